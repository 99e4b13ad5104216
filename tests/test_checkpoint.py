"""Checkpoints, resume, the run directory and the consolidated export."""
from __future__ import annotations

import json
import math
import re
import resource
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from conftest import ROOT, _env, assert_losses_close, cli, command, ds_variant, harness, rewind, val_loss_of_export
from harness.run import checksums, reshape, resume
from harness.config.run import ConfigError
from harness.tasks import get_task as resolve_task

STEPS = ["train.max_steps=8", "train.save_every=2", "train.keep_checkpoints=2", "model.dropout=0.1"]


def test_resume_auto_continues_with_the_uninterrupted_losses_and_exports_the_best(tmp_path, corpus):
    # ZeRO-3 with every parameter sharded (ZeRO-2 on 2 processes resumes in test_hf.py, against 1 process).
    # Dropout on: resuming must also restore every rank's RNG, not only weights and data position.
    # train.select_best: the loss falls, so "max" picks the evaluation at step 4 over the final one at 8 (whichever it
    # picks, eval.jsonl says); the export, gathered from 2 ranks, holds that evaluation's weights.
    ds = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    sets = STEPS + ["train.micro_batch_size=2", "train.eval_every=4", "train.select_best=\"loss\"",
                    "train.select_mode=\"max\""]
    full = harness(tmp_path / "full", corpus, nproc=2, ds=ds, sets=sets)
    part = harness(tmp_path / "part", corpus, nproc=2, ds=ds, sets=sets, args=["--stop-at", "5"])
    assert "stopped at step 5 of 8" in part.proc.stdout
    ckpts = sorted(p.name for p in (part.dir / "checkpoints").iterdir() if not p.name.endswith(".py"))
    assert ckpts == ["best", "latest", "step_00000004", "step_00000005"]  # the last 2 kept; the best is one of them
    # as if it had crashed later: metrics logged past the checkpoint, a half-written checkpoint
    with (part.dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 6, "loss": 99.0}) + "\n")
    (part.dir / "checkpoints" / "step_00000007.partial").mkdir()
    resumed = harness(tmp_path / "part", corpus, nproc=2, ds=ds, sets=sets, args=["--resume", "auto"])
    assert "resumed from" in resumed.proc.stdout and "step_00000005" in resumed.proc.stdout
    assert "config differs" not in resumed.proc.stdout
    assert_losses_close(resumed.losses, full.losses, 1e-6)  # steps 1-5 from the first leg, 6-8 resumed
    assert [m["step"] for m in resumed.metrics] == list(range(1, 9))
    assert [m["samples_seen"] for m in resumed.metrics] == [4 * s for s in range(1, 9)]
    assert not list((part.dir / "checkpoints").glob("*.partial"))
    best = max(resumed.evals, key=lambda e: e["loss"])
    assert json.loads((resumed.dir / "best.json").read_text())["step"] == best["step"]
    assert json.loads((full.dir / "best.json").read_text())["step"] == best["step"]
    assert abs(val_loss_of_export(resumed.dir) - best["loss"]) < 1e-5
    # trained on past its export (more steps, stopped before their end): evaluate says whose weights it scores
    from harness.run.export import trained_on_note

    assert trained_on_note(resumed.dir) is None  # the best step's weights, exported as the run finished
    harness(tmp_path / "part", corpus, nproc=2, ds=ds, sets=[*sets, "train.max_steps=10"],
            args=["--resume", "auto", "--stop-at", "9"])
    note = trained_on_note(resumed.dir)
    assert "is the export of step 8; the run has trained to step 9 since and not finished: these are step " \
        f"{best['step']}'s weights" in note, note
    # its best checkpoint damaged: said before any step trains (it was found after the run, at the export)
    damaged = tmp_path / "damaged"
    shutil.copytree(part.dir, damaged)
    kept = damaged / "checkpoints" / resume.step_name(best["step"])
    states = max(kept.glob("*.pt"), key=lambda f: f.stat().st_size)
    raw = bytearray(states.read_bytes())
    raw[_inside_largest_tensor(states)] ^= 1
    states.write_bytes(bytes(raw))
    bad = harness(damaged, corpus, nproc=2, front=True, ds=ds, sets=[*sets, "train.max_steps=10"],
                  args=["--resume", "auto"], check=False)
    line = bad.proc.stderr.strip().splitlines()[-1]
    assert bad.proc.returncode == 2 and f"the best checkpoint the resumed run kept (train.select_best), {kept}, " \
        f"is damaged: {states.name} has changed" in line and line.endswith('set train.select_best = "" to go on '
                                                                         'without it'), line
    assert max(m["step"] for m in bad.metrics) == 9
    # finished on 1 process: the best checkpoint, saved on 2, converted for the export (it had stopped the run at its
    # end with DeepSpeed's "used a DP world size of 2" traceback, exit 1, nothing exported)
    alone = harness(tmp_path / "part", corpus, ds=ds, sets=[*sets, "train.max_steps=10"], args=["--resume", "auto"])
    assert abs(val_loss_of_export(alone.dir) - best["loss"]) < 1e-5


def test_existing_run_dir_is_never_overwritten_unless_told(tmp_path, corpus, capsys):
    first = harness(tmp_path / "run", corpus, sets=["train.max_steps=2"])
    before = (first.dir / "metrics.jsonl").read_text()
    again = harness(tmp_path / "run", corpus, sets=["train.max_steps=2"], check=False)
    assert again.proc.returncode == 2
    assert "run directory exists" in again.proc.stderr and "--resume auto" in again.proc.stderr
    assert (first.dir / "metrics.jsonl").read_text() == before
    harness(tmp_path / "run", corpus, sets=["train.max_steps=3"], args=["--overwrite"])
    assert len((first.dir / "metrics.jsonl").read_text().splitlines()) == 3
    # `harness evaluate` on a task without a field evaluation of its own (lm): its mean loss and metrics, as the
    # loop's last validation gave them; a split it does not build is one line, and no split named scores validation.
    # New text (--data): the validation rows written to a file score as the validation split does
    from harness.data.rows import keep, load_rows
    from harness.eval.evaluate import evaluate_data, evaluate_run, score_run
    from harness.run.export import run_config
    from harness.tasks.lm import SPLIT_SEED

    scored, last = evaluate_run(first.dir, "validation"), first.evals[-1]
    assert scored["loss"] == pytest.approx(last["loss"], abs=1e-5) and scored["perplexity"] == pytest.approx(
        last["perplexity"], rel=1e-5) and scored[getattr(resolve_task("lm"), "items", "items")] > 0, (scored, last)
    with pytest.raises(ConfigError, match="task 'lm' builds no test split .* score --split validation"):
        evaluate_run(first.dir, "test")
    assert score_run(first.dir, None) == ("validation", scored)
    d = run_config(first.dir).data
    held = keep(load_rows(str(corpus), d).train_test_split(test_size=d.val_fraction, shuffle=True, seed=SPLIT_SEED)
                ["test"])["text"]
    (tmp_path / "held.txt").write_text("\n".join(held) + "\n\n")
    new = evaluate_data(first.dir, tmp_path / "held.txt")["held.txt"]
    assert {k: new[k] for k in scored} == pytest.approx(scored, rel=1e-6), (new, scored)
    assert new["rows_kept"] == len(held) and new["skipped"] == "empty 1", new
    (tmp_path / "short.txt").write_text("too short\n")
    with pytest.raises(ConfigError, match=r"short.txt: its rows hold fewer tokens than one window of data.seq_len \+ "
                                          r"1 = 33: nothing to score"):
        evaluate_data(first.dir, tmp_path / "short.txt")
    # the new file's own format and field: JSON lines by its name, its text in "body" (--set, for the new data only)
    (tmp_path / "held.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in held))
    body = evaluate_data(first.dir, tmp_path / "held.jsonl", sets=['data.text_field="body"'])["held.jsonl"]
    assert {k: body[k] for k in scored} == pytest.approx(scored, rel=1e-6), (body, scored)
    (tmp_path / "held").write_text((tmp_path / "held.txt").read_text())  # a name that tells no format: --set it
    with pytest.raises(ConfigError, match="cannot tell the format from the file name; set data.format"):
        evaluate_data(first.dir, tmp_path / "held")
    named = evaluate_data(first.dir, tmp_path / "held", sets=['data.format="text"'])["held"]
    (tmp_path / "held.parquet").write_bytes(b"PAR1")  # raw parquet: prepare reads it, not this
    with pytest.raises(ConfigError, match=r"held.parquet: raw parquet is read only by `harness prepare lm`"):
        evaluate_data(first.dir, tmp_path / "held.parquet")
    assert {k: named[k] for k in scored} == pytest.approx(scored, rel=1e-6), (named, scored)
    (tmp_path / "empty.txt").write_text("")
    for path, message in ((tmp_path / "empty.txt", "the file is empty: nothing to score"),
                          (tmp_path, "a folder that is no prepared corpus")):
        with pytest.raises(ConfigError, match=message):
            evaluate_data(first.dir, path)
    with pytest.raises(ConfigError, match=r"scored or the new data read \(this run's are data.format, "
                                          r"data.text_field\); data.seq_len is what the run trained with"):
        evaluate_data(first.dir, tmp_path / "held.txt", sets=["data.seq_len=64"])
    # a file of the same name elsewhere replaces its entry, said; a run directory that cannot take eval.json (a
    # colleague's, read-only) keeps the scores given (it had ended in a traceback once they were made)
    (tmp_path / "d2").mkdir()  # other lines under the same name; the same file named another way is no other data
    lines = (tmp_path / "held.txt").read_text().splitlines(keepends=True)
    (tmp_path / "d2" / "held.txt").write_text("".join(reversed(lines)))
    evaluate_data(first.dir, tmp_path / "held.txt")
    evaluate_data(first.dir, tmp_path / "d2" / ".." / "held.txt")
    assert "held the scores of" not in capsys.readouterr().err
    evaluate_data(first.dir, tmp_path / "d2" / "held.txt")
    was = tmp_path / "d2" / ".." / "held.txt"
    assert f"note: {first.dir / 'eval.json'}: the entry 'held.txt' held the scores of {was}; now " \
           f"{tmp_path / 'd2' / 'held.txt'}'s (--name NAME keeps both)" in capsys.readouterr().err
    (first.dir / ".eval.json.tmp").mkdir()  # (a write that fails: root writes through a read-only mode)
    assert evaluate_run(first.dir, "validation") == scored
    assert f"note: the scores are not recorded in {first.dir / 'eval.json'}: " in capsys.readouterr().err
    (first.dir / ".eval.json.tmp").rmdir()
    # --resume auto where the run saved nothing (its checkpoints gone here): said, and trained from step 0
    shutil.rmtree(first.dir / "checkpoints")
    again = harness(tmp_path / "run", corpus, sets=["train.max_steps=3"], args=["--resume", "auto"])
    assert "holds no checkpoint (its run stopped before it saved one); starting from step 0" in again.proc.stdout
    assert [m["step"] for m in again.metrics] == [1, 2, 3]
    # a copy of the run, named by its config.toml: the run it names is the original, said (it had resumed it silently)
    shutil.copytree(first.dir, tmp_path / "copy")
    copied = cli("train", "--run", str(tmp_path / "copy" / "config.toml"), "--resume", "auto")
    assert f"note: the run file {tmp_path / 'copy' / 'config.toml'} is a run directory's record, and names " \
           f"run.output_dir = {first.dir}: this run is there, not in {tmp_path / 'copy'}" in copied.stdout, \
        copied.stderr
    # and where no run is (a mistyped run.output_dir had started a new run without a word)
    fresh = harness(tmp_path / "typo", corpus, sets=["train.max_steps=1"], args=["--resume", "auto"])
    assert f"note: --resume auto: no run in {tmp_path / 'typo'} yet (it does not exist); starting from step 0" \
        in fresh.proc.stdout


def test_zero3_export_loads_into_a_plain_model_with_the_same_outputs(cached_run, tmp_path):
    from harness.run.export import load_model

    ds = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0)
    z3 = cached_run("zero3-2p", nproc=2, ds=ds, sets=["train.micro_batch_size=2"])
    model, cfg = load_model(z3.dir)
    assert all(p.numel() > 0 for p in model.parameters())  # not ZeRO-3's empty placeholders
    # the exported weights give the final eval loss the engine measured on 2 ranks
    assert abs(val_loss_of_export(z3.dir) - z3.evals[-1]["loss"]) < 1e-5
    # and equal the single-process run's weights
    ref, _ = load_model(cached_run("ref-fp32", ds="zero0.json").dir)
    for (name, a), (_, b) in zip(model.state_dict().items(), ref.state_dict().items()):
        assert torch.allclose(a, b, atol=1e-5), name


def test_run_directory_is_readable(cached_run):
    run = cached_run("ref-fp32", ds="zero0.json")
    names = {p.name for p in run.dir.iterdir()}
    assert {"config.toml", "ds_config.json", "metrics.jsonl", "eval.jsonl", "checkpoints", "model.safetensors"} <= names
    ds = json.loads((run.dir / "ds_config.json").read_text())
    assert ds["train_batch_size"] == 4 and ds["zero_optimization"]["stage"] == 0
    m = run.metrics[0]
    assert {"step", "loss", "lr", "grad_norm", "samples_seen", "tokens_per_s", "step_s", "peak_mem_bytes"} <= m.keys()
    assert m["grad_norm"] > 0 and m["tokens_per_s"] > 0 and m["step_s"] > 0 and m["peak_mem_bytes"] > 0
    # the model is as readable as every other file (safetensors alone writes 0600)
    mode = lambda name: (run.dir / name).stat().st_mode & 0o777  # noqa: E731
    assert mode("model.safetensors") == mode("config.toml")
    # the saved config is a run file that reproduces the run
    from harness.tasks import resolve

    assert resolve(str(run.dir / "config.toml")).cfg.train.max_steps == 6


def test_metrics_the_disk_cannot_hold_stop_the_run_with_exit_3_and_its_checkpoint_kept(tmp_path, corpus):
    """The disk fills while a metrics record is appended (RLIMIT_FSIZE as below, reached by metrics.jsonl first: its
    first record padded to just under the limit): one line, exit 3, `latest` unchanged and resumable."""
    out = tmp_path / "run"
    sets = ["train.save_every=2"]
    harness(out, corpus, sets=sets, args=["--stop-at", "2"])
    limit = 2 * 2**20  # the tiny model's checkpoint files are far smaller
    rows = (out / "metrics.jsonl").read_text().splitlines()
    pad = json.dumps({**json.loads(rows[0]), "pad": ""})
    rows[0] = json.dumps({**json.loads(rows[0]), "pad": "x" * (limit - 400 - len(pad) - len(rows[1]))})
    (out / "metrics.jsonl").write_text("".join(r + "\n" for r in rows))

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run(command(out, corpus, sets=sets, args=["--resume", "auto"], cold=True), cwd=ROOT,
                          env=_env(cold=True),
                          capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert full.returncode == 3, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert re.match(rf"harness: error: {re.escape(str(out / 'metrics.jsonl'))}: a record of step [345] could not be "
                    rf"written \(File too large; [\d.]+ GiB free there\)", line), line
    assert line.endswith("the run stops, its last checkpoint kept: raise the file-size limit (ulimit -f) and "
                         "continue with --resume auto"), line  # (a full disk's ENOSPC: "make room")
    assert "Traceback" not in full.stderr
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000002"
    # the record is whole or not there (a half line had failed the resume's truncation and the plots): room made,
    # the same command continues
    assert all(json.loads(r) for r in (out / "metrics.jsonl").read_text().splitlines())
    resumed = harness(out, corpus, sets=sets, args=["--resume", "auto"])
    assert max(resumed.losses) == 6 and (out / "model.safetensors").exists()


def test_a_checkpoint_the_disk_cannot_hold_stops_the_run_on_the_last_complete_one(tmp_path, corpus):
    """The disk fills during a save: stood in for by a file-size limit on the process (RLIMIT_FSIZE; the write fails
    midway as on a full disk, without root or a small file system). One line and exit 3, the partial write removed,
    `latest` unchanged; --resume auto continues from it once there is room."""
    sets = ["model.d_model=128", "train.save_every=2"]  # ~0.46M parameters: the optimizer's file is ~5.5 MB
    out = tmp_path / "run"
    harness(out, corpus, ds="zero1.json", sets=sets, args=["--stop-at", "2"])
    limit = 4 * 2**20  # what else the run writes (the model's 1.8 MB file, metrics) fits under it

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    full = subprocess.run(command(out, corpus, ds="zero1.json", sets=sets, args=["--resume", "auto"], cold=True),
                          cwd=ROOT, env=_env(cold=True), capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert full.returncode == 3, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith("harness: error: checkpoint step_00000004 could not be written (a write failed on rank "
                           "0: "), line
    assert "`latest` still names step_00000002: make room" in line and "GiB free under" in line, line
    assert "Traceback" not in full.stderr
    ckpts = out / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_00000002" and not list(ckpts.glob("*.partial"))
    resumed = harness(out, corpus, ds="zero1.json", sets=sets, args=["--resume", "auto"])
    assert "step_00000002" in resumed.proc.stdout and max(resumed.losses) == 6, resumed.proc.stdout[-2000:]
    assert (out / "model.safetensors").exists()


def test_a_checkpoint_write_that_fails_on_one_rank_stops_every_rank_in_one_line(tmp_path, corpus):
    """2 processes at ZeRO-0: rank 0 writes the weights and the optimizer (~5.5 MB here), rank 1 a few KB, so a
    nearly full disk fails rank 0 alone. DeepSpeed's save_checkpoint then raised past its last barrier, where rank 1
    waited: a hang until the collective timeout, then exit 4 blaming rank 1. Now exit 3, the write named."""
    sets = ["model.d_model=128", "train.save_every=2", "train.max_steps=4", "train.collective_timeout_s=60"]
    out = tmp_path / "run"

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (4 * 2**20, 4 * 2**20))

    full = subprocess.run(command(out, corpus, nproc=2, sets=sets, front=True), cwd=ROOT, env=_env(cold=True),
                          capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert full.returncode == 3, full.stderr[-3000:]
    line = next(x for x in full.stderr.splitlines() if x.startswith("harness: error: "))
    assert line.startswith("harness: error: checkpoint step_00000002 could not be written (a write failed on rank "
                           "0: "), line
    assert "no checkpoint is kept" in line and not list((out / "checkpoints").glob("*.partial")), line


def test_an_export_the_disk_cannot_hold_stops_every_rank_in_one_line_and_the_resume_exports(tmp_path, corpus):
    """ZeRO-3 on 4 processes: each rank's checkpoint file holds a quarter of the optimizer (~1.4 MB here), the export
    the whole model's weights (~1.8 MB), so a nearly full disk fails the export alone. Rank 0 raised and rank 1 lost
    it in the closing barrier: exit 1, two tracebacks, the line blaming rank 1. Now exit 3, the write named."""
    sets = ["model.d_model=128", "train.max_steps=2", "train.eval_every=0", "train.micro_batch_size=2"]
    out = tmp_path / "run"

    def small_disk():
        resource.setrlimit(resource.RLIMIT_FSIZE, (int(1.6 * 2**20), int(1.6 * 2**20)))

    full = subprocess.run(command(out, corpus, nproc=4, ds="zero3.json", sets=sets, front=True), cwd=ROOT,
                          env=_env(cold=True), capture_output=True, text=True, timeout=300, preexec_fn=small_disk)
    assert full.returncode == 3, full.stderr[-3000:]
    line = full.stderr.strip().splitlines()[-1]
    assert line.startswith(f"harness: error: the model could not be exported to {out} (") and \
        line.endswith("The last checkpoint is kept: make room and run the same command with --resume auto, which "
                      "exports it"), line
    assert "Traceback" not in full.stderr and not list(out.glob(".*.tmp")) and not (out / "model.safetensors").exists()
    resumed = harness(out, corpus, nproc=4, ds="zero3.json", sets=sets, args=["--resume", "auto"])
    assert (out / "model.safetensors").exists() and "exported" in resumed.proc.stdout


def test_a_zero_checkpoint_under_another_offload_or_precision_is_converted(tmp_path):
    """A ZeRO checkpoint's optimizer files hold the optimizer and precision they were saved under: resumed at the same
    size with the optimizer offloaded (DeepSpeed's CPU Adam then failed on AdamW's state: KeyError 'bias_correction'),
    or in another precision (a 16-bit run's files are missing from an fp32 one's), it goes through the conversion."""
    from harness.api import plan

    def ds(name: str):
        return plan(str(ROOT / "configs/runs/lm_demo.toml"), [], str(ROOT / f"configs/ds/{name}")).ds

    step = tmp_path / "step_00000003"
    step.mkdir()
    (step / resume.LAYOUT).write_text(json.dumps(reshape.layout_of(ds("zero2.json"))))
    assert not reshape.reshape(step, ds("zero2.json"))
    assert reshape.reshape(step, ds("zero2_offload.json")) and reshape.reshape(step, ds("bf16.json"))
    (step / resume.LAYOUT).write_text(json.dumps(reshape.layout_of(ds("zero2_offload.json"))))
    assert reshape.reshape(step, ds("zero2.json"))
    # tensor parallel: DeepSpeed's config has no train_batch_size (it derives it), the layout still records the batch
    from harness.plan.resolve import make_plan

    tp = make_plan(str(ROOT / "configs/runs/lm_demo.toml"), [], str(ROOT / "configs/ds/tp2_zero1.json"), 2).ds
    assert "train_batch_size" not in tp.config and reshape.layout_of(tp)["global_batch"] == 8
    # an emptied layout.json is a damaged checkpoint, not one saved before layout.json (DeepSpeed's traceback followed)
    (step / resume.LAYOUT).write_text("")
    with pytest.raises(ConfigError, match=r"step_00000003 cannot be read \(layout.json: JSONDecodeError: .*there is "
                                          r"none before it to resume from"):
        reshape.reshape(step, ds("zero2.json"))


def test_a_step_saved_again_is_converted_again_not_read_from_its_earlier_conversion(tmp_path, corpus):
    """Resumed from step 2 with the lr at 0, a run saves step 4 again; the conversion a ZeRO-2 resume had made of the
    step 4 saved before is removed with it, and one put back (a copy, an older harness) is not read: the ZeRO-2
    resume goes on from the new step 4, as a ZeRO-1 one does (before, it loaded the old weights without a word)."""
    flat = ["schedule.kind=\"constant\"", "schedule.warmup_steps=0", "train.eval_every=0", "train.max_steps=6",
            "train.save_every=2", "train.keep_checkpoints=5"]
    run, ckpts = tmp_path / "run", tmp_path / "run" / "checkpoints"
    harness(run, corpus, ds="zero1.json", sets=flat, args=["--stop-at", "4"])
    harness(run, corpus, ds="zero2.json", sets=flat, args=["--resume", "auto", "--stop-at", "5"])
    old = ckpts / "step_00000004.universal"
    shutil.copytree(old, tmp_path / "old")
    frozen = [*flat, "optimizer.lr=0.0"]
    rewound = harness(run, corpus, ds="zero1.json", sets=frozen,
                      args=["--resume", str(ckpts / "step_00000002"), "--stop-at", "4"])
    assert not old.exists()
    # the checkpoints after step 2 are a branch the run left: set aside, the one it has passed removed (the rotation
    # had kept them as the newest, and a resume without `latest` took the newest)
    assert "its later checkpoints (step_00000004, step_00000005) are set aside as step_N.past (rename one back to " \
           "resume it), removed once it saves at or past their steps" in rewound.proc.stdout
    assert sorted(p.name for p in ckpts.iterdir() if p.name.startswith("step_")) == [
        "step_00000002", "step_00000004", "step_00000005.past"]
    reference = harness(rewind(run, tmp_path / "reference", 4), corpus, ds="zero1.json", sets=frozen,
                        args=["--resume", "auto", "--stop-at", "5"])
    shutil.copytree(tmp_path / "old", old)
    resumed = harness(run, corpus, ds="zero2.json", sets=frozen, args=["--resume", str(ckpts / "step_00000004"),
                                                                       "--stop-at", "5"])
    assert "step_00000004.universal was converted from an earlier save of step_00000004; converting it again" in \
        resumed.proc.stdout, resumed.proc.stdout[-2000:]
    assert_losses_close({5: resumed.losses[5]}, {5: reference.losses[5]}, 1e-5)


def test_the_free_space_check_counts_a_conversion_to_another_layout(tmp_path, monkeypatch):
    """Resuming onto another data-parallel size converts the checkpoint (`reshape.to_universal`): before launch the
    disk must hold that too, CONVERSION_FACTOR x the checkpoint, unless the conversion is already there."""
    from collections import namedtuple

    from harness.run import directory
    from harness.api import plan

    p = plan(str(ROOT / "configs/runs/lm_demo.toml"), [f"run.output_dir={json.dumps(str(tmp_path / 'run'))}"],
             str(ROOT / "configs/ds/zero2.json"))
    step = tmp_path / "run" / "checkpoints" / "step_00000003"
    step.mkdir(parents=True)
    (step / resume.LAYOUT).write_text(json.dumps({**reshape.layout_of(p.ds), "dp_size": 2}))
    with open(step / "mp_rank_00_model_states.pt", "wb") as f:  # 10 GiB by its size, sparse on disk
        f.truncate(10 * 2 ** 30)
    monkeypatch.setattr(directory.shutil, "disk_usage", lambda path: namedtuple("usage", "free")(5 * 2 ** 30))
    assert directory.check_free_space(p, 400_000) is None  # the run's own checkpoints are small
    problem = directory.check_free_space(p, 400_000, step)
    assert problem and "5.0 GiB free" in problem and "15.0 GiB to convert step_00000003 for the new layout" in problem
    (step.parent / (step.name + resume.UNIVERSAL)).mkdir()  # converted by an earlier resume: reused
    assert directory.check_free_space(p, 400_000, step) is None


def test_nonfinite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, corpus):
    # a huge learning rate, warmed up slowly, drives the weights to inf after a few finite steps
    run = harness(tmp_path / "run", corpus, ds="zero0.json", check=False, env={"WANDB_MODE": "offline"},
                  sets=["train.max_steps=40", "train.save_every=1", "optimizer.lr=1e6", "train.grad_clip=0.0",
                        "schedule.warmup_steps=1000", "schedule.kind=\"constant\"", "train.max_nonfinite_steps=3",
                        "train.keep_checkpoints=40", "logging.backend=\"wandb\""])
    assert run.proc.returncode == 3, run.proc.stderr[-2000:]
    from test_logging import wandb_records

    (record,) = list((run.dir / "wandb").glob("offline-run-*/run-*.wandb"))  # W&B lists it failed, not finished
    assert [r.exit.exit_code for r in wandb_records(record) if r.HasField("exit")] == [3]
    assert "non-finite for 3 consecutive steps" in run.proc.stderr
    assert run.proc.stderr.rstrip().endswith("Lower optimizer.lr or check the data")  # an fp32 run: no fp16 advice
    losses = run.losses
    first_bad = min(s for s, v in losses.items() if not math.isfinite(v))
    assert first_bad > 2, losses  # else there is no good checkpoint to keep and the test shows nothing
    # the checkpoint at first_bad - 1 holds the weights that gave the first non-finite loss: not good
    latest = (run.dir / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{first_bad - 2:08d}"
    assert (run.dir / "checkpoints" / f"step_{first_bad - 1:08d}.bad").is_dir()  # kept, never resumed from
    assert resume.resume_target(run.dir / "checkpoints").name == latest
    assert not (run.dir / "model.safetensors").exists()
    # resumed with a sane learning rate: once a good checkpoint reaches the bad one's step, the bad one goes (the
    # run ends there: its weights, from the huge lr's steps, may not stay finite for long)
    harness(tmp_path / "run", corpus, ds="zero0.json", args=["--resume", "auto"],
            sets=[f"train.max_steps={first_bad - 1}", "train.save_every=1", "optimizer.lr=1e-3", "train.grad_clip=0.0",
                  "schedule.warmup_steps=1000", "schedule.kind=\"constant\"", "train.keep_checkpoints=40"])
    assert not list((run.dir / "checkpoints").glob("*.bad"))
    shutil.rmtree(run.dir)
    # --stop-at a step whose loss is not finite: the same stop (exit 0 there promised a checkpoint of that step)
    stopped = harness(tmp_path / "stopped", corpus, ds="zero0.json", check=False, args=["--stop-at", str(first_bad)],
                      sets=["train.max_steps=40", "train.save_every=1", "optimizer.lr=1e6", "train.grad_clip=0.0",
                            "schedule.warmup_steps=1000", "schedule.kind=\"constant\"", "train.keep_checkpoints=40"])
    assert stopped.proc.returncode == 3 and "non-finite for 1 consecutive steps" in stopped.proc.stderr, \
        stopped.proc.stderr[-2000:]
    assert (stopped.dir / "checkpoints" / "latest").read_text().strip() == f"step_{first_bad - 2:08d}"


def test_epochs_eval_every_and_resume_from_another_run(tmp_path, corpus, capsys):
    run = harness(tmp_path / "a", corpus, sets=["train.max_steps=0", "train.epochs=0.01", "train.eval_every=2",
                                                "train.eval_batches=1", "train.save_every=3"])
    per_epoch = int(run.proc.stdout.split(" per epoch;")[0].rsplit("(", 1)[1])
    steps = math.ceil(0.01 * per_epoch)
    assert steps > 3, per_epoch  # room for a checkpoint at 3 and steps after it
    assert f"steps 0->{steps} " in run.proc.stdout and len(run.metrics) == steps
    assert [e["step"] for e in run.evals] == list(range(2, steps, 2)) + [steps]
    # `harness evaluate` scores the whole split its evaluations in training read one global batch of: said
    from harness.eval.evaluate import evaluate_run

    capsys.readouterr()
    whole = evaluate_run(run.dir, "validation")
    assert whole["loss"] != pytest.approx(run.evals[-1]["loss"], rel=1e-6)
    assert re.search(r"note: the run's evaluations in training read 4 of the [\d,]+ validation samples \("
                     r"train.eval_batches = 1 global batches of 4\); this scores all of them, so its figures differ "
                     r"from eval.jsonl's and best.json's", capsys.readouterr().err)
    # --resume DIR: start a new run directory from another run's checkpoint
    other = harness(tmp_path / "b", corpus, sets=["train.max_steps=0", "train.epochs=0.01", "train.save_every=3"],
                    args=["--resume", str(run.dir / "checkpoints" / "step_00000003")])
    assert "at step 3" in other.proc.stdout
    assert [m["step"] for m in other.metrics] == list(range(4, steps + 1))
    assert_losses_close(other.losses, {s: v for s, v in run.losses.items() if s > 3}, 1e-6)
    # again into that directory, as a requeued job does: it goes on from its own checkpoints, said (torchtitan's
    # initial_load_path likewise); into one holding another run's records up to that step: refused (they had mixed)
    before = (other.dir / "metrics.jsonl").read_text()
    again = harness(tmp_path / "b", corpus, sets=["train.max_steps=0", "train.epochs=0.01", "train.save_every=3"],
                    args=["--resume", str(run.dir / "checkpoints" / "step_00000003")])
    assert f"{other.dir} holds checkpoints of its own (latest step_{steps:08d}), saved since it started from there: " \
           f"going on from them" in again.proc.stdout and "the run finished at step" in again.proc.stdout
    assert (other.dir / "metrics.jsonl").read_text() == before
    (tmp_path / "c").mkdir()
    shutil.copy(run.dir / "metrics.jsonl", tmp_path / "c" / "metrics.jsonl")
    mixed = harness(tmp_path / "c", corpus, sets=["train.max_steps=0", "train.epochs=0.01", "train.save_every=3"],
                    args=["--resume", str(run.dir / "checkpoints" / "step_00000003")], check=False)
    assert mixed.proc.returncode == 2 and mixed.proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: --resume {run.dir / 'checkpoints' / 'step_00000003'}: another run's checkpoint, into "
        f"{tmp_path / 'c'}, whose records (metrics.jsonl) hold steps up to 3 of a run of its own: the two runs' "
        f"records would mix; to go on from step_00000003, name a new run.output_dir"), mixed.proc.stderr[-2000:]
    assert "| CPU threads 1 (OMP_NUM_THREADS) |" in run.proc.stdout  # the tests' launcher environment sets it
    # --resume auto on the finished run: said, and nothing evaluated, exported, logged or written again (other
    # settings on the command line included: config.toml stays the record of the run that made the weights)
    sets = ["train.max_steps=0", "train.epochs=0.01", "train.eval_every=2", "train.eval_batches=1",
            "train.save_every=3"]
    evals, export = (run.dir / "eval.jsonl").read_text(), (run.dir / "model.safetensors").stat().st_mtime_ns
    configs = {name: (run.dir / name).read_text() for name in ("config.toml", "ds_config.json")}
    done = harness(tmp_path / "a", corpus, sets=[*sets, "train.eval_batches=2", "optimizer.lr=0.05"],
                   args=["--resume", "auto"])
    assert f"the run finished at step {steps} of {steps}" in done.proc.stdout and "nothing to do" in done.proc.stdout
    assert "optimizer.lr" not in done.proc.stdout, done.proc.stdout[-2000:]
    assert (run.dir / "eval.jsonl").read_text() == evals
    assert (run.dir / "model.safetensors").stat().st_mtime_ns == export
    assert {name: (run.dir / name).read_text() for name in configs} == configs
    # another model size: refused before anything loads or is written, naming the setting
    saved = (run.dir / "config.toml").read_text()
    wider = harness(tmp_path / "a", corpus, sets=[*sets, "model.d_model=64"], args=["--resume", "auto"], check=False)
    assert wider.proc.returncode == 2, wider.proc.stderr[-2000:]
    line = wider.proc.stderr.strip().splitlines()[-1]
    assert "its model is not this run's (model.d_model 32 there, 64 here (command line); parameters " in line, line
    # other heads over the same parameters: refused too (the checkpoint had loaded and trained on, read as 1 head)
    heads = harness(tmp_path / "a", corpus, sets=[*sets, "model.n_heads=1"], args=["--resume", "auto"], check=False)
    line = (heads.proc.stderr.strip().splitlines() or [heads.proc.stdout[-500:]])[-1]
    assert heads.proc.returncode == 2 and "(model.n_heads 2 there, 1 here (command line); the same parameters, read " \
        "as other heads)" in line, line
    assert (run.dir / "config.toml").read_text() == saved and (run.dir / "eval.jsonl").read_text() == evals
    shorter = harness(tmp_path / "a", corpus, sets=[*sets, "train.max_steps=2", "train.epochs=0.0"],
                      args=["--resume", "auto"])  # (it had said "finished at step N of 2")
    assert f"the run finished at step {steps} (past the 2 steps this run asks for) and exported" in \
        shorter.proc.stdout
    # resumed from its earlier checkpoint where that is its end: finished, its later checkpoints left as they are
    kept = sorted(p.name for p in (run.dir / "checkpoints").iterdir())
    short = harness(tmp_path / "a", corpus, sets=[*sets, "train.max_steps=3", "train.epochs=0.0"],
                    args=["--resume", str(run.dir / "checkpoints" / "step_00000003")])
    assert "the run finished at step 3 of 3" in short.proc.stdout, short.proc.stdout[-2000:]
    assert sorted(p.name for p in (run.dir / "checkpoints").iterdir()) == kept
    # its export gone, resumed with fewer steps than it trained: evaluated and exported again (it had said "stopped
    # at step N of M (--stop-at)" and exported nothing, at every resume)
    (run.dir / "model.safetensors").unlink()
    fewer = harness(tmp_path / "a", corpus, sets=["train.max_steps=2", "train.epochs=0.0", "train.eval_batches=1"],
                    args=["--resume", "auto"])
    assert (run.dir / "model.safetensors").is_file() and "--stop-at" not in fewer.proc.stdout, fewer.proc.stdout


def test_threads_follow_the_cpus_this_process_may_use(monkeypatch):
    from harness.distributed.world import cpu_threads

    before = torch.get_num_threads()
    try:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5})
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
        assert cpu_threads() == "1 (6 CPUs this process may use, 4 ranks on the node)" and torch.get_num_threads() == 1
        monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
        assert cpu_threads() == "6 (6 CPUs this process may use, 1 rank on the node)"
        monkeypatch.delenv("LOCAL_WORLD_SIZE")
        monkeypatch.setenv("LOCAL_SIZE", "3")  # DeepSpeed's launcher (pdsh, nossh) sets this one only
        assert cpu_threads() == "2 (6 CPUs this process may use, 3 ranks on the node)"
        monkeypatch.setenv("OMP_NUM_THREADS", "3")
        torch.set_num_threads(3)
        assert cpu_threads() == "3 (OMP_NUM_THREADS)"
    finally:
        torch.set_num_threads(before)


def test_more_ranks_than_cpus_on_a_node_is_said_in_one_line(monkeypatch):
    from harness.distributed.world import oversubscribed

    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert oversubscribed() is None
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    assert oversubscribed() == ("warning: 3 ranks on this node share 2 CPUs: they take turns, and every step waits for "
                                "the slowest; launch at most 2 processes per node")


BEST = ["train.max_steps=12", "train.eval_every=1", "train.save_every=1", "train.keep_checkpoints=2",
        "train.select_best=\"val_loss\"", "train.select_mode=\"max\"", "train.early_stopping_patience=3"]


def test_best_checkpoint_is_exported_and_early_stopping_stops_the_same_after_a_resume(tmp_path, corpus):
    """The validation loss falls over the first steps, so selecting its maximum makes an early evaluation the best:
    a best that is not the last, and evaluations without improvement that end the run early."""
    from safetensors.torch import load_file

    run = harness(tmp_path / "run", corpus, sets=BEST)
    best_step, best, since = 0, -math.inf, 0
    for e in run.evals:  # the decisions, taken again from eval.jsonl
        best_step, best, since = (e["step"], e["loss"], 0) if e["loss"] > best else (best_step, best, since + 1)
        if since == 3:
            stop = e["step"]
            break
    assert run.evals[-1]["step"] == stop < 12 and len(run.metrics) == stop
    assert f"stopped early at step {stop} of 12: no improvement of validation loss" in run.proc.stdout
    record = json.loads((run.dir / "best.json").read_text())
    assert (record["step"], record["value"], record["stopped_at"]) == (best_step, best, stop)
    assert "in 3 evaluations" in record["stopped_early"]
    ckpts = run.dir / "checkpoints"
    names = [f"step_{s:08d}" for s in (best_step, stop - 1, stop)]
    assert sorted(p.name for p in ckpts.iterdir()) == ["best", "latest", *names]  # kept 2, and the best
    assert (ckpts / "best").read_text().strip() == names[0]
    exported = load_file(str(run.dir / "model.safetensors"))
    module = torch.load(ckpts / names[0] / "mp_rank_00_model_states.pt", weights_only=False)["module"]
    assert exported.keys() == module.keys() and all(torch.equal(exported[k], module[k]) for k in exported)
    assert abs(val_loss_of_export(run.dir) - best) < 1e-5 and abs(best - run.evals[-1]["loss"]) > 1e-3
    sparse = harness(tmp_path / "sparse", corpus, sets=[*BEST, "train.log_every=100"])  # the stop's step has its
    assert [m["step"] for m in sparse.metrics] == [stop]  # record, as the end of a run has

    # resumed into a new run directory one evaluation before the stop: the carried state (best, evaluations since)
    # stops it at the same step, and the best checkpoint comes along from the run it resumed
    resumed = harness(tmp_path / "resumed", corpus, sets=BEST, args=["--resume", str(ckpts / names[1])])
    assert f"stopped early at step {stop} of 12" in resumed.proc.stdout
    assert json.loads((resumed.dir / "best.json").read_text()) == record
    assert (resumed.dir / "checkpoints" / "best").read_text().strip() == names[0]
    assert resumed.evals[-1]["loss"] == pytest.approx(run.evals[-1]["loss"], rel=1e-6)
    again = load_file(str(resumed.dir / "model.safetensors"))
    assert all(torch.equal(again[k], exported[k]) for k in exported)
    # resumed again, with more steps: stopped early, so it is patience that would take it on (not more steps)
    more = harness(tmp_path / "run", corpus, sets=[*BEST, "train.max_steps=40"], args=["--resume", "auto"])
    assert f"the run stopped early at step {stop} (no improvement of validation loss" in more.proc.stdout
    assert "of 40 and exported" in more.proc.stdout and "raise train.early_stopping_patience" in more.proc.stdout
    # resumed selecting the other way: its best is left behind, said (it had started over without a word)
    other = harness(tmp_path / "other", corpus, sets=[*BEST, "train.select_mode=\"min\""],
                    args=["--resume", str(ckpts / names[1])])
    assert f"note: train.select_best selects by loss (min) here, where the checkpoint's run selected by loss (max; " \
           f"best {best:.6g} at step {best_step}): the best is tracked anew from step {stop}" in other.proc.stdout


def test_select_mode_auto_minimises_errors_and_maximises_scores():
    from harness.run.selection import direction

    lower = ("loss", "val_loss", "perplexity", "price_mse", "bits_per_byte")
    assert [direction(m, "auto") for m in lower] == ["min"] * 5
    assert [direction(m, "auto") for m in ("accuracy", "bleu", "q3", "spearman", "auroc")] == ["max"] * 5
    assert direction("loss", "max") == "max"


def test_resume_auto_takes_the_newest_complete_checkpoint_or_refuses_never_restarts(tmp_path, capsys):
    root = tmp_path / "checkpoints"
    assert resume.resume_target(root) is None  # a run that saved nothing yet starts from step 0
    for step in (4, 8):
        (root / resume.step_name(step)).mkdir(parents=True)
    (root / "step_00000012.partial").mkdir()  # a write a crash cut short
    assert resume.resume_target(root).name == "step_00000008"  # `latest` missing
    assert "`latest` is missing" in capsys.readouterr().out
    (root / "latest").write_text("step_00000012\n")  # dangling: the checkpoint it names is gone
    assert resume.resume_target(root).name == "step_00000008"
    assert "names step_00000012, which is gone" in capsys.readouterr().out
    for damaged in ("", "..", ".", "step_00000012.partial", str(root / "step_00000004")):  # `latest` emptied: the
        (root / "latest").write_text(damaged)  # run's checkpoints folder itself was taken, and failed to load
        assert resume.resume_target(root).name == "step_00000008"
    assert "`latest` is empty" in capsys.readouterr().out
    (root / "latest").write_text("step_00000004\n")
    assert resume.resume_target(root).name == "step_00000004"  # `latest` wins when it is there
    # a non-finite stop rewinds past weights gone bad: the newer checkpoints are set aside, not resumed from
    assert resume.rewind_latest(root, 5).name == "step_00000004"
    assert (root / "step_00000008.bad").is_dir() and resume.resume_target(root).name == "step_00000004"
    assert resume.rewind_latest(root, 2) is None and not (root / "latest").exists()
    with pytest.raises(ConfigError, match=r"step_00000004.bad, step_00000008.bad .*weights gone bad.*--overwrite"):
        resume.resume_target(root)
    (root / resume.step_name(8)).mkdir()  # a second non-finite stop past step 8: its copy replaces the first
    (root / resume.step_name(8) / "second").touch()
    assert resume.rewind_latest(root, 2) is None and (root / "step_00000008.bad" / "second").is_file()
    for bad in root.glob("*.bad"):
        shutil.rmtree(bad)
    (root / "latest").write_text("step_00000020\n")
    with pytest.raises(ConfigError, match="names step_00000020; found: no complete checkpoint"):
        resume.resume_target(root)


def test_a_run_resumed_shorter_on_fewer_processes_follows_its_own_schedule_and_says_the_batch_changed(tmp_path,
                                                                                                      corpus):
    """A cosine run of 8 steps on 2 processes, resumed at step 4 as a 6-step run on 1: from step 5 the lr is the
    6-step run's, and the start says so; the global batch halves, and the start says that too."""
    import re

    cosine = ["schedule.kind=\"cosine\"", "schedule.warmup_steps=0", "train.eval_every=0"]
    six = harness(tmp_path / "six", corpus, ds="zero2.json", sets=[*cosine, "train.max_steps=6"])
    harness(tmp_path / "run", corpus, nproc=2, ds="zero2.json", sets=[*cosine, "train.max_steps=8"],
            args=["--stop-at", "4"])
    resumed = harness(tmp_path / "run", corpus, ds="zero2.json", sets=[*cosine, "train.max_steps=6"],
                      args=["--resume", "auto"])
    lr = {m["step"]: m["lr"] for m in resumed.metrics}
    assert [lr[k] for k in (5, 6)] == pytest.approx([m["lr"] for m in six.metrics][4:6], rel=1e-12)
    assert "the lr follows this run's schedule (its length and [schedule]) from step 5; lr there " \
           f"{lr[5]:.3g} (the checkpoint's run: " in resumed.proc.stdout, resumed.proc.stdout[-2000:]
    batch = re.search(r"note: global batch (\d+), where the checkpoint's run had (\d+): the data goes on from the "
                      r"samples read ", resumed.proc.stdout)
    assert batch and 2 * int(batch[1]) == int(batch[2]), resumed.proc.stdout[-2000:]


def test_train_epochs_resumed_at_another_batch_end_once_the_epochs_are_read(tmp_path, corpus):
    """train.epochs, stopped at step 3 and resumed at twice the batch: the run ends at the first step whose logged
    epoch reaches train.epochs (it counted every step at the new batch, and stopped short of it)."""
    sets = ["train.max_steps=0", "train.epochs=0.04", "train.eval_every=0", "train.save_every=0"]
    first = harness(tmp_path / "run", corpus, ds="zero1.json", sets=sets, args=["--stop-at", "3"])
    assert first.metrics[-1]["epoch"] < 0.02
    resumed = harness(tmp_path / "run", corpus, ds="zero1.json", sets=[*sets, "train.micro_batch_size=8"],
                      args=["--resume", "auto"])
    epochs = [m["epoch"] for m in resumed.metrics]
    assert epochs[-2] < 0.04 <= epochs[-1], epochs


def test_a_learning_rate_changed_on_resume_takes_effect_from_the_resumed_step(tmp_path, corpus):
    """The README's advice after a non-finite stop: lower optimizer.lr and resume. Resumed with lr 0 (and so no
    update, weight decay included), a ZeRO-2 run exports the weights it had at its checkpoint, which equal a 2-step
    run's; without the change taking effect, steps 3-4 would train on the checkpoint's lr."""
    from safetensors.torch import load_file

    flat = ["schedule.kind=\"constant\"", "schedule.warmup_steps=0", "train.eval_every=0"]
    two = harness(tmp_path / "two", corpus, ds="zero2.json", sets=[*flat, "train.max_steps=2"])
    part = harness(tmp_path / "four", corpus, ds="zero2.json", sets=[*flat, "train.max_steps=4"],
                   args=["--stop-at", "2"])
    assert [m["lr"] for m in part.metrics] == [3e-3, 3e-3]
    resumed = harness(tmp_path / "four", corpus, ds="zero2.json", sets=[*flat, "train.max_steps=4", "optimizer.lr=0.0"],
                      args=["--resume", "auto"])
    assert "optimizer.lr 0 (the checkpoint's run had 0.003) from step 3" in resumed.proc.stdout
    assert [m["lr"] for m in resumed.metrics] == [3e-3, 3e-3, 0.0, 0.0]
    before, after = load_file(str(two.dir / "model.safetensors")), load_file(str(resumed.dir / "model.safetensors"))
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)


def test_optimizer_settings_changed_on_resume_take_effect_and_another_optimizer_is_refused(tmp_path, corpus):
    """torch's load_state_dict takes the groups' settings from the checkpoint: a weight decay or beta changed on resume
    had been silently the saved one (while config.toml said the new one). Resumed with them changed, a ZeRO-2 run
    says so, trains apart from one resumed as saved, and saves the new settings; SGD over AdamW's state is refused
    before launch in one line (it had stopped at its first step: KeyError 'momentum'). --stop-at at the step resumed
    is refused, and past the run's end said."""
    from safetensors.torch import load_file

    flat = ["schedule.kind=\"constant\"", "schedule.warmup_steps=0", "train.eval_every=0", "train.max_steps=4",
            "optimizer.weight_decay=0.5"]
    harness(tmp_path / "same", corpus, ds="zero2.json", sets=flat, args=["--stop-at", "2"])
    for name in ("changed", "sgd"):
        shutil.copytree(tmp_path / "same", tmp_path / name)
    early = harness(tmp_path / "same", corpus, ds="zero2.json", sets=flat, args=["--resume", "auto", "--stop-at", "1"],
                    check=False)  # (it had started in full to stop at once)
    assert early.proc.returncode == 2 and early.proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: --stop-at 1: the run resumes at step 2 ({tmp_path / 'same' / 'checkpoints' / 'step_00000002'}"
        f"), past it; name a later step, or resume an earlier checkpoint (--resume "
        f"{tmp_path / 'same' / 'checkpoints'}/step_N)"), early.proc.stderr[-2000:]
    same = harness(tmp_path / "same", corpus, ds="zero2.json", sets=flat, args=["--resume", "auto", "--stop-at", "9"])
    assert "note: --stop-at 9 is past the run's end, train.max_steps = 4 (command line): it ends there" in \
        same.proc.stdout
    changed = harness(tmp_path / "changed", corpus, ds="zero2.json",
                      sets=[*flat, "optimizer.weight_decay=0.0", "optimizer.beta2=0.9"], args=["--resume", "auto"])
    assert "the optimizer's settings are this run's from step 3: weight_decay 0 (the checkpoint's run had 0.5); " \
           "betas (0.9, 0.9) (the checkpoint's run had (0.9, 0.95))" in changed.proc.stdout
    assert "optimizer's settings" not in same.proc.stdout
    before, after = load_file(str(same.dir / "model.safetensors")), load_file(str(changed.dir / "model.safetensors"))
    assert not all(torch.equal(before[k], after[k]) for k in before)
    saved = torch.load(next((changed.dir / "checkpoints" / "step_00000004").glob("*optim_states.pt")),
                       weights_only=False)["optimizer_state_dict"]["base_optimizer_state"]["param_groups"]
    assert {g["weight_decay"] for g in saved} <= {0.0} and {tuple(g["betas"]) for g in saved} == {(0.9, 0.9)}
    sgd = harness(tmp_path / "sgd", corpus, ds="zero2.json", sets=[*flat, "optimizer.name=\"sgd\""],
                  args=["--resume", "auto"], check=False)
    assert sgd.proc.returncode == 2, sgd.proc.stderr[-2000:]
    assert sgd.proc.stderr.strip().splitlines()[-1].startswith(
        f"harness: error: --resume {tmp_path / 'sgd' / 'checkpoints' / 'step_00000002'}: holds the state of AdamW; "
        f"this run's optimizer is SGD, from optimizer.name = 'sgd' (command line), which cannot take it up.")


def test_checksums_split_the_bytes_evenly_and_name_the_piece_that_changed(tmp_path, monkeypatch):
    """The ranks hash shares of equal bytes, a file far larger than the rest in pieces (one ZeRO-0 file holds every
    weight and optimizer state: one rank had hashed it alone while the others waited); a changed byte is found in
    its piece, a record that is not sizes and digests is said as such, and a name outside the checkpoint too."""
    from harness.distributed.world import single_world

    monkeypatch.setattr(checksums, "CHUNK", 1000)
    ckpt = tmp_path / "step_00000004"
    (ckpt / "sub").mkdir(parents=True)
    (ckpt / "model_states.pt").write_bytes(bytes(range(256)) * 30)  # 7,680 bytes: 8 pieces
    for i in range(3):
        (ckpt / "sub" / f"rng_rank{i}.pt").write_bytes(b"x" * (100 + i))
    sizes = checksums._listing(ckpt)
    shares = checksums._shares(sizes, 3)
    loads = [sum(min(1000, sizes[n] - i * 1000) for n, i in share) for share in shares]
    assert sorted(p for share in shares for p in share) == sorted(
        [("model_states.pt", i) for i in range(8)] + [(f"sub/rng_rank{i}.pt", 0) for i in range(3)])
    assert max(loads) - min(loads) <= 1000, loads
    checksums.write_sums(ckpt)
    world = single_world()
    checksums.verify(ckpt, world)  # whole: nothing said
    raw = bytearray((ckpt / "model_states.pt").read_bytes())
    raw[5432] ^= 1
    (ckpt / "model_states.pt").write_bytes(bytes(raw))
    with pytest.raises(ConfigError, match=r"model_states.pt has changed since it was saved \(another SHA-256 in "
                                          r"its GiB number 6"):
        checksums.verify(ckpt, world)
    for record in ({"model_states.pt": {"size": "many", "sha256": []}}, {"../x": {"size": 0, "sha256": ["0"]}}, []):
        (ckpt / "checksums.json").write_text(json.dumps(record))
        with pytest.raises(ConfigError, match="its checksums.json cannot be read .*remove it to read the checkpoint"):
            checksums.verify(ckpt, world)
    (ckpt / "checksums.json").unlink()
    checksums.verify(ckpt, world)  # saved before checksums were recorded: read as it is

def _inside_largest_tensor(states: Path) -> int:
    """The offset of a byte in the middle of the largest tensor's data in a torch.save file (a zip)."""
    import zipfile

    with zipfile.ZipFile(states) as z:
        entry = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
    with open(states, "rb") as f:
        f.seek(entry.header_offset + 26)
        name_len, extra_len = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return entry.header_offset + 30 + name_len + extra_len + entry.file_size // 2


def test_a_checkpoint_changed_or_cut_short_is_one_line_naming_the_one_before_it(tmp_path, corpus):
    """A file of the latest checkpoint with a byte of a tensor changed (which had loaded silently: shown on a copy
    without checksums), truncated or gone: checked against the checksums.json saved with it before DeepSpeed reads
    it; that record damaged: said so. One saved before checksums were recorded: what reading it raises (before, a
    traceback from torch's zip reader or DeepSpeed's bare assert, exit 1, and a last line to resume from that same
    checkpoint)."""
    sets = ["train.save_every=2", "train.max_steps=6"]
    out = tmp_path / "run"
    harness(out, corpus, sets=sets, args=["--stop-at", "4"])
    ckpts = out / "checkpoints"
    step4 = ckpts / "step_00000004"
    states = next(step4.glob("*model_states.pt"))
    sums = json.loads((step4 / "checksums.json").read_text())
    assert set(sums) == {p.name for p in step4.iterdir()} - {"checksums.json"}
    saved = states.read_bytes()
    at = _inside_largest_tensor(states)
    flipped = saved[:at] + bytes([saved[at] ^ 1]) + saved[at + 1:]
    unchecked = tmp_path / "unchecked"  # the same change where no checksums were recorded: read, trained on
    shutil.copytree(out, unchecked)
    (unchecked / "checkpoints" / step4.name / states.name).write_bytes(flipped)
    (unchecked / "checkpoints" / step4.name / "checksums.json").unlink()
    assert harness(unchecked, corpus, sets=sets, args=["--resume", "auto"]).proc.returncode == 0
    before = f"the one before it is {ckpts / 'step_00000002'}: continue from it with --resume {ckpts / 'step_00000002'}"
    layout = (step4 / "layout.json").read_text()  # a record the checks before launch read: checked before they use it
    (step4 / "layout.json").write_text(layout.replace('"zero_stage": 0', '"zero_stage": 2'))  # (it had been "saved as
    bad = harness(out, corpus, sets=sets, args=["--resume", "auto"], check=False)  # ZeRO-2: resume it so")
    assert bad.proc.returncode == 2 and "is damaged: layout.json has changed since it was saved" in bad.proc.stderr
    (step4 / "layout.json").write_text(layout)
    for damage, said in (("a byte changed", f"{states.name} has changed since it was saved (another SHA-256)"),
                         ("cut short", f"{states.name} is 1,000 bytes, saved as {len(saved):,}"),
                         ("gone", f"{states.name} is gone"),
                         ("checksums edited", "its checksums.json cannot be read (not the sizes and SHA-256"),
                         ("no checksums, cut short", "cannot be read on rank 0 ("),
                         ("no checksums, gone", "cannot be read on rank 0 (")):
        states.write_bytes({"a byte changed": flipped, "gone": saved, "checksums edited": saved}.get(damage,
                                                                                                    saved[:1000]))
        if damage.endswith("gone"):
            for f in step4.glob("*.pt"):
                f.unlink()
        if damage == "checksums edited":
            (step4 / "checksums.json").write_text(json.dumps({states.name: {"size": "many"}}))
        if damage.startswith("no checksums"):
            (step4 / "checksums.json").unlink(missing_ok=True)
        bad = harness(out, corpus, sets=sets, args=["--resume", "auto"], check=False)
        assert bad.proc.returncode == 2, bad.proc.stderr[-3000:]
        line = bad.proc.stderr.strip().splitlines()[-1]
        assert line.startswith(f"harness: error: checkpoint {step4} "), line
        assert said in line and line.endswith(before), (damage, line)
        assert "Traceback" not in bad.proc.stderr
    resumed = harness(out, corpus, sets=sets, args=["--resume", str(ckpts / "step_00000002")])
    assert "at step 2" in resumed.proc.stdout and max(resumed.losses) == 6
    # the export gone (as `evaluate` advises for a damaged one): --resume auto exports again, evaluating once more
    # in place of the final evaluation, not beside it
    (out / "model.safetensors").unlink()
    again = harness(out, corpus, sets=sets, args=["--resume", "auto"])
    assert (out / "model.safetensors").exists() and [e["step"] for e in again.evals].count(6) == 1, again.evals


def test_the_rank_that_cannot_read_its_file_is_the_one_reported_not_the_peers_it_left(tmp_path, monkeypatch):
    """Rank 1's optimizer file cut short: rank 1 stops with the line naming the checkpoint before (exit 2), and rank
    0, waiting for it in a collective, with "lost its connection to another rank" (exit 4). Local rank 0 reported
    last and won, so `harness launch` ended 4, advising --resume auto, which took the same checkpoint again."""
    from harness.distributed.world import STATUS_ENV
    from harness.launcher.supervise import report
    from harness.run.heartbeat import EXIT_HUNG

    status = tmp_path / "status.json"
    status.write_text("")
    monkeypatch.setenv(STATUS_ENV, str(status))
    for order in ([(1, 2), (0, EXIT_HUNG)], [(0, EXIT_HUNG), (1, 2)]):  # whichever ends first
        status.write_text("")
        for rank, code in order:
            monkeypatch.setenv("LOCAL_RANK", str(rank))
            assert report(code, f"rank {rank}") == code
        assert json.loads(status.read_text()) == {"code": 2, "message": "rank 1"}
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert report(3, "every rank stopped: non-finite") == 0  # local rank 0's own account of a stop made together
    assert json.loads(status.read_text())["code"] == 3


def test_a_lost_rank_or_memory_while_loading_is_not_called_a_damaged_checkpoint(tmp_path):
    """Only the file's faults become the one line naming the checkpoint before; a peer gone, a timeout or memory
    run out leave as they came (the loop's lost-rank and timeout lines, exit 4)."""
    from types import SimpleNamespace

    from harness.run.checkpoint import _said_unreadable

    for step in (2, 4):
        (tmp_path / f"step_{step:08d}").mkdir()
    world = SimpleNamespace(rank=1)
    with pytest.raises(ConfigError, match=r"cannot be read on rank 1 \(RuntimeError: PytorchStreamReader failed "
                                          r".*the one before it is .*step_00000002"):
        _said_unreadable(tmp_path / "step_00000004", world, RuntimeError("PytorchStreamReader failed reading zip"))
    for error in (RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection closed by peer [127.0.0.1]:6000"),
                  RuntimeError("Timed out waiting 60000ms for recv operation to complete"),
                  torch.OutOfMemoryError("CUDA out of memory")):
        with pytest.raises(type(error)) as raised:
            _said_unreadable(tmp_path / "step_00000004", world, error)
        assert raised.value is error
