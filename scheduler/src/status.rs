//! The text form of `gem-schd status`.

use crate::policy::HOLDER_SHOWN;
use gemini_config::format_size;
use gemini_protocol::StatusReport;
use gemini_protocol::units::format_gpus;
use std::fmt::Write as _;

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
}

/// A group's GPUs: `all`, or the `Devices=` list.
fn gpus(devices: Option<&[u32]>) -> String {
    match devices {
        None => "all".to_string(),
        Some(d) => d.iter().map(u32::to_string).collect::<Vec<_>>().join(","),
    }
}

/// A length of `us` µs for humans (`42s`, `5m 3s`, `2h 55m`).
fn length(us: u64) -> String {
    gemini_protocol::units::format_length(std::time::Duration::from_micros(us))
}

/// `us` as seconds for a reader: 10 s, 3.2 s.
fn seconds(us: u64) -> String {
    let s = us as f64 / 1e6;
    if s >= 9.95 {
        format!("{s:.0} s")
    } else {
        format!("{s:.1} s")
    }
}

/// The wall-clock time `us` from now (negative: ago), UTC.
fn at(us: i128) -> String {
    let now = std::time::SystemTime::now();
    let d = std::time::Duration::from_micros(us.unsigned_abs() as u64);
    let t = if us < 0 {
        now.checked_sub(d)
    } else {
        now.checked_add(d)
    };
    t.map_or_else(
        || "?".into(),
        |t| humantime::format_rfc3339_seconds(t).to_string(),
    )
}

/// One reservation, held (`holds`) or waiting (`waits`).
fn reservation(x: &gemini_protocol::ReservationStatus, what: &str) -> String {
    let gpus = match (&x.gpus, what) {
        (_, "holds") => format!("GPUs {:?}", x.devices),
        (gemini_protocol::GpuRequest::Count(n), _) => format!("{n} GPU(s)"),
        (gemini_protocol::GpuRequest::Ids(ids), _) => format!("GPUs {ids:?}"),
    };
    match (&x.manual, what) {
        (Some(m), "holds") => format!(
            "user {:<12} {:<16} holds {gpus} since {} ({}), until {} ({} left)  [gem-launch reserve]",
            m.user,
            x.group,
            at(-(x.for_us as i128)),
            length(x.for_us),
            at(m.left_us as i128),
            length(m.left_us)
        ),
        (Some(m), _) => format!(
            "user {:<12} {:<16} waits {gpus} for {}, to hold them {}  [gem-launch reserve]",
            m.user,
            x.group,
            length(x.for_us),
            length(m.left_us)
        ),
        (None, _) => format!(
            "pid {:<8} {:<16} {what} {gpus} for {:.0}s{}{}",
            x.pid,
            x.group,
            x.for_us as f64 / 1e6,
            if x.user.is_empty() {
                String::new()
            } else {
                format!("  (user {})", x.user)
            },
            if x.command.is_empty() {
                String::new()
            } else {
                format!("  {}", x.command)
            }
        ),
    }
}

/// Renders a report as tables for humans.
pub fn render(r: &StatusReport) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "gem-schd {}  config {}  window {:.0}s  up {:.0}s",
        r.server,
        r.config_path,
        r.window_us as f64 / 1e6,
        r.uptime_us as f64 / 1e6
    );
    if let Some(e) = &r.config_error {
        let _ = writeln!(
            s,
            "\nCONFIG ERROR (previous configuration still in force):\n{e}"
        );
    }
    let _ = writeln!(
        s,
        "\n{:<16} {:>7} {:>7} {:>12} {:>8}  GPUS",
        "GROUP", "MIN", "MAX", "MEM LIMIT", "CLIENTS"
    );
    for g in &r.groups {
        let _ = writeln!(
            s,
            "{:<16} {:>7} {:>7} {:>12} {:>8}  {}",
            g.name,
            pct(g.min_util),
            pct(g.max_util),
            format_size(g.memory_limit),
            g.clients,
            gpus(g.devices.as_deref())
        );
    }
    let limited: Vec<_> = r
        .groups
        .iter()
        .flat_map(|g| g.driver_memory.iter().map(move |m| (&g.name, m)))
        .collect();
    if r.driver_limits {
        let _ = writeln!(
            s,
            "
DRIVER MEMORY LIMITS (per cgroup, nvmlDeviceSetMemoryLimits_v1; the hook caps every group too)"
        );
        if limited.is_empty() {
            let _ = writeln!(s, "  none: no group with Cgroups= has a MemoryLimit");
        } else {
            let _ = writeln!(
                s,
                "  {:<16} {:>4} {:>24}  CGROUP",
                "GROUP", "GPU", "USED / LIMIT"
            );
        }
        for (group, m) in &limited {
            let _ = writeln!(
                s,
                "  {:<16} {:>4} {:>24}  {}",
                group,
                m.device,
                format!("{} / {}", format_size(m.used), format_size(m.limit)),
                m.cgroup
            );
        }
    } else {
        let _ = writeln!(
            s,
            "
MemoryLimit is enforced by the hook (the driver has no per-cgroup limits)"
        );
    }
    for d in &r.devices {
        let holder = d
            .holder
            .map_or("free".to_string(), |c| format!("client {c}"));
        let _ = writeln!(
            s,
            "\nDEVICE {}  busy {} over the last {}  token {}  waiting {}{}",
            d.device,
            pct(d.busy),
            seconds(d.span_us),
            holder,
            d.waiting,
            match d.rtt_us {
                0 => String::new(),
                us => format!("  round trip {us} µs"),
            }
        );
        for x in r
            .reservations
            .iter()
            .filter(|x| x.devices.contains(&d.device))
        {
            let who = match &x.manual {
                Some(m) => format!(
                    "user {} until {} ({} left)",
                    m.user,
                    at(m.left_us as i128),
                    length(m.left_us)
                ),
                None => format!("pid {} for {}", x.pid, length(x.for_us)),
            };
            let _ = writeln!(s, "  reserved for group {}: {who}", x.group);
        }
        let _ = writeln!(
            s,
            "  {:<16} {:>8} {:>7} {:>7} {:>24} {:>10} {:>8}",
            "GROUP", "SHARE", "MIN", "MAX", "MEMORY USED / LIMIT", "CONTEXTS", "WAITING"
        );
        for g in &d.groups {
            let cfg = r.groups.iter().find(|c| c.name == g.group);
            let _ = writeln!(
                s,
                "  {:<16} {:>8} {:>7} {:>7} {:>24} {:>10} {:>8}",
                g.group,
                pct(g.share),
                cfg.map_or("-".into(), |c| pct(c.min_util)),
                cfg.map_or("-".into(), |c| pct(c.max_util)),
                format!(
                    "{} / {}",
                    format_size(g.memory_used),
                    format_size(g.memory_limit)
                ),
                if g.contexts == 0 {
                    "-".to_string()
                } else {
                    format_size(g.contexts)
                },
                g.waiting
            );
        }
        // A reserved GPU is its reservations' groups': another group's
        // processes on it wait, and say for whom.
        let reserved: Vec<&gemini_protocol::ReservationStatus> = r
            .reservations
            .iter()
            .filter(|x| x.devices.contains(&d.device))
            .collect();
        if let Some(first) = reserved.first() {
            for g in d.groups.iter().filter(|g| {
                g.waiting > 0
                    && g.group != HOLDER_SHOWN
                    && !reserved.iter().any(|x| x.group == g.group)
            }) {
                let until = match &first.manual {
                    Some(m) => format!("user {} until {}", m.user, at(m.left_us as i128)),
                    None => format!("pid {} until it ends", first.pid),
                };
                let _ = writeln!(
                    s,
                    "  {} waits: GPU {} is reserved for group {} ({until})",
                    g.group, d.device, first.group
                );
            }
        }
    }
    if !r.reservations.is_empty() || !r.queue.is_empty() {
        let _ = writeln!(s, "\nRESERVATIONS (gem-launch)");
        for (what, list) in [("holds", &r.reservations), ("waits", &r.queue)] {
            for x in list.iter() {
                let _ = writeln!(s, "  {}", reservation(x, what));
            }
        }
    }
    let _ = writeln!(s, "\n{} client(s)", r.clients.len());
    if !r.clients.is_empty() {
        let _ = writeln!(
            s,
            "  {:<6} {:<8} {:<12} {:<8} {:<16} {:<6} {:<8} COMMAND",
            "CLIENT", "PID", "USER", "ROLE", "GROUP", "GPUS", "VERSION"
        );
    }
    for c in &r.clients {
        let _ = writeln!(
            s,
            "  {:<6} {:<8} {:<12} {:<8} {:<16} {:<6} {:<8} {}{}",
            c.id,
            c.pid,
            if c.user.is_empty() { "-" } else { &c.user },
            format!("{:?}", c.role).to_lowercase(),
            if c.group.is_empty() { "-" } else { &c.group },
            format_gpus(&c.devices),
            if c.build.is_empty() { "-" } else { &c.build },
            if c.command.is_empty() {
                "-"
            } else {
                &c.command
            },
            c.job
                .as_deref()
                .map(|j| format!("  (job {j})"))
                .unwrap_or_default()
        );
    }
    let older: Vec<String> = r
        .clients
        .iter()
        .filter(|c| c.protocol != 0 && c.protocol < r.protocol)
        .map(|c| c.pid.to_string())
        .collect();
    if !older.is_empty() {
        let _ = writeln!(
            s,
            "  {} client(s) speak an older protocol and are served in it: pid {}; they run the newer hook once restarted",
            older.len(),
            older.join(", ")
        );
    }
    if !r.refused.is_empty() {
        let _ = writeln!(
            s,
            "\nREFUSED: these speak a protocol this gem-schd (protocol v{}) does not; they wait, gated, for one that speaks theirs",
            r.protocol
        );
        for p in &r.refused {
            let _ = writeln!(
                s,
                "  pid {} (user {}) speaks v{}, last tried {} ago",
                if p.pid == 0 {
                    "?".to_string()
                } else {
                    p.pid.to_string()
                },
                if p.user.is_empty() { "?" } else { &p.user },
                p.protocol,
                length(p.ago_us)
            );
        }
    }
    s
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use gemini_protocol::GroupStatus;

    /// Each group's row names the GPUs it may use: its `Devices=` list, or
    /// `all`.
    #[test]
    fn a_groups_row_names_its_gpus() {
        let group = |name: &str, devices: Option<Vec<u32>>| GroupStatus {
            name: name.into(),
            min_util: 0.25,
            max_util: 1.0,
            memory_limit: u64::MAX,
            clients: 0,
            devices,
            driver_memory: vec![],
        };
        let report = StatusReport {
            server: "test".into(),
            config_path: "/etc/gemini/resource.conf".into(),
            config_error: None,
            window_us: 10_000_000,
            uptime_us: 1,
            groups: vec![group("shard", Some(vec![1, 3])), group("wide", None)],
            devices: vec![],
            clients: vec![],
            reservations: vec![],
            queue: vec![],
            driver_limits: false,
            refused: Vec::new(),
            protocol: gemini_protocol::PROTOCOL_VERSION,
        };
        let text = render(&report);
        let row = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .unwrap_or_else(|| panic!("no row for {name}:\n{text}"))
                .to_string()
        };
        assert!(text.contains("GPUS"), "{text}");
        assert!(row("shard").trim_end().ends_with(" 1,3"), "{text}");
        assert!(row("wide").trim_end().ends_with(" all"), "{text}");
    }

    /// A report of one group, `job` (`MemoryLimit` 1 GiB), whose cgroup
    /// `/slurm/job_7` the driver limits to 1 GiB on GPU `device`, with
    /// 256 MiB counted there; `devices` as given.
    pub(crate) fn driver_limited_job(
        device: u32,
        devices: Vec<gemini_protocol::DeviceStatus>,
    ) -> StatusReport {
        StatusReport {
            server: "test".into(),
            config_path: "/etc/gemini/resource.conf".into(),
            config_error: None,
            window_us: 10_000_000,
            uptime_us: 1,
            groups: vec![GroupStatus {
                name: "job".into(),
                min_util: 0.0,
                max_util: 1.0,
                memory_limit: 1 << 30,
                clients: 1,
                devices: None,
                driver_memory: vec![gemini_protocol::DriverMemory {
                    device,
                    cgroup: "/slurm/job_7".into(),
                    limit: 1 << 30,
                    used: 256 << 20,
                }],
            }],
            devices,
            clients: vec![],
            reservations: vec![],
            queue: vec![],
            driver_limits: true,
            refused: Vec::new(),
            protocol: gemini_protocol::PROTOCOL_VERSION,
        }
    }

    /// alice's `gem-launch reserve` of GPU 1 for group `job`, held for
    /// `for_us` with `left_us` to go.
    fn alices_reservation(for_us: u64, left_us: u64) -> gemini_protocol::ReservationStatus {
        gemini_protocol::ReservationStatus {
            client: 3,
            pid: 0,
            group: "job".into(),
            gpus: gemini_protocol::GpuRequest::Count(1),
            devices: vec![1],
            for_us,
            user: "alice".into(),
            command: String::new(),
            manual: Some(gemini_protocol::ManualReservation {
                user: "alice".into(),
                left_us,
            }),
        }
    }

    /// A reservation made without a program is listed with its user, since
    /// when and until when, under its GPU and with the reservations.
    #[test]
    fn a_reservation_without_a_program_names_its_user_and_end() {
        let mut report = driver_limited_job(0, vec![]);
        report.devices = vec![gemini_protocol::DeviceStatus {
            device: 1,
            busy: 0.0,
            span_us: 10_000_000,
            rtt_us: 150,
            holder: None,
            waiting: 0,
            groups: vec![],
        }];
        report.reservations = vec![alices_reservation(
            65 * 60_000_000,
            175 * 60_000_000 + 30_000_000,
        )];
        let text = render(&report);
        assert!(
            text.contains("reserved for group job: user alice until ")
                && text.contains("(2h 55m left)"),
            "{text}"
        );
        // The device line says the round trip its leads are derived from.
        assert!(
            text.contains(
                "DEVICE 1  busy 0.0% over the last 10 s  token free  waiting 0  round trip 150 µs"
            ),
            "{text}"
        );
        let row = text
            .lines()
            .find(|l| l.contains("[gem-launch reserve]"))
            .unwrap_or_else(|| panic!("{text}"));
        assert!(
            row.contains("user alice")
                && row.contains("holds GPUs [1] since ")
                && row.contains("(1h 5m), until "),
            "{row}"
        );
    }

    /// Another group's process waiting on a reserved GPU is told for whom
    /// it waits; the reserving group's own waiters are not.
    #[test]
    fn a_group_kept_off_a_reserved_gpu_says_for_whom_it_waits() {
        let mut report = driver_limited_job(0, vec![]);
        let row = |group: &str| gemini_protocol::GroupDeviceStatus {
            short_of_min: false,
            group: group.into(),
            share: 0.0,
            memory_used: 0,
            memory_limit: u64::MAX,
            waiting: 1,
            contexts: 0,
        };
        report.devices = vec![gemini_protocol::DeviceStatus {
            device: 1,
            busy: 0.0,
            span_us: 10_000_000,
            rtt_us: 150,
            holder: None,
            waiting: 2,
            groups: vec![row("job"), row("notebook")],
        }];
        report.reservations = vec![alices_reservation(0, 3_600_000_000)];
        let text = render(&report);
        assert!(
            text.contains("notebook waits: GPU 1 is reserved for group job (user alice until "),
            "{text}"
        );
        assert!(!text.contains("job waits:"), "{text}");
    }

    /// The driver's limits are listed per group, GPU and cgroup, with the
    /// driver's count; without them, the status says the hook caps.
    #[test]
    fn the_drivers_limits_are_listed() {
        let mut report = driver_limited_job(1, vec![]);
        let text = render(&report);
        let row = text
            .lines()
            .find(|l| l.contains("/slurm/job_7"))
            .unwrap_or_else(|| panic!("{text}"));
        let words: Vec<&str> = row.split_whitespace().collect();
        assert_eq!(words[..2], ["job", "1"], "{row}");
        assert!(row.contains("256.0 MiB / 1.0 GiB"), "{row}");
        report.driver_limits = false;
        report.groups[0].driver_memory.clear();
        assert!(render(&report).contains("enforced by the hook"));
    }
}
