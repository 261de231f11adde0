//! The holder stepping aside, the policy's throughput and the
//! scheduler's memory.

use super::*;

pub(crate) fn holder(t: &mut Table) {
    let g = Gemini::start_with(
        SimEnv::new(1, "4GiB"),
        "[a]\nMemoryLimit=2GiB\n",
        &["--log-level", "warn"],
    );
    let mut h = g
        .holder(&[
            "run",
            "--wait-minutes",
            "0",
            "--hold-util",
            "1.0",
            "--hold-mem",
            "3584MiB",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    g.wait_holder("holding its memory", |s| {
        s.contains("\"held_bytes\": 3758096384")
    });
    let bursts = g.sim.path().join("bursts.txt");
    let out = g.bursty_client("a", "12", &bursts).output().unwrap();
    let pid = pid_of(&out);
    let mut waits: Vec<f64> = gemini_tests::first_kernel_waits(&g.sim, 0, pid, &bursts)
        .into_iter()
        .map(|w| w as f64 / 1e6)
        .collect();
    let n = waits.len();
    t.row(
        format!("holder at 1.0: a real client's first-kernel wait, p50 / p99 over {n} arrivals"),
        format!(
            "{:.2} / {:.2} ms",
            percentile(&mut waits, 0.5),
            percentile(&mut waits, 0.99)
        ),
        "p99 ≤ 5 ms",
    );
    let mut c = g.hooked(g.sim.workload(), "a");
    c.args(["--seconds", "0", "--mem", "1536MiB"]);
    let r = &reports(&c.output().unwrap().stdout)[0];
    let took = (field(r, "alloc_done_ns") - field(r, "alloc_start_ns")) as f64 / 1e6;
    assert_eq!(field(r, "alloc_error"), 0);
    t.row(
        "memory handed back by the holder (1.5 GiB allocation)",
        format!("{took:.1} ms"),
        "≤ 200 ms",
    );
    let _ = h.kill();
    let _ = h.wait();
}

pub(crate) fn policy_throughput(t: &mut Table) {
    let mut conf = String::new();
    for i in 0..8 {
        conf += &format!("[g{i}]\nMinUtil=0.1\n");
    }
    let cfg = parse_resource(&conf, "bench.conf".as_ref()).unwrap().0;
    let mut p = Policy::new(Params::default(), cfg);
    let (clients, devices) = (256u64, 8u32);
    let mut events: BinaryHeap<std::cmp::Reverse<(u64, u64, u64)>> = BinaryHeap::new();
    let grant = |acts: Vec<Action>, now: u64, events: &mut BinaryHeap<_>| {
        let mut n = 0;
        for a in acts {
            if let Action::Reply {
                client,
                reply: Reply::Token { quota_us, .. },
                ..
            } = a
            {
                events.push(std::cmp::Reverse((now + quota_us, client, quota_us)));
                n += 1;
            }
        }
        n
    };
    let mut grants = 0u64;
    for c in 0..clients {
        let hello = Request::Hello {
            role: Role::Client,
            group: format!("g{}", c % 8),
            pid: c as u32,
            held: vec![],
            job: None,
            build: gemini_protocol::BUILD.into(),
        };
        p.handle(
            Event::Request {
                client: c,
                seq: 0,
                req: hello,
            },
            0,
        );
        let acts = p.handle(
            Event::Request {
                client: c,
                seq: 1,
                req: Request::AcquireToken {
                    device: (c % devices as u64) as u32,
                    ran: vec![],
                    in_flight: false,
                    burst_us: 0,
                    rtt_us: 100,
                    launch_us: 0,
                },
            },
            0,
        );
        grants += grant(acts, 0, &mut events);
    }
    let start = Instant::now();
    while start.elapsed() < Duration::from_secs(3) {
        let Some(std::cmp::Reverse((now, c, used))) = events.pop() else {
            break;
        };
        let req = Request::AcquireToken {
            device: (c % devices as u64) as u32,
            ran: vec![gemini_protocol::Span {
                start_us: now - used,
                end_us: now,
            }],
            in_flight: false,
            burst_us: 0,
            rtt_us: 100,
            launch_us: 0,
        };
        let acts = p.handle(
            Event::Request {
                client: c,
                seq: 1,
                req,
            },
            now,
        );
        grants += grant(acts, now, &mut events);
    }
    let per_sec = grants as f64 / start.elapsed().as_secs_f64();
    t.row(
        "policy throughput, 256 clients × 8 devices, virtual time",
        format!("{:.0} grants/s", per_sec),
        "≥ 50 000 grants/s",
    );
}

pub(crate) fn scheduler_rss(t: &mut Table) {
    let g = Gemini::start_with(
        SimEnv::new(8, "16GiB"),
        "[a]\nMemoryLimit=unlimited\n",
        &["--log-level", "warn"],
    );
    let pid = g.scheduler_pid().expect("scheduler pid");
    let before = rss_kib(pid);
    let mut clients = Vec::new();
    for i in 0..256u32 {
        let mut c = client_of(&g, "a");
        let dev = i % 8;
        c.request(
            &Request::ReserveMemory {
                device: dev,
                bytes: 1 << 20,
            },
            Duration::from_secs(5),
        )
        .unwrap();
        c.request(
            &Request::AcquireToken {
                device: dev,
                ran: vec![],
                in_flight: false,
                burst_us: 0,
                rtt_us: 100,
                launch_us: 0,
            },
            Duration::from_secs(30),
        )
        .unwrap();
        c.request(
            &Request::ReleaseToken {
                device: dev,
                ran: ran_for_us(100),
                in_flight: false,
            },
            Duration::from_secs(5),
        )
        .unwrap();
        clients.push(c);
    }
    let after = rss_kib(pid);
    t.row(
        "scheduler RSS with 256 connected clients (idle → loaded)",
        format!(
            "{:.1} → {:.1} MB",
            before as f64 / 1024.0,
            after as f64 / 1024.0
        ),
        "< 50 MB",
    );
}

/// A report of work that ran for the last `us` µs.
fn ran_for_us(us: u64) -> Vec<gemini_protocol::Span> {
    let end = gemini_protocol::clock::monotonic_us();
    vec![gemini_protocol::Span {
        start_us: end - us,
        end_us: end,
    }]
}

/// A hostile tenant's load on the scheduler: 256 connections refused for
/// an unknown protocol version, then 16 threads asking for the status as
/// fast as it answers. A hooked workload of short steps (4 × 500 µs
/// kernels, a 3 ms pause) runs 8 s beside it, and beside nothing: the
/// kernels it ran with the attack over those without.
pub(crate) fn flood(t: &mut Table) {
    let run = |attacked: bool| {
        let g = Gemini::start_with(SimEnv::new(1, "4GiB"), "[a]\n", &["--log-level", "warn"]);
        let ctx = zmq::Context::new();
        let (_refused, flood) = if attacked {
            let refused = gemini_tests::attack::refused_peers(&ctx, &g.ipc(), 256);
            (
                refused,
                Some(gemini_tests::attack::StatusFlood::start(&g.ipc(), 16)),
            )
        } else {
            (Vec::new(), None)
        };
        let mut c = g.hooked(g.sim.workload(), "a");
        c.args([
            "--seconds",
            "8",
            "--kernel-us",
            "500",
            "--iter-kernels",
            "4",
            "--gap-ms",
            "3",
        ]);
        let out = c.output().unwrap();
        let statuses = flood.map_or(0, |f| f.stop());
        let r = &reports(&out.stdout)[0];
        (field(r, "kernels") as f64, statuses)
    };
    let (alone, _) = run(false);
    let (attacked, statuses) = run(true);
    t.row(
        format!(
            "hostile flood (256 refused peers, 16 status flooders: {:.0} answers/s): kernels of 4 × 500 µs steps kept",
            statuses as f64 / 8.0
        ),
        format!("{:.1} % ({attacked:.0} of {alone:.0})", 100.0 * attacked / alone),
        "≥ 95 %",
    );
}
