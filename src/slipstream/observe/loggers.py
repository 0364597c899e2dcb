"""Metric loggers: JSON lines (always on), TensorBoard, Weights & Biases, and a fan-out.

A record is a flat dict of metrics for one step, e.g. {"step": 100, "loss": 3.2, "lr": 6e-4}.
Every logger has `log(record, step)` and `close()`. TensorBoard and wandb get tags
grouped by split: "loss" -> "train/loss", "val_loss" -> "val/loss", and a key that
already contains "/" is used as is.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Protocol

import torch

from slipstream.diskspace import disk_full_error, is_disk_full
from slipstream.errors import UserError
from slipstream.observe.env import to_jsonable


class Logger(Protocol):
    def log(self, record: dict[str, Any], step: int | None = None) -> None: ...

    def close(self) -> None: ...


def metric_tag(key: str) -> str:
    """TensorBoard/wandb tag for a record key."""
    if "/" in key:
        return key
    if key.startswith("val_"):
        return "val/" + key[len("val_") :]
    return "train/" + key


def _as_number(value: Any) -> float | None:
    """A Python number for a numeric scalar (incl. 1-element tensors, numpy scalars), else None."""
    if isinstance(value, bool):
        return None  # flags are not curves
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.dtype == torch.bool:
            return None
        value = value.item()
    elif type(value).__module__ == "numpy" and hasattr(value, "item") and getattr(value, "size", 1) == 1:
        value = value.item()
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value
    return None


def _numeric_items(record: dict[str, Any]) -> dict[str, float]:
    """Numeric fields of a record keyed by tag; the step itself is the x-axis, not a curve."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        number = _as_number(value)
        if number is not None:
            out[metric_tag(key)] = number
        elif isinstance(value, list) and value and all(_as_number(v) is not None for v in value):
            # A vector (an MoE layer's load per expert): one curve per entry, tag/0, tag/1, ...
            out.update({f"{metric_tag(key)}/{i}": _as_number(v) for i, v in enumerate(value)})
    return out


class JsonlLogger:
    """Appends one JSON object per line to `path`, flushed at once so a crash loses nothing.

    Non-finite floats (nan, inf) are written as null: bare NaN/Infinity are not valid
    JSON and break readers such as jq or JavaScript; pandas reads null back as NaN.
    Appending (not truncating) lets a resumed run continue the same file.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: every record reaches the OS at once (a killed process loses nothing), and a
        # failed write leaves no half line waiting in a buffer to be flushed later.
        self._file = open(self.path, "ab", buffering=0)

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        if step is not None and "step" not in record:
            record = {"step": step, **record}
        data = (json.dumps(to_jsonable(record), allow_nan=False) + "\n").encode("utf-8")
        good_size = self._file.tell()
        try:
            written = 0
            while written < len(data):  # a raw write may be partial
                written += self._file.write(data[written:])
        except OSError as e:
            os.ftruncate(self._file.fileno(), good_size)  # whole records only: a reader never sees half a line
            if is_disk_full(e):
                raise disk_full_error("the metrics", self.path, len(data),
                                      "the records logged before are intact") from None
            raise

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()


class TensorBoardLogger:
    """Writes every numeric field of a record as a TensorBoard scalar at `step`."""

    def __init__(self, log_dir: str | os.PathLike, flush_secs: int = 30, purge_step: int | None = None):
        """purge_step: on resume, hide events at steps >= it left by the interrupted run."""
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise UserError(
                f"TensorBoard logging is enabled but tensorboard is not importable ({e}). "
                "Run `pip install tensorboard` or disable TensorBoard logging."
            ) from e
        self.log_dir = Path(log_dir)
        self._writer = SummaryWriter(log_dir=str(self.log_dir), flush_secs=flush_secs, purge_step=purge_step)

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        if step is None:
            step = record.get("step")
        for tag, value in _numeric_items(record).items():
            self._writer.add_scalar(tag, value, global_step=step)

    def flush(self) -> None:
        self._writer.flush()

    def close(self) -> None:
        self._writer.flush()
        self._writer.close()


class WandbLogger:
    """Logs numeric fields to Weights & Biases. mode="offline" needs no network or account;
    sync later with `wandb sync <dir>`."""

    def __init__(
        self,
        project: str,
        run_name: str | None,
        config: dict[str, Any],
        mode: str = "offline",
        dir: str | os.PathLike | None = None,
    ):
        if mode not in ("online", "offline", "disabled"):
            raise UserError(f"wandb mode must be 'online', 'offline' or 'disabled', got {mode!r}.")
        try:
            import wandb
        except ImportError as e:
            raise UserError(
                "Weights & Biases logging is enabled but wandb is not installed. "
                "Run `pip install wandb` or disable wandb logging."
            ) from e
        if dir is not None:
            Path(dir).mkdir(parents=True, exist_ok=True)
        self._run = wandb.init(
            project=project,
            name=run_name,
            config=to_jsonable(config),
            mode=mode,
            dir=None if dir is None else str(dir),
        )

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        if step is None:
            step = record.get("step")
        self._run.log(_numeric_items(record), step=step)

    def close(self) -> None:
        self._run.finish()


class MultiLogger:
    """Sends each record to every logger; close() closes all of them even if one fails."""

    def __init__(self, loggers: list[Logger]):
        self.loggers = list(loggers)

    def log(self, record: dict[str, Any], step: int | None = None) -> None:
        for logger in self.loggers:
            logger.log(record, step)

    def close(self) -> None:
        first_error: BaseException | None = None
        for logger in self.loggers:
            try:
                logger.close()
            except Exception as e:  # keep closing the others, then report the first failure
                first_error = first_error or e
        if first_error is not None:
            raise first_error


class RunLoggers:
    """The training run's loggers: rank 0 writes metrics.jsonl, TensorBoard and W&B (other ranks
    nothing); with logging.rank_logs every rank also writes its own logs/rank<R>.jsonl (to find
    slow or diverging ranks). Keeps the last logged loss and the MFU of every interval."""

    def __init__(self, cfg, run_dir: Path, parallel, step: int, resumed: bool) -> None:
        import dataclasses

        self.rank_logger = None
        if cfg.logging.rank_logs and parallel.world_size > 1:
            (run_dir / "logs").mkdir(parents=True, exist_ok=True)
            self.rank_logger = JsonlLogger(run_dir / "logs" / f"rank{parallel.rank}.jsonl")
        loggers = []
        if parallel.is_main:
            loggers.append(JsonlLogger(run_dir / "metrics.jsonl"))
            if cfg.logging.tensorboard:
                loggers.append(TensorBoardLogger(run_dir / "tensorboard", purge_step=step + 1 if resumed else None))
            if cfg.logging.wandb:
                loggers.append(WandbLogger(project=cfg.logging.wandb_project, run_name=run_dir.name,
                                           config=dataclasses.asdict(cfg), mode=cfg.logging.wandb_mode,
                                           dir=str(run_dir)))
        self.job = MultiLogger(loggers)
        self.last_loss: float | None = None
        self._mfu: list[float] = []

    def log(self, record: dict[str, Any]) -> None:
        """An event of the job (eval result, checkpoint stall, guard event): rank 0's loggers."""
        self.job.log(record, record["step"])

    def log_interval(self, record: dict[str, Any], rank_view: dict[str, Any], progress) -> None:
        """An interval's record; the rank log gets it with this rank's own values (rank_view)."""
        self.job.log(record, record["step"])
        if self.rank_logger is not None:
            self.rank_logger.log({**record, **rank_view}, record["step"])
        progress.set_metrics(record)
        if record["loss"] is not None:  # None: a guard dropped every step of the interval
            self.last_loss = record["loss"]
        if record.get("mfu") is not None:
            self._mfu.append(record["mfu"])

    @property
    def mean_mfu(self) -> float | None:
        return sum(self._mfu) / len(self._mfu) if self._mfu else None

    def close(self) -> None:
        self.job.close()
        if self.rank_logger is not None:
            self.rank_logger.close()
