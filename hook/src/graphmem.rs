//! Graph memory nodes against the group's `MemoryLimit`: memory a CUDA
//! graph allocates (`cuMemAllocAsync` on a capturing stream, as
//! PyTorch's `cudaMallocAsync` backend does under `torch.cuda.graph`, or
//! `cuGraphAddMemAllocNode`) is taken from the device's graph allocator
//! when the graph is *launched*, and the allocator keeps it until
//! `cuDeviceGraphMemTrim`.
//!
//! The hook learns each graph's allocations as they are made (bytes per
//! device: captured allocations belong to the capture's origin stream
//! until `cuStreamEndCapture` names the graph), carries them to every
//! executable graph instantiated from it, and before a launch reserves
//! what the graph allocator would have to grow by: refused, the launch
//! fails with `CUDA_ERROR_OUT_OF_MEMORY`, as the driver's own does when
//! the device cannot give the memory. After the launch and after a trim,
//! the group is charged what the allocator reserves
//! (`CU_GRAPH_MEM_ATTR_RESERVED_MEM_CURRENT`).

use crate::capture;
use crate::cuda::CUDA_SUCCESS;
use crate::driver::CUresult;
use crate::memory;
use crate::state::{self, lock};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// `CU_GRAPH_MEM_ATTR_USED_MEM_CURRENT`, `…_RESERVED_MEM_CURRENT`.
const USED: i32 = 0;
const RESERVED: i32 = 2;

/// Layout of `CUDA_MEM_ALLOC_NODE_PARAMS` (cuda.h, CUDA 11.4 and later):
/// `poolProps.location.id` and `bytesize`.
const PARAMS_LOCATION_ID: usize = 12;
const PARAMS_BYTESIZE: usize = 104;

/// Graph memory needs by handle (origin stream of an open capture, graph,
/// executable graph): (ordinal, bytes).
fn add(key: usize, dev: u32, bytes: u64) {
    let st = state::get();
    st.graph_mem_seen.store(true, Ordering::Release);
    let mut needs = lock(&st.graph_needs);
    let e = needs.entry(key).or_insert((dev, 0));
    if e.0 == dev {
        e.1 = e.1.saturating_add(bytes);
    }
}

/// `cuMemAllocAsync` of `bytes` on `stream`, which captures into the
/// capture known as `capture` ([`capture::origin`]): an allocation node of
/// the capture's graph on the stream's device.
pub fn captured_alloc(stream: *mut c_void, capture: usize, bytes: u64) {
    let Some(dev) = memory::stream_ordinal(stream) else {
        return;
    };
    add(capture, dev, bytes);
}

/// A stream-ordered allocation (`cuMemAllocAsync`,
/// `cuMemAllocFromPoolAsync`) of `bytes` on `stream` from `pool` by
/// `alloc`: into a capture, a graph memory node, allocated when the graph
/// runs; else from the pool, now (see `memory::pool_alloc`).
pub fn stream_alloc(
    pool: Option<*mut c_void>,
    stream: *mut c_void,
    per_thread: bool,
    bytes: u64,
    mut alloc: impl FnMut() -> (CUresult, u64),
) -> CUresult {
    if !capture::captured(stream, per_thread) {
        return memory::pool_alloc(pool, stream, bytes, alloc);
    }
    let r = alloc().0;
    if r == CUDA_SUCCESS {
        captured_alloc(stream, capture::origin(stream, per_thread), bytes);
    }
    r
}

/// A capture begun on `stream` ended with `graph` (the driver's answer
/// `r`): its allocation nodes are the graph's.
pub fn capture_ended(stream: *mut c_void, per_thread: bool, graph: *mut *mut c_void, r: CUresult) {
    let Some(st) = state::current() else { return };
    let mut needs = lock(&st.graph_needs);
    let Some(need) = needs.remove(&capture::key(stream, per_thread)) else {
        return;
    };
    if r != CUDA_SUCCESS || graph.is_null() {
        return;
    }
    // SAFETY: the program's out-pointer, which the driver just filled.
    let g = unsafe { *graph };
    if !g.is_null() {
        needs.insert(g as usize, need);
    }
}

/// `cuGraphAddMemAllocNode` added to `graph` the node `params` describes
/// (the driver's answer `r`).
pub fn alloc_node(graph: *mut c_void, params: *const c_void, r: CUresult) {
    if r != CUDA_SUCCESS || params.is_null() {
        return;
    }
    let at = |off: usize| (params as *const u8).wrapping_add(off);
    // SAFETY: a CUDA_MEM_ALLOC_NODE_PARAMS the driver accepted, laid out
    // as cuda.h says; unaligned reads.
    let (dev, bytes) = unsafe {
        (
            (at(PARAMS_LOCATION_ID) as *const i32).read_unaligned(),
            (at(PARAMS_BYTESIZE) as *const u64).read_unaligned(),
        )
    };
    if dev >= 0 {
        add(graph as usize, dev as u32, bytes);
    }
}

/// `exec` was instantiated from `graph` (the driver's answer `r`).
pub fn instantiated(exec: *mut *mut c_void, graph: *mut c_void, r: CUresult) {
    if r != CUDA_SUCCESS || exec.is_null() {
        return;
    }
    let Some(st) = state::current() else { return };
    let mut needs = lock(&st.graph_needs);
    let Some(&need) = needs.get(&(graph as usize)) else {
        return;
    };
    // SAFETY: the program's out-pointer, which the driver just filled.
    let e = unsafe { *exec };
    if !e.is_null() {
        needs.insert(e as usize, need);
    }
}

/// A graph or executable graph was destroyed.
pub fn forget(handle: *mut c_void) {
    if let Some(st) = state::current() {
        lock(&st.graph_needs).remove(&(handle as usize));
    }
}

/// Launches `exec` by `launch` (not into a capture): first reserves what
/// the graph allocator would grow by to give it its allocations (refused:
/// `CUDA_ERROR_OUT_OF_MEMORY`, nothing launched), then charges what the
/// allocator reserves after it.
pub fn launch(exec: *mut c_void, launch: impl FnOnce() -> CUresult) -> CUresult {
    let Some(st) = state::current() else {
        return launch();
    };
    if !st.graph_mem_seen.load(Ordering::Acquire) {
        return launch();
    }
    let need = lock(&st.graph_needs).get(&(exec as usize)).copied();
    let Some((dev, bytes)) = need.filter(|n| n.1 > 0) else {
        // Allocations not seen (a graph instantiated by an entry point
        // the hook does not follow): charged after the launch.
        let r = launch();
        if let Some(dev) = memory::current_ordinal() {
            settle(dev);
        }
        return r;
    };
    let (Some(reserved), Some(used)) = (
        crate::driver::graph_mem_u64(dev, RESERVED),
        crate::driver::graph_mem_u64(dev, USED),
    ) else {
        return launch();
    };
    let target = used.saturating_add(bytes).max(reserved);
    {
        let mut held = lock(&st.graph_held);
        let h = held.entry(dev).or_insert((st.physical(dev), 0));
        if target > h.1 {
            if let Err(e) = memory::reserve(dev, target - h.1) {
                return e;
            }
            h.1 = target;
        }
    }
    let r = launch();
    settle(dev);
    r
}

/// The group is charged what the graph allocator of ordinal `dev`
/// reserves now (after a launch or a trim).
pub fn settle(dev: u32) {
    let Some(st) = state::current() else { return };
    let Some(now) = crate::driver::graph_mem_u64(dev, RESERVED) else {
        return;
    };
    let mut held = lock(&st.graph_held);
    let h = held.entry(dev).or_insert((st.physical(dev), 0));
    // The driver may reserve in chunks of its own beyond what was asked.
    if !memory::charge_to(h, now) {
        crate::log::error!(
            "the graph allocator of device {} holds {now} bytes, past what the group's MemoryLimit allowed ({} reserved)",
            h.0,
            h.1
        );
    }
}
