"""The time model's costs per operation class (plan/timing_compute.py, plan/efficiency.py), against hand
computations: each switch (activation checkpointing, attention implementation, sequence parallel,
uneven pipeline stages, GPU generation, calibration) moves the prediction the right way by the
right amount, and the CPU calibration's committed predictions are today's."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from slipstream.models.flops import flops_per_token, param_count
from slipstream.models.transformer import mlp_hidden, padded_vocab_size
from slipstream.plan import efficiency
from slipstream.plan.efficiency import FITTED, Fit
from slipstream.plan.hardware import make_cluster
from slipstream.plan.model import resolve_model
from slipstream.plan.space import PlanModel, Strategy, Workload
from slipstream.plan.timing import estimate_time
from slipstream.plan.timing_comm import step_collectives
from slipstream.plan.timing_compute import (ALIBI_BIAS_READS_BACKWARD, ALIBI_BIAS_READS_FORWARD, ALIBI_SCORE_PASSES,
                                            CAUSAL_WORK, FUSED_ATTENTION_BACKWARD, PARTIAL_ROPE_OPS,
                                            POINTWISE_BACKWARD, ROPE_OPS, SCORE_PASSES_BACKWARD,
                                            SCORE_PASSES_FORWARD, attention_kernel, gemm_seconds)

ROOT = Path(__file__).resolve().parents[2]
T = 4096
WORK = Workload(seq_len=T, global_batch=8)
# one GPU, 4 micro-batches of 2 sequences, bf16 under autocast: residual stream fp32 (4), matmul outputs bf16 (2)
S = Strategy(micro_batch=2, grad_accum=4, precision="bf16")
R, A = 4, 2


@pytest.fixture(scope="module")
def llama():
    return resolve_model("llama-8b", seq_len=T)


@pytest.fixture(scope="module")
def gpt():
    """A GPT-2 block (LayerNorm, GELU, learned positions) at 1.3B width, sized so that the device,
    not the host's launches, bounds every pass on an H100."""
    cfg = dataclasses.replace(resolve_model("gpt2").cfg, n_layer=24, d_model=2048, n_head=16, max_seq_len=T)
    return PlanModel("gpt-1.3b", cfg)


@pytest.fixture(scope="module")
def h100():
    return make_cluster("1xH100")


def _bandwidth(cluster) -> float:
    return cluster.gpu.mem_bw_gbs * 1e9 * efficiency.rates(cluster.gpu.generation).pointwise


def _pointwise_forward_bytes(cfg, tokens: float) -> float:
    """A block's pointwise forward, by hand: two norms (read the fp32 stream, write bf16), two residual
    adds (read 2, write 1, fp32), the attention output's layout copy, the activation (GELU read +
    write, SwiGLU reads two and writes one) and RoPE on q and k (read + write)."""
    d, hidden = cfg.d_model, mlp_hidden(cfg)
    kv = (cfg.n_kv_head or cfg.n_head) * d // cfg.n_head
    total = 2 * tokens * d * (R + A) + 2 * 3 * tokens * d * R + 2 * tokens * d * A
    total += (3 if cfg.mlp == "swiglu" else 2) * tokens * hidden * A
    if cfg.position == "rope":
        total += 2 * tokens * (d + kv) * A
    return total


def _compute(model, s, cluster, work=WORK, **kw):
    return estimate_time(model, s, work, cluster, **kw)


# ---------------------------------------------------------------- activation checkpointing


@pytest.fixture
def device_bound(monkeypatch):
    """The GPU host's costs zeroed, so a test sees the device's accounting alone (the host's:
    tests/unit/test_plan_gpu_host_costs.py, fitted to measured H200 steps)."""
    for generation, r in list(efficiency.PRIORS.items()):
        if generation != "cpu":
            monkeypatch.setitem(efficiency.PRIORS, generation, dataclasses.replace(
                r, launch_s=0.0, selective_dispatch_s=0.0, checkpoint_s=0.0))


@pytest.mark.parametrize("name", ["llama", "gpt"])
def test_selective_ac_costs_exactly_the_recomputed_pointwise_forward(name, request, h100, device_bound):
    model = request.getfixturevalue(name)
    none = _compute(model, S, h100)
    selective = _compute(model, S.replace(ac="selective"), h100)
    tokens = S.micro_batch * T
    expected = model.cfg.n_layer * S.grad_accum * _pointwise_forward_bytes(model.cfg, tokens) / _bandwidth(h100)
    assert selective.breakdown["compute"] - none.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    assert selective.compute_s["recompute"] == pytest.approx(expected, rel=1e-9)
    # not the old flat third of the matmuls: a few percent of this step
    assert 0.005 < expected / none.breakdown["compute"] < 0.10
    assert selective.compute_s["launch"] == 0.0   # no host time (device_bound)


def test_full_ac_adds_the_blocks_forward_and_not_the_head(llama, h100):
    cfg = llama.cfg
    none = _compute(llama, S, h100)
    full = _compute(llama, S.replace(ac="full"), h100)
    tokens = S.micro_batch * T
    d, hidden = cfg.d_model, mlp_hidden(cfg)
    kv = cfg.n_kv_head * d // cfg.n_head
    r = efficiency.rates("hopper")
    gemm_rate = h100.peak_flops("bf16") * r.gemm
    gemm = 2 * tokens * (2 * d * d + 2 * d * kv + 3 * d * hidden) / gemm_rate        # compute-bound at 8K rows
    attention = 4 * tokens * T * d * CAUSAL_WORK / (h100.peak_flops("bf16") * r.flash)
    pointwise = _pointwise_forward_bytes(cfg, tokens) / _bandwidth(h100)
    expected = cfg.n_layer * S.grad_accum * (gemm + attention + pointwise)
    assert full.breakdown["compute"] - none.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    # the head is not re-run: a 4x larger vocabulary moves none and full alike
    big = PlanModel("big-vocab", dataclasses.replace(cfg, vocab_size=4 * cfg.vocab_size))
    extra = _compute(big, S.replace(ac="full"), h100).breakdown["compute"] - _compute(big, S, h100).breakdown["compute"]
    assert extra == pytest.approx(expected, rel=1e-9)


def test_hfu_exceeds_mfu_by_exactly_the_rematerialized_flops(llama, gpt, h100):
    for model in (llama, gpt):
        cfg = model.cfg
        f = flops_per_token(cfg, T)
        attention_fwd = 4.0 * T * cfg.d_model * cfg.n_layer
        block_matmul = param_count(cfg).active_matmul - padded_vocab_size(cfg) * cfg.d_model
        kernel = (FUSED_ATTENTION_BACKWARD - 2) * attention_fwd     # flash's backward recomputes the scores
        cases = {  # (ac, attention): (activation recompute, a kernel's own recompute) FLOPs per token
            ("none", "materialized"): (0.0, 0.0),
            # the attention core (QK^T, AV) re-run: 4 T d per layer, the whole square, as models.flops counts it
            ("selective", "materialized"): (attention_fwd, 0.0),
            ("selective", "flash"): (0.0, kernel),                                # pointwise only: no FLOPs counted
            ("full", "materialized"): (2 * block_matmul + attention_fwd, 0.0),    # every block's forward once more
            ("none", "flash"): (0.0, kernel),
            ("full", "flash"): (2 * block_matmul + attention_fwd, kernel),
        }
        for (ac, attention), (remat, inside) in cases.items():
            t = _compute(model, S.replace(ac=ac, attention=attention), h100)
            # HFU as published runs report it (PaLM, Korthikanti, llm-foundry): AC's recompute only
            assert t.hfu == pytest.approx(t.mfu * (f + remat) / f, rel=1e-12), (ac, attention)
            assert t.hardware_tflops_per_gpu == pytest.approx(t.mfu * 989 * (f + remat + inside) / f, rel=1e-9)
            assert t.model_tflops_per_gpu == pytest.approx(t.mfu * 989, rel=1e-9)
        full = _compute(model, S.replace(ac="full", attention="flash"), h100)
        # the convention of FLOP formulas "with recompute": the AC forward, not the kernel's recompute
        assert full.recompute_tflops_per_gpu == pytest.approx(
            full.model_tflops_per_gpu * (f + 2 * block_matmul + attention_fwd) / f, rel=1e-12)


# ---------------------------------------------------------------- attention


def test_materialized_attention_adds_the_score_traffic_quadratic_in_t(gpt, h100):
    cfg = gpt.cfg
    bw = _bandwidth(h100)

    def pointwise(attention: str, seq: int) -> float:
        return _compute(gpt, S.replace(attention=attention), h100, work=Workload(seq, 8)).compute_s["pointwise"]

    per_t = {}
    for seq in (1024, 2048):
        scores = S.micro_batch * cfg.n_head * seq * seq * A      # B x heads x T x T in bf16
        added = pointwise("materialized", seq) - pointwise("flash", seq)
        assert added == pytest.approx(cfg.n_layer * S.grad_accum * scores * (SCORE_PASSES_FORWARD
                                                                              + SCORE_PASSES_BACKWARD) / bw, rel=1e-9)
        per_t[seq] = added
    assert per_t[2048] == pytest.approx(4 * per_t[1024], rel=1e-9)
    # flash keeps no scores: its attention is the kernel, 1 forward + 2.5 in backward
    t = _compute(gpt, S, h100, work=Workload(2048, 8))
    r = efficiency.rates("hopper")
    kernel = 4 * S.micro_batch * 2048 * 2048 * cfg.d_model * CAUSAL_WORK / (h100.peak_flops("bf16") * r.flash)
    assert t.compute_s["attention"] == pytest.approx(cfg.n_layer * S.grad_accum * kernel * (1 + FUSED_ATTENTION_BACKWARD),
                                                     rel=1e-9)
    # the memory-efficient kernel runs the same FLOPs at its own, lower fraction of peak
    eff = _compute(gpt, S.replace(attention="efficient"), h100, work=Workload(2048, 8))
    assert eff.compute_s["attention"] == pytest.approx(t.compute_s["attention"] * r.flash / r.efficient, rel=1e-9)


def test_alibi_adds_its_bias_pass_on_materialized_scores(gpt, h100):
    alibi = PlanModel("alibi", dataclasses.replace(gpt.cfg, position="alibi"))
    bw = _bandwidth(h100)
    tokens, scores = S.micro_batch * T, S.micro_batch * gpt.cfg.n_head * T * T * A
    # learned positions: the embedding's position add (read the table row, add: 2 n d r forward, x2 backward)
    positions = 2 * tokens * gpt.cfg.d_model * R * (1 + POINTWISE_BACKWARD) * S.grad_accum / bw
    a = _compute(alibi, S.replace(attention="materialized"), h100).compute_s["pointwise"]
    b = _compute(gpt, S.replace(attention="materialized"), h100).compute_s["pointwise"]
    assert a - b == pytest.approx(gpt.cfg.n_layer * S.grad_accum * scores * ALIBI_SCORE_PASSES / bw - positions,
                                  rel=1e-9)


def test_alibi_runs_flash_as_the_efficient_kernel_over_the_whole_square(gpt, h100):
    """ALiBi's bias goes to SDPA as a float attn_mask, which the flash backend does not take: the
    memory-efficient kernel runs, every score tile (the causal mask is in the bias), and reads the
    heads x T x T bias in forward and backward."""
    alibi = PlanModel("alibi", dataclasses.replace(gpt.cfg, position="alibi"))
    assert attention_kernel(alibi, S) == "efficient" and attention_kernel(gpt, S) == "flash"
    assert attention_kernel(alibi, S.replace(attention="materialized")) == "materialized"
    flash = _compute(alibi, S, h100)
    efficient = _compute(alibi, S.replace(attention="efficient"), h100)
    assert flash.step_s == efficient.step_s and flash.compute_s == efficient.compute_s
    r = efficiency.rates("hopper")
    kernel = 4 * S.micro_batch * T * T * gpt.cfg.d_model / (h100.peak_flops("bf16") * r.efficient)   # no causal half
    assert flash.compute_s["attention"] == pytest.approx(
        gpt.cfg.n_layer * S.grad_accum * kernel * (1 + FUSED_ATTENTION_BACKWARD), rel=1e-9)
    no_bias = _compute(gpt, S.replace(attention="efficient"), h100).compute_s["attention"]
    assert flash.compute_s["attention"] == pytest.approx(no_bias / CAUSAL_WORK, rel=1e-9)
    # the bias reads, against learned positions on the same kernel
    bw = _bandwidth(h100)
    tokens, scores = S.micro_batch * T, S.micro_batch * gpt.cfg.n_head * T * T * A
    positions = 2 * tokens * gpt.cfg.d_model * R * (1 + POINTWISE_BACKWARD) * S.grad_accum / bw
    bias = gpt.cfg.n_layer * S.grad_accum * scores * (ALIBI_BIAS_READS_FORWARD + ALIBI_BIAS_READS_BACKWARD) / bw
    learned = _compute(gpt, S.replace(attention="efficient"), h100).compute_s["pointwise"]
    assert flash.compute_s["pointwise"] - learned == pytest.approx(bias - positions, rel=1e-9)
    assert flash.step_s > _compute(gpt, S, h100).step_s
    # the kernel's own recompute counts as for any fused kernel; no AC recompute in the HFU
    f = flops_per_token(alibi.cfg, T)
    assert flash.hfu == pytest.approx(flash.mfu, rel=1e-12)
    assert flash.hardware_tflops_per_gpu == pytest.approx(
        flash.model_tflops_per_gpu * (f + (FUSED_ATTENTION_BACKWARD - 2) * 4 * T * gpt.cfg.d_model * gpt.cfg.n_layer) / f,
        rel=1e-9)


# ---------------------------------------------------------------- selective AC with materialized scores


def test_selective_ac_recomputes_the_materialized_attention_core(gpt, h100, device_bound):
    """plan/memory_activations.py plans selective AC over materialized scores as Megatron runs it:
    no T x T matrix kept, the core (QK^T, softmax, AV) recomputed. The time re-runs that core's
    forward: its batched GEMMs (on the roofline) and its score passes, besides the pointwise forward."""
    cfg = gpt.cfg
    s = S.replace(attention="materialized")
    none = _compute(gpt, s, h100)
    selective = _compute(gpt, s.replace(ac="selective"), h100)
    tokens, hd, heads = S.micro_batch * T, cfg.d_model // cfg.n_head, cfg.n_head
    r = efficiency.rates("hopper")
    rate, bw = h100.peak_flops("bf16") * r.gemm, _bandwidth(h100)
    bmm = S.micro_batch * heads * (gemm_seconds(T, hd, T, rate, bw, A) + gemm_seconds(T, T, hd, rate, bw, A))
    scores = S.micro_batch * heads * T * T * A * SCORE_PASSES_FORWARD / bw
    expected = cfg.n_layer * S.grad_accum * (_pointwise_forward_bytes(cfg, tokens) / bw + scores + bmm)
    assert selective.compute_s["recompute"] == pytest.approx(expected, rel=1e-9)
    assert selective.breakdown["compute"] - none.breakdown["compute"] == pytest.approx(expected, rel=1e-9)
    # the core's GEMMs are in the attention class: it grows by a third (forward 1 of backward's 2)
    assert selective.compute_s["attention"] == pytest.approx(none.compute_s["attention"] * 4 / 3, rel=1e-9)
    # a fused kernel keeps its output and log-sum-exp: no attention re-run
    flash = _compute(gpt, S, h100)
    assert _compute(gpt, S.replace(ac="selective"), h100).compute_s["attention"] == flash.compute_s["attention"]


KORTHIKANTI_SELECTIVE = {   # run: reported HFU / MFU (Korthikanti et al. 2022, Table 5)
    "korthikanti-22b-8gpu-selective-sp": 0.437 / 0.415,
    "korthikanti-175b-64gpu-selective-sp": 0.528 / 0.514,
    "korthikanti-530b-280gpu-selective-sp": 0.570 / 0.560,
    "korthikanti-1t-512gpu-selective-sp": 0.570 / 0.563,
}


@pytest.mark.parametrize("name", sorted(KORTHIKANTI_SELECTIVE))
def test_selective_hfu_of_the_korthikanti_runs(name):
    """HFU / MFU of Megatron's selective runs: 1 + the recomputed core's 4 T d L over the model
    FLOPs. Megatron's formula (the reported ratios) adds s / (6h) to 1 + s / (6h) + V / (16 l h),
    three times the core's forward (its forward and backward): the planned excess is about a third
    of the reported one."""
    from slipstream.plan.published_more import ALL_PUBLISHED_RUNS
    from slipstream.plan.report import _setup

    run = next(r for r in ALL_PUBLISHED_RUNS if r.name == name)
    model, s, work, cluster = _setup(run)
    t = estimate_time(model, s, work, cluster)
    f = flops_per_token(model.cfg, run.seq_len)
    core = 4.0 * run.seq_len * run.d_model * run.n_layer
    assert t.hfu / t.mfu == pytest.approx(1 + core / f, rel=1e-12)
    h, sq, l, v = run.d_model, run.seq_len, run.n_layer, run.vocab_size
    megatron = 1 + (sq / (6 * h)) / (1 + sq / (6 * h) + v / (16 * l * h))
    assert megatron == pytest.approx(KORTHIKANTI_SELECTIVE[name], abs=0.002)   # the reported figures' rounding
    assert (t.hfu / t.mfu - 1) == pytest.approx((megatron - 1) / 3, rel=0.03)


# ---------------------------------------------------------------- the block's pointwise ops


def test_partial_rotary_reads_and_writes_all_of_q_and_k(llama, h100, device_bound):
    """apply_rope with rotary_fraction < 1 rotates the fraction, then assembles new q and k
    (empty_like, two copies): a read and a write of all of q and k more than the rotation."""
    cfg = llama.cfg
    quarter = PlanModel("llama-quarter-rope", dataclasses.replace(cfg, rotary_fraction=0.25))
    full = _compute(llama, S, h100).compute_s["pointwise"]
    partial = _compute(quarter, S, h100).compute_s["pointwise"]
    tokens, d = S.micro_batch * T, cfg.d_model
    qk = tokens * (d + cfg.n_kv_head * d // cfg.n_head) * A                      # q and k, bf16
    per_block = (2 * 0.25 * qk + 2 * qk) - 2 * qk                                  # partial - full, forward
    expected = cfg.n_layer * S.grad_accum * per_block * (1 + POINTWISE_BACKWARD) / _bandwidth(h100)
    assert partial - full == pytest.approx(expected, rel=1e-9)
    assert partial > full          # not the fraction's bytes only: the copies cost more than they save


def test_partial_rotary_launches_its_copies(llama):
    """The host's side: 7 more eager ops per tensor (profiled), on a host-bound step."""
    small = Strategy(micro_batch=1, grad_accum=1, precision="bf16")
    work = Workload(128, 1)
    cluster = make_cluster("1xH100")
    quarter = PlanModel("q", dataclasses.replace(llama.cfg, rotary_fraction=0.25))
    launch = efficiency.rates("hopper").launch_s
    a, b = estimate_time(quarter, small, work, cluster), estimate_time(llama, small, work, cluster)
    from slipstream.plan.timing_compute import BACKWARD_OPS_PER_FORWARD_OP
    extra_ops = llama.cfg.n_layer * PARTIAL_ROPE_OPS * (1 + BACKWARD_OPS_PER_FORWARD_OP)
    assert a.compute_s["launch"] > 0 and b.compute_s["launch"] > 0     # host-bound: the step is the host's ops
    assert a.breakdown["compute"] - b.breakdown["compute"] == pytest.approx(extra_ops * launch, rel=1e-9)
    assert PARTIAL_ROPE_OPS == 14 and ROPE_OPS == 16


def test_the_parallel_block_charges_the_two_adds_eager_runs(gpt, h100, device_bound):
    """models/transformer's parallel block returns x + attn + mlp: eager PyTorch runs that as two
    binary adds (profiled: two aten::add, the first writing x + attn), the same bytes as the
    sequential block's two residual adds; its norms both read the block input, as the sequential
    ones read theirs. Same pointwise time, same ops."""
    import torch
    from torch.profiler import profile

    x, y, z = (torch.randn(4, 4) for _ in range(3))
    with profile() as prof:
        x + y + z
    assert [e.name for e in prof.events() if e.cpu_parent is None] == ["aten::add", "aten::add"]
    parallel = PlanModel("gpt-parallel", dataclasses.replace(gpt.cfg, parallel_block=True))
    assert _compute(parallel, S, h100).compute_s == _compute(gpt, S, h100).compute_s


# ---------------------------------------------------------------- tensor and pipeline parallel


def test_without_sequence_parallel_norms_and_adds_run_on_the_whole_sequence(llama):
    cluster = make_cluster("8xH100")
    s = Strategy(tp=8, micro_batch=2, grad_accum=4, precision="bf16")
    on = _compute(llama, s, cluster).compute_s["pointwise"]
    off = _compute(llama, s.replace(sequence_parallel=False), cluster).compute_s["pointwise"]
    tokens, d = S.micro_batch * T, llama.cfg.d_model
    split = 2 * tokens * d * (R + A) + 2 * 3 * tokens * d * R      # norms and residual adds, per block forward
    head_norm = tokens * d * (R + A)                                   # the final norm
    per_micro = llama.cfg.n_layer * split + head_norm
    expected = per_micro * (1 + POINTWISE_BACKWARD) * (1 - 1 / 8) * S.grad_accum / _bandwidth(cluster)
    assert off - on == pytest.approx(expected, rel=1e-9)


def test_an_uneven_split_runs_at_the_busiest_ranks_pace():
    """32 layers on 3 pipeline ranks as 11 / 11 / 10: the step follows rank 0 (11 blocks and the
    embedding), not 32 / 3 blocks; a small vocabulary keeps the head under one block."""
    cfg = dataclasses.replace(resolve_model("llama-8b", seq_len=T).cfg, vocab_size=8192)
    model = PlanModel("llama-32", cfg)
    cluster = make_cluster("8xH100")
    s = Strategy(pp=3, micro_batch=1, grad_accum=12, pp_layers=(11, 11, 10), precision="bf16")
    t = estimate_time(model, s, Workload(T, 12), cluster)
    # one block's and the ends' compute, from single-rank plans of 32 and 31 layers (12 micro-batches)
    one = Strategy(micro_batch=1, grad_accum=12, precision="bf16")

    def whole(layers: int) -> float:
        return estimate_time(PlanModel("m", dataclasses.replace(cfg, n_layer=layers)), one, Workload(T, 12),
                             cluster).breakdown["compute"]

    block = whole(32) - whole(31)
    ends = whole(32) - 32 * block                      # embedding + head + loss
    head = whole(1) - block - _embedding_only(cfg, cluster)
    embedding = ends - head
    assert block > head > embedding > 0
    assert t.breakdown["compute"] == pytest.approx(11 * block + embedding, rel=1e-9)
    # the bubble is the same formula on the busiest rank's compute
    # (1F1B: idle (p - 1) / (m + p - 1) = 2 / 14 of the step, i.e. 2 / 12 of the compute)
    assert t.breakdown["pp_bubble"] == pytest.approx(t.breakdown["compute"] * 2 / 12, rel=1e-12)
    # an even 32 / 3 split would plan 10.67 blocks: the whole-block plan is slower by about 11 / 10.67
    assert t.breakdown["compute"] > 32 / 3 * block + embedding
    # the tp collectives of the busiest rank, 11 blocks' worth: with sequence parallel 4 all-gathers
    # and 4 reduce-scatters per block and micro-batch
    tp = dataclasses.replace(s, tp=2)
    blocks = [r for r in step_collectives(model, tp, Workload(T, 12)) if r.dim == "tp" and r.part == "blocks"]
    assert sum(r.calls for r in blocks) == pytest.approx(8 * 11 * 12)
    # the split the trainer picks without pp_layers is planned too, at its busiest rank
    balanced = estimate_time(model, s.replace(pp_layers=()), Workload(T, 12), cluster)
    assert balanced.breakdown["compute"] <= t.breakdown["compute"] * (1 + 1e-9)


def _embedding_only(cfg, cluster) -> float:
    """The embedding's compute (lookup rows written, backward scatter-add), by hand: 12 micro-batches."""
    tokens = T
    nbytes = tokens * cfg.d_model * R * (1 + POINTWISE_BACKWARD)
    return 12 * nbytes / _bandwidth(cluster)


# ---------------------------------------------------------------- generations and calibration


def test_each_generation_uses_its_own_constants(llama):
    a100, h100 = make_cluster("8xA100"), make_cluster("8xH100")
    s = Strategy("fsdp", dp=8, micro_batch=2, grad_accum=1, precision="bf16")
    work = Workload(T, 16)
    ta, th = estimate_time(llama, s, work, a100), estimate_time(llama, s, work, h100)
    # compute-bound GEMMs: seconds = FLOPs / (peak x the generation's fitted GEMM fraction)
    ratio = ta.compute_s["gemm"] / th.compute_s["gemm"]
    assert ratio == pytest.approx((989 * FITTED.gemm["hopper"]) / (312 * FITTED.gemm["ampere"]), rel=1e-6)
    # changing the hopper constant moves the H100 plan and leaves the A100 plan alone
    faster = dataclasses.replace(FITTED, gemm={**FITTED.gemm, "hopper": FITTED.gemm["hopper"] * 1.25})
    assert estimate_time(llama, s, work, a100, fit=faster).step_s == ta.step_s
    assert estimate_time(llama, s, work, h100, fit=faster).compute_s["gemm"] == pytest.approx(
        th.compute_s["gemm"] / 1.25, rel=1e-9)
    # a generation without published runs: its prior scaled by the fitted generations' mean ratio
    ratios = [FITTED.gemm[g] / efficiency.PRIORS[g].gemm for g in FITTED.gemm]
    mean = (ratios[0] * ratios[1]) ** 0.5
    assert efficiency.rates("blackwell").gemm == pytest.approx(efficiency.PRIORS["blackwell"].gemm * mean)
    assert efficiency.rates("hopper").pointwise == pytest.approx(efficiency.PRIORS["hopper"].pointwise
                                                                 * FITTED.pointwise_scale)


def test_efficiency_divides_the_device_time(llama, h100):
    one = estimate_time(llama, S, WORK, h100, efficiency=1.0)
    half = estimate_time(llama, S, WORK, h100, efficiency=0.5)
    assert half.breakdown["compute"] == pytest.approx(2 * one.breakdown["compute"], rel=1e-9)
    assert half.breakdown["optimizer"] == one.breakdown["optimizer"]


def test_the_fit_is_one_of_its_candidates(llama, h100):
    """estimate_time(fit=...) uses the candidate's constants, not the committed ones: each class's
    seconds scale by the committed / candidate fraction (llama-8b at 8K rows: compute-bound GEMMs)."""
    fit = Fit(gemm={"hopper": 0.5}, attention_scale=1.0, pointwise_scale=1.0)
    assert efficiency.rates("hopper", fit).gemm == 0.5
    assert efficiency.rates("hopper", fit).flash == efficiency.PRIORS["hopper"].flash
    committed = estimate_time(llama, S, WORK, h100)
    assert estimate_time(llama, S, WORK, h100, fit=FITTED).compute_s == committed.compute_s
    candidate = estimate_time(llama, S, WORK, h100, fit=fit)
    assert candidate.compute_s["gemm"] == pytest.approx(committed.compute_s["gemm"] * FITTED.gemm["hopper"] / 0.5,
                                                        rel=1e-9)
    assert candidate.compute_s["attention"] == pytest.approx(committed.compute_s["attention"]
                                                             * FITTED.attention_scale, rel=1e-9)
    assert candidate.compute_s["pointwise"] == pytest.approx(committed.compute_s["pointwise"]
                                                             * FITTED.pointwise_scale, rel=1e-9)
    assert candidate.step_s != committed.step_s


def test_cpu_calibration_predictions_are_todays():
    """benchmarks/planner-recompute-cpu.json: its predicted ratios equal a fresh estimate on the
    machine it records, and the planner's cpu constants are the fit it reports."""
    from slipstream.perf.recompute_bench import predict, summarize

    result = json.loads((ROOT / "benchmarks" / "planner-recompute-cpu.json").read_text())
    assert predict(result) == result["ratios"]
    assert summarize(result["ratios"]) == result["summary"]
    fit, cpu = result["fit"], efficiency.CPU_FITTED
    assert (fit["pointwise"], fit["attention"], fit["launch_s"]) == (cpu.pointwise, cpu.flash, cpu.launch_s)
    assert fit["selective_dispatch_s"] == efficiency.SELECTIVE_DISPATCH_S == cpu.selective_dispatch_s
    # measured: one row per case and AC mode, full re-runs more than selective on every case
    assert len(result["rows"]) == 18
    assert all(r["full_measured_ratio"] > 1.1 and r["selective_measured_ratio"] > 1.0 for r in result["ratios"])
