"""parallel.cp_attention = ring: refused where torch's ring attention cannot run (each refusal
naming the fix), torch's head-tail layout equal to parallel.cp_load_balance's, torch's merge
unable to take CUDA's padded log-sum-exp (why chunks of 32 tokens), and a torch without the ring
named with its fix. No process group: tests/distributed/test_ring_attention.py runs the ring itself."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from slipstream.config import load_config
from slipstream.config.load import RING_QUERY_ALIGN
from slipstream.distributed import ring_attention
from slipstream.distributed.context_parallel import check_context_parallel, local_positions
from slipstream.errors import UserError

RING = ["--parallel.cp=2", "--parallel.cp_attention=ring", "--train.seq_len=128"]  # chunks of 32 tokens
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
        with pytest.raises(UserError, match=r"this run's device \(cpu\) does not have") as e:
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


def test_ring_refuses_activation_offload():
    """Offload's pinned copies (save_on_cpu(pin_memory=True) on CUDA) cannot take the DTensors the
    ring saves; full and selective checkpointing can."""
    with pytest.raises(UserError, match="activations.checkpointing = offload") as e:
        load_config(overrides=RING + ["--activations.checkpointing=offload"])
    assert FIX in str(e.value) and "--activations.checkpointing=full" in str(e.value)
    for ac in ("full", "selective"):
        load_config(overrides=RING + [f"--activations.checkpointing={ac}"])
    load_config(overrides=["--parallel.cp=2", "--train.seq_len=128", "--activations.checkpointing=offload"])


@pytest.mark.parametrize("balanced,cp,seq_len,ok", [
    (True, 2, 128, True),     # chunks of 128 / 4 = 32 queries
    (True, 2, 64, False),     # 16: the efficient kernel's log-sum-exp comes back padded to 32
    (True, 4, 256, True),
    (True, 4, 384, False),    # 48
    (False, 2, 64, True),     # contiguous: every step takes the rank's 64 / 2 = 32 queries
    (False, 2, 96, False),    # 48
    (False, 3, 96, True),
])
def test_ring_needs_chunks_of_a_multiple_of_32_tokens(balanced, cp, seq_len, ok):
    overrides = ["--parallel.cp_attention=ring", f"--parallel.cp={cp}", f"--parallel.cp_load_balance={balanced}",
                 f"--train.seq_len={seq_len}", "--model.max_seq_len=1024"]
    if ok:
        load_config(overrides=overrides)
        return
    with pytest.raises(UserError, match=f"train.seq_len = {seq_len}") as e:
        load_config(overrides=overrides)
    unit = RING_QUERY_ALIGN * (2 * cp if balanced else cp)  # seq_len in whole chunks of 32 tokens
    assert f"divisible by {unit}" in str(e.value) and FIX in str(e.value)
    below, above = seq_len // unit * unit, (seq_len // unit + 1) * unit  # the nearest valid lengths
    assert (f"e.g. {below} or {above}" if below else f"e.g. {above}") in str(e.value)
    # Checked again for a Config built in code, before the device.
    cfg = load_config(overrides=overrides[1:])
    cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, cp_attention="ring"))
    with pytest.raises(UserError, match=f"divisible by {unit}"):
        check_context_parallel(cfg, cp, 1, torch.device("cuda"))
    load_config(overrides=overrides[1:])  # the allgather kernel takes any chunk length


@pytest.mark.parametrize("chunk", [16, 32, 48])
def test_torch_merge_takes_the_efficient_kernels_lse_only_at_32_queries(chunk):
    """Why the rule above: a load-balanced ring step on rank 0 after the first runs the second local
    chunk's queries and merges them into the first step's result (torch's _SDPAMerger, partial).
    CUDA's memory-efficient kernel returns the log-sum-exp of L queries padded to ceil(L / 32) * 32
    (torch/_meta_registrations.py); torch's merge then meets the unpadded output unless L is a
    multiple of 32. If torch learns to slice the padding this fails, and the rule can go."""
    torch_cp = ring_attention.torch_ring_attention()

    def step(queries):  # one fused step's output and its log-sum-exp as CUDA's efficient kernel returns them
        return torch.zeros(1, 2, queries, 8), torch.zeros(1, 2, math.ceil(queries / 32) * 32)

    merger = torch_cp._SDPAMerger(convert_to_f32=True, seq_dim=2)
    merger.step(*step(2 * chunk), partial=False)
    if chunk % RING_QUERY_ALIGN:
        with pytest.raises(RuntimeError):
            merger.step(*step(chunk), partial=True)
    else:
        merger.step(*step(chunk), partial=True)
        out, lse = merger.results()
        assert out.shape == (1, 2, 2 * chunk, 8) and lse.shape == (1, 2, 2 * chunk)


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
