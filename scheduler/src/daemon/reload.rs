//! `resource.conf` watched and reloaded live: the file, its drop-in
//! directory and a symlinked ConfigMap, SIGHUP and `gem-schd reload`.

use super::*;

/// Quiet time after a change of `resource.conf` before it is read: an
/// editor's save is several events.
pub(super) const RELOAD_DEBOUNCE: Duration = Duration::from_millis(100);

/// A live watch of resource.conf: the watcher, its events, and the
/// directories it watches with their identity when armed (a directory
/// removed and made again, or renamed away, is a new inode the watch does
/// not follow: it is armed again).
pub(super) struct ConfigWatch {
    pub(super) _watcher: Option<notify::RecommendedWatcher>,
    pub(super) rx: mpsc::Receiver<()>,
    pub(super) dirs: Vec<(PathBuf, Option<(u64, u64)>)>,
    /// A watched directory itself was removed or renamed (the inode check
    /// alone misses a directory made again with its inode number reused).
    pub(super) lost: Arc<AtomicBool>,
    /// The file watched and what it was when the watch was made: the
    /// directory of its target if it was a symbolic link.
    pub(super) path: PathBuf,
    pub(super) target: Option<PathBuf>,
    /// Whether the drop-in directory existed, and is watched.
    pub(super) drop_ins: bool,
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
    /// Watches `path`'s directory for changes to it; if `path` is a
    /// symbolic link (a Kubernetes ConfigMap's `..data` swap, a link into
    /// a configuration repository), also its target's directory, and any
    /// change in either counts.
    pub(super) fn new(path: &Path) -> anyhow::Result<ConfigWatch> {
        use notify::{EventKind, RecursiveMode, Watcher};
        let parent = |p: &Path| match p.parent() {
            Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
            _ => PathBuf::from("."),
        };
        let linked = std::fs::symlink_metadata(path).is_ok_and(|m| m.file_type().is_symlink());
        let target = link_target_dir(path);
        let mut dirs = vec![parent(path)];
        if let Some(d) = &target
            && !dirs.contains(d)
        {
            dirs.push(d.clone());
        }
        // Drop-in groups: the directory is watched while it exists; its
        // coming or going is seen in the parent's watch.
        let drop_in = gemini_config::drop_in_dir(path);
        let drop_ins = drop_in.is_dir();
        if drop_ins {
            dirs.push(drop_in.clone());
        }
        let name = path.file_name().map(|n| n.to_os_string());
        let (tx, rx) = mpsc::channel();
        let lost = Arc::new(AtomicBool::new(false));
        let (lost_cb, dirs_cb) = (Arc::clone(&lost), dirs.clone());
        let mut watcher = notify::recommended_watcher(move |res: notify::Result<notify::Event>| {
            let Ok(ev) = res else { return };
            if matches!(ev.kind, EventKind::Access(_)) {
                return;
            }
            if matches!(
                ev.kind,
                EventKind::Remove(_) | EventKind::Modify(notify::event::ModifyKind::Name(_))
            ) && ev.paths.iter().any(|p| dirs_cb.contains(p))
            {
                lost_cb.store(true, Ordering::Release);
                let _ = tx.send(());
                return;
            }
            if linked
                || ev.paths.iter().any(|p| {
                    p.file_name().map(|n| n.to_os_string()) == name
                        || p == &drop_in
                        || p.parent() == Some(drop_in.as_path())
                })
            {
                let _ = tx.send(());
            }
        })
        .context("cannot start the file watcher")?;
        // Watch the directory, not the file: an editor's save replaces the
        // file (write to a temporary, rename), which a file watch loses.
        let mut watched = Vec::new();
        for d in dirs {
            watcher
                .watch(&d, RecursiveMode::NonRecursive)
                .with_context(|| format!("cannot watch {}", d.display()))?;
            let id = dir_id(&d);
            watched.push((d, id));
        }
        Ok(ConfigWatch {
            _watcher: Some(watcher),
            rx,
            dirs: watched,
            lost,
            path: path.to_path_buf(),
            target,
            drop_ins,
        })
    }

    /// A watch that sees nothing (none could be made).
    pub(super) fn none() -> ConfigWatch {
        ConfigWatch {
            _watcher: None,
            rx: mpsc::channel().1,
            dirs: Vec::new(),
            lost: Arc::new(AtomicBool::new(true)),
            path: PathBuf::new(),
            target: None,
            drop_ins: false,
        }
    }

    /// Whether a watched directory is gone or is not the one watched, or
    /// the file became (or stopped being, or moved) a symbolic link.
    pub(super) fn stale(&self) -> bool {
        self.lost.load(Ordering::Acquire)
            || self.dirs.is_empty()
            || self.dirs.iter().any(|(d, id)| dir_id(d) != *id)
            || link_target_dir(&self.path) != self.target
            || gemini_config::drop_in_dir(&self.path).is_dir() != self.drop_ins
    }
}

impl Daemon {
    pub(super) fn check_reload(&mut self) {
        if self.hup.swap(false, Ordering::AcqRel) {
            info!("SIGHUP: reloading {}", self.config_path.display());
            self.reload_due = None;
            let _ = self.reload();
            return;
        }
        let mut changed = false;
        while self.watch.rx.try_recv().is_ok() {
            changed = true;
        }
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
