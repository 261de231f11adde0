//! The accounting log: what each group and user ran on which GPU, and the
//! programs and reservations behind it, as JSON lines gem-schd appends to
//! (`accounting` in gemini.toml) and `gem-schd report` reads.
//!
//! JSON lines rather than an embedded database: gem-schd only appends (a
//! few lines a minute), a reader needs nothing but a text editor or `jq`,
//! a crash can lose at most the line being written (a torn last line is
//! skipped), and rotation is a rename. A report reads every line of the
//! log and its rotated files, line by line: a full 2 GiB (the default
//! bound) takes tens of seconds, once.
//!
//! Times are seconds since the Unix epoch; durations are seconds.

use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// One line of the log.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "event", rename_all = "snake_case")]
pub enum Record {
    /// gem-schd started writing here.
    Start {
        /// When.
        at: f64,
        /// Its version.
        version: String,
    },
    /// gem-schd stopped (what ran until then is in the usage before).
    Stop {
        /// When.
        at: f64,
        /// When, on CLOCK_MONOTONIC (µs), of boot `boot`: where the gap
        /// to the next gem-schd's start begins.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        mono_us: Option<u64>,
        /// `/proc/sys/kernel/random/boot_id`.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        boot: Option<String>,
        /// The programs that held a GPU's token then, as `[pid, GPU,
        /// start time]` (the process's, in clock ticks since boot: a pid
        /// reused since is not theirs): what they ran after the stop is
        /// taken from their first reports to the next gem-schd.
        #[serde(default, skip_serializing_if = "Vec::is_empty")]
        holders: Vec<[u64; 3]>,
    },
    /// Device time a group's programs used on a GPU over `[from, to)`, by
    /// one user: the ledger's charge, split among the group's users in
    /// proportion to what their programs reported (exact for a group of
    /// one user).
    Usage {
        /// Start of the period.
        from: f64,
        /// End of the period.
        to: f64,
        /// The group (`(holder)`: gem-holder).
        group: String,
        /// The GPU.
        gpu: u32,
        /// The user's id (absent: peers the kernel could not name).
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        /// The user's name (the uid as text where unknown).
        user: String,
        /// Device time, seconds.
        gpu_seconds: f64,
    },
    /// A hooked program said hello.
    ProgramStart {
        /// When.
        at: f64,
        /// Its process.
        pid: u32,
        /// Its user's id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        /// Its user's name.
        user: String,
        /// Its group.
        group: String,
    },
    /// A hooked program ended (or its connection did).
    ProgramEnd {
        /// When.
        at: f64,
        /// Its process.
        pid: u32,
        /// Its user's id.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        /// Its user's name.
        user: String,
        /// Its group.
        group: String,
        /// The GPUs it used.
        gpus: Vec<u32>,
        /// Device time it used under this gem-schd, seconds.
        gpu_seconds: f64,
    },
    /// GPUs reserved for a group (`gem-launch --gpus`, `gem-launch
    /// reserve`).
    Reserve {
        /// When this gem-schd saw it.
        at: f64,
        /// When it was made.
        since: f64,
        /// Its group.
        group: String,
        /// The GPUs.
        gpus: Vec<u32>,
        /// Whose it is.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        /// The launch's process (0: made without a program).
        pid: u32,
    },
    /// A reservation ended.
    Release {
        /// When.
        at: f64,
        /// When it was made.
        since: f64,
        /// Its group.
        group: String,
        /// The GPUs.
        gpus: Vec<u32>,
        /// Whose it was.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        uid: Option<u32>,
        /// The launch's process (0: made without a program).
        pid: u32,
    },
}

/// Rotated files kept beside each of the log's two files (`FILE.1`,
/// newest, to `FILE.7`): each file takes at most a sixteenth of
/// `accounting_max_size`.
pub const KEPT: u32 = 7;

/// The log's files, oldest first: `FILE.7` … `FILE.1`, `FILE` (those that
/// exist).
pub fn files(path: &Path) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = (1..=KEPT).rev().map(|n| rotated(path, n)).collect();
    v.push(path.to_path_buf());
    v.retain(|p| p.exists());
    v
}

/// `FILE.n`.
pub fn rotated(path: &Path, n: u32) -> PathBuf {
    let mut s = path.as_os_str().to_owned();
    s.push(format!(".{n}"));
    PathBuf::from(s)
}

/// The events file beside the usage file `path`: `accounting.jsonl` →
/// `accounting.events.jsonl` (else `FILE.events`). Programs' and
/// reservations' lines go there, so that no user starting programs
/// without end can rotate the usage out.
pub fn events_path(path: &Path) -> PathBuf {
    let s = path.as_os_str().to_string_lossy();
    match s.strip_suffix(".jsonl") {
        Some(stem) => PathBuf::from(format!("{stem}.events.jsonl")),
        None => PathBuf::from(format!("{s}.events")),
    }
}

/// This boot's id (`/proc/sys/kernel/random/boot_id`): CLOCK_MONOTONIC
/// times compare only within one boot.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
}

/// Seconds since the Unix epoch, now.
pub fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_record_reads_back_as_written_with_its_event_named() {
        let r = Record::Usage {
            from: 1.0,
            to: 61.0,
            group: "train".into(),
            gpu: 1,
            uid: Some(1000),
            user: "alice".into(),
            gpu_seconds: 12.5,
        };
        let line = serde_json::to_string(&r).unwrap();
        assert!(line.starts_with(r#"{"event":"usage","#), "{line}");
        assert_eq!(serde_json::from_str::<Record>(&line).unwrap(), r);
    }

    #[test]
    fn the_files_come_oldest_first() {
        let dir = tempfile::tempdir().unwrap();
        let log = dir.path().join("a.jsonl");
        for p in [rotated(&log, 2), rotated(&log, 1), log.clone()] {
            std::fs::write(&p, "").unwrap();
        }
        assert_eq!(
            files(&log),
            vec![rotated(&log, 2), rotated(&log, 1), log.clone()]
        );
    }
}
