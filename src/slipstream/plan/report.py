"""Planned vs published: the planner run on the layouts of published large-scale trainings.

For every entry of plan/published.py and plan/published_more.py (ALL_PUBLISHED_RUNS) the model,
layout and cluster are rebuilt (published_inputs.plan_model / plan_strategy / plan_gpu) and the planner's figures are compared
with the reported ones: TFLOP/s per GPU (as the source counted them, `flops_convention`: model
FLOPs, or hardware FLOPs with activation recompute), MFU, HFU, tokens/s per GPU, seconds per step,
and memory per GPU.

The time model's free constants (plan/efficiency.Fit: the GEMM fraction of peak per GPU
generation the runs cover, a scale on the attention kernels' fractions, a scale on the pointwise
fraction) are fitted to these runs: `fit_constants` minimizes the median over runs of each run's
mean |log error| (the median, so that one run on an unusual stack does not pull every plan; a
run's figures are one measurement and count once). Scored on the runs it was fitted on, that
error is in-sample. `published_report` also scores every speed figure with the constants fitted
WITHOUT its run (leave-one-run-out): the held-out error, the one to quote for a run the planner
has not seen.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
import statistics
from dataclasses import dataclass

from slipstream.plan.efficiency import PRIORS, Fit
from slipstream.plan.hardware import make_cluster
from slipstream.plan.memory import GIB, estimate_memory
from slipstream.plan.memory_states import StackStates, model_state_bytes
from slipstream.plan.published import PublishedRun
from slipstream.plan.published_inputs import plan_gpu, plan_model, plan_strategy
from slipstream.plan.published_more import ALL_PUBLISHED_RUNS
from slipstream.plan.space import Strategy, Workload
from slipstream.plan.timing import DEFAULT_EFFICIENCY, TimeEstimate, estimate_time

_STRATEGY_NAMES = {"zero3": "fsdp", None: "ddp"}
# The figures that measure speed (one measurement per run, however many the source gives).
SPEED_METRICS = ("tflops_per_gpu", "mfu", "hfu", "tokens_per_s_per_gpu", "step_time_s")
# The grid fit_constants searches: GEMM fractions of peak, and the scales on the prior attention
# and pointwise fractions (efficiency.PRIORS). GEMM by 0.01: at 0.02 a 1 % overall calibration was
# left on top of the fitted constants (fit_efficiency 1.01) once the stacks' overlap defaults moved
# the Megatron runs; the finer step absorbs it in the GEMM fraction, where it belongs.
GRID_GEMM = tuple(round(0.50 + 0.01 * i, 2) for i in range(41))
GRID_ATTENTION_SCALE = (0.5, 0.7, 0.85, 1.0, 1.2)
GRID_POINTWISE_SCALE = (0.4, 0.55, 0.7, 0.85, 1.0)
# A small pull towards the sourced priors, per unit of |log(fitted / prior)| summed over the
# constants: it decides between constants the (flat) median cannot tell apart.
PRIOR_PULL = 0.002

# plan_model / plan_strategy under the names this module used before they moved to published.py.
_model, _strategy = plan_model, plan_strategy


@dataclass
class Comparison:
    name: str
    metric: str          # SPEED_METRICS, "memory_gib_per_gpu" or "model_state_gib_per_gpu"
    reported: float
    planned: float
    note: str = ""

    @property
    def error(self) -> float:
        return (self.planned - self.reported) / self.reported

    def to_record(self) -> dict:
        return {"run": self.name, "metric": self.metric, "reported": self.reported, "planned": round(self.planned, 4),
                "error": round(self.error, 4), "note": self.note}


def _runs_with_speed(runs) -> list[PublishedRun]:
    return [r for r in runs if r.n_layer and any(getattr(r, m) for m in SPEED_METRICS)]


def _generation(run: PublishedRun) -> str:
    return make_cluster(f"1x{plan_gpu(run)}").gpu.generation


@functools.lru_cache(maxsize=None)
def _setup(run: PublishedRun):
    """The planner's inputs of a run: model, layout, workload and cluster (with the run's stack)."""
    model, s = plan_model(run), plan_strategy(run)
    cluster = dataclasses.replace(make_cluster(f"{run.gpus_per_node}x{plan_gpu(run)}",
                                               nodes=run.gpus // run.gpus_per_node), stack=run.stack,
                                  overlap_grad_reduce=run.overlap_grad_reduce)
    work = Workload(seq_len=run.seq_len, global_batch=s.dp * s.micro_batch * s.grad_accum)
    return model, s, work, cluster


def _speed_figures(run: PublishedRun, time: TimeEstimate, s: Strategy) -> list[Comparison]:
    """Each reported speed figure next to the planner's figure of the same kind."""
    note = "fp8 run planned at the bf16 rate" if run.precision == "fp8" else ""
    out = []
    if run.tflops_per_gpu:
        # "hardware": the source counts activation recompute's extra forward (Megatron's eq. 3,
        # BigScience's 4 x 2); "model" or unstated: one forward and backward.
        hardware = run.flops_convention == "hardware"
        planned = time.recompute_tflops_per_gpu if hardware else time.model_tflops_per_gpu
        convention = "hardware FLOPs with recompute" if hardware else (
            "model FLOPs" if run.flops_convention == "model" else "model FLOPs (the source does not say)")
        out.append(Comparison(run.name, "tflops_per_gpu", run.tflops_per_gpu, planned,
                              "; ".join(x for x in (convention, note) if x)))
    if run.mfu:
        out.append(Comparison(run.name, "mfu", run.mfu, time.mfu, note))
    if run.hfu:
        out.append(Comparison(run.name, "hfu", run.hfu, time.hfu, note))
    if run.tokens_per_s_per_gpu:
        out.append(Comparison(run.name, "tokens_per_s_per_gpu", run.tokens_per_s_per_gpu,
                              time.tokens_per_s / s.world, note))
    if run.step_time_s:
        out.append(Comparison(run.name, "step_time_s", run.step_time_s, time.step_s, note))
    return out


def compare_run(run: PublishedRun, efficiency: float = DEFAULT_EFFICIENCY, fit: Fit | None = None) -> list[Comparison]:
    """The planner's numbers for one published run, next to the reported ones."""
    if not run.n_layer:  # model-state figures only (ZeRO): bytes per parameter by strategy
        s = Strategy(dp_strategy=_STRATEGY_NAMES.get(run.dp_strategy, run.dp_strategy), dp=run.dp,
                     precision=run.precision)
        states = sum(model_state_bytes(run.n_params, s, states=StackStates(run.stack)))
        return [Comparison(run.name, "model_state_gib_per_gpu", run.memory_gib_per_gpu, states / GIB,
                           f"model states as the {run.stack} stack keeps them (plan/memory.py state_buffers)")]
    model, s, work, cluster = _setup(run)
    out = _speed_figures(run, estimate_time(model, s, work, cluster, efficiency=efficiency, fit=fit), s)
    if run.memory_gib_per_gpu:
        note = "fp8 run planned at the bf16 rate" if run.precision == "fp8" else ""
        memory = estimate_memory(model, s, run.seq_len, stack=StackStates.of_cluster(cluster))
        out.append(Comparison(run.name, "memory_gib_per_gpu", run.memory_gib_per_gpu, memory.total_bytes / GIB,
                              "planned peak incl. the fragmentation margin; " + note))
    return out


# The communication terms of a step's time (TimeEstimate.breakdown), in the order the table shows them.
COMM_TERMS = (("dp_comm", "dp reduction"), ("zero_all_gather", "ZeRO all-gather"), ("zero1_broadcast", "zero1 broadcast"),
              ("dp_replicate_comm", "hsdp replicas"), ("tp_comm", "tp"), ("cp_comm", "cp"), ("pp_p2p", "pp p2p"),
              ("ep_comm", "ep all-to-all"))


def communication_table(fit: Fit | None = None) -> str:
    """Markdown: each published speed run's stack, whether its gradient reduction overlaps
    backward, its planned step and the exposed seconds of each communication term (NCCL's
    model, plan/collectives.py) with the committed constants. docs/planner.md holds it between
    its collective-terms markers (a test renders it again)."""
    head = ["run", "stack", "overlap", "step s"] + [label for _, label in COMM_TERMS]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for run in _runs_with_speed(ALL_PUBLISHED_RUNS):
        model, s, work, cluster = _setup(run)
        t = estimate_time(model, s, work, cluster, fit=fit)
        terms = [f"{t.breakdown[key]:.3f}" if key in t.breakdown else "-" for key, _ in COMM_TERMS]
        cells = [f"`{run.name}`", run.stack, "on" if cluster.overlaps_grad_reduce else "off", f"{t.step_s:.3f}"]
        lines.append("| " + " | ".join(cells + terms) + " |")
    return "\n".join(lines)


def _speed(rows: list[Comparison]) -> list[Comparison]:
    return [r for r in rows if r.metric in SPEED_METRICS]


def run_error(rows: list[Comparison]) -> float:
    """One run's speed error: the mean |log(planned / reported)| over its speed figures."""
    return statistics.fmean(abs(math.log(r.planned / r.reported)) for r in _speed(rows))


# ---------------------------------------------------------------- the fit


@functools.lru_cache(maxsize=None)
def _error_table(run: PublishedRun) -> dict[tuple[float, float, float], float]:
    """run_error of one run at every (GEMM fraction of its generation, attention scale, pointwise
    scale) of the grid."""
    model, s, work, cluster = _setup(run)
    gen = cluster.gpu.generation
    table = {}
    for g, a, p in itertools.product(GRID_GEMM, GRID_ATTENTION_SCALE, GRID_POINTWISE_SCALE):
        fit = Fit(gemm={gen: g}, attention_scale=a, pointwise_scale=p)
        table[g, a, p] = run_error(_speed_figures(run, estimate_time(model, s, work, cluster, fit=fit), s))
    return table


def fit_constants(runs=ALL_PUBLISHED_RUNS) -> tuple[Fit, float]:
    """The Fit (GEMM fraction per generation the runs cover, attention and pointwise scales) that
    minimizes the median over `runs` of their speed errors (run_error), with PRIOR_PULL deciding
    near-ties; and that median. Exhaustive over the GRID_* values: each run's errors are computed
    once (_error_table), so a leave-one-out refit only takes medians."""
    import numpy as np

    speed = _runs_with_speed(runs)
    by_gen: dict[str, list[PublishedRun]] = {}
    for run in speed:
        by_gen.setdefault(_generation(run), []).append(run)
    gens = sorted(by_gen)
    grid = np.array(GRID_GEMM)
    # pull of each generation's GEMM fractions towards its prior, over the product grid
    pulls = sum(np.abs(np.log(grid / PRIORS[gen].gemm)).reshape([-1 if i == k else 1 for i in range(len(gens))])
                for k, gen in enumerate(gens))
    best = None
    for a, p in itertools.product(GRID_ATTENTION_SCALE, GRID_POINTWISE_SCALE):
        # errors[..., run]: every run's error at every combination of the generations' GEMM fractions
        parts = []
        for k, gen in enumerate(gens):
            e = np.array([[_error_table(run)[g, a, p] for run in by_gen[gen]] for g in GRID_GEMM])  # (G, runs)
            shape = [1] * len(gens) + [e.shape[1]]
            shape[k] = len(GRID_GEMM)
            parts.append(np.broadcast_to(e.reshape(shape), [len(GRID_GEMM)] * len(gens) + [e.shape[1]]))
        medians = np.median(np.concatenate(parts, axis=-1), axis=-1)
        loss = medians + PRIOR_PULL * (pulls + abs(math.log(a)) + abs(math.log(p)))
        i = np.unravel_index(int(np.argmin(loss)), loss.shape)
        if best is None or loss[i] < best[0]:
            best = (float(loss[i]), float(medians[i]),
                    Fit(gemm={gen: GRID_GEMM[j] for gen, j in zip(gens, i)}, attention_scale=a, pointwise_scale=p))
    return best[2], best[1]


def held_out_fits(runs=ALL_PUBLISHED_RUNS) -> dict[str, Fit]:
    """Leave-one-run-out: for each run with a speed figure, the constants fitted on the others."""
    speed = _runs_with_speed(runs)
    return {run.name: fit_constants([r for r in speed if r is not run])[0] for run in speed}


def fit_efficiency(runs=ALL_PUBLISHED_RUNS, fit: Fit | None = None) -> float:
    """The overall calibration factor (estimate_time's `efficiency`) that fits the runs best on top
    of the per-class constants (median run_error; 0.50 .. 1.50 in steps of 0.01): 1.00 when the
    constants of plan/efficiency.py are the fitted ones."""
    speed = _runs_with_speed(runs)

    def loss(eff: float) -> float:
        return statistics.median(run_error(compare_run(run, eff, fit)) for run in speed)
    return min((e / 100 for e in range(50, 151)), key=lambda e: (loss(e), abs(e - 1.0)))


def fit_record(fit: Fit) -> dict:
    return {"gemm": dict(fit.gemm), "attention_scale": fit.attention_scale, "pointwise_scale": fit.pointwise_scale}


def published_report(efficiency: float = DEFAULT_EFFICIENCY, held_out: bool = True,
                     fit: Fit | None = None) -> list[dict]:
    """Every published figure next to the planner's at `efficiency` with `fit` (default: the
    committed constants, efficiency.FITTED, fitted to these runs: in-sample). With held_out, each
    speed figure also carries held_out_fit (the constants fitted without its run), held_out_planned
    and held_out_error: the leave-one-run-out score."""
    rows = [c.to_record() for run in ALL_PUBLISHED_RUNS for c in compare_run(run, efficiency, fit)]
    if not held_out:
        return rows
    folds = held_out_fits()
    by_key = {(c.name, c.metric): (fold, c) for run in _runs_with_speed(ALL_PUBLISHED_RUNS)
              for fold in (folds[run.name],) for c in _speed(compare_run(run, efficiency, fold))}
    for row in rows:
        if (row["run"], row["metric"]) in by_key:
            fold, c = by_key[row["run"], row["metric"]]
            row.update(held_out_fit=fit_record(fold), held_out_planned=round(c.planned, 4),
                       held_out_error=round(c.error, 4))
    return rows


def held_out_summary(rows: list[dict]) -> dict:
    """The headline of a published_report: per run its held-out error (the median |error| of its
    speed figures), and the median over runs and over figures, in- and out-of-sample."""
    speed = [r for r in rows if r["metric"] in SPEED_METRICS]
    runs: dict[str, list[dict]] = {}
    for r in speed:
        runs.setdefault(r["run"], []).append(r)
    per_run = {name: {"in_sample": statistics.median(abs(r["error"]) for r in rs),
                      "held_out": statistics.median(abs(r["held_out_error"]) for r in rs)}
               for name, rs in runs.items()}
    return {"runs": len(per_run), "figures": len(speed),
            "held_out_median_run_error": round(statistics.median(v["held_out"] for v in per_run.values()), 4),
            "in_sample_median_run_error": round(statistics.median(v["in_sample"] for v in per_run.values()), 4),
            "held_out_median_figure_error": round(statistics.median(abs(r["held_out_error"]) for r in speed), 4),
            "per_run": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in per_run.items()}}


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
    from slipstream.plan.space import PlanModel, strategy_from_config
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
