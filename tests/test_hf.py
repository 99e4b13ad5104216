"""Hugging Face models in the harness (the `[hf]` extra), written by the tests with `save_pretrained` beside
tokenizers the tests build (no hub): a tiny Llama for `lm`, a T5 for `translation`, an ESM-2-style encoder for
`protein` (those two in test_hf_tasks.py). For each, 2 processes under ZeRO-3 (built already partitioned; the Llama
under ZeRO-2 too) give the per-step losses of 1 process, also when stopped and resumed; the run's HF-format export
loads with `transformers` alone and gives the engine's outputs; `harness export --hf` writes the same for a finished
run."""
from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest
import torch
from conftest import ROOT, TINY_RUN, _env, assert_losses_close, cli, ds_variant, harness, python

transformers = pytest.importorskip("transformers")

FP32_TOL = 1e-5


def hf_sets(model_dir) -> list[str]:
    return [f"model.hf={json.dumps(str(model_dir))}", "data.seq_len=16"]


def test_hf_causal_lm_matches_one_process_under_zero2_resumed_and_partitioned_zero3(cached_run, tiny_llama, corpus,
                                                                                    tiny_llama_shards, tmp_path):
    ref = cached_run("hf-ref", sets=hf_sets(tiny_llama), base=TINY_RUN)
    assert "task lm, LlamaForCausalLM of" in ref.proc.stdout
    # Llama's mask code reads values (.item()), which a meta-device forward cannot: counted from its config
    assert ref.metrics[0]["flops_method"] == "analytic (Hugging Face config)"
    assert "(FLOPs: analytic (Hugging Face config))" in ref.proc.stdout
    assert ref.losses[6] < ref.losses[1]
    zero2 = {"nproc": 2, "ds": "zero2.json", "sets": [*hf_sets(tiny_llama), "train.micro_batch_size=2"], "base": TINY_RUN}
    harness(tmp_path / "zero2", corpus, args=["--stop-at", "3"], **zero2)  # ZeRO-2 resumes exactly
    two2 = harness(tmp_path / "zero2", corpus, args=["--resume", "auto"], **zero2)
    assert "resumed from" in two2.proc.stdout
    assert_losses_close(two2.losses, ref.losses, FP32_TOL)
    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    # the same weights in shards, each rank reading its own share of each (distributed/zero3.py): the losses of 1 process
    # that read them whole through transformers
    shards = len(list(tiny_llama_shards.glob("model-*.safetensors")))
    two3 = cached_run("hf-zero3-2p", nproc=2, ds=ds3, sets=[*hf_sets(tiny_llama_shards), "train.micro_batch_size=2"],
                      base=TINY_RUN)
    assert shards > 2 and "built partitioned over the ranks (ZeRO-3: deepspeed.zero.Init through transformers' " \
        f"HfDeepSpeedConfig); weights: each rank read its own share of {shards} safetensors file(s)" in two3.proc.stdout
    assert_losses_close(two3.losses, ref.losses, FP32_TOL)
    built = two3.metrics[-1]
    assert len(built["build_peak_bytes"]) == 2 and all(b >= 0 for b in built["build_peak_bytes"])
    assert built["build_peak_device_bytes"] == [None, None] and "model built: at its peak it took" in two3.proc.stdout


def test_an_lm_resumed_on_windows_of_another_length_is_refused_unless_meant(tiny_llama, corpus, tmp_path):
    """A rotary model takes any data.seq_len, and the checkpoint's place in the data counts windows: resumed on
    windows of another length it had read text again (its epoch went backwards), with only the config's note."""
    harness(tmp_path / "run", corpus, sets=hf_sets(tiny_llama), base=TINY_RUN, args=["--stop-at", "2"])
    longer = [*hf_sets(tiny_llama), "data.seq_len=32"]
    refused = harness(tmp_path / "run", corpus, sets=longer, base=TINY_RUN, args=["--resume", "auto"], check=False)
    assert refused.proc.returncode == 2 and refused.proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: --resume {tmp_path / 'run' / 'checkpoints' / 'step_00000002'}: trained on windows of 17 "
        f"tokens (data.seq_len 16), now 33 (data.seq_len 32): its place in the data, a count of windows, falls "
        f"elsewhere in the text, which would be read twice or skipped; pass --data-changed-ok to resume anyway")
    meant = harness(tmp_path / "run", corpus, sets=longer, base=TINY_RUN,
                    args=["--resume", "auto", "--data-changed-ok"])
    assert "resumed from" in meant.proc.stdout


def test_an_export_that_fails_for_another_reason_than_a_full_disk_is_not_said_to_be_one(tiny_llama, corpus, tmp_path):
    """Any error writing the export had been said to be a full disk ("N GiB free there ... make room")."""
    harness(tmp_path / "run", corpus, sets=hf_sets(tiny_llama), base=TINY_RUN, args=["--stop-at", "2"])
    (tmp_path / "run" / "hf").write_text("a file where the export's folder goes")
    failed = harness(tmp_path / "run", corpus, sets=hf_sets(tiny_llama), base=TINY_RUN, args=["--resume", "auto"],
                     check=False)
    line = failed.proc.stderr.strip().splitlines()[-1]
    assert failed.proc.returncode == 3 and line.startswith("harness: error: the model could not be exported to "), line
    assert "free there" not in line and line.endswith("The last checkpoint is kept: once that is put right, run the "
                                                      "same command with --resume auto, which exports it"), line


def test_hf_export_loads_with_transformers_alone_and_matches(cached_run, tiny_llama_shards, tmp_path):
    import torch

    ds3 = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    run = cached_run("hf-zero3-2p", nproc=2, ds=ds3, sets=[*hf_sets(tiny_llama_shards), "train.micro_batch_size=2"],
                     base=TINY_RUN)
    from harness.run.export import load_model

    ours, _ = load_model(run.dir)
    theirs = transformers.AutoModelForCausalLM.from_pretrained(run.dir / "hf").eval()
    tok = transformers.AutoTokenizer.from_pretrained(run.dir / "hf")
    ids = torch.tensor([tok("the model trains on many small batches")["input_ids"]])
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-6)
    out = tmp_path / "again"
    proc = cli("export", "--run-dir", str(run.dir), "--hf", str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, theirs(ids).logits)
    assert transformers.AutoTokenizer.from_pretrained(out)("the model")["input_ids"] == tok("the model")["input_ids"]
    # into a directory that holds files: refused (a stale tokenizer file there changed what from_pretrained loads),
    # replaced with --overwrite where it is a model's, left as it is where it is not
    from harness.config.run import ConfigError
    from harness.run.export import export_hf

    (out / "added_tokens.json").write_text('{"<zzz>": 999}')
    with pytest.raises(ConfigError, match="holds added_tokens.json, config.json, .*files of an earlier export would "
                                          "stay beside the new ones"):
        export_hf(run.dir, out)
    assert export_hf(run.dir, out, overwrite=True) == out and not (out / "added_tokens.json").exists()
    assert transformers.AutoTokenizer.from_pretrained(out)("the model")["input_ids"] == tok("the model")["input_ids"]
    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "todo.txt").write_text("x")
    with pytest.raises(ConfigError, match="replaces a Hugging Face model's directory .*: it was left as it is"):
        export_hf(run.dir, notes, overwrite=True)
    assert [p.name for p in notes.iterdir()] == ["todo.txt"]
    own = sorted(p.name for p in (run.dir / "hf").iterdir())  # what the run reads its config and tokenizer from: it
    with pytest.raises(ConfigError, match="the run's own export, which the run reads"):  # was emptied, then the
        export_hf(run.dir, run.dir / "hf", overwrite=True)                             # tokenizer was read from it
    assert sorted(p.name for p in (run.dir / "hf").iterdir()) == own
    (tmp_path / "shared").mkdir()  # a link to a directory (a mount, the cwd) is written into, not replaced
    (tmp_path / "link").symlink_to(tmp_path / "shared")
    export_hf(run.dir, tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and (tmp_path / "shared" / "config.json").is_file()
    # the source's use_cache (true), not the training's override (false: generate() would run without a KV cache)
    for exported in (run.dir / "hf", out):
        assert json.loads((exported / "config.json").read_text())["use_cache"] is True
    assert theirs.config.use_cache is True and ours.config.use_cache is False  # (the live model keeps training's)
    # a shard its index names is missing: one line before launch (a safetensors traceback on every rank)
    gone = tmp_path / "gone"
    shutil.copytree(tiny_llama_shards, gone)
    next(gone.glob("model-*.safetensors")).unlink()
    bad = cli("plan", "--set", f"model.hf={json.dumps(str(gone))}", "--set", "train.max_steps=1")
    assert bad.returncode == 2 and "of the shards its model.safetensors.index.json names are missing" in bad.stderr, \
        bad.stderr[-2000:]


def test_activation_checkpointing_recomputes_a_hugging_face_model_s_layers(tiny_llama):
    """train.activation_checkpointing wrapped the harness's own blocks alone: a Hugging Face model trained with every
    activation kept, and nothing said so. Its layers now recompute (the same gradients); a model with nothing to
    recompute is refused."""
    from harness.config.run import ConfigError
    from harness.distributed.parallel import checkpoint_blocks

    ids = torch.tensor([[5, 6, 7, 8, 9, 10]])
    grads = []
    for recompute in (False, True):
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama).train()
        if recompute:
            checkpoint_blocks(model)
            assert model.is_activation_checkpointing
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6)
    wrapped = torch.nn.ModuleDict({"backbone": transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)})
    checkpoint_blocks(wrapped)  # a plug-in's model around a Hugging Face backbone: the backbone's layers
    assert wrapped["backbone"].is_activation_checkpointing
    with pytest.raises(ConfigError, match="Sequential has nothing to recompute"):
        checkpoint_blocks(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_an_export_of_a_16_bit_module_says_the_dtype_of_the_weights_it_wrote(tiny_llama, tmp_path):
    """A bf16 run's module is 16-bit, its export the fp32 masters: config.json said bfloat16 (save_pretrained reads
    the module), so from_pretrained, and the harness's own load_model, loaded the fp32 weights as bf16."""
    from harness.models import hf

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_llama)
    state = {k: v.float().clone() for k, v in model.state_dict().items()}
    hf.save(model.to(torch.bfloat16), state, None, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "float32"
    assert next(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").parameters()).dtype == torch.float32


def test_hf_model_from_a_config_json_alone_and_bad_references(tiny_llama, tiny_llama_shards, tmp_path):
    from harness.config.run import ConfigError
    from harness.tasks import get_task, resolve

    task = get_task("lm")
    cfg = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama / 'config.json'))}"]).cfg
    task.check(cfg)
    assert type(task.build_model(cfg)).__name__ == "LlamaForCausalLM"  # random init from the config
    named = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama / 'config.json'))}",
                           'model.hf_class="LlamaForCausalLM"']).cfg  # a model class itself, not an auto class
    assert type(task.build_model(named)).__name__ == "LlamaForCausalLM"
    broken = tmp_path / "broken"  # a checkpoint copied in part: a shard cut short, or the index of shards left out
    shutil.copytree(tiny_llama, broken)
    (broken / "model.safetensors").write_bytes((broken / "model.safetensors").read_bytes()[:10])
    unindexed = tmp_path / "unindexed"
    shutil.copytree(tiny_llama_shards, unindexed)
    (unindexed / "model.safetensors.index.json").unlink()
    ids = tmp_path / "ids"  # a config.json whose pad id is past a vocabulary made smaller
    ids.mkdir()
    config = json.loads((tiny_llama / "config.json").read_text())
    (ids / "config.json").write_text(json.dumps({**config, "vocab_size": 1}))
    coded = tmp_path / "coded"  # code of its own for the auto class beside a library model_type (an export keeps
    shutil.copytree(tiny_llama, coded)  # auto_map without the code: the library's class, as transformers builds it)
    (coded / "config.json").write_text(json.dumps({**config, "auto_map": {"AutoModelForCausalLM": "mine.MyLlama"}}))
    exported = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(coded / 'config.json'))}"]).cfg
    task.check(exported)
    assert type(task.build_model(exported)).__name__ == "LlamaForCausalLM"
    (coded / "mine.py").write_text("raise SystemExit('code of its own ran')\n")
    for ref, message in [(str(tmp_path / "none.json"), "no such file"), ("./no/such/dir", "no such directory"),
                         (str(coded / "config.json"), "its config names code of its own for AutoModelForCausalLM "
                                                      "(mine.MyLlama, in mine.py beside it), which runs when"),
                         ("tests/no/tiny-lama", "no such directory"),  # past OWNER/NAME: a path, not a hub id
                         (str(tiny_llama.parent / "tiny-lama"), f"did you mean {str(tiny_llama)!r}"),
                         (str(broken), "model.safetensors does not read as safetensors ("),
                         (str(unindexed), "but not the index that names them (model.safetensors.index.json)"),
                         (str(ids / "config.json"), "gives pad_token_id = 1, past vocab_size = 1, the size of the "
                                                     "embedding table it indexes")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            task.check(resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(ref)}"]).cfg)
    with pytest.raises(ConfigError, match=re.escape("model.hf_class = 'PreTrainedModel' builds no models; ")):
        task.check(resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                                  'model.hf_class="PreTrainedModel"']).cfg)
    with pytest.raises(ConfigError, match=re.escape("model.hf_class = 'BertLMHeadModel' builds BertConfig models; ")):
        task.check(resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                                  'model.hf_class="BertLMHeadModel"']).cfg)
    with pytest.raises(ConfigError, match="model.d_model = 64 .* belongs to the built-in model"):
        resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}", "model.d_model=64"])
    contradicted = tmp_path / "contradicted"  # a config.json edited apart from its weights: refused before launch
    shutil.copytree(tiny_llama, contradicted)
    config = json.loads((contradicted / "config.json").read_text())
    (contradicted / "config.json").write_text(json.dumps({**config, "intermediate_size": 96}))
    with pytest.raises(ConfigError, match=r"6 of its weights do not fit .*\(e\.g\. model\.layers\.0\.mlp\.down_proj\."
                                          r"weight: \[32, 64\] in model\.safetensors, \[32, 96\] by config\.json\)"):
        task.check(resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(contradicted))}"]).cfg)


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
    from harness.run.export import load_model

    ours, _ = load_model(tp.dir)
    with torch.no_grad():
        assert torch.allclose(ours(ids).logits, theirs(ids).logits, atol=1e-6)


def test_hf_tensor_parallel_sizes_are_checked_before_launch_and_an_odd_vocabulary_is_not_refused(tiny_llama):
    from harness.config.run import ConfigError
    from harness.plan.resolve import check_hf_tensor_parallel
    from harness.tasks import resolve

    run = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}"])
    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    assert config.vocab_size % 2 == 1  # split 2 ways unevenly: the AutoTP test above trains and exports it
    check_hf_tensor_parallel(run, 2, config)
    for key, value, message in [("intermediate_size", 63, "must divide intermediate_size = 63"),
                                ("num_key_value_heads", 3, "must divide num_key_value_heads = 3"),
                                ("vocab_size", 1, "is more than vocab_size = 1")]:
        bad = transformers.AutoConfig.from_pretrained(tiny_llama, **{key: value})
        with pytest.raises(ConfigError, match=f"tensor_parallel.autotp_size = 2 {message} of model.hf = "):
            check_hf_tensor_parallel(run, 2, bad)
    # tied embeddings: AutoTP left each rank's logits a share of the vocabulary ("Target 304 is out of bounds" in
    # the loss, after launch); GPT-2: DeepSpeed's AutoTP refuses it by an assert on every rank
    tied = transformers.AutoConfig.from_pretrained(tiny_llama, tie_word_embeddings=True)
    with pytest.raises(ConfigError, match="ties its output layer to its input embeddings"):
        check_hf_tensor_parallel(run, 2, tied)
    with torch.device("meta"):  # a classifier has no output layer over the vocabulary: nothing tied (it was refused)
        classifier = transformers.AutoModelForSequenceClassification.from_config(tied)
    check_hf_tensor_parallel(run, 2, tied, classifier)
    with pytest.raises(ConfigError, match="DeepSpeed's AutoTP does not support 'gpt2' models"):
        check_hf_tensor_parallel(run, 2, transformers.GPT2Config(n_embd=32, n_head=4, n_inner=64))


def test_an_owner_name_hub_id_beside_a_folder_of_that_owner_is_still_looked_up(tmp_path):
    """OWNER/NAME is a hub id though a folder OWNER is here (a model downloaded beside it); not found there either,
    the line says so, with the folder meant."""
    (tmp_path / "owner" / "model-a").mkdir(parents=True)
    offline = _env({"PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"})
    proc = subprocess.run([python(), "-m", "harness", "plan", "--set", 'model.hf="owner/model-b"', "--set",
                           "train.max_steps=1"], cwd=tmp_path, env=offline, capture_output=True, text=True, timeout=120)
    last = proc.stderr.strip().splitlines()[-1]
    assert proc.returncode == 2 and last.startswith("harness: error: model.hf = 'owner/model-b': "), proc.stderr[-2000:]
    assert last.endswith("; no folder owner/model-b here either; did you mean 'owner/model-a'?"), last


def test_a_cached_hub_id_loads_from_its_snapshot_where_the_hub_does_not_answer(tiny_llama, tmp_path, corpus):
    """A node with no way to the Hub (nothing listens at HF_ENDPOINT here) reads a cached hub id from its snapshot,
    saying so: transformers had asked the Hub five times, with back-off, for every optional tokenizer file the
    snapshot lacks (minutes a load); `prepare lm --tokenizer` too. An id not cached is refused in one line."""
    repo = tmp_path / "hf" / "hub" / "models--harness-tests--tiny-llama"
    shutil.copytree(tiny_llama, repo / "snapshots" / ("0" * 40))
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for name in ("text.txt", "more.txt"):  # two units, for two workers
        (tmp_path / name).write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    env = _env({"PYTHONPATH": str(ROOT), "HF_HOME": str(tmp_path / "hf"), "HF_ENDPOINT": "http://127.0.0.1:9",
                "HF_HUB_OFFLINE": None})
    for args in (["plan", "--set", 'model.hf="harness-tests/tiny-llama"', "--set", "train.max_steps=1"],
                 ["prepare", "lm", "--input", "text.txt", "more.txt", "--out", "corpus", "--workers", "2",
                  "--tokenizer", "harness-tests/tiny-llama"]):
        proc = subprocess.run([python(), "-m", "harness", *args], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=120)  # (the Hub's retries: over two minutes)
        assert proc.returncode == 0 and "Retrying" not in proc.stderr, proc.stderr[-2000:]
        why = re.search(r"note: the Hugging Face Hub \(http://127.0.0.1:9\) does not answer from here \((.+?)\): ",
                        proc.stderr)
        assert why and proc.stderr.count("does not answer") == 1, proc.stderr[-2000:]  # (each worker had said it)
        why = why.group(1)
        assert f"'harness-tests/tiny-llama' is read from its snapshot in the cache, {repo}" in proc.stderr
    # trained by `harness launch` on 2 processes: each reads the snapshot, and the note is said once
    sets = [*TINY_RUN, "train.max_steps=2", f"data.path={json.dumps(str(corpus))}",
            f"run.output_dir={json.dumps(str(tmp_path / 'run'))}", 'model.hf="harness-tests/tiny-llama"']
    launch = ["launch", "--config_file", str(ROOT / "launch" / "cpu_2proc.yaml"), "train"]
    launched = subprocess.run([python(), "-m", "harness", *launch, *[a for kv in sets for a in ("--set", kv)]],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert launched.returncode == 0 and "Retrying" not in launched.stderr, launched.stderr[-2000:]
    assert (launched.stdout + launched.stderr).count("does not answer from here") == 1, launched.stderr[-2000:]
    proc = subprocess.run([python(), "-m", "harness", "plan", "--set", 'model.hf="harness-tests/absent"', "--set",
                           "train.max_steps=1"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Retrying" not in proc.stderr, proc.stderr[-2000:]  # (27 s of them)
    assert proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: model.hf = 'harness-tests/absent': the Hugging Face Hub (http://127.0.0.1:9) does not answer "
        f"from here ({why}), and its cache here ({tmp_path / 'hf' / 'hub'}) does not hold it (did you mean "
        f"'harness-tests/tiny-llama'?); download it where the "
        f"network allows (hf download harness-tests/absent) into the cache this machine reads, or name a local "
        f"directory")
    # HF_HUB_OFFLINE=1: an id the cache lacks, refused the same way (transformers' paragraph named no cache)
    proc = subprocess.run([python(), "-m", "harness", "plan", "--set", 'model.hf="harness-tests/tiny-lama"', "--set",
                           "train.max_steps=1"], cwd=tmp_path, env={**env, "HF_HUB_OFFLINE": "1"}, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
        f"harness: error: model.hf = 'harness-tests/tiny-lama': HF_HUB_OFFLINE=1, and its cache here "
        f"({tmp_path / 'hf' / 'hub'}) does not hold it (did you mean 'harness-tests/tiny-llama'?)"), proc.stderr[-2000:]


def test_the_lm_packing_with_a_hugging_face_tokenizer_is_found_in_the_cache_at_the_next_start(tiny_llama, corpus):
    """datasets finds a packing it made before by a hash of the function that made it: the tokenizer's function had
    hashed the harness's module (a ContextVar in it), so datasets drew a random hash, said so, and packed the rows
    again at every start, in a new cache file each time."""
    from harness.tasks import get_task, resolve

    cfg = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                         f"data.path={json.dumps(str(corpus))}"]).cfg
    first, again = (get_task("lm")._raw_data(cfg) for _ in range(2))
    assert first.train.cache_files and first.train.cache_files == again.train.cache_files


def test_hf_class_must_be_a_transformers_auto_class(tiny_llama):
    from harness.config.run import ConfigError
    from harness.tasks import get_task, resolve

    cfg = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                         'model.hf_class="AutoModelForNothing"']).cfg
    with pytest.raises(ConfigError, match="model.hf_class = 'AutoModelForNothing' is no transformers auto class"):
        get_task("lm").check(cfg)
    # a class of another kind than the task trains: one line (a classifier had stopped at step 1 in the loss)
    for name, gives in (("AutoModelForSequenceClassification", "LlamaForSequenceClassification"),
                        ("LlamaModel", "LlamaModel")):
        cfg = resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                             f'model.hf_class="{name}"']).cfg
        with pytest.raises(ConfigError, match=f"model.hf_class = '{name}' gives {gives}, and the lm task trains what "
                                              f"AutoModelForCausalLM gives for this config \\(LlamaForCausalLM\\)"):
            get_task("lm").check(cfg)
    for name in ("LlamaForCausalLM", "AutoModelForCausalLM"):  # its own kind, named either way
        get_task("lm").check(resolve(None, ["train.max_steps=1", f"model.hf={json.dumps(str(tiny_llama))}",
                                            f'model.hf_class="{name}"']).cfg)


def test_hf_models_go_only_where_they_fit(tiny_llama, tmp_path, monkeypatch):
    from harness.config.run import ConfigError
    from harness.tasks import get_task, resolve

    monkeypatch.setenv("HARNESS_CACHE", str(tmp_path / "cache"))
    llama = f"model.hf={json.dumps(str(tiny_llama))}"
    for task, message in [("prices", "the prices task trains its own patch Transformer"),
                          ("translation", "its config has no decoder_start_token_id"),
                          ("protein", "its tokenizer has no cls_token; the protein task needs cls_token, pad_token")]:
        cfg = resolve(None, [f'run.task="{task}"', llama, "train.max_steps=1"]).cfg
        with pytest.raises(ConfigError, match=message):
            get_task(task).check(cfg)


def test_a_rank_reads_exactly_its_flat_share_of_a_checkpoint_tensor(tmp_path):
    """The partitioned loader's reading (distributed/zero3.py `_flat_range`): any flat range of a stored tensor, from the
    rows that hold it, whatever the rows' boundaries."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from harness.distributed.zero3 import _flat_range

    tensors = {"matrix": torch.arange(15.0).reshape(5, 3), "cube": torch.arange(24.0).reshape(2, 3, 4),
               "vector": torch.arange(7.0), "scalar": torch.tensor(3.0)}
    save_file(tensors, tmp_path / "model.safetensors")
    with safe_open(str(tmp_path / "model.safetensors"), framework="pt") as f:
        for key, t in tensors.items():
            flat = t.reshape(-1)
            for start in range(flat.numel()):
                for end in range(start + 1, flat.numel() + 1):
                    assert torch.equal(_flat_range(f, key, start, end), flat[start:end]), (key, start, end)


def test_the_partitioned_loader_finds_a_hub_ids_weights_in_the_cache(tiny_llama_shards, tmp_path, monkeypatch):
    """A hub id's shards are read where from_pretrained keeps them, its snapshot in the Hugging Face cache (filled by
    hand here, offline); an id neither cached nor reachable is left to transformers' loader (which says why)."""
    from huggingface_hub import constants

    from harness.models.hf import weight_files

    snapshot = tmp_path / "models--harness-tests--tiny-llama" / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_llama_shards, snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0" * 40)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    shards = sorted(f.name for f in tiny_llama_shards.glob("model-*.safetensors"))
    assert len(shards) > 2 and sorted(f.name for f in weight_files(str(tiny_llama_shards))) == shards
    found = weight_files("harness-tests/tiny-llama")
    assert sorted(f.name for f in found) == shards and all(f.is_file() and snapshot in f.parents for f in found)
    assert weight_files("harness-tests/absent") == []


def test_the_partitioned_loader_builds_a_model_class_named_itself(tiny_llama):
    """model.hf_class naming a model class, not an auto class: the ZeRO-3 loader builds it as `build` does (it had
    called from_config, which only auto classes have), and reads the checkpoint's weights into it."""
    from harness.distributed.zero3 import load_partitioned

    config = transformers.AutoConfig.from_pretrained(tiny_llama)
    model, how = load_partitioned(transformers.LlamaForCausalLM, config, str(tiny_llama))
    assert type(model).__name__ == "LlamaForCausalLM" and "read its own share" in how
    whole = transformers.LlamaForCausalLM.from_pretrained(tiny_llama).state_dict()
    assert all(torch.equal(t, whole[k]) for k, t in model.state_dict().items())


@pytest.mark.parametrize("family", ["llama", "t5", "esm-mlm", "esm-classify", "esm-residue"])
def test_hugging_face_flops_are_counted_from_the_config_and_match_a_count_of_the_real_forward(family):
    """A Hugging Face model's FLOPs come from its config over the batch's real positions (transformers' forward
    reads values, so the meta-device count cannot run): exactly torch's FlopCounterMode over a real forward pass of
    a tiny Llama (grouped key/value heads), T5 (gated, more decoder than encoder layers) and ESM-2 under each head
    (eager attention, so that the counter sees its matrix multiplies too)."""
    from torch.utils.flop_counter import FlopCounterMode

    from harness.models.flops import ForwardFlops

    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    B, S, T = 3, 12, 9
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=100, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, attn_implementation="eager"))  # eager: its attention's matmuls are counted too
        inputs = (torch.randint(3, 100, (B, S)),)
    elif family == "t5":
        model = transformers.T5ForConditionalGeneration(transformers.T5Config(
            vocab_size=100, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=3, num_heads=4,
            pad_token_id=0, decoder_start_token_id=0, feed_forward_proj="gated-gelu", attn_implementation="eager"))
        decoder = torch.randint(3, 100, (B, T))
        decoder[:, 0] = 0  # the start token is T5's pad
        inputs = (torch.randint(3, 100, (B, S)), torch.ones(B, S, dtype=torch.long), decoder)
    else:
        config = transformers.EsmConfig(vocab_size=33, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        intermediate_size=128, position_embedding_type="rotary", pad_token_id=1,
                                        num_labels=3, attn_implementation="eager")
        cls = {"esm-mlm": transformers.EsmForMaskedLM, "esm-classify": transformers.EsmForSequenceClassification,
               "esm-residue": transformers.EsmForTokenClassification}[family]
        model = cls(config)
        inputs = (torch.randint(4, 30, (B, S)), torch.ones(B, S, dtype=torch.long))
    model.eval()
    counter = FlopCounterMode(display=False)
    with counter, torch.no_grad():
        model(*inputs)
    flops = ForwardFlops(model)
    assert flops.method == "analytic (Hugging Face config)"
    assert flops(inputs, items=B * S) == pytest.approx(counter.get_total_flops(), rel=1e-9)
    if len(inputs) > 1:  # padding is not counted: a batch with padded rows costs what its real positions cost
        padded = inputs[1].clone()
        padded[0, 5:] = 0
        fewer = flops((inputs[0], padded, *inputs[2:]), items=B * S)
        assert fewer < flops(inputs, items=B * S)
