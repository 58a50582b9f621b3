//! Configuration reload on `SIGHUP`: what a new file changes, what only a restart can
//! change, and handing the new settings to the broker as one command.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::broker::{Broker, BrokerSettings};
use crate::config::{Config, ConfigError};

use super::resolve_groups;

/// What a reload would do: the configuration to run with, the reloadable sections that
/// changed (with their new values, for the log), and the keys that changed in the file but
/// only take effect on a restart.
#[derive(Debug, Clone, PartialEq)]
pub struct ReloadPlan {
    /// The running configuration with the reloadable sections replaced.
    pub config: Config,
    /// `(section, new value)` for each reloadable section that changed.
    pub changed: Vec<(&'static str, String)>,
    /// Restart-only keys whose value in the file differs from the one gpud started with.
    pub needs_restart: Vec<&'static str>,
}

/// Plans a reload. `running` is the configuration in force (command-line overrides
/// included), `at_start` what the file said when gpud started, `file` what it says now.
/// Restart-only keys are compared file against file, so an override such as `--socket`
/// is neither lost nor reported as a change.
pub fn plan_reload(running: &Config, at_start: &Config, file: &Config) -> ReloadPlan {
    let mut config = running.clone();
    let mut changed = Vec::new();
    macro_rules! take {
        ($($field:ident).+, $name:literal) => {
            if config.$($field).+ != file.$($field).+ {
                config.$($field).+ = file.$($field).+.clone();
                changed.push(($name, format!("{:?}", config.$($field).+)));
            }
        };
    }
    take!(quotas, "quotas");
    take!(admin_groups, "admin_groups");
    take!(placement, "placement");
    take!(wait, "wait");
    take!(audit, "audit");
    take!(env, "env");
    take!(history, "history");
    take!(limits, "limits");

    let mut needs_restart = Vec::new();
    // The file as it is now, with everything named here set back to the start: whatever
    // still differs is a key this function does not know (a section added later), which
    // cannot be applied safely either.
    let mut rest = file.clone();
    macro_rules! restart_only {
        ($field:ident) => {
            if file.$field != at_start.$field {
                needs_restart.push(stringify!($field));
            }
            rest.$field = at_start.$field.clone();
        };
    }
    restart_only!(socket);
    restart_only!(socket_mode);
    restart_only!(state_dir);
    restart_only!(nvml_lib);
    restart_only!(server);
    restart_only!(metrics);
    restart_only!(kubelet);
    restart_only!(dra);
    restart_only!(isolation);
    restart_only!(cdi);
    rest.quotas = at_start.quotas.clone();
    rest.admin_groups = at_start.admin_groups.clone();
    rest.placement = at_start.placement.clone();
    rest.wait = at_start.wait.clone();
    rest.audit = at_start.audit.clone();
    rest.env = at_start.env.clone();
    rest.history = at_start.history.clone();
    rest.limits = at_start.limits.clone();
    if rest != *at_start {
        needs_restart.push("other sections");
    }
    ReloadPlan {
        config,
        changed,
        needs_restart,
    }
}

/// Why a reload was refused (the running configuration stays).
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The file is missing, unreadable or invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// An admin group does not resolve.
    #[error("{path}: {source}")]
    Groups {
        /// The config file.
        path: PathBuf,
        /// Which group.
        #[source]
        source: Box<super::ServeError>,
    },
    /// The broker could not take the new settings (it is stopping).
    #[error("{path}: the new settings were not applied: {source}")]
    Broker {
        /// The config file.
        path: PathBuf,
        /// Why.
        #[source]
        source: crate::broker::BrokerError,
    },
}

/// Re-reads `path` and applies its reloadable sections to the broker, logging each change.
/// A file that does not load (including a missing one: that is a mistake, not a request to
/// drop every quota) is refused as a whole and the running configuration stays.
pub fn reload(broker: &Broker, path: &Path, at_start: &Config) -> Result<ReloadPlan, ReloadError> {
    let file = Config::load(path, true)?;
    let admin_gids = resolve_groups(&file.admin_groups).map_err(|source| ReloadError::Groups {
        path: path.to_owned(),
        source: Box::new(source),
    })?;
    let running = broker.settings();
    let plan = plan_reload(&running.config, at_start, &file);
    // The broker also tries the queue again: a larger quota or a new policy may let
    // queued requests through now.
    broker
        .reload(BrokerSettings {
            admin_gids,
            config: plan.config.clone(),
            groups: crate::broker::GroupLookup::default(),
        })
        .wait()
        .map_err(|source| ReloadError::Broker {
            path: path.to_owned(),
            source,
        })?;
    // Each changed section as the file writes it (inline TOML), or `defaults` when the file
    // no longer has it.
    let written: Option<toml::Table> = std::fs::read_to_string(path)
        .ok()
        .and_then(|text| text.parse().ok());
    for (section, _) in &plan.changed {
        let now = written
            .as_ref()
            .and_then(|t| t.get(*section))
            .map_or_else(|| "defaults".to_owned(), ToString::to_string);
        tracing::info!(config = %path.display(), section, %now, "config section changed on reload");
    }
    if plan.changed.is_empty() {
        tracing::info!(config = %path.display(), "config reloaded: no reloadable section changed");
    }
    for key in &plan.needs_restart {
        tracing::warn!(
            config = %path.display(),
            key,
            "changed in the file but takes effect only after a restart; still running with the old value"
        );
    }
    Ok(plan)
}

/// Reloads on every `SIGHUP`, telling systemd (`RELOADING=1` … `READY=1`) around it.
pub(super) async fn reload_on_hangup(
    mut sighup: tokio::signal::unix::Signal,
    broker: Arc<Broker>,
    path: PathBuf,
    at_start: Config,
) {
    while sighup.recv().await.is_some() {
        let mut states = vec![sd_notify::NotifyState::Reloading];
        if let Ok(now) = sd_notify::NotifyState::monotonic_usec_now() {
            states.push(now);
        }
        let _ = sd_notify::notify(&states);
        tracing::info!(config = %path.display(), "SIGHUP: reloading the configuration");
        let (b, p, s) = (broker.clone(), path.clone(), at_start.clone());
        match tokio::task::spawn_blocking(move || reload(&b, &p, &s)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => tracing::error!(
                error = %e,
                "config reload rejected; still running with the previous configuration"
            ),
            Err(e) => tracing::error!(error = %e, "config reload failed"),
        }
        let _ = sd_notify::notify(&[sd_notify::NotifyState::Ready]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Config {
        Config::parse(text).unwrap()
    }

    #[test]
    fn reload_applies_reloadable_sections_and_keeps_overrides() {
        let at_start = parse("[[quotas]]\nuid = 1\nmax_gpus = 1\n");
        // Started with --socket and --state-dir.
        let mut running = at_start.clone();
        running.socket = PathBuf::from("/tmp/test.sock");
        running.state_dir = PathBuf::from("/tmp/state");
        let file =
            parse("[[quotas]]\nuid = 1\nmax_gpus = 2\n[placement]\ndefault_policy = \"spread\"\n");
        let plan = plan_reload(&running, &at_start, &file);
        let changed: Vec<&str> = plan.changed.iter().map(|(s, _)| *s).collect();
        assert_eq!(changed, ["quotas", "placement"]);
        assert_eq!(plan.config.quotas[0].max_gpus, Some(2));
        assert_eq!(plan.config.socket, PathBuf::from("/tmp/test.sock"));
        assert_eq!(plan.config.state_dir, PathBuf::from("/tmp/state"));
        assert!(plan.needs_restart.is_empty(), "{:?}", plan.needs_restart);
    }

    #[test]
    fn restart_only_keys_are_reported_and_not_applied() {
        let at_start = parse("");
        let file = parse(
            "socket = \"/run/other.sock\"\n[server]\nmax_body_bytes = 1024\n[kubelet]\nenabled = true\n\
             [isolation]\nrequire = true\n",
        );
        let plan = plan_reload(&at_start, &at_start, &file);
        assert_eq!(
            plan.needs_restart,
            ["socket", "server", "kubelet", "isolation"]
        );
        assert_eq!(plan.config, at_start);
        assert!(plan.changed.is_empty());
    }

    #[test]
    fn an_unchanged_file_changes_nothing() {
        let c = parse("[audit]\ninterval = \"1s\"\n");
        let plan = plan_reload(&c, &c, &c);
        assert!(plan.changed.is_empty() && plan.needs_restart.is_empty());
        assert_eq!(plan.config, c);
    }
}
