"""Bad input in accelerate's options and config file, for `harness launch` and `harness plan`: refused in this
process before anything starts, in one line (exit 2) that names the option or the key and the file."""
from __future__ import annotations

import os
import socket

import pytest
from conftest import DS, LAUNCH, ROOT

from harness.cli import main
from harness.config.run import ConfigError
from harness.launcher.command import main as launcher_main
from harness.launcher.settings import launch_settings

RUN = str(ROOT / "configs" / "runs" / "lm_demo.toml")
CPU = (LAUNCH / "cpu_2proc.yaml").read_text()
DS_SECTION = "deepspeed_config:\n  deepspeed_multinode_launcher: standard\n"

# (id, the accelerate config's text, what the error line says; {file} is the file's path)
FILES = [
    ("empty", "", "accelerate config {file} is empty"),
    ("a-list", "- num_processes\n- 2\n", "accelerate config {file} holds a list"),
    ("unclosed-list", "num_processes: [2\n", "{file} is not YAML: expected ',' or ']', but got '<stream end>'"),
    ("colons", "  : :\n", "{file} is not YAML: expected <block end>, but found ':' at line 1, column 3"),
    ("unknown-key", CPU.replace("num_machines:", "num_machins:"),
     "{file}: unknown key num_machins (did you mean num_machines?)"),
    ("distributed-type", CPU.replace("DEEPSPEED", "DEEPSPEEED"),
     "distributed_type in {file} = 'DEEPSPEEED' is not one of accelerate's; did you mean DEEPSPEED?"),
    ("mixed-precision", CPU + "mixed_precision: fp8x\n", "mixed_precision in {file} = 'fp8x': the harness runs"),
    ("bare-no", CPU + "mixed_precision: no\n", "mixed_precision in {file} = False: must be text: put it in quotes"),
    ("port", CPU.replace("main_process_port: 0 ", "main_process_port: abc "),
     "main_process_port in {file} = 'abc': must be a whole number"),
    ("deepspeed-config", CPU.replace(DS_SECTION, "deepspeed_config: 5\n"),
     "deepspeed_config in {file} = 5: must be a section of key: value lines"),
]


@pytest.mark.parametrize("command", ["plan", "launch"])
@pytest.mark.parametrize("text,said", [f[1:] for f in FILES], ids=[f[0] for f in FILES])
def test_a_bad_accelerate_config_file_is_one_line_naming_it(command, text, said, tmp_path, capsys):
    file = tmp_path / "accelerate.yaml"
    file.write_text(text)
    argv = ["plan", "--config_file", str(file), "--run", RUN] if command == "plan" else \
        ["launch", "--config_file", str(file), "train", "--run", RUN, "--ds", str(DS / "zero2.json"), "--set",
         "train.max_steps=3"]
    assert main(argv) == 2
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.count("\n") == 1, captured.err
    assert captured.err.startswith(f"harness: error: harness {command}: ") and said.format(file=file) in captured.err


def test_a_directory_for_a_config_file_is_named_a_directory(tmp_path):
    with pytest.raises(ConfigError, match=f"--config_file {tmp_path} is a directory"):
        launch_settings(["--config_file", str(tmp_path)])


def test_fp8_on_the_command_line_is_one_line_naming_the_option(capsys):
    """accelerate itself fails with a traceback where no FP8 library is installed; DeepSpeed here takes no fp8."""
    assert main(["launch", "--config_file", str(LAUNCH / "cpu_2proc.yaml"), "--mixed_precision", "fp8", "train",
                 "--run", RUN]) == 2
    assert capsys.readouterr().err == (
        "harness: error: harness launch: --mixed_precision = 'fp8': the harness runs DeepSpeed in no, fp16 or bf16; "
        "use no and choose the precision in the DeepSpeed file\n")


def test_a_misspelled_deepspeed_setting_is_refused_naming_the_key_meant(tmp_path):
    """accelerate copies any key under deepspeed_config onto its launch arguments and nothing reads a misspelled
    one: `zero_stge: 3` trained as ZeRO-0."""
    file = tmp_path / "accelerate.yaml"
    file.write_text(CPU.replace(DS_SECTION, DS_SECTION + "  zero_stge: 3\n  banana: yes\n"))
    with pytest.raises(ConfigError, match=rf"deepspeed_config in {file}: unknown keys zero_stge \(did you mean "
                                          r"zero_stage\?\), banana; accelerate reads deepspeed_config_file, "):
        launch_settings(["--config_file", str(file)])


def test_the_keys_accepted_under_deepspeed_and_parallelism_config_are_the_installed_accelerates():
    """The sets are written out for the accelerate checked (1.15); another version's options show here first."""
    from accelerate.commands.launch import launch_command_parser

    from harness.config.accelerate import DEEPSPEED_KEYS, PARALLELISM_KEYS

    groups = {g.title: {a.dest for a in g._group_actions} for g in launch_command_parser()._action_groups}
    assert groups["DeepSpeed Arguments"] == DEEPSPEED_KEYS
    assert groups["ParallelismConfig Arguments"] == PARALLELISM_KEYS


# (id, the accelerate config's text in place of cpu_2proc.yaml's lines, options, what the error says)
MACHINES = [
    ("two-machines-no-address", {}, ["--num_machines", "2"],
     "--num_machines = 2 needs --main_process_ip (or main_process_ip in the config file)"),
    ("two-machines-no-address-in-the-file", {"num_machines: 1": "num_machines: 2"}, [],
     "num_machines in {file} = 2 needs --main_process_ip"),
    ("processes-not-a-multiple", {}, ["--num_machines", "2", "--num_processes", "3", "--main_process_ip", "127.0.0.1"],
     ("--num_processes = 3 is not a multiple of --num_machines = 2: it is the total over all machines, and accelerate "
      "would start 1 on each")),
    ("rank-past-the-machines", {}, ["--num_machines", "2", "--main_process_ip", "127.0.0.1", "--machine_rank", "5"],
     "--machine_rank = 5 with --num_machines = 2: must be 0 to 1"),
    ("rank-of-one-machine", {"machine_rank: 0": "machine_rank: 3"}, [],
     "machine_rank in {file} = 3 with num_machines in {file} = 1: must be 0"),
    ("port-picked-on-each-machine", {}, ["--num_machines", "2", "--main_process_ip", "127.0.0.1"],
     "main_process_port in {file} = 0 (a free port picked on each machine) with 2 machines"),
    ("port-out-of-range", {"main_process_port: 0 ": "main_process_port: 70000 "}, [],
     "main_process_port in {file} = 70000: a port is 0 to 65535"),
    ("address-no-machine-answers", {}, ["--num_machines", "2", "--main_process_ip", "no-such-host.invalid",
                                        "--main_process_port", "29500", "--machine_rank", "1"],
     "--main_process_ip = 'no-such-host.invalid': no such host from this machine"),
]


@pytest.mark.parametrize("edits,options,said", [m[1:] for m in MACHINES], ids=[m[0] for m in MACHINES])
def test_machines_that_cannot_start_as_planned_are_refused(edits, options, said, tmp_path):
    """Without main_process_ip torchrun waits for ever at a rendezvous on host None; accelerate starts
    num_processes // num_machines processes on each machine; machine_rank counts from 0."""
    file = tmp_path / "accelerate.yaml"
    text = CPU
    for old, new in edits.items():
        text = text.replace(old, new)
    file.write_text(text)
    with pytest.raises(ConfigError) as refused:
        launch_settings(["--config_file", str(file), *options])
    assert said.format(file=file) in str(refused.value)


def test_the_shipped_multi_node_launches_are_still_accepted(tmp_path):
    """launch/slurm.sbatch's options on node 1, and DeepSpeed's pdsh launcher, which finds its hosts in the
    hostfile (no main_process_ip)."""
    slurm = launch_settings(["--config_file", str(LAUNCH / "multi_node.yaml"), "--rdzv_backend", "c10d",
                             "--machine_rank", "1", "--main_process_ip", "127.0.0.1", "--main_process_port", "29511",
                             "--num_machines", "2", "--num_processes", "4"])
    assert (slurm["num_processes"], slurm["machine_rank"]) == (4, 1)
    hosts = tmp_path / "hostfile"
    hosts.write_text("# the shipped example's hosts\nnode-001 slots=8\n\nnode-002 slots=8\n")
    hostfile = ["--config_file", str(LAUNCH / "deepspeed_hostfile.yaml"), "--deepspeed_hostfile", str(hosts)]
    assert launch_settings(hostfile, "harness plan")["num_processes"] == 16
    # pdsh starts every host from here with the one port accelerate picks: 0 is fine (each node's own launch, not)
    assert launch_settings([*hostfile, "--main_process_port", "0"], "harness plan")["num_processes"] == 16
    # harness launch cannot watch ranks that pdsh starts on other hosts: the command that can is named
    nossh = [*hostfile, "--deepspeed_multinode_launcher", "nossh", "--main_process_ip", "127.0.0.1"]
    assert launch_settings(nossh)["runner"] is False  # each node starts its own: harness launch's
    with pytest.raises(ConfigError, match=r"deepspeed_multinode_launcher = pdsh starts .* rm -f \.deepspeed_env; "
                                          r"accelerate launch --config_file \S+deepspeed_hostfile\.yaml "
                                          r"--deepspeed_hostfile \S+ -m harness train --run R\.toml$"):
        launcher_main([*hostfile, "train", "--run", "R.toml"], None)
    # the same refusal where the hostfile is missing too (it said to write one, then refused the launch anyway)
    missing = ["--config_file", str(LAUNCH / "deepspeed_hostfile.yaml"), "--deepspeed_hostfile", str(tmp_path / "no")]
    with pytest.raises(ConfigError, match=r"deepspeed_multinode_launcher = pdsh starts "):
        launcher_main([*missing, "train", "--run", "R.toml"], None)
    with pytest.raises(ConfigError, match=r"cannot read it \(No such file or directory\)"):  # harness plan: checked
        launch_settings(missing, "harness plan")


@pytest.mark.parametrize("text,options,said", [
    (None, [], "deepspeed_hostfile in {yaml} = {file}: cannot read it (No such file or directory); DeepSpeed would "
               "train on this machine alone"),
    ("node-001 slots=8\nnode-002 slot=8\n", [], "line 'node-002 slot=8' is not HOST slots=N"),
    ("node-001 slots=8\nnode-001 slots=8\n", [], "line 'node-001 slots=8' is a second line for its host"),
    ("a slots=8\nb slots=8\nc slots=8\n", [], "lists 3 host(s), num_machines in {yaml} = 2: DeepSpeed starts ranks "
                                              "on every host it lists"),
    ("a slots=8\nb slots=4\n", [], "gives b slots=4, fewer than the 8 processes each machine starts"),
    ("a slots=8\nb slots=8\n", ["--deepspeed_multinode_launcher", "nossh"], "needs --main_process_ip"),
])
def test_a_hostfile_deepspeed_would_read_otherwise_is_refused(text, options, said, tmp_path):
    """DeepSpeed's launchers take the world from the hostfile: without one they trained on this machine alone (exit
    0, a world of 1), with another host count on every host it lists; a bad line failed inside DeepSpeed."""
    yaml = tmp_path / "accelerate.yaml"
    yaml.write_text((LAUNCH / "deepspeed_hostfile.yaml").read_text().replace("launch/hostfile", str(tmp_path / "h")))
    if text is not None:
        (tmp_path / "h").write_text(text)
    with pytest.raises(ConfigError) as refused:
        launch_settings(["--config_file", str(yaml), *options], "harness plan")
    assert said.format(yaml=yaml, file=tmp_path / "h") in str(refused.value)


def test_a_runs_lock_is_judged_on_the_first_node_alone(tmp_path, monkeypatch):
    """A lock renewed a minute ago by a pid on another host: alive by its age there, while its own host can tell by
    the pid that it is gone. Another node refusing alone would leave the first waiting at the rendezvous."""
    import json
    import os
    import time

    from harness.plan.resolve import make_plan
    from harness.run.startup import preflight

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    lock = run_dir / ".lock"
    lock.write_text(json.dumps({"host": "another-node", "pid": 999999, "since": "earlier"}))
    os.utime(lock, (time.time() - 60, time.time() - 60))
    plan = make_plan(None, [f"run.output_dir={json.dumps(str(run_dir))}", "train.max_steps=1"], None, 2)
    with pytest.raises(ConfigError, match=r"is in use by another run \(pid 999999 on another-node, .* renewed 6\d s ago"):
        preflight(plan, "auto", False)
    assert preflight(plan, "auto", False, machine_rank=1) is None  # node 1's harness launch
    monkeypatch.setenv("WORLD_SIZE", "4")  # launched ranks, rank 0's included: left to its taking of the lock,
    for rank in ("3", "0"):                # which refuses on every rank together
        monkeypatch.setenv("RANK", rank)
        assert preflight(plan, "auto", False) is None


def test_a_machine_with_fewer_gpus_than_its_processes_is_refused_before_launch(monkeypatch):
    """SLURM's --gpus-per-task=1 with 8 ranks a node, 16 processes over 2 machines of 4 GPUs: the ranks past the last
    GPU would end in CUDA's "invalid device ordinal"."""
    from harness.launcher.command import check_gpus_per_process
    from harness.run import machine

    monkeypatch.setattr(machine, "device_memory_bytes", lambda: [80 * 2**30] * 4)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    node = ["--config_file", str(LAUNCH / "multi_node.yaml"), "--machine_rank", "1", "--main_process_ip", "127.0.0.1",
            "--num_machines", "2"]
    with pytest.raises(ConfigError, match=r"^harness launch: 8 processes on this machine and 4 GPUs for them "
                                          r"\(nvidia-smi\): each process needs a GPU of its own; start 4 per machine"):
        check_gpus_per_process(launch_settings([*node, "--num_processes", "16"]))
    check_gpus_per_process(launch_settings([*node, "--num_processes", "8"]))
    with pytest.raises(ConfigError, match=r"4 processes on this machine and 2 GPUs for them \(gpu_ids = 0,1\)"):
        check_gpus_per_process(launch_settings([*node, "--num_processes", "8", "--gpu_ids", "0,1"]))
    with pytest.raises(ConfigError, match=r"gpu_ids = 0,0 names a GPU twice"):
        check_gpus_per_process(launch_settings([*node, "--num_processes", "4", "--gpu_ids", "0,0"]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4,5,6,7")  # 8 listed, 4 of them there (nvidia-smi's count)
    with pytest.raises(ConfigError, match=r"8 processes on this machine and 4 GPUs for them \(CUDA_VISIBLE_DEVICES"):
        check_gpus_per_process(launch_settings([*node, "--num_processes", "16"]))
    monkeypatch.setattr(machine, "device_memory_bytes", lambda: [])  # no GPU: CPU processes, as many as asked
    check_gpus_per_process(launch_settings([*node, "--num_processes", "16"]))


def test_a_taken_port_on_machine_rank_0_is_one_line():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ConfigError, match=f"refuses its settings: Tried to launch .* on port `{port}`"):
            launch_settings(["--config_file", str(LAUNCH / "multi_node.yaml"), "--machine_rank", "0",
                             "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_machines", "2",
                             "--num_processes", "2"])


def test_the_sequence_parallel_form_the_harness_names_plans(tmp_path, capsys):
    """accelerate 1.15 refuses --use_parallelism_config without FSDP2: the form the cp_size refusal names (the config
    file's parallelism_config) is the one that plans a sequence split."""
    from harness.config.accelerate import SP_FORM, sequence_parallel

    with pytest.raises(ConfigError) as refused:
        sequence_parallel({"cp_size": "2"})
    assert SP_FORM in str(refused.value)
    file = tmp_path / "accelerate.yaml"
    file.write_text(CPU + SP_FORM.split(" in ")[0].replace("N", "2") + "\n")
    assert main(["plan", "--config_file", str(file), "--run", RUN]) == 0
    assert "layout: data 1 x sequence 2 x tensor 1 x pipeline 1 = world 2" in capsys.readouterr().out


@pytest.mark.parametrize("section,options,said", [
    ("", ["--use_parallelism_config", "--parallelism_config_sp_size", "2"],
     "You cannot use `--use_parallelism_config` without `--use_fsdp`"),
    ("", ["--parallelism_config_sp_size", "2"], "--parallelism_config_sp_size would be ignored"),
    ("parallelism_config: {parallelism_config_sp_size: 2}\n", ["--use_deepspeed"],
     "parallelism_config in {file} would be ignored"),
    ("parallelism_config: {sp_size: 2}\n", [], "unknown key sp_size (did you mean parallelism_config_sp_size?)"),
], ids=["flags", "size-flag-alone", "beside-use-deepspeed", "short-key"])
def test_sequence_parallel_forms_accelerate_refuses_or_ignores_are_one_line(section, options, said, tmp_path):
    """The first three name the form that works (the last, the key meant)."""
    from harness.config.accelerate import SP_FORM

    file = tmp_path / "accelerate.yaml"
    file.write_text(CPU + section)
    with pytest.raises(ConfigError) as refused:
        launch_settings(["--config_file", str(file), *options])
    assert said.format(file=file) in str(refused.value)
    assert (SP_FORM in str(refused.value)) == ("{sp_size:" not in section)


def test_train_is_split_off_where_it_is_no_option_s_value():
    """`--role train` is torchrun's role name, not the start of harness train's arguments (split there, accelerate
    refused `--role` without its value)."""
    from harness.launcher.settings import split_argv

    assert split_argv(["--config_file", "x.yaml", "--role", "train", "--use_deepspeed", "train", "--run", "R"]) == (
        ["--config_file", "x.yaml", "--role", "train", "--use_deepspeed"], ["train", "--run", "R"])
    with pytest.raises(ConfigError, match="name what to run after accelerate's options"):
        split_argv(["--role", "train"])


def test_a_lock_names_its_process_and_overwrite_clears_only_a_directory_it_holds(tmp_path):
    """A pid is its holder only while the process that took the lock has it (a restarted container gives pids out
    again); `--overwrite` deletes a run directory only once it holds its lock (it deleted first, and a run started
    meanwhile trained on beside it, its lock and records gone)."""
    import json
    import subprocess

    import torch

    from harness.distributed.world import World
    from harness.plan.resolve import make_plan
    from harness.run.heartbeat import started
    from harness.run.lock import LOCK, alive, holder
    from harness.run.directory import prepare_run_dir

    other = subprocess.Popen(["sleep", "60"])
    try:
        run_dir = tmp_path / "run"
        run_dir.mkdir()
        (run_dir / "metrics.jsonl").write_text("{}\n")
        me = {"host": socket.gethostname(), "pid": other.pid, "since": "earlier"}
        for since, live in ((started(other.pid), True), (started(other.pid) + 1, False), (None, True)):
            (run_dir / LOCK).write_text(json.dumps({**me, "started": since}))
            assert alive(holder(run_dir)) is live, since
        (run_dir / LOCK).write_text(json.dumps({**me, "started": started(other.pid)}))
        plan = make_plan(None, [f"run.output_dir={json.dumps(str(run_dir))}", "train.max_steps=1"], None, 1)
        world = World(rank=0, world_size=1, local_rank=0, dp_rank=0, dp_size=1, device=torch.device("cpu"))
        with pytest.raises(ConfigError, match=rf"is in use by another run \(pid {other.pid} on "):
            prepare_run_dir(plan, world, None, overwrite=True)
        assert (run_dir / "metrics.jsonl").exists()
        other.kill()
        other.wait()
        held = prepare_run_dir(plan, world, None, overwrite=True)  # the holder is gone: taken over, then cleared
        try:
            assert not (run_dir / "metrics.jsonl").exists() and holder(run_dir)["pid"] == os.getpid()
            assert (run_dir / "config.toml").exists()
        finally:
            held.release()
    finally:
        other.kill()


def test_several_processes_where_accelerate_would_start_one_are_refused_by_launch_not_plan(capsys):
    """accelerate launch picks a launcher of several processes by itself only for 2 GPUs or more: `--num_processes 2`
    alone (or with --cpu) trained one process here while `harness plan` planned two."""
    import torch

    if torch.cuda.device_count() > 1:
        pytest.skip("accelerate launches several processes on 2 GPUs or more")
    train = ["train", "--run", RUN, "--set", "train.max_steps=1"]
    for options, why in ((["--num_processes", "2"], "no launch type is set (--use_deepspeed, --multi_gpu, ...)"),
                         (["--cpu", "--num_processes", "2"], "--cpu sends it to its one-process")):
        assert main(["launch", *options, *train]) == 2
        err = capsys.readouterr().err
        assert err.startswith("harness: error: harness launch: --num_processes = 2, but accelerate launch would start "
                              f"one process: {why}") and "add --use_deepspeed" in err, err
    assert main(["plan", "--num_processes", "2", "--run", RUN]) == 0  # a plan may be for GPUs elsewhere
    assert "world size 2" in capsys.readouterr().out
