//! Memory reserved per group and device, and the group's view of it.
//!
//! Leases: a client process that reserves memory for an allocation may
//! lease some more ([`LEASE_MAX`] at most, and at most half of what its
//! group has left), which its later allocations take without asking,
//! until [`LEASE_TTL`] has passed; it then gives back what is left. The
//! lease is reserved for the group like any allocation, so the group's
//! `MemoryLimit` holds across its processes. A process whose group is
//! short, where its other processes' leases would make room, is told to
//! ask again once they end ([`Reply::Recalled`]); none is granted or
//! renewed meanwhile, until it is served or has had [`LEASE_TTL`] more
//! to ask. So a lease holds back at most [`LEASE_MAX`] of the group's
//! memory from its other processes, for [`LEASE_TTL`] and the round trip
//! that gives it back ([`RECALL_SLACK`] is allowed for it); a process
//! that does not run holds its lease as it holds its allocations, and a
//! group-mate's allocation waits for it up to [`RECALL_LATE_MAX`] past
//! its due, then is refused.

use super::{GroupKey, Lease, Micros, Peer, Policy, error};
use gemini_protocol::{ClientId, DeviceId, ErrorKind, Reply, Role};
use std::collections::BTreeMap;

/// The most memory leased to one process on one device: 64 MiB.
pub const LEASE_MAX: u64 = 64 << 20;
/// How long a lease lasts (µs): 50 ms.
pub const LEASE_TTL: Micros = 50_000;
/// How long after its end a lease is due back (µs): the hook's lease
/// thread gives it back when it ends, in a round trip. An asker is told
/// to come back then; a lease later than that (its process was not
/// scheduled, or is stopped) is waited for in steps of [`RECALL_STEP`],
/// up to [`RECALL_LATE_MAX`], then the asker is refused: what the lease
/// holds may be allocated.
pub const RECALL_SLACK: Micros = 5_000;
/// How soon an asker comes back while a recalled lease is late (µs).
pub const RECALL_STEP: Micros = 1_000;
/// How late past its due a lease is still waited for (µs): a process
/// not scheduled for that long is stopped, or nearly; its lease is held
/// as its allocations are, and the asker is refused rather than kept
/// waiting (an allocation waits under the process's pool lock).
pub const RECALL_LATE_MAX: Micros = 100_000;

/// A [`gemini_protocol::Request::ReserveLeased`]'s amounts.
pub(super) struct LeaseAsk {
    pub(super) bytes: u64,
    pub(super) returned: u64,
    pub(super) lease: u64,
}

impl Policy {
    /// The memory `group` holds reserved on `device`, leases included.
    fn group_memory(&self, group: &GroupKey, device: DeviceId) -> u64 {
        self.memory
            .get(&(group.clone(), device))
            .copied()
            .unwrap_or(0)
    }

    pub(super) fn reserve(&mut self, client: ClientId, device: DeviceId, bytes: u64) -> Reply {
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
        let used = self.group_memory(&group, device);
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
            _ => error(ErrorKind::OutOfMemory, {
                let size = gemini_protocol::units::format_size;
                format!(
                    "group {:?} would use {} on device {device}, over its MemoryLimit of {} (in use: {}, asked: {})",
                    group.shown(),
                    size(used.saturating_add(bytes)),
                    size(limit),
                    size(used),
                    size(bytes)
                )
            }),
        }
    }

    /// Reserves `ask.bytes` for `client`'s allocation on `device` after
    /// taking back what is left of its lease (`ask.returned`), and leases
    /// it up to `ask.lease` more (see the module's notes).
    pub(super) fn reserve_leased(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ask: LeaseAsk,
        now: Micros,
    ) -> Reply {
        if let Some(c) = self.clients.get_mut(&client) {
            c.leases.remove(&device);
        }
        if ask.returned > 0 {
            self.release_memory(client, device, ask.returned);
        }
        match self.reserve(client, device, ask.bytes) {
            Reply::Memory { used, limit, .. } => {
                self.recall_served(client, device);
                let lease = self.grant_lease(client, device, ask.lease, now);
                Reply::Leased {
                    device,
                    used: used.saturating_add(lease),
                    limit,
                    lease,
                    ttl_us: if lease > 0 { LEASE_TTL } else { 0 },
                }
            }
            Reply::Error(e) if e.kind == ErrorKind::OutOfMemory => {
                match self.recall_leases(client, device, ask.bytes, now) {
                    Some(retry_us) => Reply::Recalled { device, retry_us },
                    None => Reply::Error(e),
                }
            }
            other => other,
        }
    }

    /// Leases `client` up to `want` bytes on `device` (see the module's
    /// notes); returns what it got.
    fn grant_lease(&mut self, client: ClientId, device: DeviceId, want: u64, now: Micros) -> u64 {
        let Some(c) = self.clients.get(&client).filter(|c| c.role == Role::Client) else {
            return 0;
        };
        let key = (c.group.clone(), device);
        if self
            .recalls
            .get(&key)
            .is_some_and(|&(until, _)| now < until)
        {
            return 0;
        }
        self.recalls.remove(&key);
        let limit = self.limits(&key.0).memory_limit;
        let used = self.group_memory(&key.0, device);
        let lease = want.min(LEASE_MAX).min(limit.saturating_sub(used) / 2);
        if lease == 0 || !matches!(self.reserve(client, device, lease), Reply::Memory { .. }) {
            return 0;
        }
        if let Some(c) = self.clients.get_mut(&client) {
            let until = now.saturating_add(LEASE_TTL);
            c.leases.insert(
                device,
                Lease {
                    bytes: lease,
                    until,
                },
            );
        }
        lease
    }

    /// `client`'s group has no room for `bytes` more on `device`: where
    /// the leases its other processes hold there would make room, they
    /// are recalled (none granted or renewed until the asker is served),
    /// and the asker is told when to ask again (µs): when they are due
    /// back, or soon where one is late.
    fn recall_leases(
        &mut self,
        client: ClientId,
        device: DeviceId,
        bytes: u64,
        now: Micros,
    ) -> Option<u64> {
        let group = self.clients.get(&client)?.group.clone();
        let (mut leased, mut due) = (0u64, now);
        for (_, c) in self
            .clients
            .iter()
            .filter(|(id, c)| **id != client && c.group == group)
        {
            if let Some(l) = c.leases.get(&device) {
                let lease_due = l.until.saturating_add(RECALL_SLACK);
                if now < lease_due.saturating_add(RECALL_LATE_MAX) {
                    leased = leased.saturating_add(l.bytes);
                    due = due.max(lease_due);
                }
            }
        }
        let limit = self.limits(&group).memory_limit;
        let used = self.group_memory(&group, device);
        if leased == 0 || used.saturating_sub(leased).saturating_add(bytes) > limit {
            return None;
        }
        // In force until the asker is served, or has had a lease's time
        // to ask again: a process of the group renewing its lease in all
        // the while would otherwise take a new one at `due`, before the
        // asker's return, time after time.
        self.recalls.retain(|_, (until, _)| now < *until);
        let until = due.saturating_add(LEASE_TTL);
        self.recalls.insert((group, device), (until, client));
        Some((due - now).max(RECALL_STEP))
    }

    /// `client` was served on `device`: a recall made for it ends.
    fn recall_served(&mut self, client: ClientId, device: DeviceId) {
        let Some(group) = self.clients.get(&client).map(|c| c.group.clone()) else {
            return;
        };
        let key = (group, device);
        if self
            .recalls
            .get(&key)
            .is_some_and(|&(_, asker)| asker == client)
        {
            self.recalls.remove(&key);
        }
    }

    /// `client`'s lease on `device` ended, `bytes` of it unused.
    pub(super) fn return_lease(&mut self, client: ClientId, device: DeviceId, bytes: u64) -> Reply {
        if let Some(c) = self.clients.get_mut(&client) {
            c.leases.remove(&device);
        }
        self.release_memory(client, device, bytes)
    }

    pub(super) fn release_memory(
        &mut self,
        client: ClientId,
        device: DeviceId,
        bytes: u64,
    ) -> Reply {
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

    pub(super) fn memory_view(&self, client: ClientId, device: DeviceId) -> Reply {
        let Some(c) = self.clients.get(&client) else {
            return error(ErrorKind::NotRegistered, "say hello first");
        };
        if c.group == GroupKey::Control {
            return error(
                ErrorKind::Unexpected,
                "a control connection holds no memory",
            );
        }
        let used = self.group_memory(&c.group, device);
        Reply::MemoryView {
            device,
            used,
            limit: self.limits(&c.group).memory_limit,
            reclaimable: if c.group == GroupKey::Holder {
                0
            } else {
                self.holder_memory(device)
            },
            context: context_estimate(&self.context_cost, &self.peers, client, device),
        }
    }

    /// `client`'s process says its context took `bytes` of `device`.
    /// Taken only from a client process that holds memory there (its
    /// context's, reserved as it was made) and never above what it holds,
    /// and kept for its own user only (the largest such report): one
    /// user's report cannot raise what another's processes reserve for
    /// their next context, which a false one could make every new process
    /// of a group near its `MemoryLimit` fail.
    pub(super) fn context_cost(&mut self, client: ClientId, device: DeviceId, bytes: u64) -> Reply {
        let held = self
            .clients
            .get(&client)
            .filter(|c| c.role == Role::Client)
            .and_then(|c| c.memory.get(&device).copied())
            .unwrap_or(0);
        if held == 0 {
            return error(
                ErrorKind::PermissionDenied,
                format!(
                    "a context's size on device {device} is taken only from a client process \
                     holding memory there"
                ),
            );
        }
        let cost = self
            .context_cost
            .entry((user_of(&self.peers, client), device))
            .or_default();
        *cost = (*cost).max(bytes.min(held));
        Reply::Done
    }
}

impl Policy {
    /// What a context took, per user and device, as `(uid, device,
    /// bytes)`, for the daemon's state file.
    pub fn context_costs(&self) -> Vec<(u32, DeviceId, u64)> {
        self.context_cost
            .iter()
            .map(|(&(uid, device), &bytes)| (uid, device, bytes))
            .collect()
    }

    /// Takes back what a context of `uid` took on `device`, from the state
    /// file of the daemon before this one.
    pub fn restore_context_cost(&mut self, uid: u32, device: DeviceId, bytes: u64) {
        if device < super::MAX_DEVICES {
            let cost = self.context_cost.entry((uid, device)).or_default();
            *cost = (*cost).max(bytes);
        }
    }
}

/// Whose reports of context sizes `client`'s are: its peer's uid (one
/// bucket for the connections the transport could not name).
pub(super) fn user_of(peers: &BTreeMap<ClientId, Peer>, client: ClientId) -> u32 {
    peers.get(&client).map_or(u32::MAX, |p| p.uid)
}

/// What `client`'s process reserves on `device` for a context before the
/// driver makes it: the most its own user's contexts took there (0 before
/// one is reported).
pub(super) fn context_estimate(
    context_cost: &BTreeMap<(u32, DeviceId), u64>,
    peers: &BTreeMap<ClientId, Peer>,
    client: ClientId,
    device: DeviceId,
) -> u64 {
    context_cost
        .get(&(user_of(peers, client), device))
        .copied()
        .unwrap_or(0)
}
