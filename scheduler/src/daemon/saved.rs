//! What a restart of the daemon must not lose, in state files beside the
//! socket: the GPU reservations (since when included), and the memory each
//! hooked process holds (until it says hello to the new daemon itself,
//! which an idle process does only at its next CUDA call).

use super::accounting::ReservationKey;
use super::*;
use std::collections::BTreeMap;

/// A GPU reservation as the state file keeps it across restarts: the
/// process that holds it, identified by its pid and its start time (a pid
/// reused by another process is not the holder); or, for one made
/// without a program, its user and when it expires.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedReservation {
    pub(super) pid: u32,
    pub(super) start_time: u64,
    pub(super) group: String,
    pub(super) devices: Vec<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) manual: Option<SavedManual>,
    /// When it was made, µs since the Unix epoch (0: not said, by a
    /// gemini before 0.2.0: counted from the restore).
    #[serde(default)]
    pub(super) since_unix_us: u64,
    /// The uid of the launch that made it, whose `reserve_max_gpus` it
    /// counts against (not said by a gemini before 0.2.0).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(super) uid: Option<u32>,
}

/// A reservation made without a program (`gem-launch reserve`).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedManual {
    pub(super) uid: u32,
    pub(super) user: String,
    /// When it expires, in seconds since the Unix epoch.
    pub(super) until_unix: u64,
}

/// What the state file was last written from: the run reservations and
/// those made without a program.
pub(super) type SavedState = (
    Vec<crate::policy::HeldReservation>,
    Vec<(String, Vec<u32>, u32, String, u64, i64)>,
);

/// The memory a hooked process holds, as the state file keeps it across a
/// restart: restored under a stand-in for the process until the process
/// says hello again (with what it holds then) or ends.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedMemory {
    pub(super) pid: u32,
    pub(super) start_time: u64,
    pub(super) group: String,
    /// `(device, bytes)`.
    pub(super) held: Vec<(u32, u64)>,
}

/// How often the memory state file is brought up to date (and at the
/// daemon's stop): a crash loses at most this much of it, and a process
/// says what it holds at its next call all the same.
const MEMORY_SAVE_EVERY: Duration = Duration::from_secs(1);

/// Seconds since the Unix epoch now.
fn unix_now() -> u64 {
    unix_now_us() / 1_000_000
}

/// Microseconds since the Unix epoch now.
fn unix_now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_micros() as u64)
}

/// How long before now `since_unix_us` was (0: unknown, none).
fn held_before(since_unix_us: u64) -> Micros {
    if since_unix_us == 0 {
        0
    } else {
        unix_now_us().saturating_sub(since_unix_us)
    }
}

/// The memory state file, beside the socket.
pub(super) fn memory_path(ipc_dir: &Path) -> PathBuf {
    ipc_dir.join("memory.json")
}

/// The state file of what a context took, per user and GPU (`CONTEXTS` in
/// the status, and what a new process reserves for its context): the
/// processes reported it once, when their contexts were made, and do not
/// again after a restart.
pub(super) fn contexts_path(ipc_dir: &Path) -> PathBuf {
    ipc_dir.join("contexts.json")
}

/// What a context took, as its state file keeps it.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedContext {
    pub(super) uid: u32,
    pub(super) device: u32,
    pub(super) bytes: u64,
}

/// The most entries taken from the contexts' state file (one per user
/// and GPU).
const MAX_SAVED_CONTEXTS: usize = 65_536;

/// Writes `value` as JSON to `path`, aside then renamed: never half a file.
/// Readable by the daemon's user only (0600), or also by the `ipc_group`
/// (0640, that group's): they name processes and users.
fn write_state<T: serde::Serialize>(
    path: &Path,
    value: &T,
    access: IpcAccess,
) -> std::io::Result<()> {
    use std::io::Write as _;
    use std::os::unix::fs::OpenOptionsExt as _;
    let tmp = path.with_extension("json.tmp");
    let bytes = serde_json::to_vec_pretty(value).map_err(std::io::Error::other)?;
    // A file left aside by a stop keeps its mode when opened again: made
    // anew.
    let _ = std::fs::remove_file(&tmp);
    let mut file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&tmp)?;
    access
        .apply(&tmp, access.state_mode())
        .map_err(std::io::Error::other)?;
    // No fsync: it would stall the event loop on a slow disk; a crash
    // loses at most the latest change, never the file.
    file.write_all(&bytes)?;
    std::fs::rename(&tmp, path)
}

/// The state file of the reservations, beside the socket.
pub(super) fn reservations_path(ipc_dir: &Path) -> PathBuf {
    ipc_dir.join("reservations.json")
}

/// When process `pid` started (clock ticks since boot, field 22 of
/// `/proc/PID/stat`), if it exists.
pub(super) fn process_start_time(pid: u32) -> Option<u64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The command name (field 2) may hold spaces and parentheses: count
    // from the last ')'.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_whitespace().nth(19)?.parse().ok()
}

impl Daemon {
    /// Takes back the reservations a previous daemon on this directory
    /// held for processes that still run: a restart must not hand out a
    /// GPU a running job holds.
    pub(super) fn restore_reservations(&mut self) {
        let path = reservations_path(&self.ipc_dir);
        let saved: Vec<SavedReservation> = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => {
                    warn!(
                        "{}: unreadable ({e}); no reservation restored",
                        path.display()
                    );
                    return;
                }
            },
            Err(_) => return,
        };
        for r in saved {
            if let Some(m) = r.manual {
                let now = self.now();
                let left = m.until_unix.saturating_sub(unix_now()) * 1_000_000;
                match self.policy.restore_manual(
                    &r.group,
                    r.devices.clone(),
                    (m.uid, m.user.clone()),
                    now + left,
                    held_before(r.since_unix_us),
                    now,
                ) {
                    Ok(()) => info!(
                        "reservation of GPU(s) {:?} by user {} (group {:?}) restored, {} s left",
                        r.devices,
                        m.user,
                        r.group,
                        left / 1_000_000
                    ),
                    Err(why) => info!(
                        "reservation of GPU(s) {:?} by user {} (group {:?}) not restored: {why}",
                        r.devices, m.user, r.group
                    ),
                }
                continue;
            }
            if process_start_time(r.pid) != Some(r.start_time) {
                info!(
                    "reservation of GPU(s) {:?} by pid {} not restored: the process has ended",
                    r.devices, r.pid
                );
                continue;
            }
            // The scheduler itself makes the reservation again, as the one
            // it made before: with its own user's rights (a group's
            // AllowedUsers admitted the job then).
            let hello = Request::Hello {
                role: Role::Control,
                group: String::new(),
                pid: r.pid,
                held: Vec::new(),
                job: None,
                build: gemini_protocol::BUILD.into(),
            };
            let route = Route::Reservation(r.pid);
            let (id, _) = self.open_stand_in(route, (r.pid, r.start_time), Vec::new(), "", hello);
            let now = self.now();
            let reserve = Request::Reserve {
                group: r.group.clone(),
                gpus: GpuRequest::Ids(r.devices.clone()),
                wait: false,
            };
            let actions = self.policy.handle(
                Event::Request {
                    client: id,
                    seq: 1,
                    req: reserve,
                },
                now,
            );
            let restored = actions.iter().any(|a| {
                matches!(
                    a,
                    Action::Reply {
                        reply: Reply::Reserved { .. },
                        ..
                    }
                )
            });
            if restored {
                self.policy
                    .restored_reservation(id, held_before(r.since_unix_us), r.uid);
                info!(
                    "reservation of GPU(s) {:?} by pid {} (group {:?}) restored",
                    r.devices, r.pid, r.group
                );
            } else {
                warn!(
                    "reservation of GPU(s) {:?} by pid {} (group {:?}) could not be restored: {actions:?}",
                    r.devices, r.pid, r.group
                );
            }
            self.watch(id, r.pid);
        }
        self.save_reservations();
    }

    /// Writes the reservations to the state file when they changed
    /// (written aside, then renamed: never half a file).
    pub(super) fn save_reservations(&mut self) {
        let state: SavedState = (
            self.policy.held_reservations(),
            self.policy.manual_reservations(),
        );
        if self.saved_reservations.as_ref() == Some(&state) {
            return;
        }
        let (held, manual) = &state;
        let clock = self.now();
        let unix = unix_now();
        let since_unix = |since: i64| {
            let ago = (clock as i64).saturating_sub(since).max(0) as u64;
            unix_now_us().saturating_sub(ago).max(1)
        };
        let mut now: Vec<SavedReservation> = held
            .iter()
            .filter_map(|r| {
                let pid = self.conn(r.client).and_then(|c| c.pid)?;
                Some(SavedReservation {
                    pid,
                    start_time: process_start_time(pid)?,
                    group: r.group.clone(),
                    devices: r.devices.clone(),
                    manual: None,
                    since_unix_us: since_unix(r.since),
                    uid: r.owner,
                })
            })
            .collect();
        now.extend(
            manual.iter().map(
                |(group, devices, uid, user, until, since)| SavedReservation {
                    pid: 0,
                    start_time: 0,
                    group: group.clone(),
                    devices: devices.clone(),
                    since_unix_us: since_unix(*since),
                    uid: Some(*uid),
                    manual: Some(SavedManual {
                        uid: *uid,
                        user: user.clone(),
                        until_unix: unix + until.saturating_sub(clock).div_ceil(1_000_000),
                    }),
                },
            ),
        );
        // For the accounting log: told apart by when they were made on
        // this scheduler's clock (the Unix time computed from it moves by
        // a microsecond or so from one look to the next).
        let seen: BTreeMap<ReservationKey, u64> = held
            .iter()
            .map(|r| {
                let pid = self.conn(r.client).and_then(|c| c.pid).unwrap_or(0);
                let key = (r.group.clone(), r.devices.clone(), r.since, r.owner, pid);
                (key, since_unix(r.since))
            })
            .chain(manual.iter().map(|(group, devices, uid, _, _, since)| {
                let key = (group.clone(), devices.clone(), *since, Some(*uid), 0);
                (key, since_unix(*since))
            }))
            .collect();
        if let Some(a) = &mut self.accounting {
            a.reservations(seen);
        }
        let path = reservations_path(&self.ipc_dir);
        match write_state(&path, &now, self.access) {
            Ok(()) => self.saved_reservations = Some(state),
            Err(e) => warn!("cannot write {}: {e}", path.display()),
        }
    }

    /// Writes the memory each hooked process holds to its state file, at
    /// most every [`MEMORY_SAVE_EVERY`] (`now`: at once), when it changed.
    pub(super) fn save_memory(&mut self, now: bool) {
        if !now && self.last_memory_save.elapsed() < MEMORY_SAVE_EVERY {
            return;
        }
        self.last_memory_save = Instant::now();
        // Compared before the process start times are read from /proc: a
        // scheduler of many processes reads them only when memory moved.
        // What contexts took changes apart from the memory: its own file,
        // its own check.
        self.save_contexts();
        let mut now_held = self.policy.client_memory();
        now_held.sort_by_key(|m| m.0);
        if self.saved_memory.as_ref() == Some(&now_held) {
            return;
        }
        let held: Vec<SavedMemory> = now_held
            .iter()
            .filter_map(|(pid, group, held)| {
                Some(SavedMemory {
                    pid: *pid,
                    start_time: process_start_time(*pid)?,
                    group: group.clone(),
                    held: held.clone(),
                })
            })
            .collect();
        // What was written, to compare with next time: a process whose
        // start time could not be read now (it ended, or /proc failed for
        // a moment) is not, so it is tried again.
        now_held.retain(|m| held.iter().any(|h| h.pid == m.0));
        let path = memory_path(&self.ipc_dir);
        match write_state(&path, &held, self.access) {
            Ok(()) => self.saved_memory = Some(now_held),
            Err(e) => warn!("cannot write {}: {e}", path.display()),
        }
    }

    /// Writes what contexts took to their state file, when it changed.
    fn save_contexts(&mut self) {
        let costs = self.policy.context_costs();
        if self.saved_contexts.as_ref() == Some(&costs) {
            return;
        }
        let saved: Vec<SavedContext> = costs
            .iter()
            .map(|&(uid, device, bytes)| SavedContext { uid, device, bytes })
            .collect();
        let path = contexts_path(&self.ipc_dir);
        match write_state(&path, &saved, self.access) {
            Ok(()) => self.saved_contexts = Some(costs),
            Err(e) => warn!("cannot write {}: {e}", path.display()),
        }
    }

    /// Takes back what contexts took under the previous daemon on this
    /// directory: `CONTEXTS` is shown, and a new process reserves its
    /// context's memory, at once after a restart, a crash included.
    pub(super) fn restore_contexts(&mut self) {
        let path = contexts_path(&self.ipc_dir);
        let Ok(bytes) = std::fs::read(&path) else {
            return;
        };
        match serde_json::from_slice::<Vec<SavedContext>>(&bytes) {
            Ok(saved) => {
                for c in saved.into_iter().take(MAX_SAVED_CONTEXTS) {
                    self.policy.restore_context_cost(c.uid, c.device, c.bytes);
                }
                self.saved_contexts = Some(self.policy.context_costs());
            }
            Err(e) => warn!(
                "{}: unreadable ({e}); no context sizes restored",
                path.display()
            ),
        }
    }

    /// Takes back the memory the hooked processes of a previous daemon on
    /// this directory held, for those that still run: each under a
    /// stand-in connection that says hello for it with what it held, until
    /// it says hello itself or ends. Without this, a process idle across
    /// the restart would be counted at nothing until its next call, and
    /// its group could allocate past its `MemoryLimit` meanwhile.
    pub(super) fn restore_memory(&mut self) {
        let path = memory_path(&self.ipc_dir);
        let saved: Vec<SavedMemory> = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice(&bytes) {
                Ok(v) => v,
                Err(e) => {
                    warn!("{}: unreadable ({e}); no memory restored", path.display());
                    return;
                }
            },
            Err(_) => return,
        };
        for m in saved {
            if m.pid == 0 || process_start_time(m.pid) != Some(m.start_time) {
                continue;
            }
            let route = Route::Memory(m.pid);
            if self.conns.contains_key(&route) {
                continue;
            }
            let hello = Request::Hello {
                role: Role::Client,
                group: m.group.clone(),
                pid: m.pid,
                held: m
                    .held
                    .iter()
                    .map(|&(device, bytes)| gemini_protocol::HeldMemory { device, bytes })
                    .collect(),
                job: None,
                build: String::new(),
            };
            // A group bound to cgroups takes only their processes: the
            // process's own, read now.
            let cgroups = peers::cgroups_of(m.pid);
            let (id, actions) =
                self.open_stand_in(route, (m.pid, m.start_time), cgroups, "(restored)", hello);
            if actions.iter().any(|a| {
                matches!(
                    a,
                    Action::Reply {
                        reply: Reply::Welcome { .. },
                        ..
                    }
                )
            }) {
                info!(
                    "memory of pid {} (group {:?}) restored: {:?} (device, bytes)",
                    m.pid, m.group, m.held
                );
                self.watch(id, m.pid);
            } else {
                warn!(
                    "memory of pid {} (group {:?}) could not be restored: {actions:?}",
                    m.pid, m.group
                );
                self.drop_stand_in(m.pid);
            }
        }
        self.save_memory(true);
    }

    /// Opens a stand-in connection (`route`, see [`Route`]) for
    /// process `pid` (started at `started`, as /proc says): a connection
    /// of no peer, whose replies are dropped
    /// and whose end is seen through the pid. The policy knows it as a
    /// peer of the scheduler's own user (the process was admitted when it
    /// first came) in `cgroups`, and `hello` is said for it. Its id, and
    /// what the hello did.
    fn open_stand_in(
        &mut self,
        route: Route,
        (pid, started): (u32, u64),
        cgroups: Vec<String>,
        build: &str,
        hello: Request,
    ) -> (ClientId, Vec<Action>) {
        let id = self.next_id;
        self.next_id += 1;
        self.conns.insert(
            route.clone(),
            Conn {
                id,
                delimited: false,
                cred: None,
                pid: Some(pid),
                last_seen: Instant::now(),
                version: gemini_protocol::PROTOCOL_VERSION,
                build: build.into(),
                started: Some(started),
            },
        );
        self.ids.insert(id, route);
        let now = self.now();
        let _ = self.policy.handle(
            Event::Connected {
                client: id,
                peer: Peer {
                    uid: euid(),
                    pid,
                    user: "(restored)".into(),
                    groups: Vec::new(),
                    cgroups,
                },
            },
            now,
        );
        let actions = self.policy.handle(
            Event::Request {
                client: id,
                seq: 0,
                req: hello,
            },
            now,
        );
        (id, actions)
    }

    /// Process `pid` (as the kernel names the peer) said hello itself,
    /// with what it holds now: the stand-in for its memory goes, if it
    /// stands in for this process (the same start time: a process that
    /// got the pid of an ended one takes nothing away).
    pub(super) fn adopt_stand_in(&mut self, pid: u32) {
        let Some(c) = self.conns.get(&Route::Memory(pid)) else {
            return;
        };
        if c.started.is_some() && c.started == process_start_time(pid) {
            self.drop_stand_in(pid);
        }
    }

    /// Drops the stand-in for process `pid`'s memory, if any.
    pub(super) fn drop_stand_in(&mut self, pid: u32) {
        self.forget(&Route::Memory(pid));
    }
}
