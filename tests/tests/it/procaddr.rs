//! What NVIDIA's CUDA runtime asks the driver for at start-up
//! (`tests/data/cudart-lookups`: every `cuGetProcAddress` request of
//! libcudart 12.9.79, 13.0.96 and 13.5.37) gets the same answer through
//! the hook as from the driver alone, and the hook's own wrapper where it
//! gates or charges.

use gemini_tests::{SimEnv, bin};

/// Entry points the runtime asks for that the hook must answer with its
/// own wrapper (every version and flag the runtime asks with): launches,
/// allocations, frees, memory queries, synchronisations, graphs.
const HOOKED: &[&str] = &[
    "cuLaunchKernel",
    "cuLaunchKernelEx",
    "cuLaunchCooperativeKernel",
    "cuGraphLaunch",
    "cuGraphInstantiate",
    "cuGraphInstantiateWithParams",
    "cuMemAlloc",
    "cuMemAllocPitch",
    "cuMemAllocManaged",
    "cuMemAllocAsync",
    "cuMemAllocFromPoolAsync",
    "cuMemCreate",
    "cuMemFree",
    "cuMemFreeAsync",
    "cuMemRelease",
    "cuMemMap",
    "cuMemUnmap",
    "cuMemGetInfo",
    "cuDeviceTotalMem",
    "cuStreamSynchronize",
    "cuCtxSynchronize",
    "cuEventSynchronize",
    "cuStreamBeginCapture",
    "cuStreamEndCapture",
    "cuDevicePrimaryCtxRetain",
    "cuDevicePrimaryCtxRelease",
    "cuModuleLoadData",
    "cuLibraryLoadData",
];

#[test]
fn the_cuda_runtimes_lookups_get_the_drivers_answers_through_the_hook() {
    let data = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("data/cudart-lookups");
    // Also from a driver that serves its versioned entry points only
    // through cuGetProcAddress.
    for (runtime, only) in ["12.9.79", "13.0.96", "13.5.37"]
        .into_iter()
        .flat_map(|r| [(r, false), (r, true)])
    {
        let file = data.join(format!("{runtime}.tsv"));
        let mut sim = SimEnv::default();
        sim.procaddr_only = only;
        let run = |hooked: bool| {
            let mut c = sim.command(bin("gem-procaddr"));
            c.arg(&file);
            // A CUDA 13 runtime needs a 13.x driver, which maps some names
            // to newer entry points (cuCtxSynchronize at 13000 is
            // cuCtxSynchronize_v2).
            if runtime.starts_with("13.") {
                c.env("FAKECUDA_DRIVER_VERSION", "13050");
            }
            if hooked {
                c.env("LD_PRELOAD", bin("libgemhook.so"));
            }
            let out = c.output().unwrap();
            assert!(
                out.status.success(),
                "{runtime}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
            String::from_utf8(out.stdout).unwrap()
        };
        let (plain, hooked) = (run(false), run(true));
        let requests = std::fs::read_to_string(&file)
            .unwrap()
            .lines()
            .filter(|l| !l.starts_with('#'))
            .count();
        assert_eq!(plain.lines().count(), requests, "{runtime}");
        assert_eq!(hooked.lines().count(), requests, "{runtime}");
        for b in same_answers(runtime, &plain, &hooked) {
            if HOOKED.contains(&b[0]) && b[5] == "true" {
                assert_eq!(b[6], "hook", "{runtime}: {b:?} is not the hook's wrapper");
            }
        }
    }
}

/// `gem-procaddr`'s lines without the hook (`plain`) and with it
/// (`hooked`), for `runtime`: checks that the hook changed no answer
/// (symbol, version, flags, result, status, found), that nothing is the
/// hook's without it, and that at least 40 answers are the hook's
/// wrappers with it; returns the hooked lines' fields.
pub(crate) fn same_answers<'a>(runtime: &str, plain: &str, hooked: &'a str) -> Vec<Vec<&'a str>> {
    let mut ours = 0;
    let mut lines = Vec::new();
    for (a, b) in plain.lines().zip(hooked.lines()) {
        let (a, b): (Vec<&str>, Vec<&str>) = (a.split('\t').collect(), b.split('\t').collect());
        assert_eq!(a[..6], b[..6], "{runtime}: the hook changed the answer");
        assert_ne!(a[6], "hook", "{runtime}: {a:?} without the hook");
        ours += usize::from(b[6] == "hook");
        lines.push(b);
    }
    assert!(
        ours >= 40,
        "{runtime}: only {ours} answers were the hook's:\n{hooked}"
    );
    lines
}

/// With a driver that serves its versioned entry points only through
/// `cuGetProcAddress` (as NVIDIA asks programs to reach them), a program
/// that finds everything that way works the same under the hook: the
/// hook calls the functions the driver handed out for each wrapper's
/// name, version and flag, and reaches the driver that way for itself. A
/// capture, its replays, pool and plain allocations, a context's memory,
/// a released VMM handle and the runtime's lookups are checked. (Before,
/// the hook called the exported `cuStreamBeginCapture_v2`, and such a
/// program got `CUDA_ERROR_NOT_FOUND` under the hook only.)
#[test]
fn a_driver_that_serves_versions_only_through_get_proc_address_works_under_the_hook() {
    let mut sim = SimEnv::default().driver_memory("300MiB");
    sim.procaddr_only = true;
    let g = gemini_tests::Gemini::start(sim, "[a]\nMemoryLimit=1GiB\n");
    // Without the hook the driver works (its versioned symbols do not).
    let plain = g
        .sim
        .workload()
        .args([
            "--capture",
            "40",
            "--capture-pause-ms",
            "0",
            "--seconds",
            "0",
        ])
        .output()
        .unwrap();
    assert!(
        plain.status.success(),
        "{}",
        String::from_utf8_lossy(&plain.stderr)
    );
    let hooked = g
        .hooked(g.sim.workload(), "a")
        .args([
            "--capture",
            "40",
            "--capture-pause-ms",
            "0",
            "--seconds",
            "0.3",
            "--kernel-us",
            "500",
            "--alloc-api",
            "async",
            "--mem",
            "256MiB",
        ])
        .output()
        .unwrap();
    assert!(
        hooked.status.success(),
        "under the hook: {}",
        String::from_utf8_lossy(&hooked.stderr)
    );
    let r = &gemini_tests::reports(&hooked.stdout)[0];
    assert!(gemini_tests::field(r, "kernels") > 40, "{r:?}");
    assert_eq!(gemini_tests::field(r, "allocated"), 256 << 20);
    // The group's view: 300 MiB of context, 256 MiB of pool and the
    // 8-byte module image ("fakecuda"), through the hook's own
    // cuMemGetInfo_v2 (reached through cuGetProcAddress).
    assert_eq!(
        gemini_tests::field(r, "free"),
        (1 << 30) - (556 << 20) - 8,
        "{r:?}"
    );
}

/// The hook's gate and memory cap with that driver, for every way a
/// program launches and allocates: each launch API (with and without the
/// per-thread default stream) stays under MaxUtil 0.4, and each
/// allocation API is refused past the group's 512 MiB, the hook reaching
/// every real function through `cuGetProcAddress`. The eight launch
/// variants run at once, one per simulated GPU (independent devices, a
/// group capped on each), instead of 2 s each in turn.
#[test]
fn gating_and_caps_hold_with_a_driver_that_serves_versions_only_through_get_proc_address() {
    use gemini_tests::cpu::{MAX_STEAL, measured, serial};
    let _serial = serial();
    let variants: Vec<(&str, bool)> = ["kernel", "ex", "coop", "graph"]
        .into_iter()
        .flat_map(|api| [(api, false), (api, true)])
        .collect();
    let mut sim = SimEnv::new(variants.len() as u32, "16GiB");
    sim.procaddr_only = true;
    let conf: String = (0..variants.len())
        .map(|i| format!("[g{i}]\nMaxUtil=0.4\nMemoryLimit=512MiB\nDevices={i}\n"))
        .collect();
    let g = gemini_tests::Gemini::start(sim, &conf);
    let run = || {
        let t0 = gemini_tests::now_ns();
        let children: Vec<_> = variants
            .iter()
            .enumerate()
            .map(|(i, &(api, ptsz))| {
                let dev = i.to_string();
                let mut c = g.hooked(g.sim.workload(), &format!("g{i}"));
                c.args(["--seconds", "2", "--kernel-us", "500", "--launch-api", api])
                    .args(["--device", &dev])
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped());
                if ptsz {
                    c.arg("--ptsz");
                }
                c.spawn().unwrap()
            })
            .collect();
        let pids: Vec<u32> = children
            .into_iter()
            .zip(&variants)
            .map(|(c, (api, ptsz))| {
                let out = c.wait_with_output().unwrap();
                assert!(
                    out.status.success(),
                    "{api} ptsz={ptsz}: {}",
                    String::from_utf8_lossy(&out.stderr)
                );
                gemini_tests::field(&gemini_tests::reports(&out.stdout)[0], "pid") as u32
            })
            .collect();
        pids.iter()
            .enumerate()
            .map(|(i, &pid)| {
                g.sim
                    .busy(i as u32, t0 + 500_000_000, t0 + 2_000_000_000)
                    .share(pid)
            })
            .collect::<Vec<f64>>()
    };
    let (shares, counts) = measured("eight launch APIs at once", MAX_STEAL, 2, run);
    for (&(api, ptsz), share) in variants.iter().zip(shares) {
        let what = format!("{api} ptsz={ptsz}");
        assert!(share <= 0.45, "{what}: {share:.3} over the 0.4 cap");
        if counts {
            assert!(share >= 0.3, "{what}: {share:.3} of its 0.4");
        }
    }
    for api in ["v2", "pitch", "managed", "async", "create", "array"] {
        let out = g
            .hooked(g.sim.workload(), "g0")
            .args(["--seconds", "0", "--alloc-api", api, "--mem", "600MiB"])
            .output()
            .unwrap();
        let r = &gemini_tests::reports(&out.stdout)[0];
        assert_eq!(
            gemini_tests::field(r, "alloc_error"),
            2,
            "{api}: 600 MiB under a 512 MiB limit: {r:?}"
        );
    }
}
