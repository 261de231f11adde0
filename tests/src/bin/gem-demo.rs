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

const SEC: u64 = 1_000_000_000;

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
}

fn main() {
    let conf_path = <Args as clap::Parser>::parse().config;
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
        "\n1. train and notebook both busy for 10 s (each: gem-workload under LD_PRELOAD=libgemhook.so)"
    );
    let t0 = now_ns();
    let (a, b) = (workload(&g, "train", "10"), workload(&g, "notebook", "10"));
    let (oa, ob) = (finish(a, "train"), finish(b, "notebook"));
    let busy = g.sim.busy(0, t0 + 2 * SEC, t0 + 10 * SEC);
    println!("   shares of device time over seconds 2-10, from the simulator's busy log:");
    header();
    let want = entitlements(&[limits("train"), limits("notebook")]);
    row("train", busy.share(pid(&oa)), want[0]);
    row("notebook", busy.share(pid(&ob)), want[1]);

    println!(
        "\n2. notebook alone for 4 s: held to its MaxUtil even though the GPU is otherwise idle"
    );
    let t0 = now_ns();
    let ob = finish(workload(&g, "notebook", "4"), "notebook");
    let busy = g.sim.busy(0, t0 + SEC, t0 + 4 * SEC);
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
        workload_with(&g, "train", "10", TRAINING_STEP),
        workload_with(&g, "notebook", "10", TRAINING_STEP),
    );
    let (oa, ob) = (finish(a, "train"), finish(b, "notebook"));
    let busy = g.sim.busy(0, t0 + 2 * SEC, t0 + 10 * SEC);
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
