//! The simulator's driver API as programs call it: `cuGetProcAddress`
//! versions and per-thread flags, checks in a fresh process, cudarc with
//! and without memory pools, and every kind of wait.

use super::*;

#[test]
fn get_proc_address_honours_version_and_per_thread_flag() {
    let sim = SimEnv::default();
    let exe = std::env::current_exe().unwrap();
    let mut c = sim.command(exe);
    c.args([
        "--exact",
        "simulator::api::api_checks_in_a_fresh_process",
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
