"""The config rules of [sparsity] (optimize/sparsity.py): what it refuses, and why."""

from __future__ import annotations

from slipstream.config.dims import SHARDED
from slipstream.config.schema import Config
from slipstream.errors import UserError


def check_sparsity_rules(cfg: Config) -> None:
    s = cfg.sparsity
    if s.method == "none":
        return
    what = f"sparsity.method = {s.method}"
    if s.target <= 0:
        raise UserError(f"{what} with sparsity.target = 0 prunes nothing; set a target in (0, 0.99] "
                        "or --sparsity.method=none")
    if s.method == "2:4" and s.target != 0.5:
        raise UserError(f"{what} zeroes exactly half of the weights (two of every four); sparsity.target = "
                        f"{s.target} cannot apply: set --sparsity.target=0.5 or use --sparsity.method=magnitude")
    if s.method == "2:4" and s.end_step > s.start_step:
        raise UserError(f"{what} with a gradual schedule (end_step > start_step) is not implemented yet: 2:4 "
                        "is applied all at once at sparsity.start_step; set --sparsity.end_step=0")
    if s.scope == "global" and s.method != "magnitude":
        raise UserError(f"sparsity.scope = global ranks single weights (method magnitude); {what} ranks "
                        "whole heads or channels per layer (or blocks of four): set --sparsity.scope=layer")
    if s.criterion == "wanda" and s.method not in ("magnitude", "2:4"):
        raise UserError(f"sparsity.criterion = wanda ranks single weights; {what} ranks whole heads or channels by "
                        "their norm: use --sparsity.method=magnitude or 2:4, or --sparsity.criterion=magnitude")
    if s.criterion == "wanda" and s.scope == "global":
        raise UserError("sparsity.criterion = wanda compares weights within each output row (its activation norms "
                        "are per layer, so one global threshold has no meaning); set --sparsity.scope=layer")
    if s.criterion == "wanda" and cfg.parallel.cp > 1:
        raise UserError("sparsity.criterion = wanda calibrates on whole sequences, which context parallelism "
                        "splits over ranks; set --parallel.cp=1 or use --sparsity.criterion=magnitude")
    if s.criterion == "wanda" and (cfg.data.streaming or cfg.data.mixture):
        raise UserError("sparsity.criterion = wanda calibrates on the train split of a local prepared folder; "
                        "streamed data and mixtures are not supported yet: use --sparsity.criterion=magnitude")
    if s.start_step >= cfg.train.max_steps:
        raise UserError(f"sparsity.start_step = {s.start_step} is not before train.max_steps = "
                        f"{cfg.train.max_steps}: nothing would be pruned; lower sparsity.start_step")
    if s.end_step >= cfg.train.max_steps:
        # The loop prunes at steps 0 .. max_steps - 1, so a pruning step at end_step = max_steps never runs.
        raise UserError(f"sparsity.end_step = {s.end_step} is not before train.max_steps = {cfg.train.max_steps}: "
                        "the target would never be reached (the last step is max_steps - 1); set "
                        f"sparsity.end_step <= train.max_steps - 1 = {cfg.train.max_steps - 1}")
    if cfg.model.moe_experts > 0:
        raise UserError(f"{what} with mixture-of-experts models is not implemented yet (the experts' weights "
                        "are not linear layers); set --sparsity.method=none or --model.moe_experts=0")
    p = cfg.parallel
    if p.tp > 1:
        raise UserError(f"{what} does not work with tensor parallelism: the masks are ranked over whole "
                        "weights, which tp splits into DTensor shards; set --parallel.tp=1")
    if p.pp > 1:
        raise UserError(f"{what} with pipeline parallelism is not implemented yet (each stage would rank only "
                        "its own layers); set --parallel.pp=1")
    if p.dp_strategy in SHARDED:
        raise UserError(f"{what} does not work with dp_strategy = {p.dp_strategy}: FSDP2 holds only a shard of "
                        "each weight between steps, the masks are whole tensors; use --parallel.dp_strategy="
                        "ddp (or zero1, none)")
    if p.local_sgd_period > 0:
        raise UserError(f"{what} does not work with local SGD: the replicas' weights differ between "
                        "averagings, so each rank would rank different weights; set --parallel.local_sgd_period=0")
