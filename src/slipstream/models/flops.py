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

The architecture switches change the counts only through their parameters: ALiBi has no
position table (its bias is an elementwise add on the scores, like the causal mask: not a
matmul), partial rotary changes no matmul, a ReLU MLP has the matmuls of a GELU one, the parallel
block runs the same matmuls as the sequential one, and the embedding norm is a norm (its gains
count in `total`, not in the matmuls, like the final norm's).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slipstream.config.schema import ModelConfig


@dataclass(frozen=True)
class ParamCount:
    total: int          # unique trainable parameters (tied weights counted once)
    embedding: int      # token embedding (+ learned positions)
    matmul: int         # parameters that take part in matmuls (blocks + output head)
    attn: int = 0       # per block: attention projections (+ biases)
    mlp: int = 0        # per block: the MLP (an MoE block's: every routed expert + router + shared experts)
    norm: int = 0       # per block: the two norms (+ the query/key norms; a parallel block has two as well)
    head: int = 0       # untied output head (0 when tied to the embedding)
    active_matmul: int = 0  # matmul parameters one token passes through (MoE: its top_k experts); = matmul when dense
    experts: int = 0    # the routed experts' parameters of the whole model (what expert parallelism splits)
    moe_layers: int = 0  # blocks with experts
    dense_mlp: int = 0  # per dense block: the MLP
    embedding_norm: int = 0  # the norm after the embedding (model.embedding_norm); not in `embedding`, not a matmul
    final_norm: int = 0      # the norm before the output head


def param_count(cfg: ModelConfig, experts: tuple[int, int] | None = None) -> ParamCount:
    """Count parameters from the config alone (no model needed: works for 70B shapes).

    Mixture of experts (cfg.moe_*): an MoE block's MLP is its routed experts (bias-free MLPs of
    moe_expert_hidden), a router (d x n_experts) and the shared experts; a token passes through
    top_k routed experts, the router and the shared ones. experts = (n_experts, top_k) overrides
    the config's (planning what-ifs).
    """
    from slipstream.models.moe import expert_hidden, moe_layer_count
    from slipstream.models.transformer import kv_heads, mlp_hidden, padded_vocab_size

    if experts:
        cfg = dataclasses.replace(cfg, moe_experts=experts[0], moe_top_k=experts[1])
    d, L = cfg.d_model, cfg.n_layer
    head_dim = d // cfg.n_head
    vocab = padded_vocab_size(cfg)
    b = 1 if cfg.bias else 0
    q_out, kv_out = cfg.n_head * head_dim, kv_heads(cfg) * head_dim
    attn = d * q_out + 2 * d * kv_out + q_out * d + b * (q_out + 2 * kv_out + d)
    n_up = 2 if cfg.mlp == "swiglu" else 1

    def mlp_params(hidden: int, bias: int) -> int:
        return n_up * (d * hidden + bias * hidden) + hidden * d + bias * d

    dense_mlp = mlp_params(mlp_hidden(cfg), b)
    n_moe = moe_layer_count(cfg)
    moe_mlp = active_moe_mlp = routed = 0
    if n_moe:
        expert = mlp_params(expert_hidden(cfg), 0)
        router = d * cfg.moe_experts
        shared = mlp_params(cfg.moe_shared_experts * expert_hidden(cfg), b) if cfg.moe_shared_experts else 0
        moe_mlp = cfg.moe_experts * expert + router + shared
        active_moe_mlp = cfg.moe_top_k * expert + router + shared
        routed = n_moe * cfg.moe_experts * expert
    norm = d * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    qk_norm = 2 * head_dim if cfg.qk_norm else 0
    per_block = attn + 2 * norm + qk_norm
    blocks = L * per_block + (L - n_moe) * dense_mlp + n_moe * moe_mlp
    active_blocks = L * per_block + (L - n_moe) * dense_mlp + n_moe * active_moe_mlp
    tok = vocab * d
    pos = cfg.max_seq_len * d if cfg.position == "learned" else 0
    head = 0 if cfg.tie_embeddings else vocab * d
    emb_norm = norm if cfg.embedding_norm else 0
    total = blocks + norm + emb_norm + tok + pos + head
    return ParamCount(total=total, embedding=tok + pos, matmul=blocks + vocab * d, attn=attn,
                      mlp=moe_mlp if n_moe else dense_mlp, norm=2 * norm + qk_norm, head=head,
                      active_matmul=active_blocks + vocab * d, experts=routed, moe_layers=n_moe, dense_mlp=dense_mlp,
                      embedding_norm=emb_norm, final_norm=norm)


def flops_per_token(cfg: ModelConfig, seq_len: int, experts: tuple[int, int] | None = None) -> float:
    """Training (forward + backward) FLOPs per token at sequence length `seq_len`
    (MoE: only the top_k experts a token passes through count)."""
    return 6.0 * param_count(cfg, experts).active_matmul + 12.0 * cfg.n_layer * cfg.d_model * seq_len
