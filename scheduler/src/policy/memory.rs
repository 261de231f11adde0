//! Memory reserved per group and device, and the group's view of it.

use super::{GroupKey, Peer, Policy, error};
use gemini_protocol::{ClientId, DeviceId, ErrorKind, Reply, Role};
use std::collections::BTreeMap;

impl Policy {
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
