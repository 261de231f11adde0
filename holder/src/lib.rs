//! `gem-holder`, the built-in holder client. Not built yet: it arrives with
//! the holder issue. This crate is an empty workspace member; it provides
//! no binary and does nothing.
