//! `gem-schd top`: a live terminal view of the scheduler, in the manner of
//! nvtop: per device, a bar per group (its share of the device against
//! its MinUtil and MaxUtil), its memory against its limit, its waiting
//! processes and a sparkline of its last minute; the holder in a colour of
//! its own. Built on ratatui (crossterm); fits 80×24 and works over ssh.
//! What is drawn is computed by [`view`], free of the terminal.

use crate::client::Client;
use crate::policy::HOLDER_SHOWN as HOLDER;
use gemini_config::format_size;
use gemini_protocol::{Reply, Request, StatusReport};
use ratatui::crossterm::event::{self, Event, KeyCode, KeyEventKind, KeyModifiers};
use ratatui::style::{Color, Modifier, Style};
use ratatui::text::{Line, Span};
use ratatui::widgets::Paragraph;
use std::collections::{BTreeMap, VecDeque};
use std::path::Path;
use std::time::{Duration, Instant};

/// Samples kept per group and device: a minute at one a second.
const HISTORY: usize = 60;
const NAME_W: usize = 12;
const BAR_W: usize = 16;
const SPARK_W: usize = 12;

/// Shares of the last minute, per (device, group), oldest first.
#[derive(Debug, Default)]
pub struct History(BTreeMap<(u32, String), VecDeque<f64>>);

impl History {
    /// Adds one sample of every group on every device of `st`; groups
    /// gone from a device keep their past until it scrolls out.
    pub fn push(&mut self, st: &StatusReport) {
        let mut seen = Vec::new();
        for d in &st.devices {
            for g in &d.groups {
                let key = (d.device, g.group.clone());
                let h = self.0.entry(key.clone()).or_default();
                h.push_back(g.share);
                while h.len() > HISTORY {
                    h.pop_front();
                }
                seen.push(key);
            }
        }
        for (k, h) in self.0.iter_mut() {
            if !seen.contains(k) {
                h.push_back(0.0);
                while h.len() > HISTORY {
                    h.pop_front();
                }
            }
        }
        self.0.retain(|_, h| h.iter().any(|&x| x > 0.0));
    }

    fn of(&self, device: u32, group: &str) -> Option<&VecDeque<f64>> {
        self.0.get(&(device, group.to_string()))
    }
}

/// The last `width` samples as block characters (0..1 → ▁..█).
fn sparkline(h: Option<&VecDeque<f64>>, width: usize) -> String {
    const BLOCKS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let Some(h) = h else {
        return " ".repeat(width);
    };
    let take = h.len().min(width);
    let mut s = " ".repeat(width - take);
    for &x in h.iter().skip(h.len() - take) {
        let i = (x.clamp(0.0, 1.0) * 7.0).round() as usize;
        s.push(BLOCKS[i]);
    }
    s
}

/// A bar of `width` cells: the share filled, `|` at the minimum, `]` at
/// the maximum (when below 1).
fn bar(share: f64, min: f64, max: f64, width: usize) -> String {
    let cell = |x: f64| ((x.clamp(0.0, 1.0) * width as f64).round() as usize).min(width);
    let filled = cell(share);
    let mut cells: Vec<char> = (0..width)
        .map(|i| if i < filled { '█' } else { '·' })
        .collect();
    if min > 0.0 {
        let i = cell(min).saturating_sub(1);
        cells[i] = if i < filled { '▌' } else { '|' };
    }
    if max < 1.0 {
        let i = cell(max).min(width - 1);
        if i >= filled {
            cells[i] = ']';
        }
    }
    cells.into_iter().collect()
}

/// `1.5G`, `512.0M`: a size in a narrow column.
fn short_size(bytes: u64) -> String {
    format_size(bytes)
        .replace(" GiB", "G")
        .replace(" MiB", "M")
        .replace(" KiB", "K")
        .replace(" TiB", "T")
}

fn pct(x: f64) -> String {
    format!("{:>3.0}%", x * 100.0)
}

fn fit(s: &str, w: usize) -> String {
    let n = s.chars().count();
    if n <= w {
        format!("{s:<w$}")
    } else {
        let mut t: String = s.chars().take(w - 1).collect();
        t.push('…');
        t
    }
}

/// The lines of the view.
pub fn view(st: &StatusReport, history: &History, note: Option<&str>) -> Vec<Line<'static>> {
    let dim = Style::default().add_modifier(Modifier::DIM);
    let bold = Style::default().add_modifier(Modifier::BOLD);
    let mut lines = vec![Line::from(vec![
        Span::styled("gem-schd top", bold),
        Span::raw(format!(
            "  {}  window {}s  up {}s  ",
            st.config_path,
            st.window_us / 1_000_000,
            st.uptime_us / 1_000_000
        )),
        Span::styled("q quits", dim),
    ])];
    if let Some(n) = note {
        lines.push(Line::styled(n.to_string(), Style::default().fg(Color::Red)));
    }
    if let Some(e) = &st.config_error {
        let first = e.lines().next().unwrap_or("");
        lines.push(Line::styled(
            format!("config error (previous one in force): {first}"),
            Style::default().fg(Color::Red),
        ));
    }
    let config: BTreeMap<&str, _> = st.groups.iter().map(|g| (g.name.as_str(), g)).collect();
    let critical = |name: &str| config.get(name).is_some_and(|c| c.latency == "critical");
    if st.devices.is_empty() {
        lines.push(Line::raw(""));
        lines.push(Line::styled("no device has seen a request yet", dim));
    }
    for d in &st.devices {
        lines.push(Line::raw(""));
        lines.push(Line::from(vec![
            Span::styled(format!("GPU {}", d.device), bold),
            Span::raw(format!(
                "  busy {} over {:.0} s  token: {}  waiting {}{}",
                pct(d.busy),
                d.span_us as f64 / 1e6,
                crate::status::token_of(st, d.token_client),
                d.waiting,
                match (d.memory_free, d.memory_total) {
                    (Some(free), Some(total)) => {
                        format!("  free {}/{}", short_size(free), short_size(total))
                    }
                    _ => String::new(),
                }
            )),
        ]));
        lines.push(Line::styled(
            format!(
                "  {:<NAME_W$} {:<BAR_W$} {:>4} {:>9} {:>15} {:>2} last minute",
                "GROUP", "SHARE |min ]max", "", "MIN-MAX", "MEMORY", "W"
            ),
            dim,
        ));
        for g in &d.groups {
            let holder = g.group == HOLDER;
            let (min, max) = config
                .get(g.group.as_str())
                .map_or((0.0, 1.0), |c| (c.min_util, c.max_util));
            let colour = if holder {
                Color::Blue
            } else if g.short_of_min {
                Color::Yellow
            } else {
                Color::Green
            };
            let mem = if g.memory_limit == u64::MAX {
                short_size(g.memory_used)
            } else {
                format!(
                    "{}/{}",
                    short_size(g.memory_used),
                    short_size(g.memory_limit)
                )
            };
            let limits = if holder {
                "leftover".to_string()
            } else {
                format!("{:.0}-{:.0}%", min * 100.0, max * 100.0)
            };
            lines.push(Line::from(vec![
                Span::raw("  "),
                Span::styled(
                    // A latency-critical group is marked (see the legend).
                    fit(
                        &if critical(g.group.as_str()) {
                            format!("{}*", g.group)
                        } else {
                            g.group.clone()
                        },
                        NAME_W,
                    ),
                    if holder {
                        Style::default().fg(Color::Blue)
                    } else {
                        bold
                    },
                ),
                Span::raw(" "),
                Span::styled(bar(g.share, min, max, BAR_W), Style::default().fg(colour)),
                Span::raw(format!(
                    " {} {:>9} {:>15} {:>2} ",
                    pct(g.share),
                    limits,
                    fit(&mem, 15).trim_end(),
                    g.waiting
                )),
                Span::styled(
                    sparkline(history.of(d.device, &g.group), SPARK_W),
                    Style::default().fg(colour),
                ),
            ]));
            // What the driver itself enforces for the group's cgroups here.
            let driver = config
                .get(g.group.as_str())
                .map(|c| c.driver_memory.iter().filter(|m| m.device == d.device));
            for m in driver.into_iter().flatten() {
                lines.push(Line::styled(
                    fit(
                        &format!(
                            "    driver limit {}/{} for cgroup {}",
                            short_size(m.used),
                            short_size(m.limit),
                            m.cgroup
                        ),
                        78,
                    )
                    .trim_end()
                    .to_string(),
                    dim,
                ));
            }
        }
    }
    let idle: Vec<&str> = st
        .groups
        .iter()
        .filter(|g| {
            !st.devices
                .iter()
                .any(|d| d.groups.iter().any(|x| x.group == g.name))
        })
        .map(|g| g.name.as_str())
        .collect();
    lines.push(Line::raw(""));
    lines.push(Line::styled(
        format!(
            "{} program(s); {} group(s){}{}",
            st.clients
                .iter()
                .filter(|c| c.role == gemini_protocol::Role::Client)
                .map(|c| c.pid)
                .collect::<std::collections::BTreeSet<u32>>()
                .len(),
            st.groups.len(),
            if idle.is_empty() {
                String::new()
            } else {
                format!(", idle: {}", idle.join(", "))
            },
            if st.groups.iter().any(|g| g.latency == "critical") {
                "; *: Latency=critical"
            } else {
                ""
            }
        ),
        dim,
    ));
    lines
}

fn fetch(client: &mut Client) -> anyhow::Result<StatusReport> {
    match client.request(&Request::Status, Duration::from_secs(2))? {
        Reply::Status(r) => Ok(*r),
        other => anyhow::bail!("unexpected answer to status: {other:?}"),
    }
}

/// Runs the view until `q`, Esc or Ctrl-C.
pub fn run(ipc_dir: &Path, interval: Duration) -> anyhow::Result<()> {
    use std::io::IsTerminal as _;
    // A full-screen view needs a terminal on both sides (ratatui panics
    // without one): say so in one line instead.
    if !(std::io::stdin().is_terminal() && std::io::stdout().is_terminal()) {
        anyhow::bail!(
            "top needs a terminal; use `gem-schd status --watch SECONDS` (or `--json`) for a file or a pipe"
        );
    }
    let mut client = Client::connect_now(ipc_dir)?;
    // Fail before taking over the terminal when no scheduler answers.
    let mut last = fetch(&mut client)?;
    let mut history = History::default();
    history.push(&last);
    let mut terminal = ratatui::init();
    let result = (|| -> anyhow::Result<()> {
        let mut note: Option<String> = None;
        let mut next = Instant::now() + interval;
        loop {
            terminal.draw(|f| {
                let lines = view(&last, &history, note.as_deref());
                f.render_widget(Paragraph::new(lines), f.area());
            })?;
            let wait = next.saturating_duration_since(Instant::now());
            if event::poll(wait)? {
                if let Event::Key(k) = event::read()?
                    && k.kind == KeyEventKind::Press
                    && (matches!(k.code, KeyCode::Char('q') | KeyCode::Esc)
                        || (k.code == KeyCode::Char('c')
                            && k.modifiers.contains(KeyModifiers::CONTROL)))
                {
                    return Ok(());
                }
                continue;
            }
            next = Instant::now() + interval;
            match fetch(&mut client) {
                Ok(st) => {
                    history.push(&st);
                    last = st;
                    note = None;
                }
                Err(e) => {
                    note = Some(format!("{e}; showing the last answer"));
                    if let Ok(c) = Client::connect(ipc_dir) {
                        client = c;
                    }
                }
            }
        }
    })();
    ratatui::restore();
    result
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bars_mark_the_minimum_and_maximum() {
        assert_eq!(bar(0.5, 0.25, 0.75, 8), "█▌██··]·");
        assert_eq!(bar(0.0, 0.5, 1.0, 4), "·|··");
        assert_eq!(bar(1.0, 0.0, 1.0, 4), "████");
    }

    #[test]
    fn sparklines_show_the_latest_samples_right_aligned() {
        let h: VecDeque<f64> = [0.0, 0.5, 1.0].into_iter().collect();
        assert_eq!(sparkline(Some(&h), 5), "  ▁▅█");
        assert_eq!(sparkline(Some(&h), 2), "▅█");
        assert_eq!(sparkline(None, 3), "   ");
    }

    /// Under a group's row on a GPU, the limit the driver enforces there
    /// for each of its cgroups, with the driver's count.
    #[test]
    fn the_drivers_limits_show_under_their_group() {
        use gemini_protocol::{DeviceStatus, GroupDeviceStatus};
        let report = crate::status::tests::driver_limited_job(
            0,
            vec![DeviceStatus {
                device: 0,
                busy: 0.5,
                span_us: 10_000_000,
                rtt_us: 150,
                token_client: None,
                memory_total: None,
                memory_free: None,
                waiting: 0,
                groups: vec![GroupDeviceStatus {
                    short_of_min: false,
                    group: "job".into(),
                    share: 0.5,
                    memory_used: 256 << 20,
                    contexts: 0,
                    memory_limit: 1 << 30,
                    waiting: 0,
                }],
            }],
        );
        let lines: Vec<String> = view(&report, &History::default(), None)
            .iter()
            .map(|l| l.spans.iter().map(|s| s.content.as_ref()).collect())
            .collect();
        let at = lines
            .iter()
            .position(|l| l.trim_start().starts_with("job"))
            .unwrap_or_else(|| panic!("{lines:#?}"));
        assert!(
            lines[at + 1].contains("driver limit") && lines[at + 1].contains("/slurm/job_7"),
            "{lines:#?}"
        );
        assert!(lines.iter().all(|l| l.chars().count() <= 80), "{lines:#?}");
    }
}
