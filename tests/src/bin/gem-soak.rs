//! `make soak`: the long fault and load runs — 2 minutes of clients
//! SIGKILLed at random (and the scheduler killed and restarted once), then
//! 60 s of 256 concurrent clients over 4 devices. Prints what it saw;
//! exits non-zero on any mismatch or lost reply.

// A tool of the test suite: on failure it stops loudly, which is its job.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use gemini_tests::soak::{chaos, load};
use std::time::Duration;

fn main() {
    let chaos_secs: u64 = std::env::var("SOAK_CHAOS_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(120);
    let load_secs: u64 = std::env::var("SOAK_LOAD_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(60);
    let c = chaos(Duration::from_secs(chaos_secs), 0x5eed);
    println!(
        "chaos {chaos_secs} s: {} processes started, {} SIGKILLed, scheduler restarted {} time(s), mismatches: {:?}",
        c.started, c.killed, c.scheduler_restarts, c.mismatches
    );
    let l = load(Duration::from_secs(load_secs), 256);
    println!(
        "load {load_secs} s, 256 clients over 4 devices: {} requests answered, {} lost; token wait p50 {:.0} us, p99 {:.0} us; scheduler RSS {:.1} MB at start, {:.1} MB a third of the way in, {:.1} MB at the end",
        l.requests,
        l.lost,
        l.token_p50_us,
        l.token_p99_us,
        l.rss_kib.0 as f64 / 1024.0,
        l.rss_kib.1 as f64 / 1024.0,
        l.rss_kib.2 as f64 / 1024.0
    );
    if !c.mismatches.is_empty() || l.lost > 0 {
        std::process::exit(1);
    }
}
