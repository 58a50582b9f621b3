#!/usr/bin/env bash
# Hard isolation against the real NVIDIA driver (R615 or later), as root:
#
#   tests/real-gpu/isolation.sh          the real driver: a workload holding a 1 GiB
#                                        reservation must see a 1 GiB card, fail to
#                                        allocate 2 GiB (CUDA_ERROR_OUT_OF_MEMORY) and
#                                        allocate 512 MiB; nvidia-smi shows the limit
#   tests/real-gpu/isolation.sh --fake   the same steps on the fake NVML, the workload
#                                        reading its card through nvidia-ml-py (.venv);
#                                        CI runs this, so the script cannot rot
#
# SMOKE_BIN=DIR uses the binaries in DIR (see smoke.sh --pack) instead of building.
# Steps: start gpud with its workload cgroups under the cgroup v2 mount; check GPU 0 says
# `driver`; run the workload with `gpuctl reserve --mem 1GiB --`; check its reservation,
# cgroup and limit; let it exit; check the reservation, the limit and the cgroup are gone.
# Prints what it saw; exits non-zero at the first step that fails.
set -euo pipefail

mode=real
[ "${1:-}" = "--fake" ] && mode=fake
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
say() { printf 'isolation: %s\n' "$*"; }
fail() { printf 'isolation: FAILED: %s\n' "$*" >&2; [ -f "${work:-}/gpud.log" ] && tail -20 "$work/gpud.log" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root: gpud sets limits and makes cgroups"
mount=$(awk '$9 == "cgroup2" { print $5 }' /proc/self/mountinfo | sort | head -1)
[ -n "$mount" ] || fail "no cgroup v2 hierarchy is mounted"

if [ -n "${SMOKE_BIN:-}" ]; then
    bin=$(cd "$SMOKE_BIN" && pwd)
else
    packages=(-p gpud -p gpuctl)
    [ "$mode" = fake ] && packages+=(-p fake-nvml)
    cargo build --release "${packages[@]}" 2>&1 | tail -1
    bin=$root/target/release
fi

work=$(mktemp -d /tmp/gpud-isolation.XXXXXX)
workloads=$mount/gpud-isolation-check-$$
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rmdir "$workloads"/* "$workloads" 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

printf '[isolation]\nworkloads = "%s"\n' "$workloads" > "$work/gpud.toml"
args=(--config "$work/gpud.toml" --socket "$work/gpud.sock" --state-dir "$work/state")
python=python3
if [ "$mode" = fake ]; then
    python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); d["driver_version"]="615.12.01"; json.dump(d, open(sys.argv[2],"w"))' \
        tests/fixtures/t4-pair.json "$work/fixture.json"
    export FAKE_NVML_CONFIG=$work/fixture.json NVML_LIB=$bin/libfake_nvml.so
    args+=(--nvml-lib "$bin/libfake_nvml.so")
    python=$root/.venv/bin/python
    "$python" -c 'import pynvml' 2>/dev/null || fail "needs .venv with nvidia-ml-py (tests/conformance/requirements.txt)"
fi
export GPUD_SOCKET=$work/gpud.sock
"$bin/gpud" "${args[@]}" 2> "$work/gpud.log" &
pids+=($!)
for _ in $(seq 100); do [ -S "$work/gpud.sock" ] && break; sleep 0.1; done
"$bin/gpuctl" gpus || fail "gpud did not answer"
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
mode0=$("$bin/gpuctl" gpus -o json | json 'd["gpus"][0]["isolation"]["mode"]')
if [ "$mode0" != driver ]; then
    why=$("$bin/gpuctl" gpus -o json | json 'd["gpus"][0]["isolation"].get("reason") or ""')
    fail "GPU 0's isolation is $mode0, not driver: this script checks per-cgroup limits, which need NVIDIA driver R615 or later${why:+ ($why)}"
fi
uuid=$("$bin/gpuctl" gpus -o json | json 'd["gpus"][0]["uuid"]')

# The workload: its view of the card, then it waits on its stdin (a fifo this script holds).
mkfifo "$work/in"
if [ "$mode" = real ]; then
    workload=(python3 tests/real-gpu/cuda_limit.py 2048 512)
else
    workload=("$python" tests/scripts/nvml-limits total "$uuid")
fi
"$bin/gpuctl" reserve --mem 1GiB -- sh -c '"$@"; cat > /dev/null' sh "${workload[@]}" \
    < "$work/in" > "$work/seen" 2> "$work/workload.err" &
pids+=($!)
workload_pid=$!
exec 3> "$work/in"
for _ in $(seq 100); do [ -s "$work/seen" ] && break; sleep 0.1; done
[ -s "$work/seen" ] || fail "the workload printed nothing: $(cat "$work/workload.err")"
say "the workload sees: $(cat "$work/seen")"

r=$("$bin/gpuctl" ls -o json | json 'json.dumps(d["reservations"][0])')
id=$(json 'd["id"]' <<< "$r")
cgroup=$(json 'd["isolation"].get("cgroup", "")' <<< "$r")
say "reservation $id: $(json 'd["isolation"]' <<< "$r")"
[ "$(json 'd["isolation"]["mode"]' <<< "$r")" = driver ] || fail "the reservation is not driver-enforced"
[ -d "$cgroup" ] || fail "no cgroup $cgroup"
total=$(json 'd["total"]' < "$work/seen")
[ "$total" = $((1 << 30)) ] || fail "the workload sees a card of $total bytes, not 1 GiB"
if [ "$mode" = real ]; then
    [ "$(json 'd["big"]' < "$work/seen")" = 2 ] || fail "allocating 2 GiB did not fail with CUDA_ERROR_OUT_OF_MEMORY"
    [ "$(json 'd["small"]' < "$work/seen")" = 0 ] || fail "allocating 512 MiB failed"
    if command -v nvidia-smi > /dev/null; then
        nvidia-smi memory-limits --get -n "$cgroup" -i 0 || say "nvidia-smi memory-limits --get failed"
    fi
else
    limits=$("$python" tests/scripts/nvml-limits get "$uuid" "$cgroup")
    say "the driver's limits for $cgroup: $limits"
    [ "$(json 'd["limits"][:2]' <<< "$limits")" = "[1073741824, 1073741824]" ] || fail "limits $limits"
fi

exec 3>&-
wait "$workload_pid" || fail "the workload failed: $(cat "$work/workload.err")"
for _ in $(seq 100); do [ ! -d "$cgroup" ] && break; sleep 0.1; done
[ ! -d "$cgroup" ] || fail "$cgroup is left behind"
[ "$("$bin/gpuctl" ls -o json | json 'len(d["reservations"])')" = 0 ] || fail "the reservation outlived its workload"
if [ "$mode" = fake ]; then
    left=$(python3 -c 'import json,sys
try: m = json.load(open(sys.argv[1]))
except FileNotFoundError: m = {}
print(sum(len(v) for v in m.values()))' "$work/fixture.json.limits.json")
    [ "$left" = 0 ] || fail "$left limits left in the driver"
fi
say "the workload exited: its reservation, limit and cgroup are gone"
say "PASSED"
