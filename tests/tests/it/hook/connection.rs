//! The hook and the scheduler: restarts, lost requests, refused or unknown groups, time-outs, bad settings.

use super::*;

#[test]
fn scheduler_restart_leaves_workloads_running_and_capped() {
    let _serial = serial();
    let mut g = Gemini::start(
        SimEnv::default(),
        "[capped]\nMaxUtil=0.4\nMemoryLimit=1GiB\n",
    );
    let cpu = CpuTimes::now();
    let t0 = now_ns();
    let w = spawn(rust(
        &g,
        "capped",
        &["--seconds", "8", "--kernel-us", "500", "--mem", "256MiB"],
    ));
    let c = spawn(c_prog(&g, "capped", &["-s", "8", "-k", "500"]));
    std::thread::sleep(Duration::from_secs(2));
    g.kill_scheduler();
    std::thread::sleep(Duration::from_millis(500));
    g.start_scheduler();
    // The Rust workload re-registers its memory with the new scheduler.
    g.wait_status(5.0, "memory re-registered", |s| {
        s.devices
            .first()
            .is_some_and(|d| d.groups.iter().any(|x| x.memory_used == 256 << 20))
    });
    let (ow, oc) = (finish(w), finish(c));
    let busy = g.sim.busy(0, t0 + 4 * SEC, t0 + 8 * SEC);
    let total = busy.share(pid_of(&ow)) + busy.share(pid_of(&oc));
    let counts = cpu.counts("group after the restart");
    assert_capped("group after the restart", total, 0.40, 0.04, counts);
}

/// A scheduler that dies before reading what a client wrote loses it: the
/// token request and the ping that checks on it. The client asks again
/// (pings each second while unanswered) and finds the new scheduler; it
/// used to wait for the lost ping's answer for ever.
#[test]
fn a_request_lost_with_a_killed_scheduler_is_asked_again() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::default(), "[a]\nMaxUtil=0.5\n");
    let mut w = spawn(rust(&g, "a", &["--seconds", "10", "--kernel-us", "500"]));
    g.wait_status(10.0, "the client registered", |s| {
        s.clients.iter().any(|c| c.pid == w.id())
    });
    let pid = g.scheduler_pid().expect("the scheduler runs") as i32;
    // SAFETY: signals a child process of this test.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    // The client's next request, and its ping a second later, wait unread.
    std::thread::sleep(Duration::from_millis(2500));
    g.kill_scheduler();
    g.start_scheduler();
    let deadline = Instant::now() + Duration::from_secs(8);
    let mut back = false;
    while Instant::now() < deadline && !back {
        back = g
            .try_status()
            .is_some_and(|s| s.clients.iter().any(|c| c.pid == w.id()));
        std::thread::sleep(Duration::from_millis(50));
    }
    if !back {
        let _ = w.kill();
        let out = w.wait_with_output().unwrap();
        panic!(
            "the client never came back to the new scheduler: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    finish(w);
}

/// A scheduler that speaks a protocol version this hook does not (one two
/// releases apart, say) is waited for as an absent one: the program says
/// so once on stderr, launches nothing meanwhile (it never runs
/// ungated), and goes on when a scheduler it can speak to answers. (It
/// used to fail every launch and allocation.)
#[test]
fn a_scheduler_of_an_unspoken_version_is_waited_for_gated() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::default(), "[a]\nMaxUtil=0.5\n");
    let (_ctx, foreign, socket) = stand_in(&mut g);
    let t0 = now_ns();
    let w = spawn(rust(&g, "a", &["--seconds", "1", "--kernel-us", "500"]));
    // Every request gets an answer of protocol 99 for two seconds.
    let mut answered = 0;
    let until = Instant::now() + Duration::from_secs(2);
    while Instant::now() < until {
        if foreign.poll(zmq::POLLIN, 50).unwrap() == 0 {
            continue;
        }
        let frames = foreign.recv_multipart(0).unwrap();
        let mut reply = b"GM".to_vec();
        reply.extend_from_slice(&99u16.to_le_bytes());
        reply.extend_from_slice(&[1, 2, 3]);
        foreign.send_multipart([&frames[0][..], &reply], 0).unwrap();
        answered += 1;
    }
    drop(foreign);
    let _ = std::fs::remove_file(&socket);
    let t1 = now_ns();
    assert!(answered > 0, "the hook never asked");
    g.start_scheduler();
    let out = finish(w);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(
        err.matches("speaks gemini protocol v99").count(),
        1,
        "said once: {err}"
    );
    assert!(
        err.contains("wait until a gem-schd that speaks it answers"),
        "{err}"
    );
    // Nothing ran while only the foreign scheduler answered.
    let before = g.sim.busy(0, t0, t1).share(pid_of(&out));
    assert_eq!(
        before, 0.0,
        "ran ungated before a scheduler it speaks to answered"
    );
    assert!(field(&reports(&out.stdout)[0], "kernels") > 0);
}

/// gem-schd stopped and a ZeroMQ ROUTER bound at its socket instead, for
/// a test to answer as it likes: its context, the socket, and the
/// socket's path (remove it before gem-schd starts again).
fn stand_in(g: &mut Gemini) -> (zmq::Context, zmq::Socket, std::path::PathBuf) {
    g.kill_scheduler();
    let endpoint = gemini_protocol::scheduler_endpoint(&g.ipc()).unwrap();
    let socket = g.ipc().join(gemini_protocol::SCHEDULER_SOCKET);
    let _ = std::fs::remove_file(&socket);
    let ctx = zmq::Context::new();
    let router = ctx.socket(zmq::ROUTER).unwrap();
    router.bind(&endpoint).unwrap();
    (ctx, router, socket)
}

/// The requests of the first program to reach `stand_in` (with their
/// sequence numbers), from its first one (30 s at most) until `window`
/// after it; each passed to `answer` as it comes, with the program's
/// routing id and the request's version, to answer or not.
fn asked_of(
    stand_in: &zmq::Socket,
    window: Duration,
    mut answer: impl FnMut(&[u8], u16, u32, &gemini_protocol::Request),
) -> Vec<(u32, gemini_protocol::Request)> {
    let mut asked = Vec::new();
    let mut peer: Option<Vec<u8>> = None;
    let mut until = Instant::now() + Duration::from_secs(30);
    while Instant::now() < until {
        if stand_in.poll(zmq::POLLIN, 50).unwrap() == 0 {
            continue;
        }
        let frames = stand_in.recv_multipart(0).unwrap();
        if peer.as_ref().is_some_and(|p| *p != frames[0]) {
            continue;
        }
        let (version, seq, req) = gemini_protocol::decode_request_versioned(&frames[1]).unwrap();
        if peer.is_none() {
            peer = Some(frames[0].clone());
            until = Instant::now() + window;
        }
        answer(&frames[0], version, seq, &req);
        asked.push((seq, req));
    }
    asked
}

/// At start-up the hook sends the GPU map and the memory view of the GPU
/// it makes its context on right behind its hello, without waiting for
/// the welcome: one wait for what took three. (Each wait is a hand-off
/// between four threads of two processes, and 64 programs starting at
/// once on 2 cores waited long for each.) A stand-in for gem-schd reads
/// what arrives before it answers anything; then gem-schd answers, and
/// the program runs.
#[test]
fn the_gpu_map_and_memory_view_ride_behind_the_hello() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::default(), "[a]\n");
    let (_ctx, stand_in, socket) = stand_in(&mut g);
    let w = spawn(rust(&g, "a", &["--seconds", "0.2", "--kernel-us", "500"]));
    // The program's requests from its hello, for 0.5 s. (The hook says
    // hello again after 1 s without an answer, and a test thread held off
    // on a busy machine may read that too.)
    let asked: Vec<_> = asked_of(&stand_in, Duration::from_millis(500), |_, _, _, _| {})
        .into_iter()
        .map(|(_, req)| req)
        .collect();
    drop(stand_in);
    let _ = std::fs::remove_file(&socket);
    g.start_scheduler();
    let out = finish(w);
    assert!(
        matches!(asked.first(), Some(gemini_protocol::Request::Hello { .. })),
        "{asked:?}"
    );
    assert!(
        matches!(asked.get(1), Some(gemini_protocol::Request::Gpus { uuids }) if uuids.len() == 1),
        "the GPU map behind the hello: {asked:?}"
    );
    assert_eq!(
        asked.get(2),
        Some(&gemini_protocol::Request::MemoryInfo { device: 0 }),
        "the context's GPU's memory view behind them: {asked:?}"
    );
    assert!(
        asked[3..]
            .iter()
            .all(|r| matches!(r, gemini_protocol::Request::Hello { .. })),
        "nothing else before an answer but the hello again: {asked:?}"
    );
    // What was asked of the stand-in is not taken for gem-schd's answer.
    assert!(field(&reports(&out.stdout)[0], "kernels") > 0);
}

/// gem-schd keeps a new connection's messages while it looks its user
/// up, 64 at most for all the user's new connections, and drops the
/// rest: 64 programs started together each sent three (the hello, the
/// GPU map and the memory view behind it), and one that had its hello
/// answered but the map dropped waited for the map forever. A stand-in
/// for gem-schd welcomes the program and drops what came behind the
/// hello: the program asks for the map again.
#[test]
fn what_was_sent_behind_the_hello_is_asked_again_if_dropped() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::default(), "[a]\n");
    let (_ctx, stand_in, socket) = stand_in(&mut g);
    let mut w = spawn(rust(&g, "a", &["--seconds", "0.2"]));
    // Welcomed, nothing else answered, for 1.5 s from the hello: long
    // enough for the ping a second after (the map waited for then,
    // without the fix), not for a hello sent again.
    let asked = asked_of(
        &stand_in,
        Duration::from_millis(1500),
        |peer, version, seq, req| {
            if let gemini_protocol::Request::Hello { .. } = req {
                let welcome = gemini_protocol::Reply::Welcome {
                    client: 1,
                    server: gemini_protocol::BUILD.into(),
                    config_path: "stand-in".into(),
                };
                let body = gemini_protocol::encode_reply_as(version, seq, &welcome);
                stand_in.send_multipart([peer.to_vec(), body], 0).unwrap();
            }
        },
    );
    let _ = w.kill();
    let _ = w.wait();
    drop(stand_in);
    let _ = std::fs::remove_file(&socket);
    let maps: Vec<u32> = asked
        .iter()
        .filter(|(_, r)| matches!(r, gemini_protocol::Request::Gpus { .. }))
        .map(|(seq, _)| *seq)
        .collect();
    // Asked again without a hello between (a hello said again forgets
    // what was sent behind the first, and asks anew anyway).
    let hellos_before = asked
        .iter()
        .filter(|(seq, r)| {
            matches!(r, gemini_protocol::Request::Hello { .. })
                && maps.get(1).is_some_and(|m| seq < m)
        })
        .count();
    assert!(
        maps.len() >= 2 && hellos_before == 1,
        "the GPU map asked again after it was dropped: {asked:?}"
    );
}

#[test]
fn unknown_or_missing_group_fails_cleanly_with_one_line() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let out = rust(&g, "nosuch", &["--seconds", "0.2"]).output().unwrap();
    assert!(!out.status.success());
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("unknown group") && lines[0].contains(&g.conf().display().to_string()),
        "{}",
        lines[0]
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("CUresult 800"));

    let mut c = rust(&g, "a", &["--seconds", "0.2"]);
    c.env_remove("GEMINI_GROUP_NAME");
    let out = c.output().unwrap();
    assert!(!out.status.success());
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("GEMINI_GROUP_NAME is not set"),
        "{}",
        lines[0]
    );

    let out = c_prog(&g, "nosuch", &["-s", "0.2"]).output().unwrap();
    assert!(!out.status.success());
    assert_eq!(stderr_lines(&out).len(), 1);
}

/// The hook's ZeroMQ socket is in libgemzmq.so beside it, loaded at its
/// first connection: a hook copied without it says so in one line, and
/// the program's CUDA calls fail (it neither hangs nor runs ungated). A
/// program that never calls CUDA does not need it.
#[test]
fn a_hook_without_its_socket_library_says_so_and_refuses() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let dir = tempfile::tempdir().unwrap();
    let alone = dir.path().join("libgemhook.so");
    std::fs::copy(gemini_tests::bin("libgemhook.so"), &alone).unwrap();
    let mut c = rust(&g, "a", &["--seconds", "0.2"]);
    c.env("LD_PRELOAD", &alone);
    let out = c.output().unwrap();
    assert!(!out.status.success());
    let lines = stderr_lines(&out);
    assert_eq!(lines.len(), 1, "{lines:?}");
    assert!(
        lines[0].contains("libgemzmq.so") && lines[0].contains("will fail"),
        "{}",
        lines[0]
    );
    let out = Command::new("/bin/true")
        .env("LD_PRELOAD", &alone)
        .output()
        .unwrap();
    assert!(out.status.success() && out.stderr.is_empty(), "{out:?}");
}

/// The hook links its unwinder in (not libgcc_s.so.1, which every process
/// it was preloaded into paid to load): a panic still unwinds through
/// its frames to the `catch_unwind` of its entry points, which turn it
/// into an error instead of aborting the program.
#[test]
fn a_panic_in_the_hook_unwinds_without_libgcc_s() {
    gemini_tests::assert_no_libgcc_s(&gemini_tests::bin("libgemhook.so"));
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let out = rust(&g, "a", &["--hook-unwinds"]).output().unwrap();
    assert_eq!(out.status.code(), Some(0), "{out:?}");
    let mut c = rust(&g, "a", &["--hook-unwinds"]);
    c.env_remove("LD_PRELOAD");
    assert_eq!(
        c.output().unwrap().status.code(),
        Some(5),
        "without the hook"
    );
}

/// The hook's ZeroMQ socket, loaded at a program's first connection,
/// carries its C++ runtime: loading the shared one took 0.9-1.4 ms of
/// every hooked program without one of its own. A program with its own
/// (as PyTorch has) is served, and its runtime works as before after the
/// hook connected: exceptions, a locale, threads.
#[test]
fn the_zeromq_socket_loads_without_the_shared_cxx_runtime() {
    gemini_tests::assert_no_libstdcxx(&gemini_tests::bin("libgemzmq.so"));
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let t0 = now_ns();
    let out = finish(spawn(g.hooked(g.sim.cxx_workload(), "a")));
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("cxx caught=thrown formatted=1234.5 kernels=20 threads=6"),
        "{out:?}"
    );
    g.wait_status(5.0, "group a charged for its kernels", |s| {
        s.devices
            .iter()
            .any(|d| d.groups.iter().any(|r| r.group == "a" && r.share > 0.0))
    });
    assert!(g.sim.busy(0, t0, now_ns()).device_share() > 0.0);
}

/// The hook finds libgemzmq.so beside the file it was loaded from,
/// however the loader names it: a relative path
/// (`LD_PRELOAD=lib/libgemhook.so`), or a symbolic link from a directory
/// without the library. (It reads the process's map only then.)
#[test]
fn the_socket_library_is_found_beside_a_relative_or_linked_hook() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let dir = tempfile::tempdir().unwrap();
    let lib = dir.path().join("lib");
    std::fs::create_dir(&lib).unwrap();
    for f in ["libgemhook.so", "libgemzmq.so"] {
        std::fs::copy(gemini_tests::bin(f), lib.join(f)).unwrap();
    }
    let other = dir.path().join("other");
    std::fs::create_dir(&other).unwrap();
    std::os::unix::fs::symlink(lib.join("libgemhook.so"), other.join("libgemhook.so")).unwrap();
    let relative = std::path::PathBuf::from("lib/libgemhook.so");
    for hook in [relative, other.join("libgemhook.so")] {
        let mut c = rust(&g, "a", &["--seconds", "0.2"]);
        c.env("LD_PRELOAD", &hook).current_dir(dir.path());
        let out = finish(spawn(c));
        let kernels = field(&reports(&out.stdout)[0], "kernels");
        assert!(kernels > 0, "{}: {out:?}", hook.display());
    }
}

#[test]
fn absent_scheduler_is_reported_and_connect_timeout_gives_up() {
    let mut g = Gemini::start(SimEnv::default(), "[a]\n");
    g.kill_scheduler();
    let mut c = rust(&g, "a", &["--seconds", "0.2"]);
    c.env("GEMINI_CONNECT_TIMEOUT", "1s");
    let start = Instant::now();
    let out = c.output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(5),
        "took {:?}",
        start.elapsed()
    );
    assert!(!out.status.success());
    let lines = stderr_lines(&out);
    assert!(
        lines
            .iter()
            .any(|l| l.contains("no scheduler answers") && l.contains("gem-schd")),
        "{lines:?}"
    );
    assert!(lines.iter().any(|l| l.contains("gave up")), "{lines:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("CUresult 3"));
}

/// GEMINI_CONNECT_TIMEOUT bounds a scheduler's silence mid-run too: a
/// program whose scheduler dies while it runs gives up after the timeout
/// with one line and CUDA_ERROR_NOT_INITIALIZED (it used to wait forever).
#[test]
fn connect_timeout_gives_up_when_the_scheduler_dies_mid_run() {
    let mut g = Gemini::start(SimEnv::default(), "[a]\nMaxUtil=0.5\n");
    let mut c = rust(&g, "a", &["--seconds", "30", "--kernel-us", "500"]);
    c.env("GEMINI_CONNECT_TIMEOUT", "2s");
    let w = spawn(c);
    std::thread::sleep(Duration::from_millis(800));
    g.kill_scheduler();
    let start = Instant::now();
    let out = w.wait_with_output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(15),
        "still waiting after {:?}",
        start.elapsed()
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("GEMINI_CONNECT_TIMEOUT") && err.contains("CUresult 3"),
        "{err}"
    );
}

/// A user the kernel refuses the scheduler's socket (not in its
/// ipc_group) is told so, and a hooked program gives up with
/// CUDA_ERROR_NOT_PERMITTED instead of waiting forever for "no
/// scheduler". Runs as `nobody` through setpriv, so only as root.
#[test]
fn a_user_refused_the_socket_is_told_and_the_program_gives_up() {
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 || !Path::new("/usr/bin/setpriv").exists() {
        eprintln!("SKIPPED: needs root and setpriv to run as another user");
        return;
    }
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    // The simulator's files are open to everyone; the IPC directory (0700,
    // the daemon's) is not.
    let _ = Command::new("chmod")
        .args(["-R", "a+rwX"])
        .arg(g.sim.path())
        .status();
    use std::os::unix::fs::PermissionsExt as _;
    std::fs::set_permissions(g.ipc(), std::fs::Permissions::from_mode(0o700)).unwrap();
    let as_nobody = |c: Command| {
        let prog = c.get_program().to_owned();
        let args: Vec<_> = c.get_args().map(|a| a.to_owned()).collect();
        let envs: Vec<_> = c
            .get_envs()
            .filter_map(|(k, v)| Some((k.to_owned(), v?.to_owned())))
            .collect();
        let mut n = Command::new("/usr/bin/setpriv");
        n.args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
            .arg(prog)
            .args(args)
            .envs(envs);
        n
    };
    let mut c = as_nobody(rust(&g, "a", &["--seconds", "1"]));
    c.env("GEMINI_CONNECT_TIMEOUT", "30s");
    let start = Instant::now();
    let out = c.output().unwrap();
    assert!(
        start.elapsed() < Duration::from_secs(10),
        "waited {:?}",
        start.elapsed()
    );
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("permission denied on")
            && err.contains("ipc_group")
            && err.contains("CUresult 800"),
        "{err}"
    );
    let mut status = Command::new(gemini_tests::bin("gem-schd"));
    status.arg("status").arg("--ipc-dir").arg(g.ipc());
    let out = as_nobody(status).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Not "no scheduler" (3): one answers, but not to this user (5).
    assert_eq!(out.status.code(), Some(5), "{err}");
    assert!(
        err.contains("permission denied on") && !err.contains("is gem-schd running"),
        "{err}"
    );
}

#[test]
fn program_started_before_the_scheduler_waits_for_it() {
    let mut g = Gemini::start(SimEnv::default(), "[a]\nMaxUtil=0.5\n");
    g.kill_scheduler();
    let w = spawn(rust(&g, "a", &["--seconds", "2", "--kernel-us", "500"]));
    std::thread::sleep(Duration::from_millis(1500));
    g.start_scheduler();
    let out = finish(w);
    let r = &reports(&out.stdout)[0];
    assert!(field(r, "kernels") > 100, "{r:?}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("no scheduler answers"));
    // Its hellos, sent while no scheduler ran and answered twice by the
    // new one, are no refusal: nothing to warn an operator of.
    let log = g.log();
    let warned: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("refused"))
        .collect();
    assert!(warned.is_empty(), "{warned:?}");
}

/// Environment values that do not parse are said, once each, instead of
/// being silently dropped (`GEMINI_IDLE_MS=banana` used to mean 5 ms and
/// `GEMINI_CONNECT_TIMEOUT=1sec` no limit, without a word; `1sec` is a
/// duration now), and the program still runs with the defaults.
#[test]
fn bad_environment_values_are_reported() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    for (idle, timeout) in [("banana", "1 fortnight"), ("-5", "banana")] {
        let mut c = rust(&g, "a", &["--seconds", "0.1"]);
        c.env("GEMINI_IDLE_MS", idle)
            .env("GEMINI_CONNECT_TIMEOUT", timeout);
        let out = finish(spawn(c));
        let err = String::from_utf8_lossy(&out.stderr);
        let idle_lines = err
            .lines()
            .filter(|l| l.contains(&format!("GEMINI_IDLE_MS={idle:?}: expected a duration")))
            .count();
        let timeout_lines = err
            .lines()
            .filter(|l| {
                l.contains(&format!(
                    "GEMINI_CONNECT_TIMEOUT={timeout:?}: expected a duration"
                ))
            })
            .count();
        assert_eq!((idle_lines, timeout_lines), (1, 1), "{err}");
        assert!(field(&reports(&out.stdout)[0], "kernels") > 0);
    }
}
