"""Activation checkpointing / offload: same numbers as without, less activation memory,
unchanged checkpoint keys."""

import dataclasses

import pytest
import torch
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.models.transformer import build_model, lm_loss
from slipstream.optimize.activations import activation_memory_bytes, apply_activation_checkpointing

VOCAB, BATCH, SEQ = 257, 4, 32
WRAPPER_PREFIX = "_checkpoint_wrapped_module."


def model_config(preset="tiny", **changes):
    cfg = load_config(None, [f"--model.preset={preset}", f"--train.seq_len={SEQ}"]).model
    return dataclasses.replace(cfg, vocab_size=VOCAB, n_layer=4, **changes)


def batch(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def loss_and_grads(model, x, y):
    torch.manual_seed(1234)  # same dropout masks in every run
    loss = lm_loss(model(x), y)
    loss.backward()
    # Parameter names inside a wrapper carry its prefix; compare by the original names.
    return loss.detach(), {name.replace(WRAPPER_PREFIX, ""): p.grad for name, p in model.named_parameters()}


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
@pytest.mark.parametrize("mode,every", [("full", 1), ("full", 2), ("selective", 1), ("offload", 1)])
def test_same_loss_and_grads_as_without(preset, mode, every):
    # Recomputation runs the same ops on the same inputs in the same order, and the RNG state
    # is restored for it (dropout is on here), so everything is bit-identical: torch.equal.
    cfg = model_config(preset, dropout=0.1)
    x, y = batch()
    ref_loss, ref_grads = loss_and_grads(build_model(cfg, "cpu", seed=0), x, y)
    model = apply_activation_checkpointing(build_model(cfg, "cpu", seed=0), mode, every)
    loss, grads = loss_and_grads(model, x, y)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, ref_grads[name]), name


def test_every_wraps_every_kth_block():
    model = apply_activation_checkpointing(build_model(model_config(), "cpu"), "full", every=2)
    wrapped = [type(block).__name__ != "Block" for block in model.blocks]
    assert wrapped == [True, False, True, False]


def measured(preset, mode, every=1):
    model = apply_activation_checkpointing(build_model(model_config(preset), "cpu"), mode, every)
    x, _ = batch()
    return activation_memory_bytes(model, lambda: x)


def test_measurement_matches_a_pack_hook_on_the_plain_model():
    # Without AC every kept activation goes through autograd's saved-tensor hooks, so a pack
    # hook counting unique storages must find the same bytes (parameters, buffers and the
    # input excluded, as activation_memory_bytes excludes them).
    model = build_model(model_config("llama-tiny"), "cpu")
    x, _ = batch()
    not_activations = {t.untyped_storage().data_ptr() for t in [*model.parameters(), *model.buffers(), x]}
    saved = {}

    def pack(t):
        saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = model(x)
    hooked = sum(n for ptr, n in saved.items() if ptr not in not_activations)
    assert hooked > 0
    assert activation_memory_bytes(model, lambda: x) == hooked
    del out


def test_checkpointing_reduces_activation_memory():
    none, full, half, selective, offload = (measured("tiny", m, e) for m, e in
                                            [("none", 1), ("full", 1), ("full", 2), ("selective", 1), ("offload", 1)])
    # tiny model, batch 4x32 (measured on torch 2.13): none 2176256, full 197888,
    # full every=2 1187072, selective 1512704, offload 2176256 bytes.
    assert full < half < none
    # Selective keeps the matmul and attention outputs but recomputes norms, GELU and the
    # residual sums, so it lies between full and none.
    assert full < selective < none
    # On a CPU device save_on_cpu moves nothing: all activations stay on the training device.
    assert offload == none


def test_checkpointing_reduces_activation_memory_llama():
    none, full, selective = (measured("llama-tiny", m) for m in ("none", "full", "selective"))
    assert full < selective < none
    assert full < none / 5  # only each block's input is kept (measured: ~12x less)


@pytest.mark.parametrize("mode", ["full", "selective", "offload"])
def test_state_dict_keys_unchanged(mode):
    plain = build_model(model_config("llama-tiny"), "cpu", seed=0)
    model = apply_activation_checkpointing(build_model(model_config("llama-tiny"), "cpu", seed=1), mode, every=2)
    assert any(WRAPPER_PREFIX in name for name, _ in model.named_parameters())  # really wrapped
    assert list(model.state_dict().keys()) == list(plain.state_dict().keys())
    # DCP checkpoints go through get_model_state_dict: original names there too.
    assert list(get_model_state_dict(model).keys()) == list(get_model_state_dict(plain).keys())
    # A plain model's state dict loads strictly, and the weights arrive.
    model.load_state_dict(plain.state_dict())
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key


def test_none_returns_model_unchanged():
    model = build_model(model_config(), "cpu")
    blocks = list(model.blocks)
    assert apply_activation_checkpointing(model, "none") is model
    assert list(model.blocks) == blocks


@pytest.mark.parametrize("mode,every", [("all", 1), ("Full", 1), ("full", 0), ("full", -1), ("full", 1.5), ("full", True)])
def test_invalid_values_are_user_errors(mode, every):
    with pytest.raises(UserError, match="none, full, selective, offload|every"):
        apply_activation_checkpointing(build_model(model_config(), "cpu"), mode, every)


def test_applied_twice_or_after_compile_is_a_user_error():
    model = apply_activation_checkpointing(build_model(model_config(), "cpu"), "full")
    with pytest.raises(UserError, match="already applied"):
        apply_activation_checkpointing(model, "selective")
    compiled = build_model(model_config(), "cpu")
    compiled.compile()  # lazy: nothing is compiled until a forward runs
    with pytest.raises(UserError, match="before torch.compile"):
        apply_activation_checkpointing(compiled, "full")
