//! Collective kernels, as NCCL's: `fake_allreduce` completes only once
//! every rank of its communicator has launched its matching one (the
//! same communicator, the same count of collectives before it), in
//! whichever process and on whichever device; then it runs its own
//! duration. Until then it waits without holding the device (a real NCCL
//! kernel spins on a few SMs while other contexts' kernels time-slice
//! beside it), and its stream's later work waits behind it.
//!
//! Parameters (`kernelParams`): `u64` communicator id, `u32` ranks, `u32`
//! this rank, `u64` duration in microseconds once all have arrived.
//!
//! Each rank's arrival is a file `coll/<comm>.<seq>.<rank>` under
//! `FAKECUDA_DIR` holding the time (CLOCK_MONOTONIC ns) its kernel could
//! start (its stream's earlier work done); a rank's collective ends at
//! the latest start of all ranks plus its duration.
//!
//! On time-sliced devices (`FAKECUDA_TIMESLICE_US`) the kernel instead
//! spins on its device, taking its slices, from when it is first
//! scheduled until every rank's has been; then it runs its duration (see
//! `device::slicing`).
//!
//! Simplifications: the driver returns from a launch (or an event record)
//! onto a stream whose collective is still waiting only once it has
//! completed (the real one queues it); a wait for the stream, its context
//! or an event after it waits for the peers.

use crate::device::sleep_until;
use crate::*;
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;

/// A collective of this process waiting for its peers.
struct Waiting {
    /// Its stream's tail.
    tail: Arc<AtomicU64>,
    dev: usize,
    /// Arrival files of every rank (this one's included).
    peers: Vec<PathBuf>,
    dur_ns: u64,
}

static ANY: AtomicBool = AtomicBool::new(false);
static WAITING: Mutex<Vec<Waiting>> = Mutex::new(Vec::new());
/// Collectives launched so far per communicator and rank.
static SEQ: Mutex<Option<HashMap<(u64, u32), u64>>> = Mutex::new(None);

fn lock<T>(m: &'static Mutex<T>) -> MutexGuard<'static, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

fn arrival(s: &Sim, comm: u64, seq: u64, rank: u32) -> PathBuf {
    s.dir.join("coll").join(format!("{comm:016x}.{seq}.{rank}"))
}

/// Launches `fake_allreduce` with `params` onto stream `h`.
pub(crate) fn launch(s: &Sim, h: CUstream, ptsz: bool, params: *mut *mut c_void) -> R {
    if params.is_null() {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    // SAFETY: `params` is the program's array of kernel parameters, which
    // for this kernel has four entries (see the module doc).
    let arg = |i: usize| get(unsafe { params.add(i) } as *const *mut c_void);
    let comm = get(arg(0)? as *const u64)?;
    let ranks = get(arg(1)? as *const u32)?;
    let rank = get(arg(2)? as *const u32)?;
    let dur_ns = get(arg(3)? as *const u64)?.saturating_mul(1000);
    if ranks == 0 || rank >= ranks {
        return Err(CUDA_ERROR_INVALID_VALUE);
    }
    let (dev, tail) = work::stream(s, h, ptsz)?;
    // Behind an earlier collective of the same stream.
    wait_for(|w| Arc::ptr_eq(&w.tail, &tail));
    let seq = {
        let mut seqs = lock(&SEQ);
        let n = seqs
            .get_or_insert_with(HashMap::new)
            .entry((comm, rank))
            .or_insert(0);
        *n += 1;
        *n
    };
    if let Some(ts) = &s.slicer {
        // On a time-sliced device, the kernel spins there until its peers
        // have started (see `device::slicing`).
        let gate = s.gate_for(dev, tail.load(Ordering::Acquire));
        let end = ts
            .enqueue_collective(dev, dur_ns, gate, s.queue_depth, comm, seq, ranks, rank)
            .map_err(|_| CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES)?;
        tail.fetch_max(end, Ordering::AcqRel);
        s.last_end[dev].fetch_max(end, Ordering::AcqRel);
        work::note_ctx_end(h, end);
        return Ok(());
    }
    let start = now_ns().max(tail.load(Ordering::Acquire));
    let own = arrival(s, comm, seq, rank);
    let dir = own.parent().map(PathBuf::from).unwrap_or_default();
    let _ = std::fs::create_dir_all(&dir);
    let tmp = dir.join(format!(".{}.{}", s.pid, seq));
    std::fs::write(&tmp, start.to_string())
        .and_then(|()| std::fs::rename(&tmp, &own))
        .map_err(|_| CUDA_ERROR_UNKNOWN)?;
    // Every rank has read this rank's arrival two collectives back: it
    // arrived at the one in between (which waited for this rank's).
    if seq > 2 {
        let _ = std::fs::remove_file(arrival(s, comm, seq - 2, rank));
    }
    let peers = (0..ranks).map(|r| arrival(s, comm, seq, r)).collect();
    tail.fetch_max(start, Ordering::AcqRel);
    lock(&WAITING).push(Waiting {
        tail,
        dev,
        peers,
        dur_ns,
    });
    ANY.store(true, Ordering::Release);
    settle();
    Ok(())
}

/// Ends the collectives whose peers have all arrived: their streams' work
/// ends at the latest arrival plus their duration.
pub(crate) fn settle() {
    if !ANY.load(Ordering::Acquire) {
        return;
    }
    let Ok(s) = sim() else { return };
    let mut waiting = lock(&WAITING);
    waiting.retain(|w| {
        let mut latest = 0u64;
        for p in &w.peers {
            match std::fs::read_to_string(p)
                .ok()
                .and_then(|t| t.trim().parse::<u64>().ok())
            {
                Some(t) => latest = latest.max(t),
                None => return true,
            }
        }
        let end = latest + w.dur_ns;
        w.tail.fetch_max(end, Ordering::AcqRel);
        s.last_end[w.dev].fetch_max(end, Ordering::AcqRel);
        false
    });
    ANY.store(!waiting.is_empty(), Ordering::Release);
}

/// Waits until no collective `which` picks is waiting for its peers.
fn wait_for(which: impl Fn(&Waiting) -> bool) {
    loop {
        settle();
        if !ANY.load(Ordering::Acquire) || !lock(&WAITING).iter().any(&which) {
            return;
        }
        sleep_until(now_ns() + 20_000);
    }
}

/// Whether a collective on the stream with `tail` is still waiting.
pub(crate) fn pending_on(tail: &Arc<AtomicU64>) -> bool {
    settle();
    ANY.load(Ordering::Acquire) && lock(&WAITING).iter().any(|w| Arc::ptr_eq(&w.tail, tail))
}

/// Waits for the collectives on the stream with `tail`.
pub(crate) fn wait_stream(tail: &Arc<AtomicU64>) {
    if ANY.load(Ordering::Acquire) {
        wait_for(|w| Arc::ptr_eq(&w.tail, tail));
    }
}

/// Waits for this process's collectives on device `dev`.
pub(crate) fn wait_device(dev: usize) {
    if ANY.load(Ordering::Acquire) {
        wait_for(|w| w.dev == dev);
    }
}
