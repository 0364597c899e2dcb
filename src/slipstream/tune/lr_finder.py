"""The learning-rate range test (`slipstream tune lr`, and `find_lr` for any model).

    slipstream tune lr --config F [--steps 200] [--min-lr 1e-7] [--max-lr 1] [--nproc N]
                       [--plot lr.png] [--json] [--section.key=value ...]

One real training whose learning rate grows exponentially from min_lr at the first step to
max_lr at the last (optim.schedule = range_test, no warmup), logging the loss of every step,
with evaluation and checkpoints off. It stops early once the loss has clearly diverged: the
smoothed loss above `stop_factor` x its minimum, back above its first value after falling
(all progress lost), or not finite.

The analysis (`suggest_lr`, a pure function of the sweep's lrs and losses):
  - the smoothed loss is a bias-corrected exponential moving average. Live (to stop the
    sweep) it runs forwards only; for the readings it runs forwards and then backwards over
    the curve before divergence, which cancels its lag: a one-way average trails the sweep
    by about beta / (1 - beta) steps and would put every reading at a higher lr than the one
    that earned it;
  - the suggestion is the lr of the steepest descent of the smoothed loss vs log(lr), before
    the loss is at its minimum; the "minimum / 10" rule and the divergence point (where the
    live average crossed) are reported next to it.

`slipstream tune lr` trains the LM job in a `slipstream train` subprocess (under `launch
local` for --nproc > 1) and watches its metrics.jsonl; `find_lr` runs the same sweep in this
process with slipstream's Trainer on any model (one process).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.tune.process import MetricsTail, failure_reason, override, stop_trial, train_command, train_env

MIN_STEPS = 10  # fewer points leave nothing to smooth and no slope to read
DEFAULT_STOP_FACTOR = 4.0
# The sweep's training: every step logged (the range test's data), nothing else the sweep does
# not need (evaluation, checkpoints, loggers, the memory probe); no guard skips a diverging step.
# Stopped on divergence by SIGTERM, it must die, not save its diverged weights as a preemption
# checkpoint (which a later --checkpoint.resume=auto in that run.dir would continue from).
SWEEP_SETTINGS = {"optim.schedule": "range_test", "optim.warmup_steps": 0, "train.eval_steps": 0,
                  "train.early_stop_patience": 0, "logging.log_interval": 1, "logging.progress": False,
                  "logging.tensorboard": False, "logging.wandb": False, "checkpoint.interval": 0,
                  "checkpoint.interval_minutes": 0, "checkpoint.save_final": False, "checkpoint.resume": "none",
                  "resilience.preemption": False, "stability.policy": "none", "metrics.memory_breakdown": False,
                  "profile.enabled": False}
# How often the watcher reads the trial's metrics.jsonl.
POLL_S = 0.2


def check_sweep(steps: int, min_lr: float, max_lr: float, stop_factor: float = DEFAULT_STOP_FACTOR) -> None:
    """UserError for a sweep that cannot run or say anything."""
    if steps < MIN_STEPS:
        raise UserError(f"--steps must be >= {MIN_STEPS} for a range test (got {steps}); a few hundred is usual")
    if not (math.isfinite(min_lr) and math.isfinite(max_lr)) or min_lr <= 0:
        raise UserError(f"--min-lr must be a finite number > 0 (got {min_lr}): the sweep is exponential")
    if max_lr <= min_lr:
        raise UserError(f"--min-lr ({min_lr:g}) must be below --max-lr ({max_lr:g}), e.g. --min-lr 1e-7 --max-lr 1")
    if not stop_factor > 1:
        raise UserError(f"the stop factor must be > 1 (got {stop_factor}); 4 stops at 4x the lowest smoothed loss")


def sweep_settings(steps: int, min_lr: float, max_lr: float) -> dict[str, Any]:
    """The config settings of the sweep's training (section.key -> value)."""
    return {**SWEEP_SETTINGS, "train.max_steps": steps, "optim.min_lr": min_lr, "optim.lr": max_lr}


def sweep_lrs(steps: int, min_lr: float, max_lr: float) -> list[float]:
    """The lr of steps 1..steps, from the trainer's own schedule (the logged `lr` is the next step's:
    it is read after the scheduler moved on)."""
    from slipstream.config.schema import OptimConfig
    from slipstream.train.schedule import lr_multiplier

    optim = OptimConfig(lr=max_lr, min_lr=min_lr, schedule="range_test", warmup_steps=0)
    return [max_lr * lr_multiplier(step, optim, steps) for step in range(steps)]


def smoothing_beta(steps: int) -> float:
    """The moving average's beta for a sweep of `steps`: about 5 % of its points (fastai's 0.98
    averages 50 points, a quarter of a 200-step sweep: the curve's bend would be blurred away)."""
    return min(0.98, max(0.6, 1.0 - 20.0 / steps))


def ema(values: list[float], beta: float) -> list[float]:
    """Bias-corrected exponential moving average (Adam's correction: no pull toward 0 at the start)."""
    out, avg = [], 0.0
    for t, value in enumerate(values, start=1):
        avg = beta * avg + (1.0 - beta) * value
        out.append(avg / (1.0 - beta ** t))
    return out


class DivergenceWatch:
    """Follows a sweep's losses one step at a time and says when it has diverged."""

    def __init__(self, beta: float, stop_factor: float = DEFAULT_STOP_FACTOR):
        self.beta, self.stop_factor = beta, stop_factor
        self.t, self.avg = 0, 0.0
        self.first = self.lowest = math.inf
        self.reason = ""

    def add(self, loss: float | None) -> bool:
        """Take the next step's loss; True once the sweep has diverged (self.reason says how)."""
        if loss is None or not math.isfinite(loss):
            self.reason = "the loss is not finite"
            return True
        self.t += 1
        self.avg = self.beta * self.avg + (1.0 - self.beta) * loss
        smoothed = self.avg / (1.0 - self.beta ** self.t)
        if self.t == 1:
            self.first = smoothed
        self.reason = divergence_reason(smoothed, self.first, self.lowest, self.stop_factor)
        self.lowest = min(self.lowest, smoothed)
        return bool(self.reason)


def divergence_reason(smoothed: float, first: float, lowest: float, stop_factor: float) -> str:
    """Why a smoothed loss shows divergence ("" when it does not): over stop_factor x the lowest
    so far (positive losses), or back above the first value after falling at least 10 % below it
    (a small dip is noise; an LM's loss rarely reaches 4x its minimum, but it does lose all its progress)."""
    if not math.isfinite(smoothed):
        return "the loss is not finite"
    if 0 < lowest < math.inf and smoothed > stop_factor * lowest:
        return f"the smoothed loss rose above {stop_factor:g}x its minimum"
    if lowest < first - 0.1 * abs(first) and smoothed > first:
        return "the smoothed loss rose back above its starting value"
    return ""


def suggest_lr(lrs: list[float], losses: list[float | None], beta: float | None = None,
               stop_factor: float = DEFAULT_STOP_FACTOR) -> dict[str, Any]:
    """Analyse a range test: `losses[i]` is the loss of the step trained at `lrs[i]` (increasing;
    None or nan: not finite). beta: the moving average's (None: smoothing_beta of the length).

    Returns the smoothed curve up to the divergence and: suggested_lr (steepest descent of the
    smoothed loss vs log(lr), before its minimum), min_loss_lr and min_loss_lr / 10,
    divergence_lr (the lr of the step where the live average diverged; None if it never did)
    with its reason, and notes.
    """
    beta = smoothing_beta(len(lrs)) if beta is None else beta
    if len(lrs) != len(losses):
        raise ValueError(f"{len(lrs)} lrs but {len(losses)} losses")
    if any(b <= a for a, b in zip(lrs, lrs[1:])) or (lrs and lrs[0] <= 0):
        raise ValueError("the lrs of a range test must be positive and increasing")
    # The curve ends at the first non-finite loss (nothing after it means anything).
    finite = next((i for i, x in enumerate(losses) if x is None or not math.isfinite(x)), len(losses))
    live = ema([float(x) for x in losses[:finite]], beta)  # what the sweep's watch saw
    out: dict[str, Any] = {"lrs": list(lrs), "losses": list(losses), "smoothed": [], "beta": beta,
                           "stop_factor": stop_factor, "suggested_lr": None, "min_loss": None, "min_loss_lr": None,
                           "min_loss_lr_over_10": None, "divergence_lr": None, "divergence_reason": "", "notes": []}
    notes = out["notes"]
    end = finite  # the diverged part is neither smoothed nor searched
    lowest = math.inf
    for i, value in enumerate(live):
        reason = divergence_reason(value, live[0], lowest, stop_factor)
        if reason:
            end = i
            out["divergence_lr"], out["divergence_reason"] = lrs[i], reason
            break
        lowest = min(lowest, value)
    if out["divergence_lr"] is None and finite < len(losses):
        out["divergence_lr"], out["divergence_reason"] = lrs[finite], "the loss is not finite"
    if end == 0:
        notes.append("the first step already diverged: lower --min-lr" if losses else "no step finished")
        return out
    # Forwards, then backwards: no lag (the kernel is symmetric), and still bias-corrected at both ends.
    smoothed = ema(ema([float(x) for x in losses[:end]], beta)[::-1], beta)[::-1]
    out["smoothed"] = smoothed
    i_min = min(range(end), key=lambda i: smoothed[i])
    out["min_loss"], out["min_loss_lr"] = smoothed[i_min], lrs[i_min]
    out["min_loss_lr_over_10"] = lrs[i_min] / 10
    # The steepest descent before the minimum, as the slope across 2h points (h: half the
    # average's own span), so a single noisy step or a spike's decay does not decide it. The
    # first points are skipped: the range's start is not a learning rate anyone wants.
    start = min(max(1, end // 20), i_min)
    h = min(max(1, round(0.5 / (1.0 - beta))), (i_min - start) // 2)
    if h < 1:
        notes.append("the loss fell too early in the sweep to locate its steepest descent: lower --min-lr; "
                     "the minimum / 10 rule is the estimate")
        return out
    logs = [math.log(x) for x in lrs]
    slopes = {i: (smoothed[i + h] - smoothed[i - h]) / (logs[i + h] - logs[i - h])
              for i in range(start + h, i_min - h + 1)}
    steepest = min(slopes, key=slopes.get)
    if slopes[steepest] >= 0:
        notes.append("the smoothed loss never fell: the sweep is too short or the range too low (raise --max-lr)")
        return out
    out["suggested_lr"] = lrs[steepest]
    out["steepest_slope"] = slopes[steepest]
    if out["divergence_lr"] is None and i_min >= end - max(2, end // 20):
        notes.append("the loss was still falling at --max-lr: raise it to see where training diverges")
    return out


# --- the sweep in this process (any model) -----------------------------------------------------------------------

class _Diverged(Exception):
    """Raised from the loss function to end fit() once the sweep has diverged."""


class _LossRecorder:
    """The user's loss_fn, recording every step's loss (the mean of its micro-batches) and stopping
    the sweep once it diverges. Reading each loss is a host sync: a range test logs every step anyway."""

    def __init__(self, loss_fn, grad_accum: int, watch: DivergenceWatch):
        self.loss_fn, self.grad_accum, self.watch = loss_fn, grad_accum, watch
        self.losses: list[float] = []
        self._micro: list[float] = []

    def __call__(self, model, batch):
        loss = self.loss_fn(model, batch)
        self._micro.append(float(loss.detach().float().item()))
        if len(self._micro) == self.grad_accum:
            mean = sum(self._micro) / self.grad_accum
            self.losses.append(mean if math.isfinite(mean) else None)  # None: not finite (as metrics.jsonl's null)
            self._micro = []
            if self.watch.add(self.losses[-1]):
                raise _Diverged(self.watch.reason)
        return loss


def with_settings(cfg, settings: dict[str, Any]):
    """`cfg` with some `section.key` values replaced, validated as a loaded config is."""
    from slipstream.config.load import build_config, deep_merge

    data: dict[str, dict[str, Any]] = {}
    for key, value in settings.items():
        section, name = key.split(".", 1)
        data.setdefault(section, {})[name] = value
    return build_config(deep_merge(dataclasses.asdict(cfg), data))


def find_lr(model, train_data, loss_fn, config=None, *, steps: int = 100, min_lr: float = 1e-7, max_lr: float = 1.0,
            stop_factor: float = DEFAULT_STOP_FACTOR, run_dir: str | Path | None = None, collate_fn=None,
            tokens_per_batch: int | None = None) -> dict[str, Any]:
    """The range test on any model, in this process, with slipstream's Trainer (its optimizer,
    clipping, precision and data path as `config` sets them). The model is trained by the
    sweep: pass a fresh one (or a copy) and train the real run from the start.

    run_dir: where the sweep's run directory goes (kept); None: a temporary one, removed after.
    Returns suggest_lr's result plus the sweep's settings and why it stopped.
    """
    from slipstream.config.schema import Config
    from slipstream.train.trainer import Trainer

    check_sweep(steps, min_lr, max_lr, stop_factor)
    tmp = None if run_dir else tempfile.mkdtemp(prefix="slipstream-lr-")
    # The recorder reads every loss itself: the console and metrics.jsonl need only ten lines.
    settings = {**sweep_settings(steps, min_lr, max_lr), "logging.log_interval": max(1, steps // 10),
                "run.dir": str(run_dir or tmp)}
    cfg = with_settings(config or Config(), settings)
    beta = smoothing_beta(steps)
    recorder = _LossRecorder(loss_fn, cfg.train.grad_accum_steps, DivergenceWatch(beta, stop_factor))
    try:
        trainer = Trainer(model, train_data, recorder, config=cfg, collate_fn=collate_fn,
                          tokens_per_batch=tokens_per_batch)
        if trainer.parallel.world_size > 1:  # each rank would stop at its own step and leave the others waiting
            raise UserError("find_lr runs in one process; for a distributed sweep of the LM job use "
                            "`slipstream tune lr --nproc N`")
        stopped = ""
        try:
            trainer.fit()
        except _Diverged as e:
            stopped = str(e)
        except UserError as e:
            if "loss became" not in str(e):  # the trainer's own stop on a non-finite logged loss
                raise
            stopped = "the loss is not finite"
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return _result(recorder.losses, steps, min_lr, max_lr, beta, stop_factor, stopped)


def _result(losses: list[float | None], steps: int, min_lr: float, max_lr: float, beta: float, stop_factor: float,
            stopped: str) -> dict[str, Any]:
    lrs = sweep_lrs(steps, min_lr, max_lr)[:len(losses)]
    result = suggest_lr(lrs, losses, beta=beta, stop_factor=stop_factor)
    result.update({"steps": steps, "steps_run": len(losses), "min_lr": min_lr, "max_lr": max_lr,
                   "stopped_early": bool(stopped) and len(losses) < steps, "stop_reason": stopped})
    return result


# --- the sweep of the LM job (a `slipstream train` subprocess) -----------------------------------------------------

def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def _watch_sweep(command: list[str], out, err, metrics: Path, watch: DivergenceWatch,
                 losses: list[float | None]) -> subprocess.Popen:
    """Run the sweep's training, append each step's loss to `losses` as metrics.jsonl gets it, and
    stop the training once `watch` says the loss diverged (or on Ctrl-C / any error here)."""
    stale = _inode(metrics)  # an earlier run's file in a given run.dir, until the run moves it to history/
    # Its own session: stopping it stops every rank it started.
    proc = subprocess.Popen(command, stdout=out, stderr=err, env=train_env(), start_new_session=True)
    tail = MetricsTail(metrics)
    try:
        while True:
            running = proc.poll() is None
            records = tail.read() if _inode(metrics) != stale else []
            for record in records:
                if "loss" not in record or "val_loss" in record:
                    continue  # eval or checkpoint records
                losses.append(record["loss"])  # null: a non-finite loss
                if watch.add(record["loss"]):
                    return proc
            if not running and not records:  # ended, and everything it wrote is read
                return proc
            if running:
                time.sleep(POLL_S)
    finally:  # diverged, or Ctrl-C / any error here: never leave the training running
        if proc.poll() is None:
            stop_trial(proc)


def tune_lr(config_path: str, overrides: list[str], steps: int = 200, min_lr: float = 1e-7,
            max_lr: float = 1.0, nproc: int = 1, stop_factor: float = DEFAULT_STOP_FACTOR) -> dict[str, Any]:
    """The range test of the LM job: a `slipstream train` subprocess watched through its metrics.jsonl
    and stopped once the loss diverged. The run directory is run.dir when the config or an
    override sets one (kept), else a temporary one (removed)."""
    from slipstream.config import load_config

    if not config_path:
        raise UserError("tune lr needs --config FILE: the training config whose learning rate to sweep")
    check_sweep(steps, min_lr, max_lr, stop_factor)
    if nproc < 1:
        raise UserError(f"--nproc must be >= 1 (got {nproc})")
    settings = sweep_settings(steps, min_lr, max_lr)
    cfg = load_config(config_path, [*overrides, *(override(k, v) for k, v in settings.items())])  # bad input fails here
    work = Path(tempfile.mkdtemp(prefix="slipstream-tune-lr-"))
    run_dir = Path(cfg.run.dir).expanduser() if cfg.run.dir else work / "run"
    args = ["--config", str(config_path), *overrides,
            *(override(k, v) for k, v in settings.items()), f"--run.dir={run_dir}"]
    beta = smoothing_beta(steps)
    watch = DivergenceWatch(beta, stop_factor)
    losses: list[float | None] = []
    failed = ""
    err_path = work / "train.stderr"
    try:
        with open(work / "train.stdout", "wb") as out, open(err_path, "wb") as err:
            proc = _watch_sweep(train_command(args, nproc), out, err, run_dir / "metrics.jsonl", watch, losses)
    except BaseException:  # Ctrl-C or an error while watching (the training is stopped): no temporary files stay
        shutil.rmtree(work, ignore_errors=True)
        raise
    stopped = watch.reason
    code = proc.returncode
    if not stopped and code != 0:
        reason = failure_reason(err_path.read_text(errors="replace"), code)
        if "loss became" in reason:  # the trainer stops itself on a non-finite loss: a divergence
            stopped = "the loss is not finite"
        else:
            failed = f"{reason} (logs: {err_path})"
    if failed or not losses:
        raise UserError(f"the range test's training failed: {failed or 'it logged no step'}")
    shutil.rmtree(work, ignore_errors=True)  # the logs (and a temporary run directory): the result holds the curve
    result = _result(losses, steps, min_lr, max_lr, beta, stop_factor, stopped)
    result.update({"config": config_path, "overrides": list(overrides), "nproc": nproc,
                   "run_dir": str(run_dir) if cfg.run.dir else None})
    return result


# --- output -------------------------------------------------------------------------------------------------------

def format_lr_report(result: dict[str, Any]) -> str:
    """The text report: the sweep, the suggestion, the two other readings, and the notes."""
    def lr(x):
        return "-" if x is None else f"{x:.3g}"

    lines = [f"lr range test: {result['steps_run']} of {result['steps']} steps, lr {result['min_lr']:.3g} -> "
             f"{result['max_lr']:.3g} (exponential)"
             + (f"; stopped early: {result['stop_reason']}" if result.get("stopped_early") else "")]
    if result.get("min_loss") is not None:
        lines.append(f"  lowest smoothed loss   {result['min_loss']:.4g} at lr {lr(result['min_loss_lr'])}")
    lines.append(f"  steepest descent       lr {lr(result.get('suggested_lr'))}   <- suggested optim.lr")
    lines.append(f"  minimum / 10           lr {lr(result.get('min_loss_lr_over_10'))}")
    lines.append(f"  divergence             lr {lr(result.get('divergence_lr'))}"
                 + (f" ({result['divergence_reason']})" if result.get("divergence_reason") else ""))
    lines += [f"note: {n}" for n in result.get("notes", [])]
    best = result.get("suggested_lr") or result.get("min_loss_lr_over_10")
    if best:
        lines.append(f"train with --optim.lr={best:.3g} (and a warmup: optim.warmup_steps)")
    return "\n".join(lines)


def plot_lr_sweep(result: dict[str, Any], path: str | Path) -> Path:
    """The loss vs lr (log x) with the smoothed curve and the suggestion marked, as a PNG written
    atomically (a temporary file, then a rename)."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    path = Path(path)
    fig, ax = plt.subplots(figsize=(7, 4.2))
    n = len(result["smoothed"])
    raw = [(x, y) for x, y in zip(result["lrs"], result["losses"]) if y is not None and math.isfinite(y)]
    if raw:
        ax.plot(*zip(*raw), color="#bbbbbb", linewidth=0.8, label="loss")
    if n:
        ax.plot(result["lrs"][:n], result["smoothed"], color="#1f4e9c", linewidth=1.8, label="smoothed loss")
    marks = (("suggested_lr", "#d62728", "steepest descent"), ("min_loss_lr_over_10", "#2ca02c", "minimum / 10"),
             ("divergence_lr", "#7f7f7f", "divergence"))
    for key, color, label in marks:
        if result.get(key):
            ax.axvline(result[key], color=color, linestyle="--", linewidth=1.2, label=f"{label}: {result[key]:.3g}")
    ax.set_xscale("log")
    ax.set_xlabel("learning rate")
    ax.set_ylabel("training loss")
    if n and result["smoothed"][0] > 0:  # the diverged tail would flatten the interesting part
        low, top = min(result["smoothed"]), 1.25 * result["smoothed"][0]
        ax.set_ylim(low - 0.05 * (top - low), top)
    ax.set_title(f"lr range test: {result['steps_run']} steps")
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp.png")
    try:
        fig.savefig(tmp, dpi=110, format="png")
        tmp.replace(path)
    finally:
        plt.close(fig)
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return path
