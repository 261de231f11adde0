//! The NVML calls `gem-holder` makes, answered from the simulator:
//! device count, handles, and GPU utilisation — the share of the last
//! `FAKECUDA_NVML_WINDOW_MS` (default 200 ms) during which the device ran a
//! kernel, from the busy log, as a whole percentage like NVML's.

use crate::device::sim;
use fakecuda_log::{busy, now_ns, read_tail};
use std::ffi::c_void;

type NvmlReturn = u32;
const NVML_SUCCESS: NvmlReturn = 0;
const NVML_ERROR_UNINITIALIZED: NvmlReturn = 1;
const NVML_ERROR_INVALID_ARGUMENT: NvmlReturn = 2;
const NVML_ERROR_UNKNOWN: NvmlReturn = 999;

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlUtilization {
    gpu: u32,
    memory: u32,
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
    if sim().is_ok() {
        NVML_SUCCESS
    } else {
        NVML_ERROR_UNINITIALIZED
    }
}

/// `nvmlShutdown`.
#[unsafe(no_mangle)]
pub extern "C" fn nvmlShutdown() -> NvmlReturn {
    NVML_SUCCESS
}

/// `nvmlDeviceGetCount_v2`: every simulated device (NVML ignores
/// `CUDA_VISIBLE_DEVICES`).
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
    unsafe { *count = s.total_devices() as u32 };
    NVML_SUCCESS
}

/// `nvmlDeviceGetHandleByIndex_v2`: the handle is the index plus one.
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
    if handle.is_null() || index as usize >= s.total_devices() {
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *handle = (index as usize + 1) as *mut c_void };
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
