//! `libgemhook.so`: loaded into unmodified CUDA programs with `LD_PRELOAD`,
//! it intercepts the CUDA driver API so that a program's group gets the
//! share of GPU time and the memory that `gem-schd` allows it.
//!
//! Layers, each module using only those of lower layers (no cycles; the
//! test `layers::every_module_uses_only_lower_layers` reads this list):
//!
//! 1. [`cuda`] (`CUresult` and every result code), [`clock`], [`elf`]
//!    (glibc's own `dlsym` and `dlvsym`, from libc's symbol table);
//! 2. [`log`], [`real`] (the real `dlsym`, libcuda and libnvidia-ml);
//! 3. [`driver`] and [`nvml_lib`]: the real functions the hook calls for
//!    itself; [`link`]: the scheduler's socket, in `libgemzmq.so`, loaded
//!    at the first connection;
//! 4. [`state`]: settings from the environment and all per-process data
//!    (the gates, memory, captures, contexts, the synchronisation
//!    threads' slots, event records), fork;
//! 5. [`conn`] (the scheduler connection: a `gemini_client::Client`,
//!    shared by threads, re-registering after a scheduler restart),
//!    [`capture`] (stream captures open), [`gpus`] (the scheduler's index
//!    of each ordinal, asked once), [`nccl`] (the NCCL communicators a
//!    process makes: the job it is a rank of);
//! 6. [`memory`] (allocations reserved against the group's
//!    `MemoryLimit`, the group's view of memory queries), [`graphs`]
//!    (graph launches timed with events), [`covers`] (what a completed
//!    event or synchronisation proves done), [`syncer`] (waiting for a
//!    device's work within a bound, on a thread of its own);
//! 7. [`held`] (the memory the driver keeps for the process itself:
//!    contexts, their limits, modules), [`graphmem`] (graph memory
//!    nodes), [`nvml`] (NVML's queries in the group's view);
//! 8. [`gate`] (token-gated launches; fast path: an atomic compare);
//! 9. [`table`]: the one table of hooked entry points, which drives the
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
mod elf;
mod gate;
mod gpus;
mod graphmem;
mod graphs;
mod held;
mod link;
mod log;
mod memory;
mod nccl;
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
    handle: *mut c_void,
    symbol: *const c_char,
) -> *mut c_void {
    real::real_dlsym_addr();
    if symbol.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlsym's contract: a NUL-terminated name.
    let name = unsafe { CStr::from_ptr(symbol) };
    if name.to_bytes().starts_with(b"ncclCommInit") {
        return nccl::lookup(handle, name).unwrap_or(std::ptr::null_mut());
    }
    hooked(name.to_bytes()).unwrap_or(std::ptr::null_mut())
}

/// Our function for a hooked driver or NVML name.
fn hooked(name: &[u8]) -> Option<*mut c_void> {
    if name.starts_with(b"cu") {
        table::lookup(name)
    } else if name.starts_with(b"nvmlDeviceGet") {
        nvml::lookup(name)
    } else {
        None
    }
}

/// The decision half of our `dlvsym`: our function for a hooked name that
/// glibc's `dlvsym` finds too, else null to let glibc answer. The driver's
/// and NVML's exports are unversioned, and glibc's `dlvsym` does not match
/// an unversioned symbol of an object that has version tables (as
/// `libcuda.so.1` has): a program asking `dlvsym` for a `cu*` name of the
/// driver gets null, with the hook as without it. Where it would get a
/// function (a versioned export of a driver shim), it gets ours, gated, as
/// `dlsym` gives. Every other name (the CUDA runtime asks for glibc's
/// `pthread_getaffinity_np`, `eventfd`, `accept4`...) goes to glibc
/// untouched. Same rules as [`gemhook_dlsym_filter`]: no allocation, no
/// lock.
///
/// # Safety
/// `symbol` and `version` are null or NUL-terminated strings, as for
/// `dlvsym`.
unsafe extern "C" fn gemhook_dlvsym_filter(
    handle: *mut c_void,
    symbol: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    real::real_dlvsym_addr();
    if symbol.is_null() || version.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: dlvsym's contract: a NUL-terminated name.
    let Some(ours) = hooked(unsafe { CStr::from_ptr(symbol) }.to_bytes()) else {
        return std::ptr::null_mut();
    };
    // Would glibc find it? RTLD_NEXT from here would mean "after the
    // hook", not after the caller: look in the global scope instead.
    let scope = if handle == libc::RTLD_NEXT {
        libc::RTLD_DEFAULT
    } else {
        handle
    };
    if real::real_dlvsym(scope, symbol, version).is_null() {
        return std::ptr::null_mut();
    }
    ours
}

/// Exports a function `$name` of up to three pointer-sized arguments that
/// asks `$filter` with the same arguments and either returns its non-null
/// answer or tail-jumps to the address in `$real` with the caller's
/// arguments and return address untouched. glibc's `dlsym`, `dlvsym` and
/// `dlopen` look at their caller's return address (`RTLD_NEXT` is resolved
/// relative to it, and `dlopen` finds the caller's namespace and
/// `$ORIGIN` by it), so they cannot be wrapped by an ordinary function
/// that calls the real one: every other library's `dlsym(RTLD_NEXT, …)`
/// would then resolve relative to the hook. `$filter` resolves `$real`
/// before it returns null; where glibc's function could not be found
/// (`$real` still zero), null is returned rather than a jump to address
/// zero. All three argument registers are kept across the filter,
/// whatever the function's arity.
macro_rules! trampoline {
    ($(#[$doc:meta])* $name:ident($($arg:ident: $ty:ty),+), $filter:path, $real:path) => {
        $(#[$doc])*
        #[cfg(all(target_arch = "x86_64", not(test)))]
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),+) -> *mut c_void {
            core::arch::naked_asm!(
                // On entry rsp is 8 mod 16; three pushes realign it.
                "push rdi",
                "push rsi",
                "push rdx",
                "call {filter}",
                "pop rdx",
                "pop rsi",
                "pop rdi",
                "test rax, rax",
                "jnz 2f",
                // glibc's function, or null where it was not found.
                "mov rax, qword ptr [rip + {real}]",
                "test rax, rax",
                "jz 2f",
                "jmp rax",
                "2:",
                "ret",
                filter = sym $filter,
                real = sym $real,
            )
        }

        $(#[$doc])*
        #[cfg(all(target_arch = "aarch64", not(test)))]
        #[unsafe(naked)]
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($arg: $ty),+) -> *mut c_void {
            core::arch::naked_asm!(
                // A frame record, and the three arguments kept across the
                // call (sp stays 16-byte aligned).
                "stp x29, x30, [sp, #-48]!",
                "mov x29, sp",
                "stp x0, x1, [sp, #16]",
                "str x2, [sp, #32]",
                "bl {filter}",
                "mov x16, x0",
                "ldp x0, x1, [sp, #16]",
                "ldr x2, [sp, #32]",
                "ldp x29, x30, [sp], #48",
                "cbz x16, 2f",
                "mov x0, x16",
                "ret",
                "2:",
                // x30 is the caller's again: the real function sees it
                // (or null is returned where it was not found).
                "adrp x16, {real}",
                "ldr x16, [x16, :lo12:{real}]",
                "cbz x16, 3f",
                "br x16",
                "3:",
                "mov x0, xzr",
                "ret",
                filter = sym $filter,
                real = sym $real,
            )
        }
    };
}

trampoline!(
    /// Our `dlsym`: the hook's function for a hooked name (see
    /// [`gemhook_dlsym_filter`]), else glibc's answer.
    ///
    /// # Safety
    /// As glibc's `dlsym`: a valid handle and a NUL-terminated name.
    dlsym(handle: *mut c_void, symbol: *const c_char),
    gemhook_dlsym_filter,
    real::GEMHOOK_REAL_DLSYM
);

trampoline!(
    /// Our `dlvsym`: the hook's function for a hooked name that glibc
    /// finds too (see [`gemhook_dlvsym_filter`]), else glibc's answer.
    ///
    /// # Safety
    /// As glibc's `dlvsym`: a valid handle and NUL-terminated name and
    /// version.
    dlvsym(handle: *mut c_void, symbol: *const c_char, version: *const c_char),
    gemhook_dlvsym_filter,
    real::GEMHOOK_REAL_DLVSYM
);

trampoline!(
    /// Our `dlopen`: glibc's, after noting a library loaded with
    /// `RTLD_DEEPBIND` (see [`gemhook_dlopen_note`]).
    ///
    /// # Safety
    /// As glibc's `dlopen`: a NUL-terminated file name (or null) and
    /// flags.
    dlopen(file: *mut c_void, mode: *const c_char),
    gemhook_dlopen_note,
    real::GEMHOOK_REAL_DLOPEN
);

/// The note half of our `dlopen`: a library loaded with `RTLD_DEEPBIND`
/// finds its own dependencies' symbols before the hook's, so its direct
/// calls into `libcuda` (and its own `dlsym` of CUDA names, if it carries
/// a copy of the lookup) may bypass the hook, ungated and uncapped: said
/// once per process, with the library's name. Always returns null (the
/// real `dlopen` runs), having made sure it is known.
///
/// # Safety
/// `file` is null or a NUL-terminated string, as for `dlopen`.
unsafe extern "C" fn gemhook_dlopen_note(file: *mut c_void, mode: *const c_char) -> *mut c_void {
    real::real_dlopen_addr();
    let mode = mode as usize as i32;
    if mode & libc::RTLD_DEEPBIND != 0 && !file.is_null() {
        static TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
        if !TOLD.swap(true, std::sync::atomic::Ordering::Relaxed) {
            // SAFETY: dlopen's contract: a NUL-terminated name.
            let name = unsafe { CStr::from_ptr(file.cast::<c_char>()) };
            log::error!(
                "{} is loaded with RTLD_DEEPBIND: its own calls into the CUDA driver may bypass gemini (not gated, not capped); \
                 load it without RTLD_DEEPBIND to have them managed",
                name.to_string_lossy()
            );
        }
    }
    std::ptr::null_mut()
}

/// 1 if a panic unwinds through the hook's frames and is caught, as it
/// is at every entry point (`table.rs`: a panic there becomes
/// `CUDA_ERROR_UNKNOWN`, not the program's abort). The unwinder is linked
/// into the library (see `build.rs`): this proves it finds the library's
/// own frames. For tests and packagers; changes nothing.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub extern "C" fn gemhook_unwinds() -> std::ffi::c_int {
    #[inline(never)]
    fn deep(n: u32) -> u32 {
        if n == 0 {
            // Unwinds without the panic hook: nothing is printed.
            std::panic::resume_unwind(Box::new(()));
        }
        deep(n - 1) + 1
    }
    std::panic::catch_unwind(|| deep(std::hint::black_box(3))).is_err() as std::ffi::c_int
}

#[cfg(test)]
mod layers;

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

    #[test]
    fn dlvsym_filter_lets_glibc_answer_what_glibc_would_not_find_for_a_driver_name() {
        let v = |handle, name: &std::ffi::CStr, version: &std::ffi::CStr| {
            // SAFETY: NUL-terminated names.
            unsafe { gemhook_dlvsym_filter(handle, name.as_ptr(), version.as_ptr()) }
        };
        // glibc's own names go to glibc.
        assert!(v(libc::RTLD_DEFAULT, c"dlsym", c"GLIBC_2.34").is_null());
        // A hooked name that glibc's dlvsym does not find (no libcuda
        // here, and none would match unversioned): glibc answers, null.
        assert!(v(libc::RTLD_DEFAULT, c"cuLaunchKernel", c"GLIBC_2.2.5").is_null());
        assert!(v(libc::RTLD_NEXT, c"cuLaunchKernel", c"GLIBC_2.2.5").is_null());
        // SAFETY: null strings are refused before they are read.
        let none =
            unsafe { gemhook_dlvsym_filter(libc::RTLD_DEFAULT, std::ptr::null(), c"X".as_ptr()) };
        assert!(none.is_null());
        assert_ne!(real::real_dlvsym_addr(), 0, "glibc's dlvsym found");
    }

    #[test]
    fn dlopen_note_lets_the_real_dlopen_answer() {
        // SAFETY: a NUL-terminated name; flags as an integer in the second
        // argument, as the trampoline passes them.
        let r = unsafe {
            gemhook_dlopen_note(
                c"libm.so.6".as_ptr() as *mut c_void,
                libc::RTLD_NOW as usize as *const c_char,
            )
        };
        assert!(r.is_null());
        assert_ne!(real::real_dlopen_addr(), 0, "glibc's dlopen found");
    }
}
