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
  - atomic: everything is written into a hidden temp folder next to out_dir and moved into
    place only once complete, the manifest last; a crash leaves out_dir as it was.
  - only its own files: re-preparing a folder replaces exactly the files its old manifest
    lists (shards, tokenizer copy, manifest); any other file in it stays untouched, and an
    input inside the output folder is refused.
  - idempotent: if out_dir already holds a manifest for the same inputs (paths, sizes,
    mtimes), tokenizer and settings, and its shards have the recorded sizes and sha256s,
    nothing is redone. A damaged shard is not "cached": the folder is prepared again.
  - checked: each shard records its sha256 and its largest token id (max_id); manifest.py
    says what is checked when, and what that costs.
  - a non-empty folder without a slipstream manifest is never deleted.

Reading and checking a prepared folder is in manifest.py; tokenizing in worker processes
and writing the part files in encode.py. This module decides the split, names the shards,
writes the manifest and moves the result into place.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import shutil
import tempfile
import time
from datetime import datetime, timezone

import numpy as np

from slipstream.data.encode import (CHUNK_CHARS, ShardWriter, chunk_documents, cpu_count, encode_chunk,
                                   encode_in_worker, fsync_close, make_pool)
from slipstream.data.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, load_manifest, scan_file,
                                      shard_problem, token_dtype, wants_checksums)
# Also imported from here by callers (slipstream.data, data/ensure.py, `data verify`), which
# predate manifest.py: re-exported so `slipstream.data.prepare` keeps its public names.
from slipstream.data.manifest import AUTO_FULL_BYTES, data_bytes, tokenizer_spec_for, verify_data, verify_manifest  # noqa: F401
from slipstream.data.sources import STDLIB, SourceStats, fingerprint_inputs, iter_documents
from slipstream.data.tokenizers import Tokenizer, get_tokenizer
from slipstream.diskspace import disk_full_error, is_disk_full
from slipstream.errors import UserError

MIN_VAL_TOKENS = 4096  # enough for a few validation windows on small corpora


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
    return scan_file(path)[0]


def _max_token(path: str, dtype: np.dtype, tokens: int) -> int | None:
    return int(np.memmap(path, dtype=dtype, mode="r", shape=(tokens,)).max()) if tokens else None


def _finalize_split(folder: str, split: str, parts: list, dtype: np.dtype) -> list[dict]:
    shards = []
    for i, (path, n) in enumerate(parts):
        name = f"{split}_{i:06d}.bin"
        final = os.path.join(folder, name)
        os.rename(path, final)
        shards.append({"file": name, "tokens": n, "sha256": _sha256_file(final), "max_id": _max_token(final, dtype, n)})
    return shards


# ----------------------------------------------------------------------------- output folder

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


def _manifest_files(manifest: dict, out_dir: str) -> list[str]:
    """The files an (old) manifest says slipstream wrote into out_dir: its shards and its
    tokenizer copy. A name that is not a plain file name would reach outside the folder."""
    names = [shard.get("file") for info in manifest.get("splits", {}).values() for shard in info.get("shards", [])]
    if manifest.get("tokenizer_file"):
        names.append(manifest["tokenizer_file"])
    for name in names:
        if not isinstance(name, str) or os.path.basename(name) != name or name in ("", ".", "..", MANIFEST):
            raise UserError(f"{os.path.join(out_dir, MANIFEST)} lists {name!r}, which is not a file of that folder; "
                            f"refusing to replace its data: delete the folder or choose another --out")
    return names


def _swap_into_place(tmp_dir: str, out_dir: str, old_manifest: dict | None) -> None:
    """Move the new data from tmp_dir into out_dir. Only what the old manifest lists is
    replaced: anything else in the folder (the user's own files) stays where it is.

    Order: the old listed files move aside (into tmp_dir), the new shards move in, and the
    new manifest replaces the old one last: up to that rename the old manifest still
    describes the folder, and any failure before it puts the old files back."""
    if not os.path.exists(out_dir):
        os.rename(tmp_dir, out_dir)
        return
    old_files = set(_manifest_files(old_manifest or {}, out_dir))
    new_files = sorted(name for name in os.listdir(tmp_dir) if name != MANIFEST)
    clash = [name for name in new_files if os.path.lexists(os.path.join(out_dir, name)) and name not in old_files]
    if clash:
        raise UserError(f"output folder {out_dir!r} holds {', '.join(clash[:3])}, which its manifest does not list "
                        f"and the new data would overwrite; move those files or choose another --out")
    aside = os.path.join(tmp_dir, ".replaced")
    os.mkdir(aside)
    moved_aside, moved_in = [], []
    try:
        for name in sorted(old_files):
            path = os.path.join(out_dir, name)
            if os.path.lexists(path) and not os.path.isdir(path):  # a listed name that is a folder is not ours
                os.rename(path, os.path.join(aside, name))
                moved_aside.append(name)
        for name in new_files:
            os.rename(os.path.join(tmp_dir, name), os.path.join(out_dir, name))
            moved_in.append(name)
        os.replace(os.path.join(tmp_dir, MANIFEST), os.path.join(out_dir, MANIFEST))  # the commit point
    except BaseException:
        for name in moved_in:  # put the previous data back rather than leave a mix
            os.rename(os.path.join(out_dir, name), os.path.join(tmp_dir, name))
        for name in moved_aside:
            os.rename(os.path.join(aside, name), os.path.join(out_dir, name))
        raise
    shutil.rmtree(tmp_dir, ignore_errors=True)  # the old shards: files of our old manifest only


def _refuse_inputs_inside(inputs: list[str], out_dir: str) -> None:
    """An input inside the output folder would be read as corpus and then replaced by its own
    tokens (or deleted with the old data)."""
    out = os.path.realpath(out_dir)
    for path in inputs:
        if path == STDLIB:
            continue
        real = os.path.realpath(path)
        if real == out or os.path.commonpath([real, out]) == out:
            raise UserError(f"input {path!r} lies inside the output folder {out_dir!r}; move it out, or choose "
                            f"an --out folder that holds no inputs")


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
    verify: str = "full",
) -> dict:
    """Tokenize inputs into out_dir (see module doc) and return the manifest.

    progress=False also silences the "cached" / summary messages. verify: how the cache
    check reads existing shards (VERIFY_LEVELS; `data prepare` hashes them all).
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"val_fraction={val_fraction} must be in [0, 1), e.g. 0.01 for 1% validation data")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"shard_tokens={shard_tokens} must be a positive integer (default 2**24)")
    if num_workers is not None and num_workers < 1:
        raise UserError(f"num_workers={num_workers} must be >= 1 (or None for one per CPU core)")
    num_workers = num_workers or cpu_count()

    from rich.console import Console

    console = Console(quiet=not progress)
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    fingerprint = fingerprint_inputs(inputs)
    settings = {"text_field": text_field, "val_fraction": val_fraction, "shard_tokens": shard_tokens}

    _refuse_inputs_inside(inputs, out_dir)
    existing = _existing_manifest(out_dir)
    checksums = existing is not None and wants_checksums(verify, existing)
    if existing is not None and _same_build(existing, fingerprint, tok, settings, out_dir, checksums, console):
        console.print(
            f"[data] {out_dir}: cached, inputs and tokenizer unchanged, shards {'verified' if checksums else 'of the recorded sizes'} "
            f"({existing['splits']['train']['tokens']:,} train tokens)",
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
        _swap_into_place(tmp_dir, out_dir, existing)
    except BaseException as e:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        # At most one token per input byte (byte-level; subword tokenizers need fewer).
        needed = fingerprint["bytes"] * dtype.itemsize
        # numpy's tofile drops the errno ("N requested and M written"): then the free space tells.
        if is_disk_full(e, out_dir if isinstance(e, OSError) else None, needed):
            kept = (f"the partial output was removed and the data already in {out_dir!r} is unchanged"
                    if existing is not None else "the partial output was removed")
            raise disk_full_error("the token shards", out_dir, needed, kept) from None
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


def _same_build(manifest: dict, fingerprint: dict, tok: Tokenizer, settings: dict, out_dir: str,
                checksums: bool, console) -> bool:
    """Whether out_dir already holds this build, intact. A damaged shard means no: preparing
    again is the fix, and the folder is ours (its manifest says so)."""
    same = (
        manifest.get("inputs", {}).get("sha256") == fingerprint["sha256"]
        and manifest.get("tokenizer") == tok.spec
        and manifest.get("tokenizer_fingerprint") == tok.fingerprint
        and manifest.get("settings") == settings
    )
    if not same:
        return False
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            problem = shard_problem(out_dir, manifest, shard, checksums)
            if problem:
                console.print(f"[data] {out_dir}: {split} shard {shard['file']} {problem}; preparing it again",
                              markup=False, highlight=False, soft_wrap=True)
                return False
    return True


def _build(inputs, tok, dtype, folder, text_field, val_fraction, shard_tokens, num_workers, fingerprint, settings, progress) -> dict:
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

    t0 = time.time()
    stats = SourceStats()
    chunks = chunk_documents(iter_documents(inputs, text_field=text_field, stats=stats), CHUNK_CHARS)
    # A corpus that fits in one chunk is faster to encode here than to ship to workers.
    head = list(itertools.islice(chunks, 2))
    chunks = itertools.chain(head, chunks)
    pool = make_pool(num_workers, tok.spec, dtype) if num_workers > 1 and len(head) > 1 else None

    writer = ShardWriter(folder, shard_tokens)
    doc_lengths = []
    columns = [TextColumn("[data] tokenizing", markup=False), BarColumn(), DownloadColumn(), TimeElapsedColumn(), TimeRemainingColumn(), TextColumn("{task.fields[tokens]:,} tokens")]
    try:
        with Progress(*columns, disable=not progress) as bar:
            task = bar.add_task("tokenize", total=fingerprint["bytes"] or None, tokens=0)
            results = pool.imap(encode_in_worker, chunks) if pool else (encode_chunk(tok, dtype, c) for c in chunks)
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
        shards = _finalize_split(folder, split, parts, dtype)
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
        fsync_close(f)
    return manifest
