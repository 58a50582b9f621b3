//! GPU memory sizes as people write them.
//!
//! GPU memory is sized in powers of two, and `nvidia-smi` prints MiB, so every unit here is
//! binary: `4G`, `4GB` and `4GiB` all mean 4 × 2³⁰ bytes (bytesize would read `4GB` as
//! 4 × 10⁹, which is how a "4 GB" request ends up 7 % short). A trailing `%` asks for a
//! fraction of each chosen GPU's memory. Decimals are allowed (`1.5GiB`); the result is
//! rounded down to whole bytes and must be at least one byte.

use std::fmt;

/// A parsed memory amount.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MemoryAmount {
    /// Exact bytes.
    Bytes(u64),
    /// A fraction of each GPU's total memory, in basis points (`25%` → 2500).
    BasisPoints(u32),
}

/// Why a size string was rejected. The message says what is accepted.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid memory size {input:?}: {reason}; write e.g. 512MiB, 4GiB, 4G (G means GiB) or 25%"
)]
pub struct SizeError {
    /// The text as given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

const UNITS: [(&[&str], u32); 6] = [
    (&["", "b"], 0),
    (&["k", "kb", "kib"], 10),
    (&["m", "mb", "mib"], 20),
    (&["g", "gb", "gib"], 30),
    (&["t", "tb", "tib"], 40),
    (&["p", "pb", "pib"], 50),
];

const WHOLE_BYTES: &str = "a number of bytes must be whole; give a unit for parts: 1.5GiB";

/// Parses `"4GiB"`, `"4G"`, `"1.5 GiB"`, `"512MiB"`, `"1048576"` or `"25%"`.
pub fn parse_memory(input: &str) -> Result<MemoryAmount, SizeError> {
    let err = |reason| SizeError {
        input: input.to_owned(),
        reason,
    };
    let text = input.trim();
    if let Some(number) = text.strip_suffix('%') {
        let (whole, frac) = parse_decimal(number.trim()).ok_or_else(|| err("not a number"))?;
        // Basis points: two decimals of a percent are kept.
        let bp = whole
            .checked_mul(100)
            .and_then(|w| w.checked_add(frac.scaled(2)))
            .ok_or_else(|| err("percentage out of range"))?;
        return match u32::try_from(bp) {
            Ok(0) => Err(err("must be more than 0%")),
            Ok(bp) if bp <= 10_000 => Ok(MemoryAmount::BasisPoints(bp)),
            _ => Err(err("must be at most 100%")),
        };
    }
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    if number.is_empty() {
        return Err(err("not a number"));
    }
    let unit = unit.trim().to_ascii_lowercase();
    let shift = UNITS
        .iter()
        .find(|(names, _)| names.contains(&unit.as_str()))
        .map(|&(_, shift)| shift)
        .ok_or_else(|| err("unknown unit"))?;
    let (whole, frac) = parse_decimal(number).ok_or_else(|| err("not a number"))?;
    if shift == 0 && frac.digits != 0 {
        return Err(err(WHOLE_BYTES));
    }
    let whole_bytes = whole.checked_shl(shift).filter(|b| b >> shift == whole);
    let bytes = whole_bytes
        .and_then(|w| w.checked_add(frac.scaled_binary(shift)))
        .ok_or_else(|| err("too large"))?;
    if bytes == 0 {
        return Err(err("must be at least one byte"));
    }
    Ok(MemoryAmount::Bytes(bytes))
}

/// Digits after the decimal point, kept exactly (at most 18 of them).
#[derive(Debug, Clone, Copy)]
struct Fraction {
    digits: u64,
    places: u32,
}

impl Fraction {
    /// The fraction times 10^`places`, rounded down.
    fn scaled(self, places: u32) -> u64 {
        if self.places <= places {
            self.digits * 10u64.pow(places - self.places)
        } else {
            self.digits / 10u64.pow(self.places - places)
        }
    }

    /// The fraction times 2^`shift`, rounded down.
    fn scaled_binary(self, shift: u32) -> u64 {
        let wide = (u128::from(self.digits) << shift) / 10u128.pow(self.places);
        u64::try_from(wide).unwrap_or(u64::MAX)
    }
}

/// Parses `123` or `1.25` into its whole part and fraction. No signs, no exponents.
fn parse_decimal(s: &str) -> Option<(u64, Fraction)> {
    let (whole, frac) = s.split_once('.').unwrap_or((s, ""));
    if whole.is_empty() && frac.is_empty() {
        return None;
    }
    let all_digits = |t: &str| t.bytes().all(|b| b.is_ascii_digit());
    if !all_digits(whole) || !all_digits(frac) || frac.len() > 18 {
        return None;
    }
    let whole = if whole.is_empty() {
        0
    } else {
        whole.parse().ok()?
    };
    let digits = if frac.is_empty() {
        0
    } else {
        frac.parse().ok()?
    };
    let places = u32::try_from(frac.len()).ok()?;
    Some((whole, Fraction { digits, places }))
}

/// A fraction in basis points as the size parser reads it back: `2500` → `25%`, `1250` →
/// `12.5%`, `1` → `0.01%`.
pub fn format_basis_points(bp: u32) -> String {
    let (whole, frac) = (bp / 100, bp % 100);
    match frac {
        0 => format!("{whole}%"),
        f if f.is_multiple_of(10) => format!("{whole}.{}%", f / 10),
        f => format!("{whole}.{f:02}%"),
    }
}

/// Formats bytes for people, binary units with one decimal: `3.2 GiB`, `512 MiB`, `100 B`.
pub fn format_bytes(bytes: u64) -> String {
    BytesDisplay(bytes).to_string()
}

struct BytesDisplay(u64);

impl fmt::Display for BytesDisplay {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        const NAMES: [&str; 6] = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"];
        let mut unit = 0;
        while unit + 1 < NAMES.len() && self.0 >> (10 * (unit + 1)) > 0 {
            unit += 1;
        }
        if unit == 0 {
            return write!(f, "{} B", self.0);
        }
        let whole = self.0 >> (10 * unit);
        let rest = self.0 - (whole << (10 * unit));
        // One decimal, rounded down so "3.99 GiB free" never prints as "4.0 GiB".
        let tenth = (u128::from(rest) * 10) >> (10 * unit);
        if tenth == 0 {
            write!(f, "{whole} {}", NAMES[unit])
        } else {
            write!(f, "{whole}.{tenth} {}", NAMES[unit])
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn binary_units_whatever_the_spelling() {
        for s in ["4GiB", "4G", "4GB", "4g", "4 GiB", " 4gib "] {
            assert_eq!(parse_memory(s), Ok(MemoryAmount::Bytes(4 * GIB)), "{s}");
        }
        assert_eq!(parse_memory("512MiB"), Ok(MemoryAmount::Bytes(512 << 20)));
        assert_eq!(parse_memory("1.5GiB"), Ok(MemoryAmount::Bytes(3 * GIB / 2)));
        assert_eq!(parse_memory("1024"), Ok(MemoryAmount::Bytes(1024)));
        assert_eq!(parse_memory("2k"), Ok(MemoryAmount::Bytes(2048)));
        assert_eq!(parse_memory("1T"), Ok(MemoryAmount::Bytes(1 << 40)));
    }

    #[test]
    fn basis_points_print_as_the_parser_reads_them() {
        for (bp, text) in [
            (2500, "25%"),
            (1250, "12.5%"),
            (1, "0.01%"),
            (10, "0.1%"),
            (3333, "33.33%"),
            (10_000, "100%"),
        ] {
            assert_eq!(format_basis_points(bp), text);
            assert_eq!(parse_memory(text), Ok(MemoryAmount::BasisPoints(bp)));
        }
    }

    #[test]
    fn percentages_become_basis_points() {
        assert_eq!(parse_memory("25%"), Ok(MemoryAmount::BasisPoints(2500)));
        assert_eq!(parse_memory("12.5%"), Ok(MemoryAmount::BasisPoints(1250)));
        assert_eq!(parse_memory("100%"), Ok(MemoryAmount::BasisPoints(10_000)));
        assert!(parse_memory("0%").is_err());
        assert!(parse_memory("101%").is_err());
        assert!(parse_memory("-5%").is_err());
    }

    #[test]
    fn rejects_nonsense_with_a_reason() {
        for (s, reason) in [
            ("", "not a number"),
            ("GiB", "not a number"),
            ("-1GiB", "not a number"),
            ("1e99GiB", "unknown unit"),
            ("4 parsecs", "unknown unit"),
            ("0", "must be at least one byte"),
            ("0.0000000001B", WHOLE_BYTES),
            ("1.5", WHOLE_BYTES),
            ("0.5 b", WHOLE_BYTES),
            ("18446744073709551616", "not a number"),
            ("16777216TiB", "too large"),
            ("99999999999999999999PiB", "not a number"),
            ("1.2.3G", "not a number"),
        ] {
            let e = parse_memory(s).unwrap_err();
            assert_eq!(e.reason, reason, "{s}");
            assert!(e.to_string().contains("G means GiB"), "{e}");
        }
    }

    #[test]
    fn formats_like_a_person_reads() {
        assert_eq!(format_bytes(0), "0 B");
        assert_eq!(format_bytes(1023), "1023 B");
        assert_eq!(format_bytes(4 * GIB), "4 GiB");
        assert_eq!(format_bytes(3 * GIB + GIB / 4), "3.2 GiB");
        assert_eq!(format_bytes(4 * GIB - 1), "3.9 GiB");
        assert_eq!(format_bytes(512 << 20), "512 MiB");
        assert_eq!(format_bytes(u64::MAX), "16383.9 PiB");
    }

    #[test]
    fn round_trips_whole_units() {
        for n in [1u64, 7, 1000, 40960] {
            assert_eq!(
                parse_memory(&format_bytes(n << 20)),
                Ok(MemoryAmount::Bytes(n << 20))
            );
        }
    }
}
