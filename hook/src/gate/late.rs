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
//! A detached span whose work was not done before the new span began is
//! not proven to have run there at all: on a device that keeps launch
//! order, work that reached the driver after another group's waited
//! behind it and ran in the new token. It is reported as outstanding
//! (`UnprovenUsage`): charged only where no measured span of another
//! group has the time. (Reported as run, it lay within the other group's
//! span, whose end the host saw late, and took that group's whole
//! token.) Only where a launch was still on its way to the driver as
//! the token ended (such work can land behind the next holder's), and the
//! work was not seen done (on the device's clock where its end was
//! marked, else by the host) before the next span began. Otherwise the
//! span is reported as run, as before: on a device that time-slices
//! processes, late work not done by then may still have run in slices of
//! the other group's token (two NCCL jobs' ranks, their collectives
//! waiting for their peers, lost 150 ms of 2194 when all such spans went
//! as unproven), and a host's late wake-up proves nothing.

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
        // The ticket, its launches, mark and race are set together under
        // the clock's lock, and `finish` takes them so: never a ticket
        // with another's launches.
        let mut c = lock(&g.devclock);
        c.late_raced = raced;
        g.late_launches.store(launches, Ordering::Relaxed);
        g.late_ticket.store(ticket, Ordering::Release);
        std::mem::replace(&mut c.late, mark)
    };
    devclock::unmark(g, old);
}

/// Late synchronisation `ticket`, if it is still `g`'s: taken, with the
/// launches it was asked at, its mark (the caller gives it back) and
/// whether a launch was on its way to the driver then (see [`begin`]).
fn take_ticket(g: &Gate, ticket: u64) -> Option<(u64, Mark, bool)> {
    let mut c = lock(&g.devclock);
    g.late_ticket
        .compare_exchange(ticket, 0, Ordering::AcqRel, Ordering::Acquire)
        .ok()?;
    Some((
        g.late_launches.load(Ordering::Relaxed),
        std::mem::take(&mut c.late),
        std::mem::take(&mut c.late_raced),
    ))
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

/// Where a detached span ends, and whether its work is proven to have
/// run by then (see the module doc): its work seen done at `host` by the
/// sync thread, at `device` on the device's clock (by its mark); the next
/// span began at `resumed` (0: not yet); `raced`: a launch was on its way
/// to the driver as the token ended.
fn detached_end(host: Option<u64>, device: Option<u64>, raced: bool, resumed: u64) -> (u64, bool) {
    // Seen done by the sync thread's wake-up or on the device's clock,
    // whichever is first.
    let done = host.into_iter().chain(device).min();
    let end = match (done, resumed) {
        (Some(d), 0) => d,
        (Some(d), r) => d.min(r),
        // Not seen done: it ran at most until the next span.
        (None, r) if r != 0 => r,
        (None, _) => now_ns(),
    };
    let seen_done = |d: Option<u64>| d.is_some_and(|d| resumed == 0 || d <= resumed);
    let proven = !raced || seen_done(device.or(host));
    (end, proven)
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
        finish(g, ticket, done)
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
        finish(g, ticket, done);
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
fn finish(g: &Gate, ticket: u64, done: Option<u64>) -> bool {
    // (Another ticket asked meanwhile is left for its own finish.)
    let Some((launches, mark, raced)) = take_ticket(g, ticket) else {
        return false;
    };
    // The span leaves `late_since` and enters `ran` under the report lock
    // (see `Gate::take_report`).
    let mut spans = lock(&g.ran);
    let detached = g.late_since.swap(0, Ordering::AcqRel);
    match (done, detached) {
        (Some(done_at), 0) => {
            drop(spans);
            g.close_marked(done_at, launches, mark);
        }
        (done, since) if since != 0 => {
            let device = devclock::completed_at(g, mark);
            let resumed = g.resumed_at.load(Ordering::SeqCst);
            let (end, proven) = detached_end(done, device, raced, resumed);
            record_detached(&mut spans, since, end, proven);
            // The span opened since then, given back in flight too (a lent
            // token renewed ahead as its queue ran), closes where the work
            // was done, where this synchronisation waited for it: asked
            // after its launches, with none launched since (`close_marked`
            // refuses otherwise) and none on its way to the driver as it
            // was asked. Left open, it ran on through the next group's
            // token, to this process's next proof: a renewal held behind
            // another group's 20 ms step took that step's time.
            if let Some(done_at) = done
                && !raced
            {
                drop(spans);
                g.close_marked(done_at, launches, mark);
            }
        }
        _ => {}
    }
    devclock::unmark(g, mark);
    true
}

/// Records the detached span `[since, end)`: as run where its work was
/// proven done by `end`, else as outstanding (see the module doc).
fn record_detached(spans: &mut Spans, since: u64, end: u64, proven: bool) {
    let into = if proven {
        &mut spans.ran
    } else {
        &mut spans.unproven
    };
    measure::record(into, since, end.max(since));
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
    let device = devclock::completed_at(g, mark);
    devclock::unmark(g, mark);
    let resumed = g.resumed_at.load(Ordering::SeqCst);
    let (end, proven) = detached_end(done, device, raced, resumed.max(since));
    record_detached(spans, since, end, proven);
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
    /// holder's work), work seen done only after the next span began, or
    /// not yet, is not proven to have run before it: reported as
    /// outstanding, up to where the next span began. Without that race
    /// (or a mark on the device's clock), the host's late wake-up proves
    /// nothing: reported as run, as before.
    #[test]
    fn a_detached_span_not_seen_done_before_the_next_is_reported_unproven() {
        for raced in [false, true] {
            let done_before = detached_reported(Some(3_000_000), raced);
            assert_eq!(done_before.ran, span(1000, 3000));
            assert!(done_before.unproven.is_empty());
        }
        for done in [Some(7_000_000), None] {
            let spans = detached_reported(done, true);
            assert!(spans.ran.is_empty(), "{done:?}: {spans:?}");
            assert_eq!(spans.unproven, span(1000, 5000), "{done:?}");
            let spans = detached_reported(done, false);
            assert_eq!(spans.ran, span(1000, 5000), "{done:?}: {spans:?}");
            assert!(spans.unproven.is_empty());
        }
    }

    /// A gate with late work of two tokens: detached at the renewed
    /// token's grant at 5 ms, and the span that token's launch opened
    /// there, given back in flight too; its synchronisation done at 7 ms,
    /// found by the next grant (after one more launch, with `launched`).
    fn two_tokens_closed(launched: bool) -> Gate {
        use super::measure::launch;
        let g = Gate::default();
        g.late_since.store(1_000_000, Ordering::SeqCst);
        g.resumed_at.store(5_000_000, Ordering::SeqCst);
        launch(&g, 5_000_000);
        begin(&g, 1, g.launches(), Mark::Host);
        {
            let mut slot = lock(&g.syncer.slot);
            (slot.asked, slot.done, slot.ran, slot.done_at) = (1, 1, true, 7_000_000);
        }
        if launched {
            launch(&g, 6_000_000);
        }
        assert!(!close(&g), "nothing runs on");
        g
    }

    /// A renewal asked ahead while detached work still ran leaves two
    /// spans given back in flight. Once the synchronisation, which waited
    /// for both, is done, both close: the first where the second began,
    /// the second where the work was done. Before, the second stayed open
    /// until the process's next proof, and took the time of the group
    /// that had the device in between. Not where the process launched
    /// after the synchronisation was asked: that launch's work is not
    /// proven done, and the span goes on.
    #[test]
    fn late_work_of_two_tokens_closes_both_spans() {
        let g = two_tokens_closed(false);
        assert!(!g.outstanding(), "no span is left open");
        assert_eq!(lock(&g.ran).ran, span(1000, 7000));
        let g = two_tokens_closed(true);
        assert!(g.outstanding(), "the span of the launch since goes on");
        assert_eq!(lock(&g.ran).ran, span(1000, 5000));
    }

    /// A ticket finishes only itself: one asked since (a later token's
    /// end) is left, with its own launches, for its own finish.
    #[test]
    fn a_finish_takes_only_its_own_ticket() {
        let g = Gate::default();
        begin(&g, 1, 3, Mark::Host);
        begin(&g, 2, 5, Mark::Host);
        assert!(!finish(&g, 1, Some(7_000_000)), "ticket 1 is gone");
        assert_eq!(g.late_ticket.load(Ordering::SeqCst), 2);
        assert_eq!(take_ticket(&g, 2).map(|t| t.0), Some(5));
    }

    /// On the device's clock, where the work's end was marked: work done
    /// before the next span began is proven run to there, whatever the
    /// host saw late; after a race, work done only after is not. Without
    /// a race, as run, up to where the next span began.
    #[test]
    fn the_device_clock_decides_where_it_can() {
        assert_eq!(detached_end(Some(9), Some(3), true, 5), (3, true));
        assert_eq!(detached_end(None, Some(3), true, 5), (3, true));
        assert_eq!(detached_end(Some(9), Some(7), true, 5), (5, false));
        assert_eq!(detached_end(Some(9), None, true, 5), (5, false));
        assert_eq!(detached_end(Some(4), None, true, 5), (4, true));
        assert_eq!(detached_end(Some(9), Some(7), false, 5), (5, true));
        assert_eq!(detached_end(None, None, false, 5), (5, true));
    }
}
