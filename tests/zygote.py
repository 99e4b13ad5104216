"""A warm start for the single-process `python -m harness ...` commands the tests run (conftest.cli).

Every such command spends most of its few seconds importing torch, DeepSpeed, accelerate and datasets; this process
imports them once and forks a child per command, which runs `harness.cli.main` with the command's arguments, output
files and extra environment, and exits through the interpreter as `python -m harness` would (atexit handlers and
all). Multi-process runs never come here: they start through `accelerate launch` like a user's.

Protocol, one JSON line each way on stdin and stdout: {"argv", "stdout", "stderr", "env"} in; {"pid"} once forked,
{"rc"} once it ended (a negative rc: killed by that signal, as subprocess reports it).
"""
import gc
import json
import os
import sys

sys.path[0] = os.getcwd()  # the repository, first on the path as under `python -m harness` started there
ANSWERS = os.fdopen(os.dup(1), "w")  # the protocol's channel: what the imports below print goes to stderr instead
os.dup2(2, 1)
from harness.distributed.world import quiet_deepspeed  # noqa: E402

quiet_deepspeed()  # before DeepSpeed picks its accelerator, as `harness` does
import accelerate  # noqa: E402,F401
import datasets  # noqa: E402,F401
import deepspeed  # noqa: E402,F401
import torch._dynamo  # noqa: E402,F401  (torch.optim's first call imports it in every run)

import harness.api  # noqa: E402,F401
import harness.run.checkpoint  # noqa: E402,F401
import harness.cli  # noqa: E402,F401
import harness.eval.evaluate  # noqa: E402,F401
import harness.run.export  # noqa: E402,F401
import harness.run.loop  # noqa: E402,F401
import harness.distributed.parallel  # noqa: E402,F401
import harness.tasks  # noqa: E402,F401


def child(request: dict) -> None:
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, name in ((1, "stdout"), (2, "stderr")):
        os.dup2(os.open(request[name], os.O_WRONLY | os.O_CREAT | os.O_TRUNC), fd)
    for key, value in request["env"].items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    sys.argv = [os.path.join(os.path.dirname(harness.cli.__file__), "__main__.py"), *request["argv"]]
    sys.exit(harness.cli.main(request["argv"]))


def serve() -> None:
    gc.freeze()  # the imported modules stay shared with the children instead of being copied as gc touches them
    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            ANSWERS.close()
            child(request)
        print(json.dumps({"pid": pid}), file=ANSWERS, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"rc": os.waitstatus_to_exitcode(status)}), file=ANSWERS, flush=True)


if __name__ == "__main__":
    serve()
