//! Peers: their credentials from the kernel, who they are, and their
//! processes watched so that what a dead one held is released.

use super::*;

/// Credentials of a peer, from the kernel (`SO_PEERCRED`) where libzmq
/// passes them on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct PeerCred {
    pub(super) uid: u32,
    pub(super) gid: u32,
    pub(super) pid: u32,
}

/// Parses libzmq's `Peer-Address` property of an ipc peer: `:uid:gid:pid`.
pub(super) fn parse_peer_address(s: &str) -> Option<PeerCred> {
    let mut it = s.rsplit(':');
    let pid = it.next()?.parse().ok()?;
    let gid = it.next()?.parse().ok()?;
    let uid = it.next()?.parse().ok()?;
    Some(PeerCred { uid, gid, pid })
}

/// A connection that never said hello (a `gem-schd status`, a monitoring
/// poll) is forgotten after this long without a message: ZeroMQ does not
/// tell when a peer leaves, and an entry kept for every status call ever
/// made would grow without end. One that comes back is simply new.
pub(super) const QUIET_CONN: Duration = Duration::from_secs(600);

/// The identities of the connections of no process (never said hello)
/// that have been quiet for [`QUIET_CONN`] at `now`.
pub(super) fn quiet_conns(conns: &HashMap<Route, Conn>, now: Instant) -> Vec<Route> {
    conns
        .iter()
        .filter(|(_, c)| {
            c.pid.is_none() && now.saturating_duration_since(c.last_seen) >= QUIET_CONN
        })
        .map(|(identity, _)| identity.clone())
        .collect()
}

/// Watches a process: a pidfd when the kernel has them, else polling.
#[derive(Debug)]
pub(super) struct Watched {
    pub(super) pidfd: Option<OwnedFd>,
    /// Its command line, read once when it joined (for `status`).
    pub(super) command: String,
}

pub(super) fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

pub(super) fn process_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Who a peer is: its credentials, its user's name and Unix groups (from
/// the system's databases, looked up off the loop: [`Resolver`]), and its
/// process's cgroups (read once, as it connects).
pub(super) fn peer_of(c: PeerCred, account: &Account) -> Peer {
    Peer {
        uid: c.uid,
        pid: c.pid,
        user: account.name.clone(),
        groups: account.groups.clone(),
        cgroups: cgroups_of(c.pid),
    }
}

/// The cgroups of process `pid`, one per hierarchy in `/proc/PID/cgroup`,
/// the unified (v2) one first. A job manager on cgroup v1 places its jobs
/// in some hierarchies only (Slurm's freezer: `/slurm/uid_0/job_5/...`)
/// while the unified one, mounted too, says `/`: every path counts.
pub(super) fn cgroups_of(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map(|t| cgroup_paths(&t))
        .unwrap_or_default()
}

/// The paths of a `/proc/PID/cgroup` text, unified hierarchy first, each
/// once.
pub(super) fn cgroup_paths(text: &str) -> Vec<String> {
    let mut paths: Vec<String> = Vec::new();
    let lines = text.lines().filter(|l| l.starts_with("0::"));
    for l in lines.chain(text.lines().filter(|l| !l.starts_with("0::"))) {
        if let Some(p) = l.splitn(3, ':').nth(2)
            && !paths.iter().any(|q| q == p)
        {
            paths.push(p.to_string());
        }
    }
    paths
}

/// Checks, before serving anyone, that libzmq names a peer's uid, gid and
/// pid (`SO_PEERCRED`, the `Peer-Address` property of an ipc peer): a
/// libzmq built without it gives none, and every peer could then act as
/// any user. A message of this process to a socket of its own, on an
/// endpoint of its own in `ipc_dir`. Without them gem-schd does not
/// start, unless `allow` (`--allow-unverified-peers`, for tests).
pub(super) fn check_peer_credentials(
    ctx: &zmq::Context,
    ipc_dir: &Path,
    allow: bool,
) -> anyhow::Result<()> {
    let path = ipc_dir.join(format!(".peercred-check.{}", std::process::id()));
    let endpoint = format!("ipc://{}", path.display());
    let named = (|| -> anyhow::Result<Option<PeerCred>> {
        let server = ctx.socket(zmq::ROUTER)?;
        server.set_linger(0)?;
        server.bind(&endpoint)?;
        let probe = ctx.socket(zmq::DEALER)?;
        probe.set_linger(0)?;
        probe.connect(&endpoint)?;
        probe.send("peercred?", 0)?;
        if server.poll(zmq::POLLIN, 2000)? == 0 {
            bail!("no answer from a socket of its own at {endpoint}");
        }
        let _identity = server.recv_msg(0)?;
        let mut body = server.recv_msg(0)?;
        Ok(body.gets("Peer-Address").and_then(parse_peer_address))
    })();
    let _ = std::fs::remove_file(&path);
    let named = named.context("cannot check that peers' credentials can be read")?;
    let own = std::process::id();
    match named {
        Some(c) if c.pid == own && c.uid == euid() => Ok(()),
        Some(c) => bail!(
            "libzmq named this process as pid {} uid {}, not pid {own} uid {}: peers' credentials cannot be trusted",
            c.pid,
            c.uid,
            euid()
        ),
        None if allow => {
            warn!(
                "libzmq gives no peer credentials (built without SO_PEERCRED): every peer is served \
                 unverified and may act as any user (--allow-unverified-peers)"
            );
            Ok(())
        }
        None => bail!(
            "libzmq gives no peer credentials (it was built without SO_PEERCRED), so gem-schd cannot \
             tell one user from another and does not start. Build gemini as shipped (.cargo/config.toml \
             defines ZMQ_HAVE_SO_PEERCRED for the bundled libzmq), or pass --allow-unverified-peers \
             where every user may be trusted (tests)"
        ),
    }
}

impl Daemon {
    /// Answers a message from a peer the kernel does not name (when
    /// unverified peers are not served): a permission error, and nothing
    /// kept of it.
    pub(super) fn refuse_unverified(&mut self, identity: &Route, delimited: bool, body: &[u8]) {
        let Route::Peer(id) = identity else {
            return;
        };
        self.refused_metric(ErrorKind::PermissionDenied);
        let version = frame_version(body)
            .filter(|v| spoken(*v))
            .unwrap_or(PROTOCOL_VERSION);
        let seq = peek_seq(body).unwrap_or(0);
        let reply = encode_reply_as(
            version,
            seq,
            &Reply::Error(ErrorReply {
                kind: ErrorKind::PermissionDenied,
                message: "the scheduler cannot read this connection's credentials".into(),
            }),
        );
        if let Err(e) = self.send_to(id, delimited, &reply) {
            debug!("reply to an unverified peer dropped: {e}");
        }
    }

    pub(super) fn watch(&mut self, client: ClientId, pid: u32) {
        if let Some(conn) = self.ids.get(&client).and_then(|i| self.conns.get_mut(i)) {
            conn.pid = Some(pid);
        }
        if pid == 0 {
            return;
        }
        // Read at every join: a process that exec'd and joined again
        // under its pid runs another command.
        if let Some(w) = self.watched.get_mut(&pid) {
            w.command = super::command_line(pid);
            return;
        }
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                // Already gone (or in another pid namespace): the periodic
                // check decides.
                None
            }
            Err(e) => {
                debug!("pidfd_open({pid}): {e}; polling instead");
                None
            }
        };
        let command = super::command_line(pid);
        self.watched.insert(pid, Watched { pidfd, command });
    }

    pub(super) fn poll_pids_without_fd(&mut self) {
        if self.last_pid_poll.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_pid_poll = Instant::now();
        let dead: Vec<u32> = self
            .watched
            .iter()
            .filter(|(pid, w)| w.pidfd.is_none() && !process_alive(**pid))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in dead {
            self.process_gone(pid);
        }
    }

    /// Forgets connection `route`: what its peer held is released.
    pub(super) fn forget(&mut self, route: &Route) {
        let Some(c) = self.conns.remove(route) else {
            return;
        };
        self.ids.remove(&c.id);
        self.asked.retain(|&(id, _), _| id != c.id);
        let actions = self
            .policy
            .handle(Event::Disconnected { client: c.id }, self.now());
        self.send_actions(actions);
    }

    /// Makes room for one more connection of `uid` (a user other than
    /// root and the daemon's) that has not said hello: past
    /// [`MAX_QUIET_CONNS_PER_USER`] of them, its least recently heard one
    /// is forgotten.
    pub(super) fn forget_quiet_beyond(&mut self, uid: u32) {
        if trusted_uid(uid) {
            return;
        }
        let mine = |c: &Conn| c.pid.is_none() && c.cred.is_some_and(|p| p.uid == uid);
        if self.conns.values().filter(|c| mine(c)).count() < MAX_QUIET_CONNS_PER_USER {
            return;
        }
        let oldest = self
            .conns
            .iter()
            .filter(|(route, c)| matches!(route, Route::Peer(_)) && mine(c))
            .min_by_key(|(_, c)| c.last_seen)
            .map(|(route, _)| route.clone());
        if let Some(route) = oldest {
            self.forget(&route);
        }
    }

    /// Forgets, once a minute, the connections [`quiet_conns`] names.
    pub(super) fn forget_quiet_conns(&mut self) {
        if self.last_quiet_sweep.elapsed() < Duration::from_secs(60) {
            return;
        }
        self.last_quiet_sweep = Instant::now();
        for identity in quiet_conns(&self.conns, Instant::now()) {
            debug!("a connection said nothing for {QUIET_CONN:?}; forgotten");
            self.forget(&identity);
        }
    }

    /// Releases everything held by the connections of process `pid`.
    pub(super) fn process_gone(&mut self, pid: u32) {
        self.watched.remove(&pid);
        let gone: Vec<(Route, ClientId)> = self
            .conns
            .iter()
            .filter(|(_, c)| c.pid == Some(pid))
            .map(|(i, c)| (i.clone(), c.id))
            .collect();
        for (identity, id) in gone {
            if self.loud(id) {
                info!("client {id} (pid {pid}) is gone; releasing its token and memory");
            } else {
                debug!("client {id} (pid {pid}) is gone; releasing its token and memory");
            }
            self.forget(&identity);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn connections_that_never_said_hello_are_forgotten_when_quiet() {
        let t0 = Instant::now();
        let conn = |id, pid| Conn {
            id,
            delimited: false,
            cred: None,
            pid,
            last_seen: t0,
            version: PROTOCOL_VERSION,
            build: String::new(),
            started: None,
        };
        let mut conns = HashMap::new();
        let route = |id: &[u8]| Route::Peer(id.to_vec());
        conns.insert(route(b"status"), conn(1, None));
        conns.insert(route(b"hooked"), conn(2, Some(42)));
        conns.insert(route(b"recent"), conn(3, None));
        conns.get_mut(&route(b"recent")).unwrap().last_seen = t0 + QUIET_CONN;
        assert!(quiet_conns(&conns, t0 + QUIET_CONN / 2).is_empty());
        // A process's connection is forgotten when the process ends, never
        // for being quiet; one that spoke lately is kept.
        assert_eq!(quiet_conns(&conns, t0 + QUIET_CONN), [route(b"status")]);
    }

    #[test]
    fn cgroups_of_every_hierarchy_unified_first() {
        // Slurm's cgroup v1 plugin on a hybrid host: the job is in the
        // freezer hierarchy only, the unified one says `/`.
        let text = "9:name=systemd:/\n6:freezer:/slurm/uid_0/job_5/step_batch\n5:devices:/\n0::/\n";
        assert_eq!(
            cgroup_paths(text),
            ["/", "/slurm/uid_0/job_5/step_batch"].map(String::from)
        );
        assert_eq!(
            cgroup_paths("0::/system.slice/slurmstepd.scope/job_7/step_0\n"),
            ["/system.slice/slurmstepd.scope/job_7/step_0".to_string()]
        );
    }

    #[test]
    fn peer_address_of_ipc_peer() {
        assert_eq!(
            parse_peer_address(":1000:100:4242"),
            Some(PeerCred {
                uid: 1000,
                gid: 100,
                pid: 4242
            })
        );
        assert_eq!(
            parse_peer_address("/tmp/x.sock:0:0:1"),
            Some(PeerCred {
                uid: 0,
                gid: 0,
                pid: 1
            })
        );
        assert_eq!(parse_peer_address(""), None);
        assert_eq!(parse_peer_address("127.0.0.1"), None);
    }
}
