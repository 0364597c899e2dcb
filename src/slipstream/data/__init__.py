"""Data pipeline: raw text -> tokenizer -> prepared token shards -> batches."""

from slipstream.data.loader import DatasetLoader, TokenLoader
from slipstream.data.prepare import load_manifest, prepare_dataset, tokenizer_spec_for, verify_manifest
from slipstream.data.sources import SourceStats, iter_documents
from slipstream.data.tokenizers import Tokenizer, get_tokenizer, train_bpe

__all__ = [
    "DatasetLoader",
    "SourceStats",
    "TokenLoader",
    "Tokenizer",
    "get_tokenizer",
    "iter_documents",
    "load_manifest",
    "prepare_dataset",
    "tokenizer_spec_for",
    "train_bpe",
    "verify_manifest",
]
