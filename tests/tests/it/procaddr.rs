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
    for runtime in ["12.9.79", "13.0.96", "13.5.37"] {
        let file = data.join(format!("{runtime}.tsv"));
        let sim = SimEnv::default();
        let run = |hooked: bool| {
            let mut c = sim.command(bin("gem-procaddr"));
            c.arg(&file);
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
        let mut ours = 0;
        for (a, b) in plain.lines().zip(hooked.lines()) {
            let (a, b): (Vec<&str>, Vec<&str>) = (a.split('\t').collect(), b.split('\t').collect());
            // symbol, version, flags, result, status, found.
            assert_eq!(a[..6], b[..6], "{runtime}: the hook changed the answer");
            assert_ne!(a[6], "hook", "{runtime}: {a:?} without the hook");
            if HOOKED.contains(&b[0]) && b[5] == "true" {
                assert_eq!(b[6], "hook", "{runtime}: {b:?} is not the hook's wrapper");
            }
            ours += usize::from(b[6] == "hook");
        }
        assert!(ours >= 40, "{runtime}: only {ours} answers were the hook's");
    }
}
