//! Waits: a thread waiting for (or polling) its device work keeps the
//! process busy, and a wait that proves the launches done teaches the
//! gate their device time (see `covers`).

use super::devclock::{self, Mark};
use super::*;

/// The guard of a wait call (see [`waiting`]).
#[derive(Debug)]
pub struct Waiting {
    /// The state, the device's ordinal and its gate.
    at: Option<(&'static State, usize, &'static Gate)>,
    /// What the call proves done if it returns with the work done.
    covers: Covers,
    /// Launches admitted when the call began.
    launches_at: u64,
    /// What the call's completion ends the open span at (see `devclock`).
    mark: Mark,
    /// The call returned with the work before it done (a synchronisation
    /// or blocking copy that succeeded, a query that found it complete).
    finished: bool,
}

impl Waiting {
    /// Says the work before this call is done: where that is the work of
    /// every launch of the gate's sample (see `covers`), the gate learns
    /// from it how long launches take on the device.
    pub fn finished(&mut self) {
        self.finished = true;
    }
}

impl Drop for Waiting {
    fn drop(&mut self) {
        let Some((st, dev, g)) = self.at else { return };
        // Out of `waiting_now` before `exited` (see `admission::in_flight`).
        g.waiting_now.fetch_sub(1, Ordering::SeqCst);
        g.exited.fetch_add(1, Ordering::SeqCst);
        let now = now_ns();
        // All the process's work there proven done: its span closes
        // (unless a launch came meanwhile, see `measure`).
        let proved = self.finished && self.covers.proves_open(dev, g, self.launches_at);
        if proved {
            g.close_marked(now, self.launches_at, self.mark);
        }
        devclock::unmark(g, self.mark);
        if g.in_flight().calls != 0 {
            return; // another thread is still launching or waiting
        }
        if self.finished {
            if self.covers.proves_sample(dev, g, self.launches_at) {
                g.learn_kernel(now);
            }
            let announced = g.quiet_end.swap(0, Ordering::Relaxed);
            if announced != 0 {
                let late = announced as i64 - now as i64;
                let bias = g.quiet_bias.load(Ordering::Relaxed);
                g.quiet_bias
                    .store(bias + (late - bias) / 4, Ordering::Relaxed);
            }
        }
        g.wait_exit.store(now.max(1), Ordering::Relaxed);
        // The step's end: a wait that proves all the token's work done,
        // and none left (not any wait that returned: an allocator's or a
        // watchdog's query of an old event, in the middle of a step).
        if proved && !g.outstanding() && g.last_step.load(Ordering::Relaxed) {
            super::watcher::end_step(st, dev, g);
            return;
        }
        if g.granted_at.load(Ordering::Relaxed) != 0 && g.quiet_after_waits(st) {
            // This process usually goes quiet now: let the watcher give the
            // token back at once.
            let (m, cv) = &st.kick;
            *lock(m) = true;
            cv.notify_one();
        }
    }
}

/// Marks the calling thread as waiting for (or polling) its device work on
/// the current device until the guard drops: the process is busy, not
/// idle, and keeps its token. Never blocks on the device and creates no
/// state: a process that has launched nothing holds no token to keep.
/// `blocks`: the call blocks until the work is done (a synchronisation,
/// a blocking copy), not a query; one in a process that goes quiet after
/// its waits may announce its end (see [`quieting`]). `covers`: what the
/// call proves done if it returns with the work done.
#[inline]
pub fn waiting(blocks: bool, covers: Covers) -> Waiting {
    waiting_on(blocks, covers, None)
}

/// [`waiting`] for the work of context `ctx` (`None` or null: the current
/// one), on its device: `cuCtxSynchronize_v2` names the context it waits
/// for, which need not be current.
pub fn waiting_on(blocks: bool, covers: Covers, ctx: Option<*mut c_void>) -> Waiting {
    let none = Waiting {
        at: None,
        covers,
        launches_at: 0,
        mark: Mark::Host,
        finished: false,
    };
    let Some(st) = state::current() else {
        return none;
    };
    let dev = match ctx {
        Some(ctx) if !ctx.is_null() => context_device(st, ctx),
        _ => current_device(),
    };
    let Some(dev) = dev else {
        return none;
    };
    let g = &st.gates[dev];
    let launches_at = g.launches();
    // Into `entered` first, then `waits`, then `waiting_now`: a wait in
    // `waiting_now` is in `entered - exited` (see `admission::in_flight`),
    // a wait in `waits` is in `entered` (`Gate::launches`, which reads
    // `waits` first, never counts fewer launches than were made), and a
    // wait counted in `entered` but not yet in `waits` reads as a launch
    // in flight, which proves nothing (`covers`).
    g.entered.fetch_add(1, Ordering::SeqCst);
    g.waits.fetch_add(1, Ordering::SeqCst);
    g.waiting_now.fetch_add(1, Ordering::SeqCst);
    // Marked before a quieting's round trip, which the mark would count.
    let mark = devclock::mark(g, covers, blocks);
    if blocks && g.deadline.load(Ordering::Relaxed) != 0 && g.quiet_after_waits(st) {
        quieting(st, dev, g);
    }
    Waiting {
        at: Some((st, dev, g)),
        covers,
        launches_at,
        mark,
        finished: false,
    }
}

// Work left shorter than `leads::quiet_notice` when a wait begins is not
// announced (see [`quieting`]). With a fixed 1 ms, a decode step's 0.8 ms
// of work was never announced, and the device idled for the hand-back
// after every step (about 0.2 ms): the framework-like training beside it
// kept 0.86 of its steps, and 0.91 at 400 µs (`gem-bench --only latency`;
// `docs/benchmarks.md`, "Design decisions").

/// A wait begins in a process that usually goes quiet after its waits:
/// if this wait is the only call in flight and the work queued under the
/// token is predicted to run on for a while, tell the scheduler when it
/// ends, so the device passes to the next holder just before (instead of
/// idling while this process wakes, reports and the next one launches),
/// and launch nothing more under this token (a launch after all takes
/// the slow path and asks again).
#[cold]
fn quieting(st: &'static State, dev: usize, g: &'static Gate) {
    let now = now_ns();
    let end = g.queued_end.load(Ordering::Relaxed);
    if end < now + super::leads::quiet_notice(super::leads::rtt(st)) || g.in_flight().calls != 1 {
        return;
    }
    let Ok(slow) = g.slow.try_lock() else {
        return;
    };
    if let Outcome::Unchanged = transition(&slow, st, dev, g, Transition::Close) {
        return;
    }
    let left = work_left(g, now, end);
    let bias = g.quiet_bias.load(Ordering::Relaxed);
    let left = (left as i64 - bias).max(0) as u64;
    g.quiet_end.store(now + left, Ordering::Relaxed);
    let done_in_us = left / 1000;
    debug!("device {dev}: waiting, quiet after; work ends in about {done_in_us} us");
    let device = st.physical(dev as u32);
    let _ = st.call(&Request::Quieting { device, done_in_us }, device);
}

/// How long the work queued under `g`'s token, predicted to end at `end`,
/// runs on after `now` (ns), by the estimate that leans short. The
/// queue's end was predicted with the one that leans long (a token not
/// lent); the device passes on at the end that leans short: too early,
/// the next holder's first launches wait behind this work (its time is
/// not charged to them), too late, the device idles.
fn work_left(g: &Gate, now: u64, end: u64) -> u64 {
    let (lo, hi) = (
        g.kernel_ns.load(Ordering::Relaxed),
        g.kernel_hi_ns.load(Ordering::Relaxed),
    );
    let left = end.saturating_sub(now);
    if g.lent.load(Ordering::Relaxed) || hi == 0 {
        left
    } else {
        (left as u128 * lo.min(hi) as u128 / hi as u128) as u64
    }
}

/// `g`'s token (not lent) ran out with work still queued, about to be
/// waited for (the caller holds `g.slow`, the launch that ran out blocks
/// on it): where that work runs on for a while, tell the scheduler when it
/// ends, so that a program waiting for the device gets it just before,
/// instead of after this process's wait wakes, it reports, and the next
/// holder wakes and launches (on the 2-core test VM with two CPU hogs,
/// two saturating groups left the device idle 124-175 ms in 4 s without
/// the notice, 33-55 ms with it), where the scheduler's ranking puts the
/// waiting program first. Unlike
/// [`quieting`], the process asks again once the work is done: its group
/// is not away. Only to a scheduler that speaks it, and only where the
/// queue's end is a prediction: not while the time per launch is
/// unknown, work of an earlier token runs on (see `late`), or a graph of
/// unknown cost filled the token (its end is the token's, see
/// `Gate::queue_ahead`); nor for a rank of a job, whose turn counts on
/// its tokens held to their end (gem-schd ignores it). The round trip is
/// waited for (a reply never read would stay in the connection's
/// buffer); it runs while the work does, at least twice as long.
pub(super) fn running_out(st: &State, dev: usize, g: &Gate, now: u64) {
    let end = g.queued_end.load(Ordering::Relaxed);
    let predicted = g.kernel_hi_ns.load(Ordering::Relaxed) != 0
        && g.late_ticket.load(Ordering::Acquire) == 0
        && g.late_since.load(Ordering::Acquire) == 0
        && end != g.quota_end.load(Ordering::Relaxed);
    // (Under a capture open, launches are recorded, not queued.)
    if g.lent.load(Ordering::Relaxed) || !predicted || crate::capture::any_open() {
        return;
    }
    let left = work_left(g, now, end);
    if left < super::leads::quiet_notice(super::leads::rtt(st)) || lock(&st.job).is_some() {
        return;
    }
    if !st.speaks_registered().is_ok_and(|v| v >= RUNNING_OUT_SINCE) {
        return;
    }
    let done_in_us = left / 1000;
    debug!("device {dev}: token ran out; its work ends in about {done_in_us} us");
    let device = st.physical(dev as u32);
    let _ = st.call(&Request::RunningOut { device, done_in_us }, device);
}

/// The protocol version that has [`Request::RunningOut`].
const RUNNING_OUT_SINCE: u16 = 19;
