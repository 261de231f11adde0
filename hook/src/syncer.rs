//! Waiting for a device's work, within a bound.
//!
//! A token's end waits for the work launched under it, so that the time it
//! really took is what gets reported. But work may wait for another
//! process: an NCCL collective for its peer rank on another GPU, whose
//! token another job may hold while its own collective waits for this
//! very device. A wait without a bound then holds this device until the
//! scheduler revokes the token (a second past its end), and the two jobs
//! take turns at that pace.
//!
//! So the synchronisation runs on a thread of its own per device, and the
//! token's end waits for it only so long; past that, the token is
//! accounted to now and handed back, and the synchronisation goes on (the
//! next token's end waits for it first).

use crate::state::{Gate, lock};
use std::ffi::c_void;
use std::time::{Duration, Instant};

/// What waits for a device's work: `gate`'s synchronisation of every
/// context the process has on ordinal `dev`, handed down so that this
/// layer needs nothing above it.
pub type SyncFn = fn(usize, *mut c_void);

/// Waits for the process's work on ordinal `dev` (in `ctx` and its other
/// contexts there) for at most `bound`. `Ok(ran)` once done (`ran`:
/// false where a capture was open, and nothing was synchronised);
/// `Err(ticket)` if it was not done in time: it goes on without the
/// caller, and [`finished`] with `ticket` says when it is done.
pub fn sync_within(
    dev: usize,
    g: &'static Gate,
    ctx: *mut c_void,
    bound: Duration,
    sync: SyncFn,
) -> Result<bool, u64> {
    let s = &g.syncer;
    let deadline = Instant::now() + bound;
    let mut slot = lock(&s.slot);
    if !slot.started && !start(dev, g, sync) {
        // No thread: wait here, without a bound.
        drop(slot);
        return Ok(crate::capture::unless_capturing(|| sync(dev, ctx)));
    }
    slot.started = true;
    // One still running covers only older work: the thread runs this one
    // after it (all of the device's contexts are synchronised either way).
    slot.asked += 1;
    slot.ctx = ctx as usize;
    let mine = slot.asked;
    s.cv.notify_all();
    loop {
        if slot.done >= mine {
            return Ok(slot.ran);
        }
        let now = Instant::now();
        if now >= deadline {
            return Err(mine);
        }
        slot =
            s.cv.wait_timeout(slot, deadline - now)
                .map_or_else(|p| p.into_inner().0, |(g, _)| g);
    }
}

/// Whether the synchronisation `ticket` of [`sync_within`] (or a later
/// one) is done: `None` while it runs; then when it was done (ns), or
/// `Some(None)` where it synchronised nothing (a capture was open), which
/// proves nothing done.
pub fn finished(g: &Gate, ticket: u64) -> Option<Option<u64>> {
    let slot = lock(&g.syncer.slot);
    (slot.done >= ticket).then_some(slot.ran.then_some(slot.done_at))
}

/// Starts `g`'s synchronisation thread.
fn start(dev: usize, g: &'static Gate, sync: SyncFn) -> bool {
    std::thread::Builder::new()
        .name(format!("gemini-sync-{dev}"))
        .spawn(move || run(dev, g, sync))
        .is_ok()
}

fn run(dev: usize, g: &'static Gate, sync: SyncFn) {
    let s = &g.syncer;
    loop {
        let (n, ctx) = {
            let mut slot = lock(&s.slot);
            while slot.asked == slot.done {
                slot = s.cv.wait(slot).unwrap_or_else(|p| p.into_inner());
            }
            (slot.asked, slot.ctx)
        };
        let ran = crate::capture::unless_capturing(|| sync(dev, ctx as *mut c_void));
        let mut slot = lock(&s.slot);
        slot.done = n;
        slot.ran = ran;
        slot.done_at = crate::clock::now_ns();
        s.cv.notify_all();
    }
}
