//! Memory reserved per group and device, and the group's view of it.

use super::*;

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
            context: self.context_cost.get(&device).copied().unwrap_or(0),
        }
    }
}
