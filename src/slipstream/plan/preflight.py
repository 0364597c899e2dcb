"""Pre-flight memory check: refuse a model or a run that cannot fit before anything is allocated.

The planner's estimate is shape-only arithmetic (plan/memory.py), so it answers in microseconds
even for a vocabulary of 10^12 or a million layers, where building the model would allocate
(or, on the meta device, spend minutes creating modules) before failing with an opaque error.

    training      the planned step peak per process x processes sharing that memory
                  (CPU: every local rank; GPU: one rank per device)
                  vs what the device can give: CPU MemAvailable (and the cgroup's limit), GPU total memory
    weights only  generate / export: the fp32 parameters alone, a lower bound of the need

A refusal names the estimate, the limit, and the settings that shrink the biggest part.
The check never refuses when the limit is unknown.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from slipstream.errors import UserError

GIB = 2**30
_MEMINFO = Path("/proc/meminfo")
# cgroup v2, then v1: a container's limit can be far below the host's MemAvailable.
_CGROUP_LIMITS = ((Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory.current")),
                  (Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"), Path("/sys/fs/cgroup/memory/memory.usage_in_bytes")))


def _size(n: float) -> str:
    return f"{n / GIB:,.1f} GiB" if n >= GIB else f"{n / 2**20:,.1f} MiB"


def _read_int(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # "max" (no limit), absent, or unreadable


def host_memory_limit() -> tuple[int, str] | None:
    """(bytes a new allocation can get, where that number comes from) on this machine; None if unknown."""
    available, source = None, ""
    try:
        for line in _MEMINFO.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available, source = int(line.split()[1]) * 1024, "MemAvailable in /proc/meminfo"
                break
    except (OSError, ValueError, IndexError):
        pass
    if available is None:
        try:  # not Linux: physical memory is the best we know
            available = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
            source = "physical memory"
        except (AttributeError, OSError, ValueError):
            return None
    for limit_file, usage_file in _CGROUP_LIMITS:
        limit, usage = _read_int(limit_file), _read_int(usage_file)
        # v1 reports "no limit" as a huge number, which min() ignores by itself.
        if limit is not None and usage is not None and limit - usage < available:
            available, source = max(0, limit - usage), f"this container's memory limit ({limit_file})"
    return available, source


def device_memory_limit(device: torch.device) -> tuple[int, str] | None:
    """The memory of `device` one process can use: host memory on CPU, the whole GPU on CUDA."""
    if device.type == "cpu":
        return host_memory_limit()
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return props.total_memory, f"the memory of {props.name}"
    return None  # other accelerators: no check (no CUDA call on other paths)


def plan_training_memory(cfg, world: int, dp_strategy: str, dp_shard: int, device_type: str):
    """The planner's MemoryEstimate of one training step of `cfg` (its vocabulary resolved), with
    its compression switches (quant.qat's fake-quantized linears, sparsity's masks) and FSDP2's
    reduce dtype (parallel.reduce_dtype; none: parallel.param_dtype's, as data_parallel.apply_fsdp)."""
    from slipstream.plan.memory import estimate_memory
    from slipstream.plan.memory_activations import Compression
    from slipstream.plan.memory_states import StackStates
    from slipstream.plan.space import PlanModel, strategy_from_config

    strategy = strategy_from_config(cfg, world, dp_strategy, dp_shard)
    p = cfg.parallel
    reduce_dtype = p.reduce_dtype if p.reduce_dtype != "none" else p.param_dtype
    return estimate_memory(PlanModel(cfg.model.preset, cfg.model), strategy, cfg.train.seq_len, device=device_type,
                           optimizer_state_bytes=2 if cfg.optim.state_dtype == "bf16" else 4,
                           optimizer=cfg.optim.optimizer, state_dtype=cfg.optim.state_dtype,
                           compression=Compression.of(cfg),
                           stack=StackStates("torch", reduce_dtype="fp32" if reduce_dtype == "none" else reduce_dtype))


# What shrinks each half of the step's memory, named in the refusal (the bigger half first).
_REDUCE_STATES = ("the model state (model.n_layer, model.d_model, model.vocab_size; optim.state_dtype=bf16, "
                  "int8 or int4; shard it over more processes: parallel.dp_strategy=fsdp)")
_REDUCE_ACTIVATIONS = ("the activations (train.micro_batch_size, train.seq_len, with train.grad_accum_steps to keep "
                       "the batch; activations.checkpointing=full; train.fused_loss=true: logits are tokens x vocabulary)")


def training_refusal(estimate, processes: int, limit: tuple[int, str] | None, device: torch.device) -> str | None:
    """The refusal message when `processes` steps of `estimate` exceed `limit`; None when they fit."""
    if limit is None:
        return None
    limit_bytes, source = limit
    per_process = estimate.total_bytes + (estimate.host_bytes if device.type == "cpu" else 0)
    need = per_process * processes
    if need <= limit_bytes:
        return None
    b = estimate.breakdown
    states = b["parameters"] + b["gradients"] + b["optimizer_state"] + (estimate.host_bytes if device.type == "cpu" else 0)
    dynamic = b["activations"] + b["temporaries"]
    who = f"{processes} processes x {_size(per_process)}" if processes > 1 else "one process"
    hints = (_REDUCE_STATES, _REDUCE_ACTIVATIONS) if states >= dynamic else (_REDUCE_ACTIVATIONS, _REDUCE_STATES)
    return (f"this run cannot fit: slipstream plan estimates {_size(need)} for one training step ({who}: model "
            f"state {_size(states)}, activations and temporaries {_size(dynamic)}), more than the "
            f"{_size(limit_bytes)} available on {device.type} ({source}). Reduce "
            f"{' or '.join(hints)}; or set train.preflight_memory=false to start anyway")


def check_weights_fit(model_cfg, device: torch.device | str, what: str) -> None:
    """Refuse to build `model_cfg` on `device` when its fp32 parameters alone exceed the memory
    there (generate, export: models whose config comes from a checkpoint, possibly crafted)."""
    from slipstream.models.flops import param_count

    device = torch.device(device)
    limit = device_memory_limit(device)
    need = param_count(model_cfg).total * 4  # materialize() builds fp32 parameters
    if limit is not None and need > limit[0]:
        m = model_cfg
        raise UserError(f"{what} describes a model of {param_count(m).total:,} parameters (n_layer {m.n_layer}, "
                        f"d_model {m.d_model}, vocab_size {m.vocab_size}): its weights alone need {_size(need)}, "
                        f"more than the {_size(limit[0])} available on {device.type} ({limit[1]}); it cannot be "
                        "loaded on this machine")

