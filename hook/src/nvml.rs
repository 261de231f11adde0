//! NVML's memory queries in a job show the group's view, as `cuMemGetInfo`
//! does: `nvidia-smi`, `pynvml`, vLLM's memory profiling and monitoring
//! code read `nvmlDeviceGetMemoryInfo[_v2]`. Exported (for programs
//! linked against `libnvidia-ml.so.1`) and answered by our `dlsym` (for
//! those that load it at run time); the real functions come from
//! `libnvidia-ml.so.1`.
//!
//! NVML numbers devices in PCI bus order and ignores
//! `CUDA_VISIBLE_DEVICES`; its index is taken as the physical device the
//! scheduler knows (as CUDA's is with `CUDA_DEVICE_ORDER=PCI_BUS_ID`).

use crate::memory;
use crate::nvml_lib::{NVML_ERROR_FUNCTION_NOT_FOUND, NvmlReturn, nvml_index, real, uuid_of};
use std::ffi::{CStr, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicUsize;

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

/// The physical device of an NVML handle: the scheduler's index of the
/// CUDA device with the same UUID (NVML's own index is the container's
/// in a container), else NVML's index.
fn physical_of(device: *mut c_void) -> Option<u32> {
    uuid_of(device)
        .and_then(|text| crate::state::get().physical_of_uuid(&text))
        .or_else(|| nvml_index(device))
}

/// The group's view of (free, total) on the NVML `device`, if the process
/// belongs to a group the scheduler answers for.
fn group_view(device: *mut c_void, free: u64, total: u64) -> Option<(u64, u64)> {
    let physical = physical_of(device)?;
    let (used, limit, reclaimable) = memory::view_physical(physical)?;
    Some(memory::group_view(free, total, used, limit, reclaimable))
}

/// Calls the real `name` (signature `F`, filling an `M`) and adjusts
/// what it filled to the group's view with `adjust(m, free, total)`.
///
/// # Safety
/// `F` is `name`'s C signature, `M` the struct it fills; `device` and
/// `mem` are the program's arguments.
unsafe fn in_group_view<M>(
    slot: &AtomicUsize,
    name: &CStr,
    device: *mut c_void,
    mem: *mut M,
    read: impl Fn(&M) -> (u64, u64),
    adjust: impl Fn(&mut M, u64, u64),
) -> NvmlReturn {
    type F<M> = unsafe extern "C" fn(*mut c_void, *mut M) -> NvmlReturn;
    // SAFETY: the caller's promise about `name`'s signature.
    let Some(f) = (unsafe { real::<F<M>>(slot, name) }) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: the program's arguments, passed on unchanged.
    let r = unsafe { f(device, mem) };
    if r != 0 || mem.is_null() {
        return r;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: filled by the real call just now.
        let m = unsafe { &mut *mem };
        let (free, total) = read(m);
        if let Some((free, total)) = group_view(device, free, total) {
            adjust(m, free, total);
        }
    }));
    r
}

/// `nvmlDeviceGetMemoryInfo`, in the group's view.
///
/// # Safety
/// As NVML's: a device handle and a writable `nvmlMemory_t`.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(non_snake_case)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: *mut c_void,
    mem: *mut NvmlMemory,
) -> NvmlReturn {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: nvmlDeviceGetMemoryInfo fills an nvmlMemory_t.
    unsafe {
        in_group_view(
            &SLOT,
            c"nvmlDeviceGetMemoryInfo",
            device,
            mem,
            |m| (m.free, m.total),
            |m, free, total| {
                (m.free, m.total) = (free, total);
                m.used = total - free;
            },
        )
    }
}

/// `nvmlDeviceGetMemoryInfo_v2`, in the group's view (the driver's own
/// reserved memory is left as NVML says).
///
/// # Safety
/// As NVML's: a device handle and a writable `nvmlMemory_v2_t` with its
/// version set.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(non_snake_case)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    mem: *mut NvmlMemoryV2,
) -> NvmlReturn {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: nvmlDeviceGetMemoryInfo_v2 fills an nvmlMemory_v2_t.
    unsafe {
        in_group_view(
            &SLOT,
            c"nvmlDeviceGetMemoryInfo_v2",
            device,
            mem,
            |m| (m.free, m.total),
            |m, free, total| {
                (m.free, m.total) = (free, total);
                m.used = total.saturating_sub(free).saturating_sub(m.reserved);
            },
        )
    }
}

/// Our function for an NVML name, for our `dlsym`.
pub fn lookup(name: &[u8]) -> Option<*mut c_void> {
    match name {
        b"nvmlDeviceGetMemoryInfo" => Some(nvmlDeviceGetMemoryInfo as *const () as *mut c_void),
        b"nvmlDeviceGetMemoryInfo_v2" => {
            Some(nvmlDeviceGetMemoryInfo_v2 as *const () as *mut c_void)
        }
        _ => None,
    }
}
