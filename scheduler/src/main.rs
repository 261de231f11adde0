//! `gem-schd`: run the scheduler, check a configuration, show its status,
//! stop it.

use anyhow::Context as _;
use clap::{Parser, Subcommand};
use gemini_config::{Overrides, load_resource, load_settings};
use gemini_protocol::{
    Reply, Request, StatusReport,
    endpoint::{locate_ipc_dir, settings_path},
    env,
};
use gemini_scheduler::client::{Client, ClientError};
use gemini_scheduler::daemon::Daemon;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

/// Exit code when the configuration is invalid.
const EXIT_INVALID: u8 = 1;
/// Exit code when the scheduler cannot be reached.
const EXIT_UNREACHABLE: u8 = 3;
/// Exit code when this user may not use the scheduler's socket.
const EXIT_DENIED: u8 = 5;
/// Exit code for any other failure: gem-schd could not start (another
/// runs in the IPC directory, the socket cannot be made) or do what was
/// asked.
const EXIT_FAILED: u8 = 4;

/// The exit statuses, for `--help`.
const EXIT_HELP: &str = "Exit status:
  0  done
  1  invalid resource.conf or settings (check, or at start)
  2  bad usage
  3  no scheduler answers (status, top, reload, shutdown)
  4  any other failure: gem-schd could not start (another one runs in the IPC directory, the socket cannot be made) or do what was asked
  5  permission denied: this user may not use the scheduler's socket (status, top, reload, shutdown)";

#[derive(Parser, Debug)]
#[command(
    name = "gem-schd",
    version,
    about = "gemini scheduler: guaranteed shares of GPU time and memory caps per group of CUDA processes",
    long_about = "Runs the gemini token scheduler in the foreground (without a subcommand), or talks to a running one.\n\nGroups, their MinUtil/MaxUtil shares and MemoryLimit come from resource.conf, reloaded live when it is edited.",
    after_help = EXIT_HELP
)]
struct Cli {
    /// IPC directory holding the scheduler's socket [default: ipc_dir in the settings file, else /tmp/gemini/ipc]
    #[arg(long, global = true, env = env::IPC_DIR, value_name = "DIR")]
    ipc_dir: Option<PathBuf>,

    /// gemini.toml with the daemon settings; its ipc_dir is used by every subcommand (flags override it) [default: /etc/gemini/gemini.toml when it exists]
    #[arg(long, global = true, env = env::SETTINGS, value_name = "FILE")]
    settings: Option<PathBuf>,

    #[command(flatten)]
    run: RunArgs,

    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(clap::Args, Debug)]
struct RunArgs {
    /// resource.conf with one [group] section per group [default: /etc/gemini/resource.conf]
    #[arg(long, env = env::CONFIG, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Accounting window for shares, e.g. 10s
    #[arg(long, value_name = "DURATION", value_parser = duration_flag)]
    window: Option<String>,
    /// Token length before a client's bursts are known, e.g. 30ms
    #[arg(long, value_name = "DURATION", value_parser = duration_flag)]
    base_quota: Option<String>,
    /// Shortest token, e.g. 10ms
    #[arg(long, value_name = "DURATION", value_parser = duration_flag)]
    min_quota: Option<String>,
    /// Longest token, e.g. 100ms
    #[arg(long, value_name = "DURATION", value_parser = duration_flag)]
    max_quota: Option<String>,
    /// How long a token may be kept past its end before it is revoked, e.g. 1s
    #[arg(long, value_name = "DURATION", value_parser = duration_flag)]
    token_grace: Option<String>,
    /// error, warn, info, debug or trace
    #[arg(long, value_name = "LEVEL", value_parser = gemini_config::parse_log_level)]
    log_level: Option<String>,
    /// Number of GPUs gem-launch may reserve [default: as many as /proc/driver/nvidia/gpus lists, else NVML]
    #[arg(long, value_name = "N")]
    devices: Option<u32>,
    /// Unix group whose members may connect (IPC dir 0750, socket 0770) [default: only this user]
    #[arg(long, value_name = "GROUP")]
    ipc_group: Option<String>,
    /// Serve Prometheus metrics at http://ADDR/metrics, e.g. 127.0.0.1:9400 [default: off]
    #[arg(long, value_name = "ADDR", value_parser = metrics_flag)]
    metrics: Option<String>,
    /// Serve peers whose uid, gid and pid the kernel cannot give (a libzmq built without SO_PEERCRED): each may then act as any user. For tests only [default: refuse to start without them]
    #[arg(long)]
    allow_unverified_peers: bool,
    /// Append the accounting log `gem-schd report` reads to FILE ("off": none) [default: $STATE_DIRECTORY/accounting.jsonl under systemd, else accounting.jsonl in the IPC directory]
    #[arg(long, value_name = "FILE")]
    accounting: Option<PathBuf>,
}

/// A duration flag (`--window 10s`), checked as the settings file's are,
/// so that an error names the flag.
fn duration_flag(text: &str) -> Result<String, String> {
    gemini_protocol::units::parse_duration(text)
        .map(|_| text.to_string())
        .map_err(|e| e.to_string())
}

/// `--since`/`--until WHEN`, checked before the report reads anything.
fn time_flag(text: &str) -> Result<String, String> {
    gemini_scheduler::usage_report::parse_time(text, 0.0).map(|_| text.to_string())
}

/// `--metrics ADDR`, checked as the settings file's `metrics` is.
fn metrics_flag(text: &str) -> Result<String, String> {
    gemini_config::parse_metrics(text).map(|_| text.to_string())
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Validate a resource.conf and print its groups; exits 1 if it is invalid
    #[command(override_usage = "gem-schd check <FILE>")]
    Check {
        /// The file to check
        file: PathBuf,
    },
    /// Show devices, groups, shares, memory and clients of the running scheduler
    Status {
        /// Print JSON instead of a table
        #[arg(long)]
        json: bool,
        /// Refresh every N seconds until interrupted
        #[arg(long, value_name = "SECS", num_args = 0..=1, default_missing_value = "1")]
        watch: Option<f64>,
    },
    /// A live view: per GPU, each group's share against its MinUtil and
    /// MaxUtil, its memory, its waiting processes and its last minute
    /// (q quits); `status --watch` stays for scripts
    Top {
        /// Seconds between refreshes
        #[arg(long, value_name = "SECS", default_value = "1")]
        interval: f64,
    },
    /// Stop the running scheduler
    Shutdown,
    /// Re-read resource.conf now (as SIGHUP does); exits 1 with the file's
    /// errors if it is invalid (the running configuration then stays)
    Reload,
    /// GPU time and GPU-hours per group, user or GPU over a period, from
    /// the accounting log gem-schd appends to (it need not be running)
    #[command(
        after_help = "Examples:\n  gem-schd report                      the last 7 days, by group\n  gem-schd report --since 30d --by user\n  gem-schd report --since 2026-11-01 --until 2026-12-01 --by group,user --json"
    )]
    Report {
        /// Start of the period: a duration before now (7d, 12h) or a UTC date or time (2026-11-01, "2026-11-01 12:00:00")
        #[arg(long, value_name = "WHEN", default_value = "7d", value_parser = time_flag)]
        since: String,
        /// End of the period, as --since [default: now]
        #[arg(long, value_name = "WHEN", value_parser = time_flag)]
        until: Option<String>,
        /// Rows by group, user or gpu; several with commas (group,user)
        #[arg(
            long,
            value_name = "KEYS",
            value_delimiter = ',',
            default_value = "group"
        )]
        by: Vec<gemini_scheduler::usage_report::Key>,
        /// Print JSON instead of a table (durations in seconds)
        #[arg(long)]
        json: bool,
        /// The accounting log [default: `accounting` in the settings file, else where gem-schd writes it by default]
        #[arg(long, value_name = "FILE")]
        log: Option<PathBuf>,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let settings = settings_path(cli.settings.as_deref().map(|p| p.as_os_str()));
    let ipc_dir = match locate_ipc_dir(
        cli.ipc_dir.as_deref().map(|p| p.as_os_str()),
        settings.as_deref(),
    ) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gem-schd: {e}");
            return ExitCode::from(EXIT_INVALID);
        }
    };
    let result = match cli.command {
        None => run(cli.run, settings.as_deref(), ipc_dir),
        Some(Command::Check { file }) => return check(&file),
        Some(Command::Status { json, watch }) => status(&ipc_dir, json, watch),
        Some(Command::Top { interval }) => top(&ipc_dir, interval),
        Some(Command::Shutdown) => shutdown(&ipc_dir),
        Some(Command::Reload) => reload(&ipc_dir),
        Some(Command::Report {
            since,
            until,
            by,
            json,
            log,
        }) => {
            let ask = ReportArgs {
                since,
                until,
                by,
                json,
                log,
            };
            // The package's log is looked for only where no IPC
            // directory was named (a test's or a second scheduler's).
            let system = cli.ipc_dir.is_none();
            report(ask, settings.as_deref(), &ipc_dir, system)
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gem-schd: {e:#}");
            // 3 means "no scheduler answers", and only that: a refused
            // socket or an answer that cannot be read is another failure
            // (4); 1 is an invalid configuration.
            if e.downcast_ref::<ClientError>()
                .is_some_and(|c| matches!(c, ClientError::Connect { .. } | ClientError::Timeout(_)))
            {
                ExitCode::from(EXIT_UNREACHABLE)
            } else if e
                .downcast_ref::<ClientError>()
                .is_some_and(|c| matches!(c, ClientError::Denied(_)))
            {
                ExitCode::from(EXIT_DENIED)
            } else if e.is::<gemini_scheduler::daemon::InvalidConfig>()
                || e.is::<gemini_config::SettingsError>()
                || e.is::<ReloadRefused>()
            {
                ExitCode::from(EXIT_INVALID)
            } else {
                ExitCode::from(EXIT_FAILED)
            }
        }
    }
}

fn run(args: RunArgs, settings: Option<&Path>, ipc_dir: PathBuf) -> anyhow::Result<()> {
    let over = Overrides {
        // Absolute: `status` and the log name the file a user can open
        // from anywhere.
        config: args.config.map(|p| std::path::absolute(&p).unwrap_or(p)),
        ipc_dir: None,
        window: args.window,
        base_quota: args.base_quota,
        min_quota: args.min_quota,
        max_quota: args.max_quota,
        token_grace: args.token_grace,
        log_level: args.log_level,
        devices: args.devices,
        ipc_group: args.ipc_group,
        metrics: args.metrics,
        allow_unverified_peers: args.allow_unverified_peers.then_some(true),
        accounting: args.accounting,
        ..Overrides::default()
    };
    let settings = load_settings(settings, over)?;
    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new(format!(
            "gemini_scheduler={0},gem_schd={0}",
            settings.log_level
        )))
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))
            .context("cannot install signal handler")?;
    }
    Daemon::start(&settings, &ipc_dir, stop)?.run()
}

fn check(file: &std::path::Path) -> ExitCode {
    match load_resource(file) {
        Ok((cfg, warnings)) => {
            for w in &warnings {
                eprintln!("{w}");
            }
            let gpus = gemini_scheduler::daemon::nvml_gpus();
            if gpus.is_empty() {
                eprintln!(
                    "note: no GPU found through NVML here: the MemoryLimits were not compared with the GPUs' memory"
                );
            }
            let memory: Vec<(u32, u64)> = gpus.iter().map(|(i, _, m)| (*i, *m)).collect();
            let indices: Vec<u32> = gpus.iter().map(|(i, ..)| *i).collect();
            for line in cfg.memory_overcommit(&memory) {
                eprintln!("{line}");
            }
            for line in cfg.latency_without_room(&indices) {
                eprintln!("{line}");
            }
            // Only where the GPUs can be seen: a file checked on another
            // machine than the one it is for says nothing of them.
            let missing = if indices.is_empty() {
                Vec::new()
            } else {
                cfg.devices_missing(&indices)
            };
            for line in &missing {
                eprintln!("{line}");
            }
            if !missing.is_empty() {
                return ExitCode::from(EXIT_INVALID);
            }
            println!("{}: OK, {} group(s)", file.display(), cfg.groups.len());
            for g in cfg.groups.values() {
                println!("  {}", gemini_config::ResourceConfig::summary(g));
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_INVALID)
        }
    }
}

fn fetch_status(client: &mut Client) -> anyhow::Result<StatusReport> {
    match client.request(&Request::Status, Duration::from_secs(2))? {
        Reply::Status(s) => Ok(*s),
        other => anyhow::bail!("unexpected answer to status: {other:?}"),
    }
}

fn status(ipc_dir: &std::path::Path, json: bool, watch: Option<f64>) -> anyhow::Result<()> {
    use std::io::Write as _;
    let Some(secs) = watch else {
        let report = fetch_status(&mut Client::connect_now(ipc_dir)?)?;
        return print_status(&mut std::io::stdout().lock(), &report, json, false);
    };
    let period = Duration::from_secs_f64(secs.max(0.1));
    // Watching waits for a scheduler that is not there yet.
    let mut client = Client::connect(ipc_dir)?;
    let mut away = false;
    loop {
        // A restarted scheduler (or one briefly gone) is waited for, not
        // a reason to stop watching.
        match fetch_status(&mut client) {
            Ok(report) => {
                away = false;
                // The screen is cleared for a terminal only: a file or a
                // pipe gets the reports one after another.
                let clear = std::io::IsTerminal::is_terminal(&std::io::stdout());
                print_status(&mut std::io::stdout().lock(), &report, json, clear)?;
            }
            Err(e) => {
                if !away {
                    let mut out = std::io::stdout().lock();
                    let line = writeln!(out, "gem-schd status: {e:#}; waiting for the scheduler")
                        .and_then(|()| out.flush());
                    if closed(&line) {
                        return Ok(());
                    }
                    away = true;
                }
                if let Ok(c) = Client::connect(ipc_dir) {
                    client = c;
                }
            }
        }
        std::thread::sleep(period);
    }
}

/// Whether a write failed because the reader went away (`status --watch |
/// head`): the end of the output, not an error.
fn closed(r: &std::io::Result<()>) -> bool {
    matches!(r, Err(e) if e.kind() == std::io::ErrorKind::BrokenPipe)
}

/// Prints one status report: a table (with a screen clear first when
/// `watching` on a terminal), or one JSON document per report (never
/// with escapes).
/// A closed reader ends the program quietly.
fn print_status(
    out: &mut impl std::io::Write,
    report: &StatusReport,
    json: bool,
    watching: bool,
) -> anyhow::Result<()> {
    let text = if json {
        let mut doc = serde_json::to_string_pretty(report)?;
        doc.push('\n');
        doc
    } else if watching {
        format!("\x1b[2J\x1b[H{}", gemini_scheduler::status::render(report))
    } else {
        gemini_scheduler::status::render(report)
    };
    let r = out.write_all(text.as_bytes()).and_then(|()| out.flush());
    if closed(&r) {
        std::process::exit(0);
    }
    Ok(r?)
}

fn reload(ipc_dir: &std::path::Path) -> anyhow::Result<()> {
    match gemini_scheduler::client::reload(ipc_dir)? {
        Ok(()) => {
            println!(
                "gem-schd in {} reloaded its configuration",
                ipc_dir.display()
            );
            Ok(())
        }
        Err(message) => Err(ReloadRefused(message).into()),
    }
}

/// The scheduler kept its configuration: the file it reread is invalid.
#[derive(Debug)]
struct ReloadRefused(String);

impl std::fmt::Display for ReloadRefused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for ReloadRefused {}

fn top(ipc_dir: &Path, interval: f64) -> anyhow::Result<()> {
    if !(interval.is_finite() && (0.1..=3600.0).contains(&interval)) {
        anyhow::bail!("--interval: expected seconds between 0.1 and 3600, got {interval}");
    }
    gemini_scheduler::top::run(ipc_dir, Duration::from_secs_f64(interval))
}

fn shutdown(ipc_dir: &std::path::Path) -> anyhow::Result<()> {
    let mut client = Client::connect_now(ipc_dir)?;
    match client.request(&Request::Shutdown, Duration::from_secs(2))? {
        Reply::Done => {
            println!("gem-schd in {} is stopping", ipc_dir.display());
            Ok(())
        }
        Reply::Error(e) => anyhow::bail!("{}", e.message),
        other => anyhow::bail!("unexpected answer to shutdown: {other:?}"),
    }
}

/// What `gem-schd report` was asked.
struct ReportArgs {
    since: String,
    until: Option<String>,
    by: Vec<gemini_scheduler::usage_report::Key>,
    json: bool,
    log: Option<PathBuf>,
}

fn report(
    ask: ReportArgs,
    settings: Option<&Path>,
    ipc_dir: &Path,
    system: bool,
) -> anyhow::Result<()> {
    use gemini_scheduler::usage_report as r;
    let log = match ask.log {
        Some(l) => l,
        None => {
            let candidates = load_settings(settings, Overrides::default())?
                .accounting
                .candidates(ipc_dir, system);
            let Some(first) = candidates.first().cloned() else {
                anyhow::bail!(
                    "the settings say accounting = \"off\": there is no log to report on (or give --log FILE)"
                );
            };
            candidates.into_iter().find(|p| p.exists()).unwrap_or(first)
        }
    };
    let now = gemini_scheduler::accounting::unix_now();
    let since = r::parse_time(&ask.since, now).map_err(|e| anyhow::anyhow!("--since: {e}"))?;
    let until = match &ask.until {
        Some(u) => r::parse_time(u, now).map_err(|e| anyhow::anyhow!("--until: {e}"))?,
        None => now,
    };
    if until <= since {
        anyhow::bail!(
            "--until ({}) must come after --since ({})",
            r::when(until),
            r::when(since)
        );
    }
    let mut by = ask.by;
    by.dedup();
    let q = r::Query { since, until, by };
    let (rows, skipped) = r::summarize_log(&log, &q)?;
    if skipped > 0 {
        eprintln!(
            "gem-schd report: {skipped} line(s) of {} could not be read (torn by a crash, or from a newer gemini) and were left out",
            log.display()
        );
    }
    let text = if ask.json {
        format!(
            "{}\n",
            serde_json::to_string_pretty(&r::json(&rows, &q, &log))?
        )
    } else {
        r::render(&rows, &q, &log)
    };
    let mut out = std::io::stdout().lock();
    let w = std::io::Write::write_all(&mut out, text.as_bytes());
    if closed(&w) {
        return Ok(());
    }
    Ok(w?)
}
