"""PyTorch's MemTracker without its per-module peaks, which nothing in slipstream reads.

After every tensor op the stock `MemTracker` walks every module it has seen and updates the
peak of each active one: (modules x ops) work, so a step's cost grows with the square of the
depth. Measured on torch 2.13, a 36-layer toy transformer's tracked step took 107x its plain
step (7.2 s vs 68 ms; 24x at 4 layers), and a GPT-2 small step on fake tensors took 10 s.
`PeakMemTracker` keeps what slipstream reads (the bytes it tracks per category and the
whole-process "peak" snapshot) and drops the per-module walk.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker
from torch.distributed._tools.mod_tracker import ModTracker
from torch.utils._pytree import tree_map_only


class _LeafSafeModTracker(ModTracker):
    """ModTracker that does not hook leaf inputs. A pipeline stage's received activations are
    leaves that require grad; the zero-bubble schedules take their gradients with autograd.grad,
    which refuses the multi-grad hook ModTracker puts on a leaf ("A leaf node was passed to
    _will_engine_execute_node"). Hooking a detached view instead marks the same module as
    entered; only the backward-entry notice for that leaf is lost (its module is not a parent
    of any other op's backward)."""

    def _fw_pre_hook(self, mod, input):
        input = tree_map_only(torch.Tensor, lambda t: t.detach() if t.requires_grad and t.grad_fn is None else t, input)
        return super()._fw_pre_hook(mod, input)


class PeakMemTracker(MemTracker):
    """MemTracker keeping only the process-wide peak (see the module doc)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if hasattr(self, "_mod_tracker"):  # another torch's internals: keep its own
            self._mod_tracker = _LeafSafeModTracker()

    def _update_peak_stats(self, peak_state: Any) -> None:
        current = getattr(self, "_curr_mem_snap", None)
        peak = getattr(self, "_peak_mem", None)
        peak_snap = getattr(self, "_peak_mem_snap", None)
        if current is None or peak is None or peak_snap is None:  # another torch's internals: the stock way
            super()._update_peak_stats(peak_state)
            return
        for dev, dev_snap in current.items():
            total = dev_snap.get(_TOTAL_KEY, 0)
            if peak.get(dev, 0) < total:
                peak[dev] = total
                peak_snap[dev] = dict(dev_snap)
