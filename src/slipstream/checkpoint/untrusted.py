"""Reading a checkpoint that someone else may have written, without running their code.

A checkpoint folder is data from elsewhere: every file in it, the manifest included, may have
been written by whoever handed it over, so its checksums prove the files are undamaged, not
that they are harmless. The one file that could run code is DCP's `model_optim/.metadata`,
a pickle, and DCP's non-tensor values (the optimizer's hyper-parameters), which it stores as
`torch.save` blobs and loads with `weights_only=False`. This module reads both safely:

    read_dcp_metadata(folder)   the metadata, unpickled with an allow-list of the classes DCP's
                                metadata is made of (nothing else can be built, so nothing can be
                                called), then checked field by field: every shard it points at is
                                a plain file inside the folder
    SafeReader(folder)          a FileSystemReader whose read_metadata is read_dcp_metadata
    SafePlanner()               a DefaultLoadPlanner that loads non-tensor values with
                                weights_only=True
    inside(folder, name)        a path named by a checkpoint, refused unless it stays in the folder

Every path that loads weights goes through load_weights() in manager.py, which uses these two;
`checkpoint inspect` reads the metadata through read_dcp_metadata.
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
import re
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from slipstream.errors import UserError

METADATA_FILE = ".metadata"
# DCP names its shard files __<rank>_<n>.distcp; a metadata entry pointing anywhere else is refused.
_SHARD_NAME = re.compile(r"__\d+_\d+\.distcp")

_DCP = "torch.distributed.checkpoint.metadata"
_DCP_METADATA_CLASSES = {
    (_DCP, "Metadata"), (_DCP, "TensorStorageMetadata"), (_DCP, "BytesStorageMetadata"),
    (_DCP, "ChunkStorageMetadata"), (_DCP, "TensorProperties"), (_DCP, "MetadataIndex"),
    (_DCP, "StorageMeta"), (_DCP, "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"), ("collections", "OrderedDict"),
}
# StorageMeta.checkpoint_id is the path DCP saved to (pathlib's module is pathlib._local on
# Python 3.13). It is informational: read back as an inert pure path, never a concrete one.
_PATH_CLASSES = {"PosixPath": pathlib.PurePosixPath, "PurePosixPath": pathlib.PurePosixPath,
                 "WindowsPath": pathlib.PureWindowsPath, "PureWindowsPath": pathlib.PureWindowsPath}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout_by_name(name: str) -> torch.layout:
    # What torch pickles a layout as (torch.serialization._get_layout), restricted to a lookup.
    if not isinstance(name, str) or name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


class _RestrictedUnpickler(pickle.Unpickler):
    """Builds only the objects DCP's metadata is made of. Every class or function a pickle uses
    is looked up through find_class; refusing everything else means no pickle can reach a
    callable that does anything but construct those records."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _DCP_METADATA_CLASSES:
            return super().find_class(module, name)
        if module == "torch":
            value = getattr(torch, name, None)
            if isinstance(value, (torch.dtype, torch.layout, torch.memory_format)):
                return value
        if module == "torch.serialization" and name == "_get_layout":
            return _layout_by_name
        if module in ("pathlib", "pathlib._local") and name in _PATH_CLASSES:
            return _PATH_CLASSES[name]
        raise pickle.UnpicklingError(f"it would load {module}.{name}")


def restricted_loads(data: bytes) -> Any:
    return _RestrictedUnpickler(io.BytesIO(data)).load()


def inside(folder: Path, name: str) -> Path:
    """folder/name, refused (UserError) unless it stays inside folder: no absolute path, no `..`,
    no symbolic link (a link could point anywhere), and nothing but a regular file if it exists
    (reading a pipe or a device would never end)."""
    folder = Path(folder)
    path = folder / name
    if (Path(name).is_absolute() or ".." in Path(name).parts or path.is_symlink()
            or not path.resolve().is_relative_to(folder.resolve())):
        raise UserError(f"checkpoint '{folder}' names '{name}', which is outside the checkpoint folder; refused "
                        "(a checkpoint never makes slipstream read a file outside it)")
    if path.exists() and not path.is_file():
        raise UserError(f"checkpoint '{folder}': '{name}' is not a regular file; refused")
    return path


class RefusedFile(UserError):
    """A checkpoint file that is not what slipstream writes; `reason` says why, in a few words."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


def _refuse(folder: Path, why: str) -> RefusedFile:
    return RefusedFile(f"checkpoint file '{folder / METADATA_FILE}' is refused: {why}. It is not DCP metadata "
                       "as slipstream writes it (a damaged or crafted file; slipstream never runs code from a "
                       "checkpoint); use a checkpoint you trust", reason=why)


def read_dcp_metadata(folder: str | Path) -> Metadata:
    """The DCP metadata of `folder` (a checkpoint's model_optim/), unpickled under the allow-list
    and checked: UserError naming the file when it is anything else."""
    folder = Path(folder)
    path = folder / METADATA_FILE
    # The shard folder and the checkpoint folder holding it must be real folders: a link would
    # make this checkpoint load another one's tensors (or any DCP folder on the machine).
    if folder.is_symlink() or folder.parent.is_symlink():
        raise _refuse(folder, "its folder is a symbolic link")
    if path.is_symlink() or not path.is_file():
        raise _refuse(folder, "it is missing or not a regular file")
    try:
        metadata = restricted_loads(path.read_bytes())
    except pickle.UnpicklingError as e:
        raise _refuse(folder, str(e)) from None
    except Exception as e:  # noqa: BLE001 - truncated or garbled data fails in many ways
        raise _refuse(folder, f"it does not unpickle ({type(e).__name__}: {e})") from None
    problem = _metadata_problem(metadata, folder)
    if problem:
        raise _refuse(folder, problem)
    return metadata


def _is_size(value: Any) -> bool:
    return isinstance(value, torch.Size) and all(isinstance(d, int) and d >= 0 for d in value)


def _metadata_problem(md: Any, folder: Path) -> str | None:
    """What is wrong with unpickled metadata (None: it has the shape DCP writes and every shard
    it names is a plain file inside `folder`)."""
    if not isinstance(md, Metadata):
        return f"it holds a {type(md).__name__}, not DCP's Metadata"
    if not isinstance(md.state_dict_metadata, dict):
        return "state_dict_metadata is not a dict"
    for key, entry in md.state_dict_metadata.items():
        if not isinstance(key, str):
            return f"key {key!r} is not a string"
        if isinstance(entry, TensorStorageMetadata):
            p = entry.properties
            if not (isinstance(p, TensorProperties) and isinstance(p.dtype, torch.dtype) and _is_size(entry.size)
                    and isinstance(entry.chunks, list)
                    and all(isinstance(c, ChunkStorageMetadata) and _is_size(c.offsets) and _is_size(c.sizes)
                            for c in entry.chunks)):
                return f"the entry of '{key}' is malformed"
        elif not isinstance(entry, BytesStorageMetadata):
            return f"the entry of '{key}' is a {type(entry).__name__}"
    if not isinstance(md.storage_data, dict):
        return "storage_data is not a dict"
    sizes: dict[str, int] = {}
    for index, info in md.storage_data.items():
        if not isinstance(index, MetadataIndex) or not isinstance(info, _StorageInfo):
            return "storage_data holds something other than shard locations"
        name = info.relative_path
        if not isinstance(name, str) or not _SHARD_NAME.fullmatch(name):
            return f"it points at '{name}', which is not a shard file of this folder"
        if name not in sizes:
            shard = folder / name
            if shard.is_symlink() or not shard.is_file() or shard.resolve().parent != folder.resolve():
                return f"its shard '{name}' is missing or not a regular file of this folder"
            sizes[name] = shard.stat().st_size
        offset, length = info.offset, info.length
        if not (isinstance(offset, int) and isinstance(length, int) and 0 <= offset and 0 <= length
                and offset + length <= sizes[name]):
            return f"it points past the end of '{name}'"
        if info.transform_descriptors:  # slipstream never writes compressed or transformed shards
            return f"it asks for stream transforms {info.transform_descriptors!r}"
    if md.planner_data is not None and not isinstance(md.planner_data, dict):
        return "planner_data is not a dict"
    if md.storage_meta is not None and not isinstance(md.storage_meta, StorageMeta):
        return "storage_meta is malformed"
    return None


class SafeReader(FileSystemReader):
    """DCP's file reader with the metadata read by read_dcp_metadata. No per-rank metadata
    (`__<rank>.metadata`, which slipstream never writes): read_metadata takes no rank."""

    def read_metadata(self) -> Metadata:  # type: ignore[override]
        metadata = read_dcp_metadata(Path(os.fspath(self.path)))
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id  # as FileSystemReader does
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, except that non-tensor values (learning rates, betas, the
    parameter names of a group) are unpickled with weights_only=True: plain containers,
    numbers and strings only."""

    def __init__(self, folder: str | Path):
        super().__init__()
        self.folder = Path(folder)
        self.refused: UserError | None = None  # set when a value was refused; DCP wraps what we raise

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        from torch.distributed.checkpoint._traverse import set_element

        try:
            obj = torch.load(value, map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - weights_only raises UnpicklingError; garbage anything
            first = str(e).strip().splitlines()[0][:200] if str(e).strip() else ""
            self.refused = UserError(
                f"checkpoint '{self.folder}': the stored value '{read_item.dest_index.fqn}' is refused: it is "
                f"not plain data ({type(e).__name__}: {first}); slipstream never runs code from a checkpoint; "
                "use a checkpoint you trust")
            raise self.refused from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
        else:
            self.state_dict[read_item.dest_index.fqn] = obj
