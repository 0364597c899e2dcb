"""The committed accuracy report (benchmarks/planner-accuracy-cpu.json) is within its memory
target, and the comparison with published runs plans each run as it ran (its ZeRO model states,
its experts) from a named source. That the committed rows are today's, the fitted constants and
the held-out speed median are pinned by tests/unit/test_planner_accuracy_pins.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from slipstream.plan.accuracy import TARGET_ERROR
from slipstream.plan.published import PUBLISHED_RUNS
from slipstream.plan.report import published_report
from slipstream.plan.timing import DEFAULT_EFFICIENCY

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "planner-accuracy-cpu.json"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(REPORT.read_text())


def test_committed_memory_report_is_within_target(committed):
    rows = committed["memory_cases"]
    assert rows
    assert committed["memory_worst_error"] <= TARGET_ERROR
    assert all(abs(r["error"]) <= TARGET_ERROR for r in rows)
    assert committed["env"]["git_sha"]


def test_zero_model_states_match_where_the_accounting_agrees():
    rows = {r["run"]: r for r in published_report(DEFAULT_EFFICIENCY, held_out=False)}
    assert abs(rows["zero-fig1-7.5b-64gpu-baseline-dp"]["error"]) < 0.01
    assert abs(rows["zero-fig1-7.5b-64gpu-pos-g-p"]["error"]) < 0.05


def test_every_published_run_names_its_source():
    for run in PUBLISHED_RUNS:
        assert run.source and ("http" in run.source), run.name
        assert any(v is not None for v in (run.tflops_per_gpu, run.mfu, run.tokens_per_s_per_gpu, run.memory_gib_per_gpu))


def test_published_moe_runs_plan_their_experts():
    """A published run's n_experts / experts_top_k become the model's moe_* fields (experts as
    wide as d_ff, in every block), and its ep layout is planned with the all-to-all."""
    import dataclasses

    from slipstream.models.flops import param_count
    from slipstream.plan.report import _model, _strategy, compare_run

    dense = next(r for r in PUBLISHED_RUNS if r.name == "torchtitan-llama3.1-8b-fsdp-8gpu")
    run = dataclasses.replace(dense, name="moe-8x8b", n_experts=8, experts_top_k=2, ep=8)
    model = _model(run)
    assert model.moe and (model.cfg.moe_experts, model.cfg.moe_top_k, model.cfg.moe_expert_hidden) == (8, 2, 0)
    assert param_count(model.cfg).moe_layers == run.n_layer
    assert _strategy(run).ep == 8 and _model(dense).moe is False
    assert [c.metric for c in compare_run(run, DEFAULT_EFFICIENCY)] == [c.metric for c in compare_run(dense, DEFAULT_EFFICIENCY)]
