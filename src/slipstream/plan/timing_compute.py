"""The compute of one training step, per operation class and pipeline rank: the device seconds
of a block's, the head's and the embedding's forward and backward (and what activation
checkpointing re-runs), and the host's time. Apart from the collectives (plan/timing_comm.py)
and the step's assembly (plan/timing.py), which adds the bubble, the exposed communication and
the optimizer step to it.

compute      per operation class, each at its own achievable rate (plan/efficiency.py, per GPU
             generation: sourced priors, fitted to published runs):
               gemm       q, k, v, o, the MLP, the output head, on a roofline: the slower of
                          their FLOPs (models.flops' shapes) at peak x gemm fraction and their
                          operand bytes at the memory bandwidth
               attention  a fused kernel (flash, efficient: Strategy.attention) runs the causal
                          half of QK^T and AV at peak x its fraction; its backward recomputes the
                          scores (2.5x the forward); materialized scores run as batched GEMMs and
                          their softmax (+ ALiBi bias, dropout) passes over B x heads x T x T.
                          ALiBi's float mask runs flash as the efficient kernel, over the whole
                          square, reading the bias (attention_kernel)
               pointwise  norms, activations, rope, residual adds, dropout, layout copies, the
                          loss: their bytes (read + write, forward; backward twice that) at the
                          memory bandwidth x pointwise fraction
             plus the host's time (plan/efficiency.py: per eager op, per op under selective AC,
             per checkpointed block): a GPU step takes the longer of it and the device's work
             (eager launches run ahead of the GPU), a CPU adds them.
             Activation checkpointing adds what it re-runs: full, each block's whole forward
             (not the head's or the embedding's); selective (slipstream's policy, optimize/
             activations.py: matmul and attention outputs saved) only the block's pointwise
             forward, and with materialized scores the attention core's forward (QK^T, the
             score passes, AV: no T x T matrix is kept, as plan/memory_activations.py plans
             it). A pipeline rank runs its own whole blocks (plan/stages.rank_parts, the
             trainer's split), the first also the embedding, the last the head and loss; the
             step follows the busiest rank. `efficiency` divides the device time: a calibration
             measured by `slipstream tune system` / --calibrate (1 = the fitted rates).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from slipstream.models.flops import param_count
from slipstream.plan import efficiency as rates_table
from slipstream.plan.efficiency import Fit, Rates
from slipstream.plan.experts import experts_of
from slipstream.plan.hardware import DEFAULT_MATMUL_EFFICIENCY, Cluster
from slipstream.plan.memory_activations import strategy_dtypes
from slipstream.plan.space import PlanModel, Strategy, Workload
from slipstream.plan.stages import RankPart
from slipstream.plan.timing_ranks import pipeline_ranks

# The backward of a pointwise op moves about twice its forward's bytes: it reads the saved
# input and the incoming gradient and writes the outgoing one.
POINTWISE_BACKWARD = 2.0
# A fused attention kernel's backward recomputes the scores QK^T from Q, K and the saved
# log-sum-exp, then runs dV, dP, dQ and dK: 5 matmuls against the forward's 2 (FlashAttention-2,
# Dao 2023, Algorithm 2). Its forward + backward is 3.5 forwards, models.flops counts 3.
FUSED_ATTENTION_BACKWARD = 2.5
# Causal fused kernels skip the score tiles above the diagonal: they run half of the square
# (models.flops counts the whole square, PaLM's convention). Materialized scores are all computed.
CAUSAL_WORK = 0.5
# Materialized scores (B x heads x T x T, the compute dtype): passes of the pointwise kernels over
# them. Forward: scale + mask + softmax in one kernel (Megatron's FusedScaleMaskSoftmax), read and
# write = 2; backward: the softmax gradient reads the probabilities and their gradient and writes
# one = 3. ALiBi adds its bias to the scores (read + write, forward only; the bias is constant).
SCORE_PASSES_FORWARD = 2.0
SCORE_PASSES_BACKWARD = 3.0
ALIBI_SCORE_PASSES = 2.0
# ALiBi through a fused kernel: the model passes its (heads, T, T) bias as SDPA's float attn_mask
# (models/transformer.Attention.forward), which torch's flash backend does not take: SDPA runs the
# memory-efficient kernel (planned as `efficient` whatever Strategy.attention says). The kernel
# reads the bias once per (sequence, head) tile in the forward and once more in the backward
# (which recomputes the scores), and, the causal mask being inside the bias (no is_causal), it
# computes every score tile: the whole square, not the causal half.
ALIBI_BIAS_READS_FORWARD = 1.0
ALIBI_BIAS_READS_BACKWARD = 1.0
# The loss, bytes per logit (forward + backward) in slipstream's cross-entropy (models/transformer.lm_loss):
# log-softmax reads and writes fp32 (8), the nll gradient is written (4), log-softmax's backward
# reads two and writes one (12); with low-precision logits also the fp32 copy (read 2, write 4)
# and the cast back of the gradient (read 4, write 2).
LOSS_BYTES_FP32 = 24
LOSS_BYTES_CASTS = 12
# Eager ops of a block's forward that are not matmuls or attention, as PyTorch issues them for
# slipstream's transformer (counted with torch.profiler, torch 2.13: top-level aten ops of one
# block): the views, transposes and the reshape copy around attention (8), each norm, residual
# add and dropout call (2 each), the activation (GELU / ReLU 1; SwiGLU, ReLU^2 2) and RoPE on q and
# k (16). Backward issues about 3.8 ops per forward op (counted: GPT 92 / 22, Llama 132 / 40).
LAYOUT_OPS = 8
ROPE_OPS = 16
# Partial rotary (rotary_fraction < 1, models/transformer.apply_rope): an empty_like, the slices
# and two copies (the rotated part and the pass-through part) per tensor, 7 more ops for each of
# q and k (counted with torch.profiler, torch 2.13: 15 top-level ops per tensor against 8).
PARTIAL_ROPE_OPS = 14
BACKWARD_OPS_PER_FORWARD_OP = 3.8


@dataclass
class _Work:
    """Device seconds per operation class and eager ops of one piece of work (one pass of a block,
    the head or the embedding, for one micro-batch)."""

    gemm: float = 0.0
    attention: float = 0.0
    pointwise: float = 0.0
    ops: float = 0.0
    host: float = 0.0    # other host seconds (selective AC's dispatch mode)

    @property
    def device(self) -> float:
        return self.gemm + self.attention + self.pointwise

    def host_s(self, r: Rates) -> float:
        return self.ops * r.launch_s + self.host


@dataclass
class Speeds:
    """The achievable rates of one plan: FLOP/s of GEMMs and of the attention kernel, bytes/s of
    memory-bound work, and the element sizes."""

    gemm: float
    attention: float
    bandwidth: float
    rates: Rates
    compute: int        # bytes of a matmul output / activation
    residual: int       # bytes of the residual stream


def _gemm_fraction(cluster: Cluster, dtype: str, r: Rates) -> float:
    """The GEMM fraction of peak: a measured one where the cluster has it (a CPU's measured peak,
    a `--probe` file), else the generation's (bf16) fraction scaled to `dtype` as hardware.py's
    per-dtype defaults relate (tf32 runs at 0.70 / 0.75 of bf16's fraction)."""
    measured = cluster.gpu.generation == "cpu" or any(line.startswith(f"{dtype} matmul ") and "probe" in line
                                                      for line in cluster.sources)
    if measured:
        return cluster.matmul_efficiency.get(dtype, 1.0)
    return r.gemm * DEFAULT_MATMUL_EFFICIENCY.get(dtype, 0.75) / DEFAULT_MATMUL_EFFICIENCY["bf16"]


def attention_kernel(model: PlanModel, s: Strategy) -> str:
    """The attention implementation a layout runs: Strategy.attention, except that a float
    attn_mask (ALiBi's bias) keeps SDPA off its flash backend, which takes no mask: flash runs
    as the memory-efficient kernel (ALIBI_BIAS_READS_FORWARD's comment)."""
    if s.attention == "flash" and model.traced is None and model.cfg.position == "alibi":
        return "efficient"
    return s.attention


def achievable_speeds(model: PlanModel, s: Strategy, cluster: Cluster, efficiency: float,
                      fit: Fit | None) -> Speeds:
    dtype = strategy_dtype_key(s)
    r = rates_table.rates(cluster.gpu.generation, fit)
    peak = cluster.peak_flops(dtype)
    dt = strategy_dtypes(s)
    return Speeds(gemm=peak * _gemm_fraction(cluster, dtype, r) * efficiency,
                  attention=peak * r.attention(attention_kernel(model, s)) * efficiency,
                  bandwidth=cluster.gpu.mem_bw_gbs * 1e9 * r.pointwise * efficiency,
                  rates=r, compute=dt.compute, residual=dt.residual)


def strategy_dtype_key(s: Strategy) -> str:
    return "bf16" if s.precision == "bf16" else ("fp16" if s.precision == "fp16" else "tf32")


def gemm_seconds(m: float, k: float, n: float, rate: float, mem_bw: float, elem_bytes: int) -> float:
    """One (m x k) @ (k x n) matmul on a roofline: the slower of its FLOPs at the achievable
    rate and its operand bytes at the memory bandwidth (small micro-batches are memory-bound)."""
    return max(2.0 * m * k * n / rate, elem_bytes * (m * k + k * n + m * n) / mem_bw)


@dataclass
class _BlockCost:
    """One block's work for one micro-batch: forward, backward, and what each AC mode re-runs."""

    forward: _Work
    backward: _Work
    selective: _Work     # the pointwise forward (slipstream's selective policy keeps matmul and attention
                         # outputs); with materialized scores also the attention core's forward
    full: _Work          # the whole forward


def _block_cost(model: PlanModel, s: Strategy, tokens: float, seq_len: int, sp: Speeds) -> _BlockCost:
    """The mean block (dense and MoE blocks in the model's proportion) on one GPU, for `tokens`
    tokens of one micro-batch (tensor parallel splits the heads and the MLP; sequence parallel
    also the norms and residual adds, which run on the whole sequence without it)."""
    from slipstream.models.transformer import mlp_hidden

    cfg, tp, a, r = model.cfg, s.tp, sp.compute, sp.residual
    d, head_dim = cfg.d_model, cfg.d_model // cfg.n_head
    kv = (cfg.n_kv_head or cfg.n_head) * head_dim
    seq = tp if (tp > 1 and s.sequence_parallel) else 1
    n_up = 2 if cfg.mlp == "swiglu" else 1

    def gemm(m, k, n):
        return gemm_seconds(m, k, n, sp.gemm, sp.bandwidth, a)

    # ---- GEMMs: q, o (d x d) and k, v (d x d_kv); the MLP (or the MoE layer)
    attn_gemm = gemm(tokens, d, d / tp) * 2 + gemm(tokens, d, kv / tp) * 2
    hidden = mlp_hidden(cfg)
    mlp_gemm = gemm(tokens, d, hidden / tp) * n_up + gemm(tokens, hidden / tp, d)
    act_elems = tokens * hidden / tp                  # the MLP's inner activations
    mlp_ops = n_up + 1.0
    ex = experts_of(model)
    if ex:
        # The router, the shared experts on every token and the E / ep local experts on the k n
        # rows they receive (spread evenly: k n ep / E each), whole on every tp rank.
        local = max(1, ex.n // s.ep)
        rows = max(1.0, tokens * ex.top_k / local)
        moe = local * (gemm(rows, d, ex.hidden) * n_up + gemm(rows, ex.hidden, d)) + gemm(tokens, d, ex.n)
        moe_act = tokens * ex.top_k * ex.hidden
        moe_ops = 1.0 + local * (n_up + 1)
        if ex.shared_hidden:
            moe += gemm(tokens, d, ex.shared_hidden) * n_up + gemm(tokens, ex.shared_hidden, d)
            moe_act += tokens * ex.shared_hidden
            moe_ops += n_up + 1
        share = ex.layers / cfg.n_layer
        mlp_gemm = (1 - share) * mlp_gemm + share * moe
        act_elems = (1 - share) * act_elems + share * moe_act
        mlp_ops = (1 - share) * mlp_ops + share * moe_ops
    gemms = attn_gemm + mlp_gemm

    # ---- attention: FLOPs of QK^T and AV, the whole square (models.flops' 4 T d per token)
    heads = cfg.n_head / tp
    attn_flops = 4.0 * tokens * seq_len * d / tp
    score_elems = tokens * heads * seq_len            # B x heads x T_local x T
    if s.attention == "materialized":
        # batched GEMMs per (sequence, head): (T_local x hd) @ (hd x T), then (T_local x T) @ (T x hd),
        # on the roofline (the scores are their output and input); backward twice the GEMMs.
        q_len = tokens / max(1, s.micro_batch)
        per_head = gemm(q_len, head_dim, seq_len) + gemm(q_len, seq_len, head_dim)
        attention_fwd = per_head * s.micro_batch * heads
        attention_bwd = 2 * attention_fwd
        passes_fwd = SCORE_PASSES_FORWARD + (ALIBI_SCORE_PASSES if cfg.position == "alibi" else 0.0)
        passes_bwd = SCORE_PASSES_BACKWARD
        if cfg.dropout > 0:   # attention-probability dropout: read, write and a 1-byte mask each way
            passes_fwd += 2 + 1 / a
            passes_bwd += 2 + 1 / a
        score_fwd_bytes, score_bwd_bytes = score_elems * a * passes_fwd, score_elems * a * passes_bwd
        attention_ops = 2.0 + 2 + (1 if cfg.position == "alibi" else 0) + (1 if cfg.dropout > 0 else 0)
        attention_gemm_ops = 2.0
    else:
        alibi = cfg.position == "alibi"     # a float mask: the efficient kernel, every tile (attention_kernel)
        attention_fwd = attn_flops * (1.0 if alibi else CAUSAL_WORK) / sp.attention
        attention_bwd = attention_fwd * FUSED_ATTENTION_BACKWARD
        score_fwd_bytes = score_elems * a * ALIBI_BIAS_READS_FORWARD if alibi else 0.0
        score_bwd_bytes = score_elems * a * ALIBI_BIAS_READS_BACKWARD if alibi else 0.0
        attention_ops, attention_gemm_ops = 0.0, 1.0

    # ---- pointwise: bytes each op reads and writes in the forward (module doc)
    norm_bytes = 2 * tokens * d * (r + a) / seq                      # two norms: read the stream, write the normed
    add_bytes = 2 * 3 * tokens * d * r / seq                         # two residual adds: read 2, write 1
    layout_bytes = 2 * tokens * d * a / tp                           # attention output (B, h, T, hd) -> (B, T, d)
    act_bytes = act_elems * a * (3 if cfg.mlp == "swiglu" else 2)    # SiLU(gate) x up: read 2, write 1
    pointwise = norm_bytes + add_bytes + layout_bytes + act_bytes
    ops = 2.0 * 2 + 2 + LAYOUT_OPS + (2 if cfg.mlp in ("swiglu", "relu2") else 1)  # norms, adds, dropout calls, layout, activation
    if cfg.position == "rope":
        fraction = getattr(cfg, "rotary_fraction", 1.0)
        pointwise += 2 * fraction * tokens * (d + kv) * a / tp
        ops += ROPE_OPS
        if fraction < 1:
            # apply_rope assembles a new q and k (empty_like): the rotated part copied in and the
            # pass-through part copied over, a read and a write of all of q and k
            pointwise += 2 * tokens * (d + kv) * a / tp
            ops += PARTIAL_ROPE_OPS
    if cfg.qk_norm:
        pointwise += 2 * tokens * (d + kv) * a / tp
        ops += 2
    if cfg.dropout > 0:                                              # after attention and after the MLP
        pointwise += 2 * tokens * d * (2 * a + 1) / seq
    pointwise_fwd = (pointwise + score_fwd_bytes) / sp.bandwidth
    pointwise_bwd = (pointwise * POINTWISE_BACKWARD + score_bwd_bytes) / sp.bandwidth
    pointwise_ops = ops + attention_ops
    gemm_ops = 4 + mlp_ops + attention_gemm_ops

    forward = _Work(gemms, attention_fwd, pointwise_fwd, gemm_ops + pointwise_ops)
    backward = _Work(2 * gemms, attention_bwd, pointwise_bwd,
                     (gemm_ops + pointwise_ops) * BACKWARD_OPS_PER_FORWARD_OP)
    # torch's selective checkpointing also runs its Python dispatch mode over every forward op
    # (in the forward and the recompute): host time, Rates.selective_dispatch_s per op. Either AC
    # mode pays the checkpoint frame once per block (Rates.checkpoint_s; fitted on a GPU host).
    # With materialized scores selective AC re-runs the attention core too (QK^T, softmax, AV: the
    # T x T scores are not kept, as Megatron's selective recompute and plan/memory_activations.py
    # plan it): its batched GEMMs besides the score passes already in pointwise_fwd.
    checkpoint = sp.rates.checkpoint_s
    core = s.attention == "materialized"
    selective = _Work(attention=attention_fwd if core else 0.0, pointwise=pointwise_fwd,
                      ops=pointwise_ops + (attention_gemm_ops if core else 0.0),
                      host=(gemm_ops + pointwise_ops) * sp.rates.selective_dispatch_s + checkpoint)
    return _BlockCost(forward, backward, selective, dataclasses.replace(forward, host=forward.host + checkpoint))


def _head_cost(model: PlanModel, s: Strategy, tokens: float, sp: Speeds) -> tuple[_Work, _Work]:
    """Forward and backward of the final norm, the output head and the loss (the last pp rank)."""
    from slipstream.models.transformer import padded_vocab_size

    cfg, a, r = model.cfg, sp.compute, sp.residual
    seq = s.tp if (s.tp > 1 and s.sequence_parallel) else 1
    vocab = padded_vocab_size(cfg) / s.tp
    head = gemm_seconds(tokens, cfg.d_model, vocab, sp.gemm, sp.bandwidth, a)
    norm = tokens * cfg.d_model * (r + a) / seq
    loss = tokens * vocab * (LOSS_BYTES_FP32 + (LOSS_BYTES_CASTS if a < 4 else 0))
    # the loss's bytes: a third forward, two thirds backward (as the byte counts above split)
    forward = _Work(head, 0.0, (norm + loss / 3) / sp.bandwidth, 4.0)
    backward = _Work(2 * head, 0.0, (norm * POINTWISE_BACKWARD + loss * 2 / 3) / sp.bandwidth,
                     4.0 * BACKWARD_OPS_PER_FORWARD_OP)
    return forward, backward


def _embedding_cost(model: PlanModel, s: Strategy, tokens: float, sp: Speeds) -> tuple[_Work, _Work]:
    """Forward and backward of the embedding lookup, learned positions and an embedding norm (the
    first pp rank): rows written, positions added; backward scatter-adds the rows' gradients."""
    cfg, a, r = model.cfg, sp.compute, sp.residual
    d = cfg.d_model
    nbytes, ops = tokens * d * r, 1.0
    if cfg.position == "learned":
        nbytes, ops = nbytes + 2 * tokens * d * r, ops + 2
    if getattr(cfg, "embedding_norm", False):
        nbytes, ops = nbytes + tokens * d * (r + a), ops + 1
    return (_Work(pointwise=nbytes / sp.bandwidth, ops=ops),
            _Work(pointwise=nbytes * POINTWISE_BACKWARD / sp.bandwidth, ops=ops * BACKWARD_OPS_PER_FORWARD_OP))


@dataclass
class _RankCompute:
    """One pp rank's compute for the whole step, in seconds per class (and forward / backward)."""

    part: RankPart
    classes: dict[str, float]   # gemm, attention, pointwise, launch; recompute is part of them
    recompute: float            # seconds of activation checkpointing's re-run
    forward: float
    backward: float             # incl. the recompute, which runs in backward

    @property
    def total(self) -> float:
        return self.forward + self.backward


def rank_compute(model: PlanModel, s: Strategy, work: Workload, sp: Speeds) -> list[_RankCompute]:
    """Every pp rank's compute of one step: grad_accum micro-batches through its blocks (and the
    embedding, head and loss where it holds them)."""
    tokens = s.micro_batch * work.seq_len / s.cp
    block = _block_cost(model, s, tokens, work.seq_len, sp)
    recompute = {"full": block.full, "selective": block.selective}.get(s.ac, _Work())
    head_f, head_b = _head_cost(model, s, tokens, sp)
    emb_f, emb_b = _embedding_cost(model, s, tokens, sp)

    r = sp.rates
    out = []
    for part in pipeline_ranks(model, s, work.seq_len):
        n = s.grad_accum
        forward = [(block.forward, part.blocks * n), (emb_f, part.embedding * n), (head_f, part.head * n)]
        backward = [(block.backward, part.blocks * n), (recompute, part.blocks * n), (emb_b, part.embedding * n),
                    (head_b, part.head * n)]
        classes = {k: sum(getattr(w, k) * c for w, c in forward + backward) for k in ("gemm", "attention", "pointwise")}
        device_f, device_b = (sum(w.device * c for w, c in pieces) for pieces in (forward, backward))
        host_f, host_b = (sum(w.host_s(r) * c for w, c in pieces) for pieces in (forward, backward))
        host = host_f + host_b
        # The host's launches (and selective AC's dispatch) show where they are longer than the
        # device's work over the step (GPUs run ahead of the host), or entirely (a CPU does both).
        shown = max(0.0, host - device_f - device_b) / host if (r.launch_overlaps and host > 0) else 1.0
        classes["launch"] = host * shown
        re = (recompute.device + recompute.host_s(r) * shown) * part.blocks * n
        out.append(_RankCompute(part, classes, re, device_f + host_f * shown, device_b + host_b * shown))
    return out


def hardware_flops_per_token(model: PlanModel, s: Strategy, seq_len: int) -> tuple[float, float]:
    """Training FLOPs per token beyond models.flops' count: (activation checkpointing's recomputed
    forward, a fused attention kernel's recomputed scores). Full AC re-runs every block's forward:
    2 x its (active) matmul parameters + the attention's 4 T d; selective re-runs no weight matmul,
    but with materialized scores it re-runs the attention core, QK^T and AV: 4 T d per layer (the
    whole square, which batched GEMMs compute and models.flops counts). A fused kernel's backward
    runs 2.5 attention forwards where the count has 2 (ALiBi's flash runs as the efficient
    kernel, attention_kernel: the same count)."""
    from slipstream.models.transformer import padded_vocab_size

    cfg = model.cfg
    attention_fwd = 4.0 * seq_len * cfg.d_model * cfg.n_layer
    recompute = 0.0
    if s.ac == "full":
        block_matmul = param_count(cfg).active_matmul - padded_vocab_size(cfg) * cfg.d_model
        recompute = 2.0 * block_matmul + attention_fwd
    elif s.ac == "selective" and s.attention == "materialized":
        recompute = attention_fwd
    kernel = 0.0 if attention_kernel(model, s) == "materialized" else (FUSED_ATTENTION_BACKWARD - 2.0) * attention_fwd
    return recompute, kernel
