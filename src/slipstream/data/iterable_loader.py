"""Resumable, rank-split batches from streams: any torch IterableDataset (IterableLoader here) and
WebDataset-style tar shards (TarShardLoader, tar_shards.py), both on one ProducerLoader.

How batches reach the step. A *producer* builds "batch j of epoch e of this rank" on request. The
main process asks for the keys (e, j) in order through a sampler over a small map-style dataset,
so torch's DataLoader sends key j to its workers round-robin and hands the results back in order:
workers, pinned memory and prefetch (prefetch_factor) come from the DataLoader, while what batch
j holds is the producer's alone. Hence the same batches with 0, 2 or 8 workers, and resuming is
two ints (epoch, batch in epoch): the keys simply start at the saved batch.

The split of a user's stream (IterableLoader):
  - item k of the epoch's stream goes to rank k % world_size; a rank keeps its item of round i
    (items i*W .. i*W + W-1) only once the whole round exists, so every rank ends the epoch with
    floor(N / W) items: the smallest per-rank count, and the same number of batches on every
    rank (data-parallel collectives stay in lockstep). Batch j of a rank is its items
    j*B .. j*B + B-1 (train: the last partial batch is dropped; validation keeps it).
  - within a rank, batch j is built by worker j % num_workers (the DataLoader's round robin).
    Every worker of every rank reads the whole stream and keeps only its own items, so the
    stream is read W x num_workers times (items not kept are never collated). A dataset that
    can split itself cheaply exposes `set_rank(rank, world_size)`: the loader calls it once and
    then takes the dataset's stream as this rank's alone (it must then yield the same count on
    every rank, e.g. dropping the remainder as DistributedSampler does, or the ranks fall out of
    lockstep). Which worker builds a batch is the loader's rule: while the stream is read,
    torch.utils.data.get_worker_info() returns None (as in the training process), so a dataset
    that would split itself over workers (webdataset's, datasets' IterableDataset) reads the
    whole stream in each.
  - `set_epoch(epoch)` is called on the dataset (in every worker) before each epoch's stream;
    a finite stream ends the epoch and starts the next; a stream with no full batch is an error.
  - resume: a dataset with torchdata's Stateful protocol (state_dict / load_state_dict) is
    snapshotted after each batch at the end of the batch's last round (stream position
    (j+1)*B*W), and that snapshot (JSON-serialisable, like every loader state) is saved; on
    resume each worker loads it and reads on from there. Without it, and for set_rank datasets
    (whose per-rank states one checkpoint cannot hold), resuming re-reads the stream from the
    epoch's start and skips the consumed items: the cost of reading (not collating)
    batch x B x W items, once per worker.
  - the stream must be a function of the epoch, or resuming cannot reproduce it: seed its own
    generators from the epoch, or draw from torch's, Python's or numpy's global generator, which the
    loader seeds by (seed, epoch) for the stream (restoring the training process's after each batch),
    so every worker draws the same numbers. After a Stateful
    resume the global generators start from (seed, epoch) again: keep such a stream's randomness
    in its own state.
"""

from __future__ import annotations

import contextlib
import copy
import json
import random
import re
from typing import Any, Callable

import numpy as np
import torch

from slipstream.data.dataset_loader import _to_device
from slipstream.data.loader_checks import check_positive, check_rank, check_state, seed_key
from slipstream.errors import UserError

END = "__slipstream_end_of_epoch__"  # a plain string survives pickling and pin_memory as it is


class _Keys(torch.utils.data.Sampler):
    """The (epoch, batch) keys from a start, forever. With a known number of batches per epoch
    they run on into the next epoch; otherwise they stay in one epoch until the loader restarts
    them after the producer's END."""

    def __init__(self, batches_per_epoch: int | None) -> None:
        self.batches_per_epoch = batches_per_epoch
        self.epoch, self.start = 0, 0

    def __iter__(self):
        epoch, j = self.epoch, self.start
        while True:
            if self.batches_per_epoch is not None and j >= self.batches_per_epoch:
                epoch, j = epoch + 1, 0
            yield (epoch, j)
            j += 1


class _ProducerDataset(torch.utils.data.Dataset):
    def __init__(self, producer) -> None:
        self.producer = producer

    def __getitem__(self, key: tuple[int, int]):
        epoch, j = key
        batch, state = self.producer.batch(epoch, j)
        return epoch, j, batch, state


def _as_is(x):
    return x


class ProducerLoader:
    """Infinite, resumable batches from a producer (see the module docstring), on DataLoader
    workers. `producer` provides batch(epoch, j) -> (batch or END, dataset state or None),
    batches_per_epoch (int or None), identity() (what a saved state must match),
    empty_message(epoch) and set_resume(...)."""

    kind = "ProducerLoader"

    def __init__(self, producer, *, num_workers: int = 0, prefetch: int = 2, device: str | torch.device = "cpu",
                 pin_memory: bool | None = None, seed: int = 0, rank: int = 0) -> None:
        if not isinstance(num_workers, int) or num_workers < 0:
            raise UserError(f"num_workers={num_workers!r} must be an integer >= 0")
        if not isinstance(prefetch, int) or prefetch < 0:
            raise UserError(f"prefetch={prefetch!r} must be an integer >= 0")
        self.producer = producer
        self.num_workers = num_workers
        self.device = torch.device(device)
        cuda = self.device.type == "cuda"
        self._pin = cuda if pin_memory is None else (pin_memory and cuda)
        self._keys = _Keys(producer.batches_per_epoch)
        extra = {"prefetch_factor": max(1, prefetch)} if num_workers > 0 else {}
        self._loader = torch.utils.data.DataLoader(
            _ProducerDataset(producer), sampler=self._keys, batch_size=None, collate_fn=_as_is,
            num_workers=num_workers, pin_memory=self._pin, persistent_workers=num_workers > 0,
            # Our own generator: worker seeds must not consume (or depend on) the global torch RNG.
            generator=torch.Generator().manual_seed(seed_key(seed) % 2**63 + rank), **extra)
        self._epoch = 0
        self._batch_in_epoch = 0
        self._dataset_state = None  # the producer's dataset state after the last batch returned
        self._it = None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def batches_per_epoch(self) -> int | None:
        return self.producer.batches_per_epoch

    def __iter__(self) -> "ProducerLoader":
        return self

    def __next__(self) -> Any:
        while True:
            if self._it is None:
                self._keys.epoch, self._keys.start = self._epoch, self._batch_in_epoch
                self._it = iter(self._loader)
            try:
                epoch, j, batch, state = next(self._it)
            except UserError as e:
                message = _raised_message(e)
                if message is None:  # raised in this process: as it is
                    raise
                raise type(e)(message) from None
            if isinstance(batch, str) and batch == END:
                if j == 0:
                    raise UserError(self.producer.empty_message(epoch))
                # The keys still in flight belong to the ended epoch: restart them at the next one.
                self._it = None
                self._epoch, self._batch_in_epoch = epoch + 1, 0
                continue
            break
        self._epoch, self._batch_in_epoch = epoch, j + 1
        bpe = self.producer.batches_per_epoch
        if bpe is not None and self._batch_in_epoch >= bpe:
            self._epoch, self._batch_in_epoch = epoch + 1, 0
        self._dataset_state = state
        return _to_device(batch, self.device, non_blocking=self._pin)

    def close(self) -> None:
        """Stop DataLoader worker processes now (dropping the loader does it too). Iterating restarts them."""
        # Persistent workers live on the DataLoader's cached iterator. Shut them down explicitly: after
        # a worker's error the iterator sits in a reference cycle (the re-raised exception's traceback),
        # so dropping it left the workers running until a garbage collection (and forked processes
        # inherited it, whose collection then tried to stop workers that are not theirs).
        for it in {id(x): x for x in (self._it, self._loader._iterator) if x is not None}.values():
            shutdown = getattr(it, "_shutdown_workers", None)
            if shutdown is not None:
                shutdown()
        self._it = None
        self._loader._iterator = None

    def state_dict(self) -> dict:
        """JSON-serialisable position; ranks are in lockstep, so any rank's (epoch, batch) fits all."""
        state = {"kind": self.kind, **self.producer.identity(), "num_workers": self.num_workers,
                 "epoch": self._epoch, "batch_in_epoch": self._batch_in_epoch}
        if self._dataset_state is not None and self._batch_in_epoch > 0:
            try:
                json.dumps(self._dataset_state)
            except (TypeError, ValueError) as e:
                raise UserError(f"the dataset's state_dict() is not JSON-serialisable ({e}); checkpoints store it "
                                f"as JSON: return plain numbers, strings, lists and dicts, or drop "
                                f"state_dict/load_state_dict to resume by skipping") from None
            state["dataset_state"] = self._dataset_state
        return state

    def load_state_dict(self, state: dict) -> None:
        identity = self.producer.identity()
        # Resharded at the same global batch (1 rank x 4 -> 2 x 2): batch j holds the epoch's items
        # j*B*W .. (j+1)*B*W - 1 either way (also the items a Stateful snapshot has consumed).
        if (isinstance(state, dict) and self.producer.reshardable
                and state.get("world_size", 0) * state.get("batch_size", 0) == identity["world_size"] * identity["batch_size"]):
            identity.update(world_size=state["world_size"], batch_size=state["batch_size"])
        check_state(self.kind, state, identity)  # num_workers may differ: batches do not depend on it
        self._epoch = int(state["epoch"])
        self._batch_in_epoch = int(state["batch_in_epoch"])
        self._dataset_state = state.get("dataset_state")
        if self.producer.set_resume(self._epoch, self._batch_in_epoch, self._dataset_state):
            self.close()  # the workers hold copies of the producer: new ones pick the resume point up
        self._it = None  # the next __next__ restarts the keys at the saved batch


def _raised_message(error: UserError) -> str | None:
    """The message a UserError was raised with in a DataLoader worker (None: not from a worker). torch
    re-raises it in the main process with the worker's traceback as its message ("Caught UserError in
    DataLoader worker process 0. Original Traceback ..."); the user needs what the data's error says,
    as without workers."""
    text = str(error)
    if not text.startswith("Caught ") or " in DataLoader worker process " not in text.split("\n", 1)[0]:
        return None
    marker = f"{type(error).__module__}.{type(error).__qualname__}: "
    last = text[text.rfind("Traceback (most recent call last):"):]  # the last one: a chained error's own
    found = re.search("^" + re.escape(marker), last, re.MULTILINE)  # frames are indented; the error's line is not
    return last[found.end():].rstrip("\n") if found else text


@contextlib.contextmanager
def _no_worker_info():
    """torch.utils.data.get_worker_info() returns None while the stream is read in a worker, as in the
    training process: a dataset that splits itself over workers (webdataset's and datasets'
    IterableDatasets do by default) then reads the whole stream, as the loader's rule needs (which
    worker builds a batch is the loader's choice; a self-split stream lost and repeated items)."""
    from torch.utils.data._utils import worker

    info = worker._worker_info
    worker._worker_info = None
    try:
        yield
    finally:
        worker._worker_info = info


class _Ended(Exception):
    """The stream ended inside a round."""


class StreamProducer:
    """Batch j of epoch e of this rank from a user's IterableDataset (module docstring). Lives in
    each worker (a copy per worker process) and keeps the stream it is reading between requests,
    so a worker asked for batches j, j + n, j + 2n, ... reads on without restarting."""

    reshardable = True

    def __init__(self, dataset, batch_size: int, rank: int, world_size: int, drop_last: bool,
                 collate_fn: Callable | None, seed: int = 0) -> None:
        self.dataset, self.batch_size, self.drop_last, self.seed = dataset, batch_size, drop_last, seed
        self.collate = collate_fn or torch.utils.data.default_collate
        self.world_size, self.rank = world_size, rank
        self.self_split = callable(getattr(dataset, "set_rank", None))
        if self.self_split:
            dataset.set_rank(rank, world_size)
            self.reshardable = False
        # The stream's own split: a self-split dataset's stream is this rank's already.
        self._w, self._r = (1, 0) if self.self_split else (world_size, rank)
        # A checkpoint holds one rank's loader state: fine when every rank reads the same stream, but a
        # self-split dataset's states differ per rank, so it resumes by skipping instead.
        self.stateful = (callable(getattr(dataset, "state_dict", None)) and callable(getattr(dataset, "load_state_dict", None))
                         and not self.self_split)
        self.batches_per_epoch = None
        self._resume: tuple[int, int, Any] | None = None
        self._it = None
        self._epoch = -1
        self._consumed = 0  # items of the epoch's stream read so far
        self._ended_at: int | None = None  # the epoch's batch count, once the stream has ended
        self._rngs: tuple[torch.Tensor, Any, Any] | None = None  # the stream's torch, Python and numpy generator states

    def identity(self) -> dict:
        return {"dataset": type(self.dataset).__name__, "seed": self.seed, "batch_size": self.batch_size,
                "world_size": self.world_size,
                "drop_last": self.drop_last, "self_split": self.self_split}

    def empty_message(self, epoch: int) -> str:
        name = type(self.dataset).__name__
        need = f"{self.batch_size} x {self._w} rank(s)" if self.drop_last else f"{self._w} rank(s)"
        return (f"the iterable dataset {name} yielded too few items in epoch {epoch} for one batch on every rank "
                f"(at least {need}); check that its __iter__ yields items (after set_epoch({epoch})) "
                f"or lower train.micro_batch_size")

    def set_resume(self, epoch: int, batch: int, dataset_state: Any) -> bool:
        """Where a resumed stream starts; True when the workers must be restarted to learn it."""
        resume = (epoch, batch, dataset_state) if dataset_state is not None and self.stateful else None
        changed = resume is not None or self._resume is not None
        self._resume, self._it, self._epoch = resume, None, -1
        return changed

    def _start(self, epoch: int, j: int) -> None:
        s = int(np.random.SeedSequence([seed_key(self.seed), epoch]).generate_state(1, np.uint64)[0])
        self._rngs = (torch.Generator().manual_seed(s % 2**63).get_state(), random.Random(s).getstate(),
                      np.random.RandomState(s % 2**32).get_state())
        with self._stream_rngs():
            if callable(getattr(self.dataset, "set_epoch", None)):
                self.dataset.set_epoch(epoch)
            self._consumed, self._ended_at = 0, None
            if self._resume is not None and self._resume[0] == epoch and self._resume[1] <= j:
                self.dataset.load_state_dict(copy.deepcopy(self._resume[2]))
                self._consumed = self._resume[1] * self.batch_size * self._w
            self._it = iter(self.dataset)
        self._epoch = epoch

    @contextlib.contextmanager
    def _stream_rngs(self):
        """The stream reads torch's, Python's and numpy's global generators as its own, seeded by (seed,
        epoch): every worker (each reading the whole stream) then draws the same numbers for the same
        items, as the training process does with num_workers=0, whose own generators are restored after."""
        outer = (torch.get_rng_state(), random.getstate(), np.random.get_state())
        torch.set_rng_state(self._rngs[0])
        random.setstate(self._rngs[1])
        np.random.set_state(self._rngs[2])
        try:
            with _no_worker_info():
                yield
        finally:
            self._rngs = (torch.get_rng_state(), random.getstate(), np.random.get_state())
            torch.set_rng_state(outer[0])
            random.setstate(outer[1])
            np.random.set_state(outer[2])

    def _round(self) -> Any:
        """Read one round (W items); return this rank's item. Raises _Ended if the round is incomplete."""
        mine = None
        for i in range(self._w):
            try:
                item = next(self._it)
            except StopIteration:
                raise _Ended from None
            self._consumed += 1
            if i == self._r:
                mine = item
        return mine

    def batch(self, epoch: int, j: int) -> tuple[Any, Any]:
        per_batch = self.batch_size * self._w
        if self._it is None or self._epoch != epoch or self._consumed > j * per_batch:
            self._start(epoch, j)
        if self._ended_at is not None:  # j >= the epoch's batch count here: earlier j restarted above
            return END, None
        with self._stream_rngs():
            items, state = self._collect(j, per_batch)
        return (END, None) if items is None else (self.collate(items), state)

    def _collect(self, j: int, per_batch: int) -> tuple[list | None, Any]:
        items: list = []
        try:
            while self._consumed < j * per_batch:  # batches of other workers (or consumed before a resume)
                self._round()
            while len(items) < self.batch_size:
                items.append(self._round())
        except _Ended:
            keep = bool(items) and not self.drop_last
            self._ended_at = j + 1 if keep else j
            if not keep:
                return None, None
        state = copy.deepcopy(self.dataset.state_dict()) if self.stateful and self._ended_at is None else None
        return items, state


class IterableLoader(ProducerLoader):
    """Infinite, resumable batches from any torch.utils.data.IterableDataset, split over ranks
    and workers by fixed rules (module docstring)."""

    kind = "IterableLoader"

    def __init__(self, dataset, batch_size: int, seed: int = 0, drop_last: bool = True,
                 collate_fn: Callable | None = None, num_workers: int = 0, prefetch: int = 2,
                 rank: int = 0, world_size: int = 1, device: str | torch.device = "cpu",
                 pin_memory: bool | None = None) -> None:
        check_positive(batch_size=batch_size)
        check_rank(rank, world_size)
        if not isinstance(dataset, torch.utils.data.IterableDataset) and not hasattr(dataset, "__iter__"):
            raise UserError(f"IterableLoader needs an iterable dataset, got {type(dataset).__name__}")
        producer = StreamProducer(dataset, batch_size, rank, world_size, drop_last, collate_fn, seed)
        super().__init__(producer, num_workers=num_workers, prefetch=prefetch, device=device,
                         pin_memory=pin_memory, seed=seed, rank=rank)
        self.batch_size, self.rank, self.world_size = batch_size, rank, world_size


__all__ = ["END", "IterableLoader", "ProducerLoader", "StreamProducer"]
