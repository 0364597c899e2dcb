"""The collectives of one training step and the seconds of them the compute does not hide:
step_collectives (the bytes each parallel dim moves, as observe.comm counts them in a run) and
the data-parallel terms of the step time. Apart from the compute (plan/timing_compute.py) and
the step's assembly (plan/timing.py), which times the tp, cp, ep and pp terms from these rows.

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
"""

from __future__ import annotations

import dataclasses
import math
from collections import Counter

from slipstream.models.flops import param_count
from slipstream.plan.collectives import Collective, call_time, collective_time, rows_of, span
from slipstream.plan.experts import experts_of
from slipstream.plan.hardware import Cluster
from slipstream.plan.space import PlanModel, Strategy, Workload
from slipstream.plan.timing_ranks import expert_params_per_gpu, params_per_gpu, rank_blocks

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
    layers = rank_blocks(model, s, work.seq_len)
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

    rows += data_parallel_collectives(model, s, work.seq_len, stack, bucket_mb, overlap)
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


def data_parallel_collectives(model: PlanModel, s: Strategy, seq_len: int | None, stack: str = "torch",
                              bucket_mb: float | None = None, overlap: bool = True) -> list[Collective]:
    """The gradient and parameter collectives of step_collectives (see there)."""
    group = s.dp * s.cp  # the cp ranks average gradients with the data-parallel ones
    if s.dp_strategy == "none" or group <= 1:
        return []
    # tp splits the matmuls; the norms and the row-parallel biases stay whole on every tp rank
    blocks = rank_blocks(model, s, seq_len) if model.traced is None else 1.0
    params = params_per_gpu(model, s, seq_len) + _tp_replicated_params(model, s, blocks) * (1 - 1 / s.tp)
    # ep > 1: the routed experts reduce over the dp / ep ranks that hold the same ones (below)
    experts = expert_params_per_gpu(model, s, blocks) if model.traced is None else 0.0
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
        return params_per_gpu(model, s)
    pc = param_count(model.cfg)
    return (pc.embedding + pc.head + pc.norm) / (s.tp * s.pp)


def data_parallel_time(model: PlanModel, s: Strategy, cluster: Cluster, forward_s: float,
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
    dp_rows = [dataclasses.replace(r, group=group) for r in rows_of(collectives, "dp")
               if r.part in ("parameters", "gradients")]
    where = span(cluster, group, s.tp * s.cp)
    # ep > 1: the routed experts' own collectives, over the dp / ep ranks holding the same ones
    # (the run's dp_mod_ep mesh dim: stride ep x cp x tp)
    expert_rows = rows_of(collectives, "dp", "experts")
    expert_where = span(cluster, max(1, s.dp // s.ep), s.ep * s.tp * s.cp) if expert_rows else where
    if not fsdp:
        # The gradients, in the stack's buckets as backward fills them, once per step (no_sync
        # between micro-batches; DeepSpeed ZeRO-2 after every micro-batch): every bucket but the
        # last hides behind the backward of the micro-batch that fills it, the last is exposed.
        # A stack that does not overlap (Cluster.overlaps_grad_reduce: Megatron's and DeepSpeed's
        # defaults) reduces them blocking: every bucket is exposed.
        grads = rows_of(dp_rows, "dp", "gradients")[0]
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
            out["zero1_broadcast"] = collective_time(rows_of(dp_rows, "dp", "parameters"), where)
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
    replicate = rows_of(collectives, "dp_replicate", "gradients")
    if replicate:
        out["dp_replicate_comm"] = collective_time(replicate, span(cluster, replicate[0].group, group * s.tp * s.cp))
    return out
