//! Device memory against the group's `MemoryLimit`: every allocation is
//! reserved through the scheduler before the real call (refused:
//! `CUDA_ERROR_OUT_OF_MEMORY`, never a crash), recorded by pointer or
//! handle, and released on the matching free. Memory queries report the
//! group's view, with saturating arithmetic.
//!
//! Stream-ordered allocations (`cuMemAllocAsync`,
//! `cuMemAllocFromPoolAsync`) come from a memory pool, which keeps what is
//! freed up to its release threshold (PyTorch's `cudaMallocAsync` backend
//! keeps everything): the group is charged what each pool *holds*
//! (`CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`), reserved before an allocation
//! that makes it grow and settled with the pool after it and after every
//! synchronisation (where the driver trims pools).
//!
//! Leases: with each reservation the scheduler may lease the process some
//! more of its group's memory on that device (64 MiB at most, for 50 ms;
//! see gem-schd's `policy::memory`). Allocations within the lease take
//! from it with no round trip, frees give back to it (up to what was
//! leased), and a thread of the hook's returns what is left when it
//! ends. The scheduler counts the lease as the group's, so the
//! `MemoryLimit` holds across processes; a process whose group is short
//! while others hold leases waits for them to come back (at most a
//! second), then is refused.

use crate::clock::now_ns;
use crate::cuda::{CUDA_ERROR_OUT_OF_MEMORY, CUDA_SUCCESS, CUresult};
use crate::state::{self, Lease, State, lock};
use gemini_protocol::{ErrorKind, ErrorReply, Reply, Request};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// The protocol version from which the scheduler leases memory.
const LEASES_SINCE: u16 = 17;
/// What a reservation asks to lease: the scheduler grants at most its own
/// bound.
const LEASE_WANT: u64 = 64 << 20;
/// The longest an allocation waits for its group's other processes to
/// give their leases back before it is refused.
const RECALL_WAIT: Duration = Duration::from_secs(1);

/// Device ordinal of the current context, if any.
pub fn current_ordinal() -> Option<u32> {
    let mut dev: i32 = -1;
    // SAFETY: out-pointer to a local.
    let r = unsafe { crate::driver::ctx_get_device(&mut dev) };
    (r == CUDA_SUCCESS && dev >= 0).then_some(dev as u32)
}

/// Adds `bytes` (negative: takes them) to what the process holds
/// reserved on physical `device`.
fn count(device: u32, bytes: i128) {
    let st = state::get();
    let mut r = lock(&st.reserved);
    let held = r.entry(device).or_default();
    *held = (i128::from(*held) + bytes).clamp(0, i128::from(u64::MAX)) as u64;
}

/// Asks the scheduler for `bytes` more on physical `device`; counted
/// where granted.
fn ask(device: u32, bytes: u64) -> Result<Reply, CUresult> {
    let reply = state::get().call(&Request::ReserveMemory { device, bytes }, device)?;
    if matches!(reply, Reply::Memory { .. }) {
        count(device, i128::from(bytes));
    }
    Ok(reply)
}

/// Reserves `bytes` on ordinal `dev` for this process's group. Returns the
/// physical device to record with the allocation.
pub fn reserve(dev: u32, bytes: u64) -> Result<u32, CUresult> {
    let st = state::get();
    let refused = st.refused.load(Ordering::Acquire);
    if refused != 0 {
        return Err(refused);
    }
    reserve_physical(st.physical(dev), bytes)
}

/// [`reserve`] on physical `device`.
pub fn reserve_physical(device: u32, bytes: u64) -> Result<u32, CUresult> {
    let st = state::get();
    if take_from_lease(st, device, bytes) {
        return Ok(device);
    }
    let reply = if st.speaks_registered()? >= LEASES_SINCE {
        match leased(st, device, bytes)? {
            None => return Ok(device),
            Some(r) => r,
        }
    } else {
        ask(device, bytes)?
    };
    match reply {
        Reply::Memory { .. } | Reply::Leased { .. } => Ok(device),
        Reply::Error(e) if e.kind == ErrorKind::OutOfMemory => {
            // Once per process whatever GEMINI_LOG says: a PyTorch user
            // must be able to tell the group's cap from a full GPU.
            static TOLD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !TOLD.swap(true, Ordering::Relaxed) {
                crate::log::error!(
                    "allocation of {} refused by gemini: {}; the program gets CUDA_ERROR_OUT_OF_MEMORY (further refusals are logged with GEMINI_LOG=1)",
                    gemini_protocol::units::format_size(bytes),
                    e.message
                );
            } else {
                crate::log::debug!(
                    "allocation of {} refused: {}",
                    gemini_protocol::units::format_size(bytes),
                    e.message
                );
            }
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
        Reply::Error(e) if e.kind == ErrorKind::PermissionDenied => {
            Err(crate::conn::not_permitted(&e.message))
        }
        other => {
            crate::log::error!("unexpected answer to a memory reservation: {other:?}");
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
    }
}

/// Reserves `bytes` on physical `device` through the process's lease
/// there: `None` if the lease held them (no round trip); else the
/// scheduler's answer to a reservation that renews the lease (the
/// renewal is made under the lock, so that other threads allocating
/// meanwhile take from the new lease). While the group's other leases
/// are recalled, asks again as told, for at most [`RECALL_WAIT`].
fn leased(st: &'static State, device: u32, bytes: u64) -> Result<Option<Reply>, CUresult> {
    let deadline = Instant::now() + RECALL_WAIT;
    loop {
        let mut leases = lock(&st.leases);
        if take_within(&mut leases, device, bytes) {
            return Ok(None);
        }
        let returned = leases.remove(&device).map_or(0, |l| l.slack);
        note_lease_ends(st, &leases);
        let sent = now_ns();
        let req = Request::ReserveLeased {
            device,
            bytes,
            returned,
            lease: LEASE_WANT,
        };
        let reply = match st.call(&req, device) {
            Ok(reply) => reply,
            Err(code) => {
                count(device, -i128::from(returned));
                return Err(code);
            }
        };
        // (Counted as held until now: a scheduler that restarted
        // meanwhile was told it at hello, and the repeated request takes
        // it back from there.)
        returned_with(st, device, returned, &reply);
        match reply {
            r @ Reply::Leased { lease, ttl_us, .. } => {
                count(device, i128::from(bytes) + i128::from(lease));
                if lease > 0 {
                    let ends = sent.saturating_add(ttl_us.saturating_mul(1000));
                    leases.insert(
                        device,
                        Lease {
                            slack: lease,
                            granted: lease,
                            ends,
                        },
                    );
                    note_lease_ends(st, &leases);
                    start_lease_thread(st);
                }
                return Ok(Some(r));
            }
            Reply::Recalled { retry_us, .. } if Instant::now() < deadline => {
                drop(leases);
                crate::log::debug!(
                    "device {device}: the group's other processes give their leases back; asking again in {retry_us} µs"
                );
                let left = deadline.saturating_duration_since(Instant::now());
                std::thread::sleep(Duration::from_micros(retry_us.max(1_000)).min(left));
            }
            Reply::Recalled { .. } => {
                return Ok(Some(Reply::Error(ErrorReply {
                    kind: ErrorKind::OutOfMemory,
                    message: format!(
                        "the group's other processes on device {device} did not give back the memory leased to them within {} s",
                        RECALL_WAIT.as_secs()
                    ),
                })));
            }
            Reply::Error(e) if matches!(e.kind, ErrorKind::Malformed | ErrorKind::BadRequest) => {
                // A scheduler older than leases took over meanwhile.
                drop(leases);
                return ask(device, bytes).map(Some);
            }
            other => return Ok(Some(other)),
        }
    }
}

/// Takes `bytes` from the lease on `device` in `leases`, if it holds
/// and has them.
fn take_within(leases: &mut HashMap<u32, Lease>, device: u32, bytes: u64) -> bool {
    match leases.get_mut(&device) {
        Some(l) if now_ns() < l.ends && l.slack >= bytes => {
            l.slack -= bytes;
            true
        }
        _ => false,
    }
}

/// [`take_within`] the process's leases: an allocation within one makes
/// no call to the scheduler, nor waits for the connection.
fn take_from_lease(st: &State, device: u32, bytes: u64) -> bool {
    take_within(&mut lock(&st.leases), device, bytes)
}

/// `returned` bytes of the lease on `device` were sent back with a
/// request answered `reply`: the scheduler took them back where the
/// request reached it (answered as a reservation is); else (refused
/// before, or an older scheduler that does not know leases) they are
/// released on their own, so that the group is not charged them until
/// the process ends.
fn returned_with(st: &State, device: u32, returned: u64, reply: &Reply) {
    if returned == 0 {
        return;
    }
    let taken = match reply {
        Reply::Leased { .. } | Reply::Recalled { .. } | Reply::Memory { .. } => true,
        Reply::Error(e) => matches!(e.kind, ErrorKind::OutOfMemory | ErrorKind::Unexpected),
        _ => false,
    };
    if !taken {
        let _ = st.call(
            &Request::ReleaseMemory {
                device,
                bytes: returned,
            },
            device,
        );
    }
    count(device, -i128::from(returned));
}

/// Keeps when the first lease ends, and wakes the lease thread to wait
/// for it.
fn note_lease_ends(st: &State, leases: &HashMap<u32, Lease>) {
    let first = leases.values().map(|l| l.ends).min().unwrap_or(0);
    st.lease_ends.store(first, Ordering::Release);
    st.lease_cv.notify_one();
}

/// Starts the thread that gives leases back as they end (once per
/// process, at its first lease; a forked child starts its own).
fn start_lease_thread(st: &'static State) {
    if st.lease_thread.swap(true, Ordering::AcqRel) {
        return;
    }
    let spawned = std::thread::Builder::new()
        .name("gemini-lease".into())
        .spawn(move || lease_thread(st));
    if spawned.is_err() {
        st.lease_thread.store(false, Ordering::Release);
    }
}

/// Waits for the first lease to end, then gives back what is left of
/// those that ended; sleeps while none is held.
fn lease_thread(st: &'static State) {
    loop {
        {
            let leases = lock(&st.leases);
            let first = st.lease_ends.load(Ordering::Acquire);
            let now = now_ns();
            if first == 0 {
                drop(st.lease_cv.wait(leases));
            } else if now < first {
                let wait = Duration::from_nanos(first - now);
                drop(st.lease_cv.wait_timeout(leases, wait));
            }
        }
        end_leases(st);
    }
}

/// Gives back to the scheduler what is left of the leases that ended.
fn end_leases(st: &'static State) {
    let first = st.lease_ends.load(Ordering::Acquire);
    if first == 0 || now_ns() < first {
        return;
    }
    let mut leases = lock(&st.leases);
    let now = now_ns();
    let ended: Vec<(u32, u64)> = leases
        .iter()
        .filter(|(_, l)| now >= l.ends)
        .map(|(&device, l)| (device, l.slack))
        .collect();
    for (device, bytes) in ended {
        leases.remove(&device);
        match st.call(&Request::ReturnLease { device, bytes }, device) {
            Ok(reply) => returned_with(st, device, bytes, &reply),
            Err(_) => count(device, -i128::from(bytes)),
        }
    }
    note_lease_ends(st, &leases);
}

/// Gives `bytes` freed on `device` back to the lease there, if it holds
/// and has room for them: true if it took them.
fn give_to_lease(st: &State, device: u32, bytes: u64) -> bool {
    let mut leases = lock(&st.leases);
    let Some(l) = leases.get_mut(&device) else {
        return false;
    };
    if now_ns() >= l.ends || l.slack.saturating_add(bytes) > l.granted {
        return false;
    }
    l.slack += bytes;
    true
}

/// What is left of the lease on `device` (0: none).
fn lease_slack(st: &State, device: u32) -> u64 {
    lock(&st.leases).get(&device).map_or(0, |l| l.slack)
}

/// What the process holds reserved on physical `device` for memory the
/// driver has (or is about to have): all it reserved but what is left of
/// its lease.
pub fn reserved_for_allocations(device: u32) -> u64 {
    let st = state::get();
    // Both read under their locks, in their order (leases, then
    // reserved): a renewal in between would change one and not yet the
    // other.
    let leases = lock(&st.leases);
    let slack = leases.get(&device).map_or(0, |l| l.slack);
    let reserved = lock(&st.reserved).get(&device).copied().unwrap_or(0);
    drop(leases);
    reserved.saturating_sub(slack)
}

/// Returns a reservation (the real allocation failed, or was freed): to
/// the lease on `device` while it holds, else to the scheduler.
pub fn unreserve(device: u32, bytes: u64) {
    if bytes == 0 {
        return;
    }
    let st = state::get();
    if give_to_lease(st, device, bytes) {
        return;
    }
    count(device, -i128::from(bytes));
    let _ = st.call(&Request::ReleaseMemory { device, bytes }, device);
}

/// Remembers that `key` (a pointer or handle) holds a reservation.
pub fn record(key: u64, device: u32, bytes: u64) {
    let old = lock(&state::get().memory).insert(key, (device, bytes));
    if let Some(old) = old {
        // The driver handed out an address the hook thinks is in use: its
        // free went past the hook.
        crate::log::debug!("the record of {key:#x} replaced one never freed: {old:?}");
    }
}

/// Frees `key` by `free`. Its record is taken *before* the real call and
/// put back if that fails: once the driver has the address back, another
/// thread's allocation may get it and record it, and that record must
/// not be the one this free deletes.
pub fn freeing(key: u64, free: impl FnOnce() -> CUresult) -> CUresult {
    taken(key, free, unreserve)
}

/// `cuMemRelease(handle)` by `release` (its record taken as [`freeing`]
/// takes it): the handle's memory stays with the driver, and charged,
/// while any mapping of it remains; it is given back with the last
/// `cuMemUnmap` (see [`unmapped`]).
pub fn release_handle(handle: u64, release: impl FnOnce() -> CUresult) -> CUresult {
    taken(handle, release, |device, bytes| {
        let st = state::get();
        let mut vmm = lock(&st.vmm);
        if vmm.maps.values().any(|(_, h)| *h == handle) {
            vmm.released.insert(handle, (device, bytes));
        } else {
            drop(vmm);
            unreserve(device, bytes);
        }
    })
}

/// Takes the record of `key`, calls `free`, and gives the record to
/// `freed` (physical device, bytes) if that succeeded, else puts it back.
fn taken(key: u64, free: impl FnOnce() -> CUresult, freed: impl FnOnce(u32, u64)) -> CUresult {
    let Some(st) = state::current() else {
        return free();
    };
    let found = lock(&st.memory).remove(&key);
    let r = free();
    match found {
        Some((device, bytes)) if r == CUDA_SUCCESS => freed(device, bytes),
        Some(entry) => {
            lock(&st.memory).insert(key, entry);
        }
        None => {}
    }
    r
}

/// `cuMemMap(ptr, size, _, handle)` succeeded.
pub fn mapped(ptr: u64, size: u64, handle: u64) {
    lock(&state::get().vmm).maps.insert(ptr, (size, handle));
}

/// `cuMemUnmap(ptr, size)` succeeded: the mappings in the range are gone,
/// and with the last mapping of a released handle, its memory.
pub fn unmapped(ptr: u64, size: u64) {
    let Some(st) = state::current() else { return };
    let mut gone = Vec::new();
    {
        let mut vmm = lock(&st.vmm);
        let vas: Vec<u64> = vmm
            .maps
            .range(ptr..ptr.saturating_add(size))
            .map(|(va, _)| *va)
            .collect();
        for va in vas {
            let Some((_, handle)) = vmm.maps.remove(&va) else {
                continue;
            };
            if !vmm.maps.values().any(|(_, h)| *h == handle)
                && let Some(held) = vmm.released.remove(&handle)
            {
                gone.push(held);
            }
        }
    }
    for (device, bytes) in gone {
        unreserve(device, bytes);
    }
}

/// `CUmemLocationType` `CU_MEM_LOCATION_TYPE_DEVICE`: the only location
/// of device memory (the host ones, `HOST`, `HOST_NUMA` and
/// `HOST_NUMA_CURRENT`, are host memory, their id a NUMA node).
pub const LOCATION_DEVICE: i32 = 1;

/// The ordinal a `CUmemLocation` (type, id) names, `None` for host memory.
pub fn location_device(kind: i32, id: i32) -> Option<u32> {
    (kind == LOCATION_DEVICE && id >= 0).then_some(id as u32)
}

/// `cuMemPoolCreate` made `pool` with the location (type, id): a pool of
/// host memory is never charged.
pub fn pool_made(pool: *mut c_void, kind: i32, id: i32) {
    if location_device(kind, id).is_none() && !pool.is_null() {
        lock(&state::get().host_pools).insert(pool as usize);
    }
}

/// The ordinal of the device `stream` belongs to: its context's (a
/// stream-ordered allocation comes from the pool of the stream's device,
/// whatever context is current), else the current context's.
pub fn stream_ordinal(stream: *mut c_void) -> Option<u32> {
    // The legacy and per-thread default streams (null, 0x1, 0x2) are the
    // current context's.
    if (stream as usize) <= 2 {
        return current_ordinal();
    }
    let ctx = crate::driver::stream_ctx(stream)?;
    let st = state::get();
    let known = lock(&st.contexts)
        .iter()
        .find(|&&(c, _)| c == ctx as usize)
        .map(|&(_, dev)| dev);
    known.or_else(current_ordinal)
}

/// Reserves, calls `alloc` (which returns the real result and the key of
/// what it allocated), records or rolls back.
pub fn guarded_alloc(bytes: u64, alloc: impl FnMut() -> (CUresult, u64)) -> CUresult {
    guarded_alloc_on(current_ordinal(), bytes, alloc)
}

/// [`guarded_alloc`] on an explicit device ordinal (`None`: let the real
/// call run unaccounted; it fails without a context anyway).
pub fn guarded_alloc_on(
    dev: Option<u32>,
    bytes: u64,
    mut alloc: impl FnMut() -> (CUresult, u64),
) -> CUresult {
    let Some(dev) = dev else { return alloc().0 };
    if bytes == 0 {
        return alloc().0; // the driver reports the invalid size
    }
    let device = match reserve(dev, bytes) {
        Ok(d) => d,
        Err(e) => return e,
    };
    let (r, key) = alloc_past_holder(device, bytes, &mut alloc);
    if r == CUDA_SUCCESS {
        record(key, device, bytes);
    } else {
        unreserve(device, bytes);
    }
    r
}

/// Device memory of a CUDA array of `dims` (0: absent), `format`
/// (`CUarray_format`), `channels` and mipmap `levels` (each halves every
/// dimension, down to 1), as its descriptor says (the driver may pad
/// more). A format of more than 4 bytes per channel is not in `cuda.h`;
/// unknown ones count 4.
pub fn array_bytes(dims: [usize; 3], format: u32, channels: u32, levels: u32) -> u64 {
    let elem: u64 = match format {
        0x01 | 0x08 => 1,        // (UN)SIGNED_INT8
        0x02 | 0x09 | 0x10 => 2, // (UN)SIGNED_INT16, HALF
        _ => 4,
    };
    let channels = u64::from(channels.clamp(1, 4));
    (0..levels.clamp(1, 32))
        .map(|level| {
            let size = |d: usize| ((d.max(1) as u64) >> level).max(1);
            size(dims[0])
                .saturating_mul(size(dims[1]))
                .saturating_mul(size(dims[2]))
                .saturating_mul(elem * channels)
        })
        .fold(0u64, u64::saturating_add)
}

/// `CU_MEMPOOL_ATTR_RESERVED_MEM_CURRENT`, `CU_MEMPOOL_ATTR_USED_MEM_CURRENT`.
const POOL_RESERVED: i32 = 5;
const POOL_USED: i32 = 7;

/// A stream-ordered allocation of `bytes` on `stream`, which is not
/// capturing (see `graphmem::stream_alloc`), from `pool` (`None`: the
/// current pool of the stream's device) by `alloc`, which returns the
/// result and the pointer. The pool's growth is reserved first; after the
/// call the group holds what the pool holds. A pool of host memory is
/// not charged.
pub fn pool_alloc(
    pool: Option<*mut c_void>,
    stream: *mut c_void,
    bytes: u64,
    mut alloc: impl FnMut() -> (CUresult, u64),
) -> CUresult {
    let Some(dev) = stream_ordinal(stream) else {
        return alloc().0;
    };
    if let Some(p) = pool
        && lock(&state::get().host_pools).contains(&(p as usize))
    {
        return alloc().0;
    }
    let Some(pool) = pool.or_else(|| crate::driver::device_mem_pool(dev)) else {
        return guarded_alloc_on(Some(dev), bytes, alloc); // no pools: counted per pointer
    };
    let st = state::get();
    let refused = st.refused.load(Ordering::Acquire);
    if refused != 0 {
        return refused;
    }
    let device = st.physical(dev);
    // What the pool holds and hands out is read under the lock: another
    // thread's allocation in between would make the growth reserved too
    // small, and the driver would hold more than the group was granted.
    let mut pools = lock(&st.pools);
    let reserved = crate::driver::mem_pool_u64(pool, POOL_RESERVED).unwrap_or(0);
    let used = crate::driver::mem_pool_u64(pool, POOL_USED).unwrap_or(0);
    st.pools_seen.store(true, Ordering::Release);
    let held = pools.entry(pool as usize).or_insert((device, 0)).1;
    let need = used.saturating_add(bytes).max(reserved);
    if need > held {
        if let Err(e) = reserve(dev, need - held) {
            return e;
        }
        pools.insert(pool as usize, (device, need));
    }
    let (r, ptr) = alloc_past_holder(device, bytes, &mut alloc);
    // The driver reserves in chunks of its own: settle with what it holds.
    if !settle_pool(pool, &mut pools) && r == CUDA_SUCCESS {
        crate::log::debug!(
            "pool grew beyond the group's limit: allocation of {bytes} bytes taken back"
        );
        // SAFETY: `ptr` was allocated just now on `stream` from `pool`
        // and has not been returned to the program.
        unsafe { crate::driver::pool_give_back(ptr, stream, pool) };
        settle_pool(pool, &mut pools);
        return CUDA_ERROR_OUT_OF_MEMORY;
    }
    r
}

/// Charges the group what `pool` holds now; false if the scheduler
/// refused a growth (the group would be over its limit).
fn settle_pool(pool: *mut c_void, pools: &mut HashMap<usize, (u32, u64)>) -> bool {
    let Some(held) = pools.get_mut(&(pool as usize)) else {
        return true;
    };
    let Some(now) = crate::driver::mem_pool_u64(pool, POOL_RESERVED) else {
        return true;
    };
    charge_to(held, now)
}

/// Brings `held`, the group's reservation (physical device, bytes) for
/// memory the driver keeps on its own (a pool, the graph allocator), to
/// the `now` bytes it keeps: what it gave back is released, what it grew
/// by is asked for. False, and `held` unchanged, if the scheduler refused
/// the growth (the group would be over its limit).
pub fn charge_to(held: &mut (u32, u64), now: u64) -> bool {
    let (device, was) = *held;
    if now < was {
        unreserve(device, was - now);
    } else if now > was {
        // Through the lease, as an allocation: from what is left of it,
        // or a reservation that recalls the group's other leases.
        let grown = reserve_physical(device, now - was).is_ok();
        if !grown {
            return false;
        }
    }
    held.1 = now;
    true
}

/// After a synchronisation (where the driver trims pools to their release
/// thresholds), or a pool's trim: the group holds what its pools hold.
pub fn settle_pools() {
    let Some(st) = state::current() else { return };
    if !st.pools_seen.load(Ordering::Acquire) {
        return;
    }
    let mut pools = lock(&st.pools);
    let handles: Vec<usize> = pools.keys().copied().collect();
    for h in handles {
        settle_pool(h as *mut c_void, &mut pools);
    }
}

/// A pool was destroyed: what the group held for it is released.
pub fn pool_destroyed(pool: *mut c_void) {
    let Some(st) = state::current() else { return };
    lock(&st.host_pools).remove(&(pool as usize));
    let gone = lock(&st.pools).remove(&(pool as usize));
    if let Some((device, held)) = gone
        && held > 0
    {
        unreserve(device, held);
    }
}

/// Calls `alloc`; within the group's limit but with the device full, the
/// holder may be sitting on the memory: asks for it back and tries again
/// (up to three times).
fn alloc_past_holder(
    device: u32,
    bytes: u64,
    alloc: &mut impl FnMut() -> (CUresult, u64),
) -> (CUresult, u64) {
    let mut result = alloc();
    for _ in 0..3 {
        if result.0 != CUDA_ERROR_OUT_OF_MEMORY || !holder_gives_back(device, bytes) {
            break;
        }
        result = alloc();
    }
    result
}

/// Asks the scheduler to have the holder free memory on `device`; true if
/// it did (retry the allocation).
fn holder_gives_back(device: u32, bytes: u64) -> bool {
    let st = state::get();
    matches!(
        st.call(&Request::NeedMemory { device, bytes }, device),
        Ok(Reply::Done)
    )
}

/// The group's (used, limit, reclaimable) on ordinal `dev`, if the
/// scheduler answers; reclaimable is what the holder holds there.
pub fn view(dev: u32) -> Option<(u64, u64, u64)> {
    view_physical(state::get().physical(dev))
}

/// [`view`] of the physical `device`.
pub fn view_physical(device: u32) -> Option<(u64, u64, u64)> {
    let st = state::get();
    if st.refused.load(Ordering::Acquire) != 0 {
        return None;
    }
    match st.call(&Request::MemoryInfo { device }, device).ok()? {
        Reply::MemoryView {
            used,
            limit,
            reclaimable,
            ..
        } => {
            // What is left of this process's lease is free to it.
            let used = used.saturating_sub(lease_slack(st, device));
            Some((used, limit, reclaimable))
        }
        _ => None,
    }
}

/// The most a context took on physical `device`, as processes reported
/// it to the scheduler (0: none yet, or no answer).
pub fn context_cost(device: u32) -> u64 {
    let st = state::get();
    match st.call(&Request::MemoryInfo { device }, device) {
        Ok(Reply::MemoryView { context, .. }) => context,
        _ => 0,
    }
}

/// Tells the scheduler that a context took `bytes` of physical `device`.
pub fn report_context(device: u32, bytes: u64) {
    let st = state::get();
    let _ = st.call(&Request::ContextCost { device, bytes }, device);
}

/// The group's view of physical (free, total): total = min(limit,
/// physical), free = min(limit − used, physical free + what the holder
/// would give back), never above total.
pub fn group_view(free: u64, total: u64, used: u64, limit: u64, reclaimable: u64) -> (u64, u64) {
    let total = limit.min(total);
    (
        limit
            .saturating_sub(used)
            .min(free.saturating_add(reclaimable))
            .min(total),
        total,
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn array_bytes_follow_the_descriptor() {
        assert_eq!(
            array_bytes([1024, 0, 0], 0x20, 4, 1),
            16 * 1024,
            "1D float4"
        );
        assert_eq!(array_bytes([256, 256, 0], 0x01, 1, 1), 65536, "2D u8");
        assert_eq!(
            array_bytes([64, 64, 64], 0x10, 2, 1),
            64 * 64 * 64 * 4,
            "3D half2"
        );
        assert_eq!(
            array_bytes([4, 4, 0], 0x03, 1, 3),
            (16 + 4 + 1) * 4,
            "mipmaps"
        );
        assert_eq!(
            array_bytes([usize::MAX, usize::MAX, 2], 0x20, 4, 1),
            u64::MAX
        );
    }

    #[test]
    fn group_view_saturates() {
        assert_eq!(group_view(80, 100, 10, 50, 0), (40, 50));
        assert_eq!(group_view(20, 100, 10, 50, 0), (20, 50));
        assert_eq!(
            group_view(80, 100, 70, 50, 0),
            (0, 50),
            "used above a lowered limit"
        );
        assert_eq!(group_view(80, 100, 0, u64::MAX, 0), (80, 100));
        assert_eq!(
            group_view(10, 100, 0, u64::MAX, 60),
            (70, 100),
            "the holder's memory counts as free"
        );
        assert_eq!(
            group_view(10, 100, 0, 40, u64::MAX),
            (40, 40),
            "never above the limit"
        );
    }
}
