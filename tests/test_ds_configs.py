"""DeepSpeed and accelerate configs as users already have them (config/ds_optim.py, config/accelerate.py): the five
shapes HF Trainer's and accelerate's DeepSpeed files take (written here, not copied) plan and train; "auto" is filled
from the run file, an explicit value adopted where the run keeps its default and refused, every mismatch in one
line, where the user set another; DeepSpeed's schedulers run their own curve, step by step; accelerate's DeepSpeed
settings are the strategy when no --ds is named, and train what the same --ds file trains."""
from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import LAUNCH, ROOT, TINY, _env, cli, command, harness

from harness.config.ds import resolve_ds
from harness.config.run import ConfigError
from harness.api import plan_text
from harness.plan.resolve import make_plan
from harness.tasks import resolve

AUTO_BATCH = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto",
              "gradient_accumulation_steps": "auto", "gradient_clipping": "auto"}
ADAMW_AUTO = {"type": "AdamW", "params": {"lr": "auto", "betas": "auto", "eps": "auto", "weight_decay": "auto"}}
WARMUP = {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto", "warmup_num_steps": "auto"}}
DECAY = {"type": "WarmupDecayLR", "params": {**WARMUP["params"], "total_num_steps": "auto"}}
PRECISION_AUTO = {"fp16": {"enabled": "auto", "loss_scale": 0, "loss_scale_window": 1000, "initial_scale_power": 16,
                           "hysteresis": 2, "min_loss_scale": 1}, "bf16": {"enabled": "auto"}}
Z3_AUTO = {"overlap_comm": True, "contiguous_gradients": True, "sub_group_size": 1e9, "reduce_bucket_size": "auto",
           "stage3_prefetch_bucket_size": "auto", "stage3_param_persistence_threshold": "auto",
           "stage3_max_live_parameters": 1e9, "stage3_max_reuse_distance": 1e9,
           "stage3_gather_16bit_weights_on_model_save": True}
OFFLOAD = {"device": "cpu", "pin_memory": True}
SHAPES = {  # the shapes of the files HF Trainer's DeepSpeed tests and accelerate's templates use
    "zero1": {**PRECISION_AUTO, "optimizer": ADAMW_AUTO, "scheduler": WARMUP, **AUTO_BATCH,
              "zero_optimization": {"stage": 1}},
    "zero2_offload": {**PRECISION_AUTO, "optimizer": ADAMW_AUTO, "scheduler": DECAY, **AUTO_BATCH,
                      "zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD, "allgather_partitions": True,
                                            "allgather_bucket_size": 2e8, "overlap_comm": True,
                                            "reduce_scatter": True, "reduce_bucket_size": "auto",
                                            "contiguous_gradients": True}},
    "zero3": {**PRECISION_AUTO, "optimizer": ADAMW_AUTO, "scheduler": WARMUP, **AUTO_BATCH,
              "zero_optimization": {"stage": 3, **Z3_AUTO}},
    "zero3_bf16_offload": {"bf16": {"enabled": True}, "optimizer": ADAMW_AUTO, "scheduler": DECAY, **AUTO_BATCH,
                           "zero_optimization": {"stage": 3, "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD,
                                                 **Z3_AUTO}},
    "zero3_offload_fp16": {"fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
                           "optimizer": {"type": "Adam", "params": {"lr": "auto", "betas": "auto", "eps": "auto",
                                                                    "weight_decay": "auto", "torch_adam": False,
                                                                    "adam_w_mode": True}},
                           "scheduler": DECAY, **AUTO_BATCH,
                           "zero_optimization": {"stage": 3, "offload_optimizer": OFFLOAD, "offload_param": OFFLOAD,
                                                 "stage3_gather_fp16_weights_on_model_save": True, **{
                                                     k: v for k, v in Z3_AUTO.items()
                                                     if k != "stage3_gather_16bit_weights_on_model_save"}}},
}
SETS = ["train.max_steps=8", "schedule.warmup_steps=3", "optimizer.lr=0.002"]
BASE = [s for s in TINY if not s.startswith(("optimizer.", "schedule."))]  # the optimizer at its defaults


def write(tmp_path, name: str, config: dict) -> str:
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


@pytest.mark.parametrize("name", list(SHAPES))
def test_every_shape_plans_with_auto_filled_from_the_run(name, tmp_path):
    plan = make_plan(None, [*TINY, *SETS], write(tmp_path, name, SHAPES[name]), 1)
    ds, zero = plan.ds, plan.ds.config["zero_optimization"]
    assert ds.config["gradient_accumulation_steps"] == 1 and ds.config["gradient_clipping"] == 1.0
    assert "auto" not in json.dumps(ds.config)  # every "auto" filled, the model's width included (d_model 32)
    if "reduce_bucket_size" in SHAPES[name]["zero_optimization"]:
        assert zero["reduce_bucket_size"] == 32 * 32
    sched = ds.sections.scheduler
    assert sched["params"]["warmup_max_lr"] == 0.002 and sched["params"]["warmup_num_steps"] == 3
    if sched["type"] == "WarmupDecayLR":
        assert sched["params"]["total_num_steps"] == 8


def lrs_of(scheduler_cls, params: dict, steps: int, lr: float) -> list[float]:
    """The learning rate each optimizer step uses under DeepSpeed's class, on an optimizer of its own."""
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched, out = scheduler_cls(opt, **params), []
    for _ in range(steps):
        out.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    return out


@pytest.mark.parametrize("section", [
    {**DECAY, "params": {**DECAY["params"], "warmup_min_lr": 0}},  # an integer, as HF's examples write it
    {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": "auto",
                                          "cos_min_ratio": "auto", "warmup_type": "linear"}},
    {"type": "OneCycle", "params": {"cycle_min_lr": 0.0005, "cycle_max_lr": "auto", "cycle_first_step_size": 3,
                                    "cycle_momentum": False}},
], ids=lambda s: s["type"])
def test_deepspeed_schedulers_train_their_own_curve_step_by_step(section, tmp_path, corpus):
    from deepspeed.runtime import lr_schedules

    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": OFFLOAD} if section["type"] == DECAY["type"] else
          {"stage": 0},
          "optimizer": ADAMW_AUTO, "scheduler": section}
    run = harness(tmp_path / "run", corpus, ds=write(tmp_path, "ds", ds), sets=SETS)
    filled = {**section["params"]}
    for key, value in filled.items():
        if value == "auto":
            filled[key] = {"warmup_min_lr": 0.0, "warmup_max_lr": 0.002, "warmup_num_steps": 3, "total_num_steps": 8,
                           "cos_min_ratio": 0.1, "cycle_max_lr": 0.002}[key]
    expected = lrs_of(getattr(lr_schedules, section["type"]), filled, 8, 0.002)
    assert [m["lr"] for m in run.metrics] == pytest.approx(expected, rel=1e-9, abs=1e-12)
    assert all(type(m["lr"]) is float for m in run.metrics)  # (DeepSpeed's first steps had logged the integer 0)
    assert run.losses[8] < run.losses[1]


def test_a_deepspeed_scheduler_resumed_with_another_length_takes_its_lr_from_the_resumed_step(tmp_path, corpus):
    """WarmupDecayLR's state is its step alone: resumed at step 5 as a 6-step run, the lr of step 6 is the 6-step
    run's (before, step 6 took the 8-step run's lr from the optimizer's state), and the start says so."""
    ds = write(tmp_path, "ds", {"zero_optimization": {"stage": 0}, "optimizer": ADAMW_AUTO, "scheduler": DECAY})
    six = harness(tmp_path / "six", corpus, ds=ds, sets=[*SETS, "train.max_steps=6"])
    harness(tmp_path / "run", corpus, ds=ds, sets=[*SETS, "train.max_steps=8"], args=["--stop-at", "5"])
    resumed = harness(tmp_path / "run", corpus, ds=ds, sets=[*SETS, "train.max_steps=6"], args=["--resume", "auto"])
    lr = {m["step"]: m["lr"] for m in resumed.metrics}
    assert lr[6] == pytest.approx(six.metrics[5]["lr"], rel=1e-12)  # the 8-step run's is 0.0016
    assert f"the lr follows this run's schedule (its length and [schedule]) from step 6; lr there {lr[6]:.3g}" in \
        resumed.proc.stdout, resumed.proc.stdout[-2000:]


def test_a_resume_under_another_kind_of_scheduler_takes_it_from_the_resumed_step(tmp_path, corpus):
    """The run's [schedule] resumed under a DeepSpeed scheduler section, and back: a schedule's state is its step, so
    the new one takes its lr from there as a changed section does (each had failed to read the other's state, as a
    checkpoint "cut short, damaged or missing", pointing to an earlier one that failed alike)."""
    kinds = {"harness": write(tmp_path, "harness", {"zero_optimization": {"stage": 0}, "optimizer": ADAMW_AUTO}),
             "WarmupDecayLR": write(tmp_path, "decay", {"zero_optimization": {"stage": 0}, "optimizer": ADAMW_AUTO,
                                                         "scheduler": DECAY})}
    whole = {kind: harness(tmp_path / kind, corpus, ds=ds, sets=SETS) for kind, ds in kinds.items()}
    for first, then in (("harness", "WarmupDecayLR"), ("WarmupDecayLR", "harness")):
        stopped = harness(tmp_path / "run", corpus, ds=kinds[first], sets=SETS, args=["--stop-at", "5", "--overwrite"])
        if first != "harness":  # as a checkpoint saved before layout.json named its schedule: its run's ds_config.json
            layout = stopped.dir / "checkpoints" / "step_00000005" / "layout.json"
            layout.write_text(json.dumps({k: v for k, v in json.loads(layout.read_text()).items() if k != "schedule"}))
            (layout.parent / "checksums.json").unlink()
        resumed = harness(tmp_path / "run", corpus, ds=kinds[then], sets=SETS, args=["--resume", "auto"])
        lr, expected, before = ({m["step"]: m["lr"] for m in r.metrics} for r in (resumed, whole[then], whole[first]))
        assert [lr[s] for s in (6, 7, 8)] == pytest.approx([expected[s] for s in (6, 7, 8)], rel=1e-9, abs=1e-12)
        assert lr[5] != pytest.approx(expected[5])  # the first run's schedule up to the checkpoint
        assert f"the lr schedule is {then} from step 6 (the checkpoint's run had {first})" in resumed.proc.stdout, \
            resumed.proc.stdout[-2000:]
        assert f"from step 6; lr there {lr[6]:.3g} (the checkpoint's run: {before[6]:.3g})" in resumed.proc.stdout, \
            resumed.proc.stdout[-2000:]


def test_explicit_values_are_adopted_over_defaults_and_every_contradiction_is_one_line(tmp_path):
    ds = write(tmp_path, "ds", {"optimizer": {"type": "AdamW", "params": {"lr": 5e-4, "betas": [0.8, 0.99],
                                                                           "weight_decay": 0.01}},
                                "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 7}}})
    plan = make_plan(None, BASE, ds, 1)
    o = plan.run.cfg.optimizer
    assert (o.lr, o.beta1, o.beta2, o.weight_decay) == (5e-4, 0.8, 0.99, 0.01)
    assert plan.run.source["optimizer.lr"].startswith("optimizer.params.lr (ds file")
    with pytest.raises(ConfigError) as e:
        make_plan(None, [*BASE, "optimizer.lr=0.001", "optimizer.weight_decay=0.0", "schedule.warmup_steps=2"], ds, 1)
    line = str(e.value)
    assert "\n" not in line
    for mismatch in ("optimizer.params.lr = 0.0005 vs optimizer.lr = 0.001 (command line)",
                     "optimizer.params.weight_decay = 0.01 vs optimizer.weight_decay = 0.0 (command line)",
                     "scheduler.params.warmup_num_steps = 7 vs schedule.warmup_steps = 2 (command line)"):
        assert mismatch in line, line
    # what `harness plan --ds-json` and RUN/ds_config.json write reads back as the same run: under ZeRO-0 in fp32 the
    # loop clips, and the file says so (it had said 0, which the run's own clipping then contradicted)
    from harness.plan.render import ds_json

    zero0 = make_plan(None, BASE, str(ROOT / "configs" / "ds" / "zero0.json"), 1)
    written = json.loads(ds_json(zero0))
    assert zero0.ds.loop_clips == written["gradient_clipping"] == zero0.run.cfg.train.grad_clip > 0
    again = make_plan(None, BASE, write(tmp_path, "written", written), 1)
    assert again.ds.loop_clips == zero0.ds.loop_clips and again.ds.config == zero0.ds.config
    # a run sized by epochs learns its length when the engine is built: a total the file gives is checked then
    from harness.distributed.optim import make_schedule

    total = write(tmp_path, "total", {"scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 1000,
                                                                                        "warmup_num_steps": 1}}})
    by_epochs = make_plan(None, [*(s for s in BASE if "max_steps" not in s), "train.epochs=1.0"], total, 1)
    weights = [torch.nn.Parameter(torch.zeros(1))]
    with pytest.raises(ConfigError, match=r"total_num_steps = 1000 \(DeepSpeed file\) vs the run's 5 steps .*late"):
        make_schedule(torch.optim.AdamW(weights), by_epochs.run.cfg, 5, by_epochs.ds.sections)
    assert make_schedule(torch.optim.AdamW(weights), by_epochs.run.cfg, 1000, by_epochs.ds.sections) is not None
    # sections that ask for nothing (DeepSpeed's templates, all off) plan; the same ones switched on are refused
    off = {"activation_checkpointing": {"partition_activations": False, "cpu_checkpointing": False,
                                        "number_checkpoints": None}, "compile": {"deepcompile": False},
           "comms_logger": {"enabled": False, "verbose": True}, "checkpoint": {"writer": None},
           "wandb": {"enabled": False, "project": "p"}, "tensorboard": {"output_path": "tb"}, "csv_monitor": {}}
    assert make_plan(None, BASE, write(tmp_path, "off", off), 1).ds.config["compile"] == {"deepcompile": False}
    with pytest.raises(ConfigError, match=r"^compile \(ds file .*\) would be ignored: .* set train.compile = true"):
        make_plan(None, BASE, write(tmp_path, "on", {**off, "compile": {"deepcompile": True}}), 1)
    # DeepSpeed's monitors, enabled as its model reads the switch ("yes" is true): the harness's logging.backend
    for key, way in (("wandb", 'logging.backend = "wandb"'), ("tensorboard", 'logging.backend = "tensorboard"'),
                     ("csv_monitor", "RUN/metrics.jsonl"), ("comet", "logging.backend")):
        with pytest.raises(ConfigError, match=rf"^{key}.enabled \(ds file .*\): DeepSpeed's monitor .*; use {way}"):
            make_plan(None, BASE, write(tmp_path, key, {**off, key: {"enabled": "yes"}}), 1)
    # DeepSpeed's writer engines: a KeyError as the engine was built (CROSS_SIZE), or, decoupled, still writing when
    # the checkpoint is named complete and hashed; a section that is no object: one line, not an AttributeError
    for writer in ({"decoupled": True}, {"type": "fast"}):
        with pytest.raises(ConfigError, match=r"^checkpoint.writer \(ds file .*\): DeepSpeed's writer engines"):
            make_plan(None, BASE, write(tmp_path, "late", {**off, "checkpoint": {"writer": writer}}), 1)
    with pytest.raises(ConfigError, match=r"^checkpoint \(ds file .*\) must be an object"):
        make_plan(None, BASE, write(tmp_path, "list", {**off, "checkpoint": ["writer"]}), 1)


def test_adam_w_mode_and_torch_adam_build_what_deepspeed_would():
    from harness.config.ds_optim import Sections
    from harness.distributed.optim import build_optimizer

    cfg = resolve(None, ["train.max_steps=3"]).cfg
    model = torch.nn.Linear(4, 4)
    for switches, kind in (({"adam_w_mode": False}, torch.optim.Adam), ({"adam_w_mode": True}, torch.optim.AdamW),
                           ({"torch_adam": True}, torch.optim.AdamW)):
        optimizer, _ = build_optimizer(model, cfg, False, 3, Sections(switches=switches))
        assert type(optimizer) is kind
    assert optimizer.param_groups[0]["weight_decay"] == cfg.optimizer.weight_decay  # decay groups kept


def test_accelerate_settings_are_the_strategy_and_must_agree_with_a_ds_file(tmp_path):
    run = resolve(None, ["train.max_steps=3", "train.grad_accum_steps=2"])
    given = {"zero_stage": "3", "offload_optimizer_device": "cpu", "zero3_init_flag": "true"}
    ds = resolve_ds(run, None, 1, accel=given)
    assert (ds.zero_stage, ds.offload_optimizer, ds.offload_params) == (3, True, False)
    assert ds.origin == "accelerate config (zero_stage=3, offload_optimizer_device=cpu, zero3_init_flag=true)"
    assert resolve_ds(run, None, 1, accel={}).origin == "harness default"
    zero2 = str(ROOT / "configs" / "ds" / "zero2.json")
    with pytest.raises(ConfigError, match="zero_optimization.stage = 2 vs accelerate zero_stage = 3"):
        resolve_ds(run, zero2, 1, accel=given)
    with pytest.raises(ConfigError, match="accelerate gradient_accumulation_steps = 4 vs train.grad_accum_steps = 2"):
        resolve_ds(run, None, 1, accel={"zero_stage": "2", "gradient_accumulation_steps": "4"})
    adopted = make_plan(None, ["train.max_steps=3"], None, 1)  # no accelerate settings in this process: the default
    assert adopted.ds.origin == "harness default"


def test_an_accelerate_config_and_its_flags_train_what_the_ds_file_trains(tmp_path, corpus):
    """`accelerate config`'s DeepSpeed ZeRO-3 (no --ds): ZeRO-3, said in the start line, with the losses of --ds
    configs/ds/zero3.json; `--zero_stage 3` on the command line hands the ranks the same settings; an accelerate
    stage against a --ds file: exit 2 before any process starts."""
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text((LAUNCH / "cpu_2proc.yaml").read_text().replace(
        "deepspeed_multinode_launcher: standard", "deepspeed_multinode_launcher: standard\n  zero_stage: 3"))
    sets = ["train.micro_batch_size=2", "train.max_steps=4"]
    ref = harness(tmp_path / "ref", corpus, nproc=2, ds="zero3.json", sets=sets)

    def front(out, *accelerate, ds=None):
        cmd = command(out, corpus, nproc=2, ds=ds, sets=sets, front=True)
        i = cmd.index("launch") + 1
        cmd[i:i + 4] = ["--config_file", str(accelerate[0]), *accelerate[1:]]
        return subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)

    by_file = front(tmp_path / "file", yaml)
    assert by_file.returncode == 0, by_file.stderr[-2000:]
    assert "ZeRO-3 fp32 (strategy: accelerate config (zero_stage=3" in by_file.stdout
    losses = [json.loads(line)["loss"] for line in (tmp_path / "file" / "metrics.jsonl").read_text().splitlines()]
    assert losses == pytest.approx(list(ref.losses.values()), rel=1e-5)
    # the flags give each rank what the file gives it (accelerate's own code computes both): the same training
    from harness.launcher.settings import launch_settings

    def strategy(env):  # what each rank reads (config/accelerate.py); CONFIG_DS_FIELDS only lists the file's keys
        return {k: v for k, v in env.items() if k != "ACCELERATE_CONFIG_DS_FIELDS"}

    flags = launch_settings(["--config_file", str(LAUNCH / "cpu_2proc.yaml"), "--zero_stage", "3"])["env"]
    assert strategy(flags) == strategy(launch_settings(["--config_file", str(yaml)])["env"])
    assert flags["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    refused = front(tmp_path / "refused", yaml, ds="zero2.json")
    assert refused.returncode == 2 and "accelerate zero_stage = 3" in refused.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "refused").exists()


def test_deepspeed_builds_its_other_optimizers_where_it_can(tmp_path, corpus):
    """Adagrad (torch's, built by DeepSpeed from the section) trains with the run's parameter groups and schedule;
    what DeepSpeed cannot build or train here is refused in one line before launch."""
    adagrad = {"type": "Adagrad", "params": {"lr": "auto", "weight_decay": "auto", "eps": "auto"}}
    run = harness(tmp_path / "run", corpus, ds=write(tmp_path, "ada", {"optimizer": adagrad}), sets=SETS)
    written = json.loads((run.dir / "ds_config.json").read_text())  # the run directory's resolved config, in full
    assert written["optimizer"] == {"type": "Adagrad", "params": {"lr": 0.002, "weight_decay": 0.1, "eps": 1e-8}}
    assert run.metrics[0]["lr"] == pytest.approx(0.002 / 3)  # the run's lr, through the run's warmup
    assert run.losses[8] < run.losses[1]
    # a kernel this machine cannot build: the plan notes it (it may be for other machines), a run here is refused
    lamb = write(tmp_path, "lamb", {"optimizer": {"type": "Lamb"}, "zero_optimization": {"stage": 0}})
    assert "# note: DeepSpeed cannot train it on this machine: its kernel (FusedLambBuilder) has no build for the " \
           "cpu accelerator" in plan_text(make_plan(None, BASE, lamb, 1))
    refused = harness(tmp_path / "lamb", corpus, ds=lamb, sets=SETS, check=False)
    assert refused.proc.returncode == 2 and refused.proc.stderr.strip().splitlines()[-1] == (
        f"harness: error: optimizer.type = 'Lamb' (ds file {lamb}): DeepSpeed cannot train it here: its kernel "
        f"(FusedLambBuilder) has no build for the cpu accelerator (the fused ones need a GPU)")
    assert not (tmp_path / "lamb").exists()
    for optimizer, zero, message in (
            (adagrad, {"stage": 2}, "torch's Adagrad under ZeRO-2 fails inside DeepSpeed"),
            ({"type": "Rprop", "params": {"weight_decay": 0.1}}, {"stage": 0}, "not a parameter of torch.optim.Rprop"),
            ({"type": "Muon"}, {"stage": 0}, "one of DeepSpeed's optimizers the harness does not build")):
        with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
            make_plan(None, BASE, write(tmp_path, "o", {"optimizer": optimizer, "zero_optimization": zero}), 1)


def test_config_wins_deepspeed_takes_the_file_s_values_over_the_user_s(tmp_path):
    ds = write(tmp_path, "ds", {"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}})
    with pytest.raises(ConfigError, match="run.config_wins"):
        make_plan(None, [*BASE, "optimizer.lr=0.001"], ds, 1)
    plan = make_plan(None, [*BASE, "optimizer.lr=0.001", 'run.config_wins="deepspeed"'], ds, 1)
    assert plan.run.cfg.optimizer.lr == 5e-4
    assert plan.ds.sections.notes() == ['run keys the DeepSpeed settings override (run.config_wins = "deepspeed"): '
                                        'optimizer.lr = 0.001 (command line) -> optimizer.params.lr = 0.0005']
    warmup = write(tmp_path, "warmup", {"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": "auto"}}})
    plan = make_plan(None, [*BASE, "schedule.warmup_steps=50", "--unset schedule.kind"], warmup, 1)
    assert plan.ds.sections.unused == ["schedule.warmup_steps = 50 (command line)"]  # DeepSpeed's default: 1000


MAIN_JOB = str(ROOT / "configs" / "runs" / "lm_demo.toml")
HF_FILES = ("zero1", "zero2_offload", "zero3", "zero3_bf16_offload")  # the four HF Trainer and accelerate ship


@pytest.mark.parametrize("name", HF_FILES)
def test_the_main_job_s_run_file_takes_a_hf_deepspeed_file_s_scheduler_where_the_user_says(name, tmp_path):
    """The main job's run file names the harness's cosine schedule: with an HF DeepSpeed file (AdamW and a WarmupLR
    or WarmupDecayLR section) it is refused naming both ways out; `run.config_wins = "deepspeed"` (or `--unset
    schedule.kind`) trains a few steps under the file's scheduler, the plan and the start line naming the run keys it
    overrides and those its scheduler does not read."""
    ds = write(tmp_path, name, SHAPES[name])
    with pytest.raises(ConfigError) as e:
        make_plan(MAIN_JOB, [], ds, 1)
    assert "--unset schedule.kind" in str(e.value) and 'run.config_wins = "deepspeed"' in str(e.value)
    unset = make_plan(MAIN_JOB, ["--unset schedule.kind"], ds, 1)
    assert unset.run.source["schedule.kind"] == "default" and not unset.ds.sections.overridden
    for bad, message in (("--unset schedule", "--unset expects section.key, got 'schedule'"),
                         ("--unset schedule.knd", "did you mean `schedule.kind`")):
        with pytest.raises(ConfigError, match=message):
            make_plan(MAIN_JOB, [bad], ds, 1)
    out = tmp_path / "run"
    sets = ['run.config_wins="deepspeed"', "train.max_steps=2", "train.log_every=1", "train.eval_every=0",
            "train.save_every=0", 'logging.backend="none"', "logging.plots=false",
            f"run.output_dir={json.dumps(str(out))}"]
    done = cli("train", "--run", MAIN_JOB, "--ds", ds, *[a for s in sets for a in ("--set", s)])
    assert done.returncode == 0, done.stderr[-3000:]
    said = done.stdout + done.stderr
    kind = SHAPES[name]["scheduler"]["type"]
    assert f"run keys the DeepSpeed settings override (run.config_wins = \"deepspeed\"): schedule.kind = 'cosine' " \
           f"(run file {MAIN_JOB}) -> DeepSpeed's {kind}" in said, said[-3000:]
    assert f"run keys the DeepSpeed scheduler does not use: schedule.min_lr_ratio = 0.1 (run file {MAIN_JOB})" in said
    plan = cli("plan", "--run", MAIN_JOB, "--ds", ds, "--set", 'run.config_wins="deepspeed"')
    assert plan.returncode == 0 and "# run keys the DeepSpeed scheduler does not use" in plan.stdout, plan.stderr
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [1, 2]


def test_the_zero_values_accelerate_fills_are_filled_as_it_fills_them():
    """"auto" for the stage, the offload devices and the 16-bit save, as accelerate 1.15 fills them: from its
    settings for the launch, else its defaults (stage 2, no offload, no 16-bit gather)."""
    import tempfile

    run = resolve(None, ["train.max_steps=2"])
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump({"zero_optimization": {"stage": "auto", "stage3_gather_16bit_weights_on_model_save": "auto",
                                         "offload_optimizer": {"device": "auto"}, "offload_param": None}}, f)
        f.flush()
        ds = resolve_ds(run, f.name, 1, accel={})
        zero = ds.config["zero_optimization"]
        assert (ds.zero_stage, zero["stage3_gather_16bit_weights_on_model_save"], ds.offload_optimizer) == \
            (2, False, False)
        assert ds.source["zero_optimization.stage"] == \
            "auto <- accelerate's default zero_stage = 2 (as accelerate fills it)"
        ds = resolve_ds(run, f.name, 1, accel={"zero_stage": "3", "offload_optimizer_device": "cpu",
                                               "zero3_save_16bit_model": "true"})
        zero = ds.config["zero_optimization"]
        assert (ds.zero_stage, zero["stage3_gather_16bit_weights_on_model_save"], ds.offload_optimizer) == \
            (3, True, True)


def test_a_resume_says_only_the_optimizer_settings_that_differ_once_the_schedule_has_set_its_own():
    """DeepSpeed's OneCycle cycles the momentum (Adam's beta1) by the step: the value a checkpoint holds is not the one
    the optimizer is built with, and a resume that changed nothing had said "betas (0.85, 0.99) (the checkpoint's run
    had (0.9, 0.99))"; a weight decay changed is said."""
    import torch
    from deepspeed.runtime.lr_schedules import OneCycle

    from harness.distributed.optim import follow_config_settings, group_settings, settings_changed

    weight = torch.nn.Parameter(torch.zeros(4))

    def build(decay: float):
        opt = torch.optim.AdamW([weight], lr=1e-3, betas=(0.9, 0.99), weight_decay=decay)
        return opt, OneCycle(opt, cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step_size=3, cycle_momentum=True,
                             cycle_min_mom=0.85, cycle_max_mom=0.95)

    opt, schedule = build(0.1)
    for _ in range(2):
        weight.grad = torch.ones(4)
        opt.step()
        schedule.step()
    state, step = opt.state_dict(), schedule.last_batch_iteration
    for decay, said in ((0.1, []), (0.0, ["weight_decay 0 (the checkpoint's run had 0.1)"])):
        opt, schedule = build(decay)
        built = group_settings(opt)
        opt.load_state_dict(state)
        saved = follow_config_settings(opt, built)
        assert opt.param_groups[0]["weight_decay"] == decay  # the run's, whatever the checkpoint held
        schedule.step(step)  # as follow_config_lr does: the momentum of that step
        assert settings_changed(opt, saved) == said
