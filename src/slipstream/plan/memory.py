"""Peak memory per GPU of one training step, predicted from shapes alone (docs/planner.md).

The step is walked phase by phase, as it runs:

    forward   parameters + optimizer state (+ gradients when they persist) + the activations
              saved so far + the loss's logits
    backward  layer by layer from the top: saved activations are freed as gradients appear,
              plus the backward temporaries of the layer being differentiated
    optimizer parameters + gradients + optimizer state

and the peak is the highest point of that walk. Every byte is counted from the same
shapes the model code uses (param counts come from models.flops, the one source of
truth), by category: parameters, gradients, optimizer_state, activations, temporaries.

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

Pipeline ranks (plan/stages.rank_parts, the trainer's split in whole blocks): every rank is
planned with its own blocks, the first stage's rank with the embedding, the last's with the head
and the loss, the micro-batches it keeps in flight under its schedule (in_flight_microbatches,
per rank), and torch's pipelining buffers: each stage that receives keeps one input buffer per
micro-batch, each stage that sends back gradients one gradient buffer per micro-batch, for the
whole step (torch.distributed.pipelining.stage: _setup_forward_recv_info, _create_grad_recv_info);
a stage's output is held until its backward (fwd_cache). The plan is the busiest rank's
(MemoryEstimate.peak_rank).

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
  (tests/unit/test_plan_memory.py). Its parameters: the
  router and the shared experts whole on every tp rank, E / ep routed experts, sharded over the
  dp / ep ranks holding the same experts (Strategy.expert_shard_group).

Soft-capped logits (model.logit_softcap) keep their tanh for backward: tokens x vocabulary in the
compute dtype, alive until the loss's gradient has passed it; the fused loss instead holds one more
chunk of fp32 logits in its backward (the cap's derivative).

fp16 runs as bf16 does (autocast, or FSDP mixed precision with a sharded grad scaler): the same
bytes; a grad scaler keeps a scale and an inf flag per device, nothing per parameter.

Model states as the training stack keeps them (StackStates, state_buffers; MemoryEstimate.buffers
names each): slipstream's trainer (torch) keeps fp32 parameters and gradients under autocast, and
FSDP2's MixedPrecisionPolicy gathers bf16 units from sharded fp32 ones and reduce-scatters in its
reduce dtype. Megatron-LM and DeepSpeed put the model itself in 16 bits: 16-bit weights and
gradients (fp32 with fp32 gradient accumulation, Megatron's default under bf16), the fp32 master
copy and moments sharded over dp under zero1 / zero2 (Megatron's distributed optimizer, DeepSpeed
ZeRO-1), the gradients sharded too under DeepSpeed ZeRO-2, with its reduce buckets in backward.
Checked against emulations of both on the fake process group (plan/accuracy.py, stack_cases).

Compression (Compression): quant.qat's fake-quantized linears keep, per rounded tensor, clamp's
input and the rounded copy the matmul saves, and per quantization group the scales and zero
points (_fake_quant_bytes; the weights every micro-batch, the inputs per token under
int8-dynact-int4-weight, in place of the plain linears' inputs); sparsity keeps one bool per
pruned value with the parameters and, in backward, the masked gradient of the tensor being
differentiated. Both checked against autograd and the real masks in
tests/unit/test_plan_compression_memory.py; low-bit optimizer states: low_bit_optimizer_bytes.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from slipstream.errors import UserError
from slipstream.models.flops import param_count
from slipstream.plan.experts import Experts, experts_of
from slipstream.plan.hardware import STACKS
from slipstream.plan.space import PlanModel, Strategy
from slipstream.plan.stages import RankPart, rank_parts, stage_costs

GIB = 2**30
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "temporaries")
# CUDA's caching allocator rounds blocks and keeps freed blocks for reuse: the reserved
# bytes run above the allocated ones. A margin on the device total, not on CPU (MemTracker
# and the CPU allocator count tensor bytes only).
CUDA_FRAGMENTATION = 0.08


@dataclass
class MemoryEstimate:
    """Predicted peak bytes per GPU, with the breakdown at the peak."""

    peak_bytes: int
    peak_phase: str
    breakdown: dict[str, int]
    fragmentation_bytes: int = 0
    host_bytes: int = 0          # offloaded state in host memory, per GPU
    notes: list[str] = field(default_factory=list)
    peak_rank: int | None = None   # a pipeline's busiest pp rank (the one planned here); None without one
    # The model-state buffers by name (state_buffers: "weights (bf16)", "master weights (fp32)", ...,
    # and DeepSpeed's "reduce buckets (16-bit)"), bytes per GPU; they make up parameters, gradients,
    # optimizer_state (and the buckets part of backward's temporaries).
    buffers: dict[str, int] = field(default_factory=dict)

    @property
    def total_bytes(self) -> int:
        return self.peak_bytes + self.fragmentation_bytes

    def to_record(self) -> dict:
        return {"peak_bytes": self.peak_bytes, "total_bytes": self.total_bytes, "peak_phase": self.peak_phase,
                "fragmentation_bytes": self.fragmentation_bytes, "host_bytes": self.host_bytes,
                "breakdown": dict(self.breakdown), "notes": list(self.notes), "peak_rank": self.peak_rank,
                "buffers": dict(self.buffers)}


@dataclass(frozen=True)
class _Dtypes:
    residual: int      # residual stream, norm inputs, embeddings
    compute: int       # matmul inputs/outputs, attention
    autocast: bool     # low-precision copies made per op (weights cached, norm outputs per consumer)
    gathered: int      # FSDP all-gathered parameters
    reduce: int        # gradient reduction


def _dtypes(s: Strategy) -> _Dtypes:
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
    cfg, dt = model.cfg, _dtypes(s)
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
    attention = attn_output + (_scores_bytes(model, n, s, seq_len, kept=True) if materialized
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


def _scores_bytes(model: PlanModel, tokens: int, s: Strategy, seq_len: int | None, kept: bool = False) -> int:
    """One layer's tokens x keys x heads attention matrix in the compute dtype (tp splits the heads).
    kept: what materialized attention keeps for backward: the softmax probabilities, and with
    dropout its mask (1 byte) and its output (Korthikanti et al. 2022, sec. 4.1)."""
    cfg, a = model.cfg, _dtypes(s).compute
    cells = tokens * _keys(tokens, s, seq_len) * cfg.n_head // s.tp
    if kept and cfg.dropout > 0:
        return cells * (2 * a + 1)
    return cells * a


def _forward_saved_bytes(model: PlanModel, tokens: int, s: Strategy, seq_len: int, first: bool) -> int:
    """What one micro-batch's forward keeps outside its blocks, on the rank holding the first
    stage (first) or any other: the embedding norm's input and statistics, and ALiBi's bias."""
    cfg, dt = model.cfg, _dtypes(s)
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
    dt = _dtypes(s)
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


def _qat_note(scheme: str) -> str:
    return ("int8 per-token fake-quantized inputs and int4 grouped fake-quantized weights of every block linear"
            if scheme == "int8-dynact-int4-weight" else "int8 per-channel fake-quantized weights of every block linear")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


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
    dt = _dtypes(s)
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
    dt = _dtypes(s)
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


# ---------------------------------------------------------------- model states as each stack keeps them

# DeepSpeed ZeRO-1/2's reduce bucket ("ipg buffer"): reduce_bucket_size elements in the 16-bit dtype,
# allocated by backward() (a second one with overlap_comm: "Use double buffers to avoid data access
# conflict when overlap_comm is enabled"); default reduce_bucket_size 5e8 elements
# (deepspeed/runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.backward; constants.py:
# ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT = 500000000).
DEEPSPEED_REDUCE_BUCKET_ELEMENTS = 500_000_000


@dataclass(frozen=True)
class StackStates:
    """How the training stack keeps a mixed-precision step's model states (`plan --stack`).

    torch      slipstream's trainer: fp32 parameters and gradients (autocast; DDP / ZeroRedundancyOptimizer),
               FSDP2 with MixedPrecisionPolicy (param_dtype bf16, reduce_dtype: `reduce_dtype`) for
               zero2 / fsdp / hsdp: sharded fp32 parameters and gradients, gathered bf16 units.
    megatron   Megatron-LM: the model in bf16 / fp16 (Float16Module), a contiguous gradient buffer
               (fp32 main grads with fp32_grad_accum), and for zero1 / zero2 its distributed
               optimizer: fp32 master weights and moments sharded over dp, gradients whole.
    deepspeed  DeepSpeed ZeRO-1 / 2: 16-bit weights, 16-bit gradients (ZeRO-2: sharded), fp32
               master weights and moments sharded, the reduce buckets in backward.

    fp32_grad_accum: gradients accumulated in fp32 (Megatron accumulate_allreduce_grads_in_fp32,
    DeepSpeed data_types.grad_accum_dtype fp32); None: the stack's default (Megatron: on for bf16,
    where its arguments.py turns it on; off for fp16. DeepSpeed: off).
    bucket_mb: DeepSpeed's reduce_bucket_size in MiB (None: 5e8 elements); overlap_comm: a second one.
    """

    stack: str = "torch"
    fp32_grad_accum: bool | None = None
    reduce_dtype: str = "fp32"
    bucket_mb: float | None = None
    overlap_comm: bool = False

    def __post_init__(self) -> None:
        if self.stack not in STACKS:
            raise UserError(f"unknown training stack {self.stack!r}; use one of {', '.join(STACKS)} (--stack).")
        if self.reduce_dtype not in ("fp32", "bf16", "fp16"):
            raise UserError(f"FSDP reduce dtype {self.reduce_dtype!r}: use fp32, bf16 or fp16 (parallel.reduce_dtype).")

    def keeps_16bit_model(self, s: Strategy) -> bool:
        """Whether this stack runs `s` with the model itself in 16 bits (not FSDP2, not autocast)."""
        return self.stack != "torch" and s.precision != "fp32" and s.dp_strategy in ("none", "ddp", "zero1", "zero2")

    @classmethod
    def of_cluster(cls, cluster) -> StackStates:
        """The states of `cluster`'s stack (hardware.Cluster: stack, --bucket-mb, and DeepSpeed's
        overlap_comm, whose second bucket follows --overlap-grad-reduce)."""
        return cls(cluster.stack, bucket_mb=cluster.bucket_mb,
                   overlap_comm=cluster.stack == "deepspeed" and cluster.overlaps_grad_reduce)

    def zero_optimizer(self, s: Strategy) -> bool:
        """Whether this stack runs `s` through its own ZeRO (Megatron's distributed optimizer, DeepSpeed
        ZeRO-1/2), whatever the precision: the weights stay whole, nothing is gathered per unit (not FSDP)."""
        return self.stack != "torch" and s.dp_strategy in ("zero1", "zero2")

    def grads_in_fp32(self, s: Strategy) -> bool:
        if self.fp32_grad_accum is not None:
            return self.fp32_grad_accum
        return self.stack == "megatron" and s.precision == "bf16"


TORCH_STATES = StackStates()


def state_buffers(params: float, s: Strategy, states: StackStates = TORCH_STATES, optimizer_state_bytes: int = 4,
                  shard_group: int | None = None) -> dict[str, tuple[str, float]]:
    """The model-state buffers per GPU of `params` parameters, by name: (category, bytes).

    torch (and FSDP strategies on any stack, and fp32 ddp): fp32 weights and gradients and the two
    moments, each divided by the shard group where the strategy shards it. fp32 zero1 / zero2 on
    Megatron / DeepSpeed runs their own ZeRO (StackStates.zero_optimizer): weights whole, moments
    sharded (Megatron 8 + 8 / d; DeepSpeed 8 + 12 / d, ZeRO-2 4 + 16 / d). A stack that keeps the
    model in 16 bits (StackStates.keeps_16bit_model) keeps, per parameter (d: the shard group):
        16-bit weights 2; gradients 2 (4 with fp32 accumulation), / d under DeepSpeed ZeRO-2;
        fp32 master weights 4 and moments 2 x optimizer_state_bytes, / d under zero1 / zero2;
        Megatron fp16 with 16-bit gradients: the optimizer's own fp32 main gradients 4 (/ d).
    The ZeRO paper's 2 + 2 + 12 / d (ZeRO-1) and 2 + (2 + 12) / d (ZeRO-2) bytes (Rajbhandari et al.
    2020, Figure 1: "P_os: 2 Psi + 2 Psi + K Psi / N_d", "P_os+g: 2 Psi + (2 + K) Psi / N_d", caption:
    "K=12 based on mixed-precision training with Adam optimizer"), and Megatron-LM's (README, "Distributed
    Optimizer": "fp16 param, fp16 grads | 20 | 4 + 16/d; bf16 param, fp32 grads | 18 | 6 + 12/d";
    "when using bf16 model params, however, the distributed optimizer's fp32 main grads are the same
    as the model's fp32 grads, and so the grads in this case are not distributed")."""
    shard_opt, shard_grad, shard_param = s.shards()
    group = s.state_shard_group if shard_group is None else shard_group
    moments = params * 2 * optimizer_state_bytes / (group if shard_opt else 1)
    if states.zero_optimizer(s) and not states.keeps_16bit_model(s):
        # fp32 on Megatron / DeepSpeed ZeRO: weights whole, moments sharded. Megatron README ("fp32 param,
        # fp32 grads | 16 | 8 + 8/d"): no master copy, gradients whole (its zero2 is its zero1). DeepSpeed
        # (runtime/zero/stage_1_and_2.py, DeepSpeedZeroOptimizer.__init__: "A partition of the fp32 master
        # weights ... single_partition_of_fp32_groups ... .clone().float().detach()") clones its shard even
        # in fp32, and ZeRO-2 partitions the gradients: 4 + 4 + 12 / d (ZeRO-1), 4 + 16 / d (ZeRO-2).
        deepspeed = states.stack == "deepspeed"
        buffers = {"weights (fp32)": ("parameters", params * 4),
                   "gradients (fp32)": ("gradients", params * 4 / (group if deepspeed and s.dp_strategy == "zero2"
                                                                   else 1))}
        if deepspeed:
            buffers["master weights (fp32)"] = ("optimizer_state", params * 4 / group)
        buffers["Adam moments"] = ("optimizer_state", moments)
        return buffers
    if not states.keeps_16bit_model(s):
        return {"weights (fp32)": ("parameters", params * 4 / (group if shard_param else 1)),
                "gradients (fp32)": ("gradients", params * 4 / (group if shard_grad else 1)),
                "Adam moments": ("optimizer_state", moments)}
    low = s.precision
    fp32_grads = states.grads_in_fp32(s)
    # DeepSpeed's ZeRO-2 partitions the gradients; Megatron has no ZeRO-2 (its distributed
    # optimizer keeps the whole gradient buffer), so its zero2 is its zero1.
    grad_group = group if (states.stack == "deepspeed" and s.dp_strategy == "zero2") else 1
    master_group = group if shard_opt else 1
    buffers = {f"weights ({low})": ("parameters", params * 2),
               ("gradients (fp32)" if fp32_grads else f"gradients ({low})"):
                   ("gradients", params * (4 if fp32_grads else 2) / grad_group),
               "master weights (fp32)": ("optimizer_state", params * 4 / master_group)}
    if states.stack == "megatron" and not fp32_grads:
        buffers["master gradients (fp32)"] = ("optimizer_state", params * 4 / master_group)
    buffers["Adam moments"] = ("optimizer_state", moments)
    return buffers


def stack_reduce_bucket_bytes(s: Strategy, states: StackStates) -> float:
    """DeepSpeed's reduce buckets alive in backward (16-bit; DEEPSPEED_REDUCE_BUCKET_ELEMENTS);
    Megatron's buckets are views into its gradient buffer, torch's are planned with the gradients."""
    if not (states.zero_optimizer(s) and states.stack == "deepspeed"):
        return 0.0
    elem = 2 if states.keeps_16bit_model(s) else 4   # fp32 runs reduce fp32 gradients
    one = states.bucket_mb * 2**20 if states.bucket_mb is not None else DEEPSPEED_REDUCE_BUCKET_ELEMENTS * elem
    return one * (2 if states.overlap_comm else 1)


# ---------------------------------------------------------------- pipeline ranks

_PARTS: dict[tuple, list[RankPart]] = {}


def pipeline_parts(model: PlanModel, s: Strategy, seq_len: int) -> list[RankPart]:
    """What each pp rank holds, in whole blocks, as the trainer splits them (plan/stages.rank_parts:
    balanced by training FLOPs, or s.pp_layers); one part holding everything without a pipeline.
    Cached: the split is a dynamic program over the layers, and a search asks for it per layout."""
    cfg = model.cfg
    if s.pp <= 1:
        return [RankPart(0, cfg.n_layer, (0,), (cfg.n_layer,), True, True)]
    key = (cfg.n_layer, stage_costs(cfg, seq_len), s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers)
    if key not in _PARTS:
        _PARTS[key] = rank_parts(cfg, seq_len, s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers or None)
    return _PARTS[key]


def _moe_blocks(model: PlanModel, parts: list[RankPart], part: RankPart) -> int:
    """Blocks with experts among the part's (models.moe.is_moe_layer, counted in closed form)."""
    cfg = model.cfg
    if not model.moe:
        return 0
    sizes = {stage: n for p in parts for stage, n in zip(p.stages, p.layers)}
    starts = [0]
    for stage in range(len(sizes)):
        starts.append(starts[-1] + sizes[stage])
    count = 0
    for stage in part.stages:
        lo, hi = max(starts[stage], cfg.moe_first_dense), starts[stage + 1]
        first = lo + (-(lo - cfg.moe_first_dense)) % cfg.moe_every   # the first MoE index >= lo
        count += (hi - 1 - first) // cfg.moe_every + 1 if first < hi else 0
    return count


def in_flight_microbatches(s: Strategy, rank: int = 0) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at once, counted in micro-batches
    of all its blocks (a rank of v stages holding c stage-micro-batches holds c / v), as torch's
    schedules order the work (torch.distributed.pipelining.schedules)."""
    if s.pp == 1:
        return 1.0
    m, p, v = s.grad_accum, s.pp, s.pp_virtual
    if s.pp_schedule in ("gpipe", "looped-bfs"):
        return float(m)   # every micro-batch's forward before the first backward
    if s.pp_schedule == "dualpipev":
        return float(min(p + 1, m))   # DeepSeek-V3 report, table 2: PP + 1 (1F1B: PP), every rank
    if s.pp_schedule == "zbv":
        return float(min(p, m))       # Qi et al. 2024: ZB-V's peak is 1F1B's, on every rank
    if s.pp_schedule == "1f1b":
        return float(min(m, p - rank))   # Schedule1F1B: rank r warms up with p - r forwards
    # Interleaved: _get_warmup_ops (rank r: (v - 1) micro-batches per round + 2 per hop to the last
    # rank; zero bubble 1 per hop), then one forward before each backward. Zero bubble defers the
    # weight gradients of its first r backwards (num_1f1b_microbatches = rank): their inputs stay.
    rounds = max(1, m // p)
    per_round = m // rounds
    hops = 2 if s.pp_schedule == "interleaved-1f1b" else 1
    warmup = min((v - 1) * per_round + hops * (p - 1 - rank), m * v)
    chunks = warmup + 1 if warmup < m * v else warmup
    if s.pp_schedule == "interleaved-zero-bubble":
        chunks = min(m * v, chunks + rank)
    return chunks / v


def _head_in_flight(s: Strategy) -> int:
    """Micro-batches whose logits and loss the last stage holds at once: one (its forward is
    followed by its backward), except where every forward runs first."""
    return s.grad_accum if s.pp > 1 and s.pp_schedule in ("gpipe", "looped-bfs") else 1


# ---------------------------------------------------------------- the step

def estimate_memory(model: PlanModel, s: Strategy, seq_len: int, device: str = "cuda",
                    optimizer_state_bytes: int = 4, optimizer: str = "adamw",
                    state_dtype: str = "", compression: Compression = NO_COMPRESSION,
                    stack: StackStates | str = TORCH_STATES) -> MemoryEstimate:
    """Predicted peak memory per GPU of one training step of `model` laid out as `s`.

    seq_len: tokens per sequence; s.micro_batch sequences go through each forward.
    optimizer_state_bytes: bytes per Adam moment (4 fp32, 2 bf16).
    state_dtype: int8 / int4 (optim.state_dtype): torchao's block-quantized moments, counted tensor
    by tensor (low_bit_optimizer_bytes; optimizer_state_bytes is then unused).
    optimizer: adamw, or muon (optim.optimizer): one fp32 momentum buffer per hidden-matrix
    parameter instead of two moments (a traced user module is planned with AdamW's state).
    device: "cuda" adds the allocator's fragmentation margin; "cpu" does not.
    compression: quant.qat and sparsity.method (Compression.of(config)): fake-quantized linears
    planned on, as after quant.qat_start_step (before it the linears run plain and keep less);
    sparsity's masks and masked gradients.
    stack: the training stack that keeps the model states (StackStates, or its name: torch,
    megatron, deepspeed; Cluster.stack): Megatron's and DeepSpeed's mixed precision keep 16-bit
    weights and gradients and a sharded fp32 master copy (state_buffers).
    A pipeline is planned rank by rank (pipeline_parts, rank_memory); the estimate is the
    busiest rank's, with its index in peak_rank.
    """
    states = StackStates(stack) if isinstance(stack, str) else stack
    if model.traced is not None:
        return _traced_memory(model, s, seq_len, device, optimizer_state_bytes, state_dtype, states)
    parts = pipeline_parts(model, s, seq_len)
    if s.pp == 1:
        return _rank_memory(model, s, seq_len, parts[0], _moe_blocks(model, parts, parts[0]), device,
                            optimizer_state_bytes, optimizer, state_dtype, compression, states)
    # A rank that holds the same kind of pieces as another, no more blocks and no more
    # micro-batches in flight cannot be the peak: only the others are planned (a model with
    # experts plans every rank: its blocks differ in kind).
    by_kind: dict[tuple, list[tuple[float, int, RankPart]]] = {}
    for part in parts:
        kind = (len(part.stages), part.embedding, part.head, part.rank if model.moe else 0)
        by_kind.setdefault(kind, []).append((in_flight_microbatches(s, part.rank), part.blocks, part))
    candidates = []
    for ranks in by_kind.values():
        most_blocks = -1
        for in_flight, blocks, part in sorted(ranks, key=lambda c: (-c[0], -c[1], c[2].rank)):
            if blocks > most_blocks:   # more blocks than every rank with as many in flight or more
                candidates.append((part, _moe_blocks(model, parts, part), in_flight))
                most_blocks = blocks
    planned = [(part, _rank_memory(model, s, seq_len, part, n_moe, device, optimizer_state_bytes, optimizer,
                                   state_dtype, compression, states))
               for part, n_moe, _ in sorted(candidates, key=lambda c: c[0].rank)]
    part, chosen = max(planned, key=lambda pe: (pe[1].total_bytes, -pe[0].rank))   # the first of equal peaks
    pieces = " + ".join(["embedding"] * part.embedding + [f"{part.blocks} blocks"] + ["head and loss"] * part.head)
    chosen.notes.append(f"pipeline: rank {part.rank} of {s.pp} is the busiest ({pieces}, "
                        f"{in_flight_microbatches(s, part.rank):g} micro-batches in flight)")
    chosen.peak_rank = part.rank
    return chosen


def rank_memory(model: PlanModel, s: Strategy, seq_len: int, rank: int, device: str = "cuda",
                optimizer_state_bytes: int = 4, optimizer: str = "adamw", state_dtype: str = "",
                compression: Compression = NO_COMPRESSION, stack: StackStates | str = TORCH_STATES) -> MemoryEstimate:
    """The step's peak on pipeline rank `rank` alone (estimate_memory plans the busiest)."""
    parts = pipeline_parts(model, s, seq_len)
    part = parts[rank]
    estimate = _rank_memory(model, s, seq_len, part, _moe_blocks(model, parts, part), device,
                            optimizer_state_bytes, optimizer, state_dtype, compression,
                            StackStates(stack) if isinstance(stack, str) else stack)
    estimate.peak_rank = rank if s.pp > 1 else None
    return estimate


def _rank_memory(model: PlanModel, s: Strategy, seq_len: int, part: RankPart, n_moe: int, device: str,
                 optimizer_state_bytes: int, optimizer: str, state_dtype: str = "",
                 compression: Compression = NO_COMPRESSION, states: StackStates = TORCH_STATES) -> MemoryEstimate:
    """The step's peak on one pipeline rank (without a pipeline: the one GPU's whole model)."""
    # Megatron and DeepSpeed cast the model itself to 16 bits (Float16Module; the engine's half() /
    # bfloat16()): no autocast copies, a 16-bit residual stream, the activations of FSDP mixed
    # precision's compute. `sa` plans the activations with those dtypes; `s` the states and buffers.
    sixteen = states.keeps_16bit_model(s)
    zero_stack = states.zero_optimizer(s)   # the stack's own ZeRO (any precision): not FSDP
    sa = dataclasses.replace(s, dp_strategy="fsdp", fsdp_mixed=True) if sixteen else s
    cfg, dt = model.cfg, _dtypes(sa)
    pc = param_count(cfg)
    ex = experts_of(model)
    shard_grad = s.shards()[1]
    group = s.state_shard_group
    layers, first, last = part.blocks, part.embedding, part.head
    piped = s.pp > 1
    notes: list[str] = []

    # ---- parameters per GPU: this rank's blocks (split by tp, experts by ep) + embedding / head
    block_params = (pc.attn + pc.mlp) / s.tp + pc.norm
    vocab_params = pc.embedding - (cfg.max_seq_len * cfg.d_model if cfg.position == "learned" else 0)
    pos_params = pc.embedding - vocab_params
    head_matmul = vocab_params / s.tp   # the output head's weight (a tied one is the table)
    # A pipeline's head holds its own copy of a tied table (distributed/pipeline_parallel.py).
    head_params = (pc.head or (vocab_params if piped else 0)) / s.tp
    first_stage = vocab_params / s.tp + pos_params + pc.embedding_norm
    last_stage = head_params + pc.final_norm
    edge = first_stage * first + last_stage * last
    stage_blocks, experts = layers * block_params, 0.0
    if ex:
        # Dense blocks split by tp; an MoE block's attention by tp, its router and shared experts
        # whole, its routed experts E / ep. The largest block sizes the FSDP buffers.
        dense_block = (pc.attn + ex.dense_mlp) / s.tp + pc.norm
        expert_block = ex.routed_params / s.ep
        moe_block = pc.attn / s.tp + pc.norm + ex.other_params + expert_block
        stage_blocks = (layers - n_moe) * dense_block + n_moe * moe_block
        experts = n_moe * expert_block
        block_params = moe_block if n_moe == layers else (max(dense_block, moe_block) if n_moe else dense_block)
        notes.append(f"mixture of experts: {n_moe} of this rank's {layers} blocks hold {ex.n // s.ep} of "
                     f"{ex.n} experts each; tokens are planned as spread evenly over the experts")
    local_params = stage_blocks + edge

    def sharded(count: float, is_sharded: bool) -> float:
        return count / group if is_sharded else count

    buffers = state_buffers(local_params, s, states, optimizer_state_bytes)
    if experts and s.ep > 1:
        # The routed experts shard over the dp / ep ranks that hold the same ones (FSDP), or not
        # at all (DDP, ep = dp): per GPU, E / ep experts / (dp / ep) = E / dp under FSDP.
        buffers = state_buffers(local_params - experts, s, states, optimizer_state_bytes)
        expert = state_buffers(experts, s, states, optimizer_state_bytes, shard_group=s.expert_shard_group)
        buffers = {name: (category, nbytes + expert[name][1]) for name, (category, nbytes) in buffers.items()}
    moments = "Adam moments"
    if optimizer == "muon":  # one moment instead of two for the matrices Muon steps
        muon = state_buffers(muon_matrix_params(model, layers, n_moe, s), s, states, optimizer_state_bytes)
        buffers[moments] = ("optimizer_state", buffers[moments][1] - muon[moments][1] / 2)
    if state_dtype in LOW_BIT_FORMATS:
        # config.dims refuses low-bit state with sharding and tp: this rank's whole tensors, one by one.
        buffers[moments] = ("optimizer_state", low_bit_optimizer_bytes(model, part, state_dtype, piped))
        notes.append(f"optimizer state {state_dtype}: torchao's block-quantized moments; tensors under "
                     f"{LOW_BIT_MIN_NUMEL} values (norms, biases) keep fp32 moments")
    param_bytes, grad_bytes, optim_bytes = (sum(nbytes for category, nbytes in buffers.values() if category == wanted)
                                            for wanted in ("parameters", "gradients", "optimizer_state"))
    if zero_stack and not sixteen:
        notes.append(f"{states.stack} ZeRO in fp32: " + ", ".join(buffers) + " (moments sharded over dp)")
    if sixteen:
        notes.append(f"{states.stack} mixed precision: " + ", ".join(buffers)
                     + (" (master copy and moments sharded over dp)" if s.dp_strategy in ("zero1", "zero2") else ""))
    if states.stack == "megatron" and s.dp_strategy == "zero2":
        notes.append("Megatron's distributed optimizer shards no gradients: zero2 planned as its zero1")
    host = 0
    if s.offload:
        host = int(param_bytes + grad_bytes + optim_bytes)
        param_bytes = grad_bytes = optim_bytes = 0
        notes.append("offload: sharded parameters, gradients and optimizer state live in host memory")
    # Sparsity's masks: one bool per pruned value, a buffer of each block (config refuses sharding and tp).
    masked, largest_masked = sparsity_masked_values(model, compression.sparsity)
    if masked:
        param_bytes += layers * masked
        notes.append(f"sparsity {compression.sparsity}: a bool mask per pruned tensor ({_mib(layers * masked)} with "
                     "the parameters); the masked gradient (grad x mask) of the tensor being differentiated")
    if compression.qat != "none":
        notes.append(f"QAT {compression.qat}: {_qat_note(compression.qat)} kept for backward per micro-batch "
                     "(planned after quant.qat_start_step; before it the linears run plain and keep less)")

    # ---- activations of one micro-batch on this GPU
    tokens = s.micro_batch * seq_len // s.cp
    per_block = block_activation_bytes(model, tokens, sa, seq_len=seq_len, compression=compression)
    stage_acts = layers * per_block
    if n_moe:
        moe_acts = block_activation_bytes(model, tokens, sa, moe=True, seq_len=seq_len)
        stage_acts = (layers - n_moe) * per_block + n_moe * moe_acts
    seq_split = s.tp if (s.tp > 1 and s.sequence_parallel) else 1
    final_norm = tokens * cfg.d_model * (dt.residual + (dt.compute if dt.autocast else dt.residual)) // seq_split
    if cfg.norm == "rmsnorm":
        final_norm += tokens * cfg.d_model * 4 // seq_split
    final_norm *= last
    forward_saved = _forward_saved_bytes(model, tokens, sa, seq_len, first)
    in_flight = in_flight_microbatches(s, part.rank)
    head_in_flight = _head_in_flight(s)
    one_micro = stage_acts + forward_saved + final_norm
    acts = (stage_acts + forward_saved) * in_flight + final_norm * head_in_flight
    pipe_buffers = 0.0
    if piped:
        # torch's stages: a receiving stage's input is its receive buffer (one per micro-batch,
        # kept all step; the first block's saved input is that buffer), a sending stage keeps its
        # output until the micro-batch's backward, and every stage that gets gradients back has
        # one buffer per micro-batch for them.
        boundary = tokens * cfg.d_model * dt.residual // seq_split
        acts += boundary * (in_flight * first - head_in_flight * last)
        receiving, sending = len(part.stages) - first, len(part.stages) - last
        pipe_buffers = boundary * s.grad_accum * (receiving + sending)

    # Autocast keeps a bf16 copy of each weight a saved matmul needs (blocks without AC).
    weight_copies = 0.0
    if dt.autocast and s.ac == "none":
        matmul_per_block = (pc.active_matmul - vocab_params) / cfg.n_layer / s.tp
        if ex:  # every weight of the rank's blocks: an MoE block casts all of its local experts
            matmul_per_block = stage_blocks / max(layers, 1)
        weight_copies = layers * matmul_per_block * dt.compute + head_matmul * dt.compute * last

    # ---- the loss: logits (tokens x vocab) and their fp32 log-softmax, on the last stage's rank
    v_local = vocab_params // cfg.d_model / s.tp
    loss_fwd = loss_bwd = held_loss = 0.0
    if last and s.fused_loss:
        chunk = min(s.loss_chunk, tokens)
        loss_fwd = chunk * v_local * 4 * 2
        loss_bwd = chunk * v_local * 4 * 2 + tokens * cfg.d_model * 4
        notes.append("fused loss: logits exist one chunk at a time")
        if cfg.logit_softcap > 0:  # the forward caps each chunk in place; the backward holds the cap's derivative
            loss_bwd += chunk * v_local * 4
    elif last:
        low_logits = tokens * v_local * dt.compute if dt.compute != 4 else 0   # before the fp32 upcast
        loss_fwd = low_logits + 2 * tokens * v_local * 4     # fp32 logits and their log-softmax
        # backward of the log-softmax: its saved output, the incoming gradient and the outgoing
        # one (the low-precision logits are gone by then; their gradient comes after these go)
        loss_bwd = 3 * tokens * v_local * 4
        if cfg.logit_softcap > 0:  # the tanh of the logits, saved until the loss's gradient has passed the cap
            loss_fwd += tokens * v_local * dt.compute
            loss_bwd += tokens * v_local * dt.compute
        if piped:
            # The last stage holds its output, the logits, until the micro-batch's backward, and
            # the other micro-batches in flight keep their log-softmax (and the cap's tanh).
            loss_bwd += tokens * v_local * dt.compute
            held_loss = tokens * v_local * (dt.compute + 4 + (dt.compute if cfg.logit_softcap > 0 else 0))
            acts += held_loss * (head_in_flight - 1)

    # Materialized attention: the top block's scores exist next to their softmax in the forward.
    scores_fwd = _scores_bytes(model, tokens, sa, seq_len) if s.attention == "materialized" and layers else 0

    # ---- gathered parameters and communication buffers
    gather_unit = block_params * dt.gathered
    mean_gather_unit = stage_blocks / max(layers, 1) * dt.gathered if n_moe else gather_unit   # per block of the rank
    # zero2 keeps the gathered parameters from forward to backward; so does FSDP under a
    # pipeline (as torchtitan runs it), or every micro-batch would gather them again.
    # (slipstream's zero2 runs as FSDP2; Megatron's and DeepSpeed's keep the 16-bit weights whole.)
    fsdp_run = s.dp_strategy in ("fsdp", "hsdp") or (s.dp_strategy == "zero2" and not zero_stack)
    keeps_gathered = (s.dp_strategy == "zero2" and not zero_stack) or (piped and s.dp_strategy in ("fsdp", "hsdp"))
    comm = pipe_buffers
    if s.dp_strategy in ("fsdp", "hsdp") and not keeps_gathered:
        comm += 2 * gather_unit                        # the block being computed and the prefetched next one
    elif keeps_gathered:
        comm += layers * mean_gather_unit + edge * dt.gathered   # parameters stay gathered between forward and backward
    # FSDP2 reduce-scatters a unit's gradients from a buffer in its reduce dtype (MixedPrecisionPolicy.
    # reduce_dtype; the sharded gradient it keeps is fp32 either way); DeepSpeed reduces through its buckets.
    reduce_bytes = 2 if states.reduce_dtype in ("bf16", "fp16") else dt.reduce
    bucket_bytes = stack_reduce_bucket_bytes(s, states)
    reduce_buffer = block_params * reduce_bytes if fsdp_run else bucket_bytes
    if bucket_bytes:
        buffers["reduce buckets (16-bit)" if sixteen else "reduce buckets (fp32)"] = ("temporaries", bucket_bytes)
    # DDP/zero1 gradients are views into the all-reduce buckets and never freed, as are Megatron's
    # in its gradient buffer and DeepSpeed ZeRO-2's in its gradient partition; DeepSpeed ZeRO-1's
    # 16-bit gradients appear in backward. With accumulation every gradient exists from the
    # second micro-batch on.
    if sixteen or zero_stack:
        grad_buffers = states.stack == "megatron" or s.dp_strategy == "zero2"
    else:
        grad_buffers = s.dp_strategy in ("ddp", "zero1")
    persistent_grads = grad_buffers or s.grad_accum > 1
    # Under a pipeline, FSDP reduces gradients only after the last micro-batch (torch's
    # pipelining stages turn gradient sync off before it): the unsharded gradients accumulate.
    if keeps_gathered and piped:
        grad_bytes += local_params * dt.reduce

    def phase(grads: float, activations: float, temporaries: float) -> dict[str, float]:
        return {"parameters": param_bytes, "gradients": grads, "optimizer_state": optim_bytes,
                "activations": activations, "temporaries": temporaries}

    all_grads = grad_bytes if persistent_grads else 0.0
    # GPipe-like schedules run every forward before the first backward: the gradients of the
    # step's first micro-batch appear during its backward, with every micro-batch in flight.
    forwards_first = piped and s.pp_schedule in ("gpipe", "looped-bfs") and not grad_buffers
    phases = {"forward": phase(0.0 if forwards_first else all_grads, acts + weight_copies,
                               max(loss_fwd, scores_fwd) + comm)}
    # Backward: the loss's gradient first, then down the blocks: block i's activations go as
    # its gradients arrive, while its backward temporaries (and recomputation) are alive.
    head_grad = sharded(head_matmul, shard_grad) * 4 * last
    block_grad = sharded(block_params, shard_grad) * 4
    if sixteen or zero_stack:   # the stack's gradient bytes per parameter (16-bit, fp32 accumulation, fp32)
        head_grad = head_matmul * last * grad_bytes / max(local_params, 1)
        block_grad = block_params * grad_bytes / max(local_params, 1)
    transient = _block_backward_transient(model, tokens, sa, seq_len=seq_len)
    # A checkpointed block's backward first recomputes what it did not keep.
    recompute = block_activation_bytes(model, tokens, sa, mode="none", seq_len=seq_len,
                                       compression=compression) - per_block if s.ac != "none" else 0
    # The hook of a masked gradient makes grad x mask while the gradient autograd computed is alive.
    transient += largest_masked * 4
    mean_block = per_block
    if n_moe:
        # The walk goes down the rank's blocks at their mean; the largest MoE block's backward
        # (and recompute) is the one alive at each point.
        expert_grads = experts / s.expert_shard_group if shard_grad else experts
        block_grad = (sharded(stage_blocks - experts, shard_grad) + expert_grads) / layers * 4
        transient = max(transient, _block_backward_transient(model, tokens, sa, moe=True, seq_len=seq_len))
        if s.ac != "none":
            recompute = max(recompute, block_activation_bytes(model, tokens, sa, mode="none", moe=True, seq_len=seq_len)
                            - moe_acts)
        mean_block = stage_acts / layers
    copies_per_block = weight_copies / max(layers, 1)

    def walk(held: float, grads_before: float) -> dict[str, float]:
        """The highest point of one micro-batch's backward that starts with `held` activations
        and `grads_before` gradient bytes (0: they appear as it goes down the blocks)."""
        others = held - one_micro                    # the other in-flight micro-batches stay
        worst = phase(grads_before or head_grad, held + weight_copies, loss_bwd + comm + reduce_buffer)
        # Blocks 1..i still hold their activations. The total is linear in i, so its highest point
        # is at one end: checking i = layers, then i = 1, finds the same peak as walking every
        # block, in constant time (a config with a million layers is refused in microseconds).
        for i in dict.fromkeys((layers, 1)) if layers >= 1 else ():
            grads = grads_before or head_grad + (layers - i) * block_grad
            # zero2 frees a block's gathered parameters once its gradients are reduced.
            gathered = pipe_buffers + (i * mean_gather_unit + edge * dt.gathered if keeps_gathered
                                       else comm - pipe_buffers)
            candidate = phase(grads, others + forward_saved + i * (mean_block + copies_per_block),
                              recompute + transient + gathered + reduce_buffer)
            if sum(candidate.values()) > sum(worst.values()):
                worst = candidate
        return worst

    phases["backward"] = walk(acts, all_grads)
    if forwards_first and all_grads:
        # The first backward finds no gradients; the later ones every gradient and one
        # micro-batch less in flight.
        phases["backward"] = walk(acts, 0.0)
        later = walk(acts - one_micro - held_loss, all_grads)
        if sum(later.values()) > sum(phases["backward"].values()):
            phases["backward"] = later
    # The fake quantizers keep their last scales and zero points on the modules until the next forward.
    qparams = layers * (qat_activation_bytes(model, tokens, sa, compression, checkpointed=True)
                        + qat_weight_bytes(model, sa, compression, kept=False))
    # DeepSpeed's step converts the shard's 16-bit gradients to fp32 for the optimizer
    # (stage_1_and_2.py, step: single_grad_partition ... .to(single_partition_of_fp32_groups[i].dtype)).
    fp32_grad_shard = 0.0
    if sixteen and states.stack == "deepspeed" and not states.grads_in_fp32(s):
        fp32_grad_shard = local_params * 4 / (group if s.dp_strategy in ("zero1", "zero2") else 1)
    phases["optimizer"] = phase(grad_bytes, qparams, pipe_buffers + fp32_grad_shard)

    peak_phase = max(phases, key=lambda name: sum(phases[name].values()))
    breakdown = {k: int(v) for k, v in phases[peak_phase].items()}
    peak = sum(breakdown.values())
    frag = int(peak * CUDA_FRAGMENTATION) if device != "cpu" else 0
    return MemoryEstimate(peak_bytes=peak, peak_phase=peak_phase, breakdown=breakdown,
                          fragmentation_bytes=frag, host_bytes=host, notes=notes,
                          buffers={name: int(nbytes) for name, (_, nbytes) in buffers.items()})


def _traced_memory(model: PlanModel, s: Strategy, seq_len: int, device: str,
                   optimizer_state_bytes: int, state_dtype: str = "",
                   states: StackStates = TORCH_STATES) -> MemoryEstimate:
    """A user module measured on fake tensors (plan/trace.py). Its measured step peak at
    micro-batch 1 splits into the model states alive at that peak and the rest (activations
    and temporaries); the states are re-computed for the layout's sharding, the rest grows
    with the micro-batch and (linearly: flash attention keeps no T x T matrix) the sequence."""
    t = model.traced
    key = "fp32" if s.precision == "fp32" else "bf16"
    scale = seq_len / t.seq_len
    states_at_peak = t.param_bytes + t.peak_grad_bytes.get(key, t.grad_bytes) + t.optimizer_bytes
    dynamic_one = max(0, t.peak_bytes.get(key, states_at_peak) - states_at_peak) * scale
    acts = t.activation_bytes_per_sequence[key] * scale * s.micro_batch
    temporaries = max(0.0, dynamic_one - t.activation_bytes_per_sequence[key] * scale)
    params, grads, optim = model_state_bytes(t.n_params, s, optimizer_state_bytes, states=states)
    if state_dtype in LOW_BIT_FORMATS:
        # A traced module's tensor shapes are not kept: planned as if every tensor were quantized.
        block, value_bytes, _ = LOW_BIT_FORMATS[state_dtype]
        optim = t.n_params * 2 * (value_bytes + 4 / block)
    # The peak comes early in backward, before most gradients exist (unless they persist).
    if s.dp_strategy not in ("ddp", "zero1") and s.grad_accum == 1 and t.grad_bytes:
        grads *= t.peak_grad_bytes.get(key, t.grad_bytes) / t.grad_bytes
    if s.dp_strategy in ("zero2", "fsdp", "hsdp"):
        # a user module is sharded as one unit: the whole model is gathered for compute
        temporaries += t.n_params * (2 if s.precision != "fp32" else 4)
    host = 0
    if s.offload:
        host, params, grads, optim = int(params + grads + optim), 0.0, 0.0, 0.0
    breakdown = {"parameters": int(params), "gradients": int(grads), "optimizer_state": int(optim),
                 "activations": int(acts), "temporaries": int(temporaries)}
    peak = sum(breakdown.values())
    frag = int(peak * CUDA_FRAGMENTATION) if device != "cpu" else 0
    return MemoryEstimate(peak_bytes=peak, peak_phase="backward", breakdown=breakdown, fragmentation_bytes=frag,
                          host_bytes=host, notes=["traced module: measured on fake tensors at micro-batch 1 and 2"])


def muon_matrix_params(model: PlanModel, layers: int, n_moe: int, s: Strategy) -> float:
    """Parameters of this stage that Muon steps (optimize/muon.py): the blocks' attention and MLP
    weight matrices, an MoE block's shared experts (not its router or routed experts), split by tp."""
    cfg = model.cfg
    bare = param_count(dataclasses.replace(cfg, bias=False))  # weights only: biases stay on AdamW
    shared = bare.mlp - bare.experts // bare.moe_layers - cfg.d_model * cfg.moe_experts if bare.moe_layers else 0
    return ((layers - n_moe) * (bare.attn + bare.dense_mlp) + n_moe * (bare.attn + shared)) / s.tp


# ---------------------------------------------------------------- low-bit optimizer states

# torchao.optim (0.18) quantizes a moment only when its tensor has at least this many values and
# a multiple of the block size; smaller tensors keep plain moments in the param dtype. Source:
# torchao/optim/adam.py, _AdamBase._new_buffer ("follow bitsandbytes, only quantize tensors >= 4096
# values"); block sizes: the defaults of AdamW8bit (block_size=256) and AdamW4bit (128) there;
# codes: subclass_8bit.py (one uint8 per value, a 256-entry fp32 code book per tensor) and
# subclass_4bit.py (two 4-bit codes per uint8, a 16-entry fp32 code book); one fp32 scale per
# block (torch.zeros(numel // block_size)). optimize/optimizers.py builds the optimizer from these.
LOW_BIT_MIN_NUMEL = 4096
LOW_BIT_FORMATS = {  # state_dtype: (block size, bytes per quantized value, code-book entries)
    "int8": (256, 1.0, 256),
    "int4": (128, 0.5, 16),
}


def low_bit_quantized(numel: int, state_dtype: str) -> bool:
    """Whether torchao stores the moments of a tensor of `numel` values quantized."""
    return numel >= LOW_BIT_MIN_NUMEL and numel % LOW_BIT_FORMATS[state_dtype][0] == 0


def low_bit_state_bytes(numel: int, state_dtype: str, param_bytes: int = 4) -> int:
    """Bytes of one parameter's state under torchao's low-bit AdamW: two moments (codes, one fp32
    scale per block and the code book; or plain param-dtype tensors below the size threshold) and
    the fp32 step counter."""
    if not low_bit_quantized(numel, state_dtype):
        return 2 * numel * param_bytes + 4
    block, value_bytes, codebook = LOW_BIT_FORMATS[state_dtype]
    return 2 * (int(numel * value_bytes) + 4 * (numel // block) + 4 * codebook) + 4


_LOW_BIT_CACHE: dict[tuple[str, str], tuple[float, int, int, int]] = {}


def low_bit_optimizer_bytes(model: PlanModel, part: RankPart, state_dtype: str, piped: bool = False) -> int:
    """Optimizer-state bytes of one rank's whole (unsharded, tp = 1) parameters under torchao's
    low-bit AdamW, tensor by tensor: the model's parameter shapes come from building it on the
    meta device (no memory). Blocks are counted at the mean block's bytes (exact where the blocks
    are alike); the copy of a tied table a pipeline's last stage holds (piped) is counted there too."""
    key = (repr(model.cfg), state_dtype)
    if key not in _LOW_BIT_CACHE:
        import torch

        from slipstream.models.transformer import Transformer

        with torch.device("meta"):
            net = Transformer(model.cfg)
        blocks = embedding = head = 0
        for name, param in net.named_parameters():   # a tied table once, under tok_emb
            nbytes = low_bit_state_bytes(param.numel(), state_dtype)
            if name.startswith("blocks."):
                blocks += nbytes
            elif name.startswith(("final_norm.", "lm_head.")):
                head += nbytes
            else:
                embedding += nbytes
        tied = net.lm_head.weight is net.tok_emb.weight
        _LOW_BIT_CACHE[key] = (blocks / model.cfg.n_layer, embedding, head,
                               low_bit_state_bytes(net.tok_emb.weight.numel(), state_dtype) if tied else 0)
    per_block, embedding, head, tied_table = _LOW_BIT_CACHE[key]
    return int(part.blocks * per_block + part.embedding * embedding + part.head * (head + piped * tied_table))


def model_state_bytes(params: float, s: Strategy, optimizer_state_bytes: int = 4,
                      shard_group: int | None = None, states: StackStates = TORCH_STATES) -> tuple[float, float, float]:
    """(parameters, gradients, optimizer state) bytes per GPU for the `params` parameters of
    this GPU's part of the model, as `states.stack` keeps them (state_buffers): on slipstream's own
    trainer fp32 parameters and gradients (low precision runs through autocast or FSDP mixed
    precision, so there is no separate master copy) and AdamW's two moments, each divided by the
    shard group where the strategy shards it (`shard_group` overrides it: experts shard over the
    ranks that hold the same experts)."""
    totals = dict.fromkeys(("parameters", "gradients", "optimizer_state"), 0.0)
    for category, nbytes in state_buffers(params, s, states, optimizer_state_bytes, shard_group).values():
        totals[category] += nbytes
    return totals["parameters"], totals["gradients"], totals["optimizer_state"]


def _block_backward_transient(model: PlanModel, tokens: int, s: Strategy, moe: bool = False,
                              seq_len: int | None = None) -> int:
    """Gradients of activations alive while one block is differentiated, beyond what the block
    already saved: the MLP's inner gradient (gelu, relu: one n x F tensor; swiglu: two, the gate's
    and the up projection's) next to the residual stream's gradient and its copy. An MoE
    block's: its k n routed rows' inner gradients (whole: not split by tp), the shared
    experts', and the dispatch buffers of the rows' gradients (sent and received). Materialized
    attention's backward holds the gradients of its probabilities and of its scores (two T x T
    matrices per head), after the MLP's backward has freed the MLP's saved inner tensors: those
    instead, where they are larger."""
    cfg, dt = model.cfg, _dtypes(s)
    n_up = 2 if cfg.mlp == "swiglu" else 1
    ex = experts_of(model) if moe else None
    residual_grads = 2 * tokens * cfg.d_model * dt.residual
    attention = 2 * _scores_bytes(model, tokens, s, seq_len) if s.attention == "materialized" else 0
    if ex is not None:
        routed = tokens * ex.top_k
        inner = (routed * ex.hidden + tokens * ex.shared_hidden) * dt.compute * n_up
        return max(inner + 2 * routed * cfg.d_model * dt.residual, attention) + residual_grads
    inner = tokens * _mlp_hidden(model) * dt.compute // s.tp * n_up
    # Attention's backward runs after the MLP's, which has freed the MLP's saved inner tensors.
    mlp_freed = tokens * _mlp_hidden(model) * dt.compute // s.tp * _MLP_SAVED[cfg.mlp]
    return max(inner, attention - mlp_freed) + residual_grads
