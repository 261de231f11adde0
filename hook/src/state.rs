//! The hook's per-process state: settings read once from the environment,
//! the scheduler connection, the per-device launch gates and the memory
//! this process has reserved. Created on the first intercepted call that
//! needs it; a forked child drops its parent's state (without touching it:
//! its locks may be held by threads that do not exist in the child) and
//! starts clean.

use gemini_protocol::{Request, env, units};
use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::atomic::{
    AtomicBool, AtomicI64, AtomicPtr, AtomicU32, AtomicU64, AtomicUsize, Ordering,
};
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
    /// `GEMINI_BENCH_TOKEN_DELAY_US`: slept before each token request
    /// (benchmarks only; zero in use).
    pub token_delay: Duration,
    /// `GEMINI_TEST_TAKE_DELAY_US` (`US`, or `N:US`): slept after each
    /// (every Nth) token reply is read, before the token is taken (tests
    /// only: a thread descheduled there on a loaded host; zero in use).
    pub take_delay: (u32, Duration),
    /// `GEMINI_ASK_AHEAD` (`0`: off): a token is asked for ahead of the
    /// process's predicted return from a quiet gap (see `gate::ahead`).
    pub ask_ahead: bool,
    /// The multi-GPU job the process is a rank of, as its launcher's
    /// variables declare it (see `gemini_protocol::job`).
    pub job: Option<String>,
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
        let token_delay = var(env::BENCH_TOKEN_DELAY_US)
            .and_then(|v| v.parse().ok())
            .map(Duration::from_micros)
            .unwrap_or_default();
        // "US", or "N:US" (every Nth grant).
        let take_delay = var(env::TEST_TAKE_DELAY_US)
            .and_then(|v| {
                let (every, us) = v.split_once(':').unwrap_or(("1", &v));
                Some((every.parse().ok()?, Duration::from_micros(us.parse().ok()?)))
            })
            .unwrap_or_default();
        Settings {
            group: var(env::GROUP_NAME),
            ipc_dir: ipc_dir(),
            connect_timeout,
            idle,
            visible,
            token_delay,
            take_delay,
            ask_ahead: var(env::ASK_AHEAD).is_none_or(|v| v.trim() != "0"),
            // SAFETY: getppid(2) takes nothing and cannot fail.
            job: gemini_protocol::job::declared(var, unsafe { libc::getppid() } as u32),
        }
    }

    /// The device index for ordinal `dev` without the scheduler's or
    /// NVML's help: the numeric `CUDA_VISIBLE_DEVICES` entry, else the
    /// ordinal.
    pub fn fallback_physical(&self, dev: u32) -> u32 {
        self.visible.get(dev as usize).copied().unwrap_or(dev)
    }
}

/// What a gate has to report (see `gate::measure`), oldest first each.
#[derive(Debug, Default)]
pub(crate) struct Spans {
    /// The device time work proven done occupied.
    pub(crate) ran: Vec<gemini_protocol::Span>,
    /// The time work given back in flight was outstanding, not proven to
    /// run (see `gate::late`): it ends before the spans of `ran` that
    /// follow it.
    pub(crate) unproven: Vec<gemini_protocol::Span>,
}

impl Spans {
    /// Whether there is nothing to report.
    pub(crate) fn is_empty(&self) -> bool {
        self.ran.is_empty() && self.unproven.is_empty()
    }
}

/// One device's token, as this process sees it.
#[derive(Debug, Default)]
pub struct Gate {
    /// End of the token's validity (ns); 0: no token.
    pub(crate) deadline: AtomicU64,
    /// When the token was granted (ns); 0: no token to account for.
    pub(crate) granted_at: AtomicU64,
    /// Calls that use the device (launches, synchronisations, blocking
    /// copies, queries) entered and left. Counters, not timestamps, so the
    /// fast path reads the clock once; the watcher tells activity from
    /// their changes, and a thread blocked in the driver (a full launch
    /// queue, a synchronisation) from `entered != exited`.
    pub(crate) entered: AtomicU64,
    pub(crate) exited: AtomicU64,
    /// End of the granted quota (ns).
    pub(crate) quota_end: AtomicU64,
    /// Start of the current period of activity (ns); 0: idle.
    pub(crate) burst_start: AtomicU64,
    /// Smoothed length of past activity periods (µs).
    pub(crate) burst_avg: AtomicU64,
    /// Smoothed overuse of past tokens (ns): work still queued when the
    /// token ran out. Launching stops this much before the token's end.
    pub(crate) overuse: AtomicU64,
    /// Context the token's work was launched in (for the watcher's sync).
    pub(crate) ctx: AtomicUsize,
    /// When the last wait call returned with no other call in flight
    /// (ns); 0 once a launch has come since.
    pub(crate) wait_exit: AtomicU64,
    /// Quiet time between a wait returning and the next launch (ns), each
    /// sample capped at four idle thresholds; follows a shorter gap at
    /// once and a longer one by an eighth, so one long pause (the thread
    /// descheduled on a busy CPU) does not make a process that launches
    /// again at once look quiet after its waits.
    pub(crate) gap_avg: AtomicU64,
    /// The last such gap, capped likewise (ns).
    pub(crate) gap_last: AtomicU64,
    /// The token is lent (another group is owed the device and will be
    /// back).
    pub(crate) lent: AtomicBool,
    /// The token ends with the step under way: the first wait that proves
    /// all its work done gives it back (the job's turn is over; see
    /// `Reply::Token::last_step`).
    pub(crate) last_step: AtomicBool,
    /// Predicted end of the work queued under the token (ns): launches
    /// are admitted only while it is within the quota.
    pub(crate) queued_end: AtomicU64,
    /// Launches admitted under the token while the device time per launch
    /// is not known yet.
    pub(crate) unknown_launches: AtomicU64,
    /// Smoothed device time per launch (ns), learned from waits that
    /// returned with the work done and from tokens' ends; 0: not known
    /// yet. Leans towards shorter samples: a lent token's bound, where too
    /// long an estimate leaves the device idle.
    pub(crate) kernel_ns: AtomicU64,
    /// The same, leaning towards longer samples: the bound of a token not
    /// lent, where too short an estimate lets launches of a longer kernel
    /// (another thread's) queue far past the token and past MaxUtil.
    pub(crate) kernel_hi_ns: AtomicU64,
    /// Wait calls entered (launches = `entered` - `waits`).
    pub(crate) waits: AtomicU64,
    /// Wait calls in flight now.
    pub(crate) waiting_now: AtomicU64,
    /// First launch after the last wait (ns; 0: none since), with the
    /// launches and the blocked time counted before it.
    pub(crate) sample_start: AtomicU64,
    pub(crate) sample_launches: AtomicU64,
    pub(crate) sample_blocked: AtomicU64,
    pub(crate) sample_graphs: AtomicU64,
    pub(crate) sample_graph_ns: AtomicU64,
    /// The stream the sample's launches went to (`covers::NO_STREAM`
    /// before the first, `covers::MIXED` once they went to several).
    pub(crate) sample_stream: AtomicUsize,
    /// Graph launches of known cost admitted, and their predicted device
    /// time (ns), cumulative: the time per launch of kernels is learned
    /// without them.
    pub(crate) graph_launches: AtomicU64,
    pub(crate) graph_ns: AtomicU64,
    /// Smoothed device time of one graph launch of known cost (ns),
    /// leaning long; 0: none yet. A replay is admitted whole, so it, not
    /// the kernels' average, is the launch a scheduler must wait out.
    pub(crate) graph_long_ns: AtomicU64,
    /// Time spent waiting for a grant with none of this process's work
    /// on the device (ns, cumulative): not device time of its launches.
    pub(crate) blocked: AtomicU64,
    /// The end of the work announced to the scheduler when a wait began
    /// (ns; 0: none announced since), and how late such announcements
    /// have been, smoothed (ns; negative: early): the device time per
    /// launch learned from waits runs a little long, and launches start
    /// a little after their token.
    pub(crate) quiet_end: AtomicU64,
    pub(crate) quiet_bias: AtomicI64,
    /// Work a token's end did not prove done (see `gate::late`): the
    /// synchronisation (`syncer`) whose end says it is (0: none); the
    /// start of its span once detached from the next token's (0: not
    /// detached); and when the first span after the detach opened (ns;
    /// 0: none yet).
    pub(crate) late_ticket: AtomicU64,
    pub(crate) late_since: AtomicU64,
    pub(crate) resumed_at: AtomicU64,
    /// A token asked for ahead of the process's predicted return from a
    /// quiet gap (see `gate::ahead`): when to ask (ns; 0: none planned),
    /// and the sequence number of the request once sent (0: none).
    pub(crate) ahead_at: AtomicU64,
    pub(crate) ahead_seq: AtomicU32,
    /// The predicted launch that request is for (ns), said with it.
    pub(crate) ahead_for: AtomicU64,
    /// When that request was sent (ns), and how long before the predicted
    /// launch requests are sent, learned (ns; 0: not yet).
    pub(crate) ahead_sent: AtomicU64,
    pub(crate) ahead_lead: AtomicU64,
    /// When the watcher took such a grant, before the process launched
    /// again (ns; 0: none since its last launch).
    pub(crate) ahead_taken: AtomicU64,
    /// Since when this process's work on the device has been outstanding
    /// (ns, the first launch after its last work was proven done; 0:
    /// none known outstanding), and the stream its launches since went to
    /// (`covers::NO_STREAM` before the first, `covers::MIXED` once they
    /// went to several). See `gate::measure`.
    pub(crate) open_since: AtomicU64,
    pub(crate) open_stream: AtomicUsize,
    /// The timing events that end the open span on the device's clock
    /// (see `gate::devclock`).
    pub(crate) devclock: Mutex<DevClock>,
    /// Work proven done and not reported yet: the device time it
    /// occupied, oldest first (see `gate::measure`); and the time work
    /// was outstanding but not proven to run (see `gate::late`).
    pub(crate) ran: Mutex<Spans>,
    /// The launches admitted when the last synchronisation the token's
    /// end left running (`late_ticket`) was asked for.
    pub(crate) late_launches: AtomicU64,
    /// Held by whoever is acquiring or releasing the token.
    pub(crate) slow: Mutex<()>,
    /// Waits for the work launched under the token (see `syncer`).
    pub(crate) syncer: Syncer,
}

/// A span's opening event (see `gate::devclock`): recorded on `raw`
/// (`per_thread`: the null stream is the recording thread's own), which
/// is stream `key`, in context `ctx` (taken in generation `epoch`, see
/// [`DevClock::epoch`]), for the span opened at `since`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ClockStart {
    pub(crate) since: u64,
    pub(crate) ctx: usize,
    pub(crate) event: usize,
    pub(crate) epoch: u64,
    pub(crate) key: usize,
    pub(crate) raw: usize,
    pub(crate) per_thread: bool,
    /// Recorded while work of an earlier token may still run on the
    /// stream: it completes behind that work, and times only the span's
    /// end (see `gate::devclock::open`).
    pub(crate) behind: bool,
    /// Where the event completed on the calibrated host clock, read as a
    /// wait's end event is recorded (0: not read), and the calibration
    /// read by (its `taken_at`): used only while that one is current, so
    /// that a span's two ends are placed by the same reference.
    pub(crate) began: u64,
    pub(crate) began_by: u64,
}

/// The timing events that end a gate's open span on the device's clock
/// (see `gate::devclock`).
#[derive(Debug, Default)]
pub(crate) struct DevClock {
    /// The open span's opening event (or a closed span's, whose `since`
    /// no longer matches).
    pub(crate) start: Option<ClockStart>,
    /// Events of their context, free for a record.
    pub(crate) spare: Vec<(usize, usize)>,
    /// Spans in a row whose opening event went unused, and the spans
    /// opened since they reached `devclock::MISSES`.
    pub(crate) misses: u32,
    pub(crate) skipped: u32,
    /// Moves on whenever one of the process's contexts goes: an event
    /// taken before belongs to a context that may have gone with its
    /// events, and is never given back.
    pub(crate) epoch: u64,
    /// The device's clock against the host's, per context (see
    /// `gate::devclock`).
    pub(crate) cals: Vec<Calibration>,
    /// No calibration is made before this (ns): the last one failed.
    pub(crate) cal_retry_at: u64,
    /// The end of the work a token's end left running (see `gate::late`),
    /// marked as that end began, and whether a launch was on its way to
    /// the driver then.
    pub(crate) late: ClockMark,
    pub(crate) late_raced: bool,
}

/// Where an event of context `ctx` completed on the host's clock:
/// `host_ns` (`CLOCK_MONOTONIC`) for its reference `event`, recorded on a
/// stream of the gate's own, taken at `taken_at` (0: not taken; see
/// `gate::devclock`); `next`, the event the next one is recorded into,
/// which holds the one before (at `prev_ns`; 0: none) until then; none
/// tried again before `retry_at`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Calibration {
    pub(crate) ctx: usize,
    pub(crate) stream: usize,
    pub(crate) event: usize,
    pub(crate) next: usize,
    pub(crate) host_ns: u64,
    pub(crate) prev_ns: u64,
    pub(crate) taken_at: u64,
    pub(crate) retry_at: u64,
}

/// What a wait's completion ends the span at, as the wait began (see
/// `gate::devclock`).
#[derive(Debug, Clone, Copy, Default)]
pub(crate) enum ClockMark {
    /// The host's clock.
    #[default]
    Host,
    /// An event of context `ctx` (taken in context generation `epoch`),
    /// recorded on the span's stream just before the wait: the gate's,
    /// given back once the wait is over.
    Recorded {
        ctx: usize,
        event: usize,
        epoch: u64,
    },
    /// The program's event, whose completion the wait proves.
    Event(usize),
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
    /// Requests sent ahead of the calls that will want their answers (at
    /// start-up: the GPU map and a GPU's memory view, behind the hello),
    /// with their sequence numbers; forgotten as soon as any other
    /// request is sent, so an answer never predates a change of ours.
    pub ahead: Mutex<Vec<(Request, u32)>>,
    /// The scheduler's id of this connection (its welcome; 0: not known).
    pub client_id: AtomicU64,
    /// Non-zero once the hook has given up: every gated call fails with
    /// this result code.
    pub refused: AtomicU32,
    /// Launch gates per device ordinal.
    pub gates: Vec<Gate>,
    /// Each ordinal's GPU (UUID text, scheduler's index), found once.
    pub gpus: std::sync::OnceLock<Vec<(String, u32)>>,
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
    /// Captures open, by `capture::key` (see [`crate::capture`]), and how
    /// many.
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
    /// Contexts the process has (made, retained, or seen current at a
    /// token): (context, ordinal).
    pub contexts: Mutex<Vec<(usize, u32)>>,
    /// One lock per context, held while the hook synchronises it or the
    /// program makes it go (see `gate::context_may_go`); dropped with the
    /// context.
    pub syncing: Mutex<HashMap<usize, std::sync::Arc<Mutex<()>>>>,
    /// What this process holds reserved through the scheduler, by
    /// physical device: every reservation, whatever it is for (said again
    /// to a restarted scheduler).
    pub reserved: Mutex<HashMap<u32, u64>>,
    /// Of that, the leases the scheduler granted, by physical device:
    /// allocations within one make no round trip (see `memory::leased`).
    pub leases: Mutex<HashMap<u32, Lease>>,
    /// When the first of `leases` ends (ns; 0: none held), for the lease
    /// thread, which gives leases back as they end; woken by `lease_cv`
    /// at each new lease.
    pub lease_ends: AtomicU64,
    pub lease_cv: Condvar,
    /// The lease thread runs.
    pub lease_thread: AtomicBool,
    /// Of that, what is reserved for the memory the driver keeps for the
    /// process itself (contexts, their limits, modules), by physical
    /// device (see `memory::driver_held`).
    pub driver_held: Mutex<HashMap<u32, u64>>,
    /// Serialises the measurements of the driver's own memory.
    pub measuring: Mutex<()>,
    /// `cuMemCreate` handles' mappings (see `memory::mapped`).
    pub vmm: Mutex<Vmm>,
    /// Memory pools of host memory (`cuMemPoolCreate` with a host
    /// location): allocations from them take no device memory.
    pub host_pools: Mutex<HashSet<usize>>,
    /// What the driver keeps for each of the process's contexts, their
    /// limits, modules and libraries: (physical device, bytes charged).
    pub driver_objects: Mutex<HashMap<DriverObject, (u32, u64)>>,
    /// Where each event was last recorded (see `covers`).
    pub events: Mutex<HashMap<usize, Record>>,
    /// The job the process is a rank of: declared by its launcher, or
    /// the first NCCL communicator it made (said in every hello).
    pub job: Mutex<Option<String>>,
    /// The round trip to the scheduler, measured on the requests it
    /// answers at once (see `gemini_protocol::roundtrip`): every lead that
    /// hides one is derived from it.
    pub rtt: gemini_protocol::roundtrip::RoundTrip,
}

/// What the driver keeps for one object: a context, a limit of one, a
/// module or a library.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DriverObject {
    /// A context made with `cuCtxCreate` (its handle).
    Context(usize),
    /// The primary context of an ordinal (the ordinal, its handle).
    Primary(i32, usize),
    /// A limit (`CUlimit`) of a context.
    Limit(usize, i32),
    /// A module or library (its handle).
    Code(usize),
}

/// The mappings of `cuMemCreate` handles: a handle's memory stays with
/// the driver until it is released *and* its last mapping unmapped.
#[derive(Debug, Default)]
pub struct Vmm {
    /// Virtual address → (size, handle).
    pub maps: std::collections::BTreeMap<u64, (u64, u64)>,
    /// Handles released while mapped → their reservation (physical
    /// device, bytes), given back with the last unmap.
    pub released: HashMap<u64, (u32, u64)>,
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
    let job = Mutex::new(settings.job.clone());
    let fresh = Box::into_raw(Box::new(State {
        job,
        settings,
        conn: Mutex::new(None),
        register: Mutex::new(()),
        registered: AtomicBool::new(false),
        ahead: Mutex::new(Vec::new()),
        client_id: AtomicU64::new(0),
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
        syncing: Mutex::new(HashMap::new()),
        reserved: Mutex::new(HashMap::new()),
        leases: Mutex::new(HashMap::new()),
        lease_ends: AtomicU64::new(0),
        lease_cv: Condvar::new(),
        lease_thread: AtomicBool::new(false),
        driver_held: Mutex::new(HashMap::new()),
        measuring: Mutex::new(()),
        rtt: gemini_protocol::roundtrip::RoundTrip::new(),
        vmm: Mutex::new(Vmm::default()),
        host_pools: Mutex::new(HashSet::new()),
        driver_objects: Mutex::new(HashMap::new()),
        events: Mutex::new(HashMap::new()),
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

/// Memory the scheduler leased to this process on a device (see
/// `memory::leased`): allocations take from `slack` without asking until
/// `ends` (ns, counted from when the request was sent, so never after the
/// scheduler's own end), and frees give back to it up to `granted`.
#[derive(Debug, Clone, Copy)]
pub struct Lease {
    pub slack: u64,
    pub granted: u64,
    pub ends: u64,
}

/// One device's synchronisation thread and what it was asked (run by
/// [`crate::syncer`]).
#[derive(Debug, Default)]
pub struct Syncer {
    pub(crate) slot: Mutex<SyncSlot>,
    pub(crate) cv: Condvar,
}

#[derive(Debug, Default)]
pub(crate) struct SyncSlot {
    /// Synchronisations asked for, and done.
    pub(crate) asked: u64,
    pub(crate) done: u64,
    /// The context of the last one asked (see `gate::synchronize_device`).
    pub(crate) ctx: usize,
    /// Whether the last one done ran (not while a capture was open).
    pub(crate) ran: bool,
    /// When the last one was done (ns).
    pub(crate) done_at: u64,
    /// The thread runs.
    pub(crate) started: bool,
}

/// Where an event was last recorded.
#[derive(Debug, Clone, Copy)]
pub struct Record {
    /// Ordinal of the device whose gate counted the launches.
    pub device: usize,
    /// The stream (see `covers::stream_key`).
    pub stream: usize,
    /// Launches admitted under that gate when it was recorded.
    pub launches: u64,
}

/// Device ordinal of the calling thread's current context. A process
/// that sees one device needs no driver call to know it.
#[inline]
pub(crate) fn current_device() -> Option<usize> {
    if current().is_some_and(|s| s.single_device) {
        return Some(0);
    }
    let mut dev: i32 = -1;
    // SAFETY: out-pointer to a local.
    let r = unsafe { crate::driver::ctx_get_device(&mut dev) };
    (r == crate::cuda::CUDA_SUCCESS && dev >= 0 && (dev as usize) < MAX_GATES)
        .then_some(dev as usize)
}
