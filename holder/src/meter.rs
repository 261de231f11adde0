//! What the holder's kernels really occupied of a device, measured.
//!
//! The holder gives each token back as soon as its kernels are queued, so
//! that a real client asking meanwhile gets the device at once; its
//! kernels then run after the token, behind the ones queued before, or
//! into the next holder's token. Charging them as the time they were
//! predicted to take, from the grant, left them uncharged wherever they
//! ran later (a 2-core machine's slow round trips were enough). So a
//! thread per device waits for each kernel's event as it completes and
//! records when: the holder reports those spans (from when a kernel could
//! start, its launch or the previous one's end, to its completion) with
//! its next request, and the scheduler charges them where they ran.

use cudarc::driver::CudaEvent;
use gemini_protocol::Span;
use gemini_protocol::clock::monotonic_ns;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::Duration;

/// Spans kept for one report at most; beyond, the two nearest are joined
/// (the time between them is charged: the holder's reports are frequent,
/// so this happens only while the scheduler is away).
const MAX_SPANS: usize = 64;

#[derive(Debug, Default)]
struct State {
    /// Kernels launched and not yet seen complete: when each was launched,
    /// and the event that completes with it.
    queued: VecDeque<(u64, CudaEvent)>,
    /// Kernels launched, not yet seen complete (those queued, and the one
    /// the thread waits for).
    in_flight: usize,
    /// Completed work not reported yet, oldest first.
    spans: Vec<Span>,
    /// When the last kernel was seen complete (ns).
    last_end: u64,
    /// The thread stops.
    stop: bool,
}

/// One device's measurement of the holder's kernels.
#[derive(Debug, Default)]
pub struct Meter {
    state: Mutex<State>,
    cv: Condvar,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl Meter {
    /// A meter and its thread, named after `device`.
    pub fn start(device: u32) -> std::io::Result<Arc<Meter>> {
        let m = Arc::new(Meter::default());
        let t = Arc::clone(&m);
        std::thread::Builder::new()
            .name(format!("gem-holder-meter-{device}"))
            .spawn(move || t.run())?;
        Ok(m)
    }

    /// A kernel launched at `launched` (ns, `CLOCK_MONOTONIC`) completes
    /// with `done`.
    pub fn launched(&self, launched: u64, done: CudaEvent) {
        let mut s = lock(&self.state);
        s.queued.push_back((launched, done));
        s.in_flight += 1;
        self.cv.notify_all();
    }

    /// Kernels launched and not yet seen complete.
    pub fn in_flight(&self) -> usize {
        lock(&self.state).in_flight
    }

    /// Waits until at most `n` kernels are in flight (or `limit` passed).
    pub fn wait_until_at_most(&self, n: usize, limit: Duration) {
        let mut s = lock(&self.state);
        let deadline = std::time::Instant::now() + limit;
        while s.in_flight > n {
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return;
            }
            s = self
                .cv
                .wait_timeout(s, left)
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
        }
    }

    /// The completed work not reported yet, and whether more is in
    /// flight: what the next request reports.
    pub fn take(&self) -> (Vec<Span>, bool) {
        let mut s = lock(&self.state);
        (std::mem::take(&mut s.spans), s.in_flight > 0)
    }

    /// Stops the thread (once the kernels queued are waited for).
    pub fn stop(&self) {
        lock(&self.state).stop = true;
        self.cv.notify_all();
    }

    fn run(&self) {
        loop {
            let (launched, done) = {
                let mut s = lock(&self.state);
                loop {
                    if let Some(k) = s.queued.pop_front() {
                        break k;
                    }
                    if s.stop {
                        return;
                    }
                    s = self.cv.wait(s).unwrap_or_else(|p| p.into_inner());
                }
            };
            // A failed wait (the context gone) ends the kernel's span now:
            // it can have run no longer.
            let _ = done.synchronize();
            let end = monotonic_ns();
            drop(done);
            let mut s = lock(&self.state);
            let start = launched.max(s.last_end);
            s.last_end = end;
            s.in_flight -= 1;
            record(&mut s.spans, start, end);
            self.cv.notify_all();
        }
    }
}

/// Adds the work of `[start, end)` (ns) to `spans`: joined to the last
/// where they touch, and the nearest two joined where there are too many.
fn record(spans: &mut Vec<Span>, start: u64, end: u64) {
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
            .min_by_key(|&i| spans[i].start_us - spans[i - 1].end_us)
            .unwrap_or(1);
        spans[nearest - 1].end_us = spans[nearest].end_us;
        spans.remove(nearest);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_that_touch_are_joined_and_too_many_are_joined_where_nearest() {
        let mut spans = Vec::new();
        record(&mut spans, 1_000, 2_000);
        record(&mut spans, 2_000, 3_000);
        assert_eq!(
            spans,
            [Span {
                start_us: 1,
                end_us: 3
            }]
        );
        record(&mut spans, 5_000, 5_000); // empty
        assert_eq!(spans.len(), 1);
        // Gaps of 10 µs, but one of 2 µs: that one is joined.
        for i in 0..MAX_SPANS as u64 {
            let start = 100 + i * 20 - if i == 7 { 8 } else { 0 };
            record(&mut spans, start * 1000, (start + 10) * 1000);
        }
        assert_eq!(spans.len(), MAX_SPANS);
        assert!(spans.windows(2).all(|w| w[0].end_us < w[1].start_us));
        assert!(
            spans
                .iter()
                .any(|s| s.start_us == 100 + 6 * 20 && s.end_us == 100 + 7 * 20 + 2),
            "{spans:?}"
        );
    }
}
