//! The device token: reports charged, groups away and back, the ranking
//! of waiters, lent tokens, and the deadlines of expiring tokens.

use super::*;

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
/// `schedule`). Its lent tokens are charged to their ends, and the last
/// one before such a hold ends idle (its next kernel did not fit): on the
/// simulator a training job at `MinUtil` 0.7 was charged 0.76 of the
/// device while its kernels ran 0.64 of it.
const HOLD_SLACK: f64 = 0.15;

/// The most spans a report is charged span by span (see `charge_spans`).
const MAX_REPORT_SPANS: usize = 64;

/// How far (µs) a report may pass what can be (the time now, what the
/// client was charged before, its token's grant) before it counts as
/// impossible: the two sides round their clocks to µs.
const CLOCK_SLACK: Micros = 1_000;

/// A waiter's place in line, least first: (class, key, waiting since,
/// client), see `schedule`.
type Rank = (u8, f64, Micros, ClientId);

/// A group's (class, key) as ranked, and when it may run.
type GroupRank = (u8, f64, Micros);

impl Policy {
    /// `client` reports the work of its last token on `device` (`ran`,
    /// measured; `in_flight`: some of it still runs and is reported
    /// later): charges it, and frees the device if it still holds the
    /// token.
    pub(super) fn report(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ran: &[Span],
        in_flight: bool,
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        let Some(c) = self.clients.get_mut(&client) else {
            return;
        };
        let token = c.uncharged.remove(&device);
        let dev = self.devices.entry(device).or_default();
        if dev.token.as_ref().is_some_and(|t| t.client == client) {
            dev.token = None;
        }
        let charged = self.charge_spans(client, device, ran, now, out);
        if !in_flight && let Some(c) = self.clients.get_mut(&client) {
            c.anchor.remove(&device);
        }
        // An overrun token's use is one launch or more (a 2 ms token whose
        // two 1 ms kernels ran 2.05 ms is two): the estimate follows a
        // shorter one at once, a longer one by an eighth.
        if let Some((granted_at, quota)) = token
            && let Some(c) = self.clients.get_mut(&client)
        {
            let used = ran
                .iter()
                .map(|s| s.end_us.min(now).saturating_sub(s.start_us.max(granted_at)))
                .sum::<Micros>()
                .max(charged.min(now.saturating_sub(granted_at)));
            if used > quota {
                c.launch_floor = match c.launch_floor {
                    0 => used,
                    f if used <= f => used,
                    f => f + (used - f) / 8,
                };
            }
        }
    }

    /// Charges `client`'s group the device time of `ran` on `device`
    /// (see `ledger`), each span clipped to what can be: not before the
    /// grant of the client's oldest token whose work it had not reported,
    /// nor before what it was charged already (never twice), nor in the
    /// future, nor before the window. A clipped report is said once in
    /// the log (and counted). Returns the time charged.
    pub(super) fn charge_spans(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ran: &[Span],
        now: Micros,
        out: &mut Vec<Action>,
    ) -> Micros {
        if ran.is_empty() {
            return 0;
        }
        // A hook sends at most 32 spans a report, the holder 64;
        // more is charged as one span over all of them (the client's
        // loss), so that no client has the ledger settle spans by the
        // thousand.
        let joined;
        let ran = if ran.len() > MAX_REPORT_SPANS {
            joined = [Span {
                start_us: ran.iter().map(|s| s.start_us).min().unwrap_or(0),
                end_us: ran.iter().map(|s| s.end_us).max().unwrap_or(0),
            }];
            &joined[..]
        } else {
            ran
        };
        let Policy {
            clients,
            devices,
            config,
            retired,
            params,
            ..
        } = self;
        let Some(c) = clients.get_mut(&client) else {
            return 0;
        };
        let horizon = now.saturating_sub(params.window);
        // A client with no token here before (this scheduler restarted
        // under it) may report what it ran before: clipped, not said.
        let known = c.anchor.contains_key(&device) || c.charged_until.contains_key(&device);
        let until = c.charged_until.get(&device).copied().unwrap_or(0);
        // No token granted whose work is unreported: nothing can have run,
        // unless the client ran here under the scheduler before this one,
        // whose last token may have run on after this one started (its
        // first report here: from this scheduler's start, the spans of
        // before it rebased to 0).
        // As an anchor: work it says is still in flight is taken from
        // there too, at its next report.
        if c.restored.remove(&device) && !known {
            c.anchor.insert(device, 0);
        }
        let anchor = c.anchor.get(&device).copied().unwrap_or(now);
        let dev = devices.entry(device).or_default();
        dev.ledger.forget_before(horizon);
        let mut from = until.max(anchor);
        let mut clipped = None;
        let mut charged = 0;
        let mut first = 0;
        for s in ran {
            // Rounding to µs on both sides is not an impossible report.
            if clipped.is_none()
                && (s.start_us.saturating_add(CLOCK_SLACK) < from
                    || s.end_us > now.saturating_add(CLOCK_SLACK))
            {
                clipped = Some(format!(
                    "{}-{} us, where {from}-{now} us can be ({})",
                    s.start_us,
                    s.end_us,
                    if s.end_us > now.saturating_add(CLOCK_SLACK) {
                        "in the future"
                    } else if s.start_us < until {
                        "reported already"
                    } else {
                        "before its token"
                    }
                ));
            }
            let (start, end) = (s.start_us.max(from).max(horizon), s.end_us.min(now));
            if end <= start {
                continue;
            }
            // From where its last span ended: work queued behind that
            // one, outstanding since it was.
            let since = match c.stretch.get(&device) {
                Some(&since) if s.start_us <= from && from > anchor => since,
                _ => start,
            };
            let claimed = dev.claim(&c.group, (start, end), since, params.saved_credit(), false);
            if claimed > 0 && charged == 0 {
                first = start;
            }
            charged += claimed;
            from = end;
            c.charged_until.insert(device, end);
            c.stretch.insert(device, since);
        }
        // The report's credit at once (see `Device::claim`); a report that
        // charged nothing (all clipped, or none ran) looks up no limits.
        if charged > 0 {
            let max_util = limits(config, retired, &c.group).max_util;
            dev.charge_credit(
                &c.group,
                first,
                now,
                charged,
                max_util,
                params.saved_credit(),
            );
        }
        if let Some(what) = clipped
            && known
        {
            c.clipped += 1;
            if c.clipped.is_power_of_two() {
                out.push(Action::Clipped {
                    client,
                    device,
                    reports: c.clipped,
                    what,
                });
            }
        }
        charged
    }

    /// Charges work of `client` that ran on `device` after the token it
    /// was launched under ended ([`Request::LateUsage`]): the work it gave
    /// back in flight is done.
    pub(super) fn late(
        &mut self,
        client: ClientId,
        device: DeviceId,
        ran: &[Span],
        now: Micros,
        out: &mut Vec<Action>,
    ) {
        self.charge_spans(client, device, ran, now, out);
        // The work it gave back in flight is done: what it may not have
        // reported yet is that of a token granted since, if any (an
        // anchor left at the old grant would have its exit charged, as an
        // estimate, from there to that grant's end and the grace).
        if let Some(c) = self.clients.get_mut(&client) {
            c.in_flight.remove(&device);
            match c.uncharged.get(&device) {
                Some(&(granted_at, _)) => c.anchor.insert(device, granted_at),
                None => c.anchor.remove(&device),
            };
        }
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
        if dev.waiters.iter().any(|w| &w.group == group)
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
        let Some(group) = self.clients.get(&client).map(|c| &c.group) else {
            return;
        };
        let Some(dev) = self.devices.get_mut(&device) else {
            return;
        };
        let lead = handover_lead(dev.rtt());
        let Some(token) = dev.token.as_mut().filter(|t| t.client == client) else {
            return;
        };
        let at = now.saturating_add(done_in.saturating_sub(lead));
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
        let view = match self.devices.get(&device) {
            Some(d) if !d.waiters.is_empty() => self.turn_view(device, now),
            _ => gang::TurnView::default(),
        };
        let params = self.params;
        let Policy {
            devices,
            clients,
            config,
            retired,
            reservations,
            ..
        } = self;
        // A reserved device is its reservations' groups' (and the
        // holder's, which hands it back at once): other groups wait.
        let reserved = reserve::reserved_for(reservations, device);
        let kept_out = |key: &GroupKey| reserve::kept_out(&reserved, key);
        let Some(dev) = devices.get_mut(&device) else {
            return;
        };
        if let Some(t) = dev.token.take_if(|t| now >= t.expires_at)
            && !t.ends
            && let Some(c) = clients.get(&t.client)
        {
            dev.groups.entry(c.group.clone()).or_default().revocations += 1;
        }
        // The groups with a waiter, gathered once (few: a Vec, not a set
        // built per request).
        let mut waiting_groups: Vec<GroupKey> = Vec::new();
        for w in &dev.waiters {
            if !waiting_groups.contains(&w.group) {
                waiting_groups.push(w.group.clone());
            }
        }
        // A group kept off a reserved device waits for nothing here until
        // the reservation ends: it is not throttled, not owed, and others'
        // tokens are not shortened for it.
        let (kept, waiting_groups): (Vec<GroupKey>, Vec<GroupKey>) =
            waiting_groups.into_iter().partition(|k| kept_out(k));
        let saved = params.saved_credit();
        note_throttled(dev, &waiting_groups, config, retired, saved, now);
        if dev.token.is_some() || dev.waiters.is_empty() {
            return;
        }
        // Every waiter's group has its use on the device (a kept-out one
        // too). (Not while the token is held: a waiter that left before
        // it was served would leave a group that never ran marked away.)
        for key in waiting_groups.iter().chain(&kept) {
            if !dev.groups.contains_key(key) {
                dev.groups.insert(key.clone(), GroupUse::default());
            }
        }
        let waiting = |key: &GroupKey| waiting_groups.contains(key);
        // The level groups are entitled to where no bound binds: water
        // filling between the groups using the device.
        let using: Vec<(GroupKey, f64, f64)> = groups_using(dev, waiting, now, params.window)
            .into_iter()
            .filter(|key| !kept_out(key))
            .map(|key| {
                let l = limits(config, retired, key);
                (key.clone(), l.min_util, l.max_util)
            })
            .collect();
        // (Only capped groups need it: none, and no water filling.)
        let level = if using.iter().any(|u| u.2 < 1.0) {
            let bounds: Vec<(f64, f64)> = using.iter().map(|u| (u.1, u.2)).collect();
            water_level(&bounds)
        } else {
            1.0
        };
        // A latency-critical group's room: the share it may take first
        // without breaking the `MinUtil` of the others using the device,
        // nor its own `MaxUtil`.
        let room = |key: &GroupKey| -> Option<f64> {
            let l = limits(config, retired, key);
            (l.latency == Latency::Critical).then(|| {
                let others: f64 = using.iter().filter(|u| &u.0 != key).map(|u| u.1).sum();
                l.max_util.min(1.0 - others)
            })
        };
        // A group's rank: (class, key). Class 0: latency-critical group
        // within its room (key: share - 2, before all others), real group
        // below MinUtil (key: share - MinUtil); 1: other real group (key:
        // share, plus how far its MaxUtil is below the level); 2: holder
        // (key: share).
        let rank_of = |key: &GroupKey, g: &mut GroupUse, min_util: f64, max_util: f64| {
            let share = if g.usage.is_empty(now, params.window) {
                0.0
            } else {
                g.share(now, params.window)
            };
            if *key == GroupKey::Holder {
                (2, share)
            } else if room(key).is_some_and(|r| share < r) {
                (0, share - 2.0)
            } else if share < min_util {
                (0, share - min_util)
            } else {
                (1, share + at_cap_behind(share, max_util, level))
            }
        };
        // Rank the waiters: (class, key, since). Capped groups in debt are
        // not chosen; `due`: the earliest time one of them ranked before
        // the chosen waiter is out of it.
        let mut ranked: Vec<(Rank, usize, Micros)> = Vec::new();
        // Each waiting group's (class, key, eligible at), worked out once
        // for all its waiters; `None`: never eligible (a group unknown to
        // the file).
        let mut of_group: Vec<(&GroupKey, Option<GroupRank>)> = Vec::new();
        for (i, w) in dev.waiters.iter().enumerate() {
            // A job spanning devices waits for its turn (a job owed time
            // too: it waits at most the turn and its drain, and is ranked
            // first once the turn is over; served at once, its ranks and
            // the turn's interleaved on both GPUs, and the jobs of two
            // groups at MinUtil 0.5 made half their steps).
            if !view.blocked.is_empty()
                && clients
                    .get(&w.client)
                    .is_none_or(|c| view.blocks(c.job.as_deref()))
                && !view.catch_up.contains(&w.client)
            {
                continue;
            }
            let known = of_group.iter().find(|(k, _)| *k == &w.group).map(|r| r.1);
            let rank = match known {
                Some(rank) => rank,
                None if kept_out(&w.group) => {
                    of_group.push((&w.group, None));
                    None
                }
                None => {
                    let Limits {
                        min_util, max_util, ..
                    } = limits(config, retired, &w.group);
                    let rank = dev.groups.get_mut(&w.group).and_then(|g| {
                        let at = g.eligible_at(now, max_util, saved)?;
                        let (class, key) = rank_of(&w.group, g, min_util, max_util);
                        Some((class, key, at))
                    });
                    of_group.push((&w.group, rank));
                    rank
                }
            };
            if let Some((class, key, at)) = rank {
                ranked.push(((class, key, w.since, w.client), i, at));
            }
        }
        let before = |a: &Rank, b: &Rank| a.partial_cmp(b) == Some(std::cmp::Ordering::Less);
        // The job whose turn it is goes first, unless another group is
        // below its MinUtil: turns align a job's ranks, they do not take
        // a guarantee away.
        let of_turn = |i: usize| {
            clients
                .get(&dev.waiters[i].client)
                .is_some_and(|c| view.owns(c.job.as_deref()))
        };
        let owed_first = ranked
            .iter()
            .any(|((class, ..), i, at)| *at == now && !of_turn(*i) && *class == 0);
        let turn_waits = !owed_first && ranked.iter().any(|(_, i, at)| *at == now && of_turn(*i));
        let mut best: Option<(Rank, usize)> = None;
        for (rank, i, at) in &ranked {
            if *at == now
                && (!turn_waits || of_turn(*i))
                && best.as_ref().is_none_or(|(b, _)| before(rank, b))
            {
                best = Some((*rank, *i));
            }
        }
        let Some((chosen, i)) = best else {
            return;
        };
        let due = ranked
            .iter()
            .filter(|(rank, _, at)| *at > now && before(rank, &chosen))
            .map(|r| r.2)
            .min();
        let (class, key) = (chosen.0, chosen.1);
        // A group owed time that is not waiting is between bursts and will
        // be back: lend the device to others in short tokens only, so it
        // waits at most one of them when it returns. Owed: active in the
        // window, not paused, and ranked before the chosen waiter (below
        // its MinUtil; or, for a real group chosen, less used as ranked
        // above). The lent token ends about when such a group usually
        // comes back (the earliest, learned from their past absences, and
        // not before a capped one may run again; `back`), within
        // [lent_min_quota, min_quota].
        let (mut lent, mut back) = (false, None::<Micros>);
        // A latency-critical group active here and within its room, not
        // asking now: whoever is chosen gets a short token (at most
        // CRITICAL_LEND_MAX), ending about when the critical group comes
        // back, so that it waits little behind the work queued under it.
        // `critical_back`: when the first of them is due back (expected,
        // not before it may run), while it is late by less than
        // CRITICAL_LEND_MAX: a critical group later than that is not
        // waited for (a server whose requests come irregularly is late at
        // every pause).
        let (mut critical_owed, mut critical_back) = (false, None::<Micros>);
        // When group `k`, not asking now (so active within the window,
        // `using`), is expected back, if `owed(class, key)` says its rank
        // is owed the device: `Some(None)` if its return is not known yet;
        // `None` if it is not owed. With it, when it may run (its
        // `MaxUtil`).
        let mut owed_back = |k: &GroupKey, owed: &dyn Fn(u8, f64) -> bool| {
            let Limits {
                min_util, max_util, ..
            } = limits(config, retired, k);
            let g = dev.groups.get_mut(k)?;
            let (c, kk) = rank_of(k, g, min_util, max_util);
            if !owed(c, kk) {
                return None;
            }
            let may_run = g.eligible_at(now, max_util, saved)?;
            Some((g.expected_back(now, params.min_quota), may_run))
        };
        for (k, ..) in &using {
            if waiting(k) || room(k).is_none() {
                continue;
            }
            // Within its room: ranked before all others.
            let Some((expected, may_run)) = owed_back(k, &|c, kk| c == 0 && kk < -1.0) else {
                continue;
            };
            critical_owed = true;
            lent = true;
            let at = expected.map(|t| t.max(may_run));
            back = back.into_iter().chain(at).min();
            // Its return: when it is expected, or when it may run if that
            // is later; in the past while it is late. It is waited for
            // until CRITICAL_LEND_MAX past that (a return is an average:
            // about half come after it).
            let due = expected.map(|t| if may_run > now { t.max(may_run) } else { t });
            if let Some(due) = due.filter(|&d| now < d + CRITICAL_LEND_MAX)
                && critical_back.is_none_or(|b| due < b)
            {
                critical_back = Some(due);
            }
        }
        if class != 0 {
            for (k, ..) in using.iter().filter(|u| !waiting(&u.0)) {
                let owed = |c: u8, kk: f64| c == 0 || (class == 1 && c == 1 && kk < key);
                let Some((expected, may_run)) = owed_back(k, &owed) else {
                    continue;
                };
                lent = true;
                back = back
                    .into_iter()
                    .chain(expected.map(|t| t.max(may_run)))
                    .min();
            }
        }
        // Another group in a job's turn: a short lent token, so that the
        // job's rank that comes waits at most that.
        if view.owner.is_some() && !turn_waits && !owed_first {
            lent = true;
            back = Some(now);
        }
        // A latency-critical group about to come back finds the device
        // free: a waiter whose launches would not end before it (its last
        // overrun, a kernel its hook admitted onto an empty queue, was
        // longer than the time left) waits for the critical group's step,
        // unless it is charged less than HOLD_SLACK above its MinUtil. The
        // hold ends CRITICAL_LEND_MAX after the critical group was
        // expected, and none begins once it is later than that. Only
        // kernels a lent token can hold at all are waited out: a job of
        // longer ones would otherwise get only its MinUtil. The time held
        // is charged to nobody: no work of anyone's ran.
        if class != 0
            && let Some(b) = critical_back
            && now < b + CRITICAL_LEND_MAX
            && let Some(waiter) = clients.get(&dev.waiters[i].client)
            && (1..=CRITICAL_LEND_MAX).contains(&waiter.launch_floor)
            && b < now + waiter.launch_floor
            && key - limits(config, retired, &waiter.group).min_util >= HOLD_SLACK
        {
            dev.hold_until = Some(b + CRITICAL_LEND_MAX);
            return;
        }
        dev.hold_until = None;
        // While other groups wait, tokens are as long as their group's
        // entitlement against the largest among those taking turns, so
        // that groups alternate and each waits about one token of each
        // other: with equal tokens a group entitled to 0.3 beside one of
        // 0.7 waited for two or three 100 ms tokens in a row (300 ms).
        let chosen_group = &dev.waiters[i].group;
        let ent = entitlements(&using.iter().map(|u| (u.1, u.2)).collect::<Vec<_>>());
        let real = || {
            using
                .iter()
                .zip(&ent)
                .filter(|((k, ..), _)| *k != GroupKey::Holder)
        };
        let others_wait = real().any(|((k, ..), _)| k != chosen_group && waiting(k));
        let mine = real().find(|((k, ..), _)| k == chosen_group);
        let top = real().map(|(_, &e)| e).reduce(f64::max);
        let turn_share = mine
            .map(|(_, &e)| e)
            .zip(top)
            .filter(|&(mine, top)| others_wait && mine > 0.0 && top > mine)
            .map(|(mine, top)| mine / top);
        let w = dev.waiters.remove(i);
        let Some(c) = clients.get_mut(&w.client) else {
            return;
        };
        // Work still in flight from its last token is this token's now.
        c.in_flight.remove(&device);
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
        if let Some(part) = turn_share {
            quota = quota.min(((params.max_quota as f64 * part) as Micros).max(floor));
        }
        if lent {
            let short = params.min_quota.max(floor);
            let to_return = back.map_or(short, |t| {
                t.saturating_sub(now)
                    .clamp(lent_min_quota(dev.rtt()).min(short), short)
            });
            quota = quota.min(to_return);
            if critical_owed {
                quota = quota.min(CRITICAL_LEND_MAX);
            }
            if let Some(b) = critical_back {
                let ends = b.saturating_sub(now + critical_margin(dev.rtt()));
                quota = quota.min(ends.max(dev.rtt()));
            }
        }
        // In its job's turn, a token ends with the turn; after it, with
        // the step under way (the shortest, given back at the step's end).
        let mut last_step = false;
        if turn_waits && let Some((_, until)) = &view.owner {
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
        if let Some(due) = due {
            quota = quota.min(due.saturating_sub(now).max(floor));
        }
        // A capped group's token takes its credit at most `overdraft` into
        // debt (it earns MaxUtil of the token's time while it runs).
        let max_util = limits(config, retired, &c.group).max_util;
        if max_util < 1.0
            && let Some(g) = dev.groups.get(&c.group)
        {
            let credit = g.credit_now(now, max_util, saved).max(0) as f64;
            let most = ((credit + params.overdraft() as f64) / (1.0 - max_util)) as Micros;
            quota = quota.min(most.max(floor.min(params.max_quota)));
        }
        if let Some(g) = dev.groups.get_mut(&c.group)
            && g.usage.is_empty(now, params.window)
        {
            g.active_since = now;
        }
        c.uncharged.insert(device, (now, quota));
        c.granted.insert(device, (now, quota));
        c.anchor.entry(device).or_insert(now);
        // Its work from here on runs under this scheduler's tokens.
        c.restored.remove(&device);
        // A lent token's work fits in it (its hook keeps the queue within
        // the quota): it is over at its end, and the group owed the device
        // gets it a little before (`handover_lead`), without waiting for the
        // borrower to wake up and report (charged when it does). Others
        // keep the grace for draining their queued work.
        let expires_at = if lent {
            now + quota - handover_lead(dev.rtt()).min(quota / 4)
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
                last_step,
                held_us: now.saturating_sub(w.since),
            },
        });
        let job = c.job.clone();
        self.note_turn_grant(&view, job.as_deref(), quota, now);
    }

    /// The earliest time at which [`Event::Tick`] may change something: a
    /// token expiring, or a capped group becoming eligible.
    pub fn next_deadline(&mut self, now: Micros) -> Option<Micros> {
        let cap = self.params.saved_credit();
        let mut next: Option<Micros> = None;
        let mut consider = |t: Micros| next = Some(next.map_or(t, |n: Micros| n.min(t)));
        for (&device, dev) in self.devices.iter_mut() {
            if let Some(t) = &dev.token {
                consider(t.expires_at);
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
