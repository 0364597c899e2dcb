"""The benchmark suite's statistics on samples with known answers: the median's order-statistic
interval, the bootstrap ratio interval, the regression decision and the measured noise band."""

from __future__ import annotations

import itertools
import math
import random

import pytest

from slipstream.perf.suite_stats import (
    DEFAULT_NOISE_BAND, NOISE_FLOOR, decide, noise_bands, ratio_ci, round_up, summarize,
)


def _coverage_by_enumeration(n: int, k: int) -> float:
    """P(x_(k) <= median <= x_(n+1-k)) counted over all 2^n equally likely below/above patterns,
    independently of the binomial formula in the module."""
    hits = sum(1 for signs in itertools.product((0, 1), repeat=n) if k <= sum(signs) <= n - k)
    return hits / 2**n


def test_summarize_picks_the_narrowest_order_statistics_with_enough_coverage():
    values = [float(v) for v in range(10, 100, 10)]  # 10, 20, ..., 90: x_(i) = 10 i
    random.Random(0).shuffle(values)
    s = summarize(values, level=0.95)
    assert s["n"] == 9 and s["median"] == 50.0
    assert s["ci"] == [20.0, 80.0]  # the 2nd and 8th values
    assert s["ci_level"] == pytest.approx(0.9609, abs=1e-4)
    assert s["ci_level"] == pytest.approx(_coverage_by_enumeration(9, 2), abs=1e-4)
    assert _coverage_by_enumeration(9, 3) < 0.95  # so 3rd..7th would be too narrow

    twenty = summarize(list(range(1, 21)), level=0.95)
    assert twenty["ci"] == [6, 15] and twenty["median"] == 10.5
    assert twenty["ci_level"] == pytest.approx(0.9586, abs=1e-4)  # the textbook table's 6th..15th for n=20
    # At 50 %: 9th..12th covers only (C(20,9) + C(20,10) + C(20,11)) / 2^20 = 0.497, so 8th..13th.
    assert summarize(list(range(1, 21)), level=0.5)["ci"] == [8, 13]


def test_summarize_small_samples_report_the_coverage_they_really_have():
    s = summarize([3.0, 1.0, 2.0])
    assert s["ci"] == [1.0, 3.0] and s["ci_level"] == 0.75 and s["median"] == 2.0
    assert summarize([4.0, 2.0])["ci_level"] == 0.5 and summarize([4.0, 2.0])["median"] == 3.0
    assert summarize([7.0]) == {"median": 7.0, "ci": [7.0, 7.0], "ci_level": 0.0, "n": 1}
    for bad in ([1.0, math.nan], [math.inf, 1.0], []):
        with pytest.raises(ValueError):
            summarize(bad)


def test_ratio_ci_is_the_point_without_spread_and_deterministic():
    assert ratio_ci([5.0] * 4, [6.0] * 3) == pytest.approx((1.2, 1.2, 1.2))
    assert ratio_ci([5.0], [4.0]) == pytest.approx((0.8, 0.8, 0.8))
    # One base sample: the interval carries the new side's spread only.
    ratio, lo, hi = ratio_ci([10.0], [9.0, 10.0, 11.0, 12.0, 13.0])
    assert ratio == pytest.approx(1.1) and 0.9 <= lo < 1.1 < hi <= 1.3
    rng = random.Random(1)
    base = [rng.gauss(100, 1) for _ in range(5)]
    new = [rng.gauss(70, 0.7) for _ in range(5)]
    first = ratio_ci(base, new)
    assert first == ratio_ci(base, new)  # seeded: the same files give the same interval
    assert 0.66 < first[1] <= first[0] <= first[2] < 0.74
    with pytest.raises(ValueError):
        ratio_ci([0.0, 1.0], [1.0])


@pytest.mark.parametrize("lo,hi,higher,band,verdict", [
    (0.60, 0.70, True, 0.05, "regression"),       # throughput down 30 %
    (0.90, 0.96, True, 0.05, "within noise"),     # interval reaches into the band
    (0.94, 1.06, True, 0.05, "within noise"),
    (1.06, 1.20, True, 0.05, "improvement"),
    (1.06, 1.20, False, 0.05, "regression"),      # a time up 6-20 %
    (1.04, 1.20, False, 0.05, "within noise"),
    (0.80, 0.90, False, 0.05, "improvement"),
    (0.80, 0.90, False, 0.15, "within noise"),    # a wide band swallows it
    (0.80, 0.949, True, 0.05, "regression"),
])
def test_decide_needs_the_whole_interval_beyond_the_band(lo, hi, higher, band, verdict):
    assert decide(lo, hi, higher, band) == verdict


def _run(medians_and_spreads: dict[str, tuple[float, float]], failed: tuple[str, ...] = ()) -> dict:
    workloads = []
    for name, (m, half_range) in medians_and_spreads.items():
        samples = [m - half_range, m, m + half_range]
        workloads.append({"name": name, "status": "quality_failed" if name in failed else "ok", "samples": samples,
                          "metric": "tokens_per_s", "unit": "tok/s"})
    return {"bench": "suite", "suite_version": 1, "workloads": workloads}


def test_noise_bands_follow_the_documented_rule():
    runs = [_run({"step": (100.0, 0.5), "steady": (50.0, 0.0), "wide": (10.0, 1.0), "flaky": (5.0, 0.0)}),
            _run({"step": (104.0, 0.5), "steady": (50.0, 0.0), "wide": (10.0, 1.0), "flaky": (5.0, 0.0)},
                 failed=("flaky",)),
            _run({"step": (98.0, 0.5), "steady": (50.0, 0.0), "wide": (10.0, 1.0), "flaky": (5.0, 0.0)})]
    bands = noise_bands(runs)
    # run to run: 104 / 98 - 1 = 6.12 %; 1.5 x that = 9.18 %, rounded up to 9.5 %.
    assert bands["step"]["max_pair_diff"] == pytest.approx(104 / 98 - 1, abs=1e-6)
    assert bands["step"]["run_medians"] == [100.0, 104.0, 98.0]
    assert bands["step"]["band"] == 0.095
    assert bands["steady"]["band"] == NOISE_FLOOR  # identical runs: the floor
    # within a run: (11 - 9) / (2 * 10) = 10 %, 1.5 x = 15 %.
    assert bands["wide"]["within_run_spread"] == pytest.approx(0.1) and bands["wide"]["band"] == 0.15
    assert "flaky" not in bands  # not ok in every run
    assert round_up(0.05) == 0.05 and round_up(0.0501) == 0.055 and DEFAULT_NOISE_BAND == 0.05
