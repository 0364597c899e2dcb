"""Weighted mixtures of prepared data sources: data.sources names them, data.mixture weighs them.

    [data]
    sources = {web = "data/web", code = "s3://bucket/code"}
    mixture = {web = 0.7, code = 0.3}

Every source is a folder from `slipstream data prepare` (or a URL read by the streaming
loader; the streamed sources share data.cache_bytes equally), all with one tokenizer. Each
source has its own stream of windows, read BLOCK at a time from a TokenLoader cut over the
data-parallel ranks like any training split (data.sampling applies), with a seed derived from
(train.seed, source name) so the sources are independent.

Batch i: one numpy Generator seeded by (train.seed, i) draws the source of every sequence of
the global batch (world_size x micro_batch_size draws, from the normalized weights); rank r
takes draws [r * B, (r + 1) * B) and, for each, the next window of the chosen source. The
batches are a pure function of (seed, rank, index, layout), and because each rank knows every
rank's draws it knows every rank's position in every source: rank 0's state (the one a
checkpoint stores) resumes every rank, and the tokens taken per source are the job's exact
counts without a collective. They are logged as data/tokens/<name>, next to the weights in use
(data/weight/<name>), through the loader's metrics().

Resume: the next batch is the one the uninterrupted run would have read. New weights on resume
are allowed (printed and visible in the logged weights): each source continues where it was
and the new weights apply from the next batch. A source no longer in the mixture is dropped
(printed); a new one starts at its beginning. At another number of data-parallel ranks each
source continues after the furthest any rank had read it (its TokenLoader reshards from there;
a streamed source, whose chunks are dealt by the number of ranks, at the first epoch that no
rank had begun).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
from typing import Any

import numpy as np
import torch

from slipstream.config.schema import Config
from slipstream.data.eval_windows import EvalWindows
from slipstream.data.loader import TokenLoader
from slipstream.data.loader_checks import check_positive, check_rank, check_state, seed_key
from slipstream.data.manifest import load_manifest, tokenizer_spec_for, verify_manifest, wants_checksums
from slipstream.data.train_data import TrainData
from slipstream.errors import UserError

MIX_TAG = 0x6D6978  # "mix": keeps the source draws apart from any TokenLoader stream of the same seed
# Windows a source's loader reads per call. One window per call cost ~1.1 ms per batch of
# 16 x 1024 tokens here (a numpy Generator and a tensor per window); a block of 16, ~0.3 ms.
BLOCK = 16


def is_url(location: str) -> bool:
    return "://" in location


def source_seed(seed: int, name: str) -> int:
    """A seed per (train.seed, source): stable across processes and Python runs (not hash())."""
    return int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little") >> 1


def normalized(mixture: dict[str, float]) -> dict[str, float]:
    """The weights in name order, summing to 1 (config/load.py already refused negative or all-zero weights)."""
    total = float(sum(mixture.values()))
    if not total > 0 or any(not w >= 0 for w in mixture.values()):
        raise UserError(f"data.mixture = {mixture}: weights must be >= 0 and at least one > 0")
    return {name: float(mixture[name]) / total for name in sorted(mixture)}


def _streams(cfg: Config, location: str) -> bool:
    return cfg.data.streaming or is_url(location)


def _locations(cfg: Config) -> dict[str, str]:
    """name -> location of every weighted source, in name order (the order the draws index)."""
    missing = sorted(set(cfg.data.mixture) - set(cfg.data.sources))
    if missing:
        raise UserError(f"data.mixture names {', '.join(missing)}, which data.sources does not define; add "
                        f"--data.sources.{missing[0]}=PATH_OR_URL (a folder from `slipstream data prepare`)")
    return {name: cfg.data.sources[name] for name in sorted(cfg.data.mixture)}


# -- opening and checking the sources


def _open_source(cfg: Config, name: str, location: str, check: bool) -> TrainData:
    try:
        if _streams(cfg, location):
            from slipstream.data.streaming import open_stream_url

            return open_stream_url(location, cfg, check)
        manifest = load_manifest(location)
        if check:
            verify_manifest(location, checksums=wants_checksums(cfg.data.verify, manifest))
    except UserError as e:
        raise UserError(f"data.sources.{name}: {e}") from None
    return TrainData(location, manifest, tokenizer_spec_for(location, manifest), location)


def _tokenizer_identity(manifest: dict) -> dict[str, Any]:
    # A bpe file's spec names its path, which differs between copies of one tokenizer: its
    # fingerprint (a hash of the file) is what says two folders share it.
    return {"tokenizer": manifest.get("tokenizer_fingerprint") or manifest.get("tokenizer"),
            "vocab_size": manifest.get("vocab_size"), "eot_id": manifest.get("eot_id")}


def open_mixture(cfg: Config, check: bool = True) -> TrainData:
    """Open (and check, as data.verify says) every source of data.mixture; they must share one
    tokenizer. The run records its first source (name order) as its data."""
    opened = {name: _open_source(cfg, name, location, check) for name, location in _locations(cfg).items()}
    first_name, first = next(iter(opened.items()))
    want = _tokenizer_identity(first.manifest)
    for name, data in opened.items():
        got = _tokenizer_identity(data.manifest)
        if got != want:
            diffs = ", ".join(f"{k} {want[k]!r} vs {got[k]!r}" for k in want if want[k] != got[k])
            raise UserError(f"data.sources.{first_name} ({first.location}) and data.sources.{name} ({data.location}) "
                            f"were prepared with different tokenizers ({diffs}); a mixture trains one model on one "
                            f"vocabulary: prepare {name} again with `slipstream data prepare --tokenizer "
                            f"{first.manifest.get('tokenizer')}`")
    # Evaluation reads the val split of every source of positive weight that has one
    # (mixture_val_windows), not only the first source's.
    weighted = [name for name, w in normalized(cfg.data.mixture).items() if w > 0]
    return dataclasses.replace(first, val_tokens=max(opened[name].val_tokens for name in weighted))


# -- training batches


class _Windows:
    """One source's windows in order: window n is row n % BLOCK of batch n // BLOCK of the
    source's loader (a loader of BLOCK sequences), read a block at a time."""

    def __init__(self, loader) -> None:
        self.loader = loader
        self.position = 0  # windows handed out
        self._block: tuple[np.ndarray, np.ndarray] | None = None  # the block holding `position`, once read

    def take(self, out_x: np.ndarray, out_y: np.ndarray) -> None:
        row = self.position % BLOCK
        if row == 0 or self._block is None:
            x, y = next(self.loader)  # the loader stands at block position // BLOCK (see seek)
            self._block = (x.numpy(), y.numpy())
        out_x[...] = self._block[0][row]
        out_y[...] = self._block[1][row]
        self.position += 1

    def seek(self, saved_state: dict, position: int, resharded: bool) -> None:
        """Continue at window `position` of a loader state saved by this layout; resharded: the
        state was saved by another number of ranks and `position` is the furthest any had read
        (the loader reshards it, rounding up to a block so no window of the furthest is read twice;
        a streamed source continues at the first epoch no rank had begun, see _stream_restart)."""
        streamed = saved_state.get("kind") == "StreamingTokenLoader"
        if streamed and resharded:
            position, resharded = _stream_restart(self.loader, position, saved_state.get("world_size")), False
        block = -(-position // BLOCK) if resharded else position // BLOCK
        state = {**saved_state, "batch_index": block}
        if streamed:
            state.update(_stream_position(self.loader, block * BLOCK), world_size=self.loader.world_size)
        self.loader.load_state_dict(state)
        self._block = None
        self.position = self.loader.state_dict()["batch_index"] * BLOCK if resharded else position


def _stream_restart(loader, furthest: int, saved_world) -> int:
    """Windows of this layout before the first epoch that no rank of the saved layout had begun,
    its furthest rank having read `furthest` windows: a streamed source's windows depend on the
    number of ranks, so it reshards at an epoch boundary (the rest of a begun epoch is skipped,
    nothing is read twice)."""
    if not isinstance(saved_world, int) or isinstance(saved_world, bool) or saved_world < 1:
        raise UserError("the checkpoint's data mixture state is malformed (the checkpoint is damaged); resume from "
                        "another checkpoint or start a fresh run")
    epoch, left = 0, furthest
    while left > 0:
        per_epoch = loader.windows_per_rank(epoch, saved_world)
        if per_epoch == 0:
            raise UserError(f"the checkpoint was saved by {saved_world} data-parallel ranks, more than this source's "
                            "chunks allow; resume with as many ranks as it was saved with")
        left -= per_epoch
        epoch += 1
    return sum(loader._plan(e)[2] for e in range(epoch))


def _stream_position(loader, windows: int) -> dict[str, int]:
    """The epoch and position of a StreamingTokenLoader that has handed out `windows` windows:
    its epochs hold the same number of windows on every rank (see streaming.py)."""
    epoch = 0
    while windows >= (per_epoch := loader._plan(epoch)[2]):
        windows -= per_epoch
        epoch += 1
    return {"epoch": epoch, "position": windows}


class MixtureLoader:
    """Infinite, resumable (x, y) batches drawn from several sources by weight (see module doc)."""

    def __init__(self, sources: dict[str, Any], weights: dict[str, float], batch_size: int, seq_len: int,
                 seed: int = 0, rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu",
                 pin_memory: bool = True) -> None:
        """sources: name -> a loader of BLOCK windows per batch (TokenLoader or a streaming
        loader) built for this rank, on the CPU; weights: name -> weight (normalized here)."""
        check_positive(batch_size=batch_size, seq_len=seq_len)
        check_rank(rank, world_size)
        if set(sources) != set(weights):
            raise UserError(f"mixture sources {sorted(sources)} and weights {sorted(weights)} name different sources")
        self.names = sorted(sources)
        self.sources = {name: sources[name] for name in self.names}
        self._streams = [_Windows(self.sources[name]) for name in self.names]
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        first = self.sources[self.names[0]]
        self.vocab_size, self.eot_id = first.vocab_size, first.eot_id
        self._set_weights(normalized(weights))
        self._pin = pin_memory and self.device.type == "cuda"
        self._batch_index = 0
        # Windows each rank has taken from each source (every rank's, see the module doc) and
        # the job's windows per source since the run began (across weight and layout changes).
        self._taken = np.zeros((world_size, len(self.names)), dtype=np.int64)
        self._windows = np.zeros(len(self.names), dtype=np.int64)

    @classmethod
    def from_config(cls, cfg: Config, rank: int = 0, world_size: int = 1,
                    device: str | torch.device = "cpu") -> "MixtureLoader":
        t = cfg.train
        sources: dict[str, Any] = {}
        try:
            for name, location in _locations(cfg).items():
                sources[name] = open_source_loader(cfg, name, location, "train", rank, world_size)
        except BaseException:
            for opened in sources.values():  # a streamed source's download threads and cache folder lock
                getattr(opened, "close", lambda: None)()
            raise
        return cls(sources, dict(cfg.data.mixture), t.micro_batch_size, t.seq_len, seed=t.seed, rank=rank,
                   world_size=world_size, device=device, pin_memory=cfg.data.pin_memory)

    def _set_weights(self, weights: dict[str, float]) -> None:
        self.weights = weights
        w = np.array([weights[n] for n in self.names], dtype=np.float64)
        self._cdf = np.cumsum(w) / w.sum()
        self._last_positive = int(np.flatnonzero(w > 0)[-1])  # a rounding draw never lands on a zero weight

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    # -- batch construction

    def draws(self, index: int) -> np.ndarray:
        """Source numbers (into self.names) of batch `index` on every rank: shape (world_size, batch_size)."""
        rng = np.random.default_rng([seed_key(self.seed), MIX_TAG, index])
        u = rng.random(self.world_size * self.batch_size)
        picks = np.minimum(np.searchsorted(self._cdf, u, side="right"), self._last_positive)
        return picks.reshape(self.world_size, self.batch_size)

    def __iter__(self) -> "MixtureLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        draws = self.draws(self._batch_index)
        host = torch.empty((2, self.batch_size, self.seq_len), dtype=torch.int64, pin_memory=self._pin)
        buf = host.numpy()
        for b, k in enumerate(draws[self.rank].tolist()):
            self._streams[k].take(buf[0, b], buf[1, b])
        counts = np.stack([np.bincount(row, minlength=len(self.names)) for row in draws])
        self._taken += counts
        self._windows += counts.sum(axis=0)
        self._batch_index += 1
        if self.device.type != "cpu":
            host = host.to(self.device, non_blocking=self._pin)  # the caching allocator keeps the pinned block alive
        return host[0], host[1]

    def metrics(self) -> dict[str, float]:
        """Logged with every training interval: the job's tokens per source so far, its share
        of all tokens, and the weights in use (they may change on resume)."""
        total = max(int(self._windows.sum()), 1)
        out: dict[str, float] = {}
        for k, name in enumerate(self.names):
            out[f"data/tokens/{name}"] = int(self._windows[k]) * self.seq_len
            out[f"data/share/{name}"] = int(self._windows[k]) / total
            out[f"data/weight/{name}"] = self.weights[name]
        return out

    def close(self) -> None:
        for inner in self.sources.values():
            close = getattr(inner, "close", None)
            if close is not None:
                close()

    # -- resume

    def state_dict(self) -> dict:
        """JSON-serialisable; any rank's state resumes every rank (each holds every rank's positions)."""
        return {
            "kind": "MixtureLoader", "seed": self.seed, "seq_len": self.seq_len,
            "batch_size": self.batch_size, "world_size": self.world_size, "rank": self.rank,
            "batch_index": self._batch_index, "weights": dict(self.weights),
            "sources": {name: {"taken": self._taken[:, k].tolist(), "tokens": int(self._windows[k]) * self.seq_len,
                               "state": self.sources[name].state_dict()}
                        for k, name in enumerate(self.names)},
        }

    def load_state_dict(self, state: dict) -> None:
        check_state("MixtureLoader", state, {"seed": self.seed, "seq_len": self.seq_len})
        saved = _saved_sources(state)
        saved_world = state["world_size"]
        self._batch_index = state["batch_index"]
        self._taken[:] = 0
        self._windows[:] = 0
        for k, name in enumerate(self.names):
            stream = self._streams[k]
            if name not in saved:  # a new source: it starts at its beginning
                stream.seek(self.sources[name].state_dict(), 0, resharded=False)
                continue
            taken = saved[name]["taken"]
            # Same ranks: this rank's own position. Other ranks: after the furthest any rank read.
            resharded = saved_world != self.world_size
            try:
                stream.seek(saved[name]["state"], max(taken) if resharded else taken[self.rank], resharded)
            except UserError as e:
                raise UserError(f"data.sources.{name}: {e}") from None
            self._taken[:, k] = stream.position if resharded else taken
            self._windows[k] = saved[name]["tokens"] // self.seq_len
        notes = []
        dropped = sorted(set(saved) - set(self.names))
        if dropped:
            notes.append(f"data.mixture: source(s) {', '.join(dropped)} of the checkpoint are no longer in the "
                         "mixture; dropped")
        added = sorted(set(self.names) - set(saved))
        if added:
            notes.append(f"data.mixture: new source(s) {', '.join(added)} start at their beginning")
        before = {n: round(float(w), 6) for n, w in state["weights"].items()}
        after = {n: round(w, 6) for n, w in self.weights.items()}
        if before != after:
            notes.append(f"data.mixture weights changed on resume: {before} -> {after}")
        if notes and self.rank == 0 and os.environ.get("RANK", "0") == "0":  # once per job
            print("\n".join(notes))


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _saved_sources(state: dict) -> dict:
    """The per-source part of a saved state, checked: a damaged checkpoint fails here, with
    what to do, instead of as an IndexError inside the loader."""
    sources, world = state.get("sources"), state.get("world_size")
    ok = (isinstance(sources, dict) and isinstance(state.get("weights"), dict) and _count(world) and world >= 1
          and _count(state.get("batch_index")))
    for entry in sources.values() if ok else ():
        taken = entry.get("taken") if isinstance(entry, dict) else None
        ok = ok and (isinstance(taken, list) and len(taken) == world and all(map(_count, taken))
                     and _count(entry.get("tokens")) and isinstance(entry.get("state"), dict))
    if not ok:
        raise UserError("the checkpoint's data mixture state is malformed (the checkpoint is damaged); resume from "
                        "another checkpoint or start a fresh run")
    return sources


def open_source_loader(cfg: Config, name: str, location: str, split: str, rank: int, world_size: int):
    """One source's windows for this rank: BLOCK sequences per batch, on the CPU (the mixture
    assembles its batch from them and moves it to the device)."""
    t, d = cfg.train, cfg.data
    seed = source_seed(t.seed, name)
    # data.cache_bytes bounds the process's read-ahead cache: its streamed sources share it.
    streamed = sum(_streams(cfg, loc) for loc in _locations(cfg).values()) if cfg.data.mixture else 1
    share = d.cache_bytes // max(streamed, 1)
    try:
        if _streams(cfg, location):
            from slipstream.data.streaming import StreamingTokenLoader

            try:
                # Each URL gets its own folder under data.cache_dir (streaming.cache_root).
                return StreamingTokenLoader(location, split, BLOCK, t.seq_len, seed=seed, rank=rank,
                                            world_size=world_size, device="cpu", cache_dir=d.cache_dir,
                                            cache_bytes=share, readahead=d.readahead, threads=d.stream_threads,
                                            retries=d.retries)
            except UserError as e:
                if streamed > 1 and "cache_bytes" in str(e):
                    raise UserError(f"{e} (the {streamed} streamed sources of data.mixture share data.cache_bytes = "
                                    f"{d.cache_bytes:,}: {share:,} bytes each)") from None
                raise
        return TokenLoader(location, split, BLOCK, t.seq_len, seed=seed, mode=d.sampling, rank=rank,
                           world_size=world_size, device="cpu", prefetch=0, num_workers=0, augment=d.augment,
                           augment_prob=d.augment_prob, augment_cost_ms=d.augment_cost_ms)
    except UserError as e:
        raise UserError(f"data.sources.{name}: {e}") from None


# -- evaluation


class MixtureEvalWindows(EvalWindows):
    """Each source's fixed evaluation windows, one after the other (EvalWindows's interface,
    so the Evaluator scores them as one set: the loss is the mean over all windows)."""

    def __init__(self, parts: dict[str, EvalWindows], device: str | torch.device = "cpu") -> None:
        # Not EvalWindows.__init__: the parts already hold their windows.
        self.parts = parts
        first = next(iter(parts.values()))
        self.split, self.seq_len, self.batch_size = first.split, first.seq_len, first.batch_size
        self.rank, self.world_size, self.device = first.rank, first.world_size, torch.device(device)
        self.vocab_size = first.vocab_size
        self.n_windows = sum(p.n_windows for p in parts.values())
        self.tokens = sum(p.tokens for p in parts.values())
        self.sampled = any(p.sampled for p in parts.values())
        self.n_batches = sum(p.n_batches for p in parts.values())  # the same on every rank, part by part

    def __iter__(self):
        for part in self.parts.values():
            yield from part


def eval_shares(weights: dict[str, float], eval_tokens: int, seq_len: int) -> dict[str, int]:
    """Target evaluation tokens per source: eval_tokens split by weight, at least one window
    for each source of positive weight (zero-weight sources are not evaluated)."""
    return {name: max(seq_len, int(eval_tokens * w)) for name, w in weights.items() if w > 0}


def mixture_val_windows(cfg: Config, rank: int = 0, world_size: int = 1,
                        device: str | torch.device = "cpu") -> MixtureEvalWindows:
    """The fixed evaluation windows of a mixture: each source's val split, eval_tokens shared by weight."""
    t = cfg.train
    locations = _locations(cfg)
    parts: dict[str, EvalWindows] = {}
    skipped = []
    for name, tokens in eval_shares(normalized(cfg.data.mixture), t.eval_tokens, t.seq_len).items():
        location = locations[name]
        if _streams(cfg, location):
            from slipstream.data.streaming import streaming_val_windows

            opened = _open_source(cfg, name, location, check=False)
            if opened.val_tokens <= t.seq_len:
                skipped.append(name)
                continue
            one = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, dir=location, streaming=True,
                                                                    mixture={}, sources={}),
                                      train=dataclasses.replace(t, eval_tokens=tokens))
            parts[name] = streaming_val_windows(one, opened, rank=rank, world_size=world_size, device=device)
            continue
        val = load_manifest(location)["splits"].get("val", {})
        if sum(s["tokens"] for s in val.get("shards", [])) <= t.seq_len:
            skipped.append(name)
            continue
        parts[name] = EvalWindows(location, "val", t.micro_batch_size, t.seq_len, tokens, rank=rank,
                                  world_size=world_size, device=device)
    if not parts:
        raise UserError(f"no source of data.mixture ({', '.join(locations)}) has a validation split longer than "
                        f"train.seq_len = {t.seq_len}; prepare them with data.val_fraction > 0, or set "
                        "--train.eval_tokens=0")
    if skipped and rank == 0 and os.environ.get("RANK", "0") == "0":
        print(f"note: data.sources {', '.join(skipped)} have no validation split longer than one sequence; "
              "evaluation uses the other sources")
    return MixtureEvalWindows(parts, device)
