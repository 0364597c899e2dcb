"""What TokenLoader (loader.py) and DatasetLoader (dataset_loader.py) share: the checks of
their sizes and rank, the check that a saved state belongs to this loader before resuming
from it, and the seed key their numpy generators take.
"""

from __future__ import annotations

import numpy as np

from slipstream.errors import UserError


def seed_key(seed: int) -> int:
    # numpy SeedSequence needs non-negative entropy; keep negative seeds distinct and valid.
    return int(seed) % 2**64


def check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
            raise UserError(f"{name}={value!r} must be a positive integer")


def check_rank(rank: int, world_size: int) -> None:
    check_positive(world_size=world_size)
    if not 0 <= rank < world_size:
        raise UserError(f"rank={rank} must be in [0, world_size={world_size})")


def check_state(kind: str, state: dict, expected: dict) -> None:
    """Refuse to resume from a state saved with different data settings: the batches would silently differ."""
    if not isinstance(state, dict) or state.get("kind") != kind:
        got = state.get("kind") if isinstance(state, dict) else type(state).__name__
        raise UserError(f"cannot load a {got!r} data loader state into a {kind}; the checkpoint belongs to a different kind of run")
    diffs = [f"{k}: saved {state.get(k)!r}, now {v!r}" for k, v in expected.items() if state.get(k) != v]
    if diffs:
        raise UserError(
            f"{kind} state does not match this loader ({'; '.join(diffs)}); resume with the same data "
            f"settings as the saved run, or start a fresh run"
        )
