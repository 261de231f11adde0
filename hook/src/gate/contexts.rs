//! The process's contexts: a token's end waits for the work of every
//! context the process has on the device, and forgets those that went.

use super::*;

/// Waits for the work of the context `ctx` (from any thread: the context
/// is pushed and popped around the synchronisation).
fn synchronize(ctx: *mut c_void) {
    // A context the program destroys, releases or resets meanwhile would
    // be used after it went: those calls wait (`context_may_go`).
    let Some(st) = state::current() else { return };
    let _syncing = lock(&st.syncing);
    // Read before the lock, it may have gone since.
    if lock(&st.gone_contexts).contains(&(ctx as usize)) {
        return;
    }
    // SAFETY: `ctx` was current in a thread of this process when the token
    // was taken, and is one the process still has (a context that went is
    // dropped under the same lock); pushing it on this thread and popping
    // it again leaves no trace. A null context falls back to the calling
    // thread's own.
    unsafe {
        if !ctx.is_null() && driver::ctx_push(ctx) == 0 {
            driver::ctx_synchronize();
            let mut popped = std::ptr::null_mut();
            driver::ctx_pop(&mut popped);
        } else {
            driver::ctx_synchronize();
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

/// A context of ordinal `dev` was created (or a primary one retained):
/// a token's end waits for its work too.
pub fn context_made(ctx: *mut c_void, dev: i32) {
    if ctx.is_null() || dev < 0 {
        return;
    }
    let st = state::get();
    lock(&st.gone_contexts).remove(&(ctx as usize));
    let mut contexts = lock(&st.contexts);
    if !contexts.iter().any(|&(c, _)| c == ctx as usize) {
        contexts.push((ctx as usize, dev as u32));
    }
}

/// Runs `call`, which may make a context go (`cuCtxDestroy`, a primary
/// context's release or reset), while the hook synchronises none: a
/// synchronisation of that context on another thread would use it after
/// it went. What the call lets go is dropped ([`context_gone`]) before
/// this returns.
pub fn context_may_go(call: impl FnOnce() -> CUresult) -> CUresult {
    let _syncing = lock(&state::get().syncing);
    call()
}

/// A context went (destroyed, or a primary one released for the last
/// time or reset): no token's end waits for its work any more (the
/// driver fails every call on it).
pub fn context_gone(ctx: *mut c_void) {
    if let Some(st) = state::current() {
        lock(&st.gone_contexts).insert(ctx as usize);
        lock(&st.contexts).retain(|&(c, _)| c != ctx as usize);
        for g in &st.gates {
            let _ = g
                .ctx
                .compare_exchange(ctx as usize, 0, Ordering::AcqRel, Ordering::Relaxed);
        }
    }
}
