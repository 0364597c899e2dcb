"""Chunked fused linear + cross-entropy: the LM-head loss without the (N, V) logits tensor.

A language model's last step is `logits = h @ W^T` (h: (N, d), W: (V, d)) and a mean
cross-entropy over those logits. With N = 16k tokens and V = 128k, the fp32 logits alone are
8 GiB, and autograd keeps a softmax-sized tensor of the same size for the backward. Here the
loss is computed chunk by chunk over the rows: each chunk's logits live only while that chunk
is processed, and the backward recomputes them from h and W instead of storing them. Only the
per-row logsumexp (N,) fp32 is saved, which is enough to rebuild softmax = exp(logits - lse).

Peak extra memory goes from O(N * V) to O(chunk_size * V) (+ an fp32 (V, d) grad_W accumulator
when W is bf16/fp16); the price is one extra matmul (the forward one) recomputed in backward.

Semantics match `F.cross_entropy(F.linear(h, W).float(), targets, ignore_index=...)`:
- mean over rows whose target != ignore_index; ignored rows get zero gradient;
- if every row is ignored the loss is nan (0 / 0) and the gradients are zero, like F.cross_entropy;
- the loss is always fp32; grad_h and grad_W come back in the dtypes of h and W;
- a vocabulary padded beyond the real one is just more columns: padded rows of W get
  gradients like any other (their softmax mass), exactly as the unfused computation does;
- targets outside [0, V) (other than ignore_index) are an error in the torch backend (gather
  raises); the Triton kernels do not check them (a check would cost a host sync), so there
  such a row silently counts a target logit of 0.

Soft-capping (`softcap` > 0, model.logit_softcap): each chunk's logits become
cap * tanh(logits / cap) before the softmax, and the backward multiplies the chunk's gradient by
the cap's derivative 1 - tanh^2, recomputed with the logits (one more chunk-sized buffer there).
The Triton kernels see the capped logits: the cap runs in torch around them (in the logits dtype).

Precision: the logits matmul runs in the input dtype (fp32 accumulation on tensor cores, as in
the unfused model); everything after it (logsumexp, softmax, the loss sum, grad_W's
accumulation over chunks) is fp32.

Backends (`backend=`):
- "torch": the chunk loop below in plain torch ops, on any device.
- "triton": same chunk loop and matmuls, but the softmax / logsumexp / cross-entropy part of
  each chunk runs as a Triton kernel (see triton_ce.py for exactly what is fused).
  Needs triton and CUDA tensors, or CPU tensors with TRITON_INTERPRET=1 set before triton is
  imported (the interpreter is slow: tests only).
- "auto": "triton" for CUDA tensors when triton is installed, else "torch".

Both the forward and the backward are torch.library custom ops, so torch.compile treats them
as opaque calls (no graph break, no unrolled chunk loop) and opcheck can verify them.
"""

import importlib.util
import os

import torch
import torch.nn.functional as F

from slipstream.errors import UserError

# Checked once at import: torch.compile can read a module constant without a graph break.
TRITON_INSTALLED = importlib.util.find_spec("triton") is not None
BACKENDS = ("auto", "torch", "triton")


def linear_cross_entropy_reference(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, softcap: float = 0.0
) -> torch.Tensor:
    """Ground truth: the full (N, V) logits in fp32 (soft-capped when softcap > 0), then
    F.cross_entropy (mean over non-ignored rows)."""
    h = h.reshape(-1, h.shape[-1])
    logits = F.linear(h.float(), weight.float())
    if softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, targets.reshape(-1), ignore_index=ignore_index)


# ---------------------------------------------------------------------------------------------
# The chunked implementation (runs inside the custom ops, on real tensors).


def _cap_(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """cap * tanh(logits / cap), in place (no autograd here: the backward is written out below)."""
    return logits.div_(softcap).tanh_().mul_(softcap)


def _cap_derivative_(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """Caps `logits` in place (as _cap_) and returns d(capped)/d(logits) = 1 - tanh^2 in one new
    buffer: built in place too, as `1 - t.square()` would hold two more chunks for a moment."""
    tanh = logits.div_(softcap).tanh_()
    cap_grad = tanh.square().neg_().add_(1)
    tanh.mul_(softcap)  # the same buffer as logits: now the capped logits
    return cap_grad


def _forward_impl(h, weight, targets, chunk_size, ignore_index, backend, softcap):
    n_rows = h.shape[0]
    lse = torch.empty(n_rows, dtype=torch.float32, device=h.device)
    loss_sum = torch.zeros((), dtype=torch.float32, device=h.device)
    for start in range(0, n_rows, chunk_size):
        end = min(start + chunk_size, n_rows)
        chunk_targets = targets[start:end]
        logits = F.linear(h[start:end], weight)  # (chunk, V), input dtype: the only big buffer
        if backend == "triton":
            from slipstream.ops import triton_ce

            if softcap > 0:
                _cap_(logits, softcap)
            chunk_lse, row_loss = triton_ce.ce_forward(logits, chunk_targets, ignore_index)
        else:
            logits = logits.float()  # no copy for fp32 inputs
            if softcap > 0:
                _cap_(logits, softcap)
            valid = chunk_targets != ignore_index
            # Ignored targets (e.g. -100) are not valid column indices: gather column 0, then mask.
            safe_targets = torch.where(valid, chunk_targets, 0)
            target_logit = logits.gather(1, safe_targets[:, None]).squeeze(1)
            # logsumexp done in place on the chunk (torch.logsumexp would allocate a second one).
            row_max = logits.amax(dim=1, keepdim=True)
            chunk_lse = row_max.squeeze(1) + logits.sub_(row_max).exp_().sum(dim=1).log()
            row_loss = torch.where(valid, chunk_lse - target_logit, 0.0)
        lse[start:end] = chunk_lse
        loss_sum += row_loss.sum()
        # Free this chunk's logits now: otherwise the next F.linear allocates while they are
        # still referenced, and the peak is two chunks instead of one.
        del logits
    # num_valid stays a tensor: .item() would force a host sync on GPU. All ignored -> 0/0 = nan.
    num_valid = (targets != ignore_index).sum()
    return loss_sum / num_valid, lse


def _backward_impl(grad_loss, h, weight, targets, lse, chunk_size, ignore_index, backend, softcap):
    # d(mean loss)/d(logits) = (softmax - onehot) / num_valid for valid rows, 0 for ignored rows;
    # soft-capped, times d(capped)/d(logits) = 1 - tanh(logits / cap)^2.
    num_valid = (targets != ignore_index).sum()
    scale = grad_loss.float() / num_valid.clamp(min=1)  # clamp: all ignored -> zero grads, not nan
    grad_h = torch.empty_like(h)
    # grad_W sums over every chunk, so accumulate in fp32 (for fp32 W this is grad_W itself).
    grad_w = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
    for start in range(0, h.shape[0], chunk_size):
        end = min(start + chunk_size, h.shape[0])
        h_chunk = h[start:end]
        chunk_targets = targets[start:end]
        # The logits are recomputed instead of saved, and overwritten in place where possible.
        cap_grad = None  # d(capped)/d(logits): one more chunk-sized buffer, with softcap only
        if backend == "triton":
            from slipstream.ops import triton_ce

            logits = F.linear(h_chunk, weight)
            if softcap > 0:
                cap_grad = _cap_derivative_(logits, softcap)  # logits are now the kernel's input
            dlogits = triton_ce.ce_backward_(logits, chunk_targets, lse[start:end], scale, ignore_index)
            del logits  # same buffer as dlogits
            if cap_grad is not None:
                dlogits.mul_(cap_grad)
        else:
            valid = chunk_targets != ignore_index
            safe_targets = torch.where(valid, chunk_targets, 0)
            logits = F.linear(h_chunk, weight).float()
            if softcap > 0:
                cap_grad = _cap_derivative_(logits, softcap)
            probs = logits.sub_(lse[start:end, None]).exp_()  # softmax
            del logits  # same buffer as probs
            probs.scatter_add_(1, safe_targets[:, None], torch.full_like(probs[:, :1], -1.0))  # - onehot
            probs.mul_(torch.where(valid, scale, 0.0)[:, None])
            if cap_grad is not None:
                probs.mul_(cap_grad)
            dlogits = probs.to(h.dtype)  # the gradient matmuls run in the input dtype (no copy for fp32)
            del probs
        del cap_grad
        grad_h[start:end] = dlogits @ weight
        if grad_w.dtype == dlogits.dtype:
            grad_w.addmm_(dlogits.t(), h_chunk)
        else:
            grad_w += (dlogits.t() @ h_chunk).float()
        del dlogits  # free before the next chunk's F.linear allocates (one chunk at a time)
    return grad_h, grad_w.to(weight.dtype)


# ---------------------------------------------------------------------------------------------
# Custom op registration: forward, its backward, fake (shape-only) versions, and autograd.


@torch.library.custom_op("slipstream::fused_linear_cross_entropy", mutates_args=())
def fused_linear_cross_entropy_op(
    h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int, ignore_index: int, backend: str,
    softcap: float = 0.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, d), (V, d), (N,) -> (mean loss () fp32, per-row logsumexp (N,) fp32). backend: "torch" | "triton";
    softcap: 0 = off."""
    return _forward_impl(h, weight, targets, chunk_size, ignore_index, backend, softcap)


@fused_linear_cross_entropy_op.register_fake
def _(h, weight, targets, chunk_size, ignore_index, backend, softcap=0.0):
    loss = h.new_empty((), dtype=torch.float32)
    lse = h.new_empty((h.shape[0],), dtype=torch.float32)
    return loss, lse


@torch.library.custom_op("slipstream::fused_linear_cross_entropy_backward", mutates_args=())
def fused_linear_cross_entropy_backward_op(
    grad_loss: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    chunk_size: int,
    ignore_index: int,
    backend: str,
    softcap: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (grad_h, grad_weight) of the mean loss, recomputing logits chunk by chunk."""
    return _backward_impl(grad_loss, h, weight, targets, lse, chunk_size, ignore_index, backend, softcap)


@fused_linear_cross_entropy_backward_op.register_fake
def _(grad_loss, h, weight, targets, lse, chunk_size, ignore_index, backend, softcap=0.0):
    return torch.empty_like(h), torch.empty_like(weight)


def _setup_context(ctx, inputs, output):
    h, weight, targets, chunk_size, ignore_index, backend, softcap = inputs
    _, lse = output
    # h and W are alive anyway (activation / parameter); lse is the only new saved tensor.
    ctx.save_for_backward(h, weight, targets, lse)
    ctx.chunk_size = chunk_size
    ctx.ignore_index = ignore_index
    ctx.backend = backend
    ctx.softcap = softcap
    # lse is returned for backward's use; no gradient flows through it.
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_loss, grad_lse):
    h, weight, targets, lse = ctx.saved_tensors
    grad_h, grad_w = fused_linear_cross_entropy_backward_op(
        grad_loss, h, weight, targets, lse, ctx.chunk_size, ctx.ignore_index, ctx.backend, ctx.softcap
    )
    return grad_h, grad_w, None, None, None, None, None


fused_linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup_context)


# ---------------------------------------------------------------------------------------------
# Public API.


def triton_unavailable_reason(device: torch.device) -> str | None:
    """Why the Triton backend cannot run for tensors on `device`, or None if it can."""
    if not TRITON_INSTALLED:
        return "triton is not installed (pip install triton)"
    if device.type == "cuda":
        return None
    if device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        f"the tensors are on {device.type}; Triton kernels need CUDA tensors, or CPU tensors with "
        "TRITON_INTERPRET=1 set in the environment before triton is imported (slow, for tests)"
    )


def _resolve_backend(backend: str, device: torch.device) -> str:
    if backend == "auto":
        # The interpreter is far too slow for real use, so "auto" never picks it on CPU.
        return "triton" if device.type == "cuda" and TRITON_INSTALLED else "torch"
    if backend == "triton":
        reason = triton_unavailable_reason(device)
        if reason is not None:
            raise UserError(f"fused_linear_cross_entropy: backend='triton' is not possible here: {reason}")
        return "triton"
    if backend == "torch":
        return "torch"
    raise UserError(f"fused_linear_cross_entropy: unknown backend {backend!r}; choose one of {BACKENDS}")


def fused_linear_cross_entropy(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = 4096,
    ignore_index: int = -100,
    backend: str = "auto",
    softcap: float = 0.0,
) -> torch.Tensor:
    """Mean cross-entropy of `h @ weight.T` (soft-capped: cap * tanh(logits / cap) when softcap > 0)
    against `targets`, without materializing all logits.

    h: (..., d) hidden states; weight: (V, d) LM-head weight; targets: (...) int64 class ids
    (same leading shape as h). Returns the fp32 scalar loss; differentiable wrt h and weight.
    Peak extra memory is about chunk_size * V logits in the input dtype (plus an fp32 copy
    in the torch backend for bf16/fp16), instead of N * V fp32.
    """
    if weight.dim() != 2 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"h (..., d) and weight (V, d) disagree: {tuple(h.shape)} vs {tuple(weight.shape)}")
    if h.dtype != weight.dtype:
        # A custom op is not autocast-aware: under autocast, pass weight.to(h.dtype) (differentiable).
        raise ValueError(f"h and weight must have the same dtype, got {h.dtype} and {weight.dtype}")
    if targets.dtype != torch.long or targets.shape != h.shape[:-1]:
        raise ValueError(
            f"targets must be int64 with shape {tuple(h.shape[:-1])}, got {targets.dtype} {tuple(targets.shape)}"
        )
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not softcap >= 0:
        raise ValueError(f"softcap must be >= 0 (0 = off), got {softcap}")
    resolved = _resolve_backend(backend, h.device)
    loss, _ = fused_linear_cross_entropy_op(
        h.reshape(-1, h.shape[-1]), weight, targets.reshape(-1), chunk_size, ignore_index, resolved, float(softcap)
    )
    return loss
