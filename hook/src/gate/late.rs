//! Work that runs on after its token was reported: a token's end that did
//! not wait for its work (the work outlasted the bound a token's end
//! waits, or only waits stalled on another process held the token, see
//! `Settle`) hands the token back and charges the time up to then. The
//! work itself goes on, on the device, in whichever token comes next:
//! another group's, whose holder would be charged for it, and this
//! group's kernels would run outside its tokens (issue 35). So the
//! synchronisation the token's end asked for goes on in the background,
//! and the time from the report to its end is charged to this process's
//! group with `LateUsage`: by the watcher once it is done, or at this
//! process's next grant on the device (whose token covers the rest).

use super::*;

/// The work of `g`'s last token runs on uncharged from `since` (ns); the
/// synchronisation `ticket` ends when it is done. Called under `g.slow`.
pub(super) fn begin(g: &Gate, since: u64, ticket: u64) {
    g.late_ticket.store(ticket, Ordering::Relaxed);
    g.late_since.store(since.max(1), Ordering::Release);
}

/// Whether work of `g`'s last token still runs uncharged (it is reported
/// as in flight when the token is given back).
pub(super) fn running(g: &Gate) -> bool {
    g.late_since.load(Ordering::Acquire) != 0
}

/// The watcher's check: reports the late work of `g` once done.
pub(super) fn report_done(st: &State, dev: usize, g: &Gate) {
    if g.late_since.load(Ordering::Acquire) == 0 {
        return;
    }
    let Some(done_at) = syncer::finished(g, g.late_ticket.load(Ordering::Relaxed)) else {
        return;
    };
    report(st, dev, g, done_at);
}

/// This process was granted `g`'s token at `granted`: late work of an
/// earlier token ran uncharged until then, or until it was done. Returns
/// whether it still runs (the new token's time is its from now on).
pub(super) fn close(st: &State, dev: usize, g: &Gate, granted: u64) -> bool {
    if g.late_since.load(Ordering::Acquire) == 0 {
        return false;
    }
    let done_at = syncer::finished(g, g.late_ticket.load(Ordering::Relaxed));
    report(st, dev, g, done_at.unwrap_or(granted).min(granted));
    done_at.is_none()
}

/// Charges the late work of `g` that ran up to `end` (ns), once (the
/// watcher and a grant may both try).
fn report(st: &State, dev: usize, g: &Gate, end: u64) {
    let since = g.late_since.swap(0, Ordering::AcqRel);
    if since == 0 {
        return;
    }
    // Sent even for 0 µs: the scheduler learns that the work given back
    // in flight is done.
    let used_us = end.saturating_sub(since) / 1000;
    debug!("device {dev}: work past its token's report ran {used_us} us more: charged");
    let device = st.physical(dev as u32);
    let _ = st.call(&Request::LateUsage { device, used_us }, device);
}
