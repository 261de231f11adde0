//! A token shared within its group (see `share`): who joins the holder,
//! when nobody may, and what the group is charged.

use super::*;

/// Three programs of a group alone on the device run at once: the second
/// and third are granted the token while the first holds it, each for as
/// long as the first, and the group is charged the union of their
/// overlapping spans, not the sum.
#[test]
fn programs_of_a_group_alone_run_beside_the_holder_and_are_charged_once() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n"));
    for c in 1..=3 {
        hello(&mut p, c, "a");
    }
    let first = token(&send(&mut p, 1, acquire(), 0)).expect("granted");
    assert_eq!(granted(&send(&mut p, 2, acquire(), MS), 2), Some(first.1));
    assert_eq!(
        granted(&send(&mut p, 3, acquire(), 2 * MS), 3),
        Some(first.1)
    );
    // All three ran from 0-2 ms to 10 ms: 10 ms of the device, once.
    send(&mut p, 2, release_ran(MS, 10 * MS), 10 * MS);
    send(&mut p, 1, release_ran(0, 10 * MS), 10 * MS);
    send(&mut p, 3, release_ran(2 * MS, 10 * MS), 10 * MS);
    let st = p.status(10 * MS);
    assert_eq!(st.devices[0].token_client, None, "{st:?}");
    assert!((share_on_0(&st, "a") - 1.0).abs() < 1e-9, "{st:?}");
}

/// Nobody joins while a program of another group runs, though it has not
/// asked for the device, nor while another group used the device within
/// the window.
#[test]
fn nobody_joins_while_another_group_runs_or_used_the_device() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (c, g) in [(1, "a"), (2, "a"), (3, "b")] {
        hello(&mut p, c, g);
    }
    // b has asked for nothing yet.
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(send(&mut p, 2, acquire(), MS).is_empty());
    send(&mut p, 1, release_ran(0, 2 * MS), 2 * MS);
    // b runs, then ends; its use is in the window.
    assert!(token(&send(&mut p, 3, acquire(), 3 * MS)).is_none());
    let r = send(&mut p, 2, release_ran(2 * MS, 4 * MS), 4 * MS);
    assert!(granted(&r, 3).is_some(), "{r:?}");
    send(&mut p, 3, release_ran(4 * MS, 5 * MS), 5 * MS);
    p.handle(Event::Disconnected { client: 3 }, 5 * MS);
    assert!(token(&send(&mut p, 1, acquire(), 6 * MS)).is_some());
    assert!(send(&mut p, 2, acquire(), 7 * MS).is_empty());
    // Once b's use is older than the window, a's first program gives the
    // token to its waiting second, and joins it when it asks again.
    let later = 5 * MS + params.window;
    let r = send(&mut p, 1, release_ran(6 * MS, 7 * MS), later);
    assert!(granted(&r, 2).is_some(), "{r:?}");
    assert!(granted(&send(&mut p, 1, acquire(), later + MS), 1).is_some());
}

/// A capped or latency-critical group's programs take the token in turns,
/// as before: their share is counted on a token at a time.
#[test]
fn a_capped_or_critical_group_does_not_share_its_token() {
    for conf in ["[a]\nMaxUtil=0.5\n", "[a]\nLatency=critical\nMinUtil=0.3\n"] {
        let mut p = Policy::new(Params::default(), config(conf));
        hello(&mut p, 1, "a");
        hello(&mut p, 2, "a");
        assert!(token(&send(&mut p, 1, acquire(), 0)).is_some(), "{conf}");
        assert!(send(&mut p, 2, acquire(), MS).is_empty(), "{conf}");
    }
}

/// A group that comes while programs run beside the holder waits for all
/// of them, not for the holder alone, and nobody joins them meanwhile:
/// the holder gives its token back first, a companion holds the device,
/// and the other group gets it only once that one gave it back too.
#[test]
fn another_group_waits_for_every_companion_and_stops_new_ones() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (c, g) in [(1, "a"), (2, "a"), (3, "a")] {
        hello(&mut p, c, g);
    }
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(granted(&send(&mut p, 2, acquire(), MS), 2).is_some());
    hello(&mut p, 4, "b");
    assert!(send(&mut p, 4, acquire(), 2 * MS).is_empty());
    // b runs: a's third program no longer joins.
    assert!(send(&mut p, 3, acquire(), 3 * MS).is_empty());
    // The holder leaves the device to its companion: nobody is granted.
    let r = send(&mut p, 1, release_ran(0, 4 * MS), 4 * MS);
    assert!(token(&r).is_none(), "{r:?}");
    assert_eq!(p.status(4 * MS).devices[0].token_client, Some(2));
    // The companion gives it back: the device goes on by the policy (b,
    // which has had none of it), not to a's waiter as a companion.
    let r = send(&mut p, 2, release_ran(MS, 5 * MS), 5 * MS);
    assert!(granted(&r, 4).is_some(), "{r:?}");
    assert!(granted(&r, 3).is_none(), "{r:?}");
}

/// A companion that does not give its token back is revoked at its own
/// end, as any holder is, and a companion that dies leaves the device to
/// the others: the device passes on once the last one is gone.
#[test]
fn companions_expire_and_leave_like_holders() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[a]\n[b]\n"));
    for (c, g) in [(1, "a"), (2, "a")] {
        hello(&mut p, c, g);
    }
    let quota = token(&send(&mut p, 1, acquire(), 0)).expect("granted").1;
    assert!(granted(&send(&mut p, 2, acquire(), 5 * MS), 2).is_some());
    hello(&mut p, 3, "b");
    assert!(send(&mut p, 3, acquire(), 6 * MS).is_empty());
    // The holder dies; its companion holds on to its own end.
    p.handle(Event::Disconnected { client: 1 }, 7 * MS);
    let end = 5 * MS + quota + params.grace;
    assert_eq!(p.next_deadline(7 * MS), Some(end));
    assert!(p.handle(Event::Tick, end - 1).is_empty());
    let r = replies(p.handle(Event::Tick, end));
    assert_eq!(token(&r).map(|t| t.0), Some(3), "{r:?}");
    let revoked = p
        .counters(end)
        .iter()
        .find(|g| g.group == "a")
        .unwrap()
        .revocations;
    assert_eq!(revoked, 1);
}

/// A group's own reservation of the device keeps the others off it: its
/// programs run beside each other there as on a device it is alone on.
#[test]
fn a_groups_own_reservation_lets_its_programs_share_the_token() {
    let mut p = two_gpus("[a]\n[b]\n");
    assert_eq!(
        reserve(&mut p, 1, "a", GpuRequest::Count(1), false, 0),
        vec![(1, 1, Reply::Reserved { devices: vec![0] })]
    );
    hello(&mut p, 10, "a");
    hello(&mut p, 11, "a");
    assert!(token(&send(&mut p, 10, acquire(), MS)).is_some());
    assert!(granted(&send(&mut p, 11, acquire(), 2 * MS), 11).is_some());
}

/// A job's rank of the group, which takes its GPUs in turns with its
/// job's other ranks, does not join; while it waits nobody joins, so the
/// grants drain and the policy serves it (joining programs that kept
/// asking again once held the device for ever).
#[test]
fn a_waiting_rank_of_the_group_stops_the_joining() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "a");
    hello_job(&mut p, 3, "a", Some("j"));
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(send(&mut p, 3, acquire(), MS).is_empty());
    assert!(send(&mut p, 2, acquire(), 2 * MS).is_empty());
    // 1 gives its token back and asks again: one of the two waiting gets
    // it, and 1 does not join.
    let r = send(&mut p, 1, acquire_ran(0, 3 * MS), 3 * MS);
    let first = token(&r).map(|t| t.0).expect("granted");
    assert!(first == 2 || first == 3, "{r:?}");
    if first == 2 {
        let r = send(&mut p, 2, release_ran(3 * MS, 4 * MS), 4 * MS);
        assert!(granted(&r, 3).is_some(), "{r:?}");
    }
}

/// Programs of another user in the group do not join: where claims of
/// a group overlap, the time is the first reported's, which would move
/// one user's time into another's usage.
#[test]
fn only_the_holders_user_joins() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    for (c, uid) in [(1, 1000), (2, 1001), (3, 1000)] {
        connect_as(&mut p, c, uid);
        hello(&mut p, c, "a");
    }
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    // The other user's program waits, and stops the joining meanwhile.
    assert!(send(&mut p, 2, acquire(), MS).is_empty());
    assert!(send(&mut p, 3, acquire(), 2 * MS).is_empty());
    // The holder gives its token back: one of them gets it, not both.
    let r = send(&mut p, 1, release_ran(0, 3 * MS), 3 * MS);
    assert!(
        granted(&r, 2).is_some() != granted(&r, 3).is_some(),
        "{r:?}"
    );
    // Alone again with its user's program, the holder's user shares.
    let mut q = Policy::new(Params::default(), config("[a]\n"));
    for c in [1, 3] {
        connect_as(&mut q, c, 1000);
        hello(&mut q, c, "a");
    }
    assert!(token(&send(&mut q, 1, acquire(), 0)).is_some());
    assert!(granted(&send(&mut q, 3, acquire(), MS), 3).is_some());
}

/// A companion that runs out of its token with work queued says when the
/// work ends (`RunningOut`), as a holder does; should it come to hold the
/// device alone with another group waiting, the device passes on then,
/// not at its token's end (the notice was dropped: the other group waited
/// for the whole token and the grace).
#[test]
fn a_companions_running_out_passes_the_device_on_once_it_holds_it() {
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "a");
    assert!(token(&send(&mut p, 1, acquire(), 0)).is_some());
    assert!(granted(&send(&mut p, 2, acquire(), MS), 2).is_some());
    hello(&mut p, 3, "b");
    assert!(send(&mut p, 3, acquire(), 2 * MS).is_empty());
    let running_out = Request::RunningOut {
        device: 0,
        done_in_us: 5 * MS,
    };
    let r = send(&mut p, 2, running_out, 10 * MS);
    assert!(matches!(r.as_slice(), [(2, _, Reply::Done)]), "{r:?}");
    // The holder gives its token back: the companion holds the device,
    // and b, which has had none of it, goes first where its work ends.
    send(&mut p, 1, release_ran(0, 11 * MS), 11 * MS);
    let handover = 15 * MS - handover_lead(RTT);
    assert_eq!(p.next_deadline(11 * MS), Some(handover));
    let r = replies(p.handle(Event::Tick, handover));
    assert!(granted(&r, 3).is_some(), "{r:?}");
}
