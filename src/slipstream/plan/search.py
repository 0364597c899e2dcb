"""Search the layouts of a model on a cluster: evaluate each, keep what fits, rank by speed.

    result = plan(model, cluster, Workload(seq_len=8192, global_batch=1024))
    result.ranked[0]        # the fastest layout that fits, with its memory and time
    result.rejected         # (layout, why it does not fit), fastest first

The space: tensor parallel within a node (divisors of the heads), pipeline degree (with
its schedule: 1F1B and interleaved-1F1B by default, any schedule the trainer runs on request,
e.g. gpipe or zbv), context parallel for long sequences, expert parallel for a mixture of
experts (degrees that divide its experts and the data-parallel degree), every
data-parallel strategy, every micro-batch that divides the global batch, activation
checkpointing none/selective/full, the fused loss, and CPU offload for FSDP.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from slipstream.models.transformer import mlp_hidden, padded_vocab_size
from slipstream.errors import UserError
from slipstream.plan.hardware import Cluster
from slipstream.plan.memory import GIB, MemoryEstimate, estimate_memory
from slipstream.plan.space import AC_MODES, SCHEDULE_VIRTUAL, PlanModel, Strategy, Workload, schedule_name
from slipstream.plan.timing import TimeEstimate, estimate_time

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_TP = 8


@dataclass
class Candidate:
    strategy: Strategy
    memory: MemoryEstimate
    time: TimeEstimate
    fits: bool
    why_not: str = ""                                   # the binding constraint when it does not fit
    not_runnable: list[str] = field(default_factory=list)  # what slipstream cannot run yet

    def to_record(self) -> dict:
        return {"layout": self.strategy.label(), "strategy": _strategy_record(self.strategy),
                "fits": self.fits, "why_not": self.why_not, "runnable": not self.not_runnable,
                "not_runnable": self.not_runnable, "memory": self.memory.to_record(), "time": self.time.to_record()}


@dataclass
class PlanResult:
    model: PlanModel
    cluster: Cluster
    workload: Workload
    ranked: list[Candidate]
    rejected: list[Candidate]
    evaluated: int

    def best(self, runnable_only: bool = False) -> Candidate | None:
        for c in self.ranked:
            if not runnable_only or not c.not_runnable:
                return c
        return None


def _strategy_record(s: Strategy) -> dict:
    import dataclasses

    return dataclasses.asdict(s)


def _divisors(n: int, limit: int) -> list[int]:
    return [d for d in range(1, min(n, limit) + 1) if n % d == 0]


def layouts(model: PlanModel, cluster: Cluster, work: Workload, *, dp_strategies: tuple[str, ...] | None = None,
            tp: tuple[int, ...] | None = None, pp: tuple[int, ...] | None = None, cp: tuple[int, ...] | None = None,
            ac: tuple[str, ...] | None = None, micro_batches: tuple[int, ...] | None = None,
            pp_schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b"),
            precision: str = "bf16", runnable_only: bool = False) -> list[Strategy]:
    """Every layout worth evaluating (the constraints each parallelism puts on the shapes)."""
    cfg, world = model.cfg, cluster.world
    kv = cfg.n_kv_head or cfg.n_head
    # What the run's tensor-parallel plan splits evenly: heads, KV heads, the MLP width, the padded
    # vocabulary, and the sequence (sequence parallel, which the planner always uses with tp).
    tp_options = tp or tuple(t for t in _divisors(cluster.gpus_per_node, MAX_TP)
                             if cfg.n_head % t == 0 and kv % t == 0 and mlp_hidden(cfg) % t == 0
                             and (cfg.vocab_size <= 0 or padded_vocab_size(cfg) % t == 0) and work.seq_len % t == 0)
    pp_options = pp or tuple(p for p in (1, 2, 4, 8, 16, 32) if p <= cfg.n_layer and p <= world)
    cp_options = cp or tuple(c for c in (1, 2, 4, 8, 16) if c == 1 or work.seq_len >= 8192 * c // 2)
    ep_options = (1,) if not model.moe else tuple(e for e in (1, 2, 4, 8, 16, 32, 64)
                                                  if cfg.moe_experts % e == 0)
    ac_options = ac or AC_MODES
    mb_options = micro_batches or MICRO_BATCHES
    schedules = tuple(dict.fromkeys(schedule_name(name) for name in pp_schedules))
    if model.traced is not None:
        tp_options = (1,)  # a user module has no tensor-parallel plan
        pp_options = (1,)  # and the trainer pipelines slipstream transformers only
    if model.traced is not None:
        cp_options = (1,)  # a user module's attention is unknown
    if model.traced is not None:
        ac_options = ("none",)   # a user module has no known blocks to checkpoint
    out = []
    for t, p, c, e in itertools.product(tp_options, pp_options, cp_options, ep_options):
        if world % (t * p * c):
            continue
        # Context parallel cuts every sequence into 2 x cp load-balanced chunks, and sequence
        # parallel (always on with tp here) splits each chunk over tp again.
        if c > 1 and work.seq_len % (2 * c * t):
            continue
        dp = world // (t * p * c)
        if dp % e:   # the ep ranks are data-parallel ranks
            continue
        # The cp ranks average their gradients like data-parallel ranks, so cp needs a
        # data-parallel strategy even when dp is 1 (the run's FSDP / DDP spans the cp ranks).
        replicated = dp > 1 or c > 1
        strategies = dp_strategies or (("ddp", "zero1", "zero2", "fsdp", "hsdp") if replicated else ("none",))
        for dp_strategy in strategies:
            if replicated == (dp_strategy == "none"):
                continue
            if precision == "fp16" and dp_strategy in ("zero2", "fsdp", "hsdp"):
                continue  # fp16 needs loss scaling, which slipstream runs with autocast (none/ddp/zero1) only
            shard = 0
            if dp_strategy == "hsdp":
                shard = cluster.gpus_per_node // (t * c) if cluster.gpus_per_node % (t * c) == 0 else 0
                if cluster.nodes == 1 or shard <= 1 or dp % shard or dp == shard:
                    continue
            for mb in mb_options:
                if work.global_batch % (dp * mb):
                    continue
                accum = work.global_batch // (dp * mb)
                for a in ac_options:
                    for offload, schedule in itertools.product(
                            (False, True) if dp_strategy in ("fsdp", "hsdp") else (False,),
                            schedules if p > 1 else ("1f1b",)):
                        # v stages per rank: the planner keeps them even (layers divisible by v p)
                        virtual = SCHEDULE_VIRTUAL[schedule]
                        if virtual > 1 and cfg.n_layer % (virtual * p):
                            continue
                        base = Strategy(dp_strategy=dp_strategy, dp=dp, dp_shard=shard, tp=t, pp=p, cp=c, ep=e,
                                        micro_batch=mb, grad_accum=accum, ac=a, precision=precision,
                                        offload=offload, pp_schedule=schedule, pp_virtual=virtual)
                        candidates = [base] + ([base.replace(fused_loss=True)] if model.traced is None else [])
                        out.extend(c for c in candidates if not (runnable_only and c.not_runnable()))
    return out


def evaluate(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster, efficiency: float = 1.0,
             device: str = "cuda") -> Candidate:
    memory = estimate_memory(model, s, work.seq_len, device=device)
    time = estimate_time(model, s, work, cluster, efficiency=efficiency)
    fits = memory.total_bytes <= cluster.memory_bytes
    why = "" if fits else (f"needs {memory.total_bytes / GIB:.1f} GiB > {cluster.memory_bytes / GIB:.1f} GiB "
                           f"per GPU ({_largest(memory)})")
    reasons = s.not_runnable() + _model_reasons(model, s)
    stages = s.pp * s.pp_virtual
    if s.pp > 1 and (model.traced is not None or stages > model.cfg.n_layer):
        reasons.append(f"pipeline parallel {s.pp}: {stages} stages for "
                       + ("a user module" if model.traced is not None else f"{model.cfg.n_layer} blocks"))
    return Candidate(s, memory, time, fits, why, reasons)


def _model_reasons(model: PlanModel, s: Strategy) -> list[str]:
    """What the trainer refuses for this model in this layout (config.load's model rules)."""
    cfg, reasons = model.cfg, []
    if s.ep > 1 and not model.moe:
        reasons.append(f"expert parallel {s.ep} without experts")
    elif s.ep > 1 and cfg.moe_experts % s.ep:
        reasons.append(f"expert parallel {s.ep}: {cfg.moe_experts} experts do not split evenly")
    if model.moe and s.precision == "fp16" and (cfg.moe_aux_loss or cfg.moe_z_loss):
        reasons.append("fp16 loss scaling with the MoE balancing losses")
    return reasons


def _largest(memory: MemoryEstimate) -> str:
    name, value = max(memory.breakdown.items(), key=lambda kv: kv[1])
    return f"largest: {name.replace('_', ' ')} {value / GIB:.1f} GiB"


def plan(model: PlanModel, cluster: Cluster, work: Workload, *, efficiency: float = 1.0,
         runnable_only: bool = False, **space) -> PlanResult:
    """Evaluate every layout; feasible ones ranked by predicted tokens/s (ties: less memory)."""
    if model.traced is None and work.seq_len > model.cfg.max_seq_len and model.cfg.position == "learned":
        raise UserError(f"--seq {work.seq_len} is longer than the model's learned position table "
                        f"({model.cfg.max_seq_len}); plan a shorter sequence or a model with max_seq_len >= {work.seq_len}.")
    device = "cpu" if cluster.short_name == "cpu" else "cuda"
    candidates = [evaluate(model, s, work, cluster, efficiency, device)
                  for s in layouts(model, cluster, work, runnable_only=runnable_only, **space)]
    if runnable_only:  # the model's own refusals too (evaluate's), beyond the layout's
        candidates = [c for c in candidates if not c.not_runnable]
    if not candidates:
        reason = _no_layout_reason(model, cluster, work)
        if space.get("precision") == "fp16":
            reason += (" Note: fp16 is planned only with none, ddp and zero1 (its loss scaling runs through "
                       "autocast); use --precision bf16 for the FSDP family.")
        raise UserError(reason)
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (-c.time.tokens_per_s, c.memory.total_bytes))
    rejected = sorted((c for c in candidates if not c.fits), key=lambda c: -c.time.tokens_per_s)
    return PlanResult(model, cluster, work, fitting, rejected, len(candidates))


def _no_layout_reason(model: PlanModel, cluster: Cluster, work: Workload) -> str:
    world = cluster.world
    return (f"no layout divides the work: global batch {work.global_batch} must be a multiple of the "
            f"data-parallel degree times the micro-batch, and the {world} GPUs must factor into "
            f"tensor x pipeline x context x data parallel degrees that the model's {model.cfg.n_head} heads "
            f"and {model.cfg.n_layer} layers allow. Try a global batch that is a multiple of {world}.")


def explain_infeasible(result: PlanResult) -> str:
    """Why nothing fits: the smallest layout and the constraint it still breaks."""
    smallest = min(result.rejected, key=lambda c: c.memory.total_bytes)
    b = smallest.memory.breakdown
    states = b["parameters"] + b["gradients"] + b["optimizer_state"]
    usable = result.cluster.memory_bytes
    text = (f"nothing fits in {usable / GIB:.1f} GiB per GPU. The leanest layout ({smallest.strategy.label()}) "
            f"still needs {smallest.memory.total_bytes / GIB:.1f} GiB: model states {states / GIB:.1f} GiB, "
            f"activations {b['activations'] / GIB:.1f} GiB, temporaries {b['temporaries'] / GIB:.1f} GiB.")
    if states > usable:
        text += " The model states alone do not fit: add GPUs (--nodes) or a GPU with more memory."
    else:
        text += " Shorten the sequence, or add GPUs so the activations split further."
    return text
