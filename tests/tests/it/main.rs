//! The integration tests, one binary with one harness
//! ([`gemini_tests::Gemini`]: a simulated machine with `gem-schd` on a
//! private IPC directory): each module runs the real binaries together.
//! Run one module with `cargo test -p gemini-tests --test it -- hook::`.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod aarch64;
mod collective;
mod cuda_header;
mod cuda_python;
mod daemon;
mod demo;
mod faults;
mod gpu_suite;
mod holder;
mod hook;
mod hostile;
mod latency;
mod launch;
mod memory;
mod metrics;
mod procaddr;
mod setup;
mod shapes;
mod simulator;
mod slurm;
mod top;
