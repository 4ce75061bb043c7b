//! Durations as rule files and flags write them: `500ms`, `10s`, `1m`, `1h`, `1d`.

use crate::error::RulesError;

/// Parses `500ms`, `10s`, `1m`, `1h` or `1d` into milliseconds.
pub fn parse_duration_ms(s: &str) -> Result<i64, RulesError> {
    let bad = || {
        RulesError::Invalid(format!(
            "duration `{s}`: expected e.g. 500ms, 10s, 1m, 1h, 1d"
        ))
    };
    let split = s.find(|c: char| !c.is_ascii_digit()).ok_or_else(bad)?;
    let (num, unit) = s.split_at(split);
    let n: i64 = num.parse().map_err(|_| bad())?;
    let mult = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" | "min" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => return Err(bad()),
    };
    n.checked_mul(mult).ok_or_else(bad)
}

/// Formats milliseconds in the largest exact unit (`60000` → `1m`).
pub fn format_duration(ms: i64) -> String {
    for (unit, m) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms != 0 && ms % m == 0 {
            return format!("{}{unit}", ms / m);
        }
    }
    format!("{ms}ms")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_durations() {
        assert_eq!(parse_duration_ms("500ms").unwrap(), 500);
        assert_eq!(parse_duration_ms("10s").unwrap(), 10_000);
        assert_eq!(parse_duration_ms("1m").unwrap(), 60_000);
        assert_eq!(parse_duration_ms("1h").unwrap(), 3_600_000);
        assert!(parse_duration_ms("1").is_err());
        assert!(parse_duration_ms("s").is_err());
        assert!(parse_duration_ms("1w").is_err());
        assert_eq!(format_duration(60_000), "1m");
        assert_eq!(format_duration(1_500), "1500ms");
    }
}
