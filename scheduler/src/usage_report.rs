//! `gem-schd report`: GPU time per group, user or GPU over a period, from
//! the accounting log (see [`crate::accounting`]).

use crate::accounting::{Record, events_path, files};
use serde::Serialize;
use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

/// What a report's rows are told apart by.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Key {
    /// The group.
    Group,
    /// The user.
    User,
    /// The GPU.
    Gpu,
}

impl std::str::FromStr for Key {
    type Err = String;
    fn from_str(s: &str) -> Result<Key, String> {
        match s {
            "group" => Ok(Key::Group),
            "user" => Ok(Key::User),
            "gpu" => Ok(Key::Gpu),
            _ => Err(format!("expected group, user or gpu, got {s:?}")),
        }
    }
}

impl Key {
    fn title(self) -> &'static str {
        match self {
            Key::Group => "GROUP",
            Key::User => "USER",
            Key::Gpu => "GPU",
        }
    }
}

/// A report's period and rows.
#[derive(Debug, Clone, PartialEq)]
pub struct Query {
    /// From (Unix s).
    pub since: f64,
    /// To (Unix s).
    pub until: f64,
    /// Rows by these, in this order (none: one row, the total).
    pub by: Vec<Key>,
}

/// One row.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Row {
    /// The row's group, user and GPU, as `by` asked.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub group: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub user: Option<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub gpu: Option<u32>,
    /// Device time, seconds.
    pub gpu_seconds: f64,
    /// Device time, hours.
    pub gpu_hours: f64,
    /// Programs that started in the period (one that said hello to two
    /// gem-schd, across a restart, counts once).
    pub programs: usize,
}

/// A row's group, user and GPU, as the query tells rows apart.
type RowKey = (Option<String>, Option<String>, Option<u32>);

/// The rows of a query, summed line by line (a log of hundreds of MiB is
/// never held whole).
#[derive(Debug)]
pub struct Summary<'q> {
    q: &'q Query,
    time: BTreeMap<RowKey, f64>,
    programs: BTreeMap<RowKey, BTreeSet<(u32, String, String)>>,
}

impl<'q> Summary<'q> {
    /// An empty summary of `q`.
    pub fn new(q: &'q Query) -> Summary<'q> {
        Summary {
            q,
            time: BTreeMap::new(),
            programs: BTreeMap::new(),
        }
    }

    fn key(&self, group: &str, user: &str, gpu: Option<u32>) -> RowKey {
        let by = &self.q.by;
        (
            by.contains(&Key::Group).then(|| group.to_string()),
            by.contains(&Key::User).then(|| user.to_string()),
            if by.contains(&Key::Gpu) { gpu } else { None },
        )
    }

    /// Adds one line. A usage line that straddles the period's bounds
    /// counts for the part inside it.
    pub fn add(&mut self, r: &Record) {
        let q = self.q;
        match r {
            Record::Usage {
                from,
                to,
                group,
                gpu,
                user,
                gpu_seconds,
                ..
            } => {
                let inside = (to.min(q.until) - from.max(q.since)).max(0.0);
                let part = if to > from {
                    inside / (to - from)
                } else if (q.since..q.until).contains(from) {
                    1.0
                } else {
                    0.0
                };
                if part > 0.0 && gpu_seconds.is_finite() {
                    let k = self.key(group, user, Some(*gpu));
                    *self.time.entry(k).or_default() += gpu_seconds * part;
                }
            }
            Record::ProgramStart {
                at,
                pid,
                user,
                group,
                ..
            } if (q.since..q.until).contains(at) && !q.by.contains(&Key::Gpu) => {
                let k = self.key(group, user, None);
                self.programs
                    .entry(k)
                    .or_default()
                    .insert((*pid, user.clone(), group.clone()));
            }
            _ => {}
        }
    }

    /// The rows, most GPU time first.
    pub fn rows(self) -> Vec<Row> {
        let keys: BTreeSet<RowKey> = self
            .time
            .keys()
            .chain(self.programs.keys())
            .cloned()
            .collect();
        let mut rows: Vec<Row> = keys
            .into_iter()
            .map(|k| {
                let s = self.time.get(&k).copied().unwrap_or(0.0);
                let n = self.programs.get(&k).map_or(0, BTreeSet::len);
                Row {
                    group: k.0,
                    user: k.1,
                    gpu: k.2,
                    gpu_seconds: s,
                    gpu_hours: s / 3600.0,
                    programs: n,
                }
            })
            .collect();
        rows.sort_by(|a, b| b.gpu_seconds.total_cmp(&a.gpu_seconds));
        rows
    }
}

/// The rows of `q` over `records`, most GPU time first.
pub fn summarize(records: &[Record], q: &Query) -> Vec<Row> {
    let mut s = Summary::new(q);
    for r in records {
        s.add(r);
    }
    s.rows()
}

/// The rows of `q` over the log at `path` (its usage files and its
/// events files, rotated ones included), read line by line, and how many
/// lines could not be read (a line torn by a crash, or written by a newer
/// gemini).
pub fn summarize_log(path: &Path, q: &Query) -> std::io::Result<(Vec<Row>, usize)> {
    use std::io::BufRead as _;
    let usage = files(path);
    if usage.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!(
                "{}: no accounting log there (gem-schd writes it where `accounting` in gemini.toml says; see docs/operation.md)",
                path.display()
            ),
        ));
    }
    let mut summary = Summary::new(q);
    let mut skipped = 0;
    for f in usage.into_iter().chain(files(&events_path(path))) {
        let file = std::fs::File::open(&f)
            .map_err(|e| std::io::Error::new(e.kind(), format!("{}: {e}", f.display())))?;
        for line in std::io::BufReader::new(file).split(b'\n') {
            let line = line?;
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            match serde_json::from_slice::<Record>(&line) {
                Ok(r) => summary.add(&r),
                Err(_) => skipped += 1,
            }
        }
    }
    Ok((summary.rows(), skipped))
}

/// `secs` as `1h 02m 03s`, `2m 03.4s` or `3.45s`.
fn duration(secs: f64) -> String {
    let whole = secs.max(0.0).floor() as u64;
    match whole {
        0..60 => format!("{secs:.2}s"),
        60..3600 => format!("{}m {:04.1}s", whole / 60, secs - (whole / 60 * 60) as f64),
        _ => format!(
            "{}h {:02}m {:02}s",
            whole / 3600,
            whole % 3600 / 60,
            whole % 60
        ),
    }
}

/// `t` (Unix s) as `2026-11-29 10:20:30 UTC`.
pub fn when(t: f64) -> String {
    let at = std::time::UNIX_EPOCH + std::time::Duration::from_secs_f64(t.max(0.0));
    humantime::format_rfc3339_seconds(at)
        .to_string()
        .replace('T', " ")
        .replace('Z', " UTC")
}

/// The report as a table.
pub fn render(rows: &[Row], q: &Query, log: &Path) -> String {
    let by: Vec<&str> =
        q.by.iter()
            .map(|k| match k {
                Key::Group => "group",
                Key::User => "user",
                Key::Gpu => "GPU",
            })
            .collect();
    let mut out = format!(
        "GPU time from {} to {}{} (from {})\n",
        when(q.since),
        when(q.until),
        if by.is_empty() {
            String::new()
        } else {
            format!(", by {}", by.join(" and "))
        },
        log.display()
    );
    let mut table: Vec<Vec<String>> = Vec::new();
    let mut head: Vec<String> = q.by.iter().map(|k| k.title().to_string()).collect();
    head.extend(["GPU TIME", "GPU-HOURS"].map(String::from));
    let programs = !q.by.contains(&Key::Gpu);
    if programs {
        head.push("PROGRAMS".into());
    }
    table.push(head);
    for r in rows {
        let mut line: Vec<String> =
            q.by.iter()
                .map(|k| match k {
                    Key::Group => r.group.clone().unwrap_or_default(),
                    Key::User => match r.user.as_deref() {
                        Some("") | None => "(unknown)".into(),
                        Some(u) => u.to_string(),
                    },
                    Key::Gpu => r.gpu.map_or_else(String::new, |g| g.to_string()),
                })
                .collect();
        line.push(duration(r.gpu_seconds));
        line.push(format!("{:.3}", r.gpu_hours));
        if programs {
            line.push(r.programs.to_string());
        }
        table.push(line);
    }
    if rows.is_empty() {
        out.push_str("no GPU time recorded in this period\n");
        return out;
    }
    let widths: Vec<usize> = (0..table[0].len())
        .map(|i| {
            table
                .iter()
                .map(|l| l[i].chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    let keys = q.by.len();
    for line in &table {
        let cells: Vec<String> = line
            .iter()
            .enumerate()
            .map(|(i, c)| {
                if i < keys {
                    format!("{c:<w$}", w = widths[i])
                } else {
                    format!("{c:>w$}", w = widths[i])
                }
            })
            .collect();
        out.push_str(cells.join("  ").trim_end());
        out.push('\n');
    }
    if !q.by.is_empty() {
        let total: f64 = rows.iter().map(|r| r.gpu_seconds).sum();
        out.push_str(&format!(
            "total: {} ({:.3} GPU-hours)\n",
            duration(total),
            total / 3600.0
        ));
    }
    out
}

/// The report as JSON: the period (Unix seconds and as text), what the
/// rows are by, the rows and the total. Durations are seconds.
pub fn json(rows: &[Row], q: &Query, log: &Path) -> serde_json::Value {
    serde_json::json!({
        "log": log.display().to_string(),
        "since": q.since,
        "until": q.until,
        "since_text": when(q.since),
        "until_text": when(q.until),
        "by": q.by,
        "rows": rows,
        "total_gpu_seconds": rows.iter().map(|r| r.gpu_seconds).sum::<f64>(),
    })
}

/// `--since`/`--until`: a duration before `now` (`7d`, `12h`), a date
/// (`2026-11-01`, midnight UTC) or a time (`2026-11-01 12:00:00`, UTC).
pub fn parse_time(text: &str, now: f64) -> Result<f64, String> {
    if let Ok(d) = gemini_protocol::units::parse_duration(text) {
        return Ok(now - d.as_secs_f64());
    }
    let full = if text.len() == 10 {
        format!("{text} 00:00:00")
    } else {
        text.trim_end_matches(" UTC").to_string()
    };
    humantime::parse_rfc3339_weak(&full)
        .map(|t| {
            t.duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        })
        .map_err(|_| {
            format!(
                "expected a duration before now (7d, 12h) or a UTC date or time (2026-11-01, 2026-11-01 12:00:00), got {text:?}"
            )
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn usage(from: f64, to: f64, group: &str, user: &str, gpu: u32, s: f64) -> Record {
        Record::Usage {
            from,
            to,
            group: group.into(),
            gpu,
            uid: Some(1),
            user: user.into(),
            gpu_seconds: s,
        }
    }

    fn start(at: f64, pid: u32, group: &str, user: &str) -> Record {
        Record::ProgramStart {
            at,
            pid,
            uid: Some(1),
            user: user.into(),
            group: group.into(),
        }
    }

    fn log() -> Vec<Record> {
        vec![
            usage(0.0, 60.0, "train", "alice", 0, 30.0),
            usage(0.0, 60.0, "train", "bob", 1, 10.0),
            usage(60.0, 120.0, "infer", "alice", 0, 6.0),
            start(10.0, 7, "train", "alice"),
            // The same program again, to a restarted gem-schd.
            start(70.0, 7, "train", "alice"),
            start(80.0, 8, "infer", "alice"),
        ]
    }

    fn q(since: f64, until: f64, by: &[Key]) -> Query {
        Query {
            since,
            until,
            by: by.to_vec(),
        }
    }

    #[test]
    fn rows_sum_by_what_is_asked_most_first() {
        let rows = summarize(&log(), &q(0.0, 200.0, &[Key::Group]));
        let got: Vec<(Option<&str>, f64, usize)> = rows
            .iter()
            .map(|r| (r.group.as_deref(), r.gpu_seconds, r.programs))
            .collect();
        assert_eq!(got, [(Some("train"), 40.0, 1), (Some("infer"), 6.0, 1)]);
        let rows = summarize(&log(), &q(0.0, 200.0, &[Key::User, Key::Gpu]));
        let got: Vec<(Option<&str>, Option<u32>, f64)> = rows
            .iter()
            .map(|r| (r.user.as_deref(), r.gpu, r.gpu_seconds))
            .collect();
        assert_eq!(
            got,
            [(Some("alice"), Some(0), 36.0), (Some("bob"), Some(1), 10.0)]
        );
    }

    #[test]
    fn a_line_across_the_periods_bound_counts_for_its_part_inside() {
        // 30 s to 90 s: half of each minute.
        let rows = summarize(&log(), &q(30.0, 90.0, &[Key::Group]));
        let got: Vec<(Option<&str>, f64)> = rows
            .iter()
            .map(|r| (r.group.as_deref(), r.gpu_seconds))
            .collect();
        assert_eq!(got, [(Some("train"), 20.0), (Some("infer"), 3.0)]);
    }

    #[test]
    fn the_table_names_the_period_and_totals() {
        let query = q(0.0, 200.0, &[Key::Group]);
        let text = render(&summarize(&log(), &query), &query, Path::new("/x/a.jsonl"));
        assert!(
            text.starts_with("GPU time from 1970-01-01 00:00:00 UTC to 1970-01-01 00:03:20 UTC, by group (from /x/a.jsonl)\n"),
            "{text}"
        );
        assert!(
            text.contains("\ntrain    40.00s      0.011         1\n"),
            "{text}"
        );
        assert!(
            text.ends_with("total: 46.00s (0.013 GPU-hours)\n"),
            "{text}"
        );
    }

    #[test]
    fn since_takes_a_duration_a_date_or_a_time() {
        assert_eq!(
            parse_time("7d", 1_000_000.0),
            Ok(1_000_000.0 - 7.0 * 86_400.0)
        );
        assert_eq!(parse_time("1970-01-02", 0.0), Ok(86_400.0));
        assert_eq!(parse_time("1970-01-01 01:00:00", 0.0), Ok(3600.0));
        assert!(
            parse_time("last week", 0.0)
                .unwrap_err()
                .contains("got \"last week\"")
        );
    }

    #[test]
    fn a_torn_line_is_skipped_and_counted_and_programs_come_from_the_events() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("a.jsonl");
        let line = |r: &Record| serde_json::to_string(r).unwrap();
        std::fs::write(&path, format!("{}\n{{\"event\":\"usa", line(&log()[0]))).unwrap();
        std::fs::write(events_path(&path), format!("{}\n", line(&log()[3]))).unwrap();
        let query = q(0.0, 200.0, &[Key::Group]);
        let (rows, skipped) = summarize_log(&path, &query).unwrap();
        assert_eq!(skipped, 1);
        assert_eq!(
            rows.iter()
                .map(|r| (r.gpu_seconds, r.programs))
                .collect::<Vec<_>>(),
            [(30.0, 1)]
        );
        let missing = summarize_log(&dir.path().join("none"), &query).unwrap_err();
        assert!(missing.to_string().contains("no accounting log"));
    }
}
