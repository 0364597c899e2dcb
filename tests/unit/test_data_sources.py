"""Tests for slipstream.data.sources: every input kind, decoding stats and input errors."""

import itertools
import json
import os

import pytest

from slipstream.data.sources import SourceStats, fingerprint_inputs, iter_documents, stdlib_files
from slipstream.errors import UserError


def write(path, data):
    path.parent.mkdir(parents=True, exist_ok=True)
    if isinstance(data, str):
        data = data.encode("utf-8")
    path.write_bytes(data)
    return path


def test_folder_is_sorted_recursive_and_skips_hidden_and_binary(tmp_path):
    write(tmp_path / "b.txt", "second")
    write(tmp_path / "a.txt", "first")
    write(tmp_path / "sub" / "c.txt", "third")
    write(tmp_path / ".hidden.txt", "hidden file")
    write(tmp_path / ".git" / "x.txt", "hidden dir")
    write(tmp_path / "blob.bin", b"\x00\x01binary")
    write(tmp_path / "empty.txt", "")
    stats = SourceStats()
    docs = list(iter_documents([str(tmp_path)], stats=stats))
    assert docs == ["first", "second", "third"]
    assert stats.documents == 3
    assert stats.files == 4  # the empty file is read but yields no document
    assert stats.skipped_files == 1


def test_text_file_is_one_document(tmp_path):
    f = write(tmp_path / "book.txt", "line one\nline two\n")
    assert list(iter_documents([str(f)])) == ["line one\nline two\n"]


def test_jsonl_documents_and_text_field(tmp_path):
    rows = [{"text": "alpha", "body": "A"}, {"text": "beta", "body": "B"}]
    f = write(tmp_path / "d.jsonl", "\n".join(json.dumps(r) for r in rows) + "\n\n")
    assert list(iter_documents([str(f)])) == ["alpha", "beta"]
    assert list(iter_documents([str(f)], text_field="body")) == ["A", "B"]


def test_jsonl_bad_line_names_file_and_line(tmp_path):
    f = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"text": "ok"}\nnot json\n')
    with pytest.raises(UserError, match=r"d\.jsonl, line 3: not valid JSON"):
        list(iter_documents([str(f)]))


def test_jsonl_missing_field_suggests_text_field(tmp_path):
    f = write(tmp_path / "d.jsonl", '{"text": "ok"}\n{"content": "x"}\n')
    with pytest.raises(UserError, match=r"line 2: no field 'text'.*--text-field"):
        list(iter_documents([str(f)]))


def test_stdlib_first_documents_and_size():
    files = stdlib_files()
    assert len(files) > 300
    assert not any(f"{os.sep}site-packages{os.sep}" in p or f"{os.sep}test{os.sep}" in p for p in files)
    assert sum(os.path.getsize(p) for p in files) > 10_000_000
    docs = list(itertools.islice(iter_documents(["stdlib"]), 3))
    assert len(docs) == 3 and all(docs)


def test_undecodable_bytes_are_replaced_and_counted(tmp_path):
    # Two bad bytes, plus a genuine U+FFFD that must not be counted as a replacement.
    f = write(tmp_path / "latin.txt", b"caf\xe9 ok \xff " + "\ufffd".encode())
    stats = SourceStats()
    (doc,) = iter_documents([str(f)], stats=stats)
    assert doc == "caf\ufffd ok \ufffd \ufffd"
    assert stats.replaced_chars == 2


def test_empty_corpus(tmp_path):
    write(tmp_path / "a.txt", "")
    write(tmp_path / "b.jsonl", '{"text": ""}\n')
    with pytest.raises(UserError, match="empty corpus"):
        list(iter_documents([str(tmp_path)]))


def test_missing_path_fails_before_reading(tmp_path):
    write(tmp_path / "a.txt", "text")
    docs = iter_documents([str(tmp_path / "a.txt"), str(tmp_path / "nope")])
    with pytest.raises(UserError, match="does not exist.*nope"):
        next(docs)


def test_fingerprint_changes_with_content(tmp_path):
    f = write(tmp_path / "a.txt", "one")
    before = fingerprint_inputs([str(tmp_path)])
    assert fingerprint_inputs([str(tmp_path)]) == before
    write(f, "one two")
    assert fingerprint_inputs([str(tmp_path)])["sha256"] != before["sha256"]


def test_jsonl_lone_surrogates_are_replaced_and_counted(tmp_path):
    p = tmp_path / "s.jsonl"
    p.write_text('{"text": "a\\ud800b"}\n{"text": "fine"}\n', encoding="utf-8")
    stats = SourceStats()
    docs = list(iter_documents([str(p)], stats=stats))
    assert docs == ["a\ufffdb", "fine"]
    assert stats.replaced_chars == 1
    docs[0].encode("utf-8")  # encodable now: tokenizers won't fail
