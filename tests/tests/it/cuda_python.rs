//! A real client that no one here wrote: NVIDIA's cuda-python
//! (`cuda-bindings` from PyPI, every entry point through
//! `cuGetProcAddress` as the CUDA runtime does) with a kernel NVRTC
//! (`nvidia-cuda-nvrtc-cu12`) compiles on the CPU, on the simulator under
//! the hook. The test installs both, pinned, in a virtual environment of
//! its own; where that cannot be done (offline) it says so and checks
//! nothing.

use gemini_tests::cpu::{MAX_STEAL, measured, serial};
use gemini_tests::{Gemini, SimEnv};
use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Command;

const SEC: u64 = 1_000_000_000;
const PACKAGES: &[&str] = &["cuda-bindings==12.8.0", "nvidia-cuda-nvrtc-cu12==12.8.93"];

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .into()
}

/// The python of a virtual environment `name` with the pinned `packages`
/// installed (made once per target directory); `None` where that cannot
/// be done (offline, or no python3-venv).
fn venv(name: &str, packages: &[&str]) -> Option<PathBuf> {
    let venv = Path::new(env!("CARGO_TARGET_TMPDIR")).join(name);
    let py = venv.join("bin/python");
    let marker = venv.join(packages.join(" ").replace(['=', ' ', '[', ']'], "_"));
    if marker.exists() {
        return Some(py);
    }
    let run = |c: &mut Command| c.status().is_ok_and(|s| s.success());
    let made = run(Command::new("python3").arg("-m").arg("venv").arg(&venv))
        && run(Command::new(&py)
            .args(["-m", "pip", "install", "--quiet"])
            .args(packages));
    if !made {
        return None;
    }
    std::fs::write(&marker, "").unwrap();
    Some(py)
}

/// The virtual environment's python, with cuda-python and NVRTC.
fn python() -> Option<PathBuf> {
    venv("cuda-python-venv", PACKAGES)
}

fn values(stdout: &[u8]) -> HashMap<String, String> {
    String::from_utf8_lossy(stdout)
        .split_whitespace()
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

#[test]
fn cuda_python_is_gated_capped_and_sees_its_limit() {
    let _serial = serial();
    let Some(py) = python() else {
        eprintln!(
            "NOT CHECKED: cuda-python and NVRTC could not be installed (offline, or no python3-venv)"
        );
        return;
    };
    let g = Gemini::start(SimEnv::default(), "[py]\nMaxUtil=0.3\nMemoryLimit=256MiB\n");
    let run = || {
        let mut c = g.sim.command(&py);
        c.arg(repo().join("tests/python/cuda_python_client.py"))
            .args(["3", "512"]);
        let mut c = g.hooked(c, "py");
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "cuda-python client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = values(&out.stdout);
        // The loop's last two of its 3 s (under load, importing and
        // compiling can take seconds before it).
        let t0: u64 = v["loop_start_ns"].parse().unwrap();
        let pid_share = g.sim.busy(0, t0 + SEC, t0 + 3 * SEC).device_share();
        (v, pid_share)
    };
    let ((v, share), counts) = measured("cuda-python under MaxUtil 0.3", MAX_STEAL, 2, run);
    assert!(v["ptx_bytes"].parse::<u64>().unwrap() > 0, "NVRTC compiled");
    assert_eq!(
        v["mem_total"],
        (256u64 << 20).to_string(),
        "cuMemGetInfo shows the cap"
    );
    assert_eq!(
        v["alloc_error"], "2",
        "512 MiB over a 256 MiB limit: CUDA_ERROR_OUT_OF_MEMORY"
    );
    assert!(v["launches"].parse::<u64>().unwrap() > 100, "{v:?}");
    // Gated: never over the cap (a starved run only gets less).
    assert!(
        share <= 0.35,
        "cuda-python's launches were not gated: {share:.3}"
    );
    if counts {
        assert!(share >= 0.2, "cuda-python got {share:.3} of its 0.3");
    }
}

/// numba-cuda, pinned with the CUDA 12 wheels it compiles with (NVVM) and
/// drives the driver through (cuda-bindings): about 270 MB to download.
const NUMBA: &[&str] = &[
    "numba-cuda[cu12]==0.30.4",
    "numba==0.68.1",
    "llvmlite==0.50.0",
    "numpy==2.4.6",
];

/// numba-cuda, as a new user runs it: kernels JIT-compiled by NVVM from
/// Python, loaded with cuLibraryLoadData and launched with
/// cuLaunchKernelEx on the CUkernel, no CUDA runtime. Under MaxUtil 0.3
/// over five of the scheduler's (1 s) windows its launches get no more
/// than the cap; its memory counts against the group's 256 MiB: the
/// driver's view shows the limit and what it holds, and 512 MiB more is
/// refused with CUDA_ERROR_OUT_OF_MEMORY.
#[test]
fn numba_cuda_kernels_are_gated_capped_and_their_memory_counts() {
    let _serial = serial();
    let Some(py) = venv("numba-cuda-venv", NUMBA) else {
        eprintln!("NOT CHECKED: numba-cuda could not be installed (offline, or no python3-venv)");
        return;
    };
    let g = Gemini::start_with(
        SimEnv::default(),
        "[nb]\nMaxUtil=0.3\nMemoryLimit=256MiB\n",
        &["--window", "1s"],
    );
    let run = || {
        let mut c = g.sim.command(&py);
        // numba's kernels have mangled names: every kernel runs 1 ms.
        c.env("FAKECUDA_KERNEL_US", "1000")
            .arg(repo().join("tests/python/numba_client.py"))
            .args(["5", "64", "512"]);
        let mut c = g.hooked(c, "nb");
        let out = c.output().unwrap();
        assert!(
            out.status.success(),
            "numba client failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let v = values(&out.stdout);
        // The loop's last four of its 5 s (under load, importing numba and
        // compiling can take seconds before it).
        let t0: u64 = v["loop_start_ns"].parse().unwrap();
        let share = g.sim.busy(0, t0 + SEC, t0 + 5 * SEC).device_share();
        (v, share)
    };
    let ((v, share), counts) = measured("numba-cuda under MaxUtil 0.3", MAX_STEAL, 2, run);
    let limit = 256u64 << 20;
    assert_eq!(
        v["mem_total"],
        limit.to_string(),
        "cuMemGetInfo shows the cap"
    );
    let holding: u64 = v["mem_free_holding"].parse().unwrap();
    assert!(
        holding <= limit - (64 << 20),
        "64 MiB held, yet {holding} of 256 MiB free: {v:?}"
    );
    assert_eq!(
        v["alloc_error"], "2",
        "512 MiB over a 256 MiB limit: CUDA_ERROR_OUT_OF_MEMORY"
    );
    // The loop ran and launched through the hook. How many it launches
    // depends on the CPU it gets: 78 in 5 s under make test's load on 2
    // cores, over 1000 alone; once, when the kernel's compilation (then
    // the loop's first launch, now made before the loop) took the 5 s.
    assert!(v["launches"].parse::<u64>().unwrap() >= 20, "{v:?}");
    let peak = g.sim.group_memory("nb").peak[0];
    assert!(
        (64 << 20..=limit).contains(&peak),
        "the group held {peak} bytes at most on the device: {v:?}"
    );
    assert!(share <= 0.35, "numba's launches were not gated: {share:.3}");
    if counts {
        assert!(share >= 0.2, "numba-cuda got {share:.3} of its 0.3");
    }
}
