//! The launch fast path and the token round trip: what a launch costs
//! under the hook, and a grant's latency against ZeroMQ's and a Unix
//! socket's own.

use super::*;

pub(crate) fn fast_path(t: &mut Table) {
    let g = Gemini::start_with(
        SimEnv::default(),
        "[bench]\n",
        &[
            "--log-level",
            "warn",
            "--base-quota",
            "10s",
            "--min-quota",
            "10s",
            "--max-quota",
            "10s",
            "--window",
            "100s",
            "--token-grace",
            "10s",
        ],
    );
    let (mut plain, mut hooked) = (Vec::new(), Vec::new());
    rate(g.sim.workload(), "0.3");
    for _ in 0..5 {
        plain.push(rate(g.sim.workload(), "1"));
        hooked.push(rate(g.hooked(g.sim.workload(), "bench"), "1"));
    }
    let (p, h) = (percentile(&mut plain, 0.5), percentile(&mut hooked, 0.5));
    t.row(
        "launch rate without hook / with hook, token held (median of 5)",
        format!("{:.2} / {:.2} M launches/s", p / 1e6, h / 1e6),
        "",
    );
    t.row(
        "hooked / un-hooked launch rate",
        format!("{:.1} %", 100.0 * h / p),
        "≥ 97 %",
    );
    // What the hook itself adds, against a driver whose launch does
    // nothing (FAKECUDA_NULL_LAUNCH): the simulator's own 1-2 µs launch
    // made the difference of two rates a few % apart, and noisy. Pairs
    // alternated; the median and the spread of the pairs' differences.
    let null = |mut c: Command| {
        c.env("FAKECUDA_NULL_LAUNCH", "1");
        rate(c, "0.5")
    };
    let mut added: Vec<f64> = (0..9)
        .map(|_| {
            let p = null(g.sim.workload());
            let h = null(g.hooked(g.sim.workload(), "bench"));
            1e9 / h - 1e9 / p
        })
        .collect();
    let (lo, mid, hi) = (
        percentile(&mut added, 0.0),
        percentile(&mut added, 0.5),
        percentile(&mut added, 1.0),
    );
    t.row(
        "hook fast path: time added per launch (median of 9 pairs against a launch that does nothing; spread)",
        format!("{mid:.0} ns ({lo:.0}-{hi:.0})"),
        "≤ 50 ns",
    );

    let mut c = client_of(&g, "bench");
    let mut rtt = Vec::new();
    for i in 0..3000 {
        let start = Instant::now();
        let r = c.request(
            &Request::AcquireToken {
                device: 0,
                ran: ran_1us(),
                in_flight: false,
                burst_us: 0,
                rtt_us: 100,
                launch_us: 0,
            },
            Duration::from_secs(2),
        );
        let d = start.elapsed().as_secs_f64() * 1e6;
        assert!(matches!(r, Ok(Reply::Token { .. })), "{r:?}");
        let _ = c.request(
            &Request::ReleaseToken {
                device: 0,
                ran: ran_1us(),
                in_flight: false,
            },
            Duration::from_secs(2),
        );
        if i >= 200 {
            rtt.push(d);
        }
    }
    t.row(
        "token round trip over ipc://, median",
        format!("{:.0} µs", percentile(&mut rtt, 0.5)),
        "≤ 50 µs",
    );
    t.row(
        "token round trip over ipc://, p99",
        format!("{:.0} µs", percentile(&mut rtt, 0.99)),
        "≤ 200 µs",
    );
    for (what, mut rtt) in [
        (
            "a ZeroMQ DEALER/ROUTER echo over ipc:// (no scheduler)",
            zmq_floor(),
        ),
        ("a Unix socket pair echo between two threads", unix_floor()),
    ] {
        t.row(
            format!("the floor on this machine: {what}, median / p99"),
            format!(
                "{:.0} / {:.0} µs",
                percentile(&mut rtt, 0.5),
                percentile(&mut rtt, 0.99)
            ),
            "",
        );
    }
}

/// A client of the scheduler of `g` that said hello as a process of
/// `group` (this one's pid).
pub(crate) fn client_of(g: &Gemini, group: &str) -> Client {
    client_in(&zmq::Context::new(), g, group)
}

/// [`client_of`] on the ZeroMQ context `ctx`, which clients in great
/// numbers share (a context each takes an I/O thread and about 7
/// descriptors: over the usual limit of 1024 at 256 clients).
pub(crate) fn client_in(ctx: &zmq::Context, g: &Gemini, group: &str) -> Client {
    let mut c = Client::connect_in(ctx, &g.ipc()).expect("connect");
    let hello = Request::Hello {
        role: Role::Client,
        group: group.into(),
        pid: std::process::id(),
        held: vec![],
        job: None,
        build: gemini_protocol::BUILD.into(),
    };
    let r = c.request(&hello, Duration::from_secs(5));
    assert!(matches!(r, Ok(Reply::Welcome { .. })), "{r:?}");
    c
}

/// Round trips (µs) of a 16-byte message to a ZeroMQ ROUTER that echoes it
/// from another thread, over `ipc://`, as the scheduler's socket is
/// reached but with nothing done per message: what ZeroMQ itself costs
/// here (its I/O threads wake on each side).
pub(crate) fn zmq_floor() -> Vec<f64> {
    let dir = tempfile::tempdir().unwrap();
    let endpoint = format!("ipc://{}/echo.sock", dir.path().display());
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.bind(&endpoint).unwrap();
    let echo = std::thread::spawn(move || {
        while let Ok(frames) = router.recv_multipart(0) {
            if frames.last().is_some_and(|f| f.is_empty()) {
                break;
            }
            router.send_multipart(frames, 0).unwrap();
        }
    });
    let dealer = zmq::Context::new().socket(zmq::DEALER).unwrap();
    dealer.connect(&endpoint).unwrap();
    let mut rtt = Vec::new();
    for i in 0..3000 {
        let start = Instant::now();
        dealer.send(&b"0123456789abcdef"[..], 0).unwrap();
        dealer.recv_bytes(0).unwrap();
        if i >= 200 {
            rtt.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    dealer.send(&b""[..], 0).unwrap();
    echo.join().unwrap();
    rtt
}

/// Round trips (µs) of 16 bytes over a Unix socket pair to a thread that
/// echoes them: the two wake-ups any IPC costs on this machine.
pub(crate) fn unix_floor() -> Vec<f64> {
    use std::io::{Read, Write};
    let (mut a, mut b) = std::os::unix::net::UnixStream::pair().unwrap();
    let echo = std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        while b.read_exact(&mut buf).is_ok() {
            if b.write_all(&buf).is_err() {
                break;
            }
        }
    });
    let mut buf = [7u8; 16];
    let mut rtt = Vec::new();
    for i in 0..3000 {
        let start = Instant::now();
        a.write_all(&buf).unwrap();
        a.read_exact(&mut buf).unwrap();
        if i >= 200 {
            rtt.push(start.elapsed().as_secs_f64() * 1e6);
        }
    }
    drop(a);
    echo.join().unwrap();
    rtt
}

/// What the token round trip costs each row of the shapes matrix: every
/// row run as it is and with `GEM_BENCH_RTT_DELAY_US` (default 150) slept
/// before each token request, so that every hand-over and renewal takes
/// that much longer. The shares that move by `d` pp for the added delay
/// would move by about `d × 40 / added` pp if the round trip were brought
/// from 90 µs to the 50 µs of the target: the row says which.
pub(crate) fn rtt_matrix(t: &mut Table) {
    let (secs, only, mixes) = matrix_choice();
    let mixes = mixes.unwrap_or_else(|| vec![0, 6, 8, 9]);
    let delay_us: u64 = std::env::var("GEM_BENCH_RTT_DELAY_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(150);
    // What the sleep really adds on this machine (a sleep overshoots).
    let mut slept: Vec<f64> = (0..200)
        .map(|_| {
            let s = Instant::now();
            std::thread::sleep(Duration::from_micros(delay_us));
            s.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    let added = percentile(&mut slept, 0.5);
    t.row(
        format!("token round trip made longer by a sleep of {delay_us} µs before each request"),
        format!("+{added:.0} µs (median sleep)"),
        "",
    );
    let delay = delay_us.to_string();
    let mut worst: f64 = 0.0;
    for (name, args) in SHAPES {
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        for &m in &mixes {
            let Some((groups, procs)) = MIXES.get(m) else {
                continue;
            };
            let s = gemini_tests::Scenario {
                groups,
                procs: *procs,
                args,
                seconds: secs,
                skip: 2.0,
            };
            let ((base, slow), steal) = least_starved(|| {
                let base = s.run();
                let slow = s.run_with_env(&[(gemini_protocol::env::BENCH_TOKEN_DELAY_US, &delay)]);
                (base, slow)
            });
            let moved = base
                .got
                .iter()
                .zip(&slow.got)
                .map(|(a, b)| (a - b) * 100.0)
                .fold(0.0, |w: f64, d| if d.abs() > w.abs() { d } else { w });
            let at_target = moved * 40.0 / added;
            worst = worst.max(at_target.abs());
            let capped = groups.iter().any(|g| g.1 < 1.0);
            let limits: Vec<String> = groups
                .iter()
                .map(|g| format!("{}", if capped { g.1 } else { g.0 }))
                .collect();
            let who = if groups.len() == 1 && !capped {
                "lone group, no bounds".to_string()
            } else {
                format!(
                    "{} {} {}",
                    if groups.len() == 1 {
                        "lone group"
                    } else {
                        "groups"
                    },
                    if capped { "MaxUtil" } else { "MinUtil" },
                    limits.join("/")
                )
            };
            t.row(
                format!("{name}; {who}"),
                format!(
                    "got {} → {} with +{added:.0} µs (device {:.1} → {:.1} %): {moved:+.2} pp, so {at_target:+.2} pp at the 50 µs target; host steal {:.0} %",
                    fmt_shares(&base.got),
                    fmt_shares(&slow.got),
                    base.busy * 100.0,
                    slow.busy * 100.0,
                    steal * 100.0
                ),
                "",
            );
        }
    }
    t.row(
        "the most any row would gain from a 50 µs round trip (from the rows above)",
        format!("{worst:.2} pp"),
        "irrelevant: well under the ±2 pp of a row",
    );
}

/// A report of work that ran for the last microsecond.
pub(crate) fn ran_1us() -> Vec<gemini_protocol::Span> {
    let end = gemini_protocol::clock::monotonic_us();
    vec![gemini_protocol::Span {
        start_us: end - 1,
        end_us: end,
    }]
}
