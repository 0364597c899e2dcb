"""Hugging Face interop for mixture-of-experts models: Mixtral and Qwen3-MoE.

hf.py dispatches here by `model_type` / architecture (and, for export, when model.moe_experts > 0);
its reading of HF folders (config.json, safetensors or weights_only pickles, shard maps) and its
error style apply unchanged. Both architectures are our rope / rmsnorm / swiglu Transformer with
an `MoE` MLP: a softmax router, top-k, SwiGLU experts, no biases.

  MixtralForCausalLM   experts in every block; the top-k weights are always renormalized
                       (model.moe_norm_topk = true); no qk-norm. `intermediate_size` is the
                       experts' width (we map it to d_ff, moe_expert_hidden = 0).
  Qwen3MoeForCausalLM  per-head q/k RMSNorm (model.qk_norm); `norm_topk_prob` = moe_norm_topk;
                       experts are `moe_intermediate_size` wide (moe_expert_hidden), dense blocks
                       `intermediate_size` (d_ff). A block is sparse when it is not in
                       `mlp_only_layers` and (index + 1) % `decoder_sparse_step` == 0; we import
                       the layouts our (moe_first_dense, moe_every) rule expresses (every one the
                       export writes) and refuse the others.

Weight names. transformers 5 modules hold each layer's experts fused: `mlp.experts.gate_up_proj`
(E, 2 * hidden, d) = [gate | up] along dim 1 and `mlp.experts.down_proj` (E, d, hidden), both
nn.Linear (out, in) layout, as our `experts.w_gate` / `w_up` / `w_down`; the router is `mlp.gate.weight`.
Saved files (Hub checkpoints, and save_pretrained of transformers 5, which reverts its conversion
mapping) hold one tensor per expert instead: Mixtral `block_sparse_moe.experts.{e}.w1` (gate),
`w3` (up), `w2` (down) with the router at `block_sparse_moe.gate`; Qwen3-MoE
`mlp.experts.{e}.gate_proj` / `up_proj` / `down_proj`. Import accepts both layouts, as
transformers' own loader does; `to_hf` gives the module layout (for `load_state_dict`), and the
folders written by `save_hf` / `checkpoint export` use the per-expert file layout, which
transformers 4 and 5 (and other Hub tooling) load.

Not representable, refused with a UserError: sliding-window attention shorter than the context,
rope scaling, attention biases, a head_dim other than hidden_size / heads, an activation other than
silu, and Qwen3-MoE sparse-layer layouts outside our rule; on export, a sigmoid router, a route
scale, shared experts, the balancing bias (moe_bias_rate > 0: it changes which experts are picked),
and MoE models that neither architecture describes (no qk_norm with dense blocks or without
moe_norm_topk). Training-only settings are not weights: router jitter and dropout import as 0,
HF's `router_aux_loss_coef` becomes moe_aux_loss (HF sums its loss over the k choices and all
layers at once, ours per layer: the scale differs), and a model trained with capacity dropping
(moe_dropless = false) exports as what HF computes, dropless.
"""

from __future__ import annotations

from typing import Any

import torch

from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.models.moe import MoE, expert_hidden, is_moe_layer
from slipstream.models.transformer import Transformer, kv_heads, mlp_hidden

MOE_ARCHITECTURES = {"MixtralForCausalLM": "mixtral", "Qwen3MoeForCausalLM": "qwen3_moe"}
_ARCH = {family: arch for arch, family in MOE_ARCHITECTURES.items()}

# Per-expert file names of (gate, up, down), and where a layer's MoE lives in saved files.
_EXPERT_NAMES = {"mixtral": ("w1", "w3", "w2"), "qwen3_moe": ("gate_proj", "up_proj", "down_proj")}
_FILE_MLP = {"mixtral": "block_sparse_moe", "qwen3_moe": "mlp"}


# ----------------------------------------------------------------------------------------
# HF config -> ModelConfig


def moe_model_config(c: dict, family: str) -> ModelConfig:
    """Our ModelConfig for a HF Mixtral / Qwen3-MoE config dict."""
    from slipstream.models.hf import _llama_rope_theta

    arch = _ARCH[family]
    activation = c.get("hidden_act", "silu")
    if activation != "silu":
        raise UserError(f"{arch} hidden_act '{activation}' is not supported; only silu (SwiGLU experts)")
    d, n_head, n_layer = c["hidden_size"], c["num_attention_heads"], c["num_hidden_layers"]
    head_dim = c.get("head_dim") or d // n_head
    if head_dim * n_head != d:
        raise UserError(f"{arch} head_dim={head_dim} with hidden_size={d} and {n_head} heads is not supported; "
                        f"our model needs head_dim = hidden_size / num_attention_heads")
    if c.get("attention_bias", False):
        raise UserError(f"{arch} with attention_bias=true is not supported (its MLPs have no biases; our single "
                        f"`bias` switch covers both)")
    _check_sliding_window(c, family)
    # transformers 5 names the expert count num_local_experts for both (Qwen3-MoE's attribute_map);
    # Qwen3-MoE configs saved by older versions say num_experts.
    experts = c.get("num_local_experts") or c.get("num_experts")
    top_k = c.get("num_experts_per_tok")
    if not isinstance(experts, int) or not isinstance(top_k, int) or not 1 <= top_k <= experts:
        raise UserError(f"{arch} config needs num_local_experts (or num_experts) >= num_experts_per_tok >= 1; "
                        f"got {experts} experts, top-{top_k}")
    common = dict(
        n_layer=n_layer, n_head=n_head, n_kv_head=c.get("num_key_value_heads") or n_head, d_model=d,
        max_seq_len=c["max_position_embeddings"], vocab_size=c["vocab_size"],
        position="rope", rope_theta=_llama_rope_theta(c, arch), norm="rmsnorm", norm_eps=c.get("rms_norm_eps", 1e-6),
        mlp="swiglu", bias=False, tie_embeddings=c.get("tie_word_embeddings", False),
        # Dropout and router jitter are training choices, not part of the weights: start from 0.
        dropout=0.0, init_std=c.get("initializer_range", 0.02),
        moe_experts=experts, moe_top_k=top_k, moe_router="softmax", moe_route_scale=1.0,
        moe_aux_loss=float(c.get("router_aux_loss_coef", 0.001)), moe_shared_experts=0,
    )
    if family == "mixtral":
        return ModelConfig(preset="mixtral-8x7b",  # family label only: every field that matters is explicit
                           d_ff=c["intermediate_size"], qk_norm=False, moe_norm_topk=True,
                           moe_every=1, moe_first_dense=0, moe_expert_hidden=0, **common)
    first_dense, every = _qwen3_sparse_layout(c, n_layer)
    return ModelConfig(preset="moe-tiny",  # family label only
                       d_ff=c["intermediate_size"], qk_norm=True, moe_norm_topk=bool(c.get("norm_topk_prob", False)),
                       moe_every=every, moe_first_dense=first_dense, moe_expert_hidden=c["moe_intermediate_size"],
                       **common)


def _check_sliding_window(c: dict, family: str) -> None:
    """A window at least as long as the context is plain causal attention; a shorter one is refused."""
    window = c.get("sliding_window")
    if family == "qwen3_moe" and not c.get("use_sliding_window", False):
        return  # Qwen3-MoE configs carry a sliding_window that only use_sliding_window turns on
    if window is not None and window < c["max_position_embeddings"]:
        raise UserError(f"{_ARCH[family]} with sliding_window={window} (< max_position_embeddings="
                        f"{c['max_position_embeddings']}) is not supported; our attention is full causal attention")


def _qwen3_sparse_layout(c: dict, n_layer: int) -> tuple[int, int]:
    """(moe_first_dense, moe_every) giving exactly Qwen3-MoE's sparse blocks, or UserError."""
    step, only = c.get("decoder_sparse_step", 1), c.get("mlp_only_layers") or []
    if not isinstance(step, int) or step < 1 or not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise UserError(f"Qwen3MoeForCausalLM config: decoder_sparse_step must be an integer >= 1 and mlp_only_layers "
                        f"a list of block indices; got {step!r} and {only!r}")
    sparse = [i for i in range(n_layer) if i not in only and (i + 1) % step == 0]
    if not sparse:
        raise UserError(f"Qwen3MoeForCausalLM with no sparse block (decoder_sparse_step={step}, mlp_only_layers="
                        f"{only}) is a dense model; it is not supported")
    first = sparse[0]
    every = sparse[1] - sparse[0] if len(sparse) > 1 else n_layer - first
    if [i for i in range(n_layer) if i >= first and (i - first) % every == 0] != sparse:
        raise UserError(f"Qwen3MoeForCausalLM with experts in blocks {sparse} (decoder_sparse_step={step}, "
                        f"mlp_only_layers={only}) is not supported: our model has experts in every "
                        f"moe_every-th block after the first moe_first_dense blocks")
    return first, every


# ----------------------------------------------------------------------------------------
# HF -> ours


def moe_to_ours(hf: dict[str, torch.Tensor], cfg: ModelConfig, family: str) -> dict[str, torch.Tensor]:
    """Our state dict from a Mixtral / Qwen3-MoE one (module or per-expert file layout); pops what it uses."""
    from slipstream.models.hf import _head_to_ours, _pad_rows, _take

    if family == "mixtral":  # the file layout's block name (transformers' own WeightRenaming)
        for key in [k for k in hf if ".block_sparse_moe." in k]:
            hf[key.replace(".block_sparse_moe.", ".mlp.")] = hf.pop(key)
    ours = {"tok_emb.weight": _pad_rows(_take(hf, "model.embed_tokens.weight"), cfg, "model.embed_tokens.weight")}
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if cfg.qk_norm else [])
    for i in range(cfg.n_layer):
        h, b = f"model.layers.{i}.", f"blocks.{i}."
        for name in attn:
            ours[b + f"attn.{name}.weight"] = _take(hf, h + f"self_attn.{name}.weight")
        ours[b + "attn_norm.weight"] = _take(hf, h + "input_layernorm.weight")
        ours[b + "mlp_norm.weight"] = _take(hf, h + "post_attention_layernorm.weight")
        if not is_moe_layer(cfg, i):  # a Qwen3-MoE dense block: the Llama MLP names
            for name in ("gate_proj", "up_proj", "down_proj"):
                ours[b + f"mlp.{name}.weight"] = _take(hf, h + f"mlp.{name}.weight")
            continue
        ours[b + "mlp.router.weight"] = _take(hf, h + "mlp.gate.weight")
        w_gate, w_up, w_down = _experts_to_ours(hf, h + "mlp.experts.", cfg, family)
        ours[b + "mlp.experts.w_gate"], ours[b + "mlp.experts.w_up"], ours[b + "mlp.experts.w_down"] = w_gate, w_up, w_down
        ours[b + "mlp.expert_bias"] = torch.zeros(cfg.moe_experts, dtype=w_up.dtype, device=w_up.device)
    ours["final_norm.weight"] = _take(hf, "model.norm.weight")
    _head_to_ours(hf, ours, cfg)
    return ours


def _experts_to_ours(hf: dict[str, torch.Tensor], prefix: str, cfg: ModelConfig, family: str):
    """(w_gate, w_up, w_down) of one layer, each (E, out, in), from fused or per-expert weights."""
    from slipstream.models.hf import _take

    E = cfg.moe_experts
    if prefix + "gate_up_proj" in hf:
        gate_up, down = _take(hf, prefix + "gate_up_proj"), _take(hf, prefix + "down_proj")
        if gate_up.dim() != 3 or gate_up.shape[0] != E or gate_up.shape[1] % 2:
            raise UserError(f"'{prefix}gate_up_proj' has shape {tuple(gate_up.shape)}; expected "
                            f"({E}, 2 x expert hidden, hidden_size)")
        hidden = gate_up.shape[1] // 2
        return gate_up[:, :hidden], gate_up[:, hidden:], down
    gate, up, down = _EXPERT_NAMES[family]
    try:
        return tuple(torch.stack([_take(hf, f"{prefix}{e}.{name}.weight") for e in range(E)])
                     for name in (gate, up, down))
    except RuntimeError as e:  # experts of different shapes
        raise UserError(f"the experts under '{prefix}' do not all have the same shape: {e}") from None


# ----------------------------------------------------------------------------------------
# ours -> HF


def moe_family(cfg: ModelConfig) -> str:
    """'mixtral' or 'qwen3_moe': the HF architecture representing an MoE `cfg` exactly (else UserError)."""
    wanted = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, moe_router="softmax",
                  moe_route_scale=1.0, moe_shared_experts=0, moe_bias_rate=0.0)
    for field, value in wanted.items():
        if getattr(cfg, field) != value:
            raise UserError(f"an MoE model maps to MixtralForCausalLM or Qwen3MoeForCausalLM, which need "
                            f"model.{field}={value}, but this model has {getattr(cfg, field)}; it has no "
                            f"Hugging Face equivalent")
    if cfg.qk_norm:
        return "qwen3_moe"
    dense = [i for i in range(cfg.n_layer) if not is_moe_layer(cfg, i)]
    if dense or not cfg.moe_norm_topk:
        what = f"dense MLPs in blocks {dense}" if dense else "model.moe_norm_topk=false"
        raise UserError(f"an MoE model without qk_norm maps to MixtralForCausalLM, which has experts in every "
                        f"block and renormalized top-k weights, but this model has {what} (Qwen3MoeForCausalLM "
                        f"expresses that, with model.qk_norm=true); it has no Hugging Face equivalent")
    return "mixtral"


def ours_to_hf_moe(model: Transformer, family: str, per_expert: bool = False) -> dict[str, torch.Tensor]:
    """HF names for MixtralForCausalLM / Qwen3MoeForCausalLM: the module layout (fused experts), or with
    `per_expert` the layout of saved files (one tensor per expert, as on the Hub)."""
    from slipstream.models.hf import _export

    cfg, vocab = model.cfg, model.cfg.vocab_size
    sd = {"model.embed_tokens.weight": _export(model.tok_emb.weight[:vocab])}
    attn = ["q_proj", "k_proj", "v_proj", "o_proj"] + (["q_norm", "k_norm"] if cfg.qk_norm else [])
    for i, block in enumerate(model.blocks):
        h = f"model.layers.{i}."
        for name in attn:
            sd[h + f"self_attn.{name}.weight"] = _export(getattr(block.attn, name).weight)
        sd[h + "input_layernorm.weight"] = _export(block.attn_norm.weight)
        sd[h + "post_attention_layernorm.weight"] = _export(block.mlp_norm.weight)
        mlp = block.mlp
        if not isinstance(mlp, MoE):
            for name in ("gate_proj", "up_proj", "down_proj"):
                sd[h + f"mlp.{name}.weight"] = _export(getattr(mlp, name).weight)
            continue
        if torch.any(mlp.expert_bias != 0):
            raise UserError(f"block {i} has a non-zero expert balancing bias (moe_bias_rate); it changes which experts "
                            f"are picked and {_ARCH[family]} has no such bias: it has no Hugging Face equivalent")
        ex = mlp.experts
        if per_expert:
            p = h + _FILE_MLP[family] + "."
            sd[p + "gate.weight"] = _export(mlp.router.weight)
            for e in range(cfg.moe_experts):
                for name, w in zip(_EXPERT_NAMES[family], (ex.w_gate, ex.w_up, ex.w_down)):
                    sd[p + f"experts.{e}.{name}.weight"] = _export(w[e])
        else:
            sd[h + "mlp.gate.weight"] = _export(mlp.router.weight)
            sd[h + "mlp.experts.gate_up_proj"] = _export(torch.cat([ex.w_gate, ex.w_up], dim=1))
            sd[h + "mlp.experts.down_proj"] = _export(ex.w_down)
    sd["model.norm.weight"] = _export(model.final_norm.weight)
    if cfg.tie_embeddings:
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
    else:
        sd["lm_head.weight"] = _export(model.lm_head.weight[:vocab])
    return sd


def moe_hf_config(model: Transformer, family: str) -> Any:
    """The transformers MixtralConfig / Qwen3MoeConfig describing `model`."""
    from slipstream.models.hf import _import_transformers

    transformers = _import_transformers()
    cfg = model.cfg
    common = dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layer,
        num_attention_heads=cfg.n_head, num_key_value_heads=kv_heads(cfg), head_dim=cfg.d_model // cfg.n_head,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta,  # transformers 5 moves it into rope_parameters
        tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", attention_dropout=cfg.dropout,
        initializer_range=cfg.init_std, num_experts_per_tok=cfg.moe_top_k, router_aux_loss_coef=cfg.moe_aux_loss,
        output_router_logits=False, sliding_window=None, bos_token_id=None, eos_token_id=None,
        architectures=[_ARCH[family]],
    )
    if family == "mixtral":
        return transformers.MixtralConfig(intermediate_size=expert_hidden(cfg), num_local_experts=cfg.moe_experts,
                                          router_jitter_noise=0.0, **common)
    # Sparse blocks: Qwen's own rule when it fits ((i + 1) % step == 0), else the dense blocks listed.
    if cfg.moe_first_dense == cfg.moe_every - 1:
        step, dense = cfg.moe_every, []
    else:
        step, dense = 1, [i for i in range(cfg.n_layer) if not is_moe_layer(cfg, i)]
    return transformers.Qwen3MoeConfig(
        intermediate_size=mlp_hidden(cfg), moe_intermediate_size=expert_hidden(cfg), num_experts=cfg.moe_experts,
        norm_topk_prob=cfg.moe_norm_topk, decoder_sparse_step=step, mlp_only_layers=dense,
        attention_bias=False, use_sliding_window=False, **common)
