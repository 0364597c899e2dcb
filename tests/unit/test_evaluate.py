"""The validation estimate: fixed windows over the whole split, identical across seeds,
resumes and world sizes, scored exactly, with a standard error that covers the full-split loss."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from slipstream.config.schema import ModelConfig
from slipstream.data.eval_windows import EvalWindows, window_starts
from slipstream.errors import UserError
from slipstream.models.transformer import build_model
from slipstream.train.evaluate import Evaluator, format_eval
from slipstream.train.lm_loss import lm_sequence_losses


def _model(vocab):
    cfg = ModelConfig(preset="tiny", n_layer=2, n_head=2, d_model=32, max_seq_len=64, vocab_size=vocab,
                      position="learned", norm="layernorm", mlp="gelu", bias=True, tie_embeddings=True)
    return build_model(cfg, seed=3)


def test_every_window_when_the_split_is_small():
    starts = window_starts(1001, 10, max_tokens=10_000)
    assert list(starts) == [10 * i for i in range(100)]  # (1001 - 1) // 10 windows, none overlapping


def test_sample_is_spread_over_the_split_and_fixed():
    starts = window_starts(100_001, 10, max_tokens=1_000)
    assert len(starts) == 100 and len(set(starts)) == 100
    # one window per stratum of 100 windows: the sample covers the whole split evenly
    assert all(1000 * i <= s < 1000 * (i + 1) for i, s in enumerate(starts))
    assert np.array_equal(starts, window_starts(100_001, 10, max_tokens=1_000))


def test_too_small_split_is_a_clear_error():
    with pytest.raises(UserError, match="fewer than one window"):
        window_starts(8, 10, 100)


def test_ranks_cover_the_same_windows_as_one_process(data_dir):
    one = EvalWindows(str(data_dir), "val", batch_size=4, seq_len=32, max_tokens=10**9)
    seen_one = [tuple(x[i].tolist()) for (x, _), w in one for i in range(len(w)) if w[i] > 0]
    seen_ranks, batches = [], set()
    for rank in range(3):
        part = EvalWindows(str(data_dir), "val", batch_size=4, seq_len=32, max_tokens=10**9, rank=rank, world_size=3)
        got = list(part)
        batches.add(len(got))  # FSDP needs the same number of forward passes on every rank
        seen_ranks += [tuple(x[i].tolist()) for (x, _), w in got for i in range(len(w)) if w[i] > 0]
    assert len(batches) == 1
    assert sorted(seen_ranks) == sorted(seen_one)
    assert one.tokens == len(seen_one) * 32


def test_window_loss_equals_a_direct_computation(data_dir):
    windows = EvalWindows(str(data_dir), "val", batch_size=5, seq_len=32, max_tokens=64 * 32)
    model = _model(windows.vocab_size)
    result = Evaluator(windows, None, None, torch.autocast("cpu", enabled=False), max_batches=0)(model, torch.device("cpu"))
    per_window = []
    with torch.no_grad():
        for (x, y), w in windows:
            for i in range(len(w)):
                if w[i] > 0:
                    logits = model(x[i:i + 1])
                    per_window.append(F.cross_entropy(logits[0], y[i]).item())
    assert result.samples == len(per_window) == 64
    assert result.loss == pytest.approx(np.mean(per_window), rel=1e-6)
    assert result.stderr == pytest.approx(np.std(per_window, ddof=1) / math.sqrt(64), rel=1e-5)
    assert result.tokens == 64 * 32
    assert "±" in format_eval(result) and "2,048 tokens" in format_eval(result)
    assert model.training  # evaluation restores the mode


def test_sampled_estimate_is_within_two_standard_errors_of_the_full_split(data_dir):
    full = EvalWindows(str(data_dir), "val", batch_size=16, seq_len=32, max_tokens=10**9)
    sample = EvalWindows(str(data_dir), "val", batch_size=16, seq_len=32, max_tokens=full.tokens // 8)
    assert sample.sampled and not full.sampled and sample.n_windows * 8 <= full.n_windows
    model = _model(full.vocab_size)
    evaluate = lambda data: Evaluator(data, None, None, torch.autocast("cpu", enabled=False), 0)(model, torch.device("cpu"))  # noqa: E731
    exact, estimate = evaluate(full), evaluate(sample)
    assert abs(estimate.loss - exact.loss) < 2 * estimate.stderr


def test_fused_sequence_losses_match_the_logits_path(data_dir):
    windows = EvalWindows(str(data_dir), "val", batch_size=3, seq_len=32, max_tokens=3 * 32)
    model = _model(windows.vocab_size)
    (x, y), _ = next(iter(windows))
    with torch.no_grad():
        plain, fused = lm_sequence_losses(model, x, y), lm_sequence_losses(model, x, y, fused_chunk=16)
    assert plain.shape == (3,)
    torch.testing.assert_close(fused, plain, rtol=1e-5, atol=1e-5)


def test_loader_batches_replay_from_the_start_with_a_standard_error():
    from slipstream.data.loader import DatasetLoader

    data = torch.utils.data.TensorDataset(torch.arange(40, dtype=torch.float32).view(20, 2))
    loader = DatasetLoader(data, batch_size=4, shuffle=False, seed=0, drop_last=False)
    loss_fn = lambda model, batch: batch[0].mean()  # noqa: E731
    evaluator = Evaluator(loader, loss_fn, None, torch.autocast("cpu", enabled=False), max_batches=3)
    first, second = evaluator(torch.nn.Linear(1, 1), torch.device("cpu")), evaluator(torch.nn.Linear(1, 1), torch.device("cpu"))
    batch_means = [3.5, 11.5, 19.5]
    assert first.loss == second.loss == pytest.approx(np.mean(batch_means))
    assert first.stderr == pytest.approx(np.std(batch_means, ddof=1) / math.sqrt(3))
    assert first.samples == 3 and first.tokens is None
