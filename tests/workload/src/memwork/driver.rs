//! Scenarios of the driver's other sides: NVML as `nvidia-smi` asks it,
//! contexts that go away, captures beside the idle watcher, a library's
//! kernel launched with no current context.

use crate::*;

pub(crate) fn nvml(cuda: &Cuda, bytes: u64, polls: u32) -> anyhow::Result<()> {
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
        let t = std::time::Instant::now();
        for _ in 0..polls {
            if util(dev, &mut u) != 0 {
                bail!("nvmlDeviceGetUtilizationRates failed");
            }
        }
        println!("memwork polled_ms={}", t.elapsed().as_millis());
    }
    step("listed");
    Ok(())
}

/// `nvmlMemoryLimitsInfo_v1_t` (`nvmlMemoryLimits_v1_t` is its first
/// three fields).
#[repr(C)]
struct LimitsInfo {
    name_space: *const c_char,
    soft: u64,
    hard: u64,
    current_used: u64,
}

/// See `What::Limits`.
pub(crate) fn limits(cgroup: &str, device: u32, set: Option<&str>) -> anyhow::Result<()> {
    type Init = unsafe extern "C" fn() -> u32;
    type Handle = unsafe extern "C" fn(u32, *mut Ptr) -> u32;
    type Limits = unsafe extern "C" fn(Ptr, *mut LimitsInfo) -> u32;
    type Memory = unsafe extern "C" fn(Ptr, *mut [u64; 3]) -> u32;
    let name = std::ffi::CString::new(cgroup)?;
    let set = match set {
        Some(s) => {
            let (soft, hard) = s.split_once(':').context("--set SOFT:HARD")?;
            Some((
                crate::size(soft).map_err(anyhow::Error::msg)?,
                crate::size(hard).map_err(anyhow::Error::msg)?,
            ))
        }
        None => None,
    };
    // SAFETY: NVML's C signatures, called with pointers to live locals;
    // the struct's name is a live NUL-terminated string.
    unsafe {
        let lib =
            libloading::Library::new("libnvidia-ml.so.1").context("dlopen libnvidia-ml.so.1")?;
        let init: libloading::Symbol<Init> = lib.get(b"nvmlInit_v2\0")?;
        let handle: libloading::Symbol<Handle> = lib.get(b"nvmlDeviceGetHandleByIndex_v2\0")?;
        let memory: libloading::Symbol<Memory> = lib.get(b"nvmlDeviceGetMemoryInfo\0")?;
        if init() != 0 {
            bail!("nvmlInit_v2 failed");
        }
        let mut dev: Ptr = std::ptr::null_mut();
        if handle(device, &mut dev) != 0 {
            bail!("nvmlDeviceGetHandleByIndex_v2({device}) failed");
        }
        if let Some((soft, hard)) = set {
            let r = match lib.get::<Limits>(b"nvmlDeviceSetMemoryLimits_v1\0") {
                Ok(f) => {
                    let mut l = LimitsInfo {
                        name_space: name.as_ptr(),
                        soft,
                        hard,
                        current_used: 0,
                    };
                    f(dev, &mut l)
                }
                Err(_) => 13,
            };
            println!("memwork set_error={r}");
        }
        let mut info = LimitsInfo {
            name_space: name.as_ptr(),
            soft: 0,
            hard: 0,
            current_used: 0,
        };
        let r = match lib.get::<Limits>(b"nvmlDeviceGetMemoryLimits_v1\0") {
            Ok(f) => f(dev, &mut info),
            Err(_) => 13,
        };
        let mut m = [0u64; 3];
        if memory(dev, &mut m) != 0 {
            bail!("nvmlDeviceGetMemoryInfo failed");
        }
        println!(
            "memwork get_error={r} soft={} hard={} used={} nvml_total={} nvml_free={}",
            info.soft, info.hard, info.current_used, m[0], m[1]
        );
    }
    Ok(())
}

/// `CUDA_KERNEL_NODE_PARAMS` (v2 layout).
#[repr(C)]
pub(crate) struct KernelNode {
    func: Ptr,
    grid: [u32; 3],
    block: [u32; 3],
    shmem: u32,
    params: *mut Ptr,
    extra: *mut Ptr,
    kern: Ptr,
    ctx: Ptr,
}

/// In the current context: a module's function `name` (a simulator
/// kernel name: `fixed_<N>us`).
fn kernel(cuda: &Cuda, name: &std::ffi::CStr) -> anyhow::Result<Ptr> {
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
            name.as_ptr()
        ),
    )?;
    Ok(f)
}

/// Launches `f` once (one block of one thread, no parameters) onto
/// `stream`: the driver's answer.
fn launch_raw(cuda: &Cuda, f: Ptr, stream: Ptr) -> anyhow::Result<CUresult> {
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
        stream,
        std::ptr::null_mut(),
        std::ptr::null_mut()
    ))
}

/// [`launch_raw`], which must succeed.
fn launch(cuda: &Cuda, f: Ptr, stream: Ptr) -> anyhow::Result<()> {
    check("cuLaunchKernel", launch_raw(cuda, f, stream)?)
}

/// In the current context: a module, 20 launches of a 1 ms kernel, a
/// graph of it launched 5 times, then a synchronisation.
pub(crate) fn work(cuda: &Cuda) -> anyhow::Result<()> {
    let f = kernel(cuda, c"fixed_1000us")?;
    let null: Ptr = std::ptr::null_mut();
    for _ in 0..20 {
        launch(cuda, f, null)?;
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

/// Work in a green context of all of GPU 0's SMs, through the context
/// `cuCtxFromGreenCtx` gives (as SGLang and vLLM use one), then the green
/// context destroyed, which takes that context with it.
fn green(cuda: &Cuda) -> anyhow::Result<()> {
    let (green, ctx) = green_ctx(cuda, 0)?;
    check(
        "cuCtxSetCurrent",
        call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx),
    )?;
    work(cuda)?;
    check(
        "cuGreenCtxDestroy",
        call!(cuda, "cuGreenCtxDestroy", fn(Ptr), green),
    )
}

/// A green context of all of GPU `dev`'s SMs, and the context
/// `cuCtxFromGreenCtx` gives for it.
fn green_ctx(cuda: &Cuda, dev: i32) -> anyhow::Result<(Ptr, Ptr)> {
    // A CUdevResource (144 bytes in 12.x), with room to spare.
    let mut sms = [0u8; 256];
    // CU_DEV_RESOURCE_TYPE_SM = 1.
    check(
        "cuDeviceGetDevResource",
        call!(
            cuda,
            "cuDeviceGetDevResource",
            fn(i32, *mut u8, u32),
            dev,
            sms.as_mut_ptr(),
            1
        ),
    )?;
    let mut desc: Ptr = std::ptr::null_mut();
    check(
        "cuDevResourceGenerateDesc",
        call!(
            cuda,
            "cuDevResourceGenerateDesc",
            fn(*mut Ptr, *const u8, u32),
            &mut desc,
            sms.as_ptr(),
            1
        ),
    )?;
    let mut green: Ptr = std::ptr::null_mut();
    // CU_GREEN_CTX_DEFAULT_STREAM = 1, which the driver requires.
    check(
        "cuGreenCtxCreate",
        call!(
            cuda,
            "cuGreenCtxCreate",
            fn(*mut Ptr, Ptr, i32, u32),
            &mut green,
            desc,
            dev,
            1
        ),
    )?;
    let mut ctx: Ptr = std::ptr::null_mut();
    check(
        "cuCtxFromGreenCtx",
        call!(
            cuda,
            "cuCtxFromGreenCtx",
            fn(*mut Ptr, Ptr),
            &mut ctx,
            green
        ),
    )?;
    Ok((green, ctx))
}

pub(crate) fn contexts(cuda: &Cuda) -> anyhow::Result<()> {
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
    green(cuda)?;
    pause();
    start(cuda, 0)?;
    work(cuda)?;
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

/// See `What::Loads`.
pub(crate) fn loads(cuda: &Cuda, threads: u32, count: u32, image: u64) -> anyhow::Result<()> {
    let ctx = start(cuda, 0)? as usize;
    // An ELF64 header whose section headers end at `image` bytes.
    let mut elf = vec![0u8; image as usize];
    elf[..4].copy_from_slice(b"\x7fELF");
    elf[4] = 2;
    let (entsize, num) = (64u16, 1u16);
    elf[0x28..0x30].copy_from_slice(&(image - u64::from(entsize)).to_le_bytes());
    elf[0x3a..0x3c].copy_from_slice(&entsize.to_le_bytes());
    elf[0x3c..0x3e].copy_from_slice(&num.to_le_bytes());
    step("ready");
    let t = std::time::Instant::now();
    std::thread::scope(|s| -> anyhow::Result<()> {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                let elf = &elf;
                s.spawn(move || -> anyhow::Result<()> {
                    check(
                        "cuCtxSetCurrent",
                        call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx as Ptr),
                    )?;
                    for _ in 0..count {
                        let mut m: Ptr = std::ptr::null_mut();
                        check(
                            "cuModuleLoadData",
                            call!(
                                cuda,
                                "cuModuleLoadData",
                                fn(*mut Ptr, *const u8),
                                &mut m,
                                elf.as_ptr()
                            ),
                        )?;
                    }
                    Ok(())
                })
            })
            .collect();
        for h in handles {
            h.join()
                .map_err(|_| anyhow::anyhow!("a loading thread panicked"))??;
        }
        Ok(())
    })?;
    println!("memwork loads_ms={}", t.elapsed().as_millis());
    step("loaded");
    Ok(())
}

/// See `What::SyncBeside`.
pub(crate) fn sync_beside(cuda: &Cuda, kernel_ms: u64) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let name = std::ffi::CString::new(format!("fixed_{}us", kernel_ms * 1000))?;
    let f = kernel(cuda, &name)?;
    let null: Ptr = std::ptr::null_mut();
    launch(cuda, f, null)?;
    // The program goes idle: the watcher ends the token and waits for
    // GPU 0's kernel.
    std::thread::sleep(Duration::from_millis(300));
    let at = cuda.at("cuCtxCreate", 11030)?;
    // SAFETY: cuCtxCreate_v2's signature.
    let create: unsafe extern "C" fn(*mut Ptr, u32, i32) -> CUresult =
        unsafe { std::mem::transmute(at) };
    let mut ctx: Ptr = std::ptr::null_mut();
    // SAFETY: an out-pointer to a local.
    check("cuCtxCreate", unsafe { create(&mut ctx, 0, 1) })?;
    work(cuda)?;
    let t = std::time::Instant::now();
    check("cuCtxDestroy", call!(cuda, "cuCtxDestroy", fn(Ptr), ctx))?;
    println!("memwork destroy_ms={}", t.elapsed().as_millis());
    start(cuda, 0)?;
    check("cuCtxSynchronize", call!(cuda, "cuCtxSynchronize", fn()))?;
    step("done");
    Ok(())
}

pub(crate) fn capture_race(cuda: &Cuda, iterations: u64) -> anyhow::Result<()> {
    start(cuda, 0)?;
    let f = kernel(cuda, c"fixed_200us")?;
    let s = new_stream(cuda)?;
    let launch = || launch_raw(cuda, f, s);
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

pub(crate) fn kernel_no_context(
    cuda: &Cuda,
    device: i32,
    current: Option<i32>,
    green: bool,
) -> anyhow::Result<()> {
    let ctx = start(cuda, device)?;
    let mut lib: Ptr = std::ptr::null_mut();
    let null: Ptr = std::ptr::null_mut();
    check(
        "cuLibraryLoadData",
        call!(
            cuda,
            "cuLibraryLoadData",
            fn(*mut Ptr, *const c_char, Ptr, Ptr, u32, Ptr, Ptr, u32),
            &mut lib,
            c"fakecuda".as_ptr(),
            null,
            null,
            0,
            null,
            null,
            0
        ),
    )?;
    let mut kernel: Ptr = std::ptr::null_mut();
    check(
        "cuLibraryGetKernel",
        call!(
            cuda,
            "cuLibraryGetKernel",
            fn(*mut Ptr, Ptr, *const c_char),
            &mut kernel,
            lib,
            c"fixed_500us".as_ptr()
        ),
    )?;
    if green {
        // The stream is made in a green context's, which the hook never
        // sees made.
        let (_, ctx) = green_ctx(cuda, device)?;
        check(
            "cuCtxSetCurrent",
            call!(cuda, "cuCtxSetCurrent", fn(Ptr), ctx),
        )?;
    }
    let s = new_stream(cuda)?;
    // No context current on this thread from here on, or another GPU's.
    let other = match current {
        Some(dev) => super::retain(cuda, dev)?,
        None => null,
    };
    check(
        "cuCtxSetCurrent",
        call!(cuda, "cuCtxSetCurrent", fn(Ptr), other),
    )?;
    let mut first_error = 0;
    for _ in 0..20 {
        let r = launch_raw(cuda, kernel, s)?;
        if r != 0 && first_error == 0 {
            first_error = r;
        }
    }
    check(
        "cuStreamSynchronize",
        call!(cuda, "cuStreamSynchronize", fn(Ptr), s),
    )?;
    let _ = ctx;
    println!("memwork launch_error={first_error}");
    step("launched");
    Ok(())
}
