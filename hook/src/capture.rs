//! Stream capture (`cuStreamBeginCapture` … `cuStreamEndCapture`, as
//! `torch.cuda.graph`, torch.compile's "reduce-overhead" and vLLM do it).
//!
//! While any capture is open in the process, the driver forbids
//! context-wide and legacy-stream synchronisation from other threads (a
//! global-mode capture) or the capturing one: such a call fails and
//! invalidates the capture, so the program's graph is lost. The hook
//! therefore tracks the captures the program opens and:
//! - lets a launch into a capturing stream through ungated: it only
//!   records a graph node; the work runs later through `cuGraphLaunch`,
//!   which is gated;
//! - never synchronises while a capture is open: a token's accounting then
//!   ends without waiting for its work (see `gate::settle`).

use crate::cuda::CUDA_SUCCESS;
use crate::driver::{self, CUresult};
use crate::state::{self, lock};
use std::ffi::c_void;
use std::sync::atomic::Ordering;

/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const STATUS_NONE: u32 = 0;

/// Whether a capture may be open in this process (one relaxed load: the
/// launch fast path asks).
#[inline]
pub fn any_open() -> bool {
    state::current().is_some_and(|st| st.captures_open.load(Ordering::Relaxed) != 0)
}

/// What a capture on `stream` is known by: the stream, but for the
/// per-thread default stream (null for a `_ptsz` caller, or
/// `CU_STREAM_PER_THREAD`), which is each thread's own: that one and the
/// thread.
pub fn key(stream: *mut c_void, per_thread: bool) -> usize {
    let s = stream as usize;
    if s == CU_STREAM_PER_THREAD || (s == 0 && per_thread) {
        // SAFETY: gettid has no preconditions.
        let tid = unsafe { libc::gettid() } as usize;
        (tid << 8) | CU_STREAM_PER_THREAD
    } else {
        s
    }
}

/// `CU_STREAM_PER_THREAD`.
const CU_STREAM_PER_THREAD: usize = 0x2;

/// A `cuStreamBeginCapture*` on `stream` by `call`. The capture counts as
/// open *before* the driver's call (and no longer if it fails): the idle
/// watcher checks for open captures and synchronises under the same lock
/// ([`unless_capturing`]), so it never synchronises inside a capture that
/// another thread is beginning.
pub fn begin(stream: *mut c_void, per_thread: bool, call: impl FnOnce() -> CUresult) -> CUresult {
    let st = state::get();
    let key = key(stream, per_thread);
    let counted = lock(&st.captures).insert(key);
    if counted {
        st.captures_open.fetch_add(1, Ordering::AcqRel);
    }
    let r = call();
    if r == CUDA_SUCCESS {
        crate::log::debug!("capture begun on stream {stream:?}");
    } else if counted && lock(&st.captures).remove(&key) {
        st.captures_open.fetch_sub(1, Ordering::AcqRel);
    }
    r
}

/// Runs `sync` (a synchronisation of the process's work) unless a
/// capture is open, with no capture beginning meanwhile. False if it did
/// not run.
pub fn unless_capturing(sync: impl FnOnce()) -> bool {
    let Some(st) = state::current() else {
        sync();
        return true;
    };
    let open = lock(&st.captures);
    if !open.is_empty() {
        return false;
    }
    sync();
    drop(open);
    true
}

/// A `cuStreamEndCapture` on `stream` returned: the capture is over unless
/// the driver says the stream still captures (ended from the wrong
/// thread, for one).
pub fn ended(stream: *mut c_void, per_thread: bool, r: CUresult) -> CUresult {
    let Some(st) = state::current() else { return r };
    if capturing(stream, per_thread) {
        return r;
    }
    if lock(&st.captures).remove(&key(stream, per_thread)) {
        st.captures_open.fetch_sub(1, Ordering::AcqRel);
        crate::log::debug!("capture ended on stream {stream:?} ({r})");
    }
    r
}

/// The [`key`] of the capture `stream` takes part in: its own when a
/// capture began on it; else the one capture open, when there is one (a
/// stream that joined it through an event); else its own.
pub fn origin(stream: *mut c_void, per_thread: bool) -> usize {
    let own = key(stream, per_thread);
    let Some(st) = state::current() else {
        return own;
    };
    let open = lock(&st.captures);
    if open.contains(&own) || open.len() != 1 {
        return own;
    }
    open.iter().next().copied().unwrap_or(own)
}

/// Whether work issued to `stream` is recorded into an open capture (one
/// relaxed load while no capture is open): see [`capturing`].
#[inline]
pub fn captured(stream: *mut c_void, per_thread: bool) -> bool {
    any_open() && capturing(stream, per_thread)
}

/// Whether work issued to `stream` is being captured (active or
/// invalidated: either way it does not run now). A stream the driver
/// cannot answer for (the legacy stream beside a blocking capture) is not.
pub fn capturing(stream: *mut c_void, per_thread: bool) -> bool {
    let mut status = STATUS_NONE;
    // SAFETY: the program's stream handle and an out-pointer to a local.
    let r = unsafe { driver::stream_is_capturing(stream, per_thread, &mut status) };
    r == CUDA_SUCCESS && status != STATUS_NONE
}

/// The stream of a `CUlaunchConfig` (its leading fields).
#[repr(C)]
struct LaunchConfigHead {
    grid: [u32; 3],
    block: [u32; 3],
    shared_mem_bytes: u32,
    stream: *mut c_void,
}

/// The stream a `cuLaunchKernelEx` config names (null: none readable).
pub fn config_stream(config: *const c_void) -> *mut c_void {
    if config.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: a non-null `CUlaunchConfig` from the program, whose leading
    // fields are these (cuda.h).
    unsafe { (*(config as *const LaunchConfigHead)).stream }
}
