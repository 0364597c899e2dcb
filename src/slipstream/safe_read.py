"""Bounded readers for files that come from outside: traces, data, HF folders, tokenizers,
checkpoints.

DESIGN.md's trust boundary says reading such a file never allocates without bound. A
`json.loads(path.read_text())` breaks that twice: a huge (or gzip-bombed) file is read
whole, and a deeply nested one ends in RecursionError. Every reader here has a byte cap
(for gzip, on the decompressed bytes) and turns deep nesting into a clear UserError.

The caps, and what raises them (a value in bytes, or with a unit: 512MiB, 4GiB):

    trace (doctor --trace; decompressed)   2 GiB    --max-trace-bytes
    a document: a text file or JSONL line  1 GiB    SLIPSTREAM_MAX_DOCUMENT_BYTES
    tokenizer file                         256 MiB  SLIPSTREAM_MAX_TOKENIZER_BYTES
    data manifest.json                     64 MiB   SLIPSTREAM_MAX_MANIFEST_BYTES
    checkpoint JSON (meta, manifest, ...)  16 MiB   SLIPSTREAM_MAX_CHECKPOINT_JSON_BYTES
    Hugging Face JSON (config, index)      16 MiB   SLIPSTREAM_MAX_HF_JSON_BYTES

Each is far above what a genuine file needs (our own meta.json is a few KiB, a big
tokenizer.json ~30 MiB, a profiler trace of a large run some hundreds of MiB) and low
enough that parsing one stays within a few GiB of memory. Traces are parsed as a stream
(`JsonStream`), so their memory is what the caller keeps, not the size of the file.

JSON nesting: whole-file loads reject documents deeper than MAX_DEPTH levels (real files
are under ten); a document deeper than Python's parser can go is caught in the parser.

This module sits at the bottom of the layers: it imports only the stdlib and errors.
"""

from __future__ import annotations

import codecs
import dataclasses
import gzip
import json
import os
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from slipstream.errors import UserError

KiB, MiB, GiB = 1 << 10, 1 << 20, 1 << 30
MAX_DEPTH = 100
CHUNK_BYTES = 1 << 20  # read and parse in pieces of this size
_GZIP_MAGIC = b"\x1f\x8b"


@dataclass(frozen=True)
class Cap:
    """A size limit for one kind of file, and the setting that raises it."""

    what: str  # the kind of file, named in the error: "checkpoint JSON file"
    default: int  # bytes
    setting: str  # an environment variable (SLIPSTREAM_...) or a command-line flag
    chosen: int | None = None  # a limit given explicitly (a flag's value): wins over both

    @property
    def limit(self) -> int:
        if self.chosen is not None:
            return self.chosen
        if self.setting.startswith("SLIPSTREAM_") and os.environ.get(self.setting, "").strip():
            return parse_size(os.environ[self.setting], self.setting)
        return self.default

    def with_limit(self, limit: int | None) -> Cap:
        """The same cap with an explicit limit (a flag's value); None keeps the cap as it is."""
        return self if limit is None else dataclasses.replace(self, chosen=limit)

    def exceeded(self, where: str | Path, size: int | None = None, problem: str = "is larger than") -> UserError:
        """The error for a file over this cap: names the file, the limit and how to raise it."""
        limit = self.limit
        how = (f"pass {self.setting} {human_size(2 * limit)}" if self.setting.startswith("-")
               else f"set {self.setting}={human_size(2 * limit)}")
        state = f"is {human_size(size)}, over" if size is not None else problem
        return UserError(f"{where} {state} the {human_size(limit)} limit for a {self.what}; "
                         f"if it is genuine, {how} to raise the limit")


TRACE = Cap("trace", 2 * GiB, "--max-trace-bytes")
DOCUMENT = Cap("document (a text file or a JSONL line)", 1 * GiB, "SLIPSTREAM_MAX_DOCUMENT_BYTES")
TOKENIZER = Cap("tokenizer file", 256 * MiB, "SLIPSTREAM_MAX_TOKENIZER_BYTES")
DATA_MANIFEST = Cap("data manifest", 64 * MiB, "SLIPSTREAM_MAX_MANIFEST_BYTES")
CHECKPOINT_JSON = Cap("checkpoint JSON file", 16 * MiB, "SLIPSTREAM_MAX_CHECKPOINT_JSON_BYTES")
HF_JSON = Cap("Hugging Face JSON file", 16 * MiB, "SLIPSTREAM_MAX_HF_JSON_BYTES")

_UNITS = {"": 1, "k": KiB, "m": MiB, "g": GiB, "t": 1 << 40}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*$", re.IGNORECASE)


def parse_size(text: str, setting: str) -> int:
    """'1048576', '512MiB', '2G', '1.5GiB' -> bytes (units are powers of 1024)."""
    m = _SIZE_RE.match(str(text))
    if not m or float(m.group(1)) * _UNITS[m.group(2).lower()] < 1:
        raise UserError(f"{setting}: {text!r} is not a size; give bytes or a number with a unit, e.g. 512MiB or 4GiB")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def human_size(n: int) -> str:
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", KiB)):
        if n >= scale:
            return f"{n / scale:.1f}".removesuffix(".0") + unit
    return f"{n}B"


# ---------------------------------------------------------------------------- bytes


def check_size(path: str | Path, cap: Cap) -> int:
    """The size of a plain file, or a UserError when it is over the cap (for readers that
    hand the path to a library, e.g. the `tokenizers` JSON loader)."""
    size = os.stat(path).st_size
    if size > cap.limit:
        raise cap.exceeded(path, size)
    return size


def _is_gzip(f: BinaryIO) -> bool:
    magic = f.read(2)
    f.seek(0)
    return magic == _GZIP_MAGIC


def iter_chunks(path: str | Path, cap: Cap, decompress: bool = False, chunk_bytes: int = CHUNK_BYTES) -> Iterator[bytes]:
    """The file's bytes in pieces; with decompress, gzip data (told by its magic bytes, not
    the name) is gunzipped. The cap counts the bytes yielded, so a gzip bomb stops at it."""
    limit = cap.limit
    with open(path, "rb") as raw:
        gz = decompress and _is_gzip(raw)
        if decompress and not gz and str(path).endswith(".gz"):
            raise UserError(f"{path}: named .gz but is not gzip data")
        f = gzip.GzipFile(fileobj=raw) if gz else raw
        total = 0
        while True:
            try:
                # limit + 1 - total: read one byte past the cap at most, never a whole chunk more.
                chunk = f.read(min(chunk_bytes, limit + 1 - total))
            except (OSError, EOFError, zlib.error) as e:
                if not gz:
                    raise
                raise UserError(f"{path}: gzip data is corrupt or truncated ({e}); re-create the file") from None
            if not chunk:
                return
            total += len(chunk)
            if total > limit:
                raise cap.exceeded(path, problem="decompresses to more than" if gz else "is larger than")
            yield chunk


def read_bytes_capped(path: str | Path, cap: Cap, decompress: bool = False) -> bytes:
    """The whole file (gunzipped with decompress), or a UserError when it is over the cap.
    A plain file's size is checked before anything is read."""
    if not decompress:
        check_size(path, cap)
    return b"".join(iter_chunks(path, cap, decompress))


def read_line_capped(f: BinaryIO, cap: Cap, path: str | Path, line_no: int) -> bytes:
    """Line `line_no` of a binary file (the next one; b"" at the end), refusing one longer
    than the cap before reading the rest of it."""
    limit = cap.limit
    line = f.readline(limit + 1)
    if len(line) > limit and not line.endswith(b"\n"):
        raise cap.exceeded(f"{path}, line {line_no}", problem="is longer than")
    return line


# ---------------------------------------------------------------------------- JSON


def _too_deep(where: str | Path, max_depth: int) -> UserError:
    return UserError(f"{where}: JSON nested more than {max_depth} levels deep; no genuine file nests like "
                     "that: the file is damaged or not what it claims to be")


def json_depth(value: Any) -> int:
    """Nesting depth of a parsed JSON value (a scalar is 0, [] and {} are 1); iterative, so
    a deep value cannot exhaust the stack."""
    depth, stack = 0, [(value, 1)]
    while stack:
        v, level = stack.pop()
        if isinstance(v, dict):
            v = v.values()
        elif not isinstance(v, list):
            continue
        depth = max(depth, level)
        stack.extend((child, level + 1) for child in v if isinstance(child, (dict, list)))
    return depth


def loads_bounded(text: str | bytes, where: str | Path, max_depth: int = MAX_DEPTH) -> Any:
    """json.loads, but nesting deeper than max_depth is a UserError (never a RecursionError).
    Invalid JSON raises json.JSONDecodeError as json.loads does (also for non-UTF-8 bytes)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as e:
            raise json.JSONDecodeError(f"not UTF-8 text ({e.reason})", "", e.start) from None
    try:
        value = json.loads(text)
    except RecursionError:
        raise _too_deep(where, max_depth) from None
    except json.JSONDecodeError:
        raise
    except ValueError as e:  # an integer of more than 4300 digits (Python's int-to-str guard)
        raise json.JSONDecodeError(f"unreadable number ({e})", "", 0) from None
    if json_depth(value) > max_depth:
        raise _too_deep(where, max_depth)
    return value


def load_json_capped(path: str | Path, cap: Cap, max_depth: int = MAX_DEPTH) -> Any:
    """Parse a JSON file of at most cap bytes and max_depth levels of nesting; either limit
    is a UserError naming the file. A missing file raises OSError and invalid JSON
    json.JSONDecodeError, as `json.loads(path.read_text())` did."""
    return loads_bounded(read_bytes_capped(path, cap), path, max_depth)


class JsonStream:
    """One JSON document (an object or an array) parsed a piece at a time, so memory holds
    one chunk of text plus what the caller keeps, whatever the file's size.

        stream = JsonStream(path, TRACE, decompress=True, what="chrome trace")
        if stream.peek() == "{":
            for key in stream.members():        # then read the member's value:
                for item in stream.items(): ...  # an array, item by item
                # or: value = stream.value()     # any value, whole
        stream.finish()                          # nothing but whitespace may follow

    One value read whole (an item, a member's value) may be at most max_value_chars long:
    this bounds the memory of parsing it.

    The size is checked before parsing starts: a plain file's from the file system, a gzip
    file's by decompressing it once without parsing, so a bomb costs the decompression of
    up to the cap, never the parsing of it.
    """

    _WS = re.compile(r"[ \t\n\r]*")
    _NUMBER = re.compile(r"[0-9.eE+-]*")  # characters that can continue a number

    def __init__(self, path: str | Path, cap: Cap, decompress: bool = False, what: str = "JSON file",
                 hint: str = "", max_value_chars: int = 16 * MiB, chunk_bytes: int = CHUNK_BYTES):
        self.path, self.what, self.hint, self.max_value_chars = path, what, hint, max_value_chars
        self._decoder = json.JSONDecoder()
        self._cap, self._decompress, self._chunk_bytes = cap, decompress, chunk_bytes
        self._text = self._iter_text()
        self._buf, self._pos, self._dropped, self._eof = "", 0, 0, False
        if decompress and self._sniff_gzip():
            for _ in iter_chunks(path, cap, decompress=True, chunk_bytes=max(chunk_bytes, 4 * MiB)):
                pass  # size only; parsing starts again from the top
        else:
            check_size(path, cap)  # a plain file: its size tells at once

    def _sniff_gzip(self) -> bool:
        """True for gzip data; first checks it starts like JSON, so that decompressing a
        large file that is not JSON at all fails at once."""
        with open(self.path, "rb") as f:
            if not _is_gzip(f):
                return False
        if self.peek() not in ("{", "["):
            raise self.not_json()
        self._text = self._iter_text()  # start over after the peek
        self._buf, self._pos, self._dropped, self._eof = "", 0, 0, False
        return True

    def not_json(self) -> UserError:
        return UserError(f"{self.path}: not a {self.what} (not JSON)")

    def _iter_text(self) -> Iterator[str]:
        decoder = codecs.getincrementaldecoder("utf-8")()
        offset = 0
        for chunk in iter_chunks(self.path, self._cap, self._decompress, self._chunk_bytes):
            try:
                yield decoder.decode(chunk)
            except UnicodeDecodeError as e:
                raise UserError(f"{self.path}: not a {self.what} (binary data at byte {offset + e.start}, "
                                "not JSON text)") from None
            offset += len(chunk)
        try:
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            raise UserError(f"{self.path}: not a {self.what} (it ends inside a UTF-8 character)") from None

    def _fill(self, need: int) -> None:
        """Read until at least `need` unparsed characters are buffered, or the end."""
        if self._pos:  # drop what is parsed already: the buffer holds only the unparsed tail
            self._dropped += self._pos
            self._buf, self._pos = self._buf[self._pos:], 0
        parts = [self._buf]
        have = len(self._buf)
        while have < need and not self._eof:
            piece = next(self._text, None)
            if piece is None:
                self._eof = True
            else:
                parts.append(piece)
                have += len(piece)
        self._buf = "".join(parts)

    def _error(self, msg: str, pos: int) -> UserError:
        return UserError(f"{self.path}: invalid JSON ({msg} at character {self._dropped + pos:,}){self.hint}")

    def peek(self) -> str:
        """The next character that is not whitespace ("" at the end), without taking it."""
        while True:
            self._pos = self._WS.match(self._buf, self._pos).end()
            if self._pos < len(self._buf) or self._eof:
                return self._buf[self._pos] if self._pos < len(self._buf) else ""
            self._fill(1)

    def _take(self, allowed: str) -> str:
        c = self.peek()
        if not c or c not in allowed:
            what = f"'{c}'" if c else "the end of the file"
            raise self._error(f"expected one of {' '.join(allowed)}, found {what}", self._pos)
        self._pos += 1
        return c

    def value(self) -> Any:
        """The next value, whole. Deep nesting that the parser cannot follow is a UserError."""
        self.peek()
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError as e:
                if self._eof:
                    raise self._error(e.msg, e.pos) from None
            except RecursionError:
                raise _too_deep(self.path, MAX_DEPTH) from None
            else:
                # A number may go on past the buffer's end ("2." of "2.5"): only what follows it tells.
                cut = isinstance(value, (int, float)) and self._NUMBER.match(self._buf, end).end() == len(self._buf)
                if self._eof or not cut:
                    self._pos = end
                    return value
            if len(self._buf) - self._pos > self.max_value_chars:
                raise UserError(f"{self.path}: one JSON value (at character {self._dropped + self._pos:,}) is larger "
                                f"than {human_size(self.max_value_chars)}; not a {self.what}, whose items are small")
            # Incomplete: read at least twice as much again, so a long value costs O(its size).
            self._fill(2 * (len(self._buf) - self._pos) + self._chunk_bytes)

    def items(self) -> Iterator[Any]:
        """The items of the array that comes next, one at a time."""
        self._take("[")
        if self.peek() == "]":
            self._pos += 1
            return
        while True:
            yield self.value()
            if self._take(",]") == "]":
                return

    def members(self) -> Iterator[str]:
        """The keys of the object that comes next; after each, the caller reads its value
        (value() or items())."""
        self._take("{")
        if self.peek() == "}":
            self._pos += 1
            return
        while True:
            if self.peek() != '"':
                raise self._error("expected a key in double quotes", self._pos)
            key = self.value()
            self._take(":")
            yield key
            if self._take(",}") == "}":
                return

    def finish(self) -> None:
        """Check that only whitespace follows the document."""
        if self.peek():
            raise self._error("extra data after the document", self._pos)
