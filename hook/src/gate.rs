//! The launch gate: a kernel (or graph) is launched on a device only while
//! this process holds that device's token.
//!
//! Fast path: the token's deadline is in the future — one atomic load and
//! a compare against `CLOCK_MONOTONIC` (vDSO, no syscall), plus a relaxed
//! store of the launch time for idle detection. No lock, no allocation.
//!
//! Slow path (per device, one thread at a time): wait for the work
//! launched under the expired token to finish, report the time really used
//! (overuse included) with the predicted next burst, and block until the
//! scheduler grants a new token.
//!
//! A watcher thread gives a token back early when the process stops
//! launching for `GEMINI_IDLE_MS` (default 5 ms), so device time is never
//! reserved and unused.

use crate::conn::CUDA_ERROR_NOT_PERMITTED;
use crate::driver::{self, CUresult};
use crate::log::debug;
use crate::state::{self, MAX_GATES, State, lock};
use gemini_protocol::{Reply, Request};
use std::ffi::c_void;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::Duration;

/// `CLOCK_MONOTONIC` in ns.
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// One device's token, as this process sees it.
#[derive(Debug, Default)]
pub struct Gate {
    /// End of the token's validity (ns); 0: no token.
    deadline: AtomicU64,
    /// When the token was granted (ns); 0: no token to account for.
    granted_at: AtomicU64,
    /// Launch calls entered and left. Counters, not timestamps, so the
    /// fast path reads the clock once; the watcher tells activity from
    /// their changes, and a launch blocked in the driver (its queue full)
    /// from `entered != exited`.
    entered: AtomicU64,
    exited: AtomicU64,
    /// End of the granted quota (ns).
    quota_end: AtomicU64,
    /// Start of the current period of activity (ns); 0: idle.
    burst_start: AtomicU64,
    /// Smoothed length of past activity periods (µs).
    burst_avg: AtomicU64,
    /// Smoothed overuse of past tokens (ns): work still queued when the
    /// token ran out. Launching stops this much before the token's end.
    overuse: AtomicU64,
    /// Context the token's work was launched in (for the watcher's sync).
    ctx: AtomicUsize,
    /// Held by whoever is acquiring or releasing the token.
    slow: Mutex<()>,
}

/// Device ordinal of the calling thread's current context. A process
/// that sees one device needs no driver call to know it.
#[inline]
fn current_device() -> Option<usize> {
    if state::current().is_some_and(|s| s.single_device) {
        return Some(0);
    }
    let mut dev: i32 = -1;
    // SAFETY: out-pointer to a local.
    let r = unsafe { driver::ctx_get_device(&mut dev) };
    (r == 0 && dev >= 0 && (dev as usize) < MAX_GATES).then_some(dev as usize)
}

/// Marks a thread as inside a real launch call until dropped.
#[derive(Debug)]
pub struct InLaunch(Option<&'static Gate>);

impl Drop for InLaunch {
    #[inline]
    fn drop(&mut self) {
        if let Some(g) = self.0 {
            g.exited.fetch_add(1, Ordering::Release);
        }
    }
}

/// Lets a launch through once this process holds the token of the current
/// device; keep the returned guard alive across the real launch call.
/// `Err` is the CUDA result to return instead of launching.
#[inline]
pub fn admit() -> Result<InLaunch, CUresult> {
    let Some(dev) = current_device() else {
        // No context (the real call will report it) or a device beyond the
        // gates: let the driver answer.
        return Ok(InLaunch(None));
    };
    if let Some(st) = state::current() {
        let g = &st.gates[dev];
        if now_ns() < g.deadline.load(Ordering::Acquire) {
            g.entered.fetch_add(1, Ordering::AcqRel);
            return Ok(InLaunch(Some(g)));
        }
    }
    slow_path(dev)?;
    let g: &'static Gate = &state::get().gates[dev];
    g.entered.fetch_add(1, Ordering::AcqRel);
    Ok(InLaunch(Some(g)))
}

#[cold]
fn slow_path(dev: usize) -> Result<(), CUresult> {
    let st = state::get();
    let refused = st.refused.load(Ordering::Acquire);
    if refused != 0 {
        return Err(refused);
    }
    let g = &st.gates[dev];
    let _slow = lock(&g.slow);
    if now_ns() < g.deadline.load(Ordering::Acquire) {
        return Ok(()); // another thread got it meanwhile
    }
    let granted_at = g.granted_at.swap(0, Ordering::AcqRel);
    let mut used_us = 0;
    if granted_at != 0 {
        // The token ran out: wait for the work launched under it, so the
        // time it really took (overuse included) is what gets reported.
        // SAFETY: synchronising the calling thread's context.
        unsafe { driver::ctx_synchronize() };
        let end = now_ns();
        used_us = end.saturating_sub(granted_at) / 1000;
        let over = end.saturating_sub(g.quota_end.load(Ordering::Relaxed));
        let avg = g.overuse.load(Ordering::Relaxed);
        g.overuse.store((avg + over) / 2, Ordering::Relaxed);
    }
    let now = now_ns();
    let burst_start = g.burst_start.load(Ordering::Relaxed);
    let burst_us = if burst_start == 0 {
        g.burst_start.store(now, Ordering::Relaxed);
        g.burst_avg.load(Ordering::Relaxed)
    } else {
        (now - burst_start) / 1000
    };
    let device = st.settings.physical(dev as u32);
    let req = Request::AcquireToken {
        device,
        used_us,
        burst_us,
    };
    match st.call(&req, device)? {
        Reply::Token { quota_us, .. } => {
            let t = now_ns();
            let mut ctx: *mut c_void = std::ptr::null_mut();
            // SAFETY: out-pointer to a local.
            unsafe { driver::ctx_get_current(&mut ctx) };
            g.ctx.store(ctx as usize, Ordering::Relaxed);
            let quota = quota_us * 1000;
            // Stop launching early by the work usually still queued at the
            // end, so the queue drains about when the token ends.
            let early = g.overuse.load(Ordering::Relaxed).min(quota / 2);
            g.quota_end.store(t + quota, Ordering::Relaxed);
            g.granted_at.store(t, Ordering::Release);
            g.deadline.store(t + quota - early, Ordering::Release);
            debug!(
                "device {dev}: token for {quota_us} us (used {used_us} us, burst {burst_us} us)"
            );
            start_watcher(st);
            Ok(())
        }
        other => {
            crate::log::error!("unexpected answer to a token request: {other:?}");
            Err(CUDA_ERROR_NOT_PERMITTED)
        }
    }
}

fn start_watcher(st: &'static State) {
    if st.watcher.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gemini-idle".into())
        .spawn(move || watch(st));
    if spawned.is_err() {
        st.watcher.store(false, Ordering::Release);
    }
}

/// Gives tokens back when the process stops launching.
fn watch(st: &'static State) {
    let idle = st.settings.idle.as_nanos() as u64;
    let tick = Duration::from_nanos((idle / 2).clamp(200_000, 2_000_000));
    // Per gate: launches entered as last seen, and since when unchanged.
    let mut seen: Vec<(u64, u64)> = vec![(0, now_ns()); st.gates.len()];
    loop {
        std::thread::sleep(tick);
        if !state::current().is_some_and(|c| std::ptr::eq(c, st)) {
            return; // forked child: this state is not ours any more
        }
        for (dev, g) in st.gates.iter().enumerate() {
            let now = now_ns();
            let entered = g.entered.load(Ordering::Acquire);
            let busy = entered != g.exited.load(Ordering::Acquire);
            if busy || entered != seen[dev].0 {
                seen[dev] = (entered, now);
                continue;
            }
            let quiet_since = seen[dev].1;
            if g.deadline.load(Ordering::Acquire) <= now || now - quiet_since < idle {
                continue;
            }
            let Ok(_slow) = g.slow.try_lock() else {
                continue;
            };
            if g.deadline.load(Ordering::Acquire) <= now_ns()
                || g.entered.load(Ordering::Acquire) != entered
            {
                continue;
            }
            // Launches from now on take the slow path and wait for us.
            g.deadline.store(0, Ordering::Release);
            let granted_at = g.granted_at.swap(0, Ordering::AcqRel);
            let ctx = g.ctx.load(Ordering::Relaxed) as *mut c_void;
            let t0 = now_ns();
            // SAFETY: the context was current in a thread of this process
            // when the token was taken; pushing it on this thread and
            // popping it again leaves no trace.
            unsafe {
                if !ctx.is_null() && driver::ctx_push(ctx) == 0 {
                    driver::ctx_synchronize();
                    let mut popped = std::ptr::null_mut();
                    driver::ctx_pop(&mut popped);
                }
            }
            let t1 = now_ns();
            // If the work was still running, it ended now; else it ended
            // (about) when the launches stopped.
            let end = if t1.saturating_sub(t0) > 100_000 {
                t1
            } else {
                quiet_since
            };
            let used_us = end.saturating_sub(granted_at) / 1000;
            let burst_start = g.burst_start.swap(0, Ordering::Relaxed);
            if burst_start != 0 {
                let len = end.saturating_sub(burst_start) / 1000;
                let avg = g.burst_avg.load(Ordering::Relaxed);
                g.burst_avg.store(
                    if avg == 0 { len } else { (avg + len) / 2 },
                    Ordering::Relaxed,
                );
            }
            let device = st.settings.physical(dev as u32);
            debug!("device {dev}: idle, token given back after {used_us} us");
            let _ = st.call(&Request::ReleaseToken { device, used_us }, device);
        }
    }
}
