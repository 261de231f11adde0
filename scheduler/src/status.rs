//! The text form of `gem-schd status`.

use gemini_config::format_size;
use gemini_protocol::StatusReport;
use std::fmt::Write as _;

fn pct(x: f64) -> String {
    format!("{:.1}%", x * 100.0)
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
        "\n{:<16} {:>7} {:>7} {:>12} {:>8}",
        "GROUP", "MIN", "MAX", "MEM LIMIT", "CLIENTS"
    );
    for g in &r.groups {
        let _ = writeln!(
            s,
            "{:<16} {:>7} {:>7} {:>12} {:>8}",
            g.name,
            pct(g.min_util),
            pct(g.max_util),
            format_size(g.memory_limit),
            g.clients
        );
    }
    for d in &r.devices {
        let holder = d
            .holder
            .map_or("free".to_string(), |c| format!("client {c}"));
        let _ = writeln!(
            s,
            "\nDEVICE {}  busy {}  token {}  waiting {}",
            d.device,
            pct(d.busy),
            holder,
            d.waiting
        );
        let _ = writeln!(
            s,
            "  {:<16} {:>8} {:>7} {:>7} {:>24} {:>8}",
            "GROUP", "SHARE", "MIN", "MAX", "MEMORY USED / LIMIT", "WAITING"
        );
        for g in &d.groups {
            let cfg = r.groups.iter().find(|c| c.name == g.group);
            let _ = writeln!(
                s,
                "  {:<16} {:>8} {:>7} {:>7} {:>24} {:>8}",
                g.group,
                pct(g.share),
                cfg.map_or("-".into(), |c| pct(c.min_util)),
                cfg.map_or("-".into(), |c| pct(c.max_util)),
                format!(
                    "{} / {}",
                    format_size(g.memory_used),
                    format_size(g.memory_limit)
                ),
                g.waiting
            );
        }
    }
    if !r.reservations.is_empty() || !r.queue.is_empty() {
        let _ = writeln!(s, "\nRESERVATIONS (gem-launch)");
        for (what, list) in [("holds", &r.reservations), ("waits", &r.queue)] {
            for x in list.iter() {
                let gpus = match (&x.gpus, what) {
                    (_, "holds") => format!("GPUs {:?}", x.devices),
                    (gemini_protocol::GpuRequest::Count(n), _) => format!("{n} GPU(s)"),
                    (gemini_protocol::GpuRequest::Ids(ids), _) => format!("GPUs {ids:?}"),
                };
                let _ = writeln!(
                    s,
                    "  pid {:<8} {:<16} {what} {gpus} for {:.0}s",
                    x.pid,
                    x.group,
                    x.for_us as f64 / 1e6
                );
            }
        }
    }
    let _ = writeln!(s, "\n{} client(s)", r.clients.len());
    for c in &r.clients {
        let _ = writeln!(
            s,
            "  client {:<5} pid {:<8} {:?} {}",
            c.id, c.pid, c.role, c.group
        );
    }
    s
}
