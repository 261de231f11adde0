//! GPU reservations of gem-launch and their queue.

use super::*;

#[test]
fn launches_get_different_gpus_and_a_third_waits_its_turn() {
    let mut p = two_gpus("[a]\n");
    assert_eq!(
        reserve(&mut p, 1, "a", GpuRequest::Count(1), true, 0),
        vec![(1, 1, Reply::Reserved { devices: vec![0] })]
    );
    assert_eq!(
        reserve(&mut p, 2, "a", GpuRequest::Count(1), true, 0),
        vec![(2, 1, Reply::Reserved { devices: vec![1] })]
    );
    assert!(
        reserve(&mut p, 3, "a", GpuRequest::Count(1), true, 0).is_empty(),
        "third waits"
    );
    let r = reserve(&mut p, 4, "a", GpuRequest::Count(1), false, 0);
    assert_eq!(
        kind(&r[0].2),
        Some(ErrorKind::Unavailable),
        "nonblock fails at once"
    );
    let st = p.status(1);
    assert_eq!((st.reservations.len(), st.queue.len()), (2, 1));
    // The first program exits: the third gets its GPU.
    let r = replies(p.handle(Event::Disconnected { client: 1 }, 10));
    assert_eq!(r, vec![(3, 1, Reply::Reserved { devices: vec![0] })]);
}

#[test]
fn least_recently_released_gpu_is_chosen_first() {
    let mut p = two_gpus("[a]\n");
    reserve(&mut p, 1, "a", GpuRequest::Count(1), true, 0);
    reserve(&mut p, 2, "a", GpuRequest::Count(1), true, 0);
    p.handle(Event::Disconnected { client: 2 }, 10); // device 1 released at 10
    p.handle(Event::Disconnected { client: 1 }, 20); // device 0 released at 20
    assert_eq!(
        reserve(&mut p, 3, "a", GpuRequest::Count(1), true, 30),
        vec![(3, 1, Reply::Reserved { devices: vec![1] })]
    );
    assert_eq!(
        reserve(&mut p, 4, "a", GpuRequest::Count(1), true, 30),
        vec![(4, 1, Reply::Reserved { devices: vec![0] })]
    );
}

#[test]
fn groups_with_guarantees_share_a_gpu_up_to_their_minimums() {
    let mut p = Policy::new(
        Params {
            devices: 1,
            ..Params::default()
        },
        config("[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n[c]\n"),
    );
    assert!(matches!(
        reserve(&mut p, 1, "a", GpuRequest::Count(1), true, 0)[0].2,
        Reply::Reserved { .. }
    ));
    assert!(matches!(
        reserve(&mut p, 2, "b", GpuRequest::Count(1), true, 0)[0].2,
        Reply::Reserved { .. }
    ));
    assert!(
        reserve(&mut p, 3, "a", GpuRequest::Count(1), true, 0).is_empty(),
        "the minimums add up to 1"
    );
    // A group without a minimum claims a whole device.
    let mut p = Policy::new(
        Params {
            devices: 1,
            ..Params::default()
        },
        config("[a]\nMinUtil=0.5\n[c]\n"),
    );
    reserve(&mut p, 1, "a", GpuRequest::Count(1), true, 0);
    assert_eq!(
        kind(&reserve(&mut p, 2, "c", GpuRequest::Count(1), false, 0)[0].2),
        Some(ErrorKind::Unavailable)
    );
}

#[test]
fn queue_is_first_come_first_served_and_bad_requests_are_refused() {
    let mut p = two_gpus("[a]\n");
    reserve(&mut p, 1, "a", GpuRequest::Ids(vec![1]), true, 0);
    assert!(reserve(&mut p, 2, "a", GpuRequest::Count(2), true, 0).is_empty());
    // Device 0 is free, but the launch waiting for two is first in line.
    assert!(reserve(&mut p, 3, "a", GpuRequest::Count(1), true, 0).is_empty());
    let r = replies(p.handle(Event::Disconnected { client: 1 }, 5));
    assert_eq!(
        r,
        vec![(
            2,
            1,
            Reply::Reserved {
                devices: vec![0, 1]
            }
        )]
    );
    for (gpus, what) in [
        (GpuRequest::Count(3), "has 2"),
        (GpuRequest::Count(0), "has 2"),
        (GpuRequest::Ids(vec![2]), "does not exist"),
        (GpuRequest::Ids(vec![0, 0]), "repeat"),
    ] {
        let r = reserve(&mut p, 9, "a", gpus, true, 10);
        match &r[0].2 {
            Reply::Error(e) => assert!(
                e.kind == ErrorKind::BadRequest && e.message.contains(what),
                "{e:?}"
            ),
            other => panic!("{other:?}"),
        }
        p.handle(Event::Disconnected { client: 9 }, 10);
    }
    let r = reserve(&mut p, 10, "nosuch", GpuRequest::Count(1), true, 10);
    assert_eq!(kind(&r[0].2), Some(ErrorKind::UnknownGroup));
    let mut none = Policy::new(Params::default(), config("[a]\n"));
    let r = reserve(&mut none, 1, "a", GpuRequest::Count(1), true, 0);
    match &r[0].2 {
        Reply::Error(e) => assert!(e.message.contains("knows no GPUs"), "{e:?}"),
        other => panic!("{other:?}"),
    }
}

/// The time a group's client waits while its MaxUtil holds it back is
/// counted (for `gemini_group_throttled_seconds_total`); waiting behind
/// another group's token is not.
#[test]
fn time_held_back_by_max_util_is_counted() {
    let params = Params::default();
    let mut p = Policy::new(params, config("[capped]\nMaxUtil=0.25\n[b]\n"));
    hello(&mut p, 1, "capped");
    hello(&mut p, 2, "b");
    let acquire = |start, end| Request::AcquireToken {
        device: 0,
        ran: ran(start, end),
        in_flight: false,
        burst_us: 20 * MS,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    let ev = |client, seq, req| Event::Request { client, seq, req };
    assert!(!p.handle(ev(1, 1, acquire(0, 0)), 0).is_empty());
    // b waits behind capped's token: not throttled.
    assert!(p.handle(ev(2, 1, acquire(0, 0)), MS).is_empty());
    // capped used 20 ms at 0.25: it may go again only after 60 ms more.
    p.handle(ev(1, 2, acquire(0, 20 * MS)), 20 * MS);
    let throttled = |p: &Policy, now| {
        p.counters(now)
            .iter()
            .filter(|c| c.device == 0)
            .map(|c| (c.group.clone(), c.throttled_us))
            .collect::<Vec<_>>()
    };
    // b got the token; capped waits, held back by its cap.
    let t = throttled(&p, 30 * MS);
    assert!(t.contains(&("capped".to_string(), 10 * MS)), "{t:?}");
    assert!(t.contains(&("b".to_string(), 0)), "{t:?}");
    // b gives the token back at 40 ms; capped becomes eligible at 80 ms
    // and is granted then: 60 ms held back in all.
    p.handle(
        Event::Request {
            client: 2,
            seq: 2,
            req: release_ran(20 * MS, 40 * MS),
        },
        40 * MS,
    );
    let at = p.next_deadline(40 * MS).unwrap();
    p.handle(Event::Tick, at);
    let t = throttled(&p, at + 50 * MS);
    assert!(
        t.contains(&("capped".to_string(), at - 20 * MS)),
        "{t:?} (eligible at {at})"
    );
}

/// A peer named by the kernel, for `Event::Connected`.
fn peer_of(uid: u32, user: &str) -> crate::policy::Peer {
    crate::policy::Peer {
        uid,
        pid: 1,
        user: user.into(),
        groups: Vec::new(),
        cgroups: Vec::new(),
    }
}

fn reserve_for(
    p: &mut Policy,
    client: ClientId,
    uid: u32,
    gpus: GpuRequest,
    duration_us: Micros,
    now: Micros,
) -> Vec<(ClientId, u32, Reply)> {
    p.handle(
        Event::Connected {
            client,
            peer: peer_of(uid, &format!("user{uid}")),
        },
        now,
    );
    control(p, client);
    replies(p.handle(
        Event::Request {
            client,
            seq: 1,
            req: Request::ReserveFor {
                group: "a".into(),
                gpus,
                duration_us,
                wait: true,
            },
        },
        now,
    ))
}

/// `gem-launch reserve --duration`: GPUs held for a user without a
/// program, past the connection that asked, listed with the user and the
/// time left, until they expire by themselves (and the queue moves on)
/// or their user releases them early; another user may not.
#[test]
fn a_reservation_without_a_program_expires_or_is_released_by_its_user() {
    const H: Micros = 3_600_000_000;
    // Site limits that let one user hold both GPUs for 8 h.
    let mut p = Policy::new(
        Params {
            devices: 2,
            reserve_max_gpus: Some(2),
            reserve_max_duration: 8 * H,
            ..Params::default()
        },
        config("[a]\n"),
    );
    assert_eq!(
        reserve_for(&mut p, 1, 1000, GpuRequest::Count(1), 4 * H, 0),
        vec![(1, 1, Reply::Reserved { devices: vec![0] })]
    );
    // The connection that asked goes; the reservation stays.
    p.handle(Event::Disconnected { client: 1 }, 10);
    let st = p.status(H);
    assert_eq!(st.reservations.len(), 1);
    let m = st.reservations[0]
        .manual
        .clone()
        .expect("made without a program");
    assert_eq!((m.user.as_str(), m.left_us), ("user1000", 3 * H));
    assert_eq!(p.next_deadline(H), Some(4 * H), "its expiry is a deadline");
    // A second one takes GPU 1; a third waits for one to end.
    reserve_for(&mut p, 2, 1000, GpuRequest::Count(1), 8 * H, H);
    assert!(reserve_for(&mut p, 3, 2000, GpuRequest::Count(1), 2 * H, H).is_empty());
    // Another user may not release them.
    let release = |p: &mut Policy, client, devices: Vec<DeviceId>, now| {
        replies(p.handle(
            Event::Request {
                client,
                seq: 2,
                req: Request::ReleaseReserved { devices },
            },
            now,
        ))
    };
    assert_eq!(
        release(&mut p, 3, vec![], 2 * H),
        vec![(3, 2, Reply::Released { devices: vec![] })]
    );
    // The first expires at 4 h: the waiting one gets GPU 0 then.
    assert!(replies(p.handle(Event::Tick, 4 * H - 1)).is_empty());
    assert_eq!(
        replies(p.handle(Event::Tick, 4 * H)),
        vec![(3, 1, Reply::Reserved { devices: vec![0] })]
    );
    // Its user releases GPU 1 early (connected again, as another client).
    p.handle(
        Event::Connected {
            client: 4,
            peer: peer_of(1000, "user1000"),
        },
        5 * H,
    );
    control(&mut p, 4);
    assert_eq!(
        release(&mut p, 4, vec![1], 5 * H),
        vec![(4, 2, Reply::Released { devices: vec![1] })]
    );
    let st = p.status(5 * H);
    assert_eq!(st.reservations.len(), 1, "user2000's on GPU 0 is left");
    assert_eq!(st.reservations[0].devices, vec![0]);
    // Lengths out of range are refused.
    for bad in [0, 31 * 24 * H] {
        let r = reserve_for(&mut p, 5, 1000, GpuRequest::Count(1), bad, 5 * H);
        assert_eq!(kind(&r[0].2), Some(ErrorKind::BadRequest), "{bad}");
    }
}

/// Any user could reserve every GPU of a group with no access list for
/// 30 days, and every other group's processes then ran no kernel. A user
/// (root and the daemon's user aside) now holds at most
/// `reserve_max_gpus` GPUs reserved at once (by default half the
/// machine's), counting its launches, its reservations without a program
/// and its place in the queue, for at most `reserve_max_duration` (by
/// default a day); each refusal names the limit.
#[test]
fn one_user_cannot_reserve_every_gpu_for_a_month() {
    const H: Micros = 3_600_000_000;
    let mut p = Policy::new(
        Params {
            devices: 4,
            admin_uid: 7,
            ..Params::default()
        },
        config("[a]\n"),
    );
    let why = |r: &[(ClientId, u32, Reply)]| match &r[0].2 {
        Reply::Error(e) if e.kind == ErrorKind::PermissionDenied => e.message.clone(),
        other => panic!("{other:?}"),
    };
    let r = reserve_for(&mut p, 1, 1000, GpuRequest::Count(4), 30 * 24 * H, 0);
    assert!(
        why(&r).contains("reserve_max_duration in gemini.toml"),
        "{r:?}"
    );
    let r = reserve_for(&mut p, 2, 1000, GpuRequest::Count(3), 24 * H, 0);
    assert!(why(&r).contains("at most 2 GPU(s)"), "{r:?}");
    assert!(why(&r).contains("reserve_max_gpus"), "{r:?}");
    assert_eq!(
        reserve_for(&mut p, 3, 1000, GpuRequest::Count(1), 24 * H, 0),
        vec![(3, 1, Reply::Reserved { devices: vec![0] })]
    );
    // A launch of the same user counts too.
    p.handle(
        Event::Connected {
            client: 4,
            peer: peer_of(1000, "user1000"),
        },
        0,
    );
    control(&mut p, 4);
    let launch = |p: &mut Policy, client, n| {
        replies(p.handle(
            Event::Request {
                client,
                seq: 1,
                req: Request::Reserve {
                    group: "a".into(),
                    gpus: GpuRequest::Count(n),
                    wait: true,
                },
            },
            0,
        ))
    };
    assert!(why(&launch(&mut p, 4, 2)).contains("it holds or waits for 1"));
    assert_eq!(
        launch(&mut p, 4, 1),
        vec![(4, 1, Reply::Reserved { devices: vec![1] })]
    );
    // Another user has its own share; the daemon's user has no limit.
    assert_eq!(
        reserve_for(&mut p, 5, 2000, GpuRequest::Count(2), 24 * H, 0),
        vec![(
            5,
            1,
            Reply::Reserved {
                devices: vec![2, 3]
            }
        )]
    );
    assert!(reserve_for(&mut p, 6, 7, GpuRequest::Count(4), 30 * 24 * H, 0).is_empty());
}

/// A GPU reserved with `gem-launch reserve` is its group's, as
/// canhazgpu's: it takes the whole GPU whatever the group's `MinUtil`,
/// another group's launch is placed elsewhere, and another group's
/// process already on it gets no token (it waits) until the reservation
/// ends; on the other GPU it runs as before.
#[test]
fn a_reserved_gpu_gives_other_groups_no_token_until_it_ends() {
    const H: Micros = 3_600_000_000;
    let mut p = two_gpus("[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n");
    // b used GPU 0 before it was reserved.
    hello(&mut p, 10, "b");
    assert_eq!(
        token(&send(&mut p, 10, acquire(), 0)).map(|t| t.0),
        Some(10)
    );
    send(&mut p, 10, release_ran(0, 5), 5);
    assert_eq!(
        reserve_for(&mut p, 1, 1000, GpuRequest::Count(1), H, 6),
        vec![(1, 1, Reply::Reserved { devices: vec![0] })]
    );
    // b's launch asking for one GPU gets GPU 1: GPU 0 has no room left,
    // though a claims only its MinUtil of a launch's GPU.
    assert_eq!(
        reserve(&mut p, 2, "b", GpuRequest::Count(1), false, 10),
        vec![(2, 1, Reply::Reserved { devices: vec![1] })]
    );
    hello(&mut p, 11, "a");
    // b's process on GPU 0 waits; a's gets the token.
    assert!(send(&mut p, 10, acquire(), 20).is_empty());
    // A whole token, not one lent short as if b were owed the GPU.
    assert_eq!(
        token(&send(&mut p, 11, acquire(), 30)).map(|t| (t.0, t.2)),
        Some((11, false))
    );
    // b waits there, but is owed nothing: not short of its MinUtil.
    let st = p.status(31);
    let b = st.devices[0].groups.iter().find(|r| r.group == "b");
    assert!(
        b.is_some_and(|r| r.waiting == 1 && !r.short_of_min),
        "{st:?}"
    );
    // a gives it back: still nothing for b while the reservation lasts.
    let r = send(&mut p, 11, release_ran(30, 1_000), 1_000);
    assert!(token(&r).is_none(), "{r:?}");
    // Nothing to do until the reservation expires: no tick before (the
    // daemon would spin on a deadline of now).
    assert_eq!(p.next_deadline(2_000), Some(H + 6));
    assert!(
        replies(p.handle(Event::Tick, H / 2))
            .iter()
            .all(|r| r.0 != 10)
    );
    // On GPU 1 (not reserved by a) b runs.
    let on_1 = Request::AcquireToken {
        device: 1,
        ran: vec![],
        in_flight: false,
        burst_us: 0,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    assert!(matches!(
        send(&mut p, 10, on_1, H / 2 + 1).as_slice(),
        [(10, _, Reply::Token { device: 1, .. })]
    ));
    // The reservation expires: b's wait on GPU 0 ends with a token.
    let r = replies(p.handle(Event::Tick, H + 6));
    assert!(
        r.iter()
            .any(|(c, _, reply)| *c == 10 && matches!(reply, Reply::Token { device: 0, .. })),
        "{r:?}"
    );
}

/// A reservation keeps every other group off its GPUs: a user could take
/// a GPU from under a running group, whose processes then ran no kernel
/// while it lasted. A user other than root and the daemon's may reserve
/// only GPUs no other group uses; its launch waits for one meanwhile, and
/// does not hold up the queue behind it.
#[test]
fn a_user_cannot_reserve_a_gpu_another_group_runs_on() {
    const H: Micros = 3_600_000_000;
    let mut p = Policy::new(
        Params {
            devices: 2,
            admin_uid: 7,
            ..Params::default()
        },
        config("[a]\n[victim]\nMinUtil=0.5\n"),
    );
    hello(&mut p, 1, "victim");
    ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 1 << 20,
        },
    );
    // GPU 0 is the victim's: refused by id, GPU 1 chosen by count.
    let r = reserve_for(&mut p, 2, 1000, GpuRequest::Ids(vec![0]), H, 0);
    assert!(r.is_empty(), "waits for GPU 0: {r:?}");
    assert_eq!(
        reserve_for(&mut p, 3, 1001, GpuRequest::Count(1), H, 0),
        vec![(3, 1, Reply::Reserved { devices: vec![1] })]
    );
    // The daemon's user is served behind the waiting one, and may take a
    // used GPU.
    assert_eq!(
        reserve_for(&mut p, 4, 7, GpuRequest::Ids(vec![0]), H, 0),
        vec![(4, 1, Reply::Reserved { devices: vec![0] })]
    );
    // Released by its owner, connected again.
    p.handle(
        Event::Connected {
            client: 6,
            peer: peer_of(7, "admin"),
        },
        0,
    );
    control(&mut p, 6);
    let r = replies(p.handle(
        Event::Request {
            client: 6,
            seq: 2,
            req: Request::ReleaseReserved { devices: vec![0] },
        },
        0,
    ));
    assert_eq!(r, vec![(6, 2, Reply::Released { devices: vec![0] })]);
    assert_eq!(p.status(0).queue.len(), 1, "the victim still runs on GPU 0");
    // The victim leaves: the next look at the queue serves the waiting one.
    let mut r = replies(p.handle(Event::Disconnected { client: 1 }, H));
    r.extend(replies(p.handle(Event::Tick, H + 1)));
    assert_eq!(
        r,
        vec![(2, 1, Reply::Reserved { devices: vec![0] })],
        "{:?}",
        p.status(H + 1)
    );
}

/// Restored after a restart, a launch's reservation is held by the
/// daemon's stand-in, a peer of the daemon's own user: it went uncounted,
/// and its user could hold twice `reserve_max_gpus`. It counts against
/// the user who made it, as the state file says.
#[test]
fn a_restored_reservation_counts_against_its_user() {
    const H: Micros = 3_600_000_000;
    let mut p = Policy::new(
        Params {
            devices: 2,
            admin_uid: 7,
            ..Params::default()
        },
        config("[a]\n"),
    );
    p.handle(
        Event::Connected {
            client: 1,
            peer: peer_of(7, "(restored)"),
        },
        0,
    );
    control(&mut p, 1);
    let r = replies(p.handle(
        Event::Request {
            client: 1,
            seq: 1,
            req: Request::Reserve {
                group: "a".into(),
                gpus: GpuRequest::Ids(vec![0]),
                wait: false,
            },
        },
        0,
    ));
    assert_eq!(r, vec![(1, 1, Reply::Reserved { devices: vec![0] })]);
    p.restored_reservation(1, 0, Some(1000));
    let r = reserve_for(&mut p, 2, 1000, GpuRequest::Count(1), H, 0);
    match &r[0].2 {
        Reply::Error(e) if e.kind == ErrorKind::PermissionDenied => {
            assert!(
                e.message.contains("it holds or waits for 1"),
                "{}",
                e.message
            )
        }
        other => panic!("user 1000 got a second GPU: {other:?}"),
    }
    // Another user has its own.
    assert_eq!(
        reserve_for(&mut p, 3, 1001, GpuRequest::Count(1), H, 0),
        vec![(3, 1, Reply::Reserved { devices: vec![1] })]
    );
}
