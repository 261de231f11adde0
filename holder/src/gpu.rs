//! The holder's GPU work, through cudarc with the driver loaded
//! dynamically (no CUDA toolkit needed): a one-block, one-thread kernel
//! that spins on `%globaltimer` for a given number of nanoseconds — the
//! smallest work that NVML counts as a busy device, and one whose length is
//! exact whatever the clock — and memory held in chunks. Utilisation comes
//! from NVML (`libnvidia-ml.so.1`, loaded dynamically) where present.

use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::sync::Arc;

/// The spin kernel, PTX (JIT-compiled by the driver for any GPU since
/// sm_50).
const SPIN_PTX: &str = r#"
.version 6.0
.target sm_50
.address_size 64

.visible .entry gemini_spin(
    .param .u64 gemini_spin_param_0
)
{
    .reg .pred %p<2>;
    .reg .b64 %rd<6>;

    ld.param.u64 %rd1, [gemini_spin_param_0];
    mov.u64 %rd2, %globaltimer;
$L_loop:
    mov.u64 %rd3, %globaltimer;
    sub.s64 %rd4, %rd3, %rd2;
    setp.lt.u64 %p1, %rd4, %rd1;
    @%p1 bra $L_loop;
    ret;
}
"#;

/// One device as the holder uses it.
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    spin: CudaFunction,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .finish()
    }
}

/// An error as a person reads it: a driver error by its name and
/// description (`CUDA_ERROR_INVALID_DEVICE: invalid device ordinal`), not
/// cudarc's `DriverError(…)` debug form.
pub fn describe(e: &anyhow::Error) -> String {
    let Some(d) = e.downcast_ref::<cudarc::driver::DriverError>() else {
        return format!("{e:#}");
    };
    let name = d.error_name().map_or_else(
        |_| format!("CUDA error {}", d.0 as i32),
        |n| n.to_string_lossy().into_owned(),
    );
    match d.error_string() {
        Ok(text) => format!("{name}: {}", text.to_string_lossy()),
        Err(_) => name,
    }
}

/// Number of devices the driver reports.
pub fn device_count() -> anyhow::Result<u32> {
    Ok(CudaContext::device_count()? as u32)
}

impl Gpu {
    /// Opens device `ordinal` and loads the spin kernel.
    pub fn open(ordinal: u32) -> anyhow::Result<Gpu> {
        let ctx = CudaContext::new(ordinal as usize)?;
        let stream = ctx.new_stream()?;
        let module = ctx.load_module(cudarc::nvrtc::Ptx::from_src(SPIN_PTX))?;
        let spin = module.load_function("gemini_spin")?;
        Ok(Gpu { ctx, stream, spin })
    }

    /// Device-wide (free, total) memory.
    pub fn mem_info(&self) -> anyhow::Result<(u64, u64)> {
        self.ctx.bind_to_thread()?;
        let (free, total) = cudarc::driver::result::mem_get_info()?;
        Ok((free as u64, total as u64))
    }

    /// Allocates `bytes` of device memory (not initialised: it is only held).
    pub fn alloc(&self, bytes: u64) -> anyhow::Result<CudaSlice<u8>> {
        // SAFETY: the memory is never read, only held and freed.
        Ok(unsafe { self.stream.alloc::<u8>(bytes as usize) }?)
    }

    /// Launches one spin of `ns` nanoseconds; the event completes with it.
    pub fn spin(&self, ns: u64) -> anyhow::Result<CudaEvent> {
        let mut b = self.stream.launch_builder(&self.spin);
        b.arg(&ns);
        let cfg = LaunchConfig {
            grid_dim: (1, 1, 1),
            block_dim: (1, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: gemini_spin takes exactly one u64, passed here.
        unsafe { b.launch(cfg) }?;
        // Waited for by the meter's thread: blocking, not spinning a CPU
        // for as long as the device is held.
        Ok(self.stream.record_event(Some(
            cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
        ))?)
    }

    /// Waits for all the holder's work on the device.
    pub fn synchronize(&self) -> anyhow::Result<()> {
        Ok(self.stream.synchronize()?)
    }
}

/// NVML's utilisation figure, when `libnvidia-ml.so.1` is there.
pub struct Nvml(nvml_wrapper::Nvml);

impl std::fmt::Debug for Nvml {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Nvml")
    }
}

impl Nvml {
    /// Loads and initialises NVML, or `None` where there is none.
    pub fn load() -> Option<Nvml> {
        nvml_wrapper::Nvml::builder()
            .lib_path(std::ffi::OsStr::new("libnvidia-ml.so.1"))
            .init()
            .ok()
            .map(Nvml)
    }

    /// Device memory in use on device `index`, bytes.
    pub fn used_memory(&self, index: u32) -> Option<u64> {
        Some(self.0.device_by_index(index).ok()?.memory_info().ok()?.used)
    }

    /// Device memory that processes other than `me` use on device
    /// `index` (its contexts included), bytes; `None` where NVML cannot
    /// say.
    pub fn others_memory(&self, index: u32, me: u32) -> Option<u64> {
        let procs = self
            .0
            .device_by_index(index)
            .ok()?
            .running_compute_processes()
            .ok()?;
        Some(
            procs
                .iter()
                .filter(|p| p.pid != me)
                .map(|p| match p.used_gpu_memory {
                    nvml_wrapper::enums::device::UsedGpuMemory::Used(b) => b,
                    nvml_wrapper::enums::device::UsedGpuMemory::Unavailable => 0,
                })
                .sum(),
        )
    }

    /// Share of recent time device `index` (NVML's index, the physical one)
    /// ran a kernel, 0..1.
    pub fn utilisation(&self, index: u32) -> Option<f64> {
        let u = self
            .0
            .device_by_index(index)
            .ok()?
            .utilization_rates()
            .ok()?;
        Some(f64::from(u.gpu) / 100.0)
    }
}
