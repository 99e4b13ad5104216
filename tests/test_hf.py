"""Hugging Face models in the harness (the `[hf]` extra), written by the tests with `save_pretrained` beside
tokenizers the tests build (no hub): a tiny Llama for `lm`, a T5 for `translation`, an ESM-2-style encoder for
`protein`. For each, 2 processes under ZeRO-2 or ZeRO-3 (built already partitioned), stopped and resumed, give the
per-step losses of 1 process; the run's HF-format export loads with `transformers` alone and gives the engine's
outputs; `harness export --hf` writes the same for a finished run."""
from __future__ import annotations

import json
import math
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


def split_then_resume(out, data: str, *, ds: str, env: dict, sets: list[str]):
    """2 processes: stopped after step 3, then resumed to the end."""
    harness(out, data, nproc=2, ds=ds, env=env, sets=sets, args=["--stop-at", "3"], base=TINY_RUN)
    return harness(out, data, nproc=2, ds=ds, env=env, sets=sets, args=["--resume", "auto"], base=TINY_RUN)


def test_hf_causal_lm_matches_one_process_under_zero2_resumed_and_partitioned_zero3(cached_run, tiny_llama, corpus,
                                                                                    tmp_path):
    ref = cached_run("hf-ref", sets=hf_sets(tiny_llama), base=TINY_RUN)
    assert "task lm, LlamaForCausalLM of" in ref.proc.stdout
    # Llama's mask code reads values (.item()), which a meta-device forward cannot: the 6N fallback, said so
    assert ref.metrics[0]["flops_method"] == "6N per item"
    assert ref.losses[6] < ref.losses[1]
    two2 = split_then_resume(tmp_path / "zero2", str(corpus), ds="zero2.json", env={},
                             sets=[*hf_sets(tiny_llama), "train.micro_batch_size=2"])  # resumed after step 3
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


# --- translation with a sequence-to-sequence model, protein with an ESM-style encoder --------------------------------

@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory):
    """The toy English-"French" pairs and a 2+2-layer T5 with a word-level tokenizer trained on both sides."""
    import gzip

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from test_translation import write_toy_dir

    root = tmp_path_factory.mktemp("t5")
    toy = write_toy_dir(root / "toy")
    text = root / "both.txt"
    text.write_text("".join(gzip.open(toy / f"train.{lang}.gz", "rt").read() for lang in ("en", "fr")))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(text)], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[EOS]", "[UNK]"]))  # T5's 0, 1, 2
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")
    config = transformers.T5Config(vocab_size=len(fast), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0, pad_token_id=0,
                                   eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(0)
    out = root / "tiny-t5"
    transformers.T5ForConditionalGeneration(config).save_pretrained(out)
    fast.save_pretrained(out)
    return toy, out


ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO.-", "<null_1>", "<mask>"]  # ESM-2's 33


@pytest.fixture(scope="session")
def tiny_esm(tmp_path_factory):
    """A 2-layer ESM-2-style masked LM with ESM-2's vocabulary."""
    import torch

    out = tmp_path_factory.mktemp("esm") / "tiny-esm"
    out.mkdir()
    (out / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    tok = transformers.EsmTokenizer(str(out / "vocab.txt"))
    config = transformers.EsmConfig(vocab_size=len(ESM_VOCAB), hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=260,
                                    position_embedding_type="rotary", hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, pad_token_id=1, mask_token_id=32)
    torch.manual_seed(0)
    transformers.EsmForMaskedLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def test_hf_seq2seq_translates_under_partitioned_zero3_resumes_exactly_and_exports(tiny_t5, tmp_path):
    import torch

    toy, model_dir = tiny_t5
    env = {"HARNESS_CACHE": str(tmp_path / "cache")}
    sets = ['run.task="translation"', 'translation.target_lang="fr"', f"model.hf={json.dumps(str(model_dir))}",
            "translation.eval_max_sentences=12", "translation.beam_size=2"]
    ref = harness(tmp_path / "ref", str(toy), env=env, sets=sets, base=TINY_RUN)
    assert "T5ForConditionalGeneration of" in ref.proc.stdout and ref.losses[6] < ref.losses[1]
    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    run = split_then_resume(tmp_path / "zero3", str(toy), ds=ds3, env=env, sets=[*sets, "train.micro_batch_size=2"])
    assert "built partitioned over the ranks (ZeRO-3" in run.proc.stdout
    assert_losses_close(run.losses, ref.losses, FP32_TOL)
    # `generate` under ZeRO-3 on 2 ranks (ranks in step) scores what the export scores in 1 process
    final = run.evals[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", env["HARNESS_CACHE"])
        from harness.export import load_model
        from harness.tasks.translation import TranslationTask
        from harness.world import single_world

        ours, cfg = load_model(run.dir)
        alone = TranslationTask().evaluate(ours, cfg, "validation", single_world(), max_sentences=12)
    assert final["sentences"] == alone["sentences"] == 12
    assert final["bleu"] == pytest.approx(alone["bleu"], abs=1e-6) and final["nll"] == pytest.approx(alone["nll"], rel=1e-4)
    theirs = transformers.AutoModelForSeq2SeqLM.from_pretrained(run.dir / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(run.dir / "hf")
    src = torch.tensor([tok("the big cat sees a dog .")["input_ids"]])
    tgt = torch.tensor([[0, *tok("le chat", add_special_tokens=False)["input_ids"]]])
    with torch.no_grad():
        assert torch.allclose(ours(src, src != 0, tgt).logits, theirs(input_ids=src, decoder_input_ids=tgt).logits,
                              atol=1e-6)


def test_hf_esm_classifies_proteins_under_zero2_and_partitioned_zero3_resumes_exactly_and_exports(tiny_esm, tmp_path):
    import torch

    env = {"HARNESS_CACHE": str(tmp_path / "cache")}
    sets = ['run.task="protein"', f"model.hf={json.dumps(str(tiny_esm))}", "data.seq_len=64"]
    ref = harness(tmp_path / "ref", "", env=env, sets=sets, base=TINY_RUN)
    assert "EsmForSequenceClassification of" in ref.proc.stdout
    assert {"accuracy", "auroc"} <= ref.evals[-1].keys() and ref.evals[-1]["sequences"] > 0
    two2 = split_then_resume(tmp_path / "zero2", "", ds="zero2.json", env=env,
                             sets=[*sets, "train.micro_batch_size=2"])
    assert_losses_close(two2.losses, ref.losses, FP32_TOL)
    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    two3 = harness(tmp_path / "zero3", "", nproc=2, ds=ds3, env=env, sets=[*sets, "train.micro_batch_size=2"],
                   base=TINY_RUN)
    assert_losses_close(two3.losses, ref.losses, FP32_TOL)
    assert two3.evals[-1]["accuracy"] == pytest.approx(ref.evals[-1]["accuracy"])
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(two3.dir / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(two3.dir / "hf")
    ids = torch.tensor([tok("MKTAYIAKQR")["input_ids"]])  # <cls> residues <eos>, as the harness feeds them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", env["HARNESS_CACHE"])
        from harness.export import load_model

        ours, _ = load_model(two3.dir)
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-6)


def test_hf_protein_objectives_take_the_encoder_their_auto_class_and_its_token_ids(tiny_esm, tmp_path, monkeypatch):
    """mlm and per-residue heads on the same encoder; the samples carry ESM's ids (<cls> residues <eos>), masks
    with its <mask>, and pad with its <pad> (id 1, not the harness's 0)."""
    from harness.config import resolve
    from harness.tasks.protein import IGNORE, ProteinTask

    from test_protein import write_flip

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    tok = transformers.AutoTokenizer.from_pretrained(tiny_esm)
    flip = json.dumps(str(write_flip(tmp_path / "flip")))
    for objective, path, cls_name in (("mlm", '""', "EsmForMaskedLM"), ("residue", flip, "EsmForTokenClassification")):
        cfg = resolve(None, ['run.task="protein"', f'protein.objective="{objective}"', "data.seq_len=64",
                             f"data.path={path}", f"model.hf={json.dumps(str(tiny_esm))}", "train.max_steps=1"]).cfg
        task = ProteinTask()
        task.check(cfg)
        model = task.build_model(cfg)
        assert type(model).__name__ == cls_name
        data = task.build_data(cfg)
        sample = data.train[0]
        ids, targets = sample["ids"], sample["targets"]
        assert ids[0] == tok.cls_token_id and ids[-1] == tok.eos_token_id and targets[0] == targets[-1] == IGNORE
        chosen = targets != IGNORE
        if objective == "mlm":
            assert (ids[chosen] == tok.mask_token_id).any() or len(ids) < 12  # 80% of the chosen become <mask>
            assert set(tok.convert_ids_to_tokens(targets[chosen].tolist())) <= set("ACDEFGHIKLMNPQRSTVWY")
        else:
            assert model.config.num_labels == 3 and targets[1:-1].tolist() == [IGNORE, 0, 1, 1, 1, 2, 2, 0, IGNORE]
            assert tok.convert_ids_to_tokens(ids[1:-1].tolist()) == list("ACDEFGHIK")
        batch = task.collate([data.train[0], data.train[1]])
        assert batch["ids"][~batch["mask"]].eq(tok.pad_token_id).all() and not batch["mask"].all()
        n_out = len(tok) if objective == "mlm" else 3
        loss = task.loss(model, batch) / task.count(batch)
        assert abs(loss.item() - math.log(n_out)) < 1.0  # about uniform at initialisation


def test_hf_models_go_only_where_they_fit(tiny_llama, tmp_path, monkeypatch):
    from harness.config import ConfigError, resolve
    from harness.tasks import get_task

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    llama = f"model.hf={json.dumps(str(tiny_llama))}"
    for task, message in [("prices", "the prices task trains its own patch Transformer"),
                          ("translation", "its config has no decoder_start_token_id"),
                          ("protein", "its tokenizer has no cls_token; the protein task needs cls_token, pad_token")]:
        cfg = resolve(None, [f'run.task="{task}"', llama, "train.max_steps=1"]).cfg
        with pytest.raises(ConfigError, match=message):
            get_task(task).check(cfg)
