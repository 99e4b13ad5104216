"""A SLURM of one machine for tests/test_slurm.py: `sbatch`, `srun`, `scontrol`, `scancel` and `squeue` that start
real local processes, one srun task per "node" (all on 127.0.0.1), with the variables SLURM gives them.

    python tests/fake_slurm.py install DIR     # DIR/sbatch, srun, scontrol, scancel, squeue: put DIR first on PATH

The job's output goes to slurm-JOBID.out in $FAKE_SLURM_OUT (default: the submit directory). State lives in
$FAKE_SLURM_DIR: job_N.json (the script, its arguments, its pid, its state as squeue shows it, the pids of its
step's tasks, each run's exit code and state as sacct shows them), srun.log (every srun command line). `sbatch
[--gpus-per-node=N] SCRIPT ARGS` forks a controller that runs the batch script as slurmctld would: in its own
session, with SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_CPUS_PER_TASK, SLURM_SUBMIT_DIR,
SLURM_RESTART_COUNT and, for a job with GPUs, SLURM_GPUS_ON_NODE and SLURM_GPUS_PER_NODE; GPUs beyond the node's
$FAKE_SLURM_GPUS (default 0) are refused as Slurm refuses them. Once the script ends, a job `scontrol requeue`d
meanwhile runs again with the count one higher (at once: a real SLURM holds it about 2 minutes).

Signals as Slurm 22.05 delivers them (checked on a real one, launch/slurm_check.sh): `scancel JOB` marks the job
COMPLETING, sends SIGTERM to every process of it and SIGKILL to what is left $FAKE_SLURM_KILL_WAIT_S later (30,
KillWait); `scancel --batch --signal=SIG JOB`: SIG to the batch script alone; `scancel --signal=SIG JOB`: SIG to
every process of the job's step, not to the batch script or srun. `srun` passes SIGUSR1 and SIGINT to every
process of its tasks and answers SIGTERM by killing them, unless the job is being cancelled already (then the
cancel's own SIGTERM and KillWait decide); with --kill-on-bad-exit=1 it kills the others when one fails. Set
FAKE_SLURM_STAGGER_S to start the nodes that many seconds apart.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("FAKE_SLURM_DIR", "/tmp/fake-slurm"))
TOOLS = ("sbatch", "srun", "scontrol", "scancel", "squeue")
KILL_WAIT_S = float(os.environ.get("FAKE_SLURM_KILL_WAIT_S", "30"))


def job_file(job: str) -> Path:
    return STATE / f"job_{job}.json"


def read_job(job: str) -> dict:
    return json.loads(job_file(job).read_text())


def write_job(job: str, state: dict) -> None:
    tmp = job_file(job).with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, job_file(job))


@contextlib.contextmanager
def updating(job: str):
    """The job's state to change in place: the controller, srun and scancel each write it."""
    with open(job_file(job).with_suffix(".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        state = read_job(job)
        yield state
        write_job(job, state)


def directives(script: Path) -> dict[str, str]:
    """The script's #SBATCH --key=value lines."""
    found = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            found[m[1]] = m[2] or ""
    return found


def sbatch(argv: list[str]) -> int:
    """`sbatch [--key=value ...] SCRIPT ARGS`: options before the script win over its #SBATCH lines."""
    given = {}
    while argv and argv[0].startswith("--"):
        key, _, value = argv.pop(0)[2:].partition("=")
        given[key] = value
    script, args = Path(argv[0]), argv[1:]
    opts = {**directives(script), **given}
    gpus = int(opts.get("gpus-per-node", "0").rsplit(":", 1)[-1])
    if gpus > int(os.environ.get("FAKE_SLURM_GPUS", "0")):
        print("sbatch: error: Batch job submission failed: Invalid generic resource (gres) specification",
              file=sys.stderr)
        return 1
    STATE.mkdir(parents=True, exist_ok=True)
    job = str(10000 + (os.getpid() + 997 * len(list(STATE.glob("job_*.json")))) % 80000)  # its port follows it
    write_job(job, {"script": str(script.resolve()), "args": args, "cwd": os.getcwd(), "nodes": int(opts["nodes"]),
                    "cpus": opts.get("cpus-per-task", "1"), "gpus": gpus, "runs": [], "requeue": False,
                    "pid": None, "state": "PENDING", "steps": []})
    subprocess.Popen([sys.executable, __file__, "_controller", job], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job}")
    return 0


def controller(job: str) -> int:
    """slurmctld for one job: run the batch script, again for each requeue; KillWait after a cancel."""
    restarts = 0
    while True:
        state = read_job(job)
        env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_NNODES": str(state["nodes"]),
               "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * state["nodes"]), "SLURM_CPUS_PER_TASK": state["cpus"],
               "SLURM_SUBMIT_DIR": state["cwd"], "SLURM_RESTART_COUNT": str(restarts)}
        if state["gpus"]:
            env.update(SLURM_GPUS_ON_NODE=str(state["gpus"]), SLURM_GPUS_PER_NODE=str(state["gpus"]))
        with open(Path(os.environ.get("FAKE_SLURM_OUT", state["cwd"])) / f"slurm-{job}.out", "ab") as out:
            proc = subprocess.Popen(["bash", state["script"], *state["args"]], cwd=state["cwd"], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            with updating(job) as state:
                state.update(pid=proc.pid, requeue=False, state="RUNNING")
            while (code := proc.poll()) is None:
                cancelled = read_job(job).get("cancelled_at")
                if cancelled and time.time() - cancelled > KILL_WAIT_S:
                    kill_tree(proc.pid, signal.SIGKILL)
                time.sleep(0.1)
        with updating(job) as state:
            cancelled = state.pop("cancelled_at", None)
            ended = "CANCELLED" if cancelled else "REQUEUED" if state["requeue"] else \
                "COMPLETED" if code == 0 else "FAILED"
            state["runs"].append({"code": code, "state": ended})
            state.update(pid=None, steps=[], state="PENDING" if ended == "REQUEUED" else ended)
        if ended != "REQUEUED":
            return 0
        restarts += 1


def srun(argv: list[str]) -> int:
    STATE.mkdir(parents=True, exist_ok=True)
    with open(STATE / "srun.log", "a") as log:
        log.write(json.dumps(argv) + "\n")
    opts, i = {}, 0
    while argv[i].startswith("--"):
        key, _, value = argv[i][2:].partition("=")
        opts[key] = value
        i += 1
    command = argv[i:]
    nodes = int(os.environ["SLURM_NNODES"])
    tasks = []
    for k in range(nodes):  # FAKE_SLURM_STAGGER_S apart: on one machine, the first node hosts a c10d rendezvous
        if k:
            time.sleep(float(os.environ.get("FAKE_SLURM_STAGGER_S", "0")))
        tasks.append(subprocess.Popen(command, env={**os.environ, "SLURM_NODEID": str(k), "SLURM_PROCID": str(k),
                                                    "SLURM_LOCALID": "0",
                                                    "SLURM_CPUS_PER_TASK": opts.get("cpus-per-task", "1")}))
        with updating(os.environ["SLURM_JOB_ID"]) as state:
            state["steps"].append(tasks[-1].pid)

    def forward(signum, frame) -> None:
        """As Slurm's srun: SIGTERM kills the step ("forcing job termination": SIGKILL) unless the job is being
        cancelled (the cancel has signalled every process itself); other signals go to every process of the step
        (slurmstepd signals its whole container)."""
        if signum == signal.SIGTERM and read_job(os.environ["SLURM_JOB_ID"])["state"] == "COMPLETING":
            return
        for t in tasks:
            if t.poll() is None:
                kill_tree(t.pid, signal.SIGKILL if signum == signal.SIGTERM else signum)

    for s in (signal.SIGUSR1, signal.SIGTERM, signal.SIGINT):
        signal.signal(s, forward)
    codes: dict[int, int] = {}
    while len(codes) < len(tasks):
        for k, t in enumerate(tasks):
            if k not in codes and t.poll() is not None:
                codes[k] = t.returncode
                if t.returncode != 0 and opts.get("kill-on-bad-exit") == "1":
                    for other in tasks:
                        if other.poll() is None:
                            kill_tree(other.pid, signal.SIGKILL)  # the step's cgroup: everything below it too
        time.sleep(0.05)
    return max((c if c >= 0 else 128 - c for c in codes.values()), default=0)


def scontrol(argv: list[str]) -> int:
    if argv[:2] == ["show", "hostnames"]:
        print("\n".join(argv[2].split(",")))
        return 0
    if argv[:2] == ["show", "config"]:
        print(f"KillWait                = {KILL_WAIT_S:g} sec")
        return 0
    if argv[0] == "requeue":
        with updating(argv[1]) as state:
            state["requeue"] = True
        return 0
    print(f"fake scontrol: {argv} not known", file=sys.stderr)
    return 1


def squeue(argv: list[str]) -> int:
    """`squeue -h -j JOB -o %T`: the job's state while it is queued or running; nothing once it has ended."""
    if argv[:2] != ["-h", "-j"] or argv[3:] != ["-o", "%T"]:
        print(f"fake squeue: {argv} not known", file=sys.stderr)
        return 1
    state = read_job(argv[2])["state"]
    if state in ("PENDING", "RUNNING", "COMPLETING"):
        print(state)
    return 0


def kill_tree(pid: int, sig: int) -> None:
    """`sig` to `pid` and every process below it, as SLURM's cgroup of a job or step reaches them (launchers that
    start sessions of their own included)."""
    from harness.launcher.supervise import descendants

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def scancel(argv: list[str]) -> int:
    """`scancel JOB`: SIGTERM to every process of the job, SIGKILL KillWait later (the controller). `scancel --batch
    --signal=SIG JOB`: SIG to the batch script alone. `scancel --signal=SIG JOB`: SIG to every process of its step."""
    batch = "--batch" in argv
    given = next((a.split("=", 1)[1] for a in argv if a.startswith("--signal=")), None)
    job = next(a for a in argv if not a.startswith("--"))
    with updating(job) as state:
        if given is None and state["pid"] is not None:
            state.update(state="COMPLETING", cancelled_at=time.time())
    if state["pid"] is None:
        return 0
    if given is None:
        kill_tree(state["pid"], signal.SIGTERM)
        return 0
    sig = getattr(signal, f"SIG{given.removeprefix('SIG')}")
    if batch:
        os.kill(state["pid"], sig)
    else:
        for pid in state["steps"]:
            kill_tree(pid, sig)
    return 0


def install(where: Path) -> None:
    where.mkdir(parents=True, exist_ok=True)
    for tool in TOOLS:
        path = where / tool
        path.write_text(f"#!/bin/sh\nexec '{sys.executable}' '{Path(__file__).resolve()}' {tool} \"$@\"\n")
        path.chmod(0o755)


if __name__ == "__main__":
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # `scontrol show hostnames | head -n 1`: quietly, as the real one
    name, rest = sys.argv[1], sys.argv[2:]
    if name == "install":
        install(Path(rest[0]))
        sys.exit(0)
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "scancel": scancel, "squeue": squeue,
              "_controller": lambda a: controller(a[0])}[name](rest))
