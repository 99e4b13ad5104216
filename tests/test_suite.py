"""`harness bench --suite gpu --smoke`: every part of the GPU suite at toy size on this CPU, for real, so the suite
works before a GPU ever sees it; the GPU table of docs/benchmarks.md generated from result files; the suite's bad
input."""
from __future__ import annotations

import json
import math
import shutil
import subprocess

import pytest

from conftest import ROOT, cli
from harness.bench import results
from harness.bench import suite as suite_mod
from harness.bench.suite import PARTS, RECIPES
from harness.cli import main
from harness.config.run import ConfigError

DATA = ROOT.parent / "shared" / "data"


def harness(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return cli(*args, timeout=timeout)


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("suite") / "smoke"
    data = ["--data", str(DATA)] if (DATA / "multi30k").is_dir() else []  # else the suite's own stand-ins
    proc = harness("bench", "suite", "--smoke", *data, "--out", str(out), "--work", str(out.parent / "work"))
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    return out


def test_smoke_runs_every_part_and_reports_it(smoke):
    suite = json.loads((smoke / "suite.json").read_text())
    env = suite["environment"]
    assert suite["smoke"] is True and list(suite["parts"]) == list(PARTS)
    assert env["kind"] == "cpu" and env["torch"] and env["deepspeed"] and env["commit"] and env["date"]
    assert suite["commands"][0].startswith("python -m harness bench suite --smoke")
    assert suite["parts"]["ops"]["ops"]["CPUAdamBuilder"]["built"] is True
    speed = suite["parts"]["speed"]["bench"]["configs"]
    assert [e["model"] for e in speed] == ["translation base", "protein 100M, length 512", "lm 125M, length 1024"]
    for e in speed:
        assert e["status"] == "ok", e
        assert e["step_s"]["n"] == 3 and e["tokens_per_s"] > 0 and e["precision"] == "fp32"
        assert 0 < e["mfu_measured"] <= 1 and e["mfu_table"] is None and e["target_met"] is None  # no CPU datasheet
        profile = e["profile"]  # the traced step after the timed ones: where its time went
        assert profile["step"] == 2 + 3 + 1 and profile["wall_s"] > 0 and 0 <= profile["loader_wait_s"] < 10
        assert profile["top"] and all(0 < t["share"] <= 1 for t in profile["top"])
    o = suite["parts"]["overhead"]
    assert o["status"] == "ok" and o["precision"] == "fp32" and o["loss_max_diff"] < 1e-6, o
    r = o["per_round"][0]  # one round: its ratio of mean steps
    assert o["vs_plain"]["median"] == pytest.approx(r["harness"] / r["plain"] - 1)
    assert o["target_met"] == (o["vs_plain"]["median"] <= 0.02)
    # the two steps in the same process, block by block (plain.py --paired)
    assert o["paired"]["blocks"] == 2 and "; in the same process " in results._overhead(suite["parts"])
    g = suite["parts"]["largest"]
    assert [c["name"] for c in g["configs"]] == ["zero0 x1", "zero3_offload x1"]
    assert all(c["params"] > 0 and c["tried"] for c in g["configs"]) and g["ratio"] > 0
    recipes = suite["parts"]["quality"]["recipes"]
    assert [r["name"] for r in recipes] == [r.name for r in RECIPES]
    for r in recipes:
        assert r["status"] == "ok", r
        assert math.isfinite(r["value"]) and r["steps"] <= r["recipe_steps"]
        assert r["schedule"].startswith("cut by the smoke run") and r["target_met"] in (False, None)
    bleu = recipes[0]["test"]
    assert bleu["sentences"] == 1000 and bleu["bleu_signature"].startswith("nrefs:1")  # the whole test2016 split
    by_name = {r["name"]: r["test"] for r in recipes}
    assert by_name["prices_etth1"]["persistence_mse"] == pytest.approx(1.294, abs=1e-3)  # the published 1.295
    assert by_name["protein_gb1"]["sequences"] == 3644 and 0 < by_name["protein_gb1"]["ridge_spearman"] < 1
    md = (smoke / "suite.md").read_text()
    assert "smoke: toy sizes, not figures" in md and "nrefs:1\\|case" in md  # the signature's | escaped
    assert (smoke / "speed.png").read_bytes()[:4] == b"\x89PNG"


def test_a_second_command_adds_its_parts_to_the_same_results(smoke, tmp_path, capsys):
    out = tmp_path / "two"
    shutil.copytree(smoke, out)
    assert main(["bench", "suite", "--smoke", "--parts", "ops", "--out", str(out), "--work",
                 str(tmp_path / "work")]) == 0
    suite = json.loads((out / "suite.json").read_text())
    assert len(suite["commands"]) == 2 and "--parts ops" in suite["commands"][1]
    assert list(suite["parts"]) == list(PARTS)  # the first command's parts are kept
    assert main(["bench", "suite", "--parts", "ops", "--out", str(out)]) == 2  # a full run, a smoke folder
    assert "holds a smoke run" in capsys.readouterr().err


def test_a_quality_command_for_some_recipes_replaces_only_theirs(smoke, tmp_path):
    out = tmp_path / "three"
    shutil.copytree(smoke, out)
    before = {r["name"]: r for r in json.loads((out / "suite.json").read_text())["parts"]["quality"]["recipes"]}
    (out / "suite.md").unlink()  # written again by the command
    assert main(["bench", "suite", "--smoke", "--parts", "quality", "--recipes", "prices_etth1", "--data",
                 str(DATA), "--out", str(out), "--work", str(tmp_path / "work")]) == 0
    suite = json.loads((out / "suite.json").read_text())
    assert "--recipes prices_etth1" in suite["commands"][-1]
    after = {r["name"]: r for r in suite["parts"]["quality"]["recipes"]}
    assert list(after) == [r.name for r in RECIPES]  # every recipe still there, in the suite's order
    assert all(after[n] == before[n] for n in after if n != "prices_etth1")  # kept as the first command left them
    etth1 = after["prices_etth1"]
    assert etth1["status"] == "ok" and etth1 != before["prices_etth1"]  # trained and scored again
    assert etth1["test"]["persistence_mse"] == pytest.approx(1.294, abs=1e-3)
    assert etth1["command"] == 1 and after["protein_gb1"]["command"] == 0  # which command scored each
    md = (out / "suite.md").read_text()
    assert all(f"| {n} | " in md for n in after) and "--recipes prices_etth1" in md
    # a recipe a later command had no budget for, or only failed on, keeps the result it had, with the attempt noted
    q, merge = suite["parts"]["quality"], suite_mod.merge_quality
    late = merge(q, {"recipes": [suite_mod.not_run("protein_gb1"),
                                 {"name": "prices_etth1", "status": "failed", "error": "timed out"}]})["recipes"]
    assert [r["name"] for r in late] == list(after)
    assert late[2] == {**after["protein_gb1"], "later_attempt": "not run: budget"}
    assert late[3] == {**etth1, "later_attempt": "failed: timed out"}
    assert late[0] == after["translation_multi30k"]  # not attempted: untouched
    failed = {"name": "protein_gb1", "status": "failed", "error": "OOM"}
    assert merge({"recipes": [failed]}, {"recipes": [suite_mod.not_run("protein_gb1")]})["recipes"] == [
        {**failed, "later_attempt": "not run: budget"}]  # a failure says more than "not run"
    assert merge({"recipes": [failed]}, {"recipes": [after["protein_gb1"]]})["recipes"] == [after["protein_gb1"]]
    # a part that broke keeps every recipe, and suite.md still shows them; a recipe since dropped goes last
    broke = merge(q, {"status": "failed", "error": "RuntimeError: x",
                      "recipes": [{"name": "a_dropped_recipe", "status": "failed", "error": "y"}]})
    assert broke["status"] == "failed" and broke["recipes"][:4] == q["recipes"]
    assert broke["recipes"][4]["name"] == "a_dropped_recipe"
    md = results.suite_markdown({**suite, "parts": {"quality": {**broke, "recipes": late}}})
    assert "Part quality failed: RuntimeError: x" in md and "| prices_etth1 | mse |" in md
    assert "prices_etth1: the result above is command 2's; a later command's attempt gave failed: timed out" in md
    assert merge(None, {"status": "failed", "error": "x"})["recipes"] == []


def test_readme_gpu_table_comes_from_result_files(smoke, tmp_path, capsys):
    assert results.main(check=True) == 0  # docs/benchmarks.md is what results/gpu/ gives
    root = tmp_path / "repo"
    (root / "results" / "gpu" / "smoke").mkdir(parents=True)
    (root / "docs").mkdir()
    for page in results.PAGES:
        shutil.copy(ROOT / page, root / page)
    shutil.copytree(ROOT / "results" / "cpu", root / "results" / "cpu")
    suite = json.loads((smoke / "suite.json").read_text())
    (root / "results" / "gpu" / "smoke" / "suite.json").write_text(json.dumps(suite))
    block = results.render(root)
    assert block.count(results.NOT_MEASURED) == len(results.ROWS)  # smoke runs are never figures
    suite["smoke"] = False  # the same files as a full run would leave them
    (root / "results" / "gpu" / "full").mkdir()
    (root / "results" / "gpu" / "full" / "suite.json").write_text(json.dumps(suite))
    block = results.render(root)
    link = "(../results/gpu/full/suite.json)"  # from docs/ to the file
    lm = next(line for line in block.splitlines() if line.startswith("| lm 125M, length 1024 MFU, compile off"))
    assert "MFU - of the datasheet peak" in lm and "tokens/s (fp32)" in lm and link in lm  # no CPU datasheet
    assert next(line for line in block.splitlines() if "compile on" in line).endswith(f"| {results.NOT_MEASURED} |")
    bleu = next(line for line in block.splitlines() if line.startswith("| Multi30k"))
    assert "BLEU" in bleu and "nrefs:1\\|case" in bleu and link in bleu and "not the recipe's result" in bleu
    assert "persistence 1.29" in next(line for line in block.splitlines() if line.startswith("| ETTh1"))
    assert "CPUAdamBuilder built" in block
    assert results.main(check=True, root=root) == 1  # the copied page does not show these yet
    assert results.main(check=False, root=root) == 0 and results.main(check=True, root=root) == 0
    assert link in (root / "docs" / "benchmarks.md").read_text()
    # a block naming a table under results/ shows that file: a changed file makes the check fail until regenerated
    table = root / "results" / "cpu" / "proxy" / "proxy.md"
    table.write_text(table.read_text() + "| a row the page does not show yet |\n")
    capsys.readouterr()
    assert results.main(check=True, root=root) == 1
    assert "\n+| a row the page does not show yet |\n" in capsys.readouterr().out  # where, not only that it differs
    assert results.main(check=False, root=root) == 0 and results.main(check=True, root=root) == 0
    page = (root / "docs" / "benchmarks.md").read_text()
    assert "| a row the page does not show yet |\n\n(generated from [results/cpu/proxy/proxy.md]" in page
    table.unlink()
    with pytest.raises(ConfigError, match="its block names results/cpu/proxy/proxy.md, which is no file"):
        results.main(check=True, root=root)
    (root / "results" / "gpu" / "full" / "suite.json").write_text('{"parts": ')  # cut short: one line
    with pytest.raises(ConfigError, match=r"^results/gpu/full/suite.json: not a GPU suite's record \(JSONDecodeError"):
        results.load(root)


def test_suite_refuses_bad_input_before_running(tmp_path, capsys):
    out = tmp_path / "s"
    bad = [(["--parts", "speed,warp", "--data", str(tmp_path)], "unknown part(s) warp"),
           (["--data", str(tmp_path / "nowhere")], "not a directory"),
           (["--data", str(tmp_path)], "no ett/, flip_gb1/low_vs_high.csv.gz, flip_ss/, multi30k/ in it"),
           (["--budget", "speed=soon", "--data", str(tmp_path)], "--budget speed=soon"),
           (["--recipes", "prices_etth1,warp", "--data", str(tmp_path)], "unknown recipe(s) warp; the recipes are "
                                                                           "translation_multi30k, protein_flip_ss"),
           (["--parts", "ops", "--recipes", "prices_etth1"], "--parts ops has no quality"),
           (["--recipes", "", "--data", str(tmp_path)], "unknown recipe(s) (none given)"),
           (["--parts", "quality", "--recipes", "prices_etth1", "--data", str(tmp_path)], "no ett/ in it")]
    for args, message in bad:
        assert main(["bench", "suite", "--smoke", "--out", str(out), *args]) == 2, args
        assert message in capsys.readouterr().err, args
    assert main(["bench", "suite", "--parts", "quality", "--out", str(out)]) == 2  # a real run needs the real sets
    assert "--data DIR is needed" in capsys.readouterr().err
    for flag in (["--smoke"], ["--recipes", "prices_etth1"]):  # the suite's flags given to the sweep: its usage line
        with pytest.raises(SystemExit) as stop:
            main(["bench", "sweep", *flag, "--out", str(out)])
        assert stop.value.code == 2 and f"harness bench sweep: error: unrecognized arguments: {' '.join(flag)}" in \
            capsys.readouterr().err
    assert not out.exists()


def test_a_part_that_fails_makes_the_command_fail_after_writing_its_results(tmp_path, monkeypatch, capsys):
    def broken(*args):
        raise RuntimeError("no device")

    monkeypatch.setitem(suite_mod.PART_RUNNERS, "ops", broken)
    out = tmp_path / "out"
    assert main(["bench", "suite", "--smoke", "--parts", "ops", "--out", str(out), "--work",
                 str(tmp_path / "work")]) == 1
    assert "1 of the suite's measurements failed: ops: RuntimeError: no device" in capsys.readouterr().err
    assert json.loads((out / "suite.json").read_text())["parts"]["ops"]["status"] == "failed"  # written all the same


def test_what_counts_as_a_failed_measurement():
    parts = {
        "speed": {"status": "ok", "bench": {"configs": [{"name": "a", "status": "ok"},
                                                        {"name": "b", "status": "timeout"},
                                                        {"name": "c", "status": "not run"},
                                                        {"name": "d", "status": "oom"}]}},
        "largest": {"status": "ok", "configs": [{"name": "zero0 x1", "tried": {
            "23": {"status": "timeout"}, "24": {"status": "oom"},  # how the search finds the largest
            "2": {"status": "failed", "error": "ImportError: x"}}}]},
        "quality": {"recipes": [{"name": "x", "status": "failed", "error": "diverged"},
                                {"name": "z", "status": "not run"}]},
        "overhead": {"status": "failed", "error": "RuntimeError: boom"}}
    assert suite_mod.failures(parts) == [
        "speed b: timeout", "speed d: oom", "largest zero0 x1 at 2: ImportError: x", "quality x: diverged",
        "overhead: RuntimeError: boom"]
    assert suite_mod.failures({"largest": {"status": "ok", "configs": [{"tried": {"9": {"status": "oom"}}}]}}) == []


def test_a_recipe_this_command_failed_fails_it_though_an_earlier_result_is_kept(tmp_path, monkeypatch, capsys):
    """The merge keeps an earlier scored recipe over this command's failure (suite.merge_quality); the command
    still says it failed."""
    out = tmp_path / "out"
    out.mkdir()
    h100 = json.loads((ROOT / "results/gpu/2026-11-23-nvidia-h100-80gb-hbm3/suite.json").read_text())
    earlier = {**next(r for r in h100["parts"]["quality"]["recipes"] if r["name"] == "prices_etth1"), "command": 0}
    assert earlier["status"] == "ok"
    (out / "suite.json").write_text(json.dumps({"smoke": True, "environment": suite_mod.environment(),
                                                "commands": ["earlier"], "parts": {"quality": {
                                                    "status": "ok", "recipes": [earlier]}}}))
    failed = {k: earlier[k] for k in ("name", "metric", "target", "run_file", "ds", "compare")}
    monkeypatch.setitem(suite_mod.PART_RUNNERS, "quality", lambda *args: {"status": "ok", "recipes": [
        {**failed, "status": "failed", "error": "diverged", "steps": 3}]})
    assert main(["bench", "suite", "--smoke", "--parts", "quality", "--recipes", "prices_etth1", "--data",
                 str(DATA), "--out", str(out), "--work", str(tmp_path / "work")]) == 1
    assert "quality prices_etth1: diverged" in capsys.readouterr().err
    kept = json.loads((out / "suite.json").read_text())["parts"]["quality"]["recipes"][0]
    assert kept["status"] == "ok" and kept["value"] == earlier["value"]  # the earlier result stays


def test_smoke_without_the_benchmark_sets_makes_stand_ins_in_their_layout(tmp_path):
    """No --data: made-up sets in the recipes' layout, which the case studies read and the quality part trains on;
    the same layout `harness prepare TASK --from` writes from the authors' files."""
    out, work = tmp_path / "out", tmp_path / "work"
    assert main(["bench", "suite", "--smoke", "--parts", "quality", "--recipes", "prices_etth1,protein_gb1",
                 "--out", str(out), "--work", str(work)]) == 0
    recipes = json.loads((out / "suite.json").read_text())["parts"]["quality"]["recipes"]
    assert [r["status"] for r in recipes if r["name"] in ("prices_etth1", "protein_gb1")] == ["ok", "ok"]
    made = work / "smoke-data"
    laid = tmp_path / "laid"
    for task, source in (("translation", made / "multi30k"), ("protein", made / "flip_ss"),
                         ("protein", made / "flip_gb1"), ("prices", made / "ett" / "ETTh1.csv.gz")):
        assert main(["prepare", task, "--from", str(source), "--out", str(laid)]) == 0
    assert sorted(str(p.relative_to(laid)) for p in laid.rglob("*") if p.is_file()) == sorted(
        str(p.relative_to(made)) for p in made.rglob("*") if p.is_file())
    assert main(["prepare", "translation", "--from", str(made / "flip_ss"), "--out", str(laid)]) == 2



def test_prepare_from_a_release_checks_what_it_reads(tmp_path, capsys):
    """A gzip damaged inside (zlib's error), FLIP fasta files that are not FLIP's (they were laid out, and failed
    later), a sentence file whose last line has no newline (counted one line short, refused as misaligned)."""
    import gzip

    data = bytearray(gzip.compress(b"".join(b"date,a\n2020-01-01,%d\n" % i for i in range(2000))))
    data[20:60] = bytes(40)
    (tmp_path / "ETTh1.csv.gz").write_bytes(bytes(data))
    assert main(["prepare", "prices", "--from", str(tmp_path / "ETTh1.csv.gz"), "--out", str(tmp_path / "o")]) == 2
    assert "unreadable (error: Error -3 while decompressing" in capsys.readouterr().err
    ss = tmp_path / "ss"
    ss.mkdir()
    (ss / "sequences.fasta").write_text(">a\nMKVL\n>b\nACDE\n>c\nGG\n")
    (ss / "sampled.fasta").write_text(">a SET=train VALIDATION=False\nCCHH\n>b SET=test VALIDATION=False\nCCH\n"
                                      ">c\nCC\n")  # b: a state short; c: no SET=
    assert main(["prepare", "protein", "--from", str(ss), "--out", str(tmp_path / "o")]) == 2
    assert "are not FLIP's secondary-structure files (2 of 3 records without a sequence of their length or a SET=, " \
           "e.g. b)" in capsys.readouterr().err
    pairs = tmp_path / "m30k"
    pairs.mkdir()
    for split in ("train", "val", "test_2016_flickr"):
        (pairs / f"{split}.en").write_text("a dog runs\nthe man\n")
        (pairs / f"{split}.de").write_text("ein hund rennt\nder mann")  # no newline at its end
    assert main(["prepare", "translation", "--from", str(pairs), "--out", str(tmp_path / "o")]) == 0
