"""Hugging Face interop: load GPT-2 / Llama checkpoints into our Transformer and back.

Two dense families are supported here, each mapped onto the one `Transformer`; the
mixture-of-experts ones (MixtralForCausalLM, Qwen3MoeForCausalLM) live in hf_moe.py, and the
functions below dispatch to it by `model_type` / architecture (export: model.moe_experts > 0):

  GPT2LMHeadModel   learned positions, LayerNorm, GELU(tanh), biases. Its linear layers are
                    `Conv1D` modules that store weights as (in, out), i.e. transposed from
                    nn.Linear, and `c_attn` fuses the q, k and v projections in that order.
  LlamaForCausalLM  RoPE, RMSNorm, SwiGLU, grouped-query attention. Same (out, in) layout
                    as ours, and our RoPE uses the same "rotate half" layout as HF Llama,
                    so q/k weights are copied without any permutation.

Our embedding and output head have `padded_vocab_size(cfg)` rows; loading copies the real
rows and zeroes the padding rows, exporting drops them again.

Anything the mapping cannot represent exactly (RoPE scaling, GPT-2 attention variants, an
activation other than the one we implement, ...) is refused with a UserError naming the
feature, rather than silently producing a model that computes something else.

`transformers` is an optional dependency: loading from a directory only needs
safetensors/torch; `hf_config` and `save_hf` need transformers and say so if it is missing.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.safe_read import HF_JSON, load_json_capped
from slipstream.models.transformer import (Transformer, kv_heads, mlp_hidden, padded_vocab_size,
                                           reset_position_buffers)

SUPPORTED_ARCHITECTURES = {"GPT2LMHeadModel": "gpt2", "LlamaForCausalLM": "llama",
                           "MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
_MOE_FAMILIES = ("mixtral", "qwen3_moe")  # mapped in hf_moe.py

# HF buffers that may appear in checkpoints but are not weights: GPT-2's causal-mask buffers
# (persistent in old transformers versions) and Llama's rotary frequencies. We rebuild both.
_IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", "rotary_emb.inv_freq", "rotary_emb.original_inv_freq")


# ----------------------------------------------------------------------------------------
# HF config -> ModelConfig


def model_config_from_hf(hf_cfg: Any) -> ModelConfig:
    """Our ModelConfig for a HF GPT-2 / Llama / Mixtral / Qwen3-MoE config (a transformers config or its dict)."""
    c = hf_cfg if isinstance(hf_cfg, dict) else hf_cfg.to_dict()
    family = _family_of_hf_config(c)
    if family in _MOE_FAMILIES:
        from slipstream.models.hf_moe import moe_model_config

        return moe_model_config(c, family)
    return _gpt2_model_config(c) if family == "gpt2" else _llama_model_config(c)


def _family_of_hf_config(c: dict) -> str:
    architectures = c.get("architectures") or []
    for arch in architectures:
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"unsupported Hugging Face architecture '{arch}'; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    model_type = c.get("model_type")
    if model_type not in SUPPORTED_ARCHITECTURES.values():
        raise UserError(f"unsupported Hugging Face model_type '{model_type}'; "
                        f"supported: {', '.join(SUPPORTED_ARCHITECTURES.values())}")
    return model_type


def _gpt2_model_config(c: dict) -> ModelConfig:
    # Variants that change the attention math: our attention is plain SDPA with 1/sqrt(head_dim).
    if not c.get("scale_attn_weights", True):
        raise UserError("GPT-2 with scale_attn_weights=false is not supported")
    for feature in ("scale_attn_by_inverse_layer_idx", "reorder_and_upcast_attn", "add_cross_attention"):
        if c.get(feature, False):
            raise UserError(f"GPT-2 with {feature}=true is not supported")
    activation = c.get("activation_function", "gelu_new")
    if activation not in ("gelu_new", "gelu_pytorch_tanh"):  # both are GELU with the tanh approximation
        raise UserError(f"GPT-2 activation_function '{activation}' is not supported; only gelu_new (GELU tanh)")
    d = c["n_embd"]
    return ModelConfig(
        preset="gpt2",  # family label only: every field below is explicit
        n_layer=c["n_layer"], n_head=c["n_head"], n_kv_head=0, d_model=d,
        d_ff=c.get("n_inner") or 4 * d,
        max_seq_len=c["n_positions"], vocab_size=c["vocab_size"],
        position="learned", norm="layernorm", norm_eps=c.get("layer_norm_epsilon", 1e-5), mlp="gelu",
        bias=True, tie_embeddings=c.get("tie_word_embeddings", True),
        # Dropout is a training choice, not part of the weights: start from 0 (exact inference).
        dropout=0.0, init_std=c.get("initializer_range", 0.02),
    )


def _llama_model_config(c: dict) -> ModelConfig:
    activation = c.get("hidden_act", "silu")
    if activation != "silu":
        raise UserError(f"Llama hidden_act '{activation}' is not supported; only silu (SwiGLU)")
    d, n_head = c["hidden_size"], c["num_attention_heads"]
    head_dim = c.get("head_dim") or d // n_head
    if head_dim * n_head != d:
        raise UserError(f"Llama head_dim={head_dim} with hidden_size={d} and {n_head} heads is not supported; "
                        f"our model needs head_dim = hidden_size / num_attention_heads")
    attention_bias, mlp_bias = c.get("attention_bias", False), c.get("mlp_bias", False)
    if attention_bias != mlp_bias:  # our single `bias` switch covers both
        raise UserError(f"Llama with attention_bias={attention_bias} but mlp_bias={mlp_bias} is not supported")
    return ModelConfig(
        preset="llama-1b",  # family label only: every field below is explicit
        n_layer=c["num_hidden_layers"], n_head=n_head, n_kv_head=c.get("num_key_value_heads") or n_head,
        d_model=d, d_ff=c["intermediate_size"],
        max_seq_len=c["max_position_embeddings"], vocab_size=c["vocab_size"],
        position="rope", rope_theta=_llama_rope_theta(c), norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-6),
        mlp="swiglu", bias=attention_bias, tie_embeddings=c.get("tie_word_embeddings", False),
        dropout=0.0, init_std=c.get("initializer_range", 0.02),
    )


def _llama_rope_theta(c: dict, arch: str = "Llama") -> float:
    """RoPE base from either config layout; only plain (unscaled) RoPE is supported.

    transformers 5 keeps it in `rope_parameters` = {"rope_type", "rope_theta", ...};
    older versions have a top-level `rope_theta` and an optional `rope_scaling` dict.
    """
    params = c.get("rope_parameters") or {}
    scaling = c.get("rope_scaling") or {}
    rope_type = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type") or "default"
    if rope_type != "default":
        raise UserError(f"{arch} rope scaling '{rope_type}' (rope_scaling / rope_parameters) is not supported; "
                        f"only plain RoPE")
    return float(params.get("rope_theta", c.get("rope_theta", 10000.0)))


# ----------------------------------------------------------------------------------------
# HF -> ours


def from_hf(model_or_dir: Any, device: str | torch.device = "cpu") -> Transformer:
    """Our Transformer (fp32, on `device`) with the weights of a HF GPT-2 / Llama / Mixtral / Qwen3-MoE model.

    `model_or_dir` is an instance of one of SUPPORTED_ARCHITECTURES, or a local directory with
    `config.json` and `model.safetensors` / `pytorch_model.bin` (or their sharded `.index.json`).
    Nothing is downloaded.
    """
    if isinstance(model_or_dir, (str, os.PathLike)):
        hf_cfg, hf_sd = _read_hf_dir(Path(model_or_dir))
    else:
        arch = type(model_or_dir).__name__
        if arch not in SUPPORTED_ARCHITECTURES:
            raise UserError(f"unsupported Hugging Face model class '{arch}'; "
                            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
        hf_cfg, hf_sd = model_or_dir.config.to_dict(), model_or_dir.state_dict()
    cfg = model_config_from_hf(hf_cfg)
    hf_sd = dict(hf_sd)  # we pop consumed entries; never mutate the caller's dict
    if cfg.moe_experts:
        from slipstream.models.hf_moe import moe_to_ours

        ours = moe_to_ours(hf_sd, cfg, _family_of_hf_config(hf_cfg))
    elif cfg.position == "learned":
        ours = _gpt2_to_ours(hf_sd, cfg)
    else:
        ours = _llama_to_ours(hf_sd, cfg)
    leftover = [k for k in hf_sd if not k.endswith(_IGNORED_SUFFIXES)]
    if leftover:
        raise UserError(f"the Hugging Face checkpoint has weights our model has no place for: "
                        f"{', '.join(sorted(leftover)[:5])}{' ...' if len(leftover) > 5 else ''}")
    return _build_with_weights(cfg, ours, device)


def _read_hf_dir(directory: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    if not (directory / "config.json").is_file():
        raise UserError(f"'{directory}' is not a Hugging Face model directory (no config.json); "
                        f"pass a local directory saved with save_pretrained (nothing is downloaded)")
    hf_cfg = _read_hf_json(directory / "config.json")
    _family_of_hf_config(hf_cfg)  # refuse unsupported models before reading gigabytes of weights
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (directory / name).is_file():
            return hf_cfg, _load_weight_file(directory / name)
    for name in ("model.safetensors.index.json", "pytorch_model.bin.index.json"):
        if (directory / name).is_file():
            weight_map = _read_hf_json(directory / name).get("weight_map")
            shards = set(weight_map.values()) if isinstance(weight_map, dict) else {None}
            # A shard is a file of this folder: never a path that leads out of it.
            if not all(isinstance(s, str) and s == Path(s).name and s not in ("", ".", "..") for s in shards):
                raise UserError(f"{directory / name}: 'weight_map' must map weight names to file names "
                                f"inside '{directory}'")
            sd = {}
            for shard in sorted(shards):
                sd.update(_load_weight_file(directory / shard))
            return hf_cfg, sd
    raise UserError(f"no weights in '{directory}': expected model.safetensors or pytorch_model.bin "
                    f"(or a sharded .index.json)")


def _read_hf_json(path: Path) -> dict:
    """A JSON object of a HF folder (config.json, *.index.json), read under a size and depth cap."""
    try:
        value = load_json_capped(path, HF_JSON)
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable or not JSON ({e}); re-save the model with save_pretrained") from None
    if not isinstance(value, dict):
        raise UserError(f"{path} holds a JSON {type(value).__name__}, not an object; it is not a Hugging Face file")
    return value


def _load_weight_file(path: Path) -> dict[str, torch.Tensor]:
    if path.suffix == ".safetensors":
        from safetensors.torch import load_file

        # safetensors bounds its own header (100 MB) and checks offsets against the file size;
        # a damaged file raises its SafetensorError, which is the user's to fix.
        try:
            return load_file(str(path))
        except Exception as e:  # noqa: BLE001 - SafetensorError and OSError alike
            raise UserError(f"{path} is not a valid safetensors file ({e})") from None
    # weights_only: a pickle from the internet must not be able to run code.
    return torch.load(path, map_location="cpu", weights_only=True)


def _take(sd: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in sd:
        raise UserError(f"the Hugging Face checkpoint is missing weight '{name}'")
    return sd.pop(name)


def _pad_rows(weight: torch.Tensor, cfg: ModelConfig, name: str) -> torch.Tensor:
    """Real vocabulary rows, then zero rows up to our padded vocabulary."""
    if weight.shape[0] != cfg.vocab_size:
        raise UserError(f"'{name}' has {weight.shape[0]} rows but config vocab_size is {cfg.vocab_size}")
    padded = torch.zeros(padded_vocab_size(cfg), weight.shape[1], dtype=weight.dtype, device=weight.device)
    padded[: cfg.vocab_size] = weight
    return padded


def _gpt2_to_ours(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    # Hub checkpoints of the original GPT-2 store keys without the "transformer." prefix.
    for key in list(hf):
        if not key.startswith(("transformer.", "lm_head.")):
            hf["transformer." + key] = hf.pop(key)
    d = cfg.d_model
    ours = {
        "tok_emb.weight": _pad_rows(_take(hf, "transformer.wte.weight"), cfg, "transformer.wte.weight"),
        "pos_emb.weight": _take(hf, "transformer.wpe.weight"),
    }
    for i in range(cfg.n_layer):
        h, b = f"transformer.h.{i}.", f"blocks.{i}."
        # Conv1D stores (in, out): transpose to nn.Linear's (out, in). c_attn columns are [q | k | v].
        qkv_w, qkv_b = _take(hf, h + "attn.c_attn.weight").t(), _take(hf, h + "attn.c_attn.bias")
        for j, proj in enumerate(("q_proj", "k_proj", "v_proj")):
            ours[b + f"attn.{proj}.weight"] = qkv_w[j * d:(j + 1) * d]
            ours[b + f"attn.{proj}.bias"] = qkv_b[j * d:(j + 1) * d]
        ours[b + "attn.o_proj.weight"] = _take(hf, h + "attn.c_proj.weight").t()
        ours[b + "attn.o_proj.bias"] = _take(hf, h + "attn.c_proj.bias")
        ours[b + "mlp.up_proj.weight"] = _take(hf, h + "mlp.c_fc.weight").t()
        ours[b + "mlp.up_proj.bias"] = _take(hf, h + "mlp.c_fc.bias")
        ours[b + "mlp.down_proj.weight"] = _take(hf, h + "mlp.c_proj.weight").t()
        ours[b + "mlp.down_proj.bias"] = _take(hf, h + "mlp.c_proj.bias")
        for hf_norm, our_norm in (("ln_1", "attn_norm"), ("ln_2", "mlp_norm")):
            ours[b + f"{our_norm}.weight"] = _take(hf, h + f"{hf_norm}.weight")
            ours[b + f"{our_norm}.bias"] = _take(hf, h + f"{hf_norm}.bias")
    ours["final_norm.weight"] = _take(hf, "transformer.ln_f.weight")
    ours["final_norm.bias"] = _take(hf, "transformer.ln_f.bias")
    _head_to_ours(hf, ours, cfg)
    return ours


def _llama_to_ours(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    ours = {"tok_emb.weight": _pad_rows(_take(hf, "model.embed_tokens.weight"), cfg, "model.embed_tokens.weight")}
    names = [("self_attn.q_proj", "attn.q_proj"), ("self_attn.k_proj", "attn.k_proj"),
             ("self_attn.v_proj", "attn.v_proj"), ("self_attn.o_proj", "attn.o_proj"),
             ("mlp.gate_proj", "mlp.gate_proj"), ("mlp.up_proj", "mlp.up_proj"), ("mlp.down_proj", "mlp.down_proj")]
    for i in range(cfg.n_layer):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for hf_name, our_name in names:
            ours[b + our_name + ".weight"] = _take(hf, h + hf_name + ".weight")
            if cfg.bias:
                ours[b + our_name + ".bias"] = _take(hf, h + hf_name + ".bias")
        ours[b + "attn_norm.weight"] = _take(hf, h + "input_layernorm.weight")
        ours[b + "mlp_norm.weight"] = _take(hf, h + "post_attention_layernorm.weight")
    ours["final_norm.weight"] = _take(hf, "model.norm.weight")
    _head_to_ours(hf, ours, cfg)
    return ours


def _head_to_ours(hf: dict[str, torch.Tensor], ours: dict[str, torch.Tensor], cfg: ModelConfig) -> None:
    if cfg.tie_embeddings:
        # Tied: the head is the embedding. An instance's state_dict also lists lm_head.weight
        # (the same tensor); saved files usually omit it.
        hf.pop("lm_head.weight", None)
        ours["lm_head.weight"] = ours["tok_emb.weight"]
    else:
        ours["lm_head.weight"] = _pad_rows(_take(hf, "lm_head.weight"), cfg, "lm_head.weight")


def _build_with_weights(cfg: ModelConfig, ours: dict[str, torch.Tensor], device) -> Transformer:
    """Allocate the model on `device` without a random init, then copy every weight in.

    Like `materialize`, but the values come from the checkpoint instead of the seed, which
    matters for billion-parameter models where the random init alone takes minutes.
    """
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device=device)
    if cfg.tie_embeddings:  # to_empty() re-creates parameters; re-tie them
        model.lm_head.weight = model.tok_emb.weight
    with torch.no_grad():
        try:
            model.load_state_dict(ours, strict=True)
        except RuntimeError as e:  # shape mismatch: the weights do not fit their own config
            raise UserError(f"Hugging Face weights do not match their config: {e}") from None
        reset_position_buffers(model)  # non-persistent buffers: recompute from the config
    return model


# ----------------------------------------------------------------------------------------
# ours -> HF


def hf_family(cfg: ModelConfig) -> str:
    """'gpt2', 'llama', 'mixtral' or 'qwen3_moe': which HF architecture represents `cfg` exactly (else UserError)."""
    if cfg.logit_softcap > 0:
        raise UserError(f"model.logit_softcap = {cfg.logit_softcap:g} caps the logits, which GPT2LMHeadModel, "
                        "LlamaForCausalLM, MixtralForCausalLM and Qwen3MoeForCausalLM cannot express; it has no "
                        "Hugging Face equivalent (export a model trained with model.logit_softcap = 0)")
    if cfg.mlp == "relu2":
        raise UserError("model.mlp = relu2 (ReLU² MLP) has no Hugging Face equivalent: GPT-2 uses GELU and "
                        "Llama-family models SwiGLU; export a model trained with model.mlp = gelu or swiglu")
    # Architecture switches GPT2LMHeadModel, LlamaForCausalLM and the MoE families cannot express.
    unexpressed = [(cfg.position == "alibi", "model.position = alibi", "BLOOM's / MPT's ALiBi attention bias"),
                   (cfg.rotary_fraction != 1.0, f"model.rotary_fraction = {cfg.rotary_fraction:g}",
                    "GPT-NeoX's partial rotary"),
                   (cfg.mlp == "relu", "model.mlp = relu", "OPT's ReLU MLP"),
                   (cfg.parallel_block, "model.parallel_block = true", "GPT-J's / GPT-NeoX's parallel block"),
                   (cfg.embedding_norm, "model.embedding_norm = true", "BLOOM's embedding norm")]
    for on, switch, what in unexpressed:
        if on:
            raise UserError(f"{switch} ({what}) has no equivalent in the Hugging Face architectures slipstream "
                            f"exports ({', '.join(SUPPORTED_ARCHITECTURES)}); export a model trained without it, "
                            "or keep the slipstream checkpoint")
    if cfg.moe_experts:
        from slipstream.models.hf_moe import moe_family

        return moe_family(cfg)
    family = "gpt2" if cfg.position == "learned" else "llama"
    if family == "gpt2":
        wanted = dict(norm="layernorm", mlp="gelu", bias=True, qk_norm=False)
        if kv_heads(cfg) != cfg.n_head:
            raise UserError(f"GPT-2 has no grouped-query attention; n_kv_head={cfg.n_kv_head} "
                            f"!= n_head={cfg.n_head} cannot be exported")
    else:
        wanted = dict(norm="rmsnorm", mlp="swiglu", qk_norm=False)
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            arch = "GPT2LMHeadModel" if family == "gpt2" else "LlamaForCausalLM"
            raise UserError(f"model.position={cfg.position} maps to {arch}, which needs model.{field}={value}, "
                            f"but this model has {getattr(cfg, field)}; it has no Hugging Face equivalent")
    return family


def _export(t: torch.Tensor) -> torch.Tensor:
    # A contiguous copy: safetensors needs contiguous tensors, and the caller may edit the
    # result without touching our model.
    return t.detach().clone(memory_format=torch.contiguous_format)


def to_hf(model: Transformer) -> dict[str, torch.Tensor]:
    """A state dict with HF names for GPT2LMHeadModel (position=learned) or LlamaForCausalLM (rope).

    Padding vocabulary rows are dropped. Tensors stay on the model's device. Load it with
    `hf_model.load_state_dict(sd, strict=True)` into a model built from `hf_config(model)`.
    Causal-mask buffers: GPT-2's `attn.bias`/`attn.masked_bias` are gone in transformers 5
    and non-persistent (not in state dicts) in recent 4.x; only old versions that still list
    them as persistent buffers need `strict=False` (they are masks the HF model builds itself).
    Llama's `rotary_emb.inv_freq` is non-persistent as well. With tied embeddings the dict has
    both the embedding and `lm_head.weight`, as the same tensor, like HF's own state dict.
    """
    cfg = model.cfg
    family = hf_family(cfg)
    if family in _MOE_FAMILIES:
        from slipstream.models.hf_moe import ours_to_hf_moe

        return ours_to_hf_moe(model, family)
    if family == "gpt2":
        return _ours_to_gpt2(model)
    return _ours_to_llama(model)


def to_hf_files(model: Transformer) -> dict[str, torch.Tensor]:
    """`to_hf` in the layout of HF's saved files (what save_pretrained writes): MoE experts one
    tensor per expert, as on the Hub, instead of the modules' fused 3-D tensors. Dense models: to_hf."""
    family = hf_family(model.cfg)
    if family in _MOE_FAMILIES:
        from slipstream.models.hf_moe import ours_to_hf_moe

        return ours_to_hf_moe(model, family, per_expert=True)
    return to_hf(model)


def _ours_to_gpt2(model: Transformer) -> dict[str, torch.Tensor]:
    cfg, vocab = model.cfg, model.cfg.vocab_size
    sd = {"transformer.wte.weight": _export(model.tok_emb.weight[:vocab]),
          "transformer.wpe.weight": _export(model.pos_emb.weight)}
    for i, block in enumerate(model.blocks):
        h, attn, mlp = f"transformer.h.{i}.", block.attn, block.mlp
        sd[h + "ln_1.weight"] = _export(block.attn_norm.weight)
        sd[h + "ln_1.bias"] = _export(block.attn_norm.bias)
        # nn.Linear (out, in) -> Conv1D (in, out); q, k, v fused along the output dim.
        qkv = torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight], dim=0)
        sd[h + "attn.c_attn.weight"] = _export(qkv.t())
        sd[h + "attn.c_attn.bias"] = _export(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        sd[h + "attn.c_proj.weight"] = _export(attn.o_proj.weight.t())
        sd[h + "attn.c_proj.bias"] = _export(attn.o_proj.bias)
        sd[h + "ln_2.weight"] = _export(block.mlp_norm.weight)
        sd[h + "ln_2.bias"] = _export(block.mlp_norm.bias)
        sd[h + "mlp.c_fc.weight"] = _export(mlp.up_proj.weight.t())
        sd[h + "mlp.c_fc.bias"] = _export(mlp.up_proj.bias)
        sd[h + "mlp.c_proj.weight"] = _export(mlp.down_proj.weight.t())
        sd[h + "mlp.c_proj.bias"] = _export(mlp.down_proj.bias)
    sd["transformer.ln_f.weight"] = _export(model.final_norm.weight)
    sd["transformer.ln_f.bias"] = _export(model.final_norm.bias)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["transformer.wte.weight"]
    else:
        sd["lm_head.weight"] = _export(model.lm_head.weight[:vocab])
    return sd


def _ours_to_llama(model: Transformer) -> dict[str, torch.Tensor]:
    cfg, vocab = model.cfg, model.cfg.vocab_size
    sd = {"model.embed_tokens.weight": _export(model.tok_emb.weight[:vocab])}
    for i, block in enumerate(model.blocks):
        h = f"model.layers.{i}."
        linears = {"self_attn.q_proj": block.attn.q_proj, "self_attn.k_proj": block.attn.k_proj,
                   "self_attn.v_proj": block.attn.v_proj, "self_attn.o_proj": block.attn.o_proj,
                   "mlp.gate_proj": block.mlp.gate_proj, "mlp.up_proj": block.mlp.up_proj,
                   "mlp.down_proj": block.mlp.down_proj}
        for name, linear in linears.items():
            sd[h + name + ".weight"] = _export(linear.weight)
            if cfg.bias:
                sd[h + name + ".bias"] = _export(linear.bias)
        sd[h + "input_layernorm.weight"] = _export(block.attn_norm.weight)
        sd[h + "post_attention_layernorm.weight"] = _export(block.mlp_norm.weight)
    sd["model.norm.weight"] = _export(model.final_norm.weight)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        sd["lm_head.weight"] = _export(model.lm_head.weight[:vocab])
    return sd


def _import_transformers():
    try:
        import transformers
    except ImportError:
        raise UserError("this needs the optional 'transformers' package: pip install transformers") from None
    return transformers


def hf_config(model: Transformer):
    """The transformers GPT2Config / LlamaConfig (MixtralConfig / Qwen3MoeConfig) describing `model`.

    `transformers.GPT2LMHeadModel(hf_config(m))` (or LlamaForCausalLM) plus
    `load_state_dict(to_hf(m))` gives a HF model computing the same logits.
    """
    transformers = _import_transformers()
    cfg = model.cfg
    family = hf_family(cfg)
    if family in _MOE_FAMILIES:
        from slipstream.models.hf_moe import moe_hf_config

        return moe_hf_config(model, family)
    # Token ids are only meaningful for the GPT-2 tokenizer's vocabulary (<|endoftext|> = 50256);
    # otherwise leave them unset rather than point outside the vocabulary.
    end_of_text = 50256 if cfg.vocab_size == 50257 else None
    if family == "gpt2":
        return transformers.GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.max_seq_len, n_embd=cfg.d_model, n_layer=cfg.n_layer,
            n_head=cfg.n_head, n_inner=mlp_hidden(cfg), activation_function="gelu_new",
            layer_norm_epsilon=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            resid_pdrop=cfg.dropout, embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout,
            initializer_range=cfg.init_std, bos_token_id=end_of_text, eos_token_id=end_of_text,
            architectures=["GPT2LMHeadModel"],
        )
    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, intermediate_size=mlp_hidden(cfg),
        num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=kv_heads(cfg),
        head_dim=cfg.d_model // cfg.n_head, max_position_embeddings=cfg.max_seq_len,
        rms_norm_eps=cfg.norm_eps, rope_theta=cfg.rope_theta,  # transformers 5 moves it into rope_parameters
        tie_word_embeddings=cfg.tie_embeddings, attention_bias=cfg.bias, mlp_bias=cfg.bias, hidden_act="silu",
        attention_dropout=cfg.dropout, initializer_range=cfg.init_std, bos_token_id=None, eos_token_id=None,
        architectures=["LlamaForCausalLM"],
    )


def save_hf(model: Transformer, out_dir: str | Path) -> Path:
    """Write `config.json` + `model.safetensors` that HF `from_pretrained(out_dir)` loads.

    Atomic: files are written into a temporary directory next to `out_dir`, which is then
    renamed into place, so a crash never leaves a half-written model. An existing `out_dir`
    is replaced only if it holds nothing but a previous export (never deletes other files).
    """
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    if out_dir.is_file():
        raise UserError(f"'{out_dir}' is a file; save_hf needs a directory path")
    if out_dir.is_dir():
        other = sorted(p.name for p in out_dir.iterdir() if p.name not in ("config.json", "model.safetensors"))
        if other:
            raise UserError(f"'{out_dir}' exists and holds other files ({', '.join(other[:3])}); "
                            f"choose a new or empty directory for save_hf")
    config = hf_config(model)
    sd = {k: v.cpu() for k, v in to_hf_files(model).items()}
    if model.cfg.tie_embeddings:
        # safetensors refuses tensors that share memory; HF re-ties the head when loading.
        del sd["lm_head.weight"]
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        config.save_pretrained(tmp)
        save_file(sd, str(tmp / "model.safetensors"), metadata={"format": "pt"})  # HF checks this metadata
        if out_dir.exists():
            shutil.rmtree(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out_dir
