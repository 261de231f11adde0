//! `gem-workload`: a CUDA client program for the tests. It loads the driver
//! the way the CUDA runtime ≥ 11.3 does — `dlopen("libcuda.so.1")`, then
//! every entry point through `cuGetProcAddress_v2` with a CUDA version and
//! the per-thread-stream flag — launches kernels in bursts, allocates
//! memory, and prints what it achieved as one `key=value` line per
//! process.

use anyhow::{Context as _, bail};
use clap::Parser;
use std::ffi::{CString, c_char, c_void};
use std::time::{Duration, Instant};

mod driver;
mod launch;
mod run;

use driver::*;
use launch::*;
use run::*;

type CUresult = u32;
type Ptr = *mut c_void;

#[derive(Parser, Debug, Clone)]
#[command(about = "CUDA test workload (dlopen + cuGetProcAddress_v2)")]
struct Args {
    /// Length of one kernel, microseconds
    #[arg(long, default_value_t = 1000)]
    kernel_us: u64,
    /// Launch kernels for this long, then synchronise and idle (0: never idle)
    #[arg(long, default_value_t = 0.0)]
    burst_ms: f64,
    /// Idle time between bursts, milliseconds
    #[arg(long, default_value_t = 0.0)]
    gap_ms: f64,
    /// Run time, seconds
    #[arg(long, default_value_t = 1.0)]
    seconds: f64,
    /// Device memory to allocate, e.g. 512MiB (0: none)
    #[arg(long, default_value = "0", value_parser = |s: &str| parse_size::parse_size(s))]
    mem: u64,
    /// Allocate the memory in chunks of this size (default: one chunk)
    #[arg(long, value_parser = |s: &str| parse_size::parse_size(s))]
    chunk: Option<u64>,
    /// Allocation API: v2, pitch, managed, async, create, array
    /// (cuArrayCreate, 1D float4), array3d (cuArray3DCreate)
    #[arg(long, default_value = "v2")]
    alloc_api: String,
    /// Launch API: kernel, ex, coop, graph, or coop-multi
    /// (cuLaunchCooperativeKernelMultiDevice: one kernel on each device,
    /// each onto a stream of its own there; an iteration then synchronises
    /// every one of those streams)
    #[arg(long, default_value = "kernel")]
    launch_api: String,
    /// Device ordinal
    #[arg(long, default_value_t = 0)]
    device: i32,
    /// Ask for the per-thread-default-stream variants (_ptsz)
    #[arg(long)]
    ptsz: bool,
    /// CUDA version passed to cuGetProcAddress_v2
    #[arg(long, default_value_t = 12080)]
    cuda_version: i32,
    /// Fork a child before initialising CUDA; it runs the same workload
    #[arg(long)]
    fork: bool,
    /// Driver library to dlopen
    #[arg(long, default_value = "libcuda.so.1")]
    driver: String,
    /// dlopen the driver with RTLD_DEEPBIND (as some libraries load
    /// theirs)
    #[arg(long)]
    deepbind: bool,
    /// dlopen this library (RTLD_NOW) before the driver, as a program
    /// loads its libraries
    #[arg(long)]
    load_lib: Option<std::path::PathBuf>,
    /// How entry points are found: procaddr (cuGetProcAddress_v2, as the
    /// CUDA runtime does) or dlsym (the versioned symbol names)
    #[arg(long, default_value = "procaddr")]
    resolve: String,
    /// Write the time (CLOCK_MONOTONIC ns) each burst started launching to
    /// this file, one per line
    #[arg(long)]
    bursts_file: Option<std::path::PathBuf>,
    /// Append `start end` (CLOCK_MONOTONIC ns) to this file for each
    /// burst, from its first launch to the return of its wait: when this
    /// process had work for the device (every launching thread appends)
    #[arg(long)]
    demand_file: Option<std::path::PathBuf>,
    /// Launch from this many threads at once (same context and device)
    #[arg(long, default_value_t = 1)]
    threads: usize,
    /// Retry an allocation refused with out-of-memory for up to this many
    /// seconds (0: no retry)
    #[arg(long, default_value_t = 0.0)]
    retry_alloc_seconds: f64,
    /// After the allocations, this many cuMemAlloc + cuMemFree pairs of
    /// --chunk bytes (1 MiB by default), each call timed: the report gives
    /// each call's median (alloc_pair_p50_ns, free_pair_p50_ns)
    #[arg(long, default_value_t = 0)]
    alloc_free: u32,
    /// Go on with --alloc-free's pairs for at least this many seconds
    #[arg(long, default_value_t = 0.0)]
    alloc_free_seconds: f64,
    /// Kernels per iteration, as a training step queues them; after them
    /// the iteration waits for its work as --wait says, then idles
    /// --gap-ms (0: launch for --burst-ms instead)
    #[arg(long, default_value_t = 0)]
    iter_kernels: u64,
    /// Kernel lengths in microseconds, comma-separated, taken in turn
    /// instead of --kernel-us (a training step's mix: a few long matrix
    /// products among many short element-wise kernels)
    #[arg(long, value_delimiter = ',')]
    kernel_mix: Vec<u64>,
    /// CPU time spent before each launch, microseconds (a framework's
    /// per-operation overhead: the device runs ahead of the CPU only
    /// while the queued kernels outlast it)
    #[arg(long, default_value_t = 0)]
    launch_cpu_us: u64,
    /// How an iteration (or burst) waits for its work: stream
    /// (cuStreamSynchronize), ctx (cuCtxSynchronize), event (cuEventRecord,
    /// then cuEventSynchronize), copy (a blocking cuMemcpyDtoH, as
    /// `loss.item()` does), query (spin on cuStreamQuery), event-query
    /// (cuEventRecord, then spin on cuEventQuery)
    #[arg(long, default_value = "stream", value_parser = ["stream", "ctx", "event", "copy", "query", "event-query"])]
    wait: String,
    /// Each launching thread creates a stream of its own instead of using
    /// the default stream
    #[arg(long)]
    own_streams: bool,
    /// Capture this many kernels into a CUDA graph first, as
    /// `torch.cuda.graph` does (a side stream created non-blocking,
    /// warm-up, a global-mode capture while another thread keeps
    /// launching five kernels, synchronising on a stream of its own and
    /// pausing three --capture-pause-ms), then replay
    /// the graph in the launch loop (one launch runs them all)
    #[arg(long, default_value_t = 0)]
    capture: u64,
    /// With --capture: the captured work also allocates this many bytes
    /// with cuMemAllocAsync on the capturing stream and frees them in the
    /// graph (a graph memory node, as PyTorch's cudaMallocAsync backend
    /// makes under torch.cuda.graph); 0: none
    #[arg(long, default_value_t = 0)]
    capture_alloc: u64,
    /// Pause between two captured launches, milliseconds (a capture that
    /// outlasts tokens and idle thresholds)
    #[arg(long, default_value_t = 2.0)]
    capture_pause_ms: f64,
    /// Release threshold of the device's default memory pool, in bytes
    /// or `max` (PyTorch's cudaMallocAsync backend keeps everything)
    #[arg(long)]
    pool_threshold: Option<String>,
    /// Free the memory as soon as it is allocated, then synchronise, before
    /// launching (cuMemGetInfo is asked after that)
    #[arg(long)]
    free_first: bool,
    /// Only say which GPUs the process sees, and exit: for each CUDA
    /// ordinal `cuda ordinal=N uuid=GPU-…`, and for each NVML index
    /// `nvml index=N uuid=GPU-…` or `nvml index=N error=CODE`
    #[arg(long)]
    identify: bool,
    /// Only call the preloaded hook's `gemhook_unwinds` (a panic unwound
    /// through its frames and caught) and exit: 0 where it unwound, 4
    /// where not, 5 without the hook
    #[arg(long)]
    hook_unwinds: bool,
    /// Also ask NVML (libnvidia-ml.so.1, loaded at run time as pynvml
    /// does) for device 0's memory, with nvmlDeviceGetMemoryInfo and _v2
    #[arg(long)]
    nvml: bool,
    /// Ask NVML for device 0's memory before `cuInit` (as vLLM does), with
    /// the driver loaded but not initialised
    #[arg(long)]
    nvml_first: bool,
    /// While launching, a helper thread with no current context (as NCCL's
    /// proxy or a DataLoader's pin-memory thread) keeps calling
    /// cuCtxSynchronize, cuStreamQuery, cuMemGetInfo, cuLaunchKernel and
    /// cuMemAlloc: each must answer CUDA_ERROR_INVALID_CONTEXT at once
    #[arg(long)]
    helper: bool,
    /// While launching, a watchdog thread (as NCCL's, or PyTorch's caching
    /// allocator checking its old events) records one event at the start
    /// and then queries it every this many microseconds (0: none)
    #[arg(long, default_value_t = 0)]
    poll_old_event_us: u64,
    /// End each iteration (or burst) with an allreduce, as an NCCL job
    /// step does: `COMM:RANKS:RANK` (a communicator id, its ranks and this
    /// process's rank; the simulator's `fake_allreduce`, which ends once
    /// every rank has launched its own), launched onto the stream after
    /// the iteration's kernels and before its wait
    #[arg(long)]
    allreduce: Option<String>,
    /// Device time of the allreduce once every rank is there, microseconds
    #[arg(long, default_value_t = 100)]
    allreduce_us: u64,
    /// Join an NCCL communicator first, as a rank of a job does:
    /// `RANK:RANKS:FILE` (rank 0 makes the unique id with ncclGetUniqueId
    /// and writes it to FILE, the others wait up to 10 s for it; each calls
    /// ncclCommInitRank from libnccl.so.2, reached with dlopen and dlsym)
    #[arg(long)]
    nccl_rank: Option<String>,
    /// With --alloc-api create: map each handle into this many address
    /// ranges (cuMemAddressReserve + cuMemMap), as expandable segments do
    #[arg(long, default_value_t = 0)]
    vmm_maps: u32,
    /// Page-locked host memory to allocate with cuMemHostAlloc after the
    /// device memory, e.g. 2GiB (0: none)
    #[arg(long, default_value = "0", value_parser = |s: &str| parse_size::parse_size(s))]
    host_mem: u64,
    /// Export the first allocation through cuIpcGetMemHandle: write the
    /// handle (hex) to this file, then run as usual
    #[arg(long)]
    ipc_export: Option<std::path::PathBuf>,
    /// Open the allocation whose handle another process wrote to this
    /// file (waiting up to 10 s for it) with cuIpcOpenMemHandle
    #[arg(long)]
    ipc_import: Option<std::path::PathBuf>,
    /// A second thread launches as the first does, in a context of its
    /// own (cuCtxCreate) on the same device
    #[arg(long)]
    second_context: bool,
    /// Kernel length of the --second-context thread (default: --kernel-us);
    /// its kernels are not in the report's count
    #[arg(long)]
    second_kernel_us: Option<u64>,
}

/// The driver entry points the workload uses, all from cuGetProcAddress_v2.
struct Driver {
    _lib: libloading::Library,
    init: unsafe extern "C" fn(u32) -> CUresult,
    device_get: unsafe extern "C" fn(*mut i32, i32) -> CUresult,
    primary_retain: unsafe extern "C" fn(*mut Ptr, i32) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(Ptr) -> CUresult,
    /// `cuCtxSynchronize` as asked for at `--cuda-version`: from 13000
    /// on, a 13.x driver hands out `cuCtxSynchronize_v2(ctx)` (NULL: the
    /// current context); an older one, or an older version, the
    /// argument-less one, which ignores the argument.
    ctx_sync: unsafe extern "C" fn(Ptr) -> CUresult,
    /// Whether `ctx_sync` takes its context (`cuCtxSynchronize_v2`).
    ctx_sync_names_ctx: bool,
    module_load: unsafe extern "C" fn(*mut Ptr, *const c_void) -> CUresult,
    get_function: unsafe extern "C" fn(*mut Ptr, Ptr, *const c_char) -> CUresult,
    launch: unsafe extern "C" fn(
        Ptr,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        u32,
        Ptr,
        *mut Ptr,
        *mut Ptr,
    ) -> CUresult,
    launch_ex: unsafe extern "C" fn(*const LaunchConfig, Ptr, *mut Ptr, *mut Ptr) -> CUresult,
    launch_coop:
        unsafe extern "C" fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, *mut Ptr) -> CUresult,
    launch_coop_multi: unsafe extern "C" fn(*mut MultiDeviceParams, u32, u32) -> CUresult,
    ctx_get_current: unsafe extern "C" fn(*mut Ptr) -> CUresult,
    device_get_count: unsafe extern "C" fn(*mut i32) -> CUresult,
    graph_create: unsafe extern "C" fn(*mut Ptr, u32) -> CUresult,
    graph_add_kernel:
        unsafe extern "C" fn(*mut Ptr, Ptr, *const Ptr, usize, *const KernelNodeParams) -> CUresult,
    graph_instantiate: unsafe extern "C" fn(*mut Ptr, Ptr, u64) -> CUresult,
    graph_launch: unsafe extern "C" fn(Ptr, Ptr) -> CUresult,
    mem_alloc: unsafe extern "C" fn(*mut u64, usize) -> CUresult,
    mem_alloc_pitch: unsafe extern "C" fn(*mut u64, *mut usize, usize, usize, u32) -> CUresult,
    mem_alloc_managed: unsafe extern "C" fn(*mut u64, usize, u32) -> CUresult,
    mem_alloc_async: unsafe extern "C" fn(*mut u64, usize, Ptr) -> CUresult,
    mem_free_async: unsafe extern "C" fn(u64, Ptr) -> CUresult,
    mem_create: unsafe extern "C" fn(*mut u64, usize, *const [u32; 8], u64) -> CUresult,
    mem_release: unsafe extern "C" fn(u64) -> CUresult,
    mem_free: unsafe extern "C" fn(u64) -> CUresult,
    mem_get_info: unsafe extern "C" fn(*mut usize, *mut usize) -> CUresult,
    stream_sync: unsafe extern "C" fn(Ptr) -> CUresult,
    stream_query: unsafe extern "C" fn(Ptr) -> CUresult,
    stream_create: unsafe extern "C" fn(*mut Ptr, u32) -> CUresult,
    event_create: unsafe extern "C" fn(*mut Ptr, u32) -> CUresult,
    event_record: unsafe extern "C" fn(Ptr, Ptr) -> CUresult,
    event_sync: unsafe extern "C" fn(Ptr) -> CUresult,
    event_query: unsafe extern "C" fn(Ptr) -> CUresult,
    memcpy_dtoh: unsafe extern "C" fn(*mut c_void, u64, usize) -> CUresult,
    begin_capture: unsafe extern "C" fn(Ptr, u32) -> CUresult,
    ctx_create: unsafe extern "C" fn(*mut Ptr, u32, i32) -> CUresult,
    default_mem_pool: unsafe extern "C" fn(*mut Ptr, i32) -> CUresult,
    address_reserve: unsafe extern "C" fn(*mut u64, usize, usize, u64, u64) -> CUresult,
    mem_map: unsafe extern "C" fn(u64, usize, usize, u64, u64) -> CUresult,
    host_alloc: unsafe extern "C" fn(*mut Ptr, usize, u32) -> CUresult,
    ipc_get: unsafe extern "C" fn(*mut IpcMemHandle, u64) -> CUresult,
    ipc_open: unsafe extern "C" fn(*mut u64, IpcMemHandle, u32) -> CUresult,
    ipc_close: unsafe extern "C" fn(u64) -> CUresult,
    free_host: unsafe extern "C" fn(Ptr) -> CUresult,
    array_create: unsafe extern "C" fn(*mut usize, *const [usize; 3]) -> CUresult,
    array3d_create: unsafe extern "C" fn(*mut usize, *const [usize; 5]) -> CUresult,
    array_destroy: unsafe extern "C" fn(usize) -> CUresult,
    mem_pool_set_attribute: unsafe extern "C" fn(Ptr, i32, *mut c_void) -> CUresult,
    end_capture: unsafe extern "C" fn(Ptr, *mut Ptr) -> CUresult,
}

/// `CUipcMemHandle`: 64 opaque bytes, passed by value.
#[repr(C)]
#[derive(Clone, Copy)]
struct IpcMemHandle([u8; 64]);

/// `CUDA_LAUNCH_PARAMS`.
#[repr(C)]
struct MultiDeviceParams {
    func: Ptr,
    grid: [u32; 3],
    block: [u32; 3],
    shmem: u32,
    stream: Ptr,
    params: *mut Ptr,
}

#[repr(C)]
struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shmem: u32,
    stream: Ptr,
    attrs: Ptr,
    num_attrs: u32,
}

#[repr(C)]
struct KernelNodeParams {
    func: Ptr,
    grid: [u32; 3],
    block: [u32; 3],
    shmem: u32,
    params: *mut Ptr,
    extra: *mut Ptr,
    kern: Ptr,
    ctx: Ptr,
}

fn check(what: &str, r: CUresult) -> anyhow::Result<()> {
    if r != 0 {
        bail!("{what} failed with CUresult {r}");
    }
    Ok(())
}

struct Report {
    /// Result of the `--host-mem` allocation.
    host_error: CUresult,
    /// Result of opening `--ipc-import`'s handle.
    ipc_error: CUresult,
    /// The helper thread's calls, those that did not answer
    /// CUDA_ERROR_INVALID_CONTEXT, and its slowest call (µs).
    helper: Option<(u64, u64, u64)>,
    /// NVML's (free, total) and _v2's (free, total, used), when asked.
    nvml: Option<(u64, u64, u64, u64, u64)>,
    /// With --alloc-free: the median time of a cuMemAlloc and of a
    /// cuMemFree (ns).
    pairs: Option<(u64, u64)>,
    kernels: u64,
    allocated: u64,
    alloc_error: CUresult,
    alloc_start_ns: u64,
    alloc_done_ns: u64,
    free: usize,
    total: usize,
}

fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: a valid, writable timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// `--hook-unwinds`: the preloaded hook's own check that its linked-in
/// unwinder finds its frames.
fn hook_unwinds() -> i32 {
    // SAFETY: a NUL-terminated name looked up in the global scope.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"gemhook_unwinds".as_ptr()) };
    if f.is_null() {
        eprintln!("gemhook_unwinds not found: is libgemhook.so preloaded?");
        return 5;
    }
    // SAFETY: the hook's `extern "C" fn() -> c_int`.
    let unwinds: extern "C" fn() -> std::ffi::c_int = unsafe { std::mem::transmute(f) };
    if unwinds() == 1 { 0 } else { 4 }
}

/// `--identify`: the GPUs this process sees through CUDA and through
/// NVML, by UUID.
fn identify(args: &Args) -> anyhow::Result<()> {
    type Init = unsafe extern "C" fn(u32) -> CUresult;
    type Count = unsafe extern "C" fn(*mut i32) -> CUresult;
    type Uuid = unsafe extern "C" fn(*mut [u8; 16], i32) -> CUresult;
    type NvmlInit = unsafe extern "C" fn() -> u32;
    type NvmlCount = unsafe extern "C" fn(*mut u32) -> u32;
    type NvmlHandle = unsafe extern "C" fn(u32, *mut Ptr) -> u32;
    type NvmlUuid = unsafe extern "C" fn(Ptr, *mut std::ffi::c_char, u32) -> u32;
    // SAFETY: loading the driver and NVML and calling them with their C
    // signatures and pointers to live locals.
    unsafe {
        let cuda = libloading::Library::new(&args.driver)
            .with_context(|| format!("dlopen {}", args.driver))?;
        let init: libloading::Symbol<Init> = cuda.get(b"cuInit\0")?;
        let count: libloading::Symbol<Count> = cuda.get(b"cuDeviceGetCount\0")?;
        let uuid: libloading::Symbol<Uuid> = cuda.get(b"cuDeviceGetUuid_v2\0")?;
        check("cuInit", init(0))?;
        let mut n = 0;
        check("cuDeviceGetCount", count(&mut n))?;
        for i in 0..n {
            let mut u = [0u8; 16];
            check("cuDeviceGetUuid_v2", uuid(&mut u, i))?;
            let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
            println!(
                "cuda ordinal={i} uuid=GPU-{}-{}-{}-{}-{}",
                &h[0..8],
                &h[8..12],
                &h[12..16],
                &h[16..20],
                &h[20..32]
            );
        }
        let nvml =
            libloading::Library::new("libnvidia-ml.so.1").context("dlopen libnvidia-ml.so.1")?;
        let init: libloading::Symbol<NvmlInit> = nvml.get(b"nvmlInit_v2\0")?;
        let count: libloading::Symbol<NvmlCount> = nvml.get(b"nvmlDeviceGetCount_v2\0")?;
        let handle: libloading::Symbol<NvmlHandle> =
            nvml.get(b"nvmlDeviceGetHandleByIndex_v2\0")?;
        let uuid: libloading::Symbol<NvmlUuid> = nvml.get(b"nvmlDeviceGetUUID\0")?;
        check("nvmlInit_v2", init() as CUresult)?;
        let mut n = 0u32;
        check("nvmlDeviceGetCount_v2", count(&mut n) as CUresult)?;
        for i in 0..n {
            let mut h: Ptr = std::ptr::null_mut();
            let r = handle(i, &mut h);
            if r != 0 {
                println!("nvml index={i} error={r}");
                continue;
            }
            let mut buf = [0 as std::ffi::c_char; 96];
            check(
                "nvmlDeviceGetUUID",
                uuid(h, buf.as_mut_ptr(), 96) as CUresult,
            )?;
            let text = std::ffi::CStr::from_ptr(buf.as_ptr()).to_string_lossy();
            println!("nvml index={i} uuid={text}");
        }
    }
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.identify {
        return identify(&args);
    }
    if args.hook_unwinds {
        std::process::exit(hook_unwinds());
    }
    let mut child = None;
    if args.fork {
        // SAFETY: fork before any thread or driver state exists; both
        // processes continue as single-threaded programs.
        match unsafe { libc::fork() } {
            -1 => bail!("fork failed: {}", std::io::Error::last_os_error()),
            0 => {}
            pid => child = Some(pid),
        }
    }
    let start = Instant::now();
    let result = run(&args);
    let role = if args.fork && child.is_none() {
        "child"
    } else {
        "parent"
    };
    let code = match &result {
        Ok(r) => {
            let helper = r.helper.map_or(String::new(), |(n, bad, us)| {
                format!(" helper_calls={n} helper_bad={bad} helper_slowest_us={us}")
            });
            let pairs = r.pairs.map_or(String::new(), |(a, f)| {
                format!(" alloc_pair_p50_ns={a} free_pair_p50_ns={f}")
            });
            let nvml = r.nvml.map_or(String::new(), |(f, t, f2, t2, u2)| {
                format!(" nvml_free={f} nvml_total={t} nvml_v2_free={f2} nvml_v2_total={t2} nvml_v2_used={u2}")
            });
            println!(
                "workload pid={} role={role} kernels={} kernel_us={} seconds={:.3} allocated={} alloc_error={} alloc_start_ns={} alloc_done_ns={} free={} total={} host_error={} ipc_error={}{nvml}{helper}{pairs}",
                std::process::id(),
                r.kernels,
                args.kernel_us,
                start.elapsed().as_secs_f64(),
                r.allocated,
                r.alloc_error,
                r.alloc_start_ns,
                r.alloc_done_ns,
                r.free,
                r.total,
                r.host_error,
                r.ipc_error
            );
            0
        }
        Err(e) => {
            eprintln!("gem-workload: {e:#}");
            1
        }
    };
    if let Some(pid) = child {
        let mut status = 0;
        // SAFETY: waiting for our own child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        if status != 0 {
            std::process::exit(1);
        }
    } else if args.fork {
        std::process::exit(code);
    }
    std::process::exit(code)
}
