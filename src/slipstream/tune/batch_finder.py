"""`slipstream tune batch`: the largest micro-batch that fits, and the batch size the gradient noise asks for.

    slipstream tune batch --config F [--memory-gib G] [--max-micro-batch M] [--nproc N]
                          [--noise-rounds R] [--noise-k K] [--json] [--section.key=value ...]

1. The planner's prediction: the largest power of two whose planned step memory per process
   (slipstream plan's estimate, as the pre-flight check computes it) fits the budget:
   --memory-gib, else the GPU's memory on CUDA and MemAvailable on CPU (where the --nproc
   ranks share it).
2. Confirmed by real steps: a `slipstream train` subprocess of a few steps at that size,
   whose memory probe measures the step's peak (summary.json `memory.peak_bytes`, the highest
   rank). An out-of-memory failure, a pre-flight refusal or a measured peak over the budget
   halves the micro-batch and tries again. Planned and measured bytes are reported per try.
   On CPU both count the step's tensors (what the planner models), not the process's RSS.
3. The critical batch from the gradient noise scale (tune/noise_scale.py), measured in this
   process with B_small = the config's micro-batch (or the confirmed one, if smaller) and
   B_big = --noise-k x B_small: B_simple in sequences and tokens, the global batch
   near it as a multiple of micro-batch x data-parallel ranks, its grad_accum_steps, and
   optim.lr rescaled by the square-root rule (AdamW).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.tune.system import RunTrial, subprocess_trials

GIB = 2**30
TRIAL_STEPS = 2  # the memory probe measures step 2 (the optimizer state exists from step 1 on)
# One trial builds the model and runs two steps; a GPU's first step may compile for minutes.
TRIAL_TIMEOUT_S = 900.0
# A failed trial that means "too big": CUDA's out-of-memory error, the pre-flight refusal.
_TOO_BIG = ("out of memory", "cannot fit")
# The trials evaluate nothing, so a config's early stopping (which needs evaluations) is off; a
# trial stopped at its timeout dies at once instead of saving a preemption checkpoint first.
TRIAL_OVERRIDES = ["--train.early_stop_patience=0", "--resilience.preemption=false"]


def memory_budget(device_type: str, nproc: int, memory_gib: float | None) -> tuple[int, str]:
    """(bytes one process's training step may use, where that number comes from)."""
    import torch

    from slipstream.plan.preflight import device_memory_limit

    if memory_gib is not None:
        if not (math.isfinite(memory_gib) and memory_gib > 0):
            raise UserError(f"--memory-gib must be a number > 0 (got {memory_gib}), e.g. --memory-gib 16")
        total, source = int(memory_gib * GIB), "--memory-gib"
    else:
        limit = device_memory_limit(torch.device(device_type))
        if limit is None:
            raise UserError(f"this machine's {device_type} memory is unknown; give the budget with --memory-gib G")
        total, source = limit
    if device_type == "cpu" and nproc > 1:  # CPU ranks share the machine's memory; GPU ranks have one each
        return total // nproc, f"{source}, shared by {nproc} processes"
    return total, source


def planned_step_bytes(cfg, micro_batch: int, nproc: int, device_type: str) -> int:
    """The planner's step peak per process at `micro_batch` (what the pre-flight check compares)."""
    from slipstream.plan.preflight import plan_training_memory

    sized = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batch_size=micro_batch))
    estimate = plan_training_memory(sized, nproc, None, 0, device_type)
    return estimate.total_bytes + (estimate.host_bytes if device_type == "cpu" else 0)


def plan_micro_batches(cfg, nproc: int, device_type: str, budget: int, max_micro_batch: int) -> list[dict[str, Any]]:
    """Planned bytes of micro-batches 1, 2, 4, ... up to max_micro_batch, ending at the first that
    does not fit the budget."""
    rows, micro_batch = [], 1
    while micro_batch <= max_micro_batch:
        planned = planned_step_bytes(cfg, micro_batch, nproc, device_type)
        rows.append({"micro_batch": micro_batch, "planned_bytes": planned, "fits": planned <= budget})
        if planned > budget:
            break
        micro_batch *= 2
    return rows


def confirm_micro_batch(start: int, planned: dict[int, int], run_trial: RunTrial, budget: int,
                        timeout_s: float = TRIAL_TIMEOUT_S) -> list[dict[str, Any]]:
    """Real steps from `start` down: halve on out-of-memory, a pre-flight refusal or a measured
    peak over the budget, until one fits (its try has status "ok"). Any other failure stops: it
    would fail at every size."""
    tries, micro_batch = [], start
    while micro_batch >= 1:
        measured = run_trial({"train.micro_batch_size": micro_batch}, timeout_s)
        row = {"micro_batch": micro_batch, "planned_bytes": planned.get(micro_batch),
               "measured_bytes": measured.get("peak_bytes"), "status": "ok", "reason": ""}
        tries.append(row)
        error = measured.get("error", "")
        if error and any(words in error for words in _TOO_BIG):
            row["status"], row["reason"] = "out of memory", error
        elif error:
            row["status"], row["reason"] = "failed", error
            return tries
        elif row["measured_bytes"] is None:
            row["status"], row["reason"] = "failed", "the trial measured no step memory"
            return tries
        elif row["measured_bytes"] > budget:
            row["status"] = "too big"
            row["reason"] = f"measured {row['measured_bytes'] / 2**20:,.1f} MiB > budget {budget / 2**20:,.1f} MiB"
        else:
            return tries
        micro_batch //= 2
    return tries


def tune_batch(config_path: str | None, overrides: list[str], memory_gib: float | None = None,
               max_micro_batch: int = 1024, nproc: int = 1, noise_rounds: int = 10, noise_k: int = 8,
               run_trial: RunTrial | None = None) -> dict[str, Any]:
    """Plan, confirm and measure (see the module doc); returns the JSON-ready result."""
    from slipstream.config import load_config
    from slipstream.config.dims import resolve_parallel_dims
    from slipstream.data.ensure import ensure_data
    from slipstream.runtime import resolve_device
    from slipstream.tune.noise_scale import measure_lm_noise_scale, recommend_batch

    if not config_path:
        raise UserError("tune batch needs --config FILE: the training config whose batch size to tune")
    if max_micro_batch < 1 or nproc < 1:
        raise UserError(f"--max-micro-batch and --nproc must be >= 1 (got {max_micro_batch} and {nproc})")
    if noise_rounds < 0 or noise_k < 2:
        raise UserError(f"--noise-rounds must be >= 0 (0: skip) and --noise-k >= 2 (got {noise_rounds}, {noise_k})")
    cfg = load_config(config_path, overrides)
    device_type = resolve_device(cfg.train.device).type
    budget, source = memory_budget(device_type, nproc, memory_gib)
    dp = resolve_parallel_dims(cfg.parallel, nproc, nproc).dp
    # The data once, here, quietly (the trials then only open it); its manifest gives the vocabulary.
    # Its notes go to stderr: with --json, stdout is one JSON object.
    quiet = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, progress=False))
    with contextlib.redirect_stdout(sys.stderr):
        data_dir, manifest = ensure_data(quiet)
    overrides = [*overrides, f"--data.dir={data_dir}"]
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, vocab_size=cfg.model.vocab_size or
                                                            int(manifest["vocab_size"])))
    plan = plan_micro_batches(cfg, nproc, device_type, budget, max_micro_batch)
    fitting = [row["micro_batch"] for row in plan if row["fits"]]
    result: dict[str, Any] = {"config": config_path, "overrides": overrides, "device": device_type, "nproc": nproc,
                              "dp": dp, "budget_bytes": budget, "budget_source": source, "seq_len": cfg.train.seq_len,
                              "max_micro_batch": max_micro_batch, "plan": plan,
                              "planned_micro_batch": fitting[-1] if fitting else None, "tries": [],
                              "micro_batch": None, "noise": None, "recommendation": None, "notes": []}
    if not fitting:
        result["notes"].append(f"the planner puts even a micro-batch of 1 over the budget "
                               f"({plan[0]['planned_bytes'] / 2**20:,.1f} MiB > {budget / 2**20:,.1f} MiB)")
        return result
    if fitting[-1] == max_micro_batch:
        result["notes"].append(f"--max-micro-batch {max_micro_batch} fits the plan; raise it to look further")
    planned = {row["micro_batch"]: row["planned_bytes"] for row in plan}
    tmp = Path(tempfile.mkdtemp(prefix="slipstream-tune-batch-"))
    try:
        if run_trial is None:
            run_trial = subprocess_trials(config_path, [*overrides, *TRIAL_OVERRIDES], nproc, TRIAL_STEPS, tmp)
        tries = confirm_micro_batch(fitting[-1], planned, run_trial, budget)
    except BaseException:  # Ctrl-C or an error: the trials' logs say what happened
        print(f"tune batch stopped; trial logs kept in {tmp}", file=sys.stderr)
        raise
    # The logs stay when a trial failed (its reason points into them), else they go.
    if any(t["status"] == "failed" for t in tries):
        result["notes"].append(f"trial logs kept in {tmp}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    result["tries"] = tries
    if tries and tries[-1]["status"] == "ok":
        result["micro_batch"] = tries[-1]["micro_batch"]
    elif tries and tries[-1]["status"] == "failed":
        result["notes"].append(f"a trial failed for a reason other than memory: {tries[-1]['reason']}")
    else:
        result["notes"].append("real steps do not fit the budget even at micro-batch 1: shorten train.seq_len, "
                               "set activations.checkpointing=full, shard the model state (parallel.dp_strategy=fsdp) "
                               "or raise --memory-gib")
    if result["micro_batch"] is None or noise_rounds == 0:
        return result
    # B_small: the config's micro-batch (the noise the run will see per micro-batch, and cheap),
    # or the largest that fits when that is smaller.
    b_small = min(cfg.train.micro_batch_size, result["micro_batch"])
    noise_cfg = load_config(config_path, [*overrides, f"--train.micro_batch_size={b_small}"])
    result["noise"] = measure_lm_noise_scale(noise_cfg, rounds=noise_rounds, k=noise_k)
    result["recommendation"] = recommend_batch(result["noise"]["b_simple"], result["micro_batch"], dp, cfg)
    return result


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def format_batch_report(result: dict[str, Any]) -> str:
    """The text report: the plan, each real try, the critical batch and the recommendation."""
    lines = [f"tune batch: {result['nproc']}x{result['device']}, seq {result['seq_len']}, budget "
             f"{_mib(result['budget_bytes'])} per process ({result['budget_source']})"]
    lines.append("  planned step memory: " + ", ".join(
        f"{row['micro_batch']}: {_mib(row['planned_bytes'])}" for row in result["plan"]))
    lines.append(f"  largest micro-batch the plan fits: {result['planned_micro_batch'] or 'none'}")
    for t in result["tries"]:
        error = "" if t["planned_bytes"] is None or not t["measured_bytes"] else \
            f" ({t['planned_bytes'] / t['measured_bytes'] - 1:+.1%} planned vs measured)"
        reason = f" ({t['reason']})" if t["reason"] else ""
        lines.append(f"  real steps at micro-batch {t['micro_batch']}: planned {_mib(t['planned_bytes'])}, measured "
                     f"{_mib(t['measured_bytes'])}{error}: {t['status']}{reason}")
    lines.append(f"largest micro-batch that fits: {result['micro_batch'] or 'none'}")
    lines += [f"note: {n}" for n in result["notes"]]
    noise = result["noise"]
    if noise is None:
        return "\n".join(lines)
    lines.append(f"gradient noise ({noise['rounds']} rounds at {noise['measured_at']}): |G|^2 = "
                 f"{noise['grad_sq_norm']:.4g}, tr(Sigma) = {noise['trace_cov']:.4g} "
                 f"(B_small {noise['b_small']}, B_big {noise['b_big']} sequences)")
    if noise["b_simple"] is None:
        lines.append("critical batch: not measurable (the estimated |G|^2 is not positive: the gradient is all noise "
                     "at these sizes); measure more rounds (--noise-rounds) or a bigger B_big (--noise-k)")
        return "\n".join(lines)
    stderr = f" +- {noise['b_simple_stderr']:.3g}" if noise.get("b_simple_stderr") else ""
    lines.append(f"critical batch (B_simple = tr(Sigma) / |G|^2): {noise['b_simple']:.3g}{stderr} sequences = "
                 f"{noise['b_simple_tokens']:,.0f} tokens")
    rec = result["recommendation"]
    lines.append(f"recommended global batch: {rec['global_batch']} sequences ({rec['tokens']:,} tokens) = micro-batch "
                 f"{rec['micro_batch']} x grad_accum_steps {rec['grad_accum_steps']} x {result['dp']} data-parallel")
    if rec["note"]:
        lines.append(f"note: {rec['note']}")
    lines.append(f"learning rate: square-root scaling (AdamW, an Adam-family optimizer) from the config's global batch "
                 f"{rec['current_global_batch']}: optim.lr {rec['current_lr']:.3g} -> {rec['lr']:.3g}")
    lines.append(f"train with --train.micro_batch_size={rec['micro_batch']} "
                 f"--train.grad_accum_steps={rec['grad_accum_steps']} --optim.lr={rec['lr']:.3g}")
    if noise["measured_at"] == "initialization":
        lines.append("note: measured at initialization; the noise scale grows as the loss falls, so later phases "
                     "want bigger batches (measure from a checkpoint with --checkpoint.resume=PATH)")
    return "\n".join(lines)
