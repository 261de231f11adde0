//! What the gate learns from the program: the device time a launch takes
//! (from waits that proved the launches done, and from tokens' ends) and
//! how long the process stays quiet after its waits.

use super::*;

impl Gate {
    /// A launch came after a wait: learn how long the process was quiet.
    #[cold]
    pub(super) fn learn_gap(&self, now: u64, st: &State) {
        let exit = self.wait_exit.swap(0, Ordering::Relaxed);
        if exit == 0 {
            return;
        }
        if self.ahead_taken.swap(0, Ordering::AcqRel) != 0 {
            // The token asked ahead was there before this launch.
            super::ahead::learn(self, super::leads::rtt(st), 0, now);
        }
        let gap = now.saturating_sub(exit).min(gap_cap(st));
        self.gap_last.store(gap, Ordering::Relaxed);
        let avg = self.gap_avg.load(Ordering::Relaxed);
        self.gap_avg.store(lean_low(avg, gap), Ordering::Relaxed);
        self.begin_sample(now);
    }

    /// Starts a sample of the device time per launch at `now`, unless one
    /// is under way.
    pub(super) fn begin_sample(&self, now: u64) {
        if self.sample_start.load(Ordering::Relaxed) == 0 {
            self.sample_launches
                .store(self.launches(), Ordering::Relaxed);
            self.sample_blocked
                .store(self.blocked.load(Ordering::Relaxed), Ordering::Relaxed);
            self.sample_graphs.store(
                self.graph_launches.load(Ordering::Relaxed),
                Ordering::Relaxed,
            );
            self.sample_graph_ns
                .store(self.graph_ns.load(Ordering::Relaxed), Ordering::Relaxed);
            self.sample_stream
                .store(covers::NO_STREAM, Ordering::Relaxed);
            self.sample_start.store(now, Ordering::Relaxed);
        }
    }

    /// The device time per launch over the sample that began at `start`,
    /// up to `now` (`None`: no sample, or no launch in it). Graph launches
    /// of known cost are left out, with their time, and so is the time
    /// blocked for a token.
    fn per_launch_since(&self, start: u64, now: u64) -> Option<u64> {
        if start == 0 || now <= start {
            return None;
        }
        let since = |total: &AtomicU64, at: &AtomicU64| {
            total
                .load(Ordering::Relaxed)
                .saturating_sub(at.load(Ordering::Relaxed))
        };
        let graphs = since(&self.graph_launches, &self.sample_graphs);
        let graph_ns = since(&self.graph_ns, &self.sample_graph_ns);
        let n = self
            .launches()
            .saturating_sub(self.sample_launches.load(Ordering::Relaxed))
            .saturating_sub(graphs);
        if n == 0 {
            return None;
        }
        let blocked = since(&self.blocked, &self.sample_blocked);
        Some((now - start).saturating_sub(blocked + graph_ns) / n)
    }

    /// A wait returned with the work launched before it done and no other
    /// call in flight: learn the device time per launch from the launches
    /// since the sample began (the time blocked for a token left out).
    pub(super) fn learn_kernel(&self, now: u64) {
        let start = self.sample_start.swap(0, Ordering::Relaxed);
        let Some(sample) = self.per_launch_since(start, now) else {
            return;
        };
        // A lent token's bound leans short (too long an estimate leaves the
        // device idle); a token not lent leans long (too short one lets a
        // longer kernel queue past the token and past MaxUtil).
        fold(&self.kernel_ns, sample, lean_low);
        fold(&self.kernel_hi_ns, sample, lean_high);
    }

    /// A graph of known cost was launched: learn how long a replay takes
    /// (leaning long, as `kernel_hi_ns`), for the scheduler's holds.
    pub(super) fn learn_graph(&self, cost_ns: u64) {
        fold(&self.graph_long_ns, cost_ns, lean_high);
    }

    /// A token's end waited for its launches up to `now` and they were
    /// not done: each takes longer than the time since the sample began
    /// over their number. The estimates rise to that at once. Without it
    /// a program that never waits, with kernels longer than the wait's
    /// bound, was never measured: every token admitted the few launches
    /// of an unknown time on top of a queue that never drained (100 ms
    /// kernels: 2.5 s queued past its tokens after 4 s).
    pub(super) fn learn_kernel_at_least(&self, now: u64) {
        let start = self.sample_start.load(Ordering::Relaxed);
        let Some(floor) = self.per_launch_since(start, now) else {
            return;
        };
        self.kernel_ns.fetch_max(floor.max(1), Ordering::Relaxed);
        self.kernel_hi_ns.fetch_max(floor.max(1), Ordering::Relaxed);
    }
}

/// The longest quiet gap learned (ns): four idle thresholds. One that
/// long says only that the process stays away longer, not when it comes
/// back.
pub(super) fn gap_cap(st: &State) -> u64 {
    4 * st.settings.idle.as_nanos() as u64
}

/// Folds `sample` into the estimate in `slot` with `lean` (the first
/// sample is taken as it is; never 0, which means "not known").
fn fold(slot: &AtomicU64, sample: u64, lean: fn(u64, u64) -> u64) {
    let avg = slot.load(Ordering::Relaxed);
    let est = if avg == 0 { sample } else { lean(avg, sample) };
    slot.store(est.max(1), Ordering::Relaxed);
}

/// A smoothed estimate that follows a longer `sample` by half and a
/// shorter one by an eighth: longer kernels soon count in full, and one
/// sample stretched by a stall of the process (its CPU taken) does not
/// shrink the next tokens' queues at once.
fn lean_high(avg: u64, sample: u64) -> u64 {
    if sample >= avg {
        avg + (sample - avg) / 2
    } else {
        avg - (avg - sample) / 8
    }
}

/// A smoothed estimate that follows a shorter `sample` at once and a
/// longer one by an eighth: one outlier (a thread descheduled, a slow
/// wake-up) barely moves it, a lasting change soon does.
fn lean_low(avg: u64, sample: u64) -> u64 {
    if sample <= avg {
        sample
    } else {
        avg + (sample - avg) / 8
    }
}
