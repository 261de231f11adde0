//! The workload-shape matrix: every mix of groups and shapes, each
//! group's share against what it is entitled to.

use super::*;

/// Group sets and processes per group of the share matrix.
pub(crate) const MIXES: &[(&[(f64, f64)], usize)] = &[
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
pub(crate) fn demand(args: &[&str]) -> f64 {
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
pub(crate) fn entitled(groups: &[(f64, f64)], demand: &[f64], ceiling: f64) -> Vec<f64> {
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
pub(crate) fn tries() -> u32 {
    std::env::var("GEM_BENCH_TRIES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(3)
        .max(1)
}

/// `gemini_tests::cpu::least_starved` with the bench's tries.
pub(crate) fn least_starved<T>(measure: impl FnMut() -> T) -> (T, f64) {
    gemini_tests::cpu::least_starved(gemini_tests::cpu::MAX_STEAL, tries(), measure, |_, _, _| {})
}

/// `GEM_BENCH_SECONDS`, `GEM_BENCH_SHAPES` and `GEM_BENCH_MIXES` (see the
/// help): the length of a row, and the shapes and mixes to run (`None`:
/// all).
pub(crate) fn matrix_choice() -> (f64, Option<String>, Option<Vec<usize>>) {
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
pub(crate) fn fmt_shares(v: &[f64]) -> String {
    v.iter()
        .map(|g| format!("{g:.3}"))
        .collect::<Vec<_>>()
        .join("/")
}

/// Shares for every workload shape × mix, against the entitlement.
pub(crate) fn shape_matrix(t: &mut Table) {
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
