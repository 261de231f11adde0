//! The scheduling policy: a pure state machine, `(event, now) -> actions`.
//! No I/O, no clock, no threads: the daemon's event loop feeds it decoded
//! requests and the current time, and the tests drive it in virtual time.
//!
//! Rules (DESIGN.md):
//! - One token per device; a client launches work only while it holds it.
//! - Usage is what clients report they really used (overuse included),
//!   summed per group and device over a sliding window.
//! - Among waiting groups, those below `MinUtil` go first (most behind,
//!   in points of the device's time, first: when the device cannot give
//!   every group its minimum, the groups fall short by about as many
//!   points each, which is how the guarantee is stated), then the least
//!   used.
//! - `MaxUtil` is a rate: a group earns device time at `MaxUtil` per second
//!   (credit capped at one `max_quota`) and waits, even on an idle device,
//!   while its credit is negative. Over any window it gets at most
//!   `MaxUtil` of the time plus one quota.
//! - Otherwise work-conserving: a lone client runs back to back.
//! - Token length adapts to the client's predicted burst within
//!   `[min_quota, max_quota]`; a token not returned within its quota plus
//!   `token_grace` is revoked (the grace covers a holder waiting for its
//!   queued work to finish, so that work is charged to it and does not
//!   delay the next holder unnoticed).
//! - Memory is reserved per group and device across processes and refused
//!   beyond `MemoryLimit`.
//! - The holder is served only when no eligible client waits.
//! - While a group owed time (active within the window, below its
//!   `MinUtil`) is between bursts, other groups get `min_quota` tokens at
//!   most, ending about when it usually comes back, marked lent: their
//!   clients keep the work they queue within the token, so the owed group
//!   waits at most one short token when it comes back, and gets the device
//!   at the lent token's end (no grace: the borrower's report is charged
//!   whenever it comes).

mod access;
mod holder;
mod reserve;
mod usage;

pub use access::Peer;

use gemini_config::{GroupConfig, ResourceConfig};
use gemini_protocol::{
    ClientId, ClientStatus, DeviceId, DeviceStatus, ErrorKind, ErrorReply, GroupDeviceStatus,
    GroupStatus, HeldMemory, Reply, Request, Role, StatusReport,
};
use std::collections::BTreeMap;
use usage::Usage;

/// Time in microseconds since the policy was created.
pub type Micros = u64;

/// Highest device index accepted (a bound on what a client can make the
/// daemon allocate).
pub const MAX_DEVICES: DeviceId = 1024;

/// Whose time and memory a client's are.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
enum GroupKey {
    /// The holder (`gem-holder`): leftover time and memory, handed back.
    Holder,
    /// A control connection (gem-launch, status): no time, no memory.
    Control,
    /// A group of `resource.conf`.
    Named(String),
}

impl GroupKey {
    /// The configured group's name.
    fn name(&self) -> Option<&str> {
        match self {
            GroupKey::Named(n) => Some(n),
            _ => None,
        }
    }

    /// The name shown in status, metrics and `top`.
    fn shown(&self) -> String {
        match self {
            GroupKey::Holder => HOLDER_SHOWN.to_string(),
            GroupKey::Control => "(control)".to_string(),
            GroupKey::Named(n) => n.clone(),
        }
    }
}

/// What a group is given.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Limits {
    min_util: f64,
    max_util: f64,
    memory_limit: u64,
}
/// Shortest token the holder is given (its kernels are short so a real
/// client never waits long behind one).
pub const HOLDER_MIN_QUOTA: Micros = 100;
/// Shortest token lent while a group owed time is away (each costs the
/// borrower a round trip to renew).
pub const LENT_MIN_QUOTA: Micros = 1_000;
/// How long before a lent token's end the device may pass to the next
/// holder (at most a quarter of the token). The borrower's hook queues
/// only work that ends within its token, so the next holder's first
/// launches queue behind the borrower's last ones, instead of reaching an
/// idle device a scheduler tick, a message and a wake-up (100-300 µs)
/// after the token's end. Measured by the shapes of `make bench`: one
/// process per group with short CPU gaps lost that much at every return.
pub const HANDOVER_LEAD: Micros = 200;
/// The longest absence from the device that a group is owed. Time away
/// counts in the span its share is taken over, so a group that comes back
/// from a gap between bursts (a data loader's, an optimizer's CPU work) is
/// first in line until it has had its `MinUtil` of the whole. A longer
/// absence (a process restarting, an evaluation on the CPU, a checkpoint)
/// is a pause, left out of the span whole: the group did not ask for the
/// device then and is not owed it, or else on its return it would take the
/// device from every group without a `MinUtil` for seconds to catch up
/// (3.3 s after a 1 s pause at `MinUtil` 0.7 over the 10 s window).
pub const OWED_ABSENCE: Micros = 200_000;

/// What saturating groups `(MinUtil, MaxUtil)` are entitled to under
/// these rules: a common level clamped to each group's `[MinUtil,
/// MaxUtil]`, chosen so the device is fully used (or every group is at its
/// ceiling) — water filling.
pub fn entitlements(groups: &[(f64, f64)]) -> Vec<f64> {
    let at = |l: f64| {
        groups
            .iter()
            .map(|&(lo, hi)| l.clamp(lo, hi.max(lo)))
            .collect::<Vec<_>>()
    };
    let (mut lo, mut hi) = (0.0, 1.0);
    for _ in 0..60 {
        let mid = (lo + hi) / 2.0;
        if at(mid).iter().sum::<f64>() < 1.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    at(hi)
}

/// Timing parameters, from `gemini.toml`.
#[derive(Debug, Clone, Copy)]
pub struct Params {
    /// Accounting window.
    pub window: Micros,
    /// Token length when the client predicts nothing.
    pub base_quota: Micros,
    /// Shortest token.
    pub min_quota: Micros,
    /// Longest token.
    pub max_quota: Micros,
    /// Time past a token's end before it is revoked.
    pub grace: Micros,
    /// GPUs that `gem-launch` may reserve (indices 0..devices).
    pub devices: u32,
    /// The daemon's user: with root, the only one that may stop or reload
    /// the scheduler, act as the holder, and join any group.
    pub admin_uid: u32,
}

impl Params {
    /// From validated settings.
    pub fn from_settings(s: &gemini_config::Settings) -> Params {
        let us = |d: std::time::Duration| d.as_micros().min(u64::MAX as u128) as u64;
        Params {
            window: us(s.window),
            base_quota: us(s.base_quota),
            min_quota: us(s.min_quota),
            max_quota: us(s.max_quota),
            grace: us(s.token_grace),
            devices: s.devices.unwrap_or(0),
            admin_uid: 0,
        }
    }
}

impl Default for Params {
    fn default() -> Self {
        Params::from_settings(&gemini_config::Settings::default())
    }
}

/// What the policy is told.
#[derive(Debug, Clone)]
pub enum Event {
    /// A new connection whose peer the kernel names (sent before its first
    /// request; a connection never announced is unverified).
    Connected {
        /// Connection.
        client: ClientId,
        /// Who is at the other end.
        peer: Peer,
    },
    /// A decoded request from connection `client`.
    Request {
        /// Connection.
        client: ClientId,
        /// Sequence number to answer with.
        seq: u32,
        /// The request.
        req: Request,
    },
    /// The connection is gone (process exited or was killed).
    Disconnected {
        /// Connection.
        client: ClientId,
    },
    /// A new, valid `resource.conf`.
    Reconfigure(ResourceConfig),
    /// Time passed (a deadline from [`Policy::next_deadline`] was reached).
    Tick,
}

/// What the policy asks the I/O shell to do.
#[derive(Debug, Clone, PartialEq)]
pub enum Action {
    /// Send `reply` to `client` with sequence number `seq`.
    Reply {
        /// Connection.
        client: ClientId,
        /// Sequence number of the request answered.
        seq: u32,
        /// The reply.
        reply: Reply,
    },
    /// Watch process `pid` of `client`, and send
    /// [`Event::Disconnected`] for each of its connections when it ends.
    Watch {
        /// Connection.
        client: ClientId,
        /// Its process.
        pid: u32,
    },
    /// Re-read `resource.conf` and answer `client`'s request `seq` with
    /// the outcome (the caller may reload: checked).
    Reload {
        /// Connection.
        client: ClientId,
        /// Sequence number of the request.
        seq: u32,
    },
    /// Stop the scheduler once the replies before this are sent.
    Stop,
}

#[derive(Debug)]
struct Client {
    role: Role,
    group: GroupKey,
    pid: u32,
    memory: BTreeMap<DeviceId, u64>,
    /// Per device, the last grant not yet charged: (granted_at, quota).
    uncharged: BTreeMap<DeviceId, (Micros, Micros)>,
}

#[derive(Debug, Clone)]
struct Waiter {
    client: ClientId,
    seq: u32,
    since: Micros,
    burst: Micros,
}

#[derive(Debug, Clone)]
struct Grant {
    client: ClientId,
    expires_at: Micros,
    /// Lent, or its end announced (`Quieting`): it ends at `expires_at`
    /// by design, and is not counted as revoked.
    ends: bool,
}

/// Cumulative figures of one group on one device, for metrics.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupCounters {
    /// The group (`(holder)` for the holder).
    pub group: String,
    /// The device.
    pub device: DeviceId,
    /// Time (µs) the group had a client waiting for the token while its
    /// `MaxUtil` held it back.
    pub throttled_us: Micros,
    /// Tokens of the group revoked: not given back within their length
    /// and the grace.
    pub revocations: u64,
}

#[derive(Debug, Default)]
struct GroupUse {
    usage: Usage,
    /// Credit (µs of device time) at `credit_at`, for `MaxUtil`.
    credit: i64,
    credit_at: Micros,
    /// Start of the group's current period of activity on the device.
    active_since: Micros,
    /// Since when none of the group's clients has held or asked for the
    /// token (a client gave it back); `None` while one does.
    away_since: Option<Micros>,
    /// Smoothed length of the group's past absences (0: none seen yet).
    away_avg: Micros,
    /// Past absences longer than [`OWED_ABSENCE`] (pauses): left out of
    /// the span the group's share is taken over.
    excused: Usage,
    /// Time a client of the group waited while `MaxUtil` held the group
    /// back (µs, closed periods), and since when it has now.
    throttled: Micros,
    throttled_since: Option<Micros>,
    /// Tokens revoked.
    revocations: u64,
}

#[derive(Debug, Default)]
struct Device {
    token: Option<Grant>,
    waiters: Vec<Waiter>,
    groups: BTreeMap<GroupKey, GroupUse>,
    busy: Usage,
    /// The latest report's device time `(client, start, end)`: a token
    /// granted while that work still ran (a lent token ends without its
    /// holder's report) is charged from its end, not twice.
    last_report: Option<(ClientId, Micros, Micros)>,
}

/// The scheduler's whole state.
#[derive(Debug)]
pub struct Policy {
    params: Params,
    config: ResourceConfig,
    /// Groups removed from the file that still have clients: they keep
    /// their last settings until the last one leaves.
    retired: BTreeMap<String, GroupConfig>,
    clients: BTreeMap<ClientId, Client>,
    devices: BTreeMap<DeviceId, Device>,
    /// Bytes reserved per (group, device).
    memory: BTreeMap<(GroupKey, DeviceId), u64>,
    /// When a real client last asked for a token or memory, per device.
    activity: BTreeMap<DeviceId, Micros>,
    /// The holder's pending poll for orders.
    poll: Option<holder::Poll>,
    /// Orders waiting for the holder's next poll.
    orders: std::collections::VecDeque<gemini_protocol::HolderOrder>,
    /// Clients waiting for the holder to free memory.
    demands: Vec<holder::Demand>,
    /// GPU reservations of running programs.
    reservations: Vec<reserve::Reservation>,
    /// Launches waiting for GPUs, first come first served.
    queue: std::collections::VecDeque<reserve::Waiting>,
    /// When each device's last reservation ended.
    released_at: BTreeMap<DeviceId, Micros>,
    /// Connections' verified peers.
    peers: BTreeMap<ClientId, Peer>,
}

/// A group's limits: from the file in force, or its last settings if it
/// was removed while clients remain. The holder may use everything left;
/// a control connection, or a group unknown to both, nothing.
fn limits(
    config: &ResourceConfig,
    retired: &BTreeMap<String, GroupConfig>,
    key: &GroupKey,
) -> Limits {
    const NOTHING: Limits = Limits {
        min_util: 0.0,
        max_util: 0.0,
        memory_limit: 0,
    };
    match key {
        GroupKey::Holder => Limits {
            min_util: 0.0,
            max_util: 1.0,
            memory_limit: u64::MAX,
        },
        GroupKey::Control => NOTHING,
        GroupKey::Named(name) => configured(config, retired, name).map_or(NOTHING, |g| Limits {
            min_util: g.min_util,
            max_util: g.max_util,
            memory_limit: g.memory_limit,
        }),
    }
}

/// A group's settings: from the file in force, or its last ones if it was
/// removed while clients remain (`None` for the holder and unknown groups).
fn configured<'a>(
    config: &'a ResourceConfig,
    retired: &'a BTreeMap<String, GroupConfig>,
    group: &str,
) -> Option<&'a GroupConfig> {
    config.groups.get(group).or_else(|| retired.get(group))
}

/// Opens or closes the groups' throttled periods on `dev`: throttled
/// while a client waits and the group's `MaxUtil` credit holds it back.
fn note_throttled(
    dev: &mut Device,
    clients: &BTreeMap<ClientId, Client>,
    config: &ResourceConfig,
    retired: &BTreeMap<String, GroupConfig>,
    cap: Micros,
    now: Micros,
) {
    let waiting: std::collections::BTreeSet<&GroupKey> = dev
        .waiters
        .iter()
        .filter_map(|w| clients.get(&w.client).map(|c| &c.group))
        .collect();
    for (key, g) in dev.groups.iter_mut() {
        let max_util = limits(config, retired, key).max_util;
        let held_back = waiting.contains(key) && g.eligible_at(now, max_util, cap) != Some(now);
        match (held_back, g.throttled_since) {
            (true, None) => g.throttled_since = Some(now),
            (false, Some(since)) => {
                g.throttled += now.saturating_sub(since);
                g.throttled_since = None;
            }
            _ => {}
        }
    }
}

fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
    Reply::Error(ErrorReply {
        kind,
        message: message.into(),
    })
}

/// The holder's name where groups are shown (status, metrics, `top`).
pub const HOLDER_SHOWN: &str = "(holder)";

impl GroupUse {
    /// Credit at `now`, refilled at `max_util` per µs, capped at `cap`.
    fn credit_now(&self, now: Micros, max_util: f64, cap: Micros) -> i64 {
        let earned = (now.saturating_sub(self.credit_at) as f64 * max_util) as i64;
        self.credit.saturating_add(earned).min(cap as i64)
    }

    /// When the group may next be granted the device (`None`: never).
    fn eligible_at(&self, now: Micros, max_util: f64, cap: Micros) -> Option<Micros> {
        if max_util <= 0.0 {
            return None;
        }
        if max_util >= 1.0 {
            return Some(now);
        }
        let c = self.credit_now(now, max_util, cap);
        if c >= 0 {
            Some(now)
        } else {
            Some(now + ((-c) as f64 / max_util).ceil() as Micros)
        }
    }

    /// Charges `used` µs of a token granted at `granted_at`. Credit is
    /// capped as it stood at the grant; what was earned while the token was
    /// held counts in full, so a holder's own token time is never lost to
    /// the cap (with `MaxUtil` 1 the credit never goes negative).
    fn charge(
        &mut self,
        granted_at: Micros,
        now: Micros,
        used: Micros,
        max_util: f64,
        cap: Micros,
    ) {
        let at_grant = self.credit_now(granted_at.max(self.credit_at), max_util, cap);
        let earned = (now.saturating_sub(granted_at.max(self.credit_at)) as f64 * max_util) as i64;
        self.credit = at_grant
            .saturating_add(earned)
            .saturating_sub(used as i64)
            .min(cap as i64);
        self.credit_at = now;
    }

    /// When the group, away from the device, is expected back: its usual
    /// absence after it left. `None` when that is not known, or long past
    /// (it is late by more than its usual absence and `late_by` more: it
    /// may not come back soon, and lending in short tokens would only cost
    /// round trips).
    fn expected_back(&self, now: Micros, late_by: Micros) -> Option<Micros> {
        let since = self.away_since?;
        if self.away_avg == 0 {
            return None;
        }
        let back = since + self.away_avg;
        (now < back + self.away_avg + late_by).then_some(back)
    }

    /// Share of the time since the group became active (at most a window)
    /// that it used, leaving out its pauses (past ones and one going on:
    /// absences longer than [`OWED_ABSENCE`]).
    fn share(&mut self, now: Micros, window: Micros) -> f64 {
        let span = now
            .saturating_sub(self.active_since)
            .clamp(1, window.max(1));
        let mut excused = self.excused.used(now, span);
        if let Some(since) = self.away_since
            && now.saturating_sub(since) > OWED_ABSENCE
        {
            excused += now - since.max(now.saturating_sub(span));
        }
        let counted = span.saturating_sub(excused).max(1);
        self.usage.used(now, window) as f64 / counted as f64
    }
}

impl Policy {
    /// A policy with no clients.
    pub fn new(params: Params, config: ResourceConfig) -> Policy {
        Policy {
            params,
            config,
            retired: BTreeMap::new(),
            clients: BTreeMap::new(),
            devices: BTreeMap::new(),
            memory: BTreeMap::new(),
            activity: BTreeMap::new(),
            poll: None,
            orders: Default::default(),
            demands: Vec::new(),
            reservations: Vec::new(),
            queue: Default::default(),
            released_at: BTreeMap::new(),
            peers: BTreeMap::new(),
        }
    }

    /// The configuration in force.
    pub fn config(&self) -> &ResourceConfig {
        &self.config
    }

    fn limits(&self, key: &GroupKey) -> Limits {
        limits(&self.config, &self.retired, key)
    }

    /// Handles one event at time `now` (µs, never decreasing).
    pub fn handle(&mut self, event: Event, now: Micros) -> Vec<Action> {
        let mut out = Vec::new();
        // A request about one device can only change that device; anything
        // else may change any.
        let mut only = None;
        match event {
            Event::Connected { client, peer } => {
                self.peers.insert(client, peer);
                return out;
            }
            Event::Request { client, seq, req } => {
                only = match &req {
                    Request::AcquireToken { device, .. }
                    | Request::ReleaseToken { device, .. }
                    | Request::Quieting { device, .. } => Some(*device),
                    _ => None,
                };
                self.request(client, seq, req, now, &mut out);
            }
            Event::Disconnected { client } => {
                self.peers.remove(&client);
                self.disconnect(client, now, &mut out);
            }
            Event::Reconfigure(cfg) => self.reconfigure(cfg),
            Event::Tick => {}
        }
        match only {
            Some(d) => self.schedule(d, now, &mut out),
            None => self.schedule_all(now, &mut out),
        }
        self.holder_tick(now, &mut out);
        out
    }

    fn request(
        &mut self,
        client: ClientId,
        seq: u32,
        req: Request,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let answer = |reply: Reply| Action::Reply { client, seq, reply };
        match req {
            Request::Hello {
                role,
                group,
                pid,
                held,
            } => {
                // The kernel's word wins over the claim.
                let pid = self.peer(client).map_or(pid, |p| p.pid);
                let r = self.admit(client, role, group, pid, held);
                let welcomed = matches!(r, Reply::Welcome { .. });
                out.push(answer(r));
                if welcomed {
                    out.push(Action::Watch { client, pid });
                }
                return;
            }
            Request::Shutdown => {
                match self.refuse_admin(client, "stop") {
                    Some(r) => out.push(answer(r)),
                    None => {
                        out.push(answer(Reply::Done));
                        out.push(Action::Stop);
                    }
                }
                return;
            }
            Request::Reload => {
                match self.refuse_admin(client, "reload") {
                    Some(r) => out.push(answer(r)),
                    None => out.push(Action::Reload { client, seq }),
                }
                return;
            }
            Request::Reserve { ref group, .. } => {
                if let Some(r) = self.refuse_access(client, Role::Control, group) {
                    out.push(answer(r));
                    return;
                }
            }
            Request::Status | Request::Gpus { .. } => {
                // Answered by the shell, which knows the process-level facts.
                out.push(answer(error(
                    ErrorKind::Unexpected,
                    "status and GPUs are answered by the daemon",
                )));
                return;
            }
            _ => {}
        }
        let mut reply = |reply: Reply| out.push(Action::Reply { client, seq, reply });
        let Some(c) = self.clients.get(&client) else {
            reply(error(
                ErrorKind::NotRegistered,
                "say hello first: this connection has not registered",
            ));
            return;
        };
        let role = c.role;
        let device = match &req {
            Request::AcquireToken { device, .. }
            | Request::ReleaseToken { device, .. }
            | Request::Quieting { device, .. }
            | Request::ReserveMemory { device, .. }
            | Request::ReleaseMemory { device, .. }
            | Request::NeedMemory { device, .. }
            | Request::MemoryInfo { device } => Some(*device),
            _ => None,
        };
        if let Some(d) = device
            && d >= MAX_DEVICES
        {
            reply(error(
                ErrorKind::BadRequest,
                format!("device {d} is out of range (at most {MAX_DEVICES} devices)"),
            ));
            return;
        }
        // A group with `Devices` runs on those GPUs only: its time and
        // memory on another are refused (a query is answered).
        if let Some(d) = device
            && role == Role::Client
            && !matches!(
                req,
                Request::MemoryInfo { .. } | Request::ReleaseMemory { .. }
            )
            && let Some(cfg) = c
                .group
                .name()
                .and_then(|n| configured(&self.config, &self.retired, n))
            && !cfg.uses(d)
        {
            let list: Vec<String> = cfg.devices.iter().flatten().map(u32::to_string).collect();
            reply(error(
                ErrorKind::PermissionDenied,
                format!(
                    "group \"{}\" may use GPU {} only (Devices= in {} line {}), not GPU {d}; \
                     run the program with CUDA_VISIBLE_DEVICES naming those",
                    cfg.name,
                    list.join(", "),
                    cfg.file.display(),
                    cfg.line
                ),
            ));
            return;
        }
        match req {
            Request::AcquireToken {
                device,
                used_us,
                burst_us,
            } => {
                if role == Role::Control {
                    reply(error(
                        ErrorKind::Unexpected,
                        "a control connection cannot take tokens",
                    ));
                    return;
                }
                if role == Role::Client {
                    self.activity.insert(device, now);
                }
                self.report(client, device, used_us, now);
                self.note_back(client, device, now);
                let dev = self.devices.entry(device).or_default();
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
                        seq,
                        since: now,
                        burst: burst_us,
                    });
                }
            }
            Request::ReleaseToken { device, used_us } => {
                self.report(client, device, used_us, now);
                self.note_away(client, device, now);
                reply(Reply::Done);
            }
            Request::Quieting { device, done_in_us } => {
                self.quieting(client, device, done_in_us, now);
                reply(Reply::Done);
            }
            Request::ReserveMemory { device, bytes } => {
                if role == Role::Client {
                    self.activity.insert(device, now);
                }
                reply(self.reserve(client, device, bytes))
            }
            Request::ReleaseMemory { device, bytes } => {
                reply(self.release_memory(client, device, bytes));
                if role == Role::Holder {
                    self.holder_released(device, out);
                }
            }
            Request::NeedMemory { device, bytes } => {
                if role != Role::Client {
                    reply(error(
                        ErrorKind::Unexpected,
                        "only clients ask the holder for memory",
                    ));
                    return;
                }
                self.activity.insert(device, now);
                self.need_memory(client, seq, device, bytes, now, out);
            }
            Request::Reserve { group, gpus, wait } => {
                self.reserve_gpus(client, seq, group, gpus, wait, now, out);
            }
            Request::HolderPoll { wait_us } => {
                if role != Role::Holder {
                    reply(error(
                        ErrorKind::Unexpected,
                        "only the holder polls for orders",
                    ));
                    return;
                }
                self.holder_poll(client, seq, wait_us, now, out);
            }
            Request::MemoryInfo { device } => reply(self.memory_view(client, device)),
            Request::Goodbye => {
                self.disconnect(client, now, out);
                out.push(Action::Reply {
                    client,
                    seq,
                    reply: Reply::Done,
                });
            }
            Request::Hello { .. }
            | Request::Status
            | Request::Shutdown
            | Request::Reload
            | Request::Gpus { .. } => {}
        }
    }

    /// Places a client process in its group and checks that the peer may
    /// take the role and group, then says hello.
    fn admit(
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

    fn hello(
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
                GroupKey::Named(group)
            }
            Role::Holder => GroupKey::Holder,
            Role::Control => GroupKey::Control,
        };
        let mut memory = BTreeMap::new();
        if role != Role::Control {
            for h in held.iter().filter(|h| h.device < MAX_DEVICES) {
                let m: &mut u64 = memory.entry(h.device).or_default();
                *m = m.saturating_add(h.bytes);
                let g = self.memory.entry((group.clone(), h.device)).or_default();
                *g = g.saturating_add(h.bytes);
            }
        }
        self.clients.insert(
            client,
            Client {
                role,
                group,
                pid,
                memory,
                uncharged: BTreeMap::new(),
            },
        );
        Reply::Welcome {
            client,
            server: env!("CARGO_PKG_VERSION").to_string(),
            config_path: self.config.path.display().to_string(),
        }
    }

    /// Charges the device time `client` reports for its last token on
    /// `device`, and frees the device if it still holds the token.
    fn report(&mut self, client: ClientId, device: DeviceId, used: Micros, now: Micros) {
        // Hot path (every token): no clone of group names or configs.
        let Policy {
            clients,
            devices,
            config,
            retired,
            params,
            ..
        } = self;
        let Some(c) = clients.get_mut(&client) else {
            return;
        };
        let Some((granted_at, quota)) = c.uncharged.remove(&device) else {
            return;
        };
        // A client cannot have used more than the time since the grant, or
        // its quota: a lent token is renewed while its last work still runs
        // (the hook keeps that work within the quota) and reports it ahead.
        let used = used.min(now.saturating_sub(granted_at).max(quota));
        let end = granted_at + used;
        let max_util = limits(config, retired, &c.group).max_util;
        let cap = params.max_quota;
        let dev = devices.entry(device).or_default();
        if dev.token.as_ref().is_some_and(|t| t.client == client) {
            dev.token = None;
        }
        // Work reported before that began before this grant and ran past it
        // (a lent token's overrun, reported late; a renewed lent token's
        // last work, reported ahead) held the device: the time this client
        // waited behind it, or ran after it, is charged once.
        let start = match dev.last_report {
            Some((_, s, e)) if s < granted_at => e.clamp(granted_at, end),
            _ => granted_at,
        };
        dev.last_report = Some((client, start, end));
        let used = end - start;
        let g = match dev.groups.get_mut(&c.group) {
            Some(g) => g,
            None => dev.groups.entry(c.group.clone()).or_default(),
        };
        g.usage.add(start, end);
        g.charge(granted_at, now, used, max_util, cap);
        dev.busy.add(start, end);
    }

    /// `client` gave the token of `device` back: its group is away from
    /// the device if no other client of it holds or waits for the token.
    fn note_away(&mut self, client: ClientId, device: DeviceId, now: Micros) {
        let Some(group) = self.clients.get(&client).map(|c| c.group.clone()) else {
            return;
        };
        self.mark_away(&group, device, now);
    }

    /// `group` is away from `device` from `now` (or since it already was)
    /// if none of its clients holds or waits for the token.
    fn mark_away(&mut self, group: &GroupKey, device: DeviceId, now: Micros) {
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let of_group = |id: &ClientId| self.clients.get(id).is_some_and(|c| &c.group == group);
        if dev.waiters.iter().any(|w| of_group(&w.client))
            || dev.token.as_ref().is_some_and(|t| of_group(&t.client))
        {
            return;
        }
        if let Some(g) = dev.groups.get_mut(group) {
            // Away since its token was passed on ahead of its report
            // (`quieting`), if it was.
            g.away_since.get_or_insert(now);
        }
    }

    /// The holder of `device`'s token waits for its last work, predicted
    /// to end in `done_in` µs, and will go quiet after it: the token
    /// expires `HANDOVER_LEAD` before that end, so the next holder's
    /// launches queue behind the work instead of reaching an idle device
    /// after the holder's wait returns and it reports (charged then, in
    /// full). Its group is away from then on, unless another of its
    /// processes waits.
    fn quieting(&mut self, client: ClientId, device: DeviceId, done_in: Micros, now: Micros) {
        let Some(group) = self.clients.get(&client).map(|c| &c.group) else {
            return;
        };
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let Some(token) = dev.token.as_mut().filter(|t| t.client == client) else {
            return;
        };
        let at = now.saturating_add(done_in.saturating_sub(HANDOVER_LEAD));
        token.expires_at = token.expires_at.min(at);
        token.ends = true;
        let of_group = |id: &ClientId| self.clients.get(id).is_some_and(|c| &c.group == group);
        if dev.waiters.iter().any(|w| of_group(&w.client)) {
            return;
        }
        if let Some(g) = dev.groups.get_mut(group) {
            g.away_since = Some(at);
        }
    }

    /// A client of an away group asks for the token again: the group's
    /// absence ends, and is learned.
    fn note_back(&mut self, client: ClientId, device: DeviceId, now: Micros) {
        let Some(c) = self.clients.get(&client) else {
            return;
        };
        let Some(g) = self
            .devices
            .get_mut(&device)
            .and_then(|d| d.groups.get_mut(&c.group))
        else {
            return;
        };
        if let Some(since) = g.away_since.take() {
            let away = now.saturating_sub(since);
            if away > OWED_ABSENCE {
                g.excused.add(since, now);
            }
            g.away_avg = if g.away_avg == 0 {
                away
            } else {
                (g.away_avg + away) / 2
            };
        }
    }

    fn reserve(&mut self, client: ClientId, device: DeviceId, bytes: u64) -> Reply {
        let Some(c) = self.clients.get(&client) else {
            return error(ErrorKind::NotRegistered, "say hello first");
        };
        if c.role == Role::Control {
            return error(
                ErrorKind::Unexpected,
                "a control connection holds no memory",
            );
        }
        let group = c.group.clone();
        let limit = self.limits(&group).memory_limit;
        let used = self
            .memory
            .get(&(group.clone(), device))
            .copied()
            .unwrap_or(0);
        match used.checked_add(bytes) {
            Some(total) if total <= limit => {
                self.memory.insert((group, device), total);
                if let Some(c) = self.clients.get_mut(&client) {
                    let m = c.memory.entry(device).or_default();
                    *m = m.saturating_add(bytes);
                }
                Reply::Memory {
                    device,
                    used: total,
                    limit,
                }
            }
            _ => error(
                ErrorKind::OutOfMemory,
                format!(
                    "group {:?} would use {} bytes on device {device}, over its MemoryLimit of {limit} (in use: {used}, asked: {bytes})",
                    group.shown(),
                    used.saturating_add(bytes)
                ),
            ),
        }
    }

    fn release_memory(&mut self, client: ClientId, device: DeviceId, bytes: u64) -> Reply {
        let Some(c) = self.clients.get_mut(&client) else {
            return error(ErrorKind::NotRegistered, "say hello first");
        };
        let held = c.memory.entry(device).or_default();
        // Never release more than this client reserved: a confused client
        // must not free its group-mates' reservations.
        let bytes = bytes.min(*held);
        *held -= bytes;
        let group = c.group.clone();
        let used = self.memory.entry((group.clone(), device)).or_default();
        *used = used.saturating_sub(bytes);
        Reply::Memory {
            device,
            used: *used,
            limit: self.limits(&group).memory_limit,
        }
    }

    fn memory_view(&self, client: ClientId, device: DeviceId) -> Reply {
        let Some(c) = self.clients.get(&client) else {
            return error(ErrorKind::NotRegistered, "say hello first");
        };
        if c.group == GroupKey::Control {
            return error(
                ErrorKind::Unexpected,
                "a control connection holds no memory",
            );
        }
        let used = self
            .memory
            .get(&(c.group.clone(), device))
            .copied()
            .unwrap_or(0);
        Reply::MemoryView {
            device,
            used,
            limit: self.limits(&c.group).memory_limit,
            reclaimable: if c.group == GroupKey::Holder {
                0
            } else {
                self.holder_memory(device)
            },
        }
    }

    fn disconnect(&mut self, client: ClientId, now: Micros, out: &mut Vec<Action>) {
        let Some(c) = self.clients.remove(&client) else {
            return;
        };
        for (device, bytes) in &c.memory {
            if let Some(m) = self.memory.get_mut(&(c.group.clone(), *device)) {
                *m = m.saturating_sub(*bytes);
            }
        }
        let max_util = self.limits(&c.group).max_util;
        for (device, dev) in self.devices.iter_mut() {
            dev.waiters.retain(|w| w.client != client);
            if dev.token.as_ref().is_some_and(|t| t.client == client) {
                dev.token = None;
                // It cannot report any more: charge the time it held the
                // token, up to its quota.
                if let Some((granted_at, quota)) = c.uncharged.get(device) {
                    let used = now.saturating_sub(*granted_at).min(*quota);
                    let g = dev.groups.entry(c.group.clone()).or_default();
                    g.usage.add(*granted_at, granted_at + used);
                    g.charge(*granted_at, now, used, max_util, self.params.max_quota);
                    dev.busy.add(*granted_at, granted_at + used);
                }
            }
        }
        // A process that exits while its group waits for nothing leaves the
        // group away (a restart's absence is a pause, see OWED_ABSENCE).
        let devices: Vec<DeviceId> = self.devices.keys().copied().collect();
        for device in devices {
            self.mark_away(&c.group, device, now);
        }
        if let Some(name) = c.group.name()
            && !self.clients.values().any(|o| o.group == c.group)
        {
            self.retired.remove(name);
        }
        if c.role == Role::Holder {
            self.holder_gone(client, out);
        }
        self.end_reservations(client, now, out);
    }

    fn reconfigure(&mut self, cfg: ResourceConfig) {
        for (name, old) in &self.config.groups {
            if !cfg.groups.contains_key(name)
                && self.clients.values().any(|c| c.group.name() == Some(name))
            {
                self.retired.insert(name.clone(), old.clone());
            }
        }
        self.retired
            .retain(|name, _| !cfg.groups.contains_key(name));
        self.config = cfg;
    }

    fn schedule_all(&mut self, now: Micros, out: &mut Vec<Action>) {
        let ids: Vec<DeviceId> = self.devices.keys().copied().collect();
        for d in ids {
            self.schedule(d, now, out);
        }
    }

    /// Revokes an expired token and grants a free one.
    fn schedule(&mut self, device: DeviceId, now: Micros, out: &mut Vec<Action>) {
        let params = self.params;
        let Policy {
            devices,
            clients,
            config,
            retired,
            ..
        } = self;
        let Some(dev) = devices.get_mut(&device) else {
            return;
        };
        if let Some(t) = dev.token.take_if(|t| now >= t.expires_at)
            && !t.ends
            && let Some(c) = clients.get(&t.client)
        {
            dev.groups.entry(c.group.clone()).or_default().revocations += 1;
        }
        note_throttled(dev, clients, config, retired, params.max_quota, now);
        if dev.token.is_some() || dev.waiters.is_empty() {
            return;
        }
        // Rank the waiters: (class, key, since). Class 0: real group below
        // MinUtil (key: share - min); 1: other real group (key: share);
        // 2: holder. Ineligible (capped) groups are skipped.
        let mut best: Option<((u8, f64, Micros, ClientId), usize)> = None;
        for (i, w) in dev.waiters.iter().enumerate() {
            let Some(c) = clients.get(&w.client) else {
                continue;
            };
            let Limits {
                min_util, max_util, ..
            } = limits(config, retired, &c.group);
            if max_util <= 0.0 {
                // Never eligible (a group unknown to the file).
                continue;
            }
            let g = match dev.groups.get_mut(&c.group) {
                Some(g) => g,
                None => dev.groups.entry(c.group.clone()).or_default(),
            };
            if g.eligible_at(now, max_util, params.max_quota) != Some(now) {
                continue;
            }
            let fresh = g.usage.is_empty(now, params.window);
            let share = if fresh {
                0.0
            } else {
                g.share(now, params.window)
            };
            let (class, key) = if c.group == GroupKey::Holder {
                (2, share)
            } else if share < min_util {
                (0, share - min_util)
            } else {
                (1, share)
            };
            let rank = (class, key, w.since, w.client);
            if best
                .as_ref()
                .is_none_or(|(b, _)| rank.partial_cmp(b) == Some(std::cmp::Ordering::Less))
            {
                best = Some((rank, i));
            }
        }
        let Some(((class, ..), i)) = best else {
            return;
        };
        // A group owed time (active in the window, below its MinUtil) that
        // is not waiting is between bursts and will be back: lend the
        // device to others in short tokens only, so it waits at most one
        // of them when it returns. The lent token ends about when such a
        // group usually comes back (the earliest, learned from their past
        // absences; `back`), within [LENT_MIN_QUOTA, min_quota].
        let (mut lent, mut back) = (false, None::<Micros>);
        if class != 0 {
            let waiters = &dev.waiters;
            // The chosen waiter's own group is among the waiting ones.
            let waiting = |key: &GroupKey| {
                waiters
                    .iter()
                    .any(|w| clients.get(&w.client).is_some_and(|c| &c.group == key))
            };
            for (key, g) in dev.groups.iter_mut() {
                let min_util = limits(config, retired, key).min_util;
                if min_util > 0.0
                    && !waiting(key)
                    && !g.usage.is_empty(now, params.window)
                    && g.share(now, params.window) < min_util
                {
                    lent = true;
                    back = back
                        .into_iter()
                        .chain(g.expected_back(now, params.min_quota))
                        .min();
                }
            }
        }
        let w = dev.waiters.remove(i);
        let Some(c) = clients.get_mut(&w.client) else {
            return;
        };
        let burst = if w.burst == 0 {
            params.base_quota
        } else {
            w.burst
        };
        // The holder's tokens are as short as its kernels: a real client
        // waits at most one of them.
        let floor = if c.role == Role::Holder {
            HOLDER_MIN_QUOTA
        } else {
            params.min_quota
        };
        let mut quota = burst.clamp(floor.min(params.max_quota), params.max_quota);
        if lent {
            let short = params.min_quota.max(floor);
            let to_return = back.map_or(short, |t| {
                t.saturating_sub(now)
                    .clamp(LENT_MIN_QUOTA.min(short), short)
            });
            quota = quota.min(to_return);
        }
        if let Some(g) = dev.groups.get_mut(&c.group)
            && g.usage.is_empty(now, params.window)
        {
            g.active_since = now;
        }
        c.uncharged.insert(device, (now, quota));
        // A lent token's work fits in it (its hook keeps the queue within
        // the quota): it is over at its end, and the group owed the device
        // gets it a little before (HANDOVER_LEAD), without waiting for the
        // borrower to wake up and report (charged when it does). Others
        // keep the grace for draining their queued work.
        let expires_at = if lent {
            now + quota - HANDOVER_LEAD.min(quota / 4)
        } else {
            now + quota + params.grace
        };
        dev.token = Some(Grant {
            client: w.client,
            expires_at,
            ends: lent,
        });
        out.push(Action::Reply {
            client: w.client,
            seq: w.seq,
            reply: Reply::Token {
                device,
                quota_us: quota,
                lent,
            },
        });
    }

    /// The earliest time at which [`Event::Tick`] may change something: a
    /// token expiring, or a capped group becoming eligible.
    pub fn next_deadline(&mut self, now: Micros) -> Option<Micros> {
        let cap = self.params.max_quota;
        let mut next: Option<Micros> = None;
        let mut consider = |t: Micros| next = Some(next.map_or(t, |n: Micros| n.min(t)));
        for dev in self.devices.values_mut() {
            if let Some(t) = &dev.token {
                consider(t.expires_at);
                continue;
            }
            for w in &dev.waiters {
                let Some(c) = self.clients.get(&w.client) else {
                    continue;
                };
                let max_util = limits(&self.config, &self.retired, &c.group).max_util;
                if let Some(t) = dev
                    .groups
                    .get(&c.group)
                    .and_then(|g| g.eligible_at(now, max_util, cap))
                {
                    consider(t.max(now));
                }
            }
        }
        match (next, self.holder_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Cumulative per group and device figures, for metrics.
    pub fn counters(&self, now: Micros) -> Vec<GroupCounters> {
        let mut out = Vec::new();
        for (&device, dev) in &self.devices {
            for (key, g) in &dev.groups {
                let open = g.throttled_since.map_or(0, |s| now.saturating_sub(s));
                out.push(GroupCounters {
                    group: key.shown(),
                    device,
                    throttled_us: g.throttled + open,
                    revocations: g.revocations,
                });
            }
        }
        out
    }

    /// The group of client `id`, if it is one (`(holder)` for the holder).
    pub fn client_group(&self, id: ClientId) -> Option<String> {
        self.clients.get(&id).map(|c| c.group.shown())
    }

    /// Figures for `gem-schd status`.
    pub fn status(&mut self, now: Micros) -> StatusReport {
        let (reservations, queue) = self.reservation_status(now);
        let window = self.params.window;
        let span = now.clamp(1, window.max(1)) as f64;
        let mut groups: Vec<GroupStatus> = self
            .config
            .groups
            .values()
            .chain(self.retired.values())
            .map(|g| GroupStatus {
                name: g.name.clone(),
                min_util: g.min_util,
                max_util: g.max_util,
                memory_limit: g.memory_limit,
                clients: self
                    .clients
                    .values()
                    .filter(|c| c.group.name() == Some(&g.name))
                    .count() as u32,
                devices: g.devices.clone(),
            })
            .collect();
        groups.sort_by(|a, b| a.name.cmp(&b.name));
        let mut devices = Vec::new();
        for (&id, dev) in self.devices.iter_mut() {
            let mut rows = Vec::new();
            let holder_group = dev
                .token
                .as_ref()
                .and_then(|t| self.clients.get(&t.client))
                .map(|c| &c.group);
            for (key, g) in dev.groups.iter_mut() {
                let memory_used = self.memory.get(&(key.clone(), id)).copied().unwrap_or(0);
                let waiting = dev
                    .waiters
                    .iter()
                    .filter(|w| self.clients.get(&w.client).is_some_and(|c| &c.group == key))
                    .count() as u32;
                let idle = g.usage.is_empty(now, window);
                // A group that left the device (nothing used in the
                // window, no memory, not waiting, not holding) is no longer
                // shown on it.
                if idle && memory_used == 0 && waiting == 0 && holder_group != Some(key) {
                    continue;
                }
                rows.push(GroupDeviceStatus {
                    group: key.shown(),
                    // Over the time since the group became active on the
                    // device (at most a window), as the policy measures it
                    // against MinUtil: a group started a second ago and
                    // using all of it shows 100 %, not a tenth.
                    share: g.share(now, window),
                    memory_used,
                    memory_limit: limits(&self.config, &self.retired, key).memory_limit,
                    waiting,
                });
            }
            devices.push(DeviceStatus {
                device: id,
                busy: dev.busy.used(now, window) as f64 / span,
                holder: dev.token.as_ref().map(|t| t.client),
                waiting: dev.waiters.len() as u32,
                groups: rows,
            });
        }
        // Every GPU the machine has is listed, used yet or not.
        for id in 0..self.params.devices {
            if !self.devices.contains_key(&id) {
                devices.push(DeviceStatus {
                    device: id,
                    busy: 0.0,
                    holder: None,
                    waiting: 0,
                    groups: Vec::new(),
                });
            }
        }
        devices.sort_by_key(|d| d.device);
        let clients = self
            .clients
            .iter()
            .map(|(&id, c)| ClientStatus {
                id,
                pid: c.pid,
                role: c.role,
                group: c.group.name().unwrap_or_default().to_string(),
            })
            .collect();
        StatusReport {
            server: env!("CARGO_PKG_VERSION").to_string(),
            config_path: self.config.path.display().to_string(),
            config_error: None,
            window_us: window,
            uptime_us: now,
            groups,
            devices,
            clients,
            reservations,
            queue,
        }
    }

    /// Process ids of registered clients, for the liveness check.
    pub fn client_pids(&self) -> impl Iterator<Item = (ClientId, u32)> + '_ {
        self.clients.iter().map(|(&id, c)| (id, c.pid))
    }
}

#[cfg(test)]
mod tests;
