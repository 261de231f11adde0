//! The device memory the driver keeps for the process itself, charged
//! to the group like its allocations: each context's own memory (per-
//! context state, local memory for the stack limit, the printf FIFO, the
//! `malloc` heap that `cuCtxSetLimit` can raise) and loaded modules and
//! libraries. None of it is asked for by size, so it is measured:
//!
//! - with NVML's per-process memory (`nvmlDeviceGetComputeRunningProcesses`,
//!   which counts everything the driver holds for the process), the group
//!   is charged the process's footprint less what its allocations
//!   already reserve, after every call that makes or unmakes such memory;
//! - without it (no NVML, or an NVML that does not see the process's
//!   pid), by how much the device's used memory changed across the call
//!   (`cuMemGetInfo` where the device's context is current): exact for a
//!   process alone on the device, approximate beside others.
//!
//! Before such a call the hook reserves what it expects it to take (a
//! context: what the process's first one took; a larger limit: what the
//! driver needs for it; a module: its image), so that a group at its
//! limit is refused (`CUDA_ERROR_OUT_OF_MEMORY`) before the driver takes
//! the memory. Where the driver took more than the group may have, the
//! call is undone (the context destroyed, the limit set back, the module
//! unloaded) and fails with `CUDA_ERROR_OUT_OF_MEMORY`.

use crate::cuda::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use crate::memory;
use crate::state::{self, lock};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// What the process's first context took (bytes; 0: none made yet): the
/// estimate for the next.
static CONTEXT_COST: AtomicU64 = AtomicU64::new(0);

/// Whether NVML has listed this process (by its pid) once: from then on
/// a process NVML does not list holds nothing. (Until then NVML may not
/// see its pid at all: a container's PID namespace.)
static NVML_SEES_US: AtomicBool = AtomicBool::new(false);

/// This process's whole device memory on ordinal `dev`, as NVML says.
fn footprint(dev: u32) -> Option<u64> {
    let st = state::get();
    match crate::nvml_lib::process_memory(st.uuid_of(dev)?, std::process::id())? {
        Some(bytes) => {
            NVML_SEES_US.store(true, Ordering::Relaxed);
            Some(bytes)
        }
        None => NVML_SEES_US.load(Ordering::Relaxed).then_some(0),
    }
}

/// The device memory in use on ordinal `dev` by every process, where it
/// can be read without making a context: the current context's device.
fn device_used(dev: u32) -> Option<u64> {
    if memory::current_ordinal() != Some(dev) {
        return None;
    }
    let (mut free, mut total) = (0usize, 0usize);
    // SAFETY: out-pointers to locals.
    let r = unsafe { crate::driver::mem_get_info(&mut free, &mut total) };
    (r == CUDA_SUCCESS).then(|| total.saturating_sub(free) as u64)
}

/// What the group is charged for the driver's own memory on physical
/// `device`.
fn held_on(device: u32) -> u64 {
    lock(&state::get().driver_held)
        .get(&device)
        .copied()
        .unwrap_or(0)
}

/// Brings the group's charge for the driver's own memory on physical
/// `device` to `want` bytes. False, the charge unchanged, where the
/// scheduler refuses the growth.
fn charge(device: u32, want: u64) -> bool {
    let held = held_on(device);
    if want > held {
        if memory::reserve_physical(device, want - held).is_err() {
            return false;
        }
    } else {
        memory::unreserve(device, held - want);
    }
    lock(&state::get().driver_held).insert(device, want);
    true
}

/// What the driver keeps for the process on physical `device`, given its
/// `footprint`: the footprint less what its allocations reserve.
fn own_part(device: u32, footprint: u64) -> u64 {
    let st = state::get();
    let reserved = lock(&st.reserved).get(&device).copied().unwrap_or(0);
    footprint.saturating_sub(reserved.saturating_sub(held_on(device)))
}

/// Runs `call`, which makes or unmakes memory the driver keeps for the
/// process on ordinal `dev` (`None`: it fails without a context anyway),
/// with `estimate` bytes reserved first; then charges what the driver
/// really took. `undo` takes back what a successful `call` made, where
/// the group may not have it.
pub fn around(
    dev: Option<u32>,
    estimate: u64,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(),
) -> CUresult {
    let Some(dev) = dev else { return call() };
    let st = state::get();
    if st.refused.load(Ordering::Acquire) != 0 {
        return call();
    }
    let device = st.physical(dev);
    let _one = lock(&st.measuring);
    let held = held_on(device);
    if estimate > 0 && !charge(device, held.saturating_add(estimate)) {
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    let before = footprint(dev).is_none().then(|| device_used(dev)).flatten();
    let r = call();
    let want = match footprint(dev) {
        Some(f) => Some(own_part(device, f)),
        None => match (before, device_used(dev)) {
            (Some(b), Some(a)) => {
                Some((i128::from(held) + i128::from(a) - i128::from(b)).max(0) as u64)
            }
            _ => None,
        },
    };
    let Some(want) = want else {
        // Not measurable: the estimate stays charged.
        return r;
    };
    if charge(device, want) {
        return r;
    }
    let wanted = want.saturating_sub(held);
    if r == CUDA_SUCCESS {
        undo();
    }
    let after = footprint(dev).map_or(held, |f| own_part(device, f));
    charge(device, after.min(held));
    crate::log::error!(
        "the driver needs {wanted} bytes of GPU {device} for the process's own use (a context, a limit or a module), beyond the group's MemoryLimit; the program gets CUDA_ERROR_OUT_OF_MEMORY"
    );
    CUDA_ERROR_OUT_OF_MEMORY
}

/// A context is made on ordinal `dev` by `call`; `made` reads it (to
/// destroy it again where the group may not have its memory); `primary`:
/// a primary context, which takes memory only at its first retain.
pub fn context(
    dev: i32,
    primary: bool,
    call: impl FnOnce() -> CUresult,
    made: impl Fn() -> *mut c_void,
) -> CUresult {
    let ordinal = u32::try_from(dev).ok();
    let fresh = !(primary && crate::driver::primary_active(dev));
    let estimate = if fresh {
        CONTEXT_COST.load(Ordering::Relaxed)
    } else {
        0
    };
    let before = ordinal.map(|d| held_on(state::get().physical(d)));
    let r = around(ordinal, estimate, call, || {
        let ctx = made();
        if primary {
            let _ = crate::driver::primary_release(dev);
        } else if !ctx.is_null() {
            let _ = crate::driver::ctx_destroy(ctx);
        }
    });
    if r == CUDA_SUCCESS
        && fresh
        && CONTEXT_COST.load(Ordering::Relaxed) == 0
        && let (Some(d), Some(before)) = (ordinal, before)
    {
        let now = held_on(state::get().physical(d));
        CONTEXT_COST.store(now.saturating_sub(before), Ordering::Relaxed);
    }
    r
}

/// A context goes (destroyed, or a primary one released or reset) by
/// `call`: what the driver kept for it is given back.
pub fn context_gone(dev: Option<u32>, call: impl FnOnce() -> CUresult) -> CUresult {
    around(dev, 0, call, || {})
}

/// The ordinal of context `ctx`, as the process made it.
pub fn ordinal_of(ctx: *mut c_void) -> Option<u32> {
    let st = state::current()?;
    lock(&st.contexts)
        .iter()
        .find(|&&(c, _)| c == ctx as usize)
        .map(|&(_, d)| d)
}

/// `CUlimit`s that take device memory.
const LIMIT_STACK_SIZE: i32 = 0;
const LIMIT_PRINTF_FIFO_SIZE: i32 = 1;
const LIMIT_MALLOC_HEAP_SIZE: i32 = 2;
/// `CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT`,
/// `CU_DEVICE_ATTRIBUTE_MAX_THREADS_PER_MULTIPROCESSOR`.
const ATTR_SMS: i32 = 16;
const ATTR_THREADS_PER_SM: i32 = 39;

/// `cuCtxSetLimit(limit, value)` by `call`: the device memory a larger
/// stack (per resident thread), printf FIFO or heap takes is reserved
/// first; refused, the limit is set back.
pub fn set_limit(limit: i32, value: usize, call: impl FnOnce() -> CUresult) -> CUresult {
    let dev = memory::current_ordinal();
    let old = crate::driver::ctx_get_limit(limit);
    let per_unit = match limit {
        LIMIT_STACK_SIZE => dev.map_or(0, |d| {
            let sms = crate::driver::device_attribute(ATTR_SMS, d).unwrap_or(0);
            let threads = crate::driver::device_attribute(ATTR_THREADS_PER_SM, d).unwrap_or(2048);
            (sms.max(0) as u64) * (threads.max(0) as u64)
        }),
        LIMIT_PRINTF_FIFO_SIZE | LIMIT_MALLOC_HEAP_SIZE => 1,
        _ => 0,
    };
    let estimate = (value as u64)
        .saturating_sub(old.unwrap_or(value) as u64)
        .saturating_mul(per_unit);
    around(dev, estimate, call, || {
        if let Some(old) = old {
            let _ = crate::driver::ctx_set_limit(limit, old);
        }
    })
}

/// The device memory a module image takes, as far as its header says: an
/// ELF's size, a fatbinary's; 0 for text (PTX, compiled by the driver to
/// a size known only after).
pub fn image_bytes(image: *const c_void) -> u64 {
    if image.is_null() {
        return 0;
    }
    let b = image as *const u8;
    // SAFETY: the program's image, which starts with a header when it
    // starts with one of these magics (only then read past 4 bytes).
    unsafe {
        let word = (b as *const u32).read_unaligned();
        if word == 0x464c_457f {
            // ELF64: e_shoff at 0x28, e_shentsize and e_shnum at 0x3a, 0x3c.
            let shoff = (b.add(0x28) as *const u64).read_unaligned();
            let entsize = u64::from((b.add(0x3a) as *const u16).read_unaligned());
            let num = u64::from((b.add(0x3c) as *const u16).read_unaligned());
            return shoff.saturating_add(entsize * num);
        }
        if word == 0xba55_ed50 {
            let header = u64::from((b.add(6) as *const u16).read_unaligned());
            let fat = (b.add(8) as *const u64).read_unaligned();
            return header.saturating_add(fat);
        }
    }
    0
}

/// A module is loaded by `call` (from `image`, where the program gave
/// one) into `*out`: its memory is charged; refused, it is unloaded.
pub fn module_loaded(
    out: *mut *mut c_void,
    image: *const c_void,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let dev = memory::current_ordinal();
    let read = || {
        if out.is_null() {
            std::ptr::null_mut()
        } else {
            // SAFETY: the program's out-pointer, read after the driver
            // filled it.
            unsafe { *out }
        }
    };
    let r = around(dev, image_bytes(image), call, || {
        let m = read();
        if !m.is_null() {
            let _ = crate::driver::module_unload(m);
        }
    });
    if r == CUDA_SUCCESS
        && let Some(d) = dev
    {
        lock(&state::get().modules).insert(read() as usize, d);
    }
    r
}

/// A module is unloaded by `call`: its memory is given back.
pub fn module_unloaded(module: *mut c_void, call: impl FnOnce() -> CUresult) -> CUresult {
    let dev = state::current()
        .and_then(|st| lock(&st.modules).remove(&(module as usize)))
        .or_else(memory::current_ordinal);
    around(dev, 0, call, || {})
}

/// A library is loaded or unloaded by `call` (a library is loaded into
/// the current context, and into others as they use it): charged on the
/// current device.
pub fn library(call: impl FnOnce() -> CUresult) -> CUresult {
    around(memory::current_ordinal(), 0, call, || {})
}
