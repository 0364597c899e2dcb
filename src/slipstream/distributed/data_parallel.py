"""Data-parallel wrapping: the last wrapping step of the parallelize chain (distributed/parallelize.py).

    none   the model as it is
    ddp    DistributedDataParallel: replicated parameters, gradients all-reduced in buckets
           during backward (optionally compressed by a comm hook, or local SGD)
    zero1  DDP + ZeroRedundancyOptimizer: each rank keeps and steps 1/N of the optimizer state,
           then broadcasts its updated parameters
    zero2  FSDP2 fully_shard(reshard_after_forward=False): gradients and optimizer state
           sharded; parameters stay gathered between forward and backward (no re-gather)
    fsdp   FSDP2 fully_shard per block, then the root (ZeRO-3): parameters sharded too,
           gathered block by block for forward and again for backward
    hsdp   fsdp over a 2-D mesh: sharded inside dp_shard groups, replicated (all-reduced)
           across dp_replicate groups

Gradient accumulation: DDP skips its all-reduce on all but the last micro-batch
(`no_sync`). FSDP still reduce-scatters every micro-batch: that keeps gradients sharded,
which is what these strategies are for.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn as nn

from slipstream.config.schema import Config
from slipstream.distributed.mesh import Parallel

DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _dp_group(par: Parallel):
    return par.dp_mesh.get_group()  # the dp_replicate dim (with cp: cp folded in)


def apply_sync_batchnorm(model: nn.Module, par: Parallel) -> nn.Module:
    """BatchNorm with statistics over the whole global batch (parallel.sync_batchnorm)."""
    if par.world_size == 1 or not _has_batchnorm(model):
        return model
    if par.device.type == "cpu":
        # torch's SyncBatchNorm (and DDP with it) needs accelerator tensors.
        if par.is_main:
            print("note: parallel.sync_batchnorm needs GPUs; on CPU each rank normalizes with its own batch statistics")
        return model
    # Per-rank batch statistics would differ from the global batch's: compute them across
    # ranks (every rank is a data-parallel rank for now, so the group is the whole world).
    return nn.SyncBatchNorm.convert_sync_batchnorm(model)


def _has_batchnorm(model: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in model.modules())


def apply_ddp(model: nn.Module, cfg: Config, par: Parallel) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel as DDP

    from slipstream.distributed.comm_hooks import register_comm_hook

    p = cfg.parallel
    # Expert-parallel weights (DTensors over the ep ranks) differ by rank: their gradients are
    # complete without DDP (see distributed/expert_parallel.py), so DDP leaves them alone.
    sharded = [name for name, param in model.named_parameters() if hasattr(param, "device_mesh")]
    if sharded:
        DDP._set_params_and_buffers_to_ignore_for_model(model, sharded)
    ddp = DDP(model, device_ids=[par.device.index] if par.device.type == "cuda" else None,
              process_group=_dp_group(par), bucket_cap_mb=p.bucket_mb, static_graph=p.static_graph,
              gradient_as_bucket_view=p.grad_as_bucket_view, find_unused_parameters=p.find_unused_parameters)
    ddp.slipstream_hook_state = register_comm_hook(ddp, p, _dp_group(par))
    return ddp


def apply_fsdp(model: nn.Module, cfg: Config, par: Parallel) -> nn.Module:
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    p = cfg.parallel
    param_dtype = DTYPES[p.param_dtype]
    reduce_dtype = DTYPES[p.reduce_dtype] or param_dtype
    options: dict[str, Any] = dict(
        mesh=par.dp_mesh,  # with tp, the parameters are already DTensors over the tp dim: FSDP adds the dp dims
        mp_policy=MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype),
        # CPU tensors cannot be pinned without an accelerator.
        offload_policy=CPUOffloadPolicy(pin_memory=par.device.type == "cuda") if p.offload else OffloadPolicy(),
    )
    # zero2 keeps the gathered parameters from forward to backward; so does a pipeline stage,
    # which would otherwise gather them again for every micro-batch of the schedule.
    reshard = par.dims.strategy != "zero2" and par.dims.pp == 1
    if isinstance(getattr(model, "blocks", None), (nn.ModuleList, nn.ModuleDict)):
        from slipstream.models.transformer import block_slots

        # One communication unit per block: only one block's full parameters exist at a time
        # (two with prefetching), and the gathers overlap the neighbouring blocks' compute.
        from slipstream.distributed.expert_parallel import shard_experts_for_fsdp

        for _, block in block_slots(model):
            shard_experts_for_fsdp(block, par, {**options, "reshard_after_forward": reshard})
            fully_shard(block, reshard_after_forward=reshard, **options)
    # The root unit holds the rest (embeddings, final norm, head); backward needs it first,
    # so it is not resharded after forward.
    fully_shard(model, reshard_after_forward=False, **options)
    return model


def build_zero1_optimizer(param_groups: list[dict[str, Any]], cfg: Config, par: Parallel):
    """AdamW with its state sharded over the data-parallel group (ZeRO stage 1)."""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    from slipstream.optimize.optimizers import adamw_flags

    o = cfg.optim
    params = [p for g in param_groups for p in g["params"]]
    first, *rest = param_groups
    zero = ZeroRedundancyOptimizer(first["params"], optimizer_class=torch.optim.AdamW,
                                   process_group=_dp_group(par), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                   weight_decay=first["weight_decay"], **adamw_flags(o.implementation, params))
    for group in rest:
        zero.add_param_group(group)
    return zero


def wrap_optimizer(optimizer: Any, model: nn.Module, cfg: Config, par: Parallel) -> Any:
    """Optimizer-side parts of a strategy (local SGD's periodic parameter averaging)."""
    if par.dims.strategy == "ddp" and cfg.parallel.local_sgd_period:
        from slipstream.distributed.comm_hooks import wrap_local_sgd_optimizer

        return wrap_local_sgd_optimizer(optimizer, cfg.parallel, _dp_group(par))
    return optimizer


def no_sync(model: nn.Module, last_micro_batch: bool):
    """Skip DDP's gradient all-reduce on all but the last micro-batch of an accumulation."""
    if not last_micro_batch and hasattr(model, "no_sync"):
        return model.no_sync()
    return contextlib.nullcontext()


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside a DDP wrapper (FSDP2 shards in place: nothing to unwrap)."""
    return model.module if hasattr(model, "no_sync") and hasattr(model, "module") else model


def gradients_live_in_buckets(model: nn.Module, cfg: Config) -> bool:
    """DDP with gradient_as_bucket_view: the gradients are views into DDP's buckets, which exist
    for the whole run anyway. Zeroing them (instead of setting them to None) keeps them pointing
    there, so nothing is re-allocated and memory trackers count the buckets as gradients."""
    return hasattr(model, "no_sync") and hasattr(model, "reducer") and cfg.parallel.grad_as_bucket_view


def write_full_or_shard(param: torch.Tensor, values: torch.Tensor) -> None:
    """Copy a parameter's full initial values into it; a sharded (DTensor) parameter keeps only
    its own shard. Every rank computes the same full values (same seed), so no communication."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if isinstance(param, DTensor):
        values = distribute_tensor(values.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
    param.copy_(values)


def materialize_sharded(model: nn.Module, materialize: Callable[..., Any], cfg: Config, device: torch.device,
                        seed: int) -> None:
    """Allocate and initialize a model sharded on the meta device: each rank only its shards.

    `materialize(model, device, seed, write)` is the model's own init (e.g. transformer.materialize).
    With CPU offload the sharded parameters live in CPU memory; buffers (e.g. RoPE tables) are
    not managed by FSDP and must sit on the compute device."""
    where = torch.device("cpu") if cfg.parallel.offload else device
    materialize(model, device=where, seed=seed, write=write_full_or_shard)
    if where != device:
        for module in model.modules():
            for name, buffer in module.named_buffers(recurse=False):
                setattr(module, name, buffer.to(device))


def full_value(tensor: torch.Tensor) -> torch.Tensor:
    """A plain tensor from a DTensor (e.g. the gradient norm of sharded parameters)."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def total_grad_norm(grads: list[torch.Tensor]) -> torch.Tensor:
    """The 2-norm of all gradients, whatever meshes their DTensors live on (expert-parallel weights
    on the ep mesh next to data/tensor-parallel ones): each mesh's norm is reduced over its own
    ranks (communicates), then they are combined."""
    groups: dict[int, list[torch.Tensor]] = {}
    for grad in grads:
        groups.setdefault(id(getattr(grad, "device_mesh", None)), []).append(grad)
    if len(groups) <= 1:
        return torch.nn.utils.get_total_norm(grads)
    norms = [full_value(torch.nn.utils.get_total_norm(group)).float() for group in groups.values()]
    return torch.stack(norms).square().sum().sqrt()


def clip_grads(params: list[torch.Tensor], max_norm: float, norm: torch.Tensor | None = None) -> torch.Tensor:
    """clip_grad_norm_ for gradients on several meshes (see total_grad_norm); returns the pre-clip norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = total_grad_norm(grads) if norm is None else norm
    groups: dict[int, list[torch.Tensor]] = {}
    for param in params:
        if param.grad is not None:
            groups.setdefault(id(getattr(param.grad, "device_mesh", None)), []).append(param)
    for group in groups.values():
        torch.nn.utils.clip_grads_with_norm_(group, max_norm, full_value(norm) if len(groups) > 1 else norm)
    return norm


def zero_grads(optimizer, keep_buckets: bool) -> None:
    """optimizer.zero_grad; keep_buckets: DDP's gradients are views into its buckets, so they are
    zeroed in place, not dropped (DTensor gradients, which DDP does not own, are dropped: one
    foreach call cannot mix them with plain tensors)."""
    if not keep_buckets:
        optimizer.zero_grad(set_to_none=True)
        return
    plain = []
    for group in optimizer.param_groups:
        for param in group["params"]:
            if param.grad is None:
                continue
            if hasattr(param.grad, "device_mesh"):
                param.grad = None
            else:
                plain.append(param.grad)
    if plain:
        torch._foreach_zero_(plain)
