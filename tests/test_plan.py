"""`harness plan` and the config it resolves: precedence, provenance, and every contradiction rejected before
launch with exit code 2 and the key named."""
from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from conftest import DS, ROOT, _env, cli, python
from harness.config.run import ConfigError, ScheduleSection, all_keys
from harness.tasks import resolve
from harness.config.ds import model_state_bytes, resolve_ds
from harness.distributed.optim import lr_factor

STEPS = ["train.max_steps=10"]


def plan(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    """`harness plan ARGS` in this process (it starts no process group), with the environment a new process would
    get; `test_plan_runs_as_a_command` runs it as one."""
    import contextlib
    import io
    import os

    from harness.cli import main

    out, err, saved = io.StringIO(), io.StringIO(), dict(os.environ)
    os.environ.clear()
    os.environ.update(_env(env))
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main(["plan", *args])
    finally:
        os.chdir(cwd)
        os.environ.clear()
        os.environ.update(saved)
    return subprocess.CompletedProcess(["harness", "plan", *args], rc, out.getvalue(), err.getvalue())


def test_plan_runs_as_a_command(tmp_path):
    ok = subprocess.run([python(), "-m", "harness", "plan", "--set", "train.max_steps=3"], cwd=ROOT,
                        env=_env(), capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "command line" in ok.stdout, ok.stderr
    bad = subprocess.run([python(), "-m", "harness", "plan", "--set", "train.max_stepz=3"], cwd=ROOT,
                         env=_env(), capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and bad.stderr.startswith("harness: error:") and \
        len(bad.stderr.strip().splitlines()) == 1


def write(tmp_path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_scripts_can_rely_on_these_keys():
    required = {"train.max_steps", "train.micro_batch_size", "train.grad_accum_steps", "train.log_every",
                "train.eval_every", "train.save_every", "optimizer.lr", "run.output_dir"}
    assert required <= set(all_keys())
    assert all(f.metadata["help"] for f in all_keys().values())


def test_every_option_of_every_command_says_what_it_is():
    """`--help` lists no bare option (evaluate's and export's --run-dir had none)."""
    import argparse

    from harness.cli import parser

    def bare(p, path):
        for a in p._actions:
            if isinstance(a, argparse._SubParsersAction):
                for name, sub in a.choices.items():
                    yield from bare(sub, f"{path} {name}")
            elif a.option_strings and not a.help:
                yield f"{path} {a.option_strings[0]}"

    assert list(bare(parser(), "harness")) == []


def test_the_core_config_stays_small_and_each_built_in_task_declares_its_own_section():
    import dataclasses

    from harness.config.run import SECTIONS
    from harness.tasks import task_class, task_sections

    assert list(SECTIONS) == ["run", "model", "data", "train", "optimizer", "schedule", "logging"]
    assert len(all_keys()) <= 61  # a task's settings belong to the task
    assert list(task_sections()) == ["translation", "protein", "prices"]
    for name in task_sections():
        cls = task_class(name)
        assert cls.section == name and dataclasses.is_dataclass(cls.Config)  # [protein] for run.task = "protein"
        for f in dataclasses.fields(cls.Config):
            assert f.default is not dataclasses.MISSING and f.metadata["help"], f"{name}.{f.name}"


def test_precedence_defaults_then_run_file_then_command_line(tmp_path):
    run = write(tmp_path, "run.toml", "[train]\nmax_steps = 5\nmicro_batch_size = 3\n[optimizer]\nlr = 0.01\n")
    r = resolve(run, ["optimizer.lr=0.02"])
    assert (r.cfg.train.max_steps, r.cfg.train.micro_batch_size, r.cfg.optimizer.lr) == (5, 3, 0.02)
    assert r.source["train.max_steps"] == f"run file {run}"
    assert r.source["optimizer.lr"] == "command line"
    assert r.source["train.seed"] == "default"
    tensorboard = plan("--run", run, "--set", 'logging.backend="tensorboard"', "--set", 'logging.project="team/x"')
    assert tensorboard.returncode == 0, tensorboard.stderr  # W&B's rules for its project name bind W&B alone
    bom = tmp_path / "bom.toml"  # saved by an editor that starts UTF-8 with a byte-order mark: it was malformed TOML
    bom.write_bytes(b"\xef\xbb\xbf[train]\nmax_steps = 3\n")
    assert resolve(str(bom), []).cfg.train.max_steps == 3


def test_plan_prints_values_with_their_sources_and_memory(tmp_path):
    run = write(tmp_path, "run.toml", "[train]\nmax_steps = 5\n")
    out = plan("--run", run, "--ds", str(DS / "zero3.json"), "--set", "train.micro_batch_size=2",
               "--world-size", "4", "--set", "train.grad_accum_steps=3")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "train.max_steps" in text and f"run file {run}" in text
    assert "train.micro_batch_size" in text and "command line" in text
    assert "train_batch_size                                 = 24" in text  # 2 x 3 x 4, derived
    both = plan("--run", run, "--set", "train.grad_accum_steps=2", "--set", "train.global_batch_size=32",
                "--world-size", "2")  # set, and agreeing with the global batch: the line names where it was set
    assert re.search(r"gradient_accumulation_steps +=\s+2\s+# train.grad_accum_steps \(command line\)\n",
                     both.stdout), both.stdout[-3000:]
    assert "world size 4" in text and "ZeRO stage 3" in text and "model states per rank" in text


def test_zero_memory_estimate_shrinks_with_stage():
    r = resolve(None, STEPS)
    est = {stage: model_state_bytes(1000, resolve_ds(r, str(DS / f"zero{stage}.json"), 4, "bf16"))["device"]
           for stage in range(4)}
    # ZeRO paper, mixed precision, N=4: 16, 4 + 12/4, 2 + 14/4, 16/4 bytes per parameter
    assert est == {0: 16000, 1: 7000, 2: 5500, 3: 4000}
    fp32 = {stage: model_state_bytes(1000, resolve_ds(r, str(DS / f"zero{stage}.json"), 4, "no"))["device"]
            for stage in range(4)}
    # fp32: 4 + 4 + 8 at ZeRO-0; ZeRO 1-3 also step an fp32 copy of the partition (4 + 8 = 12 sharded), as measured
    assert fp32 == {0: 16000, 1: 11000, 2: 8000, 3: 5000}
    offload = model_state_bytes(1000, resolve_ds(r, str(DS / "zero2_offload.json"), 4, "bf16"))
    assert offload == {"device": 2500, "cpu": 4000}  # the CPU's optimizer partition with its fp32 gradient
    persistent = model_state_bytes(1000, resolve_ds(r, str(DS / "zero3.json"), 4, "bf16"), persistent=250)["device"]
    assert persistent == 4000 + 250 * 2  # ZeRO-3's small tensors: their 16-bit weights whole on every rank as well


def test_the_memory_on_paper_counts_the_optimizer_and_the_zero3_parameters_the_engines_hold(tmp_path):
    """The plan's optimizer state a parameter and ZeRO-3's parameters held whole on every rank, against the engines
    `harness train` builds (tests/state_probe.py): AdamW's m and v, SGD's momentum or none, a torch.optim class from
    the DeepSpeed file (RMSprop with momentum and centring: three buffers); persistence by DeepSpeed's default
    threshold and by a file's thresholds (the per-model cap too). AdamW's 8 bytes had been counted for all."""
    rms = write(tmp_path, "rms.json", json.dumps({"optimizer": {"type": "RMSprop", "params": {
        "lr": "auto", "momentum": 0.9, "centered": True}}, "zero_optimization": {"stage": 0}}))
    small = write(tmp_path, "small.json", json.dumps({"zero_optimization": {
        "stage": 3, "stage3_param_persistence_threshold": 1000, "stage3_model_persistence_threshold": 5000}}))
    sgd = ['optimizer.name="sgd"', "optimizer.momentum="]
    cases = [["zero0", []], ["zero0", [sgd[0], sgd[1] + "0.9"]], ["zero0", [sgd[0], sgd[1] + "0.0"]], ["zero2", []],
             [rms, []], ["zero3", []], [small, []]]
    done = subprocess.run([python(), str(ROOT / "tests" / "state_probe.py"), json.dumps(cases)], cwd=ROOT,
                          env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [f["state"] for f in found] == [8.0, 4.0, 0.0, 8.0, 12.0, 8.0, 8.0], found
    assert all(f["planned"] == f["state"] and f["planned_persistent"] == f["persistent"] for f in found), found
    assert found[5]["persistent"] > 0 and 0 < found[6]["persistent"] <= 5000, found
    out = plan("--set", sgd[0], "--set", sgd[1] + "0.0", "--set", "train.max_steps=5")
    assert "(weights, gradients, SGD state of 0 bytes a parameter; activations not included)" in out.stdout, out


@pytest.mark.parametrize("args,ds,message", [
    (["--set", "train.global_batch_size=12", "--set", "train.grad_accum_steps=2", "--set", "train.micro_batch_size=2",
      "--world-size", "2"], None,
     "micro batch x accumulation x data-parallel size != global batch"),
    (["--world-size", "2"], {"train_batch_size": 99}, "set it to \"auto\", or make them agree"),  # no --set: 99/16
    (["--world-size", "2"], {"train_batch_size": 64}, "make them agree: --set train.global_batch_size=64"),
    ([], {"gradient_clipping": 0.5}, "make them agree: --set train.grad_clip=0.5"),
    (["--world-size", "2"], {"gradient_accumulation_steps": 4},
     "contradicts train.grad_accum_steps = 1 (default); set it to \"auto\", or make them agree: --set "
     "train.grad_accum_steps=4"),
    (["--world-size", "2"], {"gradient_accumulation_steps": 2, "pipeline": {"stages": 2, "micro_batches": 4}},
     "(pipeline.micro_batches (ds file"),  # no --set below: the pipeline sets it
    ([], {"fp16": {"enabled": True}, "bf16": {"enabled": True}}, "fp16.enabled and bf16.enabled are both true"),
    (["--mixed-precision", "fp16"], {"bf16": {"enabled": True}}, "accelerate mixed_precision = 'fp16'"),
    (["--set", "train.max_stepz=3"], None, "did you mean `train.max_steps`"),
    (["--set", "train.micro_batch_size=\"four\""], None, "train.micro_batch_size must be int"),
    ([], {"zero_optimisation": {"stage": 2}}, "did you mean `zero_optimization`"),
    ([], {"zero_optimization": {"stage": 2, "overlap_com": True}}, "did you mean `overlap_comm`"),
    (["--set", "optimizer.beta2=0.98"], {"optimizer": {"type": "AdamW", "params": {"betas": [0.9, 0.999]}}},
     "(optimizer.beta1: default; optimizer.beta2: command line)"),  # it said (default) for both
    (["--set", "optimizer.lr=0.001"], {"optimizer": {"type": "AdamW", "params": {"lr": 0.5}}},
     "optimizer.params.lr = 0.5 vs optimizer.lr = 0.001 (command line)"),
    ([], {"scheduler": {"type": "Cosine"}}, "scheduler.type = 'Cosine'"),
    ([], {"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": "auto"}}},  # schedule.warmup_steps 0
     "DeepSpeed's WarmupLR refuses fewer than one warmup step (ValueError), and warms up over 2 at least"),
    ([], {"zero_optimization": {"stage": 1, "offload_param": {"device": "cpu"}}}, "needs ZeRO stage 3"),
    (["--set", "model.vocab_size=300"], None, "model.vocab_size = 300"),
    (["--set", "data.path=\"no/such/file.txt\""], None, "data.path not found"),
    (["--set", "data.bucket=20"], None, "task 'lm' has samples of one length"),
    (["--set", "data.bucket=-1"], None, "data.bucket = -1 (command line) must be >= 0"),
    (["--set", "train.profile_step=-1"], None, "train.profile_step = -1 (command line) must be >= 0"),
    (["--set", "train.early_stopping_patience=2"], None,
     "train.early_stopping_patience = 2 (command line) needs train.select_best"),
    (["--set", "train.select_best=\"loss\"", "--set", "train.early_stopping_patience=2"], None,
     "counts evaluations, but train.eval_every = 0 (default) evaluates only at the end"),
    (["--set", "train.select_best=\"accuracy\""], None, "task 'lm' reports loss, perplexity, bits_per_byte"),
    (["--set", "train.select_best=\"loss\"", "--set", "train.select_mode=\"up\""], None,
     "train.select_mode must be one of auto, min, max"),
])
def test_plan_rejects_contradictions_naming_the_key(args, ds, message, tmp_path):
    extra = ["--ds", write(tmp_path, "ds.json", json.dumps(ds))] if ds is not None else []
    out = plan("--set", "train.max_steps=3", *args, *extra)
    assert out.returncode == 2, out.stdout
    assert message in out.stderr, out.stderr
    if ("or make them agree" in message or "pipeline.micro_batches" in message) and "--set" not in message:
        assert "--set" not in out.stderr, out.stderr
    assert out.stderr.startswith("harness: error:") and len(out.stderr.strip().splitlines()) == 1


def test_contradiction_message_names_both_values_and_sources(tmp_path):
    run = write(tmp_path, "run.toml", "[train]\nmax_steps = 3\ngrad_accum_steps = 2\n")
    ds = write(tmp_path, "ds.json", json.dumps({"gradient_accumulation_steps": 4}))
    with pytest.raises(ConfigError) as e:
        resolve_ds(resolve(run), ds, 1)
    msg = str(e.value)
    assert "gradient_accumulation_steps = 4" in msg and f"ds file {ds}" in msg
    assert "train.grad_accum_steps = 2" in msg and f"run file {run}" in msg


def test_auto_precision_follows_accelerate_and_agreeing_values_pass(tmp_path):
    r = resolve(None, STEPS)
    assert resolve_ds(r, str(DS / "zero2.json"), 2, "bf16").precision == "bf16"
    assert resolve_ds(r, str(DS / "zero2.json"), 2, "no").precision == "fp32"
    # no precision asked for: bf16 on a GPU that has it (the default for speed), fp32 elsewhere
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr("harness.config.ds.gpu_has_bf16", lambda: True)
        on_gpu = resolve_ds(r, str(DS / "zero2.json"), 2, "no")
        assert on_gpu.precision == "bf16" and "bf16, the default on this GPU" in on_gpu.source["bf16.enabled"]
        assert resolve_ds(r, str(DS / "zero2.json"), 2, "fp16").precision == "fp16"  # asked for: followed
        assert resolve_ds(r, str(DS / "fp32.json"), 2, "no").precision == "fp32"  # pinned: kept
    agreeing = write(tmp_path, "ds.json", json.dumps({"gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
                                                      "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}))
    ds = resolve_ds(r, agreeing, 2)
    assert ds.config["train_batch_size"] == 16 and "optimizer" not in ds.config


@pytest.mark.parametrize("files,message", [
    ({"--run": ("run.toml", "[train\nmax_steps = 3")}, "malformed TOML"),
    ({"--ds": ("ds.json", "{\"zero_optimization\": ")}, "malformed JSON"),
    ({"--run": None}, "run file not found"),
    ({"--ds": None}, "DeepSpeed config not found"),
])
def test_missing_or_malformed_files_are_one_line_errors(files, message, tmp_path):
    args = ["--set", "train.max_steps=3"]
    for flag, spec in files.items():
        args += [flag, write(tmp_path, *spec) if spec else str(tmp_path / "nope")]
    out = plan(*args)
    assert out.returncode == 2 and message in out.stderr and len(out.stderr.strip().splitlines()) == 1


def test_train_rejects_missing_data_before_any_process_starts(tmp_path):
    out = cli("train", "--set", "train.max_steps=3", "--set", f"data.path=\"{tmp_path / 'missing.txt'}\"", "--set",
              f"run.output_dir=\"{tmp_path / 'run'}\"", timeout=120)
    assert out.returncode == 2 and "data.path not found" in out.stderr
    assert not (tmp_path / "run").exists()


def test_lr_schedule_warmup_then_decay():
    cos = ScheduleSection(kind="cosine", warmup_steps=10, min_lr_ratio=0.1)
    assert lr_factor(0, 110, cos) == pytest.approx(0.1)
    assert lr_factor(9, 110, cos) == pytest.approx(1.0)
    assert lr_factor(60, 110, cos) == pytest.approx(0.55)      # halfway down the cosine
    assert lr_factor(110, 110, cos) == pytest.approx(0.1)
    lin = ScheduleSection(kind="linear", warmup_steps=0, min_lr_ratio=0.0)
    assert lr_factor(25, 100, lin) == pytest.approx(0.75)
    isq = ScheduleSection(kind="inverse_sqrt", warmup_steps=4, min_lr_ratio=0.0)
    assert lr_factor(15, 100, isq) == pytest.approx(0.5)


def test_a_jit_build_lock_left_by_a_killed_build_is_removed_at_start_or_while_waiting_and_a_wait_is_said(
        tmp_path, corpus, monkeypatch, capsys):
    """A DeepSpeed op build killed midway leaves `<op>/lock`, and torch's FileBaton would wait on it forever."""
    import os
    import shutil
    import threading
    import time
    from pathlib import Path

    from torch.utils.file_baton import FileBaton

    from harness.run import builds
    from harness.run.builds import BuildLocks, clear_stale_build_locks, watching_build_locks

    # the extensions folder is this environment's and host's unless TORCH_EXTENSIONS_DIR names one
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    ours = builds.extension_root()
    assert os.environ["TORCH_EXTENSIONS_DIR"] == str(ours) and ours.name.startswith("env-")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    monkeypatch.setattr(sys, "prefix", "/another/venv")
    assert builds.extension_root().parent == ours.parent and builds.extension_root() != ours
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "ext"))
    assert builds.extension_root() == tmp_path / "ext"

    lock = tmp_path / "ext" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    said = []
    fresh = BuildLocks(tmp_path / "ext", say=said.append)
    assert fresh.look() == [] and fresh.look(time.time() + 5) == []  # a build may be starting: left alone
    old = time.time() - 600
    os.utime(lock, (old, old))
    # a build running in the lock's directory (ninja there) keeps it; a compiler elsewhere (torch.compile's) does not
    ninja = tmp_path / "bin" / "ninja"
    ninja.parent.mkdir()
    ninja.symlink_to(shutil.which("sleep"))

    def build(cwd: Path) -> subprocess.Popen:
        proc = subprocess.Popen([str(ninja), "60"], cwd=cwd)
        while not Path(f"/proc/{proc.pid}/cmdline").read_bytes().startswith(str(ninja).encode()):
            time.sleep(0.02)  # until the process shows its own name
        return proc

    elsewhere = build(tmp_path / "bin")
    try:
        assert clear_stale_build_locks(tmp_path / "ext") == [lock] and not lock.exists()
    finally:
        elsewhere.kill()
    # waiting on another process's live build: said once, then how long; killed midway, its lock goes
    lock.touch()
    os.utime(lock, (old, old))
    builder = build(lock.parent)
    with watching_build_locks(every_s=0.2, root=tmp_path / "ext", confirm_s=0.5, say_every_s=0.5,
                              say=said.append):
        threading.Timer(2.0, builder.kill).start()
        started = time.time()
        FileBaton(str(lock)).wait()  # torch's own wait, in the main thread as in a rank
        waited = time.time() - started
    builder.wait()
    assert 2.0 < waited < 10, waited
    assert said[0] == (f"waiting for another process's JIT build of DeepSpeed's deepspeed_shm_comm op (by pid "
                       f"{builder.pid}): torch waits until its lock {lock} is gone"), said
    assert any(x.startswith("still waiting for the build of deepspeed_shm_comm (") for x in said[1:-1]), said
    assert said[-1].startswith(f"removed {lock}: a JIT build of DeepSpeed's deepspeed_shm_comm op left it "), said
    # the checks before a run (harness train's, harness launch's) remove a stale lock, saying so, and go on
    from harness.api import plan
    from harness.run.startup import preflight

    lock.touch()
    os.utime(lock, (old, old))
    preflight(plan(None, ["train.max_steps=3", f"data.path={json.dumps(str(corpus))}",
                          f"run.output_dir={json.dumps(str(tmp_path / 'run'))}"]), None, False)
    assert f"harness: removed {lock}: a JIT build of DeepSpeed's deepspeed_shm_comm op left it " in \
        capsys.readouterr().err
    assert not lock.exists()
    # a folder the nodes share (NFS, Lustre): another host's build cannot be seen from here, so its lock stays
    mounts = f"server:/home /home nfs4 rw 0 0\n/dev/sda1 / ext4 rw 0 0\nfs {tmp_path / 'ext'} lustre rw 0 0\n"
    assert builds.network_fs(tmp_path / "ext" / "deepspeed_shm_comm", mounts) == "lustre"
    assert builds.network_fs(tmp_path, mounts) is None and builds.network_fs(Path("/home/u"), mounts) == "nfs4"
    stacked = "auto /shared autofs rw 0 0\nserver:/shared /shared nfs4 rw 0 0\n"  # the last mounted is the one seen
    assert builds.network_fs(Path("/shared/ext"), stacked) == "nfs4"
    monkeypatch.setattr(builds, "network_fs", lambda path: "lustre")
    lock.touch()
    os.utime(lock, (old, old))
    assert clear_stale_build_locks(tmp_path / "ext") == [] and lock.exists()
    assert BuildLocks(ours).shared is None  # the default folder is this host's alone, on whatever file system


@pytest.mark.parametrize("arch,plain", [("9.0a", "9.0"), ("8.0;9.0a", "8.0;9.0"), ("8.0 9.0a+PTX", "8.0 9.0+PTX"),
                                        ("10.0f;12.0a", "10.0;12.0"), ("8.6+PTX", "8.6+PTX"), (None, None)])
def test_deepspeed_builds_see_an_arch_list_it_can_parse(arch, plain, monkeypatch):
    import os

    from harness.distributed.optim import deepspeed_arch_list

    if arch is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", arch)
    with deepspeed_arch_list():
        assert os.environ.get("TORCH_CUDA_ARCH_LIST") == plain
    assert os.environ.get("TORCH_CUDA_ARCH_LIST") == arch  # restored: other builds (inductor) see the user's list


@pytest.mark.parametrize("sets,ds,message", [
    (["optimizer.name=\"sgd\""], {"optimizer": {"type": "AdamW"}},
     "optimizer.type = 'adamw' vs optimizer.name = 'sgd' (command line)"),
    (["optimizer.name=\"sgd\"", "optimizer.momentum=0.8"], {"optimizer": {"type": "SGD", "params": {"momentum": 0.5}}},
     "optimizer.params.momentum = 0.5 vs optimizer.momentum = 0.8 (command line)"),
    (["optimizer.name=\"sgd\""], {"optimizer": {"type": "SGD", "params": {"betas": [0.9, 0.9]}}},
     "optimizer.params.betas (ds.json) is not a parameter the harness honours for SGD"),
    ([], {"optimizer": {"type": "Adamw2"}}, "optimizer.type = 'Adamw2' (ds.json) is not an optimizer DeepSpeed has"),
    (["optimizer.name=\"sgd\""], {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
     "runs DeepSpeed's CPU Adam, not optimizer.name = 'sgd'"),
    (["optimizer.name=\"sgd\"", "optimizer.beta1=0.8"], None, "optimizer.beta1 = 0.8 (command line) apply to "
     "optimizer.name = 'adamw'"),
    (["optimizer.momentum=0.5"], None, "apply to optimizer.name = 'sgd'"),
    (["optimizer.name=\"lion\""], None, "optimizer.name must be one of adamw, sgd"),
    (["optimizer.name=\"sgd\"", "optimizer.momentum=1.0"], None, "optimizer.momentum = 1.0 (command line) must be "
     "in [0, 1)"),
    (["optimizer.nesterov=true"], None, "optimizer.nesterov = True (command line) apply to optimizer.name = 'sgd'"),
])
def test_optimizer_choice_and_the_deepspeed_section_must_agree(sets, ds, message, tmp_path):
    path = write(tmp_path, "ds.json", json.dumps(ds)) if ds is not None else None
    with pytest.raises(ConfigError) as e:
        resolve_ds(resolve(None, ["train.max_steps=3", *sets]), path, 1)
    assert message in str(e.value).replace(f"ds file {path}", "ds.json")


def test_an_agreeing_sgd_section_is_accepted(tmp_path):
    ds = write(tmp_path, "ds.json", json.dumps({"optimizer": {"type": "SGD", "params": {"lr": "auto",
                                                                                     "momentum": 0.9}}}))
    r = resolve_ds(resolve(None, ["train.max_steps=3", "optimizer.name=\"sgd\""]), ds, 1)
    assert "optimizer" not in r.config  # the run file's optimizer is what trains


def test_ds_names_a_shipped_config_the_same_way_in_every_command(capsys):
    """`--ds zero2` is configs/ds/zero2.json in plan and train as in bench; a name that is neither a file nor a
    shipped config is one line listing them."""
    from harness.cli import main

    assert main(["plan", "--ds", "zero2", "--set", "train.max_steps=3"]) == 0
    assert "ZeRO stage 2" in capsys.readouterr().out
    assert main(["plan", "--ds", "zero9", "--set", "train.max_steps=3"]) == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("harness: error: --ds zero9: neither a file nor one of configs/ds/*.json (") and \
        "zero3_offload" in err


def test_plan_takes_the_launch_s_options_and_plans_its_world():
    """What `harness launch` takes before `train` (an accelerate config file, --num_processes) sets the planned world
    and global batch; without them the plan says it planned one process and how to plan the launch."""
    main_job = ["--run", str(ROOT / "configs" / "runs" / "lm_demo.toml"), "--ds", "zero2"]
    launched = cli("plan", "--config_file", str(ROOT / "launch" / "cpu_2proc.yaml"), *main_job)
    assert launched.returncode == 0, launched.stderr[-2000:]
    assert "global batch 16 = micro 8 x accumulation 1 x data parallel 2" in launched.stdout
    assert "planned for 1 process" not in launched.stdout
    four = cli("plan", *main_job, "--num_processes=4")
    assert four.returncode == 0 and "data parallel 4" in four.stdout, four.stderr[-2000:]
    alone = cli("plan", *main_job)
    assert "global batch 8 " in alone.stdout and "(planned for 1 process: `harness plan` takes what `harness launch` " \
        "takes before `train`" in alone.stdout
    both = cli("plan", *main_job, "--num_processes", "2", "--world-size", "2")
    assert both.returncode == 2 and "not both" in both.stderr


ACCELERATE_DS = """compute_environment: LOCAL_MACHINE
distributed_type: DEEPSPEED
deepspeed_config:
  zero_stage: 2
  offload_optimizer_device: none
mixed_precision: bf16
num_machines: 1
num_processes: 2
machine_rank: 0
"""


@pytest.mark.parametrize("where", ["accelerate config", "ds file"])
def test_accelerate_mixed_precision_enables_the_section_a_deepspeed_config_lacks(where, tmp_path):
    """As accelerate does (DeepSpeedPlugin.set_mixed_precision): mixed_precision bf16 with a DeepSpeed config that
    has no bf16 section (accelerate's own DeepSpeed settings, as `accelerate config` writes them, or an HF-style file)
    trains bf16; it had been refused as contradicting "fp32". A section that says otherwise is still refused
    (test_plan_rejects_contradictions_naming_the_key)."""
    args = ["--config_file", write(tmp_path, "accelerate.yaml", ACCELERATE_DS)] if where == "accelerate config" else \
        ["--mixed-precision", "bf16", "--world-size", "2", "--ds",
         write(tmp_path, "ds.json", json.dumps({"zero_optimization": {"stage": 2}}))]
    out = plan("--set", "train.max_steps=3", *args)
    assert out.returncode == 0, out.stderr
    assert "accelerate mixed_precision='bf16', where " in out.stdout and "has no bf16 section" in out.stdout
    assert "ZeRO stage 2, bf16," in out.stdout, out.stdout[-1500:]
