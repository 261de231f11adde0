//! The driver's own memory limits per cgroup (R615 drivers, CUDA 13.4:
//! `nvmlDeviceSetMemoryLimits_v1` / `nvmlDeviceGetMemoryLimits_v1`).
//!
//! Where the driver has them, every group bound to cgroups (`Cgroups=`,
//! and so every Slurm job `gem-slurm` sets up) with a `MemoryLimit` gets
//! that limit set by the driver on each of its cgroups, on every GPU the
//! group may use: hard and soft limit both `MemoryLimit` (gemini's cap is
//! hard; the driver's soft limit, which allows more while memory is free,
//! would only let the group past it). The driver then refuses a process
//! of the cgroup past the limit even if it escaped `LD_PRELOAD` (a static
//! binary, an unset variable, a container started without the hook). The
//! hook's cap stays for every group: it is what the scheduler accounts.
//!
//! The driver limits each cgroup on its own: a group of several cgroups
//! gets `MemoryLimit` per cgroup from the driver, and its `MemoryLimit`
//! over all of them from the hook.
//!
//! What is set is written to `driver-limits.json` in the IPC directory,
//! so that a scheduler started again removes the limits of groups that
//! went while it was down, and sets the others again.

use super::*;
use gemini_config::ResourceConfig;
use gemini_protocol::{DeviceId, DriverMemory, StatusReport};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::ffi::{CString, c_char, c_void};

/// `nvmlReturn_t` values the scheduler tells apart.
const NVML_ERROR_NOT_SUPPORTED: u32 = 3;
const NVML_ERROR_FUNCTION_NOT_FOUND: u32 = 13;

/// How often what the driver counts for each limited cgroup is read.
const POLL: Duration = Duration::from_secs(1);

/// `nvmlMemoryLimits_v1_t`.
#[repr(C)]
struct Limits {
    name_space: *const c_char,
    soft: u64,
    hard: u64,
}

/// `nvmlMemoryLimitsInfo_v1_t`.
#[repr(C)]
struct LimitsInfo {
    name_space: *const c_char,
    soft: u64,
    hard: u64,
    current_used: u64,
}

type SetFn = unsafe extern "C" fn(*mut c_void, *const Limits) -> u32;
type GetFn = unsafe extern "C" fn(*mut c_void, *mut LimitsInfo) -> u32;

/// NVML's limit calls, and a handle per GPU by NVML index.
struct Nvml {
    _lib: libloading::Library,
    /// Device handles (`nvmlDevice_t`), by NVML index.
    handles: Vec<usize>,
    set: SetFn,
    get: GetFn,
}

impl Nvml {
    /// Loads `libnvidia-ml.so.1` and its limit calls; `Err`: why the
    /// driver's limits cannot be used.
    fn load() -> Result<Nvml, String> {
        type Init = unsafe extern "C" fn() -> u32;
        type Count = unsafe extern "C" fn(*mut u32) -> u32;
        type Handle = unsafe extern "C" fn(u32, *mut *mut c_void) -> u32;
        // SAFETY: loading NVML runs its initialisers, as any NVML user
        // does.
        let lib = unsafe { libloading::Library::new("libnvidia-ml.so.1") }
            .map_err(|e| format!("no NVML ({e})"))?;
        // SAFETY: each symbol is looked up with its C signature from
        // nvml.h (the limit calls with the layout R615 documents).
        let (init, count, handle, set, get) = unsafe {
            let init = *lib
                .get::<Init>(b"nvmlInit_v2\0")
                .map_err(|e| format!("NVML: {e}"))?;
            let count = *lib
                .get::<Count>(b"nvmlDeviceGetCount_v2\0")
                .map_err(|e| format!("NVML: {e}"))?;
            let handle = *lib
                .get::<Handle>(b"nvmlDeviceGetHandleByIndex_v2\0")
                .map_err(|e| format!("NVML: {e}"))?;
            let set = lib.get::<SetFn>(b"nvmlDeviceSetMemoryLimits_v1\0").ok();
            let get = lib.get::<GetFn>(b"nvmlDeviceGetMemoryLimits_v1\0").ok();
            (init, count, handle, set.map(|f| *f), get.map(|f| *f))
        };
        let (Some(set), Some(get)) = (set, get) else {
            return Err(
                "the driver's NVML has no nvmlDeviceSetMemoryLimits_v1 (drivers before R615)"
                    .into(),
            );
        };
        // SAFETY: no arguments; NVML counts its initialisations.
        let r = unsafe { init() };
        if r != 0 {
            return Err(format!("nvmlInit_v2 failed ({r})"));
        }
        let mut n = 0u32;
        // SAFETY: an out-pointer to a local.
        if unsafe { count(&mut n) } != 0 {
            return Err("nvmlDeviceGetCount_v2 failed".into());
        }
        let mut handles = Vec::new();
        for i in 0..n {
            let mut h: *mut c_void = std::ptr::null_mut();
            // SAFETY: an out-pointer to a local.
            let r = unsafe { handle(i, &mut h) };
            // A GPU this process may not open keeps a null handle: its
            // limits cannot be set.
            handles.push(if r == 0 { h as usize } else { 0 });
        }
        let nvml = Nvml {
            _lib: lib,
            handles,
            set,
            get,
        };
        // The symbols may be there and answer that the driver has no such
        // thing.
        if let Some(dev) = nvml.handles.iter().position(|&h| h != 0)
            && let Err(NVML_ERROR_FUNCTION_NOT_FOUND | NVML_ERROR_NOT_SUPPORTED) =
                nvml.read(dev as DeviceId, "/")
        {
            return Err("the driver has no per-cgroup memory limits (drivers before R615)".into());
        }
        Ok(nvml)
    }

    fn handle(&self, dev: DeviceId) -> Result<*mut c_void, u32> {
        match self.handles.get(dev as usize) {
            Some(&h) if h != 0 => Ok(h as *mut c_void),
            // NVML_ERROR_INVALID_ARGUMENT.
            _ => Err(2),
        }
    }

    /// Sets the limit of `cgroup` on GPU `dev` (0: removes it).
    fn write(&self, dev: DeviceId, cgroup: &str, bytes: u64) -> Result<(), u32> {
        let h = self.handle(dev)?;
        let name = CString::new(cgroup).map_err(|_| 2u32)?;
        let l = Limits {
            name_space: name.as_ptr(),
            soft: bytes,
            hard: bytes,
        };
        // SAFETY: a handle NVML gave, and a struct whose name lives across
        // the call.
        match unsafe { (self.set)(h, &l) } {
            0 => Ok(()),
            r => Err(r),
        }
    }

    /// (hard limit, what the cgroup's processes hold) of `cgroup` on `dev`.
    fn read(&self, dev: DeviceId, cgroup: &str) -> Result<(u64, u64), u32> {
        let h = self.handle(dev)?;
        let name = CString::new(cgroup).map_err(|_| 2u32)?;
        let mut info = LimitsInfo {
            name_space: name.as_ptr(),
            soft: 0,
            hard: 0,
            current_used: 0,
        };
        // SAFETY: a handle NVML gave, and a writable struct whose name
        // lives across the call.
        match unsafe { (self.get)(h, &mut info) } {
            0 => Ok((info.hard, info.current_used)),
            r => Err(r),
        }
    }
}

/// One limit set, as saved.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
struct Set {
    device: DeviceId,
    cgroup: String,
    group: String,
    bytes: u64,
}

/// The driver's limits as the scheduler keeps them.
pub(super) struct DriverLimits {
    /// `None`: the driver has none (or no NVML); the hook alone caps.
    nvml: Option<Nvml>,
    /// (GPU, cgroup) → (group, bytes) now set.
    applied: BTreeMap<(DeviceId, String), (String, u64)>,
    /// What the driver counted for each, at the last poll.
    used: BTreeMap<(DeviceId, String), u64>,
    last_poll: Instant,
    /// `driver-limits.json` in the IPC directory.
    path: PathBuf,
}

impl DriverLimits {
    /// Finds out whether the driver has per-cgroup limits, says once
    /// which part enforces `MemoryLimit`, and takes over what a previous
    /// scheduler set in `ipc_dir`.
    pub(super) fn start(ipc_dir: &Path) -> DriverLimits {
        let nvml = match Nvml::load() {
            Ok(n) => {
                info!(
                    "MemoryLimit: the driver enforces it too for groups bound to cgroups (nvmlDeviceSetMemoryLimits_v1 on their cgroups), the hook for every group"
                );
                Some(n)
            }
            Err(why) => {
                info!("MemoryLimit: the hook enforces it ({why})");
                None
            }
        };
        let path = ipc_dir.join("driver-limits.json");
        let saved: Vec<Set> = std::fs::read(&path)
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or_default();
        DriverLimits {
            nvml,
            applied: saved
                .into_iter()
                .map(|s| ((s.device, s.cgroup), (s.group, s.bytes)))
                .collect(),
            used: BTreeMap::new(),
            last_poll: Instant::now() - POLL,
            path,
        }
    }

    /// Sets, changes and removes the driver's limits to match `config`.
    pub(super) fn apply(&mut self, config: &ResourceConfig) {
        let Some(nvml) = &self.nvml else {
            return;
        };
        let mut want: BTreeMap<(DeviceId, String), (String, u64)> = BTreeMap::new();
        for g in config.groups.values() {
            let Some(cgroups) = &g.cgroups else { continue };
            if g.memory_limit == u64::MAX {
                continue;
            }
            for dev in (0..nvml.handles.len() as DeviceId).filter(|&d| g.uses(d)) {
                for cg in cgroups {
                    want.entry((dev, cg.clone()))
                        .or_insert_with(|| (g.name.clone(), g.memory_limit));
                }
            }
        }
        let gone: Vec<(DeviceId, String)> = self
            .applied
            .keys()
            .filter(|k| !want.contains_key(*k))
            .cloned()
            .collect();
        for (dev, cg) in gone {
            let (group, _) = self.applied[&(dev, cg.clone())].clone();
            match nvml.write(dev, &cg, 0) {
                Ok(()) => {
                    info!(
                        "[{group}] the driver's memory limit of cgroup {cg} on GPU {dev} removed"
                    );
                    self.applied.remove(&(dev, cg.clone()));
                    self.used.remove(&(dev, cg));
                }
                Err(r) => {
                    warn!(
                        "[{group}] cannot remove the driver's memory limit of cgroup {cg} on GPU {dev}: NVML error {r}"
                    );
                }
            }
        }
        for ((dev, cg), (group, bytes)) in want {
            // Set unless the driver has it already: what a scheduler
            // before this one set may have gone since (a GPU reset).
            if self.applied.get(&(dev, cg.clone())) == Some(&(group.clone(), bytes))
                && nvml.read(dev, &cg).is_ok_and(|(hard, _)| hard == bytes)
            {
                continue;
            }
            match nvml.write(dev, &cg, bytes) {
                Ok(()) => {
                    info!(
                        "[{group}] the driver limits cgroup {cg} to {} on GPU {dev}",
                        gemini_protocol::units::format_size(bytes)
                    );
                    self.applied.insert((dev, cg), (group, bytes));
                }
                Err(r) => warn!(
                    "[{group}] cannot have the driver limit cgroup {cg} on GPU {dev}: NVML error {r}; the hook's cap still holds"
                ),
            }
        }
        self.save();
    }

    fn save(&self) {
        let sets: Vec<Set> = self
            .applied
            .iter()
            .map(|((device, cgroup), (group, bytes))| Set {
                device: *device,
                cgroup: cgroup.clone(),
                group: group.clone(),
                bytes: *bytes,
            })
            .collect();
        let tmp = self.path.with_extension("json.tmp");
        let written = serde_json::to_vec_pretty(&sets)
            .map_err(std::io::Error::other)
            .and_then(|b| std::fs::write(&tmp, b))
            .and_then(|()| std::fs::rename(&tmp, &self.path));
        if let Err(e) = written {
            warn!("cannot write {}: {e}", self.path.display());
        }
    }

    /// Reads what the driver counts for each limited cgroup, about once a
    /// second.
    pub(super) fn poll(&mut self) {
        let Some(nvml) = &self.nvml else { return };
        if self.last_poll.elapsed() < POLL {
            return;
        }
        self.last_poll = Instant::now();
        for (dev, cg) in self.applied.keys() {
            match nvml.read(*dev, cg) {
                Ok((_, used)) => {
                    self.used.insert((*dev, cg.clone()), used);
                }
                Err(r) => debug!("nvmlDeviceGetMemoryLimits_v1({cg}, GPU {dev}): {r}"),
            }
        }
    }

    /// Fills in the driver's side of a status report.
    pub(super) fn report(&self, report: &mut StatusReport) {
        report.driver_limits = self.nvml.is_some();
        for g in &mut report.groups {
            g.driver_memory = self
                .applied
                .iter()
                .filter(|(_, (group, _))| *group == g.name)
                .map(|((device, cgroup), (_, limit))| DriverMemory {
                    device: *device,
                    cgroup: cgroup.clone(),
                    limit: *limit,
                    used: self
                        .used
                        .get(&(*device, cgroup.clone()))
                        .copied()
                        .unwrap_or(0),
                })
                .collect();
        }
    }
}
