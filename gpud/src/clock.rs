//! The one place that reads the wall clock (clippy's `disallowed-methods` keeps it so).
//! Everything else takes `now` as a parameter, which is what lets lease and wait logic be
//! tested without sleeping.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::model::Millis;

/// Milliseconds since the Unix epoch, now.
#[allow(clippy::disallowed_methods)]
pub fn now_millis() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// RFC 3339 UTC with milliseconds, as the API prints times (`2026-11-21T05:20:39.123Z`).
pub fn rfc3339(at: Millis) -> String {
    humantime::format_rfc3339_millis(UNIX_EPOCH + Duration::from_millis(at)).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_utc_with_millis() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339(1_795_000_000_123), "2026-11-18T11:06:40.123Z");
        assert!(now_millis() > 1_700_000_000_000);
    }
}
