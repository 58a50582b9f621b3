# shellcheck shell=bash
# A one-node Slurm cluster (Debian bookworm's Slurm 22.05) on loopback, for integration tests.
# Source this file (as root), then:
#
#   slurm_install
#       apt-get installs slurmctld, slurmd, slurm-client and munge when any is missing (about
#       5 s; a failed install is retried once after apt-get update), without starting the
#       distribution's own services: a temporary /usr/sbin/policy-rc.d denying them where none
#       exists, and under systemd `systemctl disable --now` munge, slurmctld, slurmd after.
#   slurm_users
#       creates the unprivileged users gpud-alice and gpud-bob (system users, no home) when
#       missing. Submit as one of them with `slurm_as gpud-alice sbatch ...`.
#   slurm_start DIR
#       starts munged, slurmctld and slurmd with every file under DIR (a new or empty directory,
#       or one the test put its hooks in: anything but a former cluster's; made 0755 so that
#       the test users reach the configuration and munge's socket)
#       and waits until the node is idle (slurm_wait_idle). Sets SLURM_TEST_DIR=DIR and exports
#       SLURM_CONF=DIR/slurm.conf, so sinfo, sbatch, srun, scontrol ... talk to this cluster.
#       Configuration, read when slurm_start runs:
#         SLURM_TEST_GRES        the node's Gres= value ("" for none), e.g. gpumem:640G,wholegpu:8;
#                                GresTypes= is made from its names
#         SLURM_TEST_GRES_CONF   the content of gres.conf, e.g. "Name=gpumem Count=640G"
#         SLURM_TEST_EXTRA_CONF  lines appended to slurm.conf (Prolog=, Epilog=, TaskProlog=,
#                                HealthCheckProgram=, PrologFlags= ...)
#         SLURM_TEST_CPUS        the node's CPUs (default 32: over-committed, ~30 1-cpu jobs)
#         SLURM_TEST_TIMEOUT     seconds slurm_start and slurm_wait_idle wait (default 60)
#         SLURM_TEST_SCHED_PARAMS  SchedulerParameters (default batch_sched_delay=0,
#                                bf_interval=1,sched_interval=5: a batch job or a requeued
#                                one whose StartTime came starts within ~1 s)
#       A key given again in SLURM_TEST_EXTRA_CONF wins (slurmctld logs "error: KEY 1
#       specified more than once, latest value used"). Takes ~1.4 s.
#   slurm_wait_idle [SECONDS]
#       waits until the node is idle; on timeout prints sinfo, the node and the daemons' logs
#       to stderr and returns 1.
#   slurm_reconfigure EXTRA_CONF
#       replaces the SLURM_TEST_EXTRA_CONF lines in slurm.conf with EXTRA_CONF and applies
#       them with `scontrol reconfigure` (hooks, health check, timeouts), then waits until
#       slurmd has read them (it logs so: keep SlurmdDebug at info or above). A changed node
#       line (GRES, CPUs) needs slurm_restart instead.
#   slurm_restart
#       stops slurmctld and slurmd, rewrites slurm.conf and gres.conf from the SLURM_TEST_*
#       variables and starts them again (munged and the state directory are kept: jobs
#       survive), then waits until the node answers (~1.2 s).
#   slurm_stop
#       cancels every job (so Epilogs run), stops the daemons (TERM, then KILL after 10 s) and
#       kills whatever is left of this cluster: processes whose environment holds the daemons'
#       marker or SLURM_CONF=DIR/slurm.conf (slurmstepd, tasks, srun ...), and their
#       descendants, never the calling shell or its ancestors; returns 1 if some survive 5 s.
#       Safe to call twice, or when nothing was started: `trap slurm_stop EXIT` before
#       slurm_start. Needs only SLURM_TEST_DIR.
#   slurm_attach DIR
#       in another shell (a test program's helper): loads what slurm_start recorded in
#       DIR/cluster.env and sets SLURM_TEST_DIR and SLURM_CONF, so that every function above
#       acts on that cluster. slurm_stop needs only SLURM_TEST_DIR.
#   slurm_as USER COMMAND [ARG...]
#       runs COMMAND as USER (runuser), keeping SLURM_CONF, in DIR/jobs (1777): a job's working
#       directory and default output (slurm-%j.out) must be reachable by its user.
#   slurm_logs
#       prints the daemons' logs to stderr.
#   slurm_wait_job JOBID STATE [SECONDS]
#       waits until the job's state (scontrol show job) is STATE, e.g. COMPLETED.
#
# Files under DIR: slurm.conf, gres.conf, plugstack.conf (empty), cluster.env (for
# slurm_attach), munge/ (key, socket, seed), state/ (slurmctld), spool/ (slurmd), log/
# (slurmctld.log, slurmd.log, and each daemon's stderr: munged.out, slurmctld.out, slurmd.out),
# run/ (pids), jobs/ (1777: a place where any user's job may write).
#
# Daemons run in the foreground (-D, munged -F), detached from the calling shell (a bare `wait`
# does not wait for them), with cwd DIR. Hooks run by slurmd (Prolog, Epilog, health check)
# get no PATH; Prolog and Epilog get SLURM_CONF=DIR/slurm.conf, the health check does not.
#
# Slurm reaches munged through AuthInfo=socket=DIR/munge/munge.socket; nothing in /etc is used
# or changed except by slurm_install (the packages) and slurm_users (the users).

SLURM_TEST_PACKAGES=(slurmctld slurmd slurm-client munge)
SLURM_TEST_USERS=(gpud-alice gpud-bob)
: "${SLURM_TEST_GRES=gpumem:640G}"
: "${SLURM_TEST_GRES_CONF=Name=gpumem Count=640G}"
: "${SLURM_TEST_EXTRA_CONF=}"
: "${SLURM_TEST_CPUS:=32}"
: "${SLURM_TEST_TIMEOUT:=60}"
: "${SLURM_TEST_SCHED_PARAMS:=batch_sched_delay=0,bf_interval=1,sched_interval=5}"

_slurm_say() { printf 'slurm-test: %s\n' "$*" >&2; }

slurm_install() {
    local missing=() pkg
    for pkg in "${SLURM_TEST_PACKAGES[@]}"; do
        dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q 'ok installed' || missing+=("$pkg")
    done
    [ ${#missing[@]} = 0 ] && return 0
    _slurm_say "installing ${missing[*]}"
    local policy=/usr/sbin/policy-rc.d made_policy=0
    if [ ! -e "$policy" ]; then
        printf '#!/bin/sh\nexit 101\n' >"$policy"
        chmod 0755 "$policy"
        made_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends "${missing[@]}" \
        >&2 || rc=$?
    if [ "$rc" != 0 ]; then
        # A stale package list on a fresh machine: update once and try again.
        DEBIAN_FRONTEND=noninteractive apt-get update -q >&2 &&
            DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
                "${missing[@]}" >&2 && rc=0 || rc=$?
    fi
    [ "$made_policy" = 1 ] && rm -f "$policy"
    if [ "$rc" != 0 ]; then
        _slurm_say "apt-get install ${missing[*]} failed"
        return 1
    fi
    # Where systemd runs (or policy-rc.d was ignored), the packages' own daemons may be up.
    local unit
    for unit in munge slurmctld slurmd; do
        if [ -d /run/systemd/system ]; then
            systemctl disable --now "$unit" >/dev/null 2>&1 || true
        fi
    done
    return 0
}

slurm_users() {
    local user
    for user in "${SLURM_TEST_USERS[@]}"; do
        id -u "$user" >/dev/null 2>&1 ||
            useradd --system --no-create-home --home-dir /nonexistent --shell /bin/sh \
                --user-group "$user"
    done
}

slurm_as() {
    local user=$1
    shift
    (cd "$SLURM_TEST_DIR/jobs" && runuser -u "$user" -- env SLURM_CONF="$SLURM_CONF" "$@")
}

# Two TCP ports nothing listens on (from /proc/net/tcp{,6}): SLURM_TEST_CTLD_PORT, SLURM_TEST_SLURMD_PORT.
_slurm_pick_ports() {
    local used="" hex port picked=()
    while read -r hex; do
        [[ $hex =~ ^[0-9A-Fa-f]+$ ]] && used+=" $((16#$hex)) "
    done < <(awk 'FNR > 1 { split($2, a, ":"); print a[2] }' /proc/net/tcp /proc/net/tcp6 2>/dev/null)
    while [ ${#picked[@]} -lt 2 ]; do
        port=$((20000 + RANDOM % 30000))
        case "$used ${picked[*]} " in *" $port "*) continue ;; esac
        picked+=("$port")
    done
    SLURM_TEST_CTLD_PORT=${picked[0]}
    SLURM_TEST_SLURMD_PORT=${picked[1]}
}

_slurm_write_conf() {
    local dir=$SLURM_TEST_DIR host gres_types=""
    host=$SLURM_TEST_HOST
    if [ -n "$SLURM_TEST_GRES" ]; then
        gres_types=$(tr ',' '\n' <<<"$SLURM_TEST_GRES" | cut -d: -f1 | sort -u | paste -sd, -)
    fi
    cat >"$dir/slurm.conf.new" <<EOF
# Written by tests/slurm/cluster.sh
ClusterName=gpudtest
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$SLURM_TEST_CTLD_PORT
SlurmdPort=$SLURM_TEST_SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
PlugStackConfig=$dir/plugstack.conf
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
SchedulerParameters=$SLURM_TEST_SCHED_PARAMS
MailProg=/bin/true
MpiDefault=none
SwitchType=switch/none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
SlurmdParameters=config_overrides
ReturnToService=2
MinJobAge=600
KillWait=2
InactiveLimit=0
SlurmdTimeout=300
MessageTimeout=10
${gres_types:+GresTypes=$gres_types
}NodeName=$host NodeAddr=127.0.0.1 NodeHostname=$host CPUs=$SLURM_TEST_CPUS ${SLURM_TEST_GRES:+Gres=$SLURM_TEST_GRES }State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
# extra
$SLURM_TEST_EXTRA_CONF
EOF
    mv "$dir/slurm.conf.new" "$dir/slurm.conf"
    printf '%s\n' "$SLURM_TEST_GRES_CONF" >"$dir/gres.conf"
    : >"$dir/plugstack.conf"
    chmod 0644 "$dir/slurm.conf" "$dir/gres.conf" "$dir/plugstack.conf"
}

# Runs a daemon in the foreground (its log on DIR/log/NAME.out), detached from this shell (a
# subshell's background child, so that a test's bare `wait` does not wait for it), with the
# cluster's marker in its environment (slurm_stop finds what is left by it).
_slurm_spawn() {
    local name=$1
    shift
    (
        cd "$SLURM_TEST_DIR" &&
            GPUD_SLURM_TEST_CLUSTER=$SLURM_TEST_DIR exec "$@" \
                </dev/null >"$SLURM_TEST_DIR/log/$name.out" 2>&1 &
        echo $! >"$SLURM_TEST_DIR/run/$name.spawned"
    )
}

_slurm_start_daemons() {
    local dir=$SLURM_TEST_DIR
    _slurm_spawn slurmctld slurmctld -D -i -f "$dir/slurm.conf"
    _slurm_spawn slurmd slurmd -D -f "$dir/slurm.conf" -N "$SLURM_TEST_HOST"
}

slurm_start() {
    local dir=${1:?slurm_start DIR}
    mkdir -p "$dir"
    dir=$(cd "$dir" && pwd)
    if [ -e "$dir/slurm.conf" ]; then
        _slurm_say "$dir already holds a cluster"
        return 1
    fi
    export SLURM_TEST_DIR=$dir
    export SLURM_CONF=$dir/slurm.conf
    SLURM_TEST_HOST=$(uname -n)
    SLURM_TEST_HOST=${SLURM_TEST_HOST%%.*}
    _slurm_pick_ports
    mkdir -p "$dir"/{munge,state,spool,log,run,jobs}
    # Explicit modes, whatever the umask: the test users read slurm.conf and reach munge's
    # socket; any job writes in jobs/.
    chmod 0755 "$dir" "$dir/munge" "$dir/log" "$dir/run"
    chmod 0700 "$dir/state" "$dir/spool"
    chmod 1777 "$dir/jobs"
    _slurm_write_conf
    _slurm_save_env

    # munged: its own key, socket, pid, log and seed under DIR/munge. --force: where a parent
    # of DIR is group- or world-writable without the sticky bit munged would refuse to start
    # ("Error: PRNG seed dir is insecure: ..."); with it, it only warns.
    dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$dir/munge/munge.key"
    _slurm_spawn munged munged -F --force --socket="$dir/munge/munge.socket" \
        --key-file="$dir/munge/munge.key" --pid-file="$dir/munge/munged.pid" \
        --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
    local i
    for ((i = 0; i < 100; i++)); do
        [ -S "$dir/munge/munge.socket" ] && break
        sleep 0.1
    done
    if [ ! -S "$dir/munge/munge.socket" ]; then
        _slurm_say "munged did not start"
        slurm_logs
        return 1
    fi
    _slurm_start_daemons
    slurm_wait_idle "$SLURM_TEST_TIMEOUT"
}

# What slurm_attach needs to act on the cluster from another shell.
_slurm_save_env() {
    local v
    for v in SLURM_TEST_HOST SLURM_TEST_CTLD_PORT SLURM_TEST_SLURMD_PORT SLURM_TEST_GRES \
        SLURM_TEST_GRES_CONF SLURM_TEST_EXTRA_CONF SLURM_TEST_CPUS SLURM_TEST_SCHED_PARAMS; do
        declare -p "$v"
    done | sed 's/^declare -[-a-zA-Z]* /declare -g /' >"$SLURM_TEST_DIR/cluster.env"
}

slurm_attach() {
    local dir=${1:?slurm_attach DIR}
    dir=$(cd "$dir" && pwd)
    [ -f "$dir/cluster.env" ] || { _slurm_say "$dir holds no cluster"; return 1; }
    # shellcheck source=/dev/null
    source "$dir/cluster.env"
    export SLURM_TEST_DIR=$dir
    export SLURM_CONF=$dir/slurm.conf
}

slurm_logs() {
    local f
    for f in "$SLURM_TEST_DIR"/log/*; do
        [ -f "$f" ] || continue
        printf '==== %s (last 60 lines)\n' "$f" >&2
        tail -n 60 "$f" >&2
    done
}

slurm_wait_idle() {
    _slurm_wait_node '^idle$' "${1:-$SLURM_TEST_TIMEOUT}"
}

# Waits until the node's state (sinfo %T) matches the extended regex STATES.
_slurm_wait_node() {
    local states=$1 timeout=$2 deadline state=""
    deadline=$((SECONDS + timeout))
    local why="" name
    while ((SECONDS < deadline)); do
        state=$(sinfo -h -N -o '%T' 2>/dev/null | head -n1) || true
        [[ $state =~ $states ]] && return 0
        for name in munged slurmctld slurmd; do
            if [ -f "$SLURM_TEST_DIR/run/$name.spawned" ] && ! _slurm_running "$name"; then
                why="$name exited"
            fi
        done
        [ -n "$why" ] && break
        sleep 0.2
    done
    [ -n "$why" ] || why="not idle after ${timeout}s"
    _slurm_say "the node is not ${states//[\^\$]/}: $why (state: '${state:-no answer}')"
    sinfo -N -l >&2 || true
    scontrol show node >&2 || true
    slurm_logs
    return 1
}

slurm_wait_job() {
    local job=$1 want=$2 timeout=${3:-$SLURM_TEST_TIMEOUT} deadline state=""
    deadline=$((SECONDS + timeout))
    while ((SECONDS < deadline)); do
        state=$(scontrol show job "$job" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p')
        [ "$state" = "$want" ] && return 0
        sleep 0.2
    done
    _slurm_say "job $job is not $want after ${timeout}s (state: '${state:-none}')"
    scontrol show job -d "$job" >&2 || true
    return 1
}

# slurmd reads its configuration again (at start and on reconfigure) when it logs this line.
_slurm_slurmd_loads() {
    grep -c 'CPU frequency setting not configured for this node' "$SLURM_TEST_DIR/log/slurmd.log" 2>/dev/null ||
        true
}

slurm_reconfigure() {
    SLURM_TEST_EXTRA_CONF=$1
    _slurm_save_env
    local before i
    before=$(_slurm_slurmd_loads)
    _slurm_write_conf
    scontrol reconfigure || return 1
    # scontrol returns once slurmctld has the new configuration; slurmd gets it a moment
    # later: a step launched in between would still see the old hooks.
    for ((i = 0; i < 100; i++)); do
        [ "$(_slurm_slurmd_loads)" -gt "$before" ] && return 0
        sleep 0.05
    done
    _slurm_say "slurmd did not read the new configuration in 5s"
    slurm_logs
    return 1
}

# Whether the daemon slurm_start recorded as NAME runs (a zombie, or a pid reused by another
# process since, does not: the marker is checked).
_slurm_running() {
    local pidfile=$SLURM_TEST_DIR/run/$1.spawned pid
    [ -f "$pidfile" ] || return 1
    pid=$(cat "$pidfile")
    grep -qzxF "GPUD_SLURM_TEST_CLUSTER=$SLURM_TEST_DIR" "/proc/$pid/environ" 2>/dev/null
}

_slurm_kill_spawned() {
    local name pidfile i alive
    for name in "$@"; do
        _slurm_running "$name" && kill -TERM "$(cat "$SLURM_TEST_DIR/run/$name.spawned")" 2>/dev/null
    done
    for ((i = 0; i < 100; i++)); do
        alive=0
        for name in "$@"; do
            _slurm_running "$name" && alive=1
        done
        [ "$alive" = 0 ] && break
        sleep 0.1
    done
    for name in "$@"; do
        pidfile=$SLURM_TEST_DIR/run/$name.spawned
        [ -f "$pidfile" ] || continue
        _slurm_running "$name" && kill -KILL "$(cat "$pidfile")" 2>/dev/null
        rm -f "$pidfile"
    done
    return 0
}

slurm_restart() {
    _slurm_kill_spawned slurmd slurmctld
    _slurm_write_conf
    _slurm_save_env
    _slurm_start_daemons
    # Jobs may have outlived the restart.
    _slurm_wait_node '^(idle|mixed|allocated|completing)$' "$SLURM_TEST_TIMEOUT"
}

# Pids of this cluster's processes: those whose environment holds the daemons' marker or
# SLURM_CONF=DIR/slurm.conf (slurmstepd, jobs' tasks, srun and other clients; slurmd and
# slurmstepd set it), with all their descendants; never this shell or its ancestors.
_slurm_cluster_pids() (
    # The helpers below must not carry the markers themselves (unset once per scope: a
    # caller's local hides the global).
    while [ -n "${SLURM_CONF+x}${GPUD_SLURM_TEST_CLUSTER+x}" ]; do
        unset SLURM_CONF GPUD_SLURM_TEST_CLUSTER
    done
    local marker="GPUD_SLURM_TEST_CLUSTER=$SLURM_TEST_DIR" conf="SLURM_CONF=$SLURM_TEST_DIR/slurm.conf"
    local table roots=()
    # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
    table=$({ cat /proc/[0-9]*/stat 2>/dev/null || true; } | sed -E 's/^([0-9]+) \(.*\) [A-Za-z] ([0-9]+) .*/\1 \2/')
    mapfile -t roots < <(grep -lzxF -e "$marker" -e "$conf" /proc/[0-9]*/environ 2>/dev/null |
        sed -E 's|^/proc/([0-9]+)/environ$|\1|')
    [ ${#roots[@]} = 0 ] && return 0
    awk -v roots="${roots[*]}" -v self="$BASHPID" '
        { parent[$1] = $2 }
        END {
            # Never this shell, its ancestors, or its own helpers (its descendants).
            for (p = self; p != "" && p != 0 && !(p in spare); p = parent[p]) spare[p] = 1
            for (p in parent) {
                for (q = p; q != "" && q != 0 && q != self && (q in parent); q = parent[q]) ;
                if (q == self) spare[p] = 1
            }
            n = split(roots, r, " ")
            for (i = 1; i <= n; i++) keep[r[i]] = 1
            changed = 1
            while (changed) {
                changed = 0
                for (p in parent) if (!(p in keep) && (parent[p] in keep)) { keep[p] = 1; changed = 1 }
            }
            for (p in keep) if (!(p in spare)) print p
        }' <<<"$table"
)

slurm_stop() {
    [ -n "${SLURM_TEST_DIR:-}" ] && [ -d "$SLURM_TEST_DIR/run" ] || return 0
    export SLURM_CONF=$SLURM_TEST_DIR/slurm.conf
    # Jobs first, so that their Epilogs run and slurmd cleans up after them.
    local jobs i
    if _slurm_running slurmctld; then
        jobs=$(squeue -h -o %A 2>/dev/null | paste -sd' ' -) || true
        if [ -n "$jobs" ]; then
            # shellcheck disable=SC2086
            scancel $jobs 2>/dev/null || true
            for ((i = 0; i < 100; i++)); do
                [ -z "$(squeue -h -o %A 2>/dev/null)" ] && break
                sleep 0.1
            done
        fi
    fi
    _slurm_kill_spawned slurmd slurmctld munged
    # What is left (slurmstepd, tasks, clients): killed until none is.
    local pids round
    for ((round = 0; round < 50; round++)); do
        pids=$(_slurm_cluster_pids)
        [ -z "$pids" ] && return 0
        # shellcheck disable=SC2086
        kill -KILL $pids 2>/dev/null || true
        sleep 0.1
    done
    _slurm_say "processes left: $pids"
    return 1
}
