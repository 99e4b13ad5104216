"""Trackers: W&B offline in the run directory when no API key is configured, TensorBoard as the other choice; what a
run writes when its output is a log, not a terminal."""
from __future__ import annotations

import io
import json
import re
import struct
import subprocess
import time

import pytest
from conftest import ROOT, _env, command, harness


def wandb_records(path):
    """Records of a .wandb file: LevelDB log format (32 KiB blocks, 7-byte record headers) of protobufs."""
    from wandb.proto import wandb_internal_pb2 as pb

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, block, buf = 7, 32768, b""
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7]) if left >= 7 else (0, 0, 0)
        if length == 0 and kind == 0:  # block padding
            pos += left
            continue
        buf += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last fragment of one
            record = pb.Record()
            record.ParseFromString(buf)
            buf = b""
            yield record


def test_wandb_offline_run_holds_the_logged_metrics(tmp_path, corpus):
    env = {"WANDB_MODE": None, "WANDB_API_KEY": None, "NETRC": str(tmp_path / "none")}  # no key anywhere
    run = harness(tmp_path / "run", corpus, env=env, sets=["logging.backend=\"wandb\"", "train.max_steps=3",
                                                           "run.name=\"tiny\"", "logging.project=\"proj\""])
    files = list((run.dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1, list(run.dir.rglob("*"))
    assert [r.exit.exit_code for r in wandb_records(files[0]) if r.HasField("exit")] == [0]  # finished
    assert f"logging: W&B offline into {run.dir / 'wandb'}" in run.proc.stdout
    history = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
               for r in wandb_records(files[0]) if r.WhichOneof("record_type") == "history"]
    train = [h for h in history if "train/loss" in h]
    assert [h["_step"] for h in train] == [1, 2, 3]
    assert [h["train/loss"] for h in train] == [m["loss"] for m in run.metrics]
    assert any("eval/loss" in h for h in history)
    meta = next(r.run for r in wandb_records(files[0]) if r.WhichOneof("record_type") == "run")
    assert (meta.display_name, meta.project) == ("tiny", "proj")
    config = [r.config for r in wandb_records(files[0]) if r.WhichOneof("record_type") == "config"]
    keys = {item.key for c in config for item in c.update}
    assert {"train.max_steps", "layout.world_size", "layout.zero_stage", "layout.precision"} <= keys, keys
    # resumed for more steps: the same W&B run goes on (a new one had started at each resume)
    harness(tmp_path / "run", corpus, env=env, sets=["logging.backend=\"wandb\"", "train.max_steps=5",
                                                     "run.name=\"tiny\"", "logging.project=\"proj\""],
            args=["--resume", "auto"])
    runs = sorted((run.dir / "wandb").glob("offline-run-*/run-*.wandb"))
    ids = {next(r.run for r in wandb_records(f) if r.WhichOneof("record_type") == "run").run_id for f in runs}
    assert len(runs) == 2 and ids == {(run.dir / "wandb" / "harness_run_id").read_text().strip()}, (runs, ids)
    # a crash had logged past the checkpoint, which W&B would keep: the resume goes on in a new W&B run
    with (run.dir / "metrics.jsonl").open("a") as f:
        f.write(json.dumps({"step": 9, "loss": 1.0}) + "\n")
    harness(tmp_path / "run", corpus, env=env, sets=["logging.backend=\"wandb\"", "train.max_steps=6",
                                                     "run.name=\"tiny\"", "logging.project=\"proj\""],
            args=["--resume", "auto"])
    runs = sorted((run.dir / "wandb").glob("offline-run-*/run-*.wandb"))
    newer = {next(r.run for r in wandb_records(f) if r.WhichOneof("record_type") == "run").run_id for f in runs}
    assert len(runs) == 3 and len(newer - ids) == 1, (runs, newer)
    # a tracker that cannot start (a mode W&B refuses): one line, and the run goes on with its jsonl record
    refused = harness(tmp_path / "refused", corpus, env={**env, "WANDB_MODE": "bogus"},
                      sets=["logging.backend=\"wandb\"", "train.max_steps=2"])
    assert "harness: logging.backend wandb: start failed (" in refused.proc.stderr and len(refused.metrics) == 2
    # a key, but no server answers: W&B's record kept offline, said in one line (it waited 90 s, then dropped W&B)
    unreachable = {**env, "WANDB_API_KEY": "0" * 40, "WANDB_BASE_URL": "http://127.0.0.1:9", "WANDB_INIT_TIMEOUT": "5"}
    cut_off = harness(tmp_path / "cut_off", corpus, env=unreachable, sets=["logging.backend=\"wandb\"",
                                                                         "train.max_steps=2"])
    assert "harness: logging.backend wandb: could not start online (" in cut_off.proc.stderr
    assert "logging offline instead" in cut_off.proc.stderr and "start failed" not in cut_off.proc.stderr
    offline = list((cut_off.dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(offline) == 1 and [r.history for r in wandb_records(offline[0]) if r.HasField("history")]


def test_wandb_disabled_is_said_in_one_line(tmp_path, monkeypatch, capsys):
    """WANDB_MODE=disabled: W&B logs nothing and says nothing, and the run had said nothing either."""
    from accelerate.state import PartialState

    from harness.config.run import RunConfig
    from harness.run.tracking import Tracker

    monkeypatch.setenv("WANDB_MODE", "disabled")
    PartialState(cpu=True)  # accelerate's trackers need its state; no process group on one process
    try:
        Tracker(RunConfig(), tmp_path, enabled=True).close(0)
    finally:
        PartialState._reset_state()
    said = capsys.readouterr()
    assert f"logging: W&B disabled (WANDB_MODE=disabled): metrics.jsonl and eval.jsonl in {tmp_path}" in said.out
    assert "start failed" not in said.err and not list(tmp_path.glob("wandb/*run-*")), said


def test_a_log_s_progress_lines_say_where_a_bar_ended_once(monkeypatch, capsys):
    """In a log: a bar's last line once (a stop printed it twice), and a bar that leaves nothing (an evaluation's)
    still says where it ended once it said where it began (it showed 0/29 only)."""
    from harness import console

    monkeypatch.delenv(console.STDERR_TTY_ENV, raising=False)
    train = console.progress(total=4, desc="train", every=1000)
    train.update(4)
    train.refresh()
    train.close()
    scoring = console.progress(total=29, desc="scoring", leave=False, every=1000)
    scoring.update(29)
    scoring.close()
    lines = capsys.readouterr().err.splitlines()
    assert [line.split("|")[0] for line in lines] == ["train:   0%", "train: 100%", "scoring:   0%", "scoring: 100%"]


def test_a_log_s_lines_of_a_loop_give_its_count_at_their_time(monkeypatch, capsys):
    """A bar over an iterable (an evaluation's batches) in a log: each line its count then, not tqdm's monitor
    thread's redraw of the count last drawn with a later time (the same count twice, 10 s apart)."""
    import time

    from tqdm import tqdm

    from harness import console

    monkeypatch.delenv(console.STDERR_TTY_ENV, raising=False)
    monkeypatch.setattr(tqdm, "monitor_interval", 0.05)  # tqdm's 10 s, and its bar's 10 s maxinterval, made short
    for _ in console.progress(range(60), desc="scoring", every=0.3, maxinterval=0.1):
        time.sleep(0.01)
    counts = [line.split("|")[2].split("/")[0].strip() for line in capsys.readouterr().err.splitlines()]
    assert len(counts) > 2 and len(set(counts)) == len(counts), counts


def test_launch_log_keeps_each_bar_s_last_frame_before_other_output():
    """A terminal's bars in the job's stderr (redrawn after each \\r; an evaluation's below the training bar's, each
    redraw on its own line between cursor moves; one without a description): launch.log keeps each bar's last frame
    before other output, one a line, and every other line as written (a log's own progress lines too)."""
    from harness.launcher.relay import kept_lines

    stderr = (b"harness: task lm\n\rtrain:   1%|  | 1/100\rtrain:   2%|  | 2/100\n\r  0%|x| 0/10 [00:00<?]\x1b[A"
              b"\n\r 50%|x| 5/10 [00:01<00:01]\x1b[A\rtrain:   3%|  | 3/100\r     \reval step 3: loss 1\r\n\r\n"
              b"train: 10%|x| 10/100 [00:30]\ntrain: 20%|x| 20/100 [01:00]\n\rtrain: 100%|  | 100/100")
    assert b"".join(kept_lines(io.BytesIO(stderr))) == (
        b"harness: task lm\ntrain:   2%|  | 2/100\n 50%|x| 5/10 [00:01<00:01]\ntrain:   3%|  | 3/100\n"
        b"eval step 3: loss 1\n\r\ntrain: 10%|x| 10/100 [00:30]\ntrain: 20%|x| 20/100 [01:00]\n"
        b"train: 100%|  | 100/100\n")


def test_lines_go_where_the_bar_goes(monkeypatch, capsys):
    """Under `harness launch` the bar reaches the terminal through the relay of stderr: an evaluation's line on stdout
    landed in the middle of it. Elsewhere lines stay on stdout."""
    from harness import console

    for relayed, stream in (("1", "err"), ("", "out")):
        monkeypatch.setenv(console.STDERR_TTY_ENV, relayed)
        bar = console.progress(total=3, desc="train")
        bar.write("step 2: update skipped")
        console.write("eval step 3: loss 1")
        bar.close()
        said = capsys.readouterr()
        assert "step 2: update skipped\n" in getattr(said, stream) and "eval step 3: loss 1\n" in getattr(said, stream)
        assert "eval step" not in getattr(said, "out" if stream == "err" else "err")


def test_a_log_gets_plain_progress_lines_and_deepspeed_s_chatter_stays_in_the_run(tmp_path, corpus):
    """stderr a pipe: progress as whole lines (no carriage-return frames), the last one at the end; DeepSpeed's op
    builder lines go to RUN/deepspeed.log, not the output."""
    out = tmp_path / "run"  # read as bytes: text mode would turn a "\r" into a newline
    proc = subprocess.run(command(out, corpus, sets=["train.max_steps=6", "train.eval_every=3"]), cwd=ROOT,
                          env=_env(), capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = proc.stdout + proc.stderr
    assert b"\r" not in said and b"built successfully" not in said and b"eval step 3:" in said
    assert re.search(rb"^train: 100%.*\| 6/6 \[", proc.stderr, re.M), proc.stderr[-2000:]
    assert "built successfully" in (out / "deepspeed.log").read_text()


def test_tensorboard_backend_writes_event_files(tmp_path, corpus):
    run = harness(tmp_path / "run", corpus, sets=["logging.backend=\"tensorboard\"", "train.max_steps=2"])
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run.dir / "tensorboard" / run.dir.name))  # the tracker's writer, named after the run
    acc.Reload()
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2]


def test_a_record_s_loss_avg_is_the_mean_of_the_steps_it_stands_for(tmp_path, corpus):
    """train.log_every = 5: each record's `loss` is its step's own (comparable with any run's at that step), its
    `loss_avg` the loss of the 5 steps since the record before (the progress bar's, and curves.png's): a record had
    shown 1 step of 5."""
    every = harness(tmp_path / "every", corpus, sets=["train.max_steps=10", "train.log_every=1"])
    fifth = harness(tmp_path / "fifth", corpus, sets=["train.max_steps=10", "train.log_every=5"])
    assert [m["step"] for m in fifth.metrics] == [5, 10]
    # each record's wall-clock time (a loss against time, records against launch.log's lines)
    assert every.metrics[0]["time"] <= every.metrics[-1]["time"] <= fifth.metrics[0]["time"] <= time.time()
    # what DeepSpeed printed as the world started: each start's under a line with its date
    assert re.match(r"=== \d{4}-\d\d-\d\d \d\d:\d\d:\d\d ===\n", (fifth.dir / "deepspeed.log").read_text())
    for m in fifth.metrics:
        steps = [e["loss"] for e in every.metrics if m["step"] - 5 < e["step"] <= m["step"]]
        assert m["loss"] == pytest.approx(steps[-1], rel=1e-6)
        assert m["loss_avg"] == pytest.approx(sum(steps) / 5, rel=1e-6) != pytest.approx(m["loss"], rel=1e-6)


def test_a_finished_run_draws_its_curves_and_plot_overlays_runs(tmp_path, corpus, capsys):
    import shutil

    from harness.cli import main
    from harness.run.plots import PLOT_FILE, curves

    run = harness(tmp_path / "run", corpus, sets=["logging.plots=true", "train.eval_every=3"])
    png = run.dir / PLOT_FILE
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"curves {png}" in run.proc.stdout
    panels = {p["title"]: p["lines"]["run"] for p in curves([run.dir])}
    assert list(panels) == ["training loss", "learning rate", "validation loss", "validation perplexity"]
    assert panels["training loss"] == [(m["step"], m["loss_avg"]) for m in run.metrics]  # every logged step
    assert [s for s, _ in panels["validation loss"]] == [3, 6]
    other = tmp_path / "other"  # a second run to overlay: the same one, its losses doubled
    shutil.copytree(run.dir, other)
    (other / "metrics.jsonl").write_text("".join(json.dumps({**m, "loss_avg": 2 * m["loss_avg"]}) + "\n"
                                                 for m in run.metrics)
                                         + '{"step": 7, "lo')  # and a line a killed writer cut short: left out
    out = tmp_path / "both.png"
    assert main(["plot", str(run.dir), str(other), "--out", str(out)]) == 0
    assert out.read_bytes()[:4] == b"\x89PNG"
    both = {p["title"]: p["lines"] for p in curves([run.dir, other])}
    assert list(both["training loss"]) == ["run", "other"]  # named by what tells them apart (not their whole paths)
    assert both["training loss"]["other"][0][1] == 2 * both["training loss"]["run"][0][1]
    (tmp_path / "b").mkdir()
    shutil.copytree(run.dir, tmp_path / "b" / "run")
    assert list(curves([run.dir, tmp_path / "b" / "run"])[0]["lines"]) == [f"{tmp_path.name}/run", "b/run"]
    # against the samples read: each record's samples_seen, an evaluation's from the records around its step
    by_samples = {p["title"]: p["lines"]["run"] for p in curves([run.dir], x="samples")}
    batch = run.metrics[0]["samples_seen"] // run.metrics[0]["step"]
    assert by_samples["training loss"] == [(m["samples_seen"], m["loss_avg"]) for m in run.metrics]
    assert [n for n, _ in by_samples["validation loss"]] == [3 * batch, 6 * batch]
    capsys.readouterr()
    assert main(["plot", str(run.dir), str(other), "--x", "samples", "--out", str(out)]) == 0
    table = capsys.readouterr().out.splitlines()[1:]  # each run's last figures, beside the picture
    last, final = run.metrics[-1], run.evals[-1]
    assert table[0].split() == ["run", "step", "training", "loss", "validation", "loss", "validation", "perplexity",
                                "best"]
    assert table[1].split() == ["run", str(last["step"]), f"{last['loss_avg']:.6g}", f"{final['loss']:.6g}",
                                f"{final['perplexity']:.6g}", "-"]
    assert table[2].split()[:3] == ["other", str(last["step"]), f"{2 * last['loss_avg']:.6g}"]
    assert main(["plot", str(tmp_path / "none"), "--out", str(out)]) == 2  # nothing to draw: one line, exit 2
    assert main(["plot", str(run.dir), str(tmp_path / "typo"), "--out", str(out)]) == 2  # not one of two, silently
    assert main(["plot", str(run.dir), str(tmp_path / "b"), "--out", str(out)]) == 2  # a folder that is no run
    assert f"{tmp_path / 'b'}: no run directory (none of config.toml, metrics.jsonl, eval.jsonl there)" in \
        capsys.readouterr().err
    assert main(["plot", str(run.dir), str(run.dir / ".." / "run"), "--out", str(out)]) == 2  # one run, two names
    assert "is named twice: name each run once" in capsys.readouterr().err
    png.unlink()
    assert main(["plot", str(run.dir)]) == 0 and png.read_bytes()[:4] == b"\x89PNG"  # no --out: the run's own
    assert main(["plot", str(run.dir), str(other)]) == 0  # several: beside the first
    assert (tmp_path / "compare.png").read_bytes()[:4] == b"\x89PNG"
    # the step select_best chose and the baselines evaluated beside the metric (a price run's, written here)
    priced = tmp_path / "priced"
    shutil.copytree(run.dir, priced)
    (priced / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in (
        {"step": 3, "loss": 0.5, "mse": 0.4, "persistence_mse": 0.45, "period_1_persistence_mse": 9.0},
        {"step": 6, "loss": 0.4, "mse": 0.3, "persistence_mse": 0.44, "drift_mse": 0.5, "price_mse": 17.6,
         "persistence_price_mse": 19.2, "copy_source_mse": 0.9})))  # price: the model's own on another scale
    (priced / "best.json").write_text(json.dumps({"metric": "mse", "step": 6}, indent=2))
    marked = {p["title"]: p for p in curves([priced])}
    assert marked["validation mse"]["best"] == {"priced": 6} and marked["validation loss"]["best"] == {"priced": 6}
    assert marked["validation mse"]["baselines"] == {"persistence": 0.44, "drift": 0.5, "copy_source": 0.9}
    assert marked["training loss"]["best"] == {}
    assert main(["plot", str(priced)]) == 0 and (priced / PLOT_FILE).read_bytes()[:4] == b"\x89PNG"
    # refused before drawing, in one line: runs of other tasks on one axis, an --out that names no PNG file
    (priced / "config.toml").write_text((priced / "config.toml").read_text().replace('task = "lm"', 'task = "prices"'))
    assert main(["plot", str(run.dir), str(priced), "--out", str(out)]) == 2
    assert "runs of different tasks (lm: " in capsys.readouterr().err
    for bad in ("curves.txt", "no_suffix", "."):
        assert main(["plot", str(run.dir), "--out", str(tmp_path / bad)]) == 2
        assert "name a .png file to draw into" in capsys.readouterr().err
    (priced / "best.json").write_text("[6]")  # files that do not read as a run's: left out, not a traceback
    with (priced / "eval.jsonl").open("a") as f:
        f.write(json.dumps({"loss": 0.1}) + "\n")
    assert main(["plot", str(priced)]) == 0


def test_a_record_that_cannot_be_written_says_whether_a_checkpoint_is_kept(tmp_path):
    """The line had said "its last checkpoint kept" where the run had saved none (its resume starts at step 0)."""
    from harness.config.run import LoggingSection, RunConfig, TrainingStopped
    from harness.run.tracking import Tracker

    (tmp_path / "metrics.jsonl").mkdir()  # a record that cannot be written
    for saved in (False, True):
        if saved:
            (tmp_path / "checkpoints").mkdir()
            (tmp_path / "checkpoints" / "latest").write_text("step_00000002\n")
        tracker = Tracker(RunConfig(logging=LoggingSection(backend="none")), tmp_path, enabled=True)
        with pytest.raises(TrainingStopped) as stop:
            tracker.log({"step": 3, "loss": 1.0})
        assert str(stop.value).endswith(("the run stops, its last checkpoint kept" if saved else
                                         "the run stops, no checkpoint saved yet (a resume starts at step 0)") +
                                        ": fix that and continue with --resume auto"), stop.value  # (a directory)


def test_the_evaluations_between_records_are_left_out_of_their_step_time(tmp_path, corpus):
    """An evaluation between two records (100 micro-batches of at least 10 ms each here) is given as the next record's
    paused_s and left out of its step_s, tokens_per_s and tflops: a run's throughput had dipped at each evaluation."""
    slow = ["--run", "examples/digits.toml", "--set", 'run.task="tests.slow_eval_task:SlowEvalDigits"']
    run = harness(tmp_path / "run", corpus, env={"SLOW_EVAL_S": "0.01"}, args=slow,
                  sets=["task.test_samples=1600", "train.micro_batch_size=16", "train.max_steps=10",
                        "train.eval_every=5", "train.log_every=5"])
    first, second = run.metrics
    assert "paused_s" not in first and second["paused_s"] >= 100 * 0.01, run.metrics
