"""train.fused_loss through the training loop: the same losses as the standard head + loss
(to float rounding), in fp32 and under bf16 autocast, with less activation memory."""

import json

import pytest
import torch

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


def test_fused_loss_reaches_the_head_through_a_ddp_wrapper(tmp_path):
    """DDP hides the model behind .module; the fused loss must find lm_head there (zero1/ddp + fused_loss)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from slipstream.config.schema import ModelConfig
    from slipstream.config.presets import PRESETS
    from slipstream.models.transformer import build_model
    from slipstream.train.lm_loss import fused_lm_loss_fn, lm_loss_fn

    cfg = ModelConfig(**{**PRESETS["tiny"], "preset": "tiny", "vocab_size": 64})
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(build_model(cfg))
        x = torch.randint(0, 64, (2, 16))
        y = torch.randint(0, 64, (2, 16))
        fused = fused_lm_loss_fn(model, (x, y), chunk_size=8)
        plain = lm_loss_fn(model, (x, y))
        assert torch.allclose(fused, plain, atol=1e-5)
    finally:
        dist.destroy_process_group()
