"""How often to checkpoint: the interval that loses the least time to saves plus rework.

Saving often costs save time; saving rarely costs recomputation after a failure. With save cost
C, mean time between failures M (of the whole job: a node MTBF divided by the node count) and
interval tau of compute between saves, the first-order time lost per unit of time is

    C / tau  (saving)  +  (tau / 2 + R) / M  (on average half an interval is redone, plus restart R)

Young (1974) minimises it: tau = sqrt(2 C M). Daly (2006) adds higher-order terms, which matter
when C is not tiny next to M:

    tau = sqrt(2 C M) * (1 + sqrt(C / 2M) / 3 + (C / 2M) / 9) - C   for C < 2M,   else M

`optimal_interval` returns Daly's value; Young's is reported alongside. The two agree within a
few percent in the usual regime (C of seconds to minutes, M of hours to days).

A planner estimator (blocks layer): plan/cost.py prices a run with it, and
`slipstream checkpoint advise` prints it.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from slipstream.errors import UserError

DAY_S = 86400.0
_UNITS = {"ms": 1e-3, "s": 1.0, "sec": 1.0, "m": 60.0, "min": 60.0, "h": 3600.0, "hr": 3600.0, "d": DAY_S}
_PART = re.compile(r"(\d+(?:\.\d*)?|\.\d+)\s*([a-z]+)")


def parse_duration(text: str | float | int, what: str = "duration") -> float:
    """Seconds from "30s", "90m", "24h", "1.5d", "250ms", "1h30m" or a plain number of seconds (>= 0)."""
    if isinstance(text, (int, float)) and not isinstance(text, bool):
        value = float(text)
    else:
        s = str(text).strip().lower().replace(" ", "")
        try:
            value = float(s)
        except ValueError:
            parts = _PART.findall(s)
            if not s or "".join(n + u for n, u in parts) != s or any(u not in _UNITS for _, u in parts):
                raise UserError(f"cannot read {what} '{text}'; write e.g. 30s, 90m, 24h, 1.5d, 1h30m "
                                "or a number of seconds") from None
            value = sum(float(n) * _UNITS[u] for n, u in parts)
    if not (math.isfinite(value) and value >= 0):
        raise UserError(f"{what} must be a finite, non-negative duration (got '{text}')")
    return value


def _check_positive(**values: float) -> None:
    for name, v in values.items():
        if not (math.isfinite(v) and v > 0):
            raise UserError(f"{name} must be > 0 seconds (got {v})")


def young_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Young's first-order optimum sqrt(2 C M)."""
    _check_positive(save_cost=save_cost_s, mtbf=mtbf_s)
    return math.sqrt(2 * save_cost_s * mtbf_s)


def optimal_interval(save_cost_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum (seconds of compute between saves); M when C >= 2M."""
    _check_positive(save_cost=save_cost_s, mtbf=mtbf_s)
    c, m = save_cost_s, mtbf_s
    if c >= 2 * m:
        return m
    x = c / (2 * m)
    return math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c


def expected_loss_per_day(interval_s: float, save_cost_s: float, mtbf_s: float, restart_s: float = 0.0) -> float:
    """Seconds lost per day (first-order model above): saving + rework and restart after failures.

    Capped at a full day: beyond that the model says the job no longer makes progress.
    """
    _check_positive(interval=interval_s, save_cost=save_cost_s, mtbf=mtbf_s)
    if not (math.isfinite(restart_s) and restart_s >= 0):
        raise UserError(f"restart must be >= 0 seconds (got {restart_s})")
    lost = DAY_S * save_cost_s / interval_s + (DAY_S / mtbf_s) * (interval_s / 2 + restart_s)
    return min(lost, DAY_S)


@dataclass
class CheckpointAdvice:
    interval_s: float  # Daly's optimum
    young_interval_s: float
    interval_steps: int | None  # interval_s in steps, when a step time is known
    lost_hours_per_day: float  # at interval_s
    overhead_pct: float  # share of time spent saving at interval_s
    rework_hours_per_day: float  # rework + restarts at interval_s


def advise(save_cost_s: float, mtbf_s: float, restart_s: float = 0.0, step_time_s: float | None = None) -> CheckpointAdvice:
    tau = optimal_interval(save_cost_s, mtbf_s)
    if step_time_s is not None:
        _check_positive(step_time=step_time_s)
    lost = expected_loss_per_day(tau, save_cost_s, mtbf_s, restart_s)
    saving = DAY_S * save_cost_s / tau
    return CheckpointAdvice(
        interval_s=tau, young_interval_s=young_interval(save_cost_s, mtbf_s),
        interval_steps=None if step_time_s is None else max(1, round(tau / step_time_s)),
        lost_hours_per_day=lost / 3600, overhead_pct=100 * save_cost_s / tau,
        rework_hours_per_day=max(0.0, lost - saving) / 3600)


def format_duration(seconds: float) -> str:
    """Compact human duration: 45s, 12m 30s, 3h 05m, 2d 4h."""
    s = round(seconds)
    if seconds < 60:
        return f"{seconds:.3g}s"
    if s < 3600:
        return f"{s // 60}m {s % 60:02d}s"
    if s < DAY_S:
        return f"{s // 3600}h {s % 3600 // 60:02d}m"
    return f"{s // 86400}d {s % 86400 // 3600}h"

