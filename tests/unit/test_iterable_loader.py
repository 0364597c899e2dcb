"""IterableLoader: any torch IterableDataset split over ranks and workers by fixed rules, equal
batch counts per rank, set_epoch, exact resume (with and without the Stateful protocol), and the
Trainer taking an IterableDataset as train_data and val_data."""

from __future__ import annotations

import json

import pytest
import torch

from slipstream.data.iterable_loader import IterableLoader
from slipstream.errors import UserError


class Stream(torch.utils.data.IterableDataset):
    """n items per epoch whose values depend on the epoch (so epochs are told apart)."""

    def __init__(self, n: int = 23) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        for i in range(self.n):
            yield torch.tensor([self.epoch * 1000 + i])


class StatefulStream(Stream):
    """torchdata's Stateful protocol: the position within the epoch; counts items read."""

    def __init__(self, n: int = 23) -> None:
        super().__init__(n)
        self.pos = 0
        self.resumed_at = None
        self.reads = 0

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.pos = self.resumed_at = state["pos"]

    def __iter__(self):
        start, self.pos = self.pos, self.pos if self.resumed_at is not None else 0
        self.resumed_at = None
        for i in range(start if self.pos else 0, self.n):
            self.pos = i + 1
            self.reads += 1
            yield torch.tensor([self.epoch * 1000 + i])


def values(batch) -> list[int]:
    return batch.flatten().tolist()


def take(loader, n):
    return [values(next(loader)) for _ in range(n)]


def test_ranks_disjoint_covering_and_in_lockstep():
    loaders = [IterableLoader(Stream(23), batch_size=2, rank=r, world_size=2) for r in range(2)]
    per_rank = [take(ld, 5) for ld in loaders]  # 23 items -> 11 per rank -> 5 batches, then epoch 1
    assert per_rank[0][:2] == [[0, 2], [4, 6]] and per_rank[1][:2] == [[1, 3], [5, 7]]
    epoch0 = [v for rank in per_rank for b in rank for v in b]
    assert sorted(epoch0) == list(range(20))  # disjoint, covering all but the incomplete tail
    assert [values(next(ld)) for ld in loaders] == [[1000, 1002], [1001, 1003]]  # next epoch, via set_epoch


def test_workers_give_the_same_batches_as_in_process():
    ref = take(IterableLoader(Stream(23), batch_size=3, rank=1, world_size=2), 9)
    multi = IterableLoader(Stream(23), batch_size=3, rank=1, world_size=2, num_workers=2, prefetch=1)
    assert take(multi, 9) == ref
    multi.close()


class SplitsOverWorkers(Stream):
    """Splits itself over DataLoader workers as webdataset's and datasets' IterableDatasets do by
    default (each worker reads every num_workers-th item)."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        for i, x in enumerate(super().__iter__()):
            if info is None or i % info.num_workers == info.id:
                yield x


def test_a_dataset_that_splits_itself_over_workers_still_gives_the_in_process_batches():
    """The loader decides which worker builds a batch: a stream that splits itself over workers
    would hand each worker part of the stream, and the batches would lose and repeat items."""
    ref = take(IterableLoader(SplitsOverWorkers(23), batch_size=3, rank=1, world_size=2), 9)
    multi = IterableLoader(SplitsOverWorkers(23), batch_size=3, rank=1, world_size=2, num_workers=2, prefetch=1)
    assert take(multi, 9) == ref
    multi.close()


class Noisy(Stream):
    """Augments with torch's, Python's and numpy's global generators."""

    def __iter__(self):
        import random

        import numpy as np

        for x in super().__iter__():
            yield x + torch.rand(1), torch.tensor([random.random()]), torch.tensor(np.random.rand(1))


def test_global_generators_seeded_per_epoch_and_restored():
    import numpy as np

    torch.manual_seed(7)
    np.random.seed(7)
    expected = torch.rand(3), np.random.rand(3)
    torch.manual_seed(7)
    np.random.seed(7)
    ref = IterableLoader(Noisy(10), batch_size=2, world_size=2, rank=1, seed=4)
    ref_batches = [next(ref) for _ in range(5)]  # epoch 0 and into epoch 1
    assert torch.equal(torch.rand(3), expected[0])  # the training process's generators are left as they were
    assert np.array_equal(np.random.rand(3), expected[1])
    multi = IterableLoader(Noisy(10), batch_size=2, world_size=2, rank=1, seed=4, num_workers=2)
    for a, b in zip(ref_batches, [next(multi) for _ in range(5)]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    multi.close()
    other = IterableLoader(Noisy(10), batch_size=2, world_size=2, rank=1, seed=5)
    assert not torch.equal(next(other)[0], ref_batches[0][0])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stateful", [False, True])
def test_exact_resume_mid_epoch_and_across_epochs(workers, stateful):
    make = (lambda: StatefulStream(17)) if stateful else (lambda: Stream(17))
    ref = take(IterableLoader(make(), batch_size=2, world_size=2, rank=0), 14)  # 4 batches per epoch
    for cut in (3, 6):
        first = IterableLoader(make(), batch_size=2, world_size=2, rank=0, num_workers=workers)
        assert take(first, cut) == ref[:cut]
        state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint holds
        first.close()
        assert ("dataset_state" in state) == stateful
        again = IterableLoader(make(), batch_size=2, world_size=2, rank=0, num_workers=workers)
        again.load_state_dict(state)
        assert take(again, 14 - cut) == ref[cut:]
        again.close()


def test_stateful_resume_reads_from_the_saved_position():
    loader = IterableLoader(StatefulStream(40), batch_size=2, world_size=2, rank=0)
    take(loader, 3)
    state = loader.state_dict()
    assert state["dataset_state"] == {"pos": 12}  # 3 batches x 2 items x 2 ranks
    ds = StatefulStream(40)
    again = IterableLoader(ds, batch_size=2, world_size=2, rank=0)
    again.load_state_dict(state)
    assert values(next(again)) == [12, 14]
    assert ds.reads == 4  # read on from the saved position: nothing before it re-read


def test_validation_keeps_the_partial_batch_equal_on_every_rank():
    counts = []
    for r in range(2):
        ld = IterableLoader(Stream(9), batch_size=3, rank=r, world_size=2, drop_last=False)
        counts.append(take(ld, 2))
    assert counts == [[[0, 2, 4], [6]], [[1, 3, 5], [7]]]  # 4 per rank: item 8 would make rank 0 longer


class SelfSplit(Stream):
    def set_rank(self, rank, world_size):
        self.rank, self.world = rank, world_size

    def __iter__(self):
        for i in range(self.rank, self.n, self.world):
            yield torch.tensor([i])


class SelfSplitStateful(SelfSplit):
    def state_dict(self):
        return {"rank": self.rank}

    def load_state_dict(self, state):
        raise AssertionError("a self-split dataset's state is one rank's: never loaded")


def test_a_dataset_that_splits_itself_over_ranks():
    loaders = [IterableLoader(SelfSplit(8), batch_size=2, rank=r, world_size=2) for r in range(2)]
    assert [take(ld, 2) for ld in loaders] == [[[0, 2], [4, 6]], [[1, 3], [5, 7]]]
    # Resumed by skipping (its state would be one rank's), exactly.
    first = IterableLoader(SelfSplitStateful(12), batch_size=2, rank=1, world_size=2)
    ref = take(IterableLoader(SelfSplitStateful(12), batch_size=2, rank=1, world_size=2), 4)
    assert take(first, 2) == ref[:2] and "dataset_state" not in first.state_dict()
    again = IterableLoader(SelfSplitStateful(12), batch_size=2, rank=1, world_size=2)
    again.load_state_dict(first.state_dict())
    assert take(again, 2) == ref[2:]


class Tensors(StatefulStream):
    def state_dict(self):
        return {"pos": torch.tensor(self.pos)}


def test_a_state_that_is_not_json_is_named():
    loader = IterableLoader(Tensors(8), batch_size=2)
    next(loader)
    with pytest.raises(UserError, match="state_dict\\(\\) is not JSON-serialisable"):
        loader.state_dict()


def test_empty_and_bad_inputs():
    with pytest.raises(UserError, match="too few items"):
        next(IterableLoader(Stream(0), batch_size=2))
    with pytest.raises(UserError, match="too few items"):
        next(IterableLoader(Stream(3), batch_size=2, world_size=2))
    with pytest.raises(UserError, match="batch_size"):
        IterableLoader(Stream(3), batch_size=0)
    other = IterableLoader(Stream(8), batch_size=2).state_dict()
    with pytest.raises(UserError, match="batch_size"):
        IterableLoader(Stream(8), batch_size=3).load_state_dict(other)
    # Same global batch at another world size is allowed: batch j holds the same items.
    IterableLoader(Stream(8), batch_size=1, world_size=2).load_state_dict(other)


class Failing(Stream):
    """Raises after a few items: a UserError (the data's fault, named) or any other error."""

    def __init__(self, error: Exception) -> None:
        super().__init__(100)
        self.error = error

    def __iter__(self):
        for i, x in enumerate(super().__iter__()):
            if i == 5:
                raise self.error
            yield x


def test_a_worker_error_reaches_the_step_and_close_stops_the_workers():
    import gc

    message = "shard 7 is damaged:\nline two of the message; re-create it"
    gc.disable()  # close() itself must stop the workers, not a later garbage collection
    try:
        for workers in (0, 2):
            loader = IterableLoader(Failing(UserError(message)), batch_size=1, num_workers=workers)
            with pytest.raises(UserError) as caught:
                take(loader, 10)
            assert str(caught.value) == message  # the message as raised, not a worker's traceback around it
            processes = list(loader._loader._iterator._workers) if workers else []
            loader.close()
            for p in processes:
                p.join(timeout=10)
            assert not any(p.is_alive() for p in processes)
        loader = IterableLoader(Failing(ValueError("boom")), batch_size=1, num_workers=1)
        with pytest.raises(ValueError, match="(?s)DataLoader worker process 0.*boom"):  # others keep the traceback
            take(loader, 10)
        loader.close()
    finally:
        gc.enable()


def test_as_loader_splits_over_the_data_parallel_ranks():
    from types import SimpleNamespace

    from slipstream.config.load import load_config
    from slipstream.train.setup import as_loader

    cfg = load_config(None, ["--train.micro_batch_size=2", "--data.num_workers=0"])
    parallel = SimpleNamespace(dims=SimpleNamespace(dp=2), dp_rank=1)
    loader = as_loader(Stream(9), cfg, torch.device("cpu"), shuffle=False, parallel=parallel)
    assert isinstance(loader, IterableLoader) and (loader.rank, loader.world_size) == (1, 2)
    assert take(loader, 2) == [[1, 3], [5, 7]]


def test_trainer_takes_an_iterable_dataset(tmp_path):
    from slipstream.config.load import load_config
    from slipstream.train.trainer import Trainer

    class Pairs(torch.utils.data.IterableDataset):
        def __iter__(self):
            g = torch.Generator().manual_seed(0)
            for _ in range(64):
                x = torch.randn(4, generator=g)
                yield x, x.sum(0, keepdim=True)

    def run(steps, resume):
        cfg = load_config(None, [f"--run.dir={tmp_path}", f"--train.max_steps={steps}", "--train.micro_batch_size=8",
                                 "--checkpoint.interval=3", "--checkpoint.async_save=false", "--train.eval_steps=2",
                                 "--train.eval_interval=3", "--logging.progress=false", "--data.num_workers=1",
                                 f"--checkpoint.resume={'auto' if resume else 'none'}"])
        torch.manual_seed(0)
        model = torch.nn.Linear(4, 1)
        trainer = Trainer(model, train_data=Pairs(), val_data=Pairs(), config=cfg,
                          loss_fn=lambda m, b: torch.nn.functional.mse_loss(m(b[0]), b[1]))
        summary = trainer.fit()
        return summary, [p.detach().clone() for p in model.parameters()]

    full, ref = run(10, resume=False)
    assert full["steps"] == 10 and full["val_loss"] is not None
    import shutil

    shutil.rmtree(tmp_path)
    run(6, resume=False)
    resumed, params = run(10, resume=True)
    assert resumed["steps_this_run"] == 4
    for a, b in zip(ref, params):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
