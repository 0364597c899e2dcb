"""The Triton fused linear + cross-entropy on CUDA tensors (skipped without a GPU and triton).

tests/unit/test_ops_fused_ce.py checks the op on CPU and the Triton kernels in the
interpreter; here the compiled kernels run on the device: forward loss and both gradients
against the fp32 reference, on shapes that are not multiples of the kernels' tiles, with
ignored rows, in fp32 / bf16 / fp16, under torch.compile, and with a smaller allocator peak
than the unfused path.
"""

import importlib.util

import pytest
import torch

from slipstream.ops.fused_ce import fused_linear_cross_entropy, linear_cross_entropy_reference

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(),
                       reason="needs a CUDA device (run `slipstream bench gpu` on a GPU machine)"),
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed"),
]


def _inputs(n_rows, d, vocab, dtype, ignore_every=0, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    h = torch.randn(n_rows, d, device="cuda", generator=g).to(dtype).requires_grad_()
    w = (torch.randn(vocab, d, device="cuda", generator=g) / d**0.5).to(dtype).requires_grad_()
    t = torch.randint(0, vocab, (n_rows,), device="cuda", generator=g)
    if ignore_every:
        t[::ignore_every] = -100
    return h, w, t


def _loss_and_grads(fn, h, w, t):
    loss = fn(h, w, t)
    return (loss.detach(), *torch.autograd.grad(loss, (h, w)))


def _reference(h, w, t):
    """The fp32 reference on fp32 copies: what every dtype is compared with."""
    h32, w32 = h.detach().float().requires_grad_(), w.detach().float().requires_grad_()
    return _loss_and_grads(linear_cross_entropy_reference, h32, w32, t)


def _assert_matches(got, want, loss_rel, grad_rel):
    loss, gh, gw = got
    ref_loss, ref_gh, ref_gw = want
    assert abs(loss.item() - ref_loss.item()) <= loss_rel * abs(ref_loss.item()), (loss.item(), ref_loss.item())
    for a, b in ((gh, ref_gh), (gw, ref_gw)):
        err = (a.float() - b.float()).abs().max().item()
        assert err <= grad_rel * b.float().abs().max().item(), err


@pytest.mark.parametrize("dtype,loss_rel,grad_rel", [
    (torch.float32, 1e-4, 1e-3),  # cuBLAS may use TF32-free fp32 or split-K sums: not bit-exact
    (torch.bfloat16, 2e-3, 3e-2),
    (torch.float16, 2e-3, 2e-2),
])
@pytest.mark.parametrize("n_rows,vocab,chunk", [(37, 1100, 20), (1000, 50257, 256), (4096, 8192, 4096)])
def test_triton_backend_on_cuda_matches_the_fp32_reference(dtype, loss_rel, grad_rel, n_rows, vocab, chunk):
    h, w, t = _inputs(n_rows, 128, vocab, dtype, ignore_every=5)
    got = _loss_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=chunk, backend="triton"), h, w, t)
    assert got[1].dtype == dtype and got[2].dtype == dtype
    _assert_matches(got, _reference(h, w, t), loss_rel, grad_rel)


def test_auto_backend_is_triton_on_cuda_and_agrees_with_torch_backend():
    from slipstream.ops.fused_ce import _resolve_backend

    assert _resolve_backend("auto", torch.device("cuda")) == "triton"
    h, w, t = _inputs(513, 64, 3000, torch.bfloat16, ignore_every=7)
    fused = _loss_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=128, backend="triton"), h, w, t)
    plain = _loss_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, chunk_size=128, backend="torch"), h, w, t)
    _assert_matches(fused, plain, 2e-3, 3e-2)


def test_triton_backend_under_torch_compile_matches_eager():
    h, w, t = _inputs(300, 64, 2000, torch.bfloat16)

    def loss_fn(a, b, c):
        return fused_linear_cross_entropy(a, b, c, chunk_size=128, backend="triton")

    eager = _loss_and_grads(loss_fn, h, w, t)
    compiled = _loss_and_grads(torch.compile(loss_fn, fullgraph=True), h, w, t)
    _assert_matches(compiled, eager, 1e-5, 1e-5)


def test_all_rows_ignored_gives_nan_and_zero_grads_like_cross_entropy():
    h, w, t = _inputs(64, 32, 500, torch.float32)
    t.fill_(-100)
    loss, gh, gw = _loss_and_grads(lambda a, b, c: fused_linear_cross_entropy(a, b, c, backend="triton"), h, w, t)
    assert torch.isnan(loss)
    assert torch.count_nonzero(gh) == 0 and torch.count_nonzero(gw) == 0


def test_fused_allocator_peak_is_below_the_unfused_path():
    h, w, t = _inputs(8192, 256, 32768, torch.bfloat16)

    def peak(fn):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
        loss = fn()
        torch.autograd.grad(loss, (h, w))
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - start

    fused = peak(lambda: fused_linear_cross_entropy(h, w, t, chunk_size=1024, backend="triton"))
    unfused = peak(lambda: torch.nn.functional.cross_entropy((h @ w.T).float(), t))
    logits_fp32 = 8192 * 32768 * 4
    assert unfused >= logits_fp32  # the unfused path materializes the fp32 logits at least once
    assert fused < unfused / 4, (fused, unfused)
