"""`slipstream bench sharding --layouts ...`: the tensor- and context-parallel rungs really split
the memory (issue 13): parameters and Adam state at 1/tp, activations down with tp and cp."""

from __future__ import annotations

import json

import pytest

from slipstream.cli import main


@pytest.mark.timeout(300)
def test_bench_sharding_layouts_split_memory_per_rank(tmp_path):
    out = tmp_path / "mp.json"
    assert main(["bench", "sharding", "--layouts", "tp1", "tp2", "cp2", "--steps", "2", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    rows = {r["layout"]: r for r in result["layouts"]}
    assert set(rows) == {"tp1", "tp2", "cp2"} and result["env"]["torch_version"]
    tp2, cp2 = rows["tp2"]["vs_tp1"], rows["cp2"]["vs_tp1"]
    # tp2: every matmul weight and its Adam moments halved (norms are a rounding error here)
    assert tp2["parameters"] == pytest.approx(0.5, abs=0.01) and tp2["optimizer_state"] == pytest.approx(0.5, abs=0.01)
    # activations: measured 0.56x at tp2 (sequence parallel) and at cp2 (half the tokens)
    assert tp2["activations"] < 0.65 and cp2["activations"] < 0.65
    # cp2 averages gradients through FSDP over its 2 ranks: the Adam state is sharded too
    assert cp2["optimizer_state"] == pytest.approx(0.5, abs=0.01)
    for r in rows.values():
        assert r["step_peak_bytes"] > 0 and r["planned_peak_bytes"] > 0 and r["final_loss"] > 0
