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
//!
//! Where a launch was still on its way to the driver as the token
//! ended, the span's work is reported as outstanding (`UnprovenUsage`),
//! from its start to where the host saw it done or the next span began:
//! charged only where no measured span of another group has the time.
//! Such a launch may reach the driver long after the token ended (its
//! thread descheduled): on a device that keeps launch order its work ran
//! behind the next holder's, and a span reported as run from the late
//! work's start to its end claimed the next holder's time, which the
//! ledger gave to the work that began first (a group lost 18 ms of a
//! 20 ms step so). The device's clock cannot split it: a token's end
//! marks its work on the device only with no launch in flight (a mark
//! recorded then may come before that launch's work).
//!
//! Without such a race, the span is reported as run, up to where its
//! work was seen done (on the device's clock where its end was marked,
//! else by the host) or where the next span began: on a device that
//! time-slices processes, late work not done by then may still have run
//! in slices of the other group's token (two NCCL jobs' ranks, their
//! collectives waiting for their peers, lost 150 ms of 2194 when all
//! such spans went as unproven), and a host's late wake-up proves
//! nothing.

use super::devclock::{self, Mark};
use super::*;
use crate::state::Spans;

/// The synchronisation `ticket`, asked for when `launches` launches had
/// been admitted, ends when the work of `g`'s last token is done, which
/// `mark` marks on the device's clock (see `devclock`). Called under
/// `g.slow`.
pub(super) fn begin(g: &Gate, ticket: u64, launches: u64, mark: Mark) {
    let raced = g.launch_in_flight();
    let old = {
        let mut c = lock(&g.devclock);
        c.late_raced = raced;
        std::mem::replace(&mut c.late, mark)
    };
    devclock::unmark(g, old);
    g.late_launches.store(launches, Ordering::Relaxed);
    g.late_ticket.store(ticket, Ordering::Release);
}

/// The mark of the late work's end, taken (the caller gives it back),
/// and whether a launch was on its way to the driver as it was made.
fn take_mark(g: &Gate) -> (Mark, bool) {
    let mut c = lock(&g.devclock);
    (
        std::mem::take(&mut c.late),
        std::mem::take(&mut c.late_raced),
    )
}

/// What of the late work's span `[since, …)` is reported as run and
/// what as outstanding, each `[start, end)` (see the module doc): its
/// work seen done at `host` by the sync thread, at `marked` on the
/// device's clock (by the token end's mark); the next span began at
/// `resumed` (0: not yet); `raced`: a launch was on its way to the driver
/// as the token ended.
fn late_pieces(
    since: u64,
    (host, marked): (Option<u64>, Option<u64>),
    raced: bool,
    resumed: u64,
) -> Pieces {
    // No later than where the next span began.
    let bound = |t: u64| if resumed == 0 { t } else { t.min(resumed) };
    let seen = match (host, resumed) {
        (Some(h), _) => bound(h),
        // Not seen done: it ran at most until the next span.
        (None, r) if r != 0 => r,
        (None, _) => now_ns(),
    }
    .max(since);
    if raced {
        return Pieces {
            ran: (since, since),
            unproven: (since, seen),
        };
    }
    // Seen done by the sync thread's wake-up or on the device's clock,
    // whichever is first.
    let end = marked.map_or(seen, |m| bound(m).clamp(since, seen));
    Pieces {
        ran: (since, end),
        unproven: (end, end),
    }
}

/// A late span's parts (see [`late_pieces`]), each `[start, end)`, empty
/// where `start == end`.
#[derive(Debug, PartialEq)]
struct Pieces {
    ran: (u64, u64),
    unproven: (u64, u64),
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
    let (mark, raced) = take_mark(g);
    // The span leaves `late_since` and enters `ran` under the report lock
    // (see `Gate::take_report`).
    let mut spans = lock(&g.ran);
    let detached = g.late_since.swap(0, Ordering::AcqRel);
    match (done, detached) {
        (Some(done_at), 0) => {
            drop(spans);
            let launches = g.late_launches.load(Ordering::Relaxed);
            g.close_late(done_at, launches, mark, raced);
        }
        (done, since) if since != 0 => {
            let marked = devclock::completed_at(g, mark);
            let resumed = g.resumed_at.load(Ordering::SeqCst);
            record_late(
                &mut spans,
                late_pieces(since, (done, marked), raced, resumed),
            );
        }
        _ => {}
    }
    devclock::unmark(g, mark);
    true
}

/// Records a late span's parts (see [`late_pieces`]).
fn record_late(spans: &mut Spans, pieces: Pieces) {
    let Pieces { ran, unproven } = pieces;
    measure::record(&mut spans.ran, ran.0, ran.1);
    measure::record(&mut spans.unproven, unproven.0, unproven.1);
}

/// The late work of a span still open (no token granted since) was done
/// at `at`: the span `[begun, end)`, placed by the device's clock where
/// it could be, is reported as run, or, where a launch raced its token's
/// end, `[begun, at)` as outstanding (see the module doc).
pub(super) fn record_closed(spans: &mut Spans, (begun, end): (u64, u64), at: u64, raced: bool) {
    let pieces = if raced {
        late_pieces(begun, (Some(at), None), true, 0)
    } else {
        Pieces {
            ran: (begun, end.max(begun)),
            unproven: (0, 0),
        }
    };
    record_late(spans, pieces);
}

/// A span that opened after the detached one closes: the detached one
/// ends now, before it, where its work was done or where the next span
/// began (its work not done by now ran until then at most), so that
/// spans are reported in order.
/// Called under the report lock, with what it guards (`ran`).
pub(super) fn end_detached(g: &Gate, spans: &mut Spans) {
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
    let (mark, raced) = take_mark(g);
    let marked = devclock::completed_at(g, mark);
    devclock::unmark(g, mark);
    let resumed = g.resumed_at.load(Ordering::SeqCst);
    record_late(
        spans,
        late_pieces(since, (done, marked), raced, resumed.max(since)),
    );
}

/// Reports what was proven done since the last report (sent even where
/// nothing was: the scheduler learns that the work given back in flight
/// is done).
fn report(st: &State, dev: usize, g: &Gate) {
    let mut report = g.take_report();
    let device = st.physical(dev as u32);
    let ran = measure::sent_ahead(st, device, &mut report);
    debug!(
        "device {dev}: work past its token's end ran {} us: charged",
        measure::total_us(&ran)
    );
    let _ = st.call(&Request::LateUsage { device, ran }, device);
}

#[cfg(test)]
mod tests {
    use super::*;
    use gemini_protocol::Span;

    /// A gate whose late work, outstanding since 1 ms, was detached when
    /// the next span opened at 5 ms, and whose synchronisation was done
    /// at `done_at` (ns; `None`: it still runs), a launch on its way to
    /// the driver as the token ended if `raced`: what the detached span
    /// is reported as once that span closes.
    fn detached_reported(done_at: Option<u64>, raced: bool) -> Spans {
        let g = Gate::default();
        g.late_ticket.store(1, Ordering::SeqCst);
        g.late_since.store(1_000_000, Ordering::SeqCst);
        g.resumed_at.store(5_000_000, Ordering::SeqCst);
        lock(&g.devclock).late_raced = raced;
        if let Some(at) = done_at {
            let mut slot = lock(&g.syncer.slot);
            (slot.asked, slot.done, slot.ran, slot.done_at) = (1, 1, true, at);
        }
        let mut spans = Spans::default();
        end_detached(&g, &mut spans);
        spans
    }

    fn span(start_us: u64, end_us: u64) -> Vec<Span> {
        vec![Span { start_us, end_us }]
    }

    /// Late work seen done before the next span began ran there: its
    /// span is reported as run. Where a launch was on its way to the
    /// driver as the token ended (it may have landed behind the next
    /// holder's work, long after), nothing of it is proven run: reported
    /// as outstanding, up to where it was seen done or the next span
    /// began. Without that race, the host's late wake-up proves nothing:
    /// reported as run.
    #[test]
    fn a_raced_detached_span_is_reported_unproven() {
        for done in [Some(3_000_000), Some(7_000_000), None] {
            let end = if done == Some(3_000_000) { 3000 } else { 5000 };
            let spans = detached_reported(done, true);
            assert!(spans.ran.is_empty(), "{done:?}: {spans:?}");
            assert_eq!(spans.unproven, span(1000, end), "{done:?}");
            let spans = detached_reported(done, false);
            assert_eq!(spans.ran, span(1000, end), "{done:?}: {spans:?}");
            assert!(spans.unproven.is_empty());
        }
    }

    /// On the device's clock, where the work's end was marked: work done
    /// by then is proven run to there, whatever the host saw late, up to
    /// where the next span began. After a race, nothing is: outstanding
    /// up to where it was seen done or the next span began.
    #[test]
    fn the_device_clock_decides_where_it_can() {
        let pieces = |host, marked, raced| late_pieces(1, (host, marked), raced, 5);
        let split = |ran, unproven| Pieces { ran, unproven };
        assert_eq!(pieces(Some(9), Some(3), false), split((1, 3), (3, 3)));
        assert_eq!(pieces(None, Some(3), false), split((1, 3), (3, 3)));
        assert_eq!(pieces(Some(9), Some(7), false), split((1, 5), (5, 5)));
        assert_eq!(pieces(None, None, false), split((1, 5), (5, 5)));
        assert_eq!(pieces(Some(9), Some(3), true), split((1, 1), (1, 5)));
        assert_eq!(pieces(Some(4), None, true), split((1, 1), (1, 4)));
        assert_eq!(pieces(None, None, true), split((1, 1), (1, 5)));
    }

    /// A span still open when its late work was done: run as placed; after
    /// a launch raced its token's end, outstanding from its start to where
    /// the host saw the work done (a span reported as run there took the
    /// next holder's time where the raced launch landed among its kernels).
    #[test]
    fn a_raced_span_closed_is_outstanding() {
        let closed = |raced| {
            let mut spans = Spans::default();
            record_closed(&mut spans, (1_000_000, 3_000_000), 20_000_000, raced);
            spans
        };
        let spans = closed(true);
        assert_eq!((spans.ran, spans.unproven), (vec![], span(1000, 20000)));
        let spans = closed(false);
        assert_eq!((spans.ran, spans.unproven), (span(1000, 3000), vec![]));
    }
}
