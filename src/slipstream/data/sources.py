"""Raw text sources: turn user inputs (files, folders, JSONL, the Python stdlib) into documents.

Every input kind ends up as a stream of document strings. One plain-text file is one
document; one JSONL line is one document. Files are read as bytes and decoded as UTF-8
with errors="replace", so a stray Latin-1 byte never aborts a long prepare run; the
number of replaced characters is counted in `SourceStats` so the user can see it.

Inputs:
  - a text file                -> one document
  - a `.jsonl` file            -> one document per non-blank line, from `text_field`
  - a folder                   -> every regular file below it, sorted by relative path,
                                  skipping hidden files/folders and binaries (a NUL byte in
                                  the first 8 KiB); `.jsonl` files inside are read as JSONL
  - the word `stdlib`          -> the running interpreter's standard library `.py` files
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sysconfig
from dataclasses import dataclass
from typing import Iterator

from slipstream.errors import UserError
from slipstream.safe_read import DOCUMENT, loads_bounded, read_bytes_capped, read_line_capped

STDLIB = "stdlib"
BINARY_SNIFF_BYTES = 8192
REPLACEMENT_CHAR = "\ufffd"
REPLACEMENT_BYTES = REPLACEMENT_CHAR.encode("utf-8")

# Folders of the stdlib we skip: third-party packages are not the stdlib, and the test
# suites are huge and full of deliberately weird data (bad encodings, generated files).
# idlelib and lib2to3 are kept: they are ordinary, real Python code. What remains is
# ~12 MB of source in ~700 files on CPython 3.11.
STDLIB_SKIP_DIRS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class SourceStats:
    """Counters filled in while documents are read (the caller passes one in to see them)."""

    files: int = 0  # files read (not counting skipped binaries)
    documents: int = 0  # non-empty documents yielded
    bytes: int = 0  # raw input bytes read (skipped binaries included)
    replaced_chars: int = 0  # undecodable bytes turned into U+FFFD
    skipped_files: int = 0  # binary files skipped inside folders


def stdlib_dir() -> str:
    return sysconfig.get_paths()["stdlib"]


def _walk_files(root: str, suffix: str | None = None, skip_dirs: set[str] = frozenset()) -> list[str]:
    """All regular files below root, sorted by relative path so the order never depends on the filesystem."""
    found = []
    # followlinks=False: a symlink loop must not hang the walk; symlinked files still count.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for name in filenames:
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                found.append(path)
    found.sort(key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    return found


def stdlib_files() -> list[str]:
    return _walk_files(stdlib_dir(), suffix=".py", skip_dirs=STDLIB_SKIP_DIRS)


def _check_inputs(inputs: list[str]) -> None:
    if isinstance(inputs, str):
        raise UserError(f"inputs must be a list of paths, got the string {inputs!r}; wrap it in a list")
    if not inputs:
        raise UserError("no inputs given: pass at least one file, folder, .jsonl file or `stdlib`")
    for path in inputs:
        if path != STDLIB and not os.path.exists(path):
            raise UserError(f"input path does not exist: {path!r}; check the spelling or use `stdlib` for the built-in corpus")


def _expand(inputs: list[str]) -> list[str]:
    """Flatten inputs into the ordered list of files to read."""
    files = []
    for path in inputs:
        if path == STDLIB:
            files.extend(stdlib_files())
        elif os.path.isdir(path):
            files.extend(_walk_files(path))
        else:
            files.append(path)
    return files


def _decode(data: bytes, stats: SourceStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        # U+FFFD that was already in the input is not a replacement; subtract those.
        stats.replaced_chars += text.count(REPLACEMENT_CHAR) - data.count(REPLACEMENT_BYTES)
        return text


def _iter_jsonl(path: str, text_field: str, stats: SourceStats) -> Iterator[str]:
    with open(path, "rb") as f:
        line_no = 0
        while True:
            line_no += 1
            # One line is one document: a line over the document cap is refused before it is read whole.
            raw = read_line_capped(f, DOCUMENT, path, line_no)
            if not raw:
                break
            stats.bytes += len(raw)
            line = _decode(raw, stats).strip()
            if not line:
                continue
            try:
                obj = loads_bounded(line, f"{path}, line {line_no}")
            except json.JSONDecodeError as e:
                raise UserError(
                    f"{path}, line {line_no}: not valid JSON ({e.msg}); each line of a .jsonl file "
                    f"must be one JSON object with a {text_field!r} field (choose the field with --text-field)"
                ) from None
            if not isinstance(obj, dict) or text_field not in obj:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                raise UserError(
                    f"{path}, line {line_no}: no field {text_field!r} (found {keys}); "
                    f"pick the field holding the text with --text-field"
                )
            text = obj[text_field]
            if not isinstance(text, str):
                raise UserError(
                    f"{path}, line {line_no}: field {text_field!r} is {type(text).__name__}, not a string; "
                    f"pick the field holding the text with --text-field"
                )
            yield _replace_surrogates(text, stats)


def _replace_surrogates(text: str, stats: SourceStats) -> str:
    """JSON escapes can encode lone surrogates (\\ud800) that no tokenizer can encode: replace and count them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        surrogates = sum(1 for c in text if 0xD800 <= ord(c) <= 0xDFFF)
        stats.replaced_chars += surrogates
        return "".join(REPLACEMENT_CHAR if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def iter_documents(inputs: list[str], text_field: str = "text", stats: SourceStats | None = None) -> Iterator[str]:
    """Yield the non-empty documents of all inputs, in a deterministic order.

    Raises UserError for a missing path (before anything is yielded), a bad JSONL line,
    or when the inputs hold no text at all ("empty corpus", raised at the end).
    """
    _check_inputs(inputs)
    stats = stats if stats is not None else SourceStats()
    for path in _expand(inputs):
        if path.endswith(".jsonl"):
            stats.files += 1
            for text in _iter_jsonl(path, text_field, stats):
                if text:
                    stats.documents += 1
                    yield text
            continue
        with open(path, "rb") as f:
            head = f.read(BINARY_SNIFF_BYTES)
            if b"\0" in head:  # a binary is skipped unread, however big
                stats.bytes += os.fstat(f.fileno()).st_size
                stats.skipped_files += 1
                continue
        data = read_bytes_capped(path, DOCUMENT)  # the whole file is one document
        stats.bytes += len(data)
        stats.files += 1
        text = _decode(data, stats)
        if text:
            stats.documents += 1
            yield text
    if stats.documents == 0:
        raise UserError(
            f"empty corpus: the inputs {inputs} contain no text (only empty files, binaries or empty "
            f"{text_field!r} fields); point the inputs at files with text"
        )


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
        else:
            abspath = os.path.abspath(path)
            files = _walk_files(abspath) if os.path.isdir(abspath) else [abspath]
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
