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

/// A `cuStreamBeginCapture*` on `stream` returned `r`.
pub fn began(stream: *mut c_void, r: CUresult) -> CUresult {
    if r == CUDA_SUCCESS {
        let st = state::get();
        if lock(&st.captures).insert(stream as usize) {
            st.captures_open.fetch_add(1, Ordering::AcqRel);
        }
        crate::log::debug!("capture begun on stream {stream:?}");
    }
    r
}

/// A `cuStreamEndCapture` on `stream` returned: the capture is over unless
/// the driver says the stream still captures (ended from the wrong
/// thread, for one).
pub fn ended(stream: *mut c_void, per_thread: bool, r: CUresult) -> CUresult {
    let Some(st) = state::current() else { return r };
    if capturing(stream, per_thread) {
        return r;
    }
    if lock(&st.captures).remove(&(stream as usize)) {
        st.captures_open.fetch_sub(1, Ordering::AcqRel);
        crate::log::debug!("capture ended on stream {stream:?} ({r})");
    }
    r
}

/// The origin stream of the capture `stream` takes part in: itself when
/// a capture began on it; else the one capture open, when there is one
/// (a stream that joined it through an event); else `stream`.
pub fn origin(stream: *mut c_void) -> *mut c_void {
    let Some(st) = state::current() else {
        return stream;
    };
    let open = lock(&st.captures);
    if open.contains(&(stream as usize)) || open.len() != 1 {
        return stream;
    }
    open.iter().next().map_or(stream, |&s| s as *mut c_void)
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
