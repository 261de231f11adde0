//! Diagnostics on stderr. Errors a user must see (no group, unknown
//! group, no scheduler) are printed once each, always; everything else only
//! when `GEMINI_LOG` is set. Never used on the launch fast path.

use std::io::Write as _;
use std::sync::atomic::{AtomicBool, Ordering};

static VERBOSE: AtomicBool = AtomicBool::new(false);

/// Enables verbose logging (from `GEMINI_LOG`).
pub fn set_verbose(on: bool) {
    VERBOSE.store(on, Ordering::Relaxed);
}

/// Whether verbose logging is on.
pub fn verbose() -> bool {
    VERBOSE.load(Ordering::Relaxed)
}

/// Writes one line to fd 2 with a single `write`, so lines of several
/// threads or processes do not interleave.
pub fn line(args: std::fmt::Arguments<'_>) {
    let mut buf = [0u8; 1024];
    let mut cur = std::io::Cursor::new(&mut buf[..]);
    let _ = write!(cur, "gemini[{}]: ", std::process::id());
    let _ = cur.write_fmt(args);
    let mut n = cur.position() as usize;
    if n >= buf.len() {
        n = buf.len() - 1;
    }
    buf[n] = b'\n';
    // SAFETY: writing n + 1 initialised bytes of `buf` to fd 2.
    unsafe { libc::write(2, buf.as_ptr().cast(), n + 1) };
}

/// Verbose-only line, stamped with `CLOCK_MONOTONIC` in ms (the clock of
/// the simulator's busy log, to line the two up).
macro_rules! debug {
    ($($t:tt)*) => {
        if $crate::log::verbose() {
            let ms = $crate::clock::now_ns() as f64 / 1e6;
            $crate::log::line(format_args!("{ms:.3} {}", format_args!($($t)*)));
        }
    };
}

/// Always-printed line.
macro_rules! error {
    ($($t:tt)*) => {
        $crate::log::line(format_args!($($t)*))
    };
}

pub(crate) use {debug, error};
