//! Span ends from the device's own clock.
//!
//! A span (see `measure`) ends where a wait proves its work done. The host
//! learns that only as the waiting thread wakes: microseconds later on an
//! idle machine with a spinning wait, hundreds of microseconds on a loaded
//! CPU or with a blocking-sync context. Charged to the group as device
//! time, that wake-up takes its share: a group capped at 0.4 that waits
//! after every 1 ms kernel got 0.37 on a host that woke it 80 µs late.
//!
//! So a span's opening launch is preceded by a timing event recorded on
//! its stream (the stream is idle then: nothing of the process is known
//! outstanding), and a blocking wait on that stream by one recorded just
//! before it; an event the program waits for serves as it is. Where the
//! wait proves the span done, its end is its host opening time plus
//! `cuEventElapsedTime` between the two, never past the host's proof.
//! Anything else (work on several streams, a stream's query, a capture
//! open, an event without timing, a second context) ends on the host's
//! clock, as before.
//!
//! Every event is one of the span's context, kept for reuse; a context
//! that goes takes its events with it (see [`context_gone`]).

use super::*;
use crate::covers::stream_key;
use crate::state::ClockStart as Start;

/// Spare events kept per gate.
const MAX_SPARE: usize = 4;

/// Spans in a row that opened with an event and ended on the host's
/// clock (no wait of theirs could be timed: a program that waits only
/// for copies on other streams, or whose tokens end its spans) after
/// which only one span in `PROBE` records one: two records a span are
/// paid only where they serve.
const MISSES: u32 = 8;
const PROBE: u32 = 16;

/// What a wait's completion ends the span at, as the wait began.
#[derive(Debug, Clone, Copy, Default)]
pub(crate) enum Mark {
    /// The host's clock.
    #[default]
    Host,
    /// An event of context `ctx`, recorded on the span's stream just
    /// before the wait: the gate's, given back once the wait is over.
    Recorded { ctx: usize, event: usize },
    /// The program's event, whose completion the wait proves.
    Event(usize),
}

/// The calling thread's current context, if any.
fn current_ctx() -> Option<usize> {
    let mut ctx: *mut c_void = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    let r = unsafe { driver::ctx_get_current(&mut ctx) };
    (r == CUDA_SUCCESS && !ctx.is_null()).then_some(ctx as usize)
}

/// Gives `event` of `ctx` back for reuse.
fn give_back(g: &Gate, ctx: usize, event: usize) {
    let mut c = lock(&g.devclock);
    if c.spare.len() < MAX_SPARE {
        c.spare.push((ctx, event));
    } else {
        drop(c);
        driver::event_destroy(event);
    }
}

/// Records `event` on `raw` (`per_thread`).
fn record(event: usize, raw: usize, per_thread: bool) -> bool {
    driver::event_record(event, raw as *mut c_void, per_thread) == CUDA_SUCCESS
}

/// A launch onto `stream` under `g`, from a thread whose current context
/// is the launch's, may open a span: an event recorded on
/// that stream now, before the launch reaches the driver, so that every
/// launch of the span follows it. `None` where no event can be recorded
/// (a capture open, no context).
pub(super) fn start(g: &Gate, stream: *mut c_void, per_thread: bool) -> Option<Start> {
    if capture::any_open() {
        return None; // a record into a capture makes a node, and times nothing
    }
    {
        let mut c = lock(&g.devclock);
        if c.misses >= MISSES {
            c.skipped = c.skipped.wrapping_add(1);
            if !c.skipped.is_multiple_of(PROBE) {
                return None;
            }
        }
    }
    let ctx = current_ctx()?;
    let event = take_event(g, ctx)?;
    let raw = stream as usize;
    if !record(event, raw, per_thread) {
        give_back(g, ctx, event);
        return None;
    }
    Some(Start {
        since: 0,
        ctx,
        event,
        key: stream_key(stream, per_thread),
        raw,
        per_thread,
    })
}

/// The span `start` was recorded for opened at `since`; or, with `since`
/// 0, another launch opened it first, and the event is spare.
pub(super) fn opened(g: &Gate, start: Start, since: u64) {
    if since == 0 {
        give_back(g, start.ctx, start.event);
        return;
    }
    let old = lock(&g.devclock).start.replace(Start { since, ..start });
    if let Some(old) = old {
        give_back(g, old.ctx, old.event);
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
    if g.open_since.load(Ordering::SeqCst) == 0 || capture::any_open() {
        return Mark::Host;
    }
    let Some(start) = lock(&g.devclock).start else {
        return Mark::Host;
    };
    // The span's stream, as this thread names it.
    let here = stream_key(start.raw as *mut c_void, start.per_thread);
    let ours = match stream {
        Some(key) => key == start.key && here == key,
        // The default stream of the current context, which must be the
        // span's (`cuCtxSynchronize_v2` may name another).
        None => here == start.key && start.raw <= 2 && current_ctx() == Some(start.ctx),
    };
    if !ours {
        return Mark::Host;
    }
    let Some(event) = take_event(g, start.ctx) else {
        return Mark::Host;
    };
    if record(event, start.raw, start.per_thread) {
        Mark::Recorded {
            ctx: start.ctx,
            event,
        }
    } else {
        give_back(g, start.ctx, event);
        Mark::Host
    }
}

/// A spare event of `ctx`, or one made there where it is current.
fn take_event(g: &Gate, ctx: usize) -> Option<usize> {
    let spare = {
        let mut c = lock(&g.devclock);
        let i = c.spare.iter().position(|&(c, _)| c == ctx);
        i.map(|i| c.spare.swap_remove(i).1)
    };
    spare.or_else(|| {
        (current_ctx() == Some(ctx))
            .then(driver::event_create)
            .flatten()
    })
}

/// The wait that made `mark` is over: its event goes back.
pub(super) fn unmark(g: &Gate, mark: Mark) {
    if let Mark::Recorded { ctx, event } = mark {
        give_back(g, ctx, event);
    }
}

/// Where the span opened at `since`, whose launches went to stream
/// `stream` (or `covers::MIXED`), ends, proven done at `at` by a wait
/// that made `mark`: its opening event's device time to the mark's
/// added to `since`, at most `at`; `at` where the device cannot say.
/// Called with the span closing (its opening event is taken).
pub(super) fn end(g: &Gate, since: u64, stream: usize, at: u64, mark: Mark) -> u64 {
    let start = {
        let mut c = lock(&g.devclock);
        match c.start {
            Some(s) if s.since == since => c.start.take(),
            _ => None,
        }
    };
    let Some(start) = start else { return at };
    let end_event = match mark {
        Mark::Recorded { event, .. } => Some(event),
        Mark::Event(e) => Some(e),
        Mark::Host => None,
    };
    let elapsed = end_event
        .filter(|_| stream == start.key)
        .and_then(|e| driver::event_elapsed_ns(start.event, e).ok());
    {
        let mut c = lock(&g.devclock);
        c.misses = if elapsed.is_some() {
            0
        } else {
            c.misses.saturating_add(1)
        };
    }
    give_back(g, start.ctx, start.event);
    match elapsed {
        Some(ns) => since.saturating_add(ns).clamp(since, at.max(since)),
        None => at,
    }
}

/// Context `ctx` went, and its events with it.
pub(crate) fn context_gone(g: &Gate, ctx: usize) {
    let mut c = lock(&g.devclock);
    c.spare.retain(|&(c, _)| c != ctx);
    if c.start.is_some_and(|s| s.ctx == ctx) {
        c.start = None;
    }
}
