"""What `--model` names: a preset (mixture-of-experts ones too: moe-tiny, deepseek-moe-small,
mixtral-8x7b), a training config file, or a user nn.Module factory (`package.module:function`,
traced on fake tensors by plan/trace.py)."""

from __future__ import annotations

import difflib
from pathlib import Path

from slipstream.config.presets import PRESETS
from slipstream.config.schema import ModelConfig
from slipstream.errors import UserError
from slipstream.plan.space import PlanModel

# Vocabulary for presets whose vocabulary comes from the data (tiny, gpt-mini): GPT-2's BPE.
DEFAULT_VOCAB = 50257


def known_models() -> list[str]:
    return list(PRESETS)


def _config(values: dict, vocab: int | None) -> ModelConfig:
    values = dict(values)
    if vocab:
        values["vocab_size"] = vocab
    elif not values.get("vocab_size"):
        values["vocab_size"] = DEFAULT_VOCAB
    return ModelConfig(**values)


def resolve_model(spec: str, vocab: int | None = None, seq_len: int | None = None) -> PlanModel:
    """The PlanModel for a --model value (see the module doc); vocab overrides the vocabulary."""
    if spec in PRESETS:
        values = {**PRESETS[spec], "preset": spec}
        if seq_len and values["position"] != "learned":
            values["max_seq_len"] = max(values["max_seq_len"], seq_len)  # RoPE has no length table
        return PlanModel(spec, _config(values, vocab))
    if spec.endswith(".toml") or Path(spec).is_file():
        from slipstream.config import load_config

        if not Path(spec).is_file():
            raise UserError(f"model config file {spec} does not exist; pass a preset ({', '.join(known_models())}) "
                            "or an existing TOML config")
        cfg = load_config(spec, []).model
        return PlanModel(Path(spec).stem, _config(vars(cfg), vocab or (cfg.vocab_size or None)))
    if ":" in spec:
        from slipstream.plan.trace import trace_module

        return trace_module(spec, vocab=vocab or DEFAULT_VOCAB, seq_len=seq_len or 1024)
    match = difflib.get_close_matches(spec, known_models(), n=1)
    hint = f" Did you mean '{match[0]}'?" if match else ""
    raise UserError(f"unknown model '{spec}'.{hint} Known: {', '.join(known_models())}; or a TOML config file, "
                    "or a factory 'package.module:function' returning an nn.Module.")
