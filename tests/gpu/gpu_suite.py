#!/usr/bin/env python3
"""`make test-gpu`: gemini's scenarios on a real NVIDIA GPU.

    gpu_suite.py [RESULTS.md] [--only NAME[,NAME...]] [--list]

Needs a GPU machine with the NVIDIA driver and Python; PyTorch for most
rows, JAX, CuPy, Triton and numba-cuda for theirs (a row whose framework
does not import is reported as skipped). gemini's binaries come from
GEMINI_BIN_DIR (default target/release; the hook there or in ../lib).
Exits 0 with "no NVIDIA GPU found, skipped" where there is no GPU.

Every row runs twice: under gemini and without it (the same workload, no
hook). A row that fails both ways is reported as the row's own failure,
not gemini's. Rows are independent: an exception or a hung workload ends
that row only. Shares and caps are judged on GPU time (CUDA events around
each kernel), with throughput beside it. Memory rows are sized from what
the job itself sees free. Each row is printed as it finishes; the table
is appended to RESULTS.md (default docs/gpu-results.md). The exit status
is 1 when gemini failed a row, else 0.

GEMINI_GPU_SCHD_LOG=PATH runs gem-schd at `--log-level debug` with its log
written to PATH: every token request and grant, timed, to study a row.
"""

import ctypes
import datetime
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
WORKER = os.environ.get("GEMINI_GPU_WORKER") or os.path.join(HERE, "worker.py")
GiB = 2**30

# --- verdicts and the report: no GPU needed (tests/gpu/test_suite_logic.py) --

PASS, FAIL, OWN, INFO, SKIP = "pass", "FAIL", "fails without gemini too", "measured", "skipped"


class WorkerError(Exception):
    """A workload that ended without its RESULT line (crash, exception,
    time-out); the message carries the end of its stderr."""


class Result:
    """One row: what was measured with and without gemini, the target, and
    whether each run met what the row expects of it (None: not judged)."""

    def __init__(self, hook, plain, target="", hook_ok=None, plain_ok=None):
        self.hook, self.plain, self.target = hook, plain, target
        self.hook_ok, self.plain_ok = hook_ok, plain_ok

    def verdict(self):
        if self.hook_ok is None:
            return INFO
        if self.hook_ok:
            return PASS
        if self.plain_ok is False:
            return OWN
        return FAIL


def short(e):
    s = str(e).strip().splitlines()
    return (s[-1] if s else type(e).__name__)[:200]


def run_row(name, fn):
    """Runs one row's function; whatever it raises ends this row only.
    fn(hooked) measures one side and returns a dict; judge(h, p) turns the
    two into a Result. A side that raised is passed as the exception."""
    run, judge = fn
    sides = {}
    for hooked in (True, False):
        try:
            sides[hooked] = run(hooked, sides.get(True))
        except Exception as e:  # noqa: BLE001: a row's failure is reported, never propagated
            sides[hooked] = e
    h, p = sides[True], sides[False]
    for side in (h, p):
        if isinstance(side, dict) and side.get("skipped"):
            return Result(f"skipped: {side['skipped']}", "", ""), SKIP
    herr, perr = isinstance(h, Exception), isinstance(p, Exception)
    if herr and perr:
        return Result(f"error: {short(h)}", f"error: {short(p)}", ""), OWN
    if herr:
        # The plain side's own text, from judging it as if it were both.
        try:
            plain = judge(p, p).plain
        except Exception:  # noqa: BLE001
            plain = "ran"
        return Result(f"error: {short(h)}", plain, "", False, True), FAIL
    r = judge(h, None if perr else p)
    if perr:
        r.plain, r.plain_ok = f"error: {short(p)}", False
    return r, r.verdict()


class Report:
    def __init__(self):
        self.rows = []
        self.lock = threading.Lock()

    def add(self, name, result, verdict):
        with self.lock:
            self.rows.append((name, result, verdict))
            print(f"[{verdict}] {name}: gemini: {result.hook} | without: {result.plain} | target: {result.target}", flush=True)

    def failures(self):
        return [n for n, _, v in self.rows if v == FAIL]

    def markdown(self, header):
        cell = lambda s: str(s).replace("|", "\\|")  # noqa: E731
        lines = [header, "", "| row | with gemini | without gemini | target | verdict |", "|---|---|---|---|---|"]
        lines += [f"| {cell(n)} | {cell(r.hook)} | {cell(r.plain)} | {cell(r.target)} | {v} |" for n, r, v in self.rows]
        counts = {v: sum(1 for _, _, x in self.rows if x == v) for v in (PASS, FAIL, OWN, INFO, SKIP)}
        lines += ["", ", ".join(f"{k}: {n}" for k, n in counts.items() if n), ""]
        return "\n".join(lines) + "\n"


# --- running workloads --------------------------------------------------------


def find_bins():
    b = os.path.abspath(os.environ.get("GEMINI_BIN_DIR", "target/release"))
    hook = next((p for p in (os.environ.get("GEMINI_HOOK"), f"{b}/libgemhook.so", f"{b}/../lib/libgemhook.so") if p and os.path.exists(p)), None)
    return b, hook


class Gemini:
    """One gem-schd for the whole suite, each row in groups of its own."""

    def __init__(self, bindir, hook, conf):
        self.bin, self.hook = bindir, hook
        self.dir = tempfile.mkdtemp(prefix="gemini-gpu-")
        self.ipc = os.path.join(self.dir, "ipc")
        self.conf = os.path.join(self.dir, "resource.conf")
        with open(self.conf, "w") as f:
            f.write(conf)
        self.log_path = os.environ.get("GEMINI_GPU_SCHD_LOG") or os.path.join(self.dir, "schd.log")
        self.log = open(self.log_path, "w")
        level = ["--log-level", "debug"] if os.environ.get("GEMINI_GPU_SCHD_LOG") else []
        self.schd = subprocess.Popen([f"{bindir}/gem-schd", "--config", self.conf, "--ipc-dir", self.ipc, *level], stderr=self.log, stdout=self.log)
        for _ in range(100):
            if subprocess.run([f"{bindir}/gem-schd", "status", "--ipc-dir", self.ipc], capture_output=True).returncode == 0:
                return
            if self.schd.poll() is not None:
                break
            time.sleep(0.1)
        raise RuntimeError(f"gem-schd did not start: {open(self.log_path).read()[-1000:]}")

    def env(self, group, hooked=True, extra=None):
        e = dict(os.environ)
        e.pop("LD_PRELOAD", None)
        if hooked:
            e.update(LD_PRELOAD=self.hook, GEMINI_GROUP_NAME=group, GEMINI_IPC_DIR=self.ipc)
        e.update(extra or {})
        return e

    def spawn(self, group, mode, params=None, hooked=True, extra=None):
        err = tempfile.TemporaryFile(mode="w+")
        p = subprocess.Popen([sys.executable, WORKER, mode, json.dumps(params or {})], env=self.env(group, hooked, extra),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=err, text=True)
        p.err = err
        return p

    def run(self, group, mode, params=None, hooked=True, extra=None, timeout=120):
        return collect(self.spawn(group, mode, params, hooked, extra), timeout)

    def timed(self, jobs, secs, timeout=120, probe=None):
        """Starts every (group, mode, params, hooked) job, waits until each
        has warmed up (READY), then gives all the same window of secs.
        probe(start, end), if given, runs beside them; its answer is put
        in the first job's result as "probe"."""
        procs = [self.spawn(g, m, dict(p, sync=True), h) for g, m, p, h in jobs]
        deadline = time.time() + timeout
        try:
            for p in procs:
                line = readline(p, deadline)
                if line.strip() != "READY":
                    raise WorkerError(f"no READY: {line!r} {tail(p)}")
            start = time.time() + 0.3
            for p in procs:
                p.stdin.write(json.dumps({"start": start, "end": start + secs}) + "\n")
                p.stdin.flush()
            box = {}
            t = probe and threading.Thread(target=lambda: box.update(v=probe(start, start + secs)))
            if t:
                t.start()
            rs = [collect(p, max(1, deadline + secs - time.time())) for p in procs]
            if t:
                t.join()
                rs[0]["probe"] = box.get("v")
            return rs
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()

    def charged(self, start, end, groups):
        """The share of device 0 that gem-schd charged each of groups over
        its window, read from `gem-schd status --json` at the middle and
        at three quarters of [start, end] and averaged (None where it
        could not be read)."""
        seen = []
        for at in (start + 0.5 * (end - start), start + 0.75 * (end - start)):
            time.sleep(max(0.0, at - time.time()))
            r = subprocess.run([f"{self.bin}/gem-schd", "status", "--json", "--ipc-dir", self.ipc], capture_output=True, text=True)
            if r.returncode != 0:
                continue
            dev = next((d for d in json.loads(r.stdout).get("devices", []) if d.get("device") == 0), {})
            share = {x.get("group"): x.get("share", 0.0) for x in dev.get("groups", [])}
            seen.append([share.get(k, 0.0) for k in groups])
        return [sum(col) / len(col) for col in zip(*seen)] if seen else None

    def close(self):
        self.schd.terminate()
        try:
            self.schd.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.schd.kill()


def tail(p):
    p.err.seek(0)
    return p.err.read()[-1500:].strip()


def readline(p, deadline):
    box = []
    t = threading.Thread(target=lambda: box.append(p.stdout.readline()), daemon=True)
    t.start()
    t.join(max(0.1, deadline - time.time()))
    if not box:
        p.kill()
        raise WorkerError(f"timed out waiting for the workload {tail(p)}")
    if not box[0]:
        p.wait()
        raise WorkerError(f"exited {p.returncode}: {tail(p)}")
    return box[0]


def collect(p, timeout):
    try:
        out, _ = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        p.communicate()
        raise WorkerError(f"timed out after {timeout:.0f} s: {tail(p)}")
    for line in out.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise WorkerError(f"exited {p.returncode}: {tail(p)}")


def gib(x):
    return f"{x / GiB:.2f} GiB"


# --- the rows -------------------------------------------------------------------

LIMIT = {"mem": 2, "jax": 4, "cupy": 3, "numba": 3, "kill": 4}
CONF = """
[solo]
MemoryLimit=16GiB
[mem-native]
MemoryLimit=2GiB
[mem-async]
MemoryLimit=2GiB
[mem-expandable]
MemoryLimit=2GiB
[pool]
MemoryLimit=4GiB
[smi]
MemoryLimit=2GiB
[jax]
MemoryLimit=4GiB
[jax-platform]
MemoryLimit=4GiB
[cupy]
MemoryLimit=3GiB
[numba]
MemoryLimit=3GiB
[capture]
MemoryLimit=8GiB
[graphed]
MemoryLimit=8GiB
[kill]
MemoryLimit=4GiB
[a]
MinUtil=0.3
MemoryLimit=16GiB
[b]
MinUtil=0.7
MemoryLimit=16GiB
[half]
MaxUtil=0.5
MemoryLimit=16GiB
[serve]
Latency=critical
MemoryLimit=16GiB
[bulk]
MemoryLimit=16GiB
"""


def functional_rows(g):
    """Rows that check behaviour, not time: they run side by side."""
    rows = []
    for conf, group in (("backend:native", "mem-native"), ("backend:cudaMallocAsync", "mem-async"), ("expandable_segments:True", "mem-expandable")):
        def run(hooked, h, conf=conf, group=group):
            extra = {"PYTORCH_CUDA_ALLOC_CONF": conf}
            # Without the hook, the same sizes as under it: the program fits
            # the device, so an error under gemini is the cap's.
            params = {} if hooked else {"first": h["first"], "second": h["second"]} if isinstance(h, dict) else {}
            return g.run(group, "memcap", params, hooked, extra)

        def judge(h, p):
            ok = abs(h["total"] - 2 * GiB) < 0.01 * GiB and h["first_ok"] and h["oom"]
            return Result(f"total {gib(h['total'])}, free {gib(h['free'])}; {gib(h['first'])} then {gib(h['second'])}: "
                          + ("OutOfMemoryError" if h["oom"] else "allocated (cap NOT enforced)"),
                          p and (f"total {gib(p['total'])}; the same sizes: " + ("OutOfMemoryError" if p["oom"] else "allocated")),
                          "total 2.00 GiB; OutOfMemoryError past the free", ok, p and not p["oom"])
        rows.append((f"MemoryLimit 2 GiB, PyTorch {conf}", (run, judge)))

    def run_pool(hooked, h):
        return g.run("pool", "poolkeep", {} if hooked or not isinstance(h, dict) else {"size": h["size"]}, hooked,
                     {"PYTORCH_CUDA_ALLOC_CONF": "backend:cudaMallocAsync"})

    def judge_pool(h, p):
        kept = lambda r: r["free_before"] - r["free_after"] > 0.9 * r["size"]  # noqa: E731
        txt = lambda r: f"{gib(r['size'])} freed: free {gib(r['free_before'])} -> {gib(r['free_after'])} (" + ("kept" if kept(r) else "released") + ")"  # noqa: E731
        return Result(txt(h), p and txt(p), "the pool keeps what it freed, as without gemini", p is None or kept(h) == kept(p), None)
    rows.append(("cudaMallocAsync pool keeps freed memory (MemoryLimit 4 GiB)", (run_pool, judge_pool)))

    def run_smi(hooked, h):
        r = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits"], env=g.env("smi", hooked), capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            raise WorkerError(r.stderr.strip()[:200])
        return {"mib": int(r.stdout.strip().splitlines()[0])}
    rows.append(("nvidia-smi memory.total inside a job (MemoryLimit 2 GiB)",
                 (run_smi, lambda h, p: Result(f"{h['mib']} MiB", p and f"{p['mib']} MiB", "2048 MiB", h["mib"] == 2048, None))))

    for platform, group in ((False, "jax"), (True, "jax-platform")):
        def run_jax(hooked, h, platform=platform, group=group):
            return g.run(group, "jax", {"bytes": int(1.25 * LIMIT["jax"] * GiB), "platform": platform}, hooked, timeout=180)

        def judge_jax(h, p, platform=platform):
            txt = lambda r: (f"limit {gib(r['bytes_limit'])}; " if r.get("bytes_limit") else "") + ("5 GiB allocated" if r["allocated"] else ("RESOURCE_EXHAUSTED" if r.get("resource_exhausted") else f"error: {r.get('error')}"))  # noqa: E731
            ok = not h["allocated"] and h.get("resource_exhausted") and (platform or (h.get("bytes_limit") or 0) <= LIMIT["jax"] * GiB)
            return Result(txt(h), p and txt(p), "limit within 4 GiB; 5 GiB fails with RESOURCE_EXHAUSTED", bool(ok), p and p["allocated"])
        rows.append((f"JAX under MemoryLimit 4 GiB ({'platform allocator' if platform else 'preallocation'})", (run_jax, judge_jax)))

    for fw in ("cupy", "numba"):
        def run_fw(hooked, h, fw=fw):
            return g.run(fw, fw, {"bytes": int((LIMIT[fw] + 1) * GiB)}, hooked, timeout=180)

        def judge_fw(h, p, fw=fw):
            txt = lambda r: f"total {gib(r['total'])}; {gib(r['bytes'])}: " + ("allocated" if r["allocated"] else f"error ({r.get('error', '')[:80]})")  # noqa: E731
            ok = abs(h["total"] - LIMIT[fw] * GiB) < 0.01 * GiB and not h["allocated"]
            return Result(txt(h), p and txt(p), f"total {LIMIT[fw]}.00 GiB; an out-of-memory error past it", ok, p and p["allocated"])
        rows.append((f"{'CuPy' if fw == 'cupy' else 'numba-cuda'} under MemoryLimit {LIMIT[fw]} GiB", (run_fw, judge_fw)))

    for cmode in ("thread_local", "relaxed"):
        def run_cap(hooked, h, cmode=cmode):
            return g.run("capture", "capture", {"capture_mode": cmode}, hooked, {"GEMINI_IDLE_MS": "2"}, timeout=180)
        rows.append((f"torch.cuda.graph ({cmode} capture) beside a thread launching on its own stream, tokens ending during it",
                     (run_cap, lambda h, p: Result(f"replayed, max |diff| {h['max_abs_diff']:.1e}", p and f"replayed, max |diff| {p['max_abs_diff']:.1e}",
                                                   "replay equals eager", h["max_abs_diff"] < 1e-3, p and p["max_abs_diff"] < 1e-3))))

    def run_graphed(hooked, h):
        return g.run("graphed", "graphed", {}, hooked, {"GEMINI_IDLE_MS": "2"}, timeout=180)
    rows.append(("torch.cuda.make_graphed_callables: 30 training steps",
                 (run_graphed, lambda h, p: Result(f"loss {h['first_loss']:.4f} -> {h['last_loss']:.4f}", p and f"loss {p['first_loss']:.4f} -> {p['last_loss']:.4f}",
                                                   "the loss falls as without gemini", h["fell"], p and p["fell"]))))

    def run_kill(hooked, h):
        size = 3 * GiB
        holder = g.spawn("kill", "hold", {"size": size}, hooked)
        try:
            line = readline(holder, time.time() + 120)
            if line.strip() != "READY":
                raise WorkerError(f"holder: {line!r} {tail(holder)}")
        finally:
            holder.send_signal(signal.SIGKILL)
            holder.wait()
        t0 = time.time()
        r = g.run("kill", "alloc", {"size": size}, hooked)
        r["after_kill_s"] = time.time() - t0
        return r
    rows.append(("kill -9 of a process holding 3 GiB of a 4 GiB group, then another asks for 3 GiB",
                 (run_kill, lambda h, p: Result("allocated" if h["ok"] else f"refused: {h.get('error')}", p and ("allocated" if p["ok"] else "refused"),
                                                "allocated", h["ok"], p and p["ok"]))))
    return rows


def timed_rows(g, nvml):
    rows = []
    solo = {}

    # NVML's busy fraction over a window (its first second left out: the
    # driver's figure covers the last sample period): a second measure of a
    # lone process's GPU time.
    busy = (lambda start, end: nvml.mean_util(end - start - 1.2, wait_until=start + 1)) if nvml else None

    def solo_rate(key, mode, params):
        # The un-hooked rate of a workload alone, measured once per row.
        if key not in solo:
            solo[key] = g.timed([("solo", mode, params, False)], 5, probe=busy)[0]
        return solo[key]

    def run_shares(hooked, h):
        s = solo_rate("mm4096", "matmul", {"n": 4096})
        # Under gemini, what gem-schd charged each group beside the GPU
        # time the groups' events measured: a group charged its MinUtil
        # while its kernels ran less says where the time went.
        probe = hooked and (lambda start, end: g.charged(start, end, ("a", "b")))
        a, b = g.timed([("a", "matmul", {"n": 4096}, hooked), ("b", "matmul", {"n": 4096}, hooked)], 8, probe=probe)
        return {"a": a, "b": b, "solo": s}

    # Judged on each group's share of the device's time. Beside it, the
    # same figure over the GPU time the workload keeps busy alone, so that a
    # miss can be told apart from the workload's own gaps between batches.
    def judge_shares(h, p):
        rel = lambda r, k: r[k]["gpu_share"] / r["solo"]["gpu_share"]  # noqa: E731
        txt = lambda r: (f"GPU time {r['a']['gpu_share']:.3f} / {r['b']['gpu_share']:.3f} of the device, {rel(r, 'a'):.3f} / {rel(r, 'b'):.3f} of what it keeps busy alone "  # noqa: E731
                         f"({r['solo']['gpu_share']:.3f}); throughput {r['a']['rate'] / r['solo']['rate']:.3f} / {r['b']['rate'] / r['solo']['rate']:.3f}"
                         + (f"; charged by gem-schd {r['a']['probe'][0]:.3f} / {r['a']['probe'][1]:.3f}" if r["a"].get("probe") else ""))
        ok = abs(h["a"]["gpu_share"] - 0.3) <= 0.03 and abs(h["b"]["gpu_share"] - 0.7) <= 0.03
        return Result(txt(h), p and txt(p), "GPU time 0.30 / 0.70 ± 0.03 of the device", ok, None)
    rows.append(("two groups MinUtil 0.3 / 0.7, 4096² bf16 matmuls", (run_shares, judge_shares)))

    for label, mode, params in (("8192² bf16 matmuls", "matmul", {"n": 8192}), ("a Triton kernel", "triton", {}),
                                ("CUDA graph replays of 4 × 8192² matmuls", "matmul", {"n": 8192, "graph": True})):
        key = json.dumps([mode, params])

        def run_cap(hooked, h, key=key, mode=mode, params=params):
            s = solo_rate(key, mode, params)
            if not hooked:
                return {"r": s, "solo": s}  # without gemini nothing caps it: the solo run
            return {"r": g.timed([("half", mode, params, True)], 8, probe=busy)[0], "solo": s}

        def judge_cap(h, p):
            nv = lambda r: "" if r["r"].get("probe") is None else f" (NVML busy {r['r']['probe']:.3f})"  # noqa: E731
            txt = lambda r: f"GPU time {r['r']['gpu_share']:.3f}{nv(r)}; throughput {r['r']['rate'] / r['solo']['rate']:.3f}"  # noqa: E731
            gs = h["r"]["gpu_share"]
            return Result(txt(h), p and txt(p), "GPU time 0.50, at most 0.53 (throughput beside it)", 0.47 <= gs <= 0.53, None)
        rows.append((f"MaxUtil 0.5, lone: {label}", (run_cap, judge_cap)))

    def run_train(hooked, h):
        return g.timed([("solo", "train", {}, hooked)], 8)[0]
    rows.append(("training step (6-layer TransformerEncoder, bf16, AdamW) it/s",
                 (run_train, lambda h, p: Result(f"{h['rate']:.2f} it/s", p and f"{p['rate']:.2f} it/s" + (f" (overhead {100 * (1 - h['rate'] / p['rate']):.2f} %)" if p else ""),
                                                 "overhead ≤ 2 %", p is None or h["rate"] >= 0.98 * p["rate"], None))))

    def run_trainers(hooked, h):
        a, b = g.timed([("a", "train", {}, hooked), ("b", "train", {}, hooked)], 10)
        return {"a": a, "b": b}
    rows.append(("two training jobs, MinUtil 0.3 / 0.7: step p50 / p99 ms",
                 (run_trainers, lambda h, p: Result(*[r and " ; ".join(f"{k}: {r[k]['p50_ms']:.0f} / {r[k]['p99_ms']:.0f} ({r[k]['rate']:.1f} it/s)" for k in "ab") for r in (h, p)],
                                                    "no wait over 200 ms (not yet judged)", None, None))))

    def run_decode(hooked, h, group="a", trainer="b"):
        alone = g.timed([(group, "decode", {}, hooked)], 5)[0]
        # Under gemini, what the scheduler charges each group (the
        # device time each group's work occupied, as measured).
        probe = hooked and (lambda start, end: g.charged(start, end, (group, trainer)))
        beside, train = g.timed([(group, "decode", {}, hooked), (trainer, "train", {}, hooked)], 8, probe=probe)
        return {"alone": alone, "beside": beside, "train": train}

    def decode_txt(r):
        charged = r["beside"].get("probe")
        shown = f"; charged by gem-schd: decode {charged[0]:.3f}, training {charged[1]:.3f}" if charged else ""
        return f"alone {r['alone']['p50_ms']:.2f} / {r['alone']['p99_ms']:.2f} / {r['alone']['max_ms']:.2f}; beside training {r['beside']['p50_ms']:.2f} / {r['beside']['p99_ms']:.2f} / {r['beside']['max_ms']:.2f} (training {r['train']['rate']:.1f} it/s){shown}"

    def judge_decode(h, p):
        return Result(decode_txt(h), p and decode_txt(p), "no target: the latency class's row below is judged", None, None)
    rows.append(("decode step p50 / p99 / max ms, MinUtil 0.3 beside training at 0.7", (run_decode, judge_decode)))

    # The latency class's goal, against the decode alone without the hook: p99
    # beside training at most 1.25× (p50 1.1×), training keeping 90 % of
    # its rate without gemini (the decode takes about a seventh).
    def judge_critical(h, p):
        if not p:
            return Result(decode_txt(h), "", "p99 ≤ 1.25×, p50 ≤ 1.1× the decode alone without the hook", False, None)
        ref = p["alone"]
        ok = h["beside"]["p99_ms"] <= 1.25 * ref["p99_ms"] and h["beside"]["p50_ms"] <= 1.1 * ref["p50_ms"] and h["train"]["rate"] >= 0.9 * p["train"]["rate"]
        ratio = f" ({h['beside']['p50_ms'] / ref['p50_ms']:.2f}× / {h['beside']['p99_ms'] / ref['p99_ms']:.2f}× alone without the hook; training {h['train']['rate'] / p['train']['rate']:.2f} of its rate)"
        return Result(decode_txt(h) + ratio, decode_txt(p), "beside training p50 ≤ 1.1×, p99 ≤ 1.25× alone without the hook; training ≥ 0.9 of its rate", ok, None)
    rows.append(("decode step p50 / p99 / max ms, `Latency=critical` (no MinUtil: room 0.3) beside training at 0.7",
                 (lambda hooked, h: run_decode(hooked, h, "serve"), judge_critical)))
    # The same beside training with no MinUtil, so nothing keeps the
    # device from being held for the decode: on the simulator the class
    # meets the latency class's goal only so (0.97-1.00× / 1.05-1.20×; at
    # 0.7, with 1 ms kernels, holding for every step would take the
    # training under its MinUtil: docs/benchmarks.md).
    rows.append(("decode step p50 / p99 / max ms, `Latency=critical` beside training with no MinUtil",
                 (lambda hooked, h: run_decode(hooked, h, "serve", "bulk"), judge_critical)))

    def run_holder(hooked, h):
        if not hooked:
            return {"first_ms": 1e3 * g.run("solo", "matmul", {}, False)["first_iter_s"]}
        out = {}
        for util in ("0.5", "1.0"):
            hold = subprocess.Popen([f"{g.bin}/gem-holder", "run", "--wait-minutes", "0", "--hold-util", util], env=g.env("", False, {"GEMINI_IPC_DIR": g.ipc}),
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            try:
                time.sleep(3)
                out[util] = nvml.mean_util(4) if nvml else None
                if util == "1.0":
                    out["first_ms"] = 1e3 * g.run("solo", "matmul", {}, True)["first_iter_s"]
            finally:
                subprocess.run([f"{g.bin}/gem-holder", "shutdown"], env=g.env("", False, {"GEMINI_IPC_DIR": g.ipc}), capture_output=True, timeout=30)
                try:
                    hold.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    hold.kill()
        return out

    def judge_holder(h, p):
        u = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        ok = all(h[k] is None or abs(h[k] - float(k)) <= 0.03 for k in ("0.5", "1.0"))
        return Result(f"NVML utilisation {u(h['0.5'])} / {u(h['1.0'])}; a job's first matmul at the held GPU {h['first_ms']:.1f} ms",
                      p and f"first matmul, no holder {p['first_ms']:.1f} ms", "0.50 / 1.00 ± 0.03", ok, None)
    rows.append(("holder at hold-util 0.5 / 1.0", (run_holder, judge_holder)))

    # The holder with its defaults (--mem-threshold 0.5GB, --hold-util
    # 0.5) and a short wait: its own CUDA context (518 MiB on an H200) is
    # not others' memory, so it holds once the wait is over.
    def run_holder_defaults(hooked, h):
        if not hooked:
            return {"util": nvml.mean_util(3) if nvml else None, "state": "no holder"}
        env = g.env("", False, {"GEMINI_IPC_DIR": g.ipc})
        hold = subprocess.Popen([f"{g.bin}/gem-holder", "run", "--wait-minutes", "0.05"], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            time.sleep(6)
            st = subprocess.run([f"{g.bin}/gem-holder", "status"], env=env, capture_output=True, text=True, timeout=30)
            return {"util": nvml.mean_util(4) if nvml else None, "state": st.stdout.strip().replace("\n", "; ")[:160]}
        finally:
            subprocess.run([f"{g.bin}/gem-holder", "shutdown"], env=env, capture_output=True, timeout=30)
            try:
                hold.wait(timeout=20)
            except subprocess.TimeoutExpired:
                hold.kill()

    def judge_holder_defaults(h, p):
        u = lambda x: "n/a" if x is None else f"{x:.3f}"  # noqa: E731
        ok = "holding" in h["state"] and (h["util"] is None or abs(h["util"] - 0.5) <= 0.05)
        return Result(f"NVML utilisation {u(h['util'])}; status: {h['state']}",
                      p and f"no holder: {u(p['util'])}", "holding, 0.50 ± 0.05", ok, None)
    rows.append(("holder with its defaults, --wait-minutes 0.05", (run_holder_defaults, judge_holder_defaults)))
    return rows


class Nvml:
    def __init__(self):
        self.lib = ctypes.CDLL("libnvidia-ml.so.1")
        self.lib.nvmlInit_v2()
        self.h = ctypes.c_void_p()
        self.lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(self.h))

    def mean_util(self, secs, wait_until=None):
        while wait_until and time.time() < wait_until:
            time.sleep(0.05)
        xs, t0 = [], time.time()
        while time.time() - t0 < secs:
            time.sleep(0.2)
            u = (ctypes.c_uint * 2)()
            self.lib.nvmlDeviceGetUtilizationRates(self.h, u)
            xs.append(u[0] / 100.0)
        return sum(xs) / len(xs)


def gpu_present():
    if shutil.which("nvidia-smi") is None:
        return False
    r = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
    return r.returncode == 0 and "GPU" in r.stdout


def main(argv):
    args = [a for a in argv if not a.startswith("--")]
    only = next((a.split("=", 1)[1] for a in argv if a.startswith("--only=")), None)
    out_path = args[0] if args else "docs/gpu-results.md"
    if not gpu_present():
        print("no NVIDIA GPU found, skipped")
        return 0
    bindir, hook = find_bins()
    missing = [b for b in ("gem-schd", "gem-holder") if not os.path.exists(f"{bindir}/{b}")] + ([] if hook else ["libgemhook.so"])
    if missing:
        print(f"{', '.join(missing)} not found in {bindir}: build with `make release` (or set GEMINI_BIN_DIR)")
        return 2
    smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"], capture_output=True, text=True).stdout.strip()
    t_start = time.time()
    report = Report()
    g = Gemini(bindir, hook, CONF)
    try:
        try:
            nvml = Nvml()
        except OSError:
            nvml = None
        funcs = functional_rows(g)
        if only:
            funcs = [r for r in funcs if any(o in r[0] for o in only.split(","))]
        threads = [threading.Thread(target=lambda n=n, f=f: report.add(n, *run_row(n, f))) for n, f in funcs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        for name, f in timed_rows(g, nvml):
            if only and not any(o in name for o in only.split(",")):
                continue
            try:
                report.add(name, *run_row(name, f))
            except Exception as e:  # noqa: BLE001: the report itself must go on
                report.add(name, Result(f"suite error: {short(e)}", "", ""), FAIL)
                traceback.print_exc()
    finally:
        g.close()
    versions = subprocess.run([sys.executable, "-c", "import torch; print('PyTorch', torch.__version__, 'CUDA', torch.version.cuda)"], capture_output=True, text=True).stdout.strip()
    commit = os.environ.get("GEMINI_COMMIT") or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE).stdout.strip() or "unknown"
    header = f"## {datetime.date.today().isoformat()}: {smi}; {versions}; gemini {commit}; {time.time() - t_start:.0f} s"
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    with open(out_path, "a") as f:
        f.write("\n" + report.markdown(header))
    print(f"appended to {out_path}")
    fails = report.failures()
    if fails:
        print(f"gemini failed {len(fails)} row(s): " + "; ".join(fails))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
