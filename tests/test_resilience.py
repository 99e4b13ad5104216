"""Faults injected for real into 2-process CPU runs: signals to a rank, to the launcher and to `harness launch`; the
exit codes `harness launch` gives. Runs are long (3000 steps) and stopped by the signal, so "mid-run" needs no
sleep in the harness; an uninterrupted run stopped with --stop-at at the same step is the reference."""
from __future__ import annotations

import math
import os
import signal
import subprocess
import time

from conftest import ROOT, Run, _env, assert_losses_close, command, harness
from harness.launcher import _is_rank, descendants
from harness.preemption import EXIT_PREEMPTED

LONG = ["train.max_steps=3000"]


def start(out, corpus, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(command(out, corpus, nproc=2, ds="zero2.json", sets=LONG, **kwargs), cwd=ROOT,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def signal_mid_run(proc: subprocess.Popen, run: Run, sig: int, who: str) -> tuple[Run, float]:
    """Once the run has logged 3 steps, send `sig` to `who` (rank0, rank1, or top: the process started); wait."""
    seen = len(run.metrics)
    deadline = time.time() + 120
    while len(run.metrics) < seen + 3:
        assert proc.poll() is None and time.time() < deadline, proc.communicate()
        time.sleep(0.05)
    ranks = [p for p in descendants(proc.pid) if _is_rank(p)]
    assert len(ranks) == 2, ranks
    sent = time.time()
    os.kill({"top": proc.pid, "rank0": ranks[0], "rank1": ranks[1]}[who], sig)
    out, err = proc.communicate(timeout=120)
    return Run(run.dir, subprocess.CompletedProcess(proc.args, proc.returncode, out, err)), time.time() - sent


def latest(run: Run) -> int:
    return int((run.dir / "checkpoints" / "latest").read_text().strip().removeprefix("step_"))


def test_signals_stop_every_rank_with_a_checkpoint_and_the_resumed_losses_are_the_uninterrupted_ones(tmp_path,
                                                                                                     corpus):
    out = tmp_path / "run"
    # 1. SIGTERM to one rank under `harness launch`: both stop after the same step, save it, exit 75
    first, seconds = signal_mid_run(start(out, corpus, front=True), Run(out, None), signal.SIGTERM, "rank1")
    assert first.proc.returncode == EXIT_PREEMPTED, first.proc.stderr[-3000:]
    assert seconds < 30, seconds
    k1 = latest(first)
    assert f"stopped by SIGTERM after step {k1} of 3000" in first.proc.stderr
    assert "ChildFailedError" not in first.proc.stderr and "Traceback" not in first.proc.stderr
    assert [m["step"] for m in first.metrics] == list(range(1, k1 + 1))
    # 2. SIGTERM to a bare accelerate launch: torchrun passes it on; the ranks save before its 30 s are up (it then
    # exits 1 with its own report: why the README says harness launch)
    second, seconds = signal_mid_run(start(out, corpus, args=["--resume", "auto"]), first, signal.SIGTERM, "top")
    assert second.proc.returncode != 0 and seconds < 30, (seconds, second.proc.stderr[-3000:])
    k2 = latest(second)
    assert k2 > k1 and f"stopped by SIGTERM after step {k2}" in second.proc.stderr
    # 3. Ctrl-C (SIGINT) to `harness launch` reaches the ranks through it
    third, _ = signal_mid_run(start(out, corpus, front=True, args=["--resume", "auto"]), second, signal.SIGINT, "top")
    assert third.proc.returncode == EXIT_PREEMPTED, third.proc.stderr[-3000:]
    k3 = latest(third)
    assert k3 > k2 and f"stopped by SIGINT after step {k3}" in third.proc.stderr
    end = k3 + 2
    resumed = harness(out, corpus, nproc=2, ds="zero2.json", sets=LONG, front=True,
                      args=["--resume", "auto", "--stop-at", str(end)])
    whole = harness(tmp_path / "whole", corpus, nproc=2, ds="zero2.json", sets=LONG, args=["--stop-at", str(end)])
    assert [m["step"] for m in resumed.metrics] == list(range(1, end + 1))
    assert_losses_close(resumed.losses, whole.losses, 1e-6)


def test_harness_launch_exits_2_before_any_rank_starts_and_3_when_updates_keep_being_skipped(tmp_path, corpus):
    started = time.time()
    bad = harness(tmp_path / "bad", corpus, nproc=2, front=True, sets=["optimizer.lr=-1"], check=False)
    assert bad.proc.returncode == 2, bad.proc.stderr
    assert bad.proc.stderr.strip().splitlines()[-1] == "harness: error: optimizer.lr = -1.0 (command line) must be >= 0"
    assert "accelerate launch" not in bad.proc.stdout and not (tmp_path / "bad").exists()
    assert time.time() - started < 30
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


def test_a_live_run_directory_is_refused_naming_its_holder_and_a_dead_ones_lock_taken_over(tmp_path, corpus):
    out = tmp_path / "run"
    live = subprocess.Popen(command(out, corpus, sets=LONG), cwd=ROOT, env=_env(), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not Run(out, None).metrics:
            assert live.poll() is None and time.time() < deadline, live.communicate()
            time.sleep(0.05)
        for args in (["--resume", "auto"], ["--overwrite"], []):
            second = harness(out, corpus, sets=LONG, args=args, check=False)
            assert second.proc.returncode == 2, second.proc.stderr[-2000:]
            assert f"is in use by another run (pid {live.pid} on " in second.proc.stderr.splitlines()[-1]
        assert live.poll() is None  # untouched
    finally:
        live.kill()  # SIGKILL: no chance to remove its lock
        live.wait()
    assert (out / ".lock").exists()
    taken = harness(out, corpus, sets=LONG, args=["--resume", "auto", "--stop-at", "2"])
    assert f"taking over the lock of a run that is gone (pid {live.pid} on " in taken.proc.stdout
    assert not (out / ".lock").exists()
