//! `gem-holder` on the simulator: it keeps an idle device at its target
//! utilisation (measured from the busy log), yields the device to a real
//! client within a few milliseconds, gives memory back on demand, and
//! releases everything when stopped.

use gemini_tests::cpu::{CpuTimes, MAX_STEAL, serial, unstarved};
use gemini_tests::{Gemini, SimEnv, field, now_ns, reports, run_ok};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

const SEC: u64 = 1_000_000_000;
const MS: u64 = 1_000_000;

struct Holder {
    child: Child,
}

impl Drop for Holder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start_holder(g: &Gemini, args: &[&str]) -> Holder {
    let mut all = vec!["run", "--wait-minutes", "0"];
    all.extend_from_slice(args);
    let child = g
        .holder(&all)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let h = Holder { child };
    g.wait_holder("holding", |s| s.contains("\"state\": \"holding\""));
    h
}

/// Free memory on device 0 as a program outside gemini sees it.
fn device_free(g: &Gemini) -> (u64, u64) {
    let mut c = g.sim.workload();
    c.args(["--seconds", "0"]);
    let r = &reports(&run_ok(c).stdout)[0];
    (field(r, "free"), field(r, "total"))
}

#[test]
fn idle_device_is_held_at_the_target_utilisation() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    // The targets (±2 pp of hold-util, ≥ 97 % busy) are measured by `make
    // bench`; a test must not flake on a loaded 2-core VM, so it checks the
    // behaviour — steered to the target, the device kept busy — with room.
    // Below full, the holder makes up for stalls of its own thread (see
    // gem-holder's pacing), measured to hold 0.47–0.51 with a quarter of
    // the CPU time stolen by the host; full, it cannot: the device idles
    // once its few queued kernels have run.
    for (util, lo, hi, max_steal) in [("0.5", 0.42, 0.58, 0.25), ("1.0", 0.88, 1.0, MAX_STEAL)] {
        let h = start_holder(&g, &["--hold-util", util, "--hold-mem", "1GiB"]);
        std::thread::sleep(Duration::from_secs(2));
        let what = format!("hold-util {util}");
        let busy = unstarved(&what, max_steal, 3, || {
            let t0 = now_ns();
            std::thread::sleep(Duration::from_secs(3));
            g.sim.busy(0, t0, t0 + 3 * SEC).device_share()
        });
        if let Some(busy) = busy {
            eprintln!("hold-util {util}: device busy {busy:.3}");
            assert!(
                (lo..=hi).contains(&busy),
                "hold-util {util}: device busy {busy:.3}"
            );
        }
        drop(h);
        std::thread::sleep(Duration::from_millis(300));
    }
}

/// With its defaults but a short wait, on a GPU whose contexts take
/// 500 MiB (as a PyTorch context takes 518 MiB on an H200), the holder
/// holds: its own context is not others' memory (it was, and the default
/// threshold of 0.5 GB then kept it waiting for ever). While a real
/// program has the device its status says to whom it yielded, and its
/// log says each change: the scheduler answering, holding, yielded to
/// whom, in use again (it logged only its start).
#[test]
fn the_holder_holds_with_its_defaults_beside_its_own_context() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default().driver_memory("500MiB"), "[a]\n");
    let log = g.sim.path().join("holder.log");
    let h = g
        .holder(&["run", "--wait-minutes", "0.02"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let h = Holder { child: h };
    // 1.2 s of waiting, then holding.
    g.wait_holder("holding", |s| s.contains("\"state\": \"holding\""));
    // A real program: the holder yields to it, and says to whom.
    let mut c = g.hooked(g.sim.workload(), "a");
    c.args(["--seconds", "3", "--kernel-us", "1000"])
        .stdout(Stdio::null());
    let mut client = c.spawn().unwrap();
    g.wait_holder("yielded", |s| {
        s.contains("yielded to pid") && s.contains("(group a)")
    });
    let _ = client.kill();
    let _ = client.wait();
    // Holding again once the GPU is idle for its 1.2 s.
    g.wait_holder("holding again", |s| s.contains("\"state\": \"holding\""));
    drop(h);
    let text = std::fs::read_to_string(&log).unwrap();
    let lines = |what: &str| text.lines().filter(|l| l.contains(what)).count();
    assert!(lines("the scheduler answers") >= 1, "{text}");
    assert!(
        lines("GPU 0: idle for") >= 2 && lines("holding it") >= 2,
        "{text}"
    );
    assert!(lines("GPU 0: yielded to pid") >= 1, "{text}");
    assert!(lines("GPU 0: in use again: compute stopped") >= 1, "{text}");
}

#[test]
fn a_real_client_takes_the_device_from_the_holder_within_milliseconds() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let _h = start_holder(&g, &["--hold-util", "1.0", "--hold-mem", "1GiB"]);
    // Bursts of 20 ms every 150 ms: each one arrives at a device the
    // holder has taken back in between.
    let bursts = g.sim.path().join("bursts.txt");
    let run = || {
        let out = run_ok(g.bursty_client("a", "8", &bursts));
        let pid = field(&reports(&out.stdout)[0], "pid") as u32;
        let recs = fakecuda_log::read(&g.sim.sim_dir(), 0).unwrap();
        let waits = gemini_tests::first_kernel_waits(&g.sim, 0, pid, &bursts);
        // How long the holder ran (between the bursts).
        let holder_busy: u64 = recs
            .iter()
            .filter(|r| r.pid != pid)
            .map(|r| r.end - r.start)
            .sum();
        (waits, holder_busy)
    };
    let Some((mut waits, holder_busy)) = unstarved("first-kernel waits", MAX_STEAL, 3, run) else {
        return;
    };
    assert!(waits.len() >= 30, "{} arrivals", waits.len());
    // The holder really was running between the bursts.
    assert!(holder_busy > 2 * SEC, "holder ran {} ms", holder_busy / MS);
    waits.sort_unstable();
    // The target (p99 ≤ 5 ms) is measured by `make bench`. Here: most
    // arrivals get the device within a few holder kernels, and none waits
    // long (a scheduling hiccup of the VM must not fail the suite).
    let median = waits[waits.len() / 2];
    assert!(
        median <= 5 * MS,
        "median first-kernel wait {} us; all: {:?}",
        median / 1000,
        waits
    );
    let p99 = waits[waits.len() - 1];
    eprintln!(
        "first-kernel waits (us): {:?}",
        waits.iter().map(|w| w / 1000).collect::<Vec<_>>()
    );
    assert!(
        p99 <= 50 * MS,
        "a first kernel waited {} us; all: {:?}",
        p99 / 1000,
        waits
    );
}

#[test]
fn a_busy_real_client_gets_its_full_entitlement_beside_the_holder() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let _h = start_holder(&g, &["--hold-util", "1.0", "--hold-mem", "1GiB"]);
    let share = unstarved("client beside the holder", MAX_STEAL, 3, || {
        let mut c = g.hooked(g.sim.workload(), "a");
        c.args(["--seconds", "4", "--kernel-us", "500"]);
        let t0 = now_ns();
        let out = run_ok(c);
        let pid = field(&reports(&out.stdout)[0], "pid") as u32;
        g.sim.busy(0, t0 + SEC, t0 + 4 * SEC).share(pid)
    });
    let Some(share) = share else { return };
    eprintln!("client share beside the holder: {share:.3}");
    assert!(share >= 0.95, "client got {share:.3}");
}

#[test]
fn memory_held_by_the_holder_is_handed_back_within_200_ms() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::new(1, "4GiB"), "[a]\nMemoryLimit=2GiB\n");
    let _h = start_holder(&g, &["--hold-util", "0.5", "--hold-mem", "3584MiB"]);
    g.wait_holder("holding its memory", |s| {
        s.contains("\"held_bytes\": 3758096384")
    });
    assert_eq!(device_free(&g).0, 512 << 20);
    // Under the hook, the holder's memory counts as free (it is given back
    // on demand): the group sees its whole 2 GiB limit free.
    let mut c = g.hooked(g.sim.workload(), "a");
    c.args(["--seconds", "0"]);
    let r = &reports(&run_ok(c).stdout)[0];
    assert_eq!((field(r, "free"), field(r, "total")), (2 << 30, 2 << 30));
    let mut c = g.hooked(g.sim.workload(), "a");
    c.args(["--seconds", "0", "--mem", "1536MiB"]);
    let cpu = CpuTimes::now();
    let r = &reports(&run_ok(c).stdout)[0];
    assert_eq!(
        (field(r, "allocated"), field(r, "alloc_error")),
        (1536 << 20, 0)
    );
    let took = field(r, "alloc_done_ns") - field(r, "alloc_start_ns");
    eprintln!("allocation beside the holder took {} us", took / 1000);
    // The hand-back is always checked (the allocation succeeded); its time
    // only where the host let the processes run (342 ms was seen at high
    // steal).
    if cpu.counts("the holder's hand-back time") {
        assert!(took <= 200 * MS, "allocation took {} ms", took / MS);
    }
}

#[test]
fn stop_signal_and_scheduler_shutdown_release_everything() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::new(1, "4GiB"), "[a]\n");
    let h = start_holder(&g, &["--hold-mem", "2GiB"]);
    g.wait_holder("holding its memory", |s| {
        s.contains("\"held_bytes\": 2147483648")
    });
    // gem-holder stop: all memory free, compute stops, the process stays.
    let out = run_ok(g.holder(&["stop"]));
    assert!(String::from_utf8_lossy(&out.stdout).contains("stopped"));
    let (free, total) = device_free(&g);
    assert_eq!(free, total, "memory left after stop");
    g.wait_holder("stopped", |s| s.contains("\"state\": \"stopped\""));
    // start, then SIGHUP (it used to kill the holder silently): the
    // holder goes on holding; then SIGTERM.
    run_ok(g.holder(&["start"]));
    g.wait_holder("holding again", |s| {
        s.contains("\"held_bytes\": 2147483648")
    });
    // SAFETY: signalling our own child.
    unsafe { libc::kill(h.child.id() as i32, libc::SIGHUP) };
    std::thread::sleep(Duration::from_millis(300));
    g.wait_holder("holding after SIGHUP", |s| {
        s.contains("\"held_bytes\": 2147483648")
    });
    let mut child = {
        let mut h = h;
        std::mem::replace(&mut h.child, Command::new("true").spawn().unwrap())
    };
    // SAFETY: signalling our own child.
    unsafe { libc::kill(child.id() as i32, libc::SIGTERM) };
    assert!(child.wait().unwrap().success());
    assert_eq!(
        device_free(&g).0,
        device_free(&g).1,
        "memory left after SIGTERM"
    );
    // Scheduler shutdown: the holder lets go.
    let _h = start_holder(&g, &["--hold-mem", "2GiB"]);
    g.wait_holder("holding its memory", |s| {
        s.contains("\"held_bytes\": 2147483648")
    });
    run_ok({
        let mut c = Command::new(gemini_tests::bin("gem-schd"));
        c.arg("shutdown").arg("--ipc-dir").arg(g.ipc());
        c
    });
    g.wait_holder("released after scheduler shutdown", |s| {
        s.contains("\"held_bytes\": 0")
    });
    assert_eq!(device_free(&g).0, device_free(&g).1);
    g.kill_scheduler();
}

#[test]
fn restart_applies_new_settings_and_bad_ones_are_refused() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let _h = start_holder(&g, &["--hold-util", "0.3", "--hold-mem", "1GiB"]);
    run_ok(g.holder(&["restart", "--hold-util", "0.8", "--hold-mem", "2GiB"]));
    g.wait_holder("holding with the new settings", |s| {
        s.contains("\"hold_util\": 0.8") && s.contains("\"held_bytes\": 2147483648")
    });
    // Out of range, not a number, or past f64 (which JSON would carry as
    // null, "keep the current value": `restart` used to report success).
    for (flag, bad) in [
        ("--hold-util", "2"),
        ("--hold-util", "NaN"),
        ("--wait-minutes", "1e400"),
        ("--max-kernel-ms", "inf"),
    ] {
        let out = g.holder(&["restart", flag, bad]).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{flag} {bad} accepted");
        assert!(
            err.contains(flag) && err.contains("expected a number"),
            "{flag} {bad}: {err}"
        );
    }
    let status = run_ok(g.holder(&["status"]));
    let text = String::from_utf8_lossy(&status.stdout);
    assert!(
        text.contains("hold-util 0.80") && text.contains("hold-mem 2.0 GiB"),
        "the settings changed or are shown raw: {text}"
    );
    let out = g.holder(&["run"]).output().unwrap();
    assert!(!out.status.success(), "a second holder must not start");
    assert!(String::from_utf8_lossy(&out.stderr).contains("already running"));
}

/// `run` refuses a device listed twice (it held device 0 twice) or one the
/// driver does not have, in words rather than the driver's error; says
/// when no scheduler answers instead of "holding 2 device(s)"; and names
/// a missing IPC directory instead of "No such file or directory".
#[test]
fn the_holder_refuses_bad_devices_and_says_what_it_waits_for() {
    let g = Gemini::start(SimEnv::new(2, "16GiB"), "[a]\n");
    // Each refusal with its exit status, as `--help` lists them: 1 for
    // invalid settings, 3 for no holder, 4 for any other failure.
    let refused = |args: &[&str], expected: &str, code: i32| {
        let out = g.holder(args).output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{args:?}: {err}");
        assert!(err.contains(expected), "{args:?}: {err}");
        assert!(!err.contains("DriverError"), "{args:?}: {err}");
    };
    refused(
        &["run", "--devices", "0,0"],
        "--devices lists device 0 twice",
        1,
    );
    refused(
        &["run", "--devices", "1,5"],
        "there is no device 5; the driver reports 2 device(s), numbered 0 to 1",
        1,
    );
    let missing = g.sim.path().join("no-such-dir");
    refused(
        &["--ipc-dir", missing.to_str().unwrap(), "run"],
        "does not exist: start gem-schd first",
        4,
    );
    refused(
        &["--ipc-dir", missing.to_str().unwrap(), "status"],
        "no gem-holder answers",
        3,
    );
    let help = g.holder(&["--help"]).output().unwrap();
    let help = String::from_utf8_lossy(&help.stdout);
    assert!(
        help.contains("Exit status:") && help.contains("3  no gem-holder answers"),
        "{help}"
    );

    // No scheduler in this directory: the holder says so and holds nothing.
    let alone = g.sim.path().join("alone");
    std::fs::create_dir(&alone).unwrap();
    let dir = alone.to_str().unwrap();
    let child = g
        .holder(&["--ipc-dir", dir, "run", "--wait-minutes", "0"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    while !alone.join("holder.sock").exists() {
        assert!(
            std::time::Instant::now() < deadline,
            "the holder never opened its control socket"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // The control loop starts after the check of the scheduler, so the
    // shutdown is answered after its line is written.
    run_ok(g.holder(&["--ipc-dir", dir, "shutdown"]));
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("watching device(s) 0, 1") && err.contains("no scheduler answers yet"),
        "{err}"
    );
    assert!(!err.contains("holding 2 device(s)"), "{err}");
}
