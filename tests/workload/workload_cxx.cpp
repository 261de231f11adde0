/* gem-workload-cxx: a CUDA program with a C++ runtime of its own, as
 * PyTorch has, linked against libcuda.so.1. It launches 20 kernels of
 * 100 µs and waits for them (the hook connects to gem-schd then, loading
 * libgemzmq.so with the C++ runtime linked into it), then uses its own
 * runtime: an exception thrown and caught, a number formatted in a
 * locale, four threads. Prints
 *   cxx caught=thrown formatted=1234.5 kernels=20 threads=6
 * and exits 0, or says what failed and exits 1.
 */
#include <iostream>
#include <locale>
#include <sstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

extern "C" {
typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext, *CUmodule, *CUfunction, *CUstream;
CUresult cuInit(unsigned int);
CUresult cuDeviceGet(CUdevice *, int);
CUresult cuCtxCreate_v2(CUcontext *, unsigned int, CUdevice);
CUresult cuModuleLoadData(CUmodule *, const void *);
CUresult cuModuleGetFunction(CUfunction *, CUmodule, const char *);
CUresult cuLaunchKernel(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                        unsigned, CUstream, void **, void **);
CUresult cuStreamSynchronize(CUstream);
}

static void check(CUresult r, const char *what) {
    if (r != 0) throw std::runtime_error(std::string(what) + " failed: " + std::to_string(r));
}

int main() {
    try {
        CUdevice dev;
        CUcontext ctx;
        CUmodule mod;
        CUfunction fn;
        check(cuInit(0), "cuInit");
        check(cuDeviceGet(&dev, 0), "cuDeviceGet");
        check(cuCtxCreate_v2(&ctx, 0, dev), "cuCtxCreate");
        check(cuModuleLoadData(&mod, "fakecuda"), "cuModuleLoadData");
        check(cuModuleGetFunction(&fn, mod, "fake_spin"), "cuModuleGetFunction");
        unsigned long long kernel_us = 100;
        void *params[1] = {&kernel_us};
        int kernels = 0;
        for (int i = 0; i < 20; i++) {
            check(cuLaunchKernel(fn, 1, 1, 1, 1, 1, 1, 0, nullptr, params, nullptr),
                  "cuLaunchKernel");
            kernels++;
        }
        check(cuStreamSynchronize(nullptr), "cuStreamSynchronize");
        std::string caught;
        try {
            throw std::invalid_argument("thrown");
        } catch (const std::exception &e) {
            caught = e.what();
        }
        std::ostringstream formatted;
        formatted.imbue(std::locale::classic());
        formatted << 1234.5;
        int part[4] = {};
        std::vector<std::thread> threads;
        for (int t = 0; t < 4; t++) threads.emplace_back([&part, t] { part[t] = t; });
        for (auto &t : threads) t.join();
        std::cout << "cxx caught=" << caught << " formatted=" << formatted.str()
                  << " kernels=" << kernels << " threads=" << part[0] + part[1] + part[2] + part[3]
                  << std::endl;
        return 0;
    } catch (const std::exception &e) {
        std::cerr << "gem-workload-cxx: " << e.what() << std::endl;
        return 1;
    }
}
