//! `--only wakeup`: a lone group capped at `MaxUtil` 0.4 that waits after
//! every 1 ms kernel, on hosts that wake a blocked wait 0, 100 and 300 µs
//! after its kernel ended (`FAKECUDA_WAKEUP_US`; a blocking-sync context
//! or a loaded CPU wakes late), `GEM_BENCH_RUNS` runs each (default 5):
//! the group's share of the device, which should be its cap whatever the
//! wake-up costs (the wake-up is the host's time, not the device's).

use super::*;

/// One run of `seconds` with wake-ups `wakeup_us` late: the device's
/// share over all but its first 2 s.
fn one(wakeup_us: u32, seconds: u64) -> f64 {
    let g = Gemini::start_with(
        SimEnv::default().slow_wakeup(wakeup_us),
        "[capped]\nMaxUtil=0.4\n",
        &["--log-level", "warn"],
    );
    let t0 = now_ns();
    let out = g
        .hooked(g.sim.workload(), "capped")
        .args(gemini_tests::SYNC_EVERY_KERNEL)
        .args(["--seconds", &seconds.to_string()])
        .stdout(Stdio::null())
        .output()
        .expect("gem-workload");
    assert!(out.status.success(), "gem-workload failed");
    g.sim
        .busy(0, t0 + 2 * SEC, t0 + seconds * SEC)
        .device_share()
}

pub fn wakeup(t: &mut Table) {
    let seconds = 6;
    let runs = super::graphs::runs();
    for us in [0, 100, 300] {
        let got: Vec<f64> = (0..runs).map(|_| one(us, seconds)).collect();
        let worst = got.iter().copied().fold(f64::INFINITY, f64::min);
        let shown: Vec<String> = got.iter().map(|s| format!("{s:.3}")).collect();
        t.row(
            format!(
                "lone group capped at 0.4, a sync after every 1 ms kernel, woken {us} µs late, {runs} runs of {seconds} s"
            ),
            format!("worst {worst:.3}: {}", shown.join(" · ")),
            "0.39-0.40 in every run",
        );
    }
}
