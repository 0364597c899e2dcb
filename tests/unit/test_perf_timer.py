"""Tests for slipstream.perf.timer. Sleep-based timings use generous bounds: CI is noisy."""

import json
import time
import warnings

import pytest
import torch

from slipstream.errors import UserError
from slipstream.perf.timer import (
    METHOD_PERF_COUNTER,
    Timer,
    TimingResult,
    TimingSpreadWarning,
    time_callable,
)


def test_sleep_median_plausible_and_warmup_excluded():
    calls = []

    def fn():
        calls.append(None)
        # The warm-up calls are made slow on purpose: if any were timed, max would show it.
        time.sleep(0.2 if len(calls) <= 2 else 0.002)

    result = time_callable(fn, warmup=2, repeats=10, max_rel_iqr=float("inf"))
    assert len(calls) == 12
    assert len(result.samples) == result.repeats == 10
    assert result.warmup == 2
    assert 0.0019 <= result.median < 0.05
    assert result.max < 0.15
    assert result.min <= result.median <= result.max
    assert result.device == "cpu"
    assert result.method == METHOD_PERF_COUNTER


@pytest.mark.parametrize(
    "kwargs", [{"repeats": 0}, {"repeats": -1}, {"repeats": True}, {"repeats": 2.0}, {"warmup": -1},
               {"max_rel_iqr": -0.1}]
)
def test_invalid_arguments_are_user_errors(kwargs):
    calls = []
    with pytest.raises(UserError):
        time_callable(lambda: calls.append(None), **kwargs)
    assert calls == []  # validation happens before anything runs


def test_unavailable_device_is_user_error():
    if torch.accelerator.is_available():
        pytest.skip("this machine has an accelerator")
    with pytest.raises(UserError, match="not available"):
        time_callable(lambda: None, device="cuda")
    with pytest.raises(UserError, match="not available"):
        Timer("cuda")


def test_erratic_function_warns():
    state = {"n": 0}

    def erratic():
        state["n"] += 1
        time.sleep(0.001 if state["n"] % 2 else 0.02)

    with pytest.warns(TimingSpreadWarning, match="spread too wide to trust"):
        result = time_callable(erratic, warmup=0, repeats=10)
    assert result.spread_too_wide
    assert result.rel_iqr > 0.1


def test_steady_function_does_not_warn():
    with warnings.catch_warnings():
        warnings.simplefilter("error", TimingSpreadWarning)
        # 10 ms sleeps vary by far less than their own length, even on a busy machine.
        result = time_callable(lambda: time.sleep(0.01), warmup=1, repeats=8, max_rel_iqr=1.0)
    assert not result.spread_too_wide


def test_statistics_and_str_from_known_samples():
    result = TimingResult.from_samples(
        [0.001, 0.002, 0.003, 0.004, 0.005], warmup=3, device="cpu", method=METHOD_PERF_COUNTER,
        max_rel_iqr=0.1,
    )
    assert result.median == pytest.approx(0.003)
    assert result.mean == pytest.approx(0.003)
    assert result.iqr == pytest.approx(0.002)  # inclusive quartiles: 0.002 and 0.004
    assert result.rel_iqr == pytest.approx(2 / 3)
    assert result.spread_too_wide
    assert str(result) == (
        "3.00 ms median (min 1.00, IQR 2.00 ms = 67%) over 5 runs [spread too wide to trust]"
    )
    single = TimingResult.from_samples([0.0123], warmup=0, device="cpu", method=METHOD_PERF_COUNTER,
                                       max_rel_iqr=0.1)
    assert single.iqr == 0.0 and not single.spread_too_wide
    assert str(single) == "12.3 ms median (min 12.3, IQR 0.00 ms = 0%) over 1 runs"


def test_to_dict_is_json_serialisable():
    result = time_callable(lambda: None, warmup=0, repeats=3, max_rel_iqr=float("inf"))
    data = json.loads(json.dumps(result.to_dict(), allow_nan=False))
    assert data["repeats"] == 3 and len(data["samples"]) == 3
    for key in ("median", "mean", "min", "max", "iqr", "rel_iqr", "warmup", "device", "method",
                "spread_too_wide"):
        assert key in data
    # Below clock resolution the median can be 0 with a spread: rel_iqr is inf -> null.
    zero = TimingResult.from_samples([0.0, 0.0, 0.0, 1e-9], warmup=0, device="cpu",
                                     method=METHOD_PERF_COUNTER, max_rel_iqr=0.1)
    assert json.loads(json.dumps(zero.to_dict(), allow_nan=False))["rel_iqr"] is None


def test_timer_measures_a_sleep():
    with Timer("cpu") as t:
        time.sleep(0.01)
    assert 0.009 <= t.elapsed_s < 0.5


def test_timer_elapsed_before_exit_is_an_error():
    t = Timer()
    with pytest.raises(RuntimeError):
        _ = t.elapsed_s
