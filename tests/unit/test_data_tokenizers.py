"""Tests for slipstream.data.tokenizers: byte, BPE training/loading, tiktoken offline behaviour."""

import os
import sys
import time

import pytest

from slipstream.data.tokenizers import EOT_TEXT, ByteTokenizer, get_tokenizer, train_bpe
from slipstream.errors import UserError

CORPUS = (
    "The quick brown fox jumps over the lazy dog. " * 40
    + "def main():\n    return 42\n" * 40
    + "héllo wörld, ünïcode 日本語のテキスト " * 20
)


def test_byte_round_trip():
    tok = get_tokenizer("byte")
    assert isinstance(tok, ByteTokenizer)
    assert (tok.vocab_size, tok.eot_id, tok.spec) == (257, 256, "byte")
    text = "héllo 日本 🙂"
    ids = tok.encode(text)
    assert max(ids) < 256 and tok.decode(ids) == text
    assert tok.decode(tok.encode("a") + [tok.eot_id] + tok.encode("b")) == f"a{EOT_TEXT}b"
    assert tok.encode_batch(["a", "bc"]) == [[97], [98, 99]]


def test_decode_partial_utf8_does_not_raise():
    tok = get_tokenizer("byte")
    ids = tok.encode("日")
    assert tok.decode(ids[:2]) == "\ufffd"


def test_unknown_spec_lists_valid_forms():
    with pytest.raises(UserError, match="valid forms: byte.*bpe:.*tiktoken:"):
        get_tokenizer("sentencepiece:foo")


def test_train_bpe_round_trip(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(CORPUS, encoding="utf-8")
    out = tmp_path / "tok" / "tokenizer.json"
    tok = train_bpe([str(corpus)], str(out), vocab_size=400)
    assert out.is_file() and os.listdir(out.parent) == ["tokenizer.json"]  # no temp file left
    assert 256 < tok.vocab_size <= 400
    assert tok.eot_id is not None and tok.decode([tok.eot_id]) == EOT_TEXT
    for text in ["The quick brown fox", "héllo 日本語", "unseen: ∑ 🙂 qzx"]:
        assert tok.decode(tok.encode(text)) == text
    # A literal <|endoftext|> in a document is text, never the eot token.
    assert tok.eot_id not in tok.encode(f"a {EOT_TEXT} b")
    assert len(tok.encode("The quick brown fox")) < len("The quick brown fox")  # it learned merges
    # The spec round-trips through get_tokenizer.
    again = get_tokenizer(tok.spec)
    assert again.encode(CORPUS[:200]) == tok.encode(CORPUS[:200])


def test_train_bpe_rejects_tiny_vocab(tmp_path):
    corpus = tmp_path / "c.txt"
    corpus.write_text("abc")
    with pytest.raises(UserError, match="vocab_size=100 is too small"):
        train_bpe([str(corpus)], str(tmp_path / "t.json"), vocab_size=100)


def test_bpe_without_eot_is_rejected(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel()
    hf.train_from_iterator([CORPUS], trainer=trainers.BpeTrainer(vocab_size=300, show_progress=False))
    path = tmp_path / "noeot.json"
    hf.save(str(path))
    with pytest.raises(UserError, match="no <\\|endoftext\\|> token"):
        get_tokenizer(f"bpe:{path}")
    with pytest.raises(UserError, match="not found"):
        get_tokenizer(f"bpe:{tmp_path / 'missing.json'}")


def test_tiktoken_offline_fails_fast(tmp_path, monkeypatch):
    tiktoken = pytest.importorskip("tiktoken")
    import tiktoken.registry

    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path))  # empty cache
    monkeypatch.setattr(tiktoken.registry, "ENCODINGS", {})  # forget anything loaded in this process
    start = time.time()
    with pytest.raises(UserError, match="not available offline.*TIKTOKEN_CACHE_DIR"):
        get_tokenizer("tiktoken:gpt2")
    assert time.time() - start < 5
    with pytest.raises(UserError, match="unknown tiktoken encoding"):
        get_tokenizer("tiktoken:not_an_encoding")


def test_tiktoken_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "tiktoken", None)  # makes `import tiktoken` raise ImportError
    with pytest.raises(UserError, match="pip install tiktoken"):
        get_tokenizer("tiktoken:gpt2")
