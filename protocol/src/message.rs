//! The messages. A connection starts with [`Request::Hello`]; every request
//! gets exactly one [`Reply`] carrying the same sequence number, though a
//! token request's reply may come much later (when the token is granted).

use serde::{Deserialize, Serialize};

/// Index of a device as the client's driver numbers it.
pub type DeviceId = u32;
/// Identifier the scheduler gives a connection in [`Reply::Welcome`].
pub type ClientId = u64;

/// What a frame carries: the sender's sequence number and the body.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Envelope<T> {
    /// Chosen by the requester, echoed in the reply.
    pub seq: u32,
    /// The message.
    pub body: T,
}

/// The kind of peer that says hello.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Role {
    /// A CUDA program under the hook: gets tokens and memory for its group.
    Client,
    /// The holder: served only when no client waits, yields on demand.
    Holder,
    /// A command-line tool (`gem-schd status`, `gem-launch`): no tokens.
    Control,
}

/// Memory a reconnecting client already holds on a device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct HeldMemory {
    /// The device.
    pub device: DeviceId,
    /// Bytes held there.
    pub bytes: u64,
}

/// A stretch of time during which work of one client occupied a device:
/// from when its first work could start (launched onto the device, and
/// not before its token) to when its last work was seen complete, as
/// absolute times on `CLOCK_MONOTONIC` in microseconds (the clock every
/// process of the machine shares). Reported by the client that measured
/// it; the scheduler clips what cannot be (in the future, before the
/// client's token, or overlapping what it reported before).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// Start, µs on `CLOCK_MONOTONIC`.
    pub start_us: u64,
    /// End, µs on `CLOCK_MONOTONIC` (not before `start_us`).
    pub end_us: u64,
}

impl Span {
    /// A span from `start_ns` to `end_ns` (`CLOCK_MONOTONIC`, ns); `None`
    /// where it is empty.
    pub fn from_ns(start_ns: u64, end_ns: u64) -> Option<Span> {
        (end_ns > start_ns).then_some(Span {
            start_us: start_ns / 1000,
            end_us: end_ns.div_ceil(1000),
        })
    }

    /// Its length, µs.
    pub fn len_us(&self) -> u64 {
        self.end_us.saturating_sub(self.start_us)
    }
}

/// Client → scheduler.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Request {
    /// First message of every connection, exactly once. `group` is required
    /// for [`Role::Client`] and ignored otherwise. `held` lists memory the
    /// process already holds (non-empty when it reconnects to a restarted
    /// scheduler); it is registered as is, even beyond the limit.
    /// Reply: [`Reply::Welcome`], or an error (unknown group, mismatch).
    Hello {
        /// What the peer is.
        role: Role,
        /// The group (the program's `GEMINI_GROUP_NAME`).
        group: String,
        /// The process id the client believes it has; the scheduler prefers
        /// the kernel's peer credentials where the transport gives them.
        pid: u32,
        /// Memory already held, for re-registration.
        held: Vec<HeldMemory>,
        /// The multi-GPU job the process is a rank of, as its launcher
        /// declares it (see [`crate::job`]); `None`: none. Only a job's
        /// ranks take their GPUs in turns.
        job: Option<String>,
        /// The peer's gemini release ([`crate::BUILD`]; empty from a peer
        /// of protocol 14, which did not send it), shown in `gem-schd
        /// status` so an operator sees who still runs an old hook.
        build: String,
    },
    /// Ask for the token of `device`. `ran` is the device time the
    /// client's work occupied since its last report on this device, as
    /// measured ([`Span`]); `burst_us` its prediction of the next burst.
    /// Allowed for clients and the holder. Reply: [`Reply::Token`], sent
    /// when the token is granted — possibly much later.
    AcquireToken {
        /// The device.
        device: DeviceId,
        /// Work of the client that ran on the device since its last
        /// report, oldest first.
        ran: Vec<Span>,
        /// Work the client launched before still runs, not in `ran`
        /// (a renewed token's queue): it is reported later.
        in_flight: bool,
        /// Predicted length of the next burst, in microseconds.
        burst_us: u64,
        /// The client's token round trip, measured
        /// ([`crate::roundtrip`]), in microseconds; 0: not measured yet.
        rtt_us: u32,
        /// The device time one of the client's launches takes on the
        /// device, as its hook learned it (leaning long), in
        /// microseconds; 0: not known yet, or a peer of protocol 19 or
        /// older, which did not send it. The first launch under a token
        /// is admitted whole whatever its length, so gem-schd keeps a
        /// latency-critical group's return free of one (protocol 20).
        launch_us: u32,
    },
    /// Give the token of `device` back before it expires (the program went
    /// idle), reporting the device time its work occupied since its last
    /// report. Reply: [`Reply::Done`].
    ReleaseToken {
        /// The device.
        device: DeviceId,
        /// Work of the client that ran on the device since its last
        /// report, oldest first.
        ran: Vec<Span>,
        /// Work launched under the token still runs (it waits for another
        /// process: an NCCL collective for its peer rank; or it is
        /// queued behind other work). It is reported with
        /// [`Request::LateUsage`] once done; until then the client's
        /// group is mid-step on the device, and a job spanning devices
        /// keeps its turn so that the peer can catch up.
        in_flight: bool,
    },
    /// The client holds the token of `device`, has begun waiting for its
    /// work, predicted to end in `done_in_us`, and expects to go quiet
    /// after it (a CPU gap after a synchronisation, learned from its past
    /// waits). The scheduler may pass the device on a little before that
    /// end, so that the next holder's first launches queue behind the
    /// client's last work instead of reaching an idle device after the
    /// client's wait returns and it reports. The client launches nothing
    /// more under this token and reports with
    /// [`Request::ReleaseToken`] as usual. Reply: [`Reply::Done`].
    Quieting {
        /// The device.
        device: DeviceId,
        /// When the client's queued work is predicted to end, in
        /// microseconds from now.
        done_in_us: u64,
    },
    /// Reserve `bytes` of device memory for the client's group before the
    /// real allocation. Reply: [`Reply::Memory`] or
    /// [`ErrorKind::OutOfMemory`].
    ReserveMemory {
        /// The device.
        device: DeviceId,
        /// Bytes to reserve.
        bytes: u64,
    },
    /// Return a reservation (the allocation was freed, or the real
    /// allocation failed). Reply: [`Reply::Memory`].
    ReleaseMemory {
        /// The device.
        device: DeviceId,
        /// Bytes to return.
        bytes: u64,
    },
    /// The group's memory view on `device`. Reply: [`Reply::MemoryView`].
    MemoryInfo {
        /// The device.
        device: DeviceId,
    },
    /// The scheduler's state. Allowed without hello. Reply: [`Reply::Status`].
    Status,
    /// Stop the scheduler. Allowed without hello, only for the daemon's own
    /// user or root. Reply: [`Reply::Done`], then the daemon exits.
    Shutdown,
    /// The client is leaving: its token and memory are released at once.
    /// Reply: [`Reply::Done`].
    Goodbye,
    /// A client's real allocation failed for lack of device memory (its
    /// reservation was granted): ask the holder to give memory back on
    /// `device`. Reply: [`Reply::Done`] once the holder has freed some
    /// (retry the allocation), or [`ErrorKind::OutOfMemory`] if the holder
    /// holds none there or does not answer within a second.
    NeedMemory {
        /// The device.
        device: DeviceId,
        /// Bytes the failed allocation asked for.
        bytes: u64,
    },
    /// Reserve GPUs for a program about to start (`gem-launch`). `group`
    /// must exist. With `wait`, the request queues (first come, first
    /// served) until enough devices have room; without, it fails at once.
    /// Reply: [`Reply::Reserved`], or [`ErrorKind::Unavailable`]. The
    /// reservation lasts as long as the requesting process.
    Reserve {
        /// The group the program will run in.
        group: String,
        /// How many devices, or which.
        gpus: GpuRequest,
        /// Queue rather than fail when none is free.
        wait: bool,
    },
    /// Holder only: wait up to `wait_us` for an order. Reply:
    /// [`Reply::Holder`] with an order as soon as there is one, else with
    /// a report when the time is up.
    HolderPoll {
        /// Longest wait, in microseconds.
        wait_us: u64,
    },
    /// Re-read `resource.conf` now (as SIGHUP does). Allowed without hello,
    /// only for the daemon's own user or root. Reply: [`Reply::Done`] once
    /// the new configuration is in force, or [`ErrorKind::BadRequest`]
    /// with the file's errors (the previous configuration stays).
    Reload,
    /// The scheduler's index of each GPU named by its UUID (`GPU-…`, as
    /// NVML writes it), for a process whose own numbering differs: a
    /// container, whose NVML sees only its GPUs and numbers them from 0.
    /// Allowed without hello. Reply: [`Reply::Gpus`].
    Gpus {
        /// UUIDs, by the process's CUDA ordinal.
        uuids: Vec<String>,
    },
    /// The driver took `bytes` of `device` for a context of this client's
    /// process (measured: the context's own memory, its default limits
    /// included). The scheduler keeps the largest reported per device and
    /// gives it in [`Reply::MemoryView`], so that a process can reserve
    /// its first context before the driver makes it. Reply:
    /// [`Reply::Done`].
    ContextCost {
        /// The device.
        device: DeviceId,
        /// Bytes the context took.
        bytes: u64,
    },
    /// Reserve GPUs for `duration_us` for the connection's user, without
    /// a program (`gem-launch reserve --duration`): as [`Request::Reserve`],
    /// but the reservation outlives the connection and ends when it
    /// expires or its user (or the daemon's user, or root) releases it.
    /// Reply: [`Reply::Reserved`], or an error as for `Reserve`.
    ReserveFor {
        /// Group whose `MinUtil` the reservation claims.
        group: String,
        /// Devices wanted.
        gpus: GpuRequest,
        /// How long it holds them once granted, in microseconds.
        duration_us: u64,
        /// Wait in the queue when no GPU has room.
        wait: bool,
    },
    /// End the caller's user's reservations made with
    /// [`Request::ReserveFor`] that hold any of `devices` (empty: all of
    /// them; the daemon's user and root end anyone's). Reply:
    /// [`Reply::Released`].
    ReleaseReserved {
        /// Devices whose reservations end (empty: every one).
        devices: Vec<DeviceId>,
    },
    /// Work the client launched under a token it has already given back
    /// (its end did not wait for that work: the work outlasted the bound
    /// a token's end waits, waited for another process, or was queued)
    /// ran as `ran` says, and is done. Charged to the client's group as
    /// device time it used, including where it ran into another group's
    /// token (that group is then not charged for it). An empty `ran` says
    /// only that the work is done. Reply: [`Reply::Done`].
    LateUsage {
        /// The device.
        device: DeviceId,
        /// The work's device time, oldest first.
        ran: Vec<Span>,
    },
    /// The process created an NCCL communicator: it is a rank of the job
    /// `job` names (see [`crate::job`]), from now on. Reply:
    /// [`Reply::Done`].
    Job {
        /// The job.
        job: String,
    },
    /// Ask for the token of `device` a little before the client is
    /// predicted to launch again (it is quiet now, between steps, and has
    /// reported its last token). Served as [`Request::AcquireToken`]
    /// (nothing used since the last report) where that makes nobody
    /// wait (the device is free: no other client's token, no other
    /// waiter), where the client's group is latency-critical, or where
    /// its bursts are short (`burst_us` of 2 ms or less: a round trip at
    /// its launch would be a large part of its step). Otherwise it is
    /// declined at once with [`Reply::Done`], and the client asks when it
    /// launches: a token granted ahead keeps the device idle until the
    /// launch, and queued ahead it ended another group's lent token early.
    /// Reply: [`Reply::Token`] or [`Reply::Done`].
    AcquireTokenAhead {
        /// The device.
        device: DeviceId,
        /// Predicted length of the next burst, in microseconds.
        burst_us: u64,
        /// As in [`Request::AcquireToken`].
        rtt_us: u32,
        /// When the client is predicted to launch, in microseconds from
        /// when it sent this (its hook asks a little before that); 0: not
        /// said (a peer of protocol 20 or older). For a latency-critical
        /// group, gem-schd learns the group back then (less half the
        /// client's round trip, the request's way there; 2 ms after the
        /// request at most), not at the request, so that the tokens it
        /// lends meanwhile end by the launch (protocol 21).
        launch_in_us: u32,
    },
    /// Why a token asked for on `device` has not come: asked by a hook
    /// whose token request has waited a while (protocol 16). Reply:
    /// [`Reply::WaitReason`].
    WaitReason {
        /// The device.
        device: DeviceId,
    },
    /// Reserve `bytes` of device memory for an allocation, as
    /// [`Request::ReserveMemory`], after giving back `returned` bytes of
    /// the client's lease on `device` (what is left of it), and lease up
    /// to `lease` bytes more: the client's later allocations within its
    /// lease make no round trip until it ends (protocol 17). Reply:
    /// [`Reply::Leased`]; [`Reply::Recalled`] where the group has room
    /// only once its other processes' leases are back; or
    /// [`ErrorKind::OutOfMemory`].
    ReserveLeased {
        /// The device.
        device: DeviceId,
        /// Bytes to reserve for the allocation.
        bytes: u64,
        /// Bytes of the lease held, unused, given back first.
        returned: u64,
        /// Bytes wanted as a lease (the scheduler grants at most its own
        /// bound, and none while the group is short).
        lease: u64,
    },
    /// The client's lease on `device` ended: `bytes`, what is left of it,
    /// are given back (0: all used). Reply: [`Reply::Memory`].
    ReturnLease {
        /// The device.
        device: DeviceId,
        /// Bytes given back.
        bytes: u64,
    },
    /// Work the client gave back in flight was outstanding over `ran`,
    /// but is not proven to have run there: the client was granted a
    /// token again before it was seen done, and it may have run only
    /// after (queued behind another group's work, it ran in the new
    /// token). Charged to the client's group only where no measured span
    /// has that time (another group's, now or reported later), as
    /// [`Request::LateUsage`] otherwise; sent just before the report that
    /// follows it in time (protocol 18). Reply: [`Reply::Done`].
    UnprovenUsage {
        /// The device.
        device: DeviceId,
        /// The time the work was outstanding, oldest first.
        ran: Vec<Span>,
    },
    /// The client's token of `device` ran out with its work still queued,
    /// predicted to end in `done_in_us`; it waits for that work, reports
    /// with [`Request::ReleaseToken`] and asks again, as usual. As for
    /// [`Request::Quieting`], the scheduler may pass the device on a
    /// little before that end (once another program that may run waits);
    /// unlike it, the client's group is not going away: it counts as
    /// waiting until the client asks again (protocol 19). Reply:
    /// [`Reply::Done`].
    RunningOut {
        /// The device.
        device: DeviceId,
        /// When the client's queued work is predicted to end, in
        /// microseconds from now.
        done_in_us: u64,
    },
}

/// Scheduler → client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Reply {
    /// Answer to hello.
    Welcome {
        /// The connection's id.
        client: ClientId,
        /// The scheduler's build version.
        server: String,
        /// The configuration file in force.
        config_path: String,
    },
    /// The token of `device`, valid for `quota_us` microseconds from now.
    Token {
        /// The device.
        device: DeviceId,
        /// How long the client may launch work, in microseconds.
        quota_us: u64,
        /// The device is lent: a group owed time is between bursts and
        /// will be back, so the client must keep the work it queues within
        /// the quota (the returning group waits behind it).
        lent: bool,
        /// The turn of the client's job (its ranks on several devices)
        /// is over: the token ends with the step under way, at the first
        /// wait that proves all its work done, where the client gives it
        /// back ([`Request::ReleaseToken`]) instead of launching the next
        /// step. So the job's ranks stop together, between two
        /// collectives, and none spins through the next job's turn.
        last_step: bool,
        /// How long the request waited in the scheduler for this grant
        /// (µs): the client's time from its request to this reply, less
        /// this, is a round trip ([`crate::roundtrip`]).
        held_us: u64,
    },
    /// The group's memory on a device after the request.
    Memory {
        /// The device.
        device: DeviceId,
        /// Bytes the group has reserved there, all its processes together.
        used: u64,
        /// The group's `MemoryLimit`.
        limit: u64,
    },
    /// The request was carried out; nothing to report.
    Done,
    /// Answer to [`Request::Status`].
    Status(Box<StatusReport>),
    /// The request was refused.
    Error(ErrorReply),
    /// Answer to [`Request::HolderPoll`].
    Holder(HolderOrder),
    /// Answer to [`Request::Reserve`]: the devices, in the order to expose
    /// them (`CUDA_VISIBLE_DEVICES`).
    Reserved {
        /// Physical device indices.
        devices: Vec<DeviceId>,
    },
    /// Answer to [`Request::MemoryInfo`]: the group's memory on a device,
    /// and what the holder holds there (which it gives back on demand, so
    /// a client may count it as free).
    MemoryView {
        /// The device.
        device: DeviceId,
        /// Bytes the group has reserved there.
        used: u64,
        /// The group's `MemoryLimit`.
        limit: u64,
        /// Bytes the holder holds on the device.
        reclaimable: u64,
        /// The most a context took on the device, as processes reported
        /// it ([`Request::ContextCost`]); 0: none reported yet.
        context: u64,
    },
    /// Answer to [`Request::ReleaseReserved`]: the devices given back (by
    /// every reservation ended), in order; empty where none was ended.
    Released {
        /// Devices given back.
        devices: Vec<DeviceId>,
    },
    /// Answer to [`Request::Gpus`]: the scheduler's index of each UUID, in
    /// the order asked; `None` for one it does not know (no NVML where the
    /// scheduler runs, or a GPU of another machine).
    Gpus {
        /// Indices, by the request's order.
        devices: Vec<Option<DeviceId>>,
    },
    /// Answer to [`Request::WaitReason`].
    WaitReason {
        /// The device is reserved for another group, which the asker's
        /// group waits for (`None`: not that).
        reserved: Option<ReservedFor>,
    },
    /// Answer to [`Request::ReserveLeased`]: the allocation's bytes are
    /// reserved, and `lease` more are the client's until `ttl_us` from
    /// when it sent the request.
    Leased {
        /// The device.
        device: DeviceId,
        /// Bytes the group has reserved there, leases included.
        used: u64,
        /// The group's `MemoryLimit`.
        limit: u64,
        /// Bytes leased (0: none).
        lease: u64,
        /// How long the lease lasts, in microseconds.
        ttl_us: u64,
    },
    /// Answer to [`Request::ReserveLeased`]: the group has room only once
    /// the leases of its other processes on `device` are back, which the
    /// scheduler has stopped renewing: ask again in `retry_us`. Nothing
    /// was reserved (the `returned` bytes were taken back).
    Recalled {
        /// The device.
        device: DeviceId,
        /// When to ask again, in microseconds.
        retry_us: u64,
    },
}

/// A reservation another group holds of a device, as a waiting program is
/// told of it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReservedFor {
    /// The group it is for.
    pub group: String,
    /// Its user (empty where unknown).
    pub user: String,
    /// How long it has left, in microseconds (`None`: until its program
    /// ends).
    pub left_us: Option<u64>,
}

/// Which GPUs a launch wants.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum GpuRequest {
    /// Any `n` devices: the least recently released among those with room.
    Count(u32),
    /// These devices.
    Ids(Vec<DeviceId>),
}

/// What the scheduler tells the holder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum HolderOrder {
    /// A real client needs memory on `device`: free at least `bytes` of
    /// what you hold there (all of it if you hold less), then release the
    /// reservation.
    FreeMemory {
        /// The device.
        device: DeviceId,
        /// Bytes needed.
        bytes: u64,
    },
    /// Nothing to do; how long ago real clients last asked for each device.
    Report(Vec<DeviceActivity>),
    /// The scheduler is shutting down: release everything.
    Stop,
}

/// Real-client activity on a device.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceActivity {
    /// The device.
    pub device: DeviceId,
    /// Microseconds since a real client last asked for a token or memory
    /// there, or held or waited for the token (0: one does now;
    /// `u64::MAX`: never).
    pub idle_us: u64,
    /// The real client that holds (or else waits for) the device's token
    /// now: "pid P (group G)".
    #[serde(default)]
    pub used_by: Option<String>,
}

/// Why a request was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum ErrorKind {
    /// The peer speaks another protocol version.
    ProtocolMismatch,
    /// The frame could not be decoded.
    Malformed,
    /// The group is not in `resource.conf`.
    UnknownGroup,
    /// A request other than hello/status/shutdown before hello.
    NotRegistered,
    /// A second hello on one connection.
    AlreadyRegistered,
    /// The reservation would pass the group's `MemoryLimit`.
    OutOfMemory,
    /// No device has room (and the request did not ask to wait).
    Unavailable,
    /// The request does not fit the client's state (e.g. releasing a token
    /// it does not hold, a holder asking for memory as a group).
    Unexpected,
    /// The peer's user may not do this.
    PermissionDenied,
    /// A value is out of range (device index, size).
    BadRequest,
}

/// A refusal, with a message for humans that says what to do.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorReply {
    /// Machine-readable reason.
    pub kind: ErrorKind,
    /// What happened and, where possible, what to do about it.
    pub message: String,
}

impl std::fmt::Display for ErrorReply {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{:?}: {}", self.kind, self.message)
    }
}

/// Everything `gem-schd status` shows.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatusReport {
    /// Scheduler build version.
    pub server: String,
    /// `resource.conf` in force.
    pub config_path: String,
    /// The last reload error, if the file on disk is currently invalid.
    pub config_error: Option<String>,
    /// Accounting window, in microseconds.
    pub window_us: u64,
    /// Time since the daemon started, in microseconds.
    pub uptime_us: u64,
    /// Configured groups.
    pub groups: Vec<GroupStatus>,
    /// Devices that have seen a request.
    pub devices: Vec<DeviceStatus>,
    /// Connected clients.
    pub clients: Vec<ClientStatus>,
    /// GPU reservations held by running programs.
    pub reservations: Vec<ReservationStatus>,
    /// Launches waiting for GPUs, first in line first.
    pub queue: Vec<ReservationStatus>,
    /// Who enforces `MemoryLimit` for groups bound to cgroups: the driver
    /// too (its per-cgroup limits, R615 drivers), or the hook alone.
    #[serde(default)]
    pub driver_limits: bool,
    /// Peers refused for speaking a protocol version this scheduler does
    /// not (they wait, gated, for one that does).
    #[serde(default)]
    pub refused: Vec<RefusedPeer>,
    /// The newest protocol version the scheduler speaks.
    #[serde(default)]
    pub protocol: u16,
}

/// A peer refused for its protocol version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RefusedPeer {
    /// Its process (0 where the transport does not say).
    pub pid: u32,
    /// Its user (empty where unknown).
    pub user: String,
    /// The protocol version it speaks.
    pub protocol: u16,
    /// How long since it was last refused, in microseconds.
    pub ago_us: u64,
}

/// A reservation, held or waiting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReservationStatus {
    /// The launcher's connection.
    pub client: ClientId,
    /// Its process (the program, once started).
    pub pid: u32,
    /// Group.
    pub group: String,
    /// Devices held, or asked for.
    pub gpus: GpuRequest,
    /// Devices held (empty while waiting).
    pub devices: Vec<DeviceId>,
    /// How long it has held or waited, in microseconds.
    pub for_us: u64,
    /// The user who asked (the connection's peer; empty where unknown).
    #[serde(default)]
    pub user: String,
    /// The asking process's command line (`gem-launch … -- PROGRAM`; empty
    /// where unknown).
    #[serde(default)]
    pub command: String,
    /// A reservation made without a program (`gem-launch reserve`): its
    /// user, and how long it has left (for one still waiting, its length).
    #[serde(default)]
    pub manual: Option<ManualReservation>,
}

/// What a reservation made without a program adds to its status.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ManualReservation {
    /// The user who made it.
    pub user: String,
    /// Microseconds until it expires (held), or its length (waiting).
    pub left_us: u64,
}

/// A memory limit: `u64::MAX` (no limit) is `null` in a human-readable
/// format (the JSON of `gem-schd status --json`, where
/// 18446744073709551615 read as a limit), the number itself on the wire.
mod unlimited {
    use serde::{Deserialize, Deserializer, Serializer};

    pub fn serialize<S: Serializer>(v: &u64, s: S) -> Result<S::Ok, S::Error> {
        if s.is_human_readable() && *v == u64::MAX {
            s.serialize_none()
        } else {
            s.serialize_u64(*v)
        }
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        if d.is_human_readable() {
            Ok(Option::<u64>::deserialize(d)?.unwrap_or(u64::MAX))
        } else {
            u64::deserialize(d)
        }
    }
}

/// A group as configured.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupStatus {
    /// Section name in `resource.conf`.
    pub name: String,
    /// Guaranteed share of device time.
    pub min_util: f64,
    /// Ceiling on the share of device time.
    pub max_util: f64,
    /// Memory cap per device, bytes (`u64::MAX`: none; `null` in JSON).
    #[serde(with = "unlimited")]
    pub memory_limit: u64,
    /// Connected processes of the group.
    pub clients: u32,
    /// The GPUs the group may use (`Devices=`); `None`: every GPU.
    pub devices: Option<Vec<DeviceId>>,
    /// The limits the driver enforces for the group's cgroups
    /// (`nvmlDeviceSetMemoryLimits_v1`, R615 drivers), one per GPU and
    /// cgroup; empty where the hook alone caps the group's memory.
    #[serde(default)]
    pub driver_memory: Vec<DriverMemory>,
    /// Its latency class (`Latency=`): `normal` or `critical` (protocol
    /// 16; empty from an older scheduler).
    #[serde(default)]
    pub latency: String,
}

/// A device memory limit the driver enforces for one cgroup of a group on
/// one GPU.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DriverMemory {
    /// The GPU.
    pub device: DeviceId,
    /// The cgroup (`Cgroups=`).
    pub cgroup: String,
    /// Its hard limit, bytes.
    pub limit: u64,
    /// What its processes hold there now, as the driver counts it
    /// (`currentUsed`), bytes.
    pub used: u64,
}

/// One device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DeviceStatus {
    /// The device.
    pub device: DeviceId,
    /// Share of `span_us` during which the device was in use by anyone.
    pub busy: f64,
    /// What `busy` and every group's `share` on the device are measured
    /// over: the last window, or less where the device's first work in
    /// the window began later (µs).
    #[serde(default)]
    pub span_us: u64,
    /// The connection holding the device's token now (a program's, or
    /// gem-holder's).
    pub token_client: Option<ClientId>,
    /// Clients waiting for the token.
    pub waiting: u32,
    /// Per-group figures on this device.
    pub groups: Vec<GroupDeviceStatus>,
    /// The token round trip its clients measure and report (µs; 0: none
    /// reported yet): the leads that hide it are derived from it.
    #[serde(default)]
    pub rtt_us: u64,
    /// The device's memory, bytes, as NVML gives it (protocol 16; `None`
    /// where gem-schd has no NVML).
    #[serde(default)]
    pub memory_total: Option<u64>,
    /// Of it, what no process holds now, bytes, as NVML gives it.
    #[serde(default)]
    pub memory_free: Option<u64>,
}

/// One group on one device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GroupDeviceStatus {
    /// The group (`(holder)` for the holder).
    pub group: String,
    /// Share of the device's `span_us` the group's work occupied: the
    /// groups' shares add up to at most the device's `busy`.
    pub share: f64,
    /// Bytes reserved by the group's processes.
    pub memory_used: u64,
    /// The group's limit (`u64::MAX`: none; `null` in JSON).
    #[serde(with = "unlimited")]
    pub memory_limit: u64,
    /// Clients of the group waiting for this device's token.
    pub waiting: u32,
    /// Of `memory_used`, about what the processes' own contexts take: the
    /// group's processes holding memory on the device times the largest
    /// context a process reported there ([`Request::ContextCost`]).
    #[serde(default)]
    pub contexts: u64,
    /// Waiting while below its `MinUtil` as the scheduler weighs it (over
    /// the time since the group became active on the device, which
    /// `share` is not): its guarantee is short right now.
    #[serde(default)]
    pub short_of_min: bool,
}

/// One connection.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClientStatus {
    /// Connection id.
    pub id: ClientId,
    /// Process id.
    pub pid: u32,
    /// Role.
    pub role: Role,
    /// Group (empty for control and holder).
    pub group: String,
    /// The multi-GPU job it is a rank of, where one was declared.
    #[serde(default)]
    pub job: Option<String>,
    /// Its user (the connection's peer; empty where unknown).
    #[serde(default)]
    pub user: String,
    /// Its command line, as /proc shows it (cut to 120 bytes; empty where
    /// unknown).
    #[serde(default)]
    pub command: String,
    /// The devices it holds memory on, was granted a token of, or waits
    /// for.
    #[serde(default)]
    pub devices: Vec<DeviceId>,
    /// The protocol version it speaks.
    #[serde(default)]
    pub protocol: u16,
    /// Its gemini release, as its hello said (for a peer of protocol 14,
    /// which did not say, the release that spoke it).
    #[serde(default)]
    pub build: String,
    /// The devices whose token it waits for now (protocol 16).
    #[serde(default)]
    pub waiting: Vec<DeviceId>,
    /// The memory it holds, per device (protocol 16).
    #[serde(default)]
    pub memory: Vec<HeldMemory>,
    /// The device time it was charged since it said hello, all devices,
    /// in microseconds (protocol 16).
    #[serde(default)]
    pub gpu_us: u64,
}
