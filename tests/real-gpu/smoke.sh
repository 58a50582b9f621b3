#!/usr/bin/env bash
# gpud against the real NVIDIA driver, end to end, in about a minute: for the few minutes a
# session is lent a GPU machine (see docs/testing.md, "Testing on a real GPU").
#
#   tests/real-gpu/smoke.sh          the real driver (libnvidia-ml.so.1), CUDA processes
#   tests/real-gpu/smoke.sh --fake   the same steps on the fake NVML (CI runs this, so the
#                                    script cannot rot between GPU sessions)
#   tests/real-gpu/smoke.sh --pack DIR
#                                    only build, and put stripped gpud, gpuctl,
#                                    libfake_nvml.so and gpud-load in DIR: for a GPU
#                                    machine without a Rust toolchain, run there with
#                                    SMOKE_BIN=DIR (and the load generator from DIR)
#
# SMOKE_BIN=DIR uses the binaries in DIR instead of building.
#
# Steps: build; start gpud; list the GPUs; reserve 1 GiB; run a process holding GPU memory
# with the reservation's environment (real: tests/real-gpu/cuda_hold.py through libcuda;
# fake: a sleep written into the fixture) and check the audit counts it for the reservation;
# run one without a reservation and check the audit reports it `unreserved`; release; check
# nothing is left. Prints what it saw; exits non-zero at the first step that fails.
set -euo pipefail

mode=real
[ "${1:-}" = "--fake" ] && mode=fake
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"

if [ "${1:-}" = "--pack" ]; then
    dir=${2:?"--pack DIR"}
    # Two builds: `--bin` would limit the first to that one binary of every package named.
    cargo build --release -p gpud -p gpuctl -p fake-nvml 2>&1 | tail -1
    cargo build --release -p gpud-tests --bin gpud-load 2>&1 | tail -1
    mkdir -p "$dir"
    for f in gpud gpuctl libfake_nvml.so gpud-load; do strip -o "$dir/$f" "target/release/$f"; done
    ls -l "$dir"
    exit 0
fi

say() { printf 'smoke: %s\n' "$*"; }
fail() { printf 'smoke: FAILED: %s\n' "$*" >&2; [ -f "${work:-}/gpud.log" ] && tail -20 "$work/gpud.log" >&2; exit 1; }

if [ -n "${SMOKE_BIN:-}" ]; then
    bin=$(cd "$SMOKE_BIN" && pwd)
else
    packages=(-p gpud -p gpuctl)
    [ "$mode" = fake ] && packages+=(-p fake-nvml)
    cargo build --release "${packages[@]}" 2>&1 | tail -1
    bin=$root/target/release
fi
gpud=$bin/gpud
gpuctl=$bin/gpuctl

work=$(mktemp -d /tmp/gpud-smoke.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    rm -rf "$work"
}
trap cleanup EXIT

printf '[audit]\ninterval = "500ms"\n' > "$work/gpud.toml"
args=(--config "$work/gpud.toml" --socket "$work/gpud.sock" --state-dir "$work/state")
if [ "$mode" = fake ]; then
    cp tests/fixtures/dgx1-v100.json "$work/fixture.json"
    export FAKE_NVML_CONFIG=$work/fixture.json
    args+=(--nvml-lib "$bin/libfake_nvml.so")
fi
export GPUD_SOCKET=$work/gpud.sock
"$gpud" "${args[@]}" 2> "$work/gpud.log" &
pids+=($!)
for _ in $(seq 100); do [ -S "$work/gpud.sock" ] && break; sleep 0.1; done
"$gpuctl" gpus > /dev/null 2>&1 || fail "gpud did not answer"

json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

say "gpud $("$gpuctl" gpus -o json | json 'len(d["gpus"])') GPUs:"
"$gpuctl" gpus
grep -E "watching for critical Xid|Xid errors are not watched" "$work/gpud.log" \
    | sed 's/^/smoke: gpud: /' || say "no Xid watch line in the log"

reservation=$("$gpuctl" reserve --mem 1GiB --ttl 5m -o json)
id=$(json 'd["id"]' <<< "$reservation")
gpu=$(json 'd["gpus"][0]["index"]' <<< "$reservation")
say "reserved $id: 1 GiB on GPU $gpu"

# Starts a process holding 256 MiB on GPU $gpu, with the reservation's environment when
# $1 is "reserved"; sets $held to its pid. (Not a command substitution: that subshell would
# run the EXIT trap and stop gpud.)
hold() {
    local env=()
    if [ "$1" = reserved ]; then
        while IFS= read -r line; do env+=("$line"); done < <(json \
            '"\n".join(f"{k}={v}" for k, v in d["env"].items())' <<< "$reservation")
    else
        local uuid
        uuid=$(json 'd["gpus"][0]["uuid"]' <<< "$reservation")
        env=(CUDA_VISIBLE_DEVICES="$uuid")
    fi
    if [ "$mode" = real ]; then
        env "${env[@]}" python3 tests/real-gpu/cuda_hold.py 256 > "$work/hold.$1" 2>&1 &
    else
        env "${env[@]}" sleep 300 &
    fi
    held=$!
    pids+=("$held")
    local pid=$held
    if [ "$mode" = real ]; then
        for _ in $(seq 100); do grep -q holding "$work/hold.$1" 2>/dev/null && break; sleep 0.1; done
        grep -q holding "$work/hold.$1" || fail "cuda_hold.py: $(cat "$work/hold.$1")"
    else
        # The fake NVML lists what its fixture says runs on each GPU.
        python3 - "$work/fixture.json" "$gpu" "$pid" <<'PY'
import json, os, sys
path, gpu, pid = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
fixture = json.load(open(path))
fixture["gpus"][gpu].setdefault("processes", []).append(
    {"pid": pid, "used_memory_bytes": 256 << 20})
json.dump(fixture, open(path + ".new", "w"))
os.replace(path + ".new", path)
PY
    fi
}

events_for() {
    "$gpuctl" events -o json | json "[e['kind'] for e in d['events'] if e.get('pid') == $1]"
}

hold reserved
mine=$held
say "process $mine holds 256 MiB with the reservation's environment"
sleep 2
[ "$(events_for "$mine")" = "[]" ] || fail "the audit did not count process $mine for $id: $(events_for "$mine")"
used=$("$gpuctl" gpus -o json | json "d['gpus'][$gpu]['memory_used_bytes'] >> 20")
say "audit: no finding for $mine; GPU $gpu shows $used MiB used"
[ "$used" -ge 256 ] || fail "GPU $gpu should show at least 256 MiB used"

hold unreserved
rogue=$held
say "process $rogue holds 256 MiB without a reservation"
for _ in $(seq 20); do
    [[ "$(events_for "$rogue")" == *unreserved* ]] && break
    sleep 0.5
done
[[ "$(events_for "$rogue")" == *unreserved* ]] || fail "no unreserved event for $rogue"
say "audit: $rogue is unreserved"
"$gpuctl" events | tail -3 | sed 's/^/smoke: /'

"$gpuctl" release "$id" > /dev/null
[ "$("$gpuctl" ls -o json | json 'len(d["reservations"])')" = 0 ] || fail "a reservation is left"
say "released; nothing active. SMOKE OK ($mode)"
