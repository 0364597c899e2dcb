"""Raw text sources: turn user inputs (files, folders, URLs, the Python stdlib) into documents.

Every input kind ends up as a stream of records in a deterministic order: a document's
text, or a fine-tuning pair (prompt, completion). One plain-text file is one document;
one JSONL line or one Parquet/Arrow row is one record. Files are read as bytes and decoded
as UTF-8 with errors="replace", so a stray Latin-1 byte never aborts a long prepare run;
the number of replaced characters is counted in `SourceStats` so the user can see it.

Inputs (formats.py reads each kind; locations.py reaches local paths and URLs alike):
  - a text file                -> one document
  - a `.jsonl` file            -> one record per non-blank line, from `text_field` (or the
                                  string fields `prompt` and `completion`); `.jsonl.gz` and
                                  `.jsonl.zst` are decompressed as a stream
  - a `.parquet` / `.arrow` file -> one record per row, from the `text_field` column
  - a `datasets` folder        -> its .arrow files (save_to_disk; a DatasetDict: its train split)
  - a folder                   -> every regular file below it, sorted by relative path,
                                  skipping hidden files/folders and binaries (a NUL byte in
                                  the first 8 KiB); the formats above are read as such
  - an fsspec URL (`://`)      -> a file or a folder (prefix) as above: file://, memory://,
                                  s3://, gs://, hf://, with credentials from the environment;
                                  a glob URL (s3://b/data/*.parquet) the files it matches
  - the word `stdlib`          -> the running interpreter's standard library `.py` files
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from typing import Iterator

from slipstream.data import locations as loc
from slipstream.data.formats import SourceStats, expand_input, iter_piece, plan_pieces  # noqa: F401 (SourceStats: public here)
from slipstream.errors import UserError

STDLIB = "stdlib"

# Folders of the stdlib we skip: third-party packages are not the stdlib, and the test
# suites are huge and full of deliberately weird data (bad encodings, generated files).
# idlelib and lib2to3 are kept: they are ordinary, real Python code. What remains is
# ~12 MB of source in ~700 files on CPython 3.11.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def stdlib_files() -> list[str]:
    return loc.walk_files(stdlib_dir(), skip_dirs=STDLIB_SKIP_DIRS, suffix=".py")


def _check_inputs(inputs: list[str]) -> None:
    if isinstance(inputs, str):
        raise UserError(f"inputs must be a list of paths, got the string {inputs!r}; wrap it in a list")
    if not inputs:
        raise UserError("no inputs given: pass at least one file, folder, URL, .jsonl/.parquet file or `stdlib`")
    for path in inputs:
        if path != STDLIB and loc.is_glob(path) and not loc.exists(path):
            raise UserError(f"input {path!r} matches no file; check the pattern and the prefix before it")
        if path != STDLIB and not loc.exists(path):
            raise UserError(f"input path does not exist: {path!r}; check the spelling or use `stdlib` for the built-in corpus")


def input_files(inputs: list[str]) -> list[str]:
    """Flatten inputs into the ordered list of files to read."""
    _check_inputs(inputs)
    files = []
    for path in inputs:
        files.extend(expand_input(path, stdlib_files))
    return files


def plan(inputs: list[str], text_field: str = "text", range_bytes: int = 64 << 20) -> list[tuple]:
    """The pieces (formats.plan_pieces) of all inputs, in input order."""
    return plan_pieces(input_files(inputs), text_field, range_bytes)


def empty_corpus(inputs: list[str], text_field: str) -> UserError:
    return UserError(
        f"empty corpus: the inputs {inputs} contain no text (only empty files, binaries or empty "
        f"{text_field!r} fields); point the inputs at files with text"
    )


def iter_records(inputs: list[str], text_field: str = "text", stats: SourceStats | None = None) -> Iterator:
    """Yield the non-empty records (text, or (prompt, completion)) of all inputs, in order."""
    stats = stats if stats is not None else SourceStats()
    for piece in plan(inputs, text_field):
        for record in iter_piece(piece, text_field, stats):
            if record if isinstance(record, str) else any(record):
                stats.documents += 1
                yield record
    if stats.documents == 0:
        raise empty_corpus(inputs, text_field)


def iter_documents(inputs: list[str], text_field: str = "text", stats: SourceStats | None = None) -> Iterator[str]:
    """Yield the non-empty documents of all inputs, in a deterministic order; a fine-tuning
    pair is its prompt followed by its completion.

    Raises UserError for a missing path (before anything is yielded), a bad record, or
    when the inputs hold no text at all ("empty corpus", raised at the end).
    """
    for record in iter_records(inputs, text_field, stats):
        yield record if isinstance(record, str) else record[0] + record[1]


def fingerprint_inputs(inputs: list[str]) -> dict:
    """A cheap identity of the inputs (paths, sizes, mtimes) used to tell if prepared data is stale.

    Reading file metadata only, never the contents, keeps the cache check instant.
    """
    _check_inputs(inputs)
    entries = []
    digest = hashlib.sha256()
    total_bytes = 0
    for path in inputs:
        if path == STDLIB:
            files = stdlib_files()
            entry = {"input": STDLIB, "python": platform.python_version(), "path": stdlib_dir(), "files": len(files)}
            size = sum(os.path.getsize(p) for p in files)
            digest.update(json.dumps(entry, sort_keys=True).encode())
        elif loc.is_url(path):
            size = 0
            listing = loc.walk_url(path)
            for url, info in listing:
                size += int(info.get("size") or 0)
                digest.update(f"{url}\0{info.get('size')}\0{loc.url_identity(info)}\n".encode())
            entry = {"input": path, "files": len(listing), "bytes": size}
        else:
            abspath = os.path.abspath(path)
            files = loc.walk_files(abspath) if os.path.isdir(abspath) else [abspath]
            size = 0
            for p in files:
                st = os.stat(p)
                size += st.st_size
                rel = os.path.relpath(p, abspath) if os.path.isdir(abspath) else ""
                digest.update(f"{abspath}\0{rel}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
            entry = {"input": abspath, "files": len(files), "bytes": size}
            if len(files) == 1 and not os.path.isdir(abspath):
                entry["mtime_ns"] = os.stat(abspath).st_mtime_ns
        total_bytes += size
        entries.append(entry)
    return {"inputs": entries, "bytes": total_bytes, "sha256": digest.hexdigest()}
