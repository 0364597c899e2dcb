"""Early stopping on the validation loss (`train.early_stop_patience`, `train.early_stop_min_delta`),
and stopping at a target (`train.target_val_loss`: the time-to-target runs of `bench suite`,
MLPerf style: the first evaluation at or below the target ends the run).

Training stops after `patience` evaluations in a row whose val loss did not go below the best
so far by more than `min_delta`. A non-finite val loss is never the best. The evaluation at
train.max_steps ends the run anyway: it is counted but is no early stop (a resumed run with more
steps stops at its next evaluation without improvement). The val loss is the all-reduced one, so
every rank takes the same decision without a collective of its own. The state (best loss, its
step, evaluations without improvement) travels in checkpoints: a resumed run counts on from where
it stopped, and a rollback goes back to the checkpoint's (its later evaluations were of weights
that were thrown away).
"""

from __future__ import annotations

import math
from typing import Any

from slipstream.config.schema import TrainConfig


class EarlyStopping:
    def __init__(self, cfg: TrainConfig) -> None:
        self.patience, self.min_delta = cfg.early_stop_patience, cfg.early_stop_min_delta
        self.max_steps = cfg.max_steps
        self.best: float | None = None
        self.best_step: int | None = None
        self.bad_evals = 0  # evaluations in a row without an improvement
        self.stopped_at: int | None = None
        self.target = cfg.target_val_loss
        self.target_reached_at: int | None = None  # the step of the first evaluation at or below the target

    @property
    def stopped(self) -> bool:
        return self.stopped_at is not None

    def update(self, val_loss: float, step: int) -> bool:
        """Record one evaluation; True when training must stop after this step."""
        if self.target and self.target_reached_at is None and math.isfinite(val_loss) and val_loss <= self.target:
            self.target_reached_at = self.stopped_at = step
            self.best, self.best_step = val_loss, step
            return True
        if not self.patience:
            return False
        if math.isfinite(val_loss) and (self.best is None or val_loss < self.best - self.min_delta):
            self.best, self.best_step, self.bad_evals = val_loss, step, 0
        else:
            self.bad_evals += 1
        if self.bad_evals >= self.patience and step < self.max_steps:
            self.stopped_at = step
        return self.stopped

    def reason(self) -> str:
        if self.target_reached_at is not None:
            return f"val loss {self.best:.4f} reached the target {self.target:g} at step {self.target_reached_at}"
        best = f"best {self.best:.4f} at step {self.best_step}" if self.best is not None else "no finite val loss"
        return f"val loss did not improve by more than {self.min_delta:g} for {self.patience} evaluation(s) ({best})"

    def summary(self) -> dict[str, Any] | None:
        """For summary.json: where and why the run stopped early (None when it did not)."""
        if not self.stopped:
            return None
        return {"step": self.stopped_at, "best_val_loss": self.best, "best_step": self.best_step,
                "reason": self.reason(), "target_reached": self.target_reached_at is not None}

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "best_step": self.best_step, "bad_evals": self.bad_evals,
                "stopped_at": self.stopped_at, "target_reached_at": self.target_reached_at}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state:  # checkpoints from before early stopping existed have none
            self.best, self.best_step = state["best"], state["best_step"]
            self.bad_evals, self.stopped_at = state["bad_evals"], state["stopped_at"]
            self.target_reached_at = state.get("target_reached_at")  # absent before target_val_loss existed
