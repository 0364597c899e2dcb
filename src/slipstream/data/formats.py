"""Readers of every input format, cut into pieces that can be read independently.

A piece is (kind, path, start, end, size): a text file, a byte range of a .jsonl file
(cut at line boundaries), a whole compressed .jsonl.gz/.jsonl.zst, a range of Parquet row
groups, or a range of record batches of an Arrow file. `plan_pieces` lists them in input
order (reading metadata only: Parquet footers, Arrow message headers, a few bytes around
each JSONL cut), `iter_piece` yields the piece's records, streaming: a Parquet row group is
read in record batches of at most BATCH_ROWS rows, JSONL one line at a time with the
per-document cap, compressed JSONL through a streaming decompressor.

A record is a document's text (a str), or a supervised fine-tuning pair (prompt,
completion) from a record with string fields `prompt` and `completion` and no text field.

Hugging Face `datasets` folders (save_to_disk) are read with pyarrow, never with the
`datasets` library: state.json lists the .arrow data files (Arrow IPC streams); a
DatasetDict folder (dataset_dict.json) is read through its "train" split. Such a folder
inside a plain folder is read the same way (not its JSON metadata, other splits or cache
files); a state.json without the library's `_data_files` is just a file.
"""

from __future__ import annotations

import contextlib
import gzip
import io
import itertools
import json
import os
import zlib
from dataclasses import dataclass
from typing import Iterator

from slipstream.data import locations as loc
from slipstream.errors import UserError
from slipstream.safe_read import DOCUMENT, HF_JSON, loads_bounded, read_line_capped

TEXT, JSONL, JSONL_GZ, JSONL_ZST, PARQUET, ARROW = "text", "jsonl", "jsonl.gz", "jsonl.zst", "parquet", "arrow"
BINARY_SNIFF_BYTES = 8192
BATCH_ROWS = 256  # rows per Parquet/Arrow record batch: bounds memory by rows, not by row-group size
BATCH_BYTES = 8 << 20  # ... and by bytes: fewer rows per batch when documents are big (books, repositories)
REPLACEMENT_CHAR = "\ufffd"
REPLACEMENT_BYTES = REPLACEMENT_CHAR.encode("utf-8")
UTF8_BOM = b"\xef\xbb\xbf"
SFT_FIELDS = ("prompt", "completion")
_COLUMNAR_ERRORS: tuple = ()


@dataclass
class SourceStats:
    """Counters filled in while documents are read (the caller passes one in to see them)."""

    files: int = 0  # files read (not counting skipped binaries)
    documents: int = 0  # non-empty documents yielded
    bytes: int = 0  # raw input bytes read (skipped binaries included)
    replaced_chars: int = 0  # undecodable bytes turned into U+FFFD
    skipped_files: int = 0  # binary files skipped inside folders

    def add(self, other: dict) -> None:
        for key, value in other.items():
            setattr(self, key, getattr(self, key) + value)


def kind_of(path: str) -> str:
    name = path.lower()
    for suffix, kind in ((".jsonl.gz", JSONL_GZ), (".jsonl.zst", JSONL_ZST), (".jsonl", JSONL),
                         (".parquet", PARQUET), (".arrow", ARROW)):
        if name.endswith(suffix):
            return kind
    return TEXT


def _arrow_errors() -> tuple:
    global _COLUMNAR_ERRORS
    if not _COLUMNAR_ERRORS:
        import pyarrow as pa

        _COLUMNAR_ERRORS = (pa.ArrowException, OSError, EOFError)
    return _COLUMNAR_ERRORS


def corrupt(path: str, what: str, e: BaseException) -> UserError:
    return UserError(f"{path}: not a readable {what} file ({type(e).__name__}: {e}); the file is truncated or "
                     f"corrupt: download or write it again (or remove it from the inputs)")


# ----------------------------------------------------------------------------- planning

def hf_dataset_files(folder: str) -> list[str] | None:
    """The .arrow data files of a `datasets` folder saved with save_to_disk, in order; None
    when the folder is not one."""
    from slipstream.safe_read import load_json_capped

    def load(name: str):
        path = loc.join(folder, name)
        if not loc.is_url(path):
            return load_json_capped(path, HF_JSON)
        with loc.open_binary(path) as f:
            data = f.read(HF_JSON.limit + 1)
        if len(data) > HF_JSON.limit:
            raise HF_JSON.exceeded(path)
        return loads_bounded(data, path)

    def load_if_ours(name: str, key: str):
        # A JSON file of that name that is not the datasets library's (a code corpus has
        # its own state.json files) leaves the folder a plain folder.
        if not loc.exists(loc.join(folder, name)):
            return None
        try:
            spec = load(name)
        except (UserError, ValueError) as e:
            if getattr(e, "transient", False):  # the store, not the file: say so
                raise
            return None
        return spec if isinstance(spec, dict) and key in spec else None

    spec = load_if_ours("dataset_dict.json", "splits")
    if spec is not None:
        splits = spec.get("splits")
        if not isinstance(splits, list) or "train" not in splits:
            raise UserError(f"{folder} is a Hugging Face DatasetDict with splits {splits} and no 'train' split; "
                            f"pass the split folder to read as the input, e.g. {loc.join(folder, str((splits or ['NAME'])[0]))}")
        files = hf_dataset_files(loc.join(folder, "train"))
        if files is None:
            raise UserError(f"{loc.join(folder, 'train')} has no state.json: the DatasetDict in {folder} is incomplete; "
                            f"save it again with save_to_disk")
        return files
    state = load_if_ours("state.json", "_data_files")
    if state is None:
        return None
    files = state.get("_data_files")
    if not isinstance(files, list) or not files:
        raise UserError(f"{loc.join(folder, 'state.json')} lists no data files; save the dataset again with save_to_disk")
    names = [f.get("filename") if isinstance(f, dict) else None for f in files]
    for name in names:
        # Data files live in the folder itself: a name with a path in it would read elsewhere.
        if not isinstance(name, str) or os.path.basename(name) != name or not name.endswith(".arrow"):
            raise UserError(f"{loc.join(folder, 'state.json')} lists {name!r}, not an .arrow file of that folder; "
                            f"save the dataset again with save_to_disk")
    return [loc.join(folder, name) for name in names]


def expand_input(path: str, stdlib_files) -> list[str]:
    """The files one input stands for, in reading order."""
    if path == "stdlib":
        return stdlib_files()
    if loc.is_glob(path):
        return [url for url, _info in loc.walk_url(path)]
    if loc.isdir(path):
        hf = hf_dataset_files(path)
        return hf if hf is not None else _walk_with_datasets(path)
    return [path]


def _parent(path: str) -> str:
    return path.rsplit("/", 1)[0] if loc.is_url(path) else os.path.dirname(path)


def _walk_with_datasets(root: str) -> list[str]:
    """The files below root in order, where a `datasets` folder inside it (a state.json or
    dataset_dict.json) stands for its data files, read as expand_input reads such a folder,
    not for its JSON metadata, other splits or cache files."""
    files = loc.walk_files(root)
    datasets = sorted({_parent(f) for f in files if f[len(_parent(f)) + 1:] in ("state.json", "dataset_dict.json")},
                      key=len)
    datasets = [d for d in datasets if hf_dataset_files(d) is not None]
    # A DatasetDict's split folders are inside it: the outermost folder decides.
    outer: list[str] = []
    for d in datasets:
        if not any(_inside(d, o) for o in outer):
            outer.append(d)
    if not outer:
        return files
    out, placed = [], set()
    for f in files:
        home = next((d for d in outer if _inside(_parent(f), d)), None)
        if home is None:
            out.append(f)
        elif home not in placed:  # the dataset's files go where its first file was
            placed.add(home)
            out.extend(hf_dataset_files(home) or [])
    return out


def _inside(path: str, folder: str) -> bool:
    sep = "/" if loc.is_url(folder) else os.sep
    return path == folder or path.startswith(folder.rstrip(sep) + sep)


def plan_pieces(files: list[str], text_field: str, range_bytes: int) -> list[tuple]:
    """Pieces (kind, path, start, end, size) of the files, in order (see module doc)."""
    pieces = []
    for path in files:
        kind = kind_of(path)
        if kind == JSONL:
            pieces.extend(_jsonl_ranges(path, range_bytes))
        elif kind == PARQUET:
            pieces.extend(_parquet_pieces(path, text_field))
        elif kind == ARROW:
            pieces.extend(_arrow_pieces(path, text_field))
        else:
            pieces.append((kind, path, 0, 0, loc.size(path)))
    return pieces


def _jsonl_ranges(path: str, range_bytes: int) -> list[tuple]:
    total = loc.size(path)
    cuts = [0]
    with loc.open_binary(path) as f:
        while cuts[-1] + range_bytes < total:
            # The cut goes after the newline ending the line that holds byte target-1, so a
            # line starting exactly at the target starts the next range.
            cut = _after_newline(f, cuts[-1] + range_bytes - 1)
            if cut is None:
                break  # no newline within the cap: the reader of this range refuses the line, naming it
            if cut >= total:
                break
            cuts.append(cut)
    cuts.append(total)
    return [(JSONL, path, a, b, b - a) for a, b in zip(cuts, cuts[1:])] or [(JSONL, path, 0, 0, 0)]


def _after_newline(f, pos: int) -> int | None:
    """The offset just past the first newline at or after pos (the end of the file if none),
    scanning 1 MiB at a time; None when the line runs on past the document cap."""
    f.seek(pos)
    scanned = 0
    while scanned <= DOCUMENT.limit:
        block = f.read(1 << 20)
        if not block:
            return pos + scanned
        i = block.find(b"\n")
        if i >= 0:
            return pos + scanned + i + 1
        scanned += len(block)
    return None


def _check_schema(path: str, names: list[str], types: dict, text_field: str) -> list[str]:
    """The columns to read: [text_field], or the fine-tuning pair; else a UserError listing the columns."""
    import pyarrow as pa

    def is_text(t) -> bool:
        if pa.types.is_dictionary(t):  # dictionary-encoded strings (pandas categoricals): to_pylist gives the strings
            t = t.value_type
        return pa.types.is_string(t) or pa.types.is_large_string(t) or getattr(pa.types, "is_string_view", lambda _: False)(t)

    columns = [text_field] if text_field in names else list(SFT_FIELDS) if all(f in names for f in SFT_FIELDS) else None
    if columns is None:
        raise UserError(f"{path}: no column {text_field!r} (columns: {names}); pick the column holding the text with "
                        f"--text-field (or give `prompt` and `completion` columns for fine-tuning pairs)")
    for c in columns:
        if not is_text(types[c]):
            raise UserError(f"{path}: column {c!r} holds {types[c]}, not strings; pick the column holding the text "
                            f"with --text-field")
    return columns


def _parquet_pieces(path: str, text_field: str) -> list[tuple]:
    import pyarrow.parquet as pq

    with loc.open_binary(path) as f:
        try:
            meta = pq.ParquetFile(f).metadata
            schema = meta.schema.to_arrow_schema()
        except _arrow_errors() as e:
            raise corrupt(path, "Parquet", e) from None
    _check_schema(path, schema.names, {n: schema.field(n).type for n in schema.names}, text_field)
    pieces = []
    for i in range(meta.num_row_groups):
        rg = meta.row_group(i)
        size = sum(rg.column(c).total_compressed_size for c in range(rg.num_columns))
        pieces.append((PARQUET, path, i, i + 1, size))
    return pieces or [(PARQUET, path, 0, 0, 0)]


def _open_arrow(path: str, f):
    """(reader, is_file_format) for an Arrow IPC file ("ARROW1" magic) or stream."""
    import pyarrow as pa

    head = f.read(6)
    f.seek(0)
    if head == b"ARROW1":
        return pa.ipc.open_file(f), True
    return pa.ipc.open_stream(f), False


def _arrow_pieces(path: str, text_field: str) -> list[tuple]:
    import pyarrow as pa

    try:
        if loc.is_url(path):
            # Counting a remote stream's batches would download it: one piece per file.
            with loc.open_binary(path) as f:
                reader, _ = _open_arrow(path, f)
                schema = reader.schema
            sizes = None
        else:
            # Memory-mapped: reading a batch's header touches its metadata pages only, so
            # counting batches costs no data reads.
            with pa.memory_map(path) as f:
                reader, file_format = _open_arrow(path, f)
                schema = reader.schema
                if file_format:
                    sizes = [reader.get_batch(i).nbytes for i in range(reader.num_record_batches)]
                else:
                    sizes = [batch.nbytes for batch in reader]
    except _arrow_errors() as e:
        raise corrupt(path, "Arrow", e) from None
    _check_schema(path, schema.names, {n: schema.field(n).type for n in schema.names}, text_field)
    if sizes is None:
        return [(ARROW, path, 0, -1, loc.size(path))]
    return [(ARROW, path, i, i + 1, s) for i, s in enumerate(sizes)] or [(ARROW, path, 0, 0, 0)]


# ----------------------------------------------------------------------------- reading

def decode(data: bytes, stats: SourceStats) -> str:
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        text = data.decode("utf-8", errors="replace")
        # U+FFFD that was already in the input is not a replacement; subtract those.
        stats.replaced_chars += text.count(REPLACEMENT_CHAR) - data.count(REPLACEMENT_BYTES)
        return text


def replace_surrogates(text: str, stats: SourceStats) -> str:
    """JSON escapes can encode lone surrogates (\\ud800) that no tokenizer can encode: replace and count them."""
    try:
        text.encode("utf-8")
        return text
    except UnicodeEncodeError:
        surrogates = sum(1 for c in text if 0xD800 <= ord(c) <= 0xDFFF)
        stats.replaced_chars += surrogates
        return "".join(REPLACEMENT_CHAR if 0xD800 <= ord(c) <= 0xDFFF else c for c in text)


def iter_piece(piece: tuple, text_field: str, stats: SourceStats) -> Iterator:
    """The records of one piece, in order (empty documents included: the caller skips them)."""
    kind, path, start, end, _size = piece
    try:
        if kind == TEXT:
            yield from _iter_text(path, stats)
        elif kind in (JSONL, JSONL_GZ, JSONL_ZST):
            yield from _iter_jsonl(piece, text_field, stats)
        elif kind == PARQUET:
            yield from _iter_parquet(path, start, end, text_field, stats)
        else:
            yield from _iter_arrow(path, start, end, text_field, stats)
    except UserError:
        raise
    except Exception as e:
        err = loc.translate(e, path)
        if err is None:
            raise
        raise err from None


def _iter_text(path: str, stats: SourceStats) -> Iterator[str]:
    with loc.open_binary(path) as f:
        head = f.read(BINARY_SNIFF_BYTES)
        if b"\0" in head:  # a binary is skipped unread, however big
            stats.bytes += loc.size(path)
            stats.skipped_files += 1
            return
        size = loc.size(path)
        if size > DOCUMENT.limit:  # the whole file is one document
            raise DOCUMENT.exceeded(path, size)
        data = head + f.read(DOCUMENT.limit + 1 - len(head))
        if len(data) > DOCUMENT.limit:
            raise DOCUMENT.exceeded(path)
    stats.bytes += len(data)
    stats.files += 1
    yield decode(data, stats)


def _decompressed(kind: str, raw):
    if kind == JSONL_GZ:
        return gzip.GzipFile(fileobj=raw)
    return io.BufferedReader(_ZstdFrames(raw), 1 << 20)


class _ZstdFrames(io.RawIOBase):
    """The decompressed bytes of a stream of zstd frames, refusing one cut short.

    zstandard's stream_reader ends quietly where its input ends, even inside a frame, so a
    truncated file would lose its tail without a word. Here each frame goes through its own
    decompressobj, whose eof says the frame is complete. The compressed input is fed FEED
    bytes at a time: at zstd's largest expansion (an RLE block: 4 bytes for 128 KiB) one
    call's output stays under 64 MiB, so a decompression bomb streams like any file."""

    FEED = 1 << 11

    def __init__(self, raw) -> None:
        import zstandard

        self._raw, self._dctx, self._error = raw, zstandard.ZstdDecompressor(), zstandard.ZstdError
        self._frame = None  # the decompressobj of the frame being read
        self._in, self._in_pos = b"", 0
        self._out, self._out_pos = b"", 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        while self._out_pos >= len(self._out):
            if self._frame is not None and self._frame.eof:
                # A complete frame: what it did not use starts the next one.
                self._in, self._in_pos = self._frame.unused_data + self._in[self._in_pos:], 0
                self._frame = None
            if self._in_pos >= len(self._in):
                self._in, self._in_pos = self._raw.read(1 << 20), 0
                if not self._in:
                    if self._frame is not None:
                        raise self._error("the data ends inside a zstd frame (the file is truncated)")
                    return 0
            if self._frame is None:
                self._frame = self._dctx.decompressobj()
            data = self._in[self._in_pos : self._in_pos + self.FEED]
            self._in_pos += len(data)
            self._out, self._out_pos = self._frame.decompress(data), 0
        n = min(len(b), len(self._out) - self._out_pos)
        b[:n] = self._out[self._out_pos : self._out_pos + n]
        self._out_pos += n
        return n


def _iter_jsonl(piece: tuple, text_field: str, stats: SourceStats) -> Iterator:
    kind, path, start, end, _size = piece
    with loc.open_binary(path) as raw:
        if kind == JSONL:
            raw.seek(start)
            f = raw
        else:
            f = _decompressed(kind, raw)
        if start == 0:
            stats.files += 1
        pos, line_no = start, 0
        while kind != JSONL or pos < end:
            line_no += 1
            where = f"{path}, line {line_no}" if start == 0 else f"{path}, the line at byte {pos}"
            try:
                # One line is one document: a line over the document cap is refused before it is read whole.
                line = read_line_capped(f, DOCUMENT, path, line_no)
            except UserError:
                if start == 0:
                    raise
                # Lines are counted from the range's start: name the line by its offset instead.
                raise DOCUMENT.exceeded(where, problem="is longer than") from None
            except (EOFError, zlib.error, gzip.BadGzipFile) as e:
                raise UserError(f"{path}: compressed data is corrupt or truncated ({e}); re-create the file") from None
            except Exception as e:
                if type(e).__name__ == "ZstdError":
                    raise UserError(f"{path}: zstandard data is corrupt or truncated ({e}); re-create the file") from None
                raise
            if not line:
                break
            pos += len(line)
            stats.bytes += len(line) if kind == JSONL else 0
            if line_no == 1 and start == 0 and line.startswith(UTF8_BOM):
                line = line[len(UTF8_BOM):]  # Windows tools start UTF-8 files with one
            yield from _jsonl_record(line, where, text_field, stats)
        if kind != JSONL:
            stats.bytes += loc.size(path)


def _jsonl_record(raw: bytes, where: str, text_field: str, stats: SourceStats) -> Iterator:
    line = decode(raw, stats).strip()
    if not line:
        return
    try:
        obj = loads_bounded(line, where)
    except json.JSONDecodeError as e:
        raise UserError(
            f"{where}: not valid JSON ({e.msg}); each line of a .jsonl file "
            f"must be one JSON object with a {text_field!r} field (choose the field with --text-field)"
        ) from None
    if isinstance(obj, dict) and text_field not in obj and all(isinstance(obj.get(f), str) for f in SFT_FIELDS):
        yield (replace_surrogates(obj["prompt"], stats), replace_surrogates(obj["completion"], stats))
        return
    if not isinstance(obj, dict) or text_field not in obj:
        keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
        raise UserError(f"{where}: no field {text_field!r} (found {keys}); pick the field holding the text with "
                        f"--text-field (or give string fields `prompt` and `completion` for fine-tuning pairs)")
    text = obj[text_field]
    if not isinstance(text, str):
        raise UserError(f"{where}: field {text_field!r} is {type(text).__name__}, not a string; "
                        f"pick the field holding the text with --text-field")
    yield replace_surrogates(text, stats)


def _rows_per_batch(rows: int, nbytes: int) -> int:
    """Rows to read at once: BATCH_ROWS, fewer when that many would hold over BATCH_BYTES
    (from the average row), never less than one."""
    if rows <= 0 or nbytes <= 0:
        return BATCH_ROWS
    return max(1, min(BATCH_ROWS, BATCH_BYTES * rows // nbytes))


def _strings(column, stats: SourceStats) -> list:
    """A string column's values. Parquet and Arrow readers do not check the UTF-8: bytes
    that are not UTF-8 become U+FFFD and are counted, as in text files and JSONL."""
    try:
        return column.to_pylist()
    except UnicodeDecodeError:
        import pyarrow as pa

        if pa.types.is_dictionary(column.type):
            column = column.dictionary_decode()
        return [None if b is None else decode(b, stats) for b in column.cast(pa.large_binary()).to_pylist()]


def _batch_records(batch, columns: list[str], stats: SourceStats) -> Iterator:
    if len(columns) == 1:
        for text in _strings(batch.column(0), stats):
            yield replace_surrogates(text, stats) if text else ""
    else:
        for prompt, completion in zip(_strings(batch.column(0), stats), _strings(batch.column(1), stats)):
            yield (replace_surrogates(prompt or "", stats), replace_surrogates(completion or "", stats))


def _validate_offsets(batch) -> None:
    """IPC batches arrive unchecked: offsets past the data would be read from outside the
    buffer (SIGBUS on a memory map). Full validation of the columns' bytes (viewed as
    binary, so bad UTF-8 is left to _strings to replace) checks every offset."""
    import pyarrow as pa

    for column in batch.columns:
        t = column.type
        as_bytes = pa.binary() if pa.types.is_string(t) else pa.large_binary() if pa.types.is_large_string(t) else None
        (column.view(as_bytes) if as_bytes is not None else column).validate(full=True)


def _iter_parquet(path: str, start: int, end: int, text_field: str, stats: SourceStats) -> Iterator:
    import pyarrow.parquet as pq

    # A local path goes to pyarrow's own file reader: no Python file object in the read path.
    with (contextlib.nullcontext(path) if not loc.is_url(path) else loc.open_binary(path)) as f:
        try:
            # No pre-buffering and a small read buffer: pages stream in, the row group is never read whole.
            pf = pq.ParquetFile(f, pre_buffer=False, buffer_size=1 << 20)
            schema = pf.schema_arrow
            columns = _check_schema(path, schema.names, {n: schema.field(n).type for n in schema.names}, text_field)
            if start == 0:
                stats.files += 1
            if end <= start:
                return
            meta = pf.metadata
            for rg in range(start, end):
                group = meta.row_group(rg)
                text_bytes = sum(group.column(c).total_uncompressed_size for c in range(group.num_columns)
                                 if group.column(c).path_in_schema in columns)
                rows = _rows_per_batch(group.num_rows, text_bytes)
                for batch in pf.iter_batches(batch_size=rows, row_groups=[rg], columns=columns, use_threads=False):
                    yield from _batch_records(batch, columns, stats)
                stats.bytes += sum(meta.row_group(rg).column(c).total_compressed_size
                                   for c in range(meta.row_group(rg).num_columns))
        except _arrow_errors() as e:
            raise corrupt(path, f"Parquet (row groups {start}..{end - 1})", e) from None


def _iter_arrow(path: str, start: int, end: int, text_field: str, stats: SourceStats) -> Iterator:
    import pyarrow as pa

    try:
        # Local files are memory-mapped for zero-copy batches; the map is closed after the piece.
        source = loc.open_binary(path) if loc.is_url(path) else pa.memory_map(path)
        with source as f:
            reader, file_format = _open_arrow(path, f)
            columns = _check_schema(path, reader.schema.names,
                                    {n: reader.schema.field(n).type for n in reader.schema.names}, text_field)
            if start == 0:
                stats.files += 1
            if file_format:
                last = reader.num_record_batches if end < 0 else end
                batches = (reader.get_batch(i) for i in range(start, last))
            else:
                batches = itertools.islice(iter(reader), start, None if end < 0 else end)
            for batch in batches:
                stats.bytes += batch.nbytes
                batch = batch.select(columns)
                _validate_offsets(batch)
                rows = _rows_per_batch(batch.num_rows, batch.nbytes)
                for i in range(0, batch.num_rows, rows):
                    yield from _batch_records(batch.slice(i, rows), columns, stats)
    except _arrow_errors() as e:
        raise corrupt(path, "Arrow", e) from None
