//! Leads that hide a round trip to the scheduler, derived from the round
//! trip as this process measures it (`State::rtt`, see
//! `gemini_protocol::roundtrip`) instead of values tuned on one machine.
//! Each is a small number of round trips, for the messages it must
//! cover. On the 2-core test VM the estimate is 130-200 µs, which gives
//! about the values these leads had as constants; the round trip counts
//! as 200 µs at most (`MAX_SAMPLE_NS`, see `gemini_protocol::roundtrip`).

use super::*;

/// The round trip now (ns). Before the first one is measured (the first
/// token's grant measures one): the longest counted, 200 µs.
pub(super) fn rtt(st: &State) -> u64 {
    match st.rtt.ns() {
        0 => gemini_protocol::roundtrip::MAX_SAMPLE_NS,
        r => r,
    }
}

/// How long before a renewed lent token's queue is predicted to drain
/// its renewal is asked for: the request's round trip, and the wake-up of
/// the thread that sleeps until then (half a round trip more).
pub(super) fn renew(r: u64) -> u64 {
    r + r / 2
}

/// The least work left when a wait begins that is worth announcing
/// (`Quieting`): the notice's round trip, and the scheduler's hand-over
/// lead, which is one round trip too. Less than that would be handed over
/// at once.
pub(super) fn quiet_notice(r: u64) -> u64 {
    2 * r
}

/// The least quiet gap after waits for which a process gives its token
/// back as a wait returns: the release's round trip, the next holder's
/// grant, and the token asked ahead for its return. A shorter gap is not
/// worth lending, and the process keeps the token through it.
pub(super) fn early_release(r: u64) -> u64 {
    3 * r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn leads_grow_with_the_round_trip_and_keep_their_order() {
        for r in [30_000, 150_000, 400_000] {
            assert!(renew(r) > r);
            assert!(quiet_notice(r) > renew(r));
            assert!(early_release(r) > quiet_notice(r));
        }
        assert_eq!(early_release(200_000), 2 * early_release(100_000));
    }
}
