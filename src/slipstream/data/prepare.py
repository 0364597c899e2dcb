"""Tokenize a corpus once into flat binary shards that training can memory-map.

Output folder layout (all token arrays are raw little-endian uint16/uint32, no header):

    out_dir/
      train_000000.bin  train_000001.bin ...
      val_000000.bin ...
      train_000000.mask ...  only with fine-tuning records: uint8 per token, 1 = a training target
      manifest.json      format, tokenizer, dtype, shards with token counts + sha256, stats

Manifest fields beyond the shard list: "dtype" (uint16 when the vocabulary fits, else
uint32), "chunk_tokens" and per shard "chunk_sha256" (sha256 of tokens [i*C, (i+1)*C), for
streaming readers), "loss_mask" and per shard "mask_file" / "mask_sha256", "dedup" and
"dropped_duplicates".

Every document is followed by the tokenizer's eot token, so a split is one long token
stream. The validation split is the tail of the corpus: the last `val_fraction` of the
documents (at least one, and grown up to MIN_VAL_TOKENS tokens while val stays at most
half the corpus). A corpus of a single document (one big text file) is split by tokens
instead, so e.g. a lone novel still gets a validation set.

Safety:
  - atomic: everything is written into a hidden work folder next to out_dir and moved into
    place only once complete, the manifest last; a crash leaves out_dir as it was.
  - resumable: the work folder is named by a hash of (out_dir, inputs, tokenizer, settings)
    and keeps the part files of every finished unit (prepare_units.py): a run interrupted
    by Ctrl-C or kill -9, or stopped by a store it could not reach (network, credentials),
    and started again redoes only the unfinished units.
  - only its own files: re-preparing a folder replaces exactly the files its old manifest
    lists (shards, tokenizer copy, manifest); any other file in it stays untouched, and an
    input inside the output folder is refused.
  - idempotent: if out_dir already holds a manifest for the same inputs (paths, sizes,
    mtimes), tokenizer and settings, and its shards have the recorded sizes and sha256s,
    nothing is redone. A damaged shard is not "cached": the folder is prepared again.
  - checked: each shard records its sha256 and its largest token id (max_id); manifest.py
    says what is checked when, and what that costs.
  - a non-empty folder without a slipstream manifest is never deleted.

Reading and checking a prepared folder is in manifest.py; the readers of each input format
in formats.py; units, the journal and assembling shards in prepare_units.py; tokenizing
in encode.py. This module plans the work, decides the split, writes the manifest and moves
the result into place.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import shutil
import time
from datetime import datetime, timezone

import numpy as np

from slipstream.data import locations as loc
from slipstream.data import prepare_units as units_mod
from slipstream.data.encode import CHUNK_CHARS, cpu_count, fsync_close, make_pool  # noqa: F401 (CHUNK_CHARS: older tests set it)
from slipstream.data.manifest import (FORMAT, FORMAT_VERSION, MANIFEST, TOKENIZER_FILE, load_manifest,
                                      shard_problem, token_dtype, wants_checksums)
# Also imported from here by callers (slipstream.data, data/ensure.py, `data verify`), which
# predate manifest.py: re-exported so `slipstream.data.prepare` keeps its public names.
from slipstream.data.manifest import AUTO_FULL_BYTES, data_bytes, tokenizer_spec_for, verify_data, verify_manifest  # noqa: F401
from slipstream.data.sources import STDLIB, SourceStats, empty_corpus, fingerprint_inputs, plan
from slipstream.data.tokenizers import Tokenizer, get_tokenizer
from slipstream.diskspace import disk_full_error, is_disk_full
from slipstream.errors import UserError

MIN_VAL_TOKENS = 4096  # enough for a few validation windows on small corpora
# Units of about input_bytes / TARGET_UNITS, within these bounds: a small corpus still
# spreads over the workers, a big one is never held up by one huge unit.
TARGET_UNITS = 64
MIN_UNIT_BYTES = 1024


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
    shards = [shard for info in manifest.get("splits", {}).values() for shard in info.get("shards", [])]
    names = [shard.get("file") for shard in shards] + [shard["mask_file"] for shard in shards if shard.get("mask_file")]
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
    tokens (or deleted with the old data); an output folder inside an input folder would be
    read as corpus by the next prepare (its manifest.json as a document)."""
    out = os.path.realpath(out_dir)
    for path in inputs:
        if path == STDLIB or loc.is_url(path):
            continue
        real = os.path.realpath(path)
        if real == out or os.path.commonpath([real, out]) == out:
            raise UserError(f"input {path!r} lies inside the output folder {out_dir!r}; move it out, or choose "
                            f"an --out folder that holds no inputs")
        if os.path.isdir(real) and os.path.commonpath([real, out]) == real:
            raise UserError(f"output folder {out_dir!r} lies inside the input folder {path!r}, so a later prepare "
                            f"would read the prepared data as text; choose an --out folder outside the inputs "
                            f"(`slipstream train` prepares into ./data/: keep data.inputs out of it)")


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
    dedup: bool = False,
    chunk_tokens: int = 2**20,
) -> dict:
    """Tokenize inputs into out_dir (see module doc) and return the manifest.

    progress=False also silences the "cached" / summary messages. verify: how the cache
    check reads existing shards (VERIFY_LEVELS; `data prepare` hashes them all). dedup:
    drop exact duplicate documents (the first occurrence wins). chunk_tokens: tokens per
    chunk checksum (chunk_sha256) for streaming readers.
    """
    if not 0 <= val_fraction < 1:
        raise UserError(f"val_fraction={val_fraction} must be in [0, 1), e.g. 0.01 for 1% validation data")
    if not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise UserError(f"shard_tokens={shard_tokens} must be a positive integer (default 2**24)")
    if not isinstance(chunk_tokens, int) or isinstance(chunk_tokens, bool) or chunk_tokens < 1:
        raise UserError(f"chunk_tokens={chunk_tokens} must be a positive integer (default 2**20)")
    if num_workers is not None and num_workers < 1:
        raise UserError(f"num_workers={num_workers} must be >= 1 (or None for one per CPU core)")
    num_workers = num_workers or cpu_count()

    from rich.console import Console

    console = Console(quiet=not progress)
    tok = get_tokenizer(tokenizer)
    dtype = token_dtype(tok.vocab_size)
    fingerprint = fingerprint_inputs(inputs)
    settings = {"text_field": text_field, "val_fraction": val_fraction, "shard_tokens": shard_tokens,
                "dedup": bool(dedup), "chunk_tokens": chunk_tokens}

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

    unit_bytes = min(units_mod.UNIT_BYTES, max(MIN_UNIT_BYTES, fingerprint["bytes"] // TARGET_UNITS))
    work = _work_dir(out_dir, fingerprint, tok, dtype, settings, unit_bytes)
    lock = _lock(work, out_dir)
    try:
        manifest = _build(inputs, tok, dtype, work, out_dir, settings, unit_bytes, num_workers, fingerprint, progress, console)
        _swap_into_place(os.path.join(work, "out"), out_dir, existing)
        # Still under the lock: a prepare of the same data started now must not find this
        # folder's finished journal while its unit files are being deleted.
        shutil.rmtree(work, ignore_errors=True)
    except KeyboardInterrupt:
        # Finished units stay in the work folder: the next run with the same inputs resumes.
        console.print(f"[data] interrupted: finished units kept in {work}; run the same command again to resume",
                      markup=False, highlight=False, soft_wrap=True)
        raise
    except BaseException as e:
        if getattr(e, "transient", False):
            # The store could not be reached (network, credentials): the inputs did not
            # change, so the same command, run again once that is fixed, resumes here.
            kept = len(units_mod.read_journal(work, 1 << 62, dtype.itemsize, settings["dedup"]))
            if kept:
                raise UserError(f"{e} (the {kept} finished units are kept in {work}: run the same command again "
                                f"to resume)") from None
        shutil.rmtree(work, ignore_errors=True)
        # At most one token per input byte (byte-level; subword tokenizers need fewer).
        needed = fingerprint["bytes"] * dtype.itemsize
        # numpy's tofile drops the errno ("N requested and M written"): then the free space tells.
        if is_disk_full(e, out_dir if isinstance(e, OSError) else None, needed):
            kept = (f"the partial output was removed and the data already in {out_dir!r} is unchanged"
                    if existing is not None else "the partial output was removed")
            raise disk_full_error("the token shards", out_dir, needed, kept) from None
        raise
    finally:
        lock.close()
    _remove_stale_work(out_dir)
    s = manifest["splits"]
    dropped = f", {manifest['dropped_duplicates']:,} duplicates dropped" if dedup else ""
    console.print(
        f"[data] wrote {out_dir}: {s['train']['tokens']:,} train + {s['val']['tokens']:,} val tokens "
        f"({manifest['dtype']}, {manifest['documents']:,} documents{dropped}, {manifest['replaced_chars']:,} replaced chars) "
        f"in {manifest['seconds']:.1f}s",
        markup=False,
        highlight=False,
        soft_wrap=True,
    )
    return manifest


def _work_dir(out_dir: str, fingerprint: dict, tok: Tokenizer, dtype: np.dtype, settings: dict, unit_bytes: int) -> str:
    """The work folder next to out_dir, named by what decides the units' contents, so a rerun
    of the same prepare finds the units an interrupted one finished."""
    key = json.dumps([os.path.abspath(out_dir), fingerprint["sha256"], tok.spec, tok.fingerprint, dtype.name,
                      settings["text_field"], settings["dedup"], unit_bytes, FORMAT_VERSION, units_mod.UNITS_VERSION])
    parent, name = _work_parent(out_dir)
    work = os.path.join(parent, f".{name}.prepare-{hashlib.sha256(key.encode()).hexdigest()[:16]}")
    try:
        os.makedirs(work, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot write the output folder {out_dir!r} ({e.strerror}); choose a writable --out") from None
    return work


def _work_parent(out_dir: str) -> tuple[str, str]:
    """(folder, name) where out_dir's data really lives: its work folder goes next to that,
    so the finished files are renamed into place on one filesystem even when out_dir is a
    symlink to another."""
    return os.path.split(os.path.realpath(out_dir))


def _remove_stale_work(out_dir: str) -> None:
    """Work folders of earlier interrupted prepares of out_dir with other inputs or settings:
    out_dir now holds newer data, so their units would only take disk space. One that is
    locked belongs to a prepare still running and stays."""
    import re

    parent, name = _work_parent(out_dir)
    ours = re.compile(re.escape(f".{name}.prepare-") + "[0-9a-f]{16}")  # exactly what _work_dir names
    for entry in os.listdir(parent):
        path = os.path.join(parent, entry)
        if not ours.fullmatch(entry) or not os.path.isdir(path) or os.path.islink(path):
            continue
        try:
            lock = _lock(path, out_dir)
        except (UserError, OSError):
            continue
        shutil.rmtree(path, ignore_errors=True)
        lock.close()


def _lock(work: str, out_dir: str):
    """An exclusive lock on the work folder: two prepares of the same data must not share it.
    A POSIX record lock (lockf), not flock: the pool's forked workers do not inherit it, so
    it dies with the process that took it."""
    import fcntl

    f = open(os.path.join(work, ".lock"), "w")
    try:
        fcntl.lockf(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        f.close()
        raise UserError(f"another `slipstream data prepare` is writing {out_dir!r} right now (it holds {work}); "
                        f"wait for it to finish or stop it") from None
    return f


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


def _build(inputs, tok, dtype, work, out_dir, settings, unit_bytes, num_workers, fingerprint, progress, console) -> dict:
    t0 = time.time()
    text_field, dedup = settings["text_field"], settings["dedup"]
    units = units_mod.plan_units(plan(inputs, text_field, unit_bytes), unit_bytes)
    done = units_mod.read_journal(work, len(units), dtype.itemsize, dedup)
    for name in os.listdir(work):  # part files of units that never finished are redone from scratch
        if name.startswith("unit_") and (".partial" in name or not name[5:11].isdigit() or int(name[5:11]) not in done):
            os.remove(os.path.join(work, name))
    if done:
        console.print(f"[data] resuming {out_dir}: kept {len(done)} of {len(units)} units finished by an interrupted "
                      f"run, redoing {len(units) - len(done)}", markup=False, highlight=False, soft_wrap=True)
    _tokenize_units(units, done, tok, dtype, work, text_field, dedup, num_workers, progress)

    entries = [done[i] for i in range(len(units))]
    stats = SourceStats()
    for entry in entries:
        stats.add(entry["stats"])
    if stats.documents == 0:
        raise empty_corpus(inputs, text_field)
    lengths, keeps, dropped = units_mod.keep_masks(work, entries, dedup)
    kept = np.concatenate([n[k] for n, k in zip(lengths, keeps)])
    train_tokens, val_docs, split_by = _choose_split(kept, settings["val_fraction"])

    folder = os.path.join(work, "out")
    shutil.rmtree(folder, ignore_errors=True)  # what an interrupted assembly left
    os.mkdir(folder)
    with_mask = any(e["mask"] for e in entries)
    asm = units_mod.ShardAssembler(folder, dtype, settings["shard_tokens"], settings["chunk_tokens"], train_tokens, with_mask)
    try:
        for entry, n, k in zip(entries, lengths, keeps):
            units_mod.assemble_unit(asm, work, entry, n, k, dtype.itemsize, dtype)
    finally:
        asm.close()
    splits = {}
    for split in ("train", "val"):
        shards = asm.shards[split]
        splits[split] = {"tokens": sum(s["tokens"] for s in shards), "shards": shards}
    n_docs = len(kept)
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
        "dedup": dedup,
        "dropped_duplicates": dropped,
        "chunk_tokens": settings["chunk_tokens"],
        "loss_mask": with_mask,
        "units": len(units),
        "inputs": fingerprint,
        "settings": settings,
        "tokenizer_file": _copy_tokenizer_file(tok, folder),
        "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "seconds": round(time.time() - t0, 3),
    }
    _write_manifest(folder, manifest)
    return manifest


def _write_manifest(folder: str, manifest: dict) -> None:
    with open(os.path.join(folder, MANIFEST), "w") as f:
        json.dump(manifest, f, indent=2)
        f.write("\n")
        fsync_close(f)


def _tokenize_units(units, done, tok, dtype, work, text_field, dedup, num_workers, progress) -> None:
    """Run the units not yet done (in parallel when there are workers and several units),
    journaling each as it finishes; progress in input bytes, MB/s, ETA and tokens."""
    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    todo = [i for i in range(len(units)) if i not in done]
    pool = make_pool(num_workers, tok.spec, dtype) if num_workers > 1 and len(todo) > 1 else None
    columns = [TextColumn("[data] tokenizing", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
               TimeRemainingColumn(), TextColumn("{task.fields[tokens]:,} tokens")]
    try:
        with Progress(*columns, disable=not progress) as bar:
            total = sum(p[4] for u in units for p in u)
            task = bar.add_task("tokenize", total=total or None, tokens=sum(e["tokens"] for e in done.values()))
            # Kept units count as read: the speed and ETA are those of the work left.
            bar.update(task, completed=sum(e["bytes"] for e in done.values()))
            args = [(work, i, units[i], text_field, dedup) for i in todo]
            if pool is not None:
                results = pool.imap_unordered(units_mod.run_unit_in_worker, args)
            else:
                results = (units_mod.run_unit(tok, dtype, *a) for a in args)
            for entry in results:
                units_mod.append_journal(work, entry)
                done[entry["unit"]] = entry
                bar.update(task, advance=entry["bytes"], tokens=bar.tasks[0].fields["tokens"] + entry["tokens"])
    finally:
        if pool is not None:
            pool.terminate()
            pool.join()
