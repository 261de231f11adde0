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

mod access;
mod accounting;
mod config;

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
        job: None,
        build: gemini_protocol::BUILD.into(),
    };
    c.request(&req, T).unwrap()
}

/// Asks for `bytes` of GPU 0's memory on `c`'s connection.
fn reserve(c: &mut Client, bytes: u64) -> Reply {
    c.request(&Request::ReserveMemory { device: 0, bytes }, T)
        .unwrap()
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

/// Every tool command without a scheduler says so at once (no socket:
/// nothing to wait for), with exit status 3, whether the IPC directory
/// exists or not; a socket a stopped scheduler left behind says that.
#[test]
fn status_without_a_daemon_fails_with_a_clear_message() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-dir");
    for (args, ipc) in [
        (&["status"][..], dir.path()),
        (&["status", "--json"][..], missing.as_path()),
        (&["reload"][..], dir.path()),
        (&["shutdown"][..], missing.as_path()),
    ] {
        let out = Command::new(schd_bin())
            .args(args)
            .arg("--ipc-dir")
            .arg(ipc)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(3), "{args:?}: {err}");
        assert!(
            err.contains("no scheduler listens there (no socket"),
            "{args:?}: {err}"
        );
    }
    drop(std::os::unix::net::UnixListener::bind(dir.path().join("scheduler.sock")).unwrap());
    let out = Command::new(schd_bin())
        .args(["status", "--ipc-dir"])
        .arg(dir.path())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{err}");
    assert!(err.contains("left from one that stopped"), "{err}");
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
        ran: vec![],
        in_flight: false,
        burst_us: 20_000,
        rtt_us: 100,
        launch_us: 0,
    };
    assert_eq!(
        a.request(&acquire, T).unwrap(),
        Reply::Token {
            device: 0,
            quota_us: 20_000,
            lent: false,
            last_step: false,
            held_us: 0,
        }
    );
    // b waits while a holds the token...
    let asked = std::time::Instant::now();
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
                ran: gemini_protocol::Span::from_ns(
                    gemini_protocol::clock::monotonic_ns() - 5_000_000,
                    gemini_protocol::clock::monotonic_ns(),
                )
                .into_iter()
                .collect(),
                in_flight: false,
            },
            T
        )
        .unwrap(),
        Reply::Done
    );
    let (s2, r) = b.recv(T).unwrap();
    let waited = asked.elapsed().as_micros() as u64;
    // The grant says how long the scheduler held b's request: some of the
    // 5 ms and more that b waited, never more than all of it (the rest
    // was the round trip).
    let Reply::Token {
        device: 0,
        quota_us: 20_000,
        lent: false,
        last_step: false,
        held_us,
    } = r
    else {
        panic!("{r:?}");
    };
    assert_eq!(s2, seq);
    assert!(
        held_us > 0 && held_us <= waited,
        "held {held_us} µs of {waited}"
    );
    let r = reserve(&mut a, 1 << 30);
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
                ran: vec![],
                in_flight: false,
                burst_us: 0,
                rtt_us: 100,
                launch_us: 0,
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

/// A peer of the previous release's protocol (14) is served in it: its
/// hello and requests are read, its replies written in 14, and the status
/// lists it with its version. A peer of a version not spoken is refused,
/// and listed as refused.
#[test]
fn a_peer_of_the_previous_protocol_is_served_and_an_unknown_one_listed() {
    let s = Gemini::daemon("[a]\nMemoryLimit=1GiB\n");
    let mut old = s.client();
    let hello14 = gemini_protocol::encode_request_as(
        14,
        1,
        &Request::Hello {
            role: Role::Client,
            group: "a".into(),
            pid: std::process::id(),
            held: vec![],
            job: None,
            build: "ignored in 14".into(),
        },
    );
    assert_eq!(gemini_protocol::codec::frame_version(&hello14), Some(14));
    old.send_raw(&hello14).unwrap();
    let (seq, r) = old.recv(T).unwrap();
    assert_eq!(seq, 1);
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
    // From here on, it speaks 14 as 0.1.0 did.
    old.speak(14);
    let r = old
        .request(
            &Request::ReserveMemory {
                device: 0,
                bytes: 512 << 20,
            },
            T,
        )
        .unwrap();
    assert!(
        matches!(r, Reply::Memory { used, .. } if used == 512 << 20),
        "{r:?}"
    );
    // Its status request is answered in the shape 14 reads.
    assert!(matches!(
        old.request(&Request::Status, T).unwrap(),
        Reply::Status(_)
    ));

    // A frame of 14 that cannot be read is answered in 14, which a 0.1.0
    // hook reads (an answer in 15 it could not, and would give up).
    let ctx = zmq::Context::new();
    let raw = ctx.socket(zmq::DEALER).unwrap();
    raw.connect(&gemini_protocol::scheduler_endpoint(&s.ipc()).unwrap())
        .unwrap();
    raw.send(&b"GM\x0e\x00\x03\xff\xff\xff"[..], 0).unwrap();
    assert_eq!(raw.poll(zmq::POLLIN, 3000).unwrap(), 1);
    let reply = raw.recv_bytes(0).unwrap();
    assert_eq!(gemini_protocol::codec::frame_version(&reply), Some(14));
    let (seq, r) = gemini_protocol::decode_reply(&reply).unwrap();
    assert_eq!((seq, error_kind(&r)), (3, Some(ErrorKind::Malformed)));

    let mut foreign = s.client();
    let mut frame = encode_request(5, &Request::Status);
    frame[2..4].copy_from_slice(&(gemini_protocol::OLDEST_PROTOCOL - 1).to_le_bytes());
    foreign.send_raw(&frame).unwrap();
    let (_, r) = foreign.recv(T).unwrap();
    assert_eq!(error_kind(&r), Some(ErrorKind::ProtocolMismatch));

    let st = s.status();
    let me = st
        .clients
        .iter()
        .find(|c| c.role == Role::Client)
        .unwrap_or_else(|| panic!("{st:#?}"));
    assert_eq!((me.protocol, me.build.as_str()), (14, "0.1.0"));
    assert_eq!(st.groups[0].name, "a");
    assert_eq!(st.refused.len(), 1, "{:?}", st.refused);
    assert_eq!(st.refused[0].protocol, gemini_protocol::OLDEST_PROTOCOL - 1);
    assert_eq!(st.refused[0].pid, std::process::id());
    let out = Command::new(schd_bin())
        .args(["status", "--ipc-dir"])
        .arg(s.ipc())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("1 client(s) speak an older protocol and are served in it: pid")
            && text.contains(&format!(
                "speaks v{}, last tried",
                gemini_protocol::OLDEST_PROTOCOL - 1
            )),
        "{text}"
    );
    // The program's row (by its pid) names the release it runs.
    let row = text
        .lines()
        .find(|l| {
            l.trim_start()
                .starts_with(&format!("{} ", std::process::id()))
        })
        .unwrap_or_else(|| panic!("{text}"));
    assert!(row.contains(" a ") && row.contains(" 0.1.0 "), "{row}");
}

#[test]
fn dead_client_releases_token_and_memory() {
    let s = Gemini::daemon("[a]\nMemoryLimit=1GiB\n");
    // A child process (this test binary, in helper mode) joins, reserves
    // 1 GiB and takes the token, then is killed.
    let mut child = spawn_helper_client(&s);
    s.wait_status(5.0, "helper registered", |st| {
        st.devices.first().is_some_and(|d| {
            d.token_client.is_some() && d.groups.iter().any(|g| g.memory_used == 1 << 30)
        })
    });
    child.kill().unwrap();
    child.wait().unwrap();
    let killed = Instant::now();
    s.wait_status(5.0, "release", |st| {
        st.clients.is_empty()
            && st.devices[0].token_client.is_none()
            && st.devices[0].groups[0].memory_used == 0
    });
    assert!(
        killed.elapsed() < Duration::from_secs(2),
        "released after {:?}",
        killed.elapsed()
    );
    let mut c = s.client();
    hello(&mut c, "a");
    let r = reserve(&mut c, 1 << 30);
    assert!(matches!(r, Reply::Memory { .. }), "{r:?}");
}

/// What a context took, as a process reported it once, is known again
/// at once after a restart, a crash (kill -9) as a clean stop: the
/// status shows its group's CONTEXTS as soon as the process holds memory
/// again. (Before, only a new context's report brought it back, 12 s and
/// more later.)
#[test]
fn what_a_context_took_is_kept_across_a_restart_or_a_crash() {
    let mut s = Gemini::daemon("[a]\nMemoryLimit=4GiB\n");
    let contexts = |st: &StatusReport| {
        st.devices
            .first()
            .and_then(|d| d.groups.iter().find(|g| g.group == "a"))
            .map_or(0, |g| g.contexts)
    };
    let connect = |s: &Gemini| {
        let mut c = s.client();
        assert!(matches!(hello(&mut c, "a"), Reply::Welcome { .. }));
        let r = reserve(&mut c, 1 << 30);
        assert!(matches!(r, Reply::Memory { .. }), "{r:?}");
        c
    };
    let mut c = connect(&s);
    let r = c
        .request(
            &Request::ContextCost {
                device: 0,
                bytes: 500 << 20,
            },
            T,
        )
        .unwrap();
    assert_eq!(r, Reply::Done);
    assert_eq!(contexts(&s.status()), 500 << 20);
    for how in ["shutdown", "kill -9"] {
        drop(c);
        if how == "shutdown" {
            s.shutdown_scheduler();
        } else {
            // The state files are brought up to date every second: once
            // this one says it, the crash.
            let path = s.ipc().join("contexts.json");
            let deadline = Instant::now() + Duration::from_secs(10);
            while !std::fs::read_to_string(&path).is_ok_and(|t| t.contains("524288000")) {
                assert!(Instant::now() < deadline, "contexts.json never written");
                std::thread::sleep(Duration::from_millis(50));
            }
            s.kill_scheduler();
        }
        s.start_scheduler();
        c = connect(&s);
        let st = s.status();
        assert_eq!(contexts(&st), 500 << 20, "after {how}: {st:#?}");
    }
}

/// A process that holds memory and makes no CUDA call across a restart of
/// the scheduler (a graceful one, as `systemctl restart` or an upgrade, and
/// a kill -9) keeps its memory counted against its group: the new
/// scheduler takes it back from its state file before the process says
/// anything, so the group cannot allocate past its `MemoryLimit`
/// meanwhile. It is released when the process ends. (Before, it counted
/// as nothing until the process's next call.) The group is bound to the
/// process's cgroup, as a Slurm job's is, and no peer can speak as the
/// stand-in that holds the memory (a routing id of its name once could).
#[test]
fn an_idle_processs_memory_is_kept_across_a_restart() {
    let mine = gemini_tests::own_cgroup();
    let mut s = Gemini::daemon(&format!("[a]\nMemoryLimit=1GiB\nCgroups={mine}\n"));
    let mut child = spawn_helper_client(&s);
    let held = |st: &StatusReport| {
        st.devices
            .first()
            .and_then(|d| d.groups.iter().find(|g| g.group == "a"))
            .map_or(0, |g| g.memory_used)
    };
    s.wait_status(5.0, "helper registered", |st| held(st) == 1 << 30);
    // The state files name processes and users: the daemon's user's alone
    // (they were 0644).
    for name in ["memory.json", "reservations.json"] {
        let path = s.ipc().join(name);
        let deadline = Instant::now() + Duration::from_secs(3);
        while !path.exists() && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(50));
        }
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600, "{name}: {mode:o}");
    }
    for how in ["shutdown", "kill -9"] {
        if how == "shutdown" {
            s.shutdown_scheduler();
        } else {
            // The state file is brought up to date every second.
            std::thread::sleep(Duration::from_millis(1500));
            s.kill_scheduler();
        }
        s.start_scheduler();
        let st = s.status();
        assert_eq!(held(&st), 1 << 30, "after {how}: {st:#?}\n{}", s.log());
        let mut c = s.client();
        hello(&mut c, "a");
        let r = c
            .request(
                &Request::ReserveMemory {
                    device: 0,
                    bytes: 1 << 20,
                },
                T,
            )
            .unwrap();
        assert_eq!(error_kind(&r), Some(ErrorKind::OutOfMemory), "after {how}");
        c.request(&Request::Goodbye, T).unwrap();
        // A peer naming itself as a stand-in was once taken for it, and its
        // goodbye dropped the restored memory (and, with the scheduler's
        // own rights, its shutdown stopped it: make test-hostile, as
        // another user). ZeroMQ takes any routing id a peer sets, a zero
        // byte first included.
        for name in ["restored-memory:", "\0restored-memory:", "\0restored:"] {
            let ctx = zmq::Context::new();
            let spoof = ctx.socket(zmq::DEALER).unwrap();
            spoof
                .set_identity(format!("{name}{}", child.id()).as_bytes())
                .unwrap();
            spoof
                .connect(&gemini_protocol::scheduler_endpoint(&s.ipc()).unwrap())
                .unwrap();
            spoof.send(encode_request(1, &Request::Goodbye), 0).unwrap();
            assert_eq!(spoof.poll(zmq::POLLIN, 3000).unwrap(), 1, "{name:?}");
            let _ = spoof.recv_bytes(0).unwrap();
            assert_eq!(
                held(&s.status()),
                1 << 30,
                "after {how} and a spoofed goodbye as {name:?}"
            );
        }
    }
    child.kill().unwrap();
    child.wait().unwrap();
    s.wait_status(5.0, "the memory released", |st| held(st) == 0);
}

/// Starts [`helper_client_process`] (this test binary, in helper mode)
/// against `s`: it joins group `a`, reserves 1 GiB and takes the token of
/// device 0, then idles for a minute.
fn spawn_helper_client(s: &Gemini) -> std::process::Child {
    Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "daemon::helper_client_process",
            "--nocapture",
            "--include-ignored",
        ])
        .env("GEM_TEST_HELPER_IPC", s.ipc())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Not a test: the client process of `dead_client_releases_token_and_memory`
/// and `an_idle_processs_memory_is_kept_across_a_restart`.
#[test]
#[ignore = "helper process, run by another test"]
fn helper_client_process() {
    let Some(ipc) = std::env::var_os("GEM_TEST_HELPER_IPC") else {
        return;
    };
    let mut c = Client::connect(Path::new(&ipc)).unwrap();
    assert!(matches!(hello(&mut c, "a"), Reply::Welcome { .. }));
    let r = reserve(&mut c, 1 << 30);
    assert!(matches!(r, Reply::Memory { .. }));
    let r = c
        .request(
            &Request::AcquireToken {
                device: 0,
                ran: vec![],
                in_flight: false,
                burst_us: 100_000,
                rtt_us: 100,
                launch_us: 0,
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
                ran: vec![],
                in_flight: false,
                burst_us: 10_000_000,
                rtt_us: 100,
                launch_us: 0,
            },
            T,
        )
        .unwrap();
    assert_eq!(
        r,
        Reply::Token {
            device: 0,
            quota_us: 50_000,
            lent: false,
            last_step: false,
            held_us: 0,
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

/// `Quieting` through the daemon: the waiting client's token comes at the
/// announced end (less the hand-over lead, one round trip), without the
/// holder's report.
#[test]
fn a_quieting_holder_passes_the_token_on_at_the_announced_end() {
    let s = Gemini::daemon("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n");
    let mut hi = s.client();
    let mut lo = s.client();
    assert!(matches!(hello(&mut hi, "hi"), Reply::Welcome { .. }));
    assert!(matches!(hello(&mut lo, "lo"), Reply::Welcome { .. }));
    let acquire = Request::AcquireToken {
        device: 0,
        ran: vec![],
        in_flight: false,
        burst_us: 100_000,
        rtt_us: 100,
        launch_us: 0,
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
