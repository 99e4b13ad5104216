"""Tensor and pipeline parallelism, named by a DeepSpeed config: 2 (and 4) processes give the per-step losses of
1 process over the same global batches; resume and the consolidated export work in each; layouts DeepSpeed does
not support are refused by `harness plan` before launch."""
from __future__ import annotations

import gzip
import json
import shutil
import subprocess

import pytest
import torch

from conftest import DS, ROOT, TINY, _env, assert_losses_close, harness, python, rewind, val_loss_of_export
from harness.plan.render import bubble_fraction
from test_plan import plan, write

FP32_TOL = 1e-5
PIPE = ["train.micro_batch_size=2", "train.grad_accum_steps=2"]  # 2 micro-batches of 2 flow through the stages


def ds_file(tmp_path, base: str, **sections) -> str:
    """A shipped DeepSpeed config with some top-level sections changed."""
    cfg = json.loads((DS / base).read_text())
    cfg.update(sections)
    path = tmp_path / f"{base.removesuffix('.json')}-variant.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("config,sets,layout", [("tp2_zero1.json", [], "tensor parallel 2"),
                                                ("pp2_zero1.json", PIPE, "pipeline 2 stages")])
def test_model_parallel_matches_single_process_and_exports_the_whole_model(config, sets, layout, cached_run):
    ref = cached_run("ref-fp32", ds="zero0.json")
    two = cached_run(config, nproc=2, ds=config, sets=sets)
    assert f"(data parallel 1, {layout})" in two.proc.stdout
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    # the consolidated export: whole tensors under the plain model's names, giving the engine's final loss
    from safetensors.torch import load_file

    exported, plain = load_file(str(two.dir / "model.safetensors")), load_file(str(ref.dir / "model.safetensors"))
    assert {k: v.shape for k, v in exported.items()} == {k: v.shape for k, v in plain.items()}
    assert abs(val_loss_of_export(two.dir) - two.evals[-1]["loss"]) < 1e-5
    assert abs(two.evals[-1]["loss"] - ref.evals[-1]["loss"]) < 1e-5


@pytest.mark.parametrize("config,sets,layout", [
    ("tp2_zero2.json", ["train.micro_batch_size=2"], "tensor parallel 2"),
    ("pp2_zero1.json", ["train.micro_batch_size=1", "train.grad_accum_steps=2"], "pipeline 2 stages")])
def test_model_parallel_times_data_parallel_on_four_processes(config, sets, layout, cached_run):
    """x DP2: the two replicas read different halves of each global batch (else the losses would differ), and
    the validation loss counts every sample once."""
    ref = cached_run("ref-fp32", ds="zero0.json")
    four = cached_run(f"{config}-dp2", nproc=4, ds=config, sets=sets)
    assert f"world 4 (data parallel 2, {layout})" in four.proc.stdout
    assert_losses_close(four.losses, ref.losses, FP32_TOL)
    assert abs(four.evals[-1]["loss"] - ref.evals[-1]["loss"]) < 1e-5


@pytest.mark.parametrize("config,sets", [("tp2_zero1.json", []), ("pp2_zero1.json", PIPE)])
def test_resume_continues_with_the_uninterrupted_losses(config, sets, tmp_path, corpus):
    # dropout on: every rank's RNG (each stage's, each tensor-parallel peer's) must come back too. The resume point
    # is the uninterrupted run's own checkpoint at step 4 (test_checkpoint.py stops runs with --stop-at)
    sets = sets + ["train.max_steps=8", "train.save_every=2", "train.keep_checkpoints=4", "model.dropout=0.1"]
    full = harness(tmp_path / "full", corpus, nproc=2, ds=config, sets=sets)
    part = rewind(full.dir, tmp_path / "part", 4)
    resumed = harness(part, corpus, nproc=2, ds=config, sets=sets, args=["--resume", "auto"])
    assert "resumed from" in resumed.proc.stdout and "step_00000004" in resumed.proc.stdout
    assert_losses_close(resumed.losses, full.losses, 1e-6)
    assert resumed.evals[-1]["loss"] == pytest.approx(full.evals[-1]["loss"], rel=1e-6)


def test_a_run_starts_from_the_weights_a_run_of_another_layout_exported(tmp_path, corpus, cached_run):
    """model.init_from: the tensor-parallel run's export starts a 1-process ZeRO-0 run and a 2-stage pipeline (a
    resume across those layouts is refused) with its weights: at lr 1e-9 their validation loss is the source's own,
    and their first losses agree. A resume of such a run reads its checkpoint, not the source, which may be gone."""
    tp = cached_run("tp2_zero1.json", nproc=2, ds="tp2_zero1.json", sets=[])
    src = tmp_path / "src"
    shutil.copytree(tp.dir, src, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    start = [f"model.init_from={json.dumps(str(src))}", "optimizer.lr=1e-9", "schedule.warmup_steps=0"]
    one = harness(tmp_path / "one", corpus, ds="zero0.json", sets=[*start, "train.max_steps=2", "train.save_every=1"])
    pipe = harness(tmp_path / "pipe", corpus, nproc=2, ds="pp2_zero1.json", sets=[*start, *PIPE, "train.max_steps=1"])
    for run in (one, pipe):
        assert (f"model.init_from: the weights of {src} (its step {tp.metrics[-1]['step']}) start this run; its "
                f"optimizer state, lr schedule and place in the data start anew") in run.proc.stdout
        assert run.evals[-1]["loss"] == pytest.approx(tp.evals[-1]["loss"], abs=1e-5)
    assert_losses_close(pipe.losses, {1: one.losses[1]}, FP32_TOL)
    assert f"checkpoint {one.dir / 'checkpoints' / 'step_00000002'} saved in " in one.proc.stdout  # each save said
    shutil.rmtree(src)
    resumed = harness(one.dir, corpus, ds="zero0.json", sets=[*start, "train.max_steps=3"], args=["--resume", "auto"])
    assert "resumed from" in resumed.proc.stdout and "model.init_from" not in resumed.proc.stdout
    assert [m["step"] for m in resumed.metrics] == [1, 2, 3]


def test_weights_that_do_not_fit_are_refused_before_launch(tmp_path, corpus, cached_run, capsys):
    from harness.cli import main

    tp = cached_run("tp2_zero1.json", nproc=2, ds="tp2_zero1.json", sets=[])
    unfinished, other_task = tmp_path / "unfinished", tmp_path / "prices"
    for folder in (unfinished, other_task):
        folder.mkdir()
        shutil.copy(tp.dir / "config.toml", folder)
    shutil.copy(tp.dir / "model.safetensors", other_task)
    toml = (other_task / "config.toml").read_text()
    (other_task / "config.toml").write_text(toml.replace('task = "lm"', 'task = "prices"', 1))
    cases = [(tp.dir, ["model.d_model=64"], "its weights do not fit this run's model (model.d_model 32 there, 64 "
                                            "here; blocks.0.attn.k_proj.bias [32] there, [64] here; "),
             (tp.dir, ["data.seq_len=64"], "(data.seq_len 32 there, 64 here; pos_emb.weight [32, 32] there, [64, 32] "
                                           "here): start from a run of the same model settings"),
             (unfinished, [], "that run has not exported its weights (no model.safetensors"),
             (other_task, [], "a run of task 'prices', but run.task = 'lm' (default)"),
             (tmp_path, [], "not a run directory (it holds no config.toml)"),
             (tmp_path / "nowhere", [], "no such run directory"),
             (tp.dir, ["model.n_heads=4"], "its weights would be read as other heads (model.n_heads 2 there, 4 here)"),
             (tmp_path / "run", [], "is this run's own directory, whose files a new run replaces"),
             (tp.dir, ['model.hf="gpt2"'], "with model.hf = 'gpt2' (command line): start a Hugging Face model from a "
                                           "run's weights with model.hf = that run's hf/ directory")]
    for source, sets, said in cases:
        args = ["train", "--set", f"data.path={json.dumps(str(corpus))}", "--set",
                f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", "--set",
                f"model.init_from={json.dumps(str(source))}"]
        for item in [*TINY, *sets] if not sets or "hf" not in sets[0] else sets:
            args += ["--set", item]
        assert main(args) == 2, said
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith(f"harness: error: model.init_from = {str(source)!r} (command line)") and said in line, \
            line
    assert not (tmp_path / "run").exists()
    # nodes compare the export by its content, not its path (a copy staged on each node's disk is the same)
    from harness.run.nodes import _meaning

    copy = tmp_path / "copy"
    shutil.copytree(tp.dir, copy, ignore=shutil.ignore_patterns("checkpoints", "wandb"))
    other = cached_run("ref-fp32", ds="zero0.json").dir
    assert _meaning("model.init_from", str(copy)) == _meaning("model.init_from", str(tp.dir)) != \
        _meaning("model.init_from", str(other))
    (copy / "model.safetensors").write_bytes(b"\xff" * 64)  # not a safetensors file: said, not a MemoryError
    assert _meaning("model.init_from", str(copy)) == "no safetensors file (64 bytes)"
    assert _meaning("model.init_from", str(tmp_path / "gone")) == "no readable export"  # (a resume reads none)


def test_pipeline_passes_the_translation_model_s_tuples_and_ties_its_embedding(tmp_path, monkeypatch, capsys):
    """Encoder-decoder stages pass (memory, source mask, token ids, ...) along, the one embedding matrix is used on
    both stages, and activations are recomputed in backward: the losses and the BLEU are those of 1 process. The
    pipeline's export (its tied embedding saved once) starts a 1-process run at its own loss (model.init_from); on
    text whose SentencePiece vocabulary is another, it is refused before launch."""
    from test_translation import write_toy_dir

    toy = write_toy_dir(tmp_path / "toy")
    env = {"HARNESS_CACHE": str(tmp_path / "cache")}
    sets = ['run.task="translation"', 'translation.target_lang="fr"', "model.vocab_size=64", "model.n_heads=4",
            "train.max_steps=6", "translation.eval_max_sentences=8", "translation.beam_size=2"]
    ref = harness(tmp_path / "ref", str(toy), env=env, sets=sets)
    ds = ds_file(tmp_path, "pp2_zero1.json", pipeline={"stages": 2, "activation_checkpoint_interval": 1})
    pp = harness(tmp_path / "pp", str(toy), nproc=2, ds=ds, env=env, sets=sets + PIPE)
    assert_losses_close(pp.losses, ref.losses, FP32_TOL)
    for key in ("loss", "nll", "bleu", "chrf"):
        assert pp.evals[-1][key] == pytest.approx(ref.evals[-1][key], rel=1e-5, abs=1e-6), key
    start = ["train.max_steps=1", "optimizer.lr=1e-9", "schedule.warmup_steps=0",
             f"model.init_from={json.dumps(str(pp.dir))}"]
    again = harness(tmp_path / "again", str(toy), env=env, sets=sets + start)
    assert again.evals[-1]["loss"] == pytest.approx(pp.evals[-1]["loss"], abs=1e-5)
    from harness.cli import main

    shouted = tmp_path / "shouted"  # the same pairs in capitals: another vocabulary
    shutil.copytree(toy, shouted)
    for f in shouted.glob("*.gz"):
        f.write_bytes(gzip.compress(gzip.decompress(f.read_bytes()).upper()))
    monkeypatch.setenv("HARNESS_CACHE", env["HARNESS_CACHE"])
    args = ["train", "--set", f"data.path={json.dumps(str(shouted))}", "--set",
            f"run.output_dir={json.dumps(str(tmp_path / 'other'))}"]
    for item in [*TINY, *sets, *start]:
        args += ["--set", item]
    assert main(args) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line == (f"harness: error: model.init_from = {str(pp.dir)!r} (command line): its tokenizer (spm.model in "
                    f"{pp.dir / 'data'}) is not the one this run's data is prepared with: the ids its model learned "
                    f"would mean other pieces"), line


@pytest.mark.parametrize("center", ["mean", "last"])
def test_pipeline_forecaster_passes_window_statistics_between_stages(center, tmp_path, cached_run):
    """The price forecaster's first stage sends its per-window centre and scale to the last (float tensors that
    need no gradient, which a pipeline must still carry through backward; the last value's is a slice of the window,
    copied to be sent)."""
    from test_prices import write_series

    series = write_series(tmp_path / "series.csv", n=600)
    env = {"HARNESS_CACHE": str(tmp_path / "cache")}
    sets = ['run.task="prices"', "prices.lookback=32", "prices.horizon=8", "prices.patch_len=8", "prices.stride=4",
            "train.max_steps=5", f"prices.center={json.dumps(center)}"]
    ref = harness(tmp_path / "ref", str(series), env=env, sets=sets)
    pp = harness(tmp_path / "pp", str(series), nproc=2, ds="pp2_zero1.json", env=env, sets=sets + PIPE)
    assert_losses_close(pp.losses, ref.losses, FP32_TOL)
    assert pp.evals[-1]["mse"] == pytest.approx(ref.evals[-1]["mse"], rel=1e-5)


def test_every_model_runs_the_same_forward_as_pipeline_layers():
    from harness.models.encoder import Encoder
    from harness.models.patch import PatchConfig, PatchTST
    from harness.models.pipeline import SharedUse
    from harness.models.seq2seq import Seq2Seq, Seq2SeqConfig
    from harness.models.transformer import TransformerConfig, TransformerLM

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=40, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    ids, tgt = torch.randint(4, 40, (3, 9)), torch.randint(4, 40, (3, 6))
    mask = torch.ones(3, 9, dtype=torch.bool)
    mask[1, 5:] = False
    patch = PatchTST(PatchConfig(lookback=32, horizon=8, patch_len=8, stride=4, d_model=16, n_heads=2, d_ff=32))
    torch.nn.init.normal_(patch.head.proj.weight)  # the zero-initialised head would hide the blocks
    cases = [(TransformerLM(cfg), (ids,)), (Encoder(cfg, "classify", 2), (ids, mask)),
             (Encoder(cfg, "residue", 3), (ids, mask)),
             (Seq2Seq(Seq2SeqConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)),
              (ids * mask, tgt, tgt > 20)),
             (patch, (torch.randn(3, 32, 4),))]
    for model, inputs in cases:
        model.eval()
        x = inputs[0] if len(inputs) == 1 else inputs
        for layer in model.pipeline_layers():
            x = layer.fn(getattr(model, layer.key), x, False) if isinstance(layer, SharedUse) else layer(x)
        assert torch.equal(x, model(*inputs)), type(model).__name__


def test_plan_shows_the_layout_the_bubble_and_what_each_rank_holds(tmp_path):
    run = write(tmp_path, "run.toml", "[train]\nmax_steps = 5\ngrad_accum_steps = 4\n[model]\nn_layers = 4\n")
    out = plan("--run", run, "--ds", str(DS / "pp2_zero1.json"), "--world-size", "4")
    assert out.returncode == 0, out.stderr
    assert "layout: data 2 x tensor 1 x pipeline 2 = world 4" in out.stdout
    assert "(2-1)/(4+2-1) = 20.0% of each step idle" in out.stdout
    assert "rank 3: stage 1, data shard 1" in out.stdout and "stage 0: layers 0-" in out.stdout
    out = plan("--run", run, "--ds", str(DS / "tp2_zero1.json"), "--world-size", "4")
    assert out.returncode == 0, out.stderr
    assert "rank 1: data shard 0, tensor slice 1 of 2" in out.stdout and "split 2 ways" in out.stdout
    assert bubble_fraction(2, 4) == pytest.approx(1 / 5) and bubble_fraction(4, 8) == pytest.approx(3 / 11)
    assert bubble_fraction(1, 8) == 0.0


TP = json.loads((DS / "tp2_zero1.json").read_text())["tensor_parallel"]


@pytest.mark.parametrize("ds,args,message", [
    ({"zero_optimization": {"stage": 2}, "pipeline": {"stages": 2}}, ["--world-size", "2"],
     "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
    ({"zero_optimization": {"stage": 3}, "pipeline": {"stages": 2}}, ["--world-size", "2"],
     "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism"),
    ({"zero_optimization": {"stage": 1}, "tensor_parallel": TP}, ["--world-size", "3"],
     "world size 3 is not a multiple of tensor_parallel.autotp_size 2"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}}, ["--world-size", "3"],
     "world size 3 is not a multiple"),
    ({"zero_optimization": {"stage": 1}, "tensor_parallel": TP}, ["--world-size", "2", "--set", "model.n_heads=1"],
     "must divide model.n_heads = 1"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 4}}, ["--world-size", "4", "--set", "model.n_layers=2"],
     "pipeline.stages = 4 (ds file"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}, "tensor_parallel": TP}, ["--world-size", "4"],
     "cannot combine AutoTP with pipeline parallelism"),
    ({"zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": 2}}, ["--world-size", "2"],
     "needs partition_config.layer_specs"),
    ({"zero_optimization": {"stage": 0}, "pipeline": {"stages": 2}}, ["--world-size", "2"],
     "clips by the first stage's gradient norm only"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2, "micro_batch": 4}}, ["--world-size", "2"],
     "did you mean `pipeline.micro_batches`"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2, "micro_batches": 4}},
     ["--world-size", "2", "--set", "train.grad_accum_steps=2"], "pipeline.micro_batches = 4"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2, "micro_batches": 4}},  # names the file's key
     ["--world-size", "2", "--set", "train.global_batch_size=16"], "!= 16 (pipeline.micro_batches = 4 (ds file"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2, "partition": "best"}}, ["--world-size", "2"],
     "pipeline.partition = 'best'"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}},
     ["--world-size", "2", "--set", "train.activation_checkpointing=true"], "set pipeline.activation_checkpoint_interval"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}},  # the position table outweighs the blocks
     ["--world-size", "2", "--set", "data.seq_len=1024", "--set", "model.d_model=32", "--set", "model.n_layers=2"],
     "gives stage 0 layers 0-0 (tok_emb+pos_emb+drop) and no Transformer block, and its ranks would hang"),
    ({"zero_optimization": {"stage": 1}, "pipeline": {"stages": 2}},
     ["--world-size", "2", "--set", "train.loss_chunk=8"],
     "train.loss_chunk = 8 under a pipeline: its last stage computes the loss from the whole logits"),
])
def test_plan_refuses_layouts_deepspeed_cannot_run(ds, args, message, tmp_path):
    path = write(tmp_path, "ds.json", json.dumps(ds))
    out = plan("--ds", path, "--set", "train.max_steps=10", *args)
    assert out.returncode == 2, (out.stdout, out.stderr)
    assert message in out.stderr and len(out.stderr.strip().splitlines()) == 1, out.stderr


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_one_sync_serial_check_answers_as_deepspeed_s_check_per_tensor(dtype):
    """Where the first check is still asked (tensor parallelism, MoE, offload): once, not once per tensor."""
    from types import SimpleNamespace

    from deepspeed.runtime.utils import CheckOverflow

    from harness.distributed.ds_patches import _one_sync_serial_check

    params = [torch.nn.Parameter(torch.zeros(n, dtype=dtype)) for n in (3, 300, 7)]
    ours = SimpleNamespace(overflow_checker=CheckOverflow())
    _one_sync_serial_check(ours)
    assert ours.overflow_checker.has_overflow_serial != CheckOverflow().has_overflow_serial
    cases = {"finite": None, "inf": float("inf"), "-inf": float("-inf"), "nan": float("nan"),
             "large finite (an fp16 norm would overflow)": 6e4}
    for case, bad in cases.items():
        for p in params:
            p.grad = torch.randn_like(p)
        if bad is not None:
            params[1].grad[5] = bad
            if bad > 1:
                params[1].grad[:] = bad  # 300 x 6e4: a norm of 1e6, finite in fp32
        expected = CheckOverflow().has_overflow(params)
        assert ours.overflow_checker.has_overflow(params) == expected, case
        assert expected == (case in ("inf", "-inf", "nan")), case
    params[0].grad, params[1].grad[0] = None, float("nan")  # a parameter without a gradient is skipped
    assert ours.overflow_checker.has_overflow(params) is True
    for p in params[1:]:
        p.grad = None
    assert ours.overflow_checker.has_overflow(params) is False


def test_the_deepspeed_patches_find_what_they_rely_on_here_and_step_aside_where_it_is_gone(monkeypatch, capsys):
    """On the DeepSpeed the suite runs, every patch's relied-on code is there; with one piece gone (DeepSpeed's norm
    check after the step's first check), the step's patch steps aside and rank 0 says so once."""
    import deepspeed.runtime.utils

    from harness.distributed import ds_patches

    assert ds_patches.version() in ds_patches.CHECKED
    for relies in (ds_patches._step_relies, ds_patches._universal_relies, ds_patches._groups_relies):
        assert relies() == [], relies
    monkeypatch.delattr(deepspeed.runtime.utils, "is_invalid_grad_norm")
    monkeypatch.setattr(ds_patches, "_said", set())
    assert not ds_patches.fence("fewer_step_syncs", ds_patches._step_relies)
    assert not ds_patches.fence("fewer_step_syncs", ds_patches._step_relies)
    out = capsys.readouterr().out
    assert out == (f"harness: fewer_step_syncs left out (DeepSpeed {ds_patches.version()} lacks what it relies on: "
                   f"deepspeed.runtime.utils.is_invalid_grad_norm): DeepSpeed's own code runs\n"), out


def test_the_cpu_fp16_opt_in_steps_aside_on_a_deepspeed_it_was_not_checked_on(monkeypatch, capsys):
    """HARNESS_CPU_FP16=1 tells DeepSpeed's CPU accelerator fp16 is supported (`ds_patches.claim_cpu_fp16`) on the
    DeepSpeed it was checked on; on another, fp16 is refused in one line that says why."""
    from deepspeed.accelerator import get_accelerator

    from harness.config.run import ConfigError
    from harness.distributed import ds_patches
    from harness.run.machine import check_precision

    acc = get_accelerator()
    monkeypatch.setattr(acc, "is_fp16_supported", lambda: False)  # a CPU without native fp16, as DeepSpeed sees it
    monkeypatch.setenv("HARNESS_CPU_FP16", "1")
    monkeypatch.setattr(ds_patches, "_said", set())
    monkeypatch.setattr(ds_patches, "version", lambda: "0.0.0")
    with pytest.raises(ConfigError, match=r"HARNESS_CPU_FP16=1 steps aside on DeepSpeed 0\.0\.0"):
        check_precision("fp16")
    assert "harness: claim_cpu_fp16 left out (DeepSpeed 0.0.0 is not a version" in capsys.readouterr().out
    monkeypatch.setattr(ds_patches, "version", lambda: ds_patches.CHECKED[0])
    check_precision("fp16")
    assert acc.is_fp16_supported()


STEP_SYNCS = [(0, "fp16", 1.0), (1, "bf16", 0.0), (2, "fp16", 1.0), (2, "fp32", 0.05), (3, "fp16", 1.0)]


def test_fewer_step_syncs_updates_and_skips_as_deepspeed_does_with_one_host_wait(tmp_path):
    """DeepSpeed's own step and the one `fewer_step_syncs` leaves, on the same batches: the same fp32 weights after
    every step (exactly), the same updates skipped (every gradient non-finite at one step, one parameter's at
    another), the same loss scale; ZeRO-1/2/3 wait for the device once a step instead of 2-4 times, ZeRO-0 fp16 on
    a CPU (DeepSpeed's unfused wrapper) 4 times instead of 9. Told of tensor parallelism, it leaves the check."""
    paths = []
    for stage, precision, clip in STEP_SYNCS:
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1, "gradient_clipping": clip,
                  "zero_optimization": {"stage": stage}, "bf16": {"enabled": precision == "bf16"},
                  "fp16": {"enabled": precision == "fp16", "initial_scale_power": 8}, "steps_per_print": 10**9,
                  "timers": {"throughput": {"enabled": False}}, "zero_allow_untested_optimizer": True}
        paths.append(write(tmp_path, f"zero{stage}_{precision}.json", json.dumps(config)))
    done = subprocess.run([python(), str(ROOT / "tests" / "step_sync_probe.py"), *paths], capture_output=True,
                          text=True, env=_env({"HARNESS_CPU_FP16": "1"}), timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = [json.loads(x) for x in done.stdout.splitlines() if x.startswith("{")]
    assert len(lines) == len(STEP_SYNCS)
    for (stage, precision, _), got in zip(STEP_SYNCS, lines):
        case, theirs, ours = f"ZeRO-{stage} {precision}", got["deepspeed"], got["fewer"]
        for step, (t, o) in enumerate(zip(theirs, ours)):
            assert o["weights"] == t["weights"], (case, step)
            assert (o["skipped"], o["loss_scale"]) == (t["skipped"], t["loss_scale"]), (case, step)
        assert [t["skipped"] for t in theirs] == [0, 0, 1, 1, 2, 2], case  # both poisoned steps were skipped
        assert theirs[3]["weights"] != theirs[1]["weights"], case  # and the finite steps after them were not
        assert {o["syncs"] for o in ours} == ({4} if stage == 0 else {1}), (case, ours)
        finite = [step for step in range(len(ours)) if step not in (2, 4)]
        assert all(theirs[s]["syncs"] > ours[s]["syncs"] for s in finite), (case, theirs, ours)
        assert got["kept_under_tp"], case  # there the norm does not see every gradient the check saw
        assert got["unknown_version"] == theirs, case  # fenced out: DeepSpeed's own step, its syncs and all
    assert done.stdout.count("harness: fewer_step_syncs left out (DeepSpeed 0.0.0 is not a version it was checked "
                             "on (0.19.8)): DeepSpeed's own code runs") == 1, done.stdout  # once a process
