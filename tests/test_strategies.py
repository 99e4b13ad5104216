"""Every ZeRO stage, offload and precision: 2 processes under `accelerate launch` give the per-step losses of
1 process over the same global batches. The 2-process runs use micro batch 2 (x 2 ranks = 4), the 1-process
references micro batch 4, so each step sees the same 4 samples."""
from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import ROOT, _env, assert_losses_close, ds_variant

FP32_TOL = 1e-5   # reductions in a different order: rounding only
BF16_TOL = 2e-2   # bf16 keeps 8 bits of mantissa; different reduction order changes the rounding
FP16_TOL = 5e-3
TWO = ["train.micro_batch_size=2"]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_zero_stage_matches_single_process(stage, cached_run, tmp_path):
    ref = cached_run("ref-fp32", ds="zero0.json")
    # stage3_param_persistence_threshold=0: shard every parameter of the tiny model, as a large one would be
    ds = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0) if stage == 3 else f"zero{stage}.json"
    two = cached_run(f"zero{stage}-2p", nproc=2, ds=ds, sets=TWO)
    assert "world 2 (data parallel 2)" in two.proc.stdout
    assert len(two.losses) == 6
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    assert two.losses[6] < two.losses[1], "the loss should fall over 6 steps"
    assert all(m["samples_seen"] == 4 * m["step"] for m in two.metrics)  # global count, not per rank


@pytest.mark.parametrize("config", ["zero2_offload.json", "zero3_offload.json"])
def test_cpu_offload_matches_single_process(config, cached_run, tmp_path):
    ref = cached_run("ref-offload", ds="zero2_offload.json")  # the same CPU Adam kernel, one process
    ds = ds_variant(tmp_path, config, stage3_param_persistence_threshold=0) if "zero3" in config else config
    two = cached_run(f"{config}-2p", nproc=2, ds=ds, sets=TWO)
    assert "optimizer-offload" in two.proc.stdout
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    fp32 = cached_run("ref-fp32", ds="zero0.json")
    assert_losses_close(two.losses, fp32.losses, 1e-3)  # DeepSpeed's CPU Adam vs torch AdamW


def test_bf16_matches_single_process(cached_run):
    ref = cached_run("ref-bf16", ds="bf16.json")
    two = cached_run("bf16-2p", nproc=2, ds="bf16.json", sets=TWO)
    assert "ZeRO-2 bf16" in two.proc.stdout
    assert_losses_close(two.losses, ref.losses, BF16_TOL)


def test_fp16_dynamic_loss_scaling_matches_single_process(cached_run):
    # This CPU has no native fp16 (DeepSpeed refuses it); the opt-in runs the same fp16 math slowly.
    env = {"HARNESS_CPU_FP16": "1"}
    ref = cached_run("ref-fp16", ds="fp16.json", env=env)
    two = cached_run("fp16-2p", nproc=2, ds="fp16.json", sets=TWO, env=env)
    assert_losses_close(two.losses, ref.losses, FP16_TOL)
    scales = [m["loss_scale"] for m in two.metrics]
    # dynamic scaling starts at 2**16 and halves on each overflow-skipped step; both are logged
    assert scales[0] <= 2.0**16 and all(s > 0 for s in scales)
    skipped = [m["skipped_steps"] for m in two.metrics]
    assert skipped == sorted(skipped)
    halvings = sum(1 for a, b in zip([2.0**16] + scales, scales) if b < a)
    assert halvings <= skipped[-1]  # with hysteresis a scale drop needs at least one skipped step


# evaluations of one global batch (4 samples) at steps 3 and 6: the same samples on any layout of that batch
CAPPED_EVAL = ["train.eval_every=3", "train.eval_batches=1"]


def test_gradient_accumulation_equals_one_big_batch(cached_run):
    ref = cached_run("ref-fp32", ds="zero0.json")
    accum = cached_run("accum", ds="zero0.json", sets=["train.micro_batch_size=1", "train.grad_accum_steps=4",
                                                       *CAPPED_EVAL])
    assert "global batch 4 = 1 x 4 x 1" in accum.proc.stdout
    assert_losses_close(accum.losses, ref.losses, FP32_TOL)
    from safetensors.torch import load_file

    a, b = load_file(str(accum.dir / "model.safetensors")), load_file(str(ref.dir / "model.safetensors"))
    assert a.keys() == b.keys()
    for k in a:
        assert (a[k] - b[k]).abs().max() <= 1e-5, k


def test_accumulation_across_ranks(cached_run):
    """2 ranks x micro 1 x accumulation 2 = the same 4 samples per step."""
    ref = cached_run("ref-fp32", ds="zero0.json")
    two = cached_run("accum-2p", nproc=2, ds="zero2.json",
                     sets=["train.micro_batch_size=1", "train.global_batch_size=4", *CAPPED_EVAL])
    assert "global batch 4 = 1 x 2 x 2" in two.proc.stdout
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    # train.eval_batches = 1: one global batch's samples, the same on 2 ranks x 2 as on 1 rank x 4 micro-batches
    one = cached_run("accum", ds="zero0.json", sets=["train.micro_batch_size=1", "train.grad_accum_steps=4",
                                                     *CAPPED_EVAL])
    assert [e["step"] for e in two.evals] == [e["step"] for e in one.evals] == [3, 6]
    for theirs, ours in zip(one.evals, two.evals):
        assert ours["loss"] == pytest.approx(theirs["loss"], rel=FP32_TOL), (ours, theirs)


@pytest.mark.parametrize("option", ["train.activation_checkpointing=true", "train.compile=true"])
def test_recomputation_and_compilation_keep_the_losses(option, cached_run):
    """Activations recomputed in backward, or the model compiled: the same arithmetic, the same losses."""
    ref = cached_run("ref-fp32", ds="zero0.json")
    run = cached_run(option, ds="zero2.json", sets=[option])
    assert_losses_close(run.losses, ref.losses, FP32_TOL)


def test_sgd_with_momentum_matches_single_process(cached_run):
    sgd = ["optimizer.name=\"sgd\"", "optimizer.lr=0.5", "optimizer.momentum=0.9", "optimizer.weight_decay=0.0"]
    ref = cached_run("ref-sgd", ds="zero0.json", sets=sgd)
    two = cached_run("sgd-zero1-2p", nproc=2, ds="zero1.json", sets=[*sgd, *TWO])  # momentum buffers sharded
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    assert ref.losses[6] < ref.losses[1]
    adamw = cached_run("ref-fp32", ds="zero0.json")
    assert ref.losses[1] == adamw.losses[1] and ref.losses[3] != adamw.losses[3]  # same start, another optimizer


def test_deepspeeds_muon_module_is_imported_with_its_compilation_deferred():
    """DeepSpeed's ZeRO code imports its Muon optimizer module on every run, and that module compiles three functions
    at import (torch._inductor: ~2 s a rank). `import_muon_lazily` defers each compilation to its first call."""
    script = ("import sys; from harness.distributed.world import quiet_deepspeed; quiet_deepspeed(); import deepspeed; "
              "from harness.distributed.ds_patches import import_muon_lazily; import_muon_lazily(); "
              "from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam; "
              "from deepspeed.runtime.zero.muon import original_muon as m; "
              "print('torch._inductor' in sys.modules, m.zeropower_via_newtonschulz5.__wrapped__.__name__)")
    out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.split() == ["False", "zeropower_via_newtonschulz5"], out.stderr[-2000:]
