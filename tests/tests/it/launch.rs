//! `gem-launch` with the real scheduler: GPU reservations (different GPUs,
//! a queue, least recently released first, --nonblock), exit codes and
//! signals, the checks before launching, and a workload run through it
//! being gated on the GPU it was given.

use gemini_tests::cpu::CpuTimes;
use gemini_tests::{Gemini, SimEnv, bin, field, now_ns, reports};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn machine(conf: &str) -> Gemini {
    Gemini::start_with(SimEnv::new(2, "16GiB"), conf, &["--devices", "2"])
}

fn launch(g: &Gemini, args: &[&str], program: &[&str]) -> Command {
    let mut c = g.sim.command(bin("gem-launch"));
    c.env("GEMINI_IPC_DIR", g.ipc())
        .env_remove("GEMINI_GROUP_NAME")
        .args(args)
        .arg("--")
        .args(program);
    c
}

/// A program that prints the GPUs it was given (and the numbering CUDA
/// is told to read them in), then sleeps.
fn show_gpus(secs: &str) -> Vec<String> {
    vec![
        "sh".into(),
        "-c".into(),
        format!(
            "echo gpus=$CUDA_VISIBLE_DEVICES order=$CUDA_DEVICE_ORDER group=$GEMINI_GROUP_NAME; sleep {secs}"
        ),
    ]
}

fn args(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

fn gpus_of(out: &[u8]) -> String {
    let text = String::from_utf8_lossy(out);
    let line = text
        .lines()
        .find(|l| l.starts_with("gpus="))
        .unwrap_or_else(|| panic!("no gpus line in {text:?}"));
    let gpus = line
        .split_whitespace()
        .next()
        .unwrap()
        .trim_start_matches("gpus=")
        .to_string();
    // The scheduler's indices are nvidia-smi's: PCI bus order.
    assert!(
        gpus.is_empty() || line.contains(" order=PCI_BUS_ID "),
        "{line}"
    );
    gpus
}

#[test]
fn launches_get_different_gpus_a_third_waits_and_lru_order_holds() {
    let g = machine("[a]\n");
    let p1 = show_gpus("2.5");
    let first = launch(&g, &["--group", "a", "--gpus", "1"], &args(&p1))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    g.wait_status(5.0, "one reservation", |s| s.reservations.len() == 1);
    let p2 = show_gpus("1");
    let second = launch(&g, &["--group", "a", "--gpus", "1"], &args(&p2))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    g.wait_status(5.0, "two reservations", |s| s.reservations.len() == 2);
    // Both GPUs are held: a third queues, shows in status, and starts when
    // the second ends — on the GPU the second released.
    let t = Instant::now();
    let p3 = show_gpus("0");
    let third = launch(&g, &["--group", "a", "--gpus", "1"], &args(&p3))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    g.wait_status(5.0, "one launch queued", |s| s.queue.len() == 1);
    let text = Command::new(bin("gem-schd"))
        .arg("status")
        .arg("--ipc-dir")
        .arg(g.ipc())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("RESERVATIONS") && text.contains("waits 1 GPU(s)"),
        "{text}"
    );
    let o3 = third.wait_with_output().unwrap();
    let waited = t.elapsed();
    let (o1, o2) = (
        first.wait_with_output().unwrap(),
        second.wait_with_output().unwrap(),
    );
    let (g1, g2, g3) = (
        gpus_of(&o1.stdout),
        gpus_of(&o2.stdout),
        gpus_of(&o3.stdout),
    );
    assert_ne!(g1, g2, "two launches share a GPU");
    assert_eq!(g3, g2, "the third got the GPU the second released");
    assert!(
        waited >= Duration::from_millis(500),
        "the third did not wait ({waited:?})"
    );
    assert!(String::from_utf8_lossy(&o3.stderr).contains("waiting in the queue"));
    // g2 was released (by the third) about 1.5 s before the first released
    // g1: least recently released first means g2, whatever its index.
    g.wait_status(5.0, "all released", |s| s.reservations.is_empty());
    let p4 = show_gpus("0");
    let out = launch(&g, &["--group", "a", "--gpus", "1"], &args(&p4))
        .output()
        .unwrap();
    assert_eq!(
        gpus_of(&out.stdout),
        g2,
        "the GPU released longest ago is chosen"
    );
}

#[test]
fn nonblock_and_timeout_fail_with_exit_13() {
    let g = machine("[a]\n");
    let p = show_gpus("3");
    let holder = launch(&g, &["--group", "a", "--gpus", "2"], &args(&p))
        .stdout(Stdio::null())
        .spawn()
        .unwrap();
    g.wait_status(5.0, "GPUs held", |s| s.reservations.len() == 1);
    let t = Instant::now();
    let out = launch(
        &g,
        &["--group", "a", "--gpus", "1", "--nonblock"],
        &["true"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(13));
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("no GPU has room"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = launch(
        &g,
        &["--group", "a", "--gpu-ids", "1", "--timeout", "0.5s"],
        &["true"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(13));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--timeout"));
    let mut holder = holder;
    holder.kill().unwrap();
    holder.wait().unwrap();
    g.wait_status(3.0, "released on kill", |s| {
        s.reservations.is_empty() && s.queue.is_empty()
    });
}

#[test]
fn exit_status_and_signals_are_the_programs() {
    use std::os::unix::process::ExitStatusExt;
    let g = machine("[a]\n");
    let out = launch(&g, &["--group", "a"], &["sh", "-c", "exit 7"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(7));
    let mut child = launch(&g, &["--group", "a", "--gpus", "1"], &["sleep", "30"])
        .spawn()
        .unwrap();
    g.wait_status(5.0, "reservation", |s| s.reservations.len() == 1);
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    let status = child.wait().unwrap();
    assert_eq!(status.signal(), Some(libc::SIGTERM));
    g.wait_status(3.0, "released after SIGTERM", |s| s.reservations.is_empty());
    let out = launch(&g, &["--group", "a"], &["/nonexistent/program"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(127));
}

#[test]
fn checks_before_launching_have_their_own_exit_codes() {
    let mut g = machine("[a]\n[b]\n");
    let marker = g.sim.path().join("ran");
    let touch = format!("touch {}", marker.display());
    // Unknown group: refused before the program runs.
    let out = launch(&g, &["--group", "nosuch"], &["sh", "-c", &touch])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(12));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("\"nosuch\" is not defined") && err.contains("a, b"),
        "{err}"
    );
    assert!(!marker.exists(), "the program ran");
    // No group at all (and no group named after the user).
    let out = launch(&g, &[], &["true"]).output().unwrap();
    assert_eq!(out.status.code(), Some(12));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no --group given"));
    // GEMINI_GROUP_NAME is the default.
    let mut c = launch(
        &g,
        &[],
        &[
            "sh",
            "-c",
            "echo group=$GEMINI_GROUP_NAME preload=$LD_PRELOAD",
        ],
    );
    c.env("GEMINI_GROUP_NAME", "b")
        .env("LD_PRELOAD", "/lib/other.so");
    let out = c.output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("group=b") && text.contains("libgemhook.so /lib/other.so"),
        "{text}"
    );
    // Missing hook library.
    let out = launch(
        &g,
        &["--group", "a", "--hook", "/nonexistent/libgemhook.so"],
        &["true"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(10));
    // A hook without its socket library beside it.
    let alone = tempfile::tempdir().unwrap();
    let hook = alone.path().join("libgemhook.so");
    std::fs::copy(gemini_tests::bin("libgemhook.so"), &hook).unwrap();
    let out = launch(
        &g,
        &["--group", "a", "--hook", hook.to_str().unwrap()],
        &["true"],
    )
    .output()
    .unwrap();
    assert_eq!(out.status.code(), Some(10));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("libgemzmq.so"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // No scheduler.
    g.kill_scheduler();
    let out = launch(&g, &["--group", "a"], &["true"]).output().unwrap();
    assert_eq!(out.status.code(), Some(11));
    assert!(String::from_utf8_lossy(&out.stderr).contains("is gem-schd running?"));
}

/// A program whose SIGTERM handler calls `exit` (as many C and C++
/// programs' do) exits when the signal comes while it waits for a token,
/// holding another GPU's token it no longer uses. The hook's exit handler
/// then runs on the thread the signal interrupted, which holds the
/// connection's lock for as long as it waits for the scheduler's answer:
/// taking the lock again deadlocked that thread, and the program hung
/// for good. It only tries the lock now, for its half a second, and
/// gives up.
#[test]
fn a_program_exiting_from_a_signal_handler_while_it_waits_for_a_token_exits() {
    let g = machine("[a]\n[b]\n");
    // GPU 1 is b's: a's launch there waits for as long as the test wants.
    succeeds(
        &g,
        &[
            "reserve",
            "--group",
            "b",
            "--gpu-ids",
            "1",
            "--duration",
            "1h",
        ],
    );
    let mut a = g.hooked(g.sim.c_workload(), "a");
    a.args(["-s", "0.3", "-k", "500", "-d", "0", "-t", "1", "-x"])
        // GPU 0's token stays held while it waits on GPU 1.
        .env("GEMINI_IDLE_MS", "60000")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut a = Reaped(Some(a.spawn().unwrap()));
    let child = a.0.as_mut().unwrap();
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    assert_eq!(line.trim(), "waiting on 1");
    g.wait_status(10.0, "a waits on GPU 1", |s| {
        s.devices
            .iter()
            .any(|d| d.device == 1 && d.groups.iter().any(|r| r.group == "a" && r.waiting > 0))
    });
    let pid = child.id() as i32;
    // SAFETY: kill(2) on our own child, which has not been reaped.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let t0 = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "it still runs 20 s after SIGTERM: its exit hangs"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(status.code(), Some(3), "{status:?}");
}

#[test]
fn a_workload_launched_on_a_reserved_gpu_is_gated_there() {
    let g = machine("[capped]\nMaxUtil=0.4\n");
    let cpu = CpuTimes::now();
    let t0 = now_ns();
    let mut c = launch(
        &g,
        &["--group", "capped", "--gpu-ids", "1"],
        &[
            bin("gem-workload").to_str().unwrap(),
            "--seconds",
            "4",
            "--kernel-us",
            "500",
        ],
    );
    let out = c.output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let pid = field(&reports(&out.stdout)[0], "pid") as u32;
    let share = g
        .sim
        .busy(1, t0 + 1_000_000_000, t0 + 4_000_000_000)
        .share(pid);
    // Over the cap means not gated, starved or not; under it by more than
    // the tolerance only counts where the host left the CPU.
    assert!(share > 0.0 && share <= 0.44, "share on GPU 1: {share:.3}");
    if cpu.counts("share on GPU 1") {
        assert!((share - 0.4).abs() <= 0.04, "share on GPU 1: {share:.3}");
    }
    assert_eq!(g.sim.busy(0, t0, now_ns()).device, 0, "GPU 0 untouched");
}

/// `--job NAME` makes the program a rank of that multi-GPU job: the
/// scheduler knows it as one (its ranks take their GPUs in turns), and
/// `gem-schd status` says so. A program launched without it, and with no
/// launcher's variables (torchrun's, Slurm's, MPI's), is no rank.
#[test]
fn a_program_launched_with_job_is_a_rank_of_it() {
    let g = machine("[a]\n");
    let spawn = |extra: &[&str]| {
        let mut args = vec!["--group", "a"];
        args.extend_from_slice(extra);
        let mut c = launch(
            &g,
            &args,
            &[
                bin("gem-workload").to_str().unwrap(),
                "--seconds",
                "3",
                "--kernel-us",
                "500",
            ],
        );
        c.stdout(Stdio::null()).spawn().unwrap()
    };
    let mut ranked = spawn(&["--job", "llama-7"]);
    let mut plain = spawn(&[]);
    let programs = |s: &gemini_protocol::StatusReport| {
        s.clients
            .iter()
            .filter(|c| c.role == gemini_protocol::Role::Client)
            .map(|c| c.job.clone())
            .collect::<Vec<_>>()
    };
    let st = g.wait_status(10.0, "two programs", |s| programs(s).len() == 2);
    let mut jobs = programs(&st);
    jobs.sort();
    assert_eq!(jobs, [None, Some("gemini:llama-7".to_string())]);
    let text = Command::new(bin("gem-schd"))
        .arg("status")
        .arg("--ipc-dir")
        .arg(g.ipc())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(text.contains("(job gemini:llama-7)"), "{text}");
    for c in [&mut ranked, &mut plain] {
        let _ = c.kill();
        let _ = c.wait();
    }
}

/// GPU reservations survive a scheduler restart (kill -9, or shutdown and
/// start): the new scheduler reads them back from its state file for the
/// processes still running and does not hand their GPUs out again. A
/// launch waiting in the queue asks the new scheduler again and gets its
/// GPU when the holder ends. (Before: the restarted scheduler gave GPU 0
/// to the next launch while a job held it, and a queued launch waited
/// forever.) The group is restricted to another user: the jobs, of the
/// scheduler's own user, may use it, and so may the restored reservations,
/// which the scheduler itself makes again for them.
#[test]
fn reservations_and_the_queue_survive_a_scheduler_restart() {
    let mut g = Gemini::start_with(
        SimEnv::new(1, "16GiB"),
        "[a]\nAllowedUsers=nobody\n",
        &["--devices", "1"],
    );
    let holder_prog = show_gpus("4");
    let holder = launch(&g, &["--group", "a", "--gpus", "1"], &args(&holder_prog))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    g.wait_status(5.0, "GPU 0 reserved", |s| s.reservations.len() == 1);
    let waiting = launch(&g, &["--group", "a", "--gpus", "1"], &args(&show_gpus("0")))
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    g.wait_status(5.0, "a launch queued", |s| s.queue.len() == 1);
    // Held a second before the first restart: a restored reservation
    // counted from its restore would show less.
    std::thread::sleep(Duration::from_secs(1));
    for how in ["kill -9", "shutdown"] {
        let held_for = g.status().reservations[0].for_us;
        if how == "shutdown" {
            let out = Command::new(bin("gem-schd"))
                .arg("shutdown")
                .arg("--ipc-dir")
                .arg(g.ipc())
                .output()
                .unwrap();
            assert!(out.status.success());
            let deadline = Instant::now() + Duration::from_secs(5);
            while g.ipc().join("scheduler.sock").exists() {
                assert!(Instant::now() < deadline, "the scheduler did not stop");
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        g.kill_scheduler();
        g.start_scheduler();
        let st = g.wait_status(5.0, "the reservation restored", |s| {
            s.reservations.len() == 1 && s.reservations[0].devices == [0]
        });
        // Held since it was made, not since the restart.
        assert!(
            st.reservations[0].for_us >= held_for,
            "after {how}: held {} µs, before the restart {held_for} µs",
            st.reservations[0].for_us
        );
        let out = launch(
            &g,
            &["--group", "a", "--gpus", "1", "--nonblock"],
            &["true"],
        )
        .output()
        .unwrap();
        assert!(
            !out.status.success(),
            "after {how}, GPU 0 was handed out again while its job runs"
        );
    }
    // The holder ends: the launch that waited since before the restarts
    // gets the GPU.
    let out = holder.wait_with_output().unwrap();
    assert_eq!(gpus_of(&out.stdout), "0");
    let start = Instant::now();
    let out = waiting.wait_with_output().unwrap();
    assert!(start.elapsed() < Duration::from_secs(10));
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(gpus_of(&out.stdout), "0");
}

/// `ipc_dir` in gemini.toml moves every part, not only the daemon: with
/// only `GEMINI_SETTINGS` naming the file (no `--ipc-dir`, no
/// `GEMINI_IPC_DIR`), `gem-schd status`, a hooked program, `gem-launch`
/// and `gem-schd shutdown` (the unit's `ExecStop`) all find the scheduler
/// there. (Before, all but the daemon looked in /tmp/gemini/ipc.)
#[test]
fn ipc_dir_in_the_settings_file_moves_every_part() {
    let sim = SimEnv::new(1, "16GiB");
    let ipc = sim.path().join("elsewhere");
    let settings = sim.path().join("gemini.toml");
    std::fs::write(
        &settings,
        format!("ipc_dir = \"{}\"\ndevices = 1\n", ipc.display()),
    )
    .unwrap();
    let conf = sim.path().join("resource.conf");
    std::fs::write(&conf, "[a]\n").unwrap();
    let tool = |program: &str| {
        let mut c = sim.command(bin(program));
        c.env_remove("GEMINI_IPC_DIR")
            .env("GEMINI_SETTINGS", &settings);
        c
    };
    let mut schd = tool("gem-schd")
        .arg("--config")
        .arg(&conf)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let status = || {
        tool("gem-schd")
            .args(["status", "--json"])
            .output()
            .unwrap()
    };
    let deadline = Instant::now() + Duration::from_secs(10);
    while !status().status.success() {
        assert!(
            Instant::now() < deadline,
            "status never found the scheduler"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(ipc.join("scheduler.sock").exists());

    let mut hooked = tool("gem-workload");
    hooked
        .env("LD_PRELOAD", bin("libgemhook.so"))
        .env("GEMINI_GROUP_NAME", "a")
        .env("GEMINI_CONNECT_TIMEOUT", "5s")
        .args(["--seconds", "3", "--kernel-us", "500"])
        .stdout(Stdio::null());
    let mut hooked = hooked.spawn().unwrap();
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let out = tool("gem-schd").arg("status").output().unwrap();
        let text = String::from_utf8_lossy(&out.stdout);
        if text.contains("\n1 program(s)") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the hooked program never registered: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(hooked.wait().unwrap().success());

    let out = tool("gem-launch")
        .args(["--group", "a", "--gpus", "1", "--nonblock", "--"])
        .args(["sh", "-c", "echo dir=$GEMINI_IPC_DIR"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.contains(&format!("dir={}", ipc.display())), "{text}");

    assert!(tool("gem-schd").arg("shutdown").status().unwrap().success());
    let deadline = Instant::now() + Duration::from_secs(5);
    while schd.try_wait().unwrap().is_none() {
        assert!(
            Instant::now() < deadline,
            "shutdown did not reach the scheduler"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A settings file that cannot say where the scheduler is stops the tools
/// with its name and what is wrong, before they wait on a wrong socket.
#[test]
fn a_bad_settings_file_is_named_by_every_tool() {
    let sim = SimEnv::new(1, "16GiB");
    let settings = sim.path().join("gemini.toml");
    std::fs::write(&settings, "ipc_dir = \"relative/ipc\"\n").unwrap();
    for (program, args) in [
        ("gem-schd", &["status"][..]),
        ("gem-launch", &["--group", "a", "--", "true"][..]),
        ("gem-holder", &["status"][..]),
    ] {
        let out = sim
            .command(bin(program))
            .env_remove("GEMINI_IPC_DIR")
            .env("GEMINI_SETTINGS", &settings)
            .args(args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{program}");
        assert!(
            err.contains(&settings.display().to_string()) && err.contains("absolute path"),
            "{program}: {err}"
        );
    }
}

/// `gem-launch` with a subcommand (`reserve`, `release`) and no program.
fn subcommand(g: &Gemini, args: &[&str]) -> std::process::Output {
    g.sim
        .command(bin("gem-launch"))
        .env("GEMINI_IPC_DIR", g.ipc())
        .env_remove("GEMINI_GROUP_NAME")
        .args(args)
        .output()
        .unwrap()
}

/// [`subcommand`] that must succeed (its stderr shown where it did not).
fn succeeds(g: &Gemini, args: &[&str]) -> std::process::Output {
    let out = subcommand(g, args);
    assert!(
        out.status.success(),
        "{args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// canhazgpu's `reserve --gpus 2 --duration 4h`, then `release`: GPUs
/// reserved without a program stay the user's after `gem-launch` exits
/// and across a restart of the scheduler,
/// are listed in `gem-schd status` with the user and when they expire,
/// keep other launches off them (which wait in the queue), and end by
/// themselves when they expire or early with `gem-launch release`.
#[test]
fn gpus_reserved_without_a_program_expire_or_are_released() {
    let mut g = machine("[a]\n");
    let out = succeeds(
        &g,
        &["reserve", "--group", "a", "--gpus", "1", "--duration", "4h"],
    );
    let said = String::from_utf8_lossy(&out.stdout);
    assert!(
        said.contains("GPU(s) 0 reserved for group \"a\" until ") && said.contains("(4h)"),
        "{said}"
    );
    // gem-launch has exited; the reservation stays, with its user.
    let st = g.status();
    assert_eq!(st.reservations.len(), 1);
    let m = st.reservations[0]
        .manual
        .clone()
        .expect("made without a program");
    assert!(m.left_us > 3 * 3600 * 1_000_000, "{m:?}");
    let text = Command::new(bin("gem-schd"))
        .args(["status", "--ipc-dir"])
        .arg(g.ipc())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("reserved for group a: user {} until ", m.user)),
        "{text}"
    );
    // A scheduler killed and started again keeps it, with its user and end.
    g.kill_scheduler();
    g.start_scheduler();
    let st = g.status();
    assert_eq!(st.reservations.len(), 1, "{st:?}");
    let again = st.reservations[0]
        .manual
        .clone()
        .expect("still without a program");
    assert_eq!(again.user, m.user);
    // The state file keeps the end in whole seconds of the Unix clock
    // (rounded up, and read against a clock read in whole seconds): it
    // may come back up to 2 s later (it came back 54 µs later once, and
    // the test failed).
    assert!(
        again.left_us <= m.left_us + 2_000_000 && again.left_us + 10_000_000 > m.left_us,
        "{again:?} after {m:?}"
    );
    // A one-second reservation of GPU 1: a launch asking for both waits
    // until it expires (and for GPU 0, released below).
    succeeds(
        &g,
        &[
            "reserve",
            "--group",
            "a",
            "--gpu-ids",
            "1",
            "--duration",
            "1s",
        ],
    );
    let p = show_gpus("0");
    let waiting = launch(&g, &["--group", "a", "--gpus", "2"], &args(&p))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let st = g.wait_status(5.0, "the launch waits", |s| s.queue.len() == 1);
    // The queue names who waits and with what command.
    assert!(
        st.queue[0].command.contains("gem-launch") && st.queue[0].command.contains("--gpus 2"),
        "{:?}",
        st.queue[0]
    );
    assert!(!st.queue[0].user.is_empty(), "{:?}", st.queue[0]);
    g.wait_status(5.0, "the 1 s reservation expired", |s| {
        s.reservations.iter().all(|r| !r.devices.contains(&1))
    });
    // Released early by its user: the waiting launch gets both GPUs.
    let out = succeeds(&g, &["release"]);
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "GPU(s) 0 given back"
    );
    let out = waiting.wait_with_output().unwrap();
    assert_eq!(gpus_of(&out.stdout).split(',').count(), 2);
    // Nothing left to release: said, exit 15.
    let out = subcommand(&g, &["release", "--gpu-ids", "0"]);
    assert_eq!(out.status.code(), Some(15));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no reservation of yours"));
    // A length out of range is refused with the scheduler's reason.
    let out = subcommand(
        &g,
        &[
            "reserve",
            "--gpus",
            "1",
            "--group",
            "a",
            "--duration",
            "40d",
        ],
    );
    assert_eq!(out.status.code(), Some(14));
    assert!(String::from_utf8_lossy(&out.stderr).contains("at most 30 days"));
    // So is a request for more GPUs than there are, or for one that does
    // not exist: 14 (refused as asked), not 13 (none free now).
    for ask in [["--gpus", "3"], ["--gpu-ids", "5"]] {
        let mut a = vec!["reserve", "--group", "a", "--duration", "1h"];
        a.extend(ask);
        let out = subcommand(&g, &a);
        assert_eq!(
            out.status.code(),
            Some(14),
            "{ask:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// Usage: the exit statuses are listed in `--help`; a program not set
/// apart with `--` gets a hint; a usage line does not show the flags
/// the environment set (GEMINI_IPC_DIR) as if they were needed.
#[test]
fn usage_lists_exit_statuses_and_hints_at_the_missing_dashes() {
    let help = Command::new(bin("gem-launch"))
        .arg("--help")
        .output()
        .unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    for code in ["10 ", "11 ", "12 ", "13 ", "14 ", "15 ", "126 ", "127 "] {
        assert!(
            help.lines().any(|l| l.trim_start().starts_with(code)),
            "{code}: {help}"
        );
    }
    let out = Command::new(bin("gem-launch"))
        .args(["--group", "train", "python", "train.py"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("tip: put the program after `--`")
            && err.contains("gem-launch --group NAME -- PROGRAM"),
        "{err}"
    );
    let out = Command::new(bin("gem-launch"))
        .env("GEMINI_IPC_DIR", "/tmp/nowhere")
        .env("GEMINI_SETTINGS", "/dev/null")
        .arg("reserve")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    let usage = err
        .lines()
        .find(|l| l.starts_with("Usage:"))
        .unwrap_or_else(|| panic!("{err}"));
    assert!(
        !usage.contains("--ipc-dir")
            && !usage.contains("--settings")
            && usage.contains("--duration"),
        "{usage}"
    );
}

/// GPUs reserved for a group (`gem-launch reserve`, with the GPUs gem-schd
/// learned from NVML) are that group's: another group's program on one
/// of them gets no token and waits, and `gem-schd status` says for whom;
/// once they are given back it runs.
#[test]
fn a_program_of_another_group_waits_on_a_reserved_gpu() {
    // The simulator's 2 GPUs, learned from its NVML where the machine's
    // kernel driver lists none (a GPU host's /proc would win).
    let nvml_only = !std::path::Path::new("/proc/driver/nvidia/gpus").exists();
    let flags: &[&str] = if nvml_only { &[] } else { &["--devices", "2"] };
    let g = Gemini::start_with(SimEnv::new(2, "16GiB"), "[train]\n[notebook]\n", flags);
    succeeds(
        &g,
        &[
            "reserve",
            "--group",
            "train",
            "--gpus",
            "2",
            "--duration",
            "1h",
        ],
    );
    let t0 = now_ns();
    let notebook = launch(
        &g,
        &["--group", "notebook"],
        &[
            bin("gem-workload").to_str().unwrap(),
            "--seconds",
            "1",
            "--kernel-us",
            "500",
        ],
    )
    .stdout(Stdio::piped())
    .stderr(Stdio::piped())
    .spawn()
    .unwrap();
    // Killed if an assertion fails: it would wait for ever otherwise.
    let mut notebook = Reaped(Some(notebook));
    g.wait_status(10.0, "notebook waits on GPU 0", |s| {
        s.devices.iter().any(|d| {
            d.device == 0
                && d.groups
                    .iter()
                    .any(|r| r.group == "notebook" && r.waiting > 0)
        })
    });
    let text = Command::new(bin("gem-schd"))
        .args(["status", "--ipc-dir"])
        .arg(g.ipc())
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains("notebook waits: GPU 0 is reserved for group train (user "),
        "{text}"
    );
    // The user's view: both GPUs reserved for train by this user, the
    // waiting program on GPU 0 with its command, and among their own.
    let out = subcommand(&g, &["status"]);
    let view = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{view}");
    let gpu0 = view
        .lines()
        .find(|l| l.starts_with("0 "))
        .unwrap_or_else(|| panic!("{view}"));
    assert!(
        gpu0.contains("train (") && gpu0.contains(" left)") && gpu0.contains("notebook "),
        "{view}"
    );
    assert!(
        view.lines()
            .any(|l| l.starts_with("1 ") && l.contains("train (")),
        "{view}"
    );
    let out = subcommand(&g, &["status", "--json"]);
    let json: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mine = json["mine"].as_array().cloned().unwrap_or_default();
    assert!(
        mine.iter().any(|p| p["group"] == "notebook"
            && p["command"]
                .as_str()
                .is_some_and(|c| c.contains("gem-workload"))),
        "{json}"
    );
    assert_eq!(json["gpus"][0]["reserved"][0]["group"], "train", "{json}");
    // It is marked as waiting, and says for whom.
    let notebook_row = mine.iter().find(|p| p["group"] == "notebook").unwrap();
    assert_eq!(notebook_row["waiting"], serde_json::json!([0]), "{json}");
    assert!(
        notebook_row["waits_for"]
            .as_str()
            .is_some_and(|w| w.starts_with("GPU 0 is reserved for group train (")),
        "{json}"
    );
    assert!(
        view.contains("WAITING") && view.contains("waits: GPU 0 is reserved for group train ("),
        "{view}"
    );
    // The program's hook asks why it waits (after a second of waiting)
    // and says it on its stderr: read as it comes, until it does.
    let mut stderr = notebook.0.as_mut().unwrap().stderr.take().unwrap();
    let (said_tx, said_rx) = std::sync::mpsc::channel();
    let reader = std::thread::spawn(move || {
        let mut err = String::new();
        let mut buf = [0u8; 4096];
        let mut told = false;
        while let Ok(n) = std::io::Read::read(&mut stderr, &mut buf) {
            if n == 0 {
                break;
            }
            err.push_str(&String::from_utf8_lossy(&buf[..n]));
            if !told && err.contains("waits for it") {
                told = true;
                let _ = said_tx.send(());
            }
        }
        err
    });
    assert!(
        said_rx.recv_timeout(Duration::from_secs(20)).is_ok(),
        "the waiting program never said why it waits"
    );
    assert_eq!(
        g.sim.busy(0, t0, now_ns()).device,
        0,
        "nothing ran on the reserved GPU"
    );
    succeeds(&g, &["release"]);
    // It runs, and ends, once they are given back (bounded: a wait that
    // never ended would hang the suite).
    let mut child = notebook.0.take().unwrap();
    let deadline = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(st) = child.try_wait().unwrap() {
            break st;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("the program still waits 30 s after the GPUs were given back");
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{status:?}");
    assert!(
        g.sim.busy(0, t0, now_ns()).device > 0,
        "it ran once released"
    );
    // It said why it waited, once, on its stderr.
    let err = reader.join().unwrap();
    assert_eq!(
        err.matches("GPU 0 is reserved for group train of user ")
            .count(),
        1,
        "{err}"
    );
    assert!(
        err.contains("more; this program (group notebook) waits for it"),
        "{err}"
    );
}

/// A child killed and reaped when dropped (a failed assertion included).
struct Reaped(Option<std::process::Child>);

impl Drop for Reaped {
    fn drop(&mut self) {
        if let Some(c) = self.0.as_mut() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}
