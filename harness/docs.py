"""`harness docs`: the figures the README and docs state, each re-measured by the command stated beside it and
compared within its tolerance (`docs/checks.toml` lists them). `--quick` runs those of a minute or less, with what
they run after; `--static` only checks that each figure is still written in its page, as stated."""
from __future__ import annotations

import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .config.run import ConfigError, read_toml

ROOT = Path(__file__).resolve().parent.parent
CHECKS = ROOT / "docs" / "checks.toml"
QUICK_MINUTES = 1.0


@dataclass(frozen=True)
class Check:
    name: str
    doc: str            # the page stating the figure, from the repository's root
    command: str        # what measures it (bash, from the repository's root)
    pattern: str        # a regex over the command's output: its first group is the figure
    value: str          # the figure the page states
    tolerance: float    # how far the measured figure may be from `value` (0: the same text)
    minutes: float      # about how long the command takes on this project's 2-core CPU
    after: str = ""     # a check whose command must run first (e.g. the training an evaluation reads)
    written: str = ""   # the page's words around the figure, where the figure alone is ambiguous

    def stated(self) -> bool:  # as words: a figure may wrap over two lines of the page
        page = ROOT / self.doc
        if not page.is_file():
            raise ConfigError(f"{CHECKS.name}: check {self.name!r} names {self.doc}, which is no file")
        return " ".join((self.written or self.value).split()) in " ".join(page.read_text().split())

    def agrees(self, measured: str) -> bool:
        if not self.tolerance:
            return measured == self.value
        try:
            return abs(float(measured.replace(",", "")) - float(self.value.replace(",", ""))) <= self.tolerance
        except ValueError:
            return False


def load(path: Path | None = None) -> list[Check]:
    path = path or CHECKS
    try:
        checks = [Check(**c) for c in read_toml(path).get("check", [])]
    except TypeError as e:
        raise ConfigError(f"{path}: a [[check]] is malformed: {e}") from None
    names = {c.name for c in checks}
    for c in checks:
        if c.after and c.after not in names:
            raise ConfigError(f"{path}: check {c.name!r} runs after {c.after!r}, which is no check")
    return checks


def chosen(checks: list[Check], only: str | None, quick: bool) -> list[Check]:
    """The checks to run, each preceded by the ones it runs after."""
    by_name = {c.name: c for c in checks}
    if only is not None and not only.strip(","):  # "" had run every check, the 9-minute suite among them
        raise ConfigError(f"--only {only!r}: name a check; the checks are {', '.join(by_name)}")
    if only:
        unknown = [n for n in only.split(",") if n not in by_name]
        if unknown:
            raise ConfigError(f"--only: no check {', '.join(unknown)}; the checks are {', '.join(by_name)}")
        picked = [by_name[n] for n in only.split(",")]
    else:  # quick: a check of a minute or less, each of those it runs after too (the main job, then its score)
        picked = [c for c in checks if not quick or longest(c, by_name) <= QUICK_MINUTES]
    ordered: list[Check] = []

    def add(c: Check) -> None:
        if c.after:
            add(by_name[c.after])
        if c not in ordered:
            ordered.append(c)

    for c in picked:
        add(c)
    return ordered


def longest(c: Check, by_name: dict[str, Check]) -> float:
    """The most minutes of a check and those it runs after, each on its own."""
    return max(c.minutes, longest(by_name[c.after], by_name) if c.after else 0.0)


MIN_WAIT_S = 120.0  # the least a check is given before it counts as hung


def measure(c: Check) -> tuple[str | None, float, str]:
    """The figure the command prints (None: not found), its seconds, and the output's tail."""
    from .bench.sweep import run_program  # a session of its own: a timeout ends the launch and its ranks too

    started = time.monotonic()  # four times the stated minutes: a hang is a failure, not a wait
    done = run_program(["bash", "-c", c.command], dict(os.environ), max(MIN_WAIT_S, 240 * c.minutes), cwd=ROOT)
    out = done.stdout + done.stderr
    found = re.search(c.pattern, out, re.M)
    return (found.group(1) if found else None), time.monotonic() - started, out[-1500:]


def main(only: str | None = None, quick: bool = False, static: bool = False, listing: bool = False) -> int:
    checks = load()
    picked = chosen(checks, only, quick)  # a bad --only refused before anything runs
    if listing:
        for c in picked:
            print(f"{c.name} ({c.doc}, about {c.minutes:g} min{f', after {c.after}' * bool(c.after)}): {c.command}")
        return 0
    unstated = [c for c in picked if not c.stated()]
    for c in unstated:
        print(f"{c.name}: {c.doc} no longer says {c.written or c.value!r}", file=sys.stderr)
    if static:
        print(f"{len(picked) - len(unstated)} of {len(picked)} figures written as {CHECKS.name} states them")
        return 1 if unstated else 0
    failed = list(unstated)
    print("| check | page | stated | measured | within | seconds (stated: minutes) |\n|---|---|---|---|---|---|")
    for c in picked:
        got, seconds, tail = measure(c)
        ok = got is not None and c.agrees(got)
        print(f"| {c.name} | {c.doc} | {c.value} | {got} | {'yes' if ok else 'NO'} ({c.tolerance:g}) | "
              f"{seconds:.0f} ({c.minutes:g}) |", flush=True)
        if not ok:
            failed.append(c)
            print(tail, file=sys.stderr)
    return 1 if failed else 0
