"""Learning-rate schedules as multipliers of the peak lr (used through LambdaLR, so the
scheduler state is the standard `state_dict` of a torch scheduler)."""

from __future__ import annotations

import math

import torch

from slipstream.config.schema import OptimConfig


def lr_multiplier(step: int, cfg: OptimConfig, max_steps: int) -> float:
    """lr(step) / peak lr for the step about to be taken (step counts from 0)."""
    floor = cfg.min_lr / cfg.lr
    if cfg.schedule == "range_test":  # min_lr at the first step, lr at the last, equal ratios between
        return floor ** (1.0 - min(1.0, step / max(1, max_steps - 1)))
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.schedule == "constant":
        return 1.0
    if cfg.schedule == "cosine":
        span = max(1, max_steps - cfg.warmup_steps)
        progress = min(1.0, (step - cfg.warmup_steps) / span)
        return floor + (1.0 - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    # wsd: hold the peak, then decay linearly to min_lr over the last decay_fraction of training.
    decay_steps = max(1, round(cfg.decay_fraction * max_steps))
    decay_start = max(cfg.warmup_steps, max_steps - decay_steps)
    if step < decay_start:
        return 1.0
    progress = min(1.0, (step - decay_start + 1) / max(1, max_steps - decay_start))
    return 1.0 + (floor - 1.0) * progress


class _Multiplier:
    """A picklable-free callable: LambdaLR stores only plain state for it."""

    def __init__(self, cfg: OptimConfig, max_steps: int):
        self.cfg, self.max_steps = cfg, max_steps

    def __call__(self, step: int) -> float:
        return lr_multiplier(step, self.cfg, self.max_steps)


class MultiplierSchedule:
    """LambdaLR's behaviour for optimizers torch's schedulers refuse (not a torch Optimizer,
    e.g. the optimizer-in-backward): lr = base lr x multiplier(step) on every param group."""

    def __init__(self, optimizer, multiplier):
        self.optimizer, self.multiplier = optimizer, multiplier
        self.base_lrs = [group["lr"] for group in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = base * self.multiplier(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def state_dict(self) -> dict:
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        self.last_epoch, self.base_lrs = state["last_epoch"], list(state["base_lrs"])
        self._apply()


def build_scheduler(optimizer, cfg: OptimConfig, max_steps: int):
    if isinstance(optimizer, torch.optim.Optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, _Multiplier(cfg, max_steps))
    return MultiplierSchedule(optimizer, _Multiplier(cfg, max_steps))


def load_scheduler_state(scheduler, state: dict) -> None:
    """scheduler.load_state_dict, also from a run whose optimizer had another number of param groups
    (the groups follow the layout: device meshes in train.setup.param_groups, a pipeline stage's own
    parameters, and rank 0 saved the state). Groups may have different peaks (Muon's optim.muon_lr),
    so the saved per-group lists cannot be mapped onto other groups: this run's own peaks (from the
    config) are kept and the schedule continues from the checkpoint's step; the groups' current lrs
    came back with the optimizer's state."""
    groups = len(scheduler.optimizer.param_groups)
    state = dict(state)
    saved = state.get("base_lrs")
    if isinstance(saved, list) and len(saved) != groups:
        state["base_lrs"] = list(scheduler.base_lrs)
        state.pop("_last_lr", None)
        if isinstance(state.get("lr_lambdas"), list):
            state["lr_lambdas"] = [None] * groups
        scheduler.load_state_dict(state)
        if hasattr(scheduler, "_last_lr"):
            scheduler._last_lr = [group["lr"] for group in scheduler.optimizer.param_groups]
        return
    scheduler.load_state_dict(state)


def scheduler_state(scheduler) -> dict:
    """JSON-safe scheduler state (LambdaLR would otherwise include the callable's __dict__)."""
    state = scheduler.state_dict()
    if "lr_lambdas" in state:
        state["lr_lambdas"] = [None] * len(state["lr_lambdas"])
    return state
