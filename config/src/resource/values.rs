//! One key's value: shares, user and group names, device lists,
//! cgroup paths, and a suggestion for a misspelt key.

use super::*;

/// A share: `0.3` or `30%`, within 0..=1.
pub(super) fn parse_util(value: &str) -> Result<f64, String> {
    let (num, scale) = match value.strip_suffix('%') {
        Some(n) => (n.trim(), 100.0),
        None => (value, 1.0),
    };
    match num.parse::<f64>() {
        Ok(v) if v.is_finite() && (0.0..=1.0).contains(&(v / scale)) => Ok(v / scale),
        _ => Err(format!(
            "expected a number from 0 to 1 (or a percentage like 30%), got {value:?}"
        )),
    }
}

/// A list of user or group names: `alice;bob` (the Desktop Entry list
/// syntax) or `alice, bob`. Names are what `useradd` accepts.
pub(super) fn parse_names(value: &str) -> Result<Vec<String>, String> {
    let names: Vec<String> = value
        .split([';', ','])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if names.is_empty() {
        return Err("expected a list of names such as `alice;bob`, got nothing (remove the key to allow everyone)".into());
    }
    if let Some(bad) = names.iter().find(|n| {
        !n.chars()
            .all(|c| c.is_ascii_alphanumeric() || "._-$".contains(c))
    }) {
        return Err(format!("{bad:?} is not a user or group name"));
    }
    Ok(names)
}

/// `Devices`: GPU indices, `,`- or `;`-separated, each once.
pub(super) fn parse_devices(value: &str) -> Result<Vec<u32>, String> {
    let mut devices = Vec::new();
    for part in value
        .split([',', ';'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
    {
        let d: u32 = part.parse().map_err(|_| {
            format!("{part:?} is not a GPU index: expected numbers as nvidia-smi shows them, such as `0,2`")
        })?;
        if devices.contains(&d) {
            return Err(format!("GPU {d} is listed twice"));
        }
        devices.push(d);
    }
    if devices.is_empty() {
        return Err(
            "expected GPU indices such as `0,2`, got nothing (remove the key for every GPU)".into(),
        );
    }
    Ok(devices)
}

/// `Cgroups`: absolute cgroup paths, `;`-separated.
pub(super) fn parse_cgroups(value: &str) -> Result<Vec<String>, String> {
    let paths: Vec<String> = value
        .split(';')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect();
    if paths.is_empty() {
        return Err(
            "expected cgroup paths such as `/system.slice/slurmstepd.scope/job_42`, got nothing"
                .into(),
        );
    }
    if let Some(bad) = paths.iter().find(|p| !p.starts_with('/')) {
        return Err(format!(
            "{bad:?} is not a cgroup path: expected one starting with `/`, as /proc/PID/cgroup shows it"
        ));
    }
    Ok(paths)
}

/// Whether the user database knows `name` (a lookup that fails counts as
/// known: no warning on a guess).
pub(super) fn user_exists(name: &str) -> bool {
    !matches!(nix::unistd::User::from_name(name), Ok(None))
}

/// Whether the group database knows `name` (as [`user_exists`]).
pub(super) fn group_exists(name: &str) -> bool {
    !matches!(nix::unistd::Group::from_name(name), Ok(None))
}

/// What a key that is not known was probably meant to be: one whose case
/// alone differs, or one a letter or two away (`MinUitl`), else the list.
pub(super) fn suggestion(key: &str) -> String {
    if let Some(k) = KNOWN_KEYS.iter().find(|k| k.eq_ignore_ascii_case(key)) {
        return format!("; did you mean `{k}` (keys are case-sensitive)?");
    }
    let lower = key.to_ascii_lowercase();
    let near = KNOWN_KEYS
        .iter()
        .map(|k| {
            (
                strsim::damerau_levenshtein(&lower, &k.to_ascii_lowercase()),
                k,
            )
        })
        .min();
    match near {
        Some((d, k)) if d <= 2 => format!("; did you mean `{k}`?"),
        _ => format!("; known keys are {}", KNOWN_KEYS.join(", ")),
    }
}

/// `Latency`: `critical` or `normal` (any case).
pub(super) fn parse_latency(value: &str) -> Result<super::Latency, String> {
    match value.trim().to_ascii_lowercase().as_str() {
        "critical" => Ok(super::Latency::Critical),
        "normal" => Ok(super::Latency::Normal),
        _ => Err(format!(
            "expected `critical` or `normal`, got {:?}",
            value.trim()
        )),
    }
}
