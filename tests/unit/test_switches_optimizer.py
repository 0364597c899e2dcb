"""Optimizer switches are really applied (issue 12): a switch the Trainer silently ignored would
still train, and the loss-bound tests (test_optimize_trainer_variants.py) would barely notice.

Each case trains two steps through the public Trainer and then looks at the optimizer the Trainer
built: its class, its param_groups' foreach/fused flags, which of torch's Adam kernels actually ran
(counted by wrapping them), and the dtype, device and step count of the state after the steps.
"""

from __future__ import annotations

import pytest
import torch

from slipstream import Trainer
from slipstream.config import load_config
from slipstream.models.transformer import build_model, lm_loss

STEPS = 2
TINY = ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=16", f"--train.max_steps={STEPS}",
        "--train.micro_batch_size=2", "--train.eval_steps=0", "--logging.progress=false",
        "--logging.tensorboard=false", "--metrics.memory_breakdown=false", "--checkpoint.save_final=false",
        "--optim.grad_clip=0", "--optim.warmup_steps=1", "--logging.log_interval=1"]
KERNELS = {"for-loop": "_single_tensor_adam", "foreach": "_multi_tensor_adam", "fused": "_fused_adam"}


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (16, 17), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


@pytest.fixture
def kernel_calls(monkeypatch):
    """How often each torch Adam kernel ran (AdamW dispatches to these module functions per group)."""
    import torch.optim.adam as adam

    calls = dict.fromkeys(KERNELS.values(), 0)
    for name in calls:
        original = getattr(adam, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(adam, name, counted)
    return calls


def _fit(tmp_path, *switches):
    cfg = load_config(None, TINY + list(switches) + [f"--run.dir={tmp_path / 'run'}"])
    initial = build_model(cfg.model, "cpu", seed=0)
    start = {n: p.detach().clone() for n, p in initial.named_parameters()}
    trainer = Trainer(initial, _data(), lambda m, b: lm_loss(m(b[0]), b[1]), config=cfg)
    summary = trainer.fit()
    assert summary["steps"] == STEPS and summary["final_loss"] == summary["final_loss"]  # finite, not NaN
    moved = [n for n, p in trainer.model.named_parameters() if not torch.equal(p.detach(), start[n])]
    assert moved, "no parameter changed: the optimizer never stepped"
    return trainer


def _params(trainer):
    return [p for p in trainer.model.parameters() if p.requires_grad]


def _assert_moments(state, dtype, steps=STEPS):
    assert set(state) >= {"step", "exp_avg", "exp_avg_sq"}, sorted(state)
    assert state["exp_avg"].dtype == dtype and state["exp_avg_sq"].dtype == dtype, \
        (state["exp_avg"].dtype, state["exp_avg_sq"].dtype)
    assert float(state["step"]) == steps


@pytest.mark.parametrize("implementation, expected", [
    ("for-loop", "for-loop"), ("foreach", "foreach"), ("fused", "fused"),
    ("auto", "fused"),  # auto = fused where torch has the kernel: CPU fp32 params
])
def test_implementation_is_the_one_that_runs(tmp_path, kernel_calls, implementation, expected):
    trainer = _fit(tmp_path, f"--optim.implementation={implementation}")
    opt = trainer.optimizer
    assert type(opt) is torch.optim.AdamW, type(opt)
    for group in opt.param_groups:
        assert (bool(group["foreach"]), bool(group["fused"])) == \
            {"for-loop": (False, False), "foreach": (True, False), "fused": (False, True)}[expected], \
            f"optim.implementation={implementation}: param group has foreach={group['foreach']}, fused={group['fused']}"
    # One kernel call per param group and step, and only the chosen kernel.
    want = dict.fromkeys(KERNELS.values(), 0)
    want[KERNELS[expected]] = STEPS * len(opt.param_groups)
    assert kernel_calls == want
    for p in _params(trainer):
        _assert_moments(opt.state[p], torch.float32)


def test_bf16_state_keeps_bf16_moments(tmp_path, kernel_calls):
    trainer = _fit(tmp_path, "--optim.state_dtype=bf16")
    opt = trainer.optimizer
    assert type(opt).__name__ == "AdamWBf16State" and not isinstance(opt, torch.optim.AdamW)
    assert kernel_calls == dict.fromkeys(KERNELS.values(), 0)  # its own per-parameter loop, not torch's AdamW
    params = _params(trainer)
    assert len(opt.state) == len(params)
    for p in params:
        assert p.dtype == torch.float32
        _assert_moments(opt.state[p], torch.bfloat16)


@pytest.mark.parametrize("implementation", ["auto", "foreach"])
def test_in_backward_steps_each_parameter_from_its_hook(tmp_path, kernel_calls, implementation):
    trainer = _fit(tmp_path, "--optim.in_backward=true", f"--optim.implementation={implementation}")
    opt = trainer.optimizer
    assert type(opt).__name__ == "OptimizerInBackward"
    params = _params(trainer)
    inner = list(opt.optimizers.values())
    # One AdamW per parameter, each of which stepped every step (from the backward hook).
    assert len(inner) == len(params)
    assert {id(p) for o in inner for g in o.param_groups for p in g["params"]} == {id(p) for p in params}
    expected = {"auto": "fused", "foreach": "foreach"}[implementation]
    want = dict.fromkeys(KERNELS.values(), 0)
    want[KERNELS[expected]] = STEPS * len(params)
    assert kernel_calls == want
    for o in inner:
        [p] = o.param_groups[0]["params"]
        _assert_moments(o.state[p], torch.float32)
    # The hook frees each gradient once it has been used: none is left after the step.
    assert all(p.grad is None for p in params)


@pytest.mark.parametrize("state_dtype", ["fp32", "bf16"])
def test_offload_steps_fp32_masters_on_the_host(tmp_path, kernel_calls, state_dtype):
    trainer = _fit(tmp_path, "--optim.offload=true", f"--optim.state_dtype={state_dtype}")
    opt = trainer.optimizer
    assert type(opt).__name__ == "CPUOffloadOptimizer"
    params = _params(trainer)
    model_storage = {p.untyped_storage().data_ptr() for p in params}
    masters = [m for g in opt.inner.param_groups for m in g["params"]]
    assert len(masters) == len(params)
    for master in masters:
        # The inner optimizer works on separate fp32 host copies, never on the model's storage.
        assert master.device.type == "cpu" and master.dtype == torch.float32
        assert master.untyped_storage().data_ptr() not in model_storage
        state = opt.inner.state[master]
        _assert_moments(state, {"fp32": torch.float32, "bf16": torch.bfloat16}[state_dtype])
        assert all(t.device.type == "cpu" for t in state.values() if isinstance(t, torch.Tensor))
    if state_dtype == "fp32":
        assert type(opt.inner) is torch.optim.AdamW and all(g["fused"] for g in opt.inner.param_groups)
        assert kernel_calls["_fused_adam"] == STEPS * len(opt.inner.param_groups)
    else:
        assert type(opt.inner).__name__ == "AdamWBf16State"
        assert kernel_calls == dict.fromkeys(KERNELS.values(), 0)
    # The updated masters were copied back into the model after the last step.
    device_params = [p for g in opt.param_groups for p in g["params"]]  # in the same group order
    for p, master in zip(device_params, masters, strict=True):
        assert torch.equal(p.detach(), master)
