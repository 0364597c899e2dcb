"""Named model shapes. Plain dicts of `ModelConfig` fields, so the config loader can use
them without importing torch. A preset fills every model field the user did not set.
Config layer (below models/); slipstream.models re-exports PRESETS."""

from __future__ import annotations

import difflib
from typing import Any

from slipstream.errors import UserError

_GPT2 = dict(position="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True,
             n_kv_head=0, d_ff=0, norm_eps=1e-5, max_seq_len=1024, vocab_size=50257)
_LLAMA3 = dict(position="rope", norm="rmsnorm", mlp="swiglu", bias=False, rope_theta=500000.0,
               norm_eps=1e-5, max_seq_len=8192, vocab_size=128256)

PRESETS: dict[str, dict[str, Any]] = {
    # Test size: trains in milliseconds; vocab comes from the data.
    "tiny": dict(_GPT2, n_layer=2, n_head=2, d_model=64, max_seq_len=128, vocab_size=0),
    "llama-tiny": dict(_LLAMA3, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=192, max_seq_len=128,
                       vocab_size=0, rope_theta=10000.0, tie_embeddings=False),
    # The default quickstart model: 6 layers, 6 heads, width 192 (~2.7M parameters + embeddings).
    "gpt-mini": dict(_GPT2, n_layer=6, n_head=6, d_model=192, max_seq_len=512, vocab_size=0),
    # GPT-2 family (Radford et al. 2019; shapes as in the released checkpoints).
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, d_model=768),
    "gpt2-medium": dict(_GPT2, n_layer=24, n_head=16, d_model=1024),
    "gpt2-large": dict(_GPT2, n_layer=36, n_head=20, d_model=1280),
    "gpt2-xl": dict(_GPT2, n_layer=48, n_head=25, d_model=1600),
    # Llama 3 family shapes (Llama 3.2 1B, Llama 3.1 8B / 70B), used for planning.
    "llama-1b": dict(_LLAMA3, n_layer=16, n_head=32, n_kv_head=8, d_model=2048, d_ff=8192, tie_embeddings=True),
    "llama-8b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, tie_embeddings=False),
    "llama-70b": dict(_LLAMA3, n_layer=80, n_head=64, n_kv_head=8, d_model=8192, d_ff=28672, tie_embeddings=False),
    # Mixture of experts. Test size: 4 SwiGLU experts, top-2, in both blocks; vocab from the data.
    "moe-tiny": dict(_LLAMA3, n_layer=2, n_head=4, n_kv_head=2, d_model=64, d_ff=128, max_seq_len=256, vocab_size=0,
                     rope_theta=10000.0, tie_embeddings=False, moe_experts=4, moe_top_k=2),
    # A small DeepSeek-style model (DeepSeek-MoE / V3 choices, standard attention): fine-grained experts
    # (32 of width 256, top-4) + 2 shared ones, the first block dense, sigmoid router with the
    # auxiliary-loss-free bias and a small auxiliary loss.
    "deepseek-moe-small": dict(_LLAMA3, n_layer=8, n_head=8, n_kv_head=8, d_model=512, d_ff=1408, max_seq_len=2048,
                               vocab_size=0, rope_theta=10000.0, tie_embeddings=False, moe_experts=32, moe_top_k=4,
                               moe_expert_hidden=256, moe_shared_experts=2, moe_first_dense=1, moe_router="sigmoid",
                               moe_bias_rate=1e-3, moe_aux_loss=1e-4),
    # Mixtral 8x7B (Jiang et al. 2024): 8 SwiGLU experts, top-2, every block; used for planning.
    "mixtral-8x7b": dict(_LLAMA3, n_layer=32, n_head=32, n_kv_head=8, d_model=4096, d_ff=14336, max_seq_len=32768,
                         vocab_size=32000, rope_theta=1e6, tie_embeddings=False, moe_experts=8, moe_top_k=2),
}


def apply_preset(model_values: dict[str, Any]) -> dict[str, Any]:
    """Fill the fields the user did not set from `model_values["preset"]` (default gpt-mini)."""
    name = model_values.get("preset", "gpt-mini")
    if name not in PRESETS:
        match = difflib.get_close_matches(str(name), list(PRESETS), n=1)
        hint = f" Did you mean '{match[0]}'?" if match else ""
        raise UserError(f"unknown model.preset '{name}'.{hint} Valid: {', '.join(PRESETS)}")
    return {**PRESETS[name], **model_values, "preset": name}
