"""Tokenizing records into flat token arrays (eot after each document, a loss mask for
fine-tuning pairs, ids checked against the vocabulary), and the pool of worker processes
that does it for prepare_units.py.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import sys

import numpy as np

from slipstream.data.tokenizers import ByteTokenizer, Tokenizer, get_tokenizer
from slipstream.errors import UserError

CHUNK_CHARS = 1 << 20  # text per encode call: big enough to amortise the call, small enough to bound memory


def cpu_count() -> int:
    # Respect CPU pinning (containers, SLURM) where the platform can tell us about it.
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return os.cpu_count() or 1


def _encode_texts(tok: Tokenizer, texts: list[str]) -> list:
    if isinstance(tok, ByteTokenizer):
        # Same ids as ByteTokenizer.encode, without a Python int per byte.
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8) for t in texts]
    return tok.encode_batch(texts)


def _check_ids(tok: Tokenizer, dtype: np.dtype, ids: np.ndarray) -> None:
    """Refuse ids a tokenizer should not emit, so none is ever wrapped into the token dtype."""
    if not len(ids):
        return
    low, high = int(ids.min()), int(ids.max())
    limit = min(tok.vocab_size, np.iinfo(dtype).max + 1)
    if low < 0 or high >= limit:
        bad = low if low < 0 else high
        raise UserError(f"tokenizer {tok.spec} emitted token id {bad}, outside its vocabulary of {tok.vocab_size} "
                        f"(ids 0..{limit - 1} fit the {dtype.name} token files); the tokenizer is inconsistent: "
                        f"fix or re-export it so its vocab_size exceeds every id it produces")


def encode_records(tok: Tokenizer, dtype: np.dtype, records: list) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Encode records into one flat token array, eot after each; return it, the per-record
    lengths and the loss mask (None when every record is plain text: mask 1 everywhere).

    A record is a text, or a fine-tuning pair (prompt, completion): tokens(prompt) +
    tokens(completion) + eot, with mask 0 on the prompt and 1 on the completion and eot."""
    texts, prompt_of = [], []
    for r in records:
        if isinstance(r, str):
            texts.append(r)
            prompt_of.append(-1)
        else:
            prompt_of.append(len(texts))
            texts.extend(r)
    encoded = _encode_texts(tok, texts)
    # Byte ids arrive as uint8 arrays and concatenate straight into the token dtype; lists
    # of ints become int64 first, so an id too big for the dtype is seen, not wrapped.
    encoded = [e if isinstance(e, np.ndarray) else np.asarray(e, dtype=np.int64) for e in encoded]
    pieces, lengths, prompt_lens = [], [], []
    eot = np.array([tok.eot_id], dtype=dtype if tok.eot_id <= np.iinfo(dtype).max else np.int64)
    i = 0
    for p in prompt_of:
        if p < 0:
            pieces += [encoded[i], eot]
            lengths.append(len(encoded[i]) + 1)
            prompt_lens.append(0)
            i += 1
        else:
            pieces += [encoded[i], encoded[i + 1], eot]
            lengths.append(len(encoded[i]) + len(encoded[i + 1]) + 1)
            prompt_lens.append(len(encoded[i]))
            i += 2
    flat = np.concatenate(pieces) if pieces else np.zeros(0, dtype)
    _check_ids(tok, dtype, flat)
    lengths = np.asarray(lengths, dtype=np.int64)
    mask = None
    if any(prompt_lens):
        mask = np.ones(len(flat), dtype=np.uint8)
        starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype(np.int64)
        for start, n in zip(starts.tolist(), prompt_lens):
            mask[start : start + n] = 0
    return flat.astype(dtype, copy=False), lengths, mask


# Each pool worker builds its own tokenizer from the spec: tokenizers hold Rust/C objects
# that do not pickle, and rebuilding from the spec works under fork and spawn alike.
_worker_tok: Tokenizer | None = None
_worker_dtype: np.dtype | None = None


def _init_worker(spec: str, dtype_str: str) -> None:
    global _worker_tok, _worker_dtype
    # Ctrl-C is handled once, by the parent (which terminates the pool), not by every worker.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _die_with_parent()
    _worker_tok = get_tokenizer(spec)
    _worker_dtype = np.dtype(dtype_str)


def _die_with_parent() -> None:
    """Linux: a worker whose parent is killed (kill -9) would otherwise wait on the task
    queue forever, and could still be writing part files when the prepare is run again."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() == 1:  # the parent died before the line above took effect
        os._exit(1)


def worker_tokenizer() -> tuple[Tokenizer, np.dtype]:
    """The tokenizer and dtype this pool worker was started with."""
    return _worker_tok, _worker_dtype


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


def fsync_close(f) -> None:
    # Data must be on disk before the folder is renamed into place, or a power loss could
    # leave a complete-looking manifest next to truncated shards.
    f.flush()
    os.fsync(f.fileno())
    f.close()
