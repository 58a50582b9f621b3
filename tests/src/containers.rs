//! A real container runtime for tests and benchmarks: Podman with runc, and the busybox
//! image they run, made from the host's static busybox (no registry).

use std::process::{Command, Output};

/// Where Podman reads CDI specs (besides `/etc/cdi`).
pub const SPEC_DIR: &str = "/var/run/cdi";
/// The image every test runs: busybox, imported from the host's static binary.
pub const IMAGE: &str = "localhost/gpud-test-busybox:latest";
/// Imports [`IMAGE`] from `/bin/busybox` into root's image store, or `user`'s.
pub fn make_image(user: Option<&str>) {
    let root = tempfile::tempdir().unwrap();
    std::fs::set_permissions(
        root.path(),
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let bin = root.path().join("rootfs/bin");
    std::fs::create_dir_all(&bin).unwrap();
    std::fs::copy("/bin/busybox", bin.join("busybox")).unwrap();
    for applet in ["sh", "cat", "env", "sleep", "true", "grep", "tail"] {
        std::os::unix::fs::symlink("busybox", bin.join(applet)).unwrap();
    }
    let tar = root.path().join("rootfs.tar");
    let made = Command::new("tar")
        .arg("-C")
        .arg(root.path().join("rootfs"))
        .arg("-cf")
        .arg(&tar)
        .arg(".")
        .status()
        .unwrap();
    assert!(made.success());
    std::fs::set_permissions(&tar, std::os::unix::fs::PermissionsExt::from_mode(0o644)).unwrap();
    let out = podman_as(user, &["import", &tar.display().to_string(), IMAGE]);
    assert!(out.status.success(), "podman import: {}", text(&out.stderr));
}

/// `podman --runtime runc ARGS`, as root or as `user` (rootless, from its home).
pub fn podman_as(user: Option<&str>, args: &[&str]) -> Output {
    match user {
        None => Command::new("podman")
            .args(["--runtime", "runc"])
            .args(args)
            .output()
            .unwrap(),
        Some(user) => {
            let quoted: Vec<String> = args.iter().map(|a| shell_quoted(a)).collect();
            Command::new("su")
                .args([user, "-c"])
                .arg(format!("cd && podman --runtime runc {}", quoted.join(" ")))
                .output()
                .unwrap()
        }
    }
}

/// `podman run` flags every test's container takes: no network (none here), limits within
/// this sandbox's (the defaults exceed its hard limits).
pub const RUN: [&str; 7] = [
    "run",
    "--network",
    "none",
    "--ulimit",
    "nofile=1024:1024",
    "--ulimit",
    "nproc=1024:1024",
];

/// `podman run RUN… FLAGS… IMAGE COMMAND…`, as root or as `user`.
pub fn run_container(user: Option<&str>, flags: &[&str], command: &[&str]) -> Output {
    let mut args: Vec<&str> = RUN.to_vec();
    args.extend_from_slice(flags);
    args.push(IMAGE);
    args.extend_from_slice(command);
    podman_as(user, &args)
}

/// Where [`host_program`] mounts a program in the container.
pub const HOST_PROGRAMS: &str = "/opt/gpud-test";

/// `podman run` flags that mount the host's dynamically linked `program` read-only at
/// `HOST_PROGRAMS/<its name>` with the shared libraries it needs (as `ldd` lists them, the
/// dynamic loader included) at their own paths: the busybox image has no C library. The
/// program's path in the container, and the flags. Mounted rather than built statically:
/// the test runs the very binary the other tests run on the host.
pub fn host_program(program: &std::path::Path) -> (String, Vec<String>) {
    let name = program.file_name().unwrap().to_string_lossy().into_owned();
    let inside = format!("{HOST_PROGRAMS}/{name}");
    let ldd = Command::new("ldd").arg(program).output().unwrap();
    assert!(
        ldd.status.success(),
        "ldd {}: {}",
        program.display(),
        text(&ldd.stderr)
    );
    // `libc.so.6 => /lib/x86_64-linux-gnu/libc.so.6 (0x…)` and `/lib64/ld-linux….so.2 (0x…)`;
    // the vDSO has no file.
    let libraries: Vec<String> = text(&ldd.stdout)
        .lines()
        .filter_map(|line| {
            let path = match line.split_once("=>") {
                Some((_, right)) => right.split_whitespace().next()?,
                None => line.split_whitespace().next()?,
            };
            path.starts_with('/').then(|| path.to_owned())
        })
        .collect();
    assert!(!libraries.is_empty(), "{}", text(&ldd.stdout));
    let mut flags = vec![
        "-v".to_owned(),
        format!("{}:{inside}:ro", program.display()),
    ];
    for library in libraries {
        flags.push("-v".to_owned());
        flags.push(format!("{library}:{library}:ro"));
    }
    (inside, flags)
}

pub fn shell_quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
