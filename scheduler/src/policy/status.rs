//! Figures for `gem-schd status`, `top` and the metrics.

use super::{
    Client, Device, GroupCounters, GroupKey, Limits, Micros, Peer, Policy, limits, memory, request,
    reserve,
};
use gemini_config::{GroupConfig, ResourceConfig};
use gemini_protocol::{
    ClientId, ClientStatus, DeviceId, DeviceStatus, GroupDeviceStatus, GroupStatus, StatusReport,
};
use std::collections::{BTreeMap, BTreeSet};

impl Policy {
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
                    used_us: g.used_total,
                    by_user: g.used_by.iter().map(|(&u, &t)| (u, t)).collect(),
                });
            }
        }
        out
    }

    /// Figures for `gem-schd status`.
    pub fn status(&mut self, now: Micros) -> StatusReport {
        let (reservations, queue) = self.reservation_status(now);
        let groups = self.group_status();
        let devices = self.device_status(now);
        let clients = self.client_status();
        StatusReport {
            server: env!("CARGO_PKG_VERSION").to_string(),
            config_path: self.config.path.display().to_string(),
            config_error: None,
            window_us: self.params.window,
            uptime_us: now,
            groups,
            devices,
            clients,
            reservations,
            queue,
            // The daemon fills in the driver's side.
            driver_limits: false,
            refused: Vec::new(),
            protocol: gemini_protocol::PROTOCOL_VERSION,
        }
    }

    /// The groups of the file in force and the retired ones, by name.
    fn group_status(&self) -> Vec<GroupStatus> {
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
                driver_memory: Vec::new(),
                latency: g.latency.to_string(),
            })
            .collect();
        groups.sort_by(|a, b| a.name.cmp(&b.name));
        groups
    }

    /// Each device's figures, in order of the devices.
    fn device_status(&mut self, now: Micros) -> Vec<DeviceStatus> {
        let Policy {
            devices,
            reservations,
            clients,
            peers,
            context_cost,
            memory,
            config,
            retired,
            params,
            ..
        } = self;
        let figures = Figures {
            clients,
            peers,
            context_cost,
            memory,
            config,
            retired,
            now,
            window: params.window,
        };
        let mut out = Vec::new();
        for (&id, dev) in devices.iter_mut() {
            let reserved = reserve::reserved_for(reservations, id);
            out.push(figures.device(id, dev, &reserved));
        }
        // Every GPU the machine has is listed, used yet or not, and every
        // one a group holds memory on.
        let held_on = memory.keys().map(|(_, d)| *d);
        let others: BTreeSet<DeviceId> = (0..params.devices).chain(held_on).collect();
        for id in others {
            if !devices.contains_key(&id) {
                out.push(figures.unused(id));
            }
        }
        out.sort_by_key(|d| d.device);
        out
    }

    /// Each client's figures: among them the devices it holds memory on,
    /// was granted a token of, or waits for.
    fn client_status(&self) -> Vec<ClientStatus> {
        // The devices each client waits for, in one pass over the waiters.
        let mut waits_on: BTreeMap<ClientId, Vec<DeviceId>> = BTreeMap::new();
        for (&d, dev) in &self.devices {
            for w in &dev.waiters {
                waits_on.entry(w.client).or_default().push(d);
            }
        }
        self.clients
            .iter()
            .map(|(&id, c)| ClientStatus {
                id,
                pid: c.pid,
                role: c.role,
                group: c.group.name().unwrap_or_default().to_string(),
                job: c.job.as_deref().map(|k| request::job_name(k).to_string()),
                user: self
                    .peers
                    .get(&id)
                    .map(|p| p.user.clone())
                    .unwrap_or_default(),
                // The daemon reads it from /proc.
                command: String::new(),
                devices: c
                    .memory
                    .iter()
                    .filter(|(_, b)| **b > 0)
                    .map(|(d, _)| *d)
                    .chain(c.granted.keys().copied())
                    .chain(waits_on.get(&id).into_iter().flatten().copied())
                    .collect::<BTreeSet<DeviceId>>()
                    .into_iter()
                    .collect(),
                // The daemon knows each connection's version and build.
                protocol: 0,
                build: String::new(),
                waiting: waits_on.get(&id).cloned().unwrap_or_default(),
                memory: c
                    .memory
                    .iter()
                    .filter(|(_, b)| **b > 0)
                    .map(|(&device, &bytes)| gemini_protocol::HeldMemory { device, bytes })
                    .collect(),
                gpu_us: c.gpu_used.values().fold(0, |a, &t| a.saturating_add(t)),
            })
            .collect()
    }
}

/// What a device's figures are read from, besides the device.
#[derive(Debug)]
struct Figures<'a> {
    clients: &'a BTreeMap<ClientId, Client>,
    peers: &'a BTreeMap<ClientId, Peer>,
    context_cost: &'a BTreeMap<(u32, DeviceId), u64>,
    memory: &'a BTreeMap<(GroupKey, DeviceId), u64>,
    config: &'a ResourceConfig,
    retired: &'a BTreeMap<String, GroupConfig>,
    now: Micros,
    window: Micros,
}

impl Figures<'_> {
    /// `key`'s limits (see [`limits`]).
    fn limits(&self, key: &GroupKey) -> Limits {
        limits(self.config, self.retired, key)
    }

    /// The memory `key` holds on device `id`.
    fn memory_used(&self, key: &GroupKey, id: DeviceId) -> u64 {
        self.memory.get(&(key.clone(), id)).copied().unwrap_or(0)
    }

    /// About what the contexts of `key`'s processes take on device `id`
    /// (see [`contexts_of`]).
    fn contexts(&self, key: &GroupKey, id: DeviceId) -> u64 {
        contexts_of(self.clients, self.peers, self.context_cost, key, id)
    }

    /// The figures of device `id` (`dev`), reserved for `reserved` (the
    /// groups holding a reservation of it).
    fn device(&self, id: DeviceId, dev: &mut Device, reserved: &[&str]) -> DeviceStatus {
        let (now, window) = (self.now, self.window);
        // One span for the device's figures: from its first work in
        // the window (a device busy for 3 s of a 10 s window shows
        // 100 % over 3 s), so that the groups' shares add up to at
        // most its busy share, and each is what `MinUtil` and
        // `MaxUtil` are about.
        let span = dev
            .busy
            .first_within(now, window)
            .map_or(window, |first| now - first)
            .max(1);
        let mut rows = self.used_rows(id, dev, reserved, span);
        rows.extend(self.fresh_rows(id, dev, reserved));
        rows.extend(memory_only_rows(
            self.memory,
            |k| self.limits(k).memory_limit,
            |k| self.contexts(k, id),
            id,
            |k| dev.groups.contains_key(k) || dev.waiters.iter().any(|w| &w.group == k),
        ));
        DeviceStatus {
            device: id,
            busy: dev.busy.used(now, window) as f64 / span as f64,
            span_us: span,
            token_client: dev.token.as_ref().map(|t| t.client),
            waiting: dev.waiters.len() as u32,
            groups: rows,
            rtt_us: dev.rtt_ns / 1000,
            // The daemon's, from NVML.
            memory_total: None,
            memory_free: None,
        }
    }

    /// Rows of the groups that used device `id` (`dev`) and have not left
    /// it, their shares over `span`.
    fn used_rows(
        &self,
        id: DeviceId,
        dev: &mut Device,
        reserved: &[&str],
        span: Micros,
    ) -> Vec<GroupDeviceStatus> {
        let (now, window) = (self.now, self.window);
        let holder_group = dev
            .token
            .as_ref()
            .and_then(|t| self.clients.get(&t.client))
            .map(|c| &c.group);
        let mut rows = Vec::new();
        for (key, g) in dev.groups.iter_mut() {
            let memory_used = self.memory_used(key, id);
            let waiting = dev.waiters.iter().filter(|w| &w.group == key).count() as u32;
            let idle = g.usage.is_empty(now, window);
            // A group that left the device (nothing used in the
            // window, no memory, not waiting, not holding) is no longer
            // shown on it.
            if idle && memory_used == 0 && waiting == 0 && holder_group != Some(key) {
                continue;
            }
            let contexts = self.contexts(key, id);
            let limits = self.limits(key);
            // (Not a group kept off a reserved GPU: nothing is owed
            // to it there.)
            let short_of_min = waiting > 0
                && limits.min_util > 0.0
                && !reserve::kept_out(reserved, key)
                && g.share(now, window) < limits.min_util;
            rows.push(GroupDeviceStatus {
                short_of_min,
                contexts: contexts.min(memory_used),
                group: key.shown(),
                share: g.usage.used(now, window) as f64 / span as f64,
                memory_used,
                memory_limit: limits.memory_limit,
                waiting,
            });
        }
        rows
    }

    /// Rows of the groups waiting on device `id` (`dev`) that have not
    /// had its token yet: shown waiting, with nothing used.
    fn fresh_rows(&self, id: DeviceId, dev: &Device, reserved: &[&str]) -> Vec<GroupDeviceStatus> {
        let mut fresh: Vec<&GroupKey> = Vec::new();
        for w in &dev.waiters {
            if !dev.groups.contains_key(&w.group) && !fresh.contains(&&w.group) {
                fresh.push(&w.group);
            }
        }
        fresh
            .into_iter()
            .map(|key| {
                let limits = self.limits(key);
                let memory_used = self.memory_used(key, id);
                GroupDeviceStatus {
                    group: key.shown(),
                    share: 0.0,
                    memory_used,
                    memory_limit: limits.memory_limit,
                    waiting: dev.waiters.iter().filter(|w| &w.group == key).count() as u32,
                    contexts: self.contexts(key, id).min(memory_used),
                    short_of_min: limits.min_util > 0.0 && !reserve::kept_out(reserved, key),
                }
            })
            .collect()
    }

    /// The figures of device `id`, which nobody used yet: the memory
    /// groups hold there.
    fn unused(&self, id: DeviceId) -> DeviceStatus {
        DeviceStatus {
            device: id,
            busy: 0.0,
            span_us: self.window,
            token_client: None,
            waiting: 0,
            groups: memory_only_rows(
                self.memory,
                |k| self.limits(k).memory_limit,
                |k| self.contexts(k, id),
                id,
                |_| false,
            ),
            rtt_us: 0,
            memory_total: None,
            memory_free: None,
        }
    }
}

/// Rows of the groups that hold memory on device `id` but have not used
/// its time (`shown`: those listed already), with their limits
/// (`limit_of`): a program that only allocates is still shown with its
/// memory.
fn memory_only_rows(
    memory: &BTreeMap<(GroupKey, DeviceId), u64>,
    limit_of: impl Fn(&GroupKey) -> u64,
    contexts_of: impl Fn(&GroupKey) -> u64,
    id: DeviceId,
    shown: impl Fn(&GroupKey) -> bool,
) -> Vec<GroupDeviceStatus> {
    memory
        .iter()
        .filter(|((key, dev), used)| *dev == id && **used > 0 && !shown(key))
        .map(|((key, _), &used)| GroupDeviceStatus {
            short_of_min: false,
            group: key.shown(),
            share: 0.0,
            memory_used: used,
            memory_limit: limit_of(key),
            waiting: 0,
            contexts: contexts_of(key).min(used),
        })
        .collect()
}

/// About what the contexts of `key`'s processes take on device `id`: for
/// each process holding memory there, the largest context its user
/// reported there (0 before one is).
fn contexts_of(
    clients: &BTreeMap<ClientId, Client>,
    peers: &BTreeMap<ClientId, Peer>,
    context_cost: &BTreeMap<(u32, DeviceId), u64>,
    key: &GroupKey,
    id: DeviceId,
) -> u64 {
    clients
        .iter()
        .filter(|(_, c)| &c.group == key && c.memory.get(&id).is_some_and(|&b| b > 0))
        .map(|(&client, _)| memory::context_estimate(context_cost, peers, client, id))
        .fold(0, u64::saturating_add)
}
