//! The file as glib's `KeyFile` reads it, with the line of every
//! section and key (glib does not say): sections, keys, raw values.

use super::*;

/// A key as found in the file.
#[derive(Debug)]
pub(super) struct RawEntry {
    pub(super) key: String,
    pub(super) value: String,
    pub(super) line: usize,
}

/// A section as found in the file.
#[derive(Debug)]
pub(super) struct RawGroup {
    pub(super) name: String,
    pub(super) line: usize,
    pub(super) entries: Vec<RawEntry>,
}

/// What the line scan learns: where each section and key is, and lines
/// that are neither.
#[derive(Debug, Default)]
pub(super) struct LineIndex {
    /// Section name → header lines (several if it is repeated).
    pub(super) groups: BTreeMap<String, Vec<usize>>,
    /// (section, key) → lines (several if it is repeated).
    pub(super) keys: BTreeMap<(String, String), Vec<usize>>,
    /// Structural errors glib would reject the file for.
    pub(super) errors: Vec<(usize, String)>,
}

pub(super) fn scan_lines(text: &str) -> LineIndex {
    let mut idx = LineIndex::default();
    let mut current: Option<String> = None;
    for (i, raw) in text.lines().enumerate() {
        let n = i + 1;
        let line = raw.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        if let Some(rest) = line.strip_prefix('[') {
            match rest.strip_suffix(']') {
                Some(name) if !name.is_empty() && !name.contains(['[', ']']) => {
                    idx.groups.entry(name.to_string()).or_default().push(n);
                    current = Some(name.to_string());
                }
                _ => idx.errors.push((
                    n,
                    format!("expected a section header like `[train]`, found {line:?}"),
                )),
            }
            continue;
        }
        match (line.split_once('='), &current) {
            (Some((key, _)), Some(group)) if !key.trim().is_empty() => {
                idx.keys
                    .entry((group.clone(), key.trim().to_string()))
                    .or_default()
                    .push(n);
            }
            (Some(_), Some(_)) => idx
                .errors
                .push((n, format!("missing key name before `=` in {line:?}"))),
            (Some(_), None) => idx.errors.push((
                n,
                "a key outside any section: start the file with a group header like `[train]`"
                    .into(),
            )),
            (None, _) => idx.errors.push((
                n,
                format!("expected `Key=value`, `[group]` or a `#` comment, found {line:?}"),
            )),
        }
    }
    idx
}

/// Removes a trailing ` # comment` (glib keeps it in the value). A `#` not
/// preceded by white space is part of the value.
pub(super) fn strip_trailing_comment(value: &str) -> &str {
    let bytes = value.as_bytes();
    for (i, &b) in bytes.iter().enumerate() {
        if b == b'#' && i > 0 && bytes[i - 1].is_ascii_whitespace() {
            return value[..i].trim_end();
        }
    }
    value.trim_end()
}

pub(super) fn parse_raw(
    text: &str,
    file: &Path,
) -> Result<(Vec<RawGroup>, LineIndex), ConfigErrors> {
    // A byte order mark (some Windows editors write one) is not content.
    let text = text.strip_prefix('\u{feff}').unwrap_or(text);
    let idx = scan_lines(text);
    let at = |line: Option<usize>, group: Option<&str>| Location {
        file: file.to_path_buf(),
        line,
        group: group.map(str::to_string),
    };
    if !idx.errors.is_empty() {
        return Err(ConfigErrors(
            idx.errors
                .iter()
                .map(|(l, m)| ConfigError {
                    at: at(Some(*l), None),
                    message: m.clone(),
                })
                .collect(),
        ));
    }
    let kf = KeyFile::new();
    if let Err(e) = kf.load_from_data(text, KeyFileFlags::NONE) {
        return Err(ConfigErrors(vec![ConfigError {
            at: at(None, None),
            message: format!("not a valid XDG Desktop Entry file: {e}"),
        }]));
    }
    let mut groups = Vec::new();
    for name in kf.groups().iter() {
        let name = name.as_str().to_string();
        let line = idx
            .groups
            .get(&name)
            .and_then(|v| v.first().copied())
            .unwrap_or(0);
        let mut entries = Vec::new();
        let keys = kf.keys(&name).map_err(|e| {
            ConfigErrors(vec![ConfigError {
                at: at(Some(line), Some(&name)),
                message: format!("cannot list keys: {e}"),
            }])
        })?;
        for key in keys.iter() {
            let key = key.as_str().to_string();
            let value = kf
                .string(&name, &key)
                .or_else(|_| kf.value(&name, &key))
                .map(|v| strip_trailing_comment(v.as_str()).to_string())
                .unwrap_or_default();
            let kline = idx
                .keys
                .get(&(name.clone(), key.clone()))
                .and_then(|v| v.last().copied())
                .unwrap_or(line);
            entries.push(RawEntry {
                key,
                value,
                line: kline,
            });
        }
        groups.push(RawGroup {
            name,
            line,
            entries,
        });
    }
    Ok((groups, idx))
}
