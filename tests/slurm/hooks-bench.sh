# shellcheck shell=bash
# The cost of gpud's Slurm hooks, sourced by `tests/slurm/run --bench` with its cluster up:
# the median wall time of `srun --gres=gpumem:1G true` with the hooks against without them,
# in alternating rounds of the same sitting, and of the Prolog alone (run directly for a
# running job, as slurmd runs it) next to the `scontrol show job -d` it makes. Prints
# medians and ratios; checks nothing.
runs=${BENCH_RUNS:-10}
rounds=${BENCH_ROUNDS:-3}
ms() { echo $((($(date +%s%N) - $1) / 1000000)); }
median() { sort -n | awk '{ a[NR] = $1 } END { m = (NR % 2) ? a[(NR + 1) / 2] : (a[NR / 2] + a[NR / 2 + 1]) / 2; printf "%.1f", m }'; }
srun_times() { # appends one time per run to $1
    local i t
    for ((i = 0; i < runs; i++)); do
        t=$(date +%s%N)
        (cd "$jobs" && slurm_as gpud-alice srun --gres=gpumem:1G true) || fail "srun failed"
        ms "$t" >> "$1"
        # The job's Epilog runs after srun returns: the next job starts on an idle node.
        sleep 0.5
    done
}
# Slurm's own cost of running hooks at all: the same three hooks as programs that exit at
# once.
empty="Prolog=/bin/true
TaskProlog=/bin/true
Epilog=/bin/true"
: > "$work/bare" ; : > "$work/empty" ; : > "$work/hooked"
srun_times "$work/hooked" # warm-up, not counted
: > "$work/hooked"
for ((r = 0; r < rounds; r++)); do
    slurm_reconfigure "" > /dev/null
    srun_times "$work/bare"
    slurm_reconfigure "$empty" > /dev/null
    srun_times "$work/empty"
    slurm_reconfigure "$hooks" > /dev/null
    srun_times "$work/hooked"
done
bare=$(median < "$work/bare")
empty=$(median < "$work/empty")
hooked=$(median < "$work/hooked")
over() { awk -v a="$1" -v b="$2" 'BEGIN { printf "+%.1f ms (%.2fx)", a - b, a / b }'; }
say "srun --gres=gpumem:1G true, medians of $(wc -l < "$work/bare") runs each in $rounds alternating rounds:"
say "  no hooks $bare ms; /bin/true as the three hooks $empty ms ($(over "$empty" "$bare")); gpud's hooks $hooked ms ($(over "$hooked" "$bare") over none, $(over "$hooked" "$empty") over /bin/true)"

# The Prolog alone, for a job that runs without a reservation (hooks off meanwhile).
slurm_reconfigure "" > /dev/null
sleep 1
job=$(submit gpud-alice --gres=gpumem:1G --wrap 'sleep 300')
slurm_wait_job "$job" RUNNING 30 || fail "job $job did not start"
: > "$work/prolog" ; : > "$work/scontrol"
for ((i = 0; i < runs * rounds; i++)); do
    t=$(date +%s%N)
    scontrol show job -d "$job" > /dev/null
    ms "$t" >> "$work/scontrol"
    t=$(date +%s%N)
    # As a start of the job after i requeues: each start reserves under an id of its own.
    env -i SLURM_JOB_ID="$job" SLURM_JOB_UID="$alice" SLURM_CLUSTER_NAME="$cluster" \
        SLURM_JOB_RESTART_COUNT=$((i + 1)) SLURM_CONF="$SLURM_CONF" "$work/bin/gpud-slurm-prolog" 2> "$work/prolog.err" || fail "the prolog failed: $(cat "$work/prolog.err")"
    ms "$t" >> "$work/prolog"
    state_is "$job" active || fail "the prolog reserved nothing: $(cat "$work/prolog.err")"
    env -i SLURM_JOB_ID="$job" SLURM_CLUSTER_NAME="$cluster" SLURM_CONF="$SLURM_CONF" \
        "$work/bin/gpud-slurm-epilog" 2> /dev/null
    gpuctl ls -o json | grep -q "\"$(rid "$job").$((i + 1))\"" && fail "the epilog released nothing"
done
say "Prolog alone: median $(median < "$work/prolog") ms, of which scontrol show job -d median $(median < "$work/scontrol") ms ($((runs * rounds)) runs)"
scancel "$job"
