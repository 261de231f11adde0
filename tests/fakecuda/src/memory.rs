//! Device memory: allocations, memory pools, arrays, page-locked host
//! memory, and the memory queries.

use crate::*;

pub(crate) fn alloc(dev: usize, bytes: u64) -> Result<u64, CUresult> {
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
pub(crate) fn pool_alloc(
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
        if grow > 0 && !pl.host {
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
pub(crate) fn free(ptr: CUdeviceptr) -> R {
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
        let (dev, bytes) = p.forget_ptr(ptr).ok_or(CUDA_ERROR_INVALID_VALUE)?;
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
pub(crate) fn array_bytes(
    dims: [usize; 3],
    format: u32,
    channels: u32,
    levels: u32,
) -> Result<u64, CUresult> {
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
pub(crate) fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> R {
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

pub(crate) fn create_array(out: *mut usize, bytes: u64) -> R {
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

pub(crate) fn destroy_array(a: usize) -> R {
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
pub(crate) fn trim_pools(s: &Sim) {
    with_proc(|p| {
        for pl in p.pools.values_mut() {
            let excess = pl.at_sync();
            if excess > 0 && !pl.host {
                s.free(pl.device, excess);
            }
        }
    })
}

/// The pool `h` of this process.
pub(crate) fn with_pool<T>(
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

pub(crate) fn pool_get_attribute(h: CUmemoryPool, attr: i32, value: *mut c_void) -> R {
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

pub(crate) fn pool_set_attribute(h: CUmemoryPool, attr: i32, value: *mut c_void) -> R {
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

pub(crate) fn mem_info(free: *mut usize, total: *mut usize) -> R {
    let s = initialised()?;
    let (f, t) = s.mem_info(current_device()?);
    put(free, f as usize)?;
    put(total, t as usize)
}

/// `CUmemLocationType`: where a `cuMemCreate` handle or a pool's memory is.
pub(crate) const LOCATION_DEVICE: u32 = 1;
pub(crate) const LOCATION_HOST: u32 = 2;
pub(crate) const LOCATION_HOST_NUMA: u32 = 3;
pub(crate) const LOCATION_HOST_NUMA_CURRENT: u32 = 4;

/// The device a `CUmemLocation` (type, id) names, `None` for a host
/// location (whose id is a NUMA node, or unused).
pub(crate) fn location(s: &Sim, kind: u32, id: i32) -> Result<Option<usize>, CUresult> {
    match kind {
        LOCATION_DEVICE => check_device(s, id).map(Some),
        LOCATION_HOST | LOCATION_HOST_NUMA_CURRENT => Ok(None),
        LOCATION_HOST_NUMA if id >= 0 => Ok(None),
        _ => Err(CUDA_ERROR_INVALID_VALUE),
    }
}

/// Memory of a `cuMemCreate` handle goes back: to the device, or (host
/// memory) nowhere the simulator counts.
pub(crate) fn free_physical(s: &Sim, dev: Option<usize>, bytes: u64) {
    if let Some(dev) = dev {
        s.free(dev, bytes);
    }
}

/// `cuMemUnmap(ptr, size)`: the mappings in the range go; a released
/// handle's memory goes with its last mapping.
pub(crate) fn unmap(ptr: u64, size: u64) -> R {
    let s = initialised()?;
    if size == 0 {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let freed = with_proc(|p| {
        let end = ptr.saturating_add(size);
        let gone: Vec<u64> = p.maps.range(ptr..end).map(|(va, _)| *va).collect();
        if gone.is_empty() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let mut freed = Vec::new();
        for va in gone {
            let Some((_, handle)) = p.maps.remove(&va) else {
                continue;
            };
            let still_mapped = p.maps.values().any(|(_, h)| *h == handle);
            if !still_mapped && let Some(mem) = p.released.remove(&handle) {
                freed.push(mem);
            }
        }
        Ok(freed)
    })?;
    for (dev, bytes) in freed {
        free_physical(s, dev, bytes);
    }
    Ok(())
}
