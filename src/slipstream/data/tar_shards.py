"""WebDataset-style tar shards: TarShards (the dataset a Trainer accepts as train_data / val_data)
and TarShardLoader (its resumable, rank-split batches, on iterable_loader.ProducerLoader).

Format (as the `webdataset` library writes it, e.g. with webdataset.TarWriter): an uncompressed
tar whose consecutive members sharing a key form one sample; the key is the member's path up to
the first dot of its file name, the field is the rest (`train/000123.png`, `train/000123.cls`
-> key `train/000123`, fields `png` and `cls`).

Shards are local files or fsspec URLs (s3://, gs://, http(s)://, file://; credentials from the
environment, transient errors retried: data/remote.py), read by range requests: the index scan
fetches the headers in 256 KiB blocks, each sample its own members.

Reading data from elsewhere, so: members are located by one scan of the tar headers (never
extracted, their paths never used as paths; links, directories and devices are skipped), every
member is capped (SLIPSTREAM_MAX_TAR_MEMBER_BYTES, 64 MiB by default; pax and long-name header records
too, at least 1 MiB) before it is read, nothing
is unpickled (.npy with allow_pickle=False; .pyd/.pickle stay bytes), images open with PIL's
decompression-bomb limit as an error and only in the format their extension names, JSON is
depth-bounded. Compressed tars are refused: random access needs the plain member offsets (and
images inside are compressed already).

Order of an epoch (the same on every rank, for any number of workers): the shards are permuted
by (seed, epoch) and each shard's samples by (seed, epoch, shard); sample k of that sequence goes
to rank k % world_size, every rank keeping floor(N / W) samples (equal batch counts: ranks in
lockstep), and batch j of a rank is its samples j*B .. j*B + B-1, built by worker j % num_workers.
Because the index gives every member's offset, a worker reads (and decodes) only the samples of
its own batches, and a resumed loader starts at the saved batch without reading what came before.
The shuffle is as good as the shards are large (a batch draws from one or two shards), as with
webdataset's shard shuffle plus buffer. The costs: the index is built when TarShards is created
(one header scan per shard, in the training process: measured 2.3 s for 100,000 local members
on 2 shared cores; remote shards cost a range request per 256 KiB of headers, more with members
larger than that) and held in memory (measured about 700 bytes per sample of two fields).

Decoding (decode=True or "tensor"): png / jpg / jpeg / webp -> uint8 CHW tensor (grayscale 1
channel, everything else RGB); decode="pil" hands PIL images (RGB or L) to the transform;
decode=False leaves every field as bytes. .npy -> tensor, .cls / .index -> int, .txt -> str,
.json -> parsed; other fields stay bytes. `transform(sample)` gets the sample dict (fields plus
`__key__` and `__url__`, the shard path); a field it asks for that the sample lacks is a UserError
naming the shard and sample. Each sample's transform runs with torch's, Python's and numpy's
global generators seeded by (seed, epoch, k) (and the caller's restored afterwards), so random
augmentations are the same with any number of workers and after a resume.
"""

from __future__ import annotations

import bisect
import contextlib
import glob
import hashlib
import io
import os
import random
import re
import tarfile
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np
import torch

from slipstream.data.iterable_loader import ProducerLoader
from slipstream.data.loader_checks import check_positive, check_rank, seed_key
from slipstream.errors import UserError
from slipstream.safe_read import MiB, Cap, loads_bounded

TAR_MEMBER = Cap("tar shard member", 64 * MiB, "SLIPSTREAM_MAX_TAR_MEMBER_BYTES")
IMAGE_FORMATS = {"png": "PNG", "jpg": "JPEG", "jpeg": "JPEG", "webp": "WEBP"}
_BRACE = re.compile(r"\{(\d+)\.\.(\d+)\}")
_TAR_BLOCK = 512


# --- the shard list ------------------------------------------------------------------------------------------------

def expand_sources(sources: str | os.PathLike | Iterable[str | os.PathLike]) -> list[Path | str]:
    """Paths, folders (their *.tar files), globs (`shards/*.tar`), fsspec URLs of shards
    (`s3://bucket/train-{000..009}.tar`) and WebDataset brace ranges (`shard-{000..009}.tar`),
    in the order given (a glob or folder: sorted)."""
    items = [sources] if isinstance(sources, (str, os.PathLike)) else list(sources)
    if not items:
        raise UserError("TarShards got no shards; pass a path, folder, glob or list of .tar files")
    out: list[Path | str] = []
    for item in items:
        for name in _expand_braces(str(item)):
            if "://" in name:
                if any(c in name for c in "*?["):
                    raise UserError(f"{name!r}: globs are not expanded in URLs; list the shards or use a range "
                                    f"such as train-{{000..009}}.tar")
                out.append(name)
                continue
            path = Path(name).expanduser()
            if path.is_dir():
                found = sorted(path.glob("*.tar"))
                if not found:
                    raise UserError(f"{path} holds no .tar shards; write them with webdataset.TarWriter or pass the files")
                out.extend(found)
            elif any(c in name for c in "*?["):
                found = sorted(Path(p) for p in glob.glob(os.path.expanduser(name)))
                if not found:
                    raise UserError(f"no tar shards match {name!r}; check the pattern")
                out.extend(found)
            elif path.is_file():
                out.append(path)
            else:
                raise UserError(f"tar shard {path} does not exist; check the path")
    return out


def _expand_braces(name: str) -> list[str]:
    m = _BRACE.search(name)
    if not m:
        return [name]
    lo, hi = m.group(1), m.group(2)
    if int(hi) < int(lo):
        raise UserError(f"empty range {m.group(0)} in {name!r}; write {{low..high}}")
    width = len(lo)
    return [x for i in range(int(lo), int(hi) + 1)
            for x in _expand_braces(name[:m.start()] + str(i).zfill(width) + name[m.end():])]


# --- the index: one header scan per shard --------------------------------------------------------------------------

@dataclass
class Shard:
    path: Path | str  # a local path or an fsspec URL
    samples: list[tuple[str, dict[str, tuple[str, int, int]]]]  # key -> {field: (member name, offset, size)}


def _split_name(name: str) -> tuple[str, str] | None:
    """(key, field) as webdataset splits a member name; None for names that are no sample field."""
    folder, _, base = name.rpartition("/")
    if base.startswith(".") or "." not in base:
        return None
    stem, field = base.split(".", 1)
    return (f"{folder}/{stem}" if folder else stem), field.lower()


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of a remote shard for tarfile's header scan: reads whole blocks
    by range request (with data/remote.py's retries), so skipping a member costs no download."""

    BLOCK = 256 * 1024

    def __init__(self, remote, name: str, size: int) -> None:
        self.remote, self.name, self.size, self.pos = remote, name, size, 0
        self._block: tuple[int, bytes] = (-1, b"")

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        out = []
        while self.pos < end:
            start = self.pos - self.pos % self.BLOCK
            if self._block[0] != start:
                self._block = (start, self.remote.read_range(self.name, start, min(self.size, start + self.BLOCK)))
            piece = self._block[1][self.pos - start: end - start]
            out.append(piece)
            self.pos += len(piece)
        return b"".join(out)


def _open_location(location: Path | str):
    """(binary file object, size) of a local path or a URL."""
    if isinstance(location, Path):
        return open(location, "rb"), location.stat().st_size
    from slipstream.data.remote import Remote

    folder, _, name = location.rpartition("/")
    remote = Remote(folder)
    size = remote.size(name)
    return _RangeFile(remote, name, size), size


def index_shard(path: Path | str, cap: Cap = TAR_MEMBER) -> Shard:
    """Every sample's members (offset and size) from the tar headers, without reading the data."""
    limit = cap.limit
    f, size = _open_location(path)
    with f:
        return _index(f, path, size, cap, limit)


class _HeaderReads(io.RawIOBase):
    """The shard as tarfile's header scan reads it. tarfile reads a pax extended header or a GNU
    long name / long link record whole into memory, however large its header says it is: a read
    over `limit` (the member cap, at least HEADER_FLOOR) is refused before it happens."""

    HEADER_FLOOR = 1 * MiB  # long names and pax records of genuine shards pass a small member cap

    def __init__(self, f, path: Path | str, cap: Cap, limit: int) -> None:
        self.f, self.path, self.cap = f, path, cap
        self.limit = max(limit, self.HEADER_FLOOR)
        self.last_name = "(start of file)"

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0 or n > self.limit:
            raise self.cap.with_limit(self.limit).exceeded(
                f"tar shard {self.path}: a tar header record after member {self.last_name!r} (a pax extended "
                f"header or GNU long name),", n if n is not None and n >= 0 else None)
        return self.f.read(n)


def _index(f, path: Path | str, size: int, cap: Cap, limit: int) -> Shard:
    samples: list[tuple[str, dict[str, tuple[str, int, int]]]] = []
    last_name = "(start of file)"
    headers = _HeaderReads(f, path, cap, limit)
    try:
        with tarfile.open(fileobj=headers, mode="r:") as tar:  # "r:": uncompressed only, headers read lazily
            for member in tar:
                last_name = headers.last_name = member.name
                if not member.isfile():
                    continue  # links, folders, devices: never followed
                split = _split_name(member.name)
                if split is None:
                    continue
                key, field = split
                if member.size > limit:
                    raise cap.exceeded(f"tar shard {path}, member {member.name!r},", member.size)
                if member.offset_data + member.size > size:
                    raise UserError(f"tar shard {path} is truncated: member {member.name!r} runs past the end of "
                                    f"the file; re-create or re-download the shard")
                if not samples or samples[-1][0] != key:
                    samples.append((key, {}))
                fields = samples[-1][1]
                if field in fields:
                    raise UserError(f"tar shard {path}: sample {key!r} has field {field!r} twice "
                                    f"(member {member.name!r}); each key's members must be unique")
                fields[field] = (member.name, member.offset_data, member.size)
            end = tar.offset
    except tarfile.TarError as e:
        raise UserError(f"tar shard {path} is corrupt or not an uncompressed tar (after member {last_name!r}: {e}); "
                        f"re-create it (webdataset.TarWriter or `tar cf`), uncompressed") from None
    # tarfile stops quietly at some damaged headers after the first: what follows the last member
    # must be the end-of-archive zeros, or the rest of the shard would be lost without a word.
    f.seek(end)
    while chunk := f.read(1 << 16):
        if chunk.count(0) != len(chunk):
            raise UserError(f"tar shard {path} is corrupt: unreadable data follows member {last_name!r} "
                            f"(byte {end}); re-create or re-download the shard")
    return Shard(path, samples)


def shard_name(location: Path | str) -> str:
    return location.name if isinstance(location, Path) else location.rpartition("/")[2]


# --- decoding -------------------------------------------------------------------------------------------------------

class Sample(dict):
    """One sample's fields; a missing field names the shard and the sample."""

    def __missing__(self, field: str):
        have = ", ".join(sorted(k for k in self if not k.startswith("__")))
        raise UserError(f"tar shard {self.get('__url__')}: sample {self.get('__key__')!r} has no field {field!r} "
                        f"(it has: {have}); write the field into every sample or pass fields=(...) to TarShards "
                        f"to check them when the shards are indexed")


def decode_field(field: str, data: bytes, where: str, mode: Any = True) -> Any:
    if mode is False:
        return data
    ext = field.rsplit(".", 1)[-1]
    try:
        if ext in IMAGE_FORMATS:
            return _decode_image(data, IMAGE_FORMATS[ext], pil=mode == "pil")
        if ext == "npy":
            return torch.from_numpy(np.load(io.BytesIO(data), allow_pickle=False))
        if ext in ("cls", "cls2", "index"):
            return int(data.decode("utf-8").strip())
        if ext in ("txt", "text"):
            return data.decode("utf-8")
        if ext == "json":
            return loads_bounded(data, where)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - any decoder failure on untrusted bytes is the data's fault
        raise UserError(f"{where}: cannot decode the {ext!r} field ({type(e).__name__}: {e}); "
                        f"fix or drop that sample, or pass decode=False to get raw bytes") from None
    return data  # unknown fields (including .pyd / .pickle) stay bytes: nothing is unpickled


def _decode_image(data: bytes, fmt: str, pil: bool) -> Any:
    from PIL import Image

    with warnings.catch_warnings():
        # Past MAX_IMAGE_PIXELS PIL only warns (up to twice that): refuse there already.
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        img = Image.open(io.BytesIO(data), formats=[fmt])
        img.load()
    if img.mode not in ("L", "RGB"):
        img = img.convert("RGB")
    if pil:
        return img
    array = np.asarray(img)
    tensor = torch.from_numpy(array.copy())
    return tensor.unsqueeze(0) if tensor.dim() == 2 else tensor.permute(2, 0, 1).contiguous()


@contextlib.contextmanager
def seeded_rngs(seed: int, epoch: int, k: int):
    """torch's, Python's and numpy's global generators seeded for one sample, the caller's restored
    after (numpy's too: augmentation libraries such as albumentations draw from it, and a worker's
    numpy state is seeded by the DataLoader per worker, so unseeded it differs with num_workers)."""
    py_state, np_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        s = int(np.random.SeedSequence([seed_key(seed), epoch, k]).generate_state(1, np.uint64)[0])
        torch.manual_seed(s % 2**63)
        random.seed(s)
        np.random.seed(s % 2**32)
        try:
            yield
        finally:
            random.setstate(py_state)
            np.random.set_state(np_state)


# --- the dataset ----------------------------------------------------------------------------------------------------

class TarShards(torch.utils.data.IterableDataset):
    """WebDataset-style tar shards (module docstring). Give it to a Trainer as train_data or
    val_data; iterated directly it yields every sample once, in shard order (split over the
    workers of a plain DataLoader).

    sources: a path, folder, glob or `{000..009}` range, or a list of them.
    decode: True / "tensor", "pil" (images as PIL images for the transform) or False (bytes).
    transform: sample dict -> what the batch is collated from (default: the dict itself).
    fields: the fields to read; others are skipped unread, and a sample lacking one is an error
    when the shards are indexed. None reads every field.
    max_member_bytes: the member size cap (default SLIPSTREAM_MAX_TAR_MEMBER_BYTES or 64 MiB).
    """

    def __init__(self, sources, decode: Any = True, transform: Callable | None = None,
                 fields: Iterable[str] | None = None, max_member_bytes: int | None = None) -> None:
        if decode not in (True, False, "tensor", "pil"):
            raise UserError(f"TarShards decode={decode!r}: use True (tensors), 'pil' or False (raw bytes)")
        if transform is not None and not callable(transform):
            raise UserError(f"TarShards transform must be callable, got {type(transform).__name__}")
        self.decode, self.transform = decode, transform
        self.fields = None if fields is None else tuple(f.lower().lstrip(".") for f in fields)
        cap = TAR_MEMBER.with_limit(max_member_bytes)
        self.shards = [index_shard(p, cap) for p in expand_sources(sources)]
        for shard in self.shards:
            if not shard.samples:
                raise UserError(f"tar shard {shard.path} holds no samples (members named KEY.FIELD); check that "
                                f"it is a WebDataset shard")
            for key, members in shard.samples if self.fields else ():
                missing = [f for f in self.fields if f not in members]
                if missing:
                    raise UserError(f"tar shard {shard.path}: sample {key!r} lacks field(s) {missing} "
                                    f"(it has: {', '.join(sorted(members))}); fix the shard or drop those fields")
        self._files: dict[Path | str, Any] = {}  # open local files and Remote folders, per process

    def __len__(self) -> int:
        return sum(len(s.samples) for s in self.shards)

    def identity(self) -> dict:
        digest = hashlib.sha256("\n".join(f"{shard_name(s.path)}:{len(s.samples)}" for s in self.shards).encode())
        return {"num_shards": len(self.shards), "num_samples": len(self), "shards_sha256": digest.hexdigest()}

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_files": {}}  # open files stay in their process

    def _read(self, path: Path | str, name: str, offset: int, size: int) -> bytes:
        f = self._files.get(path)
        if f is None:
            if len(self._files) >= 16:  # a few shards at a time are open per process
                old = self._files.pop(next(iter(self._files)))
                if not isinstance(old, tuple):
                    old.close()
            if isinstance(path, Path):
                f = self._files[path] = open(path, "rb", buffering=0)
            else:
                from slipstream.data.remote import Remote

                folder, _, file_name = path.rpartition("/")
                f = self._files[path] = (Remote(folder), file_name)
        if isinstance(f, tuple):
            remote, file_name = f
            return remote.read_range(file_name, offset, offset + size)  # checks the length itself
        # pread, not seek + read: forked workers share an inherited file's position.
        chunks, done = [], 0
        while done < size:
            chunk = os.pread(f.fileno(), size - done, offset + done)
            if not chunk:
                raise UserError(f"tar shard {path}, member {name!r}: the file shrank since it was indexed; "
                                f"do not change shards while training")
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def load(self, shard_index: int, sample_index: int, seed: int = 0, epoch: int = 0, k: int = 0) -> Any:
        """Read, decode and transform one sample (the transform under seeded_rngs(seed, epoch, k))."""
        shard = self.shards[shard_index]
        key, members = shard.samples[sample_index]
        sample = Sample(__key__=key, __url__=str(shard.path))
        for field, (name, offset, size) in members.items():
            if self.fields is None or field in self.fields:
                where = f"tar shard {shard.path}, member {name!r}"
                sample[field] = decode_field(field, self._read(shard.path, name, offset, size), where, self.decode)
        if self.transform is None:
            return sample
        with seeded_rngs(seed, epoch, k):
            return self.transform(sample)

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        w, n = (info.id, info.num_workers) if info is not None else (0, 1)
        k = 0
        for s, shard in enumerate(self.shards):
            for i in range(len(shard.samples)):
                if k % n == w:
                    yield self.load(s, i, k=k)
                k += 1


# --- the loader -----------------------------------------------------------------------------------------------------

class TarProducer:
    """Batch j of epoch e of one rank from the epoch's global sample order (module docstring)."""

    reshardable = True

    def __init__(self, shards: TarShards, batch_size: int, shuffle: bool, seed: int, drop_last: bool,
                 rank: int, world_size: int, collate_fn: Callable | None) -> None:
        self.data, self.batch_size, self.shuffle, self.seed = shards, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.collate = collate_fn or torch.utils.data.default_collate
        self.n = len(shards)
        self.per_rank = self.n // world_size
        full, rest = divmod(self.per_rank, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        if self.batches_per_epoch == 0:
            raise UserError(f"tar shards too small: {self.n} samples over {world_size} rank(s) is {self.per_rank} "
                            f"per rank, less than batch_size={batch_size}; lower the batch size or add samples")
        self._epoch_order: tuple[int, list[int], list[int]] | None = None
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    def identity(self) -> dict:
        return {**self.data.identity(), "seed": self.seed, "shuffle": self.shuffle, "batch_size": self.batch_size,
                "world_size": self.world_size, "drop_last": self.drop_last}

    def empty_message(self, epoch: int) -> str:
        return f"tar shards yielded no batch in epoch {epoch}"

    def set_resume(self, epoch: int, batch: int, dataset_state: Any) -> bool:
        return False  # the order is a function of (seed, epoch): the keys alone say where to go on

    def _order(self, epoch: int) -> tuple[list[int], list[int]]:
        if self._epoch_order is None or self._epoch_order[0] != epoch:
            count = len(self.data.shards)
            if self.shuffle:
                order = np.random.default_rng([seed_key(self.seed), epoch]).permutation(count).tolist()
            else:
                order = list(range(count))
            starts = np.concatenate([[0], np.cumsum([len(self.data.shards[s].samples) for s in order])]).tolist()
            self._epoch_order = (epoch, order, starts)
            self._perms.clear()
        return self._epoch_order[1], self._epoch_order[2]

    def locate(self, epoch: int, k: int) -> tuple[int, int]:
        """(shard, sample in shard) of the epoch's k-th sample."""
        order, starts = self._order(epoch)
        pos = bisect.bisect_right(starts, k) - 1
        shard, local = order[pos], k - starts[pos]
        if not self.shuffle:
            return shard, local
        perm = self._perms.get((epoch, shard))
        if perm is None:
            n = len(self.data.shards[shard].samples)
            perm = self._perms[(epoch, shard)] = np.random.default_rng([seed_key(self.seed), epoch, shard, 1]).permutation(n)
        return shard, int(perm[local])

    def batch(self, epoch: int, j: int) -> tuple[Any, None]:
        items = []
        for p in range(j * self.batch_size, min((j + 1) * self.batch_size, self.per_rank)):
            k = p * self.world_size + self.rank
            items.append(self.data.load(*self.locate(epoch, k), seed=self.seed, epoch=epoch, k=k))
        return self.collate(items), None


class TarShardLoader(ProducerLoader):
    """Infinite, resumable batches of TarShards over DataLoader workers, split over ranks."""

    kind = "TarShardLoader"

    def __init__(self, shards: TarShards, batch_size: int, shuffle: bool = True, seed: int = 0,
                 drop_last: bool = True, collate_fn: Callable | None = None, num_workers: int = 0,
                 prefetch: int = 2, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu",
                 pin_memory: bool | None = None) -> None:
        check_positive(batch_size=batch_size)
        check_rank(rank, world_size)
        if not isinstance(shards, TarShards):
            raise UserError(f"TarShardLoader needs a TarShards dataset, got {type(shards).__name__}")
        producer = TarProducer(shards, batch_size, shuffle, seed, drop_last, rank, world_size, collate_fn)
        super().__init__(producer, num_workers=num_workers, prefetch=prefetch, device=device,
                         pin_memory=pin_memory, seed=seed, rank=rank)
        self.dataset, self.batch_size, self.rank, self.world_size = shards, batch_size, rank, world_size
