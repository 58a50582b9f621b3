//! Sizes and percentages as NVIDIA's MPS programs write them: `2G`, `4096M`, `512K` or plain
//! bytes (binary units), a thread percentage like `25` or `25.5`, and a client's
//! `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT` (`0=2G,1=4G`, or one size for every device).

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

/// A value the MPS programs would not accept.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum UnitError {
    /// Not a positive number of bytes with an optional `K`, `M`, `G` or `T` suffix.
    #[error(
        "invalid memory size {0:?} (a positive whole number with an optional K, M, G or T suffix)"
    )]
    Size(String),
    /// Not a number from 1 to 100.
    #[error("invalid thread percentage {0:?} (a number from 1 to 100)")]
    Percentage(String),
    /// Not a device index.
    #[error("invalid device index {0:?}")]
    Device(String),
    /// Not `DEV=SIZE,…` nor one size.
    #[error(
        "invalid CUDA_MPS_PINNED_DEVICE_MEM_LIMIT {0:?} (\"0=2G,1=4G\" or one size such as \"2G\")"
    )]
    ClientLimit(String),
}

/// Parses a memory size: a whole number with an optional binary-unit suffix `K`, `M`, `G`
/// or `T` (either case, optionally followed by `B`, as CUDA's documentation writes `512MB`).
pub fn parse_size(text: &str) -> Result<u64, UnitError> {
    let bad = || UnitError::Size(text.to_owned());
    let trimmed = text.trim();
    let digits_end = trimmed
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(trimmed.len());
    let (digits, suffix) = trimmed.split_at(digits_end);
    let number: u64 = digits.parse().map_err(|_| bad())?;
    let upper = suffix.to_ascii_uppercase();
    let unit = upper
        .strip_suffix('B')
        .filter(|unit| !unit.is_empty())
        .unwrap_or(&upper);
    let shift = match unit {
        "" => 0,
        "K" => 10,
        "M" => 20,
        "G" => 30,
        "T" => 40,
        _ => return Err(bad()),
    };
    let bytes = number.checked_mul(1_u64 << shift).ok_or_else(bad)?;
    if bytes == 0 {
        return Err(bad());
    }
    Ok(bytes)
}

/// Parses a thread percentage, 1 to 100, fractions allowed.
pub fn parse_percentage(text: &str) -> Result<f64, UnitError> {
    match text.trim().parse::<f64>() {
        Ok(value) if (1.0..=100.0).contains(&value) => Ok(value),
        _ => Err(UnitError::Percentage(text.to_owned())),
    }
}

/// A percentage as the control daemon prints it: `25.0`, `25.5`, `33.33`.
pub fn format_percentage(value: f64) -> String {
    let short = format!("{value:.1}");
    if short.parse::<f64>().is_ok_and(|v| v == value) {
        short
    } else {
        format!("{value}")
    }
}

/// Parses a device index.
pub fn parse_device(text: &str) -> Result<u32, UnitError> {
    text.trim()
        .parse()
        .map_err(|_| UnitError::Device(text.to_owned()))
}

/// The pinned memory limit a client asks for in its own environment
/// (`CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`); it can only lower what the server gives.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case", deny_unknown_fields)]
pub enum ClientMemLimit {
    /// One size for every device (`2G`).
    AllDevices(u64),
    /// Sizes per device index (`0=2G,1=4G`).
    PerDevice(BTreeMap<u32, u64>),
}

/// Parses `CUDA_MPS_PINNED_DEVICE_MEM_LIMIT`.
pub fn parse_client_mem_limit(text: &str) -> Result<ClientMemLimit, UnitError> {
    let bad = || UnitError::ClientLimit(text.to_owned());
    if !text.contains('=') {
        return parse_size(text)
            .map(ClientMemLimit::AllDevices)
            .map_err(|_| bad());
    }
    let mut limits = BTreeMap::new();
    for item in text.split(',').filter(|item| !item.trim().is_empty()) {
        let (device, size) = item.split_once('=').ok_or_else(bad)?;
        let device = parse_device(device).map_err(|_| bad())?;
        let size = parse_size(size).map_err(|_| bad())?;
        if limits.insert(device, size).is_some() {
            return Err(bad());
        }
    }
    if limits.is_empty() {
        return Err(bad());
    }
    Ok(ClientMemLimit::PerDevice(limits))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, reason = "tests")]

    use super::*;

    #[test]
    fn sizes_take_binary_suffixes() {
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("4096M"), Ok(4 << 30));
        assert_eq!(parse_size("512K"), Ok(512 << 10));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert_eq!(parse_size("512MB"), Ok(512 << 20));
        assert_eq!(parse_size("2g"), Ok(2 << 30));
        assert_eq!(parse_size("1048576"), Ok(1 << 20));
        for bad in [
            "",
            "G",
            "0",
            "0G",
            "1.5G",
            "-1G",
            "2X",
            "2GiB",
            "B",
            "1B",
            "2GBB",
            "99999999999T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn percentages_run_from_one_to_a_hundred() {
        assert_eq!(parse_percentage("25"), Ok(25.0));
        assert_eq!(parse_percentage("25.5"), Ok(25.5));
        assert_eq!(parse_percentage("100"), Ok(100.0));
        for bad in ["0", "0.5", "100.1", "-5", "NaN", "inf", "x", ""] {
            assert!(parse_percentage(bad).is_err(), "{bad:?}");
        }
        assert_eq!(format_percentage(25.0), "25.0");
        assert_eq!(format_percentage(100.0), "100.0");
        assert_eq!(format_percentage(25.5), "25.5");
        assert_eq!(format_percentage(33.33), "33.33");
    }

    #[test]
    fn client_limits_are_per_device_or_for_all() {
        assert_eq!(
            parse_client_mem_limit("2G"),
            Ok(ClientMemLimit::AllDevices(2 << 30))
        );
        assert_eq!(
            parse_client_mem_limit("0=2G,1=512MB"),
            Ok(ClientMemLimit::PerDevice(BTreeMap::from([
                (0, 2 << 30),
                (1, 512 << 20)
            ])))
        );
        for bad in ["", "0=", "=2G", "0=2G,0=1G", "a=2G", "0=2X", ","] {
            assert!(parse_client_mem_limit(bad).is_err(), "{bad:?}");
        }
    }
}
