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
from slipstream.models.transformer import build_model
from slipstream.optimize.activations import activation_memory_bytes, apply_activation_checkpointing
from slipstream.plan.accuracy import TARGET_ERROR, Case, default_cases, measure_case, plan_case, stratified_cases
from slipstream.plan.memory import GIB, block_activation_bytes, estimate_memory, in_flight_microbatches, model_state_bytes
from slipstream.plan.model import resolve_model
from slipstream.plan.space import PlanModel, Strategy


def _cfg(preset: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**PRESETS[preset], "preset": preset, "vocab_size": 256, **overrides})


COMMITTED_REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "planner-accuracy-cpu.json"


def _worst_error(cases: list[Case]) -> tuple[str, float]:
    # Bytes are counted, not timed, and do not depend on the thread count: one thread, which other
    # work on the 2 cores does not stall as it does two (the subset: 15 s, or 40 s on a loaded machine).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        errors = {}
        for case in cases:
            measured, planned = measure_case(case), plan_case(case)
            errors[case.label()] = (planned - measured) / measured
    finally:
        torch.set_num_threads(threads)
    worst = max(errors, key=lambda k: abs(errors[k]))
    return worst, errors[worst]


def test_planned_peak_within_target_of_measured_on_a_stratified_subset():
    """The guard of the accuracy report, in CI: the planned peak within 10 % of the measured one
    on `stratified_cases()`, 12 of the grid's cases covering every model family, data-parallel
    strategy, AC mode, precision, accumulation (with and without sharding), the fused loss and
    the 16-rank world, the committed grid's worst case among them.

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
    from slipstream.plan.accuracy import device_cases, run_device_accuracy

    assert len(device_cases()) >= 10 and all(c.seq_len == 1024 for c in device_cases())
    case = Case("tiny", Strategy(micro_batch=4, precision="fp32"), seq_len=64)
    (row,) = run_device_accuracy("cpu", "1xcpu", [case])
    assert abs(row["error"]) < TARGET_ERROR
    assert row["measured_step_s"] > 0 and row["planned_step_s"] > 0 and row["measured_reserved_bytes"] is None
