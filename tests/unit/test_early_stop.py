"""Early stopping (train.early_stop_patience / early_stop_min_delta): the loop stops at the
evaluation that exhausts the patience, writes its final checkpoint and says why, and a resumed
run keeps the decision."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream import Trainer
from slipstream.checkpoint import manager as ckpt
from slipstream.config import load_config
from slipstream.config.schema import TrainConfig
from slipstream.errors import UserError
from slipstream.train.early_stop import EarlyStopping


def _data(n=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    return torch.utils.data.TensorDataset(x, x.sum(dim=1, keepdim=True))


class PlantedValLoss:
    """Training loss: real MSE. Validation loss: the next value of a planted sequence per evaluation
    (the model is in eval mode then), so the plateau is exactly where the test puts it."""

    def __init__(self, val_losses):
        self.val_losses, self.evaluations = list(val_losses), 0

    def __call__(self, model, batch):
        x, y = batch
        if model.training:
            return F.mse_loss(model(x), y)
        value = self.val_losses[min(self.evaluations, len(self.val_losses) - 1)]
        return model(x).sum() * 0 + value

    def next_evaluation(self):  # one evaluation reads eval_steps = 1 batch
        self.evaluations += 1


def _fit(tmp_path, val_losses, patience, min_delta=0.0, max_steps=40, resume="none", extra=()):
    cfg = load_config(None, [f"--run.dir={tmp_path}", f"--train.max_steps={max_steps}", "--train.micro_batch_size=8",
                             "--train.eval_interval=2", "--train.eval_steps=1", "--logging.log_interval=3",
                             "--logging.progress=false", "--optim.warmup_steps=0", f"--checkpoint.resume={resume}",
                             f"--train.early_stop_patience={patience}", f"--train.early_stop_min_delta={min_delta}",
                             *extra])
    loss = PlantedValLoss(val_losses)
    model = nn.Linear(4, 1)
    real_eval = Trainer.evaluate

    def counting_eval(self):
        result = real_eval(self)
        loss.next_evaluation()
        return result

    trainer = Trainer(model, _data(), loss, config=cfg, val_data=_data(16, seed=1))
    trainer.evaluate = counting_eval.__get__(trainer)
    return trainer.fit()


def _records(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def test_stops_at_the_planted_plateau_with_checkpoint_and_reason(tmp_path):
    # Evaluations at steps 2, 4, 6, ...: improvements until step 6, then a plateau. Patience 3:
    # steps 8, 10, 12 do not improve -> stop after step 12, not at max_steps 40.
    summary = _fit(tmp_path, [5.0, 4.0, 3.0, 3.0, 3.0, 3.0, 3.0], patience=3)
    assert summary["steps"] == 12
    assert summary["stopped_early"]["step"] == 12
    assert summary["stopped_early"]["best_step"] == 6 and summary["stopped_early"]["best_val_loss"] == 3.0
    assert "3 evaluation(s)" in summary["stopped_early"]["reason"]
    saved = json.loads((tmp_path / "summary.json").read_text())
    assert saved["stopped_early"]["step"] == 12
    records = _records(tmp_path)
    # The interval that ends at the stop (steps 10-12, log_interval 3 logs at 3, 6, 9) is logged too.
    assert max(r["step"] for r in records if "loss" in r) == 12
    assert [r["step"] for r in records if "val_loss" in r] == [2, 4, 6, 8, 10, 12]
    assert ckpt.resolve_checkpoint(tmp_path).name.endswith("12")  # the final checkpoint, as at max_steps


def test_min_delta_counts_small_gains_as_no_improvement(tmp_path):
    # 4.95 and 4.9 are within min_delta 0.2 of the best 5.0: two bad evaluations -> stop at step 6.
    summary = _fit(tmp_path / "a", [5.0, 4.95, 4.9, 1.0], patience=2, min_delta=0.2)
    assert summary["stopped_early"]["step"] == 6
    # Without min_delta the same losses are improvements: no early stop before the 1.0 plateau ends it.
    summary = _fit(tmp_path / "b", [5.0, 4.95, 4.9, 1.0], patience=2)
    assert summary["stopped_early"]["step"] == 12 and summary["stopped_early"]["best_step"] == 8


def test_no_patience_never_stops(tmp_path):
    summary = _fit(tmp_path, [3.0] * 30, patience=0, max_steps=10)
    assert summary["steps"] == 10 and "stopped_early" not in summary


def test_resumed_run_keeps_the_decision(tmp_path):
    _fit(tmp_path, [5.0, 4.0, 4.0, 4.0], patience=2)  # stops at step 8
    again = _fit(tmp_path, [1.0], patience=2, resume="auto")  # restored state: already stopped
    assert again["steps"] == 8 and again["steps_this_run"] == 0
    assert again["stopped_early"]["best_step"] == 4


def test_a_rollback_forgets_the_evaluations_of_the_weights_it_throws_away(tmp_path, monkeypatch):
    """Evaluations at 2, 4, ...: best 3.0 at step 6, no gain at 8 (saved in the step-8 checkpoint)
    and 10. Step 10's loss is NaN: the guard rolls back to step 8, but step 10's evaluation had
    already used up the patience, so the run ended at step 8 "stopped early at step 10". Restored
    to the checkpoint's count instead, the replayed steps improve and the run trains to the end."""
    monkeypatch.setenv("SLIPSTREAM_INJECT_FAULT", "nan@10")
    summary = _fit(tmp_path, [5.0, 4.0, 3.0, 3.5, 3.5, 2.0, 1.0, 0.5, 0.25], patience=2, max_steps=16,
                   extra=["--stability.policy=rollback", "--checkpoint.interval=4"])
    assert summary["steps"] == 16 and "stopped_early" not in summary, summary.get("stopped_early")
    records = _records(tmp_path)
    assert any(r.get("guard_event") == "nonfinite_loss" for r in records)  # the rollback did happen
    assert [r["val_loss"] for r in records if "val_loss" in r][-1] == 0.25


def test_a_nan_first_val_loss_is_never_the_best():
    """The first evaluation's NaN became "the best", which no later loss could beat: the run
    stopped after `patience` evaluations however well it trained."""
    stop = EarlyStopping(TrainConfig(early_stop_patience=2, max_steps=100))
    assert not stop.update(math.nan, 2)
    assert not stop.update(3.0, 4) and (stop.best, stop.best_step, stop.bad_evals) == (3.0, 4, 0)
    never = EarlyStopping(TrainConfig(early_stop_patience=2, max_steps=100))
    assert not never.update(math.nan, 2) and never.update(math.inf, 4)
    assert never.summary()["best_val_loss"] is None and "no finite val loss" in never.reason()


def test_patience_used_up_at_the_last_step_is_no_early_stop():
    """The evaluation at train.max_steps ends the run anyway: it is no early stop (the summary said
    it was), and a resumed run with more steps is not stopped before it trains."""
    stop = EarlyStopping(TrainConfig(early_stop_patience=1, max_steps=10))
    assert not stop.update(2.0, 5) and not stop.update(2.0, 10)
    assert stop.summary() is None and stop.bad_evals == 1
    longer = EarlyStopping(TrainConfig(early_stop_patience=1, max_steps=20))
    longer.load_state_dict(stop.state_dict())
    assert not longer.stopped and longer.update(2.0, 15) and longer.summary()["step"] == 15


def test_counter_and_state_round_trip():
    stop = EarlyStopping(TrainConfig(early_stop_patience=2, early_stop_min_delta=0.0))
    assert not stop.update(2.0, 10)
    assert not stop.update(math.nan, 20)  # a NaN val loss is never an improvement
    restored = EarlyStopping(TrainConfig(early_stop_patience=2))
    restored.load_state_dict(json.loads(json.dumps(stop.state_dict())))  # JSON, as in checkpoints
    assert restored.update(2.5, 30) and restored.summary()["step"] == 30 and restored.summary()["best_step"] == 10


@pytest.mark.parametrize("off", ["--train.eval_interval=0", "--train.eval_steps=0", "--train.eval_tokens=0"])
def test_patience_without_evaluation_is_a_clear_error(off):
    with pytest.raises(UserError, match="early_stop_patience = 2 watches the val loss"):
        load_config(None, ["--train.early_stop_patience=2", off])


def test_target_val_loss_stops_at_the_first_evaluation_at_or_below_it(tmp_path):
    # Evaluations at steps 2, 4, 6, 8: 5.0, 4.0, 2.5 (<= 3.0: the target), ... -> stop after step 6.
    summary = _fit(tmp_path, [5.0, 4.0, 2.5, 2.0, 1.0], patience=0, extra=["--train.target_val_loss=3.0"])
    assert summary["steps"] == 6
    stopped = summary["stopped_early"]
    assert stopped["target_reached"] is True and stopped["step"] == 6 and stopped["best_val_loss"] == 2.5
    assert "reached the target 3" in stopped["reason"]
    # never reached: the run goes to max_steps and the summary has no stop
    never = _fit(tmp_path / "never", [5.0, 4.0, 3.5], patience=0, max_steps=8, extra=["--train.target_val_loss=3.0"])
    assert never["steps"] == 8 and "stopped_early" not in never


def test_target_val_loss_needs_periodic_evaluation():
    with pytest.raises(UserError, match="target_val_loss"):
        load_config(None, ["--train.target_val_loss=2.0", "--train.eval_interval=0"])


def test_target_state_travels_in_checkpoints():
    stop = EarlyStopping(TrainConfig(target_val_loss=2.0, max_steps=100))
    assert not stop.update(2.5, 10) and stop.update(float("nan"), 20) is False and stop.update(1.9, 30)
    restored = EarlyStopping(TrainConfig(target_val_loss=2.0, max_steps=100))
    restored.load_state_dict(stop.state_dict())
    assert restored.stopped and restored.target_reached_at == 30 and restored.summary()["target_reached"]
