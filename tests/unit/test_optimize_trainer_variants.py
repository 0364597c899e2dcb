"""Optimizer switches through the real training loop: same math as the baseline (bitwise
where the arithmetic is the same, stated tolerance otherwise), exact resume, and the
memory effects measured (in-backward lowers the step's peak; offload keeps state on CPU)."""

import json
import shutil

import pytest
import torch

from slipstream.config import load_config
from slipstream.optimize.optimizers import optimizer_state_devices
from slipstream.train.lm import build_lm_trainer, train_lm

BASE = ["--optim.grad_clip=0", "--optim.implementation=for-loop"]


def losses(run_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


@pytest.fixture
def baseline(tiny_overrides, tmp_path):  # noqa: D103
    summary = train_lm(load_config(None, tiny_overrides + BASE + [f"--run.dir={tmp_path / 'base'}"]))
    return summary, losses(tmp_path / "base")


@pytest.mark.parametrize("switch, rel_tol", [
    (["--optim.implementation=foreach"], 0.0),                   # same arithmetic: bitwise
    (["--optim.in_backward=true"], 0.0),                         # same per-parameter AdamW: bitwise
    (["--optim.offload=true"], 1e-6),                            # fused CPU AdamW on fp32 masters
    (["--optim.implementation=fused"], 1e-6),                    # fused kernel rounds differently
    (["--optim.state_dtype=bf16"], 2e-3),                        # bf16 moments
])
def test_optimizer_switch_keeps_the_math(tiny_overrides, tmp_path, baseline, switch, rel_tol):
    _, base = baseline
    train_lm(load_config(None, tiny_overrides + BASE + switch + [f"--run.dir={tmp_path / 'v'}"]))
    other = losses(tmp_path / "v")
    assert other.keys() == base.keys()
    for step in base:
        assert abs(other[step] - base[step]) <= rel_tol * abs(base[step]), (step, other[step], base[step])


@pytest.mark.parametrize("switch", [["--optim.in_backward=true", "--train.grad_accum_steps=2"],
                                    ["--optim.offload=true"], ["--optim.state_dtype=bf16"]])
def test_optimizer_switch_resumes_exactly(tiny_overrides, tmp_path, switch):
    straight, part = tmp_path / "straight", tmp_path / "part"
    train_lm(load_config(None, tiny_overrides + BASE + switch + [f"--run.dir={straight}"]))
    train_lm(load_config(None, tiny_overrides + BASE + switch + [f"--run.dir={part}", "--checkpoint.interval=5"]))
    for later in sorted((part / "checkpoints").glob("step_*"))[1:]:
        shutil.rmtree(later)  # as if the run had died after the step-5 checkpoint
    train_lm(load_config(None, tiny_overrides + BASE + switch + [f"--run.dir={part}", "--checkpoint.resume=auto"]))
    assert losses(straight) == losses(part)


def test_in_backward_lowers_the_measured_peak(tiny_overrides, tmp_path):
    """With parameters dominating (wide layers, one short sequence) the standard step peaks when
    all gradients and the optimizer state coexist; in backward, gradients never all exist."""
    shape = ["--model.d_model=256", "--train.micro_batch_size=1", "--train.seq_len=16", "--train.max_steps=3"]
    base = train_lm(load_config(None, tiny_overrides + BASE + shape + [f"--run.dir={tmp_path / 'std'}"]))
    inb = train_lm(load_config(None, tiny_overrides + BASE + shape + ["--optim.in_backward=true",
                                                                     f"--run.dir={tmp_path / 'ib'}"]))
    params = base["memory"]["categories"]["parameters"]
    assert inb["memory"]["peak_bytes"] < base["memory"]["peak_bytes"] - 0.5 * params
    assert inb["memory"]["phases"]["backward"]["end_bytes"] < base["memory"]["phases"]["backward"]["end_bytes"]


def test_offload_keeps_optimizer_state_off_the_training_device(tiny_overrides):
    trainer = build_lm_trainer(load_config(None, tiny_overrides + ["--optim.offload=true", "--train.max_steps=2",
                                                                   "--checkpoint.save_final=false"]))
    trainer.fit()
    assert optimizer_state_devices(trainer.optimizer) == {"cpu"}
    # Separate fp32 masters and grad buffers on the host, never the training parameters' storage.
    params = {p.untyped_storage().data_ptr() for p in trainer.model.parameters()}
    for param, master, grad_buffer in trainer.optimizer._slots:
        assert master.device.type == "cpu" and master.dtype == torch.float32 and grad_buffer.device.type == "cpu"
        assert master.untyped_storage().data_ptr() not in params
        assert torch.equal(master, param.detach().float().cpu())  # copied back after every step


def test_changing_the_optimizer_layout_on_resume_is_a_clear_error(tiny_overrides, tmp_path):
    from slipstream.errors import UserError

    train_lm(load_config(None, tiny_overrides + BASE + ["--train.max_steps=3"]))
    with pytest.raises(UserError, match="optim.offload: False -> True"):
        train_lm(load_config(None, tiny_overrides + BASE + ["--optim.offload=true", "--checkpoint.resume=auto"]))


def test_incompatible_optimizer_switches(tiny_overrides):
    from slipstream.errors import UserError

    with pytest.raises(UserError, match="grad_clip=0"):
        build_lm_trainer(load_config(None, tiny_overrides + ["--optim.in_backward=true", "--optim.grad_clip=1"]))
    with pytest.raises(UserError, match="cannot be combined"):
        build_lm_trainer(load_config(None, tiny_overrides + BASE + ["--optim.in_backward=true", "--optim.offload=true"]))
    with pytest.raises(UserError, match="fp16"):
        build_lm_trainer(load_config(None, tiny_overrides + BASE + ["--optim.in_backward=true", "--precision.autocast=fp16"]))
