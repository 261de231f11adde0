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

/// Who holds a device's token: `free`, `pid 42 (train)`, `gem-holder`.
pub(crate) fn token_of(r: &StatusReport, client: Option<gemini_protocol::ClientId>) -> String {
    let Some(id) = client else {
        return "free".into();
    };
    match r.clients.iter().find(|c| c.id == id) {
        Some(c) if c.role == gemini_protocol::Role::Holder => "gem-holder".into(),
        Some(c) => format!("pid {} ({})", c.pid, c.group),
        None => format!("connection {id}"),
    }
}

/// One program: its connections (a hooked process's, and the control
/// connection of the `gem-launch` it runs under, which has its pid) as
/// one row.
struct Program<'a> {
    pid: u32,
    user: &'a str,
    group: &'a str,
    devices: std::collections::BTreeSet<u32>,
    memory: u64,
    gpu_us: u64,
    waiting: std::collections::BTreeSet<u32>,
    token: std::collections::BTreeSet<u32>,
    build: &'a str,
    command: &'a str,
    job: Option<&'a str>,
}

/// The report's programs (by pid, each once), and how many other
/// connections there are (gem-holder, tools).
fn program_rows(r: &StatusReport) -> (Vec<Program<'_>>, usize) {
    use gemini_protocol::Role;
    let mut rows: std::collections::BTreeMap<u32, Program<'_>> = Default::default();
    for c in r.clients.iter().filter(|c| c.role == Role::Client) {
        let p = rows.entry(c.pid).or_insert_with(|| Program {
            pid: c.pid,
            user: &c.user,
            group: &c.group,
            devices: Default::default(),
            memory: 0,
            gpu_us: 0,
            waiting: Default::default(),
            token: Default::default(),
            build: &c.build,
            command: &c.command,
            job: c.job.as_deref(),
        });
        p.devices.extend(&c.devices);
        // Saturating: a hello may claim up to u64::MAX where a group has
        // no MemoryLimit.
        p.memory = c
            .memory
            .iter()
            .fold(p.memory, |a, m| a.saturating_add(m.bytes));
        p.gpu_us = p.gpu_us.saturating_add(c.gpu_us);
        p.waiting.extend(&c.waiting);
        p.token.extend(
            r.devices
                .iter()
                .filter(|d| d.token_client == Some(c.id))
                .map(|d| d.device),
        );
    }
    let others = r
        .clients
        .iter()
        .filter(|c| c.role != Role::Client && !rows.contains_key(&c.pid))
        .count();
    (rows.into_values().collect(), others)
}

/// The programs' table.
fn programs(s: &mut String, r: &StatusReport) {
    let (rows, others) = program_rows(r);
    let _ = writeln!(
        s,
        "\n{} program(s){}",
        rows.len(),
        match others {
            0 => String::new(),
            n => format!("; {n} other connection(s) (gem-holder, gem-launch, tools)"),
        }
    );
    if rows.is_empty() {
        return;
    }
    let _ = writeln!(
        s,
        "  {:<8} {:<12} {:<16} {:<6} {:>9} {:>9} {:<10} {:<8} COMMAND",
        "PID", "USER", "GROUP", "GPUS", "MEMORY", "GPU TIME", "STATE", "VERSION"
    );
    for p in &rows {
        let gpus: Vec<u32> = p.devices.iter().copied().collect();
        // Waiting wins: a program that holds one GPU's token and waits
        // for another's is held up.
        // A scheduler of protocol 15 or older says who holds each token,
        // not who waits.
        let known = r.protocol >= 16;
        let state = if let Some(d) = p.waiting.first().filter(|_| known) {
            format!("waits {d}")
        } else if let Some(d) = p.token.first() {
            format!("runs {d}")
        } else {
            "-".to_string()
        };
        let _ = writeln!(
            s,
            "  {:<8} {:<12} {:<16} {:<6} {:>9} {:>9} {:<10} {:<8} {}{}",
            p.pid,
            if p.user.is_empty() { "-" } else { p.user },
            if p.group.is_empty() { "-" } else { p.group },
            format_gpus(&gpus),
            if known {
                format_size(p.memory)
            } else {
                "-".into()
            },
            if known { seconds(p.gpu_us) } else { "-".into() },
            state,
            if p.build.is_empty() { "-" } else { p.build },
            if p.command.is_empty() { "-" } else { p.command },
            p.job.map(|j| format!("  (job {j})")).unwrap_or_default()
        );
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
        "\n{:<16} {:>7} {:>7} {:>12} {:>8} {:<8}  GPUS",
        "GROUP", "MIN", "MAX", "MEM LIMIT", "CLIENTS", "LATENCY"
    );
    for g in &r.groups {
        let _ = writeln!(
            s,
            "{:<16} {:>7} {:>7} {:>12} {:>8} {:<8}  {}",
            g.name,
            pct(g.min_util),
            pct(g.max_util),
            format_size(g.memory_limit),
            g.clients,
            if g.latency.is_empty() {
                "-"
            } else {
                &g.latency
            },
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
        let _ = writeln!(
            s,
            "\nDEVICE {}  busy {} over the last {}  token {}  waiting {}{}{}",
            d.device,
            pct(d.busy),
            seconds(d.span_us),
            token_of(r, d.token_client),
            d.waiting,
            match d.rtt_us {
                0 => String::new(),
                us => format!("  round trip {us} µs"),
            },
            match (d.memory_free, d.memory_total) {
                (Some(free), Some(total)) => format!(
                    "  memory {} free of {}",
                    format_size(free),
                    format_size(total)
                ),
                _ => String::new(),
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
    programs(&mut s, r);
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
            latency: "normal".into(),
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
                latency: "normal".into(),
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
            token_client: None,
            memory_total: None,
            memory_free: None,
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
            token_client: None,
            memory_total: None,
            memory_free: None,
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

    /// Each program is listed once, though it has two connections (its
    /// hook's and the control connection of the gem-launch it runs
    /// under): with its memory, its device time and what it does; the
    /// device names who holds its token and its memory; a group's
    /// latency class is shown.
    #[test]
    fn each_program_is_one_row_with_its_memory_time_and_state() {
        use gemini_protocol::{ClientStatus, HeldMemory, Role};
        let mut report = driver_limited_job(0, vec![]);
        report.groups[0].latency = "critical".into();
        let conn = |id: u64, pid: u32, role: Role| ClientStatus {
            id,
            pid,
            role,
            group: if role == Role::Client {
                "job".into()
            } else {
                String::new()
            },
            job: None,
            user: "alice".into(),
            command: "python train.py".into(),
            devices: vec![0],
            protocol: gemini_protocol::PROTOCOL_VERSION,
            build: "0.2.0".into(),
            waiting: vec![],
            memory: if role == Role::Client {
                vec![HeldMemory {
                    device: 0,
                    bytes: 1 << 30,
                }]
            } else {
                vec![]
            },
            gpu_us: if role == Role::Client { 12_500_000 } else { 0 },
        };
        let mut waiting = conn(4, 51, Role::Client);
        waiting.waiting = vec![0];
        report.clients = vec![
            conn(1, 50, Role::Control),
            conn(2, 50, Role::Client),
            conn(3, 60, Role::Holder),
            waiting,
        ];
        report.devices = vec![gemini_protocol::DeviceStatus {
            device: 0,
            busy: 0.5,
            span_us: 10_000_000,
            rtt_us: 0,
            token_client: Some(2),
            memory_total: Some(80 << 30),
            memory_free: Some(60 << 30),
            waiting: 1,
            groups: vec![],
        }];
        let text = render(&report);
        assert!(
            text.contains(
                "\n2 program(s); 1 other connection(s) (gem-holder, gem-launch, tools)\n"
            ),
            "{text}"
        );
        let row = |pid: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with(pid))
                .unwrap_or_else(|| panic!("no row of {pid}:\n{text}"))
                .to_string()
        };
        assert_eq!(text.matches("python train.py").count(), 2, "{text}");
        assert!(
            row("50 ").contains("1.0 GiB") && row("50 ").contains("12 s"),
            "{text}"
        );
        assert!(row("50 ").contains("runs 0"), "{text}");
        assert!(row("51 ").contains("waits 0"), "{text}");
        assert!(
            text.contains("token pid 50 (job)")
                && text.contains("memory 60.0 GiB free of 80.0 GiB"),
            "{text}"
        );
        let group = text.lines().find(|l| l.starts_with("job ")).unwrap();
        assert!(group.contains("critical"), "{text}");
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
