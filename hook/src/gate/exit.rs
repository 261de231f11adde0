//! The process exits: its tokens go back with what their work ran.
//!
//! A process that exits holding a token (a program's last step synced,
//! then `exit`) used to leave gem-schd to estimate that token's work
//! when it found the process gone: charged from the grant, but only
//! where no measured span has the time. Two processes exiting together
//! (a job's ranks beside another job's) had their last tokens estimated
//! over each other's time, and the estimate made first kept it. Now each
//! token is given back with its measured spans, as the idle watcher gives
//! back a quiet process's.
//!
//! An exit handler runs while the process's other threads still run:
//! only a token no call holds (none in flight, its slow path free) and
//! whose work is proven done is given back, and its end waits for
//! nothing on the device (`End::Exit`: work still queued at exit, some
//! the hook does not gate, may wait on a peer that is gone, and the
//! context's teardown after this handler must not find the context's
//! lock held by a wait). gem-schd's answers are waited for `EXIT_WAIT`
//! in all, by this thread only, with no new registration (see `conn`),
//! so that a scheduler that does not answer never holds the exit longer;
//! and the connection's lock is only tried for that long: `exit` called
//! from a signal handler can interrupt this very thread while it holds
//! the lock, waiting for the scheduler.
//! Other tokens, and a process killed or one that ends with `_exit` (or
//! that gem-schd forgot, after a restart), are estimated as before.

use super::*;

/// Registers [`at_exit`], once per process (a forked child inherits it,
/// and it acts on the state current then): at the process's first token,
/// after ZeroMQ's library was loaded, so that it runs before that
/// library's own exit handlers (they run last registered first).
pub(super) fn exit_handler() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // SAFETY: registers a plain function that catches its own panics.
        unsafe { libc::atexit(at_exit) };
    });
}

/// The exit handler: gives back each token of the process's current
/// state that nothing holds, with what its work ran, and reports late
/// work that is done.
extern "C" fn at_exit() {
    // A panic must not unwind out of an exit handler.
    let _ = std::panic::catch_unwind(|| {
        let Some(st) = state::current() else {
            return;
        };
        if !st.registered.load(Ordering::Acquire) {
            return;
        }
        crate::conn::exiting();
        for (dev, g) in st.gates.iter().enumerate() {
            give_back(st, dev, g);
        }
    });
    crate::conn::exited();
}

/// Gives back `g`'s token (ordinal `dev`) if nothing holds it and its
/// work is proven done (its spans closed), waiting for nothing on the
/// device (`End::Exit`), else reports its late work if that is done.
fn give_back(st: &'static State, dev: usize, g: &'static Gate) {
    if g.granted_at.load(Ordering::Acquire) == 0 {
        late::report_done(st, dev, g);
        return;
    }
    let entered = g.entered.load(Ordering::Acquire);
    if g.in_flight().calls != 0 || g.outstanding() {
        return;
    }
    let Ok(slow) = g.slow.try_lock() else {
        return;
    };
    let why = End::Exit { seen: entered };
    if let Outcome::Done = transition(&slow, st, dev, g, Transition::End(why)) {
        debug!("device {dev}: the process exits: token given back");
    }
}
