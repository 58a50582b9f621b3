#!/usr/bin/env bash
# What NVIDIA's MPS does that gpud relies on, without gpud (as root, on a GPU in its Default
# compute mode, which it never changes):
#
#   tests/real-gpu/mps_probe.sh
#
# 1. a control daemon started with `-d` on its own pipe directory writes its pid file there,
#    and takes `set_default_device_pinned_mem_limit` and
#    `set_default_active_thread_percentage` before any server runs;
# 2. a client (tests/real-gpu/cuda_mps.py) starts its server: which process is the server's
#    parent (gpud's audit takes a child of a reservation's daemon for its server);
# 3. what NVML's two listings (nvmlDeviceGetComputeRunningProcesses and
#    nvmlDeviceGetMPSComputeRunningProcesses, through nvidia-ml-py where it is installed)
#    return for the client, the server and a process that bypasses MPS;
# 4. `quit` while a client runs: whether it returns, whether the daemon still answers and
#    takes new clients, and when it exits;
# 5. whether two clients of one server, each asking a share through its environment, run
#    side by side (separate servers time-slice the GPU);
# 6. what a client of a daemon without caps sees beside 15 other daemons.
# Prints what it saw; exits non-zero where a fact gpud relies on does not hold.
set -uo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
cd "$root"
say() { printf 'probe: %s\n' "$*"; }
fail() { printf 'probe: FAILED: %s\n' "$*" >&2; exit 1; }
[ "$(id -u)" = 0 ] || fail "run as root"
command -v nvidia-cuda-mps-control > /dev/null || fail "nvidia-cuda-mps-control is not installed"

d=$(mktemp -d /tmp/mps-probe.XXXXXX)
mkdir -p "$d/pipe" "$d/log"
cleanup() {
    exec 3>&- 4>&- 5>&- 2>/dev/null
    echo quit | CUDA_MPS_PIPE_DIRECTORY=$d/pipe nvidia-cuda-mps-control > /dev/null 2>&1
    sleep 1
    for p in "$d"/*/nvidia-cuda-mps-control.pid; do kill "$(cat "$p")" 2>/dev/null; done
    rm -rf "$d"
}
trap cleanup EXIT
control() { CUDA_MPS_PIPE_DIRECTORY=$d/pipe CUDA_MPS_LOG_DIRECTORY=$d/log nvidia-cuda-mps-control "$@"; }
procs() { ps -eo pid,ppid,uid,stat,comm,args | grep -E 'PID|nvidia-cuda-mps|cuda_mps' | grep -v grep; }

started=$(date +%s.%N)
CUDA_VISIBLE_DEVICES=0 control -d || fail "nvidia-cuda-mps-control -d failed"
say "-d returned after $(python3 -c "import sys,time; print(round((time.time()-float(sys.argv[1]))*1000))" "$started") ms; pipe directory: $(ls -A "$d/pipe" | tr '\n' ' ')"
daemon=$(cat "$d/pipe/nvidia-cuda-mps-control.pid" 2>/dev/null) || fail "no pid file in the pipe directory"
say "daemon pid $daemon ($(cat /proc/"$daemon"/comm))"
say "caps: $(printf 'set_default_device_pinned_mem_limit 0 2048M\nset_default_active_thread_percentage 25\n' | control | tr '\n' ' ')"
say "get_server_list before a client: [$(echo get_server_list | control | tr '\n' ' ')]"

mkfifo "$d/in" "$d/in2"
CUDA_MPS_PIPE_DIRECTORY=$d/pipe python3 tests/real-gpu/cuda_mps.py --alloc 1024 --hold < "$d/in" > "$d/client" &
client=$!
python3 tests/real-gpu/cuda_mps.py --alloc 1024 --hold < "$d/in2" > "$d/bypass" &
bypass=$!
exec 3> "$d/in" 4> "$d/in2"
for _ in $(seq 200); do [ -s "$d/client" ] && [ -s "$d/bypass" ] && break; sleep 0.1; done
say "client $client sees: $(cat "$d/client")"
say "bypass $bypass sees: $(cat "$d/bypass")"
servers=$(echo get_server_list | control | tr '\n' ' ')
say "get_server_list: [$servers]"
say "processes:"
procs
for s in $servers; do
    parent=$(awk '{print $4}' "/proc/$s/stat" 2>/dev/null)
    say "server $s: parent $parent (the daemon is $daemon), comm $(cat "/proc/$s/comm" 2>/dev/null)"
    [ "$parent" = "$daemon" ] || say "NOTE: the server is not the daemon's child"
done
python3 - "$client" "$bypass" $servers <<'PY'
import sys
try:
    import pynvml as n
except ImportError:
    print("probe: nvidia-ml-py is not installed; NVML's listings not read")
    sys.exit(0)
names = {int(sys.argv[1]): "client", int(sys.argv[2]): "bypass"}
names.update({int(s): "server" for s in sys.argv[3:]})
n.nvmlInit()
h = n.nvmlDeviceGetHandleByIndex(0)
for listing in ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetMPSComputeRunningProcesses",
                "nvmlDeviceGetGraphicsRunningProcesses"):
    try:
        seen = [(p.pid, names.get(p.pid, "?"), (p.usedGpuMemory or 0) >> 20)
                for p in getattr(n, listing)(h)]
        print(f"probe: {listing}: {seen} (pid, which, MiB)")
    except n.NVMLError as e:
        print(f"probe: {listing}: {e}")
PY
command -v nvidia-smi > /dev/null && nvidia-smi

# Without the fifos' write ends, or the client would wait for quit as quit waits for it.
echo quit | control > "$d/quit.out" 2>&1 3>&- 4>&- &
quitting=$!
sleep 1
say "1 s after quit, with the client still holding: quit $(kill -0 $quitting 2>/dev/null && echo "has not returned" || echo "returned [$(cat "$d/quit.out")]"), client $(kill -0 $client 2>/dev/null && echo runs || echo gone), daemon $(kill -0 "$daemon" 2>/dev/null && echo runs || echo gone)"
say "get_server_list while quitting: $(echo get_server_list | timeout 3 3>&- 4>&- env CUDA_MPS_PIPE_DIRECTORY="$d/pipe" nvidia-cuda-mps-control 2>&1 | tr '\n' ' '; echo "(exit ${PIPESTATUS[1]}; 124: no answer in 3 s)")"
CUDA_MPS_PIPE_DIRECTORY=$d/pipe timeout 5 python3 tests/real-gpu/cuda_mps.py > "$d/late" 2>&1 3>&- 4>&-
say "a new client while quitting: exit $? $(cat "$d/late")"
exec 3>&-
for i in $(seq 100); do kill -0 $quitting 2>/dev/null || break; sleep 0.1; done
say "after the client's end: quit returned within $((i * 100)) ms [$(cat "$d/quit.out")]; daemon $(grep -q ') Z ' /proc/"$daemon"/stat 2>/dev/null && echo "a zombie" || { kill -0 "$daemon" 2>/dev/null && echo runs || echo gone; }); pipe directory: [$(ls -A "$d/pipe" | tr '\n' ' ')]"
exec 4>&-
wait

# 5. Two clients of one server, each asking its share through its environment: side by side?
mkdir -p "$d/one"
shared() { CUDA_MPS_PIPE_DIRECTORY=$d/one CUDA_MPS_LOG_DIRECTORY=$d/log "$@"; }
CUDA_VISIBLE_DEVICES=0 shared nvidia-cuda-mps-control -d
sleep 0.2
n=$(shared env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 python3 tests/real-gpu/cuda_mps.py --calibrate 1000 | python3 -c 'import json,sys; print(json.load(sys.stdin)["iterations"])')
alone=$(shared env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 python3 tests/real-gpu/cuda_mps.py --work "$n")
shared env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=25 python3 tests/real-gpu/cuda_mps.py --work "$n" > "$d/w25" &
shared env CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=75 python3 tests/real-gpu/cuda_mps.py --work "$n" > "$d/w75" &
wait
say "one server, clients at 25% and 75% by their environment: alone $alone; together $(cat "$d/w25") and $(cat "$d/w75")"
echo quit | shared nvidia-cuda-mps-control

# 6. What a client of a daemon without a share sees beside 15 idle daemons.
for k in $(seq 16); do
    mkdir -p "$d/many$k"
    CUDA_VISIBLE_DEVICES=0 CUDA_MPS_PIPE_DIRECTORY=$d/many$k CUDA_MPS_LOG_DIRECTORY=$d/log nvidia-cuda-mps-control -d
done
sleep 0.5
say "a client of one of 16 daemons without caps: $(CUDA_MPS_PIPE_DIRECTORY=$d/many1 python3 tests/real-gpu/cuda_mps.py)"
mkfifo "$d/in3"
for k in 2 3 4; do CUDA_MPS_PIPE_DIRECTORY=$d/many$k python3 tests/real-gpu/cuda_mps.py --hold < "$d/in3" > "$d/many$k.out" & done
exec 5> "$d/in3"
for _ in $(seq 100); do [ "$(cat "$d"/many[234].out 2>/dev/null | wc -l)" -ge 3 ] && break; sleep 0.1; done
say "clients of daemons 2-4 (holding): $(cat "$d"/many[234].out | tr '\n' ' ')"
say "then a client of daemon 5: $(CUDA_MPS_PIPE_DIRECTORY=$d/many5 python3 tests/real-gpu/cuda_mps.py)"
exec 5>&-
wait
say "get_default_active_thread_percentage there: $(echo get_default_active_thread_percentage | CUDA_MPS_PIPE_DIRECTORY=$d/many1 nvidia-cuda-mps-control)"
for k in $(seq 16); do echo quit | CUDA_MPS_PIPE_DIRECTORY=$d/many$k nvidia-cuda-mps-control > /dev/null; done
say "done"
