"""The gradient noise scale and the critical batch size it predicts (McCandlish et al. 2018,
"An Empirical Model of Large-Batch Training", appendix A).

A gradient averaged over B examples has E|G_B|^2 = |G|^2 + tr(Sigma) / B, where G is the true
gradient and Sigma the covariance of one example's gradient. Measuring |G_B|^2 at two batch
sizes gives unbiased estimates of both terms:

    |G|^2     = (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)
    tr(Sigma) = (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)

and the simple noise scale B_simple = tr(Sigma) / |G|^2 estimates the critical batch: below it
a bigger batch cuts the steps almost proportionally, above it the steps barely fall. Here
G_small is the gradient of one micro-batch (B_small examples) and G_big the mean of k of them
(B_big = k x B_small), measured over several rounds at fixed weights. Both estimates are
averaged before their ratio is taken (a ratio of means: the ratio of two noisy estimates is
biased). The noise scale grows as the loss falls, so a measurement at initialization is the
smallest batch the run will want.

`noise_scale` is the estimator (pure); `measure_gradient_noise` measures the norms with a
Trainer's own model, loss and data path (one process); `measure_noise_scale` does it for any
model (Python API) and `measure_lm_noise_scale` for the LM job.
"""

from __future__ import annotations

import contextlib
import math
import shutil
import sys
import tempfile
from typing import Any

import torch

from slipstream.errors import UserError

# The measurement's settings: one micro-batch per accumulate_gradients call, no evaluation (so no
# early stopping either), and the model whole in this one process: a layout of several processes
# (tp, pp, cp, ep, FSDP and its settings) cannot start here, and the full gradient is what is
# measured. A checkpoint of such a layout is resharded on load.
MEASURE_SETTINGS = {"train.grad_accum_steps": 1, "train.eval_steps": 0, "train.early_stop_patience": 0,
                    "parallel.tp": 1, "parallel.pp": 1, "parallel.cp": 1, "parallel.ep": 1,
                    "parallel.dp_strategy": "none", "parallel.dp_replicate": 0, "parallel.dp_shard": 0,
                    "parallel.param_dtype": "none", "parallel.reduce_dtype": "none", "parallel.offload": False}


def noise_scale(small_sq_norms: list[float], big_sq_norms: list[float], b_small: float,
                b_big: float) -> dict[str, Any]:
    """B_simple from measured squared gradient norms: `small_sq_norms` of micro-batch gradients at
    B_small examples, `big_sq_norms` of their means at B_big examples (lists of any length; with
    one value of each per round, the standard error of B_simple over rounds is added).
    b_simple is None when the estimated |G|^2 is not positive: the gradient is all noise at
    these batch sizes (measure more rounds or a bigger B_big)."""
    if not 0 < b_small < b_big:
        raise ValueError(f"need 0 < b_small < b_big (got {b_small}, {b_big})")
    if not small_sq_norms or not big_sq_norms:
        raise ValueError("need at least one squared norm at each batch size")
    small = sum(small_sq_norms) / len(small_sq_norms)
    big = sum(big_sq_norms) / len(big_sq_norms)
    grad_sq, trace = _estimates(small, big, b_small, b_big)
    out = {"b_small": b_small, "b_big": b_big, "small_sq_norm": small, "big_sq_norm": big,
           "grad_sq_norm": grad_sq, "trace_cov": trace,
           "b_simple": trace / grad_sq if grad_sq > 0 and trace > 0 else None, "b_simple_stderr": None,
           "rounds": len(big_sq_norms)}
    n = len(big_sq_norms)
    if out["b_simple"] is not None and len(small_sq_norms) == n >= 3:
        # Jackknife over rounds: B_simple with each round left out in turn.
        leave_one_out = []
        for i in range(n):
            g, t = _estimates((small * n - small_sq_norms[i]) / (n - 1), (big * n - big_sq_norms[i]) / (n - 1),
                              b_small, b_big)
            leave_one_out.append(t / g if g > 0 else None)
        if None not in leave_one_out:  # else one round alone decides whether there is signal: no error bar
            mean = sum(leave_one_out) / n
            out["b_simple_stderr"] = math.sqrt((n - 1) / n * sum((x - mean) ** 2 for x in leave_one_out))
    return out


def _estimates(small: float, big: float, b_small: float, b_big: float) -> tuple[float, float]:
    """The unbiased (|G|^2, tr(Sigma)) from mean squared norms at the two batch sizes."""
    grad_sq = (b_big * big - b_small * small) / (b_big - b_small)
    trace = (small - big) / (1.0 / b_small - 1.0 / b_big)
    return grad_sq, trace


def measure_gradient_noise(trainer, rounds: int, k: int) -> tuple[list[float], list[float]]:
    """Per round: the mean |G_small|^2 of k micro-batch gradients and |G_big|^2 of their mean,
    with the trainer's model, loss, precision and data (train.grad_accum_steps must be 1: one
    accumulate_gradients call is one micro-batch). The weights do not change."""
    if trainer.parallel.world_size > 1 or trainer.pipeline is not None:
        raise UserError("the gradient noise scale is measured in one process (no data or pipeline parallelism): "
                        "each rank's gradient would be only its part or already averaged")
    if trainer.cfg.train.grad_accum_steps != 1:
        raise UserError("measure the noise scale with train.grad_accum_steps = 1 (k micro-batches are its big batch)")
    if rounds < 1 or k < 2:
        raise UserError(f"need at least 1 round of k >= 2 micro-batches (got {rounds} rounds, k = {k})")
    params = [p for p in trainer.model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p, dtype=torch.float32) for p in params]
    small_means, big = [], []
    trainer.model.train()
    it = iter(trainer.train_loader)
    # optim.in_backward steps each parameter inside backward and frees its gradient there: its
    # hooks come off while measuring, or the weights would move and no gradient would be left to read.
    in_backward = trainer.cfg.optim.in_backward
    if in_backward:
        trainer.optimizer.detach()
    try:
        for _ in range(rounds):
            for t in total:
                t.zero_()
            sq = torch.zeros((), dtype=torch.float64, device=trainer.device)
            for _ in range(k):
                trainer.model.zero_grad(set_to_none=True)
                trainer.accumulate_gradients(it)
                # fp16's loss scaling multiplies the gradients: divide it out (a host sync, once per micro-batch).
                scale = trainer.scaler.get_scale() if trainer.scaler is not None else 1.0
                for p, t in zip(params, total):
                    if p.grad is not None:
                        g = p.grad.float() / scale
                        sq += torch.linalg.vector_norm(g).double() ** 2
                        t.add_(g)
            big_sq = sum(torch.linalg.vector_norm(t / k).double() ** 2 for t in total)
            small_means.append(sq.item() / k)  # host sync: once per round
            big.append(float(big_sq))
    finally:
        trainer.model.zero_grad(set_to_none=True)
        if in_backward:
            trainer.optimizer.attach()
        if hasattr(trainer.train_loader, "close"):
            trainer.train_loader.close()
    return small_means, big


def measure_noise_scale(model, train_data, loss_fn, config=None, *, rounds: int = 20, k: int = 8,
                        collate_fn=None, tokens_per_sample: int | None = None) -> dict[str, Any]:
    """B_simple of any model at its current weights (Python API, one process): B_small is the
    config's train.micro_batch_size, B_big = k x B_small. tokens_per_sample adds b_simple_tokens."""
    from slipstream.config.schema import Config
    from slipstream.train.trainer import Trainer
    from slipstream.tune.lr_finder import with_settings

    tmp = tempfile.mkdtemp(prefix="slipstream-noise-")
    try:
        cfg = with_settings(config or Config(), {**MEASURE_SETTINGS, "run.dir": tmp, "checkpoint.resume": "none"})
        trainer = Trainer(model, train_data, loss_fn, config=cfg, collate_fn=collate_fn)
        small, big = measure_gradient_noise(trainer, rounds, k)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    b = cfg.train.micro_batch_size
    result = noise_scale(small, big, b, k * b)
    result["b_simple_tokens"] = (result["b_simple"] * tokens_per_sample
                                 if result["b_simple"] is not None and tokens_per_sample else None)
    return result


def measure_lm_noise_scale(cfg, rounds: int = 10, k: int = 8) -> dict[str, Any]:
    """B_simple of the LM job of `cfg` (built by build_lm_trainer, one process), at initialization
    or at the checkpoint checkpoint.resume names; B_small = train.micro_batch_size sequences."""
    from slipstream.train.lm import build_lm_trainer
    from slipstream.tune.lr_finder import with_settings

    tmp = tempfile.mkdtemp(prefix="slipstream-noise-")
    resume = cfg.checkpoint.resume
    try:
        quiet = with_settings(cfg, {**MEASURE_SETTINGS, "logging.progress": False,
                                    # no step is taken: a checkpoint at any step may be measured
                                    "train.max_steps": 2**31,
                                    # auto resumes the newest checkpoint of the run directory given
                                    "run.dir": cfg.run.dir if resume == "auto" and cfg.run.dir else tmp})
        # The job's notes go to stderr: with --json, stdout is one JSON object.
        with contextlib.redirect_stdout(sys.stderr):
            trainer = build_lm_trainer(quiet)
            target = trainer.resume_target()
            if target is not None:
                trainer.resume(target)
            small, big = measure_gradient_noise(trainer, rounds, k)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    b = quiet.train.micro_batch_size
    result = noise_scale(small, big, b, k * b)
    seq = quiet.train.seq_len
    result.update({"b_simple_tokens": result["b_simple"] * seq if result["b_simple"] is not None else None,
                   "seq_len": seq, "measured_at": f"checkpoint {target}" if target is not None else "initialization"})
    return result


def recommend_batch(b_simple: float | None, micro_batch: int, dp: int, cfg) -> dict[str, Any]:
    """The global batch near B_simple that the layout can run: a multiple of micro_batch x dp (a
    smaller power-of-two micro-batch when B_simple is below one micro-batch per rank), the
    grad_accum_steps that gives it, and the lr rescaled from the config's global batch by the
    square-root rule (AdamW, the Adam family: lr ~ sqrt(batch); SGD would scale linearly)."""
    t = cfg.train
    current = t.micro_batch_size * t.grad_accum_steps * dp
    if b_simple is None:
        return {"global_batch": None, "micro_batch": micro_batch, "grad_accum_steps": None, "lr": None,
                "current_global_batch": current, "lr_rule": "sqrt", "note": "no noise scale: no recommendation"}
    per_rank = b_simple / dp
    note = ""
    if per_rank < micro_batch:  # one step of the largest micro-batch is already past the critical batch
        smaller = 2 ** int(math.floor(math.log2(max(1.0, per_rank))))
        note = (f"B_simple is below one micro-batch of {micro_batch} per rank: a micro-batch of {smaller} "
                f"wastes fewer samples per step")
        micro_batch = smaller
    accum = max(1, round(b_simple / (micro_batch * dp)))
    global_batch = accum * micro_batch * dp
    return {"global_batch": global_batch, "micro_batch": micro_batch, "grad_accum_steps": accum,
            "tokens": global_batch * t.seq_len, "current_global_batch": current,
            "lr": cfg.optim.lr * math.sqrt(global_batch / current), "current_lr": cfg.optim.lr, "lr_rule": "sqrt",
            "note": note}

