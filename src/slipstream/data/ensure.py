"""The prepared token shards of a run: the configured folder, or a cache folder prepared on
first use. Used by the LM job (train/lm.py) and by the tools that prepare data once before
their timed runs (perf/, plan/tune.py).
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

from slipstream.config.schema import Config
from slipstream.errors import UserError


def default_data_dir(cfg: Config) -> Path:
    """data/<tokenizer>-<inputs>-<hash>: one cached folder per (inputs, tokenizer) pair."""
    key = (sorted(cfg.data.inputs), cfg.data.tokenizer, cfg.data.text_field, cfg.data.val_fraction)
    # dedup joins the key only when on, so the folders of existing runs keep their names.
    key = repr(key + (("dedup",) if cfg.data.dedup else ()))
    digest = hashlib.sha256(key.encode()).hexdigest()[:8]
    slug = re.sub(r"[^A-Za-z0-9]+", "-", f"{cfg.data.tokenizer.split('/')[-1]}-{'-'.join(Path(i).name for i in cfg.data.inputs)}")
    return Path("data") / f"{slug.strip('-')[:60]}-{digest}"


def ensure_data(cfg: Config, check: bool = True) -> tuple[Path, dict[str, Any]]:
    """The prepared token shards of this run.

    data.dir set: use that prepared folder as it is (from `slipstream data prepare`).
    data.dir empty: prepare data.inputs on first use into a cache folder; later runs reuse it.
    Either way the shards are checked as data.verify says (check=False: another process on
    this node already did).
    """
    from slipstream.data import prepare_dataset, verify_manifest
    from slipstream.data.prepare import AUTO_FULL_BYTES, data_bytes, load_manifest, wants_checksums

    d = cfg.data
    if "://" in d.dir:
        raise UserError(f"data.dir = {d.dir!r} is a URL; stream it with --data.streaming=true (or download the "
                        "folder and point data.dir at the local copy)")
    if d.dir:
        manifest = load_manifest(d.dir)
        checksums = check and wants_checksums(d.verify, manifest)
        if check:
            verify_manifest(d.dir, checksums=checksums)
        data_dir = Path(d.dir)
    else:
        data_dir = default_data_dir(cfg)
        manifest = prepare_dataset(d.inputs, d.tokenizer, str(data_dir), text_field=d.text_field,
                                   val_fraction=d.val_fraction, num_workers=d.prepare_workers or None, dedup=d.dedup,
                                   progress=cfg.logging.progress, verify=d.verify if check else "size")
        checksums = check and wants_checksums(d.verify, manifest)
    if check and d.verify == "auto" and not checksums:
        print(f"note: {data_dir} holds {data_bytes(manifest) / 2**30:.1f} GiB of shards, more than data.verify=auto "
              f"hashes at start ({AUTO_FULL_BYTES / 2**30:.0f} GiB); sizes checked only. `slipstream data verify "
              f"--dir {data_dir}` or data.verify=full checks their sha256s")
    return data_dir, manifest
