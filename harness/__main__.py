import sys

if sys.argv[1:2] == ["train"]:  # before torch's import: a scheduler's signal while a rank starts (preemption.py)
    from .run.preemption import starting

    starting()

from .cli import main  # noqa: E402

sys.exit(main())
