#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]
//! The wire contract of gemini: every message exchanged between the hook,
//! the holder, the launcher, the CLI and the scheduler, the codec that puts
//! them on the wire, the endpoint they meet at, and the name of every
//! environment variable the parts read.
//!
//! This crate is linked into `libgemhook.so`, which lives inside arbitrary
//! CUDA programs: it must stay small (serde, postcard and the pure-Rust
//! parsers of [`units`]; nothing that starts threads or links system
//! libraries).
//!
//! A frame is a 4-byte header — the magic `GM` and the little-endian
//! protocol version — followed by a postcard-encoded [`Envelope`]. The
//! version is checked before the body is decoded, so two builds always
//! recognise each other's version before reading a byte of the body. Each
//! build speaks its own version and every older one [`legacy`] keeps (the
//! previous release's at least): it reads a frame by its version and
//! answers in that version, and a client speaks an older scheduler's
//! version once it hears it. A version neither side speaks is refused
//! cleanly instead of misread.

pub mod clock;
pub mod codec;
pub mod endpoint;
pub mod env;
pub mod job;
pub mod legacy;
pub mod message;
pub mod roundtrip;
pub mod units;

pub use codec::{
    CodecError, decode_reply, decode_reply_versioned, decode_request, decode_request_versioned,
    encode_reply, encode_reply_as, encode_request, encode_request_as,
};
pub use endpoint::{DEFAULT_IPC_DIR, EndpointError, SCHEDULER_SOCKET, scheduler_endpoint};
pub use message::*;

/// The protocol version this build speaks. Bump it on any change to the
/// messages, keeping the previous version's shape of each message that
/// changed in [`legacy`] (see docs/protocol.md for the rule).
pub const PROTOCOL_VERSION: u16 = 21;

/// The oldest protocol version this build still speaks ([`legacy`]).
/// Peers of a version below it, or above [`PROTOCOL_VERSION`], are
/// refused with [`ErrorKind::ProtocolMismatch`].
pub const OLDEST_PROTOCOL: u16 = 14;

/// This build's gemini release, as peers tell it in their hello.
pub const BUILD: &str = env!("CARGO_PKG_VERSION");

/// Largest request frame the daemon accepts, in bytes. The daemon sets it
/// as the socket's maximum message size, so a hostile peer cannot make it
/// buffer more.
pub const MAX_FRAME_BYTES: usize = 256 * 1024;

/// Largest reply frame a client accepts, in bytes: replies come from the
/// daemon, and a status report grows with the groups and clients (about
/// 20 bytes a group; 20,000 groups went past [`MAX_FRAME_BYTES`]).
pub const MAX_REPLY_BYTES: usize = 64 * 1024 * 1024;
