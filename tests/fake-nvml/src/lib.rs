//! Fake NVML.
