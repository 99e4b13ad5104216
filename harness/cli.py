"""The `harness` command: train, launch, plan, keys, prepare, evaluate, translate, export, plot, bench, results.
Input errors print one line and exit 2 before any training; a non-finite stop exits 3, a stop for a signal 75."""
from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterable
from pathlib import Path

from .config.run import UNSET_PREFIX, ConfigError, Preempted, TrainingStopped
from .distributed.world import launched_rank, quiet_deepspeed
from .run.heartbeat import EXIT_HUNG, RankHung
from .run.trust import trusting


INTERCONNECT, MFU = "ib-ndr400", 0.40  # `harness plan`'s estimate on paper, unless told otherwise


COMMAND_EXAMPLES = {
    "train": "python -m harness train --run configs/runs/lm_demo.toml --set train.max_steps=50   # one process; "
             "several: harness launch",
    "launch": "harness launch --config_file launch/cpu_2proc.yaml train --run configs/runs/lm_demo.toml --ds zero2",
    "plan": "python -m harness plan --config_file launch/cpu_2proc.yaml --run configs/runs/lm_demo.toml --ds zero2",
    "keys": "python -m harness keys | grep ^data.",
    "prepare": "python -m harness prepare lm --input 'corpus/*.jsonl.gz' --out prepared/corpus --workers 4",
    "evaluate": "python -m harness evaluate --run-dir runs/lm_demo --split validation",
    "export": "python -m harness export --run-dir runs/my_llama --hf exported/my_llama   # a run of model.hf",
    "plot": "python -m harness plot runs/lm_demo runs/lm_compare --out compare.png",
    "results": "python -m harness results --check",
    "translate": "python -m harness translate --run-dir runs/translation_cpu \"And he went up into a mountain.\"",
    "bench": "python -m harness bench proxy --stages 0,3 --precisions fp32",
    "docs": "python -m harness docs --quick",
}


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="RUN.toml", help="run file (TOML); values not given take their defaults")
    p.add_argument("--ds", metavar="DS.json", help="DeepSpeed config; default: ZeRO-0 (plain data parallel), fp32")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one run-config value (TOML literal); repeatable; wins over the run file")
    p.add_argument("--unset", action="append", dest="set", metavar="SECTION.KEY", type=lambda key: UNSET_PREFIX + key,
                   help="give a key the run file sets its default back (e.g. --unset schedule.kind, to take a "
                   "DeepSpeed file's scheduler); repeatable")


def _run_dir(p: argparse.ArgumentParser) -> None:
    """A finished run directory to read, and what of it to trust: it may come from elsewhere."""
    p.add_argument("--run-dir", required=True, metavar="DIR", help="a finished run's directory (its run.output_dir, "
                   "e.g. runs/lm_demo), holding its config.toml and exported model.safetensors")
    p.add_argument("--task", metavar="NAME", help="the plug-in task the run directory's config.toml names, named by "
                   "you: importing it runs its code, which a run directory alone may not make happen")
    p.add_argument("--trust-run-dir", action="store_true", help="import the plug-in task and run the Hugging Face "
                   "model code (model.trust_remote_code) the run directory names; only for one you trust")


PLAN_LAUNCH = """Resolve and check everything, print it with its sources, train nothing.

It also takes what `harness launch` takes before `train`: accelerate launch's options
(--config_file FILE, --num_processes N, --mixed_precision, ...), anywhere among its own,
and plans that launch's world and precision (not with --world-size or --mixed-precision)."""

EXAMPLES = """examples:
  harness train --run configs/runs/lm_demo.toml --ds zero2          # one process; --ds names a file or configs/ds/NAME
  harness launch --config_file launch/cpu_2proc.yaml train --run configs/runs/lm_demo.toml --ds zero2
  harness plan --run configs/runs/lm_demo.toml --ds zero3 --world-size 8   # everything checked, nothing trained
  harness prepare lm --input 'corpus/*.jsonl.gz' --out prepared/corpus      # then --set data.path='"prepared/corpus"'
  harness evaluate --run-dir runs/lm_demo --split validation
  harness bench sweep --run configs/runs/lm_demo.toml --ds zero0,zero2 --nproc 1,2
"""
BENCH = ("sweep", "overhead", "proxy", "suite", "seeds", "corpus")


def _bench_parsers(b: argparse.ArgumentParser) -> None:
    """`harness bench SUBCOMMAND`, each with its own flags: argparse refuses another's."""
    sub = b.add_subparsers(dest="study", required=True, metavar="{" + ",".join(BENCH) + "}")
    sweep = sub.add_parser("sweep", help="time a sweep of strategies, precisions, sizes and process counts, one "
                           "accelerate launch each; writes OUT/bench.json, bench.md and bench.png")
    overhead = sub.add_parser("overhead", help="the harness's step against a plain PyTorch step on the same model and "
                              "batches, launch by launch and in the same processes; writes OUT/overhead.json and .md")
    seeds = sub.add_parser("seeds", help="train every configuration to its end once per seed and score it with "
                           "evaluate: each seed, the mean and the sd of --metric beside --baseline (OUT/seeds.json, .md)")
    proxy = sub.add_parser("proxy", help="count what a step asks of a GPU (aten ops, kernel launches, host syncs, "
                           "collectives), harness against plain PyTorch, for each speed-suite model at toy width under "
                           "each ZeRO stage and precision, on this CPU; writes OUT/proxy.json and proxy.md")
    suite = sub.add_parser("suite", help="the GPU suite: MFU, overhead, largest model and the recipes' quality, each "
                           "part under its own time budget (harness/bench/suite.py)")
    corpus = sub.add_parser("corpus", help="prepared corpora: prepare throughput, disk bytes a token, the loader's "
                            "tokens/s, start-up and peak memory from 100 MB to 10 GB (docs/corpora.md)")
    _bench_corpus_flags(corpus)
    _bench_shared_flags(sweep, overhead, seeds, proxy, suite)
    _bench_own_flags(sweep, overhead, seeds, proxy, suite)
    for name, p in sub.choices.items():
        p.set_defaults(command_parser=p)


def _bench_corpus_flags(corpus: argparse.ArgumentParser) -> None:
    corpus.add_argument("--sizes", default="100MB,1GB,10GB", help="corpus sizes, smallest first (100MB, 1GB, 10GB)")
    corpus.add_argument("--repeats", type=int, default=3, help="start-ups per size, alternated (default 3)")
    corpus.add_argument("--work", default="bench/corpus-work", help="where the text and the prepared corpora go (a "
                        "10 GB run needs about 25 GB)")
    corpus.add_argument("--out", default="bench/corpus", help="the report's directory (default bench/corpus)")


def _bench_shared_flags(sweep, overhead, seeds, proxy, suite) -> None:
    """The flags several bench subcommands take alike: the configurations, --set, --out and the step counts."""
    for p in (sweep, overhead, seeds):
        p.add_argument("--run", metavar="RUN.toml", help="the run file every configuration starts from")
        p.add_argument("--ds", default="zero0", help="comma-separated DeepSpeed configs: names in configs/ds or paths")
        p.add_argument("--nproc", default="1", help="comma-separated process counts (GPUs on a GPU machine)")
        p.add_argument("--mixed-precision", default="no", help="comma-separated accelerate mixed_precision values "
                       "(no, bf16, fp16); 'no' lets the DeepSpeed config decide (bf16 on a GPU that has it)")
        p.add_argument("--timeout", type=int, default=1800, help="seconds one configuration may take")
    for p in (sweep, seeds):
        p.add_argument("--vary", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                       help="compare values of a run-config key, e.g. model.d_model=256,512 or train.compile=false,true")
    for p, steps, warmup, out in ((sweep, 20, 5, "bench"), (overhead, 20, 5, "bench"), (proxy, 16, 4, "bench/proxy"),
                                  (suite, None, None, "results/gpu/DATE-DEVICE; --smoke: bench/suite-smoke"),
                                  (seeds, None, None, "bench/seeds")):
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="as for train, for all")
        p.add_argument("--out", help=f"the report's directory (default {out})")
        if steps or p is suite:
            p.add_argument("--steps", type=int, default=steps, help=f"timed steps (default {steps or '20; --smoke: 3'})")
            p.add_argument("--warmup", type=int, default=warmup, help=f"steps before timing starts (default "
                           f"{warmup or '5; --smoke: 2'})")


def _bench_own_flags(sweep, overhead, seeds, proxy, suite) -> None:
    """The flags of one bench subcommand (or of sweep and suite, which both find the largest model)."""
    overhead.add_argument("--rounds", type=int, default=2, help="alternations of the two programs")
    sweep.add_argument("--rounds", type=int, default=1, help="launches of each configuration, interleaved: round by "
                       "round every configuration runs once, and its timed steps are pooled (on a shared or noisy "
                       "machine, compare speeds with 3 or more)")
    sweep.add_argument("--largest", choices=["n_layers", "d_model", "seq_len"], help="also find, per configuration, "
                       "the largest model (by this size) or the longest sequence (seq_len, in steps of 64) that trains "
                       "within the memory budget")
    for p in (sweep, suite):
        p.add_argument("--memory-budget-gb", type=float, help="device memory per rank for --largest (default on a "
                       "GPU: the card's memory)")
    sweep.add_argument("--largest-max", type=int, default=64, help="--largest stops at this many layers, units of "
                       "n_heads x 8 of width, or units of 64 positions")
    proxy.add_argument("--stages", metavar="S,...", help="the ZeRO stages (default 0,1,2,3)")
    proxy.add_argument("--precisions", metavar="P,...", help="the precisions (default fp32,bf16,fp16)")
    proxy.add_argument("--timeout", type=int, default=1800, help="seconds one configuration may take")
    for p in (proxy, suite):
        p.add_argument("--data", metavar="DIR", help="the benchmark data (multi30k/, flip_ss/, ett/), e.g. ../shared/data")
    suite.add_argument("--parts", help="comma-separated parts to run, in order (default all: ops, speed, overhead, "
                       "largest, quality); results of a later command join the same --out")
    suite.add_argument("--smoke", action="store_true", help="every part at toy size, on a CPU in about two minutes; "
                       "proves the suite works, measures nothing")
    suite.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS", help="change a part's time "
                       "budget")
    suite.add_argument("--work", metavar="DIR", help="scratch space for the runs and their checkpoints (default "
                       "bench/suite-work)")
    suite.add_argument("--recipes", metavar="NAME,...", help="the quality part's recipes to run (default all; an "
                       "unknown name is refused with the list); in the same --out their results replace those recipes' "
                       "earlier ones and the others stay")
    seeds.add_argument("seeds", metavar="S,...", help="the seeds (train.seed), e.g. 0,1,2")
    seeds.add_argument("--metric", help="the evaluation's figure to report (default: the run's train.select_best)")
    seeds.add_argument("--baseline", help="a figure the evaluation prints beside the model's to compare with, e.g. "
                       "ridge_spearman")
    seeds.add_argument("--split", default="test", choices=["validation", "test"], help="the split scored (default test)")
    seeds.add_argument("--threads", type=int, help="on a CPU: threads per process (default: its share of the cores); "
                       "the report states it")


RECIPES_READ = "../shared/data"  # where configs/runs/*.toml read the benchmark sets (prepare/benchmarks.py)


def _prepare_parsers(pr: argparse.ArgumentParser) -> None:
    """`harness prepare lm` (a corpus of any size into shards, docs/corpora.md) and the case studies'."""
    sub = pr.add_subparsers(dest="task", required=True, metavar="{lm,translation,protein,prices}")
    lm = sub.add_parser("lm", help="a text corpus of any size into token shards that training reads by memory map "
                        "(data.path = OUT)")
    _corpus_options(lm, "files, directories and globs of .txt, .jsonl/.json, .csv/.tsv, .parquet (also .gz, .bz2, "
                    ".xz, .zst), or hub:NAME (streamed)")
    lm.add_argument("--tokenizer", metavar="NAME_OR_DIR", help="a Hugging Face tokenizer (default: the lm's bytes)")
    for name in ("translation", "protein", "prices"):
        p = sub.add_parser(name, help=f"the {name} case study's data" + (
            "; with --input, sequences of any number into residue shards for masked-LM pre-training (data.path = "
            "OUT)" if name == "protein" else ""))
        p.add_argument("--data", metavar="SRC", help="the source (sets data.path): a directory such as "
                       "../shared/data/multi30k, your own file, or hub:NAME; default: the embedded default")
        p.add_argument("--run", metavar="RUN.toml", help="take the data and model settings from a run file")
        p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="as for train")
        sets = {"translation": "multi30k", "protein": "flip_ss and flip_gb1", "prices": "ett"}[name]
        p.add_argument("--from", dest="release", metavar="PATH", help=f"instead: lay out the benchmark set ({sets}) "
                       f"from the file or folder its authors publish, into --out (default {RECIPES_READ}, where the "
                       f"GPU recipes read it; docs/case-studies.md names the sources)")
        if name == "protein":
            _corpus_options(p, "instead of --data: FASTA files (.fasta, .fa, .faa, .fas; also .gz, .bz2, .xz, .zst), "
                            "directories and globs, one sequence a document; or .txt/.jsonl/.csv/.parquet of "
                            "sequences (--text-field)", out_required=False)
        else:
            p.add_argument("--out", metavar="DIR", help="with --from: the folder the benchmark set goes in")


def _corpus_options(p: argparse.ArgumentParser, inputs: str, out_required: bool = True) -> None:
    """What preparing a corpus of any size takes (docs/corpora.md)."""
    p.add_argument("--input", nargs="+", action="extend", default=[], metavar="PATH", help=inputs)
    p.add_argument("--out", required=out_required, metavar="DIR", help="the prepared directory; the same command "
                   "again continues an interrupted prepare, or does nothing")
    p.add_argument("--workers", type=int, default=1, help="processes preparing units in parallel (default 1)")
    p.add_argument("--text-field", default="text", help="the field or column of JSON, csv and parquet rows "
                   "(default text)")
    p.add_argument("--val-fraction", type=float, default=0.01, help="documents held out for validation (default "
                   "0.01; the same documents whatever the workers or parts)")
    p.add_argument("--seed", type=int, default=0, help="seed of the validation draw")
    p.add_argument("--on-error", choices=["stop", "skip"], default="stop", help="an unreadable or truncated input: "
                   "stop naming it (default), or keep what was read, count it and go on")
    p.add_argument("--part", metavar="I/N", help="prepare only part I of N (e.g. one task of a SLURM array)")
    p.add_argument("--merge", nargs="+", action="extend", metavar="DIR", help="instead: join prepared parts into OUT "
                   "(no data copied)")


OLD_BENCH = {"--overhead": "overhead", "--proxy": "proxy", "--suite": "suite", "--seeds": "seeds"}


def _old_bench(argv: list[str], bench: argparse.ArgumentParser) -> list[str]:
    """`harness bench --proxy ...` (before the subcommands) as `harness bench proxy ...`, with a line naming the new
    form; accepted until the next release. Two studies' flags, or none at all: the usage line, exit 2."""
    rest = argv[1:]
    if rest[:1] and (rest[0] in BENCH or rest[0] in ("-h", "--help")):
        return argv
    modes = [a.split("=")[0] for a in rest if a.split("=")[0] in OLD_BENCH]
    if len(modes) > 1:
        bench.error(f"{' and '.join(modes)} are two studies: run one, e.g. `harness bench {OLD_BENCH[modes[0]]} ...`")
    if not rest:
        return argv
    study, out = OLD_BENCH[modes[0]] if modes else "sweep", []
    value = None
    it = iter(rest)
    for a in it:
        flag, eq, v = a.partition("=")
        if flag not in OLD_BENCH:
            out.append(a)
        elif flag in ("--suite", "--seeds"):
            value = v if eq else next(it, None)
    if study == "suite" and value != "gpu":
        bench.error(f"--suite {value}: the suites are gpu")
    new = ["bench", study, *([value] if study == "seeds" and value is not None else []), *out]
    print(f"harness: `harness {' '.join(argv)}` is now `harness {' '.join(new)}`; the old form is accepted until the "
          f"next release", file=sys.stderr)
    return new


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="harness", description="Train Transformers with DeepSpeed strategies chosen "
                                 "by a JSON file: one process with `harness train`, several with `harness launch`.",
                                 formatter_class=argparse.RawDescriptionHelpFormatter, epilog=EXAMPLES)
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a run")
    _train_options(t)
    la = sub.add_parser("launch", help="check a training run, then start it with accelerate launch; exits with the "
                        "harness's codes",
                        description="harness launch [ACCELERATE LAUNCH OPTIONS] train [TRAIN OPTIONS]: checks "
                        "everything train checks before any process starts (bad input: one line, exit 2), then runs "
                        "accelerate launch with those options; exits 0, 2, 3 (non-finite stop), 4 (a rank stopped "
                        "answering) or 75 (stopped by SIGTERM, SIGINT or SIGUSR1 with a checkpoint: --resume auto "
                        "continues)")
    la.add_argument("argv", nargs=argparse.REMAINDER, metavar="... train ...")
    p = sub.add_parser("plan", help="resolve and check the run and DeepSpeed configs (not this machine's devices: a "
                       "plan may be of another), print them with their sources, train nothing",
                       description=PLAN_LAUNCH)
    _plan_options(p)
    sub.add_parser("keys", help="list every run-config key with its default and meaning")
    pr = sub.add_parser("prepare", help="tokenize a corpus into shards once (lm), or clean, split and tokenize a "
                        "case study's data once (training reuses it)")
    _prepare_parsers(pr)
    ev = sub.add_parser("evaluate", help="the field's metrics of a finished run on a split or on new data; writes "
                        "RUN/eval.json")
    _evaluate_options(ev)
    b = sub.add_parser("bench", help="benchmarks: sweep, overhead, proxy, suite (GPU), seeds, corpus")
    _bench_parsers(b)
    ex = sub.add_parser("export", help="write a finished run's Hugging Face model as a directory that "
                        "from_pretrained loads (config, weights, tokenizer)")
    _run_dir(ex)
    ex.add_argument("--hf", required=True, metavar="OUT", help="the directory to write (new or empty)")
    ex.add_argument("--overwrite", action="store_true", help="replace OUT where it holds a Hugging Face model "
                    "(an earlier export)")
    pl = sub.add_parser("plot", help="draw runs' curves into one PNG (training loss, learning rate, validation loss, "
                        "the task's metric), each run a line, and print each run's last figures")
    pl.add_argument("run_dirs", nargs="+", metavar="RUN_DIR")
    pl.add_argument("--out", metavar="FILE.png", help="default: RUN_DIR/curves.png for one run; for several, "
                    "compare.png beside the first run directory")
    pl.add_argument("--x", choices=("step", "samples"), default="step", help="draw against the optimizer step, or the "
                    "samples read by then (runs of other global batches compared by the data they read)")
    r = sub.add_parser("results", help="regenerate the tables of docs/benchmarks.md from their files under results/")
    r.add_argument("--check", action="store_true", help="only check that docs/benchmarks.md matches the result files")
    dc = sub.add_parser("docs", help="re-measure the figures the README and docs state, each by the command stated "
                        "beside it (docs/checks.toml), and compare them within their tolerance; exit 1 on a difference")
    _docs_options(dc)
    tr = sub.add_parser("translate", help="translate sentences with a finished translation run")
    _run_dir(tr)
    _scoring_set(tr, data=False)
    tr.add_argument("sentences", nargs="*", help="sentences to translate; none: one per line from stdin")
    for name, example in COMMAND_EXAMPLES.items():  # each command's help ends with one it runs as written
        sub.choices[name].epilog = f"example: {example}"
        sub.choices[name].formatter_class = argparse.RawDescriptionHelpFormatter
    ap.bench = b  # `harness bench`'s own usage line, for the old spellings' errors
    ap.plan = p  # `harness plan`'s own options: the others are accelerate launch's
    return ap


def _train_options(p: argparse.ArgumentParser) -> None:
    """`harness train`'s options (`harness launch` takes them after the word train)."""
    _common(p)
    p.add_argument("--resume", metavar="auto|DIR", help="auto: continue from the run directory's latest "
                   "checkpoint if there is one; DIR: a run directory or a step_* checkpoint")
    p.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    p.add_argument("--stop-at", type=int, metavar="STEP", help="stop after this step with a checkpoint, as if "
                   "the job's time ran out; continue later with --resume auto")
    p.add_argument("--data-changed-ok", action="store_true", help="resume on data other than the checkpoint's (a "
                   "prepared corpus, or a case study's prepared rows; refused without it: the steps after would read "
                   "other samples)")
    p.add_argument("--trust-checkpoint", action="store_true", help="load checkpoints that hold more than weights "
                   "and the harness's own state (unpickled: they can run code); only for files from a source you "
                   "trust")


def _scoring_set(p: argparse.ArgumentParser, data: bool = True) -> None:
    """`data`: the command takes --data (evaluate), whose file's format and field --set may name (translate: none)."""
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="a setting of how the "
                   "trained model is scored or decoded, for this command only, e.g. translation.beam_size=1 (greedy); "
                   "`harness keys` marks them" + ("; with --data, the lm's data.format and data.text_field for the "
                                                 "file" if data else ""))


def _evaluate_options(p: argparse.ArgumentParser) -> None:
    """`harness evaluate`: a finished run on a split of its data or on new data."""
    _run_dir(p)
    _scoring_set(p)
    p.add_argument("--split", choices=["validation", "test"],
                   help="a split of the run's data (default: test; validation for a task without one, the lm)")
    p.add_argument("--data", metavar="PATH", help="new data instead, in a format the task reads (a file pair by its "
                   "prefix, a directory, a csv, tsv, jsonl or fasta file; the lm: a text, jsonl or csv file, or a "
                   "prepared corpus), read with the run's stored tokenizer and statistics")
    p.add_argument("--name", help="--data: the entry's name in RUN/eval.json (default: PATH's file name)")
    p.add_argument("--periods", type=int, metavar="K", help="price runs: also score K consecutive periods of the "
                   "windows by forecast origin (rolling origin, the model fixed), each with its verdict against "
                   "persistence (sets prices.periods for this evaluation)")


def _docs_options(p: argparse.ArgumentParser) -> None:
    """`harness docs`: which of docs/checks.toml's figures to re-measure."""
    p.add_argument("--quick", action="store_true", help="only the checks of a minute or less (with what they run "
                   "after)")
    p.add_argument("--only", metavar="NAME,...", help="these checks (and those they run after)")
    p.add_argument("--static", action="store_true", help="run nothing: check that every figure is still written in "
                   "its page as docs/checks.toml states it")
    p.add_argument("--list", action="store_true", help="run nothing: list the checks, each with its page, minutes and "
                   "command")


def _plan_options(p: argparse.ArgumentParser) -> None:
    """`harness plan`'s own options (the others it is given are accelerate launch's:
    `launcher.settings.launch_options`)."""
    _common(p)
    p.add_argument("--world-size", type=int, help="processes to plan for (default: $WORLD_SIZE or 1)")
    p.add_argument("--ds-json", action="store_true", help="print only the resolved DeepSpeed config in full (\"auto\" "
                   "filled, the optimizer and DeepSpeed scheduler included), for another tool")
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"],
                   help="accelerate's mixed_precision to check against (default: $ACCELERATE_MIXED_PRECISION or no)")
    p.add_argument("--gpus-per-node", type=int, metavar="G", help="also estimate on paper the memory per GPU, step "
                   "time and speedup of this strategy on G GPUs per node x --nodes (nothing is run)")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes for the scaling estimate (default 1)")
    p.add_argument("--interconnect", default=INTERCONNECT, metavar="[INTRA:]INTER", help="inter-node link preset: "
                   "nvlink4, nvlink3, pcie5, pcie4, ib-ndr400, ib-hdr200, ethernet-100g; INTRA:INTER also sets the "
                   "intra-node link (default nvlink4), e.g. pcie4:ethernet-100g")
    p.add_argument("--profile", metavar="bench.json", help="a `harness bench` result: its one-process step time and "
                   "peak memory replace the 6N-FLOPs and activation formulas")
    p.add_argument("--mfu", type=float, default=MFU, help="model FLOPs utilisation assumed without --profile")


def _evaluate(args) -> int:
    """`harness evaluate` and `harness translate`."""
    from .eval import evaluate

    if args.command == "evaluate" and args.data is not None:
        if args.split:
            raise ConfigError(f"--split {args.split} and --data {args.data}: name one")
        results = evaluate.evaluate_data(args.run_dir, args.data, args.name, args.periods, sets=args.set)
        print("\n\n".join(evaluate.render_table(k, v) for k, v in results.items()))
    elif args.command == "evaluate":
        if args.name:
            raise ConfigError("--name names new data: it goes with --data")
        print(evaluate.render_table(*evaluate.score_run(args.run_dir, args.split, args.periods, sets=args.set)))
    elif args.sentences:
        _out(evaluate.translate(args.run_dir, args.sentences, args.set))
    else:  # a line out for each line in, a blank one for a blank one: the output lines up with its input
        binary = getattr(sys.stdin, "buffer", None)  # bytes, so any locale reads them (a text stream as it is)
        lines = [(line.decode("utf-8", "surrogateescape") if binary else line).strip() for line in binary or sys.stdin]
        if bad := next(((i, why) for i, line in enumerate(lines, 1) if (why := evaluate.undecodable(line))), None):
            raise ConfigError(f"standard input, line {bad[0]}: {bad[1]}")
        said = iter(evaluate.translate(args.run_dir, [line for line in lines if line], args.set))
        _out(next(said) if line else "" for line in lines)
    return 0


def _out(lines: Iterable[str]) -> None:
    """Print translations as they come (Ctrl-C keeps those printed); a reader that left (`harness translate ... |
    head -1`) ends the command with exit 1 and no traceback, nor Python's second error as it flushes stdout at exit
    (its own advice: stdout to devnull)."""
    try:
        for line in lines:
            print(line, flush=True)
    except BrokenPipeError:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        raise SystemExit(1) from None


def _prepare_corpus(args) -> int:
    """`harness prepare lm`: prepare (or continue, or merge) a corpus; one line of what it holds."""
    if args.merge:
        if args.input or args.part:
            raise ConfigError("--merge joins prepared parts: leave out --input and --part")
        from .prepare.corpus import merge

        m = merge(args.merge, args.out)
    else:
        if not args.input:
            raise ConfigError(f"harness prepare {args.task} needs --input PATH... (or --merge DIR...)")
        try:
            from .prepare.corpus import prepare_corpus

            m = prepare_corpus(args.input, args.out, args.workers, args.tokenizer, args.text_field,
                               args.val_fraction, args.seed, args.part, args.on_error)
        except KeyboardInterrupt:
            print(f"\nharness: interrupted: {args.out} keeps the units it finished; the same command continues",
                  file=sys.stderr)
            return 130
    c = m["counts"]
    skipped = ", ".join(f"{n} {k.replace('_', ' ')}" for k, n in c["rows"].items() if k != "ok") or "none skipped"
    held = sum(s["split"] == "validation" for s in m["shards"])
    print(f"prepared {args.out}: train {c['train']['tokens']:,} tokens in {c['train']['documents']:,} documents, "
          f"validation {c['validation']['tokens']:,} tokens in {c['validation']['documents']:,}; {len(m['shards'])} "
          f"shards ({len(m['shards']) - held} train, {held} validation; {m['dtype']}); rows {skipped}")
    if not c["validation"]["documents"] and (args.merge or args.val_fraction):
        print("note: no document was held out for validation (whole documents are): a run on it evaluates nothing; "
              "prepare more documents, a larger --val-fraction, or a validation corpus apart (data.val_path)")
    return 0


def _prepare(args) -> int:
    if getattr(args, "out", None):  # a file, or under one, or a folder it cannot write in: one line, not a traceback
        from .run.directory import check_writable

        check_writable(Path(args.out), f"--out {args.out}")
    if getattr(args, "release", None):  # a benchmark set from its authors' release
        from .prepare.benchmarks import from_release

        if args.data or args.run or args.set or getattr(args, "input", None):
            raise ConfigError(f"harness prepare {args.task}: --from (a benchmark's release) or --data/--run/--set/"
                              f"--input, not both")
        for path in from_release(args.task, args.release, args.out or RECIPES_READ):
            print(f"wrote {path}")
        return 0
    corpus = args.task == "lm" or bool(getattr(args, "input", None) or getattr(args, "merge", None))
    if corpus and args.task == "protein":
        if args.data or args.run or args.set:
            raise ConfigError("harness prepare protein: --input (a corpus of sequences) or --data/--run/--set (the "
                              "case study's data), not both")
        if not args.out:
            raise ConfigError("harness prepare protein --input needs --out DIR")
        from .prepare.tokenizers import RESIDUES

        args.tokenizer = RESIDUES
    elif getattr(args, "out", None) and args.task != "lm":
        sequences = " or --input (a corpus of sequences)" if args.task == "protein" else ""
        raise ConfigError(f"harness prepare {args.task}: --out goes with --from (a benchmark set){sequences}; the "
                          f"case study's data is prepared into the cache")
    if corpus:
        return _prepare_corpus(args)
    from .config.run import read_toml
    from .prepare import read_meta, summary
    from .tasks import get_task, resolve

    if args.run:
        task_in_file = read_toml(args.run).get("run", {}).get("task", "lm")
        if task_in_file != args.task:
            raise ConfigError(f"{args.run} is a run file for task {task_in_file!r}, not {args.task!r}")
    sets = [f"run.task={json.dumps(args.task)}", *args.set]
    if args.data is not None:
        sets.append(f"data.path={json.dumps(args.data)}")
    cfg = resolve(args.run, sets).cfg
    task = get_task(args.task)
    task.check(cfg)
    directory = task.prepare(cfg)
    print(f"prepared {directory}\n{summary(read_meta(directory)).line()}")
    return 0


def _bench(args) -> int:
    """`harness bench STUDY`: exit 1 when a measurement failed (its results are written all the same)."""
    for name in ("out", "work", "run", "data"):  # the runs start in the repository: paths are the caller's
        if getattr(args, name, None):
            setattr(args, name, str(Path(getattr(args, name)).resolve()))
    for name in ("rounds", "repeats", "steps", "timeout", "threads"):
        if isinstance(getattr(args, name, None), int) and getattr(args, name) < 1:
            raise ConfigError(f"--{name} {getattr(args, name)}: must be 1 or more")
    if getattr(args, "warmup", None) is not None and args.warmup < 0:  # it timed the cold first step
        raise ConfigError(f"--warmup {args.warmup}: must be 0 or more")
    for name in ("largest_max", "memory_budget_gb"):  # a search within nothing had reported 0 parameters
        if getattr(args, name, None) is not None and getattr(args, name) <= 0:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)}: must be above 0")
    for name in ("out", "work"):  # a file where the report's directory goes: refused before any measurement
        path = getattr(args, name, None)
        if path and Path(path).exists() and not Path(path).is_dir():
            raise ConfigError(f"--{name} {path}: a file; name a directory for the report")
    if args.study == "proxy":
        from .bench.proxy import run_proxy

        return 1 if run_proxy(args)["failed"] else 0
    if args.study == "corpus":
        from .bench.corpus import SIZES, run_corpus

        bad = [s for s in args.sizes.split(",") if s.strip() not in SIZES]
        if bad:
            raise ConfigError(f"--sizes: {', '.join(bad)} is none of {', '.join(SIZES)}")
        run_corpus(args)
        return 0
    if args.study == "seeds":
        from .bench.seeds import run_seeds

        args.out = args.out or "bench/seeds"
        return 1 if sum(e["failed"] for e in run_seeds(args)["configs"]) else 0
    if args.study == "suite":
        from .bench.suite import run_suite

        args.steps = (3 if args.smoke else 20) if args.steps is None else args.steps
        args.warmup = (2 if args.smoke else 5) if args.warmup is None else args.warmup
        failed = run_suite(args)["failures"]
        if failed:
            print(f"harness: error: {len(failed)} of the suite's measurements failed: {'; '.join(failed)}",
                  file=sys.stderr)
        return 1 if failed else 0
    from .bench.overhead import run_overhead
    from .bench.sweep import run_bench

    args.out = args.out or "bench"
    result = (run_overhead if args.study == "overhead" else run_bench)(args)
    failed = [e.get("name", "?") for e in result["configs"] if e.get("status") in ("failed", "timeout")]
    if failed:  # an out-of-memory row is a finding of the sweep; a failed or timed-out one is not a measurement
        print(f"harness: error: {len(failed)} of {len(result['configs'])} configurations failed or timed out "
              f"({', '.join(failed)}): see their rows and logs in {args.out}", file=sys.stderr)
    return 1 if failed else 0


def _plan(args) -> int:
    """`harness plan`: the resolved plan, or the DeepSpeed JSON alone, and a scaling estimate on paper."""
    from .plan.render import count_params, ds_json, render
    from .plan.resolve import make_plan

    if args.world_size is not None and args.world_size < 1:
        raise ConfigError(f"--world-size {args.world_size}: must be 1 or more (the processes in all)")
    estimate_flags = [f for f, given in (("--nodes", args.nodes != 1), ("--interconnect", args.interconnect !=
                      INTERCONNECT), ("--profile", args.profile), ("--mfu", args.mfu != MFU)) if given]
    if args.gpus_per_node is None and estimate_flags:  # they had been dropped, a missing profile file too
        raise ConfigError(f"{', '.join(estimate_flags)}: settings of the estimate on paper, which --gpus-per-node G "
                          f"asks for")
    if args.gpus_per_node is not None:
        if args.ds_json:
            raise ConfigError("--gpus-per-node estimates a launch on paper; --ds-json prints the DeepSpeed config alone")
        if args.gpus_per_node < 1 or args.nodes < 1:
            raise ConfigError(f"--gpus-per-node {args.gpus_per_node} and --nodes {args.nodes}: must be 1 or more")
        from .plan.scaling import parse_interconnect

        parse_interconnect(args.interconnect)  # bad estimate settings: one line before the plan, not after it
        if not 0 < args.mfu <= 1:
            raise ConfigError(f"--mfu {args.mfu}: a fraction in (0, 1]")
        if args.profile and not Path(args.profile).is_file():
            raise ConfigError(f"--profile {args.profile}: no such file (a `harness bench` bench.json)")
        world = args.gpus_per_node * args.nodes
        if args.world_size not in (None, world):
            raise ConfigError(f"--world-size {args.world_size} and --gpus-per-node {args.gpus_per_node} x --nodes "
                              f"{args.nodes} = {world}: one world; name it once")
        if not args.launch:  # the plan is of the world the estimate is of
            args.world_size = world
    if args.launch:  # accelerate launch's options: the world and settings that launch gives
        from .launcher.command import plan_launch
        from .launcher.settings import launch_settings

        if args.world_size or args.mixed_precision:
            raise ConfigError("harness plan: --world-size and --mixed-precision, or accelerate launch's options "
                              f"({' '.join(args.launch)}), not both")
        plan = plan_launch(args.run, args.set, args.ds, launch_settings(args.launch, "harness plan"))
    else:
        plan = make_plan(args.run, args.set, args.ds, args.world_size, args.mixed_precision)
    print(ds_json(plan) if args.ds_json else render(plan))
    if not args.launch and not args.world_size and plan.ds.layout.world_size == 1 and not args.ds_json:
        print("(planned for 1 process: `harness plan` takes what `harness launch` takes before `train`, e.g. "
              "--config_file launch/cpu_2proc.yaml or --num_processes 4, and plans that launch's world)")
    if args.gpus_per_node is not None and not args.ds_json:
        from .plan.scaling import render_scaling

        print("\n" + "\n".join(render_scaling(plan, count_params(plan), args.gpus_per_node, args.nodes,
                                              args.interconnect, args.profile, args.mfu)))
    return 0


def _keys(args) -> int:
    from .plan.render import render_keys

    print(render_keys())
    return 0


def _docs(args) -> int:
    from .docs import main as docs

    return docs(args.only, args.quick, args.static, args.list)


def _results(args) -> int:
    from .bench.results import main as results

    return results(args.check)


def _export(args) -> int:
    from .run.export import export_hf

    with trusting(task=args.task, run_dir=args.trust_run_dir):
        print(f"wrote {export_hf(args.run_dir, args.hf, args.overwrite)}")
    return 0


def _plot(args) -> int:
    from .run.plots import default_out, plot, summary

    print(f"wrote {plot(args.run_dirs, args.out or default_out(args.run_dirs), args.x)}")
    print(summary(args.run_dirs))
    return 0


def _trusted_evaluate(args) -> int:
    with trusting(task=args.task, run_dir=args.trust_run_dir):
        return _evaluate(args)


def _train(args) -> int:
    from .api import train
    from .run.preemption import stop_if_signalled

    stop_if_signalled()
    if args.stop_at is not None and args.stop_at <= 0:
        raise ConfigError(f"--stop-at must be a positive step, got {args.stop_at}")
    train(args.run, args.set, args.ds, resume=args.resume, overwrite=args.overwrite, stop_at=args.stop_at,
          trust_checkpoint=args.trust_checkpoint, data_changed_ok=args.data_changed_ok)
    return 0


COMMANDS = {"keys": _keys, "prepare": _prepare, "docs": _docs, "bench": _bench, "results": _results,
            "export": _export, "plot": _plot, "evaluate": _trusted_evaluate, "translate": _trusted_evaluate,
            "plan": _plan, "train": _train}


def _parse(argv: list[str]) -> argparse.Namespace:
    """The subcommand's arguments; `plan` first takes accelerate launch's options as `harness launch` does."""
    ap, launch = parser(), []
    if argv[:1] == ["plan"]:
        from .launcher.settings import launch_options

        own = {o for a in ap.plan._actions for o in a.option_strings}
        launch, rest = launch_options(argv[1:], own)
        argv = ["plan", *rest]
    if argv[:1] == ["bench"]:
        argv = _old_bench(argv, ap.bench)
    args, extra = ap.parse_known_args(argv)
    if extra:  # a bench study's usage line names its own flags
        spaced = [s for s in getattr(args, "set", None) or [] if "=" not in s and not s.startswith(UNSET_PREFIX)]
        value = next((argv[i + 2] for i, a in enumerate(argv[:-2]) if a == "--set" and argv[i + 1] == spaced[0]
                      and argv[i + 2] in extra), None) if spaced else None  # the word after the key
        hint = f" (--set takes KEY=VALUE as one word: --set {spaced[0]}={value})" if value is not None else ""
        getattr(args, "command_parser", ap).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    args.launch = launch
    args.argv = argv  # recorded by the suite with its results
    return args


def main(argv: list[str] | None = None) -> int:
    # DeepSpeed's launch.py puts --local_rank=N first unless its runner was given --no_local_rank (accelerate gives it
    # for pdsh and the MPI launchers, not for nossh); it sets LOCAL_RANK too, which the rank reads, as under torchrun
    argv = [a for a in (sys.argv[1:] if argv is None else argv) if not a.startswith("--local_rank=")]
    quiet_deepspeed()
    if argv[:1] == ["launch"] and not {"-h", "--help"} & set(argv[1:2]):  # accelerate's options are not ours to parse
        from .launcher.command import main as launch

        try:
            return launch(argv[1:], _parse)
        except ConfigError as e:
            print(f"harness: error: {e}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:  # not while the job runs: it passes Ctrl-C on to the ranks then
            print("\nharness: interrupted", file=sys.stderr)
            return 130
    args = _parse(argv)
    is_main = launched_rank() == 0
    try:
        return COMMANDS[args.command](args)
    except KeyboardInterrupt:  # (training takes Ctrl-C itself: a checkpoint, then exit 75)
        print("harness: interrupted", file=sys.stderr)
        return 130
    except (ConfigError, TrainingStopped, Preempted, RankHung) as e:
        from .distributed.world import under_launcher
        from .launcher.supervise import report
        from .run.preemption import EXIT_PREEMPTED

        code = 2 if isinstance(e, ConfigError) else 3 if isinstance(e, TrainingStopped) else \
            EXIT_HUNG if isinstance(e, RankHung) else EXIT_PREEMPTED
        if is_main and not under_launcher():  # `harness launch` prints it once for the whole job
            print(f"harness: {'' if code == EXIT_PREEMPTED else 'error: '}{e}", file=sys.stderr)
        return report(code, str(e))


if __name__ == "__main__":
    sys.exit(main())
