//! The one place that reads the wall clock (clippy's `disallowed-methods` keeps it so).
//! Everything else takes `now` as a parameter, which is what lets lease and wait logic be
//! tested without sleeping.

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use crate::model::Millis;

/// Where the broker thread reads the time: [`wall`] in gpud, a test's own clock in tests
/// (which move it by hand instead of sleeping).
pub type Clock = std::sync::Arc<dyn Fn() -> Millis + Send + Sync>;

/// The wall clock, as a [`Clock`].
pub fn wall() -> Clock {
    std::sync::Arc::new(now_millis)
}

/// Milliseconds since the Unix epoch, now.
#[allow(clippy::disallowed_methods)]
pub fn now_millis() -> Millis {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// The last millisecond RFC 3339 can write (four-digit years): 9999-12-31T23:59:59.999Z.
pub const LAST_RFC3339_MILLIS: Millis = 253_402_300_799_999;

/// RFC 3339 UTC with milliseconds, as the API prints times (`2026-11-21T05:20:39.123Z`).
/// Times past year 9999 (which requests cannot create, but an old database might hold) print
/// as its last millisecond.
pub fn rfc3339(at: Millis) -> String {
    let at = at.min(LAST_RFC3339_MILLIS);
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

    #[test]
    fn times_past_year_9999_print_as_its_last_millisecond() {
        assert_eq!(rfc3339(LAST_RFC3339_MILLIS), "9999-12-31T23:59:59.999Z");
        assert_eq!(rfc3339(u64::MAX), "9999-12-31T23:59:59.999Z");
    }
}
