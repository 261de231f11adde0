//! The few NCCL calls a program makes to join a communicator, so that the
//! simulator's library can be installed as `libnccl.so.2` too: every
//! rank of a communicator is handed the unique id one rank made
//! (`ncclGetUniqueId`), and creates its part with it
//! (`ncclCommInitRank`, `ncclCommInitRankConfig`), or one process creates
//! every rank (`ncclCommInitAll`). The communicators carry no
//! collectives: the simulator's collective is the kernel `fake_allreduce`
//! (see [`crate::collective`]). Results as NCCL's: `ncclSuccess` 0,
//! `ncclInvalidArgument` 4.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

const NCCL_SUCCESS: c_int = 0;
const NCCL_INVALID_ARGUMENT: c_int = 4;

/// `ncclUniqueId`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NcclUniqueId {
    pub internal: [u8; 128],
}

/// Handles given out as communicators (never dereferenced).
static NEXT: AtomicUsize = AtomicUsize::new(0x5eed_0000);

/// `ncclGetVersion`: 2.23.4.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    if version.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *version = 22304 };
    NCCL_SUCCESS
}

/// `ncclGetUniqueId`: 128 bytes no other call of any process gives (the
/// pid, the time, a count).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclGetUniqueId(id: *mut NcclUniqueId) -> c_int {
    if id.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    let mut internal = [0u8; 128];
    internal[..4].copy_from_slice(&std::process::id().to_le_bytes());
    internal[4..12].copy_from_slice(&fakecuda_log::now_ns().to_le_bytes());
    internal[12..20].copy_from_slice(&(NEXT.fetch_add(1, Ordering::Relaxed) as u64).to_le_bytes());
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *id = NcclUniqueId { internal } };
    NCCL_SUCCESS
}

fn init(comm: *mut *mut c_void, nranks: c_int, rank: c_int) -> c_int {
    if comm.is_null() || nranks < 1 || rank < 0 || rank >= nranks {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: non-null out-pointer from the caller.
    unsafe { *comm = NEXT.fetch_add(1, Ordering::Relaxed) as *mut c_void };
    NCCL_SUCCESS
}

/// `ncclCommInitRank`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut *mut c_void,
    nranks: c_int,
    _id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    init(comm, nranks, rank)
}

/// `ncclCommInitRankConfig`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut *mut c_void,
    nranks: c_int,
    _id: NcclUniqueId,
    rank: c_int,
    _config: *mut c_void,
) -> c_int {
    init(comm, nranks, rank)
}

/// `ncclCommInitAll`: `ndev` communicators, one per device of `devlist`
/// (null: devices 0 to `ndev - 1`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut *mut c_void,
    ndev: c_int,
    _devlist: *const c_int,
) -> c_int {
    if comms.is_null() || ndev < 1 {
        return NCCL_INVALID_ARGUMENT;
    }
    for i in 0..ndev as usize {
        // SAFETY: the caller's array of `ndev` communicators.
        unsafe { *comms.add(i) = NEXT.fetch_add(1, Ordering::Relaxed) as *mut c_void };
    }
    NCCL_SUCCESS
}

/// `ncclCommDestroy`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    if comm.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    NCCL_SUCCESS
}
