"""DatasetLoader: infinite, resumable batches from any map-style dataset, sharded across ranks.

The generic counterpart of TokenLoader (loader.py, which re-exports it): a torch DataLoader
driven by a per-epoch batch sampler, so its position is two plain ints (epoch, batch in
epoch) and resuming skips the batches already seen without loading them.
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from slipstream.data.loader_checks import check_positive, check_rank, check_state, seed_key
from slipstream.errors import UserError


class _EpochBatchSampler(torch.utils.data.Sampler):
    """This rank's index batches for one epoch, starting at a given batch.

    The DatasetLoader sets `epoch` and `start` before each pass; the DataLoader (and its
    workers) only ever see the indices still to be loaded, so resuming never loads the
    skipped samples. It holds no reference back to the DatasetLoader: a reference cycle
    would leave worker shutdown to the garbage collector, which stalls for seconds.
    """

    def __init__(self, n: int, batch_size: int, shuffle: bool, seed: int, drop_last: bool, rank: int, world_size: int) -> None:
        self.n, self.batch_size, self.shuffle, self.seed = n, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.per_rank = n // world_size  # equal for all ranks, so they stay in lockstep
        full, rest = divmod(self.per_rank, batch_size)
        self.batches_per_epoch = full + (1 if rest and not drop_last else 0)
        self.epoch = 0
        self.start = 0
        self._cache: tuple[int, list[list[int]]] | None = None

    def epoch_batches(self, epoch: int) -> list[list[int]]:
        if self._cache is None or self._cache[0] != epoch:
            if self.shuffle:
                order = np.random.default_rng([seed_key(self.seed), epoch]).permutation(self.n)
            else:
                order = np.arange(self.n)
            mine = order[self.rank : self.per_rank * self.world_size : self.world_size].tolist()
            batches = [mine[i : i + self.batch_size] for i in range(0, len(mine), self.batch_size)]
            self._cache = (epoch, batches[: self.batches_per_epoch])
        return self._cache[1]

    def __iter__(self):
        yield from self.epoch_batches(self.epoch)[self.start :]

    def __len__(self) -> int:
        return self.batches_per_epoch - self.start


def _to_device(batch: Any, device: torch.device, non_blocking: bool) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: _to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(_to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(_to_device(v, device, non_blocking) for v in batch)
    return batch


class DatasetLoader:
    """Infinite, resumable batches from any map-style Dataset, sharded across ranks.

    Each epoch shuffles all indices with a permutation seeded by (seed, epoch); rank r
    takes every world_size-th index of it, truncated so all ranks get the same count
    (up to world_size - 1 samples sit out each epoch, different ones every epoch).
    """

    def __init__(
        self,
        dataset,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        drop_last: bool = True,
        collate_fn: Callable | None = None,
        num_workers: int = 0,
        rank: int = 0,
        world_size: int = 1,
        device: str | torch.device = "cpu",
        pin_memory: bool | None = None,
    ) -> None:
        check_positive(batch_size=batch_size)
        check_rank(rank, world_size)
        if isinstance(dataset, torch.utils.data.IterableDataset) or not hasattr(dataset, "__len__"):
            raise UserError("DatasetLoader needs a map-style dataset (with __len__ and __getitem__); wrap streaming data in one")
        if num_workers < 0:
            raise UserError(f"num_workers={num_workers} must be >= 0")
        self.dataset, self.batch_size, self.shuffle, self.seed = dataset, batch_size, shuffle, seed
        self.drop_last, self.rank, self.world_size = drop_last, rank, world_size
        self.device = torch.device(device)
        self._n = len(dataset)
        self._sampler = _EpochBatchSampler(self._n, batch_size, shuffle, seed, drop_last, rank, world_size)
        if self.batches_per_epoch == 0:
            raise UserError(
                f"dataset too small: {self._n} samples over {world_size} rank(s) is {self._sampler.per_rank} per rank, "
                f"less than batch_size={batch_size}; lower batch_size{' or set drop_last=False' if drop_last else ''}"
            )
        cuda = self.device.type == "cuda"
        self._pin = cuda if pin_memory is None else (pin_memory and cuda)
        self._loader = torch.utils.data.DataLoader(
            dataset,
            batch_sampler=self._sampler,
            collate_fn=collate_fn,
            num_workers=num_workers,
            pin_memory=self._pin,
            persistent_workers=num_workers > 0,
            # Our own generator: worker seeds must not consume (or depend on) the global torch RNG.
            generator=torch.Generator().manual_seed(seed_key(seed) % 2**63 + rank),
        )
        self._epoch = 0
        self._batch_in_epoch = 0
        self._it = None

    @property
    def batches_per_epoch(self) -> int:
        return self._sampler.batches_per_epoch

    def __iter__(self) -> "DatasetLoader":
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._sampler.epoch, self._sampler.start = self._epoch, self._batch_in_epoch
                self._it = iter(self._loader)
            try:
                batch = next(self._it)
                break
            except StopIteration:
                self._it = None
                self._epoch += 1
                self._batch_in_epoch = 0
        self._batch_in_epoch += 1
        return _to_device(batch, self.device, non_blocking=self._pin)

    @property
    def epoch(self) -> int:
        return self._epoch

    def close(self) -> None:
        """Stop DataLoader worker processes now (dropping the loader does it too). Iterating restarts them."""
        self._it = None
        self._loader._iterator = None  # persistent workers live on the DataLoader's cached iterator

    def _identity(self) -> dict:
        return {
            "seed": self.seed,
            "batch_size": self.batch_size,
            "shuffle": self.shuffle,
            "drop_last": self.drop_last,
            "world_size": self.world_size,
            "dataset_len": self._n,
        }

    def state_dict(self) -> dict:
        """JSON-serialisable position; as with TokenLoader, ranks are in lockstep so any rank's state fits all."""
        return {"kind": "DatasetLoader", **self._identity(), "rank": self.rank, "epoch": self._epoch, "batch_in_epoch": self._batch_in_epoch}

    def load_state_dict(self, state: dict) -> None:
        identity = self._identity()
        # Resharded at the same global batch (1 rank x 4 -> 2 x 2): batch k holds perm[k*W*B : (k+1)*W*B] either way.
        same_global = self.world_size * self.batch_size
        if isinstance(state, dict) and state.get("world_size", 0) * state.get("batch_size", 0) == same_global:
            identity.update(world_size=state["world_size"], batch_size=state["batch_size"])
        check_state("DatasetLoader", state, identity)
        self._epoch = int(state["epoch"])
        self._batch_in_epoch = int(state["batch_in_epoch"])
        self._it = None  # the next __next__ restarts the DataLoader at the saved batch
