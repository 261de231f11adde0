//! `make test-gpu`'s suite, where there is no GPU: it must say so and
//! succeed, so CI and every GPU-less machine can run it.

use std::path::Path;
use std::process::Command;

#[test]
fn gpu_suite_skips_cleanly_without_a_gpu() {
    let has_gpu = Command::new("nvidia-smi")
        .arg("-L")
        .output()
        .is_ok_and(|o| o.status.success());
    if has_gpu {
        eprintln!("an NVIDIA GPU is present: this test is about machines without one");
        return;
    }
    let suite = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu/gpu_suite.py");
    let out_file = tempfile::tempdir().unwrap();
    let out = Command::new("python3")
        .arg(&suite)
        .arg(out_file.path().join("r.md"))
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "no NVIDIA GPU found, skipped"
    );
    assert!(
        !out_file.path().join("r.md").exists(),
        "wrote results without a GPU"
    );
}

/// The suite's own logic, with fake rows: rows are independent, a failure
/// that also happens without gemini is the row's own, the report carries
/// both runs, and only gemini's failures count.
#[test]
fn gpu_suite_judges_rows_against_their_runs_without_gemini() {
    let logic = Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu/test_suite_logic.py");
    let out = Command::new("python3")
        .arg(&logic)
        .output()
        .expect("python3");
    assert!(
        out.status.success(),
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}
