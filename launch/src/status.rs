//! `gem-launch status`: what a user needs from the scheduler's status —
//! each GPU, who reserves it and until when, what runs there and whose,
//! the queue, and the user's own programs. `gem-schd status` and `top`
//! stay the operator's views.

use gemini_protocol::units::format_gpus;
use gemini_protocol::{GpuRequest, ReservationStatus, Role, StatusReport};
use serde::Serialize;
use std::fmt::Write as _;

/// The user's view, as `--json` prints it.
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
}

/// One GPU.
#[derive(Debug, Serialize)]
pub struct GpuView {
    pub gpu: u32,
    /// Share of `span_s` the GPU was busy.
    pub busy: f64,
    /// Seconds `busy` is measured over.
    pub span_s: f64,
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
    /// `gem-launch reserve`: seconds left. A launch's lasts while its
    /// program runs (`None`).
    pub left_s: Option<f64>,
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
    pub waiting_s: f64,
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
        })
        .collect();
    let gpus = st
        .devices
        .iter()
        .map(|d| GpuView {
            gpu: d.device,
            busy: d.busy,
            span_s: d.span_us as f64 / 1e6,
            reserved: st
                .reservations
                .iter()
                .filter(|x| x.devices.contains(&d.device))
                .map(|x| Held {
                    group: x.group.clone(),
                    user: x.user.clone(),
                    left_s: x.manual.as_ref().map(|m| m.left_us as f64 / 1e6),
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
            waiting_s: x.for_us as f64 / 1e6,
            command: x.command.clone(),
        })
        .collect();
    UserView {
        user: user.to_string(),
        gpus,
        queue,
        mine: programs.into_iter().filter(|p| p.user == user).collect(),
    }
}

/// `s` seconds for a reader: `45s`, `12m 3s`, `3h 5m`.
fn length(s: f64) -> String {
    gemini_protocol::units::format_length(std::time::Duration::from_secs_f64(s.max(0.0)))
}

/// When `s` seconds from now is, in UTC.
fn at(s: f64) -> String {
    let t = std::time::SystemTime::now() + std::time::Duration::from_secs_f64(s.max(0.0));
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
            .map(|h| match h.left_s {
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
            .map(|p| format!("{} {} pid {}", p.group, p.user, p.pid))
            .collect();
        let _ = writeln!(
            s,
            "{:<4} {:<16} {:<48} {}",
            g.gpu,
            format!("{:.0}% of {}", g.busy * 100.0, length(g.span_s)),
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
                length(q.waiting_s),
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
                "  pid {:<8} {:<16} GPU {:<6} {}",
                p.pid,
                p.group,
                format_gpus(&p.gpus),
                p.command
            );
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
            holder: None,
            waiting: 0,
            groups: vec![],
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
                "YOUR PROGRAMS (alice)\n  pid 100      train            GPU 0      python train.py"
            ),
            "{text}"
        );
        assert!(!text.contains("python notebook.py"), "{text}");
        let json = serde_json::to_value(&v).unwrap();
        assert_eq!(json["gpus"][0]["reserved"][0]["user"], "alice");
        assert_eq!(json["queue"][0]["user"], "bob");
        assert_eq!(json["mine"].as_array().map(Vec::len), Some(1));
    }
}
