# A one-node Kubernetes on loopback for tests/kubernetes/run, built from the Go modules
# pinned in tests/kubernetes/go.mod (kube-apiserver, kube-controller-manager,
# kube-scheduler, kubelet, kubectl 1.36.3, etcd 3.6.8) and tests/kubernetes/containerd/go.mod
# (containerd 2.2.9 and its runc shim), with Debian's runc. Source it, then:
#
#   k8s_build
#       builds the binaries into target/kubernetes/bin unless a build of the same go.mod and
#       go.sum is there (target/kubernetes/bin/.stamp); Go's module and build caches are in
#       target/kubernetes too. -trimpath, -ldflags='-s -w' (no symbol table, no DWARF), cgo off.
#   k8s_pki DIR
#       a CA, the API server's serving certificate, the service-account signing key, static
#       tokens for the admin, the scheduler, the controller-manager and the kubelet
#       (system:node:$K8S_NODE), and a kubeconfig for each, under DIR/pki.
#   k8s_start_control_plane DIR
#       etcd, kube-apiserver (TLS, tokens, Node and RBAC authorization), the scheduler and
#       the controller-manager; waits until the API server answers.
#   k8s_start_node DIR
#       containerd (CDI on, specs from DIR/cdi, root and state under DIR/containerd) and the
#       kubelet (root directory DIR/kubelet, cgroupfs, cgroup v1 allowed); waits until the
#       node is Ready. k8s_start_kubelet and k8s_stop_kubelet start and stop the kubelet alone.
#   k8s_stop
#       stops all of it, kills what runs in the pods' cgroups, removes those cgroups,
#       unmounts whatever is mounted under DIR, and removes what the daemons leave at fixed
#       paths (shim sockets in /run/containerd/s, log links in /var/log/containers). Safe
#       to call twice.
#
# Every daemon logs to DIR/log/NAME.log and runs in a session of its own, its pid in
# DIR/run/NAME.pid. Ports are on 127.0.0.1 only: etcd 23790/23800, the API server 16443,
# the kubelet 20250/20248, the scheduler 20259, the controller-manager 20257.

# Go 1.26 or newer builds the binaries; where it is installed but not on PATH, at its usual
# place.
command -v go >/dev/null || PATH=/usr/local/go/bin:$PATH

K8S_NODE=${K8S_NODE:-gpud-node}
K8S_API=https://127.0.0.1:16443
k8s_root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
k8s_bin=$k8s_root/target/kubernetes/bin
K8S_DIR=

# The versions the binaries report: what Kubernetes' own build (hack/lib/version.sh) sets,
# which a plain `go build` of the module leaves at v0.0.0-master.
k8s_version=v1.36.3
k8s_ldflags="-s -w"
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
    k8s_ldflags+=" -X $pkg.gitVersion=$k8s_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=36 -X $pkg.gitTreeState=clean"
done

k8s_build() {
    local stamp want t0
    want=$( (cat "$k8s_root"/tests/kubernetes/go.{mod,sum} "$k8s_root"/tests/kubernetes/containerd/go.{mod,sum} \
        "$k8s_root"/tests/kubernetes/etcd/main.go; echo "$k8s_ldflags") | sha256sum | cut -d' ' -f1)
    stamp=$k8s_bin/.stamp
    if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
        echo "kubernetes: reusing the build in $k8s_bin"
        return 0
    fi
    t0=$SECONDS
    if ! command -v go >/dev/null; then
        echo "kubernetes: no Go to build Kubernetes with: install Go 1.26 or newer (https://go.dev/dl), or put it on PATH" >&2
        return 1
    fi
    mkdir -p "$k8s_bin"
    (
        export GOMODCACHE=$k8s_root/target/kubernetes/gomod GOCACHE=$k8s_root/target/kubernetes/gocache
        # The proxy serves the modules; go.sum, committed, is what they are checked against.
        export GOFLAGS=-mod=readonly GOSUMDB=off CGO_ENABLED=0
        set -e
        cd "$k8s_root/tests/kubernetes"
        nice -n 10 go build -trimpath -ldflags="$k8s_ldflags" -o "$k8s_bin/" ./etcd \
            k8s.io/kubernetes/cmd/kube-apiserver k8s.io/kubernetes/cmd/kube-controller-manager \
            k8s.io/kubernetes/cmd/kube-scheduler k8s.io/kubernetes/cmd/kubelet k8s.io/kubernetes/cmd/kubectl
        cd containerd
        nice -n 10 go build -trimpath -ldflags='-s -w' -o "$k8s_bin/" \
            github.com/containerd/containerd/v2/cmd/containerd \
            github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2 \
            github.com/containerd/containerd/v2/cmd/ctr
    ) || return 1
    echo "$want" > "$stamp"
    echo "kubernetes: built in $((SECONDS - t0)) s"
}

# A kubeconfig for the API server with bearer token $2, written to $1.
k8s_kubeconfig() {
    cat > "$1" <<EOF
apiVersion: v1
kind: Config
clusters:
- name: test
  cluster:
    server: $K8S_API
    certificate-authority: $K8S_DIR/pki/ca.crt
users:
- name: user
  user:
    token: $2
contexts:
- name: test
  context: {cluster: test, user: user}
current-context: test
EOF
}

k8s_pki() {
    K8S_DIR=$1
    local p=$K8S_DIR/pki
    mkdir -p "$p" "$K8S_DIR/log" "$K8S_DIR/run"
    openssl req -x509 -newkey rsa:2048 -nodes -keyout "$p/ca.key" -out "$p/ca.crt" -days 2 \
        -subj /CN=gpud-test-ca 2>/dev/null
    openssl req -newkey rsa:2048 -nodes -keyout "$p/apiserver.key" -out "$p/apiserver.csr" \
        -subj /CN=kube-apiserver 2>/dev/null
    openssl x509 -req -in "$p/apiserver.csr" -CA "$p/ca.crt" -CAkey "$p/ca.key" -CAcreateserial \
        -out "$p/apiserver.crt" -days 2 \
        -extfile <(printf 'subjectAltName=IP:127.0.0.1,IP:10.96.0.1,DNS:localhost,DNS:kubernetes.default.svc') 2>/dev/null
    openssl genrsa -out "$p/sa.key" 2048 2>/dev/null
    openssl rsa -in "$p/sa.key" -pubout -out "$p/sa.pub" 2>/dev/null
    local name user group tok
    : > "$p/tokens.csv"
    for name in admin scheduler controller-manager kubelet; do
        case $name in
            admin) user=admin group=system:masters ;;
            scheduler) user=system:kube-scheduler group= ;;
            controller-manager) user=system:kube-controller-manager group= ;;
            kubelet) user=system:node:$K8S_NODE group=system:nodes ;;
        esac
        tok=$(head -c 16 /dev/urandom | od -An -tx1 | tr -d ' \n')
        printf '%s,%s,%s%s\n' "$tok" "$user" "$name" "${group:+,$group}" >> "$p/tokens.csv"
        k8s_kubeconfig "$p/$name.kubeconfig" "$tok"
    done
}

# Starts "$@" as daemon $name, in a session of its own, logging to log/$name.log.
k8s_spawn() {
    local name=$1
    shift
    GPUD_K8S_TEST=$K8S_DIR setsid "$@" >> "$K8S_DIR/log/$name.log" 2>&1 < /dev/null &
    echo $! > "$K8S_DIR/run/$name.pid"
    disown $!
}

k8s_running() {
    local pid
    pid=$(cat "$K8S_DIR/run/$1.pid" 2>/dev/null) && kill -0 "$pid" 2>/dev/null
}

# Waits up to $1 seconds for "${@:2}" to succeed; 1 when it never did.
k8s_wait() {
    local deadline=$((SECONDS + $1))
    shift
    until "$@" >/dev/null 2>&1; do
        ((SECONDS < deadline)) || return 1
        sleep 0.5
    done
}

kubectl() { "$k8s_bin/kubectl" --kubeconfig "$K8S_DIR/pki/admin.kubeconfig" --cache-dir "$K8S_DIR/kubectl-cache" "$@"; }

k8s_start_control_plane() {
    K8S_DIR=$1
    local p=$K8S_DIR/pki
    # The audit log keeps each ResourceSlice write as the client sent it, so that the run can
    # check what gpud sent, before the API server dropped or defaulted anything.
    cat > "$K8S_DIR/audit-policy.yaml" <<'EOF'
apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Request
  verbs: [create, update, patch]
  resources: [{group: resource.k8s.io, resources: [resourceslices]}]
- level: None
EOF
    k8s_spawn etcd "$k8s_bin/etcd" --name test --data-dir "$K8S_DIR/etcd" \
        --listen-client-urls http://127.0.0.1:23790 --advertise-client-urls http://127.0.0.1:23790 \
        --listen-peer-urls http://127.0.0.1:23800 --initial-advertise-peer-urls http://127.0.0.1:23800 \
        --initial-cluster test=http://127.0.0.1:23800 --unsafe-no-fsync --log-level warn
    k8s_spawn kube-apiserver "$k8s_bin/kube-apiserver" --etcd-servers http://127.0.0.1:23790 \
        --bind-address 127.0.0.1 --advertise-address 127.0.0.1 --secure-port 16443 \
        --tls-cert-file "$p/apiserver.crt" --tls-private-key-file "$p/apiserver.key" \
        --client-ca-file "$p/ca.crt" --token-auth-file "$p/tokens.csv" \
        --authorization-mode Node,RBAC --enable-admission-plugins NodeRestriction \
        --service-account-issuer https://kubernetes.default.svc \
        --service-account-key-file "$p/sa.pub" --service-account-signing-key-file "$p/sa.key" \
        --service-cluster-ip-range 10.96.0.0/24 --allow-privileged=true --endpoint-reconciler-type none \
        --audit-policy-file "$K8S_DIR/audit-policy.yaml" --audit-log-path "$K8S_DIR/log/audit.log"
    k8s_wait 120 kubectl get --raw /readyz || {
        echo "kubernetes: the API server did not become ready" >&2
        return 1
    }
    k8s_spawn kube-controller-manager "$k8s_bin/kube-controller-manager" \
        --kubeconfig "$p/controller-manager.kubeconfig" \
        --authentication-kubeconfig "$p/controller-manager.kubeconfig" \
        --authorization-kubeconfig "$p/controller-manager.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port 20257 --leader-elect=false \
        --service-account-private-key-file "$p/sa.key" --root-ca-file "$p/ca.crt" \
        --use-service-account-credentials=true --controllers '*' \
        --flex-volume-plugin-dir "$K8S_DIR/volume-plugins"
    k8s_spawn kube-scheduler "$k8s_bin/kube-scheduler" --kubeconfig "$p/scheduler.kubeconfig" \
        --authentication-kubeconfig "$p/scheduler.kubeconfig" \
        --authorization-kubeconfig "$p/scheduler.kubeconfig" \
        --bind-address 127.0.0.1 --secure-port 20259 --leader-elect=false
}

k8s_start_containerd() {
    local c=$K8S_DIR/containerd
    mkdir -p "$c" "$K8S_DIR/cni" "$K8S_DIR/cdi"
    # Pods here run with hostNetwork; the CRI plugin still wants a network config to call
    # the node's network ready.
    cat > "$K8S_DIR/cni/10-loopback.conflist" <<'EOF'
{"cniVersion": "1.0.0", "name": "test", "plugins": [{"type": "loopback"}]}
EOF
    cat > "$c/config.toml" <<EOF
version = 3
root = "$c/root"
state = "$c/state"
[grpc]
  address = "$c/containerd.sock"
# Nothing outside the test's directory: not /opt/containerd, not NRI's /var/run/nri.
[plugins.'io.containerd.internal.v1.opt']
  path = "$c/opt"
[plugins.'io.containerd.nri.v1.nri']
  disable = true
[plugins.'io.containerd.cri.v1.images']
  snapshotter = "${K8S_SNAPSHOTTER:-overlayfs}"
  [plugins.'io.containerd.cri.v1.images'.pinned_images]
    sandbox = "registry.k8s.io/pause:3.10.1"
[plugins.'io.containerd.cri.v1.runtime']
  # These machines refuse a negative oom_score_adj (the write fails with EIO), and runc
  # then fails every sandbox (-998: "can't get final child's PID from pipe"). Clamped to
  # containerd's own, 0.
  restrict_oom_score_adj = true
  enable_cdi = true
  cdi_spec_dirs = ["$K8S_DIR/cdi"]
  [plugins.'io.containerd.cri.v1.runtime'.containerd]
    default_runtime_name = "runc"
    [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc.options]
        BinaryName = "${K8S_RUNC:-$(command -v runc)}"
        Root = "$c/runc"
        SystemdCgroup = false
  [plugins.'io.containerd.cri.v1.runtime'.cni]
    bin_dirs = ["/usr/lib/cni"]
    conf_dir = "$K8S_DIR/cni"
EOF
    PATH=$k8s_bin:$PATH k8s_spawn containerd "$k8s_bin/containerd" --config "$c/config.toml"
    k8s_wait 30 "$k8s_bin/ctr" --address "$c/containerd.sock" version || {
        echo "kubernetes: containerd did not start" >&2
        return 1
    }
}

ctr() { "$k8s_bin/ctr" --address "$K8S_DIR/containerd/containerd.sock" -n k8s.io "$@"; }

k8s_start_kubelet() {
    local k=$K8S_DIR/kubelet
    mkdir -p "$k"
    cat > "$K8S_DIR/kubelet.yaml" <<EOF
apiVersion: kubelet.config.k8s.io/v1beta1
kind: KubeletConfiguration
# These machines mount cgroup v1 (v2 only at /sys/fs/cgroup/unified), and systemd is not
# PID 1: the cgroupfs driver.
failCgroupV1: false
cgroupDriver: cgroupfs
containerRuntimeEndpoint: unix://$K8S_DIR/containerd/containerd.sock
address: 127.0.0.1
port: 20250
healthzBindAddress: 127.0.0.1
healthzPort: 20248
readOnlyPort: 0
authentication:
  anonymous: {enabled: true}
  webhook: {enabled: false}
authorization: {mode: AlwaysAllow}
failSwapOn: false
evictionHard: {memory.available: "50Mi", nodefs.available: "1%", imagefs.available: "1%", nodefs.inodesFree: "1%"}
imageGCHighThresholdPercent: 100
imageGCLowThresholdPercent: 99
resolvConf: /etc/resolv.conf
podLogsDir: $K8S_DIR/pod-logs
volumePluginDir: $K8S_DIR/volume-plugins
EOF
    k8s_spawn kubelet "$k8s_bin/kubelet" --config "$K8S_DIR/kubelet.yaml" \
        --kubeconfig "$K8S_DIR/pki/kubelet.kubeconfig" --root-dir "$k" \
        --cert-dir "$K8S_DIR/kubelet-pki" --hostname-override "$K8S_NODE" --node-ip 127.0.0.1 \
        -v 2
}

k8s_stop_kubelet() {
    local pid
    pid=$(cat "$K8S_DIR/run/kubelet.pid" 2>/dev/null) || return 0
    kill "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null || true
}

k8s_node_ready() {
    [ "$(kubectl get node "$K8S_NODE" -o jsonpath='{.status.conditions[?(@.type=="Ready")].status}' 2>/dev/null)" = True ]
}

k8s_start_node() {
    K8S_DIR=$1
    k8s_start_containerd || return 1
    k8s_start_kubelet
    k8s_wait 120 k8s_node_ready || {
        echo "kubernetes: the node did not become Ready" >&2
        return 1
    }
}

# The pods' processes (what is left in the kubelet's cgroups), killed; the cgroups removed.
k8s_kill_pods() {
    local controller dir
    for _ in 1 2 3; do
        for controller in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
            [ -d "$controller" ] || continue
            find "$controller" -name cgroup.procs -exec cat {} + 2>/dev/null | xargs -r kill -KILL 2>/dev/null || true
        done
        sleep 0.2
    done
    for controller in /sys/fs/cgroup/*/kubepods /sys/fs/cgroup/kubepods; do
        [ -d "$controller" ] || continue
        find "$controller" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
}

k8s_stop() {
    [ -n "$K8S_DIR" ] && [ -d "$K8S_DIR/run" ] || return 0
    local name pid
    for name in kubelet kube-scheduler kube-controller-manager kube-apiserver containerd etcd; do
        pid=$(cat "$K8S_DIR/run/$name.pid" 2>/dev/null) || continue
        kill "$pid" 2>/dev/null || true
    done
    sleep 1
    # The runc shims outlive containerd; they have its environment, with this marker.
    for pid in $(grep -lz "^GPUD_K8S_TEST=$K8S_DIR\$" /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3); do
        kill -KILL "$pid" 2>/dev/null || true
    done
    for name in kubelet kube-scheduler kube-controller-manager kube-apiserver containerd etcd; do
        pid=$(cat "$K8S_DIR/run/$name.pid" 2>/dev/null) || continue
        kill -KILL "$pid" 2>/dev/null || true
    done
    k8s_kill_pods
    # A killed shim leaves its socket in /run/containerd/s (a fixed path, whatever
    # containerd's state directory); containerd's log names each shim's.
    sed -n 's|.*connecting to shim.*address="unix://\(/run/containerd/s/[0-9a-f]*\)".*|\1|p' \
        "$K8S_DIR/log/containerd.log" 2>/dev/null | sort -u | xargs -r rm -f
    rmdir /run/containerd/s /run/containerd 2>/dev/null || true
    # The kubelet links each container's log into /var/log/containers, a fixed path.
    find /var/log/containers -maxdepth 1 -lname "$K8S_DIR/*" -delete 2>/dev/null || true
    rmdir /var/log/containers 2>/dev/null || true
    # Mounts under the directory (pods' volumes, the snapshots, the shims' rootfs): deepest first.
    awk -v d="$K8S_DIR" 'index($2, d) == 1 {print $2}' /proc/mounts | sort -r | while read -r m; do
        umount "$m" 2>/dev/null || umount -l "$m" 2>/dev/null || true
    done
    rm -f "$K8S_DIR"/run/*.pid
}
