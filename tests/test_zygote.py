"""The tests' fork server (tests/zygote.py) and its client (tests/warm_python): a warm process behaves as a cold one
where the tests look (exit codes, signals, tracebacks, measured figures), dies with its client, leaves nothing behind
after Ctrl-C, and the server refuses to start where fork is unsafe."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import ROOT, TINY, WARM_PYTHON, Zygote, _env, cli

pytestmark = pytest.mark.skipif(not Zygote.start(), reason="the fork server is off: HARNESS_TEST_COLD=1, or it refused "
                                "to start (the line above says why)")


def gone(pid: int, seconds: float = 10.0) -> bool:
    deadline = time.time() + seconds
    while time.time() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


def both(*args: str) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """`python ARGS` warm and cold."""
    return tuple(subprocess.run([python, *args], cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=120)
                 for python in (str(WARM_PYTHON), sys.executable))


def test_a_warm_process_ends_as_a_cold_one_does_exit_code_signal_and_traceback():
    warm, cold = both("-c", "import sys; print('out', sys.argv[1:]); sys.exit(3)", "a", "b")
    assert (warm.returncode, warm.stdout) == (cold.returncode, cold.stdout) == (3, "out ['a', 'b']\n")
    warm, cold = both("-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM)")
    assert warm.returncode == cold.returncode == -signal.SIGTERM
    # a failure inside the program: its traceback on stderr, exit 1
    warm, cold = both("-m", "harness", "train", "--set", "data.path=\"/nonexistent/corpus.txt\"", "--set",
                      "model.n_layers=-3")
    assert warm.returncode == cold.returncode == 2 and warm.stderr.splitlines()[-1] == cold.stderr.splitlines()[-1]
    warm, cold = both("-c", "def inner():\n    raise ValueError('boom')\ninner()")
    for proc in (warm, cold):
        assert proc.returncode == 1 and "Traceback (most recent call last)" in proc.stderr, proc.stderr
        assert proc.stderr.rstrip().endswith("ValueError: boom") and "in inner" in proc.stderr, proc.stderr


def test_a_warm_process_dies_with_its_client_and_gets_the_signals_its_client_gets():
    code = "import os, time; print(os.getpid(), flush=True); time.sleep(120)"
    for sig in (signal.SIGKILL, signal.SIGTERM, signal.SIGINT):
        client = subprocess.Popen([str(WARM_PYTHON), "-c", code], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True)
        child = int(client.stdout.readline())
        assert child != client.pid and not gone(child, 0.2)
        client.send_signal(sig)
        client.communicate(timeout=30)
        assert gone(child), f"the warm process outlived its client's {sig!r}"
        # SIGKILL cannot be passed on: the server kills the child; the others reach it, and the client ends as it did
        assert client.returncode == -sig if sig != signal.SIGINT else client.returncode in (-sig, 1), client.returncode


def test_ctrl_c_on_a_test_run_leaves_no_process_behind(tmp_path):
    """A pytest run of a test that trains on two warm ranks, interrupted by Ctrl-C (SIGINT to its process group, as
    a terminal sends it): afterwards no process of it is left, the fork server included."""
    marker = f"ctrl-c-{os.getpid()}-{time.time_ns()}"
    test = tmp_path / "test_long.py"
    test.write_text("""
import subprocess
from conftest import command, _env, write_corpus, ROOT

def test_long(tmp_path):
    corpus = write_corpus(tmp_path / "c.txt")
    cmd = command(tmp_path / "run", corpus, nproc=2, ds="zero2.json", sets=["train.max_steps=100000"])
    subprocess.run(cmd, cwd=ROOT, env=_env())
""")
    inner = tmp_path / "inner"
    proc = subprocess.Popen([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-p", "conftest", "-n", "0",
                             "-q", f"--basetemp={inner}", f"--rootdir={ROOT}", str(test)], cwd=ROOT,
                            env=_env({"PYTHONPATH": str(ROOT / "tests"), "CTRL_C_MARKER": marker,
                                      "HARNESS_TEST_LAUNCHES": None}, cold=True),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        deadline = time.time() + 180
        while not list(inner.glob("**/run/metrics.jsonl")):
            assert proc.poll() is None and time.time() < deadline, "the inner run did not start training"
            time.sleep(0.2)
        # pytest, the fork server, accelerate's agent, the 2 clients torchrun started and the 2 warm ranks
        assert len(processes(marker)) >= 7, processes(marker)
        os.killpg(proc.pid, signal.SIGINT)
        proc.communicate(timeout=120)
        deadline = time.time() + 30
        while processes(marker) and time.time() < deadline:
            time.sleep(0.2)
        assert processes(marker) == [], "left behind after Ctrl-C"
    finally:
        for pid in processes(marker):
            os.kill(pid, signal.SIGKILL)


def processes(marker: str) -> list[int]:
    """The processes whose environment holds `marker`."""
    found = []
    for env in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in env.read_bytes():
                found.append(int(env.parent.name))
        except OSError:
            pass
    return found


@pytest.mark.parametrize("unsafe,why", [
    ("import multiprocessing; multiprocessing.set_start_method('spawn')",
     "refused: the multiprocessing start method is forced to 'spawn'"),
    ("import torch; torch.cuda.is_initialized = lambda: True",
     "refused: a CUDA context is present (a forked child cannot use it)")])
def test_the_fork_server_refuses_where_fork_is_unsafe_and_the_tests_start_cold(tmp_path, unsafe, why):
    (tmp_path / "sitecustomize.py").write_text(unsafe + "\n")
    env = _env({"PYTHONPATH": str(tmp_path)}, cold=True)
    server = subprocess.run([sys.executable, str(ROOT / "tests" / "zygote.py"), f"refused-{os.getpid()}"], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=120)
    assert server.stdout.splitlines() == [why] and server.returncode == 0, server.stderr[-2000:]
    # and the tests' side: one line, then every command cold
    check = ("import sys; sys.path.insert(0, 'tests'); import conftest; "
             "print(conftest.Zygote.start(), conftest.python() == sys.executable, 'PYTHON_EXEC' in conftest._env())")
    fallback = subprocess.run([sys.executable, "-c", check], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=120)
    assert fallback.stdout.split() == ["False", "True", "False"], fallback.stderr[-2000:]
    lines = [x for x in fallback.stderr.splitlines() if x.startswith("tests/zygote.py")]
    assert lines == [f"tests/zygote.py {why}: every process starts cold"], fallback.stderr[-2000:]


def test_a_bench_measures_the_same_warm_and_cold(tmp_path, corpus):
    """`harness bench` starts its programs with PYTHON_EXEC where set (the tests' warm client), else cold: both
    measure the same steps and FLOPs and, within 5%, peak memory."""
    sets = [s for s in TINY if not s.startswith("train.max_steps")] + [f"data.path={json.dumps(str(corpus))}"]
    args = ["sweep", "--ds", "zero2", "--nproc", "1", "--steps", "3", "--warmup", "1"]
    for s in sets:
        args += ["--set", s]
    results = {}
    for kind, env in (("warm", None), ("cold", {"PYTHON_EXEC": None})):
        proc = cli("bench", *args, "--out", str(tmp_path / kind), env=env, timeout=600)
        assert proc.returncode == 0, proc.stderr[-3000:]
        results[kind] = json.loads((tmp_path / kind / "bench.json").read_text())["configs"][0]
    warm, cold = results["warm"], results["cold"]
    for key in ("status", "params", "global_batch", "activation_bytes"):
        assert warm[key] == cold[key], key
    assert warm["flops_per_step"] == pytest.approx(cold["flops_per_step"], rel=1e-12)
    assert warm["step_s"]["n"] == cold["step_s"]["n"] == 3
    # the warm process holds the server's imports too, a few modules more than a run needs
    mib = {kind: round(r["peak_mem_bytes"] / 2**20) for kind, r in results.items()}
    assert warm["peak_mem_bytes"] == pytest.approx(cold["peak_mem_bytes"], rel=0.05), mib
