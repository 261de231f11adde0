//! The end of a token's accounting: waiting for its work (within a
//! bound), the time it really took, and a lent token renewed ahead.

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
    Duration::from_nanos(left + quota.max(STALL_NS))
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

/// Ends the accounting of `g`'s token (the caller holds `g.slow`): waits
/// for the work launched under it and returns the device time it took in
/// µs, overuse included; `None` if no token was held. The one place that
/// turns a token into a usage report, for the slow path and the watcher.
pub(super) fn settle(dev: usize, g: &'static Gate, why: Settle) -> Option<u64> {
    let granted_at = g.granted_at.swap(0, Ordering::AcqRel);
    if granted_at == 0 {
        return None;
    }
    let t0 = now_ns();
    let ctx = g.ctx.load(Ordering::Relaxed) as *mut c_void;
    if let Settle::Stalled = why {
        // What the waits learn from now on spans the stall, not launches.
        g.sample_start.store(0, Ordering::Relaxed);
        // The work goes on without the token: charged late, once done.
        if let Err(ticket) = syncer::sync_within(dev, g, ctx, Duration::ZERO, synchronize_device) {
            late::begin(g, t0, ticket);
        }
        return Some(t0.saturating_sub(granted_at) / 1000);
    }
    // A capture is open: any synchronisation would fail and invalidate
    // the program's capture. Or the work outlasts the bound: it waits for
    // another process (see `syncer`). Either way the token is accounted up
    // to now (or to when the process went quiet) without waiting for its
    // work; work that outlasted the bound is charged late, once done.
    let synced = syncer::sync_within(
        dev,
        g,
        ctx,
        sync_bound(g, granted_at, t0),
        synchronize_device,
    );
    let capturing = synced != Ok(true);
    let mut pending = None;
    match synced {
        Ok(true) => {}
        Ok(false) => {
            debug!("a capture is open: token accounted without waiting for its work ({why:?})")
        }
        Err(ticket) => {
            debug!(
                "device {dev}: the work outlasts its prediction: token accounted without waiting for it, the rest charged once done ({why:?})"
            );
            if matches!(why, Settle::RanOut) {
                // The launches took longer than predicted: at least this.
                g.learn_kernel_at_least(now_ns());
            }
            // What the waits learn next spans the wait, not launches.
            g.sample_start.store(0, Ordering::Relaxed);
            pending = Some(ticket);
        }
    }
    let t1 = now_ns();
    if !capturing && matches!(why, Settle::RanOut) {
        // Every launch of the sample has run: learn from it.
        g.learn_kernel(t1);
    }
    let end = match why {
        // If the work was still running, it ended now; else it ended
        // (about) when the process went quiet.
        Settle::Idle { quiet_since } if capturing || t1.saturating_sub(t0) <= 100_000 => {
            quiet_since.clamp(granted_at, t1)
        }
        _ => t1,
    };
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
    if let Some(ticket) = pending {
        late::begin(g, end, ticket);
    }
    Some(end.saturating_sub(granted_at) / 1000)
}

/// How long before a renewed lent token's queue is predicted to drain its
/// renewal is asked for: a token round trip (116 µs median, 216 µs p99 in
/// `make bench`) and the wake-up.
const RENEW_LEAD_NS: u64 = 300_000;

/// Ends the accounting of a lent token (the caller holds `g.slow`)
/// without waiting for its work: returns the device time charged for it
/// (µs, to the end of its quota, within which the token's bound keeps the
/// queue) and the predicted end of the queue (ns); `None` for a token not lent, no
/// token, or while the device time per launch is not known. Lent tokens
/// are short (they end when the group they are lent from is back) and
/// renewed often while it is late: waiting for the queue to drain before
/// asking again idled the device for the round trip and the wake-up at
/// every renewal (0.4-0.9 ms per 1 ms token, measured). Asked while the
/// last launches still run, the next token comes before they end; the
/// scheduler counts the time of work reported ahead once.
pub(super) fn settle_ahead(g: &Gate, now: u64) -> Option<(u64, u64)> {
    if !g.lent.load(Ordering::Relaxed) || g.kernel_ns.load(Ordering::Relaxed) == 0 {
        return None;
    }
    if g.granted_at.load(Ordering::Acquire) == 0 {
        return None;
    }
    // Asked for when the queue is about to drain, not as soon as it is
    // full: a token granted with most of the work still queued would only
    // admit more behind it, past the time it is lent for.
    let wake = g
        .queued_end
        .load(Ordering::Relaxed)
        .saturating_sub(RENEW_LEAD_NS);
    if wake > now {
        std::thread::sleep(Duration::from_nanos(wake - now));
    }
    let now = now_ns();
    let granted_at = g.granted_at.swap(0, Ordering::AcqRel);
    if granted_at == 0 {
        return None;
    }
    // Charged to its end (or past it, where a longer kernel began on an
    // empty queue): the token was this process's until then, and the
    // estimate of the queue leans short.
    let queued = g.queued_end.load(Ordering::Relaxed).max(now);
    let end = queued.max(g.quota_end.load(Ordering::Relaxed));
    Some((end.saturating_sub(granted_at) / 1000, queued))
}
