/* gem-workload-c: a CUDA client linked against libcuda.so.1 that calls the
 * driver's exported symbols directly (no cuGetProcAddress), as programs
 * built with the driver API do. Prints one key=value line like
 * gem-workload.
 *
 * usage: gem-workload-c [-k kernel_us] [-s seconds] [-m mem_bytes]
 *                       [-b burst_ms] [-g gap_ms] [-d device] [-f (fork)]
 *                       [-t then_device] [-x]
 *
 * -t D: after the run (its last sync returned, its token still held),
 *       launch one kernel on device D and sync, saying "waiting on D" on
 *       stdout first.
 * -x:   SIGTERM calls exit(3) from its signal handler, as many C and C++
 *       programs' handlers do.
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <signal.h>
#include <sys/wait.h>

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
typedef unsigned long long CUdeviceptr;

CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuCtxSynchronize(void);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuMemAlloc_v2(CUdeviceptr *, size_t);
CUresult cuMemFree_v2(CUdeviceptr);
CUresult cuMemGetInfo_v2(size_t *, size_t *);
CUresult cuStreamSynchronize(CUstream);

static double now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec / 1e9;
}

#define CHECK(call)                                                              \
    do {                                                                         \
        CUresult r_ = (call);                                                    \
        if (r_ != 0) {                                                           \
            fprintf(stderr, "gem-workload-c: %s failed with CUresult %d\n", #call, r_); \
            return 1;                                                            \
        }                                                                        \
    } while (0)

static void exit_on_term(int sig) {
    (void)sig;
    exit(3);
}

static int run(uint64_t kernel_us, double seconds, size_t mem, double burst_ms, double gap_ms,
               int device, int then_device, const char *role) {
    double start = now();
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction fn;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, device));
    CHECK(cuCtxCreate_v2(&ctx, 0, dev));
    CHECK(cuModuleLoadData(&mod, "fakecuda"));
    CHECK(cuModuleGetFunction(&fn, mod, "fake_spin"));
    CUdeviceptr ptr = 0;
    int alloc_error = 0;
    size_t allocated = 0, free_b = 0, total_b = 0;
    if (mem > 0) {
        alloc_error = cuMemAlloc_v2(&ptr, mem);
        if (alloc_error == 0) allocated = mem;
    }
    CHECK(cuMemGetInfo_v2(&free_b, &total_b));
    void *params[1] = {&kernel_us};
    unsigned long long kernels = 0;
    double end = start + seconds;
    while (now() < end) {
        double burst_end = burst_ms > 0 ? now() + burst_ms / 1e3 : end;
        while (now() < burst_end && now() < end) {
            CHECK(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, 0, params, 0));
            kernels++;
        }
        CHECK(cuStreamSynchronize(0));
        if (gap_ms > 0 && now() < end) usleep((useconds_t)(gap_ms * 1e3));
    }
    CHECK(cuCtxSynchronize());
    if (then_device >= 0) {
        CUdevice dev2;
        CUcontext ctx2;
        CUmodule mod2;
        CUfunction fn2;
        CHECK(cuDeviceGet(&dev2, then_device));
        CHECK(cuCtxCreate_v2(&ctx2, 0, dev2));
        CHECK(cuModuleLoadData(&mod2, "fakecuda"));
        CHECK(cuModuleGetFunction(&fn2, mod2, "fake_spin"));
        printf("waiting on %d\n", then_device);
        fflush(stdout);
        CHECK(cuLaunchKernel(fn2, 1, 1, 1, 1, 1, 1, 0, 0, params, 0));
        CHECK(cuCtxSynchronize());
    }
    if (ptr) CHECK(cuMemFree_v2(ptr));
    printf("workload pid=%d role=%s kernels=%llu kernel_us=%llu seconds=%.3f "
           "allocated=%zu alloc_error=%d free=%zu total=%zu\n",
           (int)getpid(), role, kernels, (unsigned long long)kernel_us, now() - start,
           allocated, alloc_error, free_b, total_b);
    fflush(stdout);
    return 0;
}

int main(int argc, char **argv) {
    uint64_t kernel_us = 1000;
    double seconds = 1, burst_ms = 0, gap_ms = 0;
    size_t mem = 0;
    int device = 0, then_device = -1, do_fork = 0, opt;
    while ((opt = getopt(argc, argv, "k:s:m:b:g:d:ft:x")) != -1) {
        switch (opt) {
        case 'k': kernel_us = strtoull(optarg, 0, 10); break;
        case 's': seconds = atof(optarg); break;
        case 'm': mem = strtoull(optarg, 0, 10); break;
        case 'b': burst_ms = atof(optarg); break;
        case 'g': gap_ms = atof(optarg); break;
        case 'd': device = atoi(optarg); break;
        case 'f': do_fork = 1; break;
        case 't': then_device = atoi(optarg); break;
        case 'x': signal(SIGTERM, exit_on_term); break;
        default:
            fprintf(stderr, "usage: %s [-k kernel_us] [-s seconds] [-m bytes] [-b burst_ms] [-g gap_ms] [-d device] [-f] [-t then_device] [-x]\n", argv[0]);
            return 2;
        }
    }
    pid_t child = do_fork ? fork() : -1;
    if (child == 0) return run(kernel_us, seconds, mem, burst_ms, gap_ms, device, then_device, "child");
    int rc = run(kernel_us, seconds, mem, burst_ms, gap_ms, device, then_device, "parent");
    if (child > 0) {
        int status = 0;
        waitpid(child, &status, 0);
        if (status != 0) rc = 1;
    }
    return rc;
}
