"""The language-model losses the trainer and the evaluator call: the mean next-token
cross-entropy of a batch (plain, or with the output head fused into the loss) and the
loss of each sequence (for evaluation). Padded vocabulary rows never take part: they are
storage for faster matmuls, not tokens (see Transformer.forward)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    from slipstream.models.transformer import lm_loss

    x, y = batch
    return lm_loss(model(x), y)


def _fused_head_loss(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    from slipstream.distributed.data_parallel import unwrap
    from slipstream.ops.fused_ce import fused_linear_cross_entropy

    # A custom op is outside autocast's reach: cast as autocast would cast a matmul's inputs.
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    # DDP wraps the model (FSDP2 shards it in place): the head lives on the wrapped module.
    head = unwrap(model).head_weight()
    return fused_linear_cross_entropy(hidden.to(dtype), head.to(dtype), targets, chunk_size=chunk_size)


def fused_lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                     chunk_size: int = 4096) -> torch.Tensor:
    """The same loss as lm_loss_fn, with the output head fused into the cross-entropy."""
    x, y = batch
    return _fused_head_loss(model, model(x, return_hidden=True), y, chunk_size)


def lm_sequence_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                       fused_chunk: int | None = None) -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence: (B,) fp32. With `fused_chunk`, the head
    is applied one sequence at a time through the fused op, so the logits of a whole batch
    never exist (as in training with train.fused_loss)."""
    if fused_chunk is None:
        logits = model(x).float()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction="none")
        return losses.view(y.shape).mean(dim=1)
    hidden = model(x, return_hidden=True)
    return torch.stack([_fused_head_loss(model, h, t, fused_chunk).float() for h, t in zip(hidden, y)])
