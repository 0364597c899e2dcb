"""Tests for slipstream.observe.env: environment capture and atomic JSON writes."""

import json
import math
import subprocess

import numpy as np
import pytest
import torch

from slipstream.observe import env


@pytest.fixture
def no_git(monkeypatch):
    # Keep tests independent of whichever repository they run in.
    monkeypatch.setattr(env, "git_info", lambda cwd=None: {"git_sha": None, "git_dirty": None})


def test_collect_env_has_keys_and_is_json(no_git):
    info = env.collect_env()
    for key in (
        "timestamp", "python_version", "torch_version", "torch_cuda_version", "platform",
        "hostname", "cpu_model", "cpu_logical_cores", "torch_num_threads", "omp_num_threads",
        "accelerator", "accelerator_count", "devices", "git_sha", "git_dirty", "packages", "argv",
    ):
        assert key in info, key
    assert info["torch_version"] == torch.__version__
    assert info["torch_num_threads"] == torch.get_num_threads()
    assert info["packages"]["numpy"] == np.__version__
    assert set(env.KEY_PACKAGES) <= set(info["packages"])
    assert info["cpu_model"]
    json.loads(json.dumps(info, allow_nan=False))


def _fake_run(responses):
    def run(cmd, **kwargs):
        key = cmd[1] if cmd[1] != "--no-optional-locks" else cmd[2]
        code, out = responses[key]
        return subprocess.CompletedProcess(cmd, code, stdout=out, stderr="")

    return run


def test_git_info_clean_dirty_and_not_a_repo(monkeypatch, tmp_path):
    monkeypatch.setattr(env.subprocess, "run", _fake_run({"rev-parse": (0, "abc123\n"), "status": (0, "")}))
    assert env.git_info(str(tmp_path)) == {"git_sha": "abc123", "git_dirty": False}
    monkeypatch.setattr(env.subprocess, "run", _fake_run({"rev-parse": (0, "abc123\n"), "status": (0, " M x.py\n")}))
    assert env.git_info(str(tmp_path)) == {"git_sha": "abc123", "git_dirty": True}
    monkeypatch.setattr(env.subprocess, "run", _fake_run({"rev-parse": (128, "")}))
    monkeypatch.delenv("SLIPSTREAM_GIT_SHA", raising=False)
    assert env.git_info(str(tmp_path)) == {"git_sha": None, "git_dirty": None}
    # A copy of the tree without .git (a container, a remote machine) says its sha this way.
    monkeypatch.setenv("SLIPSTREAM_GIT_SHA", "def456")
    assert env.git_info(str(tmp_path)) == {"git_sha": "def456", "git_dirty": None}


def test_git_info_git_missing_or_hanging(monkeypatch, tmp_path):
    def missing(cmd, **kwargs):
        raise FileNotFoundError("git")

    monkeypatch.setattr(env.subprocess, "run", missing)
    assert env.git_info(str(tmp_path))["git_sha"] is None

    def hangs(cmd, **kwargs):
        raise subprocess.TimeoutExpired(cmd, kwargs.get("timeout"))

    monkeypatch.setattr(env.subprocess, "run", hangs)
    assert env.git_info(str(tmp_path))["git_sha"] is None


def test_write_json_atomic(tmp_path):
    path = tmp_path / "sub" / "env.json"
    env.write_json_atomic(path, {"b": 1, "a": float("nan"), "t": torch.tensor(2.5), "n": np.int64(3)})
    env.write_json_atomic(path, {"b": 2, "a": float("inf"), "t": torch.tensor(2.5), "n": np.int64(3)})
    text = path.read_text()
    assert json.loads(text) == {"a": None, "b": 2, "n": 3, "t": 2.5}
    assert text.index('"a"') < text.index('"b"')  # sort_keys
    assert [p.name for p in path.parent.iterdir()] == ["env.json"]  # no temp files left


def test_write_json_atomic_cleans_up_on_failure(tmp_path, monkeypatch):
    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(env.os, "replace", failing_replace)
    with pytest.raises(OSError):
        env.write_json_atomic(tmp_path / "x.json", {"a": 1})
    assert list(tmp_path.iterdir()) == []


def test_to_jsonable():
    out = env.to_jsonable(
        {"t": torch.tensor([1.0, math.inf]), "f": np.float32(0.5), "d": torch.bfloat16, "s": {1}}
    )
    assert out == {"t": [1.0, None], "f": 0.5, "d": "torch.bfloat16", "s": [1]}
