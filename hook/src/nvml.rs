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
use crate::real;
use std::ffi::{CStr, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicUsize;

type NvmlReturn = u32;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`.
const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;

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

/// The real NVML function `name` (cached in `slot`) as an `F`.
///
/// # Safety
/// `F` must be the C signature of `name`.
unsafe fn real<F: Copy>(slot: &AtomicUsize, name: &CStr) -> Option<F> {
    let addr = real::nvml_fn(slot, name);
    // SAFETY: a non-zero address is NVML's `name`, of signature F (the
    // caller's promise); F is a function pointer of usize's size.
    (addr != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&addr) })
}

/// The physical device of an NVML handle: the scheduler's index of the
/// CUDA device with the same UUID (NVML's own index is the container's
/// in a container), else NVML's index.
fn physical_of(device: *mut c_void) -> Option<u32> {
    uuid_of(device)
        .and_then(|text| crate::state::get().physical_of_uuid(&text))
        .or_else(|| nvml_index(device))
}

/// NVML's own index of a handle (the machine's, but the container's in a
/// container). `State::physical` falls back to it while it is being
/// found, so it must not go through `physical_of`, which would wait for
/// that finding.
fn nvml_index(device: *mut c_void) -> Option<u32> {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    type F = unsafe extern "C" fn(*mut c_void, *mut u32) -> NvmlReturn;
    // SAFETY: nvmlDeviceGetIndex's C signature.
    let f = unsafe { real::<F>(&SLOT, c"nvmlDeviceGetIndex") }?;
    let mut index = 0;
    // SAFETY: the program's handle and an out-pointer to a local.
    (unsafe { f(device, &mut index) } == 0).then_some(index)
}

/// The UUID text of an NVML handle.
fn uuid_of(device: *mut c_void) -> Option<String> {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    type F = unsafe extern "C" fn(*mut c_void, *mut std::ffi::c_char, u32) -> NvmlReturn;
    // SAFETY: nvmlDeviceGetUUID's C signature.
    let f = unsafe { real::<F>(&SLOT, c"nvmlDeviceGetUUID") }?;
    let mut buf = [0 as std::ffi::c_char; 96];
    // SAFETY: the program's handle and a local buffer of the length given.
    if unsafe { f(device, buf.as_mut_ptr(), buf.len() as u32) } != 0 {
        return None;
    }
    // SAFETY: NVML succeeded, so it wrote a NUL-terminated string into
    // `buf` (NVML_DEVICE_UUID_V2_BUFFER_SIZE, 96 bytes, the most it needs).
    let text = unsafe { CStr::from_ptr(buf.as_ptr()) };
    Some(text.to_string_lossy().into_owned())
}

/// A GPU's UUID as NVML and `nvidia-smi` write it: `GPU-` and the 16
/// bytes `cuDeviceGetUuid` gives, in hex groups of 8-4-4-4-12.
pub fn uuid_text(uuid: &[u8; 16]) -> String {
    let h: String = uuid.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "GPU-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}

/// NVML's index of the GPU whose CUDA UUID is `uuid`: the machine's own
/// numbering, which the scheduler and `nvidia-smi` use, whatever the
/// process's device cgroup and `CUDA_VISIBLE_DEVICES` made of its CUDA
/// ordinals. `None` without NVML or where it does not know the GPU.
pub fn index_of_uuid(uuid: &[u8; 16]) -> Option<u32> {
    static INIT: AtomicUsize = AtomicUsize::new(0);
    static BY_UUID: AtomicUsize = AtomicUsize::new(0);
    type Init = unsafe extern "C" fn() -> NvmlReturn;
    type ByUuid = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void) -> NvmlReturn;
    static STARTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let started = *STARTED.get_or_init(|| {
        // SAFETY: nvmlInit_v2's C signature.
        let init = unsafe { real::<Init>(&INIT, c"nvmlInit_v2") };
        // SAFETY: no arguments; NVML counts its initialisations, so the
        // program's own init and shutdown are unaffected.
        init.is_some_and(|f| unsafe { f() } == 0)
    });
    if !started {
        return None;
    }
    let text = std::ffi::CString::new(uuid_text(uuid)).ok()?;
    // SAFETY: nvmlDeviceGetHandleByUUID's C signature.
    let by_uuid = unsafe { real::<ByUuid>(&BY_UUID, c"nvmlDeviceGetHandleByUUID") }?;
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: a NUL-terminated string and an out-pointer to a local.
    if unsafe { by_uuid(text.as_ptr(), &mut handle) } != 0 {
        return None;
    }
    nvml_index(handle)
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
