//! What each group's kernels ran on the simulated device against what
//! the scheduler charged it: the check every test that runs workloads
//! passes (no kernel outside its group's charge).

use super::*;

impl Gemini {
    /// Stops the scheduler with SIGTERM, as systemd does, and waits for it
    /// (killed after 5 s). True if it stopped by itself.
    pub fn stop_scheduler(&mut self) -> bool {
        let Some(mut c) = self.schd.take() else {
            return false;
        };
        self.wait_for_the_dead_to_be_gone();
        // SAFETY: kill(2) on our own child's pid.
        unsafe { libc::kill(c.id() as i32, libc::SIGTERM) };
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = c.try_wait() {
                return true;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let _ = c.kill();
        let _ = c.wait();
        false
    }

    /// Waits (2 s at most) until the scheduler has seen every process
    /// that joined it and has exited go: a test that kills its workloads
    /// and ends at once stopped the scheduler before it charged the last
    /// one's work, whose kernels then counted as run and uncharged.
    fn wait_for_the_dead_to_be_gone(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(2);
        loop {
            let log = self.log();
            // (A restarted scheduler's accounts are not checked.)
            if log.matches(" listening on ").count() != 1 {
                return;
            }
            let gone = |pid: &str| log.contains(&format!("(pid {pid}) is gone"));
            let waiting = log
                .lines()
                .filter_map(|l| l.split(" joined: pid ").nth(1)?.split(',').next())
                .filter(|pid| !gone(pid))
                .filter_map(|pid| pid.trim().parse::<i32>().ok())
                // SAFETY: signal 0 only asks whether the process exists.
                .any(|pid| unsafe { libc::kill(pid, 0) } != 0);
            if !waiting || std::time::Instant::now() >= deadline {
                return;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
    }

    /// Per group and GPU: the device time the simulator ran the group's
    /// kernels (every process that joined the group, over the whole run),
    /// and the time the scheduler charged the group, both in ns. Read from
    /// the log of one scheduler run, which says what it charged as it
    /// stops (SIGTERM: [`Gemini::stop_scheduler`]), and from the busy log.
    /// `None` where that cannot be read: the scheduler still runs, was
    /// killed, or was restarted (its charges are split between runs, and a
    /// killed run says none).
    pub fn device_accounts(&self) -> Option<Vec<Account>> {
        let log = self.log();
        if self.schd.is_some()
            || log.matches(" listening on ").count() != 1
            || !log.contains("gem-schd stopping")
        {
            return None;
        }
        let mut group_of: HashMap<u32, String> = HashMap::new();
        let mut accounts: std::collections::BTreeMap<(String, u32), Account> = Default::default();
        for line in log.lines() {
            if let Some(rest) = line.split(" joined: pid ").nth(1)
                && let Some((pid, group)) = rest.split_once(", group ")
                && let Ok(pid) = pid.parse()
            {
                group_of.insert(pid, group.trim().trim_matches('"').to_string());
            }
            // `charged: group "a" device 0 12345 us`
            if let Some(rest) = line.split("charged: group ").nth(1)
                && let Some((group, rest)) = rest.rsplit_once(" device ")
                && let Some((dev, us)) = rest.trim_end_matches(" us").split_once(' ')
                && let (Ok(dev), Ok(us)) = (dev.parse::<u32>(), us.parse::<u64>())
            {
                let group = group.trim_matches('"').to_string();
                let a = accounts
                    .entry((group.clone(), dev))
                    .or_insert_with(|| Account::new(group, dev));
                a.charged_ns += us * 1000;
            }
        }
        // When the scheduler found each process gone (its pidfd): the real
        // driver tears a dead process's contexts down as it exits, and its
        // queued work never runs; the simulator drops it only when another
        // process looks at the device, which may be never (a killed
        // process's queued kernels then counted as run, uncharged).
        let offset = realtime_minus_monotonic();
        let gone: HashMap<u32, u64> = log
            .lines()
            .filter_map(|line| {
                let rest = line.split(" (pid ").nth(1)?;
                let (pid, rest) = rest.split_once(')')?;
                rest.starts_with(" is gone").then_some(())?;
                let at = unix_ns(line.split_whitespace().next()?)?;
                Some((pid.parse().ok()?, at.checked_sub(offset)?))
            })
            .collect();
        for dev in 0..self.sim.devices {
            for r in fakecuda_log::read(&self.sim.sim_dir(), dev).unwrap_or_default() {
                if let Some(group) = group_of.get(&r.pid) {
                    let a = accounts
                        .entry((group.clone(), dev))
                        .or_insert_with(|| Account::new(group.clone(), dev));
                    let end = gone.get(&r.pid).map_or(r.end, |&g| r.end.min(g));
                    a.ran_ns += end.saturating_sub(r.start);
                }
            }
        }
        Some(accounts.into_values().collect())
    }

    /// Where a group's kernels ran longer than it was charged, beyond
    /// [`ESCAPE_SLACK_NS`] and [`ESCAPE_SLACK`] of the charge: kernels that
    /// ran outside the group's tokens (see [`Gemini::device_accounts`]).
    pub fn escapes(&self) -> Option<Vec<String>> {
        Some(
            self.device_accounts()?
                .into_iter()
                .filter(|a| {
                    a.ran_ns
                        > a.charged_ns
                            + ESCAPE_SLACK_NS
                            + (a.charged_ns as f64 * ESCAPE_SLACK) as u64
                })
                .map(|a| {
                    format!(
                        "group {} on GPU {}: its kernels ran {:.1} ms, it was charged {:.1} ms",
                        a.group,
                        a.device,
                        a.ran_ns as f64 / 1e6,
                        a.charged_ns as f64 / 1e6
                    )
                })
                .collect(),
        )
    }
}

impl Gemini {
    /// `GEM_TEST_KEEP=DIR`: copies the simulated machine (the scheduler's
    /// log, the busy logs) into DIR, under the test's name, to read an
    /// intermittent failure after the test's directory is gone (every
    /// run's, with `GEM_TEST_KEEP_ALL=1`).
    fn keep_for_reading(&self) {
        let Some(keep) = std::env::var_os("GEM_TEST_KEEP") else {
            return;
        };
        let name = std::thread::current()
            .name()
            .unwrap_or("test")
            .replace("::", "-");
        let to = std::path::Path::new(&keep).join(format!("{name}-{}", now_ns()));
        let copied = std::fs::create_dir_all(&to).is_ok()
            && Command::new("cp")
                .arg("-r")
                .arg(self.sim.path())
                .arg(&to)
                .status()
                .is_ok_and(|s| s.success());
        eprintln!(
            "{} {}",
            if copied {
                "kept in"
            } else {
                "could not keep it in"
            },
            to.display()
        );
    }
}

/// `CLOCK_REALTIME` less `CLOCK_MONOTONIC`, in ns: turns the scheduler
/// log's wall-clock times into the busy log's.
fn realtime_minus_monotonic() -> u64 {
    let read = |clock| {
        let mut ts = libc::timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        // SAFETY: clock_gettime(2) writes the timespec we own.
        unsafe { libc::clock_gettime(clock, &mut ts) };
        ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
    };
    read(libc::CLOCK_REALTIME).saturating_sub(read(libc::CLOCK_MONOTONIC))
}

/// A log line's time, `2026-11-26T15:16:43.565541Z` (UTC), in ns since
/// the Unix epoch.
fn unix_ns(stamp: &str) -> Option<u64> {
    let t = humantime::parse_rfc3339(stamp).ok()?;
    u64::try_from(t.duration_since(std::time::UNIX_EPOCH).ok()?.as_nanos()).ok()
}

/// One group's device time on one GPU (see [`Gemini::device_accounts`]).
#[derive(Debug, Clone, PartialEq)]
pub struct Account {
    pub group: String,
    pub device: u32,
    /// What the simulator ran of the group's kernels.
    pub ran_ns: u64,
    /// What the scheduler charged the group.
    pub charged_ns: u64,
}

impl Account {
    fn new(group: String, device: u32) -> Account {
        Account {
            group,
            device,
            ran_ns: 0,
            charged_ns: 0,
        }
    }
}

/// What a group's kernels may run beyond what it was charged (see
/// [`Gemini::escapes`]): a fixed part, and a part of the charge.
pub const ESCAPE_SLACK_NS: u64 = 5_000_000;
pub const ESCAPE_SLACK: f64 = 0.005;

impl Drop for Gemini {
    /// Stops the scheduler and fails the test where a group's kernels ran
    /// outside its tokens and were not charged to it: the guarantee every
    /// test that runs workloads checks.
    fn drop(&mut self) {
        let stopped = self.stop_scheduler();
        // `GEM_TEST_ACCOUNTS=1`: every test says what each group ran and
        // was charged (with --nocapture), to see how near the check is.
        if std::env::var_os("GEM_TEST_ACCOUNTS").is_some() {
            eprintln!("accounts: {:?}", self.device_accounts());
        }
        // Read only where the check is made: not after a failure.
        let escapes = (stopped && !std::thread::panicking())
            .then(|| self.escapes())
            .flatten()
            .filter(|e| !e.is_empty());
        if std::env::var_os("GEM_TEST_KEEP_ALL").is_some() && escapes.is_none() {
            self.keep_for_reading();
        }
        if let Some(escapes) = escapes {
            self.keep_for_reading();
            // What gem-schd clipped, to tell a report it did not believe
            // from one that never came.
            let log = self.log();
            let clipped: Vec<&str> = log
                .lines()
                .filter(|l| l.contains("that cannot be"))
                .collect();
            panic!(
                "kernels ran outside their group's tokens, uncharged (beyond {} ms and {} % of the charge): {}; reports clipped: {}",
                ESCAPE_SLACK_NS / 1_000_000,
                ESCAPE_SLACK * 100.0,
                escapes.join("; "),
                if clipped.is_empty() {
                    "none".to_string()
                } else {
                    clipped.join("\n")
                }
            );
        }
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_log_stamp_is_read_as_unix_time() {
        // `date -u -d 2026-11-26T15:16:43Z +%s` = 1795706203.
        assert_eq!(
            super::unix_ns("2026-11-26T15:16:43.565541Z"),
            Some(1_795_706_203_565_541_000)
        );
        assert_eq!(super::unix_ns("1970-01-01T00:00:00Z"), Some(0));
        assert_eq!(super::unix_ns("not a time"), None);
    }
}
