"""The figures the README and docs state (docs/checks.toml): each still written in its page, and the quickest
re-measured by its command here; `harness docs` tells a figure that moved from one that holds."""
from __future__ import annotations

import pytest

from conftest import cli
from harness import docs
from harness.config.run import ConfigError


def test_every_stated_figure_is_still_in_its_page_and_the_quickest_holds():
    static = cli("docs", "--static")
    assert static.returncode == 0, static.stdout + static.stderr
    checks = docs.load()
    quickest = min(checks, key=lambda c: c.minutes)
    done = cli("docs", "--only", quickest.name)
    assert done.returncode == 0 and f"| {quickest.name} | " in done.stdout and "| yes (" in done.stdout, \
        done.stdout + done.stderr[-2000:]
    assert all(c.minutes > 0 for c in checks) and {c.doc for c in checks} >= {"README.md", "docs/case-studies.md"}
    # --quick: what the README says it runs (the plan line, the main job and its score on new text)
    assert [c.name for c in docs.chosen(checks, None, quick=True)] == ["plan-launch", "main-job", "main-job-data"]


def test_a_figure_that_moved_or_left_its_page_fails_the_check(tmp_path, monkeypatch, capsys):
    page = tmp_path / "page.md"
    page.write_text("The answer is\n42.0 units.\n")
    (tmp_path / "checks.toml").write_text(
        '[[check]]\nname = "held"\ndoc = "page.md"\ncommand = "echo answer 42.04"\npattern = \'answer ([0-9.]+)\'\n'
        'value = "42.0"\nwritten = "is 42.0 units"\ntolerance = 0.05\nminutes = 0.1\n'
        '[[check]]\nname = "moved"\ndoc = "page.md"\ncommand = "echo answer 43"\npattern = \'answer ([0-9.]+)\'\n'
        'value = "42.0"\ntolerance = 0.05\nminutes = 0.1\nafter = "held"\n')
    monkeypatch.setattr(docs, "ROOT", tmp_path)
    monkeypatch.setattr(docs, "CHECKS", tmp_path / "checks.toml")
    assert docs.main(only="held") == 0
    assert docs.main(only="moved") == 1
    out = capsys.readouterr().out
    assert "| held | page.md | 42.0 | 42.04 | yes (0.05)" in out and "| moved | page.md | 42.0 | 43 | NO (0.05)" in out
    page.write_text("The answer is 41 units.\n")
    assert docs.main(static=True) == 1
    assert "held: page.md no longer says 'is 42.0 units'" in capsys.readouterr().err
    assert docs.main(listing=True, only="moved") == 0 and capsys.readouterr().out.splitlines() == [
        "held (page.md, about 0.1 min): echo answer 42.04",
        "moved (page.md, about 0.1 min, after held): echo answer 43"]
    assert docs.main(static=True, only="moved") == 1  # held, which it runs after, no longer says it
    with pytest.raises(ConfigError, match="no check warp"):
        docs.main(only="warp")
    with pytest.raises(ConfigError, match="--only '': name a check"):  # it ran every check
        docs.main(only="")


def test_a_check_that_hangs_ends_with_everything_it_started(tmp_path, monkeypatch):
    """A timed-out check: its command's children end too (only bash was killed: a launch's ranks trained on)."""
    import time
    from pathlib import Path

    pid = tmp_path / "pid"
    hung = docs.Check(name="hung", doc="page.md", command=f"sleep 300 & echo $! > {pid}; wait", pattern="(x)",
                      value="1", tolerance=0.0, minutes=0.001)
    monkeypatch.setattr(docs, "MIN_WAIT_S", 2.0)
    got, seconds, tail = docs.measure(hung)
    assert got is None and tail.rstrip().endswith("timed out after 2 s") and seconds < 60
    time.sleep(0.5)
    stat = Path(f"/proc/{pid.read_text().strip()}/stat")
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[1].split()[0] == "Z"  # gone (or not yet reaped)
