"""Tokenizing a corpus into part files: documents go in chunks to a pool of worker
processes (or are encoded in this one), and the tokens are appended to numbered part files
of at most shard_tokens tokens each.

prepare.py drives it and owns the rest: where validation starts, cutting the parts into
the named train/val shards, and the manifest.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
from typing import Iterable, Iterator

import numpy as np

from slipstream.data.tokenizers import Tokenizer, get_tokenizer

CHUNK_CHARS = 1 << 20  # text per worker task: big enough to amortise IPC, small enough to balance


def cpu_count() -> int:
    # Respect CPU pinning (containers, SLURM) where the platform can tell us about it.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def encode_chunk(tok: Tokenizer, dtype: np.dtype, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
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


def encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    return encode_chunk(_worker_tok, _worker_dtype, texts)


def chunk_documents(docs: Iterable[str], chunk_chars: int) -> Iterator[list[str]]:
    chunk, size = [], 0
    for doc in docs:
        chunk.append(doc)
        size += len(doc)
        if size >= chunk_chars:
            yield chunk
            chunk, size = [], 0
    if chunk:
        yield chunk


def make_pool(num_workers: int, spec: str, dtype: np.dtype):
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


class ShardWriter:
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
            fsync_close(self._f)
            self._f = None


def fsync_close(f) -> None:
    # Data must be on disk before the folder is renamed into place, or a power loss could
    # leave a complete-looking manifest next to truncated shards.
    f.flush()
    os.fsync(f.fileno())
    f.close()
