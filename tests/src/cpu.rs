//! Whether the machine gave the tests their CPU time.
//!
//! A virtual machine's vCPUs can be descheduled by its host: the kernel
//! counts that as *steal* time (`/proc/stat`). On an oversubscribed host a
//! 500 ms sleep can take 1.4 s, and no process can keep a device busy or
//! answer within milliseconds then. A test that measures timing runs its
//! measurement through [`unstarved`]: a measurement taken while the host
//! took more of the CPU time than the measurement tolerates (usually
//! [`MAX_STEAL`]) is void and is taken again.

use std::io::Write;
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

/// The most CPU time the host may take during a timing measurement that
/// counts, unless the test shows it tolerates more.
pub const MAX_STEAL: f64 = 0.10;

/// Cumulative CPU time of the whole machine, in clock ticks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CpuTimes {
    /// All time, steal included.
    pub total: u64,
    /// Time the host ran something else while a vCPU wanted to run.
    pub steal: u64,
}

impl CpuTimes {
    /// Now, from `/proc/stat` (zero where it cannot be read: never void).
    pub fn now() -> CpuTimes {
        let text = std::fs::read_to_string("/proc/stat").unwrap_or_default();
        CpuTimes::parse(&text).unwrap_or(CpuTimes { total: 0, steal: 0 })
    }

    /// The `cpu` line: user nice system idle iowait irq softirq steal ….
    /// Guest time is already counted in user and nice.
    pub fn parse(stat: &str) -> Option<CpuTimes> {
        let line = stat.lines().find(|l| l.starts_with("cpu "))?;
        let v: Vec<u64> = line
            .split_whitespace()
            .skip(1)
            .take(8)
            .map(|f| f.parse().ok())
            .collect::<Option<_>>()?;
        Some(CpuTimes {
            total: v.iter().sum(),
            steal: *v.get(7).unwrap_or(&0),
        })
    }

    /// Whether a measurement begun at `self` counts: the host took at most
    /// [`MAX_STEAL`] of the CPU time since. Said on stderr (past the test
    /// harness's capture) where not.
    pub fn counts(&self, what: &str) -> bool {
        let steal = CpuTimes::now().steal_since(self);
        if steal <= MAX_STEAL {
            return true;
        }
        let _ = writeln!(
            std::io::stderr(),
            "{what}: NOT MEASURED against its lower bound: the host took {:.0} % of the CPU time",
            steal * 100.0
        );
        false
    }

    /// Share of the time since `earlier` that the host took.
    pub fn steal_since(&self, earlier: &CpuTimes) -> f64 {
        let total = self.total.saturating_sub(earlier.total);
        if total == 0 {
            return 0.0;
        }
        self.steal.saturating_sub(earlier.steal) as f64 / total as f64
    }
}

static SERIAL: Mutex<()> = Mutex::new(());

/// Held by a test while it measures timing: such tests of one test binary
/// run one at a time, since two measuring together on a 2-core machine
/// would measure each other (each test binary has its own lock).
pub fn serial() -> MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|p| p.into_inner())
}

/// Runs `measure` until one run is not starved (the host took at most
/// `max_steal` of the CPU time; at most `tries` runs) and returns its
/// result; `None`, said on stderr, where every run was.
pub fn unstarved<T: std::fmt::Debug>(
    what: &str,
    max_steal: f64,
    tries: u32,
    measure: impl FnMut() -> T,
) -> Option<T> {
    match measured(what, max_steal, tries, measure) {
        (v, true) => Some(v),
        _ => None,
    }
}

/// Like [`unstarved`], but returns a result even where every run was
/// starved (the least starved), with whether it counts: a bound that
/// starving cannot break (a cap: a starved program only gets less) is
/// checked on it either way.
pub fn measured<T: std::fmt::Debug>(
    what: &str,
    max_steal: f64,
    tries: u32,
    measure: impl FnMut() -> T,
) -> (T, bool) {
    // Straight to the process's stderr, past the test harness's capture:
    // a measurement not taken must show in the log of a passing run.
    measured_saying(what, max_steal, tries, measure, |line| {
        let _ = writeln!(std::io::stderr(), "{line}");
    })
}

/// [`measured`], saying what it says through `say`.
fn measured_saying<T: std::fmt::Debug>(
    what: &str,
    max_steal: f64,
    tries: u32,
    measure: impl FnMut() -> T,
    mut say: impl FnMut(&str),
) -> (T, bool) {
    let (result, steal) = least_starved(max_steal, tries, measure, |attempt, steal, result| {
        say(&format!(
            "{what}: the host took {:.0} % of the CPU time (more than {:.0} %): \
             measurement {attempt} of {tries} ({result:.3?}) is void",
            steal * 100.0,
            max_steal * 100.0
        ));
    });
    if steal <= max_steal {
        return (result, true);
    }
    say(&format!(
        "{what}: NOT MEASURED: the host took more than {:.0} % of the CPU time in every attempt",
        max_steal * 100.0
    ));
    (result, false)
}

/// Runs `measure` until the host took at most `max_steal` of the CPU time
/// meanwhile (at most `tries` runs, at least one) and returns that result,
/// or else the least starved one, with the steal it was taken under.
/// `void` hears of each run that did not count.
pub fn least_starved<T>(
    max_steal: f64,
    tries: u32,
    mut measure: impl FnMut() -> T,
    mut void: impl FnMut(u32, f64, &T),
) -> (T, f64) {
    let mut best: Option<(T, f64)> = None;
    for attempt in 1..=tries.max(1) {
        let before = CpuTimes::now();
        let result = measure();
        let steal = CpuTimes::now().steal_since(&before);
        if steal <= max_steal {
            return (result, steal);
        }
        void(attempt, steal, &result);
        if best.as_ref().is_none_or(|(_, s)| steal < *s) {
            best = Some((result, steal));
        }
        if attempt < tries {
            std::thread::sleep(Duration::from_secs(1));
        }
    }
    best.expect("at least one run")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn steal_is_read_from_the_cpu_line() {
        let a = CpuTimes::parse("cpu  100 0 50 800 10 0 0 40 0 0\ncpu0 1 2 3\n").unwrap();
        assert_eq!(
            a,
            CpuTimes {
                total: 1000,
                steal: 40
            }
        );
        let b = CpuTimes::parse("cpu  200 0 100 1500 10 0 0 190 0 0\n").unwrap();
        assert!((b.steal_since(&a) - 0.15).abs() < 1e-9);
        assert_eq!(a.steal_since(&a), 0.0);
        assert_eq!(CpuTimes::parse("intr 1 2\n"), None);
    }

    #[test]
    fn a_starved_measurement_is_taken_again() {
        // No steal is too much: the first run counts.
        let mut runs = 0;
        let got = unstarved("test", 1.0, 3, || {
            runs += 1;
            runs
        });
        assert_eq!((got, runs), (Some(1), 1));
        // Any steal is too much (even none): every run is void, and that is
        // said (here to the test, not to the log of `make test`, where a
        // "NOT MEASURED" line would read as a failure).
        let mut runs = 0;
        let mut said = Vec::new();
        let (got, counts) = measured_saying(
            "test",
            -1.0,
            3,
            || {
                runs += 1;
                runs
            },
            |l| said.push(l.to_string()),
        );
        assert!(!counts && (1..=3).contains(&got) && runs == 3);
        assert_eq!(said.len(), 4, "{said:?}");
        assert!(said[3].starts_with("test: NOT MEASURED"), "{said:?}");
    }
}
