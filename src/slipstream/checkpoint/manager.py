"""Checkpoints: save, find, load; atomic and safe to read.

Layout of one checkpoint (a folder under <run dir>/checkpoints/):

    step_00000100/
      model_optim/         torch.distributed.checkpoint (DCP) shards of {"model", "optim"}
      trainer_state.json   step, scheduler, data-loader position, RNG states, counters
      config.toml          the resolved config of the run
      meta.json            format version, step, world size, tokenizer, versions
      tokenizer.json       copy of a bpe tokenizer file, when one is used
      COMPLETE             written last: a folder without it is ignored

Model and optimizer go through DCP (each rank writes its own shard), so the same format
serves single-process runs, DDP and FSDP (sharded parameters and optimizer state) alike;
ZeRO-1's optimizer shards are saved per rank. Everything else is JSON, written by rank 0:
loading never unpickles arbitrary objects. A checkpoint is written into a temporary
folder and renamed into place by rank 0 after every rank has written, so an interrupted
save never looks complete.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import random
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

FORMAT_VERSION = 1
COMPLETE_MARKER = "COMPLETE"
_PREFIX = "step_"


def checkpoint_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def _barrier() -> None:
    if _rank_world()[1] > 1:
        dist.barrier()


@contextlib.contextmanager
def _quiet_dcp():
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
    """Write a complete checkpoint atomically; returns its final path. Distributed: every rank
    calls this (DCP writes each rank's shard); rank 0 writes the rest and commits."""
    rank, world = _rank_world()
    checkpoints_dir = Path(checkpoints_dir)
    final = checkpoints_dir / checkpoint_name(step)
    # One temporary name for all ranks; only one job writes into a run directory at a time.
    tmp = checkpoints_dir / f".{final.name}.tmp"
    if rank == 0:
        checkpoints_dir.mkdir(parents=True, exist_ok=True)
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a crashed save
        tmp.mkdir()
    _barrier()
    try:
        _write_shards(tmp, model, optimizer)
        _barrier()  # every rank's shard is on disk before the checkpoint can be committed
        if rank == 0:
            per_rank = optimizer is not None and _is_local_sgd(optimizer)
            _write_checkpoint(tmp, step, optimizer is not None, trainer_state, config_toml,
                              {"world_size": world, "per_rank_model": per_rank, **(meta or {})}, extra_files)
            _commit(tmp, final, checkpoints_dir)
    except BaseException:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # never leave a half-written folder behind
        raise
    _barrier()  # nobody reads or prunes before the commit
    return final


def _commit(tmp: Path, final: Path, checkpoints_dir: Path) -> None:
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
    return f"optim_zero1_rank{_rank_world()[0]}"


def _state_payload(model: torch.nn.Module, optimizer: Any | None, model_key: str = "model") -> dict[str, Any]:
    """What DCP saves/loads: model and optimizer state dicts keyed by parameter names.
    DDP wrappers and FSDP's sharded (DTensor) parameters are handled by get_state_dict."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    if optimizer is None:
        return {model_key: get_model_state_dict(model)}
    if _is_local_sgd(optimizer):
        # Between averaging steps the replicas differ (parameters and Adam moments): each rank
        # saves its own. A shared key would be written by whichever rank DCP picks per tensor.
        rank = _rank_world()[0]
        model_sd, optim_sd = get_state_dict(model, optimizer.optim)
        return {f"model_rank{rank}": model_sd, f"optim_rank{rank}": optim_sd}
    if _is_zero1(optimizer):
        # Each rank holds the state of its own partition only: saved under a per-rank key.
        # The outer groups hold the current hyper-parameters (the scheduler sets them there;
        # ZeRO copies them inward only when it steps): bring the local optimizer up to date.
        _copy_hyperparameters(optimizer.param_groups, optimizer.optim.param_groups)
        return {"model": get_model_state_dict(model),
                _zero1_key(): get_optimizer_state_dict(model, optimizer.optim)}
    model_sd, optim_sd = get_state_dict(model, torch_optimizers(optimizer))
    return {"model": model_sd, "optim": optim_sd}


def _copy_hyperparameters(source: list[dict], target: list[dict]) -> None:
    for src, dst in zip(source, target):
        dst.update({k: v for k, v in src.items() if k != "params"})


def _is_zero1(optimizer: Any) -> bool:
    return type(optimizer).__name__ == "ZeroRedundancyOptimizer"


def _is_local_sgd(optimizer: Any) -> bool:
    return type(optimizer).__name__ == "PostLocalSGDOptimizer"


def _write_shards(folder: Path, model: torch.nn.Module, optimizer: Any | None) -> None:
    with _quiet_dcp():
        dcp.save(_state_payload(model, optimizer), checkpoint_id=str(folder / "model_optim"))


def _write_checkpoint(folder: Path, step: int, has_optimizer: bool, trainer_state: dict[str, Any],
                      config_toml: str, meta: dict[str, Any], extra_files: dict[str, str | Path] | None) -> None:
    _write_text(folder / "trainer_state.json", json.dumps(trainer_state))
    _write_text(folder / "config.toml", config_toml)
    full_meta = {
        "format_version": FORMAT_VERSION, "step": step, "time": time.time(),
        "torch": torch.__version__, "has_optimizer": has_optimizer, **meta,
    }
    for name, src in (extra_files or {}).items():
        shutil.copyfile(src, folder / name)
    _write_text(folder / "meta.json", json.dumps(full_meta, indent=2))
    _write_text(folder / COMPLETE_MARKER, "")  # last: its presence means everything above is on disk


def _write_text(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def prune_checkpoints(checkpoints_dir: str | Path, keep_last: int, protect: Path | None = None) -> None:
    """Delete all but the newest `keep_last` complete checkpoints (never `protect`)."""
    complete = list_checkpoints(checkpoints_dir)
    for path in complete[:-keep_last] if keep_last > 0 else []:
        if protect is None or path.resolve() != Path(protect).resolve():
            shutil.rmtree(path, ignore_errors=True)


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


def read_meta(path: Path) -> dict[str, Any]:
    try:
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint '{path}' has an unreadable meta.json ({e}); it is damaged") from None
    if meta.get("format_version") != FORMAT_VERSION:
        raise UserError(f"checkpoint '{path}' has format version {meta.get('format_version')}, "
                        f"this slipstream reads version {FORMAT_VERSION}")
    return meta


# --- load ----------------------------------------------------------------------------------

def load_checkpoint(path: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer | None = None
                    ) -> dict[str, Any]:
    """Load model (and optimizer) in place; return the trainer state dict."""
    meta = read_meta(path)
    if optimizer is not None and not meta.get("has_optimizer", False):
        raise UserError(f"checkpoint '{path}' holds no optimizer state, so training cannot resume from it")
    try:
        with _quiet_dcp():
            # A model saved per rank (local SGD) is read back from rank 0's copy when loaded alone.
            _load_weights(path, model, optimizer, "model_rank0" if meta.get("per_rank_model") else "model")
    except UserError:
        raise
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        raise UserError(f"could not load checkpoint '{path}': {type(e).__name__}: {str(e).splitlines()[0][:300]}. "
                        "The checkpoint is damaged or was saved for a different model shape.") from None
    try:
        return json.loads((path / "trainer_state.json").read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise UserError(f"checkpoint '{path}' has an unreadable trainer_state.json ({e}); it is damaged") from None


def _load_weights(path: Path, model: torch.nn.Module, optimizer: Any | None, model_key: str) -> None:
    from torch.distributed.checkpoint.state_dict import set_model_state_dict, set_optimizer_state_dict

    payload = _state_payload(model, optimizer, model_key)
    dcp.load(payload, checkpoint_id=str(path / "model_optim"))
    if optimizer is None:
        set_model_state_dict(model, payload[model_key])
    elif _is_local_sgd(optimizer):
        rank = _rank_world()[0]
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
                       optim_state_dict=payload["optim"])
