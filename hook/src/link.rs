//! The hook's connection to gem-schd is a ZeroMQ socket in
//! `libgemzmq.so`, which it loads from its own directory at its first
//! connection (a [`gemini_client::Link`] over its five functions): a
//! process that never calls CUDA never loads ZeroMQ or the C++ runtime
//! ZeroMQ needs, which cost 0.4 ms of every exec when they were linked
//! into the hook.

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

/// The path of the library beside this one (the object that holds this
/// function, as the loader says).
fn beside_hook() -> Option<std::path::PathBuf> {
    // SAFETY: dladdr only reads the loader's tables; `info` is a local.
    let mut info: libc::Dl_info = unsafe { std::mem::zeroed() };
    let here = beside_hook as *const c_void;
    // SAFETY: as above.
    if unsafe { libc::dladdr(here, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: dladdr's file name is a NUL-terminated string it keeps.
    let me = unsafe { CStr::from_ptr(info.dli_fname) }.to_str().ok()?;
    Some(std::path::Path::new(me).with_file_name(LIBRARY))
}

/// Loads the library once: its functions, or why not.
fn functions() -> Result<Functions, String> {
    static LOADED: std::sync::OnceLock<Result<Functions, String>> = std::sync::OnceLock::new();
    LOADED.get_or_init(load).clone()
}

fn load() -> Result<Functions, String> {
    let path = beside_hook().ok_or("cannot tell where libgemhook.so was loaded from")?;
    let c = CString::new(path.as_os_str().as_encoded_bytes()).map_err(|e| e.to_string())?;
    // SAFETY: dlopen with a NUL-terminated path; the library runs no
    // code of the program's, only ZeroMQ's and Rust's initialisers.
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
        return Err(format!("cannot load {}: {why}", path.display()));
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

/// A socket of the library's.
struct ZmqLink {
    f: Functions,
    handle: *mut c_void,
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
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            // SAFETY: our handle, and `buf`'s room.
            let n = unsafe { (self.f.recv)(self.handle, buf.as_mut_ptr(), buf.len()) };
            match n {
                -1 => return None,
                n if n >= 0 => {
                    buf.truncate(n as usize);
                    return Some(buf);
                }
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
    Ok(Box::new(ZmqLink { f, handle }))
}

/// A client of the scheduler listening in `ipc_dir`, over the library
/// (as `Client::connect` is over ZeroMQ linked in): refused at once where
/// the kernel refuses this user the socket.
pub fn client(ipc_dir: &std::path::Path) -> Result<gemini_client::Client, ClientError> {
    if let Some(path) = gemini_protocol::endpoint::socket_denied(ipc_dir) {
        return Err(ClientError::Denied(
            gemini_protocol::endpoint::denied_message(&path),
        ));
    }
    let endpoint =
        gemini_protocol::scheduler_endpoint(ipc_dir).map_err(|e| ClientError::Connect {
            endpoint: ipc_dir.display().to_string(),
            reason: e.to_string(),
        })?;
    let link = connect(&endpoint)?;
    Ok(gemini_client::Client::with_link(link, endpoint))
}
