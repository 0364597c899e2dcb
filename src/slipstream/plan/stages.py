"""Which transformer blocks each pipeline stage holds, and which stages each pipeline rank runs.

Pure arithmetic on the model shape, shared by the trainer (distributed/pipeline_stages.py builds
the stage modules from it) and the planner (plan/memory.py and plan/timing.py size the busiest
pipeline rank from it), so that a plan sizes exactly the stages a run builds.

    split_layers    the contiguous block ranges of each stage: balanced by training FLOPs (the
                    embedding weighs on the first stage, the head and loss on the last), or the
                    user's split (parallel.pp_layers)
    stage_indices   the global stages a pp rank runs (loop placement, or the V of zbv / dualpipev)
    rank_parts      per pp rank: its blocks, and whether it holds the embedding and the head
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipstream.config.dims import PP_ONE_STAGE, PP_V_SHAPED
from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError

@dataclass(frozen=True)
class StageCosts:
    """Relative cost of the parts of a stage (any unit, e.g. training FLOPs per token)."""
    block: float = 1.0      # one transformer block
    embedding: float = 0.0  # the embedding lookup(s), carried by the first stage
    head: float = 0.0       # final norm + output head + loss, carried by the last stage


def stage_costs(cfg: ModelConfig, seq_len: int) -> StageCosts:
    """Training FLOPs per token of a block, the embedding and the head, from models/flops.py's counts
    (the same 6 x matmul parameters + attention scores formula as flops_per_token)."""
    from slipstream.models.flops import param_count
    from slipstream.models.transformer import padded_vocab_size

    count = param_count(cfg)
    block_params = count.attn + count.mlp + count.norm
    block = 6.0 * block_params + 12.0 * cfg.d_model * seq_len
    head = 6.0 * padded_vocab_size(cfg) * cfg.d_model  # the head's matmul (its loss is a few % more)
    # An embedding is a lookup (no matmul): its backward is a scatter-add of one row per token.
    embedding = 2.0 * cfg.d_model
    return StageCosts(block=block, embedding=embedding, head=head)


def split_layers(n_layer: int, n_stages: int, layers: list[int] | None = None,
                 weights: StageCosts | None = None) -> list[range]:
    """The contiguous block ranges of each stage (every layer exactly once, every stage >= 1 layer).

    layers: the user's split (layers per stage, e.g. [2, 1, 2]); default: the split that minimizes
    the most expensive stage, the first stage also paying `weights.embedding` and the last
    `weights.head` (weights default: every block costs 1, embedding and head nothing)."""
    if n_stages < 1:
        raise UserError(f"pipeline stages = {n_stages}: need at least 1 (parallel.pp x pp_virtual_stages)")
    if n_stages > n_layer:
        raise UserError(f"{n_stages} pipeline stages (parallel.pp x pp_virtual_stages) for a model of {n_layer} "
                        f"layers: every stage needs at least one block; lower parallel.pp or pp_virtual_stages")
    if layers is not None:
        return _user_split(n_layer, n_stages, list(layers))
    w = weights or StageCosts()
    return _balanced_split(n_layer, n_stages, w)


def _user_split(n_layer: int, n_stages: int, layers: list[int]) -> list[range]:
    given = ",".join(str(n) for n in layers)
    if len(layers) != n_stages:
        raise UserError(f"parallel.pp_layers = {given!r} gives {len(layers)} stages, the pipeline has {n_stages} "
                        f"(parallel.pp x pp_virtual_stages); give one layer count per stage")
    if any(n < 1 for n in layers):
        raise UserError(f"parallel.pp_layers = {given!r}: every stage needs at least one layer")
    if sum(layers) != n_layer:
        raise UserError(f"parallel.pp_layers = {given!r} sums to {sum(layers)} layers, the model has {n_layer}; "
                        f"the counts must add up to model.n_layer")
    starts = [sum(layers[:i]) for i in range(n_stages)]
    return [range(start, start + n) for start, n in zip(starts, layers)]


def _balanced_split(n_layer: int, n_stages: int, w: StageCosts) -> list[range]:
    """Exact min-max contiguous partition by dynamic programming (n_layer is at most a few hundred)."""

    def cost(stage: int, n_blocks: int) -> float:
        extra = (w.embedding if stage == 0 else 0.0) + (w.head if stage == n_stages - 1 else 0.0)
        return n_blocks * w.block + extra

    # best[s][k] = the smallest possible max stage cost of putting the first k layers in stages 0..s-1
    inf = math.inf
    best = [[inf] * (n_layer + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (n_layer + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0.0
    for s in range(1, n_stages + 1):
        for k in range(s, n_layer - (n_stages - s) + 1):
            for j in range(s - 1, k):  # stage s-1 holds layers j..k-1
                candidate = max(best[s - 1][j], cost(s - 1, k - j))
                # Ties go to the latest cut: earlier stages take the extra layers, the last stage
                # (which also holds the logits and the loss) the fewest.
                if candidate <= best[s][k] * (1 + 1e-9):
                    best[s][k], cut[s][k] = candidate, j
    ranges, k = [], n_layer
    for s in range(n_stages, 0, -1):
        j = cut[s][k]
        ranges.append(range(j, k))
        k = j
    return ranges[::-1]


def stage_indices(schedule: str, pp_rank: int, pp_size: int, virtual_stages: int) -> list[int]:
    """The global stage indices of `pp_rank`, in the order its schedule expects them: loop placement
    (rank r holds r, r + pp, ...) except the V schedules (rank r holds r and 2 * pp - 1 - r)."""
    if schedule in PP_V_SHAPED:
        return [pp_rank, 2 * pp_size - 1 - pp_rank]
    return [pp_rank + v * pp_size for v in range(1 if schedule in PP_ONE_STAGE else virtual_stages)]


@dataclass(frozen=True)
class RankPart:
    """What one pipeline rank holds: its blocks (over all its stages) and the end pieces."""
    rank: int
    blocks: int
    stages: tuple[int, ...]          # its global stage indices
    layers: tuple[int, ...]          # blocks of each of its stages, in the same order
    embedding: bool                  # holds the first stage (token embedding, positions)
    head: bool                       # holds the last stage (final norm, output head, loss)


def rank_parts(cfg: ModelConfig, seq_len: int, pp: int, schedule: str, virtual_stages: int,
               layers: tuple[int, ...] | list[int] | None = None) -> list[RankPart]:
    """Per pp rank, the whole blocks it holds, as the trainer splits them (split_layers with the
    FLOP weights of stage_costs, or the given `layers` per stage)."""
    v = 1 if schedule in PP_ONE_STAGE else (2 if schedule in PP_V_SHAPED else virtual_stages)
    n_stages = pp * v
    splits = split_layers(cfg.n_layer, n_stages, list(layers) if layers else None,
                          weights=stage_costs(cfg, seq_len))
    parts = []
    for rank in range(pp):
        stages = tuple(stage_indices(schedule, rank, pp, v))
        sizes = tuple(len(splits[i]) for i in stages)
        parts.append(RankPart(rank, sum(sizes), stages, sizes, 0 in stages, n_stages - 1 in stages))
    return parts
