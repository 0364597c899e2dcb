"""Console output: a live progress bar during training and a summary table at the end.

On a terminal the bar (rich) shows step count, elapsed time, ETA and the latest metrics;
rich redraws it from its own thread, so the training loop only records the step number.
When stdout is not a terminal (CI, cluster job logs, pipes) or the bar is disabled, we
print plain lines instead: progress-bar escape codes make log files unreadable.
"""

from __future__ import annotations

import io
import math
import time
from typing import Any

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)
from rich.table import Table

# Redraws per second of the bar. Low on purpose: the bar is for humans, and each redraw
# costs CPU time that a CPU training run would rather spend on the model.
REFRESH_PER_SECOND = 2


def human_bytes(n: float | None) -> str:
    """1536 -> '1.5 KiB' (binary units, as memory is counted)."""
    if n is None:
        return "n/a"
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"


def human_count(n: float | None) -> str:
    """1234 -> '1.23k', 5.6e9 -> '5.6B' (decimal units, as tokens and parameters are counted)."""
    if n is None:
        return "n/a"
    if isinstance(n, float) and not math.isfinite(n):
        return str(n)
    value = float(n)
    for suffix in ("", "k", "M", "B", "T"):
        # 999.5 and above would print as "1e+03" at 3 significant digits: move up a unit.
        if abs(value) < 999.5 or suffix == "T":
            break
        value /= 1000
    if suffix == "" and isinstance(n, int):
        return str(n)
    return f"{value:.3g}{suffix}"


def human_duration(seconds: float | None) -> str:
    """3723 -> '1h 02m 03s'."""
    if seconds is None or not math.isfinite(seconds):
        return "n/a"
    if seconds < 60:
        return f"{seconds:.1f}s"
    s = int(round(seconds))
    days, s = divmod(s, 86400)
    hours, s = divmod(s, 3600)
    minutes, s = divmod(s, 60)
    if days:
        return f"{days}d {hours:02d}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m {s:02d}s"
    return f"{minutes}m {s:02d}s"


def format_metrics(metrics: dict[str, Any]) -> str:
    """The few numbers worth watching live, from a training log record:
    {'loss': 3.21456, 'tokens_per_s': 123456.0, 'mfu': 0.41, 'lr': ...} -> 'loss 3.2146 | 123k tok/s | mfu 41.0%'.

    Other fields are left out on purpose (they are in the metric logs): the bar has one line.
    """
    parts = []
    if metrics.get("loss") is not None:
        parts.append(f"loss {metrics['loss']:.4f}")
    if metrics.get("val_loss") is not None:
        parts.append(f"val_loss {metrics['val_loss']:.4f}")
    if metrics.get("tokens_per_s") is not None:
        parts.append(f"{human_count(metrics['tokens_per_s'])} tok/s")
    if metrics.get("mfu") is not None:
        parts.append(f"mfu {100 * metrics['mfu']:.1f}%")
    if metrics.get("moe/imbalance_max") is not None:  # the worst MoE layer's max/mean expert load
        parts.append(f"moe imbalance {metrics['moe/imbalance_max']:.2f}")
    return " | ".join(parts)


class TrainProgress:
    """Progress display for the training loop.

    with TrainProgress(total_steps=1000) as progress:
        for step in range(1000):
            ...
            progress.advance(step + 1)
            if (step + 1) % log_interval == 0:
                progress.set_metrics({"loss": loss, "tokens_per_s": tps, "mfu": mfu})
            if (step + 1) % eval_interval == 0:
                progress.print_line(f"step {step + 1}: val_loss {val_loss:.4f}")

    On a terminal, set_metrics updates the text in the bar. Without a bar (not a terminal,
    or enabled=False) set_metrics prints one plain line instead, with step and ETA, so job
    logs still show progress. silent=True shows nothing at all (the other ranks of a job).
    """

    def __init__(self, total_steps: int, start_step: int = 0, enabled: bool = True, description: str = "train",
                 summary_every_s: float = 30.0, silent: bool = False):
        self.silent = silent
        self.total_steps = total_steps
        self.summary_every_s = summary_every_s
        self._last_summary = -math.inf
        self.start_step = start_step
        self.step = start_step
        self.description = description
        self.metrics_text = ""
        self._start_time = time.perf_counter()
        console = Console()
        self.use_bar = enabled and console.is_terminal and not silent
        self._progress: Progress | None = None
        if self.use_bar:
            self._progress = Progress(
                TextColumn("[bold]{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TextColumn("eta"),
                TimeRemainingColumn(),
                TextColumn("{task.fields[metrics]}"),
                console=console,
                refresh_per_second=REFRESH_PER_SECOND,
            )
            self._task = self._progress.add_task(description, total=total_steps, completed=start_step, metrics="")

    def __enter__(self) -> TrainProgress:
        self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def start(self) -> None:
        self._start_time = time.perf_counter()
        if self._progress is not None:
            self._progress.start()

    def advance(self, step: int) -> None:
        """Record that `step` steps are done. Called every step, so it only stores a number
        (no formatting, no device sync); rich's refresh thread does the drawing."""
        self.step = step
        if self._progress is not None:
            self._progress.update(self._task, completed=step)

    def eta_seconds(self) -> float | None:
        """Remaining time at the average speed since start(); None before the first step."""
        done = self.step - self.start_step
        if done <= 0:
            return None
        elapsed = time.perf_counter() - self._start_time
        return elapsed / done * max(self.total_steps - self.step, 0)

    def set_metrics(self, metrics: dict[str, Any]) -> None:
        """Show the latest loss, tokens/s and MFU (host numbers; call at the logging interval)."""
        self.metrics_text = format_metrics(metrics)
        parts = [f"{self.description} step {self.step}/{self.total_steps}"]
        if self.metrics_text:
            parts.append(self.metrics_text)
        parts.append(f"eta {human_duration(self.eta_seconds())}")
        line = " | ".join(parts)
        if self.silent:
            return
        if self._progress is None:
            print(line, flush=True)
            return
        self._progress.update(self._task, metrics=self.metrics_text)
        # The bar shows the latest numbers; a summary line every summary_every_s keeps a history.
        now = time.perf_counter()
        if now - self._last_summary >= self.summary_every_s or self.step >= self.total_steps:
            self._last_summary = now
            self._progress.console.print(line, markup=False, highlight=False)

    def print_line(self, text: str) -> None:
        """Print a line above the bar (or as a plain line when there is no bar)."""
        if self.silent:
            return
        if self._progress is not None:
            # markup=False: a line like "[step 100]" must not be parsed as rich markup.
            self._progress.console.print(text, markup=False, highlight=False)
        else:
            print(text, flush=True)

    def close(self) -> None:
        if self._progress is not None:
            self._progress.stop()


# Keys understood by format_summary, in display order, with how to show each value.
SUMMARY_FIELDS: list[tuple[str, str]] = [
    ("final_loss", "final loss"),
    ("val_loss", "val loss"),
    ("val_loss_stderr", "val std. error"),
    ("val_tokens", "val tokens"),
    ("steps", "steps"),
    ("tokens", "tokens"),
    ("tokens_per_s", "tokens/s"),
    ("mfu", "MFU"),
    ("mem_peak_bytes", "peak memory"),
    ("wall_time_s", "wall time"),
    ("run_dir", "run directory"),
    ("checkpoint", "checkpoint"),
    ("steps_this_run", "steps this run"),
    ("loop_time_s", "training time"),
    ("device", "device"),
]


def _format_summary_value(key: str, value: Any) -> str:
    if value is None:
        return "n/a"
    if key in ("final_loss", "val_loss", "val_loss_stderr"):
        return f"{value:.4f}"
    if key in ("tokens", "tokens_per_s", "val_tokens"):
        return human_count(value)
    if key == "mfu":
        return f"{100 * value:.1f}%"
    # By naming convention, for the listed keys and any extra ones alike.
    if key.endswith("_bytes"):
        return human_bytes(value)
    if key.endswith("_s"):
        return human_duration(value)
    if isinstance(value, bool):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _summary_rows(summary: dict[str, Any]) -> list[tuple[str, str]]:
    rows = [(label, _format_summary_value(key, summary.get(key))) for key, label in SUMMARY_FIELDS]
    known = {key for key, _ in SUMMARY_FIELDS}
    rows += [(key, _format_summary_value(key, v)) for key, v in summary.items() if key not in known]
    return rows


def _summary_table(rows: list[tuple[str, str]]) -> Table:
    table = Table(title="run summary", show_header=False)
    table.add_column("metric", style="bold")
    table.add_column("value", overflow="fold")
    for label, value in rows:
        table.add_row(label, value)
    return table


def format_summary(summary: dict[str, Any]) -> str:
    """The end-of-run summary table as plain text.

    Keys: final_loss, val_loss, steps, tokens, tokens_per_s, mfu (a fraction, 0.42 ->
    "42.0%"), mem_peak_bytes, wall_time_s, run_dir, checkpoint (the trainer's summary
    names). Missing or None values show as "n/a"; any other keys are appended as extra
    rows, "*_s" as durations and "*_bytes" in binary units.
    """
    rows = _summary_rows(summary)
    # Wide enough that paths are never wrapped: this text also goes into log files.
    width = max(80, max(len(label) + len(value) for label, value in rows) + 10)
    buffer = io.StringIO()
    Console(file=buffer, width=width, color_system=None, force_terminal=False).print(_summary_table(rows))
    return buffer.getvalue()


def print_summary(summary: dict[str, Any]) -> None:
    """Print the summary table: styled on a terminal, plain text otherwise."""
    console = Console()
    if console.is_terminal:
        console.print(_summary_table(_summary_rows(summary)))
    else:
        print(format_summary(summary), end="", flush=True)
