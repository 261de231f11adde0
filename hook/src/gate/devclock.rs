//! Span ends from the device's own clock.
//!
//! A span (see `measure`) ends where a wait proves its work done. The host
//! learns that only as the waiting thread wakes: microseconds later on an
//! idle machine with a spinning wait, hundreds of microseconds on a loaded
//! CPU or with a blocking-sync context. Charged to the group as device
//! time, that wake-up takes its share: a group capped at 0.4 that waits
//! after every 1 ms kernel got 0.29 on a host that woke it 300 µs late.
//!
//! So a span's opening launch is preceded by a timing event recorded on
//! its stream, where the stream is idle then (nothing of the process is
//! known outstanding, and no earlier token's work runs on: see `late`),
//! and a blocking wait on that stream by one recorded just before it,
//! with no launch in flight; an event the program waits for serves as it
//! is. Where the wait proves the span done, it is `cuEventElapsedTime`
//! between the two long, at most from its first launch, and ends at the
//! host's proof (see [`start`]). Anything else (work on several streams,
//! a stream's query, a capture open, an event without timing, a second
//! context, a token's end) keeps the host's times, as before.
//!
//! Every event is one of the span's context, kept for reuse; a context
//! that goes takes its events with it (see [`context_gone`]): an event
//! taken before then is destroyed with it, never given back.
//!
//! Where the device's clock is calibrated against the host's, a span is
//! placed where its events completed, its end too: not at the host's
//! proof, which a loaded host sees late. (Ended at the proof, the span of
//! a group whose wait woke 1 ms late overlapped the next group's first
//! kernel by that much, and the ledger gave that group's time to the
//! span that began first: a group whose kernels ran 1680 ms was charged
//! 1664 ms.) The calibration: an event recorded on a stream of the
//! gate's own (non-blocking, so it waits for nothing of the program's),
//! seen complete within `CAL_ERROR_NS` of its record, completed about
//! midway; every event's host time is that plus `cuEventElapsedTime`
//! from it. Made and first taken as a context's first span opens, taken
//! again by the idle watcher every `CAL_AGE_NS` (the two clocks drift
//! apart slowly), under the gate's clock lock, which every reading of it
//! takes too (a reference re-recorded under a reading would move it).

use super::*;
use crate::covers::stream_key;
use crate::state::ClockStart as Start;
use crate::state::{Calibration, DevClock};

/// Spare events kept per gate.
const MAX_SPARE: usize = 4;

/// A calibration is taken again once this old (ns)...
const CAL_AGE_NS: u64 = 100_000_000;
/// ...and not used once this old (ns; one that failed meanwhile).
const CAL_USE_NS: u64 = 1_000_000_000;
/// The reference event is seen complete within this of its record (ns),
/// or the calibration fails: the device was busy with another context,
/// or the host slow; tried again `CAL_RETRY_NS` later.
const CAL_ERROR_NS: u64 = 40_000;
const CAL_RETRY_NS: u64 = 10_000_000;
/// Calibrations kept per gate, one per context.
const MAX_CALS: usize = 4;
/// A device time more than this outside where the host saw the span
/// (before its first launch, after its proof) is not believed (ns).
const CAL_SLACK_NS: u64 = 50_000;

/// Spans in a row that opened with an event and ended on the host's
/// clock (no wait of theirs could be timed: a program that waits only
/// for copies on other streams, or whose tokens end its spans), whose
/// event could not be recorded, or whose device end was close to the
/// host's (the host woke at once: its clock charges as well, see
/// [`late`]),
/// after which only one span in `PROBE` records one: two records a span
/// are paid only where they serve, and a host that starts to wake late
/// is seen at the next probe.
pub(crate) const MISSES: u32 = 8;
const PROBE: u32 = 16;
/// A device end this close to the host's proof (and within a hundredth
/// of the span) is no reason to go on timing spans on the device's
/// clock: the host's charges at most 1 % more.
const LAG_NS: u64 = 20_000;

/// Whether the span opened at `since`, proven done at `at`, whose work
/// the device ran from `begun` on, took the host long enough more than
/// the device to time spans on the device.
fn late(since: u64, begun: u64, at: u64) -> bool {
    lagged(begun.saturating_sub(since), at.saturating_sub(begun))
}

/// Whether the host's view lags the device's by `lag` enough to time
/// spans of `span` on the device: by `LAG_NS`, or by a hundredth of it.
fn lagged(lag: u64, span: u64) -> bool {
    lag >= LAG_NS || lag.saturating_mul(100) >= span
}

/// What a wait's completion ends the span at, as the wait began.
pub(crate) use crate::state::ClockMark as Mark;

/// The calling thread's current context, if any.
fn current_ctx() -> Option<usize> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let r = unsafe { driver::ctx_get_current(&mut ctx) };
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx as usize)
}

/// A spare event of `ctx`, or one made there where it is current; and
/// the generation of the gate's contexts it was taken in.
fn take_event(g: &Gate, ctx: usize) -> Option<(usize, u64)> {
    let (spare, epoch) = {
        let mut c = lock(&g.devclock);
        let i = c.spare.iter().position(|&(c, _)| c == ctx);
        (i.map(|i| c.spare.swap_remove(i).1), c.epoch)
    };
    let made = || {
        (current_ctx() == Some(ctx))
            .then(driver::event_create)
            .flatten()
    };
    spare.or_else(made).map(|e| (e, epoch))
}

/// Gives `event` of `ctx`, taken in generation `epoch`, back for reuse;
/// one whose context went since (the generation moved on) went with it.
fn give_back(g: &Gate, ctx: usize, event: usize, epoch: u64) {
    let mut c = lock(&g.devclock);
    if c.epoch != epoch {
        return;
    }
    if c.spare.len() < MAX_SPARE {
        c.spare.push((ctx, event));
    } else {
        // Under the lock: its context cannot be going meanwhile (see
        // `context_going`).
        driver::event_destroy(event);
    }
}

/// Records `event` on `raw` (`per_thread`).
fn record(event: usize, raw: usize, per_thread: bool) -> bool {
    driver::event_record(event, raw as *mut c_void, per_thread) == CUDA_SUCCESS
}

/// Whether a span may record its opening event now: not after `MISSES`
/// spans in a row that could not use theirs, but for one in `PROBE`.
fn may_start(g: &Gate) -> bool {
    let mut c = lock(&g.devclock);
    if c.misses < MISSES {
        return true;
    }
    c.skipped = c.skipped.wrapping_add(1);
    c.skipped.is_multiple_of(PROBE)
}

/// A span could not use its opening event.
fn missed(g: &Gate) {
    let mut c = lock(&g.devclock);
    c.misses = c.misses.saturating_add(1);
}

/// Makes the calibration of context `ctx` (current on the calling
/// thread, which opens a span), and takes it the first time: its stream
/// and events are made in the current context. Later ones are taken by
/// the watcher ([`recalibrate`]). Called before the span's event is
/// recorded, so that the reference precedes every event it times. One
/// per context, `MAX_CALS` at most (the least recently taken goes).
fn calibrate(g: &Gate, ctx: usize) {
    let mut c = lock(&g.devclock);
    if c.cals.iter().any(|cal| cal.ctx == ctx) {
        return;
    }
    let now = now_ns();
    if now < c.cal_retry_at {
        return;
    }
    if c.cals.len() >= MAX_CALS {
        let oldest = (0..c.cals.len()).min_by_key(|&i| c.cals[i].taken_at);
        // (Of a context the process still has: one that goes drops its
        // calibration first, see `context_going`.)
        destroy(c.cals.swap_remove(oldest.unwrap_or(0)));
    }
    let Some(stream) = driver::stream_create_nonblocking() else {
        c.cal_retry_at = now + CAL_USE_NS;
        return;
    };
    let events = [driver::event_create(), driver::event_create()];
    let [Some(event), Some(next)] = events else {
        events.into_iter().flatten().for_each(driver::event_destroy);
        driver::stream_destroy(stream);
        c.cal_retry_at = now + CAL_USE_NS;
        return;
    };
    c.cals.push(Calibration {
        ctx,
        stream,
        event,
        next,
        host_ns: 0,
        prev_ns: 0,
        taken_at: 0,
        retry_at: 0,
    });
    let i = c.cals.len() - 1;
    take_reference(&mut c.cals[i]);
}

/// Destroys a calibration's stream and events (its context still there).
fn destroy(cal: Calibration) {
    driver::event_destroy(cal.event);
    driver::event_destroy(cal.next);
    driver::stream_destroy(cal.stream);
}

/// Takes one of `g`'s calibrations again where it is due (`CAL_AGE_NS`
/// old, or failed `CAL_RETRY_NS` ago): the watcher's, so that a
/// program's thread spins for it once per context at most. Its context
/// is pushed on the watcher's thread around the records, and is one the
/// process still has: a context that goes drops its calibration first,
/// under the same lock ([`context_going`]).
pub(super) fn recalibrate(g: &Gate) {
    let mut c = lock(&g.devclock);
    let now = now_ns();
    let due = c.cals.iter().position(|cal| {
        now >= cal.retry_at && (cal.taken_at == 0 || now.saturating_sub(cal.taken_at) >= CAL_AGE_NS)
    });
    let Some(i) = due else { return };
    if capture::any_open() {
        return;
    }
    let ctx = c.cals[i].ctx as *mut c_void;
    // SAFETY: a context of the process (see above), pushed on this thread
    // and popped again: no trace is left.
    if unsafe { driver::ctx_push(ctx) } != CUDA_SUCCESS {
        c.cals[i].retry_at = now + CAL_RETRY_NS;
        return;
    }
    take_reference(&mut c.cals[i]);
    let mut popped = std::ptr::null_mut();
    // SAFETY: pops what was pushed above, into a local.
    unsafe { driver::ctx_pop(&mut popped) };
}

/// Records a new reference into the calibration's spare event and waits
/// for it (see [`reference`]): it becomes the reference once seen done in
/// time, and the one before it stays, for events that completed before
/// it. On failure the reference in use stays as it was (re-recorded in
/// place, it would have moved under the host time taken for it), and it
/// is tried again `CAL_RETRY_NS` later.
fn take_reference(cal: &mut Calibration) {
    // The spare is recorded anew: what it held is lost.
    cal.prev_ns = 0;
    match reference(cal.next, cal.stream) {
        Some(at) => {
            std::mem::swap(&mut cal.event, &mut cal.next);
            cal.prev_ns = if cal.taken_at != 0 { cal.host_ns } else { 0 };
            (cal.host_ns, cal.taken_at) = (at, now_ns());
        }
        None => cal.retry_at = now_ns() + CAL_RETRY_NS,
    }
}

/// Records `event` on `stream` (idle, the gate's own) and waits for it
/// (spinning, `CAL_ERROR_NS` at most): the host time it completed at,
/// within half of that.
fn reference(event: usize, stream: usize) -> Option<u64> {
    let t0 = now_ns();
    if !record(event, stream, false) {
        return None;
    }
    loop {
        let r = driver::event_query(event);
        let waited = now_ns().saturating_sub(t0);
        if waited > CAL_ERROR_NS {
            return None;
        }
        match r {
            CUDA_SUCCESS => return Some(t0 + waited / 2),
            crate::cuda::CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
            _ => return None,
        }
    }
}

/// The host time (ns) event `event` of context `ctx` completed at, by
/// the calibration of that context held in `c` (`None` where there is
/// none, it is too old, or the driver cannot say): from its reference,
/// or from the one before where the event completed before it.
fn host_time(c: &DevClock, ctx: usize, event: usize, now: u64) -> Option<u64> {
    host_time_by(c, ctx, event, now).map(|(t, _)| t)
}

/// [`host_time`], and the calibration that gave it (its `taken_at`).
fn host_time_by(c: &DevClock, ctx: usize, event: usize, now: u64) -> Option<(u64, u64)> {
    let cal = c
        .cals
        .iter()
        .find(|cal| cal.ctx == ctx && cal.taken_at != 0)?;
    if now.saturating_sub(cal.taken_at) > CAL_USE_NS {
        return None;
    }
    let t = match driver::event_elapsed_ns(cal.event, event) {
        Ok(ns) => Some(cal.host_ns + ns),
        // Completed before the reference (a negative time): from the one
        // before. Not where it has not completed: that one says so too.
        Err(crate::cuda::CUDA_ERROR_INVALID_VALUE) if cal.prev_ns != 0 => {
            driver::event_elapsed_ns(cal.next, event)
                .ok()
                .map(|ns| cal.prev_ns + ns)
        }
        Err(_) => None,
    };
    t.map(|t| (t, cal.taken_at))
}

/// A launch onto `stream` under `g`, from a thread whose current context
/// is the launch's, may open a span: an event recorded on that stream
/// now, before the launch reaches the driver, so that every launch of the
/// span follows it. `None` where no event can be recorded (a capture
/// open, no context). Where the stream may still run an earlier token's
/// work, the event completes only behind it: the span is placed from its
/// first launch, not from the event (that work's time, between the two,
/// would be charged to nobody), and the event times only its end, on the
/// calibrated clock (see the module doc).
pub(super) fn open(g: &Gate, stream: *mut c_void, per_thread: bool) -> Option<Start> {
    if capture::any_open() {
        return None; // a record into a capture makes a node, and times nothing
    }
    let behind =
        g.late_ticket.load(Ordering::Acquire) != 0 || g.late_since.load(Ordering::Acquire) != 0;
    if !may_start(g) {
        return None;
    }
    let ctx = current_ctx()?;
    calibrate(g, ctx);
    let (event, epoch) = take_event(g, ctx)?;
    let raw = stream as usize;
    if !record(event, raw, per_thread) {
        give_back(g, ctx, event, epoch);
        missed(g); // another context's stream, say: back off
        return None;
    }
    Some(Start {
        since: 0,
        ctx,
        event,
        epoch,
        key: stream_key(stream, per_thread),
        raw,
        per_thread,
        behind,
        began: 0,
        began_by: 0,
    })
}

/// The span `start` was recorded for opened at `since`; or, with `since`
/// 0, another launch opened it first, and the event is spare.
pub(super) fn opened(g: &Gate, start: Start, since: u64) {
    if since == 0 {
        give_back(g, start.ctx, start.event, start.epoch);
        return;
    }
    let old = lock(&g.devclock).start.replace(Start { since, ..start });
    if let Some(old) = old {
        give_back(g, old.ctx, old.event, old.epoch);
    }
}

/// A wait that `covers` (`blocks`: one that blocks until the work is
/// done) begins: what its completion can end the open span at. A blocking
/// wait for the span's one stream records an event there first; the
/// program's event serves as it is. A context's wait or a synchronous
/// copy records one only where the span's stream is a default stream (a
/// stream the program made may be destroyed by now).
pub(super) fn mark(g: &Gate, covers: Covers, blocks: bool) -> Mark {
    let stream = match covers {
        Covers::Event(e) => return Mark::Event(e),
        Covers::Stream(key) if blocks => Some(key),
        // A synchronous copy's end is marked before it: its own transfer,
        // a copy engine's time, is not charged, as a copy outside a span
        // never is.
        Covers::Context | Covers::Copy { .. } if blocks => None,
        _ => return Mark::Host,
    };
    let since = g.open_since.load(Ordering::SeqCst);
    if since == 0 || capture::any_open() {
        return Mark::Host;
    }
    let Some(start) = lock(&g.devclock).start.filter(|s| s.since == since) else {
        return Mark::Host;
    };
    if !marks_span(g, &start, stream) {
        return Mark::Host;
    }
    // A launch in flight may reach the stream after the record: the event
    // would end the span before that launch's work.
    if g.launch_in_flight() {
        return Mark::Host;
    }
    let launches = g.launches();
    let Some((event, epoch)) = take_event(g, start.ctx) else {
        return Mark::Host;
    };
    if record(event, start.raw, start.per_thread) && g.launches() == launches {
        read_begin(g, since);
        Mark::Recorded {
            ctx: start.ctx,
            event,
            epoch,
        }
    } else {
        give_back(g, start.ctx, event, epoch);
        Mark::Host
    }
}

/// Reads where the open span's opening event (of the span opened at
/// `since`) completed, if it has, on the calibrated clock: before the
/// wait, while the device runs the span's work, so that the wait's end
/// reads only its own event (see [`start`]) and the program, waiting for
/// it, pays one driver call there, not two. Not for an opening event
/// recorded behind earlier work (its span begins at its first launch).
fn read_begin(g: &Gate, since: u64) {
    let mut c = lock(&g.devclock);
    let Some(s) = c
        .start
        .filter(|s| s.since == since && !s.behind && s.began == 0)
    else {
        return;
    };
    if s.epoch != c.epoch {
        return; // its context went: its event with it
    }
    if let Some((t, by)) = host_time_by(&c, s.ctx, s.event, now_ns())
        && let Some(open) = c.start.as_mut()
    {
        open.began = t;
        open.began_by = by;
    }
}

/// Whether an event recorded on the span's stream now, by the calling
/// thread, follows all the span's work, for a wait for `stream` (`None`:
/// the context's, or a copy's on a default stream).
fn marks_span(g: &Gate, start: &Start, stream: Option<usize>) -> bool {
    // The span's launches went to its opening stream alone, so far.
    if g.open_stream.load(Ordering::SeqCst) != start.key {
        return false;
    }
    // The span's stream, as this thread names it.
    let here = stream_key(start.raw as *mut c_void, start.per_thread);
    if here != start.key || stream.is_some_and(|key| key != start.key) {
        return false;
    }
    // A default stream is the current context's, which must be the
    // span's (`cuCtxSynchronize_v2` may name another); a stream the
    // program made is named only by the wait for it.
    let default = start.raw <= 2;
    (stream.is_some() || default) && (!default || current_ctx() == Some(start.ctx))
}

/// Where the work `mark` marks was done, on the host's clock, if the
/// device says so already (the mark's event completed, and the clock is
/// calibrated): before a waiting thread wakes to see it.
pub(super) fn completed_at(g: &Gate, mark: Mark) -> Option<u64> {
    let Mark::Recorded { ctx, event, epoch } = mark else {
        return None;
    };
    let c = lock(&g.devclock);
    if c.epoch != epoch || driver::event_query(event) != CUDA_SUCCESS {
        return None;
    }
    host_time(&c, ctx, event, now_ns())
}

/// The wait that made `mark` is over: its event goes back.
pub(super) fn unmark(g: &Gate, mark: Mark) {
    if let Mark::Recorded { ctx, event, epoch } = mark {
        give_back(g, ctx, event, epoch);
    }
}

/// Where the span opened at `since`, whose launches went to stream
/// `stream` (or `covers::MIXED`), and proven done at `at` by a wait that
/// made `mark`, began and ended: where its opening event and the mark
/// completed, by the calibrated clock (see the module doc); else the
/// device time from its opening event to the mark's before `at`; else
/// `since` to `at`, where the device cannot say. Called with the span
/// closing (its opening event is taken).
///
/// The span is placed to end at the proof, not to begin at `since`: the
/// time from `since` to `at` is the device's time, its first kernel's
/// wait for the device (behind another group's queued work, or for a
/// time slice) and the host's wake-up, and only the first is known not to
/// be a wait for nothing. Placed from `since`, a span that began behind
/// another group's work claimed that work's time, which the ledger gave
/// to the work that began first, and the span was charged its wait the
/// less (undercharged); ending at `at`, it is charged what it ran.
pub(super) fn start(g: &Gate, since: u64, stream: usize, at: u64, mark: Mark) -> (u64, u64) {
    let at = at.max(since);
    let start = {
        let mut c = lock(&g.devclock);
        match c.start {
            Some(s) if s.since == since => c.start.take(),
            _ => None,
        }
    };
    let Some(start) = start else {
        return (since, at);
    };
    let end_event = match mark {
        Mark::Recorded { event, .. } => Some(event),
        Mark::Event(e) => Some(e),
        Mark::Host => None,
    }
    .filter(|_| stream == start.key);
    let (placed, elapsed) = {
        // Under the lock, with both events of the context generation now:
        // a context that goes moves it on first (see `context_going`).
        let c = lock(&g.devclock);
        let current = |epoch| epoch == c.epoch;
        let end_event = end_event.filter(|_| match mark {
            Mark::Recorded { epoch, .. } => current(epoch),
            _ => true,
        });
        match end_event.filter(|_| current(start.epoch)) {
            Some(end) => match placed(&c, &start, end, since, at) {
                Some(p) => (Some(p), None),
                // Uncalibrated: the device's length, ended at the proof.
                None => (
                    None,
                    (!start.behind)
                        .then(|| driver::event_elapsed_ns(start.event, end).ok())
                        .flatten(),
                ),
            },
            None => (None, None),
        }
    };
    let ends = placed.or_else(|| elapsed.map(|ns| (at.saturating_sub(ns).clamp(since, at), at)));
    match ends {
        // Begun later than the host saw it begin, or seen done late.
        Some((begun, end))
            if late(since, begun, at)
                || lagged(at.saturating_sub(end), end.saturating_sub(begun)) =>
        {
            lock(&g.devclock).misses = 0
        }
        _ => missed(g),
    }
    give_back(g, start.ctx, start.event, start.epoch);
    ends.unwrap_or((since, at))
}

/// Where the span opened at `since` with `start` and proven done at `at`
/// by event `end` began and ended on the calibrated clock, if it is
/// calibrated and both lie where the host saw the span (within
/// `CAL_SLACK_NS`).
fn placed(c: &DevClock, start: &Start, end: usize, since: u64, at: u64) -> Option<(u64, u64)> {
    let now = now_ns();
    let (ended, by) = host_time_by(c, start.ctx, end, now)?;
    let began = if start.behind {
        since
    } else if start.began != 0 && start.began_by == by {
        start.began
    } else {
        host_time(c, start.ctx, start.event, now)?
    };
    let believable = |t: u64| since.saturating_sub(CAL_SLACK_NS) <= t && t <= at + CAL_SLACK_NS;
    if !(believable(began) && believable(ended) && began <= ended) {
        return None;
    }
    let began = began.clamp(since, at);
    Some((began, ended.clamp(began, at)))
}

/// Context `ctx` may go now (the program's call that can destroy it is
/// about to run, under its lock): its calibration goes first, and the
/// context generation moves on, under the clock's lock, so that no other
/// thread (the watcher) uses its stream or events while or after it
/// goes: every driver call on them is made under that lock, for the
/// generation they were taken in.
pub(crate) fn context_going(g: &Gate, ctx: usize) {
    let mut c = lock(&g.devclock);
    c.epoch = c.epoch.wrapping_add(1);
    if let Some(i) = c.cals.iter().position(|cal| cal.ctx == ctx) {
        destroy(c.cals.swap_remove(i));
    }
}

/// Context `ctx` went, and its events with it: none of them is used or
/// given back again.
pub(crate) fn context_gone(g: &Gate, ctx: usize) {
    let mut c = lock(&g.devclock);
    c.epoch = c.epoch.wrapping_add(1);
    c.spare.retain(|&(c, _)| c != ctx);
    if c.start.is_some_and(|s| s.ctx == ctx) {
        c.start = None;
    }
    // Its stream and references went with it.
    c.cals.retain(|cal| cal.ctx != ctx);
}

#[cfg(test)]
mod tests {
    use super::late;

    /// The device's clock is worth its records where the host's time
    /// exceeds the device's by 20 µs or by 1 % of the device's time.
    #[test]
    fn a_span_is_late_where_the_host_took_20_us_or_1_percent_more() {
        const MS: u64 = 1_000_000;
        // 1 ms on the device, the host 5 µs more: not worth it.
        assert!(!late(0, 5_000, MS + 5_000));
        // 300 µs more: worth it.
        assert!(late(0, 300_000, MS + 300_000));
        // 100 µs on the device, 2 µs more (2 %): worth it.
        assert!(late(0, 2_000, 102_000));
        // 10 ms on the device, 25 µs more (0.25 %, but over 20 µs).
        assert!(late(0, 25_000, 10 * MS + 25_000));
        // No difference at all.
        assert!(!late(7, 7, MS));
    }
}
