//! Who a peer's user is: its name and Unix groups from the system's
//! databases, looked up off the event loop and kept. A look-up goes
//! through NSS, which may read a large /etc/group or ask a directory
//! server (seconds, where it is slow); done in the loop for every
//! connection (and for every refused peer at every status), a flood of
//! connections stalled every program's tokens. Now a thread looks each
//! (uid, gid) up once, the loop keeps the answer, and the messages of a
//! connection whose user is not known yet wait (a bounded number) until
//! the answer comes. A known answer older than [`REFRESH`] is asked again
//! in the background and used meanwhile.

use super::*;
use std::collections::{HashSet, VecDeque};
use std::io::Read as _;
use std::os::unix::net::UnixStream;

/// How old an answer may be before it is asked again (a user added to a
/// group is seen within this long).
const REFRESH: Duration = Duration::from_secs(60);

/// The most messages kept for the connections of one (uid, gid) whose
/// user is being looked up; past it, new ones are dropped (a peer that
/// floods before it is known loses its own messages, no one else's).
const PENDING_PER_USER: usize = 64;

/// The most (uid, gid) pairs whose messages wait at once: the machine's
/// users are far fewer.
const PENDING_USERS: usize = 1024;

/// A user, as the system's databases name it.
#[derive(Debug, Clone)]
pub(super) struct Account {
    /// The user's name (the uid as text where it has none).
    pub(super) name: String,
    /// The names of the peer's group and of the user's Unix groups.
    pub(super) groups: Vec<String>,
    looked_up: Instant,
}

/// The look-ups, their answers and the messages waiting for them.
#[derive(Debug)]
pub(super) struct Resolver {
    known: HashMap<(u32, u32), Account>,
    asked: HashSet<(u32, u32)>,
    ask: mpsc::Sender<(u32, u32)>,
    answers: mpsc::Receiver<((u32, u32), Account)>,
    /// Readable when an answer came (the thread writes a byte).
    wake: UnixStream,
    /// Messages of connections whose user is being looked up, in order.
    pending: HashMap<(u32, u32), VecDeque<Vec<zmq::Message>>>,
}

/// Looks up the name and groups of uid `uid` with group `gid`.
fn look_up(uid: u32, gid: u32) -> Account {
    use nix::unistd::{Gid, Group, Uid, User};
    let user = User::from_uid(Uid::from_raw(uid)).ok().flatten();
    let name = user
        .as_ref()
        .map_or_else(|| uid.to_string(), |u| u.name.clone());
    let mut gids = vec![Gid::from_raw(gid)];
    if let Some(u) = &user
        && let Ok(cname) = std::ffi::CString::new(u.name.clone())
        && let Ok(list) = nix::unistd::getgrouplist(&cname, u.gid)
    {
        gids.extend(list);
    }
    gids.dedup();
    let groups = gids
        .into_iter()
        .filter_map(|g| Group::from_gid(g).ok().flatten())
        .map(|g| g.name)
        .collect();
    Account {
        name,
        groups,
        looked_up: Instant::now(),
    }
}

impl Resolver {
    /// Starts the look-up thread.
    pub(super) fn start() -> anyhow::Result<Resolver> {
        let (ask, asks) = mpsc::channel::<(u32, u32)>();
        let (answer, answers) = mpsc::channel();
        let (wake, waker) =
            UnixStream::pair().context("cannot make the resolver's wake-up pair")?;
        wake.set_nonblocking(true)?;
        std::thread::Builder::new()
            .name("gem-schd-users".into())
            .spawn(move || {
                use std::io::Write as _;
                let mut waker = waker;
                for (uid, gid) in asks {
                    let account = look_up(uid, gid);
                    if answer.send(((uid, gid), account)).is_err() {
                        return;
                    }
                    // The loop reads the answers when this is readable;
                    // a full pipe already wakes it.
                    let _ = waker.write(&[1]);
                }
            })
            .context("cannot start the resolver thread")?;
        Ok(Resolver {
            known: HashMap::new(),
            asked: HashSet::new(),
            ask,
            answers,
            wake,
            pending: HashMap::new(),
        })
    }

    /// The fd that is readable when answers came.
    pub(super) fn wake_fd(&self) -> i32 {
        self.wake.as_raw_fd()
    }

    /// The account of `(uid, gid)` if known (asked again in the
    /// background when old); `None`: asked, and the caller waits.
    pub(super) fn get(&mut self, uid: u32, gid: u32) -> Option<Account> {
        let key = (uid, gid);
        let known = self.known.get(&key).cloned();
        if known
            .as_ref()
            .is_none_or(|a| a.looked_up.elapsed() >= REFRESH)
            && self.asked.insert(key)
        {
            let _ = self.ask.send(key);
        }
        known
    }

    /// Keeps `frames`, a message of a connection of `(uid, gid)`, until
    /// that user is known; false where too many wait already (dropped).
    pub(super) fn hold(&mut self, uid: u32, gid: u32, frames: Vec<zmq::Message>) -> bool {
        let key = (uid, gid);
        if !self.pending.contains_key(&key) && self.pending.len() >= PENDING_USERS {
            return false;
        }
        let queue = self.pending.entry(key).or_default();
        if queue.len() >= PENDING_PER_USER {
            return false;
        }
        queue.push_back(frames);
        true
    }

    /// Whether messages of `(uid, gid)` wait (a new one must wait behind
    /// them, in order).
    pub(super) fn holds(&self, uid: u32, gid: u32) -> bool {
        self.pending.contains_key(&(uid, gid))
    }

    /// Takes the answers that came; returns the messages that waited for
    /// them, in the order they came.
    pub(super) fn collect(&mut self) -> Vec<Vec<zmq::Message>> {
        let mut buf = [0u8; 64];
        while matches!((&self.wake).read(&mut buf), Ok(n) if n > 0) {}
        let mut ready = Vec::new();
        while let Ok((key, account)) = self.answers.try_recv() {
            self.asked.remove(&key);
            self.known.insert(key, account);
            if let Some(queue) = self.pending.remove(&key) {
                ready.extend(queue);
            }
        }
        ready
    }
}
