"""A CUDA client that no one in this project wrote: numba-cuda, which
compiles Python kernels with NVVM and drives them through cuda-python's
driver bindings (cuLibraryLoadData, cuLibraryGetKernel, cuLaunchKernelEx
on the CUkernel), with no CUDA runtime.

Prints key=value lines: the memory the driver reports, launches made, the
bytes held on the device after allocating some, and the result of
allocating more than the group's limit.

usage: numba_client.py SECONDS HOLD_MIB ALLOC_MIB
"""

import sys
import time

import numpy as np
from numba import cuda
from numba.cuda.cudadrv.driver import CudaAPIError

seconds, hold_mib, alloc_mib = float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])


@cuda.jit
def add_one(x):
    i = cuda.grid(1)
    if i < x.size:
        x[i] += 1.0


free, total = cuda.current_context().get_memory_info()
print(f"mem_free={free} mem_total={total}")
held = cuda.device_array(hold_mib << 18, dtype=np.float32)
x = cuda.to_device(np.zeros(32, dtype=np.float32))
# The first launch compiles the kernel (NVVM): seconds under load. It
# runs before the loop, whose launches are what is measured.
add_one[1, 32](x)
cuda.synchronize()
# CLOCK_MONOTONIC, as the simulator's busy log: the test measures the
# loop, however long the imports and the compilation took before it.
print(f"loop_start_ns={time.monotonic_ns()}")
start = time.time()
launches = 0
while time.time() - start < seconds:
    add_one[1, 32](x)
    launches += 1
    if launches % 10 == 0:
        cuda.synchronize()
cuda.synchronize()
print(f"launches={launches} seconds={time.time() - start:.3f}")
free_after, _ = cuda.current_context().get_memory_info()
print(f"mem_free_holding={free_after}")
try:
    big = cuda.device_array(alloc_mib << 18, dtype=np.float32)
    alloc_error = 0
except CudaAPIError as e:
    alloc_error = int(e.code)
print(f"alloc_error={alloc_error}")
