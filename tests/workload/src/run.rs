//! One run of the workload: memory, kernels, threads beside them, and
//! what it reports.

use super::*;

pub(crate) fn run(args: &Args) -> anyhow::Result<Report> {
    let d = Driver::load(args)?;
    let before_init = if args.nvml_first {
        Some(nvml_memory()?)
    } else {
        None
    };
    // SAFETY: all driver calls below get valid handles from the driver
    // and pointers to live locals, per the driver API.
    unsafe {
        check("cuInit", (d.init)(0))?;
        let mut dev = 0;
        check("cuDeviceGet", (d.device_get)(&mut dev, args.device))?;
        let mut ctx: Ptr = std::ptr::null_mut();
        check(
            "cuDevicePrimaryCtxRetain",
            (d.primary_retain)(&mut ctx, dev),
        )?;
        check("cuCtxSetCurrent", (d.ctx_set_current)(ctx))?;
        let func = load_kernel(&d, c"fake_spin")?;
        if let Some(spec) = &args.nccl_rank {
            join_nccl(spec)?;
        }

        let mut report = Report {
            host_error: 0,
            ipc_error: 0,
            helper: None,
            nvml: before_init,
            pairs: None,
            kernels: 0,
            allocated: 0,
            alloc_error: 0,
            alloc_start_ns: monotonic_ns(),
            alloc_done_ns: 0,
            free: 0,
            total: 0,
        };
        if let Some(t) = &args.pool_threshold {
            let mut bytes = if t == "max" {
                u64::MAX
            } else {
                parse_size::parse_size(t).context("--pool-threshold")?
            };
            let mut pool: Ptr = std::ptr::null_mut();
            check(
                "cuDeviceGetDefaultMemPool",
                (d.default_mem_pool)(&mut pool, dev),
            )?;
            // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4, a u64.
            check(
                "cuMemPoolSetAttribute",
                (d.mem_pool_set_attribute)(pool, 4, (&mut bytes as *mut u64).cast()),
            )?;
        }
        let retry_until = Instant::now() + Duration::from_secs_f64(args.retry_alloc_seconds);
        let mut ptrs: Vec<u64> = Vec::new();
        let mut handles: Vec<u64> = Vec::new();
        let mut arrays: Vec<usize> = Vec::new();
        if args.mem > 0 {
            let chunk = args.chunk.unwrap_or(args.mem).max(1);
            while report.allocated < args.mem {
                let n = chunk.min(args.mem - report.allocated) as usize;
                let mut p = 0u64;
                let r = match args.alloc_api.as_str() {
                    "v2" => (d.mem_alloc)(&mut p, n),
                    "pitch" => {
                        let mut pitch = 0usize;
                        (d.mem_alloc_pitch)(&mut p, &mut pitch, 512, n.div_ceil(512), 4)
                    }
                    "managed" => (d.mem_alloc_managed)(&mut p, n, 1),
                    "async" => (d.mem_alloc_async)(&mut p, n, std::ptr::null_mut()),
                    "create" => {
                        let prop: [u32; 8] = [1, 0, 1, dev as u32, 0, 0, 0, 0];
                        let mut r = (d.mem_create)(&mut p, n, &prop, 0);
                        if r == 0 {
                            handles.push(p);
                            for _ in 0..args.vmm_maps {
                                let mut va = 0u64;
                                r = (d.address_reserve)(&mut va, n, 0, 0, 0);
                                if r == 0 {
                                    r = (d.mem_map)(va, n, 0, p, 0);
                                }
                                if r != 0 {
                                    break;
                                }
                            }
                        }
                        r
                    }
                    "array" | "array3d" => {
                        // FLOAT (0x20), 4 channels: 16 bytes per element.
                        let format = 0x20 | (4usize << 32);
                        let mut a = 0usize;
                        let r = if args.alloc_api == "array" {
                            (d.array_create)(&mut a, &[n / 16, 0, format])
                        } else {
                            (d.array3d_create)(&mut a, &[n / 16 / 64, 64, 0, format, 0])
                        };
                        if r == 0 {
                            arrays.push(a);
                        }
                        r
                    }
                    other => bail!("unknown --alloc-api {other}"),
                };
                if r == 2 && Instant::now() < retry_until {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                if r != 0 {
                    report.alloc_error = r;
                    break;
                }
                if !["create", "array", "array3d"].contains(&args.alloc_api.as_str()) {
                    ptrs.push(p);
                }
                report.allocated += n as u64;
            }
        }
        report.alloc_done_ns = monotonic_ns();
        if args.alloc_free > 0 {
            report.pairs = Some(alloc_free_pairs(&d, args)?);
        }
        if let (Some(path), Some(&p)) = (&args.ipc_export, ptrs.first()) {
            let mut h = IpcMemHandle([0; 64]);
            check("cuIpcGetMemHandle", (d.ipc_get)(&mut h, p))?;
            let hex: String = h.0.iter().map(|b| format!("{b:02x}")).collect();
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, hex).context("writing the IPC handle")?;
            std::fs::rename(&tmp, path).context("writing the IPC handle")?;
        }
        let mut opened = 0u64;
        if let Some(path) = &args.ipc_import {
            let until = Instant::now() + Duration::from_secs(10);
            let hex = loop {
                match std::fs::read_to_string(path) {
                    Ok(t) => break t,
                    Err(_) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => bail!("no IPC handle in {}: {e}", path.display()),
                }
            };
            let mut h = IpcMemHandle([0; 64]);
            for (i, b) in h.0.iter_mut().enumerate() {
                *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("00"), 16)?;
            }
            // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1.
            report.ipc_error = (d.ipc_open)(&mut opened, h, 1);
        }
        let mut host: Ptr = std::ptr::null_mut();
        if args.host_mem > 0 {
            report.host_error = (d.host_alloc)(&mut host, args.host_mem as usize, 0);
        }
        if args.free_first {
            free_all(&d, args, &mut ptrs, &mut handles, &mut arrays)?;
            check("cuCtxSynchronize", (d.ctx_sync)(std::ptr::null_mut()))?;
        }
        check(
            "cuMemGetInfo",
            (d.mem_get_info)(&mut report.free, &mut report.total),
        )?;
        if args.nvml {
            report.nvml = Some(nvml_memory()?);
        }

        let mut dur = args.kernel_us;
        let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
        let mut exec: Ptr = std::ptr::null_mut();
        if args.launch_api == "graph" {
            let mut graph: Ptr = std::ptr::null_mut();
            check("cuGraphCreate", (d.graph_create)(&mut graph, 0))?;
            let node_params = KernelNodeParams {
                func,
                grid: [1, 1, 1],
                block: [1, 1, 1],
                shmem: 0,
                params: params.as_mut_ptr(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            let mut node: Ptr = std::ptr::null_mut();
            check(
                "cuGraphAddKernelNode",
                (d.graph_add_kernel)(&mut node, graph, std::ptr::null(), 0, &node_params),
            )?;
            check(
                "cuGraphInstantiate",
                (d.graph_instantiate)(&mut exec, graph, 0),
            )?;
        }
        let mut per_launch = 1;
        if args.capture > 0 {
            let (captured, beside) = capture_graph(&d, args, func, ctx)?;
            exec = captured;
            per_launch = args.capture;
            report.kernels += beside;
        }
        let (f, e, c) = (func as usize, exec as usize, ctx as usize);
        let helping = std::sync::atomic::AtomicBool::new(args.helper);
        let polling = std::sync::atomic::AtomicBool::new(true);
        let helper = std::thread::scope(|scope| {
            let h = args
                .helper
                .then(|| scope.spawn(|| helper_thread(&d, f, &helping)));
            let watchdog = (args.poll_old_event_us > 0)
                .then(|| scope.spawn(|| poll_old_event(&d, c, args.poll_old_event_us, &polling)));
            let second = args.second_context.then(|| {
                scope.spawn(|| -> anyhow::Result<u64> {
                    // The new context becomes this thread's current one; it
                    // gets a module of its own (functions belong to one).
                    let mut own: Ptr = std::ptr::null_mut();
                    check("cuCtxCreate", (d.ctx_create)(&mut own, 0, dev))?;
                    let func = load_kernel(&d, c"fake_spin")?;
                    let mut own_args = args.clone();
                    own_args.kernel_us = args.second_kernel_us.unwrap_or(args.kernel_us);
                    let n = launch_loop(&d, &own_args, func as usize, e, per_launch)?;
                    Ok(if args.second_kernel_us.is_some() {
                        0
                    } else {
                        n
                    })
                })
            });
            let launched = if args.threads <= 1 {
                launch_loop(&d, args, f, e, per_launch)
            } else {
                launch_threads(&d, args, f, e, c, per_launch)
            };
            let launched = match second.map(|h| h.join()) {
                None => launched,
                Some(Ok(n)) => launched.and_then(|a| n.map(|b| a + b)),
                Some(Err(_)) => Err(anyhow::anyhow!("the second context's thread panicked")),
            };
            helping.store(false, std::sync::atomic::Ordering::Release);
            polling.store(false, std::sync::atomic::Ordering::Release);
            let launched = match watchdog.map(|w| w.join()) {
                None => launched,
                Some(Ok(polled)) => launched.and_then(|n| polled.map(|()| n)),
                Some(Err(_)) => Err(anyhow::anyhow!("the watchdog thread panicked")),
            };
            let helped = h
                .map(|h| h.join())
                .transpose()
                .map_err(|_| anyhow::anyhow!("the helper thread panicked"))?;
            launched.map(|n| (n, helped))
        })?;
        report.kernels += helper.0;
        report.helper = helper.1;
        check("cuCtxSynchronize", (d.ctx_sync)(std::ptr::null_mut()))?;
        free_all(&d, args, &mut ptrs, &mut handles, &mut arrays)?;
        if !host.is_null() {
            check("cuMemFreeHost", (d.free_host)(host))?;
        }
        if opened != 0 {
            check("cuIpcCloseMemHandle", (d.ipc_close)(opened))?;
        }
        Ok(report)
    }
}

/// `--threads` launching threads in context `ctx`: the kernels they ran.
pub(crate) fn launch_threads(
    d: &Driver,
    args: &Args,
    func: usize,
    exec: usize,
    ctx: usize,
    per_launch: u64,
) -> anyhow::Result<u64> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.threads)
            .map(|_| {
                scope.spawn(move || {
                    // SAFETY: the process's context.
                    check("cuCtxSetCurrent", unsafe {
                        (d.ctx_set_current)(ctx as Ptr)
                    })?;
                    launch_loop(d, args, func, exec, per_launch)
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h
                .join()
                .map_err(|_| anyhow::anyhow!("launch thread panicked"))??;
        }
        anyhow::Ok(total)
    })
}

/// `--poll-old-event-us`: in context `ctx`, records an event once, waits
/// for it, then queries that old event every `every_us` while `on`.
pub(crate) fn poll_old_event(
    d: &Driver,
    ctx: usize,
    every_us: u64,
    on: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<()> {
    let mut event: Ptr = std::ptr::null_mut();
    // SAFETY: the process's context, and an out-pointer to a local; the
    // event lives until this thread ends.
    unsafe {
        check("cuCtxSetCurrent", (d.ctx_set_current)(ctx as Ptr))?;
        check("cuEventCreate", (d.event_create)(&mut event, 0))?;
        check(
            "cuEventRecord",
            (d.event_record)(event, std::ptr::null_mut()),
        )?;
        check("cuEventSynchronize", (d.event_sync)(event))?;
        while on.load(std::sync::atomic::Ordering::Acquire) {
            check("cuEventQuery (an old event)", (d.event_query)(event))?;
            std::thread::sleep(Duration::from_micros(every_us));
        }
    }
    Ok(())
}

/// `--helper`: calls from a thread with no current context while `on`:
/// (calls, calls not answered CUDA_ERROR_INVALID_CONTEXT, slowest µs).
pub(crate) fn helper_thread(
    d: &Driver,
    func: usize,
    on: &std::sync::atomic::AtomicBool,
) -> (u64, u64, u64) {
    const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
    let (mut calls, mut bad, mut slowest) = (0u64, 0u64, 0u64);
    let null = std::ptr::null_mut();
    while on.load(std::sync::atomic::Ordering::Acquire) {
        let (mut free, mut total, mut p) = (0usize, 0usize, 0u64);
        // SAFETY: driver calls with out-pointers to locals and no context
        // (each must fail cleanly).
        let answers = unsafe {
            [
                time_us(|| (d.ctx_sync)(std::ptr::null_mut())),
                time_us(|| (d.stream_query)(null)),
                time_us(|| (d.mem_get_info)(&mut free, &mut total)),
                time_us(|| {
                    (d.launch)(
                        func as Ptr,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        null,
                        null.cast(),
                        null.cast(),
                    )
                }),
                time_us(|| (d.mem_alloc)(&mut p, 1 << 20)),
            ]
        };
        for (i, (r, us)) in answers.into_iter().enumerate() {
            calls += 1;
            if r != CUDA_ERROR_INVALID_CONTEXT {
                bad += 1;
                if bad == 1 {
                    eprintln!(
                        "gem-workload: helper call {i} answered {r}, not CUDA_ERROR_INVALID_CONTEXT"
                    );
                }
            }
            slowest = slowest.max(us);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    (calls, bad, slowest)
}

/// The result of `call` and how long it took, µs.
pub(crate) fn time_us(call: impl FnOnce() -> CUresult) -> (CUresult, u64) {
    let t = Instant::now();
    let r = call();
    (r, t.elapsed().as_micros() as u64)
}

/// Frees what was allocated (and forgets it).
pub(crate) fn free_all(
    d: &Driver,
    args: &Args,
    ptrs: &mut Vec<u64>,
    handles: &mut Vec<u64>,
    arrays: &mut Vec<usize>,
) -> anyhow::Result<()> {
    // SAFETY: pointers and handles this process allocated, freed once.
    unsafe {
        for p in ptrs.drain(..) {
            if args.alloc_api == "async" {
                check(
                    "cuMemFreeAsync",
                    (d.mem_free_async)(p, std::ptr::null_mut()),
                )?;
            } else {
                check("cuMemFree", (d.mem_free)(p))?;
            }
        }
        for h in handles.drain(..) {
            check("cuMemRelease", (d.mem_release)(h))?;
        }
        for a in arrays.drain(..) {
            check("cuArrayDestroy", (d.array_destroy)(a))?;
        }
    }
    Ok(())
}

/// Device 0's memory as NVML tells it: (free, total) from
/// `nvmlDeviceGetMemoryInfo`, (free, total, used) from `_v2`.
pub(crate) fn nvml_memory() -> anyhow::Result<(u64, u64, u64, u64, u64)> {
    type Init = unsafe extern "C" fn() -> u32;
    type Handle = unsafe extern "C" fn(u32, *mut Ptr) -> u32;
    type Mem = unsafe extern "C" fn(Ptr, *mut [u64; 3]) -> u32;
    type MemV2 = unsafe extern "C" fn(Ptr, *mut [u64; 5]) -> u32;
    // SAFETY: loading NVML and calling it with its C signatures and
    // pointers to live locals.
    unsafe {
        let lib =
            libloading::Library::new("libnvidia-ml.so.1").context("dlopen libnvidia-ml.so.1")?;
        let init: libloading::Symbol<Init> = lib.get(b"nvmlInit_v2\0")?;
        let handle: libloading::Symbol<Handle> = lib.get(b"nvmlDeviceGetHandleByIndex_v2\0")?;
        let mem: libloading::Symbol<Mem> = lib.get(b"nvmlDeviceGetMemoryInfo\0")?;
        let mem_v2: libloading::Symbol<MemV2> = lib.get(b"nvmlDeviceGetMemoryInfo_v2\0")?;
        check("nvmlInit_v2", init())?;
        let mut dev: Ptr = std::ptr::null_mut();
        check("nvmlDeviceGetHandleByIndex_v2", handle(0, &mut dev))?;
        let mut m = [0u64; 3]; // total, free, used
        check("nvmlDeviceGetMemoryInfo", mem(dev, &mut m))?;
        // version (nvmlMemory_v2: size 40, version 2), total, reserved, free, used
        let mut v2 = [40u64 | (2 << 24), 0, 0, 0, 0];
        check("nvmlDeviceGetMemoryInfo_v2", mem_v2(dev, &mut v2))?;
        Ok((m[1], m[0], v2[3], v2[1], v2[4]))
    }
}

/// `--nccl-rank RANK:RANKS:FILE`: joins a communicator of RANKS ranks as
/// RANK, through `libnccl.so.2` (dlopen, dlsym), the unique id shared
/// through FILE.
fn join_nccl(spec: &str) -> anyhow::Result<()> {
    use anyhow::Context as _;
    type GetId = unsafe extern "C" fn(*mut [u8; 128]) -> i32;
    type InitRank = unsafe extern "C" fn(*mut Ptr, i32, [u8; 128], i32) -> i32;
    let mut parts = spec.splitn(3, ':');
    let (Some(rank), Some(ranks), Some(file)) = (parts.next(), parts.next(), parts.next()) else {
        anyhow::bail!("--nccl-rank {spec}: expected RANK:RANKS:FILE");
    };
    let rank: i32 = rank.parse().context("--nccl-rank: RANK")?;
    let ranks: i32 = ranks.parse().context("--nccl-rank: RANKS")?;
    // SAFETY: the simulator's (or a real) NCCL, whose functions have these
    // C signatures; `ncclUniqueId` is 128 bytes passed by value.
    unsafe {
        let nccl = libloading::Library::new("libnccl.so.2").context("dlopen libnccl.so.2")?;
        let id = if rank == 0 {
            let get: libloading::Symbol<GetId> = nccl.get(b"ncclGetUniqueId\0")?;
            let mut id = [0u8; 128];
            anyhow::ensure!(get(&mut id) == 0, "ncclGetUniqueId failed");
            let tmp = format!("{file}.tmp");
            std::fs::write(&tmp, id)?;
            std::fs::rename(&tmp, file)?;
            id
        } else {
            let deadline = Instant::now() + Duration::from_secs(10);
            loop {
                if let Ok(b) = std::fs::read(file)
                    && let Ok(id) = <[u8; 128]>::try_from(b.as_slice())
                {
                    break id;
                }
                anyhow::ensure!(Instant::now() < deadline, "no NCCL id in {file}");
                std::thread::sleep(Duration::from_millis(10));
            }
        };
        let init: libloading::Symbol<InitRank> = nccl.get(b"ncclCommInitRank\0")?;
        let mut comm: Ptr = std::ptr::null_mut();
        let r = init(&mut comm, ranks, id, rank);
        anyhow::ensure!(r == 0, "ncclCommInitRank failed with {r}");
        // The communicator lives as long as the process.
        std::mem::forget(nccl);
    }
    Ok(())
}

/// `args.alloc_free` cuMemAlloc + cuMemFree pairs of `--chunk` bytes (1
/// MiB by default), each call timed: the median of each (ns).
fn alloc_free_pairs(d: &Driver, args: &Args) -> anyhow::Result<(u64, u64)> {
    let n = args.chunk.unwrap_or(1 << 20).max(1) as usize;
    let (mut allocs, mut frees) = (Vec::new(), Vec::new());
    let until = Instant::now() + Duration::from_secs_f64(args.alloc_free_seconds);
    let mut done = 0;
    while done < args.alloc_free || Instant::now() < until {
        done += 1;
        let mut p = 0u64;
        let t0 = monotonic_ns();
        // SAFETY: an out-pointer to a local, in the context `run` made
        // current; `p` is freed once, just after.
        let r = unsafe { (d.mem_alloc)(&mut p, n) };
        let t1 = monotonic_ns();
        check("cuMemAlloc", r)?;
        // SAFETY: `p` was allocated just now and is not used again.
        let r = unsafe { (d.mem_free)(p) };
        let t2 = monotonic_ns();
        check("cuMemFree", r)?;
        if allocs.len() < 1 << 20 {
            allocs.push(t1 - t0);
            frees.push(t2 - t1);
        }
    }
    let median = |v: &mut Vec<u64>| {
        v.sort_unstable();
        v[v.len() / 2]
    };
    Ok((median(&mut allocs), median(&mut frees)))
}
