//! The clock of the gate and the log: `CLOCK_MONOTONIC` through the vDSO
//! (no syscall), in nanoseconds.

/// `CLOCK_MONOTONIC` in ns.
#[inline]
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}
