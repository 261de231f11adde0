#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]
//! A client of `gem-schd`, for every part that talks to it: the hook, the
//! holder, `gem-launch`, `gem-slurm` and the scheduler's own CLI.
//!
//! - [`Client`]: one connection (a ZeroMQ DEALER socket, or another
//!   [`Link`]): requests carry sequence numbers, several may be
//!   outstanding, and a reply to another request is kept until it is
//!   asked for.
//! - [`Session`]: a [`Client`] that has said hello as a role and group,
//!   and says it again (with the memory it holds) when a restarted
//!   scheduler does not know it.
//!
//! Small on purpose (protocol, zmq): it is linked into `libgemhook.so`,
//! inside arbitrary CUDA programs, which uses it over a [`Link`] of its
//! own (ZeroMQ in `libgemzmq.so`, loaded at the first connection), so
//! that ZeroMQ's code is not linked into the hook.

mod client;
mod session;

pub use client::{Client, ClientError, Link, reload};
pub use session::{Session, hello};
