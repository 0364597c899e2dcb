"""The committed accuracy report (benchmarks/planner-accuracy-cpu.json) and the comparison
with published runs: both are what the code says today, and within their targets."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from slipstream.plan.accuracy import TARGET_ERROR, default_cases
from slipstream.plan.published import PUBLISHED_RUNS
from slipstream.plan.report import fit_efficiency, published_report
from slipstream.plan.timing import DEFAULT_EFFICIENCY

REPORT = Path(__file__).resolve().parents[2] / "benchmarks" / "planner-accuracy-cpu.json"


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(REPORT.read_text())


def test_committed_memory_report_covers_the_grid_within_target(committed):
    rows = committed["memory_cases"]
    assert [r["case"] for r in rows] == [c.label() for c in default_cases()]
    assert committed["memory_worst_error"] <= TARGET_ERROR
    assert all(abs(r["error"]) <= TARGET_ERROR for r in rows)
    assert committed["env"]["git_sha"]


def test_committed_published_comparison_is_current(committed):
    """Re-running the comparison gives the committed numbers: the docs table is not stale."""
    now = published_report(DEFAULT_EFFICIENCY)
    assert [(r["run"], r["metric"]) for r in now] == [(r["run"], r["metric"]) for r in committed["published"]]
    for fresh, old in zip(now, committed["published"]):
        assert fresh["planned"] == pytest.approx(old["planned"], rel=1e-3), fresh["run"]
        assert fresh.keys() == old.keys(), fresh["run"]  # the held-out fields too (speed rows only)
        if "held_out_planned" in fresh:
            assert fresh["held_out_efficiency"] == old["held_out_efficiency"], fresh["run"]
            assert fresh["held_out_planned"] == pytest.approx(old["held_out_planned"], rel=1e-3), fresh["run"]


def test_default_efficiency_is_the_fitted_one():
    assert fit_efficiency() == pytest.approx(DEFAULT_EFFICIENCY, abs=0.05)


def test_published_speeds_median_error_within_ten_percent():
    rows = [r for r in published_report(DEFAULT_EFFICIENCY, held_out=False)
            if r["metric"] in ("tflops_per_gpu", "mfu", "tokens_per_s_per_gpu")]
    assert len(rows) >= 8
    assert statistics.median(abs(r["error"]) for r in rows) <= 0.10
    # The documented outliers (docs/planner.md) stay bounded: within a factor of 2.2.
    assert all(-0.55 < r["error"] < 1.2 for r in rows)


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
