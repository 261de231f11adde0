//! `libgemzmq.so`: the ZeroMQ DEALER socket `libgemhook.so` talks to
//! gem-schd over, behind five C functions. The hook loads it (from its own
//! directory) at its first connection to the scheduler, so that a process
//! that never calls CUDA — a shell command, a data loader's worker, any
//! process under `/etc/ld.so.preload` — does not load ZeroMQ and the C++
//! runtime it needs (0.4 ms of every exec, measured).
//!
//! The C++ runtime is linked in (`CXXSTDLIB_STATIC` in
//! .cargo/config.toml): loading the shared `libstdc++.so.6` took 0.9-1.4 ms
//! of the first connection of every hooked program without a C++ runtime
//! of its own, against 0.29-0.39 ms for this library with it inside, and
//! the library needs no GLIBCXX version an older `libstdc++.so.6` loaded
//! first would lack. The copy is private: the library exports only its
//! own functions (rustc's version script for a `cdylib`) and imports no
//! C++ runtime function, so it meets a program's own runtime (PyTorch's)
//! only through libc and libgcc_s's unwinder.
//!
//! Every function takes the handle [`gemzmq_open`] gave, until
//! [`gemzmq_close`]; none is called for one handle from two threads at
//! once (the hook's connection is behind a lock).

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

use std::ffi::{CStr, c_char, c_int, c_void};

/// The version of these functions: the hook checks it, so that a
/// `libgemzmq.so` of another build is refused, not misused.
pub const ABI: u32 = 1;

/// One socket, and a frame received that did not fit the caller's buffer.
struct Link {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    pending: Option<zmq::Message>,
}

/// [`ABI`].
#[unsafe(no_mangle)]
pub extern "C" fn gemzmq_abi() -> u32 {
    ABI
}

/// A DEALER socket connected to `endpoint` (a NUL-terminated `ipc://`
/// address), with no linger; null on failure.
///
/// # Safety
/// `endpoint` is a valid NUL-terminated string.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gemzmq_open(endpoint: *const c_char) -> *mut c_void {
    if endpoint.is_null() {
        return std::ptr::null_mut();
    }
    // SAFETY: the caller passes a NUL-terminated string.
    let Ok(endpoint) = unsafe { CStr::from_ptr(endpoint) }.to_str() else {
        return std::ptr::null_mut();
    };
    let ctx = zmq::Context::new();
    let open = || -> Result<zmq::Socket, zmq::Error> {
        let sock = ctx.socket(zmq::DEALER)?;
        sock.set_linger(0)?;
        sock.connect(endpoint)?;
        Ok(sock)
    };
    match open() {
        Ok(sock) => Box::into_raw(Box::new(Link {
            _ctx: ctx,
            sock,
            pending: None,
        }))
        .cast(),
        Err(_) => std::ptr::null_mut(),
    }
}

/// The link behind a handle.
///
/// # Safety
/// `h` came from [`gemzmq_open`] and was not closed, and no other thread
/// uses it now.
unsafe fn link<'a>(h: *mut c_void) -> Option<&'a mut Link> {
    // SAFETY: as the caller promises.
    unsafe { h.cast::<Link>().as_mut() }
}

/// Sends `len` bytes at `data` as one frame: 0, or -1 on failure.
///
/// # Safety
/// `h` as for every function here; `data` points to `len` readable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gemzmq_send(h: *mut c_void, data: *const u8, len: usize) -> c_int {
    // SAFETY: as the caller promises.
    let Some(l) = (unsafe { link(h) }) else {
        return -1;
    };
    let frame: &[u8] = if len == 0 {
        &[]
    } else {
        // SAFETY: the caller passes `len` readable bytes at `data`.
        unsafe { std::slice::from_raw_parts(data, len) }
    };
    if l.sock.send(frame, 0).is_ok() { 0 } else { -1 }
}

/// Waits up to `ms` milliseconds (-1: for ever) for a frame to read: 1 if
/// one is, 0 if none came, -1 on failure.
///
/// # Safety
/// `h` as for every function here.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gemzmq_poll(h: *mut c_void, ms: i64) -> c_int {
    // SAFETY: as the caller promises.
    let Some(l) = (unsafe { link(h) }) else {
        return -1;
    };
    if l.pending.is_some() {
        return 1;
    }
    match l.sock.poll(zmq::POLLIN, ms) {
        Ok(0) => 0,
        Ok(_) => 1,
        Err(_) => -1,
    }
}

/// Copies the next frame into `buf` (room for `cap` bytes) without
/// waiting: its length; -1 if none has arrived; or, for a frame longer
/// than `cap`, minus its length less 2 (`-(len + 2)`): it is kept for the
/// next call, with a buffer that large.
///
/// # Safety
/// `h` as for every function here; `buf` points to `cap` writable bytes.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gemzmq_recv(h: *mut c_void, buf: *mut u8, cap: usize) -> i64 {
    // SAFETY: as the caller promises.
    let Some(l) = (unsafe { link(h) }) else {
        return -1;
    };
    let msg = match l.pending.take() {
        Some(m) => m,
        None => match l.sock.recv_msg(zmq::DONTWAIT) {
            Ok(m) => m,
            Err(_) => return -1,
        },
    };
    let len = msg.len();
    if len > cap {
        l.pending = Some(msg);
        return -(len as i64) - 2;
    }
    if len > 0 {
        // SAFETY: `buf` has room for `cap` ≥ `len` bytes, and a frame
        // of ZeroMQ's cannot overlap the caller's buffer.
        unsafe { std::ptr::copy_nonoverlapping(msg.as_ptr(), buf, len) };
    }
    len as i64
}

/// Closes the socket and frees the handle.
///
/// # Safety
/// `h` came from [`gemzmq_open`] and is not used again.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn gemzmq_close(h: *mut c_void) {
    if !h.is_null() {
        // SAFETY: `h` was made by Box::into_raw in gemzmq_open.
        drop(unsafe { Box::from_raw(h.cast::<Link>()) });
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A frame sent through the C functions comes back through them, a
    /// long one in two calls.
    #[test]
    fn frames_go_both_ways_and_a_long_one_waits_for_a_buffer() {
        let dir = std::env::temp_dir().join(format!("gemzmq-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let endpoint = format!("ipc://{}/echo.sock", dir.display());
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router.bind(&endpoint).unwrap();
        let c = std::ffi::CString::new(endpoint).unwrap();
        // SAFETY: a NUL-terminated string; the handle is used by this
        // thread only and closed at the end.
        unsafe {
            let h = gemzmq_open(c.as_ptr());
            assert!(!h.is_null());
            let long = vec![7u8; 1000];
            assert_eq!(gemzmq_send(h, long.as_ptr(), long.len()), 0);
            let frames = router.recv_multipart(0).unwrap();
            assert_eq!(frames[1], long);
            router.send_multipart(frames, 0).unwrap();
            assert_eq!(gemzmq_poll(h, 5000), 1);
            let mut small = [0u8; 16];
            assert_eq!(gemzmq_recv(h, small.as_mut_ptr(), small.len()), -1002);
            let mut buf = vec![0u8; 1000];
            assert_eq!(gemzmq_recv(h, buf.as_mut_ptr(), buf.len()), 1000);
            assert_eq!(buf, long);
            assert_eq!(gemzmq_recv(h, buf.as_mut_ptr(), buf.len()), -1);
            gemzmq_close(h);
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
