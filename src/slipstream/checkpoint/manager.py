"""Checkpoints: save, find, load; atomic and safe to read.

Layout of one checkpoint (a folder under <run dir>/checkpoints/):

    step_00000100/
      model_optim/         torch.distributed.checkpoint (DCP) shards of {"model", "optim"}
      trainer_state.json   step, scheduler, data-loader position, RNG states, counters
      config.toml          the resolved config of the run
      meta.json            format version, step, world size, tokenizer, versions
      tokenizer.json       the contents of a bpe tokenizer, when one is used (meta.json
                           names it as "bpe:tokenizer.json")
      manifest.json        size and CRC32 of every file above (format 2)
      COMPLETE             written last: a folder without it is ignored

Model and optimizer go through DCP (each rank writes its own shard), so the same format
serves single-process runs, DDP and FSDP (sharded parameters and optimizer state) alike;
ZeRO-1's optimizer shards are saved per rank. Everything else is JSON, written by rank 0.
A checkpoint is written into a temporary folder and renamed into place by rank 0 after
every rank has written, so an interrupted save never looks complete.

A checkpoint may come from someone else, manifest and all (SECURITY.md): loading never runs
code from it (DCP's pickled metadata and values are read under an allow-list, see
untrusted.py) and never reads a file outside its folder because a file inside says so.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
import re
import shutil
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from slipstream.errors import UserError
from slipstream.optimize.optimizers import torch_optimizers

FORMAT_VERSION = 2  # 2: manifest.json (sizes and CRC32s); 1 is still read
READABLE_VERSIONS = (1, 2)
COMPLETE_MARKER = "COMPLETE"
_PREFIX = "step_"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def barrier() -> None:
    if rank_world()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def quiet_dcp():
    # Single-process DCP warns that torch.distributed is not initialized; that is intended here.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        yield


# --- RNG state as JSON -------------------------------------------------------------------

def _tensor_to_b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _b64_to_tensor(s: str) -> torch.Tensor:
    return torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())


def capture_rng_state() -> dict[str, Any]:
    py_version, py_state, py_gauss = random.getstate()
    np_state = np.random.get_state()
    state = {
        "python": [py_version, list(py_state), py_gauss],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "torch": _tensor_to_b64(torch.get_rng_state()),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = [_tensor_to_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict[str, Any]) -> None:
    py_version, py_state, py_gauss = state["python"]
    random.setstate((py_version, tuple(py_state), py_gauss))
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
    torch.set_rng_state(_b64_to_tensor(state["torch"]))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([_b64_to_tensor(s) for s in state["cuda"]])


# --- save ----------------------------------------------------------------------------------

def save_checkpoint(checkpoints_dir: str | Path, step: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer | None, trainer_state: dict[str, Any],
                    config_toml: str, meta: dict[str, Any] | None = None,
                    extra_files: dict[str, str | Path] | None = None) -> Path:
    """Write a complete checkpoint atomically and synchronously; returns its final path.
    Distributed: every rank calls this. (The trainer keeps a CheckpointWriter, which can also
    save asynchronously and prune.)"""
    from slipstream.checkpoint.writer import CheckpointWriter

    writer = CheckpointWriter(Path(checkpoints_dir), keep_last=0)
    writer.save(step, model, optimizer, trainer_state, config_toml, meta or {}, extra_files)
    barrier()  # nobody reads before the commit
    return writer.last_committed


def commit(tmp: Path, final: Path, checkpoints_dir: Path) -> None:
    if final.exists():
            # Re-saving a step: move the old copy aside first, so there is never a moment
            # without a complete checkpoint for this step.
        old = checkpoints_dir / f".{final.name}.old-{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)


def _zero1_key() -> str:
    return f"optim_zero1_rank{rank_world()[0]}"


def state_payload(model: torch.nn.Module, optimizer: Any | None, model_key: str = "model",
                  flat_optimizer: bool = True) -> dict[str, Any]:
    """What DCP saves/loads: model and optimizer state dicts keyed by parameter names.
    DDP wrappers and FSDP's sharded (DTensor) parameters are handled by get_state_dict.

    The optimizer state is flat (`state.<name>.exp_avg`, `param_groups.<name>.lr`): every entry
    is keyed by its parameter's name, so a rank holding only some of the parameters (a pipeline
    stage) saves and loads exactly its own, at any pipeline degree. Checkpoints from before
    (meta.json without "optim_flat") hold the nested form and load with flat_optimizer=False."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    if optimizer is None:
        return {model_key: get_model_state_dict(model)}
    if is_local_sgd(optimizer):
        # Between averaging steps the replicas differ (parameters and Adam moments): each rank
        # saves its own. A shared key would be written by whichever rank DCP picks per tensor.
        rank = rank_world()[0]
        model_sd, optim_sd = get_state_dict(model, optimizer.optim)
        return {f"model_rank{rank}": model_sd, f"optim_rank{rank}": optim_sd}
    if _is_zero1(optimizer):
        # Each rank holds the state of its own partition only: saved under a per-rank key.
        # The outer groups hold the current hyper-parameters (the scheduler sets them there;
        # ZeRO copies them inward only when it steps): bring the local optimizer up to date.
        _copy_hyperparameters(optimizer.param_groups, optimizer.optim.param_groups)
        return {"model": get_model_state_dict(model),
                _zero1_key(): get_optimizer_state_dict(model, optimizer.optim)}
    options = StateDictOptions(flatten_optimizer_state_dict=flat_optimizer)
    model_sd, optim_sd = get_state_dict(model, torch_optimizers(optimizer), options=options)
    return {"model": model_sd, "optim": optim_sd}


def _copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _is_zero1(optimizer: Any) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def is_local_sgd(optimizer: Any) -> bool:
    return type(optimizer).__name__ == "PostLocalSGDOptimizer"


def write_checkpoint_files(folder: Path, step: int, has_optimizer: bool, trainer_state: dict[str, Any],
                           config_toml: str, meta: dict[str, Any], extra_files: dict[str, str | Path] | None,
                           manifest: dict[str, list[int]]) -> None:
    """Rank 0's part of a save, after every rank's shards are on disk: the JSON/TOML files,
    the manifest (size and CRC32 of every file), and COMPLETE last."""
    from slipstream.checkpoint.writer import MANIFEST, file_crc32

    write_text(folder / "trainer_state.json", json.dumps(trainer_state))
    write_text(folder / "config.toml", config_toml)
    full_meta = {
        "format_version": FORMAT_VERSION, "step": step, "time": time.time(),
        "torch": torch.__version__, "has_optimizer": has_optimizer, **meta,
    }
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, folder / name)
    write_text(folder / "meta.json", json.dumps(full_meta, indent=2))
    for name in ("trainer_state.json", "config.toml", "meta.json", *(extra_files or {})):
        manifest[name] = [(folder / name).stat().st_size, file_crc32(folder / name)]
    write_text(folder / MANIFEST, json.dumps(manifest, indent=1, sort_keys=True))
    write_text(folder / COMPLETE_MARKER, "")  # last: its presence means everything above is on disk


def write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


# --- find ----------------------------------------------------------------------------------

def is_complete(path: Path) -> bool:
    return (path / COMPLETE_MARKER).is_file() and (path / "meta.json").is_file()


def list_checkpoints(checkpoints_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first. Incomplete (interrupted) ones are ignored."""
    checkpoints_dir = Path(checkpoints_dir)
    if not checkpoints_dir.is_dir():
        return []
    found = [p for p in checkpoints_dir.iterdir() if p.is_dir() and p.name.startswith(_PREFIX) and is_complete(p)]
    return sorted(found, key=lambda p: p.name)


def resolve_checkpoint(path: str | Path) -> Path:
    """Accept a checkpoint folder, a run's checkpoints/ folder or a run folder; return a checkpoint."""
    path = Path(path).expanduser()
    if not path.exists():
        raise UserError(f"checkpoint '{path}' does not exist; pass a checkpoint folder or a run directory")
    if (path / COMPLETE_MARKER).exists() or (path / "meta.json").exists():
        if not is_complete(path):
            raise UserError(f"checkpoint '{path}' is incomplete (no {COMPLETE_MARKER} marker: the save was "
                            "interrupted); use an earlier checkpoint")
        return path
    for candidate_dir in (path, path / "checkpoints"):
        found = list_checkpoints(candidate_dir)
        if found:
            return found[-1]
    raise UserError(f"no complete checkpoint found in '{path}' (looked for checkpoints/{_PREFIX}*/ "
                    f"with a {COMPLETE_MARKER} marker)")


UNVERIFIABLE = "format 1 has no manifest.json: its files cannot be checked against checksums"


def verify_checkpoint(path: Path, deep: bool = True) -> list[str]:
    """Problems found in a checkpoint folder (empty: intact). Checks the completion marker,
    meta.json, and every file of the manifest: present, same size, and (deep) same CRC32.
    Checkpoints of format 1 have no manifest: only marker and meta are checked (callers that
    report integrity say so: see UNVERIFIABLE). Manifest entries outside the folder are
    problems, never read."""
    from slipstream.checkpoint.untrusted import inside
    from slipstream.checkpoint.writer import MANIFEST, file_crc32

    if not (path / COMPLETE_MARKER).is_file():
        return [f"no {COMPLETE_MARKER} marker (the save was interrupted)"]
    try:
        meta = read_json_inside(path, "meta.json")
    except (OSError, json.JSONDecodeError, UserError) as e:
        return [f"meta.json is unreadable ({e})"]
    if not isinstance(meta, dict) or meta.get("format_version", 1) not in READABLE_VERSIONS:
        return [f"meta.json has an unknown format version (this slipstream reads {READABLE_VERSIONS})"]
    if meta.get("format_version", 1) < 2:
        return []
    try:
        manifest = read_json_inside(path, MANIFEST)
    except (OSError, json.JSONDecodeError, UserError) as e:
        return [f"{MANIFEST} is unreadable ({e})"]
    if not isinstance(manifest, dict):
        return [f"{MANIFEST} is not a JSON object"]
    problems = []
    for name, entry in sorted(manifest.items()):
        try:
            file = inside(path, name)
        except UserError:
            problems.append(f"{MANIFEST} names '{name}', outside the checkpoint folder (not read)")
            continue
        if not (isinstance(entry, list) and len(entry) == 2 and all(type(v) is int for v in entry)):
            problems.append(f"{MANIFEST} has a malformed entry for {name}")
            continue
        size, crc = entry
        if not file.is_file():
            problems.append(f"{name} is missing")
        elif file.stat().st_size != size:
            problems.append(f"{name} has {file.stat().st_size:,} bytes, the manifest says {size:,}")
        elif deep and file_crc32(file) != crc:
            problems.append(f"{name} does not match its checksum (its contents changed after the save)")
    return problems


def check_intact(path: Path, deep: bool = True) -> None:
    """verify_checkpoint as an error that names the damage and the way out."""
    problems = verify_checkpoint(path, deep)
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise UserError(f"checkpoint '{path}' is damaged: {'; '.join(problems[:3])}{more}. Resume from an "
                        "earlier checkpoint (--checkpoint.resume=auto skips damaged ones by itself)")


def read_meta(path: Path) -> dict[str, Any]:
    from slipstream.checkpoint.untrusted import inside

    try:
        meta = read_json_inside(path, "meta.json")
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint '{path}' has an unreadable meta.json ({e}); it is damaged") from None
    if not isinstance(meta, dict):
        raise UserError(f"checkpoint '{path}' has a meta.json that is not a JSON object; it is damaged")
    if meta.get("format_version") not in READABLE_VERSIONS:
        raise UserError(f"checkpoint '{path}' has format version {meta.get('format_version')}, "
                        f"this slipstream reads version {FORMAT_VERSION}")
    return meta


# --- load ----------------------------------------------------------------------------------

def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None,
                    verify: bool = True) -> dict[str, Any]:
    """Load model (and optimizer) in place; return the trainer state dict. With verify, the
    files are checked against the checkpoint's manifest first (sizes and checksums)."""
    meta = read_meta(path)
    if verify:
        check_intact(path)
    if optimizer is not None and not meta.get("has_optimizer", False):
        raise UserError(f"checkpoint '{path}' holds no optimizer state, so training cannot resume from it")
    try:
        with quiet_dcp():
            # A model saved per rank (local SGD) is read back from rank 0's copy when loaded alone.
            _load_weights(path, model, optimizer, "model_rank0" if meta.get("per_rank_model") else "model",
                          flat_optimizer=bool(meta.get("optim_flat")))
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        if rank_world()[1] > 1:
            # The files passed their checksums; with several ranks a failure here is most likely a
            # peer that died: let it surface as a crash, which a launcher with restarts retries.
            raise
        raise UserError(f"could not load checkpoint '{path}': {type(e).__name__}: {str(e).splitlines()[0][:300]}. "
                        "The checkpoint is damaged or was saved for a different model shape.") from None
    try:
        return read_json_inside(path, "trainer_state.json")
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint '{path}' has an unreadable trainer_state.json ({e}); it is damaged") from None


def read_json_inside(path: Path, name: str) -> Any:
    """A JSON file of the checkpoint folder, under safe_read's size and nesting caps."""
    from slipstream.checkpoint.untrusted import inside
    from slipstream.safe_read import CHECKPOINT_JSON, load_json_capped

    return load_json_capped(inside(path, name), CHECKPOINT_JSON)


def read_text_inside(path: Path, name: str) -> str:
    """A text file of the checkpoint folder (never one outside it: see untrusted.inside)."""
    from slipstream.checkpoint.untrusted import inside
    from slipstream.safe_read import CHECKPOINT_JSON, read_bytes_capped

    data = read_bytes_capped(inside(path, name), CHECKPOINT_JSON)  # same cap as the checkpoint's JSON files
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise UserError(f"checkpoint '{path}': '{name}' is not UTF-8 text (byte {e.start}); it is damaged") from None


def load_dcp(folder: Path, payload: dict[str, Any]) -> None:
    """dcp.load of `folder` into `payload`, safe for a checkpoint from elsewhere: the metadata is
    read under an allow-list (every rank checks it first, so a refused file is the same clear
    error everywhere, before any collective) and non-tensor values with weights_only=True."""
    from slipstream.checkpoint.untrusted import SafePlanner, SafeReader, read_dcp_metadata

    read_dcp_metadata(folder)
    planner = SafePlanner(folder)
    try:
        dcp.load(payload, storage_reader=SafeReader(str(folder)), planner=planner)
    except (Exception, CheckpointException):
        if planner.refused is not None:
            raise planner.refused from None
        raise


def _load_weights(path: Path, model: torch.nn.Module, optimizer: Any | None, model_key: str,
                  flat_optimizer: bool = True) -> None:
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    if optimizer is not None and not flat_optimizer and getattr(model, "pipeline", None) is not None:
        raise UserError(f"checkpoint '{path}' keeps its optimizer state in the layout of slipstream before "
                        "pipeline parallelism (one list of every parameter), which a pipeline stage cannot read; "
                        "resume it with --parallel.pp=1 once and save again")
    payload = state_payload(model, optimizer, model_key, flat_optimizer)
    aliases, borrowed = _tied_copy_aliases(path, model, payload) if optimizer is not None else ({}, set())
    load_dcp(path / "model_optim", payload)
    for copy_key, table_key in aliases.items():  # the head's copy takes the table's optimizer state
        value = payload["optim"][table_key]
        # A rank holding the table too gives the copy state of its own (never one shared tensor).
        payload["optim"][copy_key] = value if table_key in borrowed or not torch.is_tensor(value) else value.clone()
    for key in borrowed:
        del payload["optim"][key]
    if optimizer is None:
        set_model_state_dict(model, payload[model_key])
    elif is_local_sgd(optimizer):
        rank = rank_world()[0]
        set_state_dict(model, optimizer.optim, model_state_dict=payload[f"model_rank{rank}"],
                       optim_state_dict=payload[f"optim_rank{rank}"])
        # Loading gave the inner optimizer new group dicts; the wrapper (which the scheduler
        # updates) must share them, or the learning rate would stop following the schedule.
        optimizer.param_groups = optimizer.optim.param_groups
    elif _is_zero1(optimizer):
        set_model_state_dict(model, payload["model"])
        set_optimizer_state_dict(model, optimizer.optim, payload[_zero1_key()])
        # ZeRO copies its outer groups' hyper-parameters (lr, ...) into the local optimizer at
        # every step: they must hold the restored values, not the fresh optimizer's.
        _copy_hyperparameters(optimizer.optim.param_groups, optimizer.param_groups)
    else:
        set_state_dict(model, torch_optimizers(optimizer), model_state_dict=payload["model"],
                       optim_state_dict=payload["optim"],
                       options=StateDictOptions(flatten_optimizer_state_dict=flat_optimizer))


def _tied_copy_aliases(path: Path, model: torch.nn.Module, payload: dict[str, Any]) -> tuple[dict[str, str], set[str]]:
    """A pipeline stage's copy of a tied embedding (`lm_head.weight`, distributed/pipeline_parallel.py)
    has optimizer state of its own; a checkpoint saved without a pipeline holds only the table's
    (`tok_emb.weight`, the one parameter). Then the copy reads the table's entries. Returns
    ({copy key: table key}, the table keys put into the payload only to load them), having taken
    the copy's keys out of the payload; ({}, set()) when the checkpoint has the copy's own."""
    from slipstream.checkpoint.untrusted import read_dcp_metadata

    optim = payload.get("optim", {})
    if getattr(model, "pipeline", None) is None or not getattr(model.pipeline, "tied", False):
        return {}, set()
    copy_keys = [key for key in optim if key.startswith(("state.lm_head.weight.", "param_groups.lm_head.weight."))]
    saved = read_dcp_metadata(path / "model_optim").state_dict_metadata if copy_keys else {}
    if not copy_keys or any(f"optim.{key}" in saved for key in copy_keys):
        return {}, set()
    aliases, borrowed = {}, set()
    for key in copy_keys:
        table_key = key.replace("lm_head.weight", "tok_emb.weight", 1)
        if table_key not in optim:  # this rank holds the copy only: the table's entry loads into the copy's tensor
            optim[table_key] = optim[key]
            borrowed.add(table_key)
        aliases[key] = table_key
        del optim[key]
    return aliases, borrowed


def checkpoint_tokenizer(path: Path, meta: dict[str, Any], fallback: str) -> str:
    """The tokenizer spec to use with a checkpoint. A bpe tokenizer is the file the checkpoint
    carries (meta.json says "bpe:tokenizer.json"): a spec naming a file outside the folder is
    refused, never read."""
    from slipstream.checkpoint.untrusted import inside

    spec = meta.get("tokenizer", fallback)
    if not isinstance(spec, str):
        raise UserError(f"checkpoint '{path}' has a malformed tokenizer entry in meta.json; it is damaged")
    kind, _, arg = spec.partition(":")
    if kind == "bpe" and arg:
        try:
            file = inside(path, arg)
        except UserError:
            raise UserError(f"checkpoint '{path}' names its tokenizer '{spec}', a file outside the checkpoint "
                            "folder; refused (a checkpoint carries its tokenizer as tokenizer.json inside it)") from None
        if not file.is_file():
            raise UserError(f"checkpoint '{path}' has no {arg} although its tokenizer is '{spec}'; it is damaged")
        return f"bpe:{file}"
    if spec == "byte" or (kind == "tiktoken" and re.fullmatch(r"[A-Za-z0-9_.-]+", arg)):
        return spec  # by name: nothing is read from a path the checkpoint chose
    raise UserError(f"checkpoint '{path}' names an unknown tokenizer {spec!r}; it is damaged or from a "
                    "newer slipstream")
