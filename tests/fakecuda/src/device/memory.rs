//! Device memory shared by the simulator's processes: allocations, what
//! each process and cgroup holds, and the per-cgroup limits of R615
//! drivers (`nvmlDeviceSetMemoryLimits_v1`).

use super::*;

/// A device memory limit of a cgroup (`nvmlDeviceSetMemoryLimits_v1`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemoryLimit {
    /// Physical device.
    pub device: usize,
    /// cgroup v2 path (`nameSpace`).
    pub cgroup: String,
    /// Soft limit, bytes (kept, not enforced).
    pub soft: u64,
    /// Hard limit, bytes.
    pub hard: u64,
}

/// The cgroup paths of process `pid`, every hierarchy
/// (`/proc/PID/cgroup`); none if it is gone.
fn cgroups_of(pid: u32) -> Vec<String> {
    std::fs::read_to_string(format!("/proc/{pid}/cgroup"))
        .map(|t| {
            t.lines()
                .filter_map(|l| l.splitn(3, ':').nth(2).map(str::to_string))
                .collect()
        })
        .unwrap_or_default()
}

/// Whether cgroup path `path` is `cgroup` or below it.
pub fn within(path: &str, cgroup: &str) -> bool {
    let cgroup = cgroup.trim_end_matches('/');
    path == cgroup
        || cgroup.is_empty()
        || path
            .strip_prefix(cgroup)
            .is_some_and(|rest| rest.starts_with('/'))
}

impl Sim {
    /// Memory in use on `dev` by living processes (dead ones are freed, as
    /// the real driver frees a process's memory when it exits).
    fn used_locked(&self, dev: usize) -> u64 {
        let mut used = 0u64;
        for s in &self.shared.slots {
            let p = s.pid.load(Ordering::Relaxed);
            if p == 0 {
                continue;
            }
            if p != self.pid && !pid_alive(p) {
                self.forget_work(s, p, now_ns());
                s.pid.store(0, Ordering::Relaxed);
                continue;
            }
            used = used.saturating_add(s.mem[dev].load(Ordering::Relaxed));
        }
        used
    }

    /// Takes `bytes` of `dev`'s memory, or fails with out-of-memory (past
    /// the device's memory, or past the hard limit of a cgroup this
    /// process is in).
    pub fn alloc(&self, dev: usize, bytes: u64) -> Result<(), CUresult> {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        let used = self.used_locked(dev);
        if used
            .checked_add(bytes)
            .is_none_or(|t| t > self.mem_total(dev))
        {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        if let Some((limit, in_cgroup)) = self.own_limit_locked(dev)
            && in_cgroup.checked_add(bytes).is_none_or(|t| t > limit.hard)
        {
            return Err(CUDA_ERROR_OUT_OF_MEMORY);
        }
        let slot = self.my_slot().ok_or(CUDA_ERROR_OUT_OF_MEMORY)?;
        slot.mem[dev].fetch_add(bytes, Ordering::Relaxed);
        self.tag_changed(dev);
        Ok(())
    }

    /// Writes what the living processes of this process's tag hold on
    /// `dev` to the groups file (called with the state locked).
    fn tag_changed(&self, dev: usize) {
        let Some(groups) = self.groups.as_ref().filter(|_| self.tag != 0) else {
            return;
        };
        let sum = self
            .shared
            .slots
            .iter()
            .filter(|s| {
                let p = s.pid.load(Ordering::Relaxed);
                p != 0
                    && s.tag.load(Ordering::Relaxed) == self.tag
                    && (p == self.pid || pid_alive(p))
            })
            .map(|s| s.mem[dev].load(Ordering::Relaxed))
            .fold(0u64, u64::saturating_add);
        groups.set(self.tag, dev, sum);
    }

    /// Every living process's device memory on `dev`: (pid, bytes), for
    /// NVML's per-process queries (only processes holding some).
    pub fn processes(&self, dev: usize) -> Vec<(u32, u64)> {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        self.used_locked(dev);
        self.holding_locked(dev).collect()
    }

    /// (pid, bytes) of each process slot holding memory on `dev` (with the
    /// state locked and `used_locked` just called).
    fn holding_locked(&self, dev: usize) -> impl Iterator<Item = (u32, u64)> + '_ {
        self.shared.slots.iter().filter_map(move |s| {
            let p = s.pid.load(Ordering::Relaxed);
            let m = s.mem[dev].load(Ordering::Relaxed);
            (p != 0 && m > 0).then_some((p, m))
        })
    }

    /// Gives `bytes` of `dev`'s memory back.
    pub fn free(&self, dev: usize, bytes: u64) {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        if let Some(slot) = self.my_slot() {
            let m = &slot.mem[dev];
            let cur = m.load(Ordering::Relaxed);
            m.store(cur.saturating_sub(bytes), Ordering::Relaxed);
        }
        self.tag_changed(dev);
    }

    /// (free, total) of `dev`, as this process sees it: within the hard
    /// limit of its cgroup, if one is set.
    pub fn mem_info(&self, dev: usize) -> (u64, u64) {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        let total = self.mem_total(dev);
        let free = total.saturating_sub(self.used_locked(dev));
        match self.own_limit_locked(dev) {
            Some((limit, in_cgroup)) => (
                free.min(limit.hard.saturating_sub(in_cgroup)),
                total.min(limit.hard),
            ),
            None => (free, total),
        }
    }

    /// Whether this driver has per-cgroup memory limits (R615, CUDA 13.4).
    pub fn has_memory_limits(&self) -> bool {
        crate::procaddr::driver_version() >= 13040
    }

    /// The memory limits set on `dev`.
    pub fn memory_limits(&self, dev: usize) -> Vec<MemoryLimit> {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        self.limits_locked()
            .into_iter()
            .filter(|l| l.device == dev)
            .collect()
    }

    /// Sets (or with both 0, removes) the limit of `cgroup` on `dev`.
    pub fn set_memory_limit(&self, dev: usize, cgroup: &str, soft: u64, hard: u64) {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        let mut all = self.limits_locked();
        all.retain(|l| !(l.device == dev && l.cgroup == cgroup));
        if soft != 0 || hard != 0 {
            all.push(MemoryLimit {
                device: dev,
                cgroup: cgroup.to_string(),
                soft,
                hard,
            });
        }
        let text: String = all
            .iter()
            .map(|l| format!("{}\t{}\t{}\t{}\n", l.device, l.soft, l.hard, l.cgroup))
            .collect();
        let path = self.dir.join("mem-limits");
        let tmp = self.dir.join(format!("mem-limits.{}", self.pid));
        if std::fs::write(&tmp, text).is_ok() {
            let _ = std::fs::rename(&tmp, &path);
        }
    }

    /// What the living processes in `cgroup` (or below it) hold on `dev`.
    pub fn cgroup_used(&self, dev: usize, cgroup: &str) -> u64 {
        let _g = lock(&self.mem_lock);
        let _f = FileLock::new(&self.file);
        self.used_locked(dev);
        self.cgroup_used_locked(dev, cgroup)
    }

    /// Every limit (called with the state locked); none on a driver that
    /// lacks them.
    fn limits_locked(&self) -> Vec<MemoryLimit> {
        if !self.has_memory_limits() {
            return Vec::new();
        }
        let text = std::fs::read_to_string(self.dir.join("mem-limits")).unwrap_or_default();
        text.lines()
            .filter_map(|l| {
                let mut f = l.splitn(4, '\t');
                Some(MemoryLimit {
                    device: f.next()?.parse().ok()?,
                    soft: f.next()?.parse().ok()?,
                    hard: f.next()?.parse().ok()?,
                    cgroup: f.next()?.to_string(),
                })
            })
            .collect()
    }

    /// The tightest hard limit of a cgroup this process is in, on `dev`,
    /// and what that cgroup's processes hold there (with the state
    /// locked and `used_locked` just called).
    fn own_limit_locked(&self, dev: usize) -> Option<(MemoryLimit, u64)> {
        let limits: Vec<MemoryLimit> = self
            .limits_locked()
            .into_iter()
            .filter(|l| l.device == dev)
            .collect();
        if limits.is_empty() {
            return None;
        }
        let mine = cgroups_of(self.pid);
        limits
            .into_iter()
            .filter(|l| mine.iter().any(|c| within(c, &l.cgroup)))
            .map(|l| {
                let used = self.cgroup_used_locked(dev, &l.cgroup);
                (l, used)
            })
            .min_by_key(|(l, used)| l.hard.saturating_sub(*used))
    }

    /// What the living processes in `cgroup` or below hold on `dev`.
    fn cgroup_used_locked(&self, dev: usize, cgroup: &str) -> u64 {
        self.holding_locked(dev)
            .filter(|&(p, _)| cgroups_of(p).iter().any(|c| within(c, cgroup)))
            .map(|(_, m)| m)
            .fold(0u64, u64::saturating_add)
    }
}
