"""Files from elsewhere are data, not code (harness/run/trust.py): a checkpoint whose unpickling would write a marker
file is refused in one line for --resume and for a resume from another run, and the marker never appears (until
--trust-checkpoint says to load it); evaluate, export and load_model read no pickle at all; a run directory that names
a plug-in task or a model's own code runs nothing unless the user names the task or trusts the directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import cli, harness

DIGITS = "examples/digits_task.py:DigitsTask"


class WritesMarker:
    """What a hostile checkpoint carries: unpickling it calls open(marker, "w"), i.e. runs code."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return open, (str(self.marker), "w")


def poison(run_dir: Path, marker: Path) -> list[Path]:
    """Every checkpoint file of the run replaced by one that writes `marker` when unpickled, with checksums to match
    (a hostile checkpoint comes with its own)."""
    from harness.run.checksums import SUMS, write_sums

    files = sorted((run_dir / "checkpoints").rglob("*.pt"))
    for f in files:
        torch.save({"module": WritesMarker(marker)}, f)
    for step in {f.parent for f in files if (f.parent / SUMS).is_file()}:
        write_sums(step)
    assert files
    return files


def last_line(text: str) -> str:
    return text.strip().splitlines()[-1]


def test_a_checkpoint_that_would_run_code_is_refused_for_resume_and_resume_from_another_run(cached_run, tmp_path,
                                                                                          corpus):
    run = tmp_path / "run"
    shutil.copytree(cached_run("ref-fp32", ds="zero0.json").dir, run)
    marker = tmp_path / "marker"
    poison(run, marker)
    longer = ["train.max_steps=8"]
    for out, resume in ((run, "auto"), (tmp_path / "other", str(run))):  # its own run; a run resumed from
        refused = harness(out, corpus, ds="zero0.json", sets=longer, args=["--resume", resume], check=False)
        line = last_line(refused.proc.stderr)
        assert refused.proc.returncode == 2, refused.proc.stderr[-2000:]
        assert line.startswith("harness: error: ") and "model_states.pt: holds io.open" in line, line
        assert "--trust-checkpoint" in line and not marker.exists()
    trusted = harness(run, corpus, ds="zero0.json", sets=longer, args=["--resume", "auto", "--trust-checkpoint"],
                      check=False)
    assert marker.exists(), trusted.proc.stderr[-2000:]  # the refusal was the guard: trusted, the file runs


def test_evaluate_export_and_load_model_read_no_pickle_and_a_plugin_run_imports_nothing_unasked(cached_run,
                                                                                                tmp_path):
    from harness import load_model
    from harness.config.run import ConfigError

    run = tmp_path / "run"
    shutil.copytree(cached_run("digits-ref", args=["--run", "examples/digits.toml"]).dir, run)
    marker = tmp_path / "marker"
    poison(run, marker)
    args = ["evaluate", "--run-dir", str(run), "--split", "test"]
    unnamed = cli(*args, timeout=120)
    assert unnamed.returncode == 2 and "names the plug-in task" in last_line(unnamed.stderr), unnamed.stderr
    assert "--task" in last_line(unnamed.stderr) and len(unnamed.stderr.strip().splitlines()) == 1
    for extra in (["--task", DIGITS], ["--trust-run-dir"]):
        named = cli(*args, *extra, timeout=120)
        assert named.returncode == 0, named.stderr[-2000:]
    assert set(json.loads((run / "eval.json").read_text())["test"]) == {"mse", "pearson"}
    export = cli("export", "--run-dir", str(run), "--hf", str(tmp_path / "hf"), "--task", DIGITS, timeout=120)
    assert "is the harness's own, not a Hugging Face model" in export.stderr  # loaded, then refused: not HF
    with pytest.raises(ConfigError, match="names the plug-in task"):
        load_model(run)
    model, cfg = load_model(run, task=DIGITS)
    assert type(model).__name__ == "DigitsModel"
    assert not marker.exists()


def test_a_run_directory_that_names_model_code_is_refused_without_trust(tmp_path):
    from harness.config.run import ConfigError, to_toml
    from harness.run.export import run_config
    from harness.run.trust import trusting
    from harness.tasks import resolve

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text(to_toml(resolve(None, ['model.hf="gpt2"', "model.trust_remote_code=true"]).cfg))
    with pytest.raises(ConfigError, match="sets model.trust_remote_code = true.*--trust-run-dir"):
        run_config(run)
    with trusting(run_dir=True):
        assert run_config(run).model.trust_remote_code


def test_a_model_with_its_own_code_is_refused_unless_trusted(tmp_path):
    """A model directory whose config names code of its own (auto_map): one line, exit 2, and its code never ran."""
    model = tmp_path / "custom"
    model.mkdir()
    marker = tmp_path / "marker"
    (model / "config.json").write_text(json.dumps({
        "model_type": "harness_custom", "auto_map": {"AutoConfig": "configuration_custom.CustomConfig"}}))
    (model / "configuration_custom.py").write_text(
        f"open({str(marker)!r}, 'w').close()\n"
        "from transformers import PretrainedConfig\n\n"
        "class CustomConfig(PretrainedConfig):\n    model_type = 'harness_custom'\n")
    proc = cli("plan", "--set", f"model.hf={json.dumps(str(model))}", "--set", "train.max_steps=1", timeout=120)
    line = last_line(proc.stderr)
    assert proc.returncode == 2 and "set model.trust_remote_code = true only if you trust" in line, proc.stderr
    assert not marker.exists()
