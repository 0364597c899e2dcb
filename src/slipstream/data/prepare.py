"""Tokenize a corpus once into flat binary shards that training can memory-map.

Output folder layout (all token arrays are raw little-endian uint16/uint32, no header):

    out_dir/
      train_000000.bin  train_000001.bin ...
      val_000000.bin ...
      manifest.json      format, tokenizer, dtype, shards with token counts + sha256, stats

Every document is followed by the tokenizer's eot token, so a split is one long token
stream. The validation split is the tail of the corpus: the last `val_fraction` of the
documents (at least one, and grown up to MIN_VAL_TOKENS tokens while val stays at most
half the corpus). A corpus of a single document (one big text file) is split by tokens
instead, so e.g. a lone novel still gets a validation set.

Safety:
  - atomic: everything is written into a hidden temp folder next to out_dir, which is
    renamed into place only once complete; a crash leaves out_dir as it was.
  - idempotent: if out_dir already holds a manifest for the same inputs (paths, sizes,
    mtimes), tokenizer and settings, and its shards have the recorded sizes, nothing is
    redone.
  - a non-empty folder without a slipstream manifest is never deleted.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import multiprocessing
import os
import shutil
import signal
import tempfile
import time
import uuid
from datetime import datetime, timezone
from typing import Iterable, Iterator

import numpy as np

from slipstream.data.sources import SourceStats, fingerprint_inputs, iter_documents
from slipstream.data.tokenizers import Tokenizer, get_tokenizer
from slipstream.errors import UserError

FORMAT = "slipstream-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
CHUNK_CHARS = 1 << 20  # text per worker task: big enough to amortise IPC, small enough to balance
MIN_VAL_TOKENS = 4096  # enough for a few validation windows on small corpora
SPLITS = ("train", "val")


def _cpu_count() -> int:
    # Respect CPU pinning (containers, SLURM) where the platform can tell us about it.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: uint16 covers GPT-2 sized vocabularies."""
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise UserError(f"tokenizer vocab_size={vocab_size} does not fit in uint32 token files; use a tokenizer with at most 2**32 tokens")


# ----------------------------------------------------------------------------- encoding

def _encode_chunk(tok: Tokenizer, dtype: np.dtype, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    """Encode documents into one flat array with eot after each; also return per-document lengths."""
    encoded = tok.encode_batch(texts)
    lengths = np.fromiter((len(ids) + 1 for ids in encoded), dtype=np.int64, count=len(encoded))
    out = np.empty(int(lengths.sum()), dtype=dtype)
    pos = 0
    for ids, n in zip(encoded, lengths.tolist()):
        out[pos : pos + n - 1] = ids
        out[pos + n - 1] = tok.eot_id
        pos += n
    return out, lengths


# Each pool worker builds its own tokenizer from the spec: tokenizers hold Rust/C objects
# that do not pickle, and rebuilding from the spec works under fork and spawn alike.
_worker_tok: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def _init_worker(spec: str, dtype_str: str) -> None:
    global _worker_tok, _worker_dtype
    # Ctrl-C is handled once, by the parent (which terminates the pool), not by every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_tok = get_tokenizer(spec)
    _worker_dtype = np.dtype(dtype_str)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return _encode_chunk(_worker_tok, _worker_dtype, texts)


def _chunks(docs: Iterable[str], chunk_chars: int) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def _make_pool(num_workers: int, spec: str, dtype: np.dtype):
    # Hugging Face tokenizers warns (and disables its threads) when used after a fork;
    # with one process per core we want it single-threaded in the workers anyway. The
    # variable is set only while the workers start, so the parent keeps its threads.
    previous = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        return multiprocessing.get_context().Pool(num_workers, initializer=_init_worker, initargs=(spec, dtype.str))
    finally:
        if previous is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = previous


class _ShardWriter:
    """Appends token arrays to numbered part files of at most shard_tokens tokens each."""

    def __init__(self, folder: str, shard_tokens: int) -> None:
        self.folder = folder
        self.shard_tokens = shard_tokens
        self.parts: list[list] = []  # [path, tokens]
        self._f = None

    def write(self, tokens: np.ndarray) -> None:
        while len(tokens):
            if self._f is None or self.parts[-1][1] == self.shard_tokens:
                self._next_file()
            room = self.shard_tokens - self.parts[-1][1]
            piece, tokens = tokens[:room], tokens[room:]
            piece.tofile(self._f)
            self.parts[-1][1] += len(piece)

    def _next_file(self) -> None:
        self.close()
        path = os.path.join(self.folder, f"part_{len(self.parts):06d}.tmp")
        self._f = open(path, "wb")
        self.parts.append([path, 0])

    def close(self) -> None:
        if self._f is not None:
            _fsync_close(self._f)
            self._f = None


def _fsync_close(f) -> None:
    # Data must be on disk before the folder is renamed into place, or a power loss could
    # leave a complete-looking manifest next to truncated shards.
    f.flush()
    os.fsync(f.fileno())
    f.close()


# ----------------------------------------------------------------------------- splitting

def _choose_split(doc_lengths: np.ndarray, val_fraction: float) -> tuple[int, int, str]:
    """Decide where val starts. Returns (train_tokens, val_documents, split_by)."""
    total, n_docs = int(doc_lengths.sum()), len(doc_lengths)
    if val_fraction == 0 or total < 2:
        return total, 0, "documents"
    min_tokens = min(MIN_VAL_TOKENS, total // 2)
    if n_docs == 1:
        val_tokens = max(math.ceil(total * val_fraction), min_tokens, 1)
        return total - val_tokens, 0, "tokens"
    min_docs = max(1, round(n_docs * val_fraction))
    n_val, val_tokens = 0, 0
    while n_val < n_docs - 1:  # train always keeps at least one document
        if n_val >= min_docs and val_tokens >= min_tokens:
            break
        next_len = int(doc_lengths[n_docs - 1 - n_val])
        if n_val >= min_docs and val_tokens + next_len > total // 2:
            break  # growing towards MIN_VAL_TOKENS must not eat most of the corpus
        n_val += 1
        val_tokens += next_len
    return total - val_tokens, n_val, "documents"


def _cut_parts(parts: list[list], split_at: int, itemsize: int) -> tuple[list, list]:
    """Assign part files to train/val; the one part straddling split_at is cut in two."""
    train, val, offset = [], [], 0
    for path, n in parts:
        if offset + n <= split_at:
            train.append((path, n))
        elif offset >= split_at:
            val.append((path, n))
        else:
            keep = split_at - offset
            tail = path + ".tail"
            with open(path, "rb") as src, open(tail, "wb") as dst:
                src.seek(keep * itemsize)
                shutil.copyfileobj(src, dst, 1 << 20)
                dst.flush()
                os.fsync(dst.fileno())
            os.truncate(path, keep * itemsize)
            train.append((path, keep))
            val.append((tail, n - keep))
        offset += n
    return train, val


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _finalize_split(folder: str, split: str, parts: list) -> list[dict]:
    shards = []
    for i, (path, n) in enumerate(parts):
        name = f"{split}_{i:06d}.bin"
        os.rename(path, os.path.join(folder, name))
        shards.append({"file": name, "tokens": n, "sha256": _sha256_file(os.path.join(folder, name))})
    return shards


# ----------------------------------------------------------------------------- manifest

def load_manifest(data_dir: str) -> dict:
    """Read data_dir/manifest.json, with a clear UserError when it is missing or not ours."""
    path = os.path.join(data_dir, MANIFEST)
    if not os.path.isfile(path):
        raise UserError(f"no prepared data in {data_dir!r} (no {MANIFEST}); run `slipstream data prepare` with --out {data_dir}")
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable or corrupt ({e}); delete {data_dir!r} and run `slipstream data prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a slipstream data manifest; point at a folder made by `slipstream data prepare`")
    if manifest.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{data_dir!r} has data format version {manifest.get('version')}, this slipstream reads version "
            f"{FORMAT_VERSION}; run `slipstream data prepare` again"
        )
    return manifest


def verify_manifest(data_dir: str, checksums: bool = False) -> dict:
    """Check every shard exists with the recorded size (fast) and optionally its sha256 (reads all data)."""
    manifest = load_manifest(data_dir)
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            path = os.path.join(data_dir, shard["file"])
            hint = f"the data in {data_dir!r} is damaged; run `slipstream data prepare` again"
            if not os.path.isfile(path):
                raise UserError(f"{split} shard {path} is missing; {hint}")
            size = os.path.getsize(path)
            if size != shard["tokens"] * itemsize:
                raise UserError(f"{split} shard {path} has {size} bytes, expected {shard['tokens'] * itemsize}; {hint}")
            if checksums and _sha256_file(path) != shard["sha256"]:
                raise UserError(f"{split} shard {path} fails its sha256 checksum; {hint}")
    return manifest


def _existing_manifest(out_dir: str) -> dict | None:
    """The manifest already in out_dir, None if there is nothing there; refuses foreign folders."""
    if not os.path.exists(out_dir):
        return None
    if not os.path.isdir(out_dir):
        raise UserError(f"output path {out_dir!r} is a file; choose a folder path for --out")
    if not os.path.exists(os.path.join(out_dir, MANIFEST)):
        if os.listdir(out_dir):
            raise UserError(
                f"output folder {out_dir!r} is not empty and is not a slipstream data folder (no {MANIFEST}); "
                f"refusing to overwrite it: choose a new or empty --out folder"
            )
        return None
    try:
        return load_manifest(out_dir)
    except UserError:
        raise UserError(
            f"output folder {out_dir!r} has a {MANIFEST} that is not a valid slipstream manifest; "
            f"refusing to overwrite it: delete the folder or choose another --out"
        ) from None


def _swap_into_place(tmp_dir: str, out_dir: str) -> None:
    if not os.path.exists(out_dir):
        os.rename(tmp_dir, out_dir)
        return
    # A non-empty folder cannot be renamed over; move the old one aside first. Between
    # the two renames out_dir is absent, never half-written.
    parent, name = os.path.split(os.path.abspath(out_dir))
    old = os.path.join(parent, f".{name}.old-{uuid.uuid4().hex[:8]}")
    os.rename(out_dir, old)
    try:
        os.rename(tmp_dir, out_dir)
    except BaseException:
        os.rename(old, out_dir)  # put the previous data back rather than leave nothing
        raise
    shutil.rmtree(old, ignore_errors=True)


# ----------------------------------------------------------------------------- prepare

def prepare_dataset(
    inputs: list[str],
    tokenizer: str,
    out_dir: str,
    text_field: str = "text",
    val_fraction: float = 0.01,
    shard_tokens: int = 2**24,
    num_workers: int | None = None,
    progress: bool = True,
) -> dict:
    """Tokenize inputs into out_dir (see module doc) and return the manifest.

    progress=False also silences the "cached" / summary messages.
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"val_fraction={val_fraction} must be in [0, 1), e.g. 0.01 for 1% validation data")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"shard_tokens={shard_tokens} must be a positive integer (default 2**24)")
    if num_workers is not None and num_workers < 1:
        raise UserError(f"num_workers={num_workers} must be >= 1 (or None for one per CPU core)")
    num_workers = num_workers or _cpu_count()

    from rich.console import Console

    console = Console(quiet=not progress)
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    fingerprint = fingerprint_inputs(inputs)
    settings = {"text_field": text_field, "val_fraction": val_fraction, "shard_tokens": shard_tokens}

    existing = _existing_manifest(out_dir)
    if existing is not None and _same_build(existing, fingerprint, tok, settings, out_dir):
        console.print(
            f"[data] {out_dir}: cached, inputs and tokenizer unchanged ({existing['splits']['train']['tokens']:,} train tokens)",
            markup=False,
            highlight=False,
            soft_wrap=True,
        )
        return existing

    parent, name = os.path.split(os.path.abspath(out_dir))
    try:
        os.makedirs(parent, exist_ok=True)
        tmp_dir = tempfile.mkdtemp(dir=parent, prefix=f".{name}.tmp-")
    except OSError as e:
        raise UserError(f"cannot write the output folder {out_dir!r} ({e.strerror}); choose a writable --out") from None
    try:
        manifest = _build(inputs, tok, dtype, tmp_dir, text_field, val_fraction, shard_tokens, num_workers, fingerprint, settings, progress)
        _swap_into_place(tmp_dir, out_dir)
    except BaseException:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        raise
    s = manifest["splits"]
    console.print(
        f"[data] wrote {out_dir}: {s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens "
        f"({manifest['dtype']}, {manifest['documents']:,} documents, {manifest['replaced_chars']:,} replaced chars) "
        f"in {manifest['seconds']:.1f}s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return manifest


def _copy_tokenizer_file(tok: Tokenizer, folder: str) -> str | None:
    """A bpe tokenizer travels inside the data folder, so training and the checkpoints it
    writes never depend on the original file staying where it was."""
    if not tok.spec.startswith("bpe:"):
        return None
    shutil.copyfile(tok.spec[len("bpe:"):], os.path.join(folder, TOKENIZER_FILE))
    return TOKENIZER_FILE


def tokenizer_spec_for(data_dir: str, manifest: dict) -> str:
    """The tokenizer spec to use with prepared data: its own copy of a bpe file if it has one."""
    if manifest.get("tokenizer_file"):
        return f"bpe:{os.path.join(os.path.abspath(data_dir), manifest['tokenizer_file'])}"
    return manifest["tokenizer"]


def _same_build(manifest: dict, fingerprint: dict, tok: Tokenizer, settings: dict, out_dir: str) -> bool:
    same = (
        manifest.get("inputs", {}).get("sha256") == fingerprint["sha256"]
        and manifest.get("tokenizer") == tok.spec
        and manifest.get("tokenizer_fingerprint") == tok.fingerprint
        and manifest.get("settings") == settings
    )
    if not same:
        return False
    try:
        verify_manifest(out_dir)  # sizes only: cheap, catches deleted or truncated shards
    except UserError:
        return False
    return True


def _build(inputs, tok, dtype, folder, text_field, val_fraction, shard_tokens, num_workers, fingerprint, settings, progress) -> dict:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    t0 = time.time()
    stats = SourceStats()
    chunks = _chunks(iter_documents(inputs, text_field=text_field, stats=stats), CHUNK_CHARS)
    # A corpus that fits in one chunk is faster to encode here than to ship to workers.
    head = list(itertools.islice(chunks, 2))
    chunks = itertools.chain(head, chunks)
    pool = _make_pool(num_workers, tok.spec, dtype) if num_workers > 1 and len(head) > 1 else None

    writer = _ShardWriter(folder, shard_tokens)
    doc_lengths = []
    columns = [TextColumn("[data] tokenizing", markup=False), BarColumn(), DownloadColumn(), TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[tokens]:,} tokens")]
    try:
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("tokenize", total=fingerprint["bytes"] or None, tokens=0)
            results = pool.imap(_encode_in_worker, chunks) if pool else (_encode_chunk(tok, dtype, c) for c in chunks)
            n_tokens = 0
            for tokens, lengths in results:
                writer.write(tokens)
                doc_lengths.append(lengths)
                n_tokens += len(tokens)
                bar.update(task, completed=stats.bytes, tokens=n_tokens)
    finally:
        writer.close()
        if pool is not None:
            pool.terminate()
            pool.join()

    doc_lengths = np.concatenate(doc_lengths)
    train_tokens, val_docs, split_by = _choose_split(doc_lengths, val_fraction)
    train_parts, val_parts = _cut_parts(writer.parts, train_tokens, dtype.itemsize)
    splits = {}
    for split, parts in (("train", train_parts), ("val", val_parts)):
        shards = _finalize_split(folder, split, parts)
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "shards": shards}
    n_docs = len(doc_lengths)
    splits["train"]["documents"] = n_docs - val_docs
    splits["val"]["documents"] = val_docs

    manifest = {
        "format": FORMAT,
        "version": FORMAT_VERSION,
        "tokenizer": tok.spec,
        "tokenizer_fingerprint": tok.fingerprint,
        "vocab_size": tok.vocab_size,
        "eot_id": tok.eot_id,
        "dtype": dtype.name,
        "splits": splits,
        "split_by": split_by,
        "documents": n_docs,
        "files": stats.files,
        "skipped_files": stats.skipped_files,
        "input_bytes": stats.bytes,
        "replaced_chars": stats.replaced_chars,
        "inputs": fingerprint,
        "settings": settings,
        "tokenizer_file": _copy_tokenizer_file(tok, folder),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - t0, 3),
    }
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        _fsync_close(f)
    return manifest
