//! Launching: the launch loop and how an iteration waits, a graph
//! captured beside a launching thread, NCCL-style allreduce ranks.

use super::*;

/// `CU_STREAM_NON_BLOCKING`: PyTorch's streams do not synchronise with
/// the legacy default stream.
pub(crate) const NON_BLOCKING: u32 = 1;

/// Captures `--capture` kernels into a graph the way `torch.cuda.graph`
/// does, while another thread keeps launching and synchronising on a
/// stream of its own; returns the instantiated graph and the kernels the
/// other thread ran.
pub(crate) fn capture_graph(
    d: &Driver,
    args: &Args,
    func: Ptr,
    ctx: Ptr,
) -> anyhow::Result<(Ptr, u64)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    const GLOBAL: u32 = 0;
    let mut dur = args.kernel_us;
    let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
    let func = func as usize; // shared with the thread beside the capture
    let launch = |stream: Ptr, params: &mut [Ptr; 1]| {
        // SAFETY: a function of this context, its one parameter.
        let r = unsafe {
            (d.launch)(
                func as Ptr,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check("cuLaunchKernel", r)
    };
    let mut side: Ptr = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check("cuStreamCreate", unsafe {
        (d.stream_create)(&mut side, NON_BLOCKING)
    })?;
    // Warm-up on the side stream, then wait for it.
    for _ in 0..3 {
        launch(side, &mut params)?;
    }
    // SAFETY: a stream of this context.
    check("cuStreamSynchronize", unsafe { (d.stream_sync)(side) })?;
    let done = AtomicBool::new(false);
    let (ctx, side_h) = (ctx as usize, side as usize);
    std::thread::scope(|scope| {
        let other = scope.spawn(|| -> anyhow::Result<u64> {
            let mut dur = args.kernel_us;
            let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
            let mut own: Ptr = std::ptr::null_mut();
            let mut n = 0;
            // SAFETY: the process's context; out-pointer to a local; the
            // stream is this thread's own.
            unsafe {
                check("cuCtxSetCurrent", (d.ctx_set_current)(ctx as Ptr))?;
                check("cuStreamCreate", (d.stream_create)(&mut own, NON_BLOCKING))?;
                while !done.load(Ordering::Acquire) {
                    for _ in 0..5 {
                        launch(own, &mut params)?;
                        n += 1;
                    }
                    check(
                        "cuStreamSynchronize (beside a capture)",
                        (d.stream_sync)(own),
                    )?;
                    // Quiet a while: the hook's idle watcher may fire.
                    std::thread::sleep(Duration::from_secs_f64(3.0 * args.capture_pause_ms / 1e3));
                }
            }
            Ok(n)
        });
        let side = side_h as Ptr;
        let captured = (|| -> anyhow::Result<Ptr> {
            // SAFETY: a stream of this context; out-pointers to locals.
            unsafe {
                check("cuStreamBeginCapture", (d.begin_capture)(side, GLOBAL))?;
                let mut scratch = 0u64;
                if args.capture_alloc > 0 {
                    check(
                        "cuMemAllocAsync (captured)",
                        (d.mem_alloc_async)(&mut scratch, args.capture_alloc as usize, side),
                    )?;
                }
                for _ in 0..args.capture {
                    launch(side, &mut params)?;
                    std::thread::sleep(Duration::from_secs_f64(args.capture_pause_ms / 1e3));
                }
                if scratch != 0 {
                    check(
                        "cuMemFreeAsync (captured)",
                        (d.mem_free_async)(scratch, side),
                    )?;
                }
                let mut graph: Ptr = std::ptr::null_mut();
                check("cuStreamEndCapture", (d.end_capture)(side, &mut graph))?;
                let mut exec: Ptr = std::ptr::null_mut();
                check(
                    "cuGraphInstantiate",
                    (d.graph_instantiate)(&mut exec, graph, 0),
                )?;
                Ok(exec)
            }
        })();
        done.store(true, Ordering::Release);
        let beside = other
            .join()
            .map_err(|_| anyhow::anyhow!("the thread beside the capture panicked"))?;
        Ok((captured?, beside?))
    })
}

/// What one launching thread waits with at the end of a burst or
/// iteration.
pub(crate) struct Wait<'a> {
    d: &'a Driver,
    how: &'a str,
    stream: Ptr,
    event: Ptr,
    /// Device buffer a blocking copy reads from.
    buf: u64,
}

impl<'a> Wait<'a> {
    /// Creates what `how` needs on this thread (a stream of its own when
    /// asked, an event, a small device buffer).
    fn new(d: &'a Driver, args: &'a Args) -> anyhow::Result<Wait<'a>> {
        let mut w = Wait {
            d,
            how: &args.wait,
            stream: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
            buf: 0,
        };
        // SAFETY: driver calls with out-pointers to live fields.
        unsafe {
            if args.own_streams {
                check("cuStreamCreate", (d.stream_create)(&mut w.stream, 0))?;
            }
            if w.how.starts_with("event") {
                check("cuEventCreate", (d.event_create)(&mut w.event, 0))?;
            }
            if w.how == "copy" {
                check("cuMemAlloc", (d.mem_alloc)(&mut w.buf, 64))?;
            }
        }
        Ok(w)
    }

    /// Blocks until the thread's work is done, the way `how` says.
    fn wait(&self) -> anyhow::Result<()> {
        let d = self.d;
        // SAFETY: handles from the driver and a live host buffer.
        unsafe {
            match self.how {
                "ctx" if d.ctx_sync_names_ctx => {
                    // As a CUDA 13 program may: the context named, from a
                    // thread where it is not current.
                    let mut ctx: Ptr = std::ptr::null_mut();
                    check("cuCtxGetCurrent", (d.ctx_get_current)(&mut ctx))?;
                    check("cuCtxSetCurrent", (d.ctx_set_current)(std::ptr::null_mut()))?;
                    let r = (d.ctx_sync)(ctx);
                    check("cuCtxSetCurrent", (d.ctx_set_current)(ctx))?;
                    check("cuCtxSynchronize", r)
                }
                "ctx" => check("cuCtxSynchronize", (d.ctx_sync)(std::ptr::null_mut())),
                "event" => {
                    check("cuEventRecord", (d.event_record)(self.event, self.stream))?;
                    check("cuEventSynchronize", (d.event_sync)(self.event))
                }
                "copy" => {
                    let mut host = [0u8; 64];
                    check(
                        "cuMemcpyDtoH",
                        (d.memcpy_dtoh)(host.as_mut_ptr() as *mut c_void, self.buf, 64),
                    )
                }
                "query" => spin("cuStreamQuery", || (d.stream_query)(self.stream)),
                "event-query" => {
                    check("cuEventRecord", (d.event_record)(self.event, self.stream))?;
                    spin("cuEventQuery", || (d.event_query)(self.event))
                }
                _ => check("cuStreamSynchronize", (d.stream_sync)(self.stream)),
            }
        }
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if self.buf != 0 {
            // SAFETY: a pointer this thread allocated and no longer uses.
            unsafe { (self.d.mem_free)(self.buf) };
        }
    }
}

/// Calls `query` until it stops answering `CUDA_ERROR_NOT_READY`.
pub(crate) fn spin(what: &str, query: impl Fn() -> CUresult) -> anyhow::Result<()> {
    const CUDA_ERROR_NOT_READY: CUresult = 600;
    loop {
        match query() {
            CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
            r => return check(what, r),
        }
    }
}

/// Launches for `--seconds` in bursts (or iterations of `--iter-kernels`);
/// returns the number of kernels run (`per_launch` per graph launch).
pub(crate) fn launch_loop(
    d: &Driver,
    args: &Args,
    func: usize,
    exec: usize,
    per_launch: u64,
) -> anyhow::Result<u64> {
    let func = func as Ptr;
    let exec = exec as Ptr;
    let mut dur = args.kernel_us;
    let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
    let mut kernels = 0u64;
    let waiter = Wait::new(d, args)?;
    let stream = waiter.stream;
    let multi = if args.launch_api == "coop-multi" {
        every_device(d)?
    } else {
        Vec::new()
    };
    let allreduce = args
        .allreduce
        .as_deref()
        .map(|spec| Allreduce::new(d, spec))
        .transpose()?;
    // SAFETY: driver calls with handles from the driver and pointers to
    // live locals, per the driver API.
    unsafe {
        let config = LaunchConfig {
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shmem: 0,
            stream,
            attrs: std::ptr::null_mut(),
            num_attrs: 0,
        };
        let end = Instant::now() + Duration::from_secs_f64(args.seconds);
        let mut bursts = Vec::new();
        let mut demand = Vec::new();
        let mut step = 0u64;
        while match &allreduce {
            // The ranks of a communicator make the same number of steps
            // (a rank whose peer has left would wait for it for ever).
            Some(a) => a.go_on(step, Instant::now() < end)?,
            None => Instant::now() < end,
        } {
            step += 1;
            let start = monotonic_ns();
            bursts.push(start);
            let burst_end = if args.burst_ms > 0.0 {
                Instant::now() + Duration::from_secs_f64(args.burst_ms / 1e3)
            } else {
                end
            };
            let mut launched = 0u64;
            while if args.iter_kernels > 0 {
                launched < args.iter_kernels
            } else {
                Instant::now() < burst_end.min(end)
            } {
                if !args.kernel_mix.is_empty() {
                    // Through the pointer the launch reads it from.
                    *(params[0] as *mut u64) =
                        args.kernel_mix[(kernels % args.kernel_mix.len() as u64) as usize];
                }
                if args.launch_cpu_us > 0 {
                    busy_for(Duration::from_micros(args.launch_cpu_us));
                }
                let r = match args.launch_api.as_str() {
                    _ if args.capture > 0 => (d.graph_launch)(exec, stream),
                    "kernel" => (d.launch)(
                        func,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                    "ex" => (d.launch_ex)(&config, func, params.as_mut_ptr(), std::ptr::null_mut()),
                    "coop" => {
                        (d.launch_coop)(func, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr())
                    }
                    "graph" => (d.graph_launch)(exec, stream),
                    "coop-multi" => {
                        let mut list: Vec<MultiDeviceParams> = multi
                            .iter()
                            .map(|&(func, stream)| MultiDeviceParams {
                                func,
                                grid: [1, 1, 1],
                                block: [1, 1, 1],
                                shmem: 0,
                                stream,
                                params: params.as_mut_ptr(),
                            })
                            .collect();
                        (d.launch_coop_multi)(list.as_mut_ptr(), list.len() as u32, 0)
                    }
                    other => bail!("unknown --launch-api {other}"),
                };
                if r != 0 {
                    bail!("{} launch failed with CUresult {r}", args.launch_api);
                }
                kernels += if args.launch_api == "graph" || args.capture > 0 {
                    per_launch
                } else {
                    1
                };
                launched += 1;
            }
            if let Some(a) = &allreduce {
                a.launch(d, stream, args.allreduce_us)?;
            }
            for &(_, s) in &multi {
                check("cuStreamSynchronize", (d.stream_sync)(s))?;
            }
            waiter.wait()?;
            demand.push((start, monotonic_ns()));
            if args.gap_ms > 0.0 && Instant::now() < end {
                std::thread::sleep(
                    Duration::from_secs_f64(args.gap_ms / 1e3)
                        .min(end.saturating_duration_since(Instant::now())),
                );
            }
        }
        if let Some(path) = &args.bursts_file {
            let text: String = bursts.iter().map(|t| format!("{t}\n")).collect();
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(path) = &args.demand_file {
            use std::io::Write as _;
            let text: String = demand.iter().map(|(a, b)| format!("{a} {b}\n")).collect();
            // One write on an O_APPEND file: threads never interleave lines.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(kernels)
}

/// `--allreduce COMM:RANKS:RANK`.
pub(crate) struct Allreduce {
    comm: u64,
    ranks: u32,
    rank: u32,
    /// `fake_allreduce`.
    func: usize,
}

impl Allreduce {
    fn new(d: &Driver, spec: &str) -> anyhow::Result<Allreduce> {
        let parts: Vec<&str> = spec.split(':').collect();
        let [comm, ranks, rank] = parts[..] else {
            bail!("--allreduce {spec}: expected COMM:RANKS:RANK");
        };
        let n = |what: &str, v: &str| -> anyhow::Result<u64> {
            v.parse()
                .with_context(|| format!("--allreduce {spec}: {what} {v:?} is not a number"))
        };
        let func = load_kernel(d, c"fake_allreduce")?;
        Ok(Allreduce {
            comm: n("communicator", comm)?,
            ranks: n("ranks", ranks)? as u32,
            rank: n("rank", rank)? as u32,
            func: func as usize,
        })
    }

    /// Whether to make step `done + 1`, `time_left` as this rank sees it.
    /// Rank 0 decides when to stop and writes the last step to a file
    /// beside the simulator's state (`FAKECUDA_DIR`): two steps on, which
    /// every rank can still reach (none is more than one allreduce ahead
    /// of another); the others stop there.
    fn go_on(&self, done: u64, time_left: bool) -> anyhow::Result<bool> {
        let dir = std::env::var_os("FAKECUDA_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("allreduce-{}.last", self.comm));
        let last = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok());
        if let Some(last) = last {
            return Ok(done < last);
        }
        if self.rank == 0 && !time_left {
            let tmp = dir.join(format!("allreduce-{}.{}", self.comm, std::process::id()));
            std::fs::write(&tmp, (done + 2).to_string())
                .and_then(|()| std::fs::rename(&tmp, &path))
                .with_context(|| format!("writing {}", path.display()))?;
            return Ok(true);
        }
        Ok(true)
    }

    /// Launches this rank's allreduce onto `stream`.
    fn launch(&self, d: &Driver, stream: Ptr, us: u64) -> anyhow::Result<()> {
        let (mut comm, mut ranks, mut rank, mut us) = (self.comm, self.ranks, self.rank, us);
        let func = self.func as Ptr;
        // SAFETY: the function loaded in `new`, and the four parameters
        // the simulator's collective takes.
        unsafe {
            let mut params: [Ptr; 4] = [
                (&raw mut comm).cast(),
                (&raw mut ranks).cast(),
                (&raw mut rank).cast(),
                (&raw mut us).cast(),
            ];
            let null = std::ptr::null_mut();
            check(
                "cuLaunchKernel (allreduce)",
                (d.launch)(func, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr(), null),
            )
        }
    }
}

/// Keeps the CPU busy for `d` (a framework's work before a launch, which
/// a sleep would not model: the thread must not give its core away).
fn busy_for(d: Duration) {
    let until = Instant::now() + d;
    while Instant::now() < until {
        std::hint::spin_loop();
    }
}
