"""`slipstream bench recompute`: what activation checkpointing costs, measured against the planner.

Small slipstream transformers (presets tiny, llama-tiny and gpt-mini, each at two sequence lengths)
train on this device with activations.checkpointing none, selective and full, applied as the
trainer applies them (optimize/activations.apply_activation_checkpointing on build_model's model).
A step is forward, loss, backward, AdamW step and zero_grad. Every (model, AC mode) is timed
round by round, interleaved, so a machine shared with other work slows them alike; a row's time is
the median of all its timed steps.

On a CPU the bench runs one torch thread and times each step by its thread CPU time (every op,
autograd's backward too, runs on the calling thread), which other processes on the machine do not
move. The planner predicts the same steps (plan/timing.estimate_time on `1x<this device>`: on a CPU the
measured matmul rate of observe.peaks.this_cpu()). Its CPU constants (plan/efficiency.CPU_FITTED:
the pointwise fraction of the memory bandwidth, the attention kernel's fraction of the matmul rate,
the cost per eager op) are fitted to the steps WITHOUT activation checkpointing only (`fit_cpu`),
so the ratios full / none and selective / none it predicts are predictions, compared with the
measured ones. The JSON (benchmarks/planner-recompute-cpu.json) records the machine, versions, git
sha, the rates the planner used, every row and the fit; `predict(result)` recomputes its
predictions from it (tests/unit/test_plan_timing_costs.py checks they are today's).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import statistics
import time
from typing import Any

import torch

from slipstream.errors import UserError

# (preset, sequence length, micro-batch): two lengths per model family, so that attention's share moves.
CASES = (("tiny", 128, 8), ("tiny", 512, 2), ("llama-tiny", 128, 8), ("llama-tiny", 512, 2),
         ("gpt-mini", 128, 8), ("gpt-mini", 512, 2))
AC_MODES = ("none", "selective", "full")
VOCAB = 512
# The grid fit_cpu searches (the cpu generation's constants): pointwise fraction of the memory
# bandwidth the planner assumes for a CPU (hardware.CPU_MEMORY_BW_GBS unless a probe gives it),
# attention kernel fraction of the measured matmul rate, host seconds per eager op.
GRID_POINTWISE = tuple(round(0.05 * 1.3**i, 4) for i in range(17))
GRID_ATTENTION = tuple(round(0.02 * 1.4**i, 4) for i in range(12))
GRID_LAUNCH_S = tuple(round(1e-6 * 1.3**i, 9) for i in range(16))
# host seconds per forward op that selective checkpointing's dispatch mode adds
GRID_DISPATCH_S = (0.0, *(round(4e-6 * 1.2**i, 9) for i in range(22)))


def _model_config(preset: str, seq_len: int):
    from slipstream.config.presets import PRESETS
    from slipstream.config.schema import ModelConfig

    values = {**PRESETS[preset], "preset": preset, "vocab_size": VOCAB}
    values["max_seq_len"] = max(values["max_seq_len"], seq_len)
    return ModelConfig(**values)


def _label(preset: str, seq_len: int, micro_batch: int) -> str:
    return f"{preset} seq{seq_len} mb{micro_batch}"


def measure(device: str = "cpu", rounds: int = 4, steps: int = 2, cases=CASES) -> list[dict[str, Any]]:
    """Median step seconds of every (case, AC mode), interleaved over `rounds` rounds of `steps` steps
    (fp32 on a CPU; bf16 autocast on a GPU)."""
    from slipstream.models.transformer import build_model, lm_loss
    from slipstream.optimize.activations import apply_activation_checkpointing

    dev = torch.device(device)
    runs = {}
    for (preset, seq_len, mb), ac in itertools.product(cases, AC_MODES):
        cfg = _model_config(preset, seq_len)
        torch.manual_seed(0)
        model = apply_activation_checkpointing(build_model(cfg, device=dev), ac)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        inputs = torch.randint(0, VOCAB, (mb, seq_len), device=dev)
        targets = torch.randint(0, VOCAB, (mb, seq_len), device=dev)
        runs[(preset, seq_len, mb, ac)] = (model, optimizer, inputs, targets)

    def sync() -> None:
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def step(key) -> float:
        model, optimizer, inputs, targets = runs[key]
        sync()
        start, cpu_start = time.perf_counter(), time.thread_time()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=dev.type == "cuda"):
            loss = lm_loss(model(inputs), targets)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        # On a CPU with one torch thread every op (autograd's backward too) runs on this thread:
        # its CPU time is the step's cost, whatever else shares the machine (wall time is not).
        return time.thread_time() - cpu_start if dev.type == "cpu" else time.perf_counter() - start

    for key in runs:  # warm-up: first-call allocations, AdamW's state, thread pools
        step(key)
        step(key)
    samples: dict[tuple, list[float]] = {key: [] for key in runs}
    for r in range(rounds):
        for key in runs:
            samples[key] += [step(key) for _ in range(steps)]
        print(f"round {r + 1}/{rounds}: " + ", ".join(
            f"{k[0]}/{k[1]}/{k[3]} {statistics.median(v) * 1e3:.1f} ms" for k, v in samples.items() if k[3] == "none"))
    return [{"case": _label(p, t, mb), "preset": p, "seq_len": t, "micro_batch": mb, "ac": ac,
             "measured_step_s": statistics.median(v), "samples": len(v)}
            for (p, t, mb, ac), v in samples.items()]


def _cluster(machine: dict[str, Any]):
    """The cluster the predictions are made for: a GPU by name, or this CPU as recorded (its
    measured matmul rates and the memory bandwidth the planner assumed)."""
    from slipstream.plan.hardware import CpuFacts, make_cluster

    if machine["gpus"] != "1xcpu":
        return make_cluster(machine["gpus"])
    peaks = machine["peak_flops"]
    cluster = make_cluster("1xcpu", cpu=CpuFacts(machine["name"], lambda key: peaks[key]))
    return dataclasses.replace(cluster, gpu=dataclasses.replace(cluster.gpu, mem_bw_gbs=machine["mem_bw_gbs"]))


def _predicted_step(row: dict[str, Any], cluster, fit) -> float:
    from slipstream.plan.space import PlanModel, Strategy, Workload
    from slipstream.plan.timing import estimate_time

    cfg = _model_config(row["preset"], row["seq_len"])
    precision = "fp32" if cluster.gpu.generation == "cpu" else "bf16"
    s = Strategy(micro_batch=row["micro_batch"], ac=row["ac"], precision=precision)
    return estimate_time(PlanModel(row["preset"], cfg), s, Workload(row["seq_len"], row["micro_batch"]),
                         cluster, fit=fit).step_s


def _with_cpu(cpu):
    from slipstream.plan.efficiency import FITTED

    return dataclasses.replace(FITTED, cpu=cpu)


def _mean_squared_log_error(rows: list[dict[str, Any]], cluster, cpu) -> float:
    fit = _with_cpu(cpu)
    return statistics.fmean(math.log(_predicted_step(r, cluster, fit) / r["measured_step_s"]) ** 2 for r in rows)


def fit_cpu(rows: list[dict[str, Any]], cluster) -> dict[str, Any]:
    """The cpu generation's rates, fitted (least mean squared log error over the GRID_* values) in
    two steps: the pointwise fraction, the attention fraction and the cost per op to the steps
    WITHOUT activation checkpointing, so that the full / none ratios are predictions; then the host
    cost of selective checkpointing's dispatch mode per op to the selective steps, and, leaving one
    case out at a time, refitted without it: the held-out selective ratio of each case."""
    from slipstream.plan.efficiency import PRIORS

    none = [r for r in rows if r["ac"] == "none"]
    prior = PRIORS["cpu"]

    def rates(pointwise: float, attention: float, launch_s: float, dispatch_s: float = 0.0):
        return dataclasses.replace(prior, pointwise=pointwise, flash=attention, efficient=attention,
                                   launch_s=launch_s, selective_dispatch_s=dispatch_s)

    best = min(itertools.product(GRID_POINTWISE, GRID_ATTENTION, GRID_LAUNCH_S),
               key=lambda point: _mean_squared_log_error(none, cluster, rates(*point)))

    def dispatch(selective: list[dict[str, Any]]) -> float:
        return min(GRID_DISPATCH_S, key=lambda s: _mean_squared_log_error(selective, cluster, rates(*best, s)))

    selective = [r for r in rows if r["ac"] == "selective"]
    fitted = rates(*best, dispatch(selective))
    held_out = {}
    for row in selective:
        cpu = rates(*best, dispatch([r for r in selective if r is not row]))
        base = next(r for r in none if r["case"] == row["case"])
        held_out[row["case"]] = {"selective_dispatch_s": cpu.selective_dispatch_s, "selective_predicted_ratio": round(
            _predicted_step(row, cluster, _with_cpu(cpu)) / _predicted_step(base, cluster, _with_cpu(cpu)), 4)}
    return {"pointwise": fitted.pointwise, "attention": fitted.flash, "launch_s": fitted.launch_s,
            "selective_dispatch_s": fitted.selective_dispatch_s,
            "none_mean_squared_log_error": round(_mean_squared_log_error(none, cluster, fitted), 6),
            "held_out_selective": held_out}


def predict(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Per case, the measured and predicted ratios of the AC modes' step times to none's, with the
    planner's constants of today (plan/efficiency.py) on the recorded machine."""
    cluster = _cluster(result["machine"])
    by_case: dict[str, dict[str, dict]] = {}
    for row in result["rows"]:
        by_case.setdefault(row["case"], {})[row["ac"]] = row
    out = []
    for case, modes in by_case.items():
        predicted = {ac: _predicted_step(row, cluster, None) for ac, row in modes.items()}
        entry = {"case": case, "none_measured_s": modes["none"]["measured_step_s"],
                 "none_predicted_s": round(predicted["none"], 6)}
        for ac in ("selective", "full"):
            entry[f"{ac}_measured_ratio"] = round(modes[ac]["measured_step_s"] / modes["none"]["measured_step_s"], 4)
            entry[f"{ac}_predicted_ratio"] = round(predicted[ac] / predicted["none"], 4)
        out.append(entry)
    return out


def summarize(ratios: list[dict[str, Any]]) -> dict[str, float]:
    """Median |error| of the predicted ratios (predicted / measured - 1), per AC mode."""
    return {f"{ac}_median_abs_error": round(statistics.median(
        abs(r[f"{ac}_predicted_ratio"] / r[f"{ac}_measured_ratio"] - 1) for r in ratios), 4)
        for ac in ("selective", "full")}


def run_recompute_bench(device: str = "cpu", rounds: int = 4, steps: int = 2, out: str = "",
                        repredict: str = "") -> dict[str, Any]:
    """Measure (or, with `repredict`, read a result file's measurements), fit the cpu constants to
    the steps without AC (on a CPU), and write the measured vs predicted ratios."""
    import json

    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.plan.efficiency import CPU_FITTED
    from slipstream.plan.hardware import CPU_MEMORY_BW_GBS

    if rounds < 1 or steps < 1:
        raise UserError(f"--rounds and --steps must be >= 1 (got {rounds} and {steps})")
    if repredict:
        try:
            with open(repredict, encoding="utf-8") as f:
                old = json.load(f)
            rows, machine, env, device = old["rows"], old["machine"], old["env"], old["device"]
        except (OSError, ValueError, KeyError) as e:
            raise UserError(f"--repredict {repredict}: not a `bench recompute` result ({e}); run the bench "
                            "without --repredict to measure") from None
    else:
        dev = torch.device(device)
        if dev.type == "cuda":
            from slipstream.tune.system import gpu_short_name

            if not torch.cuda.is_available():
                raise UserError(f"--device {device}: no CUDA GPU here; use --device cpu")
            short = gpu_short_name(torch.cuda.get_device_name(dev))
            if short is None:
                raise UserError(f"{torch.cuda.get_device_name(dev)} is not in the planner's GPU table: the "
                                "measured ratios cannot be compared with a plan; use --device cpu")
            machine = {"gpus": f"1x{short}", "name": torch.cuda.get_device_name(dev)}
        elif dev.type == "cpu":
            from slipstream.observe.peaks import this_cpu

            facts = this_cpu()
            machine = {"gpus": "1xcpu", "name": facts.name, "mem_bw_gbs": CPU_MEMORY_BW_GBS, "threads": 1}
        else:
            raise UserError(f"--device {device}: use cpu or cuda")
        threads = torch.get_num_threads()
        t0 = time.perf_counter()
        try:
            if dev.type == "cpu":
                # One torch thread: the step's thread CPU time is then its cost (measure), unmoved by
                # the other work of a shared machine, and the matmul rate is the one-thread rate.
                torch.set_num_threads(1)
                machine["peak_flops"] = {k: facts.peak_flops(k) for k in ("fp32", "bf16", "fp16")}
            rows = measure(device, rounds, steps)
        finally:
            torch.set_num_threads(threads)
        machine["measure_seconds"] = round(time.perf_counter() - t0, 1)
        env = collect_env()
    result: dict[str, Any] = {"benchmark": "planner-recompute", "device": device, "machine": machine, "rows": rows}
    if machine["gpus"] == "1xcpu":
        fit = fit_cpu(rows, _cluster(machine))
        fit["in_use"] = {"pointwise": CPU_FITTED.pointwise, "attention": CPU_FITTED.flash,
                         "launch_s": CPU_FITTED.launch_s, "selective_dispatch_s": CPU_FITTED.selective_dispatch_s}
        result["fit"] = fit
        print(f"cpu fit: pointwise {fit['pointwise']} of {machine['mem_bw_gbs']} GB/s, attention {fit['attention']} "
              f"of the matmul rate, {fit['launch_s'] * 1e6:.2f} us per op (steps without AC), selective dispatch "
              f"{fit['selective_dispatch_s'] * 1e6:.1f} us per op (selective steps); in use: {fit['in_use']}")
    result["ratios"] = predict(result)
    result["summary"] = summarize(result["ratios"])
    result["env"] = env
    for r in result["ratios"]:
        held = result.get("fit", {}).get("held_out_selective", {}).get(r["case"])
        held_text = f", held out {held['selective_predicted_ratio']:.3f}" if held else ""
        print(f"  {r['case']:<22} none {r['none_measured_s'] * 1e3:7.1f} ms (planned {r['none_predicted_s'] * 1e3:7.1f})"
              f"  selective/none {r['selective_measured_ratio']:.3f} (planned {r['selective_predicted_ratio']:.3f}"
              f"{held_text})  full/none {r['full_measured_ratio']:.3f} (planned {r['full_predicted_ratio']:.3f})")
    print("median |error| of the predicted ratios: " + ", ".join(f"{k} {v:.1%}" for k, v in result["summary"].items()))
    path = out or f"benchmarks/planner-recompute-{torch.device(device).type}.json"
    write_json_atomic(path, result)
    print(f"wrote {path}")
    return result
