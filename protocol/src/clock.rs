//! The clock every part measures device time on: `CLOCK_MONOTONIC`,
//! shared by all the processes of a machine (see [`crate::Span`]). Read
//! through the vDSO: no system call.

/// `CLOCK_MONOTONIC` in nanoseconds.
#[inline]
pub fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `CLOCK_MONOTONIC` in microseconds.
#[inline]
pub fn monotonic_us() -> u64 {
    monotonic_ns() / 1000
}
