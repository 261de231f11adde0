//! What a reload changes, for the log.

use super::*;

/// One difference between two configurations, for the reload log.
#[derive(Debug, Clone, PartialEq)]
pub enum Change {
    /// A new group.
    Added(String),
    /// A group that is gone (its running clients keep their old limits
    /// until they leave, but no new client may join it).
    Removed(String),
    /// A setting of a group changed.
    Modified {
        /// The group.
        group: String,
        /// The key.
        key: &'static str,
        /// Old value, formatted.
        old: String,
        /// New value, formatted.
        new: String,
    },
}

impl fmt::Display for Change {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Change::Added(g) => write!(f, "[{g}] added"),
            Change::Removed(g) => write!(f, "[{g}] removed"),
            Change::Modified {
                group,
                key,
                old,
                new,
            } => write!(f, "[{group}] {key}: {old} -> {new}"),
        }
    }
}

/// What changed from `old` to `new`.
pub fn diff(old: &ResourceConfig, new: &ResourceConfig) -> Vec<Change> {
    let mut out = Vec::new();
    for (name, n) in &new.groups {
        let Some(o) = old.groups.get(name) else {
            out.push(Change::Added(name.clone()));
            continue;
        };
        let mut field = |key, a: String, b: String| {
            if a != b {
                out.push(Change::Modified {
                    group: name.clone(),
                    key,
                    old: a,
                    new: b,
                });
            }
        };
        field(MIN_UTIL, o.min_util.to_string(), n.min_util.to_string());
        field(MAX_UTIL, o.max_util.to_string(), n.max_util.to_string());
        field(
            MEMORY_LIMIT,
            format_size(o.memory_limit),
            format_size(n.memory_limit),
        );
        let gpus = |d: &Option<Vec<u32>>| {
            d.as_ref().map_or("all".to_string(), |v| {
                v.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
            })
        };
        field(DEVICES, gpus(&o.devices), gpus(&n.devices));
        field(LATENCY, o.latency.to_string(), n.latency.to_string());
    }
    for name in old.groups.keys() {
        if !new.groups.contains_key(name) {
            out.push(Change::Removed(name.clone()));
        }
    }
    out
}
