//! `fakecuda`: a CUDA driver simulator, installed by the tests as
//! `libcuda.so.1` (and `libcuda.so`) in a directory put on
//! `LD_LIBRARY_PATH`. It has the real driver's C signatures, result codes
//! and versioned names, and behaves like a device: launches are
//! asynchronous and queue on a timeline shared by every process using the
//! device, synchronisation waits for it, memory is finite and shared, and
//! every kernel's busy interval is logged with its pid (see
//! `fakecuda-log`). Device settings: see [`device`].
//!
//! Kernel durations come from the function's name:
//! - `fake_spin`: the first kernel parameter, a `u64`, is the duration in
//!   microseconds;
//! - `fixed_<N>us` (e.g. `fixed_500us`): N microseconds;
//! - `gemini_spin` (the holder's kernel): the first parameter, a `u64`,
//!   in nanoseconds;
//! - any other name: `FAKECUDA_KERNEL_US` microseconds (default 100).
//!
//! The library also answers the few NVML calls the holder makes
//! ([`nvml`]), so it can be installed as `libnvidia-ml.so.1` too.
//!
//! A graph's duration is the sum of its kernel nodes'. Copies and memsets
//! take no device time. Device memory has no backing store: copies from
//! it read zeros.
//!
//! A process is initialised by `cuInit`; a forked child starts
//! uninitialised, with no contexts, and must call `cuInit` again.

#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod capture;
pub mod device;
#[cfg(test)]
mod driver_tests;
pub mod graphmem;
pub mod nvml;
pub mod pool;
pub mod procaddr;
pub mod types;

use device::{MAX_DEVICES, Sim, sim, sleep_until};
use fakecuda_log::{Kind, now_ns};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use types::*;

type R = Result<(), CUresult>;

fn guard(f: impl FnOnce() -> R) -> CUresult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `v` through an out-pointer the program passed.
fn put<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the driver API contract makes the caller pass
    // a pointer to writable storage of the right type.
    unsafe { p.write(v) };
    Ok(())
}

/// Reads a value through a pointer the program passed.
fn get<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller passes a readable `T` by contract.
    Ok(unsafe { p.read() })
}

#[derive(Debug, Clone)]
enum Func {
    /// First parameter: microseconds.
    Spin,
    /// First parameter: nanoseconds (the holder's `gemini_spin`).
    SpinNs,
    Fixed(u64),
}

#[derive(Debug)]
enum Obj {
    Ctx {
        device: usize,
    },
    /// `blocking`: not created `CU_STREAM_NON_BLOCKING` (it synchronises
    /// with the legacy stream); `ctx`: the context it belongs to.
    Stream {
        device: usize,
        tail: Arc<AtomicU64>,
        blocking: bool,
        ctx: usize,
    },
    /// `captured`: last recorded in the open capture of that id.
    Event {
        time: Option<u64>,
        captured: Option<u64>,
    },
    Module,
    Function(Func),
    Graph {
        nodes: Vec<u64>,
        allocs: Vec<graphmem::AllocNode>,
    },
    Exec {
        total: u64,
        allocs: Vec<graphmem::AllocNode>,
        auto_free: bool,
    },
    /// A `cuMemCreate` handle.
    Pool,
    /// A memory pool (its state in `Proc::pools`).
    MemPool,
}

/// Per-process driver state, reset in a forked child.
#[derive(Debug, Default)]
struct Proc {
    pid: u32,
    objects: HashMap<usize, Obj>,
    /// Primary context per device: (handle, retain count).
    primary: HashMap<usize, (usize, u32)>,
    /// Device pointer → (device, bytes).
    allocs: HashMap<u64, (usize, u64)>,
    /// `cuMemCreate` handle → (device, bytes).
    physical: HashMap<u64, (usize, u64)>,
    next_handle: usize,
    next_ptr: [u64; MAX_DEVICES],
    captures: capture::Captures,
    /// Memory pools by handle; each device's default and current pool.
    pools: HashMap<usize, pool::Pool>,
    default_pool: HashMap<usize, usize>,
    current_pool: HashMap<usize, usize>,
    /// Device pointer handed out by a pool → that pool.
    pool_allocs: HashMap<u64, usize>,
    /// CUDA arrays (plain and mipmapped) → (device, bytes).
    arrays: HashMap<usize, (usize, u64)>,
    /// Next free virtual address offset for `cuMemAddressReserve`.
    next_va: u64,
    /// Where each context's work ends, once a process has more than one
    /// context (`MANY_CONTEXTS`): `cuCtxSynchronize` waits for its own.
    ctx_end: HashMap<usize, Arc<AtomicU64>>,
    /// Allocations of other processes opened through IPC handles.
    ipc_opened: std::collections::HashSet<u64>,
    /// Each device's graph allocator (see `graphmem`): a pool trimmed
    /// only by `cuDeviceGraphMemTrim`.
    graph_mem: HashMap<usize, pool::Pool>,
    /// Allocations a launched graph did not free → (device, bytes).
    graph_live: HashMap<u64, (usize, u64)>,
}

static PROC: Mutex<Option<Proc>> = Mutex::new(None);
/// Set once a process creates a context besides the primary ones: from
/// then on work is tracked per context, not only per device.
static MANY_CONTEXTS: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static INIT_PID: AtomicU32 = AtomicU32::new(0);

fn proc_lock() -> MutexGuard<'static, Option<Proc>> {
    PROC.lock().unwrap_or_else(|p| p.into_inner())
}

fn with_proc<T>(f: impl FnOnce(&mut Proc) -> T) -> T {
    let mut g = proc_lock();
    let pid = std::process::id();
    if g.as_ref().is_none_or(|p| p.pid != pid) {
        *g = Some(Proc {
            pid,
            next_handle: 0x1000,
            ..Proc::default()
        });
    }
    match g.as_mut() {
        Some(p) => f(p),
        None => unreachable!("set above"),
    }
}

impl Proc {
    fn add(&mut self, obj: Obj) -> usize {
        self.next_handle += 16;
        self.objects.insert(self.next_handle, obj);
        self.next_handle
    }

    /// A device address for `bytes` on `dev`, recorded as an allocation.
    fn new_ptr(&mut self, dev: usize, bytes: u64) -> u64 {
        let ptr = self.address(dev, bytes);
        self.allocs.insert(ptr, (dev, bytes));
        ptr
    }

    /// A fresh device address for `bytes` on `dev`.
    fn address(&mut self, dev: usize, bytes: u64) -> u64 {
        let base = 0x7000_0000_0000u64 + ((dev as u64) << 40);
        let ptr = base + self.next_ptr[dev];
        self.next_ptr[dev] += bytes.div_ceil(512) * 512;
        ptr
    }

    /// The graph allocator of device `dev`.
    fn graph_allocator(&mut self, dev: usize) -> &mut pool::Pool {
        self.graph_mem
            .entry(dev)
            .or_insert_with(|| pool::Pool::new(dev))
    }

    /// An allocation node's address, for a graph: no memory yet.
    fn graph_alloc(&mut self, dev: usize, bytes: u64) -> graphmem::AllocNode {
        graphmem::AllocNode {
            dptr: self.address(dev, bytes),
            device: dev,
            bytes,
            freed_in_graph: false,
        }
    }

    fn default_pool(&mut self, dev: usize) -> usize {
        if let Some(h) = self.default_pool.get(&dev) {
            return *h;
        }
        let h = self.add(Obj::MemPool);
        self.pools.insert(h, pool::Pool::new(dev));
        self.default_pool.insert(dev, h);
        h
    }

    fn current_pool(&mut self, dev: usize) -> usize {
        match self.current_pool.get(&dev) {
            Some(h) => *h,
            None => self.default_pool(dev),
        }
    }
}

thread_local! {
    /// (pid, context stack) of this thread.
    static CTX: RefCell<(u32, Vec<usize>)> = const { RefCell::new((0, Vec::new())) };
    /// Per-thread default stream tails.
    static PT_TAIL: Vec<Arc<AtomicU64>> = (0..MAX_DEVICES).map(|_| Arc::new(AtomicU64::new(0))).collect();
}

fn ctx_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> T {
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        let pid = std::process::id();
        if c.0 != pid {
            *c = (pid, Vec::new());
        }
        f(&mut c.1)
    })
}

fn initialised() -> Result<&'static Sim, CUresult> {
    if INIT_PID.load(Ordering::Acquire) != std::process::id() {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    sim()
}

/// The physical device behind the program's device handle (its ordinal).
fn check_device(s: &Sim, dev: CUdevice) -> Result<usize, CUresult> {
    if dev < 0 {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    s.physical(dev as usize).ok_or(CUDA_ERROR_INVALID_DEVICE)
}

fn ctx_device(ctx: usize) -> Result<usize, CUresult> {
    with_proc(|p| match p.objects.get(&ctx) {
        Some(Obj::Ctx { device }) => Ok(*device),
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    })
}

fn current_device() -> Result<usize, CUresult> {
    let top = ctx_stack(|s| s.last().copied()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    ctx_device(top)
}

/// Device and queue tail of a stream handle; `ptsz` makes the null stream
/// the per-thread one.
fn stream(s: &Sim, h: CUstream, ptsz: bool) -> Result<(usize, Arc<AtomicU64>), CUresult> {
    let h = h as usize;
    let per_thread = |dev: usize| PT_TAIL.with(|t| Arc::clone(&t[dev]));
    match h {
        0 if ptsz => current_device().map(|d| (d, per_thread(d))),
        0 | CU_STREAM_LEGACY => current_device().map(|d| (d, Arc::clone(&s.legacy_tail[d]))),
        CU_STREAM_PER_THREAD => current_device().map(|d| (d, per_thread(d))),
        _ => with_proc(|p| match p.objects.get(&h) {
            Some(Obj::Stream { device, tail, .. }) => Ok((*device, Arc::clone(tail))),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        }),
    }
}

fn default_kernel_us() -> u64 {
    std::env::var("FAKECUDA_KERNEL_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

fn function_for(name: &str) -> Func {
    if name == "fake_spin" {
        return Func::Spin;
    }
    if name == "gemini_spin" {
        return Func::SpinNs;
    }
    let fixed = name
        .strip_prefix("fixed_")
        .and_then(|r| r.strip_suffix("us"))
        .and_then(|n| n.parse().ok());
    Func::Fixed(fixed.unwrap_or_else(default_kernel_us))
}

/// Duration in ns of one launch of `f` with `params`.
fn kernel_ns(f: CUfunction, params: *mut *mut c_void) -> Result<u64, CUresult> {
    let func = with_proc(|p| match p.objects.get(&(f as usize)) {
        Some(Obj::Function(func)) => Ok(func.clone()),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })?;
    match func {
        Func::Fixed(us) => Ok(us * 1000),
        Func::Spin => {
            let first = get(params as *const *mut c_void)?;
            Ok(get(first as *const u64)?.saturating_mul(1000))
        }
        Func::SpinNs => {
            let first = get(params as *const *mut c_void)?;
            get(first as *const u64)
        }
    }
}

/// Whether `h` (with `ptsz`) is the legacy default stream.
fn is_legacy(h: CUstream, ptsz: bool) -> bool {
    matches!(h as usize, 0 if !ptsz) || h as usize == CU_STREAM_LEGACY
}

/// Issues `ns` of device work to stream `h` (`kind`: none for work that
/// takes no device time): recorded into the stream's capture if it is
/// capturing, else queued on the device.
fn issue(s: &Sim, h: CUstream, ptsz: bool, ns: u64, kind: Option<Kind>) -> R {
    // Without an open capture, the capture bookkeeping (a process-wide
    // lock) is skipped.
    let captured = capture::any_open()
        && with_proc(|p| {
            if is_legacy(h, ptsz) {
                return p.captures.legacy_work().map(|_| false);
            }
            match p.captures.of(h as usize) {
                Some(c) if c.invalidated => Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
                Some(c) => {
                    c.nodes.push(ns);
                    Ok(true)
                }
                None => Ok(false),
            }
        })?;
    let (dev, tail) = stream(s, h, ptsz)?;
    if let (false, Some(kind)) = (captured, kind) {
        let end = s.run(dev, ns, &tail, kind as u32);
        note_ctx_end(h, end);
    }
    Ok(())
}

/// Work on stream `h` ends at `end`: so does its context's, where the
/// process has several contexts.
fn note_ctx_end(h: CUstream, end: u64) {
    if !MANY_CONTEXTS.load(Ordering::Acquire) {
        return;
    }
    let own = matches!(h as usize, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD);
    let current = ctx_stack(|st| st.last().copied());
    with_proc(|p| {
        let ctx = if own {
            current
        } else {
            match p.objects.get(&(h as usize)) {
                Some(Obj::Stream { ctx, .. }) => Some(*ctx),
                _ => None,
            }
        };
        if let Some(ctx) = ctx {
            p.ctx_end
                .entry(ctx)
                .or_default()
                .fetch_max(end, Ordering::AcqRel);
        }
    });
}

/// Where the current context's work ends: its own, with several
/// contexts; else the device's (the process's one context there).
fn current_ctx_end(s: &Sim, dev: usize) -> u64 {
    if !MANY_CONTEXTS.load(Ordering::Acquire) {
        return s.last_end[dev].load(Ordering::Acquire);
    }
    let ctx = ctx_stack(|st| st.last().copied()).unwrap_or(0);
    with_proc(|p| p.ctx_end.get(&ctx).map_or(0, |e| e.load(Ordering::Acquire)))
}

/// A wait for (or query of) stream `h`: refused on a capturing stream
/// (which invalidates its capture) and, as a potentially unsafe call, on
/// the legacy stream while a capture forbids it.
fn check_wait(h: CUstream, ptsz: bool) -> R {
    if !capture::any_open() {
        return Ok(());
    }
    with_proc(|p| {
        if is_legacy(h, ptsz) {
            return p.captures.unsafe_call();
        }
        match p.captures.of(h as usize) {
            Some(c) => {
                c.invalidated = true;
                Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
            }
            None => Ok(()),
        }
    })
}

fn launch(
    f: CUfunction,
    grid: [u32; 3],
    h: CUstream,
    params: *mut *mut c_void,
    ptsz: bool,
    kind: Kind,
) -> R {
    let s = initialised()?;
    current_device()?; // no context: CUDA_ERROR_INVALID_CONTEXT first
    if grid.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dur = kernel_ns(f, params)?;
    issue(s, h, ptsz, dur, Some(kind))
}

fn sync_stream(h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    check_wait(h, ptsz)?;
    sleep_until(tail.load(Ordering::Acquire));
    trim_pools(s);
    Ok(())
}

fn query_stream(h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    check_wait(h, ptsz)?;
    if tail.load(Ordering::Acquire) > now_ns() {
        Err(CUDA_ERROR_NOT_READY)
    } else {
        Ok(())
    }
}

/// Records `e` on `h`: the time its work ends, or, on a capturing stream,
/// a node of the capture (other streams that wait for it join it).
fn record_event(e: CUevent, h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    let t = tail.load(Ordering::Acquire).max(now_ns());
    with_proc(|p| {
        let legacy = is_legacy(h, ptsz);
        let capture = match p.captures.of(h as usize) {
            _ if legacy => {
                p.captures.legacy_work()?;
                None
            }
            Some(c) if c.invalidated => return Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
            Some(c) => Some(c.id),
            None => None,
        };
        match p.objects.get_mut(&(e as usize)) {
            Some(Obj::Event { time, captured }) => {
                *captured = capture;
                if capture.is_none() {
                    *time = Some(t);
                }
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        }
    })
}

/// Later work on the stream starts after the event's work; a stream that
/// waits for an event recorded in a capture joins that capture.
fn wait_event(h: CUstream, e: CUevent, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    let joined = with_proc(|p| {
        let captured = match p.objects.get(&(e as usize)) {
            Some(Obj::Event { captured, .. }) => *captured,
            _ => return Err(CUDA_ERROR_INVALID_HANDLE),
        };
        let Some(id) = captured else { return Ok(false) };
        if is_legacy(h, ptsz) || p.captures.of(h as usize).is_some() {
            return Ok(true); // a capturing stream waits within its graph
        }
        match p.captures.of_id(id) {
            Some(c) => {
                c.streams.push(h as usize);
                Ok(true)
            }
            None => Ok(false), // that capture is over: an ordinary wait
        }
    })?;
    if !joined && let Some(t) = event_time(e)? {
        tail.fetch_max(t, Ordering::AcqRel);
    }
    Ok(())
}

/// The time `e`'s work ends; refused for an event last recorded in a
/// capture that is still open.
fn event_time(e: CUevent) -> Result<Option<u64>, CUresult> {
    with_proc(|p| match p.objects.get(&(e as usize)) {
        Some(Obj::Event {
            captured: Some(id), ..
        }) if p.captures.has_id(*id) => Err(CUDA_ERROR_CAPTURED_EVENT),
        Some(Obj::Event { time, .. }) => Ok(*time),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })
}

fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> R {
    initialised()?;
    let (Some(a), Some(b)) = (event_time(start)?, event_time(end)?) else {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    };
    if a.max(b) > now_ns() {
        return Err(CUDA_ERROR_NOT_READY);
    }
    put(ms, (b as f64 - a as f64) as f32 / 1e6)
}

fn alloc(dev: usize, bytes: u64) -> Result<u64, CUresult> {
    let s = initialised()?;
    if bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    s.alloc(dev, bytes)?;
    Ok(with_proc(|p| p.new_ptr(dev, bytes)))
}

/// `cuMemAllocAsync` (`pool`: none) or `cuMemAllocFromPoolAsync`: from
/// the pool, which reserves more device memory only when what it holds
/// free does not cover `bytes`.
fn pool_alloc(
    dptr: *mut CUdeviceptr,
    bytes: usize,
    pool: Option<CUmemoryPool>,
    h: CUstream,
    ptsz: bool,
) -> R {
    let s = initialised()?;
    let (dev, _) = stream(s, h, ptsz)?;
    if dptr.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = bytes as u64;
    // On a capturing stream: an allocation node of the capture's graph.
    if capture::any_open() && !is_legacy(h, ptsz) {
        let node = with_proc(|p| {
            if p.captures.of(h as usize).is_none() {
                return Ok(None);
            }
            let node = p.graph_alloc(dev, bytes);
            match p.captures.of(h as usize) {
                Some(c) if c.invalidated => Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
                Some(c) => {
                    c.allocs.push(node);
                    Ok(Some(node.dptr))
                }
                None => Ok(None),
            }
        })?;
        if let Some(ptr) = node {
            return put(dptr, ptr);
        }
    }
    let ptr = with_proc(|p| {
        let ph = match pool {
            Some(ph) => ph as usize,
            None => p.current_pool(dev),
        };
        let pl = p.pools.get_mut(&ph).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        let grow = pl.growth_for(bytes);
        if grow > 0 {
            s.alloc(pl.device, grow)?;
        }
        pl.hand_out(bytes, grow);
        let d = pl.device;
        let ptr = p.new_ptr(d, bytes);
        p.pool_allocs.insert(ptr, ph);
        Ok::<u64, CUresult>(ptr)
    })?;
    put(dptr, ptr)
}

/// Frees an allocation: back to its pool, or to the device.
fn free(ptr: CUdeviceptr) -> R {
    let s = initialised()?;
    if ptr == 0 {
        return Ok(());
    }
    with_proc(|p| {
        if let Some((dev, bytes)) = p.graph_live.remove(&ptr) {
            // Back to the graph allocator, not to the device.
            p.graph_allocator(dev).take_back(bytes);
            return Ok(());
        }
        let (dev, bytes) = p.allocs.remove(&ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        match p
            .pool_allocs
            .remove(&ptr)
            .and_then(|ph| p.pools.get_mut(&ph))
        {
            Some(pl) => pl.take_back(bytes),
            None => s.free(dev, bytes),
        }
        Ok(())
    })
}

/// Bytes of a CUDA array of `dims` (0: that dimension is absent),
/// `format` (`CUarray_format`), `channels` (1, 2 or 4) and mipmap
/// `levels` (each level halves every dimension, down to 1).
fn array_bytes(dims: [usize; 3], format: u32, channels: u32, levels: u32) -> Result<u64, CUresult> {
    let elem: u64 = match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        0x03 | 0x0a | 0x20 => 4, // (UN)SIGNED_INT32, FLOAT
        _ => return Err(CUDA_ERROR_INVALID_VALUE),
    };
    if dims[0] == 0 || !matches!(channels, 1 | 2 | 4) || levels == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let mut total = 0u64;
    for level in 0..levels.min(32) {
        let size = |d: usize| ((d as u64) >> level).max(1);
        let (w, h, d) = (size(dims[0]), size(dims[1].max(1)), size(dims[2].max(1)));
        total = total.saturating_add(w * h * d * elem * channels as u64);
    }
    Ok(total)
}

/// Page-locked host memory of `bytes` (ordinary host memory here).
fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> R {
    initialised()?;
    current_device()?;
    if pp.is_null() || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: malloc of a non-zero size; null is reported as out of memory.
    let p = unsafe { libc::malloc(bytes) };
    if p.is_null() {
        return Err(CUDA_ERROR_OUT_OF_MEMORY);
    }
    put(pp, p)
}

fn create_array(out: *mut usize, bytes: u64) -> R {
    let s = initialised()?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = current_device()?;
    s.alloc(dev, bytes)?;
    let h = with_proc(|p| {
        let h = p.add(Obj::Pool);
        p.arrays.insert(h, (dev, bytes));
        h
    });
    put(out, h)
}

fn destroy_array(a: usize) -> R {
    let s = initialised()?;
    let (dev, bytes) = with_proc(|p| {
        p.objects.remove(&a);
        p.arrays.remove(&a)
    })
    .ok_or(CUDA_ERROR_INVALID_HANDLE)?;
    s.free(dev, bytes);
    Ok(())
}

/// A synchronisation returned: pools give back what they reserve beyond
/// their release thresholds.
fn trim_pools(s: &Sim) {
    with_proc(|p| {
        for pl in p.pools.values_mut() {
            let excess = pl.at_sync();
            if excess > 0 {
                s.free(pl.device, excess);
            }
        }
    })
}

/// The pool `h` of this process.
fn with_pool<T>(
    h: CUmemoryPool,
    f: impl FnOnce(&mut pool::Pool) -> Result<T, CUresult>,
) -> Result<T, CUresult> {
    initialised()?;
    with_proc(|p| {
        p.pools
            .get_mut(&(h as usize))
            .ok_or(CUDA_ERROR_INVALID_VALUE)
            .and_then(f)
    })
}

fn pool_get_attribute(h: CUmemoryPool, attr: i32, value: *mut c_void) -> R {
    use pool::*;
    let v = with_pool(h, |pl| match attr {
        ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => Ok(None),
        ATTR_RELEASE_THRESHOLD => Ok(Some(pl.threshold)),
        ATTR_RESERVED_MEM_CURRENT => Ok(Some(pl.reserved)),
        ATTR_RESERVED_MEM_HIGH => Ok(Some(pl.reserved_high)),
        ATTR_USED_MEM_CURRENT => Ok(Some(pl.used)),
        ATTR_USED_MEM_HIGH => Ok(Some(pl.used_high)),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })?;
    match v {
        Some(v) => put(value as *mut u64, v),
        None => put(value as *mut i32, 1), // the reuse policies are on
    }
}

fn pool_set_attribute(h: CUmemoryPool, attr: i32, value: *mut c_void) -> R {
    use pool::*;
    match attr {
        ATTR_REUSE_FOLLOW_EVENT_DEPENDENCIES..=ATTR_REUSE_ALLOW_INTERNAL_DEPENDENCIES => {
            get(value as *const i32)?;
            with_pool(h, |_| Ok(()))
        }
        ATTR_RELEASE_THRESHOLD => {
            let v = get(value as *const u64)?;
            with_pool(h, |pl| {
                pl.threshold = v;
                Ok(())
            })
        }
        // Only resetting a high-water mark (to 0: to the current value).
        ATTR_RESERVED_MEM_HIGH | ATTR_USED_MEM_HIGH if get(value as *const u64)? == 0 => {
            with_pool(h, |pl| {
                if attr == ATTR_RESERVED_MEM_HIGH {
                    pl.reserved_high = pl.reserved;
                } else {
                    pl.used_high = pl.used;
                }
                Ok(())
            })
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

fn mem_info(free: *mut usize, total: *mut usize) -> R {
    let s = initialised()?;
    let (f, t) = s.mem_info(current_device()?);
    put(free, f as usize)?;
    put(total, t as usize)
}

/// A synchronous copy or memset returns once the work before it is done.
/// On the legacy default stream that is every blocking stream's work of
/// the context (the legacy stream synchronises with them all); on the
/// per-thread default stream (`_ptds`), that stream's work and the legacy
/// stream's.
fn sync_copy_on(ptds: bool) -> R {
    let s = initialised()?;
    let dev = current_device()?;
    if !ptds {
        // On the legacy stream: potentially unsafe during a capture.
        with_proc(|p| p.captures.unsafe_call())?;
    }
    let until = if ptds {
        let (_, tail) = stream(s, std::ptr::null_mut(), true)?;
        tail.load(Ordering::Acquire)
            .max(s.legacy_tail[dev].load(Ordering::Acquire))
    } else {
        current_ctx_end(s, dev)
    };
    sleep_until(until);
    trim_pools(s);
    Ok(())
}

fn sync_copy() -> R {
    sync_copy_on(false)
}

fn sync_copy_ptds() -> R {
    sync_copy_on(true)
}

/// Asynchronous work that takes no device time (copies, memsets, frees):
/// recorded into a capture, or nothing.
fn check_stream(h: CUstream, ptsz: bool) -> R {
    issue(initialised()?, h, ptsz, 0, None)
}

fn graph_launch(exec: CUgraphExec, h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    let (total, allocs, auto_free) = with_proc(|p| match p.objects.get(&(exec as usize)) {
        Some(Obj::Exec {
            total,
            allocs,
            auto_free,
        }) => Ok((*total, allocs.clone(), *auto_free)),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })?;
    if !allocs.is_empty() {
        let in_capture = capture::any_open()
            && !is_legacy(h, ptsz)
            && with_proc(|p| p.captures.of(h as usize).is_some());
        if !in_capture {
            graph_memory(s, &allocs, auto_free)?;
        }
    }
    issue(s, h, ptsz, total, Some(Kind::Graph))
}

/// A launch of a graph with allocation nodes takes their memory from the
/// graph allocators (see `graphmem`).
fn graph_memory(s: &Sim, allocs: &[graphmem::AllocNode], auto_free: bool) -> R {
    with_proc(|p| {
        for a in allocs.iter().filter(|a| !a.freed_in_graph) {
            if let Some((dev, bytes)) = p.graph_live.get(&a.dptr).copied() {
                if !auto_free {
                    return Err(CUDA_ERROR_INVALID_VALUE);
                }
                p.graph_live.remove(&a.dptr);
                p.graph_allocator(dev).take_back(bytes);
            }
        }
        let mut devices: Vec<usize> = allocs.iter().map(|a| a.device).collect();
        devices.sort_unstable();
        devices.dedup();
        for &dev in &devices {
            let need = graphmem::launch_bytes(allocs, dev);
            let g = p.graph_allocator(dev);
            let grow = g.growth_for(need);
            if grow > 0 {
                s.alloc(dev, grow)?;
            }
            g.hand_out(need, grow);
        }
        for a in allocs {
            if a.freed_in_graph {
                p.graph_allocator(a.device).take_back(a.bytes);
            } else {
                p.graph_live.insert(a.dptr, (a.device, a.bytes));
            }
        }
        Ok(())
    })
}

/// `cuMemFreeAsync` of `ptr` on a capturing stream: a free node, when it
/// is an allocation of that capture (`Some`); `None` when the stream does
/// not capture.
fn captured_free(h: CUstream, ptsz: bool, ptr: CUdeviceptr) -> Option<R> {
    if !capture::any_open() || is_legacy(h, ptsz) {
        return None;
    }
    with_proc(|p| {
        let c = p.captures.of(h as usize)?;
        if c.invalidated {
            return Some(Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED));
        }
        Some(match graphmem::free_in_graph(&mut c.allocs, ptr) {
            Some(Ok(())) => Ok(()),
            Some(Err(())) => Err(CUDA_ERROR_INVALID_VALUE),
            // A free node for memory not allocated in this graph.
            None => Err(CUDA_ERROR_NOT_SUPPORTED),
        })
    })
}

fn add_mem_alloc_node(node: *mut CUgraphNode, graph: CUgraph, params: *mut c_void) -> R {
    let s = initialised()?;
    if params.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let at = |off: usize| (params as *mut u8).wrapping_add(off);
    let handle_types = get(at(graphmem::PARAMS_HANDLE_TYPES) as *const u32)?;
    let location = get(at(graphmem::PARAMS_LOCATION_TYPE) as *const u32)?;
    let dev = get(at(graphmem::PARAMS_LOCATION_ID) as *const i32)?;
    let bytes = get(at(graphmem::PARAMS_BYTESIZE) as *const u64)?;
    if handle_types != 0 || location != graphmem::LOCATION_DEVICE || bytes == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let dev = check_device(s, dev).map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let (n, dptr) = with_proc(|p| {
        let a = p.graph_alloc(dev, bytes);
        match p.objects.get_mut(&(graph as usize)) {
            Some(Obj::Graph { nodes, allocs }) => {
                allocs.push(a);
                Ok((nodes.len() + allocs.len(), a.dptr))
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        }
    })?;
    put(at(graphmem::PARAMS_DPTR) as *mut u64, dptr)?;
    put(node, (graph as usize + n) as CUgraphNode)
}

fn add_mem_free_node(node: *mut CUgraphNode, graph: CUgraph, dptr: CUdeviceptr) -> R {
    initialised()?;
    let n = with_proc(|p| match p.objects.get_mut(&(graph as usize)) {
        Some(Obj::Graph { nodes, allocs }) => match graphmem::free_in_graph(allocs, dptr) {
            Some(Ok(())) => Ok(nodes.len() + allocs.len() + 1),
            Some(Err(())) => Err(CUDA_ERROR_INVALID_VALUE),
            None => Err(CUDA_ERROR_NOT_SUPPORTED),
        },
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })?;
    put(node, (graph as usize + n) as CUgraphNode)
}

/// The graph allocator of device `dev` (a valid ordinal).
fn with_graph_mem<T>(dev: CUdevice, f: impl FnOnce(&mut pool::Pool) -> T) -> Result<T, CUresult> {
    let s = initialised()?;
    let d = check_device(s, dev)?;
    Ok(with_proc(|p| f(p.graph_allocator(d))))
}

fn graph_mem_attribute(dev: CUdevice, attr: i32, value: *mut c_void) -> R {
    use graphmem::*;
    let v = with_graph_mem(dev, |g| match attr {
        ATTR_USED_MEM_CURRENT => Ok(g.used),
        ATTR_USED_MEM_HIGH => Ok(g.used_high),
        ATTR_RESERVED_MEM_CURRENT => Ok(g.reserved),
        ATTR_RESERVED_MEM_HIGH => Ok(g.reserved_high),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })??;
    put(value as *mut u64, v)
}

/// Only a high-water mark may be set, and only to 0 (it becomes the
/// current value).
fn set_graph_mem_attribute(dev: CUdevice, attr: i32, value: *mut c_void) -> R {
    use graphmem::*;
    let v = get(value as *const u64)?;
    with_graph_mem(dev, |g| match attr {
        ATTR_USED_MEM_HIGH if v == 0 => {
            g.used_high = g.used;
            Ok(())
        }
        ATTR_RESERVED_MEM_HIGH if v == 0 => {
            g.reserved_high = g.reserved;
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    })?
}

/// `cuDeviceGraphMemTrim`: what no graph uses goes back to the device.
fn graph_mem_trim(dev: CUdevice) -> R {
    let s = initialised()?;
    let (d, excess) = with_graph_mem(dev, |g| (g.device, g.trim(0)))?;
    s.free(d, excess);
    Ok(())
}

/// The created stream `h` may capture: the legacy stream may not
/// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`); the per-thread default
/// stream is not simulated (`CUDA_ERROR_NOT_SUPPORTED`).
fn capturable(h: CUstream, ptsz: bool) -> Result<bool, CUresult> {
    let s = initialised()?;
    stream(s, h, ptsz)?;
    if is_legacy(h, ptsz) {
        return Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    }
    with_proc(|p| match p.objects.get(&(h as usize)) {
        Some(Obj::Stream { blocking, .. }) => Ok(*blocking),
        _ => Err(CUDA_ERROR_NOT_SUPPORTED),
    })
}

fn begin_capture(h: CUstream, ptsz: bool, mode: u32) -> R {
    let blocking = capturable(h, ptsz)?;
    with_proc(|p| p.captures.begin(h as usize, blocking, mode))
}

fn end_capture(h: CUstream, ptsz: bool, graph: *mut CUgraph) -> R {
    if graph.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    capturable(h, ptsz)?;
    let ended = with_proc(|p| {
        let (nodes, allocs) = p.captures.end(h as usize)?;
        Ok(p.add(Obj::Graph { nodes, allocs }))
    });
    match ended {
        Ok(g) => put(graph, g as CUgraph),
        Err(e) => {
            if e == CUDA_ERROR_STREAM_CAPTURE_INVALIDATED {
                put(graph, std::ptr::null_mut())?;
            }
            Err(e)
        }
    }
}

/// `CUstreamCaptureStatus` of `h` (and the capture's id).
fn capture_status(h: CUstream, ptsz: bool) -> Result<(u32, u64), CUresult> {
    let s = initialised()?;
    stream(s, h, ptsz)?;
    with_proc(|p| {
        if is_legacy(h, ptsz) {
            if p.captures.blocking_open() {
                return Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT);
            }
            return Ok((capture::STATUS_NONE, 0));
        }
        let status = p.captures.status(h as usize);
        Ok((status, p.captures.of(h as usize).map_or(0, |c| c.id)))
    })
}

fn add_kernel_node(
    node: *mut CUgraphNode,
    graph: CUgraph,
    params: *const CudaKernelNodeParams,
) -> R {
    initialised()?;
    let params = params_ref(params)?;
    let ns = kernel_ns(params.func, params.kernel_params)?;
    with_proc(|p| match p.objects.get_mut(&(graph as usize)) {
        Some(Obj::Graph { nodes, allocs }) => {
            nodes.push(ns);
            Ok(nodes.len() + allocs.len())
        }
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })
    .and_then(|n| put(node, (graph as usize + n) as CUgraphNode))
}

fn params_ref<'a>(p: *const CudaKernelNodeParams) -> Result<&'a CudaKernelNodeParams, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null; the caller passes a valid struct by contract and
    // it outlives this call.
    Ok(unsafe { &*p })
}

fn instantiate(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> R {
    initialised()?;
    let h = with_proc(|p| {
        let (total, allocs) = match p.objects.get(&(graph as usize)) {
            Some(Obj::Graph { nodes, allocs }) => (nodes.iter().sum(), allocs.clone()),
            _ => return Err(CUDA_ERROR_INVALID_HANDLE),
        };
        Ok(p.add(Obj::Exec {
            total,
            allocs,
            auto_free: flags & graphmem::AUTO_FREE_ON_LAUNCH != 0,
        }))
    })?;
    put(exec, h as CUgraphExec)
}

fn destroy(h: *mut c_void, is_kind: fn(&Obj) -> bool) -> R {
    initialised()?;
    with_proc(|p| match p.objects.get(&(h as usize)) {
        Some(o) if is_kind(o) => {
            p.objects.remove(&(h as usize));
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })
}

fn create_ctx(out: *mut CUcontext, dev: CUdevice) -> R {
    let s = initialised()?;
    if !MANY_CONTEXTS.swap(true, Ordering::AcqRel) {
        // From now on per context: the contexts so far own all the work
        // their devices have had.
        with_proc(|p| {
            let existing: Vec<(usize, usize)> = p
                .objects
                .iter()
                .filter_map(|(h, o)| match o {
                    Obj::Ctx { device } => Some((*h, *device)),
                    _ => None,
                })
                .collect();
            for (h, device) in existing {
                let end = s.last_end[device].load(Ordering::Acquire);
                p.ctx_end
                    .entry(h)
                    .or_default()
                    .fetch_max(end, Ordering::AcqRel);
            }
        });
    }
    let dev = check_device(s, dev)?;
    let h = with_proc(|p| p.add(Obj::Ctx { device: dev }));
    ctx_stack(|st| st.push(h));
    put(out, h as CUcontext)
}

fn primary_release(dev: CUdevice) -> R {
    let s = initialised()?;
    let dev = check_device(s, dev)?;
    with_proc(|p| match p.primary.get_mut(&dev) {
        Some((_, n)) if *n > 0 => {
            *n -= 1;
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    })
}

fn proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: i32,
    flags: u64,
    status: *mut i32,
) -> R {
    if symbol.is_null() || pfn.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null NUL-terminated string from the caller.
    let name = unsafe { CStr::from_ptr(symbol) }
        .to_str()
        .map_err(|_| CUDA_ERROR_INVALID_VALUE)?;
    let per_thread = flags & CU_GET_PROC_ADDRESS_PER_THREAD_DEFAULT_STREAM != 0;
    let set_status = |v: i32| {
        if !status.is_null() {
            let _ = put(status, v);
        }
    };
    match procaddr::resolve(name, version, per_thread, |s| lookup(s).is_some()) {
        procaddr::Resolved::Symbol(s) => match lookup(&s) {
            Some(f) => {
                set_status(CU_GET_PROC_ADDRESS_SUCCESS);
                put(pfn, f)
            }
            None => {
                set_status(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
                put(pfn, std::ptr::null_mut())?;
                Err(CUDA_ERROR_NOT_FOUND)
            }
        },
        procaddr::Resolved::VersionNotSufficient => {
            set_status(CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT);
            put(pfn, std::ptr::null_mut())?;
            Err(CUDA_ERROR_NOT_FOUND)
        }
    }
}

fn device_attribute(attr: i32, dev: usize, s: &Sim) -> i32 {
    match attr {
        1 => 1024,               // MAX_THREADS_PER_BLOCK
        2 | 3 => 1024,           // MAX_BLOCK_DIM_X/Y
        4 => 64,                 // MAX_BLOCK_DIM_Z
        5 => i32::MAX,           // MAX_GRID_DIM_X
        6 | 7 => 65535,          // MAX_GRID_DIM_Y/Z
        8 => 49152,              // MAX_SHARED_MEMORY_PER_BLOCK
        9 => 65536,              // TOTAL_CONSTANT_MEMORY
        10 => 32,                // WARP_SIZE
        12 => 65536,             // MAX_REGISTERS_PER_BLOCK
        13 => 1_980_000,         // CLOCK_RATE (kHz)
        16 => 132,               // MULTIPROCESSOR_COUNT
        33 => 0x10 + dev as i32, // PCI_BUS_ID
        41 | 83 | 89 => 1,       // UNIFIED_ADDRESSING, MANAGED_MEMORY, CONCURRENT_MANAGED_ACCESS
        75 => 9,                 // COMPUTE_CAPABILITY_MAJOR
        76 => 0,                 // COMPUTE_CAPABILITY_MINOR
        ATTR_MEMORY_POOLS_SUPPORTED => s.pools as i32,
        _ => 0,
    }
}

macro_rules! driver_api {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {
        $(
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                guard(move || -> R { $body })
            }
        )*

        /// The exported entry point called `name`.
        pub fn lookup(name: &str) -> Option<*mut c_void> {
            match name {
                $( stringify!($name) => Some($name as *const () as *mut c_void), )*
                _ => None,
            }
        }
    };
}

driver_api! {
    fn cuInit(flags: u32) {
        if flags != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        sim()?;
        INIT_PID.store(std::process::id(), Ordering::Release);
        Ok(())
    }
    fn cuDriverGetVersion(version: *mut i32) {
        let v = std::env::var("FAKECUDA_DRIVER_VERSION").ok().and_then(|v| v.parse().ok()).unwrap_or(12080);
        put(version, v)
    }
    fn cuGetErrorName(err: CUresult, out: *mut *const c_char) {
        match ERRORS.iter().find(|(c, _, _)| *c == err) {
            Some((_, name, _)) => put(out, name.as_ptr() as *const c_char),
            None => { put(out, std::ptr::null())?; Err(CUDA_ERROR_INVALID_VALUE) }
        }
    }
    fn cuGetErrorString(err: CUresult, out: *mut *const c_char) {
        match ERRORS.iter().find(|(c, _, _)| *c == err) {
            Some((_, _, text)) => put(out, text.as_ptr() as *const c_char),
            None => { put(out, std::ptr::null())?; Err(CUDA_ERROR_INVALID_VALUE) }
        }
    }
    fn cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64) {
        proc_address(symbol, pfn, version, flags, std::ptr::null_mut())
    }
    fn cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: i32, flags: u64, status: *mut i32) {
        proc_address(symbol, pfn, version, flags, status)
    }

    // Devices.
    fn cuDeviceGetCount(count: *mut i32) {
        put(count, initialised()?.devices())
    }
    fn cuDeviceGet(out: *mut CUdevice, ordinal: i32) {
        let s = initialised()?;
        check_device(s, ordinal)?;
        put(out, ordinal)
    }
    fn cuDeviceGetName(name: *mut c_char, len: i32, dev: CUdevice) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        if name.is_null() || len <= 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let text = format!("fakecuda simulated GPU {dev}");
        let n = text.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes; we write n + 1 <= len.
        unsafe {
            std::ptr::copy_nonoverlapping(text.as_ptr(), name as *mut u8, n);
            *name.add(n) = 0;
        }
        Ok(())
    }
    fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) {
        let s = initialised()?;
        put(uuid, device::uuid(check_device(s, dev)?))
    }
    fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: CUdevice) {
        // SAFETY: same contract as cuDeviceGetUuid.
        match unsafe { cuDeviceGetUuid(uuid, dev) } { CUDA_SUCCESS => Ok(()), e => Err(e) }
    }
    fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) {
        let s = initialised()?;
        put(bytes, s.mem_total(check_device(s, dev)?) as usize)
    }
    fn cuDeviceTotalMem(bytes: *mut u32, dev: CUdevice) {
        let s = initialised()?;
        put(bytes, s.mem_total(check_device(s, dev)?).min(u32::MAX as u64) as u32)
    }
    fn cuDeviceGetAttribute(value: *mut i32, attr: i32, dev: CUdevice) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        put(value, device_attribute(attr, dev, s))
    }
    fn cuDeviceComputeCapability(major: *mut i32, minor: *mut i32, dev: CUdevice) {
        let s = initialised()?;
        check_device(s, dev)?;
        put(major, 9)?;
        put(minor, 0)
    }

    // Contexts.
    fn cuDevicePrimaryCtxRetain(out: *mut CUcontext, dev: CUdevice) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        let h = with_proc(|p| {
            if let Some((h, n)) = p.primary.get_mut(&dev) {
                *n += 1;
                return *h;
            }
            let h = p.add(Obj::Ctx { device: dev });
            p.primary.insert(dev, (h, 1));
            h
        });
        put(out, h as CUcontext)
    }
    fn cuDevicePrimaryCtxRelease(dev: CUdevice) { primary_release(dev) }
    fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) { primary_release(dev) }
    fn cuDevicePrimaryCtxGetState(dev: CUdevice, flags: *mut u32, active: *mut i32) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        let n = with_proc(|p| p.primary.get(&dev).map_or(0, |(_, n)| *n));
        put(flags, 0)?;
        put(active, (n > 0) as i32)
    }
    fn cuDevicePrimaryCtxSetFlags(dev: CUdevice, _flags: u32) { check_device(initialised()?, dev).map(|_| ()) }
    fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, _flags: u32) { check_device(initialised()?, dev).map(|_| ()) }
    fn cuDevicePrimaryCtxReset(dev: CUdevice) { check_device(initialised()?, dev).map(|_| ()) }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) { check_device(initialised()?, dev).map(|_| ()) }
    fn cuCtxCreate_v2(out: *mut CUcontext, _flags: u32, dev: CUdevice) { create_ctx(out, dev) }
    fn cuCtxDestroy_v2(ctx: CUcontext) {
        destroy(ctx, |o| matches!(o, Obj::Ctx { .. }))?;
        ctx_stack(|s| s.retain(|&c| c != ctx as usize));
        Ok(())
    }
    fn cuCtxSetCurrent(ctx: CUcontext) {
        initialised()?;
        if !ctx.is_null() {
            ctx_device(ctx as usize)?;
        }
        ctx_stack(|s| {
            s.pop();
            if !ctx.is_null() {
                s.push(ctx as usize);
            }
        });
        Ok(())
    }
    fn cuCtxGetCurrent(out: *mut CUcontext) {
        initialised()?;
        put(out, ctx_stack(|s| s.last().copied()).unwrap_or(0) as CUcontext)
    }
    fn cuCtxPushCurrent_v2(ctx: CUcontext) {
        initialised()?;
        ctx_device(ctx as usize)?;
        ctx_stack(|s| s.push(ctx as usize));
        Ok(())
    }
    fn cuCtxPopCurrent_v2(out: *mut CUcontext) {
        initialised()?;
        let top = ctx_stack(|s| s.pop()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        if !out.is_null() {
            put(out, top as CUcontext)?;
        }
        Ok(())
    }
    fn cuCtxGetDevice(out: *mut CUdevice) {
        let s = initialised()?;
        let ordinal = s.ordinal(current_device()?).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        put(out, ordinal as CUdevice)
    }
    fn cuCtxGetApiVersion(_ctx: CUcontext, version: *mut u32) {
        initialised()?;
        put(version, 12080)
    }
    fn cuCtxSynchronize() {
        let s = initialised()?;
        current_device()?;
        with_proc(|p| p.captures.unsafe_call())?;
        sleep_until(current_ctx_end(s, current_device()?));
        trim_pools(s);
        Ok(())
    }

    // Streams and events.
    fn cuStreamCreate(out: *mut CUstream, flags: u32) {
        initialised()?;
        let dev = current_device()?;
        // CU_STREAM_NON_BLOCKING = 1.
        let blocking = flags & 1 == 0;
        let ctx = ctx_stack(|st| st.last().copied()).unwrap_or(0);
        let h = with_proc(|p| p.add(Obj::Stream { device: dev, tail: Arc::new(AtomicU64::new(0)), blocking, ctx }));
        put(out, h as CUstream)
    }
    fn cuStreamCreateWithPriority(out: *mut CUstream, flags: u32, _priority: i32) {
        // SAFETY: same contract as cuStreamCreate.
        match unsafe { cuStreamCreate(out, flags) } { CUDA_SUCCESS => Ok(()), e => Err(e) }
    }
    fn cuStreamDestroy_v2(h: CUstream) { destroy(h, |o| matches!(o, Obj::Stream { .. })) }
    fn cuStreamSynchronize(h: CUstream) { sync_stream(h, false) }
    fn cuStreamSynchronize_ptsz(h: CUstream) { sync_stream(h, true) }
    fn cuStreamQuery(h: CUstream) { query_stream(h, false) }
    fn cuStreamQuery_ptsz(h: CUstream) { query_stream(h, true) }
    fn cuEventCreate(out: *mut CUevent, _flags: u32) {
        initialised()?;
        let h = with_proc(|p| p.add(Obj::Event { time: None, captured: None }));
        put(out, h as CUevent)
    }
    fn cuEventDestroy_v2(e: CUevent) { destroy(e, |o| matches!(o, Obj::Event { .. })) }
    fn cuEventRecord(e: CUevent, h: CUstream) { record_event(e, h, false) }
    fn cuEventRecord_ptsz(e: CUevent, h: CUstream) { record_event(e, h, true) }
    // Stream capture (see [`capture`]).
    fn cuStreamBeginCapture(h: CUstream) { begin_capture(h, false, capture::MODE_GLOBAL) }
    fn cuStreamBeginCapture_ptsz(h: CUstream) { begin_capture(h, true, capture::MODE_GLOBAL) }
    fn cuStreamBeginCapture_v2(h: CUstream, mode: u32) { begin_capture(h, false, mode) }
    fn cuStreamBeginCapture_v2_ptsz(h: CUstream, mode: u32) { begin_capture(h, true, mode) }
    fn cuStreamEndCapture(h: CUstream, graph: *mut CUgraph) { end_capture(h, false, graph) }
    fn cuStreamEndCapture_ptsz(h: CUstream, graph: *mut CUgraph) { end_capture(h, true, graph) }
    fn cuStreamIsCapturing(h: CUstream, status: *mut u32) { put(status, capture_status(h, false)?.0) }
    fn cuStreamIsCapturing_ptsz(h: CUstream, status: *mut u32) { put(status, capture_status(h, true)?.0) }
    fn cuStreamGetCaptureInfo(h: CUstream, status: *mut u32, id: *mut u64) {
        let (st, i) = capture_status(h, false)?;
        put(status, st)?;
        if !id.is_null() { put(id, i)?; }
        Ok(())
    }
    fn cuStreamGetCaptureInfo_v2(h: CUstream, status: *mut u32, id: *mut u64, graph: *mut CUgraph, deps: *mut *const CUgraphNode, n: *mut usize) {
        let (st, i) = capture_status(h, false)?;
        put(status, st)?;
        if !id.is_null() { put(id, i)?; }
        // The graph being built is not an object here: none is handed out.
        if !graph.is_null() { put(graph, std::ptr::null_mut())?; }
        if !deps.is_null() { put(deps, std::ptr::null())?; }
        if !n.is_null() { put(n, 0)?; }
        Ok(())
    }
    fn cuThreadExchangeStreamCaptureMode(mode: *mut u32) {
        let old = capture::exchange_mode(get(mode)?)?;
        put(mode, old)
    }
    fn cuEventQuery(e: CUevent) {
        initialised()?;
        match event_time(e)? {
            Some(t) if t > now_ns() => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    }
    fn cuEventSynchronize(e: CUevent) {
        let s = initialised()?;
        if let Some(t) = event_time(e)? {
            sleep_until(t);
        }
        trim_pools(s);
        Ok(())
    }
    fn cuStreamWaitEvent(h: CUstream, e: CUevent, _flags: u32) { wait_event(h, e, false) }
    fn cuStreamWaitEvent_ptsz(h: CUstream, e: CUevent, _flags: u32) { wait_event(h, e, true) }
    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }
    fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }

    // Modules and launches.
    fn cuModuleLoadData(out: *mut CUmodule, image: *const c_void) {
        initialised()?;
        current_device()?;
        if image.is_null() {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        let h = with_proc(|p| p.add(Obj::Module));
        put(out, h as CUmodule)
    }
    fn cuModuleUnload(m: CUmodule) { destroy(m, |o| matches!(o, Obj::Module)) }
    fn cuModuleGetFunction(out: *mut CUfunction, m: CUmodule, name: *const c_char) {
        initialised()?;
        if name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_proc(|p| match p.objects.get(&(m as usize)) { Some(Obj::Module) => Ok(()), _ => Err(CUDA_ERROR_INVALID_HANDLE) })?;
        // SAFETY: non-null NUL-terminated string from the caller.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        let h = with_proc(|p| p.add(Obj::Function(function_for(&name))));
        put(out, h as CUfunction)
    }
    fn cuLaunchKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, _bx: u32, _by: u32, _bz: u32, _shmem: u32, h: CUstream, params: *mut *mut c_void, _extra: *mut *mut c_void) {
        launch(f, [gx, gy, gz], h, params, false, Kind::Kernel)
    }
    fn cuLaunchKernel_ptsz(f: CUfunction, gx: u32, gy: u32, gz: u32, _bx: u32, _by: u32, _bz: u32, _shmem: u32, h: CUstream, params: *mut *mut c_void, _extra: *mut *mut c_void) {
        launch(f, [gx, gy, gz], h, params, true, Kind::Kernel)
    }
    fn cuLaunchCooperativeKernel(f: CUfunction, gx: u32, gy: u32, gz: u32, _bx: u32, _by: u32, _bz: u32, _shmem: u32, h: CUstream, params: *mut *mut c_void) {
        launch(f, [gx, gy, gz], h, params, false, Kind::Cooperative)
    }
    fn cuLaunchCooperativeKernel_ptsz(f: CUfunction, gx: u32, gy: u32, gz: u32, _bx: u32, _by: u32, _bz: u32, _shmem: u32, h: CUstream, params: *mut *mut c_void) {
        launch(f, [gx, gy, gz], h, params, true, Kind::Cooperative)
    }
    fn cuLaunchKernelEx(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = config_ref(config)?;
        launch(f, [c.grid_dim_x, c.grid_dim_y, c.grid_dim_z], c.h_stream, params, false, Kind::Kernel)
    }
    fn cuLaunchKernelEx_ptsz(config: *const CUlaunchConfig, f: CUfunction, params: *mut *mut c_void, _extra: *mut *mut c_void) {
        let c = config_ref(config)?;
        launch(f, [c.grid_dim_x, c.grid_dim_y, c.grid_dim_z], c.h_stream, params, true, Kind::Kernel)
    }

    // Graphs.
    fn cuGraphCreate(out: *mut CUgraph, _flags: u32) {
        initialised()?;
        let h = with_proc(|p| {
            p.add(Obj::Graph {
                nodes: Vec::new(),
                allocs: Vec::new(),
            })
        });
        put(out, h as CUgraph)
    }
    fn cuGraphAddKernelNode(node: *mut CUgraphNode, graph: CUgraph, _deps: *const CUgraphNode, _n: usize, params: *const CudaKernelNodeParams) {
        add_kernel_node(node, graph, params)
    }
    fn cuGraphAddKernelNode_v2(node: *mut CUgraphNode, graph: CUgraph, _deps: *const CUgraphNode, _n: usize, params: *const CudaKernelNodeParams) {
        add_kernel_node(node, graph, params)
    }
    fn cuGraphInstantiateWithFlags(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) { instantiate(exec, graph, flags) }
    fn cuGraphInstantiate_v2(exec: *mut CUgraphExec, graph: CUgraph, _err: *mut CUgraphNode, _log: *mut c_char, _size: usize) {
        instantiate(exec, graph, 0)
    }
    fn cuGraphAddMemAllocNode(node: *mut CUgraphNode, graph: CUgraph, _deps: *const CUgraphNode, _n: usize, params: *mut c_void) {
        add_mem_alloc_node(node, graph, params)
    }
    fn cuGraphAddMemFreeNode(node: *mut CUgraphNode, graph: CUgraph, _deps: *const CUgraphNode, _n: usize, dptr: CUdeviceptr) {
        add_mem_free_node(node, graph, dptr)
    }
    fn cuDeviceGraphMemTrim(dev: CUdevice) { graph_mem_trim(dev) }
    fn cuDeviceGetGraphMemAttribute(dev: CUdevice, attr: i32, value: *mut c_void) { graph_mem_attribute(dev, attr, value) }
    fn cuDeviceSetGraphMemAttribute(dev: CUdevice, attr: i32, value: *mut c_void) { set_graph_mem_attribute(dev, attr, value) }
    fn cuGraphLaunch(exec: CUgraphExec, h: CUstream) { graph_launch(exec, h, false) }
    fn cuGraphLaunch_ptsz(exec: CUgraphExec, h: CUstream) { graph_launch(exec, h, true) }
    fn cuGraphExecDestroy(exec: CUgraphExec) { destroy(exec, |o| matches!(o, Obj::Exec { .. })) }
    fn cuGraphDestroy(graph: CUgraph) { destroy(graph, |o| matches!(o, Obj::Graph { .. })) }

    // Memory.
    fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) { mem_info(free, total) }
    fn cuMemGetInfo(free: *mut u32, total: *mut u32) {
        let s = initialised()?;
        let (f, t) = s.mem_info(current_device()?);
        put(free, f.min(u32::MAX as u64) as u32)?;
        put(total, t.min(u32::MAX as u64) as u32)
    }
    fn cuMemAlloc_v2(dptr: *mut CUdeviceptr, bytes: usize) {
        initialised()?;
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(dptr, alloc(current_device()?, bytes as u64)?)
    }
    fn cuMemAllocPitch_v2(dptr: *mut CUdeviceptr, pitch: *mut usize, width: usize, height: usize, elem: u32) {
        initialised()?;
        if dptr.is_null() || pitch.is_null() || !matches!(elem, 4 | 8 | 16) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let p = width.div_ceil(512) * 512;
        put(dptr, alloc(current_device()?, (p as u64).saturating_mul(height as u64))?)?;
        put(pitch, p)
    }
    fn cuMemAllocManaged(dptr: *mut CUdeviceptr, bytes: usize, _flags: u32) {
        initialised()?;
        if dptr.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        put(dptr, alloc(current_device()?, bytes as u64)?)
    }
    fn cuMemAllocAsync(dptr: *mut CUdeviceptr, bytes: usize, h: CUstream) { pool_alloc(dptr, bytes, None, h, false) }
    fn cuMemAllocAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, h: CUstream) { pool_alloc(dptr, bytes, None, h, true) }
    fn cuMemAllocFromPoolAsync(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, h: CUstream) {
        pool_alloc(dptr, bytes, Some(pool), h, false)
    }
    fn cuMemAllocFromPoolAsync_ptsz(dptr: *mut CUdeviceptr, bytes: usize, pool: CUmemoryPool, h: CUstream) {
        pool_alloc(dptr, bytes, Some(pool), h, true)
    }

    // Memory pools (see [`pool`]).
    fn cuDeviceGetDefaultMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        put(pool, with_proc(|p| p.default_pool(dev)) as CUmemoryPool)
    }
    fn cuDeviceGetMemPool(pool: *mut CUmemoryPool, dev: CUdevice) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        put(pool, with_proc(|p| p.current_pool(dev)) as CUmemoryPool)
    }
    fn cuDeviceSetMemPool(dev: CUdevice, pool: CUmemoryPool) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        with_proc(|p| match p.pools.get(&(pool as usize)) {
            Some(pl) if pl.device == dev => {
                p.current_pool.insert(dev, pool as usize);
                Ok(())
            }
            _ => Err(CUDA_ERROR_INVALID_VALUE),
        })
    }
    fn cuMemPoolCreate(pool: *mut CUmemoryPool, props: *const c_void) {
        let s = initialised()?;
        // CUmemPoolProps: allocation type, handle types, location type, location id.
        let props = get(props as *const [i32; 4])?;
        let dev = check_device(s, props[3])?;
        let h = with_proc(|p| {
            let h = p.add(Obj::MemPool);
            p.pools.insert(h, pool::Pool::new(dev));
            h
        });
        put(pool, h as CUmemoryPool)
    }
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        let s = initialised()?;
        let h = pool as usize;
        let pl = with_proc(|p| {
            if p.default_pool.values().any(|&d| d == h) {
                return Err(CUDA_ERROR_INVALID_VALUE); // a default pool stays
            }
            let pl = p.pools.remove(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            p.objects.remove(&h);
            p.current_pool.retain(|_, c| *c != h);
            Ok(pl)
        })?;
        s.free(pl.device, pl.reserved);
        Ok(())
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: i32, value: *mut c_void) { pool_get_attribute(pool, attr, value) }
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: i32, value: *mut c_void) { pool_set_attribute(pool, attr, value) }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) {
        let s = initialised()?;
        let (dev, excess) = with_pool(pool, |pl| Ok((pl.device, pl.trim(keep as u64))))?;
        s.free(dev, excess);
        Ok(())
    }
    fn cuMemFree_v2(ptr: CUdeviceptr) { free(ptr) }
    fn cuMemFreeAsync(ptr: CUdeviceptr, h: CUstream) {
        if let Some(r) = captured_free(h, false, ptr) {
            return r;
        }
        check_stream(h, false)?;
        free(ptr)
    }
    fn cuMemFreeAsync_ptsz(ptr: CUdeviceptr, h: CUstream) {
        if let Some(r) = captured_free(h, true, ptr) {
            return r;
        }
        check_stream(h, true)?;
        free(ptr)
    }
    fn cuMemCreate(handle: *mut u64, size: usize, prop: *const CUmemAllocationProp, _flags: u64) {
        let s = initialised()?;
        let prop = get(prop as *const [u32; 4])?;
        let dev = check_device(s, prop[3] as i32)?;
        if handle.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        s.alloc(dev, size as u64)?;
        let h = with_proc(|p| {
            let h = p.add(Obj::Pool) as u64;
            p.physical.insert(h, (dev, size as u64));
            h
        });
        put(handle, h)
    }
    fn cuMemRelease(handle: u64) {
        let s = initialised()?;
        let (dev, size) = with_proc(|p| {
            p.objects.remove(&(handle as usize));
            p.physical.remove(&handle)
        })
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        s.free(dev, size);
        Ok(())
    }
    // Virtual memory management: an address range is reserved, then
    // `cuMemCreate` handles are mapped into it (as often as wanted: the
    // memory is the handle's, allocated once at creation).
    fn cuMemAddressReserve(ptr: *mut CUdeviceptr, size: usize, _align: usize, _addr: CUdeviceptr, _flags: u64) {
        initialised()?;
        if size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let va = with_proc(|p| {
            // Above every device's allocations: 0x7f00_0000_0000.
            let va = 0x7f00_0000_0000u64 + p.next_va;
            p.next_va += (size as u64).div_ceil(2 << 20) * (2 << 20);
            va
        });
        put(ptr, va)
    }
    fn cuMemAddressFree(_ptr: CUdeviceptr, _size: usize) { initialised().map(|_| ()) }
    fn cuMemMap(_ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, _flags: u64) {
        initialised()?;
        let bytes = with_proc(|p| p.physical.get(&handle).map(|(_, b)| *b)).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
        if (offset as u64).saturating_add(size as u64) > bytes {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        Ok(())
    }
    fn cuMemUnmap(_ptr: CUdeviceptr, _size: usize) { initialised().map(|_| ()) }
    fn cuMemSetAccess(_ptr: CUdeviceptr, _size: usize, _desc: *const c_void, _count: usize) { initialised().map(|_| ()) }

    // Interprocess memory: a handle names an allocation of its owner;
    // opening it maps the owner's memory (the opener allocates nothing).
    fn cuIpcGetMemHandle(handle: *mut IpcMemHandle, dptr: CUdeviceptr) {
        initialised()?;
        let (dev, bytes) = with_proc(|p| p.allocs.get(&dptr).copied()).ok_or(CUDA_ERROR_INVALID_VALUE)?;
        let mut h = IpcMemHandle { reserved: [0; 64] };
        h.reserved[..8].copy_from_slice(&dptr.to_le_bytes());
        h.reserved[8..16].copy_from_slice(&bytes.to_le_bytes());
        h.reserved[16..24].copy_from_slice(&(dev as u64).to_le_bytes());
        h.reserved[24..28].copy_from_slice(&std::process::id().to_le_bytes());
        put(handle, h)
    }
    fn cuIpcOpenMemHandle_v2(dptr: *mut CUdeviceptr, handle: IpcMemHandle, _flags: u32) {
        initialised()?;
        let word = |i: usize| u64::from_le_bytes(handle.reserved[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let owner = u32::from_le_bytes(handle.reserved[24..28].try_into().unwrap_or_default());
        if owner == 0 || owner == std::process::id() {
            return Err(CUDA_ERROR_INVALID_CONTEXT); // not from another process
        }
        // SAFETY: kill with signal 0 only checks that the owner exists.
        if unsafe { libc::kill(owner as i32, 0) } != 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ptr = word(0);
        with_proc(|p| p.ipc_opened.insert(ptr));
        put(dptr, ptr)
    }
    fn cuIpcCloseMemHandle(dptr: CUdeviceptr) {
        initialised()?;
        if with_proc(|p| p.ipc_opened.remove(&dptr)) { Ok(()) } else { Err(CUDA_ERROR_INVALID_VALUE) }
    }

    // Page-locked host memory: the host's, never the device's.
    fn cuMemHostAlloc(pp: *mut *mut c_void, bytes: usize, _flags: u32) { host_alloc(pp, bytes) }
    fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) { host_alloc(pp, bytes) }
    fn cuMemFreeHost(p: *mut c_void) {
        initialised()?;
        // SAFETY: memory host_alloc returned (libc::malloc), freed once.
        unsafe { libc::free(p) };
        Ok(())
    }

    // CUDA arrays (textures, surfaces): device memory by their descriptor.
    fn cuArrayCreate_v2(out: *mut usize, desc: *const [usize; 3]) {
        // CUDA_ARRAY_DESCRIPTOR: width, height, then format and channels (u32 each).
        let d = get(desc)?;
        let bytes = array_bytes([d[0], d[1], 0], d[2] as u32, (d[2] >> 32) as u32, 1)?;
        create_array(out, bytes)
    }
    fn cuArray3DCreate_v2(out: *mut usize, desc: *const [usize; 4]) {
        // CUDA_ARRAY3D_DESCRIPTOR: width, height, depth, format and channels.
        let d = get(desc)?;
        let bytes = array_bytes([d[0], d[1], d[2]], d[3] as u32, (d[3] >> 32) as u32, 1)?;
        create_array(out, bytes)
    }
    fn cuMipmappedArrayCreate(out: *mut usize, desc: *const [usize; 4], levels: u32) {
        let d = get(desc)?;
        let bytes = array_bytes([d[0], d[1], d[2]], d[3] as u32, (d[3] >> 32) as u32, levels)?;
        create_array(out, bytes)
    }
    fn cuArrayDestroy(a: usize) { destroy_array(a) }
    fn cuMipmappedArrayDestroy(a: usize) { destroy_array(a) }
    fn cuMemcpyHtoD_v2(_dst: CUdeviceptr, _src: *const c_void, _n: usize) { sync_copy() }
    fn cuMemcpyHtoD_v2_ptds(_dst: CUdeviceptr, _src: *const c_void, _n: usize) { sync_copy_ptds() }
    fn cuMemcpyDtoH_v2(dst: *mut c_void, _src: CUdeviceptr, n: usize) {
        sync_copy()?;
        zero(dst, n)
    }
    fn cuMemcpyDtoH_v2_ptds(dst: *mut c_void, _src: CUdeviceptr, n: usize) {
        sync_copy_ptds()?;
        zero(dst, n)
    }
    fn cuMemcpyDtoD_v2(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize) { sync_copy() }
    fn cuMemcpyDtoD_v2_ptds(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize) { sync_copy_ptds() }
    fn cuMemcpy(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize) { sync_copy() }
    fn cuMemcpy_ptds(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize) { sync_copy_ptds() }
    fn cuMemcpyHtoDAsync_v2(_dst: CUdeviceptr, _src: *const c_void, _n: usize, h: CUstream) { check_stream(h, false) }
    fn cuMemcpyHtoDAsync_v2_ptsz(_dst: CUdeviceptr, _src: *const c_void, _n: usize, h: CUstream) { check_stream(h, true) }
    fn cuMemcpyDtoHAsync_v2(dst: *mut c_void, _src: CUdeviceptr, n: usize, h: CUstream) {
        check_stream(h, false)?;
        zero(dst, n)
    }
    fn cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, _src: CUdeviceptr, n: usize, h: CUstream) {
        check_stream(h, true)?;
        zero(dst, n)
    }
    fn cuMemcpyAsync(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize, h: CUstream) { check_stream(h, false) }
    fn cuMemcpyAsync_ptsz(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize, h: CUstream) { check_stream(h, true) }
    fn cuMemsetD8_v2(_dst: CUdeviceptr, _v: u8, _n: usize) { sync_copy() }
    fn cuMemsetD8_v2_ptds(_dst: CUdeviceptr, _v: u8, _n: usize) { sync_copy_ptds() }
    fn cuMemsetD32_v2(_dst: CUdeviceptr, _v: u32, _n: usize) { sync_copy() }
    fn cuMemsetD32_v2_ptds(_dst: CUdeviceptr, _v: u32, _n: usize) { sync_copy_ptds() }
    fn cuMemsetD8Async(_dst: CUdeviceptr, _v: u8, _n: usize, h: CUstream) { check_stream(h, false) }
    fn cuMemsetD8Async_ptsz(_dst: CUdeviceptr, _v: u8, _n: usize, h: CUstream) { check_stream(h, true) }
    fn cuMemsetD32Async(_dst: CUdeviceptr, _v: u32, _n: usize, h: CUstream) { check_stream(h, false) }
    fn cuMemsetD32Async_ptsz(_dst: CUdeviceptr, _v: u32, _n: usize, h: CUstream) { check_stream(h, true) }
}

fn config_ref<'a>(c: *const CUlaunchConfig) -> Result<&'a CUlaunchConfig, CUresult> {
    if c.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null; the caller passes a valid config by contract.
    Ok(unsafe { &*c })
}

/// Device memory has no contents: copies from it read zeros.
fn zero(dst: *mut c_void, n: usize) -> R {
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's host buffer holds `n` bytes by contract.
    unsafe { std::ptr::write_bytes(dst as *mut u8, 0, n) };
    Ok(())
}
