//! `gem-attack`: a hostile tenant of a shared machine, for
//! `make test-hostile`. Run as an unprivileged member of the scheduler's
//! `ipc_group`, it speaks the wire protocol by hand (any routing id, any
//! frame) and tries each attack it is given, printing one line per try:
//! `ATTACK <name> <what the scheduler answered>`. Whether an attack was
//! refused is judged by the test, from these answers and from what the
//! victims kept.

// A tool of the test suite: on failure it stops loudly, which is its job.
#![allow(clippy::expect_used, clippy::unwrap_used)]

use gemini_protocol::{GpuRequest, HeldMemory, MAX_FRAME_BYTES, Reply, Request, Role};
use gemini_tests::attack::{StatusFlood, ask, ask_raw, dealer, refused_peers};
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(clap::Parser, Debug)]
#[command(about = "Attacks a gem-schd as a hostile local user (make test-hostile)")]
struct Args {
    /// The scheduler's IPC directory
    #[arg(long)]
    ipc: PathBuf,
    /// Victims' pids (their stand-ins are spoofed, their pid claimed)
    #[arg(long, value_delimiter = ',')]
    victims: Vec<u32>,
    /// An open group the attacker may join
    #[arg(long, default_value = "open")]
    open: String,
    /// A victim's group
    #[arg(long, default_value = "victim_a")]
    victim_group: String,
    /// How long the flood lasts, seconds
    #[arg(long, default_value_t = 5.0)]
    seconds: f64,
    /// A routing id a trusted peer used and closed (reuse-id)
    #[arg(long, default_value = "")]
    reuse: String,
    /// The attacks: stand-in, admin, context-cost, held, claim-group,
    /// false-pid, reserve, release, malformed, flood
    attacks: Vec<String>,
}

/// What an answer was, in a word or two.
fn said(r: Option<Reply>) -> String {
    match r {
        None => "none".into(),
        Some(Reply::Error(e)) => format!("{:?}", e.kind),
        Some(Reply::Welcome { .. }) => "Welcome".into(),
        Some(Reply::Done) => "Done".into(),
        Some(Reply::Released { devices }) => format!("Released {devices:?}"),
        Some(Reply::Reserved { devices }) => format!("Reserved {devices:?}"),
        Some(other) => format!("{other:?}").chars().take(40).collect(),
    }
}

fn hello(role: Role, group: &str, pid: u32, held: Vec<HeldMemory>) -> Request {
    Request::Hello {
        role,
        group: group.into(),
        pid,
        held,
        job: None,
        build: gemini_protocol::BUILD.into(),
    }
}

fn report(name: &str, what: impl std::fmt::Display) {
    println!("ATTACK {name} {what}");
}

fn main() {
    let a = <Args as clap::Parser>::parse();
    let ctx = zmq::Context::new();
    let ipc = a.ipc.as_path();
    const MS: i64 = 3000;
    for attack in &a.attacks {
        match attack.as_str() {
            // Routing ids naming the stand-ins of the victims' processes
            // after a restart: their rights were the scheduler's.
            "stand-in" => {
                for pid in &a.victims {
                    for name in ["\0restored-memory:", "\0restored:", "restored-memory:"] {
                        let id = format!("{name}{pid}");
                        let s = dealer(&ctx, ipc, Some(id.as_bytes()));
                        let shown = name.replace('\0', "\\0");
                        report(
                            "stand-in-goodbye",
                            format!("{shown}{pid} {}", said(ask(&s, &Request::Goodbye, MS))),
                        );
                        report(
                            "stand-in-shutdown",
                            format!("{shown}{pid} {}", said(ask(&s, &Request::Shutdown, MS))),
                        );
                    }
                }
            }
            "admin" => {
                let s = dealer(&ctx, ipc, None);
                report("shutdown", said(ask(&s, &Request::Shutdown, MS)));
                report("reload", said(ask(&s, &Request::Reload, MS)));
            }
            "context-cost" => {
                let s = dealer(&ctx, ipc, None);
                ask(&s, &hello(Role::Control, "", 0, vec![]), MS);
                let huge = Request::ContextCost {
                    device: 0,
                    bytes: u64::MAX,
                };
                report("context-cost-control", said(ask(&s, &huge, MS)));
                let c = dealer(&ctx, ipc, None);
                ask(&c, &hello(Role::Client, &a.open, 0, vec![]), MS);
                // Memory on the device first: a context's size counts
                // from such a process only (and is clamped to it).
                let memory = Request::ReserveMemory {
                    device: 0,
                    bytes: 1 << 20,
                };
                ask(&c, &memory, MS);
                report("context-cost-client", said(ask(&c, &huge, MS)));
            }
            // A lease as large as can be asked, giving back what was
            // never leased: at most the scheduler's bound, and none of
            // anyone else's memory.
            "lease" => {
                let s = dealer(&ctx, ipc, None);
                ask(&s, &hello(Role::Client, &a.open, 0, vec![]), MS);
                let greedy = Request::ReserveLeased {
                    device: 0,
                    bytes: 1 << 20,
                    returned: u64::MAX,
                    lease: u64::MAX,
                };
                let what = match ask(&s, &greedy, MS) {
                    Some(Reply::Leased { lease, .. }) => format!("Leased {lease}"),
                    r => said(r),
                };
                report("lease", what);
                let back = Request::ReturnLease {
                    device: 0,
                    bytes: u64::MAX,
                };
                report("lease-return", said(ask(&s, &back, MS)));
            }
            "held" => {
                let s = dealer(&ctx, ipc, None);
                let held = vec![HeldMemory {
                    device: 0,
                    bytes: u64::MAX,
                }];
                report(
                    "held",
                    said(ask(&s, &hello(Role::Client, &a.open, 0, held), MS)),
                );
            }
            "claim-group" => {
                let s = dealer(&ctx, ipc, None);
                let r = ask(&s, &hello(Role::Client, &a.victim_group, 0, vec![]), MS);
                report("claim-group", said(r));
                let h = dealer(&ctx, ipc, None);
                report(
                    "holder-role",
                    said(ask(&h, &hello(Role::Holder, "", 0, vec![]), MS)),
                );
            }
            // A hello naming a victim's pid: the status says which pid
            // the scheduler took.
            "false-pid" => {
                for &pid in &a.victims {
                    let s = dealer(&ctx, ipc, None);
                    let r = ask(&s, &hello(Role::Client, &a.open, pid, vec![]), MS);
                    let taken = match (&r, ask(&s, &Request::Status, MS)) {
                        (Some(Reply::Welcome { client, .. }), Some(Reply::Status(st))) => st
                            .clients
                            .iter()
                            .find(|c| c.id == *client)
                            .map_or(0, |c| c.pid),
                        _ => 0,
                    };
                    report("false-pid", format!("{pid} {} as {taken}", said(r)));
                    ask(&s, &Request::Goodbye, MS);
                }
            }
            // The routing id of a closed connection of root's.
            "reuse-id" => {
                let s = dealer(&ctx, ipc, Some(a.reuse.as_bytes()));
                report("reuse-id-shutdown", said(ask(&s, &Request::Shutdown, MS)));
                let release = Request::ReleaseReserved { devices: vec![] };
                report("reuse-id-release", said(ask(&s, &release, MS)));
            }
            "reserve" => {
                let s = dealer(&ctx, ipc, None);
                ask(&s, &hello(Role::Control, "", 0, vec![]), MS);
                let reserve = |group: &str, gpus, days: f64| Request::ReserveFor {
                    group: group.into(),
                    gpus,
                    duration_us: (days * 86_400e6) as u64,
                    wait: false,
                };
                let month = reserve(&a.open, GpuRequest::Count(2), 30.0);
                report("reserve-month", said(ask(&s, &month, MS)));
                let all = reserve(&a.open, GpuRequest::Count(2), 0.5);
                report("reserve-every-gpu", said(ask(&s, &all, MS)));
                let theirs = reserve(&a.open, GpuRequest::Ids(vec![0]), 0.5);
                report("reserve-victims-gpu", said(ask(&s, &theirs, MS)));
                let group = reserve(&a.victim_group, GpuRequest::Count(1), 0.5);
                report("reserve-victims-group", said(ask(&s, &group, MS)));
            }
            "release" => {
                let s = dealer(&ctx, ipc, None);
                ask(&s, &hello(Role::Control, "", 0, vec![]), MS);
                let r = ask(&s, &Request::ReleaseReserved { devices: vec![] }, MS);
                report("release-others", said(r));
            }
            "malformed" => {
                let s = dealer(&ctx, ipc, None);
                let mut frames: Vec<Vec<u8>> = vec![
                    Vec::new(),
                    vec![0xff; 3],
                    b"GM\x0f\x00\xff\xff\xff\xff\xff\xff".to_vec(),
                    gemini_tests::attack::unknown_version_frame(),
                ];
                frames.push(vec![b'G'; MAX_FRAME_BYTES + 1]);
                let answered = frames
                    .iter()
                    .filter(|f| ask_raw(&s, f, 500).is_some())
                    .count();
                report(
                    "malformed",
                    format!("{answered} of {} answered", frames.len()),
                );
            }
            "flood" => flood(&ctx, ipc, &a),
            other => panic!("unknown attack {other:?}"),
        }
    }
}

/// 256 connections refused for their version, 16 status flooders, and
/// for `seconds` new connections saying hello (and bad frames) as fast
/// as they are answered.
fn flood(ctx: &zmq::Context, ipc: &std::path::Path, a: &Args) {
    let refused = refused_peers(ctx, ipc, 256);
    let statuses = StatusFlood::start(ipc, 16);
    let until = Instant::now() + Duration::from_secs_f64(a.seconds);
    let (mut hellos, mut bad) = (0u64, 0u64);
    while Instant::now() < until {
        let s = dealer(ctx, ipc, None);
        if ask(&s, &hello(Role::Control, "", 0, vec![]), 1000).is_some() {
            hellos += 1;
        }
        if ask_raw(&s, b"GM\x0f\x00garbage", 1000).is_some() {
            bad += 1;
        }
    }
    let answered = statuses.stop();
    report(
        "flood",
        format!(
            "{} refused peers, {answered} status answers, {hellos} hellos on new connections, {bad} bad frames answered",
            refused.len()
        ),
    );
}
