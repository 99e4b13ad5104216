"""launch/slurm.sbatch end to end under a SLURM of one machine (tests/fake_slurm.py: sbatch, srun, scontrol, scancel
and squeue starting real local processes, two "nodes" on 127.0.0.1, signals delivered as Slurm 22.05 delivers them):
the time limit's warning stops the job with a checkpoint and requeues it, `scancel --batch --signal=TERM` stops it
with a checkpoint and does not, a plain `scancel` cancels it with a checkpoint (wandb's process killed on the way),
and the job resubmitted continues with the losses of an uninterrupted run. A job without GPUs starts one process per
node, one with GPUs one per GPU, with nothing set by hand. Also: a run directory that the nodes do not share is
refused before training, and a rank lost while the job stops is named at the step the ranks were at.
launch/slurm_check.sh runs the same path under a real SLURM."""
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

SETS = [*TINY, "train.global_batch_size=8", "train.save_every=50", "train.eval_every=1000000",
        'schedule.kind="constant"']  # an lr that does not depend on train.max_steps: see LONG
LONG = 100_000  # the interrupted jobs' length: none can end before the signal meant to stop it reaches it, however
# slow the machine (a signal's way through the job takes seconds; with 400 steps a loaded machine ran them all)


def wait_for(what, seconds: float = 180.0, every: float = 0.1):
    deadline = time.time() + seconds
    while not (found := what()):
        assert time.time() < deadline, f"timed out waiting for {what.__doc__ or what}"
        time.sleep(every)
    return found


def test_the_sbatch_script_stops_requeues_and_cancels_as_slurm_signals_it_and_the_job_resumes_exactly(tmp_path,
                                                                                                       corpus):
    tools, state, out = tmp_path / "bin", tmp_path / "slurm", tmp_path / "run"
    subprocess.run([sys.executable, str(ROOT / "tests" / "fake_slurm.py"), "install", str(tools)], check=True)
    env = _env({"PATH": f"{tools}:{Path(sys.executable).parent}:{os.environ['PATH']}", "FAKE_SLURM_DIR": str(state),
                "FAKE_SLURM_OUT": str(tmp_path), "DS": str(DS / "zero2.json"), "PROCS_PER_NODE": None,
                "TORCH_ELASTIC_SHUTDOWN_TIMEOUT": "10"}, cold=True)  # cold: SLURM's signals reach the process tree
    args = ["--set", f"data.path={json.dumps(str(corpus))}", "--set", f"run.output_dir={json.dumps(str(out))}"]
    for s in [*SETS, f"train.max_steps={LONG}"]:
        args += ["--set", s]

    def submit(*options: str, train: tuple[str, ...] = (), **extra: str) -> subprocess.CompletedProcess:
        return subprocess.run(["sbatch", *options, str(LAUNCH / "slurm.sbatch"), *args, *train], cwd=ROOT,
                              env={**env, **extra}, capture_output=True, text=True, check=False)

    def submitted(*options: str, train: tuple[str, ...] = (), **extra: str) -> str:
        done = submit(*options, train=train, **extra)
        assert done.returncode == 0, done.stderr
        return done.stdout.split()[-1]

    def job(id_: str) -> dict:
        return json.loads((state / f"job_{id_}.json").read_text())

    def steps() -> int:
        return len(Run(out, None).metrics)

    def running_at(id_: str, restart: int, past: int) -> bool:
        """the job's batch script runs (its `restart`th run) and the run logged more than `past` steps"""
        j = job(id_)
        return j["pid"] is not None and len(j["runs"]) == restart and steps() > past + 2

    def latest() -> int:
        return int((out / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))

    def log(id_: str) -> str:
        return (tmp_path / f"slurm-{id_}.out").read_text()

    def said(id_: str) -> list[str]:
        return [line for line in log(id_).splitlines() if line.startswith("harness: ")]

    refused = submit("--gpus-per-node=8")  # a GPU request on a node without GPUs: Slurm's own refusal
    assert refused.returncode == 1 and "Invalid generic resource (gres) specification" in refused.stderr
    # a GPU count the script cannot read: one line naming both variables, exit 2 (`set -u` had ended the script on
    # the unset one, exit 1)
    unread = submitted(SLURM_GPUS_ON_NODE="a100:two")
    wait_for(lambda: len(job(unread)["runs"]) == 1)
    assert job(unread)["runs"][0]["code"] == 2 and said(unread) == [
        "harness: error: cannot read the job's GPUs per node from SLURM_GPUS_ON_NODE=a100:two SLURM_GPUS_PER_NODE=: "
        "set PROCS_PER_NODE"], log(unread)
    # GPUs asked for in all (--gpus) on 2 nodes: Slurm may give them 2 and 1, and the script sees its node's alone
    uneven = submitted(SLURM_GPUS="3", SLURM_GPUS_ON_NODE="2")
    wait_for(lambda: len(job(uneven)["runs"]) == 1)
    assert job(uneven)["runs"][0]["code"] == 2 and said(uneven) == [
        "harness: error: the job asked for its GPUs in all (--gpus: SLURM_GPUS=3), which Slurm may spread unevenly "
        "over its 2 nodes: ask for them with --gpus-per-node, or set PROCS_PER_NODE"], log(uneven)
    first = submitted()  # no GPUs asked for, no process count given: a CPU job, one process per node
    try:
        # 1. SIGUSR1 to the batch script (--signal=B:USR1@300): every node stops with a checkpoint, exits 75, and
        # the job is requeued; it runs again from that checkpoint
        wait_for(lambda: running_at(first, 0, 0))
        os.kill(job(first)["pid"], signal.SIGUSR1)
        wait_for(lambda: len(job(first)["runs"]) == 1)
        assert job(first)["runs"][0] == {"code": 75, "state": "REQUEUED"}, log(first)[-3000:]
        stopped = latest()
        assert said(first)[0].endswith(": 2 node(s) x 1 process(es) (a job without GPUs), rendezvous static at "
                                       f"127.0.0.1:{10000 + int(first) % 20000}"), said(first)
        # one line for every rank, from rank 0, whichever ranks the signal reached
        assert [line for line in said(first) if "every rank stops" in line] == [
            f"harness: SIGUSR1: every rank stops after step {stopped}; saving a checkpoint, then exiting (75)"]
        assert f"harness: stopped by SIGUSR1 after step {stopped} of {LONG}" in log(first)
        assert f"harness: requeueing job {first}" in log(first)
        # 2. scancel --batch --signal=TERM: the script passes it to the step's processes (not through srun, which
        # would kill the step): a checkpoint again, named for the SIGTERM it was, exit 75, not requeued
        wait_for(lambda: running_at(first, 1, stopped))
        subprocess.run(["scancel", "--batch", "--signal=TERM", first], env=env, check=True)
        wait_for(lambda: job(first)["pid"] is None and len(job(first)["runs"]) == 2)
        assert job(first)["runs"][1] == {"code": 75, "state": "FAILED"}, log(first)[-3000:]
        assert f"resumed from {out / 'checkpoints' / f'step_{stopped:08d}'}" in log(first)
        termed = latest()
        assert said(first)[-2:] == [
            (f"harness: stopped by SIGTERM after step {termed} of {LONG}; latest checkpoint: step_{termed:08d}; "
             f"continue with --resume auto"),
            (f"harness: job {first} stopped with a checkpoint, not requeued (sacct: FAILED, exit code 75): "
             f"resubmit to continue")], said(first)
        # 3. resubmitted with torchrun's dynamic rendezvous and wandb, then a plain scancel: SIGTERM to every
        # process (wandb's too), SIGKILL after KillWait; the ranks save first, the line says where
        second = submitted(train=("--set", 'logging.backend="wandb"'), RDZV="c10d", FAKE_SLURM_STAGGER_S="3")
        wait_for(lambda: running_at(second, 0, termed))
        subprocess.run(["scancel", second], env=env, check=True)
        wait_for(lambda: len(job(second)["runs"]) == 1)
        assert job(second)["runs"][0] == {"code": 75, "state": "CANCELLED"}, log(second)[-3000:]
        cancelled = latest()
        assert any(line.startswith(f"harness: job {second} cancelled (scancel, its time limit or a preemption): "
                                   f"SLURM sent SIGTERM to every process")
                   for line in said(second)), said(second)
        assert said(second)[-1] == (f"harness: stopped by SIGTERM after step {cancelled} of {LONG}; latest checkpoint: "
                                    f"step_{cancelled:08d}; continue with --resume auto"), said(second)
        # 4. resubmitted with a GPU per node (the fake node has them): one process per GPU, nothing set by hand;
        # made shorter (the lr is constant), it runs to its end; every srun gave each node's launcher the job's CPUs
        end = cancelled + 50
        third = submitted("--gpus-per-node=1", train=("--set", f"train.max_steps={end}"), FAKE_SLURM_GPUS="1")
        wait_for(lambda: len(job(third)["runs"]) == 1, seconds=300)
        assert job(third)["runs"][0] == {"code": 0, "state": "COMPLETED"}, log(third)[-3000:]
        assert ": 2 node(s) x 1 process(es) (one per GPU of the job)" in said(third)[0], said(third)
        sruns = [json.loads(x) for x in (state / "srun.log").read_text().splitlines()]
        assert len(sruns) == 4 and all("--cpus-per-task=32" in s for s in sruns), sruns
        assert "rendezvous c10d at 127.0.0.1:" in log(second)
        for id_ in (first, second, third):
            assert "Traceback" not in log(id_), log(id_)[-3000:]
    finally:  # nothing of a failed test's jobs left running
        for path in state.glob("job_*.json"):
            pid = json.loads(path.read_text())["pid"]
            if pid:
                kill_tree(pid, signal.SIGKILL)
    resumed = Run(out, None)
    assert [m["step"] for m in resumed.metrics] == list(range(1, end + 1))
    whole = harness(tmp_path / "whole", corpus, nproc=2, ds="zero2.json", sets=[*SETS, f"train.max_steps={end}"])
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


def test_a_rank_lost_while_the_job_stops_is_named_at_the_ranks_step_and_the_stop_is_said(tmp_path):
    """A plain scancel signals every process of a job: a helper's death can take a rank with it (wandb's, before its
    tracker was dropped instead). The peer's line gives the step the ranks were at, not the lost rank's heartbeat
    (written every 30 s: "last finished step 166" when the job was past 280), and the launcher's line says the job
    was stopping."""
    from harness.launcher.ending import ending
    from harness.run.heartbeat import DIR, diagnose

    dead = subprocess.Popen(["true"])
    dead.wait()
    beats = tmp_path / DIR
    beats.mkdir()
    for rank, pid, step, age in ((0, dead.pid, 166, 24), (1, os.getpid(), 284, 1)):
        (beats / f"rank_{rank:05d}.json").write_text(json.dumps(
            {"rank": rank, "host": socket.gethostname(), "pid": pid, "step": step, "time": time.time() - age}))
    error = str(diagnose(tmp_path, 2, 1, 1800.0, 30.0, lost=True, step=284))
    assert error.startswith(f"rank 1: a collective after step 284 lost its connection to another rank (a rank that "
                            f"died: killed, out of memory, or its node went down); gone: rank 0 (pid {dead.pid} on "
                            f"{socket.gethostname()}: its process is gone). Ending the job;"), error
    assert "166" not in error
    # the rank lost on another machine: this machine's ranks, seen running, are not suspected
    beat = json.loads((beats / "rank_00000.json").read_text())
    (beats / "rank_00000.json").write_text(json.dumps({**beat, "host": "node-002"}))
    (beats / "rank_00002.json").write_text(json.dumps(
        {"rank": 2, "host": socket.gethostname(), "pid": os.getppid(), "step": 284, "time": time.time()}))
    remote = str(diagnose(tmp_path, 3, 1, 1800.0, 30.0, lost=True, step=284))
    assert f"; suspects: rank 0 (pid {dead.pid} on node-002). Ending the job;" in remote, remote
    code, line, _ = ending(1, {"code": 4, "message": error}, "", tmp_path, tmp_path / "launch.log", signal.SIGTERM)
    assert code == 4 and line == (f"harness: error: {error} (the job was stopping: this launcher had passed SIGTERM "
                                  f"on to the ranks)"), line
    stopped = {"code": 75, "message": "stopped by SIGTERM after step 284 of 400"}
    assert ending(0, stopped, "", tmp_path, tmp_path / "launch.log", signal.SIGTERM)[:2] == (
        75, "harness: stopped by SIGTERM after step 284 of 400")
