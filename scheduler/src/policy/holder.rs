//! The holder's side of the policy: memory a real client needs back from
//! the holder, the holder's long poll for orders, and the activity report
//! it uses to tell idle devices.

use super::{Action, GroupKey, Micros, Policy, error};
use gemini_protocol::{ClientId, DeviceActivity, DeviceId, ErrorKind, HolderOrder, Reply};

/// How long a client waits for the holder to give memory back.
pub const DEMAND_TIMEOUT: Micros = 1_000_000;

/// A client waiting for the holder to free memory.
#[derive(Debug, Clone)]
pub struct Demand {
    client: ClientId,
    seq: u32,
    device: DeviceId,
    deadline: Micros,
}

/// The holder's pending poll.
#[derive(Debug, Clone, Copy)]
pub struct Poll {
    client: ClientId,
    seq: u32,
    deadline: Micros,
}

impl Policy {
    pub(super) fn holder_memory(&self, device: DeviceId) -> u64 {
        self.memory
            .get(&(GroupKey::Holder, device))
            .copied()
            .unwrap_or(0)
    }

    /// A real client's allocation failed for lack of physical memory.
    pub(super) fn need_memory(
        &mut self,
        client: ClientId,
        seq: u32,
        device: DeviceId,
        bytes: u64,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let held = self.holder_memory(device);
        if held == 0 {
            out.push(Action::Reply {
                client,
                seq,
                reply: error(
                    ErrorKind::OutOfMemory,
                    format!("device {device} is out of memory and the holder holds none of it"),
                ),
            });
            return;
        }
        self.demands.push(Demand {
            client,
            seq,
            device,
            deadline: now + DEMAND_TIMEOUT,
        });
        self.orders.push_back(HolderOrder::FreeMemory {
            device,
            bytes: bytes.min(held),
        });
        self.deliver_order(out);
    }

    /// The holder asks for orders.
    pub(super) fn holder_poll(
        &mut self,
        client: ClientId,
        seq: u32,
        wait_us: u64,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        if let Some(old) = self.poll.take()
            && old.client != client
        {
            out.push(Action::Reply {
                client: old.client,
                seq: old.seq,
                reply: error(ErrorKind::Unexpected, "another holder took over"),
            });
        }
        self.poll = Some(Poll {
            client,
            seq,
            deadline: now.saturating_add(wait_us.min(10_000_000)),
        });
        self.deliver_order(out);
    }

    fn deliver_order(&mut self, out: &mut Vec<Action>) {
        if self.poll.is_none() {
            return;
        }
        let Some(order) = self.orders.pop_front() else {
            return;
        };
        if let Some(p) = self.poll.take() {
            out.push(Action::Reply {
                client: p.client,
                seq: p.seq,
                reply: Reply::Holder(order),
            });
        }
    }

    /// The holder gave memory back on `device`: the clients waiting for
    /// memory there may retry.
    pub(super) fn holder_released(&mut self, device: DeviceId, out: &mut Vec<Action>) {
        self.orders
            .retain(|o| !matches!(o, HolderOrder::FreeMemory { device: d, .. } if *d == device));
        let (done, keep): (Vec<Demand>, Vec<Demand>) =
            self.demands.drain(..).partition(|d| d.device == device);
        self.demands = keep;
        for d in done {
            out.push(Action::Reply {
                client: d.client,
                seq: d.seq,
                reply: Reply::Done,
            });
        }
    }

    /// Answers a poll whose time is up and demands the holder left
    /// unanswered.
    pub(super) fn holder_tick(&mut self, now: Micros, out: &mut Vec<Action>) {
        if let Some(p) = self.poll
            && now >= p.deadline
        {
            self.poll = None;
            let report = self
                .devices
                .iter()
                .map(|(&device, dev)| {
                    // A real client holding or waiting for the token is
                    // activity now, however long ago it asked.
                    let real = |id: &ClientId| {
                        self.clients
                            .get(id)
                            .filter(|c| matches!(c.group, GroupKey::Named(_)))
                            .map(|c| format!("pid {} (group {})", c.pid, c.group.shown()))
                    };
                    let used_by = dev
                        .grants()
                        .find_map(|t| real(&t.client))
                        .or_else(|| dev.waiters.iter().find_map(|w| real(&w.client)));
                    DeviceActivity {
                        device,
                        idle_us: if used_by.is_some() {
                            0
                        } else {
                            self.activity
                                .get(&device)
                                .map_or(u64::MAX, |&t| now.saturating_sub(t))
                        },
                        used_by,
                    }
                })
                .collect();
            out.push(Action::Reply {
                client: p.client,
                seq: p.seq,
                reply: Reply::Holder(HolderOrder::Report(report)),
            });
        }
        let (late, keep): (Vec<Demand>, Vec<Demand>) =
            self.demands.drain(..).partition(|d| now >= d.deadline);
        self.demands = keep;
        for d in late {
            out.push(Action::Reply {
                client: d.client,
                seq: d.seq,
                reply: error(
                    ErrorKind::OutOfMemory,
                    "the holder did not give memory back in time",
                ),
            });
        }
    }

    /// The holder left: its memory is free again, so waiting clients may
    /// retry; its poll is gone.
    pub(super) fn holder_gone(&mut self, client: ClientId, out: &mut Vec<Action>) {
        if self.poll.is_some_and(|p| p.client == client) {
            self.poll = None;
        }
        // Orders were about the memory it held, which is free now.
        self.orders.clear();
        let devices: Vec<DeviceId> = self.demands.iter().map(|d| d.device).collect();
        for device in devices {
            if self.holder_memory(device) == 0 {
                self.holder_released(device, out);
            }
        }
    }

    /// Deadlines of the holder's poll and of memory demands.
    pub(super) fn holder_deadline(&self) -> Option<Micros> {
        self.poll
            .map(|p| p.deadline)
            .into_iter()
            .chain(self.demands.iter().map(|d| d.deadline))
            .min()
    }

    /// The daemon is stopping: tell the holder to release everything.
    pub fn shutdown(&mut self) -> Vec<Action> {
        let mut out = Vec::new();
        self.orders.clear();
        self.orders.push_back(HolderOrder::Stop);
        self.deliver_order(&mut out);
        out
    }
}
