"""The one source of truth for parameter counts and training FLOPs per token.

Metrics (MFU), docs and the planner all call these functions.

Training FLOPs per token = 6 * N_matmul + 12 * n_layer * d_model * seq_len, where
N_matmul is every parameter of the transformer blocks plus the output head (embedding
lookups and position tables are not matmuls; block biases and norm gains are included,
as in the usual "6N" convention, which overcounts by well under 0.1%) and 6 = 2
(multiply + add) x 3 (forward + backward for inputs and weights). The second term is the
attention score/value matmuls (QK^T and AV: 2 x 2 x T x d per layer forward, x3 for
backward), counted without discounting the causal mask, as PaLM and nanoGPT do.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.config.schema import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int          # unique trainable parameters (tied weights counted once)
    embedding: int      # token embedding (+ learned positions)
    matmul: int         # parameters that take part in matmuls (blocks + output head)


def param_count(cfg: ModelConfig) -> ParamCount:
    """Count parameters from the config alone (no model needed: works for 70B shapes)."""
    from slipstream.models.transformer import kv_heads, mlp_hidden, padded_vocab_size

    d, L = cfg.d_model, cfg.n_layer
    head_dim = d // cfg.n_head
    vocab = padded_vocab_size(cfg)
    b = 1 if cfg.bias else 0
    q_out, kv_out = cfg.n_head * head_dim, kv_heads(cfg) * head_dim
    attn = d * q_out + 2 * d * kv_out + q_out * d + b * (q_out + 2 * kv_out + d)
    hidden = mlp_hidden(cfg)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    mlp = n_up * (d * hidden + b * hidden) + hidden * d + b * d
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    block = attn + mlp + 2 * norm
    tok = vocab * d
    pos = cfg.max_seq_len * d if cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else vocab * d
    total = L * block + norm + tok + pos + head
    return ParamCount(total=total, embedding=tok + pos, matmul=L * block + vocab * d)


def flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`."""
    return 6.0 * param_count(cfg).matmul + 12.0 * cfg.n_layer * cfg.d_model * seq_len


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]; None when the device peak is unknown."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_tok / peak_flops
