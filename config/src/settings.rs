//! `gemini.toml`: the daemon's own settings. Every field is optional in the
//! file and can also be given as a flag (flags win).
//!
//! ```toml
//! config = "/etc/gemini/resource.conf"
//! ipc_dir = "/tmp/gemini/ipc"
//! window = "10s"        # accounting window for shares
//! base_quota = "30ms"   # token length before a burst has been observed
//! min_quota = "10ms"    # shortest token
//! max_quota = "100ms"   # longest token
//! token_grace = "1s"    # how long past its end a token may be kept (draining queued work) before it is revoked
//! log_level = "info"    # error, warn, info, debug, trace
//! ipc_group = "gemini"  # let members of this Unix group connect (dir 0750, socket 0770); default: only the daemon's user
//! devices = 8           # GPUs gem-launch may reserve (default: as many as /proc/driver/nvidia/gpus lists)
//! metrics = "127.0.0.1:9400"  # serve Prometheus metrics at http://ADDR/metrics (default: off)
//! reserve_max_duration = "1d"  # longest `gem-launch reserve --duration` a user may ask (root and the daemon's user: 30d)
//! reserve_max_gpus = 4  # most GPUs one user may hold reserved at once (default: half the GPUs, at least 1)
//! allow_unverified_peers = false  # serve peers whose credentials the kernel cannot give (tests only)
//! accounting = "/var/lib/gemini/accounting.jsonl"  # the usage log `gem-schd report` reads ("off": none; default: $STATE_DIRECTORY, else beside the socket)
//! accounting_max_size = "2GiB"  # the log and its rotated files together, at most
//!
//! [slurm]                # gem-slurm, the Slurm prolog, epilog and task prolog
//! max_util = 1.0         # MaxUtil of a job's group (default 1: a job may use what others leave)
//! shards_per_gpu = 10    # shards of one GPU (default: the node's shards / GPUs, from scontrol)
//! gpu_memory = "80GiB"   # memory of one GPU (default: from NVML)
//! hook = "/usr/local/lib/libgemhook.so"  # what the task prolog preloads
//! ```

use serde::Deserialize;
use std::path::{Path, PathBuf};
use std::time::Duration;

/// Default `resource.conf`.
pub const DEFAULT_CONFIG: &str = "/etc/gemini/resource.conf";

/// The file as written: everything optional, durations as text.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawSettings {
    /// Path of `resource.conf`.
    pub config: Option<PathBuf>,
    /// IPC directory: read by every part through
    /// `gemini_protocol::endpoint::locate_ipc_dir`, not validated here.
    pub ipc_dir: Option<PathBuf>,
    /// Accounting window.
    pub window: Option<String>,
    /// Initial token length.
    pub base_quota: Option<String>,
    /// Shortest token.
    pub min_quota: Option<String>,
    /// Longest token.
    pub max_quota: Option<String>,
    /// Time a token may be kept past its end before it is revoked.
    pub token_grace: Option<String>,
    /// Log level.
    pub log_level: Option<String>,
    /// Number of GPUs for reservations.
    pub devices: Option<u32>,
    /// Unix group whose members may connect.
    pub ipc_group: Option<String>,
    /// Address to serve Prometheus metrics on.
    pub metrics: Option<String>,
    /// Longest reservation without a program a user may ask.
    pub reserve_max_duration: Option<String>,
    /// Most GPUs one user may hold reserved at once.
    pub reserve_max_gpus: Option<u32>,
    /// Serve peers whose credentials the kernel cannot give.
    pub allow_unverified_peers: Option<bool>,
    /// The accounting log (`off`: none).
    pub accounting: Option<PathBuf>,
    /// The accounting log and its rotated files together, at most.
    pub accounting_max_size: Option<String>,
    /// `[slurm]`: gem-slurm's settings.
    pub slurm: Option<RawSlurm>,
}

/// The `[slurm]` table as written.
#[derive(Debug, Default, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RawSlurm {
    /// MaxUtil of a job's group.
    pub max_util: Option<f64>,
    /// Shards of one GPU.
    pub shards_per_gpu: Option<u32>,
    /// Memory of one GPU, as a size.
    pub gpu_memory: Option<String>,
    /// The hook the task prolog preloads.
    pub hook: Option<PathBuf>,
}

/// gem-slurm's settings (`[slurm]` of `gemini.toml`).
#[derive(Debug, Clone, PartialEq)]
pub struct SlurmSettings {
    /// MaxUtil of a job's group (default 1).
    pub max_util: f64,
    /// Shards of one GPU (`None`: the node's shards over its GPUs).
    pub shards_per_gpu: Option<u32>,
    /// Bytes of one GPU's memory (`None`: from NVML).
    pub gpu_memory: Option<u64>,
    /// The hook the task prolog preloads.
    pub hook: PathBuf,
}

/// Default `[slurm] hook`: where `make install` puts it.
pub const DEFAULT_HOOK: &str = "/usr/local/lib/libgemhook.so";

impl Default for SlurmSettings {
    fn default() -> Self {
        SlurmSettings {
            max_util: 1.0,
            shards_per_gpu: None,
            gpu_memory: None,
            hook: PathBuf::from(DEFAULT_HOOK),
        }
    }
}

/// Values given on the command line; they replace the file's.
pub type Overrides = RawSettings;

/// Validated settings.
#[derive(Debug, Clone, PartialEq)]
pub struct Settings {
    /// Path of `resource.conf`.
    pub config: PathBuf,
    /// Accounting window.
    pub window: Duration,
    /// Initial token length.
    pub base_quota: Duration,
    /// Shortest token.
    pub min_quota: Duration,
    /// Longest token.
    pub max_quota: Duration,
    /// Time a token may be kept past its end (its holder waits for its
    /// queued work to finish) before it is revoked.
    pub token_grace: Duration,
    /// Log level.
    pub log_level: String,
    /// Number of GPUs for reservations (`None`: detect).
    pub devices: Option<u32>,
    /// Unix group whose members may connect (`None`: the daemon's user
    /// only).
    pub ipc_group: Option<String>,
    /// Where to serve Prometheus metrics (`None`: not served).
    pub metrics: Option<std::net::SocketAddr>,
    /// The longest reservation without a program a user (not root, not
    /// the daemon's user) may ask.
    pub reserve_max_duration: Duration,
    /// The most GPUs one user (not root, not the daemon's user) may hold
    /// reserved at once (`None`: half the GPUs, at least 1).
    pub reserve_max_gpus: Option<u32>,
    /// Serve peers whose uid, gid and pid the kernel cannot give (a libzmq
    /// built without `SO_PEERCRED`): every one of them may then act as
    /// any user. Off: gem-schd refuses to start without them.
    pub allow_unverified_peers: bool,
    /// Where the accounting log is appended.
    pub accounting: AccountingLog,
    /// Bytes the accounting log and its rotated files take together, at
    /// most.
    pub accounting_max_size: u64,
    /// gem-slurm's settings.
    pub slurm: SlurmSettings,
}

/// Where gem-schd appends its accounting log (`gem-schd report` reads it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum AccountingLog {
    /// `$STATE_DIRECTORY/accounting.jsonl` under systemd, else
    /// `accounting.jsonl` beside the socket.
    Default,
    /// No log (`accounting = "off"`).
    Off,
    /// This file.
    At(PathBuf),
}

impl AccountingLog {
    /// The file, with the IPC directory `ipc_dir` for the default
    /// (`None`: off).
    pub fn path(&self, ipc_dir: &Path) -> Option<PathBuf> {
        match self {
            AccountingLog::Off => None,
            AccountingLog::At(p) => Some(p.clone()),
            AccountingLog::Default => Some(
                std::env::var_os("STATE_DIRECTORY")
                    .filter(|d| !d.is_empty())
                    // systemd may list several, separated by colons.
                    .and_then(|d| d.to_string_lossy().split(':').next().map(PathBuf::from))
                    .unwrap_or_else(|| ipc_dir.to_path_buf())
                    .join("accounting.jsonl"),
            ),
        }
    }
}

impl AccountingLog {
    /// Where a reader (`gem-schd report`, from a shell without systemd's
    /// `STATE_DIRECTORY`) looks for the log, in order: where the daemon
    /// writes it by default (under systemd `$STATE_DIRECTORY`, else
    /// beside the socket), then, where the IPC directory was not named
    /// (`system`), the package's `/var/lib/gemini`. `Off`: nowhere.
    pub fn candidates(&self, ipc_dir: &Path, system: bool) -> Vec<PathBuf> {
        match self {
            AccountingLog::Off => Vec::new(),
            AccountingLog::At(p) => vec![p.clone()],
            AccountingLog::Default => {
                let mut v: Vec<PathBuf> = self.path(ipc_dir).into_iter().collect();
                let mut more = vec![ipc_dir.join("accounting.jsonl")];
                if system {
                    more.push(PathBuf::from("/var/lib/gemini/accounting.jsonl"));
                }
                for p in more {
                    if !v.contains(&p) {
                        v.push(p);
                    }
                }
                v
            }
        }
    }
}

/// Default `accounting_max_size`: 2 GiB, half for the usage (a line of
/// about 150 bytes a minute per group, GPU and user that ran: 55 days of
/// 10 groups busy on all of 8 GPUs, half a year of 3 groups) and half for
/// the events.
pub const DEFAULT_ACCOUNTING_MAX_SIZE: u64 = 2 << 30;

impl Default for Settings {
    fn default() -> Self {
        Settings {
            config: PathBuf::from(DEFAULT_CONFIG),
            window: Duration::from_secs(10),
            base_quota: Duration::from_millis(30),
            min_quota: Duration::from_millis(10),
            max_quota: Duration::from_millis(100),
            token_grace: Duration::from_secs(1),
            log_level: "info".into(),
            devices: None,
            ipc_group: None,
            metrics: None,
            reserve_max_duration: DEFAULT_RESERVE_MAX_DURATION,
            reserve_max_gpus: None,
            allow_unverified_peers: false,
            accounting: AccountingLog::Default,
            accounting_max_size: DEFAULT_ACCOUNTING_MAX_SIZE,
            slurm: SlurmSettings::default(),
        }
    }
}

/// The longest reservation without a program a user may ask by default:
/// a day (the daemon's user and root: 30 days).
pub const DEFAULT_RESERVE_MAX_DURATION: Duration = Duration::from_secs(86_400);

/// Invalid settings.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}: {message}")]
pub struct SettingsError {
    /// The file (or `command line`).
    pub file: String,
    /// What was expected.
    pub message: String,
}

const LOG_LEVELS: [&str; 5] = ["error", "warn", "info", "debug", "trace"];

/// The address `metrics` (or `--metrics`) names, or what was expected.
pub fn parse_metrics(text: &str) -> Result<std::net::SocketAddr, String> {
    text.trim().parse().map_err(|e| {
        format!(
            "expected an address and port such as \"127.0.0.1:9400\" or \"[::1]:9400\", got {text:?} ({e})"
        )
    })
}

/// `log_level` (or `--log-level`), lower-cased, or what was expected.
pub fn parse_log_level(text: &str) -> Result<String, String> {
    let level = text.to_ascii_lowercase();
    if LOG_LEVELS.contains(&level.as_str()) {
        Ok(level)
    } else {
        Err(format!(
            "expected one of {}, got {text:?}",
            LOG_LEVELS.join(", ")
        ))
    }
}

fn duration(file: &str, key: &str, text: &str) -> Result<Duration, SettingsError> {
    gemini_protocol::units::parse_duration(text).map_err(|e| SettingsError {
        file: file.into(),
        message: format!("{key}: {e}"),
    })
}

impl RawSettings {
    /// Fields set in `over` replace those of `self`.
    pub fn merge(self, over: Overrides) -> RawSettings {
        RawSettings {
            config: over.config.or(self.config),
            ipc_dir: over.ipc_dir.or(self.ipc_dir),
            window: over.window.or(self.window),
            base_quota: over.base_quota.or(self.base_quota),
            min_quota: over.min_quota.or(self.min_quota),
            max_quota: over.max_quota.or(self.max_quota),
            token_grace: over.token_grace.or(self.token_grace),
            log_level: over.log_level.or(self.log_level),
            devices: over.devices.or(self.devices),
            ipc_group: over.ipc_group.or(self.ipc_group),
            metrics: over.metrics.or(self.metrics),
            reserve_max_duration: over.reserve_max_duration.or(self.reserve_max_duration),
            reserve_max_gpus: over.reserve_max_gpus.or(self.reserve_max_gpus),
            allow_unverified_peers: over.allow_unverified_peers.or(self.allow_unverified_peers),
            accounting: over.accounting.or(self.accounting),
            accounting_max_size: over.accounting_max_size.or(self.accounting_max_size),
            slurm: over.slurm.or(self.slurm),
        }
    }

    /// Validates; `file` names the source in messages.
    pub fn validate(self, file: &str) -> Result<Settings, SettingsError> {
        let d = Settings::default();
        let err = |message: String| SettingsError {
            file: file.into(),
            message,
        };
        let dur = |key, v: Option<String>, default| match v {
            Some(t) => duration(file, key, &t),
            None => Ok(default),
        };
        let s = Settings {
            config: self.config.unwrap_or(d.config),
            window: dur("window", self.window, d.window)?,
            base_quota: dur("base_quota", self.base_quota, d.base_quota)?,
            min_quota: dur("min_quota", self.min_quota, d.min_quota)?,
            max_quota: dur("max_quota", self.max_quota, d.max_quota)?,
            token_grace: dur("token_grace", self.token_grace, d.token_grace)?,
            log_level: self.log_level.unwrap_or(d.log_level).to_ascii_lowercase(),
            devices: self.devices,
            ipc_group: self.ipc_group,
            metrics: match self.metrics {
                Some(a) => Some(parse_metrics(&a).map_err(|e| err(format!("metrics: {e}")))?),
                None => None,
            },
            reserve_max_duration: dur(
                "reserve_max_duration",
                self.reserve_max_duration,
                d.reserve_max_duration,
            )?,
            reserve_max_gpus: self.reserve_max_gpus,
            allow_unverified_peers: self.allow_unverified_peers.unwrap_or(false),
            accounting: match self.accounting {
                None => AccountingLog::Default,
                Some(p) if p.as_os_str() == "off" => AccountingLog::Off,
                Some(p) if p.as_os_str().is_empty() => {
                    return Err(err(
                        "accounting: expected a file, or \"off\" for none; got an empty path"
                            .into(),
                    ));
                }
                Some(p) => AccountingLog::At(p),
            },
            accounting_max_size: match self.accounting_max_size {
                None => d.accounting_max_size,
                Some(t) => match gemini_protocol::units::parse_size(&t) {
                    Ok(n) if n >= 1 << 20 => n,
                    Ok(_) => {
                        return Err(err(format!(
                            "accounting_max_size: expected at least 1MiB, got {t:?}"
                        )));
                    }
                    Err(e) => return Err(err(format!("accounting_max_size: {e}"))),
                },
            },
            slurm: slurm_settings(file, self.slurm.unwrap_or_default())?,
        };
        if s.reserve_max_duration.is_zero() {
            return Err(err("reserve_max_duration: must be longer than 0".into()));
        }
        if s.reserve_max_gpus == Some(0) {
            return Err(err(
                "reserve_max_gpus: expected at least 1, got 0 (no reservation at all: give the groups AllowedUsers)".into(),
            ));
        }
        if let Err(e) = parse_log_level(&s.log_level) {
            return Err(err(format!("log_level: {e}")));
        }
        if s.min_quota.is_zero() {
            return Err(err("min_quota: must be longer than 0".into()));
        }
        if !(s.min_quota <= s.base_quota && s.base_quota <= s.max_quota) {
            return Err(err(format!(
                "quotas must satisfy min_quota <= base_quota <= max_quota, got {:?} <= {:?} <= {:?}",
                s.min_quota, s.base_quota, s.max_quota
            )));
        }
        if s.window < s.max_quota * 10 {
            return Err(err(format!(
                "window {:?} must be at least 10 times max_quota {:?} for shares to be measured meaningfully",
                s.window, s.max_quota
            )));
        }
        Ok(s)
    }
}

fn slurm_settings(file: &str, raw: RawSlurm) -> Result<SlurmSettings, SettingsError> {
    let d = SlurmSettings::default();
    let err = |message: String| SettingsError {
        file: file.into(),
        message: format!("[slurm] {message}"),
    };
    let max_util = raw.max_util.unwrap_or(d.max_util);
    if !(max_util > 0.0 && max_util <= 1.0) {
        return Err(err(format!(
            "max_util: expected a share in (0, 1], got {max_util}"
        )));
    }
    if raw.shards_per_gpu == Some(0) {
        return Err(err("shards_per_gpu: expected at least 1, got 0".into()));
    }
    let gpu_memory = match raw.gpu_memory {
        Some(t) => Some(crate::parse_size(&t).map_err(|e| err(format!("gpu_memory: {e}")))?),
        None => None,
    };
    Ok(SlurmSettings {
        max_util,
        shards_per_gpu: raw.shards_per_gpu,
        gpu_memory,
        hook: raw.hook.unwrap_or(d.hook),
    })
}

/// Parses the text of a `gemini.toml` into its raw form.
pub fn parse_settings(text: &str, file: &str) -> Result<RawSettings, SettingsError> {
    toml::from_str(text).map_err(|e| SettingsError {
        file: file.into(),
        message: e.to_string(),
    })
}

/// Reads `path` (if given) and applies `over`, then validates.
pub fn load_settings(path: Option<&Path>, over: Overrides) -> Result<Settings, SettingsError> {
    let (raw, name) = match path {
        Some(p) => {
            let name = p.display().to_string();
            let text = std::fs::read_to_string(p).map_err(|e| SettingsError {
                file: name.clone(),
                message: format!("cannot read the file: {e}"),
            })?;
            (parse_settings(&text, &name)?, name)
        }
        None => (RawSettings::default(), "command line".to_string()),
    };
    raw.merge(over).validate(&name)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metrics_address_is_checked() {
        let s = parse_settings("metrics = \"127.0.0.1:9400\"\n", "g.toml")
            .unwrap()
            .validate("g.toml")
            .unwrap();
        assert_eq!(s.metrics, Some("127.0.0.1:9400".parse().unwrap()));
        let e = parse_settings("metrics = \"localhost\"\n", "g.toml")
            .unwrap()
            .validate("g.toml")
            .unwrap_err()
            .to_string();
        assert!(e.starts_with("g.toml: metrics: expected an address"), "{e}");
    }

    #[test]
    fn slurm_table_is_read_and_checked() {
        let s = parse_settings(
            "[slurm]\nmax_util = 0.5\nshards_per_gpu = 8\ngpu_memory = \"80GiB\"\nhook = \"/opt/g/libgemhook.so\"\n",
            "g.toml",
        )
        .unwrap()
        .validate("g.toml")
        .unwrap();
        assert_eq!(
            s.slurm,
            SlurmSettings {
                max_util: 0.5,
                shards_per_gpu: Some(8),
                gpu_memory: Some(80 << 30),
                hook: PathBuf::from("/opt/g/libgemhook.so"),
            }
        );
        let bad = |text: &str| {
            parse_settings(text, "g.toml")
                .and_then(|r| r.validate("g.toml"))
                .unwrap_err()
                .to_string()
        };
        assert!(bad("[slurm]\nmax_util = 1.5\n").contains("[slurm] max_util"));
        assert!(bad("[slurm]\ngpu_memory = \"lots\"\n").contains("[slurm] gpu_memory"));
        assert!(bad("[slurm]\nshards = 10\n").contains("unknown field"));
    }

    #[test]
    fn empty_file_gives_defaults() {
        let s = parse_settings("", "g.toml")
            .unwrap()
            .validate("g.toml")
            .unwrap();
        assert_eq!(s, Settings::default());
    }

    #[test]
    fn reads_every_field() {
        let text = "config = \"/x/r.conf\"\nipc_dir = \"/run/g\"\nwindow = \"20s\"\nbase_quota = \"40ms\"\nmin_quota = \"5ms\"\nmax_quota = \"200ms\"\nlog_level = \"DEBUG\"\n";
        let s = parse_settings(text, "g.toml")
            .unwrap()
            .validate("g.toml")
            .unwrap();
        assert_eq!(s.config, PathBuf::from("/x/r.conf"));
        assert_eq!(s.window, Duration::from_secs(20));
        assert_eq!(
            (s.base_quota, s.min_quota, s.max_quota),
            (
                Duration::from_millis(40),
                Duration::from_millis(5),
                Duration::from_millis(200)
            )
        );
        assert_eq!(s.log_level, "debug");
    }

    #[test]
    fn reservation_limits_are_read_and_checked() {
        let s = parse_settings(
            "reserve_max_duration = \"2h\"\nreserve_max_gpus = 2\n",
            "g.toml",
        )
        .unwrap()
        .validate("g.toml")
        .unwrap();
        assert_eq!(s.reserve_max_duration, Duration::from_secs(7200));
        assert_eq!(s.reserve_max_gpus, Some(2));
        let d = RawSettings::default().validate("g.toml").unwrap();
        assert_eq!(
            (
                d.reserve_max_duration,
                d.reserve_max_gpus,
                d.allow_unverified_peers
            ),
            (DEFAULT_RESERVE_MAX_DURATION, None, false)
        );
        for (text, what) in [
            (
                "reserve_max_gpus = 0\n",
                "reserve_max_gpus: expected at least 1",
            ),
            (
                "reserve_max_duration = \"0s\"\n",
                "reserve_max_duration: must be longer",
            ),
            (
                "reserve_max_duration = \"soon\"\n",
                "reserve_max_duration: ",
            ),
        ] {
            let e = parse_settings(text, "g.toml")
                .unwrap()
                .validate("g.toml")
                .unwrap_err()
                .to_string();
            assert!(e.starts_with(&format!("g.toml: {what}")), "{e}");
        }
    }

    #[test]
    fn the_example_shipped_holds_every_setting_with_its_default() {
        let text = include_str!("../../examples/gemini.toml");
        let s = parse_settings(text, "examples/gemini.toml")
            .unwrap()
            .validate("examples/gemini.toml")
            .unwrap();
        let d = Settings::default();
        assert_eq!(s, d, "the example's values are the defaults");
        // Every key of the file's, set or commented out.
        for key in [
            "config",
            "ipc_dir",
            "ipc_group",
            "window",
            "base_quota",
            "min_quota",
            "max_quota",
            "token_grace",
            "log_level",
            "devices",
            "reserve_max_gpus",
            "reserve_max_duration",
            "metrics",
            "accounting",
            "accounting_max_size",
            "allow_unverified_peers",
            "[slurm]",
            "max_util",
            "shards_per_gpu",
            "gpu_memory",
            "hook",
        ] {
            assert!(
                text.lines()
                    .any(|l| l.trim_start_matches("# ").starts_with(key)),
                "the example lacks {key}"
            );
        }
    }

    #[test]
    fn the_accounting_log_is_where_it_is_said_or_off() {
        let read = |text: &str| parse_settings(text, "g.toml").unwrap().validate("g.toml");
        let ipc = Path::new("/run/gemini");
        let s = read("accounting = \"/var/lib/gemini/a.jsonl\"\naccounting_max_size = \"8MiB\"\n")
            .unwrap();
        assert_eq!(
            (s.accounting.path(ipc), s.accounting_max_size),
            (Some(PathBuf::from("/var/lib/gemini/a.jsonl")), 8 << 20)
        );
        assert_eq!(
            read("accounting = \"off\"\n").unwrap().accounting.path(ipc),
            None
        );
        let d = read("").unwrap();
        assert_eq!(
            (d.accounting, d.accounting_max_size),
            (AccountingLog::Default, DEFAULT_ACCOUNTING_MAX_SIZE)
        );
        for (text, what) in [
            ("accounting = \"\"\n", "accounting: expected a file"),
            (
                "accounting_max_size = \"1KiB\"\n",
                "accounting_max_size: expected at least 1MiB",
            ),
            ("accounting_max_size = \"big\"\n", "accounting_max_size: "),
        ] {
            let e = read(text).unwrap_err().to_string();
            assert!(e.starts_with(&format!("g.toml: {what}")), "{e}");
        }
    }

    #[test]
    fn flags_override_the_file() {
        let raw = parse_settings("window = \"20s\"\nmin_quota = \"5ms\"\n", "g.toml").unwrap();
        let over = Overrides {
            window: Some("30s".into()),
            ..Default::default()
        };
        let s = raw.merge(over).validate("g.toml").unwrap();
        assert_eq!(
            (s.window, s.min_quota),
            (Duration::from_secs(30), Duration::from_millis(5))
        );
    }

    #[test]
    fn unknown_field_names_file_and_line() {
        let e = parse_settings("window = \"10s\"\nwindoe = \"5s\"\n", "g.toml").unwrap_err();
        let m = e.to_string();
        assert!(
            m.starts_with("g.toml: ") && m.contains("line 2") && m.contains("windoe"),
            "{m}"
        );
    }

    #[test]
    fn bad_values_are_explained() {
        let cases = [
            ("window = \"ten\"", "window: expected a duration"),
            ("log_level = \"loud\"", "log_level: expected one of"),
            (
                "min_quota = \"50ms\"\nbase_quota = \"20ms\"",
                "min_quota <= base_quota",
            ),
            ("min_quota = \"0s\"", "min_quota: must be longer than 0"),
            ("window = \"500ms\"", "at least 10 times max_quota"),
        ];
        for (text, want) in cases {
            let e = parse_settings(text, "g.toml")
                .unwrap()
                .validate("g.toml")
                .unwrap_err();
            assert!(e.to_string().contains(want), "{text}: {e}");
        }
    }

    #[test]
    fn missing_file_is_an_error_naming_it() {
        let e =
            load_settings(Some(Path::new("/nope/gemini.toml")), Overrides::default()).unwrap_err();
        assert!(
            e.to_string().starts_with("/nope/gemini.toml: cannot read"),
            "{e}"
        );
    }
}
