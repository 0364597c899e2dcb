"""Where the memory of one training step goes: per phase, and by what the bytes hold.

    report = measure_step_memory(model, optimizer,
                                 lambda: trainer.accumulate_gradients(it),
                                 trainer.optimizer_step, device)
    print(format_memory_report(report))
    logger.log({"step": step, **report.to_record()}, step)

The measured step is a real training step (same kernels, same results): call it in place
of the step it replaces. Measure a step after the first one (e.g. step 2): optimizers
create their state lazily inside the first `step()`, so the first step shows no
optimizer state in the forward and backward phases and under-reports the real peak.
`measure_step_memory` warns when it sees that happen.

How it measures. PyTorch's `MemTracker` (torch.distributed._tools.mem_tracker) is a
TorchDispatchMode: it sees every tensor op, records each new tensor storage once and
labels it (parameter, buffer, gradient, activation, temp, optimizer state, other). It
works on real CPU and CUDA tensors. We subclass it to also keep the peak per phase:

- forward:   ops inside `run_forward_backward` outside the autograd engine: the model's
             forward, the loss, and whatever else the callable does around them;
- backward:  ops the autograd engine runs (`loss.backward()`), including activation
             checkpointing's recomputation;
- optimizer: everything `run_optimizer_step` does (clipping, step, zero_grad).

With gradient accumulation the callable runs several forward/backward pairs; each op is
attributed to its own phase, a phase's peak is the highest over all its occurrences, and
its end bytes are those live when its last occurrence ended.

Methods. "mem_tracker" (CPU and every non-CUDA device): bytes are the storages the
tracker saw, so tensors created before the step and not owned by the model or the
optimizer (e.g. a batch already loaded) are not counted, nor are buffers that kernels
allocate internally without a tensor op. "cuda_stats" (CUDA): the phase peaks and end
bytes come from the caching allocator (`torch.cuda.max_memory_allocated`, reset at each
phase start), which counts everything, including kernel workspaces; the category
breakdown still comes from the tracker (`tracked_peak_bytes` is its total), and
`reserved_peak_bytes` is the allocator's reserved peak. Note that this resets CUDA's peak
statistics, so a `peak_memory_bytes` read afterwards only covers the time since.

Quirks of the tracker's labels, as measured on torch 2.13:
- Storages are counted once: tied weights, views and in-place results add no bytes.
- A tensor made before the step is counted from the first op that returns it or a view
  of it (e.g. `targets.view(-1)` in a loss): it then shows up as an activation.
- Tensors created in the forward phase are "activations", including the loss and any
  input moved or made inside the callable; tensors created in backward are "temp" until
  they become a parameter's .grad (then "gradients").
- Temporaries created inside `optimizer.step()` are counted as "optimizer_state" (fused
  AdamW makes none; the foreach and for-loop versions do); temporaries of gradient
  clipping, which runs outside `step()`, are counted as "activations".
- Our categories: parameters, gradients, optimizer_state and activations map one to
  one; "other" is the tracker's temp + buffers + other (model buffers, gradients of
  activations during backward, temporaries).

Memory snapshots for pytorch.org/memory_viz (`record_memory_history`) need CUDA: the CPU
allocator keeps no allocation history, so asking for one on CPU is a UserError.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn
from torch.distributed._tools.mem_tracker import MemTracker

from slipstream.errors import UserError
from slipstream.memtrack import PeakMemTracker

PHASES = ("forward", "backward", "optimizer")
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "other")

# MemTracker's reference-type names (the values of its _MemRefType enum) -> our categories.
_CATEGORY_OF_REFTYPE = {
    "Parameter": "parameters",
    "Gradient": "gradients",
    "Optstate": "optimizer_state",
    "Activation": "activations",
    "Buffer": "other",
    "Temp": "other",
    "Other": "other",
}


@dataclasses.dataclass
class MemoryReport:
    """Memory of one training step.

    phases: {"forward" | "backward" | "optimizer": {"peak_bytes", "end_bytes"}}: the highest
        bytes live during the phase and the bytes live when it ended (see the module doc
        for how each method counts).
    categories: {category: bytes} at the step's peak (the highest tracked total); they sum
        to tracked_peak_bytes.
    phase_categories: {phase: {"peak": {category: bytes}, "end": {category: bytes}}}, the
        breakdown at each phase's own tracked peak and end (e.g. all gradients exist at the
        end of backward, while the step's peak is often early in backward).
    """

    device: str
    method: str  # "mem_tracker" or "cuda_stats"
    peak_bytes: int
    tracked_peak_bytes: int
    phases: dict[str, dict[str, int]]
    categories: dict[str, int]
    phase_categories: dict[str, dict[str, dict[str, int]]]
    reserved_peak_bytes: int | None = None  # CUDA only

    def to_record(self) -> dict[str, Any]:
        """Flat keys for metrics.jsonl (all in bytes; categories at the step's peak)."""
        return {
            "mem_step_peak_bytes": self.peak_bytes,
            "mem_forward_peak_bytes": self.phases["forward"]["peak_bytes"],
            "mem_backward_peak_bytes": self.phases["backward"]["peak_bytes"],
            "mem_optimizer_peak_bytes": self.phases["optimizer"]["peak_bytes"],
            "mem_params_bytes": self.categories["parameters"],
            "mem_grads_bytes": self.categories["gradients"],
            "mem_optim_state_bytes": self.categories["optimizer_state"],
            "mem_activations_bytes": self.categories["activations"],
            "mem_other_bytes": self.categories["other"],
            "mem_reserved_peak_bytes": self.reserved_peak_bytes,
        }


@dataclasses.dataclass
class _PhaseStats:
    tracked_peak: int = 0
    peak_categories: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    end_categories: dict[str, int] = dataclasses.field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    # Allocator numbers, CUDA only.
    cuda_peak: int = 0
    cuda_end: int = 0
    cuda_reserved_peak: int = 0


def _normalize_device(device: str | torch.device) -> torch.device:
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        # Tensors report "cuda:N"; pin the index so snapshots and allocator stats agree.
        device = torch.device("cuda", torch.cuda.current_device())
    return device


class _StepMemTracker(PeakMemTracker):
    """MemTracker that also keeps the peak, and the breakdown at the peak, of each phase
    (without the stock per-module peaks, whose cost grows with depth squared: memtrack.py)."""

    def __init__(self, device: torch.device):
        super().__init__()
        self._device = device
        self._cuda = device.type == "cuda"
        self._section: str | None = None  # "forward_backward" or "optimizer" while a callable runs
        self._phase: str | None = None  # phase of the ops seen last
        self.stats = {phase: _PhaseStats() for phase in PHASES}

    # --- what is live now ---

    def _live_categories(self) -> dict[str, int]:
        """Bytes live on our device now, by category."""
        categories = dict.fromkeys(CATEGORIES, 0)
        # Read after every op: the tracker's own dict, not get_tracker_snapshot's deep copy of it.
        current = getattr(self, "_curr_mem_snap", None)
        current = self.get_tracker_snapshot("current") if current is None else current
        for dev, dev_snap in current.items():
            if dev.type != self._device.type or (self._device.index is not None and dev.index != self._device.index):
                continue
            for reftype, nbytes in dev_snap.items():
                name = getattr(reftype, "value", reftype)  # skips the snapshot's "Total" key
                if name in _CATEGORY_OF_REFTYPE:
                    categories[_CATEGORY_OF_REFTYPE[name]] += nbytes
        return categories

    # --- phases ---

    def _phase_now(self) -> str:
        if self._section == "optimizer":
            return "optimizer"
        # Inside loss.backward() the autograd engine runs a graph task; the same test is
        # what ModTracker uses for its is_bw flag.
        return "backward" if torch._C._current_graph_task_id() != -1 else "forward"

    def _note_live(self) -> None:
        live = self._live_categories()
        stats = self.stats[self._phase]
        total = sum(live.values())
        if total > stats.tracked_peak:
            stats.tracked_peak = total
            stats.peak_categories = live

    def _start_phase(self, phase: str) -> None:
        self._phase = phase
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(self._device)
        # A phase's peak is at least what is live when it starts.
        self._note_live()

    def _end_phase(self) -> None:
        stats = self.stats[self._phase]
        stats.end_categories = self._live_categories()
        if self._cuda:
            stats.cuda_peak = max(stats.cuda_peak, torch.cuda.max_memory_allocated(self._device))
            stats.cuda_reserved_peak = max(stats.cuda_reserved_peak, torch.cuda.max_memory_reserved(self._device))
            stats.cuda_end = torch.cuda.memory_allocated(self._device)
        self._phase = None

    @contextlib.contextmanager
    def section(self, name: str) -> Iterator[None]:
        """Run one of the step's callables; its ops are attributed to phases as they come."""
        self._section = name
        self._start_phase("forward" if name == "forward_backward" else "optimizer")
        try:
            yield
        finally:
            if self._phase is not None:
                self._end_phase()
            self._section = None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        if self._section is not None:
            phase = self._phase_now()
            if phase != self._phase:
                # The end of a phase is measured before the next phase's first op runs.
                self._end_phase()
                self._start_phase(phase)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if self._phase is not None:
            self._note_live()
        return out


@contextlib.contextmanager
def reset_tracker_per_top_level_forward(tracker: MemTracker) -> Iterator[None]:
    """MemTracker refuses a second forward of a top-level module within one tracking
    context ("multiple iterative calls"), which gradient accumulation does by design.
    Dropping that module's per-module stats before each of its top-level forwards lifts that;
    the memory accounting we read (live storages, peaks) is not per-module and is kept. Only the
    entries of the module about to run go: a pipeline rank runs several stages, and another
    stage's backward (which reads its own entries) may still be pending.

    Global hooks run in registration order, so these must be registered before the
    tracker is entered (its own global hooks then run after ours)."""
    depth = 0

    def pre_hook(module: nn.Module, args: Any) -> None:
        nonlocal depth
        if torch._C._current_graph_task_id() != -1:
            return  # a recomputation (activation checkpointing) inside backward
        if depth == 0:
            for submodule in module.modules():
                tracker.memory_tracking.pop(submodule, None)
        depth += 1

    def post_hook(module: nn.Module, args: Any, output: Any) -> None:
        nonlocal depth
        if torch._C._current_graph_task_id() == -1:
            depth = max(0, depth - 1)

    pre = nn.modules.module.register_module_forward_pre_hook(pre_hook)
    post = nn.modules.module.register_module_forward_hook(post_hook, always_call=True)
    try:
        yield
    finally:
        pre.remove()
        post.remove()


def measure_step_memory(model: nn.Module, optimizer: torch.optim.Optimizer | list[torch.optim.Optimizer],
                        run_forward_backward: Callable[[], Any], run_optimizer_step: Callable[[], Any],
                        device: str | torch.device) -> MemoryReport:
    """Run one training step (the two callables do the work) and report its memory.

    run_forward_backward: forward + backward over all micro-batches (e.g. the trainer's
        accumulate_gradients); run_optimizer_step: clip, step, schedule, zero_grad.
    Measure a step after the first (see the module doc); the return values of the
    callables are discarded, so have them store what the caller needs.
    """
    device = _normalize_device(device)
    # A list is accepted for optimizers made of several (the optimizer in backward).
    optimizers = list(optimizer) if isinstance(optimizer, (list, tuple)) else [optimizer]
    had_optimizer_state = any(opt.state for opt in optimizers)
    tracker = _StepMemTracker(device)
    # The model and optimizer exist before the step: register their tensors (parameters,
    # buffers, existing gradients, optimizer state) so they are counted from the start.
    tracker.track_external(model, *optimizers)
    with reset_tracker_per_top_level_forward(tracker), tracker:
        with tracker.section("forward_backward"):
            run_forward_backward()
        with tracker.section("optimizer"):
            run_optimizer_step()

    if not had_optimizer_state and any(opt.state for opt in optimizers):
        warnings.warn("measure_step_memory measured the optimizer's first step: its state was created during "
                      "the step, so the forward and backward phases show none. Measure a later step "
                      "(e.g. step 2) for the steady-state memory.", stacklevel=2)

    stats = tracker.stats
    peak_phase = max(PHASES, key=lambda phase: stats[phase].tracked_peak)
    tracked_peak = stats[peak_phase].tracked_peak
    if device.type == "cuda":
        method = "cuda_stats"
        phases = {p: {"peak_bytes": stats[p].cuda_peak, "end_bytes": stats[p].cuda_end} for p in PHASES}
        reserved: int | None = max(stats[p].cuda_reserved_peak for p in PHASES)
    else:
        method = "mem_tracker"
        phases = {p: {"peak_bytes": stats[p].tracked_peak, "end_bytes": sum(stats[p].end_categories.values())}
                  for p in PHASES}
        reserved = None
    return MemoryReport(
        device=str(device),
        method=method,
        peak_bytes=max(phase["peak_bytes"] for phase in phases.values()),
        tracked_peak_bytes=tracked_peak,
        phases=phases,
        categories=dict(stats[peak_phase].peak_categories),
        phase_categories={p: {"peak": dict(stats[p].peak_categories), "end": dict(stats[p].end_categories)}
                          for p in PHASES},
        reserved_peak_bytes=reserved,
    )


@contextlib.contextmanager
def record_memory_history(device: str | torch.device, path: str | Path, max_entries: int = 100000) -> Iterator[Path]:
    """Record CUDA allocator history in the block; on exit (also on an error, e.g. an
    out-of-memory one) write the snapshot pickle for pytorch.org/memory_viz to `path`.

    CUDA only: on any other device this raises UserError rather than silently writing
    nothing, because the caller explicitly asked for a snapshot file.
    """
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise UserError(f"memory snapshots need a CUDA device (the CUDA allocator records the history); the device "
                        f"is {device}. Use measure_step_memory for a per-phase breakdown on this device, "
                        "or run on a GPU")
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    device = _normalize_device(device)
    torch.cuda.memory._record_memory_history(max_entries=max_entries, device=device)
    try:
        yield path
    finally:
        try:
            torch.cuda.memory._dump_snapshot(str(path))
        finally:
            torch.cuda.memory._record_memory_history(enabled=None, device=device)


def format_memory_report(report: MemoryReport) -> str:
    """Two small plain-text tables: phase peaks, and the category breakdown at the peak."""
    from rich.console import Console
    from rich.table import Table

    from slipstream.observe.console import human_bytes

    phases = Table(title=f"step memory on {report.device} ({report.method})")
    phases.add_column("phase")
    phases.add_column("peak", justify="right")
    phases.add_column("live at end", justify="right")
    for phase in PHASES:
        phases.add_row(phase, human_bytes(report.phases[phase]["peak_bytes"]),
                       human_bytes(report.phases[phase]["end_bytes"]))
    phases.add_row("step", human_bytes(report.peak_bytes), "")
    if report.reserved_peak_bytes is not None:
        phases.add_row("reserved (allocator)", human_bytes(report.reserved_peak_bytes), "")

    categories = Table(title="at the peak")
    categories.add_column("category")
    categories.add_column("bytes", justify="right")
    categories.add_column("share", justify="right")
    total = max(report.tracked_peak_bytes, 1)
    for name in CATEGORIES:
        nbytes = report.categories[name]
        categories.add_row(name.replace("_", " "), human_bytes(nbytes), f"{100 * nbytes / total:.0f}%")

    buffer = io.StringIO()
    console = Console(file=buffer, width=80, color_system=None, force_terminal=False)
    console.print(phases)
    console.print(categories)
    return buffer.getvalue()
