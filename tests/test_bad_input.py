"""Bad input of every kind ends `harness train` with exit 2 and one line naming the key (or the file and line)
before any process group starts: the table below runs each case in this process, with init_world replaced by a
trap that fails the test if a case gets that far."""
from __future__ import annotations

import gzip
import json
import os
import re
from types import SimpleNamespace

import pytest

from harness.distributed import world
from harness.cli import main

S = "--set"
TWO_STEPS = [S, "train.max_steps=2"]

# (id, extra arguments, run-file text or None, DeepSpeed JSON text or None, what the error line must contain)
CASES = [
    # the run config: numbers out of range or not numbers
    ("lr-nan", [S, "optimizer.lr=nan"], None, None, "optimizer.lr must be a finite number"),
    ("lr-inf", [S, "optimizer.lr=inf"], None, None, "optimizer.lr must be a finite number"),
    ("lr-negative", [S, "optimizer.lr=-1"], None, None, "optimizer.lr = -1.0"),
    ("beta1-one", [S, "optimizer.beta1=1.0"], None, None, "optimizer.beta1 = 1.0"),
    ("beta2-negative", [S, "optimizer.beta2=-0.1"], None, None, "optimizer.beta2 = -0.1"),
    ("eps-zero", [S, "optimizer.eps=0.0"], None, None, "optimizer.eps = 0.0"),
    ("eps-negative", [S, "optimizer.eps=-1e-8"], None, None, "optimizer.eps = -1e-08"),
    ("weight-decay-negative", [S, "optimizer.weight_decay=-0.1"], None, None, "optimizer.weight_decay"),
    ("momentum-one", [S, "optimizer.name=\"sgd\"", S, "optimizer.momentum=1.0"], None, None, "optimizer.momentum"),
    ("optimizer-unknown", [S, "optimizer.name=\"lion\""], None, None, "optimizer.name must be one of"),
    ("min-lr-ratio-negative", [S, "schedule.min_lr_ratio=-0.5"], None, None, "schedule.min_lr_ratio = -0.5"),
    ("min-lr-ratio-above-one", [S, "schedule.min_lr_ratio=1.5"], None, None, "schedule.min_lr_ratio = 1.5"),
    ("schedule-kind", [S, "schedule.kind=\"step\""], None, None, "schedule.kind must be one of"),
    ("warmup-negative", [S, "schedule.warmup_steps=-1"], None, None, "schedule.warmup_steps"),
    ("dropout-above-one", [S, "model.dropout=1.5"], None, None, "model.dropout = 1.5"),
    ("dropout-nan", [S, "model.dropout=nan"], None, None, "model.dropout must be a finite number"),
    ("d-model-zero", [S, "model.d_model=0"], None, None, "model.d_model"),
    ("heads-do-not-divide", [S, "model.n_heads=3"], None, None, "model.n_heads must divide model.d_model"),
    ("layers-negative", [S, "model.n_layers=-2"], None, None, "model.n_layers"),
    ("d-ff-negative", [S, "model.d_ff=-1"], None, None, "model.d_ff"),
    ("vocab-negative", [S, "model.vocab_size=-1"], None, None, "model.vocab_size"),
    ("hf-tokenizer-without-hf", [S, "model.hf_tokenizer=false"], None, None, "model.hf_tokenizer"),
    ("trust-remote-code-without-hf", [S, "model.trust_remote_code=true"], None, None,
     "model.trust_remote_code = True (command line) applies to a Hugging Face model"),
    ("seq-len-zero", [S, "data.seq_len=0"], None, None, "data.seq_len"),
    ("val-fraction-one", [S, "data.val_fraction=1.0"], None, None, "data.val_fraction"),
    ("max-row-chars-zero", [S, "data.max_row_chars=0"], None, None, "data.max_row_chars"),
    ("workers-negative", [S, "data.num_workers=-1"], None, None, "data.num_workers"),
    ("data-format", [S, "data.format=\"xml\""], None, None, "data.format must be one of"),
    ("bucket-fixed-length-task", [S, "data.bucket=4"], None, None, "data.bucket"),
    ("buckets-short", [S, 'data.length_buckets="32,64"'], None, None, "does not cover data.seq_len = 128"),
    ("buckets-past-seq-len", [S, 'data.length_buckets="64,256"'], None, None, "pads past the model's positions"),
    ("buckets-descending", [S, 'data.length_buckets="128,64"'], None, None, "> 0 and ascending"),
    ("buckets-not-lengths", [S, 'data.length_buckets="short"'], None, None, "whole lengths separated by commas"),
    ("buckets-fixed-length-task", [S, "data.length_buckets=[64, 128]"], None, None,
     "data.length_buckets = '64,128' (command line): task 'lm' does not say how to pad"),
    ("compile-zero3", [S, "train.compile=true"], None, {"zero_optimization": {"stage": 3}},
     "train.compile = True (command line) with ZeRO-3"),
    ("micro-batch-zero", [S, "train.micro_batch_size=0"], None, None, "train.micro_batch_size"),
    ("accumulation-zero", [S, "train.grad_accum_steps=0"], None, None, "train.grad_accum_steps"),
    ("max-steps-negative", [S, "train.max_steps=-5"], None, None, "train.max_steps"),
    ("epochs-negative", [S, "train.epochs=-1.0"], None, None, "train.epochs"),
    ("steps-and-epochs", [S, "train.epochs=1.0"], None, None, "set one of train.max_steps and train.epochs"),
    ("no-length", [S, "train.max_steps=0"], None, None, "train.max_steps or train.epochs"),
    ("clip-nan", [S, "train.grad_clip=nan"], None, None, "train.grad_clip must be a finite number"),
    ("clip-negative", [S, "train.grad_clip=-1.0"], None, None, "train.grad_clip"),
    ("log-every-zero", [S, "train.log_every=0"], None, None, "train.log_every"),
    ("keep-zero", [S, "train.keep_checkpoints=0"], None, None, "train.keep_checkpoints"),
    ("seed-negative", [S, "train.seed=-1"], None, None, "train.seed"),
    ("seed-past-the-generators", [S, "train.seed=18446744073709551616"], None, None,
     "train.seed: 18446744073709551616 must be in [0, 2**32)"),
    ("nonfinite-steps-zero", [S, "train.max_nonfinite_steps=0"], None, None, "train.max_nonfinite_steps"),
    ("global-batch-indivisible", [S, "train.global_batch_size=7"], None, None, "train.global_batch_size"),
    ("select-mode-alone", [S, "train.select_mode=\"max\""], None, None, "train.select_mode"),
    ("collective-timeout-zero", [S, "train.collective_timeout_s=0.0"], None, None, "train.collective_timeout_s"),
    ("disk-too-small", [S, "model.d_model=262144"], None, None,  # 1.6e12 parameters: 61,000 GiB of checkpoints
     "GiB free on its file system; this run needs about"),
    ("patience-without-evaluations", [S, "train.select_best=\"loss\"", S, "train.early_stopping_patience=2"], None,
     None, "train.early_stopping_patience"),
    ("select-unknown-metric", [S, "train.select_best=\"accuracy\""], None, None, "train.select_best"),
    ("profile-step-negative", [S, "train.profile_step=-1"], None, None, "train.profile_step"),
    ("profile-step-after-the-end", [S, "train.profile_step=5"], None, None,
     "train.profile_step = 5 (command line) comes after the run's last step"),
    ("output-dir-empty", [S, 'run.output_dir=""'], None, None, "run.output_dir: '' names no directory"),
    ("int-given-float", [S, "train.micro_batch_size=2.5"], None, None, "train.micro_batch_size must be int"),
    ("int-given-string", [S, "train.log_every=\"ten\""], None, None, "train.log_every must be int"),
    ("int-given-bool", [S, "model.d_model=true"], None, None, "model.d_model must be int"),
    ("unknown-key", [S, "train.max_step=3"], None, None,
     "`train.max_step` (command line); did you mean `train.max_steps`"),
    ("unknown-section", [S, "optimzer.lr=1e-3"], None, None, "optimzer.lr"),
    ("wandb-project-name", [S, 'logging.project="team/proj"'], None, None,
     "logging.project = 'team/proj' (command line) is not a W&B project name"),
    ("key-in-other-section", [S, "train.lr=1e-3"], None, None,
     "`train.lr` (command line); did you mean `optimizer.lr`"),
    ("other-task-section", [S, "translation.beam_size=2"], None, None, "[translation] keys belong to run.task"),
    ("task-key-out-of-range", [S, 'run.task="protein"', S, "protein.train_subsample=-1"], None, None,
     "protein.train_subsample = -1 (command line) must be >= 0"),
    ("unknown-task", [S, "run.task=\"nosuch\""], None, None, "nosuch"),
    ("override-syntax", [S, "train.max_steps"], None, None, "--set expects section.key=value"),
    ("override-toml-duplicate", [S, 'data.mix={"a" = 0.5, "a" = 0.5}'], None, None,
     "--set data.mix: {\"a\" = 0.5, \"a\" = 0.5} is not a TOML value: Duplicate inline table key 'a'"),
    ("override-toml-unterminated", [S, 'run.name="runs'], None, None, "is not a TOML value: Unterminated string"),
    # the run file
    ("run-file-syntax", [], "[train]\nmax_steps = 3\nlr = = 2\n", None, "line 3"),
    ("run-file-nan", [], "[train]\nmax_steps = 3\ngrad_clip = nan\n", None, "train.grad_clip must be a finite number"),
    ("run-file-section-not-table", [], "train = 5\n", None, "[train] must be a table"),
    ("run-file-missing", ["--run", "/nonexistent/run.toml"], None, None, "/nonexistent/run.toml"),
    # the DeepSpeed config: types as DeepSpeed reads them, ranges, contradictions
    ("ds-stage-string", [], None, {"zero_optimization": {"stage": "2"}}, "zero_optimization.stage = \"2\""),
    ("ds-stage-out-of-range", [], None, {"zero_optimization": {"stage": 5}}, "should be 0, 1, 2 or 3"),
    ("ds-zero-key-typo", [], None, {"zero_optimization": {"stag": 2}}, "did you mean `stage`"),
    ("ds-offload-ratio-below-3", [], None,  # a check of the whole section: named, without pydantic's prefix
     {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 0.3}}},
     "): Partial offloading only supported for ZeRO Stage 3"),
    ("ds-stage-bool", [], None, {"zero_optimization": {"stage": True}}, "stage = true (ds file"),
    ("ds-stage-float", [], None, {"zero_optimization": {"stage": 2.0}}, "stage = 2.0 (ds file"),
    ("ds-zero-auto-unfillable", [], None, {"zero_optimization": {"stage": 2, "allgather_bucket_size": "auto"}},
     "zero_optimization.allgather_bucket_size = \"auto\""),
    ("ds-fp16-key-typo", [], None, {"fp16": {"enabled": True, "loss_scal": 0}}, "did you mean `loss_scale`"),
    ("ds-bf16-switch-string", [], None, {"bf16": {"immediate_grad_update": "yes"}},
     "bf16.immediate_grad_update = \"yes\""),
    ("ds-amp", [], None, {"amp": {"enabled": True}}, "removed its Apex AMP integration"),
    ("ds-nvme-without-path", [], None, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}},
     "needs zero_optimization.offload_param.nvme_path"),
    ("ds-scheduler-total-contradicts", [], None,
     {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 10}}},
     "scheduler.params.total_num_steps = 10 vs train.max_steps = 2"),
    ("ds-switch-string", [], None, {"zero_optimization": {"stage": 2, "overlap_comm": "true"}},
     "zero_optimization.overlap_comm = \"true\""),
    ("ds-bf16-enabled-string", [], None, {"bf16": {"enabled": "false"}}, "bf16.enabled = \"false\""),
    ("ds-fp16-not-object", [], None, {"fp16": True}, "fp16"),
    ("ds-both-precisions", [], None, {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "both true"),
    ("ds-loss-scale-negative", [], None, {"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale = -1"),
    ("ds-scale-power-float", [], None, {"fp16": {"enabled": True, "initial_scale_power": 1.5}},
     "fp16.initial_scale_power"),
    ("ds-clipping-string", [], None, {"gradient_clipping": "1.0"}, "gradient_clipping = \"1.0\""),
    ("ds-clipping-nan", [], None, "{\"gradient_clipping\": NaN}", "gradient_clipping = NaN"),
    ("ds-micro-batch-bool", [], None, {"train_micro_batch_size_per_gpu": True}, "train_micro_batch_size_per_gpu"),
    ("ds-micro-batch-contradicts", [], None, {"train_micro_batch_size_per_gpu": 3},
     "contradicts train.micro_batch_size"),
    ("ds-unknown-key", [], None, {"zero_optimisation": {"stage": 1}}, "did you mean `zero_optimization`"),
    ("ds-scheduler-unknown", [], None, {"scheduler": {"type": "CosineAnnealing"}}, "scheduler.type = 'CosineAnnealing'"),
    ("ds-scheduler-auto-unfillable", [], None, {"scheduler": {"type": "OneCycle", "params": {"cycle_min_lr": "auto"}}},
     "scheduler.params.cycle_min_lr = \"auto\""),
    ("ds-optimizer-not-deepspeed", [], None, {"optimizer": {"type": "Adamx"}}, "is not an optimizer DeepSpeed has"),
    ("accelerate-contradicts-ds", [], None, {"zero_optimization": {"stage": 2}}, "accelerate zero_stage = 3"),
    ("ds-offload-param-stage-1", [], None, {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}},
     "offload_param"),
    ("ds-offload-stage-0", [], None, {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}},
     "offload_optimizer"),
    ("ds-optimizer-contradicts", [], None, {"optimizer": {"type": "Lamb"}}, "optimizer.type"),
    ("ds-pipeline-stages-string", [], None, {"pipeline": {"stages": "2"}}, "pipeline.stages = \"2\""),
    ("ds-autotp-float", [], None, {"tensor_parallel": {"autotp_size": 1.5}}, "tensor_parallel.autotp_size"),
    ("ds-syntax", [], None, "{\n  \"zero_optimization\": {\"stage\": 2}}}\n}", "line 2"),
    ("ds-key-twice", [], None, '{"zero_optimization": {"stage": 2}, "zero_optimization": {"stage": 3}}',
     "the key 'zero_optimization' is given twice"),
    ("ds-empty-name", ["--ds", ""], None, None, "--ds is empty"),
    ("ds-removed-feature", [], None, {"elasticity": {"enabled": True}},
     "DeepSpeed refuses it: Elastic training has been removed"),
    ("ds-not-applied", [], None, {"activation_checkpointing": {"partition_activations": True}},
     "activation_checkpointing (ds file"),
    ("ds-old-spelling", [], None, {"zero_optimization": {"stage": 2, "cpu_offload": True}},
     "write zero_optimization.offload_optimizer: {\"device\": \"cpu\"}"),
    ("ds-untested-optimizer-refused", [], None, {"zero_optimization": {"stage": 2}, "zero_allow_untested_optimizer":
                                                 False, "optimizer": {"type": "SGD", "params": {"lr": "auto"}}},
     "zero_allow_untested_optimizer = false"),
    ("ds-monitor-key-typo", [], None, {"tensorboard": {"enabled": False, "outpt_path": "x"}},
     "tensorboard.outpt_path (ds file"),
    ("ds-monitor-on", [], None, {"wandb": {"enabled": True}}, "wandb.enabled (ds file"),
    ("ds-plain-section-typo", [], None, {"flops_profiler": {"profile_stepp": 3}}, "did you mean `profile_step`"),
    ("ds-missing", ["--ds", "/nonexistent/ds.json"], None, None, "/nonexistent/ds.json"),
    ("ds-shipped-path-from-elsewhere", ["--ds", "/elsewhere/configs/ds/zero2.json"], None, None,
     "; did you mean --ds zero2, the project's configs/ds/zero2.json"),
    ("ds-not-object", [], None, "[1, 2]", "must hold a JSON object"),
    # the command line and the run directory
    ("stop-at-zero", ["--stop-at", "0"], None, None, "--stop-at"),
    ("resume-and-overwrite", ["--resume", "auto", "--overwrite"], None, None, "continue the run or replace it"),
    ("resume-nothing-there", ["--resume", "/nonexistent/run"], None, None, "--resume /nonexistent/run"),
    ("data-missing", [S, "data.path=\"/nonexistent/corpus.txt\""], None, None, "/nonexistent/corpus.txt"),
    # data files that hold nothing to train on (the file named, with what it holds)
    ("data-empty", [S, "data.path=@empty.txt"], None, None, "empty.txt: the file is empty"),
    ("data-whitespace", [S, "data.path=@blank.jsonl"], None, None, "blank.jsonl: the file holds only whitespace"),
    ("data-header-only", [S, "data.path=@header.csv"], None, None, "header.csv: only a header (text, label)"),
    ("data-no-column", [S, "data.path=@columns.csv"], None, None, "columns.csv: no column 'text'"),
    ("text-field-on-plain-text", [S, "data.path=@one.txt", S, 'data.text_field="body"'], None, None,
     "data.text_field = 'body' names a field of json or csv rows, and "),
    ("data-no-json-field", [S, "data.path=@body.jsonl"], None, None, "has a text 'text' field (data.text_field); "
     "fields found: body"),
    ("data-one-row", [S, "data.path=@one.txt"], None, None, "one.txt: data.path holds 1 row: holding out"),
    ("data-a-directory", [S, "data.path=@DIR"], None, None, "data.path is a directory (a.txt); name one file"),
    ("data-unknown-suffix", [S, "data.path=@rows.xml"], None, None, "rows.xml: cannot tell the format"),
    ("data-raw-parquet", [S, "data.path=@rows.parquet"], None, None, "rows.parquet: raw parquet is read only by "
     "`harness prepare lm`: prepare it once (harness prepare lm --input "),
    ("data-raw-parquet-gz", [S, "data.path=@rows.parquet.gz"], None, None, "rows.parquet.gz: raw parquet is read only "
     "by `harness prepare lm`: prepare it once (decompress it to "),
    ("data-gz-cut-short", [S, "data.path=@cut.txt.gz"], None, None, "cut.txt.gz: data.path is not readable: "
     "Compressed file ended"),
    ("output-dir-under-a-file", [S, "run.output_dir=@rows.xml"], None, None, "rows.xml is a file, not a directory"),
    # writable to access() as root, not to mkdir: it had been "0 bytes free on its file system"
    ("output-dir-in-proc", [S, 'run.output_dir="/proc/harness-run"'], None, None, "cannot write in /proc"),
]
FILES = {"empty.txt": b"", "blank.jsonl": b" \n\n", "header.csv": b"text,label\n", "columns.csv": b"body,label\nx,1\n",
         "rows.xml": b"<rows/>\n", "body.jsonl": b'{"body": "a"}\n{"body": "b"}\n', "one.txt": b"short text\n",
         "rows.parquet": b"PAR1", "rows.parquet.gz": gzip.compress(b"PAR1"),
         "cut.txt.gz": gzip.compress(b"some text\n" * 99)[:20]}


@pytest.fixture
def no_process_group(monkeypatch):
    def trap(*args, **kwargs):
        raise AssertionError("a process group was started: the input was not checked before launch")

    monkeypatch.setattr(world, "init_world", trap)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_exits_2_naming_it_before_any_process_group(case, tmp_path, corpus, no_process_group, capsys,
                                                              monkeypatch):
    name, extra, run_text, ds_text, expected = case
    if name.startswith("accelerate-"):  # as `accelerate launch --use_deepspeed --zero_stage 3` tells each rank
        monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
        monkeypatch.setenv("ACCELERATE_DEEPSPEED_ZERO_STAGE", "3")
    args = ["train", S, f"data.path={json.dumps(str(corpus))}", S, f"run.output_dir={json.dumps(str(tmp_path / 'r'))}"]
    if not any(a.startswith(("train.max_steps", "train.epochs")) for a in extra) and run_text is None:
        args += TWO_STEPS
    if run_text is not None:
        (tmp_path / "run.toml").write_text(run_text)
        args += ["--run", str(tmp_path / "run.toml")]
    if ds_text is not None:
        (tmp_path / "ds.json").write_text(ds_text if isinstance(ds_text, str) else json.dumps(ds_text))
        args += ["--ds", str(tmp_path / "ds.json")]
    if name == "steps-and-epochs":
        args += TWO_STEPS
    for i, arg in enumerate(extra):  # data.path=@NAME: a file of FILES written for the case (a run directory under it)
        if "=@" in arg:
            key, file_name = arg.split("=@")
            if file_name == "DIR":  # a directory of text files
                (tmp_path / file_name).mkdir()
                (tmp_path / file_name / "a.txt").write_text("some text\n")
            else:
                (tmp_path / file_name).write_bytes(FILES[file_name])
            path = tmp_path / file_name / ("run" if key == "run.output_dir" else "")
            extra = [*extra[:i], f"{key}={json.dumps(str(path))}", *extra[i + 1:]]
    assert main(args + extra) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines and lines[-1].startswith("harness: error: ") and expected in lines[-1], lines[-3:]
    assert not (tmp_path / "r").exists()  # nothing written


def test_the_table_is_wide_and_its_trap_is_real(tmp_path, corpus, no_process_group):
    assert len(CASES) >= 60
    with pytest.raises(AssertionError, match="process group was started"):  # good input gets that far
        main(["train", S, f"data.path={json.dumps(str(corpus))}", S,
              f"run.output_dir={json.dumps(str(tmp_path / 'r'))}", *TWO_STEPS])


def test_sizes_in_messages_are_in_the_unit_that_shows_them():
    from harness.run.directory import size

    assert (size(512), size(3 * 2**20), size(5.5 * 2**30)) == ("512 bytes", "3.0 MiB", "5.5 GiB")  # not "0.0 GiB"


@pytest.mark.parametrize("count", [0, -1])
def test_an_accelerate_config_with_no_processes_is_one_line_before_launch(count, tmp_path):
    from conftest import LAUNCH

    from harness.config.run import ConfigError
    from harness.launcher.settings import launch_settings

    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text((LAUNCH / "cpu_2proc.yaml").read_text().replace("num_processes: 2", f"num_processes: {count}"))
    with pytest.raises(ConfigError, match=f"num_processes in {yaml} = {count}: must be 1 or more"):
        launch_settings(["--config_file", str(yaml)])
    with pytest.raises(ConfigError, match=f"--num_processes = {count}: must be 1 or more"):
        launch_settings(["--config_file", str(LAUNCH / "cpu_2proc.yaml"), "--num_processes", str(count)])


def test_a_misspelled_accelerate_option_is_one_line_naming_the_option_meant(capsys):
    """accelerate's parser would print its 100-line usage text and exit; `harness launch` says one line."""
    assert main(["launch", "--num_proceses", "2", "train", "--run", "configs/runs/lm_demo.toml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "harness: error: harness launch: accelerate launch refuses --num_proceses 2: unrecognized arguments: "
        "--num_proceses; did you mean --num_processes?\n")
    assert main(["launch", "--mixed_precision", "bf17", "train", "--run", "configs/runs/lm_demo.toml"]) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == (
        "harness: error: harness launch: accelerate launch refuses --mixed_precision bf17: argument --mixed_precision/"
        "--mixed-precision: invalid choice: 'bf17' (choose from 'no', 'fp16', 'bf16', 'fp8')\n")  # no hint: no typo


@pytest.mark.parametrize("argv", [["train"], ["launch", "train"], ["evaluate", "--run-dir", "runs/x"]])
def test_a_set_with_a_space_for_its_equals_sign_says_how_to_write_it(argv, capsys):
    """argparse alone said "unrecognized arguments: 30", naming neither --set nor the form it takes."""
    with pytest.raises(SystemExit) as stop:
        main([*argv, "--set", "train.max_steps", "30"])
    assert stop.value.code == 2 and capsys.readouterr().err.splitlines()[-1] == (
        "harness: error: unrecognized arguments: 30 (--set takes KEY=VALUE as one word: --set train.max_steps=30)")
    for words, value in ((["--bogus", "--set", "train.max_steps", "30"], "30"), (["--set", "train.seed", "-1"], "-1")):
        with pytest.raises(SystemExit):  # the value is the word after the key, not another unknown one
            main(["train", *words])
        assert capsys.readouterr().err.splitlines()[-1].endswith(f"--set {words[-2]}={value})")


def test_harness_launch_names_the_accelerator_before_deepspeed_can_warn_of_guessing_it(monkeypatch, capsys):
    """On a CPU DeepSpeed prints a warning line when it guesses the accelerator: `harness launch` names it first,
    so that a refusal is the only line a user sees."""
    monkeypatch.delenv("DS_ACCELERATOR", raising=False)
    assert main(["launch", "--num_proceses", "2", "train"]) == 2
    assert os.environ.get("DS_ACCELERATOR") == ("cpu" if not __import__("torch").cuda.is_available() else None)


def test_a_set_value_is_a_string_unless_it_is_written_as_toml():
    from harness.config.run import ConfigError, parse_override

    assert parse_override("data.path=[draft]notes.txt") == ("data.path", "[draft]notes.txt")
    assert parse_override("data.path={a}/x") == ("data.path", "{a}/x")
    assert parse_override("run.name=hello world") == ("run.name", "hello world")
    assert parse_override('data.mix={"a" = 0.7, "b" = 0.3}') == ("data.mix", {"a": 0.7, "b": 0.3})
    for bad in ('data.mix={"a" = 0.5, "a" = 0.5}', "data.mix=[1 2]", 'run.name="open'):
        with pytest.raises(ConfigError, match="is not a TOML value"):
            parse_override(bad)


def test_hub_data_out_of_reach_is_the_same_one_line_in_one_process_and_under_harness_launch(tmp_path, corpus):
    """`data.path = "hub:..."` with no way to the Hub (offline here, as on CI; HF_HUB_OFFLINE=1 makes datasets say so
    at once instead of after its retries): found by the ranks when they load the data, after launch. `harness
    launch` prints the line `harness train` gives, once, with no traceback."""
    from conftest import harness

    sets = ['data.path="hub:nobody/no-such-dataset"']
    env = {"HF_HUB_OFFLINE": "1"}
    one = harness(tmp_path / "one", corpus, sets=sets, env=env, check=False)
    launched = harness(tmp_path / "two", corpus, nproc=2, front=True, sets=sets, env=env, check=False)
    assert one.proc.returncode == 2 and launched.proc.returncode == 2, launched.proc.stderr[-3000:]
    line = one.proc.stderr.strip().splitlines()[-1]
    assert line.startswith("harness: error: hub:nobody/no-such-dataset: cannot load as hub data: "), line
    err = launched.proc.stderr
    assert err.strip().splitlines()[-1] == line and err.count("harness: error:") == 1, err[-3000:]
    assert "Traceback" not in err and "ChildFailedError" not in err


def test_a_batch_that_does_not_fit_one_gpu_on_paper_is_refused_before_launch(tmp_path, corpus, no_process_group,
                                                                            capsys, monkeypatch):
    """The GPUs' memory read from nvidia-smi (a fake one here, as the real one prints: 80 GiB H100s and a smaller
    one hidden by CUDA_VISIBLE_DEVICES); the model states and one micro-batch's activations on paper against it."""
    from harness.api import plan
    from harness.plan.render import meta_model
    from harness.run.machine import check_fits, device_memory_bytes

    def fits(p, capacity: int) -> str | None:
        return check_fits(p, meta_model(p), capacity)

    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text("#!/bin/sh\nprintf '0, 81559\\n1, 81559\\n2, 16384\\n'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:{os.environ['PATH']}")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert device_memory_bytes() == [81559 * 2**20] * 2
    base = ["train", S, f"data.path={json.dumps(str(corpus))}", S, f"run.output_dir={json.dumps(str(tmp_path / 'r'))}",
            *TWO_STEPS, S, "model.d_model=1024", S, "model.n_layers=24", S, "model.n_heads=16", S, "data.seq_len=2048"]
    big = [*base, S, "train.micro_batch_size=64"]
    assert main(big) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert line.startswith("harness: error: train.micro_batch_size = 64 (command line) of 2048 positions does not fit "
                           "one GPU of 79.65 GiB on paper: model states "), line
    assert "lower train.micro_batch_size" in line and "activations " in line
    sets = [a for a in base[1:] if a != S]
    from harness.plan.render import render

    from harness.plan.render import memory_on_paper

    for task in ("translation", "prices"):  # two stacks with cross-attention; channels folded into the batch
        other = plan(None, [f"run.task={json.dumps(task)}", "train.max_steps=2"])
        assert memory_on_paper(other, meta_model(other)) is None, task  # the formula does not describe them
    figures = re.search(r"model states (\S+ GiB) per rank \(fp32, ZeRO-0\) \+ activations (\S+ GiB)", line)
    assert figures and f"on a GPU, on paper: model states {figures[1]} + activations {figures[2]} of one micro-batch " \
        "of 64 x 2048 positions" in render(plan(None, [*sets, "train.micro_batch_size=64"]))  # what the line points to
    auto = render(plan(None, [*sets, "train.micro_batch_size=64"], ds="zero2"))  # "auto": bf16 on a GPU, fp32 here
    assert "on a GPU, on paper in fp32 as this host resolves it (an \"auto\" file trains in bf16" in auto
    small = plan(None, [*sets, "train.micro_batch_size=4"])
    assert fits(small, 81559 * 2**20) is None  # 4 x 2048 fits; with checkpointing 64 x 2048 does too
    assert fits(plan(None, [*sets, "train.micro_batch_size=64", "train.activation_checkpointing=true"]),
                      81559 * 2**20) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2")
    assert device_memory_bytes() == [16384 * 2**20]
    assert "does not fit one GPU of 16.00 GiB" in fits(small, device_memory_bytes()[0])
    # a bench measures what fits for real (--largest tries sizes until one runs out of memory): no refusal on paper
    from harness.bench.sweep import env_for
    from harness.run.machine import FIT_CHECK_ENV

    monkeypatch.setenv(FIT_CHECK_ENV, env_for(SimpleNamespace(mixed_precision="no", nproc=1))[FIT_CHECK_ENV])
    monkeypatch.setattr(world, "init_world", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("past the checks")))
    with pytest.raises(RuntimeError, match="past the checks"):
        main(big)


def test_overwrite_clears_only_a_run_directory(tmp_path, corpus, no_process_group, capsys):
    """--overwrite deletes the run directory: a folder named by mistake (a project, the current directory) is left
    as it is, and the line says what it holds."""
    folder = tmp_path / "project"
    (folder / "src").mkdir(parents=True)
    (folder / "notes.md").write_text("mine\n")
    (folder / "eval.json").write_text("{}")  # a run's name among them: not said to be what a run does not write
    args = ["train", S, f"data.path={json.dumps(str(corpus))}", *TWO_STEPS, "--overwrite"]
    assert main([*args, S, f"run.output_dir={json.dumps(str(folder))}"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--overwrite replaces a run directory" in line and "it holds notes.md, src, which a run" in line, line
    assert (folder / "notes.md").read_text() == "mine\n" and (folder / "src").is_dir()
    for left in (["config.toml", ".lock"], ["checkpoints/", "metrics.jsonl", ".ranks/"]):  # what a crash may leave
        run = tmp_path / f"run{len(left)}"  # (the second: an --overwrite interrupted after its config.toml went)
        run.mkdir()
        for name in left:
            if name.endswith("/"):
                (run / name).mkdir()
            else:
                (run / name).write_text("")
        with pytest.raises(AssertionError, match="process group was started"):  # --overwrite gets as far as training
            main([*args, S, f"run.output_dir={json.dumps(str(run))}"])


def _finished_run(tmp_path, sets=()):
    """A run directory as training leaves it (its config.toml and exported weights), built in this process."""
    from safetensors.torch import save_file

    from harness.config.run import to_toml
    from harness.tasks import get_task, resolve

    run = tmp_path / "run"
    run.mkdir()
    cfg = resolve(None, ["train.max_steps=2", *sets]).cfg
    (run / "config.toml").write_text(to_toml(cfg))
    save_file(get_task("lm").build_model(cfg).state_dict(), str(run / "model.safetensors"))
    return run


def test_a_damaged_run_directory_is_one_line_in_evaluate_and_export(tmp_path, capsys):
    from harness.api import load_model

    run = _finished_run(tmp_path)
    load_model(run)  # whole, it loads
    cases = [(["evaluate", "--run-dir", str(tmp_path / "nothing")], "nothing: no such run directory"),
             (["export", "--run-dir", str(run / "config.toml"), "--hf", str(tmp_path / "hf")],
              "config.toml: a file, not a run directory"),
             (["export", "--run-dir", str(run), "--hf", str(run / "config.toml" / "hf")],
              f"--hf {run}/config.toml/hf: {run}/config.toml is a file; name a directory to write")]
    for args, expected in cases:
        assert main(args) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert line.startswith("harness: error: ") and expected in line, line
    (run / "config.toml").write_text((run / "config.toml").read_text().replace("d_model = 128", "d_model = 64"))
    assert main(["evaluate", "--run-dir", str(run)]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "weights' shapes differ from the model its config.toml builds" in line and "(128,) vs (64,)" in line, line
    weights = run / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])  # a copy cut short
    assert main(["evaluate", "--run-dir", str(run)]) == 2
    assert "model.safetensors: not a whole safetensors file" in capsys.readouterr().err


def test_nvme_offload_needs_deepspeeds_async_io_op_on_this_machine(tmp_path, corpus, no_process_group, capsys):
    from deepspeed.accelerator import get_accelerator

    builder = get_accelerator().create_op_builder("AsyncIOBuilder")
    if builder is not None and builder.is_compatible(verbose=False):
        pytest.skip("this machine builds DeepSpeed's async_io op (libaio): NVMe offload is not refused here")
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_optimizer": {
        "device": "nvme", "nvme_path": str(tmp_path)}}}))
    assert main(["train", S, f"data.path={json.dumps(str(corpus))}", S,
                 f"run.output_dir={json.dumps(str(tmp_path / 'r'))}", *TWO_STEPS, "--ds", str(ds)]) == 2
    assert "NVMe offload (ds file" in capsys.readouterr().err and not (tmp_path / "r").exists()


def test_zeropp_quantization_needs_deepspeeds_quantizer_kernel_on_this_machine(tmp_path, corpus, no_process_group,
                                                                             capsys):
    """Each rank failed with "This op had not been implemented on CPU backend." (ZeRO-3 building its engine, or at the
    first backward for gradients); hpZ partitioning alone runs on a CPU and gets as far as the process group."""
    from deepspeed.accelerator import get_accelerator

    if type(get_accelerator().create_op_builder("QuantizerBuilder")).__name__ != "NotImplementedBuilder":
        pytest.skip("this accelerator builds DeepSpeed's quantizer kernel: ZeRO++ quantization is not refused here")
    args = ["train", S, f"data.path={json.dumps(str(corpus))}", S, f"run.output_dir={json.dumps(str(tmp_path / 'r'))}",
            *TWO_STEPS, "--ds", str(tmp_path / "ds.json")]
    for key in ("zero_quantized_weights", "zero_quantized_nontrainable_weights", "zero_quantized_gradients"):
        (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3, key: True}}))
        assert main(args) == 2
        line = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"zero_optimization.{key} (ds file" in line and "quantizer kernel" in line, line
        assert not (tmp_path / "r").exists()
    (tmp_path / "ds.json").write_text(json.dumps({"zero_optimization": {"stage": 3, "zero_hpz_partition_size": 2}}))
    with pytest.raises(AssertionError, match="process group was started"):
        main(args)


def test_a_warmup_longer_than_the_run_is_said_in_the_plan():
    from harness.api import plan
    from harness.plan.render import render

    note = ("note: schedule.warmup_steps = 30 (command line) is longer than the run's 3 steps: the lr rises to "
            "0.0001 at the last step, never to optimizer.lr = 0.001 (command line)")
    assert note in render(plan(None, ["train.max_steps=3", "schedule.warmup_steps=30", "optimizer.lr=1e-3"]))
    assert "is longer than the run's" not in render(plan(None, ["train.max_steps=30", "schedule.warmup_steps=30"]))
