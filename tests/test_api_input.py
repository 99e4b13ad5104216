"""Bad input to the Python API and to the checks before launch, refused in one line that names it: the API's
arguments, `task=` as a name or a class, the split scored, a task class of the calling script, plug-in modules found
and their import failures located, and Hugging Face models that would train wrongly or fail on every rank. All
in-process: nothing here trains."""
from __future__ import annotations

import json
import os
import sys
import uuid

import pytest
from conftest import ROOT, TINY

import harness
from harness.config.run import ConfigError
from harness.tasks import get_task, resolve, task_class
from harness.tasks.lm import LanguageModelTask


def _one_line(e: pytest.ExceptionInfo) -> str:
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


# --- 1. the API's arguments ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fn, kwargs, message", [
    ("plan", {"sets": "train.max_steps=3"}, "harness.plan: sets = 'train.max_steps=3' must be a list of"),
    ("plan", {"world_size": "2"}, "harness.plan: world_size = '2' must be the number of processes"),
    ("plan", {"world_size": -2}, "harness.plan: world_size = -2 must be"),
    ("plan", {"world_size": 0}, "harness.plan: world_size = 0 must be"),
    ("plan", {"run": 3}, "harness.plan: run = 3 must be a run file"),
    ("train", {"sets": "train.max_steps=3"}, "harness.train: sets = 'train.max_steps=3' must be a list of"),
    ("train", {"overwrite": "no"}, "harness.train: overwrite = 'no' must be True or False"),
    ("train", {"resume": True}, "harness.train: resume = True must be \"auto\" or the path"),
    ("train", {"stop_at": "2"}, "harness.train: stop_at = '2' must be a positive step"),
    ("train", {"stop_at": 0}, "harness.train: stop_at = 0 must be a positive step"),
    ("evaluate", {"run_dir": "runs/none", "trust_run_dir": "yes"}, "harness.evaluate: trust_run_dir = 'yes' must be"),
    ("evaluate", {"run_dir": 5}, "harness.evaluate: run_dir = 5 must be the path of a run directory"),
    ("evaluate", {"run_dir": "runs/none", "data": 5}, "harness.evaluate: data = 5 must be the path of a data file"),
    ("evaluate", {"run_dir": "runs/none", "name": 3}, "harness.evaluate: name = 3 must be a name"),
    ("evaluate", {"run_dir": "runs/none", "task": 3}, "harness.evaluate: task = 3 must be a task's name or a task"),
    ("load_model", {"run_dir": "runs/none", "task": 3}, "harness.load_model: task = 3 must be a task's name or a"),
    ("plan_text", {"p": "configs/runs/lm_demo.toml"}, "harness.plan_text: p = 'configs/runs/lm_demo.toml' must be "
                                                      "what harness.plan returns"),
])
def test_api_arguments_of_a_wrong_type_or_range_are_refused_naming_them(fn, kwargs, message, tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "config.toml").write_text("")  # overwrite="no" must not replace it
    sets = [*TINY, "train.max_steps=1", f"run.output_dir={json.dumps(str(run_dir))}"]
    kwargs = {"sets": sets, **kwargs} if fn not in ("evaluate", "load_model", "plan_text") else kwargs
    with pytest.raises(ConfigError) as e:
        getattr(harness, fn)(**kwargs)
    assert message in _one_line(e)
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.toml"]


def test_a_train_that_fails_after_taking_the_run_directory_lets_go_of_it(tmp_path, corpus, monkeypatch):
    """A notebook trains again after a failure: the lock had been kept ("in use by another run (pid <its own>)")."""
    from harness.run import directory

    def full_disk(*args):
        raise OSError(28, "No space left on device")

    sets = [*TINY, "train.max_steps=1", f"data.path={json.dumps(str(corpus))}",
            f"run.output_dir={json.dumps(str(tmp_path / 'run'))}"]
    with monkeypatch.context() as m:
        m.setattr(directory, "write_configs", full_disk)
        with pytest.raises(OSError, match="No space left"):
            harness.train(sets=sets)
    assert not (tmp_path / "run" / ".lock").exists()
    assert harness.train(sets=sets, overwrite=True)["step"] == 1


def test_a_start_refused_after_writing_its_configs_is_replaced_by_the_next_without_overwrite(tmp_path, capsys):
    """A run refused by its data once it had written config.toml (a file too big for the check before launch) left a
    run directory that refused the corrected command: "exists and is not empty"."""
    (tmp_path / "one_line.txt").write_text("the cat sat on the mat. " * 3000 + "\n")  # past the check's 64 KiB peek
    run_dir = tmp_path / "run"
    sets = [*TINY, "train.max_steps=1", f"data.path={json.dumps(str(tmp_path / 'one_line.txt'))}",
            f"run.output_dir={json.dumps(str(run_dir))}"]
    with pytest.raises(ConfigError, match="leaves none to train on"):
        harness.train(sets=sets)
    assert "config.toml" in {p.name for p in run_dir.iterdir()}
    assert harness.train(sets=[*sets, "data.val_fraction=0"])["step"] == 1
    assert "holds only the start-up files of a run that never trained a step: replaced" in capsys.readouterr().out
    (run_dir / "notes.txt").write_text("mine\n")  # a trained run, and a file of the user's: still refused
    with pytest.raises(ConfigError, match="run directory exists and is not empty"):
        harness.train(sets=[*sets, "data.val_fraction=0"])
    # a folder of the user's that holds only names a start writes (its data/, no config.toml), or a refused start's
    # files and the run's data under them: refused, not emptied
    mine, started = tmp_path / "mine", tmp_path / "started"
    folder_sets = {folder: [*TINY, "train.max_steps=1", f"run.output_dir={json.dumps(str(folder))}",
                            f"data.path={json.dumps(str(folder / 'data' / 'train.txt'))}"]
                   for folder in (mine, started)}
    with pytest.raises(ConfigError, match="leaves none to train on"):
        harness.train(sets=[*folder_sets[started], f"data.path={json.dumps(str(tmp_path / 'one_line.txt'))}"])
    for folder in (mine, started):
        (folder / "data").mkdir(parents=True)
        (folder / "data" / "train.txt").write_text("the cat sat on the mat.\n" * 400)
    for folder in (mine, started):
        with pytest.raises(ConfigError, match="run directory exists and is not empty"):
            harness.train(sets=[*folder_sets[folder], "data.val_fraction=0"])
        assert (folder / "data" / "train.txt").is_file()
    # any file the run names, not its data alone: a plug-in task's file kept there
    (started / "data" / "own_lm.py").write_text("from harness.tasks.lm import LanguageModelTask\n\n\n"
                                                "class OwnLM(LanguageModelTask):\n    pass\n")
    with pytest.raises(ConfigError, match="run directory exists and is not empty"):
        harness.train(sets=[*folder_sets[started], f"data.path={json.dumps(str(tmp_path / 'one_line.txt'))}",
                            "data.val_fraction=0", f"run.task={json.dumps(str(started / 'data' / 'own_lm.py') + ':OwnLM')}"])
    assert (started / "data" / "own_lm.py").is_file()


def test_an_evaluation_reading_many_times_what_its_steps_train_on_is_said_with_the_cap(tmp_path, corpus, capsys):
    """By default an evaluation reads the whole validation split: of a large corpus it took minutes, unsaid, where
    the steps between two took seconds. The start says so, and what train.eval_batches would read."""
    sets = [*TINY, "train.max_steps=1", "train.eval_every=1", "data.val_fraction=0.3",
            f"data.path={json.dumps(str(corpus))}", f"run.output_dir={json.dumps(str(tmp_path / 'run'))}"]
    harness.train(sets=sets)
    notes = [line for line in capsys.readouterr().out.splitlines() if "note: an evaluation reads" in line]
    assert len(notes) == 1 and "train.eval_batches = 1 would read 4" in notes[0] and \
        "more than 3 times the 4 samples trained between two evaluations (1 step)" in notes[0], notes
    harness.train(sets=[*sets, "train.eval_batches=3"], overwrite=True)
    assert "note: an evaluation reads" not in capsys.readouterr().out


def test_a_wrong_type_in_a_dict_config_names_the_dict_not_the_command_line():
    with pytest.raises(ConfigError) as e:
        harness.plan({"train": {"max_steps": "three"}})
    assert "(the config dict given to harness.plan)" in _one_line(e)


# --- 2. task= as a name, or a class ----------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["lm", f"{ROOT}/examples/digits_task.py:DigitsTask"])
def test_plan_takes_a_task_by_name_as_run_task_does(name):
    p = harness.plan(sets=["train.max_steps=1"], task=name)
    assert p.run.cfg.run.task == name and type(p.task).__name__ in ("LanguageModelTask", "DigitsTask")


@pytest.mark.parametrize("fn, args", [("plan", ()), ("train", ()), ("evaluate", ("runs/none",)),
                                      ("load_model", ("runs/none",))])
def test_a_task_class_instead_of_an_instance_is_refused(fn, args):
    with pytest.raises(ConfigError) as e:
        getattr(harness, fn)(*args, task=LanguageModelTask)
    assert f"harness.{fn}: task = LanguageModelTask is a class; pass an instance: task=LanguageModelTask()" \
        in _one_line(e)


# --- 3. the split scored ---------------------------------------------------------------------------------------------

def test_a_split_other_than_validation_or_test_is_refused_by_api_and_command_line_alike(tmp_path):
    from harness.eval.evaluate import evaluate_run

    # harness.evaluate, and what `harness evaluate --split` calls
    for call in (lambda: harness.evaluate(tmp_path, split="val"), lambda: evaluate_run(tmp_path, "train")):
        with pytest.raises(ConfigError) as e:
            call()
        assert "a run is scored on 'validation' or 'test'" in _one_line(e)


# --- 4. a task class of the calling script ---------------------------------------------------------------------------

def test_training_a_task_class_of_the_calling_script_says_what_later_needs(tmp_path, monkeypatch, capsys):
    cls = type("NotebookTask", (LanguageModelTask,), {"__module__": "__main__"})
    monkeypatch.setattr(sys.modules["__main__"], "NotebookTask", cls, raising=False)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / "notes.txt").write_text("")  # refused after the note: nothing trains
    with pytest.raises(ConfigError, match="run directory exists and is not empty"):
        harness.train(sets=[*TINY, f"run.output_dir={json.dumps(str(run_dir))}"], task=cls())
    out = capsys.readouterr().out
    assert out.count("note: run.task = '__main__:NotebookTask'") == 1
    assert "task=NotebookTask() given again" in out and '"path/to/file.py:NotebookTask"' in out

    def make():  # a class of a function's: the object trains all the same (it had been refused: no such class)
        class LocalTask(LanguageModelTask):
            pass
        return LocalTask()

    with pytest.raises(ConfigError, match="run directory exists and is not empty"):
        harness.train(sets=[*TINY, f"run.output_dir={json.dumps(str(run_dir))}"], task=make())
    out = capsys.readouterr().out
    assert ".make.<locals>.LocalTask': " in out and "names a task class defined in a function" in out
    assert "task=LocalTask() given again" in out


# --- 5, 6. plug-in modules: found from the current directory, failures located ---------------------------------------

TASK = "from harness.tasks.lm import LanguageModelTask\n\n\nclass T(LanguageModelTask):\n    pass\n"


def test_a_plugin_module_is_found_in_the_current_directory_without_it_on_sys_path(tmp_path, monkeypatch):
    """The `harness` console script has no '' on sys.path, as `python -m harness` has."""
    package = f"mytasks_{uuid.uuid4().hex[:8]}"
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text("")
    (tmp_path / package / "tasks.py").write_text(TASK)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", os.getcwd())])
    assert task_class(f"{package}.tasks:T").__name__ == "T"
    assert sys.path[-1] == str(tmp_path)  # last: it never hides an installed module


def test_an_import_failure_in_a_plugin_file_names_its_line(tmp_path):
    bad = tmp_path / "bad_tasks.py"
    bad.write_text("import json\n\n\ndef load():\n    return json.loads('{')\n\n\nSETTINGS = load()\n")
    with pytest.raises(ConfigError) as e:
        task_class(f"{bad}:T")
    assert f"importing {bad} failed at {bad}:5: JSONDecodeError" in _one_line(e)


def test_a_plugin_file_with_dataclasses_imports(tmp_path):
    """dataclasses look their module up in sys.modules (string annotations, ClassVar): the file's module is there
    before it runs."""
    good = tmp_path / "dc_tasks.py"
    good.write_text("from __future__ import annotations\n\nimport dataclasses\nfrom typing import ClassVar\n\n"
                    "from harness.tasks.lm import LanguageModelTask\n\n\n@dataclasses.dataclass(frozen=True)\n"
                    "class Config:\n    hidden: int = 3\n    kind: ClassVar[str] = 'x'\n\n\n"
                    "class T(LanguageModelTask):\n    Config = Config\n")
    assert task_class(f"{good}:T").Config.kind == "x"


# --- 7. Hugging Face models checked before launch --------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """Tiny models saved with save_pretrained (no hub), each with a 20-token word-level tokenizer."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    root = tmp_path_factory.mktemp("hf-input")
    vocab = {w: i for i, w in enumerate(["[UNK]", "[PAD]", "[EOS]", *(f"w{i}" for i in range(17))])}
    words = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="[UNK]", pad_token="[PAD]",
                                               eos_token="[EOS]")
    small = {"vocab_size": len(vocab), "pad_token_id": 1, "eos_token_id": 2}
    built = {
        "gpt2": transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=16, n_layer=1, n_head=2, n_positions=16,
                                                                     **small)),
        "llama": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=16, **small)),
        "llama-small-vocab": transformers.LlamaForCausalLM(transformers.LlamaConfig(
            hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
            **{**small, "vocab_size": 10})),
        **{name: transformers.BertLMHeadModel(transformers.BertConfig(
            hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, is_decoder=decoder,
            **small)) for name, decoder in (("bert", False), ("bert-decoder", True))},
    }
    for name, model in built.items():
        model.save_pretrained(root / name)
        tok.save_pretrained(root / name)
    built["llama"].config.save_pretrained(root / "config-only")
    tok.save_pretrained(root / "config-only")
    (root / "empty").mkdir()
    (root / "notes.txt").write_text("not a model")
    return root


def _check(ref, *sets: str) -> None:
    cfg = resolve(None, ["train.max_steps=1", "data.seq_len=16", f"model.hf={json.dumps(str(ref))}", *sets]).cfg
    get_task("lm").check(cfg)


def test_hf_a_bidirectional_class_as_a_causal_lm_is_refused_unless_its_config_is_a_decoder(hf_models):
    with pytest.raises(ConfigError) as e:
        _check(hf_models / "bert")
    assert "BertLMHeadModel attends to every position unless its config says is_decoder = true; set it in " \
        "config.json" in _one_line(e)
    _check(hf_models / "bert-decoder")


def test_hf_a_tokenizer_larger_than_the_vocabulary_is_refused(hf_models):
    with pytest.raises(ConfigError) as e:
        _check(hf_models / "llama-small-vocab")
    assert "its tokenizer has 20 tokens and the model vocab_size = 10" in _one_line(e)


def test_hf_seq_len_past_a_table_of_absolute_positions_is_refused_and_rotary_ones_are_not(hf_models):
    _check(hf_models / "gpt2")
    with pytest.raises(ConfigError) as e:
        _check(hf_models / "gpt2", "data.seq_len=32")
    assert "data.seq_len = 32 takes 32 positions; model.hf" in _one_line(e) and "n_positions = 16" in str(e.value)
    _check(hf_models / "llama", "data.seq_len=32")  # rotary: max_position_embeddings is no hard limit


def test_hf_a_directory_without_weights_is_refused_naming_its_config_json(hf_models):
    with pytest.raises(ConfigError) as e:
        _check(hf_models / "config-only")
    assert "the directory holds no weights" in _one_line(e)
    assert f"model.hf = {str(hf_models / 'config-only' / 'config.json')!r}" in str(e.value)
    _check(hf_models / "config-only" / "config.json")  # random initialisation, as the docs say


def test_hf_class_without_a_class_for_the_model_is_one_line(hf_models):
    with pytest.raises(ConfigError) as e:
        _check(hf_models / "llama", 'model.hf_class="AutoModelForMaskedLM"')
    assert "is a 'llama' model (LlamaConfig), for which model.hf_class = 'AutoModelForMaskedLM' has no class" \
        in _one_line(e)


@pytest.mark.parametrize("name, message", [("notes.txt", "is a file"), ("empty", "no config.json in that directory")])
def test_hf_a_file_or_a_directory_without_config_json_is_said_so(hf_models, name, message):
    with pytest.raises(ConfigError) as e:
        _check(hf_models / name)
    assert message in _one_line(e)
