//! `gem-launch status`: what a user needs from the scheduler's status —
//! each GPU, who reserves it and until when, what runs there and whose,
//! the queue, and the user's own programs. `gem-schd status` and `top`
//! stay the operator's views.

use gemini_protocol::units::format_gpus;
use gemini_protocol::{GpuRequest, ReservationStatus, Role, StatusReport};
use serde::Serialize;
use std::fmt::Write as _;

/// The user's view, as `--json` prints it. Durations are integer
/// microseconds, named `…_us`, as in `gem-schd status --json`.
#[derive(Debug, Serialize)]
pub struct UserView {
    /// Whose view it is.
    pub user: String,
    /// Every GPU the scheduler knows.
    pub gpus: Vec<GpuView>,
    /// Launches and reservations waiting for GPUs, first served first.
    pub queue: Vec<QueueEntry>,
    /// The user's own programs.
    pub mine: Vec<Program>,
    /// Whether the scheduler says which programs wait (protocol 16 and
    /// newer): an older one's programs are shown neither running nor
    /// waiting.
    pub waits_known: bool,
}

/// One GPU.
#[derive(Debug, Serialize)]
pub struct GpuView {
    pub gpu: u32,
    /// Share of `span_us` the GPU was busy.
    pub busy: f64,
    /// What `busy` is measured over (µs).
    pub span_us: u64,
    /// Reservations holding it.
    pub reserved: Vec<Held>,
    /// Programs running on it.
    pub running: Vec<Program>,
}

/// A reservation holding a GPU.
#[derive(Debug, Serialize)]
pub struct Held {
    pub group: String,
    pub user: String,
    /// `gem-launch reserve`: how long it has left (µs). A launch's lasts
    /// while its program runs (`None`).
    pub left_us: Option<u64>,
    /// The launched program's process (0 for `gem-launch reserve`).
    pub pid: u32,
}

/// A waiting launch or reservation.
#[derive(Debug, Serialize)]
pub struct QueueEntry {
    pub position: usize,
    pub group: String,
    pub user: String,
    pub gpus: String,
    /// How long it has waited (µs).
    pub waiting_us: u64,
    /// The waiting launch's command line.
    pub command: String,
}

/// A program the scheduler knows.
#[derive(Debug, Clone, Serialize)]
pub struct Program {
    pub pid: u32,
    pub user: String,
    pub group: String,
    pub gpus: Vec<u32>,
    pub command: String,
    /// The GPUs whose token it waits for now.
    pub waiting: Vec<u32>,
    /// Why, where a reservation of another group is why:
    /// `GPU 0 is reserved for group b (bob)`.
    pub waits_for: Option<String>,
    /// Memory it holds, bytes (all GPUs).
    pub memory: u64,
    /// Device time it was charged since it said hello (µs).
    pub gpu_us: u64,
}

fn asked(x: &ReservationStatus) -> String {
    match &x.gpus {
        GpuRequest::Count(n) => format!("{n} GPU(s)"),
        GpuRequest::Ids(ids) => {
            let l: Vec<String> = ids.iter().map(u32::to_string).collect();
            format!("GPU(s) {}", l.join(","))
        }
    }
}

/// `st` as `user` needs it.
pub fn view(st: &StatusReport, user: &str) -> UserView {
    let programs: Vec<Program> = st
        .clients
        .iter()
        .filter(|c| c.role == Role::Client)
        .map(|c| Program {
            pid: c.pid,
            user: c.user.clone(),
            group: c.group.clone(),
            gpus: c.devices.clone(),
            command: c.command.clone(),
            waiting: c.waiting.clone(),
            waits_for: c.waiting.iter().find_map(|&d| {
                let x = st
                    .reservations
                    .iter()
                    .find(|x| x.devices.contains(&d) && x.group != c.group)?;
                // Only where its own group holds no reservation of it.
                if st
                    .reservations
                    .iter()
                    .any(|y| y.devices.contains(&d) && y.group == c.group)
                {
                    return None;
                }
                Some(if x.user.is_empty() {
                    format!("GPU {d} is reserved for group {}", x.group)
                } else {
                    format!("GPU {d} is reserved for group {} ({})", x.group, x.user)
                })
            }),
            memory: c.memory.iter().fold(0, |a, m| a.saturating_add(m.bytes)),
            gpu_us: c.gpu_us,
        })
        .collect();
    let gpus = st
        .devices
        .iter()
        .map(|d| GpuView {
            gpu: d.device,
            busy: d.busy,
            span_us: d.span_us,
            reserved: st
                .reservations
                .iter()
                .filter(|x| x.devices.contains(&d.device))
                .map(|x| Held {
                    group: x.group.clone(),
                    user: x.user.clone(),
                    left_us: x.manual.as_ref().map(|m| m.left_us),
                    pid: x.pid,
                })
                .collect(),
            running: programs
                .iter()
                .filter(|p| p.gpus.contains(&d.device))
                .cloned()
                .collect(),
        })
        .collect();
    let queue = st
        .queue
        .iter()
        .enumerate()
        .map(|(i, x)| QueueEntry {
            position: i + 1,
            group: x.group.clone(),
            user: x.user.clone(),
            gpus: asked(x),
            waiting_us: x.for_us,
            command: x.command.clone(),
        })
        .collect();
    UserView {
        user: user.to_string(),
        gpus,
        queue,
        mine: programs.into_iter().filter(|p| p.user == user).collect(),
        waits_known: st.protocol >= 16,
    }
}

/// `us` µs for a reader: `45s`, `12m 3s`, `3h 5m`.
fn length(us: u64) -> String {
    gemini_protocol::units::format_length(std::time::Duration::from_micros(us))
}

/// When `us` µs from now is, in UTC.
fn at(us: u64) -> String {
    let t = std::time::SystemTime::now() + std::time::Duration::from_micros(us);
    humantime::format_rfc3339_seconds(t).to_string()
}

/// The plain-text view.
pub fn render(v: &UserView) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "{:<4} {:<16} {:<48} RUNNING",
        "GPU", "BUSY", "RESERVED FOR"
    );
    for g in &v.gpus {
        let reserved: Vec<String> = g
            .reserved
            .iter()
            .map(|h| match h.left_us {
                Some(left) => format!(
                    "{} ({}, until {}, {} left)",
                    h.group,
                    h.user,
                    at(left),
                    length(left)
                ),
                None => format!("{} ({}, pid {} while it runs)", h.group, h.user, h.pid),
            })
            .collect();
        let running: Vec<String> = g
            .running
            .iter()
            .map(|p| {
                format!(
                    "{} {} pid {}{}",
                    p.group,
                    p.user,
                    p.pid,
                    if p.waiting.contains(&g.gpu) {
                        " (waiting)"
                    } else {
                        ""
                    }
                )
            })
            .collect();
        let _ = writeln!(
            s,
            "{:<4} {:<16} {:<48} {}",
            g.gpu,
            format!("{:.0}% of {}", g.busy * 100.0, length(g.span_us)),
            if reserved.is_empty() {
                "-".to_string()
            } else {
                reserved.join("; ")
            },
            if running.is_empty() {
                "-".to_string()
            } else {
                running.join(", ")
            }
        );
    }
    if v.queue.is_empty() {
        let _ = writeln!(s, "\nQUEUE: empty");
    } else {
        let _ = writeln!(s, "\nQUEUE");
        for q in &v.queue {
            let _ = writeln!(
                s,
                "  {:<3} {:<16} {:<12} {:<12} waiting {}{}",
                q.position,
                q.group,
                if q.user.is_empty() { "-" } else { &q.user },
                q.gpus,
                length(q.waiting_us),
                if q.command.is_empty() {
                    String::new()
                } else {
                    format!("  {}", q.command)
                }
            );
        }
    }
    if v.mine.is_empty() {
        let _ = writeln!(s, "\nYOUR PROGRAMS ({}): none", v.user);
    } else {
        let _ = writeln!(s, "\nYOUR PROGRAMS ({})", v.user);
        for p in &v.mine {
            let _ = writeln!(
                s,
                "  pid {:<8} {:<16} GPU {:<6} {:<8} {}",
                p.pid,
                p.group,
                format_gpus(&p.gpus),
                if !v.waits_known {
                    "-"
                } else if p.waiting.is_empty() {
                    "running"
                } else {
                    "WAITING"
                },
                p.command
            );
            // A program that waits says for what, where a reservation is
            // why (it said so on its stderr too).
            if let Some(why) = &p.waits_for {
                let _ = writeln!(s, "    waits: {why}, until it is released");
            }
        }
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use gemini_protocol::{ClientStatus, DeviceStatus, ManualReservation};

    fn report() -> StatusReport {
        let device = |d: u32, busy: f64| DeviceStatus {
            device: d,
            busy,
            span_us: 6_000_000,
            rtt_us: 0,
            token_client: None,
            waiting: 0,
            groups: vec![],
            memory_total: None,
            memory_free: None,
        };
        let client = |id: u64, pid: u32, user: &str, group: &str, devices: Vec<u32>| ClientStatus {
            id,
            pid,
            role: Role::Client,
            group: group.into(),
            job: None,
            user: user.into(),
            command: format!("python {group}.py"),
            devices,
            protocol: gemini_protocol::PROTOCOL_VERSION,
            build: gemini_protocol::BUILD.into(),
            waiting: vec![],
            memory: vec![],
            gpu_us: 0,
        };
        StatusReport {
            server: "test".into(),
            config_path: "/etc/gemini/resource.conf".into(),
            config_error: None,
            window_us: 10_000_000,
            uptime_us: 60_000_000,
            groups: vec![],
            devices: vec![device(0, 0.99), device(1, 0.0)],
            clients: vec![
                client(1, 100, "alice", "train", vec![0]),
                client(2, 200, "bob", "notebook", vec![0]),
            ],
            reservations: vec![ReservationStatus {
                client: 9,
                pid: 0,
                group: "train".into(),
                gpus: GpuRequest::Count(1),
                devices: vec![0],
                for_us: 60_000_000,
                user: "alice".into(),
                command: String::new(),
                manual: Some(ManualReservation {
                    user: "alice".into(),
                    left_us: 3 * 3_600_000_000 + 300_000_000,
                }),
            }],
            queue: vec![ReservationStatus {
                client: 10,
                pid: 300,
                group: "notebook".into(),
                gpus: GpuRequest::Count(2),
                devices: vec![],
                for_us: 5_000_000,
                user: "bob".into(),
                command: "gem-launch --gpus 2 -- jupyter lab".into(),
                manual: None,
            }],
            driver_limits: false,
            refused: Vec::new(),
            protocol: gemini_protocol::PROTOCOL_VERSION,
        }
    }

    /// Every GPU with who reserves it and until when, who runs there, the
    /// queue with its users, and the user's own programs only.
    #[test]
    fn a_user_sees_every_gpu_its_reservations_the_queue_and_their_own_programs() {
        let v = view(&report(), "alice");
        let text = render(&v);
        let gpu0 = text.lines().find(|l| l.starts_with("0 ")).unwrap();
        assert!(
            gpu0.contains("99% of 6s")
                && gpu0.contains("train (alice, until ")
                && gpu0.contains("3h 5m left")
                && gpu0.contains("train alice pid 100, notebook bob pid 200"),
            "{text}"
        );
        let gpu1 = text.lines().find(|l| l.starts_with("1 ")).unwrap();
        assert!(gpu1.contains("0% of 6s"), "{text}");
        assert!(
            text.contains(
                "  1   notebook         bob          2 GPU(s)     waiting 5s  gem-launch --gpus 2 -- jupyter lab"
            ),
            "{text}"
        );
        assert!(
            text.contains(
                "YOUR PROGRAMS (alice)\n  pid 100      train            GPU 0      running  python train.py"
            ),
            "{text}"
        );
        assert!(!text.contains("python notebook.py"), "{text}");
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["gpus"][0]["reserved"][0]["user"], "alice");
        assert_eq!(json["queue"][0]["user"], "bob");
        assert_eq!(json["mine"].as_array().map(Vec::len), Some(1));
        assert_eq!(json["gpus"][0]["span_us"], 6_000_000);
        assert_eq!(json["queue"][0]["waiting_us"], 5_000_000);
    }

    /// A program waiting for a GPU another group reserved is marked so,
    /// with whose reservation it waits for; one of the reserving group
    /// waits for its turn, not for a reservation.
    #[test]
    fn a_program_kept_off_a_reserved_gpu_is_shown_waiting_and_why() {
        let mut st = report();
        st.clients[1].waiting = vec![0];
        let v = view(&st, "bob");
        let text = render(&v);
        assert!(
            text.contains("pid 200      notebook         GPU 0      WAITING  python notebook.py\n    waits: GPU 0 is reserved for group train (alice), until it is released"),
            "{text}"
        );
        assert!(text.contains("notebook bob pid 200 (waiting)"), "{text}");
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["mine"][0]["waiting"], serde_json::json!([0]));
        st.clients[1].waiting.clear();
        st.clients[0].waiting = vec![0];
        let v = view(&st, "alice");
        assert_eq!(v.mine[0].waits_for, None);
        assert!(render(&v).contains("WAITING  python train.py"));
        // A scheduler of protocol 15 says nothing of waits: neither.
        st.protocol = 15;
        st.clients[0].waiting.clear();
        let text = render(&view(&st, "alice"));
        assert!(
            text.contains("GPU 0      -        python train.py"),
            "{text}"
        );
    }
}
