//! The idle watcher: gives tokens back when the process stops using the
//! device, or when only waits hold one, for work that waits on another
//! process (see `Settle::Stalled`).

use super::*;

/// How long past the predicted end of its work a wait holds a token
/// before it counts as stalled (or the idle threshold, if shorter): the
/// prediction leans long, so a wait this much longer waits for something
/// else than this process's launches. Also how long a token's end waits
/// for the launches admitted under it to reach the driver (`End::RanOut`):
/// a launch call in the driver that long is blocked on a full queue.
pub(super) const STALL_NS: u64 = 1_000_000;

/// Whether `g`'s token is held by waits alone, for work that should
/// have ended `idle` ago (see [`Settle::Stalled`]). Only once the device
/// time per launch is known: until then a long kernel's wait looks the
/// same.
pub(super) fn stalled(g: &Gate, now: u64, idle: u64) -> bool {
    g.in_flight().only_waits() && overdue(g, now, idle)
}

/// Whether `g`'s token's work should have ended `idle` ago (its predicted
/// end, or its grant): the time half of [`stalled`].
pub(super) fn overdue(g: &Gate, now: u64, idle: u64) -> bool {
    let granted_at = g.granted_at.load(Ordering::Acquire);
    if granted_at == 0 || g.kernel_hi_ns.load(Ordering::Relaxed) == 0 {
        return false;
    }
    let expected_end = g.queued_end.load(Ordering::Relaxed).max(granted_at);
    now >= expected_end + idle
}

/// Gives back a token [`stalled`] waits hold, accounted to now: the
/// waits go on without it, and the next launch asks for a new one.
#[cold]
fn give_back_stalled(st: &'static State, dev: usize, g: &'static Gate) {
    let Ok(slow) = g.slow.try_lock() else {
        return;
    };
    if let Outcome::Done = transition(&slow, st, dev, g, Transition::End(End::Stalled)) {
        debug!("device {dev}: waiting for work that waits on another process: token given back");
    }
}

/// A wait proved the work of a token that ends with the step under way
/// (`Gate::last_step`) done, and nothing else is in flight: the token is
/// given back now, between two steps, so the job's ranks stop together
/// (the next launch asks again, and waits for the job's next turn).
#[cold]
pub(super) fn end_step(st: &'static State, dev: usize, g: &'static Gate) {
    let Ok(slow) = g.slow.try_lock() else {
        return; // a launch is taking the slow path: it asks anew
    };
    if let Outcome::Done = transition(&slow, st, dev, g, Transition::End(End::Step)) {
        debug!("device {dev}: the job's turn is over: token given back after the step");
    }
}

/// A quiet process holds a token with work outstanding that no wait of
/// its own proves done (it launched, and did not synchronise): the sync
/// thread waits for that work, and its span closes when it is done (see
/// `measure`), not when the token's end finds it long done. `pending`:
/// the synchronisation asked for, and the launches admitted then.
fn quiet_sync(dev: usize, g: &'static Gate, pending: &mut Option<(u64, u64)>) {
    if let Some((ticket, launches)) = *pending {
        if let Some(done) = syncer::finished(g, ticket) {
            if let Some(done_at) = done {
                g.close(done_at, launches);
            }
            *pending = None;
        }
        return;
    }
    if !g.outstanding()
        || g.granted_at.load(Ordering::Acquire) == 0
        || g.late_ticket.load(Ordering::Acquire) != 0
    {
        return;
    }
    let launches = g.launches();
    let ctx = g.ctx.load(Ordering::Relaxed) as *mut c_void;
    match syncer::sync_within(dev, g, ctx, Duration::ZERO, synchronize_device) {
        Ok(true) => {
            g.close(now_ns(), launches);
        }
        Ok(false) => {}
        Err(ticket) => *pending = Some((ticket, launches)),
    }
}

pub(super) fn start_watcher(st: &'static State) {
    if st.watcher.swap(true, Ordering::AcqRel) {
        return;
    }
    // The process's first token: its tokens go back when it exits.
    super::exit::exit_handler();
    let spawned = std::thread::Builder::new()
        .name("gemini-idle".into())
        .spawn(move || watch(st));
    if spawned.is_err() {
        st.watcher.store(false, Ordering::Release);
    }
}

/// Gives tokens back when the process stops using the device: no call
/// that launches or waits in flight, and none made for `GEMINI_IDLE_MS`.
/// A token that ran out while the process was quiet is given back too, so
/// the scheduler does not keep it reserved until it revokes it.
fn watch(st: &'static State) {
    let idle = st.settings.idle.as_nanos() as u64;
    let tick = Duration::from_nanos((idle / 2).clamp(200_000, 2_000_000));
    // Per gate: calls entered as last seen, and since when unchanged.
    let mut seen: Vec<(u64, u64)> = vec![(0, now_ns()); st.gates.len()];
    // Per gate: the synchronisation asked for while the process was quiet
    // (see `quiet_sync`), and the launches admitted then.
    let mut quiet: Vec<Option<(u64, u64)>> = vec![None; st.gates.len()];
    loop {
        {
            let (m, cv) = &st.kick;
            let mut kicked = lock(m);
            if !*kicked {
                // Woken in time for a token planned ahead, too.
                let wait = ahead::next(st).map_or(tick, |at| {
                    Duration::from_nanos(at.saturating_sub(now_ns())).min(tick)
                });
                kicked = cv
                    .wait_timeout(kicked, wait)
                    .map_or_else(|p| p.into_inner().0, |(k, _)| k);
            }
            *kicked = false;
        }
        if !state::current().is_some_and(|c| std::ptr::eq(c, st)) {
            return; // forked child: this state is not ours any more
        }
        for (dev, g) in st.gates.iter().enumerate() {
            watch_gate(st, dev, g, idle, &mut seen[dev], &mut quiet[dev]);
        }
    }
}

/// One wake-up of the watcher for `g` (ordinal `dev`): late work
/// reported, a grant asked ahead taken, a stalled token given back, a
/// quiet process's work waited for, and an idle token given back.
/// `seen`: calls entered as last seen, and since when unchanged;
/// `quiet`: the synchronisation asked for while the process was quiet.
fn watch_gate(
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    idle: u64,
    seen: &mut (u64, u64),
    quiet: &mut Option<(u64, u64)>,
) {
    late::report_done(st, dev, g);
    super::devclock::recalibrate(g);
    let now = now_ns();
    let entered = g.entered.load(Ordering::Acquire);
    if ahead::tick(st, dev, g, now) {
        // A token granted ahead, before the process's return: idle
        // from now if the process does not come back.
        *seen = (entered, now);
        return;
    }
    let busy = g.in_flight().calls != 0;
    if busy && stalled(g, now, idle.min(STALL_NS)) {
        give_back_stalled(st, dev, g);
        return;
    }
    // Quiet since a wait returned, in a process that usually stays
    // quiet after its waits: idle now, not in `idle` from now.
    let wait_exit = g.wait_exit.load(Ordering::Relaxed);
    // (Not a token asked ahead that the process has not used yet.)
    let unused = g.ahead_taken.load(Ordering::Acquire) != 0;
    let predicted = !busy && wait_exit != 0 && g.quiet_after_waits(st) && !unused;
    if !predicted && (busy || entered != seen.0) {
        *seen = (entered, now);
        return;
    }
    let quiet_since = if predicted { wait_exit } else { seen.1 };
    *seen = (entered, quiet_since);
    quiet_sync(dev, g, quiet);
    if g.granted_at.load(Ordering::Acquire) == 0 || (!predicted && now - quiet_since < idle) {
        return;
    }
    let Ok(slow) = g.slow.try_lock() else {
        return;
    };
    let why = End::Idle {
        seen: entered,
        quiet_since,
    };
    if !matches!(
        transition(&slow, st, dev, g, Transition::End(why)),
        Outcome::Done
    ) {
        return;
    }
    // A token asked ahead that the process never used ran
    // nothing, and is charged nothing (it teaches the lead nothing
    // at the process's next launch).
    let unused = g.ahead_taken.swap(0, Ordering::AcqRel) != 0;
    debug!(
        "device {dev}: idle{}",
        if predicted {
            " after its wait"
        } else if unused {
            ", a token asked ahead unused"
        } else {
            ""
        }
    );
    if predicted {
        ahead::plan(st, g, wait_exit);
    }
}
