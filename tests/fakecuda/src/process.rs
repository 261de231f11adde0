//! Per-process driver state (reset in a forked child): handles and the
//! objects they name, allocations, pools, captures; each thread's context
//! stack; the initialised check and the current device.

use crate::*;

/// Per-process driver state, reset in a forked child.
#[derive(Debug, Default)]
pub(crate) struct Proc {
    pub(crate) pid: u32,
    pub(crate) objects: HashMap<usize, Obj>,
    /// Primary context per device: (handle, retain count).
    pub(crate) primary: HashMap<usize, (usize, u32)>,
    /// Device pointer → (device, bytes).
    pub(crate) allocs: HashMap<u64, (usize, u64)>,
    /// `cuMemCreate` handle → (device, bytes); device `None` for memory
    /// of a host location (`CU_MEM_LOCATION_TYPE_HOST*`).
    pub(crate) physical: HashMap<u64, (Option<usize>, u64)>,
    /// Handles released while still mapped: their memory stays until the
    /// last mapping is unmapped (`cuMemRelease`).
    pub(crate) released: HashMap<u64, (Option<usize>, u64)>,
    /// Mappings by virtual address: (size, handle).
    pub(crate) maps: std::collections::BTreeMap<u64, (u64, u64)>,
    /// Device memory each context holds for itself (see `context`).
    pub(crate) ctx_mem: HashMap<usize, CtxMem>,
    /// Loaded modules → (device, bytes of their image).
    pub(crate) modules: HashMap<usize, (usize, u64)>,
    /// Contexts that are gone: destroyed, or primary ones released for
    /// the last time or reset (until retained again).
    pub(crate) dead: std::collections::HashSet<usize>,
    /// The context each event was made in.
    pub(crate) event_ctx: HashMap<usize, usize>,
    /// Freed device addresses by (device, size rounded to 512), reused
    /// first, as the driver reuses addresses.
    pub(crate) free_addrs: HashMap<(usize, u64), Vec<u64>>,
    pub(crate) next_handle: usize,
    pub(crate) next_ptr: [u64; MAX_DEVICES],
    pub(crate) captures: capture::Captures,
    /// Memory pools by handle; each device's default and current pool.
    pub(crate) pools: HashMap<usize, pool::Pool>,
    pub(crate) default_pool: HashMap<usize, usize>,
    pub(crate) current_pool: HashMap<usize, usize>,
    /// Device pointer handed out by a pool → that pool.
    pub(crate) pool_allocs: HashMap<u64, usize>,
    /// CUDA arrays (plain and mipmapped) → (device, bytes).
    pub(crate) arrays: HashMap<usize, (usize, u64)>,
    /// Next free virtual address offset for `cuMemAddressReserve`.
    pub(crate) next_va: u64,
    /// Where each context's work ends, once a process has more than one
    /// context (`MANY_CONTEXTS`): `cuCtxSynchronize` waits for its own.
    pub(crate) ctx_end: HashMap<usize, Arc<AtomicU64>>,
    /// Allocations of other processes opened through IPC handles.
    pub(crate) ipc_opened: std::collections::HashSet<u64>,
    /// Each device's graph allocator (see `graphmem`): a pool trimmed
    /// only by `cuDeviceGraphMemTrim`.
    pub(crate) graph_mem: HashMap<usize, pool::Pool>,
    /// Allocations a launched graph did not free → (device, bytes).
    pub(crate) graph_live: HashMap<u64, (usize, u64)>,
}

pub(crate) static PROC: Mutex<Option<Proc>> = Mutex::new(None);
/// Set once a process creates a context besides the primary ones: from
/// then on work is tracked per context, not only per device.
pub(crate) static MANY_CONTEXTS: std::sync::atomic::AtomicBool =
    std::sync::atomic::AtomicBool::new(false);
pub(crate) static INIT_PID: AtomicU32 = AtomicU32::new(0);

pub(crate) fn proc_lock() -> MutexGuard<'static, Option<Proc>> {
    PROC.lock().unwrap_or_else(|p| p.into_inner())
}

pub(crate) fn with_proc<T>(f: impl FnOnce(&mut Proc) -> T) -> T {
    let mut g = proc_lock();
    let pid = std::process::id();
    if g.as_ref().is_none_or(|p| p.pid != pid) {
        *g = Some(Proc {
            pid,
            next_handle: 0x1000,
            ..Proc::default()
        });
    }
    match g.as_mut() {
        Some(p) => f(p),
        None => unreachable!("set above"),
    }
}

impl Proc {
    pub(crate) fn add(&mut self, obj: Obj) -> usize {
        self.next_handle += 16;
        self.objects.insert(self.next_handle, obj);
        self.next_handle
    }

    /// A device address for `bytes` on `dev`, recorded as an allocation:
    /// the last freed one of that size, as the driver hands an address
    /// freed by one thread to the next allocation of another.
    pub(crate) fn new_ptr(&mut self, dev: usize, bytes: u64) -> u64 {
        let reused = self
            .free_addrs
            .get_mut(&(dev, bytes.div_ceil(512) * 512))
            .and_then(Vec::pop);
        let ptr = reused.unwrap_or_else(|| self.address(dev, bytes));
        self.allocs.insert(ptr, (dev, bytes));
        ptr
    }

    /// The allocation at `ptr` was freed: its address may be handed out
    /// again.
    pub(crate) fn forget_ptr(&mut self, ptr: u64) -> Option<(usize, u64)> {
        let (dev, bytes) = self.allocs.remove(&ptr)?;
        self.free_addrs
            .entry((dev, bytes.div_ceil(512) * 512))
            .or_default()
            .push(ptr);
        Some((dev, bytes))
    }

    /// A fresh device address for `bytes` on `dev`.
    pub(crate) fn address(&mut self, dev: usize, bytes: u64) -> u64 {
        let base = 0x7000_0000_0000u64 + ((dev as u64) << 40);
        let ptr = base + self.next_ptr[dev];
        self.next_ptr[dev] += bytes.div_ceil(512) * 512;
        ptr
    }

    /// The graph allocator of device `dev`.
    pub(crate) fn graph_allocator(&mut self, dev: usize) -> &mut pool::Pool {
        self.graph_mem
            .entry(dev)
            .or_insert_with(|| pool::Pool::new(dev))
    }

    /// An allocation node's address, for a graph: no memory yet.
    pub(crate) fn graph_alloc(&mut self, dev: usize, bytes: u64) -> graphmem::AllocNode {
        graphmem::AllocNode {
            dptr: self.address(dev, bytes),
            device: dev,
            bytes,
            freed_in_graph: false,
        }
    }

    pub(crate) fn default_pool(&mut self, dev: usize) -> usize {
        if let Some(h) = self.default_pool.get(&dev) {
            return *h;
        }
        let h = self.add(Obj::MemPool);
        self.pools.insert(h, pool::Pool::new(dev));
        self.default_pool.insert(dev, h);
        h
    }

    pub(crate) fn current_pool(&mut self, dev: usize) -> usize {
        match self.current_pool.get(&dev) {
            Some(h) => *h,
            None => self.default_pool(dev),
        }
    }
}

thread_local! {
    /// (pid, context stack) of this thread.
    pub(crate) static CTX: RefCell<(u32, Vec<usize>)> = const { RefCell::new((0, Vec::new())) };
    /// Per-thread default stream tails.
    pub(crate) static PT_TAIL: Vec<Arc<AtomicU64>> = (0..MAX_DEVICES).map(|_| Arc::new(AtomicU64::new(0))).collect();
}

pub(crate) fn ctx_stack<T>(f: impl FnOnce(&mut Vec<usize>) -> T) -> T {
    CTX.with(|c| {
        let mut c = c.borrow_mut();
        let pid = std::process::id();
        if c.0 != pid {
            *c = (pid, Vec::new());
        }
        f(&mut c.1)
    })
}

pub(crate) fn initialised() -> Result<&'static Sim, CUresult> {
    if INIT_PID.load(Ordering::Acquire) != std::process::id() {
        return Err(CUDA_ERROR_NOT_INITIALIZED);
    }
    sim()
}

/// The physical device behind the program's device handle (its ordinal).
pub(crate) fn check_device(s: &Sim, dev: CUdevice) -> Result<usize, CUresult> {
    if dev < 0 {
        return Err(CUDA_ERROR_INVALID_DEVICE);
    }
    s.physical(dev as usize).ok_or(CUDA_ERROR_INVALID_DEVICE)
}

pub(crate) fn ctx_device(ctx: usize) -> Result<usize, CUresult> {
    with_proc(|p| {
        if p.dead.contains(&ctx) {
            return Err(dead_context(ctx));
        }
        match p.objects.get(&ctx) {
            Some(Obj::Ctx { device }) => Ok(*device),
            _ => Err(CUDA_ERROR_INVALID_CONTEXT),
        }
    })
}

/// A call used context `ctx`, which is gone: logged (see the crate's
/// doc), and `CUDA_ERROR_INVALID_CONTEXT`.
pub(crate) fn dead_context(ctx: usize) -> CUresult {
    use std::io::Write as _;
    if let Ok(s) = sim()
        && let Ok(mut f) = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(s.dir.join("dead-context.log"))
    {
        let call = CALL.with(std::cell::Cell::get);
        let _ = writeln!(f, "{} {call} {ctx:#x}", std::process::id());
    }
    CUDA_ERROR_INVALID_CONTEXT
}

/// Fails with [`dead_context`] where event `e` was made in a context that
/// is gone.
pub(crate) fn event_alive(e: usize) -> R {
    with_proc(|p| match p.event_ctx.get(&e) {
        Some(ctx) if p.dead.contains(ctx) => Err(dead_context(*ctx)),
        _ => Ok(()),
    })
}

pub(crate) fn current_device() -> Result<usize, CUresult> {
    let top = ctx_stack(|s| s.last().copied()).ok_or(CUDA_ERROR_INVALID_CONTEXT)?;
    ctx_device(top)
}
