"""Run set-up: the optimizer variant (device and process-wide settings: slipstream.runtime)."""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from slipstream.config.schema import Config
from slipstream.errors import UserError


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (dim >= 2: linear and embedding weights) decay; biases and norm gains don't."""
    decay, no_decay = [], []
    for param in model.parameters():  # parameters() yields tied weights once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [{"params": decay, "weight_decay": weight_decay}]
    if no_decay:
        groups.append({"params": no_decay, "weight_decay": 0.0})
    return groups


def build_optimizer(model: nn.Module, cfg: Config, parallel=None):
    """AdamW in the configured variant: implementation, bf16 state, step in backward, CPU offload;
    sharded over the data-parallel group for zero1, with periodic averaging for local SGD."""
    from slipstream.optimize.optimizers import (CPUOffloadOptimizer, OptimizerInBackward, make_adamw,
                                                named_param_groups)

    o = cfg.optim
    groups = param_groups(model, o.weight_decay)
    if not any(g["params"] for g in groups):
        raise UserError("the model has no trainable parameters")
    hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                 implementation=o.implementation, state_dtype=o.state_dtype)
    if parallel is not None and parallel.dims.strategy != "none":
        from slipstream.distributed.data_parallel import build_zero1_optimizer, wrap_optimizer

        if parallel.dims.strategy == "zero1":
            return build_zero1_optimizer(groups, cfg, parallel)
        base = CPUOffloadOptimizer(groups, **hyper) if o.offload else make_adamw(groups, **hyper)
        return wrap_optimizer(base, model, cfg, parallel)
    if o.in_backward:
        if cfg.train.grad_accum_steps > 1:
            print("note: optim.in_backward with train.grad_accum_steps > 1 steps only in the last micro-batch's "
                  "backward; the earlier micro-batches' gradients still coexist, so the peak saving is lost")
        return OptimizerInBackward(named_param_groups(model, groups), grad_clip=o.grad_clip, **hyper)
    if o.offload:
        return CPUOffloadOptimizer(groups, **hyper)
    return make_adamw(groups, **hyper)
