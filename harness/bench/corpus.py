"""`harness bench corpus`: what a prepared corpus costs (docs/corpora.md): prepare throughput, bytes on disk a token,
the loader's tokens/s a rank, and a toy 1-step run's start-up and peak memory on synthetic text of 100 MB to 10 GB,
alternated with the same run on the embedded default."""
from __future__ import annotations

import itertools
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from ..data.batches import StepSampler
from ..data.corpus import Corpus, Windows
from ..tasks.lm import LanguageModelTask
from .report import save
from .sweep import ROOT, python

SIZES = {"100MB": 100 << 20, "1GB": 1 << 30, "10GB": 10 << 30}
TOY = ["model.d_model=32", "model.n_layers=1", "model.n_heads=2", "data.seq_len=128", "train.micro_batch_size=8",
       "train.max_steps=1", "train.eval_batches=1", 'logging.backend="none"', "logging.plots=false"]
RSS = "import resource, subprocess, sys; subprocess.run(sys.argv[1:]); " \
      "print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)"  # the run's peak, in bytes


def text(path: Path, size: int) -> Path:
    """`size` bytes of synthetic lines (deterministic), written once."""
    if path.is_file() and path.stat().st_size >= size:
        return path
    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 9))) for _ in range(5000)]
    blocks = [("\n".join(" ".join(rng.choice(words) for _ in range(rng.randint(5, 30))) for _ in range(20000)) +
               "\n").encode() for _ in range(8)]
    with open(path, "wb") as f:
        written = 0
        while written < size:
            written += f.write(blocks[written % len(blocks)])
    return path


def prepare(source: Path, out: Path, workers: int, tokenizer: str | None = None) -> dict:
    """A fresh prepare: seconds, tokens/s (all, and a worker's), bytes on disk a token."""
    shutil.rmtree(out, ignore_errors=True)
    cmd = [python(), "-m", "harness", "prepare", "lm", "--input", str(source), "--out", str(out),
           "--workers", str(workers), *(["--tokenizer", tokenizer] if tokenizer else [])]
    start = time.perf_counter()
    subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True)
    seconds = time.perf_counter() - start
    m = json.loads((out / "manifest.json").read_text())
    tokens = m["counts"]["train"]["tokens"] + m["counts"]["validation"]["tokens"]
    disk = sum(f.stat().st_size for f in out.iterdir() if f.suffix in (".bin", ".idx"))
    t = m["tokenizer"]
    return {"workers": workers, "tokenizer": "bytes" if t["kind"] == "bytes" else f"BPE, {t['vocab_size']:,} ids",
            "dtype": m["dtype"], "seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds,
            "tokens_per_s_per_worker": tokens / seconds / workers, "disk_bytes_per_token": disk / tokens}


def bpe(work: Path, source: Path) -> str:
    """A byte-level BPE tokenizer (8,192 ids) trained on the first 10 MB: a Hugging Face tokenizer built here."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    out = work / "bpe"
    if not (out / "tokenizer.json").is_file():
        sample = work / "bpe-sample.txt"
        with open(source, "rb") as f:
            sample.write_bytes(f.read(10 << 20))
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
        tok.train([str(sample)], trainers.BpeTrainer(vocab_size=8192, special_tokens=["<eos>"]))
        PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>").save_pretrained(out)
    return str(out)


def loader(directory: Path, seq_len: int = 1024, micro: int = 16, ranks: int = 8, steps: int = 400) -> dict:
    """Rank 0 of `ranks` reading its micro-batches of random windows, as training does: tokens/s."""
    windows = Windows(Corpus(directory), "train", seq_len)
    batches = torch.utils.data.DataLoader(windows, collate_fn=LanguageModelTask().collate, batch_sampler=StepSampler(
        len(windows), micro, 1, 0, ranks, 0, 0, steps, order="lazy"))
    start, tokens = time.perf_counter(), 0
    for b in batches:
        tokens += b["targets"].numel()
    return {"seq_len": seq_len, "micro_batch": micro, "ranks": ranks, "tokens_per_s": tokens / (time.perf_counter() -
                                                                                               start)}


def start_up(data: str | None, run: Path) -> dict:
    """A 1-step toy run on `data` (None: the embedded default): seconds from launch to end, peak resident set."""
    sets = [*TOY, f"run.output_dir={json.dumps(str(run))}", *([f"data.path={json.dumps(data)}"] if data else [])]
    cmd = [sys.executable, "-c", RSS, python(), "-m", "harness", "train", "--overwrite", "--stop-at", "1",
           *(a for s in sets for a in ("--set", s))]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=ROOT, check=True, capture_output=True, text=True)
    return {"seconds": time.perf_counter() - start, "peak_rss_bytes": int(done.stdout.strip().splitlines()[-1])}


def run_corpus(args) -> dict:
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    sizes = sorted(dict.fromkeys(s.strip() for s in args.sizes.split(",")), key=SIZES.get)  # smallest first
    total, done = 2 * len(sizes) + 6 + args.repeats * (len(sizes) + 1), itertools.count(1)

    def say(what: str) -> None:  # long work: a line as each stage starts
        print(f"[{next(done)}/{total}] {what}", flush=True)

    sources = {}
    for s in sizes:
        say(f"synthetic text of {s} ({work / f'text-{s}.txt'}, written once)")
        sources[s] = text(work / f"text-{s}.txt", SIZES[s])
    small, bytes_at = sources[sizes[0]], sizes[min(1, len(sizes) - 1)]  # bytes on enough units for 2 workers
    result = {"sizes": sizes, "prepare": []}
    for w in (1, 2):
        say(f"prepare {bytes_at} as bytes, {w} worker(s)")
        result["prepare"].append({"text": bytes_at, **prepare(sources[bytes_at], work / "p-bytes", w)})
    say("a BPE tokenizer of 8,192 ids on the first 10 MB")
    tokenizer = bpe(work, small)
    for w in (1, 2):
        say(f"prepare {sizes[0]} with it, {w} worker(s)")
        result["prepare"].append({"text": sizes[0], **prepare(small, work / "p-bpe", w, tokenizer)})
    for s in sizes:
        say(f"prepare the {s} corpus the start-ups read")
        prepare(sources[s], work / f"corpus-{s}", 2)
    say(f"the loader over the {sizes[-1]} corpus")
    result["loader"] = loader(work / f"corpus-{sizes[-1]}")
    runs = {"default": [], **{s: [] for s in sizes}}
    for _ in range(args.repeats):  # alternated: a drift in the machine's speed weighs on every size alike
        for name in runs:
            say(f"start-up on {'the embedded default' if name == 'default' else f'the {name} corpus'}")
            runs[name].append(start_up(None if name == "default" else str(work / f"corpus-{name}"), work / "run"))
    result["start_up"] = {name: {"seconds": statistics.median(r["seconds"] for r in rs),
                                 "peak_rss_bytes": statistics.median(r["peak_rss_bytes"] for r in rs), "runs": rs}
                          for name, rs in runs.items()}
    save(out, "corpus", {**result, "cpus": os.cpu_count()}, markdown(result))
    print(markdown(result))
    print(f"wrote {out / 'corpus.json'}, {out / 'corpus.md'}")
    return result


def markdown(r: dict) -> str:
    lines = ["| prepare: tokens | text | workers | tokens/s | tokens/s a worker | disk bytes a token |",
             "|---|---|---|---|---|---|"]
    lines += [f"| {p['tokenizer']} ({p['dtype']}) | {p['text']} | {p['workers']} | "
              f"{p['tokens_per_s']:,.0f} | {p['tokens_per_s_per_worker']:,.0f} | {p['disk_bytes_per_token']:.3f} |"
              for p in r["prepare"]]
    ld = r["loader"]
    lines += ["", f"Loader: {ld['tokens_per_s']:,.0f} tokens/s on one rank of {ld['ranks']} (random windows of "
                  f"{ld['seq_len']}, micro-batches of {ld['micro_batch']}, the {r['sizes'][-1]} corpus).", "",
              "| data | start-up to the end of step 1, s (median) | above the embedded default | peak RSS |",
              "|---|---|---|---|"]
    base = r["start_up"]["default"]
    for name, s in r["start_up"].items():
        lines.append(f"| {'embedded default (raw text)' if name == 'default' else name + ' prepared'} | "
                     f"{s['seconds']:.2f} | {s['seconds'] - base['seconds']:+.2f} s | "
                     f"{s['peak_rss_bytes'] / 2**20:,.0f} MiB ({s['peak_rss_bytes'] / base['peak_rss_bytes']:.2f}x) |")
    return "\n".join(lines)
