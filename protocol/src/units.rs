//! The one grammar for durations and the one for sizes, for every part:
//! `gemini.toml`, `resource.conf`, flags and environment variables.
//!
//! - Durations: a number (fractions allowed) and a unit, several summed:
//!   `30s`, `500ms`, `250us`, `2m`, `1.5h`, `1h 30m`, `1d`. Units: `ns`,
//!   `us` (`µs`), `ms`, `s` (`sec`, `seconds`), `m` (`min`, `minutes`),
//!   `h` (`hr`, `hours`), `d` (`days`), `w` (`weeks`). A bare number is in
//!   the setting's own unit: seconds unless its name says otherwise
//!   (`GEMINI_IDLE_MS`). Parsed by the `fundu` crate.
//! - Sizes: `2GiB` (powers of 2: `Ki`, `Mi`, `Gi`, `Ti`, with or without
//!   `B`), `2GB` or `2G` (powers of 10: `K`, `M`, `G`, `T`), a bare number
//!   of bytes, or `unlimited`. Parsed by the `parse-size` crate.

use fundu::TimeUnit::{Day, Hour, MicroSecond, MilliSecond, Minute, NanoSecond, Second, Week};
use fundu::{CustomDurationParser, CustomDurationParserBuilder, CustomTimeUnit, TimeUnit};
use std::time::Duration;

/// What a duration looks like, for messages.
pub const DURATION_EXAMPLES: &str = "30s, 500ms, 2m, 1.5h or 1h 30m";

fn duration_parser(bare: TimeUnit) -> CustomDurationParser<'static> {
    CustomDurationParserBuilder::new()
        .time_units(&[
            CustomTimeUnit::with_default(NanoSecond, &["ns", "nsec"]),
            CustomTimeUnit::with_default(MicroSecond, &["us", "µs", "usec"]),
            CustomTimeUnit::with_default(MilliSecond, &["ms", "msec"]),
            CustomTimeUnit::with_default(Second, &["s", "sec", "secs", "second", "seconds"]),
            CustomTimeUnit::with_default(Minute, &["m", "min", "mins", "minute", "minutes"]),
            CustomTimeUnit::with_default(Hour, &["h", "hr", "hrs", "hour", "hours"]),
            CustomTimeUnit::with_default(Day, &["d", "day", "days"]),
            CustomTimeUnit::with_default(Week, &["w", "week", "weeks"]),
        ])
        .default_unit(bare)
        .allow_time_unit_delimiter()
        .parse_multiple(None)
        .disable_exponent()
        .disable_infinity()
        .build()
}

fn duration_with(text: &str, bare: TimeUnit, bare_name: &str) -> Result<Duration, String> {
    let t = text.trim();
    duration_parser(bare)
        .parse(t)
        .map_err(|e| e.to_string())
        .and_then(|d| Duration::try_from(d).map_err(|e| e.to_string()))
        .map_err(|e| {
            format!(
                "expected a duration such as {DURATION_EXAMPLES} (a bare number is {bare_name}), got {t:?} ({e})"
            )
        })
}

/// Parses a duration; a bare number is seconds.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    duration_with(text, Second, "seconds")
}

/// Parses a duration; a bare number is milliseconds.
pub fn parse_duration_ms(text: &str) -> Result<Duration, String> {
    duration_with(text, MilliSecond, "milliseconds")
}

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

/// Formats a length for humans, in whole seconds (whole minutes past an
/// hour): `42s`, `5m 3s`, `2h 55m`.
pub fn format_length(d: Duration) -> String {
    let secs = d.as_secs();
    let secs = if secs >= 3600 { secs / 60 * 60 } else { secs };
    humantime::format_duration(Duration::from_secs(secs)).to_string()
}

/// Formats a list of GPUs for a table: `0,2`, or `-` for none.
pub fn format_gpus(gpus: &[u32]) -> String {
    if gpus.is_empty() {
        return "-".to_string();
    }
    gpus.iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(",")
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

    #[test]
    fn a_gpu_list_is_comma_separated_and_none_is_a_dash() {
        assert_eq!(format_gpus(&[]), "-");
        assert_eq!(format_gpus(&[0, 2]), "0,2");
    }

    use super::*;

    #[test]
    fn durations_with_units_fractions_and_sums() {
        let ms = Duration::from_millis;
        let s = Duration::from_secs;
        for (text, want) in [
            ("30", s(30)),
            ("30s", s(30)),
            ("1.5s", ms(1500)),
            ("250ms", ms(250)),
            ("250 ms", ms(250)),
            ("100us", Duration::from_micros(100)),
            ("2m", s(120)),
            ("2min", s(120)),
            ("0.5h", s(1800)),
            ("1h 30m", s(5400)),
            ("1h30m", s(5400)),
            ("1d", s(86400)),
            ("10 seconds", s(10)),
            (" 20ms ", ms(20)),
        ] {
            assert_eq!(parse_duration(text), Ok(want), "{text}");
        }
        assert_eq!(parse_duration_ms("5"), Ok(ms(5)));
        assert_eq!(parse_duration_ms("0.5"), Ok(Duration::from_micros(500)));
        assert_eq!(parse_duration_ms("2s"), Ok(s(2)));
    }

    #[test]
    fn bad_durations_say_what_was_expected() {
        for bad in ["", "soon", "5 parsecs", "-1h", "h", "1e3s", "inf", "banana"] {
            let err = parse_duration(bad).expect_err(bad);
            assert!(
                err.starts_with("expected a duration such as 30s, 500ms"),
                "{bad}: {err}"
            );
        }
        let err = parse_duration_ms("x").expect_err("x");
        assert!(err.contains("a bare number is milliseconds"), "{err}");
    }

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
