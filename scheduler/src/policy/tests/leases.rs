//! Memory leases: bounded, counted against the group's limit, recalled
//! before a group-mate is refused, and never a way to free another
//! process's memory.

use super::*;
use crate::policy::memory::{LEASE_MAX, LEASE_TTL, RECALL_LATE_MAX, RECALL_SLACK, RECALL_STEP};

const MIB: u64 = 1 << 20;

/// `client`'s reservation of `bytes` on device 0 at `now`, giving back
/// `returned` of its lease and asking to lease as much as it may.
fn lease(p: &mut Policy, client: ClientId, bytes: u64, returned: u64, now: Micros) -> Reply {
    let req = Request::ReserveLeased {
        device: 0,
        bytes,
        returned,
        lease: u64::MAX,
    };
    match send(p, client, req, now).pop() {
        Some((_, _, reply)) => reply,
        None => panic!("no reply"),
    }
}

/// The group's memory reserved on device 0, as `client` sees it.
fn used(p: &mut Policy, client: ClientId) -> u64 {
    match ask(p, client, Request::MemoryInfo { device: 0 }) {
        Reply::MemoryView { used, .. } => used,
        other => panic!("{other:?}"),
    }
}

/// Clients 1 and 2, processes of group a (MemoryLimit 1 GiB).
fn two_processes_of_a() -> Policy {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=1GiB\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "a");
    p
}

#[test]
fn a_lease_is_bounded_and_counted_against_the_groups_limit() {
    let mut p = Policy::new(Params::default(), config("[a]\nMemoryLimit=1GiB\n[b]\n"));
    hello(&mut p, 1, "a");
    hello(&mut p, 2, "b");
    assert_eq!(
        lease(&mut p, 1, MIB, 0, 0),
        Reply::Leased {
            device: 0,
            used: MIB + LEASE_MAX,
            limit: 1 << 30,
            lease: LEASE_MAX,
            ttl_us: LEASE_TTL,
        }
    );
    assert_eq!(used(&mut p, 1), MIB + LEASE_MAX);
    // Near the limit, at most half of what is left: 1 GiB - 65 MiB -
    // 900 MiB = 59 MiB, of which 29.5 MiB.
    let Reply::Leased {
        lease: got, used, ..
    } = lease(&mut p, 1, 900 * MIB, 0, 10)
    else {
        panic!("refused");
    };
    assert_eq!(got, (1024 - 65 - 900) * MIB / 2);
    assert!(used <= 1 << 30, "{used}");
    // A group without a limit leases LEASE_MAX at most too.
    let Reply::Leased { lease: got, .. } = lease(&mut p, 2, MIB, 0, 0) else {
        panic!("refused");
    };
    assert_eq!(got, LEASE_MAX);
}

#[test]
fn a_group_short_of_memory_recalls_its_other_processes_leases_before_refusing() {
    let mut p = two_processes_of_a();
    assert!(matches!(
        lease(&mut p, 1, MIB, 0, 0),
        Reply::Leased {
            lease: LEASE_MAX,
            ..
        }
    ));
    // 65 MiB reserved, of which 64 leased: 1000 MiB fits once the lease
    // is back. Client 2 is told when that is due.
    let r = lease(&mut p, 2, 1000 * MIB, 0, 1_000);
    let Reply::Recalled { retry_us, .. } = r else {
        panic!("{r:?}");
    };
    assert_eq!(retry_us, LEASE_TTL + RECALL_SLACK - 1_000);
    // Meanwhile client 1's renewal gets no lease.
    let r = lease(&mut p, 1, MIB, LEASE_MAX, 2_000);
    assert!(matches!(r, Reply::Leased { lease: 0, .. }), "{r:?}");
    assert_eq!(used(&mut p, 1), 2 * MIB);
    // Client 2 asks again: it fits.
    let r = lease(&mut p, 2, 1000 * MIB, 0, 3_000);
    assert!(matches!(r, Reply::Leased { .. }), "{r:?}");
    assert!(used(&mut p, 1) <= 1 << 30);
    // Past the limit even without leases: refused at once.
    let r = lease(&mut p, 2, 100 * MIB, 0, 4_000);
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory), "{r:?}");
}

/// A lease later than due (its process was not scheduled, or is
/// stopped) is waited for in short steps: refusing then would refuse a
/// group with room.
#[test]
fn a_late_lease_is_waited_for_in_short_steps() {
    let mut p = two_processes_of_a();
    assert!(matches!(lease(&mut p, 1, MIB, 0, 0), Reply::Leased { .. }));
    let late = LEASE_TTL + RECALL_SLACK + 10_000;
    let r = lease(&mut p, 2, 1000 * MIB, 0, late);
    assert!(
        matches!(r, Reply::Recalled { retry_us, .. } if retry_us == RECALL_STEP),
        "{r:?}"
    );
    // Later than RECALL_LATE_MAX: its process is stopped; what it leased
    // may be allocated, and the asker is refused, not kept waiting.
    let stopped = LEASE_TTL + RECALL_SLACK + RECALL_LATE_MAX;
    let r = lease(&mut p, 2, 1000 * MIB, 0, stopped);
    assert_eq!(kind(&r), Some(ErrorKind::OutOfMemory), "{r:?}");
    // Given back late, it makes room.
    let r = ask(
        &mut p,
        1,
        Request::ReturnLease {
            device: 0,
            bytes: LEASE_MAX,
        },
    );
    assert!(
        matches!(r, Reply::Memory { used, .. } if used == MIB),
        "{r:?}"
    );
    let r = lease(&mut p, 2, 1000 * MIB, 0, stopped + RECALL_STEP);
    assert!(matches!(r, Reply::Leased { .. }), "{r:?}");
}

#[test]
fn a_process_gives_back_only_what_it_holds() {
    let mut p = two_processes_of_a();
    assert!(matches!(
        lease(&mut p, 2, 500 * MIB, 0, 0),
        Reply::Leased { .. }
    ));
    let mate = used(&mut p, 2);
    // Client 1 holds nothing: what it says it gives back frees none of
    // client 2's memory.
    assert!(matches!(
        lease(&mut p, 1, MIB, u64::MAX, 0),
        Reply::Leased { .. }
    ));
    let mine = used(&mut p, 1) - mate;
    let r = ask(
        &mut p,
        1,
        Request::ReturnLease {
            device: 0,
            bytes: u64::MAX,
        },
    );
    assert!(
        matches!(r, Reply::Memory { used, .. } if used == mate),
        "{r:?}"
    );
    assert!(mine > 0);
}

#[test]
fn only_client_processes_lease() {
    let mut p = Policy::new(Params::default(), config("[a]\n"));
    hello_holder(&mut p, 50);
    let r = lease(&mut p, 50, MIB, 0, 0);
    assert!(
        matches!(
            r,
            Reply::Leased {
                lease: 0,
                ttl_us: 0,
                ..
            }
        ),
        "{r:?}"
    );
    control(&mut p, 60);
    let r = lease(&mut p, 60, MIB, 0, 0);
    assert_eq!(kind(&r), Some(ErrorKind::Unexpected), "{r:?}");
}

/// A group-mate renewing its lease all the time (a loop of allocations)
/// does not take a new one between the end of the recall's wait and the
/// asker's return: the recall holds until the asker is served.
#[test]
fn a_recall_holds_until_the_asker_is_served() {
    let mut p = two_processes_of_a();
    assert!(matches!(
        lease(&mut p, 1, MIB, 0, 0),
        Reply::Leased {
            lease: LEASE_MAX,
            ..
        }
    ));
    let Reply::Recalled { retry_us, .. } = lease(&mut p, 2, 1000 * MIB, 0, 0) else {
        panic!("not recalled");
    };
    // Client 1 renews just after the wait's end, before client 2 asks.
    let due = retry_us;
    let r = lease(&mut p, 1, MIB, LEASE_MAX, due + 1);
    assert!(matches!(r, Reply::Leased { lease: 0, .. }), "{r:?}");
    let r = lease(&mut p, 2, 1000 * MIB, 0, due + 2);
    assert!(matches!(r, Reply::Leased { .. }), "{r:?}");
    // Served: the group's leases are granted again (within what is left).
    let r = lease(&mut p, 1, 0, 0, due + 3);
    assert!(
        matches!(r, Reply::Leased { lease, .. } if lease > 0),
        "{r:?}"
    );
}
