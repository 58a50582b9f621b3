#!/usr/bin/env python3
"""Writes a docker-archive tarball (what `ctr images import` reads) of one image made of a
static busybox: /bin/busybox and links to it, entry `sleep`. Tagged as the pause image the
containerd config pins, and as gpud.test/busybox:1 for the pods. No registry is needed.

    image.py BUSYBOX OUT.tar
"""

import hashlib
import io
import json
import sys
import tarfile

APPLETS = ["sh", "sleep", "env", "cat", "grep", "echo", "ls", "true"]
TAGS = ["registry.k8s.io/pause:3.10.1", "gpud.test/busybox:1"]


def layer(busybox: str) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for d in ["bin", "tmp", "dev", "proc", "sys", "etc"]:
            info = tarfile.TarInfo(d)
            info.type = tarfile.DIRTYPE
            info.mode = 0o1777 if d == "tmp" else 0o755
            tar.addfile(info)
        tar.add(busybox, arcname="bin/busybox")
        for applet in APPLETS:
            info = tarfile.TarInfo(f"bin/{applet}")
            info.type = tarfile.SYMTYPE
            info.linkname = "busybox"
            tar.addfile(info)
    return buf.getvalue()


def main() -> None:
    busybox, out = sys.argv[1], sys.argv[2]
    data = layer(busybox)
    diff_id = "sha256:" + hashlib.sha256(data).hexdigest()
    config = json.dumps({
        "architecture": "amd64",
        "os": "linux",
        "config": {"Cmd": ["/bin/sleep", "999999999"], "Env": ["PATH=/bin"]},
        "rootfs": {"type": "layers", "diff_ids": [diff_id]},
    }).encode()
    config_name = hashlib.sha256(config).hexdigest() + ".json"
    manifest = json.dumps([{"Config": config_name, "RepoTags": TAGS, "Layers": ["layer.tar"]}]).encode()
    with tarfile.open(out, mode="w") as tar:
        for name, blob in [("layer.tar", data), (config_name, config), ("manifest.json", manifest)]:
            info = tarfile.TarInfo(name)
            info.size = len(blob)
            tar.addfile(info, io.BytesIO(blob))


if __name__ == "__main__":
    main()
