//! The driver simulator behaves like a shared device, for both workloads:
//! the Rust one (dlopen + cuGetProcAddress_v2) and the C one (linked
//! against libcuda.so.1).

use gemini_tests::cpu::{MAX_STEAL, measured};
use gemini_tests::{SimEnv, field, now_ns, reports};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

const SEC: u64 = 1_000_000_000;

fn run(mut c: Command) -> Output {
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{c:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

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
    let sim = SimEnv::new(1, "1GiB");
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
fn two_devices_are_independent() {
    let sim = SimEnv::new(2, "16GiB");
    let w = |dev: &str| {
        let mut c = sim.workload();
        c.args(["--seconds", "1", "--kernel-us", "1000", "--device", dev])
            .stdout(Stdio::piped());
        c.spawn().unwrap()
    };
    let measure = || {
        let t0 = now_ns();
        let (a, b) = (w("0"), w("1"));
        let (oa, ob) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
        let (pa, pb) = (pids(&[&oa])[0], pids(&[&ob])[0]);
        let (b0, b1) = (
            sim.busy(0, t0 + SEC / 5, t0 + SEC),
            sim.busy(1, t0 + SEC / 5, t0 + SEC),
        );
        // Each process on its own device only.
        assert_eq!(b0.share(pb), 0.0);
        assert_eq!(b1.share(pa), 0.0);
        (b0.share(pa), b1.share(pb))
    };
    let ((sa, sb), counts) = measured("two devices", MAX_STEAL, 2, measure);
    assert!(sa > 0.0 && sb > 0.0, "{sa:.3} {sb:.3}");
    if counts {
        assert!(sa >= 0.97 && sb >= 0.97, "{sa:.3} {sb:.3}");
    }
    let mut bad = sim.workload();
    bad.args(["--seconds", "0", "--device", "2"]);
    let out = bad.output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cuDeviceGet failed with CUresult 101"));
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

#[test]
fn get_proc_address_honours_version_and_per_thread_flag() {
    let sim = SimEnv::default();
    let exe = std::env::current_exe().unwrap();
    let mut c = sim.command(exe);
    c.args([
        "--exact",
        "simulator::api_checks_in_a_fresh_process",
        "--include-ignored",
        "--nocapture",
    ])
    .env("GEM_API_CHECKS", "1");
    let out = run(c);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("api checks passed"), "{text}");
}

/// Runs in its own process (started by the test above) with the simulator
/// on `LD_LIBRARY_PATH`.
#[test]
#[ignore = "helper process, run by get_proc_address_honours_version_and_per_thread_flag"]
fn api_checks_in_a_fresh_process() {
    if std::env::var_os("GEM_API_CHECKS").is_none() {
        return;
    }
    type GetProc =
        unsafe extern "C" fn(*const i8, *mut *mut std::ffi::c_void, i32, u64, *mut i32) -> u32;
    type Alloc = unsafe extern "C" fn(*mut u64, usize) -> u32;
    type Init = unsafe extern "C" fn(u32) -> u32;
    // SAFETY: loading the simulator and calling its entry points with
    // their C signatures and valid pointers.
    unsafe {
        let lib = libloading::Library::new("libcuda.so.1").unwrap();
        let sym = |name: &str| {
            *lib.get::<*mut std::ffi::c_void>(format!("{name}\0").as_bytes())
                .unwrap()
        };
        let get_proc: GetProc = *lib.get(b"cuGetProcAddress_v2\0").unwrap();
        type EntryName = unsafe extern "C" fn(*mut std::ffi::c_void) -> *const std::ffi::c_char;
        let entry_name: EntryName = *lib.get(b"fakecuda_entry_name\0").unwrap();
        // The driver hands out functions of its own, not its exports:
        // which entry point each is, by name.
        let resolve = |name: &std::ffi::CStr, version: i32, flags: u64| {
            let mut p = std::ptr::null_mut();
            let mut status = -1;
            let r = get_proc(name.as_ptr(), &mut p, version, flags, &mut status);
            let n = entry_name(p);
            let n =
                (!n.is_null()).then(|| std::ffi::CStr::from_ptr(n).to_string_lossy().into_owned());
            assert!(
                p.is_null() || n.is_some(),
                "{name:?}: {p:?} is no entry point"
            );
            (r, n, status)
        };
        let named = |n: &str| Some(n.to_string());
        assert_eq!(
            resolve(c"cuMemAlloc", 12000, 0),
            (0, named("cuMemAlloc_v2"), 0)
        );
        assert_eq!(
            resolve(c"cuMemGetInfo", 11000, 0),
            (0, named("cuMemGetInfo_v2"), 0)
        );
        assert_eq!(
            resolve(c"cuLaunchKernel", 12000, 2),
            (0, named("cuLaunchKernel_ptsz"), 0)
        );
        assert_eq!(
            resolve(c"cuLaunchKernel", 12000, 0),
            (0, named("cuLaunchKernel"), 0)
        );
        assert_eq!(
            resolve(c"cuGraphLaunch", 12000, 2),
            (0, named("cuGraphLaunch_ptsz"), 0)
        );
        assert_eq!(
            resolve(c"cuMemcpyHtoD", 12000, 2),
            (0, named("cuMemcpyHtoD_v2_ptds"), 0)
        );
        assert_eq!(
            resolve(c"cuGetProcAddress", 12000, 0),
            (0, named("cuGetProcAddress_v2"), 0)
        );
        assert_eq!(resolve(c"cuMemAllocAsync", 11000, 0), (500, None, 2));
        assert_eq!(resolve(c"cuNoSuchThing", 12000, 0), (500, None, 1));
        // Real error codes for misuse.
        let alloc: Alloc = std::mem::transmute(sym("cuMemAlloc_v2"));
        let mut p = 0u64;
        assert_eq!(
            alloc(&mut p, 1024),
            3,
            "before cuInit: CUDA_ERROR_NOT_INITIALIZED"
        );
        let init: Init = std::mem::transmute(sym("cuInit"));
        assert_eq!(init(0), 0);
        assert_eq!(
            alloc(&mut p, 1024),
            201,
            "no context: CUDA_ERROR_INVALID_CONTEXT"
        );
        type DevGet = unsafe extern "C" fn(*mut i32, i32) -> u32;
        type Retain = unsafe extern "C" fn(*mut *mut std::ffi::c_void, i32) -> u32;
        type SetCur = unsafe extern "C" fn(*mut std::ffi::c_void) -> u32;
        type Free = unsafe extern "C" fn(u64) -> u32;
        type Launch = unsafe extern "C" fn(
            *mut std::ffi::c_void,
            u32,
            u32,
            u32,
            u32,
            u32,
            u32,
            u32,
            *mut std::ffi::c_void,
            *mut *mut std::ffi::c_void,
            *mut *mut std::ffi::c_void,
        ) -> u32;
        let dev_get: DevGet = std::mem::transmute(sym("cuDeviceGet"));
        let mut d = 0;
        assert_eq!(dev_get(&mut d, 7), 101, "CUDA_ERROR_INVALID_DEVICE");
        let retain: Retain = std::mem::transmute(sym("cuDevicePrimaryCtxRetain"));
        let mut ctx = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx, 0), 0);
        let set: SetCur = std::mem::transmute(sym("cuCtxSetCurrent"));
        assert_eq!(set(ctx), 0);
        assert_eq!(alloc(&mut p, 0), 1, "zero bytes: CUDA_ERROR_INVALID_VALUE");
        assert_eq!(alloc(&mut p, 1024), 0);
        let free: Free = std::mem::transmute(sym("cuMemFree_v2"));
        assert_eq!(
            free(p + 8),
            1,
            "not an allocation: CUDA_ERROR_INVALID_VALUE"
        );
        assert_eq!(free(p), 0);
        assert_eq!(free(p), 1, "double free");
        let launch: Launch = std::mem::transmute(sym("cuLaunchKernel"));
        let null = std::ptr::null_mut();
        assert_eq!(
            launch(
                0xdead0 as *mut _,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null,
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ),
            400,
            "bad function: CUDA_ERROR_INVALID_HANDLE"
        );
        type ErrName = unsafe extern "C" fn(u32, *mut *const i8) -> u32;
        let name: ErrName = std::mem::transmute(sym("cuGetErrorName"));
        let mut s = std::ptr::null();
        assert_eq!(name(2, &mut s), 0);
        assert_eq!(
            std::ffi::CStr::from_ptr(s).to_str().unwrap(),
            "CUDA_ERROR_OUT_OF_MEMORY"
        );
    }
    println!("api checks passed");
}

#[test]
fn cudarc_loads_the_simulator_with_and_without_memory_pools() {
    let sim = SimEnv::new(1, "1GiB");
    for pools in ["1", "0"] {
        let mut c = sim.command(gemini_tests::bin("cudarc_probe"));
        c.env("FAKECUDA_POOLS", pools);
        let out = run(c);
        let text = String::from_utf8_lossy(&out.stdout);
        assert!(
            text.contains(&format!(
                "cudarc-probe ok pools={pools} free={}",
                (1u64 << 30) - (64 << 20)
            )),
            "{text}"
        );
    }
    let recs = fakecuda_log_records(&sim);
    assert_eq!(
        recs.iter().filter(|r| r.end - r.start == 2_000_000).count(),
        2,
        "{recs:?}"
    );
}

fn fakecuda_log_records(sim: &SimEnv) -> Vec<fakecuda_log::Record> {
    fakecuda_log::read(&sim.sim_dir(), 0).unwrap()
}

#[test]
fn cuda_visible_devices_renumbers_devices() {
    let sim = SimEnv::new(2, "16GiB");
    let mut c = sim.workload();
    c.args(["--seconds", "0.3", "--kernel-us", "1000"])
        .env("CUDA_VISIBLE_DEVICES", "1");
    let t0 = now_ns();
    let out = run(c);
    let pid = pids(&[&out])[0];
    assert!(
        sim.busy(1, t0, now_ns()).share(pid) > 0.5,
        "ordinal 0 is physical device 1"
    );
    assert_eq!(sim.busy(0, t0, now_ns()).device, 0);
    let mut c = sim.workload();
    c.args(["--seconds", "0", "--device", "1"])
        .env("CUDA_VISIBLE_DEVICES", "1");
    assert!(
        !c.output().unwrap().status.success(),
        "only one device is visible"
    );
}

/// Each way a program waits for its work returns only once the work
/// queued before it has run, as with the real driver: at the start of
/// every iteration after the first, no kernel launched earlier is still
/// running. A blocking copy on the legacy default stream waits for a
/// stream of the program's own too (the legacy stream synchronises with
/// every blocking stream); `_ptds` copies wait for the per-thread stream.
#[test]
fn every_kind_of_wait_waits_for_the_work_before_it() {
    let sim = SimEnv::default();
    let cases: &[&[&str]] = &[
        &["--wait", "stream"],
        &["--wait", "ctx"],
        &["--wait", "event"],
        &["--wait", "copy"],
        &["--wait", "query"],
        &["--wait", "event-query"],
        &["--wait", "copy", "--own-streams"],
        &["--wait", "event", "--own-streams"],
        &["--wait", "copy", "--ptsz", "--resolve", "dlsym"],
        &["--wait", "copy", "--ptsz"],
    ];
    for (i, case) in cases.iter().enumerate() {
        let bursts = sim.path().join(format!("bursts-{i}.txt"));
        let demand = sim.path().join(format!("demand-{i}.txt"));
        let mut c = sim.workload();
        c.args([
            "--seconds",
            "0.3",
            "--kernel-us",
            "2000",
            "--iter-kernels",
            "4",
        ])
        .args(*case)
        .arg("--bursts-file")
        .arg(&bursts)
        .arg("--demand-file")
        .arg(&demand);
        let out = run(c);
        let pid = pids(&[&out])[0];
        let recs: Vec<_> = fakecuda_log_records(&sim)
            .into_iter()
            .filter(|r| r.pid == pid)
            .collect();
        let starts: Vec<u64> = std::fs::read_to_string(&bursts)
            .unwrap()
            .lines()
            .filter_map(|l| l.parse().ok())
            .collect();
        // About 37 iterations in 0.3 s; a few suffice for the check, and a
        // host that deschedules the VM's vCPUs leaves fewer.
        assert!(starts.len() >= 3, "{case:?}: {} iterations", starts.len());
        for t in &starts[1..] {
            let late = recs.iter().filter(|r| r.start < *t && r.end > *t).count();
            assert_eq!(
                late, 0,
                "{case:?}: work still running when the wait returned"
            );
        }
        // --demand-file: one `start end` per iteration, and every kernel
        // ran inside one (from the first launch to the wait's return).
        let demand: Vec<(u64, u64)> = std::fs::read_to_string(&demand)
            .unwrap()
            .lines()
            .filter_map(|l| {
                let (a, b) = l.split_once(' ')?;
                Some((a.parse().ok()?, b.parse().ok()?))
            })
            .collect();
        assert_eq!(demand.len(), starts.len(), "{case:?}");
        assert!(
            demand
                .iter()
                .zip(&starts)
                .all(|(d, s)| d.0 == *s && d.1 > d.0)
        );
        for r in &recs {
            assert!(
                demand.iter().any(|&(a, b)| r.start >= a && r.end <= b),
                "{case:?}: kernel {r:?} outside every burst {demand:?}"
            );
        }
    }
}

/// A device cgroup (Slurm's `ConstrainDevices`, a container's `--gpus`)
/// hides the other GPUs from CUDA, which numbers the allowed ones from 0,
/// while NVML still counts every GPU and refuses a handle to the hidden
/// ones (`NVML_ERROR_NO_PERMISSION`, 4); in a container, which has only
/// its GPUs' device nodes, NVML too numbers them from 0. A GPU's UUID is
/// the same through both and in every process: what names a GPU across
/// processes whose ordinals differ.
#[test]
fn a_device_cgroup_renumbers_cuda_and_nvml_names_every_gpu_by_uuid() {
    let sim = SimEnv::new(4, "16GiB");
    let identify_in = |container: bool, cgroup: Option<&str>, visible: Option<&str>| {
        let mut c = sim.workload();
        c.arg("--identify");
        if container {
            c.env("FAKECUDA_CONTAINER", "1");
        }
        if let Some(v) = cgroup {
            c.env("FAKECUDA_CGROUP_DEVICES", v);
        }
        if let Some(v) = visible {
            c.env("CUDA_VISIBLE_DEVICES", v);
        }
        let out = run(c);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let cuda: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("cuda ordinal="))
            .map(|l| l.split_once(" uuid=").unwrap().1.to_string())
            .collect();
        let nvml: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("nvml index="))
            .map(|l| l.split_once(' ').unwrap().1.to_string())
            .collect();
        (cuda, nvml)
    };
    let identify =
        |cgroup: Option<&str>, visible: Option<&str>| identify_in(false, cgroup, visible);
    let (cuda, nvml) = identify(None, None);
    assert_eq!(cuda.len(), 4);
    let uuids: Vec<String> = nvml
        .iter()
        .map(|v| v.strip_prefix("uuid=").unwrap().to_string())
        .collect();
    assert_eq!(cuda, uuids, "ordinal i is GPU i without a cgroup");
    let distinct: std::collections::BTreeSet<&String> = uuids.iter().collect();
    assert_eq!(distinct.len(), 4);
    assert!(
        uuids.iter().all(|u| u.starts_with("GPU-") && u.len() == 40),
        "{uuids:?}"
    );

    // A job given GPUs 1 and 3: CUDA sees two, as ordinals 0 and 1.
    let (cuda, nvml) = identify(Some("3,1"), None);
    assert_eq!(cuda, [uuids[1].clone(), uuids[3].clone()]);
    assert_eq!(nvml.len(), 4, "NVML counts every GPU: {nvml:?}");
    assert_eq!(nvml[0], "error=4");
    assert_eq!(nvml[1], format!("uuid={}", uuids[1]));
    assert_eq!(nvml[2], "error=4");
    assert_eq!(nvml[3], format!("uuid={}", uuids[3]));
    // CUDA_VISIBLE_DEVICES counts within the cgroup.
    let (cuda, _) = identify(Some("1,3"), Some("1"));
    assert_eq!(cuda, [uuids[3].clone()]);
    // A container given GPUs 1 and 3 has only their device nodes: NVML
    // too sees two GPUs, numbered 0 and 1; the UUIDs still name them.
    let (cuda, nvml) = identify_in(true, Some("3,1"), None);
    assert_eq!(cuda, [uuids[1].clone(), uuids[3].clone()]);
    assert_eq!(
        nvml,
        [format!("uuid={}", uuids[1]), format!("uuid={}", uuids[3])],
        "NVML in a container sees only its GPUs"
    );

    // A kernel on ordinal 0 of a job given GPU 2 runs on GPU 2.
    let mut c = sim.workload();
    c.args(["--seconds", "0.3", "--kernel-us", "1000"])
        .env("FAKECUDA_CGROUP_DEVICES", "2");
    let t0 = now_ns();
    let out = run(c);
    let pid = pids(&[&out])[0];
    assert!(sim.busy(2, t0, now_ns()).share(pid) > 0.5);
    assert_eq!(sim.busy(0, t0, now_ns()).device, 0);
}
