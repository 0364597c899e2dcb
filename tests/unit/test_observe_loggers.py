"""Tests for slipstream.observe.loggers; TensorBoard events are read back with tensorboard's reader."""

import json
import sys
import types

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from slipstream.errors import UserError
from slipstream.observe import loggers


def test_metric_tags():
    assert loggers.metric_tag("loss") == "train/loss"
    assert loggers.metric_tag("lr") == "train/lr"
    assert loggers.metric_tag("val_loss") == "val/loss"
    assert loggers.metric_tag("perf/mfu") == "perf/mfu"


def test_jsonl_logger_lines_parse(tmp_path):
    path = tmp_path / "run" / "metrics.jsonl"
    log = loggers.JsonlLogger(path)
    log.log({"step": 1, "loss": torch.tensor(2.5), "lr": np.float32(0.5), "tokens": np.int64(7)})
    log.log({"loss": float("nan"), "grad_norm": float("inf")}, step=2)
    # Flushed per record: readable before close.
    assert len(path.read_text().splitlines()) == 2
    log.close()
    log = loggers.JsonlLogger(path)  # reopening appends (resume)
    log.log({"step": 3, "loss": 1.0, "note": "resumed"})
    log.close()

    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert rows[0] == {"step": 1, "loss": 2.5, "lr": 0.5, "tokens": 7}
    assert rows[1] == {"step": 2, "loss": None, "grad_norm": None}
    assert rows[2]["note"] == "resumed"


def test_tensorboard_scalars_read_back(tmp_path):
    log = loggers.TensorBoardLogger(tmp_path / "tb")
    for step in range(5):
        record = {"step": step, "loss": 4.0 - 0.5 * step, "lr": 1e-3 * (step + 1), "phase": "warmup"}
        if step % 2 == 0:
            record["val_loss"] = 5.0 - step
        log.log(record, step)
    log.close()

    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert tags == {"train/loss", "train/lr", "val/loss"}  # no "step", no strings
    loss = events.Scalars("train/loss")
    assert [e.step for e in loss] == [0, 1, 2, 3, 4]
    assert [e.value for e in loss] == pytest.approx([4.0, 3.5, 3.0, 2.5, 2.0])
    assert [e.value for e in events.Scalars("train/lr")] == pytest.approx([1e-3, 2e-3, 3e-3, 4e-3, 5e-3])
    val = events.Scalars("val/loss")
    assert [(e.step, e.value) for e in val] == [(0, 5.0), (2, 3.0), (4, 1.0)]


def test_wandb_missing_is_a_user_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # makes `import wandb` raise ImportError
    with pytest.raises(UserError, match="pip install wandb"):
        loggers.WandbLogger("proj", "run", {"lr": 1e-3})


def test_wandb_logger_with_stand_in_module(monkeypatch, tmp_path):
    calls = {}

    class FakeRun:
        def log(self, metrics, step=None):
            calls.setdefault("log", []).append((metrics, step))

        def finish(self):
            calls["finish"] = True

    def init(**kwargs):
        calls["init"] = kwargs
        return FakeRun()

    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=init))
    log = loggers.WandbLogger("proj", "run-1", {"path": tmp_path}, dir=tmp_path / "wandb")
    log.log({"step": 10, "loss": 2.0, "val_loss": 2.5}, 10)
    log.close()
    assert calls["init"]["mode"] == "offline" and calls["init"]["name"] == "run-1"
    assert calls["init"]["config"] == {"path": str(tmp_path)}
    assert calls["log"] == [({"train/loss": 2.0, "val/loss": 2.5}, 10)]
    assert calls["finish"]


def test_multi_logger_fans_out_and_closes_all():
    class Recorder:
        def __init__(self, fail_close=False):
            self.records, self.closed, self.fail_close = [], False, fail_close

        def log(self, record, step=None):
            self.records.append((record, step))

        def close(self):
            self.closed = True
            if self.fail_close:
                raise RuntimeError("boom")

    a, b = Recorder(fail_close=True), Recorder()
    multi = loggers.MultiLogger([a, b])
    multi.log({"loss": 1.0}, 5)
    assert a.records == b.records == [({"loss": 1.0}, 5)]
    with pytest.raises(RuntimeError, match="boom"):
        multi.close()
    assert a.closed and b.closed
