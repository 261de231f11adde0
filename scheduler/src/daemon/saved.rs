//! GPU reservations kept across a restart of the daemon, in a state file
//! beside the socket.

use super::*;

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
    Vec<(ClientId, String, Vec<u32>)>,
    Vec<(String, Vec<u32>, u32, String, u64)>,
);

/// Seconds since the Unix epoch now.
fn unix_now() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
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
                    m.uid,
                    m.user.clone(),
                    now + left,
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
            let id = self.next_id;
            self.next_id += 1;
            // A connection of no peer stands for the process: replies to
            // it are dropped, and its end is seen through the pid.
            let identity = format!("restored:{}", r.pid).into_bytes();
            self.conns.insert(
                identity.clone(),
                Conn {
                    id,
                    delimited: false,
                    cred: None,
                    pid: Some(r.pid),
                    last_seen: Instant::now(),
                },
            );
            self.ids.insert(id, identity);
            let now = self.now();
            // The scheduler itself makes the reservation again, as the one
            // it made before: with its own user's rights (a group's
            // AllowedUsers admitted the job then).
            let _ = self.policy.handle(
                Event::Connected {
                    client: id,
                    peer: Peer {
                        uid: euid(),
                        pid: r.pid,
                        user: "(restored)".into(),
                        groups: Vec::new(),
                        cgroups: Vec::new(),
                    },
                },
                now,
            );
            let hello = Request::Hello {
                role: Role::Control,
                group: String::new(),
                pid: r.pid,
                held: Vec::new(),
                job: None,
            };
            let _ = self.policy.handle(
                Event::Request {
                    client: id,
                    seq: 0,
                    req: hello,
                },
                now,
            );
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
        let mut now: Vec<SavedReservation> = held
            .iter()
            .filter_map(|(client, group, devices)| {
                let pid = self.conn(*client).and_then(|c| c.pid)?;
                Some(SavedReservation {
                    pid,
                    start_time: process_start_time(pid)?,
                    group: group.clone(),
                    devices: devices.clone(),
                    manual: None,
                })
            })
            .collect();
        let clock = self.now();
        let unix = unix_now();
        now.extend(
            manual
                .iter()
                .map(|(group, devices, uid, user, until)| SavedReservation {
                    pid: 0,
                    start_time: 0,
                    group: group.clone(),
                    devices: devices.clone(),
                    manual: Some(SavedManual {
                        uid: *uid,
                        user: user.clone(),
                        until_unix: unix + until.saturating_sub(clock).div_ceil(1_000_000),
                    }),
                }),
        );
        let path = reservations_path(&self.ipc_dir);
        let tmp = path.with_extension("json.tmp");
        let written = serde_json::to_vec_pretty(&now)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match written {
            Ok(()) => self.saved_reservations = Some(state),
            Err(e) => warn!("cannot write {}: {e}", path.display()),
        }
    }
}
