//! Frames: `b"GM"`, the protocol version (u16, little endian), then the
//! postcard encoding of an [`Envelope`]. Frames of every version from
//! [`OLDEST_PROTOCOL`] to [`PROTOCOL_VERSION`] are read (older ones through
//! [`crate::legacy`]); the `_as` encoders write one for a peer of an older
//! version.

use crate::{
    Envelope, MAX_FRAME_BYTES, MAX_REPLY_BYTES, OLDEST_PROTOCOL, PROTOCOL_VERSION, Reply, Request,
};
use serde::{Serialize, de::DeserializeOwned};

const MAGIC: [u8; 2] = *b"GM";
const HEADER: usize = 4;

/// A frame that cannot be decoded.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum CodecError {
    /// Shorter than the header.
    #[error("frame of {0} bytes is shorter than the 4-byte header")]
    TooShort(usize),
    /// Not a gemini frame at all.
    #[error("frame does not start with the gemini magic \"GM\"")]
    BadMagic,
    /// A gemini frame of a protocol version this build does not speak.
    #[error(
        "protocol mismatch: peer speaks gemini protocol v{peer}, this build speaks v{OLDEST_PROTOCOL} to v{ours}; install a gem-schd and libgemhook.so that share a version"
    )]
    VersionMismatch {
        /// The peer's version.
        peer: u16,
        /// Ours (the newest this build speaks).
        ours: u16,
    },
    /// Larger than the limit ([`MAX_FRAME_BYTES`] for a request,
    /// [`MAX_REPLY_BYTES`] for a reply).
    #[error("frame of {0} bytes exceeds the {1}-byte limit")]
    TooLarge(usize, usize),
    /// The header is right but the body is not a valid message.
    #[error("malformed message body: {0}")]
    Body(String),
}

/// Whether this build speaks protocol `version`.
pub fn spoken(version: u16) -> bool {
    (OLDEST_PROTOCOL..=PROTOCOL_VERSION).contains(&version)
}

/// A frame's header for `version`.
pub(crate) fn header(version: u16) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out
}

/// `body` as it is, under a header of `version`: the bytes of every
/// message whose shape `version` shares with ours.
pub(crate) fn encode_as<T: Serialize>(version: u16, seq: u32, body: &T) -> Vec<u8> {
    // Encoding into a Vec cannot fail for these types (no maps with
    // non-string keys, no unsized sequences); should it ever, the
    // header-only frame goes out and the peer reports it as malformed.
    postcard::to_extend(&Envelope { seq, body }, header(version))
        .unwrap_or_else(|_| header(version))
}

/// Decodes all of `bytes` as one `T`.
pub(crate) fn take_all<T: DeserializeOwned>(bytes: &[u8]) -> Result<T, CodecError> {
    let (v, rest): (T, &[u8]) =
        postcard::take_from_bytes(bytes).map_err(|e| CodecError::Body(e.to_string()))?;
    if !rest.is_empty() {
        return Err(CodecError::Body(format!("{} trailing bytes", rest.len())));
    }
    Ok(v)
}

/// Decodes a body in the current shape.
pub(crate) fn decode_current<T: DeserializeOwned>(body: &[u8]) -> Result<(u32, T), CodecError> {
    let env: Envelope<T> = take_all(body)?;
    Ok((env.seq, env.body))
}

/// Checks the size and header; returns the version and the body.
fn split(frame: &[u8], limit: usize) -> Result<(u16, &[u8]), CodecError> {
    if frame.len() > limit {
        return Err(CodecError::TooLarge(frame.len(), limit));
    }
    if frame.len() < HEADER {
        return Err(CodecError::TooShort(frame.len()));
    }
    if frame[..2] != MAGIC {
        return Err(CodecError::BadMagic);
    }
    let peer = u16::from_le_bytes([frame[2], frame[3]]);
    if !spoken(peer) {
        return Err(CodecError::VersionMismatch {
            peer,
            ours: PROTOCOL_VERSION,
        });
    }
    Ok((peer, &frame[HEADER..]))
}

/// The protocol version in a frame's header, whether spoken or not.
pub fn frame_version(frame: &[u8]) -> Option<u16> {
    (frame.len() >= HEADER && frame[..2] == MAGIC).then(|| u16::from_le_bytes([frame[2], frame[3]]))
}

/// Encodes a request frame in our version.
pub fn encode_request(seq: u32, req: &Request) -> Vec<u8> {
    encode_as(PROTOCOL_VERSION, seq, req)
}

/// Encodes a request frame for a peer of `version` (ours where this build
/// does not speak it).
pub fn encode_request_as(version: u16, seq: u32, req: &Request) -> Vec<u8> {
    if spoken(version) && version < PROTOCOL_VERSION {
        crate::legacy::encode_request(version, seq, req)
    } else {
        encode_request(seq, req)
    }
}

/// Encodes a reply frame in our version.
pub fn encode_reply(seq: u32, reply: &Reply) -> Vec<u8> {
    encode_as(PROTOCOL_VERSION, seq, reply)
}

/// Encodes a reply frame for a peer of `version`: the version its request
/// came in (ours where this build does not speak it).
pub fn encode_reply_as(version: u16, seq: u32, reply: &Reply) -> Vec<u8> {
    if spoken(version) && version < PROTOCOL_VERSION {
        crate::legacy::encode_reply(version, seq, reply)
    } else {
        encode_reply(seq, reply)
    }
}

/// Decodes a request frame of any version spoken into its version,
/// sequence number and request.
pub fn decode_request_versioned(frame: &[u8]) -> Result<(u16, u32, Request), CodecError> {
    let (version, body) = split(frame, MAX_FRAME_BYTES)?;
    let (seq, req) = if version == PROTOCOL_VERSION {
        decode_current(body)?
    } else {
        crate::legacy::decode_request(version, body)?
    };
    Ok((version, seq, req))
}

/// Decodes a reply frame of any version spoken into its version, sequence
/// number and reply.
pub fn decode_reply_versioned(frame: &[u8]) -> Result<(u16, u32, Reply), CodecError> {
    let (version, body) = split(frame, MAX_REPLY_BYTES)?;
    let (seq, reply) = if version == PROTOCOL_VERSION {
        decode_current(body)?
    } else {
        crate::legacy::decode_reply(version, body)?
    };
    Ok((version, seq, reply))
}

/// Decodes a request frame of any version spoken into its sequence number
/// and request.
pub fn decode_request(frame: &[u8]) -> Result<(u32, Request), CodecError> {
    decode_request_versioned(frame).map(|(_, seq, req)| (seq, req))
}

/// Decodes a reply frame of any version spoken into its sequence number
/// and reply.
pub fn decode_reply(frame: &[u8]) -> Result<(u32, Reply), CodecError> {
    decode_reply_versioned(frame).map(|(_, seq, reply)| (seq, reply))
}

/// The sequence number of a gemini frame, even if its body cannot be
/// read, so a malformed request, or one of a version not spoken, can still
/// be answered in order. Every version so far starts its body with it, a
/// `u32` postcard writes as a varint.
pub fn peek_seq(frame: &[u8]) -> Option<u32> {
    if frame.len() > MAX_FRAME_BYTES || frame.len() < HEADER || frame[..2] != MAGIC {
        return None;
    }
    postcard::take_from_bytes::<u32>(&frame[HEADER..])
        .ok()
        .map(|(s, _)| s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ErrorKind, ErrorReply, HeldMemory, Role};

    fn all_requests() -> Vec<Request> {
        vec![
            Request::Hello {
                role: Role::Client,
                group: "train".into(),
                pid: 42,
                held: vec![HeldMemory {
                    device: 1,
                    bytes: 1 << 30,
                }],
                job: None,
                build: crate::BUILD.into(),
            },
            Request::AcquireToken {
                device: 0,
                ran: vec![crate::Span {
                    start_us: 86_400_000_000,
                    end_us: 86_400_012_345,
                }],
                in_flight: true,
                burst_us: 9_000,
                rtt_us: 100,
                launch_us: 250,
            },
            Request::ReleaseToken {
                device: 3,
                ran: vec![crate::Span {
                    start_us: 0,
                    end_us: u64::MAX,
                }],
                in_flight: false,
            },
            Request::Quieting {
                device: 1,
                done_in_us: 20_000,
            },
            Request::AcquireTokenAhead {
                device: 2,
                burst_us: 800,
                rtt_us: 100,
                launch_in_us: 400,
            },
            Request::ReserveMemory {
                device: 0,
                bytes: 1 << 40,
            },
            Request::ReleaseMemory {
                device: 0,
                bytes: 7,
            },
            Request::MemoryInfo { device: 2 },
            Request::ContextCost {
                device: 1,
                bytes: 500 << 20,
            },
            Request::Status,
            Request::Shutdown,
            Request::Goodbye,
            Request::Reload,
            Request::NeedMemory {
                device: 1,
                bytes: 1 << 30,
            },
            Request::HolderPoll { wait_us: 100_000 },
            Request::LateUsage {
                device: 1,
                ran: vec![],
            },
            Request::ReserveFor {
                group: "a".into(),
                gpus: crate::GpuRequest::Count(2),
                duration_us: 4 * 3_600_000_000,
                wait: false,
            },
            Request::ReleaseReserved {
                devices: vec![0, 2],
            },
            Request::Reserve {
                group: "train".into(),
                gpus: crate::GpuRequest::Count(2),
                wait: true,
            },
            Request::Reserve {
                group: "x".into(),
                gpus: crate::GpuRequest::Ids(vec![0, 2]),
                wait: false,
            },
            Request::Gpus {
                uuids: vec!["GPU-00000000-0000-0000-0000-000000000001".into()],
            },
        ]
    }

    #[test]
    fn every_request_round_trips() {
        for (i, req) in all_requests().into_iter().enumerate() {
            let frame = encode_request(i as u32, &req);
            assert_eq!(decode_request(&frame), Ok((i as u32, req)));
            assert_eq!(peek_seq(&frame), Some(i as u32));
        }
    }

    #[test]
    fn replies_round_trip() {
        let replies = [
            Reply::Token {
                device: 0,
                quota_us: 10_000,
                lent: true,
                last_step: false,
                held_us: 0,
            },
            Reply::Done,
            Reply::Error(ErrorReply {
                kind: ErrorKind::OutOfMemory,
                message: "over".into(),
            }),
            Reply::Memory {
                device: 1,
                used: 5,
                limit: 10,
            },
            Reply::Holder(crate::HolderOrder::FreeMemory {
                device: 0,
                bytes: 7,
            }),
            Reply::Holder(crate::HolderOrder::Report(vec![crate::DeviceActivity {
                device: 0,
                idle_us: u64::MAX,
                used_by: Some("pid 42 (group train)".into()),
            }])),
            Reply::Holder(crate::HolderOrder::Stop),
            Reply::Released {
                devices: vec![0, 2],
            },
            Reply::Gpus {
                devices: vec![Some(3), None],
            },
        ];
        for r in replies {
            assert_eq!(decode_reply(&encode_reply(9, &r)), Ok((9, r)));
        }
    }

    #[test]
    fn token_request_is_compact() {
        // A day into the machine's uptime, one span of 20 ms.
        let frame = encode_request(
            7,
            &Request::AcquireToken {
                device: 0,
                ran: vec![crate::Span {
                    start_us: 86_400_000_000,
                    end_us: 86_400_020_000,
                }],
                in_flight: false,
                burst_us: 20_000,
                rtt_us: 100,
                launch_us: 0,
            },
        );
        assert!(frame.len() <= 28, "{} bytes", frame.len());
    }

    #[test]
    fn other_version_is_recognised_before_the_body() {
        let mut frame = encode_request(1, &Request::Status);
        frame[2..4].copy_from_slice(&(PROTOCOL_VERSION + 1).to_le_bytes());
        assert_eq!(
            decode_request(&frame),
            Err(CodecError::VersionMismatch {
                peer: PROTOCOL_VERSION + 1,
                ours: PROTOCOL_VERSION
            })
        );
    }

    #[test]
    fn a_version_below_the_oldest_spoken_is_refused() {
        let mut frame = encode_request(1, &Request::Status);
        frame[2..4].copy_from_slice(&(OLDEST_PROTOCOL - 1).to_le_bytes());
        assert_eq!(
            decode_request(&frame),
            Err(CodecError::VersionMismatch {
                peer: OLDEST_PROTOCOL - 1,
                ours: PROTOCOL_VERSION
            })
        );
        assert_eq!(frame_version(&frame), Some(OLDEST_PROTOCOL - 1));
        // Its number is still read, to answer it in order.
        assert_eq!(peek_seq(&frame), Some(1));
    }

    /// Frames written by gemini 0.1.0 (protocol 14), kept as that build
    /// wrote them: `R` lines are `all_requests()` in order (each with its
    /// index as sequence number), `S` a status reply with one client, `W`
    /// a welcome, `T` a token grant.
    fn v14_frames(kind: &str) -> Vec<Vec<u8>> {
        frames(include_str!("../tests/data/v14-frames.txt"), kind)
    }

    /// The frames of `kind` in a file of kept frames (`KIND hex` lines).
    fn frames(text: &str, kind: &str) -> Vec<Vec<u8>> {
        text.lines()
            .filter_map(|l| l.strip_prefix(kind)?.strip_prefix(' '))
            .map(|hex| {
                (0..hex.len())
                    .step_by(2)
                    .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).unwrap())
                    .collect()
            })
            .collect()
    }

    /// Every request of gemini 0.1.0 is read as what it meant (its hello
    /// without a build), and written for a peer of 14 byte for byte as
    /// 0.1.0 wrote it.
    #[test]
    fn requests_of_the_previous_release_are_read_and_written_as_it_did() {
        let frames = v14_frames("R");
        let requests = all_requests();
        assert_eq!(frames.len(), requests.len());
        for (i, (frame, mut req)) in frames.iter().zip(requests).enumerate() {
            let seq = i as u32;
            let (version, s, got) = decode_request_versioned(frame).unwrap();
            assert_eq!((version, s), (14, seq));
            assert_eq!(peek_seq(frame), Some(seq));
            assert_eq!(
                encode_request_as(14, seq, &req),
                *frame,
                "request {i}: {req:?}"
            );
            // What 14 lacks is left out, and reads as not said.
            if let Request::Hello { build, .. } = &mut req {
                assert!(!build.is_empty());
                build.clear();
            }
            if let Request::AcquireToken { launch_us, .. } = &mut req {
                assert_ne!(*launch_us, 0);
                *launch_us = 0;
            }
            if let Request::AcquireTokenAhead { launch_in_us, .. } = &mut req {
                assert_ne!(*launch_in_us, 0);
                *launch_in_us = 0;
            }
            assert_eq!(got, req, "request {i}");
        }
    }

    /// A status report goes to a peer of 14 without what 14 lacks (the
    /// refused peers, each client's version), and comes from a scheduler
    /// of 14 with its clients marked as of 14; other replies are the same
    /// bytes in both versions.
    #[test]
    fn replies_of_the_previous_release_are_read_and_written_as_it_did() {
        let status = &v14_frames("S")[0];
        let (version, seq, reply) = decode_reply_versioned(status).unwrap();
        assert_eq!((version, seq), (14, 7));
        let Reply::Status(mut report) = reply.clone() else {
            panic!("{reply:?}");
        };
        assert_eq!(report.clients.len(), 1);
        assert_eq!(report.clients[0].command, "python train.py");
        assert_eq!(report.clients[0].protocol, 14);
        assert_eq!(report.clients[0].build, "0.1.0");
        assert_eq!(report.protocol, 14);
        assert_eq!(report.groups[0].name, "train");
        assert_eq!(encode_reply_as(14, 7, &reply), *status);
        // What 14 cannot carry is left out, not sent in a shape it
        // misreads.
        report.refused.push(crate::RefusedPeer {
            pid: 9,
            user: "bob".into(),
            protocol: 7,
            ago_us: 1,
        });
        report.clients[0].build = "9.9.9".into();
        assert_eq!(encode_reply_as(14, 7, &Reply::Status(report)), *status);
        for kind in ["W", "T"] {
            let frame = &v14_frames(kind)[0];
            let (version, seq, reply) = decode_reply_versioned(frame).unwrap();
            assert_eq!(version, 14);
            assert_eq!(encode_reply_as(14, seq, &reply), *frame, "{reply:?}");
            assert_eq!(decode_reply(&encode_reply(seq, &reply)), Ok((seq, reply)));
        }
    }

    /// A status reply written by a 0.2.0 development build (protocol 15:
    /// `gem-schd status` of a scheduler built from main before 16), kept
    /// as it wrote it: read as meant, with what 15 lacks left empty, and
    /// written for a peer of 15 byte for byte without what 16 added.
    #[test]
    fn a_status_of_protocol_15_is_read_and_written_as_it_was() {
        let frame = frames(include_str!("../tests/data/v15-frames.txt"), "S").remove(0);
        let (version, seq, reply) = decode_reply_versioned(&frame).unwrap();
        assert_eq!((version, seq), (15, 7));
        let Reply::Status(mut report) = reply.clone() else {
            panic!("{reply:?}");
        };
        assert_eq!(report.devices[0].token_client, Some(3));
        assert_eq!(report.devices[0].rtt_us, 180);
        assert_eq!(report.devices[0].memory_total, None);
        assert_eq!(report.groups[0].latency, "");
        assert_eq!(report.clients[0].command, "python train.py");
        assert!(report.clients[0].waiting.is_empty() && report.clients[0].gpu_us == 0);
        assert_eq!(report.refused[0].user, "bob");
        assert_eq!(encode_reply_as(15, 7, &reply), frame);
        // What 16 added does not go to a peer of 15.
        report.groups[0].latency = "critical".into();
        report.devices[0].memory_total = Some(80 << 30);
        report.clients[0].waiting = vec![0];
        report.clients[0].gpu_us = 5;
        assert_eq!(
            encode_reply_as(15, 7, &Reply::Status(report.clone())),
            frame
        );
        // And all of it goes to a peer of 16.
        let ours = Reply::Status(report);
        assert_eq!(decode_reply(&encode_reply(7, &ours)), Ok((7, ours)));
    }

    /// A token request written by a hook of protocol 19, kept as it wrote
    /// it: read with its launch's length not said (0), and written for a
    /// gem-schd of 19 byte for byte without it; a peer of 20 gets it.
    #[test]
    fn a_token_request_of_protocol_19_is_read_and_written_as_it_was() {
        let frame = frames(include_str!("../tests/data/v19-frames.txt"), "A").remove(0);
        let (version, seq, req) = decode_request_versioned(&frame).unwrap();
        assert_eq!((version, seq), (19, 7));
        let Request::AcquireToken {
            device,
            ran,
            in_flight,
            burst_us,
            rtt_us,
            launch_us,
        } = req.clone()
        else {
            panic!("{req:?}");
        };
        assert_eq!((device, in_flight, burst_us, rtt_us), (2, true, 9_000, 180));
        assert_eq!(ran[0].end_us - ran[0].start_us, 12_345);
        assert_eq!(launch_us, 0);
        let said = Request::AcquireToken {
            device,
            ran,
            in_flight,
            burst_us,
            rtt_us,
            launch_us: 300,
        };
        written_as_kept(&frame, [19, 18], said);
    }

    /// `said` is written as the kept `frame` for a peer of `versions[0]`
    /// (its version), byte for byte after the header for one of
    /// `versions[1]` (same shape), and whole for a peer of ours.
    fn written_as_kept(frame: &[u8], versions: [u16; 2], said: Request) {
        assert_eq!(encode_request_as(versions[0], 7, &said), frame);
        assert_eq!(encode_request_as(versions[1], 7, &said)[4..], frame[4..]);
        assert_eq!(decode_request(&encode_request(7, &said)), Ok((7, said)));
    }

    /// A token asked ahead by a hook of protocol 20, kept as it wrote it:
    /// read with its launch's time not said (0), and written for a
    /// gem-schd of 20 byte for byte without it (and for 14, which had
    /// the same shape); a peer of 21 gets it.
    #[test]
    fn a_token_asked_ahead_of_protocol_20_is_read_and_written_as_it_was() {
        let frame = frames(include_str!("../tests/data/v20-frames.txt"), "A").remove(0);
        let (version, seq, req) = decode_request_versioned(&frame).unwrap();
        assert_eq!((version, seq), (20, 7));
        let ahead = |launch_in_us| Request::AcquireTokenAhead {
            device: 2,
            burst_us: 9_000,
            rtt_us: 180,
            launch_in_us,
        };
        assert_eq!(req, ahead(0));
        written_as_kept(&frame, [20, 14], ahead(350));
    }

    /// The question a waiting hook asks, and its answer, are new in 16:
    /// they go as they are (no older peer sends or gets them).
    #[test]
    fn the_wait_reason_round_trips() {
        let req = Request::WaitReason { device: 3 };
        assert_eq!(decode_request(&encode_request(9, &req)), Ok((9, req)));
        let reply = Reply::WaitReason {
            reserved: Some(crate::ReservedFor {
                group: "b".into(),
                user: "bob".into(),
                left_us: None,
            }),
        };
        assert_eq!(decode_reply(&encode_reply(9, &reply)), Ok((9, reply)));
    }

    /// A report of unproven time is new in 18, and goes as it is (no
    /// older peer sends it); the variants before it keep their bytes.
    #[test]
    fn unproven_usage_round_trips() {
        let req = Request::UnprovenUsage {
            device: 1,
            ran: vec![crate::Span {
                start_us: 10,
                end_us: 20,
            }],
        };
        let frame = encode_request(9, &req);
        assert_eq!(decode_request(&frame), Ok((9, req)));
        // After the envelope's sequence number, its variant's index: the
        // one after the last of 17 (appended, never inserted).
        let last_of_17 = encode_request(
            9,
            &Request::ReturnLease {
                device: 1,
                bytes: 0,
            },
        );
        assert_eq!(frame[5], last_of_17[5] + 1);
    }

    /// A token's end announced while its work runs on is new in 19, and
    /// goes as it is (no older peer sends it), appended after 18's last.
    #[test]
    fn running_out_round_trips() {
        let req = Request::RunningOut {
            device: 2,
            done_in_us: 1_500,
        };
        let frame = encode_request(9, &req);
        assert_eq!(decode_request(&frame), Ok((9, req)));
        let last_of_18 = encode_request(
            9,
            &Request::UnprovenUsage {
                device: 1,
                ran: vec![],
            },
        );
        assert_eq!(frame[5], last_of_18[5] + 1);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        assert_eq!(decode_request(b""), Err(CodecError::TooShort(0)));
        assert_eq!(decode_request(b"hello world"), Err(CodecError::BadMagic));
        let mut frame = encode_request(1, &Request::Status);
        frame.push(0xff);
        assert!(matches!(decode_request(&frame), Err(CodecError::Body(_))));
        // A hello whose string claims to be huge must not allocate or panic.
        let mut bad = b"GM".to_vec();
        bad.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
        bad.extend_from_slice(&[0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0x0f]);
        assert!(matches!(decode_request(&bad), Err(CodecError::Body(_))));
        let big = vec![0u8; MAX_FRAME_BYTES + 1];
        assert_eq!(
            decode_request(&big),
            Err(CodecError::TooLarge(MAX_FRAME_BYTES + 1, MAX_FRAME_BYTES))
        );
    }

    /// No memory limit (`u64::MAX`) is `null` in the JSON of
    /// `gem-schd status --json` (it showed as 18446744073709551615) and
    /// reads back as no limit; a limit is its number.
    #[test]
    fn no_memory_limit_is_null_in_json() {
        use crate::GroupStatus;
        let g = GroupStatus {
            name: "a".into(),
            min_util: 0.0,
            max_util: 1.0,
            memory_limit: u64::MAX,
            clients: 0,
            devices: None,
            driver_memory: vec![],
            latency: "normal".into(),
        };
        let json = serde_json::to_value(&g).unwrap();
        assert!(json["memory_limit"].is_null(), "{json}");
        assert_eq!(serde_json::from_value::<GroupStatus>(json).unwrap(), g);
        let capped = GroupStatus {
            memory_limit: 8 << 30,
            ..g
        };
        assert_eq!(
            serde_json::to_value(&capped).unwrap()["memory_limit"],
            8u64 << 30
        );
    }

    /// A status report with 20,000 groups is larger than any request may
    /// be, and still reaches `gem-schd status` (it used to be refused as
    /// too large, and reported as "no scheduler").
    #[test]
    fn a_status_reply_may_be_larger_than_a_request() {
        use crate::{GroupStatus, StatusReport};
        let report = StatusReport {
            server: "test".into(),
            config_path: "/etc/gemini/resource.conf".into(),
            config_error: None,
            window_us: 10_000_000,
            uptime_us: 1,
            groups: (0..20_000)
                .map(|i| GroupStatus {
                    name: format!("group-{i}"),
                    min_util: 0.0,
                    max_util: 1.0,
                    memory_limit: u64::MAX,
                    clients: 0,
                    devices: None,
                    driver_memory: vec![],
                    latency: String::new(),
                })
                .collect(),
            devices: vec![],
            clients: vec![],
            reservations: vec![],
            queue: vec![],
            driver_limits: false,
            refused: vec![],
            protocol: crate::PROTOCOL_VERSION,
        };
        let reply = Reply::Status(Box::new(report));
        let frame = encode_reply(7, &reply);
        assert!(frame.len() > MAX_FRAME_BYTES, "{} bytes", frame.len());
        assert_eq!(decode_reply(&frame), Ok((7, reply)));
    }
}
