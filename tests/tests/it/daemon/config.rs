//! `resource.conf` through the daemon: errors naming the file and line,
//! `gem-schd check`, live reloads (edits, replaced directories, symlinks,
//! drop-ins, an emptied file), SIGHUP and `gem-schd reload`.

use super::*;

#[test]
fn unknown_group_is_refused_naming_the_config_file() {
    let s = Gemini::daemon("[train]\n");
    let mut c = s.client();
    match hello(&mut c, "nobody") {
        Reply::Error(e) => {
            assert_eq!(e.kind, ErrorKind::UnknownGroup);
            assert!(
                e.message.contains(&s.conf().display().to_string()),
                "{}",
                e.message
            );
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn edit_of_resource_conf_applies_live() {
    let s = Gemini::daemon("[a]\nMinUtil=0.2\n");
    fs::write(s.conf(), "[a]\nMinUtil=0.4\n").unwrap();
    s.wait_status(5.0, "in-place edit", |st| group_min(st, "a") == Some(0.4));
    save_like_an_editor(&s.conf(), "[a]\nMinUtil=0.6\n[b]\n");
    s.wait_status(5.0, "write-and-rename", |st| {
        group_min(st, "a") == Some(0.6) && group_min(st, "b") == Some(0.0)
    });
    // And again, after the rename replaced the watched file.
    save_like_an_editor(&s.conf(), "[b]\nMinUtil=0.1\n");
    s.wait_status(5.0, "second rename", |st| {
        group_min(st, "a").is_none() && group_min(st, "b") == Some(0.1)
    });
    assert!(s.log().contains("[b] MinUtil: 0 -> 0.1"), "{}", s.log());
}

#[test]
fn lowered_memory_limit_applies_to_running_clients() {
    let s = Gemini::daemon("[a]\nMemoryLimit=2GiB\n");
    let mut c = s.client();
    hello(&mut c, "a");
    let r = reserve(&mut c, 1 << 30);
    assert!(matches!(r, Reply::Memory { .. }));
    save_like_an_editor(&s.conf(), "[a]\nMemoryLimit=1GiB\n");
    s.wait_status(5.0, "new limit", |st| st.groups[0].memory_limit == 1 << 30);
    let r = c
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1,
            },
            T,
        )
        .unwrap();
    assert_eq!(error_kind(&r), Some(ErrorKind::OutOfMemory));
}

#[test]
fn broken_edit_keeps_the_last_good_config_and_logs_file_and_line() {
    let s = Gemini::daemon("[a]\nMinUtil=0.2\n");
    save_like_an_editor(&s.conf(), "[a]\nMinUtil=0.2\nMaxUtil=0.1\n");
    let st = s.wait_status(5.0, "config error", |st| st.config_error.is_some());
    assert_eq!(group_min(&st, "a"), Some(0.2));
    let want = format!(
        "{}:2: [a]: MinUtil 0.2 is greater than MaxUtil 0.1",
        s.conf().display()
    );
    assert!(
        st.config_error.as_deref().unwrap().contains(&want),
        "{:?}",
        st.config_error
    );
    let deadline = Instant::now() + T;
    while !s.log().contains(&want) && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(s.log().contains(&want), "log lacks the error:\n{}", s.log());
    assert!(s.log().contains("keeping the previous configuration"));
    // Clients of the old configuration are still served.
    let mut c = s.client();
    assert!(matches!(hello(&mut c, "a"), Reply::Welcome { .. }));
    // Deleted, then garbage, then fixed: only the fix applies.
    fs::remove_file(s.conf()).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    fs::write(s.conf(), "\u{0}\u{1}garbage\n").unwrap();
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(group_min(&s.status(), "a"), Some(0.2));
    fs::write(s.conf(), "[a]\nMinUtil=0.3\n").unwrap();
    let st = s.wait_status(5.0, "fixed config", |st| group_min(st, "a") == Some(0.3));
    assert!(st.config_error.is_none());
}

/// A typo in a key (`MinUitl=0.7`) is refused, by `gem-schd check` (with
/// exit code 1) and at a live reload, which keeps the group's guarantee
/// as it was: it used to be a warning, and the reload dropped the group
/// to `MinUtil` 0.
#[test]
fn a_typo_in_a_key_is_refused_and_the_guarantee_stays() {
    let s = Gemini::daemon("[train]\nMinUtil=0.5\n");
    save_like_an_editor(&s.conf(), "[train]\nMinUitl=0.7\n");
    let st = s.wait_status(5.0, "config error", |st| st.config_error.is_some());
    assert_eq!(group_min(&st, "train"), Some(0.5));
    let err = st.config_error.clone().unwrap();
    assert!(
        err.contains(&format!(
            "{}:2: [train]: MinUitl: unknown key",
            s.conf().display()
        )) && err.contains("did you mean `MinUtil`?"),
        "{err}"
    );
    let out = Command::new(schd_bin())
        .arg("check")
        .arg(s.conf())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("did you mean `MinUtil`?"));
}

#[test]
fn invalid_config_at_start_is_refused_with_file_and_line() {
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("resource.conf");
    fs::write(&conf, "[a]\nMinUtil=0.8\n[b]\nMinUtil=0.8\n").unwrap();
    let out = Command::new(schd_bin())
        .arg("--config")
        .arg(&conf)
        .arg("--ipc-dir")
        .arg(dir.path().join("ipc"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&conf.display().to_string()) && err.contains("adds up to 1.600"),
        "{err}"
    );
}

#[test]
fn check_subcommand_validates_files() {
    let dir = tempfile::tempdir().unwrap();
    let good = dir.path().join("good.conf");
    fs::write(&good, "[a]\nMinUtil=0.5 # half\n").unwrap();
    let out = Command::new(schd_bin())
        .arg("check")
        .arg(&good)
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(String::from_utf8_lossy(&out.stdout).contains("[a] MinUtil=0.5"));
    let bad = dir.path().join("bad.conf");
    fs::write(&bad, "[a]\n\nMemoryLimit=3 bananas\n").unwrap();
    let out = Command::new(schd_bin())
        .arg("check")
        .arg(&bad)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.starts_with(&format!("{}:3: [a]: MemoryLimit", bad.display())),
        "{err}"
    );
    let out = Command::new(schd_bin())
        .arg("check")
        .arg(dir.path().join("missing.conf"))
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    // Without a file: a usage line of what check needs alone (it named
    // --ipc-dir and --settings, which check never reads).
    let out = Command::new(schd_bin()).arg("check").output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2));
    assert!(err.contains("Usage: gem-schd check <FILE>\n"), "{err}");
}

/// `gem-schd check FILE` on `sim`'s NVML.
fn check_on(sim: &SimEnv, file: &Path) -> std::process::Output {
    sim.command(schd_bin())
        .arg("check")
        .arg(file)
        .output()
        .unwrap()
}

/// `gem-schd check` compares the groups' memory limits with the GPUs'
/// memory (through NVML): limits that add up to more than a GPU has are
/// a warning, not an error; where NVML finds no GPU, it says that they
/// were not compared.
#[test]
fn check_warns_where_memory_limits_add_up_past_a_gpu() {
    let sim = SimEnv::new(2, "16GiB");
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("resource.conf");
    fs::write(
        &conf,
        "[a]\nMemoryLimit=10GiB\n[b]\nMemoryLimit=8GiB\nDevices=0\n[c]\n",
    )
    .unwrap();
    let out = check_on(&sim, &conf);
    assert!(out.status.success(), "a warning, not an error");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.lines().collect::<Vec<_>>(),
        vec![
            "warning: GPU 0 has 16.0 GiB, and the MemoryLimit of the groups that may use it add up to 18.0 GiB ([a] 10.0 GiB, [b] 8.0 GiB): they cannot all have their limit at once"
        ],
        "GPU 1 has only [a]'s 10 GiB"
    );
    let out = Command::new(schd_bin())
        .arg("check")
        .arg(&conf)
        .env("LD_LIBRARY_PATH", dir.path())
        .output()
        .unwrap();
    assert!(out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("were not compared"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `gem-schd check` refuses `Devices` that name a GPU the machine does
/// not have (where NVML shows the GPUs), warns of a latency-critical
/// group with no room beside groups whose `MinUtil` adds up to 1, and
/// its summary shows every setting of every group.
#[test]
fn check_refuses_missing_gpus_and_warns_of_a_critical_group_without_room() {
    let sim = SimEnv::new(2, "16GiB");
    let dir = tempfile::tempdir().unwrap();
    let conf = dir.path().join("resource.conf");
    let check = |text: &str| {
        fs::write(&conf, text).unwrap();
        let out = check_on(&sim, &conf);
        (
            out.status.code(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let (code, _, err) = check("[a]\nDevices=0,7\n");
    assert_eq!(code, Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{} line 1: [a] Devices=0,7: there is no GPU 7 here; this machine has 2 GPU(s): 0, 1",
            conf.display()
        )),
        "{err}"
    );
    let (code, out, err) = check(
        "[serve]\nLatency=critical\nAllowedUsers=alice,bob\n[a]\nMinUtil=0.6\nDevices=1\n[b]\nMinUtil=0.4\n",
    );
    assert_eq!(code, Some(0), "a warning, not an error: {err}");
    assert!(
        err.contains(
            "[serve] Latency=critical has no room on GPU 1: the MinUtil of [a], [b] add up to 1"
        ),
        "{err}"
    );
    assert!(
        !err.contains("GPU 0"),
        "on GPU 0 only [b] has a MinUtil: {err}"
    );
    assert!(
        out.contains(
            "[serve] MinUtil=0 MaxUtil=1 MemoryLimit=unlimited Latency=critical Devices=all AllowedUsers=alice,bob AllowedGroups=(any) Cgroups=(by name)"
        ) && out.contains("[a] MinUtil=0.6 MaxUtil=1 MemoryLimit=unlimited Latency=normal Devices=1"),
        "{out}"
    );
    // With room (a MinUtil of its own), nothing to say.
    let (code, _, err) = check("[serve]\nLatency=critical\nMinUtil=0.2\n[a]\nMinUtil=0.8\n");
    assert_eq!(code, Some(0));
    assert!(!err.contains("no room"), "{err}");
}

/// SIGHUP re-reads resource.conf (it used to kill the daemon silently and
/// leave its socket behind), and `gem-schd reload` does the same on
/// request: the new groups are in force when it returns, and a broken file
/// is reported with its line while the running configuration stays.
#[test]
fn sighup_and_the_reload_subcommand_reread_the_config() {
    let mut s = Gemini::daemon("[a]\nMinUtil=0.2\n");
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(s.scheduler_pid().unwrap() as i32, libc::SIGHUP) };
    s.wait_status(5.0, "after SIGHUP", |_| true);
    assert!(s.alive(), "SIGHUP killed the daemon");
    let deadline = Instant::now() + T;
    while !s.log().contains("SIGHUP: reloading") {
        assert!(Instant::now() < deadline, "no SIGHUP line: {}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let reload = |s: &Gemini| {
        Command::new(schd_bin())
            .arg("reload")
            .arg("--ipc-dir")
            .arg(s.ipc())
            .output()
            .unwrap()
    };
    fs::write(s.conf(), "[a]\nMinUtil=0.4\n[b]\n").unwrap();
    let out = reload(&s);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let st = s.status();
    assert_eq!(group_min(&st, "a"), Some(0.4));
    assert_eq!(group_min(&st, "b"), Some(0.0));
    fs::write(s.conf(), "[a]\nMinUtil=banana\n").unwrap();
    let out = reload(&s);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains("resource.conf:2") && err.contains("previous configuration stays"),
        "{err}"
    );
    assert_eq!(group_min(&s.status(), "a"), Some(0.4));
}

/// The live reload survives its directory being removed and made again
/// (it used to stop for good with "No such file or directory"), and a
/// symlinked resource.conf is re-read when the link is pointed at a new
/// file, the way a Kubernetes ConfigMap is updated.
#[test]
fn live_reload_survives_a_replaced_directory_and_follows_a_symlink() {
    let dir = tempfile::tempdir().unwrap();
    let etc = dir.path().join("etc");
    fs::create_dir(&etc).unwrap();
    let conf = etc.join("resource.conf");
    fs::write(&conf, "[a]\n").unwrap();
    let mut child = Command::new(schd_bin())
        .arg("--config")
        .arg(&conf)
        .arg("--ipc-dir")
        .arg(dir.path().join("ipc"))
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = || -> Option<StatusReport> {
        let mut c = Client::connect(&dir.path().join("ipc")).ok()?;
        match c.request(&Request::Status, T).ok()? {
            Reply::Status(s) => Some(*s),
            _ => None,
        }
    };
    let wait = |what: &str, pred: &dyn Fn(&StatusReport) -> bool| {
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if status().is_some_and(|s| pred(&s)) {
                return;
            }
            assert!(Instant::now() < deadline, "{what}: {:?}", status());
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    wait("started", &|s| group_min(s, "a") == Some(0.0));
    // The directory goes away and comes back with a new file.
    fs::remove_dir_all(&etc).unwrap();
    std::thread::sleep(Duration::from_millis(300));
    fs::create_dir(&etc).unwrap();
    fs::write(&conf, "[b]\nMinUtil=0.2\n").unwrap();
    wait("directory made again", &|s| {
        group_min(s, "b") == Some(0.2) && s.config_error.is_none()
    });
    // As a ConfigMap is mounted: resource.conf -> ..data/resource.conf,
    // ..data -> ..v1; an update makes ..v2 and swaps ..data by a rename.
    // No event names resource.conf.
    let v1 = etc.join("..v1");
    let v2 = etc.join("..v2");
    fs::create_dir(&v1).unwrap();
    fs::create_dir(&v2).unwrap();
    fs::write(v1.join("resource.conf"), "[c]\nMinUtil=0.3\n").unwrap();
    fs::write(v2.join("resource.conf"), "[d]\nMinUtil=0.4\n").unwrap();
    let data = etc.join("..data");
    std::os::unix::fs::symlink("..v1", &data).unwrap();
    let tmp = etc.join("resource.conf.tmp");
    std::os::unix::fs::symlink("..data/resource.conf", &tmp).unwrap();
    fs::rename(&tmp, &conf).unwrap();
    wait("linked to v1", &|s| group_min(s, "c") == Some(0.3));
    let data_tmp = etc.join("..data_tmp");
    std::os::unix::fs::symlink("..v2", &data_tmp).unwrap();
    fs::rename(&data_tmp, &data).unwrap();
    wait("..data swapped to v2", &|s| group_min(s, "d") == Some(0.4));
    let _ = child.kill();
    let _ = child.wait();
}

#[test]
fn emptied_config_refuses_new_clients_and_keeps_running_ones() {
    let s = Gemini::daemon("[a]\nMemoryLimit=2GiB\n");
    let mut running = s.client();
    assert!(matches!(hello(&mut running, "a"), Reply::Welcome { .. }));
    // An empty file is a file being rewritten (truncated, then written):
    // it used to remove every group for a moment. It changes nothing.
    fs::write(s.conf(), "").unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s
        .log()
        .contains("is empty; keeping the previous configuration")
    {
        assert!(
            Instant::now() < deadline,
            "no word on the empty file:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(!s.log().contains("reloaded: [a] removed"), "{}", s.log());
    let st = s.status();
    assert_eq!(
        st.groups
            .iter()
            .map(|g| (g.name.as_str(), g.memory_limit))
            .collect::<Vec<_>>(),
        [("a", 2 << 30)],
        "the configuration in force changed"
    );
    // A file with nothing but a comment removes every group, on purpose.
    save_like_an_editor(&s.conf(), "# no groups for now\n");
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.log().contains("reloaded: [a] removed") {
        assert!(
            Instant::now() < deadline,
            "empty config not applied:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(s.log().contains("no groups defined"), "{}", s.log());
    let st = s.status();
    assert!(st.config_error.is_none());
    assert_eq!(
        st.groups
            .iter()
            .map(|g| (g.name.as_str(), g.clients))
            .collect::<Vec<_>>(),
        [("a", 1)],
        "kept while its client runs"
    );
    let mut newcomer = s.client();
    assert_eq!(
        error_kind(&hello(&mut newcomer, "a")),
        Some(ErrorKind::UnknownGroup)
    );
    let r = reserve(&mut running, 1 << 30);
    assert_eq!(
        r,
        Reply::Memory {
            device: 0,
            used: 1 << 30,
            limit: 2 << 30
        },
        "the running client keeps its group's last limit"
    );
}

/// Drop-in groups: every `*.conf` in `resource.conf.d` adds groups, read
/// live — the directory made after the start, files added, edited and
/// removed — while resource.conf itself stays empty; a group defined in
/// two files is refused naming both, and the last good configuration
/// stays.
#[test]
fn drop_in_files_add_and_remove_groups_live() {
    let s = Gemini::daemon("");
    let d = s.dir().join("resource.conf.d");
    fs::create_dir(&d).unwrap();
    save_like_an_editor(&d.join("job-1.conf"), "[job1]\nMinUtil=0.3\n");
    s.wait_status(5.0, "a drop-in group", |st| {
        group_min(st, "job1") == Some(0.3)
    });
    fs::write(d.join("job-2.conf"), "[job2]\nMinUtil=0.7\n").unwrap();
    s.wait_status(5.0, "a second one", |st| group_min(st, "job2") == Some(0.7));
    fs::write(d.join("notes.txt"), "[not-a-group]\n").unwrap();
    fs::write(d.join("z-dup.conf"), "[job1]\n").unwrap();
    let st = s.wait_status(5.0, "the duplicate refused", |st| st.config_error.is_some());
    let err = st.config_error.clone().unwrap();
    assert!(
        err.contains("z-dup.conf:1: [job1]: group [job1] is already defined in")
            && err.contains("job-1.conf line 1"),
        "{err}"
    );
    assert_eq!(
        group_min(&st, "job2"),
        Some(0.7),
        "the last good configuration stays"
    );
    fs::remove_file(d.join("z-dup.conf")).unwrap();
    fs::remove_file(d.join("job-1.conf")).unwrap();
    let st = s.wait_status(5.0, "job1 removed", |st| {
        st.config_error.is_none() && group_min(st, "job1").is_none()
    });
    assert_eq!(group_min(&st, "job2"), Some(0.7));
    assert!(group_min(&st, "not-a-group").is_none());
    fs::remove_dir_all(&d).unwrap();
    s.wait_status(5.0, "the directory removed", |st| st.groups.is_empty());
}

/// `--config` given relative to where gem-schd was started: `status`
/// names the file by its absolute path, which a user can open from
/// anywhere (it showed `resource.conf`).
#[test]
fn a_relative_config_path_is_shown_absolute() {
    let sim = SimEnv::default();
    let conf = sim.path().join("resource.conf");
    std::fs::write(&conf, "[a]\n").unwrap();
    let ipc = sim.path().join("ipc");
    let mut schd = sim.command(bin("gem-schd"));
    schd.current_dir(sim.path())
        .args(["--config", "resource.conf", "--ipc-dir"])
        .arg(&ipc)
        .env_remove("GEMINI_IPC_DIR")
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let mut child = schd.spawn().unwrap();
    let want = format!("config {}", conf.display());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    let mut last = String::new();
    while std::time::Instant::now() < deadline {
        let out = sim
            .command(bin("gem-schd"))
            .arg("status")
            .arg("--ipc-dir")
            .arg(&ipc)
            .output()
            .unwrap();
        last = String::from_utf8_lossy(&out.stdout).into_owned();
        if out.status.success() {
            break;
        }
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let _ = child.kill();
    let _ = child.wait();
    assert!(last.contains(&want), "{last}");
}

/// Where the groups' `MemoryLimit`s add up past a GPU (16 GiB here), the
/// daemon warns once, at start, in a line that does not say "warning"
/// twice; a reload that changes something else does not repeat it, and
/// one that changes the sum says the new one.
#[test]
fn a_memory_overcommit_is_said_once_and_again_only_when_it_changes() {
    let s = Gemini::daemon("[a]\nMemoryLimit=12GiB\n[b]\nMemoryLimit=12GiB\n");
    let said = |s: &Gemini| {
        s.log()
            .lines()
            .filter(|l| l.contains("cannot all have their limit"))
            .map(str::to_string)
            .collect::<Vec<_>>()
    };
    let reloaded = |s: &Gemini, what: &str| {
        let deadline = Instant::now() + Duration::from_secs(5);
        while !s.log().contains(what) {
            assert!(Instant::now() < deadline, "no reload:\n{}", s.log());
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let first = said(&s);
    assert_eq!(first.len(), 1, "{}", s.log());
    assert!(!first[0].contains("warning:"), "{}", first[0]);
    save_like_an_editor(
        &s.conf(),
        "[a]\nMemoryLimit=12GiB\n[b]\nMemoryLimit=12GiB\nMinUtil=0.2\n",
    );
    reloaded(&s, "reloaded: [b] MinUtil");
    assert_eq!(said(&s).len(), 1, "repeated:\n{}", s.log());
    save_like_an_editor(
        &s.conf(),
        "[a]\nMemoryLimit=12GiB\n[b]\nMemoryLimit=10GiB\n",
    );
    reloaded(&s, "reloaded: [b] MemoryLimit");
    let now = said(&s);
    assert_eq!(now.len(), 2, "{}", s.log());
    assert!(now[1].contains("22.0 GiB"), "{}", now[1]);
}
