//! The holder at work. Per device: a *compute* thread that, while the
//! device is held, takes the shortest tokens the scheduler gives (one
//! kernel each, two when holding the device full; each token goes back as
//! soon as its kernels are queued, so a real client waiting always goes
//! first) and keeps at most three spin kernels queued, paced by credit at
//! a duty cycle steered by measured utilisation toward `--hold-util`; and
//! one *orders* thread that long-polls the scheduler,
//! tells idle devices from its activity reports and the device's memory,
//! takes and holds memory in chunks, and gives it back when ordered.
//!
//! A device is held when, for the whole wait period, no real client asked
//! for it and the memory others use stayed under `--mem-threshold`. Any
//! real client's request ends that at once (compute stops; memory is kept
//! until a client needs it, then freed chunk by chunk) and the wait starts
//! again.

use crate::control::{DeviceStatus, Status};
use crate::gpu::{Gpu, Nvml};
use crate::meter::Meter;
use crate::settings::Settings;
use cudarc::driver::CudaSlice;
use gemini_client::Session as Sched;
use gemini_protocol::{HeldMemory, HolderOrder, Reply, Request};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long one poll for orders waits.
const POLL: Duration = Duration::from_millis(100);
/// How often the duty cycle is corrected from measured utilisation.
const CONTROL_PERIOD: Duration = Duration::from_millis(200);
/// The most device time a paced holder catches up after a stall.
const MAX_CREDIT: Duration = Duration::from_millis(100);
/// How far the steered duty cycle may move from the target.
const STEER_RANGE: f64 = 0.25;

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn f64_load(a: &AtomicU64) -> f64 {
    f64::from_bits(a.load(Ordering::Relaxed))
}

fn f64_store(a: &AtomicU64, v: f64) {
    a.store(v.to_bits(), Ordering::Relaxed);
}

/// One held device.
pub struct Device {
    /// Physical index (= the CUDA ordinal in PCI bus order, which
    /// `main` asks CUDA for: run the holder without
    /// `CUDA_VISIBLE_DEVICES`).
    pub index: u32,
    gpu: Gpu,
    /// Compute runs while set.
    holding: AtomicBool,
    chunks: Mutex<Vec<CudaSlice<u8>>>,
    held: AtomicU64,
    duty: AtomicU64,
    util: AtomicU64,
    others: AtomicU64,
    /// When the device was last seen in use by others (ns since start).
    busy_at: AtomicU64,
    /// Memory the holder's own context took when it opened the device
    /// (bytes; counted out of others' where NVML cannot tell processes
    /// apart).
    own: u64,
    /// The real client that has the device now, as the scheduler said.
    used_by: Mutex<Option<String>>,
    /// The minute (ns since start) changes of the device's state are
    /// being logged in, and how many were.
    logged: Mutex<(u64, u32)>,
}

/// A device's changes of state logged per minute at most: a holder told
/// to wait 0 minutes beside a program that comes and goes would log
/// every burst.
const LOG_PER_MINUTE: u32 = 6;

impl Device {
    /// Whether a change of state at `now` is logged (and then counted).
    fn may_log(&self, now: u64) -> bool {
        let mut logged = lock(&self.logged);
        if now.saturating_sub(logged.0) >= 60_000_000_000 || logged.1 == 0 {
            *logged = (now, 0);
        }
        logged.1 += 1;
        logged.1 <= LOG_PER_MINUTE
    }
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("index", &self.index)
            .finish_non_exhaustive()
    }
}

/// State shared by the holder's threads.
#[derive(Debug)]
pub struct Engine {
    /// Settings in force.
    pub settings: Mutex<Settings>,
    /// The devices.
    pub devices: Vec<Device>,
    /// `gem-holder stop`: hold nothing until `start`.
    pub stopped: AtomicBool,
    /// Everything must be released at the orders thread's next turn.
    pub release: AtomicBool,
    /// The process is exiting.
    pub exit: AtomicBool,
    /// The scheduler answered the last poll.
    pub scheduler_up: AtomicBool,
    ipc: PathBuf,
    nvml: Option<Nvml>,
    start: Instant,
}

/// Gives the token of `device` back, reporting what `meter` measured
/// (best effort: a scheduler that is gone has nothing to give back to).
fn release_token(sched: &mut Sched, device: u32, meter: &Meter) {
    let (ran, in_flight) = meter.take();
    let _ = sched.call(
        &Request::ReleaseToken {
            device,
            ran,
            in_flight,
        },
        Duration::from_secs(2),
        &[],
    );
}

/// Reports what `meter` measured of kernels that ran after the holder's
/// last token (best effort).
fn report_late(sched: &mut Sched, device: u32, meter: &Meter) {
    let (ran, _) = meter.take();
    if ran.is_empty() {
        return;
    }
    let _ = sched.call(
        &Request::LateUsage { device, ran },
        Duration::from_secs(2),
        &[],
    );
}

impl Engine {
    /// Opens the devices.
    pub fn new(settings: Settings, ipc: PathBuf) -> anyhow::Result<Arc<Engine>> {
        let count = crate::gpu::device_count()
            .map_err(|e| anyhow::anyhow!("cannot count the GPUs: {}", crate::gpu::describe(&e)))?;
        let indices: Vec<u32> = if settings.devices.is_empty() {
            (0..count).collect()
        } else {
            settings.devices.clone()
        };
        if let Some(&missing) = indices.iter().find(|&&i| i >= count) {
            return Err(crate::Invalid(format!(
                "--devices: there is no device {missing}; the driver reports {count} device(s){}",
                if count > 0 {
                    format!(", numbered 0 to {}", count - 1)
                } else {
                    String::new()
                }
            ))
            .into());
        }
        let mut devices = Vec::new();
        let nvml = Nvml::load();
        for index in indices {
            // What the device has in use before the holder's context, and
            // after: the context's own memory (where NVML can say).
            let before = nvml.as_ref().and_then(|n| n.used_memory(index));
            let gpu = Gpu::open(index).map_err(|e| {
                anyhow::anyhow!("cannot use device {index}: {}", crate::gpu::describe(&e))
            })?;
            let after = nvml.as_ref().and_then(|n| n.used_memory(index));
            let own = match (before, after) {
                (Some(b), Some(a)) => a.saturating_sub(b),
                _ => 0,
            };
            devices.push(Device {
                index,
                gpu,
                holding: AtomicBool::new(false),
                chunks: Mutex::new(Vec::new()),
                held: AtomicU64::new(0),
                duty: AtomicU64::new(settings.hold_util.to_bits()),
                util: AtomicU64::new(f64::NAN.to_bits()),
                others: AtomicU64::new(0),
                busy_at: AtomicU64::new(0),
                own,
                used_by: Mutex::new(None),
                logged: Mutex::new((0, 0)),
            });
        }
        Ok(Arc::new(Engine {
            settings: Mutex::new(settings),
            devices,
            stopped: AtomicBool::new(false),
            release: AtomicBool::new(false),
            exit: AtomicBool::new(false),
            scheduler_up: AtomicBool::new(false),
            ipc,
            nvml,
            start: Instant::now(),
        }))
    }

    fn now(&self) -> u64 {
        self.start.elapsed().as_nanos() as u64
    }

    fn held_memory(&self) -> Vec<HeldMemory> {
        self.devices
            .iter()
            .map(|d| HeldMemory {
                device: d.index,
                bytes: d.held.load(Ordering::Relaxed),
            })
            .filter(|h| h.bytes > 0)
            .collect()
    }

    /// Starts the threads.
    pub fn spawn(self: &Arc<Self>) -> Vec<std::thread::JoinHandle<()>> {
        let mut threads = Vec::new();
        for i in 0..self.devices.len() {
            let e = Arc::clone(self);
            threads.push(std::thread::spawn(move || e.compute(i)));
        }
        let e = Arc::clone(self);
        threads.push(std::thread::spawn(move || e.orders()));
        threads
    }

    /// The state for `gem-holder status`.
    pub fn status(&self) -> Status {
        let wait = lock(&self.settings).wait_ns();
        let now = self.now();
        Status {
            settings: lock(&self.settings).clone(),
            stopped: self.stopped.load(Ordering::Relaxed),
            scheduler: self.scheduler_up.load(Ordering::Relaxed),
            devices: self
                .devices
                .iter()
                .map(|d| {
                    let idle = now.saturating_sub(d.busy_at.load(Ordering::Relaxed));
                    let used_by = lock(&d.used_by).clone();
                    let state = if self.stopped.load(Ordering::Relaxed) {
                        "stopped".to_string()
                    } else if let Some(who) = used_by {
                        format!("yielded to {who}")
                    } else if d.holding.load(Ordering::Relaxed) {
                        "holding".to_string()
                    } else {
                        "waiting".to_string()
                    };
                    let _ = wait;
                    let util = f64_load(&d.util);
                    DeviceStatus {
                        device: d.index,
                        state,
                        held_bytes: d.held.load(Ordering::Relaxed),
                        duty: f64_load(&d.duty),
                        utilisation: (!util.is_nan()).then_some(util),
                        others_used: d.others.load(Ordering::Relaxed),
                        idle_seconds: idle as f64 / 1e9,
                    }
                })
                .collect(),
        }
    }

    // ---- compute -------------------------------------------------------

    fn compute(&self, i: usize) {
        let d = &self.devices[i];
        let mut sched = Sched::new(&self.ipc, gemini_protocol::Role::Holder, "");
        // Kernels launched and not yet seen complete, and when they ran.
        let meter = match Meter::start(d.index) {
            Ok(m) => m,
            Err(e) => {
                tracing::error!("device {}: cannot start its meter thread: {e}", d.index);
                return;
            }
        };
        let mut last_control = Instant::now();
        // Device time earned and not yet spent, below full (ns).
        let mut credit_ns = 0.0f64;
        let mut paced_at = Instant::now();
        while !self.exit.load(Ordering::Relaxed) {
            if !d.holding.load(Ordering::Relaxed) {
                // What ran after the last token is charged once done.
                if meter.in_flight() > 0 {
                    meter.wait_until_at_most(0, Duration::from_secs(1));
                }
                report_late(&mut sched, d.index, &meter);
                credit_ns = 0.0;
                paced_at = Instant::now();
                std::thread::sleep(Duration::from_millis(10));
                continue;
            }
            let (target, kernel_ns) = {
                let s = lock(&self.settings);
                (s.hold_util, s.kernel_ns())
            };
            if last_control.elapsed() >= CONTROL_PERIOD {
                last_control = Instant::now();
                self.steer(d, target);
            }
            let duty = f64_load(&d.duty);
            // Asked to keep the device full: two kernels per token, so one
            // round trip per millisecond of work keeps up even where round
            // trips are slow (an idle VM's CPUs wake up slowly).
            let full = target >= 0.999;
            let batch: u64 = if full { 2 } else { 1 };
            // Below full, kernels are paced by credit earned at the duty
            // cycle. Kernels stay queued either way (at most three), so a
            // stall of this thread (a busy or oversubscribed CPU) does not
            // stop the device at once, and the credit earned meanwhile is
            // spent after it: the average stays at the duty cycle.
            let now = Instant::now();
            credit_ns = (credit_ns + duty * now.duration_since(paced_at).as_nanos() as f64)
                .min(MAX_CREDIT.as_nanos() as f64);
            paced_at = now;
            let need = (batch * kernel_ns) as f64;
            if !full && credit_ns < need {
                let short = (need - credit_ns) / duty.max(0.01);
                std::thread::sleep(Duration::from_nanos(short as u64));
                continue;
            }
            // The last token was given back with its use reported; what
            // ran since is reported now.
            let (ran, in_flight) = meter.take();
            let req = Request::AcquireToken {
                device: d.index,
                ran,
                in_flight,
                burst_us: batch * kernel_ns / 1000,
                rtt_us: sched.rtt_us(),
                launch_us: u32::try_from(kernel_ns.div_ceil(1000)).unwrap_or(u32::MAX),
            };
            match sched.call(&req, Duration::from_secs(5), &[]) {
                Ok(Reply::Token { .. }) => {}
                _ => {
                    std::thread::sleep(Duration::from_millis(100));
                    continue;
                }
            }
            for _ in 0..batch {
                let launched = gemini_protocol::clock::monotonic_ns();
                match d.gpu.spin(kernel_ns) {
                    Ok(ev) => meter.launched(launched, ev),
                    Err(e) => {
                        tracing::error!("device {}: kernel launch failed: {e}", d.index);
                        std::thread::sleep(Duration::from_secs(1));
                        break;
                    }
                }
            }
            credit_ns -= need;
            // Give the token back before waiting for anything (a real
            // client asking meanwhile gets the device at once, its kernels
            // queued behind the holder's few), and keep at most three
            // kernels queued while the next token is asked for.
            release_token(&mut sched, d.index, &meter);
            meter.wait_until_at_most(3, Duration::from_secs(1));
        }
        meter.stop();
    }

    /// Closed loop: move the duty cycle by the gap between target and the
    /// utilisation NVML measured (open loop where there is no NVML).
    fn steer(&self, d: &Device, target: f64) {
        if target >= 0.999 {
            f64_store(&d.duty, 1.0);
            return;
        }
        let Some(u) = self.nvml.as_ref().and_then(|n| n.utilisation(d.index)) else {
            f64_store(&d.duty, target);
            return;
        };
        f64_store(&d.util, u);
        // Pacing by credit already makes up for stalls; the loop only
        // corrects a steady bias, so it moves gently and stays near the
        // target (a stall must not wind it up into overshoot).
        let lo = (target - STEER_RANGE).max(0.01);
        let hi = (target + STEER_RANGE).min(1.0);
        let duty = (f64_load(&d.duty) + 0.25 * (target - u)).clamp(lo, hi);
        f64_store(&d.duty, duty);
    }

    // ---- orders and memory ---------------------------------------------

    fn orders(&self) {
        let mut sched = Sched::new(&self.ipc, gemini_protocol::Role::Holder, "");
        while !self.exit.load(Ordering::Relaxed) {
            if self.release.swap(false, Ordering::AcqRel) {
                self.release_all(&mut sched);
            }
            let req = Request::HolderPoll {
                wait_us: POLL.as_micros() as u64,
            };
            let reply = sched.call(&req, POLL + Duration::from_secs(2), &self.held_memory());
            match reply {
                Ok(Reply::Holder(HolderOrder::FreeMemory { device, bytes })) => {
                    self.scheduler_answers();
                    self.free_memory(&mut sched, device, bytes);
                }
                Ok(Reply::Holder(HolderOrder::Report(activity))) => {
                    self.scheduler_answers();
                    self.update(&mut sched, &activity);
                }
                Ok(Reply::Holder(HolderOrder::Stop)) => {
                    tracing::info!("the scheduler is shutting down; releasing everything");
                    self.release_all(&mut sched);
                    self.scheduler_up.store(false, Ordering::Relaxed);
                }
                Ok(other) => {
                    tracing::warn!("unexpected answer from the scheduler: {other:?}");
                    std::thread::sleep(Duration::from_secs(1));
                }
                Err(e) => {
                    if self.scheduler_up.swap(false, Ordering::Relaxed) {
                        tracing::warn!("{e}; releasing everything until it is back");
                    }
                    self.release_all(&mut sched);
                    std::thread::sleep(Duration::from_millis(500));
                }
            }
        }
        self.release_all(&mut sched);
    }

    /// The scheduler answered: said once each time it comes (back).
    fn scheduler_answers(&self) {
        if !self.scheduler_up.swap(true, Ordering::Relaxed) {
            tracing::info!("the scheduler answers: idle GPUs will be held");
        }
    }

    /// Decides, per device, whether to hold it.
    fn update(&self, sched: &mut Sched, activity: &[gemini_protocol::DeviceActivity]) {
        let settings = lock(&self.settings).clone();
        let now = self.now();
        for d in &self.devices {
            // Others' memory: what NVML says the other processes use (the
            // holder's own context, 500 MiB and more on a real GPU, is not
            // others', or the default threshold would never let it hold);
            // without NVML, what the device has in use but the holder's
            // chunks and its own context as measured when it opened it.
            let nvml = self
                .nvml
                .as_ref()
                .and_then(|n| n.others_memory(d.index, std::process::id()));
            let others = nvml.or_else(|| {
                d.gpu.mem_info().ok().map(|(free, total)| {
                    total
                        .saturating_sub(free)
                        .saturating_sub(d.held.load(Ordering::Relaxed))
                        .saturating_sub(d.own)
                })
            });
            if let Some(others) = others {
                d.others.store(others, Ordering::Relaxed);
                if others >= settings.mem_threshold {
                    d.busy_at.store(now, Ordering::Relaxed);
                }
            }
            if let Some(a) = activity.iter().find(|a| a.device == d.index) {
                if a.idle_us != u64::MAX {
                    let last = now.saturating_sub(a.idle_us.saturating_mul(1000));
                    d.busy_at.fetch_max(last, Ordering::Relaxed);
                }
                // Said only where the holder had something to yield (a
                // program's every burst would be a line otherwise).
                let had = d.holding.load(Ordering::Relaxed) || d.held.load(Ordering::Relaxed) != 0;
                let mut used_by = lock(&d.used_by);
                let yielded = (a.used_by != *used_by && had)
                    .then(|| a.used_by.clone())
                    .flatten();
                used_by.clone_from(&a.used_by);
                drop(used_by);
                if let Some(who) = yielded
                    && d.may_log(now)
                {
                    tracing::info!("GPU {}: yielded to {who}", d.index);
                }
            }
            let idle_for = now.saturating_sub(d.busy_at.load(Ordering::Relaxed));
            let idle = !self.stopped.load(Ordering::Relaxed) && idle_for >= settings.wait_ns();
            let holding = d.holding.load(Ordering::Relaxed);
            if idle && !holding {
                if d.held.load(Ordering::Relaxed) == 0 {
                    self.take_memory(sched, d, &settings);
                }
                d.holding.store(true, Ordering::Relaxed);
                d.may_log(now).then(|| {
                    tracing::info!(
                        "GPU {}: idle for {:.1} min: holding it ({} of memory)",
                        d.index,
                        idle_for as f64 / 60e9,
                        gemini_protocol::units::format_size(d.held.load(Ordering::Relaxed))
                    )
                });
            } else if !idle && holding {
                // A real client came back: compute stops at once; memory is
                // kept until one needs it.
                d.holding.store(false, Ordering::Relaxed);
                d.may_log(now).then(|| tracing::info!(
                    "GPU {}: in use again: compute stopped ({} of memory kept until a program needs it)",
                    d.index,
                    gemini_protocol::units::format_size(d.held.load(Ordering::Relaxed))
                ));
            }
        }
    }

    fn take_memory(&self, sched: &mut Sched, d: &Device, settings: &Settings) {
        let Ok((free, _)) = d.gpu.mem_info() else {
            return;
        };
        let target = settings.hold_mem.bytes(free);
        let chunk = (target / 16).max(64 << 20);
        let mut chunks = lock(&d.chunks);
        let mut held = d.held.load(Ordering::Relaxed);
        while held < target {
            let n = chunk.min(target - held);
            let reserved = sched.call(
                &Request::ReserveMemory {
                    device: d.index,
                    bytes: n,
                },
                Duration::from_secs(2),
                &[],
            );
            if !matches!(reserved, Ok(Reply::Memory { .. })) {
                break;
            }
            match d.gpu.alloc(n) {
                Ok(c) => {
                    chunks.push(c);
                    held += n;
                    d.held.store(held, Ordering::Relaxed);
                }
                Err(_) => {
                    let _ = sched.call(
                        &Request::ReleaseMemory {
                            device: d.index,
                            bytes: n,
                        },
                        Duration::from_secs(2),
                        &[],
                    );
                    break;
                }
            }
        }
    }

    fn free_memory(&self, sched: &mut Sched, device: u32, bytes: u64) {
        let Some(d) = self.devices.iter().find(|d| d.index == device) else {
            return;
        };
        // The device is wanted: stop holding it and start waiting again.
        d.holding.store(false, Ordering::Relaxed);
        d.busy_at.store(self.now(), Ordering::Relaxed);
        let mut freed = 0u64;
        {
            let mut chunks = lock(&d.chunks);
            while freed < bytes {
                let Some(c) = chunks.pop() else { break };
                freed += c.len() as u64;
                drop(c);
            }
            if freed > 0 {
                let _ = d.gpu.synchronize();
            }
            d.held
                .fetch_sub(freed.min(d.held.load(Ordering::Relaxed)), Ordering::Relaxed);
        }
        if freed > 0 && d.may_log(self.now()) {
            tracing::info!(
                "GPU {device}: a program needs memory: gave back {}",
                gemini_protocol::units::format_size(freed)
            );
        }
        let _ = sched.call(
            &Request::ReleaseMemory {
                device,
                bytes: freed,
            },
            Duration::from_secs(2),
            &[],
        );
    }

    fn release_all(&self, sched: &mut Sched) {
        for d in &self.devices {
            d.holding.store(false, Ordering::Relaxed);
            let freed: u64 = {
                let mut chunks = lock(&d.chunks);
                let n = chunks.iter().map(|c| c.len() as u64).sum();
                chunks.clear();
                n
            };
            let _ = d.gpu.synchronize();
            d.held.store(0, Ordering::Relaxed);
            if freed > 0 {
                let _ = sched.call(
                    &Request::ReleaseMemory {
                        device: d.index,
                        bytes: freed,
                    },
                    Duration::from_millis(500),
                    &[],
                );
            }
        }
    }
}
