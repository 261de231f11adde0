//! Time-sliced devices (`FAKECUDA_TIMESLICE_US`): the work of different
//! processes shares the device in slices of about 2 ms, a kernel is
//! preempted at its slice's end, and a spinning collective takes its
//! slices, as on a real GPU. Checked on the device's busy log.

use super::{SEC, pids, run};
use fakecuda_log::{Kind, Record};
use gemini_tests::{SimEnv, field, now_ns, reports};
use std::process::Stdio;
use std::time::Duration;

const MS: u64 = 1_000_000;
/// The longest slice: nominal 2 ms, give or take a quarter.
const SLICE_MAX: u64 = 2_500_000;

fn of(recs: &[Record], pid: u32) -> Vec<Record> {
    recs.iter().filter(|r| r.pid == pid).copied().collect()
}

fn total(recs: &[Record]) -> u64 {
    recs.iter().map(|r| r.end - r.start).sum()
}

/// `(start, end)` of each step from a workload's `--demand-file`.
fn steps(path: &std::path::Path) -> Vec<(u64, u64)> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut w = l.split_whitespace().map(|v| v.parse::<u64>().ok());
            Some((w.next()??, w.next()??))
        })
        .collect()
}

/// A process launching a 10 µs kernel now and then beside one that keeps
/// the device busy with 20 ms kernels waits for the running slice, not
/// for the other's queue: in the busy log, the long kernels are cut into
/// pieces of at most a slice where the short ones come, lose no time,
/// and between a short step's start and its kernel the other process ran
/// at most a slice (launch order would make it wait out the whole queue,
/// 16 × 20 ms).
#[test]
fn a_short_kernel_waits_for_a_slice_not_for_the_other_process_s_queue() {
    let mut sim = SimEnv::new(1, "1GiB").time_sliced();
    sim.queue_depth = 16;
    let mut long = sim.workload();
    long.args(["--seconds", "1.5", "--kernel-us", "20000"])
        .stdout(Stdio::piped());
    let long = long.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(300));
    let demand = sim.path().join("short-steps");
    let mut short = sim.workload();
    short.args([
        "--seconds",
        "0.8",
        "--iter-kernels",
        "1",
        "--kernel-us",
        "10",
        "--gap-ms",
        "5",
        "--demand-file",
    ]);
    short.arg(&demand);
    let short = run(short);
    let long = long.wait_with_output().unwrap();
    assert!(long.status.success());
    let (lp, sp) = (pids(&[&long])[0], pids(&[&short])[0]);
    let kernels = field(&reports(&long.stdout)[0], "kernels") as u64;
    let recs = fakecuda_log::read(&sim.sim_dir(), 0).unwrap();
    let (lr, sr) = (of(&recs, lp), of(&recs, sp));
    assert_eq!(
        total(&lr),
        kernels * 20 * MS,
        "the long kernels ran exactly their time, in {} pieces",
        lr.len()
    );
    assert!(
        lr.len() as u64 > kernels + 20,
        "{} pieces of {kernels} long kernels: they were not preempted",
        lr.len()
    );
    for s in &sr {
        assert_eq!(
            s.end - s.start,
            10_000,
            "a short kernel ran in pieces: {s:?}"
        );
    }
    let mut waited: Vec<u64> = steps(&demand)
        .iter()
        .filter_map(|&(start, end)| {
            let first = sr.iter().find(|r| r.start >= start && r.end <= end)?;
            let other: u64 = lr
                .iter()
                .map(|l| l.end.min(first.start).saturating_sub(l.start.max(start)))
                .sum();
            Some(other)
        })
        .collect();
    assert!(waited.len() >= 20, "only {} short steps", waited.len());
    waited.sort_unstable();
    let median = waited[waited.len() / 2];
    assert!(
        median <= SLICE_MAX,
        "a short step's kernel waited behind {} ms of the other's at the median",
        median / MS
    );
}

/// A killed process's queued work never runs on a time-sliced device
/// either: its records end by the time the next process's work runs, and
/// it ran no more than it had time to while alive.
#[test]
fn a_killed_process_s_queue_never_runs_on_a_time_sliced_device() {
    let mut sim = SimEnv::new(1, "1GiB").time_sliced();
    sim.queue_depth = 200;
    let mut c = sim.workload();
    c.args(["--seconds", "30", "--kernel-us", "20000"])
        .stdout(Stdio::null());
    let t0 = now_ns();
    let mut child = c.spawn().unwrap();
    std::thread::sleep(Duration::from_millis(500));
    let dead = child.id();
    child.kill().unwrap();
    child.wait().unwrap();
    let killed_at = now_ns();
    // The next process only finds the queue dead after a look's period.
    std::thread::sleep(Duration::from_millis(20));
    let mut next = sim.workload();
    next.args([
        "--seconds",
        "0.001",
        "--iter-kernels",
        "1",
        "--kernel-us",
        "1000",
    ]);
    let after = pids(&[&run(next)])[0];
    let recs = fakecuda_log::read(&sim.sim_dir(), 0).unwrap();
    let first_after = of(&recs, after)
        .iter()
        .map(|r| r.start)
        .min()
        .expect("the next process's kernel is logged");
    let dead_recs = of(&recs, dead);
    let dead_end = dead_recs.iter().map(|r| r.end).max().unwrap_or(0);
    assert!(
        dead_end <= first_after,
        "the killed process's work ends {} ms after the next one's starts",
        (dead_end - first_after) / MS
    );
    assert!(
        total(&dead_recs) <= killed_at - t0,
        "the killed process ran {} ms in the {} ms it lived",
        total(&dead_recs) / MS,
        (killed_at - t0) / MS
    );
    assert!(
        first_after < killed_at + SEC,
        "the next process waited {} ms",
        (first_after - killed_at) / MS
    );
}

/// A collective waits for its peer rank spinning on the device, as NCCL's
/// kernels do: it is logged as the device's work while it waits, and a
/// third process on the same device gets only its slices meanwhile; the
/// collective ends once the peer's has started.
#[test]
fn a_collective_spins_on_the_device_until_its_peer_starts() {
    let sim = SimEnv::new(2, "1GiB").time_sliced();
    let rank = |r: u32| {
        let mut c = sim.workload();
        c.args([
            "--device",
            &r.to_string(),
            "--seconds",
            "0.001",
            "--iter-kernels",
            "1",
            "--kernel-us",
            "100",
            "--allreduce",
            &format!("7:2:{r}"),
            "--allreduce-us",
            "100",
        ])
        .stdout(Stdio::piped());
        c
    };
    let mut other = sim.workload();
    other
        // Busy past the peer's start, however slowly the ranks start.
        .args(["--seconds", "3", "--kernel-us", "1000"])
        .stdout(Stdio::piped());
    let other = other.spawn().unwrap();
    let r0 = rank(0).spawn().unwrap();
    std::thread::sleep(Duration::from_millis(400));
    let r1 = rank(1).spawn().unwrap();
    let (o0, o1, oo) = (
        r0.wait_with_output().unwrap(),
        r1.wait_with_output().unwrap(),
        other.wait_with_output().unwrap(),
    );
    assert!(o0.status.success() && o1.status.success() && oo.status.success());
    let (p0, po) = (pids(&[&o0])[0], pids(&[&oo])[0]);
    let recs = fakecuda_log::read(&sim.sim_dir(), 0).unwrap();
    let spun: Vec<Record> = of(&recs, p0)
        .into_iter()
        .filter(|r| r.kind == Kind::Collective as u32)
        .collect();
    assert!(
        total(&spun) >= 100 * MS,
        "rank 0's collective spun {} ms on its device in the 400 ms its peer was away",
        total(&spun) / MS
    );
    // While it spun: from its first piece to its last (the device's
    // clock, not the test's).
    let from = spun.iter().map(|r| r.start).min().unwrap_or(0);
    let to = spun.iter().map(|r| r.end).max().unwrap_or(0);
    let window = gemini_tests::busy(&recs, from, to);
    let share = window.share(po);
    assert!(
        (0.3..=0.7).contains(&share),
        "the third process had {share:.2} of the device beside the spinning collective"
    );
}
