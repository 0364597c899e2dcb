"""Numerics switches: autocast dtype, fp16 dynamic loss scaling, TF32 matmuls, fp8 linears.

    fp32     : nothing changes.
    bf16     : autocast; bf16 has fp32's exponent range, so no loss scaling is needed.
    fp16     : autocast + dynamic loss scaling (torch.amp.GradScaler): the loss is
               multiplied by a scale so small gradients don't underflow; a step whose
               gradients overflow (inf/nan) is skipped and the scale halved. Skipped steps
               are counted on the device and reported at the logging interval.
    tf32     : CUDA only: fp32 matmuls/convolutions run on TF32 tensor cores
               (switched by slipstream.runtime.configure_tf32).
    fp8      : CUDA only (compute capability >= 8.9): nn.Linear layers converted by torchao's
               float8 training recipe.
"""

from __future__ import annotations

import contextlib

import torch

from slipstream.config.schema import PrecisionConfig
from slipstream.errors import UserError

AUTOCAST_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def autocast_context(device: torch.device, autocast: str):
    """A reusable autocast context for the forward pass (nullcontext for fp32)."""
    if autocast == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=AUTOCAST_DTYPES[autocast])


def make_grad_scaler(device: torch.device, cfg: PrecisionConfig) -> torch.amp.GradScaler | None:
    """A GradScaler for fp16 autocast, else None. Note `GradScaler()` without a device
    defaults to "cuda" and silently disables itself on CPU; we always pass the device."""
    if cfg.autocast != "fp16":
        return None
    return torch.amp.GradScaler(device.type, init_scale=cfg.fp16_init_scale,
                                growth_interval=cfg.fp16_growth_interval)


def fp8_support(device: torch.device) -> str | None:
    """None when fp8 linears can run here, else the reason they can't."""
    if device.type != "cuda":
        return f"fp8 training needs a CUDA GPU with compute capability >= 8.9 (this run is on {device.type})"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) < (8, 9):
        return f"fp8 training needs compute capability >= 8.9 (Ada/Hopper or newer); this GPU has {major}.{minor}"
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        return "fp8 training uses torchao: pip install torchao"
    return None


def apply_fp8(model: torch.nn.Module, device: torch.device, tp: int = 1) -> torch.nn.Module:
    """Convert nn.Linear layers to float8 training (torchao). The output head stays in high
    precision: its logits feed the loss directly and fp8 there costs accuracy. tp: the
    tensor-parallel degree the linears will be split by (their shards must stay fp8-sized)."""
    reason = fp8_support(device)
    if reason:
        raise UserError(f"precision.fp8 = true: {reason}; set --precision.fp8=false")
    from torchao.float8 import convert_to_float8_training

    def keep_linear(module: torch.nn.Module, fqn: str) -> bool:
        # fp8 matmuls need dimensions divisible by 16, on each rank's shard under tensor
        # parallelism (column-parallel splits out_features, row-parallel in_features).
        # (An MoE router stays in high precision: fp8 noise would change which experts are picked.)
        return (isinstance(module, torch.nn.Linear) and fqn != "lm_head" and not fqn.endswith("router")
                and module.in_features % (16 * tp) == 0 and module.out_features % (16 * tp) == 0)

    convert_to_float8_training(model, module_filter_fn=keep_linear)
    return model
