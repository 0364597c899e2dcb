"""Bounded readers: a file from outside (trace, data, HF folder, tokenizer, checkpoint JSON)
that is huge, a gzip bomb or nested without end ends in one clear error within seconds,
under a 4 GiB address-space limit, and changes nothing.

Huge inputs are sparse files (10 GiB that take no disk) or multi-member gzip files (10 MB
that decompress to ~10 GiB), so building them is instant. The second half unit-tests
slipstream.safe_read itself."""

from __future__ import annotations

import gzip
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from slipstream import safe_read
from slipstream.errors import UserError
from slipstream.safe_read import Cap, JsonStream

from .conftest import ROOT, assert_unchanged, assert_user_error, tree_snapshot

MEMORY_LIMIT = 4 << 30
TIMEOUT = 180  # generous for a loaded 2-core machine: each case takes seconds alone
HUGE = 10 << 30
TINY = ["--model.preset=tiny", "--train.micro_batch_size=2", "--train.seq_len=16", "--optim.warmup_steps=1",
        "--logging.progress=false", "--train.eval_steps=0", "--checkpoint.async_save=false"]

# Runs `python -m slipstream ARGS` (or, with SLIPSTREAM_TEST_CODE, that Python code, printing a
# UserError as the CLI does) under an address-space limit: a reader that allocates without bound
# dies with MemoryError instead of eating the machine.
_LIMITED = textwrap.dedent("""
    import os, resource, runpy, sys
    resource.setrlimit(resource.RLIMIT_AS, ({limit}, {limit}))
    code = os.environ.get("SLIPSTREAM_TEST_CODE")
    if code:
        from slipstream.errors import UserError
        try:
            exec(code)
        except UserError as e:
            print(f"error: {{e}}", file=sys.stderr)
            sys.exit(2)
        sys.exit(0)
    sys.argv = ["slipstream", *sys.argv[1:]]
    runpy.run_module("slipstream", run_name="__main__")
""").format(limit=MEMORY_LIMIT)


def run_limited(*args, cwd, env_extra=None, code=None, timeout=TIMEOUT):
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="2", **(env_extra or {}))
    if code:
        env["SLIPSTREAM_TEST_CODE"] = code
    return subprocess.run([sys.executable, "-c", _LIMITED, *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def sparse(path, size=HUGE, head=b""):
    """A file of `size` bytes that starts with `head` and is a hole (zeros) after it."""
    with open(path, "wb") as f:
        f.write(head)
        f.truncate(size)
    return path


def snapshot(root):
    """tree_snapshot, but a file over 64 MiB (a sparse giant) is compared by size and mtime:
    hashing 10 GiB of zeros would take minutes."""
    big = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file() and p.stat().st_size > 64 << 20]
    snap = tree_snapshot(root, exclude=tuple(big))
    snap.update({rel: f"{(root / rel).stat().st_size} {(root / rel).stat().st_mtime_ns}" for rel in big})
    return snap


def gzip_bomb(path, head=b"", fill=b"\0", members=150):
    """~10 MB of gzip that decompresses to `head` + ~150 * 64 MiB of `fill`."""
    block = gzip.compress(fill * ((64 << 20) // len(fill)), compresslevel=9)
    with open(path, "wb") as f:
        f.write(gzip.compress(head))
        for _ in range(members):
            f.write(block)
    return path


def deep(n=100_000):
    return "[" * n + "]" * n


# ---------------------------------------------------------------------------- doctor --trace


def _small_trace(steps=3):
    events = [{"ph": "M", "name": "process_name", "pid": 1, "args": {"name": "python"}}]
    for s in range(steps):
        t0 = 1000.0 * s
        events.append({"ph": "X", "cat": "user_annotation", "name": f"ProfilerStep#{s}", "pid": 1, "tid": 1,
                       "ts": t0, "dur": 900.0})
        for k in range(4):
            events.append({"ph": "X", "cat": "cpu_op", "name": "aten::mm", "pid": 1, "tid": 1,
                           "ts": t0 + 10 + 200 * k, "dur": 150.0, "args": {"Input Dims": [[8, 8], [8, 8]]}})
    return {"schemaVersion": 1, "distributedInfo": {"rank": 0}, "traceEvents": events, "traceName": "x"}


def test_doctor_on_a_gzip_of_zeros_stops_at_once(tmp_path):
    bomb = gzip_bomb(tmp_path / "rank0.json.gz")
    before = snapshot(tmp_path)
    proc = run_limited("doctor", "--trace", bomb, cwd=tmp_path)
    assert_user_error(proc, str(bomb), "not a chrome trace")
    assert_unchanged(before, snapshot(tmp_path))


def test_doctor_on_a_gzip_bomb_of_json_stops_at_the_cap(tmp_path):
    bomb = gzip_bomb(tmp_path / "rank0.json.gz", head=b'{"traceEvents": [0', fill=b",0")
    before = snapshot(tmp_path)
    proc = run_limited("doctor", "--trace", bomb, cwd=tmp_path)
    assert_user_error(proc, str(bomb), "decompresses to more than the 2GiB limit", "--max-trace-bytes")
    assert_unchanged(before, snapshot(tmp_path))


@pytest.mark.parametrize("text", [deep(), '{"traceEvents": [' + deep() + "]}",
                                  '{"deviceProperties": ' + deep() + ', "traceEvents": []}'],
                         ids=["bare", "in-events", "in-metadata"])
def test_doctor_on_deep_nesting(tmp_path, text):
    trace = tmp_path / "rank0.json"
    trace.write_text(text)
    before = snapshot(tmp_path)
    proc = run_limited("doctor", "--trace", trace, cwd=tmp_path)
    assert_user_error(proc, str(trace), "nested more than 100 levels")
    assert_unchanged(before, snapshot(tmp_path))


def test_doctor_on_a_huge_plain_trace_and_the_flag(tmp_path):
    trace = sparse(tmp_path / "rank0.json", head=b'{"traceEvents": [')
    proc = run_limited("doctor", "--trace", trace, cwd=tmp_path)
    assert_user_error(proc, str(trace), "is 10GiB, over the 2GiB limit for a trace", "--max-trace-bytes 4GiB")
    small = tmp_path / "small.json"
    small.write_text(json.dumps(_small_trace()))
    proc = run_limited("doctor", "--trace", small, "--max-trace-bytes", "100", cwd=tmp_path)
    assert_user_error(proc, str(small), "over the 100B limit for a trace")


@pytest.mark.parametrize("zipped", [False, True])
def test_doctor_on_a_valid_small_trace_still_works(tmp_path, zipped):
    data = json.dumps(_small_trace(), indent=1).encode()
    trace = tmp_path / ("rank0.json.gz" if zipped else "rank0.json")
    trace.write_bytes(gzip.compress(data) if zipped else data)
    proc = run_limited("doctor", "--trace", trace, "--json", cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    report = json.loads(proc.stdout)
    assert report["trace_files"] == [str(trace)]
    assert report["traces"][0]["step_us"] == 900.0 and report["traces"][0]["compute_us"] == 600.0


# ---------------------------------------------------------------------------- checkpoints


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, data_dir):
    """The final checkpoint folder of a finished 2-step tiny run."""
    work = tmp_path_factory.mktemp("ckpt")
    proc = run_limited("train", *TINY, f"--data.dir={data_dir}", "--run.dir=run", "--train.max_steps=2", cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (found,) = sorted((work / "run" / "checkpoints").glob("step_*"))
    return found


def _spoil(checkpoint, tmp_path, name, how):
    ckpt = tmp_path / checkpoint.name
    shutil.copytree(checkpoint, ckpt)
    target = ckpt / name
    target.unlink()
    if how == "huge":
        sparse(target, head=b'{"format_version": 2, "x": "')
    else:
        target.write_text('{"format_version": 2, "x": ' + deep() + "}")
    return ckpt, target


@pytest.mark.parametrize("how", ["huge", "deep"])
@pytest.mark.parametrize("name", ["meta.json", "manifest.json"])
def test_checkpoint_with_bad_json(checkpoint, tmp_path, name, how):
    ckpt, target = _spoil(checkpoint, tmp_path, name, how)
    message = ("is 10GiB, over the 16MiB limit for a checkpoint JSON file" if how == "huge"
               else "nested more than 100 levels")
    before = snapshot(tmp_path)
    # inspect reports a checkpoint it cannot read as failing its integrity check: exit 1.
    proc = run_limited("checkpoint", "inspect", ckpt, cwd=tmp_path)
    line = assert_user_error(proc, str(target), message, code=1)
    assert "did not pass its integrity check" in line
    if how == "huge":
        assert "SLIPSTREAM_MAX_CHECKPOINT_JSON_BYTES=32MiB" in line
    if name == "meta.json":  # export reads meta.json itself (a bad manifest fails the same check as above)
        proc = run_limited("checkpoint", "export", ckpt, "--format", "torch", "--out", "exported", cwd=tmp_path)
        assert_user_error(proc, str(target), message)
    assert_unchanged(before, snapshot(tmp_path))


# ---------------------------------------------------------------------------- data prepare


@pytest.mark.parametrize("kind", ["giant-line", "deep-line", "huge-text"])
def test_data_prepare_on_bad_inputs(tmp_path, kind):
    if kind == "giant-line":
        source, message = sparse(tmp_path / "in.jsonl", head=b'{"text": "'), "line 1 is longer than the 1GiB limit"
    elif kind == "deep-line":
        source = tmp_path / "in.jsonl"
        source.write_text('{"text": "ok"}\n{"text": "x", "meta": ' + deep() + "}\n")
        message = "line 2: JSON nested more than 100 levels"
    else:
        source = sparse(tmp_path / "in.txt", head=b"hello world\n" * 1000)
        message = "is 10GiB, over the 1GiB limit for a document"
    before = snapshot(tmp_path)
    proc = run_limited("data", "prepare", "--input", source, "--out", "prepared", "--workers", "1", "--quiet",
                       cwd=tmp_path)
    assert_user_error(proc, str(source), message)
    assert_unchanged(before, snapshot(tmp_path))


def test_huge_tokenizer_file(tmp_path, corpus_file):
    tok = sparse(tmp_path / "tok.json", head=b'{"version": "1.0", "x": "')
    before = snapshot(tmp_path)
    proc = run_limited("data", "prepare", "--input", corpus_file, "--tokenizer", f"bpe:{tok}", "--out", "prepared",
                       "--workers", "1", "--quiet", cwd=tmp_path)
    assert_user_error(proc, str(tok), "over the 256MiB limit for a tokenizer file", "SLIPSTREAM_MAX_TOKENIZER_BYTES")
    assert_unchanged(before, snapshot(tmp_path))


def test_deep_tokenizer_file_is_a_user_error(tmp_path, corpus_file):
    tok = tmp_path / "tok.json"
    tok.write_text('{"version": "1.0", "model": ' + deep() + "}")
    proc = run_limited("data", "prepare", "--input", corpus_file, "--tokenizer", f"bpe:{tok}", "--out", "prepared",
                       "--workers", "1", "--quiet", cwd=tmp_path)
    assert_user_error(proc, str(tok), "not a valid Hugging Face tokenizers JSON file")


def test_huge_data_manifest(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    manifest = sparse(folder / "manifest.json", head=b'{"format": "slipstream-tokens", "x": "')
    before = snapshot(tmp_path)
    proc = run_limited("data", "verify", "--dir", folder, cwd=tmp_path)
    assert_user_error(proc, str(manifest), "over the 64MiB limit for a data manifest")
    assert_unchanged(before, snapshot(tmp_path))


# ---------------------------------------------------------------------------- HF folders
# No command reads an HF folder: the Python API (from_hf) is the reader, run the same way.


def _hf_folder(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    return folder


@pytest.mark.parametrize("case", ["huge-config", "deep-config", "deep-index"])
def test_hf_folder_with_huge_or_deep_json(tmp_path, case):
    folder = _hf_folder(tmp_path)
    if case == "huge-config":
        target = sparse(folder / "config.json", head=b'{"model_type": "gpt2", "x": "')
        message = "is 10GiB, over the 16MiB limit for a Hugging Face JSON file"
    elif case == "deep-config":
        target = folder / "config.json"
        target.write_text('{"model_type": "gpt2", "x": ' + deep() + "}")
        message = "nested more than 100 levels"
    else:
        target = folder / "model.safetensors.index.json"
        target.write_text('{"weight_map": ' + deep(500) + "}")
        message = "nested more than 100 levels"
    before = snapshot(tmp_path)
    proc = run_limited(cwd=tmp_path, code=f"from slipstream.models import from_hf; from_hf({str(folder)!r})")
    assert_user_error(proc, str(target), message)
    assert_unchanged(before, snapshot(tmp_path))


def test_hf_folder_with_malformed_files(tmp_path):
    from slipstream.models import from_hf

    folder = _hf_folder(tmp_path)
    (folder / "config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="config.json holds a JSON list, not an object"):
        from_hf(folder)
    folder = _hf_folder(tmp_path / "escaping")
    (folder / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"w": "../secret.safetensors"}}))
    with pytest.raises(UserError, match="must map weight names to file names inside"):
        from_hf(folder)
    folder = _hf_folder(tmp_path / "bad")
    sparse(folder / "model.safetensors", size=1 << 20, head=(10**12).to_bytes(8, "little"))  # header "1 TB"
    with pytest.raises(UserError, match="model.safetensors is not a valid safetensors file"):
        from_hf(folder)


# ---------------------------------------------------------------------------- safe_read units

CAP = Cap("test file", 1000, "SLIPSTREAM_TEST_MAX_BYTES")


def test_parse_size_and_env_override(monkeypatch):
    assert safe_read.parse_size("1048576", "x") == 1 << 20
    assert safe_read.parse_size("512MiB", "x") == 512 << 20
    assert safe_read.parse_size("2g", "x") == 2 << 30
    assert safe_read.parse_size("1.5 GiB", "x") == 3 << 29
    for bad in ("", "lots", "-1", "0", "1.5XB"):
        with pytest.raises(UserError, match="not a size"):
            safe_read.parse_size(bad, "x")
    assert CAP.limit == 1000
    monkeypatch.setenv("SLIPSTREAM_TEST_MAX_BYTES", "2KiB")
    assert CAP.limit == 2048
    assert CAP.with_limit(5).limit == 5 and CAP.with_limit(None) is CAP
    assert safe_read.human_size(3 << 29) == "1.5GiB" and safe_read.human_size(999) == "999B"


def test_read_bytes_capped(tmp_path):
    plain = tmp_path / "a.bin"
    plain.write_bytes(b"x" * 1000)
    assert safe_read.read_bytes_capped(plain, CAP) == b"x" * 1000
    plain.write_bytes(b"x" * 1001)
    with pytest.raises(UserError, match=r"a.bin is 1001B, over the 1000B limit for a test file; .*"
                                        r"set SLIPSTREAM_TEST_MAX_BYTES=2KiB to raise the limit"):
        safe_read.read_bytes_capped(plain, CAP)
    gz = tmp_path / "a.gz"
    gz.write_bytes(gzip.compress(b"y" * 1000))
    assert safe_read.read_bytes_capped(gz, CAP, decompress=True) == b"y" * 1000
    assert safe_read.read_bytes_capped(gz, CAP.with_limit(10**6)) == gz.read_bytes()  # not asked to decompress
    gz.write_bytes(gzip.compress(b"y" * 1001))
    with pytest.raises(UserError, match="decompresses to more than the 1000B limit"):
        safe_read.read_bytes_capped(gz, CAP, decompress=True)
    gz.write_bytes(gzip.compress(b"y" * 1000)[:-10])
    with pytest.raises(UserError, match="corrupt or truncated"):
        safe_read.read_bytes_capped(gz, CAP, decompress=True)
    fake = tmp_path / "b.gz"
    fake.write_bytes(b"plain")
    with pytest.raises(UserError, match="not gzip"):
        safe_read.read_bytes_capped(fake, CAP, decompress=True)


def test_read_line_capped():
    f = io.BytesIO(b"a" * 1000 + b"\n" + b"b" * 1001 + b"\n")
    assert safe_read.read_line_capped(f, CAP, "x.jsonl", 1) == b"a" * 1000 + b"\n"
    with pytest.raises(UserError, match="x.jsonl, line 2 is longer than the 1000B limit"):
        safe_read.read_line_capped(f, CAP, "x.jsonl", 2)
    assert safe_read.read_line_capped(io.BytesIO(b"end"), CAP, "x", 1) == b"end"
    assert safe_read.read_line_capped(io.BytesIO(b""), CAP, "x", 1) == b""


def test_loads_bounded_and_depth(tmp_path):
    assert safe_read.json_depth(1) == 0 and safe_read.json_depth([]) == 1
    assert safe_read.json_depth({"a": [1, {"b": []}], "c": {}}) == 4
    assert safe_read.loads_bounded("[" * 100 + "]" * 100, "f") is not None
    for n in (101, 900, 100_000):  # past our limit; near Python's; far past it (RecursionError inside)
        with pytest.raises(UserError, match="f: JSON nested more than 100 levels"):
            safe_read.loads_bounded(deep(n), "f")
    assert safe_read.loads_bounded(b'{"a": "\xc3\xa9"}', "f") == {"a": "\u00e9"}
    with pytest.raises(json.JSONDecodeError, match="not UTF-8"):
        safe_read.loads_bounded(b'{"a": "\xff"}', "f")
    with pytest.raises(json.JSONDecodeError):
        safe_read.loads_bounded("{", "f")
    path = tmp_path / "a.json"
    path.write_text('{"a": 1}')
    assert safe_read.load_json_capped(path, CAP) == {"a": 1}
    with pytest.raises(FileNotFoundError):
        safe_read.load_json_capped(tmp_path / "missing.json", CAP)


def _stream_all(stream):
    """Rebuild a document from the stream's pieces (arrays item by item, objects member by member)."""
    def read():
        if stream.peek() == "{":
            return {key: read() for key in stream.members()}
        return stream.value()

    if stream.peek() == "[":
        doc = list(stream.items())
        stream.finish()
        return doc
    doc = read()
    stream.finish()
    return doc


DOC = {"traceEvents": [{"name": "caf\u00e9 \u2603 \U0001f600", "ts": 12345.678, "dur": 1e-3, "n": -17,
                        "esc": "a\\\"b\n[{", "l": [[], {}, [1, [2, [3]]]], "t": True, "f": False, "z": None}
                       for _ in range(20)] + [123456789, 0.5, "", [], {}],
       "empty": {}, "big": 10 ** 30, "after": [1, 2]}


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64, 1 << 20])
def test_json_stream_matches_json_loads(tmp_path, chunk):
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(DOC, ensure_ascii=False, indent=1), encoding="utf-8")
    assert _stream_all(JsonStream(path, CAP.with_limit(10**6), chunk_bytes=chunk)) == DOC
    gz = tmp_path / "doc.json.gz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    assert _stream_all(JsonStream(gz, CAP.with_limit(10**6), decompress=True, chunk_bytes=chunk)) == DOC
    for top in ([1, 2.5, "x"], [], {}):
        path.write_text(json.dumps(top))
        assert _stream_all(JsonStream(path, CAP, chunk_bytes=chunk)) == top


def test_json_stream_errors(tmp_path):
    path = tmp_path / "doc.json"

    def stream(text, cap=CAP.with_limit(10**6), **kw):
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return JsonStream(path, cap, chunk_bytes=4, **kw)

    with pytest.raises(UserError, match=r"invalid JSON \(.*\); re-export"):
        _stream_all(stream('{"a": [1, 2', hint="; re-export"))
    with pytest.raises(UserError, match="extra data"):
        _stream_all(stream("[1] 2"))
    with pytest.raises(UserError, match="expected a key"):
        _stream_all(stream("{1: 2}"))
    with pytest.raises(UserError, match="binary data at byte 3"):
        _stream_all(stream(b'["a\xff"]'))
    with pytest.raises(UserError, match="nested more than 100 levels"):
        _stream_all(stream(deep()))
    with pytest.raises(UserError, match="one JSON value .* is larger than 10B"):
        _stream_all(stream('["0123456789abcdef"]', max_value_chars=10))
    with pytest.raises(UserError, match="doc.json is 1.2KiB, over the 1000B limit"):  # told by its size
        _stream_all(stream("[" + "0," * 600 + "0]", cap=CAP))
    # Whitespace is read, not kept: a gzip of spaces ends at the cap.
    gz = tmp_path / "spaces.json.gz"
    gz.write_bytes(gzip.compress(b" " * 5000))
    with pytest.raises(UserError, match="decompresses to more than the 1000B limit"):
        JsonStream(gz, CAP, decompress=True, chunk_bytes=64).peek()
    gz.write_bytes(gzip.compress(b"\0" * 500))
    with pytest.raises(UserError, match="not a test doc"):
        JsonStream(gz, CAP, decompress=True, what="test doc")


def test_a_json_number_too_long_to_convert_is_invalid_json_not_a_crash():
    """Python refuses to turn a 5000-digit integer into an int (a ValueError, not a
    JSONDecodeError): every bounded JSON reader reports it as invalid JSON."""
    import json

    from slipstream.safe_read import loads_bounded

    with pytest.raises(json.JSONDecodeError, match="unreadable number"):
        loads_bounded('{"step": ' + "9" * 5000 + "}", "summary.json")
