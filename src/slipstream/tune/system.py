"""`slipstream tune system`: run short real trials of the planner's best layouts, keep the fastest that fits.

    slipstream tune system --config F [--budget 10m] [--top K] [--nproc N] [--steps S]
                           [--layouts L ...] [--json] [--write-config OUT] [--section.key=value ...]

The planner ranks layouts from shapes and datasheets; this command checks its top K on this
machine. Every trial trains the same thing as the config (same model, optimizer, precision,
sequence length and global batch); only the layout changes: the micro-batch / accumulation
split, activation checkpointing, the fused loss, the data-parallel strategy and offload, and
with N > 1 the tensor-parallel (with sequence and loss parallel) and context-parallel degrees.
The user's own layout always runs too (labelled "current"), so the gain is measured.
`--layouts` adds layouts by name, whatever their rank: a label as `slipstream plan` and this
command print it ("none tp2+sp mb8x1"), or some of its words ("tp2", "cp2 ac:full"), which
pick the best-ranked layout that has them all. Only layouts `slipstream train` accepts with
this config are trialled: each candidate's config goes through the trainer's own layout
checks first (divisibility of heads and sequence, strategy compositions, compile rules).

Each trial is a `slipstream train` subprocess (under `launch local` for N > 1) killed at its
share of the budget. Speed is the median tokens/s of the steps after the first two (step 1
warms up, step 2 is slowed by the memory tracker); memory is the tracked peak of step 2 (the
highest rank). The median measured/predicted speed ratio (times the planner's default
efficiency the predictions used) is this machine's "efficiency", to pass to `slipstream plan
--efficiency`. A trial that fails, times out or overflows memory is reported with its reason;
it never stops the tuner.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from slipstream.errors import UserError
from slipstream.tune.process import failure_reason, override, stop_trial, train_command, train_env

# A trial is a fresh process: importing torch and building the model takes seconds before any step.
MIN_TRIAL_S = 15.0
# Step 1 warms up, step 2 is slowed by the memory tracker: at least two more steps are timed.
MIN_STEPS = 4
# Trial-only settings: no evaluation, checkpoints, loggers or profiler; one record per step.
TRIAL_SETTINGS = {"train.eval_steps": 0, "checkpoint.save_final": False, "checkpoint.interval": 0,
                  "checkpoint.interval_minutes": 0, "checkpoint.resume": "none", "logging.tensorboard": False,
                  "logging.wandb": False, "logging.progress": False, "logging.log_interval": 1,
                  "metrics.memory_breakdown": True, "metrics.memory_snapshot": False, "profile.enabled": False,
                  # Evaluation is off, so early stopping must be; a trial stopped at its share of the
                  # budget ends at once instead of saving a preemption checkpoint first.
                  "train.early_stop_patience": 0, "resilience.preemption": False}

RunTrial = Callable[[dict, float], dict]
# Context-parallel degrees the tuner plans whenever the processes divide by them: `slipstream
# plan` proposes cp only for long sequences (where it pays on GPUs), but here it is measured.
CP_DEGREES = (1, 2, 4, 8, 16)


def _vocab(cfg) -> int:
    """The vocabulary the model will have: its own, or the prepared data's / tokenizer's."""
    if cfg.model.vocab_size:
        return cfg.model.vocab_size
    from slipstream.data import get_tokenizer, load_manifest

    if cfg.data.dir:
        return int(load_manifest(cfg.data.dir)["vocab_size"])
    return get_tokenizer(cfg.data.tokenizer).vocab_size


def gpu_short_name(device_name: str) -> str | None:
    """The planner's name ("H100") for a torch.cuda.get_device_name() ("NVIDIA H100 80GB HBM3")."""
    from slipstream.plan.gpus import lookup_gpu
    from slipstream.plan.hardware import CPU, canonical_gpu_name, known_gpus, make_cluster

    short = canonical_gpu_name(device_name)
    spec = lookup_gpu(device_name)
    if short is not None or spec is None:
        return short
    # A device name: the planner entry with the same datasheet.
    return next((g for g in known_gpus() if g != CPU and make_cluster(f"1x{g}").gpu.name == spec.name), None)


def _cluster(cfg, nproc: int):
    """This machine: N CPU processes, or N GPUs of the local type when CUDA is there and used."""
    import torch

    from slipstream.observe.peaks import this_cpu
    from slipstream.plan.hardware import known_gpus, make_cluster

    if cfg.train.device == "cpu" or not torch.cuda.is_available():
        return make_cluster(f"{nproc}xcpu", cpu=this_cpu())
    if nproc > torch.cuda.device_count():
        raise UserError(f"--nproc {nproc}: this machine has {torch.cuda.device_count()} GPU(s)")
    name = torch.cuda.get_device_name()
    short = gpu_short_name(name)
    if short is None:
        raise UserError(f"the planner has no datasheet for the GPU {name!r}; known: {', '.join(known_gpus())}")
    return make_cluster(f"{nproc}x{short}")


def read_trial(run_dir: Path) -> dict:
    """Measured tokens/s (median of the steps after the first two) and peak bytes of a trial's run."""
    summary = json.loads((run_dir / "summary.json").read_text())
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = [r["tokens_per_s"] for r in records
              if r.get("tokens_per_s") and r.get("step", 0) > 2 and "mem_step_peak_bytes" not in r]
    tokens_per_s = statistics.median(steady) if steady else summary.get("tokens_per_s")
    ranks = [r["step_peak_bytes"] for r in summary.get("ranks", []) if r.get("step_peak_bytes") is not None]
    if ranks:
        peak = max(ranks)
    elif "memory" in summary:
        peak = summary["memory"]["peak_bytes"]
    else:
        peak = summary.get("mem_peak_bytes")
    return {"tokens_per_s": tokens_per_s, "peak_bytes": peak}


def subprocess_trials(config_path: str, overrides: list[str], nproc: int, steps: int, work_dir: Path) -> RunTrial:
    """A run_trial that trains each layout in a `slipstream train` subprocess under `work_dir`."""
    counter = iter(range(1_000_000))
    env = train_env()

    def run_trial(layout: dict, timeout_s: float) -> dict:
        run_dir = work_dir / f"trial{next(counter)}"
        settings = {**layout, **TRIAL_SETTINGS, "train.max_steps": steps, "run.dir": run_dir}
        command = train_command(["--config", config_path, *overrides, *(override(k, v) for k, v in settings.items())], nproc)
        err_path = work_dir / f"{run_dir.name}.stderr"
        with open(work_dir / f"{run_dir.name}.stdout", "wb") as out, open(err_path, "wb") as err:
            # Its own process group: on timeout, torchrun's workers die with it.
            proc = subprocess.Popen(command, stdout=out, stderr=err,
                                    env=env, start_new_session=True)
            try:
                code = proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                stop_trial(proc)
                return {"error": f"timed out after {timeout_s:.0f}s (logs: {err_path})", "timed_out": True}
            except BaseException:  # Ctrl-C or any error: never leave ranks running
                stop_trial(proc)
                raise
        if code != 0:
            return {"error": f"{failure_reason(err_path.read_text(errors='replace'), code)} (logs: {err_path})"}
        return read_trial(run_dir)

    return run_trial


# A label's tensor / context-parallel word: "tp2+sp", "cp4".
_DEGREE_WORD = re.compile(r"(tp|cp)\d")


def matches(pattern: str, label: str) -> bool:
    """Whether a --layouts entry names this layout label: each of its words is a word of the
    label, or a word's start before its ':' or '+' ("tp2" names "tp2+sp", "fsdp" "fsdp:2").
    The tensor / context-parallel degrees are named or 1: "tp2" names tp2 layouts without
    cp, not cp2 x tp2 ("cp2 tp2" does); "tp1" and "cp1" may be written."""
    def names(p: str, w: str) -> bool:
        return w == p or w.startswith(p + ":") or w.startswith(p + "+")

    words, wanted = label.split(), [p for p in pattern.split() if p not in ("tp1", "cp1")]
    if not pattern.split() or not all(any(names(p, w) for w in words) for p in wanted):
        return False
    return all(any(names(p, w) for p in wanted) for w in words if _DEGREE_WORD.match(w))


def trainer_refusal(config_path: str, overrides: list[str], layout: dict, nproc: int, vocab: int) -> str:
    """Why `slipstream train` would refuse this layout on `nproc` processes ("" when it starts):
    the trainer's own layout checks on the config the trial would load, run here, so a layout
    it refuses costs no trial (and is never proposed)."""
    from slipstream.config import load_config
    from slipstream.config.dims import check_compatibility, resolve_parallel_dims

    try:
        cfg = load_config(config_path, [*overrides, *(override(k, v) for k, v in {**layout, **TRIAL_SETTINGS}.items())])
        dims = resolve_parallel_dims(cfg.parallel, nproc, nproc)
        check_compatibility(cfg, dims)
        # As init_parallel and the LM job check them (imported only when needed: DTensor is slow to import).
        if dims.tp > 1:
            from slipstream.distributed.tensor_parallel import check_model_splits, check_tensor_parallel

            check_tensor_parallel(cfg, dims.tp)
            check_model_splits(dataclasses.replace(cfg.model, vocab_size=vocab), dims.tp)
        if dims.cp > 1:
            from slipstream.distributed.context_parallel import check_context_parallel

            check_context_parallel(cfg, dims.cp, dims.tp)
    except UserError as e:
        return str(e)
    return ""


def tune_system(config_path: str, overrides: list[str], budget_s: float, top: int = 3, nproc: int = 1,
                steps: int = 20, run_trial: RunTrial | None = None, layouts: list[str] | tuple[str, ...] = ()) -> dict:
    """Plan, run the trials, and return the JSON-ready result (see the module doc)."""
    from slipstream.config import load_config
    from slipstream.plan.search import evaluate, explain_infeasible, plan
    from slipstream.plan.space import PlanModel, Workload, precision_of, strategy_from_config, strategy_overrides
    from slipstream.plan.timing import DEFAULT_EFFICIENCY

    if not config_path:
        raise UserError("tune system needs --config FILE: the training config whose layout to tune")
    layouts = [" ".join(p.split()) for p in layouts]
    if top < 0 or (top == 0 and not layouts) or nproc < 1:
        raise UserError(f"--top must be >= 1 (0 with --layouts) and --nproc >= 1 (got {top} and {nproc})")
    if any(not p for p in layouts):
        raise UserError("--layouts entries must name a layout, e.g. 'tp2' or 'none tp2+sp mb8x1'")
    if steps < MIN_STEPS:
        raise UserError(f"--steps must be >= {MIN_STEPS}: step 1 warms up and step 2 measures memory (got {steps})")
    wanted = 1 + len(layouts) + top
    if budget_s < MIN_TRIAL_S:
        raise UserError(f"--budget {budget_s:g}s is too small: one trial needs at least {MIN_TRIAL_S:g}s "
                        f"(the current layout plus {wanted - 1} more need {MIN_TRIAL_S * wanted:g}s)")
    cfg = load_config(config_path, overrides)
    precision = precision_of(cfg)
    cluster = _cluster(cfg, nproc)
    vocab = _vocab(cfg)
    model = PlanModel(cfg.model.preset or Path(config_path).stem, dataclasses.replace(cfg.model, vocab_size=vocab))
    current = strategy_from_config(cfg, nproc)
    # The data-parallel ranks read different batches; tp / cp ranks share theirs.
    work = Workload(seq_len=cfg.train.seq_len, global_batch=current.micro_batch * current.grad_accum * current.dp)
    # Predicted as `slipstream plan` predicts by default, so the fitted efficiency is a drop-in value for it.
    result = plan(model, cluster, work, efficiency=DEFAULT_EFFICIENCY, runnable_only=True, precision=precision,
                  cp=tuple(c for c in CP_DEGREES if nproc % c == 0))
    if not result.ranked:
        raise UserError(explain_infeasible(result) if result.rejected else "no layout fits this machine")

    refusals: dict[str, str] = {}  # label -> why the trainer would refuse it ("" = it would run)

    def runs(candidate) -> bool:
        label = candidate.strategy.label()
        if label not in refusals:
            layout = strategy_overrides(candidate.strategy, work.seq_len)
            refusals[label] = trainer_refusal(config_path, overrides, layout, nproc, vocab)
        return not refusals[label]

    # The current layout first (it runs exactly the config), then the requested layouts (kept
    # first when the budget is short: the user asked for them), then the planner's best.
    device = "cpu" if cluster.short_name == "cpu" else "cuda"
    ranks = {c.strategy.label(): i + 1 for i, c in enumerate(result.ranked)}
    trials = [("current", evaluate(model, current, work, cluster, DEFAULT_EFFICIENCY, device), {}, None)]
    seen = {current.label()}
    for pattern in layouts:
        named = [c for c in result.ranked if matches(pattern, c.strategy.label())]
        # The exact label first, else the best-ranked layout with every word of the pattern.
        named.sort(key=lambda c: c.strategy.label() != pattern)
        chosen = next((c for c in named if runs(c)), None)
        if chosen is None:
            raise UserError(_no_such_layout(pattern, named, refusals, result.ranked, nproc))
        if chosen.strategy.label() not in seen:
            seen.add(chosen.strategy.label())
            trials.append((chosen.strategy.label(), chosen, strategy_overrides(chosen.strategy, work.seq_len), pattern))
    picked = 0
    for candidate in result.ranked:
        if picked >= top:
            break
        if candidate.strategy.label() not in seen and runs(candidate):
            seen.add(candidate.strategy.label())
            picked += 1
            trials.append((candidate.strategy.label(), candidate, strategy_overrides(candidate.strategy, work.seq_len),
                           None))
    notes = []
    skipped = [label for label, why in refusals.items() if why]
    if skipped:
        notes.append(f"skipped {len(skipped)} layout(s) slipstream train refuses with this config, e.g. "
                     f"{skipped[0]}: {refusals[skipped[0]]}")
    affordable = int(budget_s // MIN_TRIAL_S)
    if affordable < len(trials):
        notes.append(f"the budget allows {affordable} of {len(trials)} trials ({MIN_TRIAL_S:g}s each at least); "
                     f"raise --budget to try all")
        trials = trials[:affordable]
    timeout_s = budget_s / len(trials)

    tmp = tempfile.mkdtemp(prefix="slipstream-tune-")
    try:
        if run_trial is None:
            from slipstream.data.ensure import ensure_data

            # Prepare (or find) the data once, not inside a timed trial; quietly, so --json stays one object.
            quiet = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, progress=False))
            data_dir, _ = ensure_data(quiet)
            run_trial = subprocess_trials(config_path, [*overrides, f"--data.dir={data_dir}"], nproc, steps, Path(tmp))
        records = [_run_one(label, candidate, layout, run_trial, timeout_s, cluster.memory_bytes,
                            ranks.get(candidate.strategy.label()), requested)
                   for label, candidate, layout, requested in trials]
    finally:
        # The trials' logs stay when one failed (the reasons point into them), else they go.
        interrupted = "records" not in locals()
        if (interrupted or any(r["status"] != "ok" for r in records)) and any(Path(tmp).iterdir()):
            notes.append(f"trial logs kept in {tmp}")
            if interrupted:
                print(f"tune system stopped; trial logs kept in {tmp}", file=sys.stderr)
        else:
            shutil.rmtree(tmp, ignore_errors=True)

    ok = [r for r in records if r["status"] == "ok"]
    winner = max(ok, key=lambda r: r["measured"]["tokens_per_s"], default=None)
    base = records[0]["measured"]["tokens_per_s"] if records[0]["status"] == "ok" else None
    ratios = [r["measured"]["tokens_per_s"] / r["predicted"]["tokens_per_s"] for r in ok]
    return {"config": str(config_path), "overrides": list(overrides), "cluster": f"{nproc}x{cluster.short_name}",
            "nproc": nproc, "memory_bytes": cluster.memory_bytes, "precision": precision, "seq_len": work.seq_len,
            "global_batch": work.global_batch, "budget_s": budget_s, "trial_timeout_s": timeout_s, "steps": steps,
            "candidates": records, "winner": winner,
            "speedup": winner["measured"]["tokens_per_s"] / base if winner and base else None,
            "efficiency": DEFAULT_EFFICIENCY * statistics.median(ratios) if ratios else None, "notes": notes}


def _no_such_layout(pattern: str, named: list, refusals: dict[str, str], ranked: list, nproc: int) -> str:
    """The error for a --layouts entry no trial can be made of: what it matched and why those
    cannot run, or which layouts there are."""
    if named:
        label = named[0].strategy.label()
        return (f"--layouts {pattern!r}: slipstream train refuses every matching layout with this config; "
                f"{label}: {refusals[label]}")
    best: dict[tuple[int, int], str] = {}
    for c in ranked:  # the best-ranked layout of each tensor x context-parallel degree, as examples
        best.setdefault((c.strategy.tp, c.strategy.cp), c.strategy.label())
    examples = "; ".join(best[k] for k in sorted(best))
    return (f"--layouts {pattern!r} names no runnable layout that fits {nproc} process(es); the best of each "
            f"tensor / context-parallel degree here: {examples}")


def _run_one(label, candidate, layout: dict, run_trial: RunTrial, timeout_s: float, memory_bytes: int,
             rank: int | None = None, requested: str | None = None) -> dict:
    """One trial as a record; whatever goes wrong becomes its status and reason, never an exception.
    `rank`: the layout's place in the planner's ranking (None: not ranked, e.g. a current layout
    that does not fit the plan); `requested`: the --layouts entry that chose it."""
    record = {"label": label, "layout": candidate.strategy.label(), "overrides": layout,
              "rank": rank, "requested": requested,
              "predicted": {"tokens_per_s": candidate.time.tokens_per_s, "peak_bytes": candidate.memory.total_bytes},
              "measured": None, "error_pct": None, "status": "ok", "reason": ""}
    try:
        measured = run_trial(layout, timeout_s)
    except Exception as e:  # noqa: BLE001 - a broken trial must not stop the others
        measured = {"error": f"{type(e).__name__}: {e}"}
    if "error" in measured or not measured.get("tokens_per_s"):
        record["status"] = "timeout" if measured.get("timed_out") else "failed"
        record["reason"] = measured.get("error") or "the trial reported no speed"
        return record
    record["measured"] = {"tokens_per_s": float(measured["tokens_per_s"]), "peak_bytes": measured.get("peak_bytes")}
    predicted = record["predicted"]["tokens_per_s"]
    record["error_pct"] = 100.0 * (record["measured"]["tokens_per_s"] - predicted) / predicted
    peak = measured.get("peak_bytes")
    if peak is not None and peak > memory_bytes:
        record["status"] = "too big"
        record["reason"] = f"measured {peak / 2**30:.2f} GiB > {memory_bytes / 2**30:.2f} GiB usable"
    return record


def _mib(value) -> str:
    return "-" if value is None else f"{value / 2**20:,.1f} MiB"


def format_report(result: dict) -> str:
    """The plain-text table: predicted vs measured per trial, then the winner and the calibration."""
    # "plan #": the layout's rank among the planner's runnable layouts (a --layouts pick may be far down).
    rows = [("layout", "plan #", "pred tok/s", "meas tok/s", "error", "pred peak", "meas peak", "status")]
    for r in result["candidates"]:
        m = r["measured"] or {}
        name = f"current ({r['layout']})" if r["label"] == "current" else r["label"]
        rows.append((name, "-" if r.get("rank") is None else str(r["rank"]), f"{r['predicted']['tokens_per_s']:,.0f}",
                     "-" if not m else f"{m['tokens_per_s']:,.0f}",
                     "-" if r["error_pct"] is None else f"{r['error_pct']:+.0f}%",
                     _mib(r["predicted"]["peak_bytes"]), _mib(m.get("peak_bytes")),
                     r["status"] + (f": {r['reason']}" if r["reason"] else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"tune system: {result['cluster']}, seq {result['seq_len']}, global batch {result['global_batch']}, "
             f"{result['precision']}, {result['steps']} steps per trial, at most {result['trial_timeout_s']:.0f}s each"]
    lines += ["  ".join([*(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))),
                         row[-1]]) for row in rows]
    lines += [f"note: {n}" for n in result["notes"]]
    winner = result["winner"]
    if winner is None:
        lines.append("no trial succeeded; see the reasons above")
        return "\n".join(lines)
    speed = f"{winner['measured']['tokens_per_s']:,.0f} tokens/s"
    if winner["label"] == "current":
        lines.append(f"winner: the current layout ({winner['layout']}) at {speed}: keep it")
    else:
        speedup = f", {result['speedup']:.2f}x the current layout" if result["speedup"] else ""
        lines.append(f"winner: {winner['layout']} at {speed}{speedup}")
    lines.append(f"efficiency (measured / predicted, median): {result['efficiency']:.3g}; "
                 f"plan with `slipstream plan --efficiency {result['efficiency']:.3g}`")
    return "\n".join(lines)


def write_winner_config(result: dict, out: str | Path) -> Path:
    """A TOML that extends the original config with the user's overrides and the winner's layout (atomic)."""
    import tomli_w

    from slipstream.config.load import deep_merge, parse_overrides

    if result["winner"] is None:
        raise UserError("no trial succeeded, so there is no winner to write")
    from slipstream.observe.env import write_text_atomic

    out = Path(out).resolve()
    layout = [override(k, v) for k, v in result["winner"]["overrides"].items()]
    data = deep_merge(parse_overrides(result["overrides"]), parse_overrides(layout))
    base = os.path.relpath(Path(result["config"]).resolve(), out.parent)
    text = (f"# Written by `slipstream tune system`: the fastest layout measured ({result['winner']['layout']}).\n"
            + tomli_w.dumps({"extends": base, **data}))
    write_text_atomic(out, text)
    return out

