//! A gate's token as a state machine: the phases it goes through, and
//! the one function, [`transition`], that moves it from one to the next.
//! Every grant, every close and every give-back goes through it, under
//! the gate's slow lock, which the caller proves it holds by passing the
//! guard.
//!
//! | phase    | a launch                                    | left by                        |
//! |----------|---------------------------------------------|--------------------------------|
//! | `Free`   | takes the slow path and asks for a token    | `Grant` to `Held`              |
//! | `Held`   | passes while the deadline is ahead and the queue fits (see `admission`); else the slow path | `Close` to `Closed`, `End` to `Free` |
//! | `Closed` | takes the slow path (the deadline is 0)     | `End` to `Free`                |
//!
//! A token ends for one of four reasons ([`End`]): it ran out (or its
//! quota is full) and a launch wants the next one, the process went
//! idle, a job's step ended under a token that ends with the step, or
//! only waits for another process's work hold it. Each end closes the
//! token to new launches by the protocol of `admission` (an end that
//! finds a call in flight it may not end under leaves the token as it
//! was), waits for the token's work within a bound (`settle`), which
//! closes its measured spans, and gives the token back with what it ran:
//! a `ReleaseToken`, or, where a launch wants the next token, the report
//! that goes with its request ([`Renewal`]).

use super::*;
use settle::{Settle, settle, settle_ahead};
use std::sync::MutexGuard;

/// The phase of a gate's token (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Phase {
    /// No token.
    Free,
    /// A token, open to launches until its deadline.
    Held,
    /// A token closed to new launches, not given back yet: its deadline
    /// passed, or a wait announced the end of its work (see `quieting`).
    Closed,
}

impl Gate {
    /// The phase of the token, from the two words the fast path and the
    /// watcher read: granted (`granted_at`), and open (`deadline`).
    pub(crate) fn phase(&self) -> Phase {
        if self.granted_at.load(Ordering::Acquire) == 0 {
            Phase::Free
        } else if now_ns() < self.deadline.load(Ordering::Acquire) {
            Phase::Held
        } else {
            Phase::Closed
        }
    }
}

/// A move of the token from one phase to the next.
pub(super) enum Transition {
    /// `Free` to `Held`: the scheduler granted `grant`, the launch that
    /// asked going first, predicted to take `first` ns (`None`: a token
    /// asked ahead and taken while the process is still quiet), in
    /// `launch_ctx` (null: the calling thread's current context).
    Grant {
        grant: Grant,
        first: Option<u64>,
        launch_ctx: *mut c_void,
    },
    /// `Held` to `Closed`: a wait, the only call in flight, announced the
    /// end of the token's work (see `quieting`): launches from now on ask
    /// again.
    Close,
    /// `Held` or `Closed` to `Free`.
    End(End),
}

/// Why a token ends.
#[derive(Debug, Clone, Copy)]
pub(super) enum End {
    /// A launch found it run out, or its quota filled by the work queued:
    /// it is renewed, and what it ran goes with the request.
    RanOut,
    /// The process has not used the device since `quiet_since`, and
    /// `seen` calls had been counted in when that was last checked: the
    /// token stays if another came in since.
    Idle { seen: u64, quiet_since: u64 },
    /// A wait proved the step's work done under a token that ends with
    /// the step (a job's turn is over), and nothing else is in flight.
    Step,
    /// Only waits hold the token, for work that should have ended long
    /// ago: work that waits on another process (see `Settle::Stalled`).
    Stalled,
    /// The process exits (see `exit`), `seen` calls counted in, none in
    /// flight and its spans closed: the token goes back with what they
    /// ran, waiting for nothing on the device.
    Exit { seen: u64 },
}

/// What a token that ran out leaves for the request of the next: what
/// its work ran, whether some of it is not proven done yet, and where a
/// renewed lent token's queue is predicted to end (ns; 0: none).
#[derive(Debug, Default)]
pub(super) struct Renewal {
    pub(super) report: measure::Report,
    pub(super) queue_end: u64,
}

/// What a transition did.
#[derive(Debug)]
pub(super) enum Outcome {
    /// Done (a grant installed, a token closed or given back).
    Done,
    /// Nothing: the token was not in the phase the transition leaves (a
    /// call came in, the token went meanwhile, the wait is not stalled).
    Unchanged,
    /// The token ran out and ended: ask for the next with this report.
    Renew(Renewal),
}

/// Moves `g`'s token (ordinal `dev`) by `t`. The one place a token is
/// installed, closed or given back; `_slow` is `g.slow`'s guard.
pub(super) fn transition(
    _slow: &MutexGuard<'_, ()>,
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    t: Transition,
) -> Outcome {
    match t {
        Transition::Grant {
            grant,
            first,
            launch_ctx,
        } => {
            install(st, dev, g, grant, first, launch_ctx);
            Outcome::Done
        }
        Transition::Close => {
            // (A token past its deadline is closed already, but a wait may
            // still announce its end.)
            if g.phase() == Phase::Free {
                return Outcome::Unchanged;
            }
            // Only the wait that announces may be in flight: a launch that
            // came in before the swap keeps the token open.
            if !admission::close_for_wait(&g.deadline, &g.entered, &g.exited, &g.waiting_now) {
                return Outcome::Unchanged;
            }
            Outcome::Done
        }
        Transition::End(why) => end(st, dev, g, why),
    }
}

/// [`Transition::End`].
fn end(st: &State, dev: usize, g: &'static Gate, why: End) -> Outcome {
    // A launch renews even with no token (the process's first, or one
    // the watcher gave back meanwhile): it asks, with what ran since.
    if g.phase() == Phase::Free && !matches!(why, End::RanOut) {
        return Outcome::Unchanged;
    }
    if !close(st, g, why) {
        return Outcome::Unchanged;
    }
    // The token's work waited for (within a bound), its spans closed.
    let Some(queue_end) = settle_end(dev, g, why) else {
        return Outcome::Unchanged;
    };
    let mut report = g.take_report();
    if let End::RanOut = why {
        return Outcome::Renew(Renewal { report, queue_end });
    }
    let device = st.physical(dev as u32);
    let ran = measure::sent_ahead(st, device, &mut report);
    let in_flight = report.in_flight;
    debug!(
        "device {dev}: token given back ({why:?}), {} us measured{}",
        measure::total_us(&ran),
        if in_flight {
            ", the work in flight"
        } else {
            ""
        }
    );
    let _ = st.call(
        &Request::ReleaseToken {
            device,
            ran,
            in_flight,
        },
        device,
    );
    Outcome::Done
}

/// Closes `g`'s token to new launches for an end by `why`, by the
/// protocol of `admission`: `false`, the token left as it was, where a
/// call in flight keeps it.
fn close(st: &State, g: &Gate, why: End) -> bool {
    match why {
        // The launch that ran it out waits in the slow path; launches
        // counted in before were admitted under the token, and their work
        // is measured by their spans however late it runs.
        // The launches counted in before were admitted under the token:
        // the end waits (briefly) until they have reached the driver, so
        // that its synchronisation covers their work; one still in the
        // driver past that (a full queue blocks a launch until work
        // drains, or the caller is one of them, two launches of one
        // multi-device call) is reported in flight.
        End::RanOut => {
            // A launch call takes microseconds; one in the driver for
            // as long as a stalled wait (`STALL_NS`) is blocked on a
            // full queue.
            let until = now_ns() + watcher::STALL_NS;
            let _ = admission::close_and_drain(
                &g.deadline,
                &g.entered,
                &g.exited,
                &g.waiting_now,
                || {
                    std::thread::yield_now();
                    now_ns() < until
                },
            );
            true
        }
        End::Idle { seen, .. } | End::Exit { seen } => withdraw(g, seen),
        End::Step => withdraw(g, g.entered.load(Ordering::Acquire)),
        // Only waits may be in flight: `stalled`, checked again after the
        // swap, says so (a launch that slipped in keeps the token).
        End::Stalled => {
            let idle = st.settings.idle.as_nanos() as u64;
            admission::withdraw_from_waits(
                &g.deadline,
                &g.entered,
                &g.exited,
                &g.waiting_now,
                || watcher::overdue(g, now_ns(), idle.min(watcher::STALL_NS)),
            )
        }
    }
}

/// Waits for the work of `g`'s closed token (within a bound), which
/// closes its spans: where a renewed lent token's queue is predicted to
/// end (0: none), or `None` where the token went meanwhile.
fn settle_end(dev: usize, g: &'static Gate, why: End) -> Option<u64> {
    let queue_end = match why {
        // A lent token is renewed while its work still runs (see
        // `settle_ahead`); any other first waits for the work launched
        // under it, so that it is proven done and its time measured.
        End::RanOut => settle_ahead(dev, g, now_ns()).unwrap_or_else(|| {
            settle(dev, g, Settle::RanOut);
            0
        }),
        End::Idle { quiet_since, .. } => {
            if !settle(dev, g, Settle::Idle { quiet_since }) {
                return None;
            }
            0
        }
        End::Step => {
            g.last_step.store(false, Ordering::Relaxed);
            if !settle(dev, g, Settle::StepEnd) {
                return None;
            }
            0
        }
        End::Stalled => {
            if !settle(dev, g, Settle::Stalled) {
                return None;
            }
            0
        }
        // Its work proven done already (no span open): nothing to wait
        // for, and an exiting process must not wait on the device.
        End::Exit { .. } => {
            if g.granted_at.swap(0, Ordering::AcqRel) == 0 {
                return None;
            }
            0
        }
    };
    Some(queue_end)
}

/// Stops launches from using `g`'s token: from now on they take the slow
/// path and wait for the caller, which holds `g.slow`. `false`, the token
/// left as it was, where a call is in flight or one came in since
/// `entered` calls had (it keeps the token after all).
fn withdraw(g: &Gate, entered: u64) -> bool {
    admission::withdraw(&g.deadline, &g.entered, &g.exited, entered)
}

/// A token the scheduler granted.
pub(super) struct Grant {
    pub(super) quota_us: u64,
    pub(super) lent: bool,
    /// It ends with the step under way (see `Gate::last_step`).
    pub(super) last_step: bool,
    /// When it was asked for (ns): from then to the grant none of this
    /// process's work ran, unless a renewed lent token's queue ran on.
    pub(super) asked: u64,
    /// The predicted end of the work a renewed lent token left queued
    /// (ns; 0: none).
    pub(super) queue_end: u64,
    /// When the request it answers was sent (ns; 0: not known; for one
    /// answered as the asking thread waited, later by half a round trip
    /// and a slack, see `gate::ask_next`), and how long gem-schd held it
    /// before granting (the reply's `held_us`).
    pub(super) sent: u64,
    pub(super) held_us: u64,
}

impl Grant {
    /// Where its token counts from, for a grant taken at `taken` with the
    /// round trip `rtt` (ns): the request sent (see [`Grant::sent`]: for a
    /// grant the asking thread waited for, a slack later), held, and half
    /// a round trip each way; `taken` if that is sooner or the request's
    /// time is not known. For a grant asked ahead that is when gem-schd
    /// granted it, as far as this process can tell. A grant that waited
    /// to be taken (asked ahead, and read at the watcher's next wake-up,
    /// up to 2 ms later; or its thread descheduled) has that much less
    /// left, instead of launching into the time gem-schd gives the next
    /// holder (a latency-critical group's).
    pub(super) fn granted(&self, taken: u64, rtt: u64) -> u64 {
        granted_at(self.sent, self.held_us, taken, rtt)
    }
}

/// Where the token of a request sent at `sent` (ns; 0: not known; see
/// [`Grant::sent`]) and held `held_us` before the grant counts from,
/// taken at `taken` with the round trip `rtt` (see [`Grant::granted`]).
pub(super) fn granted_at(sent: u64, held_us: u64, taken: u64, rtt: u64) -> u64 {
    if sent == 0 {
        return taken;
    }
    let at = sent
        .saturating_add(held_us.saturating_mul(1000))
        .saturating_add(rtt / 2);
    taken.min(at)
}

/// [`Transition::Grant`].
fn install(
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    grant: Grant,
    first: Option<u64>,
    launch_ctx: *mut c_void,
) {
    let t = now_ns();
    let granted = grant.granted(t, leads::rtt(st));
    let Grant {
        quota_us,
        lent,
        last_step,
        asked,
        queue_end,
        ..
    } = grant;
    // From the request to the grant none of our work ran (`settle`
    // waited for it): not device time of the launches. A renewed
    // lent token's work ran on meanwhile, until its predicted end.
    g.blocked
        .fetch_add(t.saturating_sub(asked.max(queue_end)), Ordering::Relaxed);
    g.lent.store(lent, Ordering::Relaxed);
    g.last_step.store(last_step, Ordering::Relaxed);
    g.queued_end
        .store(t.max(queue_end) + first.unwrap_or(0), Ordering::Relaxed);
    g.unknown_launches
        .store(u64::from(first.is_some()), Ordering::Relaxed);
    if first.is_some() {
        // A program that never waits is measured over its tokens.
        g.begin_sample(t);
    }
    // The context the launch runs in: the current one, or the
    // stream's (a CUkernel launched with none current).
    let mut ctx = launch_ctx;
    if ctx.is_null() {
        // SAFETY: out-pointer to a local.
        unsafe { driver::ctx_get_current(&mut ctx) };
    }
    if !ctx.is_null() {
        g.ctx.store(ctx as usize, Ordering::Relaxed);
        // A context the hook did not see made (a green context's, say)
        // is waited for at token ends from now on too.
        contexts::context_made(ctx, dev as i32);
    }
    let quota = quota_us * 1000;
    // Work still running from an earlier token: its span ends apart from
    // this token's (see `late`), before any launch under this one.
    let renewed = queue_end != 0;
    if late::close(g) && !renewed {
        // That work has outlasted every prediction: the token
        // admits nothing more (but the launch that asked) until
        // a token's end has seen it done. Else each token would
        // queue its quota on top of a queue that never drains.
        g.queued_end.store(t + quota, Ordering::Relaxed);
    }
    // Stop launching early by the work usually still queued at the
    // end, so the queue drains about when the token ends.
    let early = g.overuse.load(Ordering::Relaxed).min(quota / 2);
    g.quota_end.store(granted + quota, Ordering::Relaxed);
    g.granted_at.store(t, Ordering::Release);
    // (Past already: closed to all but the launch that asked.)
    g.deadline
        .store((granted + quota - early).max(1), Ordering::SeqCst);
    watcher::start_watcher(st);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn grant(sent: u64, held_us: u64) -> Grant {
        Grant {
            quota_us: 2_000,
            lent: true,
            last_step: false,
            asked: sent,
            queue_end: 0,
            sent,
            held_us,
        }
    }

    /// A grant counts from when gem-schd granted it, not from when this
    /// process took it: asked ahead at 10 ms, held 1 ms by gem-schd, a
    /// 200 µs round trip, and taken at 13 ms by the watcher's next
    /// wake-up, it was granted at 11.1 ms, and its 2 ms end at 13.1 ms.
    /// Taken as it comes, it counts from its taking (which is no later).
    #[test]
    fn a_grant_taken_late_counts_from_when_it_was_granted() {
        const MS: u64 = 1_000_000;
        let rtt = 200_000;
        assert_eq!(
            grant(10 * MS, 1_000).granted(13 * MS, rtt),
            11 * MS + 100_000
        );
        assert_eq!(
            grant(10 * MS, 1_000).granted(11 * MS + 50_000, rtt),
            11 * MS + 50_000
        );
        // The request's time unknown: from the taking.
        assert_eq!(grant(0, 1_000).granted(13 * MS, rtt), 13 * MS);
    }
}
