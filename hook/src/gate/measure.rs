//! What the device ran of this process's work, measured: the spans the
//! scheduler charges (see `gemini_protocol::Span`).
//!
//! A span opens at the first launch while none of the process's work is
//! known outstanding, and closes when a wait proves all of it done: a
//! synchronisation that covers every launch since the span opened (see
//! `covers`), or the synchronisation at a token's end. So the time a
//! program spends on the CPU between a wait and its next launch is not
//! charged, whatever token it holds meanwhile; work that outlives its
//! token (queued behind a renewal, a collective waiting for its peer) is
//! charged once proven done, to the time it ran, however late.

use super::devclock::{self, Mark};
use super::*;
use crate::state::Spans;
use gemini_protocol::Span;

/// Spans kept for one report at most; beyond, the two nearest are joined
/// (the CPU time between them is charged). A report goes with every
/// token request or release, so this binds only a program that waits
/// thousands of times under one token.
const MAX_SPANS: usize = 32;

impl Gate {
    /// A launch was admitted at `now`: its work is outstanding from then,
    /// unless earlier work still is. `on`: the launch's stream (and
    /// whether its null stream is the thread's own) where the thread's
    /// current context is the launch's, for the device's clock (see
    /// `devclock`). Hot path: one load, mostly.
    #[inline]
    pub(super) fn open(&self, now: u64, on: Option<(*mut c_void, bool)>) {
        if self.open_since.load(Ordering::SeqCst) == 0 {
            self.open_cold(now.max(1), on);
        }
    }

    #[cold]
    fn open_cold(&self, now: u64, on: Option<(*mut c_void, bool)>) {
        // Recorded before the span is open: any launch that finds it open
        // follows the event.
        let start = on.and_then(|(stream, per_thread)| devclock::open(self, stream, per_thread));
        let opened = self
            .open_since
            .compare_exchange(0, now, Ordering::SeqCst, Ordering::Relaxed)
            .is_ok();
        if opened {
            // The first span since one was detached (see `late`).
            let _ = self
                .resumed_at
                .compare_exchange(0, now, Ordering::SeqCst, Ordering::Relaxed);
        }
        if let Some(start) = start {
            devclock::opened(self, start, if opened { now } else { 0 });
        }
    }

    /// The calls in flight now, read in the one order (see
    /// [`admission::in_flight`]).
    pub(crate) fn in_flight(&self) -> admission::InFlight {
        admission::in_flight(&self.entered, &self.exited, &self.waiting_now)
    }

    /// Whether a launch call is in flight now (entered, not returned):
    /// one may reach the driver after any proof made meanwhile.
    pub(super) fn launch_in_flight(&self) -> bool {
        self.in_flight().launches() != 0
    }

    /// All of the process's work on the device, of `launches_at`
    /// launches, was proven done at `at` (ns): the span open since its
    /// first launch closes there. `false` where that cannot be said (no
    /// span open, or a launch came or is in flight: its work may be
    /// outstanding, and the span goes on).
    pub(super) fn close(&self, at: u64, launches_at: u64) -> bool {
        self.close_marked(at, launches_at, Mark::Host).is_some()
    }

    /// [`Gate::close`] by a wait that made `mark` as it began: the span
    /// is as long as the device's clock says its work ran (see
    /// `devclock`), and ends at `at`. Its start, if it closed.
    pub(super) fn close_marked(&self, at: u64, launches_at: u64, mark: Mark) -> Option<u64> {
        let moved = |g: &Gate| g.launch_in_flight() || g.launches() != launches_at;
        if moved(self) {
            return None;
        }
        // The span leaves `open_since` and enters `ran` under the report
        // lock (see `take_report`).
        let mut ran = lock(&self.ran);
        let stream = self.open_stream.swap(covers::NO_STREAM, Ordering::SeqCst);
        let since = self.open_since.swap(0, Ordering::SeqCst);
        if since == 0 {
            return None;
        }
        if moved(self) {
            // A launch came in between: the span goes on from `since`
            // (the streams it went to are forgotten: only a proof that
            // covers every stream closes it now).
            let _ = self
                .open_since
                .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |cur| {
                    (cur == 0 || cur > since).then_some(since)
                });
            self.open_stream.store(covers::MIXED, Ordering::SeqCst);
            return None;
        }
        let (begun, end) = devclock::start(self, since, stream, at, mark);
        // A span detached before this one opened ends first (see `late`).
        late::end_detached(self, &mut ran);
        record(&mut ran.ran, begun, end.max(begun));
        Some(begun)
    }

    /// Whether work of the process may still run unreported: a span is
    /// open, or one detached is waited for (see `late`).
    pub(super) fn outstanding(&self) -> bool {
        self.open_since.load(Ordering::SeqCst) != 0 || self.late_since.load(Ordering::Acquire) != 0
    }

    /// The spans proven done and not reported yet, which are reported
    /// now, and whether work is still outstanding (see [`outstanding`]).
    /// Both under the report lock, which a span closes under: a report
    /// either carries a span or says its work is in flight, never
    /// neither. (Read apart, a span closed between the two went with a
    /// later report than one that said nothing was in flight, and
    /// `gem-schd` rightly refused it as placed before that client's
    /// token; or after a later span's report, as charged already.)
    ///
    /// [`outstanding`]: Gate::outstanding
    pub(super) fn take_report(&self) -> Report {
        let mut spans = lock(&self.ran);
        // A launch in flight (counted in, not returned) may not have
        // opened its span yet: its work is outstanding too.
        let in_flight = self.outstanding() || self.launch_in_flight();
        let Spans { ran, unproven } = std::mem::take(&mut *spans);
        Report {
            ran,
            unproven,
            in_flight,
        }
    }

    /// Spans taken for a report that was not sent: they go with the next.
    pub(super) fn keep_ran(&self, report: Report) {
        let mut kept = lock(&self.ran);
        let kept = &mut *kept;
        for (taken, now) in [
            (report.ran, &mut kept.ran),
            (report.unproven, &mut kept.unproven),
        ] {
            if taken.is_empty() {
                continue;
            }
            let later = std::mem::replace(now, taken);
            merge(now, later);
        }
    }
}

/// A report's spans (see [`Gate::take_report`]).
#[derive(Debug, Default)]
pub(super) struct Report {
    /// What ran, proven done.
    pub(super) ran: Vec<Span>,
    /// What was outstanding, not proven to run (see `late`): before
    /// `ran`'s spans that follow it in time.
    pub(super) unproven: Vec<Span>,
    /// Whether work is still outstanding.
    pub(super) in_flight: bool,
}

/// The spans of `report` to send with it: its unproven time sent first
/// as [`Request::UnprovenUsage`](gemini_protocol::Request::UnprovenUsage)
/// to a scheduler that speaks it, else reported as run, as before it.
pub(super) fn sent_ahead(st: &State, device: u32, report: &mut Report) -> Vec<Span> {
    let unproven = std::mem::take(&mut report.unproven);
    let ran = std::mem::take(&mut report.ran);
    if unproven.is_empty() {
        return ran;
    }
    if st.speaks_registered().is_ok_and(|v| v >= UNPROVEN_SINCE) {
        let req = gemini_protocol::Request::UnprovenUsage {
            device,
            ran: unproven,
        };
        let _ = st.call(&req, device);
        return ran;
    }
    let mut each: Vec<Span> = unproven.into_iter().chain(ran).collect();
    each.sort_by_key(|s| s.start_us);
    let mut all = Vec::new();
    merge(&mut all, each);
    all
}

/// Records `spans` (oldest first) after those of `into`, as [`record`]
/// does: joined where they touch, the nearest joined past `MAX_SPANS`.
fn merge(into: &mut Vec<Span>, spans: Vec<Span>) {
    for s in spans {
        record(
            into,
            s.start_us.saturating_mul(1000),
            s.end_us.saturating_mul(1000),
        );
    }
}

/// The protocol version that has [`Request::UnprovenUsage`](gemini_protocol::Request::UnprovenUsage).
const UNPROVEN_SINCE: u16 = 18;

/// The device time of `ran`, µs (for the log).
pub(super) fn total_us(ran: &[Span]) -> u64 {
    ran.iter().map(Span::len_us).sum()
}

/// Adds `[start, end)` (ns) to `spans`: joined to the last where they
/// touch, and the nearest two joined where there are too many.
pub(super) fn record(spans: &mut Vec<Span>, start: u64, end: u64) {
    let Some(span) = Span::from_ns(start, end) else {
        return;
    };
    if let Some(last) = spans.last_mut()
        && span.start_us <= last.end_us
    {
        last.end_us = last.end_us.max(span.end_us);
        return;
    }
    spans.push(span);
    if spans.len() > MAX_SPANS {
        let nearest = (1..spans.len())
            .min_by_key(|&i| spans[i].start_us.saturating_sub(spans[i - 1].end_us))
            .unwrap_or(1);
        spans[nearest - 1].end_us = spans[nearest].end_us;
        spans.remove(nearest);
    }
}

/// A launch admitted at `at` (ns) and returned, as the tests of the gate
/// make one: counted in, its span opened, counted out.
#[cfg(test)]
pub(super) fn launch(g: &Gate, at: u64) {
    g.entered.fetch_add(1, Ordering::SeqCst);
    g.open(at, None);
    g.exited.fetch_add(1, Ordering::SeqCst);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A span closes only where no launch came since the proof's wait
    /// began and none is in flight; otherwise it goes on from its start.
    #[test]
    fn a_span_closes_only_where_no_launch_came_since_the_proof() {
        let g = Gate::default();
        launch(&g, 1_000_000);
        launch(&g, 1_500_000);
        let launches = g.launches();
        // A launch after the proof's wait began: not closed.
        launch(&g, 2_000_000);
        assert!(!g.close(3_000_000, launches));
        assert!(g.outstanding());
        // A launch in flight (entered, not returned): not closed.
        g.entered.fetch_add(1, Ordering::SeqCst);
        assert!(!g.close(3_000_000, g.launches()));
        g.exited.fetch_add(1, Ordering::SeqCst);
        // Proven: one span from the first launch, the CPU time before the
        // next launch left out.
        assert!(g.close(4_000_000, g.launches()));
        assert!(!g.outstanding());
        assert!(!g.close(4_500_000, g.launches()), "nothing open");
        launch(&g, 6_000_000);
        assert!(g.close(7_000_000, g.launches()));
        assert_eq!(
            g.take_report().ran,
            [
                Span {
                    start_us: 1_000,
                    end_us: 4_000
                },
                Span {
                    start_us: 6_000,
                    end_us: 7_000
                }
            ]
        );
        assert!(g.take_report().ran.is_empty());
    }

    #[test]
    fn too_many_spans_are_joined_where_nearest() {
        let mut spans = Vec::new();
        for i in 0..MAX_SPANS as u64 + 1 {
            let start = i * 100 + if i == 5 { 80 } else { 0 };
            record(&mut spans, start * 1000, (start + 10) * 1000);
        }
        assert_eq!(spans.len(), MAX_SPANS);
        assert!(
            spans.iter().any(|s| s.start_us == 580 && s.end_us == 610),
            "{spans:?}"
        );
    }
}
