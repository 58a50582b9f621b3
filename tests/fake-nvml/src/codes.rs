//! NVML return codes (`nvmlReturn_t`): their numbers, the names fixtures use for them, and
//! the static strings `nvmlErrorString` hands out. Depends on nothing.

use std::ffi::CStr;

/// `nvmlReturn_t`, an unsigned 32-bit code.
pub type NvmlReturn = u32;

/// The call succeeded.
pub const SUCCESS: NvmlReturn = 0;
/// The operating system refused (a cgroup path that cannot be opened).
pub const OPERATING_SYSTEM: NvmlReturn = 17;
/// `nvmlInit` has not been called, or every init has been matched by a shutdown.
pub const UNINITIALIZED: NvmlReturn = 1;
/// A null pointer, a bad handle or an out-of-range index.
pub const INVALID_ARGUMENT: NvmlReturn = 2;
/// The device does not support the query.
pub const NOT_SUPPORTED: NvmlReturn = 3;
/// The caller lacks the privilege (setting memory limits needs root).
pub const NO_PERMISSION: NvmlReturn = 4;
/// No device matches the UUID or bus id, or no MIG device at that index.
pub const NOT_FOUND: NvmlReturn = 6;
/// The caller's buffer is too small; counts are written back where the API has one.
pub const INSUFFICIENT_SIZE: NvmlReturn = 7;
/// The driver is not loaded: here, the fixture could not be read at init.
pub const DRIVER_NOT_LOADED: NvmlReturn = 9;
/// No event arrived within the timeout of `nvmlEventSetWait*`.
pub const TIMEOUT: NvmlReturn = 10;
/// The GPU has fallen off the bus.
pub const GPU_IS_LOST: NvmlReturn = 15;
/// A versioned struct carried a version this library does not fill.
pub const ARGUMENT_VERSION_MISMATCH: NvmlReturn = 25;
/// Anything unexpected, including a caught panic and an invalid fixture at init.
pub const UNKNOWN: NvmlReturn = 999;

/// Every code NVML defines: number, name without the `NVML_ERROR_` prefix, and the text
/// `nvmlErrorString` returns for it.
const TABLE: &[(NvmlReturn, &str, &CStr)] = &[
    (0, "SUCCESS", c"Success"),
    (1, "UNINITIALIZED", c"Uninitialized"),
    (2, "INVALID_ARGUMENT", c"Invalid Argument"),
    (3, "NOT_SUPPORTED", c"Not Supported"),
    (4, "NO_PERMISSION", c"Insufficient Permissions"),
    (5, "ALREADY_INITIALIZED", c"Already Initialized"),
    (6, "NOT_FOUND", c"Not Found"),
    (7, "INSUFFICIENT_SIZE", c"Insufficient Size"),
    (8, "INSUFFICIENT_POWER", c"Insufficient External Power"),
    (9, "DRIVER_NOT_LOADED", c"Driver Not Loaded"),
    (10, "TIMEOUT", c"Timeout"),
    (11, "IRQ_ISSUE", c"Interrupt request issue"),
    (12, "LIBRARY_NOT_FOUND", c"NVML Shared Library Not Found"),
    (13, "FUNCTION_NOT_FOUND", c"Function Not Found"),
    (14, "CORRUPTED_INFOROM", c"Corrupted infoROM"),
    (15, "GPU_IS_LOST", c"GPU is lost"),
    (16, "RESET_REQUIRED", c"GPU requires restart"),
    (
        17,
        "OPERATING_SYSTEM",
        c"The operating system has blocked the request.",
    ),
    (
        18,
        "LIB_RM_VERSION_MISMATCH",
        c"RM has detected an NVML/RM version mismatch.",
    ),
    (19, "IN_USE", c"In use by another client"),
    (20, "MEMORY", c"Insufficient Memory"),
    (21, "NO_DATA", c"No data"),
    (
        22,
        "VGPU_ECC_NOT_SUPPORTED",
        c"The requested vgpu operation is not available on target device, because ECC is enabled",
    ),
    (
        23,
        "INSUFFICIENT_RESOURCES",
        c"Ran out of critical resources, other than memory",
    ),
    (
        24,
        "FREQ_NOT_SUPPORTED",
        c"The requested frequency is not supported",
    ),
    (
        25,
        "ARGUMENT_VERSION_MISMATCH",
        c"The provided version is invalid/unsupported",
    ),
    (
        26,
        "DEPRECATED",
        c"The requested functionality has been deprecated",
    ),
    (27, "NOT_READY", c"The system is not ready for the request"),
    (28, "GPU_NOT_FOUND", c"The GPU was not found"),
    (29, "INVALID_STATE", c"The requested state is invalid"),
    (999, "UNKNOWN", c"Unknown Error"),
];

/// The static string `nvmlErrorString` returns; unknown codes get "Unknown Error".
pub fn message(code: NvmlReturn) -> &'static CStr {
    TABLE
        .iter()
        .find(|(n, _, _)| *n == code)
        .map_or(c"Unknown Error", |(_, _, text)| text)
}

/// Parses a code as fixtures write it: `"GPU_IS_LOST"`, `"NVML_ERROR_GPU_IS_LOST"` (any
/// case), or a number in a string such as `"15"`.
pub fn parse_name(name: &str) -> Option<NvmlReturn> {
    let trimmed = name.trim();
    if let Ok(number) = trimmed.parse::<NvmlReturn>() {
        return Some(number);
    }
    let upper = trimmed.to_ascii_uppercase();
    let bare = upper
        .strip_prefix("NVML_ERROR_")
        .or_else(|| upper.strip_prefix("NVML_"))
        .unwrap_or(&upper);
    TABLE
        .iter()
        .find(|(_, n, _)| *n == bare)
        .map(|(code, _, _)| *code)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_and_numbers_parse() {
        assert_eq!(parse_name("GPU_IS_LOST"), Some(GPU_IS_LOST));
        assert_eq!(parse_name("nvml_error_gpu_is_lost"), Some(GPU_IS_LOST));
        assert_eq!(parse_name("NVML_SUCCESS"), Some(SUCCESS));
        assert_eq!(parse_name("999"), Some(UNKNOWN));
        assert_eq!(parse_name("driver_not_loaded"), Some(DRIVER_NOT_LOADED));
        assert_eq!(parse_name("NVML_ERROR_TIMEOUT"), Some(TIMEOUT));
        assert_eq!(parse_name("NO_SUCH_ERROR"), None);
    }

    #[test]
    fn messages_cover_known_and_unknown_codes() {
        assert_eq!(message(GPU_IS_LOST), c"GPU is lost");
        assert_eq!(message(INSUFFICIENT_SIZE), c"Insufficient Size");
        assert_eq!(message(12345), c"Unknown Error");
    }
}
