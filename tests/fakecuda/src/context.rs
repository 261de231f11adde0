//! Contexts, primary contexts, `cuGetProcAddress` and device attributes.

use crate::*;

pub(crate) fn create_ctx(out: *mut CUcontext, dev: CUdevice) -> R {
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

pub(crate) fn primary_release(dev: CUdevice) -> R {
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
