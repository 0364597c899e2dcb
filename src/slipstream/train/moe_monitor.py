"""What the training loop does for mixture-of-experts layers, and what it logs about them.

    start:          the balancing losses get the loop's loss scale per micro-batch
    after a step:   each layer moves its balancing bias (moe_bias_rate) from the step's counts
    at a log:       per layer: expert load (fractions), imbalance (max / mean), dropped share,
                    aux and z losses; the worst layer's imbalance (shown on the console)

The counts each layer keeps are the whole batch's already (the layers reduce them over the
data-parallel ranks); under a pipeline every stage holds other layers, so a log gathers them.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from slipstream.models.moe import MoE, moe_layers


class MoEMonitor:
    def __init__(self, layers: list[tuple[str, MoE]], parallel, loss_scale: float):
        self.layers = layers
        self.parallel = parallel
        for _, layer in layers:
            # Each micro-batch's loss is divided by the micro-batches per step before its backward;
            # the balancing losses, which start their gradient at their layer, are scaled alike.
            layer.aux_grad_scale = loss_scale

    @classmethod
    def attach(cls, model: nn.Module, parallel, micro_batches: int) -> MoEMonitor | None:
        """A monitor for the MoE layers this rank holds; None for a dense model. Under a pipeline
        a rank may hold none while another holds some: the monitor is made on every rank alike,
        since its log is a collective."""
        layers = moe_layers(model)
        anywhere = bool(layers) if parallel.world_size == 1 else any(parallel.gather(bool(layers)))
        return cls(layers, parallel, 1.0 / micro_batches) if anywhere else None

    def end_step(self) -> None:
        for _, layer in self.layers:
            layer.end_step()

    def interval_record(self) -> dict[str, Any]:
        """The log interval's MoE numbers (host syncs; a collective under torchrun)."""
        mine = {name: stats for name, layer in self.layers if (stats := layer.stats.take()) is not None}
        # Every rank's view (pipeline stages hold other layers; data-parallel ranks other tokens).
        views = self.parallel.gather(mine) if self.parallel.world_size > 1 else [mine]
        merged: dict[str, dict[str, Any]] = {}
        for name in sorted({n for view in views for n in view}, key=_block_order):
            seen = [view[name] for view in views if name in view]
            merged[name] = {key: _mean([s[key] for s in seen]) for key in seen[0]}
        record: dict[str, Any] = {}
        for name, stats in merged.items():
            for key, value in stats.items():
                record[f"moe/{name}/{key}"] = value
        if merged:
            record["moe/imbalance_max"] = max(s["imbalance"] for s in merged.values())
            record["moe/dropped"] = _mean([s["dropped"] for s in merged.values()])
            record["moe/aux_loss"] = _mean([s["aux_loss"] for s in merged.values()])
            record["moe/z_loss"] = _mean([s["z_loss"] for s in merged.values()])
        return record


def _block_order(name: str) -> tuple[int, str]:
    index = name.rsplit(".", 1)[-1]
    return (int(index), name) if index.isdigit() else (10**9, name)


def _mean(values: list[Any]) -> Any:
    if isinstance(values[0], list):  # per-expert loads: element-wise
        return [round(sum(column) / len(column), 6) for column in zip(*values)]
    return sum(values) / len(values)
