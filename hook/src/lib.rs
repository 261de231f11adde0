//! `libgemhook.so`, the LD_PRELOAD library that intercepts the CUDA driver
//! API. Not built yet: it arrives with the hook issue. This crate is an
//! empty workspace member so the layout of DESIGN.md is in place; it
//! exports nothing and intercepts nothing.
