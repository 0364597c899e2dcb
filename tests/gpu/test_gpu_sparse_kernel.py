"""The 2:4 semi-structured sparse matmul (`slipstream generate --sparse-kernel`) on a real GPU
(skipped without CUDA sm80+): a 2:4-pruned model's blocks really hold torch.sparse's
SparseSemiStructuredTensor, and their logits equal the same masked weights' dense bf16 matmuls
within bf16 rounding."""

import pytest
import torch

from slipstream.config.schema import SparsityConfig

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 0),
                                reason="needs a CUDA device of capability 8.0+ (run `slipstream bench gpu`)")


def test_sparse_kernel_holds_semi_structured_weights_and_matches_dense():
    from slipstream.config import load_config
    from slipstream.models.transformer import build_model
    from slipstream.optimize import sparsity as sp

    # Widths the sparse tensor cores accept (multiples of 64 rows and 128 columns for bf16).
    cfg = load_config(None, ["--model.preset=tiny", "--model.d_model=256", "--model.n_head=4",
                             "--model.vocab_size=512", "--train.seq_len=64"])
    model = build_model(cfg.model, seed=0).cuda()
    rule = SparsityConfig(method="2:4", target=0.5)
    sp.apply_sparsity(model, rule)
    sp.compute_masks(model, rule, 0.5)
    sp.fold_masks(model)
    x = torch.randint(0, 512, (4, 64), device="cuda")
    with torch.no_grad():
        dense = model.to(torch.bfloat16)(x).float()
        sp.use_sparse_kernel(model)
        fast = model(x).float()
    from torch.sparse import SparseSemiStructuredTensor

    assert isinstance(model.blocks[0].mlp.up_proj.weight, SparseSemiStructuredTensor)
    assert not torch.equal(fast, torch.zeros_like(fast))
    torch.testing.assert_close(fast, dense, rtol=2e-2, atol=2e-2)
