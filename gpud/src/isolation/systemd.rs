//! Placeholder until the D-Bus scope module lands (replaced on merge).

/// Why a scope could not be started.
#[derive(Debug, thiserror::Error)]
#[error("{0}")]
pub struct ScopeError(String);

/// systemd's manager.
#[derive(Debug)]
pub struct Systemd;

impl Systemd {
    /// Connects.
    pub fn connect() -> Result<Systemd, ScopeError> {
        Err(ScopeError("transient scopes are not built yet".into()))
    }

    /// Starts a scope.
    pub fn start_scope(&self, _: &str, _: &str, _: u32, _: &str) -> Result<String, ScopeError> {
        Err(ScopeError("transient scopes are not built yet".into()))
    }
}

/// The scope's unit name.
pub fn scope_name(id: &str) -> String {
    format!("gpud-{id}.scope")
}
