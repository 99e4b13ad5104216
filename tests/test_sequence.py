"""Sequence parallelism (Ulysses), named by `"sequence_parallel_size"` in the DeepSpeed JSON: every model split over
2 processes gives one process's outputs and gradients (tests/sequence_probe.py); the harness's runs give one
process's losses under ZeRO-0 and ZeRO-3 (the loss factor there), for every task; checkpoints resume with and
without it; bad input is refused before launch in one line."""
from __future__ import annotations

import json
import socket
import subprocess

import pytest
import torch
from conftest import (
    DS,
    ROOT,
    TINY,
    TINY_RUN,
    _env,
    assert_losses_close,
    cli,
    harness,
    python,
    rewind,
    val_loss_of_export,
)
from test_plan import plan, write

from harness.run.step import saved_bytes

FP32_TOL = 1e-5
TP = json.loads((DS / "tp2_zero1.json").read_text())["tensor_parallel"]


def report(name: str, two, one) -> None:
    """The agreement with one process, printed (`-s` shows it): README's figures come from these lines."""
    steps = max(abs(two.losses[s] - one.losses[s]) / abs(one.losses[s]) for s in one.losses)
    val = abs(two.evals[-1]["loss"] - one.evals[-1]["loss"]) / abs(one.evals[-1]["loss"])
    print(f"\n{name}: SP=2 vs one process over {len(one.losses)} steps, largest relative difference of a step's loss "
          f"{steps:.1e}, of the validation loss {val:.1e}")


def probe() -> dict[str, dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([python(), "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port",
                           str(port), str(ROOT / "tests" / "sequence_probe.py")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {r["case"]: r for r in map(json.loads, (line for line in proc.stdout.splitlines() if line.startswith("{")))}


def test_every_model_split_over_two_processes_gives_one_process_outputs_and_gradients():
    results = probe()
    # the probe can fail: positions numbered from 0 on every rank (the missing position ids of a naive split)
    wrong = results.pop("lm, positions from 0 on every rank")
    assert wrong["outputs"] > 1e-3 and wrong["grad"] > 1e-3, wrong
    assert set(results) == {"lm", "protein mlm", "protein regress, attention pooling, ridge", "protein classify",
                            "translation", "prices"}
    for case, r in results.items():
        assert r["loss"] < 1e-6 and r["outputs"] < 1e-5 and r["grad"] < 1e-5, (case, r)


def test_lm_split_over_two_ranks_trains_as_one_process(cached_run):
    """ZeRO-3 averages the sequence ranks' gradients where ZeRO 0-2 sum them (the loss is scaled by 2 there; ZeRO-0 is
    the case studies' and the resume's below): the losses, the validation loss and the export are one process's."""
    ref = cached_run("ref-fp32", ds="zero0.json")
    two = cached_run("sp2_zero3.json", nproc=2, ds="sp2_zero3.json",
                     sets=["train.save_every=2", "train.keep_checkpoints=4"])
    assert "(data parallel 1, sequence parallel 2)" in two.proc.stdout
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    report("lm (sp2_zero3.json)", two, ref)
    assert abs(two.evals[-1]["loss"] - ref.evals[-1]["loss"]) < 1e-5
    assert abs(val_loss_of_export(two.dir) - ref.evals[-1]["loss"]) < 1e-5
    # what the forward keeps for backward, measured on rank 0 (autograd's saved tensors): about half
    ratio = two.metrics[0]["activation_bytes"] / ref.metrics[0]["activation_bytes"]
    assert 0.4 < ratio < 0.6, ratio  # against ZeRO-0 (the weights left out, ZeRO-3 keeps as many bytes)


def test_the_chunked_loss_gives_the_same_losses_and_keeps_fewer_bytes(cached_run):
    ref = cached_run("ref-fp32", ds="zero0.json")
    chunked = cached_run("chunked", ds="zero0.json", sets=["train.loss_chunk=24"])
    assert_losses_close(chunked.losses, ref.losses, 1e-6)
    assert chunked.metrics[0]["activation_bytes"] < ref.metrics[0]["activation_bytes"]


def test_what_a_forward_keeps_for_backward_leaves_out_the_weights_as_zero_3_gathers_and_autocast_casts_them():
    """Autograd saves a Linear's weight as `weight.t()`, a view that is no Parameter; ZeRO-3 gathers a weight into a
    new storage for the layer's forward; autocast keeps a 16-bit copy. None of them is an activation."""
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 64))
    x = torch.randn(4, 64)

    def kept(**autocast) -> int:
        out: dict = {}
        with saved_bytes(out, model.parameters()), torch.autocast("cpu", **autocast):
            model(x).sum()
        return out["bytes"]

    activations = 4 * (64 + 256)  # the input and the hidden layer (ReLU's output, the second Linear's input)
    assert kept(enabled=False) == 4 * activations  # fp32
    assert kept(dtype=torch.bfloat16) == 2 * activations  # the input's and hidden layer's bf16 copies, no weight's

    def gather(module, args):  # as DeepSpeed's ZeRO-3 does before each layer's forward: the weight in a new storage
        for p in module.parameters(recurse=False):
            p.data = p.data.clone()

    for i, p in enumerate(model.parameters()):
        p.ds_id = i
    for layer in (model[0], model[2]):
        layer.register_forward_pre_hook(gather)
    assert kept(enabled=False) == 4 * activations


def test_the_chunked_loss_is_the_lm_s_own_model_s(tmp_path):
    out = plan("--set", "train.max_steps=2", "--set", 'run.task="prices"', "--set", "train.loss_chunk=8")
    assert out.returncode == 2 and "train.loss_chunk = 8 (command line): task 'prices' computes its loss whole" \
        in out.stderr, out.stderr
    out = plan("--set", "train.max_steps=2", "--set", "train.loss_chunk=-1")
    assert out.returncode == 2 and "train.loss_chunk = -1 (command line) must be >= 0" in out.stderr, out.stderr


def test_bench_finds_the_longest_sequence_split_over_two_ranks(tmp_path, corpus):
    """CI's toy size: the sweep's own run, at the cap (data.seq_len = 128), is the search's one try; on a GPU the
    same command measures the table."""
    sets = [s for s in TINY if not s.startswith(("train.max_steps", "data.seq_len"))] + [
        f"data.path={json.dumps(str(corpus))}", "data.seq_len=128"]
    args = ["sweep", "--ds", "sp2_zero0", "--nproc", "2", "--largest", "seq_len", "--memory-budget-gb", "8", "--largest-max",
            "2", "--steps", "2", "--warmup", "1", "--out", str(tmp_path / "b")]
    proc = cli("bench", *args, *[a for s in sets for a in ("--set", s)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    (config,), (longest,) = result["configs"], result["largest"]
    assert config["layout"].startswith("data 1 x sequence 2") and config["activation_bytes"] > 0
    assert longest["key"] == "data.seq_len" and longest["value"] == 128 and longest["capped"]
    assert longest["tried"]["128"]["status"] == "ok"
    assert "Longest sequence for sp2_zero0 x2 within 8.00 GiB per rank: data.seq_len = 128" in \
        (tmp_path / "b" / "bench.md").read_text()


def test_a_hugging_face_lm_split_by_deepspeeds_hf_path_trains_as_one_process(cached_run, tiny_llama):
    """Llama (grouped-query attention: 4 heads, 2 key/value heads) built partitioned under ZeRO-3, its sdpa attention
    wrapped by DeepSpeed's UlyssesSPAttentionHF, each rank's position ids its own chunk's."""
    sets = [f"model.hf={json.dumps(str(tiny_llama))}", "data.seq_len=16"]
    ref = cached_run("hf-ref", sets=sets, base=TINY_RUN)
    two = cached_run("hf-sp2_zero3", nproc=2, ds="sp2_zero3.json", sets=sets, base=TINY_RUN)
    assert "LlamaForCausalLM" in two.proc.stdout and "sequence parallel 2" in two.proc.stdout
    assert_losses_close(two.losses, ref.losses, FP32_TOL)
    report("tiny Hugging Face Llama (sp2_zero3.json)", two, ref)
    assert abs(two.evals[-1]["loss"] - ref.evals[-1]["loss"]) < 1e-5


def test_the_longest_sequence_on_paper_does_not_depend_on_the_length_planned_from():
    """The built-in model's position table grows with data.seq_len: planned from 128 positions, the longest that fits
    an H100 came out at 2.4 M positions, where the plan of that length needs twice the card."""
    import re

    sets = ["--ds", str(DS / "sp2_zero0.json"), "--world-size", "2", "--mixed-precision", "bf16", "--set",
            "model.d_model=2048", "--set", "model.n_layers=2", "--set", "model.n_heads=16", "--set",
            "train.micro_batch_size=1", "--set", "train.loss_chunk=1024", "--set", "train.max_steps=2"]
    found = []
    for length in ("128", "1246720"):
        out = plan(*sets, "--set", f"data.seq_len={length}")
        assert out.returncode == 0, out.stderr[-2000:]
        line = next(x for x in out.stdout.splitlines() if x.startswith("longest sequence that fits an H100"))
        assert "growing with it; bf16 as resolved here" in line
        found.append(re.sub(r"model states [^;]+;", "", line))
    assert found[0] == found[1] and "SP=8 1,246,720" in found[0], found


def test_a_hugging_face_model_of_another_task_is_refused(tiny_t5, tmp_path):
    toy, t5 = tiny_t5
    out = plan("--ds", str(DS / "sp2_zero0.json"), "--world-size", "2", "--set", "train.max_steps=2", "--set",
               'run.task="translation"', "--set", 'translation.target_lang="fr"', "--set",
               f"data.path={json.dumps(str(toy))}", "--set", f"model.hf={json.dumps(str(t5))}")
    assert out.returncode == 2 and "DeepSpeed's Hugging Face path drops the attention mask" in out.stderr, out.stderr


def test_a_sequence_parallel_checkpoint_resumes_in_one_process(cached_run, corpus, tmp_path):
    """ZeRO-3 over data x sequence ranks (2 partitions) resumed in one process: converted to DeepSpeed's universal
    checkpoint, and the losses go on as uninterrupted."""
    ref = cached_run("ref-fp32", ds="zero0.json")
    two = cached_run("sp2_zero3.json", nproc=2, ds="sp2_zero3.json",
                     sets=["train.save_every=2", "train.keep_checkpoints=4"])
    part = rewind(two.dir, tmp_path / "part", 4)
    assert json.loads((part / "checkpoints" / "step_00000004" / "layout.json").read_text())["sp_size"] == 2
    one = harness(part, corpus, ds="zero3.json", args=["--resume", "auto"])
    assert "universal checkpoint" in one.proc.stdout
    assert_losses_close(one.losses, ref.losses, FP32_TOL)


def test_a_one_process_checkpoint_resumes_split_over_two_ranks(corpus, tmp_path):
    sets = ["train.save_every=2", "train.keep_checkpoints=4"]
    one = harness(tmp_path / "one", corpus, ds="zero0.json", sets=sets)
    part = rewind(one.dir, tmp_path / "part", 4)
    two = harness(part, corpus, nproc=2, ds="sp2_zero0.json", sets=sets, args=["--resume", "auto"])
    assert "resumed from" in two.proc.stdout and "sequence parallel 2" in two.proc.stdout
    assert_losses_close(two.losses, one.losses, FP32_TOL)


def _task_runs(name: str, tmp_path, tmp_path_factory):
    """(data path, sets, env) of a small run of each case study."""
    env = {"HARNESS_CACHE": str(tmp_path_factory.getbasetemp() / "sp-cache")}
    base = ["train.max_steps=4", "train.log_every=1", "schedule.warmup_steps=1", 'logging.backend="none"',
            "logging.plots=false", "model.d_model=32", "model.n_layers=2", "model.n_heads=4", "model.dropout=0.0"]
    if name == "translation":
        from test_translation import write_toy_dir

        return str(write_toy_dir(tmp_path / "toy")), base + [
            'run.task="translation"', 'translation.target_lang="fr"', "model.vocab_size=64",
            "translation.eval_max_sentences=2", "translation.beam_size=1", "train.micro_batch_size=4"], env
    if name == "protein":  # the pooled (rows) head, sequences of unequal length
        return "", base + ['run.task="protein"', "data.seq_len=64", "train.micro_batch_size=5"], env
    from test_prices import write_series

    return str(write_series(tmp_path / "series.csv", n=600)), base + [
        'run.task="prices"', "prices.lookback=32", "prices.horizon=8", "prices.patch_len=8", "prices.stride=4",
        "train.micro_batch_size=4"], env


@pytest.mark.parametrize("task,config", [("translation", "sp2_zero0.json"), ("protein", "sp2_zero3.json"),
                                         ("prices", "sp2_zero0.json")])
def test_each_case_study_split_over_two_ranks_trains_as_one_process(task, config, tmp_path, tmp_path_factory):
    data, sets, env = _task_runs(task, tmp_path, tmp_path_factory)
    one = harness(tmp_path / "one", data, env=env, ds="zero0.json", sets=sets, base=[])
    two = harness(tmp_path / "two", data, env=env, nproc=2, ds=config, sets=sets, base=[])
    assert "sequence parallel 2" in two.proc.stdout
    assert_losses_close(two.losses, one.losses, FP32_TOL)
    report(f"{task} ({config})", two, one)
    assert abs(two.evals[-1]["loss"] - one.evals[-1]["loss"]) < 1e-5


def test_the_accelerate_way_names_the_same_split(tmp_path):
    env = {"ACCELERATE_USE_PARALLELISM_CONFIG": "true", "PARALLELISM_CONFIG_SP_SIZE": "2",
           "PARALLELISM_CONFIG_SP_BACKEND": "deepspeed"}
    out = plan("--world-size", "4", "--set", "model.n_heads=4", "--set", "train.max_steps=2", env=env)
    assert out.returncode == 0, out.stderr
    assert "layout: data 2 x sequence 2 x tensor 1 x pipeline 1 = world 4" in out.stdout
    both = plan("--world-size", "2", "--ds", "configs/ds/zero0.json", "--set", "train.max_steps=2", env=env)
    assert both.returncode == 2 and "sequence_parallel_size = 1 vs accelerate parallelism_config sp_size = 2" \
        in both.stderr
    ring = plan("--world-size", "2", "--set", "train.max_steps=2",
                env={**env, "PARALLELISM_CONFIG_SP_SIZE": "1", "PARALLELISM_CONFIG_CP_SIZE": "2"})
    assert ring.returncode == 2 and "cp_size = 2 is context parallelism through FSDP2" in ring.stderr


def test_the_overhead_study_refuses_sequence_parallel_configurations(tmp_path):
    proc = cli("bench", "overhead", "--ds", "sp2_zero0", "--nproc", "2", "--set", "train.max_steps=2", "--out",
               str(tmp_path / "b"))
    assert proc.returncode == 2, proc.stderr
    assert "the overhead study with sequence or tensor parallelism (sp2_zero0 x2)" in proc.stderr, proc.stderr


def _sp(tmp_path, sp=2, **keys) -> str:
    cfg = {"sequence_parallel_size": sp, "zero_optimization": {"stage": 0}, **keys}
    return write(tmp_path, "sp.json", json.dumps(cfg))


PLUGIN = '''
import torch
from harness.tasks import TaskData


class Unsaid:
    """A task that does not say how its batches split."""
    def build_model(self, cfg):
        return torch.nn.Linear(4, 1)
    def build_data(self, cfg):
        return TaskData([], [])
    def collate(self, samples):
        return {}
    def count(self, batch):
        return 1
    def inputs(self, batch):
        return ()
    def loss_from(self, outputs, batch):
        return outputs.sum()


class Flat(Unsaid):
    """A task whose model is a Linear layer: nothing to split."""
    def sequence_split(self, batch):
        return {}
'''


@pytest.mark.parametrize("ds,world,sets,message", [
    ({"sp": 2}, 3, [], "sequence_parallel_size = 2 (ds file SP) does not divide the world size 3"),
    ({"sp": 4}, 4, ["model.n_heads=2"], "sequence_parallel_size = 4 (ds file SP) must divide model.n_heads = 2"),
    ({"sp": 2}, 2, ["data.seq_len=33"], "must divide the 33 positions of each sample (data.seq_len = 33"),
    ({"sp": 2, "tensor_parallel": TP}, 4, [], "with tensor_parallel.autotp_size = 2: the harness splits"),
    ({"sp": 2, "train_batch_size": 16}, 2, ["train.micro_batch_size=8"], "train_batch_size = 16 (ds file SP) counts "
     "the sequence-parallel ranks"),
    ({"sp": 0}, 2, [], "sequence_parallel_size = 0 (ds file SP) must be a whole number >= 1"),
    ({"sp": 2, "zero_optimization": {"stage": 3, "reduce_scatter": False}}, 2, [],
     "with zero_optimization.reduce_scatter = false under ZeRO-3"),
    ({"sp": 2}, 2, ["train.compile=true"], "with train.compile = True"),
    ({"sp": 2}, 2, ['run.task="prices"', "prices.lookback=36", "prices.patch_len=8", "prices.stride=4"],
     "must divide the 9 positions of each sample (prices.lookback = 36"),
    ({"sp": 2}, 2, ['run.task="PLUGIN:Flat"'], "has no attention the harness can split"),
    ({"sp": 2}, 2, ['run.task="PLUGIN:Unsaid"'], "does not say how its batches split over positions"),
    # what the task cannot do is said first, not the heads of a model it might not have (was: must divide n_heads)
    ({"sp": 2}, 2, ['run.task="PLUGIN:Unsaid"', "model.n_heads=1"], "does not say how its batches split over"),
    ({"sp": 2}, 2, ['run.task="PLUGIN:Flat"', "model.n_heads=1"], "has no attention the harness can split"),
])
def test_bad_sequence_parallel_input_is_refused_before_launch(ds, world, sets, message, tmp_path):
    sp = ds.pop("sp")
    path = _sp(tmp_path, sp, **ds)
    plugin = write(tmp_path, "flat.py", PLUGIN)
    sets = [s.replace("PLUGIN", plugin) for s in sets]
    out = plan("--ds", path, "--world-size", str(world), "--set", "train.max_steps=2",
               *[a for s in sets for a in ("--set", s)])
    err = out.stderr.replace(path, "SP")
    assert out.returncode == 2 and message in err and len(err.strip().splitlines()) == 1, err
