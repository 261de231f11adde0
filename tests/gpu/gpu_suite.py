#!/usr/bin/env python3
"""`make test-gpu`: gemini's scenarios on a real NVIDIA GPU with PyTorch.

Needs only what a GPU machine with the NVIDIA driver, PyTorch and Python
has, plus gemini's release binaries (GEMINI_BIN_DIR, default
target/release). Exits 0 with "no NVIDIA GPU found, skipped" where there is
no GPU. Writes docs/gpu-results.md (or the path given as the argument).

Scenarios: memory cap seen by torch.cuda.mem_get_info and an OOM error
beyond it (caching allocator, cudaMallocAsync and expandable segments);
memory a cudaMallocAsync pool keeps after a free; nvidia-smi inside a job;
torch.cuda.graph capture beside a launching thread; two groups
MinUtil 0.3/0.7 with shares from iteration rates relative to a solo run;
a MaxUtil 0.5 cap; CUDA graphs gated; holder utilisation from NVML at
hold-util 0.5 and 1.0 and the first-iteration time of a job arriving at a
held GPU; hook overhead on a small training loop against no hook.
"""

import ctypes
import datetime
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

BIN = os.path.abspath(os.environ.get("GEMINI_BIN_DIR", "target/release"))
OUT = sys.argv[1] if len(sys.argv) > 1 else "docs/gpu-results.md"

WORKER = r'''
import json, sys, time, os
import torch
mode, secs = sys.argv[1], float(sys.argv[2])
dev = torch.device("cuda")
out = {}
if mode in ("matmul", "graph"):
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    y = x @ x
    torch.cuda.synchronize()
    t_first = time.time()
    step = lambda: torch.matmul(x, x, out=y)
    if mode == "graph":
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(10):
                step()
        step = g.replay
    step(); torch.cuda.synchronize()
    out["first_iter_s"] = time.time() - t_first
    n, t0 = 0, time.time()
    while time.time() - t0 < secs:
        for _ in range(10):
            step()
        torch.cuda.synchronize()
        n += 10
    out["rate"] = n / (time.time() - t0)
elif mode == "train":
    model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.ReLU(), torch.nn.Linear(4096, 1024)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(256, 1024, device=dev)
    for _ in range(20):
        opt.zero_grad(); model(data).square().mean().backward(); opt.step()
    torch.cuda.synchronize()
    n, t0 = 0, time.time()
    while time.time() - t0 < secs:
        opt.zero_grad(); model(data).square().mean().backward(); opt.step()
        n += 1
        if n % 50 == 0:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    out["rate"] = n / (time.time() - t0)
elif mode == "capture":
    # torch.cuda.graph in global mode (its default) while another thread
    # keeps launching and synchronising on its own stream; captured
    # launches are slowed so the hook's tokens run out during the capture.
    import threading
    x = torch.randn(2048, 2048, device=dev)
    y = x @ x
    torch.cuda.synchronize()
    stop = threading.Event()
    def beside():
        s2 = torch.cuda.Stream()
        z = torch.randn(1024, 1024, device=dev)
        with torch.cuda.stream(s2):
            while not stop.is_set():
                for _ in range(5):
                    z @ z
                s2.synchronize()
                time.sleep(0.006)
    t = threading.Thread(target=beside)
    t.start()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(3):
            torch.matmul(x, x, out=y)
    torch.cuda.current_stream().wait_stream(s)
    try:
        with torch.cuda.graph(g):
            for _ in range(100):
                torch.matmul(x, x, out=y)
                time.sleep(0.002)
        out["captured"] = True
    except Exception as e:
        out["captured"] = False
        out["error"] = str(e).splitlines()[0][:160]
    stop.set()
    t.join()
    if out["captured"]:
        g.replay()
        torch.cuda.synchronize()
        out["replayed"] = True
elif mode == "poolkeep":
    # cudaMallocAsync keeps what is freed (release threshold: all).
    a = torch.empty(2**30, dtype=torch.uint8, device=dev)
    del a
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out["free_after_free"], out["total"] = free, total
elif mode == "memcap":
    free, total = torch.cuda.mem_get_info()
    out["free"], out["total"] = free, total
    a = torch.empty(int(1.5 * 2**30), dtype=torch.uint8, device=dev)
    out["first_ok"] = True
    try:
        b = torch.empty(2**30, dtype=torch.uint8, device=dev)
        out["oom"] = False
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = True
        out["oom_message"] = str(e).splitlines()[0][:160]
print("RESULT " + json.dumps(out), flush=True)
'''


def gpu_present():
    if shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


class Gemini:
    def __init__(self, conf):
        self.dir = tempfile.mkdtemp(prefix="gemini-gpu-")
        self.ipc = os.path.join(self.dir, "ipc")
        self.conf = os.path.join(self.dir, "resource.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        self.log = open(os.path.join(self.dir, "schd.log"), "w")
        self.schd = subprocess.Popen([f"{BIN}/gem-schd", "--config", self.conf, "--ipc-dir", self.ipc, "--devices", "1"], stderr=self.log)
        for _ in range(100):
            if subprocess.run([f"{BIN}/gem-schd", "status", "--ipc-dir", self.ipc], capture_output=True).returncode == 0:
                return
            time.sleep(0.1)
        raise RuntimeError("gem-schd did not start")

    def env(self, group, hooked=True, extra=None):
        e = dict(os.environ)
        if hooked:
            e.update(LD_PRELOAD=f"{BIN}/libgemhook.so", GEMINI_GROUP_NAME=group, GEMINI_IPC_DIR=self.ipc)
        e.update(extra or {})
        return e

    def worker(self, group, mode, secs, hooked=True, extra=None):
        return subprocess.Popen([sys.executable, "-c", WORKER, mode, str(secs)], env=self.env(group, hooked, extra),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def close(self):
        self.schd.terminate()
        self.schd.wait()


def result(p):
    out, err = p.communicate()
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"worker failed: {err[-2000:]}")


class Nvml:
    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.lib.nvmlInit_v2()
        self.h = ctypes.c_void_p()
        self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h))

    def util(self):
        u = (ctypes.c_uint * 2)()
        self.lib.nvmlDeviceGetUtilizationRates(self.h, u)
        return u[0] / 100.0

    def mean_util(self, secs):
        xs = []
        t0 = time.time()
        while time.time() - t0 < secs:
            time.sleep(0.2)
            xs.append(self.util())
        return sum(xs) / len(xs)


def main():
    if not gpu_present():
        print("no NVIDIA GPU found, skipped")
        return 0
    for b in ("gem-schd", "gem-holder", "libgemhook.so"):
        if not os.path.exists(f"{BIN}/{b}"):
            print(f"{BIN}/{b} missing: build with `cargo build --release --workspace` (or set GEMINI_BIN_DIR)")
            return 1
    import torch  # noqa: F401  (fails clearly if PyTorch is missing)
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    rows = []

    def row(what, measured, target=""):
        print(f"{what}: {measured}", flush=True)
        rows.append((what, measured, target))

    g = Gemini("[solo]\n[mem]\nMemoryLimit=2GiB\n[a]\nMinUtil=0.3\n[b]\nMinUtil=0.7\n[half]\nMaxUtil=0.5\n")
    try:
        for conf in ("backend:native", "backend:cudaMallocAsync", "expandable_segments:True"):
            r = result(g.worker("mem", "memcap", 0, extra={"PYTORCH_CUDA_ALLOC_CONF": conf}))
            row(f"memory cap 2 GiB ({conf}): mem_get_info total", f"{r['total'] / 2**30:.2f} GiB", "2.00 GiB")
            row(f"memory cap ({conf}): 1.5 GiB then 1 GiB more", "OutOfMemoryError" if r.get("oom") else "allocated (cap NOT enforced)", "OutOfMemoryError")
        r = result(g.worker("mem", "poolkeep", 0, extra={"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"}))
        row("cudaMallocAsync: 1 GiB allocated, freed, synchronised: mem_get_info free (the pool keeps it)", f"{r['free_after_free'] / 2**30:.2f} GiB of {r['total'] / 2**30:.2f}", "≤ 1.00 GiB of 2.00")
        smi_job = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], env=g.env("mem"), capture_output=True, text=True)
        row("nvidia-smi inside a job of MemoryLimit 2 GiB: memory.total", f"{smi_job.stdout.strip() or smi_job.stderr.strip()[:80]} MiB", "2048 MiB")
        r = result(g.worker("solo", "capture", 0, extra={"GEMINI_IDLE_MS": "2"}))
        row("torch.cuda.graph (global capture) beside a launching thread, tokens ending during it", "captured and replayed" if r.get("replayed") else f"FAILED: {r.get('error')}", "captured and replayed")
        solo = result(g.worker("solo", "matmul", 10))["rate"]
        plain = result(g.worker("solo", "matmul", 10, hooked=False))["rate"]
        row("matmul 4096² bf16, solo under the hook / without", f"{solo:.1f} / {plain:.1f} it/s")
        pa, pb = g.worker("a", "matmul", 20), g.worker("b", "matmul", 20)
        ra, rb = result(pa)["rate"], result(pb)["rate"]
        row("two groups MinUtil 0.3 / 0.7 (share = rate / solo rate)", f"{ra / solo:.3f} / {rb / solo:.3f}", "0.30 / 0.70 ± 0.03")
        rh = result(g.worker("half", "matmul", 10))["rate"]
        row("MaxUtil 0.5, lone", f"{rh / solo:.3f}", "0.50 ± 0.03")
        gsolo = result(g.worker("solo", "graph", 10))["rate"]
        ghalf = result(g.worker("half", "graph", 10))["rate"]
        row("CUDA graphs under MaxUtil 0.5 (rate / solo graph rate)", f"{ghalf / gsolo:.3f}", "0.50 ± 0.03")
        th = result(g.worker("solo", "train", 15))["rate"]
        tp = result(g.worker("solo", "train", 15, hooked=False))["rate"]
        row("training loop it/s with hook / without", f"{th:.1f} / {tp:.1f} ({100 * (1 - th / tp):.1f} % overhead)", "≤ 2 %")
        nvml = Nvml()
        for util in ("0.5", "1.0"):
            h = subprocess.Popen([f"{BIN}/gem-holder", "run", "--wait-minutes", "0", "--hold-util", util], env=g.env("", hooked=False, extra={"GEMINI_IPC_DIR": g.ipc}), stderr=subprocess.DEVNULL)
            time.sleep(3)
            row(f"holder at hold-util {util}: NVML utilisation (mean of 5 s)", f"{nvml.mean_util(5):.3f}", f"{util} ± 0.02")
            if util == "1.0":
                first = result(g.worker("solo", "matmul", 1))["first_iter_s"]
                row("first matmul iteration of a job arriving at the held GPU", f"{first * 1e3:.1f} ms")
            subprocess.run([f"{BIN}/gem-holder", "shutdown"], env=g.env("", hooked=False, extra={"GEMINI_IPC_DIR": g.ipc}))
            h.wait(timeout=30)
        idle_first = result(g.worker("solo", "matmul", 1))["first_iter_s"]
        row("first matmul iteration, no holder", f"{idle_first * 1e3:.1f} ms")
    finally:
        g.close()

    date = datetime.date.today().isoformat()
    cuda = subprocess.run([sys.executable, "-c", "import torch; print(torch.version.cuda, torch.__version__)"], capture_output=True, text=True).stdout.strip()
    lines = [f"# gemini on a real GPU\n", f"`make test-gpu` on {date}: {smi}; CUDA / PyTorch {cuda}.\n", "| what | measured | target |", "|---|---|---|"]
    lines += [f"| {w} | {m} | {t} |" for w, m, t in rows]
    os.makedirs(os.path.dirname(OUT) or ".", exist_ok=True)
    with open(OUT, "a" if os.path.exists(OUT) else "w") as f:
        f.write("\n".join(lines) + "\n\n")
    print(f"appended to {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
