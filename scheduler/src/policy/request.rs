//! Requests: hello and the admission of a client, and dispatch of the
//! rest to the token, memory, holder and reservation handlers.

use super::report::Proof;
use super::{
    Action, Client, GroupKey, MAX_DEVICES, Micros, Policy, Waiter, configured, error, memory,
};
use gemini_config::Latency;
use gemini_protocol::{ClientId, DeviceId, ErrorKind, HeldMemory, Reply, Request, Role, Span};
use std::collections::BTreeMap;

/// A process whose bursts are at most this long (µs, as its hook predicts
/// them) has its token asked ahead served even while another group has
/// the device: a round trip at its launch (0.1-0.3 ms) is a large part of
/// such a step, and declining it made a normal-class decode step (0.8 ms)
/// beside training 2.1× its time alone at the median instead of 1.0-1.2×.
/// Longer bursts lose 1 % or so to the round trip, and their requests
/// queued ahead pulled groups quiet between steps into step.
const AHEAD_SHORT_BURST: Micros = 2_000;

/// The longest time to its launch a token asked ahead is taken to say:
/// a hook asks at most five round trips ahead (1 ms at 200 µs). A longer
/// claim moves only the asker's own group's learned return, and no
/// further than this.
const AHEAD_LAUNCH_MAX: Micros = 2_000;

/// A token asked ahead ([`Request::AcquireTokenAhead`]): the burst it is
/// for, the client's round trip (as it says: a false one moves only its
/// own group's return, and within [`AHEAD_LAUNCH_MAX`]), and its launch,
/// µs from when the request was sent (at most [`AHEAD_LAUNCH_MAX`]).
struct Ahead {
    burst_us: Micros,
    rtt_us: u32,
    launch_in: Micros,
}

/// The longest job name kept (bytes): a bound on what a client can make
/// the daemon hold.
const MAX_JOB_NAME: usize = 256;

/// Separates a job's name from its group and user in [`job_key`].
const JOB_SCOPE: char = '\u{1f}';

/// The key of the job `name` of `uid`'s processes in `group`: the name,
/// then the group and the uid, after [`JOB_SCOPE`] (taken out of the
/// name, so no name can end in another's scope).
pub(super) fn job_key(name: &str, group: &str, uid: u32) -> String {
    let name: String = name.chars().filter(|&c| c != JOB_SCOPE).collect();
    format!("{name}{JOB_SCOPE}{group}{JOB_SCOPE}{uid}")
}

/// The name of the job of key `key` ([`job_key`]), as its launcher said it.
pub(super) fn job_name(key: &str) -> &str {
    key.split(JOB_SCOPE).next().unwrap_or(key)
}

/// Who asks, once registered: the connection, the request's sequence
/// number, and the connection's role.
#[derive(Debug, Clone, Copy)]
struct Asker {
    client: ClientId,
    seq: u32,
    role: Role,
}

impl Asker {
    /// The reply to the request.
    fn reply(&self, reply: Reply) -> Action {
        Action::Reply {
            client: self.client,
            seq: self.seq,
            reply,
        }
    }
}

/// The device a request is about, if it is about one.
fn device_of(req: &Request) -> Option<DeviceId> {
    match req {
        Request::AcquireToken { device, .. }
        | Request::AcquireTokenAhead { device, .. }
        | Request::ReleaseToken { device, .. }
        | Request::Quieting { device, .. }
        | Request::RunningOut { device, .. }
        | Request::ReserveMemory { device, .. }
        | Request::ReleaseMemory { device, .. }
        | Request::ReserveLeased { device, .. }
        | Request::ReturnLease { device, .. }
        | Request::NeedMemory { device, .. }
        | Request::ContextCost { device, .. }
        | Request::MemoryInfo { device } => Some(*device),
        _ => None,
    }
}

impl Policy {
    /// Answers request `seq` of connection `client`: what needs no
    /// registration first, then a reservation only of a group its peer may
    /// join, and, from a registered client, a request about a device it
    /// may use, by its handler.
    pub(super) fn request(
        &mut self,
        client: ClientId,
        seq: u32,
        req: Request,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let Some(req) = self.screen(client, seq, req, out) else {
            return;
        };
        let answer = |reply: Reply| Action::Reply { client, seq, reply };
        if let Request::Reserve { group, .. } | Request::ReserveFor { group, .. } = &req
            && let Some(r) = self.refuse_reserve(client, group)
        {
            out.push(answer(r));
            return;
        }
        let Some(c) = self.clients.get(&client) else {
            out.push(answer(error(
                ErrorKind::NotRegistered,
                "say hello first: this connection has not registered",
            )));
            return;
        };
        if let Some(r) = self.refuse_device(c, &req) {
            out.push(answer(r));
            return;
        }
        let asker = Asker {
            client,
            seq,
            role: c.role,
        };
        self.dispatch(asker, req, now, out);
    }

    /// Answers what needs no registration: hello, stop and reload (and
    /// status and GPUs, which only the daemon answers). Returns the other
    /// requests.
    fn screen(
        &mut self,
        client: ClientId,
        seq: u32,
        req: Request,
        out: &mut Vec<Action>,
    ) -> Option<Request> {
        let answer = |reply: Reply| Action::Reply { client, seq, reply };
        match req {
            Request::Hello {
                role,
                group,
                pid,
                held,
                job,
                build: _,
            } => {
                // The kernel's word wins over the claim.
                let pid = self.peer(client).map_or(pid, |p| p.pid);
                let r = self.admit(client, role, group, pid, held);
                let welcomed = matches!(r, Reply::Welcome { .. });
                if welcomed && let Some(job) = job {
                    self.declare_job(client, job);
                }
                out.push(answer(r));
                if welcomed {
                    out.push(Action::Watch { client, pid });
                }
                None
            }
            Request::Shutdown => {
                match self.refuse_admin(client, "stop") {
                    Some(r) => out.push(answer(r)),
                    None => {
                        out.push(answer(Reply::Done));
                        out.push(Action::Stop);
                    }
                }
                None
            }
            Request::Reload => {
                match self.refuse_admin(client, "reload") {
                    Some(r) => out.push(answer(r)),
                    None => out.push(Action::Reload { client, seq }),
                }
                None
            }
            Request::Status | Request::Gpus { .. } => {
                // Answered by the shell, which knows the process-level facts.
                out.push(answer(error(
                    ErrorKind::Unexpected,
                    "status and GPUs are answered by the daemon",
                )));
                None
            }
            _ => Some(req),
        }
    }

    /// Refuses a reservation of `group` to `client` unless it may join
    /// the group: whoever may join it may reserve its GPUs (its
    /// AllowedUsers and AllowedGroups, and its Cgroups).
    fn refuse_reserve(&self, client: ClientId, group: &str) -> Option<Reply> {
        let outside = || {
            let p = self.limited_peer(client)?;
            self.place(client, p.pid, group).err()
        };
        self.refuse_access(client, Role::Control, group)
            .or_else(outside)
    }

    /// Refuses a request of `c` about a device out of range, or, from a
    /// hooked process, about its time or memory on a device its group's
    /// `Devices` leaves out (a query is answered).
    fn refuse_device(&self, c: &Client, req: &Request) -> Option<Reply> {
        let d = device_of(req)?;
        if d >= MAX_DEVICES {
            return Some(error(
                ErrorKind::BadRequest,
                format!("device {d} is out of range (at most {MAX_DEVICES} devices)"),
            ));
        }
        // A group with `Devices` runs on those GPUs only.
        let query = matches!(
            req,
            Request::MemoryInfo { .. }
                | Request::ReleaseMemory { .. }
                | Request::ReturnLease { .. }
                | Request::ContextCost { .. }
        );
        let cfg = c
            .group
            .name()
            .and_then(|n| configured(&self.config, &self.retired, n))
            .filter(|cfg| c.role == Role::Client && !query && !cfg.uses(d))?;
        let list: Vec<String> = cfg.devices.iter().flatten().map(u32::to_string).collect();
        Some(error(
            ErrorKind::PermissionDenied,
            format!(
                "group \"{}\" may use GPU {} only (Devices= in {}), not GPU {d}; \
                 run the program with CUDA_VISIBLE_DEVICES naming those",
                cfg.name,
                list.join(", "),
                cfg.defined_at()
            ),
        ))
    }

    /// Hands a registered client's request to its handler.
    fn dispatch(&mut self, asker: Asker, req: Request, now: Micros, out: &mut Vec<Action>) {
        let Asker { client, role, .. } = asker;
        match req {
            Request::AcquireToken { .. }
            | Request::AcquireTokenAhead { .. }
            | Request::ReleaseToken { .. }
            | Request::LateUsage { .. }
            | Request::UnprovenUsage { .. }
            | Request::Quieting { .. }
            | Request::RunningOut { .. } => self.token_request(asker, req, now, out),
            Request::WaitReason { device } => {
                out.push(asker.reply(self.wait_reason(client, device, now)));
            }
            Request::ReserveMemory { .. }
            | Request::ReleaseMemory { .. }
            | Request::ReserveLeased { .. }
            | Request::ReturnLease { .. }
            | Request::NeedMemory { .. }
            | Request::MemoryInfo { .. }
            | Request::ContextCost { .. } => self.memory_request(asker, req, now, out),
            Request::Reserve { .. }
            | Request::ReserveFor { .. }
            | Request::ReleaseReserved { .. } => self.reservation_request(asker, req, now, out),
            Request::HolderPoll { wait_us } => {
                if role != Role::Holder {
                    out.push(asker.reply(error(
                        ErrorKind::Unexpected,
                        "only the holder polls for orders",
                    )));
                    return;
                }
                self.holder_poll(client, asker.seq, wait_us, now, out);
            }
            Request::Job { job } => {
                if role != Role::Client {
                    out.push(asker.reply(error(
                        ErrorKind::Unexpected,
                        "only clients are ranks of a job",
                    )));
                    return;
                }
                self.declare_job(client, job);
                out.push(asker.reply(Reply::Done));
            }
            Request::Goodbye => {
                self.disconnect(client, now, out);
                out.push(asker.reply(Reply::Done));
            }
            Request::Hello { .. }
            | Request::Status
            | Request::Shutdown
            | Request::Reload
            | Request::Gpus { .. } => {}
        }
    }

    /// A request about a device's token: asked (now or ahead of its
    /// return), given back, its late work reported, its end announced.
    fn token_request(&mut self, asker: Asker, req: Request, now: Micros, out: &mut Vec<Action>) {
        let Asker { client, role, .. } = asker;
        match req {
            Request::AcquireToken {
                device,
                ran,
                in_flight,
                burst_us,
                rtt_us,
                launch_us,
            } => {
                if role == Role::Control {
                    out.push(asker.reply(error(
                        ErrorKind::Unexpected,
                        "a control connection cannot take tokens",
                    )));
                    return;
                }
                if role == Role::Client {
                    self.activity.insert(device, now);
                }
                if launch_us != 0
                    && let Some(c) = self.clients.get_mut(&client)
                {
                    c.launch = Micros::from(launch_us);
                }
                self.report(client, device, &ran, in_flight, now, out);
                self.note_back(client, device, now, 0);
                self.enqueue(asker, device, burst_us, rtt_us, now, out);
            }
            Request::AcquireTokenAhead {
                device,
                burst_us,
                rtt_us,
                launch_in_us,
            } => {
                let ahead = Ahead {
                    burst_us,
                    rtt_us,
                    launch_in: Micros::from(launch_in_us).min(AHEAD_LAUNCH_MAX),
                };
                self.acquire_ahead(asker, device, ahead, now, out)
            }
            Request::ReleaseToken {
                device,
                ran,
                in_flight,
            } => self.release_token(asker, device, &ran, in_flight, now, out),
            Request::LateUsage { device, ran } => {
                self.after_token(asker, device, &ran, Proof::Ran, now, out)
            }
            Request::UnprovenUsage { device, ran } => {
                self.after_token(asker, device, &ran, Proof::Outstanding, now, out)
            }
            Request::Quieting { device, done_in_us } => {
                self.quieting(client, device, done_in_us, now);
                out.push(asker.reply(Reply::Done));
            }
            Request::RunningOut { device, done_in_us } => {
                self.running_out(client, device, done_in_us, now);
                out.push(asker.reply(Reply::Done));
            }
            _ => {}
        }
    }

    /// Work of `asker`'s that ran on `device` after the token it was
    /// launched under ended, `ran` (as `proof` says: outstanding there,
    /// not proven to run, for [`Request::UnprovenUsage`], which its report
    /// that follows completes; see `Proof`).
    fn after_token(
        &mut self,
        asker: Asker,
        device: DeviceId,
        ran: &[Span],
        proof: Proof,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        if asker.role == Role::Control {
            out.push(asker.reply(error(
                ErrorKind::Unexpected,
                "a control connection has no device time to report",
            )));
            return;
        }
        let mut logs = Vec::new();
        match proof {
            Proof::Ran => self.late(asker.client, device, ran, now, &mut logs),
            Proof::Outstanding => {
                self.charge_spans(asker.client, device, ran, proof, now, &mut logs);
            }
        }
        out.push(asker.reply(Reply::Done));
        out.extend(logs);
    }

    /// Queues `asker`'s request for `device`'s token (its bursts
    /// `burst_us` long, its round trip `rtt_us`): a second request while
    /// one waits takes its place, and the old one is answered.
    fn enqueue(
        &mut self,
        asker: Asker,
        device: DeviceId,
        burst_us: Micros,
        rtt_us: u32,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let Asker { client, seq, .. } = asker;
        let Some(group) = self.clients.get(&client).map(|c| c.group.clone()) else {
            return;
        };
        let dev = self.devices.entry(device).or_default();
        dev.note_rtt(rtt_us);
        if let Some(old) = dev.waiters.iter_mut().find(|w| w.client == client) {
            // A second request while one waits: answer the old one.
            let old_seq = std::mem::replace(&mut old.seq, seq);
            old.burst = burst_us;
            out.push(Action::Reply {
                client,
                seq: old_seq,
                reply: error(ErrorKind::Unexpected, "superseded by a newer token request"),
            });
        } else {
            dev.waiters.push(Waiter {
                client,
                group,
                seq,
                since: now,
                burst: burst_us,
            });
        }
    }

    /// A token asked ahead of the client's return
    /// ([`Request::AcquireTokenAhead`]): declined where serving it would
    /// make another client wait (see [`Policy::declines_ahead`]), asked
    /// as any other otherwise.
    fn acquire_ahead(
        &mut self,
        asker: Asker,
        device: DeviceId,
        ahead: Ahead,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let Ahead {
            burst_us,
            rtt_us,
            launch_in,
        } = ahead;
        let Asker { client, seq, role } = asker;
        if role != Role::Client {
            out.push(asker.reply(error(
                ErrorKind::Unexpected,
                "only clients ask for tokens ahead",
            )));
            return;
        }
        let critical = self
            .clients
            .get(&client)
            .is_some_and(|c| self.limits(&c.group).latency == Latency::Critical);
        if self.declines_ahead(client, device, burst_us, critical) {
            out.push(asker.reply(Reply::Done));
            return;
        }
        // A latency-critical group is back when it launches (said from
        // when the request was sent, half a round trip ago): the tokens
        // lent until then end a margin before that, not before this
        // request. Other groups' lent tokens end at their return itself,
        // with no margin, so theirs stays the request. (The token request
        // below then learns nothing more.)
        let back_in = if critical {
            launch_in.saturating_sub(Micros::from(rtt_us) / 2)
        } else {
            0
        };
        self.note_back(client, device, now, back_in);
        // Nothing to report: it reported as it went quiet (and
        // what it said of work in flight stands).
        let req = Request::AcquireToken {
            device,
            ran: Vec::new(),
            in_flight: true,
            burst_us,
            rtt_us,
            launch_us: 0,
        };
        self.request(client, seq, req, now, out);
    }

    /// `asker` gives `device`'s token back, reporting the work of it that
    /// `ran` (`in_flight`: some of it still runs): charged, and its group
    /// away unless another of its clients waits.
    fn release_token(
        &mut self,
        asker: Asker,
        device: DeviceId,
        ran: &[Span],
        in_flight: bool,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let client = asker.client;
        let mut logs = Vec::new();
        self.report(client, device, ran, in_flight, now, &mut logs);
        if let Some(c) = self.clients.get_mut(&client) {
            if in_flight {
                c.in_flight.insert(device);
            } else {
                c.in_flight.remove(&device);
            }
        }
        if !in_flight {
            self.note_step_end(client, device, now);
        }
        self.note_away(client, device, now);
        out.push(asker.reply(Reply::Done));
        out.extend(logs);
    }

    /// A request about memory on a device: reserved, released, asked of
    /// the holder, shown, or what a context took.
    fn memory_request(&mut self, asker: Asker, req: Request, now: Micros, out: &mut Vec<Action>) {
        let Asker { client, seq, role } = asker;
        match req {
            Request::ReserveMemory { device, bytes } => {
                if role == Role::Client {
                    self.activity.insert(device, now);
                }
                out.push(asker.reply(self.reserve(client, device, bytes)));
            }
            Request::ReserveLeased {
                device,
                bytes,
                returned,
                lease,
            } => {
                if role == Role::Client {
                    self.activity.insert(device, now);
                }
                let ask = memory::LeaseAsk {
                    bytes,
                    returned,
                    lease,
                };
                out.push(asker.reply(self.reserve_leased(client, device, ask, now)));
            }
            Request::ReturnLease { device, bytes } => {
                out.push(asker.reply(self.return_lease(client, device, bytes)));
            }
            Request::ReleaseMemory { device, bytes } => {
                out.push(asker.reply(self.release_memory(client, device, bytes)));
                if role == Role::Holder {
                    self.holder_released(device, out);
                }
            }
            Request::NeedMemory { device, bytes } => {
                if role != Role::Client {
                    out.push(asker.reply(error(
                        ErrorKind::Unexpected,
                        "only clients ask the holder for memory",
                    )));
                    return;
                }
                self.activity.insert(device, now);
                self.need_memory(client, seq, device, bytes, now, out);
            }
            Request::MemoryInfo { device } => {
                out.push(asker.reply(self.memory_view(client, device)))
            }
            Request::ContextCost { device, bytes } => {
                out.push(asker.reply(self.context_cost(client, device, bytes)));
            }
            _ => {}
        }
    }

    /// A request about GPU reservations: made (for a program, or for a
    /// time), or released.
    fn reservation_request(
        &mut self,
        asker: Asker,
        req: Request,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let Asker { client, seq, .. } = asker;
        match req {
            Request::Reserve { group, gpus, wait } => {
                self.reserve_gpus(client, seq, group, gpus, wait, None, now, out);
            }
            Request::ReserveFor {
                group,
                gpus,
                duration_us,
                wait,
            } => {
                if let Some(r) = self.refuse_duration(client, duration_us) {
                    out.push(asker.reply(r));
                    return;
                }
                self.reserve_gpus(client, seq, group, gpus, wait, Some(duration_us), now, out);
            }
            Request::ReleaseReserved { devices } => {
                let r = self.release_reserved(client, &devices, now, out);
                out.push(asker.reply(r));
            }
            _ => {}
        }
    }

    /// Whether a token `client` asks for ahead of its return
    /// ([`Request::AcquireTokenAhead`]), its bursts `burst_us` long, is
    /// declined: where serving it would make another client wait, that is
    /// where another client (the holder aside, which yields at once)
    /// holds `device`'s token or waits for it. Queued ahead, the request
    /// made the scheduler end the other group's lent tokens for a process
    /// that was not launching yet, and the device idled until it did: two
    /// groups at `MinUtil` 0.3 / 0.7, each with 10 ms of CPU work after
    /// every 20 ms step, kept the device 91 % busy instead of 98 %, and
    /// the 0.7 group got 0.617 of the 0.664 it was owed. Served anyway: a
    /// process whose bursts are short (see [`AHEAD_SHORT_BURST`]), and a
    /// latency-critical group, for which the device kept for its return
    /// is its class's promise (`critical`: the client's group is one).
    fn declines_ahead(
        &self,
        client: ClientId,
        device: DeviceId,
        burst_us: Micros,
        critical: bool,
    ) -> bool {
        if burst_us <= AHEAD_SHORT_BURST || critical {
            return false;
        }
        if !self.clients.contains_key(&client) {
            return true;
        }
        let Some(dev) = self.devices.get(&device) else {
            return false;
        };
        let other = |id: &ClientId| {
            *id != client && self.clients.get(id).is_some_and(|o| o.role != Role::Holder)
        };
        dev.grants().any(|t| other(&t.client)) || dev.waiters.iter().any(|w| other(&w.client))
    }

    /// `client` is a rank of `job` (its launcher said so, or it made an
    /// NCCL communicator): it takes its GPUs in turns with the job's
    /// other ranks (see `gang`). A name longer than [`MAX_JOB_NAME`]
    /// bytes is cut there.
    /// The name is scoped by the client's group and user (see
    /// [`job_key`]): ranks of two groups, or of two users, that name their
    /// jobs alike are two jobs, never one that takes turns ahead of
    /// others' waiters.
    fn declare_job(&mut self, client: ClientId, mut job: String) {
        if job.len() > MAX_JOB_NAME {
            let mut end = MAX_JOB_NAME;
            while !job.is_char_boundary(end) {
                end -= 1;
            }
            job.truncate(end);
        }
        let uid = memory::user_of(&self.peers, client);
        if let Some(c) = self.clients.get_mut(&client)
            && c.role == Role::Client
            && c.job
                .replace(job_key(&job, c.group.name().unwrap_or_default(), uid))
                .is_none()
        {
            self.ranks += 1;
        }
    }

    /// Places a client process in its group and checks that the peer may
    /// take the role and group, then says hello.
    pub(super) fn admit(
        &mut self,
        client: ClientId,
        role: Role,
        group: String,
        pid: u32,
        held: Vec<HeldMemory>,
    ) -> Reply {
        // A process in a group's cgroup is that group's, whatever it asks
        // (or with no name at all).
        let group = match role {
            Role::Client => match self.place(client, pid, &group) {
                Ok(g) => g,
                Err(r) => return r,
            },
            _ => group,
        };
        if let Some(r) = self.refuse_access(client, role, &group) {
            return r;
        }
        self.hello(client, role, group, pid, held)
    }

    pub(super) fn hello(
        &mut self,
        client: ClientId,
        role: Role,
        group: String,
        pid: u32,
        held: Vec<HeldMemory>,
    ) -> Reply {
        if self.clients.contains_key(&client) {
            return error(
                ErrorKind::AlreadyRegistered,
                "this connection has already said hello",
            );
        }
        let group = match role {
            Role::Client => {
                if !self.config.groups.contains_key(&group) {
                    let known: Vec<&str> = self.config.groups.keys().map(String::as_str).collect();
                    return error(
                        ErrorKind::UnknownGroup,
                        format!(
                            "group {group:?} is not defined in {}; add a [{group}] section there or set GEMINI_GROUP_NAME to one of: {}",
                            self.config.path.display(),
                            if known.is_empty() {
                                "(no groups defined)".to_string()
                            } else {
                                known.join(", ")
                            }
                        ),
                    );
                }
                GroupKey::Named(group.into())
            }
            Role::Holder => GroupKey::Holder,
            Role::Control => GroupKey::Control,
        };
        if role != Role::Control
            && let Some(r) = self.refuse_held(&group, pid, &held)
        {
            return r;
        }
        let mut memory = BTreeMap::new();
        if role != Role::Control {
            for h in held.iter().filter(|h| h.device < MAX_DEVICES) {
                let m: &mut u64 = memory.entry(h.device).or_default();
                *m = m.saturating_add(h.bytes);
                let g = self.memory.entry((group.clone(), h.device)).or_default();
                *g = g.saturating_add(h.bytes);
            }
        }
        let c = Client::new(role, group, pid, memory, self.peers.get(&client));
        self.clients.insert(client, c);
        Reply::Welcome {
            client,
            server: env!("CARGO_PKG_VERSION").to_string(),
            config_path: self.config.path.display().to_string(),
        }
    }

    /// Refuses a hello that says it holds more on a device than its
    /// whole group may: its `MemoryLimit` (or what the process's other
    /// connections hold, its stand-in after a restart, if that is more).
    /// A hello is what a process reports of itself: one that claimed the
    /// whole device kept the group's other processes from allocating until
    /// it ended. What the group's other processes hold is not taken off:
    /// a process re-registering after a restart beside a group over its
    /// limit (lowered live) must not lose its CUDA calls for it.
    fn refuse_held(&self, group: &GroupKey, pid: u32, held: &[HeldMemory]) -> Option<Reply> {
        let mut said: BTreeMap<DeviceId, u64> = BTreeMap::new();
        for h in held.iter().filter(|h| h.device < MAX_DEVICES) {
            let m = said.entry(h.device).or_default();
            *m = m.saturating_add(h.bytes);
        }
        let limit = self.limits(group).memory_limit;
        said.into_iter().find_map(|(device, bytes)| {
            let own: u64 = self
                .clients
                .values()
                .filter(|c| &c.group == group && c.pid == pid)
                .filter_map(|c| c.memory.get(&device))
                .fold(0, |a, b| a.saturating_add(*b));
            (bytes > limit.max(own)).then(|| {
                let size = gemini_protocol::units::format_size;
                error(
                    ErrorKind::OutOfMemory,
                    format!(
                        "pid {pid} says it holds {} on device {device}, more than group {:?} may hold \
                         there (MemoryLimit {})",
                        size(bytes),
                        group.shown(),
                        size(limit)
                    ),
                )
            })
        })
    }
}
