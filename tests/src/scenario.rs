//! The workload shapes the tests and `gem-bench` run (a training step, a
//! gapped step, long kernels, NCCL-style ranks …) and a two-group
//! scenario of them.

use super::*;

/// `gem-workload` arguments for a training loop: a step of 20 kernels of
/// 1 ms, then `cuCtxSynchronize` for them.
pub const TRAINING_STEP: &[&str] = &[
    "--iter-kernels",
    "20",
    "--kernel-us",
    "1000",
    "--wait",
    "ctx",
];

/// `gem-workload` arguments for rank `rank` of a 2-rank NCCL-style job
/// (communicator `comm`) on GPU `rank`: steps of five 200 µs kernels and
/// an allreduce (the simulator's `fake_allreduce`), then a wait.
/// Makes `cmd` rank `rank` of a two-rank job `comm`, as torchrun
/// launches one (its `TORCHELASTIC_RUN_ID`, `WORLD_SIZE` and `RANK`): the
/// hook declares the job, and its ranks take their GPUs in turns.
pub fn as_rank(cmd: &mut std::process::Command, comm: usize, rank: u32) {
    cmd.env("TORCHELASTIC_RUN_ID", format!("comm-{comm}"))
        .env("WORLD_SIZE", "2")
        .env("RANK", rank.to_string());
}

pub fn allreduce_rank(comm: usize, rank: u32, seconds: &str) -> Vec<String> {
    [
        "--device",
        &rank.to_string(),
        "--iter-kernels",
        "5",
        "--kernel-us",
        "200",
        "--allreduce",
        &format!("{comm}:2:{rank}"),
        "--seconds",
        seconds,
    ]
    .map(String::from)
    .to_vec()
}

/// `gem-workload` arguments for a training loop with `loss.item()`: a step
/// of 20 kernels of 1 ms, then a blocking copy back to the host.
pub const BLOCKING_COPY_STEP: &[&str] = &[
    "--iter-kernels",
    "20",
    "--kernel-us",
    "1000",
    "--wait",
    "copy",
];

/// `gem-workload` arguments for a training loop as a framework runs it:
/// a step of 300 launches, one 400 µs matrix product to nine 15 µs
/// element-wise kernels (16 ms of device time), 40 µs of CPU before each
/// launch (12 ms), then a blocking copy back to the host. The device
/// outruns the CPU in the short kernels; only the queue built behind the
/// long ones keeps it busy, as in eager PyTorch.
pub const FRAMEWORK_STEP: &[&str] = &[
    "--iter-kernels",
    "300",
    "--kernel-mix",
    "400,15,15,15,15,15,15,15,15,15",
    "--launch-cpu-us",
    "40",
    "--wait",
    "copy",
];

/// `gem-workload` arguments for a decode-like step of an inference loop:
/// 8 kernels of 100 µs (0.8 ms of device time), a wait for them, then
/// 5 ms of sleep (an inference server's decode beside training, scaled to the simulator).
pub const DECODE_STEP: &[&str] = &[
    "--iter-kernels",
    "8",
    "--kernel-us",
    "100",
    "--wait",
    "stream",
    "--gap-ms",
    "5",
];

/// `gem-workload` arguments for a training step (as [`TRAINING_STEP`])
/// followed by 10 ms of CPU work (data loading between steps).
pub const GAPPED_STEP: &[&str] = &[
    "--iter-kernels",
    "20",
    "--kernel-us",
    "1000",
    "--wait",
    "ctx",
    "--gap-ms",
    "10",
];

/// `gem-workload` arguments for long kernels: 5 of 20 ms, then
/// `cuCtxSynchronize` for them.
pub const LONG_KERNELS_STEP: &[&str] = &[
    "--iter-kernels",
    "5",
    "--kernel-us",
    "20000",
    "--wait",
    "ctx",
];

/// `gem-workload` arguments for two launching threads on streams of their
/// own, each waiting on an event it recorded after 10 kernels of 1 ms.
pub const TWO_THREADS_EVENTS: &[&str] = &[
    "--threads",
    "2",
    "--own-streams",
    "--iter-kernels",
    "10",
    "--kernel-us",
    "1000",
    "--wait",
    "event",
];

/// `gem-workload` arguments for latency-bound inference: one 1 ms kernel,
/// then `cuStreamSynchronize` for it.
pub const SYNC_EVERY_KERNEL: &[&str] = &[
    "--iter-kernels",
    "1",
    "--kernel-us",
    "1000",
    "--wait",
    "stream",
];

/// A share scenario: groups `(MinUtil, MaxUtil)` on one simulated device,
/// each running `procs` copies of `gem-workload` with `args` (its
/// workload shape) under the hook, for `seconds`.
#[derive(Debug, Clone)]
pub struct Scenario<'a> {
    /// `(MinUtil, MaxUtil)` per group.
    pub groups: &'a [(f64, f64)],
    /// Processes per group.
    pub procs: usize,
    /// `gem-workload` arguments besides `--seconds`.
    pub args: &'a [&'a str],
    /// Run time of each process.
    pub seconds: f64,
    /// Seconds left out at the start (connecting, the window filling).
    pub skip: f64,
}

/// What a [`Scenario`] got, from the simulator's busy log.
#[derive(Debug, Clone)]
pub struct Outcome {
    /// Share of device time per group (all its processes together).
    pub got: Vec<f64>,
    /// Share of time the device was busy.
    pub busy: f64,
    /// Share of time at least one process had work for the device: from
    /// the first launch of a burst to the return of its wait (waiting for
    /// a token included).
    pub demand: f64,
}

impl Scenario<'_> {
    /// `resource.conf` for the groups, named `g0`, `g1`, ….
    pub fn conf(&self) -> String {
        self.groups
            .iter()
            .enumerate()
            .map(|(i, (min, max))| format!("[g{i}]\nMinUtil={min}\nMaxUtil={max}\n"))
            .collect()
    }

    /// Runs the scenario on a fresh simulated machine and scheduler.
    pub fn run(&self) -> Outcome {
        let g = Gemini::start_with(SimEnv::default(), &self.conf(), &["--log-level", "warn"]);
        self.run_on(&g)
    }

    /// [`Scenario::run`] with `env` set in every process's environment.
    pub fn run_with_env(&self, env: &[(&str, &str)]) -> Outcome {
        let g = Gemini::start_with(SimEnv::default(), &self.conf(), &["--log-level", "warn"]);
        self.run_on_with_env(&g, env)
    }

    /// Runs the scenario with the scheduler of `g` (whose resource.conf
    /// must define the groups `g0`, `g1`, …).
    pub fn run_on(&self, g: &Gemini) -> Outcome {
        self.run_on_with_env(g, &[])
    }

    /// [`Scenario::run_on`] with `env` set in every process's environment.
    pub fn run_on_with_env(&self, g: &Gemini, env: &[(&str, &str)]) -> Outcome {
        let t0 = now_ns();
        let secs = format!("{}", self.seconds);
        let demand_file = g.sim.sim_dir().join(format!("demand-{t0}"));
        let children: Vec<(usize, std::process::Child)> = (0..self.groups.len())
            .flat_map(|i| (0..self.procs).map(move |_| i))
            .map(|i| {
                let mut c = g.hooked(g.sim.workload(), &format!("g{i}"));
                c.args(["--seconds", &secs])
                    .args(self.args)
                    .envs(env.iter().copied())
                    .arg("--demand-file")
                    .arg(&demand_file)
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                (i, c.spawn().expect("start gem-workload"))
            })
            .collect();
        let mut pids: Vec<Vec<u32>> = vec![Vec::new(); self.groups.len()];
        for (i, c) in children {
            let out = c.wait_with_output().unwrap();
            assert!(
                out.status.success(),
                "gem-workload {:?} failed: {}",
                self.args,
                String::from_utf8_lossy(&out.stderr)
            );
            pids[i].extend(reports(&out.stdout).iter().map(|r| field(r, "pid") as u32));
        }
        let from = t0 + (self.skip * 1e9) as u64;
        let to = t0 + (self.seconds * 1e9) as u64;
        let busy = g.sim.busy(0, from, to);
        let bursts = std::fs::read_to_string(&demand_file).unwrap_or_default();
        let demanded = fakecuda_log::covered(
            bursts.lines().filter_map(|l| {
                let (a, b) = l.split_once(' ')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            }),
            from,
            to,
        );
        Outcome {
            got: pids.iter().map(|p| busy.share_of(p)).collect(),
            busy: busy.device_share(),
            demand: demanded as f64 / busy.span.max(1) as f64,
        }
    }
}
