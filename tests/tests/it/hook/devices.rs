//! GPUs: separate gates, visible devices, device cgroups, containers, MIG.

use super::*;

#[test]
fn devices_are_gated_separately_and_visible_devices_are_mapped() {
    let _serial = serial();
    // Two devices. Both workloads use physical device 1: one sees it as
    // its only device (CUDA_VISIBLE_DEVICES=1, ordinal 0), the other picks
    // ordinal 1 of two. Their group's cap must hold for the two together,
    // on device 1, and device 0 must stay idle.
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[capped]\nMaxUtil=0.4\n");
    let mut a = rust(&g, "capped", &["--seconds", "5", "--kernel-us", "500"]);
    a.env("CUDA_VISIBLE_DEVICES", "1");
    let b = rust(
        &g,
        "capped",
        &["--seconds", "5", "--kernel-us", "500", "--device", "1"],
    );
    let cpu = CpuTimes::now();
    let t0 = now_ns();
    let (ca, cb) = (spawn(a), spawn(b));
    let (oa, ob) = (finish(ca), finish(cb));
    let busy1 = g.sim.busy(1, t0 + SEC, t0 + 5 * SEC);
    let (sa, sb) = (busy1.share(pid_of(&oa)), busy1.share(pid_of(&ob)));
    let counts = cpu.counts("the group on device 1");
    let least = if counts { 0.1 } else { 0.0 };
    assert!(
        sa > least && sb > least,
        "both ran on device 1: {sa:.3} {sb:.3}"
    );
    assert_capped("the group on device 1", sa + sb, 0.40, 0.04, counts);
    assert_eq!(g.sim.busy(0, t0, now_ns()).device, 0, "device 0 untouched");
    // Every GPU is listed (NVML's two); only physical device 1 was used.
    let st = g.status();
    let used: Vec<u32> = st
        .devices
        .iter()
        .filter(|d| d.busy > 0.0 || !d.groups.is_empty())
        .map(|d| d.device)
        .collect();
    assert_eq!(used, [1], "scheduler saw physical device 1 only: {st:?}");
}

/// In a device cgroup (Slurm's `ConstrainDevices`) a job's only GPU is
/// CUDA ordinal 0 and `CUDA_VISIBLE_DEVICES` says 0, whichever GPU of the
/// machine it is: the hook names it to the scheduler by the machine's own
/// index, found through the GPU's UUID, so its time and memory count on
/// that GPU (here 2 of 4), not on GPU 0.
#[test]
fn a_job_in_a_device_cgroup_is_scheduled_on_its_own_gpu() {
    let g = Gemini::start(SimEnv::new(4, "16GiB"), "[job]\nMemoryLimit=1GiB\n");
    let mut c = rust(
        &g,
        "job",
        &["--seconds", "0.5", "--kernel-us", "500", "--mem", "256MiB"],
    );
    c.env("FAKECUDA_CGROUP_DEVICES", "2")
        .env("CUDA_VISIBLE_DEVICES", "0");
    let t0 = now_ns();
    let child = spawn(c);
    wait_memory_on(&g, "job", 2);
    let st = g.status();
    assert!(
        st.devices
            .iter()
            .all(|d| d.device == 2 || d.groups.iter().all(|r| r.group != "job")),
        "{st:?}"
    );
    let out = finish(child);
    assert_ran_only_on(&g, pid_of(&out), t0, 2, 4);
    assert_eq!(g.sim.busy(0, t0, now_ns()).device, 0);
}

/// Where the scheduler has no NVML it cannot map UUIDs: the hook falls
/// back to its own NVML, which in a device cgroup still numbers every GPU,
/// and the job is accounted on its GPU all the same. (A first version of
/// the scheduler's map hung here: the fallback waited for the map it was
/// finding.)
#[test]
fn without_nvml_at_the_scheduler_a_job_in_a_device_cgroup_keeps_its_gpu() {
    let mut g = Gemini::start(SimEnv::new(4, "16GiB"), "[job]\nDevices=3\n");
    g.kill_scheduler();
    g.start_scheduler_with(false);
    let mut c = rust(
        &g,
        "job",
        &["--seconds", "0.5", "--kernel-us", "500", "--mem", "64MiB"],
    );
    c.env("FAKECUDA_CGROUP_DEVICES", "3");
    let t0 = now_ns();
    let mut child = spawn(c);
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "a 0.5 s job still ran after 30 s: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    let out = finish(child);
    assert_ran_only_on(&g, pid_of(&out), t0, 3, 4);
}

/// In a container (Kubernetes' device plugin, `docker run --gpus`) NVML
/// too sees only the container's GPUs and numbers them from 0: the hook
/// asks the scheduler for its index of each GPU by UUID. A job given GPU 2
/// of 4, whose group may use GPU 2 only, runs, is accounted on GPU 2, and
/// NVML's memory view in the job is its group's on GPU 2.
#[test]
fn a_job_in_a_container_is_scheduled_on_its_own_gpu() {
    let r = job_in_a_container("--nvml");
    assert_eq!(
        (field(&r, "nvml_total"), field(&r, "nvml_free")),
        (1u64 << 30, (1u64 << 30) - (256 << 20)),
        "NVML's view of the container's GPU is the group's on GPU 2"
    );
}

/// vLLM asks NVML for memory before it initialises CUDA: the hook's GPU
/// map must not be built (empty) from a driver that does not answer yet.
/// A job in a container given GPU 2 of 4, whose first call is NVML's,
/// runs and is accounted on GPU 2. (Before, the empty map sent its
/// tokens and memory to GPU 0, which its group may not use: refused.)
#[test]
fn nvml_asked_before_cuda_leaves_the_gpu_map_to_the_driver() {
    let r = job_in_a_container("--nvml-first");
    assert_eq!(
        field(&r, "nvml_total"),
        1u64 << 30,
        "NVML's view before cuInit is the group's on GPU 2"
    );
}

/// A MIG instance (`CUDA_VISIBLE_DEVICES=MIG-…`, as Slurm and the
/// Kubernetes device plugin hand them out) is CUDA's ordinal 0 and has a
/// UUID of its own: the hook finds its GPU through NVML, and the job is
/// scheduled and charged there. (Before, the instance's UUID matched no
/// GPU and the job went to GPU 0, which its group may not use: refused.)
#[test]
fn a_mig_instance_is_scheduled_on_its_gpu() {
    let r = job_on_gpu_2(
        "--nvml",
        &[
            ("FAKECUDA_MIG", "2"),
            // The simulator's instance of GPU 2 (see fakecuda::device).
            (
                "CUDA_VISIBLE_DEVICES",
                "MIG-facec0da-0000-4000-8000-000000004d02",
            ),
        ],
    );
    assert_eq!(field(&r, "allocated"), 256u64 << 20);
}

/// A group with `Devices=1` launches on GPU 1; on GPU 0 its launches get
/// CUDA_ERROR_NOT_PERMITTED, and the program's stderr says why, once.
#[test]
fn a_group_launching_outside_its_devices_is_told_why() {
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[job]\nDevices=1\n");
    let out = rust(&g, "job", &["--seconds", "0.3", "--kernel-us", "500"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert_eq!(
        err.matches("refused by gemini: group \"job\" may use GPU 1 only")
            .count(),
        1,
        "{err}"
    );
    assert!(err.contains("CUDA_ERROR_NOT_PERMITTED"), "{err}");
    assert!(err.contains("CUresult 800"), "{err}");
    let ok = finish(spawn(rust(
        &g,
        "job",
        &["--seconds", "0.3", "--kernel-us", "500", "--device", "1"],
    )));
    assert!(field(&reports(&ok.stdout)[0], "kernels") > 10);
}
