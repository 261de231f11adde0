//! Any bytes a peer may send: decoding never panics, and whatever decodes
//! re-encodes to a frame that decodes and re-encodes to the same bytes
//! (bytes, not values: a status report may carry NaN, which is not equal
//! to itself — the first thing this target found).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if let Ok((seq, req)) = gemini_protocol::decode_request(data) {
        let once = gemini_protocol::encode_request(seq, &req);
        let (seq2, req2) = gemini_protocol::decode_request(&once).expect("re-encoded request decodes");
        assert_eq!(gemini_protocol::encode_request(seq2, &req2), once);
    }
    if let Ok((seq, reply)) = gemini_protocol::decode_reply(data) {
        let once = gemini_protocol::encode_reply(seq, &reply);
        let (seq2, reply2) = gemini_protocol::decode_reply(&once).expect("re-encoded reply decodes");
        assert_eq!(gemini_protocol::encode_reply(seq2, &reply2), once);
    }
    let _ = gemini_protocol::codec::peek_seq(data);
});
