//! Where the scheduler listens: `ipc://$GEMINI_IPC_DIR/scheduler.sock`.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Default for `GEMINI_IPC_DIR`.
pub const DEFAULT_IPC_DIR: &str = "/tmp/gemini/ipc";
/// `gemini.toml` read by every part (daemon, tools, hook) when no other
/// is named and it exists.
pub const DEFAULT_SETTINGS: &str = "/etc/gemini/gemini.toml";
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

/// A settings file that does not say where the IPC directory is.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("{file}: {message}")]
pub struct LocateError {
    /// The settings file.
    pub file: String,
    /// What is wrong with it.
    pub message: String,
}

/// The settings file every part reads: the one `named` (`--settings` or
/// `GEMINI_SETTINGS`), else [`DEFAULT_SETTINGS`] when it exists.
pub fn settings_path(named: Option<&OsStr>) -> Option<PathBuf> {
    settings_path_in(named, Path::new(DEFAULT_SETTINGS))
}

fn settings_path_in(named: Option<&OsStr>, default: &Path) -> Option<PathBuf> {
    match named {
        Some(n) if !n.is_empty() => Some(PathBuf::from(n)),
        _ => default.exists().then(|| default.to_path_buf()),
    }
}

/// Only the key every part needs; the daemon checks the whole file.
#[derive(serde::Deserialize)]
struct IpcDirOnly {
    ipc_dir: Option<PathBuf>,
}

/// The IPC directory, found the same way by the daemon, the tools and
/// the hook, so that one setting moves all of them: `given` (`--ipc-dir`
/// or `GEMINI_IPC_DIR`) when set, else `ipc_dir` in the settings file,
/// else [`DEFAULT_IPC_DIR`].
pub fn locate_ipc_dir(
    given: Option<&OsStr>,
    settings: Option<&Path>,
) -> Result<PathBuf, LocateError> {
    if let Some(g) = given.filter(|g| !g.is_empty()) {
        return Ok(PathBuf::from(g));
    }
    let Some(file) = settings else {
        return Ok(PathBuf::from(DEFAULT_IPC_DIR));
    };
    let err = |message: String| LocateError {
        file: file.display().to_string(),
        message,
    };
    let text =
        std::fs::read_to_string(file).map_err(|e| err(format!("cannot read the file: {e}")))?;
    let text = text.strip_prefix('\u{feff}').unwrap_or(&text);
    let only: IpcDirOnly = toml::from_str(text).map_err(|e| err(e.to_string()))?;
    match only.ipc_dir {
        None => Ok(PathBuf::from(DEFAULT_IPC_DIR)),
        Some(d) if d.is_absolute() => Ok(d),
        Some(d) => Err(err(format!(
            "ipc_dir: expected an absolute path, got {:?}",
            d.display()
        ))),
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
///
/// Where the process's real and effective ids are the same, the kernel
/// is asked without a connection first (`faccessat`, the permission
/// check `connect` makes on the path): a connection the scheduler accepts
/// only to see it closed costs its I/O thread an accept and a dozen calls
/// for every program that starts. Only a refusal is confirmed by
/// connecting (a libc without the `faccessat2` system call may work the
/// answer out itself). A refusal that only `connect` makes (a security
/// module's rule on connecting) is not seen here: the hook finds it with
/// [`socket_refused`] when its hello goes unanswered for a second, and
/// the tools' [`socket_refused`] before they connect.
pub fn socket_denied(ipc_dir: &Path) -> Option<PathBuf> {
    let path = scheduler_socket_path(ipc_dir);
    if same_ids() && !write_refused(&path) {
        return None;
    }
    socket_refused(path)
}

/// The socket at `path`, where connecting to it is refused this process
/// (the connection, if made, is closed at once).
pub fn socket_refused(path: PathBuf) -> Option<PathBuf> {
    match std::os::unix::net::UnixStream::connect(&path) {
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => Some(path),
        _ => None,
    }
}

/// Whether the process's real and effective user and group ids are the
/// same: `faccessat` then answers for the ids `connect` checks, with or
/// without `faccessat2` (without it, glibc asks the kernel for the real
/// ids, or works out a setuid program's answer from the mode bits).
fn same_ids() -> bool {
    // SAFETY: these four calls take nothing and cannot fail.
    unsafe { libc::getuid() == libc::geteuid() && libc::getgid() == libc::getegid() }
}

/// Whether the kernel refuses this process write access to `path` (what
/// connecting to a socket needs): false where it grants it, and where
/// there is nothing to ask about (no such file).
fn write_refused(path: &Path) -> bool {
    use std::os::unix::ffi::OsStrExt;
    let Ok(c) = std::ffi::CString::new(path.as_os_str().as_bytes()) else {
        return false;
    };
    // SAFETY: faccessat reads the NUL-terminated path `c`, alive for the
    // call, relative to the current directory (AT_FDCWD), and writes
    // nothing but errno, read right after it.
    let r = unsafe { libc::faccessat(libc::AT_FDCWD, c.as_ptr(), libc::W_OK, libc::AT_EACCESS) };
    r != 0
        && matches!(
            std::io::Error::last_os_error().raw_os_error(),
            Some(libc::EACCES | libc::EPERM)
        )
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

    /// Asking whether the socket is refused makes no connection where the
    /// kernel grants it (every program's start asked it, and the scheduler
    /// accepted a connection each time only to see it closed); a
    /// connection confirms a refusal, and a missing socket is not refused.
    #[test]
    fn a_socket_granted_is_not_connected_to_to_ask() {
        use std::os::unix::fs::PermissionsExt as _;
        let dir = tempfile::tempdir().unwrap();
        assert_eq!(socket_denied(&dir.path().join("missing")), None);
        let path = scheduler_socket_path(dir.path());
        let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
        listener.set_nonblocking(true).unwrap();
        let queued = || match listener.accept() {
            Ok(_) => true,
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => false,
            Err(e) => panic!("{e}"),
        };
        // Open to its owner whatever the umask.
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
        assert_eq!(socket_denied(dir.path()), None);
        if same_ids() {
            assert!(!queued(), "a connection was made to ask");
        }
        // The connection that confirms a refusal is one, where granted.
        assert_eq!(socket_refused(path.clone()), None);
        assert!(queued(), "socket_refused connects");
        // SAFETY: geteuid takes nothing and cannot fail.
        if unsafe { libc::geteuid() } != 0 {
            // Refused: said so, confirmed by one connection attempt,
            // which the kernel refuses before the listener sees it.
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o000)).unwrap();
            assert_eq!(socket_denied(dir.path()), Some(path));
            assert!(!queued());
        }
    }

    fn file(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("gemini.toml");
        std::fs::write(&path, text).unwrap();
        (dir, path)
    }

    #[test]
    fn no_setting_anywhere_gives_the_default_dir() {
        assert_eq!(
            locate_ipc_dir(None, None),
            Ok(PathBuf::from(DEFAULT_IPC_DIR))
        );
        assert_eq!(
            locate_ipc_dir(Some("".as_ref()), None),
            Ok(PathBuf::from(DEFAULT_IPC_DIR))
        );
        let (_d, f) = file("window = \"10s\"\n");
        assert_eq!(
            locate_ipc_dir(None, Some(&f)),
            Ok(PathBuf::from(DEFAULT_IPC_DIR))
        );
    }

    #[test]
    fn the_settings_file_moves_the_dir_and_the_flag_or_env_wins() {
        let (_d, f) = file("\u{feff}ipc_dir = \"/run/gemini\"\nwindow = \"10s\"\n");
        assert_eq!(
            locate_ipc_dir(None, Some(&f)),
            Ok(PathBuf::from("/run/gemini"))
        );
        assert_eq!(
            locate_ipc_dir(Some("/x".as_ref()), Some(&f)),
            Ok(PathBuf::from("/x"))
        );
    }

    #[test]
    fn a_bad_settings_file_is_named_with_what_is_wrong() {
        let (d, f) = file("ipc_dir = \"run/gemini\"\n");
        let e = locate_ipc_dir(None, Some(&f)).unwrap_err();
        assert_eq!(e.file, f.display().to_string());
        assert!(e.message.contains("absolute path"), "{e}");
        std::fs::write(&f, "ipc_dir = /run\n").unwrap();
        let e = locate_ipc_dir(None, Some(&f)).unwrap_err();
        assert!(e.to_string().contains("line 1"), "{e}");
        let missing = d.path().join("missing.toml");
        let e = locate_ipc_dir(None, Some(&missing)).unwrap_err();
        assert!(e.message.contains("cannot read the file"), "{e}");
    }

    #[test]
    fn the_default_settings_file_is_read_only_when_it_exists() {
        let (d, f) = file("");
        assert_eq!(settings_path_in(None, &f), Some(f.clone()));
        assert_eq!(settings_path_in(None, &d.path().join("absent.toml")), None);
        assert_eq!(
            settings_path_in(Some("/named.toml".as_ref()), &f),
            Some(PathBuf::from("/named.toml"))
        );
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
