//! The one table of hooked driver entry points. Each line gives the
//! exported symbol, the base name `cuGetProcAddress` asks for, the first
//! CUDA version at which that base name means this symbol, whether it is
//! the per-thread-default-stream variant, the C signature and the body.
//! From it come all three ways a program reaches the driver: the exported
//! symbols, the answer of our `dlsym`, and the answer of
//! `cuGetProcAddress[_v2]`.
//!
//! The hook never calls its own exports (it calls the real functions
//! through resolved pointers), so no re-entrancy guard is needed here.

use crate::capture;
use crate::cuda::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, CUresult,
};
use crate::driver;
use crate::gate;
use crate::graphmem;
use crate::graphs;
use crate::memory::{self, guarded_alloc, guarded_alloc_on};
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicUsize;

type Ptr = *mut c_void;
type CUdeviceptr = u64;

/// `cuGetProcAddress` flag for per-thread default stream variants.
const PER_THREAD: u64 = 2;

/// A line of the table, without the code.
#[derive(Debug, Clone, Copy)]
pub struct Entry {
    /// Exported symbol.
    pub symbol: &'static str,
    /// Name `cuGetProcAddress` is asked for.
    pub base: &'static str,
    /// First CUDA version at which `base` means `symbol`.
    pub since: i32,
    /// The `_ptsz`/`_ptds` variant.
    pub per_thread: bool,
}

macro_rules! hooks {
    ($(
        $name:ident [$base:literal, $since:literal, $pt:literal]
        ($($arg:ident : $ty:ty),* $(,)?) => |$real:ident| $body:block
    )*) => {
        $(
            #[cfg_attr(not(test), unsafe(no_mangle))]
            #[allow(non_snake_case, clippy::missing_safety_doc)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                type Real = unsafe extern "C" fn($($ty),*) -> CUresult;
                // SAFETY: Real is the C signature of this driver function.
                let Some($real) = (unsafe { driver::resolve::<Real>(&SLOT, {
                    const NAME: &CStr = match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                        Ok(c) => c,
                        Err(_) => panic!("symbol names have no NUL"),
                    };
                    NAME
                }) }) else {
                    return CUDA_ERROR_NOT_FOUND;
                };
                catch_unwind(AssertUnwindSafe(move || -> CUresult { $body })).unwrap_or(CUDA_ERROR_UNKNOWN)
            }
        )*

        /// Every line of the table.
        pub const ENTRIES: &[Entry] = &[
            $( Entry { symbol: stringify!($name), base: $base, since: $since, per_thread: $pt }, )*
        ];

        /// Our function for the exported symbol `name`. Allocates nothing
        /// and takes no lock: called from our `dlsym`.
        pub fn lookup(name: &[u8]) -> Option<Ptr> {
            $( if name == stringify!($name).as_bytes() { return Some($name as *const () as Ptr); } )*
            None
        }
    };
}

/// Launches `$call` onto stream `$s` (`$pt`: a per-thread-default-stream
/// entry point) if the gate admits this process to the device.
macro_rules! gated {
    ($s:expr, $pt:expr, $call:expr) => {
        match gate::admit_on($s, $pt) {
            Ok(_in_call) => {
                // SAFETY: the program's own arguments, passed on unchanged.
                unsafe { $call }
            }
            Err(e) => e,
        }
    };
}

/// Runs `$call`, a call that waits for (or polls) the process's device
/// work: while it runs the process is busy, not idle (see [`gate`]).
macro_rules! waits {
    ($call:expr) => {{
        let _waiting = gate::waiting(false);
        // SAFETY: the program's own arguments, passed on unchanged.
        unsafe { $call }
    }};
}

/// Like `waits!`, for a call whose success means the work before it is
/// done (a synchronisation, a blocking copy, a query answering
/// `CUDA_SUCCESS`): the gate learns from it how long launches take.
macro_rules! syncs {
    ($call:expr) => {
        syncs!($call, false)
    };
    ($call:expr, $blocks:expr) => {{
        let mut waiting = gate::waiting($blocks);
        // SAFETY: the program's own arguments, passed on unchanged.
        let r = unsafe { $call };
        if r == CUDA_SUCCESS {
            waiting.finished();
        }
        r
    }};
}

/// Like `syncs!`, for a call that blocks until the work is done (a
/// synchronisation, a blocking copy): the driver trims memory pools
/// there, so the group's pool memory is settled afterwards.
macro_rules! trims {
    ($call:expr) => {{
        let r = syncs!($call, true);
        memory::settle_pools();
        r
    }};
}

/// `cuGraphLaunch[_ptsz]` through `real`: gated by the graph's predicted
/// cost and timed with events (see `graphs`); a launch into a capturing
/// stream passes ungated and untimed.
fn graph_launch(
    exec: Ptr,
    s: Ptr,
    pt: bool,
    real: unsafe extern "C" fn(Ptr, Ptr) -> CUresult,
) -> CUresult {
    let captured = capture::captured(s, pt);
    match gate::admit_graph(exec, s, pt) {
        Ok(_in_call) => graphs::launch(exec, s, pt, || {
            // SAFETY: the program's own arguments, passed on unchanged.
            let run = || unsafe { real(exec, s) };
            if captured {
                run()
            } else {
                graphmem::launch(exec, run)
            }
        }),
        Err(e) => e,
    }
}

/// The symbol `cuGetProcAddress(base, version, flags)` stands for, when it
/// is one of ours.
pub fn resolve(base: &str, version: i32, flags: u64) -> Option<&'static Entry> {
    let candidates = || {
        ENTRIES
            .iter()
            .filter(move |e| e.base == base && e.since <= version)
    };
    if flags & PER_THREAD != 0
        && let Some(e) = candidates()
            .filter(|e| e.per_thread)
            .max_by_key(|e| e.since)
    {
        return Some(e);
    }
    candidates()
        .filter(|e| !e.per_thread)
        .max_by_key(|e| e.since)
}

fn proc_address(
    symbol: *const c_char,
    pfn: *mut Ptr,
    version: i32,
    flags: u64,
    r: CUresult,
) -> CUresult {
    if r != CUDA_SUCCESS || symbol.is_null() || pfn.is_null() {
        return r;
    }
    // SAFETY: non-null NUL-terminated name from the caller.
    let name = unsafe { CStr::from_ptr(symbol) };
    let Ok(name) = name.to_str() else { return r };
    if let Some(e) = resolve(name, version, flags)
        && let Some(f) = lookup(e.symbol.as_bytes())
    {
        // SAFETY: pfn is the caller's non-null out-pointer.
        unsafe { *pfn = f };
    }
    r
}

fn array_key(p: *mut usize) -> u64 {
    // SAFETY: read only after the real call succeeded and filled it.
    if p.is_null() { 0 } else { unsafe { *p as u64 } }
}

/// What a successful call wrote through `p` (null if `p` is).
fn ptr_read(p: *mut Ptr) -> Ptr {
    if p.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: read only after the real call succeeded and filled it.
    unsafe { *p }
}

fn ptr_key(p: *mut CUdeviceptr) -> u64 {
    // SAFETY: read only after the real call succeeded and filled it.
    if p.is_null() { 0 } else { unsafe { *p } }
}

hooks! {
    // Launches.
    cuLaunchKernel ["cuLaunchKernel", 4000, false]
    (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr, e: *mut Ptr) => |real| {
        gated!(s, false, real(f, gx, gy, gz, bx, by, bz, sh, s, p, e))
    }
    cuLaunchKernel_ptsz ["cuLaunchKernel", 7000, true]
    (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr, e: *mut Ptr) => |real| {
        gated!(s, true, real(f, gx, gy, gz, bx, by, bz, sh, s, p, e))
    }
    cuLaunchKernelEx ["cuLaunchKernelEx", 11060, false]
    (config: Ptr, f: Ptr, p: *mut Ptr, e: *mut Ptr) => |real| {
        gated!(capture::config_stream(config), false, real(config, f, p, e))
    }
    cuLaunchKernelEx_ptsz ["cuLaunchKernelEx", 11060, true]
    (config: Ptr, f: Ptr, p: *mut Ptr, e: *mut Ptr) => |real| {
        gated!(capture::config_stream(config), true, real(config, f, p, e))
    }
    cuLaunchCooperativeKernel ["cuLaunchCooperativeKernel", 9000, false]
    (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr) => |real| {
        gated!(s, false, real(f, gx, gy, gz, bx, by, bz, sh, s, p))
    }
    cuLaunchCooperativeKernel_ptsz ["cuLaunchCooperativeKernel", 9000, true]
    (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr) => |real| {
        gated!(s, true, real(f, gx, gy, gz, bx, by, bz, sh, s, p))
    }
    // The launches of CUDA 2.0, deprecated but in cuda.h: on the legacy
    // default stream, or the one given.
    cuLaunch ["cuLaunch", 2000, false]
    (f: Ptr) => |real| { gated!(std::ptr::null_mut(), false, real(f)) }
    cuLaunchGrid ["cuLaunchGrid", 2000, false]
    (f: Ptr, w: i32, h: i32) => |real| { gated!(std::ptr::null_mut(), false, real(f, w, h)) }
    cuLaunchGridAsync ["cuLaunchGridAsync", 2000, false]
    (f: Ptr, w: i32, h: i32, s: Ptr) => |real| { gated!(s, false, real(f, w, h, s)) }
    // A graph launch is gated as the device time its last runs took, and
    // timed with events (see `graphs`).
    cuGraphLaunch ["cuGraphLaunch", 10000, false]
    (exec: Ptr, s: Ptr) => |real| { graph_launch(exec, s, false, real) }
    cuGraphLaunch_ptsz ["cuGraphLaunch", 10000, true]
    (exec: Ptr, s: Ptr) => |real| { graph_launch(exec, s, true, real) }
    cuGraphExecDestroy ["cuGraphExecDestroy", 10000, false]
    (exec: Ptr) => |real| {
        graphs::forget(exec);
        graphmem::forget(exec);
        // SAFETY: the program's argument, passed on unchanged.
        unsafe { real(exec) }
    }
    // Graph memory nodes: what a graph allocates is followed from its
    // making to its executable graphs, reserved before a launch and
    // settled after it and after a trim (see `graphmem`).
    cuGraphAddMemAllocNode ["cuGraphAddMemAllocNode", 11040, false]
    (node: *mut Ptr, graph: Ptr, deps: *const Ptr, n: usize, params: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(node, graph, deps, n, params) };
        graphmem::alloc_node(graph, params, r);
        r
    }
    cuGraphInstantiateWithFlags ["cuGraphInstantiateWithFlags", 11040, false]
    (exec: *mut Ptr, graph: Ptr, flags: u64) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(exec, graph, flags) };
        graphmem::instantiated(exec, graph, r);
        r
    }
    cuGraphInstantiateWithParams ["cuGraphInstantiateWithParams", 12000, false]
    (exec: *mut Ptr, graph: Ptr, params: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(exec, graph, params) };
        graphmem::instantiated(exec, graph, r);
        r
    }
    cuGraphInstantiateWithParams_ptsz ["cuGraphInstantiateWithParams", 12000, true]
    (exec: *mut Ptr, graph: Ptr, params: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(exec, graph, params) };
        graphmem::instantiated(exec, graph, r);
        r
    }
    cuGraphDestroy ["cuGraphDestroy", 10000, false]
    (graph: Ptr) => |real| {
        graphmem::forget(graph);
        // SAFETY: the program's argument, passed on unchanged.
        unsafe { real(graph) }
    }
    cuDeviceGraphMemTrim ["cuDeviceGraphMemTrim", 11040, false]
    (dev: i32) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(dev) };
        if r == CUDA_SUCCESS && dev >= 0 {
            graphmem::settle(dev as u32);
        }
        r
    }

    // Contexts: a token's end waits for the work of every context the
    // process has on the device (a context synchronises only its own).
    cuCtxCreate_v2 ["cuCtxCreate", 3020, false]
    (pctx: *mut Ptr, flags: u32, dev: i32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(pctx, flags, dev) };
        if r == CUDA_SUCCESS {
            gate::context_made(ptr_read(pctx), dev);
        }
        r
    }
    cuCtxCreate_v3 ["cuCtxCreate", 11040, false]
    (pctx: *mut Ptr, params: Ptr, n: i32, flags: u32, dev: i32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(pctx, params, n, flags, dev) };
        if r == CUDA_SUCCESS {
            gate::context_made(ptr_read(pctx), dev);
        }
        r
    }
    cuCtxCreate_v4 ["cuCtxCreate", 12050, false]
    (pctx: *mut Ptr, params: Ptr, flags: u32, dev: i32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(pctx, params, flags, dev) };
        if r == CUDA_SUCCESS {
            gate::context_made(ptr_read(pctx), dev);
        }
        r
    }
    cuDevicePrimaryCtxRetain ["cuDevicePrimaryCtxRetain", 7000, false]
    (pctx: *mut Ptr, dev: i32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(pctx, dev) };
        if r == CUDA_SUCCESS {
            gate::context_made(ptr_read(pctx), dev);
        }
        r
    }
    cuCtxDestroy_v2 ["cuCtxDestroy", 4000, false]
    (ctx: Ptr) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(ctx) };
        if r == CUDA_SUCCESS {
            gate::context_gone(ctx);
            graphs::context_gone(ctx);
        }
        r
    }

    // Stream capture: tracked so that the hook never synchronises while a
    // capture is open (see `capture`).
    cuStreamBeginCapture ["cuStreamBeginCapture", 10000, false]
    (s: Ptr) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        capture::began(s, unsafe { real(s) })
    }
    cuStreamBeginCapture_ptsz ["cuStreamBeginCapture", 10000, true]
    (s: Ptr) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        capture::began(s, unsafe { real(s) })
    }
    cuStreamBeginCapture_v2 ["cuStreamBeginCapture", 10010, false]
    (s: Ptr, mode: u32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        capture::began(s, unsafe { real(s, mode) })
    }
    cuStreamBeginCapture_v2_ptsz ["cuStreamBeginCapture", 10010, true]
    (s: Ptr, mode: u32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        capture::began(s, unsafe { real(s, mode) })
    }
    cuStreamBeginCaptureToGraph ["cuStreamBeginCaptureToGraph", 12030, false]
    (s: Ptr, graph: Ptr, deps: *const Ptr, edges: *const c_void, n: usize, mode: u32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        capture::began(s, unsafe { real(s, graph, deps, edges, n, mode) })
    }
    cuStreamBeginCaptureToGraph_ptsz ["cuStreamBeginCaptureToGraph", 12030, true]
    (s: Ptr, graph: Ptr, deps: *const Ptr, edges: *const c_void, n: usize, mode: u32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        capture::began(s, unsafe { real(s, graph, deps, edges, n, mode) })
    }
    cuStreamEndCapture ["cuStreamEndCapture", 10000, false]
    (s: Ptr, graph: *mut Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = capture::ended(s, false, unsafe { real(s, graph) });
        graphmem::capture_ended(s, graph, r);
        r
    }
    cuStreamEndCapture_ptsz ["cuStreamEndCapture", 10000, true]
    (s: Ptr, graph: *mut Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = capture::ended(s, true, unsafe { real(s, graph) });
        graphmem::capture_ended(s, graph, r);
        r
    }

    // Waiting for (or polling) the device's work: not idle.
    cuCtxSynchronize ["cuCtxSynchronize", 2000, false]
    () => |real| { trims!(real()) }
    cuStreamSynchronize ["cuStreamSynchronize", 2000, false]
    (s: Ptr) => |real| { trims!(real(s)) }
    cuStreamSynchronize_ptsz ["cuStreamSynchronize", 7000, true]
    (s: Ptr) => |real| { trims!(real(s)) }
    cuStreamQuery ["cuStreamQuery", 2000, false]
    (s: Ptr) => |real| { syncs!(real(s)) }
    cuStreamQuery_ptsz ["cuStreamQuery", 7000, true]
    (s: Ptr) => |real| { syncs!(real(s)) }
    cuStreamWaitEvent ["cuStreamWaitEvent", 3020, false]
    (s: Ptr, e: Ptr, flags: u32) => |real| { waits!(real(s, e, flags)) }
    cuStreamWaitEvent_ptsz ["cuStreamWaitEvent", 7000, true]
    (s: Ptr, e: Ptr, flags: u32) => |real| { waits!(real(s, e, flags)) }
    cuEventSynchronize ["cuEventSynchronize", 2000, false]
    (e: Ptr) => |real| { trims!(real(e)) }
    cuEventQuery ["cuEventQuery", 2000, false]
    (e: Ptr) => |real| { syncs!(real(e)) }
    cuMemcpy ["cuMemcpy", 4000, false]
    (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpy_ptds ["cuMemcpy", 7000, true]
    (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpyHtoD_v2 ["cuMemcpyHtoD", 3020, false]
    (dst: CUdeviceptr, src: *const c_void, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpyHtoD_v2_ptds ["cuMemcpyHtoD", 7000, true]
    (dst: CUdeviceptr, src: *const c_void, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpyDtoH_v2 ["cuMemcpyDtoH", 3020, false]
    (dst: Ptr, src: CUdeviceptr, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpyDtoH_v2_ptds ["cuMemcpyDtoH", 7000, true]
    (dst: Ptr, src: CUdeviceptr, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpyDtoD_v2 ["cuMemcpyDtoD", 3020, false]
    (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |real| { trims!(real(dst, src, n)) }
    cuMemcpyDtoD_v2_ptds ["cuMemcpyDtoD", 7000, true]
    (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |real| { trims!(real(dst, src, n)) }

    // Allocations and frees.
    cuMemAlloc_v2 ["cuMemAlloc", 3020, false]
    (dptr: *mut CUdeviceptr, bytes: usize) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc(bytes as u64, || (unsafe { real(dptr, bytes) }, ptr_key(dptr)))
    }
    cuMemAllocPitch_v2 ["cuMemAllocPitch", 3020, false]
    (dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: u32) => |real| {
        // The real pitch is known only afterwards: reserve the width
        // rounded up to the driver's 512-byte pitch alignment.
        let bytes = (width.div_ceil(512) * 512) as u64 * height as u64;
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc(bytes, || (unsafe { real(dptr, pitch, width, height, elem) }, ptr_key(dptr)))
    }
    cuMemAllocManaged ["cuMemAllocManaged", 6000, false]
    (dptr: *mut CUdeviceptr, bytes: usize, flags: u32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc(bytes as u64, || (unsafe { real(dptr, bytes, flags) }, ptr_key(dptr)))
    }
    // Stream-ordered: charged what the pool holds (see `memory`).
    cuMemAllocAsync ["cuMemAllocAsync", 11020, false]
    (dptr: *mut CUdeviceptr, bytes: usize, s: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        graphmem::stream_alloc(None, s, false, bytes as u64, || (unsafe { real(dptr, bytes, s) }, ptr_key(dptr)))
    }
    cuMemAllocAsync_ptsz ["cuMemAllocAsync", 11020, true]
    (dptr: *mut CUdeviceptr, bytes: usize, s: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        graphmem::stream_alloc(None, s, true, bytes as u64, || (unsafe { real(dptr, bytes, s) }, ptr_key(dptr)))
    }
    cuMemAllocFromPoolAsync ["cuMemAllocFromPoolAsync", 11020, false]
    (dptr: *mut CUdeviceptr, bytes: usize, pool: Ptr, s: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        graphmem::stream_alloc(Some(pool), s, false, bytes as u64, || (unsafe { real(dptr, bytes, pool, s) }, ptr_key(dptr)))
    }
    cuMemAllocFromPoolAsync_ptsz ["cuMemAllocFromPoolAsync", 11020, true]
    (dptr: *mut CUdeviceptr, bytes: usize, pool: Ptr, s: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        graphmem::stream_alloc(Some(pool), s, true, bytes as u64, || (unsafe { real(dptr, bytes, pool, s) }, ptr_key(dptr)))
    }
    cuMemPoolTrimTo ["cuMemPoolTrimTo", 11020, false]
    (pool: Ptr, keep: usize) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(pool, keep) };
        memory::settle_pools();
        r
    }
    cuMemPoolDestroy ["cuMemPoolDestroy", 11020, false]
    (pool: Ptr) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(pool) };
        if r == CUDA_SUCCESS {
            memory::pool_destroyed(pool);
        }
        r
    }
    cuMemCreate ["cuMemCreate", 10020, false]
    (handle: *mut u64, bytes: usize, prop: *const [i32; 4], flags: u64) => |real| {
        // CUmemAllocationProp: type, handle types, location type, location id.
        // SAFETY: the caller passes a valid property struct.
        let dev = (!prop.is_null()).then(|| unsafe { (*prop)[3] }).filter(|d| *d >= 0).map(|d| d as u32);
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc_on(dev, bytes as u64, || (unsafe { real(handle, bytes, prop, flags) }, ptr_key(handle)))
    }
    // CUDA arrays (textures, surfaces): charged by their descriptor.
    cuArrayCreate_v2 ["cuArrayCreate", 3020, false]
    (out: *mut usize, desc: *const [usize; 3]) => |real| {
        // CUDA_ARRAY_DESCRIPTOR: width, height, format and channels (u32 each).
        // SAFETY: read only when non-null; the program's descriptor.
        let bytes = (!desc.is_null()).then(|| unsafe { *desc }).map_or(0, |d| {
            memory::array_bytes([d[0], d[1], 0], d[2] as u32, (d[2] >> 32) as u32, 1)
        });
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc(bytes, || (unsafe { real(out, desc) }, array_key(out)))
    }
    cuArray3DCreate_v2 ["cuArray3DCreate", 3020, false]
    (out: *mut usize, desc: *const [usize; 4]) => |real| {
        // CUDA_ARRAY3D_DESCRIPTOR: width, height, depth, format and channels.
        // SAFETY: read only when non-null; the program's descriptor.
        let bytes = (!desc.is_null()).then(|| unsafe { *desc }).map_or(0, |d| {
            memory::array_bytes([d[0], d[1], d[2]], d[3] as u32, (d[3] >> 32) as u32, 1)
        });
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc(bytes, || (unsafe { real(out, desc) }, array_key(out)))
    }
    cuMipmappedArrayCreate ["cuMipmappedArrayCreate", 5000, false]
    (out: *mut usize, desc: *const [usize; 4], levels: u32) => |real| {
        // SAFETY: read only when non-null; the program's descriptor.
        let bytes = (!desc.is_null()).then(|| unsafe { *desc }).map_or(0, |d| {
            memory::array_bytes([d[0], d[1], d[2]], d[3] as u32, (d[3] >> 32) as u32, levels)
        });
        // SAFETY: the program's arguments, passed on unchanged.
        guarded_alloc(bytes, || (unsafe { real(out, desc, levels) }, array_key(out)))
    }
    cuArrayDestroy ["cuArrayDestroy", 2000, false]
    (a: usize) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(a) };
        if r == CUDA_SUCCESS {
            memory::release(a as u64);
        }
        r
    }
    cuMipmappedArrayDestroy ["cuMipmappedArrayDestroy", 5000, false]
    (a: usize) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(a) };
        if r == CUDA_SUCCESS {
            memory::release(a as u64);
        }
        r
    }
    cuMemFree_v2 ["cuMemFree", 3020, false]
    (ptr: CUdeviceptr) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(ptr) };
        if r == CUDA_SUCCESS {
            memory::release(ptr);
        }
        r
    }
    cuMemFreeAsync ["cuMemFreeAsync", 11020, false]
    (ptr: CUdeviceptr, s: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(ptr, s) };
        if r == CUDA_SUCCESS {
            memory::release(ptr);
        }
        r
    }
    cuMemFreeAsync_ptsz ["cuMemFreeAsync", 11020, true]
    (ptr: CUdeviceptr, s: Ptr) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(ptr, s) };
        if r == CUDA_SUCCESS {
            memory::release(ptr);
        }
        r
    }
    cuMemRelease ["cuMemRelease", 10020, false]
    (handle: u64) => |real| {
        // SAFETY: the program's argument, passed on unchanged.
        let r = unsafe { real(handle) };
        if r == CUDA_SUCCESS {
            memory::release(handle);
        }
        r
    }

    // Memory queries: the group's view.
    cuMemGetInfo_v2 ["cuMemGetInfo", 3020, false]
    (free: *mut usize, total: *mut usize) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(free, total) };
        if r == CUDA_SUCCESS && !free.is_null() && !total.is_null()
            && let Some(dev) = memory::current_ordinal()
            && let Some((used, limit, reclaimable)) = memory::view(dev)
        {
            // SAFETY: filled by the real call just now.
            let (f, t) = unsafe { memory::group_view(*free as u64, *total as u64, used, limit, reclaimable) };
            // SAFETY: the caller's out-pointers.
            unsafe {
                *free = f as usize;
                *total = t as usize;
            }
        }
        r
    }
    cuMemGetInfo ["cuMemGetInfo", 2000, false]
    (free: *mut u32, total: *mut u32) => |real| {
        let (mut f, mut t) = (0usize, 0usize);
        // SAFETY: the 64-bit query into locals; the 32-bit one as asked.
        let r = unsafe { driver::mem_get_info(&mut f, &mut t) };
        if r != CUDA_SUCCESS {
            // SAFETY: the program's arguments, passed on unchanged.
            return unsafe { real(free, total) };
        }
        let (mut f, mut t) = (f as u64, t as u64);
        if let Some(dev) = memory::current_ordinal()
            && let Some((used, limit, reclaimable)) = memory::view(dev)
        {
            (f, t) = memory::group_view(f, t, used, limit, reclaimable);
        }
        if free.is_null() || total.is_null() {
            return CUDA_ERROR_INVALID_VALUE;
        }
        // SAFETY: the caller's non-null out-pointers.
        unsafe {
            *free = f.min(u32::MAX as u64) as u32;
            *total = t.min(u32::MAX as u64) as u32;
        }
        0
    }
    cuDeviceTotalMem_v2 ["cuDeviceTotalMem", 3020, false]
    (bytes: *mut usize, dev: i32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(bytes, dev) };
        if r == CUDA_SUCCESS && !bytes.is_null() && dev >= 0
            && let Some((_, limit, _)) = memory::view(dev as u32)
        {
            // SAFETY: filled by the real call just now.
            unsafe { *bytes = (*bytes as u64).min(limit) as usize };
        }
        r
    }
    cuDeviceTotalMem ["cuDeviceTotalMem", 2000, false]
    (bytes: *mut u32, dev: i32) => |real| {
        let mut b = 0usize;
        // SAFETY: the 64-bit query into a local.
        if unsafe { driver::device_total_mem(&mut b, dev) } != 0 || bytes.is_null() || dev < 0 {
            // SAFETY: the program's arguments, passed on unchanged.
            return unsafe { real(bytes, dev) };
        }
        let limit = memory::view(dev as u32).map_or(u64::MAX, |(_, l, _)| l);
        // SAFETY: the caller's non-null out-pointer.
        unsafe { *bytes = (b as u64).min(limit).min(u32::MAX as u64) as u32 };
        0
    }

    // Entry points: answer with ours.
    cuGetProcAddress ["cuGetProcAddress", 11030, false]
    (symbol: *const c_char, pfn: *mut Ptr, version: i32, flags: u64) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(symbol, pfn, version, flags) };
        proc_address(symbol, pfn, version, flags, r)
    }
    cuGetProcAddress_v2 ["cuGetProcAddress", 12000, false]
    (symbol: *const c_char, pfn: *mut Ptr, version: i32, flags: u64, status: *mut i32) => |real| {
        // SAFETY: the program's arguments, passed on unchanged.
        let r = unsafe { real(symbol, pfn, version, flags, status) };
        proc_address(symbol, pfn, version, flags, r)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_entry_is_exported_and_found_by_name() {
        for e in ENTRIES {
            assert!(lookup(e.symbol.as_bytes()).is_some(), "{}", e.symbol);
            assert!(e.symbol.starts_with(e.base), "{} / {}", e.symbol, e.base);
        }
        assert!(lookup(b"cuInit").is_none());
        assert!(lookup(b"malloc").is_none());
    }

    #[test]
    fn proc_address_follows_version_and_per_thread_flag() {
        let sym = |base, v, f| resolve(base, v, f).map(|e| e.symbol);
        assert_eq!(sym("cuMemAlloc", 12000, 0), Some("cuMemAlloc_v2"));
        assert_eq!(
            sym("cuMemAlloc", 3010, 0),
            None,
            "the 32-bit v1 is not hooked"
        );
        assert_eq!(sym("cuLaunchKernel", 12000, 0), Some("cuLaunchKernel"));
        assert_eq!(sym("cuLaunchKernel", 12000, 2), Some("cuLaunchKernel_ptsz"));
        assert_eq!(
            sym("cuLaunchKernel", 12000, 1),
            Some("cuLaunchKernel"),
            "legacy-stream flag"
        );
        assert_eq!(sym("cuGraphLaunch", 12000, 2), Some("cuGraphLaunch_ptsz"));
        assert_eq!(
            sym("cuMemAllocAsync", 12000, 2),
            Some("cuMemAllocAsync_ptsz")
        );
        assert_eq!(sym("cuMemGetInfo", 12000, 0), Some("cuMemGetInfo_v2"));
        assert_eq!(sym("cuMemGetInfo", 3000, 0), Some("cuMemGetInfo"));
        assert_eq!(
            sym("cuGetProcAddress", 12000, 0),
            Some("cuGetProcAddress_v2")
        );
        assert_eq!(sym("cuGetProcAddress", 11040, 0), Some("cuGetProcAddress"));
        assert_eq!(sym("cuInit", 12000, 0), None);
        // Waits: per-thread variants where the driver has them.
        assert_eq!(sym("cuMemcpyDtoH", 12000, 2), Some("cuMemcpyDtoH_v2_ptds"));
        assert_eq!(sym("cuMemcpyDtoH", 12000, 0), Some("cuMemcpyDtoH_v2"));
        assert_eq!(sym("cuMemcpyDtoH", 3010, 0), None, "the 32-bit v1");
        assert_eq!(
            sym("cuStreamSynchronize", 12000, 2),
            Some("cuStreamSynchronize_ptsz")
        );
        assert_eq!(
            sym("cuEventSynchronize", 12000, 2),
            Some("cuEventSynchronize")
        );
        assert_eq!(sym("cuCtxSynchronize", 12000, 0), Some("cuCtxSynchronize"));
        // A function with no per-thread variant keeps its default one.
        assert_eq!(sym("cuMemAlloc", 12000, 2), Some("cuMemAlloc_v2"));
    }
}
