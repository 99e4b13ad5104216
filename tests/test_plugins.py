"""Any task, any caller: a plug-in task named by file path or by module path trains under ZeRO-2 and ZeRO-3 on 2
processes with the losses of 1, resumes exactly, is evaluated and benched in new processes that find it from the
run directory alone; its [task] section is checked like every other; the Python API trains twice in one process."""
from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys

import pytest

from harness.config.run import ConfigError
from conftest import ROOT, _env, assert_losses_close, cli, ds_variant, harness, python

BY_FILE = ["--run", "examples/digits.toml"]  # run.task = "examples/digits_task.py:DigitsTask"
BY_MODULE = ["--run", "examples/digits.toml", "--set", 'run.task="examples.digits_task:DigitsTask"']
FP32_TOL = 1e-5


def test_plugin_task_by_file_matches_one_process_under_zero2_and_zero3(cached_run, tmp_path):
    ref = cached_run("digits-ref", args=BY_FILE)
    assert "data train: 4000 samples; validation: 500" in ref.proc.stdout
    assert ref.metrics[0]["flops_method"] == "counted"  # no forward_flops: counted on the meta device
    assert ref.metrics[0]["tflops"] > 0
    for stage in (2, 3):
        ds = ds_variant(tmp_path, "zero3.json", stage3_param_persistence_threshold=0) if stage == 3 else "zero2.json"
        two = cached_run(f"digits-zero{stage}-2p", nproc=2, ds=ds, sets=["train.micro_batch_size=2"], args=BY_FILE)
        assert f"world 2 (data parallel 2) | ZeRO-{stage}" in two.proc.stdout
        assert_losses_close(two.losses, ref.losses, FP32_TOL)
        # the task's own evaluation ran on both ranks at the end (every rank the same number of forwards)
        assert two.evals[-1]["pearson"] == pytest.approx(ref.evals[-1]["pearson"], abs=1e-4)
    assert ref.losses[6] < ref.losses[1]


def test_plugin_task_by_module_resumes_exactly_and_is_found_by_evaluate_and_bench(cached_run, tmp_path):
    whole = cached_run("digits-ref", args=BY_FILE)
    out = tmp_path / "run"
    harness(out, tmp_path, args=[*BY_MODULE, "--stop-at", "3"])
    resumed = harness(out, tmp_path, args=[*BY_MODULE, "--resume", "auto"])
    assert "resumed from" in resumed.proc.stdout
    assert_losses_close(resumed.losses, whole.losses, FP32_TOL)
    assert 'task = "examples.digits_task:DigitsTask"' in (out / "config.toml").read_text()
    ev = cli("evaluate", "--run-dir", str(out), "--split", "test", timeout=120)  # it names code: not run unasked
    assert ev.returncode == 2 and "--task 'examples.digits_task:DigitsTask'" in ev.stderr, ev.stderr
    ev = cli("evaluate", "--run-dir", str(out), "--split", "test", "--task", "examples.digits_task:DigitsTask",
             timeout=120)
    assert ev.returncode == 0, ev.stderr
    assert set(json.loads((out / "eval.json").read_text())["test"]) == {"mse", "pearson"}
    bench = cli("bench", "sweep", *BY_MODULE, "--set", "train.micro_batch_size=8", "--steps", "2", "--warmup", "1", "--out",
                str(tmp_path / "bench"))
    assert bench.returncode == 0, bench.stderr[-2000:]
    entry = json.loads((tmp_path / "bench" / "bench.json").read_text())["configs"][0]
    assert entry["status"] == "ok" and entry["flops_method"] == "counted"
    assert "counted by FlopCounterMode" in (tmp_path / "bench" / "bench.md").read_text()


def test_plugin_task_with_a_reader_scores_new_data_and_one_without_is_refused(cached_run, tmp_path, one_thread):
    """The example's reader (`read`): its test rows written to a file score what the test split scores; a task without
    a reader gets one line from `evaluate --data`."""
    from harness.config.run import ConfigError
    from harness.tasks import resolve
    from harness.eval.evaluate import evaluate_data, evaluate_run
    from harness.run.trust import trusting
    from harness.tasks import task_class

    run = cached_run("digits-ref", args=BY_FILE)
    cfg = resolve(str(run.dir / "config.toml")).cfg
    rows = sys.modules[task_class(cfg.run.task).__module__]._split(cfg.task.test_samples, cfg.task.length, seed=3)
    data = tmp_path / "digits.txt"
    data.write_text("".join("".join(map(str, r["digits"].tolist())) + "\n" for r in rows) + "12x\n")
    with trusting(task="examples/digits_task.py:DigitsTask"):  # named, as evaluate's --task names it
        split = evaluate_run(run.dir, "test")
        got = evaluate_data(run.dir, data)["digits.txt"]
    assert {k: got[k] for k in split} == pytest.approx(split, rel=1e-6)
    assert got["rows_kept"] == 500 and got["skipped"] == "malformed 1"

    class Unread(task_class(cfg.run.task)):
        read = None  # a task without a reader: refused before the model (here an empty file) is read

    empty = tmp_path / "empty-model"
    empty.mkdir()
    shutil.copy(run.dir / "config.toml", empty / "config.toml")
    (empty / "model.safetensors").write_bytes(b"")
    with trusting(task="examples/digits_task.py:DigitsTask"), pytest.raises(ConfigError, match=r"digits_task.py:"
                                                                                 r"DigitsTask' has no reader"):
        evaluate_data(empty, data, task=Unread())


def test_a_task_file_edited_between_two_runs_of_one_process_is_read_again(tmp_path):
    """A notebook session: the task file fixed after a failed harness.train ran the old code again."""
    import os

    from harness.tasks.registry import task_class

    path = tmp_path / "edited.py"
    head = "from harness.tasks.lm import LanguageModelTask\n\n\nclass T(LanguageModelTask):\n"
    path.write_text(head + "    version = 1\n")
    assert task_class(f"{path}:T").version == 1 and task_class(f"{path}:T") is task_class(f"{path}:T")
    path.write_text(head + "    version = 2\n")
    os.utime(path, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns + 10**9))  # (a coarse clock's same tick)
    assert task_class(f"{path}:T").version == 2


def test_a_plugin_run_goes_on_where_its_project_moved(tmp_path):
    """A project copied elsewhere (another checkout, a cluster): its run resumes, is evaluated and loaded with the
    task file where it is now (config.toml holds the old absolute path); a changed file at the old place is another
    task."""
    def harness_in(project, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run([python(), "-m", "harness", *args], cwd=project, env=_env({"PYTHONPATH": str(ROOT)}),
                              capture_output=True, text=True, timeout=300)

    old, new, run = tmp_path / "p4", tmp_path / "p5", tmp_path / "run"
    (old / "examples").mkdir(parents=True)
    for name in ("digits_task.py", "digits.toml"):
        shutil.copy(ROOT / "examples" / name, old / "examples" / name)
    train = ["train", "--run", "examples/digits.toml", "--set", f"run.output_dir={json.dumps(str(run))}",
             "--set", "train.max_steps=6", "--set", "train.save_every=3"]
    assert harness_in(old, *train, "--stop-at", "3").returncode == 0
    old.rename(new)
    (old / "examples").mkdir(parents=True)  # the old place holds a task file of that name again, another one
    (old / "examples" / "digits_task.py").write_text((new / "examples" / "digits_task.py").read_text() + "\n# v2\n")
    refused = harness_in(new, *train, "--resume", "auto")
    assert refused.returncode == 2 and f"saved by a '{old / 'examples' / 'digits_task.py'}:DigitsTask' run" in \
        refused.stderr, refused.stderr[-2000:]
    shutil.rmtree(old)
    done = harness_in(new, *train, "--resume", "auto")
    assert done.returncode == 0 and "at step 3" in done.stdout, done.stderr[-2000:]
    new.rename(old)  # and back: the finished run's config.toml names the file at `new`
    scored = harness_in(old, "evaluate", "--run-dir", str(run), "--split", "test", "--task",
                        "examples/digits_task.py:DigitsTask")
    assert scored.returncode == 0 and "| mse " in scored.stdout, scored.stderr[-2000:]


@pytest.mark.parametrize("sets,message", [
    (["task.lenght=8"], "unknown config key `task.lenght` (command line); did you mean `task.length`?"),
    (["task.length=\"8\""], "task.length must be int, got str '8'"),
    (['run.task="examples/digits_task.py:DigitTask"'], "has no class 'DigitTask'; did you mean 'DigitsTask'?"),
    (['run.task="examples/digits_task.py:DigitsConfig"'], "DigitsConfig lacks build_model, build_data"),
    (['run.task="examples/nothing_here.py:Task"'], "no file examples/nothing_here.py (a relative path is read from "
                                                   "the working directory, "),
    (['run.task="no_such_package.tasks:Task"'], "importing no_such_package.tasks failed: ModuleNotFoundError"),
    (['run.task="lm"', "task.length=8"], "[task] holds the keys of a plug-in task"),
    (['run.task="nope"'], "the built-in tasks are lm, translation, protein, prices; a plug-in task is named"),
])
def test_plugin_task_mistakes_are_one_line_before_launch(sets, message):
    from harness.config.run import ConfigError
    from harness.tasks import resolve

    with pytest.raises(ConfigError) as e:
        resolve(str(ROOT / "examples" / "digits.toml"), sets)
    assert message in str(e.value)


def test_activation_checkpointing_of_a_model_with_nothing_to_recompute_is_refused_before_launch():
    """The digits model has no Transformer blocks and no Hugging Face layers: the setting did nothing, silently."""
    from harness.plan.resolve import make_plan

    with pytest.raises(ConfigError, match="DigitsModel has nothing to recompute .*: leave it out"):
        make_plan(str(ROOT / "examples" / "digits.toml"), ["train.activation_checkpointing=true"], None, 1)


MALFORMED_CONFIG = """
from dataclasses import dataclass


class Settings:  # not a dataclass
    depth = 2


@dataclass(frozen=True)
class NoDefault:
    depth: int
    width: int = 4


class T:
    Config = {config}
    Data = {data}

    def build_model(self, cfg): ...
    def build_data(self, cfg): ...
    def collate(self, samples): ...
    def count(self, batch): ...
    def inputs(self, batch): ...
    def loss_from(self, outputs, batch): ...
"""


TYPED = """from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from harness.tasks.lm import LanguageModelTask


@dataclass(frozen=True)
class Typed:
    shape: tuple = (2, 3)
    pair: tuple[int, int] = (1, 2)
    tags: list[str] = field(default_factory=list)
    weights: dict[str, float] = field(default_factory=dict)
    limit: int | None = None
    kind: Literal["a", "b"] = "a"
    rate: float = 0.5
    cap: int | None = 5


class T(LanguageModelTask):
    Config = Typed
"""


@pytest.mark.parametrize("config,data,message", [
    ("NoDefault", "None", "T.Config.depth has no default (every [task] key needs one)"),
    ("Settings", "None", "T.Config must be a dataclass (the [task] section's keys; the class, not an instance)"),
    ("None", "NoDefault", "T.Data must be a dataclass subclassing harness.config.run.DataSection (the task's own "
                          "[data] keys)"),
])
def test_a_plugin_s_malformed_config_is_one_line_before_anything_is_built(tmp_path, config, data, message):
    file = tmp_path / "bad_task.py"
    file.write_text(MALFORMED_CONFIG.format(config=config, data=data))
    proc = cli("plan", "--set", f"run.task={json.dumps(f'{file}:T')}", "--set", "train.max_steps=1", timeout=120)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines() == [f"harness: error: run.task = '{file}:T': {message}"]


def test_the_task_s_section_is_kept_in_the_run_directory_s_config(tmp_path):
    from harness.tasks import resolve
    from harness.config.run import to_toml

    cfg = resolve(str(ROOT / "examples" / "digits.toml"), ["task.length=8"]).cfg
    assert cfg.task.length == 8 and cfg.run.task.endswith("examples/digits_task.py:DigitsTask")
    (tmp_path / "config.toml").write_text(to_toml(cfg))
    assert resolve(str(tmp_path / "config.toml")).cfg == cfg  # what evaluate and --resume read back
    # typed containers and optional keys: set, written and read back (a tuple had been refused once read back as
    # a TOML array, a list[str] refused as "must be str", a None default failed to write)
    typed = tmp_path / "typed_task.py"
    typed.write_text(TYPED)
    ref = f"run.task={json.dumps(f'{typed}:T')}"
    cfg = resolve(None, [ref, 'task.tags=["a", "b"]', "task.weights={x = 1, y = 0.5}", "task.pair=[3, 4]"]).cfg
    assert (cfg.task.shape, cfg.task.pair, cfg.task.tags, cfg.task.weights, cfg.task.limit) == \
        ((2, 3), (3, 4), ["a", "b"], {"x": 1.0, "y": 0.5}, None)
    for given in (cfg, resolve(None, [ref, "task.limit=7"]).cfg):
        (tmp_path / "typed.toml").write_text(to_toml(given))
        assert resolve(str(tmp_path / "typed.toml")).cfg == given
    for bad, said in [("task.pair=[1, 2, 3]", "task.pair must be tuple[int, int], got list [1, 2, 3]"),
                      ("task.tags=[1]", "task.tags must be list[str], got list [1]"),
                      ('task.weights={x = "a"}', "task.weights must be dict[str, float], got dict {'x': 'a'}"),
                      ("task.limit=true", "task.limit must be int or None, got bool True"),
                      ("task.kind=\"c\"", "task.kind must be one of 'a', 'b', got str 'c'")]:
        with pytest.raises(ConfigError, match=re.escape(said)):
            resolve(None, [ref, bad])
    # the Python API's dict and RunConfig forms read as a run file does: a dict-valued key is one key, any string
    # is a string, and a RunConfig's defaults leave a DeepSpeed file's values to it
    import harness

    given = {"run": {"task": f"{typed}:T", "name": "\N{GRINNING FACE}"}, "task": {"weights": {"x": 1}},
             "train": {"max_steps": 2}}
    assert harness.plan(given).run.cfg.task.weights == {"x": 1.0}
    assert harness.plan(harness.plan(given).run.cfg).run.cfg == harness.plan(given).run.cfg
    ds = tmp_path / "lr.json"
    ds.write_text(json.dumps({"optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}))
    assert harness.plan(harness.plan(given).run.cfg, ds=str(ds)).run.cfg.optimizer.lr == 0.01
    import numpy as np  # a sweep's numbers, taken as Python's; None only where the default is None

    swept = harness.plan({**given, "task": {"rate": np.float64(0.25)}, "train": {"max_steps": np.int64(2)}}).run.cfg
    assert (swept.task.rate, swept.train.max_steps) == (0.25, 2) and type(swept.task.rate) is float
    with pytest.raises(ConfigError, match=r"task.cap = None .*only a key whose default is None may be None"):
        harness.plan({**given, "task": {"cap": None}})


def test_python_api_trains_twice_in_one_process(tmp_path):
    script = f"""
import harness
for name in ("a", "b"):
    r = harness.train("examples/digits.toml", sets=["train.max_steps=3", "run.output_dir={tmp_path}/" + name],
                      ds="configs/ds/zero2.json")
    print("RESULT", r["step"], r["mse"])
model, cfg = harness.load_model("{tmp_path}/b", task="examples/digits_task.py:DigitsTask")
print("MODEL", type(model).__name__, cfg.task.length)
"""
    proc = subprocess.run([python(), "-c", script], cwd=ROOT, env=_env(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = [line.split() for line in proc.stdout.splitlines() if line.startswith("RESULT")]
    assert len(results) == 2 and results[0] == results[1]  # the same seed: the same run, twice
    assert "MODEL DigitsModel 16" in proc.stdout


@pytest.mark.parametrize("ds,message", [("pp2_zero1.json", "its model (DigitsModel) has no pipeline_layers()"),
                                        ("tp2_zero1.json", "layer_specs match no parameter of run.task")])
def test_plan_says_what_a_plugin_model_lacks_for_model_parallelism(ds, message):
    from conftest import DS
    from harness.config.run import ConfigError
    from harness.plan.resolve import make_plan

    with pytest.raises(ConfigError) as e:
        make_plan(str(ROOT / "examples" / "digits.toml"), ["model.n_heads=2"], str(DS / ds), world_size=2)
    assert message in str(e.value)


def test_keys_lists_the_tasks_and_how_to_name_a_plugin():
    from harness.plan.render import render_keys

    assert "the built-in tasks are lm, translation, protein, prices; a plug-in task is named" in render_keys()


FLOAT_TASK = '''
import torch
from torch import nn
from harness.tasks import TaskData


class FloatTask:
    """Regression from fp32 features: the inputs a bf16 model must take in its own dtype."""

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 1))

    def build_data(self, cfg):
        g = torch.Generator().manual_seed(0)
        rows = [{"x": x, "y": x.sum(0, keepdim=True)} for x in torch.randn(96, 4, generator=g)]
        return TaskData(rows[16:], rows[:16])

    def collate(self, samples):
        return {k: torch.stack([s[k] for s in samples]) for k in ("x", "y")}

    def count(self, batch):
        return len(batch["y"])

    def inputs(self, batch):
        return (batch["x"],)

    def loss_from(self, out, batch):
        return ((out.float() - batch["y"]) ** 2).sum()
'''


def test_a_flops_count_that_falls_back_to_the_estimate_says_so(tmp_path):
    """A forward that reads values cannot be counted on the meta device: the start line said "counted" while every
    record said "estimated"; the switch is now said once."""
    task = tmp_path / "reads_task.py"
    task.write_text(FLOAT_TASK + "\n\nclass Reads(nn.Module):\n    def __init__(self):\n        super().__init__()\n"
                    "        self.lin = nn.Linear(4, 1)\n\n    def forward(self, x):\n"
                    "        return self.lin(x) * (1.0 if x.sum().item() < 1e9 else 0.0)\n\n\n"
                    "class ReadsTask(FloatTask):\n    def build_model(self, cfg):\n        return Reads()\n")
    run = harness(tmp_path / "run", tmp_path, sets=["train.max_steps=2", "train.micro_batch_size=8"],
                  args=["--set", f"run.task={json.dumps(f'{task}:ReadsTask')}"])
    assert run.proc.stdout.count("note: FLOPs estimated: 6N per item (the meta-device count failed)") == 1, \
        run.proc.stdout[-2000:]
    assert all(m["flops_method"].startswith("estimated") for m in run.metrics)


@pytest.mark.parametrize("ds", ["bf16.json", "zero3.json"])
def test_a_task_with_float_inputs_trains_in_bf16_as_it_does_in_fp32(ds, tmp_path):
    """DeepSpeed's bf16 (ZeRO-2 here) keeps the weights in bf16 and passes fp32 features on as they are: the
    harness casts a model's floating-point inputs to its dtype, as the built-in price model does itself."""
    task = tmp_path / "float_task.py"
    task.write_text(FLOAT_TASK)
    run = harness(tmp_path / "run", tmp_path, ds=ds, sets=["train.max_steps=3", "train.micro_batch_size=8"],
                  args=["--set", f"run.task={json.dumps(f'{task}:FloatTask')}"])
    assert len(run.losses) == 3 and all(loss == loss for loss in run.losses), run.proc.stdout[-2000:]


SIZED_TASK = FLOAT_TASK + '''

from dataclasses import dataclass


@dataclass(frozen=True)
class Size:
    width: int = 16


class Sized(FloatTask):
    Config = Size

    def build_model(self, cfg):
        return nn.Sequential(nn.Linear(4, cfg.task.width), nn.ReLU(), nn.Linear(cfg.task.width, 1){extra})

    def metrics(self, mean_loss):
        return {"rmse": mean_loss ** 0.5}
'''


def test_a_checkpoint_resumes_only_into_the_model_it_was_saved_from_whatever_changed(tmp_path):
    """A [task] key that shapes the model, or the task's model code itself (the settings the same): one line naming
    it before anything loads (the code change had read as a checkpoint cut short or damaged). The task's own metrics
    leave out the loss, which the best checkpoint is still selected by (it had been refused)."""
    task = tmp_path / "sized_task.py"
    task.write_text(SIZED_TASK.replace("{extra}", ""))
    args = ["--set", f"run.task={json.dumps(f'{task}:Sized')}"]
    sets = ["train.max_steps=4", "train.micro_batch_size=8", 'train.select_best="loss"', "train.eval_every=1"]
    first = harness(tmp_path / "run", tmp_path, sets=sets, args=[*args, "--stop-at", "2"])
    assert (first.dir / "checkpoints" / "step_00000002" / "parameters.json").is_file()
    assert [sorted(e) for e in first.evals] == [["loss", "rmse", "step"]] * 2
    assert json.loads((first.dir / "best.json").read_text())["metric"] == "loss"
    wider = harness(tmp_path / "run", tmp_path, check=False, sets=[*sets, "task.width=32"], args=[*args, "--resume",
                                                                                                  "auto"])
    line = wider.proc.stderr.strip().splitlines()[-1]
    assert wider.proc.returncode == 2 and "its model is not this run's (task.width 16 there, 32 here" in line, line
    task.write_text(SIZED_TASK.replace("{extra}", ", nn.Linear(1, 1)"))
    changed = harness(tmp_path / "run", tmp_path, check=False, sets=sets, args=[*args, "--resume", "auto"])
    line = changed.proc.stderr.strip().splitlines()[-1]
    assert changed.proc.returncode == 2 and "the model's code (Sized), or the data or config.json it is built from, " \
        "changed since it was saved; parameters 3.bias None -> [1], 3.weight None -> [1, 1]" in line, line


def test_ranks_that_built_different_data_are_refused_in_one_line(tmp_path):
    """A split drawn unseeded (each process its own order): validation would overlap training, silently."""
    task = tmp_path / "unseeded_task.py"
    task.write_text(FLOAT_TASK + "\n\nclass Unseeded(FloatTask):\n    def build_data(self, cfg):\n"
                    "        import os, random\n        d = super().build_data(cfg)\n        rows = list(d.train)\n"
                    "        random.Random(os.getpid()).shuffle(rows)\n        return TaskData(rows, d.val)\n")
    run = harness(tmp_path / "run", tmp_path, nproc=2, ds="zero2.json", check=False, front=True,
                  sets=["train.max_steps=2", "train.micro_batch_size=8"], env={"OMP_NUM_THREADS": None},
                  args=["--set", f"run.task={json.dumps(f'{task}:Unseeded')}"])
    assert run.proc.returncode == 2, run.proc.stderr[-2000:]
    assert "Setting OMP_NUM_THREADS" not in run.proc.stderr  # torchrun's banner: harness launch sets what it would
    assert run.proc.stderr.strip().splitlines()[-1].startswith(
        "harness: error: task Unseeded: build_data(cfg) gave rank 1 other data than rank 0 (train "), run.proc.stderr[-2000:]


def test_16_bit_inputs_are_cast_except_for_a_model_that_casts_its_own():
    """The price model normalises each window in fp32 (`casts_own_inputs`): cast to bf16 first, a price of 150 moves
    in steps of 1 and its window's scale is lost. Every other model under DeepSpeed's 16 bits takes its inputs cast."""
    from types import SimpleNamespace

    import torch

    from harness.distributed.parallel import input_cast
    from harness.models.patch import PatchConfig, PatchTST

    def ds(precision, autocast=False, pp=1):
        return SimpleNamespace(precision=precision, autocast=autocast, layout=SimpleNamespace(pp_size=pp))

    plain, patch = torch.nn.Linear(4, 1), PatchTST(PatchConfig(lookback=32, horizon=8, patch_len=8, stride=8,
                                                                d_model=16, n_layers=1, n_heads=2, d_ff=32))
    x, ids = torch.full((2, 4), 150.3), torch.ones(2, 4, dtype=torch.long)
    for precision, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        cast_x, cast_ids = input_cast(ds(precision), plain)(plain, (x, ids))
        assert cast_x.dtype == dtype and cast_ids.dtype == torch.long
        assert input_cast(ds(precision), patch) is None
    assert all(input_cast(d, plain) is None for d in (ds("fp32"), ds("bf16", autocast=True), ds("bf16", pp=2)))
    assert input_cast(ds("bf16"), plain)(plain, (ids,)) is None  # nothing to cast: the inputs pass untouched


def test_a_run_whose_last_steps_are_not_finite_exports_nothing(tmp_path):
    """Fewer non-finite steps than train.max_nonfinite_steps, but the run's last: its weights are what those steps
    made of them (ZeRO-0 in fp32 applies a NaN update), so the run stops with exit 3 instead of exporting them."""
    task = tmp_path / "nan_task.py"
    task.write_text(FLOAT_TASK + "\n\nclass NanTask(FloatTask):\n    def loss_from(self, out, batch):\n"
                    "        return super().loss_from(out, batch) * float('nan')\n")
    run = harness(tmp_path / "run", tmp_path, check=False, sets=["train.max_steps=3", "train.micro_batch_size=8",
                                                                 "logging.plots=true"],
                  args=["--set", f"run.task={json.dumps(f'{task}:NanTask')}"])
    assert run.proc.returncode == 3, run.proc.stderr[-2000:]
    assert "non-finite for 3 consecutive steps (steps 1-3" in run.proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "run" / "model.safetensors").exists()
    assert (tmp_path / "run" / "curves.png").is_file()  # drawn however the run ends (it had been at the end alone)
    task.write_text(FLOAT_TASK + "\n\nclass NoItems(FloatTask):\n    def count(self, batch):\n        return 0\n")
    run = harness(tmp_path / "run", tmp_path, check=False, sets=["train.max_steps=3", "train.micro_batch_size=8"],
                  args=["--overwrite", "--set", f"run.task={json.dumps(f'{task}:NoItems')}"])  # a 0/0 loss
    assert run.proc.returncode == 3 and run.proc.stderr.strip().endswith(
        "3 of those steps counted no items: check the task's count(batch)"), run.proc.stderr[-2000:]


# (a FloatTask subclass's body, what the one line says after "task Bad: ")
BROKEN = [
    ("    def loss_from(self, out, batch):\n        return super().loss_from(out, batch).item()",
     "its loss (loss_from, or loss where the task defines it) returned float "),
    ("    def loss_from(self, out, batch):\n        return ((out.float() - batch['y']) ** 2).sum(1)",
     "returned a torch.float32 tensor of shape (8,); it must return the batch's summed loss"),
    ("    def loss_from(self, out, batch):\n        return super().loss_from(out, batch).detach()",
     "returned a torch.float32 tensor of shape (), not requiring grad"),
    ("    def build_data(self, cfg):\n        d = super().build_data(cfg)\n        return d.train, d.val",
     "build_data(cfg) returned a tuple of 2 items; it must return harness.tasks.TaskData(train, val)"),
    ("    def build_data(self, cfg):\n        return TaskData(super().build_data(cfg).train, None)",
     "build_data(cfg) gave TaskData.val = NoneType None; each split must be a map-style data set"),
    ("    def build_model(self, cfg):\n        return lambda x: x", "build_model(cfg) returned function"),
    ("    def build_model(self, cfg):\n        return super().build_model(cfg).requires_grad_(False)",
     "build_model(cfg) gave a Sequential with no trainable parameters (none, or every one frozen)"),
    ("    def metrics(self, mean_loss):\n        return None",
     "metrics(mean_loss) returned NoneType None; it must return a dict of names to numbers"),
    ("    def collate(self, samples):\n        return {**super().collate(samples), 'ids': [1, 2]}",
     "collate(samples)['ids'] returned a list of 2 items; every value of the batch must be a tensor"),
    ("    def metrics(self, mean_loss):\n        return {'mse': torch.tensor(mean_loss)}",
     "metrics(mean_loss)['mse'] returned a torch.float32 tensor"),
    ("    def metrics(self, mean_loss):\n        return {'mse': mean_loss, 'step': 1.0}",
     "metrics(mean_loss) names a metric 'step', which the evaluation record keeps for itself"),
    ("    def inputs(self, batch):\n        return batch['x']",
     "inputs(batch) returned a torch.float32 tensor of shape (8, 4)"),
    ("    def count(self, batch):\n        return None", "count(batch) returned NoneType None; it must return the batch's number"),
    ("    def evaluate(self, model, cfg, split, world, data=None, in_training=False):\n        import numpy\n"
     "        return {'r': numpy.float32(0.5)}",
     "evaluate(model, cfg, split, world)['r'] returned float32 np.float32(0.5); each metric must be a Python number"),
]


@pytest.mark.parametrize("body,said", [
    ("    def collate(self, samples, extra):\n        return None",
     "Bad.collate(self, samples, extra) cannot take (samples), what the harness passes it"),
    ("    def loss_from(self, out):\n        return None",
     "Bad.loss_from(self, out) cannot take (outputs, batch)"),
    ("    def __init__(self, size):\n        self.size = size", "Bad() must build without arguments"),
    ("    @staticmethod\n    def count(batch):\n        return len(batch['y'])", None),  # takes what it is given
    ("    collate = functools.partial(lambda samples, pad: samples, pad=0)", None),  # no self passed to it
    ("    def evaluate(self, model, cfg, split, world):\n        return {}",
     "Bad.evaluate(self, model, cfg, split, world) cannot take (model, cfg, split, world, in_training=True)"),
])
def test_a_task_method_that_cannot_take_what_the_harness_passes_is_refused_by_name(body, said, tmp_path):
    """It was a TypeError from the loop, a collate inside torch's DataLoader, or the registry building the task."""
    from harness.config.run import ConfigError
    from harness.tasks.registry import task_class

    task = tmp_path / "sig_task.py"
    task.write_text("import functools\n" + FLOAT_TASK + f"\n\nclass Bad(FloatTask):\n{body}\n")
    if said is None:
        assert task_class(f"{task}:Bad").__name__ == "Bad"
        return
    with pytest.raises(ConfigError) as refused:
        task_class(f"{task}:Bad")
    assert said in str(refused.value)


@pytest.mark.parametrize("config,said", [
    ("class C:\n    n_train: int = '256'", "Bad.Config.n_train = '256': its default is no int"),
    ("class C:\n    opts: set = frozenset()", "Bad.Config.opts: set is no type a TOML file holds"),  # config.toml
    ("class C:\n    n: int | None = None\n    pair: tuple[int, int] = (1, 2)", None),
    ("class C:\n    max_items: int = None", None),  # None: not set, as plug-ins have written it
])
def test_a_config_a_run_file_could_not_hold_is_refused_by_name(config, said, tmp_path):
    """A default of another type failed in the task's own code later; a set-typed field after launch, writing
    config.toml."""
    from harness.config.run import ConfigError
    from harness.tasks.registry import task_class

    task = tmp_path / "cfg_task.py"
    task.write_text(f"import dataclasses\n{FLOAT_TASK}\n\n@dataclasses.dataclass(frozen=True)\n{config}\n\n\n"
                    f"class Bad(FloatTask):\n    Config = C\n")
    if said is None:
        assert task_class(f"{task}:Bad").Config.__name__ == "C"
        return
    with pytest.raises(ConfigError) as refused:
        task_class(f"{task}:Bad")
    assert said in str(refused.value)


@pytest.mark.parametrize("body,said", BROKEN, ids=[b.split("(")[0].split()[-1] + str(i) for i, (b, _) in
                                                     enumerate(BROKEN)])
def test_what_a_task_returns_is_checked_where_the_harness_first_reads_it(body, said, tmp_path):
    """A task method's return value that breaks the interface: one line naming the task and the method (exit 2),
    not a traceback from the loop, DeepSpeed's engine or the JSON log."""
    task = tmp_path / "bad_task.py"
    task.write_text(FLOAT_TASK + f"\n\nclass Bad(FloatTask):\n{body}\n")
    run = harness(tmp_path / "run", tmp_path, check=False, sets=["train.max_steps=2", "train.micro_batch_size=8"],
                  args=["--set", f"run.task={json.dumps(f'{task}:Bad')}"])
    assert run.proc.returncode == 2, run.proc.stderr[-2000:]
    line = run.proc.stderr.strip().splitlines()[-1]
    assert line.startswith("harness: error: task Bad: ") and said in line, line
