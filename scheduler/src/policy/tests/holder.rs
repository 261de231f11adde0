//! The holder: memory handed back, polls, leaving, short tokens.

use super::*;

#[test]
fn holder_gives_memory_back_to_a_client_that_needs_it() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=8GiB\n"));
    hello(&mut p, 1, "a");
    hello_holder(&mut p, 50);
    // Nothing held: the client's need is refused at once.
    let r = replies(p.handle(
        Event::Request {
            client: 1,
            seq: 3,
            req: Request::NeedMemory {
                device: 0,
                bytes: 1 << 30,
            },
        },
        0,
    ));
    assert_eq!(r.len(), 1);
    assert_eq!(kind(&r[0].2), Some(ErrorKind::OutOfMemory));
    // The holder holds 6 GiB and polls.
    let r = replies(p.handle(
        Event::Request {
            client: 50,
            seq: 1,
            req: Request::ReserveMemory {
                device: 0,
                bytes: 6 << 30,
            },
        },
        0,
    ));
    assert!(matches!(r[0].2, Reply::Memory { .. }), "{r:?}");
    assert!(
        replies(p.handle(
            Event::Request {
                client: 50,
                seq: 2,
                req: Request::HolderPoll { wait_us: 100_000 }
            },
            10
        ))
        .is_empty()
    );
    // The client needs 1 GiB: the holder is told at once, the client waits.
    let r = replies(p.handle(
        Event::Request {
            client: 1,
            seq: 4,
            req: Request::NeedMemory {
                device: 0,
                bytes: 1 << 30,
            },
        },
        20,
    ));
    assert_eq!(
        r,
        vec![(
            50,
            2,
            Reply::Holder(HolderOrder::FreeMemory {
                device: 0,
                bytes: 1 << 30
            })
        )]
    );
    // The holder frees 2 GiB: the client may retry.
    let r = replies(p.handle(
        Event::Request {
            client: 50,
            seq: 5,
            req: Request::ReleaseMemory {
                device: 0,
                bytes: 2 << 30,
            },
        },
        30,
    ));
    assert!(r.contains(&(1, 4, Reply::Done)), "{r:?}");
}

#[test]
fn holder_poll_reports_activity_and_unanswered_demands_time_out() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    hello_holder(&mut p, 50);
    p.handle(
        Event::Request {
            client: 1,
            seq: 1,
            req: Request::AcquireToken {
                device: 0,
                ran: vec![],
                in_flight: false,
                burst_us: 0,
                rtt_us: RTT as u32,
                launch_us: 0,
            },
        },
        1_000,
    );
    p.handle(
        Event::Request {
            client: 1,
            seq: 2,
            req: release_ran(1_000, 1_010),
        },
        2_000,
    );
    p.handle(
        Event::Request {
            client: 50,
            seq: 1,
            req: Request::HolderPoll { wait_us: 50_000 },
        },
        3_000,
    );
    assert_eq!(p.next_deadline(3_000), Some(53_000));
    let r = replies(p.handle(Event::Tick, 53_000));
    assert_eq!(
        r,
        vec![(
            50,
            1,
            Reply::Holder(HolderOrder::Report(vec![DeviceActivity {
                device: 0,
                idle_us: 52_000,
                used_by: None,
            }]))
        )]
    );
    // A demand the holder ignores is refused after a second.
    p.handle(
        Event::Request {
            client: 50,
            seq: 2,
            req: Request::ReserveMemory {
                device: 0,
                bytes: 100,
            },
        },
        53_000,
    );
    assert!(
        replies(p.handle(
            Event::Request {
                client: 1,
                seq: 3,
                req: Request::NeedMemory {
                    device: 0,
                    bytes: 10
                }
            },
            60_000
        ))
        .is_empty()
    );
    let r = replies(p.handle(Event::Tick, 60_000 + crate::policy::holder::DEMAND_TIMEOUT));
    assert_eq!(r.len(), 1);
    assert_eq!(kind(&r[0].2), Some(ErrorKind::OutOfMemory));
}

#[test]
fn holder_leaving_frees_waiting_clients_and_shutdown_stops_it() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    hello_holder(&mut p, 50);
    p.handle(
        Event::Request {
            client: 50,
            seq: 1,
            req: Request::ReserveMemory {
                device: 0,
                bytes: 100,
            },
        },
        0,
    );
    p.handle(
        Event::Request {
            client: 1,
            seq: 2,
            req: Request::NeedMemory {
                device: 0,
                bytes: 10,
            },
        },
        0,
    );
    let r = replies(p.handle(Event::Disconnected { client: 50 }, 10));
    assert_eq!(r, vec![(1, 2, Reply::Done)]);
    hello_holder(&mut p, 51);
    p.handle(
        Event::Request {
            client: 51,
            seq: 7,
            req: Request::HolderPoll { wait_us: 1_000_000 },
        },
        20,
    );
    assert_eq!(
        replies(p.shutdown()),
        vec![(51, 7, Reply::Holder(HolderOrder::Stop))]
    );
}

#[test]
fn holder_tokens_are_as_short_as_its_kernels_and_yield_to_clients() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello(&mut p, 1, "a");
    hello_holder(&mut p, 50);
    let acquire = |burst| Request::AcquireToken {
        device: 0,
        ran: vec![],
        in_flight: false,
        burst_us: burst,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    let r = replies(p.handle(
        Event::Request {
            client: 50,
            seq: 1,
            req: acquire(2_000),
        },
        0,
    ));
    assert_eq!(
        r,
        vec![(
            50,
            1,
            Reply::Token {
                device: 0,
                quota_us: 2_000,
                lent: false,
                last_step: false,
                held_us: 0,
            }
        )]
    );
    // Both wait when the holder's token comes back: the client wins.
    assert!(
        replies(p.handle(
            Event::Request {
                client: 1,
                seq: 1,
                req: acquire(0)
            },
            500
        ))
        .is_empty()
    );
    let r = replies(p.handle(
        Event::Request {
            client: 50,
            seq: 2,
            req: Request::AcquireToken {
                device: 0,
                ran: ran(0, 2_000),
                in_flight: false,
                burst_us: 2_000,
                rtt_us: RTT as u32,
                launch_us: 0,
            },
        },
        2_000,
    ));
    assert_eq!(r.len(), 1);
    assert_eq!(r[0].0, 1, "the real client gets the device: {r:?}");
}

/// gem-launch picks a group's GPUs among its `Devices` only, and says so
/// when it asks for more or others.
#[test]
fn launches_of_a_group_with_devices_get_those_gpus() {
    let mut p = Policy::new(
        Params {
            devices: 4,
            ..Params::default()
        },
        config("[job]\nMinUtil=0.5\nDevices=3,1\n"),
    );
    assert_eq!(
        reserve(&mut p, 1, "job", GpuRequest::Count(2), true, 0),
        vec![(
            1,
            1,
            Reply::Reserved {
                devices: vec![1, 3]
            }
        )]
    );
    for (client, gpus, says) in [
        (
            2,
            GpuRequest::Count(3),
            "asked for 3 GPUs; group \"job\" may use 2 (3, 1: Devices=",
        ),
        (
            3,
            GpuRequest::Ids(vec![0]),
            "group \"job\" may not use GPU 0, only 3, 1 (Devices=",
        ),
    ] {
        let r = reserve(&mut p, client, "job", gpus, true, 0);
        match r.as_slice() {
            [(_, _, Reply::Error(e))] => {
                assert_eq!(e.kind, ErrorKind::BadRequest);
                assert!(e.message.contains(says), "{}", e.message);
            }
            other => panic!("{other:?}"),
        }
    }
}
