"""The one ordered place where single-device techniques are applied to a model.

Order (each step sees the model the previous one produced):

    1. fp8 linears        replace nn.Linear before anything wraps them
    2. activation ckpt    wrap blocks, so compile traces the recompute regions
    3. torch.compile      whole model or each block (regional)

Data-parallel wrapping (DDP/FSDP) comes after these, in a later layer. Precision autocast,
the loss scaler and the optimizer variants act on the training step, not on the model, so
they live in the trainer. Model code stays free of all of this.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from slipstream.config.schema import Config
from slipstream.errors import UserError


def _has_blocks(model: nn.Module) -> bool:
    return isinstance(getattr(model, "blocks", None), nn.ModuleList)


def apply_optimizations(model: nn.Module, cfg: Config, device: torch.device) -> nn.Module:
    if cfg.precision.fp8:
        from slipstream.optimize.precision import apply_fp8

        model = apply_fp8(model, device)

    if cfg.activations.checkpointing != "none":
        if not _has_blocks(model):
            raise UserError("activations.checkpointing works on models with a `blocks` nn.ModuleList "
                            "(slipstream transformers); for your own model apply torch.utils.checkpoint "
                            "inside it, or set --activations.checkpointing=none")
        from slipstream.optimize.activations import apply_activation_checkpointing

        model = apply_activation_checkpointing(model, cfg.activations.checkpointing, every=cfg.activations.every)

    if cfg.compile.scope != "off":
        from slipstream.optimize.compile import apply_compile, configure_compile_cache

        if cfg.compile.scope == "blocks" and not _has_blocks(model):
            raise UserError("compile.scope = blocks needs a model with a `blocks` nn.ModuleList; "
                            "use --compile.scope=model for your own model")
        configure_compile_cache(cfg.compile.cache_dir or None)
        model = apply_compile(model, cfg.compile.scope, mode=cfg.compile.mode, fullgraph=cfg.compile.fullgraph)
    return model
