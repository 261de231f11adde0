//! `fakecuda`: a CUDA driver simulator, installed by the tests as
//! `libcuda.so.1` (and `libcuda.so`) in a directory put on
//! `LD_LIBRARY_PATH`. It has the real driver's C signatures, result codes
//! and versioned names, and behaves like a device: launches are
//! asynchronous and queue on a timeline shared by every process using the
//! device, synchronisation waits for it, memory is finite and shared, and
//! every kernel's busy interval is logged with its pid (see
//! `fakecuda-log`). Device settings: see [`device`].
//!
//! Kernel durations come from the function's name:
//! - `fake_spin`: the first kernel parameter, a `u64`, is the duration in
//!   microseconds;
//! - `fixed_<N>us` (e.g. `fixed_500us`): N microseconds;
//! - `gemini_spin` (the holder's kernel): the first parameter, a `u64`,
//!   in nanoseconds;
//! - `fake_allreduce`: a collective, which ends only once every rank of
//!   its communicator has launched its own (see [`collective`]);
//! - any other name: `FAKECUDA_KERNEL_US` microseconds (default 100).
//!
//! `FAKECUDA_LAUNCH_STALL=N:US` makes every Nth kernel launch of a
//! process take US microseconds before its work is queued (a launch whose
//! thread the host descheduled).
//!
//! The library also answers the few NVML calls the holder makes
//! ([`nvml`]), so it can be installed as `libnvidia-ml.so.1` too, and the
//! NCCL calls that make a communicator ([`nccl`]), as `libnccl.so.2`.
//!
//! A graph's duration is the sum of its kernel nodes'. Copies and memsets
//! take no device time. Device memory has no backing store: copies from
//! it read zeros.
//!
//! A process is initialised by `cuInit`; a forked child starts
//! uninitialised, with no contexts, and must call `cuInit` again.
//!
//! A context that is gone (destroyed, a primary context released for the
//! last time or reset) fails every call that uses it, or an event made in
//! it, with `CUDA_ERROR_INVALID_CONTEXT`, and each such call is logged to
//! `dead-context.log` in `FAKECUDA_DIR` (`pid entry-point context`), so
//! that a test can tell that nothing used a context after it went. A
//! primary context retained again is made anew (the same handle).

#![allow(non_snake_case, clippy::missing_safety_doc)]

pub mod capture;
pub mod collective;
pub mod device;
#[cfg(test)]
mod driver_mem_tests;
#[cfg(test)]
mod driver_tests;
pub mod graphmem;
pub mod nccl;
pub mod nvml;
pub mod pool;
pub mod procaddr;
pub mod types;

use device::{MAX_DEVICES, Sim, sim};
use fakecuda_log::{Kind, now_ns};
use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::{CStr, c_char, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use types::*;

type R = Result<(), CUresult>;

thread_local! {
    /// The entry point this thread is in (for the log of calls on
    /// destroyed contexts).
    static CALL: std::cell::Cell<&'static str> = const { std::cell::Cell::new("") };
}

fn guard(f: impl FnOnce() -> R) -> CUresult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => CUDA_SUCCESS,
        Ok(Err(e)) => e,
        Err(_) => CUDA_ERROR_UNKNOWN,
    }
}

/// Writes `v` through an out-pointer the program passed.
fn put<T>(p: *mut T, v: T) -> R {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the driver API contract makes the caller pass
    // a pointer to writable storage of the right type.
    unsafe { p.write(v) };
    Ok(())
}

/// Reads a value through a pointer the program passed.
fn get<T: Copy>(p: *const T) -> Result<T, CUresult> {
    if p.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller passes a readable `T` by contract.
    Ok(unsafe { p.read() })
}

#[derive(Debug, Clone)]
enum Func {
    /// First parameter: microseconds.
    Spin,
    /// First parameter: nanoseconds (the holder's `gemini_spin`).
    SpinNs,
    Fixed(u64),
    /// `fake_allreduce`: see [`collective`].
    Collective,
}

#[derive(Debug)]
enum Obj {
    Ctx {
        device: usize,
    },
    /// `blocking`: not created `CU_STREAM_NON_BLOCKING` (it synchronises
    /// with the legacy stream); `ctx`: the context it belongs to.
    Stream {
        device: usize,
        tail: Arc<AtomicU64>,
        blocking: bool,
        ctx: usize,
    },
    /// `captured`: last recorded in the open capture of that id;
    /// `timing`: created without `CU_EVENT_DISABLE_TIMING`.
    Event {
        time: Option<u64>,
        captured: Option<u64>,
        timing: bool,
    },
    Module,
    Function(Func),
    /// A library (`cuLibraryLoadData`): context-independent code.
    Library,
    /// A `CUkernel` of a library: launched in the context of its stream
    /// (or the current one), none need be current.
    Kernel(Func),
    Graph {
        nodes: Vec<u64>,
        allocs: Vec<graphmem::AllocNode>,
    },
    Exec {
        total: u64,
        allocs: Vec<graphmem::AllocNode>,
        auto_free: bool,
    },
    /// A `cuMemCreate` handle.
    Pool,
    /// A memory pool (its state in `Proc::pools`).
    MemPool,
    /// A resource descriptor (`cuDevResourceGenerateDesc`) of a share of
    /// a device's SMs. A green context made from it runs its kernels as
    /// long as any other (the simulator models no SMs), and holds no
    /// memory of its own.
    ResourceDesc,
    /// A green context (`cuGreenCtxCreate`), used through the context
    /// `ctx` (`cuCtxFromGreenCtx`), which goes with it.
    Green {
        ctx: usize,
    },
}

macro_rules! driver_api {
    ($( fn $name:ident ( $($arg:ident : $ty:ty),* $(,)? ) $body:block )*) => {
        /// The entry points as `cuGetProcAddress` hands them out.
        mod served {
            #[allow(unused_imports)]
            use super::*;
            $(
                pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                    CALL.with(|c| c.set(stringify!($name)));
                    guard(move || -> R { $body })
                }
            )*
        }

        $(
            /// The exported symbol: with `FAKECUDA_PROCADDR_ONLY=1`, a
            /// versioned one answers `CUDA_ERROR_NOT_FOUND` (see
            /// [`crate::procaddr::served_only`]).
            #[unsafe(no_mangle)]
            pub unsafe extern "C" fn $name($($arg: $ty),*) -> CUresult {
                if crate::procaddr::served_only(stringify!($name)) {
                    return CUDA_ERROR_NOT_FOUND;
                }
                // SAFETY: the caller's arguments, passed on unchanged.
                unsafe { served::$name($($arg),*) }
            }
        )*

        /// The entry point called `name`, as `cuGetProcAddress` gives it:
        /// a function of the driver's own, as the real driver hands out
        /// its internal functions. (Its exported symbol's address would
        /// be read through the library's GOT, where a preloaded library
        /// exporting the same name takes its place: a program would reach
        /// the hook however it found `cuGetProcAddress`, which the real
        /// driver never does.)
        pub fn lookup(name: &str) -> Option<*mut c_void> {
            match name {
                $( stringify!($name) => Some(served::$name as *const () as *mut c_void), )*
                _ => None,
            }
        }

        /// The name of an entry point [`lookup`] handed out (a
        /// NUL-terminated string).
        pub(crate) fn name_of(f: *mut c_void) -> Option<&'static str> {
            $( if f == served::$name as *const () as *mut c_void {
                return Some(concat!(stringify!($name), "\0"));
            } )*
            None
        }
    };
}

mod api_device;
mod api_memory;
mod context;
mod graphs;
mod memory;
mod process;
mod work;

pub use api_device::*;
pub use api_memory::*;
use context::*;
use graphs::*;
use memory::*;
use process::*;
use work::*;

/// The entry point called `name`, as `cuGetProcAddress` hands it out.
pub fn lookup(name: &str) -> Option<*mut c_void> {
    api_device::lookup(name).or_else(|| api_memory::lookup(name))
}

/// For the tests: the name of an entry point `cuGetProcAddress` handed out
/// (a NUL-terminated string), or null for any other address.
#[unsafe(no_mangle)]
pub extern "C" fn fakecuda_entry_name(f: *mut c_void) -> *const c_char {
    api_device::name_of(f)
        .or_else(|| api_memory::name_of(f))
        .map_or(std::ptr::null(), |n| n.as_ptr().cast())
}

fn config_ref<'a>(c: *const CUlaunchConfig) -> Result<&'a CUlaunchConfig, CUresult> {
    if c.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: non-null; the caller passes a valid config by contract.
    Ok(unsafe { &*c })
}

/// Device memory has no contents: copies from it read zeros.
fn zero(dst: *mut c_void, n: usize) -> R {
    if n == 0 {
        return Ok(());
    }
    if dst.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: the caller's host buffer holds `n` bytes by contract.
    unsafe { std::ptr::write_bytes(dst as *mut u8, 0, n) };
    Ok(())
}
