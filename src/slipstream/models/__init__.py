"""Transformer language models (GPT-2 and Llama-style), presets and Hugging Face interop."""

from slipstream.config.presets import PRESETS
from slipstream.models.transformer import Transformer, build_model, generate, lm_loss, padded_vocab_size


def from_hf(model_or_dir, device="cpu"):
    """Our Transformer with the weights of a Hugging Face GPT2LMHeadModel / LlamaForCausalLM."""
    from slipstream.models.hf import from_hf as _from_hf

    return _from_hf(model_or_dir, device=device)


def to_hf(model):
    """A Hugging Face-compatible state dict (GPT-2 or Llama naming) of our model."""
    from slipstream.models.hf import to_hf as _to_hf

    return _to_hf(model)


__all__ = ["PRESETS", "Transformer", "build_model", "generate", "lm_loss", "padded_vocab_size", "from_hf", "to_hf"]
