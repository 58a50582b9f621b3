use super::*;

#[test]
fn shipped_example_parses_and_differs_from_defaults_only_where_it_says() {
    let text = include_str!("../../../systemd/gpud.toml");
    let config = Config::parse(text).unwrap();
    assert_eq!(config.socket, PathBuf::from("/run/gpud/gpud.sock"));
    assert_eq!(config.state_dir, PathBuf::from("/var/lib/gpud"));
    assert_eq!(config.audit.interval, Duration::from_secs(2));
    assert_eq!(config.audit.xid_ignore, APPLICATION_XIDS);
    assert_eq!(config.history, HistoryConfig::default());
    // Installed as /etc/gpud/gpud.toml, it must limit nobody; its commented-out quota
    // example must be valid once uncommented.
    assert!(
        config.quotas.is_empty(),
        "the installed example sets a quota"
    );
    let example: Vec<&str> = text
        .lines()
        .skip_while(|l| *l != "# [[quotas]]")
        .take_while(|l| l.starts_with('#'))
        .map(|l| l.trim_start_matches('#').trim_start())
        .collect();
    let quotas = Config::parse(&example.join("\n")).unwrap().quotas;
    assert_eq!(quotas.len(), 2, "the example shows a uid and a gid quota");
}

/// Every key the config structs accept, as `(section, key)` (`""` for the top level),
/// read from the parser itself: `deny_unknown_fields` lists them all in its refusal of
/// an unknown one, so a key added to a struct shows up here with no list to update.
fn every_key() -> Vec<(String, String)> {
    // "expected `a`", "expected `a` or `b`", "expected one of `a`, `b`, `c`".
    fn fields(refusal: Result<Config, String>) -> Option<Vec<String>> {
        let e = refusal.err()?;
        let (_, list) = e.split_once("unknown field `no_such_key`, expected ")?;
        Some(
            list.split('`')
                .skip(1)
                .step_by(2)
                .map(str::to_owned)
                .collect(),
        )
    }
    let mut keys = Vec::new();
    for top in fields(Config::parse("no_such_key = 0")).unwrap() {
        let table = fields(Config::parse(&format!("[{top}]\nno_such_key = 0")))
            .or_else(|| fields(Config::parse(&format!("[[{top}]]\nno_such_key = 0"))));
        match table {
            Some(table) => keys.extend(table.into_iter().map(|k| (top.clone(), k))),
            None => keys.push((String::new(), top)),
        }
    }
    keys
}

#[test]
fn shipped_example_names_every_key_with_its_default() {
    let text = include_str!("../../../systemd/gpud.toml");
    // Keys set in the file are the defaults; the commented-out ones are examples of
    // what to set where the default is "none" (and the quotas).
    assert_eq!(Config::parse(text).unwrap(), Config::default());
    let mut section = String::new();
    let mut found = std::collections::BTreeSet::new();
    for line in text.lines() {
        let line = line.trim_start_matches('#').trim();
        if let Some(name) = line.strip_prefix('[') {
            section = name.trim_matches(|c| c == '[' || c == ']').to_owned();
        } else if let Some((key, _)) = line.split_once(" = ") {
            found.insert((section.clone(), key.trim().to_owned()));
        }
    }
    let keys = every_key();
    assert!(keys.len() > 30, "the key discovery broke: {keys:?}");
    let missing: Vec<_> = keys.iter().filter(|k| !found.contains(*k)).collect();
    assert!(missing.is_empty(), "systemd/gpud.toml lacks {missing:?}");
}

#[test]
fn socket_mode_is_octal_and_at_most_0o777() {
    for text in [
        "socket_mode = 0o660",
        "socket_mode = \"0660\"",
        "socket_mode = \"660\"",
        "socket_mode = \"0o660\"",
        "socket_mode = 0x1b0",
    ] {
        assert_eq!(Config::parse(text).unwrap().socket_mode, 0o660, "{text}");
    }
    assert_eq!(Config::parse("socket_mode = 0").unwrap().socket_mode, 0);
    let refused = |text: &str| Config::parse(text).unwrap_err();
    assert_eq!(
        refused("socket_mode = 666"),
        "line 1, column 15: socket_mode: 666 is decimal (octal 1232); write socket_mode = 0o666"
    );
    // In range, but it reads either way: 444 would be 0o674.
    assert_eq!(
        refused("\nsocket_mode = 444\n"),
        "line 2, column 15: socket_mode: 444 is decimal, which is 0o674; write socket_mode = \
         0o674 for that, or socket_mode = 0o444 if you meant octal"
    );
    // Only decimal can be meant: taken, as before (configurations that worked still do).
    assert_eq!(
        Config::parse("socket_mode = 438").unwrap().socket_mode,
        0o666
    );
    assert!(refused("socket_mode = 888").contains("more than 0o777"));
    assert_eq!(
        refused("socket_mode = 0o1666"),
        "line 1, column 15: socket_mode: 0o1666 has bits outside 0o777 (a socket has only \
         read, write and execute bits); write e.g. socket_mode = 0o666"
    );
    assert_eq!(
        refused("socket_mode = \"0668\""),
        "line 1, column 15: socket_mode: \"0668\" is not an octal permission mode; write \
         e.g. socket_mode = 0o666"
    );
    assert!(refused("socket_mode = \"1777\"").contains("bits outside 0o777"));
    assert!(refused("socket_mode = -1").contains("not a permission mode"));
    assert!(refused("socket_mode = \"+666\"").contains("not an octal"));
}

#[test]
fn parse_errors_are_one_line_with_line_and_column() {
    let e = Config::parse("[audit]\nintervall = \"2s\"\n").unwrap_err();
    assert!(
        e.starts_with(
            "line 2, column 1: audit: unknown field `intervall`, expected one of `interval`"
        ),
        "{e}"
    );
    assert!(
        !e.contains('\n') && !e.contains('|') && !e.contains('^'),
        "{e}"
    );
    let e =
        Config::parse("socket = \"/tmp/x\"\n[wait]\nmax_wait_seconds = \"long\"\n").unwrap_err();
    assert!(
        e.starts_with("line 3, column 20: wait.max_wait_seconds: invalid type"),
        "{e}"
    );
    let e = Config::parse("socket = \n").unwrap_err();
    assert!(e.starts_with("line 1, column "), "{e}");
    assert!(!e.contains('\n'), "{e}");
    // Validation errors have no position; they name the key.
    assert_eq!(
        Config::parse("[server]\nmax_connections = 0\n").unwrap_err(),
        "server.max_connections must be at least 1"
    );
}

#[test]
fn load_errors_name_the_file_once_and_the_cause_once() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("c.toml");
    std::fs::write(&path, "[audit]\nintervall = \"2s\"\n").unwrap();
    let e = Config::load(&path, true).unwrap_err().to_string();
    assert!(
        e.starts_with(&format!(
            "invalid config {}: line 2, column 1: audit: unknown field `intervall`",
            path.display()
        )),
        "{e}"
    );
    let missing = dir.path().join("missing.toml");
    let e = Config::load(&missing, true).unwrap_err();
    assert_eq!(
        e.to_string(),
        format!(
            "cannot read config {}: No such file or directory (os error 2)",
            missing.display()
        )
    );
    assert!(
        std::error::Error::source(&e).is_some(),
        "the io::Error stays the source"
    );
    assert_eq!(Config::load(&missing, false).unwrap(), Config::default());
}

#[test]
fn empty_file_is_the_defaults() {
    assert_eq!(Config::parse("").unwrap(), Config::default());
}

#[test]
fn unknown_keys_are_named() {
    let e = Config::parse("sockett = \"/tmp/x\"\n").unwrap_err();
    assert!(e.contains("sockett"), "{e}");
    let e = Config::parse("[[quotas]]\nuid = 1\nmax_reservation = 4\n").unwrap_err();
    assert!(e.contains("max_reservation"), "{e}");
}

#[test]
fn sizes_and_durations_are_human() {
    let c = Config::parse(
        "[audit]\ninterval = \"500ms\"\n[[quotas]]\ngid = 100\nmax_memory = \"40G\"\n[wait]\nstarvation_after = \"2m\"\n",
    )
    .unwrap();
    assert_eq!(c.audit.interval, Duration::from_millis(500));
    assert_eq!(c.quotas[0].max_memory, Some(40 << 30));
    assert_eq!(c.wait.starvation_after, Duration::from_secs(120));
    assert!(
        Config::parse("[audit]\ninterval = \"soon\"\n")
            .unwrap_err()
            .contains("soon")
    );
    assert!(Config::parse("[[quotas]]\nuid = 1\nmax_memory = \"25%\"\n").is_err());
}

#[test]
fn audit_settings_parse() {
    let c = Config::parse(
        "[audit]\nenforcement = \"terminate\"\ngrace = \"3s\"\nover_limit_tolerance = \"256MiB\"\n[metrics]\nlisten = \"127.0.0.1:9400\"\n",
    )
    .unwrap();
    assert_eq!(c.audit.enforcement, Enforcement::Terminate);
    assert_eq!(c.audit.grace, Duration::from_secs(3));
    assert_eq!(
        c.audit.over_limit_tolerance.limit(1 << 30),
        (1 << 30) + (256 << 20)
    );
    assert_eq!(Tolerance::BasisPoints(500).limit(1000), 1050);
    assert_eq!(c.metrics.listen.unwrap().port(), 9400);
    assert_eq!(c.audit.xid_ignore, APPLICATION_XIDS);
    let c = Config::parse("[audit]\nxid_ignore = [13, 43]\n").unwrap();
    assert_eq!(c.audit.xid_ignore, [13, 43]);
    assert!(
        Config::parse("[audit]\nxid_ignore = \"13\"\n")
            .unwrap_err()
            .contains("xid_ignore")
    );
    assert!(
        Config::parse("[audit]\nenforcement = \"maim\"\n")
            .unwrap_err()
            .contains("maim")
    );
}

#[test]
fn kubelet_section_parses_with_defaults_and_units() {
    let c = Config::parse(
        "[kubelet]\nenabled = true\nmem_unit = \"512MiB\"\nallocation_grace = \"2s\"\n",
    )
    .unwrap();
    assert!(c.kubelet.enabled);
    assert_eq!(c.kubelet.mem_unit, 512 << 20);
    assert_eq!(c.kubelet.allocation_grace, Duration::from_secs(2));
    assert_eq!(
        c.kubelet.kubelet_socket(),
        PathBuf::from("/var/lib/kubelet/device-plugins/kubelet.sock")
    );
    assert_eq!(c.kubelet.gpuctl_dir, None);
    assert_eq!(
        Config::parse("[kubelet]\ngpuctl_dir = \"/var/lib/gpud/bin\"\n")
            .unwrap()
            .kubelet
            .gpuctl_dir,
        Some(PathBuf::from("/var/lib/gpud/bin"))
    );
    assert!(
        Config::parse("[kubelet]\ngpuctl_dir = \"bin\"\n")
            .unwrap_err()
            .contains("absolute")
    );
    assert!(Config::parse("[kubelet]\nmem_unit = \"10%\"\n").is_err());
    assert!(Config::parse("[kubelet]\nmem_unit = 1024\n").is_err());
    assert!(
        Config::parse("[kubelet]\nenable = true\n")
            .unwrap_err()
            .contains("enable")
    );
}

#[test]
fn cdi_section_parses_and_wants_absolute_paths() {
    let c = Config::parse("[cdi]\nenabled = true\nhook = \"/var/lib/gpud/bin/gpuctl\"\n").unwrap();
    assert!(c.cdi.enabled);
    assert_eq!(c.cdi.spec_dir, PathBuf::from("/var/run/cdi"));
    assert_eq!(c.cdi.hook, PathBuf::from("/var/lib/gpud/bin/gpuctl"));
    assert_eq!(
        Config::parse("[cdi]\nhook = \"gpuctl\"\n").unwrap_err(),
        "cdi.hook must be an absolute path, not gpuctl"
    );
    assert_eq!(
        Config::parse("[cdi]\nspec_dir = \"cdi\"\n").unwrap_err(),
        "cdi.spec_dir must be an absolute path, not cdi"
    );
    assert!(
        Config::parse("[cdi]\nspecdir = \"/etc/cdi\"\n")
            .unwrap_err()
            .contains("specdir")
    );
}

#[test]
fn a_quota_names_exactly_one_subject() {
    assert!(
        Config::parse("[[quotas]]\nmax_gpus = 1\n")
            .unwrap_err()
            .contains("exactly one")
    );
    assert!(Config::parse("[[quotas]]\nuid = 1\ngid = 1\n").is_err());
}

#[test]
fn the_dra_driver_needs_cdi_and_a_sane_resync() {
    let e = Config::parse("[dra]\nenabled = true\n").unwrap_err();
    assert!(e.contains("dra.enabled needs cdi.enabled"), "{e}");
    let on = Config::parse("[cdi]\nenabled = true\n[dra]\nenabled = true\nnode_name = \"n1\"\n")
        .unwrap();
    assert_eq!(on.dra.node_name.as_deref(), Some("n1"));
    assert_eq!(on.dra.kubelet_dir, std::path::Path::new("/var/lib/kubelet"));
    let e = Config::parse("[dra]\nresync_interval = \"10ms\"\n").unwrap_err();
    assert!(e.contains("dra.resync_interval"), "{e}");
    for bad in ["10ms", "40s"] {
        let e = Config::parse(&format!("[dra]\napi_timeout = \"{bad}\"\n")).unwrap_err();
        assert!(e.contains("dra.api_timeout"), "{e}");
    }
}

#[test]
fn metrics_labels_that_would_show_under_one_name_are_refused() {
    let e = Config::parse("[metrics]\nlabels = [\"slurm.job\", \"slurm-job\"]\n").unwrap_err();
    assert!(e.contains("label_slurm_job"), "{e}");
    let e = Config::parse("[metrics]\nlabels = [\"\"]\n").unwrap_err();
    assert!(e.contains("empty"), "{e}");
    let c = Config::parse("[metrics]\nlabels = [\"team\"]\nmax_series = 50\n").unwrap();
    assert_eq!(
        (c.metrics.labels, c.metrics.max_series),
        (vec!["team".to_owned()], 50)
    );
}
