"""torch.compile from outside the model: same numbers as eager (to float tolerance),
unchanged checkpoint keys, AC before compile, and a persistent compile cache.

Compiling is slow on CPU (10-40 s cold), so only three tests compile; the inductor cache
lives in <checkout>/.cache/test/inductor so that reruns take a few seconds each.
"""

import dataclasses
from pathlib import Path

import pytest
import torch
import torch._dynamo
import torch._inductor.config as inductor_config
from torch.distributed.checkpoint.state_dict import get_model_state_dict

from slipstream.checkpoint.manager import load_checkpoint, save_checkpoint
from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.models.transformer import build_model, lm_loss
from slipstream.optimize.activations import apply_activation_checkpointing
from slipstream.optimize.compile import apply_compile, configure_compile_cache, default_compile_cache_dir

VOCAB, BATCH, SEQ = 257, 4, 32
CACHE_DIR = Path(__file__).resolve().parents[2] / ".cache" / "test" / "inductor"


@pytest.fixture(scope="module")
def compile_cache():
    """Point inductor at the per-checkout cache before the first compile of this process."""
    return configure_compile_cache(CACHE_DIR)


def model_config(preset="tiny", **changes):
    cfg = load_config(None, [f"--model.preset={preset}", f"--train.seq_len={SEQ}"]).model
    return dataclasses.replace(cfg, vocab_size=VOCAB, n_layer=4, **changes)


def batch():
    gen = torch.Generator().manual_seed(0)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen), torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def loss_and_grads(model, x, y):
    model.zero_grad(set_to_none=True)
    loss = lm_loss(model(x), y)
    loss.backward()
    return loss.detach(), {name.replace("_checkpoint_wrapped_module.", ""): p.grad.clone()
                           for name, p in model.named_parameters()}


def assert_matches_eager(result, reference):
    # Inductor fuses and reorders float ops, so the last bits differ. Measured on the tiny
    # model (torch 2.13, CPU): loss |diff| ~5e-7 of ~5.6, gradients max |diff| ~1e-7 where
    # the largest gradient is ~0.2. Tolerance: 1e-5 relative, and 1e-5 of the largest
    # gradient absolute (k_proj.bias has a mathematically zero gradient: pure noise ~1e-11).
    (loss, grads), (ref_loss, ref_grads) = result, reference
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=0.0)
    assert grads.keys() == ref_grads.keys()
    scale = max(g.abs().max().item() for g in ref_grads.values())
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=1e-5, atol=1e-5 * scale, msg=lambda m: f"{name}: {m}")


# --- compiled (slow) ----------------------------------------------------------------------

def test_regional_compile_matches_eager_and_compiles_one_block_graph(compile_cache):
    cfg = model_config()
    x, y = batch()
    reference = loss_and_grads(build_model(cfg, "cpu", seed=0), x, y)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = apply_compile(build_model(cfg, "cpu", seed=0), "blocks", fullgraph=True)
    assert_matches_eager(loss_and_grads(model, x, y), reference)
    # Four identical blocks, one compiled graph: why regional compile starts fast.
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == 1


def test_whole_model_compile_matches_eager(compile_cache):
    cfg = model_config()
    x, y = batch()
    reference = loss_and_grads(build_model(cfg, "cpu", seed=0), x, y)
    model = apply_compile(build_model(cfg, "cpu", seed=0), "model", fullgraph=True)
    assert_matches_eager(loss_and_grads(model, x, y), reference)


def test_checkpointed_compiled_model_loads_a_plain_checkpoint_and_matches_eager(compile_cache, tmp_path):
    cfg = model_config()
    x, y = batch()
    # A plain eager model trains one step and is saved with its optimizer (DCP).
    plain = build_model(cfg, "cpu", seed=0)
    optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    loss_and_grads(plain, x, y)
    optimizer.step()
    path = save_checkpoint(tmp_path, 1, plain, optimizer, trainer_state={}, config_toml="")

    # Another init, AC first, then compile: the checkpoint loads into it with its keys.
    model = build_model(cfg, "cpu", seed=1)
    apply_compile(apply_activation_checkpointing(model, "full"), "blocks", fullgraph=True)
    model_optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    load_checkpoint(path, model, model_optimizer)
    for key, value in plain.state_dict().items():
        assert torch.equal(model.state_dict()[key], value), key
    loaded_state = model_optimizer.state_dict()["state"]
    for i, state in optimizer.state_dict()["state"].items():
        assert torch.equal(loaded_state[i]["exp_avg"], state["exp_avg"])

    assert_matches_eager(loss_and_grads(model, x, y), loss_and_grads(plain, x, y))


# --- not compiled (compile is lazy: nothing below runs a compiled forward) -----------------

@pytest.mark.parametrize("scope", ["model", "blocks"])
@pytest.mark.parametrize("ac", ["none", "full", "selective", "offload"])
def test_state_dict_keys_unchanged(scope, ac):
    plain = build_model(model_config(), "cpu")
    model = apply_compile(apply_activation_checkpointing(build_model(model_config(), "cpu"), ac), scope)
    assert list(model.state_dict().keys()) == list(plain.state_dict().keys())
    assert list(get_model_state_dict(model).keys()) == list(get_model_state_dict(plain).keys())
    assert not any("_orig_mod" in name for name, _ in model.named_parameters())


def test_off_returns_model_unchanged():
    model = build_model(model_config(), "cpu")
    assert apply_compile(model, "off") is model
    assert getattr(model, "_compiled_call_impl", None) is None
    assert all(getattr(block, "_compiled_call_impl", None) is None for block in model.blocks)


def test_offload_blocks_are_compiled_inside_their_wrapper():
    model = apply_compile(apply_activation_checkpointing(build_model(model_config(), "cpu"), "offload"), "blocks")
    for wrapper in model.blocks:
        assert getattr(wrapper, "_compiled_call_impl", None) is None  # save_on_cpu stays eager
        assert wrapper._checkpoint_wrapped_module._compiled_call_impl is not None


@pytest.mark.parametrize("kwargs,match", [
    (dict(scope="all"), "off, model, blocks"),
    (dict(scope="blocks", mode="fast"), "default, reduce-overhead, max-autotune, max-autotune-no-cudagraphs"),
    (dict(scope="model", dynamic="yes"), "dynamic"),
])
def test_invalid_values_are_user_errors(kwargs, match):
    with pytest.raises(UserError, match=match):
        apply_compile(build_model(model_config(), "cpu"), **kwargs)


def test_configure_compile_cache(monkeypatch, tmp_path):
    # monkeypatch restores the environment afterwards, and Inductor's own patch() its config
    # (monkeypatch's undo would delete the key: later compiles in this process would fail), so
    # the compiled tests keep using the per-checkout cache.
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "unused"))
    with inductor_config.patch(fx_graph_cache=False):
        path = configure_compile_cache(tmp_path / "run" / "inductor")
        assert path == tmp_path / "run" / "inductor" and path.is_dir()
        assert inductor_config.fx_graph_cache is True
        from torch._inductor.runtime.cache_dir_utils import cache_dir
        assert cache_dir() == str(path)  # what inductor will use

    monkeypatch.setenv("SLIPSTREAM_CACHE_DIR", str(tmp_path / "user"))
    assert default_compile_cache_dir() == tmp_path / "user" / "inductor"
    assert configure_compile_cache(None) == tmp_path / "user" / "inductor"
    monkeypatch.delenv("SLIPSTREAM_CACHE_DIR")
    assert default_compile_cache_dir() == Path.home() / ".cache" / "slipstream" / "inductor"
