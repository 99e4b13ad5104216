"""`harness launch`: check a training run before any process starts, then `accelerate launch` it, and exit with the
harness's own codes (0 done, 2 bad input, 3 non-finite stop, 4 a rank stopped answering, 75 stopped by a signal
with a checkpoint).

    harness launch --config_file launch/cpu_2proc.yaml train --run RUN.toml --ds configs/ds/zero2.json

Everything before `train` is `accelerate launch`'s, passed on as given; everything from `train` on is
`harness train`'s. Why a front end: under a bare `accelerate launch` every rank starts before a bad value is
found, and torchrun reports any non-zero rank as its multi-line ChildFailedError and exits 1, so a scheduler
script cannot tell bad input from a crash from a preemption.

The command (`command.py`, `main`) checks the launch before any rank starts, on accelerate's settings as accelerate
reads them (`settings.py`); starts the job, passes signals on to its ranks and hears how they ended (`supervise.py`);
relays the job's stderr and keeps it in `RUN/launch.log` (`relay.py`); and says how the job ended in one line
(`ending.py`).

May import: everything below it (bench, eval, run, plan, tasks, ...); never the command line, nor its siblings
`harness.api` and `harness.docs`.
"""
# The entry points the command line calls: `harness launch` (`main`), a rank's report of how it ended (`report`),
# and `harness plan`'s reading of accelerate's options (`launch_options`, `launch_settings`, `plan_launch`)
from .command import main, plan_launch
from .settings import launch_options, launch_settings
from .supervise import report

__all__ = ["launch_options", "launch_settings", "main", "plan_launch", "report"]
