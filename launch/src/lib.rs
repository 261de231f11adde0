//! `gem-launch`, the launch wrapper. Not built yet: it arrives with the
//! launcher issue. This crate is an empty workspace member; it provides no
//! binary and does nothing.
