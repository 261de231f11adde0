//! One connection to the scheduler: a DEALER socket, so several requests
//! may be outstanding (a token request answered later, say); replies are
//! matched to requests by sequence number, and one that arrives for
//! another request is kept until that one is asked for.

use gemini_protocol::{
    CodecError, ErrorKind, PROTOCOL_VERSION, Reply, Request, decode_reply_versioned,
    encode_request_as, scheduler_endpoint,
};
use std::collections::HashMap;
use std::path::Path;
use std::time::{Duration, Instant};

/// Replies kept for requests nobody asks about any more (answers to a
/// repeated hello, a late ping) are dropped past this many.
const STASH_MAX: usize = 256;

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
    /// A socket error (ZeroMQ's, or another [`Link`]'s), as it reads.
    #[error("socket error: {0}")]
    Link(String),
}

// (A message, not ZeroMQ's error itself: its text is ZeroMQ's C++ code,
// which a hook that only shows a `ClientError` must not pull in.)
impl From<zmq::Error> for ClientError {
    fn from(e: zmq::Error) -> ClientError {
        ClientError::Link(e.to_string())
    }
}

/// What carries a [`Client`]'s frames to the scheduler and back: a
/// ZeroMQ DEALER socket ([`Client::connect`]), or one the hook reaches
/// through a library it loads at its first connection (so that a
/// process that never calls CUDA does not load ZeroMQ and its C++
/// runtime).
pub trait Link: Send {
    /// Sends one frame.
    fn send(&mut self, frame: &[u8]) -> Result<(), ClientError>;
    /// Waits up to `ms` milliseconds for a frame to read: true if one is.
    fn readable(&mut self, ms: i64) -> Result<bool, ClientError>;
    /// The next frame, if one has arrived.
    fn try_recv(&mut self) -> Option<Vec<u8>>;
}

/// A ZeroMQ DEALER socket and its context.
struct ZmqLink {
    _ctx: zmq::Context,
    sock: zmq::Socket,
}

impl Link for ZmqLink {
    fn send(&mut self, frame: &[u8]) -> Result<(), ClientError> {
        Ok(self.sock.send(frame, 0)?)
    }

    fn readable(&mut self, ms: i64) -> Result<bool, ClientError> {
        Ok(self.sock.poll(zmq::POLLIN, ms)? > 0)
    }

    fn try_recv(&mut self) -> Option<Vec<u8>> {
        self.sock.recv_bytes(zmq::DONTWAIT).ok()
    }
}

/// A connection to `gem-schd`.
pub struct Client {
    link: Box<dyn Link>,
    endpoint: String,
    seq: u32,
    /// Replies received but not yet asked for, by sequence number.
    stash: HashMap<u32, Result<Reply, CodecError>>,
    /// The protocol version requests are written in: ours, or an older
    /// scheduler's once one answers in its own.
    version: u16,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.endpoint)
            .field("seq", &self.seq)
            .field("stashed", &self.stash.len())
            .field("version", &self.version)
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

    /// [`Client::connect`] for a command-line tool, which should not wait
    /// for a scheduler that is not there: where nothing listens on the
    /// socket (no socket file, or one a stopped scheduler left), the
    /// answer is a [`ClientError::Connect`] at once, not a timeout.
    pub fn connect_now(ipc_dir: &Path) -> Result<Client, ClientError> {
        let path = gemini_protocol::endpoint::scheduler_socket_path(ipc_dir);
        match std::os::unix::net::UnixStream::connect(&path) {
            Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Err(ClientError::Denied(
                gemini_protocol::endpoint::denied_message(&path),
            )),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused
                ) =>
            {
                Err(ClientError::Connect {
                    endpoint: path.display().to_string(),
                    reason: format!(
                        "no scheduler listens there ({}; start it with `gem-schd --config /etc/gemini/resource.conf`, or give the --ipc-dir it uses)",
                        if e.kind() == std::io::ErrorKind::NotFound {
                            "no socket"
                        } else {
                            "the socket is left from one that stopped"
                        }
                    ),
                })
            }
            _ => Client::connect(ipc_dir),
        }
    }

    /// [`Client::connect`] sharing a ZeroMQ context (and its I/O thread)
    /// with other clients of the same process. A tool's: whether the
    /// kernel refuses it the socket is asked by connecting, which also
    /// finds a security module's refusal of the connection (the hook's
    /// [`Client::connect_with`] asks without connecting).
    pub fn connect_in(ctx: &zmq::Context, ipc_dir: &Path) -> Result<Client, ClientError> {
        let socket = gemini_protocol::endpoint::scheduler_socket_path(ipc_dir);
        if let Some(path) = gemini_protocol::endpoint::socket_refused(socket) {
            return Err(ClientError::Denied(
                gemini_protocol::endpoint::denied_message(&path),
            ));
        }
        Client::connect_with(ipc_dir, |endpoint| {
            let ctx = ctx.clone();
            let sock = ctx.socket(zmq::DEALER)?;
            sock.set_linger(0)?;
            sock.connect(endpoint).map_err(|e| ClientError::Connect {
                endpoint: endpoint.into(),
                reason: e.to_string(),
            })?;
            Ok(Box::new(ZmqLink { _ctx: ctx, sock }))
        })
    }

    /// A client of the scheduler listening in `ipc_dir` over the link
    /// `open` makes to its endpoint (the hook's, in a library it loads):
    /// refused at once where the kernel refuses this user the socket.
    pub fn connect_with(
        ipc_dir: &Path,
        open: impl FnOnce(&str) -> Result<Box<dyn Link>, ClientError>,
    ) -> Result<Client, ClientError> {
        if let Some(path) = gemini_protocol::endpoint::socket_denied(ipc_dir) {
            return Err(ClientError::Denied(
                gemini_protocol::endpoint::denied_message(&path),
            ));
        }
        let endpoint = scheduler_endpoint(ipc_dir).map_err(|e| ClientError::Connect {
            endpoint: ipc_dir.display().to_string(),
            reason: e.to_string(),
        })?;
        let link = open(&endpoint)?;
        Ok(Client {
            link,
            endpoint,
            seq: 0,
            stash: HashMap::new(),
            version: PROTOCOL_VERSION,
        })
    }

    /// The protocol version requests are written in.
    pub fn version(&self) -> u16 {
        self.version
    }

    /// Writes requests in protocol `version` from now on (ours where this
    /// build does not speak it): what talking to an older scheduler comes
    /// to, for tests that stand for an older peer.
    pub fn speak(&mut self, version: u16) {
        self.version = if gemini_protocol::codec::spoken(version) {
            version
        } else {
            PROTOCOL_VERSION
        };
    }

    /// Writes requests in our own version again (before a hello to a
    /// scheduler that may have been upgraded): an older one answers in its
    /// own, and the client speaks that from then on.
    pub fn speak_newest(&mut self) {
        self.version = PROTOCOL_VERSION;
    }

    /// Sends `req`; returns its sequence number.
    pub fn send(&mut self, req: &Request) -> Result<u32, ClientError> {
        // Never 0: that is what a scheduler answers when it cannot read
        // the request's number.
        self.seq = self.seq.wrapping_add(1).max(1);
        self.link
            .send(&encode_request_as(self.version, self.seq, req))?;
        Ok(self.seq)
    }

    /// Sends raw bytes (tests use it to send garbage).
    pub fn send_raw(&mut self, frame: &[u8]) -> Result<(), ClientError> {
        self.link.send(frame)
    }

    /// Moves every reply that has arrived into the stash, waiting up to
    /// `wait` for the first. A refusal in an older version this build
    /// speaks makes the client speak that version from then on. A reply that
    /// cannot be read (a version this build does not speak, damaged) has
    /// no sequence number to go by: it answers `seq`. True if anything
    /// arrived.
    fn receive(&mut self, wait: Duration, seq: u32) -> Result<bool, ClientError> {
        let ms = wait.as_millis().min(i64::MAX as u128) as i64;
        if !self.link.readable(ms)? {
            return Ok(false);
        }
        while let Some(frame) = self.link.try_recv() {
            match decode_reply_versioned(&frame) {
                Ok((version, s, r)) => {
                    let refused =
                        matches!(&r, Reply::Error(e) if e.kind == ErrorKind::ProtocolMismatch);
                    // Only a refusal in an older version says what the
                    // scheduler speaks: a late answer of the one before an
                    // upgrade does not.
                    if refused {
                        self.version = self.version.min(version);
                    }
                    // A scheduler that cannot read our version cannot read
                    // our sequence number either (0.1.0 answers 0): its
                    // refusal answers the request waited for, unless that
                    // has its answer already.
                    if refused && s == 0 {
                        self.stash.entry(seq).or_insert(Ok(r));
                    } else {
                        self.stash.insert(s, Ok(r));
                    }
                }
                Err(e) => {
                    self.stash.entry(seq).or_insert(Err(e));
                }
            }
        }
        if self.stash.len() > STASH_MAX {
            let now = self.seq;
            self.stash
                .retain(|s, _| now.wrapping_sub(*s) < STASH_MAX as u32 / 2);
        }
        Ok(true)
    }

    /// The reply to `seq` if it is here or arrives within `wait`; replies
    /// to other requests are kept for them.
    pub fn take(
        &mut self,
        seq: u32,
        wait: Duration,
    ) -> Result<Option<Result<Reply, CodecError>>, ClientError> {
        if let Some(r) = self.stash.remove(&seq) {
            return Ok(Some(r));
        }
        self.receive(wait, seq)?;
        Ok(self.stash.remove(&seq))
    }

    /// Waits up to `timeout` for the next reply, to whichever request
    /// (kept ones first, oldest first).
    pub fn recv(&mut self, timeout: Duration) -> Result<(u32, Reply), ClientError> {
        let deadline = Instant::now() + timeout;
        loop {
            let now = self.seq;
            let oldest = self
                .stash
                .keys()
                .copied()
                .max_by_key(|s| now.wrapping_sub(*s));
            if let Some(s) = oldest
                && let Some(reply) = self.stash.remove(&s)
            {
                return Ok((s, reply?));
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if !self.receive(left, self.seq)? {
                return Err(ClientError::Timeout(self.endpoint.clone()));
            }
        }
    }

    /// Sends `req` and waits for its reply (replies to earlier requests
    /// are kept for them). A scheduler of an older version refuses the
    /// first request in ours, answering in its own: the request is sent
    /// again in that.
    pub fn request(&mut self, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
        let version = self.version;
        let reply = self.request_once(req, timeout)?;
        if self.version != version
            && matches!(&reply, Reply::Error(e) if e.kind == ErrorKind::ProtocolMismatch)
        {
            return self.request_once(req, timeout);
        }
        Ok(reply)
    }

    fn request_once(&mut self, req: &Request, timeout: Duration) -> Result<Reply, ClientError> {
        let seq = self.send(req)?;
        let deadline = Instant::now() + timeout;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            match self.take(seq, left)? {
                Some(r) => return Ok(r?),
                None if left.is_zero() => {
                    return Err(ClientError::Timeout(self.endpoint.clone()));
                }
                None => {}
            }
        }
    }
}

/// Asks the scheduler at `ipc_dir` to re-read its configuration now (only
/// its user or root may). `Ok(Err(message))`: it answered and kept the
/// previous configuration (the message says why); `Err`: it could not be
/// asked.
pub fn reload(ipc_dir: &Path) -> Result<Result<(), String>, ClientError> {
    let mut client = Client::connect_now(ipc_dir)?;
    Ok(
        match client.request(&Request::Reload, Duration::from_secs(5))? {
            Reply::Done => Ok(()),
            Reply::Error(e) => Err(e.message),
            other => Err(format!("unexpected answer to reload: {other:?}")),
        },
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use gemini_protocol::{ErrorReply, Role, codec::frame_version, encode_reply_as};

    /// A scheduler of protocol 14 (the previous release) refuses a request
    /// in ours, answering in 14: the client sends it again in 14, and
    /// speaks 14 from then on, until told to try its own again.
    /// A tool asks a scheduler that is not there: told so at once, not
    /// after a timeout, whether no socket was ever made or a stopped
    /// scheduler left one behind.
    #[test]
    fn no_scheduler_is_said_at_once() {
        let dir = tempfile::tempdir().unwrap();
        let said = |dir: &Path| match Client::connect_now(dir) {
            Err(ClientError::Connect { reason, .. }) => reason,
            other => panic!("{other:?}"),
        };
        assert!(said(&dir.path().join("missing")).contains("no socket"));
        let path = gemini_protocol::endpoint::scheduler_socket_path(dir.path());
        drop(std::os::unix::net::UnixListener::bind(&path).unwrap());
        assert!(said(dir.path()).contains("left from one that stopped"));
        // One that listens is connected to as before.
        let _l = {
            std::fs::remove_file(&path).unwrap();
            std::os::unix::net::UnixListener::bind(&path).unwrap()
        };
        assert!(Client::connect_now(dir.path()).is_ok());
    }

    #[test]
    fn a_client_speaks_an_older_schedulers_version() {
        let dir = tempfile::tempdir().unwrap();
        let ctx = zmq::Context::new();
        let router = ctx.socket(zmq::ROUTER).unwrap();
        router
            .bind(&scheduler_endpoint(dir.path()).unwrap())
            .unwrap();
        let old = std::thread::spawn(move || {
            let mut seen = Vec::new();
            for _ in 0..4 {
                let frames = router.recv_multipart(0).unwrap();
                let body = &frames[1];
                let version = frame_version(body).unwrap();
                seen.push(version);
                let reply = if version == 14 || seen.len() == 4 {
                    let (seq, _) = gemini_protocol::decode_request(body).unwrap();
                    (seq, Reply::Done)
                } else {
                    // As 0.1.0 does: it cannot read the number either.
                    (
                        0,
                        Reply::Error(ErrorReply {
                            kind: ErrorKind::ProtocolMismatch,
                            message: "peer speaks v15, this build speaks v14".into(),
                        }),
                    )
                };
                let frame = encode_reply_as(14, reply.0, &reply.1);
                router.send_multipart([&frames[0][..], &frame], 0).unwrap();
            }
            seen
        });
        let mut c = Client::connect(dir.path()).unwrap();
        assert_eq!(c.version(), PROTOCOL_VERSION);
        let hello = crate::hello(Role::Client, "a", &[], None);
        let t = Duration::from_secs(5);
        assert_eq!(c.request(&hello, t).unwrap(), Reply::Done);
        assert_eq!(c.version(), 14);
        assert_eq!(c.request(&Request::Status, t).unwrap(), Reply::Done);
        c.speak_newest();
        assert_eq!(c.version(), PROTOCOL_VERSION);
        // An answer in 14 that is no refusal (a late one, from before an
        // upgrade) does not make it speak 14 again.
        assert_eq!(c.request(&Request::Status, t).unwrap(), Reply::Done);
        assert_eq!(c.version(), PROTOCOL_VERSION);
        assert_eq!(
            old.join().unwrap(),
            [PROTOCOL_VERSION, 14, 14, PROTOCOL_VERSION]
        );
    }
}
