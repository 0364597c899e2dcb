"""Search the layouts of a model on a cluster: evaluate each, keep what fits, rank by speed.

    result = plan(model, cluster, Workload(seq_len=8192, global_batch=1024))
    result.ranked[0]        # the fastest layout that fits, with its memory and time
    result.rejected         # (layout, why it does not fit), fastest first
    plan_layout(model, cluster, work, parse_layout("zero1:8 tp4 pp12 mb2", ...))   # one pinned layout

The space: every degree is a divisor (none is limited to powers of two), world = tp x pp x cp x dp:
- tensor parallel within a node: the divisors of the GPUs per node up to 8 that divide the heads, KV
  heads, MLP width and padded vocabulary; each with and without sequence parallel (with it the
  sequence divides by tp);
- pipeline: every divisor of the GPUs up to the model's layers, in whole-block stages (the trainer's
  balanced split, plan/stages.split_layers, unless pp_layers pins one); schedules 1F1B and
  interleaved-1F1B by default, any schedule the trainer runs on request; the looping schedules with
  2 chunks per rank, and the largest chunk count up to MAX_VIRTUAL that splits the layers evenly
  (pp x v divides n_layer), or the counts asked for (pp_virtual); always pp x v <= n_layer;
- context parallel for long sequences: divisors c of the GPUs with seq >= CP_MIN_TOKENS x c whose
  sequence splits into 2c chunks (times tp with sequence parallel);
- expert parallel (mixture of experts): divisors of the experts that divide the data-parallel degree;
- data parallel: what is left, world / (tp pp cp), with every strategy (hsdp across nodes, a node's
  ranks as its shard group);
- micro-batches: powers of two up to 128 where dp x micro-batch divides the global batch (the rest is
  accumulation); activation checkpointing none / selective / full; the fused loss on and off; CPU
  offload for the FSDP family.

Pruning (each rule is widened by the option named). Measured on a 530B-like model (105 layers, d
20480, 128 heads, seq 2048, global batch 1920) on 280 nodes x 8 A100: 14,364 layouts, 3,478 of them
evaluated, plan() 3.7-11 s on 2 loaded AMD EPYC cores (1-3 ms per layout: the estimators' time):
- the degrees are combined and checked first (tp x pp x cp x ep x sequence parallel: a few hundred
  combinations at most), and only the combinations that divide the GPUs, the model and the batch
  are multiplied out into layouts;
- micro-batches are powers of two (`micro_batches` asks for others);
- chunks per rank: at most two counts per pipeline degree, as above (`pp_virtual`); schedules: 1F1B
  and interleaved-1F1B (`pp_schedules`);
- context parallel only for long sequences (`cp` pins degrees);
- plan() evaluates the twins of a layout that differ only in the memory levers (checkpointing
  full / selective / none, CPU offload, the fused loss) leanest first, and skips a twin that needs
  at least as much of every lever as one that does not fit (it cannot fit: the memory model is
  monotone in each lever), and an offload twin of a layout that fits without offload (offload only
  saves memory and costs time: it cannot rank above it). So `rejected` holds the leanest twins of
  what does not fit, and `evaluated` counts the layouts evaluated.
When nothing is left, the error names the constraint that binds (why_no_layout): the batch (with
the reachable data-parallel degrees and the nearest global batches that work), the heads, the
layers, the sequence, the experts, or what slipstream cannot run (with --runnable-only).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass, field

from slipstream.config.dims import PP_ONE_STAGE, PP_V_SHAPED
from slipstream.models.transformer import mlp_hidden, padded_vocab_size
from slipstream.errors import UserError
from slipstream.plan.hardware import Cluster
from slipstream.plan.memory import GIB, MemoryEstimate, estimate_memory
from slipstream.plan.memory_states import StackStates
from slipstream.plan.space import (AC_MODES, DP_STRATEGIES, PRECISIONS, PlanModel, Strategy, Workload,
                                   schedule_name)
from slipstream.plan.timing import TimeEstimate, estimate_time

MICRO_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128)
MAX_TP = 8
# Chunks per pipeline rank the looping schedules are searched with by default: 2, and the most (up to
# this) that split the layers evenly (the smallest bubble); others on request (pp_virtual).
MAX_VIRTUAL = 8
# Context parallel is searched for sequences of at least this many tokens per cp rank (8K at cp 2).
CP_MIN_TOKENS = 4096
# The order the no-layout error names the constraints in (fp16 on the FSDP family first: its fix is
# a flag, and it is what a --precision fp16 --runnable-only search most often hits).
CONSTRAINTS = ("fp16", "batch", "heads", "layers", "sequence", "experts", "tensor", "degrees", "strategy")


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


def _divisors(n: int, limit: int | None = None) -> list[int]:
    return [d for d in range(1, min(n, limit or n) + 1) if n % d == 0]


@dataclass
class _Degrees:
    """One combination of parallel degrees, and every constraint it breaks (kind, why)."""
    tp: int
    pp: int
    cp: int
    ep: int
    sequence_parallel: bool
    dp: int = 0                                                  # 0: tp x pp x cp does not divide the GPUs
    faults: list[tuple[str, str]] = field(default_factory=list)
    stages: list[tuple[str, int]] = field(default_factory=list)  # (schedule, chunks per rank) the layers allow
    strategies: list[tuple[str, int]] = field(default_factory=list)  # (dp strategy, hsdp shard)
    micro_batches: list[int] = field(default_factory=list)


def _choices(value, name: str, allowed: tuple) -> tuple:
    """on / off / both (or a tuple of booleans) as the booleans to search."""
    if isinstance(value, str):
        if value not in ("on", "off", "both"):
            raise UserError(f"{name} is on, off or both, got {value!r}")
        return {"on": (True,), "off": (False,), "both": allowed}[value]
    return tuple(value)


class SearchSpace:
    """The options of one search (None: the default, see the module doc) and the degrees they allow."""

    def __init__(self, model: PlanModel, cluster: Cluster, work: Workload, *,
                 dp_strategies: tuple[str, ...] | None = None, tp: tuple[int, ...] | None = None,
                 pp: tuple[int, ...] | None = None, cp: tuple[int, ...] | None = None,
                 ep: tuple[int, ...] | None = None, ac: tuple[str, ...] | None = None,
                 micro_batches: tuple[int, ...] | None = None,
                 pp_schedules: tuple[str, ...] = ("1f1b", "interleaved-1f1b"),
                 pp_virtual: tuple[int, ...] | None = None, pp_layers: tuple[int, ...] | None = None,
                 sequence_parallel: str | tuple[bool, ...] = "both", fused_loss: str | tuple[bool, ...] = "both",
                 precision: str = "bf16", attention: str = "flash"):
        self.model, self.cluster, self.work = model, cluster, work
        cfg, traced = model.cfg, model.traced is not None
        if precision not in PRECISIONS:
            raise UserError(f"unknown precision {precision!r}; valid: {', '.join(PRECISIONS)}")
        for name, values in (("tp", tp), ("pp", pp), ("cp", cp), ("ep", ep), ("micro_batches", micro_batches),
                             ("pp_virtual", pp_virtual)):
            if values is not None and (not values or min(values) < 1):
                raise UserError(f"{name} values must be >= 1, got {list(values)}")
        self.precision, self.attention = precision, attention
        self.pinned = bool(tp or pp or cp)   # degrees the user chose: any combination of them is reported
        # What the run's tensor-parallel plan splits evenly is a constraint (_faults), not a filter here.
        self.tp = tuple(tp) if tp else ((1,) if traced else tuple(_divisors(cluster.gpus_per_node, MAX_TP)))
        self.pp = tuple(pp) if pp else ((1,) if traced else tuple(_divisors(cluster.world, cfg.n_layer)))
        self.cp = tuple(cp) if cp else ((1,) if traced else tuple(
            c for c in _divisors(cluster.world) if c == 1 or work.seq_len >= CP_MIN_TOKENS * c))
        self.ep = tuple(ep) if ep else (tuple(_divisors(cfg.moe_experts)) if model.moe else (1,))
        self.sequence_parallel = _choices(sequence_parallel, "sequence parallel", (True, False))
        self.fused_loss = (False,) if traced else _choices(fused_loss, "fused loss", (False, True))
        if not self.sequence_parallel or not self.fused_loss:
            raise UserError("sequence_parallel and fused_loss need at least one choice (on, off or both)")
        self.ac = ("none",) if traced else tuple(ac or AC_MODES)   # a user module has no known blocks
        self.micro_batches = tuple(micro_batches or MICRO_BATCHES)
        self.dp_strategies = tuple(dp_strategies) if dp_strategies else None
        self.schedules = tuple(dict.fromkeys(schedule_name(name) for name in pp_schedules))
        looping = [name for name in self.schedules if name not in PP_ONE_STAGE + PP_V_SHAPED]
        if pp_virtual and not looping:
            raise UserError(f"pp_virtual (chunks per pipeline rank) applies to the looping schedules "
                            f"(interleaved-1f1b, looped-bfs, interleaved-zero-bubble); the schedules searched are "
                            f"{', '.join(self.schedules)}")
        self.pp_virtual = tuple(pp_virtual) if pp_virtual else None
        self.pp_layers = tuple(pp_layers) if pp_layers else None
        if self.pp_layers and (min(self.pp_layers) < 1 or sum(self.pp_layers) != cfg.n_layer):
            raise UserError(f"pp_layers {','.join(map(str, self.pp_layers))}: every stage needs at least one block "
                            f"and the stages add up to the model's {cfg.n_layer} layers")

    def chunks(self, schedule: str, pp: int) -> tuple[int, ...]:
        """Stages per pipeline rank to search for a schedule (before the layers' limit)."""
        if schedule in PP_ONE_STAGE:
            return (1,)
        if schedule in PP_V_SHAPED:
            return (2,)
        if self.pp_virtual:
            return self.pp_virtual
        n = self.model.cfg.n_layer
        even = [v for v in range(3, MAX_VIRTUAL + 1) if n % (pp * v) == 0]
        return (2, even[-1]) if even else (2,)

    def degrees(self, wide: bool = False) -> list[_Degrees]:
        """Every combination of degrees with the constraints it breaks. wide: also the pipeline degrees
        beyond the layers (what the no-layout error weighs; the search never proposes them)."""
        pps = self.pp
        if wide and self.model.traced is None and not self.pinned:
            pps = tuple(_divisors(self.cluster.world))
        out = []
        for t, p, c, e in itertools.product(self.tp, pps, self.cp, self.ep):
            if self.cluster.world % (t * p * c) and not self.pinned:
                continue   # not a factoring of these GPUs: nothing to report unless the user chose the degrees
            for sp in (self.sequence_parallel if t > 1 else (True,)):
                out.append(self._check(_Degrees(t, p, c, e, sp)))
        return out

    def _check(self, d: _Degrees) -> _Degrees:
        cfg, cluster, work, model = self.model.cfg, self.cluster, self.work, self.model
        t, p, c, e, sp = d.tp, d.pp, d.cp, d.ep, d.sequence_parallel
        fault = d.faults.append
        if cluster.world % (t * p * c):
            fault(("degrees", f"tp{t} x pp{p} x cp{c} = {t * p * c} does not divide the {cluster.world} GPUs"))
        else:
            d.dp = cluster.world // (t * p * c)
        if t > 1:
            if model.traced is not None:
                fault(("tensor", f"tp{t}: a user module has no tensor-parallel plan"))
            elif cluster.gpus_per_node % t:
                fault(("tensor", f"tp{t} does not divide the {cluster.gpus_per_node} GPUs of a node (tensor "
                                 "parallel stays within a node)"))
            else:
                kv = cfg.n_kv_head or cfg.n_head
                splits = [("heads", cfg.n_head), ("KV heads", kv), ("MLP width", mlp_hidden(cfg))]
                if cfg.vocab_size > 0:
                    splits.append(("padded vocabulary", padded_vocab_size(cfg)))
                bad = [f"{n} {what}" for what, n in splits if n % t]
                if bad:
                    fault(("heads", f"tp{t} does not divide the model's {', '.join(bad)}"))
        if p > 1:
            if model.traced is not None:
                fault(("layers", f"pp{p}: the trainer pipelines slipstream transformers only, not a user module"))
            else:
                d.stages = [(name, v) for name in (self.schedules or ("1f1b",)) for v in self.chunks(name, p)
                            if p * v <= cfg.n_layer and (not self.pp_layers or p * v == len(self.pp_layers))]
                if not d.stages and self.pp_layers:
                    fault(("layers", f"pp{p}: the {len(self.pp_layers)} stages of pp_layers are not pp x chunks "
                                     f"per rank of any schedule searched"))
                elif not d.stages:
                    least = min(p * v for name in self.schedules for v in self.chunks(name, p))
                    fault(("layers", f"pp{p} needs at least {least} layers (one block per stage), the model has "
                                     f"{cfg.n_layer}"))
        else:
            d.stages = [("1f1b", 1)]
        if sp and t > 1 and work.seq_len % t:
            fault(("sequence", f"sequence parallel splits the {work.seq_len}-token sequence over tp{t}: not "
                               "divisible (without sequence parallel it need not be)"))
        if c > 1:
            pieces = 2 * c * (t if sp and t > 1 else 1)
            if model.traced is not None:
                fault(("sequence", f"cp{c}: a user module's attention cannot be split over the sequence"))
            elif work.seq_len % pieces:
                fault(("sequence", f"cp{c} cuts the {work.seq_len}-token sequence into {2 * c} chunks"
                                   + (f", each split over tp{t}" if pieces > 2 * c else "")
                                   + f": it is not divisible by {pieces}"))
        if e > 1:
            if not model.moe:
                fault(("experts", f"ep{e}: the model has no routed experts"))
            elif cfg.moe_experts % e:
                fault(("experts", f"ep{e} does not divide the model's {cfg.moe_experts} experts"))
            elif d.dp and d.dp % e:
                fault(("experts", f"ep{e} does not divide the data-parallel degree {d.dp}"))
        if d.dp:
            d.strategies = self._strategies(d)
            if not d.strategies:
                fault(("strategy", self._strategy_fault(d)))
            d.micro_batches = [mb for mb in self.micro_batches if self.work.global_batch % (d.dp * mb) == 0]
            if not d.micro_batches:
                fault(("batch", f"dp{d.dp}"))
        return d

    def _strategies(self, d: _Degrees) -> list[tuple[str, int]]:
        # The cp ranks average their gradients like data-parallel ranks, so cp needs a
        # data-parallel strategy even when dp is 1 (the run's FSDP / DDP spans the cp ranks).
        replicated = d.dp > 1 or d.cp > 1
        out = []
        for name in self.dp_strategies or DP_STRATEGIES:
            if replicated == (name == "none"):
                continue
            shard = 0
            if name == "hsdp":   # replicas across nodes, a node's data-parallel ranks shard
                per_node = self.cluster.gpus_per_node
                shard = per_node // (d.tp * d.cp) if per_node % (d.tp * d.cp) == 0 else 0
                if self.cluster.nodes == 1 or shard <= 1 or d.dp % shard or d.dp == shard:
                    continue
            out.append((name, shard))
        return out

    def _strategy_fault(self, d: _Degrees) -> str:
        asked = ", ".join(self.dp_strategies or DP_STRATEGIES)
        if d.dp > 1 or d.cp > 1:
            return (f"{d.dp} data-parallel x {d.cp} context-parallel ranks need ddp, zero1, zero2, fsdp or hsdp "
                    f"(hsdp: several nodes, a node's ranks as its shard group); searched: {asked}")
        return f"one data-parallel rank runs with strategy none; searched: {asked}"

    def strategies(self, runnable_only: bool = False):
        """Every layout of the degrees that break no constraint."""
        traced = self.model.traced is not None
        for d in self.degrees():
            if d.faults:
                continue
            for (name, shard), mb, ac in itertools.product(d.strategies, d.micro_batches, self.ac):
                accum = self.work.global_batch // (d.dp * mb)
                offloads = (False, True) if name in ("fsdp", "hsdp") else (False,)
                for offload, (schedule, v) in itertools.product(offloads, d.stages):
                    base = Strategy(dp_strategy=name, dp=d.dp, dp_shard=shard, tp=d.tp,
                                    sequence_parallel=d.sequence_parallel, pp=d.pp, pp_schedule=schedule,
                                    pp_virtual=v, cp=d.cp, ep=d.ep, micro_batch=mb, grad_accum=accum, ac=ac,
                                    precision=self.precision, offload=offload, attention=self.attention,
                                    pp_layers=self.pp_layers if d.pp > 1 and self.pp_layers else ())
                    for fused in self.fused_loss:
                        if fused and traced:
                            continue
                        s = base.replace(fused_loss=True) if fused else base
                        if not (runnable_only and s.not_runnable()):
                            yield s

    def faults_of(self, s: Strategy) -> list[str]:
        """The constraints a given layout breaks (the reasons the search would not propose it)."""
        one = SearchSpace(self.model, self.cluster, self.work, tp=(s.tp,), pp=(s.pp,), cp=(s.cp,), ep=(s.ep,),
                          pp_schedules=(s.pp_schedule,), pp_virtual=(s.pp_virtual,) if s.pp > 1 and
                          s.pp_schedule not in PP_ONE_STAGE + PP_V_SHAPED else None,
                          pp_layers=s.pp_layers or None, precision=s.precision, attention=s.attention,
                          dp_strategies=(s.dp_strategy,), micro_batches=(s.micro_batch,),
                          sequence_parallel=(s.sequence_parallel,))
        d = one._check(_Degrees(s.tp, s.pp, s.cp, s.ep, s.sequence_parallel))
        return [why for kind, why in d.faults if kind not in ("strategy", "batch")]


def layouts(model: PlanModel, cluster: Cluster, work: Workload, *, runnable_only: bool = False,
            **space) -> list[Strategy]:
    """Every layout worth evaluating (the constraints each parallelism puts on the shapes); `space`:
    SearchSpace's options."""
    return list(SearchSpace(model, cluster, work, **space).strategies(runnable_only))


def evaluate(model: PlanModel, s: Strategy, work: Workload, cluster: Cluster, efficiency: float = 1.0,
             device: str = "cuda") -> Candidate:
    stages = s.pp * s.pp_virtual
    if s.pp > 1 and model.traced is None and stages > model.cfg.n_layer:
        raise UserError(f"layout {s.label()}: pipeline parallel {s.pp} x {s.pp_virtual} chunks = {stages} stages for "
                        f"{model.cfg.n_layer} blocks; every stage holds at least one block: fewer stages")
    memory = estimate_memory(model, s, work.seq_len, device=device, stack=StackStates.of_cluster(cluster))
    time = estimate_time(model, s, work, cluster, efficiency=efficiency)
    fits = memory.total_bytes <= cluster.memory_bytes
    why = "" if fits else (f"needs {memory.total_bytes / GIB:.1f} GiB > {cluster.memory_bytes / GIB:.1f} GiB "
                           f"per GPU ({_largest(memory)})")
    return Candidate(s, memory, time, fits, why, refusals(model, s))


def refusals(model: PlanModel, s: Strategy) -> list[str]:
    """Why slipstream cannot run layout `s` of this model (empty: it can): the layout's own reasons
    (Strategy.not_runnable) and the model's (config.load's model rules)."""
    reasons = s.not_runnable() + _model_reasons(model, s)
    if s.pp > 1 and model.traced is not None:
        reasons.append(f"pipeline parallel {s.pp} of a user module")
    return reasons


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
    """Evaluate every layout; feasible ones ranked by predicted tokens/s (ties: less memory).
    `space`: SearchSpace's options (the degrees, strategies, schedules, ... to search)."""
    _check_positions(model, work)
    device = "cpu" if cluster.short_name == "cpu" else "cuda"
    search = SearchSpace(model, cluster, work, **space)
    # Twins: layouts that differ only in the memory levers (checkpointing, offload, fused loss), each
    # evaluated leanest first, so that what cannot fit or cannot rank is skipped (the module doc).
    twins: dict[Strategy, list[tuple[int, Strategy]]] = {}
    for order, s in enumerate(search.strategies(runnable_only)):
        twins.setdefault(s.replace(ac="none", offload=False, fused_loss=False), []).append((order, s))
    candidates = []
    for group in twins.values():
        over: list[tuple[int, ...]] = []    # the lever settings of twins that did not fit
        fitting = set()
        # Without offload first, leanest first (when that does not fit, none without offload does), then
        # with offload (evaluated only where the twin without it does not fit).
        for order, s in sorted(group, key=lambda item: (item[1].offload, _levers(item[1]))):
            levers = _levers(s)
            if any(all(mine >= theirs for mine, theirs in zip(levers, lean)) for lean in over):
                continue   # needs at least the memory of a twin that does not fit
            if s.offload and s.replace(offload=False) in fitting:
                continue   # offload only saves memory and costs time: it cannot rank above its fitting twin
            c = evaluate(model, s, work, cluster, efficiency, device)
            if not c.fits:
                over.append(levers)
            elif not s.offload:
                fitting.add(s)
            if not (runnable_only and c.not_runnable):   # the model's own refusals too (evaluate's)
                candidates.append((order, c))
    candidates = [c for _, c in sorted(candidates, key=lambda item: item[0])]   # the search's order for ties
    if not candidates:
        raise UserError(why_no_layout(search, runnable_only))
    fitting = sorted((c for c in candidates if c.fits), key=lambda c: (-c.time.tokens_per_s, c.memory.total_bytes))
    rejected = sorted((c for c in candidates if not c.fits), key=lambda c: -c.time.tokens_per_s)
    return PlanResult(model, cluster, work, fitting, rejected, len(candidates))


# How much memory each lever setting leaves in use, leanest first (plan/memory.py is monotone in each:
# test_plan_search_space pins it): full < selective < no checkpointing, offload < none, fused < plain loss.
_AC_MEMORY = {"full": 0, "selective": 1, "none": 2}


def _levers(s: Strategy) -> tuple[int, int, int]:
    return _AC_MEMORY[s.ac], int(not s.offload), int(not s.fused_loss)


def plan_layout(model: PlanModel, cluster: Cluster, work: Workload, s: Strategy, *,
                efficiency: float = 1.0) -> PlanResult:
    """One pinned layout (`slipstream plan --layout`), evaluated: ranked if it fits, else rejected.
    A layout the model or the work cannot take (what the search never proposes) is a UserError."""
    _check_positions(model, work)
    if s.world != cluster.world:
        raise UserError(f"layout {s.label()} spans {s.world} GPUs, the cluster has {cluster.world}")
    if s.dp * s.micro_batch * s.grad_accum != work.global_batch:
        raise UserError(f"layout {s.label()} runs dp {s.dp} x mb{s.micro_batch}x{s.grad_accum} = "
                        f"{s.dp * s.micro_batch * s.grad_accum} sequences per step, the global batch is "
                        f"{work.global_batch}")
    faults = SearchSpace(model, cluster, work).faults_of(s)
    if faults:
        raise UserError(f"layout {s.label()} does not fit this model and work: {'; '.join(faults)}")
    device = "cpu" if cluster.short_name == "cpu" else "cuda"
    c = evaluate(model, s, work, cluster, efficiency, device)
    return PlanResult(model, cluster, work, [c] if c.fits else [], [] if c.fits else [c], 1)


def _check_positions(model: PlanModel, work: Workload) -> None:
    if model.traced is None and work.seq_len > model.cfg.max_seq_len and model.cfg.position == "learned":
        raise UserError(f"--seq {work.seq_len} is longer than the model's learned position table "
                        f"({model.cfg.max_seq_len}); plan a shorter sequence or a model with max_seq_len >= {work.seq_len}.")


# What to change, per binding constraint (the no-layout error's advice).
_FIXES = {
    "heads": "tensor parallel must split them evenly: pin a --tp that divides them, or leave the GPUs to the "
             "other degrees",
    "layers": "every pipeline stage holds at least one block: fewer stages (--pp, --pp-virtual) or more of the "
              "other degrees",
    "sequence": "choose a --seq these degrees divide, other --cp / --tp degrees, or --sequence-parallel off",
    "experts": "choose an expert-parallel degree that divides both",
    "tensor": "tensor parallel stays within a node: a --tp that divides the GPUs per node",
    "degrees": "choose degrees whose product divides the GPUs",
    "strategy": "widen --dp-strategy",
}


def why_no_layout(search: SearchSpace, runnable_only: bool = False) -> str:
    """The no-layout error: the constraint that binds, i.e. the one whose relaxation alone leaves a
    layout (of the degree combinations that break the fewest constraints), with its fix."""
    model, cluster, work = search.model, search.cluster, search.work
    head = f"no layout of {model.name} for {cluster.world} GPUs, seq {work.seq_len}, global batch {work.global_batch}"
    combos = search.degrees(wide=True)
    if any(not d.faults for d in combos):
        # The degrees divide: every layout is one slipstream cannot run (--runnable-only).
        counts = Counter(reason for s in search.strategies() for reason in refusals(model, s))
        ordered = sorted(counts, key=lambda r: (not r.startswith("fp16"), -counts[r]))
        text = (f"{head} that slipstream can run: every layout needs " + "; or ".join(ordered[:4])
                + ". Drop --runnable-only to plan them anyway")
        if any(r.startswith("fp16") for r in ordered):
            text += (", or plan --precision bf16 (slipstream runs fp16 loss scaling only with none, ddp and zero1, "
                     "through autocast)")
        return text + "."
    fewest = min(len({kind for kind, _ in d.faults}) for d in combos)
    by_kind: dict[str, list[tuple[_Degrees, str]]] = {}
    for d in combos:
        if len({kind for kind, _ in d.faults}) == fewest:
            for kind, why in d.faults:
                by_kind.setdefault(kind, []).append((d, why))
    lines = [f"{head}: every way to split the GPUs breaks "
             + ("this constraint" if len(by_kind) == 1 else "one of these constraints") + ":"]
    for kind in CONSTRAINTS:
        if kind not in by_kind:
            continue
        if kind == "batch":
            lines.append("  - " + _batch_advice(search, sorted({d.dp for d, _ in by_kind[kind]})))
            continue
        whys = list(dict.fromkeys(why for _, why in by_kind[kind]))
        more = f" (and {len(whys) - 4} more)" if len(whys) > 4 else ""
        lines.append(f"  - {'; '.join(whys[:4])}{more}: {_FIXES[kind]}")
    return "\n".join(lines)


def _batch_advice(search: SearchSpace, dps: list[int]) -> str:
    """The batch constraint: the data-parallel degrees the GPUs reach, and the global batches near the
    asked one that a reachable degree x micro-batch divides."""
    gb, mb = search.work.global_batch, min(search.micro_batches)
    steps = [dp * mb for dp in dps]
    below = max((gb // step * step for step in steps if gb >= step), default=0)
    above = min(-(-gb // step) * step for step in steps)
    near = " or ".join(str(n) for n in (below, above) if n)
    return (f"global batch {gb} is not a multiple of any reachable data-parallel degree x micro-batch: the "
            f"data-parallel degrees these GPUs reach are {', '.join(map(str, dps))} (micro-batch {mb} and up); "
            f"the nearest global batches that work: {near} (--global-batch)")


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
