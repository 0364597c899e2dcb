"""Precision switches: bf16/fp16 autocast train like fp32 within a stated tolerance, fp16
loss scaling skips overflowing steps (counted, parameters untouched) and resumes exactly,
CUDA-only switches are guarded."""

import json

import pytest
import torch

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.optimize.precision import apply_fp8, fp8_support
from slipstream.runtime import configure_tf32
from slipstream.train.lm import build_lm_trainer, train_lm


def metrics(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]


@pytest.mark.parametrize("autocast", ["bf16", "fp16"])
def test_autocast_trains_like_fp32(tiny_overrides, tmp_path, autocast):
    """Every logged loss within 1e-3 relative of fp32 (measured: ~3e-5), and not bitwise equal:
    reduced-precision matmuls really ran."""
    train_lm(load_config(None, tiny_overrides + [f"--run.dir={tmp_path / 'fp32'}"]))
    low = train_lm(load_config(None, tiny_overrides + [f"--run.dir={tmp_path / autocast}",
                                                       f"--precision.autocast={autocast}"]))
    base = {r["step"]: r["loss"] for r in metrics(tmp_path / "fp32")}
    other = {r["step"]: r["loss"] for r in metrics(tmp_path / autocast)}
    assert base.keys() == other.keys()
    assert all(abs(other[s] - base[s]) <= 1e-3 * base[s] for s in base)
    assert any(other[s] != base[s] for s in base)
    if autocast == "fp16":
        assert low["skipped_steps"] == 0  # the default scale does not overflow here
        assert all(r["loss_scale"] > 0 for r in metrics(tmp_path / "fp16"))


def test_fp16_overflow_skips_steps_and_counts_them(tiny_overrides, tmp_path):
    cfg = load_config(None, tiny_overrides + ["--precision.autocast=fp16", "--precision.fp16_init_scale=1e30",
                                              "--train.max_steps=4", "--checkpoint.save_final=false"])
    trainer = build_lm_trainer(cfg)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    it = iter(trainer.train_loader)
    trainer.train_step(it)  # scale 1e30 overflows fp16 gradients: the step must be skipped
    assert int(trainer.skipped_steps) == 1
    assert trainer.scaler.get_scale() < 1e30
    assert all(torch.equal(p, before[n]) for n, p in trainer.model.named_parameters())
    summary = train_lm(load_config(None, tiny_overrides + [f"--run.dir={tmp_path / 'skips'}",
                                                           "--precision.autocast=fp16",
                                                           "--precision.fp16_init_scale=1e30"]))
    records = metrics(tmp_path / "skips")
    assert summary["skipped_steps"] >= 1 and records[-1]["skipped_steps"] == summary["skipped_steps"]
    assert records[-1]["loss_scale"] < 1e30


def test_fp16_resume_restores_the_loss_scale(tiny_overrides, tmp_path):
    over = ["--precision.autocast=fp16", "--precision.fp16_init_scale=1e30", "--precision.fp16_growth_interval=3"]
    straight = tmp_path / "straight"
    train_lm(load_config(None, tiny_overrides + over + [f"--run.dir={straight}"]))
    part = tmp_path / "part"
    train_lm(load_config(None, tiny_overrides + over + [f"--run.dir={part}", "--checkpoint.interval=5"]))
    for ckpt in sorted((part / "checkpoints").glob("step_*"))[1:]:  # keep only step 5
        import shutil

        shutil.rmtree(ckpt)
    train_lm(load_config(None, tiny_overrides + over + [f"--run.dir={part}", "--checkpoint.resume=auto"]))
    a = {r["step"]: (r["loss"], r["loss_scale"], r["skipped_steps"]) for r in metrics(straight)}
    b = {r["step"]: (r["loss"], r["loss_scale"], r["skipped_steps"]) for r in metrics(part)}
    assert a == b


def test_cuda_only_switches_are_guarded_on_cpu(tiny_overrides):
    configure_tf32(torch.device("cpu"), True)  # nothing to change on CPU, must not fail
    assert "CUDA" in fp8_support(torch.device("cpu"))
    with pytest.raises(UserError, match="precision.fp8"):
        apply_fp8(torch.nn.Linear(16, 16), torch.device("cpu"))
    with pytest.raises(UserError, match="fp8"):
        build_lm_trainer(load_config(None, tiny_overrides + ["--precision.fp8=true"]))
