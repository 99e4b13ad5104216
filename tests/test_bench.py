"""`harness bench`: a CPU sweep end to end, the analytic FLOPs against hand counts, the largest-model search."""
from __future__ import annotations

import contextlib
import io
import json
import os
import platform
import subprocess

import pytest
import torch

from conftest import DS, ROOT, TINY, cli
from harness.bench import overhead, report
from harness.models.flops import TRAIN_FACTOR
from harness.models.seq2seq import Seq2Seq, Seq2SeqConfig
from harness.models.transformer import TransformerConfig, TransformerLM
from harness.plan.render import largest_fitting


def bench(*args: str, timeout: int = 600) -> subprocess.CompletedProcess:
    return cli("bench", *args, timeout=timeout)


def test_cpu_sweep_writes_a_well_formed_report(tmp_path, corpus):
    sets = [s for s in TINY if not s.startswith("train.max_steps")] + [f"data.path={json.dumps(str(corpus))}"]
    args = ["sweep", "--ds", "zero2", "--nproc", "1,2", "--steps", "4", "--warmup", "2", "--out", str(tmp_path / "b")]
    for s in sets:
        args += ["--set", s]
    proc = bench(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "is now" not in proc.stderr  # the new spelling: no line about the old one
    result = json.loads((tmp_path / "b" / "bench.json").read_text())
    assert result["schema"] == 2 and result["task"] == "lm" and result["steps"] == 4
    assert result["device"]["kind"] == "cpu" and result["device"]["peak_flops"]["fp32"]["measured"] > 1e8
    # every process gets the same share of the cores, the 1-process baseline too
    assert result["device"]["threads_per_process"] == max(1, (os.cpu_count() or 1) // 2)
    one, two = result["configs"]
    assert (one["name"], two["name"]) == ("zero2 x1", "zero2 x2")
    for e in (one, two):
        assert e["status"] == "ok", e
        assert e["step_s"]["n"] == 4 and 0 < e["step_s"]["min"] <= e["step_s"]["median"] <= e["step_s"]["max"]
        # an MFU above 1 (the peak measured while the other test worker was busy) is set aside as invalid
        mfu = e["mfu_measured"] if e["mfu_measured"] is not None else e["invalid"]["mfu_measured"]["value"]
        assert e["tokens_per_s"] > 0 and e["mfu_table"] is None  # no CPU datasheet
        assert 0 < mfu < 1 or (e["mfu_measured"] is None and mfu > 1)
        assert e["peak_mem_bytes"] > 0 and e["padding"] == 0.0 and e["params"] == 42_880
        assert e["activation_bytes"] > 0  # rank 0's first micro-batch: per rank, the same at 1 and 2 processes
        assert e["peak_flops_measured"] > 1e8  # measured beside the configuration, its MFU's denominator
        assert mfu == pytest.approx(e["model_flops_per_s"] / (e["peak_flops_measured"] * e["nproc"]))
    # every step trains the same shapes: its FLOPs are the analytic count of its global batch
    model = TransformerLM(TransformerConfig(vocab_size=256, max_seq_len=32, d_model=32, n_layers=2, n_heads=2,
                                            d_ff=128))
    for e in (one, two):
        ids = torch.zeros(e["global_batch"], 32, dtype=torch.long)
        assert e["flops_per_step"] == pytest.approx(TRAIN_FACTOR * model.forward_flops(ids), rel=1e-9)
    assert (one["global_batch"], two["global_batch"]) == (4, 8)  # micro 4 per rank: weak scaling
    assert one["speedup"] == 1.0 and two["baseline"] == "zero2 x1"
    assert two["speedup"] == pytest.approx(two["tokens_per_s"] / one["tokens_per_s"])
    # a speedup above 2 on 2 processes is the shared machine's noise (the 1-process run slowed by the other test
    # worker): the report then sets the efficiency aside as invalid, with its value (as test_impossible_utilisation_...)
    efficiency = two["scaling_efficiency"] if two["scaling_efficiency"] is not None else \
        two["invalid"]["scaling_efficiency"]["value"]
    assert efficiency == pytest.approx(two["speedup"] / 2)
    table = (tmp_path / "b" / "bench.md").read_text()
    assert "| zero2 x1 |" in table and "| zero2 x2 |" in table
    assert (tmp_path / "b" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_checks_every_configuration_before_launching(tmp_path, capsys):
    proc = bench("sweep", "--ds", "zero2,nonexistent", "--set", "train.max_steps=5", "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and "--ds nonexistent: neither a file" in proc.stderr
    proc = bench("sweep", "--ds", "pp2_zero1", "--nproc", "3", "--set", "train.max_steps=5", "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and "no configuration of the sweep fits its process counts" in proc.stderr
    proc = bench("sweep", "--ds", "zero2,tp2_zero1", "--nproc", "1,2", "--vary", "model.n_heads=4,3",
                 "--out", str(tmp_path / "b"))
    assert proc.returncode == 2 and "model.n_heads must divide model.d_model" in proc.stderr
    assert "skipped tp2_zero1 x1" in proc.stdout
    proc = bench("sweep", "--ds", "zero0", "--largest", "n_layers", "--out", str(tmp_path / "b"))  # a CPU
    assert proc.returncode == 2 and "--largest on a CPU needs --memory-budget-gb" in proc.stderr
    assert not (tmp_path / "b").exists()  # nothing launched, nothing written
    from harness.cli import main  # counts that cannot be (a ZeroDivisionError, or a row of world -1, before)

    for argv, said in ((["sweep", "--nproc", "0"], "--nproc 0: comma-separated process counts, each 1 or more"),
                       (["sweep", "--nproc", "a"], "--nproc a: comma-separated"),
                       (["overhead", "--rounds", "0"], "--rounds 0: must be 1 or more"),
                       (["corpus", "--repeats", "0"], "--repeats 0: must be 1 or more"),
                       (["proxy", "--stages", "a"], "and precisions fp32, bf16, fp16; not a"),
                       (["proxy", "--stages", ""], 'and precisions fp32, bf16, fp16; not ""'),
                       (["overhead", "--warmup", "-1"], "--warmup -1: must be 0 or more"),
                       (["seeds", "0", "--threads", "-1"], "--threads -1: must be 1 or more"),
                       (["sweep", "--largest", "n_layers", "--memory-budget-gb", "-1"],
                        "--memory-budget-gb -1.0: must be above 0"),
                       (["sweep", "--largest", "n_layers", "--memory-budget-gb", "1", "--largest-max", "0"],
                        "--largest-max 0: must be above 0"),
                       (["sweep", "--ds", f"zero0,{tmp_path / 'zero0.json'}"],
                        "two configurations are named 'zero0 x1'"),
                       (["overhead", "--nproc", "1,1"], "two configurations are named 'zero0 x1'"),
                       (["proxy", "--stages", "0,0"], "--stages 0,0 --precisions fp32,bf16,fp16: give each value once"),
                       (["overhead", "--ds", "tp2_zero1", "--nproc", "2"],
                        "the overhead study with sequence or tensor parallelism (tp2_zero1 x2)")):
        (tmp_path / "zero0.json").write_text((DS / "zero1.json").read_text())
        assert main(["bench", *argv, "--out", str(tmp_path / "b")]) == 2
        assert said in capsys.readouterr().err
    assert not (tmp_path / "b").exists()
    (tmp_path / "a_file").write_text("")  # a report's directory that is a file: refused before any measurement
    assert main(["bench", "sweep", "--out", str(tmp_path / "a_file")]) == 2
    assert "--out " in capsys.readouterr().err
    # a configuration that timed out is no measurement: written, said, exit 1 (it was 0)
    proc = bench("sweep", "--ds", "zero0", "--timeout", "1", "--steps", "2000", "--warmup", "1", "--out",
                 str(tmp_path / "t"), "--run", str(ROOT / "configs" / "runs" / "lm_demo.toml"), "--rounds", "2")
    # (2 steps could finish within the second, forked warm)
    assert proc.returncode == 1 and "1 of 1 configurations failed or timed out (zero0 x1)" in proc.stderr, proc.stderr
    assert "[1/1, round 2 of 2] zero0 x1" in proc.stdout  # launched again in the second round
    # the run file as the report names it: in the repository, relative to it (no machine's directories)
    assert json.loads((tmp_path / "t" / "bench.json").read_text())["run_file"] == "configs/runs/lm_demo.toml"


@pytest.mark.parametrize("argv, usage, error", [
    ([], "usage: harness bench [-h] {sweep,overhead,proxy,suite,seeds,corpus}", "the following arguments are required"),
    (["overhead", "--vary", "model.d_model=32,64"], "usage: harness bench overhead", "unrecognized arguments: --vary"),
    (["overhead", "--largest", "n_layers"], "usage: harness bench overhead", "unrecognized arguments: --largest"),
    (["proxy", "--seeds", "0,1"], "usage: harness bench proxy", "unrecognized arguments: --seeds 0,1"),
    (["seeds", "0,1", "--smoke"], "usage: harness bench seeds", "unrecognized arguments: --smoke"),
    (["--proxy", "--suite", "gpu"], "usage: harness bench [-h]", "--proxy and --suite are two studies"),
    (["--seeds", "0,1", "--overhead"], "usage: harness bench [-h]", "--seeds and --overhead are two studies"),
    (["--suite", "cpu"], "usage: harness bench [-h]", "--suite cpu: the suites are gpu"),
])
def test_bench_refuses_flags_of_two_studies_or_none_with_the_usage_line(argv, usage, error):
    """Each study is a subcommand with its own flags: another's flag, two old-style studies, or none, is argparse's
    usage line of the command at hand and exit 2, before anything runs."""
    from harness.cli import main

    with pytest.raises(SystemExit) as stop:
        with contextlib.redirect_stderr(io.StringIO()) as err:
            main(["bench", *argv])
    assert stop.value.code == 2
    assert err.getvalue().startswith(usage) and error in err.getvalue(), err.getvalue()


def test_old_bench_spellings_still_run_with_a_line_naming_the_new_form(capsys):
    from harness.cli import _old_bench, parser

    bench_parser = parser().bench
    assert _old_bench(["bench", "--proxy", "--stages", "0"], bench_parser) == ["bench", "proxy", "--stages", "0"]
    assert "`harness bench --proxy --stages 0` is now `harness bench proxy --stages 0`; the old form is accepted " \
           "until the next release" in capsys.readouterr().err
    assert _old_bench(["bench", "--seeds=0,1", "--metric", "m"], bench_parser) == ["bench", "seeds", "0,1", "--metric", "m"]
    assert _old_bench(["bench", "--suite", "gpu", "--smoke"], bench_parser) == ["bench", "suite", "--smoke"]
    assert _old_bench(["bench", "--ds", "zero2"], bench_parser) == ["bench", "sweep", "--ds", "zero2"]
    assert _old_bench(["bench", "sweep", "--ds", "zero2"], bench_parser) == ["bench", "sweep", "--ds", "zero2"]
    assert capsys.readouterr().err.count("is now") == 3  # the new spelling passes without a word
    # the old spelling parses to what the new one does
    new, old = (parser().parse_args(_old_bench(a, bench_parser)) for a in (
        ["bench", "overhead", "--rounds", "3"], ["bench", "--overhead", "--rounds", "3"]))
    assert {k: v for k, v in vars(new).items() if k != "command_parser"} == \
        {k: v for k, v in vars(old).items() if k != "command_parser"}


def test_flops_formula_matches_a_hand_count():
    # d = 4, f = 8, V = 10, 1 layer, 2 sequences of 3 tokens. Per token: q, k, v, out 4 x (2 x 4 x 4) = 128,
    # feed-forward 2 x 4 x 8 + 2 x 8 x 4 = 128, head 2 x 4 x 10 = 80: 336 x 6 tokens = 2016. Attention: scores
    # and weighted sum 4 x T^2 x d = 4 x 9 x 4 = 144 per sequence: 288. Forward 2304, training 3x.
    lm = TransformerLM(TransformerConfig(vocab_size=10, max_seq_len=3, d_model=4, n_layers=1, n_heads=2, d_ff=8))
    assert lm.forward_flops(torch.zeros(2, 3, dtype=torch.long)) == 2304
    # Encoder-decoder, d = 4, f = 8, V = 10, 1 layer each, one pair: source 3 tokens (+ 1 padding), target 2.
    # Encoder: 3 x 256 + 4 x 9 x 4 = 912. Decoder per target token: self q,k,v,out 128 + cross q,out 64 + ffn 128
    # = 320, x 2 = 640; cross k,v over the source 3 x 64 = 192; self attention 4 x 4 x 4 = 64; cross 4 x 2 x 3 x 4
    # = 96. Output projection 2 tokens x 80 = 160. Total 912 + 640 + 192 + 64 + 96 + 160 = 2064.
    s2s = Seq2Seq(Seq2SeqConfig(vocab_size=10, d_model=4, n_layers=1, n_heads=2, d_ff=8, dropout=0.0))
    src, tgt = torch.tensor([[5, 6, 7, 0]]), torch.tensor([[2, 5]])
    assert s2s.forward_flops(src, tgt, torch.ones(1, 2, dtype=torch.bool)) == 2064


def test_flops_match_pytorch_s_counter_apart_from_attention():
    """PyTorch's FLOP counter sees every matmul but not the CPU attention kernel: the rest must agree exactly."""
    from torch.utils.flop_counter import FlopCounterMode

    from harness.models.encoder import Encoder
    from harness.models.patch import PatchConfig, PatchTST

    torch.manual_seed(0)
    cfg = TransformerConfig(vocab_size=50, max_seq_len=16, d_model=32, n_layers=2, n_heads=4, d_ff=64)
    ids = torch.randint(4, 50, (3, 16))
    full = torch.ones(3, 16, dtype=torch.bool)
    src, tgt = torch.randint(4, 50, (3, 7)), torch.randint(4, 50, (3, 5))
    patch = PatchTST(PatchConfig(lookback=32, horizon=8, patch_len=8, stride=4, d_model=16, n_layers=2, n_heads=2,
                                 d_ff=32))
    n = patch.cfg.n_patches
    attention = lambda t, s, d, seqs, layers: 4 * t * s * d * seqs * layers  # noqa: E731
    cases = [(TransformerLM(cfg), (ids,), attention(16, 16, 32, 3, 2)),
             (Encoder(cfg, "mlm", 50), (ids, full), attention(16, 16, 32, 3, 2)),
             (Encoder(cfg, "classify", 2), (ids, full), attention(16, 16, 32, 3, 2)),
             (Seq2Seq(Seq2SeqConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, d_ff=64, dropout=0.0)),
              (src, tgt, torch.ones(3, 5, dtype=torch.bool)),
              attention(7, 7, 32, 3, 2) + attention(5, 5, 32, 3, 2) + attention(5, 7, 32, 3, 2)),
             (patch, (torch.randn(3, 32, 4),), attention(n, n, 16, 12, 2))]
    for model, inputs, attn in cases:
        with FlopCounterMode(display=False) as counter:
            model(*inputs)
        assert model.forward_flops(*inputs) - attn == counter.get_total_flops(), type(model).__name__


def test_largest_fitting_doubles_then_bisects():
    calls = []

    def fits_below(limit):
        def fits(k):
            calls.append(k)
            return k <= limit
        return fits

    assert largest_fitting(fits_below(13), 1, 64) == 13 and calls[:5] == [1, 2, 4, 8, 16]
    calls.clear()
    assert largest_fitting(fits_below(3), 8, 64) == 3 and calls[0] == 8  # the start fails: search below it
    assert largest_fitting(fits_below(0), 4, 64) == 0  # nothing fits
    assert largest_fitting(fits_below(1000), 4, 64) == 64  # capped


def test_impossible_utilisation_is_flagged_not_reported(tmp_path):
    """A busy machine once gave "MFU" of 213% and 2-process efficiencies of 1814%: such figures are invalid."""
    device = {"name": "cpu (x86_64, 2 threads)", "kind": "cpu", "count": 1, "threads_per_process": 1,
              "peak_flops": {"fp32": {"table": None, "measured": 1e9}}}
    common = {"status": "ok", "precision": "fp32", "sets": [], "ds": "configs/ds/zero2.json", "layout": "data 1",
              "params": 1000, "peak_mem_bytes": 2**20, "padding": 0.0, "samples_per_s": 1.0,
              "step_s": {"median": 1.0, "p10": 1.0, "p90": 1.0}}
    one = {**common, "name": "zero2 x1", "nproc": 1, "tokens_per_s": 100.0, "flops_per_step": 5e8,
           "peak_flops_measured": 1e9}
    two = {**common, "name": "zero2 x2", "nproc": 2, "tokens_per_s": 3600.0, "flops_per_step": 4.26e9,
           "peak_flops_measured": 1e9}
    report.derive([one, two], device)
    assert one["mfu_measured"] == pytest.approx(0.5) and "invalid" not in one
    assert two["mfu_measured"] is None and two["invalid"]["mfu_measured"]["value"] == pytest.approx(2.13)
    assert two["scaling_efficiency"] is None and two["invalid"]["scaling_efficiency"]["value"] == pytest.approx(18)
    assert two["speedup"] == pytest.approx(36)  # a ratio of two measurements, not bounded: shown as it is
    result = {"task": "lm", "steps": 4, "warmup": 2, "device": device, "configs": [one, two]}
    table = report.markdown(result)
    row = next(line for line in table.splitlines() if line.startswith("| zero2 x2 |"))
    assert row.count("invalid (>100%)") == 2 and "213" not in row and "1800" not in row
    assert "| 50.0% |" in next(line for line in table.splitlines() if line.startswith("| zero2 x1 |"))
    assert report.plot(result, tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"


def test_largest_fitting_with_a_resolution_grows_gently_and_stops_close():
    """At billions of parameters a try takes minutes: from a good start, few tries within 25%."""
    calls = []

    def fits(k):
        calls.append(k)
        return k <= 21

    assert largest_fitting(fits, 16, 512, resolution=0.25) in range(17, 22)
    assert calls[:2] == [16, 20] and len(calls) <= 4
    calls.clear()
    assert 21 * 0.75 <= largest_fitting(fits, 40, 512, resolution=0.25) <= 21 and calls[0] == 40  # start too big


def test_overhead_study_compares_with_a_plain_loop_that_trains_alike(tmp_path, corpus):
    """`harness bench overhead` on 2 processes, ZeRO-2: the plain PyTorch loop reads the harness's batches and
    reaches its losses (what makes the timing comparison fair), and runs the harness's step beside its own."""
    sets = [s for s in TINY if not s.startswith("train.max_steps")] + [f"data.path={json.dumps(str(corpus))}"]
    args = ["overhead", "--ds", "zero2", "--nproc", "2", "--rounds", "1", "--steps", "3", "--warmup", "1",
            "--out", str(tmp_path / "o")]
    for s in sets:
        args += ["--set", s]
    proc = bench(*args)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((tmp_path / "o" / "overhead.json").read_text())
    (e,) = result["configs"]
    assert e["status"] == "ok" and e["name"] == "zero2 x2" and e["zero_stage"] == 2, e
    assert e["loss_max_diff"] < 1e-5  # fp32, the same model, batches and AdamW: the same losses
    assert all(e["step_s"][p]["n"] == 3 for p in overhead.PROGRAMS)
    assert "| zero2 x2 |" in (tmp_path / "o" / "overhead.md").read_text()
    # The harness's step beside the plain one, in the plain program's processes: 2 blocks of each (16 timed steps
    # a block), so both really ran there.
    assert e["paired"]["blocks"] == 2 and all(e["paired"]["step_s"][p] > 0 for p in overhead.PROGRAMS)


def test_overhead_figures_are_the_rounds_ratios_of_means():
    times = {"harness": [[1.1, 1.3, 1.2], [1.0, 1.4], [2.0, 2.2, 2.4]], "plain": [[1.0, 1.0, 1.1], [1.0, 1.2], [2.0]]}
    f = overhead.figures(times)
    # round means: harness 1.2, 1.2, 2.2; plain 1.0333, 1.1, 2.0
    assert f["per_round"][2] == pytest.approx({"harness": 2.2, "plain": 2.0})
    assert f["vs_plain"] == pytest.approx({"median": 0.1, "min": 1.2 / 1.1 - 1, "max": 1.2 / (3.1 / 3) - 1})
    assert f["step_s"]["harness"]["median"] == pytest.approx(1.35) and f["step_s"]["harness"]["n"] == 8  # pooled
    row = overhead.markdown({"rounds": 3, "steps": 3, "warmup": 1, "configs": [
        {"name": "zero1 x2", "status": "ok", "loss_max_diff": 0.0, **f}]}).splitlines()[-1]
    assert "+10.0% [+9.1%, +16.1%]" in row


def test_paired_blocks_give_the_median_ratio_with_its_order_statistic_interval():
    # block ratios of means - 1: 1.1/1.0, 2.0/2.0, 0.9/1.0, 3.3/3.0 -> +10%, 0%, -10%, +10% (a mean, not a median: a
    # block's one slow step, where the harness's loop syncs, counts)
    pairs = {"harness": [[1.0, 1.0, 1.3], [2.0], [0.9, 0.9], [3.3]], "plain": [[1.0], [2.0, 2.0], [1.0], [3.0]]}
    p = overhead.paired(pairs)
    assert p["median"] == pytest.approx(0.05) and p["blocks"] == 4 and p["ratios"] == pytest.approx([-0.1, 0, 0.1, 0.1])
    assert p["ci_low"] is None and p["ci_high"] is None  # 4 pairs: even the whole sample covers only 1 - 2/16 = 87.5%
    assert p["step_s"] == pytest.approx({"harness": 10.4 / 7, "plain": 9.0 / 5})  # pooled: means of all steps
    assert overhead.paired_text(p) == "+5.0% (4 block pairs, too few for a 95% CI)"
    # n = 6: P(Bin(6, 1/2) = 0) = 1/64 <= 0.025 < 7/64: j = 1, the whole sample (coverage 1 - 2/64 = 96.9%)
    assert overhead.median_ci([1.0, 2, 3, 4, 5, 6]) == (1.0, 6)
    assert overhead.median_ci([1.0, 2, 3, 4, 5]) is None  # 2/32 = 6.25% outside even the whole sample
    # n = 25: P(X <= 7) = 0.0216 <= 0.025 < P(X <= 8) = 0.0539: j = 8, k = 18 (the 8th and 18th smallest)
    assert overhead.median_ci([i / 100 for i in range(1, 26)]) == pytest.approx((0.08, 0.18))
    assert overhead.median_ci([i / 100 for i in range(1, 36)]) == pytest.approx((0.12, 0.24))  # 35: the 12th, 24th
    assert overhead.paired({"harness": [], "plain": []}) is None
    p = overhead.paired({"harness": [[1.0 + i / 100] for i in range(6)], "plain": [[1.0]] * 6})
    assert overhead.paired_text(p) == "+2.5% (95% CI +0.0%..+5.0%; 6 block pairs)"


def test_a_sweep_s_rounds_pool_each_configuration_s_launches():
    """`--rounds N`: each configuration launched N times, round by round, its timed steps pooled into one entry (the
    median, p10-p90 and the rates from them); a launch that failed stands for the configuration."""
    from harness.bench import report
    from harness.bench.sweep import pooled

    def launch(steps: list[float], peak: float, mem: int) -> dict:
        return {"name": "zero2 x1", "status": "ok", "step_s": {"median": sorted(steps)[len(steps) // 2]},
                "step_s_values": steps, "tokens_per_s": 1000 / sorted(steps)[len(steps) // 2], "global_batch": 8,
                "peak_mem_bytes": mem, "peak_flops_measured": peak}

    one = pooled([launch([0.1, 0.3, 0.2], 5e9, 100), launch([0.4, 0.5, 0.6], 7e9, 300), launch([0.9], 6e9, 200)])
    assert one["step_s_values"] == [0.1, 0.3, 0.2, 0.4, 0.5, 0.6, 0.9] and one["rounds"] == 3
    assert one["step_s"]["median"] == 0.4 and one["tokens_per_s"] == pytest.approx(1000 / 0.4)
    assert one["samples_per_s"] == pytest.approx(8 / 0.4) and one["peak_mem_bytes"] == 300
    assert one["peak_flops_measured"] == 6e9
    failed = {"name": "zero2 x1", "status": "timeout", "error": "timed out"}
    assert pooled([launch([0.1], 1e9, 1), failed]) is failed
    assert "3 launches each, interleaved" in report._rounds(3) and report._rounds(1) == ""

def test_training_processes_keep_freed_host_memory_unless_the_user_set_glibc_s_thresholds():
    """`world.keep_freed_host_memory` (called by init_world and the plain loop) fixes glibc's mmap and trim
    thresholds, so a step's freed memory is reused instead of faulted in again; a user's MALLOC_* setting wins."""
    import subprocess
    import sys

    code = "from harness.distributed.memory import keep_freed_host_memory as k; print(k())"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    glibc = subprocess.run([sys.executable, "-c", "import platform; print(platform.libc_ver()[0])"],
                           capture_output=True, text=True).stdout.strip() == "glibc"
    for extra, expected in (({}, glibc), ({"MALLOC_TRIM_THRESHOLD_": "131072"}, False)):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env={**env, **extra},
                             cwd=ROOT, timeout=60)
        assert out.returncode == 0 and out.stdout.strip() == str(expected), out.stderr[-2000:]


PARTITIONED_BUILD = """
import sys, torch
from harness.distributed.memory import freed_blocks_returned, keep_freed_host_memory, resident_bytes
keep_freed_host_memory()  # the training thresholds, as init_world sets them
start, shares = resident_bytes(), []
with freed_blocks_returned():
    for layer in range(12):  # as deepspeed.zero.Init builds a layer: each parameter whole, then this rank's half
        for mib in (4, 4, 4, 4, 11, 11, 11):
            whole = torch.ones(mib << 18)
            shares.append(whole[: whole.numel() // 2].clone())
            del whole
print((resident_bytes() - start) / sum(s.numel() * 4 for s in shares))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's thresholds")
def test_a_partitioned_build_hands_back_the_whole_tensors_it_freed():
    """While a model is built partitioned, each parameter is allocated whole and cut to this rank's share; with the
    training thresholds the freed whole tensors stayed in glibc's heap (here up to 40% above the shares; a rank of a
    151.5M Llama held more than the whole model). `freed_blocks_returned` maps them on their own: freed, handed back."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PARTITIONED_BUILD], capture_output=True, text=True, env=env, cwd=ROOT,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert float(out.stdout) < 1.08, out.stdout  # what the shares hold, and little more


def test_a_study_cut_short_by_ctrl_c_keeps_what_it_measured(tmp_path, monkeypatch, capsys):
    """Ctrl-C in a sweep: the configurations measured are written, marked as cut short (all was lost, with a
    traceback), and the command ends in one line, exit 130."""
    from harness import cli
    from harness.bench import report

    result = {"configs": [{"name": "zero0 x1"}]}
    with pytest.raises(KeyboardInterrupt):
        with report.kept_if_interrupted(result, 3, lambda: report.save(tmp_path, "bench", result, "table")):
            raise KeyboardInterrupt
    kept = json.loads((tmp_path / "bench.json").read_text())
    assert kept["interrupted"] == "stopped by Ctrl-C after 1 of 3 configurations"
    assert kept["configs"] == result["configs"]
    assert f"wrote {tmp_path / 'bench.json'} (stopped by Ctrl-C" in capsys.readouterr().err

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setitem(cli.COMMANDS, "keys", interrupted)
    assert cli.main(["keys"]) == 130 and capsys.readouterr().err == "harness: interrupted\n"
