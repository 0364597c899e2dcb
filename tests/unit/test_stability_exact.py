"""Stability policies do exactly what they promise (issue 12), in process, on the public Trainer.

Faults are injected with SLIPSTREAM_INJECT_FAULT (slipstream.resilience.runtime: `nan@K` poisons
the loss of step K, `spike@K` multiplies it by 100). The loss function records, at every
training call, the parameters the call sees (= the state before that step), the batch it got
and its loss, so the tests can compare states bitwise:
    skip      the parameters after a skipped step are those before it, exactly
    rollback  training continues from the last checkpoint's parameters, the loader keeps
              moving forward (the offending batches are never seen again)
    stop      the run ends with an error at the max_events-th event, at that step
"""

from __future__ import annotations

import json

import pytest
import torch

from slipstream import Trainer
from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.models.transformer import build_model, lm_loss

TINY = ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=16", "--train.micro_batch_size=2",
        "--train.eval_steps=0", "--logging.progress=false", "--logging.log_interval=1", "--logging.tensorboard=false",
        "--metrics.memory_breakdown=false", "--checkpoint.save_final=false", "--optim.warmup_steps=1",
        "--optim.lr=0.01", "--optim.schedule=constant", "--train.deterministic=true",
        "--resilience.watchdog_s=0"]  # constant LR: runs of different lengths take the same steps


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 64, (64, 17), generator=g)
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


class Recorder:
    """Loss function: per training call, the parameters it sees, its batch and its loss."""

    def __init__(self):
        self.params: list[torch.Tensor] = []
        self.batches: list[torch.Tensor] = []
        self.losses: list[float] = []

    def __call__(self, model, batch):
        loss = lm_loss(model(batch[0]), batch[1])
        if model.training:
            self.params.append(torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()]))
            self.batches.append(batch[0].clone())
            self.losses.append(loss.item())
        return loss


def _fit(tmp_path, monkeypatch, steps, fault="", *extra):
    monkeypatch.delenv("SLIPSTREAM_INJECT_FAULT", raising=False)
    if fault:
        monkeypatch.setenv("SLIPSTREAM_INJECT_FAULT", fault)
    run = tmp_path / "run"
    cfg = load_config(None, TINY + [f"--train.max_steps={steps}", f"--run.dir={run}", *extra])
    rec = Recorder()
    trainer = Trainer(build_model(cfg.model, "cpu", seed=0), _data(), rec, config=cfg)
    return trainer, rec, run


def _records(run):
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _final_params(trainer):
    return torch.cat([p.detach().reshape(-1).clone() for p in trainer.model.parameters()])


def test_skip_leaves_the_parameters_exactly_as_before(tmp_path, monkeypatch):
    trainer, rec, run = _fit(tmp_path, monkeypatch, 5, "nan@3", "--stability.policy=skip")
    summary = trainer.fit()
    assert summary["steps"] == 5 and len(rec.params) == 5
    p = rec.params + [_final_params(trainer)]  # p[k] = parameters after step k
    assert torch.equal(p[3], p[2]), "the skipped step 3 changed the parameters"
    for k in (1, 2, 4, 5):  # every other step did update
        assert not torch.equal(p[k], p[k - 1]), f"step {k} did not update"
    assert all(torch.isfinite(x).all() for x in p)
    events = [(r["step"], r["guard_event"], r["action"]) for r in _records(run) if "guard_event" in r]
    assert events == [(3, "nonfinite_loss", "skip")]


def test_rollback_restores_the_checkpoint_and_skips_the_bad_batches(tmp_path, monkeypatch):
    """Checkpoint after step 2, NaN at step 4: back to step 2's parameters; steps 3 and 4 run
    again on the next batches the loader hands out (calls 5 and 6), never on batches 3 and 4."""
    trainer, rec, run = _fit(tmp_path / "bad", monkeypatch, 5, "nan@4", "--stability.policy=rollback",
                             "--checkpoint.interval=2", "--checkpoint.async_save=false")
    summary = trainer.fit()
    straight, ref, _ = _fit(tmp_path / "straight", monkeypatch, 7)
    straight.fit()
    assert summary["steps"] == 5
    assert len(rec.params) == 7, f"{len(rec.params)} training calls, not 4 + 3 replayed after the rollback"
    # The loader moved on: the rolled-back run saw exactly the straight run's first 7 batches.
    same = [torch.equal(a, b) for a, b in zip(rec.batches, ref.batches, strict=True)]
    assert all(same), f"training calls {[k + 1 for k, ok in enumerate(same) if not ok]} got other batches"
    # Calls 1-4 are the straight run's steps (call 4 is the poisoned step 4).
    for k in range(4):
        assert torch.equal(rec.params[k], ref.params[k]), f"call {k + 1}"
    # Call 5 (the new step 3) starts from the step-2 checkpoint: the parameters call 3 saw,
    # not those after step 3 (a rollback that only dropped the update would start there).
    assert torch.equal(rec.params[4], rec.params[2])
    assert not torch.equal(rec.params[4], rec.params[3])
    records = _records(run)
    assert [(r["step"], r["guard_event"], r["action"]) for r in records if "guard_event" in r] == \
        [(4, "nonfinite_loss", "rollback")]
    # The logged losses after the rollback are the losses of the new batches at the restored state.
    logged = [(r["step"], r["loss"]) for r in records if "loss" in r and "guard_event" not in r]
    after = logged[[s for s, _ in logged].index(4) + 1:]
    assert [s for s, _ in after] == [3, 4, 5]
    assert [loss for _, loss in after] == pytest.approx(rec.losses[4:], rel=1e-6)


def test_stop_ends_the_run_at_the_max_events_th_event(tmp_path, monkeypatch):
    """Spikes (loss x 100) at steps 5 and 7 with max_events = 2: the first one is counted and
    let through, the second one stops the run at step 7 with an error."""
    trainer, rec, run = _fit(tmp_path, monkeypatch, 10, "spike@5,spike@7", "--stability.policy=stop",
                             "--stability.max_events=2", "--stability.window=4")
    with pytest.raises(UserError, match="2 unstable steps") as info:
        trainer.fit()
    assert "step 7" in str(info.value)
    assert trainer.step == 7 and len(rec.params) == 7
    events = [(r["step"], r["guard_event"], r["action"]) for r in _records(run) if "guard_event" in r]
    assert events == [(5, "spike", "ok"), (7, "spike", "stop")]
    # Under stop the first event's update is applied (policy stop only counts).
    assert not torch.equal(rec.params[5], rec.params[4])
    assert not (run / "summary.json").exists()
