//! The device memory each group's processes hold, as the simulated
//! driver sees it: `groups` in `FAKECUDA_DIR`, one entry per tag
//! (`FAKECUDA_TAG`, which the test harness sets to the process's group),
//! with, per device, what the tag's living processes hold now and the most
//! they ever held at once. The simulator updates it under its state lock
//! at every change of a process's device memory; the tests read it as the
//! ground truth of a group's memory, independent of the hook's and the
//! scheduler's accounting.
//!
//! Layout: [`ENTRIES`] entries of `1 + 2 × DEVICES` little-endian u64:
//! the tag's hash (0: free entry), then `now` per device, then `peak` per
//! device.

use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// Devices per entry (the simulator's `MAX_DEVICES`).
pub const DEVICES: usize = 16;
/// Tags the file holds.
pub const ENTRIES: usize = 64;
const WORDS: usize = 1 + 2 * DEVICES;
/// Size of the file in bytes.
pub const SIZE: usize = ENTRIES * WORDS * 8;

/// The hash a tag is stored under (FNV-1a, never 0).
pub fn tag_hash(tag: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in tag.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h.max(1)
}

/// Path of the file in `dir`.
pub fn path(dir: &Path) -> PathBuf {
    dir.join("groups")
}

/// The file, mapped by the simulator.
pub struct Groups {
    words: &'static [AtomicU64],
}

impl std::fmt::Debug for Groups {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Groups").finish_non_exhaustive()
    }
}

impl Groups {
    /// Maps the file in `dir`, creating it. The mapping lives as long as
    /// the process.
    pub fn open(dir: &Path) -> std::io::Result<Groups> {
        use std::os::fd::AsRawFd;
        let f = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(false)
            .open(path(dir))?;
        if f.metadata()?.len() < SIZE as u64 {
            f.set_len(SIZE as u64)?;
        }
        // SAFETY: a shared, writable mapping of SIZE bytes of a file at
        // least that long; never unmapped, so the 'static slice stays valid.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                SIZE,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: page-aligned, SIZE bytes, and any bytes are a valid u64.
        let words = unsafe { std::slice::from_raw_parts(p as *const AtomicU64, SIZE / 8) };
        Ok(Groups { words })
    }

    /// Sets what the processes of `tag` hold on `device` now, raising its
    /// peak. The caller serialises updates (the simulator's state lock).
    pub fn set(&self, tag: u64, device: usize, now: u64) {
        if device >= DEVICES || tag == 0 {
            return;
        }
        let entries = self.words.chunks(WORDS);
        let mut free = None;
        for e in entries {
            let t = e[0].load(Ordering::Relaxed);
            if t == tag {
                e[1 + device].store(now, Ordering::Relaxed);
                e[1 + DEVICES + device].fetch_max(now, Ordering::Relaxed);
                return;
            }
            if t == 0 && free.is_none() {
                free = Some(e);
            }
        }
        if let Some(e) = free {
            e[0].store(tag, Ordering::Relaxed);
            e[1 + device].store(now, Ordering::Relaxed);
            e[1 + DEVICES + device].fetch_max(now, Ordering::Relaxed);
        }
    }
}

/// What the processes of `tag` hold (`now`) and held at most (`peak`),
/// per device, as the simulator last wrote it; zeros for a tag it never
/// saw.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct GroupMemory {
    /// Bytes held now, per device.
    pub now: [u64; DEVICES],
    /// The most ever held at once, per device.
    pub peak: [u64; DEVICES],
}

/// Reads the entry of `tag` in `dir`.
pub fn read(dir: &Path, tag: &str) -> std::io::Result<GroupMemory> {
    let bytes = match std::fs::read(path(dir)) {
        Ok(b) => b,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(GroupMemory::default()),
        Err(e) => return Err(e),
    };
    let want = tag_hash(tag);
    let word = |i: usize| {
        let mut a = [0u8; 8];
        if let Some(b) = bytes.get(i * 8..i * 8 + 8) {
            a.copy_from_slice(b);
        }
        u64::from_le_bytes(a)
    };
    let mut m = GroupMemory::default();
    for e in 0..ENTRIES {
        let base = e * WORDS;
        if word(base) == want {
            for d in 0..DEVICES {
                m.now[d] = word(base + 1 + d);
                m.peak[d] = word(base + 1 + DEVICES + d);
            }
        }
    }
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peaks_rise_and_stay_per_tag_and_device() {
        let dir = tempfile_dir();
        let g = Groups::open(&dir).unwrap();
        let (a, b) = (tag_hash("a"), tag_hash("b"));
        g.set(a, 0, 100);
        g.set(a, 0, 40);
        g.set(b, 1, 7);
        let ra = read(&dir, "a").unwrap();
        assert_eq!((ra.now[0], ra.peak[0]), (40, 100));
        let rb = read(&dir, "b").unwrap();
        assert_eq!((rb.now[1], rb.peak[1], rb.peak[0]), (7, 7, 0));
        assert_eq!(read(&dir, "c").unwrap(), GroupMemory::default());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!("fakecuda-groups-{}", std::process::id()));
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
