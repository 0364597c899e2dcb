"""plan/trace.py: a user nn.Module measured on fake tensors, checked against real runs."""

from __future__ import annotations

import os
import resource
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.flops import flops_per_token
from slipstream.observe.memprofile import measure_step_memory
from slipstream.plan.model import resolve_model
from slipstream.plan.trace import TracedModule, trace_module

REPO = Path(__file__).resolve().parents[2]
FACTORIES = "tests.unit.plan_user_model"


@pytest.fixture(autouse=True)
def _in_repo(monkeypatch):
    monkeypatch.chdir(REPO)  # factory specs are importable from the repository root


@pytest.fixture(scope="module")
def custom():
    return trace_module(f"{FACTORIES}:custom_lm", vocab=1000, seq_len=64).traced


def _real_activation_bytes(model, vocab: int, seq_len: int, autocast: bool) -> int:
    """Measured on real CPU tensors: forward + backward peak at micro-batch 2 minus 1,
    after a first step (so the optimizer state exists), with slipstream's memory profiler."""
    torch.manual_seed(0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

    def forward_backward(batch):
        idx = torch.randint(0, vocab, (batch, seq_len))
        targets = torch.randint(0, vocab, (batch, seq_len))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(idx)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), targets.view(-1))
        loss.backward()

    def step():
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    forward_backward(1)
    step()
    peaks = []
    for batch in (1, 2):
        report = measure_step_memory(model, optimizer, lambda: forward_backward(batch), step, "cpu")
        peaks.append(max(report.phases["forward"]["peak_bytes"], report.phases["backward"]["peak_bytes"]))
    return peaks[1] - peaks[0]


# --- what is measured --------------------------------------------------------------------

def test_custom_module_counts(custom):
    from tests.unit.plan_user_model import custom_lm

    real = custom_lm(vocab_size=1000, seq_len=64)
    assert isinstance(custom, TracedModule)
    assert custom.n_params == sum(p.numel() for p in real.parameters())
    assert custom.vocab == 1000 and custom.seq_len == 64  # the factory was given the planner's values
    assert custom.param_bytes == custom.grad_bytes == 4 * custom.n_params
    # AdamW: two fp32 moments per parameter (+ a scalar step tensor per parameter tensor)
    assert 8 * custom.n_params <= custom.optimizer_bytes <= 8 * custom.n_params + 4 * 64
    # Every matmul counted: 6 x matmul weights + the attention matmuls (4 T d per layer forward, x3 in all)
    d, layers, T, V = 96, 4, 64, 1000
    matmul_weights = layers * 10 * d * d + d * V
    assert custom.flops_per_token == pytest.approx(6 * matmul_weights + 12 * layers * d * T, rel=1e-6)
    assert custom.activation_bytes_per_sequence["bf16"] < custom.activation_bytes_per_sequence["fp32"]
    assert all(v >= 0 for v in custom.fixed_bytes.values())


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_custom_module_activations_match_a_real_run(custom, precision):
    from tests.unit.plan_user_model import custom_lm

    real = _real_activation_bytes(custom_lm(vocab_size=1000, seq_len=64), 1000, 64, autocast=precision == "bf16")
    traced = custom.activation_bytes_per_sequence[precision]
    print(f"{precision}: traced {traced} real {real} error {traced / real - 1:+.2%}")
    assert traced == pytest.approx(real, rel=0.10)


def test_slipstream_transformer_matches_the_formulas():
    from tests.unit.plan_user_model import TINY_TRANSFORMER, slipstream_tiny

    cfg = ModelConfig(**TINY_TRANSFORMER)
    seq_len = 128
    traced = trace_module(f"{FACTORIES}:slipstream_tiny", vocab=cfg.vocab_size, seq_len=seq_len).traced
    real = slipstream_tiny()
    assert traced.n_params == sum(p.numel() for p in real.parameters())  # tied head counted once
    formula = flops_per_token(cfg, seq_len)
    print(f"flops/token traced {traced.flops_per_token:.0f} formula {formula:.0f} "
          f"error {traced.flops_per_token / formula - 1:+.2%}")
    assert traced.flops_per_token == pytest.approx(formula, rel=0.05)
    real_acts = _real_activation_bytes(real, cfg.vocab_size, seq_len, autocast=False)
    print(f"activations traced {traced.activation_bytes_per_sequence['fp32']} real {real_acts}")
    assert traced.activation_bytes_per_sequence["fp32"] == pytest.approx(real_acts, rel=0.10)


def test_step_peak_reproduces_the_measured_peak(custom):
    for precision in ("fp32", "bf16"):
        assert custom.step_peak_bytes(1, precision) == custom.peak_bytes[precision]
        assert custom.step_peak_bytes(3, precision) == (custom.peak_bytes[precision]
                                                        + 2 * custom.activation_bytes_per_sequence[precision])
        # the spec's decomposition never predicts less than the measured peak
        upper = (custom.param_bytes + custom.grad_bytes + custom.optimizer_bytes
                 + custom.activation_bytes_per_sequence[precision] + custom.fixed_bytes[precision])
        assert upper >= custom.peak_bytes[precision]


def test_factories_built_on_meta_or_for_gpu_trace_the_same_model():
    from tests.unit.plan_user_model import meta_lm

    on_gpu = trace_module(f"{FACTORIES}:slipstream_built_on_gpu", vocab=256, seq_len=64).traced
    plain = trace_module(f"{FACTORIES}:slipstream_tiny", vocab=256, seq_len=64).traced
    assert (on_gpu.n_params, on_gpu.flops_per_token, on_gpu.activation_bytes_per_sequence) == \
        (plain.n_params, plain.flops_per_token, plain.activation_bytes_per_sequence)
    meta = trace_module(f"{FACTORIES}:meta_lm", vocab=512, seq_len=64).traced
    with torch.device("meta"):
        expected = sum(p.numel() for p in meta_lm().parameters())  # tied: embedding counted once
    assert meta.n_params == expected and meta.param_bytes == 4 * expected
    assert torch.utils.swap_tensors.__module__ == "torch.utils"  # our patch is undone


def test_a_20b_model_traces_without_allocating():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    start = time.perf_counter()
    traced = trace_module(f"{FACTORIES}:huge_lm", vocab=32000, seq_len=256).traced
    seconds = time.perf_counter() - start
    growth = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
    print(f"20B trace: {seconds:.2f} s, peak RSS growth {growth / 2**20:.0f} MiB")
    assert traced.n_params > 20e9
    assert traced.param_bytes == 4 * traced.n_params   # 83 GB that never existed
    assert growth < 500 * 2**20
    assert seconds < 10


def test_resolve_model_traces_factories():
    model = resolve_model(f"{FACTORIES}:custom_lm_fixed", vocab=2000, seq_len=32)
    assert model.name == f"{FACTORIES}:custom_lm_fixed"
    assert isinstance(model.traced, TracedModule)
    assert model.traced.vocab == 2000 and model.traced.seq_len == 32
    assert model.cfg.vocab_size == 2000


def test_factory_in_the_current_directory(tmp_path, monkeypatch):
    (tmp_path / "my_lm_factory_for_trace.py").write_text(
        "import torch.nn as nn\n"
        "def make():\n"
        "    return nn.Sequential(nn.Embedding(50, 8), nn.Linear(8, 50))\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path), os.getcwd())])
    try:
        traced = trace_module("my_lm_factory_for_trace:make", vocab=50, seq_len=16).traced
    finally:
        sys.modules.pop("my_lm_factory_for_trace", None)
    assert traced.n_params == 50 * 8 + 8 * 50 + 50
    assert str(tmp_path) not in sys.path


# --- errors ------------------------------------------------------------------------------

@pytest.mark.parametrize("spec, words", [
    ("justaname", ["package.module:function"]),
    ("some/file.py:make", ["package.module:function"]),
    (":make", ["package.module:function"]),
    ("tests.unit.no_such_module:make", ["cannot import", "tests.unit.no_such_module", "ModuleNotFoundError"]),
    (f"{FACTORIES}:no_such_function", ["no attribute 'no_such_function'", "custom_lm"]),
    (f"{FACTORIES}:NOT_CALLABLE", ["not callable"]),
    (f"{FACTORIES}:raises", ["factory exploded", "FakeTensorMode"]),
    (f"{FACTORIES}:returns_int", ["int", "not a torch.nn.Module"]),
    (f"{FACTORIES}:wants_floats", ["token ids of shape (1, 16)", "int64", "logits (B, T, V)"]),
    (f"{FACTORIES}:data_dependent", ["token ids of shape (1, 16)", "DataDependent", "fake tensors"]),
])
def test_bad_inputs_are_user_errors(spec, words):
    with pytest.raises(UserError) as info:
        trace_module(spec, vocab=100, seq_len=16)
    for word in words:
        assert word in str(info.value), str(info.value)
