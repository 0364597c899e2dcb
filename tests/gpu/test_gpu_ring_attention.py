"""parallel.cp_attention = ring on one CUDA device (skipped without a GPU).

tests/distributed/test_ring_attention.py runs torch's ring algorithm on CPU over 2 and 4 ranks,
with the SDPA call routed to the flash or memory-efficient op and CPU kernels registered for
them. Here nothing is routed: the kernel's own SDPA call on CUDA DTensors picks a fused kernel (flash for bf16,
memory-efficient for fp32, or cuDNN), and torch's CP dispatcher must turn it into its ring
(`_templated_ring_attention` and its backward, counted here) over a cp mesh of one rank, whose
one step is the whole causal attention: output and q/k/v gradients equal plain SDPA's. The fused
op torch's ring was handed is recorded: memory-efficient attention for fp32, flash or cuDNN for
bf16 (the CPU test stands in for flash and memory-efficient). One rank never merges steps, so the
memory-efficient kernel's log-sum-exp padding, which torch's merge cannot take
(config/load.RING_QUERY_ALIGN), is checked on the kernel itself.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(),
                                reason="needs a CUDA device (run `slipstream bench gpu` on a GPU machine)")


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    """The ring kernel on a cp mesh of this one GPU, and torch's ring calls counted."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from slipstream.distributed.context_parallel import ContextParallel
    from slipstream.distributed.ring_attention import torch_ring_attention

    torch_cp = torch_ring_attention()
    calls = {"forward": 0, "backward": 0, "ops": []}
    originals = torch_cp._templated_ring_attention, torch_cp._templated_ring_attention_backward
    options = torch_cp._cp_options.enable_load_balance, torch_cp._cp_options.rotate_method

    def count(kind, fn):
        def counted(group, seq_dim, op, *args, **kwargs):
            calls[kind] += 1
            calls["ops"].append(str(op).removesuffix(".default"))  # the fused op torch's SDPA handler reached
            return fn(group, seq_dim, op, *args, **kwargs)
        return counted

    # torch's handlers look its ring functions up in their module at every call.
    torch_cp._templated_ring_attention = count("forward", originals[0])
    torch_cp._templated_ring_attention_backward = count("backward", originals[1])
    own_group = not dist.is_initialized()
    if own_group:
        store = tmp_path_factory.mktemp("ring_store") / "store"
        dist.init_process_group("nccl", init_method=f"file://{store}", rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    mesh = init_device_mesh("cuda", (1,), mesh_dim_names=("cp",))
    try:
        yield ContextParallel(mesh, load_balance=True, kernel="ring").attend, calls
    finally:
        torch_cp._templated_ring_attention, torch_cp._templated_ring_attention_backward = originals
        torch_cp._cp_options.enable_load_balance, torch_cp._cp_options.rotate_method = options
        torch_cp._disable_context_parallel_dispatcher()
        if own_group:
            dist.destroy_process_group()


@pytest.mark.parametrize("dtype,n_kv,tol", [
    (torch.bfloat16, 8, 2e-2),  # flash (or cuDNN): the ring merges in fp32 and casts back, one bf16 rounding
    (torch.bfloat16, 2, 2e-2),  # GQA: K/V repeated to the query heads before the ring
    (torch.float32, 8, 1e-4),  # memory-efficient attention
])
def test_ring_kernel_matches_sdpa_on_cuda(ring, dtype, n_kv, tol):
    attend, calls = ring
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, T, D = 2, 8, 256, 64
    q = torch.randn(B, H, T, D, device="cuda", generator=g, dtype=dtype)
    k, v = (torch.randn(B, n_kv, T, D, device="cuda", generator=g, dtype=dtype) for _ in range(2))
    grad = torch.randn(B, H, T, D, device="cuda", generator=g, dtype=dtype)
    results = []
    calls.update(forward=0, backward=0, ops=[])
    for kernel in (attend, F.scaled_dot_product_attention):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        out = kernel(*leaves, is_causal=True, enable_gqa=n_kv != H)
        out.backward(grad)
        results.append((out.detach(), *(t.grad for t in leaves)))
    assert calls["forward"] == 1 and calls["backward"] == 1, calls  # torch's ring ran, not plain SDPA
    # The fused kernel SDPA picked: fp32 has memory-efficient attention only; bf16 flash or cuDNN.
    kernels = {torch.float32: ("efficient",), torch.bfloat16: ("flash", "cudnn")}[dtype]
    forward_op, backward_op = calls["ops"]
    assert forward_op in [f"aten._scaled_dot_product_{k}_attention" for k in kernels], calls
    assert backward_op == f"{forward_op}_backward", calls
    for name, got, want in zip(("out", "dq", "dk", "dv"), *results):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        err = (got.float() - want.float()).abs().max().item()
        assert err <= tol * max(1.0, want.float().abs().max().item()), (name, err)


@pytest.mark.skipif(torch.version.hip is not None, reason="ROCm's memory-efficient kernel does not pad its log-sum-exp")
@pytest.mark.parametrize("queries", [48, 64])
def test_efficient_kernel_pads_its_lse_to_32_queries(queries):
    """The premise of config/load.RING_QUERY_ALIGN on this GPU: CUDA's memory-efficient attention
    returns the log-sum-exp of L queries padded to ceil(L / 32) * 32, which torch's ring merge
    meets with the unpadded output (tests/unit/test_ring_attention_config.py)."""
    from slipstream.config.load import RING_QUERY_ALIGN

    q, k, v = (torch.randn(1, 2, queries, 64, device="cuda") for _ in range(3))
    out, lse, *_ = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, None, True, is_causal=True)
    assert out.shape == q.shape
    assert lse.shape == (1, 2, math.ceil(queries / RING_QUERY_ALIGN) * RING_QUERY_ALIGN), lse.shape
