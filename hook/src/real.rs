//! Finding the real driver functions without going through our own
//! exports: glibc's `dlsym` and `dlvsym` (found in libc's symbol table, see
//! [`crate::elf`]), and the driver's handle (`libcuda.so.1`, already loaded
//! by the program — also when it was `dlopen`ed with `RTLD_LOCAL`, which
//! `RTLD_NEXT` cannot see).

use std::ffi::{CStr, c_char, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// glibc's `dlsym`; read by the naked `dlsym` export to tail-jump to it.
pub static GEMHOOK_REAL_DLSYM: AtomicUsize = AtomicUsize::new(0);
/// glibc's `dlvsym`; read by the naked `dlvsym` export to tail-jump to it.
pub static GEMHOOK_REAL_DLVSYM: AtomicUsize = AtomicUsize::new(0);

type DlsymFn = unsafe extern "C" fn(*mut c_void, *const c_char) -> *mut c_void;
type DlvsymFn = unsafe extern "C" fn(*mut c_void, *const c_char, *const c_char) -> *mut c_void;

/// Resolves glibc's function `name` into `slot` once. Allocates nothing,
/// takes no lock (Rust's std calls `dlsym` itself, possibly from inside an
/// allocator or a lock).
fn libc_once(slot: &AtomicUsize, name: &CStr) -> usize {
    let cur = slot.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    let f = crate::elf::libc_function(name);
    slot.store(f, Ordering::Release);
    f
}

/// glibc's `dlsym`, resolved once.
pub fn real_dlsym_addr() -> usize {
    libc_once(&GEMHOOK_REAL_DLSYM, c"dlsym")
}

/// glibc's `dlvsym`, resolved once.
pub fn real_dlvsym_addr() -> usize {
    libc_once(&GEMHOOK_REAL_DLVSYM, c"dlvsym")
}

/// Calls glibc's `dlvsym` (the caller's position, for `RTLD_NEXT`, is the
/// hook's).
pub(crate) fn real_dlvsym(
    handle: *mut c_void,
    name: *const c_char,
    version: *const c_char,
) -> *mut c_void {
    let addr = real_dlvsym_addr();
    if addr == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: `addr` is glibc's dlvsym, whose C signature DlvsymFn is.
    let f: DlvsymFn = unsafe { std::mem::transmute::<usize, DlvsymFn>(addr) };
    // SAFETY: the caller's handle and NUL-terminated strings, as dlvsym's.
    unsafe { f(handle, name, version) }
}

/// glibc's `dlopen`; read by the naked `dlopen` export to tail-jump to it.
pub static GEMHOOK_REAL_DLOPEN: AtomicUsize = AtomicUsize::new(0);

/// Resolves glibc's `dlopen` once (the next one after the hook's).
pub fn real_dlopen_addr() -> usize {
    let cur = GEMHOOK_REAL_DLOPEN.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    let f = real_dlsym(libc::RTLD_NEXT, c"dlopen") as usize;
    GEMHOOK_REAL_DLOPEN.store(f, Ordering::Release);
    f
}

/// Calls the real `dlsym`.
pub(crate) fn real_dlsym(handle: *mut c_void, name: &CStr) -> *mut c_void {
    let addr = real_dlsym_addr();
    if addr == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: `addr` is glibc's dlsym, whose C signature DlsymFn is.
    let f: DlsymFn = unsafe { std::mem::transmute::<usize, DlsymFn>(addr) };
    // SAFETY: a valid handle (or pseudo-handle) and a NUL-terminated name.
    unsafe { f(handle, name.as_ptr()) }
}

/// The driver's handle: the loaded `libcuda.so.1`, or loaded now.
fn driver_handle() -> *mut c_void {
    static HANDLE: AtomicUsize = AtomicUsize::new(0);
    let h = HANDLE.load(Ordering::Acquire);
    if h != 0 {
        return h as *mut c_void;
    }
    // SAFETY: dlopen with a NUL-terminated name; NOLOAD only looks.
    let mut h = unsafe {
        libc::dlopen(
            c"libcuda.so.1".as_ptr(),
            libc::RTLD_NOLOAD | libc::RTLD_LAZY,
        )
    };
    if h.is_null() {
        // SAFETY: as above; the program is calling the driver, so loading
        // it is what it wants.
        h = unsafe { libc::dlopen(c"libcuda.so.1".as_ptr(), libc::RTLD_LAZY) };
    }
    HANDLE.store(h as usize, Ordering::Release);
    h
}

/// The real NVML function `name` (from `libnvidia-ml.so.1`, loaded if the
/// program has not), cached in `slot`; 0 if missing.
pub fn nvml_fn(slot: &AtomicUsize, name: &CStr) -> usize {
    static HANDLE: AtomicUsize = AtomicUsize::new(0);
    let cur = slot.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    let mut h = HANDLE.load(Ordering::Acquire) as *mut c_void;
    if h.is_null() {
        // SAFETY: dlopen with a NUL-terminated name; NOLOAD only looks,
        // and the program is calling NVML, so loading it is what it wants.
        h = unsafe {
            let loaded = libc::dlopen(
                c"libnvidia-ml.so.1".as_ptr(),
                libc::RTLD_NOLOAD | libc::RTLD_LAZY,
            );
            if loaded.is_null() {
                libc::dlopen(c"libnvidia-ml.so.1".as_ptr(), libc::RTLD_LAZY)
            } else {
                loaded
            }
        };
        HANDLE.store(h as usize, Ordering::Release);
    }
    let mut f = if h.is_null() {
        std::ptr::null_mut()
    } else {
        real_dlsym(h, name)
    };
    if f.is_null() {
        f = real_dlsym(libc::RTLD_NEXT, name);
    }
    slot.store(f as usize, Ordering::Release);
    f as usize
}

/// The real driver function `name`, cached in `slot`; 0 if missing.
pub fn real_fn(slot: &AtomicUsize, name: &CStr) -> usize {
    let cur = slot.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    let mut f = real_dlsym(driver_handle(), name);
    if f.is_null() {
        f = real_dlsym(libc::RTLD_NEXT, name);
    }
    slot.store(f as usize, Ordering::Release);
    f as usize
}

/// The driver's own `cuGetProcAddress_v2`, found once (0: none).
fn driver_get_proc() -> usize {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    real_fn(&SLOT, c"cuGetProcAddress_v2")
}

/// The real driver entry point that `cuGetProcAddress(base, version,
/// flags)` hands out (the ABI the version picks, as NVIDIA asks programs
/// to reach entry points), else the exported symbol `name`; cached in
/// `slot`, 0 if neither. A driver may serve its versioned entry points
/// only through `cuGetProcAddress`.
pub fn real_entry(slot: &AtomicUsize, name: &CStr, base: &CStr, version: i32, flags: u64) -> usize {
    let cur = slot.load(Ordering::Acquire);
    if cur != 0 {
        return cur;
    }
    type GetProc = unsafe extern "C" fn(*const c_char, *mut *mut c_void, i32, u64, *mut i32) -> i32;
    let get = driver_get_proc();
    let mut f: *mut c_void = std::ptr::null_mut();
    if get != 0 {
        // SAFETY: cuGetProcAddress_v2's C signature.
        let get: GetProc = unsafe { std::mem::transmute::<usize, GetProc>(get) };
        let mut status = 0;
        // SAFETY: NUL-terminated names and out-pointers to locals.
        if unsafe { get(base.as_ptr(), &mut f, version, flags, &mut status) } != 0 {
            f = std::ptr::null_mut();
        }
    }
    // A driver whose own symbols can be interposed may hand out ours (the
    // same name, exported by this library first): never call ourselves.
    if f.is_null() || in_this_library(f) {
        return real_fn(slot, name);
    }
    slot.store(f as usize, Ordering::Release);
    f as usize
}

/// Whether `f` is a function of this library.
fn in_this_library(f: *mut c_void) -> bool {
    let object = |p: *const c_void| {
        // SAFETY: dladdr only reads the loader's tables; `info` is a local.
        let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        (unsafe { libc::dladdr(p, &mut info) } != 0).then_some(info.dli_fbase as usize)
    };
    let ours = object(in_this_library as *const c_void);
    ours.is_some() && object(f) == ours
}
