"""Run set-up: the optimizer variant and the data loaders a Trainer wraps (device and process-wide
settings: slipstream.runtime)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from slipstream.config.schema import Config
from slipstream.errors import UserError


def param_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Matrices (dim >= 2: linear and embedding weights) decay; biases and norm gains don't.
    Parameters on different device meshes get groups of their own (expert parallelism's DTensors
    next to plain or data-parallel ones; an MoE layer's plain weights next to tensor-parallel
    DTensors): one fused or foreach AdamW call cannot mix plain tensors and DTensors. The number
    of groups thus depends on the layout; the scheduler state resumes across it
    (train.schedule.load_scheduler_state)."""
    decay: dict[int, list] = {}
    no_decay: dict[int, list] = {}
    for param in model.parameters():  # parameters() yields tied weights once
        if param.requires_grad:
            mesh = id(getattr(param, "device_mesh", None))
            (decay if param.dim() >= 2 else no_decay).setdefault(mesh, []).append(param)
    groups = [{"params": params, "weight_decay": weight_decay} for params in decay.values()] or \
        [{"params": [], "weight_decay": weight_decay}]
    return groups + [{"params": params, "weight_decay": 0.0} for params in no_decay.values()]


def build_optimizer(model: nn.Module, cfg: Config, parallel=None):
    """AdamW in the configured variant: implementation, bf16 state, step in backward, CPU offload;
    sharded over the data-parallel group for zero1, with periodic averaging for local SGD. Or, with
    optim.optimizer = muon, Muon for the hidden matrices and AdamW for the rest (optimize/muon.py)."""
    from slipstream.optimize.optimizers import (CPUOffloadOptimizer, OptimizerInBackward, make_adamw,
                                                named_param_groups)

    o = cfg.optim
    groups = param_groups(model, o.weight_decay)
    if not any(g["params"] for g in groups):
        raise UserError("the model has no trainable parameters")
    hyper = dict(lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay,
                 implementation=o.implementation, state_dtype=o.state_dtype)
    if o.optimizer == "muon":
        from slipstream.optimize.muon import build_muon_with_adamw, layer_rule_note

        dims = parallel.dims if parallel is not None else None
        if dims is not None and (dims.strategy in ("zero1", "zero2", "fsdp", "hsdp") or dims.tp > 1):
            # Config load refuses these where it can; dp_strategy = auto is resolved only here.
            raise UserError(f"optim.optimizer = muon needs whole matrices on every rank, but this run's layout is "
                            f"dp_strategy = {dims.strategy}, tp = {dims.tp}; use --parallel.dp_strategy=ddp "
                            "(without tp) or --optim.optimizer=adamw")
        optimizer = build_muon_with_adamw(model, groups, o)
        if getattr(parallel, "is_main", True) and (note := layer_rule_note(model)):
            print(note)
        if dims is None or dims.strategy == "none":
            return optimizer
        from slipstream.distributed.data_parallel import wrap_optimizer

        return wrap_optimizer(optimizer, model, cfg, parallel)  # ddp: local SGD's averaging
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


# --- the data a Trainer is given ------------------------------------------------------------------------------------

def as_loader(data: Any, cfg: Config, device: torch.device, shuffle: bool, collate_fn=None, parallel=None):
    """Wrap a map-style Dataset, TarShards or any IterableDataset in our stateful loaders (split
    over the data-parallel ranks; shuffle=False, for validation, keeps the order and the last
    partial batch); pass stateful loaders through. Streams and tar shards are read by
    data.num_workers worker processes with data.prefetch batches each in flight, pinned on CUDA."""
    if data is None or (hasattr(data, "state_dict") and hasattr(data, "load_state_dict") and hasattr(data, "__iter__")
                        and not isinstance(data, torch.utils.data.Dataset)):
        dp = parallel.dims.dp if parallel else 1
        if data is not None and getattr(data, "world_size", dp) != dp:
            raise UserError(f"the {'training' if shuffle else 'validation'} loader was built for world_size = "
                            f"{data.world_size}, but this job has {dp} data-parallel ranks: every rank would "
                            f"read the same batches. Build it with rank={parallel.dp_rank if parallel else 0}, "
                            f"world_size={dp}, or pass a Dataset and let the Trainer shard it")
        return data
    split = dict(rank=parallel.dp_rank if parallel else 0, world_size=parallel.dims.dp if parallel else 1)
    if isinstance(data, torch.utils.data.IterableDataset):
        from slipstream.data.iterable_loader import IterableLoader
        from slipstream.data.tar_shards import TarShardLoader, TarShards

        d = cfg.data
        workers = dict(num_workers=d.num_workers, prefetch=d.prefetch, device=device, pin_memory=d.pin_memory)
        if isinstance(data, TarShards):
            return TarShardLoader(data, batch_size=cfg.train.micro_batch_size, shuffle=shuffle, seed=cfg.train.seed,
                                  drop_last=shuffle, collate_fn=collate_fn, **workers, **split)
        return IterableLoader(data, batch_size=cfg.train.micro_batch_size, seed=cfg.train.seed, drop_last=shuffle,
                              collate_fn=collate_fn, **workers, **split)
    if isinstance(data, torch.utils.data.Dataset):
        from slipstream.data.loader import DatasetLoader

        return DatasetLoader(data, batch_size=cfg.train.micro_batch_size, shuffle=shuffle, seed=cfg.train.seed,
                             drop_last=shuffle, collate_fn=collate_fn, device=device, **split)
    raise UserError(f"train_data must be a torch Dataset (map-style or iterable), TarShards or a stateful loader "
                    f"(state_dict/load_state_dict), got {type(data).__name__}")


def batch_size_of(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return batch_size_of(batch[0])
    if isinstance(batch, dict) and batch:
        return batch_size_of(next(iter(batch.values())))
    raise UserError(f"cannot tell the batch size of a {type(batch).__name__} batch; pass tokens_per_batch=")
