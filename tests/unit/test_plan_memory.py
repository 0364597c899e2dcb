"""The memory model against measurements (MemTracker / FSDPMemTracker on a fake process
group) and against the bytes autograd really keeps, plus its structural rules."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.models.flops import param_count
from slipstream.models.transformer import build_model
from slipstream.optimize.activations import activation_memory_bytes, apply_activation_checkpointing
from slipstream.plan.accuracy import TARGET_ERROR, plan_case
from slipstream.plan.accuracy_cases import Case, default_cases, stratified_cases
from slipstream.plan.accuracy_measure import measure_case
from slipstream.plan.memory import GIB, estimate_memory, in_flight_microbatches
from slipstream.plan.memory_activations import block_activation_bytes
from slipstream.plan.memory_states import model_state_bytes
from slipstream.plan.model import resolve_model
from slipstream.plan.space import PlanModel, Strategy


def _cfg(preset: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**PRESETS[preset], "preset": preset, "vocab_size": 256, **overrides})


COMMITTED_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "planner-accuracy-cpu.json"


def _worst_error(cases: list[Case]) -> tuple[str, float]:
    # Bytes are counted, not timed, and do not depend on the thread count: one thread, which other
    # work on the 2 cores does not stall as it does two (the subset: 15 s, or 40 s on a loaded machine).
    errors = {}
    for case in cases:
        measured, planned = measure_case(case, threads=1), plan_case(case)
        errors[case.label()] = (planned - measured) / measured
    worst = max(errors, key=lambda k: abs(errors[k]))
    return worst, errors[worst]


def test_planned_peak_within_target_of_measured_on_a_stratified_subset():
    """The guard of the accuracy report, in CI: the planned peak within 10 % of the measured one
    on `stratified_cases()`, 21 of the grid's cases covering every model family, data-parallel
    strategy, AC mode, precision, accumulation (with and without sharding), the fused loss, the
    16-rank world, QAT, low-bit optimizer states and the stacks' mixed-precision states (Megatron,
    DeepSpeed, FSDP2 reducing in bf16), the committed grid's worst case among them.

    Why not the whole grid: measuring all 52 cases took ~425 s on 2 shared cores before the
    MemTracker speed-up (over the 300 s per-test limit) and still takes 27-60 s after, 2-4x the
    subset, while the committed whole-grid result is pinned by
    tests/unit/test_planner_accuracy_pins.py (every planned number recomputed, a measurement
    re-taken). SLIPSTREAM_SLOW_BENCH=1 runs the whole grid (the next test)."""
    grid, cases = default_cases(), stratified_cases()
    assert len(grid) >= 40
    assert {c.strategy.dp_strategy for c in grid} == {"none", "ddp", "zero1", "zero2", "fsdp"}
    assert max(c.strategy.dp for c in grid) >= 16
    assert {c.preset for c in cases} == {c.preset for c in grid}
    for field in ("dp_strategy", "dp", "ac", "precision", "grad_accum", "fused_loss"):
        assert {getattr(c.strategy, field) for c in cases} == {getattr(c.strategy, field) for c in grid}, field
    assert {c.strategy.dp_strategy == "none" for c in cases if c.strategy.grad_accum > 1} == {True, False}
    assert any(c.qat != "none" for c in cases) and any(c.state_dtype != "fp32" for c in cases)
    committed = json.loads(COMMITTED_REPORT.read_text())["memory_cases"]
    worst_committed = max(committed, key=lambda r: abs(r["error"]))["case"]
    assert worst_committed in [c.label() for c in cases], \
        f"the committed grid's worst case {worst_committed} is not in stratified_cases(): add it there"
    worst, error = _worst_error(cases)
    assert abs(error) <= TARGET_ERROR, f"{worst}: {error:+.1%}"


@pytest.mark.skipif(os.environ.get("SLIPSTREAM_SLOW_BENCH") != "1",
                    reason="27-60 s on 2 cores; CI runs the stratified subset above; SLIPSTREAM_SLOW_BENCH=1 runs it")
def test_planned_peak_within_target_of_measured_on_the_whole_grid():
    """The guard of the accuracy report: every case of `slipstream bench planner` within 10%."""
    worst, error = _worst_error(default_cases())
    assert abs(error) <= TARGET_ERROR, f"{worst}: {error:+.1%}"


@pytest.mark.parametrize("preset,overrides", [
    ("tiny", {}), ("tiny", {"norm": "rmsnorm"}), ("llama-tiny", {}), ("llama-tiny", {"n_kv_head": 4}),
    ("tiny", {"mlp": "swiglu", "position": "rope"}),
])
@pytest.mark.parametrize("ac", ["none", "selective", "full"])
def test_block_activation_bytes_equal_what_autograd_keeps(preset, overrides, ac):
    """Per block, the formula equals the storages a real forward keeps alive (fp32)."""
    batch, seq = 4, 64
    kept = []
    for n_layer in (1, 2):
        cfg = _cfg(preset, n_layer=n_layer, **overrides)
        model = apply_activation_checkpointing(build_model(cfg), ac)
        idx = torch.randint(0, 256, (batch, seq))
        kept.append(activation_memory_bytes(model, lambda: idx))
    planned = block_activation_bytes(PlanModel(preset, cfg), batch * seq, Strategy(ac=ac, precision="fp32"))
    assert planned == pytest.approx(kept[1] - kept[0], rel=0.01)


def test_bf16_autocast_block_keeps_low_precision_copies():
    cfg = _cfg("tiny", n_layer=2)
    fp32 = block_activation_bytes(PlanModel("tiny", cfg), 256, Strategy(precision="fp32"))
    bf16 = block_activation_bytes(PlanModel("tiny", cfg), 256, Strategy(precision="bf16"))
    # matmul outputs halve, the fp32 residual stream does not, and each matmul gets its own bf16 input copy
    assert 0.5 * fp32 < bf16 < fp32


def test_model_states_follow_the_zero_stages():
    s = dict(dp=64)
    n = 7.5e9
    ddp = sum(model_state_bytes(n, Strategy(dp_strategy="ddp", **s)))
    zero1 = sum(model_state_bytes(n, Strategy(dp_strategy="zero1", **s)))
    zero2 = sum(model_state_bytes(n, Strategy(dp_strategy="zero2", **s)))
    fsdp = sum(model_state_bytes(n, Strategy(dp_strategy="fsdp", **s)))
    assert ddp == 16 * n                      # 4 + 4 + 2 x 4 bytes per parameter
    assert zero1 == pytest.approx(8 * n + 8 * n / 64)
    # slipstream's zero2 is FSDP2 without resharding after forward: all storage is sharded and
    # the gathered copy is a temporary (counted in the temporaries, see the next test)
    assert zero2 == fsdp == pytest.approx(16 * n / 64)
    hsdp = Strategy(dp_strategy="hsdp", dp=64, dp_shard=8)
    assert sum(model_state_bytes(n, hsdp)) == pytest.approx(16 * n / 8)


def test_zero2_holds_the_gathered_parameters_fsdp_does_not():
    model = resolve_model("llama-8b")
    zero2 = estimate_memory(model, Strategy(dp_strategy="zero2", dp=8, precision="bf16"), 2048)
    fsdp = estimate_memory(model, Strategy(dp_strategy="fsdp", dp=8, precision="bf16"), 2048)
    gathered_bf16 = 8.0e9 * 2
    assert zero2.breakdown["temporaries"] - fsdp.breakdown["temporaries"] == pytest.approx(gathered_bf16, rel=0.1)


def test_structural_rules_of_the_peak():
    model = resolve_model("llama-8b")
    base = Strategy(dp_strategy="fsdp", dp=8, micro_batch=2, precision="bf16")
    peaks = {ac: estimate_memory(model, base.replace(ac=ac), 8192).total_bytes for ac in ("none", "selective", "full")}
    assert peaks["full"] < peaks["selective"] < peaks["none"]
    # more shards: smaller states, same activations
    wide = estimate_memory(model, base.replace(dp=64), 8192)
    narrow = estimate_memory(model, base, 8192)
    assert wide.breakdown["optimizer_state"] == pytest.approx(narrow.breakdown["optimizer_state"] / 8, rel=1e-6)
    assert wide.breakdown["activations"] == narrow.breakdown["activations"]
    # offload moves the sharded states to the host
    off = estimate_memory(model, base.replace(offload=True), 8192)
    assert off.breakdown["optimizer_state"] == 0 and off.host_bytes > 0
    # the fused loss never holds all logits
    assert estimate_memory(model, base.replace(fused_loss=True), 8192).total_bytes < narrow.total_bytes
    # CUDA plans carry the allocator margin, CPU plans do not
    assert narrow.fragmentation_bytes > 0
    assert estimate_memory(model, base, 8192, device="cpu").fragmentation_bytes == 0


def test_tensor_and_sequence_parallel_split_activations():
    model = resolve_model("llama-70b")
    tokens = 8192
    one = block_activation_bytes(model, tokens, Strategy(precision="bf16"))
    tp8_sp = block_activation_bytes(model, tokens, Strategy(tp=8, precision="bf16"))
    tp8 = block_activation_bytes(model, tokens, Strategy(tp=8, sequence_parallel=False, precision="bf16"))
    assert tp8_sp == pytest.approx(one / 8, rel=0.02)
    assert tp8_sp < tp8 < one          # without SP the norms and residuals stay whole


def test_pipeline_schedules_hold_different_numbers_of_micro_batches():
    s = Strategy(pp=4, grad_accum=16)
    assert in_flight_microbatches(s.replace(pp_schedule="gpipe")) == 16
    assert in_flight_microbatches(s.replace(pp_schedule="1f1b")) == 4
    for interleaved in ("interleaved-1f1b", "interleaved"):   # the trainer's name, the planner's alias
        assert in_flight_microbatches(s.replace(pp_schedule=interleaved, pp_virtual=2)) == pytest.approx(4 * (1 + 3 / 8))
    assert in_flight_microbatches(s.replace(pp_schedule="looped-bfs", pp_virtual=2)) == 16   # breadth first
    assert in_flight_microbatches(s.replace(pp_schedule="zbv", pp_virtual=2)) == 4
    assert in_flight_microbatches(s.replace(pp_schedule="dualpipev", pp_virtual=2)) == 5
    assert in_flight_microbatches(s.replace(pp=1)) == 1


def test_a_70b_model_on_one_gpu_is_dominated_by_model_states():
    est = estimate_memory(resolve_model("llama-70b"), Strategy(precision="bf16", ac="full"), 4096)
    assert est.breakdown["optimizer_state"] > 500 * GIB
    assert est.peak_phase in ("forward", "backward", "optimizer")


def test_case_labels_are_unique():
    labels = [c.label() for c in default_cases()]
    assert len(labels) == len(set(labels))
    assert isinstance(Case("tiny", Strategy()).model_config(), ModelConfig)
    assert dataclasses.is_dataclass(Case)


def test_device_accuracy_path_runs_on_cpu():
    """`bench planner --device cuda` runs this code on a GPU; here the same path on the CPU."""
    from slipstream.plan.accuracy import run_device_accuracy
    from slipstream.plan.accuracy_cases import device_cases

    assert len(device_cases()) >= 10 and all(c.seq_len == 1024 for c in device_cases())
    case = Case("tiny", Strategy(micro_batch=4, precision="fp32"), seq_len=64)
    (row,) = run_device_accuracy("cpu", "1xcpu", [case])
    assert abs(row["error"]) < TARGET_ERROR
    assert row["measured_step_s"] > 0 and row["planned_step_s"] > 0 and row["measured_reserved_bytes"] is None


# ---------------------------------------------------------------- mixture of experts (issue 15)

@pytest.mark.parametrize("overrides,ac", [
    ({"moe_gemm": "loop"}, "none"), ({"moe_gemm": "loop"}, "selective"), ({}, "full"),
    ({"moe_shared_experts": 1, "moe_gemm": "grouped"}, "selective"),
    ({"mlp": "gelu", "moe_z_loss": 1e-3, "moe_top_k": 1, "moe_experts": 8, "moe_expert_hidden": 32}, "none"),
])
def test_moe_block_activation_bytes_equal_what_autograd_keeps(overrides, ac):
    """An MoE block keeps its routed rows (tokens x top_k), the experts' inner activations, the
    combine's two copies, the router's scores and the routing indices: as autograd does (fp32)."""
    batch, seq = 4, 64
    kept = []
    for n_layer in (1, 2):
        cfg = _cfg("moe-tiny", n_layer=n_layer, **overrides)
        model = apply_activation_checkpointing(build_model(cfg), ac)
        idx = torch.randint(0, 256, (batch, seq))
        kept.append(activation_memory_bytes(model, lambda: idx))
    planned = block_activation_bytes(PlanModel("moe-tiny", cfg), batch * seq, Strategy(ac=ac, precision="fp32"), moe=True)
    assert planned == pytest.approx(kept[1] - kept[0], rel=0.01)


def test_moe_step_peak_within_target_of_measured():
    """Whole training steps of an MoE model (dense first block, shared experts; FSDP in bf16)."""
    wide = (("n_layer", 4), ("d_model", 128), ("n_head", 4), ("d_ff", 256))
    cases = [Case("moe-tiny", Strategy(micro_batch=8, precision="fp32"),
                  overrides=wide + (("moe_shared_experts", 1), ("moe_first_dense", 1), ("moe_expert_hidden", 64))),
             Case("moe-tiny", Strategy(dp_strategy="fsdp", dp=8, micro_batch=8, precision="bf16"), overrides=wide)]
    worst, error = _worst_error(cases)
    assert abs(error) < TARGET_ERROR, (worst, error)


def test_moe_plan_counts_the_built_models_parameters():
    """One process, no sharding: the planned parameters are the built model's, experts and all."""
    for preset in ("moe-tiny", "deepseek-moe-small"):
        model = resolve_model(preset, vocab=512)
        built = sum(p.numel() for p in build_model(model.cfg).parameters())
        b = estimate_memory(model, Strategy(precision="fp32"), 128, device="cpu").breakdown
        assert b["parameters"] == 4 * built, preset
        assert model.moe and not resolve_model("llama-8b").moe


def test_expert_memory_per_rank_shrinks_with_ep():
    """ddp at ep = dp: each rank holds E / ep experts, unsharded; the dense parts whole."""
    model = resolve_model("mixtral-8x7b")
    pc = param_count(model.cfg)
    params = []
    for ep in (1, 2, 4, 8):
        s = Strategy("ddp", dp=ep, ep=ep, precision="bf16", ac="full") if ep > 1 else Strategy(precision="bf16", ac="full")
        params.append(estimate_memory(model, s, 4096).breakdown["parameters"])
        assert params[-1] == pytest.approx(4 * (pc.total - pc.experts + pc.experts / ep), rel=1e-9)
    assert params == sorted(params, reverse=True)
    # fsdp over 32 ranks: the dense parts over 32, the experts over the 32 / ep holding them
    for ep in (2, 8):
        b = estimate_memory(model, Strategy("fsdp", dp=32, ep=ep, precision="bf16", ac="full"), 4096).breakdown
        assert b["optimizer_state"] == pytest.approx(8 * pc.total / 32, rel=1e-6)
    # the FSDP gather buffers hold E / ep experts of a block: fewer with more ep
    temp = [estimate_memory(model, Strategy("fsdp", dp=32, ep=ep, precision="bf16", ac="full"), 4096)
            .breakdown["temporaries"] for ep in (1, 2, 8)]
    assert temp[0] > temp[1] > temp[2]


def test_moe_activations_grow_with_top_k():
    base = resolve_model("mixtral-8x7b")
    s = Strategy("fsdp", dp=8, ep=8, precision="bf16")
    acts = [estimate_memory(PlanModel("m", dataclasses.replace(base.cfg, moe_top_k=k)), s, 4096).breakdown["activations"]
            for k in (1, 2, 4)]
    assert acts[0] < acts[1] < acts[2]
    # an MoE block is not split by tp: its activations stay whole on every tp rank
    tokens = 4096
    dense, moe = (block_activation_bytes(base, tokens, Strategy(tp=8, precision="bf16"), moe=m) for m in (False, True))
    assert moe > 8 * dense


def test_preflight_plans_the_moe_model_it_runs():
    """The run's own memory check (train.preflight_memory) plans the config's experts and its ep."""
    from slipstream.config import load_config
    from slipstream.plan.preflight import plan_training_memory

    args = ["--model.preset=moe-tiny", "--model.vocab_size=64", "--train.seq_len=128", "--optim.state_dtype=fp32"]
    cfg = load_config(None, args)
    pc = param_count(cfg.model)
    one = plan_training_memory(cfg, 1, "none", 0, "cpu")
    assert one.breakdown["parameters"] == 4 * pc.total
    assert any("mixture of experts" in note for note in one.notes)
    ep2 = plan_training_memory(load_config(None, [*args, "--parallel.dp_strategy=ddp", "--parallel.ep=2"]), 2, "ddp", 0, "cpu")
    assert ep2.breakdown["parameters"] == pytest.approx(4 * (pc.total - pc.experts / 2))
    dense = plan_training_memory(load_config(None, [*args, "--model.moe_experts=0"]), 1, "none", 0, "cpu")
    assert dense.total_bytes < one.total_bytes
