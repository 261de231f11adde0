//! One group's use of one device: its usage over the window, its
//! `MaxUtil` credit, its absences and the time it was held back.

use super::usage::Usage;
use super::{Device, GroupKey, Limits, Micros, OWED_ABSENCE};

#[derive(Debug, Default)]
pub(super) struct GroupUse {
    pub(super) usage: Usage,
    /// Credit (µs of device time) at `credit_at`, for `MaxUtil`.
    pub(super) credit: i64,
    pub(super) credit_at: Micros,
    /// Start of the group's current period of activity on the device.
    pub(super) active_since: Micros,
    /// Since when none of the group's clients has held or asked for the
    /// token (a client gave it back); `None` while one does.
    pub(super) away_since: Option<Micros>,
    /// Smoothed length of the group's past absences (0: none seen yet).
    pub(super) away_avg: Micros,
    /// The short edge of its past absences: down to a shorter one at
    /// once, up by an eighth of the way to a longer one, so that most
    /// returns come after it (0: none seen yet).
    pub(super) away_short: Micros,
    /// Past absences longer than [`OWED_ABSENCE`] (pauses): left out of
    /// the span the group's share is taken over.
    pub(super) excused: Usage,
    /// Time a client of the group waited while `MaxUtil` held the group
    /// back (µs, closed periods), and since when it has now.
    pub(super) throttled: Micros,
    pub(super) throttled_since: Option<Micros>,
    /// Tokens revoked.
    pub(super) revocations: u64,
    /// Device time charged to the group since the scheduler started (µs).
    pub(super) used_total: Micros,
    /// What its programs' reports claimed, by user (µs, since the
    /// scheduler started; refunds are not taken from it).
    pub(super) used_by: std::collections::BTreeMap<Option<u32>, Micros>,
}

impl GroupUse {
    /// Credit at `now`, refilled at `max_util` per µs, capped at `cap`.
    pub(super) fn credit_now(&self, now: Micros, max_util: f64, cap: Micros) -> i64 {
        let earned = (now.saturating_sub(self.credit_at) as f64 * max_util) as i64;
        self.credit.saturating_add(earned).min(cap as i64)
    }

    /// When the group may next be granted the device (`None`: never).
    pub(super) fn eligible_at(&self, now: Micros, max_util: f64, cap: Micros) -> Option<Micros> {
        self.eligible_after(now, max_util, cap, None)
    }

    /// [`eligible_at`](Self::eligible_at) once a token granted at the
    /// first of `charge` is charged the second (µs) at `now`, as
    /// [`charge`](Self::charge) does.
    pub(super) fn eligible_after(
        &self,
        now: Micros,
        max_util: f64,
        cap: Micros,
        charge: Option<(Micros, Micros)>,
    ) -> Option<Micros> {
        if max_util <= 0.0 {
            return None;
        }
        if max_util >= 1.0 {
            return Some(now);
        }
        let c = match charge {
            Some((granted_at, used)) => self.charged(granted_at, now, used, max_util, cap),
            None => self.credit_now(now, max_util, cap),
        };
        if c >= 0 {
            Some(now)
        } else {
            Some(now.saturating_add(((-c) as f64 / max_util).ceil() as Micros))
        }
    }

    /// Charges `used` µs of a token granted at `granted_at`. Credit is
    /// capped as it stood at the grant; what was earned while the token was
    /// held counts in full, so a holder's own token time is never lost to
    /// the cap (with `MaxUtil` 1 the credit never goes negative).
    pub(super) fn charge(
        &mut self,
        granted_at: Micros,
        now: Micros,
        used: Micros,
        max_util: f64,
        cap: Micros,
    ) {
        self.used_total = self.used_total.saturating_add(used);
        self.credit = self.charged(granted_at, now, used, max_util, cap);
        self.credit_at = now;
    }

    /// The credit once `used` µs of a token granted at `granted_at` are
    /// charged at `now` (see [`charge`](Self::charge)).
    fn charged(
        &self,
        granted_at: Micros,
        now: Micros,
        used: Micros,
        max_util: f64,
        cap: Micros,
    ) -> i64 {
        let at_grant = self.credit_now(granted_at.max(self.credit_at), max_util, cap);
        let earned = (now.saturating_sub(granted_at.max(self.credit_at)) as f64 * max_util) as i64;
        at_grant
            .saturating_add(earned)
            .saturating_sub(used.min(i64::MAX as u64) as i64)
            .min(cap as i64)
    }

    /// Takes back the charge of `[start, end)`: it was another group's
    /// device time (see `ledger`).
    pub(super) fn refund(&mut self, start: Micros, end: Micros, cap: Micros) {
        self.usage.remove(start, end);
        let back = end.saturating_sub(start);
        self.used_total = self.used_total.saturating_sub(back);
        self.credit = self
            .credit
            .saturating_add(back.min(i64::MAX as u64) as i64)
            .min(cap as i64);
    }

    /// When the group, away from the device, is expected back: its usual
    /// absence after it left. `None` when that is not known, or long past
    /// (it is late by more than its usual absence and `late_by` more: it
    /// may not come back soon, and lending in short tokens would only cost
    /// round trips).
    pub(super) fn expected_back(&self, now: Micros, late_by: Micros) -> Option<Micros> {
        let since = self.away_since?;
        if self.away_avg == 0 {
            return None;
        }
        let back = since + self.away_avg;
        (now < back + self.away_avg + late_by).then_some(back)
    }

    /// When the group is back at the earliest, as its returns go (its
    /// short absence after it left); `None` as for
    /// [`expected_back`](Self::expected_back).
    pub(super) fn early_back(&self, now: Micros, late_by: Micros) -> Option<Micros> {
        self.expected_back(now, late_by)?;
        Some(self.away_since? + self.away_short)
    }

    /// Learns an absence of `away` µs.
    pub(super) fn learn_absence(&mut self, away: Micros) {
        self.away_avg = if self.away_avg == 0 {
            away
        } else {
            (self.away_avg + away) / 2
        };
        self.away_short = if self.away_short == 0 || away < self.away_short {
            away
        } else {
            self.away_short + (away - self.away_short) / 8
        };
    }

    /// Share of the time since the group became active (at most a window)
    /// that it used, leaving out its pauses (past ones and one going on:
    /// absences longer than [`OWED_ABSENCE`]).
    pub(super) fn share(&mut self, now: Micros, window: Micros) -> f64 {
        // Forgets what is older than the window (and the pauses older
        // than the span), then reads.
        self.usage.used(now, window);
        self.excused.used(now, self.span(now, window));
        self.share_as_of(now, window, 0)
    }

    /// The time its share is taken over: since it became active, at most
    /// a window (at least 1 µs).
    fn span(&self, now: Micros, window: Micros) -> Micros {
        now.saturating_sub(self.active_since)
            .clamp(1, window.max(1))
    }

    /// [`share`](Self::share) as of `now` with `more` µs used than
    /// recorded, forgetting nothing (`now` may be ahead of the policy's
    /// time: see `Policy::ranked_behind`).
    pub(super) fn share_as_of(&self, now: Micros, window: Micros, more: Micros) -> f64 {
        let used = self.usage.used_as_of(now, window).saturating_add(more);
        if used == 0 {
            return 0.0;
        }
        let span = self.span(now, window);
        let mut excused = self.excused.used_as_of(now, span);
        if let Some(since) = self.away_since
            && now.saturating_sub(since) > OWED_ABSENCE
        {
            excused += now - since.max(now.saturating_sub(span));
        }
        let counted = span.saturating_sub(excused).max(1);
        used as f64 / counted as f64
    }
}

/// Opens or closes the groups' throttled periods on `dev`: throttled
/// while a client waits and the group's `MaxUtil` credit holds it back.
/// `waiting`: the groups with a waiter on `dev`, with their limits.
pub(super) fn note_throttled(dev: &mut Device, waiting: &[Using], cap: Micros, now: Micros) {
    for (key, g) in dev.groups.iter_mut() {
        let waits = waiting.iter().find(|u| &u.key == key);
        // Neither waiting nor throttled: nothing opens or closes.
        if waits.is_none() && g.throttled_since.is_none() {
            continue;
        }
        let held_back =
            waits.is_some_and(|u| g.eligible_at(now, u.limits.max_util, cap) != Some(now));
        match (held_back, g.throttled_since) {
            (true, None) => g.throttled_since = Some(now),
            (false, Some(since)) => {
                g.throttled += now.saturating_sub(since);
                g.throttled_since = None;
            }
            _ => {}
        }
    }
}

/// A group with a waiter on a device, or using it (see
/// [`groups_using`]), as one decision there sees it: its limits are
/// looked up once for the decision.
#[derive(Debug, Clone)]
pub(super) struct Using {
    pub(super) key: GroupKey,
    pub(super) limits: Limits,
    /// A client of the group waits for the device's token.
    pub(super) waiting: bool,
}

/// The groups of `resource.conf` using `dev`: waiting for its token
/// (`waiting`), or active on it within the window and not paused (away for
/// longer than [`OWED_ABSENCE`]).
pub(super) fn groups_using(
    dev: &Device,
    waiting: impl Fn(&GroupKey) -> bool,
    now: Micros,
    window: Micros,
) -> Vec<&GroupKey> {
    dev.groups
        .iter()
        .filter(|(key, g)| {
            key.name().is_some()
                && (waiting(key)
                    || (g.usage.recent(now, window)
                        && g.away_since
                            .is_none_or(|s| now.saturating_sub(s) <= OWED_ABSENCE)))
        })
        .map(|(key, _)| key)
        .collect()
}
