//! The launch gate: a kernel (or graph) is launched on a device only while
//! this process holds that device's token.
//!
//! Fast path: the token's deadline is in the future — one atomic load and
//! a compare against `CLOCK_MONOTONIC` (vDSO, no syscall), plus a counter
//! increment for idle detection. No lock, no allocation.
//!
//! Slow path (per device, one thread at a time): wait for the work
//! launched under the expired token to finish, report the time really used
//! (overuse included) with the predicted next burst, and block until the
//! scheduler grants a new token.
//!
//! A watcher thread gives a token back early when the process stops using
//! the device for `GEMINI_IDLE_MS` (default 5 ms), so device time is never
//! reserved and unused. Using the device means launching *or waiting for
//! its own work*: a thread blocked in a synchronising call
//! (`cuCtxSynchronize`, `cuStreamSynchronize`, `cuEventSynchronize`, a
//! blocking `cuMemcpy*`) or polling `cuStreamQuery`/`cuEventQuery` is
//! inside a call the gate counts, so a training step that queues its
//! kernels and then blocks in `loss.item()` keeps its token through the
//! wait. Only time with no such call in flight and none made counts as
//! idle (a CPU gap between iterations).
//!
//! The gate also learns how long the process stays quiet after its waits
//! return. When that is predictably at least two and a half round trips
//! to the scheduler (`leads::early_release`; a data loader's or
//! an optimizer's CPU work after every step), the watcher is woken as the
//! wait returns and gives the token back at once, at the end of the
//! burst, instead of holding an idle device through the gap; the
//! scheduler lends the device to others until the process usually comes
//! back. Shorter gaps keep the token.
//!
//! Every grant, close and give-back of a token is one transition of the
//! state machine in `token`, under the gate's slow lock.
//!
//! Under a lent token (another group owed time is away and will be back)
//! a launch is admitted only while the work queued is predicted to end
//! within the token, from the device time per launch learned from waits
//! that proved those launches run (see `covers`: an old event's
//! completion proves nothing about the kernels queued since).

use crate::capture;
use crate::clock::now_ns;
use crate::covers::{self, Covers};
use crate::cuda::{CUDA_ERROR_NOT_PERMITTED, CUDA_SUCCESS};
use crate::driver::{self, CUresult};
use crate::log::debug;
use crate::state::{self, Gate, MAX_GATES, State, current_device, lock};
use crate::syncer;

mod admission;
mod ahead;
mod contexts;
mod devclock;
mod exit;
mod late;
mod leads;
mod learn;
mod measure;
mod settle;
mod token;
mod waits;
mod watcher;

pub(crate) use contexts::synchronize_device;
pub use contexts::{context_gone, context_made, context_may_go};
use gemini_protocol::{Reply, Request};
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use token::{End, Grant, Outcome, Transition, transition};
pub use waits::{waiting, waiting_on};

/// Whether the calling thread has a current context.
fn has_context() -> bool {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let r = unsafe { driver::ctx_get_current(&mut ctx) };
    r == CUDA_SUCCESS && !ctx.is_null()
}

/// Marks a thread as inside a driver call that uses the device until
/// dropped.
#[derive(Debug)]
pub struct InCall(Option<&'static Gate>);

impl Drop for InCall {
    #[inline]
    fn drop(&mut self) {
        if let Some(g) = self.0 {
            g.exited.fetch_add(1, Ordering::Release);
        }
    }
}

/// Lets a launch onto `stream` (`per_thread`: the caller's null stream is
/// its per-thread one) through once this process holds the token of its
/// device; keep the returned guard alive across the real launch call.
/// `Err` is the CUDA result to return instead of launching. A launch into
/// a capturing stream only records a graph node and passes ungated (the
/// graph's launch is gated).
#[inline]
pub fn admit_on(stream: *mut c_void, per_thread: bool) -> Result<InCall, CUresult> {
    if capture::captured(stream, per_thread) {
        return Ok(InCall(None));
    }
    admit_cost(stream, per_thread, 0)
}

/// [`admit_on`] for a launch of the graph `exec`: under a lent token it
/// is counted as the device time its last runs took (see `graphs`), not
/// as one ordinary launch.
pub fn admit_graph(
    exec: *mut c_void,
    stream: *mut c_void,
    per_thread: bool,
) -> Result<InCall, CUresult> {
    if capture::captured(stream, per_thread) {
        return Ok(InCall(None));
    }
    let cost = crate::graphs::cost(exec).unwrap_or(UNKNOWN_GRAPH);
    let call = admit_cost(stream, per_thread, cost)?;
    if let (Some(g), true) = (call.0, cost != UNKNOWN_GRAPH) {
        g.graph_launches.fetch_add(1, Ordering::Relaxed);
        g.graph_ns.fetch_add(cost, Ordering::Relaxed);
        g.learn_graph(cost);
    }
    Ok(call)
}

/// The context of an explicit `stream` and its ordinal, for a launch from
/// a thread with no current context: a `CUkernel` (`cuLibraryGetKernel`)
/// runs in its stream's context, and the driver takes it (cuda.h).
#[cold]
fn stream_context(stream: *mut c_void) -> Option<(usize, *mut c_void)> {
    if has_context() {
        return None; // the null, legacy and per-thread streams are the current context's
    }
    stream_device(stream)
}

/// The ordinal and context of an explicit (created) `stream`.
fn stream_device(stream: *mut c_void) -> Option<(usize, *mut c_void)> {
    if (stream as usize) <= 2 {
        return None;
    }
    let ctx = driver::stream_ctx(stream)?;
    let dev = context_device(state::current()?, ctx)?;
    Some((dev, ctx))
}

/// The ordinal of context `ctx`: one the process made or retained, or
/// one it did not see made (a green context's), asked of the driver and
/// recorded from then on (its work is waited for at token ends too).
pub(crate) fn context_device(st: &State, ctx: *mut c_void) -> Option<usize> {
    let known = lock(&st.contexts)
        .iter()
        .find(|&&(c, _)| c == ctx as usize)
        .map(|&(_, d)| d as usize);
    let dev = match known {
        Some(dev) => dev,
        None => {
            let dev = driver::ctx_device(ctx)?;
            contexts::context_made(ctx, dev);
            usize::try_from(dev).ok()?
        }
    };
    (dev < MAX_GATES).then_some(dev)
}

/// Lets a launch onto each of `streams` through, each on its own device:
/// `cuLaunchCooperativeKernelMultiDevice`, one kernel per device onto a
/// stream the program created there. Tokens are taken in the order of the
/// devices (two such launchers never wait on each other's); keep the
/// guards alive across the real call.
pub fn admit_streams(mut streams: Vec<*mut c_void>) -> Result<Vec<InCall>, CUresult> {
    let mut found: Vec<(usize, *mut c_void, *mut c_void)> = Vec::new();
    streams.retain(|&s| !capture::captured(s, false));
    for s in streams {
        // A stream the driver does not know: its answer will say so.
        if let Some((dev, ctx)) = stream_device(s) {
            found.push((dev, ctx, s));
        }
    }
    found.sort_by_key(|&(dev, ..)| dev);
    found
        .into_iter()
        .map(|(dev, ctx, s)| admit_at(dev, Some(ctx), s, false, 0))
        .collect()
}

/// [`admit_on`] for a launch onto `stream` predicted to take `cost` ns on
/// the device (0: as long as the process's launches usually take).
#[inline]
fn admit_cost(stream: *mut c_void, per_thread: bool, cost: u64) -> Result<InCall, CUresult> {
    // An explicit stream's work runs on the stream's GPU, whatever context
    // is current (a `CUkernel` runs in the stream's context, cuda.h): on a
    // machine of several GPUs it is gated there (`cuStreamGetCtx` and the
    // look-up of the context's GPU instead of `cuCtxGetDevice`; a
    // one-GPU process pays nothing).
    let multi = state::current().is_some_and(|s| !s.single_device);
    let on_stream = if multi && (stream as usize) > 2 {
        stream_device(stream)
    } else {
        None
    };
    let (dev, launch_ctx) = match on_stream {
        Some((dev, ctx)) => (dev, Some(ctx)),
        None => match current_device() {
            Some(dev) => (dev, None),
            None => match stream_context(stream) {
                Some((dev, ctx)) => (dev, Some(ctx)),
                // No context (the real call will report it) or a device
                // beyond the gates: let the driver answer.
                None => return Ok(InCall(None)),
            },
        },
    };
    admit_at(dev, launch_ctx, stream, per_thread, cost)
}

/// [`admit_cost`] on ordinal `dev`, in `launch_ctx` (`None`: the calling
/// thread's current context).
#[inline]
fn admit_at(
    dev: usize,
    launch_ctx: Option<*mut c_void>,
    stream: *mut c_void,
    per_thread: bool,
    cost: u64,
) -> Result<InCall, CUresult> {
    if let Some(st) = state::current() {
        let g = &st.gates[dev];
        let now = now_ns();
        if g.wait_exit.load(Ordering::Relaxed) != 0 {
            g.learn_gap(now, st);
        }
        // Counted in before the deadline is read (see `admission`).
        if admission::enter(&g.entered, &g.deadline, now, || g.queue_ahead(now, cost)) {
            g.open(now, launch_ctx.is_none().then_some((stream, per_thread)));
            covers::note_launch(g, covers::stream_key(stream, per_thread));
            return Ok(InCall(Some(g)));
        }
    }
    // A thread with no current context (an NCCL proxy or a data loader's
    // pin-memory thread; a one-device process skips the driver call on
    // the fast path) waits for no token where the driver refuses its
    // launch; a CUkernel on an explicit stream runs in the stream's
    // context, and is gated there.
    let launch_ctx = match launch_ctx {
        Some(ctx) => ctx,
        None if has_context() => std::ptr::null_mut(),
        None => match stream_context(stream) {
            Some((d, ctx)) if d == dev => ctx,
            _ => return Ok(InCall(None)),
        },
    };
    // Counted in by the slow path, under the gate's lock.
    let on = launch_ctx.is_null().then_some((stream, per_thread));
    slow_path(dev, cost, launch_ctx, on)?;
    let g: &'static Gate = &state::get().gates[dev];
    covers::note_launch(g, covers::stream_key(stream, per_thread));
    Ok(InCall(Some(g)))
}

impl Gate {
    /// Whether the process usually stays quiet after its waits long enough
    /// to give the token back as a wait returns: `leads::early_release`
    /// or more (or the idle threshold, if shorter), so that another group
    /// uses the GPU for the gap.
    fn quiet_after_waits(&self, st: &State) -> bool {
        let idle = st.settings.idle.as_nanos() as u64;
        self.gap_avg.load(Ordering::Relaxed) >= idle.min(leads::early_release(leads::rtt(st)))
    }

    /// Launches admitted so far.
    /// `waits` before `entered`: a wait counted in `waits` is in `entered`
    /// (it counts itself there first), so the count is never short of
    /// the launches made; one too many (a wait between its two counts)
    /// only makes a span go on (`Gate::close`: the launches "moved").
    pub(crate) fn launches(&self) -> u64 {
        let waits = self.waits.load(Ordering::SeqCst);
        self.entered.load(Ordering::SeqCst).saturating_sub(waits)
    }

    /// Whether one more launch may be queued under the token: while it is
    /// predicted to end, behind the work already queued, within the quota
    /// (and it is counted if so). Launches are asynchronous: without this
    /// bound a program that never waits queues as deep as the driver lets
    /// it (1024 launches: 20 s of 20 ms kernels) under one token, and the
    /// device is its for all of that, whatever its MaxUtil. A launch onto
    /// an empty queue is always admitted (a kernel longer than the token
    /// runs and is accounted as overuse). While the device time per launch
    /// is unknown, `UNKNOWN_LAUNCHES` are admitted per token, and only the
    /// first under a lent one (which ends when the group it is lent from
    /// is back); the token's end then measures them. `cost`: the launch's
    /// predicted device time (ns), 0 for the usual per launch.
    #[inline]
    fn queue_ahead(&self, now: u64, cost: u64) -> bool {
        if cost == UNKNOWN_GRAPH {
            // Onto an empty queue only, and it fills the token.
            let quota_end = self.quota_end.load(Ordering::Relaxed);
            return self
                .queued_end
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |queued| {
                    (queued <= now).then_some(quota_end.max(now + 1))
                })
                .is_ok();
        }
        let per = self.per_launch(cost);
        if per == 0 {
            let limit = if self.lent.load(Ordering::Relaxed) {
                1
            } else {
                UNKNOWN_LAUNCHES
            };
            return self.unknown_launches.fetch_add(1, Ordering::Relaxed) < limit;
        }
        let quota_end = self.quota_end.load(Ordering::Relaxed);
        self.queued_end
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |queued| {
                let end = queued.max(now) + per;
                (queued <= now || end <= quota_end).then_some(end)
            })
            .is_ok()
    }

    /// The predicted device time of a launch (ns; 0: not known): `cost`
    /// if given, else the estimate of the token's kind (see
    /// `kernel_hi_ns`). Not for a graph not timed yet (`UNKNOWN_GRAPH`),
    /// which its callers count as filling the token.
    #[inline]
    fn per_launch(&self, cost: u64) -> u64 {
        if cost != 0 {
            cost
        } else if self.lent.load(Ordering::Relaxed) || self.last_step.load(Ordering::Relaxed) {
            self.kernel_ns.load(Ordering::Relaxed)
        } else {
            self.kernel_hi_ns.load(Ordering::Relaxed)
        }
    }
}

/// The cost of a launch of a graph not timed yet (see `graphs`): it may
/// run for many milliseconds (a captured step of hundreds of kernels), so
/// it is admitted only onto an empty queue, and no more launches under
/// the same token. Counted as an ordinary launch, 40 launches of a 20 ms
/// graph queued 800 ms under a 30 ms token, before the first was timed.
const UNKNOWN_GRAPH: u64 = u64::MAX;

/// Launches admitted per token while the device time per launch is not
/// known (see `Gate::queue_ahead`). Few: a program of 50 ms kernels
/// queued 16 of them (800 ms) under its first 30 ms token, which a
/// MaxUtil of 0.3 then made it pay back for 2.7 s.
const UNKNOWN_LAUNCHES: u64 = 4;

/// Counts in the launch the slow path lets through (onto `on`, see
/// `Gate::open`), before the gate's lock is let go: counted in after it,
/// a watcher that found the process quiet could give the token back in
/// between (it saw no call in flight), and the launch would reach the
/// driver with no token.
fn count_in(g: &Gate, on: Option<(*mut c_void, bool)>) {
    g.entered.fetch_add(1, Ordering::SeqCst);
    g.open(now_ns(), on);
}

/// The launch's way when the token does not let it pass on the fast path:
/// under the gate's lock, a token another thread got meanwhile, else the
/// token's end and the request for the next (see [`renew`]).
#[cold]
fn slow_path(
    dev: usize,
    cost: u64,
    launch_ctx: *mut c_void,
    on: Option<(*mut c_void, bool)>,
) -> Result<(), CUresult> {
    let st = state::get();
    let refused = st.refused.load(Ordering::Acquire);
    if refused != 0 {
        return Err(refused);
    }
    let g = &st.gates[dev];
    let entered = now_ns();
    let slow = lock(&g.slow);
    // Back before a token planned ahead was asked for: this asks now.
    g.ahead_at.store(0, Ordering::Release);
    let now = now_ns();
    if g.ahead_taken.swap(0, Ordering::AcqRel) != 0 {
        // The watcher took a grant asked ahead while this launch waited
        // for it: asked too late by that much.
        ahead::learn(g, leads::rtt(st), now.saturating_sub(entered), now);
    }
    if now < g.deadline.load(Ordering::Acquire) {
        if g.queue_ahead(now, cost) {
            // Another thread got a token meanwhile.
            count_in(g, on);
            return Ok(());
        }
        // A token whose quota the queued work fills: it ends here.
        debug!(
            "device {dev}: {}token full, {} us of work queued",
            if g.lent.load(Ordering::Relaxed) {
                "lent "
            } else {
                ""
            },
            g.queued_end.load(Ordering::Relaxed).saturating_sub(now) / 1000
        );
    }
    renew(&slow, st, dev, g, cost, (launch_ctx, on))
}

/// The token ran out (or its quota is full): it ends, what it ran goes
/// with the request for the next (or a grant asked ahead is taken), and
/// the grant is installed with the launch that asked going first.
fn renew(
    slow: &std::sync::MutexGuard<'_, ()>,
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    cost: u64,
    (launch_ctx, on): (*mut c_void, Option<(*mut c_void, bool)>),
) -> Result<(), CUresult> {
    let renewal = match transition(slow, st, dev, g, Transition::End(End::RanOut)) {
        Outcome::Renew(r) => r,
        _ => token::Renewal::default(),
    };
    let queue_end = renewal.queue_end;
    let now = now_ns();
    if queue_end != 0 {
        debug!(
            "device {dev}: renewing the lent token with {} us of work still queued",
            queue_end.saturating_sub(now) / 1000
        );
    }
    let asked = ask_in_time(st, dev, g, renewal, now)?;
    let Reply::Token {
        quota_us,
        lent,
        last_step,
        held_us,
        ..
    } = asked.reply
    else {
        return Err(refused(asked.reply));
    };
    // The launch that asked goes first, onto an empty queue (or behind
    // the work a renewed lent token left).
    let first = if cost == UNKNOWN_GRAPH {
        quota_us * 1000 // a graph not timed yet fills the token
    } else {
        g.per_launch(cost)
    };
    let grant = Grant {
        quota_us,
        lent,
        last_step,
        asked: now,
        // (Asked again: that request renewed nothing.)
        queue_end: if asked.again { 0 } else { queue_end },
        sent: asked.sent,
        held_us,
    };
    let t = Transition::Grant {
        grant,
        first: Some(first),
        launch_ctx,
    };
    transition(slow, st, dev, g, t);
    count_in(g, on);
    debug!(
        "device {dev}: {} for {quota_us} us (used {} us, burst {} us, {} us per launch){}",
        if lent { "lent token" } else { "token" },
        asked.used_us,
        asked.burst_us,
        g.kernel_ns.load(Ordering::Relaxed) / 1000,
        if asked.ahead {
            format!(
                ", asked ahead (lead now {} us)",
                g.ahead_lead.load(Ordering::Relaxed) / 1000
            )
        } else {
            String::new()
        }
    );
    Ok(())
}

/// What a launch returns where its token request was answered with
/// `reply`, not a token.
fn refused(reply: Reply) -> CUresult {
    match reply {
        Reply::Error(e) if e.kind == gemini_protocol::ErrorKind::PermissionDenied => {
            crate::conn::not_permitted(&e.message)
        }
        other => {
            crate::log::error!("unexpected answer to a token request: {other:?}");
            CUDA_ERROR_NOT_PERMITTED
        }
    }
}

/// The scheduler's answer to a launch's request for the next token.
struct Asked {
    reply: Reply,
    /// It answers a request sent ahead (see `ahead`).
    ahead: bool,
    /// It answers a request made again, the grant of the first over as it
    /// was taken (see [`ask_in_time`]).
    again: bool,
    /// When that request was sent (ns), see `Grant::granted`; for one
    /// answered as this thread waited, later by half a round trip and
    /// [`TAKE_SLACK_NS`] (see [`ask_next`]).
    sent: u64,
    /// What the last token ran (µs), and the burst so far (µs), for the
    /// log.
    used_us: u64,
    burst_us: u64,
}

/// Asks for the next token with what the last one ran (`renewal`), at
/// `now`: a token asked for ahead of this return (see `ahead`) is waited
/// for instead of asking again; a scheduler that forgot it, or that
/// declined it, is asked anew.
fn ask_next(
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    renewal: token::Renewal,
    now: u64,
) -> Result<Asked, CUresult> {
    let mut report = renewal.report;
    let used_us = measure::total_us(&report.ran) + measure::total_us(&report.unproven);
    let burst_start = g.burst_start.load(Ordering::Relaxed);
    let burst_us = if burst_start == 0 {
        g.burst_start.store(now, Ordering::Relaxed);
        g.burst_avg.load(Ordering::Relaxed)
    } else {
        (now - burst_start) / 1000
    };
    let device = st.physical(dev as u32);
    let seq = g.ahead_seq.swap(0, Ordering::AcqRel);
    let answered = match (seq != 0).then(|| st.answer(seq, device)).transpose()? {
        // Declined (the device was in use): asked for now, below.
        Some(Some(Reply::Done)) => {
            debug!("device {dev}: token asked ahead declined, the device in use");
            None
        }
        answered => answered.flatten(),
    };
    let asked = |reply, sent| Asked {
        reply,
        ahead: seq != 0,
        again: false,
        sent,
        used_us,
        burst_us,
    };
    if let Some(reply) = answered {
        // Nothing was sent: what ran goes with the next report.
        g.keep_ran(report);
        let t = now_ns();
        ahead::learn(g, leads::rtt(st), t.saturating_sub(now), t);
        // It may have waited unread: it counts from its grant.
        return Ok(asked(reply, g.ahead_sent.load(Ordering::Relaxed)));
    }
    if !st.settings.token_delay.is_zero() {
        std::thread::sleep(st.settings.token_delay);
    }
    let ran = measure::sent_ahead(st, device, &mut report);
    let req = Request::AcquireToken {
        device,
        ran,
        in_flight: report.in_flight,
        burst_us,
        rtt_us: st.rtt.us(),
        launch_us: launch_us(g),
    };
    // Taken later than it can be on a loaded host (see `TAKE_SLACK_NS`),
    // it counts from there, not from its taking: a thread descheduled
    // between the reply and its taking has that much less left.
    // (Counted from its taking, a lent token taken 8 ms late admitted
    // launches 8 ms into the next group's token, and the span of one
    // that reached the device then stayed open through that group's
    // 20 ms step, which it was charged.)
    let (reply, sent) = st.call_sent(&req, device)?;
    take_delay(st);
    Ok(asked(
        reply,
        sent.saturating_add(leads::rtt(st) / 2 + TAKE_SLACK_NS),
    ))
}

/// The device time of one launch (µs), as learned, for gem-schd: what it
/// bounds is a launch admitted whole ahead of a latency-critical group's
/// return, so the estimates that lean long, of a kernel and of a graph's
/// replay (the longer of the two). 0: not known yet.
fn launch_us(g: &Gate) -> u32 {
    let ns = g
        .kernel_hi_ns
        .load(Ordering::Relaxed)
        .max(g.graph_long_ns.load(Ordering::Relaxed));
    u32::try_from(ns.div_ceil(1000)).unwrap_or(u32::MAX)
}

/// How much later than a round trip after its sending (and gem-schd's
/// holding) a grant read by the thread that waited for it may be taken
/// and still count from its taking. Beside 7 other programs on 2 cores,
/// 87 % of grants were taken later than that with the round trip at its
/// 200 µs bound: by 72 µs at the median, 193 µs at the 90th percentile,
/// 2.1 ms at most. Counted from the grant itself, as one asked ahead is,
/// every token was cut short by as much, which gem-schd's grace and
/// hand-over lead are there for. What this slack leaves is a launch at
/// most this much past a token's end.
const TAKE_SLACK_NS: u64 = 1_000_000;

/// Sleeps as `GEMINI_TEST_TAKE_DELAY_US` says, after a grant is read
/// (tests only).
fn take_delay(st: &State) {
    static TAKEN: AtomicU64 = AtomicU64::new(0);
    let (every, delay) = st.settings.take_delay;
    let every = u64::from(every.max(1));
    if !delay.is_zero() && TAKEN.fetch_add(1, Ordering::Relaxed) % every == every - 1 {
        std::thread::sleep(delay);
    }
}

/// [`ask_next`], where a grant already over as it is taken (this thread
/// descheduled between the reply and now, on a loaded host; or a grant
/// asked ahead, taken by the launch more than its quota after it came)
/// is given back unused and asked for again, once. Let through, the
/// launch that asked would reach the device in the next holder's time,
/// behind its queued work, and the span it opened, within that holder's,
/// took its time (a whole 20 ms step). The second grant is taken
/// whatever is left of it: a program always goes on.
fn ask_in_time(
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    renewal: token::Renewal,
    now: u64,
) -> Result<Asked, CUresult> {
    let asked = ask_next(st, dev, g, renewal, now)?;
    let Reply::Token {
        quota_us, held_us, ..
    } = asked.reply
    else {
        return Ok(asked);
    };
    let taken = now_ns();
    let granted = token::granted_at(asked.sent, held_us, taken, leads::rtt(st));
    let end = granted.saturating_add(quota_us.saturating_mul(1000));
    if end > taken {
        return Ok(asked);
    }
    debug!(
        "device {dev}: token over as it was taken, {} us after its end: asked again",
        (taken - end) / 1000
    );
    // What was proven done since goes with it.
    let again = token::Renewal {
        report: g.take_report(),
        queue_end: 0,
    };
    let asked = ask_next(st, dev, g, again, taken)?;
    Ok(Asked {
        again: true,
        ..asked
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// gem-schd is told the longer of a kernel and a graph's replay, in
    /// whole microseconds: beside 50 µs kernels, a 1.5 ms replay is the
    /// launch a latency-critical group's return must be kept free of.
    #[test]
    fn the_launch_told_to_the_scheduler_is_the_longer_of_a_kernel_and_a_replay() {
        let g = Gate::default();
        assert_eq!(launch_us(&g), 0);
        g.kernel_hi_ns.store(50_200, Ordering::Relaxed);
        assert_eq!(launch_us(&g), 51);
        g.learn_graph(1_500_000);
        assert_eq!(launch_us(&g), 1_500);
        // A shorter replay moves it by an eighth.
        g.learn_graph(500_000);
        assert_eq!(launch_us(&g), 1_375);
    }
}
