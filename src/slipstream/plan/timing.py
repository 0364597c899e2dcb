"""Step time of a layout on a cluster, predicted from FLOPs, bytes and links (docs/planner.md).

    step = compute x (1 + pipeline bubble) + exposed communication + optimizer step

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
             score passes, AV: no T x T matrix is kept, as plan/memory.py plans it). A pipeline rank runs its own whole blocks (plan/stages.rank_parts, the
             trainer's split), the first also the embedding, the last the head and loss; the
             step follows the busiest rank. `efficiency` divides the device time: a calibration
             measured by `slipstream tune system` / --calibrate (1 = the fitted rates).
comm         each strategy's exact collective volumes (step_collectives: what slipstream's
             layers issue, the bytes observe.comm counts in a run) over the links its group crosses,
             each call as NCCL runs it (plan/collectives.py: ring, tree, PAT or NVLS, LL,
             LL128 or Simple, whichever NCCL's tuning model finds fastest for its size; gloo
             on a CPU as plain rings). Overlap rules: the gradient reduction of DDP / zero1
             runs in the stack's buckets (Cluster.stack, --bucket-mb) behind backward, all
             but the last bucket hidden, where the stack overlaps it (--overlap-grad-reduce;
             Megatron's and DeepSpeed's defaults do not: every bucket exposed); Megatron's / DeepSpeed's ZeRO all-gather of the
             updated parameters is exposed; FSDP all-gathers and reduce-scatters hide behind the
             block they prefetch for (only what is longer than the compute shows); TP
             collectives sit on the critical path; CP's ring exchange hides behind attention;
             EP's all-to-all, the MoE token-count all-reduce and PP's point-to-point sends
             are exposed.
experts      an MoE block (plan/experts.py) runs its router, shared experts and the routed
             rows (tokens x top_k, spread evenly over the E / ep local experts: the FLOPs of
             the active parameters only) whole on every tp rank; the dispatch and combine
             all-to-alls over the ep group (consecutive data-parallel ranks) are not rings:
             all_to_all_time sends each member's share over NVLink or, off the node, through
             the GPU's own share of the network.
bubble       pipeline_bubble: the idle fraction f of a pipeline rank's step, so the bubble adds
             compute x f / (1 - f): GPipe / 1F1B (p-1)/m of the compute, interleaved (p-1)/(v m),
             zero-bubble schedules 5% of that (Qi et al. 2023).
offload      parameters up and gradients down over the host link, Adam on the CPU.

MFU counts the model's FLOPs (models.flops); HFU those plus activation checkpointing's recomputed
forward (selective with materialized scores: the attention core's 4 T d per layer); the hardware
FLOPs also a fused attention kernel's recomputed scores.
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from dataclasses import dataclass, field

from slipstream.models.flops import flops_per_token, param_count
from slipstream.plan import efficiency as rates_table
from slipstream.plan.collectives import (Collective, Span, _rows, all_reduce, all_to_all_time,  # noqa: F401
                                         bus_factor, call_time, collective_time, collectives_by_dim,
                                         gather_or_scatter, ring_time, span)
from slipstream.plan.efficiency import Fit, Rates
from slipstream.plan.experts import experts_of
from slipstream.plan.hardware import DEFAULT_MATMUL_EFFICIENCY, Cluster
from slipstream.plan.memory_activations import _dtypes
from slipstream.config.dims import PP_ONE_STAGE
from slipstream.errors import UserError
from slipstream.plan.space import SCHEDULE_VIRTUAL, ZERO_BUBBLE_SCHEDULES, PlanModel, Strategy, Workload
from slipstream.plan.stages import RankPart, rank_parts, stage_costs

# A calibration factor on the compute rates, 1 = the rates of plan/efficiency.py (fitted to the
# published runs per operation class). `slipstream tune system` and --calibrate measure it for a
# machine: the measured / predicted throughput of real runs.
DEFAULT_EFFICIENCY = 1.0
# A traced user module (plan/trace.py) has no known op structure: its kept activations are read
# and written about this many times per step (forward writes them and reads them back; backward
# reads them and writes their gradients).
POINTWISE_TRAFFIC = 3.0
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
# Gradient buckets of each stack (Cluster.stack; `--bucket-mb` replaces the cap), reduced as
# backward produces them:
# torch DDP: bucket_cap_mb = 25 MiB, and a first bucket of 1 MiB (torch.distributed's
#   _DEFAULT_FIRST_BUCKET_BYTES) so that the first reduction starts early.
DDP_BUCKET_BYTES = 25 * 2**20
DDP_FIRST_BUCKET_BYTES = 2**20
# Megatron-LM: its grad buffer's buckets of max(40M, 1M x dp) parameters (Megatron Core
#   distributed/distributed_data_parallel_config.py, DistributedDataParallelConfig.bucket_size:
#   "If unspecified, MCore uses a default value of max(40000000, 1000000 * dp_size) parameters").
MEGATRON_BUCKET_PARAMS = 40_000_000
MEGATRON_BUCKET_PARAMS_PER_DP_RANK = 1_000_000
# DeepSpeed ZeRO: reduce_bucket_size and allgather_bucket_size, 5e8 elements each (deepspeed/
#   runtime/zero/constants.py: ZERO_OPTIMIZATION_REDUCE_BUCKET_SIZE_DEFAULT = 500000000,
#   ZERO_OPTIMIZATION_ALLGATHER_BUCKET_SIZE_DEFAULT = 500000000).
DEEPSPEED_BUCKET_ELEMENTS = 500_000_000
# FSDP2's host-side cost per unit and collective (pre/post hooks, copy-in/copy-out of the
# flat buffers): an estimate of tens of microseconds on a GPU host; it is why small models
# run faster with DDP than with FSDP.
FSDP_UNIT_OVERHEAD_S = 50e-6
# CPU Adam for offloaded state: bytes of state it streams per second (fp32 params, grads, two moments).
HOST_ADAM_GBS = 10.0
# Bytes Adam reads and writes per parameter on the device (param, grad, two moments, in and out).
ADAM_BYTES_PER_PARAM = 28
# What is left of the (interleaved) bubble under a zero-bubble schedule: see pipeline_bubble.
ZERO_BUBBLE_RESIDUAL = 0.05



def pipeline_bubble(schedule: str, pp: int, virtual: int, microbatches: int) -> float:
    """The pipeline bubble of a schedule: the fraction of a pipeline rank's step time it sits
    idle (idle / step), for `pp` ranks holding `virtual` stages each and `microbatches`
    micro-batches per step. The one formula the planner's step time and the trainer's planned
    bubble use; `schedule` is the trainer's name (parallel.pp_schedule).

    gpipe, 1f1b               (p-1) / (m + p-1): the warm-up and cool-down idle p-1 stage-times
                              of a step of m (Huang et al. 2019; 1F1B only bounds the memory)
    interleaved-1f1b,         (p-1) / (v m + p-1): the same p-1 slots, each of one of the v
    looped-bfs                chunks of a stage (Narayanan et al. 2021; BFS loops the same way)
    interleaved-zero-bubble,  ZERO_BUBBLE_RESIDUAL x the interleaved fraction: splitting the
    zbv, dualpipev            backward into input and weight gradients lets the deferred weight
                              passes fill the warm-up and cool-down, ~0 in theory (Qi et al. 2023,
                              2024); what stays is the uneven F / B / W times and the sends,
                              which the formula does not see, kept as a small 5%.

    gpipe and 1f1b run one stage per rank whatever `virtual` says.
    """
    if schedule not in SCHEDULE_VIRTUAL:
        raise ValueError(f"unknown pipeline schedule {schedule!r}; valid: {', '.join(SCHEDULE_VIRTUAL)}")
    if pp <= 1:
        return 0.0
    v = 1 if schedule in PP_ONE_STAGE else max(1, virtual)
    idle = (pp - 1) / (v * max(1, microbatches) + pp - 1)
    return idle * ZERO_BUBBLE_RESIDUAL if schedule in ZERO_BUBBLE_SCHEDULES else idle




@dataclass
class TimeEstimate:
    step_s: float
    tokens_per_s: float
    mfu: float                   # model FLOPs (models.flops) per second / (GPUs x dense peak)
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per component (they add up to step_s)
    # hardware FLOPs utilization as PaLM (Chowdhery et al. 2022) and the runs that report it
    # define it (Korthikanti et al. 2022, llm-foundry): model FLOPs + activation checkpointing's
    # recomputed forward; a fused attention kernel's own recompute is not counted
    hfu: float = 0.0
    model_tflops_per_gpu: float = 0.0
    # every FLOP the GPU executes per second: the recompute above and a fused attention
    # kernel's recomputed scores in backward
    hardware_tflops_per_gpu: float = 0.0
    # model + activation checkpointing's recomputed forward, per GPU: what FLOP formulas "with
    # recompute" count (Megatron-LM's, Narayanan et al. 2021 eq. 3), without a kernel's own recompute
    recompute_tflops_per_gpu: float = 0.0
    # seconds of the busiest rank's compute by class: gemm, attention, pointwise, launch (exposed
    # host time), and recompute (the part of those that activation checkpointing re-runs)
    compute_s: dict[str, float] = field(default_factory=dict)

    def to_record(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu, "hfu": self.hfu,
                "model_tflops_per_gpu": self.model_tflops_per_gpu,
                "hardware_tflops_per_gpu": self.hardware_tflops_per_gpu,
                "recompute_tflops_per_gpu": self.recompute_tflops_per_gpu,
                "breakdown_s": {k: round(v, 6) for k, v in self.breakdown.items()},
                "compute_s": {k: round(v, 6) for k, v in self.compute_s.items()}}


def step_collectives(model: PlanModel, s: Strategy, work: Workload, stack: str = "torch",
                     bucket_mb: float | None = None, overlap: bool = True) -> list[Collective]:
    """The collectives one rank runs in one training step of `model` laid out as `s`: the
    volumes slipstream's layers issue (distributed/tensor_parallel.py, context_parallel.py,
    data_parallel.py), in the units observe.comm measures (`metrics.comm_volume`).

    tp, per block and micro-batch, of the block's activations (tokens x d): without sequence
    parallel 2 all-reduces forward (attention and MLP outputs) and 2 backward (their inputs'
    gradients); with it each becomes an all-gather (forward: the input; backward: the output's
    gradient) and a reduce-scatter, 4 + 4 (the same ring time: an all-reduce is a
    reduce-scatter then an all-gather). Full activation checkpointing re-runs the forward ones.
    The vocabulary-parallel embedding reduces its output (forward; with SP a reduce-scatter and
    a backward all-gather), learned positions the same for (T, d), the head gathers its input
    (SP; backward reduce-scatter; without SP a backward all-reduce), and loss parallel's
    cross-entropy all-reduces three floats per token (max, sum of exponentials, target logit).
    With SP the norms' gradients are partial sums, all-reduced by each of their two readers
    (the gradient norm, the optimizer). Not counted: the gradient norm's few scalars.
    cp, per block and micro-batch: K and V all-gathered over the whole sequence (heads / tp),
    their gradients reduce-scattered back (full AC: gathered again).
    dp (the cp ranks fold into it), by `stack` (hardware.STACKS; bucket_mb replaces its bucket
    size, gradient_buckets): DDP and zero1 all-reduce the gradients once per step in the stack's
    buckets; torch's zero1 (ZeroRedundancyOptimizer) then broadcasts every rank's updated shard;
    Megatron's distributed optimizer and DeepSpeed ZeRO-1/2 (zero1, zero2 on those stacks)
    reduce-scatter the gradients instead and all-gather the updated parameters in the compute
    dtype (DeepSpeed ZeRO-2 reduces after every micro-batch, the others once per step); FSDP (zero2, fsdp, hsdp)
    per micro-batch all-gathers every unit's parameters forward (in bf16 under its mixed
    precision), re-gathers the blocks' in backward (not zero2; the root unit stays gathered)
    and reduce-scatters the fp32 gradients; hsdp then all-reduces the shard over the replicas.
    Under a pipeline, the stage gathers and reduces once per step.
    Mixture of experts, per MoE block and micro-batch: with tp, the layer's input is gathered
    and its output sliced (sequence parallel: an all-gather forward and one backward, no
    reduce-scatter; without SP nothing). ep: an all-to-all of the E token counts, then the
    dispatch (tokens x top_k rows of d, in the residual stream's dtype) and the combine (the
    experts' outputs, in the compute dtype) all-to-alls, each again in backward; activation
    checkpointing (full or selective: neither saves a collective) re-runs the forward ones. The
    E counts are all-reduced over the data-parallel ranks (x cp) in every forward (and
    recompute). With ep > 1 the routed experts' FSDP collectives run over the dp / ep ranks
    holding them (part "experts"); DDP leaves them alone. Pipeline sends are left to estimate_time.
    Under a pipeline the rank is the busiest one (busiest_rank: its whole blocks, the trainer's split).
    """
    cfg = model.cfg
    micro = s.grad_accum
    tokens_micro = s.micro_batch * work.seq_len // s.cp
    layers = _rank_blocks(model, s, work.seq_len)
    elem = 4 if s.precision == "fp32" else 2
    recompute = 1 if s.ac == "full" else 0
    ex = experts_of(model)
    moe_layers = ex.layers * layers / cfg.n_layer if ex else 0.0
    rows: list[Collective] = []

    def add(dim: str, kind: str, part: str, group: int, buffer: float, calls: float) -> None:
        if group > 1 and calls > 0:
            rows.append(Collective(dim, kind, part, group, buffer * calls, calls))

    if model.traced is None and s.tp > 1:
        act = tokens_micro * cfg.d_model * elem
        pos = tokens_micro // s.micro_batch * cfg.d_model * elem      # learned positions: (T/cp, d)
        if s.sequence_parallel:
            per_kind = 2 * (2 + recompute) * layers * micro             # forward (+ recomputed) and backward
            add("tp", "all_gather", "blocks", s.tp, act, per_kind)
            # an MoE block's MLP is not split: its output is sliced, not reduce-scattered
            add("tp", "reduce_scatter", "blocks", s.tp, act, per_kind - (2 + recompute) * moe_layers * micro)
            add("tp", "reduce_scatter", "embedding", s.tp, act, micro)   # forward
            add("tp", "all_gather", "embedding", s.tp, act, micro)       # backward
            if cfg.position == "learned":
                add("tp", "reduce_scatter", "embedding", s.tp, pos, micro)
                add("tp", "all_gather", "embedding", s.tp, pos, micro)
            add("tp", "all_gather", "head", s.tp, act, micro)            # forward
            add("tp", "reduce_scatter", "head", s.tp, act, micro)        # backward
        else:
            add("tp", "all_reduce", "blocks", s.tp, act,
                (2 * (1 + recompute) + 2) * layers * micro - (2 + recompute) * moe_layers * micro)
            add("tp", "all_reduce", "embedding", s.tp, act, micro)
            if cfg.position == "learned":
                add("tp", "all_reduce", "embedding", s.tp, pos, micro)
            add("tp", "all_reduce", "head", s.tp, act, micro)            # backward
        add("tp", "all_reduce", "loss", s.tp, tokens_micro * 4, 3 * micro)
        if s.sequence_parallel:
            # The norms' weights see a sequence shard each: their gradients stay partial sums
            # (DTensor Partial), reduced once per step by each reader: the gradient norm and the
            # optimizer; under FSDP once, when it takes the gradients (measured: cp2tp2).
            tensors = (2 * layers + 1) * (2 if cfg.norm == "layernorm" and cfg.bias else 1)  # weight (+ bias)
            readers = 1 if s.dp_strategy in ("zero2", "fsdp", "hsdp") else 2
            add("tp", "all_reduce", "gradients", s.tp, cfg.d_model * 4, readers * tensors)

    if model.traced is None and s.cp > 1:
        head_dim = cfg.d_model // cfg.n_head
        one = s.micro_batch * work.seq_len * (cfg.n_kv_head or cfg.n_head) * head_dim * elem / s.tp  # K or V, gathered
        add("cp", "all_gather", "blocks", s.cp, one, 2 * (1 + recompute) * layers * micro)
        add("cp", "reduce_scatter", "blocks", s.cp, one, 2 * layers * micro)

    if ex:
        again = 1 if s.ac != "none" else 0      # the recomputed forward's collectives
        counts = ex.n * 8                        # int64 per expert
        if s.ep > 1:
            routed = tokens_micro * ex.top_k * cfg.d_model
            dtypes = _moe_dtypes(s)
            add("ep", "all_to_all", "blocks", s.ep, routed * dtypes[0], (2 + again) * moe_layers * micro)   # dispatch
            add("ep", "all_to_all", "blocks", s.ep, routed * dtypes[1], (2 + again) * moe_layers * micro)   # combine
            add("ep", "all_to_all", "router", s.ep, counts, (1 + again) * moe_layers * micro)
        if s.dp_strategy == "hsdp":
            add("dp", "all_reduce", "router", s.dp_shard * s.cp, counts, (1 + again) * moe_layers * micro)
            add("dp_replicate", "all_reduce", "router", s.dp // s.dp_shard, counts, (1 + again) * moe_layers * micro)
        else:
            add("dp", "all_reduce", "router", s.dp * s.cp, counts, (1 + again) * moe_layers * micro)

    rows += _data_parallel_collectives(model, s, work.seq_len, stack, bucket_mb, overlap)
    return rows


def _moe_dtypes(s: Strategy) -> tuple[int, int]:
    """Bytes per element of the rows an MoE layer dispatches (its input: the residual stream's
    dtype, fp32 under autocast) and of the experts' outputs it combines (the compute dtype)."""
    low = s.precision != "fp32"
    fsdp_mp = low and s.dp_strategy in ("zero2", "fsdp", "hsdp") and s.fsdp_mixed
    return (2 if fsdp_mp else 4), (2 if low else 4)


def gradient_dtype_bytes(s: Strategy, stack: str) -> int:
    """Bytes per gradient element the data-parallel reduction moves. torch: slipstream keeps fp32
    parameters and gradients (autocast computes in 16 bits). Megatron: its grad buffer, fp32
    under bf16 (arguments.py forces accumulate_allreduce_grads_in_fp32: "bfloat16 requires
    gradient accumulation and all-reduce to be done in fp32"), else the parameters' dtype.
    DeepSpeed: the 16-bit model's gradients (its communication_data_type defaults to them)."""
    if s.precision == "fp32" or stack == "torch" or (stack == "megatron" and s.precision == "bf16"):
        return 4
    return 2


def uses_reduce_scatter(s: Strategy, stack: str) -> bool:
    """ZeRO as Megatron's distributed optimizer and DeepSpeed run it: gradients reduce-scattered,
    parameters all-gathered (zero1; zero2 too, which the planner otherwise runs as FSDP2)."""
    return stack != "torch" and s.dp_strategy in ("zero1", "zero2")


def _reductions(s: Strategy, stack: str) -> int:
    """Gradient reductions per step outside FSDP: one (no_sync, or the grad buffer accumulating
    the micro-batches), but DeepSpeed ZeRO-2 keeps only its gradient shard, so it reduces after
    every micro-batch (a pipeline stage accumulates first)."""
    return s.grad_accum if (stack == "deepspeed" and s.dp_strategy == "zero2" and s.pp == 1) else 1


def gradient_buckets(grad_bytes: float, elem: int, stack: str, dp: int, bucket_mb: float | None = None,
                     overlap: bool = True) -> list[float]:
    """The gradient buckets of one reduction, in the order they are reduced (bytes each). torch
    DDP: a first bucket of DDP_FIRST_BUCKET_BYTES, then bucket_cap_mb (25 MiB) ones, the rest in
    the last; Megatron: max(40M, 1M x dp) parameters each, or one bucket of every gradient when it
    does not overlap (hardware.STACK_OVERLAPS_GRAD_REDUCE: its DistributedDataParallel sets
    bucket_size to None without overlap_grad_reduce); DeepSpeed: reduce_bucket_size (5e8
    elements). bucket_mb (MiB) replaces the stack's bucket size (DDP keeps its first bucket)."""
    if grad_bytes <= 0:
        return []
    if bucket_mb is None and stack == "megatron" and not overlap:
        return [float(grad_bytes)]
    if bucket_mb is not None:
        size = bucket_mb * 2**20
    elif stack == "megatron":
        size = max(MEGATRON_BUCKET_PARAMS, MEGATRON_BUCKET_PARAMS_PER_DP_RANK * dp) * elem
    elif stack == "deepspeed":
        size = DEEPSPEED_BUCKET_ELEMENTS * elem
    else:
        size = DDP_BUCKET_BYTES
    buckets = []
    rest = grad_bytes
    if stack == "torch" and rest > DDP_FIRST_BUCKET_BYTES and size > DDP_FIRST_BUCKET_BYTES:
        buckets.append(float(DDP_FIRST_BUCKET_BYTES))
        rest -= DDP_FIRST_BUCKET_BYTES
    full = int(rest // size)
    buckets += [float(size)] * full
    if rest - full * size > 0:
        buckets.append(rest - full * size)
    return buckets


def _data_parallel_collectives(model: PlanModel, s: Strategy, seq_len: int | None, stack: str = "torch",
                               bucket_mb: float | None = None, overlap: bool = True) -> list[Collective]:
    """The gradient and parameter collectives of step_collectives (see there)."""
    group = s.dp * s.cp  # the cp ranks average gradients with the data-parallel ones
    if s.dp_strategy == "none" or group <= 1:
        return []
    # tp splits the matmuls; the norms and the row-parallel biases stay whole on every tp rank
    blocks = _rank_blocks(model, s, seq_len) if model.traced is None else 1.0
    params = _params_per_gpu(model, s, seq_len) + _tp_replicated_params(model, s, blocks) * (1 - 1 / s.tp)
    # ep > 1: the routed experts reduce over the dp / ep ranks that hold the same ones (below)
    experts = _expert_params_per_gpu(model, s, blocks) if model.traced is None else 0.0
    params -= experts
    grad_bytes = params * 4
    rows = []
    elem = gradient_dtype_bytes(s, stack)
    if uses_reduce_scatter(s, stack):
        reductions = _reductions(s, stack)
        buckets = len(gradient_buckets(params * elem, elem, stack, group, bucket_mb, overlap))
        rows.append(Collective("dp", "reduce_scatter", "gradients", group, params * elem * reductions,
                               buckets * reductions))
        compute = 4 if s.precision == "fp32" else 2
        # Megatron all-gathers the updated parameters bucket by bucket: the same parameter buckets
        # its gradients were reduce-scattered in (param_and_grad_buffer.py, one bucket group each).
        gathers = math.ceil(params / DEEPSPEED_BUCKET_ELEMENTS) if stack == "deepspeed" else buckets
        rows.append(Collective("dp", "all_gather", "parameters", group, params * compute, max(1, gathers)))
        if experts and group // s.ep > 1:
            rows.append(Collective("dp", "reduce_scatter", "experts", group // s.ep, experts * elem * reductions,
                                   len(gradient_buckets(experts * elem, elem, stack, group, bucket_mb, overlap)) * reductions))
            rows.append(Collective("dp", "all_gather", "experts", group // s.ep, experts * compute, 1))
        return rows
    if s.dp_strategy in ("ddp", "zero1"):
        buckets = len(gradient_buckets(params * elem, elem, stack, group, bucket_mb, overlap))
        rows.append(Collective("dp", "all_reduce", "gradients", group, params * elem, max(1, buckets)))
        if s.dp_strategy == "zero1":
            rows.append(Collective("dp", "broadcast", "parameters", group, params * 4, group))  # one per shard
        if experts and group // s.ep > 1:   # ddp with ep < dp (the trainer refuses it): planned as a reduction
            rows.append(Collective("dp", "all_reduce", "experts", group // s.ep, experts * elem,
                                   max(1, len(gradient_buckets(experts * elem, elem, stack, group, bucket_mb, overlap)))))
        return rows
    shard = (s.dp_shard if s.dp_strategy == "hsdp" else s.dp) * s.cp
    low = s.precision != "fp32" and s.fsdp_mixed   # FSDP gathers in bf16 only under its mixed precision
    gather_elem = 2 if low else 4
    units = _fsdp_units(model, s, blocks)
    root = _root_params_per_gpu(model, s)
    syncs = 1 if s.pp > 1 else s.grad_accum        # a pipeline stage keeps its parameters between micro-batches
    regather = params - root if (s.dp_strategy != "zero2" and s.pp == 1) else 0.0
    if shard > 1:
        rows.append(Collective("dp", "all_gather", "parameters", shard, params * gather_elem * syncs, units * syncs))
        if regather:
            rows.append(Collective("dp", "all_gather", "parameters", shard, regather * gather_elem * syncs,
                                   (units - 1) * syncs))
        rows.append(Collective("dp", "reduce_scatter", "gradients", shard, grad_bytes * syncs, units * syncs))
    holders = s.expert_shard_group
    if experts and holders > 1:
        # the experts of each MoE block: an FSDP unit of their own over the ranks that hold them
        ex_units = experts_of(model).layers * blocks / model.cfg.n_layer
        rows.append(Collective("dp", "all_gather", "experts", holders, experts * gather_elem * syncs, ex_units * syncs))
        if s.dp_strategy != "zero2" and s.pp == 1:
            rows.append(Collective("dp", "all_gather", "experts", holders, experts * gather_elem * syncs,
                                   ex_units * syncs))
        rows.append(Collective("dp", "reduce_scatter", "experts", holders, experts * 4 * syncs, ex_units * syncs))
    if s.dp_strategy == "hsdp" and s.dp // s.dp_shard > 1:
        # FSDP2 all-reduces each unit's gradient shard; counted as one call per sync (the time
        # model's latency: the units' calls follow one another behind backward)
        rows.append(Collective("dp_replicate", "all_reduce", "gradients", s.dp // s.dp_shard,
                               grad_bytes / shard * syncs, syncs))
    return rows




# ---------------------------------------------------------------- pipeline ranks

_PARTS_CACHE: dict[tuple, list[RankPart]] = {}


def pipeline_ranks(model: PlanModel, s: Strategy, seq_len: int) -> list[RankPart]:
    """What each pp rank holds: its whole blocks and end pieces, as the trainer splits them
    (plan/stages.rank_parts: balanced by training FLOPs, or s.pp_layers). One rank holding all
    when pp = 1. Cached: the split is a dynamic program over the layers."""
    cfg = model.cfg
    if s.pp <= 1:
        return [RankPart(0, cfg.n_layer, (0,), (cfg.n_layer,), True, True)]
    key = (cfg.n_layer, stage_costs(cfg, seq_len), s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers)
    if key not in _PARTS_CACHE:
        try:
            parts = rank_parts(cfg, seq_len, s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers or None)
        except UserError:
            # More stages than blocks (or a split that does not fit): the trainer refuses it and the
            # search flags it not runnable (search.evaluate); still planned, one stage per rank, with
            # the blocks dealt out as evenly as whole blocks go (at least one per rank).
            per_rank = [max(1, cfg.n_layer // s.pp + (r < cfg.n_layer % s.pp)) for r in range(s.pp)]
            parts = [RankPart(r, n, (r,), (n,), r == 0, r == s.pp - 1) for r, n in enumerate(per_rank)]
        _PARTS_CACHE[key] = parts
    return _PARTS_CACHE[key]


def busiest_rank(model: PlanModel, s: Strategy, seq_len: int) -> RankPart:
    """The pp rank with the most training FLOPs (stages.stage_costs): the one whose blocks the
    per-rank collectives and parameters are counted for."""
    w = stage_costs(model.cfg, seq_len)
    return max(pipeline_ranks(model, s, seq_len),
               key=lambda p: p.blocks * w.block + w.embedding * p.embedding + w.head * p.head)


def _rank_blocks(model: PlanModel, s: Strategy, seq_len: int | None) -> float:
    """Blocks of the busiest pp rank (all of them without a pipeline; n_layer / pp when the
    sequence length, which weighs the split, is not known)."""
    if s.pp <= 1:
        return float(model.cfg.n_layer)
    if seq_len is None:
        return model.cfg.n_layer / s.pp
    return float(busiest_rank(model, s, seq_len).blocks)


# ---------------------------------------------------------------- helpers of the collectives


def _tp_replicated_params(model: PlanModel, s: Strategy, blocks: float) -> float:
    """Parameters tensor parallelism leaves whole on a rank (of its `blocks`): every norm's
    weight (and bias), and the biases of o_proj and down_proj (row-parallel: added after the reduction)."""
    if model.traced is not None or s.tp <= 1:
        return 0.0
    cfg = model.cfg
    per_norm = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    return (2 * blocks + 1) * per_norm + (2 * blocks * cfg.d_model if cfg.bias else 0)


def _expert_units(model: PlanModel, s: Strategy, blocks: float) -> float:
    """FSDP units of the routed experts on one rank (ep > 1 under FSDP: one per MoE block)."""
    ex = experts_of(model)
    if not (ex and s.ep > 1 and s.dp_strategy in ("zero2", "fsdp", "hsdp")):
        return 0.0
    return ex.layers * blocks / model.cfg.n_layer


def _fsdp_units(model: PlanModel, s: Strategy, blocks: float) -> int:
    """FSDP units of one rank: every block, then the root (a traced module: one unit)."""
    return 1 if model.traced is not None else math.ceil(blocks) + 1


def _root_params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """Parameters of FSDP's root unit on one GPU: embeddings, the final norm and an untied head."""
    if model.traced is not None:
        return _params_per_gpu(model, s)
    pc = param_count(model.cfg)
    return (pc.embedding + pc.head + pc.norm) / (s.tp * s.pp)


# ---------------------------------------------------------------- compute, per operation class


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
class _Speeds:
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


def _speeds(model: PlanModel, s: Strategy, cluster: Cluster, efficiency: float, fit: Fit | None) -> _Speeds:
    dtype = _dtype_key(s)
    r = rates_table.rates(cluster.gpu.generation, fit)
    peak = cluster.peak_flops(dtype)
    dt = _dtypes(s)
    return _Speeds(gemm=peak * _gemm_fraction(cluster, dtype, r) * efficiency,
                   attention=peak * r.attention(attention_kernel(model, s)) * efficiency,
                   bandwidth=cluster.gpu.mem_bw_gbs * 1e9 * r.pointwise * efficiency,
                   rates=r, compute=dt.compute, residual=dt.residual)


def _dtype_key(s: Strategy) -> str:
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


def _block_cost(model: PlanModel, s: Strategy, tokens: float, seq_len: int, sp: _Speeds) -> _BlockCost:
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
    # T x T scores are not kept, as Megatron's selective recompute and plan/memory.py plan it):
    # its batched GEMMs besides the score passes already in pointwise_fwd.
    checkpoint = sp.rates.checkpoint_s
    core = s.attention == "materialized"
    selective = _Work(attention=attention_fwd if core else 0.0, pointwise=pointwise_fwd,
                      ops=pointwise_ops + (attention_gemm_ops if core else 0.0),
                      host=(gemm_ops + pointwise_ops) * sp.rates.selective_dispatch_s + checkpoint)
    return _BlockCost(forward, backward, selective, dataclasses.replace(forward, host=forward.host + checkpoint))


def _head_cost(model: PlanModel, s: Strategy, tokens: float, sp: _Speeds) -> tuple[_Work, _Work]:
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


def _embedding_cost(model: PlanModel, s: Strategy, tokens: float, sp: _Speeds) -> tuple[_Work, _Work]:
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


def _rank_compute(model: PlanModel, s: Strategy, work: Workload, sp: _Speeds) -> list[_RankCompute]:
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


def _hardware_flops_per_token(model: PlanModel, s: Strategy, seq_len: int) -> tuple[float, float]:
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


def estimate_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster,
                  efficiency: float = DEFAULT_EFFICIENCY, fit: Fit | None = None) -> TimeEstimate:
    """Predicted step time, tokens/s, MFU and HFU of `model` laid out as `s` on `cluster`.

    efficiency: a calibration factor that divides the compute's device time (1.0 = the rates of
    plan/efficiency.py; `slipstream tune system` and --calibrate measure it from real runs).
    fit: the per-class constants (efficiency.Fit; default efficiency.FITTED, the fit to the
    published runs); plan/report.py passes its candidates while it fits.
    """
    cfg = model.cfg
    dtype = _dtype_key(s)
    sp = _speeds(model, s, cluster, efficiency, fit)
    tokens_step = work.global_batch * work.seq_len
    if model.traced is not None:
        return _traced_time(model, s, work, cluster, sp, dtype)
    micro_batches = s.grad_accum
    tokens_micro = s.micro_batch * work.seq_len // s.cp
    ranks = _rank_compute(model, s, work, sp)
    busy = max(ranks, key=lambda rc: rc.total)
    compute_s = busy.total
    blocks = _rank_blocks(model, s, work.seq_len)

    out: dict[str, float] = {"compute": compute_s}
    collectives = step_collectives(model, s, work, cluster.stack, cluster.bucket_mb, cluster.overlaps_grad_reduce)  # the bytes every comm term moves
    # ---- pipeline bubble
    if s.pp > 1:
        # idle for a fraction f of the step: compute is (1 - f) of it, the bubble f / (1 - f) x compute
        idle = pipeline_bubble(s.pp_schedule, s.pp, s.pp_virtual, micro_batches)
        out["pp_bubble"] = compute_s * idle / (1.0 - idle)
        p2p_bytes = tokens_micro * cfg.d_model * (2 if s.precision != "fp32" else 4) / (s.tp if s.sequence_parallel else 1)
        link = cluster.link_for(s.pp, s.tp * s.cp * s.dp)
        # one send forward and one backward per micro-batch per stage boundary; the first and last are exposed
        out["pp_p2p"] = 2 * (p2p_bytes / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6) * (s.pp - 1 + s.pp_virtual)

    # ---- tensor parallel: the blocks' collectives (4 activation-sized ring passes per layer and
    # micro-batch), on the critical path. The embedding's, head's and loss's (4 more per
    # micro-batch, ~1/n_layer of these) are counted in step_collectives' bytes but left out of the time.
    if s.tp > 1:
        out["tp_comm"] = collective_time(_rows(collectives, "tp", "blocks"), span(cluster, s.tp, 1))

    # ---- context parallel: K and V all-gathered (backward: reduce-scattered), hidden behind attention
    if s.cp > 1:
        ring = collective_time(_rows(collectives, "cp"), span(cluster, s.cp, s.tp))
        out["cp_comm"] = max(0.0, ring - busy.classes["attention"])

    # ---- expert parallel: all-to-all dispatch and combine, forward and backward (+ recompute),
    # over ep consecutive data-parallel ranks (stride tp x cp); exposed
    ex = experts_of(model)
    if s.ep > 1 and ex:
        out["ep_comm"] = all_to_all_time(_rows(collectives, "ep"), cluster, s.tp * s.cp)
    # ---- MoE token counts: E integers all-reduced over the data-parallel ranks per MoE block,
    # exposed; latency-bound: NCCL's model runs them LL, as a tree across nodes (collectives.py)
    counts = [r for r in collectives if r.part == "router" and r.kind == "all_reduce"]
    if counts:   # the dp (x cp) ranks are tp apart; hsdp's replicas a shard group further
        out["moe_counts"] = sum(
            collective_time([r], span(cluster, r.group, s.tp * (s.cp * s.dp_shard if r.dim == "dp_replicate" else 1)))
            for r in counts)

    # ---- data parallel
    out.update(_data_parallel_time(model, s, cluster, busy.forward, busy.backward, collectives, blocks))

    # ---- optimizer step: memory-bound over this rank's share of the state
    local_params = _optimizer_params_per_gpu(model, s, work.seq_len)
    mem_bw = cluster.gpu.mem_bw_gbs * 1e9
    if s.offload:
        out["offload"] = (local_params * 4 * 2 / (cluster.host_link_gbs * 1e9)
                          + local_params * ADAM_BYTES_PER_PARAM / (HOST_ADAM_GBS * 1e9))
    else:
        out["optimizer"] = local_params * ADAM_BYTES_PER_PARAM / mem_bw

    step = sum(out.values())
    tokens_per_s = tokens_step / step
    peak = cluster.peak_flops(dtype)
    model_flops = flops_per_token(cfg, work.seq_len)
    recompute, kernel = _hardware_flops_per_token(model, s, work.seq_len)
    per_gpu = tokens_per_s / s.world
    classes = busy.classes | {"recompute": busy.recompute}
    return TimeEstimate(step_s=step, tokens_per_s=tokens_per_s, mfu=per_gpu * model_flops / peak, breakdown=out,
                        hfu=per_gpu * (model_flops + recompute) / peak,
                        model_tflops_per_gpu=per_gpu * model_flops / 1e12,
                        hardware_tflops_per_gpu=per_gpu * (model_flops + recompute + kernel) / 1e12,
                        recompute_tflops_per_gpu=per_gpu * (model_flops + recompute) / 1e12, compute_s=classes)


def _traced_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster, sp: _Speeds,
                 dtype: str) -> TimeEstimate:
    """A user module (plan/trace.py): its measured FLOPs at the GEMM rate, its kept activation
    bytes through memory (POINTWISE_TRAFFIC times), a host cost per op (TRACED_OPS per micro-batch:
    its ops are not known) and the data-parallel collectives."""
    t = model.traced
    tokens_step = work.global_batch * work.seq_len
    flops = t.flops_per_token * tokens_step / s.world
    acts = t.activation_bytes_per_sequence["fp32" if s.precision == "fp32" else "bf16"] * work.seq_len / t.seq_len
    device = flops / sp.gemm + acts * s.micro_batch * s.grad_accum * POINTWISE_TRAFFIC / sp.bandwidth
    host = TRACED_OPS * sp.rates.launch_s * s.grad_accum
    compute = max(device, host) if sp.rates.launch_overlaps else device + host
    out = {"compute": compute}
    out.update(_data_parallel_time(model, s, cluster, compute / 3, compute * 2 / 3,
                                   _data_parallel_collectives(model, s, None, cluster.stack, cluster.bucket_mb,
                                                              cluster.overlaps_grad_reduce),
                                   1.0))
    mem_bw = cluster.gpu.mem_bw_gbs * 1e9
    out["optimizer"] = t.n_params / (s.shard_group if s.shards()[0] else 1) * ADAM_BYTES_PER_PARAM / mem_bw
    step = sum(out.values())
    tokens_per_s = tokens_step / step
    per_gpu = tokens_per_s / s.world
    mfu = per_gpu * t.flops_per_token / cluster.peak_flops(dtype)
    return TimeEstimate(step_s=step, tokens_per_s=tokens_per_s, mfu=mfu, breakdown=out, hfu=mfu,
                        model_tflops_per_gpu=per_gpu * t.flops_per_token / 1e12,
                        hardware_tflops_per_gpu=per_gpu * t.flops_per_token / 1e12,
                        recompute_tflops_per_gpu=per_gpu * t.flops_per_token / 1e12)


# A traced module's eager ops per micro-batch (forward + backward): a GPT-2 block's (22 + 92,
# counted as for the transformer above).
TRACED_OPS = 114


def _params_per_gpu(model: PlanModel, s: Strategy, seq_len: int | None = None) -> float:
    """Parameters one GPU holds before data-parallel sharding: TP splits the model, EP the routed
    experts (an MoE layer is not split by tp); under a pipeline the busiest rank's whole blocks,
    the embedding on the first rank and the head and final norm on the last."""
    if model.traced is not None:
        return float(model.traced.n_params)
    cfg = model.cfg
    pc = param_count(cfg)
    ex = experts_of(model)
    ends = pc.embedding + pc.head + _final_norm_params(cfg)
    blocks = pc.total - ends
    if ex:
        moe_mlps = ex.layers * (ex.routed_params + ex.other_params)
        blocks = (blocks - moe_mlps) / s.tp + ex.layers * (ex.other_params + ex.routed_params / s.ep)
    else:
        blocks = blocks / s.tp
    if s.pp <= 1:
        return blocks + ends / s.tp
    if seq_len is None:   # no split known: the average rank
        return (blocks + ends / s.tp) / s.pp
    part = busiest_rank(model, s, seq_len)
    return (blocks * part.blocks / cfg.n_layer + (pc.embedding / s.tp if part.embedding else 0.0)
            + ((pc.head + _final_norm_params(cfg)) / s.tp if part.head else 0.0))


def _final_norm_params(cfg) -> int:
    return cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)


def _expert_params_per_gpu(model: PlanModel, s: Strategy, blocks: float) -> float:
    """The routed-expert parameters of one GPU that data parallelism treats apart: ep > 1 only
    (E / ep per MoE layer, of the rank's `blocks`); with ep = 1 they are part of their blocks."""
    ex = experts_of(model)
    if not (ex and s.ep > 1):
        return 0.0
    return ex.layers * ex.routed_params / s.ep * blocks / model.cfg.n_layer


def _optimizer_params_per_gpu(model: PlanModel, s: Strategy, seq_len: int | None = None) -> float:
    """Parameters whose AdamW update runs on one GPU: its share after data-parallel sharding
    (ep > 1: the routed experts over the dp / ep ranks that hold the same ones)."""
    group = s.shard_group if s.shards()[0] else 1
    total = _params_per_gpu(model, s, seq_len)
    if model.traced is not None:
        return total / group
    experts = _expert_params_per_gpu(model, s, _rank_blocks(model, s, seq_len))
    if not experts:
        return total / group
    return (total - experts) / group + experts / s.expert_shard_group


def _data_parallel_time(model: PlanModel, s: Strategy, cluster: Cluster, forward_s: float,
                        backward_s: float, collectives: list[Collective], blocks: float) -> dict[str, float]:
    """Exposed seconds of the data-parallel collectives (step_collectives' dp rows) per step, for
    a rank of `blocks` blocks (the busiest pp rank) whose compute is forward_s + backward_s."""
    # The time is taken over the data-parallel ranks alone (stride tp x cp), as the published
    # fit (benchmarks/planner-accuracy-cpu.json) was made: the cp ranks folded into the group
    # (step_collectives' `group`) are left out of its ring here, a small under-estimate (a
    # Llama 3 cp16 run: +4 ms of 43.5 s) kept until that benchmark is refitted.
    reduce_scatter = uses_reduce_scatter(s, cluster.stack)
    fsdp = s.dp_strategy in ("zero2", "fsdp", "hsdp") and not reduce_scatter
    group = s.shard_group if fsdp else s.dp
    if s.dp <= 1 or s.dp_strategy == "none":
        return {}
    dp_rows = [dataclasses.replace(r, group=group) for r in _rows(collectives, "dp")
               if r.part in ("parameters", "gradients")]
    where = span(cluster, group, s.tp * s.cp)
    # ep > 1: the routed experts' own collectives, over the dp / ep ranks holding the same ones
    # (the run's dp_mod_ep mesh dim: stride ep x cp x tp)
    expert_rows = _rows(collectives, "dp", "experts")
    expert_where = span(cluster, max(1, s.dp // s.ep), s.ep * s.tp * s.cp) if expert_rows else where
    if not fsdp:
        # The gradients, in the stack's buckets as backward fills them, once per step (no_sync
        # between micro-batches; DeepSpeed ZeRO-2 after every micro-batch): every bucket but the
        # last hides behind the backward of the micro-batch that fills it, the last is exposed.
        # A stack that does not overlap (Cluster.overlaps_grad_reduce: Megatron's and DeepSpeed's
        # defaults) reduces them blocking: every bucket is exposed.
        grads = _rows(dp_rows, "dp", "gradients")[0]
        elem = gradient_dtype_bytes(s, cluster.stack)
        reductions = _reductions(s, cluster.stack)
        overlap = cluster.overlaps_grad_reduce
        buckets = gradient_buckets(grads.nbytes / reductions, elem, cluster.stack, s.dp * s.cp, cluster.bucket_mb,
                                   overlap)
        # thousands of buckets of a few sizes: each size timed once
        hidden = sum(count * call_time(grads.kind, size, where) for size, count in Counter(buckets[:-1]).items())
        experts = sum(collective_time([r], expert_where) for r in expert_rows if r.kind != "all_gather")
        hidden += experts / reductions
        last = call_time(grads.kind, buckets[-1], where) if buckets else 0.0
        exposed = reductions * (last + (max(0.0, hidden - backward_s / s.grad_accum) if overlap else hidden))
        out = {"dp_comm": exposed}
        if reduce_scatter:
            # the updated parameters, gathered in the compute dtype after the optimizer step: exposed
            gather = [r for r in dp_rows if r.kind == "all_gather"]
            out["zero_all_gather"] = (collective_time(gather, where)
                                      + collective_time([r for r in expert_rows if r.kind == "all_gather"],
                                                        expert_where))
        elif s.dp_strategy == "zero1":
            # ZeroRedundancyOptimizer broadcasts each rank's updated shard after step(): exposed.
            out["zero1_broadcast"] = collective_time(_rows(dp_rows, "dp", "parameters"), where)
        return out
    # FSDP family, per micro-batch: all-gather parameters (forward, and again in backward
    # unless zero2) and reduce-scatter the gradients (slipstream keeps gradients sharded, so
    # FSDP reduces after every micro-batch's backward). Under a pipeline the stage keeps its
    # parameters gathered and reduces once, after the last micro-batch (plan/memory.py).
    syncs = 1 if s.pp > 1 else s.grad_accum
    gathers = [r for r in dp_rows if r.kind == "all_gather"]
    gather = collective_time(gathers[:1], where) / syncs                   # forward, one micro-batch
    regather = collective_time(gathers[1:], where) / syncs                 # backward (not zero2)
    scatter = collective_time([r for r in dp_rows if r.kind == "reduce_scatter"], where) / syncs
    units = _fsdp_units(model, s, blocks)
    first_layer = gather / units             # nothing to hide the first gather behind
    if expert_rows:   # the experts' units gather and reduce next to their blocks', behind the same compute
        expert_gathers = [r for r in expert_rows if r.kind == "all_gather"]
        gather += collective_time(expert_gathers[:1], expert_where) / syncs
        regather += collective_time(expert_gathers[1:], expert_where) / syncs
        scatter += collective_time([r for r in expert_rows if r.kind == "reduce_scatter"], expert_where) / syncs
    micro = s.grad_accum
    fwd_s, bwd_s = forward_s / micro, backward_s / micro          # compute of one micro-batch
    if s.pp > 1:
        exposed = max(0.0, gather - fwd_s) + max(0.0, scatter - bwd_s)
    else:
        exposed = (max(0.0, gather - fwd_s) + max(0.0, regather + scatter - bwd_s)) * micro
    # FSDP's host-side work per unit and collective (hooks, copy-in/out) sits on the critical path.
    collectives_per_unit = (1 if s.dp_strategy == "zero2" else 2) + 1
    all_units = units + _expert_units(model, s, blocks)
    overhead = FSDP_UNIT_OVERHEAD_S * all_units * collectives_per_unit * (1 if s.pp > 1 else micro)
    out = {"dp_comm": exposed + first_layer, "fsdp_overhead": overhead}
    replicate = _rows(collectives, "dp_replicate", "gradients")
    if replicate:
        out["dp_replicate_comm"] = collective_time(replicate, span(cluster, replicate[0].group, group * s.tp * s.cp))
    return out
