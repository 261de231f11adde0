//! The device token: reports charged, groups away and back, the ranking
//! of waiters, lent tokens, and the deadlines of expiring tokens.

use super::*;

impl Policy {
    /// Charges the device time `client` reports for its last token on
    /// `device`, and frees the device if it still holds the token.
    pub(super) fn report(&mut self, client: ClientId, device: DeviceId, used: Micros, now: Micros) {
        // Hot path (every token): no clone of group names or configs.
        let Policy {
            clients,
            devices,
            config,
            retired,
            params,
            ..
        } = self;
        let Some(c) = clients.get_mut(&client) else {
            return;
        };
        let Some((granted_at, quota)) = c.uncharged.remove(&device) else {
            return;
        };
        // A client cannot have used more than the time since the grant, or
        // its quota: a lent token is renewed while its last work still runs
        // (the hook keeps that work within the quota) and reports it ahead.
        let used = used.min(now.saturating_sub(granted_at).max(quota));
        let end = granted_at + used;
        let max_util = limits(config, retired, &c.group).max_util;
        let cap = params.max_quota;
        let dev = devices.entry(device).or_default();
        if dev.token.as_ref().is_some_and(|t| t.client == client) {
            dev.token = None;
        }
        // Work reported before that began before this grant and ran past it
        // (a lent token's overrun, reported late; a renewed lent token's
        // last work, reported ahead) held the device: the time this client
        // waited behind it, or ran after it, is charged once.
        let start = match dev.last_report {
            Some((_, s, e)) if s < granted_at => e.clamp(granted_at, end),
            _ => granted_at,
        };
        dev.last_report = Some((client, start, end));
        let used = end - start;
        let g = match dev.groups.get_mut(&c.group) {
            Some(g) => g,
            None => dev.groups.entry(c.group.clone()).or_default(),
        };
        g.usage.add(start, end);
        g.charge(granted_at, now, used, max_util, cap);
        dev.busy.add(start, end);
    }

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
        if dev.waiters.iter().any(|w| of_group(&w.client))
            || dev.token.as_ref().is_some_and(|t| of_group(&t.client))
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
    /// expires `HANDOVER_LEAD` before that end, so the next holder's
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
        let Some(group) = self.clients.get(&client).map(|c| &c.group) else {
            return;
        };
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let Some(token) = dev.token.as_mut().filter(|t| t.client == client) else {
            return;
        };
        let at = now.saturating_add(done_in.saturating_sub(HANDOVER_LEAD));
        token.expires_at = token.expires_at.min(at);
        token.ends = true;
        let of_group = |id: &ClientId| self.clients.get(id).is_some_and(|c| &c.group == group);
        if dev.waiters.iter().any(|w| of_group(&w.client)) {
            return;
        }
        if let Some(g) = dev.groups.get_mut(group) {
            g.away_since = Some(at);
        }
    }

    /// A client of an away group asks for the token again: the group's
    /// absence ends, and is learned.
    pub(super) fn note_back(&mut self, client: ClientId, device: DeviceId, now: Micros) {
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
            g.away_avg = if g.away_avg == 0 {
                away
            } else {
                (g.away_avg + away) / 2
            };
        }
    }

    pub(super) fn schedule_all(&mut self, now: Micros, out: &mut Vec<Action>) {
        let ids: Vec<DeviceId> = self.devices.keys().copied().collect();
        for d in ids {
            self.schedule(d, now, out);
        }
    }

    /// Revokes an expired token and grants a free one.
    pub(super) fn schedule(&mut self, device: DeviceId, now: Micros, out: &mut Vec<Action>) {
        let params = self.params;
        let Policy {
            devices,
            clients,
            config,
            retired,
            ..
        } = self;
        let Some(dev) = devices.get_mut(&device) else {
            return;
        };
        if let Some(t) = dev.token.take_if(|t| now >= t.expires_at)
            && !t.ends
            && let Some(c) = clients.get(&t.client)
        {
            dev.groups.entry(c.group.clone()).or_default().revocations += 1;
        }
        note_throttled(dev, clients, config, retired, params.max_quota, now);
        if dev.token.is_some() || dev.waiters.is_empty() {
            return;
        }
        // Rank the waiters: (class, key, since). Class 0: real group below
        // MinUtil (key: share - min); 1: other real group (key: share);
        // 2: holder. Ineligible (capped) groups are skipped.
        let mut best: Option<((u8, f64, Micros, ClientId), usize)> = None;
        for (i, w) in dev.waiters.iter().enumerate() {
            let Some(c) = clients.get(&w.client) else {
                continue;
            };
            let Limits {
                min_util, max_util, ..
            } = limits(config, retired, &c.group);
            if max_util <= 0.0 {
                // Never eligible (a group unknown to the file).
                continue;
            }
            let g = match dev.groups.get_mut(&c.group) {
                Some(g) => g,
                None => dev.groups.entry(c.group.clone()).or_default(),
            };
            if g.eligible_at(now, max_util, params.max_quota) != Some(now) {
                continue;
            }
            let fresh = g.usage.is_empty(now, params.window);
            let share = if fresh {
                0.0
            } else {
                g.share(now, params.window)
            };
            let (class, key) = if c.group == GroupKey::Holder {
                (2, share)
            } else if share < min_util {
                (0, share - min_util)
            } else {
                (1, share)
            };
            let rank = (class, key, w.since, w.client);
            if best
                .as_ref()
                .is_none_or(|(b, _)| rank.partial_cmp(b) == Some(std::cmp::Ordering::Less))
            {
                best = Some((rank, i));
            }
        }
        let Some(((class, ..), i)) = best else {
            return;
        };
        // A group owed time (active in the window, below its MinUtil) that
        // is not waiting is between bursts and will be back: lend the
        // device to others in short tokens only, so it waits at most one
        // of them when it returns. The lent token ends about when such a
        // group usually comes back (the earliest, learned from their past
        // absences; `back`), within [LENT_MIN_QUOTA, min_quota].
        let (mut lent, mut back) = (false, None::<Micros>);
        if class != 0 {
            let waiters = &dev.waiters;
            // The chosen waiter's own group is among the waiting ones.
            let waiting = |key: &GroupKey| {
                waiters
                    .iter()
                    .any(|w| clients.get(&w.client).is_some_and(|c| &c.group == key))
            };
            for (key, g) in dev.groups.iter_mut() {
                let min_util = limits(config, retired, key).min_util;
                if min_util > 0.0
                    && !waiting(key)
                    && !g.usage.is_empty(now, params.window)
                    && g.share(now, params.window) < min_util
                {
                    lent = true;
                    back = back
                        .into_iter()
                        .chain(g.expected_back(now, params.min_quota))
                        .min();
                }
            }
        }
        let w = dev.waiters.remove(i);
        let Some(c) = clients.get_mut(&w.client) else {
            return;
        };
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
        if lent {
            let short = params.min_quota.max(floor);
            let to_return = back.map_or(short, |t| {
                t.saturating_sub(now)
                    .clamp(LENT_MIN_QUOTA.min(short), short)
            });
            quota = quota.min(to_return);
        }
        if let Some(g) = dev.groups.get_mut(&c.group)
            && g.usage.is_empty(now, params.window)
        {
            g.active_since = now;
        }
        c.uncharged.insert(device, (now, quota));
        // A lent token's work fits in it (its hook keeps the queue within
        // the quota): it is over at its end, and the group owed the device
        // gets it a little before (HANDOVER_LEAD), without waiting for the
        // borrower to wake up and report (charged when it does). Others
        // keep the grace for draining their queued work.
        let expires_at = if lent {
            now + quota - HANDOVER_LEAD.min(quota / 4)
        } else {
            now + quota + params.grace
        };
        dev.token = Some(Grant {
            client: w.client,
            expires_at,
            ends: lent,
        });
        out.push(Action::Reply {
            client: w.client,
            seq: w.seq,
            reply: Reply::Token {
                device,
                quota_us: quota,
                lent,
            },
        });
    }

    /// The earliest time at which [`Event::Tick`] may change something: a
    /// token expiring, or a capped group becoming eligible.
    pub fn next_deadline(&mut self, now: Micros) -> Option<Micros> {
        let cap = self.params.max_quota;
        let mut next: Option<Micros> = None;
        let mut consider = |t: Micros| next = Some(next.map_or(t, |n: Micros| n.min(t)));
        for dev in self.devices.values_mut() {
            if let Some(t) = &dev.token {
                consider(t.expires_at);
                continue;
            }
            for w in &dev.waiters {
                let Some(c) = self.clients.get(&w.client) else {
                    continue;
                };
                let max_util = limits(&self.config, &self.retired, &c.group).max_util;
                if let Some(t) = dev
                    .groups
                    .get(&c.group)
                    .and_then(|g| g.eligible_at(now, max_util, cap))
                {
                    consider(t.max(now));
                }
            }
        }
        match (next, self.holder_deadline()) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }
}
