//! `make demo`, the README's first command, runs through: every workload
//! succeeds and every group gets device time in each step (a step whose
//! workloads failed showed 0.000 and still exited 0 before).

use gemini_tests::bin;
use gemini_tests::cpu::serial;
use std::process::Command;

#[test]
fn the_demo_runs_every_step() {
    let _serial = serial();
    let conf = concat!(env!("CARGO_MANIFEST_DIR"), "/../examples/resource.conf");
    // The demo's steps, shortened (`make demo` runs 10 s ones).
    let out = Command::new(bin("gem-demo"))
        .arg(conf)
        .args(["--seconds", "3"])
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "gem-demo failed: {text}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for step in ["\n1. ", "\n2. ", "\n3. ", "\n4. "] {
        assert!(text.contains(step), "step{step}missing:\n{text}");
    }
    // The README shows what the demo prints: the same steps, in order
    // (their lengths masked: this run's are shorter), and the same
    // sections of the status.
    let readme = include_str!("../../../README.md");
    let block = readme
        .split("```text\n1. ")
        .nth(1)
        .and_then(|b| b.split("\n```").next())
        .map(|b| format!("1. {b}"))
        .expect("README.md shows the demo's output in a text block");
    let shape = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| {
                l.starts_with(|c: char| c.is_ascii_digit())
                    || l.starts_with("GROUP")
                    || l.starts_with("DEVICE")
                    || l.contains("program(s)")
            })
            .map(|l| {
                // The heading, with its figures masked.
                let l = l.split("  busy").next().unwrap_or(l);
                let mut masked = String::new();
                for c in l.chars() {
                    if c.is_ascii_digit() || (c == '.' && masked.ends_with('#')) {
                        if !masked.ends_with('#') {
                            masked.push('#');
                        }
                    } else {
                        masked.push(c);
                    }
                }
                masked.split_whitespace().collect::<Vec<_>>().join(" ")
            })
            .collect()
    };
    let printed = text
        .split_once("\n1. ")
        .map(|(_, t)| format!("1. {t}"))
        .unwrap();
    assert_eq!(
        shape(&block),
        shape(&printed),
        "README.md's demo block is not what make demo prints:\n{printed}"
    );
    // Every achieved share (the 4th column of a group's row) is positive.
    let steps = text.split("\n4. ").next().unwrap();
    let rows: Vec<f64> = steps
        .lines()
        .filter(|l| l.starts_with("  train") || l.starts_with("  notebook"))
        .map(|l| l.split_whitespace().nth(3).unwrap().parse().unwrap())
        .collect();
    assert_eq!(rows.len(), 5, "{text}");
    // A step whose workload failed shows 0.000; a host that takes most of
    // the CPU can push a working step's share down to 0.05 (seen once in
    // `make test`), so "nothing" is below 0.01.
    assert!(
        rows.iter().all(|s| *s > 0.01),
        "a group got nothing: {rows:?}\n{text}"
    );
}

/// `gem-demo --help` explains (it used to panic, taking `--help` for a
/// file), and a config it cannot use is one line and exit 1.
#[test]
fn the_demo_has_help_and_clear_errors() {
    let out = Command::new(bin("gem-demo"))
        .arg("--help")
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && text.contains("Usage: gem-demo [OPTIONS] [CONFIG]")
            && text.contains("--seconds <SECONDS>"),
        "{text}"
    );
    let out = Command::new(bin("gem-demo"))
        .arg("/nonexistent.conf")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent.conf: No such file"), "{err}");
}

/// `gem-bench --chart` (`make chart`, the README's picture) runs its
/// scenario and writes an SVG with each group's measured share and its
/// entitlement, and the events marked.
#[test]
fn the_chart_is_drawn_from_a_run() {
    let _serial = serial();
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shares.svg");
    let out = Command::new(bin("gem-bench"))
        .arg("--chart")
        .arg(&path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "gem-bench --chart failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let svg = std::fs::read_to_string(&path).unwrap();
    assert!(
        svg.starts_with("<svg") || svg.starts_with("<?xml"),
        "{svg:.200}"
    );
    for label in [
        "group a: measured",
        "group b: entitled",
        "b leaves",
        "resource.conf: 0.6 / 0.4",
    ] {
        assert!(svg.contains(label), "no {label:?} in the chart");
    }
    // Four series: two measured, two entitled.
    assert!(svg.matches("<polyline").count() >= 4, "{svg:.400}");
    // The table row: mean shares for each phase; a alone got most of it.
    let text = String::from_utf8_lossy(&out.stdout);
    let row = text
        .lines()
        .find(|l| l.starts_with("| chart of a run"))
        .unwrap_or_else(|| panic!("no chart row:\n{text}"));
    let alone: f64 = row
        .split(" · ")
        .nth(1)
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .parse()
        .unwrap();
    assert!(alone > 0.5, "a alone got {alone}: {row}");
}

/// The README's tour on the simulator runs as printed: its block, but
/// `make release` (the test's own build stands in for it), through bash
/// in a fresh directory for the simulator, from the repository's root.
#[test]
fn the_readme_s_tour_on_the_simulator_runs_as_printed() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let readme = std::fs::read_to_string(root.join("README.md")).unwrap();
    let block = readme
        .split("<!-- tour-on-the-simulator -->")
        .nth(1)
        .and_then(|rest| rest.split("```sh\n").nth(1))
        .and_then(|rest| rest.split("```").next())
        .expect("the README has the tour's block");
    let script: String = block
        .lines()
        .filter(|l| !l.starts_with("make "))
        .map(|l| format!("{l}\n"))
        .collect();
    assert!(script.contains("gem-schd status"), "{script}");
    let dir = tempfile::tempdir().unwrap();
    // Bounded: a hang here would hold the whole suite (a program whose
    // scheduler went waits for it, by default for ever).
    let out = Command::new("timeout")
        .args(["120", "bash", "-euo", "pipefail", "-c", &script])
        .env("GEMINI_CONNECT_TIMEOUT", "20s")
        .current_dir(&root)
        .env(
            "GEMINI_BIN_DIR",
            gemini_tests::bin("gem-schd").parent().unwrap(),
        )
        .env("GEMINI_SIM_DIR", dir.path())
        .env_remove("GEMINI_IPC_DIR")
        .env_remove("GEMINI_GROUP_NAME")
        .env_remove("LD_PRELOAD")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for want in ["train", "notebook", "DEVICE 0"] {
        assert!(
            stdout.contains(want),
            "{want:?} missing from the status:\n{stdout}"
        );
    }
}
