//! Where the scheduler listens: `ipc://$GEMINI_IPC_DIR/scheduler.sock`.

use std::path::{Path, PathBuf};

/// Default for `GEMINI_IPC_DIR`.
pub const DEFAULT_IPC_DIR: &str = "/tmp/gemini/ipc";
/// File name of the scheduler's socket inside the IPC directory.
pub const SCHEDULER_SOCKET: &str = "scheduler.sock";

/// Longest socket path the kernel accepts (`sun_path` is 108 bytes,
/// one of them the terminating NUL).
const MAX_SOCKET_PATH: usize = 107;

/// An endpoint that cannot be used.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum EndpointError {
    /// The socket path does not fit in a Unix socket address.
    #[error(
        "IPC socket path {path:?} is {len} bytes long; Unix sockets allow at most {MAX_SOCKET_PATH}: choose a shorter GEMINI_IPC_DIR"
    )]
    PathTooLong {
        /// The offending path.
        path: PathBuf,
        /// Its length in bytes.
        len: usize,
    },
    /// The path is not valid UTF-8, which ZeroMQ endpoints require.
    #[error("IPC directory {0:?} is not valid UTF-8")]
    NotUtf8(PathBuf),
}

/// The IPC directory named by `value` (the content of `GEMINI_IPC_DIR`),
/// or the default when it is unset or empty.
pub fn ipc_dir_or_default(value: Option<&std::ffi::OsStr>) -> PathBuf {
    match value {
        Some(v) if !v.is_empty() => PathBuf::from(v),
        _ => PathBuf::from(DEFAULT_IPC_DIR),
    }
}

/// Path of the scheduler's socket file in `ipc_dir`.
pub fn scheduler_socket_path(ipc_dir: &Path) -> PathBuf {
    ipc_dir.join(SCHEDULER_SOCKET)
}

/// The scheduler's socket in `ipc_dir`, when the kernel refuses this
/// process a connection to it (the directory or socket is closed to its
/// user: it is not in the daemon's `ipc_group`). ZeroMQ connects lazily
/// and retries forever, so without this a refusal looks like a scheduler
/// that does not answer.
pub fn socket_denied(ipc_dir: &Path) -> Option<PathBuf> {
    let path = scheduler_socket_path(ipc_dir);
    match std::os::unix::net::UnixStream::connect(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Some(path),
        _ => None,
    }
}

/// What to tell a user refused the scheduler's socket at `path`.
pub fn denied_message(path: &Path) -> String {
    format!(
        "permission denied on {}: this user may not use the scheduler; ask its administrator to add you to the Unix group it serves (gem-schd --ipc-group, ipc_group in gemini.toml)",
        path.display()
    )
}

/// The ZeroMQ endpoint (`ipc://…`) of the scheduler listening in `ipc_dir`.
pub fn scheduler_endpoint(ipc_dir: &Path) -> Result<String, EndpointError> {
    let path = scheduler_socket_path(ipc_dir);
    let s = path
        .to_str()
        .ok_or_else(|| EndpointError::NotUtf8(ipc_dir.to_path_buf()))?;
    if s.len() > MAX_SOCKET_PATH {
        return Err(EndpointError::PathTooLong { len: s.len(), path });
    }
    Ok(format!("ipc://{s}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoint_joins_dir_and_socket_name() {
        assert_eq!(
            scheduler_endpoint(Path::new("/run/gemini")).as_deref(),
            Ok("ipc:///run/gemini/scheduler.sock")
        );
    }

    #[test]
    fn unset_or_empty_env_gives_default_dir() {
        assert_eq!(ipc_dir_or_default(None), PathBuf::from(DEFAULT_IPC_DIR));
        assert_eq!(
            ipc_dir_or_default(Some("".as_ref())),
            PathBuf::from(DEFAULT_IPC_DIR)
        );
        assert_eq!(ipc_dir_or_default(Some("/x".as_ref())), PathBuf::from("/x"));
    }

    #[test]
    fn overlong_socket_path_is_refused() {
        let dir = PathBuf::from(format!("/{}", "d".repeat(120)));
        assert!(matches!(
            scheduler_endpoint(&dir),
            Err(EndpointError::PathTooLong { .. })
        ));
    }
}
