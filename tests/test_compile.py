"""train.compile: each repeated block compiled on its own (distributed/compile.py), the compile seconds kept out of
step time, a block that cannot compile run eagerly with one line, a recompile storm said once; and a compiled run
trains the same model as an eager one."""
from __future__ import annotations

import json

import pytest
import torch
from conftest import DS, TINY, cli, harness
from torch import nn

from harness.distributed.compile import CompileWatch, compile_blocks, repeated_blocks
from harness.models.encoder import Encoder
from harness.models.seq2seq import Seq2Seq, Seq2SeqConfig
from harness.models.transformer import TransformerConfig, TransformerLM


def test_repeated_blocks_of_every_model_family():
    cfg = TransformerConfig(vocab_size=40, max_seq_len=16, d_model=32, n_layers=3, n_heads=4, d_ff=64)
    with torch.device("meta"):
        lm, encoder = TransformerLM(cfg), Encoder(cfg, "classify", 2)
        seq2seq = Seq2Seq(Seq2SeqConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, d_ff=64))
    assert [n for n, _ in repeated_blocks(lm)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in repeated_blocks(encoder)] == ["blocks.0", "blocks.1", "blocks.2"]
    assert [n for n, _ in repeated_blocks(seq2seq)] == ["encoder.0", "encoder.1", "decoder.0", "decoder.1"]
    from transformers import LlamaConfig, LlamaForCausalLM

    with torch.device("meta"):
        llama = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2))
    assert [n for n, _ in repeated_blocks(llama)] == ["model.layers.0", "model.layers.1"]


class Breaks(nn.Module):
    """A layer torch.compile cannot take whole: a tensor's value read on the host in the middle of it."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        return y * 2 if y.sum().item() > 0 else y  # sync point: a graph break, which fullgraph refuses


def test_a_block_that_cannot_compile_runs_eagerly_said_once_by_name():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.layers = nn.ModuleList([Breaks(), Breaks()])
    x = torch.randn(3, 4)
    expected = model.layers[1](model.layers[0](x))
    lines: list[str] = []
    compile_blocks(model, (), lines.append)
    for _ in range(2):
        got = model.layers[1](model.layers[0](x.requires_grad_()))
        assert torch.equal(got, expected)
    assert len(lines) == 1 and lines[0].startswith("train.compile: Breaks (layers.0 .. layers.1) cannot compile, "
                                                   "runs eagerly: "), lines  # and torch's reason, its first words


def test_compile_seconds_and_a_recompile_storm_said_once():
    lines: list[str] = []
    watch = CompileWatch(expected=1, say=lines.append)

    def double(x):
        return x * 2

    static = torch.compile(double, dynamic=False, backend="eager")
    seconds = []
    for n in range(1, 6):  # a new shape every step, each a compile of its own
        static(torch.ones(n))
        seconds.append(watch.update(step=n))
    assert watch.graphs == 5 and all(s > 0 for s in seconds) and watch.seconds == pytest.approx(sum(seconds))
    assert len(lines) == 1 and "double" in lines[0] and "compiled 3 times by step 3 (expected at most 1)" in lines[0]
    assert watch.update(step=6, until=0.0) == 0.0  # nothing compiled since; a record is read once


def test_backward_records_without_code_are_no_storm(monkeypatch):
    """torch 2.11 on CUDA records each backward graph apart with no code (`co_name` None): seen on an H200 as
    "None (None:None) compiled 6 times"; they add seconds and graphs, never a code's compile count."""
    from types import SimpleNamespace

    import torch._dynamo.utils as dynamo_utils

    def record(i, co_name):
        return SimpleNamespace(compile_id=f"0/{i}", start_time_us=i, end_time_us=i + 10**6, duration_us=10**6,
                               fail_type=None, co_name=co_name, co_filename=co_name and "m.py",
                               co_firstlineno=co_name and 1, recompile_reason=None)

    records = [record(i, "forward" if i < 2 else None) for i in range(8)]
    monkeypatch.setattr(dynamo_utils, "get_compilation_metrics", lambda: records)
    lines: list[str] = []
    watch = CompileWatch(expected=2, say=lines.append)
    assert watch.update(step=2) == pytest.approx(8.0) and watch.graphs == 8
    assert not lines and watch.per_code == {"forward (m.py:1)": 2}


def test_compiled_training_matches_eager_with_compile_time_apart(cached_run, tmp_path, corpus):
    eager = cached_run("ref-fp32", ds="zero0.json")
    compiled = harness(tmp_path / "run", corpus, ds="zero0.json", sets=["train.compile=true"], timeout=600)
    for step, loss in eager.losses.items():
        assert compiled.losses[step] == pytest.approx(loss, rel=1e-4, abs=1e-5), step
    first, later = compiled.metrics[0], compiled.metrics[1:]
    assert first["compile_s"] > 1.0 > first["step_s"]  # the block's compile, not in the step's time
    assert all(m["compile_s"] == 0.0 for m in later)
    assert "train.compile: 1 graph compiled in" in compiled.proc.stdout


def test_compile_without_a_compiler_is_refused_before_launch(tmp_path, corpus):
    out = tmp_path / "run"
    proc = cli("train", "--set", f"data.path={json.dumps(str(corpus))}", "--set",
               f"run.output_dir={json.dumps(str(out))}", *[a for s in TINY for a in ("--set", s)],
               "--set", "train.compile=true", "--ds", str(DS / "zero0.json"), env={"CXX": "no-such-compiler"})
    assert proc.returncode == 2
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("harness: error: train.compile = True") and "needs a C++ compiler" in last, last
    assert not out.exists()
