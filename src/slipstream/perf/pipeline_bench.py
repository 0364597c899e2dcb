"""`slipstream bench pipeline`: every pipeline schedule at world 2 and 4 on CPU, measured.

Each rung is one real training run of the LM job under torchrun (`run_strategy`, as `bench
sharding`): the same model and the same batch per pipeline (pp_microbatches micro-batches of one
sequence each), pp = world (and, for 1f1b at world 4, pp 2 x fsdp 2). Step 1 warms up, step 2 is
the one whose memory is measured (`metrics.memory_breakdown`, MemTracker), steps 3.. are timed.
Per rung it records:

- step time: the mean `step_time_s` of the timed steps (and their tokens/s);
- the bubble: the trainer's measured `pp_bubble` (the ranks' mean of 1 - busy / wall time of the
  schedule; on CPU a stage's host time is its compute time), averaged over the timed steps, next
  to the planner's `pp_bubble_planned` (plan/timing.pipeline_bubble, the one formula);
- memory per rank (its stages: `pp_stages`, stage index -> blocks): the step's peak and the
  activations at that peak. A stage holds the activations of every micro-batch whose forward has
  run and whose backward has not: GPipe all m of them on the first stage, 1F1B at most pp; the
  zero-bubble schedules keep what the deferred weight gradients need.

A rung whose memory-tracked run fails is run again untracked (`memory_breakdown=false`): its
step time and bubble are still measured, its memory is null and `memory_error` says why.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

# Blocks with real work per stage (8 x d256: every schedule at pp 4 has a block per stage, the
# V ones 2 stages per rank), 8 micro-batches of one 128-token sequence (dualpipev at pp 4 needs
# 8 = its stage count). About 10 s per world-2 rung and 15 s per world-4 rung on 2 cores.
MODEL = ["--model.preset=gpt2", "--model.n_layer=8", "--model.d_model=256", "--model.n_head=4",
         "--model.vocab_size=2048", "--train.seq_len=128", "--train.micro_batch_size=8",
         "--parallel.pp_microbatches=8"]
# `--size ci`: a seconds-long smoke run for the tests (a run's time is then the torchrun start-up).
CI_MODEL = ["--model.preset=gpt2", "--model.n_layer=4", "--model.d_model=64", "--model.n_head=2",
            "--model.vocab_size=512", "--train.seq_len=32", "--train.micro_batch_size=4",
            "--parallel.pp_microbatches=4"]
# size -> (model, default schedules (None: all), default worlds, default steps)
SIZES: dict[str, tuple[list[str], tuple[str, ...] | None, tuple[int, ...], int]] = {
    "default": (MODEL, None, (2, 4), 8),
    "ci": (CI_MODEL, ("gpipe", "1f1b"), (2,), 3),
}
WORLDS = (2, 4)
TIMED_FROM = 3  # step 1 warms up, step 2 is the memory-tracked one


def _rungs(schedules: tuple[str, ...], worlds: tuple[int, ...]) -> list[dict[str, Any]]:
    """(schedule, world, pp, dp, dp_strategy) per rung: pp = world, and 1f1b also as pp 2 x fsdp 2."""
    rungs = []
    for world in worlds:
        for schedule in schedules:
            rungs.append({"schedule": schedule, "world": world, "pp": world, "dp": 1, "dp_strategy": "none"})
            if schedule == "1f1b" and world == 4:
                rungs.append({"schedule": schedule, "world": world, "pp": 2, "dp": 2, "dp_strategy": "fsdp"})
    for r in rungs:
        r["rung"] = f"{r['schedule']} pp{r['pp']}" + (f" x {r['dp_strategy']}{r['dp']}" if r["dp"] > 1 else "")
    return rungs


def run_pipeline_bench(schedules: tuple[str, ...] = (), nproc: tuple[int, ...] = (), steps: int = 0,
                       size: str = "default", out: str = "", data_dir: str = "") -> dict[str, Any]:
    """Run every (schedule, world) rung; write the JSON (default benchmarks/pipeline-cpu.json)."""
    from slipstream.config.dims import pp_microbatches, virtual_stages
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env
    from slipstream.perf.sharding import write_result
    from slipstream.plan.space import SCHEDULE_VIRTUAL

    if size not in SIZES:
        raise UserError(f"unknown --size '{size}'; choose one of {', '.join(SIZES)}")
    if size != "default" and not out:
        raise UserError(f"--size {size} needs --out: benchmarks/pipeline-cpu.json holds the default size's result")
    model, size_schedules, size_worlds, size_steps = SIZES[size]
    schedules = tuple(schedules or size_schedules or SCHEDULE_VIRTUAL)
    worlds = tuple(nproc or size_worlds)
    steps = steps or size_steps
    unknown = [s for s in schedules if s not in SCHEDULE_VIRTUAL]
    if unknown:
        raise UserError(f"unknown schedule {', '.join(unknown)}; choose from {', '.join(SCHEDULE_VIRTUAL)}")
    if bad := [n for n in worlds if n not in WORLDS]:
        raise UserError(f"--nproc {' '.join(map(str, bad))}: choose from {' '.join(map(str, WORLDS))}")
    if steps < TIMED_FROM:
        raise UserError(f"--steps must be >= {TIMED_FROM} (step 2 is the memory-tracked one, steps 3.. are timed)")
    base = model + ([f"--data.dir={data_dir}"] if data_dir else [])
    data_dir = str(ensure_data(load_config(None, base))[0])  # prepare once, before the runs
    base = [*model, f"--data.dir={data_dir}", "--train.device=cpu", "--train.eval_tokens=0"]
    rows, load_before = [], os.getloadavg()  # other work on the cores shows in the step times
    with tempfile.TemporaryDirectory(prefix="slipstream-pipeline-") as tmp:
        for rung in _rungs(schedules, worlds):
            overrides = [*base, f"--parallel.pp={rung['pp']}", f"--parallel.pp_schedule={rung['schedule']}"]
            cfg = load_config(None, [*overrides, f"--parallel.dp_strategy={rung['dp_strategy']}"])
            rung.update(virtual_stages=virtual_stages(cfg.parallel), microbatches=pp_microbatches(cfg))
            rows.append(_run_rung(rung, overrides, str(Path(tmp) / rung["rung"].replace(" ", "_")), steps))
    result = {"bench": "pipeline", "size": size, "steps": steps, "timed_steps": f"{TIMED_FROM}-{steps}",
              "overrides": base,
              "measured": "step time and the trainer's pp_bubble (ranks' mean of 1 - busy / wall time of the "
                          f"schedule): the mean over steps {TIMED_FROM}-{steps}; pp_bubble_planned: "
                          "plan/timing.pipeline_bubble; memory: training step 2 on every rank (MemTracker on CPU), "
                          "the step's peak and its categories at the peak",
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "rungs": rows, "env": collect_env()}
    return write_result(result, Path(out or "benchmarks/pipeline-cpu.json"), _print_table)


def _run_rung(rung: dict[str, Any], overrides: list[str], run_dir: str, steps: int) -> dict[str, Any]:
    """One rung's run (again without the memory breakdown if the tracked run fails): its row."""
    from slipstream.perf.sharding import run_strategy

    memory_error = None
    try:
        summary = run_strategy(rung["dp_strategy"], rung["world"], overrides, run_dir, steps=steps)
    except UserError as e:
        memory_error = str(e).splitlines()[0]
        print(f"{rung['rung']}: the memory-tracked run failed ({memory_error}); running it untracked")
        try:
            summary = run_strategy(rung["dp_strategy"], rung["world"], overrides, run_dir + "-untracked",
                                   steps=steps, memory_breakdown=False)
        except UserError as again:
            raise UserError(f"bench pipeline, rung {rung['rung']}: {again}") from None
        run_dir += "-untracked"
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "step_time_s" in r and r["step"] >= TIMED_FROM]
    bubbles = [r["pp_bubble"] for r in timed if r.get("pp_bubble") is not None]
    ranks = [{"rank": r["rank"], "stages": r.get("pp_stages"), "step_peak_bytes": r["step_peak_bytes"],
              "activations_bytes": (r["step_peak_categories"] or {}).get("activations"),
              "step_peak_categories": r["step_peak_categories"]} for r in summary["ranks"]]
    row = {**rung, "timed_steps": len(timed),
           "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
           "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
           "bubble_measured": sum(bubbles) / len(bubbles) if bubbles else None,
           "bubble_measured_by_step": bubbles, "bubble_planned": timed[-1].get("pp_bubble_planned"),
           "ranks": ranks, "final_loss": summary.get("final_loss"), "memory_error": memory_error}
    peak = max((r["step_peak_bytes"] or 0) for r in ranks) / 2**20
    print(f"{row['rung']}: {row['step_time_s'] * 1e3:.0f} ms/step, bubble {row['bubble_measured'] or 0:.3f} "
          f"(planned {row['bubble_planned']:.3f}), step peak {peak:.1f} MiB (max over ranks)")
    return row


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    table = Table(title=f"pipeline schedules on CPU: steps {result['timed_steps']} timed, memory of step 2; per rank "
                        "(its stages): step peak / activations at the peak, MiB")
    for col in ("rung", "ranks", "ms/step", "tokens/s", "bubble", "planned", "stages", "peak / activations"):
        table.add_column(col, justify="left" if col in ("rung", "stages", "peak / activations") else "right")
    for r in result["rungs"]:
        stages = "  ".join(",".join(k["stages"] or {}) for k in r["ranks"])
        memory = "  ".join(f"{(k['step_peak_bytes'] or 0) / mib:.1f}/{(k['activations_bytes'] or 0) / mib:.1f}"
                           for k in r["ranks"]) if not r["memory_error"] else "not measured"
        bubble = f"{r['bubble_measured']:.3f}" if r["bubble_measured"] is not None else "n/a"
        table.add_row(r["rung"], str(r["world"]), f"{r['step_time_s'] * 1e3:.0f}", f"{r['tokens_per_s']:.0f}",
                      bubble, f"{r['bubble_planned']:.3f}", stages, memory)
    Console(width=max(Console().width, 150)).print(table)
