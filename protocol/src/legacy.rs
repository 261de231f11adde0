//! The older protocol versions this build still speaks, so that a
//! scheduler upgraded under running programs serves their hooks, and a
//! hook newer than its scheduler speaks the scheduler's version.
//!
//! Postcard writes an enum as its variant's index, then its fields in
//! order. So a message whose shape did not change has the same bytes in
//! every version, and only the messages that changed keep their older
//! shape here: a frame of an older version is read as the current one
//! except for those, which are read in their old shape and converted, and
//! an answer to an older peer is written the same way. This holds because
//! variants are only ever appended (never removed, reordered or renamed
//! into another index), and a change to a message's fields puts its old
//! shape here, with conversions both ways (docs/protocol.md).

use crate::codec::{CodecError, header, take_all};
use crate::{
    ClientId, ClientStatus, DeviceId, DeviceStatus, GroupStatus, HeldMemory, ReservationStatus,
    Role, StatusReport,
};
use crate::{Reply, Request};
use serde::{Deserialize, Serialize};

/// The release that spoke each older version still spoken, for
/// `gem-schd status` (a peer of protocol 14 did not say its release).
pub fn release_of(version: u16) -> Option<&'static str> {
    match version {
        14 => Some("0.1.0"),
        _ => None,
    }
}

/// [`Request::Hello`]'s index.
const HELLO: u32 = 0;
/// [`Request::AcquireToken`]'s index.
const ACQUIRE_TOKEN: u32 = 1;
/// [`Request::AcquireTokenAhead`]'s index.
const ACQUIRE_TOKEN_AHEAD: u32 = 20;
/// [`Reply::Status`]'s index.
const STATUS: u32 = 4;

/// Protocol 14 (gemini 0.1.0): the hello without `build`, and the status
/// report without `refused` and `protocol`, and without each client's
/// `protocol` and `build`.
mod v14 {
    use super::*;

    #[derive(Serialize, Deserialize)]
    pub(super) struct Hello {
        pub(super) role: Role,
        pub(super) group: String,
        pub(super) pid: u32,
        pub(super) held: Vec<HeldMemory>,
        pub(super) job: Option<String>,
    }

    #[derive(Serialize, Deserialize)]
    pub(super) struct Status {
        pub(super) server: String,
        pub(super) config_path: String,
        pub(super) config_error: Option<String>,
        pub(super) window_us: u64,
        pub(super) uptime_us: u64,
        pub(super) groups: Vec<v15::Group>,
        pub(super) devices: Vec<v15::Device>,
        pub(super) clients: Vec<Client>,
        pub(super) reservations: Vec<ReservationStatus>,
        pub(super) queue: Vec<ReservationStatus>,
        pub(super) driver_limits: bool,
    }

    #[derive(Serialize, Deserialize)]
    pub(super) struct Client {
        pub(super) id: ClientId,
        pub(super) pid: u32,
        pub(super) role: Role,
        pub(super) group: String,
        pub(super) job: Option<String>,
        pub(super) user: String,
        pub(super) command: String,
        pub(super) devices: Vec<DeviceId>,
    }

    pub(super) fn status_from(r: &StatusReport) -> Status {
        Status {
            server: r.server.clone(),
            config_path: r.config_path.clone(),
            config_error: r.config_error.clone(),
            window_us: r.window_us,
            uptime_us: r.uptime_us,
            groups: r.groups.iter().map(v15::group_from).collect(),
            devices: r.devices.iter().map(v15::device_from).collect(),
            clients: r
                .clients
                .iter()
                .map(|c| Client {
                    id: c.id,
                    pid: c.pid,
                    role: c.role,
                    group: c.group.clone(),
                    job: c.job.clone(),
                    user: c.user.clone(),
                    command: c.command.clone(),
                    devices: c.devices.clone(),
                })
                .collect(),
            reservations: r.reservations.clone(),
            queue: r.queue.clone(),
            driver_limits: r.driver_limits,
        }
    }

    pub(super) fn status_into(s: Status) -> StatusReport {
        StatusReport {
            server: s.server,
            config_path: s.config_path,
            config_error: s.config_error,
            window_us: s.window_us,
            uptime_us: s.uptime_us,
            groups: s.groups.into_iter().map(v15::group_into).collect(),
            devices: s.devices.into_iter().map(v15::device_into).collect(),
            clients: s
                .clients
                .into_iter()
                .map(|c| ClientStatus {
                    id: c.id,
                    pid: c.pid,
                    role: c.role,
                    group: c.group,
                    job: c.job,
                    user: c.user,
                    command: c.command,
                    devices: c.devices,
                    // A scheduler of protocol 14 serves peers of 14 only.
                    protocol: 14,
                    build: release_of(14).unwrap_or_default().to_string(),
                    waiting: Vec::new(),
                    memory: Vec::new(),
                    gpu_us: 0,
                })
                .collect(),
            reservations: s.reservations,
            queue: s.queue,
            driver_limits: s.driver_limits,
            refused: Vec::new(),
            protocol: 14,
        }
    }
}

/// Protocol 15 (0.2.0 development builds): the status report without each
/// group's latency class, each device's memory, and each client's waits,
/// memory and device time (and the token's connection named `holder`).
mod v15 {
    use super::*;
    use crate::{DriverMemory, GroupDeviceStatus, RefusedPeer};

    #[derive(Serialize, Deserialize)]
    pub(super) struct Group {
        pub(super) name: String,
        pub(super) min_util: f64,
        pub(super) max_util: f64,
        pub(super) memory_limit: u64,
        pub(super) clients: u32,
        pub(super) devices: Option<Vec<DeviceId>>,
        pub(super) driver_memory: Vec<DriverMemory>,
    }

    #[derive(Serialize, Deserialize)]
    pub(super) struct Device {
        pub(super) device: DeviceId,
        pub(super) busy: f64,
        pub(super) span_us: u64,
        pub(super) holder: Option<ClientId>,
        pub(super) waiting: u32,
        pub(super) groups: Vec<GroupDeviceStatus>,
        pub(super) rtt_us: u64,
    }

    #[derive(Serialize, Deserialize)]
    pub(super) struct Client {
        pub(super) id: ClientId,
        pub(super) pid: u32,
        pub(super) role: Role,
        pub(super) group: String,
        pub(super) job: Option<String>,
        pub(super) user: String,
        pub(super) command: String,
        pub(super) devices: Vec<DeviceId>,
        pub(super) protocol: u16,
        pub(super) build: String,
    }

    #[derive(Serialize, Deserialize)]
    pub(super) struct Status {
        pub(super) server: String,
        pub(super) config_path: String,
        pub(super) config_error: Option<String>,
        pub(super) window_us: u64,
        pub(super) uptime_us: u64,
        pub(super) groups: Vec<Group>,
        pub(super) devices: Vec<Device>,
        pub(super) clients: Vec<Client>,
        pub(super) reservations: Vec<ReservationStatus>,
        pub(super) queue: Vec<ReservationStatus>,
        pub(super) driver_limits: bool,
        pub(super) refused: Vec<RefusedPeer>,
        pub(super) protocol: u16,
    }

    pub(super) fn group_from(g: &GroupStatus) -> Group {
        Group {
            name: g.name.clone(),
            min_util: g.min_util,
            max_util: g.max_util,
            memory_limit: g.memory_limit,
            clients: g.clients,
            devices: g.devices.clone(),
            driver_memory: g.driver_memory.clone(),
        }
    }

    pub(super) fn group_into(g: Group) -> GroupStatus {
        GroupStatus {
            name: g.name,
            min_util: g.min_util,
            max_util: g.max_util,
            memory_limit: g.memory_limit,
            clients: g.clients,
            devices: g.devices,
            driver_memory: g.driver_memory,
            latency: String::new(),
        }
    }

    pub(super) fn device_from(d: &DeviceStatus) -> Device {
        Device {
            device: d.device,
            busy: d.busy,
            span_us: d.span_us,
            holder: d.token_client,
            waiting: d.waiting,
            groups: d.groups.clone(),
            rtt_us: d.rtt_us,
        }
    }

    pub(super) fn device_into(d: Device) -> DeviceStatus {
        DeviceStatus {
            device: d.device,
            busy: d.busy,
            span_us: d.span_us,
            token_client: d.holder,
            waiting: d.waiting,
            groups: d.groups,
            rtt_us: d.rtt_us,
            memory_total: None,
            memory_free: None,
        }
    }

    pub(super) fn status_from(r: &StatusReport) -> Status {
        Status {
            server: r.server.clone(),
            config_path: r.config_path.clone(),
            config_error: r.config_error.clone(),
            window_us: r.window_us,
            uptime_us: r.uptime_us,
            groups: r.groups.iter().map(group_from).collect(),
            devices: r.devices.iter().map(device_from).collect(),
            clients: r
                .clients
                .iter()
                .map(|c| Client {
                    id: c.id,
                    pid: c.pid,
                    role: c.role,
                    group: c.group.clone(),
                    job: c.job.clone(),
                    user: c.user.clone(),
                    command: c.command.clone(),
                    devices: c.devices.clone(),
                    protocol: c.protocol,
                    build: c.build.clone(),
                })
                .collect(),
            reservations: r.reservations.clone(),
            queue: r.queue.clone(),
            driver_limits: r.driver_limits,
            refused: r.refused.clone(),
            protocol: r.protocol,
        }
    }

    pub(super) fn status_into(s: Status) -> StatusReport {
        StatusReport {
            server: s.server,
            config_path: s.config_path,
            config_error: s.config_error,
            window_us: s.window_us,
            uptime_us: s.uptime_us,
            groups: s.groups.into_iter().map(group_into).collect(),
            devices: s.devices.into_iter().map(device_into).collect(),
            clients: s
                .clients
                .into_iter()
                .map(|c| ClientStatus {
                    id: c.id,
                    pid: c.pid,
                    role: c.role,
                    group: c.group,
                    job: c.job,
                    user: c.user,
                    command: c.command,
                    devices: c.devices,
                    protocol: c.protocol,
                    build: c.build,
                    waiting: Vec::new(),
                    memory: Vec::new(),
                    gpu_us: 0,
                })
                .collect(),
            reservations: s.reservations,
            queue: s.queue,
            driver_limits: s.driver_limits,
            refused: s.refused,
            protocol: s.protocol,
        }
    }
}

/// Protocols 14 to 19: the token request without the client's launch
/// length (`launch_us`).
mod v19 {
    use super::*;
    use crate::Span;

    #[derive(Serialize, Deserialize)]
    pub(super) struct AcquireToken {
        pub(super) device: DeviceId,
        pub(super) ran: Vec<Span>,
        pub(super) in_flight: bool,
        pub(super) burst_us: u64,
        pub(super) rtt_us: u32,
    }
}

/// Protocols 14 to 20: the token asked ahead without when the launch it
/// is for is predicted (`launch_in_us`).
mod v20 {
    use super::*;

    #[derive(Serialize, Deserialize)]
    pub(super) struct AcquireTokenAhead {
        pub(super) device: DeviceId,
        pub(super) burst_us: u64,
        pub(super) rtt_us: u32,
    }
}

/// Writes `seq`, a variant index and its fields after `out` (a header).
fn changed<T: Serialize>(out: Vec<u8>, seq: u32, variant: u32, fields: &T) -> Vec<u8> {
    let fallback = out.clone();
    postcard::to_extend(&(seq, variant, fields), out).unwrap_or(fallback)
}

/// Encodes `req` as a peer of `version` (older than ours, and spoken)
/// reads it.
pub(crate) fn encode_request(version: u16, seq: u32, req: &Request) -> Vec<u8> {
    match req {
        Request::Hello {
            role,
            group,
            pid,
            held,
            job,
            build: _,
        } if version == 14 => changed(
            header(version),
            seq,
            HELLO,
            &v14::Hello {
                role: *role,
                group: group.clone(),
                pid: *pid,
                held: held.clone(),
                job: job.clone(),
            },
        ),
        Request::AcquireToken {
            device,
            ran,
            in_flight,
            burst_us,
            rtt_us,
            launch_us: _,
        } if version <= 19 => changed(
            header(version),
            seq,
            ACQUIRE_TOKEN,
            &v19::AcquireToken {
                device: *device,
                ran: ran.clone(),
                in_flight: *in_flight,
                burst_us: *burst_us,
                rtt_us: *rtt_us,
            },
        ),
        Request::AcquireTokenAhead {
            device,
            burst_us,
            rtt_us,
            launch_in_us: _,
        } if version <= 20 => changed(
            header(version),
            seq,
            ACQUIRE_TOKEN_AHEAD,
            &v20::AcquireTokenAhead {
                device: *device,
                burst_us: *burst_us,
                rtt_us: *rtt_us,
            },
        ),
        _ => crate::codec::encode_as(version, seq, req),
    }
}

/// Encodes `reply` as a peer of `version` (older than ours, and spoken)
/// reads it.
pub(crate) fn encode_reply(version: u16, seq: u32, reply: &Reply) -> Vec<u8> {
    match reply {
        Reply::Status(r) if version == 14 => {
            changed(header(version), seq, STATUS, &v14::status_from(r))
        }
        Reply::Status(r) if version == 15 => {
            changed(header(version), seq, STATUS, &v15::status_from(r))
        }
        _ => crate::codec::encode_as(version, seq, reply),
    }
}

/// The sequence number and variant index at the start of a body.
fn variant_of(body: &[u8]) -> Result<(u32, u32, &[u8]), CodecError> {
    let bad = |e: postcard::Error| CodecError::Body(e.to_string());
    let (seq, rest) = postcard::take_from_bytes::<u32>(body).map_err(bad)?;
    let (variant, rest) = postcard::take_from_bytes::<u32>(rest).map_err(bad)?;
    Ok((seq, variant, rest))
}

/// Decodes the body of a request frame of `version` (older than ours, and
/// spoken).
pub(crate) fn decode_request(version: u16, body: &[u8]) -> Result<(u32, Request), CodecError> {
    let (seq, variant, fields) = variant_of(body)?;
    if version == 14 && variant == HELLO {
        let h: v14::Hello = take_all(fields)?;
        return Ok((
            seq,
            Request::Hello {
                role: h.role,
                group: h.group,
                pid: h.pid,
                held: h.held,
                job: h.job,
                build: String::new(),
            },
        ));
    }
    if version <= 19 && variant == ACQUIRE_TOKEN {
        let t: v19::AcquireToken = take_all(fields)?;
        return Ok((
            seq,
            Request::AcquireToken {
                device: t.device,
                ran: t.ran,
                in_flight: t.in_flight,
                burst_us: t.burst_us,
                rtt_us: t.rtt_us,
                launch_us: 0,
            },
        ));
    }
    if version <= 20 && variant == ACQUIRE_TOKEN_AHEAD {
        let t: v20::AcquireTokenAhead = take_all(fields)?;
        return Ok((
            seq,
            Request::AcquireTokenAhead {
                device: t.device,
                burst_us: t.burst_us,
                rtt_us: t.rtt_us,
                launch_in_us: 0,
            },
        ));
    }
    crate::codec::decode_current(body)
}

/// Decodes the body of a reply frame of `version` (older than ours, and
/// spoken).
pub(crate) fn decode_reply(version: u16, body: &[u8]) -> Result<(u32, Reply), CodecError> {
    let (seq, variant, fields) = variant_of(body)?;
    if version == 14 && variant == STATUS {
        let s: v14::Status = take_all(fields)?;
        return Ok((seq, Reply::Status(Box::new(v14::status_into(s)))));
    }
    if version == 15 && variant == STATUS {
        let s: v15::Status = take_all(fields)?;
        return Ok((seq, Reply::Status(Box::new(v15::status_into(s)))));
    }
    crate::codec::decode_current(body)
}
