//! Token hand-over, revocation, status counters and overuse.

use super::*;

#[test]
fn a_lent_token_passes_to_the_owed_group_at_its_end_without_the_borrowers_report() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n"));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    assert_eq!(token(&send(&mut p, 1, acquire(), 0)).map(|t| t.0), Some(1));
    assert!(send(&mut p, 2, acquire(), 0).is_empty());
    // hi gives the token back after 20 ms; lo gets it, not lent (hi has
    // used all the time since it became active).
    let r = send(&mut p, 1, release_ran(0, 20 * MS), 20 * MS);
    let r: Vec<_> = r.into_iter().filter(|(c, ..)| *c == 2).collect();
    assert_eq!(token(&r), Some((2, params.base_quota, false)));
    // 30 ms later hi has used 20 of 50 ms, below its MinUtil, and is away:
    // lo's next token is lent, min_quota long (hi's absences unknown).
    let r = send(&mut p, 2, acquire_ran(20 * MS, 50 * MS), 50 * MS);
    assert_eq!(token(&r), Some((2, params.min_quota, true)));
    // hi comes back and waits; at the lent token's end (`handover_lead`
    // before it, so hi's launches queue behind lo's last ones), not a
    // grace later, the device is hi's, although lo has not reported yet.
    assert!(send(&mut p, 1, acquire(), 55 * MS).is_empty());
    let end = 50 * MS + params.min_quota;
    let lead = handover_lead(RTT).min(params.min_quota / 4);
    assert!(lead > 0);
    let handover = end - lead;
    assert_eq!(p.next_deadline(55 * MS), Some(handover));
    assert!(p.handle(Event::Tick, handover - 1).is_empty());
    let r = replies(p.handle(Event::Tick, handover));
    assert_eq!(token(&r).map(|t| (t.0, t.2)), Some((1, false)));
    // lo's late report (its work ran 2 ms past the token) is charged to
    // lo and leaves hi's token alone.
    let late = params.min_quota + 2 * MS;
    assert!(send(&mut p, 2, acquire_ran(50 * MS, end + 2 * MS), end + 2 * MS).is_empty());
    let st = p.status(end + 2 * MS);
    let dev = &st.devices[0];
    assert_eq!(dev.token_client, Some(1), "{dev:?}");
    // hi's work from its first launch, at its grant, to 12 ms later
    // began behind lo's overrun: charged from its end, 10 ms less the
    // lead, once.
    let now = handover + 12 * MS;
    send(&mut p, 1, release_ran(handover, now), now);
    let st = p.status(now);
    let share = |g: &str| share_on_0(&st, g);
    // Both shares are over the device's span: from its first work, hi's
    // at 0.
    assert_eq!(st.devices[0].span_us, now);
    assert!(
        (share("hi") - (30 * MS - lead) as f64 / now as f64).abs() < 1e-9,
        "hi {}",
        share("hi")
    );
    assert!(
        (share("lo") - (30 * MS + late) as f64 / now as f64).abs() < 1e-9,
        "lo {}",
        share("lo")
    );
}

/// How early the device passes on follows the round trip the clients
/// report, not a constant: on a host of 150 µs round trips, 150 µs before
/// a lent token's end. It stays within 100-200 µs (`MIN_NS`, `MAX_NS`),
/// whatever a client reports: 50 µs counts as 100, 600 µs and none
/// reported as 200 (and a quarter of the token is the most, as always).
#[test]
fn a_lent_token_passes_on_one_reported_round_trip_before_its_end() {
    let params = Params::default();
    let handover = |rtt_us: u32| {
        let mut p = Policy::new(params, config("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n"));
        hello(&mut p, 1, "hi");
        hello(&mut p, 2, "lo");
        send(&mut p, 1, acquire_reporting(0, 0, rtt_us), 0);
        send(&mut p, 2, acquire_reporting(0, 0, rtt_us), 0);
        send(&mut p, 1, release_ran(0, 20 * MS), 20 * MS);
        let r = send(
            &mut p,
            2,
            acquire_reporting(20 * MS, 50 * MS, rtt_us),
            50 * MS,
        );
        assert_eq!(token(&r), Some((2, params.min_quota, true)));
        send(&mut p, 1, acquire_reporting(0, 0, rtt_us), 55 * MS);
        let end = 50 * MS + params.min_quota;
        end - p.next_deadline(55 * MS).expect("a hand-over is due")
    };
    use gemini_protocol::roundtrip::{MAX_NS, MIN_NS};
    assert_eq!(handover(150), 150);
    assert_eq!(handover(50), MIN_NS / 1000);
    let most = (MAX_NS / 1000).min(params.min_quota / 4);
    assert_eq!(handover(600), most);
    assert_eq!(handover(u32::MAX), most);
    assert_eq!(handover(0), most);
}

/// A lent token is renewed while its last work still runs: the hook
/// reports that work once it is done, however many tokens later. It is
/// charged to the borrower once, and not to the group that comes back
/// behind it.
#[test]
fn work_in_flight_at_a_lent_renewal_is_charged_once_to_the_borrower() {
    let params = Params::default();
    let q = params.min_quota;
    let mut p = Policy::new(params, config("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n"));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    // As above: hi works 20 ms and leaves; lo works 30 ms, then borrows.
    send(&mut p, 1, acquire(), 0);
    send(&mut p, 2, acquire(), 0);
    send(&mut p, 1, release_ran(0, 20 * MS), 20 * MS);
    let t1 = 50 * MS;
    assert_eq!(
        token(&send(&mut p, 2, acquire_ran(20 * MS, t1), t1)),
        Some((2, q, true))
    );
    // 1 ms before the lent token's end lo's queue is full: it asks again,
    // its work still running (reported once done).
    let renew = Request::AcquireToken {
        device: 0,
        ran: vec![],
        in_flight: true,
        burst_us: 0,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    let t2 = t1 + q - MS;
    assert_eq!(
        token(&send(&mut p, 2, renew.clone(), t2)),
        Some((2, q, true))
    );
    // hi comes back; lo renews ahead again and the device passes to hi
    // while lo's last millisecond still runs.
    assert!(send(&mut p, 1, acquire(), t2 + 3 * MS).is_empty());
    let t3 = t2 + q - MS;
    let r = send(&mut p, 2, renew, t3);
    let r: Vec<_> = r.into_iter().filter(|(c, ..)| *c == 1).collect();
    assert_eq!(token(&r).map(|t| (t.0, t.2)), Some((1, false)));
    // lo's work, one stretch from t1, is done a millisecond later: it
    // says so.
    let r = send(
        &mut p,
        2,
        Request::LateUsage {
            device: 0,
            ran: ran(t1, t3 + MS),
        },
        t3 + MS,
    );
    assert!(matches!(r.as_slice(), [(2, _, Reply::Done)]), "{r:?}");
    // hi's 12 ms from its grant began behind lo's last millisecond.
    let now = t3 + 12 * MS;
    send(&mut p, 1, release_ran(t3, now), now);
    let st = p.status(now);
    let share = |g: &str| share_on_0(&st, g);
    // lo: 30 ms, then its two lent tokens back to back, t1 to t3 + 1 ms.
    let lo = 30 * MS + (t3 + MS - t1);
    assert!(
        (share("lo") - lo as f64 / now as f64).abs() < 1e-9,
        "lo {} against {}",
        share("lo"),
        lo as f64 / now as f64
    );
    let hi = 20 * MS + 11 * MS;
    assert!(
        (share("hi") - hi as f64 / now as f64).abs() < 1e-9,
        "hi {} against {}",
        share("hi"),
        hi as f64 / now as f64
    );
}

/// `status` shows a device's figures over one span, from its first work
/// in the window: a group that starts long after the scheduler and uses
/// all its time shows 100 %, not a sliver of the window. Every GPU of the
/// machine is listed before any program used it, and a group that left a
/// device is no longer shown on it once a window has passed.
#[test]
fn status_counts_shares_from_the_group_start_lists_every_gpu_and_drops_rows_that_left() {
    let params = Params {
        devices: 2,
        ..Params::default()
    };
    let mut p = Policy::new(params, config("[a]\nMinUtil=0.7\n"));
    let st = p.status(SEC);
    assert_eq!(
        st.devices.iter().map(|d| d.device).collect::<Vec<_>>(),
        vec![0, 1],
        "GPUs listed before any client"
    );
    hello(&mut p, 1, "a");
    let start = 30 * SEC;
    let at = |p: &mut Policy, req: Request, now: Micros| {
        replies(p.handle(
            Event::Request {
                client: 1,
                seq: 1,
                req,
            },
            now,
        ))
    };
    let quota = match at(&mut p, acquire(), start).as_slice() {
        [(1, _, Reply::Token { quota_us, .. })] => *quota_us,
        other => panic!("{other:?}"),
    };
    let end = start + quota;
    at(&mut p, acquire_ran(start, end), end);
    let row = |st: &StatusReport| {
        st.devices[0]
            .groups
            .iter()
            .find(|r| r.group == "a")
            .cloned()
    };
    let share = row(&p.status(end)).expect("a's row").share;
    assert!((share - 1.0).abs() < 0.01, "share {share}");
    at(&mut p, release_ran(end, end + 1), end + 1);
    assert!(
        row(&p.status(end + 2)).is_some(),
        "a used the device in the window"
    );
    let later = end + params.window + 10;
    assert_eq!(row(&p.status(later)), None, "a left a window ago");
    assert_eq!(p.status(later).devices.len(), 2);
}

#[test]
fn token_not_returned_is_revoked_after_quota_and_grace() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    let acts = p.handle(
        Event::Request {
            client: 1,
            seq: 1,
            req: acquire(),
        },
        0,
    );
    assert!(matches!(
        acts.as_slice(),
        [Action::Reply {
            client: 1,
            reply: Reply::Token { .. },
            ..
        }]
    ));
    assert!(
        p.handle(
            Event::Request {
                client: 2,
                seq: 1,
                req: acquire()
            },
            1
        )
        .is_empty()
    );
    let expiry = params.base_quota + params.grace;
    assert_eq!(p.next_deadline(1), Some(expiry));
    assert!(
        p.handle(Event::Tick, expiry - 1).is_empty(),
        "revoked too early"
    );
    let revoked = |p: &Policy| {
        p.counters(expiry)
            .iter()
            .find(|c| c.group == "a")
            .map_or(0, |c| c.revocations)
    };
    assert_eq!(revoked(&p), 0);
    let acts = p.handle(Event::Tick, expiry);
    assert!(
        matches!(
            acts.as_slice(),
            [Action::Reply {
                client: 2,
                reply: Reply::Token { .. },
                ..
            }]
        ),
        "{acts:?}"
    );
    assert_eq!(revoked(&p), 1, "the revocation is counted for metrics");
    // The late report of the hog is still charged to its group.
    let late = acquire_ran(0, expiry);
    p.handle(
        Event::Request {
            client: 1,
            seq: 2,
            req: late,
        },
        expiry + 10,
    );
    let st = p.status(expiry + 10);
    let a = st.devices[0]
        .groups
        .iter()
        .find(|g| g.group == "a")
        .map(|g| g.share)
        .unwrap_or(0.0);
    assert!(a > 0.9, "a's overuse not charged: {a}");
}

#[test]
fn holder_runs_only_when_no_real_client_waits() {
    let mut sim = Sim::new("[a]\nMaxUtil=0.5\n");
    sim.add_role("", Demand::Saturating, Role::Holder);
    sim.run_until(SEC);
    let holder_alone: Micros = sim.clients[0].busy.iter().map(|&(s, e)| e - s).sum();
    assert!(holder_alone as f64 >= 0.97 * SEC as f64, "{holder_alone}");
    sim.add("a", Demand::Saturating);
    sim.run_until(11 * SEC);
    let a = sim.group_share("a", SEC, 11 * SEC);
    assert!((a - 0.5).abs() <= 0.02, "a got {a}");
    // The holder fills what a's cap leaves.
    let holder: Micros = sim.clients[0]
        .busy
        .iter()
        .map(|&(s, e)| e.min(11 * SEC).saturating_sub(s.max(SEC)))
        .sum();
    assert!(holder as f64 / (10 * SEC) as f64 >= 0.45, "{holder}");
}

#[test]
fn overuse_is_charged() {
    // a reports 3x its quota each time: it must end up with about the same
    // device time as b, not three times as much.
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    let used = take_turns(&mut p, 400, 0, |c, q| if c == 1 { 3 * q } else { q });
    let ratio = used[0] as f64 / used[1] as f64;
    assert!((0.8..1.25).contains(&ratio), "a/b = {ratio}");
}

#[test]
fn overuse_beyond_the_credit_cap_does_not_pause_an_uncapped_group() {
    // Both always report 178 ms for a 100 ms token (deep queues); with
    // MaxUtil 1, a must stay eligible, so its MinUtil 0.7 holds against b.
    let mut p = Policy::new(
        Params::default(),
        config("[a]\nMinUtil=0.7\n[b]\nMinUtil=0.3\n"),
    );
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    let used = take_turns(&mut p, 200, 100 * MS, |_, _| 178 * MS);
    let share = used[0] as f64 / (used[0] + used[1]) as f64;
    assert!((share - 0.7).abs() <= 0.02, "a got {share}");
}

/// A holder that waits for its last work and will go quiet after it
/// (`Quieting`) has its token end `handover_lead` before that work does:
/// the waiting group gets the device then, not after the holder's wait
/// returns and it reports; the report charges the holder in full, and the
/// next holder is charged from the end of that work.
#[test]
fn a_quieting_holder_passes_the_device_on_just_before_its_work_ends() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n"));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    let acquire = Request::AcquireToken {
        device: 0,
        ran: vec![],
        in_flight: false,
        burst_us: 30 * MS,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    let granted = |r: &[(ClientId, u32, Reply)], who: ClientId| {
        r.iter()
            .any(|(c, _, rep)| *c == who && matches!(rep, Reply::Token { .. }))
    };
    assert!(granted(&send(&mut p, 1, acquire.clone(), 0), 1));
    assert!(send(&mut p, 2, acquire.clone(), MS).is_empty());
    // At 1 ms hi waits for work that ends at 21 ms, and will go quiet.
    let r = send(
        &mut p,
        1,
        Request::Quieting {
            device: 0,
            done_in_us: 20 * MS,
        },
        MS,
    );
    assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
    let handover = 21 * MS - handover_lead(RTT);
    assert_eq!(p.next_deadline(2 * MS), Some(handover));
    assert!(p.handle(Event::Tick, handover - 1).is_empty());
    assert!(granted(&replies(p.handle(Event::Tick, handover)), 2));
    assert!(
        p.counters(handover).iter().all(|c| c.revocations == 0),
        "an announced end is no revocation"
    );
    // hi reports when its wait returns: 21 ms of use, all charged to hi.
    send(&mut p, 1, release_ran(0, 21 * MS), 21 * MS + 100);
    // A Quieting from a client without the token changes nothing.
    let r = send(
        &mut p,
        1,
        Request::Quieting {
            device: 0,
            done_in_us: 1,
        },
        22 * MS,
    );
    assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
    let st = p.status(22 * MS);
    assert_eq!(st.devices[0].token_client, Some(2));
    let hi = st.devices[0]
        .groups
        .iter()
        .find(|g| g.group == "hi")
        .unwrap();
    assert!((hi.share - 21.0 / 22.0).abs() < 1e-9, "{hi:?}");
}

/// Whether `group` is away from device 0 (its token passed on ahead of
/// its report, with none of its processes waiting).
fn away(p: &Policy, group: &str) -> bool {
    p.devices[&0]
        .groups
        .iter()
        .any(|(k, g)| k.name() == Some(group) && g.away_since.is_some())
}

/// A holder whose token ran out with its work still queued says when the
/// work ends (`RunningOut`): with another program waiting, its token ends
/// `handover_lead` before then, as a quieting holder's does (no
/// revocation), but its group is not away: it asks again as soon as its
/// work is done, and counts as waiting meanwhile: the token passed on is
/// cut to its holder's turn, as when both wait. A holder announcing quiet
/// is away, and the next holder's token is not cut for it.
#[test]
fn a_token_running_out_passes_the_device_on_before_its_work_ends_and_its_group_stays() {
    for quiet in [false, true] {
        let mut p = Policy::new(
            Params::default(),
            config("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n"),
        );
        hello(&mut p, 1, "hi");
        hello(&mut p, 2, "lo");
        // lo runs 50 ms first: hi, below its MinUtil, is owed the device.
        assert_eq!(token(&send(&mut p, 2, acquire(), 0)).map(|t| t.0), Some(2));
        assert!(send(&mut p, 1, acquire(), MS).is_empty());
        let long_burst = Request::AcquireToken {
            device: 0,
            ran: ran(0, 50 * MS),
            in_flight: false,
            burst_us: 200 * MS,
            rtt_us: RTT as u32,
            launch_us: 0,
        };
        let r = send(&mut p, 2, long_burst, 50 * MS);
        assert_eq!(token(&r).map(|t| t.0), Some(1), "{r:?}");
        let (device, done_in_us) = (0, 20 * MS);
        let announce = match quiet {
            true => Request::Quieting { device, done_in_us },
            false => Request::RunningOut { device, done_in_us },
        };
        let r = send(&mut p, 1, announce, 60 * MS);
        assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
        let handover = 80 * MS - handover_lead(RTT);
        assert_eq!(p.next_deadline(61 * MS), Some(handover));
        assert!(p.handle(Event::Tick, handover - 1).is_empty());
        let (who, quota, lent) = token(&replies(p.handle(Event::Tick, handover))).unwrap();
        assert_eq!(who, 2);
        assert!(!lent);
        // lo's token is cut to its turn (0.3 against 0.7 of the longest)
        // while hi counts as waiting; not while hi is away.
        let longest = Params::default().max_quota;
        match quiet {
            true => assert_eq!(quota, longest),
            false => assert_eq!(quota, longest * 3 / 7),
        }
        assert!(p.counters(handover).iter().all(|c| c.revocations == 0));
        assert_eq!(away(&p, "hi"), quiet, "quiet: {quiet}");
    }
}

/// A token running out is passed on only to a program the ranking puts
/// before its holder, were the holder asking again with the token's time
/// charged: a holder whose group is still below its `MinUtil` keeps it
/// to its end, and asks again as before. (Passed on to any program that
/// may run, the device went to an uncapped group's capped neighbour in
/// the middle of its steps, instead of between them.) Once the holder
/// has had its share, the same notice passes the device on.
#[test]
fn a_token_running_out_runs_on_where_its_group_ranks_first() {
    let mut p = hi_holds_lo_waits("[hi]\nMinUtil=0.7\n[lo]\n");
    // hi runs 10 ms and gives the token back; lo runs its 30 ms turn.
    let r = send(&mut p, 1, release_ran(0, 10 * MS), 10 * MS);
    assert_eq!(granted(&r, 2), Some(30 * MS), "{r:?}");
    assert!(send(&mut p, 1, acquire(), 11 * MS).is_empty());
    let r = send(&mut p, 2, acquire_ran(10 * MS, 40 * MS), 40 * MS);
    assert!(granted(&r, 1).is_some(), "{r:?}");
    // hi runs out at 45 ms with 5 ms of work queued: 15 ms of 45 used,
    // below its 0.7, it ranks before lo and keeps its token.
    let before = p.next_deadline(45 * MS);
    let running_out = Request::RunningOut {
        device: 0,
        done_in_us: 5 * MS,
    };
    let r = send(&mut p, 1, running_out.clone(), 45 * MS);
    assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
    assert_eq!(p.next_deadline(45 * MS), before);
    // Far on in the same token (its 100 ms not over), hi has used more
    // than 0.7 of the time (100 of 130 ms): lo goes first, and the device
    // passes on where hi said its work ends.
    let r = send(&mut p, 1, running_out, 130 * MS);
    assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
    assert_eq!(
        p.next_deadline(130 * MS),
        Some(135 * MS - handover_lead(RTT))
    );
}

/// A policy of `conf` (groups hi and lo) where client 1, of hi, holds
/// device 0's token from 0 and client 2, of lo, waits for it from 1 ms.
fn hi_holds_lo_waits(conf: &str) -> Policy {
    let mut p = Policy::new(Params::default(), config(conf));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    assert_eq!(token(&send(&mut p, 1, acquire(), 0)).map(|t| t.0), Some(1));
    assert!(send(&mut p, 2, acquire(), MS).is_empty());
    p
}

/// Device 0's groups and their use, to compare before and after.
fn groups_on_0(p: &Policy) -> String {
    format!("{:?}", p.devices[&0].groups)
}

/// A group that never ran here is ranked as the grant ranks it (nothing
/// used: first), so a token running out beside it passes on; deciding so
/// leaves the device's groups as they were (a waiter that left before
/// it was served must not leave a group that never ran behind).
#[test]
fn a_token_running_out_beside_a_new_group_passes_on_and_leaves_the_groups_alone() {
    let mut p = hi_holds_lo_waits("[hi]\n[lo]\n");
    let before = groups_on_0(&p);
    assert!(!before.contains("\"lo\""), "{before}");
    let running_out = Request::RunningOut {
        device: 0,
        done_in_us: 5 * MS,
    };
    send(&mut p, 1, running_out, 2 * MS);
    assert_eq!(p.next_deadline(2 * MS), Some(7 * MS - handover_lead(RTT)));
    assert_eq!(groups_on_0(&p), before);
}

/// A notice of an end past the token's own (up to `u64::MAX` µs away,
/// from a capped group, whose credit the ranking charges) is not taken:
/// it cuts nothing, and the ranking never looks past the token's end,
/// where every group's use would be older than the window. The device's
/// groups are as they were.
#[test]
fn a_token_running_out_past_its_end_is_not_taken() {
    let mut p = hi_holds_lo_waits("[hi]\nMaxUtil=0.5\n[lo]\n");
    let (before, deadline) = (groups_on_0(&p), p.next_deadline(2 * MS));
    for done_in_us in [u64::MAX, u64::MAX / 2, 10_000 * MS] {
        let r = send(
            &mut p,
            1,
            Request::RunningOut {
                device: 0,
                done_in_us,
            },
            2 * MS,
        );
        assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
        assert_eq!(p.next_deadline(2 * MS), deadline);
        assert_eq!(groups_on_0(&p), before);
        assert!(p.devices[&0].returning.is_none());
    }
}

/// A token running out where only `gem-holder` waits (or nobody) runs on
/// as before: passed on early, it would go to the holder, and the
/// program asking again would wait for it to be handed back. A program
/// that comes to wait later has it passed on where it was announced to
/// run out. From a client without the token, the notice changes nothing;
/// nor does a later end announced.
#[test]
fn a_token_running_out_beside_only_the_holder_runs_on() {
    let mut p = Policy::new(Params::default(), config("[hi]\n"));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "hi");
    hello_holder(&mut p, 3);
    assert_eq!(token(&send(&mut p, 1, acquire(), 0)).map(|t| t.0), Some(1));
    let before = p.next_deadline(MS);
    assert!(send(&mut p, 3, acquire(), MS).is_empty());
    let running_out = Request::RunningOut {
        device: 0,
        done_in_us: 2 * MS,
    };
    let r = send(&mut p, 1, running_out.clone(), MS);
    assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
    assert_eq!(p.next_deadline(MS), before);
    // Another program comes to wait (of the same group): the device
    // passes on where the holder said it runs out.
    let announced = Some(3 * MS - handover_lead(RTT));
    assert!(send(&mut p, 2, acquire(), 2 * MS).is_empty());
    assert_eq!(p.next_deadline(2 * MS), announced);
    send(&mut p, 2, running_out.clone(), 2 * MS);
    send(&mut p, 1, running_out, 2 * MS);
    assert_eq!(p.next_deadline(2 * MS), announced);
    assert_eq!(
        token(&replies(p.handle(Event::Tick, 3 * MS))).map(|t| t.0),
        Some(2)
    );
}

/// A token running out where the only program waiting may not run now
/// (its group in debt under its `MaxUtil`) runs on: passed on early, the
/// device would go to nobody.
#[test]
fn a_token_running_out_beside_a_group_held_back_by_its_cap_runs_on() {
    let mut p = Policy::new(Params::default(), config("[hi]\n[lo]\nMaxUtil=0.1\n"));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    assert_eq!(token(&send(&mut p, 2, acquire(), 0)).map(|t| t.0), Some(2));
    assert!(send(&mut p, 1, acquire(), MS).is_empty());
    // lo used 30 ms: at 0.1 it may run again only 300 ms on.
    let r = send(&mut p, 2, acquire_ran(0, 30 * MS), 30 * MS);
    assert_eq!(token(&r).map(|t| t.0), Some(1), "{r:?}");
    let before = p.next_deadline(31 * MS);
    let running_out = Request::RunningOut {
        device: 0,
        done_in_us: 2 * MS,
    };
    send(&mut p, 1, running_out, 31 * MS);
    assert_eq!(p.next_deadline(31 * MS), before);
}

/// A rank of a declared job whose token runs out keeps it to its end: the
/// job's turn on its devices counts on it (see `gang`).
#[test]
fn a_job_ranks_token_running_out_runs_on() {
    let mut p = Policy::new(Params::default(), config("[hi]\n[lo]\n"));
    hello_job(&mut p, 1, "hi", Some("job-1"));
    hello(&mut p, 2, "lo");
    assert_eq!(token(&send(&mut p, 1, acquire(), 0)).map(|t| t.0), Some(1));
    assert!(send(&mut p, 2, acquire(), MS).is_empty());
    let before = p.next_deadline(MS);
    let running_out = Request::RunningOut {
        device: 0,
        done_in_us: 2 * MS,
    };
    let r = send(&mut p, 1, running_out, MS);
    assert!(matches!(r.as_slice(), [(1, _, Reply::Done)]), "{r:?}");
    assert_eq!(p.next_deadline(MS), before);
}

/// A token's end did not wait for its work (it outlasted the bound, or
/// waited for another process): the work that ran on after the report
/// is charged to its group when the client reports it late, once, and
/// not to the group whose token it ran in.
#[test]
fn work_reported_late_is_charged_to_its_group_once_and_not_to_the_next_holder() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[hi]\nMinUtil=0.5\n[lo]\nMinUtil=0.5\n"));
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    control(&mut p, 3);
    // Before any token there is nothing to be late about: ignored.
    let late = |start, end| Request::LateUsage {
        device: 0,
        ran: ran(start, end),
    };
    assert_eq!(ask(&mut p, 1, late(0, 50 * MS)), Reply::Done);
    assert!(p.counters(0).is_empty(), "nothing charged");
    send(&mut p, 1, acquire(), 0);
    assert!(send(&mut p, 2, acquire(), 0).is_empty());
    // hi reports 10 ms and gives the token back, its work still running;
    // lo gets the device at once.
    let r = send(&mut p, 1, release_in_flight(0, 10 * MS), 10 * MS);
    let r: Vec<_> = r.into_iter().filter(|(c, ..)| *c == 2).collect();
    assert_eq!(token(&r).map(|t| t.0), Some(2));
    // hi's work ran on 8 ms; it says so at 18 ms. A report claiming time
    // it was charged already, or time to come, counts none of it again.
    send(&mut p, 1, late(10 * MS, 18 * MS), 18 * MS);
    send(&mut p, 1, late(0, 48 * MS), 18 * MS);
    // lo held the token from 10 to 30 ms; its kernels queued behind hi's
    // last work: charged 12 ms, not 20.
    send(&mut p, 2, release_ran(10 * MS, 30 * MS), 30 * MS);
    let counters = p.counters(30 * MS);
    let used = |g: &str| {
        counters
            .iter()
            .find(|x| x.group == g && x.device == 0)
            .map(|x| x.used_us)
    };
    assert_eq!(used("hi"), Some(18 * MS));
    assert_eq!(used("lo"), Some(12 * MS));
    // A control connection has no device time.
    assert_eq!(
        kind(&ask(
            &mut p,
            3,
            Request::LateUsage {
                device: 0,
                ran: ran(0, 1),
            }
        )),
        Some(ErrorKind::Unexpected)
    );
}

/// Where `lo` gave its token back with work in flight and was granted
/// it again before that work was seen done, over `hi`'s token whose
/// span (measured, its end seen 0.3 ms late) holds the whole wait: what
/// each group is charged, with `lo`'s wait reported as outstanding
/// (`UnprovenUsage`) or as run, before or after `hi`'s report.
fn charged_for_a_wait_behind_another_group(unproven: bool, hi_first: bool) -> (u64, u64) {
    let mut p = Policy::new(
        Params::default(),
        config("[hi]\nMinUtil=0.5\n[lo]\nMinUtil=0.5\n"),
    );
    hello(&mut p, 1, "lo");
    hello(&mut p, 2, "hi");
    send(&mut p, 1, acquire(), 0);
    assert!(send(&mut p, 2, acquire(), MS).is_empty());
    let r = send(&mut p, 1, release_in_flight(0, 10 * MS), 10 * MS);
    assert!(
        r.iter()
            .any(|(c, _, r)| *c == 2 && matches!(r, Reply::Token { .. }))
    );
    // lo's work outstanding from 10.4 ms (a launch that reached the
    // driver after hi's) until lo's next span opened at 30 ms; it ran
    // in lo's next token.
    let (wait_start, wait_end) = (10 * MS + 400, 30 * MS);
    let lo_reports = |p: &mut Policy, at| {
        if unproven {
            let r = Request::UnprovenUsage {
                device: 0,
                ran: ran(wait_start, wait_end),
            };
            assert_eq!(ask_at(p, 1, r, at), Reply::Done);
            send(p, 1, acquire(), at);
        } else {
            send(p, 1, acquire_ran(wait_start, wait_end), at);
        }
    };
    if !hi_first {
        lo_reports(&mut p, 30 * MS + 100);
    }
    send(
        &mut p,
        2,
        release_ran(10 * MS + 300, 30 * MS + 300),
        30 * MS + 300,
    );
    if hi_first {
        lo_reports(&mut p, 30 * MS + 500);
    }
    let counters = p.counters(31 * MS);
    let used = |g: &str| {
        counters
            .iter()
            .find(|x| x.group == g && x.device == 0)
            .map_or(0, |x| x.used_us)
    };
    (used("hi"), used("lo"))
}

/// Work given back in flight and seen done only after its process had
/// its token again may have waited all along behind another group's
/// token (a launch-ordered device), or run in it (a time-sliced one):
/// reported as outstanding, not run, it takes only time no measured
/// span has. Reported as run, the ledger took the other group's whole
/// token from it (its span held the wait's, its end seen late), and a
/// group whose kernels ran 1700 ms was charged 1680 ms.
#[test]
fn time_outstanding_but_not_proven_run_takes_no_other_groups_time() {
    for hi_first in [true, false] {
        assert_eq!(
            charged_for_a_wait_behind_another_group(true, hi_first),
            (20 * MS, 10 * MS),
            "hi's report first: {hi_first}"
        );
        // As run, the wait is lo's (the ledger's inner claim).
        let (hi, lo) = charged_for_a_wait_behind_another_group(false, hi_first);
        assert!(hi < MS && lo > 29 * MS, "{hi} {lo}");
    }
    // Time nobody else claimed is charged as outstanding.
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    send(&mut p, 1, acquire(), 0);
    let release = release_in_flight(0, 10 * MS);
    send(&mut p, 1, release, 10 * MS);
    let unproven = Request::UnprovenUsage {
        device: 0,
        ran: ran(12 * MS, 20 * MS),
    };
    assert_eq!(ask_at(&mut p, 1, unproven, 21 * MS), Reply::Done);
    let counters = p.counters(21 * MS);
    assert_eq!(counters[0].used_us, 18 * MS);
}

/// Unproven time is sent ahead of the report it precedes, which may
/// also hold spans older than it (kept from a report not sent): those
/// are still charged. (Had the estimate advanced what the client was
/// charged to, they were refused as reported already.)
#[test]
fn spans_older_than_unproven_time_sent_ahead_are_still_charged() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    send(&mut p, 1, acquire(), 0);
    let unproven = Request::UnprovenUsage {
        device: 0,
        ran: ran(20 * MS, 30 * MS),
    };
    assert_eq!(ask_at(&mut p, 1, unproven, 31 * MS), Reply::Done);
    // Its report: a span before it, and one that claims part of it
    // measured (not charged twice).
    let mut both = ran(12 * MS, 18 * MS);
    both.extend(ran(25 * MS, 31 * MS));
    let release = Request::ReleaseToken {
        device: 0,
        ran: both,
        in_flight: false,
    };
    send(&mut p, 1, release, 31 * MS);
    let counters = p.counters(31 * MS);
    assert_eq!(counters[0].used_us, 17 * MS);
}

/// A client gave its token back with work in flight, reported that work
/// late (`LateUsage`: done), stayed idle and exited: it is charged the
/// work it reported, not an estimate from its last grant to the grant's
/// end and the grace (the late report said nothing more runs; it was
/// charged 520 ms for 5 ms of work after 0.5 s idle).
#[test]
fn a_client_that_reported_its_late_work_is_not_charged_after_it() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n"));
    hello(&mut p, 1, "a");
    send(&mut p, 1, acquire(), 0);
    send(&mut p, 1, release_in_flight(0, 5 * MS), 5 * MS);
    send(
        &mut p,
        1,
        Request::LateUsage {
            device: 0,
            ran: ran(5 * MS, 10 * MS),
        },
        10 * MS,
    );
    let at_exit = 500 * MS;
    p.handle(Event::Disconnected { client: 1 }, at_exit);
    let used = p
        .counters(at_exit)
        .iter()
        .find(|x| x.group == "a" && x.device == 0)
        .map(|x| x.used_us);
    assert_eq!(used, Some(10 * MS), "charged past its late report");
}

/// A report of thousands of spans is charged as one span over all of
/// them: a client cannot have the ledger settle its spans one by one by
/// the thousand (a 256 KiB frame holds tens of thousands), and loses the
/// gaps between them.
#[test]
fn a_report_of_too_many_spans_is_charged_as_one() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    send(&mut p, 1, acquire(), 0);
    // 5000 spans of 1 us, 2 us apart: 5 ms of work over 10 ms.
    let ran: Vec<Span> = (0..5000)
        .map(|i| Span {
            start_us: i * 2,
            end_us: i * 2 + 1,
        })
        .collect();
    let req = Request::ReleaseToken {
        device: 0,
        ran,
        in_flight: false,
    };
    send(&mut p, 1, req, 10 * MS);
    let counters = p.counters(10 * MS);
    let used = counters.iter().find(|x| x.group == "a").map(|x| x.used_us);
    assert_eq!(used, Some(10 * MS - 1));
}

/// Two jobs spanning the same two GPUs (a rank per GPU): while one's turn
/// is open, the other's rank on the second GPU is not served there, even
/// on a free device, and the turn's own rank is served at once; once the
/// turn is over and its ranks gave their tokens back, the other job gets
/// both GPUs. (Before turns, the second GPU went to the other job as soon
/// as it was free, and each job's collective then spun beside the other
/// job's work.)
#[test]
fn a_job_spanning_gpus_holds_them_in_turns() {
    // a's ranks take GPU 0 and GPU 1: a's turn opens; b's ranks wait.
    let (mut p, quota) = two_jobs_in_a_turn();
    // a's rank on GPU 1 ends its step: GPU 1 is free, but in a's turn.
    let r = send(&mut p, 2, release(1, false, 0, 4 * MS), 5 * MS);
    assert_eq!(
        granted(&r, 4),
        None,
        "b's rank took GPU 1 in a's turn: {r:?}"
    );
    // a's rank comes back for its next step: served at once, ahead of b.
    let r = send(&mut p, 2, on(1), 6 * MS);
    assert!(granted(&r, 2).is_some(), "{r:?}");
    // The turn ends; a's ranks give their tokens back: b's turn, on both.
    let end = quota + 2 * MS;
    let mut r = send(&mut p, 1, release(0, false, 0, quota), end);
    r.extend(send(&mut p, 2, release(1, false, 6 * MS, quota), end));
    assert!(
        granted(&r, 3).is_some() && granted(&r, 4).is_some(),
        "b's ranks did not get both GPUs: {r:?}"
    );
    // In b's turn, b's rank on GPU 1 ends a step and a's asks: GPU 1
    // stays free for b's next step.
    send(&mut p, 4, release(1, false, end, end + MS), end + MS);
    let r = send(&mut p, 2, on(1), end + 2 * MS);
    assert!(r.is_empty(), "a's rank took GPU 1 in b's turn: {r:?}");
    let r = send(&mut p, 4, on(1), end + 3 * MS);
    assert!(granted(&r, 4).is_some(), "{r:?}");
}

/// A job's ranks stop together at its turn's end, between two steps: a
/// token asked for just before the end lasts to the end only (with the
/// 10 ms floor of other tokens, a rank went on stepping past it while its
/// peer had stopped, and the peer's next collective spun through the
/// stall); past the end, tokens end with the step under way
/// (`last_step`), and a rank that finished its step is not served again
/// while its peer does not need it: the turn passes as soon as both are
/// done, not after 20 ms more of steps. (`gem-bench --only nccl`: 89-90 %
/// of the un-hooked steps before, 93-94 % after.)
#[test]
fn at_its_turns_end_a_jobs_ranks_finish_the_step_under_way_and_stop() {
    let (mut p, until) = two_jobs_in_a_turn();
    // Rank 2 asks 2 ms before the turn's end: a token to the end, no more.
    send(
        &mut p,
        2,
        release(1, false, 0, until - 3 * MS),
        until - 3 * MS,
    );
    let r = send(&mut p, 2, on(1), until - 2 * MS);
    let (quota, last) = grant_of(&r, 2).unwrap_or_else(|| panic!("{r:?}"));
    assert!(quota <= 2 * MS && !last, "{quota} µs, last step {last}");
    // Past the end, rank 1's token has run out: it gets a short token
    // that ends with its step.
    send(&mut p, 1, release(0, false, 0, until), until + MS / 10);
    let r = send(&mut p, 1, on(0), until + MS / 5);
    let (quota, last) = grant_of(&r, 1).unwrap_or_else(|| panic!("{r:?}"));
    assert!(
        quota <= lent_min_quota(RTT) && last,
        "{quota} µs, last step {last}"
    );
    // So does rank 2.
    let r = send(&mut p, 2, on(1), until + MS / 2);
    assert!(grant_of(&r, 2).is_some_and(|(_, last)| last), "{r:?}");
    // Rank 1's step is done: its hook gives the token back, and its next
    // step waits (its peer finishes the same step, which needs nothing
    // from it); b does not get GPU 0 while a's rank on GPU 1 is mid-step.
    send(
        &mut p,
        1,
        release(0, false, until + MS / 5, until + MS),
        until + MS,
    );
    let r = send(&mut p, 1, on(0), until + 6 * MS / 5);
    assert_eq!(grant_of(&r, 1), None, "a began a new step: {r:?}");
    assert_eq!(grant_of(&r, 3), None, "b took GPU 0 mid-step: {r:?}");
    // Rank 2's step is done too: b's turn, on both GPUs, well within
    // what was the drain.
    let r = send(
        &mut p,
        2,
        release(1, false, until + MS / 2, until + 7 * MS / 5),
        until + 7 * MS / 5,
    );
    assert!(
        grant_of(&r, 3).is_some() && grant_of(&r, 4).is_some(),
        "b's ranks did not get both GPUs: {r:?}"
    );
    assert!(until + 7 * MS / 5 < until + gang::DRAIN);
}

/// Processes that no launcher declared ranks of a job take no turns,
/// however their work waits: two groups whose processes use both GPUs,
/// whose tokens are given back with work in flight and held past their
/// quota (a quiet process keeping a lent token to the idle threshold, a
/// long kernel on an empty queue, an idle release whose sync timed out),
/// get a GPU one of them leaves at once. (Turns were once guessed from
/// such signs: two groups of independent processes at MinUtil 0.3 / 0.7
/// then got 0.24 / 0.64 of each GPU, the gaps between one group's
/// kernels left idle.)
#[test]
fn processes_of_no_declared_job_take_no_turns_however_their_work_waits() {
    let mut p = Policy::new(
        Params::default(),
        config("[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n"),
    );
    for (id, group) in [(1, "a"), (2, "a"), (3, "b"), (4, "b")] {
        hello(&mut p, id, group);
    }
    // Work that waits beyond its token, the signs turns were guessed
    // from: a token given back with work in flight...
    for id in [3, 1] {
        assert!(granted(&send(&mut p, id, on(0), 0), id).is_some());
        send(&mut p, id, release(0, true, 0, 0), 0);
    }
    let quota = granted(&send(&mut p, 1, on(0), 0), 1).expect("GPU 0");
    assert!(granted(&send(&mut p, 2, on(1), 0), 2).is_some());
    assert!(send(&mut p, 3, on(0), MS).is_empty());
    assert!(send(&mut p, 4, on(1), MS).is_empty());
    // ...and a token held well past its quota.
    let late = quota + 10 * MS;
    let r = send(&mut p, 2, release(1, false, 0, late), late);
    assert!(
        granted(&r, 4).is_some(),
        "b's process waited for a turn on GPU 1: {r:?}"
    );
}

/// A job owed time (its group below its `MinUtil`) waits for another
/// job's turn, but no longer than the turn and the step its ranks are in
/// when it ends: well within the 200 ms a group owed time may wait.
/// (Served at once instead, its ranks and the turn's interleaved on both
/// GPUs, and two such jobs made half their steps: gem-bench --only nccl.)
#[test]
fn a_job_owed_time_waits_at_most_a_turn_and_its_step() {
    let (mut p, until) = two_jobs_in_a_turn();
    // b (MinUtil 0.5, nothing had yet) asked at 1 ms. a's ranks step on
    // until the turn's end, then finish their steps.
    let step = 5 * MS;
    let mut t = 5 * MS;
    let mut since = [0, 0];
    let served = loop {
        assert!(t < 400 * MS, "b was never served");
        let mut r = Vec::new();
        for (i, (id, dev)) in [(1, 0), (2, 1)].into_iter().enumerate() {
            r.extend(send(&mut p, id, release(dev, false, since[i], t), t));
            r.extend(send(&mut p, id, on(dev), t + MS / 10));
            since[i] = t + MS / 10;
        }
        if granted(&r, 3).is_some() || granted(&r, 4).is_some() {
            break t;
        }
        t += step;
    };
    assert!(
        served <= until + gang::DRAIN && served - MS <= 200 * MS,
        "b waited {} ms (a's turn ended at {} ms)",
        (served - MS) / MS,
        until / MS
    );
}

/// Declared ranks of one job on two GPUs beside another client take
/// turns; a process that says it made an NCCL communicator is a rank too.
#[test]
fn a_job_is_declared_at_hello_or_by_its_nccl_communicator() {
    let (mut p, _) = two_jobs_in_a_turn();
    // b's rank on GPU 1 waits in a's turn (checked in the tests above);
    // a process of a third group on GPU 0 that declares b's job later is
    // one of b's ranks from then on.
    hello(&mut p, 5, "b");
    let r = send(
        &mut p,
        5,
        Request::Job {
            job: "gemini:b".into(),
        },
        MS,
    );
    assert!(matches!(r.as_slice(), [(5, _, Reply::Done)]), "{r:?}");
    assert!(
        send(&mut p, 5, on(0), 2 * MS).is_empty(),
        "b's new rank ran in a's turn"
    );
    // A control connection is no rank.
    control(&mut p, 9);
    let r = send(&mut p, 9, Request::Job { job: "x".into() }, 3 * MS);
    assert_eq!(kind(&r[0].2), Some(ErrorKind::Unexpected), "{r:?}");
}

/// Two 2-GPU jobs in turns: a (clients 1 on GPU 0, 2 on GPU 1) holds the
/// turn, b (3, 4) waits on both. Returns the policy and the end of a's
/// turn (µs).
fn two_jobs_in_a_turn() -> (Policy, Micros) {
    two_jobs_named_in_a_turn(|group| format!("gemini:{group}"))
}

/// [`two_jobs_in_a_turn`], each group's job named `name(group)`.
fn two_jobs_named_in_a_turn(name: impl Fn(&str) -> String) -> (Policy, Micros) {
    let mut p = Policy::new(
        Params::default(),
        config("[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n"),
    );
    // Each group's two processes are the ranks of a job, as their
    // launcher declares.
    for (id, group) in [(1, "a"), (2, "a"), (3, "b"), (4, "b")] {
        hello_job(&mut p, id, group, Some(&name(group)));
    }
    let quota = granted(&send(&mut p, 1, on(0), 0), 1).expect("a's rank on GPU 0");
    assert!(granted(&send(&mut p, 2, on(1), 0), 2).is_some());
    assert!(send(&mut p, 3, on(0), MS).is_empty());
    assert!(send(&mut p, 4, on(1), MS).is_empty());
    (p, quota)
}

fn on(device: DeviceId) -> Request {
    Request::AcquireToken {
        device,
        ran: vec![],
        in_flight: false,
        burst_us: 0,
        rtt_us: RTT as u32,
        launch_us: 0,
    }
}

/// Gives the token of `device` back, its work having run from `start` to
/// `end`.
fn release(device: DeviceId, in_flight: bool, start: Micros, end: Micros) -> Request {
    Request::ReleaseToken {
        device,
        ran: ran(start, end),
        in_flight,
    }
}

/// `who`'s grant in `r`: its quota and whether it ends with the step.
fn grant_of(r: &[(ClientId, u32, Reply)], who: ClientId) -> Option<(Micros, bool)> {
    r.iter().find_map(|(c, _, reply)| match reply {
        Reply::Token {
            quota_us,
            last_step,
            ..
        } if *c == who => Some((*quota_us, *last_step)),
        _ => None,
    })
}

#[test]
fn a_job_whose_collective_waits_for_its_peer_keeps_its_turn_until_the_peer_catches_up() {
    let (mut p, until) = two_jobs_in_a_turn();
    // Well past the turn and its drain: a's rank on GPU 0 launched its
    // collective and gave its token back with the collective still
    // running (it waits for the rank on GPU 1, which has not launched
    // its own yet).
    let t = until + gang::DRAIN + 5 * MS;
    let r = send(&mut p, 1, release(0, true, 0, until), t);
    assert_eq!(
        granted(&r, 3),
        None,
        "b took GPU 0 while a's collective waits there: {r:?}"
    );
    // The rank on GPU 1 ends its token and asks again to launch its
    // collective: it catches up, ahead of b, with a short token.
    let r = send(&mut p, 2, release(1, false, 0, until), t + MS);
    assert_eq!(granted(&r, 4), None, "b took GPU 1 mid-step: {r:?}");
    let r = send(&mut p, 2, on(1), t + 2 * MS);
    let quota = granted(&r, 2).unwrap_or_else(|| panic!("a's rank did not catch up: {r:?}"));
    assert!(
        quota <= lent_min_quota(RTT),
        "a catch-up token of {quota} µs"
    );
    // The collective meets: its late time is reported, the rank on GPU 1
    // ends its token, and the turn passes to b on both GPUs.
    send(
        &mut p,
        1,
        Request::LateUsage {
            device: 0,
            ran: ran(t + MS, t + 3 * MS),
        },
        t + 3 * MS,
    );
    let r = send(
        &mut p,
        2,
        release(1, false, t + 2 * MS, t + 3 * MS),
        t + 3 * MS,
    );
    assert!(
        granted(&r, 3).is_some() && granted(&r, 4).is_some(),
        "b's ranks did not get both GPUs once a's step was done: {r:?}"
    );
}

#[test]
fn past_its_drain_a_job_begins_no_new_step_and_the_turn_passes_once_its_tokens_end() {
    let (mut p, until) = two_jobs_in_a_turn();
    let drained = until + gang::DRAIN;
    // In the drain, a's rank on GPU 1 takes a short token to finish its
    // step.
    send(&mut p, 2, release(1, false, 0, until), drained - MS);
    let r = send(&mut p, 2, on(1), drained - MS / 2);
    assert!(granted(&r, 2).is_some(), "{r:?}");
    // Past the drain, a's rank on GPU 0 ends its step (nothing in flight)
    // and asks for the next one while that token still runs.
    send(&mut p, 1, release(0, false, 0, until), drained + MS / 10);
    let r = send(&mut p, 1, on(0), drained + MS / 5);
    assert_eq!(
        granted(&r, 1),
        None,
        "a began a new step past its turn: {r:?}"
    );
    assert_eq!(
        granted(&r, 3),
        None,
        "b took GPU 0 while a's rank on GPU 1 finishes its step: {r:?}"
    );
    // Once that token ends, b's turn opens on both GPUs.
    let r = send(
        &mut p,
        2,
        release(1, false, drained - MS / 2, drained + 2 * MS / 5),
        drained + 2 * MS / 5,
    );
    assert!(
        granted(&r, 3).is_some() && granted(&r, 4).is_some(),
        "b's ranks did not get both GPUs: {r:?}"
    );
}

#[test]
fn past_its_drain_a_rank_catches_up_with_a_peer_holding_its_token_past_its_quota() {
    let (mut p, until) = two_jobs_in_a_turn();
    let t = until + gang::DRAIN + 5 * MS;
    // a's rank on GPU 1 still holds the token it got at 0, long run out:
    // its collective may be waiting for the rank on GPU 0 (the hook has
    // not found it stalled yet). That rank asks to launch its own: it is
    // served, ahead of b.
    send(&mut p, 1, release(0, false, 0, until), t);
    let r = send(&mut p, 1, on(0), t + MS);
    let quota = granted(&r, 1).unwrap_or_else(|| panic!("a's rank did not catch up: {r:?}"));
    assert!(
        quota <= lent_min_quota(RTT),
        "a catch-up token of {quota} µs"
    );
}

#[test]
fn a_collective_whose_peer_never_comes_holds_the_turn_at_most_drain_max() {
    let (mut p, until) = two_jobs_in_a_turn();
    let t = until + gang::DRAIN + 5 * MS;
    send(&mut p, 1, release(0, true, 0, until), t);
    let r = send(&mut p, 2, release(1, false, 0, until), t + MS);
    assert_eq!(granted(&r, 4), None, "b took GPU 1 mid-step: {r:?}");
    // a's rank on GPU 1 never asks again (it died, or waits on something
    // else): past DRAIN_MAX the turn is over all the same, and the
    // daemon wakes then to pass it on.
    let wake = p.next_deadline(t + MS);
    assert!(
        wake.is_some_and(|w| w <= until + gang::DRAIN_MAX),
        "next wake-up {wake:?}, the turn's hard end {}",
        until + gang::DRAIN_MAX
    );
    let r = replies(p.handle(Event::Tick, until + gang::DRAIN_MAX - MS));
    assert!(r.is_empty(), "the turn ended before DRAIN_MAX: {r:?}");
    let r = replies(p.handle(Event::Tick, until + gang::DRAIN_MAX + MS));
    assert!(
        granted(&r, 3).is_some() && granted(&r, 4).is_some(),
        "b's ranks still wait past DRAIN_MAX: {r:?}"
    );
}

/// Two groups whose launchers named their jobs alike (`GEMINI_JOB=train`
/// in both) ran as one job: the other group's ranks were served in the
/// first one's turn, both ahead of every other waiter. A job is its name
/// within its group and user.
#[test]
fn jobs_of_two_groups_named_alike_are_two_jobs() {
    let (mut p, until) = two_jobs_named_in_a_turn(|_| "train".into());
    let t = until + gang::DRAIN + 5 * MS;
    let r = send(&mut p, 1, release(0, true, 0, until), t);
    assert_eq!(granted(&r, 3), None, "b ran in a's turn: {r:?}");
    let st = p.status(t);
    assert!(
        st.clients.iter().all(|c| c.job.as_deref() == Some("train")),
        "the status shows the name as declared: {:?}",
        st.clients
    );
}

/// A group spanning devices with no other group connected takes no
/// turns: past what would be its turn and drain, it is served at once
/// with a full token (one process launching on two GPUs at once, under
/// turns, got half its capped share).
#[test]
fn a_job_alone_takes_no_turns() {
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\n"));
    hello_job(&mut p, 1, "a", Some("gemini:a"));
    let quota = granted(&send(&mut p, 1, on(0), 0), 1).expect("GPU 0");
    assert!(granted(&send(&mut p, 1, on(1), 0), 1).is_some());
    let t = quota + gang::DRAIN + 5 * MS;
    send(&mut p, 1, release(0, false, 0, quota), t);
    let r = send(&mut p, 1, on(0), t + MS);
    let again = granted(&r, 1).unwrap_or_else(|| panic!("a waited alone: {r:?}"));
    assert!(
        again > lent_min_quota(RTT),
        "a got a {again} µs token alone"
    );
}

/// A token asked for ahead of a process's return is served where that
/// makes nobody wait: on a free device, for a latency-critical group, or
/// for a process of short bursts (a decode step, whose round trip at its
/// launch is a large part of it). Otherwise, where another group holds
/// the device (or waits for it), it is declined at once and the process
/// asks when it launches: queued ahead, it ended the other group's lent
/// tokens for a process that was not launching, and two groups with 20 ms
/// steps and CPU gaps between them fell into step with each other, both
/// quiet at once (the device 91 % busy instead of 98 %, the 0.7 group
/// short of its share by 4.7 pp).
#[test]
fn a_token_asked_ahead_is_declined_where_another_group_has_the_device() {
    let mut p = Policy::new(
        Params::default(),
        config("[hi]\nMinUtil=0.6\n[lo]\nMinUtil=0.2\n[fast]\nLatency=critical\n"),
    );
    hello(&mut p, 1, "hi");
    hello(&mut p, 2, "lo");
    hello(&mut p, 3, "fast");
    hello(&mut p, 4, "lo");
    let ahead = |burst_us| Request::AcquireTokenAhead {
        device: 0,
        burst_us,
        rtt_us: RTT as u32,
        launch_in_us: 0,
    };
    // A free device: granted.
    let r = send(&mut p, 1, ahead(20 * MS), 0);
    assert_eq!(token(&r).map(|t| t.0), Some(1), "{r:?}");
    // A 20 ms step asked ahead while hi holds it: declined, nothing queued.
    let r = send(&mut p, 2, ahead(20 * MS), MS);
    assert!(matches!(r.as_slice(), [(2, _, Reply::Done)]), "{r:?}");
    assert_eq!(p.status(MS).devices[0].waiting, 0);
    // A 1 ms step's is queued as an ordinary request.
    assert!(send(&mut p, 4, ahead(MS), MS).is_empty());
    assert_eq!(p.status(MS).devices[0].waiting, 1);
    // So is the critical group's, whatever its bursts, and it is served
    // first (within its room of 0.2) when hi gives the device back.
    assert!(send(&mut p, 3, ahead(20 * MS), 2 * MS).is_empty());
    let r = send(&mut p, 1, release_ran(0, 2 * MS), 3 * MS);
    let granted: Vec<ClientId> = r
        .iter()
        .filter(|(_, _, rep)| matches!(rep, Reply::Token { .. }))
        .map(|(c, ..)| *c)
        .collect();
    assert_eq!(granted, [3], "{r:?}");
    // A control connection takes no tokens.
    control(&mut p, 9);
    let r = send(&mut p, 9, ahead(MS), 4 * MS);
    assert_eq!(r.len(), 1);
    assert_eq!(kind(&r[0].2), Some(ErrorKind::Unexpected), "{r:?}");
}

/// The groups' shares on a device are over the device's one span, so
/// they add up to at most its busy share (never over 100 %), even where
/// one group started long after the other.
#[test]
fn status_shares_of_a_device_add_up_to_at_most_its_busy_share() {
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    // a alone from 0 to 4 s, then a and b in turns of 50 ms to 6 s.
    let mut now = 0;
    let mut last: [Option<Micros>; 3] = [None; 3];
    while now < 6 * SEC {
        let client = if now < 4 * SEC || (now / (50 * MS)).is_multiple_of(2) {
            1
        } else {
            2
        };
        let req = match last[client as usize] {
            Some(from) => acquire_ran(from, now),
            None => acquire(),
        };
        send(&mut p, client, req, now);
        last[client as usize] = Some(now);
        now += 50 * MS;
        // The token is given back with its work at the turn's end.
        send(&mut p, client, release_ran(now - 50 * MS, now), now);
        last[client as usize] = None;
    }
    let st = p.status(now);
    let d = &st.devices[0];
    let sum: f64 = d.groups.iter().map(|g| g.share).sum();
    assert!(share_on_0(&st, "b") > 0.0, "{d:?}");
    assert!(sum <= d.busy + 1e-9 && d.busy <= 1.0 + 1e-9, "{d:?}");
    assert!(sum > 0.9, "{d:?}");
}

/// `status` says which waiting group is short of its `MinUtil` as the
/// scheduler weighs it (since the group became active), not by its share
/// of the device's span: a group that has just come is short, one without
/// a minimum never is.
#[test]
fn status_says_which_waiting_group_is_short_of_its_minimum() {
    let mut p = Policy::new(Params::default(), config("[a]\nMinUtil=0.5\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    let mut now = 0;
    while now < 4 * SEC {
        send(&mut p, 2, acquire(), now);
        now += 50 * MS;
        send(&mut p, 2, release_ran(now - 50 * MS, now), now);
    }
    // b holds the GPU; a and another of b's wait.
    assert!(token(&send(&mut p, 2, acquire(), now)).is_some());
    assert!(send(&mut p, 1, acquire(), now + 1).is_empty());
    hello(&mut p, 3, "b");
    assert!(send(&mut p, 3, acquire(), now + 2).is_empty());
    let st = p.status(now + 3);
    let row = |g: &str| {
        st.devices[0]
            .groups
            .iter()
            .find(|r| r.group == g)
            .cloned()
            .unwrap_or_else(|| panic!("no row {g}: {st:?}"))
    };
    assert!(row("a").short_of_min, "{st:?}");
    assert!(!row("b").short_of_min, "{st:?}");
}

/// `client` of `group` says hello at `now` holding 1 MiB on device 0, as a
/// process does to a scheduler that restarted under it.
fn hello_holding(p: &mut Policy, client: ClientId, group: &str, now: Micros) {
    let back = Request::Hello {
        role: Role::Client,
        group: group.into(),
        pid: client as u32,
        held: vec![HeldMemory {
            device: 0,
            bytes: 1 << 20,
        }],
        job: None,
        build: gemini_protocol::BUILD.into(),
    };
    assert!(matches!(
        send(p, client, back, now)[..],
        [(c, _, Reply::Welcome { .. })] if c == client
    ));
}

/// A process that holds memory when it says hello ran under a previous
/// scheduler: this one restarted (or was upgraded) under it. What it
/// reports having run after this scheduler started and before its first
/// token here ran under the token the previous one granted, and is
/// charged to its group (it used to be clipped, so a capped group ran up
/// to a token uncharged after every restart). A process that held nothing
/// cannot have run here before its first token: the same report is
/// clipped.
#[test]
fn work_under_the_previous_schedulers_token_is_charged_after_a_restart() {
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\n"));
    hello_holding(&mut p, 1, "a", 50 * MS);
    hello(&mut p, 2, "b");
    send(&mut p, 1, acquire_ran(10 * MS, 30 * MS), 50 * MS);
    send(&mut p, 2, acquire_ran(32 * MS, 48 * MS), 50 * MS);
    let used = |p: &Policy, group: &str| {
        p.counters(50 * MS)
            .iter()
            .find(|c| c.group == group && c.device == 0)
            .map_or(0, |c| c.used_us)
    };
    assert_eq!(used(&p, "a"), 20 * MS);
    assert_eq!(used(&p, "b"), 0);
    // Only the first report: the next one is held to its token as ever.
    send(&mut p, 1, release_ran(5 * MS, 9 * MS), 60 * MS);
    assert_eq!(used(&p, "a"), 20 * MS);
}

/// The same, where the first report says work is still in flight (a
/// renewal with work queued): the rest of the previous scheduler's token,
/// reported after this one's grant, is charged too, not clipped as before
/// that grant.
#[test]
fn the_rest_of_the_previous_schedulers_token_is_charged_after_a_restart() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello_holding(&mut p, 1, "a", 50 * MS);
    let renew = Request::AcquireToken {
        device: 0,
        ran: ran(10 * MS, 20 * MS),
        in_flight: true,
        burst_us: 0,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    assert!(token(&send(&mut p, 1, renew, 50 * MS)).is_some());
    send(&mut p, 1, release_ran(20 * MS, 45 * MS), 60 * MS);
    let used = p
        .counters(60 * MS)
        .iter()
        .find(|c| c.group == "a" && c.device == 0)
        .map_or(0, |c| c.used_us);
    assert_eq!(used, 35 * MS);
}
