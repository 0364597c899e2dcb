"""The language-model losses the trainer and the evaluator call: the mean next-token
cross-entropy of a batch (plain, or with the output head fused into the loss) and the
loss of each sequence (for evaluation). Padded vocabulary rows never take part: they are
storage for faster matmuls, not tokens (see Transformer.forward).

Masked targets: a target equal to IGNORE_INDEX (-100) is not a training target. Every loss
here skips it: the prepared data's loss mask (TokenLoader sets y = -100 where the mask is 0,
e.g. the prompt of a supervised fine-tuning record), and padding: a Python-API collate
function that pads sequences of unequal length marks the padded targets with -100.
Normalization: the loss of a batch is the mean over its unmasked targets (per micro-batch,
as F.cross_entropy's ignore_index does); with gradient accumulation the trainer averages
the micro-batches' means, so a micro-batch with few unmasked targets weighs each of them
more. A micro-batch without any unmasked target has loss 0 (and zero gradients), not NaN: it
still counts as one of the averaged micro-batches. The loss of a sequence is the mean over its
unmasked targets (0 when it has none).

Soft-capped logits (model.logit_softcap): the model caps its own logits; the fused loss applies
the head itself, so it caps each chunk of logits the same way (ops/fused_ce.py).

Document packing (data.packing = document): with `eot_id` the loss fns give the model the
document ids of their inputs, a new document after each end-of-text token, so attention
never crosses a document boundary and positions restart per document (models/doc_mask.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def _forward(model: torch.nn.Module, x: torch.Tensor, eot_id: int | None, kernel: str, **kwargs) -> torch.Tensor:
    if eot_id is None:
        return model(x, **kwargs)
    from slipstream.models.doc_mask import DocumentMask, doc_ids_after

    from slipstream.distributed.data_parallel import unwrap

    core = unwrap(model)
    dropout = core.cfg.dropout if core.training and hasattr(core, "cfg") else 0.0
    return model(x, doc_ids=DocumentMask(doc_ids_after(x, eot_id), kernel=kernel, dropout=dropout), **kwargs)


def lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor], eot_id: int | None = None,
               kernel: str = "auto") -> torch.Tensor:
    """Mean next-token cross-entropy over the unmasked targets of the batch; with `eot_id`, each
    document of a packed row attends only to itself (`kernel`: models/doc_mask.py)."""
    from slipstream.models.transformer import lm_loss

    x, y = batch
    return lm_loss(_forward(model, x, eot_id, kernel), y)


def _fused_head_loss(model: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor, chunk_size: int) -> torch.Tensor:
    from slipstream.distributed.data_parallel import unwrap
    from slipstream.models.transformer import no_target_loss_is_zero
    from slipstream.ops.fused_ce import fused_linear_cross_entropy

    # A custom op is outside autocast's reach: cast as autocast would cast a matmul's inputs.
    device_type = hidden.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    # DDP wraps the model (FSDP2 shards it in place): the head lives on the wrapped module.
    core = unwrap(model)
    head = core.head_weight()
    loss = fused_linear_cross_entropy(hidden.to(dtype), head.to(dtype), targets, chunk_size=chunk_size,
                                      ignore_index=IGNORE_INDEX, softcap=core.cfg.logit_softcap)
    return no_target_loss_is_zero(loss, targets, IGNORE_INDEX)  # all targets masked: 0, not NaN


def fused_lm_loss_fn(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor],
                     chunk_size: int = 4096, eot_id: int | None = None, kernel: str = "auto") -> torch.Tensor:
    """The same loss as lm_loss_fn, with the output head fused into the cross-entropy."""
    x, y = batch
    return _fused_head_loss(model, _forward(model, x, eot_id, kernel, return_hidden=True), y, chunk_size)


def lm_sequence_losses(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor,
                       fused_chunk: int | None = None, eot_id: int | None = None,
                       kernel: str = "auto") -> torch.Tensor:
    """Mean next-token cross-entropy of each sequence over its unmasked targets: (B,) fp32 (0 for
    a sequence with none; EvalWindows gives such a window weight 0). With `fused_chunk`, the head
    is applied one sequence at a time through the fused op, so the logits of a whole batch
    never exist (as in training with train.fused_loss)."""
    valid = (y != IGNORE_INDEX).sum(dim=1)
    if fused_chunk is None:
        logits = _forward(model, x, eot_id, kernel).float()
        losses = F.cross_entropy(logits.view(-1, logits.shape[-1]), y.reshape(-1), reduction="none",
                                 ignore_index=IGNORE_INDEX)
        summed = losses.view(y.shape).sum(dim=1)
        if hasattr(summed, "full_tensor"):  # loss parallel: a DTensor, which a plain count cannot divide
            summed = summed.full_tensor()
        return summed / valid.clamp(min=1)
    hidden = _forward(model, x, eot_id, kernel, return_hidden=True)
    losses = torch.stack([_fused_head_loss(model, h, t, fused_chunk).float() for h, t in zip(hidden, y)])
    return torch.where(valid > 0, losses, torch.zeros_like(losses))  # the op's 0 / 0 of an all-masked row
