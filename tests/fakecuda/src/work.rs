//! Device work: streams and their queues, kernels and their durations,
//! launches, synchronisation, events, and synchronous copies.

use crate::*;

/// Device and queue tail of a stream handle; `ptsz` makes the null stream
/// the per-thread one.
pub(crate) fn stream(
    s: &Sim,
    h: CUstream,
    ptsz: bool,
) -> Result<(usize, Arc<AtomicU64>), CUresult> {
    let h = h as usize;
    let per_thread = |dev: usize| PT_TAIL.with(|t| Arc::clone(&t[dev]));
    match h {
        0 if ptsz => current_device().map(|d| (d, per_thread(d))),
        0 | CU_STREAM_LEGACY => current_device().map(|d| (d, Arc::clone(&s.legacy_tail[d]))),
        CU_STREAM_PER_THREAD => current_device().map(|d| (d, per_thread(d))),
        _ => with_proc(|p| match p.objects.get(&h) {
            Some(Obj::Stream { device, tail, .. }) => Ok((*device, Arc::clone(tail))),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        }),
    }
}

/// The context stream `h` belongs to (`cuStreamGetCtx`): the current one
/// for the null and per-thread streams.
pub(crate) fn stream_ctx(h: CUstream) -> Result<usize, CUresult> {
    let current = || ctx_stack(|s| s.last().copied()).ok_or(CUDA_ERROR_INVALID_CONTEXT);
    match h as usize {
        0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD => current(),
        h => with_proc(|p| match p.objects.get(&h) {
            Some(Obj::Stream { ctx, .. }) if *ctx != 0 => Ok(*ctx),
            Some(Obj::Stream { .. }) => Err(CUDA_ERROR_INVALID_CONTEXT),
            _ => Err(CUDA_ERROR_INVALID_HANDLE),
        }),
    }
}

pub(crate) fn default_kernel_us() -> u64 {
    std::env::var("FAKECUDA_KERNEL_US")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(100)
}

pub(crate) fn function_for(name: &str) -> Func {
    if name == "fake_spin" {
        return Func::Spin;
    }
    if name == "gemini_spin" {
        return Func::SpinNs;
    }
    if name == "fake_allreduce" {
        return Func::Collective;
    }
    let fixed = name
        .strip_prefix("fixed_")
        .and_then(|r| r.strip_suffix("us"))
        .and_then(|n| n.parse().ok());
    Func::Fixed(fixed.unwrap_or_else(default_kernel_us))
}

/// Duration in ns of one launch of `f` with `params`.
pub(crate) fn kernel_ns(f: CUfunction, params: *mut *mut c_void) -> Result<u64, CUresult> {
    let func = with_proc(|p| match p.objects.get(&(f as usize)) {
        Some(Obj::Function(func) | Obj::Kernel(func)) => Ok(func.clone()),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })?;
    match func {
        Func::Fixed(us) => Ok(us * 1000),
        Func::Spin => {
            let first = get(params as *const *mut c_void)?;
            Ok(get(first as *const u64)?.saturating_mul(1000))
        }
        Func::SpinNs => {
            let first = get(params as *const *mut c_void)?;
            get(first as *const u64)
        }
        // Its duration once its peers are there (the fourth parameter).
        Func::Collective => {
            // SAFETY: the program's kernel parameters: four for this kernel.
            let fourth = get(unsafe { params.add(3) } as *const *mut c_void)?;
            Ok(get(fourth as *const u64)?.saturating_mul(1000))
        }
    }
}

/// Whether `h` (with `ptsz`) is the legacy default stream.
pub(crate) fn is_legacy(h: CUstream, ptsz: bool) -> bool {
    matches!(h as usize, 0 if !ptsz) || h as usize == CU_STREAM_LEGACY
}

/// Issues `ns` of device work to stream `h` (`kind`: none for work that
/// takes no device time): recorded into the stream's capture if it is
/// capturing, else queued on the device.
pub(crate) fn issue(s: &Sim, h: CUstream, ptsz: bool, ns: u64, kind: Option<Kind>) -> R {
    // Without an open capture, the capture bookkeeping (a process-wide
    // lock) is skipped.
    let captured = capture::any_open()
        && with_proc(|p| {
            if is_legacy(h, ptsz) {
                return p.captures.legacy_work().map(|_| false);
            }
            match p.captures.of(h as usize) {
                Some(c) if c.invalidated => Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
                Some(c) => {
                    c.nodes.push(ns);
                    Ok(true)
                }
                None => Ok(false),
            }
        })?;
    let (dev, tail) = stream(s, h, ptsz)?;
    if !captured {
        collective::wait_stream(&tail);
    }
    if let (false, Some(kind)) = (captured, kind) {
        let end = s.run(dev, ns, &tail, kind as u32)?;
        note_ctx_end(h, end);
    }
    Ok(())
}

/// Work on stream `h` ends at `end`: so does its context's, where the
/// process has several contexts.
pub(crate) fn note_ctx_end(h: CUstream, end: u64) {
    if !MANY_CONTEXTS.load(Ordering::Acquire) {
        return;
    }
    let own = matches!(h as usize, 0 | CU_STREAM_LEGACY | CU_STREAM_PER_THREAD);
    let current = ctx_stack(|st| st.last().copied());
    with_proc(|p| {
        let ctx = if own {
            current
        } else {
            match p.objects.get(&(h as usize)) {
                Some(Obj::Stream { ctx, .. }) => Some(*ctx),
                _ => None,
            }
        };
        if let Some(ctx) = ctx {
            p.ctx_end
                .entry(ctx)
                .or_default()
                .fetch_max(end, Ordering::AcqRel);
        }
    });
}

/// Where the current context's work ends: its own, with several
/// contexts; else the device's (the process's one context there).
pub(crate) fn current_ctx_end(s: &Sim, dev: usize) -> u64 {
    let ctx = ctx_stack(|st| st.last().copied()).unwrap_or(0);
    ctx_end(s, dev, ctx)
}

/// When the work of context `ctx` (on device `dev`) ends.
pub(crate) fn ctx_end(s: &Sim, dev: usize, ctx: usize) -> u64 {
    if !MANY_CONTEXTS.load(Ordering::Acquire) {
        return s.last_end[dev].load(Ordering::Acquire);
    }
    with_proc(|p| p.ctx_end.get(&ctx).map_or(0, |e| e.load(Ordering::Acquire)))
}

/// A wait for (or query of) stream `h`: refused on a capturing stream
/// (which invalidates its capture) and, as a potentially unsafe call, on
/// the legacy stream while a capture forbids it.
pub(crate) fn check_wait(h: CUstream, ptsz: bool) -> R {
    if !capture::any_open() {
        return Ok(());
    }
    with_proc(|p| {
        if is_legacy(h, ptsz) {
            return p.captures.unsafe_call();
        }
        match p.captures.of(h as usize) {
            Some(c) => {
                c.invalidated = true;
                Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
            }
            None => Ok(()),
        }
    })
}

/// `FAKECUDA_NULL_LAUNCH=1`: launches return at once and run nothing, a
/// driver stub that costs next to nothing, so that a benchmark measures
/// what the hook adds to a launch and not the simulator's own work.
fn null_launch() -> bool {
    static NULL: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *NULL.get_or_init(|| std::env::var("FAKECUDA_NULL_LAUNCH").is_ok_and(|v| v == "1"))
}

pub(crate) fn launch(
    f: CUfunction,
    grid: [u32; 3],
    h: CUstream,
    params: *mut *mut c_void,
    ptsz: bool,
    kind: Kind,
) -> R {
    if null_launch() {
        return Ok(());
    }
    let s = initialised()?;
    // A CUkernel runs in its stream's context: none need be current on an
    // explicit stream (cuda.h). Else no context: CUDA_ERROR_INVALID_CONTEXT
    // first.
    let kernel = with_proc(|p| matches!(p.objects.get(&(f as usize)), Some(Obj::Kernel(_))));
    if !(kernel && stream_ctx(h).is_ok() && h as usize > CU_STREAM_PER_THREAD) {
        current_device()?;
    }
    if grid.contains(&0) {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let collective = with_proc(|p| {
        matches!(
            p.objects.get(&(f as usize)),
            Some(Obj::Function(Func::Collective) | Obj::Kernel(Func::Collective))
        )
    });
    if collective && !capture::any_open() {
        return collective::launch(s, h, ptsz, params);
    }
    let dur = kernel_ns(f, params)?;
    stall();
    issue(s, h, ptsz, dur, Some(kind))
}

/// `FAKECUDA_LAUNCH_STALL=N:US`: every Nth kernel launch of the process
/// (counted from its first) takes US microseconds before its work is
/// queued, as a launch whose thread the host descheduled does, or one
/// that blocks on a full push buffer: its work reaches the device only
/// then, behind whatever other processes queued meanwhile.
fn stall() {
    static EVERY: std::sync::OnceLock<Option<(u64, u64)>> = std::sync::OnceLock::new();
    static LAUNCHES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let every = EVERY.get_or_init(|| {
        let v = std::env::var("FAKECUDA_LAUNCH_STALL").ok()?;
        let (n, us) = v.split_once(':')?;
        Some((n.parse().ok().filter(|&n| n > 0)?, us.parse().ok()?))
    });
    if let Some((n, us)) = *every {
        let k = LAUNCHES.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        if k.is_multiple_of(n) {
            std::thread::sleep(std::time::Duration::from_micros(us));
        }
    }
}

/// `cuLaunchCooperativeKernelMultiDevice` (deprecated since CUDA 11.3):
/// one kernel per device, each onto a stream the program created on that
/// device (not a null stream), no device twice; all are checked before
/// any is launched.
pub(crate) fn launch_multi_device(list: *mut CudaLaunchParams, n: u32) -> R {
    let s = initialised()?;
    if list.is_null() || n == 0 || n as usize > s.devices() as usize {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller passes `n` entries by contract.
    let entries = unsafe { std::slice::from_raw_parts(list, n as usize) };
    let mut devices = Vec::new();
    let mut runs = Vec::new();
    for e in entries {
        if (e.h_stream as usize) <= CU_STREAM_PER_THREAD || e.grid_dim.contains(&0) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        let (dev, _) = stream(s, e.h_stream, false)?;
        if devices.contains(&dev) {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        devices.push(dev);
        runs.push((e.h_stream, kernel_ns(e.function, e.kernel_params)?));
    }
    for (h, ns) in runs {
        issue(s, h, false, ns, Some(Kind::Cooperative))?;
    }
    Ok(())
}

pub(crate) fn sync_stream(h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    check_wait(h, ptsz)?;
    collective::wait_stream(&tail);
    s.wait(tail.load(Ordering::Acquire));
    trim_pools(s);
    Ok(())
}

pub(crate) fn query_stream(h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    check_wait(h, ptsz)?;
    if collective::pending_on(&tail) || !s.is_done(tail.load(Ordering::Acquire)) {
        Err(CUDA_ERROR_NOT_READY)
    } else {
        Ok(())
    }
}

/// Records `e` on `h`: the time its work ends, or, on a capturing stream,
/// a node of the capture (other streams that wait for it join it).
pub(crate) fn record_event(e: CUevent, h: CUstream, ptsz: bool) -> R {
    let s = initialised()?;
    event_alive(e as usize)?;
    let (dev, tail) = stream(s, h, ptsz)?;
    if !capture::any_open() {
        collective::wait_stream(&tail);
    }
    let capture = with_proc(|p| {
        if is_legacy(h, ptsz) {
            p.captures.legacy_work()?;
            return Ok(None);
        }
        match p.captures.of(h as usize) {
            Some(c) if c.invalidated => Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED),
            Some(c) => Ok(Some(c.id)),
            None => Ok(None),
        }
    })?;
    let t = match capture {
        None => Some(s.marker(dev, tail.load(Ordering::Acquire))?),
        Some(_) => None,
    };
    with_proc(|p| match p.objects.get_mut(&(e as usize)) {
        Some(Obj::Event { time, captured, .. }) => {
            *captured = capture;
            if t.is_some() {
                *time = t;
            }
            Ok(())
        }
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })
}

/// Later work on the stream starts after the event's work; a stream that
/// waits for an event recorded in a capture joins that capture.
pub(crate) fn wait_event(h: CUstream, e: CUevent, ptsz: bool) -> R {
    let s = initialised()?;
    let (_, tail) = stream(s, h, ptsz)?;
    let joined = with_proc(|p| {
        let captured = match p.objects.get(&(e as usize)) {
            Some(Obj::Event { captured, .. }) => *captured,
            _ => return Err(CUDA_ERROR_INVALID_HANDLE),
        };
        let Some(id) = captured else { return Ok(false) };
        if is_legacy(h, ptsz) || p.captures.of(h as usize).is_some() {
            return Ok(true); // a capturing stream waits within its graph
        }
        match p.captures.of_id(id) {
            Some(c) => {
                c.streams.push(h as usize);
                Ok(true)
            }
            None => Ok(false), // that capture is over: an ordinary wait
        }
    })?;
    if !joined && let Some(t) = event_time(e)? {
        // On a time-sliced device, work of another device is waited for
        // by a marker in this device's queue.
        let dev = stream(s, h, ptsz)?.0;
        let t = match device::slicing::decode(t) {
            Some((d, _)) if d != dev => s.marker(dev, t)?,
            _ => t,
        };
        tail.fetch_max(t, Ordering::AcqRel);
    }
    Ok(())
}

/// The time `e`'s work ends; refused for an event last recorded in a
/// capture that is still open.
pub(crate) fn event_time(e: CUevent) -> Result<Option<u64>, CUresult> {
    event_alive(e as usize)?;
    with_proc(|p| match p.objects.get(&(e as usize)) {
        Some(Obj::Event {
            captured: Some(id), ..
        }) if p.captures.has_id(*id) => Err(CUDA_ERROR_CAPTURED_EVENT),
        Some(Obj::Event { time, .. }) => Ok(*time),
        _ => Err(CUDA_ERROR_INVALID_HANDLE),
    })
}

/// When event `e`, recorded for the work that ends at `when`, completed
/// (`None`: not yet); kept in the event from then on, as a real event
/// keeps its timestamp (a time-sliced device keeps only recent markers'
/// times, and an event timed long after its record read the device's
/// present instead).
pub(crate) fn resolved(s: &Sim, e: CUevent, when: u64) -> Option<u64> {
    let at = s.time_of(when)?;
    if at != when {
        with_proc(|p| {
            if let Some(Obj::Event { time, .. }) = p.objects.get_mut(&(e as usize))
                && *time == Some(when)
            {
                *time = Some(at);
            }
        });
    }
    Some(at)
}

/// `cuEventElapsedTime`: as cuda.h says, an event created with
/// `CU_EVENT_DISABLE_TIMING`, or one never recorded, is
/// `CUDA_ERROR_INVALID_HANDLE`; one still pending `CUDA_ERROR_NOT_READY`.
pub(crate) fn elapsed(ms: *mut f32, start: CUevent, end: CUevent) -> R {
    let s = initialised()?;
    let timed = |e: CUevent| {
        with_proc(|p| {
            matches!(
                p.objects.get(&(e as usize)),
                Some(Obj::Event { timing: true, .. })
            )
        })
    };
    let (a, b) = (event_time(start)?, event_time(end)?);
    if !timed(start) || !timed(end) {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    }
    let (Some(a), Some(b)) = (a, b) else {
        return Err(CUDA_ERROR_INVALID_HANDLE);
    };
    let (Some(a), Some(b)) = (resolved(s, start, a), resolved(s, end, b)) else {
        return Err(CUDA_ERROR_NOT_READY);
    };
    put(ms, (b as f64 - a as f64) as f32 / 1e6)
}

/// A synchronous copy or memset returns once the work before it is done.
/// On the legacy default stream that is every blocking stream's work of
/// the context (the legacy stream synchronises with them all); on the
/// per-thread default stream (`_ptds`), that stream's work and the legacy
/// stream's.
pub(crate) fn sync_copy_on(ptds: bool) -> R {
    let s = initialised()?;
    let dev = current_device()?;
    if !ptds {
        // On the legacy stream: potentially unsafe during a capture.
        with_proc(|p| p.captures.unsafe_call())?;
    }
    collective::wait_device(dev);
    let until = if ptds {
        let (_, tail) = stream(s, std::ptr::null_mut(), true)?;
        tail.load(Ordering::Acquire)
            .max(s.legacy_tail[dev].load(Ordering::Acquire))
    } else {
        current_ctx_end(s, dev)
    };
    s.wait(until);
    trim_pools(s);
    Ok(())
}

/// A "synchronous" copy that does not wait for the host (device to
/// device): queued onto the null stream (`ptds`: the thread's own) like
/// asynchronous work; on the legacy stream, potentially unsafe during a
/// capture.
pub(crate) fn queued_copy(ptds: bool) -> R {
    if !ptds {
        with_proc(|p| p.captures.unsafe_call())?;
    }
    check_stream(std::ptr::null_mut(), ptds)
}

pub(crate) fn sync_copy() -> R {
    sync_copy_on(false)
}

pub(crate) fn sync_copy_ptds() -> R {
    sync_copy_on(true)
}

/// Asynchronous work that takes no device time (copies, memsets, frees):
/// recorded into a capture, or nothing.
pub(crate) fn check_stream(h: CUstream, ptsz: bool) -> R {
    issue(initialised()?, h, ptsz, 0, None)
}
