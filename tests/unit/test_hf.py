"""Hugging Face interop: our Transformer and HF GPT-2 / Llama compute the same logits.

Small random HF models are built from configs (nothing is downloaded). Vocabulary 300 is
padded to 320 by our model, so the padding-row handling is exercised in every test.
"""

import dataclasses
import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")  # optional dependency; imported once (slow)

from slipstream.errors import UserError  # noqa: E402
from slipstream.models import from_hf, to_hf  # noqa: E402
from slipstream.models.hf import hf_config, model_config_from_hf, save_hf  # noqa: E402
from slipstream.models.transformer import Transformer, build_model, padded_vocab_size  # noqa: E402

VOCAB, SEQ = 300, 32

# name -> (HF model class, config kwargs). Llama cases use GQA (4 query heads, 2 kv heads).
CASES = {
    "gpt2": (transformers.GPT2LMHeadModel, dict(n_layer=2, n_head=4, n_embd=64, n_positions=SEQ)),
    "gpt2-untied": (transformers.GPT2LMHeadModel,
                    dict(n_layer=2, n_head=4, n_embd=64, n_positions=SEQ, n_inner=96, tie_word_embeddings=False)),
    "llama-gqa": (transformers.LlamaForCausalLM,
                  dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                       intermediate_size=96, max_position_embeddings=SEQ, rope_theta=5000.0,
                       tie_word_embeddings=False)),
    "llama-gqa-tied-bias": (transformers.LlamaForCausalLM,
                            dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
                                 intermediate_size=128, max_position_embeddings=SEQ, tie_word_embeddings=True,
                                 attention_bias=True, mlp_bias=True, rms_norm_eps=1e-5)),
}


def make_hf(name, seed=0, **overrides):
    """A random HF model in eval mode. Every parameter is perturbed (HF inits biases to 0 and
    norms to 1), so a bias or norm mapped to the wrong place would change the logits."""
    cls, kwargs = CASES[name]
    config_cls = transformers.GPT2Config if cls is transformers.GPT2LMHeadModel else transformers.LlamaConfig
    config = config_cls(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, **{**kwargs, **overrides})
    model = cls(config).eval()
    # Every value comes from our own seeded generator: HF's init is not bit-reproducible from
    # one process to the next, and some draws sit at the edge of the 1e-5 fp32 tolerance.
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_gain = name.endswith("weight") and ("ln_" in name or "norm" in name)
            p.copy_(torch.randn(p.shape, generator=gen) * (0.05 if is_gain else 0.02) + (1.0 if is_gain else 0.0))
    return model


def tokens(seed=1):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ours_logits(model, idx):
    return model.eval()(idx)[..., :VOCAB]


@torch.no_grad()
def hf_logits(model, idx):
    return model(idx).logits


@pytest.mark.parametrize("name", list(CASES))
def test_from_hf_matches_hf_logits(name):
    hf = make_hf(name)
    ours = from_hf(hf)
    idx = tokens()
    torch.testing.assert_close(ours_logits(ours, idx), hf_logits(hf, idx), atol=1e-5, rtol=0)
    cfg = ours.cfg
    assert cfg.vocab_size == VOCAB and padded_vocab_size(cfg) == 320 == ours.tok_emb.weight.shape[0]
    assert torch.all(ours.tok_emb.weight[VOCAB:] == 0) and torch.all(ours.lm_head.weight[VOCAB:] == 0)
    assert (ours.lm_head.weight is ours.tok_emb.weight) == hf.config.tie_word_embeddings


@pytest.mark.parametrize("name", list(CASES))
def test_to_hf_round_trip_is_exact(name):
    # HF -> ours -> HF names gives back exactly the original tensors under the original keys.
    hf = make_hf(name)
    back = to_hf(from_hf(hf))
    expected = hf.state_dict()
    assert set(back) == set(expected)
    for key, value in expected.items():
        torch.testing.assert_close(back[key], value, atol=0, rtol=0, msg=key)


@pytest.mark.parametrize("name", list(CASES))
def test_our_model_exported_to_hf_gives_same_logits(name):
    # Start from OUR model (our own random init), build the HF model from hf_config + to_hf.
    cfg = from_hf(make_hf(name)).cfg
    ours = build_model(cfg, seed=3)
    with torch.no_grad():  # our init also has zero biases / unit norms: perturb everything
        for p in ours.parameters():
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())) * 0.05)
    config = hf_config(ours)
    hf = (transformers.GPT2LMHeadModel if cfg.position == "learned" else transformers.LlamaForCausalLM)(config)
    hf.load_state_dict(to_hf(ours), strict=True)
    idx = tokens(2)
    torch.testing.assert_close(hf_logits(hf.eval(), idx), ours_logits(ours, idx), atol=1e-5, rtol=0)
    assert model_config_from_hf(config) == cfg  # the config survives the round trip too


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa"])
def test_from_saved_directory(name, tmp_path):
    hf = make_hf(name)
    idx = tokens()
    hf.save_pretrained(tmp_path / "st")  # model.safetensors (tied head omitted from the file)
    torch.testing.assert_close(ours_logits(from_hf(tmp_path / "st"), idx), hf_logits(hf, idx), atol=1e-5, rtol=0)
    # pytorch_model.bin, loaded with weights_only=True
    (tmp_path / "bin").mkdir()
    (tmp_path / "bin" / "config.json").write_text((tmp_path / "st" / "config.json").read_text())
    torch.save(hf.state_dict(), tmp_path / "bin" / "pytorch_model.bin")
    torch.testing.assert_close(ours_logits(from_hf(str(tmp_path / "bin")), idx), hf_logits(hf, idx),
                               atol=1e-5, rtol=0)


def test_original_gpt2_key_layout_loads(tmp_path):
    # The hub's original GPT-2 checkpoint has no "transformer." prefix and stores the causal-mask
    # buffers h.N.attn.bias / attn.masked_bias; both must be handled.
    hf = make_hf("gpt2")
    sd = {k.removeprefix("transformer."): v for k, v in hf.state_dict().items() if k != "lm_head.weight"}
    for i in range(hf.config.n_layer):
        sd[f"h.{i}.attn.bias"] = torch.tril(torch.ones(1, 1, SEQ, SEQ, dtype=torch.bool))
        sd[f"h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    (tmp_path / "config.json").write_text(json.dumps(hf.config.to_dict()))
    torch.save(sd, tmp_path / "pytorch_model.bin")
    idx = tokens()
    torch.testing.assert_close(ours_logits(from_hf(tmp_path), idx), hf_logits(hf, idx), atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["gpt2", "llama-gqa-tied-bias"])
def test_save_hf_loads_with_from_pretrained(name, tmp_path):
    ours = from_hf(make_hf(name))
    out = save_hf(ours, tmp_path / "export")
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp dir left behind
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    idx = tokens()
    torch.testing.assert_close(hf_logits(hf, idx), ours_logits(ours, idx), atol=1e-5, rtol=0)
    torch.testing.assert_close(ours_logits(from_hf(out), idx), ours_logits(ours, idx), atol=0, rtol=0)
    save_hf(ours, out)  # re-exporting over a previous export is allowed ...
    (out / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="other files"):  # ... but never deletes unrelated files
        save_hf(ours, out)


@pytest.mark.parametrize("name, overrides, feature", [
    ("gpt2", dict(scale_attn_by_inverse_layer_idx=True), "scale_attn_by_inverse_layer_idx"),
    ("gpt2", dict(reorder_and_upcast_attn=True), "reorder_and_upcast_attn"),
    ("gpt2", dict(activation_function="relu"), "activation_function"),
    ("llama-gqa", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "rope scaling 'linear'"),
    ("llama-gqa", dict(attention_bias=True), "mlp_bias"),
    ("llama-gqa", dict(head_dim=32), "head_dim"),
])
def test_unsupported_features_are_refused(name, overrides, feature):
    with pytest.raises(UserError, match=feature):
        from_hf(make_hf(name, **overrides))


def test_unsupported_architecture_and_bad_paths(tmp_path):
    with pytest.raises(UserError, match="GPT2Model"):
        from_hf(transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_head=2, n_embd=16, vocab_size=VOCAB)))
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "mistral", "architectures": ["MistralForCausalLM"]}))
    with pytest.raises(UserError, match="MistralForCausalLM"):
        from_hf(tmp_path)
    with pytest.raises(UserError, match="config.json"):
        from_hf(tmp_path / "missing")


@pytest.mark.parametrize("change, message", [
    (dict(norm="rmsnorm"), "model.norm"), (dict(mlp="swiglu"), "model.mlp"), (dict(bias=False), "model.bias"),
    (dict(n_kv_head=2), "grouped-query"),
])
def test_export_refuses_models_without_hf_equivalent(change, message):
    cfg = dataclasses.replace(from_hf(make_hf("gpt2")).cfg, **change)  # GPT-2 family, one field off
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(UserError, match=message):
        to_hf(model)


def test_missing_transformers_is_a_user_error(monkeypatch):
    ours = from_hf(make_hf("gpt2"))
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    with pytest.raises(UserError, match="pip install transformers"):
        hf_config(ours)
    assert set(to_hf(ours))  # exporting the state dict itself does not need transformers
