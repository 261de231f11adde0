//! The policy in virtual time: simulated clients use the device for the
//! tokens they are granted, and shares are measured from the simulation's
//! own busy log, not from the policy's accounting.

use super::*;
use gemini_config::parse_resource;
use gemini_protocol::{DeviceActivity, GpuRequest, HeldMemory, HolderOrder, Span, StatusReport};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::path::Path;

mod access;
mod holder;
mod latency;
mod leases;
mod memory;
mod reserve;
mod share;
mod shares;
mod tokens;

const SEC: Micros = 1_000_000;
const MS: Micros = 1_000;
/// The token round trip every simulated client reports (µs).
const RTT: Micros = 200;

fn config(text: &str) -> ResourceConfig {
    parse_resource(text, Path::new("/etc/gemini/resource.conf"))
        .expect("valid config")
        .0
}

/// How a simulated client behaves.
#[derive(Clone, Copy, Debug)]
enum Demand {
    /// Always wants the device.
    Saturating,
    /// Always wants the device and says so, as the hook of a program that
    /// never pauses does (its predicted burst grows without end).
    Greedy,
    /// Wants the device until `stop`, then leaves.
    Until(Micros),
    /// Works `burst` (device time), then idles `gap`, releasing the token.
    Bursty { burst: Micros, gap: Micros },
    /// Always wants the device, in kernels of `len` µs: under a token it
    /// queues the kernels that end within it, or one onto an empty queue
    /// when none does (it then runs past the token), as the hook does.
    Kernels(Micros),
    /// Wants the device always but from `from` to `to`: it gives the token
    /// back at its first report after `from` and asks again at `to`.
    Paused { from: Micros, to: Micros },
}

#[derive(Debug)]
struct SimClient {
    id: ClientId,
    group: String,
    demand: Demand,
    busy: Vec<(Micros, Micros)>,
    /// What its hook measures of each token's work: from its first launch
    /// (the grant and a wake-up) to its end, whatever it queued behind.
    claims: Vec<(Micros, Micros)>,
    /// Quotas of the tokens granted marked lent.
    lent: Vec<Micros>,
    /// Every token granted: (when, quota).
    granted: Vec<(Micros, Micros)>,
    /// Device time left in the current burst (Bursty).
    left: Micros,
    /// When it asked for the device after being away (a burst's start).
    asked: Vec<Micros>,
    seq: u32,
    gone: bool,
    /// Its token's work is reported in this many spans (a program that
    /// waits after each batch of kernels): 1 by default.
    pieces: Micros,
}

/// Events of the simulation: at `time`, `client` finished using its token.
struct Sim {
    policy: Policy,
    now: Micros,
    clients: Vec<SimClient>,
    queue: BinaryHeap<Reverse<(Micros, usize, u8)>>,
    device_free_at: Micros,
    /// Time from a grant to the holder's first kernel on the device (a
    /// real client wakes up and launches): the device idles that long at
    /// every hand-over.
    wake: Micros,
    /// A `Bursty` client's gaps vary by up to this much either way (a
    /// host's wake-ups), the same in every run.
    gap_jitter: Micros,
    /// Its clients' hooks do not say how long a launch takes (protocol
    /// 19 or older): the scheduler learns it from their overruns.
    old_hooks: bool,
}

const DONE: u8 = 0; // token use finished
const WAKE: u8 = 1; // idle gap finished, ask again

impl Sim {
    /// `gap` moved by up to `gap_jitter` either way, by a hash of the
    /// time and the client.
    fn jittered(&self, gap: Micros, idx: usize) -> Micros {
        if self.gap_jitter == 0 {
            return gap;
        }
        let mut h = (self.now ^ (idx as u64) << 48).wrapping_mul(0x9e37_79b9_7f4a_7c15);
        h ^= h >> 29;
        let span = 2 * self.gap_jitter + 1;
        (gap + h % span).saturating_sub(self.gap_jitter)
    }

    fn new(text: &str) -> Sim {
        Sim::with_params(text, Params::default())
    }

    fn with_params(text: &str, params: Params) -> Sim {
        Sim {
            policy: Policy::new(params, config(text)),
            now: 0,
            clients: Vec::new(),
            queue: BinaryHeap::new(),
            device_free_at: 0,
            wake: 0,
            gap_jitter: 0,
            old_hooks: false,
        }
    }

    fn add(&mut self, group: &str, demand: Demand) -> usize {
        self.add_role(group, demand, Role::Client)
    }

    fn add_role(&mut self, group: &str, demand: Demand, role: Role) -> usize {
        let idx = self.clients.len();
        let id = 100 + idx as ClientId;
        let acts = self.policy.handle(
            Event::Request {
                client: id,
                seq: 0,
                req: Request::Hello {
                    role,
                    group: group.into(),
                    pid: 1000 + idx as u32,
                    held: vec![],
                    job: None,
                    build: gemini_protocol::BUILD.into(),
                },
            },
            self.now,
        );
        assert!(
            matches!(
                acts.as_slice(),
                [
                    Action::Reply {
                        reply: Reply::Welcome { .. },
                        ..
                    },
                    Action::Watch { .. }
                ]
            ),
            "{acts:?}"
        );
        let left = match demand {
            Demand::Bursty { burst, .. } => burst,
            _ => 0,
        };
        self.clients.push(SimClient {
            id,
            group: group.into(),
            demand,
            busy: vec![],
            claims: vec![],
            lent: vec![],
            granted: vec![],
            left,
            asked: vec![],
            seq: 0,
            gone: false,
            pieces: 1,
        });
        self.queue.push(Reverse((self.now, idx, WAKE)));
        idx
    }

    fn send(&mut self, idx: usize, mut req: Request) {
        // A `Kernels` client's hook says its kernels' length, as a hook
        // that has measured them does.
        if let Request::AcquireToken { launch_us, .. } = &mut req
            && let Demand::Kernels(len) = self.clients[idx].demand
            && !self.old_hooks
        {
            *launch_us = len as u32;
        }
        self.clients[idx].seq += 1;
        let ev = Event::Request {
            client: self.clients[idx].id,
            seq: self.clients[idx].seq,
            req,
        };
        let acts = self.policy.handle(ev, self.now);
        self.apply(acts);
    }

    fn apply(&mut self, acts: Vec<Action>) {
        for (client, _, reply) in replies(acts) {
            let idx = (client - 100) as usize;
            if let Reply::Token { quota_us, lent, .. } = reply {
                if lent {
                    self.clients[idx].lent.push(quota_us);
                }
                self.clients[idx].granted.push((self.now, quota_us));
                // The device runs one client at a time: work starts when the
                // previous holder's last kernel is done (overuse).
                let start = (self.now + self.wake).max(self.device_free_at);
                let c = &mut self.clients[idx];
                // A lent token's hook queues only work that ends within it:
                // queued behind the last holder's work, it does less.
                let quota_us = if lent {
                    (self.now + quota_us).saturating_sub(start).max(1)
                } else {
                    quota_us
                };
                let used = match c.demand {
                    Demand::Bursty { .. } => quota_us.min(c.left),
                    Demand::Kernels(len) => (quota_us / len).max(1) * len,
                    _ => quota_us,
                };
                c.busy.push((start, start + used));
                c.claims.push((self.now + self.wake, start + used));
                self.device_free_at = start + used;
                self.queue.push(Reverse((start + used, idx, DONE)));
            }
        }
    }

    fn step_client(&mut self, idx: usize, kind: u8) {
        let c = &mut self.clients[idx];
        if c.gone {
            return;
        }
        let used = c
            .busy
            .last()
            .map_or(0, |&(s, e)| if kind == DONE { e - s } else { 0 });
        // What it reports: the work of its last token, measured.
        let ran = match c.claims.last() {
            // In `pieces` spans, a µs apart (its waits' returns).
            Some(&(s, e)) if kind == DONE => {
                let n = c.pieces.max(1);
                let len = (e - s) / n;
                (0..n)
                    .map(|i| Span {
                        start_us: s + i * len,
                        end_us: if i + 1 == n { e } else { s + (i + 1) * len - 1 },
                    })
                    .filter(|sp| sp.end_us > sp.start_us)
                    .collect()
            }
            _ => vec![],
        };
        match c.demand {
            Demand::Until(stop) if self.now >= stop => {
                c.gone = true;
                let id = c.id;
                self.send(
                    idx,
                    Request::ReleaseToken {
                        device: 0,
                        ran: ran.clone(),
                        in_flight: false,
                    },
                );
                let acts = self
                    .policy
                    .handle(Event::Disconnected { client: id }, self.now);
                self.apply(acts);
            }
            Demand::Paused { from, to } if kind == DONE && (from..to).contains(&self.now) => {
                self.send(
                    idx,
                    Request::ReleaseToken {
                        device: 0,
                        ran: ran.clone(),
                        in_flight: false,
                    },
                );
                self.queue.push(Reverse((to, idx, WAKE)));
            }
            Demand::Bursty { burst, gap } if kind == DONE => {
                c.left -= used.min(c.left);
                if c.left == 0 {
                    c.left = burst;
                    self.send(
                        idx,
                        Request::ReleaseToken {
                            device: 0,
                            ran,
                            in_flight: false,
                        },
                    );
                    let gap = self.jittered(gap, idx);
                    self.queue.push(Reverse((self.now + gap, idx, WAKE)));
                } else {
                    let left = c.left;
                    self.send(
                        idx,
                        Request::AcquireToken {
                            device: 0,
                            ran,
                            in_flight: false,
                            burst_us: left,
                            rtt_us: RTT as u32,
                            launch_us: 0,
                        },
                    );
                }
            }
            _ => {
                if kind == WAKE {
                    c.asked.push(self.now);
                }
                let burst = match c.demand {
                    Demand::Bursty { .. } => c.left,
                    Demand::Greedy => 10 * SEC,
                    _ => 0,
                };
                self.send(
                    idx,
                    Request::AcquireToken {
                        device: 0,
                        ran,
                        in_flight: false,
                        burst_us: burst,
                        rtt_us: RTT as u32,
                        launch_us: 0,
                    },
                );
            }
        }
    }

    fn run_until(&mut self, end: Micros) {
        loop {
            let next_client = self.queue.peek().map(|Reverse((t, _, _))| *t);
            let deadline = self.policy.next_deadline(self.now);
            let next = match (next_client, deadline) {
                (Some(a), Some(b)) => a.min(b),
                (Some(a), None) | (None, Some(a)) => a,
                (None, None) => break,
            };
            if next > end {
                break;
            }
            self.now = next.max(self.now);
            if next_client == Some(next) {
                let Some(Reverse((_, idx, kind))) = self.queue.pop() else {
                    break;
                };
                self.step_client(idx, kind);
            } else {
                let acts = self.policy.handle(Event::Tick, self.now);
                self.apply(acts);
            }
        }
        self.now = end;
    }

    /// How long client `idx` waited for the device after each time it
    /// asked in `[from, to)` after being away: from the ask to its first
    /// work on the device.
    fn waits(&self, idx: usize, from: Micros, to: Micros) -> Vec<Micros> {
        let c = &self.clients[idx];
        c.asked
            .iter()
            .filter(|&&a| (from..to).contains(&a))
            .filter_map(|&a| c.busy.iter().find(|b| b.0 >= a).map(|b| b.0 - a))
            .collect()
    }

    /// Share of `[from, to)` each group used, from the simulated busy log.
    fn group_share(&self, group: &str, from: Micros, to: Micros) -> f64 {
        let used: Micros = self
            .clients
            .iter()
            .filter(|c| c.group == group)
            .flat_map(|c| c.busy.iter())
            .map(|&(s, e)| e.min(to).saturating_sub(s.max(from)))
            .sum();
        used as f64 / (to - from) as f64
    }
}

fn check_shares(groups: &[(f64, f64)]) {
    let mut text = String::new();
    for (i, (min, max)) in groups.iter().enumerate() {
        text += &format!("[g{i}]\nMinUtil={min}\nMaxUtil={max}\n");
    }
    let mut sim = Sim::new(&text);
    for i in 0..groups.len() {
        sim.add(&format!("g{i}"), Demand::Saturating);
    }
    sim.run_until(30 * SEC);
    let want = entitlements(groups);
    for (i, w) in want.iter().enumerate() {
        let got = sim.group_share(&format!("g{i}"), 20 * SEC, 30 * SEC);
        assert!(
            (got - w).abs() <= 0.02,
            "groups {groups:?}: g{i} got {got:.4}, entitled to {w:.4}"
        );
    }
    // Every group always waits: none is away, so no token is lent (but
    // where a cap ends one).
    if groups.iter().all(|g| g.1 >= 1.0) {
        assert!(sim.clients.iter().all(|c| c.lent.is_empty()));
    }
}

fn hello(p: &mut Policy, client: ClientId, group: &str) -> Reply {
    hello_job(p, client, group, None)
}

/// [`hello`] of a rank of `job`.
fn hello_job(p: &mut Policy, client: ClientId, group: &str, job: Option<&str>) -> Reply {
    let req = Request::Hello {
        role: Role::Client,
        group: group.into(),
        pid: client as u32,
        held: vec![],
        job: job.map(str::to_string),
        build: gemini_protocol::BUILD.into(),
    };
    let acts = p.handle(
        Event::Request {
            client,
            seq: 0,
            req,
        },
        0,
    );
    match replies(acts).pop() {
        Some((_, _, reply)) => reply,
        None => panic!("no reply"),
    }
}

fn ask(p: &mut Policy, client: ClientId, req: Request) -> Reply {
    ask_at(p, client, req, 0)
}

/// [`ask`] at `now`.
fn ask_at(p: &mut Policy, client: ClientId, req: Request, now: Micros) -> Reply {
    let acts = p.handle(
        Event::Request {
            client,
            seq: 7,
            req,
        },
        now,
    );
    match replies(acts).pop() {
        Some((_, seq, reply)) => {
            assert_eq!(seq, 7);
            reply
        }
        None => panic!("no reply"),
    }
}

fn kind(r: &Reply) -> Option<ErrorKind> {
    match r {
        Reply::Error(e) => Some(e.kind),
        _ => None,
    }
}

/// Two always-busy clients (1 in group a, 2 in group b) taking turns as
/// the policy grants; each reports `used(client, quota)` for its token.
/// Returns the device time each used over `rounds` tokens.
fn take_turns(
    p: &mut Policy,
    rounds: usize,
    burst: Micros,
    used: impl Fn(ClientId, Micros) -> Micros,
) -> [u64; 2] {
    let mut now = 0;
    let mut total = [0u64; 2];
    let mut holder: Option<(ClientId, Micros)> = None;
    let ask = |p: &mut Policy,
               c: ClientId,
               u: Micros,
               now: Micros,
               holder: &mut Option<(ClientId, Micros)>| {
        let req = Request::AcquireToken {
            device: 0,
            ran: ran(now - u, now),
            in_flight: false,
            burst_us: burst,
            rtt_us: RTT as u32,
            launch_us: 0,
        };
        for a in p.handle(
            Event::Request {
                client: c,
                seq: 0,
                req,
            },
            now,
        ) {
            if let Action::Reply {
                client,
                reply: Reply::Token { quota_us, .. },
                ..
            } = a
            {
                *holder = Some((client, quota_us));
            }
        }
    };
    ask(p, 1, 0, now, &mut holder);
    ask(p, 2, 0, now, &mut holder);
    for _ in 0..rounds {
        let (c, q) = holder.take().expect("someone holds the token");
        let u = used(c, q);
        now += u;
        total[(c - 1) as usize] += u;
        ask(p, c, u, now, &mut holder);
    }
    total
}

fn hello_holder(p: &mut Policy, client: ClientId) {
    let req = Request::Hello {
        role: Role::Holder,
        group: String::new(),
        pid: 9,
        held: vec![],
        job: None,
        build: gemini_protocol::BUILD.into(),
    };
    let acts = p.handle(
        Event::Request {
            client,
            seq: 0,
            req,
        },
        0,
    );
    assert!(matches!(
        replies(acts).pop(),
        Some((_, _, Reply::Welcome { .. }))
    ));
}

/// The replies among `acts`.
fn replies(acts: Vec<Action>) -> Vec<(ClientId, u32, Reply)> {
    acts.into_iter()
        .filter_map(|a| match a {
            Action::Reply { client, seq, reply } => Some((client, seq, reply)),
            _ => None,
        })
        .collect()
}

/// `req` from `client` at `now`, numbered after every request before it;
/// the replies.
fn send(
    p: &mut Policy,
    client: ClientId,
    req: Request,
    now: Micros,
) -> Vec<(ClientId, u32, Reply)> {
    static SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let seq = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
    replies(p.handle(Event::Request { client, seq, req }, now))
}

/// Work that ran on the device from `start` to `end` (none where empty),
/// as a client reports it.
fn ran(start: Micros, end: Micros) -> Vec<Span> {
    Span::from_ns(start * 1000, end * 1000)
        .into_iter()
        .collect()
}

/// A token request for device 0 reporting no work.
fn acquire() -> Request {
    acquire_ran(0, 0)
}

/// A token request for device 0 reporting work that ran from `start` to
/// `end`.
fn acquire_ran(start: Micros, end: Micros) -> Request {
    acquire_reporting(start, end, RTT as u32)
}

/// [`acquire_ran`] from a client whose round trip is `rtt_us`.
fn acquire_reporting(start: Micros, end: Micros, rtt_us: u32) -> Request {
    Request::AcquireToken {
        device: 0,
        ran: ran(start, end),
        in_flight: false,
        burst_us: 0,
        rtt_us,
        launch_us: 0,
    }
}

/// Gives the token of device 0 back, reporting work that ran from
/// `start` to `end`.
fn release_ran(start: Micros, end: Micros) -> Request {
    Request::ReleaseToken {
        device: 0,
        ran: ran(start, end),
        in_flight: false,
    }
}

/// [`release_ran`], with work still in flight.
fn release_in_flight(start: Micros, end: Micros) -> Request {
    Request::ReleaseToken {
        device: 0,
        ran: ran(start, end),
        in_flight: true,
    }
}

/// The token granted to `client` in `r`, if one was: its quota.
fn granted(r: &[(ClientId, u32, Reply)], client: ClientId) -> Option<Micros> {
    r.iter().find_map(|(c, _, reply)| match reply {
        Reply::Token { quota_us, .. } if *c == client => Some(*quota_us),
        _ => None,
    })
}

/// `client` is a connection of a process of user `uid`.
fn connect_as(p: &mut Policy, client: ClientId, uid: u32) {
    let peer = Peer {
        uid,
        pid: client as u32,
        user: format!("user{uid}"),
        groups: Vec::new(),
        cgroups: Vec::new(),
    };
    p.handle(Event::Connected { client, peer }, 0);
}

/// The one token granted in `r`: (client, quota, lent).
fn token(r: &[(ClientId, u32, Reply)]) -> Option<(ClientId, Micros, bool)> {
    match r {
        [(c, _, Reply::Token { quota_us, lent, .. })] => Some((*c, *quota_us, *lent)),
        _ => None,
    }
}

/// `group`'s share of device 0 in `st`.
fn share_on_0(st: &StatusReport, group: &str) -> f64 {
    st.devices[0]
        .groups
        .iter()
        .find(|r| r.group == group)
        .map(|r| r.share)
        .unwrap()
}

fn control(p: &mut Policy, client: ClientId) {
    let req = Request::Hello {
        role: Role::Control,
        group: String::new(),
        pid: client as u32,
        held: vec![],
        job: None,
        build: gemini_protocol::BUILD.into(),
    };
    p.handle(
        Event::Request {
            client,
            seq: 0,
            req,
        },
        0,
    );
}

fn reserve(
    p: &mut Policy,
    client: ClientId,
    group: &str,
    gpus: GpuRequest,
    wait: bool,
    now: Micros,
) -> Vec<(ClientId, u32, Reply)> {
    control(p, client);
    replies(p.handle(
        Event::Request {
            client,
            seq: 1,
            req: Request::Reserve {
                group: group.into(),
                gpus,
                wait,
            },
        },
        now,
    ))
}

fn two_gpus(conf: &str) -> Policy {
    Policy::new(
        Params {
            devices: 2,
            ..Params::default()
        },
        config(conf),
    )
}
