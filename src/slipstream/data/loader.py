"""Batches for training: prepared token shards (TokenLoader) and any map-style dataset
(DatasetLoader, in dataset_loader.py; importable from here too).

Both loaders are infinite iterators whose position is a single counter, which makes
them resumable: `state_dict()` is a few plain ints, and after `load_state_dict()` the
next batch is exactly the batch the original loader would have produced next.

TokenLoader treats the shards of a split as one continuous token stream (shards are
just storage), so windows may cross shard boundaries; a window never reads past the
end of the split. Every window holds seq_len + 1 tokens: x is the first seq_len, y the
last seq_len (x shifted by one).

Loss masks: a split prepared with one (manifest "loss_mask": true; each shard's "mask_file",
one uint8 per token, 1 = the token is a training target) is memory-mapped next to its tokens
and read over the same window: y = -100 (IGNORE_INDEX, skipped by every LM loss) wherever the
target token's mask byte is 0, e.g. the prompt of a supervised fine-tuning record.

  mode="random":     each batch draws window starts uniformly with a numpy Generator
                     seeded by (seed, rank, batch index). The stream is cut into
                     world_size contiguous regions; rank r samples only inside region r,
                     so ranks never see the same tokens.
  mode="sequential": the split is cut into non-overlapping windows (window i starts at
                     token i * seq_len). Each epoch visits them in an order shuffled by
                     (seed, epoch); the i-th window of that order goes to rank
                     i % world_size (leftovers that would make ranks uneven are skipped
                     that epoch). A rank's batches take consecutive windows of its list
                     and simply run on into the next epoch.

On CUDA the batch is assembled in pinned host memory by a background thread one step
ahead, and copied with non_blocking=True, so data loading overlaps the current step.
"""

from __future__ import annotations

import itertools
import os
import random
import queue
import threading
import time
import weakref
from typing import Callable, Iterator

import numpy as np
import torch

from slipstream.data.dataset_loader import DatasetLoader  # noqa: F401  (callers import it from here)
from slipstream.data.loader_checks import check_positive, check_rank, check_state, seed_key
from slipstream.data.manifest import load_manifest, shard_problem
from slipstream.errors import UserError

MODES = ("random", "sequential")
AUGMENTATIONS = ("none", "swap_tokens")
PREFETCH_DEPTH = 2
IGNORE_INDEX = -100  # a target no loss counts (train/lm_loss.py; F.cross_entropy's default)


class TokenLoader:
    """Infinite, resumable (x, y) batches from a prepared split (see module doc)."""

    def __init__(
        self,
        data_dir: str,
        split: str,
        batch_size: int,
        seq_len: int,
        seed: int = 0,
        mode: str = "random",
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        prefetch: int = PREFETCH_DEPTH,
        num_workers: int = 0,
        pin_memory: bool = True,
        augment: str = "none",
        augment_prob: float = 0.1,
        augment_cost_ms: float = 0.0,
    ) -> None:
        check_positive(batch_size=batch_size, seq_len=seq_len)
        if augment not in AUGMENTATIONS:
            raise UserError(f"unknown augmentation {augment!r}; use one of {', '.join(AUGMENTATIONS)}")
        if not 0.0 <= augment_prob <= 1.0:
            raise UserError(f"augment_prob={augment_prob} must be in [0, 1]")
        if num_workers < 0 or int(prefetch) < 0:
            raise UserError(f"num_workers={num_workers} and prefetch={prefetch} must be >= 0")
        check_rank(rank, world_size)
        if mode not in MODES:
            raise UserError(f"unknown data loader mode {mode!r}; use one of {', '.join(MODES)}")
        manifest = load_manifest(data_dir)
        if split not in manifest["splits"]:
            raise UserError(f"split {split!r} not found in {data_dir!r}; available: {', '.join(manifest['splits'])}")

        self.data_dir, self.split, self.mode = data_dir, split, mode
        self.batch_size, self.seq_len, self.seed = batch_size, seq_len, seed
        self.rank, self.world_size = rank, world_size
        self.device = torch.device(device)
        self.vocab_size: int = manifest["vocab_size"]
        self.eot_id: int = manifest["eot_id"]
        self.manifest = manifest

        # Memory-map every non-empty shard; the OS page cache does the buffering.
        dtype = np.dtype(manifest["dtype"]).newbyteorder("<")
        self._shards = []
        self._shard_files = []
        self.loss_mask = bool(manifest.get("loss_mask"))
        self._masks: list[np.memmap] | None = [] if self.loss_mask else None
        for shard in manifest["splits"][split]["shards"]:
            path = os.path.join(data_dir, shard["file"])
            problem = shard_problem(data_dir, manifest, shard, checksums=False)  # size and max_id: no reading
            if problem:
                raise UserError(f"{split} shard {path} {problem}; run `slipstream data prepare` again")
            if shard["tokens"] > 0:
                self._shards.append(np.memmap(path, dtype=dtype, mode="r", shape=(shard["tokens"],)))
                self._shard_files.append(path)
                if self._masks is not None:
                    self._masks.append(_open_mask(data_dir, split, shard))
        self._shard_ends = np.cumsum([len(m) for m in self._shards], dtype=np.int64)
        self.total_tokens = int(self._shard_ends[-1]) if self._shards else 0

        window = seq_len + 1
        if mode == "random":
            self._lo = rank * self.total_tokens // world_size
            self._hi = (rank + 1) * self.total_tokens // world_size
            available, needed = self._hi - self._lo, window
        else:
            self._n_windows = max(self.total_tokens - 1, 0) // seq_len
            self._per_rank = self._n_windows // world_size
            available, needed = self.total_tokens, world_size * seq_len + 1
        if available < needed:
            who = f"rank {rank} of {world_size} gets {available:,} of its {self.total_tokens:,} tokens" if world_size > 1 else f"it has {available:,} tokens"
            raise UserError(
                f"split {split!r} in {data_dir!r} is too small: {who}, but one window of seq_len + 1 = {window} "
                f"tokens per rank needs {needed:,}; use a smaller seq_len or prepare more data"
            )

        self._batch_index = 0  # batches handed out so far: the whole loader state
        self._epoch_cache: dict[int, np.ndarray] = {}
        self._cuda = self.device.type == "cuda"
        self.augment, self.augment_prob, self.augment_cost_ms = augment, augment_prob, augment_cost_ms
        self.num_workers = num_workers
        self._pin = pin_memory and self._cuda  # pinned allocations raise on CPU-only builds
        self._depth = int(prefetch)
        # Without workers, a background thread builds the next batches on CUDA so the copy
        # overlaps the step; with workers the DataLoader does that (prefetch_factor = depth).
        self._prefetch = self._depth > 0 and self._cuda and num_workers == 0
        self._workers_it: Iterator | None = None
        self._thread: threading.Thread | None = None
        self._stop: threading.Event | None = None
        self._queue: queue.Queue | None = None

    # -- properties

    @property
    def tokens_per_batch(self) -> int:
        """Input tokens per batch on this rank (multiply by world_size for the global batch)."""
        return self.batch_size * self.seq_len

    # -- batch construction (pure functions of the batch index)

    def _epoch_windows(self, epoch: int) -> np.ndarray:
        """Window numbers this rank visits in `epoch`, in order."""
        if epoch not in self._epoch_cache:
            order = np.random.default_rng([seed_key(self.seed), epoch]).permutation(self._n_windows)
            mine = order[self.rank :: self.world_size][: self._per_rank]
            self._epoch_cache = {k: v for k, v in self._epoch_cache.items() if k >= epoch - 1}  # keep it small
            self._epoch_cache[epoch] = mine
        return self._epoch_cache[epoch]

    def _batch_starts(self, index: int) -> np.ndarray:
        if self.mode == "random":
            rng = np.random.default_rng([seed_key(self.seed), self.rank, index])
            return rng.integers(self._lo, self._hi - self.seq_len, size=self.batch_size)  # high is exclusive
        positions = index * self.batch_size + np.arange(self.batch_size)
        epochs, offsets = positions // self._per_rank, positions % self._per_rank
        windows = np.array([self._epoch_windows(int(e))[o] for e, o in zip(epochs, offsets)], dtype=np.int64)
        return windows * self.seq_len

    def read(self, start: int, out: np.ndarray, mask_out: np.ndarray | None = None) -> None:
        """Copy tokens [start, start + len(out)) of the split into out, across shard boundaries
        (and their loss-mask bytes into mask_out, when given and the split has a loss mask)."""
        pos, k = 0, int(np.searchsorted(self._shard_ends, start, side="right"))
        masks = self._masks if mask_out is not None else None
        while pos < len(out):
            shard = self._shards[k]
            offset = start + pos - (int(self._shard_ends[k]) - len(shard))
            take = min(len(out) - pos, len(shard) - offset)
            out[pos : pos + take] = shard[offset : offset + take]
            if masks is not None:
                mask_out[pos : pos + take] = masks[k][offset : offset + take]
            pos += take
            k += 1
        # The manifest's vocab_size and max_id may lie (data from elsewhere, a shard edited
        # after its sha256 was fixed up): no id the embedding cannot index leaves the loader.
        # One max over the window costs microseconds per batch.
        if len(out) and out.max() >= self.vocab_size:
            raise self._bad_token(start, out)

    def _fill(self, index: int, out: np.ndarray) -> None:
        """Write batch `index` into out of shape (2, batch_size, seq_len): out[0] = x, out[1] = y."""
        window = np.empty(self.seq_len + 1, dtype=np.int64)
        mask = np.empty(self.seq_len + 1, dtype=np.uint8) if self._masks is not None else None
        for b, start in enumerate(self._batch_starts(index).tolist()):
            self.read(start, window, mask)
            out[0, b] = window[:-1]
            out[1, b] = window[1:]
            if mask is not None:
                out[1, b][mask[1:] == 0] = IGNORE_INDEX

    def _bad_token(self, start: int, window: np.ndarray) -> UserError:
        pos = start + int(np.argmax(window >= self.vocab_size))
        k = int(np.searchsorted(self._shard_ends, pos, side="right"))
        offset = pos - (int(self._shard_ends[k]) - len(self._shards[k]))
        return UserError(f"{self.split} shard {self._shard_files[k]} holds token id {int(self._shards[k][offset])} at "
                         f"token {offset}, outside the vocabulary of {self.vocab_size} its manifest declares; the data "
                         f"in {self.data_dir!r} is damaged or its manifest is wrong: run `slipstream data prepare` again")

    def _host_batch(self, index: int, pin: bool | None = None) -> torch.Tensor:
        host = torch.empty((2, self.batch_size, self.seq_len), dtype=torch.int64,
                           pin_memory=self._pin if pin is None else pin)
        self._fill(index, host.numpy())
        if self.augment != "none":
            _augment_swap_tokens(host[0].numpy(), self.augment_prob, [seed_key(self.seed), self.rank, index, 1])
            _busy_cpu(self.augment_cost_ms * self.batch_size / 1e3)
        return host

    # -- pickling (DataLoader workers get a copy of the loader; memmaps are reopened there)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        for key in ("_shards", "_masks", "_thread", "_stop", "_queue", "_workers_it"):
            state[key] = None
        shards = [sh for sh in self.manifest["splits"][self.split]["shards"] if sh["tokens"] > 0]
        state["_paths"] = [os.path.join(self.data_dir, sh["file"]) for sh in shards]
        state["_mask_paths"] = [os.path.join(self.data_dir, sh["mask_file"]) for sh in shards] if self.loss_mask else None
        return state

    def __setstate__(self, state: dict) -> None:
        paths, mask_paths = state.pop("_paths"), state.pop("_mask_paths")
        self.__dict__.update(state)
        dtype = np.dtype(self.manifest["dtype"]).newbyteorder("<")
        self._shards = [np.memmap(p, dtype=dtype, mode="r") for p in paths]
        self._masks = [np.memmap(p, dtype=np.uint8, mode="r") for p in mask_paths] if mask_paths is not None else None

    # -- iteration

    def __iter__(self) -> "TokenLoader":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self.num_workers > 0:
            host = self._next_from_workers()
        elif self._prefetch:
            host = self._next_prefetched()
        else:
            host = self._host_batch(self._batch_index)
        self._batch_index += 1
        if self.device.type != "cpu":
            # The caching host allocator keeps the pinned block alive until this copy is done.
            host = host.to(self.device, non_blocking=self._cuda)
        return host[0], host[1]

    def _next_from_workers(self) -> torch.Tensor:
        """Batches are pure functions of their index, so workers build them in any process
        and the result is the same as in-process, batch for batch."""
        if self._workers_it is None:
            loader = torch.utils.data.DataLoader(
                _BatchesByIndex(self), batch_size=None, sampler=_CountFrom(self._batch_index),
                num_workers=self.num_workers, pin_memory=self._pin,
                prefetch_factor=max(1, self._depth), persistent_workers=False)
            self._workers_it = iter(loader)
        try:
            return next(self._workers_it)
        except UserError as e:
            # A worker's error comes back with its traceback text in the message; the user
            # needs the message only (its last line: "slipstream.errors.UserError: ...").
            last = str(e).rstrip().splitlines()[-1]
            prefix = f"{UserError.__module__}.{UserError.__name__}: "
            raise UserError(last[len(prefix):] if last.startswith(prefix) else str(e)) from None

    def _next_prefetched(self) -> torch.Tensor:
        if self._thread is None:
            self._start_thread()
        item = self._queue.get()
        if isinstance(item, BaseException):
            self.close()
            raise item
        index, host = item
        assert index == self._batch_index, "prefetch thread out of step"
        return host

    def _start_thread(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self._depth)
        # The thread holds only a weak reference, so a dropped loader is collected and its thread ends.
        weakref.finalize(self, self._stop.set)
        self._thread = threading.Thread(
            target=_prefetch_worker,
            args=(weakref.ref(self), self._batch_index, self._stop, self._queue, self.device),
            name="slipstream-token-prefetch",
            daemon=True,
        )
        self._thread.start()

    def close(self) -> None:
        """Stop the prefetch thread or worker processes (if any). Iterating again restarts them."""
        if self._workers_it is not None:
            # Shut workers down now rather than whenever the garbage collector gets to them.
            shutdown = getattr(self._workers_it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
            self._workers_it = None
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = self._stop = self._queue = None

    # -- resume

    def _identity(self) -> dict:
        return {
            "split": self.split,
            "mode": self.mode,
            "seed": self.seed,
            "batch_size": self.batch_size,
            "seq_len": self.seq_len,
            "world_size": self.world_size,
            "tokens": self.total_tokens,
        }

    def state_dict(self) -> dict:
        """JSON-serialisable position. Ranks advance in lockstep, so any rank's state resumes every rank."""
        return {"kind": "TokenLoader", **self._identity(), "rank": self.rank, "batch_index": self._batch_index}

    def load_state_dict(self, state: dict) -> None:
        """Resume at a saved position. A state saved by another number of ranks or another batch
        size is resharded (see `_resharded_index`); everything else must match."""
        layout = ("batch_size", "world_size")
        same_data = {k: v for k, v in self._identity().items() if k not in layout}
        check_state("TokenLoader", state, same_data)
        self.close()  # drop batches prefetched from the old position
        if all(state.get(k) == getattr(self, k) for k in layout):
            self._batch_index = int(state["batch_index"])
        else:
            self._batch_index = self._resharded_index(int(state["batch_index"]), int(state["batch_size"]),
                                                      int(state["world_size"]))

    def _resharded_index(self, index: int, batch_size: int, world_size: int) -> int:
        """The first batch of this loader that starts at or after everything the saved loaders read.

        sequential: the saved ranks had read the first `consumed` windows of the epoch order
        (rank r reads positions r, r+W, ...). This loader continues at the first of its batch
        boundaries at or after that position: no window of the epoch is read twice, and fewer
        than two of its global batches (batch_size x world_size windows each) are skipped.
        random: batches are independent draws; the batch count carries over unchanged.
        """
        if self.mode == "random":
            return index
        saved_per_rank = self._n_windows // world_size
        position = index * batch_size  # this rank's position in its epoch lists, counted over epochs
        epoch, offset = divmod(position, saved_per_rank)
        consumed = offset * world_size  # windows of the current epoch's order already read by all ranks
        per_global_batch = self.batch_size * self.world_size
        batches_in_epoch = -(-consumed // per_global_batch)  # round up: never re-read a window
        # This layout may read fewer windows per epoch than were consumed: then start the next epoch.
        my_position = epoch * self._per_rank + min(batches_in_epoch * self.batch_size, self._per_rank)
        return -(-my_position // self.batch_size)


def _open_mask(data_dir: str, split: str, shard: dict) -> np.memmap:
    """The loss mask of a shard: one uint8 per token (1 = a training target)."""
    if not shard.get("mask_file"):
        raise UserError(f"the manifest of {data_dir!r} declares a loss mask, but {split} shard {shard['file']} has no "
                        "mask_file; run `slipstream data prepare` again")
    path = os.path.join(data_dir, shard["mask_file"])
    try:
        size = os.path.getsize(path)
    except OSError as e:
        raise UserError(f"loss mask {path} of {split} shard {shard['file']} cannot be read ({e.strerror}); run "
                        "`slipstream data prepare` again") from None
    if size != shard["tokens"]:
        raise UserError(f"loss mask {path} holds {size:,} bytes for the {shard['tokens']:,} tokens of {split} shard "
                        f"{shard['file']} (one byte per token); run `slipstream data prepare` again")
    return np.memmap(path, dtype=np.uint8, mode="r", shape=(shard["tokens"],))


class _CountFrom(torch.utils.data.Sampler):
    """Batch indices start, start + 1, ... (the loader is infinite)."""

    def __init__(self, start: int) -> None:
        self.start = start

    def __iter__(self):
        return itertools.count(self.start)


class _BatchesByIndex(torch.utils.data.Dataset):
    """Map-style view for DataLoader workers: item i is batch i (unpinned; the DataLoader pins)."""

    def __init__(self, loader: TokenLoader) -> None:
        self.loader = loader

    def __getitem__(self, index: int) -> torch.Tensor:
        return self.loader._host_batch(index, pin=False)


def _augment_swap_tokens(x: np.ndarray, prob: float, seed: list[int]) -> None:
    """CPU-side text augmentation: swap each token with its right neighbour with probability
    `prob`, in place. Written as a plain per-token Python loop on purpose: it is the kind of
    preprocessing users write, and it makes loading CPU-bound, the case that DataLoader
    workers fix (`data.num_workers`). Seeded by batch index: same result in any worker."""
    rng = random.Random(hash(tuple(seed)))
    rows, cols = x.shape
    for r in range(rows):
        row = x[r]
        for c in range(cols - 1):
            if rng.random() < prob:
                row[c], row[c + 1] = row[c + 1], row[c]


def _busy_cpu(seconds: float) -> None:
    """Keep this core busy for `seconds`: stands in for a heavy preprocessing pipeline (the
    cost is set by data.augment_cost_ms) so a data-bound run can be reproduced and fixed."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _prefetch_worker(loader_ref: Callable, index: int, stop: threading.Event, out: queue.Queue, device: torch.device) -> None:
    if device.index is not None:
        torch.cuda.set_device(device)
    while not stop.is_set():
        loader = loader_ref()
        if loader is None:
            return
        try:
            item = (index, loader._host_batch(index))
        except BaseException as e:  # hand the error to the training thread instead of dying silently
            item = e
        del loader
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)
                break
            except queue.Full:
                continue
        if isinstance(item, BaseException):
            return
        index += 1
