//! The hook's per-process state: settings read once from the environment,
//! the scheduler connection, the per-device launch gates and the memory
//! this process has reserved. Created on the first intercepted call that
//! needs it; a forked child drops its parent's state (without touching it:
//! its locks may be held by threads that do not exist in the child) and
//! starts clean.

use crate::gate::Gate;
use gemini_protocol::{env, units};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicPtr, AtomicU32, AtomicUsize, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard, Once};
use std::time::Duration;

/// Devices the gates cover (ordinals at or above are passed ungated).
pub const MAX_GATES: usize = 64;

/// What the environment says, read once per process.
#[derive(Debug, Clone)]
pub struct Settings {
    /// `GEMINI_GROUP_NAME`.
    pub group: Option<String>,
    /// `GEMINI_IPC_DIR` or the default.
    pub ipc_dir: PathBuf,
    /// `GEMINI_CONNECT_TIMEOUT`: how long to wait for an absent scheduler
    /// before failing calls (`None`: forever).
    pub connect_timeout: Option<Duration>,
    /// `GEMINI_IDLE_MS`: a token unused this long is given back.
    pub idle: Duration,
    /// `CUDA_VISIBLE_DEVICES` as physical indices, when numeric.
    pub visible: Vec<u32>,
}

/// The IPC directory, found as the daemon and the tools find it
/// (`GEMINI_IPC_DIR`, else `ipc_dir` in `gemini.toml`, else the default);
/// a settings file that cannot be used is reported and the default tried.
fn ipc_dir() -> PathBuf {
    use gemini_protocol::endpoint::{DEFAULT_IPC_DIR, locate_ipc_dir, settings_path};
    let settings = settings_path(std::env::var_os(env::SETTINGS).as_deref());
    locate_ipc_dir(
        std::env::var_os(env::IPC_DIR).as_deref(),
        settings.as_deref(),
    )
    .unwrap_or_else(|e| {
        crate::log::error!("{e}; looking for the scheduler in {DEFAULT_IPC_DIR}");
        PathBuf::from(DEFAULT_IPC_DIR)
    })
}

impl Settings {
    /// Reads the environment.
    pub fn from_env() -> Settings {
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
        // A value that does not parse is said once, not silently dropped.
        let connect_timeout =
            var(env::CONNECT_TIMEOUT).and_then(|v| match units::parse_duration(&v) {
                Ok(d) => Some(d).filter(|d| !d.is_zero()),
                Err(e) => {
                    crate::log::error!(
                        "{}={v:?}: {e}; waiting for the scheduler without a limit",
                        env::CONNECT_TIMEOUT
                    );
                    None
                }
            });
        let idle = var(env::IDLE_MS).and_then(|v| match units::parse_duration_ms(&v) {
            Ok(d) => Some(d),
            Err(e) => {
                crate::log::error!("{}={v:?}: {e}; using 5 ms", env::IDLE_MS);
                None
            }
        });
        let idle = idle
            .unwrap_or(Duration::from_millis(5))
            .max(Duration::from_micros(100));
        let visible = var("CUDA_VISIBLE_DEVICES")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().parse::<u32>())
                    .collect::<Result<Vec<_>, _>>()
                    .unwrap_or_default()
            })
            .unwrap_or_default();
        Settings {
            group: var(env::GROUP_NAME),
            ipc_dir: ipc_dir(),
            connect_timeout,
            idle,
            visible,
        }
    }

    /// The device index for ordinal `dev` without the scheduler's or
    /// NVML's help: the numeric `CUDA_VISIBLE_DEVICES` entry, else the
    /// ordinal.
    pub fn fallback_physical(&self, dev: u32) -> u32 {
        self.visible.get(dev as usize).copied().unwrap_or(dev)
    }
}

/// Per-process state.
#[derive(Debug)]
pub struct State {
    /// Settings.
    pub settings: Settings,
    /// The connection, once made.
    pub conn: Mutex<Option<gemini_client::Client>>,
    /// Serialises registration.
    pub register: Mutex<()>,
    /// Whether the scheduler knows this process.
    pub registered: AtomicBool,
    /// Non-zero once the hook has given up: every gated call fails with
    /// this result code.
    pub refused: AtomicU32,
    /// Launch gates per device ordinal.
    pub gates: Vec<Gate>,
    /// Each ordinal's GPU (UUID text, scheduler's index), found once.
    gpus: std::sync::OnceLock<Vec<(String, u32)>>,
    /// Device memory reserved through the scheduler: pointer or handle →
    /// (physical device, bytes).
    pub memory: Mutex<HashMap<u64, (u32, u64)>>,
    /// Whether the idle watcher thread runs.
    pub watcher: AtomicBool,
    /// Wakes the watcher before its next tick (a process that predictably
    /// goes idle after a wait has just finished waiting).
    pub kick: (Mutex<bool>, Condvar),
    /// The driver reports exactly one device: every launch is on ordinal 0.
    pub single_device: bool,
    /// Streams with a capture open (see [`crate::capture`]), and how many.
    pub captures: Mutex<HashSet<usize>>,
    pub captures_open: AtomicUsize,
    /// Memory pools allocated from: handle → (physical device, bytes
    /// reserved for what the pool holds); see `memory::pool_alloc`.
    pub pools: Mutex<HashMap<usize, (u32, u64)>>,
    pub pools_seen: AtomicBool,
    /// Graph memory (see [`crate::graphmem`]): what each open capture's
    /// origin stream, graph and executable graph allocates, (ordinal,
    /// bytes); what the group holds for each ordinal's graph allocator,
    /// (physical device, bytes); whether any graph allocated.
    pub graph_needs: Mutex<HashMap<usize, (u32, u64)>>,
    pub graph_held: Mutex<HashMap<u32, (u32, u64)>>,
    pub graph_mem_seen: AtomicBool,
    /// Contexts the process made: (context, ordinal).
    pub contexts: Mutex<Vec<(usize, u32)>>,
}

static STATE: AtomicPtr<State> = AtomicPtr::new(std::ptr::null_mut());
static ATFORK: Once = Once::new();

extern "C" fn in_child_after_fork() {
    // The parent's state stays allocated (leaked): its mutexes may be held
    // by threads that the child does not have, and its ZeroMQ context must
    // not be touched in the child.
    STATE.store(std::ptr::null_mut(), Ordering::Release);
}

/// Locks a mutex, ignoring poisoning (a panic in another thread must not
/// take the program's CUDA calls down).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The state, if it exists already (fast path: one atomic load).
#[inline]
pub fn current() -> Option<&'static State> {
    let p = STATE.load(Ordering::Acquire);
    // SAFETY: a non-null pointer came from Box::leak below and is never
    // freed.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The state, created on first use.
pub fn get() -> &'static State {
    if let Some(s) = current() {
        return s;
    }
    ATFORK.call_once(|| {
        // SAFETY: registers a child handler that only stores an atomic.
        unsafe { libc::pthread_atfork(None, None, Some(in_child_after_fork)) };
    });
    let settings = Settings::from_env();
    crate::log::set_verbose(std::env::var_os(env::LOG).is_some_and(|v| !v.is_empty() && v != "0"));
    let fresh = Box::into_raw(Box::new(State {
        settings,
        conn: Mutex::new(None),
        register: Mutex::new(()),
        registered: AtomicBool::new(false),
        refused: AtomicU32::new(0),
        gates: (0..MAX_GATES).map(|_| Gate::default()).collect(),
        gpus: std::sync::OnceLock::new(),
        memory: Mutex::new(HashMap::new()),
        watcher: AtomicBool::new(false),
        kick: (Mutex::new(false), Condvar::new()),
        single_device: crate::driver::device_count() == Some(1),
        captures: Mutex::new(HashSet::new()),
        captures_open: AtomicUsize::new(0),
        pools: Mutex::new(HashMap::new()),
        pools_seen: AtomicBool::new(false),
        graph_needs: Mutex::new(HashMap::new()),
        graph_held: Mutex::new(HashMap::new()),
        graph_mem_seen: AtomicBool::new(false),
        contexts: Mutex::new(Vec::new()),
    }));
    match STATE.compare_exchange(
        std::ptr::null_mut(),
        fresh,
        Ordering::AcqRel,
        Ordering::Acquire,
    ) {
        // SAFETY: we just published `fresh`; it lives for the process.
        Ok(_) => unsafe { &*fresh },
        Err(winner) => {
            // SAFETY: `fresh` was never shared; `winner` is a leaked Box.
            unsafe {
                drop(Box::from_raw(fresh));
                &*winner
            }
        }
    }
}

impl State {
    /// The scheduler's device index for the driver's ordinal `dev`: the
    /// machine's own index of the GPU, which a device cgroup (Slurm's
    /// `ConstrainDevices`: a job's only GPU is ordinal 0 whichever it is),
    /// `CUDA_VISIBLE_DEVICES` and a container (whose NVML, too, numbers
    /// its GPUs from 0) renumber away from the ordinal. Found once, by each
    /// GPU's UUID: the scheduler's NVML index, else this process's NVML
    /// index, else the numeric `CUDA_VISIBLE_DEVICES` entry, else the
    /// ordinal.
    pub fn physical(&self, dev: u32) -> u32 {
        self.gpus()
            .get(dev as usize)
            .map_or_else(|| self.settings.fallback_physical(dev), |g| g.1)
    }

    /// The scheduler's device index of the process's GPU whose UUID text
    /// is `uuid` (`None`: not one of its CUDA devices).
    pub fn physical_of_uuid(&self, uuid: &str) -> Option<u32> {
        self.gpus().iter().find(|g| g.0 == uuid).map(|g| g.1)
    }

    fn gpus(&self) -> &[(String, u32)] {
        self.gpus.get_or_init(|| self.find_gpus())
    }

    fn find_gpus(&self) -> Vec<(String, u32)> {
        let Some(count) = crate::driver::device_count() else {
            return Vec::new();
        };
        let uuids: Vec<Option<[u8; 16]>> = (0..count).map(crate::driver::device_uuid).collect();
        let texts: Vec<String> = uuids
            .iter()
            .map(|u| u.as_ref().map(crate::nvml::uuid_text).unwrap_or_default())
            .collect();
        let asked = gemini_protocol::Request::Gpus {
            uuids: texts.clone(),
        };
        let theirs = match self.call(&asked, 0) {
            Ok(gemini_protocol::Reply::Gpus { devices }) if devices.len() == uuids.len() => devices,
            _ => vec![None; uuids.len()],
        };
        let mut map = Vec::with_capacity(texts.len());
        for (ordinal, (text, theirs)) in texts.into_iter().zip(theirs).enumerate() {
            let index = theirs
                .or_else(|| uuids[ordinal].and_then(|u| crate::nvml::index_of_uuid(&u)))
                .unwrap_or_else(|| self.settings.fallback_physical(ordinal as u32));
            map.push((text, index));
        }
        crate::log::debug!("GPUs by ordinal, as the scheduler numbers them: {map:?}");
        map
    }
}
