//! Durations for people: `2 days 3 h`, `1 h 30 min`, `45 s`, `500 ms`.

use std::time::Duration;

/// `d` in its two largest units, spaced: `11 years`, `2 days 3 h`, `1 h 30 min`, `1 min
/// 5 s`, `45 s`, `500 ms`; `0 s` for zero. Years are 365 days.
pub fn format_duration(d: Duration) -> String {
    const UNITS: [(u64, &str, &str); 5] = [
        (365 * 86_400, "year", "years"),
        (86_400, "day", "days"),
        (3600, "h", "h"),
        (60, "min", "min"),
        (1, "s", "s"),
    ];
    let secs = d.as_secs();
    if secs == 0 {
        let ms = d.subsec_millis();
        return if ms == 0 {
            "0 s".to_owned()
        } else {
            format!("{ms} ms")
        };
    }
    let mut parts = Vec::new();
    let mut left = secs;
    for (size, one, many) in UNITS {
        let n = left / size;
        if n > 0 {
            parts.push(format!("{n} {}", if n == 1 { one } else { many }));
            left %= size;
        } else if !parts.is_empty() {
            // Two adjacent units at most: `1 day 5 s` would mislead as much as it tells.
            break;
        }
        if parts.len() == 2 {
            break;
        }
    }
    parts.join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_largest_units_spaced() {
        let s = Duration::from_secs;
        assert_eq!(
            format_duration(s(10 * 365 * 86_400 + 86_400)),
            "10 years 1 day"
        );
        assert_eq!(format_duration(s(11 * 365 * 86_400)), "11 years");
        assert_eq!(format_duration(s(2 * 86_400)), "2 days");
        assert_eq!(format_duration(s(86_400 + 3 * 3600 + 60)), "1 day 3 h");
        assert_eq!(format_duration(s(5400)), "1 h 30 min");
        assert_eq!(format_duration(s(3600 + 5)), "1 h");
        assert_eq!(format_duration(s(65)), "1 min 5 s");
        assert_eq!(format_duration(s(60)), "1 min");
        assert_eq!(format_duration(s(1)), "1 s");
        assert_eq!(format_duration(Duration::from_millis(500)), "500 ms");
        assert_eq!(format_duration(Duration::ZERO), "0 s");
    }
}
