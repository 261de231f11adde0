//! The simulated devices, shared by every process that loads the
//! simulator with the same `FAKECUDA_DIR`: a memory-mapped state file holds
//! each device's timeline (when it will next be free) and each process's
//! memory, so kernels from several processes queue on one device and
//! allocations from several processes share its memory.
//!
//! Settings (read when a process first initialises):
//! - `FAKECUDA_DIR`: directory of the state file and busy logs (default
//!   `/tmp/fakecuda-$UID`).
//! - `FAKECUDA_DEVICES`: number of devices, 1..=16 (default 1).
//! - `FAKECUDA_MEM`: memory per device, e.g. `16GiB` (default 16GiB).
//! - `FAKECUDA_QUEUE_DEPTH`: kernels a process may have queued on a device
//!   before a launch blocks, as the real launch queue does (default 1024).
//! - `FAKECUDA_POOLS`: `0` to report no memory-pool support (attribute
//!   115), so cudarc allocates with `cuMemAlloc_v2` (default 1).
//! - `FAKECUDA_CTX_MEM`: device memory a context takes for itself when it
//!   is created (a primary context at its first retain), with the default
//!   limits (`cuCtxSetLimit`) included; default 500MiB, the order of what
//!   a bare CUDA 12 context holds on an H100.
//! - `FAKECUDA_MODULE_MEM`: device memory a loaded module takes: `image`
//!   (default) for the size of its image, or a fixed size.
//! - `FAKECUDA_TAG`: a name this process's device memory is summed under
//!   with every other process of the same tag, for the tests (the harness
//!   sets the group's name): see `fakecuda_log::groups`.
//! - `FAKECUDA_CGROUP_DEVICES`: the devices the process's device cgroup
//!   lets it open (Slurm's `ConstrainDevices`, a container's `--gpus`), a
//!   list of device indices; default all. As with the real driver, CUDA
//!   enumerates only those, renumbered from 0 in index order, and NVML
//!   still counts every device but refuses a handle to the others
//!   (`NVML_ERROR_NO_PERMISSION`).
//! - `FAKECUDA_CONTAINER`: `1` for a container that has only the device
//!   nodes of `FAKECUDA_CGROUP_DEVICES` (Kubernetes' device plugin,
//!   `docker run --gpus`): NVML too enumerates only those, renumbered from
//!   0 in index order (`nvmlDeviceGetIndex` gives the container's index),
//!   and a UUID of another device is not found (`NVML_ERROR_NOT_FOUND`).
//! - `FAKECUDA_MIG`: devices in MIG mode, a list of indices; each has one
//!   MIG instance, whose UUID is the GPU's with its 15th byte `0x4d`
//!   (`MIG-facec0da-0000-4000-8000-000000004d02` on device 2). CUDA sees
//!   an instance only where `CUDA_VISIBLE_DEVICES` names it, and then
//!   gives its UUID (`cuDeviceGetUuid`); NVML finds it by that UUID
//!   (`nvmlDeviceGetHandleByUUID`), and gives its GPU
//!   (`nvmlDeviceGetDeviceHandleFromMigDeviceHandle`). Its work and memory
//!   are its GPU's.
//! - `CUDA_VISIBLE_DEVICES`: as with the real driver, a list of indices
//!   (of the devices the cgroup allows), GPU UUIDs (`GPU-…`) or MIG
//!   instance UUIDs (`MIG-…`) makes the process see only those,
//!   renumbered from 0 in that order (the list stops at the first entry
//!   that names no device it may see).
//!
//! - Memory limits per cgroup (R615 drivers, CUDA 13.4): where the
//!   simulated driver is 13.4 or later (`FAKECUDA_DRIVER_VERSION` ≥
//!   13040), NVML's `nvmlDeviceSetMemoryLimits_v1` sets a hard and a soft
//!   limit of a device's memory for a cgroup (v2 path), kept in
//!   `mem-limits` in `FAKECUDA_DIR`. A process whose cgroup
//!   (`/proc/self/cgroup`, any hierarchy) is that cgroup or below it is
//!   refused an allocation that would take the cgroup's processes past
//!   the hard limit (`CUDA_ERROR_OUT_OF_MEMORY`), and its `cuMemGetInfo`
//!   and NVML memory queries report the limit as the total, and what the
//!   cgroup's processes leave of it as free. Limits of 0 remove it. The
//!   soft limit is kept and reported; nothing enforces it.
//!
//! - `FAKECUDA_WAKEUP_US`: how late a blocking wait returns after the
//!   work it waits for ended (default 0): what a host that wakes the
//!   waiting thread late costs (a blocking-sync context woken by the
//!   driver's interrupt, a loaded CPU, a descheduled vCPU). A wait for
//!   work already done returns at once, as it does on a real driver.
//!
//! - `FAKECUDA_TIMESLICE_US`: the devices time-slice the work of
//!   different processes in slices of this many microseconds, as a real
//!   GPU does (see [`slicing`]); unset or 0, each device runs every
//!   process's work in launch order.
//!
//! The first process to create the state file fixes devices and memory;
//! later ones use what the file says.

mod memory;
pub mod slicing;

use crate::types::*;
use fakecuda_log::{Kind, Record, append, now_ns};
pub use memory::{MemoryLimit, within};
use std::collections::VecDeque;
use std::os::fd::AsRawFd;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard, OnceLock};

pub const MAX_DEVICES: usize = 16;
const MAX_PROCS: usize = 1024;
const MAGIC: u64 = 0x4641_4b45_4355_4403; // "FAKECUD" v3

#[repr(C)]
struct Slot {
    pid: AtomicU32,
    _pad: u32,
    /// `fakecuda_log::groups::tag_hash` of the process's `FAKECUDA_TAG`.
    tag: AtomicU64,
    mem: [AtomicU64; MAX_DEVICES],
    /// Per device, the end of the process's last queued work (ns).
    booked: [AtomicU64; MAX_DEVICES],
}

#[repr(C)]
struct Shared {
    magic: AtomicU64,
    devices: AtomicU32,
    _pad: u32,
    mem_total: [AtomicU64; MAX_DEVICES],
    busy_until: [AtomicU64; MAX_DEVICES],
    slots: [Slot; MAX_PROCS],
}

/// This process's view of the simulator.
pub struct Sim {
    shared: &'static Shared,
    file: std::fs::File,
    pub dir: PathBuf,
    pub pid: u32,
    pub queue_depth: usize,
    pub pools: bool,
    /// `FAKECUDA_CTX_MEM`.
    pub ctx_mem: u64,
    /// `FAKECUDA_MODULE_MEM` when fixed; `None`: a module's image size.
    pub module_mem: Option<u64>,
    /// Hash of `FAKECUDA_TAG` (0: none).
    tag: u64,
    groups: Option<fakecuda_log::groups::Groups>,
    /// Physical devices this process sees, by ordinal.
    visible: Vec<usize>,
    /// By ordinal: whether it is the MIG instance of its device.
    visible_mig: Vec<bool>,
    /// Devices in MIG mode (`FAKECUDA_MIG`).
    pub mig: Vec<usize>,
    /// Physical devices its device cgroup lets it open.
    allowed: Vec<usize>,
    /// Physical devices NVML enumerates, by NVML index: every device, or
    /// in a container only `allowed`.
    nvml: Vec<usize>,
    /// Ends of this process's queued kernels, per device.
    pending: Vec<Mutex<VecDeque<u64>>>,
    /// Latest end of any work of this process, per device.
    pub last_end: Vec<AtomicU64>,
    /// Legacy default stream tail, per device.
    pub legacy_tail: Vec<std::sync::Arc<AtomicU64>>,
    mem_lock: Mutex<()>,
    /// `FAKECUDA_WAKEUP_US`, in ns.
    wakeup_ns: u64,
    /// The time-sliced devices (`FAKECUDA_TIMESLICE_US`).
    pub slicer: Option<slicing::Slicer>,
}

fn env_or(name: &str, default: &str) -> String {
    std::env::var(name)
        .ok()
        .filter(|v| !v.is_empty())
        .unwrap_or_else(|| default.to_string())
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn pid_alive(pid: u32) -> bool {
    // SAFETY: signal 0 only checks that the process exists.
    let r = unsafe { libc::kill(pid as i32, 0) };
    r == 0 || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

/// How long before the end a wait stops sleeping and spins.
const SPIN_NS: u64 = 200_000;

/// Waits until `CLOCK_MONOTONIC` reaches `t` ns, as the real driver's
/// synchronisation does by default (`CU_CTX_SCHED_AUTO` spins while the
/// process has no more contexts than there are CPUs): it sleeps until
/// shortly before the end, then spins, yielding the CPU, so a program that
/// waits for its work sees it finish within microseconds, not a timer
/// wake-up later.
pub fn sleep_until(t: u64) {
    let sleep_to = t.saturating_sub(SPIN_NS);
    while now_ns() < sleep_to {
        let ts = libc::timespec {
            tv_sec: (sleep_to / 1_000_000_000) as i64,
            tv_nsec: (sleep_to % 1_000_000_000) as i64,
        };
        // SAFETY: `ts` is a valid timespec; the remaining-time pointer may
        // be null with TIMER_ABSTIME.
        unsafe {
            libc::clock_nanosleep(
                libc::CLOCK_MONOTONIC,
                libc::TIMER_ABSTIME,
                &ts,
                std::ptr::null_mut(),
            )
        };
    }
    while now_ns() < t {
        std::thread::yield_now();
    }
}

/// Opens (or creates) `path`, a file of `size` bytes every process of the
/// simulator maps, and maps it for good (never unmapped). `init` runs on
/// the mapping under the file lock, told whether the file was made anew
/// (it was missing, or of another layout: an older simulator's), so that
/// one process fills a fresh state in before any other reads it.
fn map_shared(
    path: &std::path::Path,
    size: usize,
    init: impl FnOnce(*mut libc::c_void, bool),
) -> Result<(std::fs::File, *mut libc::c_void), String> {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .create(true)
        .truncate(false)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    let guard = FileLock::new(&file);
    let fresh = file.metadata().map_err(|e| e.to_string())?.len() != size as u64;
    if fresh {
        file.set_len(0).map_err(|e| e.to_string())?;
        file.set_len(size as u64).map_err(|e| e.to_string())?;
    }
    // SAFETY: mapping `size` bytes of a file that long, shared and
    // writable; the caller never unmaps it.
    let ptr = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            size,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    if ptr == libc::MAP_FAILED {
        return Err(format!(
            "mmap {}: {}",
            path.display(),
            std::io::Error::last_os_error()
        ));
    }
    init(ptr, fresh);
    drop(guard);
    Ok((file, ptr))
}

struct FileLock<'a>(&'a std::fs::File);

impl<'a> FileLock<'a> {
    fn new(f: &'a std::fs::File) -> FileLock<'a> {
        // SAFETY: flock on an fd we own; blocks until the lock is ours.
        while unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) } != 0 {}
        FileLock(f)
    }
}

impl Drop for FileLock<'_> {
    fn drop(&mut self) {
        // SAFETY: unlocking the fd we locked.
        unsafe { libc::flock(self.0.as_raw_fd(), libc::LOCK_UN) };
    }
}

impl Sim {
    fn open() -> Result<Sim, String> {
        // SAFETY: getuid cannot fail.
        let uid = unsafe { libc::getuid() };
        let dir = PathBuf::from(env_or("FAKECUDA_DIR", &format!("/tmp/fakecuda-{uid}")));
        std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
        let init = |ptr: *mut libc::c_void, fresh: bool| {
            // SAFETY: the mapping is page-aligned, large enough, and every
            // field of `Shared` is an atomic or padding, valid for any
            // bytes.
            let shared: &Shared = unsafe { &*(ptr as *const Shared) };
            if fresh || shared.magic.load(Ordering::Acquire) != MAGIC {
                let devices: u32 = env_or("FAKECUDA_DEVICES", "1")
                    .parse()
                    .unwrap_or(1)
                    .clamp(1, MAX_DEVICES as u32);
                let mem =
                    parse_size::parse_size(env_or("FAKECUDA_MEM", "16GiB")).unwrap_or(16 << 30);
                shared.devices.store(devices, Ordering::Relaxed);
                for m in &shared.mem_total {
                    m.store(mem, Ordering::Relaxed);
                }
                shared.magic.store(MAGIC, Ordering::Release);
            }
        };
        let (file, ptr) = map_shared(&dir.join("state"), std::mem::size_of::<Shared>(), init)?;
        // SAFETY: as in `init`; the mapping lives for the rest of the
        // process (never unmapped), so the 'static reference is valid.
        let shared: &'static Shared = unsafe { &*(ptr as *const Shared) };
        let n = MAX_DEVICES;
        let count = shared.devices.load(Ordering::Relaxed) as usize;
        let allowed: Vec<usize> = match std::env::var("FAKECUDA_CGROUP_DEVICES") {
            Ok(list) => {
                let mut v: Vec<usize> = list
                    .split(',')
                    .filter_map(|s| s.trim().parse::<usize>().ok())
                    .filter(|&d| d < count)
                    .collect();
                v.sort_unstable();
                v.dedup();
                v
            }
            Err(_) => (0..count).collect(),
        };
        let mig: Vec<usize> = std::env::var("FAKECUDA_MIG")
            .unwrap_or_default()
            .split(',')
            .filter_map(|s| s.trim().parse::<usize>().ok())
            .filter(|&d| d < count)
            .collect();
        let (visible, visible_mig): (Vec<usize>, Vec<bool>) =
            match std::env::var("CUDA_VISIBLE_DEVICES") {
                Ok(list) => list
                    .split(',')
                    .map(str::trim)
                    .map_while(|e| {
                        if let Ok(i) = e.parse::<usize>() {
                            return allowed.get(i).map(|&d| (d, false));
                        }
                        allowed.iter().find_map(|&d| {
                            if e == uuid_text(d) {
                                Some((d, false))
                            } else if mig.contains(&d) && e == mig_uuid_text(d) {
                                Some((d, true))
                            } else {
                                None
                            }
                        })
                    })
                    .unzip(),
                Err(_) => (allowed.clone(), vec![false; allowed.len()]),
            };
        let nvml = if std::env::var("FAKECUDA_CONTAINER").is_ok_and(|v| v == "1") {
            allowed.clone()
        } else {
            (0..count).collect()
        };
        let groups = fakecuda_log::groups::Groups::open(&dir).ok();
        let slice_us: u64 = env_or("FAKECUDA_TIMESLICE_US", "0").parse().unwrap_or(0);
        let slicer = match slice_us {
            0 => None,
            us => Some(slicing::Slicer::open(&dir, us * 1000, count)?),
        };
        Ok(Sim {
            slicer,
            shared,
            file,
            dir,
            pid: std::process::id(),
            queue_depth: env_or("FAKECUDA_QUEUE_DEPTH", "1024")
                .parse()
                .unwrap_or(1024)
                .max(1),
            pools: env_or("FAKECUDA_POOLS", "1") != "0",
            wakeup_ns: env_or("FAKECUDA_WAKEUP_US", "0")
                .parse::<u64>()
                .unwrap_or(0)
                .saturating_mul(1000),
            ctx_mem: parse_size::parse_size(env_or("FAKECUDA_CTX_MEM", "500MiB"))
                .unwrap_or(500 << 20),
            module_mem: match env_or("FAKECUDA_MODULE_MEM", "image").as_str() {
                "image" => None,
                v => parse_size::parse_size(v).ok(),
            },
            tag: std::env::var("FAKECUDA_TAG")
                .ok()
                .filter(|t| !t.is_empty())
                .map_or(0, |t| fakecuda_log::groups::tag_hash(&t)),
            groups,
            visible,
            visible_mig,
            mig,
            allowed,
            nvml,
            pending: (0..n).map(|_| Mutex::new(VecDeque::new())).collect(),
            last_end: (0..n).map(|_| AtomicU64::new(0)).collect(),
            legacy_tail: (0..n)
                .map(|_| std::sync::Arc::new(AtomicU64::new(0)))
                .collect(),
            mem_lock: Mutex::new(()),
        })
    }

    /// Number of simulated devices, visible or not.
    pub fn total_devices(&self) -> usize {
        self.shared.devices.load(Ordering::Relaxed) as usize
    }

    /// Number of devices this process sees.
    pub fn devices(&self) -> i32 {
        self.visible.len() as i32
    }

    /// Whether ordinal `ordinal` is a MIG instance (of its physical device).
    pub fn is_mig(&self, ordinal: usize) -> bool {
        self.visible_mig.get(ordinal).copied().unwrap_or(false)
    }

    /// The physical device of ordinal `ordinal`.
    pub fn physical(&self, ordinal: usize) -> Option<usize> {
        self.visible.get(ordinal).copied()
    }

    /// Whether the process's device cgroup lets it open device `dev`.
    pub fn may_open(&self, dev: usize) -> bool {
        self.allowed.contains(&dev)
    }

    /// Number of devices NVML enumerates: every device, or in a container
    /// only its own.
    pub fn nvml_count(&self) -> usize {
        self.nvml.len()
    }

    /// The physical device of NVML index `index`.
    pub fn nvml_device(&self, index: usize) -> Option<usize> {
        self.nvml.get(index).copied()
    }

    /// NVML's index of physical device `dev`, `None` where NVML does not
    /// see it (a container without it).
    pub fn nvml_index(&self, dev: usize) -> Option<usize> {
        self.nvml.iter().position(|&d| d == dev)
    }

    /// The ordinal of physical device `dev` in this process.
    pub fn ordinal(&self, dev: usize) -> Option<usize> {
        self.visible.iter().position(|&d| d == dev)
    }

    /// Memory of `dev`.
    pub fn mem_total(&self, dev: usize) -> u64 {
        self.shared.mem_total[dev].load(Ordering::Relaxed)
    }

    /// Runs `dur_ns` of work on `dev` after what `tail` already holds;
    /// blocks while this process has `queue_depth` kernels queued there.
    /// Returns the end of the work: a time, or on time-sliced devices a
    /// pending value (see [`slicing`]).
    pub fn run(
        &self,
        dev: usize,
        dur_ns: u64,
        tail: &AtomicU64,
        kind: u32,
    ) -> Result<u64, CUresult> {
        if let Some(ts) = &self.slicer {
            let gate = self.gate_for(dev, tail.load(Ordering::Acquire));
            let end = ts
                .enqueue(dev, dur_ns, gate, Some(kind), self.queue_depth)
                .map_err(|_| CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)?;
            tail.fetch_max(end, Ordering::AcqRel);
            self.last_end[dev].fetch_max(end, Ordering::AcqRel);
            return Ok(end);
        }
        {
            let mut q = lock(&self.pending[dev]);
            loop {
                let now = now_ns();
                while q.front().is_some_and(|&e| e <= now) {
                    q.pop_front();
                }
                if q.len() < self.queue_depth {
                    break;
                }
                let first = q.front().copied().unwrap_or(now);
                sleep_until(first);
            }
        }
        let (start, end) = {
            let _g = lock(&self.mem_lock);
            let _f = FileLock::new(&self.file);
            let busy = &self.shared.busy_until[dev];
            let now = now_ns();
            let mut cur = busy.load(Ordering::Acquire);
            if cur > now {
                cur = self.drop_dead_work(dev, now);
            }
            let start = now.max(cur).max(tail.load(Ordering::Acquire));
            let end = start + dur_ns;
            busy.store(end, Ordering::Release);
            if let Some(slot) = self.my_slot() {
                slot.booked[dev].fetch_max(end, Ordering::AcqRel);
            }
            (start, end)
        };
        tail.fetch_max(end, Ordering::AcqRel);
        self.last_end[dev].fetch_max(end, Ordering::AcqRel);
        lock(&self.pending[dev]).push_back(end);
        if dur_ns > 0 {
            let _ = append(
                &self.dir,
                dev as u32,
                &Record {
                    start,
                    end,
                    pid: self.pid,
                    kind,
                },
            );
        }
        Ok(end)
    }

    /// What work queued on `dev` after `tail` must wait for beyond the
    /// order of the process's own queue there: a later time, or work on
    /// another device.
    pub fn gate_for(&self, dev: usize, tail: u64) -> u64 {
        match slicing::decode(tail) {
            Some((d, _)) if d == dev => 0,
            Some(_) => tail,
            None if tail > now_ns() => tail,
            None => 0,
        }
    }

    /// A point on `dev` after the process's work there and `tail` (an
    /// event recorded on a time-sliced device): its pending value.
    pub fn marker(&self, dev: usize, tail: u64) -> Result<u64, CUresult> {
        match &self.slicer {
            Some(ts) => ts
                .enqueue(dev, 0, self.gate_for(dev, tail), None, self.queue_depth)
                .map_err(|_| CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES),
            None => Ok(tail.max(now_ns())),
        }
    }

    /// Waits until the work that ends at `when` (a time or a pending
    /// value) is done, and then for the host's wake-up
    /// (`FAKECUDA_WAKEUP_US`) where it was not done already.
    pub fn wait(&self, when: u64) {
        if self.wakeup_ns != 0 && self.is_done(when) {
            return;
        }
        match &self.slicer {
            Some(ts) => ts.wait(when),
            None => sleep_until(when),
        }
        if self.wakeup_ns != 0 {
            // A late wake-up sleeps; it does not spin.
            std::thread::sleep(std::time::Duration::from_nanos(self.wakeup_ns));
        }
    }

    /// Whether the work that ends at `when` is done.
    pub fn is_done(&self, when: u64) -> bool {
        match &self.slicer {
            Some(ts) => ts.is_done(when),
            None => when <= now_ns(),
        }
    }

    /// When the work that ends at `when` ended; `None` while it runs.
    pub fn time_of(&self, when: u64) -> Option<u64> {
        match &self.slicer {
            Some(ts) => ts.time_of(when),
            None => (when <= now_ns()).then_some(when),
        }
    }

    /// Brings the busy logs up to now (time-sliced devices are played
    /// only when a process looks).
    pub fn advance(&self) {
        if let Some(ts) = &self.slicer {
            ts.advance();
        }
    }

    /// Drops the work that dead processes queued on `dev` (the real driver
    /// tears a dead process's contexts down, and its queued work never
    /// runs): each gets a [`Kind::Gone`] record at `now` in the busy log.
    /// Returns when the work of the living ends. Called under the locks.
    fn drop_dead_work(&self, dev: usize, now: u64) -> u64 {
        let mut live = now;
        for s in &self.shared.slots {
            let booked = s.booked[dev].load(Ordering::Acquire);
            if booked <= now {
                continue;
            }
            let p = s.pid.load(Ordering::Relaxed);
            if p == self.pid || (p != 0 && pid_alive(p)) {
                live = live.max(booked);
            } else {
                self.forget_work(s, p, now);
            }
        }
        live
    }

    /// Process `pid` of `slot` is dead (0: its slot was freed): the work
    /// it had queued from `now` on never runs. Called under the locks.
    fn forget_work(&self, slot: &Slot, pid: u32, now: u64) {
        for (dev, b) in slot.booked.iter().enumerate() {
            if b.swap(0, Ordering::AcqRel) > now && pid != 0 {
                let _ = append(
                    &self.dir,
                    dev as u32,
                    &Record {
                        start: now,
                        end: now,
                        pid,
                        kind: Kind::Gone as u32,
                    },
                );
            }
        }
    }

    fn my_slot(&self) -> Option<&Slot> {
        let slots = &self.shared.slots;
        if let Some(s) = slots
            .iter()
            .find(|s| s.pid.load(Ordering::Relaxed) == self.pid)
        {
            return Some(s);
        }
        let free = slots.iter().find(|s| {
            let p = s.pid.load(Ordering::Relaxed);
            p == 0 || !pid_alive(p)
        })?;
        self.forget_work(free, free.pid.load(Ordering::Relaxed), now_ns());
        for m in &free.mem {
            m.store(0, Ordering::Relaxed);
        }
        free.tag.store(self.tag, Ordering::Relaxed);
        free.pid.store(self.pid, Ordering::Relaxed);
        Some(free)
    }
}

impl std::fmt::Debug for Sim {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Sim")
            .field("dir", &self.dir)
            .field("pid", &self.pid)
            .finish_non_exhaustive()
    }
}

struct PerProcess {
    pid: u32,
    sim: &'static Sim,
}

static SIM: Mutex<Option<PerProcess>> = Mutex::new(None);
static INIT_ERROR: OnceLock<String> = OnceLock::new();

/// The simulator of this process, opened on first use and again in a
/// forked child (which must not share the parent's lock or queues).
pub fn sim() -> Result<&'static Sim, CUresult> {
    let mut g = lock(&SIM);
    let pid = std::process::id();
    if let Some(p) = g.as_ref()
        && p.pid == pid
    {
        return Ok(p.sim);
    }
    match Sim::open() {
        Ok(s) => {
            let s: &'static Sim = Box::leak(Box::new(s));
            *g = Some(PerProcess { pid, sim: s });
            Ok(s)
        }
        Err(e) => {
            let _ = INIT_ERROR.set(e.clone());
            eprintln!("fakecuda: cannot open the simulator state: {e}");
            Err(CUDA_ERROR_NOT_INITIALIZED)
        }
    }
}

/// The UUID of physical device `dev`, as `cuDeviceGetUuid` gives it: the
/// same for every process, whatever its ordinals.
pub fn uuid(dev: usize) -> [u8; 16] {
    let mut u = [
        0xfa, 0xce, 0xc0, 0xda, 0, 0, 0x40, 0, 0x80, 0, 0, 0, 0, 0, 0, 0,
    ];
    u[15] = dev as u8;
    u
}

/// The UUID of the MIG instance of physical device `dev` (in MIG mode).
pub fn mig_uuid(dev: usize) -> [u8; 16] {
    let mut u = uuid(dev);
    u[14] = 0x4d;
    u
}

/// The UUID of physical device `dev` as NVML writes it
/// (`GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx`, lower-case hex).
pub fn uuid_text(dev: usize) -> String {
    text_of("GPU", &uuid(dev))
}

/// The UUID of the MIG instance of physical device `dev` as NVML and
/// `CUDA_VISIBLE_DEVICES` write it (`MIG-…`).
pub fn mig_uuid_text(dev: usize) -> String {
    text_of("MIG", &mig_uuid(dev))
}

fn text_of(prefix: &str, u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{prefix}-{}-{}-{}-{}-{}",
        &h[0..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..32]
    )
}
