"""The batch finder's parts: the noise-scale estimator (exact on exact inputs, and recovering a
known B_simple through the Trainer), the micro-batch plan and its confirmation by (fake) trials,
and the recommendation."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.tune.batch_finder import confirm_micro_batch, memory_budget, plan_micro_batches, planned_step_bytes
from slipstream.tune.noise_scale import measure_noise_scale, noise_scale, recommend_batch

MIB = 2**20


def test_noise_scale_is_exact_on_exact_inputs():
    """E|G_B|^2 = |G|^2 + tr(Sigma) / B: feeding in the expectations gives back |G|^2 and tr(Sigma)."""
    grad_sq, trace = 2.5, 400.0
    small = [grad_sq + trace / 8] * 3
    big = [grad_sq + trace / 64] * 3
    r = noise_scale(small, big, 8, 64)
    assert r["grad_sq_norm"] == pytest.approx(grad_sq, rel=1e-12)
    assert r["trace_cov"] == pytest.approx(trace, rel=1e-12)
    assert r["b_simple"] == pytest.approx(trace / grad_sq, rel=1e-12) and r["b_simple_stderr"] == 0


def test_noise_scale_is_a_ratio_of_means():
    """Two rounds: both estimates are averaged over the rounds, then divided. Here the means give
    |G|^2 = (4 x 8 - 20) / 3 = 4 and tr(Sigma) = (20 - 8) / (1 - 1/4) = 16, so B_simple = 4; the
    mean of the two rounds' own ratios would be (16/3 / (14/3) + 80/3 / (10/3)) / 2 = 4.57."""
    r = noise_scale([10.0, 30.0], [6.0, 10.0], 1, 4)
    assert (r["grad_sq_norm"], r["trace_cov"]) == (pytest.approx(4.0), pytest.approx(16.0))
    assert r["b_simple"] == pytest.approx(4.0)


def test_noise_scale_without_signal_has_no_b_simple():
    r = noise_scale([10.0], [2.4], 1, 4)  # |G|^2 = (9.6 - 10) / 3 < 0: all noise
    assert r["grad_sq_norm"] < 0 and r["b_simple"] is None
    with pytest.raises(ValueError):
        noise_scale([1.0], [1.0], 8, 8)


@pytest.fixture
def one_thread():
    """One torch thread: steadier than two on a loaded 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_measured_noise_scale_recovers_linear_regression(one_thread):
    """y = x.w* + noise, x ~ N(0, I_d), noise ~ N(0, s^2), loss 0.5 (x.w - y)^2 at w = w* + delta: one
    example's gradient is x (x.delta - noise), with mean delta and covariance (|delta|^2 + s^2) I +
    delta delta^T, so |G|^2 = |delta|^2, tr(Sigma) = d (|delta|^2 + s^2) + |delta|^2 and
    B_simple = d + 1 + d s^2 / |delta|^2 = 33 here."""
    g = torch.Generator().manual_seed(0)
    d, n, noise = 16, 65536, 1.0
    w_star = torch.randn(d, generator=g)
    x = torch.randn(n, d, generator=g)
    y = x @ w_star + noise * torch.randn(n, generator=g)
    delta = torch.full((d,), 0.25)
    expected = d + 1 + d * noise**2 / (delta @ delta).item()
    model = nn.Linear(d, 1, bias=False)
    with torch.no_grad():
        model.weight.copy_((w_star + delta)[None])
    weights = model.weight.detach().clone()
    r = measure_noise_scale(model, torch.utils.data.TensorDataset(x, y),
                            lambda m, b: 0.5 * F.mse_loss(m(b[0]).squeeze(-1), b[1]),
                            load_config(None, ["--train.micro_batch_size=8", "--train.device=cpu"]),
                            rounds=100, k=8, tokens_per_sample=1)
    assert (r["b_small"], r["b_big"], r["rounds"]) == (8, 64, 100)
    # 800 micro-batches give B_simple to about 5 % (the jackknife's error bar says so too).
    assert r["b_simple"] == pytest.approx(expected, rel=0.15)
    assert abs(r["b_simple"] - expected) < 4 * r["b_simple_stderr"]
    assert r["grad_sq_norm"] == pytest.approx((delta @ delta).item(), rel=0.15)
    assert r["b_simple_tokens"] == r["b_simple"]
    assert torch.equal(model.weight.detach().cpu(), weights)  # measured at fixed weights


# --- the micro-batch -----------------------------------------------------------------------------------------------

def _tiny():
    return load_config(None, ["--model.preset=tiny", "--model.vocab_size=320", "--train.seq_len=64",
                              "--train.device=cpu"])


def test_plan_is_the_largest_power_of_two_under_the_budget():
    cfg = _tiny()
    budget = planned_step_bytes(cfg, 16, 1, "cpu") + MIB // 2  # 16 fits by half a MiB, 32 does not
    rows = plan_micro_batches(cfg, 1, "cpu", budget, 1024)
    assert [r["micro_batch"] for r in rows] == [1, 2, 4, 8, 16, 32]
    assert [r["fits"] for r in rows] == [True] * 5 + [False]
    assert all(a["planned_bytes"] < b["planned_bytes"] for a, b in zip(rows, rows[1:]))
    assert plan_micro_batches(cfg, 1, "cpu", budget, 8)[-1]["micro_batch"] == 8  # --max-micro-batch caps it


def test_confirmation_halves_on_out_of_memory_and_on_a_measured_peak_over_budget():
    seen = []

    def trial(layout, timeout_s):
        mb = layout["train.micro_batch_size"]
        seen.append(mb)
        if mb == 64:
            return {"error": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB"}
        return {"tokens_per_s": 1.0, "peak_bytes": mb * 3 * MIB}  # 32 -> 96 MiB: over; 16 -> 48 MiB: fits

    tries = confirm_micro_batch(64, {64: 120 * MIB, 32: 60 * MIB, 16: 30 * MIB}, trial, budget=64 * MIB)
    assert seen == [64, 32, 16]
    assert [t["status"] for t in tries] == ["out of memory", "too big", "ok"]
    assert [t["planned_bytes"] for t in tries] == [120 * MIB, 60 * MIB, 30 * MIB]
    assert tries[1]["measured_bytes"] == 96 * MIB and tries[2]["measured_bytes"] == 48 * MIB


def test_confirmation_stops_at_a_failure_that_is_not_memory():
    tries = confirm_micro_batch(8, {8: MIB}, lambda layout, t: {"error": "error: data.dir does not exist"}, 1 << 30)
    assert len(tries) == 1 and tries[0]["status"] == "failed" and "data.dir" in tries[0]["reason"]


@pytest.mark.parametrize("gib", [0.0, -1.0, float("nan"), float("inf")])
def test_memory_gib_must_be_positive(gib):
    with pytest.raises(UserError, match="--memory-gib"):
        memory_budget("cpu", 1, gib)


def test_cpu_ranks_share_the_budget():
    assert memory_budget("cpu", 4, 1.0) == (2**30 // 4, "--memory-gib, shared by 4 processes")
    assert memory_budget("cuda", 4, 1.0)[0] == 2**30  # a GPU each


def test_recommendation_rounds_to_the_layout_and_scales_lr_by_the_square_root():
    cfg = load_config(None, ["--train.micro_batch_size=4", "--train.grad_accum_steps=2", "--optim.lr=1e-3",
                             "--train.seq_len=128"])
    rec = recommend_batch(100.0, 16, 1, cfg)  # 100 / 16 = 6.25 -> 6 micro-batches
    assert (rec["global_batch"], rec["micro_batch"], rec["grad_accum_steps"]) == (96, 16, 6)
    assert rec["tokens"] == 96 * 128 and rec["current_global_batch"] == 8
    assert rec["lr"] == pytest.approx(1e-3 * (96 / 8) ** 0.5)
    rec = recommend_batch(100.0, 16, 2, cfg)  # two ranks: multiples of 32
    assert (rec["global_batch"], rec["grad_accum_steps"], rec["current_global_batch"]) == (96, 3, 16)
    rec = recommend_batch(5.0, 16, 1, cfg)  # below one micro-batch: a smaller one
    assert (rec["global_batch"], rec["micro_batch"], rec["grad_accum_steps"]) == (4, 4, 1) and rec["note"]
    assert recommend_batch(None, 16, 1, cfg)["global_batch"] is None


@pytest.mark.timeout(180)
def test_lm_noise_scale_grows_as_the_model_learns(tiny_overrides, one_thread, tmp_path):
    """The LM job's B_simple at initialization and at a checkpoint 100 steps later: the gradient
    signal shrinks faster than its noise as the loss falls (McCandlish et al.), so the critical
    batch grows; a measurement that ignored the checkpoint would read the same weights twice."""
    from slipstream.train.lm import train_lm
    from slipstream.tune.noise_scale import measure_lm_noise_scale

    base = [*tiny_overrides, "--train.device=cpu", "--train.threads=1"]
    train_lm(load_config(None, [*base, "--train.max_steps=100", "--train.eval_steps=0", "--optim.lr=3e-3"]))
    measure = [*base, "--train.micro_batch_size=8"]
    at_init = measure_lm_noise_scale(load_config(None, measure), rounds=6, k=4)
    trained = measure_lm_noise_scale(load_config(None, [*measure, f"--checkpoint.resume={tmp_path / 'run'}"]),
                                     rounds=6, k=4)
    assert at_init["measured_at"] == "initialization" and trained["measured_at"].endswith("step_00000100")
    assert (at_init["b_small"], at_init["b_big"], at_init["seq_len"]) == (8, 32, 32)
    assert trained["b_simple"] > 3 * at_init["b_simple"], (at_init["b_simple"], trained["b_simple"])
    assert trained["b_simple_tokens"] == pytest.approx(32 * trained["b_simple"])
