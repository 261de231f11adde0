//! `gem-schd --metrics`: the Prometheus text it serves while groups run
//! on the simulator, checked here by reading it; and, with a real
//! Prometheus scraping it (`make test-prometheus`, ignored otherwise),
//! that what Prometheus stored is what the scheduler served.

use gemini_tests::{Gemini, SimEnv, bin};
use std::io::{Read, Write};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The body of `GET http://addr{path}`.
pub(crate) fn get(addr: &str, path: &str) -> String {
    fetch(addr, path, None).1
}

/// `GET http://addr{path}` with `accept` as its Accept header: the
/// response's Content-Type and its body.
pub(crate) fn fetch(addr: &str, path: &str, accept: Option<&str>) -> (String, String) {
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let accept = accept.map_or(String::new(), |a| format!("Accept: {a}\r\n"));
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{accept}\r\n").unwrap();
    let mut text = String::new();
    s.read_to_string(&mut text).unwrap();
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    assert!(
        head.starts_with("HTTP/1.") && head.contains(" 200 "),
        "{head}"
    );
    let kind = head
        .lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("content-type")
                .then(|| v.trim().to_string())
        })
        .unwrap_or_default();
    (kind, body.to_string())
}

/// What Prometheus asks for (its default scrape protocols).
const PROMETHEUS_ACCEPT: &str = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";

/// The address the scheduler's log says the metrics are served at.
pub(crate) fn metrics_addr(g: &Gemini) -> String {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let log = g.log();
        if let Some(rest) = log.split("metrics at http://").nth(1) {
            return rest.split('/').next().unwrap().to_string();
        }
        assert!(
            Instant::now() < deadline,
            "no metrics address in the log: {log}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// The value of the sample `name{labels}` (labels as written, in order).
pub(crate) fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
        .map(|v| v.trim().parse().unwrap())
}

/// A hooked workload of `group` running 1 ms kernels for `seconds`.
pub(crate) fn workload(g: &Gemini, group: &str, seconds: &str) -> Child {
    let mut c = g.hooked(g.sim.workload(), group);
    c.args(["--seconds", seconds, "--kernel-us", "1000"])
        .stdout(Stdio::null())
        .stderr(Stdio::piped());
    c.spawn().unwrap()
}

#[test]
fn metrics_describe_groups_devices_tokens_and_reloads() {
    let g = Gemini::start_with(
        SimEnv::default(),
        "[a]\nMinUtil=0.3\n[b]\nMinUtil=0.7\nMemoryLimit=2GiB\n[idle]\nMaxUtil=0.5\nMemoryLimit=unlimited\n",
        &["--metrics", "127.0.0.1:0"],
    );
    let addr = metrics_addr(&g);
    let t0 = gemini_tests::now_ns();
    let (a, b) = (workload(&g, "a", "3"), workload(&g, "b", "3"));
    let pids = [("a", a.id()), ("b", b.id())];
    std::thread::sleep(Duration::from_millis(2500));
    let text = get(&addr, "/metrics");
    for mut c in [a, b] {
        assert!(c.wait().unwrap().success());
    }
    // Each group's GPU time counter is the device time its kernels ran,
    // as the simulator logged it (the counter follows the ledger about
    // once a second).
    let busy = g.sim.busy(0, t0, gemini_tests::now_ns());
    for (group, pid) in pids {
        let ran = busy.per_pid.get(&pid).copied().unwrap_or(0) as f64 / 1e9;
        let series = format!("gemini_group_gpu_seconds_total{{group=\"{group}\",device=\"0\"}}");
        let deadline = Instant::now() + Duration::from_secs(5);
        let counted = loop {
            let counted = sample(&get(&addr, "/metrics"), &series).unwrap_or(0.0);
            if (counted - ran).abs() <= 0.05 * ran + 0.05 || Instant::now() > deadline {
                break counted;
            }
            std::thread::sleep(Duration::from_millis(200));
        };
        assert!(
            ran > 0.1 && (counted - ran).abs() <= 0.05 * ran + 0.05,
            "{group}: {counted:.3} s counted, {ran:.3} s ran on the simulator"
        );
    }
    let v =
        |series: &str| sample(&text, series).unwrap_or_else(|| panic!("no {series} in:\n{text}"));
    assert_eq!(v("gemini_group_min_util_ratio{group=\"a\"}"), 0.3);
    assert_eq!(v("gemini_group_max_util_ratio{group=\"idle\"}"), 0.5);
    assert_eq!(
        v("gemini_group_memory_limit_bytes{group=\"b\"}"),
        2147483648.0
    );
    assert_eq!(
        v("gemini_group_memory_limit_bytes{group=\"idle\"}"),
        f64::INFINITY
    );
    assert_eq!(v("gemini_group_clients{group=\"a\"}"), 1.0);
    assert_eq!(v("gemini_group_clients{group=\"idle\"}"), 0.0);
    let (sa, sb) = (
        v("gemini_group_share_ratio{group=\"a\",device=\"0\"}"),
        v("gemini_group_share_ratio{group=\"b\",device=\"0\"}"),
    );
    assert!(sa > 0.0 && sb > sa, "shares a {sa}, b {sb}");
    // Whether the shares meet MinUtil is for the share tests and `make
    // bench`: the gauges are refreshed once a second, so no figure here is
    // the scheduler's of the same instant.
    assert!(v("gemini_device_busy_ratio{device=\"0\"}") > 0.5);
    let grants = v("gemini_group_token_grants_total{group=\"a\",device=\"0\"}");
    assert!(grants >= 1.0, "{text}");
    // Every grant's wait is in the histogram.
    assert_eq!(
        v("gemini_group_token_wait_seconds_count{group=\"a\",device=\"0\"}"),
        grants
    );
    assert!(
        sample(
            &text,
            "gemini_group_throttled_seconds_total{group=\"a\",device=\"0\"}"
        )
        .is_some()
    );
    assert!(v("gemini_request_handling_seconds_count") > 10.0);
    assert_eq!(v("gemini_config_last_reload_ok"), 1.0);
    // Every result counted from the start: an alert on the increase of
    // errors sees the first.
    assert_eq!(v("gemini_config_reloads_total{result=\"error\"}"), 0.0);
    assert_eq!(v("gemini_group_processes{group=\"a\"}"), 1.0);
    assert_eq!(v("gemini_group_reserved_gpus{group=\"b\"}"), 0.0);
    assert_eq!(v("gemini_queue_launches"), 0.0);
    assert_eq!(v("gemini_holder_share_ratio{device=\"0\"}"), 0.0);
    // A scraper that asks for nothing (curl) gets the text format every
    // scraper reads; Prometheus, which asks for OpenMetrics, gets it.
    assert!(!text.contains("# EOF"), "{text}");
    assert!(text.contains("# TYPE gemini_group_token_grants_total counter\n"));
    let (kind, om) = fetch(&addr, "/metrics", Some(PROMETHEUS_ACCEPT));
    assert!(kind.starts_with("application/openmetrics-text"), "{kind}");
    assert!(
        om.trim_end().ends_with("# EOF"),
        "OpenMetrics ends with # EOF"
    );
    let (kind, _) = fetch(&addr, "/metrics", Some("text/plain;version=0.0.4"));
    assert!(kind.starts_with("text/plain; version=0.0.4"), "{kind}");

    // A broken edit: counted, and the last reload shows it.
    g.write_conf("[a]\nMinUtil=2\n");
    let deadline = Instant::now() + Duration::from_secs(5);
    let text = loop {
        let t = get(&addr, "/metrics");
        if sample(&t, "gemini_config_reloads_total{result=\"error\"}") == Some(1.0) {
            break t;
        }
        assert!(
            Instant::now() < deadline,
            "the broken reload never showed:\n{t}"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert_eq!(sample(&text, "gemini_config_last_reload_ok"), Some(0.0));
    assert_eq!(sample(&text, "gemini_config_errors"), Some(1.0));
}

#[test]
fn a_bad_metrics_address_stops_the_scheduler_at_start() {
    let sim = SimEnv::default();
    let conf = sim.path().join("r.conf");
    std::fs::write(&conf, "[a]\n").unwrap();
    let out = Command::new(bin("gem-schd"))
        .env("GEMINI_SETTINGS", "/dev/null")
        .arg("--config")
        .arg(&conf)
        .arg("--ipc-dir")
        .arg(sim.path().join("ipc"))
        .args(["--metrics", "localhost"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Bad usage, naming the flag (not the settings file, /dev/null here).
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(
        err.contains("invalid value 'localhost' for '--metrics <ADDR>': expected an address and port such as \"127.0.0.1:9400\""),
        "{err}"
    );
    assert!(!err.contains("/dev/null"), "{err}");
    // The same address in the settings file names the file.
    let settings = sim.path().join("gemini.toml");
    std::fs::write(&settings, "metrics = \"localhost\"\n").unwrap();
    let out = Command::new(bin("gem-schd"))
        .env("GEMINI_SETTINGS", &settings)
        .arg("--config")
        .arg(&conf)
        .arg("--ipc-dir")
        .arg(sim.path().join("ipc"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(
        err.contains(&format!(
            "{}: metrics: expected an address and port",
            settings.display()
        )),
        "{err}"
    );
}

/// Where `prometheus` is, unless this machine lacks it.
fn prometheus() -> Option<std::path::PathBuf> {
    ["/usr/bin/prometheus", "/usr/local/bin/prometheus"]
        .into_iter()
        .map(std::path::PathBuf::from)
        .find(|p| p.exists())
}

/// Serves gem-schd's metrics from `target` at a port of its own, and keeps
/// every body it served: what a scraper got, scrape by scrape.
struct Recorder {
    addr: String,
    served: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl Recorder {
    fn start(target: String) -> Recorder {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap().to_string();
        let served = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let keep = served.clone();
        std::thread::spawn(move || {
            for conn in l.incoming() {
                let Ok(mut conn) = conn else { continue };
                // The request's head; its path is not looked at, its
                // Accept header is passed on.
                let mut head = Vec::new();
                let mut byte = [0u8; 1];
                while !head.ends_with(b"\r\n\r\n") && conn.read(&mut byte).unwrap_or(0) == 1 {
                    head.push(byte[0]);
                }
                let head = String::from_utf8_lossy(&head).into_owned();
                let accept = head.lines().find_map(|l| {
                    let (k, v) = l.split_once(':')?;
                    k.eq_ignore_ascii_case("accept")
                        .then(|| v.trim().to_string())
                });
                let (kind, body) = fetch(&target, "/metrics", accept.as_deref());
                keep.lock().unwrap().push(body.clone());
                let _ = write!(
                    conn,
                    "HTTP/1.0 200 OK\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                    body.len()
                );
            }
        });
        Recorder { addr, served }
    }

    /// The values of `series` in the bodies served so far, in order.
    fn values(&self, series: &str) -> Vec<f64> {
        let served = self.served.lock().unwrap();
        served.iter().filter_map(|b| sample(b, series)).collect()
    }
}

/// The samples Prometheus stored of `series` (a PromQL selector, already
/// URL-encoded) over the last minute, read back through its HTTP API.
fn stored(query: &dyn Fn(&str) -> String, series: &str) -> Vec<f64> {
    let body = query(&format!("{series}%5B1m%5D"));
    let Some(values) = body.split("\"values\":[").nth(1) else {
        return Vec::new();
    };
    let values = values.split("]]").next().unwrap_or("");
    values
        .split('[')
        .filter_map(|pair| pair.split('"').nth(1))
        .map(|v| v.parse().unwrap())
        .collect()
}

/// A real Prometheus scrapes gem-schd every second while two groups of
/// MinUtil 0.3 and 0.7 run. Every sample it stored of each group's share,
/// grant count and the device's busy ratio, read back through its HTTP
/// API, is one gem-schd served (a recording proxy sits between them), and
/// it stored at least three scrapes of the run. The shares themselves are
/// measured by `make bench`, not here: this checks the path, not the
/// timing.
#[test]
#[ignore = "needs Prometheus: run `make test-prometheus`"]
fn prometheus_stores_what_the_scheduler_served() {
    let Some(prom) = prometheus() else {
        eprintln!(
            "SKIPPED prometheus_stores_what_the_scheduler_served: no prometheus binary (apt-get install prometheus)"
        );
        return;
    };
    let g = Gemini::start_with(
        SimEnv::default(),
        "[a]\nMinUtil=0.3\nMemoryLimit=4GiB\n[b]\nMinUtil=0.7\n",
        &["--metrics", "127.0.0.1:0"],
    );
    let recorder = Recorder::start(metrics_addr(&g));
    promtool_reads(&metrics_addr(&g));
    let dir = g.sim.path().join("prometheus");
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(
        dir.join("prometheus.yml"),
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: gemini\n    static_configs:\n      - targets: ['{}']\n",
            recorder.addr
        ),
    )
    .unwrap();
    let web = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let mut server = Command::new(prom)
        .arg(format!(
            "--config.file={}",
            dir.join("prometheus.yml").display()
        ))
        .arg(format!(
            "--storage.tsdb.path={}",
            dir.join("data").display()
        ))
        .arg(format!("--web.listen-address={web}"))
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(dir.join("log")).unwrap())
        .spawn()
        .unwrap();
    struct Kill<'a>(&'a mut Child);
    impl Drop for Kill<'_> {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let _kill = Kill(&mut server);
    let query = |q: &str| get(&web, &format!("/api/v1/query?query={q}"));
    let prom_log = || std::fs::read_to_string(dir.join("log")).unwrap_or_default();
    let deadline = Instant::now() + Duration::from_secs(30);
    while std::net::TcpStream::connect(&web).is_err() || !query("up").contains("\"value\":[") {
        assert!(
            Instant::now() < deadline,
            "prometheus did not come up: {}",
            prom_log()
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let share_a = "gemini_group_share_ratio{group=\"a\",device=\"0\"}";
    let share_b = "gemini_group_share_ratio{group=\"b\",device=\"0\"}";
    let (a, b) = (workload(&g, "a", "6"), workload(&g, "b", "6"));
    // Three scrapes that saw both groups at work, however slow the host.
    let deadline = Instant::now() + Duration::from_secs(60);
    while recorder
        .values(share_a)
        .iter()
        .zip(recorder.values(share_b))
        .filter(|(a, b)| **a > 0.0 && *b > 0.0)
        .count()
        < 3
    {
        assert!(
            Instant::now() < deadline,
            "three scrapes never saw both groups"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    for mut c in [a, b] {
        assert!(c.wait().unwrap().success());
    }
    let series = [
        (share_a, "gemini_group_share_ratio%7Bgroup%3D%22a%22%7D"),
        (share_b, "gemini_group_share_ratio%7Bgroup%3D%22b%22%7D"),
        (
            "gemini_group_token_grants_total{group=\"a\",device=\"0\"}",
            "gemini_group_token_grants_total%7Bgroup%3D%22a%22%7D",
        ),
        (
            "gemini_device_busy_ratio{device=\"0\"}",
            "gemini_device_busy_ratio%7Bdevice%3D%220%22%7D",
        ),
    ];
    for (series, selector) in series {
        // Prometheus makes a scrape queryable a moment after taking it.
        let deadline = Instant::now() + Duration::from_secs(30);
        let got = loop {
            let got = stored(&query, selector);
            if got.iter().filter(|v| **v > 0.0).count() >= 3 {
                break got;
            }
            assert!(
                Instant::now() < deadline,
                "Prometheus stored {got:?} of {series}; gem-schd served {:?}\n{}",
                recorder.values(series),
                prom_log()
            );
            std::thread::sleep(Duration::from_millis(200));
        };
        let served = recorder.values(series);
        for v in &got {
            assert!(
                served.contains(v),
                "Prometheus stored {v} of {series}, which gem-schd never served: {served:?}"
            );
        }
    }
    dashboard_queries_return_data(&query);
}

/// `promtool check metrics` finds nothing wrong with the text gem-schd
/// serves a scraper that asks for nothing in particular (the text format
/// 0.0.4, which promtool reads).
fn promtool_reads(addr: &str) {
    let Some(promtool) = ["/usr/bin/promtool", "/usr/local/bin/promtool"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists())
    else {
        panic!("no promtool beside prometheus (apt-get install prometheus)");
    };
    let text = get(addr, "/metrics");
    let mut check = Command::new(promtool)
        .args(["check", "metrics"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    check
        .stdin
        .take()
        .unwrap()
        .write_all(text.as_bytes())
        .unwrap();
    let out = check.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "promtool check metrics: {}{}\n{text}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The Grafana dashboard (`deploy/grafana/gemini-dashboard.json`) is one
/// of the current schema, and every query of its panels, run against the
/// Prometheus that scraped gem-schd while two groups ran, returns data.
fn dashboard_queries_return_data(query: &dyn Fn(&str) -> String) {
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../deploy/grafana/gemini-dashboard.json");
    let dash: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    assert!(
        dash["schemaVersion"].as_u64().unwrap_or(0) >= 36,
        "schemaVersion"
    );
    assert!(dash["uid"].is_string() && dash["title"].is_string());
    let vars: Vec<&str> = dash["templating"]["list"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|v| v["name"].as_str())
        .collect();
    let panels = dash["panels"].as_array().unwrap();
    let mut exprs = Vec::new();
    for p in panels {
        let title = p["title"].as_str().unwrap_or("?");
        let pos = &p["gridPos"];
        for k in ["h", "w", "x", "y"] {
            assert!(pos[k].is_u64(), "panel {title}: gridPos.{k}");
        }
        if p["type"] == "row" {
            continue;
        }
        let targets = p["targets"]
            .as_array()
            .unwrap_or_else(|| panic!("panel {title}: no targets"));
        assert!(!targets.is_empty(), "panel {title}: no targets");
        for t in targets {
            let expr = t["expr"]
                .as_str()
                .unwrap_or_else(|| panic!("panel {title}: no expr"));
            assert!(t["refId"].is_string(), "panel {title}: refId");
            exprs.push((title.to_string(), expr.to_string()));
        }
    }
    assert!(exprs.len() >= 10, "{} queries", exprs.len());
    for (title, expr) in exprs {
        // The dashboard's variables as "All" selects them.
        let mut q = expr.replace("$__rate_interval", "1m");
        for v in &vars {
            q = q.replace(&format!("${v}"), ".*");
        }
        assert!(
            !q.contains('$'),
            "panel {title}: unknown variable in {expr}"
        );
        let encoded: String = q
            .bytes()
            .map(|b| match b {
                b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                    (b as char).to_string()
                }
                _ => format!("%{b:02X}"),
            })
            .collect();
        let body = query(&encoded);
        assert!(
            body.contains("\"status\":\"success\"") && body.contains("\"metric\":"),
            "panel {title}: {q} returned no data: {body}"
        );
    }
}

/// The holder's time and memory have metrics of their own and are in no
/// group's.
#[test]
fn the_holder_is_counted_apart_from_the_groups() {
    let g = Gemini::start_with(
        SimEnv::new(1, "4GiB"),
        "[a]\n",
        &["--metrics", "127.0.0.1:0"],
    );
    let addr = metrics_addr(&g);
    let mut holder = g
        .holder(&[
            "run",
            "--wait-minutes",
            "0",
            "--hold-util",
            "0.5",
            "--hold-mem",
            "1GiB",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    g.wait_holder("holding its memory", |s| {
        s.contains("\"held_bytes\": 1073741824")
    });
    let deadline = Instant::now() + Duration::from_secs(10);
    let text = loop {
        let t = get(&addr, "/metrics");
        let share = sample(&t, "gemini_holder_share_ratio{device=\"0\"}").unwrap_or(0.0);
        if share > 0.0 && sample(&t, "gemini_holder_memory_bytes{device=\"0\"}").is_some() {
            break t;
        }
        assert!(Instant::now() < deadline, "no holder figures:\n{t}");
        std::thread::sleep(Duration::from_millis(200));
    };
    let _ = holder.kill();
    let _ = holder.wait();
    assert_eq!(
        sample(&text, "gemini_holder_memory_bytes{device=\"0\"}"),
        Some(1073741824.0)
    );
    assert!(
        sample(&text, "gemini_holder_token_grants_total{device=\"0\"}").unwrap_or(0.0) >= 1.0,
        "{text}"
    );
    assert!(
        !text.contains("(holder)"),
        "the holder in a group's metrics:\n{text}"
    );
}

/// Where the driver enforces a group's `MemoryLimit` on its cgroups (R615),
/// the metrics say so, with each limit and the driver's count of what the
/// cgroup holds; before R615 they say the hook alone caps.
#[test]
fn metrics_show_the_drivers_memory_limits() {
    let cg = gemini_tests::own_cgroup();
    for (sim, driver) in [
        (SimEnv::new(1, "1GiB").r615(), 1.0),
        (SimEnv::new(1, "1GiB"), 0.0),
    ] {
        let g = Gemini::start_with(
            sim,
            &format!("[job]\nCgroups={cg}\nMemoryLimit=256MiB\n"),
            &["--metrics", "127.0.0.1:0"],
        );
        let addr = metrics_addr(&g);
        let deadline = Instant::now() + Duration::from_secs(5);
        let text = loop {
            let text = get(&addr, "/metrics");
            // Refreshed once at least.
            if sample(&text, "gemini_group_min_util_ratio{group=\"job\"}").is_some()
                || Instant::now() > deadline
            {
                break text;
            }
            std::thread::sleep(Duration::from_millis(100));
        };
        assert_eq!(
            sample(&text, "gemini_driver_memory_limits"),
            Some(driver),
            "{text}"
        );
        let limit = format!(
            "gemini_driver_memory_limit_bytes{{group=\"job\",device=\"0\",cgroup=\"{cg}\"}}"
        );
        let used = limit.replace("limit_bytes", "used_bytes");
        if driver == 1.0 {
            assert_eq!(sample(&text, &limit), Some(268435456.0), "{text}");
            assert_eq!(sample(&text, &used), Some(0.0), "{text}");
        } else {
            assert_eq!(sample(&text, &limit), None, "{text}");
        }
    }
}
