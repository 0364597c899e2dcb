"""Validation: a loss estimate with its standard error and the tokens behind it.

Two kinds of validation data:
- `EvalWindows` (language-model jobs): fixed windows of the val split, identical at every
  evaluation, resume and world size; the loss is the mean over windows of each window's
  mean token loss, the standard error is the std of the window losses / sqrt(windows).
- any other loader (the Python API): its first `max_batches` batches, replayed from the
  same start every time; the standard error is over batch losses.
Every rank evaluates its own part; one all-reduce of (sum, sum of squares, count) combines
them, so the result does not depend on how the windows were split over ranks.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

import torch

from slipstream.data.eval_windows import EvalWindows
from slipstream.distributed.data_parallel import full_value
from slipstream.train.lm_loss import lm_sequence_losses


@dataclass
class EvalResult:
    loss: float
    stderr: float | None  # None with fewer than two samples
    samples: int  # windows (or batches) averaged
    tokens: int | None  # target tokens evaluated over all ranks (None when unknown)

    def as_record(self) -> dict[str, Any]:
        return {"val_loss": self.loss, "val_loss_stderr": self.stderr, "val_tokens": self.tokens}


class Evaluator:
    """Owns the validation data and how a model is scored on it (see the module doc)."""

    def __init__(self, data: Any, loss_fn: Callable, parallel, autocast, max_batches: int,
                 sequence_loss_fn: Callable | None = None, context_parallel: Any = None) -> None:
        self.data, self.loss_fn, self.parallel, self.autocast = data, loss_fn, parallel, autocast
        self.cp = context_parallel  # cuts each batch to this rank's tokens, averages the losses over cp
        self.max_batches = max_batches
        self.sequence_loss_fn = sequence_loss_fn or lm_sequence_losses
        self.windows = isinstance(data, EvalWindows)
        self._start_state = None if self.windows else data.state_dict()

    @torch.no_grad()  # not inference_mode: FSDP gathers parameters into buffers autograd may see later
    def __call__(self, model: torch.nn.Module, device: torch.device) -> EvalResult | None:
        was_training = model.training
        model.eval()
        try:
            sums = self._window_sums(model, device) if self.windows else self._batch_sums(model, device)
        finally:
            model.train(was_training)
        if self.parallel is not None:  # None: one process
            sums = self.parallel.sum(sums)  # a collective: every rank's (sum, sum of squares, count) -> the job's
            # The tp / cp ranks of one batch hold the same (sum, squares, count): count each batch once.
            sums = sums / self.parallel.dims.same_batch
        total, squares, n = sums.tolist()  # host sync: the evaluation's one result
        if n == 0:
            return None
        mean = total / n
        stderr = math.sqrt(max(squares / n - mean * mean, 0.0) * n / (n - 1) / n) if n > 1 else None
        tokens = self.data.tokens if self.windows else None
        return EvalResult(loss=mean, stderr=stderr, samples=int(round(n)), tokens=tokens)

    def _window_sums(self, model, device) -> torch.Tensor:
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        for (x, y), weight in self.data:
            if self.cp is not None:
                x, y = self.cp.shard_batch((x, y))
            with self.autocast:
                losses = full_value(self.sequence_loss_fn(model, x, y)).double()  # loss parallel: a DTensor
            if self.cp is not None:  # each rank scored its equal share of every sequence's tokens
                losses = self.cp.mean(losses)
            w = weight.double()
            sums += torch.stack([(losses * w).sum(), (losses * losses * w).sum(), w.sum()])
        return sums

    def _batch_sums(self, model, device) -> torch.Tensor:
        sums = torch.zeros(3, dtype=torch.float64, device=device)
        self.data.load_state_dict(self._start_state)  # the same batches every time
        it = iter(self.data)
        for _ in range(self.max_batches):
            try:
                batch = next(it)
            except StopIteration:
                break
            if self.cp is not None:
                batch = self.cp.shard_batch(batch)
            with self.autocast:
                loss = full_value(self.loss_fn(model, batch)).double()
            if self.cp is not None:
                loss = self.cp.mean(loss)
            sums += torch.stack([loss, loss * loss, torch.ones((), dtype=torch.float64, device=device)])
        return sums


def format_eval(result: EvalResult) -> str:
    """'2.1911 ± 0.0031 over 166,656 tokens' (the parts that are known)."""
    text = f"{result.loss:.4f}"
    if result.stderr is not None:
        text += f" ± {result.stderr:.4f}"
    if result.tokens is not None:
        text += f" over {result.tokens:,} tokens"
    return text


def evaluate_checkpoint(checkpoint: str, data_dir: str | None = None, split: str = "val",
                        max_tokens: int | None = None, batch_size: int | None = None, seq_len: int | None = None,
                        device: str = "auto") -> dict[str, Any]:
    """Score a language-model checkpoint on a prepared split (default: the run's own data,
    every window of its val split), one process. The result is what `slipstream eval` prints."""
    from slipstream.train.lm import load_lm_from_checkpoint

    model, _, cfg = load_lm_from_checkpoint(checkpoint, device=device)
    return {"checkpoint": str(checkpoint), **evaluate_lm(model, cfg, data_dir, split, max_tokens, batch_size, seq_len)}


def evaluate_lm(model: torch.nn.Module, cfg: Any, data_dir: str | None = None, split: str = "val",
                max_tokens: int | None = None, batch_size: int | None = None,
                seq_len: int | None = None) -> dict[str, Any]:
    """Score a language model built from `cfg` (a checkpoint's config) on a prepared split, one
    process, on the device its weights are on."""
    from slipstream.errors import UserError

    data_dir = data_dir or cfg.data.dir
    if not data_dir:
        raise UserError("the checkpoint does not name its data folder; pass --data.dir DIR (a `slipstream data prepare` folder)")
    seq_len = seq_len or cfg.train.seq_len
    if seq_len > cfg.model.max_seq_len:
        raise UserError(f"--seq-len {seq_len} exceeds the model's max_seq_len {cfg.model.max_seq_len}")
    target = next(model.parameters()).device
    windows = EvalWindows(data_dir, split, batch_size or cfg.train.micro_batch_size, seq_len,
                          max_tokens or 2**62, device=target)
    if windows.vocab_size > cfg.model.vocab_size:
        raise UserError(f"{data_dir} has vocabulary {windows.vocab_size}, more than the model's {cfg.model.vocab_size}: "
                        "it was tokenized with another tokenizer; evaluate on data prepared with the checkpoint's")
    from slipstream.optimize.precision import autocast_context

    # A model trained with document packing is scored the same way: attention within documents.
    eot_id = windows.eot_id if cfg.data.packing == "document" else None
    sequence_loss_fn = functools.partial(lm_sequence_losses, fused_chunk=cfg.train.fused_loss_chunk if cfg.train.fused_loss else None,
                                         eot_id=eot_id)
    evaluator = Evaluator(windows, None, None, autocast_context(target, cfg.precision.autocast), 0, sequence_loss_fn)
    result = evaluator(model, target)
    return {"data_dir": str(data_dir), "split": split, "seq_len": seq_len,
            "loss": result.loss, "stderr": result.stderr, "windows": result.samples, "tokens": result.tokens,
            "sampled": windows.sampled, "perplexity": math.exp(result.loss)}
