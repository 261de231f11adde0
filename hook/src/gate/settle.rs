//! The end of a token's accounting: waiting for its work (within a
//! bound), the time it really took, and a lent token renewed ahead.

use super::devclock;
use super::*;

/// How long a token's end waits for its work (see `syncer`): until the
/// work's predicted end (which leans long), and a quota more; while the
/// device time per launch is not known, `UNKNOWN_SYNC_NS`.
fn sync_bound(g: &Gate, granted_at: u64, now: u64) -> Duration {
    if g.kernel_hi_ns.load(Ordering::Relaxed) == 0 {
        return Duration::from_nanos(UNKNOWN_SYNC_NS);
    }
    let left = g.queued_end.load(Ordering::Relaxed).saturating_sub(now);
    let quota = g
        .quota_end
        .load(Ordering::Relaxed)
        .saturating_sub(granted_at);
    Duration::from_nanos(left + quota.max(watcher::STALL_NS))
}

/// [`sync_bound`] while the device time per launch is not known: the few
/// launches admitted then (`UNKNOWN_LAUNCHES`) are measured by it, and
/// the scheduler revokes a token a second past its end.
const UNKNOWN_SYNC_NS: u64 = 250_000_000;

/// Why a token's accounting ends.
#[derive(Debug, Clone, Copy)]
pub(super) enum Settle {
    /// It ran out and a launch wants a new one.
    RanOut,
    /// The process has not used the device since `quiet_since` (ns).
    Idle { quiet_since: u64 },
    /// A wait proved the step's work done under a token that ends with
    /// the step (the job's turn is over): not a pause of the program, so
    /// neither its burst nor an overrun is learned from it.
    StepEnd,
    /// The process only waits, for work that should have ended an idle
    /// threshold ago: work that waits for another process (an NCCL
    /// collective for its peer rank, `cuStreamWaitValue32`, a host
    /// function). Waiting for it would hold the device, and the peer may
    /// need this very device (or another job's peer, which needs ours).
    Stalled,
}

/// Ends `g`'s token (the caller holds `g.slow`): waits for the work
/// launched under it (within a bound), which proves it done and closes
/// its span (see `measure`): the spans proven done wait in `g.ran` for
/// the report. `false` if no token was held. Work not proven done (the
/// wait outlasted its bound, a capture was open, or the work waits on
/// another process) stays outstanding: it is charged once a later wait
/// proves it done (`late`). The one place that ends a token's
/// accounting, for the slow path and the watcher.
pub(super) fn settle(dev: usize, g: &'static Gate, why: Settle) -> bool {
    let granted_at = g.granted_at.swap(0, Ordering::AcqRel);
    if granted_at == 0 {
        return false;
    }
    let t0 = now_ns();
    let ctx = g.ctx.load(Ordering::Relaxed) as *mut c_void;
    let launches = g.launches();
    if let Settle::Stalled = why {
        // What the waits learn from now on spans the stall, not launches.
        g.sample_start.store(0, Ordering::Relaxed);
        // The work goes on without the token: charged late, once done.
        match syncer::sync_within(dev, g, ctx, Duration::ZERO, synchronize_device) {
            Ok(true) => {
                g.close(now_ns(), launches);
            }
            Ok(false) => {}
            Err(ticket) => late::begin(g, ticket, launches, devclock::Mark::Host),
        }
        return true;
    }
    // A capture is open: any synchronisation would fail and invalidate
    // the program's capture. Or the work outlasts the bound: it waits for
    // another process (see `syncer`). Either way the token ends without
    // waiting for its work, which stays outstanding; work that outlasted
    // the bound is charged late, once done. Its end marked on the
    // device's clock first, where it can be (see `devclock`): the sync
    // thread's wake-up is not the work's end.
    let mark = devclock::mark(g, Covers::Context, true);
    if let Settle::RanOut = why {
        super::waits::running_out(state::get(), dev, g, t0);
    }
    let synced = syncer::sync_within(
        dev,
        g,
        ctx,
        sync_bound(g, granted_at, t0),
        synchronize_device,
    );
    let capturing = synced != Ok(true);
    let pending = unsynced(dev, g, why, synced);
    let t1 = now_ns();
    // When the work was done: where the device's clock says so, when it
    // ended, not when this thread woke to see it.
    let done = if capturing {
        t1
    } else {
        devclock::completed_at(g, mark).map_or(t1, |e| e.clamp(granted_at, t1))
    };
    if !capturing && matches!(why, Settle::RanOut) {
        // Every launch of the sample has run: learn from it.
        g.learn_kernel(done);
    }
    let end = match why {
        // If the work was still running, it ended now; else it ended
        // (about) when the process went quiet: no later than its last
        // call, after its last launch.
        Settle::Idle { quiet_since } if capturing || t1.saturating_sub(t0) <= 100_000 => {
            quiet_since.clamp(granted_at, t1)
        }
        _ => done,
    };
    if !capturing {
        // Proven done by now (the quiet process's own sync usually closed
        // its span at the work's end already, see `watcher::quiet_sync`).
        g.close_marked(t1, launches, mark);
    }
    learn_from_end(g, why, end);
    match pending {
        Some(ticket) => late::begin(g, ticket, launches, mark),
        None => devclock::unmark(g, mark),
    }
    true
}

/// What a token's end whose synchronisation gave `synced` did not wait
/// for: nothing, a capture's work, or work that outlasts its prediction
/// (the ticket of its synchronisation, which goes on: charged late).
fn unsynced(dev: usize, g: &Gate, why: Settle, synced: Result<bool, u64>) -> Option<u64> {
    match synced {
        Ok(true) => None,
        Ok(false) => {
            debug!("a capture is open: token ended without waiting for its work ({why:?})");
            None
        }
        Err(ticket) => {
            debug!(
                "device {dev}: the work outlasts its prediction: token ended without waiting for it, charged once done ({why:?})"
            );
            if matches!(why, Settle::RanOut) {
                // The launches took longer than predicted: at least this.
                g.learn_kernel_at_least(now_ns());
            }
            // What the waits learn next spans the wait, not launches.
            g.sample_start.store(0, Ordering::Relaxed);
            Some(ticket)
        }
    }
}

/// What a token's end whose work ended at `end` teaches: how far past
/// its quota the work ran (launching stops that much earlier next time),
/// and, where the process went quiet, how long its burst was.
fn learn_from_end(g: &Gate, why: Settle, end: u64) {
    let quota_end = g.quota_end.load(Ordering::Relaxed);
    if matches!(why, Settle::RanOut) || (end > quota_end && !matches!(why, Settle::StepEnd)) {
        // Work still queued when the token ran out: launching stops this
        // much earlier next time.
        let over = end.saturating_sub(quota_end);
        let avg = g.overuse.load(Ordering::Relaxed);
        g.overuse.store((avg + over) / 2, Ordering::Relaxed);
    }
    if let Settle::Idle { .. } = why {
        let burst_start = g.burst_start.swap(0, Ordering::Relaxed);
        if burst_start != 0 {
            let len = end.saturating_sub(burst_start) / 1000;
            let avg = g.burst_avg.load(Ordering::Relaxed);
            g.burst_avg.store(
                if avg == 0 { len } else { (avg + len) / 2 },
                Ordering::Relaxed,
            );
        }
    }
}

/// Ends a lent token (the caller holds `g.slow`) without waiting for its
/// work: its work goes on into the next token, and is charged once a
/// wait proves it done, to the time it ran (see `measure`). Returns the
/// predicted end of the queue (ns); `None` for a token not lent, no
/// token, or while the device time per launch is not known. Lent tokens
/// are short (they end when the group they are lent from is back) and
/// renewed often while it is late: waiting for the queue to drain before
/// asking again idled the device for the round trip and the wake-up at
/// every renewal (0.4-0.9 ms per 1 ms token, measured). Asked while the
/// last launches still run, the next token comes before they end.
pub(super) fn settle_ahead(dev: usize, g: &'static Gate, now: u64) -> Option<u64> {
    if !g.lent.load(Ordering::Relaxed) || g.kernel_ns.load(Ordering::Relaxed) == 0 {
        return None;
    }
    if g.granted_at.load(Ordering::Acquire) == 0 {
        return None;
    }
    // Asked for when the queue is about to drain (`leads::renew` before),
    // not as soon as it is full: a token granted with most of the work
    // still queued would only admit more behind it, past the time it is
    // lent for. Until then the work is waited for, not slept through: a
    // queue that drains sooner than predicted (the time per launch
    // learned too long) ends the token as any other (`settle`, which
    // learns from the proof). Slept through to the prediction, that time
    // went into the next sample of the time per launch, which then held
    // itself up: 460 µs per launch learned for launches of 53 µs, four
    // admitted per 2 ms token, and a framework-like training kept 0.11
    // of its steps beside a critical decode in some runs, 0.9 in others
    // (`gem-bench --only critical`).
    let lead = super::leads::renew(super::leads::rtt(state::get()));
    let wake = g.queued_end.load(Ordering::Relaxed).saturating_sub(lead);
    let ctx = g.ctx.load(Ordering::Relaxed) as *mut c_void;
    let launches = g.launches();
    let until = Duration::from_nanos(wake.saturating_sub(now));
    // The sync thread waits for the queue meanwhile, and on after it: if
    // the next grant comes after it drained (another group had the
    // device), the span closes where it did (on the device's clock, where
    // it is marked), not where a later wait proves it.
    let mark = devclock::mark(g, Covers::Context, true);
    let synced = syncer::sync_within(dev, g, ctx, until, synchronize_device);
    if synced == Ok(true) || g.granted_at.swap(0, Ordering::AcqRel) == 0 {
        devclock::unmark(g, mark);
        return None;
    }
    let now = now_ns();
    match synced {
        Err(ticket) => late::begin(g, ticket, launches, mark),
        _ => devclock::unmark(g, mark),
    }
    Some(g.queued_end.load(Ordering::Relaxed).max(now))
}
