"""The memory model's architecture options and attention implementations (issue 19): each option
changes the planned bytes by the hand-computed amount, and equals what a real forward keeps alive
(fp32, as tests/unit/test_plan_memory.py checks the base blocks); materialized attention keeps the
softmax (B x heads x T x T per layer); fp16 on the FSDP family is planned as bf16 is."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.models.transformer import build_model, mlp_hidden
from slipstream.optimize.activations import activation_memory_bytes, apply_activation_checkpointing
from slipstream.plan.accuracy import TARGET_ERROR, plan_case
from slipstream.plan.accuracy_cases import Case, architecture_cases
from slipstream.plan.accuracy_measure import measure_case
from slipstream.plan.experts import experts_of
from slipstream.plan.memory import estimate_memory
from slipstream.plan.memory_activations import block_activation_bytes
from slipstream.plan.model import resolve_model
from slipstream.plan.space import PlanModel, Strategy

BATCH, SEQ = 4, 64
N = BATCH * SEQ   # tokens of a micro-batch


def _cfg(preset: str, **overrides) -> ModelConfig:
    return ModelConfig(**{**PRESETS[preset], "preset": preset, "vocab_size": 256, **overrides})


def _kept(cfg: ModelConfig, ac: str = "none") -> int:
    """Bytes a real forward of BATCH x SEQ tokens keeps alive for backward (fp32)."""
    torch.manual_seed(0)
    model = apply_activation_checkpointing(build_model(cfg), ac)
    idx = torch.randint(0, 256, (BATCH, SEQ))
    return activation_memory_bytes(model, lambda: idx)


def _block(preset: str, s: Strategy, tokens: int = N, **overrides) -> int:
    cfg = _cfg(preset, **overrides)
    return block_activation_bytes(PlanModel(preset, cfg), tokens, s, seq_len=SEQ if tokens == N else None)


# ---------------------------------------------------------------- against autograd

@pytest.mark.parametrize("preset,overrides,ac", [
    ("tiny", {"mlp": "relu"}, "none"), ("llama-tiny", {"mlp": "relu"}, "selective"),
    ("tiny", {"parallel_block": True}, "none"), ("llama-tiny", {"parallel_block": True}, "none"),
    ("tiny", {"parallel_block": True, "mlp": "relu"}, "selective"),
])
def test_option_block_bytes_equal_what_autograd_keeps(preset, overrides, ac):
    """Per block (a 2-block model's forward minus a 1-block one's), the planned bytes are the
    storages a real forward keeps alive, to 1 %."""
    kept = [_kept(_cfg(preset, n_layer=n, **overrides), ac) for n in (1, 2)]
    planned = _block(preset, Strategy(ac=ac, precision="fp32"), **overrides)
    assert planned == pytest.approx(kept[1] - kept[0], rel=0.01)


def test_partial_rotary_keeps_what_full_rotary_keeps():
    """Partial rotary keeps q and k in their projection's layout: SDPA's output keeps it too and
    o_proj's input is a view of it, as with a full rotation (the rotation multiplies by tables)."""
    kept = [_kept(_cfg("llama-tiny", n_layer=n, rotary_fraction=0.25)) for n in (1, 2)]
    assert _block("llama-tiny", Strategy(precision="fp32"), rotary_fraction=0.25) == pytest.approx(kept[1] - kept[0], rel=0.01)


def test_alibi_blocks_share_one_bias():
    kept = [_kept(_cfg("llama-tiny", n_layer=n, position="alibi")) for n in (1, 2)]
    assert _block("llama-tiny", Strategy(precision="fp32"), position="alibi") == pytest.approx(kept[1] - kept[0], rel=0.01)


def test_embedding_norm_keeps_its_input_and_statistics_per_forward():
    """A norm after the embedding keeps its input (n d, fp32) and its statistics (layer norm: mean
    and rstd, 2 n fp32; RMS norm: rstd and the composite kernel's normalized input n d)."""
    for preset, hand in (("tiny", N * 64 * 4 + 2 * N * 4), ("llama-tiny", 2 * N * 64 * 4 + N * 4)):
        measured = _kept(_cfg(preset, n_layer=1, embedding_norm=True)) - _kept(_cfg(preset, n_layer=1))
        assert measured == hand, preset
        model = PlanModel(preset, _cfg(preset, n_layer=2))
        s = Strategy(micro_batch=BATCH, precision="fp32", ac="full")
        with_norm = estimate_memory(PlanModel(preset, _cfg(preset, n_layer=2, embedding_norm=True)), s, SEQ, device="cpu")
        without = estimate_memory(model, s, SEQ, device="cpu")
        assert with_norm.peak_phase == without.peak_phase
        assert with_norm.breakdown["activations"] - without.breakdown["activations"] == hand, preset


# ---------------------------------------------------------------- hand-computed differences

def test_relu_keeps_one_hidden_tensor_less_than_gelu():
    """relu's backward reads its own output, the tensor the down matmul keeps: n F a, not gelu's 2 n F a."""
    for precision, a in (("fp32", 4), ("bf16", 2)):
        hidden = mlp_hidden(_cfg("tiny"))
        s = Strategy(precision=precision)
        assert _block("tiny", s, mlp="gelu") - _block("tiny", s, mlp="relu") == N * hidden * a
        for ac in ("selective", "full"):   # selective keeps the up matmul's output either way
            assert _block("tiny", s.replace(ac=ac), mlp="gelu") == _block("tiny", s.replace(ac=ac), mlp="relu")
    # MoE experts too: the routed rows' hidden tensor once, not twice
    moe, s = PlanModel("moe-tiny", _cfg("moe-tiny")), Strategy(precision="fp32")
    assert experts_of(moe).hidden > 0
    relu = PlanModel("moe-tiny", _cfg("moe-tiny", mlp="relu"))
    gelu = PlanModel("moe-tiny", _cfg("moe-tiny", mlp="gelu"))
    rows = N * moe.cfg.moe_top_k * experts_of(moe).hidden
    assert block_activation_bytes(gelu, N, s, moe=True) - block_activation_bytes(relu, N, s, moe=True) == rows * 4


def test_parallel_block_keeps_no_mid_block_residual():
    """x + attn(n1 x) + mlp(n2 x): both norms read x, so the n d residual between them is gone
    (r bytes: fp32 under autocast, bf16 under FSDP mixed precision, split by sequence parallel)."""
    d = _cfg("tiny").d_model
    for s, r, split in ((Strategy(precision="fp32"), 4, 1), (Strategy(precision="bf16"), 4, 1),
                        (Strategy("fsdp", dp=8, precision="bf16"), 2, 1), (Strategy(tp=2, precision="bf16"), 4, 2)):
        assert _block("tiny", s) - _block("tiny", s, parallel_block=True) == N * d * r // split, s.label()
        assert _block("tiny", s.replace(ac="selective")) == _block("tiny", s.replace(ac="selective"), parallel_block=True)


def test_partial_rotary_changes_no_planned_bytes():
    for ac in ("none", "selective", "full"):
        s = Strategy(precision="bf16", ac=ac)
        assert _block("llama-tiny", s, rotary_fraction=0.25) == _block("llama-tiny", s)


def test_alibi_bias_is_planned_once_per_forward():
    """ALiBi's (heads, T, T) bias in the attention dtype, built once per forward and kept by every
    layer's fused kernel: heads x T^2 x a per micro-batch in flight, whatever the batch or the
    number of layers; split by tp (each rank its own heads); none with materialized scores (added
    to them, then let go)."""
    for precision, a in (("fp32", 4), ("bf16", 2)):
        for layers in (2, 4):
            for mb in (1, 4):
                s = Strategy(micro_batch=mb, precision=precision, ac="full")
                alibi = PlanModel("a", _cfg("llama-tiny", n_layer=layers, position="alibi"))
                rope = PlanModel("r", _cfg("llama-tiny", n_layer=layers))
                diff = (estimate_memory(alibi, s, SEQ, device="cpu").breakdown["activations"]
                        - estimate_memory(rope, s, SEQ, device="cpu").breakdown["activations"])
                assert diff == 4 * SEQ * SEQ * a, (precision, layers, mb)
    s = Strategy(tp=2, precision="bf16", ac="full")
    alibi, rope = PlanModel("a", _cfg("llama-tiny", position="alibi")), PlanModel("r", _cfg("llama-tiny"))
    acts = [estimate_memory(m, s, SEQ, device="cpu").breakdown["activations"] for m in (alibi, rope)]
    assert acts[0] - acts[1] == 2 * SEQ * SEQ * 2
    materialized = s.replace(tp=1, attention="materialized", ac="none")
    assert _block("llama-tiny", materialized, position="alibi") == _block("llama-tiny", materialized)


def test_materialized_attention_keeps_the_softmax_per_layer():
    """Materialized scores add B x heads x T x T x a per layer (the softmax probabilities) and drop
    the fused kernel's log-sum-exp (B x T x heads fp32); they grow with T^2 where flash grows with T."""
    heads = _cfg("tiny").n_head
    for precision, a in (("fp32", 4), ("bf16", 2)):
        flash = Strategy(micro_batch=BATCH, precision=precision)
        mat = flash.replace(attention="materialized")
        for seq in (SEQ, 2 * SEQ):
            n = BATCH * seq
            added = _block("tiny", mat, n) - _block("tiny", flash, n)
            assert added == BATCH * heads * seq * seq * a - n * heads * 4, (precision, seq)
        # flash: linear in T; materialized: its T^2 term x4 when T doubles
        assert _block("tiny", flash, 2 * N) == 2 * _block("tiny", flash, N)
        grown = _block("tiny", mat, 2 * N) - 2 * _block("tiny", mat, N)
        assert grown == 2 * BATCH * heads * SEQ * SEQ * a
        assert _block("tiny", flash.replace(attention="efficient"), N) == _block("tiny", flash, N)
    # GQA: the materialized kernel keeps k and v repeated to every head (3 n d, not n (d + 2 d_kv))
    cfg = _cfg("llama-tiny")
    kv = cfg.n_kv_head * cfg.d_model // cfg.n_head
    s = Strategy(micro_batch=BATCH, precision="fp32")
    added = _block("llama-tiny", s.replace(attention="materialized")) - _block("llama-tiny", s)
    assert added == BATCH * cfg.n_head * SEQ * SEQ * 4 - N * cfg.n_head * 4 + N * (2 * cfg.d_model - 2 * kv) * 4
    # dropout: its mask (1 byte) and its output (a bytes) per score
    dropped = _block("tiny", s.replace(attention="materialized"), dropout=0.1)
    assert dropped - _block("tiny", s.replace(attention="materialized")) == BATCH * heads * SEQ * SEQ * (1 + 4)


def test_selective_recomputes_a_materialized_core():
    """Megatron's selective recomputation re-runs QK^T, softmax and AV: no T x T matrix kept, and
    no log-sum-exp either."""
    s = Strategy(micro_batch=BATCH, precision="bf16", ac="selective")
    heads = _cfg("tiny").n_head
    assert _block("tiny", s) - _block("tiny", s.replace(attention="materialized")) == N * heads * 4


def test_materialized_attention_grows_the_planned_step():
    """The whole step: every layer's softmax on top (and k, v repeated to the 32 heads from 8)."""
    model = resolve_model("llama-8b")
    flash = Strategy("fsdp", dp=8, micro_batch=1, precision="bf16")
    mat = flash.replace(attention="materialized")
    for seq in (2048, 8192):
        extra = (estimate_memory(model, mat, seq).breakdown["activations"]
                 - estimate_memory(model, flash, seq).breakdown["activations"])
        per_layer = 32 * seq * seq * 2 - seq * 32 * 4 + seq * (2 * 4096 - 2 * 1024) * 2
        assert extra == pytest.approx(model.cfg.n_layer * per_layer, rel=0.02), seq
    assert estimate_memory(model, mat.replace(ac="full"), 8192).total_bytes > \
        estimate_memory(model, flash.replace(ac="full"), 8192).total_bytes


# ---------------------------------------------------------------- fp16

def test_fp16_is_planned_as_bf16_on_every_strategy():
    """fp16 runs as bf16 does (autocast, or FSDP mixed precision with a sharded grad scaler, which
    keeps nothing per parameter): the same bytes; never as fp32."""
    model = resolve_model("llama-8b")
    for s in (Strategy(precision="bf16"), Strategy("fsdp", dp=8, precision="bf16"),
              Strategy("hsdp", dp=16, dp_shard=8, precision="bf16"), Strategy("zero2", dp=8, precision="bf16"),
              Strategy("ddp", dp=8, precision="bf16", ac="selective"), Strategy("fsdp", dp=8, pp=2, grad_accum=4,
                                                                              precision="bf16")):
        bf16 = estimate_memory(model, s, 4096)
        fp16 = estimate_memory(model, s.replace(precision="fp16"), 4096)
        assert (fp16.total_bytes, fp16.breakdown) == (bf16.total_bytes, bf16.breakdown), s.label()
        assert fp16.total_bytes != estimate_memory(model, s.replace(precision="fp32"), 4096).total_bytes


# ---------------------------------------------------------------- a whole step, measured

@pytest.mark.parametrize("label", [
    "tiny[n_layer=4,d_model=128,n_head=4,mlp=relu] seq128 bf16 none mb8x1",
    "tiny[n_layer=4,d_model=128,n_head=4] seq128 fp32 none mb8x1 ac:full materialized",
])
def test_option_steps_within_the_grids_tolerance(label):
    """Whole training steps (MemTracker) of grid cases with an option on, within the grid's 10 %
    (the NeoX-like combination and plain materialized attention run in test_plan_memory's
    stratified subset; the grid has every option)."""
    (case,) = [c for c in architecture_cases() if c.label() == label]
    measured = measure_case(case, threads=1)
    assert abs(plan_case(case) / measured - 1) <= TARGET_ERROR
    assert dataclasses.is_dataclass(Case)
