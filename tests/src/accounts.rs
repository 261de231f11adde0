//! What each group's kernels ran on the simulated device against what
//! the scheduler charged it: the check every test that runs workloads
//! passes (no kernel outside its group's tokens, issue 35).

use super::*;

impl Gemini {
    /// Stops the scheduler with SIGTERM, as systemd does, and waits for it
    /// (killed after 5 s). True if it stopped by itself.
    pub fn stop_scheduler(&mut self) -> bool {
        let Some(mut c) = self.schd.take() else {
            return false;
        };
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
        for dev in 0..self.sim.devices {
            for r in fakecuda_log::read(&self.sim.sim_dir(), dev).unwrap_or_default() {
                if let Some(group) = group_of.get(&r.pid) {
                    let a = accounts
                        .entry((group.clone(), dev))
                        .or_insert_with(|| Account::new(group.clone(), dev));
                    a.ran_ns += r.end.saturating_sub(r.start);
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
pub const ESCAPE_SLACK_NS: u64 = 20_000_000;
pub const ESCAPE_SLACK: f64 = 0.02;

impl Drop for Gemini {
    /// Stops the scheduler and fails the test where a group's kernels ran
    /// outside its tokens and were not charged to it: the guarantee every
    /// test that runs workloads checks (issue 35).
    fn drop(&mut self) {
        let stopped = self.stop_scheduler();
        if stopped
            && !std::thread::panicking()
            && let Some(escapes) = self.escapes()
            && !escapes.is_empty()
        {
            panic!(
                "kernels ran outside their group's tokens, uncharged (beyond {} ms and {} % of the charge): {}",
                ESCAPE_SLACK_NS / 1_000_000,
                ESCAPE_SLACK * 100.0,
                escapes.join("; ")
            );
        }
    }
}
