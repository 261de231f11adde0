//! The driver simulator behaves like a shared device, for both workloads:
//! the Rust one (dlopen + cuGetProcAddress_v2) and the C one (linked
//! against libcuda.so.1).

use gemini_tests::cpu::{MAX_STEAL, measured};
use gemini_tests::{SimEnv, field, now_ns, reports};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

mod api;
mod devices;
mod slicing;

const SEC: u64 = 1_000_000_000;

// Runs a command to its end, failing the test unless it succeeded.
use gemini_tests::run_ok as run;

fn pids(outs: &[&Output]) -> Vec<u32> {
    outs.iter()
        .flat_map(|o| reports(&o.stdout))
        .map(|r| field(&r, "pid") as u32)
        .collect()
}

/// Two saturating processes share the device half and half; measured over
/// the middle second, when both have work queued. Where the VM's host took
/// the CPU meanwhile, only that both ran is checked.
fn two_saturating(make: impl Fn() -> (Command, Command), sim: &SimEnv) {
    let run = || {
        let (mut a, mut b) = make();
        let t0 = now_ns();
        let ca = a.stdout(Stdio::piped()).spawn().unwrap();
        let cb = b.stdout(Stdio::piped()).spawn().unwrap();
        let (oa, ob) = (
            ca.wait_with_output().unwrap(),
            cb.wait_with_output().unwrap(),
        );
        assert!(oa.status.success() && ob.status.success());
        let busy = sim.busy(0, t0 + SEC / 2, t0 + 3 * SEC / 2);
        let (pa, pb) = (pids(&[&oa])[0], pids(&[&ob])[0]);
        (busy.share(pa), busy.share(pb), busy.device_share())
    };
    let ((sa, sb, device), counts) = measured("two saturating processes", MAX_STEAL, 2, run);
    assert!(sa > 0.0 && sb > 0.0, "shares {sa:.3} / {sb:.3}");
    if !counts {
        return;
    }
    assert!(
        (sa - 0.5).abs() <= 0.03 && (sb - 0.5).abs() <= 0.03,
        "shares {sa:.3} / {sb:.3}"
    );
    assert!(device >= 0.97, "device busy {device:.3}");
}

#[test]
fn two_rust_workloads_share_a_device_evenly() {
    let sim = SimEnv::default();
    let w = || {
        let mut c = sim.workload();
        c.args(["--seconds", "2", "--kernel-us", "1000"]);
        c
    };
    two_saturating(|| (w(), w()), &sim);
}

#[test]
fn rust_and_c_workloads_share_a_device_evenly() {
    let sim = SimEnv::default();
    two_saturating(
        || {
            let mut a = sim.workload();
            a.args(["--seconds", "2", "--kernel-us", "1000"]);
            let mut b = sim.c_workload();
            b.args(["-s", "2", "-k", "1000"]);
            (a, b)
        },
        &sim,
    );
}

#[test]
fn a_lone_workload_keeps_the_device_busy() {
    let sim = SimEnv::default();
    for name in ["rust", "c"] {
        let measure = || {
            let c = if name == "rust" {
                let mut c = sim.workload();
                c.args(["--seconds", "1", "--kernel-us", "500"]);
                c
            } else {
                let mut c = sim.c_workload();
                c.args(["-s", "1", "-k", "500"]);
                c
            };
            let t0 = now_ns();
            let out = run(c);
            let pid = pids(&[&out])[0];
            sim.busy(0, t0 + SEC / 5, t0 + SEC).share(pid)
        };
        let (share, counts) = measured(name, MAX_STEAL, 2, measure);
        assert!(share > 0.0, "{name}: {share:.3}");
        if counts {
            assert!(share >= 0.97, "{name}: {share:.3}");
        }
    }
}

#[test]
fn allocation_beyond_device_memory_fails_and_mem_info_stays_consistent() {
    let sim = SimEnv::new(1, "1GiB");
    let mut c = sim.workload();
    c.args(["--seconds", "0", "--mem", "2GiB", "--chunk", "256MiB"]);
    let r = &reports(&run(c).stdout)[0];
    assert_eq!(field(r, "allocated"), 1 << 30);
    assert_eq!(field(r, "alloc_error"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!((field(r, "free"), field(r, "total")), (0, 1 << 30));
    // The C workload sees the memory the Rust one held freed again, and
    // a single allocation larger than the device fails cleanly.
    let mut c = sim.c_workload();
    c.args(["-s", "0", "-m", &(3u64 << 29).to_string()]);
    let r = &reports(&run(c).stdout)[0];
    assert_eq!((field(r, "allocated"), field(r, "alloc_error")), (0, 2));
    assert_eq!(field(r, "free"), 1 << 30);
}

/// As the real driver tears a dead process's contexts down, the work it
/// had queued never runs: a process killed with 50 s of 100 ms kernels
/// queued (it never waits) leaves the device to the next process at
/// once, and the busy log cuts its work where the simulator found it
/// dead (before, the queue ran on for 50 s after it, and was logged as
/// its work).
#[test]
fn a_killed_process_s_queued_work_never_runs() {
    // Launch order: the queue is logged as it is queued (see `slicing`
    // for the time-sliced device).
    let mut sim = SimEnv::new(1, "1GiB");
    sim.timeslice_us = 0;
    let mut c = sim.workload();
    c.args(["--seconds", "30", "--kernel-us", "100000"])
        .env("FAKECUDA_QUEUE_DEPTH", "500")
        .stdout(Stdio::null());
    let mut child = c.spawn().unwrap();
    let dead = child.id();
    // Until its queue is long.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    while sim
        .busy(0, 0, u64::MAX)
        .per_pid
        .get(&dead)
        .copied()
        .unwrap_or(0)
        < 20 * SEC
    {
        assert!(std::time::Instant::now() < deadline, "it never queued 20 s");
        std::thread::sleep(Duration::from_millis(20));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let killed_at = now_ns();
    let mut next = sim.workload();
    next.args([
        "--seconds",
        "0.001",
        "--iter-kernels",
        "1",
        "--kernel-us",
        "1000",
    ]);
    let out = run(next);
    let after = pids(&[&out])[0];
    let recs = fakecuda_log::read(&sim.sim_dir(), 0).unwrap();
    let first_after = recs
        .iter()
        .filter(|r| r.pid == after)
        .map(|r| r.start)
        .min()
        .expect("the next process's kernel is logged");
    let dead_end = recs
        .iter()
        .filter(|r| r.pid == dead)
        .map(|r| r.end)
        .max()
        .expect("the killed process's kernels are logged");
    assert!(
        first_after < killed_at + 5 * SEC,
        "the next process's kernel waited {} s behind a dead queue",
        (first_after - killed_at) / SEC
    );
    assert!(
        dead_end <= first_after,
        "the killed process's work ends {} ms after the next one's starts",
        (dead_end - first_after) / 1_000_000
    );
    let ran = sim.busy(0, 0, u64::MAX).per_pid[&dead];
    assert!(ran < 20 * SEC, "its queue ran {} s", ran / SEC);
}

#[test]
fn memory_of_several_processes_adds_up_and_dies_with_them() {
    let sim = SimEnv::new(1, "1GiB");
    let mut holder = sim.workload();
    holder
        .args([
            "--seconds",
            "30",
            "--mem",
            "768MiB",
            "--kernel-us",
            "100000",
            // The probes below may hold the memory for a moment.
            "--retry-alloc-seconds",
            "10",
        ])
        .stdout(Stdio::piped());
    let mut child = holder.spawn().unwrap();
    // Wait until its memory shows.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut c = sim.workload();
        c.args(["--seconds", "0", "--mem", "512MiB"]);
        let r = &reports(&run(c).stdout)[0];
        if field(r, "alloc_error") == 2 {
            assert_eq!(field(r, "free"), 256 << 20);
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the holder's memory never showed"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let mut c = sim.workload();
    c.args(["--seconds", "0", "--mem", "1GiB"]);
    let r = &reports(&run(c).stdout)[0];
    assert_eq!(
        (field(r, "allocated"), field(r, "alloc_error")),
        (1 << 30, 0),
        "killed process's memory not freed"
    );
}

#[test]
fn every_allocation_api_counts_against_device_memory() {
    let sim = SimEnv::new(1, "1GiB");
    for api in [
        "v2", "pitch", "managed", "async", "create", "array", "array3d",
    ] {
        let mut c = sim.workload();
        c.args(["--seconds", "0", "--mem", "768MiB", "--alloc-api", api]);
        let r = &reports(&run(c).stdout)[0];
        assert_eq!(field(r, "alloc_error"), 0, "{api}");
        assert!(
            field(r, "free") <= 256 << 20,
            "{api}: free {}",
            field(r, "free")
        );
        let mut c = sim.workload();
        c.args(["--seconds", "0", "--mem", "2GiB", "--alloc-api", api]);
        assert_eq!(
            field(&reports(&run(c).stdout)[0], "alloc_error"),
            2,
            "{api}"
        );
    }
}

#[test]
fn every_launch_api_and_ptsz_variant_runs_on_the_device() {
    let sim = SimEnv::default();
    for api in ["kernel", "ex", "coop", "graph"] {
        for ptsz in [false, true] {
            let mut c = sim.workload();
            c.args([
                "--seconds",
                "0.3",
                "--kernel-us",
                "1000",
                "--launch-api",
                api,
            ]);
            if ptsz {
                c.arg("--ptsz");
            }
            let t0 = now_ns();
            let out = run(c);
            let r = &reports(&out.stdout)[0];
            assert!(field(r, "kernels") > 100, "{api} {ptsz}: {r:?}");
            let busy = sim.busy(0, t0, now_ns());
            let pid = field(r, "pid") as u32;
            let got = busy.per_pid[&pid] / 1000;
            assert_eq!(
                got,
                field(r, "kernels") * 1000,
                "{api} {ptsz}: logged {got} us"
            );
        }
    }
}

#[test]
fn a_forked_child_launches_too() {
    let sim = SimEnv::default();
    let mut rust = sim.workload();
    rust.args(["--seconds", "0.5", "--kernel-us", "1000", "--fork"]);
    let mut c = sim.c_workload();
    c.args(["-s", "0.5", "-k", "1000", "-f"]);
    for cmd in [rust, c] {
        let t0 = now_ns();
        let out = run(cmd);
        let rs = reports(&out.stdout);
        assert_eq!(rs.len(), 2, "{rs:?}");
        let busy = sim.busy(0, t0, now_ns());
        for r in &rs {
            assert!(busy.share(field(r, "pid") as u32) > 0.2, "{r:?}: {busy:?}");
        }
    }
}

fn fakecuda_log_records(sim: &SimEnv) -> Vec<fakecuda_log::Record> {
    fakecuda_log::read(&sim.sim_dir(), 0).unwrap()
}
