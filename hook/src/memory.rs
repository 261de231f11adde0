//! Device memory against the group's `MemoryLimit`: every allocation is
//! reserved through the scheduler before the real call (refused:
//! `CUDA_ERROR_OUT_OF_MEMORY`, never a crash), recorded by pointer or
//! handle, and released on the matching free. Memory queries report the
//! group's view, with saturating arithmetic.

use crate::driver::CUresult;
use crate::state::{self, lock};
use gemini_protocol::{ErrorKind, Reply, Request};
use std::sync::atomic::Ordering;

/// `CUDA_ERROR_OUT_OF_MEMORY`.
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;

/// Device ordinal of the current context, if any.
pub fn current_ordinal() -> Option<u32> {
    let mut dev: i32 = -1;
    // SAFETY: out-pointer to a local.
    let r = unsafe { crate::driver::ctx_get_device(&mut dev) };
    (r == 0 && dev >= 0).then_some(dev as u32)
}

/// Reserves `bytes` on ordinal `dev` for this process's group. Returns the
/// physical device to record with the allocation.
pub fn reserve(dev: u32, bytes: u64) -> Result<u32, CUresult> {
    let st = state::get();
    let refused = st.refused.load(Ordering::Acquire);
    if refused != 0 {
        return Err(refused);
    }
    let device = st.settings.physical(dev);
    match st.call(&Request::ReserveMemory { device, bytes }, device)? {
        Reply::Memory { .. } => Ok(device),
        Reply::Error(e) if e.kind == ErrorKind::OutOfMemory => {
            crate::log::debug!("allocation of {bytes} bytes refused: {}", e.message);
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
        other => {
            crate::log::error!("unexpected answer to a memory reservation: {other:?}");
            Err(CUDA_ERROR_OUT_OF_MEMORY)
        }
    }
}

/// Returns a reservation (the real allocation failed, or was freed).
pub fn unreserve(device: u32, bytes: u64) {
    let st = state::get();
    let _ = st.call(&Request::ReleaseMemory { device, bytes }, device);
}

/// Remembers that `key` (a pointer or handle) holds a reservation.
pub fn record(key: u64, device: u32, bytes: u64) {
    lock(&state::get().memory).insert(key, (device, bytes));
}

/// Releases the reservation of `key`, if it has one (memory allocated
/// before the hook was active has none).
pub fn release(key: u64) {
    let Some(st) = state::current() else { return };
    let found = lock(&st.memory).remove(&key);
    if let Some((device, bytes)) = found {
        unreserve(device, bytes);
    }
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
    let (mut r, mut key) = alloc();
    // Within the group's limit but the device is full: the holder may be
    // sitting on the memory. Ask for it back and try again.
    for _ in 0..3 {
        if r != CUDA_ERROR_OUT_OF_MEMORY || !holder_gives_back(device, bytes) {
            break;
        }
        (r, key) = alloc();
    }
    if r == 0 {
        record(key, device, bytes);
    } else {
        unreserve(device, bytes);
    }
    r
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
    let st = state::get();
    if st.refused.load(Ordering::Acquire) != 0 {
        return None;
    }
    let device = st.settings.physical(dev);
    match st.call(&Request::MemoryInfo { device }, device).ok()? {
        Reply::MemoryView {
            used,
            limit,
            reclaimable,
            ..
        } => Some((used, limit, reclaimable)),
        _ => None,
    }
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
