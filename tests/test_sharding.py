"""Data sharding across data-parallel ranks, including the CPU trap where accelerate miscounts processes."""
from __future__ import annotations

import json
import math
import subprocess

import pytest
import torch

from conftest import DS, ROOT, TINY, _env, python
from harness.config.run import ConfigError
from harness.data.batches import StepSampler, eval_batches


def probe(*args: str) -> list[dict]:
    cmd = [python(), "-m", "accelerate.commands.launch", "--num_processes", "2", "--num_machines", "1",
           "--use_deepspeed", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
           str(ROOT / "tests" / "shard_probe.py"), *args]
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_ranks_disjoint_and_complete_under_accelerate_deepspeed_on_cpu():
    lines = probe()
    out = next(x for x in lines if "indices" in x)
    assert out["world_size"] == 2 and out["accelerate_num_processes"] == 2
    rank0, rank1 = (set(x) for x in out["indices"])
    assert len(out["indices"][0]) == len(out["indices"][1]) == 4 * 3 * 2  # steps x accum x micro
    assert not rank0 & rank1
    assert rank0 | rank1 == {i for step in out["global"] for i in step}
    closed = {x["rank"]: x for x in lines if "left_after_close" in x}
    assert sorted(closed) == [0, 1] and all("pt_gloo_runloop" in x["gloo_threads"] for x in closed.values())
    assert all(x["left_after_close"] == [] for x in closed.values()), closed


def test_a_finished_run_leaves_no_process_group_behind(corpus, tmp_path):
    """A group that outlives close_world (DeepSpeed's default arguments, its engine's hook cycles) keeps its gloo
    threads to the interpreter's end, where one aborted a finished run under load (world.py): none are left."""
    lines = probe(str(ROOT / "configs" / "runs" / "lm_demo.toml"), str(DS / "zero2.json"), *TINY,
                  "train.max_steps=2", f"data.path={json.dumps(str(corpus))}",
                  f"run.output_dir={json.dumps(str(tmp_path / 'run'))}")
    left = {x["rank"]: x["left_after_close"] for x in lines}
    assert left == {0: [], 1: []}


def test_sampler_covers_each_epoch_once_and_resumes_mid_run():
    kw = dict(n=50, micro=2, accum=2, dp_size=3, seed=1)
    full = {r: list(StepSampler(**kw, dp_rank=r, start_step=0, max_steps=8)) for r in range(3)}
    epoch0 = [i for r in range(3) for b in full[r][:4 * 2] for i in b]  # 4 steps per epoch (50 // 12)
    assert sorted(epoch0) == sorted(set(epoch0)) and len(epoch0) == 48
    resumed = list(StepSampler(**kw, dp_rank=1, start_step=5, max_steps=8))
    assert resumed == full[1][5 * 2:]
    other_seed = list(StepSampler(**{**kw, "seed": 2}, dp_rank=1, start_step=0, max_steps=1))
    assert other_seed != full[1][:2]


@pytest.mark.parametrize("order", ["held", "lazy", "given"])
def test_a_resume_with_another_global_batch_goes_on_from_the_samples_read(order):
    """16 ranks' global batch of 16 for 4 steps, then 8 ranks' 8 (a requeue onto fewer nodes): the resumed steps read
    the rest of the epoch once, then the next epoch (it placed step s at s x 8: the samples of steps 2-3 again). The
    position a checkpoint keeps gives the uninterrupted steps where the batch stays."""
    n, seed = 100, 4
    first = StepSampler(n, 1, 1, 0, 16, seed, 0, 4, order=order)
    read = torch.cat([first.step_indices(s).flatten() for s in range(4)])
    position = first.place(4)
    assert position == (0, 64)
    after = StepSampler(n, 1, 1, 0, 8, seed, 4, 20, order=order, position=position)
    # the epoch logged goes on from what was read: 72 of the 96 an epoch reads (it said 5 / 12 steps, backwards)
    assert first.epoch_at(4) == 4 / 6 and after.epoch_at(5) == 72 / 96
    rest = torch.cat([after.step_indices(s).flatten() for s in range(4, 8)])  # 96 - 64 samples: 4 steps of 8
    if order == "given":
        assert torch.equal(torch.cat([read, rest]), torch.arange(96))
    else:
        assert len(set(torch.cat([read, rest]).tolist())) == 96  # epoch 0 (96 of 100 at either batch) read once
        assert after.place(8) == (1, 0) and torch.equal(after.step_indices(8).flatten(),
                                                        StepSampler(n, 1, 1, 0, 8, seed, 0, 20, order=order)
                                                        .step_indices(12).flatten())  # epoch 1's first step
    if order != "given":  # 8 -> 16 at 56 of 203: 9 more steps fit (to 200), where 16's own epoch holds 192
        small = StepSampler(203, 8, 1, 0, 1, seed, 0, 7, order=order)
        big = StepSampler(203, 8, 1, 0, 2, seed, 7, 40, order=order, position=small.place(7))
        epoch = torch.cat([small.step_indices(s).flatten() for s in range(7)] +
                          [big.step_indices(s).flatten() for s in range(7, 16)])
        assert len(set(epoch.tolist())) == 200 and big.place(16) == (1, 0)
    same = StepSampler(n, 2, 2, 1, 3, seed, 5, 30, order=order, position=StepSampler(n, 2, 2, 1, 3, seed, 0, 5,
                                                                                       order=order).place(5))
    plain = StepSampler(n, 2, 2, 1, 3, seed, 5, 30, order=order)
    assert all(torch.equal(same.step_indices(s), plain.step_indices(s)) for s in range(5, 30))
    assert all(same.epoch_at(s) == pytest.approx(s / plain.steps_per_epoch) for s in range(5, 30))


@pytest.mark.parametrize("order", ["held", "lazy", "given"])
def test_train_epochs_resumed_at_another_batch_end_when_the_epochs_are_read(order):
    """train.epochs = 1 over 656 samples, 10 steps at a batch of 16, then resumed at 32 or at 8: the run ends once
    one epoch is read (25 or 72 steps in all), where it had counted every step at the new batch (20 steps: 3/4 of
    the epoch; 82: past it). Where the batch stays, the steps are ceil(epochs x steps per epoch), resumed or not."""
    first = StepSampler(656, 16, 1, 0, 1, 0, 0, 10, order=order)
    assert first.steps_to(1.0) == 41 and first.steps_to(0.5) == 21
    for micro, steps in ((32, 25), (8, 72)):
        resumed = StepSampler(656, micro, 1, 0, 1, 0, 10, 0, order=order, position=first.place(10))
        assert resumed.steps_to(1.0) == steps
        assert resumed.epoch_at(steps - 1) < 1.0 <= resumed.epoch_at(steps)
    same = StepSampler(656, 16, 1, 0, 1, 0, 10, 0, order=order, position=first.place(10))
    assert [same.steps_to(e) for e in (0.5, 1.0, 2.5)] == [math.ceil(e * 41) for e in (0.5, 1.0, 2.5)]


def test_sampler_rejects_data_smaller_than_a_global_batch():
    with pytest.raises(ConfigError, match="fewer than one global batch"):
        StepSampler(n=7, micro=2, accum=2, dp_rank=0, dp_size=2, seed=0, start_step=0, max_steps=1)


@pytest.mark.parametrize("n,micro,dp", [(10, 3, 2), (7, 2, 3), (1, 4, 2), (12, 2, 2)])
def test_eval_shards_cover_every_sample_once_in_lockstep(n, micro, dp):
    shards = [eval_batches(n, micro, r, dp) for r in range(dp)]
    seen = [i for batches, _ in shards for b in batches for i in b]
    assert sorted(seen) == list(range(n))
    steps = {s for _, s in shards}
    assert len(steps) == 1  # every rank runs the same number of forward passes (ZeRO-3 gathers in them)
    assert max(len(b) for b, _ in shards) == steps.pop()


def test_a_capped_evaluation_reads_samples_spread_over_the_whole_split():
    """train.eval_batches: that many global batches of samples, spread evenly over the split (a corpus's validation
    windows lie in file order, a mixture's source by source: the first ones had been one file's or one source's),
    the same ones on every layout."""
    shards = [eval_batches(1000, 4, r, 2, samples=40) for r in range(2)]
    seen = sorted(i for batches, _ in shards for b in batches for i in b)
    assert len(seen) == len(set(seen)) == 40 and {s for _, s in shards} == {5}
    assert seen[0] == 0 and seen[-1] == 975 and max(b - a for a, b in zip(seen, seen[1:])) == 25
    for micro, dp in ((8, 1), (2, 4), (3, 3)):  # another micro-batch or data-parallel size: the same samples
        shards = [eval_batches(1000, micro, r, dp, samples=40) for r in range(dp)]
        assert sorted(i for batches, _ in shards for b in batches for i in b) == seen
        assert len({s for _, s in shards}) == 1
    assert eval_batches(30, 4, 0, 2, samples=40) == eval_batches(30, 4, 0, 2)  # a cap above the split: all of it


def test_length_buckets_keep_the_epoch_a_permutation_and_batch_similar_lengths():
    lengths = [(i * 37) % 101 + 1 for i in range(960)]
    kw = dict(n=960, micro=4, accum=2, dp_size=2, seed=3, start_step=0, max_steps=60)
    plain = StepSampler(**kw, dp_rank=0)
    bucketed = [StepSampler(**kw, dp_rank=r, lengths=lengths, bucket=10) for r in range(2)]
    assert sorted(bucketed[0].epoch_order(0).tolist()) == sorted(plain.epoch_order(0).tolist())  # same samples
    assert not torch.equal(bucketed[0].epoch_order(0), plain.epoch_order(0))
    assert torch.equal(bucketed[0].epoch_order(1), StepSampler(**kw, dp_rank=0, lengths=lengths, bucket=10)
                       .epoch_order(1))  # a pure function of (seed, epoch): resume and ranks agree

    def spread(sampler):  # mean (longest - shortest) within a micro-batch: what padding costs
        batches = list(sampler)
        return sum(max(lengths[i] for i in b) - min(lengths[i] for i in b) for b in batches) / len(batches)

    assert spread(bucketed[0]) < 0.2 * spread(plain)
    mine = [set(i for b in StepSampler(**kw, dp_rank=r, lengths=lengths, bucket=10) for i in b) for r in range(2)]
    assert not mine[0] & mine[1]  # ranks stay disjoint
    steps = [bucketed[0].step_indices(s)[0, 0].tolist() for s in range(0, 120, 24)]  # epochs 0-1, varied steps
    assert len({lengths[b[0]] for b in steps}) > 1  # the batches' order is shuffled, not long-to-short
