//! `MemoryLimit` across processes, every allocation API, pools, graphs, VMM, IPC, NVML's view.

use super::*;

#[test]
fn group_memory_limit_across_processes_and_release_on_kill() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    // A holds 600 MiB and keeps running.
    let holder = spawn(rust(
        &g,
        "a",
        &[
            "--seconds",
            "60",
            "--kernel-us",
            "100000",
            "--mem",
            "600MiB",
        ],
    ));
    g.wait_status(10.0, "600 MiB held", |s| {
        s.devices
            .first()
            .is_some_and(|d| d.groups.iter().any(|x| x.memory_used == 600 << 20))
    });
    // B, same group: 600 MiB more would pass 1 GiB.
    let out = finish(spawn(rust(&g, "a", &["--seconds", "0", "--mem", "600MiB"])));
    let r = &reports(&out.stdout)[0];
    assert_eq!(
        (field(r, "allocated"), field(r, "alloc_error")),
        (0, 2),
        "CUDA_ERROR_OUT_OF_MEMORY"
    );
    // Said once on stderr without GEMINI_LOG: the group, its limit, what
    // it uses and what was asked, in sizes a person reads (a user must
    // tell the cap from a full GPU).
    let err = String::from_utf8_lossy(&out.stderr);
    let told: Vec<&str> = err
        .lines()
        .filter(|l| l.contains("refused by gemini"))
        .collect();
    assert_eq!(told.len(), 1, "{err}");
    for part in [
        "allocation of 600.0 MiB refused",
        "group \"a\"",
        "MemoryLimit of 1.0 GiB",
        "in use: 600.0 MiB",
        "asked: 600.0 MiB",
    ] {
        assert!(told[0].contains(part), "{part:?} missing: {}", told[0]);
    }
    assert_eq!(
        field(r, "total"),
        1 << 30,
        "cuMemGetInfo_v2 total = MemoryLimit"
    );
    assert_eq!(
        field(r, "free"),
        (1 << 30) - (600 << 20),
        "cuMemGetInfo_v2 free = limit - group use"
    );
    // The C program sees the same view and the same refusal.
    let out = finish(spawn(c_prog(
        &g,
        "a",
        &["-s", "0", "-m", &(600u64 << 20).to_string()],
    )));
    let r = &reports(&out.stdout)[0];
    assert_eq!(
        (field(r, "alloc_error"), field(r, "total"), field(r, "free")),
        (2, 1 << 30, (1 << 30) - (600 << 20))
    );
    // B waits for the memory; A is killed; B gets it within 2 s.
    let waiter = spawn(rust(
        &g,
        "a",
        &[
            "--seconds",
            "0",
            "--mem",
            "600MiB",
            "--retry-alloc-seconds",
            "20",
        ],
    ));
    std::thread::sleep(Duration::from_millis(300));
    let mut holder = holder;
    holder.kill().unwrap();
    let killed = now_ns();
    holder.wait().unwrap();
    let out = finish(waiter);
    let r = &reports(&out.stdout)[0];
    assert_eq!(field(r, "allocated"), 600 << 20);
    let waited = field(r, "alloc_done_ns").saturating_sub(killed);
    assert!(
        waited < 2 * SEC,
        "memory came back {} ms after the kill",
        waited / 1_000_000
    );
}

#[test]
fn every_allocation_api_is_counted() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=512MiB\n");
    for api in [
        "v2", "pitch", "managed", "async", "create", "array", "array3d",
    ] {
        let out = finish(spawn(rust(
            &g,
            "a",
            &[
                "--seconds",
                "0",
                "--mem",
                "768MiB",
                "--chunk",
                "256MiB",
                "--alloc-api",
                api,
            ],
        )));
        let r = &reports(&out.stdout)[0];
        assert_eq!(
            (field(r, "allocated"), field(r, "alloc_error")),
            (512 << 20, 2),
            "{api}"
        );
        assert_eq!(field(r, "free"), 0, "{api}");
    }
    // Everything was freed again (frees, async frees and releases are
    // counted too).
    g.wait_status(5.0, "all memory released", |s| {
        s.devices
            .iter()
            .all(|d| d.groups.iter().all(|x| x.memory_used == 0))
    });
}

#[test]
fn lowered_limit_applies_to_new_allocations() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let holder = spawn(rust(
        &g,
        "a",
        &["--seconds", "4", "--kernel-us", "100000", "--mem", "512MiB"],
    ));
    g.wait_status(10.0, "memory held", |s| {
        s.devices
            .first()
            .is_some_and(|d| d.groups.iter().any(|x| x.memory_used > 0))
    });
    g.write_conf("[a]\nMemoryLimit=512MiB\n");
    g.wait_status(5.0, "new limit", |s| s.groups[0].memory_limit == 512 << 20);
    let out = finish(spawn(rust(&g, "a", &["--seconds", "0", "--mem", "1MiB"])));
    let r = &reports(&out.stdout)[0];
    assert_eq!(
        (field(r, "alloc_error"), field(r, "free"), field(r, "total")),
        (2, 0, 512 << 20)
    );
    finish(holder);
}

/// Stream-ordered allocations come from a pool that keeps freed memory up
/// to its release threshold (PyTorch's cudaMallocAsync backend keeps it
/// all): the group is charged what the pool holds, so memory a pool sits
/// on counts against the limit — in its own view and for the group's
/// other processes — and comes back when the pool gives it back.
#[test]
fn memory_a_pool_holds_counts_against_the_group() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    for (threshold, kept) in [("max", 384u64 << 20), ("0", 0)] {
        // Allocates 384 MiB from the pool, frees it, synchronises, and
        // keeps running for 2 s.
        let pooled = spawn(rust(
            &g,
            "a",
            &[
                "--alloc-api",
                "async",
                "--mem",
                "384MiB",
                "--pool-threshold",
                threshold,
                "--free-first",
                "--seconds",
                "2",
                "--kernel-us",
                "100",
                "--burst-ms",
                "1",
                "--gap-ms",
                "20",
            ],
        ));
        std::thread::sleep(Duration::from_millis(700));
        // Another process of the group asks for 768 MiB.
        let other = finish(spawn(rust(&g, "a", &["--seconds", "0", "--mem", "768MiB"])));
        let out = finish(pooled);
        let r = &reports(&out.stdout)[0];
        assert_eq!(
            field(r, "free"),
            (1 << 30) - kept,
            "threshold {threshold}: the pool's own view after its free"
        );
        let o = &reports(&other.stdout)[0];
        let refused = field(o, "alloc_error") == 2;
        assert_eq!(
            refused,
            kept > 0,
            "threshold {threshold}: 768 MiB beside a pool holding {} MiB: {o:?}",
            kept >> 20
        );
    }
}

/// Memory a CUDA graph allocates (a graph memory node: `cuMemAllocAsync`
/// on the capturing stream, freed in the graph, as PyTorch's
/// cudaMallocAsync backend makes under `torch.cuda.graph`) counts against
/// the group: it is taken when the graph is launched, the graph allocator
/// keeps it, and the group's other processes see it used; under a limit
/// smaller than the graph's memory the launch fails with
/// `CUDA_ERROR_OUT_OF_MEMORY` instead of taking it. (Before, the graph
/// took the memory uncounted.)
#[test]
fn memory_a_graph_allocates_counts_against_the_group() {
    let g = Gemini::start(
        SimEnv::default(),
        "[a]\nMemoryLimit=1GiB\n[small]\nMemoryLimit=256MiB\n",
    );
    let graph_args = [
        "--capture",
        "3",
        "--capture-alloc",
        "536870912",
        "--seconds",
        "2",
        "--kernel-us",
        "500",
    ];
    let graph = spawn(rust(&g, "a", &graph_args));
    g.wait_status(10.0, "the graph's 512 MiB charged to a", |s| {
        s.devices.iter().any(|d| {
            d.groups
                .iter()
                .any(|r| r.group == "a" && r.memory_used >= 512 << 20)
        })
    });
    let other = finish(spawn(rust(&g, "a", &["--seconds", "0", "--mem", "768MiB"])));
    finish(graph);
    let o = &reports(&other.stdout)[0];
    assert_eq!(
        field(o, "alloc_error"),
        2,
        "768 MiB beside a graph holding 512 MiB of a 1 GiB limit: {o:?}"
    );
    let small = rust(&g, "small", &graph_args).output().unwrap();
    let err = String::from_utf8_lossy(&small.stderr);
    assert!(
        !small.status.success()
            && err.contains("launch failed with CUresult 2")
            && err.contains("over its MemoryLimit"),
        "a 512 MiB graph under a 256 MiB limit: {err}"
    );
}

/// NVML in a job (what `nvidia-smi`, pynvml and vLLM read) shows the
/// group's memory, as `cuMemGetInfo` does: total = the limit, free = the
/// limit less the group's use — through our `dlsym` (NVML loaded at run
/// time). Unhooked, NVML shows the whole simulated device.
#[test]
fn nvml_memory_queries_show_the_groups_view() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let out = finish(spawn(rust(
        &g,
        "a",
        &["--seconds", "0", "--mem", "384MiB", "--nvml"],
    )));
    let r = &reports(&out.stdout)[0];
    let (limit, used) = (1u64 << 30, 384u64 << 20);
    assert_eq!(
        (field(r, "nvml_total"), field(r, "nvml_free")),
        (limit, limit - used),
        "nvmlDeviceGetMemoryInfo"
    );
    assert_eq!(
        (
            field(r, "nvml_v2_total"),
            field(r, "nvml_v2_free"),
            field(r, "nvml_v2_used")
        ),
        (limit, limit - used, used),
        "nvmlDeviceGetMemoryInfo_v2"
    );
    let mut plain = g.sim.workload();
    plain.args(["--seconds", "0", "--mem", "384MiB", "--nvml"]);
    let out = finish(spawn(plain));
    let r = &reports(&out.stdout)[0];
    assert!(field(r, "nvml_total") > limit, "unhooked: the whole device");
}

/// What the hook leaves alone is right: a `cuMemCreate` handle mapped
/// three times (cuMemAddressReserve + cuMemMap, as PyTorch's expandable
/// segments do) counts once, and page-locked host memory (cuMemHostAlloc)
/// never counts, even four times the group's limit.
#[test]
fn mapped_handles_count_once_and_host_memory_never() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=512MiB\n");
    let out = finish(spawn(rust(
        &g,
        "a",
        &[
            "--seconds",
            "0",
            "--alloc-api",
            "create",
            "--mem",
            "384MiB",
            "--vmm-maps",
            "3",
            "--host-mem",
            "2GiB",
        ],
    )));
    let r = &reports(&out.stdout)[0];
    assert_eq!(
        (field(r, "allocated"), field(r, "alloc_error")),
        (384 << 20, 0)
    );
    assert_eq!(field(r, "free"), 128 << 20, "the handle counted once");
    assert_eq!(field(r, "host_error"), 0, "host memory is not the group's");
}

/// An allocation opened through an IPC handle (cuIpcOpenMemHandle, as
/// PyTorch's multiprocessing shares CUDA tensors) is its owner's: the
/// opener's group, whose limit is a third of it, opens it and is charged
/// nothing.
#[test]
fn memory_opened_through_ipc_is_paid_by_its_owner() {
    let g = Gemini::start(
        SimEnv::default(),
        "[owner]\nMemoryLimit=1GiB\n[opener]\nMemoryLimit=128MiB\n",
    );
    let file = g.sim.path().join("ipc-handle");
    let owner = spawn(rust(
        &g,
        "owner",
        &[
            "--mem",
            "384MiB",
            "--ipc-export",
            file.to_str().unwrap(),
            "--seconds",
            "3",
            "--kernel-us",
            "100",
            "--burst-ms",
            "1",
            "--gap-ms",
            "20",
        ],
    ));
    // The opener starts once the owner's memory is allocated: a module it
    // loads while the owner allocates would be measured, without NVML
    // listing the opener yet, by the device's used memory across the
    // load, the owner's 384 MiB included (refused under 128 MiB).
    let until = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while !file.exists() && std::time::Instant::now() < until {
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let out = finish(spawn(rust(
        &g,
        "opener",
        &["--seconds", "0", "--ipc-import", file.to_str().unwrap()],
    )));
    let r = &reports(&out.stdout)[0];
    assert_eq!(field(r, "ipc_error"), 0, "{r:?}");
    assert_eq!(
        (field(r, "free"), field(r, "total")),
        (128 << 20, 128 << 20),
        "the opener's group is charged nothing"
    );
    let o = finish(owner);
    assert_eq!(
        field(&reports(&o.stdout)[0], "free"),
        (1 << 30) - (384 << 20)
    );
}
