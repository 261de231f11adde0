//! One device's interval ledger: who the device's time was, as measured.
//!
//! Clients report the device time their work occupied as absolute
//! intervals ([`gemini_protocol::Span`]: from when their first work
//! could start to when their last was seen complete). Reports arrive
//! late and out of order, and two of them may claim the same time: work
//! queued behind another group's, or work that ran on into the next
//! group's token. Whose time an overlap was:
//! - Where one claim lies within the other, the inner one's: it began
//!   later and ended sooner, so its work ran there, in a slice the device
//!   gave its context while the other's work waited (a time-slicing GPU).
//!   A device that keeps launch order between contexts cannot run work
//!   queued later first: there the later claim ends after the earlier.
//! - Otherwise, the work's that began first: launch order ran it first,
//!   and a time-slicing device ran the later work in the overlap at most
//!   for a slice's part of it.
//!
//! - An estimate (what a process that died without reporting may have
//!   run, see `Policy::gone`) takes only time no measured claim has, now
//!   or when one is reported later: a measured claim takes its time from
//!   an estimate, whatever lies within what.
//!
//! The ledger keeps the claims of the last window, disjoint, and settles
//! each new one against them: the time it is charged, and the time
//! another group was charged before and is now refunded.

use super::{GroupKey, Micros};
use std::collections::{BTreeMap, VecDeque};

/// Time claimed by one group: `[start, end)`, of a claim of work
/// outstanding from `since` to `until` (what is left of it: other groups'
/// claims took the rest).
#[derive(Debug, Clone, PartialEq)]
struct Claim {
    start: Micros,
    end: Micros,
    since: Micros,
    until: Micros,
    /// The group, by its index in the ledger's names: a claim is made on
    /// every report, and a name cloned into each took a third of the
    /// daemon's memory under load.
    group: u32,
    /// An estimate, not a measurement (see the module doc).
    estimated: bool,
}

impl Claim {
    /// Whether the claim of work outstanding from `since` to `until`
    /// takes this one's time where they overlap (see the module doc).
    fn yields_to(&self, since: Micros, until: Micros) -> bool {
        let inner = self.since <= since && until <= self.until;
        let outer = since <= self.since && self.until <= until;
        !outer && (inner || since < self.since)
    }
}

/// What settling a claim changed.
#[derive(Debug, Default, PartialEq)]
pub(super) struct Settled {
    /// The pieces charged to the claiming group, oldest first.
    pub(super) charged: Vec<(Micros, Micros)>,
    /// Pieces another group was charged for before and no longer is.
    pub(super) refunded: Vec<(GroupKey, Micros, Micros)>,
}

/// The claims of one device, sorted and disjoint.
#[derive(Debug, Default)]
pub(super) struct Ledger {
    claims: VecDeque<Claim>,
    /// The groups that claimed time here, by index.
    names: Vec<GroupKey>,
    ids: BTreeMap<GroupKey, u32>,
}

impl Ledger {
    /// `group`'s index (its name cloned the first time only).
    fn id(&mut self, group: &GroupKey) -> u32 {
        if let Some(&id) = self.ids.get(group) {
            return id;
        }
        let id = self.names.len() as u32;
        self.names.push(group.clone());
        self.ids.insert(group.clone(), id);
        id
    }

    /// Settles `group`'s measured claim of `[start, end)` (see the module
    /// doc), of work outstanding since `since` (at or before `start`: work
    /// queued behind the group's own, reported apart from it).
    pub(super) fn claim(
        &mut self,
        group: &GroupKey,
        start: Micros,
        end: Micros,
        since: Micros,
    ) -> Settled {
        self.settle(group, start, end, since, false)
    }

    /// Settles `group`'s estimated claim of `[start, end)`: it is charged
    /// only time no measured claim has (see the module doc).
    pub(super) fn estimate(&mut self, group: &GroupKey, start: Micros, end: Micros) -> Settled {
        self.settle(group, start, end, start, true)
    }

    /// Settles `group`'s claim of `[start, end)`, of work outstanding
    /// since `since` (`estimated`: see the module doc), against the
    /// claims before it.
    fn settle(
        &mut self,
        group: &GroupKey,
        start: Micros,
        end: Micros,
        since: Micros,
        estimated: bool,
    ) -> Settled {
        let since = since.min(start);
        let group = self.id(group);
        if end <= start {
            return Settled::default();
        }
        let new = Claim {
            start,
            end,
            since,
            until: end,
            group,
            estimated,
        };
        match self.append(&new) {
            Some(settled) => settled,
            None => self.settle_overlap(new),
        }
    }

    /// The usual case: a claim after every claim (a back-to-back client
    /// extends its own), charged whole. `None` where `new` overlaps one.
    fn append(&mut self, new: &Claim) -> Option<Settled> {
        let mut out = Settled::default();
        match self.claims.back_mut() {
            Some(last) if last.end > new.start => return None,
            Some(last)
                if last.end == new.start
                    && last.group == new.group
                    && last.estimated == new.estimated =>
            {
                last.end = new.end;
                last.until = last.until.max(new.end);
            }
            _ => self.claims.push_back(new.clone()),
        }
        out.charged.push((new.start, new.end));
        Some(out)
    }

    /// Settles `new` against the claims it overlaps: where it is charged,
    /// and where another group is refunded (see the module doc).
    fn settle_overlap(&mut self, new: Claim) -> Settled {
        let (start, end) = (new.start, new.end);
        let mut out = Settled::default();
        let first = self.claims.partition_point(|c| c.end <= start);
        let last = self.claims.partition_point(|c| c.start < end);
        let old: Vec<Claim> = self.claims.drain(first..last).collect();
        let mut kept: Vec<Claim> = Vec::with_capacity(old.len() + 2);
        let mine = |s, e| Claim {
            start: s,
            end: e,
            ..new.clone()
        };
        let mut at = start;
        for c in old {
            // What lies before the claim is kept as it was.
            if c.start < start {
                kept.push(Claim {
                    end: start,
                    ..c.clone()
                });
            }
            // Time nobody claimed before this one: ours.
            if c.start > at {
                kept.push(mine(at, c.start));
                out.charged.push((at, c.start));
            }
            let (s, e) = (c.start.max(start), c.end.min(end));
            let takes = match (new.estimated, c.estimated) {
                (true, _) => false,
                (false, true) => true,
                (false, false) => c.yields_to(new.since, end),
            };
            if c.group == new.group || !takes {
                // Ours already, or the other work's (see the module doc).
                kept.push(Claim {
                    start: s,
                    end: e,
                    ..c.clone()
                });
            } else {
                // The overlap was ours.
                kept.push(mine(s, e));
                out.charged.push((s, e));
                out.refunded
                    .push((self.names[c.group as usize].clone(), s, e));
            }
            if c.end > end {
                kept.push(Claim { start: end, ..c });
            }
            at = e;
        }
        if at < end {
            kept.push(mine(at, end));
            out.charged.push((at, end));
        }
        self.put_back(first, kept);
        join_touching(&mut out.charged);
        out
    }

    /// Puts the claims `kept` (settled, in order) back at `first`, the
    /// neighbours of one group and one start joined.
    fn put_back(&mut self, first: usize, mut kept: Vec<Claim>) {
        kept.dedup_by(|b, a| {
            let join = a.end == b.start
                && a.group == b.group
                && a.since == b.since
                && a.until == b.until
                && a.estimated == b.estimated;
            if join {
                a.end = b.end;
            }
            join
        });
        for (i, c) in kept.into_iter().enumerate() {
            self.claims.insert(first + i, c);
        }
    }

    /// Forgets claims that end before `horizon`: a claim reported later
    /// than that is clipped to it.
    pub(super) fn forget_before(&mut self, horizon: Micros) {
        while self.claims.front().is_some_and(|c| c.end <= horizon) {
            self.claims.pop_front();
        }
    }
}

/// Joins pieces that touch (`[a, b)` and `[b, c)` become `[a, c)`).
fn join_touching(pieces: &mut Vec<(Micros, Micros)>) {
    pieces.dedup_by(|b, a| {
        let join = a.1 == b.0;
        if join {
            a.1 = b.1;
        }
        join
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn g(name: &str) -> GroupKey {
        GroupKey::Named(name.into())
    }

    #[test]
    fn claims_in_order_are_charged_whole() {
        let mut l = Ledger::default();
        assert_eq!(l.claim(&g("a"), 0, 10, 0).charged, [(0, 10)]);
        assert_eq!(l.claim(&g("a"), 10, 20, 10).charged, [(10, 20)]);
        assert_eq!(l.claim(&g("b"), 25, 30, 25).charged, [(25, 30)]);
        assert_eq!(l.claims.len(), 2);
    }

    /// Work queued behind another group's (launched at 5, run from 8): the
    /// work that began first had the overlap, whichever report came first.
    #[test]
    fn the_work_that_began_first_is_charged_the_overlap() {
        // The earlier work's report first.
        let mut l = Ledger::default();
        assert_eq!(l.claim(&g("a"), 0, 8, 0).charged, [(0, 8)]);
        let s = l.claim(&g("b"), 5, 12, 5);
        assert_eq!(s.charged, [(8, 12)]);
        assert!(s.refunded.is_empty());
        // The later work's report first: the earlier work's late report
        // takes the overlap back.
        let mut l = Ledger::default();
        assert_eq!(l.claim(&g("b"), 5, 12, 5).charged, [(5, 12)]);
        let s = l.claim(&g("a"), 0, 8, 0);
        assert_eq!(s.charged, [(0, 8)]);
        assert_eq!(s.refunded, [(g("b"), 5, 8)]);
        // A third claim that began between the two and ends after both
        // loses to both where they cover it: b's remaining claim still
        // began at 5.
        let s = l.claim(&g("c"), 6, 14, 6);
        assert_eq!(s.charged, [(12, 14)]);
        assert!(s.refunded.is_empty());
    }

    /// A claim within another's (a time-slicing device ran the later work
    /// in a slice while the earlier waited) takes its time from it; one
    /// that encloses another's leaves it its time.
    #[test]
    fn a_claim_within_another_is_charged_its_time() {
        let mut l = Ledger::default();
        l.claim(&g("train"), 0, 40, 0);
        let s = l.claim(&g("decode"), 20, 28, 20);
        assert_eq!(s.charged, [(20, 28)]);
        assert_eq!(s.refunded, [(g("train"), 20, 28)]);
        // Reported in the other order: the same.
        let mut l = Ledger::default();
        l.claim(&g("decode"), 20, 28, 20);
        let s = l.claim(&g("train"), 0, 40, 0);
        assert_eq!(s.charged, [(0, 20), (28, 40)]);
        assert!(s.refunded.is_empty());
    }

    #[test]
    fn a_group_is_never_charged_twice_for_its_own_time() {
        let mut l = Ledger::default();
        l.claim(&g("a"), 0, 10, 0);
        l.claim(&g("b"), 10, 20, 10);
        // a's own [5, 10) is not charged again; b's claim lies within
        // a's and keeps its time.
        let s = l.claim(&g("a"), 5, 25, 5);
        assert_eq!(s.charged, [(20, 25)]);
        assert!(s.refunded.is_empty());
        let s = l.claim(&g("a"), 0, 30, 0);
        assert_eq!(s.charged, [(25, 30)]);
        assert!(s.refunded.is_empty());
    }

    #[test]
    fn a_claim_inside_a_gap_is_charged_and_the_gap_split() {
        let mut l = Ledger::default();
        l.claim(&g("a"), 0, 10, 0);
        l.claim(&g("a"), 20, 30, 20);
        let s = l.claim(&g("b"), 12, 18, 12);
        assert_eq!(s.charged, [(12, 18)]);
        // b began at 12, before a's second claim: a's [20, 30) began later
        // and keeps only what b did not claim.
        let s = l.claim(&g("b"), 15, 25, 15);
        assert_eq!(s.charged, [(18, 25)]);
        assert_eq!(s.refunded, [(g("a"), 20, 25)]);
        let all: Vec<_> = l
            .claims
            .iter()
            .map(|c| (c.start, c.end, l.names[c.group as usize].clone()))
            .collect();
        assert_eq!(
            all,
            [
                (0, 10, g("a")),
                (12, 18, g("b")),
                (18, 25, g("b")),
                (25, 30, g("a"))
            ]
        );
    }

    /// Work queued behind the group's own and reported apart from it (a
    /// holder's kernel measured from its predecessor's end) is the
    /// group's from when it was queued: it keeps the overlap with work
    /// another group queued later.
    #[test]
    fn work_queued_behind_its_own_keeps_its_place() {
        let mut l = Ledger::default();
        // Kernel 1 from 0 to 10; kernel 2 queued at 1, ran 10 to 20.
        l.claim(&g("h"), 0, 10, 0);
        // A client launched at 5: its work ran from 20.
        let s = l.claim(&g("a"), 5, 40, 5);
        assert_eq!(s.charged, [(10, 40)]);
        let s = l.claim(&g("h"), 10, 20, 1);
        assert_eq!(s.charged, [(10, 20)]);
        assert_eq!(s.refunded, [(g("a"), 10, 20)]);
    }

    /// A process that died without reporting is charged an estimate of
    /// what it may have run; time another group's report measures is that
    /// group's, whether it came before the estimate or after it, and
    /// whatever lies within what.
    #[test]
    fn an_estimate_takes_only_time_no_measurement_has() {
        let mut l = Ledger::default();
        // b measured 10-40; the dead a is estimated 20-30 (inside it):
        // nothing of it is a's.
        l.claim(&g("b"), 10, 40, 10);
        let s = l.estimate(&g("a"), 20, 30);
        assert!(s.charged.is_empty() && s.refunded.is_empty(), "{s:?}");
        // Estimated first, 50-80; c then reports 60-70, inside it: c's,
        // and a refunded.
        assert_eq!(l.estimate(&g("a"), 50, 80).charged, [(50, 80)]);
        let s = l.claim(&g("c"), 60, 70, 60);
        assert_eq!(s.charged, [(60, 70)]);
        assert_eq!(s.refunded, [(g("a"), 60, 70)]);
        // One around both: the estimate's time is d's; c's, inside d's,
        // stays c's (the rule between measured claims).
        let s = l.claim(&g("d"), 45, 85, 45);
        assert_eq!(s.charged, [(45, 60), (70, 85)]);
        assert_eq!(s.refunded, [(g("a"), 50, 60), (g("a"), 70, 80)]);
    }

    #[test]
    fn old_claims_are_forgotten() {
        let mut l = Ledger::default();
        l.claim(&g("a"), 0, 10, 0);
        l.claim(&g("b"), 20, 30, 20);
        l.forget_before(15);
        assert_eq!(l.claims.len(), 1);
        l.forget_before(30);
        assert!(l.claims.is_empty());
    }
}
