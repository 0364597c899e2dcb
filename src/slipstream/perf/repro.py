"""Reproducibility record: capture the setup that can change a benchmark's numbers.

A benchmark or experiment that cannot be re-run to the same numbers cannot be trusted or
debugged. `slipstream.runtime.seed_all` and `slipstream.runtime.set_deterministic` make a
run repeatable; `capture_environment` records everything else that can change the numbers
(versions, hardware, threads, flags).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from slipstream.observe.env import collect_env, to_jsonable

# Environment variables that decide how many threads the CPU math libraries use.
THREAD_ENV_VARS = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "KMP_AFFINITY",
    "OMP_PROC_BIND",
)


def capture_environment() -> dict[str, Any]:
    """`collect_env()` plus the determinism and threading state that change results.

    JSON-serialisable; store it next to every benchmark result.
    """
    env = collect_env()
    env.update(
        {
            "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
            "deterministic_warn_only": torch.is_deterministic_algorithms_warn_only_enabled(),
            "cudnn_enabled": torch.backends.cudnn.enabled,
            "cudnn_deterministic": torch.backends.cudnn.deterministic,
            "cudnn_benchmark": torch.backends.cudnn.benchmark,
            "float32_matmul_precision": torch.get_float32_matmul_precision(),
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG"),
            "torch_num_threads": torch.get_num_threads(),
            "torch_num_interop_threads": torch.get_num_interop_threads(),
            "thread_env": {name: os.environ.get(name) for name in THREAD_ENV_VARS},
        }
    )
    return to_jsonable(env)
