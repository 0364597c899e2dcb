"""DDP gradient-communication hooks: compression, PowerSGD and (post-)local SGD.

All of them are torch's own hooks (torch.distributed.algorithms.ddp_comm_hooks), except a
bf16 compression hook that also runs on gloo: torch's `bf16_compress_hook` is NCCL-only.

    none      fp32 all-reduce (DDP's built-in path)
    fp16/bf16 cast each bucket to 16 bits, all-reduce, cast back: half the bytes on the wire
    powersgd  rank-r approximation of each gradient matrix, with error feedback
    local SGD after a start step, no gradient all-reduce at all; parameters are averaged
              every `period` steps by the optimizer wrapper (PostLocalSGDOptimizer)
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from slipstream.config.schema import ParallelConfig


def _bf16_compress_hook(process_group, bucket):  # no annotations: DDP checks them literally
    """Average the bucket in bf16 on any backend (gloo included), then write it back in its dtype."""
    group = process_group if process_group is not None else dist.group.WORLD
    world = dist.get_world_size(group)
    buffer = bucket.buffer()
    compressed = buffer.to(torch.bfloat16).div_(world)
    work = dist.all_reduce(compressed, group=group, async_op=True)

    def decompress(fut: torch.futures.Future) -> torch.Tensor:
        buffer.copy_(fut.value()[0])
        return buffer

    return work.get_future().then(decompress)


def register_comm_hook(ddp_model: Any, p: ParallelConfig, group: dist.ProcessGroup) -> Any:
    """Install the configured hook on a DDP model; returns hook state worth keeping (or None)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, post_localSGD_hook, powerSGD_hook

    if p.local_sgd_period:
        # After the start step gradients are not communicated at all: ranks train on their own
        # gradients, and the optimizer wrapper averages the parameters every period steps.
        state = post_localSGD_hook.PostLocalSGDState(process_group=group, subgroup=None,
                                                     start_localSGD_iter=p.local_sgd_start_step,
                                                     post_local_gradient_allreduce=False)
        ddp_model.register_comm_hook(state, post_localSGD_hook.post_localSGD_hook)
        return state
    if p.comm_hook == "fp16":
        ddp_model.register_comm_hook(group, default_hooks.fp16_compress_hook)
    elif p.comm_hook == "bf16":
        ddp_model.register_comm_hook(group, _bf16_compress_hook)
    elif p.comm_hook == "powersgd":
        state = powerSGD_hook.PowerSGDState(process_group=group, matrix_approximation_rank=p.powersgd_rank,
                                            start_powerSGD_iter=p.powersgd_start_step, min_compression_rate=1,
                                            use_error_feedback=True, warm_start=True)
        ddp_model.register_comm_hook(state, powerSGD_hook.powerSGD_hook)
        return state
    return None


def wrap_local_sgd_optimizer(optimizer: torch.optim.Optimizer, p: ParallelConfig, group: dist.ProcessGroup):
    """Average parameters across the data-parallel group every local_sgd_period steps."""
    from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
    from torch.distributed.optim import PostLocalSGDOptimizer

    averager = PeriodicModelAverager(period=p.local_sgd_period, warmup_steps=p.local_sgd_start_step,
                                     process_group=group)
    return PostLocalSGDOptimizer(optim=optimizer, averager=averager)


def restore_step(ddp_model: Any, optimizer: Any, step: int) -> None:
    """After a resume, put the hooks' and the averager's step counters where the run was, so
    warm-ups and averaging periods continue on schedule. (PowerSGD's low-rank factors and its
    error feedback are not checkpointed: they restart from zero, so a resumed PowerSGD run is
    close to, not equal to, the uninterrupted one.)"""
    state = getattr(ddp_model, "slipstream_hook_state", None)
    if state is not None and hasattr(state, "iter"):
        state.iter = step
    averager = getattr(optimizer, "averager", None)
    if averager is not None and hasattr(averager, "step"):
        averager.step = step
