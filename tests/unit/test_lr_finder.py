"""The learning-rate range test: the analysis on planted curves, and the sweep through the Trainer
on a least-squares problem whose divergence lr is known analytically."""

from __future__ import annotations

import math
import random

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.tune.lr_finder import (DivergenceWatch, check_sweep, ema, find_lr, smoothing_beta, suggest_lr,
                                       sweep_lrs)


def _planted(steps: int = 200, centre: float = 1e-3, blow_up: float = 0.1, noise: float = 0.0, seed: int = 0):
    """A sweep from 1e-6 to 10: the loss falls from 5 to 2 along a logistic in log(lr) centred on
    `centre` (its steepest point), then grows exponentially past `blow_up`."""
    rng = random.Random(seed)
    lrs = sweep_lrs(steps, 1e-6, 10.0)
    losses = []
    for lr in lrs:
        loss = 2.0 + 3.0 / (1.0 + math.exp((math.log(lr) - math.log(centre)) / 0.6))
        if lr > blow_up:
            loss *= math.exp(3.0 * math.log(lr / blow_up))
        losses.append(loss * (1.0 + noise * rng.gauss(0.0, 1.0)))
    return lrs, losses


def test_sweep_lrs_are_the_trainers_range_test_schedule():
    lrs = sweep_lrs(101, 1e-6, 1.0)
    assert lrs[0] == pytest.approx(1e-6) and lrs[-1] == pytest.approx(1.0) and lrs[50] == pytest.approx(1e-3)
    ratios = [b / a for a, b in zip(lrs, lrs[1:])]
    assert max(ratios) == pytest.approx(min(ratios))  # exponential: equal ratios


def test_ema_is_bias_corrected():
    assert ema([3.0] * 5, 0.98) == pytest.approx([3.0] * 5)  # no pull toward 0 at the start
    assert ema([0.0, 10.0], 0.5) == pytest.approx([0.0, 10.0 * 0.5 / 0.75])


def test_suggest_lr_finds_the_steepest_descent_of_a_planted_curve():
    lrs, losses = _planted()
    r = suggest_lr(lrs, losses, beta=smoothing_beta(200))
    assert r["suggested_lr"] == pytest.approx(1e-3, rel=0.3)
    # The minimum lies between the end of the descent and the blow-up; its tenth is reported too.
    assert 1e-2 < r["min_loss_lr"] < 0.15
    assert r["min_loss_lr_over_10"] == pytest.approx(r["min_loss_lr"] / 10)
    # 5 -> 2 -> back above 5 comes before 4 x 2 = 8.
    assert 0.1 < r["divergence_lr"] < 0.5 and "starting value" in r["divergence_reason"]
    # The smoothed curve ends where the divergence begins.
    assert len(r["smoothed"]) == next(i for i, lr in enumerate(lrs) if lr >= r["divergence_lr"])


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_suggest_lr_on_a_noisy_curve_stays_near_the_steepest_descent(seed):
    lrs, losses = _planted(noise=0.05, seed=seed)
    r = suggest_lr(lrs, losses, beta=smoothing_beta(200))
    assert 1e-3 / 2 < r["suggested_lr"] < 1e-3 * 2


def test_suggest_lr_moves_with_the_curve():
    """Not a constant: planting the descent two decades lower moves the suggestion with it."""
    lrs, losses = _planted(centre=1e-5, blow_up=1e-3)
    r = suggest_lr(lrs, losses, beta=smoothing_beta(200))
    assert r["suggested_lr"] == pytest.approx(1e-5, rel=0.3) and r["divergence_lr"] < 5e-3


def test_suggest_lr_cuts_the_curve_at_a_non_finite_loss():
    lrs, losses = _planted()
    cut = next(i for i, lr in enumerate(lrs) if lr > 0.05)
    losses = losses[:cut] + [float("nan")] + losses[cut + 1:]
    r = suggest_lr(lrs, losses, beta=smoothing_beta(200))
    assert r["divergence_lr"] == lrs[cut] and r["divergence_reason"] == "the loss is not finite"
    assert r["suggested_lr"] == pytest.approx(1e-3, rel=0.3)


def test_suggest_lr_says_when_there_is_nothing_to_suggest():
    lrs = sweep_lrs(50, 1e-6, 1e-4)
    flat = suggest_lr(lrs, [5.0 + 0.01 * (i % 2) for i in range(50)], beta=0.8)
    assert flat["suggested_lr"] is None and flat["notes"]
    falling = suggest_lr(lrs, [5.0 - 0.05 * i for i in range(50)], beta=0.8)
    assert falling["divergence_lr"] is None and any("still falling" in n for n in falling["notes"])


def test_divergence_watch_stops_at_4x_the_minimum_or_at_lost_progress():
    watch = DivergenceWatch(beta=0.0)  # no smoothing: each loss as it comes
    assert not any(watch.add(x) for x in (5.0, 2.0, 1.0, 3.9))
    assert watch.add(4.5) and "4x" in watch.reason
    watch = DivergenceWatch(beta=0.0)
    assert not any(watch.add(x) for x in (5.0, 4.95, 5.02))  # noise around the start is no divergence
    assert not any(watch.add(x) for x in (4.0, 3.0, 4.9))
    assert watch.add(5.1) and "starting value" in watch.reason
    assert DivergenceWatch(beta=0.9).add(None)  # metrics.jsonl writes a non-finite loss as null


@pytest.mark.parametrize("steps, low, high", [(5, 1e-7, 1.0), (100, 1e-3, 1e-3), (100, 1e-2, 1e-3), (100, 0.0, 1.0),
                                              (100, -1.0, 1.0), (100, 1e-7, float("inf"))])
def test_bad_sweeps_are_user_errors(steps, low, high):
    with pytest.raises(UserError, match="--steps|--min-lr"):
        check_sweep(steps, low, high)


# --- the sweep through the Trainer -------------------------------------------------------------------------------

def _least_squares(n: int = 256, d: int = 8):
    """Full-batch least squares: every step sees all n samples, so the loss is the quadratic
    0.5 (w - w*)^T H (w - w*) + const with H = X^T X / n, and gradient descent diverges exactly
    above lr = 2 / lambda_max(H)."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g) * torch.linspace(0.2, 1.0, d).sqrt()  # eigenvalues spread over 5x
    y = x @ torch.randn(d, generator=g) + 0.1 * torch.randn(n, generator=g)
    divergence_lr = 2.0 / torch.linalg.eigvalsh(x.T @ x / n).max().item()
    model = nn.Linear(d, 1, bias=False)
    nn.init.zeros_(model.weight)
    return model, torch.utils.data.TensorDataset(x, y), divergence_lr


def _mse(model, batch):
    return 0.5 * F.mse_loss(model(batch[0]).squeeze(-1), batch[1])


# AdamW with beta1 = beta2 = 0 steps w -= lr g / (|g| + eps) per coordinate: with eps far above
# every |g| here that is gradient descent at lr / eps (to |g| / eps < 1e-4), whose divergence lr is
# the textbook 2 / lambda_max. The sweep's lrs are in AdamW's units: lr / EPS is the GD lr.
EPS = 1e6
GD = ["--optim.beta1=0", "--optim.beta2=0", f"--optim.eps={EPS:g}", "--optim.weight_decay=0",
      "--optim.grad_clip=0", "--train.device=cpu", "--train.micro_batch_size=256"]


def test_find_lr_lands_in_the_known_good_range_of_gradient_descent(tmp_path):
    model, data, divergence = _least_squares()
    r = find_lr(model, data, _mse, load_config(None, GD), steps=100, min_lr=1e-4 * EPS, max_lr=10 * EPS,
                run_dir=tmp_path / "sweep")
    suggested, over_10, diverged = (r[k] / EPS for k in ("suggested_lr", "min_loss_lr_over_10", "divergence_lr"))
    # Known: every lr below 2 / lambda_max converges, none above it does; the range test's
    # readings are below it, within two decades (the sweep spans five).
    assert divergence / 100 < suggested < divergence, (suggested, divergence)
    assert divergence / 100 < over_10 < divergence
    # The loss cannot blow up before the analytic threshold; the sweep sees it within a few steps.
    assert divergence <= diverged < 8 * divergence
    assert r["steps_run"] == len(r["losses"]) and r["losses"][-1] > 4 * min(r["losses"])
    assert (tmp_path / "sweep" / "metrics.jsonl").is_file()  # the given run directory is kept

    # Gradient descent at the suggested lr does train: the loss falls by orders of magnitude.
    model, data, _ = _least_squares()
    w = model.weight.detach().clone()
    x, y = data.tensors
    start = 0.5 * F.mse_loss(x @ w[0], y).item()
    for _ in range(200):
        w.requires_grad_(True)
        loss = 0.5 * F.mse_loss(x @ w[0], y)
        (grad,) = torch.autograd.grad(loss, w)
        w = (w - suggested * grad).detach()
    assert 0.5 * F.mse_loss(x @ w[0], y).item() < start / 30


def test_find_lr_stops_the_sweep_once_the_loss_diverges():
    model, data, divergence = _least_squares()
    steps = 100
    r = find_lr(model, data, _mse, load_config(None, GD), steps=steps, min_lr=1e-4 * EPS, max_lr=1e4 * EPS)
    assert r["stopped_early"] and r["steps_run"] < steps, r["stop_reason"]
    assert r["divergence_lr"] / EPS >= divergence
    # The stop came at the first step the watch saw diverge: nothing was trained after it.
    lrs = sweep_lrs(steps, 1e-4 * EPS, 1e4 * EPS)
    assert r["divergence_lr"] == pytest.approx(lrs[r["steps_run"] - 1])
