"""CheckpointWriter: asynchronous saves hold the state of the moment they were started;
manifests, retention and commits."""

import json

import torch

from slipstream.checkpoint import manager as ckpt
from slipstream.checkpoint.writer import CheckpointWriter, prune


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 8))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_an_async_save_keeps_the_values_of_the_moment_it_started(tmp_path):
    model, optimizer = _model_and_optimizer()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    writer = CheckpointWriter(tmp_path, keep_last=2, async_save=True)
    stall = writer.save(1, model, optimizer, {"step": 1}, "", {})
    with torch.no_grad():  # training goes on while the write is in flight
        for p in model.parameters():
            p.mul_(-3.0)
    path = writer.wait()
    assert stall >= 0 and path.name == "step_00000001" and ckpt.verify_checkpoint(path) == []
    fresh, fresh_opt = _model_and_optimizer()
    ckpt.load_checkpoint(path, fresh, fresh_opt)
    for key, value in fresh.state_dict().items():
        assert torch.equal(value, expected[key]), key


def test_manifest_lists_every_file_and_detects_truncation(tmp_path):
    model, optimizer = _model_and_optimizer()
    path = ckpt.save_checkpoint(tmp_path, 3, model, optimizer, {"step": 3}, "x = 1\n", {})
    manifest = json.loads((path / "manifest.json").read_text())
    assert {"model_optim/.metadata", "trainer_state.json", "config.toml", "meta.json"} <= set(manifest)
    assert any(name.endswith(".distcp") for name in manifest)
    shard = next(path.glob("model_optim/*.distcp"))
    shard.write_bytes(shard.read_bytes()[:-10])
    problems = ckpt.verify_checkpoint(path, deep=False)
    assert len(problems) == 1 and "bytes, the manifest says" in problems[0]


def test_retention_keeps_the_last_k_and_every_mth(tmp_path):
    model, optimizer = _model_and_optimizer()
    writer = CheckpointWriter(tmp_path, keep_last=2, keep_every=4, async_save=False)
    for step in range(1, 10):
        writer.save(step, model, optimizer, {"step": step}, "", {})
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == [
        "step_00000004", "step_00000008", "step_00000009"]
    prune(tmp_path, keep_last=1)
    assert [p.name for p in ckpt.list_checkpoints(tmp_path)] == ["step_00000009"]
