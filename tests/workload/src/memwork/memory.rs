//! Scenarios of device memory: VMM handles, contexts, heaps and modules,
//! host memory, the stream's device, graph memory.

use crate::*;

pub(crate) fn vmm(cuda: &Cuda, handle: u64, count: u64) -> anyhow::Result<()> {
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

pub(crate) fn context(
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
        let image = fatbin(bytes);
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

pub(crate) fn host(cuda: &Cuda, host: u64, device: u64) -> anyhow::Result<()> {
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
    let stream = new_stream(cuda)?;
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

pub(crate) fn stream_device(cuda: &Cuda, bytes: u64) -> anyhow::Result<()> {
    check("cuInit", call!(cuda, "cuInit", fn(u32), 0))?;
    make_current(cuda, 1)?;
    let stream = new_stream(cuda)?;
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

pub(crate) fn graph(cuda: &Cuda, bytes: u64, version: i32) -> anyhow::Result<()> {
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

/// A fatbinary as compilers make one for several GPUs: the sm_80 cubin
/// (twice `bytes`), the sm_90 one (`bytes`, what an sm_90 device loads)
/// and the PTX (three times `bytes`), stored whole. Each entry: a 64-byte
/// header (kind at 0, 2 for an ELF and 1 for PTX; the header's length at
/// 4; the payload's at 8; the architecture at 28), then its payload.
fn fatbin(bytes: u64) -> Vec<u8> {
    let mut body = Vec::new();
    for (kind, arch, size) in [(2u16, 80u32, 2 * bytes), (2, 90, bytes), (1, 90, 3 * bytes)] {
        let mut e = [0u8; 64];
        e[0..2].copy_from_slice(&kind.to_le_bytes());
        e[4..8].copy_from_slice(&64u32.to_le_bytes());
        e[8..16].copy_from_slice(&size.to_le_bytes());
        e[28..32].copy_from_slice(&arch.to_le_bytes());
        body.extend_from_slice(&e);
        body.resize(body.len() + size as usize, 0);
    }
    let mut image = Vec::with_capacity(16 + body.len());
    image.extend_from_slice(&0xba55_ed50u32.to_le_bytes());
    image.extend_from_slice(&1u16.to_le_bytes());
    image.extend_from_slice(&16u16.to_le_bytes());
    image.extend_from_slice(&(body.len() as u64).to_le_bytes());
    image.extend_from_slice(&body);
    image
}
