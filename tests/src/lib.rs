//! Helpers for the integration tests: locating the built binaries and fixtures.
