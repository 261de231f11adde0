//! `--only graphs`: a process that captures a CUDA graph in global mode
//! while another of its threads launches and synchronises (as
//! `torch.cuda.graph` runs beside eager work), then replays the graph,
//! at `MinUtil` 0.3 beside an eager group at 0.7, on a time-sliced GPU:
//! the two groups' shares in each of `GEM_BENCH_RUNS` runs (default 5),
//! so that a run that splits the device otherwise shows.

use super::*;

/// Runs of the shape: `GEM_BENCH_RUNS`, default 5.
pub(super) fn runs() -> usize {
    std::env::var("GEM_BENCH_RUNS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(5)
        .max(1)
}

/// The graph process: 20 captured 500 µs kernels a graph (10 ms a
/// replay), one replay a step, waited for.
const GRAPHS: &[&str] = &[
    "--capture",
    "20",
    "--capture-pause-ms",
    "0.2",
    "--kernel-us",
    "500",
    "--iter-kernels",
    "1",
];

/// One run of `seconds`: the shares of "low" (graphs) and "high" (eager)
/// over all but its first 2 s.
fn one(seconds: u64) -> (f64, f64) {
    let wakeup = std::env::var("GEM_BENCH_WAKEUP_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let g = Gemini::start_with(
        SimEnv::new(1, "16GiB").time_sliced().slow_wakeup(wakeup),
        "[low]\nMinUtil=0.3\n[high]\nMinUtil=0.7\n",
        &["--log-level", "warn"],
    );
    let secs = seconds.to_string();
    let t0 = now_ns();
    let mut low = g.hooked(g.sim.workload(), "low");
    low.args(GRAPHS)
        .args(["--seconds", &secs])
        .stdout(Stdio::piped());
    let mut high = g.hooked(g.sim.workload(), "high");
    high.args(gemini_tests::BLOCKING_COPY_STEP)
        .args(["--seconds", &secs])
        .stdout(Stdio::piped());
    let (low, high) = (low.spawn().expect("spawn"), high.spawn().expect("spawn"));
    let (lp, hp) = (low.id(), high.id());
    for c in [low, high] {
        let out = c.wait_with_output().expect("gem-workload");
        assert!(out.status.success(), "gem-workload failed");
    }
    let busy = g.sim.busy(0, t0 + 2 * SEC, t0 + seconds * SEC);
    (busy.share(lp), busy.share(hp))
}

pub fn graphs(t: &mut Table) {
    let seconds = 12;
    let got: Vec<(f64, f64)> = (0..runs()).map(|_| one(seconds)).collect();
    let worst = got
        .iter()
        .map(|&(l, h)| ((l - 0.3).abs()).max((h - 0.7).abs()) * 100.0)
        .fold(0.0, f64::max);
    let shown: Vec<String> = got.iter().map(|(l, h)| format!("{l:.3}/{h:.3}")).collect();
    t.row(
        format!(
            "graphs captured beside eager work then replayed (MinUtil 0.3) beside an eager group (0.7), time-sliced, {} runs of {seconds} s",
            got.len()
        ),
        format!("worst {worst:.1} pp: {}", shown.join(" · ")),
        "0.3/0.7 within 2 pp in every run",
    );
}
