"""Tests for slipstream.plan.cost: GPU-hours, dollars and failure losses per pricing tier."""

import json
import math

import pytest

from slipstream.errors import UserError
from slipstream.plan import checkpoint_interval as advice
from slipstream.plan import cost
from slipstream.plan.cost import (DEFAULT_PRICES, Prices, cost_record, estimate_cost, format_cost,
                                  prices_for)
from slipstream.plan.hardware import known_gpus

PRICES = Prices(on_demand=2.0, spot=1.0, reserved=1.5, source="test")


def small_example(**kwargs):
    """1 hour of training on 8 GPUs, job MTBF 100 h, a save every hour."""
    args = dict(checkpoint_interval_s=3600, save_s=30, restart_s=300, mtbf_gpu_hours=800,
                spot_preemptions_per_day=0.125)
    args.update(kwargs)
    return estimate_cost(3.6e9, 1e6, 8, PRICES, **args)


def test_hand_computed_example():
    est = small_example()
    assert est.compute_hours == 1.0 and est.job_mtbf_hours == 100.0
    # Lost per unit time: 30/3600 saving + (1800 + 300)/360000 rework and restart = 17/1200.
    wall = 1 / (1 - 17 / 1200)
    od = est.on_demand
    assert od.wall_hours == pytest.approx(wall, rel=1e-12)
    assert od.gpu_hours == pytest.approx(8 * wall, rel=1e-12)
    assert od.dollars == pytest.approx(16 * wall, rel=1e-12)
    assert od.failures == pytest.approx(wall / 100, rel=1e-12)
    assert od.save_hours == pytest.approx(wall / 120, rel=1e-12)
    assert od.lost_hours == pytest.approx(wall * 7 / 1200, rel=1e-9)
    assert od.preemptions == 0.0
    assert est.reserved.dollars == pytest.approx(1.5 * 8 * wall, rel=1e-12)
    # Spot: 8 x 0.125 = 1 preemption a day, each costing a save and a restart (330 s).
    spot_wall = 1 / (1 - 17 / 1200 - 330 / 86400)
    assert est.preemptions_per_day == pytest.approx(1.0)
    assert est.spot.wall_hours == pytest.approx(spot_wall, rel=1e-12)
    assert est.spot.preemptions == pytest.approx(spot_wall / 24, rel=1e-12)
    assert est.spot.dollars == pytest.approx(1.0 * 8 * spot_wall, rel=1e-12)


def test_preemption_without_a_save_costs_like_a_failure():
    est = small_example(preemption_save=False)
    rate = 1 / 360000 + 1 / 86400  # failures + preemptions per second
    fraction = 30 / 3600 + (1800 + 300) * rate
    assert est.spot.wall_hours == pytest.approx(1 / (1 - fraction), rel=1e-12)
    assert est.spot.wall_hours > small_example().spot.wall_hours


def test_gpu_hours_and_dollars_per_tier():
    est = estimate_cost(1e12, 5e5, 64, prices_for("H100"))
    for name in cost.TIERS:
        tier = getattr(est, name)
        price = getattr(est.prices, name)
        assert tier.gpu_hours == pytest.approx(64 * tier.wall_hours)
        assert tier.dollars == pytest.approx(tier.gpu_hours * price)
        assert tier.wall_hours > est.compute_hours
        assert tier.lost_hours > 0 and tier.save_hours > 0


def test_default_interval_is_the_advice_optimum():
    est = estimate_cost(1e12, 5e5, 64, PRICES, save_s=45, mtbf_gpu_hours=20000)
    assert est.checkpoint_interval_s == advice.optimal_interval(45, 20000 * 3600 / 64)


def test_losses_grow_with_world():
    per_gpu = 3000.0  # tokens/s per GPU, the same in both jobs
    small = estimate_cost(1e11, 8 * per_gpu, 8, PRICES)
    large = estimate_cost(1e11, 1024 * per_gpu, 1024, PRICES)
    assert large.job_mtbf_hours == pytest.approx(small.job_mtbf_hours / 128)
    # The same work (1e11 tokens) in GPU-hours: the larger job fails more and loses more of it.
    assert large.on_demand.failures > small.on_demand.failures
    lost_share = [est.on_demand.lost_hours / est.on_demand.wall_hours for est in (small, large)]
    assert lost_share[1] > lost_share[0]
    assert large.on_demand.gpu_hours > small.on_demand.gpu_hours


def test_spot_includes_preemptions():
    est = estimate_cost(1e12, 5e5, 64, PRICES)
    assert est.spot.preemptions > 0 and est.on_demand.preemptions == 0
    assert est.spot.wall_hours > est.on_demand.wall_hours
    calm = estimate_cost(1e12, 5e5, 64, PRICES, spot_preemptions_per_day=0)
    assert calm.spot.wall_hours == pytest.approx(calm.on_demand.wall_hours)


def test_default_mtbf_from_llama3_figures():
    assert cost.DEFAULT_MTBF_GPU_HOURS == pytest.approx(16384 * 54 * 24 / 419)
    assert 50_000 < cost.DEFAULT_MTBF_GPU_HOURS < 51_000


@pytest.mark.parametrize("kwargs, message", [
    (dict(tokens=0), "tokens"),
    (dict(tokens=math.nan), "tokens"),
    (dict(tokens_per_s=-1), "tokens_per_s"),
    (dict(world=0), "world"),
    (dict(world=2.5), "world"),
    (dict(prices=Prices(-1.0, 1.0, 1.0, "x")), "on_demand"),
    (dict(checkpoint_interval_s=0), "checkpoint_interval_s"),
    (dict(save_s=0), "save_s"),
    (dict(restart_s=-5), "restart_s"),
    (dict(mtbf_gpu_hours=0), "mtbf_gpu_hours"),
    (dict(spot_preemptions_per_day=-1), "spot_preemptions_per_day"),
])
def test_bad_inputs(kwargs, message):
    args = dict(tokens=1e9, tokens_per_s=1e5, world=8, prices=PRICES)
    args.update(kwargs)
    with pytest.raises(UserError, match=message):
        estimate_cost(**args)


def test_job_that_cannot_finish():
    with pytest.raises(UserError, match="never finish"):
        estimate_cost(1e12, 1e5, 1024, PRICES, mtbf_gpu_hours=1, save_s=600)


def test_prices_for():
    assert prices_for("H100") is DEFAULT_PRICES["H100"]
    assert prices_for("h100-sxm") == DEFAULT_PRICES["H100"]
    changed = prices_for("A100", spot=0.5)
    assert (changed.on_demand, changed.spot, changed.reserved) == (
        DEFAULT_PRICES["A100"].on_demand, 0.5, DEFAULT_PRICES["A100"].reserved)
    assert "--spot-price" in changed.source
    assert prices_for("MI300X", 3.0, 1.5, 2.0) == Prices(3.0, 1.5, 2.0, "given")
    with pytest.raises(UserError, match="--price, --spot-price and --reserved-price"):
        prices_for("MI300X", on_demand=3.0)
    with pytest.raises(UserError, match="--price"):
        prices_for("H100", on_demand=-1)


def test_default_prices_cover_common_gpus():
    for name in ("H100", "H200", "A100", "A100-40GB", "B200", "L40S", "L4", "A10G", "V100", "T4"):
        p = DEFAULT_PRICES[name]
        assert name in known_gpus()
        assert 0 < p.spot < p.reserved < p.on_demand


def test_format_and_record():
    est = small_example()
    text = format_cost(est)
    for word in ("on-demand", "spot", "reserved", "$16.23", "1h 00m", "prices: test"):
        assert word in text
    record = json.loads(json.dumps(cost_record(est)))
    assert record["spot"]["preemptions"] == pytest.approx(est.spot.preemptions)
    assert record["on_demand"]["dollars"] == pytest.approx(est.on_demand.dollars)
    assert record["prices"]["source"] == "test"


def test_short_runs_are_told_the_final_save_is_enough():
    from slipstream.plan.cost import estimate_cost, format_cost, prices_for

    short = estimate_cost(1e9, 1e6, 8, prices_for("H100"))     # 17 minutes of training
    assert "the final save is enough" in format_cost(short)
    long = estimate_cost(1e13, 1e6, 1024, prices_for("H100"))
    assert "the final save is enough" not in format_cost(long)
