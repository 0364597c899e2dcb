"""The planner's step time for a finished run, computed when the report is made.

A run records the planner's memory (summary.json "memory" -> "planned_peak_bytes") but not its
step time, so the report asks the planner now: the run's config.toml, laid out as the run ran
it (plan.space.strategy_from_config at the run's world size), on the cluster model of the run's
device: the GPU named in env.json, or for a CPU run this machine's measured CPU (the planner's
`Nxcpu` cluster; observe.peaks caches the measurement). The page labels the number as computed
at report time, and says so when this machine is not the CPU the run used. The efficiency is the
planner's default, as `slipstream plan` predicts without --calibrate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from slipstream.errors import UserError
from slipstream.report.runs import RunData, short_text


@dataclass
class PlannedStep:
    step_s: float
    tokens_per_s: float
    layout: str  # the planner's label of the run's layout, e.g. "ddp mb4x1"
    cluster: str  # what it was predicted on, in words


def planned_step(run: RunData) -> tuple[PlannedStep | None, str]:
    """(the prediction, "") or (None, why there is none, in one sentence)."""
    if not run.config_text:
        return None, "no config.toml to predict from"
    from slipstream.config.load import config_from_toml_text
    from slipstream.plan.space import PlanModel, Workload, strategy_from_config
    from slipstream.plan.timing import estimate_time

    try:
        cfg = config_from_toml_text(run.config_text)
        cluster, where = _cluster(run)
        strategy = strategy_from_config(cfg, run.world_size)
        work = Workload(cfg.train.seq_len, cfg.train.micro_batch_size * cfg.train.grad_accum_steps * strategy.dp)
        predicted = estimate_time(PlanModel(cfg.model.preset or run.name, cfg.model), strategy, work, cluster)
    except UserError as e:
        return None, f"the planner cannot predict this run ({short_text(e)})"
    except Exception as e:  # noqa: BLE001 - a config the planner does not model must not stop the whole report
        return None, f"the planner failed on this config ({type(e).__name__}: {short_text(e)})"
    if not (math.isfinite(predicted.step_s) and predicted.step_s > 0):
        return None, "the planner gave no step time for this config"
    return PlannedStep(predicted.step_s, predicted.tokens_per_s, strategy.label(), where), ""


def _cluster(run: RunData):
    """The planner's cluster for the run's device, and a phrase saying what it is."""
    from slipstream.plan.hardware import canonical_gpu_name, make_cluster

    world = run.world_size
    device = str(run.summary.get("device") or run.config.get("train", {}).get("device", "cpu"))
    devices = run.env.get("devices") if isinstance(run.env.get("devices"), list) else []
    names = [d.get("name") for d in devices if isinstance(d, dict) and isinstance(d.get("name"), str)]
    if not device.startswith("cpu") and names:
        short = canonical_gpu_name(names[0])
        if short is None:
            raise UserError(f"the planner has no datasheet for the GPU {short_text(names[0], 60)!r}")
        per_node = max(1, min(world, len(names)))
        nodes = -(-world // per_node)
        return make_cluster(f"{per_node}x{short}", nodes=nodes), f"{world} x {short} (the run's GPU, datasheet)"
    from slipstream.observe.env import cpu_model
    from slipstream.observe.peaks import this_cpu

    here, there = cpu_model(), run.env.get("cpu_model")
    where = f"{world} CPU process(es) of this machine ({short_text(here, 60)}, measured matmul rate)"
    if isinstance(there, str) and there != here:
        where += f"; the run used {short_text(there, 60)}"
    return make_cluster(f"{world}xcpu", cpu=this_cpu()), where
