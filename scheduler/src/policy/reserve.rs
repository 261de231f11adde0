//! GPU reservations for `gem-launch --gpus N | --gpu-ids …`: the
//! scheduler is the single source of truth for which launches hold which
//! devices, and the queue of those waiting.
//!
//! A reservation *claims* its group's `MinUtil` of each device it holds
//! (a group without a minimum claims the whole device, and one made
//! without a program the whole device); a device has room while its
//! claims add up to at most 1. A reserved device is its reservations':
//! other groups' processes on it get no token until they end. Among devices with room, the least
//! recently released are chosen first. Waiting launches are served strictly
//! first come, first served. A reservation ends when its process ends.
//!
//! A reservation made without a program (`gem-launch reserve --duration`,
//! [`Request::ReserveFor`](gemini_protocol::Request::ReserveFor)) belongs
//! to its user, not to the connection: it ends when it expires, or when
//! its user (or the daemon's user, or root) releases it.

use super::{Action, GroupKey, Micros, Policy, error};
use gemini_config::GroupConfig;
use gemini_protocol::{
    ClientId, DeviceId, ErrorKind, GpuRequest, ManualReservation, Reply, ReservationStatus,
    ReservedFor,
};

/// The longest reservation without a program: 30 days.
pub(super) const MAX_MANUAL_RESERVATION: Micros = 30 * 86_400_000_000;

/// A reservation held.
#[derive(Debug, Clone)]
pub struct Reservation {
    client: ClientId,
    group: String,
    gpus: GpuRequest,
    devices: Vec<DeviceId>,
    claim: f64,
    since: Micros,
    /// How long it was held before this scheduler started (by the one
    /// before, restored from its state file).
    before: Micros,
    /// Made without a program: whose, and until when.
    manual: Option<Manual>,
    /// The user whose `reserve_max_gpus` a launch's reservation counts
    /// against: its peer's uid, or, restored after a restart (held by the
    /// daemon's stand-in), the uid of the launch that made it.
    owner: Option<u32>,
}

impl Reservation {
    /// When it was made, on this scheduler's clock (negative: before it
    /// started).
    fn held_since(&self) -> i64 {
        self.since as i64 - self.before.min(i64::MAX as u64) as i64
    }
}

/// A launch's reservation, as the daemon's state file keeps it.
#[derive(Debug, Clone, PartialEq)]
pub struct HeldReservation {
    /// The connection of the launch.
    pub client: ClientId,
    /// Its group.
    pub group: String,
    /// The GPUs it holds.
    pub devices: Vec<DeviceId>,
    /// When it was made, on this scheduler's clock (negative: before it
    /// started).
    pub since: i64,
    /// The uid whose `reserve_max_gpus` it counts against.
    pub owner: Option<u32>,
}

/// A launch waiting for devices.
#[derive(Debug, Clone)]
pub struct Waiting {
    client: ClientId,
    seq: u32,
    group: String,
    gpus: GpuRequest,
    claim: f64,
    since: Micros,
    manual: Option<Manual>,
}

/// Whose a reservation without a program is, and how long it lasts.
#[derive(Debug, Clone)]
struct Manual {
    uid: u32,
    user: String,
    /// Its length, from when it is granted.
    duration: Micros,
    /// When it expires (once granted).
    until: Micros,
}

const EPSILON: f64 = 1e-9;

/// How many GPUs `gpus` asks for.
fn count(gpus: &GpuRequest) -> usize {
    match gpus {
        GpuRequest::Count(n) => *n as usize,
        GpuRequest::Ids(ids) => ids.len(),
    }
}

/// What is wrong with `gpus` on a machine of `n` GPUs, if anything: none
/// asked, more than it has, a repeated id, or one it has not.
fn off_machine(gpus: &GpuRequest, n: u32) -> Option<String> {
    match gpus {
        GpuRequest::Count(k) => {
            (*k == 0 || *k > n).then(|| format!("asked for {k} GPUs; this machine has {n}"))
        }
        GpuRequest::Ids(ids) if ids.is_empty() => Some("no GPU ids given".into()),
        GpuRequest::Ids(ids) => {
            let mut sorted = ids.clone();
            sorted.sort_unstable();
            sorted.dedup();
            if sorted.len() != ids.len() {
                Some(format!("GPU ids {ids:?} repeat a device"))
            } else {
                ids.iter()
                    .find(|&&d| d >= n)
                    .map(|d| format!("GPU {d} does not exist; this machine has GPUs 0..{}", n - 1))
            }
        }
    }
}

/// What is wrong with `gpus` for `group` (`cfg`), if anything: more than
/// its `Devices`, or one not among them.
fn outside_devices(cfg: &GroupConfig, group: &str, gpus: &GpuRequest) -> Option<String> {
    let allowed = cfg.devices.as_ref()?;
    let list: Vec<String> = allowed.iter().map(u32::to_string).collect();
    let place = format!("Devices= in {}", cfg.defined_at());
    match gpus {
        GpuRequest::Count(k) => (*k as usize > allowed.len()).then(|| {
            format!(
                "asked for {k} GPUs; group {group:?} may use {} ({}: {place})",
                allowed.len(),
                list.join(", ")
            )
        }),
        GpuRequest::Ids(ids) => ids.iter().find(|&&d| !cfg.uses(d)).map(|d| {
            format!(
                "group {group:?} may not use GPU {d}, only {} ({place})",
                list.join(", ")
            )
        }),
    }
}

/// The groups holding a reservation of `device`, each once: while there
/// is any, only their processes (and the holder) get the device's tokens.
pub(super) fn reserved_for(reservations: &[Reservation], device: DeviceId) -> Vec<&str> {
    let mut groups: Vec<&str> = Vec::new();
    for r in reservations.iter().filter(|r| r.devices.contains(&device)) {
        if !groups.contains(&r.group.as_str()) {
            groups.push(&r.group);
        }
    }
    groups
}

/// Whether `key`'s processes are kept off a device reserved for
/// `reserved` (the groups holding a reservation of it; none: nobody is):
/// a configured group that holds none of them. The holder is never kept
/// out (it hands the device back at once).
pub(super) fn kept_out(reserved: &[&str], key: &GroupKey) -> bool {
    !reserved.is_empty() && key.name().is_some_and(|n| !reserved.contains(&n))
}

/// What a reservation of `group` claims of each device it holds: its
/// `MinUtil` for a program's launch (a group without one claims the
/// whole device), the whole device for one made without a program
/// (canhazgpu's `reserve`: the GPUs are the user's).
fn claim_of(min_util: f64, manual: bool) -> f64 {
    if min_util > 0.0 && !manual {
        min_util
    } else {
        1.0
    }
}

impl Policy {
    fn claimed(&self, device: DeviceId) -> f64 {
        self.reservations
            .iter()
            .filter(|r| r.devices.contains(&device))
            .map(|r| r.claim)
            .sum()
    }

    fn has_room(&self, device: DeviceId, claim: f64) -> bool {
        self.claimed(device) + claim <= 1.0 + EPSILON
    }

    /// Devices for `gpus` of `group` (among its `Devices`) if they have
    /// room now; for `client` a user other than root or the daemon's, only
    /// devices no other group uses (see [`Policy::used_by_others`]).
    fn pick(
        &self,
        client: ClientId,
        group: &str,
        gpus: &GpuRequest,
        claim: f64,
    ) -> Option<Vec<DeviceId>> {
        let cfg = self.config.groups.get(group);
        let limited = self.limited(client);
        let room =
            |d: DeviceId| self.has_room(d, claim) && !(limited && self.used_by_others(d, group));
        match gpus {
            GpuRequest::Count(n) => {
                let mut free: Vec<DeviceId> = (0..self.params.devices)
                    .filter(|&d| cfg.is_none_or(|g| g.uses(d)) && room(d))
                    .collect();
                free.sort_by_key(|d| (self.released_at.get(d).copied().unwrap_or(0), *d));
                (free.len() >= *n as usize).then(|| free[..*n as usize].to_vec())
            }
            GpuRequest::Ids(ids) => ids.iter().all(|&d| room(d)).then(|| ids.clone()),
        }
    }

    /// Whether `client` is of a user other than root and the daemon's,
    /// held to the site's reservation limits.
    fn limited(&self, client: ClientId) -> bool {
        self.limited_peer(client).is_some()
    }

    /// Serves the launches waiting for GPUs other groups used, once in a
    /// while (no event says that a group stopped using a GPU).
    pub(super) fn serve_limited(&mut self, now: Micros, out: &mut Vec<Action>) {
        if self.queue.iter().any(|w| self.limited(w.client)) {
            self.serve_queue(now, out);
        }
    }

    /// Whether a group other than `group` uses `device` now: holds memory
    /// there, or holds or waits for its token. A reservation keeps every
    /// other group's processes off its devices, so a user may reserve
    /// only GPUs no other group uses (or wait for them in the queue): one
    /// user's reservation must not take a running group's share away.
    fn used_by_others(&self, device: DeviceId, group: &str) -> bool {
        let other = |k: &GroupKey| k.name().is_some_and(|n| n != group);
        let memory = self
            .memory
            .iter()
            .any(|((k, d), &b)| *d == device && b > 0 && other(k));
        let client_other = |c: ClientId| self.clients.get(&c).is_some_and(|c| other(&c.group));
        memory
            || self.devices.get(&device).is_some_and(|dev| {
                dev.grants().any(|t| client_other(t.client))
                    || dev.waiters.iter().any(|w| client_other(w.client))
            })
    }

    /// Reserves `gpus` for `group`, asked by `client` (request `seq`): for
    /// its program, or without one for `duration`. Granted at once where
    /// they have room and nobody waits before it, queued where `wait`
    /// says so, refused otherwise.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn reserve_gpus(
        &mut self,
        client: ClientId,
        seq: u32,
        group: String,
        gpus: GpuRequest,
        wait: bool,
        duration: Option<Micros>,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let manual = duration.map(|duration| self.manual(client, duration));
        let mut answer = |reply| out.push(Action::Reply { client, seq, reply });
        let Some(cfg) = self.config.groups.get(&group) else {
            return answer(self.unknown_group(&group));
        };
        let claim = claim_of(cfg.min_util, manual.is_some());
        if let Some(r) = self.refuse_request(cfg, &group, &gpus) {
            return answer(r);
        }
        if let Some(r) = self.refuse_gpus(client, &gpus) {
            return answer(r);
        }
        if self.queue.iter().any(|w| w.client == client)
            || (manual.is_none()
                && self
                    .reservations
                    .iter()
                    .any(|r| r.client == client && r.manual.is_none()))
        {
            return answer(error(
                ErrorKind::Unexpected,
                "this connection already holds or waits for a reservation",
            ));
        }
        // First come, first served: nobody overtakes a waiting launch (but
        // one that waits for GPUs others use: see `serve_queue`).
        if self.queue.iter().all(|w| self.limited(w.client))
            && let Some(devices) = self.pick(client, &group, &gpus, claim)
        {
            let owner = self.peer(client).map(|p| p.uid);
            self.reservations.push(Reservation {
                client,
                group,
                gpus,
                devices: devices.clone(),
                claim,
                since: now,
                before: 0,
                manual: manual.map(|m| m.granted(now)),
                owner,
            });
            return answer(Reply::Reserved { devices });
        }
        if wait {
            self.queue.push_back(Waiting {
                client,
                seq,
                group,
                gpus,
                claim,
                since: now,
                manual,
            });
            return;
        }
        answer(self.unavailable(&cfg.name))
    }

    /// Whose a reservation without a program asked by `client` for
    /// `duration` is.
    fn manual(&self, client: ClientId, duration: Micros) -> Manual {
        let peer = self.peer(client);
        Manual {
            // A peer the transport could not name: only the daemon's
            // user or root may release it early.
            uid: peer.map_or(u32::MAX, |p| p.uid),
            user: peer.map_or_else(|| "(unknown)".into(), |p| p.user.clone()),
            duration,
            until: 0,
        }
    }

    /// The answer to a reservation of `group`, which the file does not
    /// define.
    fn unknown_group(&self, group: &str) -> Reply {
        let known: Vec<&str> = self.config.groups.keys().map(String::as_str).collect();
        error(
            ErrorKind::UnknownGroup,
            format!(
                "group {group:?} is not defined in {}; groups: {}",
                self.config.path.display(),
                known.join(", ")
            ),
        )
    }

    /// Refuses `gpus` for `group` (`cfg`) where the machine has not got
    /// them, or they are not among the group's `Devices`.
    fn refuse_request(&self, cfg: &GroupConfig, group: &str, gpus: &GpuRequest) -> Option<Reply> {
        let n = self.params.devices;
        if n == 0 {
            return Some(error(
                ErrorKind::BadRequest,
                "the scheduler knows no GPUs (neither /proc/driver/nvidia/gpus nor NVML lists any): set `devices` in gemini.toml, or start gem-schd with --devices N",
            ));
        }
        let bad = off_machine(gpus, n).or_else(|| outside_devices(cfg, group, gpus));
        bad.map(|msg| error(ErrorKind::BadRequest, msg))
    }

    /// The answer to a reservation of group `name` that no GPU has room
    /// for now, and that does not wait.
    fn unavailable(&self, name: &str) -> Reply {
        let held: Vec<String> = self
            .reservations
            .iter()
            .map(|r| format!("{} holds {:?}", r.group, r.devices))
            .collect();
        error(
            ErrorKind::Unavailable,
            format!(
                "no GPU has room for group {:?} now ({}{} waiting); retry, or wait in the queue without --nonblock",
                name,
                if held.is_empty() {
                    "none held".to_string()
                } else {
                    held.join(", ")
                },
                format_args!(", {}", self.queue.len())
            ),
        )
    }

    /// Refuses a reservation without a program of `duration` µs asked by
    /// `client`: none lasts 0 or past [`MAX_MANUAL_RESERVATION`], and
    /// none of a user other than root or the daemon's past
    /// `reserve_max_duration` (gemini.toml).
    pub(super) fn refuse_duration(&self, client: ClientId, duration: Micros) -> Option<Reply> {
        let days = |us: Micros| us as f64 / 86_400_000_000.0;
        if duration == 0 || duration > MAX_MANUAL_RESERVATION {
            return Some(error(
                ErrorKind::BadRequest,
                format!(
                    "a reservation lasts more than 0 and at most {} days",
                    days(MAX_MANUAL_RESERVATION)
                ),
            ));
        }
        let limit = self.params.reserve_max_duration;
        let peer = self.limited_peer(client)?;
        let length =
            |us| gemini_protocol::units::format_length(std::time::Duration::from_micros(us));
        (duration > limit).then(|| {
            error(
                ErrorKind::PermissionDenied,
                format!(
                    "user {} may reserve GPUs for at most {} (reserve_max_duration in gemini.toml), not {}",
                    peer.user,
                    length(limit),
                    length(duration)
                ),
            )
        })
    }

    /// The most GPUs a user other than root or the daemon's may hold
    /// reserved at once: `reserve_max_gpus` (gemini.toml), by default half
    /// the machine's, at least 1, so that no one user takes every GPU.
    fn max_gpus_per_user(&self) -> u32 {
        self.params
            .reserve_max_gpus
            .unwrap_or((self.params.devices / 2).max(1))
    }

    /// Refuses `gpus` to `client` where its user (root and the daemon's
    /// user aside) would then hold, or wait for, more GPUs than
    /// [`Policy::max_gpus_per_user`]: its reservations with a program and
    /// without, and its place in the queue.
    fn refuse_gpus(&self, client: ClientId, gpus: &GpuRequest) -> Option<Reply> {
        let peer = self.limited_peer(client)?;
        let uid = peer.uid;
        let owner = |c: ClientId, manual: Option<&Manual>| {
            manual.map_or_else(|| self.peer(c).map(|p| p.uid), |m| Some(m.uid))
        };
        let held: usize = self
            .reservations
            .iter()
            .filter(|r| r.owner == Some(uid))
            .map(|r| r.devices.len())
            .chain(
                self.queue
                    .iter()
                    .filter(|w| owner(w.client, w.manual.as_ref()) == Some(uid))
                    .map(|w| count(&w.gpus)),
            )
            .sum();
        let max = self.max_gpus_per_user();
        (held + count(gpus) > max as usize).then(|| {
            error(
                ErrorKind::PermissionDenied,
                format!(
                    "user {} may hold at most {max} GPU(s) reserved at once (reserve_max_gpus in gemini.toml{}); \
                     it holds or waits for {held}, and asked for {}",
                    peer.user,
                    if self.params.reserve_max_gpus.is_none() {
                        ": by default half the machine's"
                    } else {
                        ""
                    },
                    count(gpus)
                ),
            )
        })
    }

    /// The process of `client` ended: its reservations end, its place in
    /// the queue is gone, and waiting launches may now fit.
    pub(super) fn end_reservations(
        &mut self,
        client: ClientId,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        // One made without a program outlives its connection.
        let ended = !self
            .end_where(now, |r| r.client == client && r.manual.is_none())
            .is_empty();
        let before = self.queue.len();
        self.queue.retain(|w| w.client != client);
        if ended || self.queue.len() != before {
            self.serve_queue(now, out);
        }
    }

    /// Serves the queue in order, as far as it can: a launch that does not
    /// fit stops those behind it (first come, first served), but one of a
    /// user held to GPUs no other group uses (see [`Policy::pick`]) does
    /// not, as those may stay in use for good.
    pub(super) fn serve_queue(&mut self, now: Micros, out: &mut Vec<Action>) {
        let mut i = 0;
        while let Some(w) = self.queue.get(i) {
            let Some(devices) = self.pick(w.client, &w.group, &w.gpus, w.claim) else {
                if self.limited(w.client) {
                    i += 1;
                    continue;
                }
                break;
            };
            let Some(w) = self.queue.remove(i) else {
                break;
            };
            out.push(Action::Reply {
                client: w.client,
                seq: w.seq,
                reply: Reply::Reserved {
                    devices: devices.clone(),
                },
            });
            let owner = self.peer(w.client).map(|p| p.uid);
            self.reservations.push(Reservation {
                client: w.client,
                group: w.group,
                gpus: w.gpus,
                devices,
                claim: w.claim,
                since: now,
                before: 0,
                manual: w.manual.map(|m| m.granted(now)),
                owner,
            });
        }
    }

    /// Ends the reservations without a program that expired by `now`;
    /// says whether any did (their devices' waiters may go now).
    pub(super) fn expire_reservations(&mut self, now: Micros, out: &mut Vec<Action>) -> bool {
        let expired = |r: &Reservation| r.manual.as_ref().is_some_and(|m| m.until <= now);
        let any = !self.end_where(now, expired).is_empty();
        if any {
            self.serve_queue(now, out);
        }
        any
    }

    /// Ends the reservations `ends` picks, their devices released at
    /// `now`; returns those devices, in order, each once.
    fn end_where(&mut self, now: Micros, ends: impl Fn(&Reservation) -> bool) -> Vec<DeviceId> {
        let mut freed = Vec::new();
        let released_at = &mut self.released_at;
        self.reservations.retain(|r| {
            if !ends(r) {
                return true;
            }
            for &d in &r.devices {
                released_at.insert(d, now);
                freed.push(d);
            }
            false
        });
        freed.sort_unstable();
        freed.dedup();
        freed
    }

    /// When the next reservation without a program expires.
    pub(super) fn next_expiry(&self) -> Option<Micros> {
        self.reservations
            .iter()
            .filter_map(|r| r.manual.as_ref().map(|m| m.until))
            .min()
    }

    /// Ends the reservations without a program of `client`'s user (any
    /// user's for the daemon's user and root) that hold any of `devices`
    /// (empty: all).
    pub(super) fn release_reserved(
        &mut self,
        client: ClientId,
        devices: &[DeviceId],
        now: Micros,
        out: &mut Vec<Action>,
    ) -> Reply {
        let peer = self.peer(client);
        let anyone = peer.is_none_or(|p| p.uid == 0 || p.uid == self.params.admin_uid);
        let uid = peer.map(|p| p.uid);
        let freed = self.end_where(now, |r| {
            r.manual.as_ref().is_some_and(|m| {
                (anyone || Some(m.uid) == uid)
                    && (devices.is_empty() || r.devices.iter().any(|d| devices.contains(d)))
            })
        });
        if !freed.is_empty() {
            self.serve_queue(now, out);
        }
        Reply::Released { devices: freed }
    }

    /// The launches' reservations, in the order they were made (for the
    /// daemon's state file).
    pub fn held_reservations(&self) -> Vec<HeldReservation> {
        self.reservations
            .iter()
            .filter(|r| r.manual.is_none())
            .map(|r| HeldReservation {
                client: r.client,
                group: r.group.clone(),
                devices: r.devices.clone(),
                since: r.held_since(),
                owner: r.owner,
            })
            .collect()
    }

    /// The reservations made without a program, as `(group, devices, uid,
    /// user, until, since)` (for the daemon's state file).
    pub fn manual_reservations(&self) -> Vec<(String, Vec<DeviceId>, u32, String, Micros, i64)> {
        self.reservations
            .iter()
            .filter_map(|r| {
                let m = r.manual.as_ref()?;
                Some((
                    r.group.clone(),
                    r.devices.clone(),
                    m.uid,
                    m.user.clone(),
                    m.until,
                    r.held_since(),
                ))
            })
            .collect()
    }

    /// Counts the time the previous scheduler held `client`'s restored
    /// reservation (`before`, µs) in how long it has been held, and
    /// counts it against the user who made it (`owner`, where the state
    /// file says), not the daemon whose stand-in holds it now.
    pub fn restored_reservation(&mut self, client: ClientId, before: Micros, owner: Option<u32>) {
        for r in self.reservations.iter_mut().filter(|r| r.client == client) {
            r.before = before;
            if owner.is_some() {
                r.owner = owner;
            }
        }
    }

    /// Takes back a reservation made without a program that a previous
    /// daemon held (made by `owner`: uid and user name; held for `before`
    /// µs before this scheduler started), until `until` (this scheduler's
    /// clock), if it has not expired, its group exists and its devices
    /// have room (as they had).
    pub fn restore_manual(
        &mut self,
        group: &str,
        devices: Vec<DeviceId>,
        owner: (u32, String),
        until: Micros,
        before: Micros,
        now: Micros,
    ) -> Result<(), String> {
        let (uid, user) = owner;
        let Some(cfg) = self.config.groups.get(group) else {
            return Err(format!("group {group:?} is no longer defined"));
        };
        if until <= now {
            return Err("it has expired".into());
        }
        let claim = claim_of(cfg.min_util, true);
        if let Some(&d) = devices.iter().find(|&&d| !self.has_room(d, claim)) {
            return Err(format!("GPU {d} has no room for it"));
        }
        self.reservations.push(Reservation {
            owner: Some(uid),
            client: 0,
            group: group.into(),
            gpus: GpuRequest::Ids(devices.clone()),
            devices,
            claim,
            since: now,
            before,
            manual: Some(Manual {
                uid,
                user,
                duration: until - now,
                until,
            }),
        });
        Ok(())
    }

    /// The user of reservation `r`: its launch's peer's, or the one who
    /// made it without a program.
    fn reservation_user(&self, r: &Reservation) -> String {
        r.manual.as_ref().map_or_else(
            || {
                self.peers
                    .get(&r.client)
                    .map(|p| p.user.clone())
                    .unwrap_or_default()
            },
            |m| m.user.clone(),
        )
    }

    /// Why `client` waits for `device`'s token, as far as a reservation
    /// says: the device is reserved for another group
    /// ([`Request::WaitReason`](gemini_protocol::Request::WaitReason)).
    pub(super) fn wait_reason(&self, client: ClientId, device: DeviceId, now: Micros) -> Reply {
        let reserved = self.clients.get(&client).and_then(|c| {
            if !kept_out(&reserved_for(&self.reservations, device), &c.group) {
                return None;
            }
            let r = self
                .reservations
                .iter()
                .find(|r| r.devices.contains(&device))?;
            Some(ReservedFor {
                group: r.group.clone(),
                user: self.reservation_user(r),
                left_us: r.manual.as_ref().map(|m| m.until.saturating_sub(now)),
            })
        });
        Reply::WaitReason { reserved }
    }

    /// Reservations and queue for `gem-schd status`.
    pub(super) fn reservation_status(
        &self,
        now: Micros,
    ) -> (Vec<ReservationStatus>, Vec<ReservationStatus>) {
        let pid = |c: ClientId| self.clients.get(&c).map_or(0, |c| c.pid);
        let user = |c: ClientId, manual: Option<&Manual>| {
            manual.map_or_else(
                || {
                    self.peers
                        .get(&c)
                        .map(|p| p.user.clone())
                        .unwrap_or_default()
                },
                |m| m.user.clone(),
            )
        };
        let held = self
            .reservations
            .iter()
            .map(|r| ReservationStatus {
                client: r.client,
                pid: pid(r.client),
                group: r.group.clone(),
                gpus: r.gpus.clone(),
                devices: r.devices.clone(),
                for_us: now.saturating_sub(r.since).saturating_add(r.before),
                user: user(r.client, r.manual.as_ref()),
                // The daemon reads it.
                command: String::new(),
                manual: r.manual.as_ref().map(|m| ManualReservation {
                    user: m.user.clone(),
                    left_us: m.until.saturating_sub(now),
                }),
            })
            .collect();
        let queue = self
            .queue
            .iter()
            .map(|w| ReservationStatus {
                client: w.client,
                pid: pid(w.client),
                group: w.group.clone(),
                gpus: w.gpus.clone(),
                devices: Vec::new(),
                for_us: now.saturating_sub(w.since),
                user: user(w.client, w.manual.as_ref()),
                command: String::new(),
                manual: w.manual.as_ref().map(|m| ManualReservation {
                    user: m.user.clone(),
                    left_us: m.duration,
                }),
            })
            .collect();
        (held, queue)
    }
}

impl Manual {
    /// The reservation, granted at `now`.
    fn granted(mut self, now: Micros) -> Manual {
        self.until = now.saturating_add(self.duration);
        self
    }
}
