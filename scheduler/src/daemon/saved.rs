//! GPU reservations kept across a restart of the daemon, in a state file
//! beside the socket.

use super::*;

/// A GPU reservation as the state file keeps it across restarts: the
/// process that holds it, identified by its pid and its start time (a pid
/// reused by another process is not the holder).
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub(super) struct SavedReservation {
    pub(super) pid: u32,
    pub(super) start_time: u64,
    pub(super) group: String,
    pub(super) devices: Vec<u32>,
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
        let held = self.policy.held_reservations();
        if self.saved_reservations.as_ref() == Some(&held) {
            return;
        }
        let now: Vec<SavedReservation> = held
            .iter()
            .filter_map(|(client, group, devices)| {
                let pid = self.conn(*client).and_then(|c| c.pid)?;
                Some(SavedReservation {
                    pid,
                    start_time: process_start_time(pid)?,
                    group: group.clone(),
                    devices: devices.clone(),
                })
            })
            .collect();
        let path = reservations_path(&self.ipc_dir);
        let tmp = path.with_extension("json.tmp");
        let written = serde_json::to_vec_pretty(&now)
            .map_err(std::io::Error::other)
            .and_then(|bytes| std::fs::write(&tmp, bytes))
            .and_then(|()| std::fs::rename(&tmp, &path));
        match written {
            Ok(()) => self.saved_reservations = Some(held),
            Err(e) => warn!("cannot write {}: {e}", path.display()),
        }
    }
}
