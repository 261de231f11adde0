//! A connection that has said hello: as the holder, a control tool or a
//! client of a group. A scheduler that restarted does not know it (its
//! requests are answered `NotRegistered`): it says hello again, with the
//! memory it holds, and repeats the request.

use crate::client::{Client, ClientError};
use gemini_protocol::roundtrip::{RoundTrip, sample_of};
use gemini_protocol::{ErrorKind, HeldMemory, Reply, Request, Role};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// How long a hello waits for its welcome.
const HELLO_TIMEOUT: Duration = Duration::from_secs(3);

/// The hello of this process as `role` in `group` (empty: none named, or
/// not a client), holding `held`, a rank of `job` (see
/// `gemini_protocol::job`).
pub fn hello(role: Role, group: &str, held: &[HeldMemory], job: Option<&str>) -> Request {
    Request::Hello {
        role,
        group: group.to_string(),
        pid: std::process::id(),
        held: held.to_vec(),
        job: job.map(str::to_string),
        build: gemini_protocol::BUILD.into(),
    }
}

/// A registered connection, made again when needed.
#[derive(Debug)]
pub struct Session {
    ipc: PathBuf,
    role: Role,
    group: String,
    client: Option<Client>,
    rtt: RoundTrip,
}

impl Session {
    /// Not connected yet: the first call connects and says hello.
    pub fn new(ipc: &Path, role: Role, group: &str) -> Session {
        Session {
            ipc: ipc.to_path_buf(),
            role,
            group: group.to_string(),
            client: None,
            rtt: RoundTrip::new(),
        }
    }

    /// The round trip measured on this session's requests answered at
    /// once (µs; 0: none yet), as token requests carry it.
    pub fn rtt_us(&self) -> u32 {
        self.rtt.us()
    }

    /// The registered connection, connecting and saying hello (with
    /// `held`) first if there is none. `Ok(Err(reply))`: the scheduler
    /// refused the hello, and said why.
    pub fn register(
        &mut self,
        held: &[HeldMemory],
    ) -> Result<Result<&mut Client, Reply>, ClientError> {
        let c = match self.client.take() {
            Some(c) => c,
            None => {
                let mut c = Client::connect(&self.ipc)?;
                match c.request(&hello(self.role, &self.group, held, None), HELLO_TIMEOUT)? {
                    Reply::Welcome { .. } => c,
                    refused => return Ok(Err(refused)),
                }
            }
        };
        Ok(Ok(self.client.insert(c)))
    }

    /// Drops the connection: the next call connects and says hello again
    /// (after a restart the caller noticed another way, say).
    pub fn reset(&mut self) {
        self.client = None;
    }

    /// Sends `req` and waits up to `timeout` for its reply; says hello
    /// first when needed (with `held`, the memory this connection holds),
    /// and again, repeating the request once, when the scheduler does not
    /// know this connection. A refused hello is returned as the reply.
    pub fn call(
        &mut self,
        req: &Request,
        timeout: Duration,
        held: &[HeldMemory],
    ) -> Result<Reply, ClientError> {
        for _ in 0..2 {
            let c = match self.register(held)? {
                Ok(c) => c,
                Err(refused) => return Ok(refused),
            };
            let sent = std::time::Instant::now();
            let reply = c.request(req, timeout);
            if let Ok(r) = &reply
                && let Some(ns) = sample_of(req, r, sent.elapsed().as_nanos() as u64)
            {
                self.rtt.sample(ns);
            }
            match reply {
                Ok(Reply::Error(e)) if e.kind == ErrorKind::NotRegistered => self.reset(),
                Err(e) => {
                    // A new connection next time: the scheduler may have
                    // restarted, and a late reply must not be mistaken.
                    self.reset();
                    return Err(e);
                }
                other => return other,
            }
        }
        Err(ClientError::Timeout(self.ipc.display().to_string()))
    }
}
