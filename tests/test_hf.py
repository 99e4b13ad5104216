"""Hugging Face models in the harness (the `[hf]` extra): a tiny Llama written by the test with `save_pretrained`,
with a tokenizer the test trains (no hub), trains as the `lm` task's model. 2 processes under ZeRO-2 and under
ZeRO-3 (built already partitioned) give the per-step losses of 1 process; resume is exact; the run's HF-format
export loads with `transformers` alone and gives the engine's outputs; `harness export --hf` writes the same
for a finished run."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import ROOT, TINY_RUN, _env, assert_losses_close, ds_variant, harness

transformers = pytest.importorskip("transformers")

FP32_TOL = 1e-5


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, corpus):
    """A 2-layer Llama and a word-level tokenizer trained on the test corpus, saved as a model directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[BOS]", "[EOS]"]))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                bos_token="[BOS]", eos_token="[EOS]")
    config = transformers.LlamaConfig(vocab_size=len(fast), hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      pad_token_id=fast.pad_token_id, bos_token_id=fast.bos_token_id,
                                      eos_token_id=fast.eos_token_id)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


def hf_sets(model_dir) -> list[str]:
    return [f"model.hf={json.dumps(str(model_dir))}", "data.seq_len=16"]


def test_hf_causal_lm_matches_one_process_under_zero2_and_partitioned_zero3(cached_run, tiny_llama, tmp_path):
    ref = cached_run("hf-ref", sets=hf_sets(tiny_llama), base=TINY_RUN)
    assert "task lm, LlamaForCausalLM of" in ref.proc.stdout
    # Llama's mask code reads values (.item()), which a meta-device forward cannot: the 6N fallback, said so
    assert ref.metrics[0]["flops_method"] == "6N per item"
    assert ref.losses[6] < ref.losses[1]
    two2 = cached_run("hf-zero2-2p", nproc=2, ds="zero2.json", sets=[*hf_sets(tiny_llama), "train.micro_batch_size=2"], base=TINY_RUN)
    assert_losses_close(two2.losses, ref.losses, FP32_TOL)
    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    two3 = cached_run("hf-zero3-2p", nproc=2, ds=ds3, sets=[*hf_sets(tiny_llama), "train.micro_batch_size=2"], base=TINY_RUN)
    assert "built partitioned over the ranks (ZeRO-3" in two3.proc.stdout
    assert_losses_close(two3.losses, ref.losses, FP32_TOL)


def test_hf_export_loads_with_transformers_alone_and_matches(cached_run, tiny_llama, tmp_path):
    import torch

    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    run = cached_run("hf-zero3-2p", nproc=2, ds=ds3, sets=[*hf_sets(tiny_llama), "train.micro_batch_size=2"], base=TINY_RUN)
    from harness.export import load_model

    ours, _ = load_model(run.dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(run.dir / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(run.dir / "hf")
    ids = torch.tensor([tok("the model trains on many small batches")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-6)
    out = tmp_path / "again"
    proc = subprocess.run([sys.executable, "-m", "harness", "export", "--run-dir", str(run.dir), "--hf", str(out)],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs(ids).logits)
    assert transformers.AutoTokenizer.from_pretrained(out)("the model")["input_ids"] == tok("the model")["input_ids"]


def test_hf_resume_is_exact(cached_run, tiny_llama, corpus, tmp_path):
    whole = cached_run("hf-ref", sets=hf_sets(tiny_llama), base=TINY_RUN)
    out = tmp_path / "run"
    harness(out, corpus, sets=hf_sets(tiny_llama), args=["--stop-at", "3"], base=TINY_RUN)
    resumed = harness(out, corpus, sets=hf_sets(tiny_llama), args=["--resume", "auto"], base=TINY_RUN)
    assert_losses_close(resumed.losses, whole.losses, FP32_TOL)


def test_hf_model_from_a_config_json_alone_and_bad_references(tiny_llama, tmp_path):
    from harness.config import ConfigError, resolve
    from harness.tasks import get_task

    task = get_task("lm")
    cfg = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama / 'config.json'))}"]).cfg
    task.check(cfg)
    assert type(task.build_model(cfg)).__name__ == "LlamaForCausalLM"  # random init from the config
    for ref, message in [(str(tmp_path / "none.json"), "no such file"), ("./no/such/dir", "no such directory")]:
        with pytest.raises(ConfigError, match=message):
            task.check(resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(ref)}"]).cfg)
    with pytest.raises(ConfigError, match="model.d_model = 64 .* belongs to the built-in model"):
        resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}", "model.d_model=64"])


def test_hf_autotp_size_2_matches_one_process_and_exports_whole(cached_run, tiny_llama):
    import torch

    ref = cached_run("hf-ref", sets=hf_sets(tiny_llama), base=TINY_RUN)
    # configs/ds/tp2_hf.json names no layer specs: DeepSpeed's AutoTP applies its built-in Llama policy
    tp = cached_run("hf-tp2", nproc=2, ds="tp2_hf.json", sets=hf_sets(tiny_llama), base=TINY_RUN)
    assert "tensor parallel 2" in tp.proc.stdout
    assert_losses_close(tp.losses, ref.losses, FP32_TOL)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tp.dir / "hf").eval()
    whole = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).eval()
    assert all(a.shape == b.shape for a, b in zip(theirs.parameters(), whole.parameters()))  # gathered, not shards
    ids = torch.tensor([[5, 6, 7, 8]])
    from harness.export import load_model

    ours, _ = load_model(tp.dir)
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-6)


def test_hf_class_must_be_a_transformers_auto_class(tiny_llama):
    from harness.config import ConfigError, resolve
    from harness.tasks import get_task

    cfg = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                         'model.hf_class="AutoModelForNothing"']).cfg
    with pytest.raises(ConfigError, match="model.hf_class = 'AutoModelForNothing' is not a transformers auto class"):
        get_task("lm").check(cfg)
