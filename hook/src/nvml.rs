//! NVML's memory queries in a job show the group's view, as `cuMemGetInfo`
//! does: `nvidia-smi`, `pynvml`, vLLM's memory profiling and monitoring
//! code read `nvmlDeviceGetMemoryInfo[_v2]`. Exported (for programs
//! linked against `libnvidia-ml.so.1`) and answered by our `dlsym` (for
//! those that load it at run time); the real functions come from
//! `libnvidia-ml.so.1`.
//!
//! NVML numbers devices in PCI bus order and ignores
//! `CUDA_VISIBLE_DEVICES`; its index is taken as the physical device the
//! scheduler knows (as CUDA's is with `CUDA_DEVICE_ORDER=PCI_BUS_ID`).

use crate::memory;
use crate::nvml_lib::{NVML_ERROR_FUNCTION_NOT_FOUND, NvmlReturn, nvml_index, real, uuid_of};
use std::ffi::{CStr, c_void};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::AtomicUsize;

/// `nvmlMemory_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemory {
    total: u64,
    free: u64,
    used: u64,
}

/// `nvmlMemory_v2_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlMemoryV2 {
    version: u32,
    total: u64,
    reserved: u64,
    free: u64,
    used: u64,
}

/// The physical device of an NVML handle: the scheduler's index of the
/// CUDA device with the same UUID (NVML's own index is the container's
/// in a container), else NVML's index.
fn physical_of(device: *mut c_void) -> Option<u32> {
    uuid_of(device)
        .and_then(|text| crate::state::get().physical_of_uuid(&text))
        .or_else(|| nvml_index(device))
}

/// The group's view of (free, total) on the NVML `device`, if the process
/// belongs to a group the scheduler answers for.
fn group_view(device: *mut c_void, free: u64, total: u64) -> Option<(u64, u64)> {
    let physical = physical_of(device)?;
    let (used, limit, reclaimable) = memory::view_physical(physical)?;
    Some(memory::group_view(free, total, used, limit, reclaimable))
}

/// Calls the real `name` (signature `F`, filling an `M`) and adjusts
/// what it filled to the group's view with `adjust(m, free, total)`.
///
/// # Safety
/// `F` is `name`'s C signature, `M` the struct it fills; `device` and
/// `mem` are the program's arguments.
unsafe fn in_group_view<M>(
    slot: &AtomicUsize,
    name: &CStr,
    device: *mut c_void,
    mem: *mut M,
    read: impl Fn(&M) -> (u64, u64),
    adjust: impl Fn(&mut M, u64, u64),
) -> NvmlReturn {
    type F<M> = unsafe extern "C" fn(*mut c_void, *mut M) -> NvmlReturn;
    // SAFETY: the caller's promise about `name`'s signature.
    let Some(f) = (unsafe { real::<F<M>>(slot, name) }) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: the program's arguments, passed on unchanged.
    let r = unsafe { f(device, mem) };
    if r != 0 || mem.is_null() {
        return r;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: filled by the real call just now.
        let m = unsafe { &mut *mem };
        let (free, total) = read(m);
        if let Some((free, total)) = group_view(device, free, total) {
            adjust(m, free, total);
        }
    }));
    r
}

/// `nvmlDeviceGetMemoryInfo`, in the group's view.
///
/// # Safety
/// As NVML's: a device handle and a writable `nvmlMemory_t`.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(non_snake_case)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo(
    device: *mut c_void,
    mem: *mut NvmlMemory,
) -> NvmlReturn {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: nvmlDeviceGetMemoryInfo fills an nvmlMemory_t.
    unsafe {
        in_group_view(
            &SLOT,
            c"nvmlDeviceGetMemoryInfo",
            device,
            mem,
            |m| (m.free, m.total),
            |m, free, total| {
                (m.free, m.total) = (free, total);
                m.used = total - free;
            },
        )
    }
}

/// `nvmlDeviceGetMemoryInfo_v2`, in the group's view (the driver's own
/// reserved memory is left as NVML says).
///
/// # Safety
/// As NVML's: a device handle and a writable `nvmlMemory_v2_t` with its
/// version set.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(non_snake_case)]
pub unsafe extern "C" fn nvmlDeviceGetMemoryInfo_v2(
    device: *mut c_void,
    mem: *mut NvmlMemoryV2,
) -> NvmlReturn {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    // SAFETY: nvmlDeviceGetMemoryInfo_v2 fills an nvmlMemory_v2_t.
    unsafe {
        in_group_view(
            &SLOT,
            c"nvmlDeviceGetMemoryInfo_v2",
            device,
            mem,
            |m| (m.free, m.total),
            |m, free, total| {
                (m.free, m.total) = (free, total);
                m.used = total.saturating_sub(free).saturating_sub(m.reserved);
            },
        )
    }
}

/// The group as the scheduler sees it.
#[derive(Clone)]
struct GroupNow {
    /// Its processes' ids.
    pids: Vec<u32>,
    /// Its share of each device: (device, share).
    shares: Vec<(u32, f64)>,
}

/// How long an answer of the scheduler serves NVML queries: a monitor
/// polling NVML in a job (nvitop, a dashboard) costs the single-threaded
/// scheduler at most one status report per this.
const GROUP_VIEW_NS: u64 = 100_000_000;

/// The process's group as the scheduler saw it at most
/// [`GROUP_VIEW_NS`] ago (`None`: no answer, or the process is in no
/// group).
fn group_status() -> Option<GroupNow> {
    static VIEW: std::sync::Mutex<Option<(u64, GroupNow)>> = std::sync::Mutex::new(None);
    let now = crate::clock::now_ns();
    if let Some((at, view)) = &*crate::state::lock(&VIEW)
        && now.saturating_sub(*at) < GROUP_VIEW_NS
    {
        return Some(view.clone());
    }
    let view = ask_group_status()?;
    *crate::state::lock(&VIEW) = Some((now, view.clone()));
    Some(view)
}

/// The process's group as the scheduler sees it now.
fn ask_group_status() -> Option<GroupNow> {
    let st = crate::state::get();
    if st.refused.load(std::sync::atomic::Ordering::Acquire) != 0 {
        return None;
    }
    let me = st.client_id.load(std::sync::atomic::Ordering::Acquire);
    let gemini_protocol::Reply::Status(report) =
        st.call(&gemini_protocol::Request::Status, 0).ok()?
    else {
        return None;
    };
    let group = &report.clients.iter().find(|c| c.id == me)?.group;
    let pids = report
        .clients
        .iter()
        .filter(|c| &c.group == group && c.role == gemini_protocol::Role::Client)
        .map(|c| c.pid)
        .collect();
    let shares = report
        .devices
        .iter()
        .map(|d| {
            let share = d
                .groups
                .iter()
                .find(|g| &g.group == group)
                .map_or(0.0, |g| g.share);
            (d.device, share)
        })
        .collect();
    Some(GroupNow { pids, shares })
}

/// Calls the real `nvmlDeviceGetComputeRunningProcesses*` `name` and
/// keeps, of the entries it wrote (`size` bytes each, the pid first),
/// those of the group's processes: `nvidia-smi` in a job lists its own.
///
/// # Safety
/// As NVML's: a device handle, a writable count and `*count` entries.
unsafe fn group_processes(
    slot: &AtomicUsize,
    name: &CStr,
    device: *mut c_void,
    count: *mut u32,
    infos: *mut u8,
    size: usize,
) -> NvmlReturn {
    type F = unsafe extern "C" fn(*mut c_void, *mut u32, *mut u8) -> NvmlReturn;
    // SAFETY: the signature of every version.
    let Some(f) = (unsafe { real::<F>(slot, name) }) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: the program's arguments, passed on unchanged.
    let r = unsafe { f(device, count, infos) };
    if r != 0 || count.is_null() || infos.is_null() {
        return r;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let Some(GroupNow { pids, .. }) = group_status() else {
            return;
        };
        // SAFETY: NVML wrote `*count` entries of `size` bytes into the
        // program's array; entries are moved down within it.
        unsafe {
            let n = *count as usize;
            let mut kept = 0;
            for i in 0..n {
                let entry = infos.add(i * size);
                let pid = (entry as *const u32).read_unaligned();
                if pids.contains(&pid) {
                    if kept != i {
                        std::ptr::copy(entry, infos.add(kept * size), size);
                    }
                    kept += 1;
                }
            }
            *count = kept as u32;
        }
    }));
    r
}

macro_rules! running_processes {
    ($($name:ident: $size:literal;)*) => {$(
        /// The group's processes only (see [`group_processes`]).
        ///
        /// # Safety
        /// As NVML's.
        #[cfg_attr(not(test), unsafe(no_mangle))]
        #[allow(non_snake_case)]
        pub unsafe extern "C" fn $name(device: *mut c_void, count: *mut u32, infos: *mut c_void) -> NvmlReturn {
            static SLOT: AtomicUsize = AtomicUsize::new(0);
            const NAME: &CStr = match CStr::from_bytes_with_nul(concat!(stringify!($name), "\0").as_bytes()) {
                Ok(c) => c,
                Err(_) => panic!("no NUL in a name"),
            };
            // SAFETY: the caller's arguments; entries of this version's size.
            unsafe { group_processes(&SLOT, NAME, device, count, infos.cast(), $size) }
        }
    )*};
}

// nvmlProcessInfo_v1_t is 16 bytes, _v2_t and nvmlProcessInfo_t 24.
running_processes! {
    nvmlDeviceGetComputeRunningProcesses: 16;
    nvmlDeviceGetComputeRunningProcesses_v2: 24;
    nvmlDeviceGetComputeRunningProcesses_v3: 24;
}

/// `nvmlUtilization_t`.
#[repr(C)]
#[derive(Debug)]
pub struct NvmlUtilization {
    gpu: u32,
    memory: u32,
}

/// `nvmlDeviceGetUtilizationRates`: the GPU's busy time as the group's
/// share of it, as the scheduler measures it (the memory figure as NVML
/// says).
///
/// # Safety
/// As NVML's: a device handle and a writable `nvmlUtilization_t`.
#[cfg_attr(not(test), unsafe(no_mangle))]
#[allow(non_snake_case)]
pub unsafe extern "C" fn nvmlDeviceGetUtilizationRates(
    device: *mut c_void,
    util: *mut NvmlUtilization,
) -> NvmlReturn {
    static SLOT: AtomicUsize = AtomicUsize::new(0);
    type F = unsafe extern "C" fn(*mut c_void, *mut NvmlUtilization) -> NvmlReturn;
    // SAFETY: nvmlDeviceGetUtilizationRates' signature.
    let Some(f) = (unsafe { real::<F>(&SLOT, c"nvmlDeviceGetUtilizationRates") }) else {
        return NVML_ERROR_FUNCTION_NOT_FOUND;
    };
    // SAFETY: the program's arguments, passed on unchanged.
    let r = unsafe { f(device, util) };
    if r != 0 || util.is_null() {
        return r;
    }
    let _ = catch_unwind(AssertUnwindSafe(|| {
        let (Some(physical), Some(GroupNow { shares, .. })) = (physical_of(device), group_status())
        else {
            return;
        };
        if let Some(&(_, share)) = shares.iter().find(|(d, _)| *d == physical) {
            // SAFETY: filled by the real call just now.
            unsafe { (*util).gpu = (share * 100.0).round().clamp(0.0, 100.0) as u32 };
        }
    }));
    r
}

/// Our function for an NVML name, for our `dlsym`.
pub fn lookup(name: &[u8]) -> Option<*mut c_void> {
    match name {
        b"nvmlDeviceGetComputeRunningProcesses" => {
            Some(nvmlDeviceGetComputeRunningProcesses as *const () as *mut c_void)
        }
        b"nvmlDeviceGetComputeRunningProcesses_v2" => {
            Some(nvmlDeviceGetComputeRunningProcesses_v2 as *const () as *mut c_void)
        }
        b"nvmlDeviceGetComputeRunningProcesses_v3" => {
            Some(nvmlDeviceGetComputeRunningProcesses_v3 as *const () as *mut c_void)
        }
        b"nvmlDeviceGetUtilizationRates" => {
            Some(nvmlDeviceGetUtilizationRates as *const () as *mut c_void)
        }
        b"nvmlDeviceGetMemoryInfo" => Some(nvmlDeviceGetMemoryInfo as *const () as *mut c_void),
        b"nvmlDeviceGetMemoryInfo_v2" => {
            Some(nvmlDeviceGetMemoryInfo_v2 as *const () as *mut c_void)
        }
        _ => None,
    }
}
