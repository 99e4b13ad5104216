"""Multi-node for real: two `accelerate launch` invocations on this machine, as machine rank 0 and 1 of 2, with
launch/multi_node.yaml (DeepSpeed "standard" launcher, static rendezvous on 127.0.0.1)."""
from __future__ import annotations

import json
import shutil
import socket
import subprocess

from conftest import DS, LAUNCH, ROOT, TINY, Run, _env, assert_losses_close, python


def test_two_nodes_match_two_processes_on_one_node(tmp_path, corpus, cached_run):
    """Node 1 reads a copy of the data, and of a plug-in task's file, at other paths (staged on its own disk): the
    nodes' settings are compared with paths aside (a task by its file's name and class), the data by its content."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    (tmp_path / "node1").mkdir()
    staged = {0: corpus, 1: shutil.copy(corpus, tmp_path / "node1" / corpus.name)}
    for node in ("node0", "node1"):
        (tmp_path / node).mkdir(exist_ok=True)
        (tmp_path / node / "own_lm.py").write_text("from harness.tasks.lm import LanguageModelTask\n\n\n"
                                                   "class OwnLM(LanguageModelTask):\n    pass\n")
    train = ["-m", "harness", "train", "--ds", str(DS / "zero2.json")]
    for item in [*TINY, "train.micro_batch_size=2", f"run.output_dir={json.dumps(str(out))}"]:
        train += ["--set", item]
    procs = []
    for machine_rank in (1, 0):
        cmd = [python(), "-m", "accelerate.commands.launch", "--config_file", str(LAUNCH / "multi_node.yaml"),
               "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1", "--main_process_port",
               str(port), "--num_machines", "2", "--num_processes", "2", *train, "--set",
               f"data.path={json.dumps(str(staged[machine_rank]))}", "--set",
               f"run.task={json.dumps(str(tmp_path / f'node{machine_rank}' / 'own_lm.py') + ':OwnLM')}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-4000:]
    node0_stdout = results[1][0]
    assert "world 2 (data parallel 2)" in node0_stdout
    two_nodes = Run(out, subprocess.CompletedProcess([], 0))
    one_node = cached_run("zero2-2p", nproc=2, ds="zero2.json", sets=["train.micro_batch_size=2"])
    assert_losses_close(two_nodes.losses, one_node.losses, 1e-6)


def test_deepspeed_s_nossh_launcher_runs_two_nodes_from_the_hostfile(tmp_path, corpus, cached_run):
    """DeepSpeed's nossh launcher, each node started by `harness launch` on its own with its node rank: the world
    comes from the hostfile (two names of this machine), and each rank is given --local_rank=N (which `harness`
    refused, so this launcher never ran)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("127.0.0.1 slots=1\nlocalhost slots=1\n")
    out = tmp_path / "run"
    train = ["train", "--ds", str(DS / "zero2.json")]
    for item in [*TINY, "train.micro_batch_size=2", f"data.path={json.dumps(str(corpus))}",
                 f"run.output_dir={json.dumps(str(out))}"]:
        train += ["--set", item]
    procs = [subprocess.Popen([python(), "-m", "harness", "launch", "--config_file",
                               str(LAUNCH / "deepspeed_hostfile.yaml"), "--deepspeed_multinode_launcher", "nossh",
                               "--deepspeed_hostfile", str(hostfile), "--machine_rank", str(machine_rank),
                               "--main_process_ip", "127.0.0.1", "--main_process_port", str(port), "--num_processes",
                               "2", *train], cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for machine_rank in (1, 0)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-4000:]
    assert "world 2 (data parallel 2)" in results[1][0]
    one_node = cached_run("zero2-2p", nproc=2, ds="zero2.json", sets=["train.micro_batch_size=2"])
    assert_losses_close(Run(out, subprocess.CompletedProcess([], 0)).losses, one_node.losses, 1e-6)


def test_nodes_started_with_other_settings_are_refused_before_training(tmp_path, corpus):
    """A node given another --set or --ds had trained its share of the weights at another lr, said nowhere, or hung
    before step 1 (ZeRO-2 against ZeRO-3; sequence-parallel groups made by one node alone) until the collective
    timeout. Every node exits 2 naming what differs, before any subgroup is made."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "run"
    train = ["train"]
    for item in [*TINY, "train.micro_batch_size=2", f"data.path={json.dumps(str(corpus))}",
                 f"run.output_dir={json.dumps(str(out))}"]:
        train += ["--set", item]
    own = {1: ["--ds", str(DS / "sp2_zero3.json"), "--set", "optimizer.lr=0.01", "--set", 'run.name="exp/1"'],
           0: ["--ds", str(DS / "zero2.json"), "--set", 'run.name="exp1"']}  # (a "/" that is not a path: compared)
    procs = [subprocess.Popen([python(), "-m", "harness", "launch", "--config_file", str(LAUNCH / "multi_node.yaml"),
                               "--machine_rank", str(machine_rank), "--main_process_ip", "127.0.0.1",
                               "--main_process_port", str(port), "--num_machines", "2", "--num_processes", "2",
                               *train, *own[machine_rank]], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for machine_rank in (1, 0)]
    results = [p.communicate(timeout=300) for p in procs]
    for p, (stdout, stderr) in zip(procs, results):
        assert p.returncode == 2, stderr[-4000:]
        assert f"harness: error: rank 1 (on {socket.gethostname()}) resolved another run than rank 0: ZeRO stage = 3 " \
               "there, 2 on rank 0; run.name = 'exp/1' there, 'exp1' on rank 0; optimizer.lr = 0.01 there, 0.003 on " \
               "rank 0; ..." in stderr, stderr[-4000:]
    assert not (out / "metrics.jsonl").exists()
