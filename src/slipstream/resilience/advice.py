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
"""

from __future__ import annotations

import argparse
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


def add_advise_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `slipstream checkpoint advise`; durations are strings parsed by parse_duration."""
    parser.add_argument("--save-cost", required=True, help="time one checkpoint save blocks training (e.g. 30s)")
    parser.add_argument("--mtbf", required=True, help="mean time between failures, e.g. 24h (of the job; of one node with --nodes)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the job; the job fails nodes x as often")
    parser.add_argument("--restart", default="0", help="time to restart and reload after a failure (e.g. 5m)")
    parser.add_argument("--step-time", default=None, help="seconds per training step, to give the interval in steps")
    return parser


def main_advise(args: argparse.Namespace, extra: list[str]) -> int:
    """Print the recommended checkpoint interval and what it costs per day."""
    if extra:
        raise UserError(f"unexpected arguments: {' '.join(extra)}")
    if args.nodes < 1:
        raise UserError(f"--nodes must be >= 1 (got {args.nodes})")
    save = parse_duration(args.save_cost, "--save-cost")
    mtbf = parse_duration(args.mtbf, "--mtbf") / args.nodes
    restart = parse_duration(args.restart, "--restart")
    step = None if args.step_time is None else parse_duration(args.step_time, "--step-time")
    a = advise(save, mtbf, restart, step)
    steps = "" if a.interval_steps is None else f" = every {a.interval_steps:,} steps at {step:g}s/step"
    print(f"checkpoint advice: save cost {format_duration(save)}, job MTBF {format_duration(mtbf)}"
          f"{f' ({args.nodes} nodes)' if args.nodes > 1 else ''}, restart {format_duration(restart)}")
    print(f"  save every     {format_duration(a.interval_s)}{steps}  (Daly; Young: {format_duration(a.young_interval_s)})")
    print(f"  saving costs   {a.overhead_pct:.2f}% of the time")
    if a.lost_hours_per_day >= 24:
        print("  expected loss  the whole day: failures come faster than the job can save and redo work")
    else:
        print(f"  expected loss  {a.lost_hours_per_day:.2f} h/day ({100 * a.lost_hours_per_day / 24:.1f}%), "
              f"of which rework and restarts {a.rework_hours_per_day:.2f} h")
    if save >= mtbf:
        print("  warning: a save takes as long as the time between failures; make saves faster "
              "(asynchronous or sharded checkpoints) before tuning the interval")
    return 0


def register(add_subcommand) -> None:
    """`slipstream checkpoint advise` (registered through checkpoint.export.CHECKPOINT_COMMANDS)."""
    parser = add_subcommand("advise", "the checkpoint interval that loses the least time, from save cost and MTBF")
    add_advise_arguments(parser)
    parser.set_defaults(func=main_advise)
