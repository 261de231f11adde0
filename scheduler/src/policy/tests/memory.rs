//! Memory caps per group, reloads of the limits, devices and bad requests.

use super::*;

#[test]
fn memory_is_capped_per_group_across_processes() {
    let mut p = Policy::new(
        Params::default(),
        config("[a]\nMemoryLimit=1GiB\n[b]\nMemoryLimit=1GiB\n"),
    );
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "a");
    hello(&mut p, 3, "b");
    let r = ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 600 << 20,
        },
    );
    assert_eq!(
        r,
        Reply::Memory {
            device: 0,
            used: 600 << 20,
            limit: 1 << 30
        }
    );
    let r = ask(
        &mut p,
        2,
        Request::ReserveMemory {
            device: 0,
            bytes: 600 << 20,
        },
    );
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory));
    // In sizes a person reads, not bytes.
    let Reply::Error(e) = &r else { unreachable!() };
    assert!(
        e.message.contains("would use 1.2 GiB on device 0, over its MemoryLimit of 1.0 GiB (in use: 600.0 MiB, asked: 600.0 MiB)"),
        "{}",
        e.message
    );
    // Another group and another device are not affected.
    assert!(matches!(
        ask(
            &mut p,
            3,
            Request::ReserveMemory {
                device: 0,
                bytes: 1 << 30
            }
        ),
        Reply::Memory { .. }
    ));
    assert!(matches!(
        ask(
            &mut p,
            2,
            Request::ReserveMemory {
                device: 1,
                bytes: 1 << 30
            }
        ),
        Reply::Memory { .. }
    ));
    let r = ask(&mut p, 2, Request::MemoryInfo { device: 0 });
    assert_eq!(
        r,
        Reply::MemoryView {
            device: 0,
            used: 600 << 20,
            limit: 1 << 30,
            reclaimable: 0,
            context: 0
        }
    );
    // The process dies: its reservation goes with it.
    p.handle(Event::Disconnected { client: 1 }, 1);
    let r = ask(
        &mut p,
        2,
        Request::ReserveMemory {
            device: 0,
            bytes: 600 << 20,
        },
    );
    assert_eq!(
        r,
        Reply::Memory {
            device: 0,
            used: 600 << 20,
            limit: 1 << 30
        }
    );
}

#[test]
fn memory_release_never_underflows_or_frees_others() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=1GiB\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "a");
    ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 100,
        },
    );
    ask(
        &mut p,
        2,
        Request::ReserveMemory {
            device: 0,
            bytes: 100,
        },
    );
    let r = ask(
        &mut p,
        1,
        Request::ReleaseMemory {
            device: 0,
            bytes: u64::MAX,
        },
    );
    assert_eq!(
        r,
        Reply::Memory {
            device: 0,
            used: 100,
            limit: 1 << 30
        }
    );
    let r = ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: u64::MAX,
        },
    );
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory));
}

#[test]
fn lowered_limit_applies_to_new_reservations_and_reload_keeps_usage() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=2GiB\n"));
    hello(&mut p, 1, "a");
    ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 1 << 30,
        },
    );
    p.handle(Event::Reconfigure(config("[a]\nMemoryLimit=1GiB\n")), 1);
    let r = ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 1,
        },
    );
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory));
    assert_eq!(
        ask(&mut p, 1, Request::MemoryInfo { device: 0 }),
        Reply::MemoryView {
            device: 0,
            used: 1 << 30,
            limit: 1 << 30,
            reclaimable: 0,
            context: 0
        }
    );
}

#[test]
fn removed_group_keeps_running_clients_but_refuses_new_ones() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=2GiB\n[b]\n"));
    hello(&mut p, 1, "a");
    p.handle(Event::Reconfigure(config("[b]\n")), 1);
    assert!(
        matches!(ask(&mut p, 1, Request::ReserveMemory { device: 0, bytes: 1 << 30 }), Reply::Memory { limit, .. } if limit == 2 << 30)
    );
    assert_eq!(kind(&hello(&mut p, 2, "a")), Some(ErrorKind::UnknownGroup));
    assert!(p.status(1).groups.iter().any(|g| g.name == "a"));
    p.handle(Event::Disconnected { client: 1 }, 2);
    assert!(!p.status(2).groups.iter().any(|g| g.name == "a"));
}

#[test]
fn unknown_group_error_names_the_config_file_and_known_groups() {
    let mut p = Policy::new(Params::default(), config("[train]\n[infer]\n"));
    match hello(&mut p, 1, "trian") {
        Reply::Error(e) => {
            assert_eq!(e.kind, ErrorKind::UnknownGroup);
            assert!(
                e.message.contains("/etc/gemini/resource.conf"),
                "{}",
                e.message
            );
            assert!(e.message.contains("infer, train"), "{}", e.message);
        }
        other => panic!("{other:?}"),
    }
}

/// A group with `Devices` gets tokens and memory on those GPUs only; on
/// another it is refused, told which GPUs it has and where that is set.
#[test]
fn a_group_with_devices_is_refused_time_and_memory_elsewhere() {
    let mut p = Policy::new(
        Params::default(),
        config("[job]\nMinUtil=0.5\nDevices=1,3\n[free]\n"),
    );
    hello(&mut p, 1, "job");
    hello(&mut p, 2, "free");
    let acquire = |device| Request::AcquireToken {
        device,
        ran: vec![],
        in_flight: false,
        burst_us: 0,
        rtt_us: RTT as u32,
        launch_us: 0,
    };
    let r = ask(&mut p, 1, acquire(0));
    assert_eq!(kind(&r), Some(ErrorKind::PermissionDenied), "{r:?}");
    let Reply::Error(e) = &r else { unreachable!() };
    assert!(
        e.message.contains("group \"job\" may use GPU 1, 3 only")
            && e.message.contains("/etc/gemini/resource.conf line 1")
            && e.message.contains("not GPU 0"),
        "{}",
        e.message
    );
    let reserve = |device| Request::ReserveMemory {
        device,
        bytes: 1 << 20,
    };
    assert_eq!(
        kind(&ask(&mut p, 1, reserve(2))),
        Some(ErrorKind::PermissionDenied)
    );
    assert!(matches!(
        ask(&mut p, 1, acquire(3)),
        Reply::Token { device: 3, .. }
    ));
    assert_eq!(kind(&ask(&mut p, 1, reserve(1))), None);
    assert!(matches!(
        ask(&mut p, 1, Request::MemoryInfo { device: 0 }),
        Reply::MemoryView { .. }
    ));
    // A group without Devices uses every GPU.
    assert!(matches!(
        ask(&mut p, 2, acquire(0)),
        Reply::Token { device: 0, .. }
    ));
}

#[test]
fn requests_before_hello_and_bad_devices_are_refused() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    let r = ask(
        &mut p,
        9,
        Request::AcquireToken {
            device: 0,
            ran: vec![],
            in_flight: false,
            burst_us: 0,
            rtt_us: RTT as u32,
            launch_us: 0,
        },
    );
    assert_eq!(kind(&r), Some(ErrorKind::NotRegistered));
    hello(&mut p, 9, "a");
    assert_eq!(
        kind(&hello(&mut p, 9, "a")),
        Some(ErrorKind::AlreadyRegistered)
    );
    let r = ask(
        &mut p,
        9,
        Request::ReserveMemory {
            device: MAX_DEVICES,
            bytes: 1,
        },
    );
    assert_eq!(kind(&r), Some(ErrorKind::BadRequest));
}

#[test]
fn disconnect_while_holding_the_token_frees_the_device() {
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    let acts = p.handle(
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
        0,
    );
    assert!(matches!(
        acts[0],
        Action::Reply {
            client: 1,
            reply: Reply::Token { .. },
            ..
        }
    ));
    let acts = p.handle(
        Event::Request {
            client: 2,
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
        10,
    );
    assert!(acts.is_empty(), "{acts:?}");
    let acts = p.handle(Event::Disconnected { client: 1 }, 20);
    // The dead holder is charged its token as estimated, to now.
    assert!(
        matches!(
            acts.as_slice(),
            [
                Action::Estimated {
                    client: 1,
                    charged: 20,
                    ..
                },
                Action::Reply {
                    client: 2,
                    reply: Reply::Token { .. },
                    ..
                }
            ]
        ),
        "{acts:?}"
    );
}

/// A control connection (gem-launch) has no group: its memory query is
/// refused. It used to share the holder's internal key (the empty name)
/// and was shown the holder's memory as its own.
#[test]
fn a_control_connection_is_not_shown_the_holders_memory() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=1GiB\n"));
    hello_holder(&mut p, 9);
    let r = ask(
        &mut p,
        9,
        Request::ReserveMemory {
            device: 0,
            bytes: 5 << 30,
        },
    );
    assert!(
        matches!(r, Reply::Memory { used, .. } if used == 5 << 30),
        "{r:?}"
    );
    control(&mut p, 3);
    let r = ask(&mut p, 3, Request::MemoryInfo { device: 0 });
    assert_eq!(kind(&r), Some(ErrorKind::Unexpected), "{r:?}");
    // A group's view counts the holder's memory as reclaimable only.
    hello(&mut p, 1, "a");
    let r = ask(&mut p, 1, Request::MemoryInfo { device: 0 });
    assert_eq!(
        r,
        Reply::MemoryView {
            device: 0,
            used: 0,
            limit: 1 << 30,
            reclaimable: 5 << 30,
            context: 0
        }
    );
    assert_eq!(p.client_group(3).as_deref(), Some("(control)"));
    assert_eq!(p.client_group(9).as_deref(), Some("(holder)"));
}

/// A group that holds memory on a device but has launched nothing there
/// is in the device's rows with its memory (it was missing: status, `top`
/// and the metrics showed none of it), on a device the policy was not
/// told of too.
#[test]
fn status_shows_memory_of_a_group_that_never_launched() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=1GiB\n"));
    hello(&mut p, 1, "a");
    for device in [0, 3] {
        let r = ask(
            &mut p,
            1,
            Request::ReserveMemory {
                device,
                bytes: 256 << 20,
            },
        );
        assert!(matches!(r, Reply::Memory { .. }), "{r:?}");
    }
    let st = p.status(0);
    for device in [0, 3] {
        let d = st
            .devices
            .iter()
            .find(|d| d.device == device)
            .unwrap_or_else(|| panic!("device {device} missing: {:?}", st.devices));
        let row = d.groups.iter().find(|r| r.group == "a");
        assert_eq!(
            row.map(|r| (r.memory_used, r.memory_limit, r.share)),
            Some((256 << 20, 1 << 30, 0.0)),
            "device {device}: {d:?}"
        );
    }
}

/// Processes report what their contexts took; the memory view of every
/// process of the same user gives the largest on the device, so that a new
/// process reserves its first context before the driver makes it.
#[test]
fn context_costs_are_shared_through_the_memory_view() {
    let mut p = Policy::new(Params::default(), config("[a]\n[b]\nDevices=1\n"));
    for client in [1, 2] {
        connect_as(&mut p, client, 1000);
    }
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 1 << 30,
        },
    );
    assert_eq!(view(&mut p, 2, 0), 0, "none reported yet");
    for bytes in [300 << 20, 500 << 20, 400 << 20] {
        assert_eq!(
            ask(&mut p, 1, Request::ContextCost { device: 0, bytes }),
            Reply::Done
        );
    }
    assert_eq!(view(&mut p, 2, 0), 500 << 20, "the largest, to any group");
    assert_eq!(view(&mut p, 1, 1), 0, "per device");
    assert_eq!(
        kind(&ask(
            &mut p,
            1,
            Request::ContextCost {
                device: MAX_DEVICES,
                bytes: 1
            }
        )),
        Some(ErrorKind::BadRequest)
    );
}

fn view(p: &mut Policy, client: ClientId, device: DeviceId) -> u64 {
    match ask(p, client, Request::MemoryInfo { device }) {
        Reply::MemoryView { context, .. } => context,
        other => panic!("{other:?}"),
    }
}

/// A context's size once came from any connection, and the largest ever
/// said was what every new process reserved first: one `ContextCost` of
/// u64::MAX made every later process of a group with a `MemoryLimit` fail
/// its first context with out-of-memory. Now a report counts only from a
/// client process that holds memory on the device, never above what it
/// holds, and only for its own user's processes.
#[test]
fn one_users_context_report_moves_no_other_users_reservation() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=2GiB\n[b]\n"));
    connect_as(&mut p, 1, 1000);
    connect_as(&mut p, 2, 1001);
    connect_as(&mut p, 3, 1001);
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    hello(&mut p, 3, "b");
    control(&mut p, 4);
    let cost = |bytes| Request::ContextCost { device: 0, bytes };
    // No memory on the device: no context there.
    assert_eq!(
        kind(&ask(&mut p, 2, cost(u64::MAX))),
        Some(ErrorKind::PermissionDenied)
    );
    assert_eq!(
        kind(&ask(&mut p, 4, cost(u64::MAX))),
        Some(ErrorKind::PermissionDenied)
    );
    ask(
        &mut p,
        2,
        Request::ReserveMemory {
            device: 0,
            bytes: 64 << 20,
        },
    );
    assert_eq!(ask(&mut p, 2, cost(u64::MAX)), Reply::Done);
    assert_eq!(
        view(&mut p, 3, 0),
        64 << 20,
        "its own user's, not past what it held"
    );
    assert_eq!(
        view(&mut p, 1, 0),
        0,
        "another user's processes reserve nothing for it"
    );
    ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 500 << 20,
        },
    );
    assert_eq!(ask(&mut p, 1, cost(300 << 20)), Reply::Done);
    assert_eq!(view(&mut p, 1, 0), 300 << 20);
    assert_eq!(view(&mut p, 3, 0), 64 << 20);
}

/// What a hello says a process holds was added to its group unchecked: a
/// hello holding the whole device kept the group's other processes from
/// allocating anything. A process may say it holds at most its group's
/// whole `MemoryLimit` (or what its own other connection, its stand-in
/// after a restart, holds); beside its group's other processes it is
/// accepted, as a process re-registering after a restart must be.
#[test]
fn a_hello_holding_more_than_its_group_may_is_refused() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=2GiB\n"));
    hello(&mut p, 1, "a");
    ask(
        &mut p,
        1,
        Request::ReserveMemory {
            device: 0,
            bytes: 1 << 30,
        },
    );
    let hello_holding = |p: &mut Policy, client: ClientId, pid: u32, bytes: u64| {
        let req = Request::Hello {
            role: Role::Client,
            group: "a".into(),
            pid,
            held: vec![HeldMemory { device: 0, bytes }],
            job: None,
            build: gemini_protocol::BUILD.into(),
        };
        ask(p, client, req)
    };
    let r = hello_holding(&mut p, 2, 2, (2 << 30) + 1);
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory), "{r:?}");
    let r = hello_holding(&mut p, 3, 3, u64::MAX);
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory), "{r:?}");
    let used = |p: &mut Policy| p.status(0).devices[0].groups[0].memory_used;
    assert_eq!(used(&mut p), 1 << 30, "nothing added by a refused hello");
    assert!(matches!(
        hello_holding(&mut p, 4, 4, 2 << 30),
        Reply::Welcome { .. }
    ));
    // Process 1 again, on a new connection, with what it holds.
    assert!(matches!(
        hello_holding(&mut p, 5, 1, 1 << 30),
        Reply::Welcome { .. }
    ));
}

/// The status says, per group and device, about how much of the group's
/// memory its processes' own contexts take: processes holding memory
/// there times the largest context reported there, never more than the
/// group holds.
#[test]
fn the_status_says_what_the_contexts_of_a_group_take() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=4GiB\n[b]\n"));
    for (client, group) in [(1, "a"), (2, "a"), (3, "b")] {
        hello(&mut p, client, group);
    }
    let reserve =
        |p: &mut Policy, client, bytes| ask(p, client, Request::ReserveMemory { device: 0, bytes });
    reserve(&mut p, 1, 600 << 20);
    reserve(&mut p, 2, 700 << 20);
    reserve(&mut p, 3, 100 << 20);
    let contexts = |p: &mut Policy, group: &str| {
        p.status(0).devices[0]
            .groups
            .iter()
            .find(|g| g.group == group)
            .map(|g| g.contexts)
    };
    assert_eq!(contexts(&mut p, "a"), Some(0), "no context reported yet");
    ask(
        &mut p,
        1,
        Request::ContextCost {
            device: 0,
            bytes: 500 << 20,
        },
    );
    assert_eq!(contexts(&mut p, "a"), Some(1000 << 20), "two processes");
    assert_eq!(
        contexts(&mut p, "b"),
        Some(100 << 20),
        "not past what b holds"
    );
}
