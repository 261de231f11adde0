//! Device memory in the simulator is held as the driver holds it: a
//! context's own memory and its limits, module images, `cuMemCreate`
//! handles until their last unmap, host locations never, addresses
//! reused; NVML reports each process's whole footprint.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use super::driver_tests::{MIB, dev, free_mem};
use super::*;

/// `CUmemAllocationProp`'s leading fields: pinned, no handle types, the
/// location (type, id).
fn prop(kind: u32, id: u32) -> [u32; 8] {
    [1, 0, kind, id, 0, 0, 0, 0]
}

#[test]
fn a_context_holds_its_memory_and_its_limits_until_destroyed() {
    let _d = dev();
    let s = sim().unwrap();
    let f0 = free_mem();
    let mut ctx = std::ptr::null_mut();
    // SAFETY: out-pointers to locals; the context is this test's own.
    unsafe {
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        assert_eq!(
            free_mem(),
            f0 - s.ctx_mem,
            "a context takes FAKECUDA_CTX_MEM"
        );
        let mut heap = 0usize;
        assert_eq!(cuCtxGetLimit(&mut heap, context::LIMIT_MALLOC_HEAP_SIZE), 0);
        assert_eq!(heap, 8 << 20, "the default malloc heap");
        let more = heap + 64 * MIB as usize;
        assert_eq!(cuCtxSetLimit(context::LIMIT_MALLOC_HEAP_SIZE, more), 0);
        assert_eq!(
            free_mem(),
            f0 - s.ctx_mem - 64 * MIB,
            "a larger heap takes more"
        );
        assert_eq!(cuCtxGetLimit(&mut heap, context::LIMIT_MALLOC_HEAP_SIZE), 0);
        assert_eq!(heap, more);
        // The stack limit is per resident thread (132 SMs × 2048).
        assert_eq!(cuCtxSetLimit(context::LIMIT_STACK_SIZE, 2048), 0);
        assert_eq!(
            free_mem(),
            f0 - s.ctx_mem - 64 * MIB - 1024 * 132 * 2048,
            "a larger stack"
        );
        assert_eq!(cuCtxSetLimit(99, 1), CUDA_ERROR_UNSUPPORTED_LIMIT);
        // More heap than the device has: refused, the limit unchanged.
        assert_eq!(
            cuCtxSetLimit(context::LIMIT_MALLOC_HEAP_SIZE, usize::MAX / 2),
            CUDA_ERROR_OUT_OF_MEMORY
        );
        assert_eq!(cuCtxGetLimit(&mut heap, context::LIMIT_MALLOC_HEAP_SIZE), 0);
        assert_eq!(heap, more);
        assert_eq!(cuCtxDestroy_v2(ctx), 0);
    }
    assert_eq!(free_mem(), f0, "all of it back with the context");
}

/// A fatbinary of `entries` (kind 2: ELF, 1: PTX; its sm; its size,
/// stored compressed in 8 bytes).
pub(super) fn fatbin(entries: &[(u16, u32, u64)]) -> Vec<u8> {
    let mut body = Vec::new();
    for &(kind, arch, unpacked) in entries {
        let mut e = [0u8; 64];
        e[0..2].copy_from_slice(&kind.to_le_bytes());
        e[4..8].copy_from_slice(&64u32.to_le_bytes());
        e[8..16].copy_from_slice(&8u64.to_le_bytes());
        e[28..32].copy_from_slice(&arch.to_le_bytes());
        e[40..48].copy_from_slice(&0x8000u64.to_le_bytes());
        e[56..64].copy_from_slice(&unpacked.to_le_bytes());
        body.extend_from_slice(&e);
        body.extend_from_slice(&[0u8; 8]);
    }
    let mut image = Vec::new();
    image.extend_from_slice(&0xba55_ed50u32.to_le_bytes());
    image.extend_from_slice(&1u16.to_le_bytes());
    image.extend_from_slice(&16u16.to_le_bytes());
    image.extend_from_slice(&(body.len() as u64).to_le_bytes());
    image.extend_from_slice(&body);
    image
}

/// A fatbinary holds the ELF of every architecture it was built for and
/// their PTX: the driver loads one, the cubin for the device (sm_90
/// here), else one of the same major, else JIT compiles the PTX.
#[test]
fn a_module_holds_its_image_until_unloaded() {
    let _d = dev();
    let f0 = free_mem();
    let fat = fatbin(&[(2, 80, 8 * MIB), (2, 90, 3 * MIB), (1, 90, 5 * MIB)]);
    let old = fatbin(&[(2, 80, 8 * MIB), (1, 80, 5 * MIB)]);
    let mut m = std::ptr::null_mut();
    let mut jit = std::ptr::null_mut();
    let mut ptx = std::ptr::null_mut();
    // SAFETY: images that start with a whole header or are NUL-terminated.
    unsafe {
        assert_eq!(cuModuleLoadData(&mut m, fat.as_ptr().cast()), 0);
        assert_eq!(free_mem(), f0 - 3 * MIB, "the sm_90 cubin only");
        assert_eq!(cuModuleLoadData(&mut jit, old.as_ptr().cast()), 0);
        assert_eq!(
            free_mem(),
            f0 - 8 * MIB,
            "no sm_9x cubin: its PTX, compiled"
        );
        assert_eq!(cuModuleUnload(jit), 0);
        assert_eq!(
            cuModuleLoadData(&mut ptx, c".version 8.0".as_ptr().cast()),
            0
        );
        assert_eq!(free_mem(), f0 - 3 * MIB - 12, "PTX text: its length");
        assert_eq!(cuModuleUnload(m), 0);
        assert_eq!(cuModuleUnload(ptx), 0);
        assert_eq!(cuModuleUnload(ptx), CUDA_ERROR_INVALID_HANDLE);
    }
    assert_eq!(free_mem(), f0);
}

#[test]
fn a_released_handle_keeps_its_memory_until_its_last_unmap() {
    let _d = dev();
    let f0 = free_mem();
    let p = prop(memory::LOCATION_DEVICE, 0);
    let (mut h, mut va) = (0u64, 0u64);
    // SAFETY: out-pointers to locals; handles and ranges of this test.
    unsafe {
        assert_eq!(
            cuMemCreate(&mut h, (64 * MIB) as usize, p.as_ptr().cast(), 0),
            0
        );
        assert_eq!(
            cuMemAddressReserve(&mut va, (128 * MIB) as usize, 0, 0, 0),
            0
        );
        let half = va + 64 * MIB;
        assert_eq!(cuMemMap(va, (64 * MIB) as usize, 0, h, 0), 0);
        assert_eq!(cuMemMap(half, (64 * MIB) as usize, 0, h, 0), 0);
        assert_eq!(
            cuMemMap(va, (64 * MIB) as usize, 0, h, 0),
            CUDA_ERROR_INVALID_VALUE,
            "the range is mapped already"
        );
        // llama.cpp's VMM pool: release right after mapping.
        assert_eq!(cuMemRelease(h), 0);
        assert_eq!(free_mem(), f0 - 64 * MIB, "mapped: still held");
        assert_eq!(
            cuMemMap(va + 256 * MIB, (64 * MIB) as usize, 0, h, 0),
            CUDA_ERROR_INVALID_HANDLE,
            "a released handle maps no more"
        );
        assert_eq!(cuMemUnmap(va, (64 * MIB) as usize), 0);
        assert_eq!(free_mem(), f0 - 64 * MIB, "one mapping left");
        assert_eq!(cuMemUnmap(half, (64 * MIB) as usize), 0);
        assert_eq!(free_mem(), f0, "gone with the last mapping");
        assert_eq!(
            cuMemUnmap(half, (64 * MIB) as usize),
            CUDA_ERROR_INVALID_VALUE
        );
        // Released while unmapped: gone at once.
        assert_eq!(
            cuMemCreate(&mut h, (64 * MIB) as usize, p.as_ptr().cast(), 0),
            0
        );
        assert_eq!(free_mem(), f0 - 64 * MIB);
        assert_eq!(cuMemRelease(h), 0);
        assert_eq!(free_mem(), f0);
    }
}

#[test]
fn host_locations_take_no_device_memory() {
    let d = dev();
    let f0 = free_mem();
    let s = d.stream(1);
    // SAFETY: out-pointers to locals; handles, pools and a stream of this
    // test.
    unsafe {
        for (kind, id) in [
            (memory::LOCATION_HOST, 0),
            (memory::LOCATION_HOST_NUMA, 1),
            (memory::LOCATION_HOST_NUMA_CURRENT, 0),
        ] {
            let p = prop(kind, id);
            let mut h = 0u64;
            assert_eq!(
                cuMemCreate(&mut h, (900 * MIB) as usize, p.as_ptr().cast(), 0),
                0
            );
            assert_eq!(free_mem(), f0, "location type {kind}");
            assert_eq!(cuMemRelease(h), 0);
        }
        let bad = prop(7, 0);
        let mut h = 0u64;
        assert_eq!(
            cuMemCreate(&mut h, MIB as usize, bad.as_ptr().cast(), 0),
            CUDA_ERROR_INVALID_VALUE
        );
        let p = prop(memory::LOCATION_HOST_NUMA, 0);
        let mut pool = std::ptr::null_mut();
        assert_eq!(cuMemPoolCreate(&mut pool, p.as_ptr().cast()), 0);
        let mut ptr = 0u64;
        assert_eq!(
            cuMemAllocFromPoolAsync(&mut ptr, (512 * MIB) as usize, pool, s),
            0
        );
        assert_eq!(free_mem(), f0, "a host pool");
        assert_eq!(cuMemFreeAsync(ptr, s), 0);
        assert_eq!(cuMemPoolDestroy(pool), 0);
    }
    assert_eq!(free_mem(), f0);
}

#[test]
fn a_freed_address_is_handed_out_again() {
    let _d = dev();
    let (mut a, mut b, mut c) = (0u64, 0u64, 0u64);
    // SAFETY: out-pointers to locals; pointers this test allocated.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut a, MIB as usize), 0);
        assert_eq!(cuMemFree_v2(a), 0);
        assert_eq!(cuMemAlloc_v2(&mut b, MIB as usize), 0);
        assert_eq!(b, a, "the driver reuses addresses");
        assert_eq!(cuMemAlloc_v2(&mut c, MIB as usize), 0);
        assert_ne!(c, b);
        assert_eq!(cuMemFree_v2(b), 0);
        assert_eq!(cuMemFree_v2(c), 0);
    }
}

#[test]
fn nvml_reports_each_process_whole_footprint() {
    let _d = dev();
    let s = sim().unwrap();
    let mut p = 0u64;
    // SAFETY: out-pointers to locals, and an array of 8 entries.
    unsafe {
        assert_eq!(cuMemAlloc_v2(&mut p, (32 * MIB) as usize), 0);
        let mine = s
            .processes(0)
            .into_iter()
            .find(|(pid, _)| *pid == std::process::id());
        let (_, held) = mine.expect("this process holds memory");
        assert!(held >= 32 * MIB);
        let mut count = 0u32;
        // NVML handle of device 0 (the index plus one).
        let handle = std::ptr::without_provenance_mut::<c_void>(1);
        assert_eq!(
            nvml::nvmlDeviceGetComputeRunningProcesses_v3(handle, &mut count, std::ptr::null_mut()),
            7,
            "NVML_ERROR_INSUFFICIENT_SIZE"
        );
        assert!(count >= 1);
        let mut infos = [[0u64; 3]; 8];
        count = 8;
        assert_eq!(
            nvml::nvmlDeviceGetComputeRunningProcesses_v3(
                handle,
                &mut count,
                infos.as_mut_ptr().cast()
            ),
            0
        );
        let got = infos[..count as usize]
            .iter()
            .find(|e| e[0] as u32 == std::process::id())
            .map(|e| e[1]);
        assert_eq!(got, Some(held), "v3: pid and usedGpuMemory");
        let mut v1 = [[0u64; 2]; 8];
        count = 8;
        assert_eq!(
            nvml::nvmlDeviceGetComputeRunningProcesses(handle, &mut count, v1.as_mut_ptr().cast()),
            0
        );
        assert!(
            v1[..count as usize]
                .iter()
                .any(|e| e[0] as u32 == std::process::id() && e[1] == held)
        );
        assert_eq!(cuMemFree_v2(p), 0);
    }
}

#[test]
fn a_context_that_went_fails_its_calls_and_they_are_logged() {
    let d = dev();
    let mut ctx = std::ptr::null_mut();
    let mut e = std::ptr::null_mut();
    // SAFETY: out-pointers to locals; the context and event are this
    // test's own.
    unsafe {
        assert_eq!(cuCtxCreate_v2(&mut ctx, 0, 0), 0);
        assert_eq!(cuEventCreate(&mut e, 0), 0);
        assert_eq!(cuCtxDestroy_v2(ctx), 0);
        assert_eq!(cuCtxPushCurrent_v2(ctx), CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(
            cuEventRecord(e, std::ptr::null_mut()),
            CUDA_ERROR_INVALID_CONTEXT
        );
        assert_eq!(cuEventQuery(e), CUDA_ERROR_INVALID_CONTEXT);
    }
    let log = std::fs::read_to_string(sim().unwrap().dir.join("dead-context.log")).unwrap();
    let mine: Vec<&str> = log
        .lines()
        .filter(|l| l.ends_with(&format!("{:#x}", ctx as usize)))
        .collect();
    assert_eq!(mine.len(), 3, "{log}");
    assert!(mine[0].contains(" cuCtxPushCurrent_v2 "), "{log}");
    assert!(mine[1].contains(" cuEventRecord "), "{log}");
    d.enter();
}

/// A green context is made from a descriptor of the device's SMs with
/// `CU_GREEN_CTX_DEFAULT_STREAM` (required), is not made current, is
/// used through the context `cuCtxFromGreenCtx` gives, and takes that
/// context with it when destroyed.
#[test]
fn a_green_context_is_used_through_its_context_which_goes_with_it() {
    let d = dev();
    let mut sms = [0u8; 144];
    let (mut desc, mut green, mut ctx, mut was, mut cur) = (
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
        std::ptr::null_mut(),
    );
    // SAFETY: out-pointers to locals and a CUdevResource-sized buffer;
    // the green context is this test's own.
    unsafe {
        assert_eq!(
            cuDeviceGetDevResource(0, sms.as_mut_ptr(), DEV_RESOURCE_TYPE_SM),
            0
        );
        assert_eq!(
            u32::from_ne_bytes(sms[96..100].try_into().unwrap()),
            DEVICE_SMS
        );
        assert_eq!(cuDevResourceGenerateDesc(&mut desc, sms.as_ptr(), 1), 0);
        assert_eq!(
            cuGreenCtxCreate(&mut green, desc, 0, 0),
            CUDA_ERROR_INVALID_VALUE,
            "CU_GREEN_CTX_DEFAULT_STREAM is required"
        );
        assert_eq!(cuCtxGetCurrent(&mut was), 0);
        assert_eq!(
            cuGreenCtxCreate(&mut green, desc, 0, GREEN_CTX_DEFAULT_STREAM),
            0
        );
        assert_eq!(cuCtxGetCurrent(&mut cur), 0);
        assert_eq!(cur, was, "not made current");
        assert_eq!(cuCtxFromGreenCtx(&mut ctx, green), 0);
        assert_ne!(ctx, was);
        assert_eq!(cuCtxPushCurrent_v2(ctx), 0);
        assert_eq!(cuCtxSynchronize(), 0);
        assert_eq!(cuGreenCtxDestroy(green), 0);
        assert_eq!(cuCtxGetCurrent(&mut cur), 0);
        assert_eq!(cur, was, "the green context's context left the stack");
        assert_eq!(cuCtxPushCurrent_v2(ctx), CUDA_ERROR_INVALID_CONTEXT);
        assert_eq!(
            cuCtxFromGreenCtx(&mut ctx, green),
            CUDA_ERROR_INVALID_HANDLE
        );
    }
    d.enter();
}
