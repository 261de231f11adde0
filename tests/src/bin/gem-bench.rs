//! `make bench`: the figures behind DESIGN.md's targets that exist so far,
//! measured on this machine with the driver simulator.
//!
//! - hook fast path: launch rate of `gem-workload` (zero-length kernels,
//!   so the launch call itself is what is timed) with and without
//!   `libgemhook.so`, the token held throughout (a scheduler with 10 s
//!   tokens), runs interleaved, median of each;
//! - token round trip: `AcquireToken` → `Token` between two processes
//!   over the `ipc://` socket, the token free (a lone client).

// A tool of the test suite: on failure it stops loudly, which is its job.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use gemini_protocol::{Reply, Request, Role};
use gemini_scheduler::client::Client;
use gemini_tests::{Gemini, SimEnv, field, reports};
use std::process::Command;
use std::time::{Duration, Instant};

fn rate(mut c: Command, secs: &str) -> f64 {
    c.args(["--seconds", secs, "--kernel-us", "0"]);
    let out = c.output().expect("run gem-workload");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = &reports(&out.stdout)[0];
    field(r, "kernels") as f64 / r["seconds"].parse::<f64>().expect("seconds")
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn percentile(v: &mut [f64], p: f64) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn machine() -> String {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .map(|l| l.split(':').nth(1).unwrap_or("").trim().to_string())
        })
        .unwrap_or_else(|| "unknown CPU".into());
    let cores = std::thread::available_parallelism().map_or(0, |n| n.get());
    format!("{cpu}, {cores} cores")
}

fn main() {
    println!("gem-bench on {}", machine());
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

    // Fast path.
    let rounds = 5;
    let (mut plain, mut hooked) = (Vec::new(), Vec::new());
    rate(g.sim.workload(), "0.3"); // warm-up
    for _ in 0..rounds {
        plain.push(rate(g.sim.workload(), "1"));
        hooked.push(rate(g.hooked(g.sim.workload(), "bench"), "1"));
    }
    let (p, h) = (median(&mut plain), median(&mut hooked));
    let added_ns = (1e9 / h - 1e9 / p).max(0.0);

    // Token round trip.
    let mut c = Client::connect(&g.ipc()).expect("connect");
    let hello = Request::Hello {
        role: Role::Client,
        group: "bench".into(),
        pid: std::process::id(),
        held: vec![],
    };
    assert!(matches!(
        c.request(&hello, Duration::from_secs(2)),
        Ok(Reply::Welcome { .. })
    ));
    let mut rtt = Vec::new();
    for i in 0..3000 {
        let t = Instant::now();
        let r = c.request(
            &Request::AcquireToken {
                device: 0,
                used_us: 1,
                burst_us: 0,
            },
            Duration::from_secs(2),
        );
        let d = t.elapsed().as_secs_f64() * 1e6;
        assert!(matches!(r, Ok(Reply::Token { .. })), "{r:?}");
        let _ = c.request(
            &Request::ReleaseToken {
                device: 0,
                used_us: 1,
            },
            Duration::from_secs(2),
        );
        if i >= 200 {
            rtt.push(d);
        }
    }
    let (rtt50, rtt99) = (percentile(&mut rtt, 0.5), percentile(&mut rtt, 0.99));

    println!("\n| what | measured | target |");
    println!("|---|---|---|");
    println!(
        "| launch rate without hook (median of {rounds}) | {:.2} M launches/s | |",
        p / 1e6
    );
    println!(
        "| launch rate with hook, token held (median of {rounds}) | {:.2} M launches/s | |",
        h / 1e6
    );
    println!("| hook fast path: time added per launch | {added_ns:.0} ns | ≤ 50 ns |");
    println!(
        "| hooked / un-hooked launch rate | {:.1} % | ≥ 97 % |",
        100.0 * h / p
    );
    println!("| token round trip over ipc://, median | {rtt50:.0} µs | ≤ 50 µs |");
    println!("| token round trip over ipc://, p99 | {rtt99:.0} µs | ≤ 200 µs |");
}
