//! A hostile tenant's tools: raw ZeroMQ peers that speak the wire
//! protocol as any local user can (any routing id, any frame), for the
//! flood row of `make bench` and for `gem-attack` (`make test-hostile`).

use gemini_protocol::{Reply, Request, codec::encode_request, decode_reply};
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;

/// A frame of protocol version 999, which no gemini speaks (sequence
/// number 1, no body).
pub fn unknown_version_frame() -> Vec<u8> {
    vec![b'G', b'M', 0xe7, 0x03, 1]
}

/// A DEALER connected to the scheduler of `ipc`, with routing id `id`
/// (`None`: libzmq's own).
pub fn dealer(ctx: &zmq::Context, ipc: &Path, id: Option<&[u8]>) -> zmq::Socket {
    let s = ctx.socket(zmq::DEALER).expect("a DEALER socket");
    s.set_linger(0).expect("linger");
    if let Some(id) = id {
        s.set_identity(id).expect("routing id");
    }
    let endpoint = gemini_protocol::scheduler_endpoint(ipc).expect("endpoint");
    s.connect(&endpoint).expect("connect");
    s
}

/// Sends `frame` on `s` and waits up to `ms` for the answer: its bytes,
/// or `None` without one.
pub fn ask_raw(s: &zmq::Socket, frame: &[u8], ms: i64) -> Option<Vec<u8>> {
    s.send(frame, 0).ok()?;
    if s.poll(zmq::POLLIN, ms).ok()? == 0 {
        return None;
    }
    s.recv_bytes(0).ok()
}

/// Sends `req` on `s` and reads the answer (`None`: none within `ms`, or
/// unreadable).
pub fn ask(s: &zmq::Socket, req: &Request, ms: i64) -> Option<Reply> {
    let bytes = ask_raw(s, &encode_request(1, req), ms)?;
    decode_reply(&bytes).ok().map(|(_, r)| r)
}

/// `n` connections, each refused for speaking an unknown protocol
/// version, kept open (the scheduler lists them).
pub fn refused_peers(ctx: &zmq::Context, ipc: &Path, n: usize) -> Vec<zmq::Socket> {
    (0..n)
        .map(|i| {
            let s = dealer(ctx, ipc, Some(format!("refused-{i}").as_bytes()));
            ask_raw(&s, &unknown_version_frame(), 5000);
            s
        })
        .collect()
}

/// Threads that ask the scheduler of `ipc` for its status as fast as it
/// answers, until stopped.
#[derive(Debug)]
pub struct StatusFlood {
    stop: Arc<AtomicBool>,
    asked: Arc<AtomicU64>,
    threads: Vec<JoinHandle<()>>,
}

impl StatusFlood {
    /// Starts `n` flooding threads.
    pub fn start(ipc: &Path, n: usize) -> StatusFlood {
        let stop = Arc::new(AtomicBool::new(false));
        let asked = Arc::new(AtomicU64::new(0));
        let threads = (0..n)
            .map(|_| {
                let (stop, asked, ipc) = (stop.clone(), asked.clone(), ipc.to_path_buf());
                std::thread::spawn(move || {
                    let ctx = zmq::Context::new();
                    let s = dealer(&ctx, &ipc, None);
                    let frame = encode_request(1, &Request::Status);
                    while !stop.load(Ordering::Relaxed) {
                        if ask_raw(&s, &frame, 1000).is_some() {
                            asked.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                })
            })
            .collect();
        StatusFlood {
            stop,
            asked,
            threads,
        }
    }

    /// Stops the threads; how many answers they had.
    pub fn stop(self) -> u64 {
        self.stop.store(true, Ordering::Relaxed);
        for t in self.threads {
            let _ = t.join();
        }
        self.asked.load(Ordering::Relaxed)
    }
}
