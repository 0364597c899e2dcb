"""Review of `data prepare` at scale: inputs it misread or refused, and untrusted input that
crashed it. Each test names the bug it pins."""

import gzip
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from slipstream.data.prepare import prepare_dataset
from slipstream.data.sources import iter_documents
from slipstream.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [f"document {i}: " + "abcdefghij"[i % 10] * (20 + i) for i in range(40)]

# Peak memory of this process in KiB. Not ru_maxrss: a child started from a big pytest
# process inherits its parent's high-water mark there; VmHWM starts afresh at exec.
HWM = "def hwm():\n    return int(next(l for l in open('/proc/self/status') if l.startswith('VmHWM')).split()[1])\n"


def prepare(inputs, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 1)
    return prepare_dataset([str(i) for i in inputs], "byte", str(out), **kw)


def all_tokens(out, manifest):
    return np.concatenate([np.fromfile(os.path.join(out, s["file"]), dtype=manifest["dtype"])
                           for split in ("train", "val") for s in manifest["splits"][split]["shards"]])


def test_dictionary_encoded_text_columns_are_text(tmp_path):
    """A string column stored dictionary-encoded (pandas categoricals, Arrow dictionary
    arrays) was refused as "not strings"."""
    docs = ["alpha beta", None, "gamma", "alpha beta", "delta " * 5]
    table = pa.table({"text": pa.array(docs).dictionary_encode()})
    pq.write_table(table, tmp_path / "d.parquet")
    assert pa.types.is_dictionary(pq.ParquetFile(tmp_path / "d.parquet").schema_arrow.field("text").type)
    with pa.OSFile(str(tmp_path / "d.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    want = [d for d in docs if d]
    for name in ("d.parquet", "d.arrow"):
        assert list(iter_documents([str(tmp_path / name)])) == want
        m = prepare([tmp_path / name], tmp_path / f"out-{name}", val_fraction=0)
        assert m["documents"] == 4
    # A dictionary of integers is still not text.
    pq.write_table(pa.table({"text": pa.array([1, 2, 1]).dictionary_encode()}), tmp_path / "ints.parquet")
    with pytest.raises(UserError, match=r"ints\.parquet: column 'text' holds (dictionary<values=)?int64"):
        prepare([tmp_path / "ints.parquet"], tmp_path / "out-ints")


def test_the_same_compressed_input_twice_is_read_twice(tmp_path):
    """Consecutive pieces of one file were merged when the second started where the first
    ended; a whole-file piece (.jsonl.gz, .jsonl.zst: start 0, end 0) given twice in a row
    matched, so the repeated input was read once (and only when both fell in one unit)."""
    lines = "".join(json.dumps({"text": f"doc {i}"}) + "\n" for i in range(5)).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    inputs = [tmp_path / "a.jsonl.gz", tmp_path / "a.jsonl.gz"]
    assert len(list(iter_documents([str(p) for p in inputs]))) == 10
    m = prepare(inputs, tmp_path / "out", val_fraction=0)
    assert m["documents"] == 10
    assert len(all_tokens(tmp_path / "out", m)) == 2 * sum(len(f"doc {i}") + 1 for i in range(5))


def _arrow_stream_with_bad_offsets(path):
    table = pa.table({"text": ["hello world " * 10] * 4})
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    data = bytearray(sink.getvalue().to_pybytes())
    at = bytes(data).find(struct.pack("<5i", 0, 120, 240, 360, 480))
    assert at > 0
    struct.pack_into("<i", data, at + 16, 0x7FFF0000)  # the last string "ends" 2 GB past the file
    path.write_bytes(bytes(data))


def test_arrow_file_with_corrupt_offsets_is_a_clear_error_not_a_crash(tmp_path):
    """Arrow IPC batches were used unvalidated: string offsets pointing past the data made
    to_pylist read outside the memory map (SIGBUS: the whole process died)."""
    _arrow_stream_with_bad_offsets(tmp_path / "bad.arrow")
    script = ("import sys; from slipstream.data.prepare import prepare_dataset\n"
              "prepare_dataset([sys.argv[1]], 'byte', sys.argv[2], num_workers=1, progress=False)")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "bad.arrow"), str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 1, (proc.returncode, proc.stderr[-2000:])
    assert "UserError" in proc.stderr and "bad.arrow: not a readable Arrow file" in proc.stderr, proc.stderr[-2000:]
    assert not (tmp_path / "out").exists()


def test_truncated_zstd_jsonl_is_reported_as_truncated(tmp_path):
    """A .jsonl.zst cut short was read as if it ended there: the documents after the cut
    vanished silently (cut at a line end) or the last line was blamed as bad JSON."""
    zstandard = pytest.importorskip("zstandard")
    lines = [json.dumps({"text": f"document number {i} " * 20}) + "\n" for i in range(2000)]
    whole = zstandard.ZstdCompressor().compress("".join(lines).encode())
    # Two frames back to back are one stream; a frame cut short is not.
    two = whole + zstandard.ZstdCompressor().compress(b'{"text": "after"}\n')
    (tmp_path / "two.jsonl.zst").write_bytes(two)
    assert len(list(iter_documents([str(tmp_path / "two.jsonl.zst")]))) == 2001
    (tmp_path / "cut.jsonl.zst").write_bytes(whole[:-1])
    with pytest.raises(UserError, match=r"cut\.jsonl\.zst: zstandard data is corrupt or truncated"):
        list(iter_documents([str(tmp_path / "cut.jsonl.zst")]))
    # A cut where the decompressed data ends exactly at a line end: nothing hints at it but the frame.
    one_line = zstandard.ZstdCompressor().compress(b'{"text": "a"}\n' * 5000)
    for cut in range(len(one_line) - 1, len(one_line) - 12, -1):
        (tmp_path / "c.jsonl.zst").write_bytes(one_line[:cut])
        with pytest.raises(UserError, match="truncated"):
            list(iter_documents([str(tmp_path / "c.jsonl.zst")]))


def test_zstd_bomb_reads_in_bounded_memory(tmp_path):
    """The truncation check must not give up the streaming bound: a tiny .zst that expands
    to 1 GiB of blank lines (1 MiB each) is read without holding it."""
    zstandard = pytest.importorskip("zstandard")
    cctx = zstandard.ZstdCompressor(level=3)
    with open(tmp_path / "bomb.jsonl.zst", "wb") as f, cctx.stream_writer(f) as w:
        block = (b" " * ((1 << 20) - 1) + b"\n") * 16
        for _ in range(64):
            w.write(block)
    assert (tmp_path / "bomb.jsonl.zst").stat().st_size < 1 << 20
    script = (HWM + "import sys; from slipstream.data.sources import iter_documents\n"
              "from slipstream.errors import UserError\n"
              "base = hwm()\n"
              "try:\n    list(iter_documents([sys.argv[1]]))\nexcept UserError as e:\n    print('empty' if 'empty corpus' in str(e) else e)\n"
              "print((hwm() - base) >> 10)")
    proc = subprocess.run([sys.executable, "-c", script, str(tmp_path / "bomb.jsonl.zst")], capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    said, growth_mib = proc.stdout.split()
    assert said == "empty" and int(growth_mib) < 200, proc.stdout


def test_output_folder_inside_an_input_folder_is_refused(tmp_path):
    """`--input data --out data/tokens`: the second prepare read the first one's
    manifest.json as a training document (and the inputs never looked unchanged)."""
    (tmp_path / "data").mkdir()
    for i in range(3):
        (tmp_path / "data" / f"f{i}.txt").write_text(f"hello text file {i}")
    with pytest.raises(UserError, match=r"output folder .*tokens.* lies inside the input folder .*data.*outside the inputs"):
        prepare([tmp_path / "data"], tmp_path / "data" / "tokens")
    assert not (tmp_path / "data" / "tokens").exists()
    assert sorted(os.listdir(tmp_path / "data")) == ["f0.txt", "f1.txt", "f2.txt"]
    # Next to it is fine.
    assert prepare([tmp_path / "data"], tmp_path / "tokens", val_fraction=0)["documents"] == 3


def test_an_unreachable_store_mid_run_keeps_the_finished_units(tmp_path, monkeypatch):
    """A read that could not reach its store (network, credentials) after hours of
    tokenizing deleted the work folder with every finished unit: the inputs had not
    changed, so running the same command again must resume, not start over."""
    import slipstream.data.formats as formats
    import slipstream.data.prepare_units as units_mod

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(12):
        pq.write_table(pa.table({"text": [f"file {i} doc {j} " + "x" * (40 + j) for j in range(30)]}), folder / f"{i:02d}.parquet")
    reference = prepare([folder], tmp_path / "ref")
    read, calls = formats._iter_parquet, []

    def flaky(path, *args):
        calls.append(path)
        if len(calls) == 6:
            raise ConnectionError("connection reset by peer")
        yield from read(path, *args)

    monkeypatch.setattr(formats, "_iter_parquet", flaky)
    with pytest.raises(UserError, match=r"cannot be reached.*finished units are kept.*run the same command again"):
        prepare([folder], tmp_path / "out")
    monkeypatch.undo()
    assert not (tmp_path / "out").exists()
    (work,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.prepare-")]
    assert len((work / "journal.jsonl").read_text().splitlines()) >= 2

    redone = []
    run_unit = units_mod.run_unit
    monkeypatch.setattr(units_mod, "run_unit", lambda tok, dtype, w, index, *a: redone.append(index) or run_unit(tok, dtype, w, index, *a))
    m = prepare([folder], tmp_path / "out")
    assert len(redone) < m["units"] and not work.exists()
    assert m["splits"] == reference["splits"]
    # A bad input is not transient: its work folder goes (the input must change to fix it).
    (folder / "05.parquet").write_bytes(b"PAR1 not parquet")
    with pytest.raises(UserError, match="not a readable Parquet") as e:
        prepare([folder], tmp_path / "out2")
    assert "kept" not in str(e.value) and [p for p in tmp_path.iterdir() if p.name.startswith(".out2.")] == []


def test_datasets_folders_inside_a_plain_folder_are_read_as_datasets(tmp_path):
    """A folder holding `datasets` folders (save_to_disk) was walked file by file: each
    state.json and dataset_info.json became a training document, and a DatasetDict's test
    split (and any cache-*.arrow that `.map` left) was read as training text."""
    datasets = pytest.importorskip("datasets")
    root = tmp_path / "corpus"
    root.mkdir()
    (root / "a.txt").write_text("plain text first")
    datasets.Dataset.from_dict({"text": ["web one", "web two"]}).save_to_disk(str(root / "web"))
    table = pa.table({"text": ["left by map"]})
    with pa.OSFile(str(root / "web" / "cache-0123.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["dd train"]}),
                          "test": datasets.Dataset.from_dict({"text": ["dd test"]})}).save_to_disk(str(root / "wiki"))
    (root / "z.txt").write_text("plain text last")
    want = ["plain text first", "web one", "web two", "dd train", "plain text last"]
    assert list(iter_documents([str(root)])) == want
    m = prepare([root], tmp_path / "out", val_fraction=0)
    assert m["documents"] == 5
    tokens = all_tokens(tmp_path / "out", m)
    assert tokens.tolist() == [t for w in want for t in list(w.encode()) + [256]]


def test_a_state_json_that_is_not_a_datasets_file_is_text(tmp_path):
    """A code corpus has its own state.json files: only one with the datasets library's
    fields makes a folder a `datasets` folder (an invalid one crashed with a JSON error)."""
    root = tmp_path / "code"
    (root / "app").mkdir(parents=True)
    (root / "state.json").write_text('{"theme": "dark"}')
    (root / "app" / "state.json").write_text("{not json")
    (root / "app" / "main.py").write_text("print('hi')")
    docs = list(iter_documents([str(root)]))
    assert docs == ["print('hi')", "{not json", '{"theme": "dark"}']


def test_a_line_over_the_cap_in_a_later_byte_range_names_where_it_is(tmp_path, monkeypatch):
    """A JSONL cut into byte ranges counts lines from the range's start: a too-long line in
    a later range was reported as "line 1" (or some small number) of the file."""
    from slipstream.data.formats import SourceStats, iter_piece, plan_pieces

    monkeypatch.setenv("SLIPSTREAM_MAX_DOCUMENT_BYTES", "4096")
    small = "".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(200))
    big = json.dumps({"text": "x" * 10000}) + "\n"
    (tmp_path / "a.jsonl").write_text(small + big)
    pieces = plan_pieces([str(tmp_path / "a.jsonl")], "text", range_bytes=1024)
    assert len(pieces) > 2
    with pytest.raises(UserError, match=rf"a\.jsonl, the line at byte {len(small)} is longer than the 4KiB limit"):
        for p in pieces:
            list(iter_piece(p, "text", SourceStats()))
    with pytest.raises(UserError, match=rf"a\.jsonl, line 201 is longer than"):
        list(iter_piece(plan_pieces([str(tmp_path / "a.jsonl")], "text", range_bytes=1 << 20)[0], "text", SourceStats()))


def test_invalid_utf8_in_a_string_column_is_replaced_and_counted(tmp_path):
    """Parquet/Arrow string columns are not checked for UTF-8 when read: a bad byte raised a
    bare UnicodeDecodeError (a traceback naming no file). Text files and JSONL replace such
    bytes with U+FFFD and count them; columns now do the same."""
    arr = pa.array([b"ok text", b"bad \xff\xfe bytes", None], pa.binary()).view(pa.string())
    table = pa.table({"text": arr})
    pq.write_table(table, tmp_path / "bad.parquet")
    with pa.OSFile(str(tmp_path / "bad.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table)
    pq.write_table(pa.table({"prompt": arr, "completion": arr}), tmp_path / "sft.parquet")
    for name in ("bad.parquet", "bad.arrow"):
        assert list(iter_documents([str(tmp_path / name)])) == ["ok text", "bad \ufffd\ufffd bytes"]
        m = prepare([tmp_path / name], tmp_path / f"out-{name}", val_fraction=0)
        assert m["documents"] == 2 and m["replaced_chars"] == 2
    m = prepare([tmp_path / "sft.parquet"], tmp_path / "out-sft", val_fraction=0)
    assert m["documents"] == 2 and m["replaced_chars"] == 4 and m["loss_mask"]


@pytest.mark.skipif(not os.path.isdir("/dev/shm") or os.stat("/dev/shm").st_dev == os.stat("/tmp").st_dev,
                    reason="needs /dev/shm on another filesystem than /tmp")
def test_an_output_folder_that_is_a_symlink_to_another_filesystem(tmp_path):
    """The work folder was made next to the symlink, not next to the folder it points to:
    moving the finished shards in crossed filesystems (EXDEV, a bare OSError)."""
    import tempfile

    (tmp_path / "a.txt").write_text("some text to prepare " * 20)
    with tempfile.TemporaryDirectory(dir="/dev/shm") as target:
        (tmp_path / "out").symlink_to(target)
        m = prepare([tmp_path / "a.txt"], tmp_path / "out")
        assert (Path(target) / "manifest.json").exists() and m["documents"] == 1
        m = prepare([tmp_path / "a.txt"], tmp_path / "out", dedup=True)  # re-prepared in place
        assert m["dedup"] and (tmp_path / "out").is_symlink()
        assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []
        assert [p for p in os.listdir("/dev/shm") if ".prepare-" in p] == []


def test_only_work_folders_of_this_output_are_removed_as_stale(tmp_path):
    """Stale work folders were found by the prefix `.NAME.prepare-`: a folder of the user's
    (or another output's work folder, `.NAME.prepare-x.prepare-<hash>`) was deleted too."""
    (tmp_path / "a.txt").write_text("some text to prepare " * 20)
    keep = [tmp_path / ".out.prepare-notes", tmp_path / ".out.prepare-x.prepare-0123456789abcdef"]
    for folder in keep:
        folder.mkdir()
        (folder / "mine.txt").write_text("do not delete")
    prepare([tmp_path / "a.txt"], tmp_path / "out")
    for folder in keep:
        assert (folder / "mine.txt").read_text() == "do not delete" and not (folder / ".lock").exists()


def test_dedup_masks_and_the_val_split_against_a_reference(tmp_path):
    """Tokens and loss masks of a mixed SFT/plain corpus with many duplicates, deduplicated,
    cut into train/val over several units and shards, equal what a direct computation
    gives, the val split starts on a document boundary, whatever the number of workers."""
    rng = np.random.default_rng(0)
    records = []
    for _ in range(300):
        j = int(rng.integers(50))
        records.append({"prompt": f"Q{j}: " + "p" * (j % 7), "completion": f" A{j}" + "c" * (j % 5)}
                       if rng.random() < 0.5 else {"text": f"plain {j} " + "t" * (j % 9)})
    (tmp_path / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    seen, want_tokens, want_mask, starts = set(), [], [], []
    for r in records:
        key = json.dumps(r, sort_keys=True)
        if key in seen:
            continue
        seen.add(key)
        starts.append(len(want_tokens))
        prompt, target = (r["prompt"], r["completion"]) if "prompt" in r else ("", r["text"])
        want_tokens += list(prompt.encode()) + list(target.encode()) + [256]
        want_mask += [0] * len(prompt.encode()) + [1] * (len(target.encode()) + 1)
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        m = prepare([tmp_path / "a.jsonl"], out, num_workers=workers, dedup=True, shard_tokens=333, val_fraction=0.2)
        assert m["units"] > 4 and m["dropped_duplicates"] == len(records) - len(seen)
        shards = [s for split in ("train", "val") for s in m["splits"][split]["shards"]]
        tokens = np.concatenate([np.fromfile(out / s["file"], dtype=np.uint16) for s in shards])
        mask = np.concatenate([np.fromfile(out / s["mask_file"], dtype=np.uint8) for s in shards])
        assert tokens.tolist() == want_tokens and mask.tolist() == want_mask
        train = m["splits"]["train"]["tokens"]
        assert train in starts and m["splits"]["val"]["documents"] == len(starts) - starts.index(train) > 0


def test_a_glob_url_reads_the_files_it_matches(tmp_path):
    """`hf://datasets/.../data/*.parquet`, `s3://bucket/prefix/part-*.jsonl.gz`: how remote
    corpora are named; a glob URL was taken as a literal name ("does not exist")."""
    import fsspec

    fs = fsspec.filesystem("memory")
    try:
        for i in (2, 0, 1):
            fs.pipe(f"/globbed/data/part-{i}.jsonl", (json.dumps({"text": f"doc {i}"}) + "\n").encode())
        fs.pipe("/globbed/data/README.md", b"not a part")
        fs.pipe("/globbed/data/sub/part-9.jsonl", b'{"text": "deeper"}\n')
        url = "memory://globbed/data/part-*.jsonl"
        assert list(iter_documents([url])) == ["doc 0", "doc 1", "doc 2"]
        m = prepare([url], tmp_path / "out", val_fraction=0)
        assert m["documents"] == 3 and m["inputs"]["inputs"][0]["files"] == 3
        assert list(iter_documents(["memory://globbed/data/**/*.jsonl"]))[-1] == "deeper"
        with pytest.raises(UserError, match=r"memory://globbed/data/\*\.parquet.* matches no file"):
            prepare(["memory://globbed/data/*.parquet"], tmp_path / "none")
    finally:
        fs.rm("/globbed", recursive=True)


def test_a_torn_journal_line_does_not_swallow_the_next_entry(tmp_path, monkeypatch):
    """kill -9 mid-append leaves a journal line without its newline; the next run's first
    entry was appended onto it, so that unit was lost (redone) at every later resume."""
    import slipstream.data.prepare_units as units_mod

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(10):
        (folder / f"{i}.txt").write_text(f"text file {i} " * 200)  # one unit each
    run_unit = units_mod.run_unit

    def stop_after(n):
        ran = []

        def run(tok, dtype, work, index, *args):
            if len(ran) == n:
                raise KeyboardInterrupt
            ran.append(index)
            return run_unit(tok, dtype, work, index, *args)
        return run

    monkeypatch.setattr(units_mod, "run_unit", stop_after(3))
    with pytest.raises(KeyboardInterrupt):
        prepare([folder], tmp_path / "out")
    (work,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.prepare-")]
    with open(work / "journal.jsonl", "a") as f:
        f.write('{"unit": 7, "tok')  # torn by a kill
    monkeypatch.setattr(units_mod, "run_unit", stop_after(2))
    with pytest.raises(KeyboardInterrupt):
        prepare([folder], tmp_path / "out")
    itemsize, n_units = 2, 10
    assert len(units_mod.read_journal(str(work), n_units, itemsize, False)) == 5


def test_a_jsonl_file_starting_with_a_utf8_bom(tmp_path):
    """Windows tools (PowerShell's Out-File, Notepad) start UTF-8 files with a BOM: line 1
    was refused as "not valid JSON". A BOM at the start of the file is not part of it."""
    lines = b'\xef\xbb\xbf{"text": "bom first"}\n{"text": "second"}\n'
    (tmp_path / "a.jsonl").write_bytes(lines)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(lines))
    for name in ("a.jsonl", "b.jsonl.gz"):
        assert list(iter_documents([str(tmp_path / name)])) == ["bom first", "second"]
    (tmp_path / "c.jsonl").write_bytes(b'{"text": "x"}\n\xef\xbb\xbf{"text": "y"}\n')  # not at the start: still an error
    with pytest.raises(UserError, match=r"c\.jsonl, line 2: not valid JSON"):
        list(iter_documents([str(tmp_path / "c.jsonl")]))


def test_a_journal_entry_whose_part_files_are_damaged_is_redone(tmp_path, monkeypatch):
    """Resume keeps a journaled unit only with all its part files at the recorded sizes: a
    truncated .tok, a missing .len or a missing .mask (fine-tuning records) means redo it."""
    import slipstream.data.prepare_units as units_mod

    folder = tmp_path / "in"
    folder.mkdir()
    for i in range(8):
        rows = [{"prompt": f"q{i}.{j} " * 20, "completion": f"a{i}.{j} " * 20} for j in range(8)]
        (folder / f"{i}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    reference = prepare([folder], tmp_path / "ref")
    run_unit, ran = units_mod.run_unit, []

    def stop_after_four(tok, dtype, work, index, *args):
        if len(ran) == 4:
            raise KeyboardInterrupt
        ran.append(index)
        return run_unit(tok, dtype, work, index, *args)

    monkeypatch.setattr(units_mod, "run_unit", stop_after_four)
    with pytest.raises(KeyboardInterrupt):
        prepare([folder], tmp_path / "out")
    (work,) = [p for p in tmp_path.iterdir() if p.name.startswith(".out.prepare-")]
    a, b, c, d = ran
    tok = work / f"unit_{a:06d}.tok"
    tok.write_bytes(tok.read_bytes()[:-2])
    (work / f"unit_{b:06d}.len").unlink()
    (work / f"unit_{c:06d}.mask").unlink()
    redone = []
    monkeypatch.setattr(units_mod, "run_unit", lambda tok, dtype, w, index, *x: redone.append(index) or run_unit(tok, dtype, w, index, *x))
    m = prepare([folder], tmp_path / "out")
    assert sorted(redone) == sorted(set(range(m["units"])) - {d})
    assert m["splits"] == reference["splits"] and m["loss_mask"]


BIG_ROWS = HWM + """
import sys, tracemalloc
from slipstream.data.formats import SourceStats, iter_piece, plan_pieces
pieces = plan_pieces([sys.argv[1]], "text", 1 << 30)
base = hwm()
tracemalloc.start()
n = 0
for piece in pieces:
    for record in iter_piece(piece, "text", SourceStats()):
        n += len(record)
print(n, (hwm() - base) >> 10, tracemalloc.get_traced_memory()[1] >> 20)
"""


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_big_rows_are_read_a_few_at_a_time(tmp_path, kind):
    """Records were read BATCH_ROWS (256) rows at a time whatever their size: a row group of
    4 MiB documents (books, whole repositories) put 256 of them (1 GiB, twice over as Python
    strings) in memory at once. Batches are now bounded in bytes too."""
    rng = np.random.default_rng(0)
    doc = rng.integers(97, 123, size=4 << 20, dtype=np.uint8).tobytes().decode()
    table = pa.table({"text": [doc[i:] + doc[:i] for i in range(64)]})  # 256 MiB in one row group
    path = tmp_path / f"big.{kind}"
    if kind == "parquet":
        # One page per document (a writer that puts all in one page or dictionary leaves any reader no choice).
        pq.write_table(table, path, row_group_size=64, compression="none", use_dictionary=False, write_batch_size=1)
    else:
        with pa.OSFile(str(path), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
            w.write_table(table)
    del table, doc
    proc = subprocess.run([sys.executable, "-c", BIG_ROWS, str(path)], capture_output=True, text=True, timeout=300,
                          env=dict(os.environ, PYTHONPATH=str(ROOT / "src")))
    assert proc.returncode == 0, proc.stderr[-2000:]
    chars, growth_mib, python_peak_mib = map(int, proc.stdout.split())
    assert chars == 64 * (4 << 20), proc.stdout
    # The Python strings (tracemalloc) at most a few documents; for Parquet also the whole
    # process (the Arrow file is memory-mapped: the pages it touches count as resident).
    assert python_peak_mib < 64 and (kind == "arrow" or growth_mib < 160), proc.stdout
