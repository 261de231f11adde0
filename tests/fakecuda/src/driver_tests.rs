//! Stream capture and memory pools in the simulator behave as the driver
//! documents them (see [`crate::capture`], [`crate::pool`]): the entry
//! points are called directly, in this test process, with the
//! simulator's state in a private directory.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::*;
use crate::capture::{MODE_GLOBAL, MODE_RELAXED, MODE_THREAD_LOCAL, STATUS_ACTIVE, STATUS_NONE};
use std::sync::Once;
use std::time::{Duration, Instant};

const NON_BLOCKING: u32 = 1;

/// A context current on this thread and a 1 ms kernel; the tests take
/// turns (captures are per process: one test's global capture forbids
/// another's synchronisation).
pub(super) struct Dev {
    ctx: usize,
    kernel: usize,
    _turn: std::sync::MutexGuard<'static, ()>,
}

pub(super) fn dev() -> Dev {
    static TURN: Mutex<()> = Mutex::new(());
    let turn = TURN.lock().unwrap_or_else(|p| p.into_inner());
    static DIR: Once = Once::new();
    DIR.call_once(|| {
        let dir = std::env::temp_dir().join(format!("fakecuda-capture-{}", std::process::id()));
        // SAFETY: set once, before any test of this binary reads the
        // environment (every test starts here; the Once makes the others
        // wait until it is set).
        unsafe { std::env::set_var("FAKECUDA_DIR", dir) };
    });
    // SAFETY: the simulator's entry points with valid out-pointers.
    unsafe {
        assert_eq!(cuInit(0), 0);
        let mut ctx = std::ptr::null_mut();
        assert_eq!(cuDevicePrimaryCtxRetain(&mut ctx, 0), 0);
        assert_eq!(cuCtxSetCurrent(ctx), 0);
        let mut m = std::ptr::null_mut();
        assert_eq!(cuModuleLoadData(&mut m, c"image".as_ptr().cast()), 0);
        let mut f = std::ptr::null_mut();
        assert_eq!(cuModuleGetFunction(&mut f, m, c"fixed_1000us".as_ptr()), 0);
        Dev {
            ctx: ctx as usize,
            kernel: f as usize,
            _turn: turn,
        }
    }
}

impl Dev {
    /// Makes the context current on the calling thread (another thread).
    pub(super) fn enter(&self) {
        // SAFETY: a context of this process.
        assert_eq!(unsafe { cuCtxSetCurrent(self.ctx as CUcontext) }, 0);
    }

    pub(super) fn stream(&self, flags: u32) -> CUstream {
        let mut s = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        assert_eq!(unsafe { cuStreamCreate(&mut s, flags) }, 0);
        s
    }

    fn launch(&self, s: CUstream) -> CUresult {
        let null = std::ptr::null_mut();
        // SAFETY: a function of this process, no parameters.
        unsafe {
            cuLaunchKernel(
                self.kernel as CUfunction,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                s,
                null,
                null,
            )
        }
    }
}

fn begin(s: CUstream, mode: u32) -> CUresult {
    // SAFETY: plain handle and value arguments.
    unsafe { cuStreamBeginCapture_v2(s, mode) }
}

fn end(s: CUstream) -> (CUresult, CUgraph) {
    let mut g = 0x1 as CUgraph; // the driver sets it, even to null
    // SAFETY: out-pointer to a local.
    let r = unsafe { cuStreamEndCapture(s, &mut g) };
    (r, g)
}

fn status(s: CUstream) -> (CUresult, u32) {
    let mut st = 99;
    // SAFETY: out-pointer to a local.
    let r = unsafe { cuStreamIsCapturing(s, &mut st) };
    (r, st)
}

fn ctx_sync() -> CUresult {
    // SAFETY: no arguments.
    unsafe { cuCtxSynchronize() }
}

fn on_other_thread<T: Send>(d: &Dev, f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|sc| {
        sc.spawn(|| {
            d.enter();
            f()
        })
        .join()
        .unwrap()
    })
}

/// Instantiates graph `g` and launches it on `s`: the time until it is
/// done.
fn replay(g: CUgraph, s: CUstream) -> Duration {
    let mut exec = std::ptr::null_mut();
    let t = Instant::now();
    // SAFETY: out-pointer to a local, a graph and a stream of this process.
    unsafe {
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec, g, 0), 0);
        assert_eq!(cuGraphLaunch(exec, s), 0);
    }
    synced_after(t, s)
}

/// Time from `t` until `s` is synchronised.
fn synced_after(t: Instant, s: CUstream) -> Duration {
    // SAFETY: a stream of this process.
    assert_eq!(unsafe { cuStreamSynchronize(s) }, 0);
    t.elapsed()
}

/// A device-to-device copy does not wait for the host ("for transfers
/// from device memory to device memory, no host-side synchronization is
/// performed", the driver API's notes on synchronous calls): it returns
/// while the kernels before it still run. A device-to-host copy waits.
#[test]
fn a_device_to_device_copy_does_not_wait_for_the_work_before_it() {
    let d = dev();
    let t = Instant::now();
    for _ in 0..20 {
        assert_eq!(d.launch(std::ptr::null_mut()), 0);
    }
    // SAFETY: device pointers the simulator does not dereference.
    assert_eq!(unsafe { cuMemcpyDtoD_v2(0x20, 0x10, 8) }, 0);
    assert!(t.elapsed() < Duration::from_millis(15), "{:?}", t.elapsed());
    let mut host = [0u8; 8];
    // SAFETY: a host buffer of 8 bytes.
    let r = unsafe { cuMemcpyDtoH_v2(host.as_mut_ptr().cast(), 0x10, 8) };
    assert_eq!(r, 0);
    assert!(
        t.elapsed() >= Duration::from_millis(20),
        "{:?}",
        t.elapsed()
    );
}

#[test]
fn captured_kernels_run_only_when_the_graph_is_launched() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    assert_eq!(status(s), (0, STATUS_ACTIVE));
    for _ in 0..5 {
        assert_eq!(d.launch(s), 0);
    }
    let (r, g) = end(s);
    assert_eq!(r, 0);
    assert!(!g.is_null());
    assert_eq!(status(s), (0, STATUS_NONE));
    // SAFETY: a stream of this process.
    assert_eq!(unsafe { cuStreamQuery(s) }, 0, "nothing was queued");
    let took = replay(g, s);
    assert!(
        took >= Duration::from_millis(5),
        "the five kernels ran: {took:?}"
    );
}

#[test]
fn a_context_sync_from_another_thread_invalidates_a_global_capture() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    assert_eq!(d.launch(s), 0);
    assert_eq!(
        on_other_thread(&d, ctx_sync),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(status(s), (0, capture::STATUS_INVALIDATED));
    assert_eq!(d.launch(s), CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    let (r, g) = end(s);
    assert_eq!(r, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    assert!(g.is_null());
    assert_eq!(ctx_sync(), 0, "the capture is over");
}

#[test]
fn blocking_copies_and_legacy_waits_are_unsafe_during_a_global_capture() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    type Call = fn() -> CUresult;
    let calls: [(&str, Call); 3] = [
        ("cuMemcpyDtoH", || {
            // SAFETY: 0 bytes: no memory is touched.
            unsafe { cuMemcpyDtoH_v2(std::ptr::null_mut(), 0x10, 0) }
        }),
        ("legacy stream sync", || {
            // SAFETY: null is the legacy stream.
            unsafe { cuStreamSynchronize(std::ptr::null_mut()) }
        }),
        ("legacy stream query", || {
            // SAFETY: null is the legacy stream.
            unsafe { cuStreamQuery(std::ptr::null_mut()) }
        }),
    ];
    for (what, call) in calls {
        assert_eq!(begin(s, MODE_GLOBAL), 0);
        assert_eq!(
            on_other_thread(&d, call),
            CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
            "{what}"
        );
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED, "{what}");
    }
    // The per-thread default stream is not the legacy one: allowed.
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    // SAFETY: the per-thread default stream of the current context.
    let r = on_other_thread(&d, || unsafe {
        cuStreamSynchronize_ptsz(std::ptr::null_mut())
    });
    assert_eq!(r, 0);
    assert_eq!(end(s).0, 0);
}

#[test]
fn thread_local_and_relaxed_captures_forbid_less() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    // Thread-local: other threads may sync, the capturing one may not.
    assert_eq!(begin(s, MODE_THREAD_LOCAL), 0);
    assert_eq!(on_other_thread(&d, ctx_sync), 0);
    assert_eq!(ctx_sync(), CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
    assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    // Relaxed: nobody is forbidden.
    assert_eq!(begin(s, MODE_RELAXED), 0);
    assert_eq!(ctx_sync(), 0);
    assert_eq!(on_other_thread(&d, ctx_sync), 0);
    assert_eq!(end(s).0, 0);
    // A thread in relaxed mode may sync during a global capture.
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    let (r, old) = on_other_thread(&d, || {
        let mut mode = MODE_RELAXED;
        // SAFETY: in/out pointer to a local.
        let old = unsafe { cuThreadExchangeStreamCaptureMode(&mut mode) };
        assert_eq!(old, 0);
        (ctx_sync(), mode)
    });
    assert_eq!((r, old), (0, MODE_GLOBAL));
    assert_eq!(end(s).0, 0);
}

#[test]
fn syncing_or_querying_the_capturing_stream_invalidates_it() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    for query in [false, true] {
        assert_eq!(begin(s, MODE_GLOBAL), 0);
        // SAFETY: a stream of this process.
        let r = unsafe {
            if query {
                cuStreamQuery(s)
            } else {
                cuStreamSynchronize(s)
            }
        };
        assert_eq!(r, CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED);
        assert_eq!(end(s).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    }
}

#[test]
fn legacy_stream_work_beside_a_blocking_capture_is_implicit() {
    let d = dev();
    let blocking = d.stream(0);
    assert_eq!(begin(blocking, MODE_RELAXED), 0);
    assert_eq!(
        status(std::ptr::null_mut()).0,
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    );
    assert_eq!(
        d.launch(std::ptr::null_mut()),
        CUDA_ERROR_STREAM_CAPTURE_IMPLICIT
    );
    assert_eq!(end(blocking).0, CUDA_ERROR_STREAM_CAPTURE_INVALIDATED);
    // Beside a non-blocking capture the legacy stream works.
    let s = d.stream(NON_BLOCKING);
    assert_eq!(begin(s, MODE_RELAXED), 0);
    assert_eq!(status(std::ptr::null_mut()), (0, STATUS_NONE));
    assert_eq!(d.launch(std::ptr::null_mut()), 0);
    assert_eq!(end(s).0, 0);
}

#[test]
fn misuse_gets_the_drivers_errors() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    let h = s as usize; // a handle another thread may use
    assert_eq!(
        begin(std::ptr::null_mut(), MODE_GLOBAL),
        CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED
    );
    assert_eq!(begin(s, 7), CUDA_ERROR_INVALID_VALUE);
    assert_eq!(end(s).0, CUDA_ERROR_ILLEGAL_STATE, "not capturing");
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    assert_eq!(begin(s, MODE_GLOBAL), CUDA_ERROR_ILLEGAL_STATE, "twice");
    assert_eq!(
        on_other_thread(&d, move || end(h as CUstream).0),
        CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD
    );
    assert_eq!(status(s), (0, STATUS_ACTIVE), "still capturing");
    assert_eq!(end(s).0, 0);
    // A relaxed capture may end on any thread.
    assert_eq!(begin(s, MODE_RELAXED), 0);
    assert_eq!(on_other_thread(&d, move || end(h as CUstream).0), 0);
}

#[test]
fn a_stream_waiting_on_a_captured_event_joins_the_capture() {
    let d = dev();
    let (s, side) = (d.stream(NON_BLOCKING), d.stream(NON_BLOCKING));
    let mut e = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    assert_eq!(unsafe { cuEventCreate(&mut e, 0) }, 0);
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    assert_eq!(d.launch(s), 0);
    // SAFETY: an event and streams of this process.
    unsafe {
        assert_eq!(cuEventRecord(e, s), 0);
        assert_eq!(cuEventQuery(e), CUDA_ERROR_CAPTURED_EVENT);
        assert_eq!(cuStreamWaitEvent(side, e, 0), 0);
    }
    assert_eq!(status(side), (0, STATUS_ACTIVE));
    assert_eq!(d.launch(side), 0);
    assert_eq!(d.launch(side), 0);
    assert_eq!(end(side).0, CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
    let (r, g) = end(s);
    assert_eq!(r, 0);
    assert_eq!(status(side), (0, STATUS_NONE), "left with the capture");
    let took = replay(g, s);
    assert!(
        took >= Duration::from_millis(3),
        "all three kernels: {took:?}"
    );
}

pub(super) fn free_mem() -> u64 {
    let (mut f, mut t) = (0usize, 0usize);
    // SAFETY: out-pointers to locals.
    assert_eq!(unsafe { cuMemGetInfo_v2(&mut f, &mut t) }, 0);
    f as u64
}

fn pool_attr(pool: CUmemoryPool, attr: i32) -> u64 {
    let mut v = 0u64;
    // SAFETY: a u64 attribute into a local.
    let r = unsafe { cuMemPoolGetAttribute(pool, attr, (&mut v as *mut u64).cast()) };
    assert_eq!(r, 0);
    v
}

pub(super) const MIB: u64 = 1 << 20;

#[test]
fn freed_pool_memory_stays_reserved_until_a_sync_trims_it_to_the_threshold() {
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    let alloc = |bytes: u64| {
        let mut p = 0u64;
        // SAFETY: out-pointer to a local, a stream of this process.
        assert_eq!(unsafe { cuMemAllocAsync(&mut p, bytes as usize, s) }, 0);
        p
    };
    // SAFETY: pointers this test allocated, a stream of this process.
    let free = |p: u64| assert_eq!(unsafe { cuMemFreeAsync(p, s) }, 0);
    let mut pool = std::ptr::null_mut();
    let mut current = std::ptr::null_mut();
    // SAFETY: out-pointers to locals.
    unsafe {
        assert_eq!(cuDeviceGetDefaultMemPool(&mut pool, 0), 0);
        assert_eq!(cuDeviceGetMemPool(&mut current, 0), 0);
    }
    assert_eq!(pool, current, "the default pool is the current one");
    let f0 = free_mem();
    let p = alloc(256 * MIB);
    assert_eq!(free_mem(), f0 - 256 * MIB);
    free(p);
    assert_eq!(free_mem(), f0 - 256 * MIB, "the pool keeps it");
    assert_eq!(pool_attr(pool, pool::ATTR_RESERVED_MEM_CURRENT), 256 * MIB);
    assert_eq!(pool_attr(pool, pool::ATTR_USED_MEM_CURRENT), 0);
    synced_after(Instant::now(), s);
    assert_eq!(free_mem(), f0, "threshold 0: given back at the sync");
    // An unbounded threshold (PyTorch's cudaMallocAsync backend): kept.
    let mut max = u64::MAX;
    // SAFETY: a u64 attribute from a local.
    let r = unsafe {
        cuMemPoolSetAttribute(
            pool,
            pool::ATTR_RELEASE_THRESHOLD,
            (&mut max as *mut u64).cast(),
        )
    };
    assert_eq!(r, 0);
    let p = alloc(256 * MIB);
    free(p);
    synced_after(Instant::now(), s);
    assert_eq!(free_mem(), f0 - 256 * MIB, "kept through the sync");
    let p = alloc(128 * MIB);
    assert_eq!(free_mem(), f0 - 256 * MIB, "reused, not reserved again");
    free(p);
    // SAFETY: a pool of this process.
    assert_eq!(unsafe { cuMemPoolTrimTo(pool, 0) }, 0);
    assert_eq!(free_mem(), f0, "trimmed");
    assert_eq!(pool_attr(pool, pool::ATTR_RESERVED_MEM_HIGH), 256 * MIB);
    // A pool of its own gives its memory back when destroyed.
    let props: [i32; 8] = [1, 0, 1, 0, 0, 0, 0, 0];
    let mut own = std::ptr::null_mut();
    let mut p = 0u64;
    // SAFETY: CUmemPoolProps' leading fields; out-pointers to locals.
    unsafe {
        assert_eq!(cuMemPoolCreate(&mut own, props.as_ptr().cast()), 0);
        assert_eq!(
            cuMemAllocFromPoolAsync(&mut p, (64 * MIB) as usize, own, s),
            0
        );
        assert_eq!(cuMemFreeAsync(p, s), 0);
        assert_eq!(
            cuMemPoolDestroy(pool),
            CUDA_ERROR_INVALID_VALUE,
            "a default pool stays"
        );
    }
    let mut keep = u64::MAX;
    // SAFETY: a u64 attribute from a local; a pool of this process.
    unsafe {
        let _ = cuMemPoolSetAttribute(
            own,
            pool::ATTR_RELEASE_THRESHOLD,
            (&mut keep as *mut u64).cast(),
        );
        assert_eq!(free_mem(), f0 - 64 * MIB);
        assert_eq!(cuMemPoolDestroy(own), 0);
    }
    assert_eq!(free_mem(), f0);
}

#[test]
fn a_context_synchronises_only_its_own_work() {
    let d = dev();
    let mut other = std::ptr::null_mut();
    let mut m = std::ptr::null_mut();
    let mut long = std::ptr::null_mut();
    let null = std::ptr::null_mut();
    let t = Instant::now();
    // SAFETY: out-pointers to locals; a context, module and function of
    // this process; no kernel parameters.
    unsafe {
        assert_eq!(cuCtxCreate_v2(&mut other, 0, 0), 0); // now current
        assert_eq!(cuModuleLoadData(&mut m, c"image".as_ptr().cast()), 0);
        assert_eq!(
            cuModuleGetFunction(&mut long, m, c"fixed_300000us".as_ptr()),
            0
        );
        assert_eq!(
            cuLaunchKernel(long, 1, 1, 1, 1, 1, 1, 0, null, null.cast(), null.cast()),
            0
        );
    }
    d.enter(); // the primary context
    assert_eq!(ctx_sync(), 0);
    // SAFETY: contexts and the legacy stream of this process.
    unsafe {
        assert_eq!(cuCtxSetCurrent(other), 0);
        assert_eq!(
            cuStreamQuery(null),
            CUDA_ERROR_NOT_READY,
            "the primary context's sync did not wait for the other's 300 ms kernel ({:?})",
            t.elapsed()
        );
    }
    assert!(synced_after(t, null) >= Duration::from_millis(300));
    d.enter();
    // SAFETY: a context this test created.
    assert_eq!(unsafe { cuCtxDestroy_v2(other) }, 0);
}

fn graph_attr(attr: i32) -> u64 {
    let mut v = 0u64;
    // SAFETY: a u64 attribute into a local.
    let r = unsafe { cuDeviceGetGraphMemAttribute(0, attr, (&mut v as *mut u64).cast()) };
    assert_eq!(r, 0);
    v
}

fn graph_trim() {
    // SAFETY: a device ordinal.
    assert_eq!(unsafe { cuDeviceGraphMemTrim(0) }, 0);
}

/// Graph memory nodes: `cuMemAllocAsync` on a capturing stream adds an
/// allocation node and takes no memory; a launch takes it from the graph
/// allocator, which keeps it reserved after the graph frees it (a sync
/// does not trim it) until `cuDeviceGraphMemTrim`; an allocation the
/// graph does not free blocks a relaunch until it is freed, unless the
/// graph was instantiated to free it on launch; a launch the device
/// cannot give the memory to fails with `CUDA_ERROR_OUT_OF_MEMORY`.
#[test]
fn graph_memory_is_taken_at_launch_and_kept_until_trimmed() {
    use graphmem::*;
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    graph_trim();
    let f0 = free_mem();
    // Captured: an allocation freed in the graph, and one left to the
    // caller.
    assert_eq!(begin(s, MODE_GLOBAL), 0);
    let (mut inner, mut outer) = (0u64, 0u64);
    // SAFETY: out-pointers to locals, a stream of this process.
    unsafe {
        assert_eq!(cuMemAllocAsync(&mut inner, (300 * MIB) as usize, s), 0);
        assert_eq!(d.launch(s), 0);
        assert_eq!(cuMemFreeAsync(inner, s), 0);
        assert_eq!(cuMemAllocAsync(&mut outer, (100 * MIB) as usize, s), 0);
    }
    assert!(inner != 0 && outer != 0 && inner != outer);
    let (r, g) = end(s);
    assert_eq!(r, 0);
    assert_eq!(free_mem(), f0, "no memory before the graph runs");
    let mut exec = std::ptr::null_mut();
    // SAFETY: out-pointer to a local, a graph of this process.
    assert_eq!(unsafe { cuGraphInstantiateWithFlags(&mut exec, g, 0) }, 0);
    // SAFETY: an executable graph and a stream of this process.
    assert_eq!(unsafe { cuGraphLaunch(exec, s) }, 0);
    synced_after(Instant::now(), s);
    assert_eq!(free_mem(), f0 - 400 * MIB, "kept through the sync");
    assert_eq!(graph_attr(ATTR_RESERVED_MEM_CURRENT), 400 * MIB);
    assert_eq!(
        graph_attr(ATTR_USED_MEM_CURRENT),
        100 * MIB,
        "outer is in use"
    );
    assert_eq!(graph_attr(ATTR_USED_MEM_HIGH), 400 * MIB);
    // SAFETY: an executable graph and a stream of this process.
    let again = unsafe { cuGraphLaunch(exec, s) };
    assert_eq!(again, CUDA_ERROR_INVALID_VALUE, "outer not freed yet");
    // SAFETY: the graph's allocation, now the caller's.
    assert_eq!(unsafe { cuMemFree_v2(outer) }, 0);
    assert_eq!(graph_attr(ATTR_USED_MEM_CURRENT), 0);
    // SAFETY: as above.
    assert_eq!(unsafe { cuGraphLaunch(exec, s) }, 0);
    assert_eq!(free_mem(), f0 - 400 * MIB, "the reserve is reused");
    // SAFETY: as above.
    assert_eq!(unsafe { cuMemFreeAsync(outer, s) }, 0);
    graph_trim();
    assert_eq!(free_mem(), f0, "trimmed");
    assert_eq!(graph_attr(ATTR_RESERVED_MEM_HIGH), 400 * MIB);
    let mut zero = 0u64;
    // SAFETY: a u64 attribute from a local.
    let r = unsafe {
        cuDeviceSetGraphMemAttribute(0, ATTR_RESERVED_MEM_HIGH, (&mut zero as *mut u64).cast())
    };
    assert_eq!(r, 0);
    assert_eq!(
        graph_attr(ATTR_RESERVED_MEM_HIGH),
        0,
        "reset to the current"
    );

    // Built by hand, instantiated to free on launch: relaunches at will;
    // more than the device has: the launch fails.
    let mut g2 = std::ptr::null_mut();
    let mut params = [0u8; 120];
    params[PARAMS_LOCATION_TYPE..PARAMS_LOCATION_TYPE + 4]
        .copy_from_slice(&LOCATION_DEVICE.to_le_bytes());
    params[PARAMS_BYTESIZE..PARAMS_BYTESIZE + 8].copy_from_slice(&(64 * MIB).to_le_bytes());
    let mut node = std::ptr::null_mut();
    let mut exec2 = std::ptr::null_mut();
    // SAFETY: out-pointers to locals; CUDA_MEM_ALLOC_NODE_PARAMS laid out
    // as cuda.h says.
    unsafe {
        assert_eq!(cuGraphCreate(&mut g2, 0), 0);
        assert_eq!(
            cuGraphAddMemAllocNode(
                &mut node,
                g2,
                std::ptr::null(),
                0,
                params.as_mut_ptr().cast()
            ),
            0
        );
        assert_eq!(
            cuGraphInstantiateWithFlags(&mut exec2, g2, AUTO_FREE_ON_LAUNCH),
            0
        );
        assert_eq!(cuGraphLaunch(exec2, s), 0);
        assert_eq!(cuGraphLaunch(exec2, s), 0, "freed on launch");
    }
    let dptr = u64::from_le_bytes(params[PARAMS_DPTR..PARAMS_DPTR + 8].try_into().unwrap());
    assert_ne!(dptr, 0, "the node's address is returned");
    assert_eq!(free_mem(), f0 - 64 * MIB);
    // SAFETY: the graph's allocation; a device ordinal.
    unsafe {
        assert_eq!(cuMemFree_v2(dptr), 0);
        assert_eq!(cuDeviceGraphMemTrim(0), 0);
    }
    let mut huge = [0u8; 120];
    huge[PARAMS_LOCATION_TYPE..PARAMS_LOCATION_TYPE + 4]
        .copy_from_slice(&LOCATION_DEVICE.to_le_bytes());
    huge[PARAMS_BYTESIZE..PARAMS_BYTESIZE + 8].copy_from_slice(&(f0 + MIB).to_le_bytes());
    let (mut g3, mut exec3) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: as above.
    unsafe {
        assert_eq!(cuGraphCreate(&mut g3, 0), 0);
        assert_eq!(
            cuGraphAddMemAllocNode(&mut node, g3, std::ptr::null(), 0, huge.as_mut_ptr().cast()),
            0,
            "no memory is taken when the node is made"
        );
        assert_eq!(cuGraphInstantiateWithFlags(&mut exec3, g3, 0), 0);
        assert_eq!(cuGraphLaunch(exec3, s), CUDA_ERROR_OUT_OF_MEMORY);
    }
    assert_eq!(free_mem(), f0);
}

/// `fake_allreduce` launches `rank` of `ranks` of communicator `comm`
/// (2 ms once all are there) onto `s`.
fn allreduce(s: CUstream, comm: u64, ranks: u32, rank: u32) -> CUresult {
    let (mut comm, mut ranks, mut rank, mut us) = (comm, ranks, rank, 2000u64);
    let mut m = std::ptr::null_mut();
    let mut f = std::ptr::null_mut();
    // SAFETY: out-pointers to locals; four parameters, as the kernel
    // takes them.
    unsafe {
        assert_eq!(cuModuleLoadData(&mut m, c"image".as_ptr().cast()), 0);
        assert_eq!(
            cuModuleGetFunction(&mut f, m, c"fake_allreduce".as_ptr()),
            0
        );
        let mut params: [*mut c_void; 4] = [
            (&raw mut comm).cast(),
            (&raw mut ranks).cast(),
            (&raw mut rank).cast(),
            (&raw mut us).cast(),
        ];
        let null = std::ptr::null_mut();
        cuLaunchKernel(f, 1, 1, 1, 1, 1, 1, 0, s, params.as_mut_ptr(), null)
    }
}

fn query(s: CUstream) -> CUresult {
    // SAFETY: a stream of this process.
    unsafe { cuStreamQuery(s) }
}

/// A collective waits for its peer however long, and then runs its own
/// time; the stream's later work waits behind it.
#[test]
fn a_collective_ends_only_after_every_rank_has_launched_its_own() {
    let d = dev();
    let (a, b) = (d.stream(NON_BLOCKING), d.stream(NON_BLOCKING));
    let comm = 0x5eed_0000 + u64::from(std::process::id());
    assert_eq!(allreduce(a, comm, 2, 0), 0);
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(query(a), CUDA_ERROR_NOT_READY, "ended without its peer");
    let t = Instant::now();
    assert_eq!(allreduce(b, comm, 2, 1), 0);
    // SAFETY: streams of this process.
    assert_eq!(unsafe { cuStreamSynchronize(a) }, 0);
    let waited = t.elapsed();
    assert!(
        waited >= Duration::from_millis(2),
        "ended {waited:?} after its peer came, before its own 2 ms"
    );
    assert_eq!(query(b), 0, "the peer's ended with it");
    // A rank with nobody to wait for, and bad ranks.
    assert_eq!(allreduce(a, comm + 1, 1, 0), 0);
    // SAFETY: a stream of this process.
    assert_eq!(unsafe { cuStreamSynchronize(a) }, 0);
    assert_eq!(allreduce(a, comm + 2, 2, 2), CUDA_ERROR_INVALID_VALUE);
}

/// `cuEventElapsedTime` as cuda.h gives it: the device time between two
/// completed records; `CUDA_ERROR_NOT_READY` while one is pending;
/// `CUDA_ERROR_INVALID_HANDLE` for an event created with
/// `CU_EVENT_DISABLE_TIMING` (PyTorch's default) or never recorded.
#[test]
fn elapsed_time_needs_two_completed_timing_events() {
    const DISABLE_TIMING: u32 = 0x2;
    let d = dev();
    let s = d.stream(NON_BLOCKING);
    let event = |flags: u32| {
        let mut e = std::ptr::null_mut();
        // SAFETY: out-pointer to a local.
        assert_eq!(unsafe { cuEventCreate(&mut e, flags) }, 0);
        e
    };
    let (a, b, untimed, unrecorded) = (event(0), event(0), event(DISABLE_TIMING), event(0));
    let mut ms = 0f32;
    // SAFETY: events and a stream of this process, out-pointers to locals.
    unsafe {
        assert_eq!(
            cuEventCreate(&mut std::ptr::null_mut(), 0x4),
            CUDA_ERROR_INVALID_VALUE
        );
        assert_eq!(cuEventRecord(a, s), 0);
        assert_eq!(d.launch(s), 0);
        assert_eq!(d.launch(s), 0);
        assert_eq!(cuEventRecord(b, s), 0);
        assert_eq!(cuEventRecord(untimed, s), 0);
        assert_eq!(cuEventElapsedTime(&mut ms, a, b), CUDA_ERROR_NOT_READY);
        assert_eq!(cuEventSynchronize(b), 0);
        assert_eq!(cuEventElapsedTime(&mut ms, a, b), 0);
        // At least the work between them (the host may take its time to
        // launch the second kernel on a loaded machine: no upper bound
        // but a sane one).
        assert!((1.9..1000.0).contains(&ms), "two 1 ms kernels: {ms} ms");
        assert_eq!(
            cuEventElapsedTime(&mut ms, a, untimed),
            CUDA_ERROR_INVALID_HANDLE
        );
        assert_eq!(
            cuEventElapsedTime(&mut ms, unrecorded, b),
            CUDA_ERROR_INVALID_HANDLE
        );
    }
}
