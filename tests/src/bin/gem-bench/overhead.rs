//! What the hook costs a program that has the GPU to itself.

use super::*;

/// What the hook costs a program that is alone on the device: the kernel
/// throughput of a lone uncapped group launching 10 µs kernels with a
/// wait every 100 (default scheduler settings: tokens come and go), and
/// the time an allocation takes, with the hook and without it (runs
/// interleaved, median of 5 each).
pub(crate) fn overhead(t: &mut Table) {
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
    // 2048 pairs of a 1 MiB cuMemAlloc and its cuMemFree, each call
    // timed: (alloc, free) medians, µs.
    let pairs = |hooked: bool| {
        let mut c = workload(&g, hooked, "mem");
        c.args(["--seconds", "0", "--alloc-free", "2048", "--chunk", "1MiB"]);
        let out = c.output().expect("run gem-workload");
        let r = &reports(&out.stdout)[0];
        (
            field(r, "alloc_pair_p50_ns") as f64 / 1000.0,
            field(r, "free_pair_p50_ns") as f64 / 1000.0,
        )
    };
    let (mut plain, mut hooked) = (Vec::new(), Vec::new());
    let (mut plain_alloc, mut hooked_alloc) = (Vec::new(), Vec::new());
    let (mut plain_pairs, mut hooked_pairs) = (Vec::new(), Vec::new());
    for _ in 0..5 {
        plain.push(kernels(false));
        hooked.push(kernels(true));
        plain_alloc.push(allocs(false));
        hooked_alloc.push(allocs(true));
        plain_pairs.push(pairs(false));
        hooked_pairs.push(pairs(true));
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
    let median_of = |v: &[(f64, f64)], pick: fn(&(f64, f64)) -> f64| {
        let mut x: Vec<f64> = v.iter().map(pick).collect();
        percentile(&mut x, 0.5)
    };
    let (pa, ha) = (
        median_of(&plain_pairs, |p| p.0),
        median_of(&hooked_pairs, |p| p.0),
    );
    let (pf, hf) = (
        median_of(&plain_pairs, |p| p.1),
        median_of(&hooked_pairs, |p| p.1),
    );
    t.row(
        "memory cap: time added per call, 2048 pairs of a 1 MiB cuMemAlloc and its cuMemFree (each call's median, median of 5)",
        format!(
            "alloc {:.2} µs ({pa:.2} → {ha:.2} µs), free {:.2} µs ({pf:.2} → {hf:.2} µs)",
            ha - pa,
            hf - pf
        ),
        "≤ 5 µs",
    );
}
