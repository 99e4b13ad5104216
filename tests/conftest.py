"""Helpers that run the harness for real: `python -m harness` for one process, `accelerate launch` for several, each
Python process forked warm from the worker's fork server (tests/zygote.py) unless a test needs it cold.

Runs are tiny (a 2-layer, 32-wide model on generated text) so the whole suite fits in minutes on 2 cores.
Runs that several tests compare against are trained once for the whole test run by their arguments (cached_run).
docs/testing.md says how it all fits together.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.distributed.world import quiet_deepspeed
from zygote_client import import_time

ROOT = Path(__file__).resolve().parents[1]
DS = ROOT / "configs" / "ds"
LAUNCH = ROOT / "launch"
TINY = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "data.seq_len=32", "train.micro_batch_size=4",
        "train.max_steps=6", "train.log_every=1", "optimizer.lr=3e-3", "schedule.warmup_steps=2",
        "logging.backend=\"none\"", "logging.plots=false", "data.val_fraction=0.1"]  # curves: test_logging.py
TINY_RUN = [s for s in TINY if not s.startswith("model.")]  # for a model whose sizes come from its own config


# The slowest files start first (by their time in a full suite), so neither worker is left with a long file at the
# end (pyproject's --no-loadscope-reorder keeps this order: xdist's own puts the files with the most tests first).
LONGEST_FIRST = ("test_resilience.py", "test_suite.py", "test_parallel.py", "test_strategies.py", "test_checkpoint.py",
                 "test_sequence.py", "test_hf_tasks.py", "test_slurm.py", "test_bench.py", "test_translation.py",
                 "test_ds_configs.py", "test_hf.py", "test_plugins.py", "test_compile.py", "test_low_n.py", "test_protein.py",
                 "test_multinode.py", "test_trust.py")


def pytest_sessionstart(session):
    if LAUNCHES and not hasattr(session.config, "workerinput"):
        Path(LAUNCHES).write_text("")  # this run's launches only


def pytest_terminal_summary(terminalreporter):
    """With HARNESS_TEST_LAUNCHES=FILE: where the time went, per test file (tests/launchlog/launches.py)."""
    if LAUNCHES and not hasattr(terminalreporter.config, "workerinput") and Path(LAUNCHES).exists():
        sys.path.insert(0, LAUNCHLOG)
        import launches

        terminalreporter.write_sep("-", f"launches (from {LAUNCHES})")
        for line in launches.summary(LAUNCHES):
            terminalreporter.write_line(line)


def pytest_collection_modifyitems(items):
    items.sort(key=lambda item: next((i for i, name in enumerate(LONGEST_FIRST) if item.path.name == name),
                                     len(LONGEST_FIRST)))


@dataclass
class Run:
    dir: Path
    proc: subprocess.CompletedProcess

    @property
    def metrics(self) -> list[dict]:
        path = self.dir / "metrics.jsonl"
        text = path.read_text() if path.exists() else ""
        lines = text.splitlines() if text.endswith("\n") else text.splitlines()[:-1]  # a line still being written
        return [json.loads(line) for line in lines]

    @property
    def losses(self) -> dict[int, float]:
        return {m["step"]: m["loss"] for m in self.metrics}

    @property
    def evals(self) -> list[dict]:
        return [json.loads(line) for line in (self.dir / "eval.jsonl").read_text().splitlines()]


def write_corpus(path: Path, lines: int = 1500, seed: int = 0) -> Path:
    """Generated English-like text: deterministic, varied enough that the loss falls over a few steps."""
    rng = random.Random(seed)
    words = ("the model trains on many small batches of text and learns which byte comes next while every rank "
             "sees its own shard of data so the gradients agree").split()
    path.write_text("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(4, 14)))
                              for _ in range(lines)) + "\n")
    return path


def shared_dir(tmp_path_factory) -> Path:
    """A folder all pytest-xdist workers of this run share (their base folders' parent), else this process's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@contextlib.contextmanager
def locked(path: Path):
    """Hold an exclusive lock on `path` (a file created for it) across the workers."""
    with open(path, "a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


@pytest.fixture(scope="session")
def corpus(tmp_path_factory) -> Path:
    """One file for every worker, so runs cached across workers (cached_run) name the same data."""
    path = shared_dir(tmp_path_factory) / "corpus.txt"
    with locked(path.with_suffix(".lock")):
        return path if path.exists() else write_corpus(path)


def _env(extra: dict | None = None, cold: bool = False) -> dict:
    """A launch's environment. Where the worker's fork server runs (Zygote) and not `cold`, every Python process that
    torchrun starts below it is forked warm from it (PYTHON_EXEC)."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1",
           "HF_DATASETS_CACHE": os.environ.get("HF_DATASETS_CACHE", str(ROOT / ".pytest_cache" / "hf")),
           "WANDB_MODE": os.environ.get("WANDB_MODE", "offline")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "ACCELERATE_MIXED_PRECISION",
                *Zygote.ENV):
        env.pop(key, None)
    if LAUNCHES:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (LAUNCHLOG, env.get("PYTHONPATH")) if p)
    if not cold and Zygote.start():
        env.update(Zygote.env())
    env.update(extra or {})
    return {k: v for k, v in env.items() if v is not None}  # None removes a variable


def python(cold: bool = False) -> str:
    """What a test's command starts with in place of `python`: the warm client where the fork server runs."""
    return str(WARM_PYTHON) if not cold and Zygote.start() else sys.executable


def command(out: Path, corpus: Path, *, nproc: int = 1, ds: str | None = None, sets: list[str] = (),
            args: list[str] = (), launch: list[str] | None = None, front: bool = False,
            base: list[str] = TINY, cold: bool = False) -> list[str]:
    """The command line `harness` runs: nproc > 1 goes through `accelerate launch --config_file
    launch/cpu_2proc.yaml`, or with `front` through `harness launch` and the same options (started cold: the
    launcher is what those tests check; its ranks are warm unless the environment is `_env(cold=True)`)."""
    cmd = ["-m", "harness", "train", "--set", f"data.path={json.dumps(str(corpus))}",
           "--set", f"run.output_dir={json.dumps(str(out))}"]
    for s in [*base, *sets]:
        cmd += ["--set", s]
    if ds:
        cmd += ["--ds", str(DS / ds) if not Path(ds).is_absolute() else ds]
    cmd += list(args)
    accelerate = ["--config_file", str(LAUNCH / "cpu_2proc.yaml"), "--num_processes", str(nproc)]
    if launch is not None:
        return launch + cmd
    if front:
        return [sys.executable, "-m", "harness", "launch", *accelerate, *cmd[2:]]
    if nproc > 1:
        return [python(cold), "-m", "accelerate.commands.launch", *accelerate] + cmd
    return [python(cold)] + cmd


class Zygote:
    """One per test worker: tests/zygote.py, the fork server that tests/warm_python asks for warm processes. Not
    started where fork is unsafe (it says why; the tests then start every process cold) or with HARNESS_TEST_COLD=1."""
    ENV = ("PYTHON_EXEC", "HARNESS_ZYGOTE", "HARNESS_ZYGOTE_PYTHON", "HARNESS_ZYGOTE_ENV")  # what `env` sets
    proc: subprocess.Popen | None = None
    name = ""
    server_env: dict = {}
    refused: str | None = None

    @classmethod
    def start(cls) -> bool:
        if cls.proc is not None and cls.proc.poll() is None:
            return True
        if cls.refused is not None or os.environ.get("HARNESS_TEST_COLD") == "1":
            return False
        cls.name = f"harness-zygote-{os.getpid()}-{random.getrandbits(32):08x}"
        env = _env(cold=True)
        env.pop("HARNESS_TEST_LAUNCHES", None)  # the server is no launch; its children log themselves
        cls.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py"), cls.name], cwd=ROOT,
                                    env={**env, "HARNESS_ZYGOTE_PARENT": str(os.getpid())}, stdin=subprocess.PIPE,
                                    stdout=subprocess.PIPE, text=True)
        answer = cls.proc.stdout.readline().strip()
        if not answer.startswith("ready "):
            cls.refused = answer or f"ended with {cls.proc.wait()}"
            cls.proc.wait()
            print(f"\ntests/zygote.py {cls.refused}: every process starts cold", file=sys.stderr)
            return False
        server = json.loads(answer.removeprefix("ready "))
        cls.server_env = {"env": import_time(server["env"]), "set": server["set"]}
        os.environ.update(cls.env())  # what a test runs in this process (a bench's programs) starts warm too
        return True

    @classmethod
    def env(cls) -> dict:
        return {"PYTHON_EXEC": str(WARM_PYTHON), "HARNESS_ZYGOTE": cls.name, "HARNESS_ZYGOTE_PYTHON": sys.executable,
                "HARNESS_ZYGOTE_ENV": json.dumps(cls.server_env)}

    @classmethod
    def close(cls) -> None:
        if cls.proc is not None:
            cls.proc.stdin.close()
            cls.proc.wait()
            cls.proc = None
            for key in cls.ENV:
                os.environ.pop(key, None)


WARM_PYTHON = ROOT / "tests" / "warm_python"
# The accelerator named as every harness process names it (DS_ACCELERATOR), before the fork server starts: the
# environment of this worker's launches is then the same before and after a test runs the harness in this process.
quiet_deepspeed()
LAUNCHES = os.environ.get("HARNESS_TEST_LAUNCHES")  # a file: every process the tests start logged there (launchlog)
if LAUNCHES:
    LAUNCHES = os.environ["HARNESS_TEST_LAUNCHES"] = os.path.abspath(LAUNCHES)
LAUNCHLOG = str(ROOT / "tests" / "launchlog")


@pytest.fixture(scope="session", autouse=True)
def zygote():
    yield
    Zygote.close()


def cli(*args: str, env: dict | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m harness ARGS` in one process, from the cwd ROOT, output captured (warm where it can be)."""
    return subprocess.run([python(), "-m", "harness", *args], cwd=ROOT, env=_env(env), capture_output=True,
                          text=True, timeout=timeout)


def harness(out: Path, corpus: Path, *, env: dict | None = None, check: bool = True, timeout: int = 300,
            cold: bool = False, **kwargs) -> Run:
    """Train into `out` (see `command` for the arguments) and wait for the end; `cold`: every process started afresh,
    where the process tree is what a test checks."""
    cmd = command(out, corpus, cold=cold, **kwargs)
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(env, cold=cold), capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        log = out.parent / "failed.log"  # the whole output: the cause is often far above the launcher's summary
        log.write_text(f"{' '.join(cmd)}\n--- stdout\n{proc.stdout}\n--- stderr\n{proc.stderr}")
        causes = [line for line in proc.stderr.splitlines() if "Error" in line or "error:" in line]
        raise AssertionError(f"harness failed ({proc.returncode}), full log in {log}:\n" + "\n".join(causes[-20:]))
    return Run(out, proc)


@pytest.fixture(scope="session")
def cached_run(tmp_path_factory, corpus):
    """cached_run(name, **kwargs): one run per name and arguments for the whole test run, shared by the xdist
    workers: the first to ask trains it under a file lock, the others read it (the run folder, its output)."""
    root = shared_dir(tmp_path_factory) / "cached-runs"
    root.mkdir(exist_ok=True)

    def get(name: str, **kwargs) -> Run:
        key = hashlib.sha1(json.dumps([name, kwargs], sort_keys=True, default=str).encode()).hexdigest()[:10]
        folder, lock = root / f"{name}-{key}", root / f"{name}-{key}.lock"
        with locked(lock):
            if not (folder / "proc.json").exists():
                shutil.rmtree(folder, ignore_errors=True)
                folder.mkdir()
                proc = harness(folder / "run", corpus, **kwargs).proc
                (folder / "proc.json").write_text(json.dumps({"args": proc.args, "returncode": proc.returncode,
                                                              "stdout": proc.stdout, "stderr": proc.stderr}))
            saved = json.loads((folder / "proc.json").read_text())
        return Run(folder / "run", subprocess.CompletedProcess(**saved))

    return get


@pytest.fixture(scope="session", autouse=True)
def busy_cores():
    """HARNESS_TEST_BUSY=N: N busy loops beside each pytest worker for the whole session, a loaded cluster node's
    conditions for the distributed tests (e.g. `HARNESS_TEST_BUSY=1 python -m pytest tests/test_sharding.py`; a race
    at process-group teardown showed only under load: world.py)."""
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(int(os.environ.get("HARNESS_TEST_BUSY", "0")))]
    yield
    for p in loops:
        p.kill()
        p.wait()


@pytest.fixture(scope="session", autouse=True)
def one_thread():
    """In-process model work on one thread, in every test: the suite's two workers and their runs already share the
    cores, where a tiny model's ops on two threads wait on each other (measured: beam search 10x slower). Runs the
    tests start get OMP_NUM_THREADS=1 (`_env`)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def bare_copy(run_dir: Path, dest: Path) -> Path:
    """A run directory with only its config and exported model: none of the stored tokenizer and statistics."""
    dest.mkdir()
    for name in ("config.toml", "model.safetensors"):
        (dest / name).write_bytes((run_dir / name).read_bytes())
    return dest


def rewind(run_dir: Path, dest: Path, step: int) -> Path:
    """A copy of a finished run directory as if the run had stopped after its checkpoint at `step`: the later
    checkpoints removed and `latest` naming that one (the uninterrupted run's own mid-run checkpoint as a resume
    point, instead of a second run stopped there)."""
    shutil.copytree(run_dir, dest)
    ckpts = dest / "checkpoints"
    for path in ckpts.glob("step_*"):
        if int(path.name.removeprefix("step_").split(".")[0]) > step:
            shutil.rmtree(path)
    (ckpts / "latest").write_text(f"step_{step:08d}")
    assert (ckpts / f"step_{step:08d}").is_dir(), sorted(p.name for p in ckpts.iterdir())
    return dest


def ds_variant(tmp: Path, base: str, **zero) -> str:
    """A shipped DeepSpeed config with some zero_optimization keys changed (e.g. to force real sharding)."""
    cfg = json.loads((DS / base).read_text())
    cfg["zero_optimization"].update(zero)
    path = tmp / f"{Path(base).stem}-variant.json"
    path.write_text(json.dumps(cfg))
    return str(path)


class Stopped(Exception):
    """What `stop_after` raises."""


def stop_after(last: int, i: int, steps: int, asked: list) -> None:
    """A World's `between_batches` for a task's own evaluation: records each (i, steps) it is asked with in `asked`,
    and stops the evaluation (raises Stopped) after micro-batch `last`, as the loop does on a stop signal."""
    asked.append((i, steps))
    if i == last:
        raise Stopped


def assert_losses_close(a: dict[int, float], b: dict[int, float], rel: float) -> None:
    assert a.keys() == b.keys() and a, (a, b)
    for step in a:
        assert abs(a[step] - b[step]) <= rel * abs(b[step]), f"step {step}: {a[step]} vs {b[step]} (rel {rel})"


def val_loss_of_export(run_dir: Path) -> float:
    """The exported model's mean validation loss, computed in this process with a plain module."""
    import torch

    from harness.run.export import load_model
    from harness.tasks import get_task

    model, cfg = load_model(run_dir)
    task = get_task(cfg.run.task)
    val = task.build_data(cfg).val
    total = count = 0.0
    with torch.no_grad():
        for i in range(0, len(val), 8):
            batch = task.collate([val[j] for j in range(i, min(i + 8, len(val)))])
            total += task.loss(model, batch).item()
            count += task.count(batch)
    return total / count


# --- Hugging Face models written by the tests (no hub), for test_hf.py and test_hf_tasks.py ---------------------

def _transformers():
    return pytest.importorskip("transformers")


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory, corpus):
    """A 2-layer Llama and a word-level tokenizer trained on the test corpus, saved as a model directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    out = tmp_path_factory.mktemp("hf") / "tiny-llama"
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(corpus)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "[PAD]", "[BOS]", "[EOS]"]))
    fast = _transformers().PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", pad_token="[PAD]",
                                                bos_token="[BOS]", eos_token="[EOS]")
    # an odd vocabulary: tensor parallelism splits the output layer unevenly (test_hf.py's AutoTP test exports it)
    config = _transformers().LlamaConfig(vocab_size=len(fast) | 1, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                      max_position_embeddings=64, tie_word_embeddings=False,
                                      pad_token_id=fast.pad_token_id, bos_token_id=fast.bos_token_id,
                                      eos_token_id=fast.eos_token_id)
    torch.manual_seed(1234)  # not the runs' seed: a model that lost its weights and re-initialised would show
    _transformers().LlamaForCausalLM(config).save_pretrained(out)
    fast.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_llama_shards(tmp_path_factory, tiny_llama):
    """`tiny_llama`'s weights saved again in shards of at most 20 KB (with an index), beside the same tokenizer."""
    out = tmp_path_factory.mktemp("hf") / "tiny-llama-shards"
    _transformers().LlamaForCausalLM.from_pretrained(tiny_llama).save_pretrained(out, max_shard_size="20KB")
    for f in tiny_llama.iterdir():
        if not f.name.startswith("model") and not (out / f.name).exists():
            shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="session")
def tiny_t5(tmp_path_factory):
    """The toy English-"French" pairs and a 2+2-layer T5 with a word-level tokenizer trained on both sides."""
    import gzip

    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from test_translation import write_toy_dir

    root = tmp_path_factory.mktemp("t5")
    toy = write_toy_dir(root / "toy")
    text = root / "both.txt"
    text.write_text("".join(gzip.open(toy / f"train.{lang}.gz", "rt").read() for lang in ("en", "fr")))
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train([str(text)], trainers.WordLevelTrainer(special_tokens=["[PAD]", "[EOS]", "[UNK]"]))  # T5's 0, 1, 2
    fast = _transformers().PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", eos_token="[EOS]",
                                                unk_token="[UNK]")
    config = _transformers().T5Config(vocab_size=len(fast), d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0, pad_token_id=0,
                                   eos_token_id=1, decoder_start_token_id=0)
    torch.manual_seed(1234)  # not the runs' seed: a model that lost its weights and re-initialised would show
    out = root / "tiny-t5"
    _transformers().T5ForConditionalGeneration(config).save_pretrained(out)
    fast.save_pretrained(out)
    return toy, out


ESM_VOCAB = ["<cls>", "<pad>", "<eos>", "<unk>", *"LAGVSERTIDPKQNFYMHWCXBUZO.-", "<null_1>", "<mask>"]  # ESM-2's 33


@pytest.fixture(scope="session")
def tiny_esm(tmp_path_factory):
    """A 2-layer ESM-2-style masked LM with ESM-2's vocabulary."""
    import torch

    out = tmp_path_factory.mktemp("esm") / "tiny-esm"
    out.mkdir()
    (out / "vocab.txt").write_text("\n".join(ESM_VOCAB) + "\n")
    tok = _transformers().EsmTokenizer(str(out / "vocab.txt"))
    config = _transformers().EsmConfig(vocab_size=len(ESM_VOCAB), hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, max_position_embeddings=260,
                                    position_embedding_type="rotary", hidden_dropout_prob=0.0,
                                    attention_probs_dropout_prob=0.0, pad_token_id=1, mask_token_id=32)
    torch.manual_seed(1234)  # not the runs' seed: a model that lost its weights and re-initialised would show
    _transformers().EsmForMaskedLM(config).save_pretrained(out)
    tok.save_pretrained(out)
    return out
