//! Short versions of the fault and load runs (`make soak` runs the long
//! ones): random SIGKILLs of hooked processes and a scheduler crash leave
//! the accounting exact; many concurrent clients lose no reply.

use gemini_tests::soak::{chaos, load};
use std::time::Duration;

#[test]
fn random_kills_and_a_scheduler_crash_leave_the_accounting_exact() {
    let r = chaos(Duration::from_secs(8), 42);
    assert!(r.killed >= 5, "{r:?}");
    assert_eq!(r.scheduler_restarts, 1);
    assert!(r.mismatches.is_empty(), "{r:?}");
}

#[test]
fn many_concurrent_clients_lose_no_reply() {
    let r = load(Duration::from_secs(3), 64);
    assert!(r.requests > 1000, "{r:?}");
    assert_eq!(r.lost, 0, "{r:?}");
}
