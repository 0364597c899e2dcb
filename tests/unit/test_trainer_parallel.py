"""Single-process parts of the data-parallel integration (no process group needed)."""

from types import SimpleNamespace

import pytest
import torch

from slipstream.config.load import load_config
from slipstream.errors import UserError

TINY = ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=16", "--train.max_steps=2",
        "--train.micro_batch_size=2", "--train.eval_steps=0", "--logging.progress=false",
        "--logging.tensorboard=false", "--metrics.memory_breakdown=false", "--checkpoint.save_final=false"]


def _data(n=16):
    torch.manual_seed(0)
    x = torch.randint(0, 64, (n, 17))
    return torch.utils.data.TensorDataset(x[:, :-1], x[:, 1:])


def _loss(model, batch):
    from slipstream.models.transformer import lm_loss

    return lm_loss(model(batch[0]), batch[1])


def test_a_meta_model_is_initialized_by_init_model(tmp_path):
    from slipstream.models.transformer import Transformer, build_model, materialize
    from slipstream.train.trainer import Trainer

    cfg = load_config(None, TINY + [f"--run.dir={tmp_path / 'run'}"])
    with torch.device("meta"):
        meta = Transformer(cfg.model)
    trainer = Trainer(meta, _data(), _loss, config=cfg, init_model=lambda m: materialize(m, "cpu", seed=3))
    reference = build_model(cfg.model, "cpu", seed=3)
    for (name, got), want in zip(trainer.model.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name
    assert trainer.fit()["steps"] == 2
    with torch.device("meta"):
        meta = Transformer(cfg.model)
    with pytest.raises(UserError, match="init_model"):
        Trainer(meta, _data(), _loss, config=cfg)


def test_a_loader_built_for_another_world_size_is_refused():
    from slipstream.data.loader import DatasetLoader
    from slipstream.train.setup import as_loader as _as_loader

    cfg = load_config(None, TINY)
    parallel = SimpleNamespace(dims=SimpleNamespace(dp=2), dp_rank=1)
    single = DatasetLoader(_data(), batch_size=2, shuffle=True, seed=0, drop_last=True)
    with pytest.raises(UserError, match="world_size = 1, but this job has 2 data-parallel ranks"):
        _as_loader(single, cfg, torch.device("cpu"), shuffle=True, parallel=parallel)
    sharded = DatasetLoader(_data(), batch_size=2, shuffle=True, seed=0, drop_last=True, rank=1, world_size=2)
    assert _as_loader(sharded, cfg, torch.device("cpu"), shuffle=True, parallel=parallel) is sharded
    built = _as_loader(_data(), cfg, torch.device("cpu"), shuffle=True, parallel=parallel)
    assert (built.rank, built.world_size) == (1, 2)


def test_usable_cores_counts_this_process_cores():
    import os

    from slipstream.distributed.mesh import usable_cores

    assert 1 <= usable_cores() <= (os.cpu_count() or 1)


def test_mfu_peak_follows_the_compute_dtype(tmp_path, monkeypatch):
    """bf16 autocast, or FSDP's 16-bit parameter dtype, runs the matmuls at the 16-bit peak."""
    from slipstream.models.transformer import build_model
    from slipstream.train.trainer import Trainer

    seen = []
    monkeypatch.setattr("slipstream.observe.peaks.device_peak_flops",
                        lambda device, key, user=None: seen.append(key) or (1e12, "test"))
    cfg = load_config(None, TINY + [f"--run.dir={tmp_path / 'run'}"])
    trainer = Trainer(build_model(cfg.model), _data(), _loss, config=cfg, flops_per_token=1.0)
    for autocast, param_dtype in (("none", "none"), ("bf16", "none"), ("none", "bf16"), ("none", "fp16")):
        trainer.cfg.precision.autocast, trainer.cfg.parallel.param_dtype = autocast, param_dtype
        trainer._peak_flops()
    assert seen == ["fp32", "bf16", "bf16", "fp16"]
