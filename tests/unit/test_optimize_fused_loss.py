"""train.fused_loss through the training loop: the same losses as the standard head + loss
(to float rounding), in fp32 and under bf16 autocast, with less activation memory."""

import json

import pytest

from slipstream.config import load_config
from slipstream.train.lm import train_lm


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.parametrize("precision", ["none", "bf16"])
def test_fused_loss_matches_standard_and_saves_activations(tiny_overrides, tmp_path, precision):
    common = tiny_overrides + [f"--precision.autocast={precision}", "--train.max_steps=6"]
    std = train_lm(load_config(None, common + [f"--run.dir={tmp_path / 'std'}"]))
    # chunk 48 rows: 4 x 32 = 128 tokens per micro-batch in three chunks, the last one partial
    fused = train_lm(load_config(None, common + [f"--run.dir={tmp_path / 'fused'}", "--train.fused_loss=true",
                                                 "--train.fused_loss_chunk=48"]))
    for a, b in zip(losses(tmp_path / "std"), losses(tmp_path / "fused")):
        assert abs(a - b) <= (1e-5 if precision == "none" else 1e-4) * abs(a)  # same math, other summation order
    assert fused["memory"]["categories"]["activations"] < std["memory"]["categories"]["activations"]
