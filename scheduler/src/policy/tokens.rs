//! The device token: its grant, groups away and back, and the deadlines
//! of expiring tokens (what clients report they used is charged in
//! `report`).
//!
//! A grant is decided in steps, each a function of its own
//! (`Policy::schedule` calls them):
//! 1. Who may run here: the expired token taken back, the groups a
//!    reservation keeps off the device set aside, the periods `MaxUtil`
//!    holds a group back opened or closed (`who_may_run`); a capped group
//!    in debt is ranked but not chosen.
//! 2. Who is owed the device: a group below its `MinUtil`, or a
//!    latency-critical group within its room (`Decision::rank_of`,
//!    `Decision::room`); the job whose turn it is; the latency-critical
//!    groups away (`Decision::critical_away`).
//! 3. Who gets the token and for how long: the waiters ranked
//!    (`Decision::rank_waiters`), the first chosen (`Decision::choose`),
//!    its quota and the cuts to it (`Decision::terms`).
//! 4. What is lent (`Decision::lending`), and the grant itself
//!    (`Decision::grant`).
//!
//! The hold for a latency-critical group about to come back is its own
//! step, after the choice (`Decision::hold`): while it holds, nobody is
//! served. `Decision`'s functions are in the order they are called in:
//! the groups away are looked at after the choice, as who is owed then
//! depends on the waiter chosen.

use super::group_use::{GroupUse, Using, groups_using, note_throttled};
use super::{
    Action, CRITICAL_LEND_MAX, Client, Device, Grant, GroupKey, HOLDER_MIN_QUOTA, Limits, Micros,
    OWED_ABSENCE, Params, Policy, Returning, Waiter, critical_margin, entitlements, gang,
    handover_lead, lent_min_quota, limits, reserve, water_level,
};
use gemini_config::{GroupConfig, Latency, ResourceConfig};
use gemini_protocol::{ClientId, DeviceId, Reply, Role};
use std::collections::BTreeMap;

/// How much more than its share a capped group counts as having used
/// when waiters are ranked: how far its `MaxUtil` is below `level` (what
/// the groups using the device are entitled to where no bound binds), in
/// full at its cap and none [`AT_CAP`] or more below it. A group at its cap
/// then waits behind a group below the level, and spends its credit while
/// that group is away instead of while it waits (10 ms CPU gaps: 0.43
/// instead of 0.6 for the uncapped group, `make bench`); a capped group
/// that asks for less than its cap competes on its share alone.
fn at_cap_behind(share: f64, max_util: f64, level: f64) -> f64 {
    let near = ((share - (max_util - AT_CAP)) / AT_CAP).clamp(0.0, 1.0);
    (level - max_util).max(0.0) * near
}

/// See [`at_cap_behind`].
const AT_CAP: f64 = 0.02;

/// How far above its `MinUtil` a group's charged share must be for the
/// device to be kept from it for a latency-critical group (see
/// [`Decision::hold`]). Its lent tokens are charged to their ends, and the last
/// one before such a hold ends idle (its next kernel did not fit): on the
/// simulator a training job at `MinUtil` 0.7 was charged 0.76 of the
/// device while its kernels ran 0.64 of it. At 0.05, training in 1 ms
/// kernels at `MinUtil` 0.7 beside a critical decode settled at the
/// bound, held before some returns and not others: it made 37 steps/s
/// against 41, and the decode's p99 stayed at 2.0× its time alone.
const HOLD_SLACK: f64 = 0.15;

/// How long past the expected return of a group below its `MinUtil` the
/// device is held for it from a waiter whose launches would run into that
/// return (see [`Decision::hold`]), and how late the group may be for a
/// hold to begin: as for a latency-critical group, [`CRITICAL_LEND_MAX`].
const OWED_HOLD_MAX: Micros = CRITICAL_LEND_MAX;

impl Policy {
    /// `client` gave the token of `device` back: its group is away from
    /// the device if no other client of it holds or waits for the token.
    pub(super) fn note_away(&mut self, client: ClientId, device: DeviceId, now: Micros) {
        let Some(group) = self.clients.get(&client).map(|c| c.group.clone()) else {
            return;
        };
        self.mark_away(&group, device, now);
    }

    /// `group` is away from `device` from `now` (or since it already was)
    /// if none of its clients holds or waits for the token.
    pub(super) fn mark_away(&mut self, group: &GroupKey, device: DeviceId, now: Micros) {
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let of_group = |id: &ClientId| self.clients.get(id).is_some_and(|c| &c.group == group);
        if dev.waiters.iter().any(|w| &w.group == group)
            || dev.grants().any(|t| of_group(&t.client))
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
    /// expires `handover_lead` before that end, so the next holder's
    /// launches queue behind the work instead of reaching an idle device
    /// after the holder's wait returns and it reports (charged then, in
    /// full). Its group is away from then on, unless another of its
    /// processes waits.
    pub(super) fn quieting(
        &mut self,
        client: ClientId,
        device: DeviceId,
        done_in: Micros,
        now: Micros,
    ) {
        let Some(at) = self.announce_end(client, device, done_in, now) else {
            return;
        };
        let Some(group) = self.clients.get(&client).map(|c| &c.group) else {
            return;
        };
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let of_group = |id: &ClientId| self.clients.get(id).is_some_and(|c| &c.group == group);
        // Not while another of its processes waits, or runs beside it
        // (see `share`).
        if dev.waiters.iter().any(|w| of_group(&w.client))
            || dev
                .grants()
                .any(|t| t.client != client && of_group(&t.client))
        {
            return;
        }
        if let Some(g) = dev.groups.get_mut(group) {
            g.away_since = Some(at);
        }
    }

    /// The holder of `device`'s token ran out of it with work still
    /// queued, predicted to end in `done_in` µs, and asks again once that
    /// work is done (`RunningOut`): the token ends `handover_lead` before
    /// that end once a program waits (now or by then) that the grant
    /// would choose before the holder (see
    /// [`Policy::pass_on_running_out`]), as for [`Policy::quieting`].
    /// Without it, the device idled while the holder's wait woke, it
    /// reported, and the next holder woke and launched: 124-175 ms in 4 s
    /// for two saturating groups on the 2-core test VM with two CPU hogs,
    /// 33-55 ms with it. A rank of a declared job keeps its token to its
    /// end: its turn (see `gang`) counts on it.
    pub(super) fn running_out(
        &mut self,
        client: ClientId,
        device: DeviceId,
        done_in: Micros,
        now: Micros,
    ) {
        // A rank of a job, and a lent token (which ends by design, for
        // the group it is lent from), run to their end.
        if self
            .clients
            .get(&client)
            .is_none_or(|c| c.job.is_some() || c.lent.contains(&device))
        {
            return;
        }
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let lead = handover_lead(dev.rtt());
        let at = now.saturating_add(done_in.saturating_sub(lead));
        // Only an end within the token is taken: one after it cuts
        // nothing, and would let the ranking look past the token's end.
        // A companion's is kept for when it holds the device alone (see
        // `share`).
        if let Some(t) = dev
            .token
            .iter_mut()
            .chain(dev.with.iter_mut())
            .find(|t| t.client == client && now < at && at < t.expires_at)
        {
            t.runs_out_at = Some(at);
        }
    }

    /// Ends `device`'s token where its holder said it runs out (see
    /// [`Policy::running_out`]) and a program that waits would be chosen
    /// before it, were it asking again now with its token's work charged
    /// (see [`Policy::ranked_behind`]). Its group is not away: it counts
    /// as waiting until it asks again (`Device::returning`), so the grant
    /// made meanwhile is not lent for its return and is cut to a turn as
    /// if it waited. Where it would be chosen first (a group below its
    /// `MinUtil`, an uncapped group beside a capped one at its cap), or
    /// nobody else may run now, the token runs on and the holder asks
    /// again as before: passed on, the device would go to a program the
    /// ranking puts after it (a capped group spending credit it should
    /// have kept for the other group's pauses, measured at 0.550 against
    /// 0.556-0.573 for the uncapped group), or to `gem-holder`.
    pub(super) fn pass_on_running_out(
        &mut self,
        device: DeviceId,
        view: &gang::TurnView,
        now: Micros,
    ) {
        let Some((client, at)) = self
            .devices
            .get(&device)
            .and_then(|d| d.token.as_ref())
            .and_then(|t| Some((t.client, t.runs_out_at?)))
        else {
            return;
        };
        let Some(group) = self.clients.get(&client).map(|c| c.group.clone()) else {
            return;
        };
        if !self.ranked_behind(device, view, client, &group, at, now) {
            return;
        }
        let lapse = self.params.min_quota;
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        // Cut only a token that has not expired (an overrun one is
        // revoked as such) and that the end cuts short.
        let Some(t) = dev.token.as_mut().filter(|t| now < t.expires_at) else {
            return;
        };
        t.runs_out_at = None;
        if !t.end_early(at) {
            return;
        }
        let until = at.max(now).saturating_add(lapse);
        dev.returning = Some(Returning {
            client,
            group,
            until: match &dev.returning {
                Some(r) if r.client == client => r.until.min(until),
                _ => until,
            },
        });
    }

    /// Whether a program waiting for `device` would be chosen before
    /// `client` (of `group`, holding the token, its work ending about
    /// `end`) were `client` asking again at `end`: the decision's own
    /// steps (who may run, the ranking, the choice) taken as of then,
    /// with the token's time from its grant to `end` charged to `group`
    /// (see [`Pending`]), as they will be when it reports and asks.
    /// (Charged only to now, a process that queued its token's work at
    /// the grant, as a saturating one does, would look as if it had used
    /// none of it.) Leaves the device as it was: the groups' use is read
    /// without forgetting what is older than the window as of `end`, and
    /// the stand-in waiter and the empty use given a waiting group that
    /// never ran here are taken out again. `false` where nobody else
    /// waits, or nobody may run then.
    fn ranked_behind(
        &mut self,
        device: DeviceId,
        view: &gang::TurnView,
        client: ClientId,
        group: &GroupKey,
        end: Micros,
        now: Micros,
    ) -> bool {
        let at = end.max(now);
        let Some((granted_at, charge)) = self.pending_charge(device, client, group, at) else {
            return false;
        };
        let Policy {
            devices,
            clients,
            config,
            retired,
            reservations,
            params,
            ..
        } = self;
        let Some(dev) = devices.get_mut(&device) else {
            return false;
        };
        if !dev.waiters.iter().any(|w| w.client != client) {
            return false;
        }
        let fresh = give_fresh_groups(dev, None);
        let stand_in = push_stand_in(dev, client, group, at);
        let reserved = reserve::reserved_for(reservations, device);
        // Another group whose token was passed on as it ran out waits
        // as in the grant (the announcer's own is its stand-in).
        let also = dev.returning.as_ref().filter(|r| at < r.until);
        let also = also.map(|r| r.group.clone());
        let (_, waiting) = waiting_groups(dev, &reserved, also.as_ref(), config, retired);
        let using = groups_of(dev, &reserved, waiting, config, retired, params, at);
        let d = Decision {
            device,
            now: at,
            params: *params,
            view,
            reserved: &reserved,
            config,
            retired,
            level: level_of(&using),
            using,
            pending: Some(Pending {
                group,
                granted_at,
                charge,
            }),
        };
        let ranked = d.rank_waiters(dev, clients);
        let chosen = d.choose(dev, clients, &ranked).map(|c| c.index);
        dev.waiters.truncate(stand_in);
        for k in &fresh {
            dev.groups.remove(k);
        }
        chosen.is_some_and(|i| i != stand_in)
    }

    /// What `client`'s token of `device` is to be charged to `group` up
    /// to `at` that the group's use does not hold yet, with the token's
    /// grant: `None` for a rank of a job, or where client, grant or
    /// group are not known there.
    fn pending_charge(
        &self,
        device: DeviceId,
        client: ClientId,
        group: &GroupKey,
        at: Micros,
    ) -> Option<(Micros, Micros)> {
        let c = self.clients.get(&client).filter(|c| c.job.is_none())?;
        let &(granted_at, _) = c.granted.get(&device)?;
        let g = self.devices.get(&device)?.groups.get(group)?;
        Some((granted_at, g.usage.unrecorded(granted_at, at)))
    }

    /// `client`'s token of `device` ends `handover_lead` before its work
    /// does, `done_in` µs from now (never later than it would have), as
    /// announced: not a revocation. When, if `client` holds it.
    fn announce_end(
        &mut self,
        client: ClientId,
        device: DeviceId,
        done_in: Micros,
        now: Micros,
    ) -> Option<Micros> {
        let dev = self.devices.get_mut(&device)?;
        let lead = handover_lead(dev.rtt());
        let token = dev
            .token
            .iter_mut()
            .chain(dev.with.iter_mut())
            .find(|t| t.client == client)?;
        let at = now.saturating_add(done_in.saturating_sub(lead));
        token.end_early(at);
        Some(at)
    }

    /// A client of an away group asks for the token again, for a launch
    /// `launch_in` µs from now (0: at once; a token asked ahead): the
    /// group's absence ends, and is learned as lasting until that launch,
    /// when the group needs the device.
    pub(super) fn note_back(
        &mut self,
        client: ClientId,
        device: DeviceId,
        now: Micros,
        launch_in: Micros,
    ) {
        if let Some(dev) = self.devices.get_mut(&device) {
            dev.returning.take_if(|r| r.client == client);
        }
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
            g.learn_absence(away + launch_in);
        }
    }

    pub(super) fn schedule_all(&mut self, now: Micros, out: &mut Vec<Action>) {
        let ids: Vec<DeviceId> = self.devices.keys().copied().collect();
        for d in ids {
            self.schedule(d, now, out);
        }
    }

    /// Revokes an expired token and grants a free one, in the steps of a
    /// grant (see the module doc): who may run here, who is owed the
    /// device, who gets the token and for how long, what is lent.
    pub(super) fn schedule(&mut self, device: DeviceId, now: Micros, out: &mut Vec<Action>) {
        let view = match self.devices.get(&device) {
            Some(d) if !d.waiters.is_empty() => self.turn_view(device, now),
            _ => gang::TurnView::default(),
        };
        self.pass_on_running_out(device, &view, now);
        self.share_token(device, now, out);
        let Policy {
            devices,
            clients,
            config,
            retired,
            reservations,
            params,
            ..
        } = self;
        // A reserved device is its reservations' groups' (and the
        // holder's, which hands it back at once): other groups wait.
        let reserved = reserve::reserved_for(reservations, device);
        let Some(dev) = devices.get_mut(&device) else {
            return;
        };
        revoke_expired(dev, clients, now);
        let Some(using) = who_may_run(dev, &reserved, config, retired, params, now) else {
            return;
        };
        let d = Decision {
            device,
            now,
            params: *params,
            view: &view,
            reserved: &reserved,
            config,
            retired,
            level: level_of(&using),
            using,
            pending: None,
        };
        let ranked = d.rank_waiters(dev, clients);
        let Some(choice) = d.choose(dev, clients, &ranked) else {
            return;
        };
        let critical = d.critical_away(dev);
        let lending = d.lending(dev, &choice, &critical);
        dev.hold_until = d
            .hold(dev, clients, &choice, &critical)
            .or_else(|| d.hold_for_owed(dev, clients, &choice, &lending));
        if dev.hold_until.is_some() {
            return;
        }
        let w = dev.waiters.remove(choice.index);
        let Some(c) = clients.get_mut(&w.client) else {
            return;
        };
        let terms = d.terms(dev, c, &w, &choice, &lending, &critical);
        d.grant(dev, c, &w, &terms, out);
        let job = c.job.clone();
        self.note_turn_grant(&view, job.as_deref(), terms.quota, now);
    }

    /// The earliest time at which [`Event::Tick`](super::Event::Tick) may
    /// change something: a token expiring, or a capped group becoming
    /// eligible.
    pub fn next_deadline(&mut self, now: Micros) -> Option<Micros> {
        let cap = self.params.saved_credit();
        let mut next: Option<Micros> = None;
        let mut consider = |t: Micros| next = Some(next.map_or(t, |n: Micros| n.min(t)));
        for (&device, dev) in self.devices.iter_mut() {
            if let Some(t) = dev.grants().map(|t| t.expires_at).min() {
                consider(t);
                continue;
            }
            // Waiters kept off a reserved device wait for its end (an
            // expiry, below, or an event), not for a tick.
            let reserved = reserve::reserved_for(&self.reservations, device);
            // Held for a critical group: its waiters wait until then (or
            // until it asks, a request).
            if let Some(t) = dev
                .hold_until
                .filter(|&t| t > now && !dev.waiters.is_empty())
            {
                consider(t);
                continue;
            }
            for w in dev
                .waiters
                .iter()
                .filter(|w| !reserve::kept_out(&reserved, &w.group))
            {
                let max_util = limits(&self.config, &self.retired, &w.group).max_util;
                if let Some(t) = dev
                    .groups
                    .get(&w.group)
                    .and_then(|g| g.eligible_at(now, max_util, cap))
                {
                    consider(t.max(now));
                }
            }
        }
        if let Some(t) = self.next_expiry() {
            consider(t.max(now));
        }
        if let Some(t) = self.next_turn_end(now) {
            consider(t);
        }
        match (next, self.holder_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}

/// A group's rank among the waiters (see [`Decision::rank_of`]): its
/// class (0: owed the device first, 1: other real groups, 2: the holder)
/// and its key within the class, least first.
#[derive(Debug, Clone, Copy)]
struct GroupRank {
    class: u8,
    key: f64,
}

/// A waiter's place in line, least first: its group's rank, then since
/// when it waits, then its connection (see [`Rank::before`]).
#[derive(Debug, Clone, Copy)]
struct Rank {
    group: GroupRank,
    since: Micros,
    client: ClientId,
}

impl Rank {
    /// Whether it goes before `other`: compared as the tuple (class, key,
    /// waiting since, client), so that a key that is not a number puts
    /// neither before the other.
    fn before(&self, other: &Rank) -> bool {
        let a = (self.group.class, self.group.key, self.since, self.client);
        let b = (
            other.group.class,
            other.group.key,
            other.since,
            other.client,
        );
        a.partial_cmp(&b) == Some(std::cmp::Ordering::Less)
    }
}

/// A waiting group's rank and when it may run (later than now: a capped
/// group in debt), worked out once for all its waiters.
#[derive(Debug, Clone, Copy)]
struct Standing {
    rank: GroupRank,
    may_run: Micros,
}

/// A waiter that may be chosen: its place in line, its index among the
/// device's waiters, and when its group may run.
#[derive(Debug, Clone, Copy)]
struct Ranked {
    rank: Rank,
    index: usize,
    may_run: Micros,
}

/// The waiter chosen, and what the turns of jobs and the capped groups
/// ranked before it mean for its token.
#[derive(Debug)]
struct Choice {
    /// Its index among the device's waiters.
    index: usize,
    /// Its group's rank.
    rank: GroupRank,
    /// A waiter of the job whose turn it is may run now: only those were
    /// chosen from.
    turn_waits: bool,
    /// A group owed the device (class 0) outside the turn may run now:
    /// it goes before the turn.
    owed_first: bool,
    /// When the first capped group ranked before the chosen waiter may
    /// run again (it waits for its credit); `None`: none does.
    due: Option<Micros>,
}

/// When a group away from the device and owed it comes back.
#[derive(Debug, Clone, Copy)]
struct Return {
    /// When it is expected back (`None`: not known yet, or long past;
    /// see `GroupUse::expected_back`).
    expected: Option<Micros>,
    /// When it is back at the earliest, as its returns go (`None` as
    /// `expected`; see `GroupUse::early_back`).
    early: Option<Micros>,
    /// When it may run (its `MaxUtil`).
    may_run: Micros,
}

/// The latency-critical groups active on the device and within their
/// room, not asking now (see [`Decision::critical_away`]).
#[derive(Debug, Default)]
struct Critical {
    /// One of them is away: whoever is chosen gets a short lent token (at
    /// most [`CRITICAL_LEND_MAX`]).
    owed: bool,
    /// When the first of them is expected back, not before it may run:
    /// the lent token ends about then.
    back: Option<Micros>,
    /// When the first of them is due back (expected, not before it may
    /// run), while it is late by less than [`CRITICAL_LEND_MAX`]: a
    /// critical group later than that is not waited for (a server whose
    /// requests come irregularly is late at every pause).
    due: Option<Micros>,
}

/// Whether the token granted is lent, and until when (see
/// [`Decision::lending`]).
#[derive(Debug)]
struct Lending {
    /// A group owed the device is between bursts and will be back (or a
    /// rank of the job whose turn it is may come): the token is short
    /// and ends by design.
    lent: bool,
    /// When the first group owed the device is expected back (not before
    /// it may run); `None`: not known.
    back: Option<Micros>,
    /// When the first group below its `MinUtil` (not latency-critical) is
    /// due back, while it is late by less than [`OWED_HOLD_MAX`].
    owed_due: Option<Micros>,
}

/// The token granted: its length, whether it is lent, and whether it
/// ends with the step under way (its job's turn is over).
#[derive(Debug)]
pub(super) struct Terms {
    pub(super) quota: Micros,
    pub(super) lent: bool,
    pub(super) last_step: bool,
}

/// What one grant on one device is decided from: the time, the timing
/// parameters, the turns of jobs, the reservations, and the groups using
/// the device with their limits (looked up once for the decision).
#[derive(Debug)]
struct Decision<'a> {
    device: DeviceId,
    now: Micros,
    params: Params,
    view: &'a gang::TurnView,
    /// The groups holding a reservation of the device (see
    /// `reserve::kept_out`).
    reserved: &'a [&'a str],
    config: &'a ResourceConfig,
    retired: &'a BTreeMap<String, GroupConfig>,
    /// The groups using the device (waiting, or active within the window
    /// and not paused), none of them kept out by a reservation.
    using: Vec<Using>,
    /// The level groups are entitled to where no bound binds (see
    /// [`level_of`]).
    level: f64,
    /// Device time a group is to be charged that its use does not hold
    /// yet (see [`Policy::ranked_behind`]); `None` for a grant.
    pending: Option<Pending<'a>>,
}

/// Device time `group` is to be charged (µs) that its use on the device
/// does not hold yet: a token's time up to its work's end, counted in its
/// share and charged to its `MaxUtil` credit as its report will be
/// (`GroupUse::charge`), where the decision is taken as of that end.
#[derive(Debug, Clone, Copy)]
struct Pending<'a> {
    group: &'a GroupKey,
    /// The grant of the token whose time it is.
    granted_at: Micros,
    charge: Micros,
}

/// How long after a grant now a launch of `waiter` admitted under it may
/// still run (µs): one launch, as its hook said (`Client::launch`); from
/// a hook that did not say, as learned from its overruns
/// (`Client::launch_floor`). `None`: not known, or longer than [`CRITICAL_LEND_MAX`]
/// (a job of such launches is not held: it would get only its MinUtil).
/// The grant's way to the hook (half a round trip) is left out: it moves
/// the launch later by as much, and the critical group waits at most that
/// for the launch's end, where counting it idled the device as long at
/// every return.
pub(super) fn launch_reach(waiter: &Client) -> Option<Micros> {
    let launch = match waiter.launch {
        0 => waiter.launch_floor,
        l => l,
    };
    (1..=CRITICAL_LEND_MAX).contains(&launch).then_some(launch)
}

/// Puts `client` (of `group`) in `dev`'s line as if it asked at `at`;
/// returns its index, to take it out again.
fn push_stand_in(dev: &mut Device, client: ClientId, group: &GroupKey, at: Micros) -> usize {
    dev.waiters.push(Waiter {
        client,
        group: group.clone(),
        seq: 0,
        since: at,
        burst: 0,
    });
    dev.waiters.len() - 1
}

/// Gives each group waiting on `dev` (and `also`) that has no use there
/// yet an empty one, as a grant does; returns those groups, to take out
/// again where the grant is only ranked.
fn give_fresh_groups(dev: &mut Device, also: Option<&GroupKey>) -> Vec<GroupKey> {
    let mut fresh: Vec<GroupKey> = Vec::new();
    for key in dev.waiters.iter().map(|w| &w.group).chain(also) {
        if !dev.groups.contains_key(key) && !fresh.contains(key) {
            fresh.push(key.clone());
        }
    }
    for k in &fresh {
        dev.groups.insert(k.clone(), GroupUse::default());
    }
    fresh
}

/// Takes `dev`'s tokens back once they expired, the holder's and its
/// companions' (see `share`): one that did not end by design (lent, or
/// its end announced) counts as revoked against its client's group. A
/// companion whose token runs on holds the device after an expired
/// holder.
fn revoke_expired(dev: &mut Device, clients: &BTreeMap<ClientId, Client>, now: Micros) {
    let expired: Vec<ClientId> = dev
        .grants()
        .filter(|t| now >= t.expires_at)
        .map(|t| t.client)
        .collect();
    for client in expired {
        if let Some(t) = dev.take_back(client)
            && !t.ends
            && let Some(c) = clients.get(&t.client)
        {
            dev.groups.entry(c.group.clone()).or_default().revocations += 1;
        }
    }
}

/// Who may run on `dev` (the first step of a grant): the groups with a
/// waiter there but those a reservation keeps off it (`reserved`: the
/// groups holding one). Opens or closes the throttled periods of the
/// groups `MaxUtil` holds back. `None` while the token is held or nobody
/// waits; otherwise the groups using the device, with their limits.
fn who_may_run(
    dev: &mut Device,
    reserved: &[&str],
    config: &ResourceConfig,
    retired: &BTreeMap<String, GroupConfig>,
    params: &Params,
    now: Micros,
) -> Option<Vec<Using>> {
    // A group whose token was passed on as it ran out asks again in a
    // moment: it waits (though it cannot be chosen before it asks).
    dev.returning.take_if(|r| now >= r.until);
    let returning = dev.returning.as_ref().map(|r| r.group.clone());
    let (_, waiting) = waiting_groups(dev, reserved, returning.as_ref(), config, retired);
    note_throttled(dev, &waiting, params.saved_credit(), now);
    if dev.token.is_some() || dev.waiters.is_empty() {
        return None;
    }
    // Every waiter's group has its use on the device (a kept-out one
    // too). (Not while the token is held: a waiter that left before
    // it was served would leave a group that never ran marked away.)
    give_fresh_groups(dev, returning.as_ref());
    Some(groups_of(
        dev, reserved, waiting, config, retired, params, now,
    ))
}

/// The groups with a waiter on `dev` (and `also`): those a reservation
/// keeps off it (`reserved`: the groups holding one), and the others with
/// their limits. A group kept off a reserved device waits for nothing here
/// until the reservation ends: it is not throttled, not owed, and
/// others' tokens are not shortened for it.
fn waiting_groups(
    dev: &Device,
    reserved: &[&str],
    also: Option<&GroupKey>,
    config: &ResourceConfig,
    retired: &BTreeMap<String, GroupConfig>,
) -> (Vec<GroupKey>, Vec<Using>) {
    // The groups with a waiter, gathered once (few: a Vec, not a set
    // built per request).
    let mut groups: Vec<GroupKey> = Vec::new();
    for key in dev.waiters.iter().map(|w| &w.group).chain(also) {
        if !groups.contains(key) {
            groups.push(key.clone());
        }
    }
    let (kept, waiting): (Vec<GroupKey>, Vec<GroupKey>) = groups
        .into_iter()
        .partition(|k| reserve::kept_out(reserved, k));
    let waiting = waiting
        .into_iter()
        .map(|key| Using {
            limits: limits(config, retired, &key),
            key,
            waiting: true,
        })
        .collect();
    (kept, waiting)
}

/// The groups using `dev`, with their limits: the `waiting` ones, and
/// those active within the window and not paused, but those a
/// reservation keeps off it.
fn groups_of(
    dev: &Device,
    reserved: &[&str],
    waiting: Vec<Using>,
    config: &ResourceConfig,
    retired: &BTreeMap<String, GroupConfig>,
    params: &Params,
    now: Micros,
) -> Vec<Using> {
    let waits = |key: &GroupKey| waiting.iter().any(|u| &u.key == key);
    groups_using(dev, waits, now, params.window)
        .into_iter()
        .filter(|key| !reserve::kept_out(reserved, key))
        .map(|key| match waiting.iter().find(|u| &u.key == key) {
            Some(u) => u.clone(),
            None => Using {
                key: key.clone(),
                limits: limits(config, retired, key),
                waiting: false,
            },
        })
        .collect()
}

/// The level groups `using` the device are entitled to where no bound
/// binds: water filling between them. (Only capped groups need it: none,
/// and no water filling.)
fn level_of(using: &[Using]) -> f64 {
    if using.iter().any(|u| u.limits.max_util < 1.0) {
        water_level(&bounds(using))
    } else {
        1.0
    }
}

/// The `(MinUtil, MaxUtil)` of each group in `using`, in order.
fn bounds(using: &[Using]) -> Vec<(f64, f64)> {
    using
        .iter()
        .map(|u| (u.limits.min_util, u.limits.max_util))
        .collect()
}

impl Decision<'_> {
    /// `key`'s limits: as looked up for the groups using the device, or
    /// from the file (the holder).
    fn limits(&self, key: &GroupKey) -> Limits {
        match self.using.iter().find(|u| &u.key == key) {
            Some(u) => u.limits,
            None => limits(self.config, self.retired, key),
        }
    }

    /// A latency-critical group's room: the share it may take first
    /// without breaking the `MinUtil` of the others using the device,
    /// nor its own `MaxUtil`. `None` for a group of another class.
    fn room(&self, key: &GroupKey) -> Option<f64> {
        let l = self.limits(key);
        (l.latency == Latency::Critical).then(|| {
            let others: f64 = self
                .using
                .iter()
                .filter(|u| &u.key != key)
                .map(|u| u.limits.min_util)
                .sum();
            l.max_util.min(1.0 - others)
        })
    }

    /// Who is owed the device: a group's rank. Class 0: latency-critical
    /// group within its room (key: share - 2, before all others), real
    /// group below MinUtil (key: share - MinUtil); 1: other real group
    /// (key: share, plus how far its MaxUtil is below the level); 2:
    /// holder (key: share).
    fn rank_of(&self, key: &GroupKey, g: &mut GroupUse) -> GroupRank {
        let Limits {
            min_util, max_util, ..
        } = self.limits(key);
        let (now, window) = (self.now, self.params.window);
        // Ranked as of a later time (`pending`), the use is read without
        // forgetting what is older than the window then.
        let share = match self.pending {
            Some(p) => g.share_as_of(now, window, if p.group == key { p.charge } else { 0 }),
            None if g.usage.is_empty(now, window) => 0.0,
            None => g.share(now, window),
        };
        let (class, key) = if *key == GroupKey::Holder {
            (2, share)
        } else if self.room(key).is_some_and(|r| share < r) {
            (0, share - 2.0)
        } else if share < min_util {
            (0, share - min_util)
        } else {
            (1, share + at_cap_behind(share, max_util, self.level))
        };
        GroupRank { class, key }
    }

    /// Whether waiter `w` is a rank of a job that waits for its turn (a
    /// job owed time too: it waits at most the turn and its drain, and is
    /// ranked first once the turn is over; served at once, its ranks and
    /// the turn's interleaved on both GPUs, and the jobs of two groups at
    /// MinUtil 0.5 made half their steps).
    fn waits_for_turn(&self, clients: &BTreeMap<ClientId, Client>, w: &Waiter) -> bool {
        !self.view.blocked.is_empty()
            && clients
                .get(&w.client)
                .is_none_or(|c| self.view.blocks(c.job.as_deref()))
            && !self.view.catch_up.contains(&w.client)
    }

    /// The waiters that may be chosen, ranked, with when their group may
    /// run: capped groups in debt are not chosen, but a token ends when
    /// one ranked before the chosen waiter may run (see [`Choice::due`]).
    /// Left out: ranks of a job waiting for its turn, groups kept out by
    /// a reservation, and groups never eligible (unknown to the file).
    fn rank_waiters(&self, dev: &mut Device, clients: &BTreeMap<ClientId, Client>) -> Vec<Ranked> {
        let saved = self.params.saved_credit();
        let mut ranked: Vec<Ranked> = Vec::new();
        // Each waiting group's standing, worked out once for all its
        // waiters; `None`: never eligible.
        let mut of_group: Vec<(&GroupKey, Option<Standing>)> = Vec::new();
        for (i, w) in dev.waiters.iter().enumerate() {
            if self.waits_for_turn(clients, w) {
                continue;
            }
            let known = of_group.iter().find(|(k, _)| *k == &w.group).map(|r| r.1);
            let standing = match known {
                Some(standing) => standing,
                None if reserve::kept_out(self.reserved, &w.group) => {
                    of_group.push((&w.group, None));
                    None
                }
                None => {
                    let max_util = self.limits(&w.group).max_util;
                    let standing = dev.groups.get_mut(&w.group).and_then(|g| {
                        let charge = self
                            .pending
                            .filter(|p| p.group == &w.group)
                            .map(|p| (p.granted_at, p.charge));
                        let may_run = g.eligible_after(self.now, max_util, saved, charge)?;
                        let rank = self.rank_of(&w.group, g);
                        Some(Standing { rank, may_run })
                    });
                    of_group.push((&w.group, standing));
                    standing
                }
            };
            if let Some(Standing { rank, may_run }) = standing {
                let rank = Rank {
                    group: rank,
                    since: w.since,
                    client: w.client,
                };
                ranked.push(Ranked {
                    rank,
                    index: i,
                    may_run,
                });
            }
        }
        ranked
    }

    /// Who gets the token: the first of the `ranked` waiters whose group
    /// may run now. The job whose turn it is goes first, unless another
    /// group is below its MinUtil: turns align a job's ranks, they do not
    /// take a guarantee away.
    fn choose(
        &self,
        dev: &Device,
        clients: &BTreeMap<ClientId, Client>,
        ranked: &[Ranked],
    ) -> Option<Choice> {
        let now = self.now;
        let of_turn = |i: usize| {
            clients
                .get(&dev.waiters[i].client)
                .is_some_and(|c| self.view.owns(c.job.as_deref()))
        };
        let owed_first = ranked
            .iter()
            .any(|r| r.may_run == now && !of_turn(r.index) && r.rank.group.class == 0);
        let turn_waits = !owed_first && ranked.iter().any(|r| r.may_run == now && of_turn(r.index));
        let mut best: Option<&Ranked> = None;
        for r in ranked {
            if r.may_run == now
                && (!turn_waits || of_turn(r.index))
                && best.is_none_or(|b| r.rank.before(&b.rank))
            {
                best = Some(r);
            }
        }
        let chosen = best?;
        let due = ranked
            .iter()
            .filter(|r| r.may_run > now && r.rank.before(&chosen.rank))
            .map(|r| r.may_run)
            .min();
        Some(Choice {
            index: chosen.index,
            rank: chosen.rank.group,
            turn_waits,
            owed_first,
            due,
        })
    }

    /// When group `key`, not asking now (so active within the window, in
    /// `using`), is expected back, if `owed` says its rank is owed the
    /// device; `None` if it is not owed (or may never run).
    fn owed_back(
        &self,
        dev: &mut Device,
        key: &GroupKey,
        owed: impl Fn(GroupRank) -> bool,
    ) -> Option<Return> {
        let max_util = self.limits(key).max_util;
        let g = dev.groups.get_mut(key)?;
        if !owed(self.rank_of(key, g)) {
            return None;
        }
        let may_run = g.eligible_at(self.now, max_util, self.params.saved_credit())?;
        Some(Return {
            expected: g.expected_back(self.now, self.params.min_quota),
            early: g.early_back(self.now, self.params.min_quota),
            may_run,
        })
    }

    /// The latency-critical groups active here and within their room, not
    /// asking now: whoever is chosen gets a short token (at most
    /// [`CRITICAL_LEND_MAX`]), ending about when the critical group comes
    /// back, so that it waits little behind the work queued under it.
    fn critical_away(&self, dev: &mut Device) -> Critical {
        let mut critical = Critical::default();
        for u in &self.using {
            if u.waiting || self.room(&u.key).is_none() {
                continue;
            }
            // Within its room: ranked before all others.
            let owed = |r: GroupRank| r.class == 0 && r.key < -1.0;
            let Some(Return {
                expected,
                early,
                may_run,
            }) = self.owed_back(dev, &u.key, owed)
            else {
                continue;
            };
            critical.owed = true;
            let at = expected.map(|t| t.max(may_run));
            critical.back = critical.back.into_iter().chain(at).min();
            // Its return: when it is back at the earliest, or when it may
            // run if that is later; in the past while it is late. It is
            // waited for until CRITICAL_LEND_MAX past that.
            let due = self.due(early, may_run);
            if let Some(due) = due.filter(|&d| self.now < d + CRITICAL_LEND_MAX)
                && critical.due.is_none_or(|b| due < b)
            {
                critical.due = Some(due);
            }
        }
        critical
    }

    /// When a group away is due back: when it is expected, or when it may
    /// run if that is later; in the past while it is late.
    fn due(&self, expected: Option<Micros>, may_run: Micros) -> Option<Micros> {
        expected.map(|t| {
            if may_run > self.now {
                t.max(may_run)
            } else {
                t
            }
        })
    }

    /// What is lent. A group owed time that is not waiting is between
    /// bursts and will be back: lend the device to others in short tokens
    /// only, so it waits at most one of them when it returns. Owed: active
    /// in the window, not paused, and ranked before the chosen waiter
    /// (below its MinUtil; or, for a real group chosen, less used as
    /// ranked); a latency-critical group away (`critical`) is. The lent
    /// token ends about when such a group usually comes back (the
    /// earliest, learned from their past absences, and not before a
    /// capped one may run again; `back`), within [lent_min_quota,
    /// min_quota].
    fn lending(&self, dev: &mut Device, choice: &Choice, critical: &Critical) -> Lending {
        let mut lending = Lending {
            lent: critical.owed,
            back: critical.back,
            owed_due: None,
        };
        let GroupRank { class, key } = choice.rank;
        if class != 0 {
            for u in self.using.iter().filter(|u| !u.waiting) {
                // (Its rank, as `owed` saw it: below its MinUtil or not.)
                let below = std::cell::Cell::new(false);
                let owed = |r: GroupRank| {
                    below.set(r.class == 0);
                    r.class == 0 || (class == 1 && r.class == 1 && r.key < key)
                };
                let Some(Return {
                    expected, may_run, ..
                }) = self.owed_back(dev, &u.key, owed)
                else {
                    continue;
                };
                lending.lent = true;
                lending.back = lending
                    .back
                    .into_iter()
                    .chain(expected.map(|t| t.max(may_run)))
                    .min();
                if below.get()
                    && self.room(&u.key).is_none()
                    && let Some(due) = self.due(expected, may_run)
                    && self.now < due + OWED_HOLD_MAX
                    && lending.owed_due.is_none_or(|d| due < d)
                {
                    lending.owed_due = Some(due);
                }
            }
        }
        // Another group in a job's turn: a short lent token, so that the
        // job's rank that comes waits at most that.
        if self.view.owner.is_some() && !choice.turn_waits && !choice.owed_first {
            lending = Lending {
                lent: true,
                back: Some(self.now),
                owed_due: None,
            };
        }
        lending
    }

    /// The hold for a latency-critical group: one about to come back
    /// finds the device free. A waiter whose launches would not end
    /// before it (one launch, which its hook admits onto an empty queue
    /// whatever its length, would run past it: see [`launch_reach`])
    /// waits for the critical group's step, unless it is charged less
    /// than HOLD_SLACK above its MinUtil. The hold ends CRITICAL_LEND_MAX after the critical group
    /// was expected, and none begins once it is later than that. Only
    /// kernels a lent token can hold at all are waited out: a job of
    /// longer ones would otherwise get only its MinUtil. The time held is
    /// charged to nobody: no work of anyone's ran. Returns when the hold
    /// ends; `None`: no hold, the chosen waiter is served.
    fn hold(
        &self,
        dev: &Device,
        clients: &BTreeMap<ClientId, Client>,
        choice: &Choice,
        critical: &Critical,
    ) -> Option<Micros> {
        let GroupRank { class, key } = choice.rank;
        let now = self.now;
        if class != 0
            && let Some(b) = critical.due
            && now < b + CRITICAL_LEND_MAX
            && let Some(waiter) = clients.get(&dev.waiters[choice.index].client)
            && let Some(reach) = launch_reach(waiter)
            && b < now + reach
            && key - self.limits(&waiter.group).min_util >= HOLD_SLACK
        {
            return Some(b + CRITICAL_LEND_MAX);
        }
        None
    }

    /// The hold for a group below its `MinUtil`, between its bursts and
    /// about to come back: a waiter above its own `MinUtil` whose launches
    /// are longer than any lent token (a CUDA graph's replay, admitted
    /// whole onto an empty queue) and would run into that return waits
    /// for it instead. Lent the gap, such a launch made the owed group
    /// wait its whole length at every return: a graph group at `MinUtil`
    /// 0.3 beside an eager one at 0.7 that gave the device back for 0.2 ms
    /// between its 20 ms steps split the device 0.51/0.49 (seen in 2 of 13
    /// runs on an independent simulator, where the eager group's hook had
    /// learned to go quiet after its waits). A launch's length is known
    /// only from a lent token it overran (`Client::long_launch`): other
    /// tokens' queues run past their end by a little as a rule, and an
    /// eager trainer held on that reading would idle the device at every
    /// return. The hold begins at most [`OWED_HOLD_MAX`] before the group
    /// is expected and ends that long after (none begins once it is later
    /// than that): at most twice that of idle time per return, charged to
    /// nobody. A waiter below its own `MinUtil` is never held, so the
    /// waiter keeps its guarantee; above it, a group that comes back less
    /// than [`OWED_HOLD_MAX`] after it left can keep it off the device
    /// (its `MinUtil` was the waiter's only promise). Launches a lent
    /// token can hold are lent the gap as before: the owed group waits
    /// at most that token.
    fn hold_for_owed(
        &self,
        dev: &Device,
        clients: &BTreeMap<ClientId, Client>,
        choice: &Choice,
        lending: &Lending,
    ) -> Option<Micros> {
        let now = self.now;
        let b = lending.owed_due?;
        let waiter = clients.get(&dev.waiters[choice.index].client)?;
        (choice.rank.class == 1
            && now < b + OWED_HOLD_MAX
            && b <= now + OWED_HOLD_MAX
            && waiter.long_launch > self.params.min_quota
            && b < now + waiter.long_launch)
            .then_some(b + OWED_HOLD_MAX)
    }

    /// The part of the longest token `group` gets while other groups
    /// wait: its entitlement against the largest among those taking
    /// turns, so that groups alternate and each waits about one token of
    /// each other: with equal tokens a group entitled to 0.3 beside one of
    /// 0.7 waited for two or three 100 ms tokens in a row (300 ms).
    /// `None`: no cut (nobody else waits, or it is the largest).
    fn turn_share(&self, group: &GroupKey) -> Option<f64> {
        let ent = entitlements(&bounds(&self.using));
        let real = || {
            self.using
                .iter()
                .zip(&ent)
                .filter(|(u, _)| u.key != GroupKey::Holder)
        };
        let others_wait = real().any(|(u, _)| &u.key != group && u.waiting);
        let mine = real().find(|(u, _)| &u.key == group);
        let top = real().map(|(_, &e)| e).reduce(f64::max);
        mine.map(|(_, &e)| e)
            .zip(top)
            .filter(|&(mine, top)| others_wait && mine > 0.0 && top > mine)
            .map(|(mine, top)| mine / top)
    }

    /// How long the token granted to `c` (waiter `w`) is: its predicted
    /// burst within `[min_quota, max_quota]`, cut to its group's turn
    /// share, to the return of a group owed the device (see
    /// [`Decision::lent_quota`]), to its job's turn, to when a capped
    /// group ranked before it may run, and to its own `MaxUtil` credit.
    fn terms(
        &self,
        dev: &Device,
        c: &Client,
        w: &Waiter,
        choice: &Choice,
        lending: &Lending,
        critical: &Critical,
    ) -> Terms {
        let (params, now) = (&self.params, self.now);
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
        if let Some(part) = self.turn_share(&w.group) {
            quota = quota.min(((params.max_quota as f64 * part) as Micros).max(floor));
        }
        if lending.lent {
            quota = self.lent_quota(dev, quota, floor, lending, critical);
        }
        // In its job's turn, a token ends with the turn; after it, with
        // the step under way (the shortest, given back at the step's end).
        let mut last_step = false;
        if choice.turn_waits
            && let Some((_, until)) = &self.view.owner
        {
            quota = if now < *until {
                quota.min(until.saturating_sub(now).max(lent_min_quota(dev.rtt())))
            } else {
                last_step = true;
                quota.min(lent_min_quota(dev.rtt()))
            };
        }
        // A capped group ranked before this one waits for its credit: the
        // token ends when that group may run, so it does not wait longer,
        // earning more than it may save.
        if let Some(due) = choice.due {
            quota = quota.min(due.saturating_sub(now).max(floor));
        }
        Terms {
            quota: self.overdraft_quota(dev, &c.group, quota, floor),
            lent: lending.lent,
            last_step,
        }
    }

    /// A lent token's `quota`: it ends when the group owed the device is
    /// back (within [lent_min_quota, min_quota]); beside a latency-critical
    /// group away, at most [`CRITICAL_LEND_MAX`], and [`critical_margin`]
    /// before it is due (at least one round trip).
    fn lent_quota(
        &self,
        dev: &Device,
        quota: Micros,
        floor: Micros,
        lending: &Lending,
        critical: &Critical,
    ) -> Micros {
        let now = self.now;
        let short = self.params.min_quota.max(floor);
        let to_return = lending.back.map_or(short, |t| {
            t.saturating_sub(now)
                .clamp(lent_min_quota(dev.rtt()).min(short), short)
        });
        let mut quota = quota.min(to_return);
        if critical.owed {
            quota = quota.min(CRITICAL_LEND_MAX);
        }
        if let Some(b) = critical.due {
            let ends = b.saturating_sub(now + critical_margin(dev.rtt()));
            quota = quota.min(ends.max(dev.rtt()));
        }
        quota
    }

    /// A capped group's token takes its credit at most `overdraft` into
    /// debt (it earns MaxUtil of the token's time while it runs): `quota`
    /// cut so for `group`.
    fn overdraft_quota(
        &self,
        dev: &Device,
        group: &GroupKey,
        quota: Micros,
        floor: Micros,
    ) -> Micros {
        let params = &self.params;
        let max_util = self.limits(group).max_util;
        if max_util < 1.0
            && let Some(g) = dev.groups.get(group)
        {
            let credit = g
                .credit_now(self.now, max_util, params.saved_credit())
                .max(0) as f64;
            let most = ((credit + params.overdraft() as f64) / (1.0 - max_util)) as Micros;
            return quota.min(most.max(floor.min(params.max_quota)));
        }
        quota
    }

    /// The grant: `c` (waiter `w`, taken out of the line) gets the token
    /// on `terms`, and is told so. A lent token's work fits in it (its
    /// hook keeps the queue within the quota): it is over at its end, and
    /// the group owed the device gets it a little before
    /// (`handover_lead`), without waiting for the borrower to wake up and
    /// report (charged when it does). Others keep the grace for draining
    /// their queued work.
    fn grant(
        &self,
        dev: &mut Device,
        c: &mut Client,
        w: &Waiter,
        terms: &Terms,
        out: &mut Vec<Action>,
    ) {
        let (now, device, quota) = (self.now, self.device, terms.quota);
        if let Some(g) = dev.groups.get_mut(&c.group)
            && g.usage.is_empty(now, self.params.window)
        {
            g.active_since = now;
        }
        note_grant(c, device, now, quota, terms.lent);
        let expires_at = if terms.lent {
            now + quota - handover_lead(dev.rtt()).min(quota / 4)
        } else {
            now + quota + self.params.grace
        };
        dev.token = Some(Grant {
            client: w.client,
            expires_at,
            ends: terms.lent,
            runs_out_at: None,
        });
        out.push(told(w, device, quota, terms, now));
    }
}

/// The reply that tells waiter `w` it has `device`'s token for `quota`
/// on `terms`' other terms, from `now`.
pub(super) fn told(
    w: &Waiter,
    device: DeviceId,
    quota: Micros,
    terms: &Terms,
    now: Micros,
) -> Action {
    Action::Reply {
        client: w.client,
        seq: w.seq,
        reply: Reply::Token {
            device,
            quota_us: quota,
            lent: terms.lent,
            last_step: terms.last_step,
            held_us: now.saturating_sub(w.since),
        },
    }
}

/// What `c` is granted `device`'s token for (`quota`, from `now`;
/// `lent` or not) changes in its own record.
pub(super) fn note_grant(c: &mut Client, device: DeviceId, now: Micros, quota: Micros, lent: bool) {
    // Work still in flight from its last token is this token's now.
    c.in_flight.remove(&device);
    c.uncharged.insert(device, (now, quota));
    if lent {
        c.lent.insert(device);
    } else {
        c.lent.remove(&device);
    }
    c.granted.insert(device, (now, quota));
    c.anchor.entry(device).or_insert(now);
    // Its work from here on runs under this scheduler's tokens.
    c.restored.remove(&device);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rank(class: u8, key: f64, since: Micros, client: ClientId) -> Rank {
        Rank {
            group: GroupRank { class, key },
            since,
            client,
        }
    }

    /// Waiters go by class, then key, then since when they wait, then
    /// connection; a key that is not a number puts neither before the
    /// other (as the tuple of the four compared, which ranks were).
    #[test]
    fn a_rank_goes_by_class_key_since_and_client() {
        let line = [
            rank(0, -0.5, 10, 1),
            rank(0, -0.5, 10, 2),
            rank(0, -0.5, 20, 1),
            rank(0, 0.1, 0, 0),
            rank(1, -5.0, 0, 0),
            rank(2, -9.0, 0, 0),
        ];
        for (i, a) in line.iter().enumerate() {
            for (j, b) in line.iter().enumerate() {
                assert_eq!(a.before(b), i < j, "{a:?} before {b:?}");
            }
        }
        let nan = rank(1, f64::NAN, 0, 0);
        assert!(!nan.before(&rank(1, 0.0, 0, 0)) && !rank(1, 0.0, 0, 0).before(&nan));
        assert!(rank(0, f64::NAN, 0, 0).before(&rank(1, 0.0, 0, 0)));
    }
}
