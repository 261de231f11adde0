//! The real `gem-schd` binary: each test gets a fresh machine
//! ([`Gemini`]) with its own `resource.conf` and IPC directory, and talks
//! to the daemon with the protocol client.

use gemini_protocol::{
    ErrorKind, PROTOCOL_VERSION, Reply, Request, Role, StatusReport, encode_request,
};
use gemini_scheduler::client::Client;
use gemini_tests::{Gemini, SimEnv, bin};
use std::fs;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const T: Duration = Duration::from_secs(3);

/// `gem-schd`, for its command-line tests.
fn schd_bin() -> PathBuf {
    bin("gem-schd")
}

fn hello(c: &mut Client, group: &str) -> Reply {
    let req = Request::Hello {
        role: Role::Client,
        group: group.into(),
        pid: std::process::id(),
        held: vec![],
    };
    c.request(&req, T).unwrap()
}

fn error_kind(r: &Reply) -> Option<ErrorKind> {
    match r {
        Reply::Error(e) => Some(e.kind),
        _ => None,
    }
}

/// Replaces a file the way editors do: write a temporary, rename it over.
fn save_like_an_editor(path: &Path, text: &str) {
    let tmp = path.with_extension("conf.swp");
    fs::write(&tmp, text).unwrap();
    fs::rename(&tmp, path).unwrap();
}

fn group_min(s: &StatusReport, name: &str) -> Option<f64> {
    s.groups.iter().find(|g| g.name == name).map(|g| g.min_util)
}

#[test]
fn status_lists_configured_groups_and_ipc_dir_is_private() {
    let s = Gemini::daemon(
        "[train]\nMinUtil=0.7\nMemoryLimit=8GiB\n[notebook]\nMinUtil=0.3\nMaxUtil=0.5\n",
    );
    let st = s.status();
    let names: Vec<&str> = st.groups.iter().map(|g| g.name.as_str()).collect();
    assert_eq!(names, ["notebook", "train"]);
    assert_eq!(st.groups[1].memory_limit, 8 << 30);
    assert_eq!(st.groups[0].max_util, 0.5);
    let mode = fs::metadata(s.ipc()).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o700, "IPC dir mode {mode:o}");
}

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

#[test]
fn status_cli_prints_table_and_json() {
    let s = Gemini::daemon("[train]\nMinUtil=0.5\n");
    let out = Command::new(schd_bin())
        .arg("status")
        .arg("--ipc-dir")
        .arg(s.ipc())
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains("train") && text.contains("50.0%"), "{text}");
    let out = Command::new(schd_bin())
        .args(["status", "--json"])
        .env("GEMINI_IPC_DIR", s.ipc())
        .output()
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["groups"][0]["name"], "train");
}

/// `status --json --watch` prints plain JSON documents (no screen-clear
/// escapes), keeps watching across a scheduler restart, and ends quietly
/// with exit 0 when its reader goes away (`| head`: it used to panic on
/// the broken pipe).
#[test]
fn status_watch_survives_a_restart_and_a_closed_pipe() {
    use std::io::Read as _;
    let mut s = Gemini::daemon("[a]\n");
    let mut watch = Command::new(schd_bin())
        .args(["status", "--json", "--watch", "0.1", "--ipc-dir"])
        .arg(s.ipc())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut stdout = watch.stdout.take().unwrap();
    let mut seen = Vec::new();
    let mut read_until = |what: &str, buf: &mut Vec<u8>| {
        let deadline = Instant::now() + Duration::from_secs(10);
        let mut chunk = [0u8; 4096];
        while !String::from_utf8_lossy(buf).contains(what) {
            assert!(
                Instant::now() < deadline,
                "no {what:?} in {}",
                String::from_utf8_lossy(buf)
            );
            let n = stdout.read(&mut chunk).unwrap();
            assert!(
                n > 0,
                "status --watch ended: {}",
                String::from_utf8_lossy(buf)
            );
            buf.extend_from_slice(&chunk[..n]);
        }
    };
    read_until("\"groups\"", &mut seen);
    // The scheduler stops and a new one starts on the same directory.
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(s.scheduler_pid().unwrap() as i32, libc::SIGTERM) };
    s.wait_scheduler();
    read_until("waiting for the scheduler", &mut seen);
    fs::write(s.conf(), "[b]\n").unwrap();
    let mut again = Command::new(schd_bin())
        .arg("--config")
        .arg(s.conf())
        .arg("--ipc-dir")
        .arg(s.ipc())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    read_until("\"b\"", &mut seen);
    let text = String::from_utf8_lossy(&seen);
    assert!(!text.contains('\x1b'), "escapes in JSON output: {text:?}");
    // The reader goes away.
    drop(stdout);
    let status = watch.wait().unwrap();
    let mut err = String::new();
    watch
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert_eq!(status.code(), Some(0), "{err}");
    let _ = again.kill();
    let _ = again.wait();
}

#[test]
fn status_without_a_daemon_fails_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let out = Command::new(schd_bin())
        .arg("status")
        .arg("--ipc-dir")
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("is gem-schd running?"), "{err}");
}

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
fn tokens_and_memory_through_the_daemon() {
    let s = Gemini::daemon("[a]\nMemoryLimit=1GiB\n[b]\n");
    let mut a = s.client();
    let mut b = s.client();
    assert!(matches!(hello(&mut a, "a"), Reply::Welcome { .. }));
    assert!(matches!(hello(&mut b, "b"), Reply::Welcome { .. }));
    let acquire = Request::AcquireToken {
        device: 0,
        used_us: 0,
        burst_us: 20_000,
    };
    assert_eq!(
        a.request(&acquire, T).unwrap(),
        Reply::Token {
            device: 0,
            quota_us: 20_000,
            lent: false
        }
    );
    // b waits while a holds the token...
    let seq = b.send(&acquire).unwrap();
    assert!(
        b.recv(Duration::from_millis(5)).is_err(),
        "b got a token while a held it"
    );
    // ...and gets it when a gives it back.
    assert_eq!(
        a.request(
            &Request::ReleaseToken {
                device: 0,
                used_us: 5_000
            },
            T
        )
        .unwrap(),
        Reply::Done
    );
    let (s2, r) = b.recv(T).unwrap();
    assert_eq!(
        (s2, r),
        (
            seq,
            Reply::Token {
                device: 0,
                quota_us: 20_000,
                lent: false
            }
        )
    );
    let r = a
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1 << 30,
            },
            T,
        )
        .unwrap();
    assert_eq!(
        r,
        Reply::Memory {
            device: 0,
            used: 1 << 30,
            limit: 1 << 30
        }
    );
    let r = a
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1,
            },
            T,
        )
        .unwrap();
    assert_eq!(error_kind(&r), Some(ErrorKind::OutOfMemory));
    let st = s.status();
    assert_eq!(
        st.devices[0]
            .groups
            .iter()
            .find(|g| g.group == "a")
            .unwrap()
            .memory_used,
        1 << 30
    );
    assert_eq!(st.clients.len(), 2);
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
    let r = c
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1 << 30,
            },
            T,
        )
        .unwrap();
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

#[test]
fn garbage_and_foreign_versions_get_error_replies_and_the_daemon_lives() {
    let mut s = Gemini::daemon("[a]\n");
    let mut c = s.client();
    // A frame of our version whose body is garbage.
    let mut bad_body = b"GM".to_vec();
    bad_body.extend_from_slice(&PROTOCOL_VERSION.to_le_bytes());
    bad_body.extend_from_slice(&[0xff; 5]);
    for junk in [
        &b""[..],
        b"x",
        b"GET / HTTP/1.1\r\n\r\n",
        &[0xff; 300],
        &bad_body,
    ] {
        c.send_raw(junk).unwrap();
        let (_, r) = c.recv(T).unwrap();
        assert_eq!(error_kind(&r), Some(ErrorKind::Malformed), "{junk:?}");
    }
    let mut frame = encode_request(5, &Request::Status);
    frame[2..4].copy_from_slice(&(PROTOCOL_VERSION + 7).to_le_bytes());
    c.send_raw(&frame).unwrap();
    let (_, r) = c.recv(T).unwrap();
    assert_eq!(error_kind(&r), Some(ErrorKind::ProtocolMismatch));
    // A frame larger than the limit is dropped by libzmq (the connection
    // is closed); the daemon carries on.
    let mut big = s.client();
    big.send_raw(&vec![0u8; 2 << 20]).unwrap();
    // Requests that make no sense in the client's state.
    let r = c
        .request(
            &Request::AcquireToken {
                device: 0,
                used_us: 0,
                burst_us: 0,
            },
            T,
        )
        .unwrap();
    assert_eq!(error_kind(&r), Some(ErrorKind::NotRegistered));
    hello(&mut c, "a");
    assert_eq!(
        error_kind(&hello(&mut c, "a")),
        Some(ErrorKind::AlreadyRegistered)
    );
    let r = c
        .request(
            &Request::ReserveMemory {
                device: u32::MAX,
                bytes: 1,
            },
            T,
        )
        .unwrap();
    assert_eq!(error_kind(&r), Some(ErrorKind::BadRequest));
    // A REQ socket (delimiter frame) is answered too.
    let ctx = zmq::Context::new();
    let req = ctx.socket(zmq::REQ).unwrap();
    req.connect(&gemini_protocol::scheduler_endpoint(&s.ipc()).unwrap())
        .unwrap();
    req.send(encode_request(1, &Request::Status), 0).unwrap();
    assert_eq!(req.poll(zmq::POLLIN, 3000).unwrap(), 1);
    let (_, r) = gemini_protocol::decode_reply(&req.recv_bytes(0).unwrap()).unwrap();
    assert!(matches!(r, Reply::Status(_)));
    assert!(s.alive());
    assert!(matches!(
        s.client().request(&Request::Status, T).unwrap(),
        Reply::Status(_)
    ));
}

#[test]
fn dead_client_releases_token_and_memory() {
    let s = Gemini::daemon("[a]\nMemoryLimit=1GiB\n");
    // A child process (this test binary, in helper mode) joins, reserves
    // 1 GiB and takes the token, then is killed.
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "daemon::helper_client_process",
            "--nocapture",
            "--include-ignored",
        ])
        .env("GEM_TEST_HELPER_IPC", s.ipc())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    s.wait_status(5.0, "helper registered", |st| {
        st.devices.first().is_some_and(|d| {
            d.holder.is_some() && d.groups.iter().any(|g| g.memory_used == 1 << 30)
        })
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    s.wait_status(5.0, "release", |st| {
        st.clients.is_empty()
            && st.devices[0].holder.is_none()
            && st.devices[0].groups[0].memory_used == 0
    });
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "released after {:?}",
        killed.elapsed()
    );
    let mut c = s.client();
    hello(&mut c, "a");
    let r = c
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1 << 30,
            },
            T,
        )
        .unwrap();
    assert!(matches!(r, Reply::Memory { .. }), "{r:?}");
}

/// Not a test: the client process of `dead_client_releases_token_and_memory`.
#[test]
#[ignore = "helper process, run by another test"]
fn helper_client_process() {
    let Some(ipc) = std::env::var_os("GEM_TEST_HELPER_IPC") else {
        return;
    };
    let mut c = Client::connect(Path::new(&ipc)).unwrap();
    assert!(matches!(hello(&mut c, "a"), Reply::Welcome { .. }));
    let r = c
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1 << 30,
            },
            T,
        )
        .unwrap();
    assert!(matches!(r, Reply::Memory { .. }));
    let r = c
        .request(
            &Request::AcquireToken {
                device: 0,
                used_us: 0,
                burst_us: 100_000,
            },
            T,
        )
        .unwrap();
    assert!(matches!(r, Reply::Token { .. }));
    std::thread::sleep(Duration::from_secs(60));
}

#[test]
fn second_daemon_on_the_same_dir_is_refused() {
    let s = Gemini::daemon("[a]\n");
    let out = Command::new(schd_bin())
        .arg("--config")
        .arg(s.conf())
        .arg("--ipc-dir")
        .arg(s.ipc())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("already running"));
    assert!(matches!(
        s.client().request(&Request::Status, T).unwrap(),
        Reply::Status(_)
    ));
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
    let out = sim
        .command(schd_bin())
        .arg("check")
        .arg(&conf)
        .output()
        .unwrap();
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

#[test]
fn shutdown_stops_the_daemon_and_removes_the_socket() {
    let mut s = Gemini::daemon("[a]\n");
    let out = Command::new(schd_bin())
        .arg("shutdown")
        .arg("--ipc-dir")
        .arg(s.ipc())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let status = s.wait_scheduler();
    assert!(status.success());
    assert!(!s.ipc().join("scheduler.sock").exists());
}

#[test]
fn sigterm_stops_the_daemon_cleanly() {
    let mut s = Gemini::daemon("[a]\n");
    // SAFETY: sending a signal to our own child process.
    unsafe { libc::kill(s.scheduler_pid().unwrap() as i32, libc::SIGTERM) };
    let status = s.wait_scheduler();
    assert!(status.success(), "{status:?}");
    assert!(!s.ipc().join("scheduler.sock").exists());
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

#[test]
fn settings_file_and_flags_are_applied() {
    let sim = SimEnv::default();
    fs::write(sim.path().join("resource.conf"), "[a]\n").unwrap();
    fs::write(
        sim.path().join("gemini.toml"),
        "window = \"20s\"\nmax_quota = \"50ms\"\n",
    )
    .unwrap();
    let settings = sim.path().join("gemini.toml").display().to_string();
    let s = Gemini::start_prepared(sim, &["--settings", &settings, "--window", "30s"]);
    assert_eq!(s.status().window_us, 30_000_000);
    let mut c = s.client();
    hello(&mut c, "a");
    let r = c
        .request(
            &Request::AcquireToken {
                device: 0,
                used_us: 0,
                burst_us: 10_000_000,
            },
            T,
        )
        .unwrap();
    assert_eq!(
        r,
        Reply::Token {
            device: 0,
            quota_us: 50_000,
            lent: false
        }
    );
}

#[test]
fn removed_ipc_dir_is_recreated_and_clients_keep_working() {
    let s = Gemini::daemon("[a]\n");
    let mut old = s.client();
    assert!(matches!(hello(&mut old, "a"), Reply::Welcome { .. }));
    fs::remove_dir_all(s.ipc()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(5);
    while !s.ipc().join("scheduler.sock").exists() {
        assert!(
            Instant::now() < deadline,
            "socket not recreated; log:\n{}",
            s.log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        fs::metadata(s.ipc()).unwrap().permissions().mode() & 0o777,
        0o700
    );
    // A new client connects through the new socket...
    let st = s.status();
    assert_eq!(st.clients.len(), 1);
    // ...and the old connection still works.
    let r = old.request(&Request::MemoryInfo { device: 0 }, T).unwrap();
    assert!(matches!(r, Reply::MemoryView { .. }), "{r:?}");
    assert!(s.log().contains("disappeared; creating it again"));
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
            "daemon::helper_hello_as_user",
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
    let r = running
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 1 << 30,
            },
            T,
        )
        .unwrap();
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

/// `Quieting` through the daemon: the waiting client's token comes at the
/// announced end (less `HANDOVER_LEAD`), without the holder's report.
#[test]
fn a_quieting_holder_passes_the_token_on_at_the_announced_end() {
    let s = Gemini::daemon("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n");
    let mut hi = s.client();
    let mut lo = s.client();
    assert!(matches!(hello(&mut hi, "hi"), Reply::Welcome { .. }));
    assert!(matches!(hello(&mut lo, "lo"), Reply::Welcome { .. }));
    let acquire = Request::AcquireToken {
        device: 0,
        used_us: 0,
        burst_us: 100_000,
    };
    assert!(matches!(
        hi.request(&acquire, T).unwrap(),
        Reply::Token { .. }
    ));
    let seq = lo.send(&acquire).unwrap();
    let t0 = Instant::now();
    assert_eq!(
        hi.request(
            &Request::Quieting {
                device: 0,
                done_in_us: 50_000
            },
            T
        )
        .unwrap(),
        Reply::Done
    );
    let (s2, r) = lo.recv(T).unwrap();
    let waited = t0.elapsed();
    assert_eq!(s2, seq);
    assert!(matches!(r, Reply::Token { .. }), "{r:?}");
    assert!(
        waited >= Duration::from_millis(45) && waited < Duration::from_millis(90),
        "lo waited {waited:?} for a holder quieting in 50 ms (its token was 100 ms)"
    );
}
