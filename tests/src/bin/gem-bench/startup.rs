//! `--only startup`: many programs started together, each timed from its
//! exec to its first kernel's completion on the simulated GPU (the
//! simulator's busy log), with and without the hook; gem-schd's CPU for
//! them; and any that never finished (HAMi-core left 2-4 of 64 hung).

use super::{Table, percentile, workload};
use gemini_tests::{Gemini, SimEnv, now_ns};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// How many programs start together.
const COUNTS: [usize; 4] = [1, 16, 64, 256];

/// How long a program may take before it counts as hung.
const HUNG: Duration = Duration::from_secs(60);

/// Process `pid`'s CPU time so far, seconds (utime + stime).
pub(crate) fn cpu_s(pid: u32) -> f64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<u64> = rest
        .split_whitespace()
        .map(|x| x.parse().unwrap_or(0))
        .collect();
    // Fields 14 and 15 of stat; after the command, 12 and 13 (1-based).
    let ticks = f.get(11).copied().unwrap_or(0) + f.get(12).copied().unwrap_or(0);
    // SAFETY: sysconf reads a constant of the system.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

/// What `n` programs started together measured: median and p99 (ms) from
/// exec to the first kernel's end, gem-schd's CPU (s), and how many hung.
struct Started {
    median: f64,
    p99: f64,
    scheduler_cpu: f64,
    hung: usize,
    /// Programs that exited with an error.
    failed: usize,
}

fn start_together(n: usize, hooked: bool) -> Started {
    // Room for every program's context (500 MB each in the simulator):
    // one that cannot create its context fails before its first kernel,
    // and would drop out of the figures.
    let g = Gemini::start(SimEnv::new(1, "192GiB"), "[a]\n");
    let schd = g.scheduler_pid().expect("gem-schd runs");
    let cpu0 = cpu_s(schd);
    let mut kids = Vec::with_capacity(n);
    for _ in 0..n {
        let mut c = workload(&g, hooked, "a");
        // One 10 µs kernel, waited for, again for 0.5 ms: each program
        // queues one kernel at a time, so the device adds little wait.
        c.args([
            "--iter-kernels",
            "1",
            "--kernel-us",
            "10",
            "--wait",
            "stream",
            "--seconds",
            "0.0005",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
        let t = now_ns();
        kids.push((t, c.spawn().expect("spawn gem-workload")));
    }
    let deadline = Instant::now() + HUNG;
    let (mut hung, mut failed) = (0, 0);
    let mut started = Vec::with_capacity(n);
    for (t, mut c) in kids {
        loop {
            match c.try_wait() {
                Ok(Some(status)) => {
                    failed += usize::from(!status.success());
                    break;
                }
                _ if Instant::now() > deadline => {
                    hung += 1;
                    let _ = c.kill();
                    let _ = c.wait();
                    break;
                }
                _ => std::thread::sleep(Duration::from_millis(5)),
            }
        }
        started.push((c.id(), t));
    }
    let scheduler_cpu = cpu_s(schd) - cpu0;
    let recs = fakecuda_log::read(&g.sim.sim_dir(), 0).unwrap_or_default();
    let mut ms: Vec<f64> = started
        .iter()
        .filter_map(|&(pid, t)| {
            let first = recs.iter().filter(|r| r.pid == pid).map(|r| r.end).min()?;
            Some(first.saturating_sub(t) as f64 / 1e6)
        })
        .collect();
    if ms.is_empty() {
        ms.push(f64::NAN);
    }
    Started {
        median: percentile(&mut ms, 0.5),
        p99: percentile(&mut ms, 0.99),
        scheduler_cpu,
        hung,
        failed,
    }
}

/// The rows: for each count, without and with the hook.
pub fn startup(t: &mut Table) {
    for n in COUNTS {
        let bare = start_together(n, false);
        let hooked = start_together(n, true);
        t.row(
            format!("start-up: {n} program(s) started together, exec to the first kernel's end"),
            format!(
                "no hook: median {:.2} ms, p99 {:.2} ms; hooked: median {:.2} ms, p99 {:.2} ms (+{:.2} ms median); gem-schd {:.0} ms of CPU; hung {}; failed {}",
                bare.median,
                bare.p99,
                hooked.median,
                hooked.p99,
                hooked.median - bare.median,
                hooked.scheduler_cpu * 1e3,
                bare.hung + hooked.hung,
                bare.failed + hooked.failed
            ),
            "added at 64 ≤ HAMi-core's (+15 ms median); none hung or failed",
        );
    }
}
