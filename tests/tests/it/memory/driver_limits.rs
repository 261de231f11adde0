//! The driver's own memory limits per cgroup (R615, CUDA 13.4 and
//! later), set by the scheduler, and the hook alone before them.

use super::*;

/// What `gem-memwork limits` said, as numbers.
fn limits(
    sim: &SimEnv,
    cgroup: &str,
    set: Option<&str>,
    env: &[(&str, &str)],
) -> HashMap<String, u64> {
    let mut args = vec!["limits", "--cgroup", cgroup];
    if let Some(s) = set {
        args.extend(["--set", s]);
    }
    Memwork::plain(sim, &args, env)
        .said()
        .into_iter()
        .filter_map(|(k, v)| Some((k, v.parse().ok()?)))
        .collect()
}

/// The driver's own per-cgroup memory limit (R615, CUDA 13.4), as the
/// simulator models it: a driver before it has no such call
/// (`NVML_ERROR_FUNCTION_NOT_FOUND`); with it, a process in the cgroup
/// that runs without the hook is refused past the hard limit, and the
/// driver and NVML report the limit as its total; NVML's `currentUsed`
/// counts the cgroup's processes; a limit of 0 removes it.
#[test]
fn the_drivers_cgroup_limit_holds_without_the_hook() {
    let sim = SimEnv::new(1, "1GiB");
    let cg = gemini_tests::own_cgroup();
    let old = limits(&sim, &cg, Some("256MiB:256MiB"), &[]);
    assert_eq!(old["set_error"], 13, "{old:?}");
    assert_eq!(old["get_error"], 13, "{old:?}");
    let r615 = [("FAKECUDA_DRIVER_VERSION", "13050")];
    let set = limits(&sim, &cg, Some("200MiB:256MiB"), &r615);
    assert_eq!(set["set_error"], 0, "{set:?}");
    assert_eq!(
        (set["soft"], set["hard"]),
        (200 * MIB, 256 * MIB),
        "{set:?}"
    );
    assert_eq!(set["used"], 0);
    assert_eq!(set["nvml_total"], 256 * MIB, "NVML reports the limit");
    let mut w = Memwork::plain(&sim, &["context", "--chunk", "64MiB"], &r615);
    w.at("allocated");
    assert_eq!(w.num("error"), 2, "refused past the limit: {:?}", w.said);
    assert_eq!(w.num("allocated"), 256 * MIB);
    assert_eq!(w.num("total"), 256 * MIB, "cuMemGetInfo reports the limit");
    assert_eq!(w.num("free"), 0);
    let held = limits(&sim, &cg, None, &r615);
    assert_eq!(held["used"], 256 * MIB, "currentUsed: {held:?}");
    assert_eq!(held["nvml_free"], 0);
    w.go();
    w.end();
    let bad = limits(&sim, &cg, Some("300MiB:256MiB"), &r615);
    assert_eq!(bad["set_error"], 2, "a soft limit above the hard one");
    let gone = limits(&sim, &cg, Some("0:0"), &r615);
    assert_eq!((gone["set_error"], gone["hard"]), (0, 0));
    let mut w = Memwork::plain(
        &sim,
        &["context", "--chunk", "64MiB", "--most", "512MiB"],
        &r615,
    );
    w.at("allocated");
    assert_eq!((w.num("allocated"), w.num("error")), (512 * MIB, 0));
    assert_eq!(w.num("total"), 1 << 30);
    w.go();
    w.end();
}

/// The driver's limit of a group's cgroup on `dev`, from the status.
fn driver_limit(st: &gemini_protocol::StatusReport, group: &str, dev: u32) -> Option<(u64, u64)> {
    st.groups
        .iter()
        .find(|g| g.name == group)?
        .driver_memory
        .iter()
        .find(|m| m.device == dev)
        .map(|m| (m.limit, m.used))
}

/// With an R615 driver, gem-schd has the driver enforce the `MemoryLimit`
/// of a group bound to cgroups, on each of its cgroups and every GPU it
/// may use: a process of the cgroup that runs without the hook is refused
/// past it, and sees the limit as its GPU's memory, as a hooked one does.
/// The driver's count of what the cgroup holds shows in the status. The
/// limit follows a reload, is set again by a scheduler started after a
/// crash, and is removed when the group goes, even while the scheduler
/// was down.
#[test]
fn the_driver_enforces_the_memory_limit_of_a_group_bound_to_cgroups() {
    let cg = gemini_tests::own_cgroup();
    let conf = |limit: &str| format!("[job]\nCgroups={cg}\nMemoryLimit={limit}\n");
    let mut g = Gemini::start(SimEnv::new(2, "1GiB").r615(), &conf("256MiB"));
    assert!(
        g.log().contains("MemoryLimit: the driver enforces it too"),
        "{}",
        g.log()
    );
    let st = g.wait_status(5.0, "the driver's limits", |s| {
        s.driver_limits && (0..2).all(|d| driver_limit(s, "job", d).is_some())
    });
    for dev in 0..2 {
        assert_eq!(driver_limit(&st, "job", dev).unwrap().0, 256 * MIB);
    }
    let r615 = [("FAKECUDA_DRIVER_VERSION", "13050")];
    let mut plain = Memwork::plain(&g.sim, &["context", "--chunk", "64MiB"], &r615);
    plain.at("allocated");
    assert_eq!(
        (plain.num("allocated"), plain.num("error")),
        (256 * MIB, 2),
        "without the hook, refused by the driver: {:?}",
        plain.said
    );
    assert_eq!(plain.num("total"), 256 * MIB);
    g.wait_status(5.0, "the driver's count in the status", |s| {
        driver_limit(s, "job", 0) == Some((256 * MIB, 256 * MIB))
    });
    plain.go();
    plain.end();
    let mut hooked = Memwork::start(&g, "job", &["context", "--chunk", "64MiB"]);
    hooked.at("allocated");
    assert_eq!(
        (
            hooked.num("allocated"),
            hooked.num("error"),
            hooked.num("total")
        ),
        (256 * MIB, 2, 256 * MIB),
        "with the hook, the same view: {:?}",
        hooked.said
    );
    hooked.go();
    hooked.end();

    g.write_conf(&conf("512MiB"));
    g.wait_status(5.0, "the limit reloaded", |s| {
        driver_limit(s, "job", 1).is_some_and(|l| l.0 == 512 * MIB)
    });
    assert_eq!(limits(&g.sim, &cg, None, &r615)["hard"], 512 * MIB);

    // The driver forgets (a GPU reset, say) while the scheduler is down:
    // started again, it sets the limit again.
    g.kill_scheduler();
    limits(&g.sim, &cg, Some("0:0"), &r615);
    g.start_scheduler();
    g.wait_status(5.0, "the limit set again", |s| {
        driver_limit(s, "job", 0).is_some_and(|l| l.0 == 512 * MIB)
    });
    assert_eq!(limits(&g.sim, &cg, None, &r615)["hard"], 512 * MIB);

    // The group goes while the scheduler is down: its limits go with it.
    g.kill_scheduler();
    g.write_conf("[other]\n");
    g.start_scheduler();
    let st = g.status();
    assert!(
        st.groups.iter().all(|g| g.driver_memory.is_empty()),
        "{st:?}"
    );
    for dev in ["0", "1"] {
        let args = ["limits", "--cgroup", &cg, "--device", dev];
        let said = Memwork::plain(&g.sim, &args, &r615).said();
        assert_eq!(said["hard"], "0", "GPU {dev}: {said:?}");
    }
}

/// A driver before R615 has no per-cgroup limits: gem-schd says once that
/// the hook enforces `MemoryLimit`, sets nothing, and the status says so.
#[test]
fn before_r615_the_hook_alone_enforces_the_memory_limit() {
    let cg = gemini_tests::own_cgroup();
    let g = Gemini::start(
        SimEnv::new(1, "1GiB"),
        &format!("[job]\nCgroups={cg}\nMemoryLimit=256MiB\n"),
    );
    let st = g.status();
    assert!(!st.driver_limits);
    assert!(st.groups.iter().all(|g| g.driver_memory.is_empty()));
    assert_eq!(
        g.log().matches("MemoryLimit: the hook enforces it").count(),
        1,
        "{}",
        g.log()
    );
    // Without the hook nothing stops a process of the job.
    let mut plain = Memwork::plain(
        &g.sim,
        &["context", "--chunk", "64MiB", "--most", "512MiB"],
        &[],
    );
    plain.at("allocated");
    assert_eq!(plain.num("allocated"), 512 * MIB);
    plain.go();
    plain.end();
}
