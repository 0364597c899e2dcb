"""W&B logging in offline mode (no network, no account) through a real training run."""

import pytest

from slipstream.config import load_config
from slipstream.train.lm import train_lm

wandb = pytest.importorskip("wandb")


def test_wandb_offline_run_is_written(tiny_overrides, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    train_lm(load_config(None, tiny_overrides + ["--logging.wandb=true", "--train.max_steps=4"]))
    runs = list((tmp_path / "run" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1
    assert any(f.stat().st_size > 0 for f in runs[0].glob("run-*.wandb"))
