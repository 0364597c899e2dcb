"""PeakMemTracker drops MemTracker's per-module peaks and must keep everything else it tracks."""

import torch
from torch.distributed._tools.mem_tracker import MemTracker

from slipstream.config.schema import ModelConfig
from slipstream.memtrack import PeakMemTracker
from slipstream.models.transformer import build_model, lm_loss


def _tracked_step(tracker_cls):
    torch.manual_seed(0)
    model = build_model(ModelConfig(n_layer=3, n_head=2, d_model=32, vocab_size=64, max_seq_len=16))
    optimizer = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, 64, (2, 16))
    lm_loss(model(x), x).backward()
    optimizer.step()
    optimizer.zero_grad()
    tracker = tracker_cls()
    tracker.track_external(model, optimizer)
    with tracker:
        loss = lm_loss(model(x), x)
        # Per-module stats live only while tracking: the whole model's peak within its forward.
        tracker.model_local_peak = tracker.memory_tracking[model].local_peak[torch.device("cpu")]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    return tracker


def _bytes(snapshot):
    return {str(dev): {getattr(k, "value", k): v for k, v in snap.items()} for dev, snap in snapshot.items()}


def test_peak_snapshot_equals_the_stock_tracker():
    stock, ours = _tracked_step(MemTracker), _tracked_step(PeakMemTracker)
    assert _bytes(ours.get_tracker_snapshot("peak")) == _bytes(stock.get_tracker_snapshot("peak"))
    assert _bytes(ours.get_tracker_snapshot("peak"))["cpu"]["Total"] > 0


def test_per_module_peaks_are_not_walked():
    """The point of the class: the stock tracker raises each active module's local peak after
    every op (cost modules x ops); ours leaves it at what was live when the module was entered."""
    stock, ours = _tracked_step(MemTracker), _tracked_step(PeakMemTracker)
    assert stock.model_local_peak > ours.model_local_peak > 0
