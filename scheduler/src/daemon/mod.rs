//! The daemon: one ZeroMQ ROUTER socket on `ipc://$GEMINI_IPC_DIR/
//! scheduler.sock`, an event loop that decodes requests, feeds them to the
//! [`Policy`] and sends its replies, a watcher that reloads `resource.conf`
//! when it changes, and a liveness check that releases what dead clients
//! held. A bad frame gets an error reply and a log line, never a panic.

mod accounting;
mod driver_limits;
mod ipc;
mod paced;
mod peers;
mod reload;
mod resolve;
mod saved;

use driver_limits::DriverLimits;
use ipc::{IpcAccess, prepare_ipc_dir, scheduler_alive};
use paced::{Paced, Pacer, Turn};
use peers::{PeerCred, Watched, parse_peer_address, peer_of};
use reload::{ConfigWatch, main_is_empty};
use resolve::{Account, Resolver};

use crate::metrics::{Metrics, serve as serve_metrics};
use crate::policy::{Action, Event, Micros, Params, Peer, Policy};
use anyhow::{Context as _, bail};
use gemini_config::{Settings, diff, load_resource};
use gemini_protocol::{
    ClientId, CodecError, DeviceId, ErrorKind, ErrorReply, GpuRequest, MAX_FRAME_BYTES,
    PROTOCOL_VERSION, Reply, Request, Role,
    codec::{frame_version, peek_seq, spoken},
    decode_request_versioned, encode_reply_as,
    endpoint::scheduler_socket_path,
    scheduler_endpoint,
};
use std::collections::HashMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::time::{Duration, Instant};
use tracing::{debug, error, info, warn};

/// Longest sleep of the loop (signals, pid checks without pidfd).
const MAX_POLL: Duration = Duration::from_millis(250);
/// How often the daemon looks for messages while it waits for a deadline
/// less than a millisecond away: the shortest round trip leads are
/// derived from (`gemini_protocol::roundtrip::MIN_NS`), as no hand-over
/// is timed finer.
const SLICE: Duration = Duration::from_nanos(gemini_protocol::roundtrip::MIN_NS);
/// How often the metrics' gauges are rebuilt from the status.
const METRICS_REFRESH: Duration = Duration::from_secs(1);

/// Where a connection is reached. A peer of the socket is named by its
/// ZeroMQ routing id, which the peer may choose (any 1-255 bytes, a zero
/// byte first included); a stand-in the daemon keeps for a process after
/// a restart is not a peer at all, so no routing id can name it, and its
/// replies go nowhere.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum Route {
    /// A peer, by its routing id.
    Peer(Vec<u8>),
    /// The stand-in holding a restored reservation of process `pid`.
    Reservation(u32),
    /// The stand-in holding the restored memory of process `pid`.
    Memory(u32),
}

#[derive(Debug)]
struct Conn {
    id: ClientId,
    /// REQ peers put an empty delimiter frame before the body.
    delimited: bool,
    cred: Option<PeerCred>,
    /// Process watched for liveness (after hello).
    pid: Option<u32>,
    /// When its last message came.
    last_seen: Instant,
    /// The protocol version of its last request, which its replies are
    /// written in.
    version: u16,
    /// Its gemini release, as its hello said.
    build: String,
    /// A stand-in's process's start time (`/proc/PID/stat`), which the
    /// process's own hello must match to take its place.
    started: Option<u64>,
}

/// How long a peer refused for its protocol version stays in the status
/// after its last try (a hook waiting for a scheduler it can speak to says
/// hello again at most every 32 s).
const REFUSED_SHOWN: Duration = Duration::from_secs(120);

/// The most refused peers listed (bounded whatever peers do).
const MAX_REFUSED: usize = 256;

/// The most connections one process may register (say hello on).
const MAX_CONNS_PER_PROCESS: usize = 16;

/// The most connections of one user that never said hello kept at once:
/// past it, its least recently heard one is forgotten (one that speaks
/// again is simply new).
const MAX_QUIET_CONNS_PER_USER: usize = 256;

/// A peer refused for its protocol version: who (as it connected), the
/// version, and when.
#[derive(Debug)]
struct Refused {
    pid: u32,
    user: String,
    protocol: u16,
    at: Instant,
}

/// The most messages read in one turn of the loop before its deadlines
/// (tokens' ends, hand-overs) are looked at again: a flood of requests
/// delays a grant by at most this many messages' handling.
const MAX_BATCH: usize = 64;

/// What a user other than root and the daemon's may make the log say
/// about its connections (refusals, joins, ends): [`LOG_BURST`] lines, then
/// one every [`LOG_EVERY`]; the rest go to the debug level. A flood of
/// connections and bad frames wrote thousands of lines a second.
#[derive(Debug, Default)]
struct LogBudget(HashMap<u32, (u32, Instant)>);

/// Lines a user's connections may log at once.
const LOG_BURST: u32 = 20;
/// How often a user's connections may log once the burst is spent.
const LOG_EVERY: Duration = Duration::from_secs(1);

impl LogBudget {
    /// Whether a line about a connection of `uid` is logged at its level.
    fn allows(&mut self, uid: u32) -> bool {
        let now = Instant::now();
        if self.0.len() > 4096 {
            self.0.clear();
        }
        let (left, since) = self.0.entry(uid).or_insert((LOG_BURST, now));
        let earned = (now.duration_since(*since).as_secs_f64() / LOG_EVERY.as_secs_f64()) as u32;
        if earned > 0 {
            *left = (*left + earned).min(LOG_BURST);
            *since = now;
        }
        if *left == 0 {
            return false;
        }
        *left -= 1;
        true
    }
}

/// The running daemon.
pub struct Daemon {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    socket_path: PathBuf,
    policy: Policy,
    config_path: PathBuf,
    config_error: Option<String>,
    /// `CLOCK_MONOTONIC` (µs) when the daemon started: the policy's time
    /// 0, and what clients' measured spans are rebased by.
    epoch_us: Micros,
    conns: HashMap<Route, Conn>,
    ids: HashMap<ClientId, Route>,
    next_id: ClientId,
    watched: HashMap<u32, Watched>,
    last_pid_poll: Instant,
    /// When connections that never said hello were last looked at.
    last_quiet_sweep: Instant,
    watch: ConfigWatch,
    /// When the watch was last checked for a directory made again.
    last_watch_check: Instant,
    /// The reservations as last written to the state file (`None`: not
    /// written yet).
    saved_reservations: Option<saved::SavedState>,
    /// The memory as last written to its state file, and when it was
    /// last looked at.
    saved_memory: Option<Vec<crate::policy::ProcessMemory>>,
    /// What contexts took, as last written to their state file.
    saved_contexts: Option<Vec<(u32, DeviceId, u64)>>,
    last_memory_save: Instant,
    reload_due: Option<Instant>,
    /// resource.conf itself had content at the last good load (groups may
    /// come from its drop-in files alone).
    main_had_text: bool,
    stop: Arc<AtomicBool>,
    /// Set by SIGHUP: re-read resource.conf now.
    hup: Arc<AtomicBool>,
    ipc_dir: PathBuf,
    endpoint: String,
    access: IpcAccess,
    last_socket_check: Instant,
    /// Prometheus metrics (`--metrics`), the last refresh of their
    /// gauges, and when each pending token request arrived.
    metrics: Option<Arc<Metrics>>,
    last_metrics: Instant,
    asked: HashMap<(ClientId, u32), Instant>,
    /// The machine's GPUs: UUID → index (`Request::Gpus`).
    gpus: HashMap<String, DeviceId>,
    /// The machine's GPUs' memory, by index (for `MemoryLimit` warnings).
    gpu_memory: Vec<(DeviceId, u64)>,
    /// NVML, for each GPU's free memory in the status (`None`: none), and
    /// what it last said, by GPU: `(total, free)`, and when.
    nvml: Option<nvml_wrapper::Nvml>,
    gpu_memory_now: (HashMap<DeviceId, (u64, u64)>, Option<Instant>),
    /// Where the `MemoryLimit`s add up past a GPU, as last said.
    overcommit: Vec<String>,
    /// The driver's per-cgroup memory limits, where it has them.
    driver_limits: DriverLimits,
    /// A client asked to stop (and was allowed to).
    stopping: bool,
    /// Peers refused for their protocol version, as the status lists them.
    refused: HashMap<ClientId, Refused>,
    /// Who peers' users are, looked up off the loop.
    resolver: Resolver,
    /// Status answers, paced per connection or user.
    paced: Paced,
    /// Log lines about other users' connections, rationed.
    log_budget: LogBudget,
    /// The accounting log (`None`: off).
    accounting: Option<accounting::Accounting>,
    /// Serve peers the kernel does not name (`allow_unverified_peers`).
    allow_unverified: bool,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("socket", &self.socket_path)
            .finish_non_exhaustive()
    }
}

/// The machine's GPUs as NVML lists them, by NVML index (the numbering
/// the scheduler, `nvidia-smi` and `resource.conf` use): UUID (`GPU-…`)
/// and memory in bytes. Empty without NVML (`libnvidia-ml.so.1`).
pub fn nvml_gpus() -> Vec<(DeviceId, String, u64)> {
    let nvml = match nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
        .init()
    {
        Ok(n) => n,
        Err(e) => {
            debug!("no NVML ({e}): clients number the GPUs themselves");
            return Vec::new();
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    (0..count)
        .filter_map(|i| {
            let d = nvml.device_by_index(i).ok()?;
            let memory = d.memory_info().map_or(0, |m| m.total);
            Some((i, d.uuid().ok()?, memory))
        })
        .collect()
}

/// Says (as warnings) where the groups' `MemoryLimit`s add up to more than
/// a GPU has (see `ResourceConfig::memory_overcommit`), but what `said`
/// says already (the last configuration's): a reload that changes
/// something else does not repeat it. Returns what is to be said now.
fn warn_overcommit(
    config: &gemini_config::ResourceConfig,
    memory: &[(DeviceId, u64)],
    said: &[String],
) -> Vec<String> {
    let lines = config.memory_overcommit(memory);
    for line in lines.iter().filter(|l| !said.contains(l)) {
        // (The log says WARN: not "warning:" twice.)
        warn!("{}", line.strip_prefix("warning: ").unwrap_or(line));
    }
    lines
}

/// `pid`'s command line as /proc shows it, its arguments joined by
/// spaces, cut to 120 bytes (empty where it cannot be read). Read once,
/// when a process joins: reading it takes the process's mmap lock, which
/// a busy CUDA process may hold a while.
fn command_line(pid: u32) -> String {
    const MAX: usize = 120;
    // At most what is shown: a command line may be megabytes long.
    let mut raw = Vec::with_capacity(MAX + 1);
    let read = std::fs::File::open(format!("/proc/{pid}/cmdline")).and_then(|f| {
        use std::io::Read as _;
        f.take(MAX as u64 + 1).read_to_end(&mut raw)
    });
    if read.is_err() {
        return String::new();
    }
    let args: Vec<String> = raw
        .split(|&b| b == 0)
        .filter(|a| !a.is_empty())
        .map(|a| String::from_utf8_lossy(a).into_owned())
        .collect();
    let mut line = args.join(" ");
    if line.len() > MAX {
        let mut end = MAX;
        while !line.is_char_boundary(end) {
            end -= 1;
        }
        line.truncate(end);
        line.push('…');
    }
    line
}

/// Why gem-schd did not start: its resource.conf is invalid (the error's
/// context, so that the command exits with the status that says so).
#[derive(Debug, Clone, Copy)]
pub struct InvalidConfig;

impl std::fmt::Display for InvalidConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("invalid configuration; gem-schd did not start")
    }
}

/// Number of NVIDIA GPUs the kernel driver lists (no CUDA library needed).
fn detect_gpus() -> u32 {
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map_or(0, |d| d.filter_map(Result::ok).count() as u32)
}

/// Seeds the C library's `rand()`, from which libzmq 4.3.4 takes the
/// first routing id a ROUTER gives the peers that name none (`\0` and a
/// counter from there), and which it never seeds itself: unseeded, every
/// gem-schd counted from the same place. A peer that took the id libzmq
/// was about to give (any peer may set a `\0` id) made libzmq abort the
/// daemon when it gave that id to the next peer.
fn seed_routing_ids() {
    let mut seed = [0u8; 4];
    // SAFETY: getrandom writes at most `seed.len()` bytes into `seed`.
    let n = unsafe { libc::getrandom(seed.as_mut_ptr().cast(), seed.len(), 0) };
    let seed = if n == seed.len() as isize {
        u32::from_ne_bytes(seed)
    } else {
        // No getrandom: the clock's nanoseconds and the pid.
        let t = gemini_protocol::clock::monotonic_us();
        (t as u32) ^ std::process::id().rotate_left(16)
    };
    // SAFETY: srand only sets the C library's generator state; gem-schd
    // calls rand() from no other thread while it starts.
    unsafe { libc::srand(seed) };
}

fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
}

/// Root or the daemon's own user (the policy's `trusted`): exempt from the
/// limits the daemon puts on other users' connections.
fn trusted_uid(uid: u32) -> bool {
    uid == 0 || uid == euid()
}

impl Daemon {
    /// Reads the configuration, binds the socket and starts watching.
    pub fn start(
        settings: &Settings,
        ipc_dir: &Path,
        stop: Arc<AtomicBool>,
    ) -> anyhow::Result<Daemon> {
        let hup = Arc::new(AtomicBool::new(false));
        signal_hook::flag::register(signal_hook::consts::SIGHUP, Arc::clone(&hup))
            .context("cannot install the SIGHUP handler")?;
        let config_path = settings.config.clone();
        let (config, warnings) = load_resource(&config_path)
            .map_err(|e| anyhow::anyhow!("{e}"))
            .context(InvalidConfig)?;
        for w in &warnings {
            warn!("{w}");
        }
        let access = IpcAccess::from_settings(settings)?;
        prepare_ipc_dir(ipc_dir, access)?;
        if scheduler_alive(ipc_dir) {
            bail!(
                "another gem-schd is already running in {} (stop it with `gem-schd shutdown`)",
                ipc_dir.display()
            );
        }
        let endpoint = scheduler_endpoint(ipc_dir)?;
        seed_routing_ids();
        let ctx = zmq::Context::new();
        peers::check_peer_credentials(&ctx, ipc_dir, settings.allow_unverified_peers)?;
        let sock = ctx.socket(zmq::ROUTER)?;
        sock.set_linger(0)?;
        sock.set_maxmsgsize(MAX_FRAME_BYTES as i64)?;
        // A reply to a peer that vanished is dropped, not an error.
        sock.set_router_mandatory(false)?;
        sock.bind(&endpoint)
            .with_context(|| format!("cannot bind {endpoint}"))?;
        let socket_path = scheduler_socket_path(ipc_dir);
        access.apply(&socket_path, access.socket_mode())?;
        let watch = match ConfigWatch::new(&config_path) {
            Ok(w) => w,
            Err(e) => {
                warn!("{e:#}; resource.conf will be reloaded once its directory can be watched");
                ConfigWatch::none()
            }
        };
        let gpus = nvml_gpus();
        let mut params = Params::from_settings(settings);
        if settings.devices.is_none() {
            // The kernel driver's list, or NVML's where /proc has none
            // (some containers).
            params.devices = match detect_gpus() {
                0 => gpus.len() as u32,
                n => n,
            };
        }
        params.admin_uid = euid();
        let metrics = match settings.metrics {
            Some(addr) => {
                let m = Arc::new(Metrics::new());
                let bound = serve_metrics(addr, Arc::clone(&m))?;
                info!("metrics at http://{bound}/metrics");
                Some(m)
            }
            None => None,
        };
        info!(
            "gem-schd {} listening on {endpoint}; {} group(s) from {}; {} GPU(s) for reservations",
            env!("CARGO_PKG_VERSION"),
            config.groups.len(),
            config_path.display(),
            params.devices
        );
        let mut driver_limits = DriverLimits::start(ipc_dir);
        driver_limits.apply(&config);
        let gpu_memory: Vec<(DeviceId, u64)> = gpus.iter().map(|(i, _, m)| (*i, *m)).collect();
        let overcommit = warn_overcommit(&config, &gpu_memory, &[]);
        Ok(Daemon {
            _ctx: ctx,
            sock,
            socket_path,
            policy: Policy::new(params, config),
            config_path,
            config_error: None,
            epoch_us: gemini_protocol::clock::monotonic_us(),
            conns: HashMap::new(),
            ids: HashMap::new(),
            next_id: 1,
            watched: HashMap::new(),
            last_pid_poll: Instant::now(),
            last_quiet_sweep: Instant::now(),
            watch,
            last_watch_check: Instant::now(),
            saved_reservations: None,
            saved_memory: None,
            saved_contexts: None,
            last_memory_save: Instant::now(),
            refused: HashMap::new(),
            resolver: Resolver::start()?,
            paced: Paced::default(),
            log_budget: LogBudget::default(),
            reload_due: None,
            main_had_text: !main_is_empty(&settings.config),
            stop,
            hup,
            ipc_dir: ipc_dir.to_path_buf(),
            endpoint,
            access,
            last_socket_check: Instant::now(),
            metrics,
            last_metrics: Instant::now(),
            asked: HashMap::new(),
            gpu_memory,
            nvml: nvml_wrapper::Nvml::builder()
                .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
                .init()
                .ok(),
            gpu_memory_now: (HashMap::new(), None),
            overcommit,
            gpus: gpus.into_iter().map(|(i, uuid, _)| (uuid, i)).collect(),
            driver_limits,
            stopping: false,
            accounting: settings.accounting.path(ipc_dir).map(|p| {
                info!("accounting log: {}", p.display());
                accounting::Accounting::new(p, settings.accounting_max_size)
            }),
            allow_unverified: settings.allow_unverified_peers,
        })
    }

    /// Writes the programs that ended, and the usage when it is due, to
    /// the accounting log.
    fn account(&mut self) {
        let ended = self.policy.take_ended();
        let Some(a) = &mut self.accounting else {
            return;
        };
        if !ended.is_empty() {
            a.programs_ended(&ended);
        }
        if a.due() {
            let now = gemini_protocol::clock::monotonic_us().saturating_sub(self.epoch_us);
            a.usage(&self.policy.counters(now), false);
        }
    }

    /// The work a report says ran in the gap between the gem-schd before
    /// this one and this one's start, for the accounting log: neither
    /// ledger has it (the one before charged its clients to its stop;
    /// this one takes reports from its start).
    fn account_gap(&mut self, client: ClientId, req: &Request) {
        let (device, ran) = match req {
            Request::AcquireToken { device, ran, .. }
            | Request::ReleaseToken { device, ran, .. }
            | Request::LateUsage { device, ran, .. } => (*device, ran),
            _ => return,
        };
        // Nothing to look up once the gap is written (after the first
        // minute), nor for a program that held no token at the stop.
        let Some(a) = self.accounting.as_mut().filter(|a| a.gap_open()) else {
            return;
        };
        let Some(pid) = self.policy.client_pid(client) else {
            return;
        };
        let Some(from) = a.gap_start(pid, device, self.epoch_us) else {
            return;
        };
        let to = self.epoch_us;
        let mut spans: Vec<(Micros, Micros)> = ran
            .iter()
            .map(|s| (s.start_us.max(from), s.end_us.min(to)))
            .filter(|(b, e)| e > b)
            .collect();
        spans.sort_unstable();
        if let Some(p) = self.policy.program(client)
            && !spans.is_empty()
        {
            a.before_start(&p, device, &spans, to - from);
        }
    }

    /// Refreshes the metrics' gauges about once a second.
    fn refresh_metrics(&mut self) {
        let Some(m) = self.metrics.clone() else {
            return;
        };
        if self.last_metrics.elapsed() < METRICS_REFRESH {
            return;
        }
        self.last_metrics = Instant::now();
        let report = self.status_report();
        m.refresh(&report, &self.policy.counters(self.now()));
    }

    /// The status: the policy's, the configuration's error and the
    /// driver's limits.
    fn status_report(&mut self) -> gemini_protocol::StatusReport {
        let mut report = self.policy.status(self.now());
        report.config_error = self.config_error.clone();
        self.driver_limits.report(&mut report);
        // Each GPU's memory, as the driver counts it (every process's,
        // gemini's or not), asked of NVML at most once a second: an NVML
        // call may wait behind other NVML users (DCGM, nvidia-smi), and
        // statuses come by the hundred a second.
        let (known, asked) = &mut self.gpu_memory_now;
        if let Some(nvml) = &self.nvml
            && asked.is_none_or(|t| t.elapsed() >= Duration::from_secs(1))
        {
            *asked = Some(Instant::now());
            known.clear();
            for d in &report.devices {
                if let Ok(m) = nvml.device_by_index(d.device).and_then(|h| h.memory_info()) {
                    known.insert(d.device, (m.total, m.free));
                }
            }
        }
        for d in &mut report.devices {
            if let Some(&(total, free)) = known.get(&d.device) {
                d.memory_total = Some(total);
                d.memory_free = Some(free);
            }
        }
        report
    }

    fn now(&self) -> Micros {
        gemini_protocol::clock::monotonic_us().saturating_sub(self.epoch_us)
    }

    /// Runs until shutdown is asked or a signal arrives.
    pub fn run(mut self) -> anyhow::Result<()> {
        self.restore_reservations();
        self.restore_contexts();
        self.restore_memory();
        while !self.stop.load(Ordering::Relaxed) {
            let now = self.now();
            let mut timeout = MAX_POLL;
            if let Some(d) = self.policy.next_deadline(now) {
                timeout = timeout.min(Duration::from_micros(d.saturating_sub(now)));
            }
            if let Some(due) = self.reload_due {
                timeout = timeout.min(due.saturating_duration_since(Instant::now()));
            }
            if let Some(due) = self.paced.next_due() {
                timeout = timeout.min(due.saturating_duration_since(Instant::now()));
            }
            let pids: Vec<(u32, i32)> = self
                .watched
                .iter()
                .filter_map(|(&pid, w)| w.pidfd.as_ref().map(|fd| (pid, fd.as_raw_fd())))
                .collect();
            let (sock_ready, resolved, dead, watch_ready) = {
                let mut items = Vec::with_capacity(3 + pids.len());
                items.push(self.sock.as_poll_item(zmq::POLLIN));
                items.push(zmq::PollItem::from_fd(self.resolver.wake_fd(), zmq::POLLIN));
                for &(_, fd) in &pids {
                    items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
                }
                // resource.conf's watch, last (read in check_reload).
                if let Some(fd) = self.watch.fd() {
                    items.push(zmq::PollItem::from_fd(fd, zmq::POLLIN));
                }
                // zmq_poll counts whole milliseconds. A deadline (a token's
                // end, a hand-over) is met to about a tenth of one: poll for
                // the whole milliseconds before it, then look again every
                // SLICE until it, so it is neither up to 1 ms late
                // (rounding up) nor spun on (rounding down to 0), and a
                // message arriving meanwhile waits at most a slice.
                let until = Instant::now() + timeout;
                let mut ms = timeout.as_millis() as i64;
                loop {
                    let ready = match zmq::poll(&mut items, ms) {
                        Ok(n) => n,
                        Err(zmq::Error::EINTR) => 1,
                        Err(e) => return Err(e).context("poll failed"),
                    };
                    let left = until.saturating_duration_since(Instant::now());
                    if ready > 0 || ms > 0 || left.is_zero() {
                        break;
                    }
                    std::thread::sleep(left.min(SLICE));
                    ms = 0;
                }
                let dead: Vec<u32> = pids
                    .iter()
                    .zip(&items[2..])
                    .filter(|(_, it)| it.is_readable())
                    .map(|(p, _)| p.0)
                    .collect();
                let watched = items.get(2 + pids.len()).is_some_and(|it| it.is_readable());
                (
                    items[0].is_readable(),
                    items[1].is_readable(),
                    dead,
                    watched,
                )
            };
            let busy_since = Instant::now();
            if resolved && self.resolved() {
                break;
            }
            if sock_ready && self.drain_socket()? {
                break;
            }
            for (client, seq) in self.paced.due(Instant::now()) {
                self.answer_status(client, seq);
            }
            for pid in dead {
                self.process_gone(pid);
            }
            self.poll_pids_without_fd();
            self.forget_quiet_conns();
            self.check_reload(watch_ready);
            self.check_socket();
            let now = self.now();
            let actions = self.policy.handle(Event::Tick, now);
            self.send_actions(actions);
            self.save_reservations();
            self.account();
            self.save_memory(false);
            self.driver_limits.poll();
            self.refresh_metrics();
            if let Some(m) = &self.metrics {
                m.loop_busy(busy_since.elapsed().as_secs_f64());
            }
        }
        info!("gem-schd stopping");
        // What each process holds, for the next gem-schd (an upgrade).
        self.save_memory(true);

        // What each group was charged, for the record (and for the tests'
        // check that no kernel ran outside its group's tokens).
        let now = self.now();
        for c in self.policy.counters(now) {
            info!(
                "charged: group {:?} device {} {} us",
                c.group, c.device, c.used_us
            );
        }
        // The accounting log: with what the clients ran under their last
        // tokens and have not reported (the next gem-schd takes reports
        // only from its own start).
        let ended = self.policy.take_ended();
        if let Some(a) = &mut self.accounting {
            // With each process's start time: a pid reused by the next
            // gem-schd's time is not the holder's.
            let holders: Vec<[u64; 3]> = self
                .policy
                .token_holders()
                .into_iter()
                .filter_map(|[pid, gpu]| {
                    Some([
                        u64::from(pid),
                        u64::from(gpu),
                        saved::process_start_time(pid)?,
                    ])
                })
                .collect();
            self.policy.settle(now);
            a.programs_ended(&ended);
            a.stop(
                &self.policy.counters(now),
                holders,
                now.saturating_add(self.epoch_us),
            );
        }
        // Tell the holder to let go of everything, and give the message
        // time to leave before the socket closes.
        let actions = self.policy.shutdown();
        let _ = self.sock.set_linger(500);
        self.send_actions(actions);
        Ok(())
    }

    /// Reads the pending messages, [`MAX_BATCH`] at most. Returns true
    /// when shutdown was asked.
    fn drain_socket(&mut self) -> anyhow::Result<bool> {
        for _ in 0..MAX_BATCH {
            let mut frames: Vec<zmq::Message> = Vec::with_capacity(3);
            loop {
                let mut msg = zmq::Message::new();
                match self.sock.recv(&mut msg, zmq::DONTWAIT) {
                    Ok(()) => {}
                    Err(zmq::Error::EAGAIN) if frames.is_empty() => return Ok(false),
                    Err(zmq::Error::EINTR) => continue,
                    Err(e) => return Err(e).context("receive failed"),
                }
                let more = msg.get_more();
                frames.push(msg);
                if !more {
                    break;
                }
            }
            self.on_message(frames);
            if self.stopping {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// Handles the messages that waited for their users to be looked up.
    fn resolved(&mut self) -> bool {
        for frames in self.resolver.collect() {
            self.on_message(frames);
            if self.stopping {
                return true;
            }
        }
        false
    }

    /// Handles one multipart message: `[identity, (empty,) body]`.
    fn on_message(&mut self, mut frames: Vec<zmq::Message>) {
        if frames.len() < 2 {
            return;
        }
        let identity = Route::Peer(frames[0].to_vec());
        let delimited = frames.len() == 3 && frames[1].is_empty();
        let last = frames.len() - 1;
        let cred = frames[last]
            .gets("Peer-Address")
            .and_then(parse_peer_address);
        if frames.len() > 3 || (frames.len() == 3 && !delimited) {
            if cred.is_none_or(|c| self.loud_uid(c.uid)) {
                warn!("dropping a message of {} frames from a peer", frames.len());
            }
            return;
        }
        if cred.is_none() && !self.allow_unverified {
            self.refuse_unverified(&identity, delimited, &frames[last]);
            return;
        }
        // A routing id names a connection only while that peer has it:
        // ZeroMQ gives a closed peer's id to a new peer that asks for it.
        // A message whose kernel credentials are not the connection's is
        // a new peer's, and the old connection (its rights with it) goes.
        if self
            .conns
            .get(&identity)
            .is_some_and(|c| cred.is_some() && c.cred != cred)
        {
            debug!(
                "a new peer took the routing id of a closed one; the old connection is forgotten"
            );
            self.forget(&identity);
        }
        let known = self.conns.get_mut(&identity).map(|conn| {
            conn.last_seen = Instant::now();
            conn.id
        });
        // A new connection's user is looked up off the loop: its messages
        // wait for the answer, behind those of its user that wait already.
        let account = match (known, cred) {
            (None, Some(c)) => match self.resolver.get(c.uid, c.gid) {
                Some(a) if !self.resolver.holds(c.uid, c.gid) => Some((c, a)),
                _ => {
                    if !self.resolver.hold(c.uid, c.gid, frames) {
                        debug!(
                            "a message of uid {} dropped: too many wait for its user",
                            c.uid
                        );
                    }
                    return;
                }
            },
            _ => None,
        };
        let body = frames[last].to_vec();
        let client = match known {
            Some(id) => id,
            None => self.connected(identity, delimited, account),
        };
        // Answered in the version it spoke, even where the body cannot be
        // read (a Malformed error in another version would be unreadable).
        if let Some(version) = frame_version(&body).filter(|v| spoken(*v))
            && let Some(conn) = self.ids.get(&client).and_then(|i| self.conns.get_mut(i))
        {
            conn.version = version;
        }
        match decode_request_versioned(&body) {
            Ok((version, seq, req)) => {
                self.refused.remove(&client);
                if let Request::Hello { build, .. } = &req
                    && let Some(conn) = self.ids.get(&client).and_then(|i| self.conns.get_mut(i))
                {
                    conn.build = if build.is_empty() {
                        gemini_protocol::legacy::release_of(version)
                            .unwrap_or_default()
                            .to_string()
                    } else {
                        build.clone()
                    };
                }
                let t = Instant::now();
                self.on_request(client, seq, req);
                if let Some(m) = &self.metrics {
                    m.handled(t.elapsed().as_secs_f64());
                }
            }
            Err(e) => {
                let kind = match e {
                    CodecError::VersionMismatch { peer, .. } => {
                        self.refused_peer(client, peer);
                        ErrorKind::ProtocolMismatch
                    }
                    _ => ErrorKind::Malformed,
                };
                self.refused_metric(kind);
                if self.loud(client) {
                    warn!("client {client}: {e}");
                } else {
                    debug!("client {client}: {e}");
                }
                let seq = peek_seq(&body).unwrap_or(0);
                self.reply(
                    client,
                    seq,
                    &Reply::Error(ErrorReply {
                        kind,
                        message: e.to_string(),
                    }),
                );
            }
        }
    }

    /// A new connection: numbered, and its peer (where the kernel names
    /// it) told to the policy.
    fn connected(
        &mut self,
        identity: Route,
        delimited: bool,
        peer: Option<(PeerCred, Account)>,
    ) -> ClientId {
        let cred = peer.as_ref().map(|(c, _)| *c);
        if let Some(c) = cred {
            self.forget_quiet_beyond(c.uid);
        }
        let id = self.next_id;
        self.next_id += 1;
        self.ids.insert(id, identity.clone());
        self.conns.insert(
            identity,
            Conn {
                id,
                delimited,
                cred,
                pid: None,
                last_seen: Instant::now(),
                version: PROTOCOL_VERSION,
                build: String::new(),
                started: None,
            },
        );
        if let Some((c, account)) = &peer {
            let actions = self.policy.handle(
                Event::Connected {
                    client: id,
                    peer: peer_of(*c, account),
                },
                self.now(),
            );
            self.send_actions(actions);
        }
        id
    }

    /// Who `client` is, for the log.
    fn peer(&self, client: ClientId) -> String {
        self.conn(client)
            .and_then(|c| c.cred)
            .map_or("a peer".into(), |c| {
                format!("pid {} (uid {})", c.pid, c.uid)
            })
    }

    fn on_request(&mut self, client: ClientId, seq: u32, req: Request) {
        debug!("client {client} #{seq}: {req:?}");
        let hello_pid = match req {
            Request::Gpus { uuids } => {
                let devices = uuids.iter().map(|u| self.gpus.get(u).copied()).collect();
                self.reply(client, seq, &Reply::Gpus { devices });
                return;
            }
            Request::Status => {
                let pacer = match self.conn(client).and_then(|c| c.cred) {
                    Some(c) if !trusted_uid(c.uid) => Pacer::User(c.uid),
                    _ => Pacer::Conn(client),
                };
                match self.paced.ask(pacer, client, seq, Instant::now()) {
                    Turn::Now => self.answer_status(client, seq),
                    Turn::Later => {}
                    Turn::Refused => self.refuse_paced(client, seq),
                }
                return;
            }
            Request::AcquireToken { .. } if self.metrics.is_some() => {
                self.asked.insert((client, seq), Instant::now());
                None
            }
            Request::Hello { pid, .. } => {
                if let Some(r) = self.refuse_connections(client) {
                    self.refused_metric(ErrorKind::PermissionDenied);
                    self.reply(client, seq, &r);
                    return;
                }
                Some(pid)
            }
            Request::Shutdown => {
                if self.loud(client) {
                    info!("shutdown requested by {}", self.peer(client));
                }
                None
            }
            _ => None,
        };
        let mut req = req;
        self.account_gap(client, &req);
        rebase(&mut req, self.epoch_us);
        let actions = self
            .policy
            .handle(Event::Request { client, seq, req }, self.now());
        // A process that had its memory restored says hello itself, with
        // what it holds now: once it is welcome, its stand-in goes. (The
        // kernel's pid, where the transport gives it, as the policy takes.)
        if let Some(claimed) = hello_pid
            && self.policy.is_process(client)
            && actions.iter().any(|a| {
                matches!(a, Action::Reply { client: c, reply: Reply::Welcome { .. }, .. } if *c == client)
            })
        {
            let pid = self.conn(client).and_then(|c| c.cred).map_or(claimed, |c| c.pid);
            self.adopt_stand_in(pid);
            if let (Some(a), Some(p)) = (&mut self.accounting, self.policy.program(client)) {
                a.program_start(&p);
            }
        }
        // A hello refused for another reason than a permission (logged
        // with every refusal below): an unknown group, say. Not a hello
        // said again on a connection that said one (a program that
        // started before this scheduler says hello as it comes and again
        // as it learns the scheduler is new): the hook takes that answer
        // as a welcome, and nothing is wrong.
        if let Some(claimed) = hello_pid
            && let Some(e) = actions.iter().find_map(|a| match a {
                Action::Reply {
                    reply: Reply::Error(e),
                    ..
                } if !matches!(
                    e.kind,
                    ErrorKind::PermissionDenied | ErrorKind::AlreadyRegistered
                ) =>
                {
                    Some(e)
                }
                _ => None,
            })
            && self.loud(client)
        {
            warn!("client {client} (pid {claimed}) refused: {}", e.message);
        }
        self.send_actions(actions);
    }

    /// Whether a line about `client` is logged at its level: always for
    /// root's and the daemon's user's connections, within its
    /// [`LogBudget`] for another user's.
    fn loud(&mut self, client: ClientId) -> bool {
        match self.conn(client).and_then(|c| c.cred) {
            Some(c) => self.loud_uid(c.uid),
            None => true,
        }
    }

    /// [`Daemon::loud`] for a peer of `uid`.
    fn loud_uid(&mut self, uid: u32) -> bool {
        trusted_uid(uid) || self.log_budget.allows(uid)
    }

    /// Refuses a hello of `client` where its process (the kernel's pid),
    /// of a user other than root and the daemon's, has
    /// [`MAX_CONNS_PER_PROCESS`] connections that said hello already:
    /// each is kept until the process ends, and one process opening
    /// thousands grew the daemon's state without end (a hooked program
    /// has one, `gem-launch` one; the load tests, as root, many).
    fn refuse_connections(&self, client: ClientId) -> Option<Reply> {
        let cred = self.conn(client)?.cred?;
        if trusted_uid(cred.uid) {
            return None;
        }
        let pid = cred.pid;
        let said = self
            .conns
            .iter()
            .filter(|(route, c)| matches!(route, Route::Peer(_)) && c.pid == Some(pid))
            .count();
        (said >= MAX_CONNS_PER_PROCESS).then(|| {
            Reply::Error(ErrorReply {
                kind: ErrorKind::PermissionDenied,
                message: format!(
                    "pid {pid} has {said} connections registered with the scheduler already, the most one process may have"
                ),
            })
        })
    }

    /// Refuses `client`'s status request `seq`: too many of its pacer's
    /// wait already.
    fn refuse_paced(&mut self, client: ClientId, seq: u32) {
        self.refused_metric(ErrorKind::Unavailable);
        let message = format!(
            "too many status requests wait for this user (one is answered every {:?}); ask again later",
            paced::STATUS_EVERY
        );
        let reply = Reply::Error(ErrorReply {
            kind: ErrorKind::Unavailable,
            message,
        });
        self.reply(client, seq, &reply);
    }

    /// Counts a request refused with `kind`, for the metrics.
    fn refused_metric(&self, kind: ErrorKind) {
        if let Some(m) = &self.metrics {
            m.refused(kind);
        }
    }

    /// Answers `client`'s status request `seq`: the policy's status, with
    /// what the daemon knows of each process.
    fn answer_status(&mut self, client: ClientId, seq: u32) {
        let mut report = self.status_report();
        for c in &mut report.clients {
            if let Some(w) = self.watched.get(&c.pid) {
                c.command.clone_from(&w.command);
            }
            if let Some(conn) = self.conn(c.id) {
                c.protocol = conn.version;
                c.build.clone_from(&conn.build);
            }
        }
        report.refused = self.refused_peers();
        for x in report
            .reservations
            .iter_mut()
            .chain(report.queue.iter_mut())
        {
            if let Some(w) = self.watched.get(&x.pid) {
                x.command.clone_from(&w.command);
            }
        }
        self.reply(client, seq, &Reply::Status(Box::new(report)));
    }

    /// Notes a peer refused for speaking protocol `version`, for the
    /// status: who it is, as it connected (nothing is looked up to list
    /// it). At most [`MAX_REFUSED`], the oldest forgotten first.
    fn refused_peer(&mut self, client: ClientId, version: u16) {
        let now = Instant::now();
        if let Some(r) = self.refused.get_mut(&client) {
            r.protocol = version;
            r.at = now;
            return;
        }
        self.refused
            .retain(|_, r| now.duration_since(r.at) < REFUSED_SHOWN);
        if self.refused.len() >= MAX_REFUSED
            && let Some(oldest) = self
                .refused
                .iter()
                .min_by_key(|(_, r)| r.at)
                .map(|(c, _)| *c)
        {
            self.refused.remove(&oldest);
        }
        let cred = self.conn(client).and_then(|c| c.cred);
        let user = self.policy.peer_user(client).unwrap_or_default();
        self.refused.insert(
            client,
            Refused {
                pid: cred.map_or(0, |c| c.pid),
                user,
                protocol: version,
                at: now,
            },
        );
    }

    /// The peers refused for their version lately, for the status.
    fn refused_peers(&self) -> Vec<gemini_protocol::RefusedPeer> {
        let now = Instant::now();
        let mut out: Vec<gemini_protocol::RefusedPeer> = self
            .refused
            .values()
            .filter(|r| now.duration_since(r.at) < REFUSED_SHOWN)
            .map(|r| gemini_protocol::RefusedPeer {
                pid: r.pid,
                user: r.user.clone(),
                protocol: r.protocol,
                ago_us: now.duration_since(r.at).as_micros() as u64,
            })
            .collect();
        out.sort_by_key(|r| r.ago_us);
        out
    }

    fn conn(&self, client: ClientId) -> Option<&Conn> {
        self.ids.get(&client).and_then(|i| self.conns.get(i))
    }

    /// Does what the policy asks.
    fn send_actions(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Reply { client, seq, reply } => {
                    if let Reply::Error(e) = &reply
                        && e.kind == ErrorKind::PermissionDenied
                    {
                        self.refused_metric(e.kind);
                        if self.loud(client) {
                            warn!(
                                "{} (client {client}) refused: {}",
                                self.peer(client),
                                e.message
                            );
                        }
                    }
                    self.reply(client, seq, &reply);
                }
                Action::Watch { client, pid } => {
                    // Said after a welcome only: the client has joined
                    // (its group shows the holder and control roles).
                    let group = self.policy.client_group(client).unwrap_or_default();
                    if self.loud(client) {
                        info!("client {client} joined: pid {pid}, group {group:?}");
                    } else {
                        debug!("client {client} joined: pid {pid}, group {group:?}");
                    }
                    self.watch(client, pid);
                }
                Action::Reload { client, seq } => {
                    info!(
                        "reload of {} requested by {}",
                        self.config_path.display(),
                        self.peer(client)
                    );
                    self.reload_due = None;
                    let reply = match self.reload() {
                        Ok(()) => Reply::Done,
                        Err(message) => Reply::Error(ErrorReply {
                            kind: ErrorKind::BadRequest,
                            message: format!(
                                "{message}\nthe previous configuration stays in force"
                            ),
                        }),
                    };
                    self.reply(client, seq, &reply);
                }
                Action::Stop => self.stopping = true,
                Action::Clipped {
                    client,
                    device,
                    reports,
                    what,
                } => {
                    if self.loud(client) {
                        warn!(
                            "{} (client {client}) reported device time on GPU {device} that cannot be: \
                             {what}; clipped ({reports} such report(s) so far)",
                            self.peer(client)
                        );
                    }
                }
                Action::Estimated {
                    client,
                    device,
                    from,
                    until,
                    charged,
                } => debug!(
                    "client {client} ended with device time unreported on GPU {device}: \
                     charged {charged} us as estimated, of [{from}, {until})"
                ),
            }
        }
    }

    fn reply(&mut self, client: ClientId, seq: u32, reply: &Reply) {
        if let Some(m) = &self.metrics
            && let Some(asked) = self.asked.remove(&(client, seq))
            && let Reply::Token { device, .. } = reply
            && let Some(group) = self.policy.client_group(client)
        {
            m.granted(&group, *device, asked.elapsed().as_secs_f64());
        }
        let Some(route) = self.ids.get(&client) else {
            return;
        };
        debug!("client {client} #{seq} <- {reply:?}");
        let (delimited, version) = self
            .conns
            .get(route)
            .map_or((false, PROTOCOL_VERSION), |c| (c.delimited, c.version));
        // A stand-in's replies go nowhere.
        let Route::Peer(identity) = route else {
            return;
        };
        let body = encode_reply_as(version, seq, reply);
        if let Err(e) = self.send_to(identity, delimited, &body) {
            debug!("reply to client {client} dropped: {e}");
        }
    }

    /// Sends `body` to the peer of routing id `identity` (after an empty
    /// delimiter frame for a REQ peer), never waiting.
    fn send_to(&self, identity: &[u8], delimited: bool, body: &[u8]) -> zmq::Result<()> {
        if delimited {
            self.sock
                .send_multipart([identity, &[], body], zmq::DONTWAIT)
        } else {
            self.sock.send_multipart([identity, body], zmq::DONTWAIT)
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

/// Puts the spans of `req`, in µs on `CLOCK_MONOTONIC`, on the policy's
/// clock, which began at `epoch_us` (work before it counts as at 0).
fn rebase(req: &mut Request, epoch_us: Micros) {
    let spans = match req {
        Request::AcquireToken { ran, .. }
        | Request::ReleaseToken { ran, .. }
        | Request::LateUsage { ran, .. }
        | Request::UnprovenUsage { ran, .. } => ran,
        _ => return,
    };
    for s in spans {
        s.start_us = s.start_us.saturating_sub(epoch_us);
        s.end_us = s.end_us.saturating_sub(epoch_us);
    }
}
