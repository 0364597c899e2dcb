"""`slipstream tune system` end to end on this CPU: real `slipstream train` trials of the tiny
model, predicted vs measured, the winner written as a config that loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from slipstream.cli.plan import add_tune_arguments, cmd_tune_system
from slipstream.config.load import load_config
from slipstream.plan.tune import format_report

ROOT = Path(__file__).resolve().parents[2]


def _tune(argv: list[str]) -> int:
    """`slipstream tune system ARGV` in this process (each trial still is a real subprocess)."""
    args, extra = add_tune_arguments(argparse.ArgumentParser()).parse_known_args(argv)
    return cmd_tune_system(args, extra)


@pytest.mark.timeout(180)
def test_tune_system_runs_real_trials(tiny_overrides, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "2")  # the trials inherit it: no more threads than cores
    out = tmp_path / "tuned" / "best.toml"
    # seq 32, global batch 4: three trials of 6 steps, a few seconds each.
    code = _tune(["--config", str(ROOT / "configs" / "tiny.toml"), "--top", "2", "--budget", "90s", "--steps", "6",
                  "--json", "--write-config", str(out), *tiny_overrides, "--train.device=cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(printed)

    assert result["cluster"] == "1xcpu" and result["trial_timeout_s"] == pytest.approx(30.0)
    assert [r["label"] for r in result["candidates"]][0] == "current" and len(result["candidates"]) == 3
    for r in result["candidates"]:
        assert r["status"] == "ok", r
        assert r["predicted"]["tokens_per_s"] > 0 and r["measured"]["tokens_per_s"] > 0
        assert r["measured"]["peak_bytes"] > 0
    fastest = max(result["candidates"], key=lambda r: r["measured"]["tokens_per_s"])
    assert result["winner"]["layout"] == fastest["layout"] and result["efficiency"] > 0

    cfg = load_config(out)
    expected = {"train.micro_batch_size": 4, "train.grad_accum_steps": 1, **result["winner"]["overrides"]}
    assert cfg.train.micro_batch_size == expected["train.micro_batch_size"]
    assert cfg.train.grad_accum_steps == expected["train.grad_accum_steps"]
    assert cfg.model.preset == "tiny" and cfg.train.seq_len == 32
    assert "winner:" in format_report(result)
