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
use crate::covers::{self, Covers};
use crate::cuda::{
    CUDA_ERROR_INVALID_VALUE, CUDA_ERROR_NOT_FOUND, CUDA_ERROR_UNKNOWN, CUDA_SUCCESS, CUresult,
};
use crate::driver;
use crate::gate;
use crate::graphmem;
use crate::graphs;
use crate::held;
use crate::memory::{self, guarded_alloc, guarded_alloc_on};
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicUsize;

type Ptr = *mut c_void;
type CUdeviceptr = u64;

/// `cuGetProcAddress` flag for per-thread default stream variants.
const PER_THREAD: u64 = 2;

/// What an entry point does, for the coverage checks (`cuda_header`
/// test): every launch, allocation, free and memory query of `cuda.h`
/// must have a line of its kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Queues device work: gated by the token.
    Launch,
    /// Takes device memory: reserved against the group's `MemoryLimit`.
    Alloc,
    /// Gives device memory back.
    Free,
    /// Answers how much memory there is: the group's view.
    Query,
    /// Waits for (or polls) device work: the process is not idle.
    Sync,
    /// Makes or destroys a context, or changes the memory it keeps.
    Context,
    /// Loads or unloads code (modules, libraries): the driver keeps
    /// device memory for it.
    Module,
    /// Follows where memory is without taking or giving any (mappings of
    /// `cuMemCreate` handles, a pool's location).
    Track,
    /// Begins or ends a stream capture.
    Capture,
    /// Makes or destroys a graph.
    Graph,
    /// Resolves entry points (`cuGetProcAddress`).
    Entry,
    /// Records or destroys an event: what its completion proves done.
    Event,
}

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
    /// What it does (read by the tests, and by the header check, which
    /// parses this file).
    #[cfg_attr(not(test), allow(dead_code))]
    pub kind: Kind,
}

/// One line per entry point: `symbol [base, since, per_thread, kind]
/// (C parameters) => |call| what the hook does`, where `call()` calls the
/// real function with the program's own arguments.
macro_rules! hooks {
    ($(
        $name:ident [$base:literal, $since:literal, $pt:literal, $kind:ident]
        ($($arg:ident : $ty:ty),* $(,)?) => |$call:ident| $body:expr;
    )*) => {
        $(
            #[cfg_attr(not(test), unsafe(no_mangle))]
            #[allow(non_snake_case, clippy::missing_safety_doc, unused_variables)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                static SLOT: AtomicUsize = AtomicUsize::new(0);
                type Real = unsafe extern "C" fn($($ty),*) -> CUresult;
                const NAME: &CStr = match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                    Ok(c) => c,
                    Err(_) => panic!("symbol names have no NUL"),
                };
                const BASE: &CStr = match CStr::from_bytes_with_nul(concat!($base, "\0").as_bytes()) {
                    Ok(c) => c,
                    Err(_) => panic!("base names have no NUL"),
                };
                // The function the driver hands out for this line's base
                // name, version and flag: the ABI this wrapper has.
                // SAFETY: Real is the C signature of this driver function.
                let Some(real) = (unsafe {
                    driver::resolve_entry::<Real>(&SLOT, NAME, BASE, $since, if $pt { PER_THREAD } else { 0 })
                }) else {
                    return CUDA_ERROR_NOT_FOUND;
                };
                let $call = move || {
                    // SAFETY: the program's own arguments, passed on
                    // unchanged to the real function of the same signature.
                    unsafe { real($($arg),*) }
                };
                catch_unwind(AssertUnwindSafe(move || -> CUresult { $body })).unwrap_or(CUDA_ERROR_UNKNOWN)
            }
        )*

        /// Every line of the table.
        pub const ENTRIES: &[Entry] = &[
            $( Entry { symbol: stringify!($name), base: $base, since: $since, per_thread: $pt, kind: Kind::$kind }, )*
        ];

        /// Our function for the exported symbol `name`. Allocates nothing
        /// and takes no lock: called from our `dlsym`.
        pub fn lookup(name: &[u8]) -> Option<Ptr> {
            $( if name == stringify!($name).as_bytes() { return Some($name as *const () as Ptr); } )*
            None
        }
    };
}

/// `call`, a launch onto stream `s` (`pt`: a per-thread-default-stream
/// entry point), if the gate admits this process to the device.
fn gated(s: Ptr, pt: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    match gate::admit_on(s, pt) {
        Ok(_in_call) => call(),
        Err(e) => e,
    }
}

/// `CUDA_LAUNCH_PARAMS`, one device's part of a
/// `cuLaunchCooperativeKernelMultiDevice`.
#[repr(C)]
pub struct LaunchParams {
    function: Ptr,
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: Ptr,
    params: *mut Ptr,
}

/// The streams of the `n` entries of a multi-device launch (none where
/// the list is null: the driver refuses it).
fn launch_streams(list: *mut LaunchParams, n: u32) -> Vec<Ptr> {
    if list.is_null() {
        return Vec::new();
    }
    // SAFETY: non-null, and the program passes `n` entries by contract
    // (the driver reads the same).
    let entries = unsafe { std::slice::from_raw_parts(list, n as usize) };
    entries.iter().map(|e| e.stream).collect()
}

/// `call`, which waits for (or polls) the process's device work: while it
/// runs the process is busy, not idle (see [`gate`]).
fn waits(call: impl FnOnce() -> CUresult) -> CUresult {
    let _waiting = gate::waiting(false, Covers::Context);
    call()
}

/// Like [`waits`], for a call whose success means the work before it is
/// done (a synchronisation, a blocking copy, a query answering
/// `CUDA_SUCCESS`): the gate learns from it how long launches take.
/// `blocks`: the call blocks until the work is done; `covers`: what it
/// proves done.
fn synced(blocks: bool, covers: Covers, call: impl FnOnce() -> CUresult) -> CUresult {
    synced_on(blocks, covers, None, call)
}

/// [`synced`] for the work of context `ctx` (`None`: the current one).
fn synced_on(
    blocks: bool,
    covers: Covers,
    ctx: Option<Ptr>,
    call: impl FnOnce() -> CUresult,
) -> CUresult {
    let mut waiting = gate::waiting_on(blocks, covers, ctx);
    let r = call();
    if r == CUDA_SUCCESS {
        waiting.finished();
    }
    r
}

/// [`synced`], for a query (`cuStreamQuery`, `cuEventQuery`).
fn syncs(covers: Covers, call: impl FnOnce() -> CUresult) -> CUresult {
    synced(false, covers, call)
}

/// [`synced`], for a call that blocks until the work is done (a
/// synchronisation, a blocking copy): the driver trims memory pools
/// there, so the group's pool memory is settled afterwards.
fn trims(covers: Covers, call: impl FnOnce() -> CUresult) -> CUresult {
    let r = synced(true, covers, call);
    memory::settle_pools();
    r
}

/// [`trims`] for `cuCtxSynchronize_v2(ctx)`: the work of every stream of
/// `ctx` (null: the current context), on its device.
fn trims_ctx(ctx: Ptr, call: impl FnOnce() -> CUresult) -> CUresult {
    let r = synced_on(true, Covers::Context, Some(ctx), call);
    memory::settle_pools();
    r
}

/// `r`, after `then` ran if it is `CUDA_SUCCESS`.
fn on_success(r: CUresult, then: impl FnOnce()) -> CUresult {
    if r == CUDA_SUCCESS {
        then();
    }
    r
}

/// `r`, after `then(r)` ran.
fn after(r: CUresult, then: impl FnOnce(CUresult)) -> CUresult {
    then(r);
    r
}

/// `cuGraphLaunch[_ptsz]` by `call`: gated by the graph's predicted cost
/// and timed with events (see `graphs`); a launch into a capturing stream
/// passes ungated and untimed.
fn graph_launch(exec: Ptr, s: Ptr, pt: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    let captured = capture::captured(s, pt);
    match gate::admit_graph(exec, s, pt) {
        Ok(_in_call) => graphs::launch(exec, s, pt, || {
            if captured {
                call()
            } else {
                graphmem::launch(exec, call)
            }
        }),
        Err(e) => e,
    }
}

/// What `cuMemAllocPitch` of `width` × `height` takes: the real pitch is
/// known only afterwards, so the width rounded up to the driver's 512-byte
/// pitch alignment.
fn pitched_bytes(width: usize, height: usize) -> u64 {
    (width.div_ceil(512) * 512) as u64 * height as u64
}

/// The device a `cuMemCreate` property or `cuMemPoolCreate` props name
/// (`CUmemAllocationProp`, `CUmemPoolProps`: type, handle types,
/// location type, location id); `None` for host memory.
fn prop_device(prop: *const [i32; 4]) -> Option<u32> {
    // SAFETY: read only when non-null; the program's property struct.
    let p = (!prop.is_null()).then(|| unsafe { *prop })?;
    memory::location_device(p[2], p[3])
}

/// A context went: no token's end waits for it, and the graphs' timing
/// events made in it are dropped.
fn context_gone(ctx: Ptr) {
    gate::context_gone(ctx);
    graphs::context_gone(ctx);
}

/// Takes back a module the group may not have.
fn unload_module(m: Ptr) {
    let _ = driver::module_unload(m);
}

/// Takes back a library the group may not have.
fn unload_library(l: Ptr) {
    let _ = driver::library_unload(l);
}

/// `cuMemPoolCreate` made `*pool` from `props`.
fn pool_made(pool: *mut Ptr, props: *const [i32; 4]) {
    if !props.is_null() {
        // SAFETY: the program's props, which the driver just accepted.
        let p = unsafe { *props };
        memory::pool_made(ptr_read(pool), p[2], p[3]);
    }
}

/// The bytes of a `CUDA_ARRAY_DESCRIPTOR`: width, height, format and
/// channels (u32 each).
fn array_bytes(desc: *const [usize; 3]) -> u64 {
    // SAFETY: read only when non-null; the program's descriptor.
    let d = (!desc.is_null()).then(|| unsafe { *desc });
    d.map_or(0, |d| {
        memory::array_bytes([d[0], d[1], 0], d[2] as u32, (d[2] >> 32) as u32, 1)
    })
}

/// The bytes of a `CUDA_ARRAY3D_DESCRIPTOR` (width, height, depth, format
/// and channels) with `levels` mipmap levels.
fn array3d_bytes(desc: *const [usize; 4], levels: u32) -> u64 {
    // SAFETY: read only when non-null; the program's descriptor.
    let d = (!desc.is_null()).then(|| unsafe { *desc });
    d.map_or(0, |d| {
        memory::array_bytes([d[0], d[1], d[2]], d[3] as u32, (d[3] >> 32) as u32, levels)
    })
}

/// The driver's (free, total) of the current context's device in the
/// group's view; as they are where the scheduler gives none.
fn current_view(free: u64, total: u64) -> (u64, u64) {
    match memory::current_ordinal().and_then(memory::view) {
        Some((used, limit, reclaimable)) => {
            memory::group_view(free, total, used, limit, reclaimable)
        }
        None => (free, total),
    }
}

/// `cuMemGetInfo_v2`'s answer `r`, turned into the group's view.
fn mem_get_info(r: CUresult, free: *mut usize, total: *mut usize) -> CUresult {
    if r == CUDA_SUCCESS && !free.is_null() && !total.is_null() {
        // SAFETY: the caller's non-null out-pointers, filled by the real
        // call just now.
        unsafe {
            let (f, t) = current_view(*free as u64, *total as u64);
            *free = f as usize;
            *total = t as usize;
        }
    }
    r
}

/// The 32-bit `cuMemGetInfo` in the group's view: asked of the 64-bit one
/// (`call` only where that fails).
fn mem_get_info_32(call: impl FnOnce() -> CUresult, free: *mut u32, total: *mut u32) -> CUresult {
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: out-pointers to locals.
    if unsafe { driver::mem_get_info(&mut f, &mut t) } != CUDA_SUCCESS {
        return call();
    }
    let (f, t) = current_view(f as u64, t as u64);
    if free.is_null() || total.is_null() {
        return CUDA_ERROR_INVALID_VALUE;
    }
    // SAFETY: the caller's non-null out-pointers.
    unsafe {
        *free = f.min(u32::MAX as u64) as u32;
        *total = t.min(u32::MAX as u64) as u32;
    }
    CUDA_SUCCESS
}

/// `cuDeviceTotalMem_v2`'s answer `r`, at most the group's limit.
fn total_mem(r: CUresult, bytes: *mut usize, dev: i32) -> CUresult {
    if r == CUDA_SUCCESS
        && !bytes.is_null()
        && dev >= 0
        && let Some((_, limit, _)) = memory::view(dev as u32)
    {
        // SAFETY: the caller's non-null out-pointer, filled by the real
        // call just now.
        unsafe { *bytes = (*bytes as u64).min(limit) as usize };
    }
    r
}

/// The 32-bit `cuDeviceTotalMem`, at most the group's limit: asked of the
/// 64-bit one (`call` only where that fails).
fn total_mem_32(call: impl FnOnce() -> CUresult, bytes: *mut u32, dev: i32) -> CUresult {
    let mut b = 0usize;
    // SAFETY: an out-pointer to a local.
    if unsafe { driver::device_total_mem(&mut b, dev) } != CUDA_SUCCESS
        || bytes.is_null()
        || dev < 0
    {
        return call();
    }
    let limit = memory::view(dev as u32).map_or(u64::MAX, |(_, l, _)| l);
    // SAFETY: the caller's non-null out-pointer.
    unsafe { *bytes = (b as u64).min(limit).min(u32::MAX as u64) as u32 };
    CUDA_SUCCESS
}

/// Base names that the driver maps, from a version on, to another entry
/// point's base (`cudaTypedefs.h`): `cuGraphInstantiate` at 12000 is the
/// 3-argument `cuGraphInstantiateWithFlags`, not `cuGraphInstantiate_v2`.
const RENAMED: &[(&str, i32, &str)] =
    &[("cuGraphInstantiate", 12000, "cuGraphInstantiateWithFlags")];

/// The symbol `cuGetProcAddress(base, version, flags)` stands for, when it
/// is one of ours.
pub fn resolve(base: &str, version: i32, flags: u64) -> Option<&'static Entry> {
    let base = RENAMED
        .iter()
        .find(|(from, since, _)| *from == base && version >= *since)
        .map_or(base, |(_, _, to)| to);
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
    // Launches, gated on the stream they go to.
    cuLaunchKernel ["cuLaunchKernel", 4000, false, Launch] (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr, e: *mut Ptr) => |call| gated(s, false, call);
    cuLaunchKernel_ptsz ["cuLaunchKernel", 7000, true, Launch] (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr, e: *mut Ptr) => |call| gated(s, true, call);
    cuLaunchKernelEx ["cuLaunchKernelEx", 11060, false, Launch] (config: Ptr, f: Ptr, p: *mut Ptr, e: *mut Ptr) => |call| gated(capture::config_stream(config), false, call);
    cuLaunchKernelEx_ptsz ["cuLaunchKernelEx", 11060, true, Launch] (config: Ptr, f: Ptr, p: *mut Ptr, e: *mut Ptr) => |call| gated(capture::config_stream(config), true, call);
    cuLaunchCooperativeKernel ["cuLaunchCooperativeKernel", 9000, false, Launch] (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr) => |call| gated(s, false, call);
    cuLaunchCooperativeKernelMultiDevice ["cuLaunchCooperativeKernelMultiDevice", 9000, false, Launch] (list: *mut LaunchParams, n: u32, flags: u32) => |call| match gate::admit_streams(launch_streams(list, n)) { Ok(_in_calls) => call(), Err(e) => e };
    cuLaunchCooperativeKernel_ptsz ["cuLaunchCooperativeKernel", 9000, true, Launch] (f: Ptr, gx: u32, gy: u32, gz: u32, bx: u32, by: u32, bz: u32, sh: u32, s: Ptr, p: *mut Ptr) => |call| gated(s, true, call);
    // The launches of CUDA 2.0, deprecated but in cuda.h: on the legacy
    // default stream, or the one given.
    cuLaunch ["cuLaunch", 2000, false, Launch] (f: Ptr) => |call| gated(std::ptr::null_mut(), false, call);
    cuLaunchGrid ["cuLaunchGrid", 2000, false, Launch] (f: Ptr, w: i32, h: i32) => |call| gated(std::ptr::null_mut(), false, call);
    cuLaunchGridAsync ["cuLaunchGridAsync", 2000, false, Launch] (f: Ptr, w: i32, h: i32, s: Ptr) => |call| gated(s, false, call);
    // A graph launch is gated as the device time its last runs took, and
    // timed with events (see `graphs`).
    cuGraphLaunch ["cuGraphLaunch", 10000, false, Launch] (exec: Ptr, s: Ptr) => |call| graph_launch(exec, s, false, call);
    cuGraphLaunch_ptsz ["cuGraphLaunch", 10000, true, Launch] (exec: Ptr, s: Ptr) => |call| graph_launch(exec, s, true, call);

    // Graphs and their memory nodes: what a graph allocates is followed
    // from its making to its executable graphs, reserved before a launch
    // and settled after it and after a trim (see `graphmem`).
    cuGraphExecDestroy ["cuGraphExecDestroy", 10000, false, Graph] (exec: Ptr) => |call| { graphs::forget(exec); graphmem::forget(exec); call() };
    cuGraphAddMemAllocNode ["cuGraphAddMemAllocNode", 11040, false, Graph] (node: *mut Ptr, graph: Ptr, deps: *const Ptr, n: usize, params: Ptr) => |call| after(call(), |r| graphmem::alloc_node(graph, params, r));
    cuGraphInstantiateWithFlags ["cuGraphInstantiateWithFlags", 11040, false, Graph] (exec: *mut Ptr, graph: Ptr, flags: u64) => |call| after(call(), |r| graphmem::instantiated(exec, graph, r));
    cuGraphInstantiate ["cuGraphInstantiate", 10000, false, Graph] (exec: *mut Ptr, graph: Ptr, err: *mut Ptr, log: *mut c_char, size: usize) => |call| after(call(), |r| graphmem::instantiated(exec, graph, r));
    cuGraphInstantiate_v2 ["cuGraphInstantiate", 11000, false, Graph] (exec: *mut Ptr, graph: Ptr, err: *mut Ptr, log: *mut c_char, size: usize) => |call| after(call(), |r| graphmem::instantiated(exec, graph, r));
    cuGraphInstantiateWithParams ["cuGraphInstantiateWithParams", 12000, false, Graph] (exec: *mut Ptr, graph: Ptr, params: Ptr) => |call| after(call(), |r| graphmem::instantiated(exec, graph, r));
    cuGraphInstantiateWithParams_ptsz ["cuGraphInstantiateWithParams", 12000, true, Graph] (exec: *mut Ptr, graph: Ptr, params: Ptr) => |call| after(call(), |r| graphmem::instantiated(exec, graph, r));
    cuGraphDestroy ["cuGraphDestroy", 10000, false, Graph] (graph: Ptr) => |call| { graphmem::forget(graph); call() };
    cuDeviceGraphMemTrim ["cuDeviceGraphMemTrim", 11040, false, Free] (dev: i32) => |call| on_success(call(), || if dev >= 0 { graphmem::settle(dev as u32) });

    // Contexts: a token's end waits for the work of every context the
    // process has on the device (a context synchronises only its own).
    // What the driver keeps for a context, and for its limits, is charged
    // to the group (see `held`).
    cuCtxCreate_v2 ["cuCtxCreate", 3020, false, Context] (pctx: *mut Ptr, flags: u32, dev: i32) => |call| on_success(held::context(dev, false, call, || ptr_read(pctx)), || gate::context_made(ptr_read(pctx), dev));
    cuCtxCreate_v3 ["cuCtxCreate", 11040, false, Context] (pctx: *mut Ptr, params: Ptr, n: i32, flags: u32, dev: i32) => |call| on_success(held::context(dev, false, call, || ptr_read(pctx)), || gate::context_made(ptr_read(pctx), dev));
    cuCtxCreate_v4 ["cuCtxCreate", 12050, false, Context] (pctx: *mut Ptr, params: Ptr, flags: u32, dev: i32) => |call| on_success(held::context(dev, false, call, || ptr_read(pctx)), || gate::context_made(ptr_read(pctx), dev));
    cuDevicePrimaryCtxRetain ["cuDevicePrimaryCtxRetain", 7000, false, Context] (pctx: *mut Ptr, dev: i32) => |call| on_success(held::context(dev, true, call, || ptr_read(pctx)), || gate::context_made(ptr_read(pctx), dev));
    cuDevicePrimaryCtxRelease ["cuDevicePrimaryCtxRelease", 7000, false, Context] (dev: i32) => |call| gate::context_may_go(std::ptr::null_mut(), dev, || held::primary_gone(dev, false, call, context_gone));
    cuDevicePrimaryCtxRelease_v2 ["cuDevicePrimaryCtxRelease", 11000, false, Context] (dev: i32) => |call| gate::context_may_go(std::ptr::null_mut(), dev, || held::primary_gone(dev, false, call, context_gone));
    cuDevicePrimaryCtxReset ["cuDevicePrimaryCtxReset", 7000, false, Context] (dev: i32) => |call| gate::context_may_go(std::ptr::null_mut(), dev, || held::primary_gone(dev, true, call, context_gone));
    cuDevicePrimaryCtxReset_v2 ["cuDevicePrimaryCtxReset", 11000, false, Context] (dev: i32) => |call| gate::context_may_go(std::ptr::null_mut(), dev, || held::primary_gone(dev, true, call, context_gone));
    cuCtxDestroy_v2 ["cuCtxDestroy", 4000, false, Context] (ctx: Ptr) => |call| gate::context_may_go(ctx, -1, || on_success(held::context_destroyed(ctx, call), || context_gone(ctx)));
    // A green context's work is waited for at token ends through the
    // context it is used through (seen current at a grant): that context
    // goes with it, under its lock, and is forgotten.
    cuGreenCtxDestroy ["cuGreenCtxDestroy", 12040, false, Context] (green: Ptr) => |call| match driver::ctx_from_green(green) {
        Some(ctx) => gate::context_may_go(ctx, -1, || on_success(call(), || context_gone(ctx))),
        None => call(),
    };
    cuCtxSetLimit ["cuCtxSetLimit", 3010, false, Context] (limit: i32, value: usize) => |call| held::set_limit(limit, value, call);

    // Code: the driver keeps device memory for each module and library
    // (see `held`).
    cuModuleLoad ["cuModuleLoad", 2000, false, Module] (module: *mut Ptr, fname: *const c_char) => |call| held::code_loaded(module, std::ptr::null(), call, unload_module);
    cuModuleLoadData ["cuModuleLoadData", 2000, false, Module] (module: *mut Ptr, image: *const c_void) => |call| held::code_loaded(module, image, call, unload_module);
    cuModuleLoadDataEx ["cuModuleLoadDataEx", 2010, false, Module] (module: *mut Ptr, image: *const c_void, n: u32, options: *mut i32, values: *mut Ptr) => |call| held::code_loaded(module, image, call, unload_module);
    cuModuleLoadFatBinary ["cuModuleLoadFatBinary", 2000, false, Module] (module: *mut Ptr, fatbin: *const c_void) => |call| held::code_loaded(module, fatbin, call, unload_module);
    cuModuleUnload ["cuModuleUnload", 2000, false, Module] (module: Ptr) => |call| held::code_unloaded(module, call);
    cuLibraryLoadData ["cuLibraryLoadData", 12000, false, Module] (library: *mut Ptr, code: *const c_void, jit_options: *mut i32, jit_values: *mut Ptr, jit_n: u32, options: *mut i32, values: *mut Ptr, n: u32) => |call| held::code_loaded(library, code, call, unload_library);
    cuLibraryLoadFromFile ["cuLibraryLoadFromFile", 12000, false, Module] (library: *mut Ptr, fname: *const c_char, jit_options: *mut i32, jit_values: *mut Ptr, jit_n: u32, options: *mut i32, values: *mut Ptr, n: u32) => |call| held::code_loaded(library, std::ptr::null(), call, unload_library);
    cuLibraryUnload ["cuLibraryUnload", 12000, false, Module] (library: Ptr) => |call| held::code_unloaded(library, call);

    // Stream capture: tracked so that the hook never synchronises while a
    // capture is open (see `capture`).
    cuStreamBeginCapture ["cuStreamBeginCapture", 10000, false, Capture] (s: Ptr) => |call| capture::begin(s, false, call);
    cuStreamBeginCapture_ptsz ["cuStreamBeginCapture", 10000, true, Capture] (s: Ptr) => |call| capture::begin(s, true, call);
    cuStreamBeginCapture_v2 ["cuStreamBeginCapture", 10010, false, Capture] (s: Ptr, mode: u32) => |call| capture::begin(s, false, call);
    cuStreamBeginCapture_v2_ptsz ["cuStreamBeginCapture", 10010, true, Capture] (s: Ptr, mode: u32) => |call| capture::begin(s, true, call);
    cuStreamBeginCaptureToGraph ["cuStreamBeginCaptureToGraph", 12030, false, Capture] (s: Ptr, graph: Ptr, deps: *const Ptr, edges: *const c_void, n: usize, mode: u32) => |call| capture::begin(s, false, call);
    cuStreamBeginCaptureToGraph_ptsz ["cuStreamBeginCaptureToGraph", 12030, true, Capture] (s: Ptr, graph: Ptr, deps: *const Ptr, edges: *const c_void, n: usize, mode: u32) => |call| capture::begin(s, true, call);
    cuStreamEndCapture ["cuStreamEndCapture", 10000, false, Capture] (s: Ptr, graph: *mut Ptr) => |call| after(capture::ended(s, false, call()), |r| graphmem::capture_ended(s, false, graph, r));
    cuStreamEndCapture_ptsz ["cuStreamEndCapture", 10000, true, Capture] (s: Ptr, graph: *mut Ptr) => |call| after(capture::ended(s, true, call()), |r| graphmem::capture_ended(s, true, graph, r));

    // Waiting for (or polling) the device's work: not idle.
    cuCtxSynchronize ["cuCtxSynchronize", 2000, false, Sync] () => |call| trims(Covers::Context, call);
    cuCtxSynchronize_v2 ["cuCtxSynchronize", 13000, false, Sync] (ctx: Ptr) => |call| trims_ctx(ctx, call);
    cuStreamSynchronize ["cuStreamSynchronize", 2000, false, Sync] (s: Ptr) => |call| trims(Covers::stream(s, false), call);
    cuStreamSynchronize_ptsz ["cuStreamSynchronize", 7000, true, Sync] (s: Ptr) => |call| trims(Covers::stream(s, true), call);
    cuStreamQuery ["cuStreamQuery", 2000, false, Sync] (s: Ptr) => |call| syncs(Covers::stream(s, false), call);
    cuStreamQuery_ptsz ["cuStreamQuery", 7000, true, Sync] (s: Ptr) => |call| syncs(Covers::stream(s, true), call);
    cuStreamWaitEvent ["cuStreamWaitEvent", 3020, false, Sync] (s: Ptr, e: Ptr, flags: u32) => |call| waits(call);
    cuStreamWaitEvent_ptsz ["cuStreamWaitEvent", 7000, true, Sync] (s: Ptr, e: Ptr, flags: u32) => |call| waits(call);
    cuEventSynchronize ["cuEventSynchronize", 2000, false, Sync] (e: Ptr) => |call| trims(Covers::event(e), call);
    // What an event's completion proves done (see `covers`).
    cuEventRecord ["cuEventRecord", 2000, false, Event] (e: Ptr, s: Ptr) => |call| covers::record(e, s, false, call);
    cuEventRecord_ptsz ["cuEventRecord", 7000, true, Event] (e: Ptr, s: Ptr) => |call| covers::record(e, s, true, call);
    cuEventRecordWithFlags ["cuEventRecordWithFlags", 11010, false, Event] (e: Ptr, s: Ptr, flags: u32) => |call| covers::record(e, s, false, call);
    cuEventRecordWithFlags_ptsz ["cuEventRecordWithFlags", 11010, true, Event] (e: Ptr, s: Ptr, flags: u32) => |call| covers::record(e, s, true, call);
    cuEventDestroy_v2 ["cuEventDestroy", 4000, false, Event] (e: Ptr) => |call| covers::destroyed(e, call);
    cuEventQuery ["cuEventQuery", 2000, false, Sync] (e: Ptr) => |call| syncs(Covers::event(e), call);
    cuMemcpy ["cuMemcpy", 4000, false, Sync] (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |call| trims(Covers::Copy { per_thread: false }, call);
    cuMemcpy_ptds ["cuMemcpy", 7000, true, Sync] (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |call| trims(Covers::Copy { per_thread: true }, call);
    cuMemcpyHtoD_v2 ["cuMemcpyHtoD", 3020, false, Sync] (dst: CUdeviceptr, src: *const c_void, n: usize) => |call| trims(Covers::Copy { per_thread: false }, call);
    cuMemcpyHtoD_v2_ptds ["cuMemcpyHtoD", 7000, true, Sync] (dst: CUdeviceptr, src: *const c_void, n: usize) => |call| trims(Covers::Copy { per_thread: true }, call);
    cuMemcpyDtoH_v2 ["cuMemcpyDtoH", 3020, false, Sync] (dst: Ptr, src: CUdeviceptr, n: usize) => |call| trims(Covers::Copy { per_thread: false }, call);
    cuMemcpyDtoH_v2_ptds ["cuMemcpyDtoH", 7000, true, Sync] (dst: Ptr, src: CUdeviceptr, n: usize) => |call| trims(Covers::Copy { per_thread: true }, call);
    // Device to device: no wait for the host, so no proof of anything done.
    cuMemcpyDtoD_v2 ["cuMemcpyDtoD", 3020, false, Sync] (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |call| waits(call);
    cuMemcpyDtoD_v2_ptds ["cuMemcpyDtoD", 7000, true, Sync] (dst: CUdeviceptr, src: CUdeviceptr, n: usize) => |call| waits(call);

    // Allocations, reserved against the group's MemoryLimit first.
    cuMemAlloc_v2 ["cuMemAlloc", 3020, false, Alloc] (dptr: *mut CUdeviceptr, bytes: usize) => |call| guarded_alloc(bytes as u64, || (call(), ptr_key(dptr)));
    cuMemAllocPitch_v2 ["cuMemAllocPitch", 3020, false, Alloc] (dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: u32) => |call| guarded_alloc(pitched_bytes(width, height), || (call(), ptr_key(dptr)));
    cuMemAllocManaged ["cuMemAllocManaged", 6000, false, Alloc] (dptr: *mut CUdeviceptr, bytes: usize, flags: u32) => |call| guarded_alloc(bytes as u64, || (call(), ptr_key(dptr)));
    // Stream-ordered: charged what the pool holds (see `memory`), or a
    // graph memory node when the stream is capturing (see `graphmem`).
    cuMemAllocAsync ["cuMemAllocAsync", 11020, false, Alloc] (dptr: *mut CUdeviceptr, bytes: usize, s: Ptr) => |call| graphmem::stream_alloc(None, s, false, bytes as u64, || (call(), ptr_key(dptr)));
    cuMemAllocAsync_ptsz ["cuMemAllocAsync", 11020, true, Alloc] (dptr: *mut CUdeviceptr, bytes: usize, s: Ptr) => |call| graphmem::stream_alloc(None, s, true, bytes as u64, || (call(), ptr_key(dptr)));
    cuMemAllocFromPoolAsync ["cuMemAllocFromPoolAsync", 11020, false, Alloc] (dptr: *mut CUdeviceptr, bytes: usize, pool: Ptr, s: Ptr) => |call| graphmem::stream_alloc(Some(pool), s, false, bytes as u64, || (call(), ptr_key(dptr)));
    cuMemAllocFromPoolAsync_ptsz ["cuMemAllocFromPoolAsync", 11020, true, Alloc] (dptr: *mut CUdeviceptr, bytes: usize, pool: Ptr, s: Ptr) => |call| graphmem::stream_alloc(Some(pool), s, true, bytes as u64, || (call(), ptr_key(dptr)));
    // VMM: a handle of device memory (not a host location) is charged
    // until it is released and its last mapping unmapped.
    cuMemCreate ["cuMemCreate", 10020, false, Alloc] (handle: *mut u64, bytes: usize, prop: *const [i32; 4], flags: u64) => |call| guarded_alloc_on(prop_device(prop), bytes as u64, || (call(), ptr_key(handle)));
    cuMemMap ["cuMemMap", 10020, false, Track] (ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, flags: u64) => |call| on_success(call(), || memory::mapped(ptr, size as u64, handle));
    // A pool of host memory is never charged.
    cuMemPoolCreate ["cuMemPoolCreate", 11020, false, Track] (pool: *mut Ptr, props: *const [i32; 4]) => |call| on_success(call(), || pool_made(pool, props));
    // CUDA arrays (textures, surfaces): charged by their descriptor.
    cuArrayCreate_v2 ["cuArrayCreate", 3020, false, Alloc] (out: *mut usize, desc: *const [usize; 3]) => |call| guarded_alloc(array_bytes(desc), || (call(), array_key(out)));
    cuArray3DCreate_v2 ["cuArray3DCreate", 3020, false, Alloc] (out: *mut usize, desc: *const [usize; 4]) => |call| guarded_alloc(array3d_bytes(desc, 1), || (call(), array_key(out)));
    cuMipmappedArrayCreate ["cuMipmappedArrayCreate", 5000, false, Alloc] (out: *mut usize, desc: *const [usize; 4], levels: u32) => |call| guarded_alloc(array3d_bytes(desc, levels), || (call(), array_key(out)));

    // Frees, and pools giving memory back.
    // Frees: the record is taken before the real call (see
    // `memory::freeing`).
    cuMemFree_v2 ["cuMemFree", 3020, false, Free] (ptr: CUdeviceptr) => |call| memory::freeing(ptr, call);
    cuMemFreeAsync ["cuMemFreeAsync", 11020, false, Free] (ptr: CUdeviceptr, s: Ptr) => |call| memory::freeing(ptr, call);
    cuMemFreeAsync_ptsz ["cuMemFreeAsync", 11020, true, Free] (ptr: CUdeviceptr, s: Ptr) => |call| memory::freeing(ptr, call);
    cuMemRelease ["cuMemRelease", 10020, false, Free] (handle: u64) => |call| memory::release_handle(handle, call);
    cuMemUnmap ["cuMemUnmap", 10020, false, Free] (ptr: CUdeviceptr, size: usize) => |call| on_success(call(), || memory::unmapped(ptr, size as u64));
    cuArrayDestroy ["cuArrayDestroy", 2000, false, Free] (a: usize) => |call| memory::freeing(a as u64, call);
    cuMipmappedArrayDestroy ["cuMipmappedArrayDestroy", 5000, false, Free] (a: usize) => |call| memory::freeing(a as u64, call);
    cuMemPoolTrimTo ["cuMemPoolTrimTo", 11020, false, Free] (pool: Ptr, keep: usize) => |call| after(call(), |_| memory::settle_pools());
    cuMemPoolDestroy ["cuMemPoolDestroy", 11020, false, Free] (pool: Ptr) => |call| on_success(call(), || memory::pool_destroyed(pool));

    // Memory queries: the group's view.
    cuMemGetInfo_v2 ["cuMemGetInfo", 3020, false, Query] (free: *mut usize, total: *mut usize) => |call| mem_get_info(call(), free, total);
    cuMemGetInfo ["cuMemGetInfo", 2000, false, Query] (free: *mut u32, total: *mut u32) => |call| mem_get_info_32(call, free, total);
    cuDeviceTotalMem_v2 ["cuDeviceTotalMem", 3020, false, Query] (bytes: *mut usize, dev: i32) => |call| total_mem(call(), bytes, dev);
    cuDeviceTotalMem ["cuDeviceTotalMem", 2000, false, Query] (bytes: *mut u32, dev: i32) => |call| total_mem_32(call, bytes, dev);

    // Entry points: answered with ours.
    cuGetProcAddress ["cuGetProcAddress", 11030, false, Entry] (symbol: *const c_char, pfn: *mut Ptr, version: i32, flags: u64) => |call| proc_address(symbol, pfn, version, flags, call());
    cuGetProcAddress_v2 ["cuGetProcAddress", 12000, false, Entry] (symbol: *const c_char, pfn: *mut Ptr, version: i32, flags: u64, status: *mut i32) => |call| proc_address(symbol, pfn, version, flags, call());
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
        // cudaTypedefs.h: the name means another entry point from 12000.
        assert_eq!(
            sym("cuGraphInstantiate", 12000, 0),
            Some("cuGraphInstantiateWithFlags")
        );
        assert_eq!(
            sym("cuGraphInstantiate", 11000, 0),
            Some("cuGraphInstantiate_v2")
        );
        assert_eq!(
            sym("cuGraphInstantiate", 10000, 0),
            Some("cuGraphInstantiate")
        );
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

    /// Memory taken through the table can be given back through it: every
    /// allocation's base name has its free, of kind `Free`, in each
    /// variant the allocation has.
    #[test]
    fn every_allocation_has_its_free() {
        let frees = [
            ("cuMemAlloc", "cuMemFree"),
            ("cuMemAllocPitch", "cuMemFree"),
            ("cuMemAllocManaged", "cuMemFree"),
            ("cuMemAllocAsync", "cuMemFreeAsync"),
            ("cuMemAllocFromPoolAsync", "cuMemFreeAsync"),
            ("cuMemCreate", "cuMemRelease"),
            ("cuArrayCreate", "cuArrayDestroy"),
            ("cuArray3DCreate", "cuArrayDestroy"),
            ("cuMipmappedArrayCreate", "cuMipmappedArrayDestroy"),
        ];
        let allocs: Vec<&Entry> = ENTRIES.iter().filter(|e| e.kind == Kind::Alloc).collect();
        assert!(allocs.len() >= 10, "{allocs:?}");
        for a in allocs {
            let Some((_, free)) = frees.iter().find(|(alloc, _)| *alloc == a.base) else {
                panic!("{}: an allocation with no free named here", a.symbol);
            };
            assert!(
                ENTRIES.iter().any(|e| e.base == *free
                    && e.kind == Kind::Free
                    && e.per_thread == a.per_thread),
                "{}: no {free} line of kind Free{}",
                a.symbol,
                if a.per_thread { " (per-thread)" } else { "" }
            );
        }
        // Every launch is a gated kind, every wait a Sync.
        for (base, kind) in [
            ("cuLaunchKernel", Kind::Launch),
            ("cuGraphLaunch", Kind::Launch),
            ("cuStreamSynchronize", Kind::Sync),
            ("cuMemGetInfo", Kind::Query),
        ] {
            assert!(
                ENTRIES
                    .iter()
                    .filter(|e| e.base == base)
                    .all(|e| e.kind == kind),
                "{base}"
            );
        }
    }
}
