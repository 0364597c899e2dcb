"""Tests for slipstream.ops.fused_ce: the chunked fused linear + cross-entropy custom op."""

import importlib.util
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from slipstream.errors import UserError
from slipstream.ops import fused_ce
from slipstream.ops.fused_ce import fused_linear_cross_entropy, linear_cross_entropy_reference
from slipstream.perf.fused_ce_bench import peak_memory_bytes

SRC_DIR = Path(__file__).resolve().parents[2] / "src"


def _inputs(n_rows, d, vocab, dtype=torch.float32, ignore_every=0, seed=0, leading=None):
    generator = torch.Generator().manual_seed(seed)
    shape = leading if leading is not None else (n_rows,)
    h = torch.randn(*shape, d, generator=generator).to(dtype).requires_grad_()
    weight = (torch.randn(vocab, d, generator=generator) / 3).to(dtype).requires_grad_()
    targets = torch.randint(0, vocab, shape, generator=generator)
    if ignore_every:
        targets.view(-1)[::ignore_every] = -100
    return h, weight, targets


def _loss_and_grads(loss_fn, h, weight, targets):
    loss = loss_fn(h, weight, targets)
    grad_h, grad_w = torch.autograd.grad(loss, (h, weight))
    return loss.detach(), grad_h, grad_w


def _assert_close_rel(actual, expected, rel):
    """max |actual - expected| <= rel * max |expected| (grads have many near-zero entries)."""
    err = (actual.float() - expected.float()).abs().max().item()
    scale = expected.float().abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3g} > {rel} * {scale:.3g}"


@pytest.mark.parametrize(
    "n_rows, vocab, chunk_size, ignore_every",
    [
        (32, 100, 8, 0),  # N divisible by the chunk
        (37, 100, 8, 4),  # N not divisible, with ignored rows
        (37, 100, 64, 3),  # chunk larger than N (a single chunk)
        (37, 128, 5, 0),  # a vocab padded beyond the real one is just more columns
    ],
)
def test_fp32_matches_reference(n_rows, vocab, chunk_size, ignore_every):
    h, weight, targets = _inputs(n_rows, 16, vocab, ignore_every=ignore_every)
    if vocab == 128:
        with torch.no_grad():
            weight[100:] = 0.0  # padding rows, as a padded LM head has them

    def fused(h, w, t):
        return fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size, backend="torch")

    loss, grad_h, grad_w = _loss_and_grads(fused, h, weight, targets)
    ref_loss, ref_grad_h, ref_grad_w = _loss_and_grads(linear_cross_entropy_reference, h, weight, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    _assert_close_rel(grad_h, ref_grad_h, 1e-5)
    _assert_close_rel(grad_w, ref_grad_w, 1e-5)


def test_leading_dims_are_flattened():
    h, weight, targets = _inputs(0, 16, 50, leading=(3, 7), ignore_every=5)
    loss, grad_h, grad_w = _loss_and_grads(
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=4), h, weight, targets
    )
    ref_loss, ref_grad_h, ref_grad_w = _loss_and_grads(linear_cross_entropy_reference, h, weight, targets)
    assert grad_h.shape == (3, 7, 16)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0)
    _assert_close_rel(grad_h, ref_grad_h, 1e-5)
    _assert_close_rel(grad_w, ref_grad_w, 1e-5)


# Stated tolerances for half-precision inputs. The fused op runs the logits matmul in the input
# dtype (as the unfused model does) while the reference upcasts h and W to fp32 first, so the
# logits differ by one input-dtype rounding; the grads are also rounded to the input dtype.
# Measured: bf16 loss ~1e-4 rel, grads ~7e-3 of max; fp16 loss ~1e-5, grads ~1e-3.
HALF_TOLERANCES = {torch.bfloat16: (1e-3, 2e-2), torch.float16: (1e-4, 4e-3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_matches_reference(dtype):
    h, weight, targets = _inputs(70, 32, 300, dtype=dtype, ignore_every=5)
    loss, grad_h, grad_w = _loss_and_grads(
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=16, backend="torch"), h, weight, targets
    )
    ref_loss, ref_grad_h, ref_grad_w = _loss_and_grads(linear_cross_entropy_reference, h, weight, targets)
    loss_rel, grad_rel = HALF_TOLERANCES[dtype]
    assert loss.dtype == torch.float32  # the loss is always accumulated and returned in fp32
    assert grad_h.dtype == dtype and grad_w.dtype == dtype
    torch.testing.assert_close(loss, ref_loss, rtol=loss_rel, atol=0)
    _assert_close_rel(grad_h, ref_grad_h, grad_rel)
    _assert_close_rel(grad_w, ref_grad_w, grad_rel)


def test_all_rows_ignored_is_nan_with_zero_grads_like_f_cross_entropy():
    h, weight, targets = _inputs(10, 8, 20)
    targets[:] = -100
    loss, grad_h, grad_w = _loss_and_grads(
        lambda h, w, t: fused_linear_cross_entropy(h, w, t, chunk_size=4), h, weight, targets
    )
    ref_loss, ref_grad_h, ref_grad_w = _loss_and_grads(linear_cross_entropy_reference, h, weight, targets)
    assert torch.isnan(loss) and torch.isnan(ref_loss)
    assert torch.equal(grad_h, ref_grad_h) and torch.equal(grad_w, ref_grad_w)
    assert not grad_h.any() and not grad_w.any()


def test_backend_selection_and_errors(monkeypatch):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_ce._resolve_backend("auto", cpu) == "torch"
    assert fused_ce._resolve_backend("torch", cuda) == "torch"
    monkeypatch.setattr(fused_ce, "TRITON_INSTALLED", True)
    assert fused_ce._resolve_backend("auto", cuda) == "triton"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(UserError, match="need CUDA tensors.*TRITON_INTERPRET=1"):
        fused_ce._resolve_backend("triton", cpu)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fused_ce._resolve_backend("triton", cpu) == "triton"
    monkeypatch.setattr(fused_ce, "TRITON_INSTALLED", False)
    assert fused_ce._resolve_backend("auto", cuda) == "torch"
    with pytest.raises(UserError, match="triton is not installed"):
        fused_ce._resolve_backend("triton", cuda)
    with pytest.raises(UserError, match="unknown backend 'cuda'"):
        fused_ce._resolve_backend("cuda", cpu)


def test_opcheck_forward_and_backward_ops():
    h, weight, targets = _inputs(13, 8, 33, ignore_every=4)
    utils = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    forward = torch.ops.slipstream.fused_linear_cross_entropy.default
    torch.library.opcheck(forward, (h, weight, targets, 4, -100, "torch"), test_utils=utils)
    _, lse = forward(h.detach(), weight.detach(), targets, 4, -100, "torch")
    backward = torch.ops.slipstream.fused_linear_cross_entropy_backward.default
    args = (torch.tensor(1.0), h.detach(), weight.detach(), targets, lse, 4, -100, "torch")
    torch.library.opcheck(backward, args, test_utils=utils)


def test_torch_compile_fullgraph_matches_eager():
    # The one compiled test (cold inductor compile is ~10-30 s on 2 cores).
    def step(x, proj, weight, targets):
        h = torch.tanh(x @ proj)
        return fused_linear_cross_entropy(h, weight, targets, chunk_size=5)

    generator = torch.Generator().manual_seed(0)
    x = torch.randn(2, 9, 8, generator=generator)
    proj = torch.randn(8, 8, generator=generator, requires_grad=True)
    weight = torch.randn(33, 8, generator=generator, requires_grad=True)
    targets = torch.randint(0, 33, (2, 9), generator=generator)
    targets[0, 3] = -100

    eager_loss = step(x, proj, weight, targets)
    eager_grads = torch.autograd.grad(eager_loss, (proj, weight))
    compiled_loss = torch.compile(step, fullgraph=True)(x, proj, weight, targets)
    compiled_grads = torch.autograd.grad(compiled_loss, (proj, weight))
    torch.testing.assert_close(compiled_loss, eager_loss, rtol=1e-5, atol=1e-6)
    for compiled, eager in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-6)


def test_fused_peak_memory_is_below_reference():
    # Logits dominate: N * V * 4 = 128 MiB of fp32 logits vs 0.5 MiB of h and 4 MiB of W.
    n_rows, d, vocab, chunk_size = 2048, 64, 16384, 256
    h, weight, targets = _inputs(n_rows, d, vocab)

    # Forward + backward, grads counted; autograd.grad leaves nothing behind between the two runs.
    def fused():
        loss = fused_linear_cross_entropy(h, weight, targets, chunk_size=chunk_size, backend="torch")
        torch.autograd.grad(loss, (h, weight))

    def reference():
        torch.autograd.grad(linear_cross_entropy_reference(h, weight, targets), (h, weight))

    fused_peak = peak_memory_bytes(fused, "cpu")
    reference_peak = peak_memory_bytes(reference, "cpu")
    logits_bytes = n_rows * vocab * 4
    chunk_bytes = chunk_size * vocab * 4
    grads_bytes = (h.numel() + weight.numel()) * 4
    # The reference holds at least the full logits; the fused op at most one chunk + the grads.
    assert reference_peak >= logits_bytes
    assert fused_peak >= chunk_bytes  # measured for real: the chunk's logits are seen
    assert fused_peak <= chunk_bytes + grads_bytes + 2**20
    assert fused_peak < reference_peak / 4


TRITON_SCRIPT = textwrap.dedent(
    """
    import os
    assert os.environ["TRITON_INTERPRET"] == "1"  # must be set before triton is imported
    import torch
    from slipstream.ops.fused_ce import fused_linear_cross_entropy, linear_cross_entropy_reference

    def check(dtype, n_rows, vocab, chunk_size, loss_rel, grad_rel):
        g = torch.Generator().manual_seed(0)
        h = torch.randn(n_rows, 16, generator=g).to(dtype).requires_grad_()
        w = (torch.randn(vocab, 16, generator=g) / 3).to(dtype).requires_grad_()
        t = torch.randint(0, vocab, (n_rows,), generator=g)
        t[::4] = -100
        results = []
        for fn in (
            lambda: fused_linear_cross_entropy(h, w, t, chunk_size=chunk_size, backend="triton"),
            lambda: linear_cross_entropy_reference(h, w, t),
        ):
            loss = fn()
            results.append((loss.detach(), *torch.autograd.grad(loss, (h, w))))
        (loss, gh, gw), (ref_loss, ref_gh, ref_gw) = results
        assert gh.dtype == dtype and gw.dtype == dtype
        assert abs(loss.item() - ref_loss.item()) <= loss_rel * abs(ref_loss.item()), (dtype, loss, ref_loss)
        for got, want in ((gh, ref_gh), (gw, ref_gw)):
            err = (got.float() - want.float()).abs().max().item()
            assert err <= grad_rel * want.float().abs().max().item(), (dtype, err)

    # vocab 1100 is not a multiple of the 512-column tile; 37 rows is not a multiple of 16-row
    # blocks nor of the chunk.
    check(torch.float32, 37, 1100, 20, 1e-5, 1e-5)
    check(torch.bfloat16, 37, 1100, 20, 1e-3, 2e-2)
    print("TRITON_OK")
    """
)


def test_triton_kernels_in_interpreter_match_reference():
    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    pythonpath = os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=pythonpath)
    result = subprocess.run(
        [sys.executable, "-c", TRITON_SCRIPT], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "TRITON_OK" in result.stdout
