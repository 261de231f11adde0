//! `cuGetProcAddress`: from a base name, the requested CUDA version and
//! the per-thread-default-stream flag to the versioned entry point, as the
//! real driver does (a `cuMemAlloc` asked for at version ≥ 3020 is
//! `cuMemAlloc_v2`; with the per-thread flag, `cuLaunchKernel` is
//! `cuLaunchKernel_ptsz`).

/// Whether the exported symbol `name` is served only through
/// `cuGetProcAddress`: with `FAKECUDA_PROCADDR_ONLY=1` the simulator is a
/// driver that serves its versioned entry points (`_v2`, `_ptsz`, ...)
/// only that way, as NVIDIA asks programs to reach them; called through
/// the exported symbol, they answer `CUDA_ERROR_NOT_FOUND`.
pub fn served_only(name: &str) -> bool {
    // What the CUDA runtime itself finds with dlsym stays exported.
    only_through_proc_address()
        && name != "cuGetProcAddress_v2"
        && (VERSIONED.iter().any(|(_, _, s)| *s == name)
            || name.ends_with("_ptsz")
            || name.ends_with("_ptds"))
}

/// Whether `FAKECUDA_PROCADDR_ONLY=1` (read once): then the exported
/// symbols of versioned entry points answer `CUDA_ERROR_NOT_FOUND`.
/// (`cuGetProcAddress` always hands out functions of the driver's own, as
/// the real driver does, never its exports: a library preloaded beside
/// it that exports the same names is not handed out instead.)
pub fn only_through_proc_address() -> bool {
    use std::sync::atomic::{AtomicU8, Ordering};
    static ON: AtomicU8 = AtomicU8::new(0);
    match ON.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var("FAKECUDA_PROCADDR_ONLY").is_ok_and(|v| v == "1");
            ON.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// The CUDA version the driver reports: `FAKECUDA_DRIVER_VERSION`, else
/// 12080 (read once). A CUDA 13 runtime refuses a driver under 13000.
pub fn driver_version() -> i32 {
    use std::sync::atomic::{AtomicI32, Ordering};
    static V: AtomicI32 = AtomicI32::new(0);
    match V.load(Ordering::Relaxed) {
        0 => {
            let v = std::env::var("FAKECUDA_DRIVER_VERSION")
                .ok()
                .and_then(|v| v.parse().ok())
                .filter(|v| *v > 0)
                .unwrap_or(12080);
            V.store(v, Ordering::Relaxed);
            v
        }
        v => v,
    }
}

/// (base name, first CUDA version of the variant, the variant's symbol).
/// For each base name, the entry with the highest version not above the
/// requested one wins; without one the base name itself is the symbol.
pub const VERSIONED: &[(&str, i32, &str)] = &[
    ("cuArray3DCreate", 3020, "cuArray3DCreate_v2"),
    ("cuArrayCreate", 3020, "cuArrayCreate_v2"),
    ("cuIpcOpenMemHandle", 11000, "cuIpcOpenMemHandle_v2"),
    ("cuMemAllocHost", 3020, "cuMemAllocHost_v2"),
    ("cuCtxCreate", 3020, "cuCtxCreate_v2"),
    ("cuCtxCreate", 11040, "cuCtxCreate_v3"),
    ("cuCtxCreate", 12050, "cuCtxCreate_v4"),
    ("cuCtxGetDevice", 13000, "cuCtxGetDevice_v2"),
    ("cuCtxSynchronize", 13000, "cuCtxSynchronize_v2"),
    ("cuCtxDestroy", 4000, "cuCtxDestroy_v2"),
    ("cuCtxPopCurrent", 4000, "cuCtxPopCurrent_v2"),
    ("cuCtxPushCurrent", 4000, "cuCtxPushCurrent_v2"),
    (
        "cuDevicePrimaryCtxRelease",
        11000,
        "cuDevicePrimaryCtxRelease_v2",
    ),
    (
        "cuDevicePrimaryCtxReset",
        11000,
        "cuDevicePrimaryCtxReset_v2",
    ),
    (
        "cuDevicePrimaryCtxSetFlags",
        11000,
        "cuDevicePrimaryCtxSetFlags_v2",
    ),
    ("cuDeviceTotalMem", 3020, "cuDeviceTotalMem_v2"),
    ("cuDeviceGetUuid", 11040, "cuDeviceGetUuid_v2"),
    ("cuEventDestroy", 4000, "cuEventDestroy_v2"),
    ("cuEventElapsedTime", 12080, "cuEventElapsedTime_v2"),
    ("cuGetProcAddress", 12000, "cuGetProcAddress_v2"),
    ("cuGraphAddKernelNode", 12000, "cuGraphAddKernelNode_v2"),
    ("cuGraphInstantiate", 11000, "cuGraphInstantiate_v2"),
    ("cuGraphInstantiate", 12000, "cuGraphInstantiateWithFlags"),
    ("cuMemAlloc", 3020, "cuMemAlloc_v2"),
    ("cuMemAllocPitch", 3020, "cuMemAllocPitch_v2"),
    ("cuMemFree", 3020, "cuMemFree_v2"),
    ("cuMemGetInfo", 3020, "cuMemGetInfo_v2"),
    ("cuMemcpyDtoD", 3020, "cuMemcpyDtoD_v2"),
    ("cuMemcpyDtoH", 3020, "cuMemcpyDtoH_v2"),
    ("cuMemcpyDtoHAsync", 3020, "cuMemcpyDtoHAsync_v2"),
    ("cuMemcpyHtoD", 3020, "cuMemcpyHtoD_v2"),
    ("cuMemcpyHtoDAsync", 3020, "cuMemcpyHtoDAsync_v2"),
    ("cuMemsetD32", 3020, "cuMemsetD32_v2"),
    ("cuMemsetD8", 3020, "cuMemsetD8_v2"),
    ("cuStreamBeginCapture", 10010, "cuStreamBeginCapture_v2"),
    ("cuStreamDestroy", 4000, "cuStreamDestroy_v2"),
    ("cuStreamGetCaptureInfo", 11030, "cuStreamGetCaptureInfo_v2"),
];

/// First CUDA version that has `name` at all (functions not listed exist
/// in every version the simulator reports).
pub const INTRODUCED: &[(&str, i32)] = &[
    ("cuGetProcAddress", 11030),
    ("cuLibraryLoadData", 12000),
    ("cuLibraryGetKernel", 12000),
    ("cuLibraryUnload", 12000),
    ("cuKernelGetAttribute", 12000),
    ("cuLaunchKernelEx", 11060),
    ("cuMemAllocAsync", 11020),
    ("cuMemFreeAsync", 11020),
    ("cuMemAllocFromPoolAsync", 11020),
    ("cuMemCreate", 10020),
    ("cuMemRelease", 10020),
    ("cuGraphInstantiateWithFlags", 11040),
    ("cuDeviceGetMemPool", 11020),
    ("cuDeviceSetMemPool", 11020),
    ("cuDeviceGetDefaultMemPool", 11020),
    ("cuMemPoolCreate", 11020),
    ("cuMemPoolDestroy", 11020),
    ("cuMemPoolGetAttribute", 11020),
    ("cuMemPoolSetAttribute", 11020),
    ("cuMemPoolTrimTo", 11020),
    ("cuStreamBeginCapture", 10000),
    ("cuStreamEndCapture", 10000),
    ("cuStreamIsCapturing", 10000),
    ("cuStreamGetCaptureInfo", 10010),
    ("cuThreadExchangeStreamCaptureMode", 10010),
];

/// Outcome of a lookup.
#[derive(Debug, PartialEq, Eq)]
pub enum Resolved {
    /// The symbol to return.
    Symbol(String),
    /// The function exists only in later versions.
    VersionNotSufficient,
    /// The function is newer than this driver.
    NotFound,
}

/// The symbol `cuGetProcAddress(name, version, flags)` stands for, from
/// this driver (see [`driver_version`]); `exists` tells whether the
/// simulator exports a symbol.
pub fn resolve(
    name: &str,
    version: i32,
    per_thread: bool,
    exists: impl Fn(&str) -> bool,
) -> Resolved {
    resolve_from(driver_version(), name, version, per_thread, exists)
}

/// [`resolve`] by a driver of CUDA version `driver`: a version asked for
/// above the driver's gets the newest variant the driver has (a 12.8
/// driver asked for `cuCtxSynchronize` at 13000 hands out the one it
/// has), and a function newer than the driver is not found.
pub fn resolve_from(
    driver: i32,
    name: &str,
    version: i32,
    per_thread: bool,
    exists: impl Fn(&str) -> bool,
) -> Resolved {
    if let Some((_, v)) = INTRODUCED.iter().find(|(n, _)| *n == name) {
        if version < *v {
            return Resolved::VersionNotSufficient;
        }
        if driver < *v {
            return Resolved::NotFound;
        }
    }
    let version = version.min(driver);
    let base = VERSIONED
        .iter()
        .filter(|(n, v, _)| *n == name && *v <= version)
        .max_by_key(|(_, v, _)| *v)
        .map_or(name, |(_, _, s)| *s);
    if per_thread {
        for suffix in ["_ptsz", "_ptds"] {
            let s = format!("{base}{suffix}");
            if exists(&s) {
                return Resolved::Symbol(s);
            }
        }
    }
    Resolved::Symbol(base.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn r(name: &str, v: i32, pt: bool) -> Resolved {
        resolve(name, v, pt, |s| {
            s.ends_with("_ptsz") && s.starts_with("cuLaunchKernel") || s == "cuMemcpyHtoD_v2_ptds"
        })
    }

    #[test]
    fn versions_pick_the_right_variant() {
        assert_eq!(
            r("cuMemAlloc", 12000, false),
            Resolved::Symbol("cuMemAlloc_v2".into())
        );
        assert_eq!(
            r("cuMemAlloc", 3010, false),
            Resolved::Symbol("cuMemAlloc".into())
        );
        assert_eq!(
            r("cuGraphInstantiate", 11000, false),
            Resolved::Symbol("cuGraphInstantiate_v2".into())
        );
        assert_eq!(
            r("cuGraphInstantiate", 12040, false),
            Resolved::Symbol("cuGraphInstantiateWithFlags".into())
        );
        assert_eq!(r("cuInit", 12000, false), Resolved::Symbol("cuInit".into()));
        assert_eq!(
            r("cuMemAllocAsync", 11000, false),
            Resolved::VersionNotSufficient
        );
    }

    #[test]
    fn a_driver_hands_out_the_newest_variant_it_has() {
        let at = |driver: i32, name: &str, v: i32| resolve_from(driver, name, v, false, |_| true);
        assert_eq!(
            at(13050, "cuCtxSynchronize", 13000),
            Resolved::Symbol("cuCtxSynchronize_v2".into())
        );
        assert_eq!(
            at(12080, "cuCtxSynchronize", 13000),
            Resolved::Symbol("cuCtxSynchronize".into())
        );
        assert_eq!(
            at(13050, "cuCtxSynchronize", 12080),
            Resolved::Symbol("cuCtxSynchronize".into())
        );
        assert_eq!(
            at(12000, "cuCtxCreate", 13000),
            Resolved::Symbol("cuCtxCreate_v3".into())
        );
        assert_eq!(at(11000, "cuMemAllocAsync", 13000), Resolved::NotFound);
    }

    #[test]
    fn per_thread_flag_picks_ptsz_and_ptds() {
        assert_eq!(
            r("cuLaunchKernel", 12000, true),
            Resolved::Symbol("cuLaunchKernel_ptsz".into())
        );
        assert_eq!(
            r("cuLaunchKernel", 12000, false),
            Resolved::Symbol("cuLaunchKernel".into())
        );
        assert_eq!(
            r("cuMemcpyHtoD", 12000, true),
            Resolved::Symbol("cuMemcpyHtoD_v2_ptds".into())
        );
        assert_eq!(r("cuInit", 12000, true), Resolved::Symbol("cuInit".into()));
    }
}
