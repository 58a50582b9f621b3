#!/usr/bin/env bash
# MPS isolation against the real NVIDIA driver and its MPS (any driver with
# nvidia-cuda-mps-control; the GPU in its Default compute mode, never changed), as root:
#
#   tests/real-gpu/mps.sh          the real driver: through gpud, a client of a 2 GiB, 25%
#                                  reservation sees about 25% of the SMs, fails to allocate
#                                  3 GiB and allocates 1 GiB, cannot raise its caps through
#                                  its environment; 25% and 75% reservations each keep to
#                                  their SMs when busy at once, and the GPU's time-slicing
#                                  between their servers starves neither (each at most
#                                  2.3x its time alone); a process without the pipe is
#                                  found and ended;
#                                  nothing is left after release
#   tests/real-gpu/mps.sh --fake   the same steps against tests/fake-mps and the fake NVML
#                                  (the side-by-side timing needs a GPU and is skipped);
#                                  CI runs this, so the script cannot rot
#
# SMOKE_BIN=DIR uses the binaries in DIR (see smoke.sh --pack) instead of building;
# MPS_KEEP_LOG=FILE keeps gpud's log there.
# Prints what it saw (nvidia-smi's and gpud's process listings among it); exits non-zero at
# the first step that fails.
set -euo pipefail

mode=real
[ "${1:-}" = "--fake" ] && mode=fake
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
say() { printf 'mps: %s\n' "$*"; }
fail() { printf 'mps: FAILED: %s\n' "$*" >&2; [ -f "${work:-}/gpud.log" ] && tail -20 "$work/gpud.log" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root: gpud runs one MPS daemon per reservation"

if [ -n "${SMOKE_BIN:-}" ]; then
    bin=$(cd "$SMOKE_BIN" && pwd)
else
    packages=(-p gpud -p gpuctl)
    [ "$mode" = fake ] && packages+=(-p fake-nvml -p fake-mps)
    cargo build --release "${packages[@]}" 2>&1 | tail -1
    bin=$root/target/release
fi

work=$(mktemp -d /tmp/gpud-mps.XXXXXX)
pids=()
cleanup() {
    for p in "${pids[@]}"; do kill "$p" 2>/dev/null || true; done
    wait 2>/dev/null || true
    [ -n "${MPS_KEEP_LOG:-}" ] && cp "$work/gpud.log" "$MPS_KEEP_LOG" 2>/dev/null
    rm -rf "$work"
}
trap cleanup EXIT
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }

# The GPU's whole SM count, seen by a client outside MPS, before gpud (whose audit would
# end a process on an MPS GPU without a reservation).
if [ "$mode" = real ]; then
    command -v nvidia-cuda-mps-control > /dev/null || fail "nvidia-cuda-mps-control is not installed"
    full=$(python3 tests/real-gpu/cuda_mps.py | json 'd["sms"]')
    say "GPU 0 has $full SMs"
fi

{
    printf '[isolation]\nmps_dir = "%s/mps"\n' "$work"
    [ "$mode" = fake ] && printf 'mps_control = "%s/nvidia-cuda-mps-control"\n' "$bin"
    printf '[audit]\ninterval = "500ms"\nenforcement = "terminate"\ngrace = "1s"\nterminate_root = true\n'
} > "$work/gpud.toml"
args=(--config "$work/gpud.toml" --socket "$work/gpud.sock" --state-dir "$work/state")
if [ "$mode" = fake ]; then
    # A driver before R615: the GPUs are advisory to the driver, so MPS holds them.
    cp tests/fixtures/t4-pair.json "$work/fixture.json"
    export FAKE_NVML_CONFIG=$work/fixture.json
    args+=(--nvml-lib "$bin/libfake_nvml.so")
fi
export GPUD_SOCKET=$work/gpud.sock
"$bin/gpud" "${args[@]}" 2> "$work/gpud.log" &
pids+=($!)
for _ in $(seq 100); do [ -S "$work/gpud.sock" ] && break; sleep 0.1; done
"$bin/gpuctl" gpus || fail "gpud did not answer"
mode0=$("$bin/gpuctl" gpus -o json | json 'd["gpus"][0]["isolation"]["mode"]')
[ "$mode0" = mps ] || fail "GPU 0 is $mode0: $("$bin/gpuctl" gpus -o json | json 'd["gpus"][0]["isolation"].get("reason")')"

# What a client under a reservation sees: one JSON line.
client() { # client [ENV=VALUE...] -- RESERVE-FLAGS... ; prints the client's line
    local envs=()
    while [ "$1" != -- ]; do envs+=("$1"); shift; done
    shift
    if [ "$mode" = real ]; then
        "$bin/gpuctl" reserve "$@" -- env "${envs[@]}" python3 tests/real-gpu/cuda_mps.py --alloc 3072 --alloc 1024
    else
        "$bin/gpuctl" reserve "$@" -- env "${envs[@]}" sh -c '
            "$0" --alloc $((3 << 30)) > /dev/null; big=$?
            "$0" --alloc $((1 << 30)) | sed "s/}\$/,\"big\": $big}/"' "$bin/fake-cuda-client"
    fi
}
check_caps() { # check_caps LINE WHAT
    local seen=$1 what=$2
    say "$what: $seen"
    if [ "$mode" = real ]; then
        local sms
        sms=$(json 'd["sms"]' <<< "$seen")
        want=$(( (full * 25 + 50) / 100 ))
        [ $((sms - want)) -le 2 ] && [ $((want - sms)) -le 2 ] || fail "$what: $sms SMs, not about $want (25% of $full)"
        [ "$(json 'd["allocs"]["3072"]' <<< "$seen")" = 2 ] || fail "$what: 3 GiB did not fail with CUDA_ERROR_OUT_OF_MEMORY"
        [ "$(json 'd["allocs"]["1024"]' <<< "$seen")" = 0 ] || fail "$what: 1 GiB failed"
    else
        [ "$(json 'd["mps"]' <<< "$seen")" = True ] || fail "$what: no MPS client"
        [ "$(json 'd["active_thread_percentage"]' <<< "$seen")" = 25.0 ] || fail "$what: not 25% of the SMs"
        [ "$(json 'd["pinned_mem_limits"]["0"]' <<< "$seen")" = $((2 << 30)) ] || fail "$what: not a 2 GiB cap"
        [ "$(json 'd["big"]' <<< "$seen")" = 2 ] || fail "$what: 3 GiB did not fail"
        [ "$(json 'd.get("allocated")' <<< "$seen")" != None ] || fail "$what: 1 GiB failed"
    fi
}

check_caps "$(client -- --mem 2GiB --compute 25 --devices 0)" "a 2 GiB, 25% reservation's client"
check_caps "$(client CUDA_MPS_PINNED_DEVICE_MEM_LIMIT=0=8G CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=100 -- \
    --mem 2GiB --compute 25 --devices 0)" "the same, asking for 8 GiB and 100% through its environment"

if [ "$mode" = real ]; then
    # A fixed amount of work (about 2 s alone on a 25% share; one block per SM, so as long
    # on 75%), each reservation alone, then both at once. Each reservation has its own
    # server, and the GPU time-slices between servers (measured on driver 580): together,
    # each may take up to twice as long as alone, no longer (neither is starved), and each
    # keeps to its share of the SMs.
    work() { # work PCT ITERATIONS: the client's line
        "$bin/gpuctl" reserve --mem 1GiB --compute "$1" --devices 0 -- \
            python3 tests/real-gpu/cuda_mps.py --work "$2"; }
    n=$("$bin/gpuctl" reserve --mem 1GiB --compute 25 --devices 0 -- \
        python3 tests/real-gpu/cuda_mps.py --calibrate 2000 | json 'd["iterations"]')
    alone25=$(work 25 "$n" | json 'd["work_ms"]'); alone75=$(work 75 "$n" | json 'd["work_ms"]')
    work 25 "$n" > "$work/t25" & p25=$!
    work 75 "$n" > "$work/t75" & p75=$!
    wait "$p25" "$p75"
    both25=$(json 'd["work_ms"]' < "$work/t25"); both75=$(json 'd["work_ms"]' < "$work/t75")
    overlap=$(python3 -c '
import json, sys
a, b = (json.load(open(f)) for f in sys.argv[1:])
shared = min(a["work_end"], b["work_end"]) - max(a["work_start"], b["work_start"])
print(round(100 * max(shared, 0) / min(a["work_end"] - a["work_start"], b["work_end"] - b["work_start"])))' \
        "$work/t25" "$work/t75")
    say "$n iterations: 25% alone ${alone25} ms, together ${both25} ms; 75% alone ${alone75} ms, together ${both75} ms; they overlapped for ${overlap}% of the shorter"
    [ "$overlap" -ge 50 ] || fail "the two kernels overlapped for only ${overlap}% of the shorter: the comparison says nothing"
    for pct in 25 75; do
        sms=$(json 'd["sms"]' < "$work/t$pct"); want=$(( (full * pct + 50) / 100 ))
        [ $((sms - want)) -le 2 ] && [ $((want - sms)) -le 2 ] || fail "the ${pct}% reservation ran on $sms SMs beside the other, not about $want"
    done
    ratio() { python3 -c "import sys; print(round(float(sys.argv[2]) / float(sys.argv[1]), 2))" "$1" "$2"; }
    r25=$(ratio "$alone25" "$both25"); r75=$(ratio "$alone75" "$both75")
    python3 -c "import sys; sys.exit(0 if max(map(float, sys.argv[1:])) <= 2.3 else 1)" "$r25" "$r75" ||
        fail "beside each other, the 25% reservation's work took ${r25}x its time alone and the 75% one's ${r75}x: more than a fair time slice (2x, with 15% to spare)"
    if python3 -c "import sys; sys.exit(0 if max(map(float, sys.argv[1:])) <= 1.15 else 1)" "$r25" "$r75"; then
        say "side by side: each took at most 1.15x its time alone (${r25}x, ${r75}x)"
    else
        say "time-sliced: ${r25}x and ${r75}x their times alone, each on its share of the SMs"
    fi
else
    say "side by side: skipped on the fake (nothing runs on a GPU)"
fi

# A lease with a client of its server, and a process of the same reservation started
# without the pipe: the audit finds the second and ends it.
lease=$(curl -sf --unix-socket "$work/gpud.sock" -X POST \
    -d '{"memory": "2GiB", "devices": ["0"], "ttl_seconds": 120}' http://gpud/v1/reservations)
id=$(json 'd["id"]' <<< "$lease")
pipe=$(json 'd["env"]["CUDA_MPS_PIPE_DIRECTORY"]' <<< "$lease")
if [ "$mode" = real ]; then
    mkfifo "$work/in"
    GPUD_RESERVATION_ID=$id CUDA_MPS_PIPE_DIRECTORY=$pipe python3 tests/real-gpu/cuda_mps.py --hold < "$work/in" > "$work/member" &
    member=$!
    GPUD_RESERVATION_ID=$id python3 tests/real-gpu/cuda_mps.py --hold < "$work/in" > "$work/bypass" &
    bypass=$!
else
    GPUD_RESERVATION_ID=$id CUDA_MPS_PIPE_DIRECTORY=$pipe "$bin/fake-cuda-client" --hold 60 > "$work/member" &
    member=$!
    GPUD_RESERVATION_ID=$id sleep 60 &
    bypass=$!
    python3 - "$work/fixture.json" "$member" "$bypass" <<'EOF'
import json, os, sys
path, member, bypass = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
d = json.load(open(path))
d["gpus"][0]["processes"] = [
    {"pid": member, "used_memory_bytes": 1 << 30, "mps": True},
    {"pid": bypass, "used_memory_bytes": 1 << 30},
]
json.dump(d, open(path + ".new", "w"))
os.rename(path + ".new", path)
EOF
fi
pids+=("$member" "$bypass")
# The real clients hold until their stdin (the fifo) closes.
[ "$mode" = real ] && exec 3> "$work/in"
for _ in $(seq 100); do [ -s "$work/member" ] && break; sleep 0.1; done
say "what the reservation's client sees: $(cat "$work/member")"
if [ "$mode" = real ] && command -v nvidia-smi > /dev/null; then
    say "nvidia-smi (type M+C: an MPS client; C: a server or a plain process):"
    nvidia-smi || true
fi
found=""
for _ in $(seq 200); do
    found=$("$bin/gpuctl" events --kind unlimited -o json 2>/dev/null | python3 -c '
import json, sys
pid = int(sys.argv[1])
for e in json.load(sys.stdin)["events"]:
    if e["pid"] == pid and e["phase"] == "start":
        print(e["message"]); break' "$bypass" || true)
    [ -n "$found" ] && break
    sleep 0.1
done
[ -n "$found" ] || fail "the process without the pipe was not found: $("$bin/gpuctl" events -o json)"
say "found: $found"
say "gpud's listing:"
"$bin/gpuctl" ps || true
for _ in $(seq 100); do kill -0 "$bypass" 2>/dev/null || break; sleep 0.1; done
! kill -0 "$bypass" 2>/dev/null || fail "the process without the pipe was not ended"
kill -0 "$member" 2>/dev/null || fail "the reservation's client was ended too"
say "the process without the pipe was ended; the client of its server runs on"
[ "$mode" = real ] && exec 3>&-
kill "$member" 2>/dev/null || true
"$bin/gpuctl" release "$id" > /dev/null

# Nothing is left: no daemon, server or directory of any reservation.
left() {
    ls -A "$work/mps" 2>/dev/null
    grep -lsz "CUDA_MPS_PIPE_DIRECTORY=$work/mps" /proc/[0-9]*/environ 2>/dev/null | while read -r f; do
        p=${f#/proc/}; p=${p%/environ}
        grep -q ') Z ' "/proc/$p/stat" 2>/dev/null || echo "process $p"
    done
}
for _ in $(seq 150); do [ -z "$(left)" ] && break; sleep 0.1; done
[ -z "$(left)" ] || fail "left behind: $(left)"
[ "$("$bin/gpuctl" ls -o json | json 'len(d["reservations"])')" = 0 ] || fail "a reservation is left"
say "released: no daemon, server or directory is left"
say "PASSED"
