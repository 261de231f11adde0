//! Busy intervals in a sliding window, summed in O(1) amortised.

use super::Micros;
use std::collections::VecDeque;

/// Intervals of device time used, oldest first, adjacent ones merged.
#[derive(Debug, Default, Clone)]
pub struct Usage {
    records: VecDeque<(Micros, Micros)>,
    total: Micros,
}

impl Usage {
    /// Records `[start, end)`. Intervals that touch or overlap the newest
    /// record are merged into it (a back-to-back client keeps one record);
    /// a report that arrives late is merged the same way, which can only
    /// under-count overlap, never double-count it.
    pub fn add(&mut self, start: Micros, end: Micros) {
        if end <= start {
            return;
        }
        if let Some(last) = self.records.back_mut()
            && start <= last.1
        {
            let before = last.1 - last.0;
            last.0 = last.0.min(start);
            last.1 = last.1.max(end);
            self.total = self.total - before + (last.1 - last.0);
            return;
        }
        self.records.push_back((start, end));
        self.total += end - start;
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
}
