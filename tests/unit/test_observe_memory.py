"""Tests for slipstream.observe.memory."""

import torch

from slipstream.observe import memory


def test_cpu_memory_is_process_rss():
    memory.reset_peak_memory("cpu")  # a no-op on CPU, must not fail
    peak = memory.peak_memory_bytes("cpu")
    current = memory.current_memory_bytes(torch.device("cpu"))
    assert peak > 10 * 2**20  # a Python process with torch loaded is well above 10 MiB
    assert current > 0
    assert peak >= current * 0.9  # both are RSS; allow for page-size rounding


def test_cuda_device_routes_to_torch_cuda(monkeypatch):
    # No CUDA here: check the dispatch by device type with stand-ins.
    seen = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: seen.append(d) or 123)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda d=None: 45)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: seen.append(("reset", d)))
    assert memory.peak_memory_bytes("cuda:1") == 123
    assert memory.current_memory_bytes("cuda") == 45
    memory.reset_peak_memory("cuda:1")
    assert seen == [torch.device("cuda:1"), ("reset", torch.device("cuda:1"))]
