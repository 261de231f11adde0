use super::*;

fn parse(text: &str) -> Result<(ResourceConfig, Vec<Warning>), ConfigErrors> {
    parse_resource(text, Path::new("/etc/gemini/resource.conf"))
}

fn errors(text: &str) -> Vec<String> {
    parse(text)
        .expect_err("expected an error")
        .0
        .iter()
        .map(ToString::to_string)
        .collect()
}

#[test]
fn reads_groups_with_defaults() {
    let (cfg, warnings) =
        parse("[a]\nMinUtil=0.3\nMaxUtil=0.8\nMemoryLimit=2GiB\n\n[b]\n").unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    let a = cfg.group("a").unwrap();
    assert_eq!(
        (a.min_util, a.max_util, a.memory_limit, a.line),
        (0.3, 0.8, 2 << 30, 1)
    );
    let b = cfg.group("b").unwrap();
    assert_eq!(
        (b.min_util, b.max_util, b.memory_limit, b.line),
        (0.0, 1.0, DEFAULT_MEMORY_LIMIT, 6)
    );
}

#[test]
fn latency_is_normal_unless_critical_and_a_bad_value_names_its_line() {
    let (cfg, warnings) =
        parse("[serve]\nLatency=critical\n[train]\n[nb]\nLatency = Normal\n").unwrap();
    assert!(warnings.is_empty(), "{warnings:?}");
    let class = |g: &str| cfg.group(g).map(|g| g.latency);
    assert_eq!(class("serve"), Some(Latency::Critical));
    assert_eq!(class("train"), Some(Latency::Normal));
    assert_eq!(class("nb"), Some(Latency::Normal));
    let e = errors("[serve]\nMinUtil=0.3\nLatency=high\n");
    assert_eq!(
        e,
        [
            "/etc/gemini/resource.conf:3: [serve]: Latency: expected `critical` or `normal`, got \"high\""
        ]
    );
}

#[test]
fn trailing_comments_after_values_are_stripped() {
    let text = "# groups\n[user1]\nMinUtil=0.5   # half the GPU\nMemoryLimit=1GB # decimal\n";
    let (cfg, _) = parse(text).unwrap();
    let g = cfg.group("user1").unwrap();
    assert_eq!((g.min_util, g.memory_limit), (0.5, 1_000_000_000));
}

#[test]
fn percentages_are_shares() {
    let (cfg, _) = parse("[a]\nMinUtil=25%\nMaxUtil=50 %\n").unwrap();
    assert_eq!(
        cfg.group("a").map(|g| (g.min_util, g.max_util)),
        Some((0.25, 0.5))
    );
}

#[test]
fn min_above_max_names_file_line_and_group() {
    let e = errors("[a]\nMaxUtil=0.2\nMinUtil=0.5\n");
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with(
            "/etc/gemini/resource.conf:3: [a]: MinUtil 0.5 is greater than MaxUtil 0.2"
        ),
        "{}",
        e[0]
    );
}

#[test]
fn values_outside_zero_to_one_are_refused() {
    for (text, line) in [
        ("[a]\nMinUtil=1.5\n", 2),
        ("[a]\n\nMaxUtil=-0.1\n", 3),
        ("[a]\nMaxUtil=nan\n", 2),
        ("[a]\nMinUtil=lots\n", 2),
    ] {
        let e = errors(text);
        assert_eq!(e.len(), 1, "{text}: {e:?}");
        assert!(
            e[0].starts_with(&format!("/etc/gemini/resource.conf:{line}: [a]: ")),
            "{}",
            e[0]
        );
        assert!(e[0].contains("expected a number from 0 to 1"), "{}", e[0]);
    }
}

#[test]
fn sum_of_min_util_above_one_is_refused() {
    let e = errors("[a]\nMinUtil=0.6\n[b]\nMinUtil=0.5\n");
    assert_eq!(e.len(), 1);
    assert!(e[0].contains("adds up to 1.100"), "{}", e[0]);
    assert!(
        e[0].contains("a 0.6 (line 1)") && e[0].contains("b 0.5 (line 3)"),
        "{}",
        e[0]
    );
    // Exactly one is fine, despite 0.1 + 0.2 + 0.7 != 1.0 in binary.
    assert!(parse("[a]\nMinUtil=0.1\n[b]\nMinUtil=0.2\n[c]\nMinUtil=0.7\n").is_ok());
}

/// `Devices` limits a group to some GPUs: MinUtil then counts on those
/// only, beside the groups without `Devices` (on every GPU).
#[test]
fn min_util_adds_up_per_gpu_with_devices() {
    // 0.6 on GPU 0 and 0.7 on GPU 1, each beside the 0.3 of c: fits.
    let (cfg, _) =
        parse("[a]\nMinUtil=0.6\nDevices=0\n[b]\nMinUtil=0.7\nDevices=1\n[c]\nMinUtil=0.3\n")
            .unwrap();
    assert_eq!(cfg.group("a").unwrap().devices, Some(vec![0]));
    assert!(cfg.group("a").unwrap().uses(0) && !cfg.group("a").unwrap().uses(1));
    assert!(cfg.group("c").unwrap().uses(7));
    // Both on GPU 1 with c: 1.3 there.
    let e =
        errors("[a]\nMinUtil=0.6\nDevices=0;1\n[b]\nMinUtil=0.4\nDevices=1\n[c]\nMinUtil=0.3\n");
    assert_eq!(e.len(), 1, "{e:?}");
    assert!(
        e[0].contains("of the groups on GPU 1 adds up to 1.300"),
        "{}",
        e[0]
    );
    assert!(
        e[0].contains("a 0.6 (line 1)")
            && e[0].contains("b 0.4 (line 4)")
            && e[0].contains("c 0.3"),
        "{}",
        e[0]
    );
    for (bad, says) in [
        ("two", "\"two\" is not a GPU index"),
        ("0,0", "GPU 0 is listed twice"),
        (" ", "expected GPU indices"),
    ] {
        let e = errors(&format!("[a]\nDevices={bad}\n"));
        assert_eq!(e.len(), 1, "{e:?}");
        assert!(
            e[0].starts_with("/etc/gemini/resource.conf:2: [a]: Devices: ") && e[0].contains(says),
            "{}",
            e[0]
        );
    }
}

#[test]
fn unknown_size_suffix_is_refused_with_its_line() {
    let e = errors("[a]\nMinUtil=0.1\nMemoryLimit=4GX\n");
    assert_eq!(e.len(), 1);
    assert!(
        e[0].starts_with("/etc/gemini/resource.conf:3: [a]: MemoryLimit: expected a size"),
        "{}",
        e[0]
    );
    assert!(e[0].contains("\"4GX\""), "{}", e[0]);
}

/// A key gemini does not know is an error, not a warning: `MinUitl=0.7`
/// left the group at `MinUtil` 0, its guarantee gone, with only a warning
/// ("OK", exit 0) from `gem-schd check` and an INFO line at a reload.
/// Every such key is reported, with what it was probably meant to be.
/// Keys starting with `X-` stay allowed (the Desktop Entry convention for
/// extensions).
#[test]
fn an_unknown_key_is_an_error_with_a_suggestion() {
    let e = errors("[a]\nminutil=0.3\nColour=blue\n[train]\nMinUitl=0.7\n");
    assert_eq!(e.len(), 3, "{e:?}");
    assert!(
        e[0].contains(":2: [a]: minutil: unknown key") && e[0].contains("did you mean `MinUtil`"),
        "{e:?}"
    );
    assert!(
        e[1].contains(":3: [a]: Colour: unknown key") && e[1].contains("known keys are"),
        "{e:?}"
    );
    assert!(
        e[2].contains(":5: [train]: MinUitl: unknown key")
            && e[2].contains("did you mean `MinUtil`?"),
        "{e:?}"
    );
    let (cfg, w) = parse("[a]\nMinUtil=0.3\nX-Owner=ml-team\nX-Comment=anything\n").unwrap();
    assert_eq!(cfg.group("a").map(|g| g.min_util), Some(0.3));
    assert!(w.is_empty(), "{w:?}");
}

#[test]
fn every_error_in_a_file_is_reported_in_line_order() {
    let e = errors("[a]\nMinUtil=2\n[b]\nMemoryLimit=1Q\nMaxUtil=x\n");
    let lines: Vec<&str> = e.iter().map(|m| m.split(": ").next().unwrap()).collect();
    assert_eq!(
        lines,
        [
            "/etc/gemini/resource.conf:2",
            "/etc/gemini/resource.conf:4",
            "/etc/gemini/resource.conf:5"
        ]
    );
}

#[test]
fn structural_errors_have_lines() {
    let e = errors("MinUtil=0.1\n[a]\n");
    assert!(
        e[0].starts_with("/etc/gemini/resource.conf:1: a key outside any section"),
        "{}",
        e[0]
    );
    let e = errors("[a]\nMinUtil 0.3\n");
    assert!(
        e[0].starts_with("/etc/gemini/resource.conf:2: expected `Key=value`"),
        "{}",
        e[0]
    );
    let e = errors("[a]\n[b\n");
    assert!(
        e[0].starts_with("/etc/gemini/resource.conf:2: expected a section header"),
        "{}",
        e[0]
    );
}

#[test]
fn empty_file_is_valid_but_warned() {
    let (cfg, w) = parse("# nothing yet\n").unwrap();
    assert!(cfg.groups.is_empty());
    assert!(w[0].message.contains("no groups"));
}

#[test]
fn repeated_sections_and_keys_are_warned() {
    let (cfg, w) = parse("[a]\nMinUtil=0.1\n[b]\n[a]\nMinUtil=0.2\n").unwrap();
    assert_eq!(cfg.group("a").map(|g| g.min_util), Some(0.2));
    let w: Vec<String> = w.iter().map(ToString::to_string).collect();
    assert!(
        w.iter()
            .any(|m| m.contains(":4: [a]: warning: section also starts at line 1")),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|m| m.contains(":5: [a]: warning: `MinUtil` is set more than once")),
        "{w:?}"
    );
}

#[test]
fn unlimited_memory() {
    let (cfg, _) = parse("[a]\nMemoryLimit=unlimited\n").unwrap();
    assert_eq!(cfg.group("a").map(|g| g.memory_limit), Some(u64::MAX));
}

#[test]
fn diff_lists_added_removed_and_modified() {
    let (old, _) = parse("[a]\nMinUtil=0.1\n[b]\n").unwrap();
    let (new, _) = parse("[a]\nMinUtil=0.2\nMemoryLimit=2GiB\n[c]\n").unwrap();
    let d: Vec<String> = diff(&old, &new).iter().map(ToString::to_string).collect();
    assert_eq!(
        d,
        [
            "[a] MinUtil: 0.1 -> 0.2",
            "[a] MemoryLimit: unlimited -> 2.0 GiB",
            "[c] added",
            "[b] removed"
        ]
    );
    assert!(diff(&new, &new).is_empty());
}

#[test]
fn unreadable_file_names_the_path() {
    let e = load_resource(Path::new("/nonexistent/resource.conf")).unwrap_err();
    assert!(
        e.to_string()
            .starts_with("/nonexistent/resource.conf: cannot read the file"),
        "{e}"
    );
}

#[test]
fn allowed_users_and_groups_restrict_a_group() {
    let (cfg, w) = parse("[a]\nAllowedUsers=alice;bob\nAllowedGroups=ml, staff\n[b]\n").unwrap();
    // The only warnings: names this machine does not know.
    assert!(
        w.iter().all(|w| w.message.contains("on this machine")),
        "{w:?}"
    );
    let a = cfg.group("a").unwrap();
    assert_eq!(
        a.allowed_users.as_deref(),
        Some(&["alice".to_string(), "bob".to_string()][..])
    );
    assert!(a.admits("alice", &[]));
    assert!(a.admits("carol", &["staff".to_string()]));
    assert!(!a.admits("carol", &["users".to_string()]));
    assert!(
        cfg.group("b").unwrap().admits("anyone", &[]),
        "no keys: everyone"
    );
    let e = errors("[a]\nAllowedUsers=\n");
    assert!(
        e[0].contains(":2: [a]: AllowedUsers: expected a list of names"),
        "{}",
        e[0]
    );
    let e = errors("[a]\nAllowedGroups=ml;rm -rf\n");
    assert!(e[0].contains("is not a user or group name"), "{}", e[0]);
}

#[test]
fn min_above_max_is_reported_beside_other_errors_of_the_group() {
    let e = errors("[a]\nMinUtil=0.8\nMaxUtil=0.5\nMemoryLimit=1Q\n");
    assert_eq!(e.len(), 2, "{e:?}");
    assert!(
        e.iter()
            .any(|m| m.contains("MinUtil 0.8 is greater than MaxUtil 0.5")),
        "{e:?}"
    );
    assert!(e.iter().any(|m| m.contains("MemoryLimit")), "{e:?}");
}

#[test]
fn a_byte_order_mark_is_not_content() {
    let (cfg, warnings) = parse("\u{feff}[a]\nMinUtil=0.3\n").unwrap();
    assert_eq!(cfg.groups["a"].min_util, 0.3);
    assert!(warnings.is_empty(), "{warnings:?}");
}

#[test]
fn zero_memory_and_unknown_users_or_groups_are_warned_about() {
    let (_, w) = parse(
        "[a]\nMemoryLimit=0\nAllowedUsers=root;no-such-user-gemini\nAllowedGroups=no-such-group-gemini\n",
    )
    .unwrap();
    let w: Vec<String> = w.iter().map(ToString::to_string).collect();
    assert_eq!(w.len(), 3, "{w:?}");
    assert!(
        w.iter()
            .any(|m| m.contains(":2: [a]: warning: MemoryLimit is 0")),
        "{w:?}"
    );
    assert!(
        w.iter()
            .any(|m| m.contains(":3: [a]: warning: AllowedUsers: no user \"no-such-user-gemini\"")),
        "{w:?}"
    );
    assert!(
        w.iter().any(|m| m
            .contains(":4: [a]: warning: AllowedGroups: no Unix group \"no-such-group-gemini\"")),
        "{w:?}"
    );
    // root exists: no warning for it.
    assert!(!w.iter().any(|m| m.contains("\"root\"")), "{w:?}");
}

/// A `resource.conf` and its drop-in directory in a fresh directory.
fn with_drop_ins(main: &str, drop_ins: &[(&str, &str)]) -> (tempfile::TempDir, PathBuf) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("resource.conf");
    std::fs::write(&path, main).unwrap();
    let d = drop_in_dir(&path);
    std::fs::create_dir(&d).unwrap();
    for (name, text) in drop_ins {
        std::fs::write(d.join(name), text).unwrap();
    }
    (dir, path)
}

#[test]
fn drop_in_files_add_groups() {
    let (_d, path) = with_drop_ins(
        "[a]\nMinUtil=0.2\n",
        &[
            ("job-2.conf", "[job2]\nMinUtil=0.3\n"),
            ("job-1.conf", "[job1]\nMinUtil=0.1\nMemoryLimit=2GiB\n"),
            ("notes.txt", "[ignored]\n"),
        ],
    );
    assert_eq!(drop_in_dir(&path), path.with_file_name("resource.conf.d"));
    let (cfg, _) = load_resource(&path).unwrap();
    assert_eq!(
        cfg.groups.keys().collect::<Vec<_>>(),
        ["a", "job1", "job2"],
        "only *.conf files count"
    );
    assert_eq!(cfg.groups["job1"].memory_limit, 2 << 30);
    assert_eq!(cfg.path, path);
}

#[test]
fn a_group_defined_twice_or_guarantees_over_1_across_files_are_errors() {
    let (_d, path) = with_drop_ins(
        "[a]\nMinUtil=0.5\n",
        &[
            ("x.conf", "\n[a]\nMinUtil=0.1\n"),
            ("y.conf", "[b]\nMinUtil=0.6\n[c]\nMinUtil=bad\n"),
        ],
    );
    let e = load_resource(&path).unwrap_err();
    let text = e.to_string();
    assert!(
        text.contains("x.conf:2: [a]: group [a] is already defined in")
            && text.contains("resource.conf line 1"),
        "{text}"
    );
    assert!(text.contains("y.conf:4: [c]: MinUtil"), "{text}");
    let (_d, path) = with_drop_ins("[a]\nMinUtil=0.5\n", &[("y.conf", "[b]\nMinUtil=0.6\n")]);
    let text = load_resource(&path).unwrap_err().to_string();
    assert!(
        text.contains("adds up to 1.100") && text.contains("y.conf line 1"),
        "{text}"
    );
}

#[test]
fn a_drop_in_file_of_another_user_is_refused() {
    let (_d, path) = with_drop_ins("[a]\n", &[("job.conf", "[job]\nMinUtil=0.9\n")]);
    let file = drop_in_dir(&path).join("job.conf");
    let me = nix::unistd::geteuid().as_raw();
    // As root, the file is given to nobody; otherwise the scheduler is
    // taken to run as another user than the file's owner.
    let owner = if me == 0 {
        std::os::unix::fs::chown(&file, Some(65534), None).unwrap();
        0
    } else {
        me + 1
    };
    let text = load_resource_as(&path, owner).unwrap_err().to_string();
    assert!(
        text.contains("job.conf: owned by uid") && text.contains("must belong to root"),
        "{text}"
    );
}

#[test]
fn cgroups_are_absolute_paths_and_match_their_subtrees() {
    let (cfg, _) =
        parse("[job]\nCgroups=/system.slice/slurmstepd.scope/job_42 ; /kubepods/pod1/\n").unwrap();
    let g = &cfg.groups["job"];
    let m = |cg: &str| g.cgroup_match(cg);
    assert!(m("/system.slice/slurmstepd.scope/job_42").is_some());
    assert!(m("/system.slice/slurmstepd.scope/job_42/step_0/user/task_0").is_some());
    assert_eq!(
        m("/system.slice/slurmstepd.scope/job_420"),
        None,
        "not a prefix of a name"
    );
    assert!(m("/kubepods/pod1/c1").is_some());
    assert_eq!(m("/"), None);
    assert_eq!(cfg.groups["job"].cgroups.as_ref().map(Vec::len), Some(2));
    let e = parse("[job]\nCgroups=system.slice/x\n")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains(":2: [job]: Cgroups:") && e.contains("starting with `/`"),
        "{e}"
    );
    let (open, _) = parse("[open]\n").unwrap();
    assert_eq!(open.groups["open"].cgroup_match("/anything"), None);
}

#[test]
fn memory_limits_past_a_gpu_s_memory_are_named() {
    let (cfg, _) = parse(
        "[a]\nMemoryLimit=10GiB\n[b]\nMemoryLimit=8GiB\n[c]\n[d]\nMemoryLimit=4GiB\nDevices=1\n",
    )
    .unwrap();
    let gib = 1u64 << 30;
    // GPU 0: a and b (c has no limit, d may not use it): 18 GiB of 16.
    // GPU 1: a, b and d: 22 GiB of 32, fine.
    let lines = cfg.memory_overcommit(&[(0, 16 * gib), (1, 32 * gib)]);
    assert_eq!(
        lines,
        vec![
            "warning: GPU 0 has 16.0 GiB, and the MemoryLimit of the groups that may use it add up to 18.0 GiB ([a] 10.0 GiB, [b] 8.0 GiB): they cannot all have their limit at once"
                .to_string()
        ]
    );
    // One group alone past the GPU.
    let (one, _) = parse("[a]\nMemoryLimit=100GiB\n").unwrap();
    assert_eq!(
        one.memory_overcommit(&[(0, 16 * gib)]),
        vec![
            "warning: GPU 0 has 16.0 GiB, less than the MemoryLimit of [a] (100.0 GiB)".to_string()
        ]
    );
    assert!(one.memory_overcommit(&[(0, 100 * gib)]).is_empty());
}

/// `4gb` is 4 × 10^9 bytes (3.7 GiB), which GPU memory is seldom meant
/// in: the limit is taken as written, with a warning that says so and
/// what to write for powers of 2. Units of powers of 2 draw none.
#[test]
fn a_memory_limit_in_powers_of_ten_draws_a_warning() {
    let (cfg, w) =
        parse("[a]\nMemoryLimit=4gb\n[b]\nMemoryLimit=512M\n[c]\nMemoryLimit=4GiB\n").unwrap();
    assert_eq!(cfg.group("a").map(|g| g.memory_limit), Some(4_000_000_000));
    let w: Vec<String> = w.iter().map(ToString::to_string).collect();
    assert_eq!(w.len(), 2, "{w:?}");
    assert!(
        w[0].contains(":2: [a]")
            && w[0].contains(
                "MemoryLimit=4gb is in powers of 10: 4000000000 bytes, 3.7 GiB; write 4GiB"
            ),
        "{w:?}"
    );
    assert!(
        w[1].contains(":4: [b]") && w[1].contains("write 512MiB"),
        "{w:?}"
    );
}

/// A latency-critical group without `MinUtil` has no room where the other
/// groups on a GPU it may use have `MinUtil` adding up to 1; groups pinned
/// to different GPUs do not add up, whether the GPUs are known or not.
#[test]
fn a_critical_group_without_room_is_named() {
    let (cfg, _) = parse(
        "[serve]\nLatency=critical\n[a]\nMinUtil=0.6\nDevices=0\n[b]\nMinUtil=0.6\nDevices=1\n",
    )
    .unwrap();
    assert!(cfg.latency_without_room(&[]).is_empty());
    assert!(cfg.latency_without_room(&[0, 1]).is_empty());
    let (cfg, _) =
        parse("[serve]\nLatency=critical\n[a]\nMinUtil=0.6\nDevices=1\n[b]\nMinUtil=0.4\n")
            .unwrap();
    for gpus in [&[][..], &[0, 1][..]] {
        let lines = cfg.latency_without_room(gpus);
        assert_eq!(lines.len(), 1, "{gpus:?}: {lines:?}");
        assert!(
            lines[0].contains("[serve] Latency=critical has no room on GPU 1")
                && lines[0].contains("[a], [b] add up to 1"),
            "{lines:?}"
        );
    }
    // Its own MinUtil is room.
    let (cfg, _) = parse("[serve]\nLatency=critical\nMinUtil=0.1\n[a]\nMinUtil=0.9\n").unwrap();
    assert!(cfg.latency_without_room(&[0]).is_empty());
    // Devices a machine lacks, named with the group's file and line.
    let (cfg, _) = parse("[x]\n[a]\nDevices=0,7\n").unwrap();
    let missing = cfg.devices_missing(&[0, 1]);
    assert_eq!(missing.len(), 1);
    assert!(
        missing[0].ends_with(
            "line 2: [a] Devices=0,7: there is no GPU 7 here; this machine has 2 GPU(s): 0, 1"
        ),
        "{missing:?}"
    );
}
