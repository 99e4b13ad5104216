"""The on-paper scaling model behind `harness plan --gpus-per-node/--nodes/--interconnect`: communication volumes
against hand-computed numbers, the pipeline bubble, a real resolved plan rendered, bad input refused, and a
`harness bench` profile used for compute time. In-process and fast: no training, no subprocess."""
from __future__ import annotations

import dataclasses
import json

import pytest

from harness.config.run import ConfigError
from harness.config.layout import Layout
from harness.config.ds import model_state_bytes
from harness.plan.render import bubble_fraction, meta_model, persistent_count
from harness.plan.scaling import (EFFICIENCY, GPUS, LINKS, bubble_factor, collective_bytes, estimate, offload_bytes,
                                   render_scaling, tp_step_bytes, zero_step_bytes, zero_volume_bytes)
from harness.plan.resolve import make_plan

STEPS = ["train.max_steps=10"]


def n_params(plan) -> int:
    return sum(p.numel() for p in meta_model(plan).parameters())


def device_states(n: int, plan, dp: int) -> int:
    """The ZeRO accounting of config.ds for `dp` data-parallel ranks (ZeRO-3's small tensors whole on each)."""
    return model_state_bytes(n, dataclasses.replace(plan.ds, layout=Layout(dp, dp)), persistent_count(plan))["device"]


def test_ring_collectives_per_gpu():
    assert collective_bytes("all-reduce", 8, 1e9) == pytest.approx(1.75e9)       # 2 x 7/8
    assert collective_bytes("all-gather", 8, 1e9) == pytest.approx(0.875e9)      # 7/8
    assert collective_bytes("reduce-scatter", 4, 1e9) == pytest.approx(0.75e9)   # 3/4
    assert collective_bytes("all-reduce", 1, 1e9) == 0                            # alone: nothing sent
    with pytest.raises(ValueError):
        collective_bytes("broadcast", 8, 1e9)


def test_zero_volumes_match_the_paper():
    # Psi = 1e9 parameters, 8 data-parallel ranks, bf16 (2 bytes)
    for stage in (0, 1, 2):
        assert zero_volume_bytes(stage, 8, 1e9, 2) == pytest.approx(2 * 7 / 8 * 1e9 * 2)  # 3.5e9
    assert zero_volume_bytes(3, 8, 1e9, 2) == pytest.approx(5.25e9)                       # 3 x 7/8 x 2e9
    assert zero_volume_bytes(3, 8, 1e9, 4) == pytest.approx(10.5e9)                       # fp32 doubles it
    assert zero_volume_bytes(3, 1, 1e9, 2) == 0


def test_zero_volumes_per_step_follow_deepspeed_accumulation():
    # 4 micro-batches: stages 0-1 reduce once at the boundary; stage 2 reduce-scatters each micro-batch and
    # all-gathers once; stage 3 repeats its whole pass per micro-batch.
    assert zero_step_bytes(1, 8, 1e9, 2, 4) == pytest.approx(3.5e9)
    assert zero_step_bytes(2, 8, 1e9, 2, 4) == pytest.approx(4 * 1.75e9 + 1.75e9)
    assert zero_step_bytes(3, 8, 1e9, 2, 4) == pytest.approx(4 * 5.25e9)
    assert zero_step_bytes(2, 8, 1e9, 2, 1) == pytest.approx(zero_volume_bytes(2, 8, 1e9, 2))


def test_tensor_parallel_all_reduces_and_bubble():
    act = 8 * 128 * 128 * 2  # one (B=8, seq=128, d_model=128) activation in bf16: 262,144 bytes
    # 4 all-reduces per layer per micro-batch, each 2 (tp-1)/tp x act = act for tp = 2; 2 layers, 3 micro-batches
    assert tp_step_bytes(2, 2, 3, act) == pytest.approx(4 * 2 * 3 * act)
    assert tp_step_bytes(4, 1, 1, act) == pytest.approx(4 * 1.5 * act)
    assert tp_step_bytes(1, 2, 3, act) == 0
    assert bubble_factor(2, 4) == pytest.approx(5 / 4)
    assert bubble_factor(4, 8) == pytest.approx(11 / 8)
    assert bubble_factor(1, 8) == 1
    # the same bubble `harness plan` prints: idle share = 1 - 1 / factor
    assert 1 - 1 / bubble_factor(4, 8) == pytest.approx(bubble_fraction(4, 8))


def test_offload_moves_shards_over_pcie():
    assert offload_bytes(1e9, 2, 4, optimizer=True, params=False) == pytest.approx(4e9)   # grads out + params back
    assert offload_bytes(1e9, 2, 4, optimizer=True, params=True) == pytest.approx(4e9 + 16e9)  # + 2 per micro-batch
    assert offload_bytes(1e9, 2, 4, optimizer=False, params=False) == 0


def test_render_zero3_on_32_gpus():
    plan = make_plan(None, STEPS, "configs/ds/zero3.json", world_size=1, accel_precision="bf16")
    n = n_params(plan)
    lines = render_scaling(plan, n, 8, 4, "ib-ndr400")
    assumes = [line for line in lines if line.startswith("assume:")]
    assert len(assumes) >= 8
    assert any("6 x params x tokens" in a and "MFU 40%" in a for a in assumes)
    assert any("ib-ndr400 50 GB/s" in a for a in assumes)
    assert any(line.startswith("layout: data 32 x tensor 1 x pipeline 1 = world 32") and "span nodes" in line
               for line in lines)
    assert any(line.startswith("speedup vs 1 GPU") and "scaling efficiency" in line for line in lines)
    assert any(line.startswith("memory per GPU") and "fits" in line for line in lines)

    s = estimate(plan, n, 8, 4, "ib-ndr400")
    micro = plan.run.cfg.train.micro_batch_size
    assert s.volume["data parallel"] == pytest.approx(zero_step_bytes(3, 32, n, 2, 1))
    assert s.seconds["data parallel"] == pytest.approx(s.volume["data parallel"] / (EFFICIENCY * 50e9))  # over IB
    assert s.compute_s == pytest.approx(6 * n * micro * 128 / (0.40 * GPUS["H100"].flops_16bit))
    assert s.states["device"] == device_states(n, plan, 32)  # sharded 32 ways, its tensors under 1e5 elements aside
    assert s.lower_s <= s.upper_s
    assert s.gpu == "H100"
    # on one node the same group stays on NVLink: 9x faster per byte
    one_node = estimate(plan, n, 8, 1, "ib-ndr400")
    assert not one_node.spans["dp"]
    assert one_node.seconds["data parallel"] == pytest.approx(one_node.volume["data parallel"] / (EFFICIENCY * 450e9))
    slow = estimate(plan, n, 8, 4, "pcie4:ethernet-100g")
    assert slow.seconds["data parallel"] == pytest.approx(s.volume["data parallel"] / (EFFICIENCY * 12.5e9))


def test_pipeline_bubble_and_model_split_in_compute():
    plan = make_plan(None, STEPS + ["train.grad_accum_steps=4"], "configs/ds/pp2_zero1.json", world_size=2,
                     accel_precision="bf16")
    n = n_params(plan)
    s = estimate(plan, n, 8, 1, "ib-ndr400")
    per_gpu = 6 * n * plan.run.cfg.train.micro_batch_size * 4 * 128 / (0.40 * GPUS["H100"].flops_16bit) / 2  # half
    # of the model on each of the 2 stages
    assert s.compute_s == pytest.approx(per_gpu * 5 / 4)                                   # (m + p - 1) / m
    assert s.layout.dp_size == 4 and s.volume["pipeline sends"] > 0
    # 1F1B: the first stage holds min(p, m) = 2 micro-batches of half the layers: all layers' worth of one
    full = 34 * 128 * plan.run.cfg.train.micro_batch_size * 128 * 2  # 34 seq B d_model layers, 16-bit
    assert s.activations == pytest.approx(full)
    one = make_plan(None, STEPS, "configs/ds/pp2_zero1.json", world_size=2, accel_precision="bf16")  # m = 1
    assert estimate(one, n, 8, 1, "ib-ndr400").activations == pytest.approx(full / 2)
    # tensor parallel 2 splits 24 of the 34 bytes (Korthikanti et al.): 10 + 24/2
    tp = make_plan(None, STEPS, "configs/ds/tp2_zero1.json", world_size=2, accel_precision="bf16")
    assert estimate(tp, n, 8, 1, "ib-ndr400").activations == pytest.approx(full * 22 / 34)
    assert any("1F1B bubble" in line for line in render_scaling(plan, n, 8, 1, "ib-ndr400"))


def test_impossible_inputs_are_config_errors():
    plan = make_plan(None, STEPS, "configs/ds/zero3.json", world_size=1)
    with pytest.raises(ConfigError, match="unknown link 'infiniband'.*ib-ndr400.*ethernet-100g"):
        render_scaling(plan, 1000, 8, 2, "infiniband")
    with pytest.raises(ConfigError, match="unknown link 'nvlink9'"):
        render_scaling(plan, 1000, 8, 2, "nvlink9:ib-ndr400")
    tp = make_plan(None, STEPS, "configs/ds/tp2_zero1.json", world_size=2)
    with pytest.raises(ConfigError, match="not a multiple of tensor parallel 2"):
        render_scaling(tp, 1000, 3, 1, "ib-ndr400")
    with pytest.raises(ConfigError, match="must fit inside one node"):
        render_scaling(tp, 1000, 1, 4, "ib-ndr400")
    with pytest.raises(ConfigError, match="at least 1"):
        render_scaling(plan, 1000, 0, 4, "ib-ndr400")
    sp = make_plan(None, STEPS, "configs/ds/sp2_zero3.json", world_size=2)  # its figures had been of a world of dp x 1
    with pytest.raises(ConfigError, match="does not model sequence parallelism"):
        render_scaling(sp, 1000, 8, 1, "ib-ndr400")


def test_profile_gives_compute_time_and_activations(tmp_path):
    plan = make_plan(None, STEPS + ["train.grad_accum_steps=2"], "configs/ds/fp32.json", world_size=1)  # pinned
    n, micro = n_params(plan), plan.run.cfg.train.micro_batch_size
    states = device_states(n, plan, 1)
    bench = {"device": {"name": "NVIDIA H100 80GB HBM3", "peak_flops_table": 989e12, "peak_flops_measured": 7e14},
             "configs": [
                 {"nproc": 2, "status": "ok", "precision": "fp32", "step_s": {"median": 9.0}, "global_batch": 16,
                  "params": n, "peak_mem_bytes": states},
                 {"nproc": 1, "status": "failed", "precision": "fp32"},
                 {"nproc": 1, "status": "ok", "precision": "bf16", "step_s": {"median": 7.0}, "global_batch": micro,
                  "params": n, "peak_mem_bytes": states},
                 {"nproc": 1, "status": "ok", "precision": "fp32", "step_s": {"median": 0.5}, "global_batch": micro,
                  "params": n, "peak_mem_bytes": states + 10**8, "flops_per_step": 1e12}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    s = estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path)
    assert s.compute_s == pytest.approx(0.5 * 2)        # the fp32 entry, twice the samples (accumulation 2)
    assert s.one_gpu_s == pytest.approx(0.5 * 2)        # no communication, no offload on one GPU
    assert s.activations == pytest.approx(10**8)        # peak minus model states, same micro batch
    assert s.gpu == "H100"
    lines = render_scaling(plan, n, 8, 2, "ib-ndr400", profile_path=path)
    assert any(line.startswith("assume: compute from the profile") for line in lines)
    assert any(line.startswith("assume: activations from the profile") for line in lines)
    # a profile step of 2 micro-batches' worth in one forward: half the time per sample, activations per sample
    bench["configs"][-1]["global_batch"] = 2 * micro
    path.write_text(json.dumps(bench))
    s = estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path)
    assert s.compute_s == pytest.approx(0.5) and s.activations == pytest.approx(10**8 / 2)
    bench["configs"][-1]["sets"] = [f"train.micro_batch_size={micro}"]  # ... unless its overrides say it accumulated
    path.write_text(json.dumps(bench))
    assert estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path).activations == pytest.approx(10**8)
    bench["configs"][-1]["sets"].append("data.seq_len=64")  # half the plan's 128 tokens per sample
    path.write_text(json.dumps(bench))
    s = estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path)
    assert s.compute_s == pytest.approx(0.5 * 2) and s.activations == pytest.approx(2 * 10**8)
    bench["configs"][-1]["sets"] = []
    # a profile of half the model on an unknown device: compute scales with parameters, memory cap unknown
    bench["device"]["name"] = "Some CPU"
    bench["configs"][-1].update(params=n // 2, global_batch=micro)
    path.write_text(json.dumps(bench))
    s = estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path)
    assert s.compute_s == pytest.approx(0.5 * 2 * n / (n // 2))
    # ... and its peak memory says nothing about this model: the stated formula instead (fp32: doubled)
    assert s.activations == pytest.approx(34 * 128 * micro * 128 * 2 * 2)
    assert s.gpu is None and "GPU memory unknown" in s.assumptions[-1]
    assert all(": fits" not in line for line in render_scaling(plan, n, 8, 2, "ib-ndr400", profile_path=path))
    # a CPU profile's peak is the whole process's: its measured activations are taken instead
    bench["configs"][-1].update(params=n, peak_mem_bytes=states + 10**9, activation_bytes=3 * 10**7)
    path.write_text(json.dumps(bench))
    assert estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path).activations == pytest.approx(3 * 10**7)
    del bench["configs"][-1]["activation_bytes"]
    path.write_text(json.dumps(bench))
    assert estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path).activations == \
        pytest.approx(34 * 128 * micro * 128 * 2 * 2)  # not peak - states: the formula


def test_bad_profiles_are_config_errors(tmp_path):
    plan = make_plan(None, STEPS, "configs/ds/zero3.json", world_size=1)
    with pytest.raises(ConfigError, match="not found"):
        render_scaling(plan, 1000, 8, 1, "ib-ndr400", profile_path=tmp_path / "missing.json")
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"zero_optimization": {"stage": 3}}))
    with pytest.raises(ConfigError, match="not a bench.json"):
        render_scaling(plan, 1000, 8, 1, "ib-ndr400", profile_path=other)
    other.write_text(json.dumps({"configs": [{"nproc": 2, "status": "ok"}]}))
    with pytest.raises(ConfigError, match="nproc"):
        render_scaling(plan, 1000, 8, 1, "ib-ndr400", profile_path=other)
    other.write_text(json.dumps({"configs": [{"nproc": 1, "status": "ok", "step_s": 0.5}]}))
    with pytest.raises(ConfigError, match="lacks step_s.median"):
        render_scaling(plan, 1000, 8, 1, "ib-ndr400", profile_path=other)


def test_presets_are_stated_in_bytes_per_second():
    assert LINKS["ib-ndr400"].bytes_per_s == 400e9 / 8 and LINKS["ethernet-100g"].bytes_per_s == 100e9 / 8
    assert GPUS["H100"].memory == 80 * 2**30


def test_plan_command_prints_the_estimate_and_refuses_bad_input():
    from test_plan import plan

    out = plan("--ds", "configs/ds/zero3.json", "--set", "train.max_steps=10", "--gpus-per-node", "8", "--nodes",
               "4", "--interconnect", "ib-ndr400")
    assert out.returncode == 0, out.stderr
    assert "# scaling on paper: 4 node(s) x 8 GPUs = 32 GPUs over ib-ndr400" in out.stdout
    assert "assume: ring collectives" in out.stdout and "speedup vs 1 GPU" in out.stdout
    assert "layout: data 32 x tensor 1 x pipeline 1 = world 32\n" in out.stdout  # the plan of the estimate's world
    out = plan("--ds", "configs/ds/tp2_zero1.json", "--set", "train.max_steps=10", "--gpus-per-node", "8")
    assert out.returncode == 0 and "layout: data 4 x tensor 2 x pipeline 1 = world 8" in out.stdout, out.stderr
    out = plan("--ds", "configs/ds/zero3.json", "--set", "train.max_steps=10", "--gpus-per-node", "8",
               "--world-size", "3")
    assert out.returncode == 2 and "--world-size 3 and --gpus-per-node 8 x --nodes 1 = 8: one world" in out.stderr
    out = plan("--ds", "configs/ds/zero3.json", "--set", "train.max_steps=10", "--gpus-per-node", "8",
               "--interconnect", "carrier-pigeon")
    assert out.returncode == 2 and "carrier-pigeon" in out.stderr and "ib-ndr400" in out.stderr


def test_auto_precision_is_estimated_as_the_target_gpu_trains_it():
    """zero3.json leaves the precision "auto": fp32 on this CPU host, bf16 on the H100 the estimate is for."""
    host = make_plan(None, STEPS, "configs/ds/zero3.json", world_size=1)
    assert host.ds.precision == "fp32"
    pinned = make_plan(None, STEPS, "configs/ds/zero3.json", world_size=1, accel_precision="bf16")
    n = n_params(host)
    auto, bf16 = estimate(host, n, 8, 1, "ib-ndr400"), estimate(pinned, n, 8, 1, "ib-ndr400")
    assert auto.compute_s == pytest.approx(bf16.compute_s)       # the 16-bit peak, not the fp32 one
    assert auto.volume == pytest.approx(bf16.volume) and auto.states == bf16.states
    assert any("training precision bf16" in a and "resolved it to fp32" in a for a in auto.assumptions)
    fp32 = make_plan(None, STEPS, "configs/ds/fp32.json", world_size=1)  # pinned fp32 stays fp32
    s = estimate(fp32, n, 8, 1, "ib-ndr400")
    assert s.compute_s == pytest.approx(6 * n * fp32.run.cfg.train.micro_batch_size * 128
                                        / (0.40 * GPUS["H100"].flops_fp32))
    assert any("training precision fp32: as the DeepSpeed file" in a for a in s.assumptions)


def test_activation_checkpointing_and_a_profile_measured_with_it_are_what_the_estimate_takes(tmp_path):
    """train.activation_checkpointing: each layer's input kept and one layer's whole (it took the full 34 a layer);
    a profile of several entries: the one measured with the run's own compared values (it took the first)."""
    sets = STEPS + ["train.activation_checkpointing=true"]
    plan = make_plan(None, sets, "configs/ds/fp32.json", world_size=1)
    n, c = n_params(plan), plan.run.cfg
    full = 34 * c.data.seq_len * c.train.micro_batch_size * c.model.d_model * c.model.n_layers * 2  # fp32: x2
    s = estimate(plan, n, 8, 2, "ib-ndr400")
    assert s.activations == pytest.approx(full * 2 / 34 + full / c.model.n_layers)  # inputs, and one layer's 34
    assert any("with train.activation_checkpointing" in a for a in s.assumptions)
    entry = {"nproc": 1, "status": "ok", "precision": "fp32", "global_batch": c.train.micro_batch_size, "params": n,
             "activation_bytes": 10**6}
    bench = {"device": {"name": "Some CPU"}, "configs": [
        {**entry, "step_s": {"median": 0.5}, "sets": ["train.activation_checkpointing=false"]},
        {**entry, "step_s": {"median": 0.7}, "sets": ["train.activation_checkpointing=true"]}]}
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(bench))
    assert estimate(plan, n, 8, 2, "ib-ndr400", profile_path=path).compute_s == pytest.approx(0.7)
