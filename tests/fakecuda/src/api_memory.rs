//! The exported entry points: memory, pools, virtual memory, IPC, host
//! memory and arrays, copies and memsets.

use crate::*;

driver_api! {
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
        let at = location(s, props[2] as u32, props[3])?;
        let h = with_proc(|p| {
            let h = p.add(Obj::MemPool);
            let mut pl = pool::Pool::new(at.unwrap_or(0));
            pl.host = at.is_none();
            p.pools.insert(h, pl);
            h
        });
        put(pool, h as CUmemoryPool)
    }
    fn cuMemPoolDestroy(pool: CUmemoryPool) {
        let s = initialised()?;
        let h = pool as usize;
        with_proc(|p| {
            if p.default_pool.values().any(|&d| d == h) {
                return Err(CUDA_ERROR_INVALID_VALUE); // a default pool stays
            }
            let pl = p.pools.remove(&h).ok_or(CUDA_ERROR_INVALID_VALUE)?;
            p.objects.remove(&h);
            p.current_pool.retain(|_, c| *c != h);
            if !pl.host {
                s.free(pl.device, pl.reserved);
            }
            Ok(())
        })
    }
    fn cuMemPoolGetAttribute(pool: CUmemoryPool, attr: i32, value: *mut c_void) { pool_get_attribute(pool, attr, value) }
    fn cuMemPoolSetAttribute(pool: CUmemoryPool, attr: i32, value: *mut c_void) { pool_set_attribute(pool, attr, value) }
    fn cuMemPoolTrimTo(pool: CUmemoryPool, keep: usize) {
        let s = initialised()?;
        // Given back to the device before any allocation can see the pool
        // smaller (under the process lock), as the driver's trim is done
        // when it returns.
        with_pool(pool, |pl| {
            let excess = pl.trim(keep as u64);
            if !pl.host {
                s.free(pl.device, excess);
            }
            Ok(())
        })
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
        // CUmemAllocationProp: type, handle types, location type, location id.
        let prop = get(prop as *const [u32; 4])?;
        let dev = location(s, prop[2], prop[3] as i32)?;
        if handle.is_null() || size == 0 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if let Some(dev) = dev {
            s.alloc(dev, size as u64)?;
        }
        let h = with_proc(|p| {
            let h = p.add(Obj::Pool) as u64;
            p.physical.insert(h, (dev, size as u64));
            h
        });
        put(handle, h)
    }
    // The handle goes at once; its memory stays while it is mapped
    // ("the memory is released when all outstanding mappings are
    // unmapped", cuda.h).
    fn cuMemRelease(handle: u64) {
        let s = initialised()?;
        let gone = with_proc(|p| {
            p.objects.remove(&(handle as usize));
            let mem = p.physical.remove(&handle)?;
            if p.maps.values().any(|(_, h)| *h == handle) {
                p.released.insert(handle, mem);
                return Some(None);
            }
            Some(Some(mem))
        })
        .ok_or(CUDA_ERROR_INVALID_VALUE)?;
        if let Some((dev, size)) = gone {
            free_physical(s, dev, size);
        }
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
    fn cuMemMap(ptr: CUdeviceptr, size: usize, offset: usize, handle: u64, _flags: u64) {
        initialised()?;
        with_proc(|p| {
            let bytes = p.physical.get(&handle).map(|(_, b)| *b).ok_or(CUDA_ERROR_INVALID_HANDLE)?;
            if size == 0 || (offset as u64).saturating_add(size as u64) > bytes {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            let end = ptr.saturating_add(size as u64);
            let overlaps = p.maps.range(..end).next_back().is_some_and(|(va, (len, _))| va + len > ptr);
            if overlaps {
                return Err(CUDA_ERROR_INVALID_VALUE);
            }
            p.maps.insert(ptr, (size as u64, handle));
            Ok(())
        })
    }
    fn cuMemUnmap(ptr: CUdeviceptr, size: usize) { unmap(ptr, size as u64) }
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
    // Device to device: queued behind the stream's work, no wait for the
    // host (the driver API's notes on synchronous calls).
    fn cuMemcpyDtoD_v2(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize) { queued_copy(false) }
    fn cuMemcpyDtoD_v2_ptds(_dst: CUdeviceptr, _src: CUdeviceptr, _n: usize) { queued_copy(true) }
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
