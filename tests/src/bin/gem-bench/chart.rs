//! `gem-bench --chart PATH`: an SVG chart of each group's share of the
//! device over one run, with what it is entitled to as a dashed line.
//!
//! The run, 12 s on the simulator under the hook: groups `a` (`MinUtil`
//! 0.3) and `b` (0.7), one saturating process each; `b` leaves at 4 s
//! (`a` gets the whole device: work-conserving) and comes back at 6 s; at
//! 8 s `resource.conf` is edited live to 0.6 / 0.4. Shares come from the
//! simulator's busy log, in 500 ms bins. After the edit the group whose
//! `MinUtil` rose catches up first: the shares are kept over the
//! scheduler's accounting window (10 s), not bin by bin.

use gemini_tests::{Gemini, SimEnv, field, now_ns, reports};
use plotters::prelude::*;
use std::process::{Child, Stdio};
use std::time::Duration;

const SEC: u64 = 1_000_000_000;
const RUN_S: f64 = 12.0;
const BIN_NS: u64 = 500_000_000;

/// One group's share per bin: (seconds since the start, share).
type Series = Vec<(f64, f64)>;

fn saturating(g: &Gemini, group: &str, seconds: &str) -> Child {
    let mut c = g.hooked(g.sim.workload(), group);
    c.args(["--seconds", seconds, "--kernel-us", "500"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
    c.spawn().unwrap()
}

fn pid(c: Child) -> u32 {
    let out = c.wait_with_output().unwrap();
    assert!(out.status.success(), "a workload of the chart's run failed");
    field(&reports(&out.stdout)[0], "pid") as u32
}

/// Runs the scenario; returns each group's measured shares.
fn run() -> (Series, Series) {
    let g = Gemini::start(SimEnv::default(), "[a]\nMinUtil=0.3\n[b]\nMinUtil=0.7\n");
    let t0 = now_ns();
    let a = saturating(&g, "a", "12");
    let b1 = saturating(&g, "b", "4");
    let b1 = pid(b1);
    std::thread::sleep(Duration::from_nanos(
        (6 * SEC).saturating_sub(now_ns() - t0),
    ));
    let b2 = saturating(&g, "b", "6");
    std::thread::sleep(Duration::from_nanos(
        (8 * SEC).saturating_sub(now_ns() - t0),
    ));
    g.write_conf("[a]\nMinUtil=0.6\n[b]\nMinUtil=0.4\n");
    let (a, b2) = (pid(a), pid(b2));
    let (mut sa, mut sb) = (Vec::new(), Vec::new());
    let bins = (RUN_S * SEC as f64) as u64 / BIN_NS;
    for i in 0..bins {
        let from = t0 + i * BIN_NS;
        let busy = g.sim.busy(0, from, from + BIN_NS);
        let at = (i * BIN_NS + BIN_NS / 2) as f64 / SEC as f64;
        sa.push((at, busy.share(a)));
        sb.push((at, busy.share(b1) + busy.share(b2)));
    }
    (sa, sb)
}

/// What each group is entitled to at `t` s: its MinUtil while both are
/// there, the whole device for `a` alone; none for `b` while away.
fn entitled(t: f64) -> (f64, f64) {
    match t {
        t if t < 4.0 => (0.3, 0.7),
        t if t < 6.0 => (1.0, 0.0),
        t if t < 8.0 => (0.3, 0.7),
        _ => (0.6, 0.4),
    }
}

/// Runs the scenario and writes the chart to `path`; returns, for each
/// phase, the mean shares of `a` and `b` over its settled part: both
/// (1-4 s), `a` alone (4.5-6 s), both again (6.5-8 s), after the edit
/// once the window caught up (10.5-12 s).
pub fn write(path: &std::path::Path) -> Vec<(f64, f64)> {
    let (sa, sb) = run();
    draw(path, &sa, &sb).unwrap_or_else(|e| panic!("writing {}: {e}", path.display()));
    let mean = |s: &Series, from: f64, to: f64| {
        let v: Vec<f64> = s
            .iter()
            .filter(|(t, _)| (from..to).contains(t))
            .map(|&(_, x)| x)
            .collect();
        v.iter().sum::<f64>() / v.len().max(1) as f64
    };
    [(1.0, 4.0), (4.5, 6.0), (6.5, 8.0), (10.5, 12.0)]
        .into_iter()
        .map(|(from, to)| (mean(&sa, from, to), mean(&sb, from, to)))
        .collect()
}

fn draw(
    path: &std::path::Path,
    sa: &Series,
    sb: &Series,
) -> Result<(), Box<dyn std::error::Error>> {
    let root = SVGBackend::new(path, (900, 420)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "Share of one GPU per group (gemini, driver simulator)",
            ("sans-serif", 20),
        )
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0.0..RUN_S, 0.0..1.05)?;
    chart
        .configure_mesh()
        .x_desc("seconds")
        .y_desc("share of the device")
        .light_line_style(WHITE.mix(0.0))
        .draw()?;
    let colours = [RGBColor(31, 119, 180), RGBColor(255, 127, 14)];
    let steps: Vec<f64> = (0..=(RUN_S * 20.0) as usize)
        .map(|i| i as f64 / 20.0)
        .collect();
    for (i, (name, series)) in [("a", sa), ("b", sb)].into_iter().enumerate() {
        let colour = colours[i];
        chart
            .draw_series(LineSeries::new(
                series.iter().copied(),
                colour.stroke_width(2),
            ))?
            .label(format!("group {name}: measured"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(2))
            });
        let want: Vec<(f64, f64)> = steps
            .iter()
            .map(|&t| {
                let (a, b) = entitled(t);
                (t, if i == 0 { a } else { b })
            })
            .collect();
        chart
            .draw_series(DashedLineSeries::new(want, 6, 4, colour.stroke_width(1)))?
            .label(format!("group {name}: entitled"))
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], colour.stroke_width(1))
            });
    }
    for (t, what) in [
        (4.0, "b leaves"),
        (6.0, "b is back"),
        (8.0, "resource.conf: 0.6 / 0.4"),
    ] {
        chart.draw_series(std::iter::once(Text::new(
            what,
            (t + 0.05, 1.02),
            ("sans-serif", 13).into_font(),
        )))?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK.mix(0.3))
        .draw()?;
    root.present()?;
    Ok(())
}
