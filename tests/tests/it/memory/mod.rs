//! The group's memory as the driver holds it (`gem-memwork` on the
//! simulator, which keeps memory as the real driver does): a context's
//! own memory and its limits, modules, `cuMemCreate` handles until their
//! last unmap, never host memory, the stream's device, graphs however
//! their instantiation was found, and the bookkeeping of frees racing
//! allocations. The simulator's per-group figures
//! (`fakecuda_log::groups`) are the ground truth: the most the group's
//! processes ever held at once, and what they hold now.

use gemini_tests::{Gemini, SimEnv, bin};
use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::time::{Duration, Instant};

mod contexts;
mod driver_limits;

const MIB: u64 = 1 << 20;

/// A running `gem-memwork`, driven step by step.
struct Memwork {
    child: Child,
    /// Its standard output, line by line.
    out: Receiver<String>,
    /// Every `key=value` it printed so far.
    said: HashMap<String, String>,
}

impl Memwork {
    fn start(g: &Gemini, group: &str, args: &[&str]) -> Memwork {
        Memwork::start_with(g, group, args, &[])
    }

    /// [`Memwork::start`] with more environment.
    fn start_with(g: &Gemini, group: &str, args: &[&str], env: &[(&str, &str)]) -> Memwork {
        Memwork::spawn(
            g.hooked(g.sim.command(bin("gem-memwork")), group),
            args,
            env,
        )
    }

    /// Without the hook, on `sim`.
    fn plain(sim: &SimEnv, args: &[&str], env: &[(&str, &str)]) -> Memwork {
        Memwork::spawn(sim.command(bin("gem-memwork")), args, env)
    }

    fn spawn(mut c: Command, args: &[&str], env: &[(&str, &str)]) -> Memwork {
        c.envs(env.iter().copied());
        c.args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        let mut child = c.spawn().unwrap();
        let stdout = BufReader::new(child.stdout.take().unwrap());
        let (tx, out) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in stdout.lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Memwork {
            child,
            out,
            said: HashMap::new(),
        }
    }

    /// Reads until it says `step=name` (and waits there); fails if it
    /// ends or takes a minute first.
    fn at(&mut self, name: &str) -> &mut Memwork {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let line = match self
                .out
                .recv_timeout(deadline.saturating_duration_since(Instant::now()))
            {
                Ok(line) => line,
                Err(e) => {
                    let _ = self.child.kill();
                    let mut err = String::new();
                    let _ = std::io::Read::read_to_string(
                        self.child.stderr.as_mut().unwrap(),
                        &mut err,
                    );
                    let how = if e == RecvTimeoutError::Timeout {
                        "took a minute"
                    } else {
                        "ended"
                    };
                    panic!(
                        "gem-memwork {how} before step {name}: {err}\nsaid {:?}",
                        self.said
                    );
                }
            };
            let Some(rest) = line.trim().strip_prefix("memwork ") else {
                continue;
            };
            for (k, v) in rest.split_whitespace().filter_map(|kv| kv.split_once('=')) {
                self.said.insert(k.into(), v.into());
            }
            if self.said.get("step").is_some_and(|s| s == name) {
                return self;
            }
        }
    }

    /// A number it said.
    fn num(&self, key: &str) -> u64 {
        self.said
            .get(key)
            .unwrap_or_else(|| panic!("gem-memwork did not say {key}: {:?}", self.said))
            .parse()
            .unwrap()
    }

    /// Lets it go on past the step it waits at.
    fn go(&mut self) {
        self.child.stdin.as_mut().unwrap().write_all(b"\n").unwrap();
    }

    /// Runs it to its end (which must be a success) and returns what it
    /// said.
    fn said(mut self) -> HashMap<String, String> {
        drop(self.child.stdin.take());
        for line in self.out.iter() {
            if let Some(rest) = line.trim().strip_prefix("memwork ") {
                for (k, v) in rest.split_whitespace().filter_map(|kv| kv.split_once('=')) {
                    self.said.insert(k.into(), v.into());
                }
            }
        }
        let said = std::mem::take(&mut self.said);
        self.end();
        said
    }

    /// Lets it go on to its end, which must be a success.
    fn end(mut self) {
        drop(self.child.stdin.take());
        drop(self.child.stdout.take());
        let out = self.child.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "gem-memwork failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// What the scheduler has the group hold on `dev`.
///
/// Once its processes' leases are back: a lease (64 MiB at most) is
/// charged to the group until its process gives back what is left of it
/// (50 ms after it was granted, and the idle watcher's tick), so this
/// waits, up to 2 s, for the charge to be what the driver holds.
fn charged(g: &Gemini, group: &str, dev: u32) -> u64 {
    let read = || -> u64 {
        g.status()
            .devices
            .iter()
            .filter(|d| d.device == dev)
            .flat_map(|d| d.groups.iter())
            .filter(|r| r.group == group)
            .map(|r| r.memory_used)
            .sum()
    };
    let until = std::time::Instant::now() + std::time::Duration::from_secs(2);
    loop {
        let charged = read();
        if charged == g.sim.group_memory(group).now[dev as usize]
            || std::time::Instant::now() >= until
        {
            return charged;
        }
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
}

/// llama.cpp and Ollama grow their VMM pool by mapping each new handle
/// and releasing it at once: the driver keeps the memory until the
/// mapping goes. Before, the hook gave the reservation back at
/// `cuMemRelease` and the group held 1400 MB under a 1 GiB limit.
#[test]
fn a_released_handle_is_charged_until_its_last_unmap() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let mut w = Memwork::start(&g, "a", &["vmm", "--handle", "200MiB", "--count", "7"]);
    w.at("mapped");
    assert_eq!(w.num("mapped"), 1000 * MIB, "five handles fit in 1 GiB");
    assert_eq!(w.num("error"), 2, "the sixth is refused");
    let held = g.sim.group_memory("a");
    assert!(
        held.peak[0] <= 1 << 30,
        "the group held {} MiB under a 1 GiB limit",
        held.peak[0] / MIB
    );
    assert_eq!(charged(&g, "a", 0), 1000 * MIB, "charged while mapped");
    w.go();
    w.at("unmapped");
    assert_eq!(g.sim.group_memory("a").now[0], 0);
    assert_eq!(charged(&g, "a", 0), 0, "given back with the unmaps");
    w.end();
}

/// A context's own memory, a larger malloc heap and a module count
/// against the group: under a 1 GiB limit, a program whose context (300
/// MiB), heap (64 MiB more) and module (4 MiB) take 368 MiB gets 656 MiB
/// of allocations, and `cuMemGetInfo` says so. Before, none of it was
/// charged and the program allocated the whole 1 GiB beside it.
#[test]
fn a_context_its_heap_and_its_modules_count_against_the_group() {
    let g = Gemini::start(
        SimEnv::default().driver_memory("300MiB"),
        "[a]\nMemoryLimit=1GiB\n",
    );
    let mut w = Memwork::start(
        &g,
        "a",
        &[
            "context", "--heap", "72MiB", "--module", "4MiB", "--chunk", "16MiB",
        ],
    );
    w.at("allocated");
    assert_eq!(w.num("context"), 0);
    assert_eq!(w.num("heap_error"), 0);
    assert_eq!(w.num("module_error"), 0);
    // 300 MiB context + 64 MiB more heap + 4 MiB module = 368 MiB.
    let own = 368 * MIB;
    assert_eq!(
        w.num("allocated"),
        (1024 * MIB - own) / (16 * MIB) * (16 * MIB)
    );
    assert_eq!(w.num("error"), 2);
    let held = g.sim.group_memory("a");
    assert!(held.peak[0] <= 1 << 30, "peak {} MiB", held.peak[0] / MIB);
    assert_eq!(
        charged(&g, "a", 0),
        held.now[0],
        "the scheduler and the driver agree"
    );
    assert_eq!(w.num("total"), 1 << 30);
    assert_eq!(
        w.num("free"),
        (1 << 30) - held.now[0],
        "cuMemGetInfo in the group's view"
    );
    w.go();
    // The module and the context go: only the allocations stay.
    w.at("released");
    let now = g.sim.group_memory("a").now[0];
    assert_eq!(now, w.num("allocated"));
    assert_eq!(charged(&g, "a", 0), now);
    w.end();
}

/// Where NVML lists the process but not its memory
/// (`NVML_VALUE_NOT_AVAILABLE`: some containers, vGPU and MIG set-ups), the
/// driver's own memory is measured from the device's used memory: the
/// same charges as with NVML. Before, the hook read the marker as a
/// footprint of 2^64 - 1 bytes and refused every program its first
/// context.
#[test]
fn a_process_whose_memory_nvml_cannot_read_is_charged_from_the_device() {
    let g = Gemini::start(
        SimEnv::default().driver_memory("300MiB"),
        "[a]\nMemoryLimit=1GiB\n",
    );
    let args = [
        "context", "--heap", "72MiB", "--module", "4MiB", "--chunk", "16MiB",
    ];
    // A process NVML sees teaches the scheduler what a context takes.
    Memwork::start(&g, "a", &args).said();
    let mut w = Memwork::start_with(
        &g,
        "a",
        &args,
        &[("FAKECUDA_NVML_PROCESS_MEMORY", "unavailable")],
    );
    w.at("allocated");
    assert_eq!(w.num("context"), 0, "the context is made");
    let own = 368 * MIB;
    assert_eq!(
        w.num("allocated"),
        (1024 * MIB - own) / (16 * MIB) * (16 * MIB)
    );
    let held = g.sim.group_memory("a");
    assert!(held.peak[0] <= 1 << 30, "peak {} MiB", held.peak[0] / MIB);
    assert_eq!(charged(&g, "a", 0), held.now[0]);
    w.end();
}

/// Where the process has no NVML (a container that does not expose it)
/// and nothing told the scheduler yet what a context takes, a runtime
/// program's primary context (300 MiB here) still counts: the hook
/// measures it with a second context of its own for a moment. Before, it
/// was charged nothing, and the program allocated 1000 MiB beside it in a
/// 1 GiB group (1300 MiB on the device); with either context kind.
#[test]
fn a_first_context_counts_without_nvml() {
    for create in [false, true] {
        let g = Gemini::start(
            SimEnv::default().driver_memory("300MiB"),
            "[a]\nMemoryLimit=1GiB\n",
        );
        let mut args = vec!["context", "--chunk", "100MiB"];
        if create {
            args.push("--create");
        }
        let mut w = Memwork::start_with(&g, "a", &args, &[("FAKECUDA_NVML", "missing")]);
        w.at("allocated");
        assert_eq!(w.num("context"), 0, "the context is made");
        assert_eq!(w.num("allocated"), 700 * MIB, "create: {create}");
        let held = g.sim.group_memory("a");
        assert_eq!(held.now[0], 1000 * MIB, "create: {create}");
        assert_eq!(charged(&g, "a", 0), held.now[0], "create: {create}");
        w.end();
    }
}

/// A context the group has no room for is refused before the driver
/// makes it (its cost learned from the process's first context is not
/// known yet: it is made, measured and taken back).
#[test]
fn a_context_past_the_limit_is_refused() {
    let g = Gemini::start(
        SimEnv::default().driver_memory("300MiB"),
        "[a]\nMemoryLimit=256MiB\n",
    );
    let mut w = Memwork::start(&g, "a", &["context", "--create"]);
    w.at("refused");
    assert_eq!(w.num("context"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    assert_eq!(g.sim.group_memory("a").now[0], 0, "taken back");
    assert_eq!(charged(&g, "a", 0), 0);
    w.end();
}

/// NCCL keeps its host buffers in `cuMemCreate` handles on a host NUMA
/// node (drivers from 12.6): host memory, never charged. Before, 900 MB
/// of it was charged as device memory of GPU 0 and a legal 900 MB device
/// allocation beside it was refused.
#[test]
fn host_numa_memory_is_never_charged() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let mut w = Memwork::start(&g, "a", &["host", "--host", "900MiB", "--device", "900MiB"]);
    w.at("held");
    assert_eq!(w.num("host_error"), 0);
    assert_eq!(w.num("host_pool_error"), 0);
    assert_eq!(w.num("device_error"), 0, "900 MiB of device memory fits");
    assert_eq!(charged(&g, "a", 0), 900 * MIB);
    assert_eq!(g.sim.group_memory("a").now[0], 900 * MIB);
    w.end();
}

/// A stream-ordered allocation comes from the pool of the stream's
/// device, whatever context is current: it is charged there.
#[test]
fn a_stream_ordered_allocation_is_charged_to_the_streams_device() {
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[a]\nMemoryLimit=1GiB\n");
    let mut w = Memwork::start(&g, "a", &["stream-device", "--bytes", "512MiB"]);
    w.at("held");
    assert_eq!(w.num("alloc_error"), 0);
    let held = g.sim.group_memory("a");
    assert_eq!(
        (held.now[0], held.now[1]),
        (0, 512 * MIB),
        "the driver took it on GPU 1"
    );
    assert_eq!((charged(&g, "a", 0), charged(&g, "a", 1)), (0, 512 * MIB));
    w.end();
}

/// `cuGetProcAddress("cuGraphInstantiate", 12000)` is
/// `cuGraphInstantiateWithFlags`, and at 10000/11000 the 5-argument
/// `cuGraphInstantiate[_v2]`: a graph instantiated under any of these
/// names has its memory nodes reserved before its launch, which the
/// group's limit refuses. Before, the 12000 name went past the hook and
/// the launch took 900 MiB beside 300 MiB under a 1 GiB limit.
#[test]
fn graphs_are_reserved_however_their_instantiation_was_found() {
    for version in ["10000", "11000", "12000"] {
        let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
        let mut first = Memwork::start(&g, "a", &["host", "--host", "1MiB", "--device", "300MiB"]);
        first.at("held");
        let mut w = Memwork::start(
            &g,
            "a",
            &["graph", "--bytes", "900MiB", "--version", version],
        );
        w.at("launched");
        assert_eq!(
            w.num("launch_error"),
            2,
            "version {version}: the launch is refused"
        );
        let held = g.sim.group_memory("a");
        assert!(
            held.peak[0] <= 1 << 30,
            "version {version}: peak {} MiB",
            held.peak[0] / MIB
        );
        w.end();
        first.end();
    }
}

/// A context's cost, measured in the first process that made one on the
/// GPU, is reserved by the next before the driver makes its context: a
/// group with room for its allocations but not for another context is
/// refused the context, and the driver never holds more than the limit.
#[test]
fn a_new_process_reserves_its_context_before_the_driver_makes_it() {
    let g = Gemini::start(
        SimEnv::default().driver_memory("300MiB"),
        "[a]\nMemoryLimit=1GiB\n",
    );
    // 300 MiB of context and 512 MiB of allocations: 212 MiB left.
    let mut first = Memwork::start(
        &g,
        "a",
        &["context", "--chunk", "512MiB", "--most", "512MiB"],
    );
    first.at("allocated");
    assert_eq!(first.num("allocated"), 512 * MIB);
    let mut second = Memwork::start(&g, "a", &["context", "--create"]);
    second.at("refused");
    assert_eq!(second.num("context"), 2, "CUDA_ERROR_OUT_OF_MEMORY");
    let held = g.sim.group_memory("a");
    assert_eq!(held.peak[0], 812 * MIB, "the second context was never made");
    assert_eq!(charged(&g, "a", 0), 812 * MIB);
    second.end();
    first.end();
}

/// Three processes of one group, 16 threads each, for 10 s of random
/// allocations and frees (`cuMemAlloc`, stream-ordered on two devices),
/// VMM handles mapped and released, host NUMA handles and pool trims,
/// under a limit that refuses some: the driver never holds more for the
/// group than its limit, and at the end the scheduler charges it exactly
/// what the driver holds, on each device. (Frees racing allocations of
/// the same address, which the simulator hands out again at once, used
/// to delete the new allocation's record: a leak and an uncharged
/// allocation.)
#[test]
fn memory_stays_within_the_limit_under_concurrent_traffic() {
    let g = Gemini::start(
        SimEnv::new(2, "16GiB").driver_memory("100MiB"),
        "[a]\nMemoryLimit=1GiB\n",
    );
    let mut procs: Vec<Memwork> = (0..3)
        .map(|_| {
            Memwork::start(
                &g,
                "a",
                &[
                    "stress",
                    "--threads",
                    "16",
                    "--seconds",
                    "10",
                    "--devices",
                    "2",
                ],
            )
        })
        .collect();
    // Every process makes its contexts before any traffic: the first
    // context made on a GPU since the scheduler started is charged only
    // once the driver has made it (see
    // `a_new_process_reserves_its_context_before_the_driver_makes_it`).
    for w in &mut procs {
        w.at("ready");
    }
    for w in &mut procs {
        w.go();
    }
    for w in &mut procs {
        w.at("done");
        assert!(w.num("ops") > 1000, "{:?}", w.said);
    }
    let held = g.sim.group_memory("a");
    for dev in 0..2 {
        assert!(
            held.peak[dev] <= 1 << 30,
            "GPU {dev}: the group's processes held {} MiB at once under a 1 GiB limit",
            held.peak[dev] / MIB
        );
        assert!(held.now[dev] > 0, "GPU {dev}: nothing held at the end");
        assert_eq!(
            charged(&g, "a", dev as u32),
            held.now[dev],
            "GPU {dev}: the scheduler charges what the driver holds"
        );
    }
    for w in procs {
        w.end();
    }
}

/// Sixteen threads allocate and free 1 MiB at once, so that the address
/// one thread frees is the next one another allocates (the simulator
/// hands a freed address out again first, as the driver does). A free's
/// record is taken before the real free: taken after it, it could be the
/// record another thread's allocation of the same address had just
/// made, leaving that allocation uncharged and the free's reservation
/// leaked. At the end the scheduler charges exactly what the driver
/// holds.
#[test]
fn a_free_racing_an_allocation_of_the_same_address_keeps_the_books_exact() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let mut w = Memwork::start(
        &g,
        "a",
        &[
            "stress",
            "--threads",
            "16",
            "--seconds",
            "4",
            "--ops",
            "0,1",
            "--size",
            "1MiB",
        ],
    );
    w.at("ready").go();
    w.at("done");
    assert!(w.num("ops") > 1000, "{:?}", w.said);
    let held = g.sim.group_memory("a");
    assert_eq!(
        charged(&g, "a", 0),
        held.now[0],
        "charged and held at the end"
    );
    w.end();
}

/// `nvidia-smi` in a job shows the job's group: NVML's list of the
/// processes using the GPU (`nvmlDeviceGetComputeRunningProcesses`, every
/// version) has the group's processes only, and its utilisation is the
/// group's share of the GPU as the scheduler measures it, not the busy
/// time other groups made. (Before, every process on the GPU was listed
/// and the device's whole busy time shown.)
#[test]
fn nvml_in_a_job_shows_its_group() {
    let g = Gemini::start(SimEnv::default(), "[a]\n[b]\n");
    let mut mate = Memwork::start(&g, "a", &["host", "--host", "1MiB", "--device", "64MiB"]);
    mate.at("held");
    let mut other = Memwork::start(&g, "b", &["host", "--host", "1MiB", "--device", "64MiB"]);
    other.at("held");
    // Group b keeps the GPU busy.
    let mut busy = g.hooked(g.sim.workload(), "b");
    busy.args(["--seconds", "3", "--kernel-us", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    let mut busy = busy.spawn().unwrap();
    g.wait_status(5.0, "group b at work on GPU 0", |s| {
        s.devices
            .iter()
            .any(|d| d.groups.iter().any(|r| r.group == "b" && r.share > 0.0))
    });
    let mut w = Memwork::start(&g, "a", &["nvml"]);
    w.at("listed");
    let me = w.num("pid");
    let mut want = vec![me, u64::from(mate.child.id())];
    want.sort_unstable();
    for version in ["v1", "v2", "v3"] {
        let mut pids: Vec<u64> = w.said[&format!("pids_{version}")]
            .split(',')
            .map(|p| p.parse().unwrap())
            .collect();
        pids.sort_unstable();
        assert_eq!(pids, want, "{version}: group a's processes only");
    }
    assert_eq!(w.num("util"), 0, "group a has used none of the GPU");
    let _ = busy.kill();
    let _ = busy.wait();
    w.end();
    other.end();
    mate.end();
}

/// A monitor polling NVML in a job (nvitop, a dashboard) asks the
/// scheduler for the group's view at most once per 100 ms: 2000 polls of
/// the utilisation cost a handful of status reports, not 2000 round trips
/// through the single-threaded scheduler that every hand-over waits on.
#[test]
fn a_monitor_polling_nvml_asks_the_scheduler_at_most_every_100_ms() {
    let g = Gemini::start_with(SimEnv::default(), "[a]\n", &["--log-level", "debug"]);
    let mut w = Memwork::start(&g, "a", &["nvml", "--polls", "2000"]);
    w.at("listed");
    let polled_ms = w.num("polled_ms");
    w.end();
    let asked = g.log().lines().filter(|l| l.ends_with(": Status")).count() as u64;
    // The listing's own questions, then at most one per 100 ms of polling.
    assert!(
        asked <= 3 + polled_ms / 100,
        "{asked} status reports for 2000 polls in {polled_ms} ms"
    );
}

/// Cubins loaded by 8 threads at once (Triton, `torch.compile`, the
/// runtime's lazy loading) are charged their images' sizes with no NVML
/// enumeration: before, each load held one process-wide lock across the
/// load and two enumerations (with an NVML that takes 100 ms each, 32
/// loads took 6.4 s).
#[test]
fn modules_load_side_by_side_charged_their_images() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let enumerations =
        || std::fs::metadata(g.sim.sim_dir().join("nvml-enumerations")).map_or(0, |m| m.len());
    let mut w = Memwork::start(
        &g,
        "a",
        &["loads", "--threads", "8", "--count", "4", "--image", "1MiB"],
    );
    w.at("ready");
    let before = enumerations();
    w.go();
    w.at("loaded");
    assert_eq!(enumerations(), before, "NVML enumerated during the loads");
    assert_eq!(charged(&g, "a", 0), 32 * MIB, "each image's size");
    w.end();
}

/// A process that allocates and frees all the time holds a lease of its
/// group's memory (64 MiB) nearly always. A group-mate that needs all but
/// that lease of the group's 1 GiB is not refused: gem-schd recalls the
/// lease (renews none, though the busy process asks all the time), and
/// the allocation is made once it is back. The group never holds more
/// than its limit.
#[test]
fn a_group_mates_lease_is_recalled_before_an_allocation_is_refused() {
    let g = Gemini::start(SimEnv::default(), "[a]\nMemoryLimit=1GiB\n");
    let mut c = g.hooked(g.sim.command(bin("gem-workload")), "a");
    c.args([
        "--seconds",
        "0",
        "--alloc-free",
        "1",
        "--alloc-free-seconds",
        "60",
    ]);
    let mut busy = c
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    // Its loop is under way once the group holds a lease.
    let reserved = || -> u64 {
        g.status()
            .devices
            .iter()
            .flat_map(|d| d.groups.iter())
            .filter(|r| r.group == "a")
            .map(|r| r.memory_used)
            .sum()
    };
    let until = Instant::now() + Duration::from_secs(30);
    while reserved() < 64 * MIB {
        assert!(Instant::now() < until, "the busy process never leased");
        std::thread::sleep(Duration::from_millis(5));
    }
    let mut big = Memwork::start(&g, "a", &["host", "--host", "1MiB", "--device", "1000MiB"]);
    big.at("held");
    assert_eq!(
        big.num("device_error"),
        0,
        "1000 MiB fits beside the busy process's 1 MiB once its lease is back"
    );
    // (The busy process was in its loop all along.)
    assert!(busy.try_wait().unwrap().is_none(), "the busy process ended");
    busy.kill().unwrap();
    busy.wait().unwrap();
    let held = g.sim.group_memory("a");
    assert!(
        held.peak[0] <= 1 << 30,
        "the group held {} MiB under a 1 GiB limit",
        held.peak[0] / MIB
    );
    big.end();
}
