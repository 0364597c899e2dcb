"""Process-wide runtime settings: the device, seeds, deterministic kernels, threads, TF32.

Bottom layer (beside config/ and errors): it needs only torch, the config schema and
UserError, so every layer above (distributed, train, perf, cli) can use it.

A benchmark or experiment that cannot be re-run to the same numbers cannot be trusted or
debugged: `seed_all` and `set_deterministic` make a run repeatable.
"""

from __future__ import annotations

import os
import random
import warnings

import torch

from slipstream.config.schema import Config
from slipstream.errors import UserError

# cuBLAS needs a fixed workspace layout for deterministic results; ":4096:8" is one of the
# two values the CUDA docs allow (":16:8" is the other, smaller and slower).
CUBLAS_WORKSPACE_CONFIG = ":4096:8"

_MAX_SEED = 2**32 - 1  # numpy's legacy seeding rejects anything larger


def resolve_device(spec: str, what: str = "train.device") -> torch.device:
    """`auto` -> the current accelerator if there is one, else cpu; validates explicit devices.
    `what` names the setting in error messages."""
    if spec == "auto":
        accel = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        return torch.device(accel) if accel is not None else torch.device("cpu")
    try:
        device = torch.device(spec)
    except RuntimeError:
        raise UserError(f"{what} = '{spec}' is not a device; use auto, cpu, cuda or cuda:N") from None
    if device.type != "cpu":
        accel = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
        if accel is None or accel.type != device.type:
            raise UserError(f"{what} = '{spec}' but this machine has no {device.type} device; use cpu or auto")
    return device


def seed_all(seed: int) -> None:
    """Seed Python's `random`, numpy's global RNG and torch's RNGs on every device.

    Does not cover hash randomisation (PYTHONHASHSEED must be set before Python starts)
    nor RNGs created by other libraries with their own seeds.
    """
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= _MAX_SEED:
        raise UserError(f"seed must be an integer in [0, {_MAX_SEED}], got {seed!r}")
    random.seed(seed)
    try:
        import numpy as np
    except ImportError:  # numpy is optional for slipstream itself
        pass
    else:
        np.random.seed(seed)
    # torch.manual_seed seeds the CPU generator and every accelerator device's generator
    # (CUDA included, lazily if CUDA is not initialised yet), so no torch.cuda call is
    # needed here and the CPU path never touches CUDA.
    torch.manual_seed(seed)


def set_deterministic(enabled: bool, device: str | torch.device | None = None) -> None:
    """Turn deterministic algorithms on or off for torch and cuDNN.

    With `enabled`, an op that has no deterministic implementation raises an error rather
    than silently giving run-to-run differences (warn_only=False), and cuDNN autotuning
    is off (it may pick different kernels per run). Disabling restores torch's defaults
    for speed: nondeterministic ops allowed, cuDNN autotuning on.

    On CUDA (`device` of type cuda, or `device=None` while CUDA is the accelerator),
    enabling also sets CUBLAS_WORKSPACE_CONFIG=":4096:8" unless it is already set, because
    deterministic cuBLAS requires it. cuBLAS reads it when it creates its handle, so it only
    takes effect if this runs before the first CUDA matmul in the process; to be safe, set
    it in the shell environment or call this function before any CUDA work.
    """
    if not isinstance(enabled, bool):
        raise UserError(f"enabled must be True or False, got {enabled!r}")
    torch.use_deterministic_algorithms(enabled, warn_only=False)
    # These are plain flags in torch.backends; setting them never initialises CUDA.
    torch.backends.cudnn.deterministic = enabled
    torch.backends.cudnn.benchmark = not enabled
    if enabled and _is_cuda(device) and "CUBLAS_WORKSPACE_CONFIG" not in os.environ:
        os.environ["CUBLAS_WORKSPACE_CONFIG"] = CUBLAS_WORKSPACE_CONFIG
        if torch.cuda.is_initialized():
            warnings.warn(
                "set CUBLAS_WORKSPACE_CONFIG after CUDA was initialised; cuBLAS matmuls may "
                f"stay nondeterministic. Export CUBLAS_WORKSPACE_CONFIG={CUBLAS_WORKSPACE_CONFIG} "
                "before starting Python.",
                stacklevel=2,
            )


def _is_cuda(device: str | torch.device | None) -> bool:
    if device is not None:
        try:
            return torch.device(device).type == "cuda"
        except (RuntimeError, TypeError) as exc:
            raise UserError(f"invalid device {device!r}: {exc}") from exc
    # Device-generic query: does not touch torch.cuda on a CPU-only machine.
    if not torch.accelerator.is_available():
        return False
    current = torch.accelerator.current_accelerator()
    return current is not None and current.type == "cuda"


def configure_tf32(device: torch.device, enabled: bool) -> None:
    """TF32 is a CUDA tensor-core mode; on CPU the switch has nothing to change."""
    if device.type != "cuda":
        return
    torch.backends.cuda.matmul.allow_tf32 = enabled
    torch.backends.cudnn.allow_tf32 = enabled


def configure_runtime(cfg: Config, device: torch.device) -> None:
    """Threads, determinism and TF32: process-wide settings, applied once per run."""
    configure_tf32(device, cfg.precision.tf32)
    if cfg.train.threads:
        torch.set_num_threads(cfg.train.threads)
    if cfg.train.deterministic:
        set_deterministic(True, device)
