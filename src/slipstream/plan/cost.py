"""Money and time for a training run: GPU-hours and dollars per pricing tier, failures included.

A run of `tokens` at `tokens_per_s` needs tokens / tokens_per_s seconds of pure training. Real
wall time is longer: checkpoint saves block training, and each failure throws away the work
since the last save plus a restart. plan/checkpoint_interval.py has that model (Young/Daly); here we
apply it per pricing tier and turn the wall time into GPU-hours and dollars:

    lost fraction f = expected_loss_per_day(...) / day     wall time = compute time / (1 - f)

On-demand and reserved capacity see hardware failures only; spot capacity also sees
preemptions (see estimate_cost for what a preemption costs).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from slipstream.errors import UserError
from slipstream.plan.checkpoint_interval import DAY_S, expected_loss_per_day, format_duration, optimal_interval
from slipstream.plan.hardware import canonical_gpu_name

TIERS = ("on_demand", "spot", "reserved")


@dataclass(frozen=True)
class Prices:
    """USD per GPU-hour."""

    on_demand: float
    spot: float
    reserved: float
    source: str


# INDICATIVE defaults: round figures in the range of typical public cloud list prices, 2025
# (hyperscaler on-demand price pages, GPU-cloud price lists and spot/"preemptible" markets).
# Real prices differ 2-3x between providers, regions and contract terms and change often: pass
# --price / --spot-price / --reserved-price for numbers you can act on. Reserved means a
# 1-year commitment (typically 20-50 % below on-demand); spot is typically 50-70 % below.
_LIST = "indicative 2025 public cloud list prices (override with --price/--spot-price/--reserved-price)"
DEFAULT_PRICES: dict[str, Prices] = {
    name: Prices(on_demand, spot, reserved, _LIST)
    for name, on_demand, spot, reserved in (
        ("B200", 6.00, 3.00, 4.00),
        ("H200", 4.50, 2.25, 3.00),
        ("H100", 3.50, 1.75, 2.30),
        ("A100", 1.80, 0.90, 1.20),
        ("A100-40GB", 1.40, 0.70, 0.95),
        ("L40S", 1.50, 0.75, 1.00),
        ("L4", 0.75, 0.30, 0.50),
        ("A10G", 1.00, 0.45, 0.65),
        ("V100", 2.00, 0.80, 1.30),
        ("T4", 0.50, 0.20, 0.35),
    )
}

# Mean time between job-killing failures of ONE GPU (with its share of host, network and
# software). From "The Llama 3 Herd of Models" (Dubey et al., 2024), reliability section: 419
# unexpected interruptions (of 466 in all; 47 were planned maintenance) in a 54-day snapshot of
# pre-training on up to 16,384 H100 GPUs. 16,384 GPUs x 54 days x 24 h / 419 = ~50,700
# GPU-hours per interruption. "Up to" 16,384 GPUs means the GPU-hours are an upper bound, so
# this MTBF is if anything optimistic. (Figures checked against press coverage of the paper,
# not the paper's own text.) A job of W GPUs fails every DEFAULT_MTBF_GPU_HOURS / W hours.
DEFAULT_MTBF_GPU_HOURS = 16384 * 54 * 24 / 419

# Spot preemptions per GPU per day: an ASSUMPTION, not a measured figure - about one
# preemption a day of an 8-GPU spot instance (0.125 per GPU). Providers publish interruption
# rates per instance type (e.g. AWS's Spot Instance Advisor); high-end GPUs are among the
# most interrupted. A job of W GPUs is preempted W x this many times a day.
DEFAULT_SPOT_PREEMPTIONS_PER_DAY = 0.125


@dataclass(frozen=True)
class TierCost:
    price_per_gpu_hour: float
    wall_hours: float   # expected wall time, saves and failures included
    gpu_hours: float    # world x wall_hours
    dollars: float      # gpu_hours x price
    failures: float     # expected hardware failures during the run
    preemptions: float  # expected spot preemptions (0 for on-demand and reserved)
    lost_hours: float   # wall hours lost to failures and preemptions (rework + restarts)
    save_hours: float   # wall hours spent saving checkpoints


@dataclass(frozen=True)
class CostEstimate:
    tokens: float
    tokens_per_s: float           # of the whole job
    world: int
    compute_hours: float          # pure training time: tokens / tokens_per_s
    checkpoint_interval_s: float  # compute time between saves
    save_s: float
    restart_s: float
    job_mtbf_hours: float         # mtbf_gpu_hours / world
    preemptions_per_day: float    # of the whole job, on spot
    preemption_save: bool         # does a preemption get a save in its notice period?
    prices: Prices
    on_demand: TierCost
    spot: TierCost
    reserved: TierCost


def prices_for(gpu_short_name: str, on_demand: float | None = None, spot: float | None = None,
               reserved: float | None = None) -> Prices:
    """DEFAULT_PRICES for a GPU, with any of the three prices replaced by the given ones."""
    given = {"on_demand": on_demand, "spot": spot, "reserved": reserved}
    flags = {"on_demand": "--price", "spot": "--spot-price", "reserved": "--reserved-price"}
    for tier, value in given.items():
        if value is not None and not (isinstance(value, (int, float)) and 0 <= value < math.inf):
            raise UserError(f"{flags[tier]} {value!r}: a price must be >= 0 USD per GPU-hour.")
    default = DEFAULT_PRICES.get(canonical_gpu_name(gpu_short_name) or gpu_short_name)
    if default is None:
        if any(value is None for value in given.values()):
            raise UserError(f"no default prices for GPU {gpu_short_name!r} (defaults exist for "
                            f"{', '.join(DEFAULT_PRICES)}); pass --price, --spot-price and "
                            "--reserved-price in USD per GPU-hour.")
        return Prices(on_demand, spot, reserved, "given")
    if all(value is None for value in given.values()):
        return default
    overridden = ", ".join(flags[tier] for tier, value in given.items() if value is not None)
    merged = {tier: default.__dict__[tier] if value is None else float(value) for tier, value in given.items()}
    return Prices(**merged, source=f"{overridden} given; others {default.source}")


def _check(name: str, value: float, minimum: float = 0.0, strict: bool = True) -> None:
    ok = isinstance(value, (int, float)) and math.isfinite(value) and (value > minimum if strict else value >= minimum)
    if not ok:
        raise UserError(f"{name} must be a finite number {'>' if strict else '>='} {minimum:g}, got {value!r}.")


def _tier(price: float, compute_s: float, world: int, interval_s: float, save_s: float,
          lost_per_day_s: float, failures_per_s: float, preemptions_per_s: float) -> TierCost:
    fraction = lost_per_day_s / DAY_S
    if fraction >= 1.0:
        raise UserError("failures and preemptions come faster than the job can save and redo its work, so it "
                        "would never finish: use fewer GPUs, faster checkpoint saves (save_s) or a shorter "
                        "checkpoint interval.")
    wall_s = compute_s / (1.0 - fraction)
    save_hours = wall_s * save_s / interval_s / 3600  # the saving term of the same loss model
    return TierCost(
        price_per_gpu_hour=price, wall_hours=wall_s / 3600, gpu_hours=world * wall_s / 3600,
        dollars=world * wall_s / 3600 * price, failures=wall_s * failures_per_s,
        preemptions=wall_s * preemptions_per_s,
        lost_hours=wall_s * fraction / 3600 - save_hours, save_hours=save_hours)


def estimate_cost(tokens: float, tokens_per_s: float, world: int, prices: Prices, *,
                  checkpoint_interval_s: float | None = None, save_s: float = 30.0, restart_s: float = 300.0,
                  mtbf_gpu_hours: float = DEFAULT_MTBF_GPU_HOURS,
                  spot_preemptions_per_day: float = DEFAULT_SPOT_PREEMPTIONS_PER_DAY,
                  preemption_save: bool = True) -> CostEstimate:
    """Expected wall time, GPU-hours and dollars of a run per pricing tier.

    tokens_per_s is the whole job's throughput. checkpoint_interval_s (seconds of compute
    between saves) defaults to the Young/Daly optimum for the job's hardware MTBF.
    Each failure costs half an interval of rework plus restart_s (plan/checkpoint_interval.py).
    A spot preemption comes with notice (30 s to 2 min), and slipstream saves on that notice
    (resilience.preemption: SIGTERM/SIGUSR1 -> save and exit) so with preemption_save=True it
    costs one save plus a restart and no rework. If saves take longer than the notice, pass
    preemption_save=False: a preemption then costs what a failure costs.
    """
    _check("tokens", tokens)
    _check("tokens_per_s", tokens_per_s)
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise UserError(f"world must be a whole number of GPUs >= 1, got {world!r}.")
    for tier in TIERS:
        _check(f"the {tier} price", getattr(prices, tier), strict=False)
    _check("save_s", save_s)
    _check("restart_s", restart_s, strict=False)
    _check("mtbf_gpu_hours", mtbf_gpu_hours)
    _check("spot_preemptions_per_day", spot_preemptions_per_day, strict=False)

    compute_s = tokens / tokens_per_s
    mtbf_s = mtbf_gpu_hours * 3600 / world
    if checkpoint_interval_s is None:
        interval_s = optimal_interval(save_s, mtbf_s)
    else:
        _check("checkpoint_interval_s", checkpoint_interval_s)
        interval_s = float(checkpoint_interval_s)
    preemptions_per_s = spot_preemptions_per_day * world / DAY_S

    failures_only = expected_loss_per_day(interval_s, save_s, mtbf_s, restart_s)
    if preemption_save:
        # Failures as usual, plus a save and a restart per preemption.
        spot_loss = failures_only + preemptions_per_s * DAY_S * (save_s + restart_s)
    else:
        # Preemptions are failures too: the events arrive at the sum of the two rates.
        spot_loss = expected_loss_per_day(interval_s, save_s, 1.0 / (1.0 / mtbf_s + preemptions_per_s), restart_s)

    def tier(price: float, loss: float, preempt: float) -> TierCost:
        return _tier(price, compute_s, world, interval_s, save_s, loss, 1.0 / mtbf_s, preempt)

    return CostEstimate(
        tokens=float(tokens), tokens_per_s=float(tokens_per_s), world=world, compute_hours=compute_s / 3600,
        checkpoint_interval_s=interval_s, save_s=float(save_s), restart_s=float(restart_s),
        job_mtbf_hours=mtbf_s / 3600, preemptions_per_day=preemptions_per_s * DAY_S,
        preemption_save=preemption_save, prices=prices,
        on_demand=tier(prices.on_demand, failures_only, 0.0),
        spot=tier(prices.spot, spot_loss, preemptions_per_s),
        reserved=tier(prices.reserved, failures_only, 0.0))


def _money(dollars: float) -> str:
    return f"${dollars:,.0f}" if dollars >= 100 else f"${dollars:,.2f}"


def format_cost(est: CostEstimate) -> str:
    """A plain-text table, one row per pricing tier, and the assumptions under it."""
    header = ("tier", "$/GPU-h", "wall time", "GPU-hours", "cost", "failures", "preempt.", "lost h", "saving h")
    rows = [header]
    for name in TIERS:
        t: TierCost = getattr(est, name)
        rows.append((name.replace("_", "-"), f"{t.price_per_gpu_hour:.2f}", format_duration(t.wall_hours * 3600),
                     f"{t.gpu_hours:,.0f}", _money(t.dollars), f"{t.failures:.1f}", f"{t.preemptions:.1f}",
                     f"{t.lost_hours:.1f}", f"{t.save_hours:.1f}"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header))]
    lines = ["  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths)))
             for row in rows]
    on_notice = "a save and a restart" if est.preemption_save else "half an interval and a restart"
    lines += [
        f"{est.tokens:,.0f} tokens at {est.tokens_per_s:,.0f} tokens/s on {est.world} GPUs: "
        f"{format_duration(est.compute_hours * 3600)} of pure training",
        f"checkpoint every {format_duration(est.checkpoint_interval_s)}"
        f"{', longer than the run: the final save is enough' if est.checkpoint_interval_s >= est.compute_hours * 3600 else ''}"
        f" (save {format_duration(est.save_s)}, "
        f"restart {format_duration(est.restart_s)}); job MTBF {format_duration(est.job_mtbf_hours * 3600)}; "
        f"spot: {est.preemptions_per_day:.2g} preemptions/day, each costing {on_notice}",
        f"prices: {est.prices.source}",
    ]
    return "\n".join(lines)


def cost_record(est: CostEstimate) -> dict:
    """JSON-ready: every field, tiers and prices as nested dicts."""
    return asdict(est)
