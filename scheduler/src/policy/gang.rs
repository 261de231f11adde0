//! Turns of jobs that span devices (an NCCL job's ranks, one process per
//! GPU): its ranks hold their devices in the same windows.
//!
//! A collective kernel spins on its device until its peer ranks have
//! started theirs. If one rank's device serves job A while the peer's
//! serves job B, A's collective spins beside B's work (a real GPU
//! time-slices them) until the peer gets its device, and B's does the
//! same on the other device: both jobs crawl. So the ranks of a job (as
//! its launcher or its NCCL communicator declares it, see
//! `gemini_protocol::job`: never guessed from how its work waits, which
//! put independent programs into turns) that used (or wait for) several
//! devices within [`GANG_RECENT`] take the devices in turns decided on
//! the first of them (its leader), while another client is connected:
//! - while no turn is open, the waiters are ranked as on any device; a
//!   job granted a token on one of its devices opens its turn on all of
//!   them for that token's length (on the leader's record); its ranks'
//!   tokens in the turn end with it (at least
//!   [`lent_min_quota`](super::lent_min_quota), not the usual 10 ms
//!   floor: a rank that went on stepping past the end left its peer's
//!   next collective spinning);
//! - during the turn its ranks are served first on its devices (unless
//!   another group is well below its `MinUtil`), other jobs that share
//!   the leader wait, and groups of one device get short lent tokens
//!   while the job's rank there is not asking (a group below its
//!   `MinUtil` goes first, turn or not);
//! - at the turn's end the job's ranks finish the step they are in: they
//!   get short tokens that end with the step (`Reply::Token { last_step
//!   }`: the hook gives the token back as a wait proves all its work
//!   done), ahead of other jobs. A rank that gave its token back so (or
//!   any rank, [`DRAIN`] after the end) begins no new step: it is served
//!   only while a peer is still in the turn's steps (holds a token granted
//!   before the end) or may wait for it (gave its token back with its
//!   work in flight, `ReleaseToken { in_flight }`, or holds a token past
//!   its quota). The turn is over once none of its ranks holds a token or
//!   has work in flight, or [`DRAIN_MAX`] after its end; the waiters are
//!   then ranked again.
//!
//! So a turn changes hands between steps: a collective launched by one
//! rank is met by its peer before the next job's ranks run, instead of
//! spinning through the next turn (before the in-flight report, 12 % of
//! the device time went to such collectives and the jobs kept 71-74 % of
//! their steps; `gem-bench --only nccl`). And it changes hands at the
//! first step's end: with 20 ms of 1 ms tokens after each turn (each
//! ending mid-step, the queue drained before the next), the device
//! worked 0.67-0.70 of that time against 0.84 in the turn, and the jobs
//! kept 89-90 % of their steps; with tokens that end with the step, 93-94 %.

use super::{Client, Micros, Policy};
use gemini_protocol::{ClientId, DeviceId, Role};
use std::collections::{BTreeMap, BTreeSet};

/// A job spanning devices: see the module doc.
pub const GANG_RECENT: Micros = 100_000;

/// How long after its end a turn's ranks still begin steps (short
/// tokens, so that they end together), at most: a rank that finished its
/// step (its token given back between steps) begins no new one before
/// that. Measured, before tokens ended with the step, with `gem-bench --only
/// nccl` before the in-flight report, two runs each: 5 ms kept 53-59 % of
/// the un-hooked steps on time-sliced GPUs, 20 ms 71-74 %, 50 ms 72-75 %
/// but a work split 11-22 pp off in launch order (20 ms: 7 pp). With the
/// in-flight report (6 s runs of the same scenario, kernels per rank):
/// 2 ms 9570, 10 ms 11170-11705, 20 ms 11690, 40 ms 11205-11325.
pub(super) const DRAIN: Micros = 20_000;

/// How long after its end a turn goes on at most while one of its ranks
/// gave its token back with work still running (a collective waiting for
/// a peer rank, which gets short tokens to launch its own): a rank whose
/// peer never comes (it died, or waits on something else) does not hold
/// the other jobs off for longer.
pub(super) const DRAIN_MAX: Micros = 100_000;

/// A job's turn on its devices.
#[derive(Debug, Clone)]
pub(super) struct Turn {
    pub job: String,
    pub devices: BTreeSet<DeviceId>,
    /// When the turn ends (its ranks then finish their step).
    pub until: Micros,
}

/// What the turns mean for one device's next grant.
#[derive(Debug, Default)]
pub(super) struct TurnView {
    /// Jobs waiting for their turn (not served here).
    pub blocked: BTreeSet<String>,
    /// Clients of a blocked job served all the same.
    pub catch_up: BTreeSet<ClientId>,
    /// The job whose turn it is here, and when the turn ends.
    pub owner: Option<(String, Micros)>,
    /// Jobs with no turn open, and their devices: a grant here opens one
    /// on them.
    pub leads: BTreeMap<String, BTreeSet<DeviceId>>,
}

impl TurnView {
    /// Whether `job` waits for its turn here.
    pub(super) fn blocks(&self, job: Option<&str>) -> bool {
        job.is_some_and(|j| self.blocked.contains(j))
    }

    /// Whether it is `job`'s turn here.
    pub(super) fn owns(&self, job: Option<&str>) -> bool {
        job.is_some_and(|j| self.owner.as_ref().is_some_and(|(o, _)| o == j))
    }
}

impl Policy {
    /// The devices each job's ranks used within [`GANG_RECENT`], hold a
    /// token of, run work on in flight, or wait for.
    fn recent_devices(&self, now: Micros) -> BTreeMap<String, BTreeSet<DeviceId>> {
        let since = now.saturating_sub(GANG_RECENT);
        let mut used: BTreeMap<String, BTreeSet<DeviceId>> = BTreeMap::new();
        for c in self.clients.values() {
            let Some(job) = &c.job else {
                continue;
            };
            let recent = c
                .charged_until
                .iter()
                .filter(|&(_, &t)| t >= since)
                .map(|(d, _)| *d)
                .chain(c.uncharged.keys().copied())
                .chain(c.in_flight.iter().copied());
            match used.get_mut(job) {
                Some(s) => s.extend(recent),
                None => {
                    used.insert(job.clone(), recent.collect());
                }
            }
        }
        for (&d, dev) in &self.devices {
            for w in &dev.waiters {
                if let Some(job) = self.clients.get(&w.client).and_then(|c| c.job.as_ref()) {
                    used.entry(job.clone()).or_default().insert(d);
                }
            }
        }
        used
    }

    /// The clients that are ranks of `job`.
    fn ranks<'a>(&'a self, job: &'a str) -> impl Iterator<Item = (&'a ClientId, &'a Client)> + 'a {
        self.clients
            .iter()
            .filter(move |(_, c)| c.job.as_deref() == Some(job))
    }

    /// Whether a rank of `job` holds a token on one of `devices`.
    fn holds_any(&self, job: &str, devices: &BTreeSet<DeviceId>) -> bool {
        self.ranks(job).any(|(_, c)| c.holds_on(devices))
    }

    /// Whether a rank of `job` gave a token of one of `devices` back
    /// with its work still running (a collective waiting for its peer).
    fn in_flight_any(&self, job: &str, devices: &BTreeSet<DeviceId>) -> bool {
        self.ranks(job).any(|(_, c)| c.in_flight_on(devices))
    }

    /// Whether a rank of `job` on one of `devices` may be waiting for a
    /// peer rank: it gave its token back with work in flight, or holds
    /// one past its quota (its last work outlasts it: a collective waiting
    /// for its peer, until the hook finds it stalled and says so).
    fn waits_for_peer(&self, job: &str, devices: &BTreeSet<DeviceId>, now: Micros) -> bool {
        self.ranks(job).any(|(_, c)| {
            c.in_flight_on(devices) || c.held_past_quota(0, now).any(|d| devices.contains(&d))
        })
    }

    /// Ends the turns that are over (their ranks hold no token past the
    /// turn's end, or the job no longer spans devices), and says what
    /// the open ones mean for `device`'s next grant.
    pub(super) fn turn_view(&mut self, device: DeviceId, now: Micros) -> TurnView {
        // No job declared (the common case): nothing to align, nothing to
        // compute.
        debug_assert_eq!(
            self.ranks,
            self.clients.values().filter(|c| c.job.is_some()).count()
        );
        if self.turns.is_empty() && self.ranks == 0 {
            return TurnView::default();
        }
        let used = self.spanning_jobs(now);
        self.end_turns(&used, now);
        if self.turns.is_empty() && used.is_empty() {
            return TurnView::default();
        }
        let mut view = TurnView::default();
        for (job, devices) in &used {
            let Some(&leader) = devices.first() else {
                continue;
            };
            if !devices.contains(&device) {
                continue;
            }
            match self.turns.get(&leader) {
                Some(t) if &t.job == job => self.view_own_turn(&mut view, t, device, now),
                Some(_) => {
                    view.blocked.insert(job.clone());
                }
                // No turn open: a grant on any of its devices opens one
                // (its rank on the first device may be waiting in a
                // collective for this one, asking for nothing).
                None => {
                    view.leads.insert(job.clone(), devices.clone());
                }
            }
        }
        view
    }

    /// The jobs that span devices (see [`Policy::recent_devices`]), and
    /// their devices. A job spanning devices takes turns only while
    /// another client is connected (it may ask for those devices at any
    /// time): alone, there is nobody to align its ranks against, and a
    /// turn's short tokens and pauses would only slow it (one process
    /// launching on two devices at once got half its capped share).
    fn spanning_jobs(&self, now: Micros) -> BTreeMap<String, BTreeSet<DeviceId>> {
        let mut used = self.recent_devices(now);
        used.retain(|j, d| {
            d.len() >= 2
                && self
                    .clients
                    .values()
                    .any(|c| c.role == Role::Client && c.job.as_deref() != Some(j))
        });
        used
    }

    /// Ends the turns that are over: of a job no longer among those that
    /// span devices (`used`), or past their end once its ranks finished
    /// the step they were in (or [`DRAIN_MAX`] after it).
    fn end_turns(&mut self, used: &BTreeMap<String, BTreeSet<DeviceId>>, now: Micros) {
        let over: Vec<DeviceId> = self
            .turns
            .iter()
            .filter(|(_, t)| {
                if !used.contains_key(&t.job) {
                    return true;
                }
                if now < t.until {
                    return false;
                }
                // Its ranks finish the step they are in: a token in hand
                // runs out, a rank's collective that waits for its peer
                // (which needs a token to launch its own) is met.
                now >= t.until + DRAIN_MAX
                    || !(self.holds_any(&t.job, &t.devices)
                        || self.in_flight_any(&t.job, &t.devices))
            })
            .map(|(&l, _)| l)
            .collect();
        for l in over {
            self.turns.remove(&l);
        }
    }

    /// What turn `t`, open on `device`, means for its next grant (in
    /// `view`): its job owns the device, but its ranks begin no new step
    /// once the turn is over.
    fn view_own_turn(&self, view: &mut TurnView, t: &Turn, device: DeviceId, now: Micros) {
        let job = &t.job;
        view.owner = Some((job.clone(), t.until));
        // A rank that finished its step since the turn's end,
        // or any past the drain, begins no new step: one is
        // served only to catch up with a peer whose work waits
        // for it (a collective in flight).
        let mut others = t.devices.clone();
        others.remove(&device);
        let done = self
            .ranks(job)
            .any(|(_, c)| c.turn_done.get(&device) == Some(&t.until));
        // A peer rank still in the turn's steps (a token granted
        // before its end) needs this one for them.
        let peer_steps = self.ranks(job).any(|(_, c)| {
            c.uncharged
                .iter()
                .any(|(d, &(at, _))| others.contains(d) && at < t.until)
        });
        if (done || now >= t.until + DRAIN)
            && !peer_steps
            && !self.waits_for_peer(job, &others, now)
        {
            view.blocked.insert(job.clone());
            // A process that holds another of the turn's
            // devices is mid-operation on both (a launch on
            // several devices at once): it is served.
            view.catch_up.extend(
                self.ranks(job)
                    .filter(|(_, c)| c.holds_on(&others))
                    .map(|(&id, _)| id),
            );
        }
    }

    /// A rank of `job` was granted a token for `quota` µs: with no turn
    /// of its open, it opens one.
    pub(super) fn note_turn_grant(
        &mut self,
        view: &TurnView,
        job: Option<&str>,
        quota: Micros,
        now: Micros,
    ) {
        let Some(devices) = job.and_then(|j| view.leads.get(j)) else {
            return;
        };
        let Some(&leader) = devices.first() else {
            return;
        };
        self.turns.insert(
            leader,
            Turn {
                job: job.unwrap_or_default().to_string(),
                devices: devices.clone(),
                until: now + quota,
            },
        );
    }

    /// `client` gave its token of `device` back with no work in flight:
    /// after its job's turn there ended, it has finished its last step.
    pub(super) fn note_step_end(&mut self, client: ClientId, device: DeviceId, now: Micros) {
        let Some(job) = self.clients.get(&client).and_then(|c| c.job.as_ref()) else {
            return;
        };
        let until = self
            .turns
            .values()
            .find(|t| &t.job == job && t.devices.contains(&device) && now >= t.until)
            .map(|t| t.until);
        if let (Some(until), Some(c)) = (until, self.clients.get_mut(&client)) {
            c.turn_done.insert(device, until);
        }
    }

    /// The earliest change of an open turn still to come: its end, the
    /// end of its drain, its hard end.
    pub(super) fn next_turn_end(&self, now: Micros) -> Option<Micros> {
        self.turns
            .values()
            .flat_map(|t| [t.until, t.until + DRAIN, t.until + DRAIN_MAX])
            .filter(|&u| u > now)
            .min()
    }
}

impl Client {
    /// Whether it holds a token on one of `devices`.
    fn holds_on(&self, devices: &BTreeSet<DeviceId>) -> bool {
        self.uncharged.keys().any(|d| devices.contains(d))
    }

    /// Whether work of a token it gave back runs on one of `devices`.
    fn in_flight_on(&self, devices: &BTreeSet<DeviceId>) -> bool {
        self.in_flight.iter().any(|d| devices.contains(d))
    }

    /// The devices where it holds a token `by` µs or more past its quota
    /// at `now`.
    fn held_past_quota(&self, by: Micros, now: Micros) -> impl Iterator<Item = DeviceId> + '_ {
        self.uncharged
            .iter()
            .filter(move |&(_, &(at, quota))| at + quota + by <= now)
            .map(|(&d, _)| d)
    }
}
