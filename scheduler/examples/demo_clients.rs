//! Simulated clients for `make demo` (until the hook exists): each client
//! is a thread with its own connection that takes tokens and "runs
//! kernels" by sleeping for the quota, reporting the time it used. At the
//! end it prints, per group, the configured share next to the share the
//! clients measured themselves.
//!
//! Usage: demo_clients IPC_DIR SECONDS GROUP[xN] [GROUP[xN] ...]

#![allow(clippy::unwrap_used, clippy::expect_used)]

use gemini_protocol::{Reply, Request, Role};
use gemini_scheduler::client::Client;
use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::{Duration, Instant};

fn main() -> anyhow::Result<()> {
    let args: Vec<String> = std::env::args().collect();
    anyhow::ensure!(
        args.len() >= 4,
        "usage: demo_clients IPC_DIR SECONDS GROUP[xN] ..."
    );
    let ipc = PathBuf::from(&args[1]);
    let secs: f64 = args[2].parse()?;
    let mut threads = Vec::new();
    for spec in &args[3..] {
        let (group, n) = match spec.split_once('x') {
            Some((g, n)) => (g.to_string(), n.parse::<usize>()?),
            None => (spec.clone(), 1),
        };
        for _ in 0..n {
            let ipc = ipc.clone();
            let group = group.clone();
            threads.push(std::thread::spawn(move || run_client(&ipc, &group, secs)));
        }
    }
    let mut used: BTreeMap<String, Duration> = BTreeMap::new();
    for t in threads {
        let (group, d) = t.join().expect("client thread panicked")?;
        *used.entry(group).or_default() += d;
    }
    let mut c = Client::connect(&ipc)?;
    let Reply::Status(status) = c.request(&Request::Status, Duration::from_secs(2))? else {
        anyhow::bail!("no status");
    };
    println!(
        "\n{:<12} {:>8} {:>8} {:>14}",
        "GROUP", "MinUtil", "MaxUtil", "achieved share"
    );
    for g in &status.groups {
        let share = used.get(&g.name).map_or(0.0, |d| d.as_secs_f64() / secs);
        println!(
            "{:<12} {:>8.2} {:>8.2} {:>14.3}",
            g.name, g.min_util, g.max_util, share
        );
    }
    Ok(())
}

fn run_client(ipc: &std::path::Path, group: &str, secs: f64) -> anyhow::Result<(String, Duration)> {
    let mut c = Client::connect(ipc)?;
    let t = Duration::from_secs(5);
    let hello = Request::Hello {
        role: Role::Client,
        group: group.into(),
        pid: std::process::id(),
        held: vec![],
    };
    match c.request(&hello, t)? {
        Reply::Welcome { .. } => {}
        Reply::Error(e) => anyhow::bail!("{}", e.message),
        other => anyhow::bail!("unexpected {other:?}"),
    }
    let end = Instant::now() + Duration::from_secs_f64(secs);
    let mut total = Duration::ZERO;
    let mut last = 0u64;
    while Instant::now() < end {
        let r = c.request(
            &Request::AcquireToken {
                device: 0,
                used_us: last,
                burst_us: 0,
            },
            Duration::from_secs(30),
        )?;
        let Reply::Token { quota_us, .. } = r else {
            anyhow::bail!("unexpected {r:?}")
        };
        let start = Instant::now();
        let left = end.saturating_duration_since(start);
        std::thread::sleep(Duration::from_micros(quota_us).min(left));
        let used = start.elapsed();
        total += used;
        last = used.as_micros() as u64;
    }
    c.request(
        &Request::ReleaseToken {
            device: 0,
            used_us: last,
        },
        t,
    )?;
    Ok((group.to_string(), total))
}
