"""The Transformer, its presets, and the parameter / FLOP accounting in models/flops.py."""

import dataclasses

import pytest
import torch

from slipstream.config import load_config
from slipstream.models import PRESETS, Transformer, build_model, generate, padded_vocab_size
from slipstream.models.transformer import materialize
from slipstream.models.flops import flops_per_token, param_count

VOCAB = 300  # pads to 320 with the default vocab_multiple of 64


def preset_config(name, **changes):
    """The resolved ModelConfig of a preset; presets without a vocabulary get VOCAB."""
    cfg = load_config(None, [f"--model.preset={name}", "--train.seq_len=64"]).model
    if cfg.vocab_size == 0:
        cfg = dataclasses.replace(cfg, vocab_size=VOCAB)
    return dataclasses.replace(cfg, **changes)


def on_meta(cfg):
    with torch.device("meta"):  # shapes only, no memory: works for the 70B preset too
        return Transformer(cfg)


def real_param_count(model):
    return sum(p.numel() for p in model.parameters())  # parameters() yields tied weights once


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_resolves_and_param_count_matches_model(name):
    cfg = preset_config(name)
    assert cfg.preset == name
    model = on_meta(cfg)
    counted = param_count(cfg)
    assert counted.total == real_param_count(model)
    # The FLOP formula's matmul parameters: every block weight plus the (padded) output head.
    matmul = sum(p.numel() for p in model.blocks.parameters()) + model.lm_head.weight.numel()
    assert counted.matmul == matmul
    # A token passes through top_k of the routed experts (counted from the built experts' weights).
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    assert counted.experts == experts
    active = matmul - (experts - experts * cfg.moe_top_k // cfg.moe_experts if cfg.moe_experts else 0)
    assert counted.active_matmul == active
    T = 64
    assert flops_per_token(cfg, T) == 6 * active + 12 * cfg.n_layer * cfg.d_model * T


def test_gpt2_preset_is_124m():
    # With the exact GPT-2 vocabulary this is the published GPT2LMHeadModel count.
    assert param_count(preset_config("gpt2", vocab_multiple=1)).total == 124_439_808
    assert 124e6 < param_count(preset_config("gpt2")).total < 125e6  # vocab padded 50257 -> 50304


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
def test_param_count_of_a_materialized_model(name):
    cfg = preset_config(name)
    assert real_param_count(build_model(cfg, seed=0)) == param_count(cfg).total


@pytest.mark.parametrize("vocab, multiple", [(300, 64), (320, 64), (50257, 64), (50257, 128), (7, 1)])
def test_padded_vocab_size(vocab, multiple):
    cfg = preset_config("tiny", vocab_size=vocab, vocab_multiple=multiple)
    padded = padded_vocab_size(cfg)
    assert padded % multiple == 0 and vocab <= padded < vocab + multiple
    model = on_meta(cfg)
    assert model.tok_emb.weight.shape[0] == model.lm_head.weight.shape[0] == padded


def test_materialize_is_deterministic_and_ignores_global_rng():
    cfg = preset_config("llama-tiny")
    torch.manual_seed(1)
    a = build_model(cfg, seed=7).state_dict()
    torch.manual_seed(2)  # a different global RNG state must not matter
    torch.rand(100)
    b = build_model(cfg, seed=7).state_dict()
    c = build_model(cfg, seed=8).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)
    # materialize() of a meta model is what build_model does; check it directly too.
    d = materialize(on_meta(cfg), "cpu", seed=7).state_dict()
    assert all(torch.equal(a[k], d[k]) for k in a)


def test_tied_embeddings_stay_tied_after_materialize():
    model = build_model(preset_config("tiny"), seed=0)
    assert model.lm_head.weight is model.tok_emb.weight
    untied = build_model(preset_config("llama-tiny"), seed=0)
    assert untied.lm_head.weight is not untied.tok_emb.weight


@torch.no_grad()
def test_gqa_equals_mha_with_repeated_kv_heads():
    gqa_cfg = preset_config("llama-tiny")  # 4 query heads share 2 kv heads
    assert gqa_cfg.n_kv_head < gqa_cfg.n_head
    mha_cfg = dataclasses.replace(gqa_cfg, n_kv_head=0)
    gqa, mha = build_model(gqa_cfg, seed=0).eval(), build_model(mha_cfg, seed=1).eval()
    group = gqa_cfg.n_head // gqa_cfg.n_kv_head
    head_dim = gqa_cfg.d_model // gqa_cfg.n_head
    state = gqa.state_dict()
    for key, value in state.items():
        if key.endswith(("k_proj.weight", "v_proj.weight")):
            # Query head h reads kv head h // group: repeat each kv head `group` times in a row.
            heads = value.view(gqa_cfg.n_kv_head, head_dim, -1)
            state[key] = heads.repeat_interleave(group, dim=0).reshape(gqa_cfg.n_head * head_dim, -1)
    mha.load_state_dict(state)
    idx = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(gqa(idx), mha(idx), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["tiny", "llama-tiny"])
@torch.no_grad()
def test_causal_future_tokens_do_not_change_past_logits(name):
    model = build_model(preset_config(name), seed=0).eval()
    idx = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(0))
    changed = idx.clone()
    changed[0, 10] = (idx[0, 10] + 1) % VOCAB
    a, b = model(idx), model(changed)
    torch.testing.assert_close(a[:, :10], b[:, :10], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 10:], b[:, 10:])


@torch.no_grad()
def test_rope_model_below_max_seq_len():
    cfg = preset_config("llama-tiny")
    model = build_model(cfg, seed=0).eval()
    idx = torch.randint(0, VOCAB, (2, 20), generator=torch.Generator().manual_seed(0))
    short = model(idx[:, :10])
    assert short.shape == (2, 10, padded_vocab_size(cfg))
    # A prefix sees the same positions (RoPE tables sliced from 0) as in a longer sequence.
    torch.testing.assert_close(short, model(idx)[:, :10], atol=1e-5, rtol=0)


def test_max_seq_len_exceeded_is_an_error():
    cfg = preset_config("tiny")
    model = build_model(cfg, seed=0)
    with pytest.raises(ValueError, match="max_seq_len"):
        model(torch.zeros(1, cfg.max_seq_len + 1, dtype=torch.long))


@torch.no_grad()
def test_generate_is_deterministic_and_never_emits_padding_ids():
    cfg = preset_config("tiny", tie_embeddings=False)
    model = build_model(cfg, seed=0).eval()
    # Rig the model so the padded rows would win: the final norm outputs ~ its bias b, and the
    # padding rows of the head are b, so their logits (~|b|^2) dwarf the real ones.
    b = torch.randn(cfg.d_model, generator=torch.Generator().manual_seed(0))
    model.final_norm.weight.mul_(0.1)
    model.final_norm.bias.copy_(b)
    model.lm_head.weight[cfg.vocab_size:] = b
    prompt = torch.randint(0, VOCAB, (2, 5), generator=torch.Generator().manual_seed(1))
    logits = model(prompt)
    assert (logits[..., cfg.vocab_size:] == float("-inf")).all()  # rigged to win, the padding still takes no probability
    assert (logits[:, -1].argmax(-1) < cfg.vocab_size).all()

    greedy = generate(model, prompt, max_new_tokens=20, temperature=0)
    assert torch.equal(greedy, generate(model, prompt, max_new_tokens=20, temperature=0))
    assert torch.equal(greedy[:, :5], prompt) and greedy.shape == (2, 25)
    assert greedy.max() < cfg.vocab_size
    sampled = generate(model, prompt, max_new_tokens=20, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert sampled.max() < cfg.vocab_size
    # Longer than max_seq_len in total: generate crops the context instead of failing.
    long = generate(model, torch.zeros(1, cfg.max_seq_len, dtype=torch.long), max_new_tokens=2, temperature=0)
    assert long.shape == (1, cfg.max_seq_len + 2)


def test_padded_vocabulary_rows_are_not_classes():
    """The loss of a padded model equals the loss of the same weights without padding: the
    padded rows are storage only (no probability, no gradient), in both loss paths."""
    from slipstream.train.lm_loss import fused_lm_loss_fn, lm_loss_fn

    padded_cfg = preset_config("tiny", vocab_size=300, vocab_multiple=64)
    exact_cfg = preset_config("tiny", vocab_size=300, vocab_multiple=1)
    padded, exact = build_model(padded_cfg, seed=0), build_model(exact_cfg, seed=0)
    assert padded.lm_head.weight.shape[0] == 320 and exact.lm_head.weight.shape[0] == 300
    with torch.no_grad():
        for name, p in exact.named_parameters():
            p.copy_(dict(padded.named_parameters())[name][: p.shape[0]] if "tok_emb" in name else dict(padded.named_parameters())[name])
    gen = torch.Generator().manual_seed(0)
    x, y = torch.randint(0, 300, (2, 16), generator=gen), torch.randint(0, 300, (2, 16), generator=gen)
    reference = lm_loss_fn(exact, (x, y))
    for loss_fn in (lm_loss_fn, lambda m, b: fused_lm_loss_fn(m, b, chunk_size=8)):
        padded.zero_grad()
        loss = loss_fn(padded, (x, y))
        torch.testing.assert_close(loss, reference, rtol=1e-6, atol=1e-6)
        loss.backward()
        assert padded.tok_emb.weight.grad[300:].abs().max() == 0  # padded rows get no gradient
