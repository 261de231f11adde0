//! A token held by several programs of one group at once (see `share`).

use super::*;

/// Device time charged to `group` on device 0 so far (µs).
fn used(p: &Policy, group: &str, now: Micros) -> Micros {
    p.counters(now)
        .iter()
        .find(|c| c.group == group && c.device == 0)
        .map_or(0, |c| c.used_us)
}

/// `group`'s revoked tokens on device 0 so far.
fn revoked(p: &Policy, group: &str, now: Micros) -> u64 {
    p.counters(now)
        .iter()
        .find(|c| c.group == group && c.device == 0)
        .map_or(0, |c| c.revocations)
}

/// The clients granted a token in `r`.
fn granted(r: &[(ClientId, u32, Reply)]) -> Vec<ClientId> {
    r.iter()
        .filter(|(_, _, r)| matches!(r, Reply::Token { .. }))
        .map(|(c, _, _)| *c)
        .collect()
}

#[test]
fn programs_of_one_group_share_its_token_until_another_group_waits() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (id, g) in [(1, "a"), (2, "a"), (3, "b"), (4, "a")] {
        hello(&mut p, id, g);
    }
    let first = token(&send(&mut p, 1, acquire(), 0));
    assert_eq!(first, Some((1, params.base_quota, false)));
    // Another program of a is served at once, until 1's token ends.
    let second = token(&send(&mut p, 2, acquire(), MS));
    assert_eq!(second, Some((2, params.base_quota - MS, false)));
    // b waits, and from then on so does a's next program.
    assert!(send(&mut p, 3, acquire(), 2 * MS).is_empty());
    assert!(send(&mut p, 4, acquire(), 3 * MS).is_empty());
    // 1 is done: 2 still holds the token, so b still waits.
    assert!(granted(&send(&mut p, 1, release_ran(MS, 5 * MS), 6 * MS)).is_empty());
    assert_eq!(
        p.next_deadline(6 * MS),
        Some(params.base_quota + params.grace)
    );
    // 2 is done: the device goes to b, ranked before a (which used it).
    let next = send(&mut p, 2, release_ran(2 * MS, 7 * MS), 8 * MS);
    assert_eq!(granted(&next), [3], "{next:?}");
    // The time the two overlapped is charged to a once.
    assert_eq!(used(&p, "a", 8 * MS), 6 * MS);
}

#[test]
fn a_token_is_shared_beside_the_holder_waiting_but_not_when_little_is_left() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n"));
    for id in 1..=3 {
        hello(&mut p, id, "a");
    }
    hello_holder(&mut p, 9);
    assert_eq!(token(&send(&mut p, 1, acquire(), 0)).map(|t| t.0), Some(1));
    assert!(send(&mut p, 9, acquire(), 0).is_empty());
    // The holder waiting (served only when no program waits) does not
    // keep a's programs apart.
    let second = token(&send(&mut p, 2, acquire(), MS));
    assert_eq!(second, Some((2, params.base_quota - MS, false)));
    // Less than min_quota left: 3 waits for the next token.
    let late = params.base_quota - params.min_quota + 1;
    assert!(send(&mut p, 3, acquire(), late).is_empty());
    assert!(granted(&send(&mut p, 1, release_ran(MS, late), late + 1)).is_empty());
    let r = send(&mut p, 2, release_ran(2 * MS, late), late + 2);
    assert_eq!(granted(&r), [3], "{r:?}");
}

#[test]
fn a_program_sharing_a_token_that_keeps_it_past_its_end_is_revoked() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (id, g) in [(1, "a"), (2, "a"), (3, "b")] {
        hello(&mut p, id, g);
    }
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(token(&send(&mut p, 2, acquire(), MS)).is_some());
    assert!(send(&mut p, 3, acquire(), 2 * MS).is_empty());
    // 1 gives it back; 2 never does.
    assert!(granted(&send(&mut p, 1, release_ran(0, 4 * MS), 5 * MS)).is_empty());
    let expiry = params.base_quota + params.grace;
    assert_eq!(p.next_deadline(5 * MS), Some(expiry));
    assert!(p.handle(Event::Tick, expiry - 1).is_empty());
    assert_eq!(revoked(&p, "a", expiry - 1), 0);
    let r = replies(p.handle(Event::Tick, expiry));
    assert_eq!(token(&r).map(|t| t.0), Some(3), "{r:?}");
    assert_eq!(revoked(&p, "a", expiry), 1);
}

#[test]
fn a_program_sharing_a_token_that_exits_leaves_it_to_the_others() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (id, g) in [(1, "a"), (2, "a"), (3, "b")] {
        hello(&mut p, id, g);
    }
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(token(&send(&mut p, 2, acquire(), MS)).is_some());
    assert!(send(&mut p, 3, acquire(), 2 * MS).is_empty());
    // The token's first holder dies: 2 holds it on.
    assert!(replies(p.handle(Event::Disconnected { client: 1 }, 3 * MS)).is_empty());
    let r = replies(p.handle(Event::Disconnected { client: 2 }, 4 * MS));
    assert_eq!(token(&r).map(|t| t.0), Some(3), "{r:?}");
}

#[test]
fn ranks_of_a_job_do_not_share_tokens() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n"));
    hello_job(&mut p, 1, "a", Some("j"));
    hello(&mut p, 2, "a");
    hello_job(&mut p, 3, "a", Some("j"));
    assert_eq!(token(&send(&mut p, 1, acquire(), 0)).map(|t| t.0), Some(1));
    // A rank's token is its job's turn, not shared.
    assert!(send(&mut p, 2, acquire(), MS).is_empty());
    let r = send(&mut p, 1, release_ran(0, MS), 2 * MS);
    assert_eq!(granted(&r), [2], "{r:?}");
    // Nor does a rank join a program's token.
    assert!(send(&mut p, 3, acquire(), 3 * MS).is_empty());
}

#[test]
fn a_token_whose_holder_goes_quiet_stays_with_the_programs_sharing_it() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (id, g) in [(1, "a"), (2, "a"), (3, "b")] {
        hello(&mut p, id, g);
    }
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(token(&send(&mut p, 2, acquire(), MS)).is_some());
    assert!(send(&mut p, 3, acquire(), 2 * MS).is_empty());
    // 1's last work ends in 2 ms: its token ends about then, but 2 still
    // holds the device, and a is not away from it.
    let quiet = Request::Quieting {
        device: 0,
        done_in_us: 2 * MS,
    };
    send(&mut p, 1, quiet, 3 * MS);
    let end = p.next_deadline(3 * MS).expect("a deadline");
    assert!(end <= 5 * MS, "{end}");
    assert!(granted(&replies(p.handle(Event::Tick, end))).is_empty());
    assert_eq!(
        revoked(&p, "a", end),
        0,
        "an announced end is no revocation"
    );
    let r = send(&mut p, 2, release_ran(MS, 8 * MS), 8 * MS);
    assert_eq!(granted(&r), [3], "{r:?}");
}

/// Whether two of `sim`'s clients were granted tokens that overlap.
fn grants_overlap(sim: &Sim) -> bool {
    let mut all: Vec<(Micros, Micros, usize)> = Vec::new();
    for (i, c) in sim.clients.iter().enumerate() {
        all.extend(c.granted.iter().map(|&(at, q)| (at, at + q, i)));
    }
    all.sort();
    all.windows(2).any(|w| w[1].0 < w[0].1 && w[1].2 != w[0].2)
}

#[test]
fn a_lone_capped_group_sharing_its_token_keeps_its_cap() {
    let mut sim = Sim::new("[a]\nMaxUtil=0.4\n");
    for _ in 0..3 {
        sim.add("a", Demand::Saturating);
    }
    sim.run_until(20 * SEC);
    assert!(grants_overlap(&sim), "the programs shared no token");
    for start in [0, 5 * SEC, 10 * SEC] {
        let got = sim.group_share("a", start, start + 10 * SEC);
        assert!((got - 0.4).abs() <= 0.02, "window at {start}: {got}");
    }
}

#[test]
fn a_lone_group_sharing_its_token_keeps_the_device_busy() {
    let mut sim = Sim::new("[a]\n");
    for _ in 0..3 {
        sim.add("a", Demand::Kernels(700));
    }
    sim.run_until(10 * SEC);
    assert!(grants_overlap(&sim), "the programs shared no token");
    let got = sim.group_share("a", SEC, 10 * SEC);
    assert!(got >= 0.97, "{got}");
}
