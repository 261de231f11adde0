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
//!   used. A capped group at its cap counts as having used what it used
//!   plus how far its cap is below the level the others are entitled to
//!   (water filling between the groups using the device): it is not ahead
//!   of a group that wants more and is owed it, so it spends its credit
//!   while that group is away instead of while it waits.
//! - `MaxUtil` is a rate: a group earns device time at `MaxUtil` per second
//!   (credit capped at three `min_quota`) and waits, even on an idle device,
//!   while its credit is negative. Its tokens are cut so they take the
//!   credit at most two `min_quota` into debt, and another group's token ends
//!   when a capped group ranked before it may run again, so it does not
//!   lose the time it earns while it waits. Over any window it gets at
//!   most `MaxUtil` of the time plus five `min_quota`.
//! - Otherwise work-conserving: a lone client runs back to back.
//! - Token length adapts to the client's predicted burst within
//!   `[min_quota, max_quota]`; a token not returned within its quota plus
//!   `token_grace` is revoked (the grace covers a holder waiting for its
//!   queued work to finish, so that work is charged to it and does not
//!   delay the next holder unnoticed).
//! - Memory is reserved per group and device across processes and refused
//!   beyond `MemoryLimit`.
//! - The holder is served only when no eligible client waits.
//! - A job spanning devices (a group whose processes use several) takes
//!   them in turns decided on the first of them, so that its ranks run
//!   in the same windows (see `gang`).
//! - While a group owed time (active within the window and not paused,
//!   ranked before the waiter chosen: below its `MinUtil`, or further
//!   below its fair share) is between bursts, other groups get `min_quota` tokens at
//!   most, ending about when it usually comes back, marked lent: their
//!   clients keep the work they queue within the token, so the owed group
//!   waits at most one short token when it comes back, and gets the device
//!   at the lent token's end (no grace: the borrower's report is charged
//!   whenever it comes).

mod access;
mod gang;
mod group_use;
mod holder;
mod ledger;
mod memory;
mod report;
mod request;
mod reserve;
mod share;
mod status;
mod tokens;
mod usage;

pub use access::Peer;
pub use gang::GANG_RECENT;
pub use reserve::HeldReservation;

use gemini_config::{GroupConfig, Latency, ResourceConfig};
use gemini_protocol::{ClientId, DeviceId, ErrorKind, ErrorReply, Reply, Request, Role};
use group_use::GroupUse;
use std::collections::{BTreeMap, BTreeSet};
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
    /// A group of `resource.conf`. Shared, not copied: a key is cloned
    /// into every waiter and compared on each request, and two clones of
    /// one name compare by address.
    Named(std::sync::Arc<str>),
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
            GroupKey::Named(n) => n.to_string(),
        }
    }
}

/// What a group is given.
#[derive(Debug, Clone, Copy, PartialEq)]
struct Limits {
    min_util: f64,
    max_util: f64,
    memory_limit: u64,
    latency: Latency,
}
/// Shortest token the holder is given (its kernels are short so a real
/// client never waits long behind one).
pub const HOLDER_MIN_QUOTA: Micros = 100;
/// Shortest token lent while a group owed time is away: five round trips
/// (1 ms at 200 µs, see [`Device::rtt`]), as each costs the borrower one
/// to renew.
pub fn lent_min_quota(rtt: Micros) -> Micros {
    5 * rtt
}
/// Longest token another group gets while a latency-critical group
/// (`Latency=critical`) is active on the device and not asking: about the
/// longest the critical group waits when it comes back, with the work
/// queued under that token (the hook queues only what ends within it).
pub const CRITICAL_LEND_MAX: Micros = 2_000;
/// How long before a latency-critical group is expected back (learned from
/// its past absences) a token lent meanwhile ends, so that the work
/// queued under it has drained when it comes: on a real GPU the critical
/// group's kernels would otherwise time-slice with that work (2.6× its
/// step, measured on an H200 without gemini). A round trip and a half
/// (0.3 ms at 200 µs, see [`Device::rtt`]); the shortest token lent then
/// is one round trip.
pub fn critical_margin(rtt: Micros) -> Micros {
    rtt + rtt / 2
}

/// How long before a lent token's end the device may pass to the next
/// holder (at most a quarter of the token), and before an announced end
/// (`Quieting`): one round trip (0.2 ms at 200 µs, see [`Device::rtt`]).
/// The borrower's
/// hook queues only work that ends within its token, so the next holder's
/// first launches queue behind the borrower's last ones, instead of
/// reaching an idle device a scheduler tick, a message and a wake-up
/// after the token's end. Measured by the shapes of `make bench`: one
/// process per group with short CPU gaps lost that much at every return.
pub fn handover_lead(rtt: Micros) -> Micros {
    rtt
}
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
    let l = water_level(groups);
    groups
        .iter()
        .map(|&(lo, hi)| l.clamp(lo, hi.max(lo)))
        .collect()
}

/// The common level of [`entitlements`]: what a group gets where neither
/// of its bounds binds (the lowest such level; 1 where every group is at
/// its ceiling).
pub fn water_level(groups: &[(f64, f64)]) -> f64 {
    let sum = |l: f64| -> f64 { groups.iter().map(|&(lo, hi)| l.clamp(lo, hi.max(lo))).sum() };
    let (mut lo, mut hi) = (0.0, 1.0);
    for _ in 0..40 {
        let mid = (lo + hi) / 2.0;
        if sum(mid) < 1.0 {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    hi
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
    /// The longest reservation without a program another user may ask.
    pub reserve_max_duration: Micros,
    /// The most GPUs another user may hold reserved at once (`None`: half
    /// of `devices`, at least 1).
    pub reserve_max_gpus: Option<u32>,
}

impl Params {
    /// The most device time a capped group may save for later (µs): its
    /// `MaxUtil` credit is capped here. With the overdraft its tokens are
    /// allowed ([`Params::overdraft`]), this bounds how far above its cap a
    /// group can go over a window `W`: by `(saved + overdraft) / W`, 0.8
    /// points over 6 s with the defaults (it was 2 points with a credit
    /// of `max_quota`). A group waiting behind another's token loses
    /// nothing by it: that token ends when the waiting group may run again
    /// (see `schedule`). Less (10 ms) and a process that needs the tokens
    /// of two devices at once (a multi-device launch) gets 0.32 instead
    /// of its 0.4: it holds one device's token while it waits for the
    /// other's, and each device's turns drift apart.
    pub fn saved_credit(&self) -> Micros {
        3 * self.min_quota
    }

    /// How far into debt (µs) a capped group's token may take its credit:
    /// its quota is cut to what its credit and this allow.
    pub fn overdraft(&self) -> Micros {
        2 * self.min_quota
    }

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
            reserve_max_duration: us(s.reserve_max_duration),
            reserve_max_gpus: s.reserve_max_gpus,
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
    /// `client` reported device time on `device` that cannot be (in the
    /// future, before its token, or charged already): it was clipped.
    /// Said at the 1st, 2nd, 4th, … such report, `reports` so far.
    Clipped {
        /// Connection.
        client: ClientId,
        /// The device.
        device: DeviceId,
        /// Clipped reports of the connection so far.
        reports: u64,
        /// The first span clipped, what could be, and why it could not
        /// (µs on the policy's clock).
        what: String,
    },
    /// `client` ended with device time unreported on `device`: it was
    /// charged `charged` µs as estimated, of `[from, until)` on the
    /// policy's clock (the rest was other groups' measured time).
    Estimated {
        /// Connection.
        client: ClientId,
        /// The device.
        device: DeviceId,
        /// The estimate's start (µs).
        from: Micros,
        /// Its end (µs).
        until: Micros,
        /// What of it was charged (µs).
        charged: Micros,
    },
}

#[derive(Debug)]
struct Client {
    role: Role,
    group: GroupKey,
    pid: u32,
    memory: BTreeMap<DeviceId, u64>,
    /// Per device, the last grant not yet reported: (granted_at, quota).
    uncharged: BTreeMap<DeviceId, (Micros, Micros)>,
    /// Per device, its last grant: (granted_at, quota).
    granted: BTreeMap<DeviceId, (Micros, Micros)>,
    /// Per device, the end of the device time last charged to it: what it
    /// reports later is charged from there on, never twice.
    charged_until: BTreeMap<DeviceId, Micros>,
    /// Per device, the grant of its oldest token whose work may not be
    /// reported yet: none of its work can have started before (a report
    /// that says so is clipped). `None`: all its work is reported.
    anchor: BTreeMap<DeviceId, Micros>,
    /// Reports clipped because they claimed what cannot be (see
    /// `Policy::charge_spans`).
    clipped: u64,
    /// Per device, since when the work whose span ended where it was last
    /// charged (`charged_until`) was outstanding: a span reported from
    /// there on is work queued behind it (see `ledger`).
    stretch: BTreeMap<DeviceId, Micros>,
    /// Devices where work of a token it gave back still runs (it said
    /// `in_flight`), until its [`Request::LateUsage`] or next report.
    in_flight: BTreeSet<DeviceId>,
    /// Devices where it held memory when it said hello: it ran there
    /// under a previous scheduler (this one restarted under it), and its
    /// first report there may hold work of that scheduler's last token
    /// that ran after this one started. Taken by that first report.
    restored: BTreeSet<DeviceId>,
    /// The multi-GPU job it is a rank of, as declared (see `gang`).
    job: Option<String>,
    /// Per device, the turn of its job (by the turn's end) in which it
    /// gave its token back between steps after the turn's end: it has
    /// finished its last step of the turn (see `gang`).
    turn_done: BTreeMap<DeviceId, Micros>,
    /// The device time its last token that it overran took (µs; 0: none
    /// overran): at least one of its launches, which its hook admits onto
    /// an empty queue even when it outlasts the token.
    launch_floor: Micros,
    /// The device time of one of its launches, as its hook last said
    /// with a token request (µs; 0: never said: not learned yet, or a
    /// hook of protocol 19 or older). Preferred to `launch_floor`, which
    /// is only learned from overruns and drifts with the tokens' length.
    launch: Micros,
    /// The device time its last lent token took where it overran it (µs;
    /// 0: its last lent token's work fitted): one launch longer than the
    /// token, admitted whole onto an empty queue (a CUDA graph's replay),
    /// as its hook keeps the rest of a lent token's queue within it. Not
    /// learned from other tokens, whose queues run past their end by a
    /// little as a rule (see `Decision::hold_for_owed`).
    long_launch: Micros,
    /// Devices where its last token, not reported yet, was lent.
    lent: BTreeSet<DeviceId>,
    /// Its user, as the kernel named its connection (`None`: unverified),
    /// and the user's name.
    uid: Option<u32>,
    user: String,
    /// Per device, the device time charged to it (µs): what its reports
    /// claimed, before any later refund to another group's work.
    gpu_used: BTreeMap<DeviceId, Micros>,
    /// Per device, the memory leased to it (part of `memory`, which its
    /// allocations take without asking) and until when (see `memory`).
    leases: BTreeMap<DeviceId, Lease>,
}

/// Memory leased to a client on a device: at most `bytes` of what it
/// holds reserved there are not allocated yet, until `until`.
#[derive(Debug, Clone, Copy)]
struct Lease {
    bytes: u64,
    until: Micros,
}

impl Client {
    /// A client that just said hello: `role`, of `group`, process `pid`,
    /// holding `memory` (per device; held under the scheduler before
    /// this one), its connection's peer `peer`.
    fn new(
        role: Role,
        group: GroupKey,
        pid: u32,
        memory: BTreeMap<DeviceId, u64>,
        peer: Option<&Peer>,
    ) -> Client {
        // Memory held at hello: it ran there under the scheduler before.
        let restored = memory.keys().copied().collect();
        Client {
            role,
            group,
            pid,
            memory,
            uncharged: BTreeMap::new(),
            granted: BTreeMap::new(),
            charged_until: BTreeMap::new(),
            anchor: BTreeMap::new(),
            clipped: 0,
            stretch: BTreeMap::new(),
            in_flight: BTreeSet::new(),
            restored,
            job: None,
            turn_done: BTreeMap::new(),
            launch_floor: 0,
            launch: 0,
            long_launch: 0,
            lent: BTreeSet::new(),
            uid: peer.map(|p| p.uid),
            user: peer.map(|p| p.user.clone()).unwrap_or_default(),
            gpu_used: BTreeMap::new(),
            leases: BTreeMap::new(),
        }
    }
}

#[derive(Debug, Clone)]
struct Waiter {
    client: ClientId,
    /// Its client's group (a shared key: cloned, not copied).
    group: GroupKey,
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
    /// Its holder ran out of it with work queued until about then, less
    /// the hand-over lead (`RunningOut`): it ends then once a program
    /// that may run waits (see `Policy::pass_on_running_out`).
    runs_out_at: Option<Micros>,
}

impl Grant {
    /// Ends the token at `at`, as announced (`Quieting`, `RunningOut`):
    /// by design, not revoked. An end no earlier than its own changes
    /// nothing (its overrun is still a revocation): `false`.
    fn end_early(&mut self, at: Micros) -> bool {
        if at >= self.expires_at {
            return false;
        }
        self.expires_at = at;
        self.ends = true;
        true
    }
}

/// A hooked program (its client connection), for the accounting log
/// and `gem-schd status`.
#[derive(Debug, Clone, PartialEq)]
pub struct Program {
    /// Its connection.
    pub client: ClientId,
    /// Its process.
    pub pid: u32,
    /// Its user (`None`: an unverified peer).
    pub uid: Option<u32>,
    /// Its user's name (empty where unknown).
    pub user: String,
    /// Its group.
    pub group: String,
    /// Device time charged to it since it said hello, per device (µs).
    pub gpu_us: Vec<(DeviceId, Micros)>,
}

/// The most ended programs kept for the daemon to take: more (a daemon
/// that never takes them, as in tests) drops the oldest.
const MAX_ENDED: usize = 4096;

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
    /// Device time charged to the group since the scheduler started (µs).
    pub used_us: Micros,
    /// What its programs' reports claimed since the scheduler started,
    /// by user (µs; `None`: unverified peers): the split of `used_us`
    /// among users, in proportion (a refund to another group's work is
    /// taken from the group, not from one of its users).
    pub by_user: Vec<(Option<u32>, Micros)>,
}

#[derive(Debug, Default)]
struct Device {
    token: Option<Grant>,
    /// Programs of the holder's group that run beside it, their tokens
    /// ending with its (see `share`).
    with: Vec<Grant>,
    waiters: Vec<Waiter>,
    groups: BTreeMap<GroupKey, GroupUse>,
    busy: Usage,
    /// Who the device's time was over the window, as measured.
    ledger: ledger::Ledger,
    /// Until when the device is kept free for a latency-critical group
    /// about to come back (see `schedule`): the waiters' launches would
    /// not end before it.
    hold_until: Option<Micros>,
    /// Its clients' token round trip, as they measure and report it
    /// (ns, averaged; 0: none reported yet): see [`Device::rtt`].
    rtt_ns: u64,
    /// The client whose token was passed on as it ran out, ahead of its
    /// next request (`RunningOut`): its group counts as waiting until it
    /// asks again, leaves, or `until` passes.
    returning: Option<Returning>,
}

/// A client about to ask for the device again (see `Device::returning`).
#[derive(Debug, Clone)]
struct Returning {
    client: ClientId,
    group: GroupKey,
    until: Micros,
}

impl Device {
    /// A client on the device reported its round trip (µs; 0: it has
    /// measured none yet).
    fn note_rtt(&mut self, rtt_us: u32) {
        if rtt_us != 0 {
            self.rtt_ns = gemini_protocol::roundtrip::fold(self.rtt_ns, rtt_us as u64 * 1000);
        }
    }

    /// The round trip the device's leads are derived from (µs): its
    /// clients' average estimate within 100-200 µs, or 200 µs before any
    /// reported one (`gemini_protocol::roundtrip::basis`). Every lead that
    /// hides a round trip is the value it had as a constant scaled by it
    /// over 200 µs: how early a lent or announced token passes the device
    /// on ([`handover_lead`]), how long before a latency-critical group's
    /// return a token lent meanwhile ends ([`critical_margin`]), the
    /// shortest token lent then (one round trip) and the shortest lent
    /// token ([`lent_min_quota`]). The bounds keep one client's report,
    /// true or not, from moving another group's margins by more than
    /// half.
    fn rtt(&self) -> Micros {
        gemini_protocol::roundtrip::basis(self.rtt_ns) / 1000
    }
    /// Charges `group` the device time `[start, end)` its work occupied,
    /// work outstanding since `since` (at or before `start`), as the
    /// ledger settles it against what other groups claimed (see
    /// `ledger`): its usage over the window, its `MaxUtil` credit and the
    /// device's busy time; a group charged before for time that was
    /// `group`'s is refunded. `max_util` gives each group's `MaxUtil`.
    /// Returns the time charged. For an estimate (what a process that
    /// died without reporting may have run), only time no measured claim
    /// has, now or later (see `ledger`).
    fn charge_estimate(
        &mut self,
        (group, uid): (&GroupKey, Option<u32>),
        (start, end): (Micros, Micros),
        now: Micros,
        max_util: impl Fn(&GroupKey) -> f64,
        cap: Micros,
    ) -> Micros {
        let charged = self.claim((group, uid), (start, end), start, cap, true);
        self.charge_credit(group, start, now, charged, max_util(group), cap);
        charged
    }

    /// [`Device::charge`] without the `MaxUtil` credit: the usage, the
    /// busy time and the refunds only. The spans of one report are claimed
    /// one by one and their credit charged once, with
    /// [`Device::charge_credit`]: charged span by span, the credit the
    /// group earned while it held its token was added with the first span,
    /// cut at the cap, and the spans after it were taken from a credit
    /// that had lost it (a lone group capped at 0.8 got 0.57).
    fn claim(
        &mut self,
        (group, uid): (&GroupKey, Option<u32>),
        (start, end): (Micros, Micros),
        since: Micros,
        cap: Micros,
        estimated: bool,
    ) -> Micros {
        let settled = if estimated {
            self.ledger.estimate(group, start, end)
        } else {
            self.ledger.claim(group, start, end, since)
        };
        for (other, s, e) in &settled.refunded {
            if let Some(g) = self.groups.get_mut(other) {
                g.refund(*s, *e, cap);
            }
        }
        if settled.charged.is_empty() {
            return 0;
        }
        // Hot path (every token): the group's name cloned only the first
        // time it uses the device.
        let g = match self.groups.get_mut(group) {
            Some(g) => g,
            None => self.groups.entry(group.clone()).or_default(),
        };
        let mut charged = 0;
        for &(s, e) in &settled.charged {
            g.usage.add(s, e);
            self.busy.add(s, e);
            charged += e - s;
        }
        let by = g.used_by.entry(uid).or_default();
        *by = by.saturating_add(charged);
        charged
    }

    /// Takes `used` µs of device time, from `from` on, out of `group`'s
    /// `MaxUtil` credit (see `GroupUse::charge`).
    fn charge_credit(
        &mut self,
        group: &GroupKey,
        from: Micros,
        now: Micros,
        used: Micros,
        max_util: f64,
        cap: Micros,
    ) {
        if used == 0 {
            return;
        }
        if let Some(g) = self.groups.get_mut(group) {
            g.charge(from, now, used, max_util, cap);
        }
    }
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
    /// How many of `clients` declared a job: none (the common case), and
    /// no request looks for turns.
    ranks: usize,
    devices: BTreeMap<DeviceId, Device>,
    /// Bytes reserved per (group, device).
    memory: BTreeMap<(GroupKey, DeviceId), u64>,
    /// The most a context took per user and device, as that user's
    /// processes measured it (see [`Policy::context_cost`]).
    context_cost: BTreeMap<(u32, DeviceId), u64>,
    /// Groups short of memory on a device, until when their processes'
    /// leases there are recalled (none is granted or renewed meanwhile),
    /// and for which client.
    recalls: BTreeMap<(GroupKey, DeviceId), (Micros, ClientId)>,
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
    /// Programs that ended since the daemon last took them
    /// ([`Policy::take_ended`]), for the accounting log.
    ended: Vec<Program>,
    /// Open turns of jobs spanning devices, by their leader device.
    turns: BTreeMap<DeviceId, gang::Turn>,
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
        latency: Latency::Normal,
    };
    match key {
        GroupKey::Holder => Limits {
            min_util: 0.0,
            max_util: 1.0,
            memory_limit: u64::MAX,
            latency: Latency::Normal,
        },
        GroupKey::Control => NOTHING,
        GroupKey::Named(name) => configured(config, retired, name).map_or(NOTHING, |g| Limits {
            min_util: g.min_util,
            max_util: g.max_util,
            memory_limit: g.memory_limit,
            latency: g.latency,
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

fn error(kind: ErrorKind, message: impl Into<String>) -> Reply {
    Reply::Error(ErrorReply {
        kind,
        message: message.into(),
    })
}

/// The holder's name where groups are shown (status, metrics, `top`).
pub const HOLDER_SHOWN: &str = "(holder)";

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
            context_cost: BTreeMap::new(),
            recalls: BTreeMap::new(),
            activity: BTreeMap::new(),
            poll: None,
            orders: Default::default(),
            demands: Vec::new(),
            reservations: Vec::new(),
            queue: Default::default(),
            released_at: BTreeMap::new(),
            peers: BTreeMap::new(),
            ended: Vec::new(),
            turns: BTreeMap::new(),
            ranks: 0,
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
                    | Request::AcquireTokenAhead { device, .. }
                    | Request::ReleaseToken { device, .. }
                    | Request::Quieting { device, .. }
                    | Request::RunningOut { device, .. } => Some(*device),
                    _ => None,
                };
                self.request(client, seq, req, now, &mut out);
            }
            Event::Disconnected { client } => {
                self.peers.remove(&client);
                self.disconnect(client, now, &mut out);
            }
            Event::Reconfigure(cfg) => self.reconfigure(cfg),
            Event::Tick => self.serve_limited(now, &mut out),
        }
        // A reservation that expired lets its devices' other groups go.
        if self.expire_reservations(now, &mut out) {
            only = None;
        }
        match only {
            Some(d) => self.schedule(d, now, &mut out),
            None => self.schedule_all(now, &mut out),
        }
        // A turn of a job spanning devices opened or ended: its other
        // devices' waiters may go now.
        if only.is_some() && !self.turns.is_empty() {
            self.schedule_all(now, &mut out);
        }
        self.holder_tick(now, &mut out);
        out
    }

    fn disconnect(&mut self, client: ClientId, now: Micros, out: &mut Vec<Action>) {
        let Some(mut c) = self.clients.remove(&client) else {
            return;
        };
        if c.job.is_some() {
            self.ranks -= 1;
        }
        for (device, bytes) in &c.memory {
            if let Some(m) = self.memory.get_mut(&(c.group.clone(), *device)) {
                *m = m.saturating_sub(*bytes);
            }
        }
        for dev in self.devices.values_mut() {
            dev.waiters.retain(|w| w.client != client);
            dev.returning.take_if(|r| r.client == client);
            dev.take_back(client);
        }
        // It cannot report any more, and its work is gone with it (the
        // driver drops a dead process's work).
        self.charge_unreported(client, &mut c, now, out);
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
        if c.role == Role::Client {
            if self.ended.len() >= MAX_ENDED {
                self.ended.remove(0);
            }
            self.ended.push(program(client, &c));
        }
        self.end_reservations(client, now, out);
    }

    /// The process of program `client` (`None`: not a program's
    /// connection).
    pub fn client_pid(&self, client: ClientId) -> Option<u32> {
        self.clients
            .get(&client)
            .filter(|c| c.role == Role::Client)
            .map(|c| c.pid)
    }

    /// The programs holding a device's token now, as `[pid, device]`.
    pub fn token_holders(&self) -> Vec<[u32; 2]> {
        self.devices
            .iter()
            .flat_map(|(&d, dev)| {
                dev.grants().filter_map(move |t| {
                    let c = self.clients.get(&t.client)?;
                    (c.role == Role::Client).then_some([c.pid, d])
                })
            })
            .collect()
    }

    /// The programs that ended since the last call, with the device time
    /// each was charged.
    pub fn take_ended(&mut self) -> Vec<Program> {
        std::mem::take(&mut self.ended)
    }

    /// Program `client`, if it is one (a hooked process's connection).
    pub fn program(&self, client: ClientId) -> Option<Program> {
        self.clients
            .get(&client)
            .filter(|c| c.role == Role::Client)
            .map(|c| program(client, c))
    }

    /// Charges what `c` had not reported: it ran, as far as can be known,
    /// from its oldest unreported token (or the end of what it was
    /// charged) for as long as its last token may be held (its quota and
    /// the grace), or until `now` if that is sooner: charged so, but only
    /// where no measured claim has that time, now or when it is reported
    /// later (see `ledger`).
    fn charge_unreported(
        &mut self,
        client: ClientId,
        c: &mut Client,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        for (device, dev) in self.devices.iter_mut() {
            let (Some(&anchor), Some(&(granted_at, quota))) =
                (c.anchor.get(device), c.granted.get(device))
            else {
                continue;
            };
            let from = c
                .charged_until
                .get(device)
                .map_or(anchor, |&u| u.max(anchor));
            let until = now.min(
                granted_at
                    .saturating_add(quota)
                    .saturating_add(self.params.grace),
            );
            let (config, retired) = (&self.config, &self.retired);
            let charged = dev.charge_estimate(
                (&c.group, c.uid),
                (from, until),
                now,
                |k| limits(config, retired, k).max_util,
                self.params.saved_credit(),
            );
            let used = c.gpu_used.entry(*device).or_default();
            *used = used.saturating_add(charged);
            out.push(Action::Estimated {
                client,
                device: *device,
                from,
                until,
                charged,
            });
        }
    }

    /// The scheduler stops: what the holders of the devices' tokens ran
    /// under them and have not reported is charged as estimated, to
    /// `now` (the next scheduler takes their reports only from its own
    /// start), so that the charges this one leaves behind, in the
    /// accounting log, hold that work too. Other clients' unreported work
    /// (a token given back with work in flight) is left out: an estimate
    /// of it would run into the token holders' time.
    pub fn settle(&mut self, now: Micros) {
        let holders: BTreeSet<ClientId> = self
            .devices
            .values()
            .flat_map(|d| d.grants().map(|t| t.client))
            .collect();
        for id in holders {
            if let Some(mut c) = self.clients.remove(&id) {
                let holds: Vec<DeviceId> = self
                    .devices
                    .iter()
                    .filter(|(_, d)| d.holds(id))
                    .map(|(&d, _)| d)
                    .collect();
                c.anchor.retain(|d, _| holds.contains(d));
                self.charge_unreported(id, &mut c, now, &mut Vec::new());
                c.anchor.clear();
                self.clients.insert(id, c);
            }
        }
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

    /// The group of client `id`, if it is one (`(holder)` for the holder).
    pub fn client_group(&self, id: ClientId) -> Option<String> {
        self.clients.get(&id).map(|c| c.group.shown())
    }

    /// The memory each hooked process holds, as `(pid, group, [(device,
    /// bytes)])`, for the daemon's state file (the holder's is not kept:
    /// it says hello again at once, and gives memory back on demand).
    pub fn client_memory(&self) -> Vec<ProcessMemory> {
        self.clients
            .values()
            .filter(|c| c.role == Role::Client)
            .filter_map(|c| {
                let held: Vec<(DeviceId, u64)> = c
                    .memory
                    .iter()
                    .filter(|(_, b)| **b > 0)
                    .map(|(&d, &b)| (d, b))
                    .collect();
                let group = c.group.name()?.to_string();
                (!held.is_empty()).then_some((c.pid, group, held))
            })
            .collect()
    }

    /// Whether `id` is a registered hooked process (not the holder or a
    /// tool).
    pub fn is_process(&self, id: ClientId) -> bool {
        self.clients
            .get(&id)
            .is_some_and(|c| c.role == Role::Client)
    }

    /// Process ids of registered clients, for the liveness check.
    pub fn client_pids(&self) -> impl Iterator<Item = (ClientId, u32)> + '_ {
        self.clients.iter().map(|(&id, c)| (id, c.pid))
    }
}

/// What a hooked process holds: its pid, its group, and `(device,
/// bytes)` for each device it holds memory on.
pub type ProcessMemory = (u32, String, Vec<(DeviceId, u64)>);

#[cfg(test)]
mod tests;

/// `c`, connection `client`, as a [`Program`].
fn program(client: ClientId, c: &Client) -> Program {
    Program {
        client,
        pid: c.pid,
        uid: c.uid,
        user: c.user.clone(),
        group: c.group.shown(),
        gpu_us: c.gpu_used.iter().map(|(&d, &t)| (d, t)).collect(),
    }
}
