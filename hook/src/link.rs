//! The hook's connection to gem-schd is a ZeroMQ socket in
//! `libgemzmq.so`, which it loads from its own directory at its first
//! connection (a [`gemini_client::Link`] over its five functions): a
//! process that never calls CUDA never loads ZeroMQ or the C++ runtime
//! ZeroMQ needs, which cost 0.4 ms of every exec when they were linked
//! into the hook. `libgemzmq.so` carries that runtime (a static
//! libstdc++, private to it): loading the shared one took 0.9-1.4 ms of
//! the first connection of every hooked program without a C++ runtime of
//! its own.

use gemini_client::{ClientError, Link};
use std::ffi::{CStr, CString, c_char, c_int, c_void};

/// The library, as named beside `libgemhook.so`.
pub const LIBRARY: &str = "libgemzmq.so";
/// The version of its functions this build calls (`gemzmq_abi`).
const ABI: u32 = 1;

type Open = unsafe extern "C" fn(*const c_char) -> *mut c_void;
type Send = unsafe extern "C" fn(*mut c_void, *const u8, usize) -> c_int;
type Poll = unsafe extern "C" fn(*mut c_void, i64) -> c_int;
type Recv = unsafe extern "C" fn(*mut c_void, *mut u8, usize) -> i64;
type Close = unsafe extern "C" fn(*mut c_void);
type Abi = unsafe extern "C" fn() -> u32;

/// The library's functions.
#[derive(Clone, Copy)]
struct Functions {
    open: Open,
    send: Send,
    poll: Poll,
    recv: Recv,
    close: Close,
}

/// Where the library is first looked for: beside this one as the loader
/// names it, when that is an absolute path.
fn named_beside(here: *const c_void) -> Option<std::path::PathBuf> {
    // SAFETY: dladdr only reads the loader's tables; `info` is a local.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::dladdr(here, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string it keeps.
    let me = unsafe { CStr::from_ptr(info.dli_fname) }.to_string_lossy();
    let me = std::path::Path::new(me.as_ref());
    me.is_absolute().then(|| me.with_file_name(LIBRARY))
}

/// The file mapped at `addr` in this process (`/proc/self/maps`).
fn mapped_file(addr: usize) -> Option<std::path::PathBuf> {
    let maps = std::fs::read_to_string("/proc/self/maps").ok()?;
    maps.lines().find_map(|line| {
        let mut f = line.split_whitespace();
        let (lo, hi) = f.next()?.split_once('-')?;
        let (lo, hi) = (
            usize::from_str_radix(lo, 16).ok()?,
            usize::from_str_radix(hi, 16).ok()?,
        );
        let path = f.nth(4)?;
        ((lo..hi).contains(&addr) && path.starts_with('/')).then(|| path.into())
    })
}

/// The library's functions, loaded once (kept for the process; a
/// failure is tried again at the next connection). No lock is held while
/// the library loads: the loader's own lock, which a library's
/// initialiser calling CUDA holds, must never wait on one of the hook's.
/// Two threads may load it at once: `dlopen` counts the second.
fn functions() -> Result<Functions, String> {
    use std::sync::atomic::{AtomicPtr, Ordering};
    static LOADED: AtomicPtr<Functions> = AtomicPtr::new(std::ptr::null_mut());
    let cur = LOADED.load(Ordering::Acquire);
    if !cur.is_null() {
        // SAFETY: set below from a leaked Box, never freed.
        return Ok(unsafe { *cur });
    }
    let f = load()?;
    let leaked = Box::into_raw(Box::new(f));
    if LOADED
        .compare_exchange(
            std::ptr::null_mut(),
            leaked,
            Ordering::AcqRel,
            Ordering::Acquire,
        )
        .is_err()
    {
        // SAFETY: `leaked` was never shared.
        drop(unsafe { Box::from_raw(leaked) });
    }
    Ok(f)
}

/// Loads the library now, if it is not yet (see [`functions`]): called
/// before the connection's locks are taken. A failure is reported when
/// the connection is made.
pub fn load_early() {
    let _ = functions();
}

/// Loads the library from beside this one as the loader names it, else
/// (a path relative to a directory the program has left, or a symbolic
/// link) from beside the file the process has mapped (`/proc/self/maps`:
/// absolute, links resolved). The map is read only then: the kernel
/// writes it a line per mapping, 0.3 ms per thousand on the test VM
/// (0.85-1.25 ms for 3000), and a program that loaded many libraries (a
/// PyTorch program's hundreds) has thousands.
fn load() -> Result<Functions, String> {
    let here = load as *const c_void;
    let mut tried = Vec::new();
    let named = named_beside(here);
    if let Some(path) = &named {
        match open_at(path) {
            Ok(f) => return Ok(f),
            Err(e) => tried.push(e),
        }
    }
    let mapped = mapped_file(here as usize).map(|m| m.with_file_name(LIBRARY));
    if let Some(path) = mapped.filter(|p| named.as_ref() != Some(p)) {
        match open_at(&path) {
            Ok(f) => return Ok(f),
            Err(e) => tried.push(e),
        }
    }
    if tried.is_empty() {
        tried.push(format!(
            "cannot tell where libgemhook.so was loaded from, to load {LIBRARY} beside it"
        ));
    }
    Err(tried.join("; "))
}

/// The library's functions from `path`, or why not.
fn open_at(path: &std::path::Path) -> Result<Functions, String> {
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen with a NUL-terminated path; the library runs no
    // code of the program's, only ZeroMQ's and Rust's initialisers. No
    // lock of the hook's is held (see `functions`).
    let h = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
    if h.is_null() {
        // SAFETY: dlerror returns a NUL-terminated string or null.
        let why = unsafe { libc::dlerror() };
        let why = if why.is_null() {
            String::from("unknown error")
        } else {
            // SAFETY: as above.
            unsafe { CStr::from_ptr(why) }
                .to_string_lossy()
                .into_owned()
        };
        return Err(format!(
            "cannot load {}: {why} (the hook's ZeroMQ socket: install it beside libgemhook.so, of the same build)",
            path.display()
        ));
    }
    let find = |name: &CStr| {
        let f = crate::real::real_dlsym(h, name);
        if f.is_null() {
            Err(format!("{} has no {name:?}", path.display()))
        } else {
            Ok(f)
        }
    };
    // SAFETY: each symbol is the library's function of the signature
    // named (lib.rs of gemini-zmqlink, checked by its ABI version).
    unsafe {
        let abi: Abi = std::mem::transmute::<*mut c_void, Abi>(find(c"gemzmq_abi")?);
        if abi() != ABI {
            return Err(format!(
                "{} is of another build of gemini (its functions are version {}, this hook calls version {ABI}); install libgemhook.so and libgemzmq.so of one build",
                path.display(),
                abi()
            ));
        }
        Ok(Functions {
            open: std::mem::transmute::<*mut c_void, Open>(find(c"gemzmq_open")?),
            send: std::mem::transmute::<*mut c_void, Send>(find(c"gemzmq_send")?),
            poll: std::mem::transmute::<*mut c_void, Poll>(find(c"gemzmq_poll")?),
            recv: std::mem::transmute::<*mut c_void, Recv>(find(c"gemzmq_recv")?),
            close: std::mem::transmute::<*mut c_void, Close>(find(c"gemzmq_close")?),
        })
    }
}

/// A socket of the library's, and the buffer frames are read into.
struct ZmqLink {
    f: Functions,
    handle: *mut c_void,
    buf: Vec<u8>,
}

// SAFETY: the library's socket is used by one thread at a time (the
// hook's connection is behind a lock); ZeroMQ allows a socket to move
// between threads so.
unsafe impl std::marker::Send for ZmqLink {}

impl Drop for ZmqLink {
    fn drop(&mut self) {
        // SAFETY: the handle came from `open` and is not used again.
        unsafe { (self.f.close)(self.handle) };
    }
}

impl Link for ZmqLink {
    fn send(&mut self, frame: &[u8]) -> Result<(), ClientError> {
        // SAFETY: our handle, and `frame`'s bytes.
        match unsafe { (self.f.send)(self.handle, frame.as_ptr(), frame.len()) } {
            0 => Ok(()),
            _ => Err(ClientError::Link("cannot send to the scheduler".into())),
        }
    }

    fn readable(&mut self, ms: i64) -> Result<bool, ClientError> {
        // SAFETY: our handle.
        match unsafe { (self.f.poll)(self.handle, ms) } {
            0 => Ok(false),
            1 => Ok(true),
            _ => Err(ClientError::Link(
                "cannot poll the scheduler's socket".into(),
            )),
        }
    }

    fn try_recv(&mut self) -> Option<Vec<u8>> {
        loop {
            let buf = &mut self.buf;
            // SAFETY: our handle, and `buf`'s room (its length).
            let n = unsafe { (self.f.recv)(self.handle, buf.as_mut_ptr(), buf.len()) };
            match n {
                -1 => return None,
                n if n >= 0 => return Some(buf[..n as usize].to_vec()),
                // A longer frame waits for a buffer its size.
                n => buf.resize((-(n + 2)) as usize, 0),
            }
        }
    }
}

/// A connection to the scheduler at `endpoint` through the library.
pub fn connect(endpoint: &str) -> Result<Box<dyn Link>, ClientError> {
    let f = functions().map_err(ClientError::Link)?;
    let c = CString::new(endpoint).map_err(|e| ClientError::Link(e.to_string()))?;
    // SAFETY: a NUL-terminated endpoint.
    let handle = unsafe { (f.open)(c.as_ptr()) };
    if handle.is_null() {
        return Err(ClientError::Connect {
            endpoint: endpoint.into(),
            reason: "the socket could not be made".into(),
        });
    }
    Ok(Box::new(ZmqLink {
        f,
        handle,
        buf: vec![0; 64 * 1024],
    }))
}

/// A client of the scheduler listening in `ipc_dir`, over the library
/// (as `Client::connect` is over ZeroMQ linked in).
pub fn client(ipc_dir: &std::path::Path) -> Result<gemini_client::Client, ClientError> {
    gemini_client::Client::connect_with(ipc_dir, connect)
}
