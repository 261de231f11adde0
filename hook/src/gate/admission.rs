//! The admission protocol: how a launch on the fast path and a thread
//! that takes the token away agree, with no lock, that no launch reaches
//! the driver once the token is taken.
//!
//! A launch counts itself in (`entered`) and only then reads the
//! deadline; if the deadline has passed it counts itself out again and
//! takes the slow path. A give-back swaps the deadline out and only then
//! checks that every call counted in has returned (`entered ==
//! exited`); if one has not, it puts the deadline back and the token
//! stays. Both sides' accesses are sequentially consistent, so one of
//! them sees the other: either the give-back sees the launch counted in
//! and keeps the token, or the launch sees the deadline gone. (Reading
//! the deadline first and counting in after lets a launch read the old
//! deadline, the give-back then find nothing in flight, and the launch
//! reach the driver with no token: the loom model below finds that
//! interleaving.)
//!
//! The functions are generic over the word they work on, so that the
//! same code runs on `std`'s atomics in the hook and on `loom`'s in the
//! model (`RUSTFLAGS="--cfg loom" cargo test -p gemini-hook --release
//! --lib admission`, see docs/testing.md). The order each side needs is
//! between its write (the count, the swap) and its read that follows:
//! `std`'s sequentially consistent accesses give it (C11 orders every
//! such access in one total order); loom treats such accesses as
//! acquire-release only, and models the same order with a sequentially
//! consistent fence after the write, so its words fence there.

use std::sync::atomic::Ordering::SeqCst;

/// A 64-bit atomic word, as the protocol uses it: every access is
/// ordered with every other, of every word (see the module doc).
pub(crate) trait Word {
    fn get(&self) -> u64;
    fn set(&self, v: u64);
    fn swap_in(&self, v: u64) -> u64;
    fn add(&self, v: u64);
    fn sub(&self, v: u64);
}

impl Word for std::sync::atomic::AtomicU64 {
    #[inline]
    fn get(&self) -> u64 {
        self.load(SeqCst)
    }
    #[inline]
    fn set(&self, v: u64) {
        self.store(v, SeqCst)
    }
    #[inline]
    fn swap_in(&self, v: u64) -> u64 {
        self.swap(v, SeqCst)
    }
    #[inline]
    fn add(&self, v: u64) {
        self.fetch_add(v, SeqCst);
    }
    #[inline]
    fn sub(&self, v: u64) {
        self.fetch_sub(v, SeqCst);
    }
}

/// A launch at `now` asks to pass: counted into `entered` if the token
/// (`deadline`) is valid and `fits` agrees (the queue bound), else not
/// counted and `false` (the slow path). Keep the call counted until it
/// returns from the driver, then count it out of `exited`.
#[inline]
pub(crate) fn enter<W: Word>(
    entered: &W,
    deadline: &W,
    now: u64,
    fits: impl FnOnce() -> bool,
) -> bool {
    entered.add(1);
    if now < deadline.get() && fits() {
        return true;
    }
    entered.sub(1);
    false
}

/// Takes the token (`deadline`) from new launches, if no call is in flight
/// and none came in since `seen` calls had been counted in: `true`, and
/// every launch from now on takes the slow path (and waits for the
/// caller, which holds the gate's lock). `false`, the token left as it
/// was, otherwise.
pub(crate) fn withdraw<W: Word>(deadline: &W, entered: &W, exited: &W, seen: u64) -> bool {
    let was = deadline.swap_in(0);
    // Out first, then in: a call (a wait counts in with no deadline to
    // check) that came in and went out between the two reads would, read
    // the other way round, bring `exited` up to `seen` while a launch
    // counted in `seen` is still in flight.
    let out = exited.get();
    if out != seen || entered.get() != seen {
        deadline.set(was);
        return false;
    }
    true
}

/// The calls of a gate in flight, as [`in_flight`] reads them: `calls`
/// (launches and waits counted in and not out) and `waits` (of them,
/// waits). Each may count a call that came or went during the reading,
/// but `launches()` never counts fewer than the launches in flight
/// throughout it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct InFlight {
    pub(crate) calls: u64,
    pub(crate) waits: u64,
    /// `entered` as read (last).
    pub(crate) entered: u64,
}

impl InFlight {
    /// Launches in flight (calls that are not waits): at least every
    /// launch in flight throughout the reading.
    pub(crate) fn launches(self) -> u64 {
        self.calls.saturating_sub(self.waits)
    }

    /// Waits alone are in flight (at least one): no launch is.
    pub(crate) fn only_waits(self) -> bool {
        self.calls != 0 && self.launches() == 0
    }
}

/// Reads the calls in flight: `exited`, then `waiting` (waits in flight),
/// then `entered`. The one order every reader of the counts uses; a wait
/// counts itself into `entered` before `waiting`, and out of `waiting`
/// before `exited`. So a wait counted in `waiting` is counted in
/// `entered - exited` too (it entered before and left after the reading
/// of `waiting`), and `calls - waits` never hides a launch. Read in
/// another order, a wait that left and a wait that came between two
/// reads make a launch in flight look like waits alone (see the models
/// below).
pub(crate) fn in_flight<W: Word>(entered: &W, exited: &W, waiting: &W) -> InFlight {
    let out = exited.get();
    let waits = waiting.get();
    let entered = entered.get();
    InFlight {
        calls: entered.saturating_sub(out),
        waits,
        entered,
    }
}

/// Closes the token (`deadline`) to new launches for the one call in
/// flight, a wait announcing the end of the token's work
/// (`Transition::Close`): `true` where that wait is the only call in
/// flight; `false`, the token left as it was, where a launch came in
/// before the swap (or the token was closed already).
pub(crate) fn close_for_wait<W: Word>(deadline: &W, entered: &W, exited: &W, waiting: &W) -> bool {
    let was = deadline.swap_in(0);
    if was == 0 {
        return false;
    }
    if in_flight(entered, exited, waiting).calls != 1 {
        deadline.set(was);
        return false;
    }
    true
}

/// Takes the token (`deadline`) from new launches where only waits hold
/// it and `overdue` says they have waited too long (the Stalled
/// give-back): both checked after the swap, so that a launch that came
/// in before it keeps the token.
pub(crate) fn withdraw_from_waits<W: Word>(
    deadline: &W,
    entered: &W,
    exited: &W,
    waiting: &W,
    overdue: impl FnOnce() -> bool,
) -> bool {
    let was = deadline.swap_in(0);
    if in_flight(entered, exited, waiting).only_waits() && overdue() {
        return true;
    }
    deadline.set(was);
    false
}

/// Closes the token (`deadline`) to new launches at once, then waits
/// while a launch admitted under it may still be in the driver, as long
/// as `keep_waiting` says (the end of a token that ran out: its
/// synchronisation must come after their work was submitted). `true`
/// once none is; `false` where `keep_waiting` gave up first (the launch
/// is reported in flight).
pub(crate) fn close_and_drain<W: Word>(
    deadline: &W,
    entered: &W,
    exited: &W,
    waiting: &W,
    mut keep_waiting: impl FnMut() -> bool,
) -> bool {
    deadline.set(0);
    while in_flight(entered, exited, waiting).launches() != 0 {
        if !keep_waiting() {
            return false;
        }
    }
    true
}

#[cfg(all(test, loom))]
mod model {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64;

    use loom::sync::atomic::fence;

    /// Loom's accesses are acquire-release at most: a sequentially
    /// consistent fence after each write orders it with what follows.
    impl Word for AtomicU64 {
        fn get(&self) -> u64 {
            self.load(SeqCst)
        }
        fn set(&self, v: u64) {
            self.store(v, SeqCst);
            fence(SeqCst);
        }
        fn swap_in(&self, v: u64) -> u64 {
            let was = self.swap(v, SeqCst);
            fence(SeqCst);
            was
        }
        fn add(&self, v: u64) {
            self.fetch_add(v, SeqCst);
            fence(SeqCst);
        }
        fn sub(&self, v: u64) {
            self.fetch_sub(v, SeqCst);
            fence(SeqCst);
        }
    }

    #[derive(Default)]
    struct Gate {
        deadline: AtomicU64,
        entered: AtomicU64,
        exited: AtomicU64,
        /// Set once a give-back returned true.
        taken: AtomicU64,
    }

    /// Runs `launches` launches on each of two threads beside a thread
    /// giving the token back with `withdraw`, each launch passing with
    /// `enter`; fails where a launch passes after the give-back returned
    /// true.
    fn check(launches: usize, enter: fn(&AtomicU64, &AtomicU64, u64) -> bool) {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(move || {
            let g = Arc::new(Gate::default());
            g.deadline.set(100);
            let launch = |g: Arc<Gate>| {
                move || {
                    for _ in 0..launches {
                        if enter(&g.entered, &g.deadline, 10) {
                            // The launch reaches the driver here.
                            assert_eq!(g.taken.get(), 0, "a launch passed after the give-back");
                            g.exited.add(1);
                        }
                    }
                }
            };
            let a = loom::thread::spawn(launch(g.clone()));
            let b = loom::thread::spawn(launch(g.clone()));
            let seen = g.entered.get();
            if g.exited.get() == seen && withdraw(&g.deadline, &g.entered, &g.exited, seen) {
                g.taken.set(1);
            }
            a.join().unwrap();
            b.join().unwrap();
        });
    }

    /// No launch is admitted once a give-back returned true, in every
    /// interleaving (of up to three preemptions).
    #[test]
    fn no_launch_reaches_the_driver_after_a_give_back() {
        check(2, |entered, deadline, now| {
            enter(entered, deadline, now, || true)
        });
    }

    /// Runs a launch and a wait (which counts in and out with no deadline
    /// to check, as `waits` does) beside a give-back that reads the calls
    /// counted in as it starts (`End::Step`), with `withdraw`; fails where
    /// the give-back returns true while the launch is in the driver.
    fn check_beside_a_wait(withdraw: fn(&AtomicU64, &AtomicU64, &AtomicU64, u64) -> bool) {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(move || {
            let g = Arc::new(Gate::default());
            g.deadline.set(100);
            let in_driver = Arc::new(AtomicU64::new(0));
            let launch = {
                let (g, in_driver) = (g.clone(), in_driver.clone());
                loom::thread::spawn(move || {
                    if enter(&g.entered, &g.deadline, 10, || true) {
                        in_driver.set(1);
                        in_driver.set(0);
                        g.exited.add(1);
                    }
                })
            };
            let wait = {
                let g = g.clone();
                loom::thread::spawn(move || {
                    g.entered.add(1);
                    g.exited.add(1);
                })
            };
            let seen = g.entered.get();
            if withdraw(&g.deadline, &g.entered, &g.exited, seen) {
                assert_eq!(in_driver.get(), 0, "a give-back with a launch in flight");
            }
            launch.join().unwrap();
            wait.join().unwrap();
        });
    }

    /// The give-back reads the calls counted out before those counted in:
    /// a wait that comes and goes between the two reads cannot make a
    /// launch in flight look done.
    #[test]
    fn a_wait_beside_a_give_back_hides_no_launch_in_flight() {
        check_beside_a_wait(|d, e, x, seen| withdraw(d, e, x, seen));
    }

    /// Read the other way round (in, then out), the wait's exit brings
    /// `exited` up to `seen` while the launch is still in the driver.
    #[test]
    #[should_panic(expected = "a give-back with a launch in flight")]
    fn reading_in_before_out_lets_a_wait_hide_a_launch() {
        check_beside_a_wait(|deadline, entered, exited, seen| {
            let was = deadline.swap_in(0);
            if entered.get() != seen || exited.get() != seen {
                deadline.set(was);
                return false;
            }
            true
        });
    }

    /// A launch in flight beside one wait that returns and another that
    /// begins (in the order the hook counts a wait: `entered`, then
    /// `waiting`; out of `waiting`, then of `exited`), and a reader that
    /// asks whether waits alone are in flight (the Stalled give-back):
    /// `read` must never say so while the launch is in the driver.
    fn check_only_waits(read: fn(&AtomicU64, &AtomicU64, &AtomicU64) -> InFlight) {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(move || {
            let g = Arc::new(Gate::default());
            let waiting = Arc::new(AtomicU64::new(0));
            // The launch is counted in and in the driver already; the
            // first wait is under way.
            g.entered.set(2);
            waiting.set(1);
            let in_driver = Arc::new(AtomicU64::new(1));
            let launch = {
                let (g, in_driver) = (g.clone(), in_driver.clone());
                loom::thread::spawn(move || {
                    in_driver.set(0);
                    g.exited.add(1);
                })
            };
            let waits = {
                let (g, waiting) = (g.clone(), waiting.clone());
                loom::thread::spawn(move || {
                    // The first wait returns.
                    waiting.sub(1);
                    g.exited.add(1);
                    // A second begins.
                    g.entered.add(1);
                    waiting.add(1);
                })
            };
            let seen = read(&g.entered, &g.exited, &waiting);
            if seen.only_waits() {
                assert_eq!(
                    in_driver.get(),
                    0,
                    "waits alone seen with a launch in flight"
                );
            }
            launch.join().unwrap();
            waits.join().unwrap();
        });
    }

    /// [`in_flight`] never sees waits alone while a launch is in flight,
    /// whatever waits come and go during the reading.
    #[test]
    fn waits_coming_and_going_hide_no_launch_from_in_flight() {
        check_only_waits(|e, x, w| in_flight(e, x, w));
    }

    /// The order the Stalled give-back read before (`entered`, then
    /// `exited`, then `waiting`): the first wait leaves and the second
    /// comes between the reads, and the launch in flight looks like
    /// waits alone.
    #[test]
    #[should_panic(expected = "waits alone seen with a launch in flight")]
    fn reading_in_before_out_lets_waits_hide_a_launch() {
        check_only_waits(|entered, exited, waiting| {
            let e = entered.get();
            let x = exited.get();
            InFlight {
                calls: e.saturating_sub(x),
                waits: waiting.get(),
                entered: e,
            }
        });
    }

    /// A launching thread of the models below: if `enter` lets it pass, it
    /// is in the driver (`in_driver` counts it) until it counts itself
    /// out; it fails where it passes after the token was taken (`taken`).
    fn launch(g: Arc<Gate>, in_driver: Arc<AtomicU64>) -> impl FnOnce() {
        move || {
            if enter(&g.entered, &g.deadline, 10, || true) {
                in_driver.add(1);
                assert_eq!(
                    g.taken.get(),
                    0,
                    "a launch passed after the token was taken"
                );
                in_driver.sub(1);
                g.exited.add(1);
            }
        }
    }

    /// A launch beside a wait that announces the end of the token's work
    /// (`close_for_wait`): once the close returned true, no launch passes,
    /// and none was in the driver when it did.
    #[test]
    fn a_close_for_a_wait_leaves_no_launch_in_flight_or_to_come() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let g = Arc::new(Gate::default());
            let waiting = Arc::new(AtomicU64::new(0));
            g.deadline.set(100);
            // The announcing wait is in flight.
            g.entered.set(1);
            waiting.set(1);
            let in_driver = Arc::new(AtomicU64::new(0));
            let launch = loom::thread::spawn(launch(g.clone(), in_driver.clone()));
            if close_for_wait(&g.deadline, &g.entered, &g.exited, &waiting) {
                assert_eq!(in_driver.get(), 0, "closed with a launch in flight");
                g.taken.set(1);
            }
            launch.join().unwrap();
        });
    }

    /// The Stalled give-back (`withdraw_from_waits`) beside a launch and a
    /// wait that returns and another that begins: once it returned true,
    /// no launch passes, and none was in the driver when it did.
    #[test]
    fn a_stalled_give_back_leaves_no_launch_in_flight_or_to_come() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let g = Arc::new(Gate::default());
            let waiting = Arc::new(AtomicU64::new(0));
            g.deadline.set(100);
            // A wait is in flight.
            g.entered.set(1);
            waiting.set(1);
            let in_driver = Arc::new(AtomicU64::new(0));
            let launch = loom::thread::spawn(launch(g.clone(), in_driver.clone()));
            let waits = {
                let (g, waiting) = (g.clone(), waiting.clone());
                loom::thread::spawn(move || {
                    waiting.sub(1);
                    g.exited.add(1);
                    g.entered.add(1);
                    waiting.add(1);
                })
            };
            if withdraw_from_waits(&g.deadline, &g.entered, &g.exited, &waiting, || true) {
                assert_eq!(in_driver.get(), 0, "given back with a launch in flight");
                g.taken.set(1);
            }
            launch.join().unwrap();
            waits.join().unwrap();
        });
    }

    /// The end of a token that ran out (`close_and_drain`) beside two
    /// launches: once it returned true, no launch admitted under the
    /// token is still in the driver, and none passes after.
    #[test]
    fn a_token_that_ran_out_waits_for_every_launch_admitted_under_it() {
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let g = Arc::new(Gate::default());
            let waiting = Arc::new(AtomicU64::new(0));
            g.deadline.set(100);
            let in_driver = Arc::new(AtomicU64::new(0));
            let a = loom::thread::spawn(launch(g.clone(), in_driver.clone()));
            let b = loom::thread::spawn(launch(g.clone(), in_driver.clone()));
            let drained = close_and_drain(&g.deadline, &g.entered, &g.exited, &waiting, || {
                loom::thread::yield_now();
                true
            });
            if drained {
                assert_eq!(in_driver.get(), 0, "ended with a launch in the driver");
                g.taken.set(1);
            }
            a.join().unwrap();
            b.join().unwrap();
        });
    }

    /// A grant's install stores the queue bound (`quota_end`) before the
    /// deadline: a launch that sees the new deadline sees the new bound,
    /// never the last token's (the fast path's `fits` reads it after the
    /// deadline, relaxed).
    #[test]
    fn a_launch_that_sees_a_new_deadline_sees_its_queue_bound() {
        install_beside_a_launch(true);
    }

    /// Stored the other way round (the deadline, then the bound), a launch
    /// passes under the new deadline with the last token's bound.
    #[test]
    #[should_panic(expected = "the last token's bound")]
    fn storing_the_deadline_before_the_bound_lets_a_launch_see_the_old_bound() {
        install_beside_a_launch(false);
    }

    /// A launch beside an install that stores the queue bound and the
    /// deadline (`bound_first`: in that order).
    fn install_beside_a_launch(bound_first: bool) {
        use std::sync::atomic::Ordering::Relaxed;
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(move || {
            let g = Arc::new(Gate::default());
            let quota_end = Arc::new(AtomicU64::new(5));
            let launch = {
                let (g, quota_end) = (g.clone(), quota_end.clone());
                loom::thread::spawn(move || {
                    let passed = enter(&g.entered, &g.deadline, 10, || {
                        assert_eq!(quota_end.load(Relaxed), 50, "the last token's bound");
                        true
                    });
                    if passed {
                        g.exited.add(1);
                    }
                })
            };
            if bound_first {
                quota_end.store(50, Relaxed);
                g.deadline.set(100);
            } else {
                g.deadline.set(100);
                quota_end.store(50, Relaxed);
            }
            launch.join().unwrap();
        });
    }

    /// A grant asked ahead, taken either by the idle watcher (which tries
    /// the gate's lock, with the request's number read before it) or by
    /// the launch's slow path (which takes the lock and the number):
    /// installed exactly once, whichever comes first.
    #[test]
    fn a_grant_asked_ahead_is_installed_once_by_the_watcher_or_the_launch() {
        use loom::sync::Mutex;
        let mut model = loom::model::Builder::new();
        model.preemption_bound = Some(3);
        model.check(|| {
            let slow = Arc::new(Mutex::new(()));
            let seq = Arc::new(AtomicU64::new(7));
            // The scheduler's reply to request 7, waiting to be read.
            let answer = Arc::new(AtomicU64::new(7));
            let installed = Arc::new(AtomicU64::new(0));
            // Takes the answer to `s` if it is there (read once).
            let take = |answer: &AtomicU64, s: u64| {
                s != 0 && answer.compare_exchange(s, 0, SeqCst, SeqCst).is_ok()
            };
            let watcher = {
                let (slow, seq, answer, installed) =
                    (slow.clone(), seq.clone(), answer.clone(), installed.clone());
                loom::thread::spawn(move || {
                    let s = seq.get();
                    if let Ok(_slow) = slow.try_lock()
                        && take(&answer, s)
                    {
                        seq.set(0);
                        installed.add(1);
                    }
                })
            };
            {
                let _slow = slow.lock().unwrap();
                let s = seq.swap_in(0);
                if take(&answer, s) {
                    installed.add(1);
                }
            }
            watcher.join().unwrap();
            assert_eq!(
                installed.get(),
                1,
                "the grant installed {} times",
                installed.get()
            );
        });
    }

    /// The order the fast path had before: the deadline read, then the
    /// launch counted. A launch reads the old deadline, the give-back
    /// swaps it and finds nothing in flight, and the launch reaches the
    /// driver with no token.
    #[test]
    #[should_panic(expected = "a launch passed after the give-back")]
    fn reading_the_deadline_before_counting_in_lets_a_launch_through() {
        check(1, |entered, deadline, now| {
            if now < deadline.get() {
                entered.add(1);
                true
            } else {
                false
            }
        });
    }
}
