"""One trial of `slipstream tune hparams`: a real `slipstream train` in its own run directory,
watched while it runs.

The tuner reads the trial's metrics.jsonl as the trainer appends to it; each evaluation record
({"step": s, "val_loss": v, ...}) is reported to Optuna (trial.report(v, s)), and after the
warm-up evaluations the pruner is asked whether to stop. A pruned trial, or one still running
at the worker's deadline, is stopped with everything it started (process.stop_trial).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from slipstream.tune.process import MetricsTail, failure_reason, stop_trial

# Trial-only settings: nothing saved, no resume, quiet, and SIGTERM ends the trial at once (no
# preemption save). None of them changes the loss.
TRIAL_SETTINGS = {"checkpoint.save_final": False, "checkpoint.interval": 0, "checkpoint.interval_minutes": 0,
                  "checkpoint.resume": "none", "logging.progress": False, "resilience.preemption": False}
# Seconds between two looks at a running trial's metrics.
POLL_S = 0.25


@dataclasses.dataclass
class Outcome:
    """How a trial ended: state "complete" | "pruned" | "failed", its objective values, why it
    failed, and the last step its metrics recorded."""

    state: str
    values: list[float] | None = None
    reason: str = ""
    last_step: int | None = None


def _finite(value: Any) -> float:
    """A logged value as a float: nan for null (a non-finite value is logged as null)."""
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else math.nan


def _records(metrics: Path):
    """The records of a finished run's metrics.jsonl, one line at a time (memory bounded by the
    longest record)."""
    with contextlib.suppress(OSError), open(metrics, "rb") as f:
        for line in f:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and isinstance(record.get("step"), int):
                    yield record


def val_losses(metrics: Path) -> list[tuple[int, float]]:
    """(step, val_loss) of every evaluation record of a finished run's metrics.jsonl."""
    return [(r["step"], _finite(r["val_loss"])) for r in _records(metrics) if "val_loss" in r]


def steady_tokens_per_s(metrics: Path) -> float | None:
    """Tokens/s of the logging intervals after the first (tokens over their time), None with
    fewer than two intervals. The first interval holds start-up and warm-up (torch.compile's
    compilation, allocator growth) and summary.json's mean includes it: a short trial would
    rank a compiled setting by its compile time. The interval of the memory-measured step
    (metrics.memory_breakdown: a slower step) is left out too."""
    intervals, tokens_before = [], None
    for r in _records(metrics):
        speed, tokens = _finite(r.get("tokens_per_s")), r.get("tokens")
        if not isinstance(tokens, int) or not speed > 0:
            continue  # an evaluation or checkpoint record
        if tokens_before is not None and tokens > tokens_before and "mem_step_peak_bytes" not in r:
            intervals.append((tokens - tokens_before, speed))
        tokens_before = tokens
    if len(intervals) < 1:
        return None
    return sum(n for n, _ in intervals) / sum(n / speed for n, speed in intervals)


def read_objective(run_dir: Path, objective: str) -> tuple[list[float] | None, str]:
    """The trial's objective values (in the order of tune.objective), or None and why not:
    val_loss is summary.json's (the evaluation at the last step), best_val_loss the lowest
    evaluation, tokens_per_s the steady-state speed (steady_tokens_per_s, else the summary's)."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None, "the trial wrote no summary.json"
    values = []
    for name in objective.split(","):
        if name == "best_val_loss":
            losses = [v for _, v in val_losses(run_dir / "metrics.jsonl")]
            value = min(losses) if losses and not any(math.isnan(v) for v in losses) else \
                (math.nan if losses else None)
        elif name == "tokens_per_s" and (steady := steady_tokens_per_s(run_dir / "metrics.jsonl")) is not None:
            value = steady
        else:
            value = summary.get(name)
            value = None if value is None and name not in summary else _finite(value)
        if value is None:
            return None, f"the trial reported no {name} (is evaluation on? train.eval_tokens, train.eval_steps)"
        if not math.isfinite(value):
            return None, f"{name} is not finite ({value})"
        values.append(value)
    return values, ""


def _die_with_parent(parent: int):
    """preexec_fn: the trial gets SIGTERM when the tuner dies (even by SIGKILL), so a killed
    worker leaves no training behind (Linux; elsewhere resume stops the orphan)."""
    def setup() -> None:
        with contextlib.suppress(Exception):
            import ctypes

            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the tuner died before the line above ran
            os._exit(1)
    return setup if sys.platform.startswith("linux") else None


def run_trial(trial, command: list[str], run_dir: Path, env: dict[str, str], objective: str,
              deadline: float | None, report: bool, prune: bool, warmup_evals: int, final_step: int,
              on_start=None, on_poll=None) -> Outcome:
    """Run one trial to its end (see the module doc). `report`: send the val losses to Optuna
    (a val-loss objective of a single-objective study: Optuna takes no intermediate values of
    multi-objective ones); `prune`: ask the pruner after more than `warmup_evals` of them, before
    `final_step` (the trial's train.max_steps: its last evaluation is its result, which stopping
    would only throw away). `on_start(pid)` is called once the process runs, `on_poll()` at every
    look at it. Ctrl-C or any error stops the trial before it propagates."""
    out_path, err_path = run_dir / "trial.stdout", run_dir / "trial.stderr"
    tail, evals = MetricsTail(run_dir / "metrics.jsonl"), 0
    with open(out_path, "wb") as out, open(err_path, "wb") as err:
        proc = subprocess.Popen(command, stdout=out, stderr=err, env=env, start_new_session=True,
                                preexec_fn=_die_with_parent(os.getpid()))
        try:
            if on_start is not None:
                on_start(proc.pid)
            while True:
                code = proc.poll()
                for record in tail.read():
                    if not report or "val_loss" not in record or not isinstance(record.get("step"), int):
                        continue
                    trial.report(_finite(record["val_loss"]), record["step"])
                    evals += 1
                    # Not after the process ended, nor at the last step (the process is still
                    # writing its summary): a finished trial is complete, whatever its last report.
                    if (prune and code is None and record["step"] < final_step and evals > warmup_evals
                            and trial.should_prune()):
                        stop_trial(proc)
                        tail.read()
                        return Outcome("pruned", reason=f"pruned at step {record['step']}", last_step=record["step"])
                if code is not None:
                    break
                if on_poll is not None:
                    on_poll()
                if deadline is not None and time.monotonic() >= deadline:
                    stop_trial(proc)
                    tail.read()
                    return Outcome("failed", reason="budget", last_step=tail.last_step)
                time.sleep(POLL_S)
        except BaseException:  # Ctrl-C or an error of the tuner: never leave the trial running
            stop_trial(proc)
            raise
    if code != 0:
        reason = failure_reason(err_path.read_text(encoding="utf-8", errors="replace"), code)
        if code < 0:  # killed by a signal: its stderr's last line is whatever it printed before, not why
            name = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            reason = f"killed by {name}" + (" (out of memory? see dmesg)" if -code == signal.SIGKILL else "")
        return Outcome("failed", reason=reason, last_step=tail.last_step)
    values, why = read_objective(run_dir, objective)
    if values is None:
        return Outcome("failed", reason=why, last_step=tail.last_step)
    return Outcome("complete", values=values, last_step=tail.last_step)
