//! A token shared within its group: programs of the group that holds a
//! device's token, asking for it while nobody else uses the device, run
//! beside the holder instead of after it.
//!
//! Programs of one group started together (ranks of a job on one GPU,
//! workers of a server, a sweep) otherwise took the device in turns, each
//! holding it from its first kernel to its exit: at 64 programs the
//! median one waited for 32 others' tenures, about 90-140 ms, where the
//! device without gemini runs them all at once. Their work time-slices on
//! the device as it would without gemini, and their group is charged
//! the union of their measured spans (the ledger keeps one claim per
//! moment of device time; see `ledger`), not their sum.
//!
//! A waiter joins the token (a companion grant) only where it is a
//! program of the holder's user and group, not a job's rank, and only
//! while:
//! - the token is a plain one of a program (not lent, not announced to
//!   end, not gem-holder's, not a job rank's) and has not expired;
//! - the group is neither capped (`MaxUtil` below 1) nor latency-critical;
//! - every other waiter on the device may join too, or is gem-holder's
//!   (which takes only what nobody else wants): a job's rank, or a
//!   program of another user of the group, stops the joining, so that
//!   the grants drain and the policy serves it;
//! - no program of another configured group is connected to gem-schd,
//!   and no other group is about to ask again, has the device kept for
//!   its return, holds a reservation of it, or used it within the
//!   window.
//!
//! A companion's token is as long as the holder's was. The device goes
//! to another group only once every one of them gave its token back or
//! it expired, and nobody joins once another group's program connects.
//! That program waits for their tokens to end (each at most the longest
//! token and the grace from when it asks) and for the work they queued
//! under them: each hook keeps its own queue within its token, so with
//! `n` of them up to `n` tokens' work, where behind a single holder it
//! waited for one (without a message from gem-schd to its clients, a
//! token granted cannot be cut short). The first of them to have joined
//! holds the device should the holder give its token back first (see
//! [`Device::take_back`]).
//!
//! A program of another group merely connected counts: joining while it
//! had not asked yet ran one group's programs together at the start of a
//! shapes row, and the window then held the other group back for the
//! rest of it (2.4-3.0 pp off its `MinUtil`, against 0.9-1.6). Only one
//! user's programs join: where two claims of a group overlap, the ledger
//! gives the time to the one reported first, which between users would
//! move one user's time into another's usage.

use super::tokens::{Terms, note_grant, told};
use super::{
    Action, Client, ClientId, Device, DeviceId, Grant, GroupKey, Micros, Policy, limits, reserve,
};
use gemini_config::Latency;
use gemini_protocol::Role;

impl Device {
    /// Every grant of the device's token: the holder's, then its
    /// companions' (see the module doc).
    pub(super) fn grants(&self) -> impl Iterator<Item = &Grant> {
        self.token.iter().chain(self.with.iter())
    }

    /// Whether `client` holds the device's token, alone or beside others.
    pub(super) fn holds(&self, client: ClientId) -> bool {
        self.grants().any(|t| t.client == client)
    }

    /// Takes `client`'s grant back, if it holds one. A holder's grant
    /// passes the device to its first companion, which holds it on its
    /// own terms (the end the holder's had when it joined, or one cut
    /// since by the holder's announcement).
    pub(super) fn take_back(&mut self, client: ClientId) -> Option<Grant> {
        if self.token.as_ref().is_some_and(|t| t.client == client) {
            let t = self.token.take();
            if !self.with.is_empty() {
                self.token = Some(self.with.remove(0));
            }
            return t;
        }
        let i = self.with.iter().position(|t| t.client == client)?;
        Some(self.with.remove(i))
    }
}

impl Policy {
    /// Grants `device`'s token to the waiters of its holder's group beside
    /// the holder, where nobody else can lose by it (see the module doc).
    pub(super) fn share_token(&mut self, device: DeviceId, now: Micros, out: &mut Vec<Action>) {
        let Some(Shared {
            group,
            uid,
            quota,
            expires_at,
        }) = self.shareable(device, now)
        else {
            return;
        };
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let mut i = 0;
        while i < dev.waiters.len() {
            let joins = self
                .clients
                .get(&dev.waiters[i].client)
                .is_some_and(|c| joins(c, &group, uid));
            if !joins {
                i += 1;
                continue;
            }
            let w = dev.waiters.remove(i);
            let Some(c) = self.clients.get_mut(&w.client) else {
                continue;
            };
            note_grant(c, device, now, quota, false);
            dev.with.push(Grant {
                client: w.client,
                expires_at,
                ends: false,
                runs_out_at: None,
            });
            let terms = Terms {
                quota,
                lent: false,
                last_step: false,
            };
            out.push(told(&w, device, quota, &terms, now));
        }
    }

    /// Whom `device`'s token may be shared with now, and on what terms
    /// (see the module doc); `None` where it may not.
    fn shareable(&mut self, device: DeviceId, now: Micros) -> Option<Shared> {
        let (grace, window) = (self.params.grace, self.params.window);
        let dev = self.devices.get_mut(&device)?;
        let t = dev
            .token
            .as_ref()
            .filter(|t| !t.ends && now < t.expires_at)?;
        if dev.hold_until.is_some_and(|h| h > now) {
            return None;
        }
        let c = self.clients.get(&t.client)?;
        if c.role != Role::Client || c.job.is_some() || c.lent.contains(&device) {
            return None;
        }
        let &(_, quota) = c.granted.get(&device)?;
        let (group, uid) = (c.group.clone(), c.uid);
        let other = |k: &GroupKey| k != &group && matches!(k, GroupKey::Named(_));
        // Someone to join, and nobody else waiting but gem-holder (first:
        // the cheapest check, and false on most requests).
        let clients = &self.clients;
        let may_join = |id: &ClientId| clients.get(id).is_some_and(|c| joins(c, &group, uid));
        let holder = |id: &ClientId| clients.get(id).is_none_or(|c| c.role == Role::Holder);
        if !dev.waiters.iter().any(|w| may_join(&w.client))
            || !dev
                .waiters
                .iter()
                .all(|w| may_join(&w.client) || holder(&w.client))
            || dev.returning.as_ref().is_some_and(|r| other(&r.group))
        {
            return None;
        }
        let l = limits(&self.config, &self.retired, &group);
        let reserved = reserve::reserved_for(&self.reservations, device);
        let others_reserved = reserved.iter().any(|&n| group.name() != Some(n));
        if l.max_util < 1.0 || l.latency == Latency::Critical || others_reserved {
            return None;
        }
        if dev
            .groups
            .iter_mut()
            .any(|(k, g)| other(k) && !g.usage.is_empty(now, window))
        {
            return None;
        }
        // A program of another group that runs, even one that has not
        // asked for this device yet, would wait for every companion's
        // queued work when it does.
        if clients
            .values()
            .any(|c| c.role == Role::Client && other(&c.group))
        {
            return None;
        }
        Some(Shared {
            group,
            uid,
            quota,
            expires_at: now + quota + grace,
        })
    }
}

/// Whom a device's token may be shared with, and on what terms (see
/// [`Policy::shareable`]).
struct Shared {
    /// The holder's group and user: only their programs join.
    group: GroupKey,
    uid: Option<u32>,
    /// A companion's token: as long as the holder's, from now.
    quota: Micros,
    expires_at: Micros,
}

/// Whether program `c` may join a token shared by `group`'s user `uid`.
fn joins(c: &Client, group: &GroupKey, uid: Option<u32>) -> bool {
    c.role == Role::Client && c.job.is_none() && &c.group == group && c.uid == uid
}
