//! Who may do what, from the peer the kernel names: restricted groups,
//! the holder role, stop and reload, the pid watched, cgroup placement.
//! What the root-only daemon tests check through real users, checked here
//! for any user.

use super::*;

/// The daemon's user in these tests.
const ADMIN: u32 = 1000;

fn policy(conf: &str) -> Policy {
    Policy::new(
        Params {
            admin_uid: ADMIN,
            devices: 1,
            ..Params::default()
        },
        config(conf),
    )
}

fn peer(uid: u32, user: &str, groups: &[&str]) -> Peer {
    Peer {
        uid,
        pid: 40_000 + uid,
        user: user.into(),
        groups: groups.iter().map(|g| g.to_string()).collect(),
        cgroups: vec!["/user.slice/user-1000.slice/session-1.scope".into()],
    }
}

fn connect(p: &mut Policy, client: ClientId, peer: Peer) {
    let acts = p.handle(Event::Connected { client, peer }, 0);
    assert!(acts.is_empty(), "{acts:?}");
}

fn hello_as(p: &mut Policy, client: ClientId, role: Role, group: &str) -> Vec<Action> {
    p.handle(
        Event::Request {
            client,
            seq: 1,
            req: Request::Hello {
                role,
                group: group.into(),
                pid: 7,
                held: vec![],
                job: None,
                build: gemini_protocol::BUILD.into(),
            },
        },
        0,
    )
}

/// The one reply among `acts`.
fn only_reply(acts: &[Action]) -> Reply {
    let r = replies(acts.to_vec());
    assert_eq!(r.len(), 1, "{acts:?}");
    r[0].2.clone()
}

fn denial(r: &Reply) -> String {
    match r {
        Reply::Error(e) if e.kind == ErrorKind::PermissionDenied => e.message.clone(),
        r => panic!("not refused: {r:?}"),
    }
}

#[test]
fn a_restricted_group_admits_its_users_and_members_by_the_kernels_credentials() {
    let conf = "[open]\n[alice_only]\nAllowedUsers=alice\n[by_group]\nAllowedGroups=nogroup\n";
    let mut p = policy(conf);
    let nobody = || peer(65534, "nobody", &["nogroup"]);
    for (client, group) in [(1, "open"), (2, "by_group")] {
        connect(&mut p, client, nobody());
        let r = only_reply(&hello_as(&mut p, client, Role::Client, group));
        assert!(matches!(r, Reply::Welcome { .. }), "{group}: {r:?}");
    }
    connect(&mut p, 3, nobody());
    let m = denial(&only_reply(&hello_as(
        &mut p,
        3,
        Role::Client,
        "alice_only",
    )));
    assert!(
        m.starts_with("user nobody (uid 65534) may not run in group \"alice_only\""),
        "{m}"
    );
    assert!(
        m.contains("/etc/gemini/resource.conf line 2 allows users alice"),
        "{m}"
    );
    // A refused hello leaves nothing behind: no client, nothing watched.
    assert_eq!(p.client_group(3), None);
    // alice, the daemon's user and root get in.
    for (client, who) in [
        (4, peer(1001, "alice", &["alice"])),
        (5, peer(ADMIN, "ops", &["ops"])),
        (6, peer(0, "root", &["root"])),
    ] {
        connect(&mut p, client, who);
        let r = only_reply(&hello_as(&mut p, client, Role::Client, "alice_only"));
        assert!(matches!(r, Reply::Welcome { .. }), "client {client}: {r:?}");
    }
    // A connection the kernel did not name may not join a restricted group
    // (an open one, yes).
    let m = denial(&only_reply(&hello_as(
        &mut p,
        7,
        Role::Client,
        "alice_only",
    )));
    assert!(m.contains("cannot be verified"), "{m}");
    let r = only_reply(&hello_as(&mut p, 8, Role::Client, "open"));
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
}

#[test]
fn a_reservation_for_a_restricted_group_is_refused_to_others() {
    let mut p = policy("[alice_only]\nAllowedUsers=alice\n");
    connect(&mut p, 1, peer(65534, "nobody", &["nogroup"]));
    let r = reserve(&mut p, 1, "alice_only", GpuRequest::Count(1), false, 0);
    assert_eq!(r.len(), 1, "{r:?}");
    let m = denial(&r[0].2);
    assert!(m.contains("may not run in group \"alice_only\""), "{m}");
    connect(&mut p, 2, peer(1001, "alice", &[]));
    let r = reserve(&mut p, 2, "alice_only", GpuRequest::Count(1), false, 0);
    assert!(
        matches!(r.as_slice(), [(2, 1, Reply::Reserved { .. })]),
        "{r:?}"
    );
}

#[test]
fn only_the_daemons_user_or_root_may_stop_reload_or_act_as_the_holder() {
    let mut p = policy("[a]\n");
    let ask = |p: &mut Policy, client, req| {
        p.handle(
            Event::Request {
                client,
                seq: 9,
                req,
            },
            0,
        )
    };
    connect(&mut p, 1, peer(65534, "nobody", &[]));
    for (req, what) in [(Request::Shutdown, "stop"), (Request::Reload, "reload")] {
        let acts = ask(&mut p, 1, req);
        let m = denial(&only_reply(&acts));
        assert_eq!(
            m,
            format!("only uid {ADMIN} (the daemon's user) or root may {what} the scheduler")
        );
    }
    let m = denial(&only_reply(&hello_as(&mut p, 1, Role::Holder, "")));
    assert!(m.starts_with("uid 65534 may not act as the holder"), "{m}");
    for (client, uid) in [(2, ADMIN), (3, 0)] {
        connect(&mut p, client, peer(uid, "ops", &[]));
        assert_eq!(
            ask(&mut p, client, Request::Reload),
            vec![Action::Reload { client, seq: 9 }]
        );
        assert_eq!(
            ask(&mut p, client, Request::Shutdown),
            vec![
                Action::Reply {
                    client,
                    seq: 9,
                    reply: Reply::Done
                },
                Action::Stop
            ]
        );
    }
    let r = only_reply(&hello_as(&mut p, 2, Role::Holder, ""));
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
    // A peer the transport could not name is trusted as before.
    assert_eq!(
        ask(&mut p, 4, Request::Reload),
        vec![Action::Reload { client: 4, seq: 9 }]
    );
}

#[test]
fn the_kernels_pid_is_watched_not_the_one_claimed() {
    let mut p = policy("[a]\n");
    connect(&mut p, 1, peer(1001, "alice", &[]));
    let acts = hello_as(&mut p, 1, Role::Client, "a");
    assert_eq!(
        acts.last(),
        Some(&Action::Watch {
            client: 1,
            pid: 41_001
        })
    );
    let st = p.status(0);
    assert_eq!(
        st.clients.iter().map(|c| c.pid).collect::<Vec<_>>(),
        [41_001]
    );
    // Unverified: the claim is all there is.
    let acts = hello_as(&mut p, 2, Role::Client, "a");
    assert_eq!(acts.last(), Some(&Action::Watch { client: 2, pid: 7 }));
    // Gone: its peer is forgotten with it.
    p.handle(Event::Disconnected { client: 1 }, 1);
    assert_eq!(p.client_group(1), None);
    assert!(p.peer(1).is_none());
}

#[test]
fn a_groups_cgroups_place_its_processes_and_keep_others_out() {
    let mut p = policy(
        "[job]\nCgroups=/no/such/job;/slurm/job_5\n[open]\n[elsewhere]\nCgroups=/no/such/cgroup\n",
    );
    let in_job = || Peer {
        cgroups: vec!["/slurm/job_5/step_0".into(), "/".into()],
        ..peer(1001, "alice", &[])
    };
    connect(&mut p, 1, in_job());
    let r = only_reply(&hello_as(&mut p, 1, Role::Client, ""));
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
    assert_eq!(p.client_group(1).as_deref(), Some("job"));
    connect(&mut p, 2, in_job());
    let m = denial(&only_reply(&hello_as(&mut p, 2, Role::Client, "open")));
    assert!(
        m.contains("runs in cgroup /slurm/job_5/step_0, /")
            && m.contains("belongs to group \"job\"")
            && m.contains("resource.conf line 1"),
        "{m}"
    );
    // Outside every group's cgroups.
    connect(&mut p, 3, peer(1001, "alice", &[]));
    let m = denial(&only_reply(&hello_as(&mut p, 3, Role::Client, "elsewhere")));
    assert!(m.contains("takes only the processes of its cgroups"), "{m}");
    match only_reply(&hello_as(&mut p, 3, Role::Client, "")) {
        Reply::Error(e) => {
            assert_eq!(e.kind, ErrorKind::UnknownGroup);
            assert!(
                e.message.contains("GEMINI_GROUP_NAME is not set"),
                "{}",
                e.message
            );
        }
        r => panic!("{r:?}"),
    }
    let r = only_reply(&hello_as(&mut p, 3, Role::Client, "open"));
    assert!(matches!(r, Reply::Welcome { .. }), "{r:?}");
}
