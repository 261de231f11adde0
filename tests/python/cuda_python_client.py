"""A CUDA client that no one in this project wrote: NVIDIA's cuda-python
(`cuda.bindings.driver`, which finds every entry point through
cuGetProcAddress as the CUDA runtime does) with a kernel compiled by NVRTC.

Prints key=value lines: the memory the driver reports, launches made, and
the result of allocating more than the group's limit.

usage: cuda_python_client.py SECONDS ALLOC_MIB
"""

import sys
import time

from cuda.bindings import driver as cu
from cuda.bindings import nvrtc

seconds, alloc_mib = float(sys.argv[1]), int(sys.argv[2])


def ok(result):
    err, *rest = result
    if err != cu.CUresult.CUDA_SUCCESS:
        raise SystemExit(f"cuda-python: driver call failed: {err}")
    return rest[0] if len(rest) == 1 else rest


def nvrtc_ok(result):
    err, *rest = result
    if err != nvrtc.nvrtcResult.NVRTC_SUCCESS:
        raise SystemExit(f"cuda-python: NVRTC failed: {err}")
    return rest[0] if len(rest) == 1 else rest


# The simulator times a kernel by its name: fixed_1000us runs 1 ms.
source = b'extern "C" __global__ void fixed_1000us(float *x) { if (x) x[threadIdx.x] += 1.0f; }'
prog = nvrtc_ok(nvrtc.nvrtcCreateProgram(source, b"kernel.cu", 0, [], []))
nvrtc_ok(nvrtc.nvrtcCompileProgram(prog, 1, [b"--gpu-architecture=compute_90"]))
size = nvrtc_ok(nvrtc.nvrtcGetPTXSize(prog))
ptx = b" " * size
nvrtc_ok(nvrtc.nvrtcGetPTX(prog, ptx))
print(f"ptx_bytes={size}")

ok(cu.cuInit(0))
device = ok(cu.cuDeviceGet(0))
ctx = ok(cu.cuDevicePrimaryCtxRetain(device))
ok(cu.cuCtxSetCurrent(ctx))
free, total = ok(cu.cuMemGetInfo())
print(f"mem_free={free} mem_total={total}")
module = ok(cu.cuModuleLoadData(ptx))
kernel = ok(cu.cuModuleGetFunction(module, b"fixed_1000us"))

# CLOCK_MONOTONIC, as the simulator's busy log: the test measures the
# loop, however long the imports and the compilation took before it.
print(f"loop_start_ns={time.monotonic_ns()}")
start = time.time()
launches = 0
while time.time() - start < seconds:
    ok(cu.cuLaunchKernel(kernel, 1, 1, 1, 32, 1, 1, 0, 0, 0, 0))
    launches += 1
    if launches % 10 == 0:
        ok(cu.cuCtxSynchronize())
ok(cu.cuCtxSynchronize())
print(f"launches={launches} seconds={time.time() - start:.3f}")

err, ptr = cu.cuMemAlloc(alloc_mib << 20)
print(f"alloc_error={int(err)}")
if err == cu.CUresult.CUDA_SUCCESS:
    ok(cu.cuMemFree(ptr))
