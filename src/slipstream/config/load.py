"""Load a Config: TOML files with `extends` inheritance, then `section.key=value` overrides.

Order of precedence (last wins): dataclass defaults < model preset < TOML chain (base
first) < command-line overrides. Values are parsed by the declared field type; nothing is
ever eval'd. Every user mistake raises `UserError` naming the key, the value and what is
valid (with a "did you mean" for unknown keys).
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
import tomllib
import typing
from pathlib import Path
from typing import Any

import tomli_w

from slipstream.config.schema import Config, sections
from slipstream.config.sparsity_rules import check_sparsity_rules
from slipstream.config.dims import check_pipeline_config
from slipstream.errors import UserError

EXTENDS_KEY = "extends"


def _closest(name: str, valid: list[str]) -> str:
    match = difflib.get_close_matches(name, valid, n=1, cutoff=0.5)
    return f" Did you mean '{match[0]}'?" if match else f" Valid: {', '.join(valid)}."


def read_toml_chain(path: str | Path, _seen: tuple[Path, ...] = ()) -> dict[str, Any]:
    """Read a TOML file, resolving `extends = "base.toml"` (relative to the file) recursively."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise UserError(f"config '{path}' is a folder; pass a TOML file (see configs/).")
    if not path.is_file():
        raise UserError(f"config file '{path}' does not exist; pass an existing TOML file (see configs/).")
    resolved = path.resolve()
    if resolved in _seen:
        chain = " -> ".join(str(p) for p in (*_seen, resolved))
        raise UserError(f"config files extend each other in a cycle: {chain}")
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"config file '{path}' is not valid TOML: {e}") from None
    base_name = data.pop(EXTENDS_KEY, None)
    if base_name is None:
        return data
    if not isinstance(base_name, str):
        raise UserError(f"'{EXTENDS_KEY}' in '{path}' must be a file name string, got {base_name!r}")
    base = read_toml_chain(path.parent / base_name, (*_seen, resolved))
    return deep_merge(base, data)


def deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _field_types(section_cls: type) -> dict[str, Any]:
    return typing.get_type_hints(section_cls)


def _parse_override_value(text: str, typ: Any, key: str) -> Any:
    """Turn the string of `--section.key=value` into the field's type."""
    if typ is Any:  # a free-form table entry (tune.space): a TOML value, else the text itself
        try:
            return tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            return text
    if typ is bool:
        lowered = text.strip().lower()
        if lowered in ("true", "1", "yes", "on"):
            return True
        if lowered in ("false", "0", "no", "off"):
            return False
        raise UserError(f"--{key}={text}: expected a boolean (true/false)")
    if typ is int:
        try:
            return int(text.replace("_", ""))
        except ValueError:
            try:  # allow 1e3-style integers
                as_float = float(text)
            except ValueError:
                raise UserError(f"--{key}={text}: expected an integer") from None
            if not as_float.is_integer():
                raise UserError(f"--{key}={text}: expected an integer") from None
            return int(as_float)
    if typ is float:
        try:
            return float(text)
        except ValueError:
            raise UserError(f"--{key}={text}: expected a number") from None
    if typing.get_origin(typ) is dict:
        # {a = 0.7, b = 0.3} (a TOML inline table) or a=0.7,b=0.3; one entry: --section.key.name=value.
        text = text.strip()
        inline = text if text.startswith("{") else "{" + ", ".join(
            f'"{k.strip()}" = {_toml_scalar(v.strip(), typing.get_args(typ)[1])}'
            for k, v in (part.split("=", 1) if "=" in part else (part, "") for part in text.split(",") if part)) + "}"
        try:
            return tomllib.loads(f"v = {inline}")["v"]
        except tomllib.TOMLDecodeError:
            raise UserError(f"--{key}={text}: expected a table such as {{web = 0.7, code = 0.3}} or web=0.7,code=0.3") from None
    if typing.get_origin(typ) is list:
        text = text.strip()
        if text.startswith("["):
            try:
                return tomllib.loads(f"v = {text}")["v"]
            except tomllib.TOMLDecodeError:
                raise UserError(f"--{key}={text}: expected a list such as [\"a\", \"b\"] or a,b") from None
        return [part for part in text.split(",") if part]
    return text


def _toml_scalar(text: str, typ: Any) -> str:
    """One value of a `name=value,...` table override as TOML: a number stays bare, a string is quoted."""
    return json.dumps(text) if typ is str else (text or '""')


def split_overrides(extra: list[str]) -> list[str]:
    """Command-line leftovers as a list of `--section.key=value` overrides for `parse_overrides`.

    `extra` are the arguments a command's parser did not know. Each must be `--section.key=value`
    or `--section.key value` (two arguments, joined here); the values are not checked yet.
    Anything else (a positional, `--flag` without a dot, a trailing key without a value) is
    a UserError naming it.
    """
    overrides, i = [], 0
    while i < len(extra):
        arg = extra[i]
        if not arg.startswith("--") or "." not in arg.split("=", 1)[0]:
            raise UserError(f"unexpected argument '{arg}'; config overrides look like --section.key=value")
        if "=" not in arg:
            if i + 1 >= len(extra) or extra[i + 1].startswith("--"):
                raise UserError(f"override '{arg}' has no value; write {arg}=VALUE")
            arg = f"{arg}={extra[i + 1]}"
            i += 1
        overrides.append(arg)
        i += 1
    return overrides


def parse_overrides(overrides: list[str]) -> dict[str, dict[str, Any]]:
    """`["--train.max_steps=10", "model.preset=gpt2"]` -> {"train": {"max_steps": 10}, ...}."""
    out: dict[str, dict[str, Any]] = {}
    known = sections()
    for raw in overrides:
        item = raw[2:] if raw.startswith("--") else raw
        if "=" not in item:
            raise UserError(f"override '{raw}' must look like --section.key=value (e.g. --train.max_steps=100)")
        dotted, value = item.split("=", 1)
        if "." not in dotted:
            raise UserError(f"override '{raw}' must name a section and a key, e.g. --train.{dotted}=...")
        section, key = dotted.split(".", 1)
        if section not in known:
            raise UserError(f"unknown config section '{section}' in '{raw}'." + _closest(section, list(known)))
        types = _field_types(known[section])
        key, _, entry = key.partition(".")  # --data.mixture.web=0.5 sets one entry of a table
        if key not in types:
            raise UserError(f"unknown config key '{section}.{key}'." + _closest(key, list(types)))
        if entry:
            if typing.get_origin(types[key]) is not dict:
                raise UserError(f"override '{raw}': {section}.{key} is not a table; write --{section}.{key}=VALUE")
            value_type = typing.get_args(types[key])[1]
            parsed = _parse_override_value(value, value_type, dotted)
            out.setdefault(section, {}).setdefault(key, {})[entry] = parsed
            continue
        out.setdefault(section, {})[key] = _parse_override_value(value, types[key], dotted)
    return out


def _check_type(value: Any, typ: Any, where: str) -> Any:
    if typ is Any:  # checked by its user (tune.space: slipstream.tune.space)
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise UserError(f"{where} = {value!r}: expected true or false")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            if isinstance(value, float) and value.is_integer():
                return int(value)
            raise UserError(f"{where} = {value!r}: expected an integer")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise UserError(f"{where} = {value!r}: expected a number")
        if not math.isfinite(value):
            raise UserError(f"{where} = {value!r}: expected a finite number")
        return float(value)
    if typing.get_origin(typ) is dict:
        if not isinstance(value, dict):
            raise UserError(f"{where} = {value!r}: expected a table such as {{name = value}}")
        value_type = typing.get_args(typ)[1]
        return {str(k): _check_type(v, value_type, f"{where}.{k}") for k, v in value.items()}
    if typing.get_origin(typ) is list:
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise UserError(f"{where} = {value!r}: expected a list of strings")
        return list(value)
    if not isinstance(value, str):
        raise UserError(f"{where} = {value!r}: expected a string")
    return value


def _check_rules(value: Any, f: dataclasses.Field, where: str) -> None:
    meta = f.metadata
    if meta.get("choices") and value not in meta["choices"]:
        valid = ", ".join(str(c) for c in meta["choices"])
        raise UserError(f"{where} = {value!r} is not valid; choose one of: {valid}")
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and (value < lo or (meta.get("min_exclusive") and value == lo)):
        bound = f"> {lo}" if meta.get("min_exclusive") else f">= {lo}"
        raise UserError(f"{where} = {value!r} is out of range; it must be {bound}")
    if hi is not None and value > hi:
        raise UserError(f"{where} = {value!r} is out of range; it must be <= {hi}")


def build_config(data: dict[str, Any]) -> Config:
    """Validate a nested dict (from TOML + overrides) and build the Config."""
    from slipstream.config.presets import apply_preset  # presets are plain dicts; no torch import

    known = sections()
    for section, values in data.items():
        if section not in known:
            raise UserError(f"unknown config section '{section}'." + _closest(section, list(known)))
        if not isinstance(values, dict):
            raise UserError(f"config section '{section}' must be a table like [{section}], got {values!r}")
    model_values = apply_preset(dict(data.get("model", {})))
    built = {}
    for section, cls in known.items():
        values = model_values if section == "model" else data.get(section, {})
        types = _field_types(cls)
        fields = {f.name: f for f in dataclasses.fields(cls)}
        kwargs = {}
        for key, value in values.items():
            if key not in fields:
                raise UserError(f"unknown config key '{section}.{key}'." + _closest(key, list(fields)))
            where = f"{section}.{key}"
            value = _check_type(value, types[key], where)
            _check_rules(value, fields[key], where)
            kwargs[key] = value
        built[section] = cls(**kwargs)
    cfg = Config(**built)
    check_consistency(cfg)
    return cfg


def check_training_rules(cfg: Config) -> None:
    """The config-only rules of the training step (optimizer, precision, stability); the Trainer
    checks them again for a Config built in code (it trains any model, so the [model] rules of
    check_consistency do not apply to it)."""
    o = cfg.optim
    check_quant_rules(cfg)
    check_sparsity_rules(cfg)
    if o.in_backward and o.offload:
        raise UserError("optim.in_backward and optim.offload cannot be combined; choose one")
    if o.in_backward and cfg.precision.autocast == "fp16":
        raise UserError("optim.in_backward cannot be used with fp16 loss scaling (the scaler must see all "
                        "gradients before any step); use --precision.autocast=bf16")
    if o.in_backward and o.grad_clip > 0:
        raise UserError("gradient clipping needs the global gradient norm, which is only known after the "
                        "whole backward, but the in-backward optimizer has already stepped by then; "
                        "set optim.grad_clip=0 with optim.in_backward")
    if o.state_dtype == "bf16" and o.implementation not in ("auto", "for-loop"):
        raise UserError(f"optim.implementation = {o.implementation} is not available with optim.state_dtype = bf16 "
                        "(it has its own for-loop implementation); use auto or for-loop")
    if o.state_dtype in ("int8", "int4") and o.implementation == "foreach":
        raise UserError(f"optim.implementation = foreach is not available with optim.state_dtype = {o.state_dtype} "
                        "(torchao's low-bit AdamW updates one parameter at a time); use auto or fused (compiled) "
                        "or for-loop (eager)")
    if o.in_backward and cfg.stability.policy in ("skip", "rollback"):
        raise UserError(f"stability.policy = {cfg.stability.policy} must see the gradients before the update, "
                        "but optim.in_backward updates during backward; use policy stop or none")
    check_muon_rules(cfg)


def check_quant_rules(cfg: Config) -> None:
    """quant.qat swaps the blocks' linears for torchao's FakeQuantizedLinear (optimize/qat.py)."""
    q = cfg.quant
    if q.qat == "none":
        return
    if cfg.precision.fp8:
        raise UserError(f"quant.qat = {q.qat} and precision.fp8 both replace the linear layers; choose one "
                        "(--precision.fp8=false or --quant.qat=none)")
    if cfg.parallel.tp > 1:
        raise UserError(f"quant.qat = {q.qat} does not work with tensor parallelism (the fake quantizers compute "
                        "their scales over a whole weight, not a DTensor shard); set --parallel.tp=1 or "
                        "--quant.qat=none")
    if q.qat_start_step >= cfg.train.max_steps:
        # The loop runs steps 0 .. max_steps - 1: a later switch would train (and export) in full precision.
        raise UserError(f"quant.qat_start_step = {q.qat_start_step} is not before train.max_steps = "
                        f"{cfg.train.max_steps}: fake quantization would never start (the last step is max_steps - 1); "
                        f"set quant.qat_start_step <= train.max_steps - 1 = {cfg.train.max_steps - 1}")
    if cfg.model.moe_experts > 0:
        # QAT swaps nn.Linear modules: it would quantize the routers and leave the 3-D expert weights
        # (most of an MoE block's weights) in full precision, silently.
        raise UserError(f"quant.qat = {q.qat} with mixture-of-experts models is not implemented yet (the experts' "
                        "weights are not linear layers); set --quant.qat=none or --model.moe_experts=0")


def check_muon_rules(cfg: Config) -> None:
    """optim.optimizer = muon: the AdamW variants are AdamW-only, the original lr scale needs an lr
    of its own, and Newton-Schulz orthogonalizes each whole matrix, which a rank holding a shard of
    it does not have."""
    o, p = cfg.optim, cfg.parallel
    if o.optimizer != "muon":
        return
    variants = (("optim.offload", o.offload, "the offloaded step is AdamW on CPU master weights", "offload=false"),
                ("optim.in_backward", o.in_backward, "the in-backward step is one AdamW per parameter",
                 "in_backward=false"),
                (f"optim.state_dtype = {o.state_dtype}", o.state_dtype != "fp32", f"{o.state_dtype} moments are "
                 "AdamW's; Muon keeps one momentum buffer per matrix, half of AdamW's state already",
                 "state_dtype=fp32"))
    for switch, on, why, fix in variants:
        if on:
            raise UserError(f"optim.optimizer = muon cannot be combined with {switch} ({why}); set --optim.{fix} "
                            "or --optim.optimizer=adamw")
    if o.muon_adjust_lr == "original" and not o.muon_lr:
        # Only match_rms_adamw scales Muon's step to AdamW's size; with the original scale optim.lr
        # would drive the matrices several times (0.2 x sqrt(width)) too gently, and silently.
        raise UserError(f"optim.optimizer = muon with optim.muon_adjust_lr = original scales Muon's step for an lr "
                        f"near 0.02, so optim.lr = {o.lr:g} (AdamW's, taken by optim.muon_lr = 0) does not carry "
                        "over; set --optim.muon_lr (e.g. 0.02), or --optim.muon_adjust_lr=match_rms_adamw")
    sharded = (f"parallel.dp_strategy = {p.dp_strategy}" if p.dp_strategy in ("zero1", "zero2", "fsdp", "hsdp")
               else f"parallel.tp = {p.tp}" if p.tp > 1
               else f"parallel.cp = {p.cp} with dp_strategy = auto (fsdp on one data-parallel rank)"
               if p.cp > 1 and p.dp_strategy == "auto" else "")
    if sharded:
        raise UserError(f"optim.optimizer = muon orthogonalizes each whole weight matrix, but {sharded} splits the "
                        "matrices or their optimizer state over ranks; use --parallel.dp_strategy=ddp (pipeline "
                        "parallelism keeps matrices whole too), or --optim.optimizer=adamw")


def check_data_rules(cfg: Config) -> None:
    """data.mixture names data.sources with finite, non-negative weights that do not all vanish."""
    d = cfg.data
    if d.sources and not d.mixture:
        raise UserError("data.sources is set but data.mixture is empty; give each source a weight, e.g. "
                        f"--data.mixture={{{', '.join(f'{name} = 1.0' for name in d.sources)}}}")
    if not d.mixture:
        return
    unknown = sorted(set(d.mixture) - set(d.sources))
    if unknown:
        raise UserError(f"data.mixture names {', '.join(unknown)}, which data.sources does not define; add e.g. "
                        f"--data.sources.{unknown[0]}=PATH_OR_URL (a folder from `slipstream data prepare`)")
    bad = {name: w for name, w in d.mixture.items() if not w >= 0}
    if bad or not sum(d.mixture.values()) > 0:
        raise UserError(f"data.mixture = {d.mixture}: weights must be >= 0 and at least one > 0")


def check_architecture_rules(cfg: Config) -> None:
    """The architecture switches of [model] that only mean something together, and the parallelisms
    an option cannot run under (each named with its fix)."""
    m = cfg.model
    if m.rotary_fraction != 1.0 and m.position != "rope":
        raise UserError(f"model.rotary_fraction = {m.rotary_fraction:g} sets how much of each head RoPE rotates, but "
                        f"model.position = {m.position}; set --model.position=rope, or --model.rotary_fraction=1")
    if m.position == "alibi" and cfg.parallel.cp > 1:
        # Each cp rank holds chunks of the sequence and attends over the gathered keys: the bias would
        # have to follow the absolute positions of both chunks (not built yet).
        raise UserError(f"model.position = alibi with parallel.cp = {cfg.parallel.cp} is not supported (the ALiBi "
                        "bias of a sequence chunk depends on where the query and key chunks sit in the sequence); "
                        "use --parallel.cp=1 (tensor or pipeline parallelism split an ALiBi model), or "
                        "--model.position=rope")


# CUDA's memory-efficient attention kernel (what SDPA picks for fp32, and for bf16 where flash
# cannot run) returns its log-sum-exp padded to a multiple of 32 queries (kAlignLSE = 32: torch/
# _meta_registrations.py, meta__scaled_dot_product_efficient_attention: math.ceil(M / 32) * 32).
# torch's ring merges each step's log-sum-exp with that step's unpadded output, so the shapes agree
# only when every step's queries are a multiple of 32 (with cp_load_balance a step takes both local
# chunks or the second one: seq_len / (2 cp) queries each; without it seq_len / cp).
RING_QUERY_ALIGN = 32


def ring_needs_cuda(device: str) -> UserError:
    """The refusal of the ring kernel off CUDA (here by train.device; by the resolved device in
    distributed/context_parallel.check_ring_attention). device: what the run has, e.g. "train.device = cpu"."""
    return UserError(f"parallel.cp_attention = ring runs torch's ring attention on CUDA's fused attention kernels "
                     f"(flash, efficient, cuDNN), which {device} does not have. Use --parallel.cp_attention=allgather "
                     "(any device)")


def check_cp_attention_rules(cfg: Config) -> None:
    """parallel.cp_attention = ring runs torch's ring attention: its per-step kernels are CUDA's
    fused SDPA ops, and it knows the causal mask only. (Checked again with the resolved device
    and the installed torch by distributed/context_parallel.check_context_parallel.)"""
    p = cfg.parallel
    if p.cp_attention != "ring" or p.cp <= 1:
        return
    fix = "--parallel.cp_attention=allgather"
    if not cfg.train.device.startswith(("auto", "cuda")):
        raise ring_needs_cuda(f"train.device = {cfg.train.device}")
    if cfg.data.packing == "document":
        raise UserError("parallel.cp_attention = ring supports the causal mask only (torch's ring attention takes "
                        "is_causal, not a mask), but data.packing = document masks attention at document ends; use "
                        "--data.packing=eos")
    if cfg.model.dropout > 0:
        # torch's ring backward replays every step's attention with the random state of the last
        # step only, so the dropped elements would not be those of the forward.
        raise UserError(f"parallel.cp_attention = ring with model.dropout = {cfg.model.dropout:g} is not supported "
                        f"(torch's ring attention does not replay each step's dropout mask in its backward); set "
                        f"--model.dropout=0, or {fix}")
    if cfg.compile.scope != "off" and cfg.compile.fullgraph:
        # The ring runs eagerly inside compiled blocks (distributed/ring_attention.py says why).
        raise UserError(f"parallel.cp_attention = ring breaks the compiled graph at attention (torch's ring runs "
                        f"eagerly there), which compile.fullgraph = true refuses; set --compile.fullgraph=false, "
                        f"or {fix}")
    if cfg.activations.checkpointing == "offload":
        # save_on_cpu(pin_memory=True) copies each saved tensor into a pinned plain tensor; the ring
        # saves DTensors, and copy_ of a DTensor into a plain tensor raises ("got mixed torch.Tensor
        # and DTensor") on the first CUDA step.
        raise UserError("parallel.cp_attention = ring with activations.checkpointing = offload is not supported "
                        "(offloading copies the saved tensors into pinned CPU tensors, and the ring saves DTensors); "
                        f"set --activations.checkpointing=full or selective, or {fix}")
    pieces = 2 * p.cp if p.cp_load_balance else p.cp
    unit = RING_QUERY_ALIGN * pieces
    if cfg.train.seq_len % unit:
        valid = [n for n in (cfg.train.seq_len // unit * unit, (cfg.train.seq_len // unit + 1) * unit) if n > 0]
        what = "2 x cp: parallel.cp_load_balance" if p.cp_load_balance else "cp"
        raise UserError(f"parallel.cp_attention = ring needs every chunk of the sequence to hold a multiple of "
                        f"{RING_QUERY_ALIGN} tokens (CUDA's memory-efficient attention pads its log-sum-exp to a "
                        f"multiple of {RING_QUERY_ALIGN} queries, which torch's ring cannot merge with the unpadded "
                        f"output), but train.seq_len = {cfg.train.seq_len} in {pieces} chunks ({what}) gives "
                        f"{cfg.train.seq_len / pieces:g}. Use a train.seq_len divisible by {unit} "
                        f"(e.g. {' or '.join(map(str, valid))}), or {fix}")


def check_consistency(cfg: Config) -> None:
    """Rules that involve several fields and need nothing but the config: checked when the
    config is loaded, before any data is prepared or model built. Rules that need the world
    size or device are checked before joining the process group (config/dims.py,
    distributed/mesh.py)."""
    m, t, o = cfg.model, cfg.train, cfg.optim
    if not re.fullmatch(r"[A-Za-z0-9._-]+", cfg.run.name) or cfg.run.name in (".", ".."):
        raise UserError(f"run.name = {cfg.run.name!r}: use only letters, digits, '.', '_' and '-' "
                        "(it becomes part of a folder name)")
    if m.d_model % m.n_head:
        raise UserError(f"model.d_model = {m.d_model} must be divisible by model.n_head = {m.n_head}")
    if (m.d_model // m.n_head) % 2 and m.position == "rope":
        raise UserError(f"RoPE needs an even head size; d_model/n_head = {m.d_model // m.n_head}")
    kv = m.n_kv_head or m.n_head
    if m.n_head % kv:
        raise UserError(f"model.n_head = {m.n_head} must be divisible by model.n_kv_head = {kv}")
    if m.moe_experts and m.moe_top_k > m.moe_experts:
        raise UserError(f"model.moe_top_k = {m.moe_top_k} is larger than model.moe_experts = {m.moe_experts}: a "
                        "token cannot be routed to more experts than there are; lower moe_top_k or raise moe_experts")
    if m.moe_experts and m.moe_first_dense >= m.n_layer:
        raise UserError(f"model.moe_first_dense = {m.moe_first_dense} leaves no MoE layer in a model of {m.n_layer} "
                        "blocks; lower it (or set model.moe_experts = 0 for a dense model)")
    if m.moe_experts and cfg.parallel.ep > 1 and m.moe_experts % cfg.parallel.ep:
        raise UserError(f"model.moe_experts = {m.moe_experts} is not divisible by parallel.ep = {cfg.parallel.ep}: "
                        "every expert-parallel rank holds the same number of experts; choose an ep that divides it")
    if m.moe_experts and (m.moe_aux_loss or m.moe_z_loss) and cfg.precision.autocast == "fp16":
        raise UserError("fp16 loss scaling with the MoE balancing losses is not supported (they add their gradient "
                        "at the MoE layers, outside the scaled loss); use --precision.autocast=bf16, or set "
                        "model.moe_aux_loss = moe_z_loss = 0")
    if cfg.parallel.ep > 1 and not m.moe_experts:
        raise UserError(f"parallel.ep = {cfg.parallel.ep} splits the experts of a mixture-of-experts model, but "
                        "model.moe_experts = 0 (a dense model); set --parallel.ep=1 or choose an MoE model "
                        "(e.g. --model.preset=moe-tiny)")
    if t.seq_len > m.max_seq_len:
        raise UserError(f"train.seq_len = {t.seq_len} exceeds model.max_seq_len = {m.max_seq_len}; "
                        f"lower train.seq_len or raise model.max_seq_len")
    if o.min_lr > o.lr:
        raise UserError(f"optim.min_lr = {o.min_lr} is larger than optim.lr = {o.lr}")
    if o.schedule == "range_test" and o.min_lr <= 0:
        raise UserError("optim.schedule = range_test sweeps exponentially from optim.min_lr to optim.lr: "
                        "set optim.min_lr > 0 (e.g. 1e-7)")
    if t.early_stop_patience and not (t.eval_interval and t.eval_steps and t.eval_tokens):
        raise UserError(f"train.early_stop_patience = {t.early_stop_patience} watches the val loss of each "
                        "evaluation, but evaluation is off or only at the end (train.eval_interval, eval_steps and "
                        "eval_tokens must all be > 0); set them, or train.early_stop_patience = 0")
    if t.target_val_loss and not (t.eval_interval and t.eval_steps and t.eval_tokens):
        raise UserError(f"train.target_val_loss = {t.target_val_loss:g} is checked at each evaluation, but evaluation "
                        "is off or only at the end (train.eval_interval, eval_steps and eval_tokens must all be > 0); "
                        "set them, or train.target_val_loss = 0")
    check_architecture_rules(cfg)
    check_cp_attention_rules(cfg)
    check_training_rules(cfg)
    check_data_rules(cfg)
    check_pipeline_config(cfg)
    if cfg.checkpoint.resume not in ("none", "auto") and not cfg.checkpoint.resume:
        raise UserError("checkpoint.resume must be none, auto or a checkpoint path")


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> Config:
    """The one entry point: defaults < preset < TOML chain < overrides, validated once."""
    data = read_toml_chain(path) if path else {}
    data = deep_merge(data, parse_overrides(overrides or []))
    return build_config(data)


def config_to_toml(cfg: Config) -> str:
    return tomli_w.dumps(dataclasses.asdict(cfg))


def config_from_toml_text(text: str) -> Config:
    """Rebuild a Config from a resolved config.toml (e.g. one stored in a checkpoint)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise UserError(f"stored config is not valid TOML: {e}") from None
    except RecursionError:  # a crafted file of deeply nested arrays
        raise UserError("stored config is nested too deeply to be a slipstream config") from None
    return build_config(data)


def reference_markdown() -> str:
    """The README config reference, generated from the schema."""
    lines = []
    for section, cls in sections().items():
        lines.append(f"### `[{section}]`\n")
        lines.append(f"{(cls.__doc__ or '').strip().splitlines()[0]}\n")
        lines.append("| key | default | description |")
        lines.append("|---|---|---|")
        for f in dataclasses.fields(cls):
            default = f.default_factory() if f.default is dataclasses.MISSING else f.default
            doc = f.metadata["doc"]
            if f.metadata.get("choices"):
                doc += " One of: " + ", ".join(f"`{c}`" for c in f.metadata["choices"]) + "."
            shown = json.dumps(default) if isinstance(default, (list, str, dict)) else tomli_w.dumps({"v": default})[4:].strip()
            lines.append(f"| `{section}.{f.name}` | `{shown}` | {doc} |")
        lines.append("")
    return "\n".join(lines)
