//! `gem-holder`: keeps idle GPUs occupied — a share of their time and
//! memory — so they do not look idle to a cluster's reclaimers, and hands
//! both back the moment a real program wants them. A client of `gem-schd`
//! of the lowest priority.
//!
//! ```text
//! gem-holder run [--devices 0,1] [--wait-minutes 10] [--mem-threshold 512MiB]
//!                [--hold-mem 50%] [--hold-util 0.5] [--max-kernel-ms 1]
//! gem-holder status [--json] | stop | start | restart [flags] | shutdown
//! ```

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod control;
mod engine;
mod gpu;
mod meter;
mod settings;

use anyhow::Context as _;
use clap::{Args, Parser, Subcommand};
use control::{Answer, Command, Patch};
use gemini_protocol::units::format_size;
use gemini_protocol::{
    Request,
    endpoint::{locate_ipc_dir, settings_path},
    env,
};
use settings::{HoldMem, MAX_WAIT_MINUTES, Settings, number_in};
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;
use tracing::{info, warn};

/// The exit statuses, for `--help`.
const EXIT_HELP: &str = "Exit status:
  0  done
  1  invalid settings: a flag's value (--devices, --hold-util, ...) or the settings file
  2  bad usage
  3  no gem-holder answers (status, stop, start, restart, shutdown)
  4  any other failure: a holder already runs in the IPC directory, the IPC directory does not exist, the devices cannot be opened";

/// Invalid settings (exit status 1).
#[derive(Debug)]
struct Invalid(String);

impl std::fmt::Display for Invalid {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Invalid {}

#[derive(Parser, Debug)]
#[command(
    name = "gem-holder",
    version,
    about = "Keeps idle GPUs occupied for gemini; hands them back at once when a real program needs them",
    after_help = EXIT_HELP
)]
struct Cli {
    /// IPC directory of the scheduler (and of the holder's control socket) [default: ipc_dir in the settings file, else /tmp/gemini/ipc]
    #[arg(long, global = true, env = env::IPC_DIR, value_name = "DIR")]
    ipc_dir: Option<PathBuf>,
    /// gemini.toml whose ipc_dir locates the scheduler [default: /etc/gemini/gemini.toml when it exists]
    #[arg(long, global = true, env = env::SETTINGS, value_name = "FILE")]
    settings: Option<PathBuf>,
    #[command(subcommand)]
    command: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Run the holder in the foreground
    Run(Flags),
    /// Show what the running holder holds
    Status {
        /// Print JSON
        #[arg(long)]
        json: bool,
    },
    /// Release everything and stop holding (the holder keeps running)
    Stop,
    /// Start holding again (after the wait period)
    Start,
    /// Release everything, apply new settings, hold again
    Restart(Flags),
    /// Release everything and exit
    Shutdown,
}

#[derive(Args, Debug, Default)]
struct Flags {
    /// Devices to hold, e.g. 0,1 [default: all]
    #[arg(long, value_delimiter = ',')]
    devices: Option<Vec<u32>>,
    /// Minutes a device must stay idle before it is held [default: 10]
    #[arg(long, value_parser = |s: &str| number_in(s, 0.0, MAX_WAIT_MINUTES))]
    wait_minutes: Option<f64>,
    /// Memory used by others under which a device counts idle [default: 512MiB]
    #[arg(long, value_parser = gemini_protocol::units::parse_size)]
    mem_threshold: Option<u64>,
    /// Memory to hold: a size (8GiB) or a share of free memory (50%) [default: 50%]
    #[arg(long, value_parser = |s: &str| HoldMem::parse(s))]
    hold_mem: Option<HoldMem>,
    /// Utilisation to keep the device at, real programs included, 0..1 [default: 0.5]
    #[arg(long, value_parser = |s: &str| number_in(s, 0.0, 1.0))]
    hold_util: Option<f64>,
    /// Length of one holder kernel in ms, 0.05..100; a real program waits behind at most a few [default: 1]
    #[arg(long, value_parser = |s: &str| number_in(s, 0.05, 100.0))]
    max_kernel_ms: Option<f64>,
}

impl Flags {
    fn patch(self) -> Patch {
        Patch {
            devices: self.devices,
            wait_minutes: self.wait_minutes,
            mem_threshold: self.mem_threshold,
            hold_mem: self.hold_mem,
            hold_util: self.hold_util,
            max_kernel_ms: self.max_kernel_ms,
        }
    }
}

fn defaults() -> Settings {
    Settings {
        devices: Vec::new(),
        wait_minutes: 10.0,
        mem_threshold: 512 << 20,
        hold_mem: HoldMem::FractionOfFree(0.5),
        hold_util: 0.5,
        max_kernel_ms: 1.0,
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    // Devices are numbered as the machine numbers them (nvidia-smi, NVML,
    // the hook's reports to the scheduler): in PCI bus order, which CUDA
    // follows only when asked to, before it initialises.
    if std::env::var_os("CUDA_DEVICE_ORDER").is_none() {
        // SAFETY: no other thread exists yet to read the environment.
        unsafe { std::env::set_var("CUDA_DEVICE_ORDER", "PCI_BUS_ID") };
    }
    let ipc = match locate_ipc_dir(
        cli.ipc_dir.as_deref().map(Path::as_os_str),
        settings_path(cli.settings.as_deref().map(Path::as_os_str)).as_deref(),
    ) {
        Ok(d) => d,
        Err(e) => {
            eprintln!("gem-holder: {e}");
            return ExitCode::from(1);
        }
    };
    let result = match cli.command {
        Cmd::Run(flags) => run(flags.patch().apply(&defaults()), &ipc),
        Cmd::Status { json } => ask(&ipc, &Command::Status, json),
        Cmd::Stop => ask(&ipc, &Command::Stop, false),
        Cmd::Start => ask(&ipc, &Command::Start, false),
        Cmd::Restart(flags) => ask(&ipc, &Command::Restart(flags.patch()), false),
        Cmd::Shutdown => ask(&ipc, &Command::Shutdown, false),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("gem-holder: {e:#}");
            ExitCode::from(if e.is::<Invalid>() {
                1
            } else if e.is::<control::NoHolder>() {
                3
            } else {
                4
            })
        }
    }
}

fn ask(ipc: &Path, cmd: &Command, json: bool) -> anyhow::Result<()> {
    match control::send(ipc, cmd)? {
        Answer::Status(s) if json => println!("{}", serde_json::to_string_pretty(&s)?),
        Answer::Status(s) => {
            println!(
                "gem-holder: {}; scheduler {}; hold-util {:.2}, hold-mem {}, wait {} min, threshold {}, kernel {} ms",
                if s.stopped { "stopped" } else { "running" },
                if s.scheduler {
                    "answering"
                } else {
                    "not answering"
                },
                s.settings.hold_util,
                s.settings.hold_mem,
                s.settings.wait_minutes,
                format_size(s.settings.mem_threshold),
                s.settings.max_kernel_ms
            );
            // The state last: "yielded to pid 4242 (group train)" is as
            // long as it is, and the columns before it stay aligned.
            println!(
                "{:<7} {:>14} {:>6} {:>6} {:>14} {:>10}  STATE",
                "DEVICE", "HELD", "DUTY", "UTIL", "OTHERS USE", "IDLE (s)"
            );
            for d in &s.devices {
                // The utilisation the holder steers by is measured only
                // while it holds the device: otherwise it is stale.
                let util = d
                    .utilisation
                    .filter(|_| d.state == "holding")
                    .map_or("-".into(), |u| format!("{:.0}%", u * 100.0));
                println!(
                    "{:<7} {:>14} {:>6.2} {:>6} {:>14} {:>10.1}  {}",
                    d.device,
                    format_size(d.held_bytes),
                    d.duty,
                    util,
                    format_size(d.others_used),
                    d.idle_seconds,
                    d.state,
                );
            }
        }
        Answer::Ok(msg) => println!("{msg}"),
        Answer::Err(msg) => anyhow::bail!("{msg}"),
    }
    Ok(())
}

/// Logs to stderr through tracing, as gem-schd does: `info` and above,
/// or what `RUST_LOG` says.
fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| {
        tracing_subscriber::EnvFilter::new("gem_holder=info,gemini_holder=info")
    });
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
}

fn run(settings: Settings, ipc: &Path) -> anyhow::Result<()> {
    settings.validate().map_err(Invalid)?;
    init_logging();
    if control::running(ipc) {
        anyhow::bail!(
            "a gem-holder is already running in {} (stop it with `gem-holder shutdown`)",
            ipc.display()
        );
    }
    let stop = Arc::new(AtomicBool::new(false));
    for sig in [signal_hook::consts::SIGTERM, signal_hook::consts::SIGINT] {
        signal_hook::flag::register(sig, Arc::clone(&stop))?;
    }
    // SIGHUP (a closed terminal, a unit's reload) used to kill the holder
    // silently: it has nothing to re-read, so it says so and goes on.
    let hup = Arc::new(AtomicBool::new(false));
    signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&hup))?;
    if !ipc.is_dir() {
        anyhow::bail!(
            "the IPC directory {} does not exist: start gem-schd first (the holder's control socket lives beside the scheduler's), with the same ipc_dir",
            ipc.display()
        );
    }
    let wait = settings.wait_minutes;
    let engine = engine::Engine::new(settings, ipc.to_path_buf())?;
    let ctx = zmq::Context::new();
    let sock = ctx.socket(zmq::REP)?;
    sock.set_linger(100)?;
    sock.bind(&control::endpoint(ipc))
        .with_context(|| format!("cannot open the control socket {}", control::endpoint(ipc)))?;
    let threads = engine.spawn();
    let listed: Vec<String> = engine.devices.iter().map(|d| d.index.to_string()).collect();
    info!(
        "watching device(s) {}; each is held once idle for {wait} min; control at {}",
        listed.join(", "),
        control::endpoint(ipc)
    );
    let answers = gemini_client::Client::connect(ipc)
        .map_err(anyhow::Error::from)
        .and_then(|mut c| Ok(c.request(&Request::Status, Duration::from_secs(1))?));
    if let Err(e) = answers {
        warn!("no scheduler answers yet ({e:#}); nothing is held until one does");
    }
    while !stop.load(Ordering::Relaxed) {
        if hup.swap(false, Ordering::AcqRel) {
            warn!(
                "SIGHUP ignored: nothing to reload (change settings with `gem-holder restart …`)"
            );
        }
        if sock.poll(zmq::POLLIN, 100).unwrap_or(0) == 0 {
            continue;
        }
        let Ok(msg) = sock.recv_bytes(0) else {
            continue;
        };
        let (answer, quit) = match serde_json::from_slice::<Command>(&msg) {
            Ok(cmd) => handle(&engine, cmd),
            Err(e) => (Answer::Err(format!("bad command: {e}")), false),
        };
        let _ = sock.send(serde_json::to_vec(&answer)?, 0);
        if quit {
            break;
        }
    }
    engine.exit.store(true, Ordering::Relaxed);
    for t in threads {
        let _ = t.join();
    }
    let _ = std::fs::remove_file(ipc.join(control::SOCKET));
    info!("released everything; exiting");
    Ok(())
}

fn handle(engine: &engine::Engine, cmd: Command) -> (Answer, bool) {
    match cmd {
        Command::Status => (Answer::Status(engine.status()), false),
        Command::Stop => {
            engine.stopped.store(true, Ordering::Relaxed);
            engine.release.store(true, Ordering::Relaxed);
            wait_released(engine);
            (Answer::Ok("gem-holder stopped: nothing held".into()), false)
        }
        Command::Start => {
            engine.stopped.store(false, Ordering::Relaxed);
            (
                Answer::Ok(
                    "gem-holder started: devices are held once idle for the wait period".into(),
                ),
                false,
            )
        }
        Command::Restart(patch) => {
            let new = {
                let cur = engine.settings.lock().unwrap_or_else(|p| p.into_inner());
                patch.apply(&cur)
            };
            if let Err(e) = new.validate() {
                return (Answer::Err(e), false);
            }
            if new.devices
                != engine
                    .settings
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .devices
            {
                return (
                    Answer::Err(
                        "--devices cannot change on restart; shut down and run again".into(),
                    ),
                    false,
                );
            }
            engine.release.store(true, Ordering::Relaxed);
            wait_released(engine);
            *engine.settings.lock().unwrap_or_else(|p| p.into_inner()) = new;
            engine.stopped.store(false, Ordering::Relaxed);
            (
                Answer::Ok("gem-holder restarted with the new settings".into()),
                false,
            )
        }
        Command::Shutdown => {
            engine.stopped.store(true, Ordering::Relaxed);
            (Answer::Ok("gem-holder is shutting down".into()), true)
        }
    }
}

/// Waits (briefly) until the orders thread has released everything.
fn wait_released(engine: &engine::Engine) {
    for _ in 0..50 {
        if !engine.release.load(Ordering::Relaxed) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for _ in 0..50 {
        if engine.status().devices.iter().all(|d| d.held_bytes == 0) {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}
