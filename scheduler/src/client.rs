//! A blocking client of the scheduler, for the CLI (`gem-schd status`,
//! `shutdown`), the demo and the tests. One DEALER socket, so several
//! requests may be outstanding (a token request answered later, say).

use gemini_protocol::{
    CodecError, Reply, Request, decode_reply, encode_request, scheduler_endpoint,
};
use std::path::Path;
use std::time::{Duration, Instant};

/// Failures talking to the scheduler.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The endpoint could not be formed or connected.
    #[error("cannot reach the scheduler at {endpoint}: {reason}")]
    Connect {
        /// The endpoint.
        endpoint: String,
        /// Why.
        reason: String,
    },
    /// The kernel refuses this user the socket (the message says what to
    /// ask for).
    #[error("{0}")]
    Denied(String),
    /// No answer in time.
    #[error(
        "no answer from the scheduler at {0} (is gem-schd running? start it with `gem-schd --config /etc/gemini/resource.conf`)"
    )]
    Timeout(String),
    /// The answer could not be decoded.
    #[error("bad answer from the scheduler: {0}")]
    Codec(#[from] CodecError),
    /// A socket error.
    #[error("socket error: {0}")]
    Zmq(#[from] zmq::Error),
}

/// A connection to `gem-schd`.
pub struct Client {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    endpoint: String,
    seq: u32,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.endpoint)
            .field("seq", &self.seq)
            .finish()
    }
}

impl Client {
    /// Connects to the scheduler listening in `ipc_dir`. ZeroMQ connects
    /// lazily: an absent scheduler shows up as a timeout on the first
    /// request.
    pub fn connect(ipc_dir: &Path) -> Result<Client, ClientError> {
        Client::connect_in(&zmq::Context::new(), ipc_dir)
    }

    /// [`Client::connect`] sharing a ZeroMQ context (and its I/O thread)
    /// with other clients of the same process.
    pub fn connect_in(ctx: &zmq::Context, ipc_dir: &Path) -> Result<Client, ClientError> {
        if let Some(path) = gemini_protocol::endpoint::socket_denied(ipc_dir) {
            return Err(ClientError::Denied(
                gemini_protocol::endpoint::denied_message(&path),
            ));
        }
        let endpoint = scheduler_endpoint(ipc_dir).map_err(|e| ClientError::Connect {
            endpoint: ipc_dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let ctx = ctx.clone();
        let sock = ctx.socket(zmq::DEALER)?;
        sock.set_linger(0)?;
        sock.connect(&endpoint).map_err(|e| ClientError::Connect {
            endpoint: endpoint.clone(),
            reason: e.to_string(),
        })?;
        Ok(Client {
            _ctx: ctx,
            sock,
            endpoint,
            seq: 0,
        })
    }

    /// Sends `req`; returns its sequence number.
    pub fn send(&mut self, req: &Request) -> Result<u32, ClientError> {
        self.seq = self.seq.wrapping_add(1);
        self.sock.send(encode_request(self.seq, req), 0)?;
        Ok(self.seq)
    }

    /// Sends raw bytes (tests use it to send garbage).
    pub fn send_raw(&mut self, frame: &[u8]) -> Result<(), ClientError> {
        self.sock.send(frame, 0)?;
        Ok(())
    }

    /// Waits up to `timeout` for the next reply.
    pub fn recv(&mut self, timeout: Duration) -> Result<(u32, Reply), ClientError> {
        let ms = timeout.as_millis().min(i64::MAX as u128) as i64;
        if self.sock.poll(zmq::POLLIN, ms)? == 0 {
            return Err(ClientError::Timeout(self.endpoint.clone()));
        }
        let frame = self.sock.recv_bytes(0)?;
        Ok(decode_reply(&frame)?)
    }

    /// Sends `req` and waits for its reply, skipping replies to earlier
    /// requests.
    pub fn request(&mut self, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
        let seq = self.send(req)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let (s, reply) = self.recv(left)?;
            if s == seq {
                return Ok(reply);
            }
        }
    }
}

/// Asks the scheduler at `ipc_dir` to re-read its configuration now (only
/// its user or root may). `Ok(Err(message))`: it answered and kept the
/// previous configuration (the message says why); `Err`: it could not be
/// asked.
pub fn reload(ipc_dir: &Path) -> Result<Result<(), String>, ClientError> {
    let mut client = Client::connect(ipc_dir)?;
    Ok(
        match client.request(&Request::Reload, Duration::from_secs(5))? {
            Reply::Done => Ok(()),
            Reply::Error(e) => Err(e.message),
            other => Err(format!("unexpected answer to reload: {other:?}")),
        },
    )
}
