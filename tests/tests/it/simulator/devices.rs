//! Several simulated devices: independent timelines, and the numbering
//! `CUDA_VISIBLE_DEVICES` and a device cgroup give CUDA and NVML.

use super::*;

#[test]
fn two_devices_are_independent() {
    let sim = SimEnv::new(2, "16GiB");
    let w = |dev: &str| {
        let mut c = sim.workload();
        c.args(["--seconds", "1", "--kernel-us", "1000", "--device", dev])
            .stdout(Stdio::piped());
        c.spawn().unwrap()
    };
    let measure = || {
        let t0 = now_ns();
        let (a, b) = (w("0"), w("1"));
        let (oa, ob) = (a.wait_with_output().unwrap(), b.wait_with_output().unwrap());
        let (pa, pb) = (pids(&[&oa])[0], pids(&[&ob])[0]);
        let (b0, b1) = (
            sim.busy(0, t0 + SEC / 5, t0 + SEC),
            sim.busy(1, t0 + SEC / 5, t0 + SEC),
        );
        // Each process on its own device only.
        assert_eq!(b0.share(pb), 0.0);
        assert_eq!(b1.share(pa), 0.0);
        (b0.share(pa), b1.share(pb))
    };
    let ((sa, sb), counts) = measured("two devices", MAX_STEAL, 2, measure);
    assert!(sa > 0.0 && sb > 0.0, "{sa:.3} {sb:.3}");
    if counts {
        assert!(sa >= 0.97 && sb >= 0.97, "{sa:.3} {sb:.3}");
    }
    let mut bad = sim.workload();
    bad.args(["--seconds", "0", "--device", "2"]);
    let out = bad.output().unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("cuDeviceGet failed with CUresult 101"));
}

#[test]
fn cuda_visible_devices_renumbers_devices() {
    let sim = SimEnv::new(2, "16GiB");
    let mut c = sim.workload();
    c.args(["--seconds", "0.3", "--kernel-us", "1000"])
        .env("CUDA_VISIBLE_DEVICES", "1");
    let t0 = now_ns();
    let out = run(c);
    let pid = pids(&[&out])[0];
    assert!(
        sim.busy(1, t0, now_ns()).share(pid) > 0.5,
        "ordinal 0 is physical device 1"
    );
    assert_eq!(sim.busy(0, t0, now_ns()).device, 0);
    let mut c = sim.workload();
    c.args(["--seconds", "0", "--device", "1"])
        .env("CUDA_VISIBLE_DEVICES", "1");
    assert!(
        !c.output().unwrap().status.success(),
        "only one device is visible"
    );
}

/// A device cgroup (Slurm's `ConstrainDevices`, a container's `--gpus`)
/// hides the other GPUs from CUDA, which numbers the allowed ones from 0,
/// while NVML still counts every GPU and refuses a handle to the hidden
/// ones (`NVML_ERROR_NO_PERMISSION`, 4); in a container, which has only
/// its GPUs' device nodes, NVML too numbers them from 0. A GPU's UUID is
/// the same through both and in every process: what names a GPU across
/// processes whose ordinals differ.
#[test]
fn a_device_cgroup_renumbers_cuda_and_nvml_names_every_gpu_by_uuid() {
    let sim = SimEnv::new(4, "16GiB");
    let identify_in = |container: bool, cgroup: Option<&str>, visible: Option<&str>| {
        let mut c = sim.workload();
        c.arg("--identify");
        if container {
            c.env("FAKECUDA_CONTAINER", "1");
        }
        if let Some(v) = cgroup {
            c.env("FAKECUDA_CGROUP_DEVICES", v);
        }
        if let Some(v) = visible {
            c.env("CUDA_VISIBLE_DEVICES", v);
        }
        let out = run(c);
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        let cuda: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("cuda ordinal="))
            .map(|l| l.split_once(" uuid=").unwrap().1.to_string())
            .collect();
        let nvml: Vec<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("nvml index="))
            .map(|l| l.split_once(' ').unwrap().1.to_string())
            .collect();
        (cuda, nvml)
    };
    let identify =
        |cgroup: Option<&str>, visible: Option<&str>| identify_in(false, cgroup, visible);
    let (cuda, nvml) = identify(None, None);
    assert_eq!(cuda.len(), 4);
    let uuids: Vec<String> = nvml
        .iter()
        .map(|v| v.strip_prefix("uuid=").unwrap().to_string())
        .collect();
    assert_eq!(cuda, uuids, "ordinal i is GPU i without a cgroup");
    let distinct: std::collections::BTreeSet<&String> = uuids.iter().collect();
    assert_eq!(distinct.len(), 4);
    assert!(
        uuids.iter().all(|u| u.starts_with("GPU-") && u.len() == 40),
        "{uuids:?}"
    );

    // A job given GPUs 1 and 3: CUDA sees two, as ordinals 0 and 1.
    let (cuda, nvml) = identify(Some("3,1"), None);
    assert_eq!(cuda, [uuids[1].clone(), uuids[3].clone()]);
    assert_eq!(nvml.len(), 4, "NVML counts every GPU: {nvml:?}");
    assert_eq!(nvml[0], "error=4");
    assert_eq!(nvml[1], format!("uuid={}", uuids[1]));
    assert_eq!(nvml[2], "error=4");
    assert_eq!(nvml[3], format!("uuid={}", uuids[3]));
    // CUDA_VISIBLE_DEVICES counts within the cgroup.
    let (cuda, _) = identify(Some("1,3"), Some("1"));
    assert_eq!(cuda, [uuids[3].clone()]);
    // A container given GPUs 1 and 3 has only their device nodes: NVML
    // too sees two GPUs, numbered 0 and 1; the UUIDs still name them.
    let (cuda, nvml) = identify_in(true, Some("3,1"), None);
    assert_eq!(cuda, [uuids[1].clone(), uuids[3].clone()]);
    assert_eq!(
        nvml,
        [format!("uuid={}", uuids[1]), format!("uuid={}", uuids[3])],
        "NVML in a container sees only its GPUs"
    );

    // A kernel on ordinal 0 of a job given GPU 2 runs on GPU 2.
    let mut c = sim.workload();
    c.args(["--seconds", "0.3", "--kernel-us", "1000"])
        .env("FAKECUDA_CGROUP_DEVICES", "2");
    let t0 = now_ns();
    let out = run(c);
    let pid = pids(&[&out])[0];
    assert!(sim.busy(2, t0, now_ns()).share(pid) > 0.5);
    assert_eq!(sim.busy(0, t0, now_ns()).device, 0);
}
