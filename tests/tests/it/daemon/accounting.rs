//! The accounting log gem-schd appends to, and `gem-schd report` over it.

use super::*;
use crate::metrics::workload;

fn report(g: &Gemini, args: &[&str]) -> std::process::Output {
    g.sim
        .command(schd_bin())
        .arg("report")
        .arg("--ipc-dir")
        .arg(g.ipc())
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn report_gives_each_groups_gpu_time_as_the_device_ran_it_across_a_restart() {
    let mut g = Gemini::start(SimEnv::default(), "[a]\nMinUtil=0.3\n[b]\nMinUtil=0.7\n");
    let t0 = gemini_tests::now_ns();
    let (a, b) = (workload(&g, "a", "10"), workload(&g, "b", "10"));
    let pids = [("a", a.id()), ("b", b.id())];
    std::thread::sleep(Duration::from_millis(5000));
    // An upgrade in the middle: the log goes on where it was.
    g.shutdown_scheduler();
    g.start_scheduler();
    for mut c in [a, b] {
        let out = c.wait().unwrap();
        assert!(out.success());
    }
    let busy = g.sim.busy(0, t0, gemini_tests::now_ns());
    g.shutdown_scheduler();
    let out = report(&g, &["--since", "1h", "--json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let doc: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ran = |pid: u32| busy.per_pid.get(&pid).copied().unwrap_or(0) as f64 / 1e9;
    eprintln!(
        "ran: a {:.4} s, b {:.4} s; report: {}",
        ran(pids[0].1),
        ran(pids[1].1),
        doc["rows"]
    );
    for (group, pid) in pids {
        let ran = busy.per_pid.get(&pid).copied().unwrap_or(0) as f64 / 1e9;
        let row = doc["rows"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["group"] == group)
            .unwrap_or_else(|| panic!("no row of {group}: {doc}"));
        let reported = row["gpu_seconds"].as_f64().unwrap();
        assert!(
            ran > 0.5 && (reported - ran).abs() <= 0.01 * ran,
            "{group}: {reported:.4} s reported, {ran:.4} s ran on the simulator"
        );
        // One program, though it said hello to both schedulers.
        assert_eq!(row["programs"], 1, "{doc}");
    }
    // The log holds each scheduler's start and stop, and each program's
    // start (twice: once to each) and end.
    let log = std::fs::read_to_string(g.ipc().join("accounting.jsonl")).unwrap()
        + &std::fs::read_to_string(g.ipc().join("accounting.events.jsonl")).unwrap();
    let count = |event: &str| {
        log.lines()
            .filter(|l| l.contains(&format!("\"event\":\"{event}\"")))
            .count()
    };
    assert_eq!(
        [
            count("start"),
            count("stop"),
            count("program_start"),
            count("program_end")
        ],
        [2, 2, 4, 2],
        "{log}"
    );
    // By user: the same time, all of it this test's user's.
    let out = report(&g, &["--since", "1h", "--by", "user"]);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success() && text.contains("USER"), "{text}");
}

#[test]
fn report_says_what_is_wrong_with_its_arguments_or_its_log() {
    let g = Gemini::start_with(SimEnv::default(), "[a]\n", &["--accounting", "off"]);
    let out = report(&g, &["--since", "last week"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.code() == Some(2) && err.contains("--since"),
        "{err}"
    );
    let out = report(&g, &[]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && err.contains("no accounting log"),
        "accounting off, nothing written: {err}"
    );
    let out = report(&g, &["--since", "1d", "--until", "2d"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("must come after --since"), "{err}");
}
