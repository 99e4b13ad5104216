"""Where the suite's time goes: with HARNESS_TEST_LAUNCHES=FILE, each Python process the tests start appends a line
to FILE as it starts (cold: a fresh interpreter, from sitecustomize; warm: forked by tests/zygote.py) and another as it
ends, and `summary` turns the lines into launches (a process a test started, with all the processes below it) per test
file: command, wall time, cold interpreters and warm forks.

Started from a file, `python tests/launchlog/launches.py FILE` prints the summary of a finished run again."""
from __future__ import annotations

import atexit
import json
import os
import sys
import time
from collections import defaultdict


def write(line: dict) -> None:
    fd = os.open(os.environ["HARNESS_TEST_LAUNCHES"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(line) + "\n").encode())  # one write: lines of several processes never interleave
    finally:
        os.close(fd)


def _ancestors(pid: int) -> list[int]:
    chain = []
    while pid > 1:
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            break
        chain.append(pid)
    return chain


def record(kind: str, argv: list[str] | None, client: int | None = None) -> None:
    """This process starts: `client` is the warm_python process a warm one stands in for (its logical parent)."""
    if argv is None:
        with open("/proc/self/cmdline", "rb") as f:
            argv = [a.decode(errors="replace") for a in f.read().split(b"\0")[1:] if a]
    ancestors = [client, *_ancestors(client)] if client else _ancestors(os.getpid())
    pid = os.getpid()
    write({"pid": pid, "kind": kind, "argv": argv, "ancestors": ancestors, "start": time.time(),
            "test": os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]})
    atexit.register(lambda: os.getpid() == pid and write({"pid": pid, "end": time.time()}))


def summary(path: str, workers: set[int] | None = None) -> list[str]:
    """Per test file: launches, their wall seconds, cold interpreters, warm forks; then the 15 longest launches."""
    procs: dict[int, dict] = {}
    with open(path) as f:
        for line in f:
            item = json.loads(line)
            procs.setdefault(item["pid"], {}).update(item)
    launches: dict[int, dict] = {}
    for pid, p in procs.items():
        if "kind" not in p:
            continue
        logged = [a for a in p["ancestors"] if a in procs and "kind" in procs[a]]
        root = logged[-1] if logged else pid  # the outermost logged process: the one a test started
        launch = launches.setdefault(root, {"cold": 0, "warm": 0, "end": 0.0})
        launch[p["kind"]] += 1
        launch["end"] = max(launch["end"], p.get("end", p["start"]))
    files: dict[str, list] = defaultdict(list)
    rows = []
    for root, launch in launches.items():
        p = procs[root]
        wall = p.get("end", launch["end"]) - p["start"]
        test = p["test"] or "(outside a test)"
        files[test.split("::")[0]].append((wall, launch["cold"], launch["warm"]))
        rows.append((wall, launch["cold"], launch["warm"], test, " ".join(p["argv"])[:150]))
    out = [f"{'test file':<34} {'launches':>8} {'wall s':>8} {'cold':>5} {'warm':>5}"]
    for name, items in sorted(files.items(), key=lambda kv: -sum(w for w, _, _ in kv[1])):
        out.append(f"{name:<34} {len(items):>8} {sum(w for w, _, _ in items):>8.1f} "
                   f"{sum(c for _, c, _ in items):>5} {sum(w for _, _, w in items):>5}")
    out.append(f"{'all':<34} {len(rows):>8} {sum(r[0] for r in rows):>8.1f} {sum(r[1] for r in rows):>5} "
               f"{sum(r[2] for r in rows):>5}")
    fallbacks = defaultdict(int)
    for p in procs.values():
        if "fallback" in p:
            fallbacks[p["fallback"]] += 1
    out += [f"asked warm, started cold ({n}x): {why}" for why, n in sorted(fallbacks.items(), key=lambda kv: -kv[1])]
    out.append("longest launches: wall s, cold, warm, test, command")
    out += [f"{w:7.1f} {c:3} {m:3}  {t}  {cmd}" for w, c, m, t, cmd in sorted(rows, reverse=True)[:15]]
    return out


if __name__ == "__main__":
    print("\n".join(summary(sys.argv[1])))
