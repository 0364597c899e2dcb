"""Tests for slipstream.observe.console."""

import functools
import io
import time

import pytest
from rich.console import Console

from slipstream.observe import console


def _drive(progress):
    with progress:
        for step in range(1, 6):
            progress.advance(step)
        progress.set_metrics({"step": 5, "loss": 3.14159, "lr": 1e-3, "tokens_per_s": 123456.0, "mfu": 0.41})
        progress.print_line("[step 5] loss 3.1416")


def test_disabled_progress_prints_plain_lines(capsys):
    progress = console.TrainProgress(total_steps=5, enabled=False)
    assert not progress.use_bar
    _drive(progress)
    out = capsys.readouterr().out
    assert out.splitlines() == [
        "train step 5/5 | loss 3.1416 | 123k tok/s | mfu 41.0% | eta 0.0s",
        "[step 5] loss 3.1416",
    ]
    assert progress.step == 5 and progress.metrics_text == "loss 3.1416 | 123k tok/s | mfu 41.0%"


def test_non_tty_degrades_to_plain_lines(capsys):
    progress = console.TrainProgress(total_steps=5, start_step=0)  # stdout is captured: not a TTY
    assert not progress.use_bar
    _drive(progress)
    out = capsys.readouterr().out
    assert "[step 5] loss 3.1416" in out and "\x1b" not in out


def test_bar_on_a_terminal(monkeypatch):
    buffer = io.StringIO()
    monkeypatch.setattr(console, "Console", functools.partial(Console, file=buffer, force_terminal=True, width=120))
    progress = console.TrainProgress(total_steps=5, start_step=0, description="train")
    assert progress.use_bar
    _drive(progress)
    out = buffer.getvalue()
    assert "[step 5] loss 3.1416" in out  # markup=False: brackets survive
    assert "5/5" in out and "loss 3.1416 | 123k tok/s | mfu 41.0%" in out
    assert "lr" not in out  # only the few live numbers go in the bar


def test_advance_is_cheap(monkeypatch):
    monkeypatch.setattr(console, "Console", functools.partial(Console, file=io.StringIO(), force_terminal=True))
    with console.TrainProgress(total_steps=20_000) as progress:
        t0 = time.perf_counter()
        for step in range(20_000):
            progress.advance(step)
        per_call = (time.perf_counter() - t0) / 20_000
    assert per_call < 50e-6  # measured ~1 us; generous for loaded CI machines


def test_eta_without_a_bar():
    progress = console.TrainProgress(total_steps=110, start_step=10, enabled=False)
    assert progress.eta_seconds() is None
    progress._start_time = time.perf_counter() - 10.0  # pretend 50 steps took 10 s
    progress.advance(60)
    assert progress.eta_seconds() == pytest.approx(10.0, rel=0.05)


def test_format_summary():
    text = console.format_summary(
        {
            "final_loss": 2.345678,
            "val_loss": None,
            "steps": 1000,
            "tokens": 123_456_789,
            "tokens_per_s": 45_678.9,
            "mfu": None,
            "mem_peak_bytes": 3 * 2**30 + 2**29,
            "wall_time_s": 3723.0,
            "run_dir": "/some/very/long/path/to/runs/2024-01-01_12-00-00_a-rather-long-run-name-that-goes-on",
            "checkpoint": "/some/very/long/path/to/runs/ckpt/step_1000",
            "steps_this_run": 12345,
            "loop_time_s": 95.0,
            "device": "cpu",
        }
    )
    assert "/some/very/long/path/to/runs/2024-01-01_12-00-00_a-rather-long-run-name-that-goes-on" in text
    assert "ckpt/step_1000" in text
    mfu_line = next(line for line in text.splitlines() if "MFU" in line)
    assert "n/a" in mfu_line
    for expected in ("2.3457", "1,000", "123M", "45.7k", "3.5 GiB", "1h 02m 03s", "12,345", "1m 35s", "device"):
        assert expected in text, expected
    assert "42.0%" in console.format_summary({"mfu": 0.42})


def test_print_summary_non_tty(capsys):
    console.print_summary({"run_dir": "runs/x", "mfu": 0.5})
    out = capsys.readouterr().out
    assert "runs/x" in out and "50.0%" in out


def test_human_units():
    assert console.human_bytes(512) == "512 B"
    assert console.human_bytes(1536) == "1.5 KiB"
    assert console.human_bytes(5 * 2**20) == "5.0 MiB"
    assert console.human_bytes(80 * 2**30) == "80.0 GiB"
    assert console.human_bytes(None) == "n/a"
    assert console.human_count(999) == "999"
    assert console.human_count(999.6) == "1k"
    assert console.human_count(1234) == "1.23k"
    assert console.human_count(7_000_000_000) == "7B"
    assert console.human_count(0.5) == "0.5"
    assert console.human_duration(42.25) == "42.2s"
    assert console.human_duration(125) == "2m 05s"
    assert console.human_duration(2 * 86400 + 3600) == "2d 01h 00m"
