//! The real driver functions the hook calls for itself (never through its
//! own exports), resolved once each.

use crate::real::{real_entry, real_fn};
use std::ffi::{CStr, c_void};
use std::sync::atomic::AtomicUsize;

pub use crate::cuda::CUresult;
use crate::cuda::{CUDA_ERROR_NOT_FOUND, CUDA_SUCCESS};

/// Resolves `name` into a function pointer of type `F`.
///
/// # Safety
/// `F` must be the C signature of the driver function `name`.
#[inline]
pub unsafe fn resolve<F: Copy>(slot: &AtomicUsize, name: &CStr) -> Option<F> {
    let addr = real_fn(slot, name);
    // SAFETY: non-zero addresses are driver functions of signature F (the
    // caller's promise); F is a function pointer of usize's size.
    (addr != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&addr) })
}

/// [`resolve`], through the driver's `cuGetProcAddress(base, version,
/// flags)` first (see `real::real_entry`).
///
/// # Safety
/// `F` must be the C signature of the driver function `name`, which
/// `base` at `version` with `flags` stands for.
#[inline]
pub unsafe fn resolve_entry<F: Copy>(
    slot: &AtomicUsize,
    name: &CStr,
    base: &CStr,
    version: i32,
    flags: u64,
) -> Option<F> {
    let addr = real_entry(slot, name, base, version, flags);
    // SAFETY: as for `resolve`.
    (addr != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&addr) })
}

/// Calls the real driver function: by its name (an entry point every
/// driver exports under that name), or, for a versioned one, as the
/// driver's `cuGetProcAddress` gives `@ base, version, flags`.
macro_rules! real_call {
    ($name:literal @ $base:literal, $version:literal, $flags:literal, fn($($t:ty),*) $(, $arg:expr)*) => {{
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        type F = unsafe extern "C" fn($($t),*) -> CUresult;
        // SAFETY: F is the C signature of the named driver function.
        match unsafe { resolve_entry::<F>(&SLOT, $name, $base, $version, $flags) } {
            // SAFETY: arguments as the caller passed them to us.
            Some(f) => unsafe { f($($arg),*) },
            None => CUDA_ERROR_NOT_FOUND,
        }
    }};
    ($name:literal, fn($($t:ty),*) $(, $arg:expr)*) => {{
        static SLOT: AtomicUsize = AtomicUsize::new(0);
        type F = unsafe extern "C" fn($($t),*) -> CUresult;
        // SAFETY: F is the C signature of the named driver function.
        match unsafe { resolve::<F>(&SLOT, $name) } {
            // SAFETY: arguments as the caller passed them to us.
            Some(f) => unsafe { f($($arg),*) },
            None => CUDA_ERROR_NOT_FOUND,
        }
    }};
}

/// The driver's CUDA version (`cuDriverGetVersion`: 12080 for 12.8), read
/// once; 0 where it cannot be read.
pub fn driver_version() -> i32 {
    static VERSION: std::sync::OnceLock<i32> = std::sync::OnceLock::new();
    *VERSION.get_or_init(|| {
        let mut v: i32 = 0;
        let r = real_call!(c"cuDriverGetVersion", fn(*mut i32), &mut v);
        if r == CUDA_SUCCESS { v } else { 0 }
    })
}

/// The device ordinal of context `ctx` (any thread's): `cuCtxGetDevice_v2`
/// (CUDA 13.0), else `cuCtxGetDevice` with `ctx` pushed and popped.
pub fn ctx_device(ctx: *mut c_void) -> Option<i32> {
    let mut dev: i32 = -1;
    // A driver before 13.0 answers the request for the 13.0 function with
    // `cuCtxGetDevice` itself, which takes no context and says the
    // current one's device.
    let r = if driver_version() < 13000 {
        CUDA_ERROR_NOT_FOUND
    } else {
        real_call!(
        c"cuCtxGetDevice_v2" @ c"cuCtxGetDevice", 13000, 0,
        fn(*mut i32, *mut c_void),
            &mut dev,
            ctx
        )
    };
    if r == CUDA_SUCCESS {
        return (dev >= 0).then_some(dev);
    }
    // SAFETY: `ctx` is pushed for this call only, and popped again.
    unsafe {
        if ctx_push(ctx) != CUDA_SUCCESS {
            return None;
        }
        let r = ctx_get_device(&mut dev);
        let mut popped = std::ptr::null_mut();
        ctx_pop(&mut popped);
        (r == CUDA_SUCCESS && dev >= 0).then_some(dev)
    }
}

/// `cuCtxGetDevice`.
///
/// # Safety
/// `dev` must be writable.
#[inline]
pub unsafe fn ctx_get_device(dev: *mut i32) -> CUresult {
    real_call!(c"cuCtxGetDevice", fn(*mut i32), dev)
}

/// `cuCtxGetCurrent`.
///
/// # Safety
/// `ctx` must be writable.
pub unsafe fn ctx_get_current(ctx: *mut *mut c_void) -> CUresult {
    real_call!(c"cuCtxGetCurrent", fn(*mut *mut c_void), ctx)
}

/// `cuCtxSynchronize`.
///
/// # Safety
/// Always safe to call; unsafe for uniformity with the driver API.
pub unsafe fn ctx_synchronize() -> CUresult {
    real_call!(c"cuCtxSynchronize", fn())
}

/// `cuCtxPushCurrent_v2`.
///
/// # Safety
/// `ctx` must be a context of this process.
pub unsafe fn ctx_push(ctx: *mut c_void) -> CUresult {
    real_call!(c"cuCtxPushCurrent_v2" @ c"cuCtxPushCurrent", 4000, 0, fn(*mut c_void), ctx)
}

/// `cuCtxPopCurrent_v2`.
///
/// # Safety
/// `ctx` must be writable.
pub unsafe fn ctx_pop(ctx: *mut *mut c_void) -> CUresult {
    real_call!(c"cuCtxPopCurrent_v2" @ c"cuCtxPopCurrent", 4000, 0, fn(*mut *mut c_void), ctx)
}

/// `cuStreamIsCapturing` (`_ptsz` for a per-thread-default-stream
/// caller, whose null stream is its own).
///
/// # Safety
/// `status` must be writable.
pub unsafe fn stream_is_capturing(
    stream: *mut c_void,
    per_thread: bool,
    status: *mut u32,
) -> CUresult {
    if per_thread {
        real_call!(
            c"cuStreamIsCapturing_ptsz" @ c"cuStreamIsCapturing", 10000, 2,
            fn(*mut c_void, *mut u32),
            stream,
            status
        )
    } else {
        real_call!(
            c"cuStreamIsCapturing",
            fn(*mut c_void, *mut u32),
            stream,
            status
        )
    }
}

/// `cuDeviceGetMemPool`: the pool `cuMemAllocAsync` allocates from on
/// ordinal `dev`.
pub fn device_mem_pool(dev: u32) -> Option<*mut c_void> {
    let mut pool = std::ptr::null_mut();
    let r = real_call!(
        c"cuDeviceGetMemPool",
        fn(*mut *mut c_void, i32),
        &mut pool,
        dev as i32
    );
    (r == CUDA_SUCCESS && !pool.is_null()).then_some(pool)
}

/// A `u64` attribute of a memory pool (`cuMemPoolGetAttribute`).
pub fn mem_pool_u64(pool: *mut c_void, attr: i32) -> Option<u64> {
    let mut v = 0u64;
    let r = real_call!(
        c"cuMemPoolGetAttribute",
        fn(*mut c_void, i32, *mut c_void),
        pool,
        attr,
        (&mut v as *mut u64).cast()
    );
    (r == CUDA_SUCCESS).then_some(v)
}

/// A `u64` graph memory attribute of ordinal `dev`
/// (`cuDeviceGetGraphMemAttribute`, CUDA 11.4+; `None` where the driver
/// has none).
pub fn graph_mem_u64(dev: u32, attr: i32) -> Option<u64> {
    let mut v = 0u64;
    let r = real_call!(
        c"cuDeviceGetGraphMemAttribute",
        fn(i32, i32, *mut c_void),
        dev as i32,
        attr,
        (&mut v as *mut u64).cast()
    );
    (r == CUDA_SUCCESS).then_some(v)
}

/// `cuMemFreeAsync` then `cuMemPoolTrimTo(pool, 0)`: takes back an
/// allocation the group may not keep, and the pool's unused memory.
///
/// # Safety
/// `ptr` was just allocated from `pool` on `stream` and not handed out.
pub unsafe fn pool_give_back(ptr: u64, stream: *mut c_void, pool: *mut c_void) {
    let _ = real_call!(c"cuMemFreeAsync", fn(u64, *mut c_void), ptr, stream);
    let _ = real_call!(c"cuMemPoolTrimTo", fn(*mut c_void, usize), pool, 0usize);
}

/// `cuDeviceGetCount`, if the driver is initialised and answers.
pub fn device_count() -> Option<i32> {
    let mut n = 0;
    let r = real_call!(c"cuDeviceGetCount", fn(*mut i32), &mut n);
    (r == CUDA_SUCCESS).then_some(n)
}

/// The UUID of the driver's device `ordinal` (`cuDeviceGetUuid_v2`, or
/// `cuDeviceGetUuid` before CUDA 11.4), if the driver is initialised and
/// answers.
pub fn device_uuid(ordinal: i32) -> Option<[u8; 16]> {
    let mut dev = 0i32;
    if real_call!(c"cuDeviceGet", fn(*mut i32, i32), &mut dev, ordinal) != 0 {
        return None;
    }
    let mut uuid = [0u8; 16];
    let mut r = real_call!(
        c"cuDeviceGetUuid_v2" @ c"cuDeviceGetUuid", 11040, 0,
        fn(*mut [u8; 16], i32),
        &mut uuid,
        dev
    );
    if r == CUDA_ERROR_NOT_FOUND {
        r = real_call!(c"cuDeviceGetUuid", fn(*mut [u8; 16], i32), &mut uuid, dev);
    }
    (r == CUDA_SUCCESS).then_some(uuid)
}

/// `cuMemGetInfo_v2`.
///
/// # Safety
/// Both pointers must be writable.
pub unsafe fn mem_get_info(free: *mut usize, total: *mut usize) -> CUresult {
    real_call!(c"cuMemGetInfo_v2" @ c"cuMemGetInfo", 3020, 0, fn(*mut usize, *mut usize), free, total)
}

/// `cuDeviceTotalMem_v2`.
///
/// # Safety
/// `bytes` must be writable.
pub unsafe fn device_total_mem(bytes: *mut usize, dev: i32) -> CUresult {
    real_call!(c"cuDeviceTotalMem_v2" @ c"cuDeviceTotalMem", 3020, 0, fn(*mut usize, i32), bytes, dev)
}

/// `cuStreamGetFlags`.
///
/// # Safety
/// `flags` must be writable.
pub unsafe fn stream_get_flags(stream: *mut c_void, flags: *mut u32) -> CUresult {
    real_call!(
        c"cuStreamGetFlags",
        fn(*mut c_void, *mut u32),
        stream,
        flags
    )
}

/// `cuEventCreate` with timing (flags 0), in the current context.
pub fn event_create() -> Option<usize> {
    let mut e: *mut c_void = std::ptr::null_mut();
    let r = real_call!(c"cuEventCreate", fn(*mut *mut c_void, u32), &mut e, 0u32);
    (r == CUDA_SUCCESS && !e.is_null()).then_some(e as usize)
}

/// `cuEventRecord` (`_ptsz` where the null stream is the per-thread one).
pub fn event_record(event: usize, stream: *mut c_void, per_thread: bool) -> CUresult {
    let e = event as *mut c_void;
    if per_thread {
        real_call!(
            c"cuEventRecord_ptsz" @ c"cuEventRecord", 7000, 2,
            fn(*mut c_void, *mut c_void),
            e,
            stream
        )
    } else {
        real_call!(c"cuEventRecord", fn(*mut c_void, *mut c_void), e, stream)
    }
}

/// `cuEventElapsedTime` between two completed events, in ns; the driver's
/// error otherwise (`CUDA_ERROR_NOT_READY` while either is pending), and
/// `CUDA_ERROR_INVALID_VALUE` where `end` completed before `start` (one
/// re-recorded meanwhile: no time of the pair's).
pub fn event_elapsed_ns(start: usize, end: usize) -> Result<u64, CUresult> {
    let mut ms: f32 = 0.0;
    let r = real_call!(
        c"cuEventElapsedTime",
        fn(*mut f32, *mut c_void, *mut c_void),
        &mut ms,
        start as *mut c_void,
        end as *mut c_void
    );
    if r != CUDA_SUCCESS {
        Err(r)
    } else if ms < 0.0 || !ms.is_finite() {
        Err(crate::cuda::CUDA_ERROR_INVALID_VALUE)
    } else {
        Ok((f64::from(ms) * 1e6) as u64)
    }
}

/// `cuEventQuery`: `CUDA_SUCCESS` once the event completed,
/// `CUDA_ERROR_NOT_READY` before.
pub fn event_query(event: usize) -> CUresult {
    real_call!(c"cuEventQuery", fn(*mut c_void), event as *mut c_void)
}

/// `cuStreamCreate` of a non-blocking stream (`CU_STREAM_NON_BLOCKING`:
/// no implicit synchronisation with the legacy default stream) in the
/// current context.
pub fn stream_create_nonblocking() -> Option<usize> {
    let mut s: *mut c_void = std::ptr::null_mut();
    let r = real_call!(c"cuStreamCreate", fn(*mut *mut c_void, u32), &mut s, 1u32);
    (r == CUDA_SUCCESS && !s.is_null()).then_some(s as usize)
}

/// `cuStreamDestroy_v2`.
pub fn stream_destroy(stream: usize) {
    let _ = real_call!(c"cuStreamDestroy_v2" @ c"cuStreamDestroy", 4000, 0, fn(*mut c_void), stream as *mut c_void);
}

/// `cuEventDestroy_v2`.
pub fn event_destroy(event: usize) {
    let _ = real_call!(c"cuEventDestroy_v2" @ c"cuEventDestroy", 4000, 0, fn(*mut c_void), event as *mut c_void);
}

/// `cuCtxFromGreenCtx`: the context a green context is used through.
pub fn ctx_from_green(green: *mut c_void) -> Option<*mut c_void> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let r = real_call!(
        c"cuCtxFromGreenCtx",
        fn(*mut *mut c_void, *mut c_void),
        &mut ctx,
        green
    );
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx)
}

/// `cuStreamGetCtx`: the context `stream` belongs to.
pub fn stream_ctx(stream: *mut c_void) -> Option<*mut c_void> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    let r = real_call!(
        c"cuStreamGetCtx",
        fn(*mut c_void, *mut *mut c_void),
        stream,
        &mut ctx
    );
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx)
}

/// `cuCtxGetLimit` of the current context.
pub fn ctx_get_limit(limit: i32) -> Option<usize> {
    let mut v = 0usize;
    let r = real_call!(c"cuCtxGetLimit", fn(*mut usize, i32), &mut v, limit);
    (r == CUDA_SUCCESS).then_some(v)
}

/// `cuCtxSetLimit` of the current context.
pub fn ctx_set_limit(limit: i32, value: usize) -> CUresult {
    real_call!(c"cuCtxSetLimit", fn(i32, usize), limit, value)
}

/// An attribute of ordinal `dev` (`cuDeviceGetAttribute`).
pub fn device_attribute(attr: i32, dev: u32) -> Option<i32> {
    let mut v = 0i32;
    let r = real_call!(
        c"cuDeviceGetAttribute",
        fn(*mut i32, i32, i32),
        &mut v,
        attr,
        dev as i32
    );
    (r == CUDA_SUCCESS).then_some(v)
}

/// `cuCtxDestroy_v2`: takes back a context the group may not have.
pub fn ctx_destroy(ctx: *mut c_void) -> CUresult {
    real_call!(c"cuCtxDestroy_v2" @ c"cuCtxDestroy", 4000, 0, fn(*mut c_void), ctx)
}

/// `cuCtxCreate_v2` on ordinal `dev` with the default flags: a context
/// of the hook's own, current on the calling thread until destroyed.
pub fn ctx_create(dev: i32) -> Option<*mut c_void> {
    let mut ctx = std::ptr::null_mut();
    let r = real_call!(
        c"cuCtxCreate_v2" @ c"cuCtxCreate",
        3020,
        0,
        fn(*mut *mut c_void, u32, i32),
        &mut ctx,
        0,
        dev
    );
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx)
}

/// `cuDevicePrimaryCtxRelease_v2`: takes back a retain the group may not
/// have.
pub fn primary_release(dev: i32) -> CUresult {
    real_call!(c"cuDevicePrimaryCtxRelease_v2" @ c"cuDevicePrimaryCtxRelease", 11000, 0, fn(i32), dev)
}

/// `cuModuleUnload`: takes back a module the group may not have.
pub fn module_unload(module: *mut c_void) -> CUresult {
    real_call!(c"cuModuleUnload", fn(*mut c_void), module)
}

/// Whether the primary context of ordinal `dev` is active (retained).
pub fn primary_active(dev: i32) -> bool {
    let (mut flags, mut active) = (0u32, 0i32);
    let r = real_call!(
        c"cuDevicePrimaryCtxGetState",
        fn(i32, *mut u32, *mut i32),
        dev,
        &mut flags,
        &mut active
    );
    r == CUDA_SUCCESS && active != 0
}

/// `cuLibraryUnload`: takes back a library the group may not have.
pub fn library_unload(library: *mut c_void) -> CUresult {
    real_call!(c"cuLibraryUnload", fn(*mut c_void), library)
}
