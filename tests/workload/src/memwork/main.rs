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
//! - `nvml`: NVML's process list and utilisation, as `nvidia-smi` asks.
//! - `contexts`: kernels and graphs in a primary context released to
//!   nothing, retained again and reset, and in one made and destroyed.
//! - `capture-race`: captures begun as the process goes idle.
//! - `kernel-no-context`: a library's kernel launched with no current
//!   context.
//! - `stress`: threads of random allocations, frees, stream-ordered
//!   allocations on several streams and devices, VMM handles, host NUMA
//!   handles and pool trims, for `--seconds`.
//!
//! The memory scenarios are in `memory`, the others in `driver`, the
//! traffic in `stress`.

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
        /// A module whose sm_90 cubin is this large, in a fatbinary beside
        /// an sm_80 one twice as large and PTX three times
        /// (the device loads the sm_90 one).
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
        /// Then asks its utilisation this many times more, as a monitor
        /// polling NVML does, and says how long that took (`polled_ms`)
        #[arg(long, default_value = "0")]
        polls: u32,
    },
    /// The driver's memory limit of a cgroup on GPU `--device` (NVML,
    /// R615): sets it if `--set SOFT:HARD` is given (as the NVIDIA
    /// container toolkit's hook does), then prints what NVML reports for
    /// the cgroup, and NVML's memory figures of the device as this
    /// process sees them.
    Limits {
        /// The cgroup (v2 path).
        #[arg(long)]
        cgroup: String,
        /// NVML index.
        #[arg(long, default_value_t = 0)]
        device: u32,
        /// `SOFT:HARD`, sizes (0:0 removes the limit).
        #[arg(long)]
        set: Option<String>,
    },
    /// Kernels and graphs in a primary context released to nothing, in
    /// one retained again and reset, in a green context destroyed (then
    /// in the primary context again), and in one made and destroyed, with
    /// a pause after each (PyTorch's and the runtime's teardown).
    Contexts,
    /// A `--kernel-ms` kernel on GPU 0, left to the hook's idle watcher
    /// to wait for, while a context of GPU 1 is made, used and destroyed:
    /// says how long the destruction took (`destroy_ms`)
    /// `--threads` threads each load `--count` cubins (ELF images of
    /// `--image` bytes, by their headers) in the primary context of GPU 0
    /// at once (after step `ready`): says how long that took (`loads_ms`)
    Loads {
        #[arg(long, default_value = "8")]
        threads: u32,
        #[arg(long, default_value = "4")]
        count: u32,
        #[arg(long, value_parser = size, default_value = "64KiB")]
        image: u64,
    },
    SyncBeside {
        #[arg(long, default_value = "3000")]
        kernel_ms: u64,
    },
    /// `--iterations` times: a kernel, a wait, a pause of 0 to 10 ms (the
    /// hook's idle watcher settles the token meanwhile), then a global
    /// capture of a kernel; counts the captures the driver invalidated.
    CaptureRace {
        #[arg(long, default_value_t = 1000)]
        iterations: u64,
    },
    /// A library's kernel (`CUkernel`) launched 20 times on a stream of
    /// `--device` from a thread with no current context, as cuda.h
    /// allows; with `--current`, from a thread whose current context is
    /// that GPU's primary context (the kernel runs in the stream's);
    /// with `--green`, onto a stream of a green context of `--device`.
    KernelNoContext {
        #[arg(long, default_value_t = 0)]
        device: i32,
        #[arg(long)]
        current: Option<i32>,
        #[arg(long)]
        green: bool,
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

mod driver;
mod memory;
mod stress;

use driver::*;
use memory::*;
use stress::*;

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
    make_current(cuda, dev)
}

/// Retains the primary context of `dev`.
fn retain(cuda: &Cuda, dev: i32) -> anyhow::Result<Ptr> {
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
    Ok(ctx)
}

/// Retains the primary context of `dev` and makes it this thread's.
fn make_current(cuda: &Cuda, dev: i32) -> anyhow::Result<Ptr> {
    let ctx = retain(cuda, dev)?;
    check(
        "cuCtxSetCurrent",
        call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx),
    )?;
    Ok(ctx)
}

/// A stream of the current context that does not synchronise with the
/// legacy one (`CU_STREAM_NON_BLOCKING`), as PyTorch's.
fn new_stream(cuda: &Cuda) -> anyhow::Result<Ptr> {
    let mut stream: Ptr = std::ptr::null_mut();
    check(
        "cuStreamCreate",
        call!(cuda, "cuStreamCreate", fn(*mut Ptr, u32), &mut stream, 1),
    )?;
    Ok(stream)
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
        What::Nvml { bytes, polls } => nvml(&cuda, bytes, polls),
        What::Limits {
            cgroup,
            device,
            set,
        } => limits(&cgroup, device, set.as_deref()),
        What::Contexts => contexts(&cuda),
        What::SyncBeside { kernel_ms } => sync_beside(&cuda, kernel_ms),
        What::Loads {
            threads,
            count,
            image,
        } => loads(&cuda, threads, count, image),
        What::KernelNoContext {
            device,
            current,
            green,
        } => kernel_no_context(&cuda, device, current, green),
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
