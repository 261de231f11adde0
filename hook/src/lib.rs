//! `libgemhook.so`: loaded into unmodified CUDA programs with `LD_PRELOAD`,
//! it intercepts the CUDA driver API so that a program's group gets the
//! share of GPU time and the memory that `gem-schd` allows it.
//!
//! Layers, each using only those below it (no module cycles):
//!
//! 1. [`cuda`] (`CUresult` and every result code), [`clock`], [`log`],
//!    [`real`] (the real `dlsym`, libcuda and libnvidia-ml);
//! 2. [`driver`] and [`nvml_lib`]: the real functions the hook calls for
//!    itself;
//! 3. [`state`]: settings from the environment and all per-process data
//!    (the gates, memory, captures, contexts), fork;
//! 4. [`conn`] (the scheduler connection: a `gemini_client::Client`,
//!    shared by threads, re-registering after a scheduler restart),
//!    [`capture`] (stream captures open);
//! 5. [`gpus`]: the scheduler's index of each ordinal, asked once;
//! 6. [`memory`] (allocations reserved against the group's
//!    `MemoryLimit`, the group's view of memory queries), [`graphs`]
//!    (graph launches timed with events);
//!    then [`held`] (the memory the driver keeps for the process itself:
//!    contexts, their limits, modules), which uses [`memory`];
//! 7. [`gate`] (token-gated launches; fast path: an atomic compare),
//!    [`graphmem`] (graph memory nodes), [`nvml`] (NVML's memory queries
//!    in the group's view);
//! 8. [`table`]: the one table of hooked entry points, which drives the
//!    exported symbols, our `dlsym` and our `cuGetProcAddress[_v2]`.
//!
//! Environment: `GEMINI_GROUP_NAME` (unless a group's `Cgroups` places the process), `GEMINI_IPC_DIR`,
//! `GEMINI_LOG`, `GEMINI_CONNECT_TIMEOUT`, `GEMINI_IDLE_MS`.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod capture;
mod clock;
mod conn;
mod covers;
mod cuda;
mod driver;
mod gate;
mod gpus;
mod graphmem;
mod graphs;
mod held;
mod log;
mod memory;
mod nvml;
mod nvml_lib;
mod real;
mod state;
mod syncer;
mod table;

use std::ffi::{CStr, c_char, c_void};

/// The decision half of our `dlsym`: our function for a hooked `cu*`
/// name, or null to let glibc's `dlsym` answer. Runs inside every `dlsym`
/// call of the process (Rust's std's included): it allocates nothing,
/// takes no lock and reads no environment. It also makes sure the real
/// `dlsym` is known before returning null, since the caller jumps to it.
///
/// # Safety
/// `symbol` is null or a NUL-terminated string, as for `dlsym`.
unsafe extern "C" fn gemhook_dlsym_filter(
    _handle: *mut c_void,
    symbol: *const c_char,
) -> *mut c_void {
    real::real_dlsym_addr();
    if symbol.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's contract: a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(symbol) }.to_bytes();
    if name.starts_with(b"cu") {
        return table::lookup(name).unwrap_or(std::ptr::null_mut());
    }
    if name.starts_with(b"nvmlDeviceGet") {
        return nvml::lookup(name).unwrap_or(std::ptr::null_mut());
    }
    std::ptr::null_mut()
}

/// Our `dlsym`. glibc resolves `RTLD_NEXT` relative to the caller's return
/// address, so this must not be an ordinary function that calls the real
/// one (every other library's `dlsym(RTLD_NEXT, …)` would then resolve
/// relative to us). It asks the filter, and either returns its answer or
/// tail-jumps to glibc's `dlsym` with the caller's arguments and return
/// address untouched.
///
/// # Safety
/// As glibc's `dlsym`: a valid handle and a NUL-terminated name.
#[cfg(all(target_arch = "x86_64", not(test)))]
#[unsafe(naked)]
#[unsafe(no_mangle)]
pub unsafe extern "C" fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void {
    core::arch::naked_asm!(
        // On entry rsp is 8 mod 16; two pushes and 8 bytes realign it.
        "push rdi",
        "push rsi",
        "sub rsp, 8",
        "call {filter}",
        "add rsp, 8",
        "pop rsi",
        "pop rdi",
        "test rax, rax",
        "jnz 2f",
        "jmp qword ptr [rip + {real}]",
        "2:",
        "ret",
        filter = sym gemhook_dlsym_filter,
        real = sym real::GEMHOOK_REAL_DLSYM,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dlsym_filter_answers_hooked_cu_and_nvml_names_only() {
        // SAFETY: NUL-terminated names.
        unsafe {
            let ours = gemhook_dlsym_filter(std::ptr::null_mut(), c"cuLaunchKernel".as_ptr());
            assert_eq!(ours, table::lookup(b"cuLaunchKernel").unwrap());
            assert!(gemhook_dlsym_filter(std::ptr::null_mut(), c"cuInit".as_ptr()).is_null());
            let nvml =
                gemhook_dlsym_filter(std::ptr::null_mut(), c"nvmlDeviceGetMemoryInfo_v2".as_ptr());
            assert_eq!(nvml, nvml::lookup(b"nvmlDeviceGetMemoryInfo_v2").unwrap());
            assert!(gemhook_dlsym_filter(std::ptr::null_mut(), c"nvmlInit_v2".as_ptr()).is_null());
            assert!(gemhook_dlsym_filter(std::ptr::null_mut(), c"malloc".as_ptr()).is_null());
            assert!(gemhook_dlsym_filter(std::ptr::null_mut(), std::ptr::null()).is_null());
        }
        assert_ne!(real::real_dlsym_addr(), 0, "glibc's dlsym found");
    }
}
