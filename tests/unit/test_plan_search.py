"""Tests for slipstream.plan.search: the layouts, the ranking, infeasible and impossible work,
and strategy_overrides (a layout as `slipstream train` config values)."""

import pytest

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.plan.hardware import make_cluster
from slipstream.plan.memory import GIB
from slipstream.plan.model import resolve_model
from slipstream.plan.search import MAX_VIRTUAL, MICRO_BATCHES, evaluate, explain_infeasible, layouts, plan
from slipstream.plan.space import (PP_DP_STRATEGIES, TP_DP_STRATEGIES, PlanModel, Strategy, Workload,
                                   strategy_overrides)

W70 = Workload(8192, 512)


@pytest.fixture(scope="module")
def cluster64():
    return make_cluster("8xH100", nodes=8)


@pytest.fixture(scope="module")
def llama70b():
    return resolve_model("llama-70b", seq_len=8192)


@pytest.fixture(scope="module")
def result70(llama70b, cluster64):
    return plan(llama70b, cluster64, W70)


@pytest.fixture(scope="module")
def gpt2():
    return resolve_model("gpt2")


@pytest.fixture(scope="module")
def mixtral_result():
    return plan(resolve_model("mixtral-8x7b"), make_cluster("8xH100"), Workload(4096, 64))


# ---------------------------------------------------------------- llama-70b on 64 H100

def test_ranked_by_tokens_per_s(result70, cluster64):
    r = result70
    assert r.evaluated == len(r.ranked) + len(r.rejected)
    assert len(r.ranked) > 10 and len(r.rejected) > 10
    speeds = [c.time.tokens_per_s for c in r.ranked]
    assert speeds == sorted(speeds, reverse=True)
    for a, b in zip(r.ranked, r.ranked[1:]):           # ties: less memory first
        if a.time.tokens_per_s == b.time.tokens_per_s:
            assert a.memory.total_bytes <= b.memory.total_bytes
    assert r.best() is r.ranked[0]
    assert 0.2 < r.ranked[0].time.mfu < 0.75


def test_ranked_fit_and_rejected_do_not(result70, cluster64):
    usable = cluster64.memory_bytes
    assert usable == 78 * GIB
    for c in result70.ranked:
        assert c.fits and c.why_not == ""
        assert c.memory.total_bytes <= usable
        assert c.strategy.world == 64
    for c in result70.rejected:
        assert not c.fits
        assert c.memory.total_bytes > usable
        assert c.why_not.startswith("needs ") and "GiB" in c.why_not and "78.0 GiB" in c.why_not
        needed = float(c.why_not.split()[1])
        assert needed == pytest.approx(c.memory.total_bytes / GIB, abs=0.051)
    speeds = [c.time.tokens_per_s for c in result70.rejected]
    assert speeds == sorted(speeds, reverse=True)


def test_ranked_layouts_span_parallelisms(result70):
    ranked = result70.ranked
    assert any(c.strategy.tp > 1 for c in ranked) and any(c.strategy.pp > 1 for c in ranked)
    flagged = [c for c in ranked if c.not_runnable]
    assert flagged and all(c.not_runnable == c.strategy.not_runnable() for c in ranked)
    for c in ranked:
        s = c.strategy
        # Tensor parallelism runs with none / fsdp / hsdp and without the fused loss (issue 13).
        tp_flagged = any(r.startswith("tensor parallel") for r in c.not_runnable)
        assert tp_flagged == (s.tp > 1 and (s.dp_strategy not in TP_DP_STRATEGIES or s.fused_loss))
        # Pipelines run with none / ddp / fsdp / hsdp and tp, without cp and the fused loss, and
        # with the micro-batches torch's schedules need (issue 14).
        pp_flagged = any(r.startswith(f"pipeline parallel {s.pp}") for r in c.not_runnable)
        refused = (s.cp > 1 or s.dp_strategy in ("zero1", "zero2") or s.fused_loss
                   or (s.pp_schedule == "1f1b" and s.grad_accum < s.pp)
                   or (s.pp_schedule == "interleaved-1f1b" and s.grad_accum % max(1, s.grad_accum // s.pp)))
        assert pp_flagged == (s.pp > 1 and refused), (s.label(), c.not_runnable)
    assert any(c.strategy.pp > 1 and not c.not_runnable for c in ranked)


def test_best_runnable_has_no_reasons(result70):
    best = result70.best(runnable_only=True)
    assert best is not None and best.not_runnable == []
    s = best.strategy
    assert s.ep == 1 and not best.strategy.not_runnable()
    assert s.tp == 1 or (s.dp_strategy in TP_DP_STRATEGIES and not s.fused_loss)
    assert s.pp == 1 or (s.cp == s.tp == 1 and s.dp_strategy in PP_DP_STRATEGIES and not s.fused_loss)
    assert s.world == 64 and s.dp_strategy in ("zero2", "fsdp", "hsdp")   # 70B does not fit unsharded
    runnable = [c for c in result70.ranked if not c.not_runnable]
    assert best is runnable[0]
    assert best.time.tokens_per_s <= result70.ranked[0].time.tokens_per_s


def test_runnable_only_gives_dp_tp_and_pp_layouts(llama70b, cluster64, result70):
    r = plan(llama70b, cluster64, W70, runnable_only=True)
    assert r.ranked and r.evaluated < result70.evaluated
    for c in r.ranked + r.rejected:
        assert c.strategy.ep == 1
        assert c.not_runnable == []
    assert any(c.strategy.tp > 1 for c in r.ranked)  # tensor parallelism runs now
    assert any(c.strategy.pp > 1 for c in r.ranked)  # and pipelines (issue 14)
    assert r.ranked[0].strategy == result70.best(runnable_only=True).strategy
    assert r.best(runnable_only=True) is r.ranked[0]


def test_layouts_divide_the_work(llama70b, cluster64):
    for s in layouts(llama70b, cluster64, W70):
        assert s.world == 64
        assert s.dp * s.micro_batch * s.grad_accum == 512
        assert llama70b.cfg.n_head % s.tp == 0 and (llama70b.cfg.n_kv_head or llama70b.cfg.n_head) % s.tp == 0
        assert s.tp <= 8 and s.micro_batch in MICRO_BATCHES
        if s.dp_strategy == "hsdp":
            assert s.dp_shard > 1 and s.dp % s.dp_shard == 0 and s.dp > s.dp_shard
        if s.offload:
            assert s.dp_strategy in ("fsdp", "hsdp")
        if s.pp_schedule == "interleaved-1f1b":
            # 2 chunks per rank (stages of uneven whole blocks), or more where the layers split evenly
            assert s.pp * s.pp_virtual <= llama70b.cfg.n_layer and 2 <= s.pp_virtual <= MAX_VIRTUAL
            assert s.pp_virtual == 2 or llama70b.cfg.n_layer % (s.pp * s.pp_virtual) == 0


# ---------------------------------------------------------------- small and impossible work

def test_gpt2_single_gpu_best_is_no_data_parallel(gpt2):
    r = plan(gpt2, make_cluster("1xH100"), Workload(1024, 64))
    assert r.ranked and not r.rejected
    best = r.best()
    assert best.strategy.dp_strategy == "none" and best.strategy.dp == 1
    assert best.strategy.micro_batch * best.strategy.grad_accum == 64
    assert {c.strategy.dp_strategy for c in r.ranked} == {"none"}
    # 8 micro-batch sizes x 3 AC modes x fused loss on/off, less micro-batches above 64 (128)
    assert r.evaluated == 7 * 3 * 2


def test_infeasible_explains_model_states():
    r = plan(resolve_model("llama-70b", seq_len=4096), make_cluster("1xL4"), Workload(4096, 8))
    assert r.ranked == [] and r.best() is None and r.rejected
    text = explain_infeasible(r)
    assert text.startswith("nothing fits in 22.0 GiB per GPU")
    assert "model states alone" in text
    leanest = min(r.rejected, key=lambda c: c.memory.total_bytes)
    assert leanest.strategy.label() in text


def test_infeasible_activations_advice(gpt2):
    """States fit, activations do not: the advice is about the sequence, not the model states."""
    cluster = make_cluster("1xH100", memory_gib=2.0)
    r = plan(gpt2, cluster, Workload(1024, 8), ac=("none",), micro_batches=(8,))
    assert r.ranked == []
    text = explain_infeasible(r)
    assert "model states alone" not in text and "Shorten the sequence" in text


def test_prime_global_batch(gpt2):
    cluster = make_cluster("8xH100")
    # 7 sequences on 8 GPUs: only layouts without data parallelism (tp x pp = 8) divide it
    r = plan(gpt2, cluster, Workload(1024, 7))
    assert r.evaluated > 0
    for c in r.ranked + r.rejected:
        s = c.strategy
        assert (s.dp, s.dp_strategy, s.tp * s.pp * s.cp, s.micro_batch, s.grad_accum) == (1, "none", 8, 1, 7)
    # 1F1B needs at least pp micro-batches: 7 run over pp 2 or 4 with tp, not over pp 8 (the 12 blocks
    # of gpt2 also make 8 uneven interleaved stages over pp 4)
    best = r.best(runnable_only=True).strategy
    assert best.tp * best.pp == 8 and best.pp <= 7 and best.pp_schedule in ("1f1b", "interleaved-1f1b")
    assert all(c.not_runnable for c in r.ranked if c.strategy.pp == 8 and c.strategy.pp_schedule == "1f1b")
    # GPipe runs fewer micro-batches than stages: 7 sequences over a pipeline of 8
    piped = plan(gpt2, cluster, Workload(1024, 7), runnable_only=True, pp_schedules=("gpipe",))
    assert any((c.strategy.pp, c.strategy.pp_schedule, c.strategy.grad_accum) == (8, "gpipe", 7) for c in piped.ranked)
    # ddp only: the batch binds (dp 2, 4, 8 reach 6 or 8 sequences), or the strategy (dp 1 runs none)
    with pytest.raises(UserError, match="(?s)degrees these GPUs reach are 2, 4, 8 .*work: 6 or 8 .*strategy none"):
        plan(gpt2, cluster, Workload(1024, 7), dp_strategies=("ddp",))


def test_seq_longer_than_learned_positions(gpt2):
    with pytest.raises(UserError, match="max_seq_len"):
        plan(gpt2, make_cluster("1xH100"), Workload(4096, 8))
    # RoPE models have no table: resolve_model stretches max_seq_len
    llama = resolve_model("llama-1b", seq_len=65536)
    assert llama.cfg.max_seq_len >= 65536


def test_workload_rejects_nonpositive():
    with pytest.raises(UserError):
        Workload(0, 8)
    with pytest.raises(UserError):
        Workload(1024, 0)


def test_space_restrictions(gpt2):
    cluster = make_cluster("8xH100")
    work = Workload(1024, 64)
    space = dict(dp_strategies=("fsdp",), tp=(1,), pp=(1,), ac=("full",), micro_batches=(2, 4))
    assert len(layouts(gpt2, cluster, work, **space)) == 2 * 2 * 2   # micro-batch x offload x fused loss
    r = plan(gpt2, cluster, work, **space)
    # each layout fits without offload, so its offload twin (slower, never ranked above it) is not evaluated
    assert r.evaluated == 2 * 2 and len(r.ranked) == 4 and not any(c.strategy.offload for c in r.ranked)
    for c in r.ranked + r.rejected:
        s = c.strategy
        assert (s.dp_strategy, s.dp, s.tp, s.pp, s.ac) == ("fsdp", 8, 1, 1, "full")
        assert s.micro_batch in (2, 4) and s.dp * s.micro_batch * s.grad_accum == 64
    r = plan(gpt2, cluster, work, tp=(2,), pp=(1,), dp_strategies=("ddp", "zero1"))
    assert {c.strategy.tp for c in r.ranked + r.rejected} == {2}
    assert {c.strategy.dp_strategy for c in r.ranked + r.rejected} == {"ddp", "zero1"}
    assert {c.strategy.dp for c in r.ranked + r.rejected} == {4}


def test_evaluate_matches_plan_entry(gpt2):
    cluster = make_cluster("1xH100")
    work = Workload(1024, 64)
    r = plan(gpt2, cluster, work)
    best = r.best()
    again = evaluate(gpt2, best.strategy, work, cluster)
    assert again.time.tokens_per_s == best.time.tokens_per_s
    assert again.memory.total_bytes == best.memory.total_bytes
    rec = best.to_record()
    assert rec["layout"] == best.strategy.label() and rec["runnable"] is True
    assert rec["memory"]["total_bytes"] == best.memory.total_bytes


# ---------------------------------------------------------------- mixture of experts

def test_mixtral_expert_parallel_runnable_and_ranked(mixtral_result):
    """mixtral-8x7b is a real preset: its experts come from model.moe_*, and the expert-parallel
    layouts slipstream runs (fsdp / hsdp / zero2, ddp at ep = dp) are runnable and ranked."""
    r = mixtral_result
    assert r.model.moe and r.model.cfg.moe_experts == 8 and r.model.cfg.moe_top_k == 2
    ep = [c for c in r.ranked + r.rejected if c.strategy.ep > 1]
    assert {c.strategy.ep for c in ep} == {2, 4, 8}
    for c in ep:
        s = c.strategy
        assert s.dp % s.ep == 0
        refused = s.cp > 1 or s.dp_strategy == "zero1" or (s.dp_strategy == "ddp" and s.dp != s.ep)
        assert any(x.startswith(f"expert parallel {s.ep}") for x in c.not_runnable) == refused, (s.label(), c.not_runnable)
    assert "mixture of experts" not in {x for c in r.ranked + r.rejected for x in c.not_runnable}
    assert any(c.strategy.ep > 1 and not c.not_runnable for c in r.ranked)
    best = r.best(runnable_only=True)
    assert best is not None and best.not_runnable == []


def test_mixtral_runnable_only_keeps_expert_parallel_layouts():
    r = plan(resolve_model("mixtral-8x7b"), make_cluster("8xH100"), Workload(4096, 64), runnable_only=True)
    assert r.ranked and all(not c.not_runnable for c in r.ranked + r.rejected)
    assert {c.strategy.ep for c in r.ranked} >= {1, 2, 4, 8}
    assert any(c.strategy.ep > 1 and c.strategy.tp > 1 for c in r.ranked + r.rejected)   # ep x tp
    assert any(c.strategy.ep > 1 and c.strategy.pp > 1 for c in r.ranked + r.rejected)   # ep x pp


def test_expert_parallel_rules():
    """What the trainer runs (distributed/expert_parallel.py): ep with fsdp / hsdp / zero2, ddp
    only where ep = dp, never zero1 nor cp; with tp and pp as they run without experts."""
    assert Strategy("fsdp", dp=8, ep=4).not_runnable() == []
    assert Strategy("zero2", dp=8, ep=2).not_runnable() == []
    assert Strategy("hsdp", dp=16, dp_shard=8, ep=4).not_runnable() == []
    assert Strategy("ddp", dp=8, ep=8).not_runnable() == []
    assert Strategy("fsdp", dp=4, tp=2, ep=4).not_runnable() == []
    assert Strategy("fsdp", dp=4, pp=2, ep=2, grad_accum=2).not_runnable() == []
    assert Strategy("ddp", dp=8, ep=4).not_runnable() == [
        "expert parallel 4 with ddp over 8 ranks (ddp needs ep = dp; fsdp or hsdp average the ranks holding "
        "the same experts)"]
    assert Strategy("zero1", dp=8, ep=8).not_runnable() == ["expert parallel 8 with zero1"]
    assert Strategy("fsdp", dp=4, cp=2, ep=2).not_runnable() == ["expert parallel 2 with context parallel 2"]
    assert "expert parallel 3 over 4 data-parallel ranks (ep must divide them)" in Strategy("fsdp", dp=4, ep=3).not_runnable()
    # the model's side: ep splits the experts of an MoE model
    gpt2, moe = resolve_model("gpt2"), resolve_model("moe-tiny")
    cluster, work = make_cluster("8xH100"), Workload(256, 64)
    assert "expert parallel 2 without experts" in evaluate(gpt2, Strategy("fsdp", dp=8, ep=2), work, cluster).not_runnable
    assert "expert parallel 8: 4 experts do not split evenly" in evaluate(
        moe, Strategy("fsdp", dp=8, ep=8), work, cluster).not_runnable
    assert evaluate(moe, Strategy("fsdp", dp=8, ep=4), work, cluster).not_runnable == []
    # fp16 loss scaling cannot carry the balancing losses' gradients (config.load refuses it)
    assert "fp16 loss scaling with the MoE balancing losses" in evaluate(
        moe, Strategy("ddp", dp=8, ep=8, precision="fp16"), work, cluster).not_runnable


def test_flagged_and_hybrid_expert_layouts_are_planned_across_nodes():
    """cp x ep (flagged) and hsdp x ep plan on two nodes: every group's link lies inside the cluster."""
    mixtral, cluster = resolve_model("mixtral-8x7b", seq_len=32768), make_cluster("8xH100", nodes=2)
    c = evaluate(mixtral, Strategy("fsdp", dp=2, cp=8, ep=2, ac="full"), Workload(32768, 32), cluster)
    assert c.not_runnable == ["expert parallel 2 with context parallel 8"] and c.time.breakdown["ep_comm"] > 0
    h = evaluate(mixtral, Strategy("hsdp", dp=16, dp_shard=8, ep=4, ac="full"), Workload(4096, 64), cluster)
    assert h.not_runnable == [] and h.time.breakdown["moe_counts"] > 0 and h.time.breakdown["ep_comm"] > 0


def test_moe_layouts_divide_experts_and_data_parallel_degree():
    found = layouts(resolve_model("moe-tiny"), make_cluster("8xH100", nodes=2), Workload(256, 64))
    eps = {s.ep for s in found}
    assert eps == {1, 2, 4}                                   # the 4 experts' divisors
    assert all(s.dp % s.ep == 0 for s in found)
    assert {s.ep for s in layouts(resolve_model("gpt2"), make_cluster("8xH100"), Workload(1024, 64))} == {1}


# ---------------------------------------------------------------- strategy_overrides

def test_overrides_write_the_expert_parallel_degree():
    from slipstream.plan.space import strategy_from_config

    assert strategy_overrides(Strategy("fsdp", dp=8, ep=4), 256)["parallel.ep"] == 4
    assert strategy_overrides(Strategy("fsdp", dp=8), 256)["parallel.ep"] == 1   # a layout replaces a config's ep
    cfg = load_config(None, ["--model.preset=moe-tiny", "--model.vocab_size=64", "--train.seq_len=128",
                             "--parallel.dp_strategy=fsdp", "--parallel.ep=2"])
    assert strategy_from_config(cfg, 4, "fsdp", 0).ep == 2


def test_write_config_of_an_expert_parallel_plan(tmp_path):
    """--write-config writes parallel.ep and the model's moe_* fields: the config trains the plan."""
    from slipstream.plan.render import write_best_config
    from slipstream.plan.search import PlanResult

    model, cluster, work = resolve_model("mixtral-8x7b"), make_cluster("8xH100", nodes=4), Workload(4096, 128)
    best = evaluate(model, Strategy("fsdp", dp=32, ep=8, micro_batch=1, grad_accum=4, ac="full"), work, cluster)
    assert best.fits and not best.not_runnable
    out = tmp_path / "mixtral.toml"
    write_best_config(PlanResult(model, cluster, work, [best], [], 1), str(out))
    cfg = load_config(str(out))
    assert cfg.parallel.ep == 8 and cfg.parallel.dp_strategy == "fsdp"
    assert (cfg.model.moe_experts, cfg.model.moe_top_k, cfg.model.n_layer) == (8, 2, 32)


def test_overrides_fsdp_bf16():
    s = Strategy("fsdp", dp=8, micro_batch=2, grad_accum=4, ac="selective", fused_loss=True, loss_chunk=2048)
    ov = strategy_overrides(s, 2048)
    assert ov["parallel.param_dtype"] == "bf16" and ov["parallel.reduce_dtype"] == "fp32"
    assert ov["precision.autocast"] == "none"
    assert ov["parallel.dp_strategy"] == "fsdp"
    assert ov["train.seq_len"] == 2048 and ov["train.micro_batch_size"] == 2 and ov["train.grad_accum_steps"] == 4
    assert ov["activations.checkpointing"] == "selective"
    assert ov["train.fused_loss"] is True and ov["train.fused_loss_chunk"] == 2048
    assert "parallel.dp_shard" not in ov


def test_overrides_ddp_bf16_and_fp32():
    ov = strategy_overrides(Strategy("ddp", dp=8, micro_batch=4, grad_accum=2), 1024)
    assert ov["precision.autocast"] == "bf16"
    assert ov["parallel.param_dtype"] == "none" and ov["parallel.reduce_dtype"] == "none"
    assert ov["train.fused_loss"] is False and "train.fused_loss_chunk" not in ov
    fp32 = strategy_overrides(Strategy("fsdp", dp=8, precision="fp32"), 1024)
    assert fp32["precision.autocast"] == "none" and fp32["parallel.param_dtype"] == "none"


def test_overrides_hsdp_degrees():
    ov = strategy_overrides(Strategy("hsdp", dp=16, dp_shard=8, offload=True), 1024)
    assert ov["parallel.dp_shard"] == 8 and ov["parallel.dp_replicate"] == 2
    assert ov["parallel.offload"] is True


def test_overrides_tp_and_refusals():
    ov = strategy_overrides(Strategy("fsdp", dp=4, tp=2), 1024)
    assert ov["parallel.tp"] == 2 and ov["parallel.sequence_parallel"] is True and ov["parallel.loss_parallel"] is True
    with pytest.raises(UserError, match="tensor parallel 2 with ddp"):
        strategy_overrides(Strategy("ddp", dp=4, tp=2), 1024)
    with pytest.raises(UserError, match="tensor parallel 2 with the fused loss"):
        strategy_overrides(Strategy("fsdp", dp=4, tp=2, fused_loss=True), 1024)
    # tp / cp always written: a tp1 layout laid over a tp2 config must reset it
    assert strategy_overrides(Strategy("ddp", dp=8), 1024)["parallel.tp"] == 1
    ov = strategy_overrides(Strategy("fsdp", dp=2, tp=2, cp=2), 4096)
    assert ov["parallel.cp"] == 2 and ov["parallel.tp"] == 2
    with pytest.raises(UserError, match="context parallel 2 with none"):
        strategy_overrides(Strategy("none", cp=2), 4096)
    with pytest.raises(UserError, match="context parallel 2 with ddp"):
        strategy_overrides(Strategy("ddp", dp=2, tp=2, cp=2), 4096)
    with pytest.raises(UserError, match="pipeline parallel 4"):
        strategy_overrides(Strategy("none", pp=4), 1024)


def test_overrides_of_every_runnable_layout_load():
    """Every runnable layout becomes config values `slipstream train` accepts."""
    model = resolve_model("llama-8b", seq_len=4096)
    seen = set()
    for precision in ("bf16", "fp32", "fp16"):
        for s in layouts(model, make_cluster("8xH100", nodes=2), Workload(4096, 64), runnable_only=True,
                         precision=precision, micro_batches=(1,)):
            key = (s.dp_strategy, s.ac, s.offload, s.fused_loss, precision)
            if key in seen:
                continue
            seen.add(key)
            values = strategy_overrides(s, 4096)
            args = [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]
            cfg = load_config(None, args + ["--model.preset=llama-8b", "--model.max_seq_len=4096"])
            assert cfg.parallel.dp_strategy == s.dp_strategy
            assert cfg.train.micro_batch_size == s.micro_batch
            assert cfg.activations.checkpointing == s.ac
    assert len(seen) > 50


def test_tensor_parallel_degrees_divide_the_padded_vocabulary_and_sequence():
    """The planner proposes only tp degrees the run's plan splits evenly (issue 13 review)."""
    import dataclasses

    from slipstream.plan.search import layouts

    base = resolve_model("gpt2", seq_len=1024)
    odd_vocab = PlanModel("gpt2", dataclasses.replace(base.cfg, vocab_size=50257, vocab_multiple=1))
    cluster = make_cluster("8xH100")
    assert {s.tp for s in layouts(odd_vocab, cluster, Workload(1024, 64))} == {1}
    # 1026 = 2 x 513: sequence parallel splits it over tp 2 only; without SP tp 4 runs too
    assert {s.tp for s in layouts(base, cluster, Workload(1026, 64), sequence_parallel="on")} == {1, 2}
    assert {(s.tp, s.sequence_parallel) for s in layouts(base, cluster, Workload(1026, 64)) if s.tp > 1} == {
        (2, True), (2, False), (4, False)}
    assert {2, 4} <= {s.tp for s in layouts(base, cluster, Workload(1024, 64))}
