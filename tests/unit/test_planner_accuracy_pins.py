"""Pins on the planner's stated accuracy, so that neither the committed numbers nor the
prose quoting them can go stale relative to the code:

(a) speed: the compute efficiency fitted leave-one-run-out over the published runs, and
    the error of each held-out run's figures at the efficiency fitted without it;
(b) memory: the committed rows of benchmarks/planner-accuracy-cpu.json equal a fresh
    computation (every prediction recomputed; the measurement re-taken on a cheap subset);
(c) the figures the README and docs/planner.md state equal the committed JSON: the in-sample
    speed figures, and the leave-one-run-out (held-out) ones the docs quote as the planner's
    out-of-sample accuracy.
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
DOCS = ("README.md", "docs/planner.md")
# The held-out median the docs state is rounded to 0.1 %: a fresh computation must agree that closely.
HELD_OUT_TOLERANCE = 0.0005


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
    in_sample = [r for r in published_report(DEFAULT_EFFICIENCY, held_out=False) if r["metric"] in SPEED]
    assert len(held_out) == len(in_sample) == 12
    assert all(0.30 <= eff <= 1.00 for _, eff, _ in held_out)


def test_committed_held_out_rows_equal_a_fresh_leave_one_out(committed, held_out):
    """The held_out_* fields of the committed published rows are this test's own refit."""
    rows = [r for r in committed["published"] if r["metric"] in SPEED]
    assert [r["run"] for r in rows] == [n for n, _, _ in held_out]
    for r, (name, eff, error) in zip(rows, held_out):
        assert r["held_out_efficiency"] == pytest.approx(eff, abs=1e-9), name
        assert r["held_out_error"] == pytest.approx(error, abs=1e-4), name
    assert not any("held_out_error" in r for r in committed["published"] if r["metric"] not in SPEED)


def _stated_held_out_median(text: str) -> float:
    figures = {float(m) for m in re.findall(r"held-out median speed error (?:is )?(\d+(?:\.\d+)?) %", text)}
    assert len(figures) == 1, f"held-out median figures stated: {sorted(figures)}"
    return figures.pop() / 100


@pytest.mark.parametrize("doc", DOCS)
def test_docs_held_out_median_is_the_fresh_leave_one_out(doc, held_out):
    """The out-of-sample accuracy the docs quote is what leave-one-run-out gives today."""
    text = re.sub(r"\s+", " ", (ROOT / doc).read_text())
    median = statistics.median(abs(e) for _, _, e in held_out)
    stated = _stated_held_out_median(text)
    assert median == pytest.approx(stated, abs=HELD_OUT_TOLERANCE), \
        f"{doc} states a held-out median of {stated:.1%}, leave-one-run-out gives {median:.2%}: " + \
        ", ".join(f"{n} eff {eff:.2f} {e:+.0%}" for n, eff, e in held_out)


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
    tests/unit/test_plan_memory.py re-measures a stratified subset against the 10 % target (the
    whole grid with SLIPSTREAM_SLOW_BENCH=1)."""
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


def test_docs_held_out_figures_equal_the_committed_rows(committed):
    """The spread the docs give with the held-out median: the counts within 10 / 18 %, the
    range of refitted efficiencies and how many folds hit the top of the search range, and the
    held-out column of docs/planner.md's table, all from the committed rows."""
    rows = [r for r in committed["published"] if r["metric"] in SPEED]
    errors = [abs(r["held_out_error"]) for r in rows]
    folds = {r["run"]: r["held_out_efficiency"] for r in rows}
    low, high = min(folds.values()), max(folds.values())
    for doc in DOCS:
        text = re.sub(r"\s+", " ", (ROOT / doc).read_text())
        assert _stated_held_out_median(text) == pytest.approx(statistics.median(errors), abs=HELD_OUT_TOLERANCE), doc
        assert f"{low:.2f}-{high:.2f} across folds" in text, (doc, low, high)
    readme = re.sub(r"\s+", " ", (ROOT / "README.md").read_text())
    for bound in (10, 18):
        within = sum(e <= bound / 100 for e in errors)
        assert f"{within} of {len(rows)} within {bound} %" in readme.split("held out (leave-one-run-out")[1], bound
    planner = (ROOT / "docs/planner.md").read_text()
    top = sum(eff == 1.0 for eff in folds.values())
    assert f"in {top} of the {len(folds)} folds" in re.sub(r"\s+", " ", planner)
    # The table: one row per run with a speed figure (its first), the held-out cell last.
    first = {}
    for r in rows:
        first.setdefault(r["run"], r)
    cells = re.findall(r"\| ([+-]\d+) % \((\d\.\d\d)\) \|$", planner, flags=re.MULTILINE)
    assert cells == [(f"{100 * r['held_out_error']:+.0f}", f"{r['held_out_efficiency']:.2f}") for r in first.values()]
