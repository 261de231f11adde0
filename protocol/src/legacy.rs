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
        pub(super) groups: Vec<GroupStatus>,
        pub(super) devices: Vec<DeviceStatus>,
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
            groups: r.groups.clone(),
            devices: r.devices.clone(),
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
            groups: s.groups,
            devices: s.devices,
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
    crate::codec::decode_current(body)
}
