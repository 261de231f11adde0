//! `gem-schd top` in a real terminal: tmux runs it in 80×24 while two
//! groups share the simulated device, and what tmux shows (capture-pane)
//! has both groups and their shares; `q` ends it.

use gemini_tests::{Gemini, SimEnv, bin};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

fn tmux(socket: &str, args: &[&str]) -> std::process::Output {
    Command::new("tmux")
        .arg("-L")
        .arg(socket)
        .args(args)
        .output()
        .unwrap()
}

/// The share `top` shows on the line of `group` (its first `NN%`).
fn shown_share(screen: &str, group: &str) -> Option<f64> {
    let line = screen.lines().find(|l| l.trim_start().starts_with(group))?;
    let pct = line
        .split_whitespace()
        .find(|w| w.ends_with('%') && w.trim_end_matches('%').parse::<f64>().is_ok())?;
    Some(pct.trim_end_matches('%').parse::<f64>().ok()? / 100.0)
}

#[test]
fn top_shows_the_groups_and_their_shares_in_an_80_by_24_terminal() {
    let ok = Command::new("tmux")
        .arg("-V")
        .stdout(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!(
            "gem-schd top in a terminal: NOT CHECKED: tmux is not installed (apt-get install tmux)"
        );
        return;
    }
    let g = Gemini::start(
        SimEnv::default(),
        "[train]\nMinUtil=0.3\nMemoryLimit=4GiB\n[serve]\nMinUtil=0.7\n",
    );
    let spawn = |group: &str| {
        let mut c = g.hooked(g.sim.workload(), group);
        c.args(["--seconds", "6", "--kernel-us", "1000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        c.spawn().unwrap()
    };
    let workloads = [spawn("train"), spawn("serve")];
    g.wait_status(5.0, "both groups running", |s| s.clients.len() == 2);
    let socket = format!("gemtop-{}", std::process::id());
    let cmd = format!(
        "GEMINI_SETTINGS=/dev/null {} top --ipc-dir {}",
        bin("gem-schd").display(),
        g.ipc().display()
    );
    let out = tmux(
        &socket,
        &[
            "new-session",
            "-d",
            "-x",
            "80",
            "-y",
            "24",
            "-s",
            "top",
            &cmd,
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // A few refreshes, so the shares have settled and the sparklines grown.
    std::thread::sleep(Duration::from_secs(3));
    let screen =
        String::from_utf8_lossy(&tmux(&socket, &["capture-pane", "-p", "-t", "top"]).stdout)
            .into_owned();
    let _ = tmux(&socket, &["send-keys", "-t", "top", "q"]);
    let deadline = Instant::now() + Duration::from_secs(3);
    while tmux(&socket, &["has-session", "-t", "top"])
        .status
        .success()
    {
        if Instant::now() > deadline {
            let _ = tmux(&socket, &["kill-server"]);
            panic!("gem-schd top did not quit on q:\n{screen}");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    for mut w in workloads {
        let _ = w.wait();
    }
    assert!(
        screen.contains("gem-schd top") && screen.contains("GPU 0"),
        "{screen}"
    );
    assert!(
        screen.lines().all(|l| l.chars().count() <= 80),
        "wider than 80 columns:\n{screen}"
    );
    let (train, serve) = (
        shown_share(&screen, "train").unwrap_or_else(|| panic!("no train line:\n{screen}")),
        shown_share(&screen, "serve").unwrap_or_else(|| panic!("no serve line:\n{screen}")),
    );
    assert!(
        screen.contains("30-100%") && screen.contains("/4.0G"),
        "{screen}"
    );
    assert!(
        train > 0.0 && serve > train,
        "train {train}, serve {serve}:\n{screen}"
    );
}

/// Without a terminal (a pipe, cron, CI), `top` ends with one clear line
/// and a failure exit, not a panic and a backtrace; `status --watch` into
/// a file writes the reports one after another, with no screen-clearing
/// escape codes.
#[test]
fn without_a_terminal_top_says_so_and_watch_writes_plain_reports() {
    let g = Gemini::start(SimEnv::default(), "[a]\n");
    let out = Command::new(bin("gem-schd"))
        .args(["top", "--ipc-dir"])
        .arg(g.ipc())
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Not a configuration error (1): another failure (4).
    assert_eq!(out.status.code(), Some(4), "{err}");
    assert!(err.contains("top needs a terminal"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    let mut watch = Command::new(bin("gem-schd"))
        .args(["status", "--watch", "0.2", "--ipc-dir"])
        .arg(g.ipc())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(700));
    let _ = watch.kill();
    let out = watch.wait_with_output().unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(text.matches("GROUP").count() >= 2, "{text}");
    assert!(!text.contains('\u{1b}'), "escape codes in {text:?}");
}
