"""Hugging Face interop for mixtures of experts: our Transformer and HF Mixtral / Qwen3-MoE
compute the same logits, both ways, through instances and saved folders.

Small random HF models are built from configs (nothing is downloaded), fp32, eval mode (no
router jitter). Vocabulary 300 is padded to 320 by our model. Router weights are drawn wider
than the rest so no token sits on a near-tie between its k-th and (k+1)-th expert, where a
1e-7 difference in the hidden state could pick another expert.
"""

import dataclasses
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")  # optional dependency; imported once (slow)

from slipstream.errors import UserError  # noqa: E402
from slipstream.models import from_hf, to_hf  # noqa: E402
from slipstream.models.hf import hf_config, model_config_from_hf, save_hf  # noqa: E402
from slipstream.models.moe import MoE  # noqa: E402
from slipstream.models.transformer import Transformer, build_model, padded_vocab_size  # noqa: E402

VOCAB, SEQ = 300, 32
_ATTN = dict(num_attention_heads=4, num_key_value_heads=2, hidden_size=64, max_position_embeddings=SEQ)

# name -> (HF model class, config class, config kwargs, expected (moe_first_dense, moe_every, moe_norm_topk)).
CASES = {
    "mixtral": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                dict(_ATTN, num_hidden_layers=2, intermediate_size=96, num_local_experts=8, num_experts_per_tok=2,
                     rope_theta=5000.0, tie_word_embeddings=False), (0, 1, True)),
    "mixtral-tied-4": (transformers.MixtralForCausalLM, transformers.MixtralConfig,
                       dict(_ATTN, num_hidden_layers=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                            tie_word_embeddings=True, rms_norm_eps=1e-6), (0, 1, True)),
    "qwen3-moe-norm-topk": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                            dict(_ATTN, num_hidden_layers=2, head_dim=16, intermediate_size=128,
                                 moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                 norm_topk_prob=True), (0, 1, True)),
    "qwen3-moe-raw-topk": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                           dict(_ATTN, num_hidden_layers=2, head_dim=16, intermediate_size=128,
                                moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2,
                                norm_topk_prob=False, tie_word_embeddings=True), (0, 1, False)),
    # Dense and sparse blocks mixed: Qwen's decoder_sparse_step (blocks 1 and 3 sparse) ...
    "qwen3-moe-sparse-step": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                              dict(_ATTN, num_hidden_layers=4, head_dim=16, intermediate_size=96,
                                   moe_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
                                   norm_topk_prob=True, decoder_sparse_step=2, rope_theta=5000.0), (1, 2, True)),
    # ... and mlp_only_layers (block 0 dense, 1 and 2 sparse).
    "qwen3-moe-first-dense": (transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig,
                              dict(_ATTN, num_hidden_layers=3, head_dim=16, intermediate_size=96,
                                   moe_intermediate_size=32, num_experts=6, num_experts_per_tok=2,
                                   norm_topk_prob=False, mlp_only_layers=[0]), (1, 1, False)),
}


def make_hf(name, seed=0, **overrides):
    """A random HF model in eval mode; every parameter drawn from our own seeded generator (norm
    gains around 1, routers wider: see the module doc string)."""
    cls, config_cls, kwargs, _ = CASES[name]
    config = config_cls(vocab_size=VOCAB, bos_token_id=None, eos_token_id=None, **{**kwargs, **overrides})
    model = cls(config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            is_gain = pname.endswith("norm.weight")
            std = 0.05 if is_gain else 0.3 if pname.endswith("mlp.gate.weight") else 0.02
            p.copy_(torch.randn(p.shape, generator=gen) * std + (1.0 if is_gain else 0.0))
    return model


def tokens(seed=1):
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def ours_logits(model, idx):
    return model.eval()(idx)[..., :VOCAB]


@torch.no_grad()
def hf_logits(model, idx):
    return model(idx).logits


def assert_logits_close(a, b):
    diff = (a - b).abs().max().item()
    print(f"max |logit difference| = {diff:.3g}")  # pytest -s shows the measured differences
    assert diff <= 1e-5, diff


@pytest.mark.parametrize("name", list(CASES))
def test_from_hf_matches_hf_logits(name):
    hf = make_hf(name)
    ours = from_hf(hf)
    assert_logits_close(ours_logits(ours, tokens()), hf_logits(hf, tokens()))
    cfg = ours.cfg
    first_dense, every, norm_topk = CASES[name][3]
    assert (cfg.moe_first_dense, cfg.moe_every, cfg.moe_norm_topk) == (first_dense, every, norm_topk)
    assert cfg.qk_norm == name.startswith("qwen3") and cfg.moe_experts == hf.config.num_local_experts
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert [i for i, b in enumerate(ours.blocks) if isinstance(b.mlp, MoE)] == sparse
    assert padded_vocab_size(cfg) == 320 and torch.all(ours.tok_emb.weight[VOCAB:] == 0)
    assert (ours.lm_head.weight is ours.tok_emb.weight) == hf.config.tie_word_embeddings


@pytest.mark.parametrize("name", list(CASES))
def test_to_hf_round_trip_is_exact(name):
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
    with torch.no_grad():  # our init has unit norms: perturb everything; routers wider
        for pname, p in ours.named_parameters():
            noise = torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel()))
            p.add_(noise * (0.3 if pname.endswith("router.weight") else 0.05))
    config = hf_config(ours)
    hf = CASES[name][0](config).eval()
    hf.load_state_dict(to_hf(ours), strict=True)
    assert_logits_close(hf_logits(hf, tokens(2)), ours_logits(ours, tokens(2)))
    assert model_config_from_hf(config) == cfg  # the config survives the round trip too
    assert model_config_from_hf(json.loads(config.to_json_string())) == cfg  # ... and its JSON form


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe-first-dense"])
def test_from_saved_directory_both_expert_layouts(name, tmp_path):
    hf = make_hf(name)
    idx = tokens()
    # save_pretrained writes the Hub layout: one tensor per expert (Mixtral: block_sparse_moe.experts.N.w1 ...)
    hf.save_pretrained(tmp_path / "hub")
    from safetensors import safe_open

    with safe_open(str(tmp_path / "hub" / "model.safetensors"), "pt") as f:
        assert any(".experts.0." in k for k in f.keys()) and not any("gate_up_proj" in k for k in f.keys())
    assert_logits_close(ours_logits(from_hf(tmp_path / "hub"), idx), hf_logits(hf, idx))
    # The modules' fused layout (experts.gate_up_proj / down_proj) in a pytorch_model.bin, with a
    # Qwen3-MoE config as older transformers wrote it (num_experts, not num_local_experts).
    (tmp_path / "fused").mkdir()
    config = json.loads((tmp_path / "hub" / "config.json").read_text())
    if "num_local_experts" in config and name.startswith("qwen3"):
        config["num_experts"] = config.pop("num_local_experts")
    (tmp_path / "fused" / "config.json").write_text(json.dumps(config))
    torch.save(hf.state_dict(), tmp_path / "fused" / "pytorch_model.bin")
    assert_logits_close(ours_logits(from_hf(tmp_path / "fused"), idx), hf_logits(hf, idx))


@pytest.mark.parametrize("name", ["mixtral", "qwen3-moe-sparse-step"])
def test_save_hf_loads_with_from_pretrained(name, tmp_path):
    ours = from_hf(make_hf(name))
    out = save_hf(ours, tmp_path / "export")
    from safetensors import safe_open

    with safe_open(str(out / "model.safetensors"), "pt") as f:  # the Hub's per-expert file layout
        keys = set(f.keys())
    expert = "block_sparse_moe.experts.0.w1.weight" if name == "mixtral" else "mlp.experts.0.gate_proj.weight"
    assert f"model.layers.1.{expert}" in keys and not any("gate_up_proj" in k for k in keys)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert type(hf) is CASES[name][0]
    idx = tokens()
    assert_logits_close(hf_logits(hf, idx), ours_logits(ours, idx))
    torch.testing.assert_close(ours_logits(from_hf(out), idx), ours_logits(ours, idx), atol=0, rtol=0)


@pytest.mark.parametrize("name, overrides, feature", [
    ("mixtral", dict(sliding_window=8), "sliding_window=8"),
    ("mixtral", dict(hidden_act="gelu"), "hidden_act 'gelu'"),
    ("mixtral", dict(rope_scaling={"rope_type": "linear", "factor": 2.0}), "Mixtral.* rope scaling 'linear'"),
    ("qwen3-moe-norm-topk", dict(attention_bias=True), "attention_bias"),
    ("qwen3-moe-norm-topk", dict(head_dim=32), "head_dim=32"),
    ("qwen3-moe-norm-topk", dict(use_sliding_window=True, sliding_window=8), "sliding_window=8"),
    ("qwen3-moe-sparse-step", dict(decoder_sparse_step=1, mlp_only_layers=[2]), r"experts in blocks \[0, 1, 3\]"),
    ("qwen3-moe-norm-topk", dict(mlp_only_layers=[0, 1]), "no sparse block"),
])
def test_unsupported_hf_features_are_refused(name, overrides, feature):
    with pytest.raises(UserError, match=feature):
        from_hf(make_hf(name, **overrides))


def test_unsupported_moe_architecture_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2_moe",
                                                      "architectures": ["Qwen2MoeForCausalLM"]}))
    with pytest.raises(UserError, match="Qwen2MoeForCausalLM"):
        from_hf(tmp_path)


@pytest.mark.parametrize("name, change, message", [
    ("qwen3-moe-norm-topk", dict(moe_router="sigmoid"), "model.moe_router=softmax"),
    ("qwen3-moe-norm-topk", dict(moe_shared_experts=1), "moe_shared_experts"),
    ("qwen3-moe-norm-topk", dict(moe_route_scale=2.5), "moe_route_scale"),
    ("qwen3-moe-norm-topk", dict(moe_bias_rate=1e-3), "moe_bias_rate"),
    ("mixtral", dict(mlp="gelu"), "model.mlp=swiglu"),
    ("mixtral", dict(moe_norm_topk=False), "moe_norm_topk=false"),
    ("mixtral", dict(moe_first_dense=1), r"dense MLPs in blocks \[0\]"),
    ("mixtral", dict(moe_experts=0, qk_norm=True), "qk_norm"),  # a dense qk-norm model is no Llama either
])
def test_export_refuses_models_without_hf_equivalent(name, change, message):
    cfg = dataclasses.replace(from_hf(make_hf(name)).cfg, **change)
    with torch.device("meta"):
        model = Transformer(cfg)
    with pytest.raises(UserError, match=message):
        to_hf(model)


def test_export_refuses_a_balancing_bias():
    ours = from_hf(make_hf("mixtral"))
    with torch.no_grad():
        ours.blocks[1].mlp.expert_bias[2] = 1e-3  # picks other experts: HF has no such bias
    with pytest.raises(UserError, match="block 1 has a non-zero expert balancing bias"):
        to_hf(ours)


# --- slipstream checkpoint export --format hf of a trained MoE checkpoint ------------------------

@pytest.fixture(scope="module", params=["mixtral", "qwen3_moe"])
def moe_run(request, tmp_path_factory, data_dir):
    from slipstream.config import load_config
    from slipstream.train.lm import train_lm

    extra = [] if request.param == "mixtral" else [
        "--model.qk_norm=true", "--model.moe_first_dense=1", "--model.moe_norm_topk=false"]
    run = tmp_path_factory.mktemp("moe-export") / "run"
    train_lm(load_config(None, [
        "--model.preset=moe-tiny", f"--data.dir={data_dir}", f"--run.dir={run}", "--model.max_seq_len=32",
        "--train.max_steps=2", "--train.micro_batch_size=2", "--train.seq_len=16", "--train.eval_steps=0",
        "--optim.warmup_steps=1", "--logging.progress=false", *extra,
    ]))
    return request.param, run


def test_checkpoint_export_hf_of_moe_models(moe_run, tmp_path):
    from slipstream.checkpoint.export import export_checkpoint
    from slipstream.train.lm import load_lm_from_checkpoint

    family, run = moe_run
    model, _tok, cfg = load_lm_from_checkpoint(run, "cpu")
    out = export_checkpoint(run, "hf", tmp_path / "hf")
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, local_files_only=True).eval()
    assert hf.config.model_type == family
    idx = torch.randint(0, cfg.model.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert_logits_close(hf(idx).logits, model.eval()(idx)[..., :cfg.model.vocab_size])


def test_checkpoint_export_hf_refuses_an_inexpressible_moe(moe_run, tmp_path):
    import shutil

    from slipstream.checkpoint.export import export_checkpoint

    _family, run = moe_run
    src = next((run / "checkpoints").iterdir())
    copy = tmp_path / src.name
    shutil.copytree(src, copy)
    toml = (copy / "config.toml").read_text()
    assert 'moe_router = "softmax"' in toml
    (copy / "config.toml").write_text(toml.replace('moe_router = "softmax"', 'moe_router = "sigmoid"'))
    with pytest.raises(UserError, match="Mixtral / Qwen3-MoE.*moe_router.*--format safetensors"):
        export_checkpoint(copy, "hf", tmp_path / "o")
    assert not (tmp_path / "o").exists()
