"""Data-path switches: worker processes, CPU-side augmentation, prefetch depth. Every
switch changes where and when batches are built, never which batches the model sees."""

import pytest
import torch

from slipstream.config import load_config
from slipstream.data import TokenLoader
from slipstream.errors import UserError
from slipstream.train.lm import train_lm


def batches(loader, n):
    return [next(loader) for _ in range(n)]


def same(a, b):
    return all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("augment", ["none", "swap_tokens"])
def test_workers_give_the_in_process_batches(data_dir, augment):
    plain = TokenLoader(str(data_dir), "train", 4, 32, seed=5, augment=augment, augment_prob=0.3)
    workers = TokenLoader(str(data_dir), "train", 4, 32, seed=5, augment=augment, augment_prob=0.3,
                          num_workers=2, prefetch=3)
    try:
        assert same(batches(plain, 6), batches(workers, 6))
        state = workers.state_dict()
        expected = next(workers)
        resumed = TokenLoader(str(data_dir), "train", 4, 32, seed=5, augment=augment, augment_prob=0.3, num_workers=2)
        resumed.load_state_dict(state)
        assert same([expected], [next(resumed)])
        resumed.close()
    finally:
        workers.close()


def test_swap_augmentation_changes_inputs_not_targets(data_dir):
    plain = TokenLoader(str(data_dir), "train", 4, 32, seed=5)
    aug = TokenLoader(str(data_dir), "train", 4, 32, seed=5, augment="swap_tokens", augment_prob=0.5)
    (x0, y0), (x1, y1) = next(plain), next(aug)
    assert torch.equal(y0, y1) and not torch.equal(x0, x1)
    assert torch.equal(torch.sort(x0, dim=1).values, torch.sort(x1, dim=1).values)  # swaps only permute tokens


def test_bad_data_path_values(data_dir):
    with pytest.raises(UserError, match="augmentation"):
        TokenLoader(str(data_dir), "train", 4, 32, augment="rotate")
    with pytest.raises(UserError, match="must be >= 0"):
        TokenLoader(str(data_dir), "train", 4, 32, num_workers=-1)


def test_training_with_workers_equals_in_process(tiny_overrides, tmp_path):
    common = tiny_overrides + ["--train.max_steps=4", "--data.augment=swap_tokens"]
    a = train_lm(load_config(None, common + [f"--run.dir={tmp_path / 'a'}"]))
    b = train_lm(load_config(None, common + [f"--run.dir={tmp_path / 'b'}", "--data.num_workers=2"]))
    assert a["final_loss"] == b["final_loss"]


def test_a_url_without_streaming_names_the_switch():
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data
    from slipstream.errors import UserError

    with pytest.raises(UserError, match="--data.streaming=true"):
        ensure_data(load_config(None, ["--data.dir=s3://bucket/prepared"]))


def test_ranks_that_read_different_manifests_stop():
    from slipstream.data.train_data import TrainData, check_same_data

    data = TrainData("s3://bucket/prepared", {"splits": {"train": {"tokens": 10}}}, "byte")
    check_same_data(data, lambda mine: mine)  # rank 0, or a rank that read what rank 0 read
    reupload = TrainData("s3://bucket/prepared", {"splits": {"train": {"tokens": 11}}}, "byte")
    rank0 = []
    check_same_data(reupload, lambda mine: rank0.append(mine) or mine)
    with pytest.raises(UserError, match="another manifest"):
        check_same_data(data, lambda mine: rank0[0])
