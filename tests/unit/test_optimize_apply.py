"""Activation checkpointing and compile through the training loop (applied by the one
ordered chain, distributed/parallelize.py): same losses as the baseline, less measured activation
memory, checkpoints that load into a model without the switches."""

import json
from pathlib import Path

import pytest
import torch

from slipstream import Trainer
from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.train.lm import train_lm

CACHE = Path(__file__).resolve().parents[2] / ".cache" / "inductor-tests"


def losses(run_dir):
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.fixture
def base(tiny_overrides, tmp_path):
    summary = train_lm(load_config(None, tiny_overrides + ["--train.max_steps=6", f"--run.dir={tmp_path / 'base'}"]))
    return summary, losses(tmp_path / "base")


@pytest.mark.parametrize("mode", ["full", "selective", "offload"])
def test_activation_checkpointing_keeps_losses_and_saves_memory(tiny_overrides, tmp_path, base, mode):
    base_summary, base_losses = base
    summary = train_lm(load_config(None, tiny_overrides + ["--train.max_steps=6", f"--run.dir={tmp_path / mode}",
                                                           f"--activations.checkpointing={mode}"]))
    assert losses(tmp_path / mode) == base_losses  # recomputation repeats the same ops: bitwise
    if mode != "offload":  # offload moves saved tensors to host memory, which on CPU is the same memory
        assert summary["memory"]["categories"]["activations"] < base_summary["memory"]["categories"]["activations"]


def test_checkpointed_model_checkpoint_loads_into_plain_model(tiny_overrides, tmp_path):
    run = tmp_path / "ac"
    train_lm(load_config(None, tiny_overrides + ["--train.max_steps=2", f"--run.dir={run}",
                                                 "--activations.checkpointing=full"]))
    from slipstream.train.lm import load_lm_from_checkpoint

    model, _, _ = load_lm_from_checkpoint(run, device="cpu")  # a plain model: same state-dict keys
    assert sum(p.numel() for p in model.parameters()) > 0


def test_regional_compile_matches_eager(tiny_overrides, tmp_path, base, monkeypatch):
    _, base_losses = base
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(CACHE))
    train_lm(load_config(None, tiny_overrides + ["--train.max_steps=6", f"--run.dir={tmp_path / 'c'}",
                                                 "--compile.scope=blocks", "--activations.checkpointing=full",
                                                 f"--compile.cache_dir={CACHE}", "--train.deterministic=false"]))
    for a, b in zip(losses(tmp_path / "c"), base_losses):
        assert abs(a - b) <= 1e-4 * abs(b)  # inductor fuses and reorders float ops


def test_block_switches_need_blocks(tmp_path):
    model = torch.nn.Linear(4, 2)
    data = torch.utils.data.TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,)))
    for switch in ("--activations.checkpointing=full", "--compile.scope=blocks"):
        cfg = load_config(None, [switch, f"--run.dir={tmp_path}"])
        with pytest.raises(UserError, match="blocks"):
            Trainer(model, data, lambda m, b: torch.nn.functional.cross_entropy(m(b[0]), b[1]), config=cfg)
