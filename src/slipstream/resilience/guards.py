"""NaN/Inf and loss-spike guards: decide per step whether to keep, skip or roll back an update.

Pure Python on host floats: the trainer syncs one small tensor (loss, grad norm) per step and
calls `StabilityGuard.check`. Nothing here touches the model; the trainer acts on the decision.

Spike rule (robust to noise and to the loss trend). Over the last `window` accepted losses,
with median `med` and median absolute deviation `MAD`:

    spike  if  loss - med > threshold * max(1.4826 * MAD, rel_floor * |med|)

1.4826 * MAD estimates the standard deviation of Gaussian noise without being inflated by
outliers, so `threshold` reads as "robust standard deviations above the median". The relative
floor keeps a very smooth curve (MAD near 0) from flagging tiny wiggles: with the defaults a
loss must also be at least 30% above the median. Only upward jumps count; a falling loss is
progress. Spikes and non-finite losses never enter the history, so a spike cannot raise the
median and hide the next one.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from slipstream.errors import UserError

POLICIES = ("none", "skip", "rollback", "stop")
MAD_TO_STD = 1.4826  # 1 / Phi^-1(3/4): makes the MAD a consistent estimate of a Gaussian's std.
MAX_KEPT_EVENTS = 100  # events kept in state_dict; the count itself is never truncated.


def _finite_or_str(x: float | None) -> float | str | None:
    """JSON has no NaN/Inf; strings like "nan" round-trip through float()."""
    return x if x is None or math.isfinite(x) else str(x)


class SpikeDetector:
    """Flags a loss far above the recent median; see the module docstring for the rule."""

    def __init__(self, window: int = 50, threshold: float = 6.0, min_history: int = 10,
                 rel_floor: float = 0.05) -> None:
        if window < 3 or not 2 <= min_history <= window:
            raise UserError(f"spike detection needs window >= 3 and 2 <= min_history <= window "
                            f"(got window={window}, min_history={min_history})")
        if not threshold > 0 or not rel_floor >= 0:
            raise UserError(f"spike threshold must be > 0 and rel_floor >= 0 (got {threshold}, {rel_floor})")
        self.window, self.threshold, self.min_history, self.rel_floor = window, threshold, min_history, rel_floor
        self.history: deque[float] = deque(maxlen=window)

    def stats(self) -> tuple[float, float] | None:
        """(median, allowed excess above it), or None while the history is too short to judge."""
        if len(self.history) < self.min_history:
            return None
        med = statistics.median(self.history)
        mad = statistics.median(abs(x - med) for x in self.history)
        return med, self.threshold * max(MAD_TO_STD * mad, self.rel_floor * abs(med))

    def is_spike(self, loss: float) -> bool:
        """True for a finite loss above the rule's limit. Non-finite losses are NaN events, not spikes."""
        st = self.stats()
        return st is not None and math.isfinite(loss) and loss - st[0] > st[1]

    def update(self, loss: float) -> bool:
        """Judge `loss`, then add it to the history unless it is a spike or non-finite; returns is_spike."""
        spike = self.is_spike(loss)
        if not spike and math.isfinite(loss):
            self.history.append(float(loss))
        return spike

    def state_dict(self) -> dict[str, Any]:
        return {"history": list(self.history)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.history = deque((float(x) for x in state.get("history", [])), maxlen=self.window)


@dataclass
class GuardDecision:
    """What the trainer should do with this step's update.

    action: "ok" (apply), "skip" (drop this update), "rollback" (reload the last good checkpoint
    and skip the batches from `events[*]["batch_position"]`), "stop" (raise with `message`).
    events: what happened at this step (0 or 1 entries), for logging.
    """

    action: str = "ok"
    events: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.action == "ok"


class StabilityGuard:
    """Turns per-step loss/grad-norm into a `GuardDecision` according to `policy`.

    Policies: "none" records and reports events but never intervenes or stops (observe only);
    "skip" drops the update of a bad step; "rollback" asks for a reload of the last good
    checkpoint; "stop" lets the update through and only counts. Under every policy but "none",
    the `max_events`-th event turns into "stop": repeated trouble means something is wrong that
    skipping will not fix (bad data shard, too high LR, a real change in the loss level).

    At most one event per step, by priority non-finite loss > non-finite grad norm > spike, so
    `max_events` counts bad steps (a NaN loss usually brings a NaN grad norm with it).
    Spikes never enter the detector's history under any policy, so after a lasting jump in the
    loss level every step is an event: "none" logs each one, the others stop at `max_events`.

    On a rollback, keep this live object (do not load the guard state from the checkpoint):
    the event count must survive, or a deterministic failure would roll back forever.
    """

    def __init__(self, policy: str = "skip", max_events: int = 10, spike_threshold: float = 6.0,
                 window: int = 50, min_history: int = 10, rel_floor: float = 0.05) -> None:
        if policy not in POLICIES:
            raise UserError(f"unknown stability policy '{policy}'; use one of {', '.join(POLICIES)}")
        if max_events < 1:
            raise UserError(f"max_events must be >= 1 (got {max_events})")
        self.policy, self.max_events = policy, max_events
        self.detector = SpikeDetector(window, spike_threshold, min_history, rel_floor)
        self.num_events = 0
        self.events: list[dict[str, Any]] = []  # the most recent MAX_KEPT_EVENTS, for the run summary

    def check(self, step: int, loss: float, grad_norm: float | None = None,
              batch_position: Any = None) -> GuardDecision:
        """Judge one step. `grad_norm` may be None when it is not computed (then only the loss counts)."""
        loss = float(loss)
        gn = None if grad_norm is None else float(grad_norm)
        st = self.detector.stats()
        if not math.isfinite(loss):
            kind = "nonfinite_loss"
        elif gn is not None and not math.isfinite(gn):
            kind = "nonfinite_grad_norm"
        elif self.detector.is_spike(loss):
            kind = "spike"
        else:
            # Only clean steps teach the detector what normal looks like.
            self.detector.update(loss)
            return GuardDecision()
        event = {"step": int(step), "batch_position": batch_position, "kind": kind, "loss": loss,
                 "grad_norm": gn, "median": None if st is None else st[0], "policy": self.policy}
        self.num_events += 1
        self.events = (self.events + [event])[-MAX_KEPT_EVENTS:]
        if self.policy == "none":
            return GuardDecision("ok", [event])
        if self.num_events >= self.max_events:
            msg = (f"stopping: {self.num_events} unstable steps (max_events={self.max_events}); last: {kind} "
                   f"at step {step} (loss {loss:.4g}, grad norm {gn if gn is None else f'{gn:.4g}'}). "
                   "Lower the learning rate or raise warm-up, check the data around the logged batch "
                   "positions, or, if the loss legitimately changed level, raise the spike threshold.")
            return GuardDecision("stop", [event], msg)
        action = {"skip": "skip", "rollback": "rollback", "stop": "ok"}[self.policy]
        return GuardDecision(action, [event])

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable (non-finite floats become strings)."""
        events = [{k: (_finite_or_str(v) if isinstance(v, float) else v) for k, v in e.items()} for e in self.events]
        return {"num_events": self.num_events, "events": events, "detector": self.detector.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_events = int(state.get("num_events", 0))
        self.events = [{k: (float(v) if k in ("loss", "grad_norm", "median") and v is not None else v)
                        for k, v in e.items()} for e in state.get("events", [])]
        self.detector.load_state_dict(state.get("detector", {}))
