//! Time-slicing, as a real GPU shares itself between contexts
//! (`FAKECUDA_TIMESLICE_US`, e.g. `2000`; unset or `0`: the simple model,
//! where the device runs every process's work in launch order).
//!
//! A real device does not run the work of different contexts in launch
//! order. When several contexts have work, each runs for up to a time
//! slice, a kernel still running at the slice's end is preempted and
//! resumed at the context's next slice, and within one context work stays
//! in order. A context with no work left gives the device up at once. On
//! an H200 (no hook), a 10 µs kernel launched beside another process's
//! 50 ms kernels waited at most 2.35 ms for the device: slices of about
//! 2 ms. NCCL's collective kernels spin on the device until their peer
//! ranks have started theirs, and they take their slices like any other
//! kernel while they spin.
//!
//! Here each process has, per device, a queue of work items in a shared
//! file (`slices` in `FAKECUDA_DIR`): kernels and graphs (a duration),
//! markers (an event record, a wait for another device's work: no
//! duration) and collectives (spin until every rank has been scheduled,
//! then their duration). Nothing runs in the background: whichever
//! process next touches the simulator replays the device from where it
//! was left up to now, slice by slice, under a file lock, writes what ran
//! to the busy log (one record per uninterrupted piece of a kernel), and
//! stores the state back. A process that waits for its work computes,
//! from a copy of the state, when the work will end if nothing else is
//! launched, sleeps until then, and looks again.
//!
//! The end of queued work is not known when it is launched (later work of
//! other processes delays it), so a stream's tail, an event or a
//! context's end is a *pending* value: the process's queue on a device
//! and the item's sequence number, with the top bit set, so that it
//! compares above every time. [`super::Sim::wait`], [`super::Sim::is_done`]
//! and [`super::Sim::time_of`] resolve both kinds of value.

use super::{FileLock, MAX_DEVICES, map_shared, pid_alive, sleep_until};
use fakecuda_log::{Kind, Record, append_many, now_ns};
use std::collections::VecDeque;
use std::path::{Path, PathBuf};
use std::sync::Mutex;

/// The top bit: a pending value, not a time.
pub const PENDING: u64 = 1 << 63;
const SEQ_BITS: u32 = 48;
const SEQ_MASK: u64 = (1 << SEQ_BITS) - 1;

/// The pending value of item `seq` of this process's queue on `dev`.
pub fn pending(dev: usize, seq: u64) -> u64 {
    PENDING | ((dev as u64) << SEQ_BITS) | (seq & SEQ_MASK)
}

/// The device and sequence number of a pending value; `None` for a time.
pub fn decode(when: u64) -> Option<(usize, u64)> {
    (when & PENDING != 0).then_some((((when & !PENDING) >> SEQ_BITS) as usize, when & SEQ_MASK))
}

/// Items a queue holds (pending and recently done).
const RING: usize = 1024;
/// Done times of recent markers, kept longer than the ring keeps items
/// (an event is looked up long after a thousand kernels ran).
const MARKS: usize = 64;
const MAX_QUEUES: usize = 128;
const MAX_COLLS: usize = 256;
const MAGIC: u64 = 0x534c_4943_4553_0003; // "SLICES" v3
/// `Item::kind` of an item the busy log does not record (a marker).
const NO_RECORD: u32 = u32::MAX;
/// How often a waiting or launching process looks whether the owners of
/// other queues still live.
const CHECK_NS: u64 = 5_000_000;
/// How far ahead a wait computes its work's end; past it, it looks again.
const HORIZON_NS: u64 = 100_000_000;
/// How often a wait looks again for work that waits on what is not
/// launched yet.
const POLL_NS: u64 = 200_000;
/// A collective whose ranks have not all finished by then is forgotten
/// (a rank died).
const COLL_LIFE_NS: u64 = 60_000_000_000;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Item {
    seq: u64,
    /// Device time still to run (ns).
    left: u64,
    /// 0, a time before which it cannot start, or a pending value of the
    /// same process's queue on another device that must be done first.
    gate: u64,
    /// When it ended (once done).
    done_at: u64,
    /// Index + 1 of its collective in `Shared::colls`; 0: none.
    coll: u32,
    rank: u32,
    /// `Kind` of its busy-log records, or `NO_RECORD`.
    kind: u32,
    _pad: u32,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Mark {
    seq: u64,
    done_at: u64,
}

#[repr(C)]
struct Queue {
    pid: u32,
    dev: u32,
    /// Sequence number of the last item queued (the first is 1).
    enq: u64,
    /// Sequence number of the last item done.
    done: u64,
    /// When another process last looked whether `pid` lives.
    checked: u64,
    marks_next: u64,
    marks: [Mark; MARKS],
    items: [Item; RING],
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Coll {
    comm: u64,
    seq: u64,
    ranks: u32,
    used: u32,
    /// Ranks whose kernel has been scheduled (started spinning).
    arrived: u64,
    /// Ranks whose kernel is done.
    finished: u64,
    born: u64,
}

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
struct Dev {
    /// Index + 1 of the queue running; 0: none.
    running: u32,
    _pad: u32,
    /// When the running queue's slice ends.
    slice_end: u64,
    /// Start of the running item's current uninterrupted piece.
    piece_start: u64,
}

#[repr(C)]
struct Shared {
    magic: u64,
    /// The time up to which the devices have been played.
    clock: u64,
    devs: [Dev; MAX_DEVICES],
    colls: [Coll; MAX_COLLS],
    queues: [Queue; MAX_QUEUES],
}

/// A queue's pending work, copied out of the shared state.
#[derive(Clone, Debug)]
struct Q {
    idx: usize,
    pid: u32,
    dev: usize,
    done: u64,
    items: VecDeque<Item>,
}

/// The devices' state while they are played: what [`Slicer::advance`]
/// stores back, or what a wait plays ahead on a copy.
#[derive(Clone, Debug)]
struct World {
    clock: u64,
    slice: u64,
    ndev: usize,
    devs: [Dev; MAX_DEVICES],
    colls: Vec<Coll>,
    qs: Vec<Q>,
    /// Items done while playing, by queue index, for storing back.
    finished: Vec<(usize, Item)>,
    records: Vec<(usize, Record)>,
}

impl World {
    fn q_of(&self, pid: u32, dev: usize) -> Option<&Q> {
        self.qs.iter().find(|q| q.pid == pid && q.dev == dev)
    }

    fn pos_of_idx(&self, idx: usize) -> Option<usize> {
        self.qs.iter().position(|q| q.idx == idx)
    }

    /// Where in `qs` the queue `dev` runs is (none: idle, or its queue has
    /// nothing pending).
    fn running_pos(&self, dev: usize) -> Option<usize> {
        (self.devs[dev].running as usize)
            .checked_sub(1)
            .and_then(|i| self.pos_of_idx(i))
    }

    fn spinning(&self, it: &Item) -> bool {
        it.coll != 0 && {
            let c = &self.colls[it.coll as usize - 1];
            c.arrived.count_ones() < c.ranks
        }
    }

    fn gate_open(&self, pid: u32, it: &Item) -> bool {
        match decode(it.gate) {
            None => it.gate <= self.clock,
            // A queue with nothing pending has done everything.
            Some((dev, seq)) => self.q_of(pid, dev).is_none_or(|q| q.done >= seq),
        }
    }

    /// Whether queue `pos` has work the device can run now.
    fn runnable(&self, pos: usize) -> bool {
        let q = &self.qs[pos];
        q.items.front().is_some_and(|h| self.gate_open(q.pid, h))
    }

    fn record(&mut self, dev: usize, pid: u32, kind: u32, from: u64) {
        if kind != NO_RECORD && self.clock > from {
            self.records.push((
                dev,
                Record {
                    start: from,
                    end: self.clock,
                    pid,
                    kind,
                },
            ));
        }
    }

    /// Ends every head that is done at the clock: markers whose gate is
    /// open, kernels with no time left, collectives whose ranks have all
    /// arrived and that ran their time. Returns whether any ended.
    fn settle(&mut self) -> bool {
        let mut any = false;
        for pos in 0..self.qs.len() {
            while let Some(&h) = self.qs[pos].items.front() {
                let (pid, dev) = (self.qs[pos].pid, self.qs[pos].dev);
                let done = h.left == 0
                    && !self.spinning(&h)
                    && self.gate_open(pid, &h)
                    && (h.coll == 0 || self.arrived(&h));
                if !done {
                    break;
                }
                let running = self.devs[dev].running as usize == self.qs[pos].idx + 1;
                if running {
                    let from = self.devs[dev].piece_start;
                    self.record(dev, pid, h.kind, from);
                    self.devs[dev].piece_start = self.clock;
                }
                let mut h = h;
                h.done_at = self.clock;
                let q = &mut self.qs[pos];
                q.items.pop_front();
                q.done = h.seq;
                let idx = q.idx;
                self.finished.push((idx, h));
                if h.coll != 0 {
                    let c = &mut self.colls[h.coll as usize - 1];
                    c.finished |= 1 << h.rank;
                    if c.finished.count_ones() >= c.ranks {
                        *c = Coll::default();
                    }
                }
                any = true;
            }
        }
        any
    }

    fn arrived(&self, it: &Item) -> bool {
        self.colls[it.coll as usize - 1].arrived & (1 << it.rank) != 0
    }

    /// The length of a slice that starts at `t`: the nominal one, give or
    /// take a quarter, so that a program that wakes periodically does not
    /// lock onto the slices' phase (a real GPU's slices are not a clock
    /// either).
    fn slice_len(&self, t: u64) -> u64 {
        let mut z = t.wrapping_add(0x9e37_79b9_7f4a_7c15);
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^= z >> 31;
        let quarter = self.slice / 4;
        self.slice - quarter + z % (2 * quarter + 1)
    }

    /// The first slice end after the clock, slices going on from `end`.
    fn next_slice_end(&self, mut end: u64) -> u64 {
        if self.clock > end + 64 * self.slice {
            return self.clock + self.slice_len(self.clock);
        }
        while end <= self.clock {
            end += self.slice_len(end);
        }
        end
    }

    /// Picks what each device runs from the clock on: the running queue
    /// until its slice ends (or on, where nothing else waits), else the
    /// next queue with work in turn. A collective arrives when its kernel
    /// first runs. Returns whether one arrived.
    fn schedule(&mut self) -> bool {
        let mut arrived = false;
        for dev in 0..self.ndev {
            let d = self.devs[dev];
            let mut cands: Vec<usize> = (0..self.qs.len())
                .filter(|&p| self.qs[p].dev == dev && self.runnable(p))
                .collect();
            cands.sort_by_key(|&p| self.qs[p].idx);
            let cur = self.running_pos(dev);
            let cur_runs = cur.is_some_and(|p| cands.contains(&p));
            let others = cands.iter().any(|&p| Some(p) != cur);
            let slice_over = self.clock >= d.slice_end;
            if cur_runs && (!slice_over || !others) {
                // Alone, it goes on in slices on the same grid: another
                // context that comes waits for the current one's end.
                if slice_over {
                    self.devs[dev].slice_end = self.next_slice_end(d.slice_end);
                }
            } else {
                // Preempted mid-kernel: the piece so far is recorded.
                if let Some(p) = cur
                    && let Some(&h) = self.qs[p].items.front()
                {
                    let pid = self.qs[p].pid;
                    self.record(dev, pid, h.kind, d.piece_start);
                }
                let cur_idx = d.running as usize;
                let next = cands
                    .iter()
                    .copied()
                    .find(|&p| self.qs[p].idx + 1 > cur_idx)
                    .or(cands.first().copied());
                self.devs[dev] = match next {
                    Some(p) => Dev {
                        running: self.qs[p].idx as u32 + 1,
                        _pad: 0,
                        slice_end: self.clock + self.slice_len(self.clock),
                        piece_start: self.clock,
                    },
                    None => Dev::default(),
                };
            }
            if let Some(p) = self.running_pos(dev)
                && let Some(&h) = self.qs[p].items.front()
                && h.coll != 0
                && !self.arrived(&h)
            {
                self.colls[h.coll as usize - 1].arrived |= 1 << h.rank;
                arrived = true;
            }
        }
        arrived
    }

    /// The next time anything changes: a kernel ends, a slice ends where
    /// another queue waits, a gate in time opens; at most `until`.
    fn next_event(&self, until: u64) -> u64 {
        let mut next = until;
        for dev in 0..self.ndev {
            let d = &self.devs[dev];
            let Some(p) = self.running_pos(dev) else {
                continue;
            };
            if let Some(h) = self.qs[p].items.front()
                && !self.spinning(h)
            {
                next = next.min(self.clock + h.left);
            }
            if self
                .qs
                .iter()
                .any(|q| q.dev == dev && q.idx != self.qs[p].idx && !q.items.is_empty())
            {
                next = next.min(d.slice_end);
            }
        }
        for q in &self.qs {
            if let Some(h) = q.items.front()
                && decode(h.gate).is_none()
                && h.gate > self.clock
            {
                next = next.min(h.gate);
            }
        }
        next.max(self.clock + 1)
    }

    /// Whether queue `idx` waits for what has not been launched yet: its
    /// head a collective spinning for its peers, or gated on another
    /// device's work.
    fn blocked(&self, idx: usize) -> bool {
        let Some(p) = self.pos_of_idx(idx) else {
            return false;
        };
        self.qs[p].items.front().is_some_and(|h| {
            self.spinning(h) || (decode(h.gate).is_some() && !self.gate_open(self.qs[p].pid, h))
        })
    }

    /// Plays the devices up to `until`, or until item `stop` (a queue
    /// index and sequence number) is done. Returns whether it is.
    fn play(&mut self, until: u64, stop: Option<(usize, u64)>) -> bool {
        let stopped = |w: &World| {
            stop.is_some_and(|(idx, seq)| w.pos_of_idx(idx).is_none_or(|p| w.qs[p].done >= seq))
        };
        loop {
            // Ends, arrivals and choices at this instant, until stable.
            loop {
                let ended = self.settle();
                let arrived = self.schedule();
                if !ended && !arrived {
                    break;
                }
            }
            if stopped(self) {
                return true;
            }
            if self.clock >= until {
                return false;
            }
            let next = self.next_event(until);
            let dt = next - self.clock;
            for dev in 0..self.ndev {
                let Some(p) = self.running_pos(dev) else {
                    continue;
                };
                let spinning = self.qs[p].items.front().is_some_and(|h| self.spinning(h));
                if !spinning && let Some(h) = self.qs[p].items.front_mut() {
                    h.left = h.left.saturating_sub(dt);
                }
            }
            self.clock = next;
        }
    }
}

/// Items a wait keeps the end times of (see `Slicer::waited`).
const WAITED: usize = 4;

/// This process's handle on the time-sliced devices.
pub struct Slicer {
    shared: *mut Shared,
    file: std::fs::File,
    lock: Mutex<()>,
    dir: PathBuf,
    pid: u32,
    slice_ns: u64,
    ndev: usize,
    /// The pending values a wait of this process last saw done (the work
    /// waited for and up to `WAITED - 1` items after it, such as an event
    /// recorded just before the wait), with when each ended: an event's
    /// time is read from here, as a real driver reads an event's
    /// timestamp from host memory, not by playing the devices again (see
    /// [`Slicer::time_of`]).
    waited: Mutex<[(u64, u64); WAITED]>,
}

// SAFETY: the shared mapping is only read or written while holding both
// `lock` (threads of this process) and the file lock (other processes).
unsafe impl Send for Slicer {}
// SAFETY: as above.
unsafe impl Sync for Slicer {}

impl std::fmt::Debug for Slicer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Slicer")
            .field("dir", &self.dir)
            .field("slice_ns", &self.slice_ns)
            .finish_non_exhaustive()
    }
}

/// The queue is full (more than `RING` items) or no queue is free.
#[derive(Debug)]
pub struct Full;

impl Slicer {
    /// Opens (or creates) the shared state in `dir`.
    pub fn open(dir: &Path, slice_ns: u64, ndev: usize) -> Result<Slicer, String> {
        let size = std::mem::size_of::<Shared>();
        let init = |ptr: *mut libc::c_void, _fresh: bool| {
            // SAFETY: under the file lock, nobody else touches the
            // mapping; every field is plain integers, valid for any bytes
            // (zero too). A fresh file is zeros, without the magic.
            unsafe {
                let shared = ptr.cast::<Shared>();
                if (*shared).magic != MAGIC {
                    std::ptr::write_bytes(ptr.cast::<u8>(), 0, size);
                    (*shared).magic = MAGIC;
                }
            }
        };
        let (file, ptr) = map_shared(&dir.join("slices"), size, init)?;
        let shared = ptr.cast::<Shared>();
        Ok(Slicer {
            shared,
            file,
            lock: Mutex::new(()),
            dir: dir.to_path_buf(),
            pid: std::process::id(),
            slice_ns: slice_ns.max(1),
            ndev: ndev.min(MAX_DEVICES),
            waited: Mutex::new([(0, 0); WAITED]),
        })
    }

    /// Runs `f` on the shared state, locked for this process and others.
    fn with<T>(&self, f: impl FnOnce(&mut Shared) -> T) -> T {
        let _g = self.lock.lock().unwrap_or_else(|p| p.into_inner());
        let _f = FileLock::new(&self.file);
        // SAFETY: both locks are held, so this is the only reference to
        // the mapping anywhere until they are released.
        let sh = unsafe { &mut *self.shared };
        f(sh)
    }

    /// Copies the pending work out, dropping that of dead processes (a
    /// `Gone` record each: the driver drops a dead process's work).
    fn load(&self, sh: &mut Shared, now: u64) -> World {
        if sh.clock == 0 {
            sh.clock = now;
        }
        let mut qs = Vec::new();
        for (idx, q) in sh.queues.iter_mut().enumerate() {
            if q.pid == 0 || q.enq <= q.done {
                continue;
            }
            if q.pid != self.pid && now >= q.checked + CHECK_NS {
                q.checked = now;
                if !pid_alive(q.pid) {
                    let gone = Record {
                        start: sh.clock,
                        end: sh.clock,
                        pid: q.pid,
                        kind: Kind::Gone as u32,
                    };
                    let _ = append_many(&self.dir, q.dev, &[gone]);
                    q.pid = 0;
                    continue;
                }
            }
            let items = (q.done + 1..=q.enq)
                .map(|s| q.items[s as usize % RING])
                .collect();
            qs.push(Q {
                idx,
                pid: q.pid,
                dev: q.dev as usize,
                done: q.done,
                items,
            });
        }
        World {
            clock: sh.clock,
            slice: self.slice_ns,
            ndev: self.ndev,
            devs: sh.devs,
            colls: sh.colls.to_vec(),
            qs,
            finished: Vec::new(),
            records: Vec::new(),
        }
    }

    /// Stores a played world back and writes what ran to the busy logs.
    fn store(&self, sh: &mut Shared, w: World) {
        sh.clock = w.clock;
        sh.devs = w.devs;
        sh.colls.copy_from_slice(&w.colls);
        for (idx, it) in w.finished {
            let q = &mut sh.queues[idx];
            q.items[it.seq as usize % RING] = it;
            if it.kind == NO_RECORD && it.coll == 0 {
                let at = q.marks_next as usize % MARKS;
                q.marks[at] = Mark {
                    seq: it.seq,
                    done_at: it.done_at,
                };
                q.marks_next += 1;
            }
        }
        for q in &w.qs {
            let sq = &mut sh.queues[q.idx];
            sq.done = q.done;
            for it in &q.items {
                sq.items[it.seq as usize % RING] = *it;
            }
        }
        for dev in 0..self.ndev {
            let recs: Vec<Record> = w
                .records
                .iter()
                .filter(|(d, _)| *d == dev)
                .map(|(_, r)| *r)
                .collect();
            if !recs.is_empty() {
                let _ = append_many(&self.dir, dev as u32, &recs);
            }
        }
    }

    /// Plays the devices up to now.
    fn advance_locked(&self, sh: &mut Shared) {
        let now = now_ns();
        let mut w = self.load(sh, now);
        w.play(now, None);
        self.store(sh, w);
    }

    /// Plays the devices up to now (for readers of the busy log).
    pub fn advance(&self) {
        self.with(|sh| self.advance_locked(sh));
    }

    /// This process's queue on `dev`, taken if it has none.
    fn my_queue(&self, sh: &mut Shared, dev: usize) -> Option<usize> {
        if let Some(i) = sh
            .queues
            .iter()
            .position(|q| q.pid == self.pid && q.dev as usize == dev)
        {
            return Some(i);
        }
        let free = sh.queues.iter().position(|q| {
            q.pid == 0 || (q.enq <= q.done && q.pid != self.pid && !pid_alive(q.pid))
        })?;
        let q = &mut sh.queues[free];
        q.pid = self.pid;
        q.dev = dev as u32;
        q.enq = 0;
        q.done = 0;
        q.checked = 0;
        q.marks_next = 0;
        Some(free)
    }

    fn find_queue(sh: &Shared, pid: u32, dev: usize) -> Option<usize> {
        sh.queues
            .iter()
            .position(|q| q.pid == pid && q.dev as usize == dev)
    }

    /// Queues `ns` of work on `dev` after `gate` (see [`Item`]); `kind`
    /// `None` for a marker. Blocks while `depth` items are pending there.
    /// Returns its pending value.
    pub fn enqueue(
        &self,
        dev: usize,
        ns: u64,
        gate: u64,
        kind: Option<u32>,
        depth: usize,
    ) -> Result<u64, Full> {
        self.enqueue_item(dev, ns, gate, kind.unwrap_or(NO_RECORD), None, depth)
    }

    /// Queues a collective: rank `rank` of `ranks` of the `seq`th
    /// collective on communicator `comm`, running `ns` once every rank's
    /// kernel has started.
    #[allow(clippy::too_many_arguments)]
    pub fn enqueue_collective(
        &self,
        dev: usize,
        ns: u64,
        gate: u64,
        depth: usize,
        comm: u64,
        seq: u64,
        ranks: u32,
        rank: u32,
    ) -> Result<u64, Full> {
        if ranks == 0 || ranks > 64 || rank >= ranks {
            return Err(Full);
        }
        self.enqueue_item(
            dev,
            ns,
            gate,
            Kind::Collective as u32,
            Some((comm, seq, ranks, rank)),
            depth,
        )
    }

    fn enqueue_item(
        &self,
        dev: usize,
        ns: u64,
        gate: u64,
        kind: u32,
        coll: Option<(u64, u64, u32, u32)>,
        depth: usize,
    ) -> Result<u64, Full> {
        let depth = depth.clamp(1, RING - 1) as u64;
        loop {
            let queued = self.with(|sh| {
                self.advance_locked(sh);
                let qi = self.my_queue(sh, dev).ok_or(Full)?;
                let q = &sh.queues[qi];
                if q.enq - q.done >= depth {
                    return Ok(Err(q.done + 1));
                }
                let coll_idx = match coll {
                    None => 0,
                    Some((comm, seq, ranks, _)) => {
                        let clock = sh.clock;
                        let colls = &mut sh.colls;
                        let found = colls
                            .iter()
                            .position(|c| c.used != 0 && c.comm == comm && c.seq == seq);
                        let i = match found {
                            Some(i) => i,
                            None => {
                                let i = colls
                                    .iter()
                                    .position(|c| c.used == 0 || clock >= c.born + COLL_LIFE_NS)
                                    .ok_or(Full)?;
                                colls[i] = Coll {
                                    comm,
                                    seq,
                                    ranks,
                                    used: 1,
                                    arrived: 0,
                                    finished: 0,
                                    born: clock,
                                };
                                i
                            }
                        };
                        i as u32 + 1
                    }
                };
                let q = &mut sh.queues[qi];
                q.enq += 1;
                let seq = q.enq;
                q.items[seq as usize % RING] = Item {
                    seq,
                    left: ns,
                    gate,
                    done_at: 0,
                    coll: coll_idx,
                    rank: coll.map_or(0, |c| c.3),
                    kind,
                    _pad: 0,
                };
                // A marker that is already due ends now, not at the next
                // look.
                self.advance_locked(sh);
                Ok(Ok(seq))
            })?;
            match queued {
                Ok(seq) => return Ok(pending(dev, seq)),
                // Full: wait for the oldest to end, then try again.
                Err(oldest) => self.wait(pending(dev, oldest)),
            }
        }
    }

    /// Whether the work of pending value `when` is done (played up to now).
    pub fn is_done(&self, when: u64) -> bool {
        let Some((dev, seq)) = decode(when) else {
            return when <= now_ns();
        };
        self.with(|sh| {
            self.advance_locked(sh);
            Self::find_queue(sh, self.pid, dev).is_none_or(|i| sh.queues[i].done >= seq)
        })
    }

    /// When the work of `when` ended; `None` while it has not.
    pub fn time_of(&self, when: u64) -> Option<u64> {
        let Some((dev, seq)) = decode(when) else {
            return (when <= now_ns()).then_some(when);
        };
        let waited = *self.waited.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(&(_, at)) = waited.iter().find(|w| w.0 == when) {
            return Some(at);
        }
        self.with(|sh| {
            self.advance_locked(sh);
            let Some(i) = Self::find_queue(sh, self.pid, dev) else {
                return Some(sh.clock);
            };
            let q = &sh.queues[i];
            if q.done < seq {
                return None;
            }
            let it = q.items[seq as usize % RING];
            if it.seq == seq {
                return Some(it.done_at);
            }
            // Long gone from the ring: a marker's time is kept apart.
            Some(
                q.marks
                    .iter()
                    .find(|m| m.seq == seq)
                    .map_or(sh.clock, |m| m.done_at),
            )
        })
    }

    /// Waits until the work of `when` is done.
    pub fn wait(&self, when: u64) {
        let Some((dev, seq)) = decode(when) else {
            sleep_until(when);
            return;
        };
        loop {
            let until = self.with(|sh| {
                self.advance_locked(sh);
                let i = Self::find_queue(sh, self.pid, dev)?;
                let q = &sh.queues[i];
                if q.done >= seq {
                    let mut seen = [(0, 0); WAITED];
                    for (w, s) in seen.iter_mut().zip(seq..=q.done) {
                        let it = q.items[s as usize % RING];
                        if it.seq == s {
                            *w = (pending(dev, s), it.done_at);
                        }
                    }
                    *self.waited.lock().unwrap_or_else(|e| e.into_inner()) = seen;
                    return None;
                }
                // When it ends if nothing more is launched; where it waits
                // for what is not launched yet (a peer's collective), a
                // short poll.
                let now = sh.clock;
                let mut ahead = self.load(sh, now);
                let ends = ahead.play(now + HORIZON_NS, Some((i, seq)));
                Some(if ends || !ahead.blocked(i) {
                    ahead.clock
                } else {
                    now + POLL_NS
                })
            });
            match until {
                None => return,
                Some(t) => sleep_until(t),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const MS: u64 = 1_000_000;

    fn item(seq: u64, left: u64) -> Item {
        Item {
            seq,
            left,
            kind: Kind::Kernel as u32,
            ..Item::default()
        }
    }

    fn world(slice: u64, ndev: usize) -> World {
        World {
            clock: 0,
            slice,
            ndev,
            devs: [Dev::default(); MAX_DEVICES],
            colls: vec![Coll::default(); MAX_COLLS],
            qs: Vec::new(),
            finished: Vec::new(),
            records: Vec::new(),
        }
    }

    fn queue(idx: usize, pid: u32, dev: usize, items: &[Item]) -> Q {
        Q {
            idx,
            pid,
            dev,
            done: 0,
            items: items.iter().copied().collect(),
        }
    }

    fn pieces(w: &World, pid: u32) -> Vec<(u64, u64)> {
        w.records
            .iter()
            .filter(|(_, r)| r.pid == pid)
            .map(|(_, r)| (r.start, r.end))
            .collect()
    }

    /// A kernel that comes while another context's long kernel runs
    /// waits for that slice's end, runs, and the long one resumes: it
    /// ran its whole time in two pieces.
    #[test]
    fn a_long_kernel_is_preempted_at_its_slice_s_end() {
        let mut w = world(2 * MS, 1);
        w.qs.push(queue(0, 1, 0, &[item(1, 5 * MS)]));
        w.play(MS, None);
        w.qs.push(queue(1, 2, 0, &[item(1, MS / 100)]));
        w.play(20 * MS, None);
        let end_b = pieces(&w, 2)[0].1;
        let start_b = pieces(&w, 2)[0].0;
        assert!(
            (3 * MS / 2..=5 * MS / 2).contains(&start_b),
            "it started at {start_b} ns, not at the slice's end"
        );
        let a = pieces(&w, 1);
        assert_eq!(a.len(), 2, "{a:?}");
        assert_eq!(a[1].0, end_b, "{a:?}");
        assert_eq!(a.iter().map(|(s, e)| e - s).sum::<u64>(), 5 * MS);
        assert!(w.qs.iter().all(|q| q.items.is_empty()));
    }

    /// Two saturating contexts alternate in slices and each gets half.
    #[test]
    fn two_busy_contexts_share_the_device_in_slices() {
        let mut w = world(2 * MS, 1);
        w.qs.push(queue(0, 1, 0, &[item(1, 100 * MS)]));
        w.qs.push(queue(1, 2, 0, &[item(1, 100 * MS)]));
        w.play(300 * MS, None);
        let (a, b) = (pieces(&w, 1), pieces(&w, 2));
        let ran = |p: &[(u64, u64)]| p.iter().map(|(s, e)| e - s).sum::<u64>();
        assert_eq!((ran(&a), ran(&b)), (100 * MS, 100 * MS));
        // Alternating: both end together (in launch order, 100 ms apart;
        // the slices' jitter leaves a few ms).
        assert!(
            a[a.len() - 1].1.abs_diff(b[b.len() - 1].1) <= 10 * MS,
            "{a:?} {b:?}"
        );
        // While both have work, no piece is longer than a slice.
        let both = a[a.len() - 1].1.min(b[b.len() - 1].1);
        for (s, e) in a.iter().chain(&b).filter(|p| p.1 < both) {
            assert!(e - s <= 2 * MS + MS / 2, "a slice of {} µs", (e - s) / 1000);
        }
    }

    /// A collective spins (takes its slices, ends nothing) until its peer
    /// on another device has been scheduled, then runs its time.
    #[test]
    fn a_collective_runs_its_time_only_once_its_peer_has_started() {
        let mut w = world(2 * MS, 2);
        w.colls[0] = Coll {
            comm: 7,
            seq: 1,
            ranks: 2,
            used: 1,
            ..Coll::default()
        };
        let coll = |rank| Item {
            coll: 1,
            rank,
            kind: Kind::Collective as u32,
            ..item(1, MS)
        };
        w.qs.push(queue(0, 1, 0, &[coll(0)]));
        w.play(10 * MS, None);
        assert_eq!(w.qs[0].done, 0, "it ended without its peer");
        w.qs.push(queue(1, 2, 1, &[coll(1)]));
        assert!(w.play(20 * MS, Some((0, 1))));
        assert_eq!(w.clock, 11 * MS, "it ends its time after the peer came");
        assert!(w.play(20 * MS, Some((1, 1))));
        assert_eq!(w.colls[0].used, 0, "the collective is freed once all ended");
    }

    /// A wait keeps the end times of the work it waited for and of the
    /// markers just after it (an event recorded before a synchronisation):
    /// read from there, they are the times the devices' play gives, as
    /// another handle on the same state, which kept none, reads them.
    #[test]
    #[allow(clippy::expect_used)]
    fn a_wait_keeps_the_times_of_what_it_waited_for() {
        let dir = std::env::temp_dir().join(format!("fakecuda-waited-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let (a, b) = (
            Slicer::open(&dir, 2 * MS, 1).expect("slicer"),
            Slicer::open(&dir, 2 * MS, 1).expect("slicer"),
        );
        // Long enough that it is not done before the first look, however
        // late this thread runs.
        let kernel = a
            .enqueue(0, 20 * MS, 0, Some(Kind::Kernel as u32), 8)
            .expect("queued");
        let marker = a.enqueue(0, 0, 0, None, 8).expect("queued");
        let later = a
            .enqueue(0, 20 * MS, 0, Some(Kind::Kernel as u32), 8)
            .expect("queued");
        assert_eq!(a.time_of(marker), None, "not done yet");
        a.wait(kernel);
        // What is not done yet is never answered from what a wait kept.
        assert_eq!(a.time_of(later), None, "the kernel after it is not done");
        let kept = *a.waited.lock().expect("waited");
        assert!(kept.iter().any(|w| w.0 == marker), "{kept:?}");
        let (k, m) = (a.time_of(kernel), a.time_of(marker));
        assert!(k.is_some() && k == m, "{k:?} {m:?}");
        assert_eq!((k, m), (b.time_of(kernel), b.time_of(marker)));
        // What was not waited for is played, as before.
        a.wait(later);
        assert_eq!(a.time_of(later), b.time_of(later));
        assert_eq!(a.time_of(later), k.map(|k| k + 20 * MS));
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A marker gated on another device's work ends when that work does.
    #[test]
    fn a_wait_for_another_device_s_work_ends_with_it() {
        let mut w = world(2 * MS, 2);
        w.qs.push(queue(0, 1, 0, &[item(1, 3 * MS)]));
        let gated = Item {
            gate: pending(0, 1),
            kind: NO_RECORD,
            ..item(1, 0)
        };
        w.qs.push(queue(1, 1, 1, &[gated, item(2, MS)]));
        assert!(w.play(10 * MS, Some((1, 2))));
        assert_eq!(w.clock, 4 * MS);
    }
}
