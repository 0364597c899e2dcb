"""The benchmark suite's statistics: the median of a workload's repeats with a confidence
interval, the ratio of two medians with a bootstrap interval, the regression decision and
the noise band measured from repeated runs.

Why these methods: a suite run has 3-10 repeats per workload on a machine shared with other
work, so its samples are few, skewed (a busy neighbour only ever slows a run down) and not
normal. Every interval here is distribution-free: the median's comes from order statistics
(no assumption at all), the ratio's from a percentile bootstrap (seeded, so a comparison
prints the same numbers every time it is made).

A change counts as a regression only when its whole interval lies beyond the noise band:
the relative change that two runs of the same code on the same machine show anyway
(measured by `slipstream bench noise`, see `noise_bands`). A shared machine's slow afternoon
then does not cry wolf, and a real 30 % slowdown is still caught.

Pure Python and numpy: no torch, so the statistics are testable in milliseconds.
"""

from __future__ import annotations

import math
from typing import Any

DEFAULT_NOISE_BAND = 0.05  # used when no band was measured for a workload on this machine
NOISE_FLOOR = 0.02  # no measured band is narrower: a few runs can agree by luck
NOISE_MULTIPLE = 1.5  # the band is this many times the variation seen, as a few runs underestimate its range
NOISE_STEP = 0.005  # bands are rounded up to this step, so a re-measured band does not churn in its 4th digit
NOISE_RULE = (f"band = max({NOISE_FLOOR}, {NOISE_MULTIPLE} * max(run_to_run, within_run)) rounded up to {NOISE_STEP}; "
              "run_to_run = max(run medians) / min(run medians) - 1; "
              "within_run = the largest (max - min) / (2 * median) of one run's samples")


def _finite(samples: list[float], what: str = "samples") -> list[float]:
    values = [float(x) for x in samples]
    if not values:
        raise ValueError(f"no {what}: at least one value is needed")
    bad = [x for x in values if not math.isfinite(x)]
    if bad:
        raise ValueError(f"{what} must be finite numbers; got {bad[0]}")
    return values


def median(samples: list[float]) -> float:
    values = sorted(_finite(samples))
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def order_statistic_coverage(n: int, k: int) -> float:
    """P(x_(k) <= true median <= x_(n+1-k)) for n samples of any continuous distribution.

    Each sample falls below the median with probability 1/2, so the number below it is
    Binomial(n, 1/2); the interval misses the median when fewer than k fall on one side.
    """
    tail = sum(math.comb(n, i) for i in range(k)) / 2**n
    return 1.0 - 2.0 * tail


def summarize(samples: list[float], level: float = 0.95) -> dict[str, Any]:
    """The median of `samples` and a distribution-free confidence interval for it.

    The interval is the pair of order statistics (x_(k), x_(n+1-k)) with the largest k, so
    the narrowest pair, whose coverage is still at least `level` (n=9, level 0.95: the 2nd
    and 8th values, coverage 0.961). When even min..max covers less than `level` (n <= 5 at
    0.95), the interval is min..max and ci_level says the coverage it really has (n=3: 0.75).
    One sample: the interval is the point, with coverage 0.
    """
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1; got {level}")
    values = sorted(_finite(samples))
    n = len(values)
    k = 1
    while k + 1 <= (n + 1) // 2 and order_statistic_coverage(n, k + 1) >= level:
        k += 1
    return {"median": median(values), "ci": [values[k - 1], values[n - k]],
            "ci_level": round(order_statistic_coverage(n, k), 4), "n": n}


def ratio_ci(base: list[float], new: list[float], level: float = 0.95, resamples: int = 2000,
             seed: int = 0) -> tuple[float, float, float]:
    """(ratio, lo, hi): median(new) / median(base) with a percentile bootstrap interval.

    Each resample draws both sides with replacement and takes the ratio of their medians;
    the interval is the central `level` of those ratios. The generator is seeded, so the same
    two files always give the same interval. One sample on a side has no spread to resample:
    the interval then carries the other side's spread only, and 1 vs 1 is the point itself.
    The interval always contains the ratio (a skewed bootstrap may otherwise leave it out).
    """
    import numpy as np

    base_values, new_values = _finite(base, "base samples"), _finite(new, "new samples")
    if min(base_values) <= 0 or min(new_values) <= 0:
        raise ValueError("a ratio needs positive samples; got a zero or negative one")
    ratio = median(new_values) / median(base_values)
    rng = np.random.default_rng(seed)
    b, n = np.asarray(base_values), np.asarray(new_values)
    base_medians = np.median(b[rng.integers(0, len(b), size=(resamples, len(b)))], axis=1)
    new_medians = np.median(n[rng.integers(0, len(n), size=(resamples, len(n)))], axis=1)
    tail = (1.0 - level) / 2
    lo, hi = np.quantile(new_medians / base_medians, [tail, 1.0 - tail])
    return ratio, min(float(lo), ratio), max(float(hi), ratio)


def decide(ratio_lo: float, ratio_hi: float, higher_is_better: bool, noise_band: float) -> str:
    """'regression', 'improvement' or 'within noise' for a new/base ratio's interval.

    A verdict needs the whole interval beyond the band: for a throughput (higher is better)
    a regression is hi < 1 - band, for a time lo > 1 + band; an improvement mirrors it.
    An interval that touches the band, or straddles it, is noise.
    """
    if ratio_lo > ratio_hi:
        raise ValueError(f"interval [{ratio_lo}, {ratio_hi}] is upside down")
    below, above = ratio_hi < 1.0 - noise_band, ratio_lo > 1.0 + noise_band
    if below:
        return "regression" if higher_is_better else "improvement"
    if above:
        return "improvement" if higher_is_better else "regression"
    return "within noise"


def round_up(value: float, step: float = NOISE_STEP) -> float:
    # The small tolerance keeps a value already on the grid (0.05 as 0.05000000001) where it is.
    return round(math.ceil(value / step - 1e-9) * step, 6)


def noise_bands(runs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The noise band of each workload from repeated suite runs of the same code on one machine.

    Runs are parsed suite results. A workload counts when it is "ok" in every run. Its band:

        run_to_run  = max(run medians) / min(run medians) - 1   (the largest pairwise relative difference)
        within_run  = max over runs of (max - min) / (2 * median) of the run's samples
        band        = max(NOISE_FLOOR, NOISE_MULTIPLE * max(run_to_run, within_run)), rounded up to NOISE_STEP

    i.e. 1.5 times the widest variation seen, never below 2 %. Run-to-run shifts are what a
    single run's interval cannot see (the machine's load, clocks and cache state change
    between runs); the within-run half-range keeps the band no narrower than one run scatters.
    The multiple is there because a few runs underestimate the range that more would show.
    """
    names = [w["name"] for w in runs[0]["workloads"]] if runs else []
    bands: dict[str, dict[str, Any]] = {}
    for name in names:
        found = [next((w for w in run["workloads"] if w["name"] == name), None) for run in runs]
        if any(w is None or w.get("status") != "ok" or not w.get("samples") for w in found):
            continue
        run_medians = [median(w["samples"]) for w in found]
        if min(run_medians) <= 0:
            continue  # relative differences need positive numbers
        run_to_run = max(run_medians) / min(run_medians) - 1.0
        within_run = max((max(w["samples"]) - min(w["samples"])) / (2 * m) for w, m in zip(found, run_medians))
        band = round_up(max(NOISE_FLOOR, NOISE_MULTIPLE * max(run_to_run, within_run)))
        bands[name] = {"band": band, "run_medians": run_medians, "max_pair_diff": round(run_to_run, 6),
                       "within_run_spread": round(within_run, 6), "runs": len(found),
                       "metric": found[0].get("metric", ""), "unit": found[0].get("unit", "")}
    return bands
