//! The connection to `gem-schd`: one DEALER socket per process, shared by
//! its threads (requests carry sequence numbers; a reply for another
//! thread is kept until that thread looks). Created on first use, never in
//! a load-time constructor. Handles the scheduler being absent at start
//! (a clear message, then wait, up to `GEMINI_CONNECT_TIMEOUT`), being
//! restarted or upgraded (the new one does not know us: say hello again
//! with the memory we hold, then repeat the request), being older (it
//! answers in its protocol version: speak that), speaking a version this
//! build does not (one line on stderr, then wait as for an absent one, so
//! nothing runs ungated and installing a matching gem-schd lets the program
//! go on), and refusing us (unknown group: one line on stderr, then every
//! gated call fails).

use crate::log::{debug, error};
use crate::state::{State, lock};
use gemini_client::{Client, ClientError};
use gemini_protocol::{CodecError, ErrorKind, ErrorReply, HeldMemory, Reply, Request, Role};
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use crate::cuda::{CUDA_ERROR_DEINITIALIZED, CUDA_ERROR_NOT_INITIALIZED, CUDA_ERROR_NOT_PERMITTED};

/// How long one poll holds the socket lock.
const POLL: Duration = Duration::from_millis(1);
/// Silence after which a waiting request checks the scheduler still knows
/// us (it may have restarted and forgotten the request).
const PING_AFTER: Duration = Duration::from_secs(1);
/// How long the answer to a request sent behind the hello is waited for,
/// once the hello was answered, before it is asked anew (see
/// [`State::answer_ahead`]): it comes right behind the welcome, or not at
/// all.
const AHEAD_WAIT: Duration = Duration::from_millis(250);
/// The longest the thread running the exit handler waits for the
/// scheduler's answers, all of them together (see `gate::at_exit`).
const EXIT_WAIT: Duration = Duration::from_millis(500);

std::thread_local! {
    /// Until when (ns, `clock::now_ns`) this thread, running the exit
    /// handler, waits for the scheduler (0: it does not exit). Per
    /// thread: the program's other threads still run, and their calls
    /// wait as ever.
    static EXIT_BY: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// This thread runs the process's exit handler: until [`exited`], its
/// requests wait for the scheduler [`EXIT_WAIT`] in all, and none
/// registers again.
pub fn exiting() {
    let by = crate::clock::now_ns() + EXIT_WAIT.as_nanos() as u64;
    EXIT_BY.with(|c| c.set(by));
}

/// The exit handler is done: what runs after it on this thread (other
/// exit handlers, static destructors) waits for the scheduler as ever.
pub fn exited() {
    EXIT_BY.with(|c| c.set(0));
}

/// Until when this thread waits for the scheduler, running the exit
/// handler (see [`exiting`]; 0: it does not exit).
fn exit_by() -> u64 {
    EXIT_BY.with(|c| c.get())
}

/// Whether this thread runs the exit handler and its time to wait for
/// the scheduler is over (see `gate::at_exit`).
fn exit_overdue() -> bool {
    let exit_by = exit_by();
    exit_by != 0 && crate::clock::now_ns() >= exit_by
}

/// Whether this thread runs the exit handler (see [`exiting`]).
fn is_exiting() -> bool {
    exit_by() != 0
}

/// Why a request got no usable answer.
enum Failure {
    /// The scheduler forgot us: register again and repeat.
    Forgotten,
    /// Give up with this CUDA result.
    Refused(u32),
}

impl State {
    fn refuse(&self, code: u32) -> u32 {
        self.refused.store(code, Ordering::Release);
        code
    }

    fn open(&self) -> Result<(), u32> {
        let mut g = lock(&self.conn);
        if g.is_some() {
            return Ok(());
        }
        match crate::link::client(&self.settings.ipc_dir) {
            Ok(c) => {
                *g = Some(c);
                Ok(())
            }
            Err(ClientError::Denied(message)) => {
                error!(
                    "{message}; CUDA launches and allocations will fail with CUDA_ERROR_NOT_PERMITTED"
                );
                Err(self.refuse(CUDA_ERROR_NOT_PERMITTED))
            }
            Err(e) => {
                error!("{e}; CUDA launches and allocations will fail");
                Err(self.refuse(CUDA_ERROR_NOT_INITIALIZED))
            }
        }
    }

    /// The connection's lock. The thread running the exit handler only
    /// tries it until its deadline (`None` then): the handler may run
    /// in a signal handler that interrupted this very thread while it
    /// held the lock (a program whose SIGTERM handler calls `exit`), or
    /// another thread may hold it for as long as the scheduler is slow.
    fn conn(&self) -> Option<std::sync::MutexGuard<'_, Option<Client>>> {
        let exit_by = exit_by();
        if exit_by == 0 {
            return Some(lock(&self.conn));
        }
        loop {
            match self.conn.try_lock() {
                Ok(g) => return Some(g),
                Err(std::sync::TryLockError::Poisoned(p)) => return Some(p.into_inner()),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
            if crate::clock::now_ns() >= exit_by {
                return None;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
    }

    fn send(&self, req: &Request) -> Result<u32, u32> {
        let Some(mut g) = self.conn() else {
            return Err(CUDA_ERROR_DEINITIALIZED);
        };
        let Some(c) = g.as_mut() else {
            return Err(CUDA_ERROR_NOT_INITIALIZED);
        };
        c.send(req).map_err(|e| {
            error!("cannot send to the scheduler: {e}");
            CUDA_ERROR_NOT_INITIALIZED
        })
    }

    /// The reply to `seq` if it has arrived (polling the socket briefly;
    /// replies for other threads' requests are kept for them).
    fn take(&self, seq: u32) -> Option<Result<Reply, CodecError>> {
        self.take_within(seq, POLL)
    }

    /// [`State::take`], polling at most `wait`.
    fn take_within(&self, seq: u32, wait: Duration) -> Option<Result<Reply, CodecError>> {
        let mut g = self.conn()?;
        g.as_mut()?.take(seq, wait).ok().flatten()
    }

    /// The protocol version the connection speaks.
    pub(crate) fn speaks(&self) -> u16 {
        lock(&self.conn)
            .as_ref()
            .map_or(gemini_protocol::PROTOCOL_VERSION, Client::version)
    }

    fn held_memory(&self) -> Vec<HeldMemory> {
        lock(&self.reserved)
            .iter()
            .filter(|(_, b)| **b > 0)
            .map(|(&device, &bytes)| HeldMemory { device, bytes })
            .collect()
    }

    /// Says hello until the scheduler answers (or the connect timeout
    /// passes).
    fn register(&self) -> Result<(), u32> {
        self.register_with(&[])
    }

    /// [`State::register`], sending `ahead` right behind the first hello
    /// (see [`State::send_ahead`]): the scheduler reads them in order, so
    /// one wait serves all. They are kept only where that hello is the
    /// one welcomed: a hello sent again forgets them, and a refusal or a
    /// time-out fails every later call anyway. (A scheduler of 0.1.0
    /// answers what it cannot read with sequence number 0, which is taken
    /// for the hello waited for: its refusals of those sent ahead may
    /// cost a hello or two more, each answered "already registered".)
    fn register_with(&self, ahead: &[Request]) -> Result<(), u32> {
        // Before any lock of ours (see `link::functions`).
        crate::link::load_early();
        let _g = lock(&self.register);
        if self.registered.load(Ordering::Acquire) {
            return Ok(());
        }
        let mut ahead = ahead;
        let code = self.refused.load(Ordering::Acquire);
        if code != 0 {
            return Err(code);
        }
        // Without GEMINI_GROUP_NAME the scheduler places the process by
        // its cgroup (a group's `Cgroups`), or refuses it saying so.
        let group = self.settings.group.clone().unwrap_or_default();
        self.open()?;
        let start = Instant::now();
        let job = lock(&self.job).clone();
        let hello = gemini_client::hello(Role::Client, &group, &self.held_memory(), job.as_deref());
        // A scheduler that is not up yet gets it from the socket's queue
        // when it starts. It is sent again all the same, after 1, 2, 4 …
        // up to 32 s, as one written to a scheduler that died before
        // reading it is lost; the latest is the one waited for (queued
        // ones arrive in order, and a second hello is answered "already
        // registered"). The back-off keeps a long wait from filling the
        // socket's queue, which would block the send.
        let mut warned = false;
        let mut told_version = false;
        let mut seq = 0;
        let mut next_send = Instant::now();
        let mut resend_after = Duration::from_secs(1);
        // A scheduler upgraded since we last spoke may speak our version
        // again; an older one answers in its own, which we then speak.
        if let Some(c) = lock(&self.conn).as_mut() {
            c.speak_newest();
        }
        'hello: loop {
            if Instant::now() >= next_send {
                seq = self.send_hello(&hello, std::mem::take(&mut ahead))?;
                next_send = Instant::now() + resend_after;
                resend_after = (resend_after * 2).min(Duration::from_secs(32));
            }
            let asked = Instant::now();
            while asked.elapsed() < Duration::from_secs(1) {
                match self.take(seq) {
                    None => continue,
                    Some(Ok(Reply::Welcome {
                        config_path,
                        client,
                        ..
                    })) => {
                        debug!("registered with the scheduler as group {group:?} ({config_path})");
                        self.client_id.store(client, Ordering::Release);
                        self.registered.store(true, Ordering::Release);
                        return Ok(());
                    }
                    Some(Ok(Reply::Error(e))) if e.kind == ErrorKind::AlreadyRegistered => {
                        drop(self.cleared_ahead());
                        self.registered.store(true, Ordering::Release);
                        return Ok(());
                    }
                    Some(Ok(Reply::Error(e)))
                        if e.kind == ErrorKind::ProtocolMismatch
                            && self.speaks() < gemini_protocol::PROTOCOL_VERSION =>
                    {
                        // An older scheduler, which answered in its
                        // version: say hello again in it, now.
                        debug!(
                            "the scheduler speaks protocol v{}; speaking it",
                            self.speaks()
                        );
                        next_send = Instant::now();
                        continue 'hello;
                    }
                    Some(Ok(Reply::Error(ErrorReply {
                        kind: ErrorKind::ProtocolMismatch,
                        message,
                    }))) => {
                        if !std::mem::replace(&mut told_version, true) {
                            error!(
                                "{message}; CUDA launches and allocations wait until a gem-schd that speaks this libgemhook.so's protocol answers"
                            );
                        }
                        warned = true;
                        break;
                    }
                    Some(Err(CodecError::VersionMismatch { peer, .. })) => {
                        // Neither of us speaks the other's version: wait,
                        // gated, as for an absent scheduler (below).
                        if !std::mem::replace(&mut told_version, true) {
                            error!(
                                "the scheduler at {} speaks gemini protocol v{peer}, which this libgemhook.so ({}, protocol v{} to v{}) does not; CUDA launches and allocations wait until a gem-schd that speaks it answers{} (install matching versions; `gem-schd status` lists this process as refused)",
                                self.settings
                                    .ipc_dir
                                    .join(gemini_protocol::SCHEDULER_SOCKET)
                                    .display(),
                                gemini_protocol::BUILD,
                                gemini_protocol::OLDEST_PROTOCOL,
                                gemini_protocol::PROTOCOL_VERSION,
                                match self.settings.connect_timeout {
                                    Some(t) => format!(" (up to {t:?}, GEMINI_CONNECT_TIMEOUT)"),
                                    None => String::new(),
                                }
                            );
                        }
                        warned = true;
                        break;
                    }
                    Some(Ok(Reply::Error(e))) => {
                        let what = match e.kind {
                            ErrorKind::UnknownGroup => "unknown group",
                            _ => "refused by the scheduler",
                        };
                        error!(
                            "{what}: {}; CUDA launches and allocations will fail with CUDA_ERROR_NOT_PERMITTED",
                            e.message
                        );
                        return Err(self.refuse(CUDA_ERROR_NOT_PERMITTED));
                    }
                    Some(Ok(other)) => {
                        error!("unexpected answer to hello: {other:?}");
                        return Err(self.refuse(CUDA_ERROR_NOT_PERMITTED));
                    }
                    Some(Err(e)) => {
                        error!(
                            "{e}; CUDA launches and allocations will fail with CUDA_ERROR_NOT_PERMITTED"
                        );
                        return Err(self.refuse(CUDA_ERROR_NOT_PERMITTED));
                    }
                }
            }
            // Unanswered for a second: connecting says whether the kernel
            // refuses us the socket (a security module's refusal of the
            // connection too, which the check made before connecting,
            // on the path, does not see).
            let socket = gemini_protocol::endpoint::scheduler_socket_path(&self.settings.ipc_dir);
            if let Some(path) = gemini_protocol::endpoint::socket_refused(socket) {
                error!(
                    "{}; CUDA launches and allocations will fail with CUDA_ERROR_NOT_PERMITTED",
                    gemini_protocol::endpoint::denied_message(&path)
                );
                return Err(self.refuse(CUDA_ERROR_NOT_PERMITTED));
            }
            if !warned {
                warned = true;
                error!(
                    "no scheduler answers at {} (start it with `gem-schd --config /etc/gemini/resource.conf`); waiting{}",
                    self.settings
                        .ipc_dir
                        .join(gemini_protocol::SCHEDULER_SOCKET)
                        .display(),
                    match self.settings.connect_timeout {
                        Some(t) => format!(" up to {t:?} (GEMINI_CONNECT_TIMEOUT)"),
                        None =>
                            " (set GEMINI_CONNECT_TIMEOUT to give up after a while)".to_string(),
                    }
                );
            }
            if self
                .settings
                .connect_timeout
                .is_some_and(|t| start.elapsed() >= t)
            {
                error!(
                    "gave up waiting for the scheduler; CUDA launches and allocations will fail with CUDA_ERROR_NOT_INITIALIZED"
                );
                return Err(self.refuse(CUDA_ERROR_NOT_INITIALIZED));
            }
        }
    }

    /// Sends `hello`, then `ahead` behind it (kept for the calls that
    /// want their answers); the hello's sequence number. What was sent
    /// ahead before a scheduler's restart, or behind a hello sent again
    /// (no answer, or in an older version), is answered late or not at
    /// all: forgotten.
    fn send_hello(&self, hello: &Request, ahead: &[Request]) -> Result<u32, u32> {
        let mut kept = self.cleared_ahead();
        let seq = self.send(hello)?;
        if let Some(k) = kept.as_mut() {
            self.send_kept(k, ahead);
        }
        Ok(seq)
    }

    /// Sends `req` and waits for its reply; with when it was sent (ns on
    /// `CLOCK_MONOTONIC`, just before the send). A request sent ahead is
    /// not sent again (unless its answer does not come, see
    /// [`State::answer_ahead`]), and its wait, which began behind others,
    /// is not a sample of the round trip.
    fn roundtrip(&self, req: &Request, device: u32) -> Result<(Reply, u64), Failure> {
        if let Some(seq) = self.take_ahead(req) {
            let asked = crate::clock::now_ns();
            if let Some(reply) = self.answer_ahead(seq)? {
                return Ok((reply, asked));
            }
        }
        let sent = crate::clock::now_ns();
        let seq = self.send_new(req).map_err(Failure::Refused)?;
        let token = matches!(req, Request::AcquireToken { .. });
        let reply = self.wait_for(seq, device, token)?;
        let elapsed = crate::clock::now_ns().saturating_sub(sent);
        if let Some(ns) = gemini_protocol::roundtrip::sample_of(req, &reply, elapsed) {
            self.rtt.sample(ns);
        }
        Ok((reply, sent))
    }

    /// Sends `reqs` now (registering first, right behind the hello, if
    /// need be), for calls that will want their answers: a call of the
    /// same request takes its answer instead of asking. Only until any
    /// other request is sent, after which the answers could predate a
    /// change of ours (a reservation after a memory view), and they are
    /// forgotten. The answers not taken stay in the connection's bounded
    /// store of replies until it drops them.
    pub fn send_ahead(&self, reqs: &[Request]) {
        // (Exiting: nothing registers again, and the calls ask anew.)
        if is_exiting() {
            return;
        }
        if !self.registered.load(Ordering::Acquire) {
            let _ = self.register_with(reqs);
            return;
        }
        // Held across the sends: a request another thread sends between
        // two of them forgets them all, or waits.
        if let Some(mut kept) = self.cleared_ahead() {
            self.send_kept(&mut kept, reqs);
        }
    }

    /// Sends `reqs`, keeping each sent with its sequence number in `kept`.
    fn send_kept(&self, kept: &mut Vec<(Request, u32)>, reqs: &[Request]) {
        for req in reqs {
            if let Ok(seq) = self.send(req) {
                kept.push((req.clone(), seq));
            }
        }
    }

    /// The requests sent ahead. The thread running the exit handler only
    /// tries the lock (`None`: it is held), as for the connection's (see
    /// [`State::conn`]).
    fn ahead_lock(&self) -> Option<std::sync::MutexGuard<'_, Vec<(Request, u32)>>> {
        if !is_exiting() {
            return Some(lock(&self.ahead));
        }
        match self.ahead.try_lock() {
            Ok(g) => Some(g),
            Err(std::sync::TryLockError::Poisoned(p)) => Some(p.into_inner()),
            Err(std::sync::TryLockError::WouldBlock) => None,
        }
    }

    /// [`State::ahead_lock`], with the requests sent ahead forgotten: held
    /// across a send, none is sent between.
    fn cleared_ahead(&self) -> Option<std::sync::MutexGuard<'_, Vec<(Request, u32)>>> {
        let mut kept = self.ahead_lock()?;
        kept.clear();
        Some(kept)
    }

    /// The sequence number of `req` if it was sent ahead (see
    /// [`State::send_ahead`]), taken out of those kept.
    fn take_ahead(&self, req: &Request) -> Option<u32> {
        let mut kept = self.ahead_lock()?;
        let at = kept.iter().position(|(r, _)| r == req)?;
        Some(kept.swap_remove(at).1)
    }

    /// The answer to `seq`, a request sent ahead, if it comes within
    /// [`AHEAD_WAIT`]; `None`: it was lost, and is to be asked anew. gem-schd
    /// keeps a new connection's messages while it looks its user up, 64
    /// at most for all of the user's new connections, and drops the rest:
    /// a hello is said again after a second, but what was sent behind it
    /// was waited for forever (a hooked program of 64 started together hung
    /// in its first `cuDevicePrimaryCtxRetain`). The hello was answered
    /// before this is asked, and gem-schd answers a connection's requests
    /// in order: the answer is on its way, or never comes.
    fn answer_ahead(&self, seq: u32) -> Result<Option<Reply>, Failure> {
        let until = Instant::now() + AHEAD_WAIT;
        loop {
            // Exiting: past the exit's deadline nothing is waited for.
            if exit_overdue() {
                return Ok(None);
            }
            match self.take(seq) {
                Some(r) if forgets_us(&r) => return Err(Failure::Forgotten),
                Some(Ok(r)) => return Ok(Some(r)),
                Some(Err(e)) => {
                    debug!("unreadable answer to a request sent ahead: {e}; asking again");
                    return Ok(None);
                }
                None if Instant::now() >= until => {
                    debug!("no answer to request {seq}, sent behind the hello; asking again");
                    return Ok(None);
                }
                None => {}
            }
        }
    }

    /// Sends a request not sent ahead: those sent ahead are forgotten
    /// (under their lock, so none is sent between). The thread running
    /// the exit handler sends even where it cannot take that lock: what it
    /// sends (the token's end, late usage) changes neither a memory view
    /// nor the GPU map, the only requests sent ahead.
    fn send_new(&self, req: &Request) -> Result<u32, u32> {
        let _kept = self.cleared_ahead();
        self.send(req)
    }

    /// Waits for the reply to `seq` (a request about `device`), checking
    /// with pings that the scheduler still knows us. A wait for `device`'s
    /// token (`token`) pings by asking why it waits, and says once on
    /// stderr when another group's reservation of the device is why.
    fn wait_for(&self, seq: u32, device: u32, token: bool) -> Result<Reply, Failure> {
        let mut last = Instant::now();
        // When the scheduler last answered anything (a ping while a token
        // request waits its turn counts): GEMINI_CONNECT_TIMEOUT bounds
        // silence mid-run too, not only at the start.
        let mut heard = Instant::now();
        let mut ping: Option<u32> = None;
        let mut warned = false;
        loop {
            match self.take(seq) {
                Some(r) if forgets_us(&r) => return Err(Failure::Forgotten),
                Some(Ok(r)) => return Ok(r),
                Some(Err(e)) => {
                    error!("unreadable answer from the scheduler: {e}");
                    return Err(Failure::Refused(self.refuse(CUDA_ERROR_NOT_PERMITTED)));
                }
                None => {}
            }
            // Exiting (see `gate::at_exit`): a scheduler that does not
            // answer soon must not hold the process's exit.
            if exit_overdue() {
                return Err(Failure::Refused(CUDA_ERROR_DEINITIALIZED));
            }
            if let Some(p) = ping {
                match self.take(p) {
                    Some(r) if forgets_us(&r) => return Err(Failure::Forgotten),
                    Some(r) => {
                        if let Ok(Reply::WaitReason {
                            reserved: Some(held),
                        }) = r
                        {
                            self.say_reserved(device, &held);
                        }
                        ping = None;
                        last = Instant::now();
                        heard = last;
                    }
                    None => {}
                }
            }
            // A ping unanswered for as long is asked again: one written to
            // a scheduler killed before it read it is lost, and the request
            // with it (its late answer, if any, is dropped with the stash).
            // (A scheduler of protocol 15 or older has no WaitReason.)
            if last.elapsed() >= PING_AFTER {
                let ask = if token && self.speaks() >= 16 {
                    Request::WaitReason { device }
                } else {
                    Request::MemoryInfo { device }
                };
                ping = self.send(&ask).ok();
                last = Instant::now();
            }
            if heard.elapsed() >= 5 * PING_AFTER && !warned {
                warned = true;
                error!(
                    "the scheduler does not answer; waiting for it to come back{}",
                    match self.settings.connect_timeout {
                        Some(t) => format!(" up to {t:?} (GEMINI_CONNECT_TIMEOUT)"),
                        None => String::new(),
                    }
                );
            }
            if let Some(t) = self.settings.connect_timeout
                && heard.elapsed() >= t.max(5 * PING_AFTER)
            {
                error!(
                    "the scheduler has not answered for {:?} (GEMINI_CONNECT_TIMEOUT); CUDA launches and allocations will fail with CUDA_ERROR_NOT_INITIALIZED",
                    heard.elapsed()
                );
                return Err(Failure::Refused(self.refuse(CUDA_ERROR_NOT_INITIALIZED)));
            }
        }
    }

    /// Says once per device and group, on stderr whatever `GEMINI_LOG`
    /// says, that this program waits for `device` because it is reserved
    /// for another group: a program that stalls must say why.
    fn say_reserved(&self, device: u32, held: &gemini_protocol::ReservedFor) {
        static TOLD: std::sync::Mutex<Vec<(u32, String)>> = std::sync::Mutex::new(Vec::new());
        let key = (device, held.group.clone());
        {
            let mut told = lock(&TOLD);
            if told.contains(&key) {
                return;
            }
            told.push(key);
        }
        let whose = if held.user.is_empty() {
            String::new()
        } else {
            format!(" of user {}", held.user)
        };
        let until = match held.left_us {
            Some(us) => format!(
                "for {} more",
                gemini_protocol::units::format_length(Duration::from_micros(us))
            ),
            None => "until its program ends".to_string(),
        };
        let mine = match self.settings.group.as_deref() {
            Some(g) if !g.is_empty() => format!(" (group {g})"),
            _ => String::new(),
        };
        error!(
            "GPU {device} is reserved for group {}{whose} {until}; this program{mine} waits for it (gem-launch status lists the reservations)",
            held.group
        );
    }

    /// Sends `req` and waits for its reply, registering first and again
    /// after a scheduler restart. `Err` is the CUDA result to return.
    pub fn call(&self, req: &Request, device: u32) -> Result<Reply, u32> {
        self.call_sent(req, device).map(|(reply, _)| reply)
    }

    /// [`State::call`], with when the request that was answered was sent
    /// (ns on `CLOCK_MONOTONIC`): after a registration, or a scheduler's
    /// restart, that is the last send.
    pub fn call_sent(&self, req: &Request, device: u32) -> Result<(Reply, u64), u32> {
        loop {
            if !self.registered.load(Ordering::Acquire) {
                // (Exiting: nothing of a new registration to report.)
                if is_exiting() {
                    return Err(CUDA_ERROR_DEINITIALIZED);
                }
                self.register()?;
            }
            match self.roundtrip(req, device) {
                Ok(r) => return Ok(r),
                Err(Failure::Refused(code)) => return Err(code),
                // (Exiting: a scheduler that forgot us holds no token of
                // ours either, and nothing registers again.)
                Err(Failure::Forgotten) if is_exiting() => return Err(CUDA_ERROR_DEINITIALIZED),
                Err(Failure::Forgotten) => self.forgotten(),
            }
        }
    }

    /// The protocol version the scheduler speaks, registering first if
    /// need be. `Err` is the CUDA result to return.
    pub fn speaks_registered(&self) -> Result<u16, u32> {
        if !self.registered.load(Ordering::Acquire) {
            if is_exiting() {
                return Err(CUDA_ERROR_DEINITIALIZED);
            }
            self.register()?;
        }
        Ok(self.speaks())
    }

    /// The scheduler answered that it does not know us (it restarted): the
    /// next request registers again.
    fn forgotten(&self) {
        error!("the scheduler restarted; registering again");
        self.registered.store(false, Ordering::Release);
    }
}

impl State {
    /// Sends `req` (registering first if need be) without waiting for its
    /// reply: its sequence number, for [`State::answer_within`] and
    /// [`State::answer`]. `Err` is the CUDA result to return.
    pub fn ask(&self, req: &Request) -> Result<u32, u32> {
        if !self.registered.load(Ordering::Acquire) {
            self.register()?;
        }
        self.send_new(req)
    }

    /// The reply to `seq`, sent with [`State::ask`], if it comes within
    /// `wait` (zero: one poll, no wait): `Some(None)` if the scheduler
    /// forgot the request (it restarted) or the reply cannot be read.
    pub fn answer_within(&self, seq: u32, wait: Duration) -> Option<Option<Reply>> {
        // Waits of POLL each (the socket's poll counts whole ms; shorter
        // ones would spin, and a spinning thread kept the scheduler from
        // answering on a 2-core machine): each returns as a reply comes.
        let deadline = Instant::now() + wait;
        let taken = loop {
            let poll = if wait.is_zero() { Duration::ZERO } else { POLL };
            match self.take_within(seq, poll) {
                Some(r) => break r,
                None if Instant::now() >= deadline => return None,
                None => {}
            }
        };
        match taken {
            r if forgets_us(&r) => {
                self.registered.store(false, Ordering::Release);
                Some(None)
            }
            Ok(r) => Some(Some(r)),
            Err(e) => {
                error!("unreadable answer from the scheduler: {e}");
                Some(None)
            }
        }
    }

    /// Waits for the reply to `seq`, sent with [`State::ask`]: `Ok(None)`
    /// if the scheduler forgot the request (it restarted; ask again with
    /// [`State::call`]). `Err` is the CUDA result to return.
    pub fn answer(&self, seq: u32, device: u32) -> Result<Option<Reply>, u32> {
        match self.wait_for(seq, device, true) {
            Ok(r) => Ok(Some(r)),
            Err(Failure::Refused(code)) => Err(code),
            Err(Failure::Forgotten) => {
                self.forgotten();
                Ok(None)
            }
        }
    }
}

/// The answer says the scheduler does not know this connection: it
/// restarted, or it was replaced by one of an older protocol version that
/// did not read the request, or by one of a version we do not speak.
/// Registering again (in its version, or waiting for one we speak) and
/// repeating the request is the answer to all three.
fn forgets_us(answer: &Result<Reply, CodecError>) -> bool {
    match answer {
        Ok(Reply::Error(e)) => matches!(
            e.kind,
            ErrorKind::NotRegistered | ErrorKind::ProtocolMismatch
        ),
        Err(CodecError::VersionMismatch { .. }) => true,
        _ => false,
    }
}

/// The scheduler refused this group a GPU (`Devices=`): said once per
/// process whatever `GEMINI_LOG` says, then only with it; the call gets
/// `CUDA_ERROR_NOT_PERMITTED`.
pub fn not_permitted(message: &str) -> u32 {
    static TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if !TOLD.swap(true, Ordering::Relaxed) {
        error!("refused by gemini: {message}; the call gets CUDA_ERROR_NOT_PERMITTED");
    } else {
        crate::log::debug!("refused by gemini: {message}");
    }
    CUDA_ERROR_NOT_PERMITTED
}
