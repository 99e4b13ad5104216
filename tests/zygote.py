"""A fork server for the tests: warm Python processes for `python -m harness ...`, `accelerate launch` and the ranks
torchrun starts.

Every cold interpreter the suite starts spends 3-5 s of CPU importing torch, DeepSpeed, accelerate and datasets.
This process imports them once and forks a child for each request from `tests/zygote_client.py`, a stdlib-only
stand-in for `python` (torchrun's PYTHON_EXEC, or the first word of a test's command). The client passes its argv,
cwd, environment and stdin/stdout/stderr; the child takes them over and runs the program as `python ARGV` would
(`-m module`, a script or `-c code`), exiting through the interpreter (atexit handlers, non-daemon threads, an uncaught
traceback on stderr). A child dies with its client (the server kills it when the client's connection closes) and with
the server (PR_SET_PDEATHSIG); the server dies with the test worker that started it (the same, and stdin's end).

Usage: zygote.py SOCKET_NAME  (an abstract Unix socket). One line on stdout, "ready ENV" (JSON: the environment the
imports left, and the keys they set) or "refused: WHY", then nothing.
Refused where fork is unsafe: threads running, a CUDA context present, or another multiprocessing start method forced.
Protocol: the client sends one JSON line {"argv", "cwd", "env"} with its fds 0-2; the server answers {"pid"} once
forked, {"rc"} once the child ended (a negative rc: killed by that signal, as subprocess reports it), or {"cold": WHY}
where it does not run such a command line (the client then starts the real interpreter).
"""
import ctypes
import gc
import io
import json
import os
import select
import signal
import socket
import struct
import sys
import threading

PR_SET_PDEATHSIG = 1
# Native threads whose library makes fork safe itself (pthread_atfork): pyarrow's jemalloc, started by `datasets`.
FORK_SAFE_THREADS = ("jemalloc_bg_thd",)
LIBC = ctypes.CDLL(None, use_errno=True)


def die_with_parent(parent: int) -> None:
    LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent:  # the parent died before the call: nothing would tell us
        os._exit(1)


def preload() -> str | None:
    """Import what every harness process imports; why fork is unsafe here, or None."""
    sys.path[0] = os.getcwd()  # the repository, first on the path as under `python -m harness` started there
    from harness.distributed.world import quiet_deepspeed

    quiet_deepspeed()  # before DeepSpeed picks its accelerator, as `harness` does
    import multiprocessing

    import accelerate.commands.launch  # noqa: F401
    import datasets  # noqa: F401
    import deepspeed  # noqa: F401
    import torch
    import torch._dynamo  # noqa: F401  (torch.optim's first call imports it in every run)
    import torch.distributed.run  # noqa: F401

    import harness.api  # noqa: F401
    import harness.cli  # noqa: F401
    import harness.distributed.parallel  # noqa: F401
    import harness.eval.evaluate  # noqa: F401
    import harness.run.checkpoint  # noqa: F401
    import harness.run.export  # noqa: F401
    import harness.run.loop  # noqa: F401
    import harness.tasks  # noqa: F401

    try:
        os.close(os.pidfd_open(os.getpid()))
    except (AttributeError, OSError):
        return "no pidfd_open here (Linux 5.3 and Python 3.9 or later): the server could not watch its children"
    method = multiprocessing.get_start_method(allow_none=True)
    if method not in (None, "fork"):
        return f"the multiprocessing start method is forced to {method!r}"
    if torch.cuda.is_initialized():
        return "a CUDA context is present (a forked child cannot use it)"
    others = [open(f"/proc/self/task/{t}/comm").read().strip() for t in os.listdir("/proc/self/task")
              if int(t) != os.getpid()]
    unsafe = [name for name in others if name not in FORK_SAFE_THREADS] + (["Python"] * (threading.active_count() - 1))
    if unsafe:
        return f"threads are running ({', '.join(unsafe)}): a fork copies one, and any lock another held"
    return None


def resident_file_pages() -> list[tuple[int, int]]:
    """The pages of file mappings (shared libraries, mostly) resident in this process, as (address, count) runs.
    fork copies no page-table entries for file mappings, so a child's resident set lacks them until it touches them
    again: without `touch`, a warm process would measure a smaller peak resident set than a cold one."""
    page = os.sysconf("SC_PAGE_SIZE")
    runs = []
    with open("/proc/self/maps") as maps, open("/proc/self/pagemap", "rb") as pagemap:
        for line in maps:
            fields = line.split()
            if len(fields) < 6 or not fields[5].startswith("/") or not fields[1].startswith("r"):
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            pagemap.seek(start // page * 8)
            entries = struct.unpack(f"{(end - start) // page}Q", pagemap.read((end - start) // page * 8))
            for i, entry in enumerate(entries):
                if entry >> 63:  # present
                    if runs and runs[-1][0] + runs[-1][1] * page == start + i * page:
                        runs[-1] = (runs[-1][0], runs[-1][1] + 1)
                    else:
                        runs.append((start + i * page, 1))
    return runs


def touch(runs: list[tuple[int, int]]) -> None:
    page = os.sysconf("SC_PAGE_SIZE")
    for address, count in runs:
        for i in range(count):
            ctypes.c_char.from_address(address + i * page).value  # noqa: B018  (the read maps the page)


def parse(argv: list[str]) -> tuple[str, str, list[str]]:
    """`python ARGV` as (kind, target, sys.argv): kind is "module", "path" or "code"."""
    i = 0
    while i < len(argv) and argv[i] in ("-u", "-B", "-s", "-E", "-I"):
        i += 1
    rest = argv[i:]
    if rest[:1] == ["-m"] and len(rest) > 1:
        return "module", rest[1], [rest[1], *rest[2:]]  # runpy puts the module's path in argv[0]
    if rest[:1] == ["-c"] and len(rest) > 1:
        return "code", rest[1], ["-c", *rest[2:]]
    if rest and not rest[0].startswith("-"):
        return "path", rest[0], rest
    raise ValueError(f"the warm python runs `-m MODULE`, `-c CODE` or a script, not {argv}")


def child(request: dict, fds: list[int]) -> None:
    """In the forked child: become the client's process, then run its program (never returns)."""
    import runpy

    for sig in (signal.SIGTERM, signal.SIGCHLD, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    for target, fd in enumerate(fds):
        os.dup2(fd, target)
        os.close(fd)
    unbuffered = "-u" in request["argv"][:3] or request["env"].get("PYTHONUNBUFFERED")
    sys.stdin = open(0, "r", closefd=False)
    sys.stdout = stream(1, unbuffered=bool(unbuffered))
    sys.stderr = stream(2, unbuffered=True)  # stderr is always line-buffered, at least
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    kind, target, argv = parse(request["argv"])  # checked by the server before it forked
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[0:1] = [os.path.dirname(os.path.abspath(target)) if kind == "path" else request["cwd"], *extra]
    sys.argv = argv
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():
        import torch

        torch.set_num_threads(int(threads))
    log_start(request)
    touch(FILE_PAGES)
    if kind == "module":
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    elif kind == "path":
        runpy.run_path(target, run_name="__main__")
    else:
        exec(compile(target, "<string>", "exec"), {"__name__": "__main__"})
    sys.exit(0)


def stream(fd: int, unbuffered: bool) -> io.TextIOWrapper:
    """sys.stdout or sys.stderr on `fd` as a fresh interpreter makes it (-u / PYTHONUNBUFFERED: written through)."""
    raw = open(fd, "wb", buffering=0 if unbuffered else -1, closefd=False)
    return io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace" if fd == 2 else "strict",
                            line_buffering=os.isatty(fd) or fd == 2, write_through=unbuffered)


def log_start(request: dict) -> None:
    """With HARNESS_TEST_LAUNCHES set, this process's line in the launch log (tests/launchlog)."""
    if os.environ.get("HARNESS_TEST_LAUNCHES"):
        sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "launchlog"))
        import launches

        launches.record("warm", request["argv"], client=request["client"])
        del sys.path[0]


class Server:
    def __init__(self, name: str):
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind("\0" + name)
        self.listener.listen(64)
        self.clients: dict[int, tuple[socket.socket, int, int]] = {}  # conn fd -> (conn, child pid, pidfd)

    def serve(self) -> None:
        while True:
            watched = [self.listener, sys.stdin, *(c for c, _, _ in self.clients.values()),
                       *(p for _, _, p in self.clients.values())]
            ready = select.select(watched, [], [])[0]
            if sys.stdin in ready and not os.read(sys.stdin.fileno(), 4096):
                return  # the test worker closed us, or died
            if self.listener in ready:
                self.accept()
            for conn, pid, pidfd in list(self.clients.values()):
                if pidfd in ready:
                    self.reap(conn, pid, pidfd)
                elif conn in ready and not conn.recv(1, socket.MSG_PEEK):
                    os.kill(pid, signal.SIGKILL)  # the client is gone: its child goes with it
                    self.reap(conn, pid, pidfd)

    def accept(self) -> None:
        conn, _ = self.listener.accept()
        request, fds = self.receive(conn)
        try:
            parse(request["argv"]) if request else None
        except ValueError as e:  # the client starts the real interpreter instead
            conn.sendall(json.dumps({"cold": str(e)}).encode() + b"\n")
            request = None
        if request is None:
            conn.close()
            for fd in fds:
                os.close(fd)
            return
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            self.listener.close()
            for other, _, pidfd in self.clients.values():
                other.close()
                os.close(pidfd)
            conn.close()
            die_with_parent(SERVER)
            child(request, fds)
        for fd in fds:
            os.close(fd)
        self.clients[conn.fileno()] = (conn, pid, os.pidfd_open(pid))
        try:
            conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")
        except OSError:  # the client is gone already: its child goes with it
            os.kill(pid, signal.SIGKILL)
            self.reap(conn, pid, self.clients[conn.fileno()][2])

    @staticmethod
    def receive(conn: socket.socket) -> tuple[dict | None, list[int]]:
        """The client's request and its three fds; None where it went away before sending them whole."""
        msg, fds, _, _ = socket.recv_fds(conn, 1 << 20, 3)
        while msg and not msg.endswith(b"\n"):
            more = conn.recv(1 << 20)
            msg = msg + more if more else b""
        if not msg or len(fds) != 3:
            return None, fds
        request = json.loads(msg)
        request["client"] = struct.unpack("3i", conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12))[0]
        return request, fds

    def reap(self, conn: socket.socket, pid: int, pidfd: int) -> None:
        _, status = os.waitpid(pid, 0)
        try:
            conn.sendall(json.dumps({"rc": os.waitstatus_to_exitcode(status)}).encode() + b"\n")
        except OSError:  # the client is gone
            pass
        del self.clients[conn.fileno()]
        conn.close()
        os.close(pidfd)

    def close(self) -> None:
        for conn, pid, pidfd in list(self.clients.values()):
            os.kill(pid, signal.SIGKILL)
            self.reap(conn, pid, pidfd)


SERVER = os.getpid()
FILE_PAGES: list[tuple[int, int]] = []

if __name__ == "__main__":
    die_with_parent(int(os.environ.get("HARNESS_ZYGOTE_PARENT", os.getppid())))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the children itself; the server ends with its worker
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the answer
    before = dict(os.environ)
    why = preload()
    if why is None:
        FILE_PAGES = resident_file_pages()
        server = Server(sys.argv[1])
        gc.freeze()  # the imported modules stay shared with the children instead of being copied as gc touches them
    # ready: the environment the children are forked with, and what the imports set in it themselves (a cold start
    # of a client that lacks those sets them just the same)
    env = {"env": dict(os.environ), "set": sorted(k for k in os.environ if k not in before)}
    print(f"refused: {why}" if why else f"ready {json.dumps(env)}", file=answers, flush=True)
    if why is None:
        try:
            server.serve()
        finally:
            if os.getpid() == SERVER:
                server.close()
