//! The daemon: one ZeroMQ ROUTER socket on `ipc://$GEMINI_IPC_DIR/
//! scheduler.sock`, an event loop that decodes requests, feeds them to the
//! [`Policy`] and sends its replies, a watcher that reloads `resource.conf`
//! when it changes, and a liveness check that releases what dead clients
//! held. A bad frame gets an error reply and a log line, never a panic.

use crate::metrics::{Metrics, serve as serve_metrics};
use crate::policy::{Action, Event, Micros, Params, Peer, Policy};
use anyhow::{Context as _, bail};
use gemini_config::{Settings, diff, load_resource};
use gemini_protocol::{
    ClientId, CodecError, DeviceId, ErrorKind, ErrorReply, GpuRequest, MAX_FRAME_BYTES, Reply,
    Request, Role, codec::peek_seq, decode_request, encode_reply, endpoint::scheduler_socket_path,
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

/// Quiet time after a change of `resource.conf` before it is read: an
/// editor's save is several events.
const RELOAD_DEBOUNCE: Duration = Duration::from_millis(100);
/// Longest sleep of the loop (signals, pid checks without pidfd).
const MAX_POLL: Duration = Duration::from_millis(250);
/// How often the daemon looks for messages while it waits for a deadline
/// less than a millisecond away.
const SLICE: Duration = Duration::from_micros(100);
/// How often the metrics' gauges are rebuilt from the status.
const METRICS_REFRESH: Duration = Duration::from_secs(1);

/// Credentials of a peer, from the kernel (`SO_PEERCRED`) where libzmq
/// passes them on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct PeerCred {
    uid: u32,
    gid: u32,
    pid: u32,
}

/// Parses libzmq's `Peer-Address` property of an ipc peer: `:uid:gid:pid`.
fn parse_peer_address(s: &str) -> Option<PeerCred> {
    let mut it = s.rsplit(':');
    let pid = it.next()?.parse().ok()?;
    let gid = it.next()?.parse().ok()?;
    let uid = it.next()?.parse().ok()?;
    Some(PeerCred { uid, gid, pid })
}

#[derive(Debug)]
struct Conn {
    id: ClientId,
    /// REQ peers put an empty delimiter frame before the body.
    delimited: bool,
    cred: Option<PeerCred>,
    /// Process watched for liveness (after hello).
    pid: Option<u32>,
}

/// Watches a process: a pidfd when the kernel has them, else polling.
#[derive(Debug)]
struct Watched {
    pidfd: Option<OwnedFd>,
}

/// The running daemon.
pub struct Daemon {
    _ctx: zmq::Context,
    sock: zmq::Socket,
    socket_path: PathBuf,
    policy: Policy,
    config_path: PathBuf,
    config_error: Option<String>,
    start: Instant,
    conns: HashMap<Vec<u8>, Conn>,
    ids: HashMap<ClientId, Vec<u8>>,
    next_id: ClientId,
    watched: HashMap<u32, Watched>,
    last_pid_poll: Instant,
    watch: ConfigWatch,
    /// When the watch was last checked for a directory made again.
    last_watch_check: Instant,
    /// The reservations as last written to the state file (`None`: not
    /// written yet).
    saved_reservations: Option<Vec<(ClientId, String, Vec<u32>)>>,
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
    /// A client asked to stop (and was allowed to).
    stopping: bool,
}

impl std::fmt::Debug for Daemon {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Daemon")
            .field("socket", &self.socket_path)
            .finish_non_exhaustive()
    }
}

/// Who may connect: the daemon's user only (directory 0700, socket 0700),
/// or also the members of one Unix group (0750 / 0770). Nobody else can
/// write to either.
#[derive(Debug, Clone, Copy)]
struct IpcAccess {
    group: Option<nix::unistd::Gid>,
}

impl IpcAccess {
    fn from_settings(settings: &Settings) -> anyhow::Result<IpcAccess> {
        let group = match &settings.ipc_group {
            None => None,
            Some(name) => Some(
                nix::unistd::Group::from_name(name)
                    .with_context(|| format!("cannot look up Unix group {name:?} (ipc_group)"))?
                    .with_context(|| format!("Unix group {name:?} (ipc_group) does not exist"))?
                    .gid,
            ),
        };
        Ok(IpcAccess { group })
    }

    fn dir_mode(&self) -> u32 {
        if self.group.is_some() { 0o750 } else { 0o700 }
    }

    fn socket_mode(&self) -> u32 {
        if self.group.is_some() { 0o770 } else { 0o700 }
    }

    fn apply(&self, path: &Path, mode: u32) -> anyhow::Result<()> {
        if let Some(gid) = self.group {
            nix::unistd::chown(path, None, Some(gid))
                .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set mode {mode:o} on {}", path.display()))
    }
}

/// Creates the IPC directory (mode 0700, or 0750 for an `ipc_group`) if it
/// is missing. An existing directory is used as it is, never chmodded (it
/// may be `/tmp`, or shared): it is refused if it belongs to another user
/// (not root) or if anyone but its owner may write to it, since they could
/// replace the socket.
fn prepare_ipc_dir(dir: &Path, access: IpcAccess) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create IPC directory {}", dir.display()))?;
        // `recursive` applies the mode through the umask: set it exactly
        // on the directory this daemon made.
        return access.apply(dir, access.dir_mode());
    }
    if !dir.is_dir() {
        bail!("IPC path {} exists and is not a directory", dir.display());
    }
    let meta = std::fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    if meta.uid() != euid() && meta.uid() != 0 {
        bail!(
            "IPC directory {} belongs to uid {}, not to this user (uid {}): another user could replace the socket; remove it or choose another --ipc-dir",
            dir.display(),
            meta.uid(),
            euid()
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        bail!(
            "IPC directory {} may be written by other users (mode {mode:04o}): they could replace the socket. \
             gem-schd changes no directory it did not create; name one of its own (it is created 0700), e.g. --ipc-dir {}",
            dir.display(),
            dir.join("gemini").display()
        );
    }
    if access.group.is_some() && mode & 0o050 != 0o050 {
        warn!(
            "IPC directory {} (mode {mode:04o}) does not let the ipc_group enter it: its members cannot connect. \
             Give it mode 0750 and that group, or let gem-schd create a new one",
            dir.display()
        );
    }
    Ok(())
}

/// A GPU reservation as the state file keeps it across restarts: the
/// process that holds it, identified by its pid and its start time (a pid
/// reused by another process is not the holder).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
struct SavedReservation {
    pid: u32,
    start_time: u64,
    group: String,
    devices: Vec<u32>,
}

/// The state file of the reservations, beside the socket.
fn reservations_path(ipc_dir: &Path) -> PathBuf {
    ipc_dir.join("reservations.json")
}

/// When process `pid` started (clock ticks since boot, field 22 of
/// `/proc/PID/stat`), if it exists.
fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

/// True if a scheduler already answers in `dir`.
fn scheduler_alive(dir: &Path) -> bool {
    if !scheduler_socket_path(dir).exists() {
        return false;
    }
    crate::client::Client::connect(dir)
        .and_then(|mut c| c.request(&Request::Status, Duration::from_millis(500)))
        .is_ok()
}

/// A live watch of resource.conf: the watcher, its events, and the
/// directories it watches with their identity when armed (a directory
/// removed and made again, or renamed away, is a new inode the watch does
/// not follow: it is armed again).
struct ConfigWatch {
    _watcher: Option<notify::RecommendedWatcher>,
    rx: mpsc::Receiver<()>,
    dirs: Vec<(PathBuf, Option<(u64, u64)>)>,
    /// A watched directory itself was removed or renamed (the inode check
    /// alone misses a directory made again with its inode number reused).
    lost: Arc<AtomicBool>,
    /// The file watched and what it was when the watch was made: the
    /// directory of its target if it was a symbolic link.
    path: PathBuf,
    target: Option<PathBuf>,
    /// Whether the drop-in directory existed, and is watched.
    drop_ins: bool,
}

/// The directory a symbolic link at `path` leads into (`None`: not a link).
fn link_target_dir(path: &Path) -> Option<PathBuf> {
    let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if !linked {
        return None;
    }
    let target = std::fs::canonicalize(path).ok()?;
    Some(match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    })
}

/// Whether resource.conf is empty (a UTF-8 mark and blanks at most).
fn main_is_empty(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|t| t.trim_start_matches('\u{feff}').trim().is_empty())
}

/// `(device, inode)` of `dir`, if it exists.
fn dir_id(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

impl ConfigWatch {
    /// Watches `path`'s directory for changes to it; if `path` is a
    /// symbolic link (a Kubernetes ConfigMap's `..data` swap, a link into
    /// a configuration repository), also its target's directory, and any
    /// change in either counts.
    fn new(path: &Path) -> anyhow::Result<ConfigWatch> {
        use notify::{EventKind, RecursiveMode, Watcher};
        let parent = |p: &Path| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
        let target = link_target_dir(path);
        let mut dirs = vec![parent(path)];
        if let Some(d) = &target
            && !dirs.contains(d)
        {
            dirs.push(d.clone());
        }
        // Drop-in groups: the directory is watched while it exists; its
        // coming or going is seen in the parent's watch.
        let drop_in = gemini_config::drop_in_dir(path);
        let drop_ins = drop_in.is_dir();
        if drop_ins {
            dirs.push(drop_in.clone());
        }
        let name = path.file_name().map(|n| n.to_os_string());
        let (tx, rx) = mpsc::channel();
        let lost = Arc::new(AtomicBool::new(false));
        let (lost_cb, dirs_cb) = (Arc::clone(&lost), dirs.clone());
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(ev) = res else { return };
            if matches!(ev.kind, EventKind::Access(_)) {
                return;
            }
            if matches!(
                ev.kind,
                EventKind::Remove(_) | EventKind::Modify(notify::event::ModifyKind::Name(_))
            ) && ev.paths.iter().any(|p| dirs_cb.contains(p))
            {
                lost_cb.store(true, Ordering::Release);
                let _ = tx.send(());
                return;
            }
            if linked
                || ev.paths.iter().any(|p| {
                    p.file_name().map(|n| n.to_os_string()) == name
                        || p == &drop_in
                        || p.parent() == Some(drop_in.as_path())
                })
            {
                let _ = tx.send(());
            }
        })
        .context("cannot start the file watcher")?;
        // Watch the directory, not the file: an editor's save replaces the
        // file (write to a temporary, rename), which a file watch loses.
        let mut watched = Vec::new();
        for d in dirs {
            watcher
                .watch(&d, RecursiveMode::NonRecursive)
                .with_context(|| format!("cannot watch {}", d.display()))?;
            let id = dir_id(&d);
            watched.push((d, id));
        }
        Ok(ConfigWatch {
            _watcher: Some(watcher),
            rx,
            dirs: watched,
            lost,
            path: path.to_path_buf(),
            target,
            drop_ins,
        })
    }

    /// A watch that sees nothing (none could be made).
    fn none() -> ConfigWatch {
        ConfigWatch {
            _watcher: None,
            rx: mpsc::channel().1,
            dirs: Vec::new(),
            lost: Arc::new(AtomicBool::new(true)),
            path: PathBuf::new(),
            target: None,
            drop_ins: false,
        }
    }

    /// Whether a watched directory is gone or is not the one watched, or
    /// the file became (or stopped being, or moved) a symbolic link.
    fn stale(&self) -> bool {
        self.lost.load(Ordering::Acquire)
            || self.dirs.is_empty()
            || self.dirs.iter().any(|(d, id)| dir_id(d) != *id)
            || link_target_dir(&self.path) != self.target
            || gemini_config::drop_in_dir(&self.path).is_dir() != self.drop_ins
    }
}

/// The machine's GPUs by UUID (`GPU-…`) → NVML index, the numbering the
/// scheduler, `nvidia-smi` and `resource.conf` use. Empty without NVML
/// (`libnvidia-ml.so.1`): clients then number GPUs themselves.
fn gpu_uuids() -> HashMap<String, DeviceId> {
    let nvml = match nvml_wrapper::Nvml::builder()
        .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
        .init()
    {
        Ok(n) => n,
        Err(e) => {
            debug!("no NVML ({e}): clients number the GPUs themselves");
            return HashMap::new();
        }
    };
    let count = nvml.device_count().unwrap_or(0);
    (0..count)
        .filter_map(|i| Some((nvml.device_by_index(i).ok()?.uuid().ok()?, i)))
        .collect()
}

/// Number of NVIDIA GPUs the kernel driver lists (no CUDA library needed).
fn detect_gpus() -> u32 {
    std::fs::read_dir("/proc/driver/nvidia/gpus")
        .map_or(0, |d| d.filter_map(Result::ok).count() as u32)
}

fn pidfd_open(pid: u32) -> std::io::Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags and returns a new fd or -1;
    // no memory is passed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: the syscall returned a fresh fd that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as i32) })
}

fn process_alive(pid: u32) -> bool {
    // SAFETY: kill with signal 0 only checks for existence and permission.
    let r = unsafe { libc::kill(pid as libc::pid_t, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// Who a peer is: its credentials, its user's name and Unix groups from
/// the system's databases, and its process's cgroups.
fn peer_of(c: PeerCred) -> Peer {
    use nix::unistd::{Gid, Group, Uid, User};
    let user = User::from_uid(Uid::from_raw(c.uid)).ok().flatten();
    let name = user
        .as_ref()
        .map_or_else(|| c.uid.to_string(), |u| u.name.clone());
    let mut gids = vec![Gid::from_raw(c.gid)];
    if let Some(u) = &user
        && let Ok(cname) = std::ffi::CString::new(u.name.clone())
        && let Ok(list) = nix::unistd::getgrouplist(&cname, u.gid)
    {
        gids.extend(list);
    }
    let groups = gids
        .into_iter()
        .filter_map(|g| Group::from_gid(g).ok().flatten())
        .map(|g| g.name)
        .collect();
    Peer {
        uid: c.uid,
        pid: c.pid,
        user: name,
        groups,
        cgroups: cgroups_of(c.pid),
    }
}

/// The cgroups of process `pid`, one per hierarchy in `/proc/PID/cgroup`,
/// the unified (v2) one first. A job manager on cgroup v1 places its jobs
/// in some hierarchies only (Slurm's freezer: `/slurm/uid_0/job_5/...`)
/// while the unified one, mounted too, says `/`: every path counts.
fn cgroups_of(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map(|t| cgroup_paths(&t))
        .unwrap_or_default()
}

/// The paths of a `/proc/PID/cgroup` text, unified hierarchy first, each
/// once.
fn cgroup_paths(text: &str) -> Vec<String> {
    let mut paths: Vec<String> = Vec::new();
    let lines = text.lines().filter(|l| l.starts_with("0::"));
    for l in lines.chain(text.lines().filter(|l| !l.starts_with("0::"))) {
        if let Some(p) = l.splitn(3, ':').nth(2)
            && !paths.iter().any(|q| q == p)
        {
            paths.push(p.to_string());
        }
    }
    paths
}

fn euid() -> u32 {
    // SAFETY: geteuid cannot fail and touches no memory.
    unsafe { libc::geteuid() }
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
            .context("invalid configuration; gem-schd did not start")?;
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
        let ctx = zmq::Context::new();
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
        let mut params = Params::from_settings(settings);
        if settings.devices.is_none() {
            params.devices = detect_gpus();
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
        Ok(Daemon {
            _ctx: ctx,
            sock,
            socket_path,
            policy: Policy::new(params, config),
            config_path,
            config_error: None,
            start: Instant::now(),
            conns: HashMap::new(),
            ids: HashMap::new(),
            next_id: 1,
            watched: HashMap::new(),
            last_pid_poll: Instant::now(),
            watch,
            last_watch_check: Instant::now(),
            saved_reservations: None,
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
            gpus: gpu_uuids(),
            stopping: false,
        })
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
        let now = self.now();
        let report = self.policy.status(now);
        m.refresh(&report, &self.policy.counters(now));
    }

    fn now(&self) -> Micros {
        self.start.elapsed().as_micros() as Micros
    }

    /// Takes back the reservations a previous daemon on this directory
    /// held for processes that still run: a restart must not hand out a
    /// GPU a running job holds.
    fn restore_reservations(&mut self) {
        let path = reservations_path(&self.ipc_dir);
        let saved: Vec<SavedReservation> = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => {
                    warn!(
                        "{}: unreadable ({e}); no reservation restored",
                        path.display()
                    );
                    return;
                }
            },
            Err(_) => return,
        };
        for r in saved {
            if process_start_time(r.pid) != Some(r.start_time) {
                info!(
                    "reservation of GPU(s) {:?} by pid {} not restored: the process has ended",
                    r.devices, r.pid
                );
                continue;
            }
            let id = self.next_id;
            self.next_id += 1;
            // A connection of no peer stands for the process: replies to
            // it are dropped, and its end is seen through the pid.
            let identity = format!("restored:{}", r.pid).into_bytes();
            self.conns.insert(
                identity.clone(),
                Conn {
                    id,
                    delimited: false,
                    cred: None,
                    pid: Some(r.pid),
                },
            );
            self.ids.insert(id, identity);
            let now = self.now();
            let hello = Request::Hello {
                role: Role::Control,
                group: String::new(),
                pid: r.pid,
                held: Vec::new(),
            };
            let _ = self.policy.handle(
                Event::Request {
                    client: id,
                    seq: 0,
                    req: hello,
                },
                now,
            );
            let reserve = Request::Reserve {
                group: r.group.clone(),
                gpus: GpuRequest::Ids(r.devices.clone()),
                wait: false,
            };
            let actions = self.policy.handle(
                Event::Request {
                    client: id,
                    seq: 1,
                    req: reserve,
                },
                now,
            );
            let restored = actions.iter().any(|a| {
                matches!(
                    a,
                    Action::Reply {
                        reply: Reply::Reserved { .. },
                        ..
                    }
                )
            });
            if restored {
                info!(
                    "reservation of GPU(s) {:?} by pid {} (group {:?}) restored",
                    r.devices, r.pid, r.group
                );
            } else {
                warn!(
                    "reservation of GPU(s) {:?} by pid {} (group {:?}) could not be restored: {actions:?}",
                    r.devices, r.pid, r.group
                );
            }
            self.watch(id, r.pid);
        }
        self.save_reservations();
    }

    /// Writes the reservations to the state file when they changed
    /// (written aside, then renamed: never half a file).
    fn save_reservations(&mut self) {
        let held = self.policy.held_reservations();
        if self.saved_reservations.as_ref() == Some(&held) {
            return;
        }
        let now: Vec<SavedReservation> = held
            .iter()
            .filter_map(|(client, group, devices)| {
                let pid = self.conn(*client).and_then(|c| c.pid)?;
                Some(SavedReservation {
                    pid,
                    start_time: process_start_time(pid)?,
                    group: group.clone(),
                    devices: devices.clone(),
                })
            })
            .collect();
        let path = reservations_path(&self.ipc_dir);
        let tmp = path.with_extension("json.tmp");
        let written = serde_json::to_vec_pretty(&now)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match written {
            Ok(()) => self.saved_reservations = Some(held),
            Err(e) => warn!("cannot write {}: {e}", path.display()),
        }
    }

    /// Runs until shutdown is asked or a signal arrives.
    pub fn run(mut self) -> anyhow::Result<()> {
        self.restore_reservations();
        while !self.stop.load(Ordering::Relaxed) {
            let now = self.now();
            let mut timeout = MAX_POLL;
            if let Some(d) = self.policy.next_deadline(now) {
                timeout = timeout.min(Duration::from_micros(d.saturating_sub(now)));
            }
            if let Some(due) = self.reload_due {
                timeout = timeout.min(due.saturating_duration_since(Instant::now()));
            }
            let pids: Vec<(u32, i32)> = self
                .watched
                .iter()
                .filter_map(|(&pid, w)| w.pidfd.as_ref().map(|fd| (pid, fd.as_raw_fd())))
                .collect();
            let (sock_ready, dead) = {
                let mut items = Vec::with_capacity(1 + pids.len());
                items.push(self.sock.as_poll_item(zmq::POLLIN));
                for &(_, fd) in &pids {
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
                    .zip(&items[1..])
                    .filter(|(_, it)| it.is_readable())
                    .map(|(p, _)| p.0)
                    .collect();
                (items[0].is_readable(), dead)
            };
            if sock_ready && self.drain_socket()? {
                break;
            }
            for pid in dead {
                self.process_gone(pid);
            }
            self.poll_pids_without_fd();
            self.check_reload();
            self.check_socket();
            let now = self.now();
            let actions = self.policy.handle(Event::Tick, now);
            self.send_actions(actions);
            self.save_reservations();
            self.refresh_metrics();
        }
        info!("gem-schd stopping");
        // Tell the holder to let go of everything, and give the message
        // time to leave before the socket closes.
        let actions = self.policy.shutdown();
        let _ = self.sock.set_linger(500);
        self.send_actions(actions);
        Ok(())
    }

    /// Reads every pending frame. Returns true when shutdown was asked.
    fn drain_socket(&mut self) -> anyhow::Result<bool> {
        loop {
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
    }

    /// Handles one multipart message: `[identity, (empty,) body]`.
    fn on_message(&mut self, mut frames: Vec<zmq::Message>) {
        if frames.len() < 2 {
            return;
        }
        let identity = frames[0].to_vec();
        let delimited = frames.len() == 3 && frames[1].is_empty();
        if frames.len() > 3 || (frames.len() == 3 && !delimited) {
            warn!("dropping a message of {} frames from a peer", frames.len());
            return;
        }
        let last = frames.len() - 1;
        let cred = frames[last]
            .gets("Peer-Address")
            .and_then(parse_peer_address);
        let body = frames[last].to_vec();
        let client = match self.conns.get(&identity) {
            Some(conn) => conn.id,
            None => self.connected(identity, delimited, cred),
        };
        match decode_request(&body) {
            Ok((seq, req)) => {
                let t = Instant::now();
                self.on_request(client, seq, req);
                if let Some(m) = &self.metrics {
                    m.handled(t.elapsed().as_secs_f64());
                }
            }
            Err(e) => {
                let kind = match e {
                    CodecError::VersionMismatch { .. } => ErrorKind::ProtocolMismatch,
                    _ => ErrorKind::Malformed,
                };
                warn!("client {client}: {e}");
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
        identity: Vec<u8>,
        delimited: bool,
        cred: Option<PeerCred>,
    ) -> ClientId {
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
            },
        );
        if let Some(c) = cred {
            let actions = self.policy.handle(
                Event::Connected {
                    client: id,
                    peer: peer_of(c),
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
        let hello = match req {
            Request::Gpus { uuids } => {
                let devices = uuids.iter().map(|u| self.gpus.get(u).copied()).collect();
                self.reply(client, seq, &Reply::Gpus { devices });
                return;
            }
            Request::Status => {
                let mut report = self.policy.status(self.now());
                report.config_error = self.config_error.clone();
                self.reply(client, seq, &Reply::Status(Box::new(report)));
                return;
            }
            Request::AcquireToken { .. } if self.metrics.is_some() => {
                self.asked.insert((client, seq), Instant::now());
                None
            }
            Request::Hello { role, pid, .. } => Some((role, pid)),
            Request::Shutdown => {
                info!("shutdown requested by {}", self.peer(client));
                None
            }
            _ => None,
        };
        let actions = self
            .policy
            .handle(Event::Request { client, seq, req }, self.now());
        if let Some((role, claimed)) = hello {
            let pid = actions.iter().find_map(|a| match a {
                Action::Watch { pid, .. } => Some(*pid),
                _ => None,
            });
            match (pid, self.policy.client_group(client)) {
                (Some(pid), Some(group)) => {
                    info!("client {client} joined: pid {pid}, {role:?}, group {group:?}")
                }
                _ => {
                    if let Some(e) = actions.iter().find_map(|a| match a {
                        Action::Reply {
                            reply: Reply::Error(e),
                            ..
                        } if e.kind != ErrorKind::PermissionDenied => Some(e),
                        _ => None,
                    }) {
                        warn!("client {client} (pid {claimed}) refused: {}", e.message);
                    }
                }
            }
        }
        self.send_actions(actions);
    }

    fn conn(&self, client: ClientId) -> Option<&Conn> {
        self.ids.get(&client).and_then(|i| self.conns.get(i))
    }

    fn watch(&mut self, client: ClientId, pid: u32) {
        if let Some(conn) = self.ids.get(&client).and_then(|i| self.conns.get_mut(i)) {
            conn.pid = Some(pid);
        }
        if pid == 0 || self.watched.contains_key(&pid) {
            return;
        }
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => Some(fd),
            Err(e) if e.raw_os_error() == Some(libc::ESRCH) => {
                // Already gone (or in another pid namespace): the periodic
                // check decides.
                None
            }
            Err(e) => {
                debug!("pidfd_open({pid}): {e}; polling instead");
                None
            }
        };
        self.watched.insert(pid, Watched { pidfd });
    }

    fn poll_pids_without_fd(&mut self) {
        if self.last_pid_poll.elapsed() < Duration::from_millis(500) {
            return;
        }
        self.last_pid_poll = Instant::now();
        let dead: Vec<u32> = self
            .watched
            .iter()
            .filter(|(pid, w)| w.pidfd.is_none() && !process_alive(**pid))
            .map(|(pid, _)| *pid)
            .collect();
        for pid in dead {
            self.process_gone(pid);
        }
    }

    /// Releases everything held by the connections of process `pid`.
    fn process_gone(&mut self, pid: u32) {
        self.watched.remove(&pid);
        let gone: Vec<(Vec<u8>, ClientId)> = self
            .conns
            .iter()
            .filter(|(_, c)| c.pid == Some(pid))
            .map(|(i, c)| (i.clone(), c.id))
            .collect();
        for (identity, id) in gone {
            info!("client {id} (pid {pid}) is gone; releasing its token and memory");
            self.conns.remove(&identity);
            self.ids.remove(&id);
            self.asked.retain(|&(c, _), _| c != id);
            let actions = self
                .policy
                .handle(Event::Disconnected { client: id }, self.now());
            self.send_actions(actions);
        }
    }

    /// Recreates the IPC directory and socket if someone removed them:
    /// connected clients keep their connections, new ones can connect again.
    fn check_socket(&mut self) {
        if self.last_socket_check.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_socket_check = Instant::now();
        if self.socket_path.exists() {
            return;
        }
        warn!(
            "{} disappeared; creating it again",
            self.socket_path.display()
        );
        // Bound again beside the old (now nameless) listener, whose
        // connections stay up.
        let result = prepare_ipc_dir(&self.ipc_dir, self.access)
            .and_then(|()| self.sock.bind(&self.endpoint).map_err(anyhow::Error::from))
            .and_then(|()| {
                self.access
                    .apply(&self.socket_path, self.access.socket_mode())
            });
        if let Err(e) = result {
            error!(
                "cannot recreate {}: {e:#}; retrying",
                self.socket_path.display()
            );
        }
    }

    fn check_reload(&mut self) {
        if self.hup.swap(false, Ordering::AcqRel) {
            info!("SIGHUP: reloading {}", self.config_path.display());
            self.reload_due = None;
            let _ = self.reload();
            return;
        }
        let mut changed = false;
        while self.watch.rx.try_recv().is_ok() {
            changed = true;
        }
        if self.last_watch_check.elapsed() >= Duration::from_secs(1) {
            self.last_watch_check = Instant::now();
            if self.watch.stale() {
                // The directory was removed, renamed or made again: the
                // old watch sees nothing any more. Watch anew and re-read.
                match ConfigWatch::new(&self.config_path) {
                    Ok(w) => {
                        info!(
                            "watching {} again (its directory or its drop-in directory came or went)",
                            self.config_path.display()
                        );
                        self.watch = w;
                        changed = true;
                    }
                    Err(e) => debug!("cannot watch {} yet: {e:#}", self.config_path.display()),
                }
            }
        }
        if changed {
            self.reload_due = Some(Instant::now() + RELOAD_DEBOUNCE);
            return;
        }
        match self.reload_due {
            Some(due) if Instant::now() >= due => self.reload_due = None,
            _ => return,
        }
        let _ = self.reload();
    }

    /// Re-reads resource.conf and puts it in force; on errors keeps the
    /// previous configuration and returns them.
    fn reload(&mut self) -> Result<(), String> {
        // A file being rewritten (truncated, then written) is empty for a
        // moment: that is not "no groups". An empty file after a non-empty
        // one keeps the configuration; a file with only a comment applies.
        let emptied = main_is_empty(&self.config_path);
        if emptied && self.main_had_text {
            warn!(
                "{} is empty; keeping the previous configuration until it has content \
                 (to remove every group, leave a comment in it)",
                self.config_path.display()
            );
            return Ok(());
        }
        match load_resource(&self.config_path) {
            Ok((cfg, warnings)) => {
                for w in &warnings {
                    warn!("{w}");
                }
                let changes = diff(self.policy.config(), &cfg);
                if changes.is_empty() {
                    info!("{} reloaded: no change", self.config_path.display());
                }
                for c in &changes {
                    info!("{} reloaded: {c}", self.config_path.display());
                }
                self.config_error = None;
                self.main_had_text = !emptied;
                if let Some(m) = &self.metrics {
                    m.reloaded(0);
                }
                let actions = self.policy.handle(Event::Reconfigure(cfg), self.now());
                self.send_actions(actions);
                Ok(())
            }
            Err(e) => {
                for err in &e.0 {
                    error!("{err}");
                }
                error!(
                    "{} is invalid; keeping the previous configuration",
                    self.config_path.display()
                );
                self.config_error = Some(e.to_string());
                if let Some(m) = &self.metrics {
                    m.reloaded(e.0.len().max(1));
                }
                Err(e.to_string())
            }
        }
    }

    /// Does what the policy asks.
    fn send_actions(&mut self, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::Reply { client, seq, reply } => {
                    if let Reply::Error(e) = &reply
                        && e.kind == ErrorKind::PermissionDenied
                    {
                        warn!(
                            "{} (client {client}) refused: {}",
                            self.peer(client),
                            e.message
                        );
                    }
                    self.reply(client, seq, &reply);
                }
                Action::Watch { client, pid } => self.watch(client, pid),
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
        let Some(identity) = self.ids.get(&client) else {
            return;
        };
        debug!("client {client} #{seq} <- {reply:?}");
        let delimited = self.conns.get(identity).is_some_and(|c| c.delimited);
        let body = encode_reply(seq, reply);
        let result = if delimited {
            self.sock
                .send_multipart([identity.as_slice(), &[], &body], zmq::DONTWAIT)
        } else {
            self.sock
                .send_multipart([identity.as_slice(), &body], zmq::DONTWAIT)
        };
        if let Err(e) = result {
            debug!("reply to client {client} dropped: {e}");
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.socket_path);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroups_of_every_hierarchy_unified_first() {
        // Slurm's cgroup v1 plugin on a hybrid host: the job is in the
        // freezer hierarchy only, the unified one says `/`.
        let text = "9:name=systemd:/\n6:freezer:/slurm/uid_0/job_5/step_batch\n5:devices:/\n0::/\n";
        assert_eq!(
            cgroup_paths(text),
            ["/", "/slurm/uid_0/job_5/step_batch"].map(String::from)
        );
        assert_eq!(
            cgroup_paths("0::/system.slice/slurmstepd.scope/job_7/step_0\n"),
            ["/system.slice/slurmstepd.scope/job_7/step_0".to_string()]
        );
    }

    #[test]
    fn peer_address_of_ipc_peer() {
        assert_eq!(
            parse_peer_address(":1000:100:4242"),
            Some(PeerCred {
                uid: 1000,
                gid: 100,
                pid: 4242
            })
        );
        assert_eq!(
            parse_peer_address("/tmp/x.sock:0:0:1"),
            Some(PeerCred {
                uid: 0,
                gid: 0,
                pid: 1
            })
        );
        assert_eq!(parse_peer_address(""), None);
        assert_eq!(parse_peer_address("127.0.0.1"), None);
    }
}
