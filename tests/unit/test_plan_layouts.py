"""What a plan writes and how layouts map to what slipstream runs (review findings)."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import time

import pytest

from slipstream.cli import main
from slipstream.errors import UserError
from slipstream.config import load_config
from slipstream.plan.hardware import make_cluster
from slipstream.plan.memory import GIB, estimate_memory
from slipstream.plan.model import resolve_model
from slipstream.plan.search import evaluate, layouts, plan
from slipstream.plan.space import (PP_SCHEDULES, SCHEDULE_VIRTUAL, PlanModel, Strategy, Workload,
                                   strategy_from_config, strategy_overrides)
from slipstream.plan.timing import estimate_time
from slipstream.tune.system import stop_trial


def test_written_config_trains_exactly_the_planned_model(tmp_path, capsys):
    model_toml = tmp_path / "my.toml"
    model_toml.write_text('[model]\npreset = "tiny"\nn_layer = 4\nn_head = 4\nd_model = 256\nmlp = "swiglu"\n'
                          'norm = "rmsnorm"\nposition = "rope"\nbias = false\ntie_embeddings = false\nvocab_size = 32000\nmax_seq_len = 4096\n')
    out = tmp_path / "out.toml"
    assert main(["plan", "--model", str(model_toml), "--gpus", "1xH100", "--seq", "2048", "--global-batch", "8",
                 "--write-config", str(out)]) == 0
    planned, written = load_config(str(model_toml)).model, load_config(str(out)).model
    for field in ("n_layer", "n_head", "d_model", "mlp", "norm", "position", "bias", "tie_embeddings", "vocab_size"):
        assert getattr(written, field) == getattr(planned, field), field
    assert oct(out.stat().st_mode & 0o777) == "0o644"
    assert "[data]" in out.read_text()  # the header tells the user to add their data


def test_fp32_plans_run_with_tf32_and_low_precision_without():
    assert strategy_overrides(Strategy(precision="fp32"), 128)["precision.tf32"] is True
    assert strategy_overrides(Strategy(precision="bf16"), 128)["precision.tf32"] is False


def test_fp16_on_the_fsdp_family_is_planned_and_flagged():
    """fp16 needs loss scaling, which slipstream runs through autocast only (config.dims refuses it
    on FSDP2): the FSDP family in fp16 is planned as it would run, and flagged with that reason."""
    model, cluster = resolve_model("gpt2"), make_cluster("8xH100")
    found = layouts(model, cluster, Workload(1024, 64), precision="fp16")
    assert {"ddp", "zero1", "zero2", "fsdp"} <= {s.dp_strategy for s in found}
    for s in found:
        flagged = "fp16 loss scaling with " + s.dp_strategy + " (bf16 runs it)" in s.not_runnable()
        assert flagged == (s.dp_strategy in ("zero2", "fsdp", "hsdp")), s.label()
    runnable = {s.dp_strategy for s in layouts(model, cluster, Workload(1024, 64), precision="fp16", runnable_only=True)}
    assert runnable == {"ddp", "zero1"}


def test_expert_parallel_does_not_shrink_expert_state_under_fsdp():
    """Experts shard over the dp/ep ranks that hold them: per GPU, experts/dp whatever ep is."""
    model = resolve_model("mixtral-8x7b")
    states = []
    for ep in (1, 2, 4, 8):
        b = estimate_memory(model, Strategy(dp_strategy="fsdp", dp=16, ep=ep, precision="bf16"), 4096).breakdown
        states.append(b["parameters"] + b["optimizer_state"])   # gradients: partial at a backward peak
    assert max(states) == pytest.approx(min(states), rel=1e-6)
    assert states[0] == pytest.approx(46.7e9 * 12 / 16, rel=0.02)   # (4 + 8) bytes over 16 ranks


def test_zero1_pays_the_parameter_broadcast():
    model, cluster = resolve_model("llama-8b"), make_cluster("8xH100")
    work = Workload(4096, 64)
    ddp = estimate_time(model, Strategy("ddp", dp=8, micro_batch=1, grad_accum=8), work, cluster)
    zero1 = estimate_time(model, Strategy("zero1", dp=8, micro_batch=1, grad_accum=8), work, cluster)
    assert zero1.breakdown["zero1_broadcast"] > 0 and "zero1_broadcast" not in ddp.breakdown
    assert zero1.breakdown["dp_comm"] == pytest.approx(ddp.breakdown["dp_comm"], rel=1e-12)  # same all-reduce
    # its optimizer step is 8x smaller, but the broadcast of 8B fp32 parameters costs more than that saves
    assert zero1.breakdown["optimizer"] == pytest.approx(ddp.breakdown["optimizer"] / 8, rel=1e-9)


def test_fsdp_reduces_every_micro_batch_but_once_under_a_pipeline():
    """Same layout, more micro-batches: FSDP's exposed traffic grows with them, except under a
    pipeline, where the stage keeps its parameters gathered and reduces once per step."""
    model, cluster = resolve_model("llama-8b"), make_cluster("1xH100", nodes=8, inter="ethernet-25g")
    work = Workload(4096, 64)
    one = estimate_time(model, Strategy("fsdp", dp=8, micro_batch=8, grad_accum=1), work, cluster)
    eight = estimate_time(model, Strategy("fsdp", dp=8, micro_batch=1, grad_accum=8), work, cluster)
    assert eight.breakdown["dp_comm"] > 4 * one.breakdown["dp_comm"] > 0
    piped_one = estimate_time(model, Strategy("fsdp", dp=4, pp=2, micro_batch=16, grad_accum=1), work, cluster)
    piped_eight = estimate_time(model, Strategy("fsdp", dp=4, pp=2, micro_batch=2, grad_accum=8), work, cluster)
    # (smaller micro-batches hide less of the one gather and reduce, but nothing repeats 8 times)
    assert piped_eight.breakdown["dp_comm"] < 2 * piped_one.breakdown["dp_comm"]


@pytest.mark.parametrize("flag", [["--tp", "0"], ["--pp", "0"], ["--cp", "0"], ["--micro-batch", "-2"],
                                  ["--rejected", "-1"], ["--vocab", "0"], ["--global-batch", "-1"]])
def test_bad_numbers_are_user_errors(flag, capsys):
    args = ["plan", "--model", "gpt2", "--gpus", "8xH100", "--seq", "1024", "--global-batch", "64", *flag]
    assert main(args) == 2
    assert "error:" in capsys.readouterr().err


def test_plan_rejects_what_does_not_fit_with_the_binding_constraint():
    result = plan(resolve_model("llama-8b"), make_cluster("1xL4"), Workload(4096, 8))
    assert not result.ranked and result.rejected
    assert all(c.memory.total_bytes > 20 * GIB for c in result.rejected)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc walk")
def test_stop_trial_kills_ranks_in_their_own_sessions(tmp_path):
    """torchrun starts ranks with start_new_session: a process-group kill misses them."""
    pid_file = tmp_path / "child.pid"
    script = ("import subprocess, sys, time\n"
              f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'], start_new_session=True)\n"
              f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
              "time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", script], start_new_session=True)
    deadline = time.time() + 10
    while not (pid_file.exists() and pid_file.read_text()) and time.time() < deadline:
        time.sleep(0.05)
    assert pid_file.exists() and pid_file.read_text(), "the trial did not start its child within 10 s"
    child = int(pid_file.read_text())
    stop_trial(proc, grace_s=0.5)
    for _ in range(100):
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        # a killed child stays a zombie until its reaper (init) collects it: check its state
        state = open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] if os.path.exists(f"/proc/{child}") else "X"
        if state in ("Z", "X"):
            break
        time.sleep(0.05)
    else:
        pytest.fail("the trial's child survived stop_trial")
    assert proc.returncode is not None


def test_pipeline_schedules_are_searched_as_asked():
    model, cluster = resolve_model("llama-70b"), make_cluster("8xH100", nodes=8)
    work = Workload(8192, 512)
    # the planner's short names are the trainer's schedules (parallel.pp_schedule)
    found = layouts(model, cluster, work, pp=(8,), tp=(8,), pp_schedules=("gpipe", "zero-bubble"))
    assert {(s.pp_schedule, s.pp_virtual) for s in found} == {("gpipe", 1), ("zbv", 2)}
    default = layouts(model, cluster, work, pp=(8,), tp=(8,))
    assert {s.pp_schedule for s in default} == {"1f1b", "interleaved-1f1b"}
    # 2 chunks per rank, and the counts up to MAX_VIRTUAL that split 80 layers over 8 ranks evenly (5: 2 blocks each)
    assert {s.pp_virtual for s in default if s.pp_schedule == "interleaved-1f1b"} == {2, 5}
    every = layouts(model, cluster, work, pp=(8,), tp=(8,), micro_batches=(1,), pp_schedules=PP_SCHEDULES)
    assert {s.pp_schedule for s in every} == set(SCHEDULE_VIRTUAL)
    # 80 layers over 32 ranks hold 2 chunks each (64 uneven stages of whole blocks), not 3 (96 stages);
    # over 64 ranks not even 2: no interleaved layout then
    chunks = {s.pp_virtual for s in layouts(model, cluster, work, pp=(32,), tp=(2,)) if s.pp_schedule == "interleaved-1f1b"}
    assert chunks == {2}
    assert not [s for s in layouts(model, cluster, work, pp=(64,), tp=(1,)) if s.pp_schedule == "interleaved-1f1b"]
    # zero-bubble: the best 1F1B layout run as zbv (the same layout and micro-batches) keeps only the
    # residual of its bubble. (Its step is not shorter here: the V split balances stages, not ranks,
    # and puts 12 blocks on the busiest rank; and with torch's per-micro-batch buffers no zbv layout
    # fits this batch at all.)
    f1b = plan(model, cluster, work, pp=(8,), tp=(8,), pp_schedules=("1f1b",)).ranked[0]
    zbv = estimate_time(model, f1b.strategy.replace(pp_schedule="zbv", pp_virtual=2), work, cluster)
    assert 0 < zbv.breakdown["pp_bubble"] < 0.1 * f1b.time.breakdown["pp_bubble"]
    with pytest.raises(UserError, match="unknown pipeline schedule 'zb'"):
        layouts(model, cluster, work, pp=(8,), pp_schedules=("zb",))


def test_small_models_run_faster_with_ddp_than_fsdp():
    """Per-unit collectives and FSDP's host-side work dominate a small model: DDP wins. At 4
    micro-batches of 2 FSDP pays its per-unit work 4 times a step; at one micro-batch of 8 its bf16
    residual stream (FSDP mixed precision, not autocast) halves enough pointwise traffic to win."""
    model, cluster = resolve_model("gpt2"), make_cluster("8xH100")
    work = Workload(1024, 64)
    ddp = estimate_time(model, Strategy("ddp", dp=8, micro_batch=2, grad_accum=4), work, cluster)
    fsdp = estimate_time(model, Strategy("fsdp", dp=8, micro_batch=2, grad_accum=4), work, cluster)
    assert ddp.tokens_per_s > fsdp.tokens_per_s
    assert fsdp.breakdown["fsdp_overhead"] > 0
    # the per-unit work decides it: without it FSDP's step would be the shorter
    assert fsdp.step_s - fsdp.breakdown["fsdp_overhead"] < ddp.step_s


def test_autocast_on_fsdp_plans_fp32_gathers_and_weight_copies():
    """A config may run FSDP with autocast instead of FSDP mixed precision: planned as it runs."""
    model = resolve_model("gpt2")
    mixed = estimate_memory(model, Strategy("fsdp", dp=4, micro_batch=16, precision="bf16"), 1024)
    autocast = estimate_memory(model, Strategy("fsdp", dp=4, micro_batch=16, precision="bf16", fsdp_mixed=False), 1024)
    fp32 = estimate_memory(model, Strategy("fsdp", dp=4, micro_batch=16, precision="fp32"), 1024)
    assert mixed.total_bytes < autocast.total_bytes < fp32.total_bytes


def test_strategy_from_config_resolves_like_the_trainer(tmp_path):
    cfg = load_config(None, ["--parallel.dp_strategy=hsdp", "--parallel.dp_replicate=2"])
    s = strategy_from_config(cfg, 4)
    assert (s.dp_strategy, s.dp, s.dp_shard) == ("hsdp", 4, 2)
    assert strategy_from_config(load_config(None, []), 2).dp_strategy == "ddp"
    assert strategy_from_config(load_config(None, []), 1).dp_strategy == "none"
    mixed = strategy_from_config(load_config(None, ["--parallel.dp_strategy=fsdp", "--parallel.param_dtype=bf16"]), 2)
    autocast = strategy_from_config(load_config(None, ["--parallel.dp_strategy=fsdp", "--precision.autocast=bf16"]), 2)
    assert mixed.fsdp_mixed and not autocast.fsdp_mixed and autocast.precision == "bf16"
    # and back: the overrides of an autocast FSDP layout ask for autocast, not FSDP mixed precision
    assert strategy_overrides(autocast, 128)["precision.autocast"] == "bf16"
    assert strategy_overrides(autocast, 128)["parallel.param_dtype"] == "none"


def test_strategy_from_config_carries_tensor_parallel():
    """The run's own memory check plans the tp layout it runs (issue 13): tp and SP from the
    config, dp = world / tp; and less memory per rank than the same run without tp."""
    from slipstream.plan.preflight import plan_training_memory
    args = ["--parallel.dp_strategy=fsdp", "--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=128"]
    cfg = load_config(None, [*args, "--parallel.tp=2", "--parallel.sequence_parallel=false"])
    s = strategy_from_config(cfg, 4)
    assert (s.dp_strategy, s.dp, s.tp, s.sequence_parallel) == ("fsdp", 2, 2, False)
    with_tp = plan_training_memory(load_config(None, [*args, "--parallel.tp=2"]), 2, "fsdp", 0, "cpu")
    without = plan_training_memory(load_config(None, args), 2, "fsdp", 0, "cpu")
    assert with_tp.total_bytes < without.total_bytes


def test_context_parallel_state_is_sharded_over_the_cp_ranks_too():
    """FSDP shards over the dp dims with cp folded in (issue 13 review): at cp2 the planned Adam
    state per rank is half of cp1's, as measured (benchmarks/model-parallel-cpu.json: 0.50x)."""
    from slipstream.plan.preflight import plan_training_memory

    args = ["--parallel.dp_strategy=fsdp", "--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=128"]
    one = plan_training_memory(load_config(None, args), 1, "fsdp", 0, "cpu")
    cp2 = plan_training_memory(load_config(None, [*args, "--parallel.cp=2"]), 1, "fsdp", 0, "cpu")
    assert cp2.breakdown["optimizer_state"] == pytest.approx(one.breakdown["optimizer_state"] / 2)
    assert Strategy("ddp", dp=2, cp=2).state_shard_group == 1 and Strategy("fsdp", dp=2, cp=2).state_shard_group == 4


# ---------------------------------------------------------------- pipelines (issue 14)

PP_MODEL = ["--model.preset=tiny", "--model.n_layer=8", "--model.n_head=4", "--model.d_model=128",
            "--model.vocab_size=512", "--model.max_seq_len=256"]


def _args(values: dict) -> list[str]:
    return [f"--{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in values.items()]


def test_pipeline_layouts_run_and_round_trip_through_the_config():
    for s in (Strategy("fsdp", dp=4, pp=2, pp_schedule="interleaved", micro_batch=2, grad_accum=4),
              Strategy("ddp", dp=2, pp=4, pp_schedule="zero-bubble", micro_batch=1, grad_accum=8, fsdp_mixed=False),
              Strategy("hsdp", dp=4, dp_shard=2, pp=2, pp_schedule="gpipe", micro_batch=4, grad_accum=2),
              Strategy("none", pp=8, micro_batch=1, grad_accum=8, precision="fp32", fsdp_mixed=False)):
        assert s.not_runnable() == [], s.label()
        values = strategy_overrides(s, 256)
        assert (values["parallel.pp"], values["parallel.pp_schedule"], values["parallel.pp_microbatches"],
                values["parallel.pp_virtual_stages"]) == (s.pp, s.pp_schedule, s.grad_accum, s.pp_virtual)
        assert values["parallel.pp_schedule"] in ("interleaved-1f1b", "zbv", "gpipe", "1f1b")  # the trainer's names
        cfg = load_config(None, [*PP_MODEL, *_args(values)])
        assert strategy_from_config(cfg, s.world) == s, s.label()


def test_a_layout_laid_over_a_pipeline_config_resets_it():
    values = strategy_overrides(Strategy("ddp", dp=2, micro_batch=2, grad_accum=4), 256)
    piped = ["--parallel.pp=2", "--parallel.pp_schedule=zbv", "--parallel.pp_microbatches=8",
             "--parallel.pp_virtual_stages=2", "--parallel.pp_layers=1,3,3,1"]
    p = load_config(None, [*PP_MODEL, *piped, *_args(values)]).parallel
    assert (p.pp, p.pp_schedule, p.pp_microbatches, p.pp_virtual_stages, p.pp_layers) == (1, "1f1b", 0, 0, "")


def test_pipeline_config_defaults_are_planned_as_the_trainer_runs_them():
    """pp_microbatches 0 is one sequence per micro-batch; pp_virtual_stages 0 the schedule's count."""
    args = [*PP_MODEL, "--parallel.pp=2", "--parallel.dp_strategy=fsdp", "--train.micro_batch_size=2",
            "--train.grad_accum_steps=4"]
    s = strategy_from_config(load_config(None, [*args, "--parallel.pp_schedule=interleaved-1f1b"]), 4)
    assert (s.dp, s.pp, s.pp_schedule, s.pp_virtual, s.micro_batch, s.grad_accum) == (2, 2, "interleaved-1f1b", 2, 1, 8)
    s = strategy_from_config(load_config(None, [*args, "--parallel.pp_microbatches=2"]), 4)
    assert (s.pp_schedule, s.pp_virtual, s.micro_batch, s.grad_accum) == ("1f1b", 1, 4, 2)


@pytest.mark.parametrize("changes, reason", [
    ({"cp": 2, "dp": 1}, "pipeline parallel 2 with context parallel 2"),
    ({"dp_strategy": "zero1"}, "pipeline parallel 2 with zero1"),
    ({"dp_strategy": "zero2"}, "pipeline parallel 2 with zero2"),
    ({"fused_loss": True}, "pipeline parallel 2 with the fused loss"),
    ({"precision": "fp16"}, "pipeline parallel 2 with fp16 loss scaling"),
    ({"grad_accum": 1, "micro_batch": 4}, "pipeline parallel 2: 1f1b with 1 micro-batches (needs 2)"),
    ({"pp_schedule": "dualpipev", "pp_virtual": 2}, "pipeline parallel 2: dualpipev with 2 micro-batches (needs 4)"),
    ({"pp_schedule": "zbv", "pp_virtual": 1}, "pipeline parallel 2: zbv with 1 stages per rank (it runs 2)"),
    ({"pp_schedule": "interleaved-1f1b", "pp_virtual": 2, "grad_accum": 5},
     "pipeline parallel 2: interleaved-1f1b with 5 micro-batches (not a multiple of its 2 rounds)"),
])
def test_pipeline_layouts_the_trainer_refuses_stay_planned_and_flagged(changes, reason):
    model, cluster = resolve_model("gpt2"), make_cluster("8xH100")
    base = Strategy("ddp", dp=4, pp=2, micro_batch=2, grad_accum=2)
    assert base.not_runnable() == []
    s = base.replace(**changes)
    work = Workload(1024, s.dp * s.micro_batch * s.grad_accum)
    candidate = evaluate(model, s, work, cluster)
    assert reason in candidate.not_runnable and candidate.time.breakdown["pp_bubble"] > 0
    with pytest.raises(UserError, match="slipstream cannot run yet"):
        strategy_overrides(s, 1024)


def test_a_pipeline_needs_a_block_per_stage():
    small = PlanModel("gpt2-3", dataclasses.replace(resolve_model("gpt2").cfg, n_layer=3))
    s = Strategy("ddp", dp=4, pp=2, pp_schedule="interleaved-1f1b", micro_batch=2, grad_accum=2)
    assert s.not_runnable() == []
    # stages are whole blocks (plan/stages.rank_parts sizes them): 4 stages of 3 blocks cannot be planned
    with pytest.raises(UserError, match="2 x 2 chunks = 4 stages for 3 blocks"):
        evaluate(small, s, Workload(1024, 16), make_cluster("8xH100"))
    assert evaluate(small, s.replace(pp_schedule="1f1b", pp_virtual=1), Workload(1024, 16),
                    make_cluster("8xH100")).not_runnable == []


def _trainer_accepts(cfg, world: int) -> None:
    """The trainer's checks of a pipeline config that need no process group (load_config has run
    the config's own pipeline rules, config.dims.check_pipeline_config)."""
    from slipstream.config.dims import check_compatibility, resolve_parallel_dims
    from slipstream.distributed.pipeline_stages import check_schedule, split_layers

    dims = resolve_parallel_dims(cfg.parallel, world, world)
    check_compatibility(cfg, dims)
    assert dims.pp == cfg.parallel.pp > 1
    virtual = cfg.parallel.pp_virtual_stages
    check_schedule(cfg.parallel.pp_schedule, virtual)
    assert len(split_layers(cfg.model.n_layer, dims.pp * virtual)) == dims.pp * virtual
    sequences = cfg.train.micro_batch_size * cfg.train.grad_accum_steps
    assert sequences % cfg.parallel.pp_microbatches == 0


def test_the_best_runnable_pipeline_is_a_config_the_trainer_accepts(tmp_path):
    """--write-config of a pipeline plan: load_config (the config's own pipeline rules), the
    degrees, the data-parallel combination and the schedule all pass."""
    from slipstream.plan.render import write_best_config

    cfg = load_config(None, PP_MODEL)
    model, cluster = PlanModel("tiny-8", cfg.model), make_cluster("8xH100")
    result = plan(model, cluster, Workload(256, 32), pp=(2, 4), ac=("none",))
    best = result.best(runnable_only=True)
    assert best is not None and best.strategy.pp > 1
    path = tmp_path / "pp.toml"
    write_best_config(result, str(path))
    written = load_config(str(path), [])
    assert (written.parallel.pp, written.parallel.pp_schedule) == (best.strategy.pp, best.strategy.pp_schedule)
    _trainer_accepts(written, cluster.world)


def test_every_proposed_pipeline_is_a_config_the_trainer_accepts():
    """Every runnable pipeline layout of every schedule passes the trainer's config checks."""
    cfg = load_config(None, PP_MODEL)
    model, cluster = PlanModel("tiny-8", cfg.model), make_cluster("8xH100")
    result = plan(model, cluster, Workload(256, 32), pp=(2, 4), ac=("none",), micro_batches=(1, 2, 4),
                  pp_schedules=tuple(SCHEDULE_VIRTUAL))
    runnable = [c.strategy for c in result.ranked if not c.not_runnable]
    assert {s.pp_schedule for s in runnable} == set(SCHEDULE_VIRTUAL)
    for s in runnable:
        written = load_config(None, [*PP_MODEL, *_args(strategy_overrides(s, 256))])
        _trainer_accepts(written, s.world)


def test_a_runs_pinned_pipeline_split_is_the_layout_its_preflight_plans():
    """parallel.pp_layers reaches the planner's Strategy (the run's own pre-flight plans the
    split it will build), and the balanced default stays ()."""
    from slipstream.config import load_config
    from slipstream.plan.space import strategy_from_config

    pinned = load_config("configs/quickstart.toml", ["--parallel.pp=2", "--parallel.pp_layers=2,4", "--model.n_layer=6"])
    assert strategy_from_config(pinned, 2).pp_layers == (2, 4)
    balanced = load_config("configs/quickstart.toml", ["--parallel.pp=2", "--model.n_layer=6"])
    assert strategy_from_config(balanced, 2).pp_layers == ()
