//! Prometheus metrics of `gem-schd` (`--metrics ADDR`): the exposition
//! comes from `prometheus-client` (OpenMetrics text), the HTTP listener
//! from `tiny_http`, on a thread of its own. The daemon's loop updates
//! the figures (gauges from its status about once a second, counters as
//! things happen); a scrape only reads them. Every metric is listed in
//! `docs/metrics.md`.

use crate::policy::{GroupCounters, HOLDER_SHOWN as HOLDER};
use gemini_protocol::StatusReport;
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
    share: Family<GroupDevice, FloatGauge>,
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
            share: Family::default(),
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
            "Connected processes of the group",
            m.clients.clone(),
        );
        r.register_with_unit(
            "group_share",
            "Share of the device's time the group used since it became active, over at most the window",
            Unit::Other("ratio".into()),
            m.share.clone(),
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
        m.last_reload_ok.set(1);
        Metrics { registry: r, ..m }
    }

    /// Rebuilds the gauges from a status report and the policy's
    /// cumulative counters.
    pub fn refresh(&self, st: &StatusReport, counters: &[GroupCounters]) {
        let _g = lock(&self.refresh);
        for f in [&self.min_util, &self.max_util, &self.memory_limit] {
            f.clear();
        }
        self.clients.clear();
        self.share.clear();
        self.memory_used.clear();
        self.driver_limit.clear();
        self.driver_used.clear();
        self.driver_limits.set(i64::from(st.driver_limits));
        self.waiting.clear();
        self.busy.clear();
        self.holder_share.clear();
        self.holder_memory.clear();
        for g in &st.groups {
            let l = GroupLabel {
                group: g.name.clone(),
            };
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
        for d in &st.devices {
            let device = DeviceLabel {
                device: d.device.to_string(),
            };
            self.busy.get_or_create(&device).set(d.busy);
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
        for c in counters.iter().filter(|c| c.group != HOLDER) {
            let l = GroupDevice {
                group: c.group.clone(),
                device: c.device.to_string(),
            };
            let throttled = self.throttled.get_or_create(&l);
            let secs = c.throttled_us as f64 / 1e6;
            if secs > throttled.get() {
                throttled.inc_by(secs - throttled.get());
            }
            let revoked = self.revocations.get_or_create(&l);
            if c.revocations > revoked.get() {
                revoked.inc_by(c.revocations - revoked.get());
            }
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
            let content_type = tiny_http::Header::from_bytes(
                &b"Content-Type"[..],
                &b"application/openmetrics-text; version=1.0.0; charset=utf-8"[..],
            )
            .ok();
            for req in server.incoming_requests() {
                let path = req.url().split('?').next().unwrap_or("");
                let resp = if path == "/metrics" {
                    let mut r = tiny_http::Response::from_string(metrics.encode());
                    if let Some(h) = content_type.clone() {
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
