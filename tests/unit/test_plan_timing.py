"""Tests for slipstream.plan.timing (and timing_compute, timing_comm): ring collectives and the step-time
model, against hand-computed values."""

import dataclasses
import math

import pytest

from slipstream.models.transformer import padded_vocab_size
from slipstream.models.flops import flops_per_token, param_count
from slipstream.plan import efficiency
from slipstream.plan.hardware import make_cluster
from slipstream.plan.links import LOCAL, Link
from slipstream.plan.model import resolve_model
from slipstream.plan.space import PlanModel, Strategy, Workload
from slipstream.plan.collectives import (Collective, all_reduce, all_to_all_time, call_time, gather_or_scatter,
                                         ring_time, span)
from slipstream.plan.timing import ADAM_BYTES_PER_PARAM, ZERO_BUBBLE_RESIDUAL, estimate_time, pipeline_bubble
from slipstream.plan.timing_comm import gradient_buckets, step_collectives
from slipstream.plan.timing_compute import (BACKWARD_OPS_PER_FORWARD_OP, CAUSAL_WORK, FUSED_ATTENTION_BACKWARD,
                                            LAYOUT_OPS, LOSS_BYTES_CASTS, LOSS_BYTES_FP32, POINTWISE_BACKWARD,
                                            gemm_seconds)

LINK = Link("test", 100.0, 5.0, "100 GB/s, 5 us per step")
NO_LATENCY = Link("fast", 100.0, 0.0, "100 GB/s, no latency")


@pytest.fixture(scope="module")
def gpt2():
    return resolve_model("gpt2")


@pytest.fixture(scope="module")
def llama70b():
    return resolve_model("llama-70b", seq_len=8192)


@pytest.fixture(scope="module")
def h100():
    return make_cluster("1xH100")


@pytest.fixture(scope="module")
def h100_64():
    return make_cluster("8xH100", nodes=8)


GPT2_WORK = Workload(seq_len=1024, global_batch=64)
GPT2_S = Strategy(micro_batch=8, grad_accum=8)          # one GPU, no data parallel
W70 = Workload(seq_len=8192, global_batch=512)


# ---------------------------------------------------------------- ring collectives

def test_all_reduce_hand_computed():
    # 2(n-1)/n x bytes / bw + 2(n-1) latency steps: 4 ranks, 1 GB, 100 GB/s, 5 us per step
    expected = 1e9 * 2 * 3 / 4 / 100e9 + 2 * 3 * 5e-6
    assert all_reduce(1e9, 4, LINK) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(0.01503, rel=1e-12)
    # 8 ranks: bus factor 14/8
    assert all_reduce(2e9, 8, LINK) == pytest.approx(2e9 * 14 / 8 / 100e9 + 14 * 5e-6, rel=1e-12)


def test_gather_or_scatter_bandwidth_term_is_half_an_all_reduce():
    # (n-1)/n x bytes / bw: 4 ranks, 1 GB, 100 GB/s
    assert gather_or_scatter(1e9, 4, NO_LATENCY) == pytest.approx(0.0075, rel=1e-12)
    assert all_reduce(1e9, 4, NO_LATENCY) == pytest.approx(2 * gather_or_scatter(1e9, 4, NO_LATENCY), rel=1e-12)


def test_gather_or_scatter_latency_is_n_minus_1_steps():
    # A zero-byte all-gather over 4 ranks is pure latency: 3 ring steps of 5 us.
    assert gather_or_scatter(0.0, 4, LINK) == pytest.approx(3 * 5e-6, rel=1e-12)


def test_all_reduce_latency_is_2_n_minus_1_steps():
    assert all_reduce(0.0, 4, LINK) == pytest.approx(6 * 5e-6, rel=1e-12)


@pytest.mark.parametrize("fn", [all_reduce, gather_or_scatter])
def test_group_of_one_costs_nothing(fn):
    assert fn(1e12, 1, LINK) == 0.0
    assert fn(1e12, 1, LOCAL) == 0.0
    assert ring_time(1e12, 0, LINK, 1.0, 0) == 0.0


def test_ring_time_scales_linearly_in_bytes():
    one = ring_time(1e9, 4, NO_LATENCY, 1.5, 6)
    assert ring_time(3e9, 4, NO_LATENCY, 1.5, 6) == pytest.approx(3 * one, rel=1e-12)


# ---------------------------------------------------------------- step time: bookkeeping

def test_step_is_sum_of_breakdown_and_throughput_follows(gpt2, h100):
    t = estimate_time(gpt2, GPT2_S, GPT2_WORK, h100)
    assert set(t.breakdown) == {"compute", "optimizer"}
    assert t.step_s == pytest.approx(sum(t.breakdown.values()), rel=1e-12)
    assert t.tokens_per_s == pytest.approx(64 * 1024 / t.step_s, rel=1e-12)
    mfu = t.tokens_per_s * flops_per_token(gpt2.cfg, 1024) / (1 * h100.peak_flops("bf16"))
    assert t.mfu == pytest.approx(mfu, rel=1e-12)
    # well below the fitted H100 GEMM fraction: at 768 wide gpt2's pointwise traffic takes more time
    # than its matmuls (test_compute_hand_computed), and the optimizer step adds more
    assert 0.15 < t.mfu < efficiency.rates("hopper").gemm
    rec = t.to_record()
    assert rec["step_s"] == t.step_s and set(rec["breakdown_s"]) == set(t.breakdown)


def test_mfu_counts_every_gpu(llama70b, h100_64):
    s = Strategy("fsdp", dp=64, micro_batch=1, grad_accum=8)
    t = estimate_time(llama70b, s, W70, h100_64)
    assert t.step_s == pytest.approx(sum(t.breakdown.values()), rel=1e-12)
    assert t.tokens_per_s == pytest.approx(8192 * 512 / t.step_s, rel=1e-12)
    mfu = t.tokens_per_s * flops_per_token(llama70b.cfg, 8192) / (64 * h100_64.peak_flops("bf16"))
    assert t.mfu == pytest.approx(mfu, rel=1e-12)
    assert 0.2 < t.mfu < 0.75


def _roof(m, k, n, rate, bw, elem=2):
    """A matmul on a roofline, by hand: the slower of FLOPs at the rate and operand bytes at the bandwidth."""
    return max(2 * m * k * n / rate, elem * (m * k + k * n + m * n) / bw)


def _rates(cluster):
    """GEMM FLOP/s, flash-attention FLOP/s and memory-bound bytes/s of a bf16 plan on `cluster`:
    the peak and bandwidth x the generation's fitted fractions (plan/efficiency.py)."""
    r = efficiency.rates(cluster.gpu.generation)
    peak = cluster.peak_flops("bf16")
    return peak * r.gemm, peak * r.flash, cluster.gpu.mem_bw_gbs * 1e9 * r.pointwise


def _gpt2_gemms(tokens, rate, bw):
    """Forward GEMM seconds of one gpt2 block (q, k, v, o at 768 x 768, the GELU MLP 768 -> 3072 -> 768)
    and of its output head (768 x the padded vocabulary), for `tokens` rows."""
    d, hidden, vocab = 768, 3072, padded_vocab_size(resolve_model("gpt2").cfg)
    block = 4 * _roof(tokens, d, d, rate, bw) + _roof(tokens, d, hidden, rate, bw) + _roof(tokens, hidden, d, rate, bw)
    return block, _roof(tokens, d, vocab, rate, bw)


# Eager ops of one gpt2 micro-batch's forward, by hand: per block 4 projections, 2 MLP matmuls and
# the flash kernel; 2 norms, 2 residual adds, 2 dropout calls, the layout ops around attention and
# GELU. The head issues 4, the embedding 3 (lookup, learned positions). Backward issues
# BACKWARD_OPS_PER_FORWARD_OP per forward op.
GPT2_BLOCK_OPS = 4 + 2 + 1 + 2 + 2 + 2 + LAYOUT_OPS + 1
GPT2_OPS = (12 * GPT2_BLOCK_OPS + 4 + 3) * (1 + BACKWARD_OPS_PER_FORWARD_OP)


def test_gemm_seconds_roofline():
    # compute-bound: 2 x 4096^3 FLOPs at 1 PFLOP/s beat 3 x 4096^2 x 2 bytes at 1 TB/s
    assert gemm_seconds(4096, 4096, 4096, 1e15, 1e12, 2) == pytest.approx(2 * 4096**3 / 1e15, rel=1e-12)
    # memory-bound: one row through a 4096 x 4096 weight is all weight traffic
    assert gemm_seconds(1, 4096, 4096, 1e15, 1e12, 2) == pytest.approx(2 * (4096 + 4096**2 + 4096) / 1e12,
                                                                        rel=1e-12)
    assert gemm_seconds(1, 4096, 4096, 1e15, 1e12, 4) == pytest.approx(
        2 * gemm_seconds(1, 4096, 4096, 1e15, 1e12, 2), rel=1e-12)


@pytest.fixture
def device_bound(monkeypatch):
    """The GPU host's costs zeroed, so a test sees the device's accounting alone (the host's:
    tests/unit/test_plan_gpu_host_costs.py, fitted to measured H200 steps)."""
    for generation, r in list(efficiency.PRIORS.items()):
        if generation != "cpu":
            monkeypatch.setitem(efficiency.PRIORS, generation, dataclasses.replace(
                r, launch_s=0.0, selective_dispatch_s=0.0, checkpoint_s=0.0))


def test_compute_hand_computed(gpt2, h100, device_bound):
    """gpt2 on one H100, 8 micro-batches of 8 x 1024 tokens, bf16 under autocast, per class by hand:
    GEMMs on a roofline, forward + 2 in backward; the causal half of the flash kernel's FLOPs,
    forward + FUSED_ATTENTION_BACKWARD; pointwise bytes (fp32 residual stream, bf16 matmul
    outputs) forward + POINTWISE_BACKWARD x in backward, the loss's bytes per logit once."""
    t = estimate_time(gpt2, GPT2_S, GPT2_WORK, h100)
    gemm_rate, flash_rate, bw = _rates(h100)
    n, tokens, d, hidden, vocab, R, A = 8, 8 * 1024, 768, 3072, padded_vocab_size(gpt2.cfg), 4, 2
    block, head = _gpt2_gemms(tokens, gemm_rate, bw)
    assert t.compute_s["gemm"] == pytest.approx(n * 3 * (12 * block + head), rel=1e-9)
    attention = 4 * tokens * 1024 * d * CAUSAL_WORK / flash_rate
    assert t.compute_s["attention"] == pytest.approx(n * 12 * attention * (1 + FUSED_ATTENTION_BACKWARD), rel=1e-9)
    # per block: two norms (read fp32, write bf16), two residual adds (read 2, write 1 in fp32), the
    # attention output's layout copy, GELU (read + write); the final norm; the embedding's rows and
    # learned positions (read the row, add)
    block_bytes = 2 * tokens * d * (R + A) + 2 * 3 * tokens * d * R + 2 * tokens * d * A + 2 * tokens * hidden * A
    ends = tokens * d * (R + A) + tokens * d * R + 2 * tokens * d * R
    loss = tokens * vocab * (LOSS_BYTES_FP32 + LOSS_BYTES_CASTS)
    assert t.compute_s["pointwise"] == pytest.approx(
        n * ((12 * block_bytes + ends) * (1 + POINTWISE_BACKWARD) + loss) / bw, rel=1e-9)
    assert t.compute_s["launch"] == 0.0   # no host time (device_bound)
    assert t.breakdown["compute"] == pytest.approx(sum(t.compute_s[k] for k in ("gemm", "attention", "pointwise")),
                                                   rel=1e-12)
    params = param_count(gpt2.cfg).total
    assert t.breakdown["optimizer"] == pytest.approx(params * ADAM_BYTES_PER_PARAM / (h100.gpu.mem_bw_gbs * 1e9),
                                                     rel=1e-9)


def test_small_micro_batches_pay_launches_and_weight_traffic(gpt2, h100):
    """Same tokens per step, 64 micro-batches of one sequence against 8 of 8: every GEMM reads its
    weights once per micro-batch (the attention projections are memory-bound at 1024 rows), and
    the host's 64 micro-batches of launches outlast the device's work: the step waits for them."""
    small = estimate_time(gpt2, Strategy(micro_batch=1, grad_accum=64), GPT2_WORK, h100)
    big = estimate_time(gpt2, GPT2_S, GPT2_WORK, h100)
    gemm_rate, _, bw = _rates(h100)
    assert 2 * (1024 * 768 * 2 + 768 * 768) / bw > 2 * 1024 * 768 * 768 / gemm_rate   # bytes, not FLOPs, bound it

    def step_gemms(micro_batch):   # 64 / micro_batch micro-batches, forward + 2 in backward
        block, head = _gpt2_gemms(micro_batch * 1024, gemm_rate, bw)
        return 64 // micro_batch * 3 * (12 * block + head)

    assert step_gemms(1) > step_gemms(8)
    assert small.compute_s["gemm"] - big.compute_s["gemm"] == pytest.approx(step_gemms(1) - step_gemms(8), rel=1e-9)
    # attention and pointwise work is linear in the tokens: the same
    for k in ("attention", "pointwise"):
        assert small.compute_s[k] == pytest.approx(big.compute_s[k], rel=1e-9), k
    # the host launches GPT2_OPS eager ops a micro-batch, asynchronously: the step is the longer
    # of the host's and the device's time, and the host's excess shows as "launch"
    for t, micro_batches in ((small, 64), (big, 8)):
        host = micro_batches * GPT2_OPS * efficiency.rates("hopper").launch_s
        device = sum(t.compute_s[k] for k in ("gemm", "attention", "pointwise"))
        assert t.breakdown["compute"] == pytest.approx(max(host, device), rel=1e-9)
        assert t.compute_s["launch"] == pytest.approx(max(0.0, host - device), rel=1e-9, abs=1e-12)
    assert small.compute_s["launch"] > 0.5 * small.breakdown["compute"]   # 64 micro-batches: mostly host
    assert small.tokens_per_s < 0.6 * big.tokens_per_s


# ---------------------------------------------------------------- tensor and pipeline parallel

def test_tp_adds_tp_comm_hand_computed(llama70b, h100_64):
    base = Strategy("fsdp", dp=64, micro_batch=1, grad_accum=8)
    assert "tp_comm" not in estimate_time(llama70b, base, W70, h100_64).breakdown
    s = Strategy("fsdp", dp=32, tp=2, micro_batch=1, grad_accum=16)
    t = estimate_time(llama70b, s, W70, h100_64)
    act = 8192 * llama70b.cfg.d_model * 2
    # sequence parallel: each of the 4 all-reduces a ring would run is an all-gather + a reduce-scatter,
    # each call at NCCL's fastest (collectives.py)
    assert s.sequence_parallel
    per_layer = 4 * (call_time("all_gather", act, span(h100_64, 2)) + call_time("reduce_scatter", act, span(h100_64, 2)))
    assert h100_64.intra.name == "nvlink4"
    assert t.breakdown["tp_comm"] == pytest.approx(per_layer * llama70b.cfg.n_layer * 16, rel=1e-9)
    # full AC re-runs forward collectives: x1.5
    t_full = estimate_time(llama70b, s.replace(ac="full"), W70, h100_64)
    assert t_full.breakdown["tp_comm"] == pytest.approx(1.5 * t.breakdown["tp_comm"], rel=1e-9)


def _bubble_of(t, schedule, pp, virtual, microbatches):
    """The bubble a plan adds on its own (busiest rank's) compute: idle f of the step, f / (1 - f) x compute."""
    f = pipeline_bubble(schedule, pp, virtual, microbatches)
    return t.breakdown["compute"] * f / (1 - f)


def test_pp_bubble_per_schedule(llama70b, h100_64):
    """Each schedule's bubble on its own compute: interleaved and zero-bubble schedules split the 80
    blocks into 16 stages of whole blocks, so their busiest rank (12 blocks) is not 1F1B's (11)."""
    base = Strategy("fsdp", dp=8, pp=8, micro_batch=1, grad_accum=64, pp_schedule="1f1b")
    f1b = estimate_time(llama70b, base, W70, h100_64)
    assert f1b.breakdown["pp_bubble"] == pytest.approx(f1b.breakdown["compute"] * 7 / 64, rel=1e-12)
    assert f1b.breakdown["pp_bubble"] == pytest.approx(_bubble_of(f1b, "1f1b", 8, 1, 64), rel=1e-12)
    assert f1b.breakdown["pp_p2p"] > 0
    gpipe = estimate_time(llama70b, base.replace(pp_schedule="gpipe"), W70, h100_64)
    assert gpipe.breakdown["compute"] == f1b.breakdown["compute"]          # the same split
    assert gpipe.breakdown["pp_bubble"] == pytest.approx(f1b.breakdown["pp_bubble"], rel=1e-12)
    inter = estimate_time(llama70b, base.replace(pp_schedule="interleaved-1f1b", pp_virtual=2), W70, h100_64)
    assert inter.breakdown["pp_bubble"] == pytest.approx(inter.breakdown["compute"] * 7 / 64 / 2, rel=1e-12)
    assert inter.breakdown["pp_bubble"] < f1b.breakdown["pp_bubble"]
    # the planner's alias is the trainer's schedule
    alias = estimate_time(llama70b, base.replace(pp_schedule="interleaved", pp_virtual=2), W70, h100_64)
    assert alias.breakdown == inter.breakdown
    zb = estimate_time(llama70b, base.replace(pp_schedule="zbv", pp_virtual=2), W70, h100_64)
    assert zb.breakdown["pp_bubble"] == pytest.approx(_bubble_of(zb, "zbv", 8, 2, 64), rel=1e-12)
    assert 0 < zb.breakdown["pp_bubble"] < inter.breakdown["pp_bubble"]
    # more micro-batches, smaller bubble
    more = estimate_time(llama70b, base.replace(grad_accum=128), Workload(8192, 1024), h100_64)
    assert more.breakdown["pp_bubble"] / more.breakdown["compute"] == pytest.approx(7 / 128, rel=1e-12)
    no_pp = estimate_time(llama70b, Strategy("fsdp", dp=64, micro_batch=1, grad_accum=8), W70, h100_64)
    assert "pp_bubble" not in no_pp.breakdown and "pp_p2p" not in no_pp.breakdown


@pytest.mark.parametrize("schedule, p, v, m, idle", [
    ("gpipe", 4, 1, 8, 3 / 11),
    ("1f1b", 4, 1, 8, 3 / 11),
    ("1f1b", 8, 1, 64, 7 / 71),
    ("1f1b", 4, 2, 8, 3 / 11),                  # one stage per rank, whatever v says
    ("gpipe", 2, 1, 1, 1 / 2),
    ("interleaved-1f1b", 4, 2, 8, 3 / 19),
    ("interleaved-1f1b", 8, 4, 16, 7 / 71),
    ("looped-bfs", 4, 2, 8, 3 / 19),
    ("interleaved-zero-bubble", 4, 2, 8, ZERO_BUBBLE_RESIDUAL * 3 / 19),
    ("zbv", 4, 2, 8, ZERO_BUBBLE_RESIDUAL * 3 / 19),
    ("dualpipev", 4, 2, 8, ZERO_BUBBLE_RESIDUAL * 3 / 19),
    ("1f1b", 1, 1, 8, 0.0),
])
def test_pipeline_bubble_is_the_idle_fraction(schedule, p, v, m, idle):
    """GPipe / 1F1B (p-1)/(m+p-1), interleaved (p-1)/(v m + p-1): idle time over step time."""
    assert pipeline_bubble(schedule, p, v, m) == pytest.approx(idle, rel=1e-12)


def test_pipeline_bubble_knows_every_schedule_the_trainer_runs():
    from dataclasses import fields

    from slipstream.config.schema import ParallelConfig

    choices = next(f.metadata["choices"] for f in fields(ParallelConfig) if f.name == "pp_schedule")
    for name in choices:
        assert 0 < pipeline_bubble(name, 4, 2, 8) < 1
    with pytest.raises(ValueError, match="unknown pipeline schedule 'interleaved'"):
        pipeline_bubble("interleaved", 4, 2, 8)   # the trainer's names only


def test_step_time_takes_its_bubble_from_pipeline_bubble(llama70b, h100_64, monkeypatch):
    """The time model has no bubble formula of its own: it adds compute x f / (1 - f)."""
    import slipstream.plan.timing as timing

    s = Strategy("fsdp", dp=8, pp=8, micro_batch=1, grad_accum=64, pp_schedule="interleaved-1f1b")
    before = estimate_time(llama70b, s, W70, h100_64)
    seen = []

    def half(schedule, pp, virtual, microbatches):
        seen.append((schedule, pp, virtual, microbatches))
        return 0.5

    monkeypatch.setattr(timing, "pipeline_bubble", half)
    after = estimate_time(llama70b, s, W70, h100_64)
    assert seen == [("interleaved-1f1b", 8, 2, 64)]
    assert after.breakdown["pp_bubble"] == pytest.approx(after.breakdown["compute"], rel=1e-12)   # 0.5 / 0.5
    assert after.step_s - before.step_s == pytest.approx(
        after.breakdown["pp_bubble"] - before.breakdown["pp_bubble"], rel=1e-9)
    assert after.step_s > before.step_s


# ---------------------------------------------------------------- optimizer and offload

def test_offload_replaces_optimizer_component(llama70b, h100_64):
    s = Strategy("fsdp", dp=64, micro_batch=1, grad_accum=8)
    plain = estimate_time(llama70b, s, W70, h100_64)
    off = estimate_time(llama70b, s.replace(offload=True), W70, h100_64)
    assert "optimizer" in plain.breakdown and "offload" not in plain.breakdown
    assert "offload" in off.breakdown and "optimizer" not in off.breakdown
    local = param_count(llama70b.cfg).total / 64
    host = local * 8 / (h100_64.host_link_gbs * 1e9) + local * ADAM_BYTES_PER_PARAM / 10e9
    assert off.breakdown["offload"] == pytest.approx(host, rel=1e-9)
    assert plain.breakdown["optimizer"] == pytest.approx(local * ADAM_BYTES_PER_PARAM / (h100_64.gpu.mem_bw_gbs * 1e9),
                                                         rel=1e-9)
    assert off.breakdown["offload"] > plain.breakdown["optimizer"]
    assert off.tokens_per_s < plain.tokens_per_s


# ---------------------------------------------------------------- data parallel

def test_ddp_exposed_comm_slow_link_vs_nvlink(gpt2, device_bound):
    work = Workload(1024, 16)
    s = Strategy("ddp", dp=2, micro_batch=8, grad_accum=1)
    nvlink = make_cluster("2xH100")                                   # one node: NVLink
    ether = make_cluster("1xH100", nodes=2, inter="ethernet-25g")     # two nodes, 25 Gb/s each
    fast = estimate_time(gpt2, s, work, nvlink)
    slow = estimate_time(gpt2, s, work, ether)
    assert fast.breakdown["compute"] == pytest.approx(slow.breakdown["compute"], rel=1e-12)
    assert slow.breakdown["dp_comm"] > 10 * fast.breakdown["dp_comm"]
    assert slow.tokens_per_s < fast.tokens_per_s
    # hand-computed: fp32 gradients all-reduced over 2 ranks in DDP's buckets (1 MiB first, then
    # 25 MiB, the rest last), each call at NCCL's fastest; what backward cannot hide of all but the
    # last bucket, + the last bucket
    grad_bytes = param_count(gpt2.cfg).total * 4
    full = int((grad_bytes - 2**20) // (25 * 2**20))
    buckets = [2**20] + [25 * 2**20] * full + [grad_bytes - 2**20 - full * 25 * 2**20]
    assert gradient_buckets(grad_bytes, 4, "torch", 2) == pytest.approx(buckets)
    # backward's share of the compute, by class: GEMMs 2 of 3 passes, pointwise POINTWISE_BACKWARD of
    # 1 + POINTWISE_BACKWARD, the flash kernel FUSED_ATTENTION_BACKWARD of 1 + that; no launches shown
    c = slow.compute_s
    assert c["launch"] == 0.0
    backward = (2 / 3 * c["gemm"] + POINTWISE_BACKWARD / (1 + POINTWISE_BACKWARD) * c["pointwise"]
                + FUSED_ATTENTION_BACKWARD / (1 + FUSED_ATTENTION_BACKWARD) * c["attention"])
    assert 0.6 < backward / slow.breakdown["compute"] < 0.75
    for t, cluster in ((slow, ether), (fast, nvlink)):
        times = [call_time("all_reduce", b, span(cluster, 2)) for b in buckets]
        assert t.breakdown["dp_comm"] == pytest.approx(max(0.0, sum(times[:-1]) - backward) + times[-1], rel=1e-9)
    assert ether.link_for(2, 1).bandwidth_gbs == pytest.approx(2.5)
    assert nvlink.intra.bandwidth_gbs == pytest.approx(370.0)


def test_no_dp_comm_without_data_parallel(gpt2, h100):
    t = estimate_time(gpt2, GPT2_S, GPT2_WORK, h100)
    assert "dp_comm" not in t.breakdown and "dp_replicate_comm" not in t.breakdown


def test_hsdp_has_replicate_comm(llama70b, h100_64):
    s = Strategy("hsdp", dp=64, dp_shard=8, micro_batch=1, grad_accum=8)
    t = estimate_time(llama70b, s, W70, h100_64)
    assert {"dp_comm", "dp_replicate_comm"} <= set(t.breakdown)
    grad_shard = param_count(llama70b.cfg).total * 4 / 8
    link = h100_64.link_for(8, 8)     # one replica per node: the network
    assert link.name == "ib-ndr"
    # FSDP2 all-reduces across replicas after every micro-batch's backward (8 of them)
    assert t.breakdown["dp_replicate_comm"] == pytest.approx(8 * call_time("all_reduce", grad_shard,
                                                                           span(h100_64, 8, 8)), rel=1e-9)
    fsdp = estimate_time(llama70b, Strategy("fsdp", dp=64, micro_batch=1, grad_accum=8), W70, h100_64)
    assert "dp_replicate_comm" not in fsdp.breakdown
    # hsdp shards the optimizer over 8 ranks, fsdp over 64: 8x the optimizer time
    assert t.breakdown["optimizer"] == pytest.approx(8 * fsdp.breakdown["optimizer"], rel=1e-9)
    assert math.isfinite(t.step_s) and t.step_s == pytest.approx(sum(t.breakdown.values()), rel=1e-12)


# ---------------------------------------------------------------- mixture of experts

def test_expert_parallel_adds_all_to_all():
    mixtral = resolve_model("mixtral-8x7b")
    cluster = make_cluster("8xH100")
    work = Workload(4096, 64)
    no_ep = estimate_time(mixtral, Strategy("ddp", dp=8, micro_batch=1, grad_accum=8), work, cluster)
    ep = estimate_time(mixtral, Strategy("ddp", dp=8, ep=8, micro_batch=1, grad_accum=8), work, cluster)
    assert "ep_comm" not in no_ep.breakdown and ep.breakdown["ep_comm"] > 0
    # per MoE block (32) and micro-batch (8): the 4096 tokens x top-2 rows of d = 4096 dispatched
    # (fp32: the residual stream under autocast) and combined (bf16), forward and backward, and an
    # all-to-all of the 8 experts' int64 counts before each dispatch
    rows = 4096 * 2 * 4096
    link = cluster.intra
    per_block = (2 * gather_or_scatter(rows * 4, 8, link) + 2 * gather_or_scatter(rows * 2, 8, link)
                 + gather_or_scatter(8 * 8, 8, link))
    assert ep.breakdown["ep_comm"] == pytest.approx(per_block * 32 * 8, rel=1e-9)
    # the counts are all-reduced over the data-parallel ranks in every MoE block, with or without ep
    # (64 bytes: NCCL's model runs them LL, a ring within the node: 6.6 us + 14 steps x 0.6 us)
    counts = call_time("all_reduce", 8 * 8, span(cluster, 8))
    assert counts == pytest.approx((6.6 + 14 * 0.6) * 1e-6 + 64 / (141e9 * 8 / 14), rel=1e-9)
    assert no_ep.breakdown["moe_counts"] == pytest.approx(counts * 32 * 8, rel=1e-9)
    assert ep.breakdown["moe_counts"] == no_ep.breakdown["moe_counts"]
    assert "moe_counts" not in estimate_time(resolve_model("llama-8b"), Strategy("ddp", dp=8, grad_accum=8),
                                             work, cluster).breakdown


def test_all_to_all_across_nodes_goes_through_each_gpus_nic():
    cluster = make_cluster("8xH100", nodes=2)
    intra, inter = cluster.intra.bandwidth_gbs * 1e9, cluster.inter.bandwidth_gbs * 1e9
    row = Collective("ep", "all_to_all", "blocks", 16, 1e9, 1)
    # 7/16 of the buffer to this node's GPUs over NVLink, 8/16 through this GPU's NIC, at once
    expected = max(7 / 16 * 1e9 / intra, 8 / 16 * 1e9 / inter) + 15 * cluster.inter.latency_us * 1e-6
    assert all_to_all_time([row], cluster, 1) == pytest.approx(expected, rel=1e-12)
    # tp 2 puts 4 members on a node
    ep8 = dataclasses.replace(row, group=8)
    expected = max(3 / 8 * 1e9 / intra, 4 / 8 * 1e9 / inter) + 7 * cluster.inter.latency_us * 1e-6
    assert all_to_all_time([ep8], cluster, 2) == pytest.approx(expected, rel=1e-12)
    # within a node: the ring time
    assert all_to_all_time([ep8], cluster, 1) == pytest.approx(gather_or_scatter(1e9, 8, cluster.intra), rel=1e-12)


def _ep_rows(model, s, work):
    return [r for r in step_collectives(model, s, work) if r.dim == "ep" and r.part == "blocks"]


def test_all_to_all_grows_with_ep_top_k_and_recompute():
    mixtral = resolve_model("mixtral-8x7b")
    cluster, work = make_cluster("8xH100", nodes=4), Workload(4096, 128)

    def layout(**kw):
        return Strategy("fsdp", dp=32, micro_batch=1, grad_accum=4, **kw)

    def ep_comm(model, **kw):
        return estimate_time(model, layout(**kw), work, cluster).breakdown["ep_comm"]

    by_ep = [ep_comm(mixtral, ep=e) for e in (2, 4, 8)]
    assert by_ep[0] < by_ep[1] < by_ep[2]          # more of the rows leave the rank: (ep - 1) / ep
    # 16 ranks span two nodes: the all-to-all crosses the inter-node link
    m16 = PlanModel("m16", dataclasses.replace(mixtral.cfg, moe_experts=16))
    assert ep_comm(m16, ep=16) > 3 * ep_comm(m16, ep=8)
    # the routed bytes are tokens x top_k x d: exactly proportional to top_k
    routed = {k: sum(r.nbytes for r in _ep_rows(PlanModel("k", dataclasses.replace(mixtral.cfg, moe_top_k=k)),
                                                layout(ep=8), work)) for k in (1, 2, 4)}
    assert routed[2] == 2 * routed[1] and routed[4] == 4 * routed[1]
    times = [ep_comm(PlanModel("k", dataclasses.replace(mixtral.cfg, moe_top_k=k)), ep=8) for k in (1, 2, 4)]
    assert times[0] < times[1] < times[2]
    # activation checkpointing (full or selective) re-runs the forward's dispatch and combine
    none, full = (sum(r.calls for r in _ep_rows(mixtral, layout(ep=8, ac=ac), work)) for ac in ("none", "full"))
    assert none == 2 * 2 * 32 * 4 and full == 1.5 * none
    assert _ep_rows(mixtral, layout(ep=8, ac="selective"), work) == _ep_rows(mixtral, layout(ep=8, ac="full"), work)
    assert ep_comm(mixtral, ep=8, ac="full") > ep_comm(mixtral, ep=8)


def test_expert_compute_counts_the_active_experts_only():
    """Twice the experts at the same top_k: the same FLOPs per token (the routed rows spread over
    more experts); twice the top_k: twice the expert FLOPs. MFU counts the active parameters."""
    mixtral = resolve_model("mixtral-8x7b")
    cluster, work = make_cluster("8xH100", nodes=4), Workload(4096, 128)
    s = Strategy("fsdp", dp=32, ep=8, micro_batch=2, grad_accum=2)

    def compute(**changes):
        return estimate_time(PlanModel("m", dataclasses.replace(mixtral.cfg, **changes)), s, work, cluster).breakdown["compute"]

    assert compute(moe_experts=16) == pytest.approx(compute(), rel=0.01)
    assert compute(moe_top_k=4) > 1.3 * compute()
    t = estimate_time(mixtral, s, work, cluster)
    active = param_count(mixtral.cfg).active_matmul
    assert active < 0.3 * param_count(mixtral.cfg).total                     # 2 of 8 experts
    assert t.mfu == pytest.approx(t.tokens_per_s * (6 * active + 12 * 32 * 4096 * 4096) / (cluster.peak_flops("bf16") * 32))


def test_expert_parallel_moves_expert_gathers_to_the_ranks_holding_them():
    """fsdp with ep: the routed experts gather and reduce over the dp / ep ranks that hold the
    same experts (E / ep of them per rank), the dense parts over all dp ranks as before."""
    mixtral = resolve_model("mixtral-8x7b")
    work = Workload(4096, 128)
    experts = param_count(mixtral.cfg).experts
    for ep in (2, 8):
        rows = step_collectives(mixtral, Strategy("fsdp", dp=32, ep=ep, micro_batch=1, grad_accum=4), work)
        expert = [r for r in rows if r.part == "experts"]
        assert {r.group for r in expert} == {32 // ep}
        scatter = [r for r in expert if r.kind == "reduce_scatter"]
        assert sum(r.nbytes for r in scatter) == pytest.approx(experts / ep * 4 * 4)   # fp32, every micro-batch
    ddp = step_collectives(mixtral, Strategy("ddp", dp=8, ep=8, micro_batch=1, grad_accum=4), work)
    assert not [r for r in ddp if r.part == "experts"]    # ep = dp: no two ranks hold the same experts
    reduced = sum(r.nbytes for r in ddp if r.part == "gradients")
    assert reduced == pytest.approx((param_count(mixtral.cfg).total - experts) * 4)


def test_expert_parallel_shrinks_optimizer_and_dp_comm():
    mixtral = resolve_model("mixtral-8x7b")
    cluster = make_cluster("8xH100")
    work = Workload(4096, 64)
    dense = estimate_time(mixtral, Strategy("ddp", dp=8, micro_batch=1, grad_accum=8), work, cluster)
    ep = estimate_time(mixtral, Strategy("ddp", dp=8, ep=8, micro_batch=1, grad_accum=8), work, cluster)
    # each GPU holds 1 of the 8 experts per block: far fewer parameters to step and to all-reduce
    assert ep.breakdown["optimizer"] < 0.5 * dense.breakdown["optimizer"]
    assert ep.breakdown["dp_comm"] < 0.5 * dense.breakdown["dp_comm"]
