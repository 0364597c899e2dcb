"""The run's memory measurements: the step-2 breakdown and the CUDA allocator snapshot.

- metrics.memory_breakdown: the second step this process runs is measured under the memory
  tracker (the optimizer state, created lazily by the first step, then exists as in every
  later step); its record carries the mem_* keys, and the summary the breakdown.
- metrics.memory_snapshot (CUDA): the allocator's history over steps 2-3, the steady state.
"""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Callable

import torch

from slipstream.config.schema import Config
from slipstream.observe.memprofile import format_memory_report, measure_step_memory, record_memory_history


class MemoryProbe:
    def __init__(self, cfg: Config, device: torch.device, start_step: int, snapshot_path: Path,
                 planned_peak_bytes: int | None = None, is_main: bool = True) -> None:
        self.device = device
        self.start_step = start_step
        self.max_steps = cfg.train.max_steps
        self.snapshot_path = snapshot_path
        self.snapshot_enabled = cfg.metrics.memory_snapshot
        self.planned_peak_bytes = planned_peak_bytes  # slipstream plan's prediction of the step peak
        self.report = None
        self._record: dict[str, Any] = {}
        self._snapshot: contextlib.ExitStack | None = None
        self.measure_at = start_step + 2 if cfg.metrics.memory_breakdown and start_step + 2 <= self.max_steps else None
        if self.measure_at is not None and cfg.compile.scope != "off":
            # The tracker is a dispatch mode: compiled code would not run under it (fullgraph
            # fails, otherwise the eager model is measured instead). Never report that.
            if is_main:
                print("note: metrics.memory_breakdown is skipped with torch.compile (its tracker would measure "
                      "the eager model); compare memory with --compile.scope=off")
            self.measure_at = None
        compiled_update = cfg.optim.state_dtype in ("int8", "int4") and cfg.optim.implementation != "for-loop"
        if self.measure_at is not None and compiled_update:
            # torchao's low-bit AdamW compiles its update (fullgraph): it cannot run under the tracker.
            if is_main:
                print(f"note: metrics.memory_breakdown is skipped with optim.state_dtype = {cfg.optim.state_dtype} "
                      "and its compiled update; measure with --optim.implementation=for-loop (the eager update)")
            self.measure_at = None

    def measures(self, step: int) -> bool:
        """Whether training step `step` (1-based) runs under the tracker."""
        return step == self.measure_at

    def measure(self, model, optimizers, forward_backward: Callable[[], None], optimizer_step: Callable[[], None]):
        """Run one step under the tracker (same math; the step is slower)."""
        self.report = measure_step_memory(model, optimizers, forward_backward, optimizer_step, self.device)
        self._record = self.report.to_record()

    def take_record(self) -> dict[str, Any]:
        """The measured step's mem_* keys, once, for the interval record that contains it."""
        record, self._record = self._record, {}
        return record

    def before_step(self, step: int) -> None:
        """step: the number of steps done so far."""
        if self.snapshot_enabled and step == self.start_step + 1:
            self._snapshot = contextlib.ExitStack()  # steps 2-3: the steady state, optimizer state included
            self._snapshot.enter_context(record_memory_history(self.device, self.snapshot_path))

    def after_step(self, step: int, progress) -> None:
        if self._snapshot is not None and step in (self.start_step + 3, self.max_steps):
            self.close()  # writes the snapshot file
            progress.print_line(f"memory snapshot: {self.snapshot_path} (open it at https://pytorch.org/memory_viz)")

    def close(self) -> None:
        if self._snapshot is not None:
            self._snapshot.close()
            self._snapshot = None

    def summary(self) -> dict[str, Any] | None:
        """The summary's `memory` entry; every run with a plan checks the planner (docs/planner.md)."""
        if self.report is None:
            return None
        r = self.report
        out = {"step": self.measure_at, "peak_bytes": r.peak_bytes, "phases": r.phases, "categories": r.categories,
               "method": r.method, "planned_peak_bytes": self.planned_peak_bytes}
        if self.planned_peak_bytes:
            out["planned_error"] = self.planned_peak_bytes / r.peak_bytes - 1
        return out

    def print_report(self) -> None:
        if self.report is None:
            return
        print(f"memory of training step {self.measure_at} (rank 0):")
        print(format_memory_report(self.report))
        if self.planned_peak_bytes:
            print(f"  planned by `slipstream plan`: {self.planned_peak_bytes / 2**20:.1f} MiB "
                  f"({self.planned_peak_bytes / self.report.peak_bytes - 1:+.1%} of the measured peak)")
