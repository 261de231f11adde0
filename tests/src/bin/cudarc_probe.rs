//! Loads the driver through cudarc (dynamic loading), as `gem-holder`
//! will: context, a kernel launch from a module, an allocation, a copy and
//! memory info. Prints `cudarc-probe ok pools=<0|1> free=<bytes>`; the
//! simulator test runs it to prove cudarc can drive the simulator.

// A tool of the test suite: on failure it stops loudly, which is its job.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use cudarc::driver::{CudaContext, LaunchConfig, PushKernelArg};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let ctx = CudaContext::new(0)?;
    let stream = ctx.default_stream();
    let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src("// fakecuda\n"))?;
    let f = module.load_function("fake_spin")?;
    let buf = stream.alloc_zeros::<u8>(64 << 20)?;
    let us: u64 = 2000;
    let mut launch = stream.launch_builder(&f);
    launch.arg(&us);
    // SAFETY: the simulator's fake_spin takes one u64 (microseconds).
    unsafe { launch.launch(LaunchConfig::for_num_elems(1))? };
    stream.synchronize()?;
    let host = stream.clone_dtoh(&buf.slice(0..16))?;
    assert!(host.iter().all(|&b| b == 0));
    let (free, _total) = cudarc::driver::result::mem_get_info()?;
    println!(
        "cudarc-probe ok pools={} free={free}",
        ctx.has_async_alloc() as u8
    );
    drop(buf);
    Ok(())
}
