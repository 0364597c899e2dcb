"""Tests for slipstream.data.loader: TokenLoader windows, determinism, resume, ranks; DatasetLoader."""

import json
import os

import numpy as np
import pytest
import torch

from slipstream.data.loader import DatasetLoader, TokenLoader
from slipstream.data.prepare import prepare_dataset
from slipstream.errors import UserError

SEQ = 16
BATCH = 4


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("loader")
    corpus = root / "corpus"
    corpus.mkdir()
    rng = np.random.default_rng(0)
    for i in range(30):
        words = rng.choice(["alpha", "beta", "gamma", "delta", "x", "yz"], size=int(rng.integers(20, 80)))
        (corpus / f"{i:02d}.txt").write_text(f"doc {i}: " + " ".join(words))
    out = root / "data"
    # Tiny shards, so windows regularly cross shard boundaries.
    prepare_dataset([str(corpus)], "byte", str(out), shard_tokens=997, val_fraction=0.2, progress=False)
    return str(out)


def stream(data_dir, split="train"):
    m = json.loads(open(os.path.join(data_dir, "manifest.json")).read())
    parts = [np.fromfile(os.path.join(data_dir, s["file"]), dtype=np.uint16) for s in m["splits"][split]["shards"]]
    return np.concatenate(parts).astype(np.int64)


def take(loader, n):
    return [tuple(t.clone() for t in next(loader)) for _ in range(n)]


def same(a, b):
    return len(a) == len(b) and all(torch.equal(x1, x2) and torch.equal(y1, y2) for (x1, y1), (x2, y2) in zip(a, b))


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_shapes_and_windows_match_the_stream(data_dir, mode):
    loader = TokenLoader(data_dir, "train", BATCH, SEQ, mode=mode)
    tokens = stream(data_dir)
    assert len(loader._shards) > 1
    assert loader.tokens_per_batch == BATCH * SEQ and loader.vocab_size == 257 and loader.eot_id == 256
    for index in range(20):
        starts = loader._batch_starts(index)
        x, y = next(loader)
        assert x.shape == y.shape == (BATCH, SEQ) and x.dtype == y.dtype == torch.int64
        assert x.is_contiguous() and y.is_contiguous()
        for b, s in enumerate(starts):
            assert np.array_equal(x[b].numpy(), tokens[s : s + SEQ])
            assert np.array_equal(y[b].numpy(), tokens[s + 1 : s + SEQ + 1])


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_deterministic_per_seed(data_dir, mode):
    a = take(TokenLoader(data_dir, "train", BATCH, SEQ, seed=1, mode=mode), 5)
    b = take(TokenLoader(data_dir, "train", BATCH, SEQ, seed=1, mode=mode), 5)
    c = take(TokenLoader(data_dir, "train", BATCH, SEQ, seed=2, mode=mode), 5)
    assert same(a, b)
    assert not same(a, c)


@pytest.mark.parametrize("mode", ["random", "sequential"])
def test_resume_gives_identical_next_batches(data_dir, mode):
    loader = TokenLoader(data_dir, "train", BATCH, SEQ, seed=3, mode=mode)
    steps = 3 * (loader._per_rank // BATCH) + 1 if mode == "sequential" else 7  # cross epoch boundaries
    take(loader, steps)
    state = json.loads(json.dumps(loader.state_dict()))  # must survive JSON
    expected = take(loader, 5)
    resumed = TokenLoader(data_dir, "train", BATCH, SEQ, seed=3, mode=mode)
    resumed.load_state_dict(state)
    assert same(take(resumed, 5), expected)


def test_prefetch_thread_resume(data_dir):
    # The CUDA prefetch thread, exercised on CPU: batches and resume must be unaffected by read-ahead.
    plain = take(TokenLoader(data_dir, "train", BATCH, SEQ), 8)
    loader = TokenLoader(data_dir, "train", BATCH, SEQ)
    loader._prefetch = True
    assert same(take(loader, 4), plain[:4])
    state = loader.state_dict()
    assert same(take(loader, 2), plain[4:6])
    loader.load_state_dict(state)  # drops the batches already read ahead
    assert same(take(loader, 4), plain[4:8])
    loader.close()
    assert loader._thread is None


def test_random_ranks_are_disjoint(data_dir):
    spans = []
    for rank in range(2):
        loader = TokenLoader(data_dir, "train", BATCH, SEQ, rank=rank, world_size=2)
        starts = np.concatenate([loader._batch_starts(i) for i in range(200)])
        spans.append((starts.min(), starts.max() + SEQ + 1))
    assert spans[0][1] <= spans[1][0]  # every window of rank 0 ends before any window of rank 1 starts


def test_sequential_epoch_covers_every_window_once(data_dir):
    loader = TokenLoader(data_dir, "train", BATCH, SEQ, mode="sequential", seed=5)
    n = loader._n_windows
    assert n == (len(stream(data_dir)) - 1) // SEQ
    batches = -(-n // BATCH)
    starts = np.concatenate([loader._batch_starts(i) for i in range(batches)])[:n]
    assert sorted(starts.tolist()) == [i * SEQ for i in range(n)]
    # world_size=2: each rank gets half of the windows, disjoint.
    per_rank = []
    for rank in range(2):
        r = TokenLoader(data_dir, "train", BATCH, SEQ, mode="sequential", seed=5, rank=rank, world_size=2)
        k = r._per_rank
        per_rank.append(set(np.concatenate([r._batch_starts(i) for i in range(-(-k // BATCH))])[:k].tolist()))
    assert not per_rank[0] & per_rank[1]
    assert len(per_rank[0]) == len(per_rank[1]) == n // 2


def test_too_little_data(data_dir):
    total = len(stream(data_dir, "val"))
    with pytest.raises(UserError, match=r"split 'val'.*too small.*smaller seq_len"):
        TokenLoader(data_dir, "val", 1, total)
    TokenLoader(data_dir, "val", 1, total - 1)  # exactly one window fits
    with pytest.raises(UserError, match="rank 1 of 2"):
        TokenLoader(data_dir, "val", 1, total - 1, rank=1, world_size=2)
    with pytest.raises(UserError, match="split 'test' not found"):
        TokenLoader(data_dir, "test", 1, 8)


def test_mismatched_state_is_rejected(data_dir):
    state = TokenLoader(data_dir, "train", BATCH, SEQ, seed=1).state_dict()
    with pytest.raises(UserError, match="seed: saved 1, now 2"):
        TokenLoader(data_dir, "train", BATCH, SEQ, seed=2).load_state_dict(state)
    with pytest.raises(UserError, match="mode"):
        TokenLoader(data_dir, "train", BATCH, SEQ, seed=1, mode="sequential").load_state_dict(state)
    with pytest.raises(UserError, match="DatasetLoader"):
        TokenLoader(data_dir, "train", BATCH, SEQ).load_state_dict({"kind": "DatasetLoader"})


# ----------------------------------------------------------------------------- DatasetLoader


class Recording(torch.utils.data.Dataset):
    def __init__(self, n):
        self.n, self.seen = n, []

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.seen.append(i)
        return {"x": torch.tensor([i, i * 2]), "i": i}


def indices(batches):
    return [b["i"].tolist() for b in batches]


def test_dataset_loader_resume_is_exact():
    loader = DatasetLoader(Recording(23), batch_size=5, seed=7)
    assert loader.batches_per_epoch == 4
    first = indices(next(loader) for _ in range(6))  # crosses into epoch 1
    assert sorted(sum(first[:4], [])) == sorted(set(sum(first[:4], [])))  # no repeats within an epoch
    state = json.loads(json.dumps(loader.state_dict()))
    expected = indices(next(loader) for _ in range(5))

    data = Recording(23)
    resumed = DatasetLoader(data, batch_size=5, seed=7)
    resumed.load_state_dict(state)
    batch = next(resumed)
    assert data.seen == batch["i"].tolist()  # the consumed part of the epoch was skipped, not loaded
    assert [batch["i"].tolist()] + indices(next(resumed) for _ in range(4)) == expected
    assert batch["x"].shape == (5, 2)


def test_dataset_loader_ranks_are_disjoint():
    seen = []
    for rank in range(2):
        loader = DatasetLoader(Recording(21), batch_size=2, seed=1, rank=rank, world_size=2)
        seen.append(set(sum(indices(next(loader) for _ in range(loader.batches_per_epoch)), [])))
    assert not seen[0] & seen[1]
    assert len(seen[0]) == len(seen[1]) == 10


def test_dataset_loader_workers_match_in_process():
    in_process = DatasetLoader(Recording(30), batch_size=4, seed=2)
    plain = indices(next(in_process) for _ in range(10))
    loader = DatasetLoader(Recording(30), batch_size=4, seed=2, num_workers=2)
    assert indices(next(loader) for _ in range(10)) == plain
    # Resume with workers too.
    state = loader.state_dict()
    expected = indices(next(loader) for _ in range(3))
    loader.load_state_dict(state)
    assert indices(next(loader) for _ in range(3)) == expected
    assert indices(next(in_process) for _ in range(3)) == expected
    loader.close()  # stops the worker processes; iterating again restarts them
    assert indices([next(loader)]) == indices([next(in_process)])


def test_dataset_loader_leaves_global_rng_alone():
    torch.manual_seed(0)
    expected = torch.rand(3)
    torch.manual_seed(0)
    loader = DatasetLoader(Recording(10), batch_size=2)
    for _ in range(7):
        next(loader)
    assert torch.equal(torch.rand(3), expected)


def test_dataset_loader_errors():
    with pytest.raises(UserError, match="dataset too small"):
        DatasetLoader(Recording(3), batch_size=4)
    DatasetLoader(Recording(3), batch_size=4, drop_last=False)
    state = DatasetLoader(Recording(10), batch_size=2, seed=1).state_dict()
    with pytest.raises(UserError, match="batch_size: saved 2, now 3"):
        DatasetLoader(Recording(10), batch_size=3, seed=1).load_state_dict(state)


@pytest.mark.parametrize("saved, resumed", [((2, 2), (1, 4)), ((1, 4), (2, 2)), ((2, 3), (4, 1)), ((4, 1), (2, 3))])
def test_a_sequential_position_is_resharded_without_repeats(data_dir, saved, resumed):
    """Saved by W ranks of batch B, resumed by W' ranks of batch B': no window of the epoch is
    read twice, and fewer than two global batches of the new layout are skipped."""
    from slipstream.data.loader import TokenLoader

    (world, batch), (new_world, new_batch) = saved, resumed
    old = [TokenLoader(str(data_dir), "train", batch, 32, seed=3, mode="sequential", rank=r, world_size=world)
           for r in range(world)]
    read = set()
    for loader in old:
        for index in range(5):
            read |= set(loader._batch_starts(index).tolist())
        loader._batch_index = 5
    state = old[0].state_dict()
    new = [TokenLoader(str(data_dir), "train", new_batch, 32, seed=3, mode="sequential", rank=r, world_size=new_world)
           for r in range(new_world)]
    following = set()
    for loader in new:
        loader.load_state_dict(state)
        following |= set(loader._batch_starts(loader._batch_index).tolist())
    assert not read & following
    import numpy as np

    from slipstream.data.loader_checks import seed_key

    epoch_order = np.random.default_rng([seed_key(3), 0]).permutation(old[0]._n_windows) * 32  # window starts
    first_new = min(list(epoch_order).index(s) for s in following)
    assert first_new >= len(read) and first_new - len(read) < 2 * new_batch * new_world


def test_dataset_loader_position_reshards_at_the_same_global_batch():
    """1 rank x batch 4 -> 2 ranks x batch 2 (a resharded resume): the position carries, and the
    ranks' next batches together are the single rank's next batch; another global batch is refused."""
    from slipstream.data.loader import DatasetLoader
    from slipstream.errors import UserError

    data = torch.utils.data.TensorDataset(torch.arange(32))
    one = DatasetLoader(data, batch_size=4, shuffle=True, seed=3, drop_last=True)
    it = iter(one)
    next(it), next(it)
    state = one.state_dict()
    want = next(it)[0].tolist()
    got = []
    for rank in range(2):
        two = DatasetLoader(data, batch_size=2, shuffle=True, seed=3, drop_last=True, rank=rank, world_size=2)
        two.load_state_dict(state)
        got += next(iter(two))[0].tolist()
    assert sorted(got) == sorted(want)
    with pytest.raises(UserError, match="does not match this loader"):
        DatasetLoader(data, batch_size=3, shuffle=True, seed=3, drop_last=True).load_state_dict(state)
