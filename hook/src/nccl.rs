//! NCCL communicators: a process that makes one with other ranks is a rank
//! of the job its unique id names (`gemini_protocol::job::of_nccl`), and
//! takes its GPUs in turns with the job's other ranks. Interposed:
//! `ncclCommInitRank`, `ncclCommInitRankConfig` (every rank is handed the
//! same unique id) and `ncclCommInitAll` (one process, all ranks: the
//! process is the job). `ncclCommSplit` makes a communicator of ranks of
//! a job already known, and is left alone. The job a launcher declared
//! (torchrun's, Slurm's, `gem-launch --job`) stays the process's.
//!
//! Programs reach these through the exports below (a program linked
//! against `libnccl.so.2`, as PyTorch is) or through `dlsym` (see the
//! export filter in `lib.rs`): the real function is then the one the
//! program's handle names.

#![allow(non_snake_case)]

use crate::real::real_dlsym;
use crate::state::{self, lock};
use std::ffi::{CStr, c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

/// `ncclUniqueId`: 128 bytes every rank is handed, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    internal: [u8; 128],
}

impl std::fmt::Debug for NcclUniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("NcclUniqueId")
    }
}

type Comm = *mut c_void;
type InitRank = unsafe extern "C" fn(*mut Comm, c_int, NcclUniqueId, c_int) -> c_int;
type InitRankConfig =
    unsafe extern "C" fn(*mut Comm, c_int, NcclUniqueId, c_int, *mut c_void) -> c_int;
type InitAll = unsafe extern "C" fn(*mut Comm, c_int, *const c_int) -> c_int;

/// `ncclSystemError`: what a program gets where no NCCL can be found.
const NCCL_SYSTEM_ERROR: c_int = 2;

static INIT_RANK: AtomicUsize = AtomicUsize::new(0);
static INIT_RANK_CONFIG: AtomicUsize = AtomicUsize::new(0);
static INIT_ALL: AtomicUsize = AtomicUsize::new(0);

/// The slot of a hooked NCCL name, and our function for it.
fn entry(name: &[u8]) -> Option<(&'static AtomicUsize, *mut c_void)> {
    match name {
        b"ncclCommInitRank" => Some((&INIT_RANK, ncclCommInitRank as *mut c_void)),
        b"ncclCommInitRankConfig" => {
            Some((&INIT_RANK_CONFIG, ncclCommInitRankConfig as *mut c_void))
        }
        b"ncclCommInitAll" => Some((&INIT_ALL, ncclCommInitAll as *mut c_void)),
        _ => None,
    }
}

/// `dlsym(handle, name)` by the program: for a hooked NCCL name that
/// `handle` has, ours (the real one remembered); `None` otherwise. Called
/// from the `dlsym` filter: no allocation, no lock.
pub fn lookup(handle: *mut c_void, name: &CStr) -> Option<*mut c_void> {
    let (slot, ours) = entry(name.to_bytes())?;
    // RTLD_NEXT from here would mean "after the hook", not after the
    // caller: the global scope, where the hook comes first, answers (and
    // glibc then gives the caller our export).
    let scope = if handle == libc::RTLD_NEXT {
        libc::RTLD_DEFAULT
    } else {
        handle
    };
    let real = real_dlsym(scope, name);
    if real.is_null() || real == ours {
        return None;
    }
    slot.store(real as usize, Ordering::Release);
    Some(ours)
}

/// The real function of `name`: the one `dlsym` found for the program,
/// else the next after the hook, else `libnccl.so.2`'s if it is loaded.
fn real<F: Copy>(slot: &AtomicUsize, name: &CStr) -> Option<F> {
    let mut f = slot.load(Ordering::Acquire);
    if f == 0 {
        f = real_dlsym(libc::RTLD_NEXT, name) as usize;
        if f == 0 {
            // SAFETY: dlopen with a NUL-terminated name; NOLOAD only looks.
            let h = unsafe {
                libc::dlopen(
                    c"libnccl.so.2".as_ptr(),
                    libc::RTLD_NOLOAD | libc::RTLD_LAZY,
                )
            };
            if !h.is_null() {
                f = real_dlsym(h, name) as usize;
            }
        }
        slot.store(f, Ordering::Release);
    }
    // SAFETY: a non-null address of the named NCCL function, whose C
    // signature F is.
    (f != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&f) })
}

/// The process made a communicator of `nranks` ranks: with others, it is
/// a rank of `job`, unless its launcher said of which.
fn made(nranks: c_int, job: impl FnOnce() -> String) {
    if nranks < 2 {
        return;
    }
    let st = state::get();
    let job = {
        let mut j = lock(&st.job);
        if j.is_some() {
            return;
        }
        let name = job();
        *j = Some(name.clone());
        name
    };
    crate::log::debug!("a rank of NCCL job {job}");
    if st.registered.load(Ordering::Acquire) {
        let _ = st.call(&gemini_protocol::Request::Job { job }, 0);
    }
}

/// `ncclCommInitRank`.
///
/// # Safety
/// NCCL's contract.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitRank(
    comm: *mut Comm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
) -> c_int {
    let Some(f) = real::<InitRank>(&INIT_RANK, c"ncclCommInitRank") else {
        return NCCL_SYSTEM_ERROR;
    };
    // SAFETY: the program's arguments, passed on.
    let r = unsafe { f(comm, nranks, id, rank) };
    if r == 0 {
        made(nranks, || gemini_protocol::job::of_nccl(&id.internal));
    }
    r
}

/// `ncclCommInitRankConfig`.
///
/// # Safety
/// NCCL's contract.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitRankConfig(
    comm: *mut Comm,
    nranks: c_int,
    id: NcclUniqueId,
    rank: c_int,
    config: *mut c_void,
) -> c_int {
    let Some(f) = real::<InitRankConfig>(&INIT_RANK_CONFIG, c"ncclCommInitRankConfig") else {
        return NCCL_SYSTEM_ERROR;
    };
    // SAFETY: the program's arguments, passed on.
    let r = unsafe { f(comm, nranks, id, rank, config) };
    if r == 0 {
        made(nranks, || gemini_protocol::job::of_nccl(&id.internal));
    }
    r
}

/// `ncclCommInitAll`: one process drives every rank.
///
/// # Safety
/// NCCL's contract.
#[cfg_attr(not(test), unsafe(no_mangle))]
pub unsafe extern "C" fn ncclCommInitAll(
    comms: *mut Comm,
    ndev: c_int,
    devlist: *const c_int,
) -> c_int {
    let Some(f) = real::<InitAll>(&INIT_ALL, c"ncclCommInitAll") else {
        return NCCL_SYSTEM_ERROR;
    };
    // SAFETY: the program's arguments, passed on.
    let r = unsafe { f(comms, ndev, devlist) };
    if r == 0 {
        made(ndev, || format!("nccl:pid-{}", std::process::id()));
    }
    r
}
