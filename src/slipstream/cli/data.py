"""`slipstream data prepare|verify|train-tokenizer`: token shards and tokenizers.

    slipstream data prepare --input PATH... --tokenizer T --out DIR [--text-field F] [--dedup] [--chunk-tokens N] [--workers N]
    slipstream data verify --dir DIR
    slipstream data train-tokenizer --input PATH... --vocab-size N --out FILE [--force]
"""

from __future__ import annotations

import argparse
import sys

from slipstream.cli._common import add_force, no_extra
from slipstream.outputs import refuse_existing, refuse_same_file


def cmd_data_prepare(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.data import prepare_dataset

    no_extra(extra)
    manifest = prepare_dataset(args.input, args.tokenizer, args.out, text_field=args.text_field,
                               val_fraction=args.val_fraction, num_workers=args.workers or None,
                               progress=not args.quiet, dedup=args.dedup, chunk_tokens=args.chunk_tokens)
    splits = manifest.get("splits", {})
    counts = ", ".join(f"{name}: {info.get('tokens', 0):,} tokens" for name, info in splits.items())
    print(f"prepared {args.out} ({manifest['tokenizer']}, vocab {manifest['vocab_size']}): {counts}")
    return 0


def cmd_data_verify(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.data.prepare import verify_data

    no_extra(extra)
    _manifest, results = verify_data(args.dir)
    for split, name, problem in results:
        print(f"{'ok ' if problem is None else 'BAD'} {split} {name}" + (f": {problem}" if problem else ""), flush=True)
    bad = [name for _split, name, problem in results if problem]
    if bad:
        print(f"{args.dir}: {len(bad)} of {len(results)} shards damaged ({', '.join(bad[:5])}"
              f"{', ...' if len(bad) > 5 else ''}); run `slipstream data prepare` again", file=sys.stderr)
        return 1
    print(f"{args.dir}: all {len(results)} shards intact (sizes, sha256s, token ids < vocab)")
    return 0


def cmd_data_train_tokenizer(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.data import train_bpe

    no_extra(extra)
    refuse_existing(args.out, args.force)
    refuse_same_file(args.out, args.input, "--out", "one of the inputs")
    tok = train_bpe(args.input, args.out, vocab_size=args.vocab_size, text_field=args.text_field)
    print(f"wrote {args.out} (vocab {tok.vocab_size}); use it with --tokenizer bpe:{args.out}")
    return 0


def add_commands(sub) -> None:
    """Register `data prepare|verify|train-tokenizer` on the top-level subparsers."""
    data = sub.add_parser("data", help="prepare token shards, train tokenizers").add_subparsers(dest="data_cmd", required=True)
    p = data.add_parser("prepare", help="tokenize inputs into token shards + manifest")
    p.add_argument("--input", nargs="+", required=True,
                   help="text files, folders, .jsonl/.jsonl.gz/.jsonl.zst, .parquet, .arrow, Hugging Face `datasets` "
                        "folders (save_to_disk), fsspec URLs (s3://, gs://, hf://, file://; globs such as s3://b/data/*.parquet) "
                        "or `stdlib`")
    p.add_argument("--tokenizer", default="byte", help="byte | bpe:FILE | tiktoken:NAME")
    p.add_argument("--out", required=True, help="output folder")
    p.add_argument("--text-field", default="text",
                   help="JSONL field / Parquet or Arrow column holding the text (records with `prompt` and "
                        "`completion` instead are fine-tuning pairs: loss on the completion only)")
    p.add_argument("--val-fraction", type=float, default=0.01)
    p.add_argument("--workers", type=int, default=0, help="tokenizer processes; 0 = all cores")
    p.add_argument("--dedup", action="store_true", help="drop exact duplicate documents (the first occurrence is kept)")
    p.add_argument("--chunk-tokens", type=int, default=2**20, help="tokens per chunk checksum, for streaming readers")
    p.add_argument("--quiet", action="store_true")
    p.set_defaults(func=cmd_data_prepare)
    p = data.add_parser("verify", help="check every shard of a prepared folder (sizes, sha256, token ids); exit 1 on damage")
    p.add_argument("--dir", required=True, help="prepared data folder")
    p.set_defaults(func=cmd_data_verify)
    p = data.add_parser("train-tokenizer", help="train a byte-level BPE tokenizer on the inputs")
    p.add_argument("--input", nargs="+", required=True)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--out", required=True, help="tokenizer JSON file to write")
    add_force(p)
    p.add_argument("--text-field", default="text")
    p.set_defaults(func=cmd_data_train_tokenizer)
