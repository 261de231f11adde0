//! Graphs: capture, instantiation, launch, and graph memory nodes.

use crate::*;

pub(crate) fn graph_launch(exec: CUgraphExec, h: CUstream, ptsz: bool) -> R {
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
pub(crate) fn graph_memory(s: &Sim, allocs: &[graphmem::AllocNode], auto_free: bool) -> R {
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
pub(crate) fn captured_free(h: CUstream, ptsz: bool, ptr: CUdeviceptr) -> Option<R> {
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

pub(crate) fn add_mem_alloc_node(node: *mut CUgraphNode, graph: CUgraph, params: *mut c_void) -> R {
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

pub(crate) fn add_mem_free_node(node: *mut CUgraphNode, graph: CUgraph, dptr: CUdeviceptr) -> R {
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
pub(crate) fn with_graph_mem<T>(
    dev: CUdevice,
    f: impl FnOnce(&mut pool::Pool) -> T,
) -> Result<T, CUresult> {
    let s = initialised()?;
    let d = check_device(s, dev)?;
    Ok(with_proc(|p| f(p.graph_allocator(d))))
}

pub(crate) fn graph_mem_attribute(dev: CUdevice, attr: i32, value: *mut c_void) -> R {
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
pub(crate) fn set_graph_mem_attribute(dev: CUdevice, attr: i32, value: *mut c_void) -> R {
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
pub(crate) fn graph_mem_trim(dev: CUdevice) -> R {
    let s = initialised()?;
    let (d, excess) = with_graph_mem(dev, |g| (g.device, g.trim(0)))?;
    s.free(d, excess);
    Ok(())
}

/// The created stream `h` may capture: the legacy stream may not
/// (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`); the per-thread default
/// stream is not simulated (`CUDA_ERROR_NOT_SUPPORTED`).
pub(crate) fn capturable(h: CUstream, ptsz: bool) -> Result<bool, CUresult> {
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

/// Begins a capture on `h`. The capture is open from the start of the
/// call; `FAKECUDA_BEGIN_CAPTURE_US` makes the call take that long after
/// it (0 by default), which a test uses to widen the moment in which
/// another thread's synchronisation meets a capture its caller cannot
/// know of yet.
pub(crate) fn begin_capture(h: CUstream, ptsz: bool, mode: u32) -> R {
    let blocking = capturable(h, ptsz)?;
    with_proc(|p| p.captures.begin(h as usize, blocking, mode))?;
    let us: u64 = std::env::var("FAKECUDA_BEGIN_CAPTURE_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    if us > 0 {
        std::thread::sleep(std::time::Duration::from_micros(us));
    }
    Ok(())
}

pub(crate) fn end_capture(h: CUstream, ptsz: bool, graph: *mut CUgraph) -> R {
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
pub(crate) fn capture_status(h: CUstream, ptsz: bool) -> Result<(u32, u64), CUresult> {
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

pub(crate) fn add_kernel_node(
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

pub(crate) fn params_ref<'a>(
    p: *const CudaKernelNodeParams,
) -> Result<&'a CudaKernelNodeParams, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null; the caller passes a valid struct by contract and
    // it outlives this call.
    Ok(unsafe { &*p })
}

pub(crate) fn instantiate(exec: *mut CUgraphExec, graph: CUgraph, flags: u64) -> R {
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

pub(crate) fn destroy(h: *mut c_void, is_kind: fn(&Obj) -> bool) -> R {
    initialised()?;
    with_proc(|p| match p.objects.get(&(h as usize)) {
        Some(o) if is_kind(o) => {
            p.objects.remove(&(h as usize));
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })
}
