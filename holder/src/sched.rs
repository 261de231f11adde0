//! A connection to `gem-schd` as the holder: says hello, and again after a
//! scheduler restart (re-registering the memory it holds).

use gemini_protocol::{ErrorKind, HeldMemory, Reply, Request, Role};
use gemini_scheduler::client::{Client, ClientError};
use std::path::PathBuf;
use std::time::Duration;

/// One holder connection (each thread has its own).
#[derive(Debug)]
pub struct Sched {
    ipc: PathBuf,
    client: Option<Client>,
}

impl Sched {
    /// Not connected yet.
    pub fn new(ipc: PathBuf) -> Sched {
        Sched { ipc, client: None }
    }

    /// Sends `req` and waits up to `timeout` for its reply; says hello
    /// first when needed (with `held`, the memory this connection holds).
    pub fn call(
        &mut self,
        req: &Request,
        timeout: Duration,
        held: &[HeldMemory],
    ) -> Result<Reply, ClientError> {
        for _ in 0..2 {
            if self.client.is_none() {
                let mut c = Client::connect(&self.ipc)?;
                let hello = Request::Hello {
                    role: Role::Holder,
                    group: String::new(),
                    pid: std::process::id(),
                    held: held.to_vec(),
                };
                match c.request(&hello, Duration::from_secs(2))? {
                    Reply::Welcome { .. } => self.client = Some(c),
                    other => return Ok(other),
                }
            }
            let Some(c) = self.client.as_mut() else {
                continue;
            };
            match c.request(req, timeout) {
                Ok(Reply::Error(e)) if e.kind == ErrorKind::NotRegistered => self.client = None,
                Err(e) => {
                    // A new connection next time: the scheduler may have
                    // restarted, and a late reply must not be mistaken.
                    self.client = None;
                    return Err(e);
                }
                other => return other,
            }
        }
        Err(ClientError::Timeout(self.ipc.display().to_string()))
    }
}
