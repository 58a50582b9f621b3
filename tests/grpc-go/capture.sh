#!/usr/bin/env bash
# Writes tests/fixtures/grpc-go/*.bin: the bytes grpc-go sends when the kubelet calls a plugin
# over a Unix socket, dialled as the kubelet dials (grpc.Dial with the bare socket path and a
# context dialer, no WithAuthority), so that `:authority` is the path, percent-encoded.
# Each capture is one connection with two or three calls; the listener (listen.py) answers
# only the HTTP/2 SETTINGS, so every call ends at its deadline and the file holds exactly
# what the client sent. Needs Go and the Go module proxy; run as root (it binds under
# /var/lib/kubelet, the paths a real node uses, and removes them again).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
out="$here/../fixtures/grpc-go"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
(cd "$here" && go build -o "$work/client" .)
pb() { # a length-delimited protobuf field: pb FIELD BYTES-AS-HEX
    printf '%02x%02x%s' $(( $1 << 3 | 2 )) $(( ${#2} / 2 )) "$2"
}
hex() { printf '%s' "$1" | od -An -tx1 | tr -d ' \n'; }
claim=$(pb 1 "$(pb 1 "$(hex ml)")$(pb 2 "$(hex 4f1c9e52-7d5b-4c1e-9a43-1d2b3c4d5e6f)")$(pb 3 "$(hex reuse)")")
capture() { # capture SOCKET FILE METHOD BODY ...
    local socket=$1 file=$2
    shift 2
    python3 "$here/listen.py" "$socket" "$work/capture" &
    while [ ! -S "$socket" ]; do sleep 0.05; done
    "$work/client" "$socket" "$@"
    wait
    mv "$work/capture" "$out/$file"
}
capture /var/lib/kubelet/plugins_registry/gpu.gpud.io-reg.sock registration.bin \
    /pluginregistration.Registration/GetInfo "" \
    /pluginregistration.Registration/NotifyRegistrationStatus 0801
dra=/k8s.io.kubelet.pkg.apis.dra.v1.DRAPlugin
capture /var/lib/kubelet/plugins/gpu.gpud.io/dra.sock dra.bin \
    $dra/NodePrepareResources "$claim" $dra/NodeUnprepareResources "$claim" \
    $dra/NodePrepareResources "$claim"
capture /var/lib/kubelet/device-plugins/gpud-gpu-mem.sock device-plugin.bin \
    /v1beta1.DevicePlugin/GetDevicePluginOptions "" /v1beta1.DevicePlugin/GetDevicePluginOptions ""
