//! `--only latency`: an inference-like loop beside a training-like job, on
//! a time-sliced simulated GPU (an inference server's decode beside training, scaled to the
//! simulator): how much slower the latency-bound loop's steps get, with
//! and without gemini, and how long a group owed time waits for the
//! device behind another training job.

use super::{Table, percentile, workload};
use gemini_tests::{
    BLOCKING_COPY_STEP as TRAIN, DECODE_STEP as DECODE, FRAMEWORK_STEP, Gemini, SimEnv, field,
    reports,
};
use std::os::unix::process::CommandExt;
use std::process::{Child, Command, Stdio};

const SECONDS: &str = "6";
/// Steps before this (ns after the first) are the warm-up, left out.
const WARM_NS: u64 = 1_000_000_000;

/// Step times (ms) from a `--demand-file`, the warm-up left out.
fn step_ms(path: &std::path::Path) -> Vec<f64> {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    let steps: Vec<(u64, u64)> = text
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace().map(|v| v.parse::<u64>().ok());
            Some((w.next()??, w.next()??))
        })
        .collect();
    let first = steps.first().map_or(0, |s| s.0);
    steps
        .iter()
        .filter(|s| s.0 >= first + WARM_NS)
        .map(|&(a, b)| (b - a) as f64 / 1e6)
        .collect()
}

struct Run {
    /// p50, p99, max of the decode steps (ms).
    decode: Option<(f64, f64, f64)>,
    /// Training steps per second.
    train: Option<f64>,
    /// Kernels per second of the decode and of the training.
    kernels: (f64, f64),
}

/// The CPUs this process may run on, in order.
fn allowed_cpus() -> Vec<usize> {
    // SAFETY: `set` is a plain bit set that sched_getaffinity fills for
    // the calling thread; its size is passed.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return Vec::new();
        }
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| libc::CPU_ISSET(c, &set))
            .collect()
    }
}

/// Which CPU each of the two processes of a row runs on (`first`: the
/// decode, or the 0.3 trainer): CPUs of their own where the machine has
/// two or more, as on a GPU server, so that a step's time is the
/// device's and the scheduler's, not a wake-up queued behind the other
/// process's CPU-bound launch loop on a 2-core VM (measured: the
/// decode's wait woke 1.0-1.7 ms after its work ended, in up to 1 % of
/// its steps, while the framework-like training launched beside it).
/// `gem-schd` and the hooks' threads run anywhere.
fn cpu_for(first: bool) -> Option<usize> {
    let cpus = allowed_cpus();
    (cpus.len() >= 2).then(|| cpus[usize::from(!first)])
}

/// Runs `c` on `cpu` only.
fn pin(c: &mut Command, cpu: usize) {
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls sched_setaffinity, a system call, on a set on its own stack.
    unsafe {
        c.pre_exec(move || {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            libc::CPU_SET(cpu, &mut set);
            if libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) != 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

fn spawn(
    g: &Gemini,
    hooked: bool,
    group: &str,
    args: &[&str],
    demand: &std::path::Path,
    cpu: Option<usize>,
) -> Child {
    let mut c = workload(g, hooked, group);
    if let Some(cpu) = cpu {
        pin(&mut c, cpu);
    }
    c.args(args)
        .args(["--seconds", SECONDS, "--demand-file"])
        .arg(demand)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c.spawn().expect("spawn gem-workload")
}

/// One time-sliced GPU under `gem-schd` with `conf`.
fn machine(conf: &str) -> Gemini {
    Gemini::start_with(
        SimEnv::new(1, "16GiB").time_sliced(),
        conf,
        &["--log-level", "warn"],
    )
}

fn finish(c: Child) -> std::process::Output {
    let out = c.wait_with_output().expect("gem-workload");
    assert!(out.status.success(), "gem-workload failed");
    out
}

/// p50, p99 and max of the steps in a `--demand-file` (ms).
fn spread(path: &std::path::Path) -> (f64, f64, f64) {
    let mut v = step_ms(path);
    (
        percentile(&mut v, 0.5),
        percentile(&mut v, 0.99),
        percentile(&mut v, 1.0),
    )
}

/// Runs a decode loop (`decode`: its group, or none) beside a training
/// job (`train`: its group, or none), hooked or not.
fn run(conf: &str, hooked: bool, decode: Option<&str>, train: Option<&str>) -> Run {
    run_with(TRAIN, 20, conf, hooked, decode, train)
}

/// [`run`] with the training's arguments `train_args`, `per_step`
/// kernels a step.
fn run_with(
    train_args: &[&str],
    per_step: u64,
    conf: &str,
    hooked: bool,
    decode: Option<&str>,
    train: Option<&str>,
) -> Run {
    let g = machine(conf);
    let dir = g.sim.path().to_path_buf();
    let (dd, td) = (dir.join("decode-steps"), dir.join("train-steps"));
    let t = train.map(|grp| spawn(&g, hooked, grp, train_args, &td, cpu_for(false)));
    let d = decode.map(|grp| spawn(&g, hooked, grp, DECODE, &dd, cpu_for(true)));
    let rate = |out: &std::process::Output| {
        let r = &reports(&out.stdout)[0];
        field(r, "kernels") as f64 / r["seconds"].parse::<f64>().unwrap_or(1.0)
    };
    let d = d.map(finish);
    let decode = d.as_ref().map(|_| spread(&dd));
    let t = t.map(finish);
    let train = t.as_ref().map(|out| rate(out) / per_step as f64);
    let kernels = (d.as_ref().map_or(0.0, rate), t.as_ref().map_or(0.0, rate));
    Run {
        decode,
        train,
        kernels,
    }
}

/// A trainer of short kernels: bursts of 100 × 200 µs, each waited for,
/// no pause between them.
const SHORT_KERNEL_TRAIN: &[&str] = &[
    "--iter-kernels",
    "100",
    "--kernel-us",
    "200",
    "--wait",
    "stream",
];

/// The decode beside [`SHORT_KERNEL_TRAIN`], `Latency=critical` at
/// MinUtil 0.3 beside the trainer's 0.7, with and without gemini: the
/// decode's steps against `alone`, and the trainer's share of the device
/// against the time the decode leaves it.
fn short_kernels(t: &mut Table, alone: (f64, f64, f64)) {
    let critical = "[decode]\nMinUtil=0.3\nLatency=critical\n[train]\nMinUtil=0.7\n";
    for hooked in [false, true] {
        let r = run_with(
            SHORT_KERNEL_TRAIN,
            100,
            critical,
            hooked,
            Some("decode"),
            Some("train"),
        );
        let (p50, p99, _) = r.decode.expect("decode ran");
        let (decode_busy, train_busy) = (r.kernels.0 * 100e-6, r.kernels.1 * 200e-6);
        t.row(
            if hooked {
                "latency: decode beside a trainer of 200 µs kernels (100 a burst, waited for), gemini, decode `Latency=critical` (MinUtil 0.3 / 0.7)"
            } else {
                "latency: decode beside a trainer of 200 µs kernels (100 a burst, waited for), no gemini (time-slicing)"
            },
            format!(
                "p50 {p50:.2} ms ({:.2}×), p99 {p99:.2} ms ({:.2}×); trainer {train_busy:.3} of the device, {:.2} of the time the decode leaves",
                p50 / alone.0,
                p99 / alone.1,
                train_busy / (1.0 - decode_busy).max(f64::MIN_POSITIVE),
            ),
            if hooked {
                "p99 ≤ 1.25×; trainer ≥ 0.9 of the time the decode leaves"
            } else {
                "the reference for the row below"
            },
        );
    }
}

pub fn latency(t: &mut Table) {
    let conf = "[decode]\nMinUtil=0.3\n[train]\nMinUtil=0.7\n";
    let alone = alone();
    let fmt = |(p50, p99, max): (f64, f64, f64)| {
        format!(
            "p50 {p50:.2} ms ({:.2}×), p99 {p99:.2} ms ({:.2}×), max {max:.2} ms",
            p50 / alone.0,
            p99 / alone.1
        )
    };
    t.row(
        "latency: decode step (8×100 µs, then 5 ms sleep) alone, no hook, time-sliced GPU",
        fmt(alone),
        "the reference",
    );
    let hooked = run(conf, true, Some("decode"), None);
    t.row(
        "latency: decode alone under the hook (its group alone)",
        fmt(hooked.decode.expect("decode ran")),
        "p50 ≤ 1.05×",
    );
    let beside = |r: Run| {
        format!(
            "{}; training {:.1} steps/s",
            fmt(r.decode.expect("decode ran")),
            r.train.unwrap_or(0.0)
        )
    };
    t.row(
        "latency: decode beside training (20×1 ms, blocking copy), no gemini (time-slicing)",
        beside(run(conf, false, Some("decode"), Some("train"))),
        "H200: 2.6× p50, 2.8× p99",
    );
    t.row(
        "latency: decode beside training, gemini (MinUtil 0.3 / 0.7)",
        beside(run(conf, true, Some("decode"), Some("train"))),
        "the latency class is for this",
    );
    let critical = "[decode]\nMinUtil=0.3\nLatency=critical\n[train]\nMinUtil=0.7\n";
    t.row(
        "latency: decode beside training, gemini, decode `Latency=critical` (MinUtil 0.3 / 0.7)",
        beside(run(critical, true, Some("decode"), Some("train"))),
        "p99 ≤ 1.25×, p50 ≤ 1.1× (the latency class); training ≥ 90 % of the time decode leaves",
    );
    short_kernels(t, alone);
    // The training as a best-effort group: room above its MinUtil, so
    // the device is kept free for the decode's return (see
    // docs/configuration.md, "Latency-critical groups").
    let best_effort = "[decode]\nLatency=critical\n[train]\n";
    t.row(
        "latency: decode beside training, gemini, decode `Latency=critical`, training with no MinUtil",
        beside(run(best_effort, true, Some("decode"), Some("train"))),
        "p99 ≤ 1.25×, p50 ≤ 1.1× (the latency class); training ≥ 90 % of the time decode leaves",
    );
    framework_rows(t, alone);
    // Two training jobs: how long the 0.3 group's steps take.
    let g = machine("[low]\nMinUtil=0.3\n[high]\nMinUtil=0.7\n");
    let dir = g.sim.path().to_path_buf();
    let (ld, hd) = (dir.join("low-steps"), dir.join("high-steps"));
    let high = spawn(&g, true, "high", TRAIN, &hd, cpu_for(false));
    let low = spawn(&g, true, "low", TRAIN, &ld, cpu_for(true));
    for c in [high, low] {
        finish(c);
    }
    let (p50, p99, max) = spread(&ld);
    t.row(
        "latency: two trainers at MinUtil 0.3 / 0.7, the 0.3 group's step (20 ms of work)",
        format!("p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms"),
        "no wait over 200 ms (H200: p99 1006 ms)",
    );
}

/// The decode beside a framework-like training (see [`FRAMEWORK_STEP`]),
/// with and without gemini: what the latency class costs a training whose
/// queue, not the device alone, sets its pace.
fn framework_rows(t: &mut Table, alone: (f64, f64, f64)) {
    let fmt = |(p50, p99, max): (f64, f64, f64)| {
        format!(
            "p50 {p50:.2} ms ({:.2}×), p99 {p99:.2} ms ({:.2}×), max {max:.2} ms",
            p50 / alone.0,
            p99 / alone.1
        )
    };
    let beside = |r: Run| {
        format!(
            "{}; training {:.1} steps/s",
            fmt(r.decode.expect("decode ran")),
            r.train.unwrap_or(0.0)
        )
    };
    // The training as a framework runs it (CPU-bound in its short
    // kernels): what the latency class costs it where the queue ahead of
    // the device, not the device alone, sets its pace.
    let framework = |conf: &str, hooked: bool| {
        run_with(
            FRAMEWORK_STEP,
            300,
            conf,
            hooked,
            Some("decode"),
            Some("train"),
        )
    };
    let bare = framework("[decode]\n[train]\n", false);
    let bare_rate = bare.train.unwrap_or(0.0);
    t.row(
        "latency: decode beside a framework-like training (300 launches a step, 400 µs + 9×15 µs kernels, 40 µs of CPU each), no gemini",
        beside(bare),
        "the reference for the row below",
    );
    let critical = "[decode]\nMinUtil=0.3\nLatency=critical\n[train]\nMinUtil=0.7\n";
    let r = framework(critical, true);
    let kept = r.train.unwrap_or(0.0) / bare_rate.max(f64::MIN_POSITIVE);
    t.row(
        "latency: decode beside the framework-like training, gemini, decode `Latency=critical` (MinUtil 0.3 / 0.7)",
        format!("{}; {:.2} of the training's steps without gemini", beside(r), kept),
        "p99 ≤ 1.25×, p50 ≤ 1.1× (the latency class); training ≥ 0.9 of its steps",
    );
}

/// The decode alone, no hook: the reference of the rows after it.
fn alone() -> (f64, f64, f64) {
    run("[decode]\n", false, Some("decode"), None)
        .decode
        .expect("decode ran")
}

/// `--only critical`: the latency class's rows alone (the decode alone,
/// beside the trainer of short kernels, beside the framework-like
/// training), for measuring changes to it side by side.
pub fn critical(t: &mut Table) {
    let alone = alone();
    t.row(
        "latency: decode step (8×100 µs, then 5 ms sleep) alone, no hook, time-sliced GPU",
        format!(
            "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
            alone.0, alone.1, alone.2
        ),
        "the reference",
    );
    short_kernels(t, alone);
    framework_rows(t, alone);
}
