"""`python ARGS`, run warm by the tests' fork server (tests/zygote.py): stdlib only, so it starts in milliseconds.

Started as torchrun's PYTHON_EXEC (each rank) or as the first word of a test's command. It hands its argv, cwd,
environment and stdin/stdout/stderr to the server, forwards the signals it gets to the forked child, and ends as the
child ended: the same exit code, or killed by the same signal. Killed itself (SIGKILL), its child is killed by the
server. Where the server cannot be reached, or the environment differs from the server's in what is read at import
time, it runs the real interpreter instead (HARNESS_ZYGOTE_PYTHON), cold.
"""
import json
import os
import signal
import socket
import sys

# Read by torch, DeepSpeed, accelerate, datasets or Python when they are imported, so a child forked from a server
# whose environment differs in them would not be the process a cold start makes. The rest (the torchrun's RANK and
# friends, HARNESS_*, OMP_NUM_THREADS: set again in the child) is read when the program runs.
IMPORT_TIME = ("DS_", "DEEPSPEED_", "TORCH_", "PYTORCH_", "CUDA_", "HF_", "TRANSFORMERS_", "DATASETS_", "PYTHON",
               "LD_", "MALLOC_", "KMP_", "MKL_", "TORCHINDUCTOR_", "TRITON_", "CXX", "CC")  # the compilers: inductor's
# KMP_DUPLICATE_LIB_OK (set by sklearn when imported) is read when a second OpenMP runtime loads: in a warm child as
# in a cold one, at that import.
RUN_TIME = ("PYTHONUNBUFFERED", "PYTHONPATH", "PYTHON_EXEC", "TORCHELASTIC_", "TORCH_NCCL_", "CUDA_VISIBLE_DEVICES",
            "CUDA_DEVICE_MAX_CONNECTIONS", "TORCH_EXTENSIONS_DIR", "TORCHINDUCTOR_CACHE_DIR", "KMP_DUPLICATE_LIB_OK")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT,
             signal.SIGCONT)


def import_time(env: dict) -> dict:
    return {k: v for k, v in env.items() if k.startswith(IMPORT_TIME) and not k.startswith(RUN_TIME)}


def differs(env: dict, server: dict) -> list[str]:
    """The import-time keys where `env` is not what the server's children have: `server` holds the server's
    environment after its imports ("env") and the keys those imports set themselves ("set"), which a cold start of
    a process that lacks them sets just the same."""
    mine, theirs = import_time(env), server.get("env", {})
    return sorted(k for k in set(mine) | set(theirs)
                  if mine.get(k) != theirs.get(k) and not (k not in mine and k in server.get("set", ())))


def cold(why: str) -> None:
    python = os.environ["HARNESS_ZYGOTE_PYTHON"]
    if os.environ.get("HARNESS_TEST_LAUNCHES"):  # the reason, beside this process's line in the launch log
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "launchlog"))
        import launches

        launches.write({"pid": os.getpid(), "fallback": why})
    os.execv(python, [python, *sys.argv[1:]])


def main() -> None:
    env = dict(os.environ)
    server_env = json.loads(env.get("HARNESS_ZYGOTE_ENV", "{}"))
    changed = differs(env, server_env)
    if changed:
        cold("the environment differs in " + ", ".join(changed))
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.connect("\0" + env["HARNESS_ZYGOTE"])
    except (KeyError, OSError) as e:
        cold(f"no fork server: {e}")
    request = json.dumps({"argv": sys.argv[1:], "cwd": os.getcwd(), "env": env}).encode() + b"\n"
    socket.send_fds(conn, [request], [0, 1, 2])
    answers = conn.makefile("r")
    answer = json.loads(answers.readline())
    if "cold" in answer:
        cold(answer["cold"])
    pid = answer["pid"]
    for sig in FORWARDED:
        signal.signal(sig, lambda s, _: os.kill(pid, s))
    while True:
        try:
            line = answers.readline()
            break
        except InterruptedError:
            continue
    if not line:
        sys.exit("zygote_client: the fork server went away")
    rc = json.loads(line)["rc"]
    if rc < 0:  # killed by a signal: end the same way, so whoever waits on this process sees it so
        signal.signal(-rc, signal.SIG_DFL)
        os.kill(os.getpid(), -rc)
    sys.exit(rc)


if __name__ == "__main__":
    main()
