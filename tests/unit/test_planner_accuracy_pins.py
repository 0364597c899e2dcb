"""Pins on the planner's stated accuracy, so that neither the committed numbers nor the
prose quoting them can go stale relative to the code:

(a) speed: the compute efficiency fitted leave-one-run-out over the published runs, and
    the error of each held-out run's figures at the efficiency fitted without it;
(b) memory: the committed rows of benchmarks/planner-accuracy-cpu.json equal a fresh
    computation (every prediction recomputed; the measurement re-taken on a cheap subset);
(c) the figures the README and docs/planner.md state equal the committed JSON.
"""

from __future__ import annotations

import json
import math
import re
import statistics
from pathlib import Path

import pytest

from slipstream.plan.accuracy import default_cases, measure_case, plan_case
from slipstream.plan.published import PUBLISHED_RUNS
from slipstream.plan.report import compare_run, fit_efficiency, published_report
from slipstream.plan.timing import DEFAULT_EFFICIENCY

ROOT = Path(__file__).resolve().parents[2]
REPORT = ROOT / "benchmarks" / "planner-accuracy-cpu.json"
SPEED = ("tflops_per_gpu", "mfu", "tokens_per_s_per_gpu")
# The in-sample median speed error the docs state ("median speed error 9 %"), with its
# rounding: the README's bound for the planner's speed.
DOCS_MEDIAN_BOUND = 0.10
# Leave-one-run-out, measured when this test was written: median 14.7 % over the 12 figures
# (the fit is flat between 0.87 and 1.0, so dropping one run moves it a lot). This bound
# catches the held-out error getting worse; the docs' bound is checked by the xfail below.
HELD_OUT_GUARD = 0.16


@pytest.fixture(scope="module")
def committed() -> dict:
    return json.loads(REPORT.read_text())


# ----------------------------------------------------------------------- (a) speed


def _speed_figures(run, efficiency):
    return [c for c in compare_run(run, efficiency) if c.metric in SPEED]


@pytest.fixture(scope="module")
def held_out() -> list[tuple[str, float, float]]:
    """(run, efficiency fitted without it, error of each of its speed figures at that efficiency)."""
    rows = []
    for run in PUBLISHED_RUNS:
        if not _speed_figures(run, DEFAULT_EFFICIENCY):
            continue  # memory-only entries do not enter the speed fit
        rest = [r for r in PUBLISHED_RUNS if r is not run]
        eff = fit_efficiency(rest)
        rows += [(run.name, eff, c.error) for c in _speed_figures(run, eff)]
    return rows


def test_leave_one_out_covers_every_speed_figure(held_out):
    in_sample = [r for r in published_report(DEFAULT_EFFICIENCY) if r["metric"] in SPEED]
    assert len(held_out) == len(in_sample) == 12
    assert all(0.30 <= eff <= 1.00 for _, eff, _ in held_out)


def test_held_out_median_speed_error_does_not_grow(held_out):
    median = statistics.median(abs(e) for _, _, e in held_out)
    assert median <= HELD_OUT_GUARD, \
        f"leave-one-run-out median speed error {median:.1%} > {HELD_OUT_GUARD:.0%}: " + \
        ", ".join(f"{n} eff {eff:.2f} {e:+.0%}" for n, eff, e in held_out)


@pytest.mark.xfail(strict=True, reason="the docs' 9 % median is in-sample; held out it is 14.7 % "
                                        "(issue 12: the claim needs a held-out figure or a better fit)")
def test_held_out_median_speed_error_within_the_docs_bound(held_out):
    median = statistics.median(abs(e) for _, _, e in held_out)
    assert median <= DOCS_MEDIAN_BOUND, f"leave-one-run-out median speed error {median:.1%}"


# ---------------------------------------------------------------------- (b) memory


def test_committed_memory_predictions_equal_a_fresh_computation(committed):
    rows, cases = committed["memory_cases"], default_cases()
    assert [r["case"] for r in rows] == [c.label() for c in cases]
    stale = [(c.label(), r["planned_bytes"], plan_case(c)) for c, r in zip(cases, rows)
             if plan_case(c) != r["planned_bytes"]]
    assert not stale, "committed planned_bytes differ from the planner now (rerun slipstream bench planner): " \
                      + "; ".join(f"{label}: committed {old} now {new}" for label, old, new in stale)
    # each row's error and the headline worst are what its own bytes give
    for r in rows:
        assert r["error"] == pytest.approx((r["planned_bytes"] - r["measured_bytes"]) / r["measured_bytes"],
                                           abs=1e-12), r["case"]
    assert committed["memory_worst_error"] == max(abs(r["error"]) for r in rows)


def test_committed_memory_measurement_reproduces_on_a_cheap_case(committed):
    """One of the cheapest cases (ZeRO-2 over the fake 8-rank group: FSDPMemTracker), measured again;
    the whole grid is re-measured against the 10 % target by tests/unit/test_plan_memory.py."""
    index = 10
    case = default_cases()[index]
    row = committed["memory_cases"][index]
    assert row["case"] == case.label()
    assert measure_case(case) == pytest.approx(row["measured_bytes"], rel=1e-3), case.label()


# -------------------------------------------------------------------- (c) the prose


def _percent_figures(text: str, word: str) -> list[float]:
    """Every 'worst 7.7 %' / 'worst +7.7 %' figure in text."""
    return [float(m) for m in re.findall(word + r"\s+\+?(\d+(?:\.\d+)?)\s*%", text)]


def test_readme_and_docs_state_the_committed_worst_case(committed):
    worst = round(100 * committed["memory_worst_error"], 1)
    n = len(committed["memory_cases"])
    for doc in ("README.md", "docs/planner.md"):
        text = (ROOT / doc).read_text()
        figures = _percent_figures(re.sub(r"\s+", " ", text), "worst")
        assert figures, f"{doc} states no worst-case memory error any more"
        assert all(f == worst for f in figures), f"{doc} says worst {figures}, the committed JSON {worst} %"
        counts = {int(m) for m in re.findall(r"(\d+)[ -]case", text) + re.findall(r"on (\d+) cases", text)
                  + re.findall(r"all (\d+) within", text)}
        assert counts == {n}, f"{doc} states {sorted(counts)} cases, the committed JSON has {n}"


def test_readme_speed_figures_equal_the_committed_published_comparison(committed):
    rows = [r for r in committed["published"] if r["metric"] in SPEED]
    errors = [abs(r["error"]) for r in rows]
    text = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    median = round(100 * statistics.median(errors))
    for claim in (f"median speed error {median} %", f"median error {median} % over {len(rows)} figures"):
        assert claim in text, f"README does not say {claim!r} (the committed comparison's median)"
    for bound in (10, 18):
        within = sum(e <= bound / 100 for e in errors)
        assert f"{within} of {len(rows)} within {bound} %" in text, (bound, within)
    assert committed["efficiency"] == DEFAULT_EFFICIENCY
    assert f"efficiency, {DEFAULT_EFFICIENCY}" in text or f"efficiency {DEFAULT_EFFICIENCY}" in text
    assert not math.isnan(committed["efficiency_fitted"])
