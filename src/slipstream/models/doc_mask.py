"""Document masks for packed sequences: attention that never crosses a document boundary.

A packed row holds several documents back to back. With a document mask each token attends
only to earlier tokens of its own document (causal AND same document), and its position is
its position inside that document, so every document is computed exactly as if it were alone
in its row (tests/unit/test_doc_mask.py checks this against running each document separately).

The model receives the (B, T) document ids of its tokens (`Transformer.forward(doc_ids=...)`)
or a `DocumentMask` built from them; it never looks at token values: which token separates
documents is data knowledge, applied by the caller (train/lm_loss.py: a new document starts
after each end-of-text token, `doc_ids_after`).

Kernels:
  flex   torch.nn.attention.flex_attention with a block mask (create_block_mask): blocks
         outside every document are skipped, so the cost falls with the documents' lengths.
         On CUDA it runs compiled (a fused kernel). On CPU torch (2.11 to 2.13) runs its
         forward only ("FlexAttention does not support backward on CPU"): usable for
         evaluation, not for training; eager by default there (eager materializes the scores:
         ~8x slower than dense SDPA at T = 512; compiled=True is on par with it after a
         ~6 s compile per shape, `slipstream bench packing`).
  dense  scaled_dot_product_attention with a boolean (B, 1, T, T) mask: exact on every
         device and dtype, with dropout, at the cost of a T x T mask per row and attention
         over the whole row (no skipped blocks).
  auto   flex on CUDA (without attention dropout, which flex lacks), dense elsewhere.

ALiBi (model.position = alibi, `with_alibi`): the bias slope x (j - i) of a query i and a key j
of the same document is the one it has in the document alone (only the distance counts), so the
mask adds it to the scores it keeps: a (B, heads, T, T) float mask (dense) or a score_mod (flex).
"""

from __future__ import annotations

import copy
import functools

import torch
import torch.nn.functional as F

from slipstream.errors import UserError

KERNELS = ("auto", "flex", "dense")


def doc_ids_after(tokens: torch.Tensor, separator: int) -> torch.Tensor:
    """(B, T) document ids of a packed row: a new document starts after each `separator` token
    (the separator closes its own document, as the end-of-text token does)."""
    is_sep = (tokens == separator).to(torch.int32)
    return (torch.cumsum(is_sep, dim=1) - is_sep).to(torch.int32)


def positions_in_document(doc_ids: torch.Tensor) -> torch.Tensor:
    """(B, T) int64 position of each token inside its document (0 at each document's first token)."""
    B, T = doc_ids.shape
    index = torch.arange(T, device=doc_ids.device).expand(B, T)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    # The start of the document each token is in: the latest start at or before it.
    first = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - first


def flex_runnable(device: torch.device, needs_grad: bool) -> str | None:
    """Why flex attention cannot run here (None: it can)."""
    try:
        import torch.nn.attention.flex_attention  # noqa: F401
    except ImportError:  # pragma: no cover - torch >= 2.11 ships it
        return "this torch has no torch.nn.attention.flex_attention"
    if device.type == "cpu" and needs_grad:
        return "torch's FlexAttention has no backward on CPU (forward only: evaluation)"
    if device.type not in ("cpu", "cuda"):
        return f"FlexAttention runs on CUDA and (forward only) CPU, not {device.type}"
    return None


@functools.cache
def _compiled_flex():
    from torch.nn.attention.flex_attention import flex_attention

    # Eager flex_attention materializes the whole score matrix; compiled, it is one fused kernel.
    return torch.compile(flex_attention, dynamic=False)


@functools.cache
def _compiled_create_block_mask():
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


class DocumentMask:
    """The causal, same-document attention of a batch of packed rows, built once per forward
    (outside the blocks: activation checkpointing's recomputation and compiled blocks reuse it).

    doc_ids: (B, T) integer ids, equal for the tokens of one document; documents are contiguous.
    kernel: "auto", "flex" or "dense" (see the module doc). `positions` is (B, T): each token's
    position inside its document."""

    def __init__(self, doc_ids: torch.Tensor, kernel: str = "auto", dropout: float = 0.0,
                 needs_grad: bool | None = None, compiled: bool | None = None) -> None:
        if kernel not in KERNELS:
            raise UserError(f"document mask kernel {kernel!r} is unknown; use one of {', '.join(KERNELS)}")
        if doc_ids.dim() != 2 or doc_ids.dtype.is_floating_point:
            raise ValueError(f"doc_ids must be an integer (B, T) tensor, got {doc_ids.dtype} {tuple(doc_ids.shape)}")
        device = doc_ids.device
        if needs_grad is None:
            needs_grad = torch.is_grad_enabled()
        if kernel == "auto":
            kernel = "flex" if device.type == "cuda" and dropout == 0 and flex_runnable(device, needs_grad) is None \
                else "dense"
        elif kernel == "flex":
            reason = flex_runnable(device, needs_grad)
            if reason is not None:
                raise UserError(f"document mask kernel 'flex' cannot run here: {reason}; use kernel 'dense' or 'auto'")
            if dropout > 0:
                raise UserError(f"document mask kernel 'flex' has no attention dropout (model.dropout = {dropout}); "
                                "use kernel 'dense' or 'auto', or model.dropout = 0")
        self.kernel, self.doc_ids = kernel, doc_ids
        self.alibi_slopes: torch.Tensor | None = None
        self._score_mod = None
        self.compiled = device.type == "cuda" if compiled is None else compiled
        self.positions = positions_in_document(doc_ids)
        B, T = doc_ids.shape
        if kernel == "dense":
            causal = torch.ones(T, T, dtype=torch.bool, device=device).tril()
            # (B, 1, T, T): one mask for every head (a tensor-parallel rank's heads included).
            self.dense = (causal & (doc_ids[:, :, None] == doc_ids[:, None, :]))[:, None]
            self.block_mask = None
        else:
            from torch.nn.attention.flex_attention import create_block_mask

            ids = doc_ids

            def document_causal(b, h, q_idx, kv_idx):
                return (q_idx >= kv_idx) & (ids[b, q_idx] == ids[b, kv_idx])

            self.dense = None
            # Compiled, the block mask is built without materializing the (B, T, T) boolean mask.
            build = _compiled_create_block_mask() if self.compiled else create_block_mask
            self.block_mask = build(document_causal, B, None, T, T, device=device)
            # Chosen here, outside the model: a compiled block then traces one plain call.
            if self.compiled:
                self._flex = _compiled_flex()
            else:
                from torch.nn.attention.flex_attention import flex_attention as eager

                self._flex = eager

    def with_alibi(self, slopes: torch.Tensor, dtype: torch.dtype | None = None) -> DocumentMask:
        """This mask with ALiBi's bias slope[h] x (j - i) added to the scores it keeps (slopes: one
        per head the attention computes). A copy: the caller's mask stays as it was. dtype: the
        attention's (dense: the float mask is built in it once, for every layer)."""
        out = copy.copy(self)
        out.alibi_slopes = slopes
        if self.dense is not None:
            from slipstream.models.transformer import alibi_bias

            T = self.doc_ids.shape[1]
            bias = alibi_bias(slopes, T, dtype or torch.float32)  # (1, H, T, T), causal -inf in it
            out.dense = torch.where(self.dense, bias, float("-inf"))  # (B, H, T, T)
        else:
            float_slopes = slopes.float()

            def alibi(score, b, h, q_idx, kv_idx):
                return score + float_slopes[h] * (kv_idx - q_idx)

            out._score_mod = alibi
        return out

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float = 0.0,
               enable_gqa: bool = False) -> torch.Tensor:
        """(B, H, T, D) queries, (B, H_kv, T, D) keys and values -> (B, H, T, D)."""
        if self.dense is not None:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=self.dense, dropout_p=dropout_p,
                                                  enable_gqa=enable_gqa)
        if dropout_p > 0:
            raise UserError("document mask kernel 'flex' has no attention dropout; use kernel 'dense' or 'auto'")
        return self._flex(q, k, v, score_mod=self._score_mod, block_mask=self.block_mask, enable_gqa=enable_gqa)
