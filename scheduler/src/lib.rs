//! `gem-schd`, the gemini scheduler: the pure policy core ([`policy`]) and
//! the daemon around it ([`daemon`]), plus the client used by the CLI and
//! the tests ([`client`]).
#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

/// The client side, re-exported for the CLI, the demo and the tests.
pub use gemini_client as client;
pub mod accounting;
pub mod daemon;
pub mod metrics;
pub mod policy;
pub mod status;
pub mod top;
pub mod usage_report;
