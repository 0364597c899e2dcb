"""parallel.cp_attention = ring: refused where torch's ring attention cannot run (each refusal
naming the fix), torch's head-tail layout equal to parallel.cp_load_balance's, and a torch
without the ring named with its fix. No process group: tests/distributed/test_ring_attention.py
runs the ring itself."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.config import load_config
from slipstream.distributed import ring_attention
from slipstream.distributed.context_parallel import check_context_parallel, local_positions
from slipstream.errors import UserError

RING = ["--parallel.cp=2", "--parallel.cp_attention=ring", "--train.seq_len=64"]
FIX = "--parallel.cp_attention=allgather"


def test_allgather_is_the_default_and_ring_loads_for_cuda():
    assert load_config(overrides=["--parallel.cp=2"]).parallel.cp_attention == "allgather"
    cfg = load_config(overrides=RING + ["--train.device=cuda"])  # config-only rules: no device needed yet
    assert cfg.parallel.cp_attention == "ring"
    with pytest.raises(UserError, match="allgather, ring"):
        load_config(overrides=["--parallel.cp_attention=rings"])


def test_ring_on_cpu_is_refused_when_loaded_and_when_the_device_is_known():
    with pytest.raises(UserError, match="train.device = cpu") as e:
        load_config(overrides=RING + ["--train.device=cpu"])
    assert FIX in str(e.value)
    cfg = load_config(overrides=RING)  # train.device = auto: decided by the machine
    for device in (torch.device("cpu"), None):  # None: resolved from auto (this machine has no GPU)
        if device is None and torch.cuda.is_available():
            continue
        with pytest.raises(UserError, match="this run is on cpu") as e:
            check_context_parallel(cfg, 2, 1, device)
        assert FIX in str(e.value)
    check_context_parallel(cfg, 1, 1, torch.device("cpu"))  # cp = 1: no context parallelism, nothing to refuse
    allgather = load_config(overrides=["--parallel.cp=2", "--train.seq_len=64"])
    check_context_parallel(allgather, 2, 1, torch.device("cpu"))


def test_ring_refuses_document_masks_dropout_and_fullgraph():
    with pytest.raises(UserError, match="data.packing = document") as e:
        load_config(overrides=RING + ["--data.packing=document"])
    assert "--data.packing=eos" in str(e.value)
    with pytest.raises(UserError, match="model.dropout = 0.1") as e:
        load_config(overrides=RING + ["--model.dropout=0.1"])
    assert FIX in str(e.value) and "--model.dropout=0" in str(e.value)
    with pytest.raises(UserError, match="compile.fullgraph") as e:
        load_config(overrides=RING + ["--compile.scope=blocks", "--compile.fullgraph=true"])
    assert "--compile.fullgraph=false" in str(e.value)
    load_config(overrides=RING + ["--compile.scope=blocks"])  # graph breaks allowed: the ring runs eagerly
    # A Config built in code was never loaded: the cp check refuses it too, before the device.
    cfg = load_config(overrides=RING + ["--train.device=cuda"])
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, dropout=0.1))
    with pytest.raises(UserError, match="model.dropout"):
        check_context_parallel(cfg, 2, 1, torch.device("cuda"))


@pytest.mark.parametrize("cp", [2, 3, 4])
def test_torch_head_tail_layout_is_cp_load_balance(cp):
    """torch's ring with enable_load_balance reads each rank's shard as its _HeadTailLoadBalancer
    lays it out; slipstream's trainer splits batches by local_positions."""
    torch_cp = ring_attention.torch_ring_attention()
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    seq_len = 2 * cp * 3
    order = _HeadTailLoadBalancer(seq_len, cp, "cpu")._generate_indices()[0]
    for rank in range(cp):
        assert order.chunk(cp)[rank].tolist() == local_positions(seq_len, cp, rank, True).tolist()
    assert hasattr(torch_cp._cp_options, "enable_load_balance")


def test_a_torch_without_the_ring_names_the_version_and_the_fix(monkeypatch):
    monkeypatch.setattr(ring_attention, "_TORCH_CP_MODULES", ("torch.distributed.tensor.experimental._no_such_module",))
    with pytest.raises(UserError, match=torch.__version__.replace("+", r"\+")) as e:
        ring_attention.torch_ring_attention()
    assert FIX in str(e.value) and "torch >= 2.10" in str(e.value)
