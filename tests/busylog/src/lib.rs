//! The busy log of the driver simulator: every kernel the simulated device
//! runs, as `[start, end)` in `CLOCK_MONOTONIC` nanoseconds with the pid
//! that launched it, one file per device (`busy-<device>.log` in
//! `FAKECUDA_DIR`). It is the tests' ground truth for shares, independent
//! of the scheduler's own accounting.
//!
//! A record is 24 bytes, little endian: start u64, end u64, pid u32,
//! kind u32. Records are appended with one `write` on an `O_APPEND` file,
//! so concurrent processes never interleave inside a record. A kernel is
//! recorded when it is queued; a record of kind [`Kind::Gone`] later cuts
//! the work of a process that died before it ran. On a time-sliced
//! device (`FAKECUDA_TIMESLICE_US`) a kernel is recorded once it ran, one
//! record per uninterrupted piece of it.

#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod groups;

use std::collections::BTreeMap;
use std::io::Write as _;
use std::path::{Path, PathBuf};

/// Size of one record in bytes.
pub const RECORD: usize = 24;

/// What the device ran.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u32)]
pub enum Kind {
    /// A kernel launch.
    Kernel = 0,
    /// A graph launch.
    Graph = 1,
    /// A cooperative kernel launch.
    Cooperative = 2,
    /// Not work: the process `pid` was found dead at `start`, and the
    /// work it had queued from then on never ran (the driver drops a
    /// dead process's work). Readers ([`read`], [`read_tail`]) cut its
    /// earlier records there and leave this one out.
    Gone = 3,
    /// A collective kernel (NCCL's), spinning until its peer ranks start
    /// or running its own time: only on time-sliced devices, where it
    /// takes its slices as any kernel does.
    Collective = 4,
}

/// One busy interval.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Record {
    /// Start, ns on `CLOCK_MONOTONIC`.
    pub start: u64,
    /// End, ns on `CLOCK_MONOTONIC`.
    pub end: u64,
    /// Launching process.
    pub pid: u32,
    /// Raw kind (see [`Kind`]).
    pub kind: u32,
}

impl Record {
    /// Encodes the record.
    pub fn to_bytes(&self) -> [u8; RECORD] {
        let mut b = [0u8; RECORD];
        b[0..8].copy_from_slice(&self.start.to_le_bytes());
        b[8..16].copy_from_slice(&self.end.to_le_bytes());
        b[16..20].copy_from_slice(&self.pid.to_le_bytes());
        b[20..24].copy_from_slice(&self.kind.to_le_bytes());
        b
    }

    /// Decodes a record.
    pub fn from_bytes(b: &[u8; RECORD]) -> Record {
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |i: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[i..i + 4]);
            u32::from_le_bytes(a)
        };
        Record {
            start: u64_at(0),
            end: u64_at(8),
            pid: u32_at(16),
            kind: u32_at(20),
        }
    }
}

/// `CLOCK_MONOTONIC` now, in ns: the clock of the log, the same in every
/// process of the machine.
pub fn now_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Path of the log of `device` in `dir`.
pub fn log_path(dir: &Path, device: u32) -> PathBuf {
    dir.join(format!("busy-{device}.log"))
}

/// Appends one record.
pub fn append(dir: &Path, device: u32, rec: &Record) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(dir, device))?;
    f.write_all(&rec.to_bytes())
}

/// Appends `recs` in one write (records of one device, in time order).
pub fn append_many(dir: &Path, device: u32, recs: &[Record]) -> std::io::Result<()> {
    let mut f = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(log_path(dir, device))?;
    let bytes: Vec<u8> = recs.iter().flat_map(|r| r.to_bytes()).collect();
    f.write_all(&bytes)
}

/// The whole records in `bytes`, each process's work cut where a
/// [`Kind::Gone`] record after it says the process died.
fn decode_all(bytes: &[u8]) -> Vec<Record> {
    let records: Vec<Record> = bytes
        .chunks_exact(RECORD)
        .map(|c| {
            let mut a = [0u8; RECORD];
            a.copy_from_slice(c);
            Record::from_bytes(&a)
        })
        .collect();
    cut_at_death(records)
}

/// Applies the [`Kind::Gone`] records: a dead process's records before
/// one end at its time (those that would start later go), and the `Gone`
/// records go. Records after it (a new process of the same pid) stay.
fn cut_at_death(records: Vec<Record>) -> Vec<Record> {
    let gone = Kind::Gone as u32;
    // Per pid, its deaths in log order: (index, time).
    let mut deaths: BTreeMap<u32, Vec<(usize, u64)>> = BTreeMap::new();
    for (i, r) in records.iter().enumerate().filter(|(_, r)| r.kind == gone) {
        deaths.entry(r.pid).or_default().push((i, r.start));
    }
    if deaths.is_empty() {
        return records;
    }
    records
        .into_iter()
        .enumerate()
        .filter(|(_, r)| r.kind != gone)
        .filter_map(|(i, mut r)| {
            let death = deaths
                .get(&r.pid)
                .and_then(|d| d.iter().find(|&&(at, _)| at > i))
                .map(|&(_, t)| t);
            match death {
                Some(t) if r.start >= t => None,
                Some(t) => {
                    r.end = r.end.min(t);
                    Some(r)
                }
                None => Some(r),
            }
        })
        .collect()
}

/// Reads every record of `device` (missing log: none).
pub fn read(dir: &Path, device: u32) -> std::io::Result<Vec<Record>> {
    let bytes = match std::fs::read(log_path(dir, device)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    Ok(decode_all(&bytes))
}

/// Reads at most the last `max` records of `device` (for a recent window
/// without reading a long log whole).
pub fn read_tail(dir: &Path, device: u32, max: usize) -> std::io::Result<Vec<Record>> {
    use std::io::{Read as _, Seek as _, SeekFrom};
    let mut f = match std::fs::File::open(log_path(dir, device)) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(e),
    };
    let len = f.metadata()?.len();
    let whole = len - len % RECORD as u64;
    let start = whole.saturating_sub((max * RECORD) as u64);
    f.seek(SeekFrom::Start(start))?;
    let mut bytes = vec![0u8; (whole - start) as usize];
    f.read_exact(&mut bytes)?;
    Ok(decode_all(&bytes))
}

/// Busy time within `[from, to)` of each pid, and of the device as a whole
/// (overlapping intervals counted once), in ns.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Busy {
    /// Per launching pid.
    pub per_pid: BTreeMap<u32, u64>,
    /// The device: the union of all intervals.
    pub device: u64,
    /// Length of the interval.
    pub span: u64,
}

impl Busy {
    /// Share of the interval `pid` kept the device busy.
    pub fn share(&self, pid: u32) -> f64 {
        self.per_pid.get(&pid).copied().unwrap_or(0) as f64 / self.span.max(1) as f64
    }

    /// Share of the interval the device was busy.
    pub fn device_share(&self) -> f64 {
        self.device as f64 / self.span.max(1) as f64
    }

    /// Sum of the shares of `pids`.
    pub fn share_of(&self, pids: &[u32]) -> f64 {
        pids.iter().map(|p| self.share(*p)).sum()
    }
}

/// Busy figures over `[from, to)`.
pub fn busy(records: &[Record], from: u64, to: u64) -> Busy {
    let clip = |r: &Record| (r.start.max(from), r.end.min(to));
    let mut out = Busy {
        span: to.saturating_sub(from),
        ..Busy::default()
    };
    for r in records {
        let (s, e) = clip(r);
        if e > s {
            *out.per_pid.entry(r.pid).or_default() += e - s;
        }
    }
    out.device = covered(records.iter().map(|r| (r.start, r.end)), from, to);
    out
}

/// Length of `[from, to)` that the union of `spans` (`[start, end)` ns)
/// covers, overlaps counted once.
pub fn covered(spans: impl IntoIterator<Item = (u64, u64)>, from: u64, to: u64) -> u64 {
    let mut spans: Vec<(u64, u64)> = spans
        .into_iter()
        .map(|(s, e)| (s.max(from), e.min(to)))
        .filter(|(s, e)| e > s)
        .collect();
    spans.sort_unstable();
    let mut total = 0;
    let mut cur: Option<(u64, u64)> = None;
    for (s, e) in spans {
        match cur {
            Some((cs, ce)) if s <= ce => cur = Some((cs, ce.max(e))),
            Some((cs, ce)) => {
                total += ce - cs;
                cur = Some((s, e));
            }
            None => cur = Some((s, e)),
        }
    }
    total + cur.map_or(0, |(cs, ce)| ce - cs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_round_trip_through_a_file() {
        let dir = std::env::temp_dir().join(format!("busylog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let a = Record {
            start: 1,
            end: 5,
            pid: 7,
            kind: Kind::Graph as u32,
        };
        append(&dir, 3, &a).unwrap();
        append(
            &dir,
            3,
            &Record {
                start: 5,
                end: 9,
                pid: 8,
                kind: 0,
            },
        )
        .unwrap();
        let got = read(&dir, 3).unwrap();
        assert_eq!(got.len(), 2);
        assert_eq!(got[0], a);
        assert!(read(&dir, 4).unwrap().is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_dead_process_s_queued_work_is_cut_where_it_was_found_dead() {
        let r = |start, end, pid, kind: Kind| Record {
            start,
            end,
            pid,
            kind: kind as u32,
        };
        let got = cut_at_death(vec![
            r(0, 10, 1, Kind::Kernel),
            r(10, 20, 2, Kind::Kernel),
            r(20, 30, 1, Kind::Graph),
            r(30, 40, 1, Kind::Kernel),
            r(25, 25, 1, Kind::Gone),
            // A later process that got pid 1 again.
            r(50, 60, 1, Kind::Kernel),
        ]);
        assert_eq!(
            got,
            vec![
                r(0, 10, 1, Kind::Kernel),
                r(10, 20, 2, Kind::Kernel),
                r(20, 25, 1, Kind::Graph),
                r(50, 60, 1, Kind::Kernel),
            ]
        );
    }

    #[test]
    fn busy_clips_and_unions() {
        let r = |start, end, pid| Record {
            start,
            end,
            pid,
            kind: 0,
        };
        let recs = [r(0, 10, 1), r(5, 15, 2), r(20, 40, 1), r(90, 200, 2)];
        let b = busy(&recs, 0, 100);
        assert_eq!(b.per_pid[&1], 30);
        assert_eq!(b.per_pid[&2], 20);
        assert_eq!(b.device, 15 + 20 + 10);
        assert!((b.share(1) - 0.3).abs() < 1e-9);
        assert!((b.device_share() - 0.45).abs() < 1e-9);
    }

    #[test]
    fn covered_counts_overlaps_once_within_the_interval() {
        let spans = [(30, 50), (0, 10), (5, 20), (45, 60), (90, 200)];
        assert_eq!(covered(spans, 0, 100), 20 + 30 + 10);
        assert_eq!(covered(spans, 8, 55), 12 + 25);
        assert_eq!(covered([], 0, 100), 0);
    }
}
