//! Leads that hide a round trip to the scheduler, derived from the round
//! trip as this process measures it (`State::rtt`), kept within 100-200
//! µs (see `gemini_protocol::roundtrip`): each is the value it had as a
//! constant, tuned on the 2-core test VM, scaled by the round trip over
//! that VM's 200 µs. On a faster host they shrink, down to half.

use super::*;

/// The round trip leads are derived from now (ns): the estimate within
/// its bounds, or 200 µs before the first is measured (the first token's
/// grant measures one).
pub(super) fn rtt(st: &State) -> u64 {
    gemini_protocol::roundtrip::basis(st.rtt.ns())
}

/// How long before a renewed lent token's queue is predicted to drain
/// its renewal is asked for: the request's round trip, and the wake-up of
/// the thread that sleeps until then, half a round trip more (0.3 ms at
/// 200 µs).
pub(super) fn renew(r: u64) -> u64 {
    r + r / 2
}

/// The least work left when a wait begins that is worth announcing
/// (`Quieting`): the notice's round trip, and the scheduler's hand-over
/// lead, which is one round trip too (0.4 ms at 200 µs). Less than that
/// would be handed over at once.
pub(super) fn quiet_notice(r: u64) -> u64 {
    2 * r
}

/// The least quiet gap after waits for which a process gives its token
/// back as a wait returns (0.5 ms at 200 µs): a release's and a grant's
/// round trips, and the token asked back, half of the shortest token
/// lent meanwhile (five round trips, `gem-schd`'s `lent_min_quota`). A
/// shorter gap is not worth lending, and the process keeps the token
/// through it.
pub(super) fn early_release(r: u64) -> u64 {
    5 * r / 2
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leads_scale_with_the_round_trip_and_keep_their_order() {
        // At 200 µs, the values they had as constants.
        let r = gemini_protocol::roundtrip::MAX_NS;
        assert_eq!(
            (renew(r), quiet_notice(r), early_release(r)),
            (300_000, 400_000, 500_000)
        );
        let fast = gemini_protocol::roundtrip::MIN_NS;
        assert_eq!(early_release(fast), early_release(r) / 2);
        for r in [fast, 150_000, r] {
            assert!(r < renew(r) && renew(r) < quiet_notice(r));
            assert!(quiet_notice(r) < early_release(r));
        }
    }
}
