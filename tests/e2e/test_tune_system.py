"""`slipstream tune system` end to end on this CPU: real `slipstream train` trials of the tiny
model, predicted vs measured, the winner written as a config that loads."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from slipstream.cli.tune import add_tune_arguments, cmd_tune_system
from slipstream.config.load import load_config
from slipstream.tune.system import format_report

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


@pytest.mark.timeout(240)
def test_tune_system_trials_tensor_and_context_parallel_at_nproc_2(tiny_overrides, tmp_path, capsys, monkeypatch):
    """`--nproc 2 --layouts tp2 cp2`: real `launch local --nproc 2` trials of the tensor-parallel
    (sequence + loss parallel) and context-parallel layouts next to the current one (ddp:2)."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # two ranks on two cores
    code = _tune(["--config", str(ROOT / "configs" / "tiny.toml"), "--nproc", "2", "--top", "0",
                  "--layouts", "tp2", "cp2", "--budget", "180s", "--steps", "4", "--json",
                  *tiny_overrides, "--train.device=cpu"])
    printed = capsys.readouterr().out
    assert code == 0, printed
    result = json.loads(printed)
    assert result["cluster"] == "2xcpu" and result["global_batch"] == 8  # micro-batch 4 x 2 data-parallel ranks
    current, tp2, cp2 = result["candidates"]
    assert current["layout"] == "ddp:2 mb4x1" and current["requested"] is None
    assert tp2["requested"] == "tp2" and tp2["layout"].startswith("none tp2+sp mb")
    assert (tp2["overrides"]["parallel.tp"], tp2["overrides"]["parallel.cp"]) == (2, 1)
    assert tp2["overrides"]["parallel.sequence_parallel"] is True and tp2["overrides"]["parallel.loss_parallel"] is True
    assert cp2["requested"] == "cp2" and " cp2 " in cp2["layout"]
    assert (cp2["overrides"]["parallel.tp"], cp2["overrides"]["parallel.cp"]) == (1, 2)
    for r in (current, tp2, cp2):
        assert r["status"] == "ok", r
        assert r["measured"]["tokens_per_s"] > 0 and r["measured"]["peak_bytes"] > 0
        # Per-rank peak against the per-rank plan (measured within 10 %): mixing up one rank and
        # the whole model, or the ranks' sum, would be 2x off.
        assert 0.67 < r["measured"]["peak_bytes"] / r["predicted"]["peak_bytes"] < 1.5, r
        # The same global batch in every layout: tp / cp ranks share one batch (micro-batch 8 at dp 1).
        o = r["overrides"]
        if o:
            assert o["train.micro_batch_size"] * o["train.grad_accum_steps"] == 8
