//! Loading the driver as the CUDA runtime does, and the entry points
//! the workload uses.

use super::*;

/// The exported symbol a dlsym-resolving program asks for.
pub(crate) fn versioned(name: &str, ptsz: bool) -> String {
    let v2 = [
        "cuMemAlloc",
        "cuMemAllocPitch",
        "cuMemFree",
        "cuMemGetInfo",
        "cuArrayCreate",
        "cuArray3DCreate",
        "cuIpcOpenMemHandle",
        "cuCtxCreate",
        "cuEventDestroy",
    ];
    let per_thread = [
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "cuGraphLaunch",
        "cuMemAllocAsync",
        "cuMemFreeAsync",
        "cuStreamSynchronize",
        "cuStreamQuery",
        "cuEventRecord",
        "cuStreamEndCapture",
    ];
    if name == "cuStreamBeginCapture" {
        format!("{name}_v2{}", if ptsz { "_ptsz" } else { "" })
    } else if name == "cuMemcpyDtoH" {
        format!("{name}_v2{}", if ptsz { "_ptds" } else { "" })
    } else if v2.contains(&name) {
        format!("{name}_v2")
    } else if ptsz && per_thread.contains(&name) {
        format!("{name}_ptsz")
    } else if name == "cuGraphAddKernelNode" {
        "cuGraphAddKernelNode_v2".into()
    } else {
        name.into()
    }
}

pub(crate) type FnGetProc =
    unsafe extern "C" fn(*const c_char, *mut Ptr, i32, u64, *mut i32) -> CUresult;

impl Driver {
    // Each transmute's target is the field's type: spelled once there.
    #[allow(clippy::missing_transmute_annotations)]
    pub(crate) fn load(args: &Args) -> anyhow::Result<Driver> {
        if let Some(path) = &args.load_lib {
            // SAFETY: a library the test built; its initialisers are its
            // own. Kept loaded for the process's life.
            let lib = unsafe { libloading::Library::new(path) }
                .with_context(|| format!("dlopen {}", path.display()))?;
            std::mem::forget(lib);
        }
        // SAFETY: loading the driver library; its initialisers are the
        // driver's own.
        let lib = if args.deepbind {
            // SAFETY: as above, with the flags of a library that binds
            // its own dependencies first.
            unsafe {
                libloading::os::unix::Library::open(
                    Some(&args.driver),
                    libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_DEEPBIND,
                )
            }
            .map(libloading::Library::from)
        } else {
            // SAFETY: as above.
            unsafe { libloading::Library::new(&args.driver) }
        }
        .with_context(|| format!("dlopen {}", args.driver))?;
        // SAFETY: the symbol has cuGetProcAddress_v2's C signature.
        let get_proc: FnGetProc = *unsafe { lib.get::<FnGetProc>(b"cuGetProcAddress_v2\0") }?;
        let flags = if args.ptsz { 2 } else { 0 };
        let version = args.cuda_version;
        let by_dlsym = args.resolve == "dlsym";
        let resolve = |name: &str| -> anyhow::Result<Ptr> {
            if by_dlsym {
                let sym = CString::new(versioned(name, args.ptsz))?;
                // SAFETY: looking up a symbol; the pointer is only used as
                // the function it names.
                let p = unsafe { lib.get::<Ptr>(sym.as_bytes_with_nul()) }.map(|s| *s);
                return p.with_context(|| format!("dlsym {sym:?}"));
            }
            let c = CString::new(name)?;
            let mut p: Ptr = std::ptr::null_mut();
            let mut status = -1i32;
            // The workload calls cuCtxCreate with the v2 signature, which
            // the name means up to CUDA 11.3 (11.4 made it v3, 12.5 v4).
            let version = if name == "cuCtxCreate" {
                version.min(11030)
            } else {
                version
            };
            // SAFETY: valid name, out-pointers to locals.
            let r = unsafe { get_proc(c.as_ptr(), &mut p, version, flags, &mut status) };
            if r != 0 || p.is_null() {
                bail!(
                    "cuGetProcAddress_v2({name}, {version}, {flags}) failed: {r}, status {status}"
                );
            }
            Ok(p)
        };
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: the driver returns the entry point of that name,
                // whose C signature the field's type spells out (which is
                // also why the target type is left to inference).
                unsafe { std::mem::transmute::<Ptr, _>(resolve($name)?) }
            };
        }
        Ok(Driver {
            init: f!("cuInit"),
            device_get: f!("cuDeviceGet"),
            primary_retain: f!("cuDevicePrimaryCtxRetain"),
            ctx_set_current: f!("cuCtxSetCurrent"),
            ctx_sync: f!("cuCtxSynchronize"),
            ctx_sync_names_ctx: version >= 13000 && {
                let get: unsafe extern "C" fn(*mut i32) -> CUresult = f!("cuDriverGetVersion");
                let mut v = 0i32;
                // SAFETY: out-pointer to a local.
                (unsafe { get(&mut v) }) == 0 && v >= 13000
            },
            module_load: f!("cuModuleLoadData"),
            get_function: f!("cuModuleGetFunction"),
            launch: f!("cuLaunchKernel"),
            launch_ex: f!("cuLaunchKernelEx"),
            launch_coop: f!("cuLaunchCooperativeKernel"),
            launch_coop_multi: f!("cuLaunchCooperativeKernelMultiDevice"),
            ctx_get_current: f!("cuCtxGetCurrent"),
            device_get_count: f!("cuDeviceGetCount"),
            graph_create: f!("cuGraphCreate"),
            graph_add_kernel: f!("cuGraphAddKernelNode"),
            graph_instantiate: f!("cuGraphInstantiateWithFlags"),
            graph_launch: f!("cuGraphLaunch"),
            mem_alloc: f!("cuMemAlloc"),
            mem_alloc_pitch: f!("cuMemAllocPitch"),
            mem_alloc_managed: f!("cuMemAllocManaged"),
            mem_alloc_async: f!("cuMemAllocAsync"),
            mem_free_async: f!("cuMemFreeAsync"),
            mem_create: f!("cuMemCreate"),
            mem_release: f!("cuMemRelease"),
            mem_free: f!("cuMemFree"),
            mem_get_info: f!("cuMemGetInfo"),
            stream_sync: f!("cuStreamSynchronize"),
            stream_query: f!("cuStreamQuery"),
            stream_create: f!("cuStreamCreate"),
            event_create: f!("cuEventCreate"),
            event_record: f!("cuEventRecord"),
            event_sync: f!("cuEventSynchronize"),
            event_query: f!("cuEventQuery"),
            memcpy_dtoh: f!("cuMemcpyDtoH"),
            begin_capture: f!("cuStreamBeginCapture"),
            ctx_create: f!("cuCtxCreate"),
            default_mem_pool: f!("cuDeviceGetDefaultMemPool"),
            address_reserve: f!("cuMemAddressReserve"),
            mem_map: f!("cuMemMap"),
            host_alloc: f!("cuMemHostAlloc"),
            ipc_get: f!("cuIpcGetMemHandle"),
            ipc_open: f!("cuIpcOpenMemHandle"),
            ipc_close: f!("cuIpcCloseMemHandle"),
            free_host: f!("cuMemFreeHost"),
            array_create: f!("cuArrayCreate"),
            array3d_create: f!("cuArray3DCreate"),
            array_destroy: f!("cuArrayDestroy"),
            mem_pool_set_attribute: f!("cuMemPoolSetAttribute"),
            end_capture: f!("cuStreamEndCapture"),
            _lib: lib,
        })
    }
}

/// Loads a module in the calling thread's current context and returns
/// its function `name` (the simulator times a kernel by its name).
pub(crate) fn load_kernel(d: &Driver, name: &std::ffi::CStr) -> anyhow::Result<Ptr> {
    let (mut module, mut func): (Ptr, Ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to locals and a NUL-terminated name.
    unsafe {
        check(
            "cuModuleLoadData",
            (d.module_load)(&mut module, c"fakecuda".as_ptr() as *const c_void),
        )?;
        check(
            "cuModuleGetFunction",
            (d.get_function)(&mut func, module, name.as_ptr()),
        )?;
    }
    Ok(func)
}

/// `--launch-api coop-multi`: on every device, the kernel (loaded in its
/// primary context) and a non-blocking stream there.
pub(crate) fn every_device(d: &Driver) -> anyhow::Result<Vec<(Ptr, Ptr)>> {
    let mut out = Vec::new();
    // SAFETY: driver calls with out-pointers to locals; the thread's
    // current context is put back at the end.
    unsafe {
        let mut current: Ptr = std::ptr::null_mut();
        check("cuCtxGetCurrent", (d.ctx_get_current)(&mut current))?;
        let mut n = 0;
        check("cuDeviceGetCount", (d.device_get_count)(&mut n))?;
        for dev in 0..n {
            let mut ctx: Ptr = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                (d.primary_retain)(&mut ctx, dev),
            )?;
            check("cuCtxSetCurrent", (d.ctx_set_current)(ctx))?;
            let func = load_kernel(d, c"fake_spin")?;
            let mut stream: Ptr = std::ptr::null_mut();
            check("cuStreamCreate", (d.stream_create)(&mut stream, 1))?;
            out.push((func, stream));
        }
        check("cuCtxSetCurrent", (d.ctx_set_current)(current))?;
    }
    Ok(out)
}
