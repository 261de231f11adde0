//! Shares in virtual time: MinUtil, MaxUtil, lent tokens, token lengths.

use super::*;

#[test]
fn entitlement_helper_is_water_filling() {
    let e = entitlements(&[(0.1, 1.0), (0.6, 1.0)]);
    assert!(
        (e[0] - 0.4).abs() < 1e-6 && (e[1] - 0.6).abs() < 1e-6,
        "{e:?}"
    );
    let e = entitlements(&[(0.0, 0.2), (0.0, 0.3)]);
    assert!(
        (e[0] - 0.2).abs() < 1e-6 && (e[1] - 0.3).abs() < 1e-6,
        "{e:?}"
    );
}

#[test]
fn two_groups_reach_their_entitlements() {
    check_shares(&[(0.3, 1.0), (0.7, 1.0)]);
    check_shares(&[(0.2, 1.0), (0.3, 1.0)]);
    check_shares(&[(0.1, 1.0), (0.6, 1.0)]);
    check_shares(&[(0.0, 0.3), (0.0, 1.0)]);
    check_shares(&[(0.0, 0.25), (0.0, 0.5)]);
}

#[test]
fn three_groups_reach_their_entitlements() {
    check_shares(&[(0.2, 1.0), (0.3, 1.0), (0.5, 1.0)]);
    check_shares(&[(0.1, 0.2), (0.1, 1.0), (0.0, 1.0)]);
    check_shares(&[(0.5, 0.6), (0.0, 0.1), (0.0, 1.0)]);
}

#[test]
fn four_groups_reach_their_entitlements() {
    check_shares(&[(0.1, 1.0), (0.2, 1.0), (0.3, 1.0), (0.4, 1.0)]);
    check_shares(&[(0.0, 0.1), (0.25, 0.5), (0.0, 1.0), (0.05, 0.15)]);
    check_shares(&[(0.0, 1.0), (0.0, 1.0), (0.0, 1.0), (0.0, 1.0)]);
}

/// When hand-overs leave the device idle a little, the minimums cannot all
/// be met: the groups fall short by about as many points each (the
/// guarantee is in points of device time), not in proportion to their
/// minimums, which left the large group 2.3 points short.
#[test]
fn groups_short_of_their_minimums_fall_short_alike() {
    for mins in [&[0.3, 0.7][..], &[0.2, 0.3, 0.5], &[0.1, 0.2, 0.3, 0.4]] {
        let mut text = String::new();
        for (i, min) in mins.iter().enumerate() {
            text += &format!("[g{i}]\nMinUtil={min}\nMaxUtil=1\n");
        }
        let mut sim = Sim::new(&text);
        // 1 ms idle per 30 ms token: the device is busy 96.8 %.
        sim.wake = MS;
        for i in 0..mins.len() {
            sim.add(&format!("g{i}"), Demand::Saturating);
        }
        sim.run_until(30 * SEC);
        let short: Vec<f64> = mins
            .iter()
            .enumerate()
            .map(|(i, min)| min - sim.group_share(&format!("g{i}"), 20 * SEC, 30 * SEC))
            .collect();
        let total: f64 = short.iter().sum();
        assert!((0.02..0.05).contains(&total), "{mins:?}: short {short:?}");
        for s in &short {
            assert!(
                (s - total / mins.len() as f64).abs() <= 0.005,
                "{mins:?}: short {short:?}"
            );
        }
    }
}

#[test]
fn lone_group_is_capped_at_max_util() {
    let mut sim = Sim::new("[a]\nMaxUtil=0.4\n");
    sim.add("a", Demand::Saturating);
    sim.run_until(20 * SEC);
    for start in [0, 5 * SEC, 10 * SEC] {
        let got = sim.group_share("a", start, start + 10 * SEC);
        assert!((got - 0.4).abs() <= 0.02, "window at {start}: {got}");
    }
    // The cap is smooth, not a burst followed by a long stall: every
    // second gets its share.
    for s in 1..20 {
        let got = sim.group_share("a", s * SEC, (s + 1) * SEC);
        assert!((got - 0.4).abs() <= 0.05, "second {s}: {got}");
    }
}

/// A program that waits after each batch of kernels reports its token's
/// work in several spans, charged in one go: its `MaxUtil` credit earned
/// while it held the token counts for all of them. Charged span by span,
/// the credit earned was cut at the cap with the first span, and a lone
/// group capped at 0.8 got 0.57 of the device (`gem-bench --only
/// shapes`, 20 x 1 ms kernels and a wait).
#[test]
fn a_capped_group_reporting_several_spans_per_token_gets_its_cap() {
    for max in [0.4, 0.8] {
        let mut sim = Sim::new(&format!("[a]\nMaxUtil={max}\n"));
        // Greedy: its predicted burst grows, and its tokens reach the
        // longest quota, as a program's that never pauses do.
        let a = sim.add("a", Demand::Greedy);
        sim.clients[a].pieces = 5;
        sim.run_until(20 * SEC);
        let got = sim.group_share("a", 5 * SEC, 15 * SEC);
        assert!((got - max).abs() <= 0.02, "MaxUtil {max}: {got}");
    }
}

#[test]
fn lone_group_without_cap_runs_back_to_back() {
    let mut sim = Sim::new("[a]\nMinUtil=0.1\n");
    sim.add("a", Demand::Saturating);
    sim.run_until(10 * SEC);
    let got = sim.group_share("a", 0, 10 * SEC);
    assert!(got >= 0.97, "{got}");
}

#[test]
fn idle_group_leaves_its_share_to_others() {
    let mut sim = Sim::new("[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n");
    sim.add("a", Demand::Saturating);
    sim.add("b", Demand::Until(10 * SEC));
    sim.run_until(25 * SEC);
    let (a, b) = (
        sim.group_share("a", 0, 10 * SEC),
        sim.group_share("b", 0, 10 * SEC),
    );
    assert!(
        (a - 0.5).abs() <= 0.02 && (b - 0.5).abs() <= 0.02,
        "{a} {b}"
    );
    let a = sim.group_share("a", 11 * SEC, 25 * SEC);
    assert!(a >= 0.97, "after b left, a got {a}");
}

#[test]
fn processes_of_one_group_share_its_entitlement() {
    let mut sim = Sim::new("[a]\nMinUtil=0.5\n[b]\nMinUtil=0.5\n");
    sim.add("a", Demand::Saturating);
    sim.add("a", Demand::Saturating);
    sim.add("a", Demand::Saturating);
    sim.add("b", Demand::Saturating);
    sim.run_until(30 * SEC);
    let (a, b) = (
        sim.group_share("a", 20 * SEC, 30 * SEC),
        sim.group_share("b", 20 * SEC, 30 * SEC),
    );
    assert!(
        (a - 0.5).abs() <= 0.02 && (b - 0.5).abs() <= 0.02,
        "{a} {b}"
    );
    // Within the group, the processes take turns.
    for c in sim.clients.iter().filter(|c| c.group == "a") {
        let own: Micros = c
            .busy
            .iter()
            .map(|&(s, e)| e.min(30 * SEC).saturating_sub(s.max(20 * SEC)))
            .sum();
        let share = own as f64 / (10 * SEC) as f64;
        assert!(
            (share - 0.5 / 3.0).abs() <= 0.03,
            "process {} got {share}",
            c.id
        );
    }
}

#[test]
fn bursty_group_gets_its_minimum_when_it_asks() {
    // A group that needs 40 % at bursts of 20 ms every 30 ms competes with a
    // saturating one; its minimum is 0.4, so it must get all it asks for.
    let mut sim = Sim::new("[a]\nMinUtil=0.4\n[b]\nMinUtil=0.1\n");
    sim.add(
        "a",
        Demand::Bursty {
            burst: 20 * MS,
            gap: 30 * MS,
        },
    );
    sim.add("b", Demand::Saturating);
    sim.run_until(20 * SEC);
    let a = sim.group_share("a", 10 * SEC, 20 * SEC);
    let b = sim.group_share("b", 10 * SEC, 20 * SEC);
    assert!(a >= 0.3, "a got {a}");
    assert!(a + b >= 0.97, "device idle: a {a} b {b}");
}

#[test]
fn group_owed_time_waits_one_short_token_when_it_comes_back() {
    // A group below its MinUtil that idles between bursts (20 ms of work,
    // 50 ms away: it asks for 0.29) must not find the device taken by a
    // long token each time it returns: while it is away, the others get
    // short tokens, and it gets nearly all it asks for.
    let mut sim = Sim::new("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n");
    sim.add(
        "hi",
        Demand::Bursty {
            burst: 20 * MS,
            gap: 50 * MS,
        },
    );
    let lo_client = sim.add("lo", Demand::Greedy);
    sim.run_until(20 * SEC);
    let hi = sim.group_share("hi", 10 * SEC, 20 * SEC);
    let lo = sim.group_share("lo", 10 * SEC, 20 * SEC);
    assert!(hi >= 0.25, "hi got {hi}, asks 0.29");
    assert!(hi + lo >= 0.97, "device idle: hi {hi} lo {lo}");
    // The short tokens are marked lent, so the hook keeps lo's queued work
    // within them: one per 10 ms of each of hi's 50 ms gaps, about.
    let lent = &sim.clients[lo_client].lent;
    let min_quota = Params::default().min_quota;
    assert!(lent.len() >= 1000, "{} lent tokens", lent.len());
    assert!(lent.iter().all(|&q| q <= min_quota), "{lent:?}");
    assert!(sim.clients[0].lent.is_empty(), "hi is never lent to");
}

#[test]
fn a_pause_is_not_owed_time() {
    // hi (MinUtil 0.7) and lo (no MinUtil) both saturate; hi stops asking
    // for a second. Back, it is owed the gaps of its bursts but not the
    // pause: lo keeps its 0.3 instead of waiting the seconds hi would need
    // to make its share of the window 0.7 again, and hi has its 0.7 of
    // the time it asks.
    for (lo_max, pause) in [(0.3, SEC), (1.0, 3 * SEC)] {
        let mut sim = Sim::new(&format!("[hi]\nMinUtil=0.7\n[lo]\nMaxUtil={lo_max}\n"));
        sim.add(
            "hi",
            Demand::Paused {
                from: 5 * SEC,
                to: 5 * SEC + pause,
            },
        );
        sim.add("lo", Demand::Saturating);
        let back = 5 * SEC + pause;
        sim.run_until(back + 4 * SEC);
        let lo = sim.group_share("lo", back + 200 * MS, back + SEC);
        let hi = sim.group_share("hi", back, back + 4 * SEC);
        assert!(
            lo >= 0.25,
            "pause {pause} us: lo got {lo:.3} of the second after hi came back"
        );
        assert!((hi - 0.7).abs() <= 0.02, "pause {pause} us: hi got {hi:.3}");
        // While hi was away the device was lo's, up to its MaxUtil.
        let alone = sim.group_share("lo", 5 * SEC + 200 * MS, back);
        assert!(
            alone >= lo_max - 0.02,
            "pause {pause} us: lo alone got {alone:.3}"
        );
    }
}

#[test]
fn lent_tokens_end_about_when_the_owed_group_comes_back() {
    // hi works 20 ms and is away `gap` (it asks for 20 / (20 + gap) and is
    // owed it, MinUtil 0.7). The device is lent to lo while hi is away, in
    // tokens that end about when hi usually returns, so hi does not wait
    // for the rest of a full short token each time.
    for gap in [1, 3, 5, 10, 15, 25] {
        let mut sim = Sim::new("[hi]\nMinUtil=0.7\n[lo]\nMinUtil=0.3\n");
        sim.add(
            "hi",
            Demand::Bursty {
                burst: 20 * MS,
                gap: gap * MS,
            },
        );
        sim.add("lo", Demand::Greedy);
        sim.run_until(20 * SEC);
        let hi = sim.group_share("hi", 10 * SEC, 20 * SEC);
        let lo = sim.group_share("lo", 10 * SEC, 20 * SEC);
        // Owed what it asks for, up to its MinUtil.
        let owed = (20.0 / (20 + gap) as f64).min(0.7);
        assert!(
            hi >= owed - 0.02,
            "gap {gap} ms: hi got {hi:.3}, owed {owed:.3}"
        );
        assert!(
            hi + lo >= 0.97,
            "gap {gap} ms: device idle: hi {hi:.3} lo {lo:.3}"
        );
    }
}

#[test]
fn quota_follows_predicted_burst_within_bounds() {
    let params = Params {
        window: 10 * SEC,
        base_quota: 30 * MS,
        min_quota: 10 * MS,
        max_quota: 100 * MS,
        grace: SEC,
        devices: 1,
        ..Params::default()
    };
    let mut p = Policy::new(params, config("[a]\n"));
    let hello = Request::Hello {
        role: Role::Client,
        group: "a".into(),
        pid: 1,
        held: vec![],
        job: None,
        build: gemini_protocol::BUILD.into(),
    };
    p.handle(
        Event::Request {
            client: 1,
            seq: 0,
            req: hello,
        },
        0,
    );
    let mut quota_for = |burst, now| {
        let req = Request::AcquireToken {
            device: 0,
            ran: vec![],
            in_flight: false,
            burst_us: burst,
            rtt_us: RTT as u32,
            launch_us: 0,
        };
        match p
            .handle(
                Event::Request {
                    client: 1,
                    seq: 1,
                    req,
                },
                now,
            )
            .as_slice()
        {
            [
                Action::Reply {
                    reply: Reply::Token { quota_us, .. },
                    ..
                },
            ] => *quota_us,
            other => panic!("{other:?}"),
        }
    };
    assert_eq!(quota_for(0, 0), 30 * MS);
    assert_eq!(quota_for(25 * MS, 1), 25 * MS);
    assert_eq!(quota_for(1, 2), 10 * MS);
    assert_eq!(quota_for(10 * SEC, 3), 100 * MS);
}

/// Most a capped group used of any `len` window of `[from, to)`, the
/// windows starting every 50 ms.
fn most_in_any_window(sim: &Sim, group: &str, len: Micros, from: Micros, to: Micros) -> f64 {
    (from..=to - len)
        .step_by(50 * MS as usize)
        .map(|s| sim.group_share(group, s, s + len))
        .fold(0.0, f64::max)
}

#[test]
fn a_capped_group_never_passes_its_cap_in_a_window_of_seconds() {
    // MaxUtil is a ceiling over any stretch of time a user looks at, not
    // only on average: over the bench's 6 s windows, a capped group gets at
    // most its cap plus the credit it may save and the debt a token may
    // take it into (0.83 pp with the defaults; it was 2 pp before these
    // two were bounded).
    let capped = [
        Demand::Saturating,
        Demand::Greedy,
        Demand::Bursty {
            burst: 20 * MS,
            gap: 0,
        },
        Demand::Bursty {
            burst: 19 * MS,
            gap: 10 * MS,
        },
    ];
    let p = Params::default();
    let slack = (p.saved_credit() + p.overdraft()) as f64 / (6 * SEC) as f64;
    assert!(slack <= 0.0084, "{slack}");
    let mut missed = vec![];
    for max in [0.2f64, 0.4, 0.8] {
        for demand in capped {
            for beside in [None, Some(Demand::Greedy), Some(Demand::Saturating)] {
                let mut sim = Sim::new(&format!("[c]\nMaxUtil={max}\n[u]\n"));
                sim.add("c", demand);
                if let Some(d) = beside {
                    sim.add("u", d);
                }
                sim.run_until(40 * SEC);
                let most = most_in_any_window(&sim, "c", 6 * SEC, 4 * SEC, 40 * SEC);
                let whole = sim.group_share("c", 4 * SEC, 40 * SEC);
                let asks = match demand {
                    Demand::Bursty { burst, gap } => burst as f64 / (burst + gap) as f64,
                    _ => 1.0,
                };
                let want = match beside {
                    None => max.min(asks),
                    Some(_) => entitlements(&[(0.0, max.min(asks)), (0.0, 1.0)])[0],
                };
                let other = sim.group_share("u", 4 * SEC, 40 * SEC);
                if most > max + slack
                    || (whole - want).abs() > 0.02
                    || (beside.is_some() && whole + other < 0.97)
                {
                    missed.push(format!(
                        "MaxUtil {max}, {demand:?} beside {beside:?}: {most:.4} in a 6 s window, \
                         {whole:.4} over 36 s (entitled {want:.3}), the other {other:.4}"
                    ));
                }
            }
        }
    }
    assert!(missed.is_empty(), "{}", missed.join("\n"));
}

#[test]
fn a_capped_group_uses_the_gaps_of_an_uncapped_one() {
    // Both work 19 ms and then compute 10 ms on the CPU (a data loader):
    // alone, each keeps the device busy 0.655 of the time. The capped
    // group's 0.4 fits in the uncapped group's gaps and the time it
    // waits, so the uncapped group is owed the other 0.6.
    let bursty = Demand::Bursty {
        burst: 19 * MS,
        gap: 10 * MS,
    };
    let mut sim = Sim::new("[c]\nMaxUtil=0.4\n[u]\n");
    sim.add("c", bursty);
    sim.add("u", bursty);
    sim.run_until(30 * SEC);
    let c = sim.group_share("c", 10 * SEC, 30 * SEC);
    let u = sim.group_share("u", 10 * SEC, 30 * SEC);
    assert!((c - 0.4).abs() <= 0.02, "capped got {c:.3}");
    assert!(u >= 0.58, "uncapped got {u:.3} (capped {c:.3})");
}

#[test]
fn a_group_that_waits_after_every_step_gets_as_much_as_one_that_never_waits() {
    // No bounds: equal shares. One program waits for its work after every
    // 20 ms step and asks again at once; the other queues as deep as it
    // may (its hook predicts long bursts). The first used to come back to
    // find the other holding a 100 ms token each time, and got 1/6; the
    // other's tokens are now lent while it is between steps.
    for gap in [0, 2 * MS] {
        let mut sim = Sim::new("[step]\n[deep]\n");
        sim.add(
            "step",
            Demand::Bursty {
                burst: 20 * MS,
                gap,
            },
        );
        sim.add("deep", Demand::Greedy);
        sim.run_until(20 * SEC);
        let step = sim.group_share("step", 5 * SEC, 20 * SEC);
        let deep = sim.group_share("deep", 5 * SEC, 20 * SEC);
        let asks = 20.0 / (20 * MS + gap) as f64 * MS as f64;
        let want = asks.min(0.5);
        assert!(
            (step - want).abs() <= 0.02 && step + deep >= 0.97,
            "gap {gap} us: step {step:.3} (owed {want:.3}), deep {deep:.3}"
        );
    }
}

/// `status` never shows a capped group's SHARE above its `MaxUtil` by
/// more than the documented bound: the credit it may save and overdraw
/// (5 × `min_quota`) over the GPU's span, at every second of a run,
/// beside an uncapped group and alone.
#[test]
fn status_shows_a_capped_share_within_its_documented_bound() {
    for text in ["[c]\nMaxUtil=0.4\n", "[c]\nMaxUtil=0.4\n[u]\n"] {
        let mut sim = Sim::new(text);
        sim.add("c", Demand::Saturating);
        if text.contains("[u]") {
            sim.add("u", Demand::Saturating);
        }
        let min_quota = Params::default().min_quota;
        for s in 1..=20 {
            sim.run_until(s * SEC);
            let st = sim.policy.status(sim.now);
            let d = &st.devices[0];
            let share = share_on_0(&st, "c");
            let bound = 0.4 + (5 * min_quota) as f64 / d.span_us as f64;
            assert!(
                share <= bound + 1e-9,
                "{text:?} at {s} s: {share:.4} > {bound:.4}"
            );
            let sum: f64 = d.groups.iter().map(|g| g.share).sum();
            assert!(sum <= d.busy + 1e-9 && d.busy <= 1.0 + 1e-9, "{d:?}");
            // And it gets its cap.
            if s >= 2 {
                assert!(share >= 0.38, "{text:?} at {s} s: {share:.4}");
            }
        }
    }
}

/// A group whose launches are long and cannot be split (a CUDA graph's
/// replay of 21 ms, admitted whole onto an empty queue) beside an eager
/// group that gives the device back for a moment between its 20 ms steps
/// (its hook goes quiet after each wait): each moment must not hand the
/// long launch the device, or the eager group waits 21 ms for each of its
/// steps and the two split the device 0.5/0.5 whatever their MinUtil
/// (seen in 2 of 13 runs on an independent simulator).
#[test]
fn an_unsplittable_launch_is_not_lent_the_gaps_of_a_group_owed_time() {
    let mut sim = Sim::new("[low]\nMinUtil=0.3\n[high]\nMinUtil=0.7\n");
    sim.add("low", Demand::Kernels(21 * MS));
    sim.add(
        "high",
        Demand::Bursty {
            burst: 20 * MS,
            gap: 200,
        },
    );
    sim.run_until(12 * SEC);
    let (from, to) = (2 * SEC, 12 * SEC);
    let (l, h) = (
        sim.group_share("low", from, to),
        sim.group_share("high", from, to),
    );
    assert!(
        (l - 0.3).abs() <= 0.03 && (h - 0.7).abs() <= 0.03,
        "low {l:.3}, high {h:.3}: want 0.3/0.7"
    );
}

/// An eager group above its MinUtil whose last ordinary token ran past
/// its end (its queue drained a little late, as it does) is still lent
/// the gap of a group below its MinUtil: a launch's length is learned
/// from a lent token it overran, not from any overrun. (Read from every
/// overrun, a 10.5 ms token made the eager group look like one of long
/// launches, and the device was held idle at every return.)
#[test]
fn an_overrun_ordinary_token_does_not_make_a_group_wait_for_returns() {
    let mut p = Policy::new(Params::default(), config("[eager]\n[owed]\nMinUtil=0.7\n"));
    hello(&mut p, 1, "eager");
    hello(&mut p, 2, "owed");
    // The owed group runs 20 ms and leaves for 0.2 ms, twice: its return
    // is learned.
    let mut now = 0;
    for _ in 0..2 {
        send(&mut p, 2, acquire(), now);
        now += 20 * MS;
        send(&mut p, 2, release_ran(now - 20 * MS, now), now);
        now += 200;
    }
    // The eager group's ordinary token (the device free) overran by
    // 0.5 ms.
    let r = send(&mut p, 1, acquire(), now);
    let (_, quota, lent) = token(&r).expect("granted");
    assert!(!lent && quota > 10 * MS, "an ordinary token: {r:?}");
    send(&mut p, 2, acquire(), now);
    let start = now;
    now += quota + 500;
    send(&mut p, 1, release_ran(start, now), now);
    // The owed group takes its turn and leaves again; the eager group
    // asks meanwhile: lent the gap, not held.
    now += 20 * MS;
    send(&mut p, 2, release_ran(now - 20 * MS, now), now);
    let r = send(&mut p, 1, acquire(), now + 10);
    assert!(
        token(&r).is_some_and(|t| t.0 == 1),
        "the eager group was kept waiting: {r:?}"
    );
}
