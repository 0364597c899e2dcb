"""The data of a language-model run, whatever its kind: one prepared folder read locally, one
streamed from a URL (data.streaming), or a weighted mixture of several (data.mixture).

train/lm.py asks this module for three things and never looks at which kind it got:
open_train_data (the manifest that sizes the model and the tokenizer to record), the
training loader of a data-parallel rank, and the fixed evaluation windows. Ranks of one
model-parallel group (tp, cp, pp, ep) pass the same (dp_rank, dp) and so read the same batches.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slipstream.config.schema import Config
from slipstream.errors import UserError


@dataclass
class TrainData:
    """What the run trains on: `location` is recorded as data.dir in the run's config."""

    location: str  # a local folder or a URL (streaming); for a mixture, its first source
    manifest: dict[str, Any]  # sizes the model (vocab_size) and names the tokenizer
    tokenizer: str  # a spec get_tokenizer can open on this machine (a bpe file is local)
    local_dir: str | None = None  # the folder holding the shards on this machine (None: streamed)
    # Tokens of the validation data (a mixture: its largest source's; evaluation is off when
    # no window fits). None: the manifest's val split.
    val_tokens: int | None = None

    def __post_init__(self) -> None:
        if self.val_tokens is None:
            self.val_tokens = int(self.manifest.get("splits", {}).get("val", {}).get("tokens", 0))


def open_train_data(cfg: Config, check: bool = True) -> TrainData:
    """Prepare (or find) the data of this run and check it as data.verify says. check=False:
    another process on this node already did."""
    d = cfg.data
    if d.mixture:
        from slipstream.data.mixture import open_mixture

        return open_mixture(cfg, check)
    if d.streaming:
        from slipstream.data.streaming import open_stream

        return open_stream(cfg, check)
    from slipstream.data.ensure import ensure_data
    from slipstream.data.manifest import tokenizer_spec_for

    data_dir, manifest = ensure_data(cfg, check=check)
    return TrainData(str(data_dir), manifest, tokenizer_spec_for(str(data_dir), manifest), str(data_dir))


def check_same_data(data: TrainData, broadcast: Callable[[str], str]) -> None:
    """Every rank must read the same data. Each rank opens it on its own (a streamed manifest is
    fetched per process), so a manifest re-uploaded while the job starts, or node-local folders
    that differ, would give the ranks different chunk lists: overlapping or missing data, ranks
    out of step. broadcast(value) returns rank 0's value on every rank."""
    digest = hashlib.sha256(json.dumps(data.manifest, sort_keys=True).encode()).hexdigest()
    first = broadcast(digest)  # a collective: every rank calls it once, at start-up
    if first != digest:
        raise UserError(f"this rank read another manifest for {data.location} than rank 0 (sha256 {digest[:12]} vs "
                        f"{first[:12]}): the data changed while the job started, or the nodes' copies differ; make "
                        "every node read the same prepared folder and start again")


def make_train_loader(cfg: Config, data: TrainData, rank: int, world_size: int, device: torch.device):
    """The stateful training loader of data-parallel rank `rank` of `world_size`."""
    t, d = cfg.train, cfg.data
    if d.mixture:
        from slipstream.data.mixture import MixtureLoader

        return MixtureLoader.from_config(cfg, rank=rank, world_size=world_size, device=device)
    if d.streaming:
        from slipstream.data.streaming import StreamingTokenLoader

        return StreamingTokenLoader.from_config(cfg, data, "train", rank=rank, world_size=world_size, device=device)
    from slipstream.data.loader import TokenLoader

    return TokenLoader(data.local_dir, "train", t.micro_batch_size, t.seq_len, seed=t.seed,
                       mode=d.sampling, device=device, prefetch=d.prefetch, num_workers=d.num_workers,
                       rank=rank, world_size=world_size, pin_memory=d.pin_memory, augment=d.augment,
                       augment_prob=d.augment_prob, augment_cost_ms=d.augment_cost_ms)


def make_val_windows(cfg: Config, data: TrainData, rank: int, world_size: int, device: torch.device):
    """The fixed evaluation windows of this rank (the same at every evaluation and resume)."""
    t, d = cfg.train, cfg.data
    if d.mixture:
        from slipstream.data.mixture import mixture_val_windows

        return mixture_val_windows(cfg, rank=rank, world_size=world_size, device=device)
    if d.streaming:
        from slipstream.data.streaming import streaming_val_windows

        return streaming_val_windows(cfg, data, rank=rank, world_size=world_size, device=device)
    from slipstream.data.eval_windows import EvalWindows

    return EvalWindows(data.local_dir, "val", t.micro_batch_size, t.seq_len, t.eval_tokens,
                       rank=rank, world_size=world_size, device=device)


class CalibrationInputs:
    """The input ids of fixed windows of the train split, batch by batch, for data-aware pruning
    (sparsity.criterion = wanda): the same windows at every pass, on every rank (each rank reads
    all of them: the masks they decide must be equal everywhere) and after resume."""

    def __init__(self, data_dir: str, batch_size: int, seq_len: int, tokens: int, device: torch.device | str = "cpu"):
        from slipstream.data.eval_windows import EvalWindows

        self.windows = EvalWindows(data_dir, "train", batch_size, seq_len, tokens, device=device)

    def __iter__(self):
        for (x, _), _weight in self.windows:
            yield x
