"""A prepared data folder's manifest: its format, reading it, and checking shards against it.

prepare.py writes the folder (its layout is in that module's doc); this is the side that
reads it: training, `data prepare`'s cache check and `slipstream data verify` all go
through load_manifest and shard_problem.

Each shard records its sha256 and its largest token id (max_id); with fine-tuning records
also its loss-mask file (mask_file, uint8 per token) and that file's mask_sha256, and since
chunked checksums exist, chunk_sha256 (per chunk_tokens tokens; fields are additive, so
manifests without them still load). Opening data checks sizes
and max_id < vocab_size (free); the sha256s, which prove both for shards slipstream wrote,
cost one read of the data (~1.1 GB/s measured on a 2-core dev VM with SHA extensions):
`data prepare`'s cache check and `slipstream data verify` always hash, training hashes by
`data.verify` (auto: when the shards total at most AUTO_FULL_BYTES). The loader still
refuses any id >= vocab_size in every batch it builds, since a manifest from elsewhere may lie.
"""

from __future__ import annotations

import hashlib
import os

import numpy as np

from slipstream.errors import UserError
from slipstream.safe_read import DATA_MANIFEST, load_json_capped

FORMAT = "slipstream-tokens"
FORMAT_VERSION = 1
MANIFEST = "manifest.json"
TOKENIZER_FILE = "tokenizer.json"
SPLITS = ("train", "val")
VERIFY_LEVELS = ("auto", "full", "size")
# data.verify=auto hashes the shards at train start up to this size: about a second at the
# ~1.1 GB/s sha256 measured here; bigger data checks sizes and max_id only (see module doc).
AUTO_FULL_BYTES = 1 << 30


def token_dtype(vocab_size: int) -> np.dtype:
    """Smallest unsigned dtype that holds every id: uint16 covers GPT-2 sized vocabularies."""
    if vocab_size <= 2**16:
        return np.dtype("<u2")
    if vocab_size <= 2**32:
        return np.dtype("<u4")
    raise UserError(f"tokenizer vocab_size={vocab_size} does not fit in uint32 token files; use a tokenizer with at most 2**32 tokens")


def load_manifest(data_dir: str) -> dict:
    """Read data_dir/manifest.json, with a clear UserError when it is missing or not ours."""
    path = os.path.join(data_dir, MANIFEST)
    if not os.path.isfile(path):
        raise UserError(f"no prepared data in {data_dir!r} (no {MANIFEST}); run `slipstream data prepare` with --out {data_dir}")
    try:
        manifest = load_json_capped(path, DATA_MANIFEST)
    except (OSError, ValueError) as e:
        raise UserError(f"{path} is unreadable or corrupt ({e}); delete {data_dir!r} and run `slipstream data prepare` again") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise UserError(f"{path} is not a slipstream data manifest; point at a folder made by `slipstream data prepare`")
    if manifest.get("version") != FORMAT_VERSION:
        raise UserError(
            f"{data_dir!r} has data format version {manifest.get('version')}, this slipstream reads version "
            f"{FORMAT_VERSION}; run `slipstream data prepare` again"
        )
    _check_fields(manifest, path)
    return manifest


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_fields(manifest: dict, path: str) -> None:
    """The fields the loaders rely on, so a manifest from elsewhere fails here with its name
    instead of as a KeyError (or an IndexError in the embedding) later."""
    def bad(what: str):
        return UserError(f"{path}: {what}; the manifest is damaged or not written by slipstream: "
                         "run `slipstream data prepare` again")

    dtype, vocab = manifest.get("dtype"), manifest.get("vocab_size")
    if dtype not in ("uint16", "uint32"):
        raise bad(f"token dtype {dtype!r} is not uint16 or uint32")
    if not _is_count(vocab) or not 1 <= vocab <= 2 ** (8 * np.dtype(dtype).itemsize):
        raise bad(f"vocab_size {vocab!r} is not a positive integer that fits {dtype}")
    if not _is_count(manifest.get("eot_id")) or manifest["eot_id"] >= vocab:
        raise bad(f"eot_id {manifest.get('eot_id')!r} is not an id below vocab_size {vocab}")
    splits = manifest.get("splits")
    if not isinstance(splits, dict) or "train" not in splits:
        raise bad("it has no train split")
    for split, info in splits.items():
        shards = info.get("shards") if isinstance(info, dict) else None
        if not isinstance(shards, list):
            raise bad(f"split {split!r} has no shard list")
        for shard in shards:
            ok = (isinstance(shard, dict) and isinstance(shard.get("file"), str) and _is_count(shard.get("tokens"))
                  and isinstance(shard.get("sha256"), str)
                  and (shard.get("max_id") is None or _is_count(shard["max_id"])))
            # Shard files live in the folder itself: a name with a path in it would read elsewhere.
            if not ok or os.path.basename(shard["file"]) != shard["file"] or shard["file"] in ("", ".", ".."):
                raise bad(f"split {split!r} has a malformed shard entry {str(shard)[:120]}")
            mask = shard.get("mask_file")
            if mask is not None and (not isinstance(mask, str) or os.path.basename(mask) != mask
                                     or mask in ("", ".", "..", shard["file"]) or not isinstance(shard.get("mask_sha256"), str)):
                raise bad(f"split {split!r} has a malformed mask entry {str(shard)[:120]}")


def shard_problem(data_dir: str, manifest: dict, shard: dict, checksums: bool) -> str | None:
    """What is wrong with one shard (None: nothing). Sizes and the recorded max_id are free
    to check; checksums reads the file: its sha256 and the ids it really holds."""
    dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
    vocab = manifest["vocab_size"]
    path = os.path.join(data_dir, shard["file"])
    if not os.path.isfile(path):
        return "is missing"
    size, expected = os.path.getsize(path), shard["tokens"] * dtype.itemsize
    if size != expected:
        return f"has {size} bytes, expected {expected}"
    recorded = shard.get("max_id")
    if recorded is not None and recorded >= vocab:
        return f"holds token id {recorded} (its max_id), outside the vocabulary of {vocab}"
    mask_path = os.path.join(data_dir, shard["mask_file"]) if shard.get("mask_file") else None
    if mask_path is not None:
        if not os.path.isfile(mask_path):
            return f"has no loss-mask file {shard['mask_file']}"
        if os.path.getsize(mask_path) != shard["tokens"]:
            return f"has a loss-mask file {shard['mask_file']} of {os.path.getsize(mask_path)} bytes, expected {shard['tokens']}"
    if not checksums:
        return None
    if mask_path is not None and scan_file(mask_path)[0] != shard["mask_sha256"]:
        return f"has a loss-mask file {shard['mask_file']} that fails its sha256 checksum"
    digest, top = scan_file(path, dtype)
    if digest != shard["sha256"]:
        return "fails its sha256 checksum (its bytes changed since `slipstream data prepare` wrote it)"
    if top is not None and top >= vocab:
        return f"holds token id {top}, outside the vocabulary of {vocab}"
    if "max_id" in shard and top != recorded:
        return f"holds ids up to {top} but its manifest records max_id {recorded}"
    return None


def scan_file(path: str, dtype: np.dtype | None = None) -> tuple[str, int | None]:
    """sha256 of a file and (with dtype) its largest token id, in one read."""
    h, top = hashlib.sha256(), None
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            if dtype is not None:
                usable = len(block) - len(block) % dtype.itemsize  # a damaged shard may end mid-token
                if usable:
                    m = int(np.frombuffer(block[:usable], dtype=dtype).max())
                    top = m if top is None else max(top, m)
    return h.hexdigest(), top


def verify_manifest(data_dir: str, checksums: bool = False) -> dict:
    """Check every shard exists with the recorded size and max_id (fast) and optionally its
    sha256 and ids (reads all data); raises on the first damaged shard."""
    manifest = load_manifest(data_dir)
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            problem = shard_problem(data_dir, manifest, shard, checksums)
            if problem:
                raise UserError(f"{split} shard {os.path.join(data_dir, shard['file'])} {problem}; the data in "
                                f"{data_dir!r} is damaged: run `slipstream data prepare` again")
    return manifest


def data_bytes(manifest: dict) -> int:
    itemsize = np.dtype(manifest["dtype"]).itemsize
    return sum(sh["tokens"] * itemsize for info in manifest["splits"].values() for sh in info["shards"])


def wants_checksums(level: str, manifest: dict) -> bool:
    """data.verify: full always hashes, size never, auto when the data is small (AUTO_FULL_BYTES)."""
    if level not in VERIFY_LEVELS:
        raise UserError(f"data.verify = {level!r}; use one of {', '.join(VERIFY_LEVELS)}")
    return level == "full" or (level == "auto" and data_bytes(manifest) <= AUTO_FULL_BYTES)


def verify_data(data_dir: str) -> tuple[dict, list[tuple[str, str, str | None]]]:
    """`slipstream data verify`: (manifest, [(split, shard file, problem or None)]) for every shard, hashed."""
    manifest = load_manifest(data_dir)
    results = []
    for split, info in manifest["splits"].items():
        for shard in info["shards"]:
            results.append((split, shard["file"], shard_problem(data_dir, manifest, shard, checksums=True)))
    return manifest, results


def tokenizer_spec_for(data_dir: str, manifest: dict) -> str:
    """The tokenizer spec to use with prepared data: its own copy of a bpe file if it has one."""
    if manifest.get("tokenizer_file"):
        return f"bpe:{os.path.join(os.path.abspath(data_dir), manifest['tokenizer_file'])}"
    return manifest["tokenizer"]
