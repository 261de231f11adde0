//! `resource.conf` watched and reloaded live: the file, its drop-in
//! directory and a symlinked ConfigMap, SIGHUP and `gem-schd reload`.

use super::*;

/// Quiet time after a change of `resource.conf` before it is read: an
/// editor's save is several events.
pub(super) const RELOAD_DEBOUNCE: Duration = Duration::from_millis(100);

/// A live watch of resource.conf, read from the daemon's own loop (its
/// inotify descriptor is among those the loop polls): the file's
/// directory for its entries coming and going only, the file itself for
/// its content, and the drop-in directory and a symbolic link's target
/// directory for anything. A directory shared with busy files (a log
/// written per kernel) wakes nobody: its files' writes are not asked for.
/// The directories are kept with their identity when armed (a directory
/// removed and made again, or renamed away, is a new inode the watch does
/// not follow: it is armed again).
pub(super) struct ConfigWatch {
    inotify: Option<inotify::Inotify>,
    /// The file's directory, the file, and the others (drop-ins, a link's
    /// target directory).
    parent: Option<inotify::WatchDescriptor>,
    file: Option<inotify::WatchDescriptor>,
    others: Vec<inotify::WatchDescriptor>,
    pub(super) dirs: Vec<(PathBuf, Option<(u64, u64)>)>,
    /// The file as watched, `(device, inode)` (its target's, for a link):
    /// another one there is watched anew.
    file_id: Option<(u64, u64)>,
    /// A watched directory itself was removed or renamed (the inode check
    /// alone misses a directory made again with its inode number reused),
    /// or events were lost (the kernel's queue overflowed).
    lost: bool,
    /// The file watched and what it was when the watch was made: the
    /// directory of its target if it was a symbolic link.
    pub(super) path: PathBuf,
    pub(super) target: Option<PathBuf>,
    /// Whether the drop-in directory existed, and is watched.
    pub(super) drop_ins: bool,
}

/// What is asked of the file's directory: its entries coming and going
/// (the file saved by rename, made, removed; the drop-in directory made),
/// and the directory itself going; not its files' writes.
fn parent_mask() -> inotify::WatchMask {
    use inotify::WatchMask as M;
    M::CREATE | M::DELETE | M::MOVED_FROM | M::MOVED_TO | M::DELETE_SELF | M::MOVE_SELF | M::ONLYDIR
}

/// What is asked of the file: its content and its going.
fn file_mask() -> inotify::WatchMask {
    use inotify::WatchMask as M;
    M::MODIFY | M::CLOSE_WRITE | M::ATTRIB | M::DELETE_SELF | M::MOVE_SELF
}

/// What is asked of a directory that is all configuration (drop-ins, a
/// ConfigMap's target): anything.
fn dir_mask() -> inotify::WatchMask {
    parent_mask() | file_mask()
}

/// The directory a symbolic link at `path` leads into (`None`: not a link).
pub(super) fn link_target_dir(path: &Path) -> Option<PathBuf> {
    let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
    if !linked {
        return None;
    }
    let target = std::fs::canonicalize(path).ok()?;
    Some(match target.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    })
}

/// Whether resource.conf is empty (a UTF-8 mark and blanks at most).
pub(super) fn main_is_empty(path: &Path) -> bool {
    std::fs::read_to_string(path).is_ok_and(|t| t.trim_start_matches('\u{feff}').trim().is_empty())
}

/// `(device, inode)` of `dir`, if it exists.
pub(super) fn dir_id(dir: &Path) -> Option<(u64, u64)> {
    use std::os::unix::fs::MetadataExt;
    std::fs::metadata(dir).ok().map(|m| (m.dev(), m.ino()))
}

impl ConfigWatch {
    /// Watches `path` (see [`ConfigWatch`]); if `path` is a symbolic link
    /// (a Kubernetes ConfigMap's `..data` swap, a link into a
    /// configuration repository), also its target's directory, and any
    /// change of the file's directory's entries counts.
    pub(super) fn new(path: &Path) -> anyhow::Result<ConfigWatch> {
        let parent = |p: &Path| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let target = link_target_dir(path);
        let inotify = inotify::Inotify::init().context("cannot start the file watcher")?;
        let mut watches = inotify.watches();
        let dir = parent(path);
        // Watch the directory, not only the file: an editor's save
        // replaces the file (write to a temporary, rename), which a file
        // watch alone loses.
        let parent_wd = watches
            .add(&dir, parent_mask())
            .with_context(|| format!("cannot watch {}", dir.display()))?;
        let mut dirs = vec![(dir_id(&dir), dir)];
        let mut others = Vec::new();
        let mut also = Vec::new();
        // A link's target directory, unless it is the parent itself (by
        // inode: a relative path or a linked /etc/gemini names it
        // otherwise, and a second watch of one inode would replace the
        // parent's mask with one that wakes for every write there).
        if let Some(d) = &target
            && !dirs
                .iter()
                .any(|(id, x)| x == d || (id.is_some() && *id == dir_id(d)))
        {
            also.push(d.clone());
        }
        // Drop-in groups: the directory is watched while it exists; its
        // coming or going is seen in the parent's watch.
        let drop_in = gemini_config::drop_in_dir(path);
        let drop_ins = drop_in.is_dir();
        if drop_ins {
            also.push(drop_in);
        }
        for d in also {
            others.push(
                watches
                    .add(&d, dir_mask())
                    .with_context(|| format!("cannot watch {}", d.display()))?,
            );
            dirs.push((dir_id(&d), d));
        }
        // The file itself, where it exists (made later: seen in the
        // parent's watch, and watched then).
        let file = watches.add(path, file_mask()).ok();
        Ok(ConfigWatch {
            inotify: Some(inotify),
            parent: Some(parent_wd),
            file,
            file_id: dir_id(path),
            others,
            dirs: dirs.into_iter().map(|(id, d)| (d, id)).collect(),
            lost: false,
            path: path.to_path_buf(),
            target,
            drop_ins,
        })
    }

    /// A watch that sees nothing (none could be made).
    pub(super) fn none() -> ConfigWatch {
        ConfigWatch {
            inotify: None,
            parent: None,
            file: None,
            others: Vec::new(),
            dirs: Vec::new(),
            file_id: None,
            lost: true,
            path: PathBuf::new(),
            target: None,
            drop_ins: false,
        }
    }

    /// The descriptor the daemon's loop polls (`None`: no watch).
    pub(super) fn fd(&self) -> Option<i32> {
        self.inotify.as_ref().map(AsRawFd::as_raw_fd)
    }

    /// Reads what the watch saw since the last call, without waiting:
    /// whether the configuration may have changed.
    pub(super) fn changed(&mut self) -> bool {
        let Some(inotify) = self.inotify.as_mut() else {
            return false;
        };
        let name = self.path.file_name().map(std::ffi::OsStr::to_os_string);
        let drop_in = gemini_config::drop_in_dir(&self.path);
        let drop_in_name = drop_in.file_name().map(std::ffi::OsStr::to_os_string);
        let linked = self.target.is_some();
        let mut buf = [0u8; 4096];
        let (mut changed, mut rewatch) = (false, false);
        // Bounded: the queue holds what came since the last call (the
        // kernel's queue is bounded too, and says when it overflowed).
        while let Ok(events) = inotify.read_events(&mut buf) {
            let mut any = false;
            for e in events {
                any = true;
                use inotify::EventMask as E;
                let gone = e
                    .mask
                    .intersects(E::DELETE_SELF | E::MOVE_SELF | E::IGNORED | E::UNMOUNT);
                if e.mask.contains(E::Q_OVERFLOW) {
                    // Events were lost: watched anew from scratch.
                    self.lost = true;
                    changed = true;
                } else if Some(&e.wd) == self.parent.as_ref() {
                    if gone {
                        self.lost = true;
                        changed = true;
                    } else if e.name.map(std::ffi::OsStr::to_os_string) == name {
                        // The file was made, replaced or removed: a new
                        // file is watched anew.
                        changed = true;
                        rewatch = true;
                    } else if linked || e.name.map(std::ffi::OsStr::to_os_string) == drop_in_name {
                        changed = true;
                    }
                } else if Some(&e.wd) == self.file.as_ref() {
                    changed = true;
                } else if self.others.contains(&e.wd) {
                    if gone {
                        self.lost = true;
                    }
                    changed = true;
                }
            }
            if !any {
                break;
            }
        }
        // The file may be another one now (made, replaced, or a link's
        // target saved by rename): watched anew, the old watch dropped (a
        // backup kept under another name would wake us for ever).
        if (rewatch || changed) && dir_id(&self.path) != self.file_id {
            let mut watches = inotify.watches();
            let new = watches.add(&self.path, file_mask()).ok();
            if let Some(old) = self.file.take()
                && Some(&old) != new.as_ref()
            {
                let _ = watches.remove(old);
            }
            self.file = new;
            self.file_id = dir_id(&self.path);
        }
        changed
    }

    /// Whether a watched directory is gone or is not the one watched, or
    /// the file became (or stopped being, or moved) a symbolic link.
    pub(super) fn stale(&self) -> bool {
        self.lost
            || self.dirs.is_empty()
            || dir_id(&self.path) != self.file_id
            || self.dirs.iter().any(|(d, id)| dir_id(d) != *id)
            || link_target_dir(&self.path) != self.target
            || gemini_config::drop_in_dir(&self.path).is_dir() != self.drop_ins
    }
}

impl Daemon {
    /// `watch_ready`: the watch's descriptor has something to read.
    pub(super) fn check_reload(&mut self, watch_ready: bool) {
        if self.hup.swap(false, Ordering::AcqRel) {
            info!("SIGHUP: reloading {}", self.config_path.display());
            self.reload_due = None;
            let _ = self.reload();
            return;
        }
        let mut changed = watch_ready && self.watch.changed();
        if self.last_watch_check.elapsed() >= Duration::from_secs(1) {
            self.last_watch_check = Instant::now();
            if self.watch.stale() {
                // The directory was removed, renamed or made again: the
                // old watch sees nothing any more. Watch anew and re-read.
                match ConfigWatch::new(&self.config_path) {
                    Ok(w) => {
                        info!(
                            "watching {} again (its directory or its drop-in directory came or went)",
                            self.config_path.display()
                        );
                        self.watch = w;
                        changed = true;
                    }
                    Err(e) => debug!("cannot watch {} yet: {e:#}", self.config_path.display()),
                }
            }
        }
        if changed {
            self.reload_due = Some(Instant::now() + RELOAD_DEBOUNCE);
            return;
        }
        match self.reload_due {
            Some(due) if Instant::now() >= due => self.reload_due = None,
            _ => return,
        }
        let _ = self.reload();
    }

    /// Re-reads resource.conf and puts it in force; on errors keeps the
    /// previous configuration and returns them.
    pub(super) fn reload(&mut self) -> Result<(), String> {
        // A file being rewritten (truncated, then written) is empty for a
        // moment: that is not "no groups". An empty file after a non-empty
        // one keeps the configuration; a file with only a comment applies.
        let emptied = main_is_empty(&self.config_path);
        if emptied && self.main_had_text {
            warn!(
                "{} is empty; keeping the previous configuration until it has content \
                 (to remove every group, leave a comment in it)",
                self.config_path.display()
            );
            return Ok(());
        }
        match load_resource(&self.config_path) {
            Ok((cfg, warnings)) => {
                for w in &warnings {
                    warn!("{w}");
                }
                let changes = diff(self.policy.config(), &cfg);
                if changes.is_empty() {
                    info!("{} reloaded: no change", self.config_path.display());
                }
                for c in &changes {
                    info!("{} reloaded: {c}", self.config_path.display());
                }
                self.overcommit = warn_overcommit(&cfg, &self.gpu_memory, &self.overcommit);
                self.config_error = None;
                self.main_had_text = !emptied;
                if let Some(m) = &self.metrics {
                    m.reloaded(0);
                }
                let actions = self.policy.handle(Event::Reconfigure(cfg), self.now());
                self.send_actions(actions);
                self.driver_limits.apply(self.policy.config());
                Ok(())
            }
            Err(e) => {
                for err in &e.0 {
                    error!("{err}");
                }
                error!(
                    "{} is invalid; keeping the previous configuration",
                    self.config_path.display()
                );
                self.config_error = Some(e.to_string());
                if let Some(m) = &self.metrics {
                    m.reloaded(e.0.len().max(1));
                }
                Err(e.to_string())
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether the watch has anything to read: events it was not asked
    /// for never reach it.
    fn pending(w: &ConfigWatch) -> bool {
        let mut fds = [libc::pollfd {
            fd: w.fd().unwrap(),
            events: libc::POLLIN,
            revents: 0,
        }];
        // SAFETY: one valid pollfd, a zero timeout.
        unsafe { libc::poll(fds.as_mut_ptr(), 1, 0) == 1 }
    }

    /// A directory shared with a busy file (a log written per kernel)
    /// wakes nobody; resource.conf's writes, its save by rename and a
    /// write after that, its drop-in directory made, all count.
    #[test]
    fn only_the_configurations_own_files_wake_the_watch() {
        let dir = tempfile::tempdir().unwrap();
        let conf = dir.path().join("resource.conf");
        std::fs::write(&conf, "[a]\n").unwrap();
        let mut w = ConfigWatch::new(&conf).unwrap();
        // Another file made is an entry of the directory, read and let
        // be; its writes are not even read.
        let mut log = std::fs::File::create(dir.path().join("train.log")).unwrap();
        assert!(!w.changed());
        for i in 0..10_000 {
            std::io::Write::write_all(&mut log, format!("kernel {i}\n").as_bytes()).unwrap();
        }
        drop(log);
        assert!(!pending(&w), "a log's writes woke the watch");
        // Written in place.
        std::fs::write(&conf, "[a]\nMinUtil=0.5\n").unwrap();
        assert!(pending(&w) && w.changed());
        // Saved as an editor does, then written in place again: the new
        // file is watched.
        let tmp = dir.path().join("resource.conf.swp");
        std::fs::write(&tmp, "[a]\n").unwrap();
        std::fs::rename(&tmp, &conf).unwrap();
        assert!(w.changed());
        std::fs::write(&conf, "[b]\n").unwrap();
        assert!(w.changed(), "a write after a save by rename was missed");
        // Removed, then made again.
        std::fs::remove_file(&conf).unwrap();
        assert!(w.changed());
        std::fs::write(&conf, "[c]\n").unwrap();
        assert!(w.changed());
        // The drop-in directory made (the daemon then watches anew).
        std::fs::create_dir(gemini_config::drop_in_dir(&conf)).unwrap();
        assert!(w.changed());
        assert!(w.stale());
        assert!(!w.changed(), "nothing more came");
    }

    /// resource.conf a link to a file beside it: the target saved by
    /// rename (sed -i, most editors), then written in place, is seen; the
    /// file watched before is not watched any more.
    #[test]
    fn a_link_to_a_file_beside_it_is_followed_across_saves() {
        let dir = tempfile::tempdir().unwrap();
        let prod = dir.path().join("resource.conf.prod");
        let conf = dir.path().join("resource.conf");
        std::fs::write(&prod, "[a]\n").unwrap();
        std::os::unix::fs::symlink("resource.conf.prod", &conf).unwrap();
        let mut w = ConfigWatch::new(&conf).unwrap();
        let tmp = dir.path().join("sedXYZ");
        std::fs::write(&tmp, "[b]\n").unwrap();
        std::fs::rename(&tmp, &prod).unwrap();
        assert!(w.changed());
        std::fs::write(&prod, "[c]\n").unwrap();
        assert!(w.changed(), "a write after the target's save was missed");
        assert!(!w.stale());
        assert!(!w.changed());
    }
}
