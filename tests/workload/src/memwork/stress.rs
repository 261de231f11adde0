//! Random memory traffic on many threads.

use crate::*;

/// xorshift64*: each thread's own random numbers.
pub(crate) struct Rng(pub(crate) u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// One stress thread: until `until`, random operations; what it holds at
/// the end stays held.
pub(crate) fn stress_thread(
    cuda: &Cuda,
    tid: u64,
    devices: i32,
    kinds: &[u64],
    bytes: Option<u64>,
    until: Instant,
) -> anyhow::Result<u64> {
    let dev = (tid % devices.max(1) as u64) as i32;
    make_current(cuda, dev)?;
    let stream = new_stream(cuda)?;
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

pub(crate) fn stress(
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
        retain(cuda, dev)?;
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
