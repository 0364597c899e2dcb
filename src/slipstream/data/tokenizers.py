"""Tokenizers behind one tiny interface, selected by a spec string.

Specs:
  byte             UTF-8 bytes 0..255 plus an end-of-text token (no dependencies)
  bpe:FILE         a Hugging Face `tokenizers` JSON file with an <|endoftext|> special token
  tiktoken:NAME    a tiktoken encoding (e.g. gpt2) whose files are already cached locally

Every tokenizer has an end-of-text token (`eot_id`) that prepare appends after each
document, so the model learns where documents end. Document text is always encoded as
plain text: a literal "<|endoftext|>" inside a document never becomes the eot token.
`decode` never raises on partial UTF-8 (it inserts U+FFFD) and renders eot as
"<|endoftext|>". Ids outside the tokenizer's vocabulary (models often pad their vocab
to a multiple of 64) have no text and are dropped by `decode`.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from typing import Iterable, Sequence

from slipstream.data.sources import iter_documents
from slipstream.errors import UserError
from slipstream.safe_read import TOKENIZER, check_size

EOT_TEXT = "<|endoftext|>"
VALID_SPECS = "byte, bpe:PATH/TO/tokenizer.json (see `slipstream data train-tokenizer`), tiktoken:NAME (e.g. tiktoken:gpt2)"


def _as_list(ids) -> list[int]:
    # Accept lists, numpy arrays and torch tensors without importing either here.
    return ids.tolist() if hasattr(ids, "tolist") else [int(i) for i in ids]


class Tokenizer:
    """The interface prepare, loaders and generation rely on."""

    spec: str  # round-trips through get_tokenizer(spec)
    vocab_size: int  # one more than the largest id the tokenizer can produce
    eot_id: int  # appended after every document
    fingerprint: str  # changes when the tokenizer's behaviour could change (e.g. its file)

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return f"{type(self).__name__}(spec={self.spec!r}, vocab_size={self.vocab_size}, eot_id={self.eot_id})"


class ByteTokenizer(Tokenizer):
    """Raw UTF-8 bytes: ids 0..255 are bytes, 256 is end-of-text."""

    def __init__(self) -> None:
        self.spec = "byte"
        self.vocab_size = 257
        self.eot_id = 256
        self.fingerprint = "byte"

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Iterable[int]) -> str:
        parts, buf = [], bytearray()
        for i in _as_list(ids):
            if 0 <= i < 256:
                buf.append(i)
            elif i == self.eot_id:
                parts.append(buf.decode("utf-8", errors="replace"))
                parts.append(EOT_TEXT)
                buf = bytearray()
        parts.append(buf.decode("utf-8", errors="replace"))
        return "".join(parts)


class BPETokenizer(Tokenizer):
    """A byte-level BPE stored as a Hugging Face `tokenizers` JSON file."""

    def __init__(self, path: str) -> None:
        from tokenizers import Tokenizer as HFTokenizer

        path = os.path.abspath(os.path.expanduser(path))
        if not os.path.isfile(path):
            raise UserError(f"tokenizer file not found: {path}; train one with `slipstream data train-tokenizer` or fix the bpe: path")
        # The Rust loader reads the whole file into memory: refuse a huge one first (it bounds
        # nesting itself, with a clear error caught below).
        check_size(path, TOKENIZER)
        try:
            self._tok = HFTokenizer.from_file(path)
        except Exception as e:  # the Rust side raises a plain Exception for any bad file
            raise UserError(f"{path} is not a valid Hugging Face tokenizers JSON file ({e}); re-train or re-export it") from None
        eot = self._tok.token_to_id(EOT_TEXT)
        if eot is None:
            raise UserError(
                f"tokenizer {path} has no {EOT_TEXT} token, which slipstream appends after every document; "
                f"add it as a special token or train with `slipstream data train-tokenizer`"
            )
        # Documents are plain text: never turn a literal "<|endoftext|>" in the data into eot.
        self._tok.encode_special_tokens = True
        self.spec = f"bpe:{path}"
        self.eot_id = eot
        self.vocab_size = max(self._tok.get_vocab(with_added_tokens=True).values()) + 1
        digest = hashlib.sha256()
        with open(path, "rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                digest.update(block)
        self.fingerprint = "sha256:" + digest.hexdigest()
        self.path = path

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        return [e.ids for e in self._tok.encode_batch(list(texts), add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [i for i in _as_list(ids) if 0 <= i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=False)


def _tiktoken_cache_dir() -> str:
    # Same lookup order as tiktoken.load.read_file_cached.
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return os.environ["TIKTOKEN_CACHE_DIR"]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return os.environ["DATA_GYM_CACHE_DIR"]
    return os.path.join(tempfile.gettempdir(), "data-gym-cache")


class _NeedsDownload(Exception):
    pass


def _load_tiktoken_offline(name: str):
    """tiktoken.get_encoding, but failing fast instead of downloading.

    tiktoken fetches missing files over HTTP with no timeout; offline that can hang for
    minutes. While the encoding loads we swap tiktoken's raw reader for one that refuses
    URLs, so only files already in its cache (or local paths) can be used.
    """
    try:
        import tiktoken
        import tiktoken.load
    except ImportError:
        raise UserError("tokenizer tiktoken:... needs the `tiktoken` package: pip install tiktoken (or use --tokenizer byte)") from None

    if name not in tiktoken.list_encoding_names():
        raise UserError(f"unknown tiktoken encoding {name!r}; available: {', '.join(tiktoken.list_encoding_names())}")

    original_read = getattr(tiktoken.load, "read_file", None)

    def read_local_only(blobpath: str) -> bytes:
        if "://" in blobpath:
            raise _NeedsDownload(blobpath)
        return original_read(blobpath)

    if original_read is not None:
        tiktoken.load.read_file = read_local_only
    try:
        return tiktoken.get_encoding(name)
    except _NeedsDownload as e:
        url = str(e)
        cache_dir = _tiktoken_cache_dir()
        cache_file = os.path.join(cache_dir, hashlib.sha1(url.encode()).hexdigest()) if cache_dir else "(caching disabled)"
        raise UserError(
            f"tiktoken encoding {name!r} is not available offline: missing cached file {cache_file} "
            f"(downloaded from {url}). On a machine with internet run "
            f"`TIKTOKEN_CACHE_DIR=DIR python -c \"import tiktoken; tiktoken.get_encoding('{name}')\"`, copy DIR here "
            f"and set TIKTOKEN_CACHE_DIR=DIR; or use --tokenizer byte / bpe:FILE"
        ) from None
    except Exception as e:
        raise UserError(f"could not load tiktoken encoding {name!r} from {_tiktoken_cache_dir()}: {e}; set TIKTOKEN_CACHE_DIR to a folder with its cached files") from None
    finally:
        if original_read is not None:
            tiktoken.load.read_file = original_read


class TiktokenTokenizer(Tokenizer):
    """A tiktoken encoding (e.g. gpt2), loaded strictly from the local cache."""

    def __init__(self, name: str) -> None:
        self._enc = _load_tiktoken_offline(name)
        if EOT_TEXT not in self._enc.special_tokens_set:
            raise UserError(f"tiktoken encoding {name!r} has no {EOT_TEXT} token; use one that does (e.g. gpt2, cl100k_base)")
        self.spec = f"tiktoken:{name}"
        self.eot_id = self._enc.eot_token
        self.vocab_size = self._enc.n_vocab
        self.fingerprint = self.spec

    def encode(self, text: str) -> list[int]:
        return self._enc.encode_ordinary(text)

    def encode_batch(self, texts: Sequence[str]) -> list[list[int]]:
        # No tiktoken thread pool: prepare already runs one process per core.
        return [self._enc.encode_ordinary(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        ids = [i for i in _as_list(ids) if 0 <= i < self.vocab_size]
        return self._enc.decode(ids, errors="replace")


def get_tokenizer(spec: str) -> Tokenizer:
    """Build a tokenizer from its spec string (see module doc)."""
    if not isinstance(spec, str):
        raise UserError(f"tokenizer spec must be a string, got {spec!r}; valid forms: {VALID_SPECS}")
    kind, _, arg = spec.partition(":")
    if spec == "byte":
        return ByteTokenizer()
    if kind == "bpe" and arg:
        return BPETokenizer(arg)
    if kind == "tiktoken" and arg:
        return TiktokenTokenizer(arg)
    raise UserError(f"unknown tokenizer {spec!r}; valid forms: {VALID_SPECS}")


def train_bpe(
    inputs: list[str],
    out_path: str,
    vocab_size: int = 4096,
    text_field: str = "text",
    min_frequency: int = 2,
) -> BPETokenizer:
    """Train a byte-level BPE (GPT-2 style pre-tokenization) on the inputs and save it to out_path.

    The 256 byte symbols are always in the vocabulary, so any text can be encoded. The
    corpus may yield fewer merges than asked for; the saved vocabulary is then smaller.
    """
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = [EOT_TEXT]
    if not isinstance(vocab_size, int) or vocab_size < 256 + len(specials):
        raise UserError(f"vocab_size={vocab_size} is too small: a byte-level BPE needs at least {256 + len(specials)} (256 bytes + {EOT_TEXT})")
    if min_frequency < 1:
        raise UserError(f"min_frequency={min_frequency} must be >= 1")
    if os.path.isdir(os.path.expanduser(out_path)):
        raise UserError(f"--out {out_path!r} is a folder; give the tokenizer JSON file to write, e.g. {out_path}/tokenizer.json")

    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_documents(inputs, text_field=text_field), trainer=trainer)

    out_path = os.path.abspath(os.path.expanduser(out_path))
    os.makedirs(os.path.dirname(out_path), exist_ok=True)
    # Save to a temp file and rename, so an interrupted run never leaves half a JSON file.
    fd, tmp = tempfile.mkstemp(dir=os.path.dirname(out_path), prefix=os.path.basename(out_path) + ".", suffix=".tmp")
    os.close(fd)
    try:
        tok.save(tmp)
        os.replace(tmp, out_path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return BPETokenizer(out_path)
