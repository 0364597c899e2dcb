"""Pipeline memory, rank by rank (issue 19): every pp rank is planned with the whole blocks the
trainer gives it (plan/stages.rank_parts), the embedding on the first stage's rank, the head and
loss on the last's, the micro-batches its schedule keeps in flight and torch's pipelining
buffers; the plan is the busiest rank's. Hand sums, torch's own schedule order, and measured
ranks (one process) against the plan."""

from __future__ import annotations

import pytest

from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.models.flops import param_count
from slipstream.models.transformer import mlp_hidden, padded_vocab_size
from slipstream.plan.accuracy import TARGET_ERROR, plan_case
from slipstream.plan.accuracy_cases import pipeline_cases
from slipstream.plan.accuracy_measure import measure_case
from slipstream.plan.memory import estimate_memory, in_flight_microbatches, rank_memory
from slipstream.plan.memory_activations import block_activation_bytes
from slipstream.plan.model import resolve_model
from slipstream.plan.space import PlanModel, Strategy
from slipstream.plan.stages import rank_parts

SEQ = 128


def _tiny(**overrides) -> PlanModel:
    values = {**PRESETS["tiny"], "preset": "tiny", "vocab_size": 512, "n_layer": 4, "d_model": 128, "n_head": 4,
              **overrides}
    return PlanModel("tiny", ModelConfig(**values))


# ---------------------------------------------------------------- micro-batches in flight per rank

def test_1f1b_rank_r_keeps_pp_minus_r_micro_batches():
    """torch's Schedule1F1B warms rank r up with min(m, pp - r) forwards before its first backward."""
    for m in (2, 4, 16):
        s = Strategy(pp=4, grad_accum=m)
        assert [in_flight_microbatches(s, r) for r in range(4)] == [min(m, 4 - r) for r in range(4)]
    s = Strategy(pp=4, grad_accum=8)
    assert [in_flight_microbatches(s.replace(pp_schedule="gpipe"), r) for r in range(4)] == [8] * 4
    assert [in_flight_microbatches(s.replace(pp_schedule="zbv"), r) for r in range(4)] == [4] * 4
    assert [in_flight_microbatches(s.replace(pp_schedule="dualpipev"), r) for r in range(4)] == [5] * 4


def _torch_in_flight(name: str, p: int, m: int, v: int, rank: int) -> float:
    """The most stage-micro-batches rank `rank` holds at once in the op list torch's interleaved
    schedules build (a forward adds one; a full backward, or zero bubble's weight backward, frees
    it), over its v stages."""
    import torch.distributed.pipelining.schedules as schedules

    per_round = m // max(1, m // p)
    zero_bubble = name == "interleaved-zero-bubble"
    warmup = schedules._get_warmup_ops(rank, v, per_round, p, m, multiply_factor=1 if zero_bubble else 2)
    steady = v * m - warmup

    def forward_stage(step):
        return ((step // per_round) % v) * p + rank

    def backward_stage(step):
        return (v - 1 - ((step - warmup) // per_round) % v) * p + rank

    ops = schedules._get_1f1b_rank_ops(v, p, warmup, steady, v * m - steady, rank, forward_stage, backward_stage,
                                       rank if zero_bubble else 0, enable_zero_bubble=zero_bubble)
    kinds = schedules._ComputationType
    alive = most = 0
    for op in ops:
        if op is None:
            continue
        alive += {kinds.FORWARD: 1, kinds.FULL_BACKWARD: -1, kinds.BACKWARD_WEIGHT: -1}.get(op.computation_type, 0)
        most = max(most, alive)
    return most / v


@pytest.mark.skipif(not hasattr(__import__("torch.distributed.pipelining.schedules", fromlist=["x"]),
                                "_get_1f1b_rank_ops"), reason="this torch has no _get_1f1b_rank_ops")
@pytest.mark.parametrize("name", ["interleaved-1f1b", "interleaved-zero-bubble"])
def test_interleaved_in_flight_follows_torchs_op_order(name):
    """Per rank, the planner's count equals the peak of torch's own op list (rounds of m // pp
    micro-batches, 2 warm-up steps per hop to the last rank, zero bubble's deferred weights)."""
    for p, m, v in ((4, 8, 2), (4, 4, 3), (4, 2, 2), (3, 6, 2), (8, 16, 4)):
        s = Strategy(pp=p, pp_schedule=name, pp_virtual=v, grad_accum=m)
        assert [in_flight_microbatches(s, r) for r in range(p)] == [_torch_in_flight(name, p, m, v, r) for r in range(p)]
    # Narayanan et al. 2021 (sec. 2.2.2): rank 0 holds (1 + (p - 1) / (p v)) x 1F1B's
    s = Strategy(pp=4, pp_schedule="interleaved-1f1b", pp_virtual=2, grad_accum=16)
    assert in_flight_microbatches(s, 0) == 4 * (1 + 3 / 8)


# ---------------------------------------------------------------- a rank, by hand

def test_pipeline_ranks_equal_a_hand_sum():
    """fp32, full AC, 1F1B over 2 ranks, 4 micro-batches of 2 x 128 tokens, every byte by hand:
    rank 0 (embedding, 2 micro-batches in flight, each one's output held until its backward, a
    gradient buffer per micro-batch), rank 1 (head copy and loss, 1 in flight, its input in one of
    its receive buffers, the logits held until the backward)."""
    model = _tiny()
    cfg, pc = model.cfg, param_count(model.cfg)
    s = Strategy(pp=2, micro_batch=2, grad_accum=4, ac="full", precision="fp32")
    n, d, vocab, m = 2 * SEQ, cfg.d_model, padded_vocab_size(cfg), 4
    parts = rank_parts(cfg, SEQ, 2, "1f1b", 1)
    block = pc.attn + pc.mlp + pc.norm
    stream = n * d * 4                              # one micro-batch's residual stream (fp32)
    whole_block = block_activation_bytes(model, n, s, mode="none")
    in_block = whole_block - stream + n * mlp_hidden(cfg) * 4 + 2 * stream   # recompute + transient
    expected = []
    for part in parts:
        params = part.blocks * block + (vocab * d + cfg.max_seq_len * d if part.embedding else 0) \
            + (vocab * d + pc.final_norm if part.head else 0)
        states = 16 * params      # fp32 parameter and gradient (kept: 4 micro-batches), Adam's two moments
        buffers = m * stream      # rank 0: gradients coming back; rank 1: activations coming in
        if part.embedding:
            acts = 2 * (part.blocks * stream) + 2 * stream   # + each micro-batch's output, held
            peaks = [states + acts + buffers + in_block]
        else:
            final_norm = 2 * stream                          # its input and output (fp32: no autocast copies)
            acts = part.blocks * stream + final_norm - stream   # the first block's input is a receive buffer
            loss_fwd, loss_bwd = 2 * n * vocab * 4, 4 * n * vocab * 4   # + the held logits
            peaks = [states + acts + buffers + loss_fwd, states + acts + buffers + loss_bwd,
                     states + acts - final_norm + buffers + in_block]
        expected.append(max(peaks))
        assert rank_memory(model, s, SEQ, part.rank, device="cpu").peak_bytes == max(peaks), part
    plan = estimate_memory(model, s, SEQ, device="cpu")
    assert plan.peak_bytes == max(expected) and plan.peak_rank == expected.index(max(expected))
    assert plan.to_record()["peak_rank"] == plan.peak_rank
    assert any(note.startswith(f"pipeline: rank {plan.peak_rank} of 2") for note in plan.notes)


def test_the_peak_rank_is_the_one_holding_most():
    """Llama 3 8B over 4 ranks, 8 blocks each: under 1F1B the first rank holds the embedding and
    the most micro-batches in flight (4, then 3, 2, 1): it is the peak, and memory falls rank by
    rank up to the last (the head and the loss); under GPipe every rank holds all 8, and the last also every micro-batch's logits: it is
    the peak. With the trainer's own split the plan is still the largest rank's."""
    model = resolve_model("llama-8b")
    even = Strategy(pp=4, micro_batch=1, grad_accum=8, precision="bf16", pp_layers=(8, 8, 8, 8))
    ranks = [rank_memory(model, even, 4096, r).total_bytes for r in range(4)]
    assert ranks[0] > ranks[1] > ranks[2] and estimate_memory(model, even, 4096).peak_rank == 0
    gpipe = even.replace(pp_schedule="gpipe")
    ranks = [rank_memory(model, gpipe, 4096, r).total_bytes for r in range(4)]
    assert ranks[1] == ranks[2] and ranks.index(max(ranks)) == 3 == estimate_memory(model, gpipe, 4096).peak_rank
    s = even.replace(pp=8, grad_accum=16, pp_layers=())
    parts = rank_parts(model.cfg, 4096, 8, "1f1b", 1)
    assert sum(p.blocks for p in parts) == model.cfg.n_layer and len({p.blocks for p in parts}) > 1
    ranks = [rank_memory(model, s, 4096, r).total_bytes for r in range(8)]
    plan = estimate_memory(model, s, 4096)
    assert plan.total_bytes == max(ranks) and plan.peak_rank == ranks.index(max(ranks))


def test_no_fractional_layers():
    """7 layers over 3 ranks: every rank plans whole blocks (its rank_parts share), the plan is
    one of them, and a rank's blocks cost whole blocks' bytes."""
    model = _tiny(n_layer=7)
    s = Strategy(pp=3, micro_batch=2, grad_accum=3, precision="fp32", ac="full")
    parts = rank_parts(model.cfg, SEQ, 3, "1f1b", 1)
    assert sorted(p.blocks for p in parts) != [7 / 3] * 3 and sum(p.blocks for p in parts) == 7
    ranks = [rank_memory(model, s, SEQ, r, device="cpu") for r in range(3)]
    plan = estimate_memory(model, s, SEQ, device="cpu")
    assert plan.peak_bytes == max(r.peak_bytes for r in ranks)
    block = param_count(model.cfg)
    one_block = (block.attn + block.mlp + block.norm) * 4
    assert ranks[1].breakdown["parameters"] == parts[1].blocks * one_block


def test_a_pinned_split_moves_the_peak():
    """Strategy.pp_layers is the split: more blocks on a rank, more memory there."""
    model = _tiny()
    s = Strategy(pp=2, micro_batch=2, grad_accum=4, precision="fp32")
    balanced = estimate_memory(model, s, SEQ, device="cpu")
    front = estimate_memory(model, s.replace(pp_layers=(3, 1)), SEQ, device="cpu")
    back = estimate_memory(model, s.replace(pp_layers=(1, 3)), SEQ, device="cpu")
    assert front.peak_rank == 0 and back.peak_rank == 1
    assert front.peak_bytes > balanced.peak_bytes and back.peak_bytes != front.peak_bytes
    assert rank_memory(model, s.replace(pp_layers=(1, 3)), SEQ, 0, device="cpu").peak_bytes < \
        rank_memory(model, s.replace(pp_layers=(3, 1)), SEQ, 0, device="cpu").peak_bytes


def test_torch_buffers_hold_the_whole_batch_at_every_stage_boundary():
    """torch's stages keep a receive buffer per micro-batch (stages after the first) and a
    gradient buffer per micro-batch (stages before the last) all step: a middle rank holds the
    rank's whole batch of residual streams twice, whatever the micro-batch size."""
    model = resolve_model("llama-8b")
    tokens = 4096 * 16                 # the rank's sequences per step x sequence
    for mb, m in ((1, 16), (2, 8), (4, 4)):
        s = Strategy(pp=4, micro_batch=mb, grad_accum=m, precision="bf16", ac="full")
        more = s.replace(grad_accum=2 * m)
        # 1F1B rank 1 keeps min(m, 3) in flight: with m >= 3 only the buffers grow with m
        grown = (rank_memory(model, more, 4096, 1).breakdown["temporaries"]
                 - rank_memory(model, s, 4096, 1).breakdown["temporaries"])
        assert grown == tokens * 4096 * 4 * 2, (mb, m)   # fp32 residual stream, receive + gradient
    # a V schedule's middle rank holds two stages: four sets
    s = Strategy(pp=4, pp_schedule="zbv", micro_batch=1, grad_accum=8, precision="bf16", ac="full")
    v_grown = (rank_memory(model, s.replace(grad_accum=16), 4096, 1).breakdown["temporaries"]
               - rank_memory(model, s, 4096, 1).breakdown["temporaries"])
    assert v_grown == 8 * 4096 * 4096 * 4 * 4


# ---------------------------------------------------------------- measured ranks

@pytest.mark.parametrize("label", [
    "tiny[n_layer=4,d_model=128,n_head=4] seq128 fp32 none pp2:1f1b layers:1,3 mb2x4 rank 1",
    "tiny[n_layer=4,d_model=128,n_head=4] seq128 fp32 none pp2:gpipe mb2x4 rank 1",
])
def test_measured_rank_within_the_grids_tolerance(label):
    """One pp rank's step on one process (its stage modules, its micro-batches in torch's order,
    torch's buffers; MemTracker) against the planner's estimate for that rank: a pinned split's
    last rank, GPipe's (every micro-batch and its logits in flight). The stratified subset of
    test_plan_memory runs a 1F1B pipeline's busiest rank; the grid more."""
    (case,) = [c for c in pipeline_cases() if c.label() == label]
    measured = measure_case(case, threads=1)
    assert abs(plan_case(case) / measured - 1) <= TARGET_ERROR
