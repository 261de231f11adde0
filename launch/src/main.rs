//! `gem-launch`: runs a program under gemini — with `LD_PRELOAD` set to
//! the hook, its group and the scheduler's IPC directory — and, with
//! `--gpus N` or `--gpu-ids`, on GPUs reserved through the scheduler
//! (least recently released first, waiting in a first-come-first-served
//! queue when none is free).
//!
//! The program replaces `gem-launch` (`exec`): it keeps the process id,
//! receives signals directly, and its exit status is the command's. The
//! reservation belongs to that process and ends when it exits or is
//! killed; there is nothing to renew.
//!
//! `gem-launch reserve --gpus N --duration 4h` reserves GPUs without a
//! program, for the user, until they expire by themselves or
//! `gem-launch release` gives them back.

#![cfg_attr(test, allow(clippy::unwrap_used, clippy::expect_used))]

mod status;

use clap::{Parser, Subcommand};
use gemini_client::{Client, ClientError, Session};
use gemini_protocol::{
    ErrorKind, GpuRequest, Reply, Request, Role,
    endpoint::{locate_ipc_dir, settings_path},
    env,
};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

/// The settings file (gemini.toml) cannot say where the scheduler is.
const EXIT_BAD_SETTINGS: i32 = 2;
/// The hook library was not found.
const EXIT_NO_HOOK: i32 = 10;
/// No scheduler answers.
const EXIT_NO_SCHEDULER: i32 = 11;
/// The group is not configured, not open to this user, or none could be
/// chosen.
const EXIT_BAD_GROUP: i32 = 12;
/// No GPU free (--nonblock) or none became free in time (--timeout).
const EXIT_NO_GPU: i32 = 13;
/// The scheduler refused the reservation as asked: more GPUs than the
/// machine (or the group's `Devices`) has, GPUs that do not exist, a
/// length out of range, or anything else but "none free" and the group.
/// Waiting would not help.
const EXIT_REFUSED: i32 = 14;
/// `release`: no reservation of yours to give back.
const EXIT_NOTHING_RESERVED: i32 = 15;
/// This user may not use the scheduler's socket.
const EXIT_DENIED: i32 = 16;
/// The command could not be run.
const EXIT_NOT_EXECUTABLE: i32 = 126;
/// The command was not found.
const EXIT_NOT_FOUND: i32 = 127;

/// The exit statuses, for every `--help`.
const EXIT_HELP: &str = "Exit status:
  the program's own, once it runs
  2    bad usage, or a settings file that cannot say where the scheduler is
  10   the hook library (libgemhook.so) was not found
  11   no scheduler answers
  12   the group is not defined, not open to you, or none could be chosen
  13   no GPU free (--nonblock), or none became free in time (--timeout)
  14   the scheduler refused the reservation as asked (more GPUs than there are, unknown GPU ids, a length out of range)
  15   release: no reservation of yours to give back
  16   permission denied: you may not use the scheduler's socket (ipc_group in gemini.toml)
  126  the command is not executable
  127  the command was not found";

#[derive(Parser, Debug)]
#[command(
    name = "gem-launch",
    version,
    about = "Run a program under gemini: its group's GPU share and memory cap, optionally on reserved GPUs",
    override_usage = "gem-launch [OPTIONS] -- COMMAND [ARGS]...\n       gem-launch reserve [--group G] (--gpus N | --gpu-ids 0,2) --duration 4h\n       gem-launch release [--gpu-ids 0,2]\n       gem-launch status [--json]",
    after_help = EXIT_HELP,
    subcommand_negates_reqs = true,
    args_conflicts_with_subcommands = true
)]
struct Args {
    #[command(subcommand)]
    sub: Option<Sub>,
    /// Group to run in [default: $GEMINI_GROUP_NAME, else a group named after your user name]
    #[arg(long)]
    group: Option<String>,
    /// Reserve this many GPUs and expose only them (CUDA_VISIBLE_DEVICES)
    #[arg(long, conflicts_with = "gpu_ids")]
    gpus: Option<u32>,
    /// Reserve these GPUs, e.g. 0,2
    #[arg(long, value_delimiter = ',')]
    gpu_ids: Option<Vec<u32>>,
    /// Wait in the queue when no GPU is free (the default)
    #[arg(long, conflicts_with = "nonblock")]
    wait: bool,
    /// Fail at once when no GPU is free
    #[arg(long)]
    nonblock: bool,
    /// Give up waiting after this long, e.g. 30m, 2h, 1d, 0.5h
    #[arg(long, value_parser = gemini_protocol::units::parse_duration)]
    timeout: Option<Duration>,
    /// IPC directory of the scheduler [default: ipc_dir in the settings file, else /tmp/gemini/ipc]
    #[arg(long, env = env::IPC_DIR, value_name = "DIR", global = true)]
    ipc_dir: Option<PathBuf>,
    /// gemini.toml whose ipc_dir locates the scheduler [default: /etc/gemini/gemini.toml when it exists]
    #[arg(long, env = env::SETTINGS, value_name = "FILE", global = true)]
    settings: Option<PathBuf>,
    /// The hook library [default: libgemhook.so next to this install, or $GEMINI_HOOK]
    #[arg(long, env = gemini_protocol::env::HOOK, value_name = "PATH")]
    hook: Option<PathBuf>,
    /// The program is a rank of this multi-GPU job: its ranks (every
    /// gem-launch with the same --job) take their GPUs in turns together,
    /// so that their collectives meet. torchrun, Slurm and MPI jobs are
    /// recognised without it.
    #[arg(long, value_name = "NAME")]
    job: Option<String>,
    /// The program and its arguments
    #[arg(required = true, last = true, value_name = "COMMAND")]
    command: Vec<String>,
}

#[derive(Subcommand, Debug)]
enum Sub {
    /// Reserve GPUs for a stretch of time, without a program: yours until
    /// they expire by themselves or `gem-launch release` gives them back;
    /// `gem-schd status` lists them with your user
    #[command(
        override_usage = "gem-launch reserve [--group G] (--gpus N | --gpu-ids 0,2) --duration 4h [--nonblock | --timeout 30m]",
        after_help = EXIT_HELP
    )]
    Reserve {
        /// Group whose MinUtil the reservation claims [default: as for a launch]
        #[arg(long)]
        group: Option<String>,
        /// How many GPUs
        #[arg(long, conflicts_with = "gpu_ids", required_unless_present = "gpu_ids")]
        gpus: Option<u32>,
        /// Which GPUs, e.g. 0,2
        #[arg(long, value_delimiter = ',')]
        gpu_ids: Option<Vec<u32>>,
        /// How long, from when they are yours: e.g. 30m, 4h, 1d (at most 30 days)
        #[arg(long, value_parser = gemini_protocol::units::parse_duration)]
        duration: Duration,
        /// Fail at once when no GPU is free (default: wait in the queue)
        #[arg(long)]
        nonblock: bool,
        /// Give up waiting after this long, e.g. 30m
        #[arg(long, value_parser = gemini_protocol::units::parse_duration)]
        timeout: Option<Duration>,
    },
    /// What you need to know: each GPU, who reserves it and until when,
    /// what runs there and whose, the queue, and your own programs
    #[command(after_help = EXIT_HELP)]
    Status {
        /// Print it as JSON
        #[arg(long)]
        json: bool,
    },
    /// Give back GPUs reserved with `gem-launch reserve` before they expire
    #[command(
        override_usage = "gem-launch release [--gpu-ids 0,2]",
        after_help = EXIT_HELP
    )]
    Release {
        /// Only the reservations holding these GPUs, e.g. 0,2 [default: all of yours]
        #[arg(long, value_delimiter = ',')]
        gpu_ids: Option<Vec<u32>>,
    },
}

fn fail(code: i32, msg: impl std::fmt::Display) -> ! {
    eprintln!("gem-launch: {msg}");
    std::process::exit(code)
}

/// Exits for a connection that failed: permission denied (16) apart
/// from no scheduler answering (11).
fn no_scheduler(e: ClientError) -> ! {
    let code = match e {
        gemini_client::ClientError::Denied(_) => EXIT_DENIED,
        _ => EXIT_NO_SCHEDULER,
    };
    fail(code, e)
}

/// `libgemhook.so` next to this binary's install (`PREFIX/bin/../lib`),
/// beside it (a build directory), or in the usual prefixes.
fn find_hook() -> Option<PathBuf> {
    let exe = std::env::current_exe().ok()?;
    let dir = exe.parent()?;
    // Where the hook's socket library is beside it too (it loads it from
    // its own directory when it first connects).
    [
        dir.join("../lib/libgemhook.so"),
        dir.join("libgemhook.so"),
        "/usr/local/lib/libgemhook.so".into(),
        "/usr/lib/libgemhook.so".into(),
    ]
    .into_iter()
    .find(|p| p.exists() && p.with_file_name("libgemzmq.so").exists())
}

fn user_name() -> Option<String> {
    // SAFETY: getpwuid returns a pointer into static storage or null; we
    // copy the name out at once (single-threaded here).
    unsafe {
        let pw = libc::getpwuid(libc::geteuid());
        if pw.is_null() || (*pw).pw_name.is_null() {
            return std::env::var("USER").ok();
        }
        Some(
            std::ffi::CStr::from_ptr((*pw).pw_name)
                .to_string_lossy()
                .into_owned(),
        )
    }
}

/// The arguments, or exit 2 with clap's message; where the program was
/// not set apart with `--`, says so.
fn parse_args() -> Args {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    match Args::try_parse_from(&argv) {
        Ok(a) => a,
        Err(e) => {
            let forgot_dashes = matches!(
                e.kind(),
                clap::error::ErrorKind::UnknownArgument | clap::error::ErrorKind::InvalidSubcommand
            ) && !argv.iter().any(|a| a == "--");
            let _ = e.print();
            if forgot_dashes {
                eprintln!(
                    "\ntip: put the program after `--`, so that its own options are not taken for gem-launch's:\n  gem-launch --group NAME -- PROGRAM [ARGS]..."
                );
            }
            std::process::exit(e.exit_code());
        }
    }
}

fn main() {
    let args = parse_args();
    let ipc = locate_ipc_dir(
        args.ipc_dir.as_deref().map(Path::as_os_str),
        settings_path(args.settings.as_deref().map(Path::as_os_str)).as_deref(),
    )
    .unwrap_or_else(|e| fail(EXIT_BAD_SETTINGS, e));

    if let Some(Sub::Release { gpu_ids }) = &args.sub {
        release(&ipc, gpu_ids.clone().unwrap_or_default());
        return;
    }
    // Before the scheduler is asked anything: a launch that cannot run
    // fails first.
    let hook = args.sub.is_none().then(|| match args.hook.clone().or_else(find_hook) {
        Some(h) if !h.exists() => fail(
            EXIT_NO_HOOK,
            format!("hook library {} does not exist", h.display()),
        ),
        // (Resolved, as the hook finds it beside the file it was loaded
        // from.)
        Some(h) if !std::fs::canonicalize(&h)
            .unwrap_or_else(|_| h.clone())
            .with_file_name("libgemzmq.so")
            .exists()
            && !h.with_file_name("libgemzmq.so").exists() =>
        {
            fail(
                EXIT_NO_HOOK,
                format!(
                    "libgemzmq.so, the hook's ZeroMQ socket, is not beside {}: install the two side by side, of one build",
                    h.display()
                ),
            )
        }
        Some(h) => h,
        None => fail(
            EXIT_NO_HOOK,
            "libgemhook.so (with libgemzmq.so beside it) not found next to gem-launch or in /usr/local/lib; pass --hook PATH or set GEMINI_HOOK",
        ),
    });
    let mut session = Session::new(&ipc, Role::Control, "");
    let status = match registered(&mut session).request(&Request::Status, Duration::from_secs(3)) {
        Ok(Reply::Status(s)) => s,
        Ok(other) => fail(
            EXIT_NO_SCHEDULER,
            format!("unexpected answer from the scheduler: {other:?}"),
        ),
        Err(e) => no_scheduler(e),
    };

    if let Some(Sub::Status { json }) = &args.sub {
        let v = status::view(&status, &user_name().unwrap_or_default());
        if *json {
            match serde_json::to_string_pretty(&v) {
                Ok(text) => println!("{text}"),
                Err(e) => fail(EXIT_NO_SCHEDULER, e),
            }
        } else {
            print!("{}", status::render(&v));
        }
        return;
    }
    if let Some(Sub::Reserve {
        group,
        gpus,
        gpu_ids,
        duration,
        nonblock,
        timeout,
    }) = &args.sub
    {
        let group = choose_group(group.clone(), &status);
        let gpus = gpu_request(*gpus, gpu_ids.clone()).unwrap_or_else(|| {
            fail(
                EXIT_BAD_SETTINGS,
                "say how many GPUs (--gpus N) or which (--gpu-ids 0,2)",
            )
        });
        let duration_us = duration.as_micros().min(u64::MAX as u128) as u64;
        let ask = Request::ReserveFor {
            group: group.clone(),
            gpus,
            duration_us,
            wait: !nonblock,
        };
        let devices = reserve(&mut session, &group, ask, *timeout);
        let list: Vec<String> = devices.iter().map(u32::to_string).collect();
        let until = std::time::SystemTime::now() + *duration;
        println!(
            "GPU(s) {} reserved for group {group:?} until {} ({}); `gem-launch release` gives them back earlier",
            list.join(","),
            humantime::format_rfc3339_seconds(until),
            humantime::format_duration(*duration)
        );
        println!(
            "run programs there with: CUDA_VISIBLE_DEVICES={} CUDA_DEVICE_ORDER=PCI_BUS_ID gem-launch --group {group} -- PROGRAM",
            list.join(",")
        );
        return;
    }
    let Some(hook) = hook else {
        return; // a subcommand, done above
    };
    let group = choose_group(args.group.clone(), &status);
    let gpus = gpu_request(args.gpus, args.gpu_ids.clone());
    let mut cmd = std::process::Command::new(&args.command[0]);
    cmd.args(&args.command[1..]);
    if let Some(gpus) = gpus {
        let ask = Request::Reserve {
            group: group.clone(),
            gpus,
            wait: !args.nonblock,
        };
        let devices = reserve(&mut session, &group, ask, args.timeout);
        let list: Vec<String> = devices.iter().map(u32::to_string).collect();
        // The indices are the machine's own (nvidia-smi's, the
        // scheduler's): in PCI bus order, which CUDA follows only when
        // asked to (its default puts the fastest GPU first).
        cmd.env("CUDA_VISIBLE_DEVICES", list.join(","))
            .env("CUDA_DEVICE_ORDER", "PCI_BUS_ID");
    }
    let preload = match std::env::var("LD_PRELOAD") {
        Ok(p) if !p.is_empty() => format!("{} {p}", hook.display()),
        _ => hook.display().to_string(),
    };
    cmd.env("LD_PRELOAD", preload)
        .env(env::GROUP_NAME, &group)
        .env(env::IPC_DIR, &ipc);
    if let Some(job) = &args.job {
        cmd.env(env::JOB, job);
    }
    let err = cmd.exec();
    let code = if err.kind() == std::io::ErrorKind::NotFound {
        EXIT_NOT_FOUND
    } else {
        EXIT_NOT_EXECUTABLE
    };
    fail(code, format!("cannot run {}: {err}", args.command[0]));
}

/// The GPUs `--gpus N` or `--gpu-ids …` ask for, if either is given.
fn gpu_request(count: Option<u32>, ids: Option<Vec<u32>>) -> Option<GpuRequest> {
    match (count, ids) {
        (Some(n), _) => Some(GpuRequest::Count(n)),
        (None, ids) => ids.map(GpuRequest::Ids),
    }
}

/// The group: `given`, else `$GEMINI_GROUP_NAME`, else the user's name;
/// exits where the scheduler does not know it.
fn choose_group(given: Option<String>, status: &gemini_protocol::StatusReport) -> String {
    let known: Vec<&str> = status.groups.iter().map(|g| g.name.as_str()).collect();
    match given.or_else(|| {
        std::env::var(env::GROUP_NAME)
            .ok()
            .filter(|g| !g.is_empty())
    }) {
        Some(g) if known.contains(&g.as_str()) => g,
        Some(g) => fail(
            EXIT_BAD_GROUP,
            format!(
                "group {g:?} is not defined in {}; groups: {}",
                status.config_path,
                known.join(", ")
            ),
        ),
        None => match user_name() {
            Some(u) if known.contains(&u.as_str()) => u,
            u => fail(
                EXIT_BAD_GROUP,
                format!(
                    "no --group given and no group named after user {:?} in {}; pass --group (groups: {})",
                    u.unwrap_or_default(),
                    status.config_path,
                    known.join(", ")
                ),
            ),
        },
    }
}

/// The session's connection, registered as a control connection; exits
/// when no scheduler answers or it refuses.
fn registered(session: &mut Session) -> &mut Client {
    match session.register(&[]) {
        Ok(Ok(c)) => c,
        Ok(Err(refused)) => fail(
            EXIT_NO_SCHEDULER,
            format!("the scheduler did not accept the connection: {refused:?}"),
        ),
        Err(e) => no_scheduler(e),
    }
}

/// Reserves GPUs, waiting in the queue if asked; exits on failure.
fn reserve(
    session: &mut Session,
    group: &str,
    ask_for: Request,
    timeout: Option<Duration>,
) -> Vec<u32> {
    // Registers and asks; again after a scheduler restart, which forgets
    // the queue (the new scheduler would never answer the old request).
    // Returns the request's seq and the scheduler's uptime then.
    let ask = |session: &mut Session| -> (u32, u64) {
        let client = registered(session);
        let uptime = match client.request(&Request::Status, Duration::from_secs(3)) {
            Ok(Reply::Status(st)) => st.uptime_us,
            _ => 0,
        };
        let seq = client
            .send(&ask_for)
            .unwrap_or_else(|e| fail(EXIT_NO_SCHEDULER, e));
        (seq, uptime)
    };
    let (mut seq, mut uptime) = ask(session);
    let mut uptime_at = Instant::now();
    let start = Instant::now();
    let mut told = false;
    // While waiting, the scheduler's uptime is asked every few seconds: a
    // scheduler younger than the one asked before has restarted.
    let mut status_seq: Option<u32> = None;
    let mut last_status = Instant::now();
    loop {
        let left = timeout.map(|t| t.saturating_sub(start.elapsed()));
        if left.is_some_and(|l| l.is_zero()) {
            fail(
                EXIT_NO_GPU,
                format!(
                    "no GPU became free within {:?} (--timeout)",
                    timeout.unwrap_or_default()
                ),
            );
        }
        // Say so soon if the request has to wait, then check once a second.
        let step = if told {
            Duration::from_secs(1)
        } else {
            Duration::from_millis(200)
        };
        let step = left.map_or(step, |l| l.min(step));
        match registered(session).recv(step) {
            Ok((s, Reply::Reserved { devices })) if s == seq => {
                if told {
                    eprintln!(
                        "gem-launch: got GPU(s) {devices:?} after {:.1}s",
                        start.elapsed().as_secs_f64()
                    );
                }
                return devices;
            }
            Ok((s, Reply::Error(e))) if s == seq => fail(
                match e.kind {
                    ErrorKind::Unavailable => EXIT_NO_GPU,
                    ErrorKind::UnknownGroup | ErrorKind::PermissionDenied => EXIT_BAD_GROUP,
                    _ => EXIT_REFUSED,
                },
                e.message,
            ),
            Ok((s, Reply::Status(st))) if Some(s) == status_seq => {
                status_seq = None;
                let expected = uptime + uptime_at.elapsed().as_micros() as u64;
                if st.uptime_us + 500_000 < expected {
                    eprintln!("gem-launch: the scheduler restarted; asking again");
                    session.reset();
                    (seq, uptime) = ask(session);
                } else {
                    uptime = st.uptime_us;
                }
                uptime_at = Instant::now();
            }
            Ok(_) => {}
            Err(ClientError::Timeout(_)) => {
                if !told {
                    told = true;
                    eprintln!(
                        "gem-launch: no GPU free for group {group:?}; waiting in the queue (see `gem-schd status`)"
                    );
                }
                if last_status.elapsed() >= Duration::from_secs(2) {
                    last_status = Instant::now();
                    status_seq = registered(session).send(&Request::Status).ok();
                }
            }
            Err(e) => fail(EXIT_NO_SCHEDULER, e),
        }
    }
}

/// Gives back the user's reservations made with `gem-launch reserve`
/// (those holding `devices`; empty: all).
fn release(ipc: &Path, devices: Vec<u32>) {
    let mut session = Session::new(ipc, Role::Control, "");
    let named = !devices.is_empty();
    match registered(&mut session).request(
        &Request::ReleaseReserved { devices },
        Duration::from_secs(3),
    ) {
        Ok(Reply::Released { devices }) if devices.is_empty() => {
            eprintln!(
                "gem-launch: no reservation of yours{} (see `gem-schd status`)",
                if named { " holds those GPUs" } else { "" }
            );
            std::process::exit(EXIT_NOTHING_RESERVED);
        }
        Ok(Reply::Released { devices }) => {
            let list: Vec<String> = devices.iter().map(u32::to_string).collect();
            println!("GPU(s) {} given back", list.join(","));
        }
        Ok(Reply::Error(e)) => fail(EXIT_NO_SCHEDULER, e.message),
        Ok(other) => fail(
            EXIT_NO_SCHEDULER,
            format!("unexpected answer from the scheduler: {other:?}"),
        ),
        Err(e) => fail(EXIT_NO_SCHEDULER, e),
    }
}
