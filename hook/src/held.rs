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
//! context: the most a context took on the GPU, as processes told the
//! scheduler; a larger limit: what the
//! driver needs for it; a module: its image), so that a group at its
//! limit is refused (`CUDA_ERROR_OUT_OF_MEMORY`) before the driver takes
//! the memory. Where the driver took more than the group may have, the
//! call is undone (the context destroyed, the limit set back, the module
//! unloaded) and fails with `CUDA_ERROR_OUT_OF_MEMORY`.

use crate::cuda::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use crate::memory;
use crate::state::{self, DriverObject as Object, lock};
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

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
/// can be read without making a context: the current context's device,
/// where that context is one the process still has (a released primary
/// context may still be current, and the driver refuses every call on
/// it).
fn device_used(dev: u32) -> Option<u64> {
    let ctx = current_context()?;
    let alive = lock(&state::get().contexts)
        .iter()
        .any(|&(c, d)| c == ctx && d == dev);
    if !alive {
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

/// What the driver keeps for the process on physical `device` beyond its
/// allocations, given its `footprint`. A lower bound: the hook reserves
/// before the driver takes and gives back after the driver did, so
/// another thread's allocation or free in flight makes it smaller, never
/// larger.
fn own_part(device: u32, footprint: u64) -> u64 {
    let reserved = memory::reserved_for_allocations(device);
    footprint.saturating_sub(reserved.saturating_sub(held_on(device)))
}

/// What the driver keeps for the process on ordinal `dev` beyond its
/// allocations, now (`None`: not measurable).
fn measure(dev: u32, device: u32) -> Option<u64> {
    footprint(dev).map(|f| own_part(device, f))
}

/// Runs `call`, which makes memory the driver keeps for the process on
/// ordinal `dev` (`None`: it fails without a context anyway), with
/// `estimate` bytes reserved first; then charges what the driver really
/// took, at least the estimate (a measurement taken while other threads
/// allocate can only come out low). `undo` takes back what a successful
/// `call` made, where the group may not have it. Returns the result and
/// the bytes charged for what it made, to give back when it goes
/// ([`gone`]).
pub fn around(
    dev: Option<u32>,
    estimate: u64,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(),
) -> (CUresult, u64) {
    around_if(dev, || true, estimate, call, undo, || None)
}

/// Runs `call`, which makes `bytes` of memory the driver keeps for the
/// process on ordinal `dev`, with them reserved first (refused:
/// `CUDA_ERROR_OUT_OF_MEMORY` before the driver takes anything) and kept;
/// given back if it fails. Under the measuring lock, like [`around`]: a
/// measurement running beside `call` would take the memory it makes for
/// its own, and charge it twice.
fn charged_at(dev: Option<u32>, bytes: u64, call: impl FnOnce() -> CUresult) -> (CUresult, u64) {
    let Some((_, device)) = chargeable(dev) else {
        return (call(), 0);
    };
    let st = state::get();
    let _one = lock(&st.measuring);
    let held = held_on(device);
    if !charge(device, held.saturating_add(bytes)) {
        return (CUDA_ERROR_OUT_OF_MEMORY, 0);
    }
    let r = call();
    if r != CUDA_SUCCESS {
        charge(device, held_on(device).saturating_sub(bytes));
        return (r, 0);
    }
    (r, bytes)
}

/// The ordinal `dev` and its physical device, where what the driver keeps
/// there is charged: a device is known and the scheduler has not refused
/// the process.
fn chargeable(dev: Option<u32>) -> Option<(u32, u32)> {
    let dev = dev?;
    let st = state::get();
    (st.refused.load(Ordering::Acquire) == 0).then(|| (dev, st.physical(dev)))
}

/// [`around`], where `new` says (asked once no other such call runs)
/// whether `call` will make anything: a primary context another thread
/// was retaining at the same moment is not made twice; and `probe`
/// measures what a successful `call` made where neither NVML nor the
/// device's used memory before the call could (see [`probe_context`]).
fn around_if(
    dev: Option<u32>,
    new: impl FnOnce() -> bool,
    estimate: u64,
    call: impl FnOnce() -> CUresult,
    undo: impl FnOnce(),
    probe: impl FnOnce() -> Option<u64>,
) -> (CUresult, u64) {
    let Some((dev, device)) = chargeable(dev) else {
        return (call(), 0);
    };
    let st = state::get();
    let _one = lock(&st.measuring);
    if !new() {
        return (call(), 0);
    }
    let held = held_on(device);
    if estimate > 0 && !charge(device, held.saturating_add(estimate)) {
        return (CUDA_ERROR_OUT_OF_MEMORY, 0);
    }
    let nvml = measure(dev, device);
    let used = nvml.is_none().then(|| device_used(dev)).flatten();
    let r = call();
    if r != CUDA_SUCCESS {
        charge(device, held);
        return (r, 0);
    }
    let grown = match (nvml, measure(dev, device)) {
        (Some(b), Some(a)) => Some(a.saturating_sub(b)),
        // The process's first memory on the GPU: NVML did not list it
        // before.
        (None, Some(a)) if used.is_none() => Some(a.saturating_sub(held)),
        _ => match (used, device_used(dev)) {
            (Some(b), Some(a)) => Some(a.saturating_sub(b)),
            _ => None,
        },
    }
    .or_else(probe);
    if grown.is_none() {
        static TOLD: AtomicBool = AtomicBool::new(false);
        if !crate::nvml_lib::available() && !TOLD.swap(true, Ordering::Relaxed) {
            crate::log::error!(
                "the memory the driver keeps for this process on GPU {device} (its contexts and modules) cannot be measured: there is no NVML, and no context of the GPU was current; only what the hook expects is charged"
            );
        }
    }
    let took = grown.unwrap_or(0).max(estimate);
    if charge(device, held.saturating_add(took)) {
        return (r, took);
    }
    undo();
    charge(device, held);
    crate::log::error!(
        "the driver needs {took} bytes of GPU {device} for the process's own use (a context, a limit or a module), beyond the group's MemoryLimit; the program gets CUDA_ERROR_OUT_OF_MEMORY"
    );
    (CUDA_ERROR_OUT_OF_MEMORY, 0)
}

/// What the driver kept for an object that went (`bytes` on physical
/// `device`, as [`around`] charged it) is given back.
fn gone(device: u32, bytes: u64) {
    let st = state::get();
    let _one = lock(&st.measuring);
    charge(device, held_on(device).saturating_sub(bytes));
}

/// Remembers that `object` holds `bytes` of physical `device`, adding to
/// what it held.
fn keep(object: Object, device: u32, bytes: u64) {
    let mut objects = lock(&state::get().driver_objects);
    let e = objects.entry(object).or_insert((device, 0));
    e.1 = e.1.saturating_add(bytes);
}

/// `object` went: what it held is given back.
fn drop_object(object: Object) {
    let Some(st) = state::current() else { return };
    let found = lock(&st.driver_objects).remove(&object);
    if let Some((device, bytes)) = found {
        gone(device, bytes);
    }
}

/// A context is made on ordinal `dev` by `call`; `made` reads it (to
/// destroy it again where the group may not have its memory); `primary`:
/// a primary context, which takes memory only at its first retain. What
/// a new context takes is reserved first: the most any process's context
/// took on the GPU, as the scheduler heard (0 for the first context made
/// there since it started: that one is charged right after the driver
/// made it). What it really took is reported for the next, where it is more.
pub fn context(
    dev: i32,
    primary: bool,
    call: impl FnOnce() -> CUresult,
    made: impl Fn() -> *mut c_void,
) -> CUresult {
    let ordinal = u32::try_from(dev).ok();
    if primary && crate::driver::primary_active(dev) {
        return call(); // retained again: nothing new
    }
    let Some(device) = ordinal.map(|d| state::get().physical(d)) else {
        return call();
    };
    let new = || !(primary && crate::driver::primary_active(dev));
    let estimate = memory::context_cost(device);
    let undo = || {
        let ctx = made();
        if primary {
            let _ = crate::driver::primary_release(dev);
        } else if !ctx.is_null() {
            let _ = crate::driver::ctx_destroy(ctx);
        }
    };
    // Only with no NVML (with it, a context NVML does not list took
    // nothing), and while no context's size is known on the GPU: the
    // probe makes a context of its own for a moment. What it measures is
    // not reported as the GPU's context size: beside other processes that
    // allocate at the same moment it comes out high, and the scheduler
    // keeps the largest size it heard for every later context.
    let probed = std::cell::Cell::new(false);
    let probe = || {
        let took = (estimate == 0 && !crate::nvml_lib::available())
            .then(|| probe_context(dev, made()))
            .flatten();
        probed.set(took.is_some());
        took
    };
    let (r, took) = around_if(ordinal, new, estimate, call, undo, probe);
    if r == CUDA_SUCCESS {
        let ctx = made() as usize;
        let object = if primary {
            Object::Primary(dev, ctx)
        } else {
            Object::Context(ctx)
        };
        keep(object, device, took);
        // The scheduler keeps the largest size it heard: one no larger
        // than it said is not worth a round trip (every program started
        // after the first paid one, at start-up).
        if took > estimate && !probed.get() {
            memory::report_context(device, took);
        }
    }
    r
}

/// What a context takes of ordinal `dev`, measured with the driver's own
/// answers where nothing else can: the process's first context, made with
/// no NVML (a container may not expose it) and so no context to read the
/// device's used memory in before it. With `ctx` (the new context)
/// current, `cuMemGetInfo` is read, a second context of the same device
/// made for a moment and read again: the second took what the first did
/// (both hold the same per-context state; the limits and modules that
/// differ are charged on their own). Exact for a process alone on the
/// device, approximate beside others that allocate at the same moment.
/// `None` where the second context cannot be made (the device is full).
fn probe_context(dev: i32, ctx: *mut c_void) -> Option<u64> {
    if ctx.is_null() {
        return None;
    }
    // SAFETY: `ctx` is the context the driver just made for this process.
    if unsafe { crate::driver::ctx_push(ctx) } != CUDA_SUCCESS {
        return None;
    }
    let used = || {
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: out-pointers to locals.
        let r = unsafe { crate::driver::mem_get_info(&mut free, &mut total) };
        (r == CUDA_SUCCESS).then(|| total.saturating_sub(free) as u64)
    };
    let before = used();
    let second = crate::driver::ctx_create(dev);
    let after = second.and_then(|c| {
        let after = used();
        // Destroying the current context pops it: `ctx` is current again.
        let _ = crate::driver::ctx_destroy(c);
        after
    });
    let mut popped = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local; pops the `ctx` pushed above.
    unsafe { crate::driver::ctx_pop(&mut popped) };
    let took = after?.saturating_sub(before?);
    crate::log::debug!(
        "GPU ordinal {dev}: a first context no other reading could measure, measured by a second one: {} MiB",
        took >> 20
    );
    Some(took)
}

/// `cuCtxDestroy(ctx)` by `call`: what the driver kept for the context
/// and its limits is given back.
pub fn context_destroyed(ctx: *mut c_void, call: impl FnOnce() -> CUresult) -> CUresult {
    let r = call();
    if r == CUDA_SUCCESS {
        context_gone(ctx as usize);
    }
    r
}

/// The context `ctx` and its limits went.
fn context_gone(ctx: usize) {
    drop_object(Object::Context(ctx));
    limits_gone(ctx);
}

/// The limits of context `ctx` went with it.
fn limits_gone(ctx: usize) {
    for limit in [
        LIMIT_STACK_SIZE,
        LIMIT_PRINTF_FIFO_SIZE,
        LIMIT_MALLOC_HEAP_SIZE,
    ] {
        drop_object(Object::Limit(ctx, limit));
    }
}

/// `cuDevicePrimaryCtxRelease` or `cuDevicePrimaryCtxReset` of ordinal
/// `dev` by `call`: where the primary context is gone after it (its last
/// release, or a reset: `reset`), what the driver kept for it is given
/// back, and `gone` is told which context it was.
pub fn primary_gone(
    dev: i32,
    reset: bool,
    call: impl FnOnce() -> CUresult,
    gone: impl FnOnce(*mut c_void),
) -> CUresult {
    let primary = primary_of(dev);
    let r = call();
    if r == CUDA_SUCCESS
        && let Some(object) = primary
        && (reset || !crate::driver::primary_active(dev))
    {
        drop_object(object);
        if let Object::Primary(_, ctx) = object {
            limits_gone(ctx);
            gone(ctx as *mut c_void);
        }
    }
    r
}

/// The primary context of ordinal `dev`, as charged.
fn primary_of(dev: i32) -> Option<Object> {
    let st = state::current()?;
    lock(&st.driver_objects)
        .keys()
        .find(|o| matches!(o, Object::Primary(d, _) if *d == dev))
        .copied()
}

/// The current context.
fn current_context() -> Option<usize> {
    let mut ctx = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    let r = unsafe { crate::driver::ctx_get_current(&mut ctx) };
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx as usize)
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
/// first (refused, the limit is set back); a smaller one gives back what
/// the limit's growth was charged.
pub fn set_limit(limit: i32, value: usize, call: impl FnOnce() -> CUresult) -> CUresult {
    let dev = memory::current_ordinal();
    let (Some(d), Some(ctx)) = (dev, current_context()) else {
        return call();
    };
    let old = crate::driver::ctx_get_limit(limit);
    let per_unit = match limit {
        LIMIT_STACK_SIZE => {
            let sms = crate::driver::device_attribute(ATTR_SMS, d).unwrap_or(0);
            let threads = crate::driver::device_attribute(ATTR_THREADS_PER_SM, d).unwrap_or(2048);
            (sms.max(0) as u64) * (threads.max(0) as u64)
        }
        LIMIT_PRINTF_FIFO_SIZE | LIMIT_MALLOC_HEAP_SIZE => 1,
        _ => return call(),
    };
    let Some(old) = old else { return call() };
    if value <= old {
        let r = call();
        if r == CUDA_SUCCESS {
            let less = ((old - value) as u64).saturating_mul(per_unit);
            let st = state::get();
            let mut objects = lock(&st.driver_objects);
            if let Some(e) = objects.get_mut(&Object::Limit(ctx, limit)) {
                let back = less.min(e.1);
                e.1 -= back;
                let device = e.0;
                drop(objects);
                gone(device, back);
            }
        }
        return r;
    }
    let estimate = ((value - old) as u64).saturating_mul(per_unit);
    let (r, took) = around(dev, estimate, call, || {
        let _ = crate::driver::ctx_set_limit(limit, old);
    });
    if r == CUDA_SUCCESS && took > 0 {
        keep(Object::Limit(ctx, limit), state::get().physical(d), took);
    }
    r
}

/// The device memory a module image takes on ordinal `dev`, as far as
/// its headers say: an ELF's size; for a fatbinary, the size of the one
/// cubin the driver loads from it (the device's architecture, else the
/// highest of the same major below it), not the whole: every
/// architecture and the PTX were charged, and memory the driver never
/// holds refused. 0 where only the driver can say (text, PTX, a
/// fatbinary with no cubin for the device: compiled to a size known only
/// after).
pub fn image_bytes(image: *const c_void, dev: Option<u32>) -> u64 {
    if image.is_null() {
        return 0;
    }
    let b = image as *const u8;
    // SAFETY: the program's image, which starts with a header when it
    // starts with one of these magics (only then read past 4 bytes); a
    // fatbinary is as long as its header says, as the driver reads it.
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
            let Some(arch) = dev.and_then(device_arch) else {
                return 0;
            };
            return fatbin_cubin(b, arch).unwrap_or(0);
        }
    }
    0
}

/// The architecture of ordinal `dev` (sm_90: 90).
fn device_arch(dev: u32) -> Option<u32> {
    let major = crate::driver::device_attribute(75, dev)?;
    let minor = crate::driver::device_attribute(76, dev)?;
    u32::try_from(major * 10 + minor).ok()
}

/// The size of the cubin a device of `arch` loads from the fatbinary at
/// `b`: its entries (a header each, 64 bytes or more: its kind at 0, 2
/// for an ELF; the header's length at 4; the payload's at 8; the
/// architecture at 28; the payload's size unpacked at 56, 0 where it is
/// stored whole) follow the 16-byte header, for as many bytes as it says.
///
/// # Safety
/// `b` starts a whole fatbinary.
unsafe fn fatbin_cubin(b: *const u8, arch: u32) -> Option<u64> {
    // SAFETY: within the fatbinary, by its own lengths (the caller's).
    unsafe {
        let header = usize::from((b.add(6) as *const u16).read_unaligned());
        let fat = usize::try_from((b.add(8) as *const u64).read_unaligned()).ok()?;
        let end = header.checked_add(fat)?;
        let (mut at, mut best) = (header, None::<(u32, u64)>);
        for _ in 0..4096 {
            if at.saturating_add(64) > end {
                break;
            }
            let e = b.add(at);
            let kind = (e as *const u16).read_unaligned();
            let head = (e.add(4) as *const u32).read_unaligned() as usize;
            let size = (e.add(8) as *const u64).read_unaligned();
            let sm = (e.add(28) as *const u32).read_unaligned();
            let unpacked = (e.add(56) as *const u64).read_unaligned();
            if head < 64 {
                break;
            }
            if matches!(kind, 2 | 0x10)
                && sm / 10 == arch / 10
                && sm <= arch
                && best.is_none_or(|(a, _)| sm > a)
            {
                best = Some((sm, if unpacked > 0 { unpacked } else { size }));
            }
            at = at
                .checked_add(head)?
                .checked_add(usize::try_from(size).ok()?)?;
        }
        best.map(|(_, n)| n)
    }
}

/// A module or library is loaded by `call` (from `image`, where the
/// program gave one) into `*out`: its memory is charged; refused, it is
/// unloaded by `unload`. A library is loaded into the current context
/// (and into others as they use it): charged on the current device.
pub fn code_loaded(
    out: *mut *mut c_void,
    image: *const c_void,
    call: impl FnOnce() -> CUresult,
    unload: impl FnOnce(*mut c_void),
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
    let undo = || {
        let m = read();
        if !m.is_null() {
            unload(m);
        }
    };
    let size = image_bytes(image, dev);
    // An image whose header gives its size (a cubin, a fatbinary: what
    // compilers, Triton and the runtime's lazy loading hand the driver)
    // is charged that size, with no measurement: loads of many threads
    // run side by side, paying no NVML enumeration. Text (PTX), whose
    // code size only the driver's compiler knows, is measured.
    let (r, took) = if size > 0 {
        charged_at(dev, size, call)
    } else {
        around(dev, 0, call, undo)
    };
    if r == CUDA_SUCCESS
        && took > 0
        && let Some(d) = dev
    {
        keep(
            Object::Code(read() as usize),
            state::get().physical(d),
            took,
        );
    }
    r
}

/// A module or library is unloaded by `call`: its memory is given back.
pub fn code_unloaded(handle: *mut c_void, call: impl FnOnce() -> CUresult) -> CUresult {
    let r = call();
    if r == CUDA_SUCCESS {
        drop_object(Object::Code(handle as usize));
    }
    r
}
