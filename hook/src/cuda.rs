//! CUDA's result type and every result code the hook returns or tests,
//! with `cuda.h`'s names and values. The bottom layer with `log`, `clock`
//! and `real`: it depends on nothing in the hook.

/// `CUresult`.
pub type CUresult = u32;

/// `CUDA_SUCCESS`.
pub const CUDA_SUCCESS: CUresult = 0;
/// `CUDA_ERROR_INVALID_VALUE`: a null out-pointer.
pub const CUDA_ERROR_INVALID_VALUE: CUresult = 1;
/// `CUDA_ERROR_OUT_OF_MEMORY`: the group's `MemoryLimit` (or the device)
/// has no room.
pub const CUDA_ERROR_OUT_OF_MEMORY: CUresult = 2;
/// `CUDA_ERROR_NOT_INITIALIZED`: no scheduler could be reached in time.
pub const CUDA_ERROR_NOT_INITIALIZED: CUresult = 3;
/// `CUDA_ERROR_DEINITIALIZED`: the driver is shutting down.
pub const CUDA_ERROR_DEINITIALIZED: CUresult = 4;
/// `CUDA_ERROR_NOT_FOUND`: the real driver lacks a function.
pub const CUDA_ERROR_NOT_FOUND: CUresult = 500;
/// `CUDA_ERROR_NOT_READY`: work not completed yet.
pub const CUDA_ERROR_NOT_READY: CUresult = 600;
/// `CUDA_ERROR_NOT_PERMITTED`: the scheduler refused this process (or
/// this GPU).
pub const CUDA_ERROR_NOT_PERMITTED: CUresult = 800;
/// `CUDA_ERROR_UNKNOWN`: the hook itself failed unexpectedly.
pub const CUDA_ERROR_UNKNOWN: CUresult = 999;
