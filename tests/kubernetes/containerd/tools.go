//go:build tools

// Package tools names the containerd commands tests/kubernetes/run builds, pinned by this
// go.mod and go.sum. A module of its own: containerd and Kubernetes pin different versions
// of the modules they share (k8s.io/cri-api, gRPC, OpenTelemetry). It is never compiled.
package tools

import (
	_ "github.com/containerd/containerd/v2/cmd/containerd"
	_ "github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2"
	_ "github.com/containerd/containerd/v2/cmd/ctr"
)
