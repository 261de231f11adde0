//! The process's contexts: a token's end waits for the work of every
//! context the process has on the device, and forgets those that went.
//!
//! Each context has a lock of its own, held while the hook synchronises
//! it and while the program makes it go (`cuCtxDestroy`, a primary
//! context's release or reset): a synchronisation never uses a context
//! that went, and waiting for one GPU's work (an NCCL collective waiting
//! for its peer) holds up neither the other GPUs' token ends nor the
//! program's calls on other contexts.

use super::*;
use std::sync::{Arc, Mutex};

/// The lock of context `ctx`, made on first use.
fn ctx_lock(st: &State, ctx: usize) -> Arc<Mutex<()>> {
    lock(&st.syncing).entry(ctx).or_default().clone()
}

/// Whether `ctx` is a context the process has (made, retained, or seen
/// current at a token; not one that went).
fn alive(st: &State, ctx: usize) -> bool {
    lock(&st.contexts).iter().any(|&(c, _)| c == ctx)
}

/// Waits for the work of the context `ctx` (from any thread: the context
/// is pushed and popped around the synchronisation).
fn synchronize(ctx: *mut c_void) {
    let Some(st) = state::current() else { return };
    if ctx.is_null() {
        // SAFETY: the calling thread's own context, if any.
        unsafe { driver::ctx_synchronize() };
        return;
    }
    let one = ctx_lock(st, ctx as usize);
    let _syncing = lock(&one);
    // `ctx` was read before the lock: it may have gone since (its call
    // held this lock, and dropped it from the list).
    if !alive(st, ctx as usize) {
        let mut locks = lock(&st.syncing);
        if locks
            .get(&(ctx as usize))
            .is_some_and(|l| Arc::ptr_eq(l, &one))
        {
            locks.remove(&(ctx as usize));
        }
        return;
    }
    // SAFETY: `ctx` is one the process still has: a context that goes
    // goes under this lock. Pushing it on this thread and popping it again
    // leaves no trace.
    unsafe {
        if driver::ctx_push(ctx) == 0 {
            driver::ctx_synchronize();
            let mut popped = std::ptr::null_mut();
            driver::ctx_pop(&mut popped);
        }
    }
}

/// Waits for the process's work on ordinal `dev`: in `ctx` (the one the
/// token was taken in) and in every other context the process has there
/// (a context synchronises only its own work).
pub(crate) fn synchronize_device(dev: usize, ctx: *mut c_void) {
    synchronize(ctx);
    let others: Vec<usize> = state::current().map_or_else(Vec::new, |st| {
        lock(&st.contexts)
            .iter()
            .filter(|&&(c, d)| d as usize == dev && c != ctx as usize)
            .map(|&(c, _)| c)
            .collect()
    });
    for c in others {
        synchronize(c as *mut c_void);
    }
}

/// A context of ordinal `dev` was created (or a primary one retained, or
/// one was seen current at a token): a token's end waits for its work
/// too.
pub fn context_made(ctx: *mut c_void, dev: i32) {
    if ctx.is_null() || dev < 0 {
        return;
    }
    let mut contexts = lock(&state::get().contexts);
    if !contexts.iter().any(|&(c, _)| c == ctx as usize) {
        contexts.push((ctx as usize, dev as u32));
    }
}

/// Runs `call`, which may make `ctx` go (`cuCtxDestroy`), or, with `ctx`
/// null, the primary context of ordinal `dev` (its release or reset),
/// while the hook synchronises none of the contexts it may take: a
/// synchronisation on another thread would use them after they went.
/// What the call lets go is dropped ([`context_gone`]) before this
/// returns. Other contexts' synchronisations go on meanwhile.
pub fn context_may_go(ctx: *mut c_void, dev: i32, call: impl FnOnce() -> CUresult) -> CUresult {
    let st = state::get();
    let mut which: Vec<usize> = if ctx.is_null() {
        lock(&st.contexts)
            .iter()
            .filter(|&&(_, d)| i64::from(d) == i64::from(dev))
            .map(|&(c, _)| c)
            .collect()
    } else {
        vec![ctx as usize]
    };
    // Always in the same order: two such calls never wait on each other
    // crosswise (a synchronisation holds one lock at a time).
    which.sort_unstable();
    let locks: Vec<Arc<Mutex<()>>> = which.iter().map(|&c| ctx_lock(st, c)).collect();
    let _held: Vec<_> = locks.iter().map(|l| lock(l)).collect();
    // Nothing of the device's clock is used on them from here on (the
    // watcher's calibrations and placements; see `devclock`).
    for g in &st.gates {
        for &c in &which {
            super::devclock::context_going(g, c);
        }
    }
    call()
}

/// A context went (destroyed, or a primary one released for the last
/// time or reset): no token's end waits for its work any more (the
/// driver fails every call on it). Called under its lock
/// ([`context_may_go`]).
pub fn context_gone(ctx: *mut c_void) {
    if let Some(st) = state::current() {
        lock(&st.contexts).retain(|&(c, _)| c != ctx as usize);
        lock(&st.syncing).remove(&(ctx as usize));
        for g in &st.gates {
            let _ = g
                .ctx
                .compare_exchange(ctx as usize, 0, Ordering::AcqRel, Ordering::Relaxed);
            super::devclock::context_gone(g, ctx as usize);
        }
    }
}
