//! The NVML calls `gem-holder` and monitoring code make, answered from
//! the simulator: device memory (every process counted, as NVML does),
//! device count, handles, and GPU utilisation — the share of the last
//! `FAKECUDA_NVML_WINDOW_MS` (default 200 ms) during which the device ran a
//! kernel, from the busy log, as a whole percentage like NVML's.

use crate::device::Sim;
use fakecuda_log::{busy, now_ns, read_tail};
use std::ffi::c_void;

type NvmlReturn = u32;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_NO_PERMISSION: NvmlReturn = 4;
const NVML_ERROR_NOT_FOUND: NvmlReturn = 6;
const NVML_ERROR_INSUFFICIENT_SIZE: NvmlReturn = 7;
const NVML_ERROR_LIBRARY_NOT_FOUND: NvmlReturn = 12;
const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlUtilization {
    gpu: u32,
    memory: u32,
}

/// The simulator as NVML reaches it: not at all on a machine without
/// NVML (`FAKECUDA_NVML=missing`: a container that does not expose
/// `libnvidia-ml.so.1`, whose CUDA driver still works), where `nvmlInit`
/// fails and so does every call after it.
fn sim() -> Result<&'static Sim, NvmlReturn> {
    if std::env::var("FAKECUDA_NVML").is_ok_and(|v| v == "missing") {
        return Err(NVML_ERROR_LIBRARY_NOT_FOUND);
    }
    crate::device::sim().map_err(|_| NVML_ERROR_UNINITIALIZED)
}

fn window_ns() -> u64 {
    std::env::var("FAKECUDA_NVML_WINDOW_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(200)
        * 1_000_000
}

/// `nvmlInit_v2`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlInit_v2() -> NvmlReturn {
    match sim() {
        Ok(_) => NVML_SUCCESS,
        Err(e) => e,
    }
}

/// `nvmlShutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

/// `nvmlDeviceGetCount_v2`: every simulated device (NVML ignores
/// `CUDA_VISIBLE_DEVICES`), or in a container (`FAKECUDA_CONTAINER`) the
/// container's.
///
/// # Safety
/// `count` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetCount_v2(count: *mut u32) -> NvmlReturn {
    let Ok(s) = sim() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *count = s.nvml_count() as u32 };
    NVML_SUCCESS
}

/// `nvmlDeviceGetHandleByIndex_v2`: the handle is the index plus one; a
/// device the process's device cgroup does not let it open is refused
/// with `NVML_ERROR_NO_PERMISSION`, as NVML does (`nvidia-smi` in a Slurm
/// job with `ConstrainDevices`: "Insufficient Permissions").
///
/// # Safety
/// `handle` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByIndex_v2(
    index: u32,
    handle: *mut *mut c_void,
) -> NvmlReturn {
    let Ok(s) = sim() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    let Some(dev) = s.nvml_device(index as usize) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    if handle.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if !s.may_open(dev) {
        return NVML_ERROR_NO_PERMISSION;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *handle = (dev + 1) as *mut c_void };
    NVML_SUCCESS
}

/// `nvmlDeviceGetHandleByUUID`: `NVML_ERROR_NOT_FOUND` for a UUID of no
/// device, `NVML_ERROR_NO_PERMISSION` for one the device cgroup hides.
///
/// # Safety
/// `uuid` must be a NUL-terminated string and `handle` writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetHandleByUUID(
    uuid: *const std::ffi::c_char,
    handle: *mut *mut c_void,
) -> NvmlReturn {
    let Ok(s) = sim() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    if uuid.is_null() || handle.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let text = unsafe { std::ffi::CStr::from_ptr(uuid) }.to_string_lossy();
    if text.starts_with("MIG-") {
        let Some(dev) = s
            .mig
            .iter()
            .copied()
            .filter(|&d| s.nvml_index(d).is_some())
            .find(|&d| crate::device::mig_uuid_text(d) == text)
        else {
            return NVML_ERROR_NOT_FOUND;
        };
        if !s.may_open(dev) {
            return NVML_ERROR_NO_PERMISSION;
        }
        // SAFETY: non-null out-pointer from the caller.
        unsafe { *handle = (MIG_HANDLES + dev + 1) as *mut c_void };
        return NVML_SUCCESS;
    }
    let Some(dev) = (0..s.total_devices())
        .filter(|&d| s.nvml_index(d).is_some())
        .find(|&d| crate::device::uuid_text(d) == text)
    else {
        return NVML_ERROR_NOT_FOUND;
    };
    if !s.may_open(dev) {
        return NVML_ERROR_NO_PERMISSION;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *handle = (dev + 1) as *mut c_void };
    NVML_SUCCESS
}

/// `nvmlDeviceGetUUID`: `GPU-` and the bytes `cuDeviceGetUuid` gives, NUL
/// terminated; `NVML_ERROR_INSUFFICIENT_SIZE` if `length` cannot hold it.
///
/// # Safety
/// `uuid` must hold `length` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUUID(
    handle: *mut c_void,
    uuid: *mut std::ffi::c_char,
    length: u32,
) -> NvmlReturn {
    let text = match (mig_of(handle), device_of(handle)) {
        (Some(dev), _) => crate::device::mig_uuid_text(dev),
        (None, Ok(dev)) => crate::device::uuid_text(dev),
        (None, Err(e)) => return e,
    };
    if uuid.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    if (length as usize) < text.len() + 1 {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // SAFETY: the caller's buffer holds `length` > text.len() bytes.
    unsafe {
        std::ptr::copy_nonoverlapping(text.as_ptr(), uuid.cast::<u8>(), text.len());
        *uuid.add(text.len()) = 0;
    }
    NVML_SUCCESS
}

/// `nvmlDeviceGetUtilizationRates`.
///
/// # Safety
/// `util` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    handle: *mut c_void,
    util: *mut NvmlUtilization,
) -> NvmlReturn {
    let Ok(s) = sim() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    let dev = (handle as usize).wrapping_sub(1);
    if util.is_null() || dev >= s.total_devices() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    s.advance();
    let Ok(recs) = read_tail(&s.dir, dev as u32, 8192) else {
        return NVML_ERROR_UNKNOWN;
    };
    let now = now_ns();
    let w = window_ns();
    let share = busy(&recs, now.saturating_sub(w), now).device_share();
    // SAFETY: non-null out-pointer from the caller.
    unsafe {
        *util = NvmlUtilization {
            gpu: (share * 100.0).round() as u32,
            memory: 0,
        }
    };
    NVML_SUCCESS
}

/// `NVML_ERROR_ARGUMENT_VERSION_MISMATCH`.
const NVML_ERROR_ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemoryV2 {
    version: u32,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2`: the struct's size and version 2.
pub const NVML_MEMORY_V2: u32 = std::mem::size_of::<NvmlMemoryV2>() as u32 | (2 << 24);

/// The simulated device of an NVML handle.
/// MIG instances' handles: this plus their GPU's index plus one (a GPU's
/// handle is its index plus one).
const MIG_HANDLES: usize = 0x1_0000;

/// The GPU of a MIG instance's handle.
fn mig_of(handle: *mut c_void) -> Option<usize> {
    let s = sim().ok()?;
    let dev = (handle as usize).checked_sub(MIG_HANDLES + 1)?;
    s.mig.contains(&dev).then_some(dev)
}

/// `nvmlDeviceIsMigDeviceHandle`.
///
/// # Safety
/// `is_mig` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceIsMigDeviceHandle(
    handle: *mut c_void,
    is_mig: *mut u32,
) -> NvmlReturn {
    if is_mig.is_null() || (mig_of(handle).is_none() && device_of(handle).is_err()) {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *is_mig = u32::from(mig_of(handle).is_some()) };
    NVML_SUCCESS
}

/// `nvmlDeviceGetDeviceHandleFromMigDeviceHandle`: the GPU a MIG
/// instance is part of.
///
/// # Safety
/// `parent` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetDeviceHandleFromMigDeviceHandle(
    handle: *mut c_void,
    parent: *mut *mut c_void,
) -> NvmlReturn {
    let (Some(dev), false) = (mig_of(handle), parent.is_null()) else {
        return NVML_ERROR_INVALID_ARGUMENT;
    };
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *parent = (dev + 1) as *mut c_void };
    NVML_SUCCESS
}

/// The GPU of a GPU's handle (not a MIG instance's: NVML's device queries
/// on those are left out).
fn device_of(handle: *mut c_void) -> Result<usize, NvmlReturn> {
    let s = sim().map_err(|_| NVML_ERROR_UNINITIALIZED)?;
    let dev = (handle as usize).wrapping_sub(1);
    if dev >= s.total_devices() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(dev)
}

/// `nvmlDeviceGetIndex`.
///
/// # Safety
/// `index` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetIndex(handle: *mut c_void, index: *mut u32) -> NvmlReturn {
    match device_of(handle) {
        Ok(_) if index.is_null() => NVML_ERROR_INVALID_ARGUMENT,
        Ok(dev) => match sim().ok().and_then(|s| s.nvml_index(dev)) {
            Some(i) => {
                // SAFETY: non-null out-pointer from the caller.
                unsafe { *index = i as u32 };
                NVML_SUCCESS
            }
            None => NVML_ERROR_INVALID_ARGUMENT,
        },
        Err(e) => e,
    }
}

/// (total, free) of the device, every process's memory counted.
fn memory(handle: *mut c_void) -> Result<(u64, u64), NvmlReturn> {
    let dev = device_of(handle)?;
    let s = sim().map_err(|_| NVML_ERROR_UNINITIALIZED)?;
    let (free, total) = s.mem_info(dev);
    Ok((total, free))
}

/// `nvmlDeviceGetMemoryInfo`: the whole device, every process counted.
///
/// # Safety
/// `mem` must be writable.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    handle: *mut c_void,
    mem: *mut NvmlMemory,
) -> NvmlReturn {
    match memory(handle) {
        Ok(_) if mem.is_null() => NVML_ERROR_INVALID_ARGUMENT,
        Ok((total, free)) => {
            // SAFETY: non-null out-pointer from the caller.
            unsafe {
                *mem = NvmlMemory {
                    total,
                    free,
                    used: total - free,
                }
            };
            NVML_SUCCESS
        }
        Err(e) => e,
    }
}

/// `nvmlDeviceGetMemoryInfo_v2` (no memory is reserved by the simulated
/// driver itself).
///
/// # Safety
/// `mem` must be writable, its `version` set by the caller.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    handle: *mut c_void,
    mem: *mut NvmlMemoryV2,
) -> NvmlReturn {
    match memory(handle) {
        Ok(_) if mem.is_null() => NVML_ERROR_INVALID_ARGUMENT,
        // SAFETY: non-null; the caller sets the version field.
        Ok(_) if unsafe { (*mem).version } != NVML_MEMORY_V2 => {
            NVML_ERROR_ARGUMENT_VERSION_MISMATCH
        }
        Ok((total, free)) => {
            // SAFETY: non-null out-pointer from the caller.
            unsafe {
                *mem = NvmlMemoryV2 {
                    version: NVML_MEMORY_V2,
                    total,
                    reserved: 0,
                    free,
                    used: total - free,
                }
            };
            NVML_SUCCESS
        }
        Err(e) => e,
    }
}

/// `nvmlProcessInfo_v2_t` (and `_v3`, the same layout); `_v1` is its
/// first two fields (16 bytes).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NvmlProcessInfo {
    pid: u32,
    used_gpu_memory: u64,
    gpu_instance_id: u32,
    compute_instance_id: u32,
}

/// `NVML_VALUE_NOT_AVAILABLE` for an instance id outside MIG.
const NOT_AVAILABLE: u32 = u32::MAX;

/// `nvmlDeviceGetComputeRunningProcesses*`: each process holding device
/// memory and what it holds (its whole footprint: contexts, modules,
/// allocations, pools), as NVML reports it. With too small a buffer (or
/// none), the count needed and `NVML_ERROR_INSUFFICIENT_SIZE`.
///
/// # Safety
/// `count` must be writable and `infos` hold `*count` entries of
/// `entry_size` bytes.
unsafe fn running_processes(
    handle: *mut c_void,
    count: *mut u32,
    infos: *mut u8,
    entry_size: usize,
) -> NvmlReturn {
    let dev = match device_of(handle) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let Ok(s) = sim() else {
        return NVML_ERROR_UNINITIALIZED;
    };
    if count.is_null() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // Each enumeration (milliseconds on a real NVML) is counted, one byte
    // each in `nvml-enumerations`, for tests of who pays for them.
    if let Ok(mut f) = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(s.dir.join("nvml-enumerations"))
    {
        let _ = std::io::Write::write_all(&mut f, b".");
    }
    let procs = s.processes(dev);
    // SAFETY: non-null in/out count from the caller.
    let room = unsafe { *count } as usize;
    // SAFETY: as above.
    unsafe { *count = procs.len() as u32 };
    if procs.is_empty() {
        return NVML_SUCCESS;
    }
    if infos.is_null() || room < procs.len() {
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    // NVML_VALUE_NOT_AVAILABLE where NVML cannot read a process's memory
    // (Windows' WDDM always; some containers, vGPU and MIG set-ups):
    // FAKECUDA_NVML_PROCESS_MEMORY=unavailable.
    let unavailable =
        std::env::var("FAKECUDA_NVML_PROCESS_MEMORY").is_ok_and(|v| v == "unavailable");
    for (i, (pid, bytes)) in procs.into_iter().enumerate() {
        let info = NvmlProcessInfo {
            pid,
            used_gpu_memory: if unavailable { u64::MAX } else { bytes },
            gpu_instance_id: NOT_AVAILABLE,
            compute_instance_id: NOT_AVAILABLE,
        };
        // SAFETY: entry i of the caller's array of `room` entries of
        // `entry_size` (16 or 24) bytes; the first `entry_size` bytes of
        // the struct are the fields that version has.
        unsafe {
            std::ptr::copy_nonoverlapping(
                (&info as *const NvmlProcessInfo).cast::<u8>(),
                infos.add(i * entry_size),
                entry_size,
            )
        };
    }
    NVML_SUCCESS
}

/// `nvmlDeviceGetComputeRunningProcesses` (`nvmlProcessInfo_v1_t`).
///
/// # Safety
/// As [`running_processes`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses(
    handle: *mut c_void,
    count: *mut u32,
    infos: *mut c_void,
) -> NvmlReturn {
    // SAFETY: the caller's contract, v1 entries of 16 bytes.
    unsafe { running_processes(handle, count, infos.cast(), 16) }
}

/// `nvmlDeviceGetComputeRunningProcesses_v2`.
///
/// # Safety
/// As [`running_processes`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v2(
    handle: *mut c_void,
    count: *mut u32,
    infos: *mut c_void,
) -> NvmlReturn {
    // SAFETY: the caller's contract, v2 entries of 24 bytes.
    unsafe { running_processes(handle, count, infos.cast(), 24) }
}

/// `nvmlDeviceGetComputeRunningProcesses_v3`.
///
/// # Safety
/// As [`running_processes`].
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetComputeRunningProcesses_v3(
    handle: *mut c_void,
    count: *mut u32,
    infos: *mut c_void,
) -> NvmlReturn {
    // SAFETY: the caller's contract, v3 entries of 24 bytes.
    unsafe { running_processes(handle, count, infos.cast(), 24) }
}

/// `NVML_ERROR_FUNCTION_NOT_FOUND`: what a driver older than R615 answers
/// for the per-cgroup memory limits.
const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;

/// `nvmlMemoryLimits_v1_t`: a cgroup's (`name_space`, its cgroup v2
/// path) limits of a device's memory.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemoryLimits {
    name_space: *const std::ffi::c_char,
    soft_limit: u64,
    hard_limit: u64,
}

/// `nvmlMemoryLimitsInfo_v1_t`: `name_space` in; the limits and what the
/// cgroup's processes use of the device now out.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemoryLimitsInfo {
    name_space: *const std::ffi::c_char,
    soft_limit: u64,
    hard_limit: u64,
    current_used: u64,
}

/// A cgroup v2 path from the caller: absolute, UTF-8.
///
/// # Safety
/// `p` must be null or a NUL-terminated string.
unsafe fn name_space(p: *const std::ffi::c_char) -> Result<String, NvmlReturn> {
    if p.is_null() {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: non-null NUL-terminated string (the caller's promise).
    let s = unsafe { std::ffi::CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| NVML_ERROR_INVALID_ARGUMENT)?;
    if !s.starts_with('/') {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    Ok(s.to_string())
}

/// What both limit calls check first: the device, a driver that has the
/// calls, a struct (`is_null` says whether it is missing), and its cgroup
/// (read by `name`, called only for a struct that is there).
///
/// # Safety
/// `name` must return null or a NUL-terminated string.
unsafe fn limits_call(
    handle: *mut c_void,
    is_null: bool,
    name: impl FnOnce() -> *const std::ffi::c_char,
) -> Result<(&'static crate::device::Sim, usize, String), NvmlReturn> {
    let dev = device_of(handle)?;
    let s = sim().map_err(|_| NVML_ERROR_UNINITIALIZED)?;
    if !s.has_memory_limits() {
        return Err(NVML_ERROR_FUNCTION_NOT_FOUND);
    }
    if is_null {
        return Err(NVML_ERROR_INVALID_ARGUMENT);
    }
    // SAFETY: the caller's promise on `name`.
    let cgroup = unsafe { name_space(name()) }?;
    Ok((s, dev, cgroup))
}

/// `nvmlDeviceSetMemoryLimits_v1` (R615): sets the soft and hard limit of
/// the device's memory for the processes of a cgroup (both 0: removes
/// them). A soft limit above the hard one is refused. Drivers before
/// R615 (`FAKECUDA_DRIVER_VERSION` < 13040) answer
/// `NVML_ERROR_FUNCTION_NOT_FOUND`.
///
/// # Safety
/// `limits` must be null or point to a readable struct whose `name_space`
/// is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceSetMemoryLimits_v1(
    handle: *mut c_void,
    limits: *const NvmlMemoryLimits,
) -> NvmlReturn {
    // SAFETY: the caller's promise on `limits`.
    let (s, dev, cgroup) =
        match unsafe { limits_call(handle, limits.is_null(), || (*limits).name_space) } {
            Ok(x) => x,
            Err(e) => return e,
        };
    // SAFETY: non-null (checked), readable (the caller's promise).
    let l = unsafe { &*limits };
    if l.hard_limit != 0 && l.soft_limit > l.hard_limit {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    s.set_memory_limit(dev, &cgroup, l.soft_limit, l.hard_limit);
    NVML_SUCCESS
}

/// `nvmlDeviceGetMemoryLimits_v1` (R615): the limits set for the cgroup
/// `info.name_space` (0: none) and what its processes (and those of the
/// cgroups below it) hold on the device now.
///
/// # Safety
/// `info` must be null or point to a writable struct whose `name_space`
/// is null or a NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryLimits_v1(
    handle: *mut c_void,
    info: *mut NvmlMemoryLimitsInfo,
) -> NvmlReturn {
    // SAFETY: the caller's promise on `info`.
    let (s, dev, cgroup) =
        match unsafe { limits_call(handle, info.is_null(), || (*info).name_space) } {
            Ok(x) => x,
            Err(e) => return e,
        };
    // SAFETY: non-null (checked), writable (the caller's promise).
    let out = unsafe { &mut *info };
    let set = s
        .memory_limits(dev)
        .into_iter()
        .find(|l| l.cgroup == cgroup);
    out.soft_limit = set.as_ref().map_or(0, |l| l.soft);
    out.hard_limit = set.as_ref().map_or(0, |l| l.hard);
    out.current_used = s.cgroup_used(dev, &cgroup);
    NVML_SUCCESS
}
