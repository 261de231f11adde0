//! Contexts, primary contexts, `cuGetProcAddress` and device attributes.

use crate::*;

pub(crate) fn create_ctx(out: *mut CUcontext, dev: CUdevice) -> R {
    let s = initialised()?;
    many_contexts(s);
    let dev = check_device(s, dev)?;
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    s.alloc(dev, s.ctx_mem)?;
    let h = with_proc(|p| {
        let h = p.add(Obj::Ctx { device: dev });
        p.ctx_mem.insert(h, CtxMem::new(dev, s.ctx_mem));
        h
    });
    ctx_stack(|st| st.push(h));
    put(out, h as CUcontext)
}

/// A context beside the primary ones is made (created, or a green
/// context's): work is tracked per context from now on.
pub(crate) fn many_contexts(s: &Sim) {
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
}

/// `CUlimit`s that take device memory, with their defaults.
pub(crate) const LIMIT_STACK_SIZE: i32 = 0;
pub(crate) const LIMIT_PRINTF_FIFO_SIZE: i32 = 1;
pub(crate) const LIMIT_MALLOC_HEAP_SIZE: i32 = 2;
/// Every `CUlimit` of `cuda.h` 12.x with its default (stack 1 KiB per
/// thread, printf FIFO 1 MiB, malloc heap 8 MiB, ...).
const LIMIT_DEFAULTS: [u64; 7] = [1024, 1 << 20, 8 << 20, 2, 2048, 32, 0];
/// Threads resident at once (132 SMs × 2048, an H100 SXM): the stack
/// limit is per thread.
const RESIDENT_THREADS: u64 = 132 * 2048;

/// The device memory a context holds for itself: created with
/// `FAKECUDA_CTX_MEM` (the default limits included), changed by
/// `cuCtxSetLimit`, given back when the context goes.
#[derive(Debug, Clone)]
pub(crate) struct CtxMem {
    pub(crate) device: usize,
    pub(crate) bytes: u64,
    pub(crate) limits: [u64; 7],
}

impl CtxMem {
    pub(crate) fn new(device: usize, bytes: u64) -> CtxMem {
        CtxMem {
            device,
            bytes,
            limits: LIMIT_DEFAULTS,
        }
    }
}

/// Device memory limit `limit` of `value` takes.
fn limit_bytes(limit: i32, value: u64) -> u64 {
    match limit {
        LIMIT_STACK_SIZE => value.saturating_mul(RESIDENT_THREADS),
        LIMIT_PRINTF_FIFO_SIZE | LIMIT_MALLOC_HEAP_SIZE => value,
        _ => 0,
    }
}

/// `cuCtxSetLimit` on the current context: a limit that takes more
/// device memory takes it now (`CUDA_ERROR_OUT_OF_MEMORY`, the limit
/// unchanged, where the device has too little); less gives it back.
pub(crate) fn set_limit(limit: i32, value: usize) -> R {
    let s = initialised()?;
    let ctx = ctx_stack(|st| st.last().copied()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    let dev = ctx_device(ctx)?;
    let idx = usize::try_from(limit)
        .ok()
        .filter(|&i| i < LIMIT_DEFAULTS.len())
        .ok_or(CUDA_ERROR_UNSUPPORTED_LIMIT)?;
    let old = with_proc(|p| {
        p.ctx_mem
            .entry(ctx)
            .or_insert_with(|| CtxMem::new(dev, 0))
            .limits[idx]
    });
    let (was, now) = (limit_bytes(limit, old), limit_bytes(limit, value as u64));
    if now > was {
        s.alloc(dev, now - was)?;
    } else {
        s.free(dev, was - now);
    }
    with_proc(|p| {
        if let Some(c) = p.ctx_mem.get_mut(&ctx) {
            c.limits[idx] = value as u64;
            c.bytes = (c.bytes + now).saturating_sub(was);
        }
    });
    Ok(())
}

/// `cuCtxGetLimit` of the current context.
pub(crate) fn get_limit(out: *mut usize, limit: i32) -> R {
    initialised()?;
    let ctx = ctx_stack(|st| st.last().copied()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    ctx_device(ctx)?;
    let idx = usize::try_from(limit)
        .ok()
        .filter(|&i| i < LIMIT_DEFAULTS.len())
        .ok_or(CUDA_ERROR_UNSUPPORTED_LIMIT)?;
    let v = with_proc(|p| {
        p.ctx_mem
            .get(&ctx)
            .map_or(LIMIT_DEFAULTS[idx], |c| c.limits[idx])
    });
    put(out, v as usize)
}

/// A context's own memory goes back to the device (it was destroyed, or
/// a primary context released for the last time or reset).
pub(crate) fn free_ctx_mem(s: &Sim, ctx: usize) {
    if let Some(c) = with_proc(|p| p.ctx_mem.remove(&ctx)) {
        s.free(c.device, c.bytes);
    }
}

/// The primary context of `dev` holds its memory again (its first
/// retain, or the first after a reset or a last release).
pub(crate) fn primary_mem(s: &Sim, dev: usize, ctx: usize) -> R {
    // Checked and taken under the process lock: two threads retaining it
    // at once make it once.
    with_proc(|p| {
        if p.ctx_mem.contains_key(&ctx) {
            return Ok(());
        }
        s.alloc(dev, s.ctx_mem)?;
        p.ctx_mem.insert(ctx, CtxMem::new(dev, s.ctx_mem));
        p.dead.remove(&ctx); // made anew
        Ok(())
    })
}

/// Device memory of a module image: an ELF's size from its section
/// headers; a fatbinary's, the entry the device loads (see below); else
/// a NUL-terminated text (PTX); or `FAKECUDA_MODULE_MEM` when that is a
/// size.
pub(crate) fn image_bytes(s: &Sim, image: *const c_void) -> u64 {
    if let Some(fixed) = s.module_mem {
        return fixed;
    }
    let b = image as *const u8;
    // SAFETY: the program's image, at least a header long when it starts
    // with one of these magics (read only then), else NUL-terminated.
    unsafe {
        let word = |off: usize| (b.add(off) as *const u32).read_unaligned();
        if word(0) == 0x464c_457f {
            // ELF64: e_shoff at 0x28, e_shentsize and e_shnum at 0x3a, 0x3c.
            let shoff = (b.add(0x28) as *const u64).read_unaligned();
            let entsize = u64::from((b.add(0x3a) as *const u16).read_unaligned());
            let num = u64::from((b.add(0x3c) as *const u16).read_unaligned());
            return shoff.saturating_add(entsize * num);
        }
        if word(0) == 0xba55_ed50 {
            // A fatbinary: the driver loads one of its entries, the ELF
            // (cubin) for the device's architecture (sm_90 here), else one
            // of the same major with a lower minor; its size uncompressed.
            // Else (PTX only) what JIT compiling it makes: its text's length.
            let header = usize::from((b.add(6) as *const u16).read_unaligned());
            let fat = (b.add(8) as *const u64).read_unaligned() as usize;
            let (mut at, end) = (header, header.saturating_add(fat));
            let (mut best, mut ptx) = (None::<(u32, u64)>, 0u64);
            while at.saturating_add(64) <= end {
                let e = b.add(at);
                let kind = (e as *const u16).read_unaligned();
                let head = (e.add(4) as *const u32).read_unaligned() as usize;
                let size = (e.add(8) as *const u64).read_unaligned();
                let arch = (e.add(28) as *const u32).read_unaligned();
                let unpacked = (e.add(56) as *const u64).read_unaligned();
                let loaded = if unpacked > 0 { unpacked } else { size };
                if head < 64 {
                    break;
                }
                match kind {
                    2 | 0x10 if arch / 10 == 9 && best.is_none_or(|(a, _)| arch > a) => {
                        best = Some((arch, loaded));
                    }
                    1 => ptx = ptx.max(loaded),
                    _ => {}
                }
                at = at.saturating_add(head).saturating_add(size as usize);
            }
            return best.map_or(ptx, |(_, n)| n);
        }
        CStr::from_ptr(image as *const c_char).to_bytes().len() as u64
    }
}

/// `cuModuleLoadData[Ex]`: a module on the current device, holding the
/// device memory of its image.
pub(crate) fn load_module(out: *mut CUmodule, image: *const c_void) -> R {
    let s = initialised()?;
    let dev = current_device()?;
    if image.is_null() {
        return Err(CUDA_ERROR_INVALID_IMAGE);
    }
    if out.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let bytes = image_bytes(s, image);
    s.alloc(dev, bytes)?;
    let h = with_proc(|p| {
        let h = p.add(Obj::Module);
        p.modules.insert(h, (dev, bytes));
        h
    });
    put(out, h as CUmodule)
}

/// `cuModuleUnload`: its memory goes back.
pub(crate) fn unload_module(m: CUmodule) -> R {
    let s = initialised()?;
    destroy(m, |o| matches!(o, Obj::Module))?;
    if let Some((dev, bytes)) = with_proc(|p| p.modules.remove(&(m as usize))) {
        s.free(dev, bytes);
    }
    Ok(())
}

pub(crate) fn primary_release(dev: CUdevice) -> R {
    let s = initialised()?;
    let dev = check_device(s, dev)?;
    let last = with_proc(|p| match p.primary.get_mut(&dev) {
        Some((h, n)) if *n > 0 => {
            *n -= 1;
            Ok((*n == 0).then_some(*h))
        }
        _ => Err(CUDA_ERROR_INVALID_CONTEXT),
    })?;
    // The last release destroys the primary context: its memory goes.
    if let Some(h) = last {
        free_ctx_mem(s, h);
        with_proc(|p| p.dead.insert(h));
    }
    Ok(())
}

/// `cuDevicePrimaryCtxReset`: the primary context is destroyed (its
/// memory goes) and made again, memory and all, at its next retain.
pub(crate) fn primary_reset(dev: CUdevice) -> R {
    let s = initialised()?;
    let dev = check_device(s, dev)?;
    if let Some(h) = with_proc(|p| p.primary.get(&dev).map(|(h, _)| *h)) {
        free_ctx_mem(s, h);
        with_proc(|p| p.dead.insert(h));
    }
    Ok(())
}

pub(crate) fn proc_address(
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
        procaddr::Resolved::NotFound => {
            set_status(CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND);
            put(pfn, std::ptr::null_mut())?;
            Err(CUDA_ERROR_NOT_FOUND)
        }
    }
}

pub(crate) fn device_attribute(attr: i32, dev: usize, s: &Sim) -> i32 {
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
