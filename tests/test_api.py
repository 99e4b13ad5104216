"""The Python API (`import harness`): each public function callable any number of times in one process, whatever
was imported before it."""
from __future__ import annotations

import json
import subprocess

import pytest

from conftest import ROOT, TINY, _env, python
from test_plugins import FLOAT_TASK

SCRIPT = """
import sys
if sys.argv[1] == "cli first":
    import harness.cli  # noqa: F401 - the command line's modules (harness.plan.render, ...) imported before the API
import harness
sets = {sets!r}
for i in (1, 2):
    p = harness.plan(sets=sets)
    print("PLAN", p.ds.global_batch_size, harness.plan_text(p).count("\\n") > 10)
    r = harness.train(sets=[*sets, f"run.output_dir={{sys.argv[2]}}/run{{i}}"])
    print("TRAIN", r["step"])
    print("EVAL", sorted(harness.evaluate(f"{{sys.argv[2]}}/run{{i}}", "validation")))
    model, cfg = harness.load_model(f"{{sys.argv[2]}}/run{{i}}")
    print("LOAD", type(model).__name__, cfg.train.max_steps)
import harness.plan.render  # the subpackage is still there, and harness.plan still the function
print("AGAIN", harness.plan(sets=sets).ds.global_batch_size, harness.plan.render.__name__)
"""


@pytest.mark.parametrize("order", ["api first", "cli first"])
def test_every_api_function_is_callable_twice_in_one_process(order, tmp_path, corpus):
    sets = [*TINY, "train.max_steps=2", f"data.path={json.dumps(str(corpus))}"]
    proc = subprocess.run([python(), "-c", SCRIPT.format(sets=sets), order, str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line.split(" ", 1) for line in proc.stdout.splitlines() if line.split(" ")[0].isupper()]
    assert [k for k, _ in lines] == ["PLAN", "TRAIN", "EVAL", "LOAD"] * 2 + ["AGAIN"], proc.stdout[-2000:]
    assert dict(lines)["PLAN"] == "4 True" and dict(lines)["TRAIN"] == "2"
    assert dict(lines)["AGAIN"] == "4 harness.plan.render"


STOPPED = """
import os
import sys
import harness
sets = ['run.task="tests.slow_eval_task:SlowEvalDigits"', "train.max_steps=4", f"run.output_dir={sys.argv[1]!r}"]
try:
    harness.train("examples/digits.toml", sets=[s.replace("'", '"') for s in sets])
except harness.Preempted as e:  # the task sends its process SIGTERM in step 1 (Ctrl-C in a notebook is SIGINT)
    print("PREEMPTED", e)
os.environ.pop("SIGNAL_AT_STEP")
print("RESUMED", harness.train("examples/digits.toml", sets=[s.replace("'", '"') for s in sets], resume="auto")["step"])
"""


def test_a_run_stopped_by_a_signal_raises_harness_preempted_and_resumes(tmp_path):
    proc = subprocess.run([python(), "-c", STOPPED, str(tmp_path / "run")], cwd=ROOT, env=_env({"SIGNAL_AT_STEP": "1"}),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "PREEMPTED stopped by SIGTERM after step 2 of 4; latest checkpoint: step_00000002" in proc.stdout, \
        proc.stdout[-2000:]
    assert "RESUMED 4" in proc.stdout


TASK_OBJECT = """
import sys
import harness
from examples.digits_task import DigitsTask
run = sys.argv[1]
harness.train("examples/digits.toml", sets=["train.max_steps=3", f"run.output_dir={run!r}".replace("'", '"')],
              ds="configs/ds/zero0.json")
for _ in (1, 2):
    print("EVAL", sorted(harness.evaluate(run, "test", task=DigitsTask())))
    model, cfg = harness.load_model(run, task=DigitsTask())
    print("LOAD", type(model).__name__)
"""


def test_evaluate_and_load_model_take_the_task_as_an_object(tmp_path):
    """`task=` takes the object in every function that takes a task: a run of the file plug-in
    examples/digits_task.py, evaluated and loaded with an instance of the class imported as a module."""
    proc = subprocess.run([python(), "-c", TASK_OBJECT, str(tmp_path / "digits")], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith(("EVAL", "LOAD"))]
    assert len(lines) == 4 and lines[0] == lines[2] and "mse" in lines[0] and lines[1] == lines[3], proc.stdout


BOOM = """
import sys
import harness
from harness.tasks.lm import LanguageModelTask


class Boom(LanguageModelTask):
    def loss_from(self, outputs, batch):
        raise RuntimeError("boom in the loss")


harness.train(sets=[*{sets!r}, f"run.output_dir={{sys.argv[1]!r}}".replace("'", '"')], task=Boom())
"""


def test_an_error_in_one_process_is_printed_once_as_python_prints_it(tmp_path, corpus):
    """torch's process group wraps sys.excepthook to prefix every line with "[rank0]: "; a world of one that the
    harness started itself gives the hook back when it closes."""
    sets = [*TINY, f"data.path={json.dumps(str(corpus))}"]
    # cold: the task class lives in the script's __main__, which a warm fork's is not
    proc = subprocess.run([python(cold=True), "-c", BOOM.format(sets=sets), str(tmp_path / "run")], cwd=ROOT,
                          env=_env(cold=True), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr[-3000:]
    assert "RuntimeError: boom in the loss" in proc.stderr and "[rank0]" not in proc.stderr


LAUNCHED_TWICE = """
import os, sys
import harness
sets = {sets!r}
try:  # rank 1 means another run: refused on every rank as the world starts, which is then closed for the next
    harness.train(sets=[*sets, f"run.output_dir={{sys.argv[1]}}/run0",
                        f"optimizer.lr={{0.01 if os.environ['RANK'] == '1' else 0.003}}"])
except harness.ConfigError as e:
    with open(f"{{sys.argv[1]}}/refused", "a") as f:
        f.write(f"rank {{os.environ['RANK']}}: {{str(e).split(': ', 1)[1].split(';')[0]}}\\n")
for i in (1, 2, 3):  # the ranks' second and later worlds meet in the launcher's store, which holds the first's keys
    r = harness.train(sets=[*sets, f"run.output_dir={{sys.argv[1]}}/run{{i}}"], ds="zero2")
    with open(f"{{sys.argv[1]}}/trained", "a") as f:
        f.write(f"rank {{os.environ['RANK']}} run {{i}} step {{r['step']}}\\n")
"""


def test_the_api_trains_again_in_a_script_accelerate_launched(tmp_path, corpus):
    """A script under `accelerate launch` that calls harness.train more than once: each call starts its world anew
    on every rank (before: the second failed in gloo's connectFullMesh, or hung)."""
    from conftest import LAUNCH

    sets = [*TINY, "train.max_steps=2", f"data.path={json.dumps(str(corpus))}"]
    script = tmp_path / "twice.py"
    script.write_text(LAUNCHED_TWICE.format(sets=sets))
    proc = subprocess.run([python(), "-m", "accelerate.commands.launch", "--config_file",
                           str(LAUNCH / "cpu_2proc.yaml"), str(script), str(tmp_path)], cwd=ROOT, env=_env(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert sorted((tmp_path / "trained").read_text().splitlines()) == \
        [f"rank {r} run {i} step 2" for r in (0, 1) for i in (1, 2, 3)], proc.stdout[-2000:]
    assert sorted((tmp_path / "refused").read_text().splitlines()) == [
        f"rank {r}: optimizer.lr = 0.01 there, 0.003 on rank 0" for r in (0, 1)], proc.stdout[-2000:]


LOCAL_TASK = FLOAT_TASK + """
import sys
import harness


def make(validation=True):
    class Local(FloatTask):  # defined in a function: `harness.evaluate` and `load_model` looked its name up, and failed
        def build_model(self, cfg):  # one layer used twice: exported once, and loaded back (it was refused)
            shared = nn.Linear(4, 4)
            return nn.Sequential(shared, nn.Tanh(), shared, nn.Linear(4, 1))

        def build_data(self, cfg):
            data = super().build_data(cfg)
            return data if validation else TaskData(data.train, [])

        def metrics(self, mean_loss):  # a "loss" of its own: the record's is the mean loss all the same
            return {"loss": 123.0, "mse": mean_loss}
    return Local()


out, sets = sys.argv[1], ["train.max_steps=2", "train.micro_batch_size=8"]
trained = harness.train(sets=[*sets, f'run.output_dir="{out}/a"'], task=make())
scored = harness.evaluate(f"{out}/a", split="validation", task=make())
print("EVAL", scored["loss"] == trained["loss"] == trained["mse"])
print("LOAD", type(harness.load_model(f"{out}/a", task=make())[0]).__name__)
harness.train(sets=[*sets, f'run.output_dir="{out}/b"'], task=make(validation=False))  # (data.mix: AttributeError)
"""


def test_a_task_class_defined_in_a_function_evaluates_and_loads_and_may_hold_no_validation(tmp_path):
    """A class defined in a function, a model that uses one layer twice, a task without validation samples."""
    proc = subprocess.run([python(), "-c", LOCAL_TASK, str(tmp_path)], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "EVAL True" in proc.stdout and "LOAD Sequential" in proc.stdout and "defined in a function" in proc.stdout
    assert "note: the validation split holds nothing to evaluate: no evaluation runs; Local.build_data's validation " \
           "samples (TaskData.val) gives one" in proc.stdout, proc.stdout[-2000:]
