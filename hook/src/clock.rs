//! The clock of the gate and the log: `CLOCK_MONOTONIC` through the vDSO
//! (no syscall), in nanoseconds: the clock the scheduler charges measured
//! device time on.

pub use gemini_protocol::clock::monotonic_ns as now_ns;
