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
    /// Kernels per iteration, as a training step queues them; after them
    /// the iteration waits for its work as --wait says, then idles
    /// --gap-ms (0: launch for --burst-ms instead)
    #[arg(long, default_value_t = 0)]
    iter_kernels: u64,
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

/// The exported symbol a dlsym-resolving program asks for.
fn versioned(name: &str, ptsz: bool) -> String {
    let v2 = [
        "cuMemAlloc",
        "cuMemAllocPitch",
        "cuMemFree",
        "cuMemGetInfo",
        "cuArrayCreate",
        "cuArray3DCreate",
        "cuIpcOpenMemHandle",
        "cuCtxCreate",
        "cuEventDestroy",
    ];
    let per_thread = [
        "cuLaunchKernel",
        "cuLaunchKernelEx",
        "cuLaunchCooperativeKernel",
        "cuGraphLaunch",
        "cuMemAllocAsync",
        "cuMemFreeAsync",
        "cuStreamSynchronize",
        "cuStreamQuery",
        "cuEventRecord",
        "cuStreamEndCapture",
    ];
    if name == "cuStreamBeginCapture" {
        format!("{name}_v2{}", if ptsz { "_ptsz" } else { "" })
    } else if name == "cuMemcpyDtoH" {
        format!("{name}_v2{}", if ptsz { "_ptds" } else { "" })
    } else if v2.contains(&name) {
        format!("{name}_v2")
    } else if ptsz && per_thread.contains(&name) {
        format!("{name}_ptsz")
    } else if name == "cuGraphAddKernelNode" {
        "cuGraphAddKernelNode_v2".into()
    } else {
        name.into()
    }
}

type FnGetProc = unsafe extern "C" fn(*const c_char, *mut Ptr, i32, u64, *mut i32) -> CUresult;

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

/// Loads a module in the calling thread's current context and returns
/// its function `name` (the simulator times a kernel by its name).
fn load_kernel(d: &Driver, name: &std::ffi::CStr) -> anyhow::Result<Ptr> {
    let (mut module, mut func): (Ptr, Ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
    // SAFETY: out-pointers to locals and a NUL-terminated name.
    unsafe {
        check(
            "cuModuleLoadData",
            (d.module_load)(&mut module, c"fakecuda".as_ptr() as *const c_void),
        )?;
        check(
            "cuModuleGetFunction",
            (d.get_function)(&mut func, module, name.as_ptr()),
        )?;
    }
    Ok(func)
}

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

/// `--launch-api coop-multi`: on every device, the kernel (loaded in its
/// primary context) and a non-blocking stream there.
fn every_device(d: &Driver) -> anyhow::Result<Vec<(Ptr, Ptr)>> {
    let mut out = Vec::new();
    // SAFETY: driver calls with out-pointers to locals; the thread's
    // current context is put back at the end.
    unsafe {
        let mut current: Ptr = std::ptr::null_mut();
        check("cuCtxGetCurrent", (d.ctx_get_current)(&mut current))?;
        let mut n = 0;
        check("cuDeviceGetCount", (d.device_get_count)(&mut n))?;
        for dev in 0..n {
            let mut ctx: Ptr = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                (d.primary_retain)(&mut ctx, dev),
            )?;
            check("cuCtxSetCurrent", (d.ctx_set_current)(ctx))?;
            let func = load_kernel(d, c"fake_spin")?;
            let mut stream: Ptr = std::ptr::null_mut();
            check("cuStreamCreate", (d.stream_create)(&mut stream, 1))?;
            out.push((func, stream));
        }
        check("cuCtxSetCurrent", (d.ctx_set_current)(current))?;
    }
    Ok(out)
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

impl Driver {
    // Each transmute's target is the field's type: spelled once there.
    #[allow(clippy::missing_transmute_annotations)]
    fn load(args: &Args) -> anyhow::Result<Driver> {
        if let Some(path) = &args.load_lib {
            // SAFETY: a library the test built; its initialisers are its
            // own. Kept loaded for the process's life.
            let lib = unsafe { libloading::Library::new(path) }
                .with_context(|| format!("dlopen {}", path.display()))?;
            std::mem::forget(lib);
        }
        // SAFETY: loading the driver library; its initialisers are the
        // driver's own.
        let lib = if args.deepbind {
            // SAFETY: as above, with the flags of a library that binds
            // its own dependencies first.
            unsafe {
                libloading::os::unix::Library::open(
                    Some(&args.driver),
                    libc::RTLD_NOW | libc::RTLD_LOCAL | libc::RTLD_DEEPBIND,
                )
            }
            .map(libloading::Library::from)
        } else {
            // SAFETY: as above.
            unsafe { libloading::Library::new(&args.driver) }
        }
        .with_context(|| format!("dlopen {}", args.driver))?;
        // SAFETY: the symbol has cuGetProcAddress_v2's C signature.
        let get_proc: FnGetProc = *unsafe { lib.get::<FnGetProc>(b"cuGetProcAddress_v2\0") }?;
        let flags = if args.ptsz { 2 } else { 0 };
        let version = args.cuda_version;
        let by_dlsym = args.resolve == "dlsym";
        let resolve = |name: &str| -> anyhow::Result<Ptr> {
            if by_dlsym {
                let sym = CString::new(versioned(name, args.ptsz))?;
                // SAFETY: looking up a symbol; the pointer is only used as
                // the function it names.
                let p = unsafe { lib.get::<Ptr>(sym.as_bytes_with_nul()) }.map(|s| *s);
                return p.with_context(|| format!("dlsym {sym:?}"));
            }
            let c = CString::new(name)?;
            let mut p: Ptr = std::ptr::null_mut();
            let mut status = -1i32;
            // The workload calls cuCtxCreate with the v2 signature, which
            // the name means up to CUDA 11.3 (11.4 made it v3, 12.5 v4).
            let version = if name == "cuCtxCreate" {
                version.min(11030)
            } else {
                version
            };
            // SAFETY: valid name, out-pointers to locals.
            let r = unsafe { get_proc(c.as_ptr(), &mut p, version, flags, &mut status) };
            if r != 0 || p.is_null() {
                bail!(
                    "cuGetProcAddress_v2({name}, {version}, {flags}) failed: {r}, status {status}"
                );
            }
            Ok(p)
        };
        macro_rules! f {
            ($name:literal) => {
                // SAFETY: the driver returns the entry point of that name,
                // whose C signature the field's type spells out (which is
                // also why the target type is left to inference).
                unsafe { std::mem::transmute::<Ptr, _>(resolve($name)?) }
            };
        }
        Ok(Driver {
            init: f!("cuInit"),
            device_get: f!("cuDeviceGet"),
            primary_retain: f!("cuDevicePrimaryCtxRetain"),
            ctx_set_current: f!("cuCtxSetCurrent"),
            ctx_sync: f!("cuCtxSynchronize"),
            ctx_sync_names_ctx: version >= 13000 && {
                let get: unsafe extern "C" fn(*mut i32) -> CUresult = f!("cuDriverGetVersion");
                let mut v = 0i32;
                // SAFETY: out-pointer to a local.
                (unsafe { get(&mut v) }) == 0 && v >= 13000
            },
            module_load: f!("cuModuleLoadData"),
            get_function: f!("cuModuleGetFunction"),
            launch: f!("cuLaunchKernel"),
            launch_ex: f!("cuLaunchKernelEx"),
            launch_coop: f!("cuLaunchCooperativeKernel"),
            launch_coop_multi: f!("cuLaunchCooperativeKernelMultiDevice"),
            ctx_get_current: f!("cuCtxGetCurrent"),
            device_get_count: f!("cuDeviceGetCount"),
            graph_create: f!("cuGraphCreate"),
            graph_add_kernel: f!("cuGraphAddKernelNode"),
            graph_instantiate: f!("cuGraphInstantiateWithFlags"),
            graph_launch: f!("cuGraphLaunch"),
            mem_alloc: f!("cuMemAlloc"),
            mem_alloc_pitch: f!("cuMemAllocPitch"),
            mem_alloc_managed: f!("cuMemAllocManaged"),
            mem_alloc_async: f!("cuMemAllocAsync"),
            mem_free_async: f!("cuMemFreeAsync"),
            mem_create: f!("cuMemCreate"),
            mem_release: f!("cuMemRelease"),
            mem_free: f!("cuMemFree"),
            mem_get_info: f!("cuMemGetInfo"),
            stream_sync: f!("cuStreamSynchronize"),
            stream_query: f!("cuStreamQuery"),
            stream_create: f!("cuStreamCreate"),
            event_create: f!("cuEventCreate"),
            event_record: f!("cuEventRecord"),
            event_sync: f!("cuEventSynchronize"),
            event_query: f!("cuEventQuery"),
            memcpy_dtoh: f!("cuMemcpyDtoH"),
            begin_capture: f!("cuStreamBeginCapture"),
            ctx_create: f!("cuCtxCreate"),
            default_mem_pool: f!("cuDeviceGetDefaultMemPool"),
            address_reserve: f!("cuMemAddressReserve"),
            mem_map: f!("cuMemMap"),
            host_alloc: f!("cuMemHostAlloc"),
            ipc_get: f!("cuIpcGetMemHandle"),
            ipc_open: f!("cuIpcOpenMemHandle"),
            ipc_close: f!("cuIpcCloseMemHandle"),
            free_host: f!("cuMemFreeHost"),
            array_create: f!("cuArrayCreate"),
            array3d_create: f!("cuArray3DCreate"),
            array_destroy: f!("cuArrayDestroy"),
            mem_pool_set_attribute: f!("cuMemPoolSetAttribute"),
            end_capture: f!("cuStreamEndCapture"),
            _lib: lib,
        })
    }
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

fn run(args: &Args) -> anyhow::Result<Report> {
    let d = Driver::load(args)?;
    let before_init = if args.nvml_first {
        Some(nvml_memory()?)
    } else {
        None
    };
    // SAFETY: all driver calls below get valid handles from the driver
    // and pointers to live locals, per the driver API.
    unsafe {
        check("cuInit", (d.init)(0))?;
        let mut dev = 0;
        check("cuDeviceGet", (d.device_get)(&mut dev, args.device))?;
        let mut ctx: Ptr = std::ptr::null_mut();
        check(
            "cuDevicePrimaryCtxRetain",
            (d.primary_retain)(&mut ctx, dev),
        )?;
        check("cuCtxSetCurrent", (d.ctx_set_current)(ctx))?;
        let func = load_kernel(&d, c"fake_spin")?;

        let mut report = Report {
            host_error: 0,
            ipc_error: 0,
            helper: None,
            nvml: before_init,
            kernels: 0,
            allocated: 0,
            alloc_error: 0,
            alloc_start_ns: monotonic_ns(),
            alloc_done_ns: 0,
            free: 0,
            total: 0,
        };
        if let Some(t) = &args.pool_threshold {
            let mut bytes = if t == "max" {
                u64::MAX
            } else {
                parse_size::parse_size(t).context("--pool-threshold")?
            };
            let mut pool: Ptr = std::ptr::null_mut();
            check(
                "cuDeviceGetDefaultMemPool",
                (d.default_mem_pool)(&mut pool, dev),
            )?;
            // CU_MEMPOOL_ATTR_RELEASE_THRESHOLD = 4, a u64.
            check(
                "cuMemPoolSetAttribute",
                (d.mem_pool_set_attribute)(pool, 4, (&mut bytes as *mut u64).cast()),
            )?;
        }
        let retry_until = Instant::now() + Duration::from_secs_f64(args.retry_alloc_seconds);
        let mut ptrs: Vec<u64> = Vec::new();
        let mut handles: Vec<u64> = Vec::new();
        let mut arrays: Vec<usize> = Vec::new();
        if args.mem > 0 {
            let chunk = args.chunk.unwrap_or(args.mem).max(1);
            while report.allocated < args.mem {
                let n = chunk.min(args.mem - report.allocated) as usize;
                let mut p = 0u64;
                let r = match args.alloc_api.as_str() {
                    "v2" => (d.mem_alloc)(&mut p, n),
                    "pitch" => {
                        let mut pitch = 0usize;
                        (d.mem_alloc_pitch)(&mut p, &mut pitch, 512, n.div_ceil(512), 4)
                    }
                    "managed" => (d.mem_alloc_managed)(&mut p, n, 1),
                    "async" => (d.mem_alloc_async)(&mut p, n, std::ptr::null_mut()),
                    "create" => {
                        let prop: [u32; 8] = [1, 0, 1, dev as u32, 0, 0, 0, 0];
                        let mut r = (d.mem_create)(&mut p, n, &prop, 0);
                        if r == 0 {
                            handles.push(p);
                            for _ in 0..args.vmm_maps {
                                let mut va = 0u64;
                                r = (d.address_reserve)(&mut va, n, 0, 0, 0);
                                if r == 0 {
                                    r = (d.mem_map)(va, n, 0, p, 0);
                                }
                                if r != 0 {
                                    break;
                                }
                            }
                        }
                        r
                    }
                    "array" | "array3d" => {
                        // FLOAT (0x20), 4 channels: 16 bytes per element.
                        let format = 0x20 | (4usize << 32);
                        let mut a = 0usize;
                        let r = if args.alloc_api == "array" {
                            (d.array_create)(&mut a, &[n / 16, 0, format])
                        } else {
                            (d.array3d_create)(&mut a, &[n / 16 / 64, 64, 0, format, 0])
                        };
                        if r == 0 {
                            arrays.push(a);
                        }
                        r
                    }
                    other => bail!("unknown --alloc-api {other}"),
                };
                if r == 2 && Instant::now() < retry_until {
                    std::thread::sleep(Duration::from_millis(10));
                    continue;
                }
                if r != 0 {
                    report.alloc_error = r;
                    break;
                }
                if !["create", "array", "array3d"].contains(&args.alloc_api.as_str()) {
                    ptrs.push(p);
                }
                report.allocated += n as u64;
            }
        }
        report.alloc_done_ns = monotonic_ns();
        if let (Some(path), Some(&p)) = (&args.ipc_export, ptrs.first()) {
            let mut h = IpcMemHandle([0; 64]);
            check("cuIpcGetMemHandle", (d.ipc_get)(&mut h, p))?;
            let hex: String = h.0.iter().map(|b| format!("{b:02x}")).collect();
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, hex).context("writing the IPC handle")?;
            std::fs::rename(&tmp, path).context("writing the IPC handle")?;
        }
        let mut opened = 0u64;
        if let Some(path) = &args.ipc_import {
            let until = Instant::now() + Duration::from_secs(10);
            let hex = loop {
                match std::fs::read_to_string(path) {
                    Ok(t) => break t,
                    Err(_) if Instant::now() < until => {
                        std::thread::sleep(Duration::from_millis(20))
                    }
                    Err(e) => bail!("no IPC handle in {}: {e}", path.display()),
                }
            };
            let mut h = IpcMemHandle([0; 64]);
            for (i, b) in h.0.iter_mut().enumerate() {
                *b = u8::from_str_radix(hex.get(2 * i..2 * i + 2).unwrap_or("00"), 16)?;
            }
            // CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS = 1.
            report.ipc_error = (d.ipc_open)(&mut opened, h, 1);
        }
        let mut host: Ptr = std::ptr::null_mut();
        if args.host_mem > 0 {
            report.host_error = (d.host_alloc)(&mut host, args.host_mem as usize, 0);
        }
        if args.free_first {
            free_all(&d, args, &mut ptrs, &mut handles, &mut arrays)?;
            check("cuCtxSynchronize", (d.ctx_sync)(std::ptr::null_mut()))?;
        }
        check(
            "cuMemGetInfo",
            (d.mem_get_info)(&mut report.free, &mut report.total),
        )?;
        if args.nvml {
            report.nvml = Some(nvml_memory()?);
        }

        let mut dur = args.kernel_us;
        let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
        let mut exec: Ptr = std::ptr::null_mut();
        if args.launch_api == "graph" {
            let mut graph: Ptr = std::ptr::null_mut();
            check("cuGraphCreate", (d.graph_create)(&mut graph, 0))?;
            let node_params = KernelNodeParams {
                func,
                grid: [1, 1, 1],
                block: [1, 1, 1],
                shmem: 0,
                params: params.as_mut_ptr(),
                extra: std::ptr::null_mut(),
                kern: std::ptr::null_mut(),
                ctx: std::ptr::null_mut(),
            };
            let mut node: Ptr = std::ptr::null_mut();
            check(
                "cuGraphAddKernelNode",
                (d.graph_add_kernel)(&mut node, graph, std::ptr::null(), 0, &node_params),
            )?;
            check(
                "cuGraphInstantiate",
                (d.graph_instantiate)(&mut exec, graph, 0),
            )?;
        }
        let mut per_launch = 1;
        if args.capture > 0 {
            let (captured, beside) = capture_graph(&d, args, func, ctx)?;
            exec = captured;
            per_launch = args.capture;
            report.kernels += beside;
        }
        let (f, e, c) = (func as usize, exec as usize, ctx as usize);
        let helping = std::sync::atomic::AtomicBool::new(args.helper);
        let polling = std::sync::atomic::AtomicBool::new(true);
        let helper = std::thread::scope(|scope| {
            let h = args
                .helper
                .then(|| scope.spawn(|| helper_thread(&d, f, &helping)));
            let watchdog = (args.poll_old_event_us > 0)
                .then(|| scope.spawn(|| poll_old_event(&d, c, args.poll_old_event_us, &polling)));
            let second = args.second_context.then(|| {
                scope.spawn(|| -> anyhow::Result<u64> {
                    // The new context becomes this thread's current one; it
                    // gets a module of its own (functions belong to one).
                    let mut own: Ptr = std::ptr::null_mut();
                    check("cuCtxCreate", (d.ctx_create)(&mut own, 0, dev))?;
                    let func = load_kernel(&d, c"fake_spin")?;
                    let mut own_args = args.clone();
                    own_args.kernel_us = args.second_kernel_us.unwrap_or(args.kernel_us);
                    let n = launch_loop(&d, &own_args, func as usize, e, per_launch)?;
                    Ok(if args.second_kernel_us.is_some() {
                        0
                    } else {
                        n
                    })
                })
            });
            let launched = if args.threads <= 1 {
                launch_loop(&d, args, f, e, per_launch)
            } else {
                launch_threads(&d, args, f, e, c, per_launch)
            };
            let launched = match second.map(|h| h.join()) {
                None => launched,
                Some(Ok(n)) => launched.and_then(|a| n.map(|b| a + b)),
                Some(Err(_)) => Err(anyhow::anyhow!("the second context's thread panicked")),
            };
            helping.store(false, std::sync::atomic::Ordering::Release);
            polling.store(false, std::sync::atomic::Ordering::Release);
            let launched = match watchdog.map(|w| w.join()) {
                None => launched,
                Some(Ok(polled)) => launched.and_then(|n| polled.map(|()| n)),
                Some(Err(_)) => Err(anyhow::anyhow!("the watchdog thread panicked")),
            };
            let helped = h
                .map(|h| h.join())
                .transpose()
                .map_err(|_| anyhow::anyhow!("the helper thread panicked"))?;
            launched.map(|n| (n, helped))
        })?;
        report.kernels += helper.0;
        report.helper = helper.1;
        check("cuCtxSynchronize", (d.ctx_sync)(std::ptr::null_mut()))?;
        free_all(&d, args, &mut ptrs, &mut handles, &mut arrays)?;
        if !host.is_null() {
            check("cuMemFreeHost", (d.free_host)(host))?;
        }
        if opened != 0 {
            check("cuIpcCloseMemHandle", (d.ipc_close)(opened))?;
        }
        Ok(report)
    }
}

/// `--threads` launching threads in context `ctx`: the kernels they ran.
fn launch_threads(
    d: &Driver,
    args: &Args,
    func: usize,
    exec: usize,
    ctx: usize,
    per_launch: u64,
) -> anyhow::Result<u64> {
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..args.threads)
            .map(|_| {
                scope.spawn(move || {
                    // SAFETY: the process's context.
                    check("cuCtxSetCurrent", unsafe {
                        (d.ctx_set_current)(ctx as Ptr)
                    })?;
                    launch_loop(d, args, func, exec, per_launch)
                })
            })
            .collect();
        let mut total = 0;
        for h in handles {
            total += h
                .join()
                .map_err(|_| anyhow::anyhow!("launch thread panicked"))??;
        }
        anyhow::Ok(total)
    })
}

/// `--poll-old-event-us`: in context `ctx`, records an event once, waits
/// for it, then queries that old event every `every_us` while `on`.
fn poll_old_event(
    d: &Driver,
    ctx: usize,
    every_us: u64,
    on: &std::sync::atomic::AtomicBool,
) -> anyhow::Result<()> {
    let mut event: Ptr = std::ptr::null_mut();
    // SAFETY: the process's context, and an out-pointer to a local; the
    // event lives until this thread ends.
    unsafe {
        check("cuCtxSetCurrent", (d.ctx_set_current)(ctx as Ptr))?;
        check("cuEventCreate", (d.event_create)(&mut event, 0))?;
        check(
            "cuEventRecord",
            (d.event_record)(event, std::ptr::null_mut()),
        )?;
        check("cuEventSynchronize", (d.event_sync)(event))?;
        while on.load(std::sync::atomic::Ordering::Acquire) {
            check("cuEventQuery (an old event)", (d.event_query)(event))?;
            std::thread::sleep(Duration::from_micros(every_us));
        }
    }
    Ok(())
}

/// `--helper`: calls from a thread with no current context while `on`:
/// (calls, calls not answered CUDA_ERROR_INVALID_CONTEXT, slowest µs).
fn helper_thread(d: &Driver, func: usize, on: &std::sync::atomic::AtomicBool) -> (u64, u64, u64) {
    const CUDA_ERROR_INVALID_CONTEXT: CUresult = 201;
    let (mut calls, mut bad, mut slowest) = (0u64, 0u64, 0u64);
    let null = std::ptr::null_mut();
    while on.load(std::sync::atomic::Ordering::Acquire) {
        let (mut free, mut total, mut p) = (0usize, 0usize, 0u64);
        // SAFETY: driver calls with out-pointers to locals and no context
        // (each must fail cleanly).
        let answers = unsafe {
            [
                time_us(|| (d.ctx_sync)(std::ptr::null_mut())),
                time_us(|| (d.stream_query)(null)),
                time_us(|| (d.mem_get_info)(&mut free, &mut total)),
                time_us(|| {
                    (d.launch)(
                        func as Ptr,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        null,
                        null.cast(),
                        null.cast(),
                    )
                }),
                time_us(|| (d.mem_alloc)(&mut p, 1 << 20)),
            ]
        };
        for (i, (r, us)) in answers.into_iter().enumerate() {
            calls += 1;
            if r != CUDA_ERROR_INVALID_CONTEXT {
                bad += 1;
                if bad == 1 {
                    eprintln!(
                        "gem-workload: helper call {i} answered {r}, not CUDA_ERROR_INVALID_CONTEXT"
                    );
                }
            }
            slowest = slowest.max(us);
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    (calls, bad, slowest)
}

/// The result of `call` and how long it took, µs.
fn time_us(call: impl FnOnce() -> CUresult) -> (CUresult, u64) {
    let t = Instant::now();
    let r = call();
    (r, t.elapsed().as_micros() as u64)
}

/// Frees what was allocated (and forgets it).
fn free_all(
    d: &Driver,
    args: &Args,
    ptrs: &mut Vec<u64>,
    handles: &mut Vec<u64>,
    arrays: &mut Vec<usize>,
) -> anyhow::Result<()> {
    // SAFETY: pointers and handles this process allocated, freed once.
    unsafe {
        for p in ptrs.drain(..) {
            if args.alloc_api == "async" {
                check(
                    "cuMemFreeAsync",
                    (d.mem_free_async)(p, std::ptr::null_mut()),
                )?;
            } else {
                check("cuMemFree", (d.mem_free)(p))?;
            }
        }
        for h in handles.drain(..) {
            check("cuMemRelease", (d.mem_release)(h))?;
        }
        for a in arrays.drain(..) {
            check("cuArrayDestroy", (d.array_destroy)(a))?;
        }
    }
    Ok(())
}

/// Device 0's memory as NVML tells it: (free, total) from
/// `nvmlDeviceGetMemoryInfo`, (free, total, used) from `_v2`.
fn nvml_memory() -> anyhow::Result<(u64, u64, u64, u64, u64)> {
    type Init = unsafe extern "C" fn() -> u32;
    type Handle = unsafe extern "C" fn(u32, *mut Ptr) -> u32;
    type Mem = unsafe extern "C" fn(Ptr, *mut [u64; 3]) -> u32;
    type MemV2 = unsafe extern "C" fn(Ptr, *mut [u64; 5]) -> u32;
    // SAFETY: loading NVML and calling it with its C signatures and
    // pointers to live locals.
    unsafe {
        let lib =
            libloading::Library::new("libnvidia-ml.so.1").context("dlopen libnvidia-ml.so.1")?;
        let init: libloading::Symbol<Init> = lib.get(b"nvmlInit_v2\0")?;
        let handle: libloading::Symbol<Handle> = lib.get(b"nvmlDeviceGetHandleByIndex_v2\0")?;
        let mem: libloading::Symbol<Mem> = lib.get(b"nvmlDeviceGetMemoryInfo\0")?;
        let mem_v2: libloading::Symbol<MemV2> = lib.get(b"nvmlDeviceGetMemoryInfo_v2\0")?;
        check("nvmlInit_v2", init())?;
        let mut dev: Ptr = std::ptr::null_mut();
        check("nvmlDeviceGetHandleByIndex_v2", handle(0, &mut dev))?;
        let mut m = [0u64; 3]; // total, free, used
        check("nvmlDeviceGetMemoryInfo", mem(dev, &mut m))?;
        // version (nvmlMemory_v2: size 40, version 2), total, reserved, free, used
        let mut v2 = [40u64 | (2 << 24), 0, 0, 0, 0];
        check("nvmlDeviceGetMemoryInfo_v2", mem_v2(dev, &mut v2))?;
        Ok((m[1], m[0], v2[3], v2[1], v2[4]))
    }
}

/// `CU_STREAM_NON_BLOCKING`: PyTorch's streams do not synchronise with
/// the legacy default stream.
const NON_BLOCKING: u32 = 1;

/// Captures `--capture` kernels into a graph the way `torch.cuda.graph`
/// does, while another thread keeps launching and synchronising on a
/// stream of its own; returns the instantiated graph and the kernels the
/// other thread ran.
fn capture_graph(d: &Driver, args: &Args, func: Ptr, ctx: Ptr) -> anyhow::Result<(Ptr, u64)> {
    use std::sync::atomic::{AtomicBool, Ordering};
    const GLOBAL: u32 = 0;
    let mut dur = args.kernel_us;
    let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
    let func = func as usize; // shared with the thread beside the capture
    let launch = |stream: Ptr, params: &mut [Ptr; 1]| {
        // SAFETY: a function of this context, its one parameter.
        let r = unsafe {
            (d.launch)(
                func as Ptr,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                stream,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        check("cuLaunchKernel", r)
    };
    let mut side: Ptr = std::ptr::null_mut();
    // SAFETY: out-pointer to a local.
    check("cuStreamCreate", unsafe {
        (d.stream_create)(&mut side, NON_BLOCKING)
    })?;
    // Warm-up on the side stream, then wait for it.
    for _ in 0..3 {
        launch(side, &mut params)?;
    }
    // SAFETY: a stream of this context.
    check("cuStreamSynchronize", unsafe { (d.stream_sync)(side) })?;
    let done = AtomicBool::new(false);
    let (ctx, side_h) = (ctx as usize, side as usize);
    std::thread::scope(|scope| {
        let other = scope.spawn(|| -> anyhow::Result<u64> {
            let mut dur = args.kernel_us;
            let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
            let mut own: Ptr = std::ptr::null_mut();
            let mut n = 0;
            // SAFETY: the process's context; out-pointer to a local; the
            // stream is this thread's own.
            unsafe {
                check("cuCtxSetCurrent", (d.ctx_set_current)(ctx as Ptr))?;
                check("cuStreamCreate", (d.stream_create)(&mut own, NON_BLOCKING))?;
                while !done.load(Ordering::Acquire) {
                    for _ in 0..5 {
                        launch(own, &mut params)?;
                        n += 1;
                    }
                    check(
                        "cuStreamSynchronize (beside a capture)",
                        (d.stream_sync)(own),
                    )?;
                    // Quiet a while: the hook's idle watcher may fire.
                    std::thread::sleep(Duration::from_secs_f64(3.0 * args.capture_pause_ms / 1e3));
                }
            }
            Ok(n)
        });
        let side = side_h as Ptr;
        let captured = (|| -> anyhow::Result<Ptr> {
            // SAFETY: a stream of this context; out-pointers to locals.
            unsafe {
                check("cuStreamBeginCapture", (d.begin_capture)(side, GLOBAL))?;
                let mut scratch = 0u64;
                if args.capture_alloc > 0 {
                    check(
                        "cuMemAllocAsync (captured)",
                        (d.mem_alloc_async)(&mut scratch, args.capture_alloc as usize, side),
                    )?;
                }
                for _ in 0..args.capture {
                    launch(side, &mut params)?;
                    std::thread::sleep(Duration::from_secs_f64(args.capture_pause_ms / 1e3));
                }
                if scratch != 0 {
                    check(
                        "cuMemFreeAsync (captured)",
                        (d.mem_free_async)(scratch, side),
                    )?;
                }
                let mut graph: Ptr = std::ptr::null_mut();
                check("cuStreamEndCapture", (d.end_capture)(side, &mut graph))?;
                let mut exec: Ptr = std::ptr::null_mut();
                check(
                    "cuGraphInstantiate",
                    (d.graph_instantiate)(&mut exec, graph, 0),
                )?;
                Ok(exec)
            }
        })();
        done.store(true, Ordering::Release);
        let beside = other
            .join()
            .map_err(|_| anyhow::anyhow!("the thread beside the capture panicked"))?;
        Ok((captured?, beside?))
    })
}

/// What one launching thread waits with at the end of a burst or
/// iteration.
struct Wait<'a> {
    d: &'a Driver,
    how: &'a str,
    stream: Ptr,
    event: Ptr,
    /// Device buffer a blocking copy reads from.
    buf: u64,
}

impl<'a> Wait<'a> {
    /// Creates what `how` needs on this thread (a stream of its own when
    /// asked, an event, a small device buffer).
    fn new(d: &'a Driver, args: &'a Args) -> anyhow::Result<Wait<'a>> {
        let mut w = Wait {
            d,
            how: &args.wait,
            stream: std::ptr::null_mut(),
            event: std::ptr::null_mut(),
            buf: 0,
        };
        // SAFETY: driver calls with out-pointers to live fields.
        unsafe {
            if args.own_streams {
                check("cuStreamCreate", (d.stream_create)(&mut w.stream, 0))?;
            }
            if w.how.starts_with("event") {
                check("cuEventCreate", (d.event_create)(&mut w.event, 0))?;
            }
            if w.how == "copy" {
                check("cuMemAlloc", (d.mem_alloc)(&mut w.buf, 64))?;
            }
        }
        Ok(w)
    }

    /// Blocks until the thread's work is done, the way `how` says.
    fn wait(&self) -> anyhow::Result<()> {
        let d = self.d;
        // SAFETY: handles from the driver and a live host buffer.
        unsafe {
            match self.how {
                "ctx" if d.ctx_sync_names_ctx => {
                    // As a CUDA 13 program may: the context named, from a
                    // thread where it is not current.
                    let mut ctx: Ptr = std::ptr::null_mut();
                    check("cuCtxGetCurrent", (d.ctx_get_current)(&mut ctx))?;
                    check("cuCtxSetCurrent", (d.ctx_set_current)(std::ptr::null_mut()))?;
                    let r = (d.ctx_sync)(ctx);
                    check("cuCtxSetCurrent", (d.ctx_set_current)(ctx))?;
                    check("cuCtxSynchronize", r)
                }
                "ctx" => check("cuCtxSynchronize", (d.ctx_sync)(std::ptr::null_mut())),
                "event" => {
                    check("cuEventRecord", (d.event_record)(self.event, self.stream))?;
                    check("cuEventSynchronize", (d.event_sync)(self.event))
                }
                "copy" => {
                    let mut host = [0u8; 64];
                    check(
                        "cuMemcpyDtoH",
                        (d.memcpy_dtoh)(host.as_mut_ptr() as *mut c_void, self.buf, 64),
                    )
                }
                "query" => spin("cuStreamQuery", || (d.stream_query)(self.stream)),
                "event-query" => {
                    check("cuEventRecord", (d.event_record)(self.event, self.stream))?;
                    spin("cuEventQuery", || (d.event_query)(self.event))
                }
                _ => check("cuStreamSynchronize", (d.stream_sync)(self.stream)),
            }
        }
    }
}

impl Drop for Wait<'_> {
    fn drop(&mut self) {
        if self.buf != 0 {
            // SAFETY: a pointer this thread allocated and no longer uses.
            unsafe { (self.d.mem_free)(self.buf) };
        }
    }
}

/// Calls `query` until it stops answering `CUDA_ERROR_NOT_READY`.
fn spin(what: &str, query: impl Fn() -> CUresult) -> anyhow::Result<()> {
    const CUDA_ERROR_NOT_READY: CUresult = 600;
    loop {
        match query() {
            CUDA_ERROR_NOT_READY => std::hint::spin_loop(),
            r => return check(what, r),
        }
    }
}

/// Launches for `--seconds` in bursts (or iterations of `--iter-kernels`);
/// returns the number of kernels run (`per_launch` per graph launch).
fn launch_loop(
    d: &Driver,
    args: &Args,
    func: usize,
    exec: usize,
    per_launch: u64,
) -> anyhow::Result<u64> {
    let func = func as Ptr;
    let exec = exec as Ptr;
    let mut dur = args.kernel_us;
    let mut params: [Ptr; 1] = [&mut dur as *mut u64 as Ptr];
    let mut kernels = 0u64;
    let waiter = Wait::new(d, args)?;
    let stream = waiter.stream;
    let multi = if args.launch_api == "coop-multi" {
        every_device(d)?
    } else {
        Vec::new()
    };
    let allreduce = args
        .allreduce
        .as_deref()
        .map(|spec| Allreduce::new(d, spec))
        .transpose()?;
    // SAFETY: driver calls with handles from the driver and pointers to
    // live locals, per the driver API.
    unsafe {
        let config = LaunchConfig {
            grid: [1, 1, 1],
            block: [1, 1, 1],
            shmem: 0,
            stream,
            attrs: std::ptr::null_mut(),
            num_attrs: 0,
        };
        let end = Instant::now() + Duration::from_secs_f64(args.seconds);
        let mut bursts = Vec::new();
        let mut demand = Vec::new();
        let mut step = 0u64;
        while match &allreduce {
            // The ranks of a communicator make the same number of steps
            // (a rank whose peer has left would wait for it for ever).
            Some(a) => a.go_on(step, Instant::now() < end)?,
            None => Instant::now() < end,
        } {
            step += 1;
            let start = monotonic_ns();
            bursts.push(start);
            let burst_end = if args.burst_ms > 0.0 {
                Instant::now() + Duration::from_secs_f64(args.burst_ms / 1e3)
            } else {
                end
            };
            let mut launched = 0u64;
            while if args.iter_kernels > 0 {
                launched < args.iter_kernels
            } else {
                Instant::now() < burst_end.min(end)
            } {
                let r = match args.launch_api.as_str() {
                    _ if args.capture > 0 => (d.graph_launch)(exec, stream),
                    "kernel" => (d.launch)(
                        func,
                        1,
                        1,
                        1,
                        1,
                        1,
                        1,
                        0,
                        stream,
                        params.as_mut_ptr(),
                        std::ptr::null_mut(),
                    ),
                    "ex" => (d.launch_ex)(&config, func, params.as_mut_ptr(), std::ptr::null_mut()),
                    "coop" => {
                        (d.launch_coop)(func, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr())
                    }
                    "graph" => (d.graph_launch)(exec, stream),
                    "coop-multi" => {
                        let mut list: Vec<MultiDeviceParams> = multi
                            .iter()
                            .map(|&(func, stream)| MultiDeviceParams {
                                func,
                                grid: [1, 1, 1],
                                block: [1, 1, 1],
                                shmem: 0,
                                stream,
                                params: params.as_mut_ptr(),
                            })
                            .collect();
                        (d.launch_coop_multi)(list.as_mut_ptr(), list.len() as u32, 0)
                    }
                    other => bail!("unknown --launch-api {other}"),
                };
                if r != 0 {
                    bail!("{} launch failed with CUresult {r}", args.launch_api);
                }
                kernels += if args.launch_api == "graph" || args.capture > 0 {
                    per_launch
                } else {
                    1
                };
                launched += 1;
            }
            if let Some(a) = &allreduce {
                a.launch(d, stream, args.allreduce_us)?;
            }
            for &(_, s) in &multi {
                check("cuStreamSynchronize", (d.stream_sync)(s))?;
            }
            waiter.wait()?;
            demand.push((start, monotonic_ns()));
            if args.gap_ms > 0.0 && Instant::now() < end {
                std::thread::sleep(
                    Duration::from_secs_f64(args.gap_ms / 1e3)
                        .min(end.saturating_duration_since(Instant::now())),
                );
            }
        }
        if let Some(path) = &args.bursts_file {
            let text: String = bursts.iter().map(|t| format!("{t}\n")).collect();
            std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))?;
        }
        if let Some(path) = &args.demand_file {
            use std::io::Write as _;
            let text: String = demand.iter().map(|(a, b)| format!("{a} {b}\n")).collect();
            // One write on an O_APPEND file: threads never interleave lines.
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .and_then(|mut f| f.write_all(text.as_bytes()))
                .with_context(|| format!("writing {}", path.display()))?;
        }
    }
    Ok(kernels)
}

/// `--allreduce COMM:RANKS:RANK`.
struct Allreduce {
    comm: u64,
    ranks: u32,
    rank: u32,
    /// `fake_allreduce`.
    func: usize,
}

impl Allreduce {
    fn new(d: &Driver, spec: &str) -> anyhow::Result<Allreduce> {
        let parts: Vec<&str> = spec.split(':').collect();
        let [comm, ranks, rank] = parts[..] else {
            bail!("--allreduce {spec}: expected COMM:RANKS:RANK");
        };
        let n = |what: &str, v: &str| -> anyhow::Result<u64> {
            v.parse()
                .with_context(|| format!("--allreduce {spec}: {what} {v:?} is not a number"))
        };
        let func = load_kernel(d, c"fake_allreduce")?;
        Ok(Allreduce {
            comm: n("communicator", comm)?,
            ranks: n("ranks", ranks)? as u32,
            rank: n("rank", rank)? as u32,
            func: func as usize,
        })
    }

    /// Whether to make step `done + 1`, `time_left` as this rank sees it.
    /// Rank 0 decides when to stop and writes the last step to a file
    /// beside the simulator's state (`FAKECUDA_DIR`): two steps on, which
    /// every rank can still reach (none is more than one allreduce ahead
    /// of another); the others stop there.
    fn go_on(&self, done: u64, time_left: bool) -> anyhow::Result<bool> {
        let dir = std::env::var_os("FAKECUDA_DIR")
            .map(std::path::PathBuf::from)
            .unwrap_or_else(std::env::temp_dir);
        let path = dir.join(format!("allreduce-{}.last", self.comm));
        let last = std::fs::read_to_string(&path)
            .ok()
            .and_then(|t| t.trim().parse::<u64>().ok());
        if let Some(last) = last {
            return Ok(done < last);
        }
        if self.rank == 0 && !time_left {
            let tmp = dir.join(format!("allreduce-{}.{}", self.comm, std::process::id()));
            std::fs::write(&tmp, (done + 2).to_string())
                .and_then(|()| std::fs::rename(&tmp, &path))
                .with_context(|| format!("writing {}", path.display()))?;
            return Ok(true);
        }
        Ok(true)
    }

    /// Launches this rank's allreduce onto `stream`.
    fn launch(&self, d: &Driver, stream: Ptr, us: u64) -> anyhow::Result<()> {
        let (mut comm, mut ranks, mut rank, mut us) = (self.comm, self.ranks, self.rank, us);
        let func = self.func as Ptr;
        // SAFETY: the function loaded in `new`, and the four parameters
        // the simulator's collective takes.
        unsafe {
            let mut params: [Ptr; 4] = [
                (&raw mut comm).cast(),
                (&raw mut ranks).cast(),
                (&raw mut rank).cast(),
                (&raw mut us).cast(),
            ];
            let null = std::ptr::null_mut();
            check(
                "cuLaunchKernel (allreduce)",
                (d.launch)(func, 1, 1, 1, 1, 1, 1, 0, stream, params.as_mut_ptr(), null),
            )
        }
    }
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
            let nvml = r.nvml.map_or(String::new(), |(f, t, f2, t2, u2)| {
                format!(" nvml_free={f} nvml_total={t} nvml_v2_free={f2} nvml_v2_total={t2} nvml_v2_used={u2}")
            });
            println!(
                "workload pid={} role={role} kernels={} kernel_us={} seconds={:.3} allocated={} alloc_error={} alloc_start_ns={} alloc_done_ns={} free={} total={} host_error={} ipc_error={}{nvml}{helper}",
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
