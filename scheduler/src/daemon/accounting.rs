//! Appends the accounting log (see [`crate::accounting`]): each group's
//! device time per GPU and user every [`EVERY`] and at the stop, in the
//! usage file; the programs' and reservations' starts and ends in the
//! events file beside it, at most [`EVENT_LINES_PER_USER`] a user each
//! period: a user who starts programs or reservations without end can
//! push events out, never the usage.

use super::saved::process_start_time;
use crate::accounting::{KEPT, Record, boot_id, events_path, rotated, unix_now};
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

/// Event lines (programs' and reservations' starts and ends) one user
/// gets written per [`EVERY`]: at about 130 bytes each, a user who starts
/// programs by the thousand fills the events' half of the default 2 GiB
/// in about three months, and the usage file not at all.
pub(super) const EVENT_LINES_PER_USER: u32 = 60;

/// A group's charge on a GPU as last written, and each user's claims
/// (µs since gem-schd started).
type Written = (Micros, BTreeMap<Option<u32>, Micros>);

/// The old gem-schd's stop, as the gap after it is told: when (Unix s
/// and, on this boot, CLOCK_MONOTONIC µs), and which programs held which
/// GPU's token then, as `[pid, GPU, process start time]`.
#[derive(Debug, Clone, PartialEq)]
struct Gap {
    at: f64,
    mono_us: Micros,
    holders: Vec<[u64; 3]>,
}

/// Whether program `pid` (its process started at `started`, in clock
/// ticks since boot) held `gpu`'s token at the stop.
fn held(g: &Gap, pid: u32, gpu: u32, started: Option<u64>) -> bool {
    started.is_some_and(|t| g.holders.contains(&[u64::from(pid), u64::from(gpu), t]))
}

/// The log being appended to.
pub(super) struct Accounting {
    path: PathBuf,
    events: PathBuf,
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
    /// The gem-schd before this one, if it stopped cleanly on this boot:
    /// what the programs that held its tokens ran from its stop to this
    /// one's start is taken from their first reports (see
    /// [`Accounting::before_start`]).
    gap_from: Option<Gap>,
    /// What they reported of that gap, per (group, GPU, user) (µs), until
    /// the first usage lines.
    gap: BTreeMap<(String, u32, Option<u32>), Micros>,
    /// Per (pid, GPU) of a holder, what was taken of the gap (µs, never
    /// more than the gap) and the end of the last span taken: a span
    /// reported again counts once.
    gap_taken: BTreeMap<[u32; 2], (Micros, Micros)>,
    /// Event lines written per user since the period began, and those
    /// left out ([`EVENT_LINES_PER_USER`]).
    event_lines: BTreeMap<Option<u32>, u32>,
    left_out: u64,
}

impl Accounting {
    /// A log at `path` whose files take `max_size` bytes together at most.
    pub(super) fn new(path: PathBuf, max_size: u64) -> Accounting {
        let gap_from = last_stop(&path);
        let mut a = Accounting {
            events: events_path(&path),
            path,
            // The usage and the events files, each with KEPT rotated ones.
            file_max: (max_size / 2 / u64::from(KEPT + 1)).max(1),
            since: unix_now(),
            last_flush: Instant::now(),
            written: BTreeMap::new(),
            names: BTreeMap::new(),
            reservations: None,
            failing: None,
            gap_from,
            gap: BTreeMap::new(),
            gap_taken: BTreeMap::new(),
            event_lines: BTreeMap::new(),
            left_out: 0,
        };
        a.append(&[Record::Start {
            at: a.since,
            version: env!("CARGO_PKG_VERSION").into(),
        }]);
        a
    }

    /// Where the gap between the gem-schd before and this one starts, on
    /// CLOCK_MONOTONIC (µs; this one started at `epoch_us`), if program
    /// `pid` held `gpu`'s token at that stop: no gap after a crash, after
    /// a reboot, for another program or GPU, or once the first usage was
    /// written.
    pub(super) fn gap_start(&self, pid: u32, gpu: u32, epoch_us: Micros) -> Option<Micros> {
        let g = self.gap_from.as_ref()?;
        (g.mono_us <= epoch_us && held(g, pid, gpu, process_start_time(pid))).then_some(g.mono_us)
    }

    /// Whether the gap before this gem-schd is still to be written (its
    /// first minute).
    pub(super) fn gap_open(&self) -> bool {
        self.gap_from.is_some()
    }

    /// Program `p` reported `spans` of work on `gpu` in the gap before
    /// this gem-schd started (clipped to it, in order): neither
    /// scheduler's ledger has it. Taken only from the programs that held
    /// the GPU's token at the stop ([`Accounting::gap_start`]), what was
    /// not taken from them before, at most the gap's length `gap_us`.
    pub(super) fn before_start(
        &mut self,
        p: &Program,
        gpu: u32,
        spans: &[(Micros, Micros)],
        gap_us: Micros,
    ) {
        let Some(g) = self.gap_from.as_ref() else {
            return;
        };
        if !held(g, p.pid, gpu, process_start_time(p.pid)) {
            return;
        }
        let (taken, reach) = self.gap_taken.entry([p.pid, gpu]).or_default();
        let mut us = 0;
        for &(b, e) in spans {
            let b = b.max(*reach);
            if e > b {
                us += e - b;
                *reach = e;
            }
        }
        // Programs of a group alone on the GPU held its token together
        // (see `policy::share`): their spans overlap, and the group is
        // given at most the gap, not each of them. (Not their union: the
        // gap is seconds long, once after a restart, and its reports
        // arrive in any order.)
        let group_taken: Micros = self
            .gap
            .iter()
            .filter(|((g, d, _), _)| *g == p.group && *d == gpu)
            .map(|(_, &us)| us)
            .sum();
        let us = us
            .min(gap_us.saturating_sub(*taken))
            .min(gap_us.saturating_sub(group_taken));
        if us == 0 {
            return;
        }
        *taken += us;
        *self.gap.entry((p.group.clone(), gpu, p.uid)).or_default() += us;
    }

    /// Whether an event line of user `uid` may be written in this period
    /// ([`EVENT_LINES_PER_USER`]).
    fn event_line(&mut self, uid: Option<u32>) -> bool {
        let n = self.event_lines.entry(uid).or_default();
        if *n >= EVENT_LINES_PER_USER {
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
        if !self.event_line(p.uid) {
            return;
        }
        self.append_events(&[Record::ProgramStart {
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
        let ended: Vec<&Program> = ended.iter().filter(|p| self.event_line(p.uid)).collect();
        let lines: Vec<Record> = ended
            .iter()
            .map(|p| Record::ProgramEnd {
                at,
                pid: p.pid,
                uid: p.uid,
                user: self.name(p.uid),
                group: p.group.clone(),
                gpus: p.gpu_us.iter().map(|&(d, _)| d).collect(),
                gpu_seconds: p
                    .gpu_us
                    .iter()
                    .map(|&(_, t)| t)
                    .fold(0, Micros::saturating_add) as f64
                    / 1e6,
            })
            .collect();
        self.append_events(&lines);
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
        let changed: Vec<(bool, (&ReservationKey, &u64))> = before
            .iter()
            .filter(|(k, _)| !now.contains_key(k))
            .map(|r| (false, r))
            .chain(
                now.iter()
                    .filter(|(k, _)| !before.contains_key(k))
                    .map(|r| (true, r)),
            )
            .collect();
        let mut lines = Vec::new();
        for (made, r) in changed {
            if self.event_line(r.0.3) {
                lines.push(line(r, made));
            }
        }
        self.append_events(&lines);
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
        self.event_lines.clear();
        if self.left_out > 0 {
            warn!(
                "accounting log: {} program or reservation line(s) left out in the last period (over {EVENT_LINES_PER_USER} a user); the usage lines hold all GPU time",
                self.left_out
            );
            self.left_out = 0;
        }
    }

    /// gem-schd stops: the usage until now, and the stop with the
    /// programs holding tokens (`holders`, as `(pid, GPU)`), at `mono_us`
    /// on CLOCK_MONOTONIC.
    pub(super) fn stop(
        &mut self,
        counters: &[GroupCounters],
        holders: Vec<[u64; 3]>,
        mono_us: Micros,
    ) {
        self.usage(counters, true);
        self.append(&[Record::Stop {
            at: unix_now(),
            mono_us: Some(mono_us),
            boot: boot_id(),
            holders,
        }]);
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
        let Some(g) = self.gap_from.take() else {
            return Vec::new();
        };
        let from = g.at;
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

    /// Appends `lines` to the usage file.
    fn append(&mut self, lines: &[Record]) {
        let path = self.path.clone();
        self.append_to(&path, lines);
    }

    /// Appends `lines` to the events file.
    fn append_events(&mut self, lines: &[Record]) {
        let path = self.events.clone();
        self.append_to(&path, lines);
    }

    /// Appends `lines` to `path`, rotating it first where it is full. A
    /// failure is said once (until the log works again) and loses those
    /// lines, never the daemon.
    fn append_to(&mut self, path: &std::path::Path, lines: &[Record]) {
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
        match self.write(path, text.as_bytes()) {
            Ok(()) => self.failing = None,
            Err(e) => {
                let e = e.to_string();
                if self.failing.as_ref() != Some(&e) {
                    warn!(
                        "accounting log {}: {e}; its lines are lost until it can be written",
                        path.display()
                    );
                    self.failing = Some(e);
                }
            }
        }
    }

    fn write(&self, path: &std::path::Path, bytes: &[u8]) -> std::io::Result<()> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)?;
        }
        let size = std::fs::symlink_metadata(path).map_or(0, |m| m.len());
        if size > 0 && size + bytes.len() as u64 > self.file_max {
            rotate(path)?;
        }
        // Never through a symbolic link someone put in its place.
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .mode(0o640)
            .custom_flags(libc::O_NOFOLLOW)
            .open(path)?;
        // One write of whole lines: a reader never sees half of one unless
        // the disk fills.
        f.write_all(bytes)
    }
}

/// `FILE.6` → `FILE.7` … `FILE` → `FILE.1` (the oldest dropped).
fn rotate(path: &std::path::Path) -> std::io::Result<()> {
    for n in (1..KEPT).rev() {
        let from = rotated(path, n);
        if from.exists() {
            std::fs::rename(&from, rotated(path, n + 1))?;
        }
    }
    std::fs::rename(path, rotated(path, 1))
}

/// The stop of the gem-schd that last wrote to `path`: its last line, if
/// that is a stop (a crash leaves none) made on this boot.
fn last_stop(path: &std::path::Path) -> Option<Gap> {
    use std::io::{Read as _, Seek as _};
    let mut f = std::fs::File::open(path).ok()?;
    let len = f.metadata().ok()?.len();
    f.seek(std::io::SeekFrom::Start(len.saturating_sub(8192)))
        .ok()?;
    let mut tail = Vec::new();
    f.read_to_end(&mut tail).ok()?;
    let tail = String::from_utf8_lossy(&tail);
    let last = tail.lines().rev().find(|l| !l.trim().is_empty())?;
    match serde_json::from_str(last).ok()? {
        Record::Stop {
            at,
            mono_us: Some(mono_us),
            boot: Some(boot),
            holders,
        } if Some(&boot) == boot_id().as_ref() => Some(Gap {
            at,
            mono_us,
            holders,
        }),
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

    /// Program `pid` of user alice (uid 1), group g.
    fn alice(pid: u32) -> Program {
        Program {
            client: 1,
            pid,
            uid: Some(1),
            user: "alice".into(),
            group: "g".into(),
            gpu_us: vec![],
        }
    }

    #[test]
    fn the_gap_after_a_clean_stop_is_taken_from_its_token_holders_at_most_its_length() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        // This process held GPU 0's token at the stop, at 900 ms; a pid of
        // the same number started at another time is not it.
        let me = std::process::id();
        let started = process_start_time(me).unwrap();
        let holders = vec![[u64::from(me), 0, started], [1, 0, 12345]];
        Accounting::new(path.clone(), 1 << 30).stop(&[], holders, 900_000);
        let mut a = Accounting::new(path.clone(), 1 << 30);
        assert!(a.gap_open());
        assert_eq!(a.gap_start(me, 0, 1_000_000), Some(900_000));
        assert_eq!(a.gap_start(me, 1, 1_000_000), None, "another GPU");
        assert_eq!(a.gap_start(1, 0, 1_000_000), None, "a pid reused");
        // 30 ms, the same 30 ms said again, then 80 ms more, in a gap of
        // 100 ms: 100 ms taken; another program's report, none.
        a.before_start(&alice(me), 0, &[(900_000, 930_000)], 100_000);
        a.before_start(&alice(me), 0, &[(900_000, 930_000)], 100_000);
        a.before_start(&alice(me), 0, &[(920_000, 1_000_000)], 100_000);
        a.before_start(&alice(1), 0, &[(900_000, 980_000)], 100_000);
        a.usage(&[], true);
        assert_eq!(usage(&read(&path)), [(Some(1), 0.1)]);
        assert!(!a.gap_open(), "the gap is written once");
        // After a crash (no stop last), no gap.
        drop(a);
        assert!(!Accounting::new(path, 1 << 30).gap_open());
    }

    /// Two programs of one group that held the GPU's token together at
    /// the stop report overlapping work in the gap: the group is given
    /// the gap at most, not each program up to it.
    #[test]
    fn programs_holding_a_token_together_take_the_gap_at_most_once() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut child = std::process::Command::new("sleep")
            .arg("5")
            .spawn()
            .unwrap();
        let pids = [std::process::id(), child.id()];
        let holders = pids
            .iter()
            .map(|&pid| [u64::from(pid), 0, process_start_time(pid).unwrap()])
            .collect();
        Accounting::new(path.clone(), 1 << 30).stop(&[], holders, 900_000);
        let mut a = Accounting::new(path.clone(), 1 << 30);
        // 60 ms each, overlapping, in a gap of 100 ms: capped at 100 (an
        // overlap within the cap counts twice; see `before_start`).
        a.before_start(&alice(pids[0]), 0, &[(900_000, 960_000)], 100_000);
        a.before_start(&alice(pids[1]), 0, &[(940_000, 1_000_000)], 100_000);
        a.usage(&[], true);
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(usage(&read(&path)), [(Some(1), 0.1)]);
    }

    #[test]
    fn usage_waits_for_its_period_unless_forced() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        let mut a = Accounting::new(path.clone(), 1 << 30);
        a.usage(&[counters("g", 1_000_000, &[(Some(1), 1_000_000)])], false);
        assert!(usage(&read(&path)).is_empty());
        a.stop(
            &[counters("g", 1_000_000, &[(Some(1), 1_000_000)])],
            vec![],
            0,
        );
        let r = read(&path);
        assert_eq!(usage(&r), [(Some(1), 1.0)]);
        assert!(matches!(r.last(), Some(Record::Stop { .. })));
    }

    #[test]
    fn a_full_file_is_rotated_and_the_oldest_dropped() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("log");
        // The events' 8 files of 512 bytes at most (half of 8 KiB).
        let mut a = Accounting::new(path.clone(), 8 << 10);
        let p = Program {
            client: 1,
            pid: 7,
            uid: Some(1),
            user: "alice".into(),
            group: "g".into(),
            gpu_us: vec![(0, 5)],
        };
        for _ in 0..EVENT_LINES_PER_USER {
            a.programs_ended(std::slice::from_ref(&p));
        }
        let files = crate::accounting::files(&events_path(&path));
        assert_eq!(files.len(), KEPT as usize + 1, "{files:?}");
        for f in &files {
            let len = std::fs::metadata(f).unwrap().len();
            assert!(len <= 512, "{} is {len} bytes", f.display());
            // Whole lines only.
            assert!(!read(f).is_empty());
        }
        // The usage file is another: it holds its start line still.
        assert!(matches!(read(&path)[..], [Record::Start { .. }]));
    }

    #[test]
    fn a_user_gets_a_bounded_number_of_event_lines_a_period() {
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
        a.reservations(BTreeMap::new());
        for _ in 0..1000 {
            a.program_start(&p(1));
        }
        a.program_start(&p(2));
        // Reservations count against the same budget.
        let reserved = |uid: u32| -> BTreeMap<ReservationKey, u64> {
            [(("g".to_string(), vec![0], 1, Some(uid), 0), 1)].into()
        };
        a.reservations(reserved(1));
        a.reservations(reserved(2));
        let events = || read(&events_path(&path));
        let count = |f: &dyn Fn(&Record) -> bool| events().iter().filter(|r| f(r)).count();
        let starts = |r: &Record| matches!(r, Record::ProgramStart { .. });
        assert_eq!(count(&starts), EVENT_LINES_PER_USER as usize + 1);
        let of = |uid| move |r: &Record| matches!(r, Record::Reserve { uid: u, .. } | Record::Release { uid: u, .. } if *u == Some(uid));
        // (1 made one, left out; it went as 2 made one: left out too.)
        assert_eq!((count(&of(1)), count(&of(2))), (0, 1), "{:?}", events());
        // The next period, again.
        a.usage(&[], true);
        a.program_start(&p(1));
        assert_eq!(count(&starts), EVENT_LINES_PER_USER as usize + 2);
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
        let events: Vec<String> = read(&events_path(&path))
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
