"""Inputs of `data prepare` beyond text and JSONL: Parquet, Arrow and `datasets` folders,
compressed JSONL, fsspec URLs; fine-tuning records with loss masks; token dtype checks;
dedup; chunk checksums; and the bad-input errors (each a UserError naming the file, with
nothing half-written next to the output)."""

import gzip
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import fsspec
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import slipstream.data.prepare as prep
from slipstream.data.prepare import load_manifest, prepare_dataset, verify_manifest
from slipstream.data.sources import iter_documents
from slipstream.data.tokenizers import EOT_TEXT, ByteTokenizer
from slipstream.errors import UserError

ROOT = Path(__file__).resolve().parents[2]
DOCS = [f"document {i}: " + "abcdefghij"[i % 10] * (20 + i) for i in range(40)]


def tokens_of(out, manifest, split=None, ext="bin", dtype=None):
    splits = [split] if split else ["train", "val"]
    arrays = []
    for s in splits:
        for shard in manifest["splits"][s]["shards"]:
            name = shard["file"] if ext == "bin" else shard["mask_file"]
            arrays.append(np.fromfile(os.path.join(out, name), dtype=dtype or manifest["dtype"]))
    return np.concatenate(arrays) if arrays else np.zeros(0, dtype=dtype or manifest["dtype"])


def expected_text(docs):
    return "".join(d + EOT_TEXT for d in docs)


def prepare(inputs, out, **kw):
    kw.setdefault("progress", False)
    kw.setdefault("num_workers", 1)
    return prepare_dataset([str(i) for i in inputs], "byte", str(out), **kw)


def leftovers(folder):
    return sorted(p for p in os.listdir(folder) if p.startswith("."))


# ----------------------------------------------------------------------------- formats

def test_parquet_file_and_folder_read_row_group_by_row_group(tmp_path):
    pq.write_table(pa.table({"id": list(range(40)), "text": DOCS}), tmp_path / "a.parquet", row_group_size=7)
    m = prepare([tmp_path / "a.parquet"], tmp_path / "one")
    assert ByteTokenizer().decode(tokens_of(tmp_path / "one", m)) == expected_text(DOCS)
    assert m["documents"] == 40 and m["units"] > 1  # row groups are units: a small corpus still spreads
    folder = tmp_path / "pq"
    folder.mkdir()
    pq.write_table(pa.table({"body": DOCS[:20]}), folder / "part-0.parquet", row_group_size=5)
    pq.write_table(pa.table({"body": DOCS[20:]}), folder / "part-1.parquet", row_group_size=5)
    m = prepare([folder], tmp_path / "two", text_field="body", num_workers=2)
    assert ByteTokenizer().decode(tokens_of(tmp_path / "two", m)) == expected_text(DOCS)
    assert m["files"] == 2


def test_datasets_save_to_disk_folders_and_raw_arrow(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": DOCS, "n": list(range(40))}).save_to_disk(str(tmp_path / "ds"))
    assert list(iter_documents([str(tmp_path / "ds")])) == DOCS  # state.json, not dataset_info.json, is read
    dd = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": DOCS[:30]}),
                               "test": datasets.Dataset.from_dict({"text": DOCS[30:]})})
    dd.save_to_disk(str(tmp_path / "dd"))
    m = prepare([tmp_path / "dd"], tmp_path / "out")
    assert ByteTokenizer().decode(tokens_of(tmp_path / "out", m)) == expected_text(DOCS[:30])
    datasets.DatasetDict({"validation": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "nv"))
    with pytest.raises(UserError, match=r"splits \['validation'\] and no 'train'.*nv/validation"):
        prepare([tmp_path / "nv"], tmp_path / "bad")
    # Raw .arrow files: the IPC stream format (as datasets writes) and the IPC file format.
    table = pa.table({"text": DOCS})
    with pa.OSFile(str(tmp_path / "stream.arrow"), "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=6):
            w.write_batch(batch)
    with pa.OSFile(str(tmp_path / "file.arrow"), "wb") as f, pa.ipc.new_file(f, table.schema) as w:
        for batch in table.to_batches(max_chunksize=9):
            w.write_batch(batch)
    for name in ("stream.arrow", "file.arrow"):
        m = prepare([tmp_path / name], tmp_path / f"out-{name}", num_workers=2)
        assert ByteTokenizer().decode(tokens_of(tmp_path / f"out-{name}", m)) == expected_text(DOCS)
        assert m["units"] > 1  # record batches are pieces of their own


def test_compressed_jsonl(tmp_path):
    import zstandard

    lines = "".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode()
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines))
    (tmp_path / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(lines))
    assert list(iter_documents([str(tmp_path / "a.jsonl.gz")])) == DOCS
    assert list(iter_documents([str(tmp_path / "b.jsonl.zst")])) == DOCS
    m = prepare([tmp_path], tmp_path.parent / "cj", num_workers=2)
    assert ByteTokenizer().decode(tokens_of(tmp_path.parent / "cj", m)) == expected_text(DOCS + DOCS)
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines)[:-30])
    with pytest.raises(UserError, match=r"a\.jsonl\.gz: compressed data is corrupt or truncated"):
        list(iter_documents([str(tmp_path / "a.jsonl.gz")]))


def test_fsspec_urls_memory_and_file(tmp_path):
    fs = fsspec.filesystem("memory")
    with fs.open("/corpus/docs/a.jsonl", "wb") as f:
        f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS[:20]).encode())
    buf = pa.BufferOutputStream()
    pq.write_table(pa.table({"text": DOCS[20:]}), buf, row_group_size=8)
    with fs.open("/corpus/docs/b.parquet", "wb") as f:
        f.write(buf.getvalue().to_pybytes())
    try:
        m = prepare(["memory://corpus/docs"], tmp_path / "mem", num_workers=1)
        assert ByteTokenizer().decode(tokens_of(tmp_path / "mem", m)) == expected_text(DOCS)
        assert m["inputs"]["inputs"][0] == {"input": "memory://corpus/docs", "files": 2, "bytes": m["inputs"]["bytes"]}
        single = prepare(["memory://corpus/docs/b.parquet"], tmp_path / "one")
        assert single["documents"] == 20
    finally:
        fs.rm("/corpus", recursive=True)
    (tmp_path / "local").mkdir()
    (tmp_path / "local" / "t.txt").write_text("a text file by URL")
    m = prepare([f"file://{tmp_path / 'local'}"], tmp_path / "viafile")
    assert ByteTokenizer().decode(tokens_of(tmp_path / "viafile", m)) == "a text file by URL" + EOT_TEXT


def test_s3_folder_from_a_local_moto_server(tmp_path, monkeypatch):
    """s3:// through s3fs, credentials and endpoint from the environment as boto reads them;
    the forked pool workers read their units from the store too."""
    s3fs = pytest.importorskip("s3fs")
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        for key, value in dict(AWS_ACCESS_KEY_ID="test", AWS_SECRET_ACCESS_KEY="test", AWS_DEFAULT_REGION="us-east-1",
                               AWS_ENDPOINT_URL=f"http://{host}:{port}").items():
            monkeypatch.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()  # a cached instance would keep another test's settings
        fs = fsspec.filesystem("s3")
        fs.mkdir("bucket")
        with fs.open("bucket/docs/a.jsonl", "wb") as f:
            f.write("".join(json.dumps({"text": d}) + "\n" for d in DOCS).encode())
        buf = pa.BufferOutputStream()
        pq.write_table(pa.table({"text": DOCS}), buf, row_group_size=8)
        with fs.open("bucket/docs/b.parquet", "wb") as f:
            f.write(buf.getvalue().to_pybytes())
        m = prepare(["s3://bucket/docs"], tmp_path / "s3", num_workers=2)
        assert ByteTokenizer().decode(tokens_of(tmp_path / "s3", m)) == expected_text(DOCS + DOCS)
        assert m["units"] > 1 and m["inputs"]["inputs"][0]["files"] == 2
        with pytest.raises(UserError, match=r"does not exist: 's3://bucket/nothing-here'"):
            prepare(["s3://bucket/nothing-here"], tmp_path / "none")
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
        server.stop()


# ----------------------------------------------------------------------------- fine-tuning masks

def test_prompt_completion_records_carry_a_loss_mask(tmp_path):
    rows = [{"prompt": "Q: 2+2?", "completion": " A: 4"}, {"text": "plain document"}, {"prompt": "", "completion": "only answer"}]
    (tmp_path / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    m = prepare([tmp_path / "sft.jsonl"], tmp_path / "out", shard_tokens=10, val_fraction=0.0, chunk_tokens=4)
    out = tmp_path / "out"
    assert m["loss_mask"] is True
    toks, mask = tokens_of(out, m), tokens_of(out, m, ext="mask", dtype=np.uint8)
    assert ByteTokenizer().decode(toks) == "Q: 2+2? A: 4" + EOT_TEXT + "plain document" + EOT_TEXT + "only answer" + EOT_TEXT
    want = [0] * 7 + [1] * 6 + [1] * 15 + [1] * 12
    assert mask.tolist() == want
    for shard in m["splits"]["train"]["shards"]:
        assert shard["mask_file"] == shard["file"].replace(".bin", ".mask")
        data = (out / shard["mask_file"]).read_bytes()
        assert len(data) == shard["tokens"] and hashlib.sha256(data).hexdigest() == shard["mask_sha256"]
    verify_manifest(str(out), checksums=True)
    (out / m["splits"]["train"]["shards"][0]["mask_file"]).write_bytes(b"\1" * 10)
    with pytest.raises(UserError, match="loss-mask file .* sha256"):
        verify_manifest(str(out), checksums=True)
    # Parquet pairs too; plain text alone has no mask files at all.
    pq.write_table(pa.table({"prompt": ["p1", "p2"], "completion": ["c1", "c2"]}), tmp_path / "sft.parquet")
    m = prepare([tmp_path / "sft.parquet"], tmp_path / "pq", val_fraction=0.0)
    assert tokens_of(tmp_path / "pq", m, ext="mask", dtype=np.uint8).tolist() == [0, 0, 1, 1, 1] * 2
    m = prepare([tmp_path / "sft.parquet"], tmp_path / "txt", val_fraction=0.0, text_field="prompt")
    assert m["loss_mask"] is False and not any(p.endswith(".mask") for p in os.listdir(tmp_path / "txt"))


def test_masks_survive_rebuild_in_place(tmp_path):
    (tmp_path / "a.jsonl").write_text(json.dumps({"prompt": "p", "completion": "c"}) + "\n")
    out = tmp_path / "out"
    prepare([tmp_path / "a.jsonl"], out, val_fraction=0.0)
    (tmp_path / "a.jsonl").write_text(json.dumps({"text": "now plain"}) + "\n")
    m = prepare([tmp_path / "a.jsonl"], out, val_fraction=0.0)
    assert m["loss_mask"] is False and sorted(os.listdir(out)) == ["manifest.json", "train_000000.bin"]


# ----------------------------------------------------------------------------- dtype and ids

class WideTokenizer:
    """Byte ids shifted up, so every id needs uint32; optionally one id past the vocabulary."""

    def __init__(self, vocab_size, bad_id=None):
        self.spec, self.fingerprint, self.vocab_size, self.eot_id = f"wide:{vocab_size}", "wide", vocab_size, 0
        self.bad_id = bad_id

    def encode_batch(self, texts):
        return [[70_000 + b for b in t.encode()] + ([self.bad_id] if self.bad_id is not None else []) for t in texts]


def test_uint32_tokens_and_ids_outside_the_vocabulary(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_text("hello")
    monkeypatch.setattr(prep, "get_tokenizer", lambda spec: WideTokenizer(70_300))
    m = prepare([tmp_path / "a.txt"], tmp_path / "wide", val_fraction=0.0)
    assert m["dtype"] == "uint32" and tokens_of(tmp_path / "wide", m).tolist() == [70_000 + b for b in b"hello"] + [0]
    monkeypatch.setattr(prep, "get_tokenizer", lambda spec: WideTokenizer(70_300, bad_id=70_300))
    with pytest.raises(UserError, match=r"tokenizer wide:70300 emitted token id 70300, outside its vocabulary of 70300"):
        prepare([tmp_path / "a.txt"], tmp_path / "bad")
    # An id past uint16 from a tokenizer claiming a small vocabulary is refused, never wrapped.
    monkeypatch.setattr(prep, "get_tokenizer", lambda spec: WideTokenizer(300))
    with pytest.raises(UserError, match=r"emitted token id 70\d\d\d, outside its vocabulary of 300"):
        prepare([tmp_path / "a.txt"], tmp_path / "bad")
    assert leftovers(tmp_path) == [] and not (tmp_path / "bad").exists()


# ----------------------------------------------------------------------------- dedup and chunks

def test_dedup_keeps_first_occurrence_across_units_and_workers(tmp_path):
    docs = DOCS[:10] + DOCS[3:7] + DOCS[:2] + ["fresh"]
    pq.write_table(pa.table({"text": docs[:12]}), tmp_path / "a.parquet", row_group_size=3)
    (tmp_path / "b.jsonl").write_text("".join(json.dumps({"text": d}) + "\n" for d in docs[12:]))
    results = []
    for workers in (1, 2):
        out = tmp_path / f"w{workers}"
        m = prepare([tmp_path / "a.parquet", tmp_path / "b.jsonl"], out, dedup=True, num_workers=workers)
        assert m["dropped_duplicates"] == 6 and m["documents"] == 11 and m["dedup"] is True
        assert ByteTokenizer().decode(tokens_of(out, m)) == expected_text(DOCS[:10] + ["fresh"])
        results.append((m["splits"], tokens_of(out, m).tobytes()))
    assert results[0] == results[1]
    plain = prepare([tmp_path / "a.parquet", tmp_path / "b.jsonl"], tmp_path / "w1", num_workers=1)
    assert plain["documents"] == len(docs) and plain["settings"]["dedup"] is False  # a setting: rebuilt


def test_chunk_checksums(tmp_path):
    (tmp_path / "a.txt").write_text("x" * 1000)
    m = prepare([tmp_path / "a.txt"], tmp_path / "out", shard_tokens=300, chunk_tokens=128, val_fraction=0.0)
    assert m["chunk_tokens"] == 128 and m["settings"]["chunk_tokens"] == 128
    for shard in m["splits"]["train"]["shards"]:
        data = (tmp_path / "out" / shard["file"]).read_bytes()
        want = [hashlib.sha256(data[i:i + 256]).hexdigest() for i in range(0, len(data), 256)]
        assert shard["chunk_sha256"] == want
    rows = [json.dumps({"prompt": "q" * 90, "completion": "a" * 150}) for _ in range(3)]
    (tmp_path / "sft.jsonl").write_text("\n".join(rows) + "\n")
    sft = prepare([tmp_path / "sft.jsonl"], tmp_path / "sft", shard_tokens=300, chunk_tokens=128, val_fraction=0.0)
    for shard in sft["splits"]["train"]["shards"]:  # the mask of a streamed chunk has its own checksum
        bits = (tmp_path / "sft" / shard["mask_file"]).read_bytes()
        assert shard["mask_chunk_sha256"] == [hashlib.sha256(bits[i:i + 128]).hexdigest()
                                              for i in range(0, len(bits), 128)]
    with pytest.raises(UserError, match="chunk_tokens=0"):
        prepare([tmp_path / "a.txt"], tmp_path / "z", chunk_tokens=0)


def test_old_manifest_without_new_fields_still_loads(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    m = prepare([tmp_path / "a.txt"], tmp_path / "out", val_fraction=0.0)
    path = tmp_path / "out" / "manifest.json"
    old = json.loads(path.read_text())
    for key in ("chunk_tokens", "loss_mask", "dedup", "dropped_duplicates", "units"):
        old.pop(key)
    for shard in old["splits"]["train"]["shards"]:
        shard.pop("chunk_sha256")
    path.write_text(json.dumps(old))
    assert load_manifest(str(tmp_path / "out"))["version"] == m["version"] == 1
    verify_manifest(str(tmp_path / "out"), checksums=True)


# ----------------------------------------------------------------------------- bad input

def test_missing_or_non_string_text_column(tmp_path):
    pq.write_table(pa.table({"content": ["a"], "n": [1]}), tmp_path / "a.parquet")
    with pytest.raises(UserError, match=r"a\.parquet: no column 'text' \(columns: \['content', 'n'\]\).*--text-field"):
        prepare([tmp_path / "a.parquet"], tmp_path / "out")
    with pytest.raises(UserError, match=r"a\.parquet: column 'n' holds int64, not strings.*--text-field"):
        prepare([tmp_path / "a.parquet"], tmp_path / "out", text_field="n")
    with pa.OSFile(str(tmp_path / "b.arrow"), "wb") as f, pa.ipc.new_stream(f, pa.schema([("body", pa.string())])) as w:
        w.write_table(pa.table({"body": ["x"]}))
    with pytest.raises(UserError, match=r"b\.arrow: no column 'text' \(columns: \['body'\]\)"):
        prepare([tmp_path / "b.arrow"], tmp_path / "out")
    (tmp_path / "c.jsonl").write_text('{"body": "x"}\n')
    with pytest.raises(UserError, match=r"c\.jsonl, line 1: no field 'text' \(found \['body'\]\).*--text-field"):
        prepare([tmp_path / "c.jsonl"], tmp_path / "out")
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_empty_datasets(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "empty.parquet")
    with pytest.raises(UserError, match="empty corpus"):
        prepare([tmp_path / "empty.parquet"], tmp_path / "out")
    pq.write_table(pa.table({"text": ["", None, ""]}), tmp_path / "blank.parquet")
    with pytest.raises(UserError, match="empty corpus"):
        prepare([tmp_path / "blank.parquet"], tmp_path / "out", dedup=True, num_workers=2)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_corrupt_parquet(tmp_path):
    pq.write_table(pa.table({"text": DOCS}), tmp_path / "good.parquet", row_group_size=10)
    data = (tmp_path / "good.parquet").read_bytes()
    (tmp_path / "truncated.parquet").write_bytes(data[: len(data) // 2])
    (tmp_path / "garbage.parquet").write_bytes(b"PAR1" + os.urandom(2000))
    for name in ("truncated.parquet", "garbage.parquet"):
        with pytest.raises(UserError, match=rf"{name}: not a readable Parquet file .*corrupt"):
            prepare([tmp_path / name], tmp_path / "out")
    # Damage inside a row group's pages (the footer still reads): caught while reading.
    damaged = bytearray(data)
    damaged[100:400] = os.urandom(300)
    (tmp_path / "damaged.parquet").write_bytes(bytes(damaged))
    with pytest.raises(UserError, match=r"damaged\.parquet: not a readable Parquet \(row groups"):
        prepare([tmp_path / "damaged.parquet"], tmp_path / "out", num_workers=2)
    assert not (tmp_path / "out").exists() and leftovers(tmp_path) == []


def test_missing_and_unreachable_urls(tmp_path):
    with pytest.raises(UserError, match=r"does not exist: 'memory://no/such/file.parquet'"):
        prepare(["memory://no/such/file.parquet"], tmp_path / "out")
    with pytest.raises(UserError, match=r"http://127\.0\.0\.1:9/x\.parquet: cannot be reached"):
        prepare(["http://127.0.0.1:9/x.parquet"], tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_cloud_credentials_names_the_variables(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    # No metadata server, no credential files: botocore finds nothing and says so (no network needed).
    env.update(AWS_EC2_METADATA_DISABLED="true", AWS_SHARED_CREDENTIALS_FILE=str(tmp_path / "none"),
               AWS_CONFIG_FILE=str(tmp_path / "none"), PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "slipstream", "data", "prepare", "--input", "s3://bucket/data.parquet",
                           "--out", str(tmp_path / "out"), "--quiet"], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "s3://bucket/data.parquet: no credentials" in proc.stderr and "AWS_ACCESS_KEY_ID" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_cli_prepare_parquet_with_options(tmp_path):
    pq.write_table(pa.table({"body": DOCS + DOCS[:5]}), tmp_path / "data.parquet", row_group_size=10)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    proc = subprocess.run([sys.executable, "-m", "slipstream", "data", "prepare", "--input", "data.parquet", "--out", "prep",
                           "--text-field", "body", "--dedup", "--chunk-tokens", "512", "--workers", "2"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "5 duplicates dropped" in proc.stdout
    m = load_manifest(str(tmp_path / "prep"))
    assert m["documents"] == 40 and m["chunk_tokens"] == 512 and m["settings"]["text_field"] == "body"
