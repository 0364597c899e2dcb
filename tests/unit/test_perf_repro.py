"""Tests for slipstream.runtime (seeding, determinism switches) and slipstream.perf.repro
(environment capture)."""

import json
import os
import random

import numpy as np
import pytest
import torch

from slipstream.errors import UserError
from slipstream.observe import env
from slipstream import runtime
from slipstream.perf import repro


@pytest.fixture
def restore_determinism(monkeypatch):
    # These are process-wide flags; leaking them would change other tests' behaviour.
    saved = (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)  # monkeypatch restores it
    yield
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
    torch.backends.cudnn.deterministic = saved[2]
    torch.backends.cudnn.benchmark = saved[3]


def _draw():
    return torch.rand(4).tolist(), random.random(), np.random.rand(3).tolist()


def test_seed_all_repeats_every_rng():
    runtime.seed_all(1234)
    first = _draw()
    runtime.seed_all(1234)
    assert _draw() == first
    runtime.seed_all(4321)
    assert _draw() != first


@pytest.mark.parametrize("bad", [-1, 2**32, 1.5, "1", True])
def test_seed_all_rejects_bad_seeds(bad):
    with pytest.raises(UserError):
        runtime.seed_all(bad)


def test_set_deterministic_toggles(restore_determinism):
    runtime.set_deterministic(True, device="cpu")
    assert torch.are_deterministic_algorithms_enabled()
    assert not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert "CUBLAS_WORKSPACE_CONFIG" not in os.environ  # only needed on CUDA
    runtime.set_deterministic(False, device="cpu")
    assert not torch.are_deterministic_algorithms_enabled()
    assert not torch.backends.cudnn.deterministic and torch.backends.cudnn.benchmark


def test_set_deterministic_cuda_sets_cublas_config_if_unset(restore_determinism, monkeypatch):
    runtime.set_deterministic(True, device="cuda")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # A value the user chose is kept.
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    runtime.set_deterministic(True, device="cuda")
    assert os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"


def test_set_deterministic_rejects_non_bool(restore_determinism):
    with pytest.raises(UserError):
        runtime.set_deterministic("yes")


def test_capture_environment_keys_and_json(monkeypatch):
    # Keep the test independent of whichever repository it runs in (and fast).
    monkeypatch.setattr(env, "git_info", lambda cwd=None: {"git_sha": None, "git_dirty": None})
    info = repro.capture_environment()
    for key in (
        "torch_version", "cpu_model", "git_sha",  # from collect_env
        "deterministic_algorithms", "deterministic_warn_only", "cudnn_enabled",
        "cudnn_deterministic", "cudnn_benchmark", "torch_num_threads",
        "torch_num_interop_threads", "thread_env", "cublas_workspace_config",
    ):
        assert key in info, key
    assert info["deterministic_algorithms"] == torch.are_deterministic_algorithms_enabled()
    assert info["torch_num_interop_threads"] == torch.get_num_interop_threads()
    assert "OMP_NUM_THREADS" in info["thread_env"] and "MKL_NUM_THREADS" in info["thread_env"]
    json.dumps(info, allow_nan=False)
