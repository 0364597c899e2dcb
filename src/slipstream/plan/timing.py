"""Step time of a layout on a cluster, predicted from FLOPs, bytes and links (docs/planner.md).

    step = compute x (1 + pipeline bubble) + exposed communication + optimizer step

compute      matmul FLOPs (models.flops, the one source of truth; + the recomputed forward
             of activation checkpointing) over the achievable matmul rate (datasheet peak x
             the cluster's matmul efficiency, measured by `slipstream probe` when given),
             plus the memory-bound ops (norms, activations, softmax, residual adds): they
             move about three times the block's activation bytes through device memory.
comm         each strategy's exact collective volumes (step_collectives: what slipstream's
             layers issue, the bytes observe.comm counts in a run) over the link its group crosses,
             ring algorithms (bus bandwidth as nccl-tests defines it) plus a latency per
             ring step. Overlap rules: DDP/zero1 gradient all-reduce hides behind backward
             except the last bucket; FSDP all-gathers and reduce-scatters hide behind the
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
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

from slipstream.models.flops import flops_per_token, param_count
from slipstream.plan.collectives import (Collective, _rows, all_reduce, all_to_all_time, bus_factor,  # noqa: F401
                                         collective_time, collectives_by_dim, gather_or_scatter, ring_time)
from slipstream.plan.experts import experts_of
from slipstream.plan.hardware import Cluster, Link
from slipstream.plan.memory import block_activation_bytes
from slipstream.config.dims import PP_ONE_STAGE
from slipstream.plan.space import SCHEDULE_VIRTUAL, ZERO_BUBBLE_SCHEDULES, PlanModel, Strategy, Workload

# A factor on the compute rate: the fraction of the cluster's matmul rate a whole step
# sustains. Fitted to the published runs of plan/published.py by plan/report.fit_efficiency
# (the median |log error| is smallest at 0.87, with the matmul efficiencies of plan/hardware.py).
# The fit is flat: refitted leave-one-run-out it lands anywhere in 0.87-1.00 (docs/planner.md).
DEFAULT_EFFICIENCY = 0.87
# Memory-bound ops read and write the block's activations about this many times per step
# (forward writes them and reads them back; backward reads them and writes their gradients).
POINTWISE_TRAFFIC = 3.0
# Eager PyTorch launches about this many kernels per transformer block per micro-batch
# (forward + backward: matmuls, norms, rope, attention, activations, adds, casts), each with
# a fixed cost on the host; it decides how small a micro-batch can get before it shows.
KERNELS_PER_LAYER = 60
KERNEL_LAUNCH_S = 5e-6
# DDP's gradient bucket (torch's default 25 MiB): one all-reduce, with its latency, per bucket.
DDP_BUCKET_BYTES = 25 * 2**20
# FSDP2's host-side cost per unit and collective (pre/post hooks, copy-in/copy-out of the
# flat buffers): an estimate of tens of microseconds on a GPU host; it is why small models
# run faster with DDP than with FSDP.
FSDP_UNIT_OVERHEAD_S = 50e-6
# Fraction of a DDP all-reduce that cannot hide behind backward: the last bucket.
DDP_UNHIDDEN = 0.1
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
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per component

    def to_record(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "breakdown_s": {k: round(v, 6) for k, v in self.breakdown.items()}}


def step_collectives(model: PlanModel, s: Strategy, work: Workload) -> list[Collective]:
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
    dp (the cp ranks fold into it): DDP and zero1 all-reduce the fp32 gradients once per step
    (25 MiB buckets), zero1 then broadcasts every rank's updated shard; FSDP (zero2, fsdp, hsdp)
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
    """
    cfg = model.cfg
    micro = s.grad_accum
    tokens_micro = s.micro_batch * work.seq_len // s.cp
    layers = cfg.n_layer / s.pp
    elem = 4 if s.precision == "fp32" else 2
    recompute = 1 if s.ac == "full" else 0
    ex = experts_of(model)
    moe_layers = ex.layers / s.pp if ex else 0.0
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

    rows += _data_parallel_collectives(model, s)
    return rows


def _moe_dtypes(s: Strategy) -> tuple[int, int]:
    """Bytes per element of the rows an MoE layer dispatches (its input: the residual stream's
    dtype, fp32 under autocast) and of the experts' outputs it combines (the compute dtype)."""
    low = s.precision != "fp32"
    fsdp_mp = low and s.dp_strategy in ("zero2", "fsdp", "hsdp") and s.fsdp_mixed
    return (2 if fsdp_mp else 4), (2 if low else 4)


def _data_parallel_collectives(model: PlanModel, s: Strategy) -> list[Collective]:
    """The gradient and parameter collectives of step_collectives (see there)."""
    group = s.dp * s.cp  # the cp ranks average gradients with the data-parallel ones
    if s.dp_strategy == "none" or group <= 1:
        return []
    # tp splits the matmuls; the norms and the row-parallel biases stay whole on every tp rank
    params = _params_per_gpu(model, s) + _tp_replicated_params(model, s) * (1 - 1 / s.tp)
    # ep > 1: the routed experts reduce over the dp / ep ranks that hold the same ones (below)
    experts = _expert_params_per_gpu(model, s)
    params -= experts
    grad_bytes = params * 4
    rows = []
    if s.dp_strategy in ("ddp", "zero1"):
        buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
        rows.append(Collective("dp", "all_reduce", "gradients", group, grad_bytes, buckets))
        if s.dp_strategy == "zero1":
            rows.append(Collective("dp", "broadcast", "parameters", group, params * 4, group))  # one per shard
        if experts and group // s.ep > 1:   # ddp with ep < dp (the trainer refuses it): planned as a reduction
            rows.append(Collective("dp", "all_reduce", "experts", group // s.ep, experts * 4,
                                   max(1, math.ceil(experts * 4 / DDP_BUCKET_BYTES))))
        return rows
    shard = (s.dp_shard if s.dp_strategy == "hsdp" else s.dp) * s.cp
    low = s.precision != "fp32" and s.fsdp_mixed   # FSDP gathers in bf16 only under its mixed precision
    gather_elem = 2 if low else 4
    units = _fsdp_units(model, s)
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
        ex_units = experts_of(model).layers / s.pp
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


def _tp_replicated_params(model: PlanModel, s: Strategy) -> float:
    """Parameters tensor parallelism leaves whole on a rank (per pipeline stage): every norm's
    weight (and bias), and the biases of o_proj and down_proj (row-parallel: added after the reduction)."""
    if model.traced is not None or s.tp <= 1:
        return 0.0
    cfg = model.cfg
    per_norm = cfg.d_model * (2 if cfg.norm == "layernorm" and cfg.bias else 1)
    layers = cfg.n_layer / s.pp
    return (2 * layers + 1) * per_norm + (2 * layers * cfg.d_model if cfg.bias else 0)


def _expert_units(model: PlanModel, s: Strategy) -> float:
    """FSDP units of the routed experts on one rank (ep > 1 under FSDP: one per MoE block)."""
    ex = experts_of(model)
    return ex.layers / s.pp if ex and s.ep > 1 and s.dp_strategy in ("zero2", "fsdp", "hsdp") else 0.0


def _fsdp_units(model: PlanModel, s: Strategy) -> int:
    """FSDP units of one rank: every block, then the root (a traced module: one unit)."""
    return 1 if model.traced is not None else math.ceil(model.cfg.n_layer / s.pp) + 1


def _root_params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """Parameters of FSDP's root unit on one GPU: embeddings, the final norm and an untied head."""
    if model.traced is not None:
        return _params_per_gpu(model, s)
    pc = param_count(model.cfg)
    return (pc.embedding + pc.head + pc.norm) / (s.tp * s.pp)


def estimate_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster,
                  efficiency: float = DEFAULT_EFFICIENCY) -> TimeEstimate:
    """Predicted step time, tokens/s and MFU of `model` laid out as `s` on `cluster`.

    efficiency: a calibration factor on the compute rate (1.0 = the cluster's matmul rate;
    `slipstream tune system` and the accuracy report fit it from measured runs).
    """
    cfg = model.cfg
    dtype = "bf16" if s.precision == "bf16" else ("fp16" if s.precision == "fp16" else "tf32")
    rate = cluster.achievable_flops(dtype) * efficiency
    mem_bw = cluster.gpu.mem_bw_gbs * 1e9

    tokens_step = work.global_batch * work.seq_len
    if model.traced is not None:
        return _traced_time(model, s, work, cluster, rate, mem_bw, dtype)
    micro_batches = s.grad_accum
    tokens_micro = s.micro_batch * work.seq_len // s.cp
    layers_per_gpu = cfg.n_layer / s.pp
    elem = 4 if s.precision == "fp32" else 2
    block_fwd, head_fwd = _matmul_seconds(model, s, tokens_micro, work.seq_len, rate, mem_bw, elem)
    # backward runs two matmuls per forward one (input and weight gradients); full activation
    # checkpointing runs each block's forward once more.
    recompute = 1.0 if s.ac == "full" else 0.0
    matmul_s = (layers_per_gpu * block_fwd * (3 + recompute) + head_fwd * 3 / s.pp) * micro_batches

    act_bytes = block_activation_bytes(model, tokens_micro, s.replace(ac="none"))
    ex = experts_of(model)
    if ex:  # the mean block: dense and MoE blocks in the model's proportion
        moe_bytes = block_activation_bytes(model, tokens_micro, s.replace(ac="none"), moe=True)
        act_bytes = ((cfg.n_layer - ex.layers) * act_bytes + ex.layers * moe_bytes) / cfg.n_layer
    pointwise_factor = POINTWISE_TRAFFIC + (1.0 if s.ac != "none" else 0.0)
    pointwise_s = act_bytes * layers_per_gpu * micro_batches * pointwise_factor / mem_bw
    launch_s = KERNELS_PER_LAYER * KERNEL_LAUNCH_S * layers_per_gpu * micro_batches
    compute_s = matmul_s + pointwise_s + launch_s
    forward_s, backward_s = compute_s / 3, compute_s * 2 / 3

    out: dict[str, float] = {"compute": compute_s}
    collectives = step_collectives(model, s, work)  # the bytes every comm term below moves
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
    # micro-batch, ~1/n_layer of these) are counted in step_collectives' bytes but left out of
    # the time, which the efficiency fit of plan/published.py was made with.
    if s.tp > 1:
        out["tp_comm"] = collective_time(_rows(collectives, "tp", "blocks"), cluster.link_for(s.tp, 1))

    # ---- context parallel: K and V all-gathered (backward: reduce-scattered), hidden behind attention
    if s.cp > 1:
        ring = collective_time(_rows(collectives, "cp"), cluster.link_for(s.cp, s.tp))
        attn_s = 12.0 * cfg.d_model * work.seq_len * tokens_micro / s.tp / rate   # attention FLOPs of the layer
        out["cp_comm"] = max(0.0, ring - attn_s * layers_per_gpu * micro_batches)

    # ---- expert parallel: all-to-all dispatch and combine, forward and backward (+ recompute),
    # over ep consecutive data-parallel ranks (stride tp x cp); exposed
    if s.ep > 1 and ex:
        out["ep_comm"] = all_to_all_time(_rows(collectives, "ep"), cluster, s.tp * s.cp)
    # ---- MoE token counts: E integers all-reduced over the data-parallel ranks per MoE block,
    # exposed; latency-bound, so NCCL runs them as a tree: 2 log2(n) steps, not a ring's 2(n - 1)
    counts = [r for r in collectives if r.part == "router" and r.kind == "all_reduce"]
    if counts:   # the dp (x cp) ranks are tp apart; hsdp's replicas a shard group further
        out["moe_counts"] = sum(
            ring_time(r.nbytes, r.group, cluster.link_for(r.group, s.tp * (s.cp * s.dp_shard if r.dim == "dp_replicate" else 1)),
                      bus_factor(r.kind, r.group), 2 * math.ceil(math.log2(r.group)) * r.calls) for r in counts)

    # ---- data parallel
    out.update(_data_parallel_time(model, s, cluster, forward_s, backward_s, collectives))

    # ---- optimizer step: memory-bound over this rank's share of the state
    local_params = _optimizer_params_per_gpu(model, s)
    if s.offload:
        out["offload"] = (local_params * 4 * 2 / (cluster.host_link_gbs * 1e9)
                          + local_params * ADAM_BYTES_PER_PARAM / (HOST_ADAM_GBS * 1e9))
    else:
        out["optimizer"] = local_params * ADAM_BYTES_PER_PARAM / mem_bw

    step = sum(out.values())
    tokens_per_s = tokens_step / step
    peak = cluster.peak_flops(dtype)
    mfu = tokens_per_s * flops_per_token(cfg, work.seq_len) / (peak * s.world)
    return TimeEstimate(step_s=step, tokens_per_s=tokens_per_s, mfu=mfu, breakdown=out)


def _traced_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster, rate: float, mem_bw: float,
                 dtype: str) -> TimeEstimate:
    """A user module (plan/trace.py): its measured FLOPs at the achievable rate, its kept
    activation bytes through memory, kernel launches, and the data-parallel collectives."""
    t = model.traced
    tokens_step = work.global_batch * work.seq_len
    flops = t.flops_per_token * tokens_step / s.world
    acts = t.activation_bytes_per_sequence["fp32" if s.precision == "fp32" else "bf16"] * work.seq_len / t.seq_len
    compute = (flops / rate + acts * s.micro_batch * s.grad_accum * POINTWISE_TRAFFIC / mem_bw
               + KERNELS_PER_LAYER * KERNEL_LAUNCH_S * s.grad_accum)
    out = {"compute": compute}
    out.update(_data_parallel_time(model, s, cluster, compute / 3, compute * 2 / 3,
                                   _data_parallel_collectives(model, s)))
    out["optimizer"] = t.n_params / (s.shard_group if s.shards()[0] else 1) * ADAM_BYTES_PER_PARAM / mem_bw
    step = sum(out.values())
    tokens_per_s = tokens_step / step
    mfu = tokens_per_s * t.flops_per_token / (cluster.peak_flops(dtype) * s.world)
    return TimeEstimate(step_s=step, tokens_per_s=tokens_per_s, mfu=mfu, breakdown=out)


def _params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """Parameters one GPU holds before data-parallel sharding: TP and PP split the model,
    EP splits the routed experts (an MoE layer is not split by tp)."""
    if model.traced is not None:
        return float(model.traced.n_params)
    pc = param_count(model.cfg)
    ex = experts_of(model)
    if not ex:
        return pc.total / (s.tp * s.pp)
    moe_mlps = ex.layers * (ex.routed_params + ex.other_params)
    return ((pc.total - moe_mlps) / s.tp + ex.layers * (ex.other_params + ex.routed_params / s.ep)) / s.pp


def _expert_params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """The routed-expert parameters of one GPU that data parallelism treats apart: ep > 1 only
    (E / ep per MoE layer, per pipeline rank); with ep = 1 they are part of their blocks."""
    ex = experts_of(model)
    return ex.layers * ex.routed_params / s.ep / s.pp if ex and s.ep > 1 else 0.0


def _optimizer_params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """Parameters whose AdamW update runs on one GPU: its share after data-parallel sharding
    (ep > 1: the routed experts over the dp / ep ranks that hold the same ones)."""
    group = s.shard_group if s.shards()[0] else 1
    total = _params_per_gpu(model, s)
    experts = _expert_params_per_gpu(model, s)
    if not experts:
        return total / group
    return (total - experts) / group + experts / s.expert_shard_group


def gemm_seconds(m: float, k: float, n: float, rate: float, mem_bw: float, elem_bytes: int) -> float:
    """One (m x k) @ (k x n) matmul on a roofline: the slower of its FLOPs at the achievable
    rate and its operand bytes at the memory bandwidth (small micro-batches are memory-bound)."""
    return max(2.0 * m * k * n / rate, elem_bytes * (m * k + k * n + m * n) / mem_bw)


def _matmul_seconds(model: PlanModel, s: Strategy, tokens: int, seq_len: int, rate: float, mem_bw: float,
                    elem: int) -> tuple[float, float]:
    """Forward seconds of one block's matmuls (+ attention) and of the output head, for one
    micro-batch of `tokens` tokens on one GPU (tensor parallel splits the output features)."""
    from slipstream.models.transformer import mlp_hidden, padded_vocab_size

    cfg, tp = model.cfg, s.tp
    d, head_dim = cfg.d_model, cfg.d_model // cfg.n_head
    kv = (cfg.n_kv_head or cfg.n_head) * head_dim
    hidden = mlp_hidden(cfg)
    n_up = 2 if cfg.mlp == "swiglu" else 1

    def gemm(m, k, n):
        return gemm_seconds(m, k, n, rate, mem_bw, elem)

    attn = gemm(tokens, d, d / tp) * 2 + gemm(tokens, d, kv / tp) * 2          # q, o (as d x d) and k, v
    # QK^T and AV: 4 T d FLOPs per token (the causal half is counted, as in models.flops)
    attn += 4.0 * tokens * seq_len * d / tp / rate
    mlp = gemm(tokens, d, hidden / tp) * n_up + gemm(tokens, hidden / tp, d)
    ex = experts_of(model)
    if ex:
        # An MoE block, whole on every tp rank: the router, the shared experts on every token, and
        # the E / ep local experts on the k n rows they receive (spread evenly: k n ep / E each).
        # The model's mean block: its dense and MoE blocks in proportion.
        local = max(1, ex.n // s.ep)
        rows = max(1.0, tokens * ex.top_k / local)
        moe = local * (gemm(rows, d, ex.hidden) * n_up + gemm(rows, ex.hidden, d)) + gemm(tokens, d, ex.n)
        if ex.shared_hidden:
            moe += gemm(tokens, d, ex.shared_hidden) * n_up + gemm(tokens, ex.shared_hidden, d)
        mlp = ((cfg.n_layer - ex.layers) * mlp + ex.layers * moe) / cfg.n_layer
    head = gemm(tokens, d, padded_vocab_size(cfg) / tp)
    return attn + mlp, head


def _data_parallel_time(model: PlanModel, s: Strategy, cluster: Cluster, forward_s: float,
                        backward_s: float, collectives: list[Collective]) -> dict[str, float]:
    """Exposed seconds of the data-parallel collectives (step_collectives' dp rows) per step."""
    # The time is taken over the data-parallel ranks alone (stride tp x cp), as the published
    # fit (benchmarks/planner-accuracy-cpu.json) was made: the cp ranks folded into the group
    # (step_collectives' `group`) are left out of its ring here, a small under-estimate (a
    # Llama 3 cp16 run: +4 ms of 43.5 s) kept until that benchmark is refitted.
    group = s.shard_group if s.dp_strategy in ("zero2", "fsdp", "hsdp") else s.dp
    if s.dp <= 1 or s.dp_strategy == "none":
        return {}
    dp_rows = [dataclasses.replace(r, group=group) for r in _rows(collectives, "dp")
               if r.part in ("parameters", "gradients")]
    link = cluster.link_for(group, s.tp * s.cp)
    # ep > 1: the routed experts' own collectives, over the dp / ep ranks holding the same ones
    # (the run's dp_mod_ep mesh dim: stride ep x cp x tp)
    expert_rows = _rows(collectives, "dp", "experts")
    expert_link = cluster.link_for(max(1, s.dp // s.ep), s.ep * s.tp * s.cp) if expert_rows else link
    if s.dp_strategy in ("ddp", "zero1"):
        # once per step (no_sync between micro-batches), in buckets: one ring's latency each
        comm = collective_time(_rows(dp_rows, "dp", "gradients"), link) + collective_time(expert_rows, expert_link)
        exposed = max(0.0, comm - backward_s / s.grad_accum) + DDP_UNHIDDEN * comm
        out = {"dp_comm": exposed}
        if s.dp_strategy == "zero1":
            # ZeroRedundancyOptimizer broadcasts each rank's updated shard after step(): exposed.
            out["zero1_broadcast"] = gather_or_scatter(_rows(dp_rows, "dp", "parameters")[0].nbytes, group, link)
        return out
    # FSDP family, per micro-batch: all-gather parameters (forward, and again in backward
    # unless zero2) and reduce-scatter the gradients (slipstream keeps gradients sharded, so
    # FSDP reduces after every micro-batch's backward). Under a pipeline the stage keeps its
    # parameters gathered and reduces once, after the last micro-batch (plan/memory.py).
    syncs = 1 if s.pp > 1 else s.grad_accum
    gathers = [r for r in dp_rows if r.kind == "all_gather"]
    gather = collective_time(gathers[:1], link) / syncs                    # forward, one micro-batch
    regather = collective_time(gathers[1:], link) / syncs                  # backward (not zero2)
    scatter = collective_time([r for r in dp_rows if r.kind == "reduce_scatter"], link) / syncs
    units = _fsdp_units(model, s)
    first_layer = gather / units             # nothing to hide the first gather behind
    if expert_rows:   # the experts' units gather and reduce next to their blocks', behind the same compute
        expert_gathers = [r for r in expert_rows if r.kind == "all_gather"]
        gather += collective_time(expert_gathers[:1], expert_link) / syncs
        regather += collective_time(expert_gathers[1:], expert_link) / syncs
        scatter += collective_time([r for r in expert_rows if r.kind == "reduce_scatter"], expert_link) / syncs
    micro = s.grad_accum
    fwd_s, bwd_s = forward_s / micro, backward_s / micro          # compute of one micro-batch
    if s.pp > 1:
        exposed = max(0.0, gather - fwd_s) + max(0.0, scatter - bwd_s)
    else:
        exposed = (max(0.0, gather - fwd_s) + max(0.0, regather + scatter - bwd_s)) * micro
    # FSDP's host-side work per unit and collective (hooks, copy-in/out) sits on the critical path.
    collectives_per_unit = (1 if s.dp_strategy == "zero2" else 2) + 1
    all_units = units + _expert_units(model, s)
    overhead = FSDP_UNIT_OVERHEAD_S * all_units * collectives_per_unit * (1 if s.pp > 1 else micro)
    out = {"dp_comm": exposed + first_layer, "fsdp_overhead": overhead}
    replicate = _rows(collectives, "dp_replicate", "gradients")
    if replicate:
        out["dp_replicate_comm"] = collective_time(replicate, cluster.link_for(replicate[0].group,
                                                                               group * s.tp * s.cp))
    return out
