//! Who may use the daemon: the IPC directory's owner and mode, a group's
//! `AllowedUsers`, `AllowedGroups` and `Cgroups`, from kernel credentials.

use super::*;

/// An existing IPC directory is never chmodded: one that others may write
/// to (`/tmp`, mode 1777) is refused with a message naming a private one,
/// and keeps its mode; one of this user's, closed to others, is used as
/// it is. (The daemon used to set 0700 on whatever it was given.)
#[test]
fn an_existing_ipc_dir_keeps_its_mode_and_a_shared_one_is_refused() {
    let sim = SimEnv::default();
    fs::write(sim.path().join("resource.conf"), "[a]\n").unwrap();
    let ipc = sim.path().join("ipc");
    fs::create_dir(&ipc).unwrap();
    fs::set_permissions(&ipc, fs::Permissions::from_mode(0o1777)).unwrap();
    let mut c = Gemini::spawn_in(&sim, &[]);
    let deadline = Instant::now() + T;
    let status = loop {
        if let Some(st) = c.try_wait().unwrap() {
            break st;
        }
        assert!(
            Instant::now() < deadline,
            "gem-schd started in a shared directory"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(!status.success());
    let log = fs::read_to_string(sim.path().join("schd.log")).unwrap();
    assert!(
        log.contains("may be written by other users (mode 1777)") && log.contains("/ipc/gemini"),
        "{log}"
    );
    let mode = fs::metadata(&ipc).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o1777, "the shared directory's mode was changed");

    fs::set_permissions(&ipc, fs::Permissions::from_mode(0o755)).unwrap();
    let s = Gemini::start_prepared(sim, &[]);
    assert_eq!(s.status().groups.len(), 1);
    let mode = fs::metadata(s.ipc()).unwrap().permissions().mode() & 0o7777;
    assert_eq!(mode, 0o755, "the existing directory's mode was changed");
}

fn is_root() -> bool {
    // SAFETY: geteuid cannot fail.
    unsafe { libc::geteuid() == 0 }
}

/// Runs `helper_hello_as_user` as the unprivileged user `nobody`.
fn hello_as_nobody(s: &Gemini, group: &str) -> String {
    use std::os::unix::process::CommandExt;
    // nobody must be able to reach the socket through the test's directory.
    fs::set_permissions(s.dir(), fs::Permissions::from_mode(0o755)).unwrap();
    let out = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "daemon::access::helper_hello_as_user",
            "--nocapture",
            "--include-ignored",
        ])
        .env("GEM_TEST_HELLO_IPC", s.ipc())
        .env("GEM_TEST_HELLO_GROUP", group)
        .uid(65534)
        .gid(65534)
        .output()
        .unwrap();
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .find(|l| l.starts_with("HELLO "))
        .unwrap_or("HELLO none")
        .to_string()
}

/// Not a test: says hello as another user for the access-control test.
#[test]
#[ignore = "helper process, run by another test"]
fn helper_hello_as_user() {
    let (Some(ipc), Some(group)) = (
        std::env::var_os("GEM_TEST_HELLO_IPC"),
        std::env::var("GEM_TEST_HELLO_GROUP").ok(),
    ) else {
        return;
    };
    let reply = Client::connect(Path::new(&ipc)).and_then(|mut c| {
        let req = Request::Hello {
            role: Role::Client,
            group,
            pid: std::process::id(),
            held: vec![],
            job: None,
            build: gemini_protocol::BUILD.into(),
        };
        c.request(&req, T)
    });
    match reply {
        Ok(Reply::Welcome { .. }) => println!("HELLO welcome"),
        Ok(Reply::Error(e)) => println!("HELLO {:?} {}", e.kind, e.message),
        other => println!("HELLO other {other:?}"),
    }
}

#[test]
fn allowed_users_and_groups_are_enforced_from_kernel_credentials() {
    if !is_root() {
        eprintln!("needs root to run a client as another user; skipped");
        return;
    }
    let s = Gemini::start_with(
        SimEnv::default(),
        "[open]\n[alice_only]\nAllowedUsers=alice\n[by_group]\nAllowedGroups=nogroup\n",
        &["--ipc-group", "nogroup"],
    );
    // The directory and socket let the group in and nobody else write.
    let dir = fs::metadata(s.ipc()).unwrap();
    assert_eq!(dir.permissions().mode() & 0o777, 0o750);
    assert_eq!(std::os::unix::fs::MetadataExt::gid(&dir), 65534);
    let sock = fs::metadata(s.ipc().join("scheduler.sock")).unwrap();
    assert_eq!(sock.permissions().mode() & 0o777, 0o770);
    assert_eq!(hello_as_nobody(&s, "open"), "HELLO welcome");
    assert_eq!(
        hello_as_nobody(&s, "by_group"),
        "HELLO welcome",
        "nobody's group is nogroup"
    );
    let denied = hello_as_nobody(&s, "alice_only");
    assert!(
        denied.starts_with(
            "HELLO PermissionDenied user nobody (uid 65534) may not run in group \"alice_only\""
        ),
        "{denied}"
    );
    assert!(denied.contains("allows users alice"), "{denied}");
}

#[test]
fn ipc_dir_owned_by_another_user_is_refused() {
    if !is_root() {
        eprintln!("needs root to give a directory to another user; skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let ipc = dir.path().join("ipc");
    fs::create_dir(&ipc).unwrap();
    std::os::unix::fs::chown(&ipc, Some(65534), Some(65534)).unwrap();
    fs::write(dir.path().join("resource.conf"), "[a]\n").unwrap();
    let out = Command::new(schd_bin())
        .arg("--config")
        .arg(dir.path().join("resource.conf"))
        .arg("--ipc-dir")
        .arg(&ipc)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("belongs to uid 65534"), "{err}");
}

/// Another user who owns a directory above the IPC directory (as one who
/// made /tmp/gemini before gem-schd did) could move the IPC directory away
/// and put a socket of their own in its place: such a directory is refused
/// too, and so is one others may write without the sticky bit.
#[test]
fn a_parent_of_the_ipc_dir_another_user_owns_is_refused() {
    if !is_root() {
        eprintln!("needs root to give a directory to another user; skipped");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    fs::write(dir.path().join("resource.conf"), "[a]\n").unwrap();
    let squatted = dir.path().join("gemini");
    fs::create_dir(&squatted).unwrap();
    std::os::unix::fs::chown(&squatted, Some(65534), Some(65534)).unwrap();
    let open = dir.path().join("open");
    fs::create_dir(&open).unwrap();
    fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
    for (parent, why) in [
        (&squatted, "belongs to uid 65534"),
        (
            &open,
            "may be written by other users (mode 0777, not sticky)",
        ),
    ] {
        let out = Command::new(schd_bin())
            .env("GEMINI_SETTINGS", "/dev/null")
            .arg("--config")
            .arg(dir.path().join("resource.conf"))
            .arg("--ipc-dir")
            .arg(parent.join("ipc"))
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!("{} (above the IPC directory", parent.display()))
                && err.contains(why),
            "{err}"
        );
    }
}

/// A group's `Cgroups` decides membership from the kernel's view of the
/// connecting process: a process in the group's cgroup is placed in it
/// without naming a group and may not name another; a group bound to
/// cgroups takes no process outside them; a process in no group's cgroup
/// that names no group is told to set GEMINI_GROUP_NAME.
#[test]
fn a_groups_cgroups_place_its_processes_and_keep_others_out() {
    let mine = gemini_tests::own_cgroup();
    let s = Gemini::daemon(&format!(
        "[job]\nCgroups=/no/such/job;{mine}\n[open]\n[elsewhere]\nCgroups=/no/such/cgroup\n"
    ));
    let mut c = s.client();
    assert!(
        matches!(hello(&mut c, ""), Reply::Welcome { .. }),
        "placed by its cgroup without a name"
    );
    let st = s.status();
    assert!(
        st.clients.iter().any(|c| c.group == "job"),
        "{:?}",
        st.clients
    );
    let mut other = s.client();
    match hello(&mut other, "open") {
        Reply::Error(e) => {
            assert_eq!(e.kind, ErrorKind::PermissionDenied);
            assert!(
                e.message.contains(&format!("runs in cgroup {mine}"))
                    && e.message.contains("belongs to group \"job\"")
                    && e.message.contains("resource.conf line 1"),
                "{}",
                e.message
            );
        }
        r => panic!("a job's process joined another group: {r:?}"),
    }
    save_like_an_editor(&s.conf(), "[open]\n[elsewhere]\nCgroups=/no/such/cgroup\n");
    // The job's group is retired (its connected process keeps it).
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.log().contains("[job] removed") {
        assert!(Instant::now() < deadline, "not reloaded:\n{}", s.log());
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut third = s.client();
    let r = hello(&mut third, "elsewhere");
    assert_eq!(error_kind(&r), Some(ErrorKind::PermissionDenied), "{r:?}");
    let r = hello(&mut s.client(), "");
    match r {
        Reply::Error(e) => {
            assert_eq!(e.kind, ErrorKind::UnknownGroup);
            assert!(
                e.message.contains("GEMINI_GROUP_NAME is not set"),
                "{}",
                e.message
            );
        }
        r => panic!("{r:?}"),
    }
    assert!(matches!(
        hello(&mut s.client(), "open"),
        Reply::Welcome { .. }
    ));
}
