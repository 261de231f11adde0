//! `resource.conf`: one `[group]` section per client group.
//!
//! ```ini
//! [train]
//! MinUtil=0.3      # guaranteed share of device time, 0..1 (default 0)
//! MaxUtil=0.8      # ceiling, 0..1 (default 1)
//! MemoryLimit=8GiB # per device, all processes of the group (default: unlimited)
//! Devices=0,2      # only these GPUs, numbered as nvidia-smi does (default all)
//! Latency=critical # served first when it asks (default normal)
//! ```
//!
//! The file is parsed by glib's `KeyFile` (XDG Desktop Entry syntax). glib
//! reports no line numbers and keeps a trailing `# comment` in the value,
//! so this module also scans the text itself: to strip such comments and
//! to point every message at its line.

use crate::{format_size, parse_size};
use glib::{KeyFile, KeyFileFlags};
use std::collections::BTreeMap;
use std::fmt;
use std::path::{Path, PathBuf};

/// Key for the guaranteed share.
pub const MIN_UTIL: &str = "MinUtil";
/// Key for the share ceiling.
pub const MAX_UTIL: &str = "MaxUtil";
/// Key for the memory cap.
pub const MEMORY_LIMIT: &str = "MemoryLimit";
/// Key for the users allowed in a group.
pub const ALLOWED_USERS: &str = "AllowedUsers";
/// Key for the Unix groups allowed in a group.
pub const ALLOWED_GROUPS: &str = "AllowedGroups";
/// Key for the cgroups whose processes belong to a group.
pub const CGROUPS: &str = "Cgroups";
/// Key for the GPUs a group may use.
pub const DEVICES: &str = "Devices";
/// Key for the latency class.
pub const LATENCY: &str = "Latency";
/// Keys this version understands.
pub const KNOWN_KEYS: [&str; 8] = [
    MIN_UTIL,
    MAX_UTIL,
    MEMORY_LIMIT,
    ALLOWED_USERS,
    ALLOWED_GROUPS,
    CGROUPS,
    DEVICES,
    LATENCY,
];

/// A group's latency class (`Latency`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Latency {
    /// Shares only: a waiting group is ranked by how much of its share it
    /// had (the default).
    #[default]
    Normal,
    /// An inference server, a notebook: served first whenever it asks,
    /// within the share it can take without breaking another group's
    /// `MinUtil`; while it is active, other groups get short tokens, so
    /// that it never waits long behind their queued work.
    Critical,
}

impl fmt::Display for Latency {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Latency::Normal => "normal",
            Latency::Critical => "critical",
        })
    }
}
/// Where a size is written with a unit in powers of 10 (`4gb`, `4G`,
/// `512MB`: what GPU memory is seldom meant in), the same number in the
/// unit of powers of 2 (`4GiB`), to suggest; `None` otherwise.
fn decimal_size(text: &str) -> Option<String> {
    let t = text.trim();
    let digits = t.trim_end_matches(|c: char| c.is_ascii_alphabetic()).trim();
    let unit = t[digits.len()..].trim().to_ascii_lowercase();
    let binary = match unit.as_str() {
        "k" | "kb" => "KiB",
        "m" | "mb" => "MiB",
        "g" | "gb" => "GiB",
        "t" | "tb" => "TiB",
        _ => return None,
    };
    Some(format!("{digits}{binary}"))
}

/// `MemoryLimit` when the key is absent: unlimited, so the group may use
/// the GPU's whole memory, which is what a user who sets nothing expects
/// (a fixed default was a trap: 1 GiB left a PyTorch job on a 141 GiB
/// H200 half a gigabyte beside its 518 MiB context).
pub const DEFAULT_MEMORY_LIMIT: u64 = u64::MAX;
/// Tolerance for the sum of `MinUtil` (decimal fractions do not add up
/// exactly in binary floating point).
const SUM_EPSILON: f64 = 1e-9;

/// One validated group.
#[derive(Debug, Clone, PartialEq)]
pub struct GroupConfig {
    /// Section name.
    pub name: String,
    /// Guaranteed share of each device's time, 0..=1.
    pub min_util: f64,
    /// Ceiling on the share of each device's time, min_util..=1.
    pub max_util: f64,
    /// Bytes per device, summed over the group's processes.
    pub memory_limit: u64,
    /// The file that defines it (`resource.conf` or a drop-in file).
    pub file: PathBuf,
    /// Line of the section header.
    pub line: usize,
    /// `AllowedUsers`: user names that may run in the group (`None`: no
    /// restriction by user).
    pub allowed_users: Option<Vec<String>>,
    /// `AllowedGroups`: Unix groups whose members may run in the group
    /// (`None`: no restriction by Unix group).
    pub allowed_groups: Option<Vec<String>>,
    /// `Cgroups`: cgroup paths (as `/proc/PID/cgroup` shows them, e.g.
    /// Slurm's `/system.slice/slurmstepd.scope/job_42`) whose processes,
    /// and those of the cgroups below, belong to this group and to no
    /// other; `None`: membership is by name.
    pub cgroups: Option<Vec<String>>,
    /// `Devices`: the GPUs (the machine's indices, as nvidia-smi numbers
    /// them) the group may use, in order; `MinUtil` is then guaranteed on
    /// those only and counts against theirs alone. `None`: every GPU.
    pub devices: Option<Vec<u32>>,
    /// `Latency`: the group's latency class.
    pub latency: Latency,
}

impl GroupConfig {
    /// Where the group is defined, for messages: `FILE line N`.
    pub fn defined_at(&self) -> String {
        format!("{} line {}", self.file.display(), self.line)
    }

    /// Whether the group may use GPU `device`.
    pub fn uses(&self, device: u32) -> bool {
        self.devices.as_ref().is_none_or(|d| d.contains(&device))
    }

    /// The length of the longest of this group's cgroups that `cgroup`
    /// is (or is below); `None`: none, or the group has none.
    pub fn cgroup_match(&self, cgroup: &str) -> Option<usize> {
        self.cgroups
            .as_ref()?
            .iter()
            .filter(|c| {
                let c = c.trim_end_matches('/');
                c.is_empty()
                    || cgroup == c
                    || cgroup
                        .strip_prefix(c)
                        .is_some_and(|rest| rest.starts_with('/'))
            })
            .map(String::len)
            .max()
    }

    /// Whether a user may join: unrestricted groups admit everyone; a
    /// restricted one admits the users listed and the members of the Unix
    /// groups listed.
    pub fn admits(&self, user: &str, unix_groups: &[String]) -> bool {
        if self.allowed_users.is_none() && self.allowed_groups.is_none() {
            return true;
        }
        self.allowed_users
            .as_ref()
            .is_some_and(|u| u.iter().any(|x| x == user))
            || self
                .allowed_groups
                .as_ref()
                .is_some_and(|g| g.iter().any(|x| unix_groups.contains(x)))
    }
}

/// A validated `resource.conf`.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ResourceConfig {
    /// Where it was read from (for messages).
    pub path: PathBuf,
    /// Groups by name.
    pub groups: BTreeMap<String, GroupConfig>,
}

impl ResourceConfig {
    /// The group called `name`.
    pub fn group(&self, name: &str) -> Option<&GroupConfig> {
        self.groups.get(name)
    }

    /// The groups' `Devices` that name a GPU this machine does not have
    /// (`gpus`: the indices it has, as NVML numbers them): one line each,
    /// with where the group is defined. Such a group could never run on
    /// that GPU; `gem-schd check` refuses the file.
    pub fn devices_missing(&self, gpus: &[u32]) -> Vec<String> {
        let mut out = Vec::new();
        for g in self.groups.values() {
            let Some(devices) = &g.devices else { continue };
            let missing: Vec<String> = devices
                .iter()
                .filter(|d| !gpus.contains(d))
                .map(u32::to_string)
                .collect();
            if missing.is_empty() {
                continue;
            }
            let listed: Vec<String> = devices.iter().map(u32::to_string).collect();
            let mut have: Vec<u32> = gpus.to_vec();
            have.sort_unstable();
            let have: Vec<String> = have.iter().map(u32::to_string).collect();
            out.push(format!(
                "{}: [{}] Devices={}: there is no GPU {} here; this machine has {} GPU(s): {}",
                g.defined_at(),
                g.name,
                listed.join(","),
                missing.join(", "),
                have.len(),
                have.join(", ")
            ));
        }
        out
    }

    /// Latency-critical groups with no room on a GPU they may use: no
    /// `MinUtil` of their own while the other groups there have `MinUtil`
    /// adding up to 1, so that they get only what those leave (1-2 % of a
    /// busy GPU). One warning line each; `gpus`: the machine's GPU
    /// indices (empty: not known, and `Devices` lists are compared as
    /// given).
    pub fn latency_without_room(&self, gpus: &[u32]) -> Vec<String> {
        let mut out = Vec::new();
        for c in self.groups.values() {
            if c.latency != Latency::Critical || c.min_util > 0.0 {
                continue;
            }
            // The GPUs it may use; where neither it nor the machine says
            // which, every GPU a group names, and one for the rest.
            let devices: Vec<Option<u32>> = match (&c.devices, gpus) {
                (Some(d), _) => d.iter().copied().map(Some).collect(),
                (None, []) => {
                    let mut named: Vec<u32> = self
                        .groups
                        .values()
                        .filter_map(|g| g.devices.clone())
                        .flatten()
                        .collect();
                    named.sort_unstable();
                    named.dedup();
                    named.into_iter().map(Some).chain([None]).collect()
                }
                (None, g) => g.iter().copied().map(Some).collect(),
            };
            for d in devices {
                // `None`: a GPU no group names, which only the groups
                // without `Devices` use.
                let others: Vec<&GroupConfig> = self
                    .groups
                    .values()
                    .filter(|g| g.name != c.name && d.map_or(g.devices.is_none(), |d| g.uses(d)))
                    .filter(|g| g.min_util > 0.0)
                    .collect();
                let sum: f64 = others.iter().map(|g| g.min_util).sum();
                if sum < 1.0 - SUM_EPSILON {
                    continue;
                }
                let names: Vec<String> = others.iter().map(|g| format!("[{}]", g.name)).collect();
                let on = d.map_or("its GPUs".to_string(), |d| format!("GPU {d}"));
                out.push(format!(
                    "warning: {}: [{}] Latency=critical has no room on {on}: the MinUtil of {} add up to 1, so it gets only what they leave; give it a MinUtil (and lower theirs)",
                    c.defined_at(),
                    c.name,
                    names.join(", ")
                ));
                break;
            }
        }
        out
    }

    /// One line of every setting of group `g`, defaults included, for
    /// `gem-schd check`'s summary.
    pub fn summary(g: &GroupConfig) -> String {
        let list = |v: &Option<Vec<String>>, none: &str| {
            v.as_ref().map_or(none.to_string(), |v| v.join(","))
        };
        let devices = g.devices.as_ref().map_or("all".to_string(), |d| {
            d.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
        });
        format!(
            "[{}] MinUtil={} MaxUtil={} MemoryLimit={} Latency={} Devices={} AllowedUsers={} AllowedGroups={} Cgroups={}",
            g.name,
            g.min_util,
            g.max_util,
            if g.memory_limit == DEFAULT_MEMORY_LIMIT {
                "unlimited".to_string()
            } else {
                format_size(g.memory_limit)
            },
            g.latency,
            devices,
            list(&g.allowed_users, "(anyone)"),
            list(&g.allowed_groups, "(any)"),
            list(&g.cgroups, "(by name)"),
        )
    }

    /// Where the `MemoryLimit`s of the groups that may use a GPU add up to
    /// more than it has, one line per such GPU (`gpus`: each GPU's index
    /// and memory in bytes). Not an error: groups rarely all use their
    /// limit at once, but then the later ones get out-of-memory errors
    /// under their limit, from the driver. Groups without a limit are
    /// left out (they may take whatever is free); a lone group's limit
    /// past the GPU is named too.
    pub fn memory_overcommit(&self, gpus: &[(u32, u64)]) -> Vec<String> {
        let mut out = Vec::new();
        for &(index, total) in gpus {
            let limited: Vec<&GroupConfig> = self
                .groups
                .values()
                .filter(|g| g.uses(index) && g.memory_limit != DEFAULT_MEMORY_LIMIT)
                .collect();
            let sum = limited
                .iter()
                .fold(0u64, |a, g| a.saturating_add(g.memory_limit));
            if sum <= total {
                continue;
            }
            if let [g] = limited[..] {
                out.push(format!(
                    "warning: GPU {index} has {}, less than the MemoryLimit of [{}] ({})",
                    format_size(total),
                    g.name,
                    format_size(g.memory_limit)
                ));
                continue;
            }
            let each: Vec<String> = limited
                .iter()
                .map(|g| format!("[{}] {}", g.name, format_size(g.memory_limit)))
                .collect();
            out.push(format!(
                "warning: GPU {index} has {}, and the MemoryLimit of the groups that may use it add up to {} ({}): they cannot all have their limit at once",
                format_size(total),
                format_size(sum),
                each.join(", ")
            ));
        }
        out
    }
}

/// Where in the file a message points.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Location {
    /// The file.
    pub file: PathBuf,
    /// 1-based line, when known.
    pub line: Option<usize>,
    /// The `[group]`, when the message concerns one.
    pub group: Option<String>,
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.file.display())?;
        if let Some(l) = self.line {
            write!(f, ":{l}")?;
        }
        if let Some(g) = &self.group {
            write!(f, ": [{g}]")?;
        }
        Ok(())
    }
}

/// An error that makes the file unusable.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{at}: {message}")]
pub struct ConfigError {
    /// Where.
    pub at: Location,
    /// What was found and what was expected.
    pub message: String,
}

/// All errors found in one file, in line order.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, e) in self.0.iter().enumerate() {
            if i > 0 {
                writeln!(f)?;
            }
            write!(f, "{e}")?;
        }
        Ok(())
    }
}

/// Something suspicious that does not stop the file from being used.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Warning {
    /// Where.
    pub at: Location,
    /// What.
    pub message: String,
}

impl fmt::Display for Warning {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: warning: {}", self.at, self.message)
    }
}

/// Reads and validates `path`.
pub fn load_resource(path: &Path) -> Result<(ResourceConfig, Vec<Warning>), ConfigErrors> {
    load_resource_as(path, nix::unistd::geteuid().as_raw())
}

/// The drop-in directory of `path`: `resource.conf.d` beside
/// `resource.conf`. Every `*.conf` file in it adds groups.
pub fn drop_in_dir(path: &Path) -> PathBuf {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".d");
    path.with_file_name(name)
}

/// [`load_resource`] for a daemon running as `owner`: a drop-in file is
/// accepted only if root or `owner` owns it (and the link to it, if it is
/// one), since whoever writes one decides a group's share.
pub fn load_resource_as(
    path: &Path,
    owner: u32,
) -> Result<(ResourceConfig, Vec<Warning>), ConfigErrors> {
    let unreadable = |file: &Path, e: std::io::Error| ConfigError {
        at: Location {
            file: file.to_path_buf(),
            line: None,
            group: None,
        },
        message: format!("cannot read the file: {e}"),
    };
    let text =
        std::fs::read_to_string(path).map_err(|e| ConfigErrors(vec![unreadable(path, e)]))?;
    let mut files = vec![(path.to_path_buf(), text)];
    let mut errors = Vec::new();
    let dir = drop_in_dir(path);
    let mut drop_ins: Vec<PathBuf> = match std::fs::read_dir(&dir) {
        Ok(entries) => entries
            .filter_map(Result::ok)
            .map(|e| e.path())
            .filter(|p| p.extension().is_some_and(|x| x == "conf"))
            .collect(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Vec::new(),
        Err(e) => {
            errors.push(unreadable(&dir, e));
            Vec::new()
        }
    };
    drop_ins.sort();
    for file in drop_ins {
        if let Some(uid) = foreign_owner(&file, owner) {
            errors.push(ConfigError {
                at: Location {
                    file: file.clone(),
                    line: None,
                    group: None,
                },
                message: format!(
                    "owned by uid {uid}: a drop-in file must belong to root or to the scheduler's user (uid {owner}), since it decides a group's share"
                ),
            });
            continue;
        }
        match std::fs::read_to_string(&file) {
            Ok(text) => files.push((file, text)),
            Err(e) => errors.push(unreadable(&file, e)),
        }
    }
    let mut warnings = Vec::new();
    let mut groups: BTreeMap<String, GroupConfig> = BTreeMap::new();
    for (file, text) in &files {
        match parse_groups(text, file) {
            Ok((gs, ws)) => {
                warnings.extend(ws);
                for (name, g) in gs {
                    if let Some(first) = groups.get(&name) {
                        errors.push(ConfigError {
                            at: Location {
                                file: file.clone(),
                                line: Some(g.line),
                                group: Some(name.clone()),
                            },
                            message: format!(
                                "group [{name}] is already defined in {} line {}; each group is defined in one file",
                                first.file.display(),
                                first.line
                            ),
                        });
                        continue;
                    }
                    groups.insert(name, g);
                }
            }
            Err(e) => errors.extend(e.0),
        }
    }
    finish(groups, warnings, errors, path)
}

/// The owner of `file` (or of the link to it) when it is neither root nor
/// `owner`.
fn foreign_owner(file: &Path, owner: u32) -> Option<u32> {
    use std::os::unix::fs::MetadataExt;
    let ok = |uid: u32| uid == 0 || uid == owner;
    for m in [std::fs::symlink_metadata(file), std::fs::metadata(file)]
        .into_iter()
        .flatten()
    {
        if !ok(m.uid()) {
            return Some(m.uid());
        }
    }
    None
}

/// Parses and validates the text of a `resource.conf` read from `file`
/// (used in messages only).
pub fn parse_resource(
    text: &str,
    file: &Path,
) -> Result<(ResourceConfig, Vec<Warning>), ConfigErrors> {
    let (groups, warnings) = parse_groups(text, file)?;
    finish(groups, warnings, Vec::new(), file)
}

/// The groups of one file, validated one by one (what concerns all
/// groups together is [`finish`]'s).
#[allow(clippy::type_complexity)]
fn parse_groups(
    text: &str,
    file: &Path,
) -> Result<(BTreeMap<String, GroupConfig>, Vec<Warning>), ConfigErrors> {
    let (raw, idx) = parse_raw(text, file)?;
    let at = |line: usize, group: &str| Location {
        file: file.to_path_buf(),
        line: (line > 0).then_some(line),
        group: Some(group.to_string()),
    };
    let mut errors = Vec::new();
    let mut warnings = Vec::new();
    for (name, lines) in &idx.groups {
        if lines.len() > 1 {
            warnings.push(Warning {
                at: at(lines[1], name),
                message: format!(
                    "section also starts at line {}; the two are merged and later keys win",
                    lines[0]
                ),
            });
        }
    }
    for ((group, key), lines) in &idx.keys {
        if lines.len() > 1 {
            warnings.push(Warning {
                at: at(lines[lines.len() - 1], group),
                message: format!("`{key}` is set more than once; this last value wins"),
            });
        }
    }
    let mut groups = BTreeMap::new();
    for g in raw {
        let mut cfg = GroupConfig {
            name: g.name.clone(),
            min_util: 0.0,
            max_util: 1.0,
            memory_limit: DEFAULT_MEMORY_LIMIT,
            file: file.to_path_buf(),
            line: g.line,
            allowed_users: None,
            allowed_groups: None,
            cgroups: None,
            devices: None,
            latency: Latency::Normal,
        };
        let mut min_line = g.line;
        // Whether MinUtil and MaxUtil are usable (absent or valid): their
        // order is checked whatever else in the group is wrong, so every
        // error is reported at once.
        let (mut min_ok, mut max_ok) = (true, true);
        let mut memory_line = None;
        for e in &g.entries {
            let result = match e.key.as_str() {
                MIN_UTIL => parse_util(&e.value)
                    .map(|v| {
                        cfg.min_util = v;
                        min_line = e.line;
                    })
                    .inspect_err(|_| min_ok = false),
                MAX_UTIL => parse_util(&e.value)
                    .map(|v| cfg.max_util = v)
                    .inspect_err(|_| max_ok = false),
                MEMORY_LIMIT => parse_size(&e.value).map(|v| {
                    cfg.memory_limit = v;
                    memory_line = Some(e.line);
                    if let Some(binary) = decimal_size(&e.value) {
                        warnings.push(Warning {
                            at: at(e.line, &g.name),
                            message: format!(
                                "MemoryLimit={} is in powers of 10: {} bytes, {}; write {binary} for powers of 2",
                                e.value.trim(),
                                v,
                                format_size(v)
                            ),
                        });
                    }
                }),
                ALLOWED_USERS => parse_names(&e.value).map(|v| {
                    for name in v.iter().filter(|n| !user_exists(n)) {
                        warnings.push(Warning {
                            at: at(e.line, &g.name),
                            message: format!("AllowedUsers: no user {name:?} on this machine"),
                        });
                    }
                    cfg.allowed_users = Some(v);
                }),
                ALLOWED_GROUPS => parse_names(&e.value).map(|v| {
                    for name in v.iter().filter(|n| !group_exists(n)) {
                        warnings.push(Warning {
                            at: at(e.line, &g.name),
                            message: format!(
                                "AllowedGroups: no Unix group {name:?} on this machine"
                            ),
                        });
                    }
                    cfg.allowed_groups = Some(v);
                }),
                CGROUPS => parse_cgroups(&e.value).map(|v| cfg.cgroups = Some(v)),
                DEVICES => parse_devices(&e.value).map(|v| cfg.devices = Some(v)),
                LATENCY => parse_latency(&e.value).map(|v| cfg.latency = v),
                // Extensions, by the Desktop Entry convention: kept out of
                // the way of every key gemini knows or may come to know.
                other if other.starts_with("X-") => Ok(()),
                // A typo must not drop a guarantee silently (`MinUitl=0.7`
                // left the group at MinUtil 0): an error, so that the
                // file is refused and, on a reload, the last good one
                // stays.
                other => Err(format!("unknown key{}", suggestion(other))),
            };
            if let Err(msg) = result {
                errors.push(ConfigError {
                    at: at(e.line, &g.name),
                    message: format!("{}: {msg}", e.key),
                });
            }
        }
        if min_ok && max_ok && cfg.min_util > cfg.max_util {
            errors.push(ConfigError {
                at: at(min_line, &g.name),
                message: format!(
                    "MinUtil {} is greater than MaxUtil {}: the guaranteed share cannot exceed the ceiling",
                    cfg.min_util, cfg.max_util
                ),
            });
        }
        if max_ok && cfg.max_util == 0.0 {
            warnings.push(Warning {
                at: at(g.line, &g.name),
                message: "MaxUtil is 0: programs of this group will never run a kernel".into(),
            });
        }
        if let (Some(line), 0) = (memory_line, cfg.memory_limit) {
            warnings.push(Warning {
                at: at(line, &g.name),
                message: "MemoryLimit is 0: programs of this group can allocate no GPU memory \
                          (remove the key for no limit)"
                    .into(),
            });
        }
        groups.insert(g.name.clone(), cfg);
    }
    if !errors.is_empty() {
        errors.sort_by_key(|e| e.at.line.unwrap_or(usize::MAX));
        return Err(ConfigErrors(errors));
    }
    Ok((groups, warnings))
}

/// The configuration of all of `groups` (read from `file` and its
/// drop-ins), after the checks that concern them all, with the `errors`
/// found so far.
fn finish(
    groups: BTreeMap<String, GroupConfig>,
    mut warnings: Vec<Warning>,
    mut errors: Vec<ConfigError>,
    file: &Path,
) -> Result<(ResourceConfig, Vec<Warning>), ConfigErrors> {
    // Where a group is, for messages: its line, and its file when that
    // is a drop-in.
    let place = |g: &GroupConfig| {
        if g.file == file {
            format!("line {}", g.line)
        } else {
            format!("{} line {}", g.file.display(), g.line)
        }
    };
    // MinUtil is a share of each GPU's time: the groups that may use a
    // GPU must fit on it. A GPU no `Devices` names has the groups without
    // one (`None` below).
    let mut named: Vec<Option<u32>> = groups
        .values()
        .flat_map(|g| g.devices.iter().flatten().copied().map(Some))
        .collect();
    named.sort_unstable();
    named.dedup();
    named.insert(0, None);
    for gpu in named {
        let on = |g: &&GroupConfig| gpu.map_or(g.devices.is_none(), |d| g.uses(d));
        let sum: f64 = groups.values().filter(on).map(|g| g.min_util).sum();
        if sum > 1.0 + SUM_EPSILON {
            let parts: Vec<String> = groups
                .values()
                .filter(on)
                .filter(|g| g.min_util > 0.0)
                .map(|g| format!("{} {} ({})", g.name, g.min_util, place(g)))
                .collect();
            let over = match gpu {
                None => "over all groups".to_string(),
                Some(d) => format!("of the groups on GPU {d}"),
            };
            errors.push(ConfigError {
                at: Location { file: file.to_path_buf(), line: None, group: None },
                message: format!(
                    "MinUtil {over} adds up to {sum:.3}, more than 1: {}; lower them so the guarantees can all be met",
                    parts.join(", ")
                ),
            });
            break;
        }
    }
    if groups.is_empty() {
        warnings.push(Warning {
            at: Location {
                file: file.to_path_buf(),
                line: None,
                group: None,
            },
            message: "no groups defined: every client will be refused".into(),
        });
    }
    if !errors.is_empty() {
        errors.sort_by(|a, b| {
            (
                a.at.file != file,
                &a.at.file,
                a.at.line.unwrap_or(usize::MAX),
            )
                .cmp(&(
                    b.at.file != file,
                    &b.at.file,
                    b.at.line.unwrap_or(usize::MAX),
                ))
        });
        return Err(ConfigErrors(errors));
    }
    Ok((
        ResourceConfig {
            path: file.to_path_buf(),
            groups,
        },
        warnings,
    ))
}

mod diff;
mod raw;
mod values;

pub use diff::{Change, diff};
use raw::*;
use values::*;

#[cfg(test)]
mod tests;
