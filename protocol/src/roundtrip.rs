//! The token round trip, measured. A client (the hook, the holder) times
//! each request from its send to its reply, on its own thread: the
//! message each way, the scheduler's wake-up and the client's. A token
//! request counts less the time the scheduler held it for the grant
//! (`Reply::Token { held_us }`); a request the scheduler answers as it
//! reads it (a token given back, a wait's end announced, memory) counts
//! whole. A hello does not count: the connection's own set-up is in it.
//! The client sends its estimate with each token request, and the
//! scheduler averages them per device ([`fold`]).
//!
//! The estimate is the 90th percentile of the last [`SAMPLES`] round
//! trips: a lead must cover the slower ones, and one in a hundred that
//! waited for another thread's poll of the socket (1 ms and more on the
//! 2-core test VM, where the median is 80 µs) must not move it.
//!
//! Every lead that hides a round trip is derived from it, on both sides
//! ([`basis`]): how early a lent token is renewed, asked ahead or passes
//! the device on, what a quiet gap or an announced end must exceed to be
//! worth a message, the shortest lent token. Each is the value it had as
//! a constant, tuned on the test VM, scaled by the round trip over
//! [`MAX_NS`], the 99th percentile there (`make bench`). The round trip
//! they are derived from is kept within [`MIN_NS`, `MAX_NS`]:
//! - below, a lead would be shorter than the timers that must meet it:
//!   `gem-schd` times deadlines under 1 ms in slices of `MIN_NS`, and a
//!   client's sleep overshoots by its timer slack (50 µs by default);
//! - above, leads grown with the round trips of a loaded 2-core host
//!   (1-2 ms while the test suite ran) made hand-overs overlap by as
//!   much: a 2 ms CPU gap was no longer lent, and the next holder's span,
//!   begun at its early grant behind the last holder's queued work, took
//!   that work's time in the ledger (a group's kernels ran 52 ms more
//!   than it was charged over 2 s).
//!
//! So a faster host gets leads down to half their former values, and no
//! host gets longer ones.

use crate::{Reply, Request};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// The longest round trip leads are derived from, and the longest sample
/// taken as it is (ns): see the module doc.
pub const MAX_NS: u64 = 200_000;

/// The shortest round trip leads are derived from (ns): see the module
/// doc.
pub const MIN_NS: u64 = 100_000;

/// The round trip leads are derived from, given the estimate `est_ns` (0:
/// none yet, and then the longest, as the constants were).
pub fn basis(est_ns: u64) -> u64 {
    match est_ns {
        0 => MAX_NS,
        ns => ns.clamp(MIN_NS, MAX_NS),
    }
}

/// How many of the latest samples the estimate is taken from.
pub const SAMPLES: usize = 32;

/// Folds a client's reported estimate `sample_ns` into the scheduler's
/// estimate for a device `est_ns` (0: none yet, and the sample is taken as
/// it is): an average that moves by an eighth of each difference. Never 0
/// after a sample.
pub fn fold(est_ns: u64, sample_ns: u64) -> u64 {
    let s = sample_ns.clamp(1, MAX_NS);
    let est = if est_ns == 0 {
        s
    } else if s >= est_ns {
        est_ns + (s - est_ns) / 8
    } else {
        est_ns - (est_ns - s) / 8
    };
    est.max(1)
}

/// The round trip (ns) of `req`, answered `reply` `elapsed_ns` after it
/// was sent, if it tells one: a token's grant, less the time the
/// scheduler held it, or a request answered as the scheduler reads it.
/// Not memory asked for, which may wait for the holder to hand some back,
/// nor a hello.
pub fn sample_of(req: &Request, reply: &Reply, elapsed_ns: u64) -> Option<u64> {
    match reply {
        // A grant held longer than the client waited answers another
        // request than the one timed (it superseded a waiting one, whose
        // arrival the hold is counted from): no sample.
        Reply::Token { held_us, .. } => elapsed_ns.checked_sub(held_us.saturating_mul(1000)),
        Reply::Error(_) => None,
        _ => matches!(
            req,
            Request::ReleaseToken { .. }
                | Request::Quieting { .. }
                | Request::RunningOut { .. }
                | Request::LateUsage { .. }
                | Request::UnprovenUsage { .. }
                | Request::ReleaseMemory { .. }
                | Request::MemoryInfo { .. }
                | Request::ContextCost { .. }
        )
        .then_some(elapsed_ns),
    }
}

/// A round-trip estimate shared by a client's threads.
#[derive(Debug, Default)]
pub struct RoundTrip {
    /// The latest samples (ns), oldest overwritten, and how many were
    /// taken in all.
    samples: Mutex<([u64; SAMPLES], usize)>,
    /// Their 90th percentile (ns; 0: no sample yet), for readers.
    estimate: AtomicU64,
}

impl RoundTrip {
    /// No sample yet.
    pub const fn new() -> RoundTrip {
        RoundTrip {
            samples: Mutex::new(([0; SAMPLES], 0)),
            estimate: AtomicU64::new(0),
        }
    }

    /// A request answered at once took `ns` from its send to its reply.
    pub fn sample(&self, ns: u64) {
        let mut g = self.samples.lock().unwrap_or_else(|e| e.into_inner());
        let (ring, taken) = &mut *g;
        ring[*taken % SAMPLES] = ns.clamp(1, MAX_NS);
        *taken += 1;
        let n = (*taken).min(SAMPLES);
        let mut sorted = *ring;
        let sorted = &mut sorted[..n];
        sorted.sort_unstable();
        // The 90th percentile: of 32, the fourth longest.
        let p90 = sorted[(n * 9).div_ceil(10) - 1];
        self.estimate.store(p90, Ordering::Relaxed);
    }

    /// The estimate (ns; 0: no sample yet).
    pub fn ns(&self) -> u64 {
        self.estimate.load(Ordering::Relaxed)
    }

    /// The estimate in whole µs, as sent to the scheduler (0: none yet).
    pub fn us(&self) -> u32 {
        let ns = self.ns();
        if ns == 0 {
            0
        } else {
            (ns / 1000).max(1) as u32
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_estimate_is_the_slower_round_trips_not_the_rare_stall() {
        // Of the last 32 round trips, one in eight of 150 µs, one of
        // 1.3 ms (a poll of another thread waited for), the rest of 60
        // µs: the estimate covers the slower ones and not the stall.
        let r = RoundTrip::new();
        for i in 0..100 {
            r.sample(match i {
                90 => 1_300_000,
                i if i % 8 == 3 => 150_000,
                _ => 60_000,
            });
        }
        assert_eq!(r.ns(), 150_000);
    }

    #[test]
    fn a_grant_counts_less_the_time_it_was_held_and_a_refusal_not_at_all() {
        let ask = Request::AcquireToken {
            device: 0,
            ran: vec![],
            in_flight: false,
            burst_us: 0,
            rtt_us: 0,
            launch_us: 0,
        };
        let grant = Reply::Token {
            device: 0,
            quota_us: 10_000,
            lent: false,
            last_step: false,
            held_us: 30_000,
        };
        assert_eq!(sample_of(&ask, &grant, 30_090_000), Some(90_000));
        assert_eq!(sample_of(&ask, &grant, 20_000_000), None);
        let release = Request::ReleaseToken {
            device: 0,
            ran: vec![],
            in_flight: false,
        };
        assert_eq!(sample_of(&release, &Reply::Done, 70_000), Some(70_000));
        let refused = Reply::Error(crate::ErrorReply {
            kind: crate::ErrorKind::NotRegistered,
            message: String::new(),
        });
        assert_eq!(sample_of(&release, &refused, 70_000), None);
        let need = Request::NeedMemory {
            device: 0,
            bytes: 1,
        };
        assert_eq!(sample_of(&need, &Reply::Done, 5_000_000), None);
    }

    #[test]
    fn leads_are_derived_from_a_round_trip_within_their_bounds() {
        assert_eq!(basis(0), MAX_NS);
        assert_eq!(basis(30_000), MIN_NS);
        assert_eq!(basis(150_000), 150_000);
        assert_eq!(basis(900_000), MAX_NS);
    }

    #[test]
    fn a_stall_counts_as_the_longest_round_trip() {
        let r = RoundTrip::new();
        r.sample(5_000_000_000);
        assert_eq!(r.ns(), MAX_NS);
        assert_eq!(fold(0, 5_000_000_000), MAX_NS);
    }

    #[test]
    fn the_first_sample_is_taken_as_it_is_and_zero_means_none() {
        let r = RoundTrip::new();
        assert_eq!((r.ns(), r.us()), (0, 0));
        r.sample(80_000);
        assert_eq!((r.ns(), r.us()), (80_000, 80));
        // A sub-µs estimate is still sent as known.
        let fast = RoundTrip::new();
        fast.sample(500);
        assert_eq!(fast.us(), 1);
    }

    #[test]
    fn the_estimate_follows_the_host_within_its_samples() {
        // A slow first round trip is forgotten once SAMPLES faster ones
        // came.
        let r = RoundTrip::new();
        r.sample(180_000);
        for _ in 0..SAMPLES {
            r.sample(30_000);
        }
        assert_eq!(r.ns(), 30_000);
        // The scheduler's average of its clients' estimates moves by an
        // eighth of each difference.
        let mut est = fold(0, 200_000);
        assert_eq!(est, 200_000);
        est = fold(est, 40_000);
        assert_eq!(est, 180_000);
        est = fold(est, 20_000);
        assert_eq!(est, 160_000);
    }
}
