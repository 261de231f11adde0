//! Busy intervals in a sliding window, summed in O(1) amortised.

use super::Micros;
use std::collections::VecDeque;

/// Intervals of device time used, sorted, disjoint, touching ones merged.
#[derive(Debug, Default, Clone)]
pub struct Usage {
    records: VecDeque<(Micros, Micros)>,
    total: Micros,
}

impl Usage {
    /// Records `[start, end)`. Time already recorded is not counted twice:
    /// a back-to-back client keeps one record, and a report that arrives
    /// late (older than the newest record) is merged where it belongs.
    pub fn add(&mut self, start: Micros, end: Micros) {
        if end <= start {
            return;
        }
        // The usual case: at or after the newest record.
        match self.records.back_mut() {
            None => {}
            Some(last) if start > last.1 => {}
            Some(last) if start >= last.0 => {
                if end > last.1 {
                    self.total += end - last.1;
                    last.1 = end;
                }
                return;
            }
            Some(_) => return self.merge(start, end),
        }
        self.records.push_back((start, end));
        self.total += end - start;
    }

    /// [`Usage::add`] of an interval that begins before the newest record.
    fn merge(&mut self, mut start: Micros, mut end: Micros) {
        // The records that touch or overlap `[start, end)`: from the first
        // that ends at or after `start` to the last that begins at or
        // before `end`.
        let first = self.records.partition_point(|r| r.1 < start);
        let last = self.records.partition_point(|r| r.0 <= end);
        for r in self.records.range(first..last) {
            self.total -= r.1 - r.0;
            start = start.min(r.0);
            end = end.max(r.1);
        }
        self.records.drain(first..last);
        self.records.insert(first, (start, end));
        self.total += end - start;
    }

    /// Forgets `[start, end)` (device time found to be another group's).
    /// Returns how much of it was recorded.
    pub fn remove(&mut self, start: Micros, end: Micros) -> Micros {
        if end <= start {
            return 0;
        }
        let first = self.records.partition_point(|r| r.1 <= start);
        let last = self.records.partition_point(|r| r.0 < end);
        let mut kept = Vec::new();
        let mut removed = 0;
        for &(s, e) in self.records.range(first..last) {
            removed += e.min(end) - s.max(start);
            if s < start {
                kept.push((s, start));
            }
            if e > end {
                kept.push((end, e));
            }
        }
        self.records.drain(first..last);
        for (i, r) in kept.into_iter().enumerate() {
            self.records.insert(first + i, r);
        }
        self.total -= removed;
        removed
    }

    /// How much of `[start, end)` is not recorded.
    pub fn unrecorded(&self, start: Micros, end: Micros) -> Micros {
        if end <= start {
            return 0;
        }
        let first = self.records.partition_point(|r| r.1 <= start);
        let covered: Micros = self
            .records
            .range(first..)
            .take_while(|r| r.0 < end)
            .map(|&(s, e)| e.min(end) - s.max(start))
            .sum();
        (end - start).saturating_sub(covered)
    }

    /// Time used within `[now - window, now]`; forgets older records.
    pub fn used(&mut self, now: Micros, window: Micros) -> Micros {
        let cutoff = now.saturating_sub(window);
        while let Some(&(s, e)) = self.records.front() {
            if e > cutoff {
                break;
            }
            self.records.pop_front();
            self.total -= e - s;
        }
        match self.records.front() {
            Some(&(s, _)) if s < cutoff => self.total - (cutoff - s),
            _ => self.total,
        }
    }

    /// [`used`](Self::used), forgetting nothing (`now` may be ahead of
    /// the last trim): the records older than the window are summed, not
    /// dropped.
    pub fn used_as_of(&self, now: Micros, window: Micros) -> Micros {
        let cutoff = now.saturating_sub(window);
        let first = self.records.partition_point(|r| r.1 <= cutoff);
        let old: Micros = self.records.range(..first).map(|r| r.1 - r.0).sum();
        let partial = match self.records.get(first) {
            Some(&(s, _)) if s < cutoff => cutoff - s,
            _ => 0,
        };
        self.total - old - partial
    }

    /// When the first time recorded within `[now - window, now]` began
    /// (forgets older records); `None` where there is none.
    pub fn first_within(&mut self, now: Micros, window: Micros) -> Option<Micros> {
        self.used(now, window);
        let cutoff = now.saturating_sub(window);
        self.records.front().map(|&(s, _)| s.max(cutoff))
    }

    /// Whether anything recorded ends within `[now - window, now]`
    /// (without trimming).
    pub fn recent(&self, now: Micros, window: Micros) -> bool {
        self.records
            .back()
            .is_some_and(|&(_, e)| e > now.saturating_sub(window))
    }

    /// True when nothing is recorded within the window (after trimming).
    pub fn is_empty(&mut self, now: Micros, window: Micros) -> bool {
        self.used(now, window) == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn used_as_of_reads_what_used_would_and_forgets_nothing() {
        let mut u = Usage::default();
        u.add(0, 100);
        u.add(200, 300);
        for now in [300, 1050, 1250, 5000] {
            let kept = u.records.len();
            let read = u.used_as_of(now, 1000);
            assert_eq!(u.records.len(), kept);
            assert_eq!(read, u.clone().used(now, 1000), "at {now}");
        }
    }

    #[test]
    fn unrecorded_is_what_no_record_covers() {
        let mut u = Usage::default();
        u.add(10, 20);
        u.add(30, 40);
        assert_eq!(u.unrecorded(0, 50), 30);
        assert_eq!(u.unrecorded(15, 35), 10);
        assert_eq!(u.unrecorded(12, 18), 0);
        assert_eq!(u.unrecorded(40, 30), 0);
        assert_eq!(Usage::default().unrecorded(5, 9), 4);
    }

    #[test]
    fn sums_within_window_and_clips_the_oldest() {
        let mut u = Usage::default();
        u.add(0, 100);
        u.add(200, 300);
        assert_eq!(u.used(300, 1000), 200);
        assert_eq!(u.used(1050, 1000), 250 - 200 + 100); // [50,100) + [200,300)
        assert_eq!(u.used(1250, 1000), 50); // [250,300)
        assert_eq!(u.used(5000, 1000), 0);
        assert!(u.records.is_empty());
    }

    #[test]
    fn merges_adjacent_and_late_intervals() {
        let mut u = Usage::default();
        u.add(0, 100);
        u.add(100, 200);
        u.add(50, 150); // late, overlapping
        assert_eq!(u.records.len(), 1);
        assert_eq!(u.used(200, 1000), 200);
        u.add(10, 10); // empty
        assert_eq!(u.used(200, 1000), 200);
    }

    /// A report older than the newest record is counted where it belongs:
    /// in full where nothing covered it, once where something did.
    #[test]
    fn a_late_report_between_records_is_counted_once() {
        let mut u = Usage::default();
        u.add(0, 100);
        u.add(500, 600);
        u.add(200, 300); // late, between the two
        assert_eq!(u.used(600, 1000), 300);
        u.add(50, 550); // covers all three and the gaps
        assert_eq!(u.records, [(0, 600)]);
        assert_eq!(u.used(600, 1000), 600);
        u.add(700, 800);
        u.add(650, 660);
        assert_eq!(u.records, [(0, 600), (650, 660), (700, 800)]);
        assert_eq!(u.used(800, 1000), 710);
    }

    #[test]
    fn removing_an_interval_splits_the_records_it_cuts() {
        let mut u = Usage::default();
        u.add(0, 100);
        u.add(200, 300);
        assert_eq!(u.remove(50, 250), 100);
        assert_eq!(u.records, [(0, 50), (250, 300)]);
        assert_eq!(u.used(300, 1000), 100);
        assert_eq!(u.remove(20, 30), 10);
        assert_eq!(u.records, [(0, 20), (30, 50), (250, 300)]);
        assert_eq!(u.remove(400, 500), 0);
        assert_eq!(u.remove(0, 1000), 90);
        assert_eq!(u.used(300, 1000), 0);
    }
}
