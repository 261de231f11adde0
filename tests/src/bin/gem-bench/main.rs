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
mod daemons;
mod fast;
mod graphs;
mod latency;
mod overhead;
mod scale;
mod shapes;
mod startup;
mod wakeup;

use daemons::*;
use fast::*;
use overhead::*;
use shapes::*;

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
/// for 12 s: the steps made, with the hook and without it, how each
/// device's work split between the jobs over the last 10 s, and whether
/// any kernel ran outside its group's tokens (the tests' check: what the
/// busy log ran against what gem-schd charged).
fn nccl_jobs(t: &mut Table) {
    for sliced in [true, false] {
        nccl_jobs_on(t, sliced);
    }
}

/// `sliced`: on time-sliced devices, as a real GPU (else launch order).
fn nccl_jobs_on(t: &mut Table, sliced: bool) {
    let conf = "[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n";
    let run = |hooked: bool| {
        let mut sim = SimEnv::new(2, "16GiB");
        if sliced {
            sim = sim.time_sliced();
        }
        // Logging at info: the check of what each group was charged reads
        // who joined and the charges said at the stop.
        let mut g = Gemini::start_with(sim, conf, &["--log-level", "info"]);
        let t0 = now_ns();
        let children: Vec<(usize, u32, Child)> = (0..4)
            .map(|i| {
                let (job, rank) = (i / 2, (i % 2) as u32);
                let group = ["a", "b"][job];
                let mut c = workload(&g, hooked, group);
                gemini_tests::as_rank(&mut c, job + 1, rank);
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
        g.stop_scheduler();
        let escapes = if !hooked {
            String::new()
        } else {
            // The worst group's device time against its charge, too.
            let worst = g.device_accounts().and_then(|a| {
                a.iter()
                    .filter(|a| a.charged_ns > 0)
                    .map(|a| a.ran_ns as f64 / a.charged_ns as f64)
                    .reduce(f64::max)
            });
            match (g.escapes(), worst) {
                (Some(e), Some(w)) if e.is_empty() => {
                    format!(
                        "none (a group's kernels ran at most {:.1} % of its charge)",
                        w * 100.0
                    )
                }
                (Some(e), _) if !e.is_empty() => e.join("; "),
                _ => "not known (the scheduler's log could not be read)".to_string(),
            }
        };
        (steps, worst, busy, escapes)
    };
    let (bare, _, bare_busy, _) = run(false);
    let (steps, worst, busy, escapes) = run(true);
    let devices = if sliced {
        "time-sliced GPUs"
    } else {
        "GPUs in launch order"
    };
    t.row(
        format!(
            "two 2-GPU NCCL jobs on the same 2 {devices} (MinUtil 0.5/0.5, allreduce per step)"
        ),
        format!(
            "{steps} steps per rank in 12 s, {:.0} % of {bare} without the hook; split of the work worst {worst:.1} pp; devices busy {:.1} % ({:.1} % without); kernels outside their group's tokens: {escapes}",
            100.0 * steps as f64 / bare.max(1) as f64,
            busy * 100.0,
            bare_busy * 100.0
        ),
        "≥ 90 % of the steps, no hang, ±2 pp, no kernel outside its tokens",
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

/// The parts of the bench, in the order they run.
const PARTS: [&str; 16] = [
    "fast", "shares", "nccl", "latency", "overhead", "shapes", "holder", "policy", "rss", "flood",
    "rtt", "critical", "graphs", "wakeup", "startup", "scale",
];

/// Parts run only when `--only` names them (they take long).
const ON_REQUEST: [&str; 6] = ["rtt", "critical", "graphs", "wakeup", "startup", "scale"];

#[derive(clap::Parser, Debug)]
#[command(
    about = "Measures gemini's targets on the driver simulator (no GPU) and prints them as a table",
    after_help = "Environment: GEMINI_BIN_DIR (the binaries; default: next to this one), \
GEM_BENCH_TRIES (attempts at a shapes row while the host steals over 10 % of \
the CPU; default 3), GEM_BENCH_SECONDS (length of a shapes row; default 12), GEM_BENCH_SHAPES (only the \
shapes whose name contains it), GEM_BENCH_MIXES (only these group mixes, by index: 0 two groups, 1 and 2 two and four processes per group, 3 three groups, 4 four groups, 5-7 a lone group capped at 0.2, 0.4, 0.8, 8 a group capped at 0.4 beside an uncapped one, 9 a lone group with no bounds; e.g. 0,2; the rtt part runs 0,6,8,9 unless told), GEM_BENCH_RTT_DELAY_US (the rtt part: the sleep added before each token request; default 150). The rtt part runs only when --only names it: every shapes row with and without a longer token round trip, to show what the round trip costs. So does the critical part: the latency class's rows of the latency part alone (the decode alone, beside a trainer of 200 µs kernels, beside the framework-like training), to measure a change to it side by side. So does the graphs part: a graph-replaying group at MinUtil 0.3 beside an eager one at 0.7, GEM_BENCH_RUNS times (default 5), on a host whose waits wake GEM_BENCH_WAKEUP_US late (default 0). So does the wakeup part: a lone group capped at 0.4 that waits after every 1 ms kernel, on hosts that wake its waits 0, 100 and 300 µs late, GEM_BENCH_RUNS times each. So does the startup part: 1, 16, 64 and 256 programs started together, each timed from exec to its first kernel's end, with and without the hook, and gem-schd's CPU. So does the scale part: 8, 64 and 256 clients on 1, 4 and 8 GPUs taking and giving back tokens as fast as granted, the round trip, the grants/s and gem-schd's CPU per grant."
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
    let parts: [Part; 16] = [
        ("fast", fast_path),
        ("shares", share_accuracy),
        ("nccl", nccl_jobs),
        ("latency", latency::latency),
        ("overhead", overhead),
        ("shapes", shape_matrix),
        ("holder", holder),
        ("policy", policy_throughput),
        ("rss", scheduler_rss),
        ("flood", flood),
        ("rtt", rtt_matrix),
        ("critical", latency::critical),
        ("graphs", graphs::graphs),
        ("wakeup", wakeup::wakeup),
        ("startup", startup::startup),
        ("scale", scale::scale),
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
