//! Durations as people type them: `30m`, `2h`, `1d`, `0.5h`, `90s`,
//! `250ms`, or a plain number of seconds. (humantime, used elsewhere, does
//! not take fractions such as `0.5h`.)

use std::time::Duration;

/// Parses a duration; the error says what was expected.
pub fn parse(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let scale = match unit.trim() {
        "" | "s" | "sec" | "secs" => 1.0,
        "ms" => 1e-3,
        "m" | "min" | "mins" => 60.0,
        "h" | "hr" | "hrs" => 3600.0,
        "d" | "day" | "days" => 86400.0,
        _ => {
            return Err(format!(
                "expected a duration such as 30m, 2h, 1d, 0.5h or 90s, got {s:?}"
            ));
        }
    };
    match num.trim().parse::<f64>() {
        Ok(v) if v.is_finite() && v >= 0.0 => Ok(Duration::from_secs_f64(v * scale)),
        _ => Err(format!(
            "expected a duration such as 30m, 2h, 1d, 0.5h or 90s, got {s:?}"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_and_fractions() {
        assert_eq!(parse("30m"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse("2h"), Ok(Duration::from_secs(7200)));
        assert_eq!(parse("1d"), Ok(Duration::from_secs(86400)));
        assert_eq!(parse("0.5h"), Ok(Duration::from_secs(1800)));
        assert_eq!(parse("90"), Ok(Duration::from_secs(90)));
        assert_eq!(parse("250ms"), Ok(Duration::from_millis(250)));
        for bad in ["", "soon", "5 parsecs", "-1h", "h"] {
            assert!(parse(bad).is_err(), "{bad}");
        }
    }
}
