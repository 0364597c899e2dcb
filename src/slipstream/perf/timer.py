"""Trustworthy timing of a callable or a code region, on CPU or an accelerator.

Every benchmark times through this module so that all of them follow the same rules:

* Warm-up calls run first and are never counted (they pay for lazy init, allocator
  growth, autotuning and compilation).
* Accelerator work is asynchronous, so the clock must only be read after the device has
  finished. On CUDA we record a pair of `torch.cuda.Event`s around each call and
  synchronize once at the end, which times the GPU work without adding a host sync per
  call. On other accelerators we synchronize around every call and use `perf_counter`.
  On CPU we use `perf_counter` alone.
* We report the median (robust to a few outliers) together with the spread (IQR). When
  the spread is large relative to the median the number is not trustworthy, and we say
  so with a warning instead of silently printing it.
"""

from __future__ import annotations

import math
import statistics
import time
import warnings
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch

from slipstream.errors import UserError
from slipstream.observe.env import to_jsonable

METHOD_PERF_COUNTER = "perf_counter+sync"
METHOD_CUDA_EVENTS = "cuda_events"


class TimingSpreadWarning(UserWarning):
    """Timings varied too much between runs for their median to be trusted."""


@dataclass
class TimingResult:
    """The per-run samples of one timing and their summary statistics (all in seconds)."""

    samples: list[float]
    median: float
    mean: float
    min: float
    max: float
    iqr: float  # q75 - q25
    rel_iqr: float  # iqr / median
    warmup: int
    repeats: int
    device: str
    method: str  # METHOD_PERF_COUNTER or METHOD_CUDA_EVENTS
    spread_too_wide: bool

    @classmethod
    def from_samples(
        cls, samples: list[float], *, warmup: int, device: str, method: str, max_rel_iqr: float
    ) -> TimingResult:
        if not samples:
            raise ValueError("TimingResult needs at least one sample")
        samples = [float(s) for s in samples]
        if len(samples) >= 2:
            # "inclusive" treats the samples as the whole population, so the quartiles
            # always lie within [min, max] even for small repeat counts.
            q25, _, q75 = statistics.quantiles(samples, n=4, method="inclusive")
            iqr = q75 - q25
        else:
            iqr = 0.0
        median = statistics.median(samples)
        if median > 0:
            rel_iqr = iqr / median
        else:
            # Only possible for work below the clock's resolution; a zero spread is then
            # still "no spread", anything else cannot be related to the median.
            rel_iqr = 0.0 if iqr == 0 else math.inf
        return cls(
            samples=samples,
            median=median,
            mean=statistics.fmean(samples),
            min=min(samples),
            max=max(samples),
            iqr=iqr,
            rel_iqr=rel_iqr,
            warmup=warmup,
            repeats=len(samples),
            device=device,
            method=method,
            spread_too_wide=rel_iqr > max_rel_iqr,
        )

    def to_dict(self) -> dict[str, Any]:
        """A JSON-serialisable dict (a non-finite rel_iqr becomes None)."""
        return to_jsonable(asdict(self))

    def __str__(self) -> str:
        scale, unit = _unit_for(self.median)
        text = (
            f"{_fmt(self.median * scale)} {unit} median "
            f"(min {_fmt(self.min * scale)}, IQR {_fmt(self.iqr * scale)} {unit} = "
            f"{_percent(self.rel_iqr)}) over {self.repeats} runs"
        )
        if self.spread_too_wide:
            text += " [spread too wide to trust]"
        return text


def _unit_for(seconds: float) -> tuple[float, str]:
    """A scale and unit that print `seconds` as a number of a readable size."""
    if seconds >= 1.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "us"


def _fmt(value: float) -> str:
    # One decimal is enough for large numbers; small ones keep two so they are not "0.0".
    return f"{value:.1f}" if abs(value) >= 10 else f"{value:.2f}"


def _percent(fraction: float) -> str:
    return "inf%" if math.isinf(fraction) else f"{fraction * 100:.0f}%"


def _resolve_device(device: str | torch.device) -> torch.device:
    """Parse `device` and check that it is usable here, with a clear error if not."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise UserError(f"invalid device {device!r}: {exc}") from exc
    if dev.type == "cpu":
        return dev
    # torch.accelerator is device-generic, so checking it never touches torch.cuda on CPU.
    current = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if current is None or current.type != dev.type:
        found = current.type if current is not None else "none"
        raise UserError(f"device {str(dev)!r} is not available on this machine (accelerator: {found})")
    return dev


def _synchronize(dev: torch.device) -> None:
    """Wait until all queued work on `dev` has finished; a no-op on CPU."""
    if dev.type != "cpu":
        torch.accelerator.synchronize(dev)


def time_callable(
    fn: Callable[[], Any],
    *,
    warmup: int = 3,
    repeats: int = 20,
    device: str | torch.device = "cpu",
    max_rel_iqr: float = 0.1,
) -> TimingResult:
    """Time `fn()` `repeats` times after `warmup` untimed calls; return the samples and stats.

    Warns with a `TimingSpreadWarning` when IQR / median exceeds `max_rel_iqr`: the
    median is then not a number to compare or publish.
    """
    # bool is an int subclass; True as a repeat count is almost certainly a mistake.
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise UserError(f"warmup must be an integer >= 0, got {warmup!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise UserError(f"repeats must be an integer >= 1, got {repeats!r}")
    if not isinstance(max_rel_iqr, (int, float)) or math.isnan(max_rel_iqr) or max_rel_iqr < 0:
        raise UserError(f"max_rel_iqr must be a number >= 0, got {max_rel_iqr!r}")
    if not callable(fn):
        raise UserError(f"fn must be callable, got {type(fn).__name__}")
    dev = _resolve_device(device)

    for _ in range(warmup):
        fn()

    if dev.type == "cuda":
        samples = _time_cuda_events(fn, dev, repeats)
        method = METHOD_CUDA_EVENTS
    else:
        samples = _time_perf_counter(fn, dev, repeats)
        method = METHOD_PERF_COUNTER

    result = TimingResult.from_samples(
        samples, warmup=warmup, device=str(dev), method=method, max_rel_iqr=max_rel_iqr
    )
    if result.spread_too_wide:
        warnings.warn(
            f"timings spread too wide to trust: IQR is {_percent(result.rel_iqr)} of the median "
            f"(limit {_percent(max_rel_iqr)}); {result}. Close other work on the machine, "
            "raise warmup/repeats, or time a larger unit of work.",
            TimingSpreadWarning,
            stacklevel=2,
        )
    return result


def _time_perf_counter(fn: Callable[[], Any], dev: torch.device, repeats: int) -> list[float]:
    samples = []
    # Warm-up work may still be queued on an accelerator; it must not land in sample 0.
    _synchronize(dev)
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _synchronize(dev)
        samples.append(time.perf_counter() - start)
    return samples


def _time_cuda_events(fn: Callable[[], Any], dev: torch.device, repeats: int) -> list[float]:
    # Events are recorded on the current stream of the current device, so make `dev` current.
    with torch.cuda.device(dev):
        starts = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        ends = [torch.cuda.Event(enable_timing=True) for _ in range(repeats)]
        # Start from an idle device so queued warm-up work is not attributed to run 0.
        torch.cuda.synchronize(dev)
        for start, end in zip(starts, ends):
            start.record()
            fn()
            end.record()
        # One sync for all runs: a per-run host sync would add its own latency and idle
        # the GPU between runs, which is not how the work runs in training.
        torch.cuda.synchronize(dev)
        return [start.elapsed_time(end) / 1e3 for start, end in zip(starts, ends)]  # ms -> s


class Timer:
    """Time a code region: `with Timer("cuda") as t: ...` then read `t.elapsed_s`.

    On CUDA the region is bracketed by events and `__exit__` waits for the end event, so
    `elapsed_s` covers the GPU work queued inside the region. On other accelerators the
    device is synchronized on entry and exit; on CPU only `perf_counter` is read.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = _resolve_device(device)
        self._elapsed_s: float | None = None
        self._start_time = 0.0
        self._start_event: Any = None

    def __enter__(self) -> Timer:
        self._elapsed_s = None
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                self._start_event = torch.cuda.Event(enable_timing=True)
                self._start_event.record()
        else:
            _synchronize(self.device)
            self._start_time = time.perf_counter()
        return self

    def __exit__(self, *exc_info: Any) -> None:
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):
                end_event = torch.cuda.Event(enable_timing=True)
                end_event.record()
            end_event.synchronize()
            self._elapsed_s = self._start_event.elapsed_time(end_event) / 1e3  # ms -> s
        else:
            _synchronize(self.device)
            self._elapsed_s = time.perf_counter() - self._start_time

    @property
    def elapsed_s(self) -> float:
        """Seconds the region took; only available once the `with` block has exited."""
        if self._elapsed_s is None:
            raise RuntimeError("Timer.elapsed_s is only available after the `with` block exits")
        return self._elapsed_s
