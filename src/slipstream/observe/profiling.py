"""Profiling a few training steps with torch.profiler: chrome traces, a top-ops table, named ranges.

This is the step profiler the Trainer drives (observe layer); `slipstream profile`, the tool
that runs a short profiled job, is slipstream.perf.profiling.profile_run.

The trainer drives a `StepProfiler` (config section `[profile]`):

    profiler = StepProfiler(cfg.profile, device, run_dir, rank=0)
    with profiler:                          # start() ... stop(), also on errors
        for each training step:
            with profiler.label("forward"):
                ...
            profiler.step()                 # after each step but the last

Schedule: the steps before `profile.start_step` are one warm-up step (profiler on, results
dropped: the first profiled iteration is always slow) preceded by plain waiting steps;
then `profile.steps` steps are recorded. Steps count from the first step this process
runs, so in a fresh run trainer step n is `ProfilerStep#<n-1>` in the trace.

Files (one set per rank):
    <run dir>/traces/rank<R>.json              chrome trace (uncompressed JSON: ui.perfetto.dev,
                                               chrome://tracing, `json.load`)
    <run dir>/memory_timeline_rank<R>.json     with profile.memory_timeline: memory by category
                                               over the profiled steps ([times, [sizes...]])
The memory timeline lives outside traces/ so that tools reading traces/*.json only find traces.

Label contract (trace analyzers rely on these names; `label()` adds the prefix):
    slipstream/data        waiting for the next batch
    slipstream/forward     the forward pass and the loss
    slipstream/backward    the backward pass
    slipstream/optimizer   clip + optimizer step + LR schedule + zero_grad
    slipstream/eval        an evaluation
plus torch's own `ProfilerStep#N` range around each profiled step.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from slipstream.config.schema import ProfileConfig
from slipstream.errors import UserError

LABEL_PREFIX = "slipstream/"
LABELS = ("data", "forward", "backward", "optimizer", "eval")


def trace_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / "traces" / f"rank{rank}.json"


def memory_timeline_path(run_dir: str | Path, rank: int) -> Path:
    return Path(run_dir) / f"memory_timeline_rank{rank}.json"


def current_rank() -> int:
    """This process's rank in the default process group; 0 when not distributed."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return 0


@contextlib.contextmanager
def label(name: str, nvtx: bool = False) -> Iterator[None]:
    """A `slipstream/<name>` range in the torch profiler trace and, with nvtx (CUDA only),
    in Nsight Systems. Not free (a dispatcher call or two): use it only while profiling."""
    full_name = LABEL_PREFIX + name
    with torch.profiler.record_function(full_name):
        if nvtx:
            with torch.cuda.nvtx.range(full_name):
                yield
        else:
            yield


class StepProfiler:
    """torch.profiler over a window of training steps; see the module doc for files and labels."""

    def __init__(self, cfg: ProfileConfig, device: torch.device, run_dir: str | Path, rank: int = 0):
        if cfg.nvtx and device.type != "cuda":
            raise UserError(f"profile.nvtx emits NVTX ranges for Nsight Systems, which needs CUDA; this run is on "
                            f"{device.type}. Use --profile.nvtx=false (the torch profiler trace has the same ranges)")
        self.cfg = cfg
        self.device = device
        self.rank = rank
        self.trace_file = trace_path(run_dir, rank)
        self.memory_timeline_file = memory_timeline_path(run_dir, rank) if cfg.memory_timeline else None
        self.trace_files: list[Path] = []  # written so far (one, once the window is recorded)
        self.key_averages: Any = None  # torch's per-op averages of the recorded steps
        self._prof: torch.profiler.profile | None = None
        self._steps_seen = 0
        # After this many steps the window (wait + warm-up + active) is over.
        self._window_end = cfg.start_step - 1 + cfg.steps

    @property
    def labels_active(self) -> bool:
        """True while the profiler runs: the trainer labels steps only then, so the rest of the
        run (and every unprofiled run) keeps its full speed."""
        return self._prof is not None

    def label(self, name: str):
        return label(name, nvtx=self.cfg.nvtx)

    def start(self) -> None:
        cfg = self.cfg
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        # torch's memory timeline is built from shapes, allocations and stacks: it needs all three.
        memory = cfg.memory_timeline
        schedule = torch.profiler.schedule(wait=cfg.start_step - 2, warmup=1, active=cfg.steps, repeat=1)
        self._prof = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._save,
            record_shapes=cfg.record_shapes or memory, profile_memory=cfg.profile_memory or memory,
            with_stack=cfg.with_stack or memory)
        self._prof.start()

    def step(self) -> None:
        """Call after each training step that another step follows; stop() ends the last one.
        (torch opens the next ProfilerStep range here: after the run's last step inside the
        window, that range would be recorded as an extra, empty step.)"""
        if self._prof is None:
            return
        self._prof.step()  # writes the trace (via _save) when it ends the last profiled step
        self._steps_seen += 1
        if self._steps_seen >= self._window_end:
            self.stop()  # release the profiler now: later steps run unobserved, at full speed

    def stop(self) -> None:
        """End profiling; a run that ends inside the window gets the steps recorded so far."""
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.stop()

    def __enter__(self) -> StepProfiler:
        self.start()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.stop()
            return
        # The run failed: still release the profiler (it is process-wide state), but never let a
        # failing trace export hide the real error.
        with contextlib.suppress(Exception):
            self.stop()

    def _save(self, prof: torch.profiler.profile) -> None:
        """on_trace_ready: the recorded window is complete."""
        self.trace_file.parent.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(self.trace_file))
        if self.trace_file not in self.trace_files:
            self.trace_files.append(self.trace_file)
        self.key_averages = prof.key_averages()
        if self.memory_timeline_file is not None:
            with warnings.catch_warnings():
                # Deprecated in favour of CUDA memory snapshots, which do not exist on CPU; this still works.
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(self.memory_timeline_file), device=self._memory_device())

    def _memory_device(self) -> str:
        if self.device.type == "cuda":
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            return f"cuda:{index}"
        return self.device.type

    def top_ops_table(self, n: int = 15) -> str:
        """The n most expensive ops of the recorded steps by self time (device time on CUDA)."""
        if self.key_averages is None:
            return ""
        sort_by = "self_device_time_total" if self.device.type == "cuda" else "self_cpu_time_total"
        return self.key_averages.table(sort_by=sort_by, row_limit=n)
