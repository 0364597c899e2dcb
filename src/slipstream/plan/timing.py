"""Step time of a layout on a cluster, predicted from FLOPs, bytes and links (docs/planner.md).

    step = compute x (1 + pipeline bubble) + exposed communication + optimizer step

compute      matmul FLOPs (models.flops, the one source of truth; + the recomputed forward
             of activation checkpointing) over the achievable matmul rate (datasheet peak x
             the cluster's matmul efficiency, measured by `slipstream probe` when given),
             plus the memory-bound ops (norms, activations, softmax, residual adds): they
             move about three times the block's activation bytes through device memory.
comm         each strategy's exact collective volumes over the link its group crosses,
             ring algorithms (bus bandwidth as nccl-tests defines it) plus a latency per
             ring step. Overlap rules: DDP/zero1 gradient all-reduce hides behind backward
             except the last bucket; FSDP all-gathers and reduce-scatters hide behind the
             block they prefetch for (only what is longer than the compute shows); TP
             collectives sit on the critical path; CP's ring exchange hides behind attention;
             EP's all-to-all and PP's point-to-point sends are exposed.
bubble       1F1B / GPipe (p-1)/m, interleaved (p-1)/(m v), zero-bubble ~0 (Qi et al. 2023).
offload      parameters up and gradients down over the host link, Adam on the CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from slipstream.models.flops import flops_per_token, param_count
from slipstream.plan.hardware import Cluster, Link
from slipstream.plan.memory import block_activation_bytes
from slipstream.plan.space import PlanModel, Strategy, Workload

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


@dataclass
class TimeEstimate:
    step_s: float
    tokens_per_s: float
    mfu: float
    breakdown: dict[str, float] = field(default_factory=dict)   # seconds per component

    def to_record(self) -> dict:
        return {"step_s": self.step_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
                "breakdown_s": {k: round(v, 6) for k, v in self.breakdown.items()}}


def ring_time(nbytes: float, group: int, link: Link, factor: float, steps: int) -> float:
    """Seconds of one ring collective moving `nbytes` (the full buffer) over `link` in `steps`
    ring steps: factor = 2(n-1)/n and 2(n-1) steps for all-reduce, (n-1)/n and n-1 steps for
    all-gather / reduce-scatter (nccl-tests' bus bandwidth)."""
    if group <= 1:
        return 0.0
    return nbytes * factor / (link.bandwidth_gbs * 1e9) + steps * link.latency_us * 1e-6


def all_reduce(nbytes: float, group: int, link: Link) -> float:
    return ring_time(nbytes, group, link, 2 * (group - 1) / max(group, 1), 2 * (group - 1))


def gather_or_scatter(nbytes: float, group: int, link: Link) -> float:
    return ring_time(nbytes, group, link, (group - 1) / max(group, 1), group - 1)


def estimate_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster,
                  efficiency: float = DEFAULT_EFFICIENCY) -> TimeEstimate:
    """Predicted step time, tokens/s and MFU of `model` laid out as `s` on `cluster`.

    efficiency: a calibration factor on the compute rate (1.0 = the cluster's matmul rate;
    `slipstream tune system` and the accuracy report fit it from measured runs).
    """
    cfg = model.cfg
    experts = (model.moe.n_experts, model.moe.top_k) if model.moe else None
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
    pointwise_factor = POINTWISE_TRAFFIC + (1.0 if s.ac != "none" else 0.0)
    pointwise_s = act_bytes * layers_per_gpu * micro_batches * pointwise_factor / mem_bw
    launch_s = KERNELS_PER_LAYER * KERNEL_LAUNCH_S * layers_per_gpu * micro_batches
    compute_s = matmul_s + pointwise_s + launch_s
    forward_s, backward_s = compute_s / 3, compute_s * 2 / 3

    out: dict[str, float] = {"compute": compute_s}
    # ---- pipeline bubble
    if s.pp > 1:
        bubble = (s.pp - 1) / micro_batches
        if s.pp_schedule == "interleaved":
            bubble /= s.pp_virtual
        elif s.pp_schedule == "zero-bubble":
            bubble *= 0.05
        out["pp_bubble"] = compute_s * bubble
        p2p_bytes = tokens_micro * cfg.d_model * (2 if s.precision != "fp32" else 4) / (s.tp if s.sequence_parallel else 1)
        link = cluster.link_for(s.pp, s.tp * s.cp * s.dp)
        # one send forward and one backward per micro-batch per stage boundary; the first and last are exposed
        out["pp_p2p"] = 2 * (p2p_bytes / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6) * (s.pp - 1 + s.pp_virtual)

    # ---- tensor parallel: per layer 2 collectives forward + 2 backward of the block's activations
    if s.tp > 1:
        link = cluster.link_for(s.tp, 1)
        act = tokens_micro * cfg.d_model * (2 if s.precision != "fp32" else 4)
        per_layer = 4 * all_reduce(act, s.tp, link) * (1.5 if s.ac == "full" else 1.0)
        out["tp_comm"] = per_layer * layers_per_gpu * micro_batches

    # ---- context parallel: ring exchange of K and V, hidden behind attention
    if s.cp > 1:
        link = cluster.link_for(s.cp, s.tp)
        kv = 2 * (cfg.n_kv_head or cfg.n_head) * (cfg.d_model // cfg.n_head) * tokens_micro * 2 / s.tp
        ring = (s.cp - 1) * (kv / (link.bandwidth_gbs * 1e9) + link.latency_us * 1e-6) * 3  # fwd + 2x bwd
        attn_s = 12.0 * cfg.d_model * work.seq_len * tokens_micro / s.tp / rate   # attention FLOPs of the layer
        out["cp_comm"] = max(0.0, ring - attn_s) * layers_per_gpu * micro_batches

    # ---- expert parallel: all-to-all dispatch and combine, forward and backward
    if s.ep > 1 and model.moe:
        link = cluster.link_for(s.ep, s.tp * s.cp)
        routed = tokens_micro * cfg.d_model * 2 * model.moe.top_k / (s.tp if s.sequence_parallel else 1)
        out["ep_comm"] = 4 * gather_or_scatter(routed, s.ep, link) * layers_per_gpu * micro_batches

    # ---- data parallel
    out.update(_data_parallel_time(model, s, cluster, forward_s, backward_s))

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
    mfu = tokens_per_s * flops_per_token(cfg, work.seq_len, experts) / (peak * s.world)
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
    out.update(_data_parallel_time(model, s, cluster, compute / 3, compute * 2 / 3))
    out["optimizer"] = t.n_params / (s.shard_group if s.shards()[0] else 1) * ADAM_BYTES_PER_PARAM / mem_bw
    step = sum(out.values())
    tokens_per_s = tokens_step / step
    mfu = tokens_per_s * t.flops_per_token / (cluster.peak_flops(dtype) * s.world)
    return TimeEstimate(step_s=step, tokens_per_s=tokens_per_s, mfu=mfu, breakdown=out)


def _params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """Parameters one GPU holds before data-parallel sharding: TP and PP split the model,
    EP splits the experts."""
    if model.traced is not None:
        return float(model.traced.n_params)
    if not model.moe:
        return param_count(model.cfg).total / (s.tp * s.pp)
    pc = param_count(model.cfg, (model.moe.n_experts, model.moe.top_k))
    experts = model.cfg.n_layer * pc.mlp
    return (pc.total - experts + experts / s.ep) / (s.tp * s.pp)


def _optimizer_params_per_gpu(model: PlanModel, s: Strategy) -> float:
    """Parameters whose AdamW update runs on one GPU: its share after data-parallel sharding
    (experts shard over the dp/ep ranks that hold the same experts)."""
    group = s.shard_group if s.shards()[0] else 1
    total = _params_per_gpu(model, s)
    if not (model.moe and s.ep > 1):
        return total / group
    pc = param_count(model.cfg, (model.moe.n_experts, model.moe.top_k))
    experts = model.cfg.n_layer * pc.mlp / s.ep / (s.tp * s.pp)
    return (total - experts) / group + experts / max(1, group // s.ep)


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
    if model.moe:
        experts_here = model.moe.n_experts / s.ep
        routed = max(1.0, tokens * model.moe.top_k / experts_here / s.ep * s.ep)   # tokens per local expert
        mlp = experts_here * (gemm(routed, d, hidden / tp) * n_up + gemm(routed, hidden / tp, d))
        mlp += gemm(tokens, d, model.moe.n_experts)                              # the router
    else:
        mlp = gemm(tokens, d, hidden / tp) * n_up + gemm(tokens, hidden / tp, d)
    head = gemm(tokens, d, padded_vocab_size(cfg) / tp)
    return attn + mlp, head


def _data_parallel_time(model: PlanModel, s: Strategy, cluster: Cluster, forward_s: float,
                        backward_s: float) -> dict[str, float]:
    """Exposed seconds of the data-parallel collectives per step."""
    if s.dp <= 1 or s.dp_strategy == "none":
        return {}
    params = _params_per_gpu(model, s)
    grad_bytes = params * 4
    low = s.precision != "fp32" and s.fsdp_mixed   # FSDP gathers in bf16 only under its mixed precision
    stride = s.tp * s.cp
    if s.dp_strategy in ("ddp", "zero1"):
        link = cluster.link_for(s.dp, stride)
        # once per step (no_sync between micro-batches), in buckets: one ring's latency each
        buckets = max(1, math.ceil(grad_bytes / DDP_BUCKET_BYTES))
        comm = all_reduce(grad_bytes, s.dp, link) + (buckets - 1) * 2 * (s.dp - 1) * link.latency_us * 1e-6
        exposed = max(0.0, comm - backward_s / s.grad_accum) + DDP_UNHIDDEN * comm
        out = {"dp_comm": exposed}
        if s.dp_strategy == "zero1":
            # ZeroRedundancyOptimizer broadcasts each rank's updated shard after step(): exposed.
            out["zero1_broadcast"] = gather_or_scatter(params * 4, s.dp, link)
        return out
    # FSDP family, per micro-batch: all-gather parameters (forward, and again in backward
    # unless zero2) and reduce-scatter the gradients (slipstream keeps gradients sharded, so
    # FSDP reduces after every micro-batch's backward). Under a pipeline the stage keeps its
    # parameters gathered and reduces once, after the last micro-batch (plan/memory.py).
    shard = s.shard_group
    link = cluster.link_for(shard, stride)
    units = 1 if model.traced is not None else math.ceil(model.cfg.n_layer / s.pp) + 1  # blocks + the root
    # one collective per FSDP unit: its ring latency each time
    unit_latency = (units - 1) * (shard - 1) * link.latency_us * 1e-6 if shard > 1 else 0.0
    gather = gather_or_scatter(params * (2 if low else 4), shard, link) + unit_latency
    scatter = gather_or_scatter(grad_bytes, shard, link) + unit_latency
    micro = s.grad_accum
    fwd_s, bwd_s = forward_s / micro, backward_s / micro          # compute of one micro-batch
    if s.pp > 1:
        exposed = max(0.0, gather - fwd_s) + max(0.0, scatter - bwd_s)
        syncs = 1
    else:
        regather = gather if s.dp_strategy != "zero2" else 0.0     # zero2 keeps them from forward to backward
        exposed = (max(0.0, gather - fwd_s) + max(0.0, regather + scatter - bwd_s)) * micro
        syncs = micro
    first_layer = gather / units             # nothing to hide the first gather behind
    # FSDP's host-side work per unit and collective (hooks, copy-in/out) sits on the critical path.
    collectives = (1 if s.dp_strategy == "zero2" else 2) + 1
    overhead = FSDP_UNIT_OVERHEAD_S * units * collectives * (1 if s.pp > 1 else micro)
    out = {"dp_comm": exposed + first_layer, "fsdp_overhead": overhead}
    if s.dp_strategy == "hsdp":
        replicas = s.dp // shard
        per_sync = all_reduce(grad_bytes / shard, replicas, cluster.link_for(replicas, stride * shard))
        out["dp_replicate_comm"] = per_sync * syncs
    return out
