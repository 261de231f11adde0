//! Inputs found by `make fuzz`, kept as regression tests.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use gemini_protocol::{Reply, decode_reply, encode_reply};

/// A status report whose shares are NaN and huge: decodes, and re-encodes
/// to a fixed point (found by the protocol_decode target, which had
/// compared values, and NaN != NaN).
#[test]
fn status_with_nan_shares_round_trips_byte_for_byte() {
    // Recorded at protocol version 2; version 5 added a group's GPUs
    // (`None`, one zero byte after each group's client count, inserted
    // here), version 7 a group's driver limits (an empty list, one zero
    // byte after its GPUs) and the report's `driver_limits` (false, a zero
    // byte at the end), as protocol 14 reads it; only the header's
    // version is brought up to 14, which this build still reads.
    let mut frame = include_bytes!("status_with_nan_shares.bin").to_vec();
    frame[2..4].copy_from_slice(&14u16.to_le_bytes());
    let (seq, reply) = decode_reply(&frame).expect("decodes");
    let Reply::Status(s) = &reply else {
        panic!("{reply:?}")
    };
    assert!(s.groups.iter().any(|g| g.min_util.is_nan()));
    let once = encode_reply(seq, &reply);
    let (seq2, reply2) = decode_reply(&once).unwrap();
    assert_eq!(encode_reply(seq2, &reply2), once);
}
