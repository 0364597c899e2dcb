"""Step time of a layout on a cluster, predicted from FLOPs, bytes and links (docs/planner.md).

    step = compute x (1 + pipeline bubble) + exposed communication + optimizer step

compute      per operation class, each at its own achievable rate, on the busiest pipeline
             rank: plan/timing_compute.py. `efficiency` divides the device time: a calibration
             measured by `slipstream tune system` / --calibrate (1 = the fitted rates).
comm         each strategy's exact collective volumes over the links its group crosses, as
             NCCL runs each call, and what of them the compute hides: plan/timing_comm.py.
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

from dataclasses import dataclass, field

from slipstream.config.dims import PP_ONE_STAGE
from slipstream.models.flops import flops_per_token
from slipstream.plan.collectives import all_to_all_time, collective_time, rows_of, span
from slipstream.plan.efficiency import Fit
from slipstream.plan.experts import experts_of
from slipstream.plan.hardware import Cluster
from slipstream.plan.space import SCHEDULE_VIRTUAL, ZERO_BUBBLE_SCHEDULES, PlanModel, Strategy, Workload
from slipstream.plan.timing_comm import data_parallel_collectives, data_parallel_time, step_collectives
from slipstream.plan.timing_compute import (Speeds, achievable_speeds, hardware_flops_per_token, rank_compute,
                                            strategy_dtype_key)
from slipstream.plan.timing_ranks import optimizer_params_per_gpu, rank_blocks

# A calibration factor on the compute rates, 1 = the rates of plan/efficiency.py (fitted to the
# published runs per operation class). `slipstream tune system` and --calibrate measure it for a
# machine: the measured / predicted throughput of real runs.
DEFAULT_EFFICIENCY = 1.0
# A traced user module (plan/trace.py) has no known op structure: its kept activations are read
# and written about this many times per step (forward writes them and reads them back; backward
# reads them and writes their gradients).
POINTWISE_TRAFFIC = 3.0
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


def estimate_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster,
                  efficiency: float = DEFAULT_EFFICIENCY, fit: Fit | None = None) -> TimeEstimate:
    """Predicted step time, tokens/s, MFU and HFU of `model` laid out as `s` on `cluster`.

    efficiency: a calibration factor that divides the compute's device time (1.0 = the rates of
    plan/efficiency.py; `slipstream tune system` and --calibrate measure it from real runs).
    fit: the per-class constants (efficiency.Fit; default efficiency.FITTED, the fit to the
    published runs); plan/report.py passes its candidates while it fits.
    """
    cfg = model.cfg
    dtype = strategy_dtype_key(s)
    sp = achievable_speeds(model, s, cluster, efficiency, fit)
    tokens_step = work.global_batch * work.seq_len
    if model.traced is not None:
        return _traced_time(model, s, work, cluster, sp, dtype)
    micro_batches = s.grad_accum
    tokens_micro = s.micro_batch * work.seq_len // s.cp
    ranks = rank_compute(model, s, work, sp)
    busy = max(ranks, key=lambda rc: rc.total)
    compute_s = busy.total
    blocks = rank_blocks(model, s, work.seq_len)

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
        out["tp_comm"] = collective_time(rows_of(collectives, "tp", "blocks"), span(cluster, s.tp, 1))

    # ---- context parallel: K and V all-gathered (backward: reduce-scattered), hidden behind attention
    if s.cp > 1:
        ring = collective_time(rows_of(collectives, "cp"), span(cluster, s.cp, s.tp))
        out["cp_comm"] = max(0.0, ring - busy.classes["attention"])

    # ---- expert parallel: all-to-all dispatch and combine, forward and backward (+ recompute),
    # over ep consecutive data-parallel ranks (stride tp x cp); exposed
    ex = experts_of(model)
    if s.ep > 1 and ex:
        out["ep_comm"] = all_to_all_time(rows_of(collectives, "ep"), cluster, s.tp * s.cp)
    # ---- MoE token counts: E integers all-reduced over the data-parallel ranks per MoE block,
    # exposed; latency-bound: NCCL's model runs them LL, as a tree across nodes (collectives.py)
    counts = [r for r in collectives if r.part == "router" and r.kind == "all_reduce"]
    if counts:   # the dp (x cp) ranks are tp apart; hsdp's replicas a shard group further
        out["moe_counts"] = sum(
            collective_time([r], span(cluster, r.group, s.tp * (s.cp * s.dp_shard if r.dim == "dp_replicate" else 1)))
            for r in counts)

    # ---- data parallel
    out.update(data_parallel_time(model, s, cluster, busy.forward, busy.backward, collectives, blocks))

    # ---- optimizer step: memory-bound over this rank's share of the state
    local_params = optimizer_params_per_gpu(model, s, work.seq_len)
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
    recompute, kernel = hardware_flops_per_token(model, s, work.seq_len)
    per_gpu = tokens_per_s / s.world
    classes = busy.classes | {"recompute": busy.recompute}
    return TimeEstimate(step_s=step, tokens_per_s=tokens_per_s, mfu=per_gpu * model_flops / peak, breakdown=out,
                        hfu=per_gpu * (model_flops + recompute) / peak,
                        model_tflops_per_gpu=per_gpu * model_flops / 1e12,
                        hardware_tflops_per_gpu=per_gpu * (model_flops + recompute + kernel) / 1e12,
                        recompute_tflops_per_gpu=per_gpu * (model_flops + recompute) / 1e12, compute_s=classes)


def _traced_time(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster, sp: Speeds,
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
    out.update(data_parallel_time(model, s, cluster, compute / 3, compute * 2 / 3,
                                  data_parallel_collectives(model, s, None, cluster.stack, cluster.bucket_mb,
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
