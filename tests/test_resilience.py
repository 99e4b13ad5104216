"""Faults injected for real into 2-process CPU runs: signals to a rank and to `harness launch`, a second run into a
live run directory, a stopped (SIGSTOP) rank, resuming onto another size or ZeRO stage, and the exit codes
`harness launch` gives. Runs are long (3000 steps) and stopped by the fault, so "mid-run" needs no sleep in the
harness; an uninterrupted run stopped with --stop-at at the same step is the reference (and with its own checkpoint,
the first leg of the elastic test)."""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest

from conftest import ROOT, Run, _env, assert_losses_close, command, harness, rewind
from harness import console
from harness.launcher.supervise import _is_rank, descendants
from harness.run.preemption import EXIT_PREEMPTED

LONG = ["train.max_steps=3000", "train.global_batch_size=8"]  # 4 x 1 x 2 on two processes, 4 x 2 x 1 on one


def start(out, corpus, **kwargs) -> subprocess.Popen:
    """A long run to stop with a signal: every process cold, since the test finds and signals the ranks."""
    return subprocess.Popen(command(out, corpus, nproc=2, ds="zero2.json", sets=LONG, cold=True, **kwargs), cwd=ROOT,
                            env=_env(cold=True), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_mid_run(proc: subprocess.Popen, run: Run, sig: int, who: str, pid: int | None = None,
                   at: int | None = None) -> tuple[Run, float]:
    """Once the run has logged 3 steps (or step `at`), send `sig` to `who` (rank0, rank1, or top: the process
    started), or to `pid`; wait."""
    seen = len(run.metrics)
    deadline = time.time() + 120
    while len(run.metrics) < (at or seen + 3):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    ranks = [p for p in descendants(proc.pid) if _is_rank(p)]
    assert len(ranks) == 2, ranks
    sent = time.time()
    os.kill(pid or {"top": proc.pid, "rank0": ranks[0], "rank1": ranks[1]}[who], sig)
    out, err = proc.communicate(timeout=120)
    return Run(run.dir, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)), time.time() - sent


def latest(run: Run) -> int:
    return int((run.dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))


def test_signals_stop_every_rank_with_a_checkpoint_and_the_resumed_losses_are_the_uninterrupted_ones(tmp_path,
                                                                                                     corpus):
    out = tmp_path / "run"
    # 1. SIGTERM to one rank under `harness launch`: both stop after the same step, save it, exit 75. While it runs,
    # the run directory is its own: a second run into it is refused before launch, naming the holder.
    live = start(out, corpus, front=True)
    seen = time.time() + 120
    while not Run(out, None).metrics:
        assert live.poll() is None and time.time() < seen, live.communicate()
        time.sleep(0.05)
    holder = [p for p in descendants(live.pid) if _is_rank(p)][0]
    for args in (["--resume", "auto"], ["--overwrite"]):
        second = harness(out, corpus, sets=LONG, args=args, check=False)
        assert second.proc.returncode == 2, second.proc.stderr[-2000:]
        assert f"is in use by another run (pid {holder} on " in second.proc.stderr.splitlines()[-1]
    first, seconds = signal_mid_run(live, Run(out, None), signal.SIGTERM, "rank1")
    assert first.proc.returncode == EXIT_PREEMPTED, first.proc.stderr[-3000:]
    assert seconds < 30, seconds
    k1 = latest(first)
    assert f"stopped by SIGTERM after step {k1} of 3000" in first.proc.stderr
    assert "ChildFailedError" not in first.proc.stderr and "Traceback" not in first.proc.stderr
    assert [m["step"] for m in first.metrics] == list(range(1, k1 + 1))
    assert not (out / ".lock").exists()
    assert not (out / "checkpoints" / f"step_{k1:08d}" / "checksums.json").exists()  # no hashing in a grace period
    # 2. Ctrl-C (SIGINT) to `harness launch` reaches the ranks through it; `latest` gone before it: the newest
    # complete checkpoint resumed, said once (before, by the launch's check and again by each rank)
    (out / "checkpoints" / "latest").unlink()
    second, seconds = signal_mid_run(start(out, corpus, front=True, args=["--resume", "auto"]), first, signal.SIGINT,
                                     "top")
    assert second.proc.returncode == EXIT_PREEMPTED and seconds < 30, (seconds, second.proc.stderr[-3000:])
    assert second.proc.stdout.count("`latest` is missing; resuming from the newest complete checkpoint") == 1
    k2 = latest(second)
    assert k2 > k1 and f"stopped by SIGINT after step {k2}" in second.proc.stderr
    # 3. a lock left by a run that is gone (SIGKILLed: its pid no longer exists) is taken over with a note
    (out / ".lock").write_text(json.dumps({"host": socket.gethostname(), "pid": live.pid, "since": "earlier"}))
    end = k2 + 2  # where the signals land depends on the machine's speed: its own uninterrupted reference
    resumed = harness(out, corpus, nproc=2, ds="zero2.json", sets=LONG, front=True,
                      args=["--resume", "auto", "--stop-at", str(end)])
    assert f"taking over the lock of a run that is gone (pid {live.pid} on " in resumed.proc.stdout
    whole = harness(tmp_path / "whole", corpus, nproc=2, ds="zero2.json", sets=LONG, args=["--stop-at", str(end)])
    assert [m["step"] for m in resumed.metrics] == list(range(1, end + 1))
    assert_losses_close(resumed.losses, whole.losses, 1e-6)


SLOW_EVAL = ["--run", "examples/digits.toml", "--set", 'run.task="tests.slow_eval_task:SlowEvalDigits"']
EVAL_AT = ["task.test_samples=20000", "train.max_steps=20", "train.eval_every=10", "train.log_every=1",
           "train.micro_batch_size=16"]  # an evaluation of 625 micro-batches a rank


def test_a_signal_in_an_evaluation_cuts_it_short_on_every_rank_and_the_resumed_run_makes_it_first(tmp_path):
    """SIGTERM to one rank as the ranks evaluate step 10 (each micro-batch 10 ms: 6 s; without the cut the run stops
    some steps later): every rank stops it at the same micro-batch and saves step 10 owing it, exit 75. The run
    resumed makes it first (stopped there by --stop-at, it saves step 10 again, owing nothing: the next resume does
    not make it again); Ctrl-C in the final evaluation stops that one too, after the last checkpoint; resumed, the
    run makes it and exports. Losses and evaluations: an uninterrupted run's, each evaluation once."""
    out = tmp_path / "run"

    def start(*args: str) -> subprocess.Popen:
        cmd = command(out, tmp_path, nproc=2, ds="zero2.json", sets=EVAL_AT, front=True, args=[*SLOW_EVAL, *args])
        return subprocess.Popen(cmd, cwd=ROOT, env=_env({"SLOW_EVAL_S": "0.01"}, cold=True), stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True)

    def resumed(*args: str, env: dict | None = None) -> Run:
        return harness(out, tmp_path, nproc=2, ds="zero2.json", sets=EVAL_AT, env=env,
                       args=[*SLOW_EVAL, "--resume", "auto", *args])

    first, _ = signal_mid_run(start(), Run(out, None), signal.SIGTERM, "rank1", at=10)
    assert first.proc.returncode == EXIT_PREEMPTED, first.proc.stderr[-3000:]
    assert ("harness: SIGTERM: every rank stops after step 10 (in its evaluation); saving a checkpoint, then exiting "
            "(75)") in first.proc.stderr
    assert first.proc.stderr.strip().splitlines()[-1] == (
        "harness: stopped by SIGTERM after step 10 of 20, its evaluation left to the resumed run, which makes it "
        "first; latest checkpoint: step_00000010; continue with --resume auto")
    assert not (out / "eval.jsonl").exists() and latest(first) == 10
    # (its evaluation slow, and stderr taken for a terminal's: one that takes seconds draws a bar of its own)
    owed = resumed("--stop-at", "10", env={"SLOW_EVAL_S": "0.01", console.STDERR_TTY_ENV: "1"})
    assert "eval step 10: " in owed.proc.stderr and "stopped at step 10 of 20 (--stop-at)" in owed.proc.stdout
    assert re.search(r"evaluating: +\d+%\|", owed.proc.stderr), owed.proc.stderr[-3000:]  # (lines go where it goes)
    second, _ = signal_mid_run(start("--resume", "auto"), owed, signal.SIGINT, "top", at=20)
    assert second.proc.returncode == EXIT_PREEMPTED, second.proc.stderr[-3000:]
    assert second.proc.stderr.strip().splitlines()[-1] == (
        "harness: stopped by SIGINT after step 20 of 20, in the final evaluation (a resumed run makes it, then "
        "exports); latest checkpoint: step_00000020; continue with --resume auto")
    assert "eval step 10: " not in second.proc.stdout and [e["step"] for e in second.evals] == [10]
    assert not (out / "model.safetensors").exists()
    done = resumed()
    whole = harness(tmp_path / "whole", tmp_path, nproc=2, ds="zero2.json", sets=EVAL_AT, args=SLOW_EVAL)
    assert [e["step"] for e in done.evals] == [e["step"] for e in whole.evals] == [10, 20]
    for ours, theirs in zip(done.evals, whole.evals):
        assert ours == pytest.approx(theirs, rel=1e-6), (ours, theirs)
    assert_losses_close(done.losses, whole.losses, 1e-6)
    assert (out / "model.safetensors").exists()


def test_a_signal_that_reaches_the_loop_at_a_step_that_evaluates_leaves_the_evaluation_to_the_resumed_run(tmp_path):
    """SIGTERM (the task sends it to its own process in step 1's forward) reaches the loop with step 2, which
    evaluates: the run stops without evaluating and the checkpoint owes it. SIGTERM in an evaluation at a step
    without a record of its own (train.log_every = 3) writes the step's record before the run stops."""
    out, sets = tmp_path / "run", ["task.test_samples=500", "train.max_steps=4", "train.eval_every=2"]
    stopped = harness(out, tmp_path, sets=sets, args=SLOW_EVAL, env={"SIGNAL_AT_STEP": "1"}, check=False)
    assert stopped.proc.returncode == EXIT_PREEMPTED, stopped.proc.stderr[-3000:]
    assert stopped.proc.stderr.strip().splitlines()[-1] == (
        "harness: stopped by SIGTERM after step 2 of 4, its evaluation left to the resumed run, which makes it first; "
        "latest checkpoint: step_00000002; continue with --resume auto")
    # the resumed run makes it, then dies before its next checkpoint (removed here): the run resumed again makes it
    # again, recorded once
    harness(out, tmp_path, sets=sets, args=[*SLOW_EVAL, "--resume", "auto", "--stop-at", "3"])
    shutil.rmtree(out / "checkpoints" / "step_00000003")
    (out / "checkpoints" / "latest").write_text("step_00000002\n")
    done = harness(out, tmp_path, sets=sets, args=[*SLOW_EVAL, "--resume", "auto"])
    assert [e["step"] for e in done.evals] == [2, 4] and "eval step 2: " in done.proc.stdout
    cut = harness(tmp_path / "cut", tmp_path, sets=[*sets, "train.log_every=3"], args=SLOW_EVAL,
                  env={"SIGNAL_IN_EVAL": "1"}, check=False)
    assert cut.proc.returncode == EXIT_PREEMPTED and "after step 2 of 4, its evaluation left" in cut.proc.stderr
    assert [m["step"] for m in cut.metrics] == [2], cut.metrics


def test_a_signal_in_a_tasks_own_evaluation_cuts_it_where_the_task_asks_and_the_resumed_run_makes_it(tmp_path):
    """SIGTERM (the task sends it to its own process) in the 2nd micro-batch of the task's own evaluation (of 16, for
    train.select_best's metric): the run stops after 2, owing it; resumed, it makes it: the uninterrupted run's."""
    sets = ["task.test_samples=500", "train.max_steps=4", "train.eval_every=2", 'train.select_best="mae"']
    own = ["--run", "examples/digits.toml", "--set", 'run.task="tests.slow_eval_task:SlowOwnEvalDigits"']
    out, log = tmp_path / "run", tmp_path / "scored.log"
    stopped = harness(out, tmp_path, sets=sets, args=own, env={"SIGNAL_IN_OWN_EVAL": "2", "OWN_EVAL_LOG": str(log)},
                      check=False)
    assert stopped.proc.returncode == EXIT_PREEMPTED, stopped.proc.stderr[-3000:]
    assert stopped.proc.stderr.strip().splitlines()[-1] == (
        "harness: stopped by SIGTERM after step 2 of 4, its evaluation left to the resumed run, which makes it first; "
        "latest checkpoint: step_00000002; continue with --resume auto")
    assert log.read_text().split() == ["0", "1"]  # of 16
    done = harness(out, tmp_path, sets=sets, args=[*own, "--resume", "auto"])
    whole = harness(tmp_path / "whole", tmp_path, sets=sets, args=own)
    assert [e["step"] for e in done.evals] == [e["step"] for e in whole.evals] == [2, 4]
    for ours, theirs in zip(done.evals, whole.evals):
        assert ours == pytest.approx(theirs, rel=1e-6), (ours, theirs)


def catches(pid: int, sig: int) -> bool:
    """Whether process `pid` has a handler for `sig` (Linux /proc: SigCgt)."""
    try:
        caught = [line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("SigCgt:")]
    except OSError:
        return False
    return bool(caught) and bool(int(caught[0].split()[1], 16) >> (sig - 1) & 1)


def test_a_schedulers_signal_while_the_ranks_start_stops_the_job_with_exit_75_not_a_crash(tmp_path, corpus):
    """SIGTERM to `harness launch` while its ranks import torch: they had no handler yet, died by the signal, and the
    job read as a crash (exit 4; SIGUSR1: 1) that slurm.sbatch does not requeue."""
    live = start(tmp_path / "run", corpus, front=True)
    deadline, seen = time.time() + 120, {}
    while True:  # both ranks take it (a harness rank does from its first line), or 2 s into their imports of torch
        for p in [p for p in descendants(live.pid) if _is_rank(p) and p not in seen][:2 - len(seen)]:  # (not the
            # ranks' data workers, listed after them)
            seen.setdefault(p, time.time())
        if len(seen) == 2 and all(catches(p, signal.SIGTERM) or time.time() - t > 2 for p, t in seen.items()):
            break
        assert live.poll() is None and time.time() < deadline, live.communicate()
        time.sleep(0.01)
    live.send_signal(signal.SIGTERM)
    out, err = live.communicate(timeout=120)
    assert live.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "stopped by SIGTERM while the run was starting, before its first step: nothing was saved" in \
        err.strip().splitlines()[-1], err[-3000:]
    assert "Traceback" not in err and not Run(tmp_path / "run", None).metrics
    assert not any(Path(f"/proc/{p}").exists() for p in seen)


def test_harness_launch_exits_2_before_any_rank_starts_and_3_when_updates_keep_being_skipped(tmp_path, corpus):
    started = time.time()
    bad = harness(tmp_path / "bad", corpus, nproc=2, front=True, sets=["optimizer.lr=-1"], check=False)
    assert bad.proc.returncode == 2, bad.proc.stderr
    assert bad.proc.stderr.strip().splitlines()[-1] == "harness: error: optimizer.lr = -1.0 (command line) must be >= 0"
    assert "accelerate launch" not in bad.proc.stdout and not (tmp_path / "bad").exists()
    assert time.time() - started < 30
    # Ctrl-C while it checks (a plug-in task's check that takes its time): one line, exit 130, nothing started
    slow = subprocess.Popen(command(tmp_path / "slow", corpus, nproc=2, front=True, args=SLOW_EVAL), cwd=ROOT,
                            env=_env({"SLOW_CHECK_S": "120"}), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    for line in slow.stderr:
        if line.startswith("checking slowly"):
            break
    slow.send_signal(signal.SIGINT)
    _, err = slow.communicate(timeout=60)
    assert slow.returncode == 130 and err.strip().splitlines() == ["harness: interrupted"], err[-3000:]
    assert not (tmp_path / "slow").exists()
    # started without the front end, the ranks check the disk before they build a model of 1.6e12 parameters
    disk = harness(tmp_path / "disk", corpus, nproc=2, sets=["model.d_model=262144"], check=False)
    assert disk.proc.returncode != 0, disk.proc.stderr[-2000:]
    lines = [x for x in disk.proc.stderr.splitlines() if x.startswith("harness: error: run.output_dir")]
    assert lines and "GiB free on its file system; this run needs about" in lines[0], disk.proc.stderr[-2000:]
    nan = harness(tmp_path / "nan", corpus, nproc=2, front=True, ds="zero2.json", check=False,
                  sets=["train.max_steps=40", "optimizer.lr=1e6", "train.grad_clip=0.0", "schedule.warmup_steps=1000",
                        "schedule.kind=\"constant\"", "train.max_nonfinite_steps=2"])
    # fp32 ZeRO-2: DeepSpeed finds the gradient non-finite and skips the update; the loss itself stays finite
    assert nan.proc.returncode == 3, nan.proc.stderr[-3000:]
    assert "non-finite for 2 consecutive steps" in nan.proc.stderr and "ChildFailedError" not in nan.proc.stderr
    assert "gradient not finite, update skipped" in nan.proc.stdout and "fp16 overflow" not in nan.proc.stdout
    skipped = [m["skipped_steps"] for m in nan.metrics]
    assert skipped[-2:] == [1, 2] and all(math.isfinite(m["loss"]) for m in nan.metrics), nan.metrics
    assert not (nan.dir / "model.safetensors").exists()


def one_error(run: Run) -> str:
    """The job's one line: no traceback, no torchrun report, a single `harness: error:` line, the last one."""
    err = run.proc.stderr
    assert "Traceback" not in err and "ChildFailedError" not in err and "FAILED" not in err, err[-3000:]
    lines = [x for x in err.splitlines() if x.startswith("harness: error:")]
    assert len(lines) == 1 and err.strip().splitlines()[-1] == lines[0], err[-3000:]
    return lines[0]


def test_a_stopped_killed_or_agent_stopped_rank_ends_the_job_in_one_line_and_the_checkpoint_resumes(tmp_path,
                                                                                                   corpus):
    """SIGSTOP, then SIGKILL to a rank, SIGTERM to torchrun, SIGKILL to `harness launch`: each leg resumes the last."""
    out = tmp_path / "run"
    sets = [*LONG, "train.collective_timeout_s=8.0", "train.save_every=2"]

    def leg(*args: str, shutdown_s: int = 3) -> subprocess.Popen:
        """torchrun waits `shutdown_s` for the ranks it stops: short where one is stopped or gone, long enough to
        save where it passes a signal on; every process cold, since the test finds and signals the ranks"""
        return subprocess.Popen(command(out, corpus, nproc=2, ds="zero2.json", front=True, sets=sets, args=args),
                                cwd=ROOT, env=_env({"TORCH_ELASTIC_SHUTDOWN_TIMEOUT": str(shutdown_s)}, cold=True),
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    # 1. a stopped rank (SIGSTOP): the others' collective times out, the job ends naming it
    run, seconds = signal_mid_run(leg(), Run(out, None), signal.SIGSTOP, "rank1")
    assert run.proc.returncode == 4, run.proc.stderr[-3000:]
    assert seconds < 8 + 3 + 20, seconds  # the timeout, torchrun's shutdown, a start-up's worth of slack
    line = one_error(run)
    assert line.startswith("harness: error: rank 0: a collective got no answer within train.collective_timeout_s "
                           "= 8 s; stopped answering: rank 1 (pid "), line
    assert re.search(r": had finished step \d+ when last heard of, \d+ s ago\)", line), line  # (it may lag)
    assert line.endswith(f"latest checkpoint: step_{latest(run):08d}; continue with --resume auto"), line
    # 2. a rank killed with SIGKILL (the out-of-memory killer): torchrun's root cause, in one line
    run, _ = signal_mid_run(leg("--resume", "auto"), run, signal.SIGKILL, "rank1")
    assert run.proc.returncode == 4, run.proc.stderr[-3000:]
    line = one_error(run)
    assert " was killed by SIGKILL after step " in line and line.startswith("harness: error: rank 1 (pid "), line
    assert f"latest checkpoint: step_{latest(run):08d}; continue with --resume auto; every rank's stderr: " \
        f"{out / 'launch.log'}" in line, line
    assert "ChildFailedError" in (out / "launch.log").read_text()  # torchrun's report, kept
    # 3. SIGTERM to torchrun (the elastic agent) itself: it passes it on, the ranks save and say so in one line
    agent = leg("--resume", "auto", shutdown_s=60)
    while [p for p in descendants(agent.pid) if _is_rank(p)] == []:
        time.sleep(0.05)
    torchrun = next(p for p in descendants(agent.pid) if b"accelerate.commands.launch" in
                    (Path(f"/proc/{p}/cmdline").read_bytes()))
    run, _ = signal_mid_run(agent, run, signal.SIGTERM, "rank1", pid=torchrun)
    assert run.proc.returncode == EXIT_PREEMPTED, run.proc.stderr[-3000:]
    assert "Traceback" not in run.proc.stderr and "SignalException" not in run.proc.stderr
    assert run.proc.stderr.strip().splitlines()[-1].startswith(f"harness: stopped by SIGTERM after step {latest(run)}")
    # 4. `harness launch` itself killed (SIGKILL): torchrun gets SIGTERM (its parent-death signal) and the ranks,
    # writing to a file and not a pipe to the dead launcher, stop with a checkpoint
    before, killed = latest(run), leg("--resume", "auto", shutdown_s=60)
    wait = time.time() + 120
    while len(Run(out, None).metrics) < before + 3:
        assert killed.poll() is None and time.time() < wait, killed.communicate()
        time.sleep(0.05)
    ranks = [p for p in descendants(killed.pid) if _is_rank(p)]
    killed.kill()
    killed.communicate()
    sent = time.time()
    while any(Path(f"/proc/{p}").exists() for p in ranks):  # unwatched, they would train on for minutes
        assert time.time() < sent + 30, ranks
        time.sleep(0.1)
    assert latest(run) > before and Run(out, None).metrics[-1]["step"] == latest(run)  # stopped at its checkpoint
    # the last checkpoint loads and the run goes on
    end = latest(run) + 2
    resumed = harness(out, corpus, nproc=2, ds="zero2.json", sets=sets, args=["--resume", "auto", "--stop-at",
                                                                              str(end)])
    assert [m["step"] for m in resumed.metrics] == list(range(1, end + 1))


def test_resume_onto_another_size_stage_or_offload_continues_with_the_uninterrupted_losses(tmp_path, corpus):
    # the global batch stays 8, so the data order is the same; the first leg is the reference's own checkpoint
    whole = harness(tmp_path / "whole", corpus, nproc=2, ds="zero2.json",
                    sets=[*LONG, "train.save_every=3", "train.keep_checkpoints=5"], args=["--stop-at", "12"])
    out = rewind(whole.dir, tmp_path / "run", 3)
    sets = [*LONG, "train.keep_checkpoints=1"]

    def leg(nproc: int, ds: str, stop: int, *extra: str) -> Run:
        run = harness(out, corpus, nproc=nproc, ds=ds, sets=[*sets, *extra], args=["--resume", "auto", "--stop-at",
                                                                                  str(stop)])
        assert [m["step"] for m in run.metrics] == list(range(1, stop + 1))
        assert_losses_close(run.losses, {k: v for k, v in whole.losses.items() if k <= stop}, 1e-5)
        return run

    # each leg is converted once to DeepSpeed's universal checkpoint and loaded into the new partitioning
    one = leg(2, "zero2_offload.json", 5)  # the optimizer offloaded alone (DeepSpeed's CPU Adam read AdamW's state)
    assert "converting step_00000003 to DeepSpeed's universal checkpoint" in one.proc.stdout
    assert not (out / "checkpoints" / "step_00000003.universal").exists()  # rotated out with its checkpoint
    assert "converting step_00000005" in leg(1, "zero1.json", 7).proc.stdout  # 2 -> 1, ZeRO-2 offload -> ZeRO-1
    leg(4, "zero3.json", 9, "train.micro_batch_size=2")  # 1 -> 4 (2 x 4 x 1), ZeRO-1 -> ZeRO-3
    leg(1, "zero1.json", 12)  # 4 -> 1, ZeRO-3 -> ZeRO-1
    # another run's checkpoint is converted in this run's directory, not in the other's (which may be read-only)
    theirs = sorted(p.name for p in (whole.dir / "checkpoints").iterdir())
    fork = harness(tmp_path / "fork", corpus, ds="zero1.json", sets=sets,
                   args=["--resume", str(whole.dir / "checkpoints" / "step_00000009"), "--stop-at", "10"])
    assert "converting step_00000009" in fork.proc.stdout
    assert_losses_close(fork.losses, {10: whole.losses[10]}, 1e-5)
    assert sorted(p.name for p in (whole.dir / "checkpoints").iterdir()) == theirs
    assert not list((tmp_path / "fork" / "checkpoints").glob("*universal*"))  # read, then removed
    # ZeRO-0 resumes on any data-parallel size as it is: every rank holds the whole optimizer
    zero = tmp_path / "zero0"
    harness(zero, corpus, nproc=2, ds="zero0.json", sets=sets, args=["--stop-at", "3"])
    resumed = harness(zero, corpus, ds="zero0.json", sets=sets, args=["--resume", "auto", "--stop-at", "8"])
    assert_losses_close(resumed.losses, {k: v for k, v in whole.losses.items() if k <= 8}, 1e-5)
    # a change it cannot make is refused before launch, naming both layouts
    refused = harness(zero, corpus, ds="zero2.json", sets=sets, args=["--resume", "auto"], check=False)
    assert refused.proc.returncode == 2
    line = refused.proc.stderr.strip().splitlines()[-1]
    assert "was saved as data 1 x tensor 1 x pipeline 1, ZeRO-0" in line, line
    assert "this run is data 1 x tensor 1 x pipeline 1, ZeRO-2" in line, line
    assert line.endswith("Resume it as it was saved: 1 process with a DeepSpeed file of zero_optimization.stage 0; "
                         "or start a new run on this layout from its exported weights (a run exports as it "
                         "finishes): model.init_from = its run directory, with another run.output_dir"), line
    # rank 1's optimizer file cut short: found by its checksum before anything is read, on 2 processes (each checks
    # its share of the files: the same line on both) and on 1 (before the conversion); saved before checksums were
    # recorded, rank 1's line (before, rank 0 lost it in a collective and its exit 4 "--resume auto" won), and on 1
    # process no half conversion left behind
    cut = rewind(whole.dir, tmp_path / "cut", 9)
    rank1 = cut / "checkpoints" / "step_00000009" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    rank1.write_bytes(rank1.read_bytes()[:len(rank1.read_bytes()) // 2])
    for nproc, said in ((2, f"is damaged: {rank1.name} is "), (1, f"is damaged: {rank1.name} is "),
                        (2, "step_00000009 cannot be read on rank"), (1, "step_00000009 cannot be read on rank")):
        if "cannot be read" in said:
            (rank1.parent / "checksums.json").unlink(missing_ok=True)
        refused = harness(cut, corpus, nproc=nproc, front=True, ds="zero2.json", sets=sets, args=["--resume", "auto"],
                          check=False)
        line = refused.proc.stderr.strip().splitlines()[-1]
        assert refused.proc.returncode == 2 and said in line, refused.proc.stderr
        assert line.endswith(f"continue from it with --resume {cut / 'checkpoints' / 'step_00000006'}"), line
    assert sorted(p.name for p in (cut / "checkpoints").glob("step_*")) == [f"step_0000000{i}" for i in (3, 6, 9)]


def test_the_loop_reads_each_span_of_steps_from_the_next_spans_collective_and_counts_none_past_giving_up():
    """`step.Ledger`, the loop's account of its steps, on made-up steps in a world of one: the loop's collective
    comes once a span of steps (`step.Span`), with the work of each of its steps, and carries the figures of the
    steps run since the last one (`carry`), read when the span's first step is added; `settle` reads them at once.
    A span is as long as a second of the slowest rank's steps. A stop signal is known from the span it was sent
    in; giving up on non-finite losses counts no step after."""
    import torch

    from harness.run.step import MAX_SPAN, Ledger, StepResult, span_length

    logged, written = [], []
    work = [10.0, 1e12, 9, 10, 7]  # items, FLOPs, real and padded positions, the batches' data hash

    def made_up(books: Ledger, step: int, loss: float, span: int = 0, signal: int = 0, step_s: float = 0.0,
                skipped: bool = False, scale: float | None = None) -> StepResult:
        """What `train_step` returns (with the rows of its span's collective where a span of `span` steps starts:
        a signal, the seconds per step, each step's work, what it carried) and its figures."""
        head = torch.tensor([float(signal), step_s, *work * span], dtype=torch.float64)
        rows = torch.cat([head, books.carry()]).reshape(1, -1)
        mine = torch.tensor([1, 100 * step, 1, 0.5, 10 * loss], dtype=torch.float64)  # loss sum over 10 items
        return StepResult((lambda: rows) if span else None, mine, skipped=skipped, skipped_steps=int(step >= 3),
                          loss_scale=scale)

    def ledger(log_every: int, stop: int, max_nonfinite: int = 2) -> Ledger:
        logged.clear(), written.clear()
        progress = type("Bar", (), {"write": lambda self, s: written.append(s), "set_postfix": lambda *a, **k: None})
        world = type("World", (), {"replicas": 1, "loss_replicas": 1, "device": torch.device("cpu"), "is_main": True})
        return Ledger(type("Tracker", (), {"log": lambda self, r: logged.append(r)})(), progress(),
                      type("Train", (), {"log_every": log_every, "max_nonfinite_steps": max_nonfinite}), stop,
                      epoch_at=lambda step: step / 4, flops=type("Flops", (), {"method": "analytic"}), fixed={},
                      items="tokens", min_loss_scale=1.0, world=world)

    assert [span_length(s) for s in (0.0, 2.0, 0.3, 0.001)] == [1, 1, 3, MAX_SPAN]
    # spans of 1, 3 and 3 steps; a record every 3 steps and at the last (7): each over its window of steps, each
    # step read once, when the span after its own starts
    books = ledger(log_every=3, stop=7)
    assert books.span == 1 and not books.carry().numel()  # nothing to carry into the first span
    last_read = {1: None, 2: 1, 3: 1, 4: 1, 5: 4, 6: 4, 7: 4}
    for step in range(1, 8):
        span = {1: 1, 2: 3, 5: 3}.get(step, 0)
        books.add(step, made_up(books, step, 1.0 / step, span, step_s=0.3 if step == 2 else 0.0,
                                skipped=step == 3), lr=1e-3, samples_seen=8 * step)
        assert books.step == last_read[step], step
        carried = books.carry().reshape(-1, 5)[:, 1].tolist()  # the peak memory (100 x step) of each step not read
        assert carried == [100.0 * s for s in range((last_read[step] or 0) + 1, step + 1)], step
        assert books.span == (3 if step in (2, 3, 4) else 1)  # step 2's span said 0.3 s a step; 5's, not known
    books.settle()  # the last span's: read at once
    assert books.step == 7 and not books.pending and not books.carry().numel()
    assert [r["step"] for r in logged] == [3, 6, 7] and [r["loss"] for r in logged] == [1 / 3, 1 / 6, 1 / 7]
    assert [r["peak_mem_bytes"] for r in logged] == [300, 600, 700] and logged[-1]["epoch"] == 7 / 4
    for r in logged:  # 10 items and 1e12 FLOPs a step, whatever the window's length
        assert math.isclose(r["tokens_per_s"] * r["step_s"], 10) and math.isclose(r["tflops"] * r["step_s"], 1)
        assert math.isclose(r["padding"], 0.1) and r["grad_norm"] == 0.5 and r["skipped_steps"] == 1
        assert r["flops_method"] == "analytic"
    assert written == ["step 3: gradient not finite, update skipped (1 so far)"]

    # spans of one: a non-finite loss at steps 2 and 5, an update skipped for a non-finite gradient at 6: the second
    # bad step in a row gives up on reading step 6; step 7, run meanwhile, is read but neither counted nor logged
    books = ledger(log_every=1, stop=100)
    for step, loss in zip(range(1, 8), [1.0, math.nan, 1.0, 1.0, math.inf, 1.0, 1.0]):
        books.add(step, made_up(books, step, loss, span=1, skipped=step == 6), lr=1e-3, samples_seen=8 * step)
        if books.give_up:
            break
    assert step == 7 and books.step == 6 and books.nonfinite == 2
    books.settle(last=True)
    assert not books.pending and [r["step"] for r in logged] == list(range(1, 7))
    # what the loop asks at the last step: a skipped update with a finite loss left the weights as they were; a
    # non-finite loss says they were damaged before (a checkpoint's bytes), however its update went; but not fp16's
    # overflow while its loss scale can still fall (scale 1024 here, above the minimum 1: skipping is how it scales)
    books, suspect = ledger(log_every=1, stop=100, max_nonfinite=5), []
    for step, (loss, skipped, scale) in enumerate([(1.0, False, None), (1.0, True, None), (math.nan, True, None),
                                                    (1.0, False, None), (math.inf, True, 1024.0)], 1):
        books.add(step, made_up(books, step, loss, span=1, skipped=skipped, scale=scale), lr=1e-3,
                  samples_seen=8 * step)
        books.settle()
        suspect.append(books.bad_weights)
    assert suspect == [False, False, True, False, False] and books.nonfinite == 1
    # one span of 4 read at once: non-finite at 2 and 3 gives up at 3; step 4, read with them, is not counted
    books = ledger(log_every=1, stop=100)
    for step, loss in zip(range(1, 5), [1.0, math.nan, math.nan, 1.0]):
        books.add(step, made_up(books, step, loss, span=4 if step == 1 else 0), lr=1e-3, samples_seen=8 * step)
    books.settle()
    assert books.give_up and books.step == 3 and books.nonfinite == 2 and [r["step"] for r in logged] == [1, 2, 3]

    # a signal sent with the span starting at step 3 is known once step 3 has run, before its figures are read;
    # read at once, it is logged (the loop then saves and stops)
    books = ledger(log_every=10, stop=100)
    for step in range(1, 4):
        books.add(step, made_up(books, step, 1.0, span=1 if step < 3 else 5, signal=15 if step == 3 else 0),
                  lr=1e-3, samples_seen=8 * step)
        assert books.signal == (15 if step == 3 else 0) and books.step == (step - 1 or None)
    books.settle(last=True)
    assert [r["step"] for r in logged] == [3] and books.step == 3 and books.result.signal == 15


def test_a_span_fetches_what_the_ledger_asks_but_never_past_the_last_step_a_profiled_one_or_the_workers_ready():
    """`step.Steps` at a span's first step, in a world of one: it fetches and counts the batches of `Ledger.span`
    steps, no more than the loader's workers hold ready (PREFETCH micro-batches each, over the accumulation), none
    past the last step, and ends the span before a profiled step, which is a span of its own."""
    from types import SimpleNamespace as NS

    import torch

    from harness.run import profiling
    from harness.data.batches import PREFETCH
    from harness.run.step import MAX_SPAN, Steps

    def spans(workers: int, accum: int, last: int, starts=(), span: int = MAX_SPAN) -> list[int]:
        fetched = []
        task = NS(count=lambda b: 10, inputs=lambda b: (b,))
        plan = NS(task=task, ds=NS(grad_accum_steps=accum), run=NS(cfg=NS(data=NS(num_workers=workers))))
        ledger = NS(span=span, carry=lambda: torch.zeros(0, dtype=torch.float64))
        world = NS(device=torch.device("cpu"), world_size=1)
        loader = iter(lambda: fetched.append(1) or {"x": torch.zeros(1)}, None)
        steps = Steps(None, plan, world, loader, lambda inputs, n: 1.0, ledger, None, last=last, starts=starts)
        lengths, step = [], 1
        while step <= last:
            steps._start_span(step, 0, profiling.unmarked)
            lengths.append(len(steps.ahead))
            step += len(steps.ahead)
            steps.ahead.clear()
        assert len(fetched) == last * accum  # every step's micro-batches, once
        return lengths

    assert spans(workers=0, accum=1, last=40) == [16, 16, 8]  # the ledger's 16; the last step ends the third
    assert spans(workers=2, accum=1, last=20) == [2 * PREFETCH] * 2 + [4]  # 8 ready with 2 workers
    assert spans(workers=1, accum=2, last=5) == [2, 2, 1]  # 4 micro-batches ready: 2 steps of 2
    assert spans(workers=1, accum=8, last=3) == [1, 1, 1]  # fewer ready than a step: a step at a time
    assert spans(workers=0, accum=1, last=30, starts=(10,), span=6) == [6, 3, 1, 6, 6, 6, 2]  # 10 alone


def test_the_launcher_shows_progress_as_it_comes_holds_back_a_failing_jobs_tracebacks_and_reads_torchruns_cause(
        tmp_path):
    """`launcher.relay.Relay` on a made-up stream, fed whole and a byte at a time, and `launcher.ending.ending` on
    what it held: the real streams are the fault tests' above."""
    import io

    from harness.launcher.ending import ending
    from harness.launcher.relay import Relay

    bar = b"\rtrain:   1%|  | 1/100\rtrain:   2%|  | 2/100"
    failing = (b"\rW1127 02:42:23.955000 20312 site-packages/torch/distributed/elastic/multiprocessing/api.py:1028]"
               b" Sending process 20315 closing signal SIGTERM\n"
               b"harness: rank 0 got SIGTERM: finishing this step\n"
               b"Traceback (most recent call last):\n  File \"harness/run/loop.py\", line 1, in train\n"
               b"ValueError: a rank's own error\n"
               b"Traceback (most recent call last):\n"
               b"  File \"/x/torch/distributed/launcher/api.py\", line 383, in launch_agent\n"
               b"torch.distributed.elastic.multiprocessing.errors.ChildFailedError: \n"
               b"Root Cause (first observed failure):\n[0]:\n  time      : 2026-11-27_02:41:44\n"
               b"  host      : node7\n  rank      : 3 (local_rank: 1)\n  exitcode  : CODE (pid: 20176)  (SIG)\n")
    stream = b"harness: task lm\n" + bar + failing

    def relay(chunks: list[bytes], release_s: float = 30.0, pause_s: float = 0.0) -> tuple[bytes, Relay]:
        written = tmp_path / f"stderr_{len(chunks)}"
        sink = io.BytesIO()
        with written.open("wb", buffering=0) as job:
            r = Relay(written, sink, release_s=release_s, every_s=0.001)
            for c in chunks:
                job.write(c)
                time.sleep(pause_s)
        r.finish()
        return sink.getvalue(), r

    whole, r = relay([stream])
    assert relay([stream[i:i + 1] for i in range(len(stream))], pause_s=0.0005)[0] == whole  # however reads cut it
    assert whole == b"harness: task lm\n" + bar + b"\rharness: rank 0 got SIGTERM: finishing this step\n", whole
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert r.save(run_dir, 0) == r.path  # not a run directory yet (no config.toml): the file it was written to
    (run_dir / "config.toml").write_text("")
    log = r.save(run_dir, 1)
    # kept with each bar's last frame before it was written over, one a line (a terminal's bar: 1 frame a second)
    assert log == run_dir / "launch_node1.log" and not r.path.exists()
    assert log.read_bytes().endswith(b"harness: task lm\ntrain:   2%|  | 2/100\n" + failing[1:]), log.read_bytes()
    (run_dir / "metrics.jsonl").write_text('{"step": 7}\n{"step": 8}\n')
    held = r.held_text()
    code, line, shown = ending(1, {}, held.replace("CODE", "-9"), run_dir, run_dir / "launch.log")
    assert code == 4 and shown == "", (code, shown)
    assert line.startswith("harness: error: rank 3 (pid 20176 on node7) was killed by SIGKILL after step 8 (kill "
                           "-9, or the kernel's out-of-memory killer"), line
    assert "; no checkpoint was saved; --resume auto starts from step 0" in line, line
    code, line, shown = ending(1, {}, held.replace("CODE", "1"), run_dir, run_dir / "launch.log")
    assert code == 1 and "rank 3 (pid 20176 on node7) failed with exit code 1 after step 8: its error is above" in line
    assert "ValueError: a rank's own error" in shown and "ChildFailedError" not in shown and "W1127" not in shown
    # the ranks' own report wins, but not the peers' "lost a rank" over the rank that failed on its own or was killed
    told = {"code": 4, "message": "rank 0: a collective lost its connection to another rank"}
    assert ending(1, told, held.replace("CODE", "4"), run_dir, run_dir / "x")[:2] == (4, f"harness: error: "
                                                                                          f"{told['message']}")
    assert ending(1, {**told, "code": 3}, held.replace("CODE", "1"), run_dir, run_dir / "x")[0] == 3
    code, line, shown = ending(1, told, held.replace("CODE", "1"), run_dir, run_dir / "x")
    assert code == 1 and "failed with exit code 1" in line and "ValueError: a rank's own error" in shown
    assert "was killed by SIGKILL" in ending(1, told, held.replace("CODE", "-9"), run_dir, run_dir / "x")[1]
    # a crash is not a kill from outside: exit 1, its output shown; a real-time signal has no name
    code, line, _ = ending(1, {}, held.replace("CODE", "-6"), run_dir, run_dir / "x")
    assert code == 1 and "crashed with SIGABRT after step 8 (its collective library aborts" in line, line
    line = ending(1, {}, held.replace("CODE", "-35"), run_dir, run_dir / "x")[1]
    assert "crashed with signal 35 after step 8" in line
    # metrics.jsonl lags by up to train.log_every steps: a rank's heartbeat, written as it stopped, is further on
    (run_dir / ".ranks").mkdir()
    (run_dir / ".ranks" / "rank_00001.json").write_text('{"rank": 1, "step": 11}')
    (run_dir / ".ranks" / "rank_00000.json").write_text('{"rank": 0, "step": 1')  # cut short: not read
    line = ending(1, {}, held.replace("CODE", "1"), run_dir, run_dir / "x")[1]
    assert "failed with exit code 1 after step 11:" in line, line
    # a traceback straight after a progress bar (tqdm never ends its line) is held too, the bar's line ended
    shown, r = relay([bar, b"Traceback (most recent call last):\n", b"  File \"x.py\"\nKeyError: 1\n"], pause_s=0.05)
    assert shown == bar + b"\n" and r.held_text().startswith("Traceback"), shown
    # once torchrun reports a failure, nothing held is let go, however long the job takes to end
    shown, _ = relay([failing, b"later\n"], release_s=0.0, pause_s=0.2)
    assert b"Traceback" not in shown and b"W1127" not in shown, shown
    # a job that goes on past a traceback some library printed shows it after `release_s`
    shown, _ = relay([b"Traceback (most recent call last):\nKeyError: 1\n", b"later\n"], release_s=0.0, pause_s=0.2)
    assert shown == b"Traceback (most recent call last):\nKeyError: 1\nlater\n", shown
