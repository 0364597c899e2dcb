"""The logging interval: what the loop sums between two logs, and the one host sync per log.

Two kinds of numbers live here:
- the interval sums (loss, steps, items, data wait, dropped steps): part of the training
  state, saved in checkpoints, so a resumed run logs exactly what the uninterrupted one does;
- the speed counters (steps and items this process timed, wall time without eval/checkpoint
  time): never restored, since a resumed interval may have started before the checkpoint.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class IntervalReading:
    """One log's worth of measurements (host values)."""

    mean_loss: float | None  # over the data-parallel ranks and the counted steps; None if a guard dropped all
    local_loss: float       # this rank's own mean
    step_time_s: float
    data_wait_s: float
    tokens_per_s: float     # the whole job's
    timed_items: int


class IntervalMeter:
    def __init__(self, device: torch.device, parallel) -> None:
        self.device = device
        self.parallel = parallel
        self.reset()
        # Timed wall time and items of this fit's finished intervals; eval, checkpoint and
        # profiler time (side time) is not step time. Set by start().
        self.train_time_s, self.train_items, self.side_time_s = 0.0, 0, 0.0
        self.start()

    def reset(self) -> None:
        """Start new interval sums. The loss stays a device tensor so the loop never waits on
        the device between logs."""
        self.loss_sum = torch.zeros((), device=self.device)
        self.steps, self.items, self.data_wait_s = 0, 0, 0.0
        self.dropped = 0  # steps whose update a stability guard dropped (their loss is an event)

    def start(self) -> None:
        """Start timing (at the top of the loop, after resume and set-up)."""
        self._timed_steps, self._timed_items = 0, 0
        self._interval_start = self._loop_start = time.perf_counter()
        self.side_time_s = 0.0
        self.train_time_s, self.train_items = 0.0, 0  # speed is per fit(): a second fit starts over

    def add(self, loss: torch.Tensor, items: int, data_wait_s: float, counted: bool = True) -> None:
        if counted:
            self.loss_sum += loss
        else:
            self.dropped += 1
        self.steps += 1
        self.items += items
        self.data_wait_s += data_wait_s
        self._timed_steps += 1
        self._timed_items += items

    def read(self) -> IntervalReading:
        """Close the interval: the one host-device sync of the loop (and, distributed, one all-reduce)."""
        counted = self.steps - self.dropped  # the guards' verdicts agree across ranks: the same on every rank
        local = self.loss_sum / max(1, counted)
        mean_loss = self.parallel.mean(local).item()  # all-reduce over ranks + host sync
        if counted == 0:  # every step of the interval was a guard event: there is no loss to report
            mean_loss = None
        now = time.perf_counter()
        elapsed = now - self._interval_start
        reading = IntervalReading(
            mean_loss=mean_loss, local_loss=local.item(),  # host sync (already synced above: free)
            step_time_s=elapsed / max(1, self._timed_steps), data_wait_s=self.data_wait_s / max(1, self.steps),
            tokens_per_s=self._timed_items / elapsed if elapsed > 0 else 0.0, timed_items=self._timed_items)
        self.train_time_s += elapsed
        self.train_items += self._timed_items
        self.reset()
        self._timed_steps, self._timed_items = 0, 0
        self._interval_start = now  # logging time counts towards the next interval
        return reading

    @contextlib.contextmanager
    def side_work(self):
        """Time inside this block (eval, checkpoint, writing a trace) is not step time."""
        start = time.perf_counter()
        try:
            yield
        finally:
            spent = time.perf_counter() - start
            self._interval_start += spent
            self.side_time_s += spent

    @property
    def loop_time_s(self) -> float:
        """Wall time of the loop so far without the side work."""
        return time.perf_counter() - self._loop_start - self.side_time_s

    @property
    def tokens_per_s(self) -> float | None:
        """Mean speed over every finished interval of this process."""
        return self.train_items / self.train_time_s if self.train_time_s > 0 else None

    # --- Stateful: the interval sums (checkpoint format of `trainer_state["interval"]`) ---

    def state_dict(self) -> dict[str, Any]:
        # A collective: the checkpoint stores the ranks' mean loss sum (one all-reduce + host sync).
        return {"loss_sum": self.parallel.mean(self.loss_sum).item(), "steps": self.steps,
                "items": self.items, "data_wait_s": self.data_wait_s, "dropped": self.dropped}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        self.reset()
        if not state:
            return
        self.loss_sum.fill_(state["loss_sum"])
        self.steps, self.items = state["steps"], state["items"]
        self.data_wait_s = state["data_wait_s"]
        self.dropped = state.get("dropped", 0)
