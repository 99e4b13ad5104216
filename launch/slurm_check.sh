#!/usr/bin/env bash
# launch/slurm.sbatch under a real SLURM of one machine. Installs the distribution's slurm-wlm, slurmdbd, munge and
# mariadb-server (apt), starts munged, mariadb, slurmdbd, slurmctld and slurmd on this host (no cgroups: proctrack
# linuxproc, task/none), then runs the sbatch path end to end with a tiny model and checks each outcome:
#   1. a job without GPUs and without PROCS_PER_NODE starts one process per node, and ends COMPLETED 0:0
#   2. `scancel --batch --signal=USR1` (what --signal=B:USR1@300 sends before the time limit): one line for both
#      ranks, a checkpoint, exit 75, the job requeued and held about 2 minutes (BeginTime), then resumed from it
#   3. `scancel --batch --signal=TERM`: "stopped by SIGTERM", exit 75, not requeued (sacct: FAILED 75:0)
#   4. resubmitted, a plain `scancel`: the "cancelled" line, then the step and the checkpoint it saved (sacct:
#      CANCELLED); wandb (offline) is on in every job, so its killed process is part of the check
#   5. resubmitted, it runs to the end: its losses are those of an uninterrupted job with the same settings
# Run as root from a checkout with the harness installed, on a machine you can spare (it writes /etc/slurm/ and
# refuses to replace a slurm.conf it did not write); about 4 minutes on 2 cores, 2 of them SLURM's requeue hold:
#     bash launch/slurm_check.sh [WORKDIR]          # default WORKDIR: a new folder under /tmp
# It prints one "ok:" or "FAIL:" line per check and exits 1 if any failed. The daemons it started are stopped at the
# end; KEEP=1 leaves them running (the jobs' output stays in WORKDIR either way).
set -euo pipefail
cd "$(dirname "$0")/.."
WORK=${1:-$(mktemp -d /tmp/harness-slurm-check.XXXXXX)}
mkdir -p "$WORK"
WORK=$(cd "$WORK" && pwd)
STEPS=2000                           # per job; the signals come every 200 steps or so
MARK="# written by launch/slurm_check.sh"
[ "$(id -u)" -eq 0 ] || { echo "slurm_check: run as root (it installs and starts SLURM)" >&2; exit 2; }
command -v harness > /dev/null || { echo "slurm_check: no harness command: install the harness first" >&2; exit 2; }

# ---- SLURM: installed, configured, running ----
if ! command -v slurmctld > /dev/null || ! command -v slurmdbd > /dev/null || ! command -v mariadbd > /dev/null; then
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q slurm-wlm slurmdbd munge mariadb-server > "$WORK/apt.log"
fi
if [ -f /etc/slurm/slurm.conf ] && ! grep -qF "$MARK" /etc/slurm/slurm.conf; then
  echo "slurm_check: /etc/slurm/slurm.conf is not this script's: not replacing it" >&2
  exit 2
fi
HOST=$(hostname -s)
MEM_MB=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 - 1024 ))  # slurmd drains a node claiming more
cat > /etc/slurm/slurm.conf <<EOF
$MARK: one node, every CPU, no cgroups
ClusterName=harness
SlurmctldHost=$HOST
SlurmUser=root
AuthType=auth/munge
StateSaveLocation=/var/lib/slurm/slurmctld
SlurmdSpoolDir=/var/lib/slurm/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=/var/log/slurm/slurmctld.log
SlurmdLogFile=/var/log/slurm/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
NodeName=$HOST CPUs=$(nproc) RealMemory=$MEM_MB State=UNKNOWN
PartitionName=check Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
# Slurm 22.05 has no CgroupPlugin=disabled: the v1 plugin, constraining nothing
cat > /etc/slurm/cgroup.conf <<EOF
$MARK
CgroupPlugin=cgroup/v1
CgroupAutomount=no
ConstrainCores=no
ConstrainRAMSpace=no
ConstrainDevices=no
EOF
cat > /etc/slurm/slurmdbd.conf <<EOF
$MARK
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
PidFile=/run/slurmdbd.pid
LogFile=/var/log/slurm/slurmdbd.log
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=slurm
StorageLoc=slurm_acct_db
EOF
chmod 600 /etc/slurm/slurmdbd.conf  # slurmdbd refuses a readable one
mkdir -p /var/lib/slurm/slurmctld /var/lib/slurm/slurmd /var/log/slurm /run/munge
chown munge:munge /run/munge
[ -s /etc/munge/munge.key ] || { dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 2> /dev/null
                                 chown munge:munge /etc/munge/munge.key; chmod 400 /etc/munge/munge.key; }
STARTED=()
start() {  # start NAME COMMAND...: unless a process of that name runs
  if ! pgrep -x "$1" > /dev/null; then
    "${@:2}"
    STARTED+=("$1")
  fi
}
stop_started() {  # by the pid files their configurations name
  [ "${KEEP:-0}" = 1 ] && return
  local name
  for name in slurmd slurmctld slurmdbd; do
    if [[ " ${STARTED[*]} " == *" $name "* ]] && [ -s "/run/$name.pid" ]; then
      kill "$(cat "/run/$name.pid")" || true
    fi
  done
  if [[ " ${STARTED[*]} " == *" mariadbd "* ]]; then service mariadb stop > /dev/null || true; fi
  if [[ " ${STARTED[*]} " == *" munged "* ]] && [ -s /run/munge/munged.pid ]; then
    kill "$(cat /run/munge/munged.pid)" || true
  fi
}
trap stop_started EXIT
start munged runuser -u munge -- /usr/sbin/munged
start mariadbd service mariadb start > /dev/null
mysql -e "CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY 'slurm';
          GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"
start slurmdbd slurmdbd
for _ in $(seq 60); do sacctmgr -n list cluster > /dev/null 2>&1 && break; sleep 1; done
sacctmgr -n -P list cluster format=cluster | grep -qx harness || sacctmgr -i add cluster harness > /dev/null
start slurmctld slurmctld
start slurmd slurmd
for _ in $(seq 60); do sinfo -h -o %T | grep -qx idle && break; sleep 1; done
sinfo -h -o %T | grep -qx idle || scontrol update nodename="$HOST" state=resume
VERSION=$(sinfo --version)
echo "slurm_check: $VERSION, one node ($HOST, $(nproc) CPUs); jobs' output in $WORK"

# ---- the jobs ----
python3 - "$WORK/corpus.txt" <<'EOF'  # generated text: the same every time
import random, sys
rng = random.Random(0)
words = ("the model trains on many small batches of text and learns which byte comes next while every rank "
         "sees its own shard of data so the gradients agree").split()
open(sys.argv[1], "w").write("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
                                       for _ in range(1500)) + "\n")
EOF
TINY=(--set "data.path=\"$WORK/corpus.txt\"" --set model.d_model=32 --set model.n_layers=2 --set model.n_heads=2
      --set data.seq_len=32 --set train.micro_batch_size=4 --set train.log_every=1
      --set optimizer.lr=3e-3 --set schedule.warmup_steps=2 --set data.val_fraction=0.1 --set train.save_every=100
      --set train.eval_every=1000000 --set logging.plots=false)
export WANDB_MODE=offline OMP_NUM_THREADS=1 DS=configs/ds/zero2.json
unset PROCS_PER_NODE
submit() {  # submit OUT STEPS [sbatch options]: the job's id; 4 sequences a step for each of PROCS_PER_NODE
  local out=$1 steps=$2
  sbatch --parsable --nodes=1 --cpus-per-task="$(nproc)" --output="$WORK/slurm-%j.out" "${@:3}" launch/slurm.sbatch \
    "${TINY[@]}" --set "run.output_dir=\"$out\"" --set train.max_steps="$steps" \
    --set train.global_batch_size=$((4 * ${PROCS_PER_NODE:-1}))
}
FAILED=0
check() {  # check WHAT COMMAND...: one line, ok or FAIL
  if "${@:2}"; then echo "ok: $1"; else echo "FAIL: $1"; FAILED=$((FAILED + 1)); fi
}
said() { grep -a '^harness: ' "$WORK/slurm-$1.out" || true; }  # the job's own lines, every run of it
said_line() { grep -aqxF -- "$2" "$WORK/slurm-$1.out"; }
said_start() { grep -a '^harness: ' "$WORK/slurm-$1.out" | grep -c "^$2" > /dev/null; }
count_lines() { [ "$(grep -acxF -- "$2" "$WORK/slurm-$1.out")" -eq "$3" ]; }
steps() { if [ -f "$1/metrics.jsonl" ]; then wc -l < "$1/metrics.jsonl"; else echo 0; fi; }
latest() { sed 's/^step_0*//' "$1/checkpoints/latest"; }
state() { squeue -h -j "$1" -o "%T %r" 2> /dev/null || true; }
wait_for() {  # wait_for SECONDS COMMAND...
  local until=$((SECONDS + $1))
  until "${@:2}"; do
    [ "$SECONDS" -lt "$until" ] || { echo "slurm_check: timed out waiting for: ${*:2}" >&2; return 1; }
    sleep 0.5
  done
}
past() { [ "$(steps "$1")" -gt "$2" ]; }
running() { [ "$(state "$1")" = "RUNNING None" ]; }
ended() { [ -z "$(state "$1")" ]; }
requeued() { [ "$(state "$1")" = "PENDING BeginTime" ]; }
start_line() {  # start_line JOB RESTART PROCESSES WHY: the script's first line, as it should be
  echo "harness: job $1 (restart $2) on $HOST: 1 node(s) x $3 process(es) ($4), rendezvous static at" \
       "$HOST:$((10000 + $1 % 20000))"
}
stop_line() {  # stop_line SIGNAL STEP: rank 0's line for every rank
  echo "harness: $1: every rank stops after step $2; saving a checkpoint, then exiting (75)"
}
stopped_line() {  # stopped_line SIGNAL STEP: the launcher's last line
  echo "harness: stopped by $1 after step $2 of $STEPS; latest checkpoint: step_$(printf %08d "$2"); continue with" \
       "--resume auto"
}
sacct_is() {  # sacct_is JOB LINES: `sacct -D` shows these JobID|State|ExitCode lines (slurmdbd may lag a little)
  for _ in $(seq 30); do
    [ "$(sacct -n -P -D -j "$1" -o JobID,State,ExitCode)" = "$2" ] && return 0
    sleep 1
  done
  echo "slurm_check: sacct -D -j $1 shows:" >&2
  sacct -D -j "$1" -o JobID,State,ExitCode >&2
  return 1
}

# 1. A job without GPUs: one process per node, with nothing set by hand
CPU=$(submit "$WORK/cpu" 20)
wait_for 300 ended "$CPU"
check "a job without GPUs or PROCS_PER_NODE starts 1 process per node" \
  said_line "$CPU" "$(start_line "$CPU" 0 1 "a job without GPUs")"
check "it ends COMPLETED 0:0" sacct_is "$CPU" "$CPU|COMPLETED|0:0
$CPU.batch|COMPLETED|0:0
$CPU.0|COMPLETED|0:0"

# 2. The time limit's warning: stopped with a checkpoint, requeued, held, resumed
export PROCS_PER_NODE=2
JOB=$(submit "$WORK/run" "$STEPS")
wait_for 300 past "$WORK/run" 200
scancel --batch --signal=USR1 "$JOB"
wait_for 120 requeued "$JOB"
HELD_S=$(( $(date -d "$(scontrol show job "$JOB" | sed -n 's/.*StartTime=\([^ ]*\).*/\1/p')" +%s) - $(date +%s) ))
USR1_AT=$(latest "$WORK/run")
REF=$(submit "$WORK/whole" "$STEPS")  # the uninterrupted job runs during the hold
check "SIGUSR1: one line for both ranks, at the step they stop after" \
  count_lines "$JOB" "$(stop_line SIGUSR1 "$USR1_AT")" 1
check "SIGUSR1: the ranks' line names it and the checkpoint" \
  said_line "$JOB" "$(stopped_line SIGUSR1 "$USR1_AT")"
check "SIGUSR1: the script requeues" said_line "$JOB" \
  "harness: requeueing job $JOB: SLURM holds it about 2 minutes (its BeginTime), then it continues from this checkpoint"
check "the requeued job is held (squeue: PENDING BeginTime), $HELD_S s from now" test "$HELD_S" -gt 60
wait_for 400 running "$JOB"
wait_for 300 past "$WORK/run" $((USR1_AT + 200))
check "the requeued job runs again (restart 1) and resumes from step $USR1_AT" \
  said_line "$JOB" "$(start_line "$JOB" 1 2 PROCS_PER_NODE)"
check "  ... from its checkpoint" \
  grep -qF "resumed from $WORK/run/checkpoints/step_$(printf %08d "$USR1_AT") at step $USR1_AT" "$WORK/slurm-$JOB.out"

# 3. scancel --batch --signal=TERM: a checkpoint, not requeued
scancel --batch --signal=TERM "$JOB"
wait_for 120 ended "$JOB"
TERM_AT=$(latest "$WORK/run")
check "TERM: the script says it is not requeued" \
  said_line "$JOB" "harness: SIGTERM to the batch script: stopping with a checkpoint; not requeued"
check "TERM: one line for both ranks" \
  count_lines "$JOB" "$(stop_line SIGTERM "$TERM_AT")" 1
check "TERM: the ranks' line names SIGTERM and the checkpoint" \
  said_line "$JOB" "$(stopped_line SIGTERM "$TERM_AT")"
check "TERM: the job's last line" test "$(said "$JOB" | tail -n 1)" = \
  "harness: job $JOB stopped with a checkpoint, not requeued (sacct: FAILED, exit code 75): resubmit to continue"
check "sacct -D: the requeued run (REQUEUED 0:0, its 75 on .batch and .0) and the stopped one (FAILED 75)" \
  sacct_is "$JOB" "$JOB|REQUEUED|0:0
$JOB.batch|FAILED|75:0
$JOB.0|FAILED|75:0
$JOB|FAILED|75:0
$JOB.batch|FAILED|75:0
$JOB.0|FAILED|75:0"

# 4. Resubmitted, then a plain scancel: SIGTERM to every process (wandb's too), SIGKILL after KillWait
JOB2=$(submit "$WORK/run" "$STEPS")
wait_for 300 past "$WORK/run" $((TERM_AT + 200))
scancel "$JOB2"
wait_for 120 ended "$JOB2"
CANCEL_AT=$(latest "$WORK/run")
check "scancel: the script says the job is cancelled" \
  said_start "$JOB2" "harness: job $JOB2 cancelled (scancel, its time limit or a preemption): SLURM sent SIGTERM"
check "scancel: one line for both ranks" \
  count_lines "$JOB2" "$(stop_line SIGTERM "$CANCEL_AT")" 1
check "scancel: the last line names SIGTERM, the step and the checkpoint" \
  test "$(said "$JOB2" | tail -n 1)" = "$(stopped_line SIGTERM "$CANCEL_AT")"
check "sacct: CANCELLED, the batch script's 75 on its line" sacct_is "$JOB2" "$JOB2|CANCELLED by 0|0:0
$JOB2.batch|FAILED|75:0
$JOB2.0|FAILED|75:0"

# 5. Resubmitted, to the end: the losses of the uninterrupted job
JOB3=$(submit "$WORK/run" "$STEPS")
wait_for 600 ended "$JOB3"
wait_for 600 ended "$REF"
check "resubmitted, it runs to the end" sacct_is "$JOB3" "$JOB3|COMPLETED|0:0
$JOB3.batch|COMPLETED|0:0
$JOB3.0|COMPLETED|0:0"
check "every step's loss equals the uninterrupted job's (stopped at $USR1_AT, $TERM_AT, $CANCEL_AT)" \
  python3 - "$WORK/run/metrics.jsonl" "$WORK/whole/metrics.jsonl" "$STEPS" <<'EOF'
import json, sys
runs = [{r["step"]: r["loss"] for r in map(json.loads, open(path))} for path in sys.argv[1:3]]
steps = list(range(1, int(sys.argv[3]) + 1))
if any(list(r) != steps for r in runs):
    sys.exit(f"the steps logged are not 1..{sys.argv[3]} in both runs")
worst = max(abs(runs[0][s] - runs[1][s]) for s in steps)
print(f"slurm_check: {len(steps)} steps, largest difference {worst:g}")
sys.exit(worst != 0)
EOF
for id in "$CPU" "$JOB" "$JOB2" "$JOB3" "$REF"; do
  if grep -q Traceback "$WORK/slurm-$id.out"; then echo "FAIL: a traceback in slurm-$id.out"; FAILED=$((FAILED + 1)); fi
done
echo "slurm_check: $VERSION: $([ "$FAILED" -eq 0 ] && echo "every check passed" || echo "$FAILED check(s) failed")"
[ "$FAILED" -eq 0 ]
