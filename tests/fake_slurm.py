"""A SLURM of one machine for tests/test_slurm.py: `sbatch`, `srun`, `scontrol` and `scancel` that start real local
processes, one srun task per "node" (all on 127.0.0.1), with the variables SLURM gives them.

    python tests/fake_slurm.py install DIR     # DIR/sbatch, srun, scontrol, scancel: put DIR first on PATH

The job's output goes to slurm-JOBID.out in $FAKE_SLURM_OUT (default: the submit directory). State lives in
$FAKE_SLURM_DIR: job_N.json (the script, its arguments, its pid, each run's exit code, requeued or
not), srun.log (every srun command line). `sbatch` forks a controller that runs the batch script as slurmctld
would: in its own session, with SLURM_JOB_ID, SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_CPUS_PER_TASK,
SLURM_SUBMIT_DIR and SLURM_RESTART_COUNT; once the script ends, a job `scontrol requeue`d meanwhile runs again
with the count one higher. `scancel` sends SIGTERM to every process of the job, as SLURM does (`--batch
--signal=SIG`: SIG to the batch script alone). `srun` passes SIGUSR1 and SIGINT to every process of its tasks and
answers SIGTERM by killing them, as Slurm's srun does; with --kill-on-bad-exit=1 it kills the others when one fails. Set
FAKE_SLURM_STAGGER_S to start the nodes that many seconds apart.
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("FAKE_SLURM_DIR", "/tmp/fake-slurm"))
TOOLS = ("sbatch", "srun", "scontrol", "scancel")


def job_file(job: str) -> Path:
    return STATE / f"job_{job}.json"


def read_job(job: str) -> dict:
    return json.loads(job_file(job).read_text())


def write_job(job: str, state: dict) -> None:
    tmp = job_file(job).with_suffix(".tmp")
    tmp.write_text(json.dumps(state))
    os.replace(tmp, job_file(job))


def directives(script: Path) -> dict[str, str]:
    """The script's #SBATCH --key=value lines."""
    found = {}
    for line in script.read_text().splitlines():
        m = re.match(r"#SBATCH\s+--([\w-]+)(?:=(\S+))?", line)
        if m:
            found[m[1]] = m[2] or ""
    return found


def sbatch(argv: list[str]) -> int:
    script, args = Path(argv[0]), argv[1:]
    STATE.mkdir(parents=True, exist_ok=True)
    job = str(10000 + (os.getpid() + 997 * len(list(STATE.glob("job_*.json")))) % 80000)  # its port follows it
    opts = directives(script)
    write_job(job, {"script": str(script.resolve()), "args": args, "cwd": os.getcwd(), "nodes": int(opts["nodes"]),
                    "cpus": opts.get("cpus-per-task", "1"), "runs": [], "requeue": False, "pid": None})
    subprocess.Popen([sys.executable, __file__, "_controller", job], start_new_session=True,
                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    print(f"Submitted batch job {job}")
    return 0


def controller(job: str) -> int:
    """slurmctld for one job: run the batch script, again for each requeue."""
    restarts = 0
    while True:
        state = read_job(job)
        env = {**os.environ, "SLURM_JOB_ID": job, "SLURM_NNODES": str(state["nodes"]),
               "SLURM_JOB_NODELIST": ",".join(["127.0.0.1"] * state["nodes"]), "SLURM_CPUS_PER_TASK": state["cpus"],
               "SLURM_SUBMIT_DIR": state["cwd"], "SLURM_RESTART_COUNT": str(restarts)}
        with open(Path(os.environ.get("FAKE_SLURM_OUT", state["cwd"])) / f"slurm-{job}.out", "ab") as out:
            proc = subprocess.Popen(["bash", state["script"], *state["args"]], cwd=state["cwd"], env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            state.update(pid=proc.pid, requeue=False)
            write_job(job, state)
            code = proc.wait()
        state = read_job(job)
        state["runs"].append({"code": code, "requeued": state["requeue"]})
        state["pid"] = None
        write_job(job, state)
        if not state["requeue"]:
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

    def forward(signum, frame) -> None:
        """As Slurm's srun: SIGTERM kills the step ("forcing job termination": SIGKILL); other signals go to every
        process of the step (slurmstepd signals its whole container)."""
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
    if argv[0] == "requeue":
        state = read_job(argv[1])
        state["requeue"] = True
        write_job(argv[1], state)
        return 0
    print(f"fake scontrol: {argv} not known", file=sys.stderr)
    return 1


def kill_tree(pid: int, sig: int) -> None:
    """`sig` to `pid` and every process below it, as SLURM's cgroup of a job or step reaches them (launchers that
    start sessions of their own included)."""
    from harness.launcher import descendants

    for p in [pid, *descendants(pid)]:
        try:
            os.kill(p, sig)
        except ProcessLookupError:
            pass


def scancel(argv: list[str]) -> int:
    """`scancel JOB`: SIGTERM to every process of the job (the batch script and all below it). `scancel --batch
    --signal=SIG JOB`: SIG to the batch script alone."""
    batch = "--batch" in argv
    sig = next((getattr(signal, f"SIG{a.split('=', 1)[1].removeprefix('SIG')}") for a in argv
                if a.startswith("--signal=")), signal.SIGTERM)
    pid = read_job([a for a in argv if not a.startswith("--")][0])["pid"]
    if pid is not None:
        if batch:
            os.kill(pid, sig)
        else:
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
    sys.exit({"sbatch": sbatch, "srun": srun, "scontrol": scontrol, "scancel": scancel,
              "_controller": lambda a: controller(a[0])}[name](rest))
