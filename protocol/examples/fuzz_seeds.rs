//! Writes one valid frame of every request and reply kind into the
//! directory given as the argument: the seed corpus of the
//! `protocol_decode` fuzz target (`make fuzz` runs it).

use gemini_protocol::*;

fn main() -> std::io::Result<()> {
    let dir = std::path::PathBuf::from(
        std::env::args()
            .nth(1)
            .unwrap_or_else(|| "fuzz/corpus/protocol_decode".into()),
    );
    std::fs::create_dir_all(&dir)?;
    let requests = [
        Request::Hello {
            role: Role::Client,
            group: "train".into(),
            pid: 42,
            held: vec![HeldMemory {
                device: 0,
                bytes: 1 << 30,
            }],
            job: None,
            build: gemini_protocol::BUILD.into(),
        },
        Request::AcquireToken {
            device: 0,
            ran: vec![Span {
                start_us: 1_000_000,
                end_us: 1_030_000,
            }],
            in_flight: false,
            burst_us: 30_000,
            rtt_us: 100,
            launch_us: 0,
        },
        Request::ReleaseToken {
            device: 1,
            ran: vec![],
            in_flight: false,
        },
        Request::Quieting {
            device: 1,
            done_in_us: 20_000,
        },
        Request::AcquireTokenAhead {
            device: 0,
            burst_us: 800,
            rtt_us: 100,
            launch_in_us: 300,
        },
        Request::ReserveMemory {
            device: 0,
            bytes: 1 << 20,
        },
        Request::ReleaseMemory {
            device: 0,
            bytes: 1 << 20,
        },
        Request::MemoryInfo { device: 3 },
        Request::ContextCost {
            device: 0,
            bytes: 500 << 20,
        },
        Request::Status,
        Request::Shutdown,
        Request::Reload,
        Request::Goodbye,
        Request::NeedMemory {
            device: 0,
            bytes: 1 << 30,
        },
        Request::HolderPoll { wait_us: 100_000 },
        Request::LateUsage {
            device: 1,
            ran: vec![Span {
                start_us: 5_000_000,
                end_us: 5_002_500,
            }],
        },
        Request::ReserveFor {
            group: "a".into(),
            gpus: GpuRequest::Count(2),
            duration_us: 4 * 3_600_000_000,
            wait: false,
        },
        Request::ReleaseReserved {
            devices: vec![0, 2],
        },
        Request::Reserve {
            group: "a".into(),
            gpus: GpuRequest::Ids(vec![0, 2]),
            wait: true,
        },
    ];
    for (i, r) in requests.iter().enumerate() {
        std::fs::write(
            dir.join(format!("seed-request-{i}")),
            encode_request(i as u32, r),
        )?;
    }
    let replies = [
        Reply::Token {
            device: 0,
            quota_us: 30_000,
            lent: false,
            last_step: false,
            held_us: 0,
        },
        Reply::Memory {
            device: 0,
            used: 1,
            limit: 2,
        },
        Reply::Error(ErrorReply {
            kind: ErrorKind::OutOfMemory,
            message: "over".into(),
        }),
        Reply::Holder(HolderOrder::Report(vec![DeviceActivity {
            device: 0,
            idle_us: 7,
            used_by: None,
        }])),
        Reply::Reserved { devices: vec![1] },
        Reply::Released {
            devices: vec![0, 2],
        },
    ];
    for (i, r) in replies.iter().enumerate() {
        std::fs::write(
            dir.join(format!("seed-reply-{i}")),
            encode_reply(i as u32, r),
        )?;
    }
    Ok(())
}
