"""Planned vs published: the planner run on the layouts of published large-scale trainings.

For every entry of plan/published.py we rebuild the model from its shape, the layout from
its parallel sizes, and the cluster from its GPU count, then compare what the planner
predicts (throughput per GPU, MFU, memory per GPU) with what the source reports. One
constant, the compute efficiency (the fraction of the cluster's matmul rate a whole
training step sustains), is fitted to these runs: `fit_efficiency`. Everything else is
the model as documented in docs/planner.md.

Scored on the runs it was fitted on, that error is in-sample. `held_out_efficiencies`
refits the efficiency leave-one-run-out (without each run in turn), and `published_report`
scores every speed figure at the efficiency fitted without its own run as well: the
out-of-sample error, the one to quote for a run the planner has not seen.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

from slipstream.config.schema import ModelConfig
from slipstream.models.flops import flops_per_token
from slipstream.plan.hardware import make_cluster
from slipstream.plan.memory import GIB, estimate_memory, model_state_bytes
from slipstream.plan.published import PUBLISHED_RUNS, PublishedRun
from slipstream.plan.space import PlanModel, Strategy, Workload
from slipstream.plan.timing import DEFAULT_EFFICIENCY, estimate_time

_STRATEGY_NAMES = {"zero3": "fsdp", None: "ddp"}


@dataclass
class Comparison:
    name: str
    metric: str          # "tflops_per_gpu" | "mfu" | "tokens_per_s_per_gpu" | "memory_gib_per_gpu" | "model_state_gib_per_gpu"
    reported: float
    planned: float
    note: str = ""

    @property
    def error(self) -> float:
        return (self.planned - self.reported) / self.reported

    def to_record(self) -> dict:
        return {"run": self.name, "metric": self.metric, "reported": self.reported, "planned": round(self.planned, 4),
                "error": round(self.error, 4), "note": self.note}


def _model(run: PublishedRun) -> PlanModel:
    llama = run.mlp == "swiglu"
    cfg = ModelConfig(preset="llama-8b" if llama else "gpt2", n_layer=run.n_layer, d_model=run.d_model,
                      n_head=run.n_head, n_kv_head=run.n_kv_head or 0, d_ff=run.d_ff or 0,
                      vocab_size=run.vocab_size, max_seq_len=run.seq_len, mlp=run.mlp,
                      tie_embeddings=run.tie_embeddings, position="rope" if llama else "learned",
                      norm="rmsnorm" if llama else "layernorm", bias=not llama,
                      # a mixture of experts in every block, each expert as wide as d_ff
                      moe_experts=run.n_experts, moe_top_k=run.experts_top_k or 2)
    return PlanModel(run.name, cfg)


def _strategy(run: PublishedRun) -> Strategy:
    dp_strategy = _STRATEGY_NAMES.get(run.dp_strategy, run.dp_strategy) if run.dp > 1 else "none"
    micro = run.micro_batch or 1
    global_batch = run.global_batch or run.dp * micro * max(run.pp, 1) * 4
    accum = max(1, global_batch // (run.dp * micro))
    schedule = (run.pp_schedule or "1f1b").lower()
    schedule = "interleaved-1f1b" if "interleaved" in schedule else ("gpipe" if "gpipe" in schedule else "1f1b")
    virtual = (run.virtual_stages or 2) if schedule == "interleaved-1f1b" else 1
    return Strategy(dp_strategy=dp_strategy, dp=run.dp, tp=run.tp, pp=run.pp, cp=run.cp, ep=run.ep,
                    micro_batch=micro, grad_accum=accum, ac=run.activation_checkpointing or "none",
                    precision="bf16", pp_schedule=schedule, pp_virtual=virtual)


def compare_run(run: PublishedRun, efficiency: float) -> list[Comparison]:
    """The planner's numbers for one published run, next to the reported ones."""
    if not run.n_layer:  # model-state figures only (ZeRO): bytes per parameter by strategy
        s = Strategy(dp_strategy=_STRATEGY_NAMES.get(run.dp_strategy, run.dp_strategy), dp=run.dp)
        states = sum(model_state_bytes(run.n_params, s))
        return [Comparison(run.name, "model_state_gib_per_gpu", run.memory_gib_per_gpu, states / GIB,
                           "slipstream keeps fp32 parameters and gradients (4 + 4 bytes) where the paper keeps fp16 "
                           "ones and an fp32 master copy in the optimizer state (2 + 2 + 12 bytes): equal without "
                           "sharding and at ZeRO-3, different at ZeRO-1/2")]
    model, s = _model(run), _strategy(run)
    gpu = run.gpu.replace("-96GB", "")
    # Capacity does not enter the predicted numbers, so the 96 GB H100 plans as the 80 GB one.
    cluster = make_cluster(f"{run.gpus_per_node}x{gpu}", nodes=run.gpus // run.gpus_per_node)
    work = Workload(seq_len=run.seq_len, global_batch=s.dp * s.micro_batch * s.grad_accum)
    time = estimate_time(model, s, work, cluster, efficiency=efficiency)
    note = "fp8 run planned at the bf16 rate" if run.precision == "fp8" else ""
    out = []
    per_gpu = time.tokens_per_s / s.world
    model_tflops = per_gpu * flops_per_token(model.cfg, run.seq_len) / 1e12
    if run.tflops_per_gpu:
        # Megatron counts the recomputed forward too (hardware FLOPs): 4 passes instead of 3.
        counted = model_tflops * (4 / 3 if "recompute" in run.notes.lower() and s.ac == "full" else 1)
        out.append(Comparison(run.name, "tflops_per_gpu", run.tflops_per_gpu, counted, note))
    if run.mfu:
        out.append(Comparison(run.name, "mfu", run.mfu, time.mfu, note))
    if run.tokens_per_s_per_gpu:
        out.append(Comparison(run.name, "tokens_per_s_per_gpu", run.tokens_per_s_per_gpu, per_gpu, note))
    if run.memory_gib_per_gpu:
        memory = estimate_memory(model, s, run.seq_len)
        out.append(Comparison(run.name, "memory_gib_per_gpu", run.memory_gib_per_gpu, memory.total_bytes / GIB,
                              "planned peak incl. the fragmentation margin; " + note))
    return out


SPEED_METRICS = ("tflops_per_gpu", "mfu", "tokens_per_s_per_gpu")


def _speed(rows: list[Comparison]) -> list[Comparison]:
    return [r for r in rows if r.metric in SPEED_METRICS]


def fit_efficiency(runs=PUBLISHED_RUNS) -> float:
    """The compute efficiency that minimizes the median |log error| of the planned speeds
    (the median, so that one run on a very different stack does not pull every plan).

    Throughput is proportional to efficiency only where compute dominates, so we search a
    grid instead of solving: 0.30 .. 1.00 in steps of 0.01."""
    def loss(eff: float) -> float:
        rows = _speed([c for run in runs for c in compare_run(run, eff)])
        return statistics.median(abs(math.log(r.planned / r.reported)) for r in rows)
    return min((e / 100 for e in range(30, 101)), key=loss)


def held_out_efficiencies(runs=PUBLISHED_RUNS) -> dict[str, float]:
    """Leave-one-run-out: for each run with a speed figure, the efficiency fitted on the others.
    (Memory-only runs do not enter the speed fit, so they get no fold of their own.)"""
    return {run.name: fit_efficiency([r for r in runs if r is not run])
            for run in runs if _speed(compare_run(run, DEFAULT_EFFICIENCY))}


def published_report(efficiency: float, held_out: bool = True) -> list[dict]:
    """Every published figure next to the planner's at `efficiency` (in-sample when that is the
    efficiency fitted to these runs). With held_out, each speed figure also carries
    held_out_efficiency (fitted without its run), held_out_planned and held_out_error (the
    figure planned at that efficiency): the leave-one-run-out score (9 refits, a few seconds)."""
    rows = [c.to_record() for run in PUBLISHED_RUNS for c in compare_run(run, efficiency)]
    if not held_out:
        return rows
    folds = held_out_efficiencies()
    by_key = {(c.name, c.metric): (eff, c) for run in PUBLISHED_RUNS if run.name in folds
              for eff in (folds[run.name],) for c in _speed(compare_run(run, eff))}
    for row in rows:
        if (row["run"], row["metric"]) in by_key:
            eff, c = by_key[row["run"], row["metric"]]
            row.update(held_out_efficiency=eff, held_out_planned=round(c.planned, 4), held_out_error=round(c.error, 4))
    return rows


def efficiency_from_runs(run_dirs: list[str], cluster) -> tuple[float, list[dict]]:
    """The compute efficiency measured by finished `slipstream train` runs on this cluster's
    kind of device: for each run, the planner's prediction of its own config (at the default
    efficiency) against its measured tokens/s; the median ratio x the default."""
    import dataclasses
    import json
    from pathlib import Path

    from slipstream.config.load import config_from_toml_text
    from slipstream.errors import UserError
    from slipstream.plan.hardware import canonical_gpu_name
    from slipstream.plan.space import strategy_from_config
    from slipstream.plan.timing import DEFAULT_EFFICIENCY
    from slipstream.tune.system import read_trial

    rows = []
    for run_dir in map(Path, run_dirs):
        files = [run_dir / name for name in ("config.toml", "summary.json", "metrics.jsonl", "env.json")]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise UserError(f"--calibrate {run_dir}: not a finished run directory (no {', '.join(missing)}); "
                            "pass the run directory of a completed `slipstream train`")
        cfg = config_from_toml_text(files[0].read_text(encoding="utf-8"))
        summary = json.loads(files[1].read_text())
        env = json.loads(files[3].read_text())
        names = {canonical_gpu_name(d.get("name", "")) for d in env.get("devices", [])} or {"cpu"}
        if cluster.short_name not in names:
            raise UserError(f"--calibrate {run_dir}: that run used {', '.join(sorted(map(str, names)))}, the plan is "
                            f"for {cluster.short_name}; calibrate with runs on the same kind of device")
        world = int(summary.get("world_size", 1))
        per_node = min(world, cluster.gpus_per_node)
        here = dataclasses.replace(cluster, gpus_per_node=per_node, nodes=max(1, world // per_node))
        strategy = strategy_from_config(cfg, world)
        work = Workload(cfg.train.seq_len, cfg.train.micro_batch_size * cfg.train.grad_accum_steps * strategy.dp)
        predicted = estimate_time(PlanModel(cfg.model.preset, cfg.model), strategy, work, here).tokens_per_s
        measured = read_trial(run_dir)["tokens_per_s"]
        if not measured:
            raise UserError(f"--calibrate {run_dir}: the run logged no tokens/s")
        rows.append({"run": str(run_dir), "layout": strategy.label(), "predicted_tokens_per_s": predicted,
                     "measured_tokens_per_s": measured})
    efficiency = DEFAULT_EFFICIENCY * statistics.median(r["measured_tokens_per_s"] / r["predicted_tokens_per_s"]
                                                        for r in rows)
    return efficiency, rows
