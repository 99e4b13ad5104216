"""The `harness` command: train, plan, keys. Input errors print one line and exit 2 before any training."""
from __future__ import annotations

import argparse
import sys

from .config import ConfigError
from .world import launched_rank, quiet_deepspeed


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--run", metavar="RUN.toml", help="run file (TOML); values not given take their defaults")
    p.add_argument("--ds", metavar="DS.json", help="DeepSpeed config; default: ZeRO-0 (plain data parallel), fp32")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override one run-config value (TOML literal); repeatable; wins over the run file")


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="harness", description="Train Transformers with DeepSpeed strategies "
                                 "chosen by a JSON file; launch with `accelerate launch -m harness train ...`.")
    sub = ap.add_subparsers(dest="command", required=True)
    t = sub.add_parser("train", help="train a run")
    _common(t)
    t.add_argument("--resume", metavar="auto|DIR", help="auto: continue from the run directory's latest "
                   "checkpoint if there is one; DIR: a run directory or a step_* checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing run directory")
    t.add_argument("--stop-at", type=int, metavar="STEP", help="stop after this step with a checkpoint, as if "
                   "the job's time ran out; continue later with --resume auto")
    p = sub.add_parser("plan", help="resolve and check everything, print it with its sources, train nothing")
    _common(p)
    p.add_argument("--world-size", type=int, help="processes to plan for (default: $WORLD_SIZE or 1)")
    p.add_argument("--mixed-precision", choices=["no", "fp16", "bf16"],
                   help="accelerate's mixed_precision to check against (default: $ACCELERATE_MIXED_PRECISION or no)")
    sub.add_parser("keys", help="list every run-config key with its default and meaning")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    quiet_deepspeed()
    is_main = launched_rank() == 0
    try:
        if args.command == "keys":
            from .plan import render_keys

            print(render_keys())
            return 0
        from .startup import make_plan

        if args.command == "plan":
            from .plan import render

            plan = make_plan(args.run, args.set, args.ds, args.world_size, args.mixed_precision)
            print(render(plan))
            return 0
        plan = make_plan(args.run, args.set, args.ds)
        from .startup import preflight

        resume_from = preflight(plan, args.resume, args.overwrite)
        if args.stop_at is not None and args.stop_at <= 0:
            raise ConfigError(f"--stop-at must be a positive step, got {args.stop_at}")
    except ConfigError as e:
        if is_main:
            print(f"harness: error: {e}", file=sys.stderr)
        return 2
    from .train import TrainingStopped, train
    from .world import barrier, init_world

    world = init_world()
    try:
        train(plan, world, resume_from, args.overwrite, args.stop_at)
        barrier()  # every rank is done before any tears down its connections
    except (ConfigError, TrainingStopped) as e:
        if world.is_main:
            print(f"harness: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, ConfigError) else 3
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
