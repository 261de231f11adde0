//! Status answers, paced. A status lists every client, group, device and
//! reservation: the heaviest request the daemon answers, and one any
//! connected user may send. Asked as fast as the daemon answers (16
//! connections in a loop), it took the CPU the processes and their
//! grants needed. So one connection, or one user other than root and the
//! daemon's, gets at most one answer every [`STATUS_EVERY`]; a request
//! that comes sooner is answered when its turn comes, and past
//! [`STATUS_QUEUED`] waiting answers it is refused at once (cheaply).
//! A `gem-schd status --watch`, or a monitoring poll, never comes near.

use super::*;
use std::collections::VecDeque;

/// The shortest time between two status answers to one connection, or to
/// one user other than root and the daemon's.
pub(super) const STATUS_EVERY: Duration = Duration::from_millis(10);

/// The most status answers that wait for one connection or user.
pub(super) const STATUS_QUEUED: u32 = 32;

/// Whose pace a status request keeps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) enum Pacer {
    /// A connection of root or of the daemon's user.
    Conn(ClientId),
    /// Every connection of a user.
    User(u32),
}

/// When each pacer may next be answered, and the answers waiting.
#[derive(Debug, Default)]
pub(super) struct Paced {
    next: HashMap<Pacer, (Instant, u32)>,
    waiting: VecDeque<(Instant, Pacer, ClientId, u32)>,
}

/// What to do with a status request.
#[derive(Debug, PartialEq, Eq)]
pub(super) enum Turn {
    /// Answer it now.
    Now,
    /// It waits (answered by [`Paced::due`]).
    Later,
    /// Refuse it: too many wait.
    Refused,
}

impl Paced {
    /// A status request `seq` of `client` (paced as `pacer`) at `now`.
    pub(super) fn ask(&mut self, pacer: Pacer, client: ClientId, seq: u32, now: Instant) -> Turn {
        let (next, queued) = self.next.get(&pacer).copied().unwrap_or((now, 0));
        if next <= now {
            self.next.insert(pacer, (now + STATUS_EVERY, 0));
            self.forget_old(now);
            return Turn::Now;
        }
        if queued >= STATUS_QUEUED {
            return Turn::Refused;
        }
        self.next.insert(pacer, (next + STATUS_EVERY, queued + 1));
        self.waiting.push_back((next, pacer, client, seq));
        Turn::Later
    }

    /// The requests whose turn has come by `now`, as `(client, seq)`.
    pub(super) fn due(&mut self, now: Instant) -> Vec<(ClientId, u32)> {
        let mut out = Vec::new();
        // Turns are given in order per pacer, not across them: look at all.
        self.waiting.retain(|&(at, pacer, client, seq)| {
            if at > now {
                return true;
            }
            out.push((client, seq));
            if let Some((_, queued)) = self.next.get_mut(&pacer) {
                *queued = queued.saturating_sub(1);
            }
            false
        });
        out
    }

    /// When the next waiting request's turn comes.
    pub(super) fn next_due(&self) -> Option<Instant> {
        self.waiting.iter().map(|w| w.0).min()
    }

    /// Forgets the pacers that may be answered at once anyway (bounded:
    /// looked at only when they outnumber the waiting answers a lot).
    fn forget_old(&mut self, now: Instant) {
        if self.next.len() > 1024 + self.waiting.len() {
            self.next
                .retain(|_, (next, queued)| *next > now || *queued > 0);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One pacer is answered once per STATUS_EVERY, its extra requests in
    /// turn and then refused; another pacer is not held up by it.
    #[test]
    fn a_flood_of_status_requests_is_answered_at_a_pace() {
        let t0 = Instant::now();
        let mut p = Paced::default();
        let flood = Pacer::User(1000);
        assert_eq!(p.ask(flood, 1, 1, t0), Turn::Now);
        for seq in 2..2 + STATUS_QUEUED {
            assert_eq!(p.ask(flood, 1, seq, t0), Turn::Later);
        }
        assert_eq!(p.ask(flood, 2, 99, t0), Turn::Refused);
        assert_eq!(p.ask(Pacer::Conn(7), 7, 1, t0), Turn::Now);
        assert_eq!(p.next_due(), Some(t0 + STATUS_EVERY));
        assert!(p.due(t0).is_empty());
        assert_eq!(p.due(t0 + STATUS_EVERY), [(1, 2)]);
        assert_eq!(p.due(t0 + 3 * STATUS_EVERY), [(1, 3), (1, 4)]);
        // Answers leave room for as many more.
        assert_eq!(p.ask(flood, 1, 100, t0 + 3 * STATUS_EVERY), Turn::Later);
    }
}
