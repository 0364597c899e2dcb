"""The parallelize chain (distributed/parallelize.py): the order it applies techniques in, where
a meta-device model is materialized, and the refusal of what a step cannot split."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from slipstream.config import load_config
from slipstream.distributed.mesh import init_parallel
from slipstream.distributed.parallelize import parallelize
from slipstream.errors import UserError
from slipstream.models.transformer import Transformer, materialize

TINY = ["--model.preset=tiny", "--model.vocab_size=64", "--train.seq_len=16"]


def _cfg(*extra: str):
    return load_config(None, TINY + list(extra))


def _meta_model(cfg) -> Transformer:
    with torch.device("meta"):
        return Transformer(cfg.model)


def test_pipeline_stage_runs_first_and_refuses_a_model_without_a_split():
    """The chain's first step is the pipeline split (run against one process in
    tests/e2e/test_launch_pipeline.py); a user module has no split it could cut."""
    cfg = _cfg()
    parallel = init_parallel(cfg)
    wider = dataclasses.replace(parallel, dims=dataclasses.replace(parallel.dims, pp=2))
    with pytest.raises(UserError, match=r"parallel.pp > 1 splits a slipstream Transformer .* Linear has no such split"):
        parallelize(torch.nn.Linear(4, 4), wider, cfg)


@pytest.mark.parametrize("dim, message", [("tp", "must divide model.n_head = 3"),
                                          ("cp", "train.seq_len = 30 must be divisible by 2 x cp = 4")])
def test_tensor_and_context_parallel_steps_run_in_the_chain(dim, message):
    """The chain's tp / cp steps check the model against their degree first (the splits
    themselves are tested against one process in tests/distributed/test_tensor_parallel.py)."""
    cfg = _cfg("--model.n_head=3", "--model.d_model=48", "--train.seq_len=30")
    parallel = init_parallel(cfg)
    wider = dataclasses.replace(parallel, dims=dataclasses.replace(parallel.dims, **{dim: 2}))
    with pytest.raises(UserError, match=message):
        parallelize(Transformer(cfg.model), wider, cfg)


def test_meta_model_needs_an_init_function():
    cfg = _cfg()
    with pytest.raises(UserError, match="meta device; pass init_model="):
        parallelize(_meta_model(cfg), init_parallel(cfg), cfg)


def test_replicated_meta_model_is_materialized_first_then_checkpointed_then_compiled(tmp_path):
    """One device: init runs once, on the plain model (before AC wraps the blocks); AC comes
    before compile, so the compiled unit of each block is its checkpoint wrapper; the weights
    are the seed's, exactly as a model materialized by hand."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    cfg = _cfg("--activations.checkpointing=full", "--compile.scope=blocks", f"--compile.cache_dir={tmp_path}")
    seen = []

    def init(model):
        seen.append([type(b).__name__ for b in model.blocks])
        materialize(model, "cpu", seed=3)

    model = parallelize(_meta_model(cfg), init_parallel(cfg), cfg, init)
    assert seen == [["Block"] * cfg.model.n_layer]  # once, before activation checkpointing wrapped anything
    for block in model.blocks:
        assert isinstance(block, CheckpointWrapper)
        assert getattr(block, "_compiled_call_impl", None) is not None  # compile wrapped the AC'd block
    reference = materialize(_meta_model(cfg), "cpu", seed=3)
    ours = {k.replace("._checkpoint_wrapped_module", ""): v for k, v in model.state_dict().items()}
    assert ours.keys() == reference.state_dict().keys()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(ours[name], value, rtol=0, atol=0, msg=name)


def test_a_model_on_a_device_is_moved_and_left_unwrapped_when_nothing_is_enabled():
    cfg = _cfg()
    model = Transformer(cfg.model)
    assert parallelize(model, init_parallel(cfg), cfg) is model
