#!/usr/bin/env bash
# Checks tests/slurm/cluster.sh against a real one-node Slurm 22.05 on loopback, with trivial
# shell hooks. Usage (as root): tests/slurm/selftest.sh [DIR]
# DIR (default: a new directory under /tmp, removed at the end when every check passed) holds
# the cluster; its log/ and hooks/ stay for reading when a check fails.
#
# Checks, in order (each prints `==>` and its name; the first failure stops the run and prints
# the daemons' logs):
#   start       the packages (installed when missing), the test users, the cluster
#   batch       sbatch --wrap runs; its task sees FOO=bar from the TaskProlog; the Prolog saw
#               the job's uid and comment; scontrol show job -d has JOB_GRES=gpumem:<bytes>
#   scancel     cancelling that running job runs the Epilog
#   srun        srun runs and sees FOO=bar
#   gpu         --gres=gpu:1 on fake device nodes: SLURM_JOB_GPUS and CUDA_VISIBLE_DEVICES in
#               the Prolog's environment
#   user        a job submitted as gpud-alice runs as her; the Prolog saw her uid; srun as
#               gpud-bob runs as him
#   requeue     a Prolog that requeues its batch job the first time: the job runs later,
#               once, with Restarts=1
#   reconfigure a changed TaskProlog applied with scontrol reconfigure
#   health      the HealthCheckProgram ran
#   stop        no process of the cluster is left
# shellcheck disable=SC2016 # $VARS in single quotes are for the jobs' shells
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
# shellcheck source-path=SCRIPTDIR source=cluster.sh
source "$here/cluster.sh"

fail() {
    printf 'FAILED: %s\n' "$*" >&2
    [ -n "${SLURM_TEST_DIR:-}" ] && slurm_logs
    exit 1
}
step() { printf '\n==> %s\n' "$*"; }
# expect FILE PATTERN: FILE (waited for up to 20 s) has a line matching the extended regex.
expect() {
    local file=$1 pattern=$2 i
    for ((i = 0; i < 200; i++)); do
        [ -f "$file" ] && grep -qE -- "$pattern" "$file" && return 0
        sleep 0.1
    done
    [ -f "$file" ] && sed 's/^/    /' "$file" >&2
    fail "$file: no line matches '$pattern'"
}

[ "$(id -u)" = 0 ] || fail "must run as root"
step start
started=$SECONDS
slurm_install || fail "slurm_install"
slurm_users || fail "slurm_users"
dir=${1:-}
keep=1
if [ -z "$dir" ]; then
    dir=$(mktemp -d /tmp/gpud-slurm.XXXXXX)
    keep=0
fi
cleanup() {
    local rc=$?
    slurm_stop || rc=1
    if [ "$rc" = 0 ] && [ "$keep" = 0 ]; then rm -rf "$dir"; fi
    if [ "$rc" != 0 ]; then echo "state and logs kept in $dir" >&2; fi
    exit "$rc"
}
trap cleanup EXIT
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)

# Hooks: each writes its environment where the checks read it. The Prolog, Epilog and health
# check run as root with no PATH; the TaskProlog runs as the job's user.
hooks=$dir/hooks
mkdir -m 0755 "$hooks"
mkdir -m 1777 "$hooks/out"
mkdir -m 0755 "$hooks/dev"
mknod "$hooks/dev/fakenvidia0" c 195 0
mknod "$hooks/dev/fakenvidia1" c 195 1
cat >"$hooks/prolog" <<EOF
#!/bin/sh
env | sort >"$hooks/out/prolog.\$SLURM_JOB_ID.\${SLURM_JOB_RESTART_COUNT:-0}"
if [ "\$SLURM_JOB_COMMENT" = requeue-once ] && [ "\${SLURM_JOB_RESTART_COUNT:-0}" = 0 ]; then
    /usr/bin/scontrol requeue "\$SLURM_JOB_ID" || exit 1
    /usr/bin/scontrol update JobId="\$SLURM_JOB_ID" StartTime=now+2 || exit 1
fi
exit 0
EOF
cat >"$hooks/epilog" <<EOF
#!/bin/sh
env | sort >"$hooks/out/epilog.\$SLURM_JOB_ID"
EOF
cat >"$hooks/taskprolog" <<EOF
#!/bin/sh
env | sort >"$hooks/out/taskprolog.\$SLURM_JOB_ID.\$SLURM_STEP_ID"
echo "export FOO=bar"
EOF
cat >"$hooks/taskprolog2" <<EOF
#!/bin/sh
echo "export FOO=baz"
EOF
cat >"$hooks/health" <<EOF
#!/bin/sh
env | sort >"$hooks/out/health.\$\$"
EOF
chmod 0755 "$hooks"/prolog "$hooks"/epilog "$hooks"/taskprolog "$hooks"/taskprolog2 "$hooks"/health

hook_conf() {
    printf '%s\n' "Prolog=$hooks/prolog" "Epilog=$hooks/epilog" "TaskProlog=$1" \
        "HealthCheckProgram=$hooks/health" "HealthCheckInterval=5"
}
SLURM_TEST_GRES=gpumem:640G,gpu:2
SLURM_TEST_GRES_CONF="Name=gpumem Count=640G
Name=gpu File=$hooks/dev/fakenvidia[0-1]"
SLURM_TEST_EXTRA_CONF=$(hook_conf "$hooks/taskprolog")
install_done=$SECONDS
slurm_start "$dir" || fail "slurm_start"
printf 'install %ss, start %ss\n' $((install_done - started)) $((SECONDS - install_done))
out=$dir/jobs

step batch
job=$(sbatch --parsable --gres=gpumem:30G --comment=hello -o "$out/%j.out" \
    --wrap 'echo "FOO=$FOO"; sleep 300')
slurm_wait_job "$job" RUNNING || fail "batch job $job does not run"
expect "$out/$job.out" '^FOO=bar$'
expect "$hooks/out/prolog.$job.0" '^SLURM_JOB_UID=0$'
expect "$hooks/out/prolog.$job.0" '^SLURM_JOB_COMMENT=hello$'
scontrol show job -d "$job" | grep -q 'JOB_GRES=gpumem:32212254720' ||
    fail "no JOB_GRES=gpumem:32212254720 in: $(scontrol show job -d "$job")"

step scancel
scancel "$job"
expect "$hooks/out/epilog.$job" "^SLURM_JOB_ID=$job\$"
slurm_wait_job "$job" CANCELLED || fail "job $job is not cancelled"

step srun
got=$(srun -N1 -n1 sh -c 'echo "FOO=$FOO"') || fail "srun failed"
[ "$got" = FOO=bar ] || fail "srun printed '$got', not FOO=bar"

step gpu
got=$(srun --gres=gpu:1 sh -c 'echo "$SLURM_JOB_ID $CUDA_VISIBLE_DEVICES"') || fail "srun --gres=gpu:1 failed"
job=${got% *}
[ "${got#* }" = 0 ] || fail "the task's CUDA_VISIBLE_DEVICES is '${got#* }', not 0"
expect "$hooks/out/prolog.$job.0" '^SLURM_JOB_GPUS=0$'
expect "$hooks/out/prolog.$job.0" '^CUDA_VISIBLE_DEVICES=0$'

step user
alice_uid=$(id -u gpud-alice)
job=$(slurm_as gpud-alice sbatch --parsable -o "$out/%j.out" --wrap 'id -un; echo "FOO=$FOO"')
slurm_wait_job "$job" COMPLETED || fail "job $job of gpud-alice did not complete"
expect "$out/$job.out" '^gpud-alice$'
expect "$out/$job.out" '^FOO=bar$'
expect "$hooks/out/prolog.$job.0" "^SLURM_JOB_UID=$alice_uid\$"
expect "$hooks/out/prolog.$job.0" '^SLURM_JOB_USER=gpud-alice$'
got=$(slurm_as gpud-bob srun id -un) || fail "srun as gpud-bob failed"
[ "$got" = gpud-bob ] || fail "srun as gpud-bob ran as '$got'"

step requeue
job=$(sbatch --parsable --comment=requeue-once -o "$out/%j.out" \
    --wrap 'echo "restarts=$SLURM_RESTART_COUNT"')
expect "$hooks/out/prolog.$job.0" "^SLURM_JOB_ID=$job\$"
slurm_wait_job "$job" COMPLETED 30 || fail "requeued job $job did not complete"
expect "$hooks/out/prolog.$job.1" "^SLURM_JOB_RESTART_COUNT=1\$"
scontrol show job "$job" | grep -q 'Restarts=1 ' || fail "job $job: $(scontrol show job "$job")"
expect "$out/$job.out" '^restarts=1$'
[ "$(grep -c . "$out/$job.out")" = 1 ] || fail "job $job ran more than once: $(cat "$out/$job.out")"

step reconfigure
slurm_reconfigure "$(hook_conf "$hooks/taskprolog2")" || fail "scontrol reconfigure"
got=$(srun sh -c 'echo "FOO=$FOO"') || fail "srun failed"
[ "$got" = FOO=baz ] || fail "after reconfigure srun printed '$got', not FOO=baz"

step health
runs=("$hooks"/out/health.*)
[ -f "${runs[0]}" ] || fail "the HealthCheckProgram never ran"
expect "${runs[0]}" '^SLURMD_NODENAME='

step stop
daemons=$(cat "$dir"/run/*.spawned)
slurm_stop || fail "slurm_stop"
left=$(_slurm_cluster_pids)
for pid in $daemons; do
    [ -d "/proc/$pid" ] && ! grep -q '^State:.*Z' "/proc/$pid/status" 2>/dev/null && left+=" $pid"
done
[ -z "${left// /}" ] || fail "processes left: $(ps -o pid=,args= -p "${left// /,}" || true)"
printf '\nall checks passed (%ss)\n' "$SECONDS"
