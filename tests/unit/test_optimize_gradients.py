"""Gradients, not just losses: one forward/backward through the trainer on the same batch,
with and without a switch; every parameter's gradient compared to the baseline's."""

import pytest

from slipstream.config import load_config
from slipstream.train.lm import build_lm_trainer


def grads_after_one_backward(overrides):
    trainer = build_lm_trainer(load_config(None, overrides + ["--checkpoint.save_final=false"]))
    trainer.accumulate_gradients(iter(trainer.train_loader))
    scale = trainer.scaler.get_scale() if trainer.scaler is not None else 1.0
    return {n: p.grad.detach().float() / scale for n, p in trainer.model.named_parameters()}


@pytest.mark.parametrize("switch, tol", [
    (["--activations.checkpointing=full"], 0.0),        # recomputation repeats the same ops: bitwise
    (["--activations.checkpointing=selective"], 0.0),
    (["--train.grad_accum_steps=1", "--train.fused_loss=true"], 1e-5),
    (["--precision.autocast=bf16"], 3e-2),              # bf16 matmuls: ~8 mantissa bits
    (["--precision.autocast=fp16"], 5e-3),              # fp16 matmuls, loss-scaled then unscaled
])
def test_switch_gradients_match_baseline(tiny_overrides, switch, tol):
    base = grads_after_one_backward(tiny_overrides)
    other = grads_after_one_backward(tiny_overrides + switch)
    # Relative to the largest gradient of the model: k_proj biases have a true gradient of 0
    # (softmax is shift-invariant), so their values are rounding noise of ~1e-11.
    scale = max(g.abs().max().item() for g in base.values())
    for name, g in base.items():
        name_other = next(k for k in other if k.replace("_checkpoint_wrapped_module.", "") == name)
        diff = (other[name_other] - g).abs().max().item()
        assert diff <= tol * scale, (name, diff, scale)
