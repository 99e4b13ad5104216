"""Hugging Face models for the case studies: a T5 for `translation` and an ESM-2-style encoder for `protein`, written
by the tests with tokenizers they build (no hub; the Llama and the common checks are in test_hf.py). 2 processes
under ZeRO-3, built already partitioned, stopped after step 3 and resumed, give the per-step losses of 1 process;
T5's beam search under ZeRO-3 scores what its export scores on 1 process; each export loads with `transformers`
alone and gives the engine's outputs."""
from __future__ import annotations

import json
import math
import shutil

import pytest
import torch

from conftest import TINY_RUN, assert_losses_close, ds_variant, harness

transformers = pytest.importorskip("transformers")

FP32_TOL = 1e-5


def split_then_resume(out, data: str, *, ds: str, env: dict, sets: list[str]):
    """2 processes: stopped after step 3, then resumed to the end."""
    harness(out, data, nproc=2, ds=ds, env=env, sets=sets, args=["--stop-at", "3"], base=TINY_RUN)
    return harness(out, data, nproc=2, ds=ds, env=env, sets=sets, args=["--resume", "auto"], base=TINY_RUN)



def test_hf_seq2seq_translates_under_partitioned_zero3_resumes_exactly_and_exports(tiny_t5, tmp_path):
    toy, model_dir = tiny_t5
    env = {"HARNESS_CACHE": str(tmp_path / "cache")}
    sets = ['run.task="translation"', 'translation.target_lang="fr"', f"model.hf={json.dumps(str(model_dir))}",
            "translation.eval_max_sentences=12", "translation.beam_size=2"]
    ref = harness(tmp_path / "ref", str(toy), env=env, sets=sets, base=TINY_RUN)
    assert "T5ForConditionalGeneration of" in ref.proc.stdout and ref.losses[6] < ref.losses[1]
    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    run = split_then_resume(tmp_path / "zero3", str(toy), ds=ds3, env=env, sets=[*sets, "train.micro_batch_size=2"])
    said = [line for line in run.proc.stdout.splitlines() if "built partitioned over the ranks (ZeRO-3" in line]
    # tied embeddings (shared, encoder, decoder, lm_head: one tensor) read once by each rank, its share
    assert said and said[0].endswith("; weights: each rank read its own share of 1 safetensors file(s)"), said
    assert_losses_close(run.losses, ref.losses, FP32_TOL)
    # `generate` under ZeRO-3 on 2 ranks (ranks in step) scores what the export scores in 1 process
    final = run.evals[-1]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", env["HARNESS_CACHE"])
        from harness.run.export import load_model
        from harness.tasks.translation import TranslationTask
        from harness.distributed.world import single_world

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
    # the export's generation_config decodes as the run's evaluation did: its beam and length penalty (transformers'
    # generate() on it had been greedy)
    from harness.models.decoding import _strip, hf_generate

    gen = theirs.generation_config
    assert (gen.num_beams, gen.length_penalty, gen.do_sample) == (2, cfg.task.length_penalty, False)
    with torch.no_grad():
        said = hf_generate(ours, src, bos=theirs.config.decoder_start_token_id, eos=tok.eos_token_id,
                           pad=tok.pad_token_id, max_len=8, beam_size=2, length_penalty=cfg.task.length_penalty)
        plain = theirs.generate(src, max_new_tokens=8)[0, 1:].tolist()
    assert _strip(plain, tok.eos_token_id, tok.pad_token_id) == said[0]


def test_hf_esm_classifies_proteins_under_partitioned_zero3_resumes_exactly_and_exports(tiny_esm, tmp_path):
    env = {"HARNESS_CACHE": str(tmp_path / "cache")}
    sets = ['run.task="protein"', f"model.hf={json.dumps(str(tiny_esm))}", "data.seq_len=64"]
    ref = harness(tmp_path / "ref", "", env=env, sets=sets, base=TINY_RUN)
    assert "EsmForSequenceClassification of" in ref.proc.stdout
    assert {"accuracy", "auroc"} <= ref.evals[-1].keys() and ref.evals[-1]["sequences"] > 0
    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    two3 = split_then_resume(tmp_path / "zero3", "", ds=ds3, env=env, sets=[*sets, "train.micro_batch_size=2"])
    assert "built partitioned over the ranks (ZeRO-3" in two3.proc.stdout  # its new head initialised as in 1
    # a masked-LM checkpoint under a classifier: names the partitioned loader cannot place, left to transformers
    said = [line for line in two3.proc.stdout.splitlines() if "built partitioned" in line]
    assert said and "; weights: transformers' loader (rank 0 reads the whole checkpoint): the checkpoint's " in said[0]
    assert_losses_close(two3.losses, ref.losses, FP32_TOL)
    assert two3.evals[-1]["accuracy"] == pytest.approx(ref.evals[-1]["accuracy"])
    theirs = transformers.AutoModelForSequenceClassification.from_pretrained(two3.dir / "hf").eval()
    classes = json.loads((two3.dir / "data" / "meta.json").read_text())["classes"]
    assert theirs.config.id2label == {i: str(c) for i, c in enumerate(classes)}  # pipeline() prints real labels
    assert "LABEL_0" not in theirs.config.id2label.values()
    tok = transformers.AutoTokenizer.from_pretrained(two3.dir / "hf")
    ids = torch.tensor([tok("MKTAYIAKQR")["input_ids"]])  # <cls> residues <eos>, as the harness feeds them
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HARNESS_CACHE", env["HARNESS_CACHE"])
        from harness.run.export import load_model

        ours, _ = load_model(two3.dir)
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-6)


def test_hf_protein_objectives_take_the_encoder_their_auto_class_and_its_token_ids(tiny_esm, tmp_path, monkeypatch):
    """mlm and per-residue heads on the same encoder; the samples carry ESM's ids (<cls> residues <eos>), masks
    with its <mask>, and pad with its <pad> (id 1, not the harness's 0)."""
    from harness.tasks import resolve
    from harness.tasks.protein import ProteinTask
    from harness.tasks.protein_samples import IGNORE

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
    # regress: the sequence-classification class with one output, on z-scored values
    from harness.config.run import ConfigError

    from test_protein import write_fitness

    sets = ['run.task="protein"', 'protein.objective="regress"', "data.seq_len=64", "train.max_steps=1",
            f"data.path={json.dumps(str(write_fitness(tmp_path / 'fitness.csv', n=40)))}",
            f"model.hf={json.dumps(str(tiny_esm))}"]
    cfg, task = resolve(None, sets).cfg, ProteinTask()
    task.check(cfg)
    model = task.build_model(cfg)
    assert type(model).__name__ == "EsmForSequenceClassification" and model.config.num_labels == 1
    from harness.prepare import read_meta
    from harness.tasks.protein_samples import scale

    model.config.save_pretrained(tmp_path / "regress")  # what the export's config.json says of its outputs
    saved = json.loads((tmp_path / "regress" / "config.json").read_text())
    assert saved["problem_type"] == "regression" and saved["harness_target_scale"] == dict(
        zip(("mean", "std"), scale(read_meta(task.prepare(cfg)))))
    data = task.build_data(cfg)
    batch = task.collate([data.train[0], data.train[1]])
    assert batch["values"].dtype == torch.float32 and task.count(batch) == 2
    assert torch.isfinite(task.loss(model, batch))
    with pytest.raises(ConfigError, match="protein.pooling = 'attention' is for the built-in encoder"):
        task.check(resolve(None, [*sets, 'protein.pooling="attention"']).cfg)


def test_hf_protein_positions_count_its_cls_and_eos_and_a_table_counted_from_padding_idx(tiny_esm, tmp_path):
    """An ESM with a table of 66 absolute positions counts them from padding_idx + 1 = 2, and a protein sample is
    <cls> residues <eos>: 62 residues fit and 63 do not, which the check says before launch (it compared data.seq_len
    with 66, and the first step failed in the embedding: "index out of range", BERT's "The expanded size ...")."""
    from harness.config.run import ConfigError
    from harness.tasks import resolve
    from harness.tasks.protein import ProteinTask

    absolute = tmp_path / "esm-absolute"
    shutil.copytree(tiny_esm, absolute)
    config = json.loads((absolute / "config.json").read_text())
    (absolute / "config.json").write_text(json.dumps({**config, "position_embedding_type": "absolute",
                                                      "max_position_embeddings": 66}))
    (absolute / "model.safetensors").unlink()

    def cfg(seq_len: int):
        return resolve(None, ['run.task="protein"', "data.seq_len=%d" % seq_len, "train.max_steps=1",
                              f"model.hf={json.dumps(str(absolute / 'config.json'))}"]).cfg

    ProteinTask().check(cfg(62))
    with pytest.raises(ConfigError, match=r"data.seq_len = 63 and the task's 2 token\(s\) around it take 65 "
                                          r"positions; .* has 64: max_position_embeddings = 66 .*counted from "
                                          r"padding_idx \+ 1 = 2\); set data.seq_len <= 62"):
        ProteinTask().check(cfg(63))
    model = transformers.EsmForSequenceClassification(transformers.EsmConfig.from_pretrained(absolute)).eval()
    with torch.no_grad():
        model(torch.full((1, 64), 5))  # <cls>, 62 residues, <eos>
        with pytest.raises(IndexError, match="index out of range"):
            model(torch.full((1, 65), 5))


def test_hf_model_from_its_config_on_the_tasks_own_tokenizer(tiny_llama, tiny_t5, tiny_esm, corpus, tmp_path,
                                                             monkeypatch):
    """`model.hf_tokenizer = false`: a model from its config.json trains on the task's own ids (bytes, SentencePiece,
    residues), its vocabulary and special ids set to theirs; pretrained weights are refused."""
    from harness.config.run import ConfigError
    from harness.tasks import resolve
    from harness.prepare import read_meta
    from harness.prepare import protein as pprep
    from harness.prepare import translation as tprep
    from harness.tasks import get_task
    from harness.distributed.world import single_world

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    toy, t5 = tiny_t5
    cases = [("lm", tiny_llama, str(corpus), []),
             ("translation", t5, str(toy), ['translation.target_lang="fr"', "translation.beam_size=2"]),
             ("protein", tiny_esm, "", [])]
    for name, model_dir, data, sets in cases:
        cfg = resolve(None, [f'run.task="{name}"', f"model.hf={json.dumps(str(model_dir / 'config.json'))}",
                             "model.hf_tokenizer=false", "data.seq_len=32", f"data.path={json.dumps(data)}",
                             "train.max_steps=1", *sets]).cfg
        task = get_task(name)
        task.check(cfg)
        model = task.build_model(cfg)
        data_ = task.build_data(cfg)
        batch = task.collate([data_.train[0], data_.train[1]])
        with torch.no_grad():
            loss = (task.loss(model, batch) / task.count(batch)).item()
        vocab = model.config.vocab_size
        if name == "lm":
            assert vocab == 256 and batch["inputs"].max() < 256 and "bits_per_byte" in task.metrics(loss)
        elif name == "translation":
            directory = task.prepare(cfg)
            assert (directory / "spm.model").is_file() and vocab == tprep.vocab_size(directory)
            assert model.config.decoder_start_token_id == 2 and batch["tgt_in"][:, 0].eq(2).all()
            scores = task.evaluate(model, cfg, "validation", single_world(), max_sentences=4)
            assert scores["sentences"] == 4 and math.isfinite(scores["nll"])
        else:
            directory = task.prepare(cfg)
            assert vocab == read_meta(directory)["vocab_size"] and model.config.pad_token_id == 0
            assert batch["ids"][:, 0].eq(pprep.tokenizer(directory).piece_id("<cls>")).all()  # no <eos> added
            assert batch["ids"][~batch["mask"]].eq(0).all()  # the harness's padding id
        assert abs(loss - math.log(vocab if name != "protein" else 2)) < 1.5, (name, loss)
        assert task.tokenizer(cfg) is None  # the export has the model; the task's tokenizer stays with its data
    for sets, message in [([f"model.hf={json.dumps(str(tiny_llama))}", "model.hf_tokenizer=false"],
                           "pretrained weights know only their own tokenizer"),
                          (["model.hf_tokenizer=false"], "applies to a Hugging Face model")]:
        with pytest.raises(ConfigError, match=message):
            get_task("lm").check(resolve(None, ["train.max_steps=1", *sets]).cfg)
