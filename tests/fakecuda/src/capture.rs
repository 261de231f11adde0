//! Stream capture, as the driver does it (`cuStreamBeginCapture` …
//! `cuStreamEndCapture`): work issued to a capturing stream is recorded
//! into a graph instead of running; an event recorded in a capture and
//! waited on by another stream draws that stream into the capture.
//!
//! What is illegal during a capture, and what it does (CUDA driver API,
//! "Stream Management" and `cuThreadExchangeStreamCaptureMode`):
//! - A thread's interaction mode (default `GLOBAL`) decides which captures
//!   forbid it *potentially unsafe* calls — here a context-wide
//!   synchronisation (`cuCtxSynchronize`) and work on, or a wait for, the
//!   legacy default stream (synchronous copies and memsets among them):
//!   `GLOBAL`: its own captures not begun `RELAXED`, and any other
//!   thread's `GLOBAL` capture; `THREAD_LOCAL`: its own captures not begun
//!   `RELAXED`; `RELAXED`: none. A forbidden call fails with
//!   `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` and invalidates those
//!   captures.
//! - Synchronising or querying a capturing stream fails the same way and
//!   invalidates its capture.
//! - Work issued to a stream whose capture is invalidated fails with
//!   `CUDA_ERROR_STREAM_CAPTURE_INVALIDATED`, and so does ending that
//!   capture (the capture is over, no graph).
//! - Work on the legacy stream while a blocking stream (one not created
//!   `CU_STREAM_NON_BLOCKING`) captures would make the legacy stream
//!   depend on the capture: `CUDA_ERROR_STREAM_CAPTURE_IMPLICIT`, and the
//!   capture is invalidated.
//! - Ending a capture begun not `RELAXED` from another thread:
//!   `CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD` (it goes on); on a stream
//!   that only joined it: `CUDA_ERROR_STREAM_CAPTURE_UNMATCHED`; on a
//!   stream not capturing: `CUDA_ERROR_ILLEGAL_STATE`, as is beginning a
//!   capture twice.
//!
//! Simplifications: captures are only on created streams (the legacy and
//! per-thread default streams cannot capture here: `CUDA_ERROR_NOT_SUPPORTED`
//! for the per-thread one, `CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED` for the
//! legacy one, as the driver says); a graph is the list of its kernels'
//! durations, run one after another.

use crate::types::*;
use std::cell::Cell;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Captures open in the process (a forked child may see its parent's
/// count: it then only takes the slower, exact path).
static OPEN: AtomicUsize = AtomicUsize::new(0);

/// Whether a capture may be open: without one, work and waits skip the
/// capture bookkeeping.
pub fn any_open() -> bool {
    OPEN.load(Ordering::Acquire) != 0
}

/// `CUstreamCaptureMode`.
pub const MODE_GLOBAL: u32 = 0;
pub const MODE_THREAD_LOCAL: u32 = 1;
pub const MODE_RELAXED: u32 = 2;

/// `CUstreamCaptureStatus`.
pub const STATUS_NONE: u32 = 0;
pub const STATUS_ACTIVE: u32 = 1;
pub const STATUS_INVALIDATED: u32 = 2;

thread_local! {
    /// This thread's capture interaction mode.
    static MODE: Cell<u32> = const { Cell::new(MODE_GLOBAL) };
}

/// The calling thread's id.
pub fn tid() -> i64 {
    // SAFETY: gettid has no preconditions.
    unsafe { libc::syscall(libc::SYS_gettid) }
}

/// `cuThreadExchangeStreamCaptureMode`: sets this thread's mode, returns
/// the one it had.
pub fn exchange_mode(mode: u32) -> Result<u32, CUresult> {
    if mode > MODE_RELAXED {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    Ok(MODE.with(|m| m.replace(mode)))
}

/// An open capture sequence.
#[derive(Debug)]
pub struct Capture {
    pub id: u64,
    pub mode: u32,
    /// Thread that began it.
    pub thread: i64,
    /// Streams in it: the one it began on first, then those that joined.
    pub streams: Vec<usize>,
    /// Whether the origin stream is a blocking one.
    pub blocking: bool,
    pub invalidated: bool,
    /// Durations (ns) of the kernels recorded, in order.
    pub nodes: Vec<u64>,
    /// Allocation nodes (`cuMemAllocAsync` on a capturing stream).
    pub allocs: Vec<crate::graphmem::AllocNode>,
}

/// The open captures of a process.
#[derive(Debug, Default)]
pub struct Captures {
    open: Vec<Capture>,
    next_id: u64,
}

impl Captures {
    /// The capture stream `h` takes part in.
    pub fn of(&mut self, h: usize) -> Option<&mut Capture> {
        self.open.iter_mut().find(|c| c.streams.contains(&h))
    }

    /// The open capture of that id.
    pub fn of_id(&mut self, id: u64) -> Option<&mut Capture> {
        self.open.iter_mut().find(|c| c.id == id)
    }

    /// Whether the capture of that id is open.
    pub fn has_id(&self, id: u64) -> bool {
        self.open.iter().any(|c| c.id == id)
    }

    pub fn begin(&mut self, h: usize, blocking: bool, mode: u32) -> Result<(), CUresult> {
        if mode > MODE_RELAXED {
            return Err(CUDA_ERROR_INVALID_VALUE);
        }
        if self.of(h).is_some() {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        }
        self.next_id += 1;
        OPEN.fetch_add(1, Ordering::AcqRel);
        self.open.push(Capture {
            id: self.next_id,
            mode,
            thread: tid(),
            streams: vec![h],
            blocking,
            invalidated: false,
            nodes: Vec::new(),
            allocs: Vec::new(),
        });
        Ok(())
    }

    /// Ends the capture begun on `h`: its kernels and allocation nodes, or
    /// the error.
    #[allow(clippy::type_complexity)]
    pub fn end(
        &mut self,
        h: usize,
    ) -> Result<(Vec<u64>, Vec<crate::graphmem::AllocNode>), CUresult> {
        let Some(i) = self.open.iter().position(|c| c.streams.contains(&h)) else {
            return Err(CUDA_ERROR_ILLEGAL_STATE);
        };
        let c = &self.open[i];
        if c.streams[0] != h {
            return Err(CUDA_ERROR_STREAM_CAPTURE_UNMATCHED);
        }
        if c.mode != MODE_RELAXED && c.thread != tid() {
            return Err(CUDA_ERROR_STREAM_CAPTURE_WRONG_THREAD);
        }
        let c = self.open.remove(i);
        OPEN.fetch_sub(1, Ordering::AcqRel);
        if c.invalidated {
            Err(CUDA_ERROR_STREAM_CAPTURE_INVALIDATED)
        } else {
            Ok((c.nodes, c.allocs))
        }
    }

    /// A potentially unsafe call (context-wide synchronisation, legacy
    /// stream work or wait) from this thread: refused, and the captures
    /// that forbid it invalidated, if any does.
    pub fn unsafe_call(&mut self) -> Result<(), CUresult> {
        let me = tid();
        let mode = MODE.with(Cell::get);
        let mut forbidden = false;
        for c in &mut self.open {
            let own = c.thread == me && c.mode != MODE_RELAXED && mode != MODE_RELAXED;
            let other = c.thread != me && c.mode == MODE_GLOBAL && mode == MODE_GLOBAL;
            if own || other {
                c.invalidated = true;
                forbidden = true;
            }
        }
        if forbidden {
            Err(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED)
        } else {
            Ok(())
        }
    }

    /// Work issued to the legacy stream: refused while a blocking stream
    /// captures (the legacy stream would depend on it), which invalidates
    /// that capture.
    pub fn legacy_work(&mut self) -> Result<(), CUresult> {
        let mut implicit = false;
        for c in self.open.iter_mut().filter(|c| c.blocking) {
            c.invalidated = true;
            implicit = true;
        }
        if implicit {
            Err(CUDA_ERROR_STREAM_CAPTURE_IMPLICIT)
        } else {
            Ok(())
        }
    }

    /// `cuStreamIsCapturing` of a created stream.
    pub fn status(&mut self, h: usize) -> u32 {
        match self.of(h) {
            None => STATUS_NONE,
            Some(c) if c.invalidated => STATUS_INVALIDATED,
            Some(_) => STATUS_ACTIVE,
        }
    }

    /// Whether a blocking stream captures (the legacy stream's status
    /// cannot be asked then).
    pub fn blocking_open(&self) -> bool {
        self.open.iter().any(|c| c.blocking)
    }
}
