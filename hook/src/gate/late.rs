//! Work that runs on after its token ended: a token's end that did not
//! prove its work done (the work outlasted the bound a token's end
//! waits, or only waits stalled on another process held the token, see
//! `Settle`), or a lent token renewed while its queue still runs, ends
//! the token with the work outstanding. The work itself goes on, on the
//! device, in whichever token comes next: another group's, whose holder
//! would be charged for it, and this group's kernels would run outside
//! its tokens. So the synchronisation the token's end asked for goes on
//! in the background, and once it is done the work's span closes where
//! it ended (see `measure`): reported with `LateUsage` by the watcher
//! where the process holds no token, else with its next report.
//!
//! Where the process is granted a token again before that work is done,
//! its span is detached: the new token's launches open a span of their
//! own, and the detached one ends where the work was done or where the
//! new span began, whichever is first. So a renewal that waited while
//! another group had the device is not charged that group's time.

use super::*;

/// The synchronisation `ticket`, asked for when `launches` launches had
/// been admitted, ends when the work of `g`'s last token is done. Called
/// under `g.slow`.
pub(super) fn begin(g: &Gate, ticket: u64, launches: u64) {
    g.late_launches.store(launches, Ordering::Relaxed);
    g.late_ticket.store(ticket, Ordering::Release);
}

/// The watcher's check: once the late work of `g` is done, its span
/// closes, and while the process holds no token what was proven done is
/// reported (`LateUsage`, which also tells the scheduler that work given
/// back in flight is done).
pub(super) fn report_done(st: &State, dev: usize, g: &Gate) {
    let ticket = g.late_ticket.load(Ordering::Acquire);
    let finished = if ticket != 0 {
        let Some(done) = syncer::finished(g, ticket) else {
            return;
        };
        finish(g, done)
    } else {
        false
    };
    // Only where none of its work is outstanding (a span a capture kept
    // open): `LateUsage` tells gem-schd that nothing more of its runs, and
    // a span reported after it would be placed before the next token.
    if g.granted_at.load(Ordering::Acquire) != 0
        || g.outstanding()
        || (!finished && lock(&g.ran).is_empty())
    {
        return;
    }
    // Taken and sent under the gate's lock, as a token's own report is
    // (see `token`): else a token's end running meanwhile (which holds
    // no token while it waits for its work) could report after this took
    // the spans and before it sent them, saying nothing was in flight,
    // and gem-schd would place them before the process's next token and
    // refuse them. Skipped while a transition runs: the spans go with its
    // report, or with the next.
    let Ok(_slow) = g.slow.try_lock() else {
        return;
    };
    if g.granted_at.load(Ordering::Acquire) == 0 {
        report(st, dev, g);
    }
}

/// This process was granted `g`'s token (under `g.slow`, before any
/// launch under it): late work of an earlier token that is done closes
/// its span where it ended; work that still runs has its span detached
/// (see the module doc). Returns whether it still runs.
pub(super) fn close(g: &Gate) -> bool {
    let ticket = g.late_ticket.load(Ordering::Acquire);
    if ticket == 0 {
        return false;
    }
    if let Some(done) = syncer::finished(g, ticket) {
        finish(g, done);
        return false;
    }
    if g.late_since.load(Ordering::Acquire) == 0 {
        let since = g.open_since.swap(0, Ordering::SeqCst);
        if since != 0 {
            g.open_stream.store(covers::NO_STREAM, Ordering::SeqCst);
            g.resumed_at.store(0, Ordering::SeqCst);
            g.late_since.store(since, Ordering::Release);
        }
    }
    true
}

/// The late synchronisation was done at `done` (`None`: it synchronised
/// nothing): the span of the work it waited for closes there (a
/// detached one no later than where the next span began); one still
/// attached, unless the process launched since (then a later proof
/// closes it). Returns whether this call finished it (the watcher and a
/// grant may both try).
fn finish(g: &Gate, done: Option<u64>) -> bool {
    if g.late_ticket.swap(0, Ordering::AcqRel) == 0 {
        return false;
    }
    // The span leaves `late_since` and enters `ran` under the report lock
    // (see `Gate::take_report`).
    let mut ran = lock(&g.ran);
    let detached = g.late_since.swap(0, Ordering::AcqRel);
    match (done, detached) {
        (Some(done_at), 0) => {
            drop(ran);
            g.close(done_at, g.late_launches.load(Ordering::Relaxed));
        }
        (done, since) if since != 0 => {
            let resumed = g.resumed_at.load(Ordering::SeqCst);
            let end = match (done, resumed) {
                (Some(d), 0) => d,
                (Some(d), r) => d.min(r),
                // Nothing proven: it ran at most until the next span.
                (None, r) if r != 0 => r,
                (None, _) => now_ns(),
            };
            measure::record(&mut ran, since, end.max(since));
        }
        _ => {}
    }
    true
}

/// A span that opened after the detached one closes: the detached one
/// ends now, before it, where its work was done or where the next span
/// began (its work not done by now ran until then at most), so that
/// spans are reported in order.
/// Called under the report lock, with what it guards (`ran`).
pub(super) fn end_detached(g: &Gate, ran: &mut Vec<gemini_protocol::Span>) {
    if g.late_since.load(Ordering::Acquire) == 0 {
        return;
    }
    let ticket = g.late_ticket.load(Ordering::Acquire);
    let done = syncer::finished(g, ticket).flatten();
    let since = g.late_since.swap(0, Ordering::AcqRel);
    if since == 0 {
        return;
    }
    g.late_ticket.store(0, Ordering::Release);
    let resumed = g.resumed_at.load(Ordering::SeqCst);
    let end = match done {
        Some(d) if resumed != 0 => d.min(resumed),
        Some(d) => d,
        None => resumed.max(since),
    };
    measure::record(ran, since, end.max(since));
}

/// Reports what was proven done since the last report (sent even where
/// nothing was: the scheduler learns that the work given back in flight
/// is done).
fn report(st: &State, dev: usize, g: &Gate) {
    let ran = g.take_ran();
    debug!(
        "device {dev}: work past its token's end ran {} us: charged",
        measure::total_us(&ran)
    );
    let device = st.physical(dev as u32);
    let _ = st.call(&Request::LateUsage { device, ran }, device);
}
