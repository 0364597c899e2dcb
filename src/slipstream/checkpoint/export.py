"""`slipstream checkpoint inspect|export`: look into a checkpoint; consolidate its weights.

    slipstream checkpoint inspect DIR [--json]
    slipstream checkpoint export DIR --format torch|safetensors|hf --out FOLDER
                                     [--dtype fp32|bf16|fp16] [--force]
                                     [--quantize int8-dynact-int4-weight|int8-weight|int8|int4]

DIR is a checkpoint folder, a run's checkpoints/ folder or a run folder (its latest complete
checkpoint), as everywhere in the CLI.

inspect
    Prints what the checkpoint holds: step, save time, torch and format versions, the world
    size and data-parallel strategy it was saved with, optimizer state (and whether model /
    optimizer state is stored per rank: local SGD, ZeRO-1), tokenizer, model config and
    parameter count, a trainer-state summary (tokens seen, learning rate, data position),
    sizes (files on disk; tensors per top-level key group, as numel * element size from the
    DCP metadata: logical sizes, a tied weight counts under each of its keys) and the
    integrity check of `verify_checkpoint(deep=True)`. `--json` prints the same as one JSON
    object. Exit code 0 when intact, 1 when damaged (the report still prints and names every
    problem), 2 for a bad path. The DCP metadata (a pickle written by
    torch.distributed.checkpoint) is read only when it passes the manifest's checksum, and
    then under an allow-list (checkpoint/untrusted.py): a file that would build anything but
    DCP's metadata records is refused and reported as a problem. Format 1 checkpoints have no
    manifest, so they are reported as not verified (exit 1), never as intact.

export
    Loads the model weights on this one process, whatever world size and strategy saved them
    (per-rank models: rank 0's copy), and writes them to `--out`, which is always a FOLDER:

      torch        model.pt: `torch.save` of the plain state dict (our parameter names, padded
                   vocabulary rows included; tied weights stay shared). Load it with
                   `torch.load(path, weights_only=True)` and `Transformer(cfg).load_state_dict`.
      safetensors  model.safetensors: the same state dict. safetensors refuses tensors that
                   share memory, so a tied weight is stored once: the file's metadata key
                   "tied" maps each dropped key to the key holding its tensor, e.g.
                   {"lm_head.weight": "tok_emb.weight"}; re-tie after loading. The metadata
                   also carries step, preset, dtype and the slipstream version.
      hf           a Hugging Face folder (config.json, model.safetensors) that
                   `AutoModelForCausalLM.from_pretrained(out)` loads: GPT-2-shaped models
                   (position=learned, layernorm, gelu, bias), Llama-shaped ones (rope,
                   rmsnorm, swiglu) and mixture-of-experts ones as Mixtral or Qwen3-MoE
                   (models/hf_moe.py: experts stored one tensor per expert, as on the Hub)
                   only; needs `transformers`. A bpe checkpoint also gets
                   tokenizer.json and tokenizer_config.json (PreTrainedTokenizerFast).

    A checkpoint trained with [sparsity] exports weight * mask under the weights' own names
    (no mask buffers): the pruned entries are exact zeros in every format.

    --quantize (format torch only) converts the blocks' linears to torchao's quantized
    weights (optimize/qat.py convert_qat: torchao's QAT convert step): a checkpoint trained
    with quant.qat gives exactly the model its fake-quantized forward trained; any other
    checkpoint gets the same post-training quantization. int8-dynact-int4-weight uses the
    checkpoint's quant.qat_group_size (32 by default). model.pt then holds torchao tensor
    subclasses (int8 storage; int4 values one per byte, so int4 saves as much file size as
    int8): `import torchao` first, then `torch.load(path, weights_only=True)`. The embedding
    and head stay as saved. The command prints the file size. Without --quantize, a QAT
    checkpoint exports its float weights like any other. --quantize int8 | int4 is weight-only
    quantization (optimize/weight_quant.py: activations stay in floating point), exactly what
    `slipstream generate --quantize` runs.

    Every format also gets config.toml (the run's resolved config), export.json (source,
    step, format, dtype, tied keys) and, for bpe tokenizers, tokenizer.json (the copy inside
    the checkpoint: a checkpoint whose meta names a tokenizer file outside its folder is
    refused). `--dtype` casts
    floating-point tensors (default: as saved, normally fp32). The folder is written under a
    temporary name next to `--out` and renamed into place. An existing `--out` is refused
    unless `--force`, and even then replaced only when it holds nothing but files an export
    writes (never deletes unrelated files).
"""

from __future__ import annotations

import datetime
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import UserError

FORMATS = ("torch", "safetensors", "hf")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
_WEIGHT_FILES = {"torch": "model.pt", "safetensors": "model.safetensors", "hf": "model.safetensors"}
# Everything an export may write: --force replaces a folder holding only these.
_EXPORT_FILES = {"model.pt", "model.safetensors", "config.json", "generation_config.json", "config.toml",
                 "export.json", "tokenizer.json", "tokenizer_config.json"}
_GROUP_ORDER = ("model", "optim")


# --- inspect ------------------------------------------------------------------------------------

def _human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:,.0f} {unit}" if unit == "B" else f"{n:,.1f} {unit}"
        n /= 1024
    return str(n)  # unreachable


def _read_json(path: Path) -> tuple[Any, str | None]:
    from slipstream.checkpoint.manager import read_json_inside

    try:
        return read_json_inside(path.parent, path.name), None
    except (OSError, json.JSONDecodeError, UserError) as e:
        return None, f"{path.name} is unreadable ({e})"


def _tensor_groups(ckpt_dir: Path, trusted: bool) -> tuple[dict[str, dict[str, int]] | None, str | None]:
    """Per top-level key ("model", "optim", "model_rank0", "optim_zero1_rank1", ...): tensors,
    elements and bytes (numel * element size), from the DCP metadata alone. The error is a
    problem of the checkpoint (the metadata is refused or unreadable)."""
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from slipstream.checkpoint.untrusted import RefusedFile, read_dcp_metadata

    if not trusted:
        return None, None
    try:
        metadata = read_dcp_metadata(ckpt_dir / "model_optim")
    except RefusedFile as e:
        return None, f"model_optim/.metadata is refused: {e.reason} (never unpickled as it is: it may run code)"
    groups: dict[str, dict[str, int]] = {}
    for fqn, entry in metadata.state_dict_metadata.items():
        group = groups.setdefault(fqn.split(".", 1)[0], {"tensors": 0, "elements": 0, "bytes": 0})
        if isinstance(entry, TensorStorageMetadata):
            numel = 1
            for dim in entry.size:
                numel *= int(dim)
            dtype = entry.properties.dtype
            group["tensors"] += 1
            group["elements"] += numel
            group["bytes"] += numel * (torch.finfo(dtype).bits if dtype.is_floating_point
                                       else torch.iinfo(dtype).bits if dtype != torch.bool else 8) // 8
    order = {name: i for i, name in enumerate(_GROUP_ORDER)}
    return dict(sorted(groups.items(), key=lambda kv: (order.get(kv[0], len(order)), kv[0]))), None


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """Everything `checkpoint inspect` reports, as a JSON-safe dict. Parts that cannot be read
    are None and named in integrity.problems; only a bad path raises UserError."""
    from slipstream.checkpoint import manager as ckpt

    ckpt_dir = ckpt.resolve_checkpoint(path)
    problems = ckpt.verify_checkpoint(ckpt_dir, deep=True)
    notes: list[str] = []

    meta, err = _read_json(ckpt_dir / "meta.json")
    meta = meta if isinstance(meta, dict) else {}
    if err and not any(p.startswith("meta.json") for p in problems):
        problems.append(err)
    if not problems and meta.get("format_version", 1) < 2:
        problems.append(ckpt.UNVERIFIABLE)  # nothing to check against: never reported as intact
    layout = meta.get("optimizer_layout") or {}

    model = None
    try:
        from slipstream.config.load import config_from_toml_text
        from slipstream.models.flops import param_count

        cfg = config_from_toml_text(ckpt.read_text_inside(ckpt_dir, "config.toml"))
        m = cfg.model
        model = {"preset": m.preset, "n_layer": m.n_layer, "d_model": m.d_model, "n_head": m.n_head,
                 "n_kv_head": m.n_kv_head or m.n_head, "vocab_size": m.vocab_size, "max_seq_len": m.max_seq_len,
                 "position": m.position, "norm": m.norm, "mlp": m.mlp, "tie_embeddings": m.tie_embeddings,
                 "parameters": param_count(m).total}
    except (OSError, UserError) as e:
        msg = e.strerror if isinstance(e, OSError) else str(e)
        notes.append(f"config.toml is unreadable ({msg})")

    trainer = None
    state, err = _read_json(ckpt_dir / "trainer_state.json")
    if isinstance(state, dict):
        last_lr = (state.get("scheduler") or {}).get("_last_lr")
        loader = state.get("train_loader") or {}
        position = {k: loader[k] for k in ("batch_index", "epoch", "batch_in_epoch") if k in loader}
        trainer = {"step": state.get("step"), "tokens_seen": state.get("tokens_seen"),
                   "learning_rate": last_lr[0] if last_lr else None,
                   "data_loader": {"kind": loader.get("kind"), **position} if loader else None}
    elif err:
        notes.append(err)

    metadata_ok = not any(p.startswith("model_optim/.metadata") for p in problems)
    if not metadata_ok:
        notes.append("model_optim/.metadata failed its checksum: not read")
    groups, err = _tensor_groups(ckpt_dir, metadata_ok)
    if err:
        problems.append(err)
    per_rank_optim = bool(groups) and any(g.startswith(("optim_rank", "optim_zero1_rank")) for g in groups)
    on_disk = sum(p.stat().st_size for p in ckpt_dir.rglob("*") if p.is_file())
    saved = meta.get("time")

    return {
        "path": str(ckpt_dir),
        "step": meta.get("step"),
        "time": saved,
        "time_saved": (datetime.datetime.fromtimestamp(saved).astimezone().isoformat(timespec="seconds")
                       if isinstance(saved, (int, float)) else None),
        "torch": meta.get("torch"),
        "format_version": meta.get("format_version"),
        "world_size": layout.get("world_size", meta.get("world_size")),
        "dp_strategy": layout.get("dp_strategy"),
        "mesh": meta.get("mesh"),  # [[name, size], ...] outermost first; older checkpoints: None
        "has_optimizer": meta.get("has_optimizer"),
        "per_rank_model": bool(meta.get("per_rank_model", False)),
        "per_rank_optimizer": per_rank_optim,
        "tokenizer": meta.get("tokenizer"),
        "model": model,
        "trainer_state": trainer,
        "sizes": {"on_disk_bytes": on_disk,
                  "tensors": sum(g["tensors"] for g in groups.values()) if groups is not None else None,
                  "tensor_bytes": sum(g["bytes"] for g in groups.values()) if groups is not None else None,
                  "groups": groups},
        "integrity": {"ok": not problems, "problems": problems},
        "notes": notes,
    }


def format_report(r: dict[str, Any]) -> str:
    def show(v: Any) -> str:
        return "?" if v is None else str(v)

    lines = [f"checkpoint   {r['path']}",
             f"step         {show(r['step'])}   saved {show(r['time_saved'])}",
             f"versions     format {show(r['format_version'])}, torch {show(r['torch'])}",
             f"saved by     world size {show(r['world_size'])}, dp strategy {show(r['dp_strategy'])}"
             + (f", mesh {' x '.join(f'{n} {s}' for n, s in r['mesh'])}" if r.get("mesh") else ""),
             f"optimizer    {'yes' if r['has_optimizer'] else 'no'}; per-rank model: "
             f"{'yes' if r['per_rank_model'] else 'no'}, per-rank optimizer: {'yes' if r['per_rank_optimizer'] else 'no'}",
             f"tokenizer    {show(r['tokenizer'])}"]
    m = r["model"]
    if m:
        lines.append(f"model        {m['preset']}: {m['parameters']:,} parameters ({m['parameters'] / 1e6:.2f}M), "
                     f"{m['n_layer']} layers, width {m['d_model']}, {m['n_head']} heads "
                     f"({m['n_kv_head']} kv), vocab {m['vocab_size']}, context {m['max_seq_len']}, "
                     f"{m['position']}/{m['norm']}/{m['mlp']}{', tied embeddings' if m['tie_embeddings'] else ''}")
    t = r["trainer_state"]
    if t:
        lr = "?" if t["learning_rate"] is None else f"{t['learning_rate']:.4g}"
        tokens = "?" if t["tokens_seen"] is None else f"{t['tokens_seen']:,}"
        loader = t["data_loader"] or {}
        where = ", ".join(f"{k} {v}" for k, v in loader.items() if k != "kind")
        lines.append(f"trainer      step {show(t['step'])}, {tokens} tokens seen, learning rate {lr}, "
                     f"data {show(loader.get('kind'))}{' at ' + where if where else ''}")
    s = r["sizes"]
    lines.append(f"on disk      {_human(s['on_disk_bytes'])}"
                 + (f"; {s['tensors']:,} tensors, {_human(s['tensor_bytes'])}" if s["tensors"] is not None else ""))
    for name, g in (s["groups"] or {}).items():
        lines.append(f"  {name:<22} {g['tensors']:>6,} tensors  {_human(g['bytes']):>12}")
    for note in r["notes"]:
        lines.append(f"note         {note}")
    from slipstream.checkpoint.manager import UNVERIFIABLE

    problems = r["integrity"]["problems"]
    if problems == [UNVERIFIABLE]:
        lines.append("integrity    NOT VERIFIED:")
        lines.extend(f"  - {p}" for p in problems)
    elif problems:
        lines.append(f"integrity    DAMAGED: {len(problems)} problem{'s' if len(problems) > 1 else ''}")
        lines.extend(f"  - {p}" for p in problems)
    else:
        lines.append("integrity    ok (every file matches the manifest's size and checksum)")
    return "\n".join(lines)


# --- export -------------------------------------------------------------------------------------

def _check_out(out: Path, force: bool) -> None:
    if out.exists() or out.is_symlink():
        if not out.is_dir() or out.is_symlink():
            raise UserError(f"--out '{out}' exists and is not a folder; export writes a folder: choose another --out")
        if not force:
            raise UserError(f"--out '{out}' already exists; pass --force to replace it, or choose another --out")
        other = sorted(p.name for p in out.iterdir() if p.name not in _EXPORT_FILES or not p.is_file())
        if other:
            raise UserError(f"--out '{out}' holds files an export does not write ({', '.join(other[:3])}"
                            f"{' ...' if len(other) > 3 else ''}); --force only replaces an earlier export: "
                            "choose a new or empty folder")


def _load_model(ckpt_dir: Path):
    """Our Transformer (fp32, CPU) with the checkpoint's weights, and its config."""
    from slipstream.checkpoint import manager as ckpt
    from slipstream.config.load import config_from_toml_text
    from slipstream.models.transformer import Transformer, materialize

    try:
        cfg = config_from_toml_text(ckpt.read_text_inside(ckpt_dir, "config.toml"))
    except OSError as e:
        raise UserError(f"checkpoint '{ckpt_dir}' has no readable config.toml ({e.strerror}); it is damaged") from None
    from slipstream.plan.preflight import check_weights_fit
    check_weights_fit(cfg.model, "cpu", f"checkpoint '{ckpt_dir}'")  # a crafted config: refuse before building
    with torch.device("meta"):
        model = Transformer(cfg.model)
    model = materialize(model, "cpu", seed=0)
    if cfg.sparsity.method != "none":  # its masks, saved with the model: loaded, then folded in below
        from slipstream.optimize.sparsity import register_masks

        register_masks(model, cfg.sparsity)
    ckpt.load_checkpoint(ckpt_dir, model)  # checks the manifest; per-rank models: rank 0's copy
    if cfg.sparsity.method != "none":
        from slipstream.optimize.sparsity import fold_masks

        fold_masks(model)  # weight * mask under the weights' own names; no mask buffers in the export
    return model.eval(), cfg


def _tie_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def _plain_state_dict(model: torch.nn.Module, dtype: torch.dtype | None) -> tuple[dict[str, torch.Tensor],
                                                                                  dict[str, str]]:
    """(state dict with floating tensors cast, {tied key: key it shares its tensor with}).
    Tied keys still point at the same tensor after the cast."""
    sd: dict[str, torch.Tensor] = {}
    ties: dict[str, str] = {}
    first: dict[tuple, str] = {}
    for key, value in model.state_dict().items():
        if not isinstance(value, torch.Tensor) or type(value) not in (torch.Tensor, torch.nn.Parameter):
            sd[key] = value.detach()  # torchao's quantized weights (--quantize): stored as they are, never tied
            continue
        tk = _tie_key(value)
        if tk in first:
            ties[key] = first[tk]
            sd[key] = sd[first[tk]]
            continue
        first[tk] = key
        value = value.detach().cpu()
        if dtype is not None and value.is_floating_point():
            value = value.to(dtype)
        sd[key] = value.contiguous()
    return sd, ties


def export_checkpoint(path: str | Path, fmt: str, out: str | Path, dtype: str | None = None,
                      force: bool = False, quantize: str | None = None) -> Path:
    """Write the checkpoint's model as a `fmt` folder at `out` (see the module docstring)."""
    from slipstream import __version__
    from slipstream.checkpoint import manager as ckpt

    if fmt not in FORMATS:
        raise UserError(f"unknown --format '{fmt}'; choose one of: {', '.join(FORMATS)}")
    if dtype is not None and dtype not in DTYPES:
        raise UserError(f"unknown --dtype '{dtype}'; choose one of: {', '.join(DTYPES)}")
    if quantize is not None:
        from slipstream.optimize.qat import SCHEMES, import_torchao_qat
        from slipstream.optimize.weight_quant import KINDS

        if quantize not in SCHEMES + KINDS:
            raise UserError(f"unknown --quantize '{quantize}'; choose one of: {', '.join(SCHEMES + KINDS)}")
        if fmt != "torch":
            raise UserError(f"--quantize writes torchao's quantized tensors, which only --format torch stores; "
                            f"use --format torch (not {fmt}) or drop --quantize")
        import_torchao_qat()  # refuse before any loading when torchao is missing
    ckpt_dir = ckpt.resolve_checkpoint(path)
    out = Path(out).expanduser()
    _check_out(out, force)
    meta = ckpt.read_meta(ckpt_dir)
    torch_dtype = DTYPES[dtype] if dtype else None

    if fmt == "hf":
        _check_hf_exportable(ckpt_dir)
    # Only the tokenizer the checkpoint carries: a spec naming a file elsewhere is refused.
    spec = ckpt.checkpoint_tokenizer(ckpt_dir, meta, "byte")
    tokenizer_file = Path(spec[4:]) if spec.startswith("bpe:") else None
    model, cfg = _load_model(ckpt_dir)
    if quantize is not None:
        from slipstream.optimize.qat import convert_qat

        if torch_dtype is not None:  # cast first: the quantized model computes in this dtype
            model = model.to(torch_dtype)
        if quantize in SCHEMES:
            convert_qat(model, quantize, cfg.quant.qat_group_size)
        else:  # int8 / int4 weight-only, as `slipstream generate --quantize` runs it
            from slipstream.optimize.weight_quant import quantize_weights

            quantize_weights(model, quantize)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it private; the export is an ordinary folder
        if fmt == "hf":
            ties = _write_hf(model, tmp, torch_dtype, tokenizer_file)
        else:
            sd, ties = _plain_state_dict(model, torch_dtype)
            if fmt == "torch":
                torch.save(sd, tmp / _WEIGHT_FILES[fmt])
            else:
                from safetensors.torch import save_file

                for key in ties:  # stored once, under the key it is tied to
                    del sd[key]
                save_file(sd, str(tmp / _WEIGHT_FILES[fmt]), metadata={
                    "format": "pt", "slipstream_version": __version__, "step": str(meta.get("step")),
                    "preset": cfg.model.preset, "dtype": str(next(iter(sd.values())).dtype).removeprefix("torch."),
                    "tied": json.dumps(ties)})
            if tokenizer_file is not None:
                shutil.copyfile(tokenizer_file, tmp / "tokenizer.json")
        (tmp / "config.toml").write_text(ckpt.read_text_inside(ckpt_dir, "config.toml"), encoding="utf-8")
        info = {"source": str(ckpt_dir.resolve()), "step": meta.get("step"), "format": fmt,
                "dtype": dtype or "as saved", "quantize": quantize, "weights": _WEIGHT_FILES[fmt], "tied": ties,
                "preset": cfg.model.preset, "slipstream_version": __version__, "torch": torch.__version__}
        (tmp / "export.json").write_text(json.dumps(info, indent=2), encoding="utf-8")
        _commit(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def _commit(tmp: Path, out: Path) -> None:
    """Rename the finished folder into place; an earlier export is moved aside first."""
    if out.exists():
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        os.rename(out, old)
        os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, out)


def _check_hf_exportable(ckpt_dir: Path) -> None:
    """Refuse before loading any weights: shape not representable, or no transformers."""
    from slipstream.checkpoint.manager import read_text_inside
    from slipstream.config.load import config_from_toml_text
    from slipstream.models.hf import _import_transformers, hf_family

    try:
        cfg = config_from_toml_text(read_text_inside(ckpt_dir, "config.toml"))
    except OSError as e:
        raise UserError(f"checkpoint '{ckpt_dir}' has no readable config.toml ({e.strerror}); it is damaged") from None
    try:
        hf_family(cfg.model)
    except UserError as e:
        raise UserError(f"--format hf supports GPT-2-shaped models (position=learned, norm=layernorm, mlp=gelu, "
                        f"bias=true, no grouped-query attention), Llama-shaped ones (position=rope, "
                        f"norm=rmsnorm, mlp=swiglu) and Mixtral / Qwen3-MoE-shaped mixtures of experts; this "
                        f"one is none of them: {e}. Use --format safetensors or --format torch instead") from None
    _import_transformers()


def _write_hf(model, folder: Path, dtype: torch.dtype | None, tokenizer_file: Path | None) -> dict[str, str]:
    from safetensors.torch import save_file

    from slipstream.models.hf import hf_config, to_hf_files

    if dtype is not None:
        model = model.to(dtype)  # floating parameters only; ties survive
    config = hf_config(model)
    config.dtype = str(dtype or torch.float32).removeprefix("torch.")
    sd = {k: v.cpu().contiguous() for k, v in to_hf_files(model).items()}
    ties = {}
    if model.cfg.tie_embeddings:  # safetensors refuses shared memory; HF re-ties the head itself
        del sd["lm_head.weight"]
        ties["lm_head.weight"] = next(k for k in sd if k.endswith(("wte.weight", "embed_tokens.weight")))
    config.save_pretrained(folder)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})  # HF checks "format"
    if tokenizer_file is not None:
        shutil.copyfile(tokenizer_file, folder / "tokenizer.json")
        tok_cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "<|endoftext|>",
                   "bos_token": "<|endoftext|>", "model_max_length": model.cfg.max_seq_len}
        (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2), encoding="utf-8")
    return ties
