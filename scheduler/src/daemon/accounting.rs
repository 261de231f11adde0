//! Appends the accounting log (see [`crate::accounting`]): each group's
//! device time per GPU and user every [`EVERY`] and at the stop, the
//! programs' starts and ends, the reservations' starts and ends.

use crate::accounting::{KEPT, Record, rotated, unix_now};
use crate::policy::{GroupCounters, Micros, Program};
use std::collections::BTreeMap;
use std::io::Write as _;
use std::os::unix::fs::OpenOptionsExt as _;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tracing::warn;

/// How often the usage since the last lines is written: a crash (not a
/// stop) loses at most this much of it.
pub(super) const EVERY: Duration = Duration::from_secs(60);

/// A reservation as the log tells it apart: group, GPUs, since when (on
/// the scheduler's clock), uid, pid.
pub(super) type ReservationKey = (String, Vec<u32>, i64, Option<u32>, u32);

/// Program lines (starts and ends) one user gets written per [`EVERY`]:
/// a user who starts programs by the thousand (or connections that say
/// hello and leave) cannot rotate everybody's history out of the log.
/// The usage lines, from the ledger, are never left out.
pub(super) const PROGRAM_LINES_PER_USER: u32 = 240;

/// A group's charge on a GPU as last written, and each user's claims
/// (µs since gem-schd started).
type Written = (Micros, BTreeMap<Option<u32>, Micros>);

/// The log being appended to.
pub(super) struct Accounting {
    path: PathBuf,
    /// Bytes one file may take before it is rotated.
    file_max: u64,
    /// When the usage was last written (Unix s, and on the monotonic
    /// clock).
    since: f64,
    last_flush: Instant,
    /// Per (group, GPU): the group's charge, and each user's claims, as
    /// last written (µs since gem-schd started).
    written: BTreeMap<(String, u32), Written>,
    /// User names seen, by uid.
    names: BTreeMap<u32, String>,
    /// The reservations as last seen, with when each was made (Unix µs;
    /// `None`: not yet looked at).
    reservations: Option<BTreeMap<ReservationKey, u64>>,
    /// The last write's error, said once until the log works again.
    failing: Option<String>,
    /// When the gem-schd before this one stopped (Unix s), if it stopped
    /// cleanly: what its programs ran from then to this one's start is
    /// taken from their first reports (see [`Accounting::before_start`]).
    gap_from: Option<f64>,
    /// What programs reported of that gap, per (group, GPU, user) (µs),
    /// until the first usage lines.
    gap: BTreeMap<(String, u32, Option<u32>), Micros>,
    /// Per GPU, what was taken of the gap so far (µs): never more than
    /// the gap, whatever the reports say.
    gap_taken: BTreeMap<u32, Micros>,
    /// Program lines written per user since the period began, and those
    /// left out ([`PROGRAM_LINES_PER_USER`]).
    program_lines: BTreeMap<Option<u32>, u32>,
    left_out: u64,
}

impl Accounting {
    /// A log at `path` whose files take `max_size` bytes together at most.
    pub(super) fn new(path: PathBuf, max_size: u64) -> Accounting {
        let gap_from = last_stop(&path);
        let mut a = Accounting {
            path,
            file_max: (max_size / u64::from(KEPT + 1)).max(1),
            since: unix_now(),
            last_flush: Instant::now(),
            written: BTreeMap::new(),
            names: BTreeMap::new(),
            reservations: None,
            failing: None,
            gap_from,
            gap: BTreeMap::new(),
            gap_taken: BTreeMap::new(),
            program_lines: BTreeMap::new(),
            left_out: 0,
        };
        a.append(&[Record::Start {
            at: a.since,
            version: env!("CARGO_PKG_VERSION").into(),
        }]);
        a
    }

    /// Where the gap between the gem-schd before and this one starts, on
    /// the monotonic clock (µs) whose `epoch_us` is this one's start: no
    /// gap (`None`) after a crash, or once the first usage was written.
    pub(super) fn gap_start(&self, epoch_us: Micros) -> Option<Micros> {
        let from = self.gap_from?;
        let before = ((self.since - from).max(0.0) * 1e6) as Micros;
        Some(epoch_us.saturating_sub(before))
    }

    /// Program `p` reported `us` µs of work on `gpu` in the gap before
    /// this gem-schd started (after the one before stopped): neither
    /// scheduler's ledger has it. Bounded per GPU by the gap's length.
    pub(super) fn before_start(&mut self, p: &Program, gpu: u32, us: Micros, gap_us: Micros) {
        let taken = self.gap_taken.entry(gpu).or_default();
        let us = us.min(gap_us.saturating_sub(*taken));
        if us == 0 {
            return;
        }
        *taken += us;
        *self.gap.entry((p.group.clone(), gpu, p.uid)).or_default() += us;
    }

    /// Whether a program line of user `uid` may be written in this
    /// period ([`PROGRAM_LINES_PER_USER`]).
    fn program_line(&mut self, uid: Option<u32>) -> bool {
        let n = self.program_lines.entry(uid).or_default();
        if *n >= PROGRAM_LINES_PER_USER {
            self.left_out += 1;
            return false;
        }
        *n += 1;
        true
    }

    /// Program `p` said hello.
    pub(super) fn program_start(&mut self, p: &Program) {
        if let Some(uid) = p.uid
            && !p.user.is_empty()
            && self.names.len() < 65_536
        {
            self.names.insert(uid, p.user.clone());
        }
        if !self.program_line(p.uid) {
            return;
        }
        self.append(&[Record::ProgramStart {
            at: unix_now(),
            pid: p.pid,
            uid: p.uid,
            user: self.name(p.uid),
            group: p.group.clone(),
        }]);
    }

    /// Programs that ended.
    pub(super) fn programs_ended(&mut self, ended: &[Program]) {
        let at = unix_now();
        let ended: Vec<&Program> = ended.iter().filter(|p| self.program_line(p.uid)).collect();
        let lines: Vec<Record> = ended
            .iter()
            .map(|p| Record::ProgramEnd {
                at,
                pid: p.pid,
                uid: p.uid,
                user: self.name(p.uid),
                group: p.group.clone(),
                gpus: p.gpu_us.iter().map(|&(d, _)| d).collect(),
                gpu_seconds: p.gpu_us.iter().map(|&(_, t)| t).sum::<Micros>() as f64 / 1e6,
            })
            .collect();
        self.append(&lines);
    }

    /// The reservations now: those new and those gone since the last look
    /// are written (the first look only learns them: they were written by
    /// the gem-schd that made them).
    pub(super) fn reservations(&mut self, now: BTreeMap<ReservationKey, u64>) {
        let Some(before) = self.reservations.replace(now.clone()) else {
            return;
        };
        let at = unix_now();
        let line = |((group, gpus, _, uid, pid), since): (&ReservationKey, &u64), made: bool| {
            let (group, gpus, since, uid, pid) =
                (group.clone(), gpus.clone(), *since as f64 / 1e6, *uid, *pid);
            if made {
                Record::Reserve {
                    at,
                    since,
                    group,
                    gpus,
                    uid,
                    pid,
                }
            } else {
                Record::Release {
                    at,
                    since,
                    group,
                    gpus,
                    uid,
                    pid,
                }
            }
        };
        let mut lines: Vec<Record> = before
            .iter()
            .filter(|(k, _)| !now.contains_key(k))
            .map(|r| line(r, false))
            .collect();
        lines.extend(
            now.iter()
                .filter(|(k, _)| !before.contains_key(k))
                .map(|r| line(r, true)),
        );
        self.append(&lines);
    }

    /// [`EVERY`] has passed since the usage was last written.
    pub(super) fn due(&self) -> bool {
        self.last_flush.elapsed() >= EVERY
    }

    /// Writes the usage since the last time, if [`EVERY`] has passed
    /// (`force`: now, as at the stop).
    pub(super) fn usage(&mut self, counters: &[GroupCounters], force: bool) {
        if !force && !self.due() {
            return;
        }
        let (from, to) = (self.since, unix_now());
        let mut lines = self.gap_lines();
        lines.extend(self.usage_lines(counters, from, to));
        self.append(&lines);
        self.since = to;
        self.last_flush = Instant::now();
        self.program_lines.clear();
        if self.left_out > 0 {
            warn!(
                "accounting log: {} program start or end line(s) left out in the last period (over {PROGRAM_LINES_PER_USER} a user); the usage lines hold all GPU time",
                self.left_out
            );
            self.left_out = 0;
        }
    }

    /// gem-schd stops: the usage until now, and the stop.
    pub(super) fn stop(&mut self, counters: &[GroupCounters]) {
        self.usage(counters, true);
        self.append(&[Record::Stop { at: unix_now() }]);
    }

    /// The usage lines over `[from, to)`: each group's charge since the
    /// last lines, split among its users by their claims since then.
    fn usage_lines(&mut self, counters: &[GroupCounters], from: f64, to: f64) -> Vec<Record> {
        let mut lines = Vec::new();
        for c in counters {
            let (used, users) = self.written.entry((c.group.clone(), c.device)).or_default();
            // The ledger refunds time it charged a group for another's
            // work: taken out of the charges after it, as the metrics'
            // counter does.
            let delta = c.used_us.saturating_sub(*used);
            *used = (*used).max(c.used_us);
            let claims: Vec<(Option<u32>, Micros)> = c
                .by_user
                .iter()
                .map(|&(u, t)| (u, t.saturating_sub(users.get(&u).copied().unwrap_or(0))))
                .filter(|&(_, d)| d > 0)
                .collect();
            for &(u, t) in &c.by_user {
                users.insert(u, t);
            }
            if delta == 0 {
                continue;
            }
            let total: Micros = claims.iter().map(|&(_, d)| d).sum();
            let split: Vec<(Option<u32>, f64)> = if total == 0 {
                vec![(None, delta as f64)]
            } else {
                claims
                    .iter()
                    .map(|&(u, d)| (u, delta as f64 * d as f64 / total as f64))
                    .collect()
            };
            for (uid, us) in split {
                lines.push(Record::Usage {
                    from,
                    to,
                    group: c.group.clone(),
                    gpu: c.device,
                    uid,
                    user: self.name(uid),
                    gpu_seconds: us / 1e6,
                });
            }
        }
        lines
    }

    /// The usage of the gap before this gem-schd's start, once.
    fn gap_lines(&mut self) -> Vec<Record> {
        let Some(from) = self.gap_from.take() else {
            return Vec::new();
        };
        let gap = std::mem::take(&mut self.gap);
        gap.into_iter()
            .map(|((group, gpu, uid), us)| Record::Usage {
                from,
                to: from.max(self.since),
                group,
                gpu,
                uid,
                user: self.name(uid),
                gpu_seconds: us as f64 / 1e6,
            })
            .collect()
    }

    /// User `uid`'s name, as seen, else the uid as text.
    fn name(&self, uid: Option<u32>) -> String {
        match uid {
            Some(u) => self.names.get(&u).cloned().unwrap_or_else(|| u.to_string()),
            None => String::new(),
        }
    }

    /// Appends `lines`, rotating the file first where it is full. A
    /// failure is said once (until the log works again) and loses those
    /// lines, never the daemon.
    fn append(&mut self, lines: &[Record]) {
        if lines.is_empty() {
            return;
        }
        let mut text = String::new();
        for l in lines {
            if let Ok(s) = serde_json::to_string(l) {
                text.push_str(&s);
                text.push('\n');
            }
        }
        match self.write(text.as_bytes()) {
            Ok(()) => self.failing = None,
            Err(e) => {
                let e = e.to_string();
                if self.failing.as_ref() != Some(&e) {
                    warn!(
                        "accounting log {}: {e}; its lines are lost until it can be written",
                        self.path.display()
                    );
                    self.failing = Some(e);
                }
            }
        }
    }

    fn write(&self, bytes: &[u8]) -> std::io::Result<()> {
        if let Some(dir) = self.path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let size = std::fs::metadata(&self.path).map_or(0, |m| m.len());
        if size > 0 && size + bytes.len() as u64 > self.file_max {
            self.rotate()?;
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .open(&self.path)?;
        // One write of whole lines: a reader never sees half of one unless
        // the disk fills.
        f.write_all(bytes)
    }

    /// `FILE.6` → `FILE.7` … `FILE` → `FILE.1` (the oldest dropped).
    fn rotate(&self) -> std::io::Result<()> {
        for n in (1..KEPT).rev() {
            let from = rotated(&self.path, n);
            if from.exists() {
                std::fs::rename(&from, rotated(&self.path, n + 1))?;
            }
        }
        std::fs::rename(&self.path, rotated(&self.path, 1))
    }
}

/// When the gem-schd that last wrote to `path` stopped (Unix s): its
/// last line, if that is a stop (a crash leaves none).
fn last_stop(path: &std::path::Path) -> Option<f64> {
    use std::io::{Read as _, Seek as _};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(std::io::SeekFrom::Start(len.saturating_sub(4096)))
        .ok()?;
    let mut tail = String::new();
    f.read_to_string(&mut tail).ok()?;
    let last = tail.lines().rev().find(|l| !l.trim().is_empty())?;
    match serde_json::from_str(last).ok()? {
        Record::Stop { at } => Some(at),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counters(group: &str, used: Micros, by: &[(Option<u32>, Micros)]) -> GroupCounters {
        GroupCounters {
            group: group.into(),
            device: 0,
            throttled_us: 0,
            revocations: 0,
            used_us: used,
            by_user: by.to_vec(),
        }
    }

    fn read(path: &std::path::Path) -> Vec<Record> {
        std::fs::read_to_string(path)
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect()
    }

    fn usage(r: &[Record]) -> Vec<(Option<u32>, f64)> {
        r.iter()
            .filter_map(|r| match r {
                Record::Usage {
                    uid, gpu_seconds, ..
                } => Some((*uid, *gpu_seconds)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn a_groups_charge_is_split_among_its_users_by_their_claims() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut a = Accounting::new(path.clone(), 1 << 30);
        // The group was charged 3 s; alice's programs claimed 2 s, bob's 2 s
        // (a refund of 1 s to another group was taken from the group).
        a.usage(
            &[counters(
                "g",
                3_000_000,
                &[(Some(1), 2_000_000), (Some(2), 2_000_000)],
            )],
            true,
        );
        let r = read(&path);
        assert!(matches!(r[0], Record::Start { .. }));
        assert_eq!(usage(&r), [(Some(1), 1.5), (Some(2), 1.5)]);
        // Next period: only what came since, and a refund larger than the
        // charges since writes nothing (taken from the next charges).
        a.usage(
            &[counters(
                "g",
                4_000_000,
                &[(Some(1), 3_000_000), (Some(2), 2_000_000)],
            )],
            true,
        );
        a.usage(
            &[counters(
                "g",
                3_500_000,
                &[(Some(1), 3_000_000), (Some(2), 2_000_000)],
            )],
            true,
        );
        a.usage(
            &[counters(
                "g",
                4_500_000,
                &[(Some(1), 3_000_000), (Some(2), 3_000_000)],
            )],
            true,
        );
        assert_eq!(
            usage(&read(&path)),
            [
                (Some(1), 1.5),
                (Some(2), 1.5),
                (Some(1), 1.0),
                (Some(2), 0.5)
            ]
        );
    }

    #[test]
    fn the_gap_after_a_clean_stop_is_taken_from_reports_at_most_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        Accounting::new(path.clone(), 1 << 30).stop(&[]);
        let mut a = Accounting::new(path.clone(), 1 << 30);
        let start = a.gap_start(1_000_000_000).expect("stopped cleanly: a gap");
        assert!(start <= 1_000_000_000);
        let p = Program {
            client: 1,
            pid: 7,
            uid: Some(1),
            user: "alice".into(),
            group: "g".into(),
            gpu_us: vec![],
        };
        // Reports of 30 ms then 80 ms in a gap of 100 ms: 100 ms taken.
        a.before_start(&p, 0, 30_000, 100_000);
        a.before_start(&p, 0, 80_000, 100_000);
        a.usage(&[], true);
        assert_eq!(usage(&read(&path)), [(Some(1), 0.1)]);
        assert_eq!(a.gap_start(1_000_000_000), None, "the gap is written once");
        // After a crash (no stop last), no gap.
        drop(a);
        assert!(Accounting::new(path, 1 << 30).gap_start(1).is_none());
    }

    #[test]
    fn usage_waits_for_its_period_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut a = Accounting::new(path.clone(), 1 << 30);
        a.usage(&[counters("g", 1_000_000, &[(Some(1), 1_000_000)])], false);
        assert!(usage(&read(&path)).is_empty());
        a.stop(&[counters("g", 1_000_000, &[(Some(1), 1_000_000)])]);
        let r = read(&path);
        assert_eq!(usage(&r), [(Some(1), 1.0)]);
        assert!(matches!(r.last(), Some(Record::Stop { .. })));
    }

    #[test]
    fn a_full_file_is_rotated_and_the_oldest_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        // 8 files of 1 KiB at most.
        let mut a = Accounting::new(path.clone(), 8 << 10);
        let p = Program {
            client: 1,
            pid: 7,
            uid: Some(1),
            user: "alice".into(),
            group: "g".into(),
            gpu_us: vec![(0, 5)],
        };
        for _ in 0..400 {
            a.programs_ended(std::slice::from_ref(&p));
        }
        let files = crate::accounting::files(&path);
        assert_eq!(files.len(), KEPT as usize + 1, "{files:?}");
        for f in &files {
            let len = std::fs::metadata(f).unwrap().len();
            assert!(len <= 1 << 10, "{} is {len} bytes", f.display());
            // Whole lines only.
            assert!(!read(f).is_empty());
        }
    }

    #[test]
    fn a_user_gets_a_bounded_number_of_program_lines_a_period() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut a = Accounting::new(path.clone(), 1 << 30);
        let p = |uid| Program {
            client: 1,
            pid: 7,
            uid: Some(uid),
            user: String::new(),
            group: "g".into(),
            gpu_us: vec![],
        };
        for _ in 0..1000 {
            a.program_start(&p(1));
        }
        a.program_start(&p(2));
        let lines = || {
            read(&path)
                .iter()
                .filter(|r| matches!(r, Record::ProgramStart { .. }))
                .count()
        };
        assert_eq!(lines(), PROGRAM_LINES_PER_USER as usize + 1);
        // The next period, again.
        a.usage(&[], true);
        a.program_start(&p(1));
        assert_eq!(lines(), PROGRAM_LINES_PER_USER as usize + 2);
    }

    #[test]
    fn reservations_are_written_as_they_come_and_go_not_at_the_first_look() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut a = Accounting::new(path.clone(), 1 << 30);
        let r1: ReservationKey = ("g".into(), vec![0], 1_000_000, Some(1), 5);
        let r2: ReservationKey = ("h".into(), vec![1], 2_000_000, None, 0);
        a.reservations([(r1.clone(), 10)].into());
        // The same reservation with its Unix time a microsecond off is not
        // a new one.
        a.reservations([(r1.clone(), 11), (r2.clone(), 20)].into());
        a.reservations([(r2, 20)].into());
        let events: Vec<String> = read(&path)
            .iter()
            .map(|r| match r {
                Record::Reserve { group, .. } => format!("+{group}"),
                Record::Release { group, .. } => format!("-{group}"),
                _ => String::new(),
            })
            .filter(|s| !s.is_empty())
            .collect();
        assert_eq!(events, ["+h", "-g"]);
    }
}
