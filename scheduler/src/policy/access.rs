//! Who may do what. A connection's peer, as the kernel names it (the
//! daemon looks it up once, [`Event::Connected`](super::Event::Connected)),
//! is checked here against the groups' `AllowedUsers`, `AllowedGroups` and
//! `Cgroups`, the holder role and the administrative requests. A
//! connection whose peer the transport could not name reaches the policy
//! only where the daemon serves unverified peers (`allow_unverified_peers`,
//! for tests): it may then join open groups, act as the holder, stop and
//! reload, but not join a restricted group.

use super::{Policy, error};
use gemini_config::GroupConfig;
use gemini_protocol::{ClientId, ErrorKind, Reply, Role};

/// A connection's peer, from the kernel (`SO_PEERCRED`) and the system's
/// databases.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Peer {
    /// User id.
    pub uid: u32,
    /// Process id.
    pub pid: u32,
    /// User name (the uid as text where the user database has none).
    pub user: String,
    /// The user's Unix groups, by name.
    pub groups: Vec<String>,
    /// The process's cgroups, one per hierarchy, the unified one first.
    pub cgroups: Vec<String>,
}

/// Who a restricted group lets in, for messages.
fn describe_allowed(cfg: &GroupConfig) -> String {
    let mut parts = Vec::new();
    if let Some(u) = &cfg.allowed_users {
        parts.push(format!("users {}", u.join(", ")));
    }
    if let Some(g) = &cfg.allowed_groups {
        parts.push(format!("members of {}", g.join(", ")));
    }
    parts.join(" and ")
}

fn denied(message: String) -> Reply {
    error(ErrorKind::PermissionDenied, message)
}

impl Policy {
    /// The verified peer of `client`, if the transport named it.
    pub(super) fn peer(&self, client: ClientId) -> Option<&Peer> {
        self.peers.get(&client)
    }

    /// The user name of `client`'s peer, if the transport named it.
    pub fn peer_user(&self, client: ClientId) -> Option<String> {
        self.peer(client).map(|p| p.user.clone())
    }

    /// `client`'s peer if it is a user other than root and the daemon's:
    /// one held to the site's limits (reservations).
    pub(super) fn limited_peer(&self, client: ClientId) -> Option<&Peer> {
        self.peer(client).filter(|p| !self.trusted(p))
    }

    /// The daemon's user or root.
    pub(super) fn trusted(&self, peer: &Peer) -> bool {
        peer.uid == 0 || peer.uid == self.params.admin_uid
    }

    /// Refuses an administrative request (`what`: stop, reload) from
    /// anyone but the daemon's user or root.
    pub(super) fn refuse_admin(&self, client: ClientId, what: &str) -> Option<Reply> {
        let peer = self.peer(client)?;
        (!self.trusted(peer)).then(|| {
            denied(format!(
                "only uid {} (the daemon's user) or root may {what} the scheduler",
                self.params.admin_uid
            ))
        })
    }

    /// Refuses `client` joining `group` (its `AllowedUsers` and
    /// `AllowedGroups`) or acting as the holder (the daemon's user or root
    /// only).
    pub(super) fn refuse_access(&self, client: ClientId, role: Role, group: &str) -> Option<Reply> {
        let peer = self.peer(client);
        if role == Role::Holder {
            let p = peer.filter(|p| !self.trusted(p))?;
            return Some(denied(format!(
                "uid {} may not act as the holder: only the scheduler's user (uid {}) or root",
                p.uid, self.params.admin_uid
            )));
        }
        let cfg = self
            .config
            .group(group)
            .filter(|c| c.allowed_users.is_some() || c.allowed_groups.is_some())?;
        match peer {
            None => Some(denied(format!(
                "group {group:?} is restricted and this connection's user cannot be verified"
            ))),
            Some(p) if self.trusted(p) || cfg.admits(&p.user, &p.groups) => None,
            Some(p) => Some(denied(format!(
                "user {} (uid {}) may not run in group {group:?}: {} allows {}",
                p.user,
                p.uid,
                cfg.defined_at(),
                describe_allowed(cfg)
            ))),
        }
    }

    /// The group a client process of `pid` belongs to, asking for `asked`
    /// (empty: none named). A process in a cgroup that a group's `Cgroups`
    /// lists (or below one) belongs to that group (the longest match) and
    /// may join no other; a group with `Cgroups` takes no process outside
    /// them. The cgroups are the kernel's, so a job cannot claim another's
    /// group.
    pub(super) fn place(&self, client: ClientId, pid: u32, asked: &str) -> Result<String, Reply> {
        let config = &self.config;
        let cgroups: &[String] = self.peer(client).map_or(&[], |p| &p.cgroups);
        let home = config
            .groups
            .values()
            .filter_map(|g| {
                let n = cgroups.iter().filter_map(|cg| g.cgroup_match(cg)).max()?;
                Some((n, g))
            })
            .max_by_key(|(n, _)| *n)
            .map(|(_, g)| g);
        let cg = if cgroups.is_empty() {
            "(unknown)".to_string()
        } else {
            cgroups.join(", ")
        };
        match (home, config.group(asked)) {
            (Some(h), _) if asked.is_empty() || asked == h.name => Ok(h.name.clone()),
            (Some(h), _) => Err(denied(format!(
                "pid {pid} runs in cgroup {cg}, which belongs to group {:?} ({}): it may not join group {asked:?} (unset GEMINI_GROUP_NAME, or set it to {:?})",
                h.name,
                h.defined_at(),
                h.name
            ))),
            (None, Some(g)) if g.cgroups.is_some() => Err(denied(format!(
                "group {asked:?} ({}) takes only the processes of its cgroups; pid {pid} runs in cgroup {cg}",
                g.defined_at()
            ))),
            (None, _) if asked.is_empty() => Err(error(
                ErrorKind::UnknownGroup,
                format!(
                    "GEMINI_GROUP_NAME is not set, and pid {pid} (cgroup {cg}) is in no group's Cgroups in {}: set GEMINI_GROUP_NAME to a group (see `gem-schd status`)",
                    config.path.display()
                ),
            )),
            (None, _) => Ok(asked.to_string()),
        }
    }
}
