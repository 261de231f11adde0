//! The exported entry points: initialisation, devices, contexts,
//! streams, events, capture, modules, launches and graphs.

use crate::*;

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
        put(version, procaddr::driver_version())
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
            std::ptr::copy_nonoverlapping(text.as_ptr(), name.cast::<u8>(), n);
            *name.add(n) = 0;
        }
        Ok(())
    }
    fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: CUdevice) {
        let s = initialised()?;
        let physical = check_device(s, dev)?;
        // A MIG instance's own UUID, as CUDA gives it.
        if s.is_mig(dev as usize) {
            return put(uuid, device::mig_uuid(physical));
        }
        put(uuid, device::uuid(physical))
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
        if out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let h = with_proc(|p| match p.primary.get(&dev) {
            Some((h, _)) => *h,
            None => {
                let h = p.add(Obj::Ctx { device: dev });
                p.primary.insert(dev, (h, 0));
                h
            }
        });
        // Its first retain (and the first after a reset or a last
        // release) makes the context, which takes its memory.
        primary_mem(s, dev, h)?;
        with_proc(|p| {
            if let Some((_, n)) = p.primary.get_mut(&dev) {
                *n += 1;
            }
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
    fn cuDevicePrimaryCtxReset(dev: CUdevice) { primary_reset(dev) }
    fn cuDevicePrimaryCtxReset_v2(dev: CUdevice) { primary_reset(dev) }
    fn cuCtxCreate_v2(out: *mut CUcontext, _flags: u32, dev: CUdevice) { create_ctx(out, dev) }
    fn cuCtxDestroy_v2(ctx: CUcontext) {
        destroy(ctx, |o| matches!(o, Obj::Ctx { .. }))?;
        with_proc(|p| p.dead.insert(ctx as usize));
        free_ctx_mem(initialised()?, ctx as usize);
        ctx_stack(|s| s.retain(|&c| c != ctx as usize));
        Ok(())
    }
    // Green contexts (cuda.h 12.4 on): a device's SMs as a resource, a
    // descriptor of a share of them, a context limited to that share.
    // `CUdevResource` is 144 bytes in 12.x: the type (a u32) first, and
    // the SM resource's `smCount` at byte 96, past 92 bytes of padding.
    fn cuDeviceGetDevResource(dev: CUdevice, resource: *mut u8, kind: u32) {
        let s = initialised()?;
        check_device(s, dev)?;
        if resource.is_null() || kind != DEV_RESOURCE_TYPE_SM {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's CUdevResource, 144 bytes or more.
        unsafe {
            std::ptr::write_bytes(resource, 0, 144);
            resource.cast::<u32>().write_unaligned(DEV_RESOURCE_TYPE_SM);
            resource.add(96).cast::<u32>().write_unaligned(DEVICE_SMS);
        }
        Ok(())
    }
    fn cuDevResourceGenerateDesc(desc: *mut *mut c_void, resources: *const u8, count: u32) {
        initialised()?;
        if resources.is_null() || count != 1 {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        // SAFETY: the caller's CUdevResource, as above.
        let (kind, sms) = unsafe {
            (
                resources.cast::<u32>().read_unaligned(),
                resources.add(96).cast::<u32>().read_unaligned(),
            )
        };
        if kind != DEV_RESOURCE_TYPE_SM || sms == 0 || sms > DEVICE_SMS {
            return Err(CUDA_ERROR_INVALID_RESOURCE_CONFIGURATION);
        }
        let h = with_proc(|p| p.add(Obj::ResourceDesc));
        put(desc, h as *mut c_void)
    }
    fn cuGreenCtxCreate(out: *mut *mut c_void, desc: *mut c_void, dev: CUdevice, flags: u32) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        many_contexts(s);
        // CU_GREEN_CTX_DEFAULT_STREAM is required.
        if flags != GREEN_CTX_DEFAULT_STREAM || out.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_proc(|p| match p.objects.get(&(desc as usize)) {
            Some(Obj::ResourceDesc) => {
                // Not made current: it is used through its context.
                let ctx = p.add(Obj::Ctx { device: dev });
                Ok(p.add(Obj::Green { ctx }))
            }
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        })
        .and_then(|h| put(out, h as *mut c_void))
    }
    fn cuCtxFromGreenCtx(out: *mut CUcontext, green: *mut c_void) {
        initialised()?;
        let ctx = with_proc(|p| match p.objects.get(&(green as usize)) {
            Some(Obj::Green { ctx }) => Ok(*ctx),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        })?;
        put(out, ctx as CUcontext)
    }
    fn cuGreenCtxDestroy(green: *mut c_void) {
        initialised()?;
        let ctx = with_proc(|p| match p.objects.get(&(green as usize)) {
            Some(Obj::Green { ctx }) => {
                let ctx = *ctx;
                p.objects.remove(&(green as usize));
                p.objects.remove(&ctx);
                p.dead.insert(ctx);
                Ok(ctx)
            }
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        })?;
        ctx_stack(|s| s.retain(|&c| c != ctx));
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
    // CUDA 13.0: the context is named (NULL: the current one).
    fn cuCtxGetDevice_v2(out: *mut CUdevice, ctx: CUcontext) {
        let s = initialised()?;
        let dev = if ctx.is_null() { current_device()? } else { ctx_device(ctx as usize)? };
        let ordinal = s.ordinal(dev).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
        put(out, ordinal as CUdevice)
    }
    fn cuCtxSetLimit(limit: i32, value: usize) { set_limit(limit, value) }
    fn cuCtxGetLimit(value: *mut usize, limit: i32) { get_limit(value, limit) }
    fn cuCtxGetApiVersion(_ctx: CUcontext, version: *mut u32) {
        initialised()?;
        put(version, 12080)
    }
    fn cuCtxSynchronize() {
        let s = initialised()?;
        current_device()?;
        with_proc(|p| p.captures.unsafe_call())?;
        collective::wait_device(current_device()?);
        s.wait(current_ctx_end(s, current_device()?));
        trim_pools(s);
        Ok(())
    }
    // CUDA 13.0: the context is named (NULL: the current one); what CUDA
    // 13 runtimes find as cuCtxSynchronize.
    fn cuCtxSynchronize_v2(ctx: CUcontext) {
        let s = initialised()?;
        let ctx = if ctx.is_null() {
            ctx_stack(|st| st.last().copied()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?
        } else {
            ctx as usize
        };
        let dev = ctx_device(ctx)?;
        with_proc(|p| p.captures.unsafe_call())?;
        collective::wait_device(dev);
        s.wait(ctx_end(s, dev, ctx));
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
    fn cuStreamGetCtx(h: CUstream, out: *mut CUcontext) {
        initialised()?;
        let ctx = stream_ctx(h)?;
        put(out, ctx as CUcontext)
    }
    fn cuStreamDestroy_v2(h: CUstream) { destroy(h, |o| matches!(o, Obj::Stream { .. })) }
    fn cuStreamSynchronize(h: CUstream) { sync_stream(h, false) }
    fn cuStreamSynchronize_ptsz(h: CUstream) { sync_stream(h, true) }
    fn cuStreamQuery(h: CUstream) { query_stream(h, false) }
    fn cuStreamQuery_ptsz(h: CUstream) { query_stream(h, true) }
    fn cuEventCreate(out: *mut CUevent, flags: u32) {
        initialised()?;
        // CU_EVENT_DEFAULT, _BLOCKING_SYNC, _DISABLE_TIMING, _INTERPROCESS
        // (which needs _DISABLE_TIMING).
        const DISABLE_TIMING: u32 = 0x2;
        if flags & !0x7 != 0 || (flags & 0x4 != 0 && flags & DISABLE_TIMING == 0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let ctx = ctx_stack(|st| st.last().copied()).unwrap_or(0);
        let timing = flags & DISABLE_TIMING == 0;
        let h = with_proc(|p| {
            let h = p.add(Obj::Event { time: None, captured: None, timing });
            p.event_ctx.insert(h, ctx);
            h
        });
        put(out, h as CUevent)
    }
    fn cuEventDestroy_v2(e: CUevent) {
        event_alive(e as usize)?;
        destroy(e, |o| matches!(o, Obj::Event { .. }))
    }
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
        let s = initialised()?;
        match event_time(e)? {
            Some(t) if resolved(s, e, t).is_none() => Err(CUDA_ERROR_NOT_READY),
            _ => Ok(()),
        }
    }
    fn cuEventSynchronize(e: CUevent) {
        let s = initialised()?;
        if let Some(t) = event_time(e)? {
            s.wait(t);
            resolved(s, e, t);
        }
        trim_pools(s);
        Ok(())
    }
    fn cuStreamWaitEvent(h: CUstream, e: CUevent, _flags: u32) { wait_event(h, e, false) }
    fn cuStreamWaitEvent_ptsz(h: CUstream, e: CUevent, _flags: u32) { wait_event(h, e, true) }
    fn cuEventElapsedTime(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }
    fn cuEventElapsedTime_v2(ms: *mut f32, start: CUevent, end: CUevent) { elapsed(ms, start, end) }

    // Modules and launches.
    fn cuModuleLoadData(out: *mut CUmodule, image: *const c_void) { load_module(out, image) }
    fn cuModuleLoadDataEx(out: *mut CUmodule, image: *const c_void, _n: u32, _options: *mut i32, _values: *mut *mut c_void) {
        load_module(out, image)
    }
    fn cuModuleUnload(m: CUmodule) { unload_module(m) }
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
    // Libraries (CUDA 12.0): context-independent code, whose kernels
    // (CUkernel) are launched with the launch calls.
    fn cuLibraryLoadData(library: *mut *mut c_void, code: *const c_void, _jit_options: *mut i32, _jit_values: *mut *mut c_void, _jit_n: u32, _options: *mut i32, _values: *mut *mut c_void, _n: u32) {
        initialised()?;
        if code.is_null() {
            return Err(CUDA_ERROR_INVALID_IMAGE);
        }
        let h = with_proc(|p| p.add(Obj::Library));
        put(library, h as *mut c_void)
    }
    fn cuLibraryGetKernel(kernel: *mut *mut c_void, library: *mut c_void, name: *const c_char) {
        initialised()?;
        if name.is_null() {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        with_proc(|p| match p.objects.get(&(library as usize)) { Some(Obj::Library) => Ok(()), _ => Err(CUDA_ERROR_INVALID_HANDLE) })?;
        // SAFETY: non-null NUL-terminated string from the caller.
        let name = unsafe { CStr::from_ptr(name) }.to_string_lossy().into_owned();
        let h = with_proc(|p| p.add(Obj::Kernel(function_for(&name))));
        put(kernel, h as *mut c_void)
    }
    fn cuLibraryUnload(library: *mut c_void) { destroy(library, |o| matches!(o, Obj::Library)) }
    fn cuKernelGetAttribute(value: *mut i32, attr: i32, kernel: *mut c_void, dev: CUdevice) {
        let s = initialised()?;
        let dev = check_device(s, dev)?;
        with_proc(|p| match p.objects.get(&(kernel as usize)) { Some(Obj::Kernel(_)) => Ok(()), _ => Err(CUDA_ERROR_INVALID_HANDLE) })?;
        // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK = 0; the rest: 0.
        put(value, if attr == 0 { device_attribute(1, dev, s) } else { 0 })
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
    fn cuLaunchCooperativeKernelMultiDevice(list: *mut CudaLaunchParams, n: u32, _flags: u32) {
        launch_multi_device(list, n)
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
    fn cuGraphInstantiate(exec: *mut CUgraphExec, graph: CUgraph, _err: *mut CUgraphNode, _log: *mut c_char, _size: usize) {
        instantiate(exec, graph, 0)
    }
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
}
