"""Mixture of experts in the planner: which blocks hold experts and what a layout does with them.

The model's own config says it all (model.moe_*; models/moe.py, models/flops.param_count):
an MoE block's MLP is E routed experts (bias-free MLPs of moe_expert_hidden), a router
(d x E) and moe_shared_experts shared experts; the first moe_first_dense blocks and the ones
off the moe_every rhythm keep a dense MLP. How slipstream runs them
(distributed/expert_parallel.py, distributed/tensor_parallel.py):

    ep       each MoE layer's routed experts split over ep consecutive data-parallel ranks
             (E / ep each); its forward sends every routed token copy (tokens x top_k rows of
             d) to the rank holding its expert and the results back: two all-to-alls, two more
             in backward, and the forward ones again where activation checkpointing recomputes
             the block; plus an all-to-all of the E token counts before each dispatch
    state    ep = 1: the experts are part of their block (sharded like it); ep > 1: FSDP over
             the dp / ep ranks holding the same experts (Strategy.expert_shard_group), DDP
             leaves them alone (ep = dp: no two ranks hold the same experts)
    tp       not split: every tp rank runs the whole MoE layer (router, experts, shared
             experts) on the gathered sequence of its micro-batch; its input is gathered, its
             output sliced back (sequence parallel)
    counts   the E per-expert token counts are all-reduced over the data-parallel ranks
             (x cp) in every MoE layer's forward (and its recompute)

Token routing is planned as balanced: every expert gets tokens x top_k / E rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipstream.plan.space import PlanModel


@dataclass(frozen=True)
class Experts:
    """The MoE shape of a model, per MoE layer unless said otherwise."""

    n: int               # routed experts
    top_k: int           # experts per token
    hidden: int          # one expert's hidden width
    shared_hidden: int   # the shared experts' hidden width together (0: none)
    layers: int          # MoE blocks in the model
    every: int           # model.moe_every
    routed_params: int   # the routed experts' parameters
    other_params: int    # the router's and the shared experts' parameters
    dense_mlp: int       # a dense block's MLP parameters (the blocks without experts)

    def stage_layers(self, blocks: int) -> int:
        """MoE blocks among `blocks` consecutive blocks, at most: the busiest pipeline stage's."""
        return min(math.ceil(blocks / self.every), self.layers)


def experts_of(model: PlanModel) -> Experts | None:
    """The MoE shape of `model`; None for a dense model or a traced module."""
    if not model.moe:
        return None
    from slipstream.models.flops import param_count
    from slipstream.models.moe import expert_hidden

    cfg = model.cfg
    pc = param_count(cfg)
    hidden = expert_hidden(cfg)
    routed = pc.experts // pc.moe_layers
    return Experts(n=cfg.moe_experts, top_k=cfg.moe_top_k, hidden=hidden,
                   shared_hidden=cfg.moe_shared_experts * hidden, layers=pc.moe_layers, every=cfg.moe_every,
                   routed_params=routed, other_params=pc.mlp - routed, dense_mlp=pc.dense_mlp)
