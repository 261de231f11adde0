//! `make bench`: every target of DESIGN.md that can be measured without a
//! GPU, measured on this machine with the driver simulator, printed as a
//! table and written to `docs/benchmarks.md` (`--write PATH`).
//!
//! - hook fast path: launch rate of `gem-workload` (zero-length kernels,
//!   so the launch call itself is timed) with and without `libgemhook.so`,
//!   the token held throughout, runs interleaved, median of 5 each;
//! - token round trip: `AcquireToken` → `Token` over `ipc://`, token free;
//! - share accuracy: 2, 3 and 4 saturating groups (and a lone capped
//!   group) under the hook, shares over the last 10 s of a 12 s run from
//!   the simulator's busy log, worst deviation from the entitlement;
//! - work conservation: device busy share during the 2-group run;
//! - holder: first-kernel wait of a real client arriving at a held device
//!   (p50/p99 over ~60 arrivals, the first — which also connects to the
//!   scheduler — left out) and the time an allocation takes when the
//!   holder must give memory back;
//! - policy throughput: grants per second of the pure policy with 256
//!   always-busy clients on 8 devices, in virtual time;
//! - scheduler RSS with 256 connected clients;
//! - with `--chart PATH`, an SVG chart of two groups' shares over a run
//!   (see `chart`).

// A tool of the test suite: on failure it stops loudly, which is its job.
#![allow(clippy::expect_used, clippy::unwrap_used)]

mod chart;

use gemini_config::parse_resource;
use gemini_protocol::{Reply, Request, Role};
use gemini_scheduler::client::Client;
use gemini_scheduler::policy::{Action, Event, Params, Policy, entitlements};
use gemini_tests::soak::rss_kib;
use gemini_tests::{Gemini, SimEnv, bin, field, now_ns, reports};
use std::collections::BinaryHeap;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const SEC: u64 = 1_000_000_000;

fn rate(mut c: Command, secs: &str) -> f64 {
    c.args(["--seconds", secs, "--kernel-us", "0"]);
    kernels_per_second(c)
}

/// Kernels per second a run of `gem-workload` reports.
fn kernels_per_second(mut c: Command) -> f64 {
    let out = c.output().expect("run gem-workload");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let r = &reports(&out.stdout)[0];
    field(r, "kernels") as f64 / r["seconds"].parse::<f64>().expect("seconds")
}

/// `gem-workload` on `g`'s simulator: under the hook in `group`, or
/// without it.
fn workload(g: &Gemini, hooked: bool, group: &str) -> Command {
    if hooked {
        g.hooked(g.sim.workload(), group)
    } else {
        g.sim.workload()
    }
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

struct Table(Vec<(String, String, String)>);

impl Table {
    fn row(
        &mut self,
        what: impl Into<String>,
        measured: impl Into<String>,
        target: impl Into<String>,
    ) {
        let (w, m, t) = (what.into(), measured.into(), target.into());
        eprintln!("  {w}: {m}");
        self.0.push((w, m, t));
    }

    fn markdown(&self) -> String {
        let mut s = String::from("| what | measured | target |\n|---|---|---|\n");
        for (w, m, t) in &self.0 {
            s += &format!("| {w} | {m} | {t} |\n");
        }
        s
    }
}

fn fast_path(t: &mut Table) {
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
        "hook fast path: time added per launch",
        format!("{:.0} ns", (1e9 / h - 1e9 / p).max(0.0)),
        "≤ 50 ns",
    );
    t.row(
        "hooked / un-hooked launch rate",
        format!("{:.1} %", 100.0 * h / p),
        "≥ 97 %",
    );

    let mut c = client_of(&g, "bench");
    let mut rtt = Vec::new();
    for i in 0..3000 {
        let start = Instant::now();
        let r = c.request(
            &Request::AcquireToken {
                device: 0,
                used_us: 1,
                burst_us: 0,
            },
            Duration::from_secs(2),
        );
        let d = start.elapsed().as_secs_f64() * 1e6;
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
fn client_of(g: &Gemini, group: &str) -> Client {
    let mut c = Client::connect(&g.ipc()).expect("connect");
    let hello = Request::Hello {
        role: Role::Client,
        group: group.into(),
        pid: std::process::id(),
        held: vec![],
    };
    assert!(matches!(
        c.request(&hello, Duration::from_secs(5)),
        Ok(Reply::Welcome { .. })
    ));
    c
}

/// Round trips (µs) of a 16-byte message to a ZeroMQ ROUTER that echoes it
/// from another thread, over `ipc://`, as the scheduler's socket is
/// reached but with nothing done per message: what ZeroMQ itself costs
/// here (its I/O threads wake on each side).
fn zmq_floor() -> Vec<f64> {
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
fn unix_floor() -> Vec<f64> {
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

fn spawn_workload(g: &Gemini, group: &str, secs: &str) -> Child {
    let mut c = g.hooked(g.sim.workload(), group);
    c.args(["--seconds", secs, "--kernel-us", "500"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c.spawn().unwrap()
}

fn pid_of(out: &std::process::Output) -> u32 {
    field(&reports(&out.stdout)[0], "pid") as u32
}

/// Saturating groups for 12 s; worst deviation (pp) over the last 10 s and
/// the device's busy share.
fn shares(groups: &[(f64, f64)]) -> (f64, f64, Vec<f64>) {
    let mut conf = String::new();
    for (i, (min, max)) in groups.iter().enumerate() {
        conf += &format!("[g{i}]\nMinUtil={min}\nMaxUtil={max}\n");
    }
    let g = Gemini::start_with(SimEnv::default(), &conf, &["--log-level", "warn"]);
    let t0 = now_ns();
    let children: Vec<Child> = (0..groups.len())
        .map(|i| spawn_workload(&g, &format!("g{i}"), "12"))
        .collect();
    let outs: Vec<_> = children
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect();
    let busy = g.sim.busy(0, t0 + 2 * SEC, t0 + 12 * SEC);
    let want = entitlements(groups);
    let got: Vec<f64> = outs.iter().map(|o| busy.share(pid_of(o))).collect();
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs() * 100.0)
        .fold(0.0, f64::max);
    (worst, busy.device_share(), got)
}

fn share_accuracy(t: &mut Table) {
    for groups in [
        vec![(0.3, 1.0), (0.7, 1.0)],
        vec![(0.2, 1.0), (0.3, 1.0), (0.5, 1.0)],
        vec![(0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.4, 1.0)],
    ] {
        let (worst, busy, got) = shares(&groups);
        let mins: Vec<String> = groups.iter().map(|g| format!("{}", g.0)).collect();
        let gots: Vec<String> = got.iter().map(|g| format!("{g:.3}")).collect();
        t.row(
            format!(
                "share accuracy, {} groups MinUtil {}",
                groups.len(),
                mins.join("/")
            ),
            format!("worst {worst:.1} pp (got {})", gots.join("/")),
            "±2 pp",
        );
        if groups.len() == 2 {
            t.row(
                "work conservation (device busy, 2 groups)",
                format!("{:.1} %", busy * 100.0),
                "≥ 97 %",
            );
        }
    }
    let (worst, _, got) = shares(&[(0.0, 0.4)]);
    t.row(
        "MaxUtil 0.4 cap, lone client",
        format!("{:.3} ({worst:.1} pp off)", got[0]),
        "cap ± 2 pp",
    );
}

/// Two jobs of two ranks each on the same two GPUs, `MinUtil` 0.5 each,
/// five 200 µs kernels and an allreduce per step (the simulator's
/// `fake_allreduce`, which ends once the peer rank has launched its own),
/// for 12 s: the steps made, with the hook and without it, and how each
/// device's work split between the jobs over the last 10 s.
fn nccl_jobs(t: &mut Table) {
    let conf = "[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n";
    let run = |hooked: bool| {
        let g = Gemini::start_with(SimEnv::new(2, "16GiB"), conf, &["--log-level", "warn"]);
        let t0 = now_ns();
        let children: Vec<(usize, u32, Child)> = (0..4)
            .map(|i| {
                let (job, rank) = (i / 2, (i % 2) as u32);
                let group = ["a", "b"][job];
                let mut c = workload(&g, hooked, group);
                c.args(gemini_tests::allreduce_rank(job + 1, rank, "12"))
                    .stdout(Stdio::piped())
                    .stderr(Stdio::inherit());
                (job, rank, c.spawn().unwrap())
            })
            .collect();
        let done: Vec<(usize, u32, u64, u32)> = children
            .into_iter()
            .map(|(job, rank, c)| {
                let out = c.wait_with_output().unwrap();
                let r = &reports(&out.stdout)[0];
                (
                    job,
                    rank,
                    field(r, "kernels") as u64 / 5,
                    field(r, "pid") as u32,
                )
            })
            .collect();
        let mut worst = 0.0f64;
        let mut busy = 0.0f64;
        for dev in 0..2u32 {
            let b = g.sim.busy(dev, t0 + 2 * SEC, t0 + 12 * SEC);
            let of = |job: usize| -> f64 {
                done.iter()
                    .filter(|d| d.0 == job && d.1 == dev)
                    .map(|d| b.share(d.3))
                    .sum()
            };
            let split = of(0) / (of(0) + of(1)).max(f64::EPSILON);
            worst = worst.max((split - 0.5).abs() * 100.0);
            busy += b.device_share() / 2.0;
        }
        let steps = done.iter().map(|d| d.2).min().unwrap_or(0);
        (steps, worst, busy)
    };
    let (bare, _, bare_busy) = run(false);
    let (steps, worst, busy) = run(true);
    t.row(
        "two 2-GPU NCCL jobs on the same 2 GPUs (MinUtil 0.5/0.5, allreduce per step)",
        format!(
            "{steps} steps per rank in 12 s ({bare} without the hook); split of the work worst {worst:.1} pp; devices busy {:.1} % ({:.1} % without)",
            busy * 100.0,
            bare_busy * 100.0
        ),
        "no hang, ±2 pp",
    );
}

/// What the hook costs a program that is alone on the device: the kernel
/// throughput of a lone uncapped group launching 10 µs kernels with a
/// wait every 100 (default scheduler settings: tokens come and go), and
/// the time an allocation takes, with the hook and without it (runs
/// interleaved, median of 5 each).
fn overhead(t: &mut Table) {
    let g = Gemini::start_with(
        SimEnv::default(),
        "[alone]\n[mem]\nMemoryLimit=8GiB\n",
        &["--log-level", "warn"],
    );
    let kernels = |hooked: bool| {
        let mut c = workload(&g, hooked, "alone");
        c.args([
            "--seconds",
            "3",
            "--kernel-us",
            "10",
            "--iter-kernels",
            "100",
            "--wait",
            "stream",
        ]);
        kernels_per_second(c)
    };
    // 1 MiB at a time, 2048 of them: each one charged before the driver
    // is asked.
    let allocs = |hooked: bool| {
        let mut c = workload(&g, hooked, "mem");
        c.args(["--seconds", "0", "--mem", "2GiB", "--chunk", "1MiB"]);
        let out = c.output().expect("run gem-workload");
        let r = &reports(&out.stdout)[0];
        (field(r, "alloc_done_ns") - field(r, "alloc_start_ns")) as f64 / 2048.0 / 1000.0
    };
    let (mut plain, mut hooked) = (Vec::new(), Vec::new());
    let (mut plain_alloc, mut hooked_alloc) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        plain.push(kernels(false));
        hooked.push(kernels(true));
        plain_alloc.push(allocs(false));
        hooked_alloc.push(allocs(true));
    }
    let (p, h) = (percentile(&mut plain, 0.5), percentile(&mut hooked, 0.5));
    t.row(
        "lone uncapped group, 10 µs kernels, a wait every 100: kernel throughput lost to the hook (median of 5)",
        format!(
            "{:.1} % ({:.0} / {:.0} kernels/s without / with)",
            100.0 * (1.0 - h / p),
            p,
            h
        ),
        "≤ 1 %",
    );
    let (pa, ha) = (
        percentile(&mut plain_alloc, 0.5),
        percentile(&mut hooked_alloc, 0.5),
    );
    t.row(
        "memory cap: time added per cuMemAlloc (1 MiB, 2048 in a row, median of 5)",
        format!("{:.1} µs ({pa:.1} → {ha:.1} µs)", ha - pa),
        "",
    );
}

/// The workload shapes of the share matrix: what real programs do between
/// launches (`gem-workload` arguments).
pub const SHAPES: &[(&str, &[&str])] = &[
    ("(a) 20×1 ms, cuCtxSynchronize", gemini_tests::TRAINING_STEP),
    (
        "(a) 20×1 ms, cuStreamSynchronize",
        &[
            "--iter-kernels",
            "20",
            "--kernel-us",
            "1000",
            "--wait",
            "stream",
        ],
    ),
    (
        "(a) 20×1 ms, cuEventSynchronize",
        &[
            "--iter-kernels",
            "20",
            "--kernel-us",
            "1000",
            "--wait",
            "event",
        ],
    ),
    (
        "(b) 20×1 ms, blocking cuMemcpyDtoH",
        gemini_tests::BLOCKING_COPY_STEP,
    ),
    (
        "(c) sync after every 1 ms kernel",
        gemini_tests::SYNC_EVERY_KERNEL,
    ),
    (
        "(c) cuStreamQuery spin after every 1 ms kernel",
        &[
            "--iter-kernels",
            "1",
            "--kernel-us",
            "1000",
            "--wait",
            "query",
        ],
    ),
    (
        "(d) 20×1 ms, sync, 1 ms CPU gap",
        &[
            "--iter-kernels",
            "20",
            "--kernel-us",
            "1000",
            "--wait",
            "ctx",
            "--gap-ms",
            "1",
        ],
    ),
    (
        "(d) 20×1 ms, sync, 10 ms CPU gap",
        gemini_tests::GAPPED_STEP,
    ),
    (
        "(d) 20×1 ms, sync, 50 ms CPU gap",
        &[
            "--iter-kernels",
            "20",
            "--kernel-us",
            "1000",
            "--wait",
            "ctx",
            "--gap-ms",
            "50",
        ],
    ),
    (
        "(e) 200×0.1 ms, sync",
        &[
            "--iter-kernels",
            "200",
            "--kernel-us",
            "100",
            "--wait",
            "ctx",
        ],
    ),
    ("(e) 5×20 ms, sync", gemini_tests::LONG_KERNELS_STEP),
    (
        "(f) 2 threads, own streams, 10×1 ms, cuStreamSynchronize",
        &[
            "--threads",
            "2",
            "--own-streams",
            "--iter-kernels",
            "10",
            "--kernel-us",
            "1000",
            "--wait",
            "stream",
        ],
    ),
];

/// Group sets and processes per group of the share matrix.
const MIXES: &[(&[(f64, f64)], usize)] = &[
    (&[(0.3, 1.0), (0.7, 1.0)], 1),
    (&[(0.3, 1.0), (0.7, 1.0)], 2),
    (&[(0.3, 1.0), (0.7, 1.0)], 4),
    (&[(0.2, 1.0), (0.3, 1.0), (0.5, 1.0)], 1),
    (&[(0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.4, 1.0)], 1),
    // MaxUtil: a lone capped group, and a capped group beside an
    // uncapped one.
    (&[(0.0, 0.2)], 1),
    (&[(0.0, 0.4)], 1),
    (&[(0.0, 0.8)], 1),
    (&[(0.0, 0.4), (0.0, 1.0)], 1),
    // A lone group with no bounds: what the hook costs it.
    (&[(0.0, 1.0)], 1),
];

/// Share of the device one process of `args` keeps busy alone, without
/// the hook: its demand, and the ceiling this machine allows the shape.
fn demand(args: &[&str]) -> f64 {
    let sim = SimEnv::default();
    let t0 = now_ns();
    let mut c = sim.workload();
    c.args(["--seconds", "5"]).args(args);
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    sim.busy(0, t0 + SEC, t0 + 5 * SEC).device_share()
}

/// What groups `(MinUtil, MaxUtil)` whose demands are `demand` are entitled
/// to: water filling as for saturating groups, with each group's bounds
/// lowered to what it asks for (a group idle between bursts cannot use its
/// whole MinUtil; it is owed what it asks for, up to MinUtil).
///
/// `ceiling` is the share of the device the mix can keep busy at all
/// (below 1 where its processes pause between bursts, so that at times
/// none has work): that much is shared out, not the whole device.
fn entitled(groups: &[(f64, f64)], demand: &[f64], ceiling: f64) -> Vec<f64> {
    let bounds: Vec<(f64, f64)> = groups
        .iter()
        .zip(demand)
        .map(|(&(lo, hi), &d)| (lo.min(d), hi.min(d)))
        .collect();
    // Water filling spreads a whole device: spread the ceiling by scaling
    // the bounds to it and the result back.
    let c = ceiling.clamp(0.01, 1.0);
    let scaled: Vec<(f64, f64)> = bounds.iter().map(|&(lo, hi)| (lo / c, hi / c)).collect();
    let e = entitlements(&scaled);
    // A group never gets more than it asks for.
    e.iter()
        .zip(&bounds)
        .map(|(x, b)| (x * c).min(b.1))
        .collect()
}

/// Attempts per shape row where the host takes the CPU (see
/// `gemini_tests::cpu`): `GEM_BENCH_TRIES`, default 3.
fn tries() -> u32 {
    std::env::var("GEM_BENCH_TRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1)
}

/// `gemini_tests::cpu::least_starved` with the bench's tries.
fn least_starved<T>(measure: impl FnMut() -> T) -> (T, f64) {
    gemini_tests::cpu::least_starved(gemini_tests::cpu::MAX_STEAL, tries(), measure, |_, _, _| {})
}

/// `GEM_BENCH_SECONDS`, `GEM_BENCH_SHAPES` and `GEM_BENCH_MIXES` (see the
/// help): the length of a row, and the shapes and mixes to run (`None`:
/// all).
fn matrix_choice() -> (f64, Option<String>, Option<Vec<usize>>) {
    let secs: f64 = std::env::var("GEM_BENCH_SECONDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(12.0);
    let only: Option<String> = std::env::var("GEM_BENCH_SHAPES").ok();
    let mixes: Option<Vec<usize>> = std::env::var("GEM_BENCH_MIXES")
        .ok()
        .map(|v| v.split(',').filter_map(|x| x.parse().ok()).collect());
    (secs, only, mixes)
}

/// "0.300/0.700".
fn fmt_shares(v: &[f64]) -> String {
    v.iter()
        .map(|g| format!("{g:.3}"))
        .collect::<Vec<_>>()
        .join("/")
}

/// What the token round trip costs each row of the shapes matrix: every
/// row run as it is and with `GEM_BENCH_RTT_DELAY_US` (default 150) slept
/// before each token request, so that every hand-over and renewal takes
/// that much longer. The shares that move by `d` pp for the added delay
/// would move by about `d × 40 / added` pp if the round trip were brought
/// from 90 µs to the 50 µs of the target: the row says which.
fn rtt_matrix(t: &mut Table) {
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

/// Shares for every workload shape × mix, against the entitlement.
fn shape_matrix(t: &mut Table) {
    let (secs, only, mixes) = matrix_choice();
    for (name, args) in SHAPES {
        if only.as_ref().is_some_and(|o| !name.contains(o.as_str())) {
            continue;
        }
        let (alone, steal) = least_starved(|| demand(args));
        t.row(
            format!("{name}: one process alone, no hook"),
            format!(
                "device {:.1} %; host steal {:.0} %",
                alone * 100.0,
                steal * 100.0
            ),
            "",
        );
        for (m, (groups, procs)) in MIXES.iter().enumerate() {
            if mixes.as_ref().is_some_and(|ms| !ms.contains(&m)) {
                continue;
            }
            let s = gemini_tests::Scenario {
                groups,
                procs: *procs,
                args,
                seconds: secs,
                skip: 2.0,
            };
            let (o, steal) = least_starved(|| s.run());
            // Time when no process had work cannot be shared out: what the
            // groups are entitled to comes out of the time with demand.
            let ceiling = o.demand;
            let asks = vec![(alone * *procs as f64).min(1.0); groups.len()];
            let want = entitled(groups, &asks, ceiling);
            let asked = asks.iter().sum::<f64>().min(ceiling);
            let worst = o
                .got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs() * 100.0)
                .fold(0.0, f64::max);
            let capped = groups.iter().any(|g| g.1 < 1.0);
            let limits: Vec<String> = groups
                .iter()
                .map(|g| format!("{}", if capped { g.1 } else { g.0 }))
                .collect();
            // A cap is never passed (by more than the bin's noise).
            let over_cap = groups
                .iter()
                .zip(&o.got)
                .any(|(g, got)| g.1 < 1.0 && *got > g.1 + 0.005);
            // Work conservation is for MinUtil: capped time is not asked.
            let conserving = capped || o.busy >= 0.97 * asked;
            t.row(
                format!(
                    "{name}; {} {} {}, {procs} proc/group",
                    if groups.len() == 1 { "lone group" } else { "groups" },
                    if capped { "MaxUtil" } else { "MinUtil" },
                    limits.join("/")
                ),
                format!(
                    "{} {worst:.1} pp (got {}, entitled {}), device {:.1} % of {:.1} % asked{}; host steal {:.0} %",
                    if worst <= 2.0 && conserving && !over_cap {
                        "ok"
                    } else {
                        "MISSED"
                    },
                    fmt_shares(&o.got),
                    fmt_shares(&want),
                    o.busy * 100.0,
                    asked * 100.0,
                    if ceiling < 0.995 {
                        format!(" (some process had work {:.1} % of the time)", ceiling * 100.0)
                    } else {
                        String::new()
                    },
                    steal * 100.0
                ),
                if capped {
                    "±2 pp, never over the cap"
                } else {
                    "±2 pp; device ≥ 97 % of what is asked"
                },
            );
        }
    }
}

fn holder(t: &mut Table) {
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

fn policy_throughput(t: &mut Table) {
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
                    used_us: 0,
                    burst_us: 0,
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
            used_us: used,
            burst_us: 0,
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

fn scheduler_rss(t: &mut Table) {
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
                used_us: 0,
                burst_us: 0,
            },
            Duration::from_secs(30),
        )
        .unwrap();
        c.request(
            &Request::ReleaseToken {
                device: dev,
                used_us: 100,
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

/// The parts of the bench, in the order they run.
const PARTS: [&str; 9] = [
    "fast", "shares", "nccl", "overhead", "shapes", "holder", "policy", "rss", "rtt",
];

/// Parts run only when `--only` names them (they take long).
const ON_REQUEST: [&str; 1] = ["rtt"];

#[derive(clap::Parser, Debug)]
#[command(
    about = "Measures gemini's targets on the driver simulator (no GPU) and prints them as a table",
    after_help = "Environment: GEMINI_BIN_DIR (the binaries; default: next to this one), \
GEM_BENCH_TRIES (attempts at a shapes row while the host steals over 10 % of \
the CPU; default 3), GEM_BENCH_SECONDS (length of a shapes row; default 12), GEM_BENCH_SHAPES (only the \
shapes whose name contains it), GEM_BENCH_MIXES (only these group mixes, by index: 0 two groups, 1 and 2 two and four processes per group, 3 three groups, 4 four groups, 5-7 a lone group capped at 0.2, 0.4, 0.8, 8 a group capped at 0.4 beside an uncapped one, 9 a lone group with no bounds; e.g. 0,2; the rtt part runs 0,6,8,9 unless told), GEM_BENCH_RTT_DELAY_US (the rtt part: the sleep added before each token request; default 150). The rtt part runs only when --only names it: every shapes row with and without a longer token round trip, to show what the round trip costs."
)]
struct Args {
    /// Also write the table, with the date, commit and machine, to this file
    #[arg(long, value_name = "PATH")]
    write: Option<std::path::PathBuf>,
    /// Run only these parts (comma-separated)
    #[arg(long, value_delimiter = ',', value_parser = PARTS)]
    only: Option<Vec<String>>,
    /// Write an SVG chart of two groups' shares over a 12 s run (one
    /// leaving and coming back, a live resource.conf edit) to this file;
    /// alone, without --only, runs nothing else
    #[arg(long, value_name = "PATH")]
    chart: Option<std::path::PathBuf>,
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let write = args.write.map(|p| p.display().to_string());
    let machine = machine();
    eprintln!("gem-bench on {machine}");
    let mut t = Table(Vec::new());
    let started = Instant::now();
    let cpu_before = gemini_tests::cpu::CpuTimes::now();
    let only = match (&args.chart, args.only) {
        (Some(_), None) => Some(Vec::new()),
        (_, only) => only,
    };
    if let Some(path) = &args.chart {
        let phases = chart::write(path);
        let shown: Vec<String> = phases
            .iter()
            .map(|(a, b)| format!("{a:.2}/{b:.2}"))
            .collect();
        t.row(
            format!(
                "chart of a run ({}): mean shares a/b, both / b away / both / after the edit",
                path.display()
            ),
            shown.join(" · "),
            "0.30/0.70 · 1.00/0 · 0.30/0.70 · 0.60/0.40",
        );
    }
    type Part = (&'static str, fn(&mut Table));
    let parts: [Part; 9] = [
        ("fast", fast_path),
        ("shares", share_accuracy),
        ("nccl", nccl_jobs),
        ("overhead", overhead),
        ("shapes", shape_matrix),
        ("holder", holder),
        ("policy", policy_throughput),
        ("rss", scheduler_rss),
        ("rtt", rtt_matrix),
    ];
    for (name, run) in parts {
        let asked = match &only {
            None => !ON_REQUEST.contains(&name),
            Some(o) => o.iter().any(|x| x == name),
        };
        if asked {
            run(&mut t);
        }
    }
    let date = Command::new("date")
        .arg("-u")
        .arg("+%Y-%m-%d")
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let commit = Command::new("git")
        .args(["rev-parse", "--short", "HEAD"])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default();
    let table = t.markdown();
    let steal = gemini_tests::cpu::CpuTimes::now().steal_since(&cpu_before);
    println!("\n{table}");
    println!(
        "(took {:.0} s; the host took {:.1} % of the CPU time)",
        started.elapsed().as_secs_f64(),
        steal * 100.0
    );
    if let Some(path) = write {
        let steal_pct = steal * 100.0;
        let latest = format!(
            "Measured by `make bench` on {date} (commit {commit}), on {machine}, with the driver simulator (no GPU); the VM's host took {steal_pct:.1} % of its CPU time (steal) during the run.\nEach row is a target of DESIGN.md; `make bench` re-measures them all.\n\n{table}\nNotes:\n\n- Shares are measured from the simulator's busy log (the device side), not from the scheduler's accounting.\n- The simulator's launch takes about 1 µs, so the hooked/un-hooked ratio is lower than on a real GPU, where launches take several µs; the added nanoseconds are the hook's own, and vary from run to run on a VM.\n- Real-GPU figures are in `docs/gpu-results.md` (`make test-gpu`).\n"
        );
        let old = std::fs::read_to_string(&path).unwrap_or_default();
        std::fs::write(&path, with_latest(&old, &latest)).unwrap();
        eprintln!("wrote {path}");
    }
    let _ = bin("gem-schd");
}

/// Marks the part of the benchmarks file that `--write` replaces.
const LATEST_BEGIN: &str = "<!-- gem-bench --write: latest run -->";
const LATEST_END: &str = "<!-- end of the latest run -->";

/// The benchmarks file `old` with its latest run replaced by `latest`;
/// everything else (dated sections written by hand: measurements before
/// and after a change) is kept. A file without the markers gets the run
/// under its title, before what it had.
fn with_latest(old: &str, latest: &str) -> String {
    let block = format!("{LATEST_BEGIN}\n{latest}{LATEST_END}\n");
    if let (Some(a), Some(b)) = (old.find(LATEST_BEGIN), old.find(LATEST_END))
        && a < b
    {
        let rest = &old[b + LATEST_END.len()..];
        return format!(
            "{}{block}{}",
            &old[..a],
            rest.strip_prefix('\n').unwrap_or(rest)
        );
    }
    let body = old
        .strip_prefix("# Benchmarks\n")
        .unwrap_or(old)
        .trim_start();
    if body.is_empty() {
        format!("# Benchmarks\n\n{block}")
    } else {
        format!("# Benchmarks\n\n{block}\n{body}")
    }
}

#[cfg(test)]
mod tests {
    use super::{entitled, with_latest};

    /// `--write` replaces only the latest run: the dated sections after
    /// it survive (it used to overwrite the whole file).
    #[test]
    fn writing_a_run_keeps_the_sections_written_by_hand() {
        let first = with_latest("", "run 1\n");
        assert!(first.starts_with("# Benchmarks\n") && first.contains("run 1"));
        let edited = format!("{first}\n## Before and after a change\n\nkept\n");
        let second = with_latest(&edited, "run 2\n");
        assert!(
            second.contains("run 2") && !second.contains("run 1"),
            "{second}"
        );
        assert!(
            second.ends_with("## Before and after a change\n\nkept\n"),
            "{second}"
        );
        assert_eq!(with_latest(&second, "run 2\n"), second);
        let legacy = with_latest("# Benchmarks\n\nold table\n\n## Section\n", "run\n");
        assert!(
            legacy.contains("run\n") && legacy.contains("old table\n\n## Section\n"),
            "{legacy}"
        );
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6)
    }

    #[test]
    fn entitlement_shares_out_only_the_time_with_demand() {
        let groups = [(0.3, 1.0), (0.7, 1.0)];
        // Saturating groups share the whole device by their minimums.
        let e = entitled(&groups, &[1.0, 1.0], 1.0);
        assert!(close(&e, &[0.3, 0.7]), "{e:?}");
        // hi asks 0.57, under its minimum: it gets all of it, and lo the
        // rest of the 0.95 in which some process had work (not of 1.0).
        let e = entitled(&groups, &[0.57, 0.57], 0.95);
        assert!(close(&e, &[0.38, 0.57]), "{e:?}");
        // Neither gets more than it asks for.
        let e = entitled(&groups, &[0.285, 0.285], 0.6);
        assert!(close(&e, &[0.285, 0.285]), "{e:?}");
    }
}
