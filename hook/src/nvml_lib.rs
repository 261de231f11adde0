//! The NVML functions the hook calls for itself (never through its own
//! exports), resolved once each from `libnvidia-ml.so.1`: a handle's
//! index and UUID, and the index of the GPU with a given CUDA UUID. Below
//! `gpus` and `nvml` (the exports), as `driver` is for CUDA.

use crate::real;
use std::ffi::{CStr, c_void};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// `nvmlReturn_t`.
pub type NvmlReturn = u32;
/// `NVML_ERROR_FUNCTION_NOT_FOUND`.
pub const NVML_ERROR_FUNCTION_NOT_FOUND: NvmlReturn = 13;

/// The real NVML function `name` (cached in `slot`) as an `F`.
///
/// # Safety
/// `F` must be the C signature of `name`.
pub unsafe fn real<F: Copy>(slot: &AtomicUsize, name: &CStr) -> Option<F> {
    let addr = real::nvml_fn(slot, name);
    // SAFETY: a non-zero address is NVML's `name`, of signature F (the
    // caller's promise); F is a function pointer of usize's size.
    (addr != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&addr) })
}

/// NVML's own index of a handle (the machine's, but the container's in a
/// container). `State::physical` falls back to it while it is being
/// found, so it must not go through `physical_of`, which would wait for
/// that finding.
pub fn nvml_index(device: *mut c_void) -> Option<u32> {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    type F = unsafe extern "C" fn(*mut c_void, *mut u32) -> NvmlReturn;
    // SAFETY: nvmlDeviceGetIndex's C signature.
    let f = unsafe { real::<F>(&SLOT, c"nvmlDeviceGetIndex") }?;
    let mut index = 0;
    // SAFETY: the program's handle and an out-pointer to a local.
    (unsafe { f(device, &mut index) } == 0).then_some(index)
}

/// The UUID text of an NVML handle.
pub fn uuid_of(device: *mut c_void) -> Option<String> {
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

/// Whether NVML is there and initialised for the hook's own use (once).
pub fn available() -> bool {
    static INIT: AtomicUsize = AtomicUsize::new(0);
    type Init = unsafe extern "C" fn() -> NvmlReturn;
    static STARTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *STARTED.get_or_init(|| {
        // SAFETY: nvmlInit_v2's C signature.
        let init = unsafe { real::<Init>(&INIT, c"nvmlInit_v2") };
        // SAFETY: no arguments; NVML counts its initialisations, so the
        // program's own init and shutdown are unaffected.
        init.is_some_and(|f| unsafe { f() } == 0)
    })
}

/// NVML's handle of the GPU whose UUID text is `uuid`.
fn handle_of(uuid: &str) -> Option<*mut c_void> {
    static BY_UUID: AtomicUsize = AtomicUsize::new(0);
    type ByUuid = unsafe extern "C" fn(*const std::ffi::c_char, *mut *mut c_void) -> NvmlReturn;
    if !available() {
        return None;
    }
    let text = std::ffi::CString::new(uuid).ok()?;
    // SAFETY: nvmlDeviceGetHandleByUUID's C signature.
    let by_uuid = unsafe { real::<ByUuid>(&BY_UUID, c"nvmlDeviceGetHandleByUUID") }?;
    let mut handle: *mut c_void = std::ptr::null_mut();
    // SAFETY: a NUL-terminated string and an out-pointer to a local.
    (unsafe { by_uuid(text.as_ptr(), &mut handle) } == 0).then_some(handle)
}

/// NVML's index of the GPU whose CUDA UUID is `uuid`: the machine's own
/// numbering, which the scheduler and `nvidia-smi` use, whatever the
/// process's device cgroup and `CUDA_VISIBLE_DEVICES` made of its CUDA
/// ordinals. `None` without NVML or where it does not know the GPU.
pub fn index_of_uuid(uuid: &[u8; 16]) -> Option<u32> {
    nvml_index(handle_of(&gpu_of_uuid(uuid)?)?)
}

/// The UUID text of the GPU a CUDA device whose UUID is `uuid` runs on:
/// its own (`GPU-…`), or, for a MIG instance (`CUDA_VISIBLE_DEVICES=MIG-…`:
/// CUDA then gives the instance's UUID), the GPU it is part of. `None`
/// without NVML or where NVML knows neither.
pub fn gpu_of_uuid(uuid: &[u8; 16]) -> Option<String> {
    static PARENT: AtomicUsize = AtomicUsize::new(0);
    type Parent = unsafe extern "C" fn(*mut c_void, *mut *mut c_void) -> NvmlReturn;
    let gpu = uuid_text(uuid);
    if handle_of(&gpu).is_some() {
        return Some(gpu);
    }
    let instance = handle_of(&format!("MIG-{}", &gpu["GPU-".len()..]))?;
    // SAFETY: nvmlDeviceGetDeviceHandleFromMigDeviceHandle's C signature.
    let parent_of =
        unsafe { real::<Parent>(&PARENT, c"nvmlDeviceGetDeviceHandleFromMigDeviceHandle") }?;
    let mut parent: *mut c_void = std::ptr::null_mut();
    // SAFETY: a MIG handle NVML gave and an out-pointer to a local.
    if unsafe { parent_of(instance, &mut parent) } != 0 {
        return None;
    }
    uuid_of(parent)
}

/// The device memory NVML says process `pid` holds on the GPU whose UUID
/// text is `uuid` (`nvmlDeviceGetComputeRunningProcesses`, the newest
/// version NVML has): its whole footprint, contexts and modules
/// included; `Some(None)` where NVML does not list `pid` (a process
/// holding nothing, or one in a PID namespace NVML does not see); `None`
/// without NVML.
/// `None` too where NVML lists `pid` without its memory
/// (`NVML_VALUE_NOT_AVAILABLE`).
pub fn process_memory(uuid: &str, pid: u32) -> Option<Option<u64>> {
    /// `NVML_VALUE_NOT_AVAILABLE` for an unsigned long long.
    const VALUE_NOT_AVAILABLE: u64 = u64::MAX;
    static V3: AtomicUsize = AtomicUsize::new(0);
    static V2: AtomicUsize = AtomicUsize::new(0);
    static V1: AtomicUsize = AtomicUsize::new(0);
    type F = unsafe extern "C" fn(*mut c_void, *mut u32, *mut u8) -> NvmlReturn;
    /// `NVML_ERROR_INSUFFICIENT_SIZE`.
    const INSUFFICIENT_SIZE: NvmlReturn = 7;
    let handle = handle_of(uuid)?;
    // nvmlProcessInfo_t (v2, v3) is 24 bytes: pid u32, usedGpuMemory
    // u64, two u32 instance ids; v1 is the first two (16 bytes).
    // SAFETY: the C signature of each version, with its entry size.
    let (f, size) = unsafe {
        real::<F>(&V3, c"nvmlDeviceGetComputeRunningProcesses_v3")
            .map(|f| (f, 24))
            .or_else(|| real::<F>(&V2, c"nvmlDeviceGetComputeRunningProcesses_v2").map(|f| (f, 24)))
            .or_else(|| real::<F>(&V1, c"nvmlDeviceGetComputeRunningProcesses").map(|f| (f, 16)))
    }?;
    let mut room = 64u32;
    for _ in 0..4 {
        let mut buf = vec![0u8; room as usize * size];
        let mut count = room;
        // SAFETY: `buf` holds `count` entries of `size` bytes.
        let r = unsafe { f(handle, &mut count, buf.as_mut_ptr()) };
        if r == INSUFFICIENT_SIZE {
            room = count.max(room) + 16;
            continue;
        }
        if r != 0 {
            return None;
        }
        let used = buf
            .chunks_exact(size)
            .take(count as usize)
            .find(|e| e[0..4] == pid.to_ne_bytes())
            .map(|e| {
                let mut b = [0u8; 8];
                b.copy_from_slice(&e[8..16]);
                u64::from_ne_bytes(b)
            });
        if used == Some(VALUE_NOT_AVAILABLE) {
            static TOLD: AtomicBool = AtomicBool::new(false);
            if !TOLD.swap(true, Ordering::Relaxed) {
                crate::log::error!(
                    "NVML lists this process but not its GPU memory (NVML_VALUE_NOT_AVAILABLE, as in some containers, vGPU and MIG set-ups): \
                     the memory the driver keeps for it (contexts, modules) is measured from the device's used memory, or estimated"
                );
            }
            return None;
        }
        return Some(used);
    }
    None
}
