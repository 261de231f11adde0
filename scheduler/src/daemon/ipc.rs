//! The IPC directory and socket: who may connect (modes, group), made
//! safely, and made again if someone removes them.

use super::*;

/// Who may connect: the daemon's user only (directory 0700, socket 0700),
/// or also the members of one Unix group (0750 / 0770). Nobody else can
/// write to either.
#[derive(Debug, Clone, Copy)]
pub(super) struct IpcAccess {
    group: Option<nix::unistd::Gid>,
}

impl IpcAccess {
    pub(super) fn from_settings(settings: &Settings) -> anyhow::Result<IpcAccess> {
        let group = match &settings.ipc_group {
            None => None,
            Some(name) => Some(
                nix::unistd::Group::from_name(name)
                    .with_context(|| format!("cannot look up Unix group {name:?} (ipc_group)"))?
                    .with_context(|| format!("Unix group {name:?} (ipc_group) does not exist"))?
                    .gid,
            ),
        };
        Ok(IpcAccess { group })
    }

    pub(super) fn dir_mode(&self) -> u32 {
        if self.group.is_some() { 0o750 } else { 0o700 }
    }

    /// The state files' mode: 0600, or 0640 for an `ipc_group`.
    pub(super) fn state_mode(&self) -> u32 {
        if self.group.is_some() { 0o640 } else { 0o600 }
    }

    pub(super) fn socket_mode(&self) -> u32 {
        if self.group.is_some() { 0o770 } else { 0o700 }
    }

    pub(super) fn apply(&self, path: &Path, mode: u32) -> anyhow::Result<()> {
        if let Some(gid) = self.group {
            nix::unistd::chown(path, None, Some(gid))
                .with_context(|| format!("cannot give {} to group {gid}", path.display()))?;
        }
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("cannot set mode {mode:o} on {}", path.display()))
    }
}

/// Creates the IPC directory (mode 0700, or 0750 for an `ipc_group`) if it
/// is missing. An existing directory is used as it is, never chmodded (it
/// may be `/tmp`, or shared): it is refused if it belongs to another user
/// (not root) or if anyone but its owner may write to it, since they could
/// replace the socket.
pub(super) fn prepare_ipc_dir(dir: &Path, access: IpcAccess) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    check_parents(dir)?;
    if !dir.exists() {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .with_context(|| format!("cannot create IPC directory {}", dir.display()))?;
        // Again: a parent made meanwhile by someone else.
        check_parents(dir)?;
        // `recursive` applies the mode through the umask: set it exactly
        // on the directory this daemon made.
        return access.apply(dir, access.dir_mode());
    }
    if !dir.is_dir() {
        bail!("IPC path {} exists and is not a directory", dir.display());
    }
    let meta = std::fs::metadata(dir).with_context(|| format!("cannot read {}", dir.display()))?;
    if meta.uid() != euid() && meta.uid() != 0 {
        bail!(
            "IPC directory {} belongs to uid {}, not to this user (uid {}): another user could replace the socket; remove it or choose another --ipc-dir",
            dir.display(),
            meta.uid(),
            euid()
        );
    }
    let mode = meta.mode() & 0o7777;
    if mode & 0o022 != 0 {
        bail!(
            "IPC directory {} may be written by other users (mode {mode:04o}): they could replace the socket. \
             gem-schd changes no directory it did not create; name one of its own (it is created 0700), e.g. --ipc-dir {}",
            dir.display(),
            dir.join("gemini").display()
        );
    }
    if access.group.is_some() && mode & 0o050 != 0o050 {
        warn!(
            "IPC directory {} (mode {mode:04o}) does not let the ipc_group enter it: its members cannot connect. \
             Give it mode 0750 and that group, or let gem-schd create a new one",
            dir.display()
        );
    }
    Ok(())
}

/// Refuses an IPC directory below one that another user (not root) owns,
/// or that others may write without the sticky bit (as /tmp has): they
/// could rename the IPC directory away and put their own in its place.
fn check_parents(dir: &Path) -> anyhow::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let absolute = std::path::absolute(dir).unwrap_or_else(|_| dir.to_path_buf());
    for parent in absolute.ancestors().skip(1) {
        let Ok(meta) = std::fs::metadata(parent) else {
            continue; // made by this daemon, below
        };
        let mode = meta.mode() & 0o7777;
        if meta.uid() != euid() && meta.uid() != 0 {
            bail!(
                "{} (above the IPC directory {}) belongs to uid {}, not to this user (uid {}) or root: \
                 that user could replace the socket; choose another --ipc-dir (the package uses one only root can make)",
                parent.display(),
                dir.display(),
                meta.uid(),
                euid()
            );
        }
        if mode & 0o022 != 0 && mode & 0o1000 == 0 {
            bail!(
                "{} (above the IPC directory {}) may be written by other users (mode {mode:04o}, not sticky): \
                 they could replace the socket; choose another --ipc-dir",
                parent.display(),
                dir.display()
            );
        }
    }
    Ok(())
}

/// True if a scheduler already answers in `dir`.
pub(super) fn scheduler_alive(dir: &Path) -> bool {
    if !scheduler_socket_path(dir).exists() {
        return false;
    }
    crate::client::Client::connect(dir)
        .and_then(|mut c| c.request(&Request::Status, Duration::from_millis(500)))
        .is_ok()
}

impl Daemon {
    /// Recreates the IPC directory and socket if someone removed them:
    /// connected clients keep their connections, new ones can connect again.
    pub(super) fn check_socket(&mut self) {
        if self.last_socket_check.elapsed() < Duration::from_secs(1) {
            return;
        }
        self.last_socket_check = Instant::now();
        if self.socket_path.exists() {
            return;
        }
        warn!(
            "{} disappeared; creating it again",
            self.socket_path.display()
        );
        // Bound again beside the old (now nameless) listener, whose
        // connections stay up.
        let result = prepare_ipc_dir(&self.ipc_dir, self.access)
            .and_then(|()| self.sock.bind(&self.endpoint).map_err(anyhow::Error::from))
            .and_then(|()| {
                self.access
                    .apply(&self.socket_path, self.access.socket_mode())
            });
        if let Err(e) = result {
            error!(
                "cannot recreate {}: {e:#}; retrying",
                self.socket_path.display()
            );
        }
    }
}
