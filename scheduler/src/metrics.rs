//! Prometheus metrics of `gem-schd` (`--metrics ADDR`): the exposition
//! comes from `prometheus-client` (OpenMetrics text), the HTTP listener
//! from `tiny_http`, on a thread of its own. The daemon's loop updates
//! the figures (gauges from its status about once a second, counters as
//! things happen); a scrape only reads them. Every metric is listed in
//! `docs/metrics.md`.

use crate::policy::{GroupCounters, HOLDER_SHOWN as HOLDER};
use gemini_protocol::{Role, StatusReport};
use prometheus_client::encoding::EncodeLabelSet;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{Histogram, exponential_buckets};
use prometheus_client::registry::{Registry, Unit};
use std::net::SocketAddr;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

/// A group.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupLabel {
    /// The group's name.
    pub group: String,
}

/// A group on a device.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupDevice {
    /// The group's name.
    pub group: String,
    /// The device (the scheduler's index).
    pub device: String,
}

/// One cgroup of a group on a device (the driver's limits).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct GroupCgroup {
    /// The group's name.
    pub group: String,
    /// The device (the scheduler's index).
    pub device: String,
    /// The cgroup (`Cgroups=`).
    pub cgroup: String,
}

/// A device.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DeviceLabel {
    /// The device (the scheduler's index).
    pub device: String,
}

/// Why a request was refused.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    /// `permission`, `protocol`, `malformed` or `busy`.
    pub reason: String,
}

/// The build.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct BuildLabel {
    /// gem-schd's version.
    pub version: String,
    /// The newest protocol version it speaks.
    pub protocol: String,
}

/// How a reload ended.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ResultLabel {
    /// `ok` or `error`.
    pub result: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;
type FloatCounter = Counter<f64, AtomicU64>;
type HistogramFamily<L> = Family<L, Histogram, fn() -> Histogram>;

fn wait_buckets() -> Histogram {
    // 50 µs to about 1.6 s.
    Histogram::new(exponential_buckets(50e-6, 2.0, 16))
}

fn handling_buckets() -> Histogram {
    // 5 µs to about 160 ms.
    Histogram::new(exponential_buckets(5e-6, 2.0, 16))
}

/// The metrics, shared by the daemon (writer) and the HTTP thread.
pub struct Metrics {
    registry: Registry,
    /// Held while the gauges are rebuilt and while they are encoded, so a
    /// scrape never sees a half-refreshed set.
    refresh: Mutex<()>,
    min_util: Family<GroupLabel, FloatGauge>,
    max_util: Family<GroupLabel, FloatGauge>,
    memory_limit: Family<GroupLabel, FloatGauge>,
    clients: Family<GroupLabel, Gauge>,
    processes: Family<GroupLabel, Gauge>,
    reserved: Family<GroupLabel, Gauge>,
    reservation_left: Family<GroupLabel, FloatGauge>,
    queued: Gauge,
    queue_oldest: FloatGauge,
    build: Family<BuildLabel, Gauge>,
    share: Family<GroupDevice, FloatGauge>,
    gpu_time: Family<GroupDevice, FloatCounter>,
    memory_used: Family<GroupDevice, Gauge>,
    driver_limit: Family<GroupCgroup, Gauge>,
    driver_used: Family<GroupCgroup, Gauge>,
    driver_limits: Gauge,
    waiting: Family<GroupDevice, Gauge>,
    throttled: Family<GroupDevice, FloatCounter>,
    revocations: Family<GroupDevice, Counter>,
    grants: Family<GroupDevice, Counter>,
    token_wait: HistogramFamily<GroupDevice>,
    busy: Family<DeviceLabel, FloatGauge>,
    holder_share: Family<DeviceLabel, FloatGauge>,
    holder_memory: Family<DeviceLabel, Gauge>,
    holder_grants: Family<DeviceLabel, Counter>,
    holder_gpu_time: Family<DeviceLabel, FloatCounter>,
    reloads: Family<ResultLabel, Counter>,
    last_reload_ok: Gauge,
    config_errors: Gauge,
    handling: Histogram,
    loop_busy: Histogram,
    refused: Family<ReasonLabel, Counter>,
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Metrics")
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics::new()
    }
}

impl Metrics {
    /// Every metric, registered and empty.
    pub fn new() -> Metrics {
        let mut r = Registry::with_prefix("gemini");
        let m = Metrics {
            registry: Registry::default(),
            refresh: Mutex::new(()),
            min_util: Family::default(),
            max_util: Family::default(),
            memory_limit: Family::default(),
            clients: Family::default(),
            processes: Family::default(),
            reserved: Family::default(),
            reservation_left: Family::default(),
            queued: Gauge::default(),
            queue_oldest: FloatGauge::default(),
            build: Family::default(),
            share: Family::default(),
            gpu_time: Family::default(),
            memory_used: Family::default(),
            driver_limit: Family::default(),
            driver_used: Family::default(),
            driver_limits: Gauge::default(),
            waiting: Family::default(),
            throttled: Family::default(),
            revocations: Family::default(),
            grants: Family::default(),
            token_wait: Family::new_with_constructor(wait_buckets),
            busy: Family::default(),
            holder_share: Family::default(),
            holder_memory: Family::default(),
            holder_grants: Family::default(),
            holder_gpu_time: Family::default(),
            reloads: Family::default(),
            last_reload_ok: Gauge::default(),
            config_errors: Gauge::default(),
            handling: handling_buckets(),
            loop_busy: handling_buckets(),
            refused: Family::default(),
        };
        r.register_with_unit(
            "group_min_util",
            "Guaranteed share of each device's time (MinUtil)",
            Unit::Other("ratio".into()),
            m.min_util.clone(),
        );
        r.register_with_unit(
            "group_max_util",
            "Ceiling on the share of each device's time (MaxUtil)",
            Unit::Other("ratio".into()),
            m.max_util.clone(),
        );
        r.register_with_unit(
            "group_memory_limit",
            "Device memory the group may hold per device (MemoryLimit; +Inf: unlimited)",
            Unit::Bytes,
            m.memory_limit.clone(),
        );
        r.register(
            "group_clients",
            "Connections of the group's programs (a program has one, or two while it also controls: see gemini_group_processes)",
            m.clients.clone(),
        );
        r.register(
            "group_processes",
            "Programs of the group connected to the scheduler (each counted once)",
            m.processes.clone(),
        );
        r.register(
            "group_reserved_gpus",
            "GPUs held by reservations of the group (gem-launch --exclusive, gem-launch reserve)",
            m.reserved.clone(),
        );
        r.register_with_unit(
            "group_reservation_left",
            "Time until the group's first reservation made without a program (gem-launch reserve) expires; absent where it has none",
            Unit::Seconds,
            m.reservation_left.clone(),
        );
        r.register(
            "queue_launches",
            "Launches waiting in gem-launch's queue for free GPUs",
            m.queued.clone(),
        );
        r.register_with_unit(
            "queue_oldest_wait",
            "How long the first launch in gem-launch's queue has waited (0: none waits)",
            Unit::Seconds,
            m.queue_oldest.clone(),
        );
        r.register(
            "build_info",
            "1, labelled with gem-schd's version and the newest protocol version it speaks",
            m.build.clone(),
        );
        r.register_with_unit(
            "group_share",
            "Share of the device's span (the accounting window, or less where the device's first work in it began later) the group's work occupied; the groups' shares on a device add up to at most its busy share",
            Unit::Other("ratio".into()),
            m.share.clone(),
        );
        r.register_with_unit(
            "group_gpu",
            "Device time charged to the group since gem-schd started: rate() of it is the group's share at any scrape interval",
            Unit::Seconds,
            m.gpu_time.clone(),
        );
        r.register_with_unit(
            "group_memory_used",
            "Device memory held by the group's processes",
            Unit::Bytes,
            m.memory_used.clone(),
        );
        r.register_with_unit(
            "driver_memory_limit",
            "The hard limit the driver enforces for a cgroup of the group on the device (nvmlDeviceSetMemoryLimits_v1, R615 drivers)",
            Unit::Bytes,
            m.driver_limit.clone(),
        );
        r.register_with_unit(
            "driver_memory_used",
            "Device memory the processes of a cgroup of the group hold, as the driver counts it (currentUsed)",
            Unit::Bytes,
            m.driver_used.clone(),
        );
        r.register(
            "driver_memory_limits",
            "1 where the driver has per-cgroup memory limits and enforces MemoryLimit for groups bound to cgroups, 0 where the hook alone does",
            m.driver_limits.clone(),
        );
        r.register(
            "group_waiting_clients",
            "Processes of the group waiting for the device's token",
            m.waiting.clone(),
        );
        r.register_with_unit(
            "group_throttled",
            "Time a process of the group waited for the token while its MaxUtil held the group back",
            Unit::Seconds,
            m.throttled.clone(),
        );
        r.register(
            "group_token_revocations",
            "Tokens of the group revoked: not given back within their length and the grace",
            m.revocations.clone(),
        );
        r.register(
            "group_token_grants",
            "Tokens granted to the group's processes",
            m.grants.clone(),
        );
        r.register_with_unit(
            "group_token_wait",
            "Time from a process's token request to its grant",
            Unit::Seconds,
            m.token_wait.clone(),
        );
        r.register_with_unit(
            "device_busy",
            "Share of the window during which the device was in use by anyone (the holder included)",
            Unit::Other("ratio".into()),
            m.busy.clone(),
        );
        r.register_with_unit(
            "holder_share",
            "Share of the device's time the holder used (idle share it filled; no group's)",
            Unit::Other("ratio".into()),
            m.holder_share.clone(),
        );
        r.register_with_unit(
            "holder_memory",
            "Device memory the holder holds (leftover it gives back on demand)",
            Unit::Bytes,
            m.holder_memory.clone(),
        );
        r.register(
            "holder_token_grants",
            "Tokens granted to the holder",
            m.holder_grants.clone(),
        );
        r.register_with_unit(
            "holder_gpu",
            "Device time the holder used since gem-schd started (idle time it filled; no group's)",
            Unit::Seconds,
            m.holder_gpu_time.clone(),
        );
        r.register(
            "config_reloads",
            "Reloads of resource.conf (and its drop-ins) by result",
            m.reloads.clone(),
        );
        r.register(
            "config_last_reload_ok",
            "1 if the last reload put the files in force, 0 if they had errors (the previous configuration stays)",
            m.last_reload_ok.clone(),
        );
        r.register(
            "config_errors",
            "Errors found in the files at the last reload (0 when it succeeded)",
            m.config_errors.clone(),
        );
        r.register_with_unit(
            "request_handling",
            "Time the daemon took to handle one message, from reading it to its reply (a token request answered later counts only its reading)",
            Unit::Seconds,
            m.handling.clone(),
        );
        r.register(
            "requests_refused",
            "Requests refused, by why: permission (a right the peer's user lacks), protocol (a version this gem-schd does not speak), malformed (a frame it cannot read), busy (status asked faster than it is answered)",
            m.refused.clone(),
        );
        r.register_with_unit(
            "event_loop_busy",
            "Each stretch the daemon was busy between two looks at its socket: a request that arrived meanwhile waited up to this long in the socket before it was read (time gemini_group_token_wait_seconds does not count)",
            Unit::Seconds,
            m.loop_busy.clone(),
        );
        // Every reason shown from the start, at 0: an alert on an
        // increase sees the first refusal.
        for reason in ["permission", "protocol", "malformed", "busy"] {
            let _ = m.refused.get_or_create(&ReasonLabel {
                reason: reason.into(),
            });
        }
        for result in ["ok", "error"] {
            let _ = m.reloads.get_or_create(&ResultLabel {
                result: result.into(),
            });
        }
        m.build
            .get_or_create(&BuildLabel {
                version: env!("CARGO_PKG_VERSION").into(),
                protocol: gemini_protocol::PROTOCOL_VERSION.to_string(),
            })
            .set(1);
        m.last_reload_ok.set(1);
        Metrics { registry: r, ..m }
    }

    /// Rebuilds the gauges from a status report and the policy's
    /// cumulative counters.
    pub fn refresh(&self, st: &StatusReport, counters: &[GroupCounters]) {
        let _g = lock(&self.refresh);
        self.clear_gauges();
        self.driver_limits.set(i64::from(st.driver_limits));
        self.queued.set(st.queue.len() as i64);
        let oldest = st.queue.iter().map(|q| q.for_us).max().unwrap_or(0);
        self.queue_oldest.set(oldest as f64 / 1e6);
        self.refresh_groups(st);
        self.refresh_devices(st);
        self.refresh_counters(counters);
    }

    /// Empties the gauges rebuilt at each refresh (a group or a device
    /// gone drops out).
    fn clear_gauges(&self) {
        for f in [&self.min_util, &self.max_util, &self.memory_limit] {
            f.clear();
        }
        for f in [&self.clients, &self.processes, &self.reserved] {
            f.clear();
        }
        self.reservation_left.clear();
        self.share.clear();
        self.memory_used.clear();
        self.driver_limit.clear();
        self.driver_used.clear();
        self.waiting.clear();
        self.busy.clear();
        self.holder_share.clear();
        self.holder_memory.clear();
    }

    /// The configured groups' settings, programs and driver limits.
    fn refresh_groups(&self, st: &StatusReport) {
        for g in &st.groups {
            let l = GroupLabel {
                group: g.name.clone(),
            };
            self.group_programs(st, &l);
            self.min_util.get_or_create(&l).set(g.min_util);
            self.max_util.get_or_create(&l).set(g.max_util);
            self.memory_limit
                .get_or_create(&l)
                .set(if g.memory_limit == u64::MAX {
                    f64::INFINITY
                } else {
                    g.memory_limit as f64
                });
            self.clients.get_or_create(&l).set(i64::from(g.clients));
            for m in &g.driver_memory {
                let c = GroupCgroup {
                    group: g.name.clone(),
                    device: m.device.to_string(),
                    cgroup: m.cgroup.clone(),
                };
                self.driver_limit.get_or_create(&c).set(m.limit as i64);
                self.driver_used.get_or_create(&c).set(m.used as i64);
            }
        }
    }

    /// Each device's busy share, the holder's figures there, and each
    /// group's share, memory and waiting processes there.
    fn refresh_devices(&self, st: &StatusReport) {
        for d in &st.devices {
            let device = DeviceLabel {
                device: d.device.to_string(),
            };
            self.busy.get_or_create(&device).set(d.busy);
            // Every group that may use the device, from 0: a group that
            // waits and was never charged has series too, for an alert.
            for g in st
                .groups
                .iter()
                .filter(|g| g.devices.as_ref().is_none_or(|ds| ds.contains(&d.device)))
            {
                let l = GroupDevice {
                    group: g.name.clone(),
                    device: device.device.clone(),
                };
                let _ = self.gpu_time.get_or_create(&l);
                self.waiting.get_or_create(&l).set(0);
            }
            // At 0 where the holder is not on the device: a panel or an
            // alert finds the series either way.
            self.holder_share.get_or_create(&device).set(0.0);
            self.holder_memory.get_or_create(&device).set(0);
            for g in &d.groups {
                if g.group == HOLDER {
                    self.holder_share.get_or_create(&device).set(g.share);
                    self.holder_memory
                        .get_or_create(&device)
                        .set(g.memory_used as i64);
                    continue;
                }
                let l = GroupDevice {
                    group: g.group.clone(),
                    device: device.device.clone(),
                };
                self.share.get_or_create(&l).set(g.share);
                self.memory_used.get_or_create(&l).set(g.memory_used as i64);
                self.waiting.get_or_create(&l).set(i64::from(g.waiting));
            }
        }
    }

    /// The counters, raised to the policy's cumulative figures.
    fn refresh_counters(&self, counters: &[GroupCounters]) {
        for c in counters {
            let used = c.used_us as f64 / 1e6;
            if c.group == HOLDER {
                let device = DeviceLabel {
                    device: c.device.to_string(),
                };
                raise(&self.holder_gpu_time.get_or_create(&device), used);
                continue;
            }
            let l = GroupDevice {
                group: c.group.clone(),
                device: c.device.to_string(),
            };
            // The ledger refunds time it charged a group for another's
            // work: a counter never goes down, so a refund is taken out
            // of the next charges instead.
            raise(&self.gpu_time.get_or_create(&l), used);
            raise(
                &self.throttled.get_or_create(&l),
                c.throttled_us as f64 / 1e6,
            );
            let revoked = self.revocations.get_or_create(&l);
            if c.revocations > revoked.get() {
                revoked.inc_by(c.revocations - revoked.get());
            }
        }
    }

    /// The figures of `group`'s programs: how many are connected, the
    /// GPUs its reservations hold and when the first made without a
    /// program expires.
    fn group_programs(&self, st: &StatusReport, group: &GroupLabel) {
        let programs: std::collections::BTreeSet<u32> = st
            .clients
            .iter()
            .filter(|c| c.role == Role::Client && c.group == group.group)
            .map(|c| c.pid)
            .collect();
        self.processes
            .get_or_create(group)
            .set(programs.len() as i64);
        let ours = || st.reservations.iter().filter(|r| r.group == group.group);
        let gpus: usize = ours().map(|r| r.devices.len()).sum();
        self.reserved.get_or_create(group).set(gpus as i64);
        if let Some(left) = ours()
            .filter_map(|r| r.manual.as_ref())
            .map(|m| m.left_us)
            .min()
        {
            self.reservation_left
                .get_or_create(group)
                .set(left as f64 / 1e6);
        }
    }

    /// A token was granted to a process of `group` on `device` after it
    /// waited `waited` seconds.
    pub fn granted(&self, group: &str, device: u32, waited: f64) {
        if group == HOLDER {
            self.holder_grants
                .get_or_create(&DeviceLabel {
                    device: device.to_string(),
                })
                .inc();
            return;
        }
        let l = GroupDevice {
            group: group.to_string(),
            device: device.to_string(),
        };
        self.grants.get_or_create(&l).inc();
        self.token_wait.get_or_create(&l).observe(waited);
    }

    /// A reload ended: `errors` errors (0: in force).
    pub fn reloaded(&self, errors: usize) {
        let result = if errors == 0 { "ok" } else { "error" };
        self.reloads
            .get_or_create(&ResultLabel {
                result: result.into(),
            })
            .inc();
        self.last_reload_ok.set(i64::from(errors == 0));
        self.config_errors.set(errors as i64);
    }

    /// A request was refused with `kind`.
    pub fn refused(&self, kind: gemini_protocol::ErrorKind) {
        use gemini_protocol::ErrorKind as K;
        let reason = match kind {
            K::PermissionDenied => "permission",
            K::ProtocolMismatch => "protocol",
            K::Malformed => "malformed",
            _ => "busy",
        };
        self.refused
            .get_or_create(&ReasonLabel {
                reason: reason.into(),
            })
            .inc();
    }

    /// The event loop was busy `secs` between two polls of its socket.
    pub fn loop_busy(&self, secs: f64) {
        self.loop_busy.observe(secs);
    }

    /// One message took `secs` to handle.
    pub fn handled(&self, secs: f64) {
        self.handling.observe(secs);
    }

    /// The OpenMetrics text of every metric.
    pub fn encode(&self) -> String {
        let _g = lock(&self.refresh);
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &self.registry);
        out
    }
}

/// The content type of OpenMetrics text.
const OPENMETRICS: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";
/// The content type of Prometheus's text format 0.0.4.
const TEXT_004: &str = "text/plain; version=0.0.4; charset=utf-8";

/// Whether a scraper that sent `accept` (its `Accept` header; `None`:
/// none) takes OpenMetrics: where it names it, as Prometheus does. A
/// scraper that names only `text/plain` (or nothing: `curl`) gets the
/// older Prometheus text format, which every scraper reads.
fn wants_openmetrics(accept: Option<&str>) -> bool {
    accept.is_some_and(|a| {
        a.split(',').any(|part| {
            let mut params = part.split(';').map(str::trim);
            let is_om = params
                .next()
                .is_some_and(|t| t.eq_ignore_ascii_case("application/openmetrics-text"));
            // `q=0` (or 0.0, 0.000) means "not this one" (RFC 9110).
            let refused = |p: &str| {
                let p = p.replace(' ', "");
                p.strip_prefix("q=")
                    .is_some_and(|q| q.parse::<f64>().is_ok_and(|q| q == 0.0))
            };
            is_om && !params.any(refused)
        })
    })
}

/// OpenMetrics text rewritten as Prometheus's text format 0.0.4: a
/// counter's `# TYPE` and `# HELP` name its `_total` sample, `# UNIT`
/// and `# EOF` go, and an `info` is a gauge of its `_info` sample.
fn to_text_004(om: &str) -> String {
    use std::collections::HashMap;
    // A family's type, from its `# TYPE` line.
    let types: HashMap<&str, &str> = om
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE "))
        .filter_map(|rest| rest.split_once(' '))
        .collect();
    let renamed = |name: &str| -> String {
        match types.get(name) {
            Some(&"counter") => format!("{name}_total"),
            Some(&"info") => format!("{name}_info"),
            _ => name.to_string(),
        }
    };
    let mut out = String::with_capacity(om.len());
    for line in om.lines() {
        if line == "# EOF" || line.starts_with("# UNIT ") {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let (name, kind) = rest.split_once(' ').unwrap_or((rest, "untyped"));
            let kind = match kind {
                "counter" | "gauge" | "histogram" | "summary" => kind,
                "info" => "gauge",
                _ => "untyped",
            };
            out.push_str(&format!("# TYPE {} {kind}\n", renamed(name)));
        } else if let Some(rest) = line.strip_prefix("# HELP ") {
            let (name, help) = rest.split_once(' ').unwrap_or((rest, ""));
            out.push_str(&format!("# HELP {} {help}\n", renamed(name)));
        } else {
            // A sample: its value as the text format writes infinities.
            match line.rsplit_once(' ') {
                Some((series, "inf")) => out.push_str(&format!("{series} +Inf")),
                Some((series, "-inf")) => out.push_str(&format!("{series} -Inf")),
                _ => out.push_str(line),
            }
            out.push('\n');
        }
    }
    out
}

/// Raises `counter` to `total` (a cumulative figure of the policy's); a
/// smaller total leaves it as it is.
fn raise(counter: &FloatCounter, total: f64) {
    let now = counter.get();
    if total > now {
        counter.inc_by(total - now);
    }
}

fn lock(m: &Mutex<()>) -> std::sync::MutexGuard<'_, ()> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// Serves `metrics` at `http://addr/metrics` on a thread of its own, and
/// returns the address bound (port 0 picks a free one). Binding is done
/// here, so a bad or busy address is an error at start.
pub fn serve(addr: SocketAddr, metrics: Arc<Metrics>) -> anyhow::Result<SocketAddr> {
    let server = tiny_http::Server::http(addr)
        .map_err(|e| anyhow::anyhow!("metrics: cannot listen on {addr}: {e}"))?;
    let bound = server.server_addr().to_ip().unwrap_or(addr);
    std::thread::Builder::new()
        .name("gem-schd-metrics".into())
        .spawn(move || {
            for req in server.incoming_requests() {
                let path = req.url().split('?').next().unwrap_or("");
                let resp = if path == "/metrics" {
                    let accept = req
                        .headers()
                        .iter()
                        .find(|h| h.field.equiv("Accept"))
                        .map(|h| h.value.as_str().to_string());
                    let om = metrics.encode();
                    let (body, kind) = if wants_openmetrics(accept.as_deref()) {
                        (om, OPENMETRICS)
                    } else {
                        (to_text_004(&om), TEXT_004)
                    };
                    let mut r = tiny_http::Response::from_string(body);
                    if let Ok(h) = tiny_http::Header::from_bytes(&b"Content-Type"[..], kind) {
                        r = r.with_header(h);
                    }
                    r
                } else {
                    tiny_http::Response::from_string("gem-schd serves its metrics at /metrics\n")
                        .with_status_code(404)
                };
                let _ = req.respond(resp);
            }
        })?;
    Ok(bound)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn openmetrics_only_for_a_scraper_that_asks_for_it() {
        // What Prometheus 2.x/3.x sends, and what curl and older scrapers do.
        let prom = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75,text/plain;version=0.0.4;q=0.5,*/*;q=0.1";
        assert!(wants_openmetrics(Some(prom)));
        assert!(!wants_openmetrics(Some("text/plain;version=0.0.4")));
        assert!(!wants_openmetrics(Some("*/*")));
        assert!(!wants_openmetrics(None));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text; q=0, text/plain"
        )));
        assert!(!wants_openmetrics(Some(
            "application/openmetrics-text;q=0.0"
        )));
        assert!(wants_openmetrics(Some("Application/OpenMetrics-Text")));
    }

    #[test]
    fn the_old_text_format_names_counters_by_their_samples() {
        let m = Metrics::new();
        m.granted("a", 0, 0.001);
        m.reloaded(0);
        let om = m.encode();
        assert!(
            om.contains("# TYPE gemini_group_token_grants counter"),
            "{om}"
        );
        let text = to_text_004(&om);
        assert!(
            !text.contains("# EOF") && !text.contains("# UNIT"),
            "{text}"
        );
        assert!(
            text.contains("# TYPE gemini_group_token_grants_total counter\n"),
            "{text}"
        );
        assert!(
            text.contains("# HELP gemini_group_token_grants_total Tokens granted"),
            "{text}"
        );
        assert!(text.contains("gemini_group_token_grants_total{group=\"a\",device=\"0\"} 1\n"));
        // Histograms and gauges keep their names.
        assert!(text.contains("# TYPE gemini_group_token_wait_seconds histogram\n"));
        assert!(text.contains("# TYPE gemini_config_last_reload_ok gauge\n"));
        // Every sample line is kept: only comments change.
        let samples = |t: &str| t.lines().filter(|l| !l.starts_with('#')).count();
        assert_eq!(samples(&om), samples(&text));
    }

    #[test]
    fn every_reload_result_and_the_build_are_shown_from_the_start() {
        let om = Metrics::new().encode();
        for line in [
            "gemini_config_reloads_total{result=\"ok\"} 0",
            "gemini_config_reloads_total{result=\"error\"} 0",
        ] {
            assert!(om.contains(line), "{line} missing:\n{om}");
        }
        let build = format!(
            "gemini_build_info{{version=\"{}\",protocol=\"{}\"}} 1",
            env!("CARGO_PKG_VERSION"),
            gemini_protocol::PROTOCOL_VERSION
        );
        assert!(om.contains(&build), "{build} missing:\n{om}");
    }

    /// docs/metrics.md lists every metric gem-schd serves, by the name
    /// of its samples, and no other.
    #[test]
    fn the_doc_lists_every_metric_and_no_other() {
        let text = to_text_004(&Metrics::new().encode());
        let served: std::collections::BTreeSet<String> = text
            .lines()
            .filter_map(|l| l.strip_prefix("# TYPE "))
            .filter_map(|l| l.split(' ').next())
            .map(str::to_string)
            .collect();
        let doc = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/metrics.md"),
        )
        .unwrap();
        let listed: std::collections::BTreeSet<String> = doc
            .lines()
            .filter_map(|l| l.strip_prefix("| `gemini_"))
            .filter_map(|l| l.split('`').next())
            .map(|n| format!("gemini_{n}"))
            .collect();
        assert!(served.len() > 30, "{served:?}");
        let missing: Vec<_> = served.difference(&listed).collect();
        let extra: Vec<_> = listed.difference(&served).collect();
        assert!(
            missing.is_empty(),
            "served, not in docs/metrics.md: {missing:?}"
        );
        assert!(
            extra.is_empty(),
            "in docs/metrics.md, not served: {extra:?}"
        );
    }

    #[test]
    fn a_refunded_charge_never_takes_the_counter_down() {
        let c = FloatCounter::default();
        raise(&c, 2.0);
        raise(&c, 1.5);
        assert_eq!(c.get(), 2.0);
        raise(&c, 2.5);
        assert_eq!(c.get(), 2.5);
    }
}
