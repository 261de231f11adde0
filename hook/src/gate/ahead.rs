//! Tokens asked for ahead of a process's return. A process that stays
//! quiet after its waits (a decode step, then a sleep until the next
//! request) gives its token back as each wait returns (see `watcher`),
//! and its next step's first launch then waited for a whole token round
//! trip and the wake-ups on both sides: 0.2-0.3 ms of every 1 ms decode
//! step alone on the simulator, 0.3-0.4 ms on an H200 (`gem-bench --only
//! latency`, `make test-gpu`). Instead the idle watcher asks for the next
//! token a lead (`lead`) before the process is predicted to launch again
//! (the end of its wait plus its usual quiet gap, which leans short), and
//! the launch takes the grant that is already there.
//!
//! The scheduler sees an ordinary token request, a little early: it is
//! granted when the device is free or the process's turn comes, as it
//! would be at the launch. A grant that comes while the process is still
//! quiet is taken by the watcher, so it starts and ends like any other
//! token: one the process does not use is given back after the idle
//! threshold, charged the time it was held.

use super::*;

/// How long before the predicted launch the token is asked for, in round
/// trips `r` (see `leads`): at first [`shortest`], then learned (see
/// [`learn`]) between that and [`longest`].
fn lead(g: &Gate, r: u64) -> u64 {
    match g.ahead_lead.load(Ordering::Relaxed) {
        0 => shortest(r),
        lead => within(lead, r),
    }
}

/// `lead` within its bounds for the round trip `r`: [`shortest`] to
/// [`longest`].
fn within(lead: u64, r: u64) -> u64 {
    lead.clamp(shortest(r), longest(r))
}

/// The shortest lead for the round trip `r`: four of them (0.8 ms at 200
/// µs). The lead is also how long before the launch gem-schd hears of it,
/// and stops lending the device to others: what it lent until then must
/// drain by the launch. That is the request's way there (half a round
/// trip), a lent token's shortest (one round trip, as gem-schd lends near
/// a latency-critical group's return) and the one launch its hook admits
/// onto an empty queue, and the wake-ups on both sides. Down to three
/// quarters of a round trip (the grant alone in time), the lead settled
/// at one to two on the 2-core test VM, and a critical decode's slow
/// steps mostly waited for a trainer's 200 µs kernel launched under a
/// token granted before the request came (p99 1.19-1.30× alone; at four,
/// 1.14-1.22×). A normal-class group, which gem-schd counts back at its
/// request, pays for it: the GPU idles for the lead before its launch.
/// The figures, and what else moved: docs/design-decisions.md, "A token
/// asked ahead of a quiet process's return".
fn shortest(r: u64) -> u64 {
    4 * r
}

/// The longest lead for the round trip `r`: five of them (1 ms at 200
/// µs).
fn longest(r: u64) -> u64 {
    5 * r
}

/// A launch that waited longer than this for a grant asked ahead found
/// the request sent too late: a tenth of a round trip (20 µs at 200 µs);
/// less is the jitter of the wake-ups.
fn late(r: u64) -> u64 {
    r / 10
}

/// A launch found the grant of a request sent ahead after waiting
/// `waited` ns for it (0: it was there), at `now`. A late grant that came
/// within twice the lead of the request (the launch waited at most a
/// lead: a grant held that long is as often another group's token as a
/// request sent late) grows the lead by the wait at once, up to
/// [`longest`]. A grant the scheduler held longer says nothing about the
/// lead. One in time shrinks it by a sixteenth, down to [`shortest`], so
/// that it settles where a grant is rarely late, keeping the device
/// reserved for the process as briefly as that allows.
pub(super) fn learn(g: &Gate, r: u64, waited: u64, now: u64) {
    let lead = lead(g, r);
    let since_ask = now.saturating_sub(g.ahead_sent.load(Ordering::Relaxed));
    let next = if waited <= late(r) {
        lead - lead / 16
    } else if since_ask <= 2 * lead {
        lead + waited
    } else {
        lead
    };
    g.ahead_lead.store(within(next, r), Ordering::Relaxed);
}

/// A token was given back as the wait that ended at `wait_exit` returned:
/// plans the next one's request for the process's predicted return.
pub(super) fn plan(st: &State, g: &Gate, wait_exit: u64) {
    let gap = g.gap_avg.load(Ordering::Relaxed);
    // Only where the process comes back regularly: its last gap was not
    // cut at the cap (see `learn::gap_cap`) and is within a quarter of
    // the estimate, which leans short and follows a longer gap slowly.
    // Bursts 130 ms apart were otherwise asked for up to 120 ms early,
    // each token given back unused.
    let last = g.gap_last.load(Ordering::Relaxed);
    let known = last < learn::gap_cap(st) && last <= gap + gap / 4;
    if !st.settings.ask_ahead || gap == 0 || !known || g.ahead_seq.load(Ordering::Acquire) != 0 {
        return;
    }
    let launch = wait_exit + gap;
    let at = launch.saturating_sub(lead(g, leads::rtt(st))).max(1);
    g.ahead_for.store(launch, Ordering::Relaxed);
    g.ahead_at.store(at, Ordering::Release);
}

/// The earliest planned request among `st`'s gates (ns; `None`: none).
pub(super) fn next(st: &State) -> Option<u64> {
    st.gates
        .iter()
        .map(|g| g.ahead_at.load(Ordering::Acquire))
        .filter(|&at| at != 0)
        .min()
}

/// What the watcher does for `g` at each wake-up: sends the planned
/// request once it is due while the process is still quiet with no
/// token, and takes a grant that came before the process's return
/// (`true`: it did, and the token is `g`'s from now).
pub(super) fn tick(st: &'static State, dev: usize, g: &'static Gate, now: u64) -> bool {
    let at = g.ahead_at.load(Ordering::Acquire);
    let seq = g.ahead_seq.load(Ordering::Acquire);
    if (at == 0 || now < at) && seq == 0 {
        return false;
    }
    // The slow path, if a launch is in it, asks or waits itself.
    let Ok(slow) = g.slow.try_lock() else {
        return false;
    };
    if at != 0 && now >= at {
        g.ahead_at.store(0, Ordering::Release);
        // A launch since the wait (it cleared `wait_exit`) has asked for
        // its own token, or holds one.
        let quiet = g.wait_exit.load(Ordering::Relaxed) != 0;
        if quiet && seq == 0 && g.granted_at.load(Ordering::Acquire) == 0 {
            let device = st.physical(dev as u32);
            let req = Request::AcquireTokenAhead {
                device,
                burst_us: g.burst_avg.load(Ordering::Relaxed),
                rtt_us: st.rtt.us(),
                launch_in_us: launch_in_us(g, now_ns()),
            };
            if let Ok(seq) = st.ask(&req) {
                g.ahead_sent.store(now_ns(), Ordering::Relaxed);
                g.ahead_seq.store(seq, Ordering::Release);
                debug!("device {dev}: token asked for ahead of the process's return");
                // Taken as it comes, while the process is still quiet: the
                // token is the process's from its grant, as gem-schd
                // counts it. Taken later (by the launch), the time between
                // went uncharged, and gem-schd, which places the reported
                // use from its grant on, cut the process's work short by
                // it: a critical decode's kernels ran 8-16 % more than it
                // was charged (`latency::a_critical_groups_steps_overlap_at_most_a_lent_token_of_training`).
                // A grant the scheduler holds back (another group's token)
                // is looked for at the next wake-ups. Waited for up to the
                // longest lead (the watcher holds the device's slow path
                // meanwhile, but a launch would wait for the same grant);
                // each poll returns as the grant comes.
                let wait = longest(leads::rtt(st));
                return take(&slow, st, dev, g, seq, wait);
            }
        }
        return false;
    }
    take(&slow, st, dev, g, seq, 0)
}

/// How long from `now` (ns) the launch a request sent ahead is for is
/// predicted (µs, rounded down: a return counted early is the safe
/// side), as the request says, so that gem-schd counts the process back
/// then.
fn launch_in_us(g: &Gate, now: u64) -> u32 {
    let ns = g.ahead_for.load(Ordering::Relaxed).saturating_sub(now);
    u32::try_from(ns / 1000).unwrap_or(u32::MAX)
}

/// Takes the grant of the request `seq` sent ahead if it comes within
/// `wait_ns` (`slow`: `g.slow`'s guard): `true` if it did, and the token
/// is `g`'s from now.
fn take(
    slow: &std::sync::MutexGuard<'_, ()>,
    st: &'static State,
    dev: usize,
    g: &'static Gate,
    seq: u32,
    wait_ns: u64,
) -> bool {
    let Some(answer) = st.answer_within(seq, Duration::from_nanos(wait_ns)) else {
        return false;
    };
    let now = now_ns();
    g.ahead_seq.store(0, Ordering::Release);
    match answer {
        Some(Reply::Token {
            quota_us,
            lent,
            last_step,
            held_us,
            ..
        }) => {
            let grant = Grant {
                quota_us,
                lent,
                last_step,
                asked: now,
                queue_end: 0,
                sent: g.ahead_sent.load(Ordering::Relaxed),
                held_us,
            };
            let t = Transition::Grant {
                grant,
                first: None,
                launch_ctx: std::ptr::null_mut(),
            };
            transition(slow, st, dev, g, t);
            // Whether the process waited for it says its next launch.
            g.ahead_taken.store(now, Ordering::Release);
            debug!(
                "device {dev}: {} for {quota_us} us, asked ahead, granted before the process's return",
                if lent { "lent token" } else { "token" }
            );
            true
        }
        // Declined: another client has the device or waits for it, and
        // the launch asks as usual.
        Some(Reply::Done) => {
            debug!("device {dev}: token asked ahead declined, the device in use");
            false
        }
        // Forgotten by a restarted scheduler, or refused: the next launch
        // asks as usual and hears why.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_lead_grows_by_a_late_grant_and_shrinks_by_one_in_time() {
        // At a round trip of 200 µs: 0.8 ms at first, within 0.8-1 ms.
        let r = 200_000;
        let g = Gate::default();
        assert_eq!(lead(&g, r), 800_000);
        // Sent 0.9 ms before a launch that then waited 0.1 ms: too late.
        g.ahead_sent.store(1_000_000, Ordering::Relaxed);
        learn(&g, r, 100_000, 2_000_000);
        assert_eq!(lead(&g, r), 900_000);
        // Held by the scheduler for 4 ms (another group's token): no lesson.
        learn(&g, r, 4_000_000, 6_000_000);
        assert_eq!(lead(&g, r), 900_000);
        // Late by no more than a tenth of a round trip: in time. A
        // sixteenth less each time, down to the floor.
        learn(&g, r, r / 10, 6_000_000);
        assert_eq!(lead(&g, r), 900_000 - 900_000 / 16);
        for _ in 0..100 {
            learn(&g, r, 0, 6_000_000);
        }
        assert_eq!(lead(&g, r), 800_000);
        // Late, and asked within twice the lead (1.6 ms) of the launch
        // finding the grant: the lead grows. Just past it: held by the
        // scheduler, no lesson.
        g.ahead_sent.store(10_000_000, Ordering::Relaxed);
        learn(&g, r, 50_000, 10_000_000 + 1_600_001);
        assert_eq!(lead(&g, r), 800_000);
        learn(&g, r, 50_000, 10_000_000 + 1_600_000);
        assert_eq!(lead(&g, r), 850_000);
        // And never past the ceiling, however late.
        learn(&g, r, 300_000, 10_000_000 + 1_100_000);
        assert_eq!(lead(&g, r), 1_000_000);
        // The bounds follow the round trip: on a host twice as fast, half.
        assert_eq!(lead(&g, r / 2), 500_000);
        assert_eq!(within(0, r / 2), 400_000);
    }

    #[test]
    fn a_request_sent_ahead_says_when_its_launch_is_predicted() {
        let g = Gate::default();
        g.ahead_for.store(10_000_000, Ordering::Relaxed);
        // Sent 0.4 ms (and a part of a µs) before it: rounded down.
        assert_eq!(launch_in_us(&g, 9_599_500), 400);
        // The watcher woke past it: due now.
        assert_eq!(launch_in_us(&g, 10_000_001), 0);
        g.ahead_for.store(u64::MAX, Ordering::Relaxed);
        assert_eq!(launch_in_us(&g, 0), u32::MAX);
    }
}
