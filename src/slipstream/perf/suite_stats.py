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
