"""What the busiest pipeline rank holds: its whole blocks and end pieces, as the trainer splits
them (plan/stages.rank_parts), and the parameters of one GPU before and after data-parallel
sharding. Its own module because the compute (plan/timing_compute.py), the collectives
(plan/timing_comm.py) and the optimizer step (plan/timing.py) all count from the same rank.
"""

from __future__ import annotations

from slipstream.errors import UserError
from slipstream.models.flops import param_count
from slipstream.plan.experts import experts_of
from slipstream.plan.space import PlanModel, Strategy
from slipstream.plan.stages import RankPart, rank_parts, stage_costs

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


def rank_blocks(model: PlanModel, s: Strategy, seq_len: int | None) -> float:
    """Blocks of the busiest pp rank (all of them without a pipeline; n_layer / pp when the
    sequence length, which weighs the split, is not known)."""
    if s.pp <= 1:
        return float(model.cfg.n_layer)
    if seq_len is None:
        return model.cfg.n_layer / s.pp
    return float(busiest_rank(model, s, seq_len).blocks)


def params_per_gpu(model: PlanModel, s: Strategy, seq_len: int | None = None) -> float:
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


def expert_params_per_gpu(model: PlanModel, s: Strategy, blocks: float) -> float:
    """The routed-expert parameters of one GPU that data parallelism treats apart: ep > 1 only
    (E / ep per MoE layer, of the rank's `blocks`); with ep = 1 they are part of their blocks."""
    ex = experts_of(model)
    if not (ex and s.ep > 1):
        return 0.0
    return ex.layers * ex.routed_params / s.ep * blocks / model.cfg.n_layer


def optimizer_params_per_gpu(model: PlanModel, s: Strategy, seq_len: int | None = None) -> float:
    """Parameters whose AdamW update runs on one GPU: its share after data-parallel sharding
    (ep > 1: the routed experts over the dp / ep ranks that hold the same ones)."""
    group = s.shard_group if s.shards()[0] else 1
    total = params_per_gpu(model, s, seq_len)
    if model.traced is not None:
        return total / group
    experts = expert_params_per_gpu(model, s, rank_blocks(model, s, seq_len))
    if not experts:
        return total / group
    return (total - experts) / group + experts / s.expert_shard_group
