//! `gem-memwork`: programs that take device memory the ways real
//! libraries do, for the memory tests. It reaches the driver as the CUDA
//! runtime does (`dlopen("libcuda.so.1")`, every entry point through
//! `cuGetProcAddress_v2` at CUDA 12.8), prints `memwork key=value ...`
//! lines, and where it prints `memwork step=NAME` it waits for a line on
//! standard input before going on, so that a test can look at the
//! scheduler and the simulator while it holds its memory.
//!
//! Scenarios:
//! - `vmm`: llama.cpp's and Ollama's VMM pool: one address range, each
//!   `cuMemCreate` handle mapped into it and released right after; then
//!   every mapping unmapped.
//! - `context`: a context (primary, or `--create`d), a larger `malloc`
//!   heap (`cuCtxSetLimit`), a module of `--module` bytes, then
//!   allocations of `--chunk` until the driver or the group refuses.
//! - `host`: NCCL's host buffers (`cuMemCreate` on a host NUMA node, a
//!   pool of host memory) beside device memory.
//! - `stream-device`: `cuMemAllocAsync` on a stream of device 1 while
//!   device 0's context is current.
//! - `graph`: a graph with a memory node, instantiated through
//!   `cuGetProcAddress("cuGraphInstantiate", --version)`, then launched.
//! - `stress`: threads of random allocations, frees, stream-ordered
//!   allocations on several streams and devices, VMM handles, host NUMA
//!   handles and pool trims, for `--seconds`.

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand};
use std::ffi::{CString, c_char, c_void};
use std::io::BufRead;
use std::time::{Duration, Instant};

type Ptr = *mut c_void;
type CUresult = i32;
const OUT_OF_MEMORY: CUresult = 2;

#[derive(Parser, Debug)]
#[command(about = "Takes device memory the ways real libraries do (see the module doc)")]
struct Args {
    #[command(subcommand)]
    what: What,
}

#[derive(Subcommand, Debug)]
enum What {
    /// Handles of `--handle` bytes, each mapped then released, `--count`
    /// of them; then all unmapped.
    Vmm {
        #[arg(long, value_parser = size)]
        handle: u64,
        #[arg(long)]
        count: u64,
    },
    /// A context, its heap, a module, then allocations until refused.
    Context {
        /// `cuCtxCreate` instead of retaining the primary context.
        #[arg(long)]
        create: bool,
        /// `cuCtxSetLimit(CU_LIMIT_MALLOC_HEAP_SIZE)` to this.
        #[arg(long, value_parser = size)]
        heap: Option<u64>,
        /// A module whose image says it is this large.
        #[arg(long, value_parser = size)]
        module: Option<u64>,
        /// Allocation size.
        #[arg(long, value_parser = size, default_value = "64MiB")]
        chunk: u64,
        /// Stop allocating at this many bytes.
        #[arg(long, value_parser = size, default_value = "1TiB")]
        most: u64,
    },
    /// `--host` bytes on host NUMA node 0 (a handle, and a host pool),
    /// and `--device` bytes of device memory.
    Host {
        #[arg(long, value_parser = size)]
        host: u64,
        #[arg(long, value_parser = size)]
        device: u64,
    },
    /// `--bytes` from the pool of device 1 through a stream of device 1,
    /// with device 0's context current.
    StreamDevice {
        #[arg(long, value_parser = size)]
        bytes: u64,
    },
    /// A graph allocating `--bytes`, instantiated as `cuGraphInstantiate`
    /// at `--version`, launched `--launches` times.
    Graph {
        #[arg(long, value_parser = size)]
        bytes: u64,
        #[arg(long)]
        version: i32,
    },
    /// Holds `--bytes` of device memory, then asks NVML (as `nvidia-smi`
    /// does) which processes use GPU 0 and how busy it is.
    Nvml {
        #[arg(long, value_parser = size, default_value = "64MiB")]
        bytes: u64,
    },
    /// Kernels and graphs in a primary context released to nothing, in
    /// one retained again and reset, and in one made and destroyed, with
    /// a pause after each (PyTorch's and the runtime's teardown).
    Contexts,
    /// `--iterations` times: a kernel, a wait, a pause of 0 to 10 ms (the
    /// hook's idle watcher settles the token meanwhile), then a global
    /// capture of a kernel; counts the captures the driver invalidated.
    CaptureRace {
        #[arg(long, default_value_t = 1000)]
        iterations: u64,
    },
    /// Random memory traffic on `--threads` threads for `--seconds`.
    Stress {
        #[arg(long, default_value_t = 16)]
        threads: u64,
        #[arg(long, default_value_t = 10.0)]
        seconds: f64,
        /// Devices to spread streams over (0..N).
        #[arg(long, default_value_t = 1)]
        devices: i32,
        /// Only these kinds of operation (0-8; default all): 0/1 alloc
        /// and free, 2/3 stream-ordered, 4/5 VMM map and unmap, 6 host
        /// NUMA, 7 pool trim, 8 stream synchronisation.
        #[arg(long, value_delimiter = ',')]
        ops: Vec<u64>,
        /// Every allocation this size (default: 0.5 to 16 MiB at random),
        /// so that each free's address is the next allocation's.
        #[arg(long, value_parser = size)]
        size: Option<u64>,
    },
}

fn size(s: &str) -> Result<u64, String> {
    parse_size::parse_size(s).map_err(|e| e.to_string())
}

/// The driver, reached through `cuGetProcAddress_v2`.
struct Cuda {
    _lib: libloading::Library,
    get: unsafe extern "C" fn(*const c_char, *mut Ptr, i32, u64, *mut i32) -> CUresult,
}

impl Cuda {
    fn load() -> anyhow::Result<Cuda> {
        // SAFETY: the driver library's initialisers are its own.
        let lib =
            unsafe { libloading::Library::new("libcuda.so.1") }.context("dlopen libcuda.so.1")?;
        // SAFETY: cuGetProcAddress_v2's C signature.
        let get = *unsafe {
            lib.get::<unsafe extern "C" fn(*const c_char, *mut Ptr, i32, u64, *mut i32) -> CUresult>(
                b"cuGetProcAddress_v2\0",
            )
        }?;
        Ok(Cuda { _lib: lib, get })
    }

    /// The entry point `name` at `version`.
    fn at(&self, name: &str, version: i32) -> anyhow::Result<Ptr> {
        let c = CString::new(name)?;
        let (mut p, mut status): (Ptr, i32) = (std::ptr::null_mut(), 0);
        // SAFETY: a NUL-terminated name and out-pointers to locals.
        let r = unsafe { (self.get)(c.as_ptr(), &mut p, version, 0, &mut status) };
        if r != 0 || p.is_null() {
            bail!("cuGetProcAddress({name}, {version}) failed: {r}");
        }
        Ok(p)
    }

    /// The entry point `name` at CUDA 12.8, as type `F`.
    fn f<F: Copy>(&self, name: &str) -> anyhow::Result<F> {
        let p = self.at(name, 12080)?;
        // SAFETY: the caller names F as the C signature of `name`; F is a
        // function pointer.
        Ok(unsafe { std::mem::transmute_copy::<Ptr, F>(&p) })
    }
}

macro_rules! call {
    ($cuda:expr, $name:literal, fn($($t:ty),*) $(, $a:expr)*) => {{
        let f: unsafe extern "C" fn($($t),*) -> CUresult = $cuda.f($name)?;
        // SAFETY: the arguments are valid for the named entry point.
        unsafe { f($($a),*) }
    }};
}

fn check(what: &str, r: CUresult) -> anyhow::Result<()> {
    if r != 0 {
        bail!("{what} failed: {r}");
    }
    Ok(())
}

/// Says `memwork step=NAME` and waits for a line on standard input.
fn step(name: &str) {
    println!("memwork step={name}");
    let mut line = String::new();
    let _ = std::io::stdin().lock().read_line(&mut line);
}

/// Initialises the driver and makes the primary context of `dev` current.
fn start(cuda: &Cuda, dev: i32) -> anyhow::Result<Ptr> {
    check("cuInit", call!(cuda, "cuInit", fn(u32), 0))?;
    let mut ctx: Ptr = std::ptr::null_mut();
    check(
        "cuDevicePrimaryCtxRetain",
        call!(
            cuda,
            "cuDevicePrimaryCtxRetain",
            fn(*mut Ptr, i32),
            &mut ctx,
            dev
        ),
    )?;
    check(
        "cuCtxSetCurrent",
        call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx),
    )?;
    Ok(ctx)
}

/// `CUmemAllocationProp`'s leading fields: pinned, no handle types, a
/// location (type, id).
fn prop(kind: u32, id: u32) -> [u32; 8] {
    [1, 0, kind, id, 0, 0, 0, 0]
}
const DEVICE: u32 = 1;
const HOST_NUMA: u32 = 3;

fn free_total(cuda: &Cuda) -> anyhow::Result<(usize, usize)> {
    let (mut f, mut t) = (0usize, 0usize);
    check(
        "cuMemGetInfo",
        call!(
            cuda,
            "cuMemGetInfo",
            fn(*mut usize, *mut usize),
            &mut f,
            &mut t
        ),
    )?;
    Ok((f, t))
}

fn vmm(cuda: &Cuda, handle: u64, count: u64) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let mut va = 0u64;
    check(
        "cuMemAddressReserve",
        call!(
            cuda,
            "cuMemAddressReserve",
            fn(*mut u64, usize, usize, u64, u64),
            &mut va,
            (handle * count) as usize,
            0,
            0,
            0
        ),
    )?;
    let p = prop(DEVICE, 0);
    let mut mapped = 0u64;
    let mut error = 0;
    for i in 0..count {
        let mut h = 0u64;
        let r = call!(
            cuda,
            "cuMemCreate",
            fn(*mut u64, usize, *const [u32; 8], u64),
            &mut h,
            handle as usize,
            &p,
            0
        );
        if r != 0 {
            error = r;
            break;
        }
        check(
            "cuMemMap",
            call!(
                cuda,
                "cuMemMap",
                fn(u64, usize, usize, u64, u64),
                va + i * handle,
                handle as usize,
                0,
                h,
                0
            ),
        )?;
        // As llama.cpp: the mapping keeps the memory; the handle goes.
        check("cuMemRelease", call!(cuda, "cuMemRelease", fn(u64), h))?;
        mapped += handle;
    }
    println!("memwork mapped={mapped} error={error}");
    step("mapped");
    if mapped > 0 {
        check(
            "cuMemUnmap",
            call!(cuda, "cuMemUnmap", fn(u64, usize), va, mapped as usize),
        )?;
    }
    println!("memwork unmapped={mapped}");
    step("unmapped");
    Ok(())
}

fn context(
    cuda: &Cuda,
    create: bool,
    heap: Option<u64>,
    module: Option<u64>,
    chunk: u64,
    most: u64,
) -> anyhow::Result<()> {
    check("cuInit", call!(cuda, "cuInit", fn(u32), 0))?;
    let mut ctx: Ptr = std::ptr::null_mut();
    let r = if create {
        // The v2 signature, which the name means up to CUDA 11.3.
        let at = cuda.at("cuCtxCreate", 11030)?;
        // SAFETY: cuCtxCreate_v2's signature.
        let f: unsafe extern "C" fn(*mut Ptr, u32, i32) -> CUresult =
            unsafe { std::mem::transmute(at) };
        // SAFETY: an out-pointer to a local.
        unsafe { f(&mut ctx, 0, 0) }
    } else {
        call!(
            cuda,
            "cuDevicePrimaryCtxRetain",
            fn(*mut Ptr, i32),
            &mut ctx,
            0
        )
    };
    println!("memwork context={r}");
    if r != 0 {
        step("refused");
        return Ok(());
    }
    if !create {
        check(
            "cuCtxSetCurrent",
            call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx),
        )?;
    }
    if let Some(h) = heap {
        // CU_LIMIT_MALLOC_HEAP_SIZE = 2.
        let r = call!(cuda, "cuCtxSetLimit", fn(i32, usize), 2, h as usize);
        let mut now = 0usize;
        check(
            "cuCtxGetLimit",
            call!(cuda, "cuCtxGetLimit", fn(*mut usize, i32), &mut now, 2),
        )?;
        println!("memwork heap_error={r} heap={now}");
    }
    let mut m: Ptr = std::ptr::null_mut();
    if let Some(bytes) = module {
        // A fatbinary header: magic, version 1, header size 16, contents.
        let mut image = [0u8; 16];
        image[0..4].copy_from_slice(&0xba55_ed50u32.to_le_bytes());
        image[4..6].copy_from_slice(&1u16.to_le_bytes());
        image[6..8].copy_from_slice(&16u16.to_le_bytes());
        image[8..16].copy_from_slice(&bytes.saturating_sub(16).to_le_bytes());
        let r = call!(
            cuda,
            "cuModuleLoadData",
            fn(*mut Ptr, *const u8),
            &mut m,
            image.as_ptr()
        );
        println!("memwork module_error={r}");
    }
    let mut allocated = 0u64;
    let mut error = 0;
    while allocated < most {
        let mut p = 0u64;
        let r = call!(
            cuda,
            "cuMemAlloc",
            fn(*mut u64, usize),
            &mut p,
            chunk as usize
        );
        if r != 0 {
            error = r;
            break;
        }
        allocated += chunk;
    }
    let (free, total) = free_total(cuda)?;
    println!("memwork allocated={allocated} error={error} free={free} total={total}");
    step("allocated");
    if !m.is_null() {
        check("cuModuleUnload", call!(cuda, "cuModuleUnload", fn(Ptr), m))?;
    }
    if create {
        check("cuCtxDestroy", call!(cuda, "cuCtxDestroy", fn(Ptr), ctx))?;
    } else {
        check(
            "cuDevicePrimaryCtxRelease",
            call!(cuda, "cuDevicePrimaryCtxRelease", fn(i32), 0),
        )?;
    }
    step("released");
    Ok(())
}

fn host(cuda: &Cuda, host: u64, device: u64) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let p = prop(HOST_NUMA, 0);
    let mut h = 0u64;
    let r = call!(
        cuda,
        "cuMemCreate",
        fn(*mut u64, usize, *const [u32; 8], u64),
        &mut h,
        host as usize,
        &p,
        0
    );
    println!("memwork host_error={r}");
    let mut pool: Ptr = std::ptr::null_mut();
    check(
        "cuMemPoolCreate",
        call!(
            cuda,
            "cuMemPoolCreate",
            fn(*mut Ptr, *const [u32; 8]),
            &mut pool,
            &p
        ),
    )?;
    let mut stream: Ptr = std::ptr::null_mut();
    check(
        "cuStreamCreate",
        call!(cuda, "cuStreamCreate", fn(*mut Ptr, u32), &mut stream, 1),
    )?;
    let mut hp = 0u64;
    let r = call!(
        cuda,
        "cuMemAllocFromPoolAsync",
        fn(*mut u64, usize, Ptr, Ptr),
        &mut hp,
        host as usize,
        pool,
        stream
    );
    println!("memwork host_pool_error={r}");
    let mut d = 0u64;
    let r = call!(
        cuda,
        "cuMemAlloc",
        fn(*mut u64, usize),
        &mut d,
        device as usize
    );
    println!("memwork device_error={r}");
    step("held");
    Ok(())
}

fn stream_device(cuda: &Cuda, bytes: u64) -> anyhow::Result<()> {
    check("cuInit", call!(cuda, "cuInit", fn(u32), 0))?;
    let mut c1: Ptr = std::ptr::null_mut();
    check(
        "cuDevicePrimaryCtxRetain",
        call!(
            cuda,
            "cuDevicePrimaryCtxRetain",
            fn(*mut Ptr, i32),
            &mut c1,
            1
        ),
    )?;
    check(
        "cuCtxSetCurrent",
        call!(cuda, "cuCtxSetCurrent", fn(Ptr), c1),
    )?;
    let mut stream: Ptr = std::ptr::null_mut();
    check(
        "cuStreamCreate",
        call!(cuda, "cuStreamCreate", fn(*mut Ptr, u32), &mut stream, 1),
    )?;
    start(cuda, 0)?;
    let mut p = 0u64;
    let r = call!(
        cuda,
        "cuMemAllocAsync",
        fn(*mut u64, usize, Ptr),
        &mut p,
        bytes as usize,
        stream
    );
    println!("memwork alloc_error={r}");
    step("held");
    Ok(())
}

fn graph(cuda: &Cuda, bytes: u64, version: i32) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let mut g: Ptr = std::ptr::null_mut();
    check(
        "cuGraphCreate",
        call!(cuda, "cuGraphCreate", fn(*mut Ptr, u32), &mut g, 0),
    )?;
    // CUDA_MEM_ALLOC_NODE_PARAMS: poolProps.location (type at 8, id at
    // 12), bytesize at 104, dptr (out) at 112.
    let mut params = [0u8; 128];
    params[8..12].copy_from_slice(&DEVICE.to_le_bytes());
    params[104..112].copy_from_slice(&bytes.to_le_bytes());
    let mut node: Ptr = std::ptr::null_mut();
    check(
        "cuGraphAddMemAllocNode",
        call!(
            cuda,
            "cuGraphAddMemAllocNode",
            fn(*mut Ptr, Ptr, *const Ptr, usize, *mut u8),
            &mut node,
            g,
            std::ptr::null(),
            0,
            params.as_mut_ptr()
        ),
    )?;
    let at = cuda.at("cuGraphInstantiate", version)?;
    let mut exec: Ptr = std::ptr::null_mut();
    let r = if version >= 12000 {
        // SAFETY: cuGraphInstantiateWithFlags' signature, which the name
        // means from 12000 on.
        let f: unsafe extern "C" fn(*mut Ptr, Ptr, u64) -> CUresult =
            unsafe { std::mem::transmute(at) };
        // SAFETY: out-pointer to a local, a graph of this process;
        // CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH.
        unsafe { f(&mut exec, g, 1) }
    } else {
        // SAFETY: the 5-argument cuGraphInstantiate[_v2].
        let f: unsafe extern "C" fn(*mut Ptr, Ptr, *mut Ptr, *mut c_char, usize) -> CUresult =
            unsafe { std::mem::transmute(at) };
        // SAFETY: out-pointers to locals, no log buffer.
        unsafe { f(&mut exec, g, std::ptr::null_mut(), std::ptr::null_mut(), 0) }
    };
    check("cuGraphInstantiate", r)?;
    let r = call!(
        cuda,
        "cuGraphLaunch",
        fn(Ptr, Ptr),
        exec,
        std::ptr::null_mut()
    );
    let s = call!(cuda, "cuCtxSynchronize", fn());
    println!("memwork launch_error={r} sync_error={s}");
    step("launched");
    Ok(())
}

fn nvml(cuda: &Cuda, bytes: u64) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let mut p = 0u64;
    check(
        "cuMemAlloc",
        call!(
            cuda,
            "cuMemAlloc",
            fn(*mut u64, usize),
            &mut p,
            bytes as usize
        ),
    )?;
    type Init = unsafe extern "C" fn() -> u32;
    type Handle = unsafe extern "C" fn(u32, *mut Ptr) -> u32;
    type Procs = unsafe extern "C" fn(Ptr, *mut u32, *mut u8) -> u32;
    type Util = unsafe extern "C" fn(Ptr, *mut [u32; 2]) -> u32;
    // SAFETY: NVML's C signatures, called with pointers to live locals
    // and arrays of the size given.
    unsafe {
        let lib =
            libloading::Library::new("libnvidia-ml.so.1").context("dlopen libnvidia-ml.so.1")?;
        let init: libloading::Symbol<Init> = lib.get(b"nvmlInit_v2\0")?;
        let handle: libloading::Symbol<Handle> = lib.get(b"nvmlDeviceGetHandleByIndex_v2\0")?;
        let util: libloading::Symbol<Util> = lib.get(b"nvmlDeviceGetUtilizationRates\0")?;
        if init() != 0 {
            bail!("nvmlInit_v2 failed");
        }
        let mut dev: Ptr = std::ptr::null_mut();
        if handle(0, &mut dev) != 0 {
            bail!("nvmlDeviceGetHandleByIndex_v2 failed");
        }
        for (version, name, size) in [
            (
                "v1",
                &b"nvmlDeviceGetComputeRunningProcesses\0"[..],
                16usize,
            ),
            ("v2", b"nvmlDeviceGetComputeRunningProcesses_v2\0", 24),
            ("v3", b"nvmlDeviceGetComputeRunningProcesses_v3\0", 24),
        ] {
            let procs: libloading::Symbol<Procs> = lib.get(name)?;
            let mut count = 64u32;
            let mut buf = vec![0u8; 64 * size];
            let r = procs(dev, &mut count, buf.as_mut_ptr());
            if r != 0 {
                bail!("nvmlDeviceGetComputeRunningProcesses {version} failed: {r}");
            }
            let pids: Vec<String> = buf
                .chunks_exact(size)
                .take(count as usize)
                .map(|e| u32::from_ne_bytes([e[0], e[1], e[2], e[3]]).to_string())
                .collect();
            println!("memwork pids_{version}={}", pids.join(","));
        }
        let mut u = [0u32; 2];
        if util(dev, &mut u) != 0 {
            bail!("nvmlDeviceGetUtilizationRates failed");
        }
        println!("memwork pid={} util={}", std::process::id(), u[0]);
    }
    step("listed");
    Ok(())
}

/// `CUDA_KERNEL_NODE_PARAMS` (v2 layout).
#[repr(C)]
struct KernelNode {
    func: Ptr,
    grid: [u32; 3],
    block: [u32; 3],
    shmem: u32,
    params: *mut Ptr,
    extra: *mut Ptr,
    kern: Ptr,
    ctx: Ptr,
}

/// In the current context: a module, 20 launches of a 1 ms kernel, a
/// graph of it launched 5 times, then a synchronisation.
fn work(cuda: &Cuda) -> anyhow::Result<()> {
    let mut m: Ptr = std::ptr::null_mut();
    check(
        "cuModuleLoadData",
        call!(
            cuda,
            "cuModuleLoadData",
            fn(*mut Ptr, *const c_char),
            &mut m,
            c"fakecuda".as_ptr()
        ),
    )?;
    let mut f: Ptr = std::ptr::null_mut();
    check(
        "cuModuleGetFunction",
        call!(
            cuda,
            "cuModuleGetFunction",
            fn(*mut Ptr, Ptr, *const c_char),
            &mut f,
            m,
            c"fixed_1000us".as_ptr()
        ),
    )?;
    let null: Ptr = std::ptr::null_mut();
    for _ in 0..20 {
        check(
            "cuLaunchKernel",
            call!(
                cuda,
                "cuLaunchKernel",
                fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, *mut Ptr, *mut Ptr),
                f,
                1,
                1,
                1,
                1,
                1,
                1,
                0,
                null,
                std::ptr::null_mut(),
                std::ptr::null_mut()
            ),
        )?;
    }
    let mut g: Ptr = std::ptr::null_mut();
    check(
        "cuGraphCreate",
        call!(cuda, "cuGraphCreate", fn(*mut Ptr, u32), &mut g, 0),
    )?;
    let node = KernelNode {
        func: f,
        grid: [1, 1, 1],
        block: [1, 1, 1],
        shmem: 0,
        params: std::ptr::null_mut(),
        extra: std::ptr::null_mut(),
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    };
    let mut n: Ptr = std::ptr::null_mut();
    check(
        "cuGraphAddKernelNode",
        call!(
            cuda,
            "cuGraphAddKernelNode",
            fn(*mut Ptr, Ptr, *const Ptr, usize, *const KernelNode),
            &mut n,
            g,
            std::ptr::null(),
            0,
            &node
        ),
    )?;
    let mut exec: Ptr = std::ptr::null_mut();
    check(
        "cuGraphInstantiateWithFlags",
        call!(
            cuda,
            "cuGraphInstantiateWithFlags",
            fn(*mut Ptr, Ptr, u64),
            &mut exec,
            g,
            0
        ),
    )?;
    for _ in 0..5 {
        check(
            "cuGraphLaunch",
            call!(cuda, "cuGraphLaunch", fn(Ptr, Ptr), exec, null),
        )?;
    }
    check("cuCtxSynchronize", call!(cuda, "cuCtxSynchronize", fn()))
}

fn contexts(cuda: &Cuda) -> anyhow::Result<()> {
    let pause = || std::thread::sleep(Duration::from_millis(300));
    start(cuda, 0)?;
    work(cuda)?;
    check(
        "cuDevicePrimaryCtxRelease",
        call!(cuda, "cuDevicePrimaryCtxRelease", fn(i32), 0),
    )?;
    pause();
    start(cuda, 0)?;
    work(cuda)?;
    check(
        "cuDevicePrimaryCtxReset",
        call!(cuda, "cuDevicePrimaryCtxReset", fn(i32), 0),
    )?;
    pause();
    let at = cuda.at("cuCtxCreate", 11030)?;
    // SAFETY: cuCtxCreate_v2's signature.
    let create: unsafe extern "C" fn(*mut Ptr, u32, i32) -> CUresult =
        unsafe { std::mem::transmute(at) };
    let mut ctx: Ptr = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    check("cuCtxCreate", unsafe { create(&mut ctx, 0, 0) })?;
    work(cuda)?;
    check("cuCtxDestroy", call!(cuda, "cuCtxDestroy", fn(Ptr), ctx))?;
    pause();
    println!("memwork pid={}", std::process::id());
    step("done");
    Ok(())
}

fn capture_race(cuda: &Cuda, iterations: u64) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let mut m: Ptr = std::ptr::null_mut();
    check(
        "cuModuleLoadData",
        call!(
            cuda,
            "cuModuleLoadData",
            fn(*mut Ptr, *const c_char),
            &mut m,
            c"fakecuda".as_ptr()
        ),
    )?;
    let mut f: Ptr = std::ptr::null_mut();
    check(
        "cuModuleGetFunction",
        call!(
            cuda,
            "cuModuleGetFunction",
            fn(*mut Ptr, Ptr, *const c_char),
            &mut f,
            m,
            c"fixed_200us".as_ptr()
        ),
    )?;
    let mut s: Ptr = std::ptr::null_mut();
    check(
        "cuStreamCreate",
        call!(cuda, "cuStreamCreate", fn(*mut Ptr, u32), &mut s, 1),
    )?;
    let launch = || -> anyhow::Result<CUresult> {
        Ok(call!(
            cuda,
            "cuLaunchKernel",
            fn(Ptr, u32, u32, u32, u32, u32, u32, u32, Ptr, *mut Ptr, *mut Ptr),
            f,
            1,
            1,
            1,
            1,
            1,
            1,
            0,
            s,
            std::ptr::null_mut(),
            std::ptr::null_mut()
        ))
    };
    let mut rng = Rng(0x51_7cc1_b727_220a ^ u64::from(std::process::id()));
    let (mut invalidated, mut failed) = (0u64, 0u64);
    for _ in 0..iterations {
        check("cuLaunchKernel", launch()?)?;
        check(
            "cuStreamSynchronize",
            call!(cuda, "cuStreamSynchronize", fn(Ptr), s),
        )?;
        std::thread::sleep(Duration::from_micros(rng.below(200) * 50));
        // CU_STREAM_CAPTURE_MODE_GLOBAL = 0.
        check(
            "cuStreamBeginCapture",
            call!(cuda, "cuStreamBeginCapture", fn(Ptr, u32), s, 0),
        )?;
        let r = launch()?;
        let mut g: Ptr = std::ptr::null_mut();
        let e = call!(cuda, "cuStreamEndCapture", fn(Ptr, *mut Ptr), s, &mut g);
        match (r, e) {
            (0, 0) => {}
            (901, _) | (_, 901) => invalidated += 1,
            _ => failed += 1,
        }
        if !g.is_null() {
            let _ = call!(cuda, "cuGraphDestroy", fn(Ptr), g);
        }
    }
    println!("memwork invalidated={invalidated} failed={failed}");
    step("done");
    Ok(())
}

/// xorshift64*: each thread's own random numbers.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One stress thread: until `until`, random operations; what it holds at
/// the end stays held.
fn stress_thread(
    cuda: &Cuda,
    tid: u64,
    devices: i32,
    kinds: &[u64],
    bytes: Option<u64>,
    until: Instant,
) -> anyhow::Result<u64> {
    let dev = (tid % devices.max(1) as u64) as i32;
    let mut ctx: Ptr = std::ptr::null_mut();
    check(
        "cuDevicePrimaryCtxRetain",
        call!(
            cuda,
            "cuDevicePrimaryCtxRetain",
            fn(*mut Ptr, i32),
            &mut ctx,
            dev
        ),
    )?;
    check(
        "cuCtxSetCurrent",
        call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx),
    )?;
    let mut stream: Ptr = std::ptr::null_mut();
    check(
        "cuStreamCreate",
        call!(cuda, "cuStreamCreate", fn(*mut Ptr, u32), &mut stream, 1),
    )?;
    let mut pool: Ptr = std::ptr::null_mut();
    check(
        "cuDeviceGetMemPool",
        call!(
            cuda,
            "cuDeviceGetMemPool",
            fn(*mut Ptr, i32),
            &mut pool,
            dev
        ),
    )?;
    let mut rng =
        Rng(0x9e37_79b9_7f4a_7c15 ^ (tid + 1).wrapping_mul(u64::from(std::process::id())));
    let mib = 1u64 << 20;
    let (mut plain, mut pooled, mut handles): (Vec<u64>, Vec<u64>, Vec<(u64, u64)>) =
        (vec![], vec![], vec![]);
    let mut va = 0u64;
    let span = 256 * mib;
    check(
        "cuMemAddressReserve",
        call!(
            cuda,
            "cuMemAddressReserve",
            fn(*mut u64, usize, usize, u64, u64),
            &mut va,
            (span * 8) as usize,
            0,
            0,
            0
        ),
    )?;
    let mut ops = 0u64;
    let ok = |what: &str, r: CUresult| {
        if r == 0 || r == OUT_OF_MEMORY {
            Ok(r == 0)
        } else {
            bail!("{what} failed: {r}")
        }
    };
    while Instant::now() < until {
        ops += 1;
        let bytes = bytes.unwrap_or_else(|| (1 + rng.below(32)) * mib / 2);
        let kind = rng.below(9);
        if !kinds.is_empty() && !kinds.contains(&kind) {
            continue;
        }
        match kind {
            0 => {
                let mut p = 0u64;
                if ok(
                    "cuMemAlloc",
                    call!(
                        cuda,
                        "cuMemAlloc",
                        fn(*mut u64, usize),
                        &mut p,
                        bytes as usize
                    ),
                )? {
                    plain.push(p);
                }
            }
            1 if !plain.is_empty() => {
                let p = plain.swap_remove(rng.below(plain.len() as u64) as usize);
                check("cuMemFree", call!(cuda, "cuMemFree", fn(u64), p))?;
            }
            2 => {
                let mut p = 0u64;
                if ok(
                    "cuMemAllocAsync",
                    call!(
                        cuda,
                        "cuMemAllocAsync",
                        fn(*mut u64, usize, Ptr),
                        &mut p,
                        bytes as usize,
                        stream
                    ),
                )? {
                    pooled.push(p);
                }
            }
            3 if !pooled.is_empty() => {
                let p = pooled.swap_remove(rng.below(pooled.len() as u64) as usize);
                check(
                    "cuMemFreeAsync",
                    call!(cuda, "cuMemFreeAsync", fn(u64, Ptr), p, stream),
                )?;
            }
            4 if handles.len() < 8 => {
                // A VMM handle, mapped, released at once (llama.cpp).
                let slot = (0..8u64).find(|s| !handles.iter().any(|(at, _)| *at == va + s * span));
                let Some(slot) = slot else { continue };
                let p = prop(DEVICE, dev as u32);
                let mut h = 0u64;
                if ok(
                    "cuMemCreate",
                    call!(
                        cuda,
                        "cuMemCreate",
                        fn(*mut u64, usize, *const [u32; 8], u64),
                        &mut h,
                        (bytes.div_ceil(2 * mib) * 2 * mib) as usize,
                        &p,
                        0
                    ),
                )? {
                    let at = va + slot * span;
                    let len = bytes.div_ceil(2 * mib) * 2 * mib;
                    check(
                        "cuMemMap",
                        call!(
                            cuda,
                            "cuMemMap",
                            fn(u64, usize, usize, u64, u64),
                            at,
                            len as usize,
                            0,
                            h,
                            0
                        ),
                    )?;
                    check("cuMemRelease", call!(cuda, "cuMemRelease", fn(u64), h))?;
                    handles.push((at, len));
                }
            }
            5 if !handles.is_empty() => {
                let (at, len) = handles.swap_remove(rng.below(handles.len() as u64) as usize);
                check(
                    "cuMemUnmap",
                    call!(cuda, "cuMemUnmap", fn(u64, usize), at, len as usize),
                )?;
            }
            6 => {
                // Host memory on a NUMA node: never charged.
                let p = prop(HOST_NUMA, 0);
                let mut h = 0u64;
                check(
                    "cuMemCreate (host)",
                    call!(
                        cuda,
                        "cuMemCreate",
                        fn(*mut u64, usize, *const [u32; 8], u64),
                        &mut h,
                        (64 * mib) as usize,
                        &p,
                        0
                    ),
                )?;
                check(
                    "cuMemRelease (host)",
                    call!(cuda, "cuMemRelease", fn(u64), h),
                )?;
            }
            7 => {
                check(
                    "cuMemPoolTrimTo",
                    call!(cuda, "cuMemPoolTrimTo", fn(Ptr, usize), pool, 0),
                )?;
            }
            _ => {
                check(
                    "cuStreamSynchronize",
                    call!(cuda, "cuStreamSynchronize", fn(Ptr), stream),
                )?;
            }
        }
    }
    // Pool frees take effect at a synchronisation: settle before the end.
    check(
        "cuStreamSynchronize",
        call!(cuda, "cuStreamSynchronize", fn(Ptr), stream),
    )?;
    Ok(ops)
}

fn stress(
    cuda: &Cuda,
    threads: u64,
    seconds: f64,
    devices: i32,
    kinds: &[u64],
    size: Option<u64>,
) -> anyhow::Result<()> {
    check("cuInit", call!(cuda, "cuInit", fn(u32), 0))?;
    // The contexts first (see the test): the traffic starts on a go.
    for dev in 0..devices.max(1) {
        let mut ctx: Ptr = std::ptr::null_mut();
        check(
            "cuDevicePrimaryCtxRetain",
            call!(
                cuda,
                "cuDevicePrimaryCtxRetain",
                fn(*mut Ptr, i32),
                &mut ctx,
                dev
            ),
        )?;
    }
    step("ready");
    let until = Instant::now() + Duration::from_secs_f64(seconds);
    let ops: anyhow::Result<Vec<u64>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| s.spawn(move || stress_thread(cuda, t, devices, kinds, size, until)))
            .collect();
        handles
            .into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| bail!("a stress thread panicked"))
            })
            .collect()
    });
    let ops: u64 = ops?.iter().sum();
    println!("memwork ops={ops}");
    step("done");
    Ok(())
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let cuda = Cuda::load()?;
    match args.what {
        What::Vmm { handle, count } => vmm(&cuda, handle, count),
        What::Context {
            create,
            heap,
            module,
            chunk,
            most,
        } => context(&cuda, create, heap, module, chunk, most),
        What::Host { host: h, device } => host(&cuda, h, device),
        What::StreamDevice { bytes } => stream_device(&cuda, bytes),
        What::Graph { bytes, version } => graph(&cuda, bytes, version),
        What::Nvml { bytes } => nvml(&cuda, bytes),
        What::Contexts => contexts(&cuda),
        What::CaptureRace { iterations } => capture_race(&cuda, iterations),
        What::Stress {
            threads,
            seconds,
            devices,
            ops,
            size,
        } => stress(&cuda, threads, seconds, devices, &ops, size),
    }
}
