"""The one source of truth for parameter counts and training FLOPs per token.

Metrics (MFU, observe/flops.py), docs and the planner all call these functions: they are facts
of the model shape, computed from its config alone.

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
    attn: int = 0       # per block: attention projections (+ biases)
    mlp: int = 0        # per block: the MLP (all experts of an MoE layer, + router)
    norm: int = 0       # per block: the two norms
    head: int = 0       # untied output head (0 when tied to the embedding)
    active_matmul: int = 0  # matmul parameters one token passes through (MoE: top_k experts); = matmul when dense


def param_count(cfg: ModelConfig, experts: tuple[int, int] | None = None) -> ParamCount:
    """Count parameters from the config alone (no model needed: works for 70B shapes).

    experts = (n_experts, top_k) for a mixture-of-experts MLP in every block (planning only):
    every expert is a full MLP, a token passes through top_k of them, and a router (d x n_experts)
    picks them.
    """
    from slipstream.models.transformer import kv_heads, mlp_hidden, padded_vocab_size

    d, L = cfg.d_model, cfg.n_layer
    head_dim = d // cfg.n_head
    vocab = padded_vocab_size(cfg)
    b = 1 if cfg.bias else 0
    q_out, kv_out = cfg.n_head * head_dim, kv_heads(cfg) * head_dim
    attn = d * q_out + 2 * d * kv_out + q_out * d + b * (q_out + 2 * kv_out + d)
    hidden = mlp_hidden(cfg)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    expert = n_up * (d * hidden + b * hidden) + hidden * d + b * d
    n_experts, top_k = experts or (1, 1)
    router = d * n_experts if experts else 0
    mlp = n_experts * expert + router
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    block = attn + mlp + 2 * norm
    active_block = attn + top_k * expert + router + 2 * norm
    tok = vocab * d
    pos = cfg.max_seq_len * d if cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else vocab * d
    total = L * block + norm + tok + pos + head
    return ParamCount(total=total, embedding=tok + pos, matmul=L * block + vocab * d, attn=attn, mlp=mlp,
                      norm=2 * norm, head=head, active_matmul=L * active_block + vocab * d)


def flops_per_token(cfg: ModelConfig, seq_len: int, experts: tuple[int, int] | None = None) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`
    (MoE: only the top_k experts a token passes through count)."""
    return 6.0 * param_count(cfg, experts).active_matmul + 12.0 * cfg.n_layer * cfg.d_model * seq_len
