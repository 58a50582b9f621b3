#!/usr/bin/env bash
# What an MPS reservation costs on a real GPU (as root, the GPU in its Default compute mode):
#
#   SMOKE_BIN=DIR tests/real-gpu/mps_cost.sh     the binaries of smoke.sh --pack DIR
#
# 1. `gpuctl reserve --mem 1GiB -- true`, 40 times after 3 to warm up, with MPS off and on:
#    the median and p90 of each;
# 2. 16 MPS leases: gpud's resident memory and CPU ticks before and after;
# 3. a client of each of 8 of them holding nothing but its context: the GPU memory used
#    before and after (nvidia-smi), and gpud's process listing;
# 4. nothing left after the releases.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
bin=$(cd "${SMOKE_BIN:?SMOKE_BIN=DIR: the binaries of tests/real-gpu/smoke.sh --pack DIR}" && pwd)
json() { python3 -c "import json,sys; d=json.load(sys.stdin); print($1)"; }
for mode in off auto; do
    w=$(mktemp -d /tmp/cost.XXXXXX)
    printf '[isolation]\nmps = "%s"\nmps_dir = "%s/mps"\n' "$mode" "$w" > "$w/gpud.toml"
    "$bin/gpud" --config "$w/gpud.toml" --socket "$w/s" --state-dir "$w/state" 2> "$w/log" &
    g=$!
    for _ in $(seq 100); do [ -S "$w/s" ] && break; sleep 0.1; done
    export GPUD_SOCKET=$w/s
    echo "== mps=$mode: GPU 0 $("$bin/gpuctl" gpus -o json | json 'd["gpus"][0]["isolation"]["mode"]')"
    for _ in 1 2 3; do "$bin/gpuctl" reserve --mem 1GiB --devices 0 -- true; done
    python3 - "$bin/gpuctl" <<'PY'
import statistics, subprocess, sys, time
t = []
for _ in range(40):
    s = time.perf_counter()
    subprocess.run([sys.argv[1], "reserve", "--mem", "1GiB", "--devices", "0", "--", "true"], check=True)
    t.append((time.perf_counter() - s) * 1000)
t.sort()
print(f"reserve -- true: median {statistics.median(t):.1f} ms, p90 {t[35]:.1f} ms (40 runs)")
PY
    if [ "$mode" = auto ]; then
        rss() { awk '/VmRSS/ {print $2}' /proc/$g/status; }
        cpu() { awk '{print $14 + $15}' /proc/$g/stat; }
        r0=$(rss); c0=$(cpu)
        ids=(); pipes=()
        for i in $(seq 16); do
            r=$(curl -sf --unix-socket "$w/s" -X POST -d '{"memory": "1GiB", "devices": ["0"], "ttl_seconds": 300}' http://gpud/v1/reservations)
            ids+=("$(json 'd["id"]' <<< "$r")"); pipes+=("$(json 'd["env"].get("CUDA_MPS_PIPE_DIRECTORY")' <<< "$r")")
        done
        sleep 3
        r1=$(rss); c1=$(cpu)
        echo "16 mps leases: gpud RSS $r0 -> $r1 KiB, CPU ticks $c0 -> $c1 over their creation and 3 s; daemons: $(pgrep -c -f nvidia-cuda-mps-control)"
        used() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }
        u0=$(used)
        mkdir -p "$w/fifos"; cl=()
        for i in $(seq 8); do
            pipe=${pipes[$i]}
            mkfifo "$w/fifos/$i"
            GPUD_RESERVATION_ID=${ids[$i]} CUDA_MPS_PIPE_DIRECTORY=$pipe python3 tests/real-gpu/cuda_mps.py --hold < "$w/fifos/$i" > "$w/fifos/$i.out" &
            cl+=($!)
            exec {fd}> "$w/fifos/$i"
        done
        for _ in $(seq 150); do [ "$(cat "$w"/fifos/*.out 2>/dev/null | wc -l)" -ge 8 ] && break; sleep 0.1; done
        sleep 1
        u1=$(used)
        echo "8 clients of 8 reservations, each with a context only: GPU memory used $u0 -> $u1 MiB"
        head -2 "$w"/fifos/1.out
        "$bin/gpuctl" ps || true
        kill "${cl[@]}" 2>/dev/null
        for id in "${ids[@]}"; do "$bin/gpuctl" release "$id" > /dev/null; done
        sleep 6
        echo "after release: daemons $(pgrep -c -f nvidia-cuda-mps 2>/dev/null), dirs [$(ls -A "$w/mps" 2>/dev/null | tr '\n' ' ')]"
    fi
    kill $g; wait $g 2>/dev/null
    rm -rf "$w"
done
