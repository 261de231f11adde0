#!/usr/bin/env python3
"""One workload of `make test-gpu`, run by gpu_suite.py with or without the
hook: `worker.py MODE JSON-PARAMS`. Prints one line `RESULT {json}` on
success; any exception ends it with a traceback and no RESULT line.

Timed modes (params["sync"]) warm up, print READY and read the window
{start, end} (time.time()) from stdin, so that the processes of one row
measure the same window.
"""

import json
import os
import sys
import threading
import time

GiB = 2**30


def wait_until(t):
    while True:
        d = t - time.time()
        if d <= 0:
            return
        time.sleep(min(d, 0.05))


def window(p):
    """The timed window: READY to the suite, then {start, end} from it."""
    print("READY", flush=True)
    w = json.loads(sys.stdin.readline())
    wait_until(w["start"])
    return w["end"]


def pct(xs, q):
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def done(out):
    print("RESULT " + json.dumps(out), flush=True)


# --- PyTorch ---------------------------------------------------------------


def torch_dev():
    import torch

    return torch, torch.device("cuda")


def mode_memcap(p):
    """mem_get_info, then an allocation of 3/4 of what is free, then one
    that goes past the rest by 512 MiB. Sizes come from params when given
    (the run without the hook takes the hooked run's sizes)."""
    torch, dev = torch_dev()
    torch.zeros(1, device=dev)
    free, total = torch.cuda.mem_get_info()
    first = p.get("first") or int(free * 0.75)
    second = p.get("second") or (free - first + 512 * 2**20)
    out = {"free": free, "total": total, "first": first, "second": second}
    a = torch.empty(first, dtype=torch.uint8, device=dev)
    out["first_ok"] = True
    try:
        b = torch.empty(second, dtype=torch.uint8, device=dev)
        b.fill_(1)
        torch.cuda.synchronize()
        out["oom"] = False
    except torch.cuda.OutOfMemoryError as e:
        out["oom"] = True
        out["oom_message"] = str(e).splitlines()[0][:200]
    del a
    done(out)


def mode_poolkeep(p):
    """cudaMallocAsync: half of what is free allocated, freed, synchronised:
    the pool keeps it (PyTorch sets the release threshold to the maximum)."""
    torch, dev = torch_dev()
    torch.zeros(1, device=dev)
    free0, total = torch.cuda.mem_get_info()
    n = p.get("size") or free0 // 2
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    a.fill_(0)
    del a
    torch.cuda.synchronize()
    free1, _ = torch.cuda.mem_get_info()
    done({"free_before": free0, "free_after": free1, "size": n, "total": total})


def mode_hold(p):
    """Allocates params["size"] bytes, says READY and sleeps until killed."""
    torch, dev = torch_dev()
    a = torch.empty(p["size"], dtype=torch.uint8, device=dev)
    a.fill_(1)
    torch.cuda.synchronize()
    print("READY", flush=True)
    time.sleep(600)
    done({})


def mode_alloc(p):
    torch, dev = torch_dev()
    t0 = time.time()
    try:
        a = torch.empty(p["size"], dtype=torch.uint8, device=dev)
        a.fill_(1)
        torch.cuda.synchronize()
        done({"ok": True, "seconds": time.time() - t0})
    except torch.cuda.OutOfMemoryError as e:
        done({"ok": False, "error": str(e).splitlines()[0][:200]})


def timed_kernels(torch, step, p):
    """Runs `step` (one kernel or one graph replay) in the timed window.
    GPU time is the sum over steps of end(i) - max(end(i-1), launched(i)):
    end from a CUDA event after each step, mapped to the host clock through
    a reference event, launched(i) the host time the launch returned. An
    event before each step would also count the time a launch waited for
    the hook's token while the GPU had reached the event."""
    end = window(p)
    ref = torch.cuda.Event(enable_timing=True)
    ref.record()
    torch.cuda.synchronize()
    t_ref = time.perf_counter()
    n, gpu, t0, prev = 0, 0.0, time.time(), t_ref
    batch = p.get("batch", 8)
    while time.time() < end:
        marks = []
        for _ in range(batch):
            step()
            launched = time.perf_counter()
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            marks.append((launched, e))
        torch.cuda.synchronize()
        for launched, e in marks:
            t_end = t_ref + ref.elapsed_time(e) / 1e3
            gpu += max(0.0, t_end - max(prev, launched))
            prev = t_end
        n += batch
    wall = time.time() - t0
    return {"steps": n, "rate": n / wall, "gpu_s": gpu, "wall_s": wall, "gpu_share": gpu / wall}


def mode_matmul(p):
    torch, dev = torch_dev()
    n = p.get("n", 4096)
    x = torch.randn(n, n, device=dev, dtype=torch.bfloat16)
    y = x @ x
    step = lambda: torch.matmul(x, x, out=y)  # noqa: E731
    if p.get("graph"):
        g = torch.cuda.CUDAGraph()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(s)
        with torch.cuda.graph(g):
            for _ in range(4):
                step()
        step = g.replay
    t_first = time.time()
    step()
    torch.cuda.synchronize()
    out = {"first_iter_s": time.time() - t_first}
    if p.get("sync"):
        out.update(timed_kernels(torch, step, p))
    done(out)


def mode_triton(p):
    torch, dev = torch_dev()
    import triton
    import triton.language as tl

    @triton.jit
    def spin(x_ptr, n, rounds, BLOCK: tl.constexpr):
        i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = i < n
        v = tl.load(x_ptr + i, mask=mask)
        for _ in range(rounds):
            v = v * 0.9999 + 0.0001
        tl.store(x_ptr + i, v, mask=mask)

    n = 1 << 24
    x = torch.ones(n, device=dev)
    grid = (triton.cdiv(n, 1024),)
    step = lambda: spin[grid](x, n, 400, BLOCK=1024)  # noqa: E731
    step()
    torch.cuda.synchronize()
    done(timed_kernels(torch, step, p))


def transformer(torch, dev):
    layer = torch.nn.TransformerEncoderLayer(1024, 16, 4096, batch_first=True, dtype=torch.bfloat16, device=dev)
    model = torch.nn.TransformerEncoder(layer, 6)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    data = torch.randn(32, 512, 1024, device=dev, dtype=torch.bfloat16)

    def step():
        opt.zero_grad(set_to_none=True)
        loss = model(data).float().square().mean()
        loss.backward()
        opt.step()
        return loss.item()

    return step


def mode_train(p):
    """Training steps (loss.item() each) from start to end: steps/s and
    the step time's percentiles."""
    torch, dev = torch_dev()
    step = transformer(torch, dev)
    for _ in range(3):
        step()
    end = window(p)
    times, t0 = [], time.time()
    while time.time() < end:
        s = time.perf_counter()
        step()
        times.append(time.perf_counter() - s)
    wall = time.time() - t0
    done({"rate": len(times) / wall, "p50_ms": 1e3 * pct(times, 0.5), "p99_ms": 1e3 * pct(times, 0.99), "max_ms": 1e3 * max(times)})


def mode_decode(p):
    """The latency issue's decode-like loop: 8 memory-bound bf16 MLP
    layers, batch 64, synchronise, then 5 ms of sleep."""
    torch, dev = torch_dev()
    ws = [(torch.randn(4096, 16384, device=dev, dtype=torch.bfloat16) * 0.01, torch.randn(16384, 4096, device=dev, dtype=torch.bfloat16) * 0.01) for _ in range(8)]
    x0 = torch.randn(64, 4096, device=dev, dtype=torch.bfloat16)

    def step():
        x = x0
        for a, b in ws:
            x = torch.relu(x @ a) @ b
        torch.cuda.synchronize()

    for _ in range(10):
        step()
    end = window(p)
    times = []
    while time.time() < end:
        s = time.perf_counter()
        step()
        times.append(time.perf_counter() - s)
        time.sleep(0.005)
    done({"steps": len(times), "p50_ms": 1e3 * pct(times, 0.5), "p99_ms": 1e3 * pct(times, 0.99), "max_ms": 1e3 * max(times)})


def mode_capture(p):
    """A capture that is legal for the driver while tokens end during it:
    torch.cuda.graph in thread-local mode (or relaxed) while another thread
    launches and synchronises on its own stream; captured launches are
    slowed (2 ms apart) so tokens run out mid-capture. The replay must give
    what eager execution gives."""
    torch, dev = torch_dev()
    x = torch.randn(1024, 1024, device=dev)
    y = torch.empty_like(x)
    torch.cuda.synchronize()
    stop = threading.Event()
    beside_steps = [0]

    def beside():
        s2 = torch.cuda.Stream()
        z = torch.randn(1024, 1024, device=dev)
        with torch.cuda.stream(s2):
            while not stop.is_set():
                for _ in range(5):
                    z = torch.tanh(z @ z)
                s2.synchronize()
                beside_steps[0] += 1
                time.sleep(0.003)

    def body():
        y.copy_(x)
        for _ in range(40):
            y.copy_(torch.tanh(y @ x) * 0.5)
            time.sleep(0.002)

    t = threading.Thread(target=beside)
    t.start()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        body()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g, capture_error_mode=p.get("capture_mode", "thread_local")):
        body()
    stop.set()
    t.join()
    y.zero_()
    g.replay()
    torch.cuda.synchronize()
    got = y.clone()
    body()
    torch.cuda.synchronize()
    err = (got - y).abs().max().item()
    done({"replayed": True, "max_abs_diff": err, "beside_steps": beside_steps[0]})


def mode_graphed(p):
    """torch.cuda.make_graphed_callables on an MLP, trained for 30 steps
    with graphed forward and backward; the loss must fall as it does
    eagerly."""
    torch, dev = torch_dev()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    data = torch.randn(256, 512, device=dev)
    target = torch.randn(256, 512, device=dev) * 0.1
    graphed = torch.cuda.make_graphed_callables(model, (data,))
    losses = []
    for _ in range(30):
        opt.zero_grad(set_to_none=False)
        loss = (graphed(data) - target).square().mean()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        time.sleep(0.003)
    done({"first_loss": losses[0], "last_loss": losses[-1], "fell": losses[-1] < losses[0] * 0.9})


# --- other frameworks ------------------------------------------------------


def mode_jax(p):
    """JAX with its default preallocation (or the platform allocator when
    params["platform"]): what it takes as its limit, then an array of
    params["bytes"] that must fail cleanly where it does not fit."""
    if p.get("platform"):
        os.environ["XLA_PYTHON_CLIENT_ALLOCATOR"] = "platform"
    import jax
    import jax.numpy as jnp

    d = jax.devices()[0]
    stats = d.memory_stats() or {}
    out = {"bytes_limit": stats.get("bytes_limit"), "platform": d.platform}
    try:
        a = jnp.ones((p["bytes"] // 4,), dtype=jnp.float32)
        a.block_until_ready()
        out["allocated"] = True
    except Exception as e:  # XlaRuntimeError
        msg = str(e)
        out["allocated"] = False
        out["resource_exhausted"] = "RESOURCE_EXHAUSTED" in msg
        out["error"] = msg.splitlines()[0][:200]
    done(out)


def mode_cupy(p):
    import cupy

    free, total = cupy.cuda.runtime.memGetInfo()
    out = {"free": free, "total": total}
    size = p.get("bytes") or total + GiB
    out["bytes"] = size
    try:
        a = cupy.empty(size, dtype=cupy.uint8)
        a.fill(1)
        cupy.cuda.runtime.deviceSynchronize()
        out["allocated"] = True
    except cupy.cuda.memory.OutOfMemoryError as e:
        out["allocated"] = False
        out["error"] = str(e).splitlines()[0][:200]
    done(out)


def mode_numba(p):
    try:
        from numba import cuda
        import numpy as np
    except Exception as e:
        done({"skipped": f"numba-cuda does not import: {str(e).splitlines()[0][:160]}"})
        return
    try:
        ctx = cuda.current_context()
    except Exception as e:
        done({"skipped": f"numba-cuda cannot open the device: {str(e).splitlines()[0][:160]}"})
        return
    free, total = ctx.get_memory_info()
    out = {"free": free, "total": total}
    size = p.get("bytes") or total + GiB
    out["bytes"] = size
    try:
        cuda.device_array(size, dtype=np.uint8)
        out["allocated"] = True
    except Exception as e:
        out["allocated"] = False
        out["error"] = str(e).splitlines()[0][:200]
    done(out)


MODES = {k[5:]: v for k, v in globals().items() if k.startswith("mode_")}

if __name__ == "__main__":
    MODES[sys.argv[1]](json.loads(sys.argv[2]) if len(sys.argv) > 2 else {})
