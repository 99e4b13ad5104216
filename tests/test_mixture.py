"""Prepared corpora blended (`data.mix`) and packed documents kept apart (`data.document_mask`): the blend's
proportions and repeats, exact resume on other layouts, the same loss as each document alone, and bad input refused
in one line before launch."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from conftest import assert_losses_close, cli, harness, rewind, write_corpus
from harness.data.batches import StepSampler
from harness.data.corpus import Corpus, Mixture, Windows
from harness.prepare.corpus import prepare_corpus


@pytest.fixture
def sources(tmp_path, corpus):
    """A large source (the test corpus) and a small one, both with held-out documents, in shards of ~8 KB."""
    big, small = tmp_path / "big", tmp_path / "small"
    prepare_corpus([str(corpus)], str(big), val_fraction=0.05, unit_bytes=8192)
    prepare_corpus([str(write_corpus(tmp_path / "small.txt", lines=250, seed=5))], str(small), val_fraction=0.05,
                   unit_bytes=8192)
    return big, small


def mix(*pairs) -> str:
    return "data.mix=" + json.dumps([[str(p), w] for p, w in pairs])


def test_a_blend_draws_each_source_in_its_share_at_every_step_and_reads_every_window_in_turn(sources):
    """The run's sample numbers in turn (StepSampler's order "given", past the blend's length): every 8 samples hold
    each source in its share to a sample, and over three epochs' samples each source's windows are read as often as
    one another, the big source's too (read more than twice), each epoch of a source a new permutation."""
    big, small = (Windows(Corpus(p), "train", 32) for p in sources)
    blend = Mixture([big, small], [0.7, 0.3], seed=3)
    n = 3 * len(blend)
    source, window = blend.locate(np.arange(n))
    assert all(abs((source[i:i + 8] == 1).sum() - 0.3 * 8) <= 1 for i in range(0, n - 8, 8))
    for k, w in enumerate((big, small)):
        times = np.bincount(window[source == k], minlength=len(w))
        assert times.min() >= 2 and times.max() - times.min() <= 1, (k, times.min(), times.max())
    first = window[source == 0][:len(big)]
    second = window[source == 0][len(big):2 * len(big)]
    assert sorted(first) == list(range(len(big))) and not np.array_equal(first, second)
    assert np.array_equal(Mixture([big, small], [0.7, 0.3], seed=3).locate(np.arange(n))[1], window)  # a function
    assert not np.array_equal(Mixture([big, small], [0.7, 0.3], seed=4).locate(np.arange(n))[1], window)  # of seed
    assert torch.equal(blend[n - 1]["ids"], (big, small)[source[n - 1]][int(window[n - 1])]["ids"])
    sampler = StepSampler(len(blend), 4, 1, 1, 2, 0, 0, 5, order="given")  # rank 1 of 2: its share of each step
    assert next(iter(sampler)) == [4, 5, 6, 7]
    every = Mixture([big, small])  # validation: each source's windows once, in order
    assert len(every) == len(big) + len(small) and torch.equal(every[len(big)]["ids"], small[0]["ids"])
    with pytest.raises(IndexError):
        every[len(every)]


def test_a_window_knows_each_tokens_document_from_the_index(sources):
    corpus = Corpus(sources[0])
    ends = np.concatenate([start + np.fromfile(s.path.with_suffix(".idx"), dtype="<u4") for start, s in
                           zip(np.cumsum([0] + [s.tokens for s in corpus.shards["train"]]), corpus.shards["train"])])
    w = Windows(corpus, "train", 64, documents=True)
    for i in (0, 1, len(w) // 2, len(w) - 1):  # across shards too
        docs = w[i]["documents"].numpy()
        new = np.flatnonzero(np.diff(docs)) + i * 64 + 1  # where a document starts inside the window
        assert docs[0] == 0 and np.array_equal(new, ends[(ends > i * 64) & (ends < i * 64 + 65)])


def packed(vocab: int):
    """Three documents packed in one row, the third cut off, with each position's document."""
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, vocab, (n,), generator=g) for n in (5, 9, 4)]
    return docs, torch.cat(docs)[None], torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]


@pytest.mark.parametrize("model", ["built-in", "llama"])
def test_a_document_mask_gives_each_packed_document_the_loss_it_has_alone(model):
    from harness.tasks.lm import LanguageModelTask

    task = LanguageModelTask()
    torch.manual_seed(0)
    if model == "built-in":
        from harness.models.transformer import TransformerConfig, TransformerLM

        net = TransformerLM(TransformerConfig(vocab_size=64, max_seq_len=32, d_model=32, n_layers=2, n_heads=4))
    else:
        transformers = pytest.importorskip("transformers")
        net = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64, use_cache=False))  # as the task builds it
        task.hf_model = True
    net.eval()
    with torch.no_grad():  # sharper predictions than an initialisation's near-uniform ones: the context shows
        for p in net.parameters():
            p.mul_(4)
    docs, ids, documents = packed(64)
    targets = torch.randint(0, 64, ids.shape)
    alone = torch.cat([task.loss_from(net(d[None]), {"targets": t[None]}).reshape(1) for d, t in
                       zip(docs, targets[0].split([len(d) for d in docs]))]).sum()
    with torch.no_grad():
        masked = task.loss(net, {"inputs": ids, "targets": targets, "documents": documents})
        unmasked = task.loss(net, {"inputs": ids, "targets": targets})
    assert abs(masked.item() - alone.item()) <= 1e-5 * alone.item()
    assert abs(unmasked.item() - alone.item()) > 1e-2 * alone.item()  # the test can tell


def test_a_blend_with_document_masks_resumes_exactly_on_another_world_size_or_sequence_split(tmp_path, sources):
    """Stopped on 2 processes and resumed on 1 with accumulation 2, then split over 2 sequence ranks (ZeRO-3): every
    step reads the samples the uninterrupted run read (its `data_hash`) and reaches its loss."""
    sets = ["data.path=\"\"", mix((sources[0], 0.6), (sources[1], 0.4)), "data.document_mask=true",
            "train.max_steps=8", "train.save_every=2", "train.keep_checkpoints=10"]
    whole = harness(tmp_path / "whole", sources[0], nproc=2, ds="zero2.json", sets=sets)
    out = whole.proc.stdout + whole.proc.stderr
    assert "a mixture of prepared corpora" in out and out.count("the run reads it") == 2
    assert "validation: the corpora's own (--val-fraction at prepare; data.val_fraction is for raw text); an " \
           "evaluation reads ~" in out  # how much, before a run on a large corpus evaluates all of it
    hashes = {m["step"]: m["data_hash"] for m in whole.metrics}
    assert len(set(hashes.values())) == 8
    run_dir = rewind(whole.dir, tmp_path / "run", 2)
    # the second leg logs every 3 steps from step 4 (6, 8): a logged step's data_hash is that step's own, not its
    # window's (steps 5-6 here, 4-6 uninterrupted)
    for nproc, ds, stop, extra in ((1, "zero1.json", 4, ["train.grad_accum_steps=2"]),
                                   (2, "sp2_zero3.json", 8, ["train.grad_accum_steps=2", "train.log_every=3"])):
        run = harness(run_dir, sources[0], nproc=nproc, ds=ds, sets=[*sets, *extra],
                      args=["--resume", "auto", "--stop-at", str(stop)])
        logged = [m["step"] for m in run.metrics]
        assert logged == [1, 2, 3, 4] + [6, 8] * (stop == 8), logged
        assert {m["step"]: m["data_hash"] for m in run.metrics} == {k: hashes[k] for k in logged}
        assert_losses_close(run.losses, {k: whole.losses[k] for k in logged}, 1e-5)


def plan(*sets: str, ds: list[str] = ()):
    args = ["plan", "--set", "train.max_steps=2000", "--set", "data.seq_len=32", *ds]
    for s in sets:
        args += ["--set", s]
    return cli(*args)


def test_the_plan_says_each_sources_epochs_and_names_one_repeated_too_often(sources):
    done = plan(mix((sources[0], 0.5), (sources[1], 0.5)))
    assert done.returncode == 0, done.stderr[-2000:]
    lines = [line for line in done.stdout.splitlines() if "the run reads it" in line]
    assert len(lines) == 2 and "more than 4 repeats" not in lines[0] and "more than 4 repeats" in lines[1]


def test_bad_mixtures_and_document_masks_are_refused_in_one_line(sources, tmp_path, tiny_llama):
    big, small = sources
    bpe = tmp_path / "bpe"
    prepare_corpus([str(write_corpus(tmp_path / "c.txt", lines=50))], str(bpe), tokenizer=str(tiny_llama))
    cases = [
        ([mix((big, 0.5), (small, 0))], "data.mix: the weight of"),
        ([mix((big, 1), (big, 1))], "twice"),
        ([mix((big, 1), (small, 1e-4))], "is below 1/8,192 of the mix"),  # (it had never been drawn, silently)
        ([mix((big, 1), (tmp_path / "none", 1))], "is no prepared corpus"),
        ([mix((big, 1), (bpe, 1))], "prepared with the tokenizer"),
        ([mix((big, 1), (small, 1)), "data.seq_len=100000"], "not one window of data.seq_len + 1"),
        (["data.mix=[3]"], "each item must be a directory or a [directory, weight] pair"),
        ([mix((big, 1)), f"data.path={json.dumps(str(big))}"], "data.mix and data.path"),
        (["data.document_mask=true"], "needs a prepared corpus"),
        ([f"data.path={json.dumps(str(big))}", "data.document_mask=true", "run.task=\"prices\""],
         "belongs to run.task"),
    ]
    for sets, message in cases:
        done = plan(*sets)
        last = done.stderr.strip().splitlines()[-1]
        assert done.returncode == 2 and message in last, (sets, done.stderr[-1500:])
    done = plan(f"data.path={json.dumps(str(big))}", "data.document_mask=true",
                ds=["--ds", "pp2_zero1.json", "--world-size", "2"])
    assert done.returncode == 2 and "not supported under a pipeline" in done.stderr, done.stderr[-1500:]
    done = plan(f"data.path={json.dumps(str(big))}", "data.document_mask=true",
                ds=["--ds", "sp2_zero0.json", "--world-size", "2"])  # its memory is not in the formula, and said so
    assert done.returncode == 0 and done.stdout.count("not counted above: data.document_mask's attention") == 2, \
        done.stdout[-3000:]
    # a causal LM whose modeling code builds no mask with transformers' utilities (Mamba has no attention at all)
    import shutil

    from transformers import MambaConfig, MambaForCausalLM

    mamba = tmp_path / "tiny-mamba"
    config = MambaConfig(vocab_size=64, hidden_size=16, num_hidden_layers=1, state_size=4)
    MambaForCausalLM(config).save_pretrained(mamba)
    for f in tiny_llama.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, mamba / f.name)
    bpe_set = f"data.path={json.dumps(str(bpe))}"
    done = plan(bpe_set, f"model.hf={json.dumps(str(mamba))}", "data.document_mask=true")
    last = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and "does not build its attention mask with transformers' masking" in last, last
    done = plan(bpe_set, f"model.hf={json.dumps(str(tiny_llama))}", "data.document_mask=true")
    assert done.returncode == 0, done.stderr[-1500:]  # the Llama builds it so: the same corpus is taken
