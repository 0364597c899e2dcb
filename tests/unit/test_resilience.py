"""Tests for slipstream.resilience: stability guards, step watchdog, preemption, checkpoint advice.

Watchdog kills and SIGTERM are exercised in subprocesses (they end the process); the
subprocesses import only the resilience modules (no torch), so each takes well under a second.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from slipstream.cli.checkpoint import add_advise_arguments, cmd_advise
from slipstream.errors import UserError
from slipstream.plan.checkpoint_interval import (
    advise,
    expected_loss_per_day,
    optimal_interval,
    parse_duration,
    young_interval,
)
from slipstream.resilience.guards import SpikeDetector, StabilityGuard
from slipstream.resilience.preemption import EXIT_PREEMPTED, PreemptionHandler
from slipstream.resilience.watchdog import EXIT_HANG, StepWatchdog

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _noisy_curve(n: int, noise: float, seed: int = 0) -> list[float]:
    """A typical decreasing loss: 1/sqrt(t) with multiplicative Gaussian noise."""
    rng = random.Random(seed)
    return [(1 / math.sqrt(t)) * (1 + noise * rng.gauss(0, 1)) for t in range(1, n + 1)]


# ---------------------------------------------------------------- guards


@pytest.mark.parametrize("noise,seed", [(0.02, 0), (0.02, 1), (0.02, 2), (0.10, 0), (0.10, 1)])
def test_no_false_spikes_on_noisy_decreasing_curve(noise, seed):
    det = SpikeDetector()
    assert sum(det.update(x) for x in _noisy_curve(500, noise, seed)) == 0


def test_no_false_spikes_at_threshold_3_with_two_percent_noise():
    det = SpikeDetector(threshold=3.0)
    assert sum(det.update(x) for x in _noisy_curve(500, 0.02)) == 0


def test_spike_after_stable_history_and_spikes_do_not_enter_history():
    det = SpikeDetector(window=20, min_history=10)
    for x in _noisy_curve(100, 0.02)[50:80]:
        assert not det.update(x)
    base = det.stats()[0]
    assert det.update(base * 3)
    assert det.update(base * 3)  # still a spike: the first one did not raise the median
    assert det.stats()[0] == pytest.approx(base)
    assert not det.update(base * 0.99)


def test_no_judgement_before_min_history_and_nonfinite_is_not_a_spike():
    det = SpikeDetector(min_history=5)
    for x in [1.0, 1.0, 1.0, 1.0]:
        det.update(x)
    assert not det.is_spike(100.0)  # only 4 values known
    det.update(1.0)
    assert det.is_spike(100.0)
    assert not det.is_spike(float("nan")) and not det.is_spike(float("inf"))
    det.update(float("nan"))
    assert len(det.history) == 5


def test_bad_detector_and_guard_settings_are_user_errors():
    with pytest.raises(UserError, match="min_history"):
        SpikeDetector(window=10, min_history=20)
    with pytest.raises(UserError, match="threshold"):
        SpikeDetector(threshold=0)
    with pytest.raises(UserError, match="policy"):
        StabilityGuard(policy="explode")
    with pytest.raises(UserError, match="max_events"):
        StabilityGuard(max_events=0)


def _warm(guard: StabilityGuard, n: int = 30) -> None:
    for step, x in enumerate(_noisy_curve(n, 0.02)):
        assert guard.check(step, x, 1.0, batch_position=step).ok


def test_nan_loss_at_step_k_is_skipped_and_reported():
    g = StabilityGuard(policy="skip", max_events=5)
    _warm(g)
    d = g.check(30, float("nan"), float("nan"), batch_position={"shard": 3, "offset": 1200})
    assert d.action == "skip"
    assert len(d.events) == 1  # one event per step, even with a NaN grad norm too
    ev = d.events[0]
    assert ev["kind"] == "nonfinite_loss" and ev["step"] == 30
    assert ev["batch_position"] == {"shard": 3, "offset": 1200}
    assert math.isnan(ev["loss"]) and math.isnan(ev["grad_norm"]) and ev["median"] > 0
    assert g.check(31, 0.18, 1.0).ok  # training continues afterwards


def test_inf_grad_norm_with_finite_loss():
    g = StabilityGuard(policy="skip")
    _warm(g)
    d = g.check(30, 0.18, float("inf"), batch_position=30)
    assert d.action == "skip" and d.events[0]["kind"] == "nonfinite_grad_norm"
    assert d.events[0]["grad_norm"] == float("inf")


def test_spike_under_each_policy():
    actions = {}
    for policy in ("none", "skip", "rollback", "stop"):
        g = StabilityGuard(policy=policy, max_events=3)
        _warm(g)
        d = g.check(30, 5.0, 1.0, batch_position=30)
        assert d.events and d.events[0]["kind"] == "spike" and d.events[0]["policy"] == policy
        actions[policy] = d.action
    assert actions == {"none": "ok", "skip": "skip", "rollback": "rollback", "stop": "ok"}


def test_grad_norm_is_optional():
    g = StabilityGuard()
    _warm(g)
    assert g.check(30, 0.18).ok
    assert g.check(31, float("nan")).action == "skip"


@pytest.mark.parametrize("policy", ["skip", "rollback", "stop"])
def test_stop_after_max_events(policy):
    g = StabilityGuard(policy=policy, max_events=3)
    _warm(g)
    decisions = [g.check(30 + i, float("nan"), 1.0, batch_position=30 + i) for i in range(3)]
    assert [d.action for d in decisions[:2]] == [{"stop": "ok"}.get(policy, policy)] * 2
    assert decisions[2].action == "stop"
    assert "3 unstable steps" in decisions[2].message and "step 32" in decisions[2].message
    assert g.num_events == 3


def test_policy_none_records_but_never_stops():
    g = StabilityGuard(policy="none", max_events=2)
    _warm(g)
    decisions = [g.check(30 + i, float("inf"), 1.0) for i in range(5)]
    assert all(d.action == "ok" and len(d.events) == 1 for d in decisions)
    assert g.num_events == 5


def test_guard_state_round_trips_through_json():
    g = StabilityGuard(policy="skip", max_events=4)
    _warm(g)
    g.check(30, float("nan"), float("inf"), batch_position=[0, 30])
    g.check(31, 9.0, 1.0, batch_position=[0, 31])
    state = json.loads(json.dumps(g.state_dict(), allow_nan=False))  # strict JSON: no NaN tokens

    g2 = StabilityGuard(policy="skip", max_events=4)
    g2.load_state_dict(state)
    assert g2.num_events == 2
    assert list(g2.detector.history) == list(g.detector.history)
    assert math.isnan(g2.events[0]["loss"]) and g2.events[0]["grad_norm"] == float("inf")
    assert g2.events[1]["kind"] == "spike" and g2.events[1]["batch_position"] == [0, 31]
    # The restored history judges like the original, and the count carries on to the stop.
    assert g2.check(32, 9.0, 1.0).action == "skip"
    assert g2.check(33, 9.0, 1.0).action == "stop"


# ---------------------------------------------------------------- watchdog

_WATCHDOG_SCRIPT = textwrap.dedent("""
    import sys, time
    from slipstream.resilience.watchdog import StepWatchdog
    mode, dump = sys.argv[1], sys.argv[2]
    wd = StepWatchdog(timeout_s=1.0, dump_dir=dump, rank=3).start()

    def stuck_in_collective_xyz():
        time.sleep(30)

    if mode == "hang":
        wd.beat(7)
        stuck_in_collective_xyz()
    elif mode == "beat":
        for step in range(25):
            time.sleep(0.1)
            wd.beat(step)
    elif mode == "pause":
        with wd.paused():
            time.sleep(2.5)
    wd.stop()
    print("survived")
""")


def test_watchdog_kills_hang_but_not_beating_or_paused_processes(tmp_path):
    env = {**os.environ, "PYTHONPATH": SRC}
    start = time.monotonic()
    procs = {mode: subprocess.Popen([sys.executable, "-c", _WATCHDOG_SCRIPT, mode, str(tmp_path / mode)],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
             for mode in ("hang", "beat", "pause")}
    out = {mode: p.communicate(timeout=25) + (p.returncode,) for mode, p in procs.items()}

    stdout, stderr, rc = out["hang"]
    assert rc == EXIT_HANG, stderr
    assert time.monotonic() - start < 15
    assert "survived" not in stdout
    assert len(stderr.strip().splitlines()) == 1 and "hang_rank3.txt" in stderr
    dump = (tmp_path / "hang" / "hang_rank3.txt").read_text()
    assert "last beat at step: 7" in dump and "rank: 3" in dump
    assert "stuck_in_collective_xyz" in dump  # the main thread's stack, not just the watchdog's

    for mode in ("beat", "pause"):
        stdout, stderr, rc = out[mode]
        assert rc == 0 and "survived" in stdout, (mode, stderr)
        assert not (tmp_path / mode / "hang_rank3.txt").exists()


def test_watchdog_rejects_bad_timeout_and_stops_cleanly(tmp_path):
    with pytest.raises(UserError, match="timeout"):
        StepWatchdog(0, tmp_path)
    wd = StepWatchdog(60, tmp_path).start()
    wd.beat(1)
    with wd.paused():
        with wd.paused():  # nested pauses: the inner resume must not re-arm
            pass
        assert wd._pause_depth == 1
    wd.stop()
    wd.stop()
    assert not any(t.name.startswith("slipstream-watchdog") for t in threading.enumerate())


def test_exit_codes_are_distinct():
    assert len({EXIT_HANG, EXIT_PREEMPTED, 0, 1, 2, 130}) == 6


# ---------------------------------------------------------------- preemption


def test_preemption_flag_in_process_and_handler_restored():
    before = signal.getsignal(signal.SIGUSR1)
    with PreemptionHandler(grace_s=30) as h:
        assert h.installed and not h.requested and h.seconds_left() == 30
        os.kill(os.getpid(), signal.SIGUSR1)
        deadline = time.monotonic() + 5
        while not h.requested and time.monotonic() < deadline:
            time.sleep(0.01)  # the handler runs at the main thread's next bytecode boundary
        assert h.requested and h.signal_name == "SIGUSR1" and h.count == 1
        assert 29 < h.seconds_left() <= 30
        first = h.received_at
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(0.05)
        assert h.count == 2 and h.received_at == first  # a repeat does not restart the grace clock
    assert signal.getsignal(signal.SIGUSR1) is before and not h.installed


def test_preemption_seconds_left_runs_out():
    h = PreemptionHandler(grace_s=0.05)
    h.request("test")
    time.sleep(0.1)
    assert h.requested and h.signal_name == "test" and h.seconds_left() == 0.0


def test_preemption_signal_names_and_errors():
    assert PreemptionHandler(signals=("term", 10, signal.SIGUSR2)).signals == (
        signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
    with pytest.raises(UserError, match="SIGKILL"):
        PreemptionHandler(signals=("SIGKILL",))
    with pytest.raises(UserError, match="SIGNOPE"):
        PreemptionHandler(signals=("SIGNOPE",))
    with pytest.raises(UserError, match="grace"):
        PreemptionHandler(grace_s=-1)


def test_preemption_off_main_thread_constructs_but_refuses_to_install():
    errors = []

    def worker():
        h = PreemptionHandler()  # constructing is fine anywhere
        try:
            h.install()
        except RuntimeError as e:
            errors.append(str(e))

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert errors and "main thread" in errors[0]


_PREEMPT_SCRIPT = textwrap.dedent("""
    import sys, time
    from slipstream.resilience.preemption import EXIT_PREEMPTED, PreemptionHandler
    with PreemptionHandler(grace_s=10) as h:
        print("ready", flush=True)
        for step in range(500):  # the "training loop" polls at step boundaries
            time.sleep(0.01)
            if h.requested:
                print(f"saving at step {step} after {h.signal_name}", flush=True)
                sys.exit(EXIT_PREEMPTED)
    sys.exit(1)
""")


def test_sigterm_in_subprocess_exits_preempted():
    p = subprocess.Popen([sys.executable, "-c", _PREEMPT_SCRIPT], stdout=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONPATH": SRC})
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    out, _ = p.communicate(timeout=10)
    assert p.returncode == EXIT_PREEMPTED
    assert "after SIGTERM" in out


# ---------------------------------------------------------------- advice


def test_known_intervals():
    assert young_interval(60, 86400) == pytest.approx(3219.9, abs=0.1)
    assert optimal_interval(60, 86400) == pytest.approx(3180.0, abs=0.5)  # Daly
    assert optimal_interval(100, 40) == 40  # C >= 2M: Daly says save every M


def test_interval_monotonic_and_young_minimises_first_order_loss():
    costs = [1, 10, 60, 600]
    assert sorted(optimal_interval(c, 86400) for c in costs) == [optimal_interval(c, 86400) for c in costs]
    mtbfs = [3600, 86400, 7 * 86400]
    assert sorted(optimal_interval(60, m) for m in mtbfs) == [optimal_interval(60, m) for m in mtbfs]
    tau = young_interval(60, 86400)
    best = expected_loss_per_day(tau, 60, 86400, 300)
    for factor in (0.5, 0.8, 1.25, 2.0):
        assert expected_loss_per_day(tau * factor, 60, 86400, 300) > best
    # Restart time adds a fixed cost per failure: one failure a day, 5 min restart.
    assert (expected_loss_per_day(tau, 60, 86400, 300) - expected_loss_per_day(tau, 60, 86400, 0)
            == pytest.approx(300))


def test_advise_numbers():
    a = advise(60, 86400, restart_s=300, step_time_s=1.2)
    assert a.interval_s == pytest.approx(3180.0, abs=0.5)
    assert a.interval_steps == round(a.interval_s / 1.2)
    assert a.overhead_pct == pytest.approx(100 * 60 / a.interval_s)
    saving_h = 24 * 60 / a.interval_s
    rework_h = (a.interval_s / 2 + 300) / 3600
    assert a.lost_hours_per_day == pytest.approx(saving_h + rework_h)
    assert a.rework_hours_per_day == pytest.approx(rework_h)
    assert advise(60, 86400).interval_steps is None


@pytest.mark.parametrize("text,seconds", [
    ("30s", 30), ("90m", 5400), ("24h", 86400), ("1.5d", 129600), ("250ms", 0.25), ("1h30m", 5400),
    ("45", 45), (" 2 H ", 7200), ("0", 0), (12.5, 12.5), ("5min", 300)])
def test_parse_duration(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)


@pytest.mark.parametrize("text", ["", "abc", "10x", "-5", "-5m", "nan", "inf", "1h-30m", "h", "m30"])
def test_parse_duration_rejects_bad_input(text):
    with pytest.raises(UserError, match="duration|non-negative"):
        parse_duration(text)


@pytest.mark.parametrize("args", [(0, 86400), (-1, 86400), (60, 0), (60, float("inf"))])
def test_advice_rejects_non_positive_inputs(args):
    with pytest.raises(UserError, match="> 0"):
        optimal_interval(*args)
    with pytest.raises(UserError):
        expected_loss_per_day(3000, *args)


def _cli(argv: list[str]) -> argparse.Namespace:
    parser = add_advise_arguments(argparse.ArgumentParser())
    return parser.parse_known_args(argv)


def test_cmd_advise_prints_report(capsys):
    args, extra = _cli(["--save-cost", "60s", "--mtbf", "24h", "--restart", "5m", "--step-time", "1.2s"])
    assert cmd_advise(args, extra) == 0
    out = capsys.readouterr().out
    assert "save every" in out and "53m 00s" in out and "2,650 steps" in out
    assert "Young: 53m 40s" in out and "h/day" in out

    args, extra = _cli(["--save-cost", "60", "--mtbf", "24h", "--nodes", "24"])
    assert cmd_advise(args, extra) == 0
    assert "job MTBF 1h 00m (24 nodes)" in capsys.readouterr().out

    args, extra = _cli(["--save-cost", "2h", "--mtbf", "1h"])  # saves slower than failures
    assert cmd_advise(args, extra) == 0
    out = capsys.readouterr().out
    assert "the whole day" in out and "warning" in out


@pytest.mark.parametrize("argv,match", [
    (["--save-cost", "soon", "--mtbf", "24h"], "--save-cost"),
    (["--save-cost", "0", "--mtbf", "24h"], "save_cost"),
    (["--save-cost", "30s", "--mtbf", "24h", "--nodes", "0"], "--nodes"),
    (["--save-cost", "30s", "--mtbf", "24h", "--bogus"], "unexpected"),
])
def test_cmd_advise_user_errors(argv, match):
    args, extra = _cli(argv)
    with pytest.raises(UserError, match=match):
        cmd_advise(args, extra)
