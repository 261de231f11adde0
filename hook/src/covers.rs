//! What a wait that returned with work done proves done.
//!
//! The gate learns the device time per launch from a sample: the
//! launches since it began and the time until a wait proved them run (see
//! `gate`). A completion proves less than "the process's work": a stream
//! synchronisation or query only that stream's work queued before it, an
//! event's only the work its stream had before the event's last record,
//! a synchronous copy only the work of the streams it synchronises with.
//! PyTorch's caching allocator and NCCL's watchdog query old events all the
//! time; had each such answer counted, the kernels queued since would have
//! seemed to take no time.
//!
//! So each gate remembers the one stream its sample's launches went to
//! (or that they went to several), and each event the stream and the
//! launch count of its last record; a completion teaches the gate only
//! where it covers every launch of the sample.

use crate::capture;
use crate::driver;
use crate::state::{self, Gate, Record, lock};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// The sample has no launch yet.
pub const NO_STREAM: usize = 0;
/// The sample's launches went to more than one stream.
pub const MIXED: usize = usize::MAX;
/// The legacy default stream (`0` without `_ptsz`, `CU_STREAM_LEGACY`).
const LEGACY: usize = 1;
/// `CU_STREAM_PER_THREAD`.
const PER_THREAD: usize = 2;

thread_local! {
    /// Its address names the calling thread's per-thread default stream.
    static OWN_STREAM: u8 = const { 0 };
}

/// The calling thread's per-thread default stream.
fn own_stream() -> usize {
    OWN_STREAM.with(|b| b as *const u8 as usize)
}

/// Names the stream a handle means on the calling thread (`per_thread`:
/// the null stream is the thread's own, as for `_ptsz` entry points).
#[inline]
pub fn stream_key(stream: *mut c_void, per_thread: bool) -> usize {
    match stream as usize {
        0 if per_thread => own_stream(),
        0 | LEGACY => LEGACY,
        PER_THREAD => own_stream(),
        s => s,
    }
}

/// A launch onto `key` was admitted under `g`: the sample's launches
/// went there too, and so did those of the open span (see
/// `gate::measure`).
#[inline]
pub fn note_launch(g: &Gate, key: usize) {
    note_stream(&g.sample_stream, key);
    note_stream(&g.open_stream, key);
}

/// Notes a launch onto `key` in `slot` (a stream, `NO_STREAM` or `MIXED`).
#[inline]
fn note_stream(slot: &std::sync::atomic::AtomicUsize, key: usize) {
    let seen = slot.load(Ordering::Relaxed);
    if seen == key || seen == MIXED {
        return;
    }
    let _ = slot.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |s| {
        (s != key && s != MIXED).then_some(if s == NO_STREAM { key } else { MIXED })
    });
}

/// What a wait call, if it returns with the work done, proves done.
#[derive(Debug, Clone, Copy)]
pub enum Covers {
    /// Every stream of the current context (`cuCtxSynchronize`).
    Context,
    /// The work queued onto one stream before the call.
    Stream(usize),
    /// The work before the event's last record.
    Event(usize),
    /// A synchronous copy: the work of the streams the null stream
    /// synchronises with (`per_thread`: the thread's own default stream).
    Copy { per_thread: bool },
}

impl Covers {
    /// A synchronisation or query of `stream`.
    pub fn stream(stream: *mut c_void, per_thread: bool) -> Covers {
        Covers::Stream(stream_key(stream, per_thread))
    }

    /// A synchronisation or query of `event`.
    pub fn event(event: *mut c_void) -> Covers {
        Covers::Event(event as usize)
    }

    /// Whether this completion, of a wait that began when `launches_at`
    /// launches had been admitted under gate `dev`, proves every launch
    /// of the gate's sample run.
    pub fn proves_sample(self, dev: usize, g: &Gate, launches_at: u64) -> bool {
        self.proves(dev, g, launches_at, g.sample_stream.load(Ordering::Relaxed))
    }

    /// Whether this completion proves every launch of the gate's open
    /// span run (see `gate::measure`): all the process's work there.
    pub fn proves_open(self, dev: usize, g: &Gate, launches_at: u64) -> bool {
        self.proves(dev, g, launches_at, g.open_stream.load(Ordering::SeqCst))
    }

    /// Whether this completion proves every launch that went to `sample`
    /// (a stream, `NO_STREAM` or `MIXED`) since the count was last reset.
    fn proves(self, dev: usize, g: &Gate, launches_at: u64, sample: usize) -> bool {
        let launches = g.launches();
        if launches != launches_at {
            return false; // launched meanwhile: the call need not cover that
        }
        match self {
            Covers::Context => true,
            Covers::Stream(key) => sample == key,
            Covers::Event(e) => state::current().is_some_and(|st| {
                lock(&st.events).get(&e).is_some_and(|r| {
                    r.device == dev && r.stream == sample && r.launches == launches
                })
            }),
            // The per-thread default stream synchronises with the legacy
            // one; the legacy one with the per-thread ones and every
            // blocking stream.
            Covers::Copy { per_thread: true } => sample == own_stream() || sample == LEGACY,
            Covers::Copy { per_thread: false } => {
                sample == LEGACY || (sample != MIXED && sample != NO_STREAM && blocking(sample))
            }
        }
    }
}

/// Whether the stream named `key` synchronises with the legacy default
/// stream: a per-thread default stream, or one created without
/// `CU_STREAM_NON_BLOCKING` (asked of the driver; a stream it does not
/// know proves nothing).
fn blocking(key: usize) -> bool {
    if key == own_stream() {
        return true;
    }
    const CU_STREAM_NON_BLOCKING: u32 = 1;
    let mut flags = 0u32;
    // SAFETY: out-pointer to a local; an invalid handle is answered with
    // an error, not used.
    let r = unsafe { driver::stream_get_flags(key as *mut c_void, &mut flags) };
    r == crate::cuda::CUDA_SUCCESS && flags & CU_STREAM_NON_BLOCKING == 0
}

/// `cuEventRecord[WithFlags]` of `event` onto `stream` by `call`: what the
/// event's completion will prove done. A record into a capture makes a
/// graph node and proves nothing now.
pub fn record(
    event: *mut c_void,
    stream: *mut c_void,
    per_thread: bool,
    call: impl FnOnce() -> crate::cuda::CUresult,
) -> crate::cuda::CUresult {
    let Some(st) = state::current() else {
        return call();
    };
    // The launches the record follows, counted before it: counted after,
    // another thread's launch between the two was taken as covered, and
    // a watchdog's event recorded as the first kernels were launched
    // proved them done at once (1 ms kernels learned as 99 µs; every wait
    // then looked stalled, and the estimate never recovered).
    let device = state::current_device();
    let before = device.map(|d| launches_before_record(&st.gates[d]));
    let r = call();
    // Asked of the driver before the lock: it is held only to update.
    let record = (r == crate::cuda::CUDA_SUCCESS && !capture::captured(stream, per_thread))
        .then_some(device.zip(before))
        .flatten()
        .map(|(device, launches)| Record {
            device,
            stream: stream_key(stream, per_thread),
            launches,
        });
    let mut events = lock(&st.events);
    match record {
        Some(rec) => events.insert(event as usize, rec),
        None => events.remove(&(event as usize)),
    };
    r
}

/// The launches of `g` that a record made now follows, for
/// [`Covers::proves_sample`]: its launch count, where no launch is in
/// flight; else `u64::MAX`, which matches no count, so that the event
/// proves no sample (a launch counted as it enters may reach the driver
/// after the record).
fn launches_before_record(g: &Gate) -> u64 {
    // `waits` after `entered`: a wait counted in `waits` but not in
    // `entered` makes the count smaller, which proves less, never more.
    let f = g.in_flight();
    if f.launches() != 0 {
        return u64::MAX;
    }
    f.entered.saturating_sub(g.waits.load(Ordering::SeqCst))
}

/// `cuEventDestroy` of `event` by `call`.
pub fn destroyed(
    event: *mut c_void,
    call: impl FnOnce() -> crate::cuda::CUresult,
) -> crate::cuda::CUresult {
    if let Some(st) = state::current() {
        lock(&st.events).remove(&(event as usize));
    }
    call()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event recorded while a launch is in flight (counted as it
    /// entered, maybe not yet with the driver) proves no sample; one
    /// recorded with only waits in flight follows every launch made.
    #[test]
    fn a_record_beside_a_launch_in_flight_follows_no_count() {
        let g = Gate::default();
        let set = |entered, exited, waiting, waits| {
            g.entered.store(entered, Ordering::Relaxed);
            g.exited.store(exited, Ordering::Relaxed);
            g.waiting_now.store(waiting, Ordering::Relaxed);
            g.waits.store(waits, Ordering::Relaxed);
        };
        // Four launches made and returned: the record follows all four.
        set(4, 4, 0, 0);
        assert_eq!(launches_before_record(&g), 4);
        // A fifth launch entered, not returned: no count.
        set(5, 4, 0, 0);
        assert_eq!(launches_before_record(&g), u64::MAX);
        // A wait in flight (another thread synchronising), no launch.
        set(6, 5, 1, 1);
        assert_eq!(launches_before_record(&g), 5);
        // A wait and a launch in flight: no count.
        set(7, 5, 1, 1);
        assert_eq!(launches_before_record(&g), u64::MAX);
    }
}
