//! Memory sizes as people write them: `2GiB` (powers of 2: `Ki`, `Mi`,
//! `Gi`, `Ti`, with or without `B`), `2GB` or `2G` (powers of 10: `K`, `M`,
//! `G`, `T`), a bare number of bytes, or `unlimited`. Parsing is done by
//! the `parse-size` crate; this module only adds `unlimited` and the
//! messages.

/// Parses a size. `unlimited` (any case) is `u64::MAX`.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    if t.eq_ignore_ascii_case("unlimited") {
        return Ok(u64::MAX);
    }
    parse_size::parse_size(t).map_err(|e| {
        format!(
            "expected a size such as 1073741824, 1GiB (powers of 2: Ki, Mi, Gi, Ti) or 1GB (powers of 10: K, M, G, T), or `unlimited`; got {t:?} ({e})"
        )
    })
}

/// Formats bytes for humans, in binary units (`1.5 GiB`).
pub fn format_size(bytes: u64) -> String {
    if bytes == u64::MAX {
        return "unlimited".into();
    }
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.1} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn binary_and_decimal_suffixes() {
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("2Gi"), Ok(2 << 30));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4KiB"), Ok(4096));
        assert_eq!(parse_size("2GB"), Ok(2_000_000_000));
        assert_eq!(parse_size("2G"), Ok(2_000_000_000));
        assert_eq!(parse_size("300M"), Ok(300_000_000));
        assert_eq!(parse_size("1.5GiB"), Ok(3 << 29));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        assert_eq!(parse_size(" 1 GiB "), Ok(1 << 30));
        assert_eq!(parse_size("unlimited"), Ok(u64::MAX));
    }

    #[test]
    fn unknown_suffix_and_garbage_are_refused() {
        for bad in ["2GX", "2 parsecs", "", "-1G", "GiB", "1e30"] {
            let err = parse_size(bad).expect_err(bad);
            assert!(err.contains("expected a size"), "{err}");
        }
    }

    #[test]
    fn formats_binary_units() {
        assert_eq!(format_size(512), "512 B");
        assert_eq!(format_size(3 << 29), "1.5 GiB");
        assert_eq!(format_size(u64::MAX), "unlimited");
    }
}
