"""Tests for slipstream.data.prepare: shard contents, manifest, dtype, idempotency and atomicity."""

import hashlib
import json
import os

import numpy as np
import pytest

import slipstream.data.prepare as prep
from slipstream.data.prepare import load_manifest, prepare_dataset, verify_manifest
from slipstream.data.tokenizers import EOT_TEXT, ByteTokenizer, get_tokenizer, train_bpe
from slipstream.errors import UserError


def make_corpus(folder, n_docs=12, size=300):
    folder.mkdir(parents=True, exist_ok=True)
    docs = []
    for i in range(n_docs):
        text = f"document {i:03d} " + "".join(chr(97 + (i * 7 + j) % 26) for j in range(size)) + " é\n"
        (folder / f"doc_{i:03d}.txt").write_text(text, encoding="utf-8")
        docs.append(text)
    return docs


def read_split(out_dir, manifest, split):
    dtype = np.dtype(manifest["dtype"])
    parts = [np.fromfile(os.path.join(out_dir, s["file"]), dtype=dtype) for s in manifest["splits"][split]["shards"]]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def all_tokens(out_dir, manifest):
    return np.concatenate([read_split(out_dir, manifest, "train"), read_split(out_dir, manifest, "val")])


def test_shards_decode_back_to_input(tmp_path):
    docs = make_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    m = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), shard_tokens=1000, progress=False)
    assert m["dtype"] == "uint16" and m["vocab_size"] == 257 and m["eot_id"] == 256
    assert m["documents"] == len(docs)
    assert len(m["splits"]["train"]["shards"]) > 1  # small shard_tokens forces several shards
    assert sorted(os.listdir(out))[0] == "manifest.json"
    tokens = all_tokens(out, m)
    assert ByteTokenizer().decode(tokens) == "".join(d + EOT_TEXT for d in docs)
    # Val is the tail of the corpus, whole documents, at least one.
    val = read_split(out, m, "val")
    assert m["splits"]["val"]["documents"] >= 1 and val[-1] == 256
    assert m["splits"]["train"]["tokens"] + m["splits"]["val"]["tokens"] == len(tokens)
    assert read_split(out, m, "train")[-1] == 256  # the split falls on a document boundary


def test_manifest_checksums_and_verify(tmp_path):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    m = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), shard_tokens=1000, progress=False)
    for split in ("train", "val"):
        for shard in m["splits"][split]["shards"]:
            data = (out / shard["file"]).read_bytes()
            assert shard["sha256"] == hashlib.sha256(data).hexdigest()
            assert len(data) == 2 * shard["tokens"]
    assert load_manifest(str(out)) == m
    verify_manifest(str(out), checksums=True)
    first = out / m["splits"]["train"]["shards"][0]["file"]
    data = bytearray(first.read_bytes())
    data[0] ^= 1
    first.write_bytes(bytes(data))
    verify_manifest(str(out))  # sizes still fine
    with pytest.raises(UserError, match="checksum"):
        verify_manifest(str(out), checksums=True)
    first.write_bytes(bytes(data[:-2]))
    with pytest.raises(UserError, match="wrong size|bytes, expected"):
        verify_manifest(str(out))


def test_load_manifest_errors(tmp_path):
    with pytest.raises(UserError, match="slipstream data prepare"):
        load_manifest(str(tmp_path / "nothing"))
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(UserError, match="corrupt"):
        load_manifest(str(tmp_path))


class BigVocab:
    """Byte encoding, but claims a vocabulary too large for uint16."""

    def __init__(self, vocab_size):
        self.spec, self.fingerprint = f"big:{vocab_size}", "big"
        self.vocab_size, self.eot_id = vocab_size, vocab_size - 1

    def encode_batch(self, texts):
        return [list(t.encode()) for t in texts]


def test_dtype_choice(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus", n_docs=3)
    monkeypatch.setattr(prep, "get_tokenizer", lambda spec: BigVocab(70_000))
    m = prepare_dataset([str(tmp_path / "corpus")], "big", str(tmp_path / "d32"), num_workers=1, progress=False)
    assert m["dtype"] == "uint32"
    tokens = all_tokens(tmp_path / "d32", m)
    assert tokens.dtype == np.uint32 and tokens[-1] == 69_999
    shard = m["splits"]["train"]["shards"][0]
    assert os.path.getsize(tmp_path / "d32" / shard["file"]) == 4 * shard["tokens"]
    monkeypatch.setattr(prep, "get_tokenizer", lambda spec: BigVocab(2**32 + 1))
    with pytest.raises(UserError, match="does not fit in uint32"):
        prepare_dataset([str(tmp_path / "corpus")], "big", str(tmp_path / "d64"), progress=False)


def test_idempotent_and_rebuild_on_change(tmp_path, capsys):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "data"
    m1 = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), progress=False)
    mtimes = {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)}
    m2 = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), progress=True)
    assert m2 == m1
    assert {p: os.stat(out / p).st_mtime_ns for p in os.listdir(out)} == mtimes
    assert "cached" in capsys.readouterr().out
    # Changed input -> rebuilt in place.
    (tmp_path / "corpus" / "doc_000.txt").write_text("a brand new first document")
    m3 = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), progress=False)
    assert m3["inputs"]["sha256"] != m1["inputs"]["sha256"]
    assert load_manifest(str(out)) == m3
    assert ByteTokenizer().decode(all_tokens(out, m3)).startswith("a brand new first document" + EOT_TEXT)
    # Changed settings -> rebuilt too.
    m4 = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), val_fraction=0.5, progress=False)
    assert m4["splits"]["val"]["documents"] == 6
    assert [p for p in os.listdir(tmp_path) if p.startswith(".")] == []  # no temp or old folders left


def test_crash_mid_write_leaves_no_complete_looking_folder(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "data"

    def crash(folder, manifest):
        raise KeyboardInterrupt("simulated crash")

    monkeypatch.setattr(prep, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), progress=False)
    assert not out.exists()
    # Only the hidden work folder stays, so that running again resumes (test_prepare_scale.py).
    assert [p for p in os.listdir(tmp_path) if not p.startswith(".data.prepare-")] == ["corpus"]
    monkeypatch.undo()
    good = prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), progress=False)
    # A crash while rebuilding keeps the previous complete data untouched.
    monkeypatch.setattr(prep, "_write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), val_fraction=0.3, progress=False)
    monkeypatch.undo()
    assert verify_manifest(str(out), checksums=True) == good


def test_leftover_temp_folder_does_not_break_prepare(tmp_path):
    make_corpus(tmp_path / "corpus")
    (tmp_path / ".data.tmp-killed").mkdir()  # what a SIGKILLed run leaves behind
    (tmp_path / ".data.tmp-killed" / "part_000000.tmp").write_bytes(b"\0" * 10)
    m = prepare_dataset([str(tmp_path / "corpus")], "byte", str(tmp_path / "data"), progress=False)
    assert load_manifest(str(tmp_path / "data")) == m


def test_refuses_to_overwrite_foreign_folder(tmp_path):
    make_corpus(tmp_path / "corpus")
    out = tmp_path / "mine"
    out.mkdir()
    (out / "precious.txt").write_text("do not delete")
    with pytest.raises(UserError, match="not a slipstream data folder"):
        prepare_dataset([str(tmp_path / "corpus")], "byte", str(out), progress=False)
    assert (out / "precious.txt").read_text() == "do not delete"
    # An empty folder is fine to fill.
    empty = tmp_path / "empty"
    empty.mkdir()
    prepare_dataset([str(tmp_path / "corpus")], "byte", str(empty), progress=False)
    assert (empty / "manifest.json").is_file()


def test_workers_match_in_process(tmp_path, monkeypatch):
    make_corpus(tmp_path / "corpus", n_docs=20)
    monkeypatch.setattr(prep, "CHUNK_CHARS", 1000)  # several chunks, so the pool is really used
    pools = []
    make_pool = prep.make_pool
    monkeypatch.setattr(prep, "make_pool", lambda *args: pools.append(args) or make_pool(*args))
    m1 = prepare_dataset([str(tmp_path / "corpus")], "byte", str(tmp_path / "one"), num_workers=1, progress=False)
    assert pools == []
    m2 = prepare_dataset([str(tmp_path / "corpus")], "byte", str(tmp_path / "two"), num_workers=2, progress=False)
    assert len(pools) == 1
    assert m1["splits"] == m2["splits"]


def test_bad_input_mid_prepare_leaves_nothing(tmp_path):
    corpus = tmp_path / "corpus"
    make_corpus(corpus, n_docs=3)
    (corpus / "z.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(UserError, match="line 2: no field 'text'"):
        prepare_dataset([str(corpus)], "byte", str(tmp_path / "data"), progress=False)
    assert sorted(os.listdir(tmp_path)) == ["corpus"]
    with pytest.raises(UserError, match="does not exist"):
        prepare_dataset([str(tmp_path / "missing")], "byte", str(tmp_path / "data"), progress=False)


def test_val_split_rules(tmp_path):
    single = tmp_path / "single"
    single.mkdir()
    (single / "book.txt").write_text("x" * 5000)
    m = prepare_dataset([str(single)], "byte", str(tmp_path / "d1"), progress=False)
    assert m["split_by"] == "tokens" and m["splits"]["val"]["tokens"] >= 50 and m["splits"]["train"]["tokens"] > 0
    m = prepare_dataset([str(single)], "byte", str(tmp_path / "d2"), val_fraction=0.0, progress=False)
    assert m["splits"]["val"] == {"tokens": 0, "shards": [], "documents": 0}
    with pytest.raises(UserError, match="val_fraction"):
        prepare_dataset([str(single)], "byte", str(tmp_path / "d3"), val_fraction=1.0, progress=False)


def test_prepare_with_trained_bpe(tmp_path):
    docs = make_corpus(tmp_path / "corpus", n_docs=6)
    tok = train_bpe([str(tmp_path / "corpus")], str(tmp_path / "tok.json"), vocab_size=320)
    out = tmp_path / "data"
    m = prepare_dataset([str(tmp_path / "corpus")], tok.spec, str(out), progress=False)
    assert m["tokenizer"] == tok.spec and m["eot_id"] == tok.eot_id
    assert get_tokenizer(m["tokenizer"]).decode(all_tokens(out, m)) == "".join(d + EOT_TEXT for d in docs)
    assert json.loads((out / "manifest.json").read_text())["vocab_size"] == tok.vocab_size


def test_bpe_tokenizer_travels_with_the_data(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("the quick brown fox jumps over the lazy dog\n" * 50)
    tok = tmp_path / "tok.json"
    train_bpe([str(corpus)], str(tok), vocab_size=280)
    out = tmp_path / "out"
    manifest = prepare_dataset([str(corpus)], f"bpe:{tok}", str(out), progress=False)
    assert manifest["tokenizer_file"] == "tokenizer.json"
    assert (out / "tokenizer.json").read_bytes() == tok.read_bytes()
    assert prep.tokenizer_spec_for(str(out), manifest) == f"bpe:{out / 'tokenizer.json'}"
    assert prepare_dataset([str(corpus)], "byte", str(tmp_path / "b"), progress=False)["tokenizer_file"] is None


def test_unwritable_output_and_tokenizer_folder_errors(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("hello world\n" * 20)
    blocker = tmp_path / "blocker"
    blocker.write_text("a file, not a folder")
    with pytest.raises(UserError, match="choose a writable --out"):
        prepare_dataset([str(corpus)], "byte", str(blocker / "out"), progress=False)
    with pytest.raises(UserError, match="is a folder"):
        train_bpe([str(corpus)], str(tmp_path), vocab_size=300)
