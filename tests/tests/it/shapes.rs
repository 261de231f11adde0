//! MinUtil for the programs real users run: one process per group that
//! queues a step's kernels and then waits for them (a synchronisation, a
//! blocking copy back to the host, an event), and programs idle between
//! steps. Shares come from the simulator's busy log, as parts of the time
//! the device worked, which must be at least 90 %. Tolerances leave room
//! for a loaded 2-core machine; `make bench` measures the full matrix of
//! shapes against ±2 pp of the whole time.

use gemini_tests::cpu::{MAX_STEAL, measured, serial, unstarved};
use gemini_tests::{
    BLOCKING_COPY_STEP, GAPPED_STEP, Gemini, LONG_KERNELS_STEP, SYNC_EVERY_KERNEL, Scenario,
    SimEnv, TRAINING_STEP, TWO_THREADS_EVENTS, field, now_ns, reports,
};
use std::process::Stdio;

const SEC: u64 = 1_000_000_000;
const TOL: f64 = 0.05;
/// How long each scenario runs, and the part measured (the first two
/// seconds left out while the shares settle).
const RUN_S: u64 = 6;
const SKIP_S: u64 = 2;

fn min_util_holds(args: &[&str]) {
    min_util_holds_below(args, MAX_STEAL);
}

/// [`min_util_holds`], counted only where the host took at most
/// `max_steal` of the CPU time.
fn min_util_holds_below(args: &[&str], max_steal: f64) {
    let _serial = serial();
    let scenario = Scenario {
        groups: &[(0.3, 1.0), (0.7, 1.0)],
        procs: 1,
        args,
        seconds: RUN_S as f64,
        skip: SKIP_S as f64,
    };
    let Some(o) = unstarved(&format!("{args:?}"), max_steal, 2, || scenario.run()) else {
        return;
    };
    // The split of the time the device worked: what MinUtil decides. The
    // time it idled at hand-overs (longer in this debug build on a loaded
    // VM: a CI run once measured 0.279 / 0.641, device 0.92, for a sync
    // after every kernel) is bounded below; `make bench` holds both to
    // their targets in a release build.
    let used = o.busy.max(f64::EPSILON);
    let (lo, hi) = (o.got[0] / used, o.got[1] / used);
    let ok = (lo - 0.3).abs() <= TOL && (hi - 0.7).abs() <= TOL;
    assert!(
        ok,
        "{args:?}: shares {:.3} / {:.3} of a device busy {:.3} ({lo:.3} / {hi:.3} of its work), want 0.30 / 0.70 ± {TOL} of its work",
        o.got[0], o.got[1], o.busy
    );
    assert!(o.busy >= 0.90, "{args:?}: device busy {:.3}", o.busy);
}

/// The reported bug: 20 kernels then cuCtxSynchronize gave 0.49 / 0.49.
#[test]
fn one_process_per_group_that_synchronises_every_step_gets_its_min_util() {
    min_util_holds(TRAINING_STEP);
}

/// `loss.item()`: a blocking copy back to the host, through the `_ptds`
/// variant a per-thread-default-stream program resolves by name.
#[test]
fn a_blocking_copy_back_to_the_host_is_not_idle() {
    min_util_holds(&[
        "--iter-kernels",
        "20",
        "--kernel-us",
        "1000",
        "--wait",
        "copy",
        "--ptsz",
        "--resolve",
        "dlsym",
    ]);
}

/// Latency-bound inference: one 1 ms kernel, then cuStreamSynchronize,
/// again and again. The process waits far more often than it launches.
/// Every kernel costs it a wake-up, which a host taking the CPU stretches
/// (at 12 % steal lo got 0.253), so it counts only at 5 % steal or less.
#[test]
fn a_sync_after_every_kernel_is_not_idle() {
    min_util_holds_below(SYNC_EVERY_KERNEL, 0.05);
}

/// Two launching threads on streams of their own, each waiting on an
/// event it recorded.
#[test]
fn threads_waiting_on_events_of_their_own_streams_are_not_idle() {
    min_util_holds(TWO_THREADS_EVENTS);
}

/// Runs a training-step process in group `lo` (MinUtil 0.3) and one in
/// `hi` (MinUtil 0.7) that goes quiet for `hi_gap_ms` after every step, RUN_S
/// each; returns their pids and the time of the seconds SKIP_S to RUN_S measured.
fn lo_and_gapped_hi(g: &Gemini, hi_gap_ms: &str) -> (u32, u32, u64, u64) {
    lo_slowed_and_gapped_hi(g, hi_gap_ms, &[])
}

/// [`lo_and_gapped_hi`], lo's process with the simulator settings
/// `lo_env` (its waits woken late, its launches stalled: a process
/// descheduled on a loaded host).
fn lo_slowed_and_gapped_hi(
    g: &Gemini,
    hi_gap_ms: &str,
    lo_env: &[(&str, &str)],
) -> (u32, u32, u64, u64) {
    let t0 = now_ns();
    let spawn = |group: &str, extra: &[&str]| {
        let mut c = g.hooked(g.sim.workload(), group);
        if group == "lo" {
            c.envs(lo_env.iter().copied());
        }
        c.args(["--seconds", &RUN_S.to_string()])
            .args(TRAINING_STEP)
            .args(extra)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        c.spawn().unwrap()
    };
    let (lo, hi) = (spawn("lo", &[]), spawn("hi", &["--gap-ms", hi_gap_ms]));
    let (lo, hi) = (
        lo.wait_with_output().unwrap(),
        hi.wait_with_output().unwrap(),
    );
    assert!(lo.status.success() && hi.status.success());
    let pid = |o: &std::process::Output| field(&reports(&o.stdout)[0], "pid") as u32;
    (pid(&lo), pid(&hi), t0 + SKIP_S * SEC, t0 + RUN_S * SEC)
}

/// A process doing CPU work between its steps (50 ms after every 20 ms
/// step) is idle then: the device goes to the other group at once, not
/// after GEMINI_IDLE_MS of holding it idle, and the idle group, owed time,
/// finds the device lent in short tokens when it comes back.
#[test]
fn a_process_idle_between_steps_gives_the_device_away() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default(), "[lo]\nMinUtil=0.3\n[hi]\nMinUtil=0.7\n");
    let run = || {
        let (lo, hi, from, to) = lo_and_gapped_hi(&g, "50");
        let busy = g.sim.busy(0, from, to);
        // Every hand-over from hi, going quiet after its step, to lo: how
        // long the device stood idle in between.
        let mut recs = fakecuda_log::read(&g.sim.sim_dir(), 0).unwrap();
        recs.retain(|r| r.start >= from && r.end <= to);
        recs.sort_by_key(|r| r.start);
        let mut handovers: Vec<u64> = recs
            .windows(2)
            .filter(|w| w[0].pid == hi && w[1].pid == lo)
            .map(|w| w[1].start.saturating_sub(w[0].end))
            .collect();
        handovers.sort_unstable();
        (
            busy.share(lo),
            busy.share(hi),
            busy.device_share(),
            handovers,
        )
    };
    let Some((s_lo, s_hi, device, handovers)) = unstarved("idle between steps", MAX_STEAL, 2, run)
    else {
        return;
    };
    // hi asks for 20 / 70 of the device and is owed it (MinUtil 0.7).
    // Coming back it waits at most one short token lent to lo, which
    // keeps its queued work within the token: at least 20 / 80. (With
    // lo's long tokens it got 0.16; with short ones and lo's whole 20 ms
    // step queued under them, 0.20-0.23.)
    assert!(
        s_hi >= 0.24,
        "the idle-between-steps group got {s_hi:.3}, asks ~0.28"
    );
    // hi gives the device away as its wait returns, not after holding it
    // idle for GEMINI_IDLE_MS (5 ms; the device was 0.77 busy then): the
    // usual hand-over costs a round trip. The median, because a host that
    // deschedules a vCPU stretches single hand-overs to 10 ms and more;
    // the 97 % busy target is measured by `make bench`.
    assert!(handovers.len() >= 40, "{} hand-overs", handovers.len());
    let median = handovers[handovers.len() / 2];
    eprintln!(
        "hand-over from the idle group: median {} us; device busy {device:.3}",
        median / 1000
    );
    assert!(
        median < 2_500_000,
        "hand-over median {} us (lo {s_lo:.3}, hi {s_hi:.3}, device {device:.3}): \
         the idle process kept the device",
        median / 1000
    );
}

/// The hand-overs of `a_process_idle_between_steps_gives_the_device_away`
/// where lo's waits wake 1 ms after its work ended (descheduled on a
/// loaded host) and hi's at once: each group is charged what its kernels
/// ran. Spans ended at the host's proof overlapped hi's first kernels by
/// the wake-up, the ledger gave that time to the span that began first,
/// and hi, handed the device, was charged up to a millisecond less per
/// hand-over (its kernels ran 1700 ms, it was charged 1664-1693 ms on a
/// loaded CPU).
#[test]
fn a_late_wakeup_does_not_take_the_next_groups_time() {
    charged_as_run(SimEnv::default(), &[("FAKECUDA_WAKEUP_US", "1000")]);
}

/// The hand-overs of `a_process_idle_between_steps_gives_the_device_away`
/// where lo's thread takes every third of its tokens 8 ms after gem-schd
/// granted it (descheduled between the reply and its taking, as on a
/// loaded host): a token taken that late counts from when it could have
/// been taken (a round trip after it was asked, gem-schd's holding and a
/// millisecond), not from its taking, and one already over as it is
/// taken is asked for again, so that no launch goes long after its
/// token's end. (Counted from its taking, a token
/// admitted launches up to 8 ms into the next group's: in a full test
/// run one reached the device among hi's kernels, its span stayed open
/// through hi's 20 ms step, and hi, whose kernels ran 1700 ms, was
/// charged 1684 ms. With a token over as it was taken letting the launch
/// that asked go, that launch queued among hi's kernels, and its span,
/// within hi's, took 16 ms of hi's step: hi was charged 1580-1624 ms for
/// 1680.)
#[test]
fn a_token_taken_late_admits_nothing_after_its_end() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::default(), "[lo]\nMinUtil=0.3\n[hi]\nMinUtil=0.7\n");
    let lo_env = [(gemini_protocol::env::TEST_TAKE_DELAY_US, "3:8000")];
    lo_slowed_and_gapped_hi(&g, "50", &lo_env);
    let (grants, spans) = tokens_and_spans(&g.log(), "lo");
    assert!(
        grants.len() >= 50 && spans.len() >= 50,
        "{grants:?} {spans:?}"
    );
    // Every span of lo's that began more than 2 ms (the hook's slack, and
    // the log's times against the grant's) after the end
    // of the last token granted before it: its start, the token's end and
    // quota (µs). A few may on a loaded host, descheduled past a second
    // grant's end, or after its deadline's check and before the span
    // opened; without the fix, or either half of it, 59-86 of 549-599
    // did.
    let late: Vec<(u64, u64, u64)> = spans
        .iter()
        .filter_map(|&start| {
            let &(at, quota) = grants.iter().rev().find(|&&(at, _)| at <= start)?;
            (start > at + quota + 2_000).then_some((start, at + quota, quota))
        })
        .collect();
    eprintln!(
        "{} of {} spans began after their token's end",
        late.len(),
        spans.len()
    );
    assert!(
        late.len() * 50 <= spans.len(),
        "{} of {} spans began after their token's end: {late:?}",
        late.len(),
        spans.len()
    );
    each_charged_what_it_ran(&mut g, "lo taking its tokens late");
}

/// What gem-schd's debug log `log` says of `group`'s tokens: each grant
/// (µs on `CLOCK_MONOTONIC`, as the log's wall-clock time of the reply
/// says, and its quota in µs), and where each span it reported began.
fn tokens_and_spans(log: &str, group: &str) -> (Vec<(u64, u64)>, Vec<u64>) {
    // The log's time of day (UTC) against the monotonic clock, read now.
    let wall = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap();
    let day_us = 86_400_000_000_i64;
    let now_us = now_ns() as i64 / 1000;
    let offset = now_us - (wall.as_micros() as i64).rem_euclid(day_us);
    let to_mono = |line: &str| -> Option<u64> {
        // "2026-11-30T07:00:51.259278Z ..."
        let (h, rest) = line.get(11..26)?.split_once(':')?;
        let (m, s) = rest.split_once(':')?;
        let tod = (h.parse::<f64>().ok()? * 3600.0
            + m.parse::<f64>().ok()? * 60.0
            + s.parse::<f64>().ok()?)
            * 1e6;
        // (A run over midnight: the day before.)
        let mut mono = tod as i64 + offset;
        if mono > now_us {
            mono -= day_us;
        }
        Some(mono as u64)
    };
    let number = |text: &str, key: &str| -> Option<u64> {
        let at = text.find(key)? + key.len();
        let digits: String = text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    };
    let mut clients = Vec::new();
    let (mut grants, mut spans) = (Vec::new(), Vec::new());
    for line in log.lines() {
        if line.contains(" joined: pid ") && line.ends_with(&format!("group {group:?}")) {
            clients.extend(number(line, "client "));
            continue;
        }
        let Some(client) = number(line, "daemon: client ") else {
            continue;
        };
        if !clients.contains(&client) {
            continue;
        }
        if line.contains(" <- Token { ") {
            grants.extend(to_mono(line).zip(number(line, "quota_us: ")));
        } else {
            spans.extend(
                line.split("Span { start_us: ")
                    .skip(1)
                    .filter_map(|s| number(s, "")),
            );
        }
    }
    (grants, spans)
}

/// Two groups that each go idle for 10 ms after every 20 ms step, where
/// every 7th of lo's launches takes 10 ms before its work is queued (its
/// thread descheduled) and each of hi's 0.9 ms (a launch at CPU pace):
/// one on its way as lo's lent token ends reaches the device long after.
/// No group's kernels run uncharged. (Seen under load in a full test
/// run, where such a launch landed among hi's kernels: lo's span from
/// its late work's start to that launch's end, reported as run, began
/// before hi's and took 18 ms of hi's 20 ms step; not reproduced here,
/// where the launch mostly lands after hi's step, whose span then lies
/// within lo's and keeps its time. lo is charged the time its stalls
/// held the device, inside its spans: about twice what its kernels ran.)
#[test]
fn a_launch_stalled_past_its_tokens_end_takes_no_other_groups_time() {
    let _serial = serial();
    let mut g = Gemini::start(SimEnv::default(), "[lo]\nMinUtil=0.3\n[hi]\nMinUtil=0.7\n");
    let spawn = |group: &str, env: &[(&str, &str)]| {
        let mut c = g.hooked(g.sim.workload(), group);
        c.args(["--seconds", "2"])
            .args(GAPPED_STEP)
            .envs(env.iter().copied())
            .stdout(Stdio::null());
        c.spawn().unwrap()
    };
    let mut lo = spawn("lo", &[("FAKECUDA_LAUNCH_STALL", "7:10000")]);
    let mut hi = spawn("hi", &[("FAKECUDA_LAUNCH_STALL", "1:900")]);
    assert!(lo.wait().unwrap().success() && hi.wait().unwrap().success());
    each_charged_what_it_ran(&mut g, "lo's launches stalled");
}

/// The same hand-overs on a device that time-slices processes, where
/// lo's work always queues behind its own (the simulator runs a
/// process's streams in one queue): the device clock's calibration
/// mostly fails there, and a failed one must leave the last good one as
/// it was (re-recorded in place, it moved by the time since, and lo's
/// kernels ran 4040 ms, charged 3657 ms).
#[test]
fn each_group_is_charged_what_it_ran_on_a_time_sliced_device() {
    charged_as_run(SimEnv::default().time_sliced(), &[]);
}

/// Each group's charge against what its kernels ran, in the hand-overs of
/// [`lo_slowed_and_gapped_hi`] on `sim`, lo's process with `lo_env` (see
/// [`each_charged_what_it_ran`]).
fn charged_as_run(sim: SimEnv, lo_env: &[(&str, &str)]) {
    let _serial = serial();
    let mut g = Gemini::start(sim, "[lo]\nMinUtil=0.3\n[hi]\nMinUtil=0.7\n");
    lo_slowed_and_gapped_hi(&g, "50", lo_env);
    each_charged_what_it_ran(&mut g, &format!("lo with {lo_env:?}"));
}

/// Each group's charge against what its kernels ran, once gem-schd
/// stopped: not less, beyond 5 ms and 0.5 % (the check every test makes,
/// asserted here whatever the host took); `what`: the case, said.
fn each_charged_what_it_ran(g: &mut Gemini, what: &str) {
    assert!(g.stop_scheduler(), "gem-schd did not stop");
    let accounts = g.device_accounts().expect("the scheduler's charges");
    eprintln!("accounts, {what}: {accounts:?}");
    let mut groups: Vec<&str> = accounts.iter().map(|a| a.group.as_str()).collect();
    groups.sort_unstable();
    assert_eq!(groups, ["hi", "lo"], "each group ran and was charged");
    for a in &accounts {
        let (ran, charged) = (a.ran_ns as f64 / 1e6, a.charged_ns as f64 / 1e6);
        assert!(
            charged >= ran - 5.0 - ran * 0.005,
            "group {} ran {ran:.1} ms, charged {charged:.1} ms",
            a.group
        );
    }
}

/// A group owed time that goes quiet for 10 ms after every 20 ms step
/// (it asks for 2/3 of the device, and MinUtil 0.7 owes it all of that)
/// against one that never stops. While it is away the device is lent in
/// tokens that end about when it usually comes back, and the borrower
/// queues no more work than fits in them: coming back, it finds the
/// device at once instead of behind a whole step of the other group's
/// (hi got 0.47-0.49 before, 0.61-0.64 after, at 0-11 % steal).
#[test]
fn a_group_back_from_a_short_gap_finds_the_device_at_once() {
    let _serial = serial();
    let g = Gemini::start(SimEnv::default(), "[lo]\nMinUtil=0.3\n[hi]\nMinUtil=0.7\n");
    let run = || {
        let (lo, hi, from, to) = lo_and_gapped_hi(&g, "10");
        let busy = g.sim.busy(0, from, to);
        (busy.share(lo), busy.share(hi), busy.device_share())
    };
    let Some((s_lo, s_hi, device)) = unstarved("back from a short gap", MAX_STEAL, 2, run) else {
        return;
    };
    eprintln!("lo {s_lo:.3}, hi {s_hi:.3}, device {device:.3}");
    assert!(
        s_hi >= 0.56,
        "the group back from its 10 ms gaps got {s_hi:.3} (lo {s_lo:.3}), asks ~0.66"
    );
    // Lending must not leave the device idle (holding it through the
    // gaps gave 0.77); hand-overs cost round trips on a loaded VM.
    assert!(device >= 0.85, "device busy {device:.3}");
}

/// Runs at once, for `RUN_S`, a hooked workload with each `(device,
/// args)` of `runs` on that device, in group `g{device}`; each device's
/// share of its busy log from `SKIP_S` on.
fn one_group_per_device(g: &Gemini, runs: &[(usize, &[&str])]) -> Vec<(usize, f64)> {
    let t0 = now_ns();
    let children: Vec<_> = runs
        .iter()
        .map(|&(i, args)| {
            let mut c = g.hooked(g.sim.workload(), &format!("g{i}"));
            c.args(["--seconds", &RUN_S.to_string(), "--device", &i.to_string()])
                .args(args)
                .stdout(Stdio::null())
                .stderr(Stdio::piped());
            c.spawn().unwrap()
        })
        .collect();
    for c in children {
        let out = c.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    runs.iter()
        .map(|&(d, _)| {
            let busy = g.sim.busy(d as u32, t0 + SKIP_S * SEC, t0 + RUN_S * SEC);
            (d, busy.device_share())
        })
        .collect()
}

/// The shapes (a)-(f), one per device, each a lone group capped at
/// MaxUtil 0.4 for RUN_S (the devices are independent: five shapes run at
/// once; (c), a sync after every kernel, which a busy CPU's late wake-ups
/// slow, runs alone after them): each gets its cap, measured over the
/// seconds SKIP_S to RUN_S, and never more. Over the cap means not gated, starved or
/// not; under it counts only where the host left the machine its CPU (for
/// (c), as for its MinUtil twin, at 5 % steal or less).
#[test]
fn max_util_holds_for_every_shape() {
    const CAP: f64 = 0.4;
    let shapes: [(&str, &[&str]); 6] = [
        ("(a) a training step", TRAINING_STEP),
        ("(b) a blocking copy back", BLOCKING_COPY_STEP),
        ("(c) a sync after every kernel", SYNC_EVERY_KERNEL),
        ("(d) 10 ms of CPU work after every step", GAPPED_STEP),
        ("(e) 20 ms kernels", LONG_KERNELS_STEP),
        ("(f) two threads on their own streams", TWO_THREADS_EVENTS),
    ];
    let _serial = serial();
    let conf: String = (0..shapes.len())
        .map(|i| format!("[g{i}]\nMaxUtil={CAP}\nDevices={i}\n"))
        .collect();
    let g = Gemini::start(SimEnv::new(shapes.len() as u32, "16GiB"), &conf);
    let run = |batch: &[usize]| {
        let runs: Vec<(usize, &[&str])> = batch.iter().map(|&i| (i, shapes[i].1)).collect();
        one_group_per_device(&g, &runs)
    };
    let (mut got, counts) = measured("MaxUtil 0.4, five shapes at once", MAX_STEAL, 2, || {
        run(&[0, 1, 3, 4, 5])
    });
    let (sync, sync_counts) = measured("MaxUtil 0.4, a sync after every kernel", 0.05, 2, || {
        run(&[2])
    });
    let counted: Vec<(usize, f64, bool)> = got
        .drain(..)
        .map(|(d, s)| (d, s, counts))
        .chain(sync.into_iter().map(|(d, s)| (d, s, sync_counts)))
        .collect();
    for &(d, share, counts) in &counted {
        let name = shapes[d].0;
        assert!(
            share <= CAP + TOL,
            "{name}: {share:.3} of the device, over its {CAP} cap"
        );
        if counts {
            assert!(
                share >= CAP - TOL,
                "{name}: {share:.3} of the device under a {CAP} cap (all: {counted:?})"
            );
        }
    }
}

/// A lone group capped at MaxUtil 0.4 that waits after every 1 ms
/// kernel, on a host that wakes each wait 300 µs after its kernel ended
/// (a blocking-sync context, a loaded CPU), one group per device for
/// each way of waiting: a stream's synchronisation, the context's, an
/// event's, a blocking copy. The wake-up is not the device's time, and
/// each group gets its cap (0.398 in a quiet run). Charged to them, as
/// when spans ended on the host's clock, they got 0.287-0.289.
#[test]
fn a_late_wakeup_is_not_charged_as_device_time() {
    const CAP: f64 = 0.4;
    const WAITS: [&str; 4] = ["stream", "ctx", "event", "copy"];
    let _serial = serial();
    let conf: String = (0..WAITS.len())
        .map(|i| format!("[g{i}]\nMaxUtil={CAP}\nDevices={i}\n"))
        .collect();
    let mut g = Gemini::start(
        SimEnv::new(WAITS.len() as u32, "16GiB").slow_wakeup(300),
        &conf,
    );
    let args: Vec<[&str; 6]> = WAITS
        .iter()
        .map(|wait| ["--iter-kernels", "1", "--kernel-us", "1000", "--wait", wait])
        .collect();
    let run = || {
        let runs: Vec<(usize, &[&str])> =
            args.iter().enumerate().map(|(i, a)| (i, &a[..])).collect();
        one_group_per_device(&g, &runs)
            .into_iter()
            .map(|(_, share)| share)
            .collect::<Vec<f64>>()
    };
    let (shares, counts) = measured(
        "MaxUtil 0.4, 300 us wake-ups, four ways of waiting",
        0.05,
        2,
        run,
    );
    eprintln!("capped groups with 300 us wake-ups ({WAITS:?}): {shares:.3?}");
    for (wait, share) in WAITS.iter().zip(shares) {
        assert!(
            share <= CAP + TOL,
            "{wait}: {share:.3} of the device, over its {CAP} cap"
        );
        if counts {
            assert!(
                share >= CAP - TOL,
                "{wait}: {share:.3} of the device under a {CAP} cap: the wake-ups were charged"
            );
        }
    }
    // What each group was charged against what its kernels ran, over the
    // whole run: a 300 µs wake-up after each 1 ms kernel, charged, would
    // make it 1.3 times as much.
    assert!(g.stop_scheduler(), "gem-schd did not stop");
    for a in g.device_accounts().expect("the scheduler's charges") {
        let ratio = a.charged_ns as f64 / a.ran_ns.max(1) as f64;
        eprintln!("group {}: charged / ran {ratio:.3}", a.group);
        assert!(
            ratio <= 1.1,
            "group {} ({}): charged {:.1} ms for {:.1} ms its kernels ran: the wake-ups were charged",
            a.group,
            WAITS[a.device as usize],
            a.charged_ns as f64 / 1e6,
            a.ran_ns as f64 / 1e6
        );
    }
}

/// Two groups whose programs compute 10 ms on the CPU after every 20 ms
/// step (each alone keeps the device 0.66 busy), one capped at MaxUtil
/// 0.4 and one without bounds: the capped group gets its cap and never
/// more, and spends it while the other is between its steps, so that the
/// other gets most of the rest. (The capped group used to go first
/// whenever it had credit, and spent it while the other waited: the
/// uncapped group got 0.43-0.47 of the 0.6 it is owed, the device 0.83
/// busy; now 0.58, in `make bench`.)
#[test]
fn a_capped_group_leaves_an_uncapped_one_its_share_between_steps() {
    let _serial = serial();
    let scenario = Scenario {
        groups: &[(0.0, 0.4), (0.0, 1.0)],
        procs: 1,
        args: GAPPED_STEP,
        seconds: RUN_S as f64,
        skip: SKIP_S as f64,
    };
    let Some(o) = unstarved("capped beside uncapped, 10 ms gaps", MAX_STEAL, 2, || {
        scenario.run()
    }) else {
        return;
    };
    eprintln!(
        "capped {:.3}, uncapped {:.3}, device {:.3}",
        o.got[0], o.got[1], o.busy
    );
    assert!(o.got[0] <= 0.4 + 0.01, "capped: {:.3}", o.got[0]);
    assert!(o.got[0] >= 0.4 - TOL, "capped: {:.3}", o.got[0]);
    assert!(
        o.got[1] >= 0.52,
        "uncapped: {:.3} (capped {:.3}, device {:.3})",
        o.got[1],
        o.got[0],
        o.busy
    );
}
