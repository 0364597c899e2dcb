"""Model FLOPs utilization: achieved training FLOP/s over the device peak.

The parameter counts and FLOPs per token it divides by are in slipstream.models.flops, the one
source of truth the planner uses too.
"""

from __future__ import annotations


def mfu(tokens_per_s: float, flops_per_tok: float, peak_flops: float | None) -> float | None:
    """Model FLOPs utilization in [0, 1]; None when the device peak is unknown."""
    if not peak_flops:
        return None
    return tokens_per_s * flops_per_tok / peak_flops
