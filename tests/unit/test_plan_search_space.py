"""The planner's layout space (issue 19 part 1): every divisor degree, uneven whole-block pipeline
stages and chunks per rank, sequence parallel and the fused loss on / off, fp16 on the FSDP family,
the no-layout error's binding constraint, the pruning's premises, and the MFU / HFU columns."""

from __future__ import annotations

import dataclasses
import random
import time
from types import SimpleNamespace

import pytest

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.plan.hardware import make_cluster
from slipstream.plan.memory import estimate_memory
from slipstream.plan.model import resolve_model
from slipstream.plan.render import format_plan
from slipstream.plan.search import MAX_VIRTUAL, Candidate, PlanResult, SearchSpace, layouts, plan
from slipstream.plan.space import PlanModel, Strategy, Workload, strategy_overrides
from slipstream.plan.stages import rank_parts
from slipstream.plan.timing import estimate_time

GPT2 = resolve_model("gpt2").cfg


def _model(name: str, **changes) -> PlanModel:
    return PlanModel(name, dataclasses.replace(GPT2, **changes))


# A 530B-like model (MT-NLG's shape: 105 layers, d 20480, 128 heads) and the 280 nodes x 8 it trained on.
MT_NLG = _model("mt-nlg-like", n_layer=105, d_model=20480, n_head=128, max_seq_len=2048, vocab_size=51200)
NODES_280 = make_cluster("8xA100", nodes=280)
WORK_530B = Workload(2048, 1920)


# ---------------------------------------------------------------- every divisor

def test_2240_gpus_search_every_divisor_degree():
    """2240 = 2^6 x 5 x 7: pipeline degrees 7, 14, 35, 70 and data-parallel degrees 5, 10, 20, 40, 80
    are searched (pp 5 is not: it leaves dp 56 or 112, and 1920 sequences do not split over them);
    every layout multiplies to the GPUs and divides the batch."""
    start = time.perf_counter()
    found = layouts(MT_NLG, NODES_280, WORK_530B)
    assert time.perf_counter() - start < 5   # the degrees are checked before anything is multiplied out
    assert {s.pp for s in found} == {7, 14, 28, 35, 56, 70}
    assert {5, 10, 20, 40, 80} <= {s.dp for s in found}
    for s in found:
        assert s.world == 2240 and s.dp * s.micro_batch * s.grad_accum == 1920 and s.pp * s.pp_virtual <= 105
    # the published layout: tp 8 x pp 35 x dp 8 (1920 / 8 = 240 sequences per replica)
    assert any((s.tp, s.pp, s.dp, s.pp_schedule) == (8, 35, 8, "1f1b") for s in found)
    # the search stays bounded (a regression guard on the pruning: counted, not timed)
    assert len(found) < 20_000


def test_280_and_48_nodes_plan():
    r = plan(MT_NLG, NODES_280, WORK_530B, tp=(8,), pp=(35,), ac=("full",), fused_loss="off",
             sequence_parallel="on", dp_strategies=("zero1", "fsdp"), micro_batches=(1,))
    best = r.best(runnable_only=True)
    assert best is not None and (best.strategy.tp, best.strategy.pp, best.strategy.dp) == (8, 35, 8)
    # 48 nodes: pp 3, 6 and 12 for a 36-layer model (384 = 2^7 x 3)
    m36 = _model("m36", n_layer=36, d_model=1024, n_head=16, max_seq_len=2048)
    nodes48 = make_cluster("8xH100", nodes=48)
    assert {3, 6, 12, 24} <= {s.pp for s in layouts(m36, nodes48, Workload(2048, 1536))}
    r = plan(m36, nodes48, Workload(2048, 1536), pp=(3, 12), tp=(4,), ac=("none",), fused_loss="off",
             sequence_parallel="on", dp_strategies=("fsdp",), micro_batches=(1,))
    assert {c.strategy.pp for c in r.ranked} == {3, 12} and {c.strategy.dp for c in r.ranked} == {32, 8}


def test_tensor_parallel_stays_within_a_node_and_divides_the_model():
    six = make_cluster("6xH100", nodes=2)     # 6 GPUs per node: tp 1, 2, 3, 6
    m = _model("h24", n_head=24, d_model=1536, vocab_size=50304)
    assert {s.tp for s in layouts(m, six, Workload(1024, 48))} == {1, 2, 3, 6}
    # 12 heads but 2 KV heads: tp divides both (1, 2)
    gqa = _model("gqa", n_head=12, n_kv_head=2, d_model=768)
    assert {s.tp for s in layouts(gqa, six, Workload(1024, 48))} == {1, 2}


# ---------------------------------------------------------------- pipelines

def test_chunks_per_rank_default_and_asked():
    m = resolve_model("llama-70b")   # 80 layers
    cluster, work = make_cluster("8xH100", nodes=8), Workload(8192, 512)

    def chunks(pp, **space):
        return {s.pp_virtual for s in layouts(m, cluster, work, pp=(pp,), tp=(8,), micro_batches=(1,), ac=("none",),
                                               **space) if s.pp_schedule == "interleaved-1f1b"}
    # 2, and the most up to MAX_VIRTUAL that split the layers evenly: 80 / (8 x 5) = 2 blocks per chunk
    assert chunks(8) == {2, 5} and MAX_VIRTUAL == 8
    assert chunks(2) == {2, 8}      # 80 / (2 x 8) = 5
    assert chunks(8, pp_virtual=(3, 10)) == {3, 10}   # 24 uneven stages, and 80 one-block stages
    assert chunks(8, pp_virtual=(11,)) == set()       # 88 stages > 80 layers
    # the V schedules always run 2, one-stage schedules 1
    found = layouts(m, cluster, work, pp=(8,), tp=(8,), pp_schedules=("zbv", "gpipe"), micro_batches=(1,))
    assert {(s.pp_schedule, s.pp_virtual) for s in found} == {("zbv", 2), ("gpipe", 1)}
    with pytest.raises(UserError, match="looping schedules"):
        layouts(m, cluster, work, pp_schedules=("1f1b",), pp_virtual=(3,))


def test_uneven_stages_are_the_trainers_split():
    """A 10-layer model on pipelines of 3, 4, 6 and 8 ranks: uneven whole-block stages. The blocks per
    rank the planner sizes (plan.stages.rank_parts of the layout) are the blocks the trainer builds from
    the config the layout writes (its split_layers and stage_indices)."""
    from slipstream.config.dims import pp_layers, virtual_stages
    from slipstream.distributed.pipeline_stages import stage_indices
    from slipstream.plan.stages import split_layers, stage_costs

    args = ["--model.preset=tiny", "--model.n_layer=10", "--model.n_head=4", "--model.d_model=128",
            "--model.vocab_size=512", "--model.max_seq_len=256"]
    cfg = load_config(None, args)
    model, cluster = PlanModel("tiny-10", cfg.model), make_cluster("8xH100", nodes=3)
    found = {(s.pp, s.pp_schedule, s.pp_virtual): s for s in layouts(
        model, cluster, Workload(256, 48), runnable_only=True, ac=("none",), micro_batches=(1,), fused_loss="off",
        sequence_parallel="on", tp=(1,), pp_schedules=("1f1b", "interleaved-1f1b", "zbv")) if s.pp > 1}.values()
    assert {3, 4, 6, 8} <= {s.pp for s in found}
    assert any(10 % (s.pp * s.pp_virtual) for s in found)            # uneven ones among them
    for s in found:
        values = strategy_overrides(s, 256)
        written = load_config(None, [*args, *(f"--{k}={str(v).lower() if isinstance(v, bool) else v}"
                                                for k, v in values.items())]).parallel
        v = virtual_stages(written)
        splits = split_layers(10, s.pp * v, pp_layers(written), stage_costs(cfg.model, 256))
        trainer = [sum(len(splits[i]) for i in stage_indices(written.pp_schedule, r, s.pp, v)) for r in range(s.pp)]
        planned = [part.blocks for part in rank_parts(cfg.model, 256, s.pp, s.pp_schedule, s.pp_virtual,
                                                      s.pp_layers or None)]
        assert planned == trainer and sum(trainer) == 10, s.label()


def test_a_pinned_split_is_searched_and_written():
    m = _model("m38", n_layer=38, d_model=512, n_head=8)
    cluster, work = make_cluster("8xH100"), Workload(1024, 64)
    found = layouts(m, cluster, work, pp_layers=(9, 10, 10, 9), micro_batches=(1,), ac=("none",))
    # 4 stages: pp 4 with 1F1B, or pp 2 interleaved with 2 chunks each
    assert {(s.pp, s.pp_schedule, s.pp_virtual) for s in found if s.pp > 1} == {(4, "1f1b", 1), (2, "interleaved-1f1b", 2)}
    for s in found:
        if s.pp > 1:
            assert s.pp_layers == (9, 10, 10, 9) and "layers:9,10,10,9" in s.label()
            if not s.not_runnable():
                assert strategy_overrides(s, 1024)["parallel.pp_layers"] == "9,10,10,9"
            assert [p.blocks for p in rank_parts(m.cfg, 1024, s.pp, s.pp_schedule, s.pp_virtual, s.pp_layers)] == (
                [9, 10, 10, 9] if s.pp == 4 else [19, 19])
    with pytest.raises(UserError, match="add up to the model's 38 layers"):
        layouts(m, cluster, work, pp_layers=(9, 10, 10, 10))


# ---------------------------------------------------------------- sequence parallel, fused loss

def test_sequence_parallel_is_searched_on_and_off():
    m, cluster, work = resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 64)
    both = layouts(m, cluster, work, micro_batches=(4,), ac=("none",))
    tp = [s for s in both if s.tp > 1]
    assert {s.sequence_parallel for s in tp} == {True, False}
    assert {"+sp" in s.label() for s in tp} == {True, False}
    # the trainer runs both: the same reasons (or none) either way
    for s in tp:
        assert s.not_runnable() == s.replace(sequence_parallel=not s.sequence_parallel).not_runnable()
    off = layouts(m, cluster, work, micro_batches=(4,), ac=("none",), sequence_parallel="off")
    assert not any("+sp" in s.label() for s in off) and {s.tp for s in off} == {1, 2, 4}
    on = layouts(m, cluster, work, micro_batches=(4,), ac=("none",), sequence_parallel="on")
    assert all("+sp" in s.label() for s in on if s.tp > 1)
    assert len(on) + len(off) == len(both) + len([s for s in both if s.tp == 1])
    # without SP the sequence need not divide by tp (1026 = 2 x 513)
    odd = Workload(1026, 64)
    assert {s.tp for s in layouts(m, cluster, odd, sequence_parallel="off")} == {1, 2, 4}
    assert {s.tp for s in layouts(m, cluster, odd, sequence_parallel="on")} == {1, 2}
    # and the plan sizes the difference: SP splits the norms' and residuals' activations over tp
    s = Strategy("fsdp", dp=2, tp=4, micro_batch=4, grad_accum=8)
    sp, nosp = (estimate_memory(m, s.replace(sequence_parallel=v), 1024).breakdown["activations"] for v in (True, False))
    assert sp < nosp


def test_the_fused_loss_can_be_excluded():
    m, cluster, work = resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 64)
    space = dict(micro_batches=(4,), ac=("none",), tp=(1,), pp=(1,))
    both = layouts(m, cluster, work, **space)
    assert {s.fused_loss for s in both} == {True, False}
    assert not any(s.fused_loss or "fused-loss" in s.label() for s in layouts(m, cluster, work, fused_loss="off", **space))
    assert all(s.fused_loss for s in layouts(m, cluster, work, fused_loss="on", **space))
    assert len(layouts(m, cluster, work, fused_loss="off", **space)) * 2 == len(both)
    with pytest.raises(UserError, match="on, off or both"):
        layouts(m, cluster, work, fused_loss="maybe")


# ---------------------------------------------------------------- fp16 on the FSDP family

def test_fp16_on_the_fsdp_family_is_planned_like_bf16_and_flagged():
    m, cluster, work = resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 64)
    r = plan(m, cluster, work, precision="fp16", dp_strategies=("fsdp", "ddp"), tp=(1,), pp=(1,), ac=("none",),
             micro_batches=(8,), fused_loss="off")
    fsdp = next(c for c in r.ranked if c.strategy.dp_strategy == "fsdp" and not c.strategy.offload)
    assert fsdp.not_runnable[0] == "fp16 loss scaling with fsdp (bf16 runs it)"      # the first reason
    ddp = next(c for c in r.ranked if c.strategy.dp_strategy == "ddp")
    assert ddp.not_runnable == []
    # FSDP mixed precision in fp16: the memory of bf16
    bf16 = estimate_memory(m, fsdp.strategy.replace(precision="bf16"), 1024)
    assert fsdp.memory.total_bytes == bf16.total_bytes
    # shown in the table with its reason, and first in the error when only runnable layouts are asked for
    assert "no: fp16 loss scaling with fsdp" in format_plan(r, 10, 0)
    with pytest.raises(UserError) as e:
        plan(m, cluster, work, precision="fp16", dp_strategies=("fsdp", "ddp"), tp=(2,), pp=(1,), fused_loss="off",
             runnable_only=True)
    text = str(e.value)
    assert "every layout needs fp16 loss scaling with fsdp" in text and "tensor parallel 2 with ddp" in text
    assert text.index("fp16 loss scaling") < text.index("tensor parallel 2 with ddp") and "--precision bf16" in text


# ---------------------------------------------------------------- the no-layout error

def _error(*args, **space) -> str:
    with pytest.raises(UserError) as e:
        plan(*args, **space)
    return str(e.value)


def test_no_layout_names_the_batch_with_reachable_degrees_and_nearest_batches():
    text = _error(resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 7), tp=(1, 2, 4), pp=(1,))
    assert "global batch 7 is not a multiple of any reachable data-parallel degree x micro-batch" in text
    assert "reach are 2, 4, 8" in text and "work: 6 or 8" in text     # multiples of 2 around 7
    # 2240 GPUs, 1921 sequences: 1920 (dp 320 x 6) below, 1924 (dp 4 x 481) above
    text = _error(MT_NLG, NODES_280, Workload(2048, 1921))
    assert "work: 1920 or 1924" in text and "reach are 4, 5, 7, 8, 10, " in text
    assert "heads" not in text and "multiple of 2240" not in text


def test_no_layout_names_the_heads():
    gqa = _model("gqa", n_head=12, n_kv_head=2)
    text = _error(gqa, make_cluster("8xH100"), Workload(1024, 64), tp=(4,))
    assert "tp4 does not divide the model's 2 KV heads" in text and "not a multiple" not in text


def test_no_layout_names_the_layers():
    text = _error(_model("two", n_layer=2), make_cluster("8xH100"), Workload(1024, 64), pp=(8,))
    assert "pp8 needs at least 8 layers (one block per stage), the model has 2" in text
    # 1 sequence on 8 GPUs of a 2-layer model with 6 heads: dp must be 1, so tp x pp = 8, and each way
    # breaks one constraint: pp 8 or 4 the layers, tp 4 or 8 the heads; dp > 1 the batch
    text = _error(_model("two-six", n_layer=2, n_head=6, d_model=384), make_cluster("8xH100"), Workload(1024, 1))
    assert "pp8 needs at least 8 layers" in text and "pp4 needs at least 4 layers" in text
    assert "tp4 does not divide the model's 6 heads" in text and "global batch 1 is not a multiple" in text


def test_no_layout_names_the_sequence():
    m, cluster = resolve_model("gpt2"), make_cluster("8xH100")
    text = _error(m, cluster, Workload(1022, 64), tp=(4,), sequence_parallel="on")
    assert "sequence parallel splits the 1022-token sequence over tp4" in text
    llama = resolve_model("llama-1b", seq_len=16386)
    text = _error(llama, cluster, Workload(16386, 64), cp=(2,), tp=(1,))
    assert "cp2 cuts the 16386-token sequence into 4 chunks: it is not divisible by 4" in text


def test_no_layout_names_the_experts():
    moe, cluster = resolve_model("moe-tiny"), make_cluster("8xH100")   # 4 experts
    assert "ep3 does not divide the model's 4 experts" in _error(moe, cluster, Workload(256, 64), ep=(3,))
    assert "ep2: the model has no routed experts" in _error(resolve_model("gpt2"), cluster, Workload(1024, 64), ep=(2,))
    # ep 4 over the 2 data-parallel ranks of tp 2 x pp 2
    text = _error(moe, cluster, Workload(256, 64), ep=(4,), tp=(2,), pp=(2,))
    assert "ep4 does not divide the data-parallel degree 2" in text


# ---------------------------------------------------------------- the pruning's premises

def test_memory_levers_are_monotone_and_offload_only_costs_time():
    """plan() skips a twin that needs at least the memory levers of one that does not fit, and an
    offload twin of a layout that fits: both premises, on a sample of layouts."""
    rng = random.Random(0)
    m, cluster, work = resolve_model("llama-8b", seq_len=4096), make_cluster("8xH100", nodes=2), Workload(4096, 64)
    sample = rng.sample(layouts(m, cluster, work, dp_strategies=("fsdp", "hsdp")), 25)
    for s in sample:
        mem = {ac: estimate_memory(m, s.replace(ac=ac, offload=False, fused_loss=False), 4096).total_bytes
               for ac in ("full", "selective", "none")}
        assert mem["full"] <= mem["selective"] <= mem["none"], s.label()
        plain = s.replace(offload=False, fused_loss=False)
        assert estimate_memory(m, plain.replace(fused_loss=True), 4096).total_bytes <= mem[s.ac]
        assert estimate_memory(m, plain.replace(offload=True), 4096).total_bytes <= estimate_memory(m, plain, 4096).total_bytes
        assert (estimate_time(m, plain.replace(offload=True), work, cluster).tokens_per_s
                <= estimate_time(m, plain, work, cluster).tokens_per_s)
    # and the plan keeps every layout that fits without offload (the skipped are offload twins only)
    space = dict(tp=(1, 2), pp=(1,), micro_batches=(1, 2), dp_strategies=("fsdp",))
    r = plan(m, cluster, work, **space)
    from slipstream.plan.search import evaluate
    every = [evaluate(m, s, work, cluster) for s in layouts(m, cluster, work, **space)]
    assert {c.strategy for c in every if c.fits and not c.strategy.offload} == {
        c.strategy for c in r.ranked if not c.strategy.offload}
    assert r.evaluated < len(every)
    best = max((c for c in every if c.fits), key=lambda c: c.time.tokens_per_s)
    assert r.ranked[0].time.tokens_per_s == best.time.tokens_per_s


# ---------------------------------------------------------------- the table

def _candidate(**time) -> Candidate:
    from slipstream.plan.memory import MemoryEstimate

    parts = {"parameters": 1, "gradients": 1, "optimizer_state": 1, "activations": 1, "temporaries": 1}
    base = dict(step_s=1.0, tokens_per_s=1000.0, mfu=0.4, breakdown={"compute": 1.0})
    return Candidate(Strategy("ddp", dp=8, micro_batch=1, grad_accum=1), MemoryEstimate(5, "backward", parts),
                     SimpleNamespace(**base, **time), True)


def test_table_shows_mfu_and_hfu_labelled():
    cluster = make_cluster("8xH100")
    result = PlanResult(resolve_model("gpt2"), cluster, Workload(1024, 8), [_candidate(hfu=0.52)], [], 1)
    text = format_plan(result, 10, 0)
    header = next(line for line in text.splitlines() if "layout" in line and "tokens/s" in line)
    assert " MFU " in header and " HFU " in header
    assert "40.0%  52.0%" in text and "MFU (model FLOPs)" in text and "HFU (with recompute)" in text
    # a time model without hfu: no HFU column
    text = format_plan(PlanResult(resolve_model("gpt2"), cluster, Workload(1024, 8), [_candidate()], [], 1), 10, 0)
    assert "HFU" not in text and "MFU (model FLOPs)" in text


def test_search_space_checks_its_options():
    m, cluster, work = resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 64)
    with pytest.raises(UserError, match="tp values must be >= 1"):
        SearchSpace(m, cluster, work, tp=(0,))
    with pytest.raises(UserError, match="unknown precision"):
        SearchSpace(m, cluster, work, precision="fp8")
