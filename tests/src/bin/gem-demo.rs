//! `make demo`: gemini end to end on the driver simulator. Starts
//! `gem-schd` with `examples/resource.conf`, runs two unmodified CUDA
//! workloads under `libgemhook.so` (one per group, both always wanting the
//! GPU), then one alone, then one training-like process per group (a step
//! of kernels, then a wait for them), and prints the share each got — measured from the
//! simulated device's busy log — next to its configured MinUtil/MaxUtil.

// A tool of the test suite: on failure it stops loudly, which is its job.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use gemini_scheduler::policy::entitlements;
use gemini_tests::{Gemini, SimEnv, TRAINING_STEP, bin, field, now_ns, reports};
use std::process::{Command, Stdio};

fn workload(g: &Gemini, group: &str, seconds: &str) -> std::process::Child {
    workload_with(g, group, seconds, &[])
}

/// A hooked `gem-workload` of `group` for `seconds` with `args` (0.5 ms
/// kernels unless they say otherwise).
fn workload_with(g: &Gemini, group: &str, seconds: &str, args: &[&str]) -> std::process::Child {
    let mut c = g.hooked(g.sim.workload(), group);
    c.args(["--seconds", seconds]);
    if !args.contains(&"--kernel-us") {
        c.args(["--kernel-us", "500"]);
    }
    c.args(args).stdout(Stdio::piped()).stderr(Stdio::inherit());
    c.spawn().expect("start gem-workload")
}

/// Waits for a workload; the demo stops, failing, if it failed.
fn finish(child: std::process::Child, group: &str) -> std::process::Output {
    let out = child.wait_with_output().expect("wait for gem-workload");
    if !out.status.success() {
        eprintln!(
            "gem-demo: the {group} workload failed ({}); see its error above",
            out.status
        );
        std::process::exit(1);
    }
    out
}

fn pid(out: &std::process::Output) -> u32 {
    reports(&out.stdout)
        .first()
        .map_or(0, |r| field(r, "pid") as u32)
}

/// gemini end to end on the driver simulator (no GPU needed): two groups
/// sharing a simulated GPU by their MinUtil and MaxUtil, one held to its
/// cap alone, and training loops of one process per group.
#[derive(clap::Parser)]
#[command(name = "gem-demo")]
struct Args {
    /// The resource.conf to run with; it must define the groups `train`
    /// and `notebook`
    #[arg(default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/resource.conf"))]
    config: String,
    /// How long the two-group steps run (the one alone runs 0.4 of it);
    /// each is measured from a fifth of the way in
    #[arg(long, default_value_t = 10.0, value_parser = at_least_two)]
    seconds: f64,
}

fn at_least_two(s: &str) -> Result<f64, String> {
    match s.parse::<f64>() {
        Ok(v) if (2.0..=3600.0).contains(&v) => Ok(v),
        _ => Err(format!("expected seconds between 2 and 3600, got {s:?}")),
    }
}

fn main() {
    let args = <Args as clap::Parser>::parse();
    let conf_path = args.config;
    let secs = args.seconds;
    let long = format!("{secs}");
    // Rounded: 3 s * 0.4 printed as 1.2000000000000002.
    let short = format!("{}", (secs * 0.4 * 10.0).round() / 10.0);
    let ns = |s: f64| (s * 1e9) as u64;
    let fail = |msg: String| -> ! {
        eprintln!("gem-demo: {msg}");
        std::process::exit(1)
    };
    let conf =
        std::fs::read_to_string(&conf_path).unwrap_or_else(|e| fail(format!("{conf_path}: {e}")));
    let cfg = gemini_config::parse_resource(&conf, conf_path.as_ref())
        .unwrap_or_else(|e| fail(e.to_string()))
        .0;
    for g in ["train", "notebook"] {
        if !cfg.groups.contains_key(g) {
            fail(format!(
                "{conf_path} does not define the group [{g}] the demo runs"
            ));
        }
    }
    let g = Gemini::start(SimEnv::default(), &conf);
    println!("gem-schd is running with {conf_path} on a simulated GPU (libcuda.so.1 = fakecuda).");
    let limits = |g: &str| (cfg.groups[g].min_util, cfg.groups[g].max_util);
    let row = |group: &str, share: f64, entitled: f64| {
        let (min, max) = limits(group);
        println!("  {group:<10} {min:>8.2} {max:>8.2} {share:>10.3} {entitled:>12.3}");
    };
    let header = || {
        println!(
            "  {:<10} {:>8} {:>8} {:>10} {:>12}",
            "group", "MinUtil", "MaxUtil", "achieved", "entitled"
        )
    };

    println!(
        "\n1. train and notebook both busy for {secs} s (each: gem-workload under LD_PRELOAD=libgemhook.so)"
    );
    let t0 = now_ns();
    let (a, b) = (
        workload(&g, "train", &long),
        workload(&g, "notebook", &long),
    );
    let (oa, ob) = (finish(a, "train"), finish(b, "notebook"));
    let busy = g.sim.busy(0, t0 + ns(secs / 5.0), t0 + ns(secs));
    println!(
        "   shares of device time over seconds {}-{secs}, from the simulator's busy log:",
        (secs / 5.0 * 10.0).round() / 10.0
    );
    header();
    let want = entitlements(&[limits("train"), limits("notebook")]);
    row("train", busy.share(pid(&oa)), want[0]);
    row("notebook", busy.share(pid(&ob)), want[1]);

    println!(
        "\n2. notebook alone for {short} s: held to its MaxUtil even though the GPU is otherwise idle"
    );
    let t0 = now_ns();
    let ob = finish(workload(&g, "notebook", &short), "notebook");
    let busy = g.sim.busy(0, t0 + ns(secs / 10.0), t0 + ns(secs * 0.4));
    header();
    row(
        "notebook",
        busy.share(pid(&ob)),
        entitlements(&[limits("notebook")])[0],
    );

    println!(
        "\n3. one process per group, each a training loop: 20 kernels of 1 ms, then wait for them (cuCtxSynchronize), again and again"
    );
    let t0 = now_ns();
    let (a, b) = (
        workload_with(&g, "train", &long, TRAINING_STEP),
        workload_with(&g, "notebook", &long, TRAINING_STEP),
    );
    let (oa, ob) = (finish(a, "train"), finish(b, "notebook"));
    let busy = g.sim.busy(0, t0 + ns(secs / 5.0), t0 + ns(secs));
    println!("   waiting for its own work is not idle: each keeps its token through the wait");
    header();
    row("train", busy.share(pid(&oa)), want[0]);
    row("notebook", busy.share(pid(&ob)), want[1]);

    println!("\n4. gem-schd status");
    let _ = Command::new(bin("gem-schd"))
        .arg("status")
        .arg("--ipc-dir")
        .arg(g.ipc())
        .status();
}
