//! Kubernetes quantities (`resource.Quantity`) as bytes: what a claim's `consumedCapacity`
//! says and what a ResourceSlice's `capacity` publishes. Pure.

/// The bytes `text` says: a plain or decimal-exponent number (`4294967296`, `4e9`), or one
/// with a binary (`Ki` … `Ei`) or decimal (`k`, `M`, `G`, `T`, `P`, `E`) suffix. A fraction of
/// a byte is rounded up (the API rounds a consumed amount up, never down). `None` when it is
/// not a quantity, is negative, or is more than `u64` holds.
pub fn parse(text: &str) -> Option<u64> {
    let text = text.trim();
    let split = text
        .find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '+'))
        .unwrap_or(text.len());
    let (number, suffix) = text.split_at(split);
    let (multiplier, exponent): (u128, i32) = match suffix {
        "" => (1, 0),
        "Ki" => (1 << 10, 0),
        "Mi" => (1 << 20, 0),
        "Gi" => (1 << 30, 0),
        "Ti" => (1 << 40, 0),
        "Pi" => (1 << 50, 0),
        "Ei" => (1 << 60, 0),
        "k" => (1, 3),
        "M" => (1, 6),
        "G" => (1, 9),
        "T" => (1, 12),
        "P" => (1, 15),
        "E" => (1, 18),
        // A decimal exponent: `4e9`, `4E9`.
        s => (1, s.strip_prefix(['e', 'E'])?.parse().ok()?),
    };
    let mantissa = number.strip_prefix('+').unwrap_or(number);
    let (whole, fraction) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    if whole.is_empty() && fraction.is_empty() {
        return None;
    }
    if !whole
        .chars()
        .chain(fraction.chars())
        .all(|c| c.is_ascii_digit())
    {
        return None;
    }
    // value = digits × 10^(exponent − fraction digits) × multiplier, rounded up.
    let digits: u128 = format!("{whole}{fraction}").parse().ok()?;
    let scale = exponent - i32::try_from(fraction.len()).ok()?;
    let mut numerator = digits.checked_mul(multiplier)?;
    let mut denominator: u128 = 1;
    if scale >= 0 {
        numerator = numerator.checked_mul(10u128.checked_pow(u32::try_from(scale).ok()?)?)?;
    } else {
        denominator = 10u128.checked_pow(scale.unsigned_abs())?;
    }
    u64::try_from(numerator.div_ceil(denominator)).ok()
}

/// `bytes` as a quantity: in the largest binary unit that divides it (`16Gi`), else plain.
pub fn format(bytes: u64) -> String {
    const UNITS: [(&str, u32); 6] = [
        ("Ei", 60),
        ("Pi", 50),
        ("Ti", 40),
        ("Gi", 30),
        ("Mi", 20),
        ("Ki", 10),
    ];
    UNITS
        .iter()
        .find(|(_, shift)| bytes != 0 && bytes.trailing_zeros() >= *shift)
        .map_or_else(
            || bytes.to_string(),
            |(unit, shift)| format!("{}{unit}", bytes >> shift),
        )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantities_as_the_api_writes_them_are_bytes() {
        for (text, bytes) in [
            ("4Gi", 4 << 30),
            ("4294967296", 4 << 30),
            ("1536Mi", 1536 << 20),
            ("1.5Gi", 3 << 29),
            ("4G", 4_000_000_000),
            ("4e9", 4_000_000_000),
            ("2E", 2_000_000_000_000_000_000),
            ("4E9", 4_000_000_000),
            ("0.5", 1),
            ("+1Ki", 1024),
        ] {
            assert_eq!(parse(text), Some(bytes), "{text}");
        }
        // Milli-bytes ("100m") are a quantity, but no memory size.
        for bad in ["", "Gi", "-1Gi", "4 GiB", "4GiB", "1e99", "x", "100m"] {
            assert_eq!(parse(bad), None, "{bad}");
        }
    }

    #[test]
    fn bytes_are_written_in_the_largest_unit_that_divides_them() {
        assert_eq!(format(16 << 30), "16Gi");
        assert_eq!(format(1536 << 20), "1536Mi");
        assert_eq!(format(1000), "1000");
        assert_eq!(format(0), "0");
        for bytes in [16 << 30, 1536 << 20, 12_345] {
            assert_eq!(parse(&format(bytes)), Some(bytes));
        }
    }
}
