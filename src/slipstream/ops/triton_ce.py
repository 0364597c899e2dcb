"""Triton kernels for the softmax / logsumexp / cross-entropy part of the fused linear + CE op.

What is fused here, and what is not: the two matmuls (logits = h @ W^T per chunk, and the
gradient matmuls dlogits @ W and dlogits^T @ h) stay in torch, where cuBLAS is already optimal.
These kernels fuse everything that happens *between* the matmuls, on one chunk of logits:

- forward: one pass over the vocabulary (tiled), keeping an online max and rescaled sum of
  exponentials per row, plus the target logit -> per-row logsumexp and per-row loss.
  torch would need several full passes (max, sub, exp, sum, log, gather) and temporaries.
- backward: one pass that writes dlogits = (softmax - onehot) * grad_loss / num_valid, zero for
  ignored rows, *in place* over the chunk's logits buffer, so no second (chunk, V) buffer exists.

Logits may be fp32, bf16 or fp16; all arithmetic is in fp32 and dlogits are stored back in the
logits dtype (they feed the gradient matmuls in that dtype).

This module imports triton at import time; import it lazily (fused_ce does) and only where
triton is installed. To run on CPU tensors, TRITON_INTERPRET=1 must be set before this module
is first imported: the @triton.jit decorator decides at decoration time whether to compile or
interpret.
"""

import torch
import triton
import triton.language as tl

# Rows per program and vocabulary columns per tile. 16 x 512 fp32 = 32 KiB of registers per tile
# spread over 8 warps; a reasonable untuned default for both small and 128k vocabularies.
BLOCK_M = 16
BLOCK_V = 512
NUM_WARPS = 8


@triton.jit
def _ce_forward_kernel(
    logits_ptr,  # (n_rows, n_cols), row stride `stride_row`, column stride 1
    targets_ptr,  # (n_rows,) int64
    lse_ptr,  # (n_rows,) fp32 out
    loss_ptr,  # (n_rows,) fp32 out: lse - target logit, 0 for ignored rows
    n_rows,
    n_cols,
    stride_row,
    ignore_index,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    # int64 row offsets: chunk * vocab can exceed 2**31 elements (e.g. 32k rows x 128k vocab).
    row_ptrs = logits_ptr + rows.to(tl.int64) * stride_row
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=ignore_index)

    running_max = tl.full([BLOCK_M], float("-inf"), tl.float32)
    running_sum = tl.zeros([BLOCK_M], tl.float32)
    target_logit = tl.zeros([BLOCK_M], tl.float32)
    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        col_mask = cols < n_cols
        # Out-of-range rows read 0 (finite, results discarded); out-of-range columns must be
        # -inf so they add nothing to the max or the sum. Every tile has >= 1 real column.
        x = tl.load(row_ptrs[:, None] + cols[None, :], mask=row_mask[:, None] & col_mask[None, :], other=0.0)
        x = tl.where(col_mask[None, :], x.to(tl.float32), float("-inf"))
        # Online logsumexp: rescale the sum so far to the new max, then add this tile.
        new_max = tl.maximum(running_max, tl.max(x, axis=1))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max[:, None]), axis=1)
        running_max = new_max
        # The target column is in exactly one tile; ignored targets (e.g. -100) match no column.
        target_logit += tl.sum(tl.where(cols[None, :] == targets[:, None], x, 0.0), axis=1)

    lse = running_max + tl.log(running_sum)
    row_loss = tl.where(targets != ignore_index, lse - target_logit, 0.0)
    tl.store(lse_ptr + rows, lse, mask=row_mask)
    tl.store(loss_ptr + rows, row_loss, mask=row_mask)


@triton.jit
def _ce_backward_kernel(
    logits_ptr,  # (n_rows, n_cols) in: logits; out: dlogits (same buffer, same dtype)
    targets_ptr,  # (n_rows,) int64
    lse_ptr,  # (n_rows,) fp32, saved by the forward
    scale_ptr,  # () fp32: grad_loss / num_valid, read on device so the host never syncs
    n_rows,
    n_cols,
    stride_row,
    ignore_index,
    BLOCK_M: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < n_rows
    row_ptrs = logits_ptr + rows.to(tl.int64) * stride_row
    targets = tl.load(targets_ptr + rows, mask=row_mask, other=ignore_index)
    lse = tl.load(lse_ptr + rows, mask=row_mask, other=0.0)
    scale = tl.load(scale_ptr)
    # Ignored rows contribute nothing to the mean, so their gradient is exactly zero.
    row_scale = tl.where(targets != ignore_index, scale, 0.0)

    for start in range(0, n_cols, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        mask = row_mask[:, None] & (cols < n_cols)[None, :]
        ptrs = row_ptrs[:, None] + cols[None, :]
        x = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        probs = tl.exp(x - lse[:, None])
        probs = tl.where(cols[None, :] == targets[:, None], probs - 1.0, probs)
        # Each element is read and written by the same program in the same step: in-place is safe.
        tl.store(ptrs, (probs * row_scale[:, None]).to(logits_ptr.dtype.element_ty), mask=mask)


def _check_logits(logits: torch.Tensor, targets: torch.Tensor) -> None:
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"logits must be 2-D with contiguous columns, got shape {tuple(logits.shape)}")
    if targets.shape != (logits.shape[0],) or targets.dtype != torch.long:
        raise ValueError("targets must be int64 with one entry per logits row")


def ce_forward(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row logsumexp and per-row loss (0 for ignored rows), both (rows,) fp32."""
    _check_logits(logits, targets)
    n_rows, n_cols = logits.shape
    lse = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    row_loss = torch.empty(n_rows, dtype=torch.float32, device=logits.device)
    grid = (triton.cdiv(n_rows, BLOCK_M),)
    _ce_forward_kernel[grid](
        logits,
        targets.contiguous(),
        lse,
        row_loss,
        n_rows,
        n_cols,
        logits.stride(0),
        ignore_index,
        BLOCK_M=BLOCK_M,
        BLOCK_V=BLOCK_V,
        num_warps=NUM_WARPS,
    )
    return lse, row_loss


def ce_backward_(
    logits: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, scale: torch.Tensor, ignore_index: int
) -> torch.Tensor:
    """Overwrite `logits` with dlogits = (softmax - onehot) * scale (0 for ignored rows); returns it."""
    _check_logits(logits, targets)
    n_rows, n_cols = logits.shape
    grid = (triton.cdiv(n_rows, BLOCK_M),)
    _ce_backward_kernel[grid](
        logits,
        targets.contiguous(),
        lse.contiguous(),
        scale.to(torch.float32),
        n_rows,
        n_cols,
        logits.stride(0),
        ignore_index,
        BLOCK_M=BLOCK_M,
        BLOCK_V=BLOCK_V,
        num_warps=NUM_WARPS,
    )
    return logits
