//! Fault and load scenarios, shared by the short versions in `make test`
//! and the long ones in `make soak` (`gem-soak`).

use crate::{Gemini, SimEnv, bin};
use gemini_protocol::{Reply, Request, Role, StatusReport};
use gemini_scheduler::client::Client;
use std::collections::BTreeMap;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A small deterministic random number generator (xorshift64*): the
/// scenarios must be repeatable from a seed.
#[derive(Debug)]
pub struct Rng(u64);

impl Rng {
    /// From a seed.
    pub fn new(seed: u64) -> Rng {
        Rng(seed.max(1))
    }

    /// Next number.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// In `0..n`.
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n.max(1)
    }
}

/// What a chaos run observed.
#[derive(Debug)]
pub struct ChaosReport {
    /// Processes started.
    pub started: usize,
    /// Processes killed with SIGKILL.
    pub killed: usize,
    /// Times the scheduler was SIGKILLed and restarted.
    pub scheduler_restarts: usize,
    /// Mismatches between the scheduler's accounting and the living
    /// processes (empty: none).
    pub mismatches: Vec<String>,
}

const GROUPS: [&str; 3] = ["a", "b", "c"];

struct Proc {
    child: Child,
    group: &'static str,
    mem: u64,
}

fn spawn(g: &Gemini, rng: &mut Rng) -> Proc {
    let group = GROUPS[rng.below(3) as usize];
    let mem = rng.below(4) * (64 << 20);
    let mut c = g.hooked(g.sim.workload(), group);
    c.args([
        "--seconds",
        "600",
        "--kernel-us",
        &(200 + rng.below(2000)).to_string(),
        "--mem",
        &mem.to_string(),
    ]);
    if rng.below(3) == 0 {
        c.args(["--burst-ms", "20", "--gap-ms", "30"]);
    }
    c.stdout(Stdio::null()).stderr(Stdio::null());
    Proc {
        child: c.spawn().expect("spawn gem-workload"),
        group,
        mem,
    }
}

fn kill(p: &mut Proc) {
    let _ = p.child.kill();
    let _ = p.child.wait();
}

/// Memory the scheduler accounts per group, over all devices.
fn memory_by_group(s: &StatusReport) -> BTreeMap<String, u64> {
    let mut m = BTreeMap::new();
    for d in &s.devices {
        for g in &d.groups {
            *m.entry(g.group.clone()).or_insert(0) += g.memory_used;
        }
    }
    m
}

/// Runs hooked workloads (three groups, random memory, some bursty) for
/// `duration`, SIGKILLing random ones at random moments — mid-token,
/// mid-allocation, whatever they are doing — and starting new ones; kills
/// and restarts the scheduler in the middle. Then checks that the
/// scheduler's clients and memory match the processes still alive, and
/// that everything is released once they are gone.
pub fn chaos(duration: Duration, seed: u64) -> ChaosReport {
    let mut g = Gemini::start_with(
        SimEnv::new(2, "64GiB"),
        "[a]\nMinUtil=0.3\nMemoryLimit=4GiB\n[b]\nMinUtil=0.2\nMaxUtil=0.6\nMemoryLimit=4GiB\n[c]\nMemoryLimit=4GiB\n",
        &["--log-level", "info"],
    );
    let mut rng = Rng::new(seed);
    let mut live: Vec<Proc> = Vec::new();
    let mut report = ChaosReport {
        started: 0,
        killed: 0,
        scheduler_restarts: 0,
        mismatches: Vec::new(),
    };
    let start = Instant::now();
    let mut restarted = false;
    while start.elapsed() < duration {
        while live.len() < 8 {
            live.push(spawn(&g, &mut rng));
            report.started += 1;
        }
        std::thread::sleep(Duration::from_millis(rng.below(300)));
        if rng.below(2) == 0 && !live.is_empty() {
            let i = rng.below(live.len() as u64) as usize;
            let mut p = live.swap_remove(i);
            kill(&mut p);
            report.killed += 1;
        }
        if !restarted && start.elapsed() >= duration / 2 {
            restarted = true;
            g.kill_scheduler();
            std::thread::sleep(Duration::from_millis(300));
            g.start_scheduler();
            report.scheduler_restarts += 1;
        }
    }
    // The survivors must be accounted exactly: give them time to (re)register.
    let want_clients = live.len();
    let mut want_mem: BTreeMap<String, u64> = BTreeMap::new();
    for p in &live {
        if p.mem > 0 {
            *want_mem.entry(p.group.to_string()).or_insert(0) += p.mem;
        }
    }
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut last = None;
    while Instant::now() < deadline {
        // A status not answered in time (the host stalled us) is tried
        // again; one never answered ends in a mismatch below.
        let Some(s) = g.try_status() else {
            last = Some("the scheduler does not answer status".into());
            continue;
        };
        let mem: BTreeMap<String, u64> = memory_by_group(&s)
            .into_iter()
            .filter(|(_, v)| *v > 0)
            .collect();
        if s.clients.len() == want_clients && mem == want_mem {
            last = None;
            break;
        }
        last = Some(format!(
            "clients {} (want {want_clients}), memory {mem:?} (want {want_mem:?})",
            s.clients.len()
        ));
        std::thread::sleep(Duration::from_millis(100));
    }
    report.mismatches.extend(last);
    for p in &mut live {
        kill(p);
    }
    let deadline = Instant::now() + Duration::from_secs(3);
    loop {
        let Some(s) = g.try_status() else {
            if Instant::now() > deadline {
                report
                    .mismatches
                    .push("after all died: the scheduler does not answer status".into());
                break;
            }
            continue;
        };
        let held: u64 = memory_by_group(&s).values().sum();
        let tokens = s
            .devices
            .iter()
            .filter(|d| d.token_client.is_some())
            .count();
        if s.clients.is_empty() && held == 0 && tokens == 0 {
            break;
        }
        if Instant::now() > deadline {
            report.mismatches.push(format!(
                "after all died: {} clients, {held} bytes, {tokens} tokens still accounted",
                s.clients.len()
            ));
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    report
}

/// What a load run observed.
#[derive(Debug)]
pub struct LoadReport {
    /// Requests answered.
    pub requests: u64,
    /// Requests not answered within 10 s.
    pub lost: u64,
    /// Token wait, p50 and p99, microseconds.
    pub token_p50_us: f64,
    /// Token wait, p99, microseconds.
    pub token_p99_us: f64,
    /// Scheduler RSS when all clients had connected, a third of the way
    /// (the accounting window filled), and at the end (KiB).
    pub rss_kib: (u64, u64, u64),
}

/// Resident memory of process `pid`, KiB (0 if unknown).
pub fn rss_kib(pid: u32) -> u64 {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// `clients` connections (one thread each) over 4 devices, each asking for
/// tokens and memory as fast as answers come, for `duration`.
pub fn load(duration: Duration, clients: usize) -> LoadReport {
    let g = Gemini::start_with(
        SimEnv::new(4, "64GiB"),
        "[a]\nMemoryLimit=unlimited\n[b]\nMinUtil=0.5\nMemoryLimit=unlimited\n",
        &["--log-level", "warn"],
    );
    let pid = g.scheduler_pid().expect("scheduler runs");
    let ctx = zmq::Context::new();
    let ipc = g.ipc();
    let barrier = std::sync::Arc::new(std::sync::Barrier::new(clients + 1));
    let threads: Vec<_> = (0..clients)
        .map(|i| {
            let (ctx, ipc, barrier) = (ctx.clone(), ipc.clone(), barrier.clone());
            std::thread::spawn(move || {
                let t = Duration::from_secs(10);
                let mut c = Client::connect_in(&ctx, &ipc).expect("connect");
                let group = if i % 2 == 0 { "a" } else { "b" };
                let hello = Request::Hello {
                    role: Role::Client,
                    group: group.into(),
                    pid: std::process::id(),
                    held: vec![],
                    job: None,
                    build: gemini_protocol::BUILD.into(),
                };
                let ok = matches!(c.request(&hello, t), Ok(Reply::Welcome { .. }));
                barrier.wait();
                let (mut answered, mut lost, mut waits) = (0u64, 0u64, Vec::new());
                if !ok {
                    return (0, 1, waits);
                }
                let device = (i % 4) as u32;
                let end = Instant::now() + duration;
                // What ran since the last report, µs on CLOCK_MONOTONIC.
                let mut ran: Vec<gemini_protocol::Span> = Vec::new();
                while Instant::now() < end {
                    let start = Instant::now();
                    match c.request(
                        &Request::AcquireToken {
                            device,
                            ran: std::mem::take(&mut ran),
                            in_flight: false,
                            burst_us: 0,
                            rtt_us: 100,
                            launch_us: 0,
                        },
                        t,
                    ) {
                        Ok(Reply::Token { .. }) => {
                            answered += 1;
                            waits.push(start.elapsed().as_secs_f64() * 1e6);
                        }
                        _ => lost += 1,
                    }
                    let now = gemini_protocol::clock::monotonic_us();
                    ran = vec![gemini_protocol::Span {
                        start_us: now - 50,
                        end_us: now,
                    }];
                    for req in [
                        Request::ReserveMemory {
                            device,
                            bytes: 1 << 20,
                        },
                        Request::ReleaseMemory {
                            device,
                            bytes: 1 << 20,
                        },
                    ] {
                        match c.request(&req, t) {
                            Ok(Reply::Memory { .. }) => answered += 1,
                            _ => lost += 1,
                        }
                    }
                }
                let _ = c.request(
                    &Request::ReleaseToken {
                        device,
                        ran,
                        in_flight: false,
                    },
                    t,
                );
                (answered, lost, waits)
            })
        })
        .collect();
    barrier.wait();
    let rss_start = rss_kib(pid);
    std::thread::sleep(duration / 3);
    let rss_third = rss_kib(pid);
    let mut report = LoadReport {
        requests: 0,
        lost: 0,
        token_p50_us: 0.0,
        token_p99_us: 0.0,
        rss_kib: (rss_start, rss_third, 0),
    };
    let mut waits = Vec::new();
    for t in threads {
        let (a, l, w) = t.join().expect("load thread");
        report.requests += a;
        report.lost += l;
        waits.extend(w);
    }
    report.rss_kib.2 = rss_kib(pid);
    waits.sort_by(|a, b| a.total_cmp(b));
    if !waits.is_empty() {
        report.token_p50_us = waits[waits.len() / 2];
        report.token_p99_us = waits[((waits.len() - 1) as f64 * 0.99) as usize];
    }
    let _ = bin("gem-schd");
    report
}
