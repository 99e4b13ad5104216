"""launch/slurm.sbatch end to end under a SLURM of one machine (tests/fake_slurm.py: sbatch, srun, scontrol and
scancel starting real local processes, two "nodes" on 127.0.0.1): the time limit's warning stops the job with a
checkpoint and requeues it, a `scancel --batch --signal=TERM` stops it with a checkpoint and does not, and the job
resubmitted continues
with the losses of an uninterrupted run. Also: a run directory that the nodes do not share is refused before
training."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from conftest import DS, LAUNCH, ROOT, TINY, Run, _env, assert_losses_close, harness
from fake_slurm import kill_tree

SETS = [*TINY, "train.max_steps=400", "train.global_batch_size=8", "train.save_every=50",
        "train.eval_every=1000000"]


def wait_for(what, seconds: float = 180.0, every: float = 0.1):
    deadline = time.time() + seconds
    while not (found := what()):
        assert time.time() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(every)
    return found


def test_the_sbatch_script_requeues_on_the_time_limits_warning_only_and_the_job_resumes_exactly(tmp_path, corpus):
    tools, state, out = tmp_path / "bin", tmp_path / "slurm", tmp_path / "run"
    subprocess.run([sys.executable, str(ROOT / "tests" / "fake_slurm.py"), "install", str(tools)], check=True)
    env = _env({"PATH": f"{tools}:{Path(sys.executable).parent}:{os.environ['PATH']}", "FAKE_SLURM_DIR": str(state),
                "FAKE_SLURM_OUT": str(tmp_path), "GPUS_PER_NODE": "1", "DS": str(DS / "zero2.json"),
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10"}, cold=True)  # cold: SLURM's signals reach the process tree
    args = ["--set", f"data.path={json.dumps(str(corpus))}", "--set", f"run.output_dir={json.dumps(str(out))}"]
    for s in SETS:
        args += ["--set", s]

    def submit(**extra: str) -> str:
        done = subprocess.run(["sbatch", str(LAUNCH / "slurm.sbatch"), *args], cwd=ROOT, env={**env, **extra},
                              check=True, capture_output=True, text=True)
        return done.stdout.split()[-1]

    def job(id_: str) -> dict:
        return json.loads((state / f"job_{id_}.json").read_text())

    def steps() -> int:
        return len(Run(out, None).metrics)

    def running_at(id_: str, restart: int, past: int) -> bool:
        """the job's batch script runs (its `restart`th run) and the run logged more than `past` steps"""
        j = job(id_)
        return j["pid"] is not None and len(j["runs"]) == restart and steps() > past + 2

    def log(id_: str) -> str:
        return (tmp_path / f"slurm-{id_}.out").read_text()

    first = submit()
    try:
        # 1. SIGUSR1 to the batch script (--signal=B:USR1@300): every node stops with a checkpoint, exits 75, and
        # the job is requeued; it runs again from that checkpoint
        wait_for(lambda: running_at(first, 0, 0))
        os.kill(job(first)["pid"], signal.SIGUSR1)
        wait_for(lambda: len(job(first)["runs"]) == 1)
        assert job(first)["runs"][0] == {"code": 75, "requeued": True}, log(first)[-3000:]
        stopped = int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))
        assert f"stopped by SIGUSR1 after step {stopped}" in log(first)
        assert "requeueing job" in log(first)
        # 2. scancel --batch --signal=TERM (the script passes it on as SIGUSR1: srun would kill the step on a
        # SIGTERM): a checkpoint again, exit 75, not requeued
        wait_for(lambda: running_at(first, 1, stopped))
        subprocess.run(["scancel", "--batch", "--signal=TERM", first], env=env, check=True)
        wait_for(lambda: job(first)["pid"] is None and len(job(first)["runs"]) == 2)
        assert job(first)["runs"][1] == {"code": 75, "requeued": False}, log(first)[-3000:]
        assert f"resumed from {out / 'checkpoints' / f'step_{stopped:08d}'}" in log(first)
        # 3. resubmitted with torchrun's dynamic rendezvous, it runs to the end; every srun gave each node's
        # launcher the job's CPUs
        second = submit(RDZV="c10d", FAKE_SLURM_STAGGER_S="3")
        wait_for(lambda: len(job(second)["runs"]) == 1, seconds=300)
        assert job(second)["runs"][0]["code"] == 0, log(second)[-3000:]
        sruns = [json.loads(x) for x in (state / "srun.log").read_text().splitlines()]
        assert len(sruns) == 3 and all("--cpus-per-task=32" in s for s in sruns), sruns
        assert "rendezvous static at 127.0.0.1:" in log(first) and "rendezvous c10d at 127.0.0.1:" in log(second)
        for id_ in (first, second):
            assert "Traceback" not in log(id_), log(id_)[-3000:]
    finally:  # nothing of a failed test's jobs left running
        for path in state.glob("job_*.json"):
            pid = json.loads(path.read_text())["pid"]
            if pid:
                kill_tree(pid, signal.SIGKILL)
    resumed = Run(out, None)
    assert [m["step"] for m in resumed.metrics] == list(range(1, 401))
    whole = harness(tmp_path / "whole", corpus, nproc=2, ds="zero2.json", sets=SETS)
    assert_losses_close(resumed.losses, whole.losses, 1e-5)


def test_a_run_directory_the_nodes_do_not_share_is_refused_before_training(tmp_path, corpus):
    """Two "nodes" started in two folders with a relative run.output_dir: each writes its own copy. The check
    before training (each node writes a token, every node must read them all) refuses in one line, exit 2."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = []
    for node in (0, 1):
        cwd = tmp_path / f"node{node}"
        cwd.mkdir()
        cmd = [sys.executable, "-m", "harness", "launch", "--config_file", str(LAUNCH / "multi_node.yaml"),
               "--machine_rank", str(node), "--main_process_ip", "127.0.0.1", "--main_process_port", str(port),
               "--num_machines", "2", "--num_processes", "2", "train", "--ds", str(DS / "zero2.json"),
               "--set", f"data.path={json.dumps(str(corpus))}", "--set", 'run.output_dir="run"']
        for item in TINY:
            cmd += ["--set", item]
        procs.append(subprocess.Popen(cmd, cwd=cwd, env=_env({"PYTHONPATH": str(ROOT), "HARNESS_SHARED_WAIT_S": "3"}),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for node, proc in enumerate(procs):
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 2, err[-3000:]
        line = err.strip().splitlines()[-1]
        assert line.startswith("harness: error: run.output_dir = 'run'") and "is not on storage every node shares" \
            in line, err[-3000:]
    assert not (tmp_path / "node1" / "run" / "metrics.jsonl").exists()


def test_a_bad_shared_storage_wait_is_refused_before_launch(tmp_path, corpus, monkeypatch, capsys):
    from harness.cli import main

    for bad in ("soon", "-1", "nan"):
        monkeypatch.setenv("HARNESS_SHARED_WAIT_S", bad)
        assert main(["train", "--set", f"data.path={json.dumps(str(corpus))}", "--set",
                     f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "--set", "train.max_steps=2"]) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"harness: error: HARNESS_SHARED_WAIT_S={bad!r}: the seconds each node looks"), line
    assert not (tmp_path / "run").exists()
