"""`data prepare` at scale: the work cut into units, a journal of finished ones, and the
assembly of their part files into the final shards.

A unit is a run of consecutive input pieces (formats.py: files, JSONL byte ranges, Parquet
row groups, Arrow record batches) of about UNIT_BYTES. Units are tokenized independently,
in any order, by the pool; each writes its part files into the work folder:

    unit_000123.tok   the tokens of its documents, eot after each (the shard dtype)
    unit_000123.len   int64 tokens per document
    unit_000123.mask  uint8 loss mask per token (only when a record of the unit has one)
    unit_000123.hash  16-byte blake2b of each document's text (only with dedup)

written under a .partial name and renamed when complete, then recorded in journal.jsonl
(one fsynced line per unit). A prepare that is interrupted and run again with the same
inputs and settings finds the same work folder (its name is a hash of them), keeps every
unit the journal lists whose files have the recorded sizes, and redoes the rest.

Assembly reads the part files in unit order, so the output never depends on the number of
workers or on interruptions: it drops duplicate documents (dedup), cuts train/val and
writes the shards, hashing as it writes (sha256, chunk sha256s, max id, mask sha256).
Memory: the parent keeps per-document lengths (8 bytes) and hashes (16 bytes) only.
"""

from __future__ import annotations

import hashlib
import json
import os
from typing import Iterator

import numpy as np

from slipstream.data.encode import CHUNK_CHARS, encode_records, fsync_close, worker_tokenizer
from slipstream.data.formats import TEXT, SourceStats, iter_piece

UNIT_BYTES = 64 << 20  # input bytes per unit: enough to amortize a task, small enough to balance 2..64 workers
COPY_TOKENS = 1 << 20  # tokens per read while assembling
JOURNAL = "journal.jsonl"
# Part of the work folder's name: bump it when what a unit holds for the same inputs changes
# (how inputs are planned into pieces, or read into records), so a prepare interrupted
# under older code is not resumed with its units. 2: datasets folders inside folders,
# bad UTF-8 in columns replaced, repeated inputs read again.
UNITS_VERSION = 2
HASH_BYTES = 16


def plan_units(pieces: list[tuple], unit_bytes: int = UNIT_BYTES) -> list[list[tuple]]:
    """Consecutive pieces grouped into units of about unit_bytes (a big piece is a unit alone)."""
    units, current, size = [], [], 0
    for piece in pieces:
        last = current[-1] if current else None
        if last is not None and last[:2] == piece[:2] and last[0] != TEXT and 0 < piece[2] == last[3]:
            # Adjacent ranges of one file read as one: the file is opened (its footer or
            # stream headers read) once per unit, not once per row group or batch. A piece
            # starting at 0 starts its file: the same input given again, read again.
            current[-1] = (last[0], last[1], last[2], piece[3], last[4] + piece[4])
        else:
            current.append(piece)
        size += piece[4]
        if size >= unit_bytes:
            units.append(current)
            current, size = [], 0
    if current:
        units.append(current)
    return units


def unit_path(work: str, index: int, ext: str) -> str:
    return os.path.join(work, f"unit_{index:06d}.{ext}")


def doc_hash(record) -> bytes:
    if isinstance(record, str):
        data = record.encode("utf-8")
    else:  # a fine-tuning pair: the NUL keeps ("ab", "c") apart from ("a", "bc") and from text "abc"
        data = b"\0sft\0" + record[0].encode("utf-8") + b"\0" + record[1].encode("utf-8")
    return hashlib.blake2b(data, digest_size=HASH_BYTES).digest()


class _UnitWriter:
    """The part files of one unit, under .partial names until commit()."""

    def __init__(self, work: str, index: int, dedup: bool) -> None:
        self.work, self.index, self.dedup = work, index, dedup
        self.tokens, self.documents, self.masked = 0, 0, False
        self.files = {ext: open(self._partial(ext), "wb") for ext in ("tok", "len") + (("hash",) if dedup else ())}

    def _partial(self, ext: str) -> str:
        # The pid keeps a worker orphaned by a killed run from writing into this run's files.
        return unit_path(self.work, self.index, ext) + f".partial-{os.getpid()}"

    def write(self, tokens: np.ndarray, lengths: np.ndarray, mask: np.ndarray | None, hashes: list[bytes]) -> None:
        if mask is not None and not self.masked:
            # The first masked record: the unit's earlier tokens were all targets.
            self.files["mask"] = open(self._partial("mask"), "wb")
            ones = np.ones(min(self.tokens, COPY_TOKENS), dtype=np.uint8)
            for start in range(0, self.tokens, COPY_TOKENS):
                ones[: min(COPY_TOKENS, self.tokens - start)].tofile(self.files["mask"])
            self.masked = True
        tokens.tofile(self.files["tok"])
        lengths.astype("<i8").tofile(self.files["len"])
        if self.masked:
            (mask if mask is not None else np.ones(len(tokens), dtype=np.uint8)).tofile(self.files["mask"])
        if self.dedup:
            self.files["hash"].write(b"".join(hashes))
        self.tokens += len(tokens)
        self.documents += len(lengths)

    def commit(self) -> None:
        for ext, f in self.files.items():
            fsync_close(f)
            os.replace(self._partial(ext), unit_path(self.work, self.index, ext))

    def abort(self) -> None:
        for ext, f in self.files.items():
            f.close()
            try:
                os.remove(self._partial(ext))
            except OSError:
                pass


def run_unit(tok, dtype: np.dtype, work: str, index: int, pieces: list[tuple], text_field: str, dedup: bool) -> dict:
    """Tokenize one unit into its part files; return its journal entry."""
    stats = SourceStats()
    writer = _UnitWriter(work, index, dedup)
    try:
        batch, chars = [], 0
        for record in _records(pieces, text_field, stats):
            batch.append(record)
            chars += len(record) if isinstance(record, str) else len(record[0]) + len(record[1])
            if chars >= CHUNK_CHARS:
                _flush(tok, dtype, writer, batch, dedup)
                batch, chars = [], 0
        if batch:
            _flush(tok, dtype, writer, batch, dedup)
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    stats.documents = writer.documents
    return {"unit": index, "tokens": writer.tokens, "documents": writer.documents, "mask": writer.masked,
            "bytes": sum(p[4] for p in pieces), "stats": vars(stats)}


def run_unit_in_worker(args: tuple) -> dict:
    tok, dtype = worker_tokenizer()
    return run_unit(tok, dtype, *args)


def _records(pieces: list[tuple], text_field: str, stats: SourceStats) -> Iterator:
    for piece in pieces:
        for record in iter_piece(piece, text_field, stats):
            if record if isinstance(record, str) else any(record):  # empty documents are skipped
                yield record


def _flush(tok, dtype, writer: _UnitWriter, batch: list, dedup: bool) -> None:
    tokens, lengths, mask = encode_records(tok, dtype, batch)
    writer.write(tokens, lengths, mask, [doc_hash(r) for r in batch] if dedup else [])


# ----------------------------------------------------------------------------- journal

def read_journal(work: str, n_units: int, itemsize: int, dedup: bool) -> dict[int, dict]:
    """The finished units whose part files are intact; a torn last line (kill -9) is ignored."""
    done = {}
    path = os.path.join(work, JOURNAL)
    if not os.path.exists(path):
        return done
    line = b"\n"
    with open(path, "rb") as f:
        for line in f:
            try:
                entry = json.loads(line)
                index = entry["unit"]
            except (ValueError, KeyError, TypeError):
                continue
            if isinstance(index, int) and 0 <= index < n_units and _intact(work, entry, itemsize, dedup):
                done[index] = entry
    if not line.endswith(b"\n"):
        # A line torn by a kill: end it, or the next entry appended would join it and be lost.
        with open(path, "ab") as f:
            f.write(b"\n")
            fsync_close(f)
    return done


def _intact(work: str, entry: dict, itemsize: int, dedup: bool) -> bool:
    if not all(isinstance(entry.get(k), int) and entry[k] >= 0 for k in ("tokens", "documents", "bytes")):
        return False
    want = {"tok": entry["tokens"] * itemsize, "len": entry["documents"] * 8}
    if entry.get("mask"):
        want["mask"] = entry["tokens"]
    if dedup:
        want["hash"] = entry["documents"] * HASH_BYTES
    for ext, size in want.items():
        path = unit_path(work, entry["unit"], ext)
        if not os.path.isfile(path) or os.path.getsize(path) != size:
            return False
    return True


def append_journal(work: str, entry: dict) -> None:
    with open(os.path.join(work, JOURNAL), "a") as f:
        f.write(json.dumps(entry, sort_keys=True) + "\n")
        fsync_close(f)


# ----------------------------------------------------------------------------- assembly

def keep_masks(work: str, entries: list[dict], dedup: bool) -> tuple[list[np.ndarray], list[np.ndarray], int]:
    """Per unit: document lengths and which documents to keep (first occurrence in input
    order wins); and how many duplicates were dropped."""
    lengths = [np.fromfile(unit_path(work, e["unit"], "len"), dtype="<i8") for e in entries]
    if not dedup:
        return lengths, [np.ones(len(n), dtype=bool) for n in lengths], 0
    hashes = np.concatenate([np.fromfile(unit_path(work, e["unit"], "hash"), dtype=f"V{HASH_BYTES}") for e in entries])
    keep = np.zeros(len(hashes), dtype=bool)
    keep[np.unique(hashes, return_index=True)[1]] = True  # np.unique's index is the first occurrence
    del hashes
    splits = np.cumsum([len(n) for n in lengths])[:-1]
    return lengths, np.split(keep, splits), int((~keep).sum())


class ShardAssembler:
    """Writes the final shards of one folder from a stream of (tokens, mask) pieces: train
    until train_tokens, then val; shard_tokens per shard; hashing as it writes."""

    def __init__(self, folder: str, dtype: np.dtype, shard_tokens: int, chunk_tokens: int, train_tokens: int,
                 with_mask: bool) -> None:
        self.folder, self.dtype, self.shard_tokens, self.chunk_tokens = folder, dtype, shard_tokens, chunk_tokens
        self.train_tokens, self.with_mask = train_tokens, with_mask
        self.written = 0  # tokens so far, all splits
        self.shards: dict[str, list[dict]] = {"train": [], "val": []}
        self._open = None

    def write(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        while len(tokens):
            split = "train" if self.written < self.train_tokens else "val"
            if self._open is None or self._open["split"] != split or self._open["tokens"] == self.shard_tokens:
                self._next(split)
            room = self.shard_tokens - self._open["tokens"]
            if split == "train":
                room = min(room, self.train_tokens - self.written)
            self._put(tokens[:room], None if mask is None else mask[:room])
            tokens = tokens[room:]
            mask = None if mask is None else mask[room:]

    def _next(self, split: str) -> None:
        self.close()
        name = f"{split}_{len(self.shards[split]):06d}"
        shard = {"split": split, "name": name, "tokens": 0, "max_id": None, "sha": hashlib.sha256(),
                 "chunk": hashlib.sha256(), "chunk_fill": 0, "chunks": [],
                 "f": open(os.path.join(self.folder, name + ".bin"), "wb")}
        if self.with_mask:
            shard["mf"], shard["msha"] = open(os.path.join(self.folder, name + ".mask"), "wb"), hashlib.sha256()
            shard["mask_chunk"], shard["mask_chunks"] = hashlib.sha256(), []
        self._open = shard

    def _put(self, tokens: np.ndarray, mask: np.ndarray | None) -> None:
        s = self._open
        tokens = np.ascontiguousarray(tokens, dtype=self.dtype)
        data = tokens.tobytes()
        s["f"].write(data)
        s["sha"].update(data)
        top = int(tokens.max())
        s["max_id"] = top if s["max_id"] is None else max(s["max_id"], top)
        m = b""
        if self.with_mask:
            m = (mask if mask is not None else np.ones(len(tokens), dtype=np.uint8)).astype(np.uint8).tobytes()
            s["mf"].write(m)
            s["msha"].update(m)
        pos, size = 0, self.dtype.itemsize
        while pos < len(tokens):  # the chunk checksums streaming readers verify (chunk_tokens each)
            take = min(self.chunk_tokens - s["chunk_fill"], len(tokens) - pos)
            s["chunk"].update(data[pos * size : (pos + take) * size])
            if self.with_mask:  # a streamed chunk's mask bytes are checked on their own too
                s["mask_chunk"].update(m[pos : pos + take])
            s["chunk_fill"] += take
            pos += take
            if s["chunk_fill"] == self.chunk_tokens:
                self._end_chunk(s)
        s["tokens"] += len(tokens)
        self.written += len(tokens)

    def _end_chunk(self, s: dict) -> None:
        s["chunks"].append(s["chunk"].hexdigest())
        s["chunk"], s["chunk_fill"] = hashlib.sha256(), 0
        if self.with_mask:
            s["mask_chunks"].append(s["mask_chunk"].hexdigest())
            s["mask_chunk"] = hashlib.sha256()

    def close(self) -> None:
        s, self._open = self._open, None
        if s is None:
            return
        fsync_close(s["f"])
        if s["chunk_fill"]:
            self._end_chunk(s)
        entry = {"file": s["name"] + ".bin", "tokens": s["tokens"], "sha256": s["sha"].hexdigest(),
                 "max_id": s["max_id"], "chunk_sha256": s["chunks"]}
        if self.with_mask:
            fsync_close(s["mf"])
            entry["mask_file"], entry["mask_sha256"] = s["name"] + ".mask", s["msha"].hexdigest()
            entry["mask_chunk_sha256"] = s["mask_chunks"]
        self.shards[s["split"]].append(entry)


def assemble_unit(asm: ShardAssembler, work: str, entry: dict, lengths: np.ndarray, keep: np.ndarray,
                  itemsize: int, dtype: np.dtype) -> None:
    """Copy one unit's kept documents into the assembler, a bounded block at a time."""
    ends = np.cumsum(lengths)
    starts = ends - lengths
    # Runs of consecutive kept documents, as token ranges: one read per run, not per document.
    flips = np.flatnonzero(np.diff(np.concatenate([[False], keep, [False]]).astype(np.int8)))
    runs = [(int(starts[a]), int(ends[b - 1])) for a, b in zip(flips[::2], flips[1::2])]
    mask_path = unit_path(work, entry["unit"], "mask") if entry.get("mask") else None
    with open(unit_path(work, entry["unit"], "tok"), "rb") as tf, (open(mask_path, "rb") if mask_path else _Null()) as mf:
        for a, b in runs:
            tf.seek(a * itemsize)
            if mask_path:
                mf.seek(a)
            for lo in range(a, b, COPY_TOKENS):
                n = min(COPY_TOKENS, b - lo)
                tokens = np.frombuffer(tf.read(n * itemsize), dtype=dtype)
                mask = np.frombuffer(mf.read(n), dtype=np.uint8) if mask_path else None
                if len(tokens) != n or (mask is not None and len(mask) != n):
                    raise OSError(f"{unit_path(work, entry['unit'], 'tok')}: shorter than its journal entry")
                asm.write(tokens, mask)


class _Null:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
