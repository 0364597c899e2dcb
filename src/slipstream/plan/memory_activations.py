"""What a transformer block saves for backward, and the temporaries of its backward, in bytes per
GPU: the per-tensor accounting of one block, which the tests check against autograd. Apart from
the step's walk (plan/memory.py, which adds the per-forward terms and autocast's weight copies
below to the blocks') and the model states (plan/memory_states.py).

Activation bytes per block were derived from what autograd keeps for backward in
slipstream's transformer and checked against MemTracker (tests/unit/test_plan_memory.py,
test_plan_memory_arch.py):

  saved per block, n = tokens in the micro-batch, d = width, F = MLP width, T = sequence, h =
  heads, r = bytes of the residual stream (fp32 under autocast), a = bytes of matmul outputs
  (2 under bf16)
    residual stream      2 n d r        the block's input and the mid-block residual (a parallel
                                        block, x + attn(n1 x) + mlp(n2 x), has no mid-block residual)
    norm outputs         n d (4 | a x consumers)   one fp32 tensor shared by the matmuls, or
                                        under autocast one low-precision copy per matmul
    rmsnorm              + n d 4 per norm (the normalized input, composite kernel)
    norm statistics      n 4 (rms) or 2 n 4 (layer norm) per norm
    q, k, v              n (d + 2 d_kv) a (partial rotary and rope keep nothing more: the rotation
                                        multiplies by constant tables)
    attention output     n d a + n h 4 (flash / efficient: the softmax log-sum-exp, no T x T matrix);
                         materialized (Strategy.attention): n d a + n T h a, the softmax
                         probabilities (Korthikanti et al. 2022, sec. 4.1: 2 a s^2 b bytes per layer
                         in 16 bits), + n T h (1 + a) with dropout (its mask and output), and k, v
                         repeated to every head under GQA (3 n d a for q, k, v)
    MLP                  2 n F a (gelu: up output, gelu output; relu2: relu output, its square),
                         n F a (relu: its output, which relu's and the down matmul's backward share),
                         4 n F a (swiglu)
  per forward (micro-batch): the embedding norm (model.embedding_norm) keeps its input and
  statistics as a block's norm does; ALiBi's (heads, T, T) bias, built once per forward in the
  attention dtype, is kept by every layer's fused kernel for backward (one tensor, alive until
  the first block's backward); the final norm's input and output.
  activation checkpointing: full keeps only the block input; selective keeps the outputs of
  the matmuls and attention plus the block input (materialized attention: its core, QK^T,
  softmax and AV, is recomputed, as Megatron's selective recomputation does: no T x T kept).
  autocast keeps a low-precision copy of every weight its matmuls saved (2 bytes per matmul
  parameter), freed as backward goes past the layer; checkpointed blocks keep none.

Mixture of experts (plan/experts.py): an MoE block's MLP is not split by tp and sees the n
tokens of its micro-batch routed to top_k experts each (k n rows, spread evenly):
    router               2 n E 4        fp32 logits and scores
    routing              k n 32         the picks, the sort order and its token index (int64), the weights
    dispatched rows      k n d r        the token copies the experts take (sent to their ranks under ep)
    experts              4 k n h a (swiglu), 2 k n h a (gelu, relu2), k n h a (relu), h = moe_expert_hidden
    combine              2 k n d a      the experts' outputs, and placed back per token to be weighed
    shared experts       as an MLP of moe_shared_experts x h
  selective keeps the router's logits, the shared experts' matmul outputs and, unless the
  experts run as one grouped GEMM (model.moe_gemm = grouped: not a matmul the policy saves),
  the experts' (k n h a x 2 | 1, k n d a); it re-runs the dispatch. A backward also holds the
  dispatch buffers of the gradients (2 k n d r). Checked against autograd on moe-tiny
  (tests/unit/test_plan_memory.py).

Compression (Compression): quant.qat's fake-quantized linears keep, per rounded tensor, clamp's
input and the rounded copy the matmul saves, and per quantization group the scales and zero
points (_fake_quant_bytes; the weights every micro-batch, the inputs per token under
int8-dynact-int4-weight, in place of the plain linears' inputs); sparsity keeps one bool per
pruned value with the parameters and, in backward, the masked gradient of the tensor being
differentiated. Both checked against autograd and the real masks in
tests/unit/test_plan_compression_memory.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from slipstream.plan.experts import Experts, experts_of
from slipstream.plan.space import PlanModel, Strategy


@dataclass(frozen=True)
class _Dtypes:
    residual: int      # residual stream, norm inputs, embeddings
    compute: int       # matmul inputs/outputs, attention
    autocast: bool     # low-precision copies made per op (weights cached, norm outputs per consumer)
    gathered: int      # FSDP all-gathered parameters
    reduce: int        # gradient reduction


def strategy_dtypes(s: Strategy) -> _Dtypes:
    low = s.precision != "fp32"
    # Sharded strategies run low precision as FSDP mixed precision (parameters gathered in
    # bf16, gradients reduced in fp32): no autocast, so the residual stream is low precision too.
    fsdp_mp = low and s.dp_strategy in ("zero2", "fsdp", "hsdp") and s.fsdp_mixed
    if fsdp_mp:
        return _Dtypes(residual=2, compute=2, autocast=False, gathered=2, reduce=4)
    return _Dtypes(residual=4, compute=2 if low else 4, autocast=low, gathered=4, reduce=4)


def block_activation_bytes(model: PlanModel, tokens: int, s: Strategy, mode: str | None = None,
                           moe: bool = False, seq_len: int | None = None,
                           compression: Compression | None = None) -> int:
    """Bytes one transformer block saves for backward for `tokens` tokens on this GPU
    (moe: a block with experts, of a model that has them). seq_len: the keys each query attends
    to (materialized attention keeps tokens x seq_len scores per head); default the sequence
    the tokens come from, tokens x cp / micro_batch. compression: quant.qat's fake-quantized
    linears change what the block keeps (qat_activation_bytes)."""
    cfg, dt = model.cfg, strategy_dtypes(s)
    ex = experts_of(model) if moe else None
    mode = s.ac if mode is None else mode
    d, n, tp = cfg.d_model, tokens, s.tp
    # Sequence parallel splits the residual/norm tensors over tp ranks too; without it they are replicated.
    seq_split = tp if (tp > 1 and s.sequence_parallel) else 1
    r, a = dt.residual, dt.compute
    block_input = n * d * r // seq_split
    qat = compression is not None and compression.qat != "none" and ex is None
    # A checkpointed block keeps only its fake quantizers' scales and zero points (the last ones
    # stay on the modules); it recomputes the rounded tensors in its backward.
    qparams = (qat_activation_bytes(model, n, s, compression, checkpointed=True)
               + qat_weight_bytes(model, s, compression, kept=False)) if qat else 0
    if mode == "full":
        return block_input + qparams
    materialized = s.attention == "materialized"
    head_dim = d // cfg.n_head
    kv = (cfg.n_kv_head or cfg.n_head) * head_dim
    hidden = _mlp_hidden(model)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    # A materialized kernel repeats k and v to every query head (GQA) and keeps the repeated ones.
    qkv = n * (3 * d if materialized else d + 2 * kv) * a // tp
    attn_output = n * d * a // tp
    projections = n * d * a // seq_split                    # o_proj and down_proj outputs (selective keeps them)
    mlp_inner = n * hidden * a // tp
    if mode == "selective":
        # Selective keeps the fused kernel's log-sum-exp; a materialized core is recomputed whole.
        attention = attn_output + (0 if materialized else _logsumexp_bytes(cfg, n, s))
        if ex is not None:
            return block_input + qkv + attention + projections + _moe_saved(ex, cfg, n, s, "selective")
        return block_input + qkv + attention + projections * 2 + mlp_inner * n_up + qparams
    attention = attn_output + (attention_scores_bytes(model, n, s, seq_len, kept=True) if materialized
                               else _logsumexp_bytes(cfg, n, s))
    stats = n * 4 * (1 if cfg.norm == "rmsnorm" else 2) // seq_split
    rms_extra = n * d * 4 // seq_split if cfg.norm == "rmsnorm" else 0
    if dt.autocast:
        norm_outs = n * d * a * 3 // seq_split + n * d * a * n_up // seq_split
    else:
        norm_outs = 2 * n * d * r // seq_split
    # The parallel block's norms both read the block input: no mid-block residual to keep.
    residual_mid = 0 if cfg.parallel_block else n * d * r // seq_split
    mlp = mlp_inner * _MLP_SAVED[cfg.mlp] if ex is None else _moe_saved(ex, cfg, n, s, "none")
    if qat:
        # The linears keep their fake-quantized inputs and weights instead of their inputs: the norm
        # outputs (or autocast's copies of them), the MLP's last inner tensor and a materialized
        # attention's output were kept for the linears alone and go. Every micro-batch's forward
        # rounds the weights again: they are per micro-batch, as activations are.
        kept_inputs = norm_outs + mlp_inner * _DOWN_INPUT_ONLY[cfg.mlp] + (attn_output if materialized else 0)
        mlp += qat_activation_bytes(model, n, s, compression, kept_inputs) + qat_weight_bytes(model, s, compression)
    return block_input + residual_mid + norm_outs + 2 * (stats + rms_extra) + qkv + attention + mlp


# What an MLP saves for backward, in n x F tensors of the compute dtype: gelu its input and output
# (down_proj's input); relu2 the relu output and its square; relu only its output (relu's backward
# reads its result, the same tensor down_proj keeps); swiglu gate, silu, up and their product.
_MLP_SAVED = {"gelu": 2, "relu2": 2, "relu": 1, "swiglu": 4}
# Of those, the n x F tensors only down_proj keeps (its input): gelu's output, relu2's square,
# swiglu's product; relu's output is also relu's own saved result.
_DOWN_INPUT_ONLY = {"gelu": 1, "relu2": 1, "relu": 0, "swiglu": 1}


def _logsumexp_bytes(cfg, tokens: int, s: Strategy) -> int:
    """A fused attention kernel's saved softmax statistics: one fp32 log-sum-exp per query and head."""
    return tokens * cfg.n_head * 4 // s.tp


def _keys(tokens: int, s: Strategy, seq_len: int | None) -> int:
    return seq_len if seq_len is not None else tokens * s.cp // max(1, s.micro_batch)


def attention_scores_bytes(model: PlanModel, tokens: int, s: Strategy, seq_len: int | None,
                           kept: bool = False) -> int:
    """One layer's tokens x keys x heads attention matrix in the compute dtype (tp splits the heads).
    kept: what materialized attention keeps for backward: the softmax probabilities, and with
    dropout its mask (1 byte) and its output (Korthikanti et al. 2022, sec. 4.1)."""
    cfg, a = model.cfg, strategy_dtypes(s).compute
    cells = tokens * _keys(tokens, s, seq_len) * cfg.n_head // s.tp
    if kept and cfg.dropout > 0:
        return cells * (2 * a + 1)
    return cells * a


def forward_saved_bytes(model: PlanModel, tokens: int, s: Strategy, seq_len: int, first: bool) -> int:
    """What one micro-batch's forward keeps outside its blocks, on the rank holding the first
    stage (first) or any other: the embedding norm's input and statistics, and ALiBi's bias."""
    cfg, dt = model.cfg, strategy_dtypes(s)
    seq_split = s.tp if (s.tp > 1 and s.sequence_parallel) else 1
    saved = 0
    if first and cfg.embedding_norm:
        stats = tokens * 4 * (1 if cfg.norm == "rmsnorm" else 2)
        rms_extra = tokens * cfg.d_model * 4 if cfg.norm == "rmsnorm" else 0
        saved += (tokens * cfg.d_model * dt.residual + stats + rms_extra) // seq_split
    if cfg.position == "alibi" and s.attention != "materialized":
        # One (heads, T, T) bias per forward in the attention's dtype, shared by the layers and
        # saved by each fused kernel (a materialized softmax adds it to its scores and lets go).
        saved += cfg.n_head // s.tp * (seq_len // s.cp) * seq_len * dt.compute
    return saved


def _moe_saved(ex: Experts, cfg, n: int, s: Strategy, mode: str) -> int:
    """What an MoE layer saves for backward for the n tokens of its micro-batch (module doc)."""
    dt = strategy_dtypes(s)
    d, r, a = cfg.d_model, dt.residual, dt.compute
    n_up = 2 if cfg.mlp == "swiglu" else 1
    routed = n * ex.top_k
    shared_inner = n * ex.shared_hidden * a
    if mode == "selective":
        # the matmuls' outputs: router logits, the shared experts' and (matmul per expert) the experts'
        experts = 0 if cfg.moe_gemm == "grouped" else routed * ex.hidden * a * n_up + routed * d * a
        return n * ex.n * a + experts + (shared_inner * n_up + n * d * a if ex.shared_hidden else 0)
    router = 2 * n * ex.n * 4
    routing = routed * 32
    rows = routed * d * r
    inner = routed * ex.hidden * a * _MLP_SAVED[cfg.mlp]
    combine = 2 * routed * d * a
    return router + routing + rows + inner + combine + shared_inner * _MLP_SAVED[cfg.mlp]


def _mlp_hidden(model: PlanModel) -> int:
    from slipstream.models.transformer import mlp_hidden

    return mlp_hidden(model.cfg)


# ---------------------------------------------------------------- compression: QAT and sparsity masks

@dataclass(frozen=True)
class Compression:
    """The switches that change a step's memory by compressing the model: quant.qat
    (optimize/qat.py: torchao's fake-quantized linears in the blocks) and sparsity.method
    (optimize/sparsity.py: a bool mask per pruned tensor and a masked gradient)."""

    qat: str = "none"
    qat_group_size: int = 32
    sparsity: str = "none"

    @classmethod
    def of(cls, cfg) -> Compression:
        """A run's (a Config's) compression switches."""
        return cls(cfg.quant.qat, cfg.quant.qat_group_size, cfg.sparsity.method)


NO_COMPRESSION = Compression()


def _block_linears(model: PlanModel) -> list[tuple[str, int, int, str]]:
    """(name, in_features, out_features, what feeds it) of a dense block's nn.Linear modules
    (models/transformer.py: Attention, MLP): a norm's output, the attention's, or the MLP's."""
    cfg = model.cfg
    d, hidden = cfg.d_model, _mlp_hidden(model)
    kv = (cfg.n_kv_head or cfg.n_head) * (d // cfg.n_head)
    linears = [("q_proj", d, d, "norm"), ("k_proj", d, kv, "norm"), ("v_proj", d, kv, "norm"),
               ("o_proj", d, d, "attention"), ("up_proj", d, hidden, "norm")]
    if cfg.mlp == "swiglu":
        linears.append(("gate_proj", d, hidden, "norm"))
    return linears + [("down_proj", hidden, d, "mlp")]


def _fake_quant_bytes(values: int, groups: int, b: int, a: int, kept: bool = True) -> int:
    """What one fake-quantized tensor of `values` values in `groups` quantization groups keeps,
    computed in its input's dtype (b bytes) for a matmul in the compute dtype (a bytes). torchao
    0.18's _fake_quantize_affine (quantization/quant_primitives.py) rounds, adds the zero point,
    clamps and dequantizes: clamp keeps its input (values x b) for the gradient's mask, the
    matmul keeps the fake-quantized tensor (values x a: autocast's copy, or the tensor itself),
    the dequantizing multiply keeps the broadcast scale (groups x b); and the fake quantizer
    (IntxFakeQuantizer) holds its last scale (b) and int32 zero point on the module, per group,
    until the next forward. kept=False: only those two (a checkpointed block recomputes the rest).
    Measured with saved tensors in tests/unit/test_plan_compression_memory.py."""
    qparams = groups * (b + 4)
    return values * (b + a) + groups * b + qparams if kept else qparams


def _weight_groups(scheme: str, group_size: int, out_features: int, in_features: int) -> int:
    """Quantization groups of a linear's weight: int4 in groups of group_size inputs (PerGroup), or
    one per output channel (int8-weight: PerAxis(0))."""
    return out_features * in_features // group_size if scheme == "int8-dynact-int4-weight" else out_features


def qat_activation_bytes(model: PlanModel, tokens: int, s: Strategy, compression: Compression,
                         kept_inputs: int = 0, checkpointed: bool = False) -> int:
    """What quant.qat changes in one block's saved activations for `tokens` tokens: int8
    per-token dynamic activations (int8-dynact-int4-weight) fake-quantize every linear's input
    (one group per token, in that input's dtype: the residual stream's for the norm outputs,
    the compute dtype for the attention's and the MLP's), minus `kept_inputs`, the bytes the
    plain linears alone kept. A checkpointed block keeps the quantizers' scales and zero points
    only. int8-weight quantizes no activation."""
    if compression.qat != "int8-dynact-int4-weight":
        return 0
    dt = strategy_dtypes(s)
    dtype_of = {"norm": dt.residual, "attention": dt.compute, "mlp": dt.compute}
    total = sum(_fake_quant_bytes(tokens * fan_in, tokens, dtype_of[source], dt.compute, kept=not checkpointed)
                for _, fan_in, _, source in _block_linears(model))
    return total - kept_inputs


def qat_weight_bytes(model: PlanModel, s: Strategy, compression: Compression, kept: bool = True) -> int:
    """One block's fake-quantized weights, as kept for backward (kept) or during its recompute:
    every linear's weight rounded in the parameters' dtype (the gathered one under FSDP) per
    group (_weight_groups), beyond autocast's low-precision copy of the weight a plain linear
    keeps anyway (weight_copies)."""
    if compression.qat == "none":
        return 0
    dt = strategy_dtypes(s)
    total = 0
    for _, fan_in, fan_out, _ in _block_linears(model):
        values = fan_in * fan_out
        groups = _weight_groups(compression.qat, compression.qat_group_size, fan_out, fan_in)
        total += _fake_quant_bytes(values, groups, dt.gathered, dt.compute, kept)
        total -= values * dt.compute if dt.autocast and kept else 0
    return total


def sparsity_masked_values(model: PlanModel, method: str) -> tuple[int, int]:
    """(values per block, the largest tensor's values) that sparsity.method gives a `<name>_mask`
    (optimize/sparsity.py, _pruned_tensors): magnitude and 2:4 every linear's weight; heads
    q_proj's rows and o_proj's columns (k_proj's and v_proj's without GQA), with their biases;
    channels the MLP's up (gate) rows and down_proj's columns, with their biases."""
    if method == "none":
        return 0, 0
    cfg = model.cfg
    linears = {name: (fan_in, fan_out) for name, fan_in, fan_out, _ in _block_linears(model)}
    if method in ("magnitude", "2:4"):
        sizes = [i * o for i, o in linears.values()]
    elif method == "heads":
        heads = ["q_proj", "o_proj"] + (["k_proj", "v_proj"] if (cfg.n_kv_head or cfg.n_head) == cfg.n_head else [])
        sizes = [linears[n][0] * linears[n][1] for n in heads]
        sizes += [linears[n][1] for n in heads if n != "o_proj" and cfg.bias]
    else:  # channels
        names = ["up_proj", "down_proj"] + (["gate_proj"] if "gate_proj" in linears else [])
        sizes = [linears[n][0] * linears[n][1] for n in names]
        sizes += [linears[n][1] for n in names if n != "down_proj" and cfg.bias]
    return sum(sizes), max(sizes)


def block_backward_transient_bytes(model: PlanModel, tokens: int, s: Strategy, moe: bool = False,
                                   seq_len: int | None = None) -> int:
    """Gradients of activations alive while one block is differentiated, beyond what the block
    already saved: the MLP's inner gradient (gelu, relu: one n x F tensor; swiglu: two, the gate's
    and the up projection's) next to the residual stream's gradient and its copy. An MoE
    block's: its k n routed rows' inner gradients (whole: not split by tp), the shared
    experts', and the dispatch buffers of the rows' gradients (sent and received). Materialized
    attention's backward holds the gradients of its probabilities and of its scores (two T x T
    matrices per head), after the MLP's backward has freed the MLP's saved inner tensors: those
    instead, where they are larger."""
    cfg, dt = model.cfg, strategy_dtypes(s)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    ex = experts_of(model) if moe else None
    residual_grads = 2 * tokens * cfg.d_model * dt.residual
    attention = 2 * attention_scores_bytes(model, tokens, s, seq_len) if s.attention == "materialized" else 0
    if ex is not None:
        routed = tokens * ex.top_k
        inner = (routed * ex.hidden + tokens * ex.shared_hidden) * dt.compute * n_up
        return max(inner + 2 * routed * cfg.d_model * dt.residual, attention) + residual_grads
    inner = tokens * _mlp_hidden(model) * dt.compute // s.tp * n_up
    # Attention's backward runs after the MLP's, which has freed the MLP's saved inner tensors.
    mlp_freed = tokens * _mlp_hidden(model) * dt.compute // s.tp * _MLP_SAVED[cfg.mlp]
    return max(inner, attention - mlp_freed) + residual_grads
