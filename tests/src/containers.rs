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

pub fn shell_quoted(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

pub fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}
