"""One optimizer step of the Trainer: batch -> forward/backward x grad_accum (or the pipeline
schedule) -> clip -> guards -> optimizer -> schedule -> zero grads.

Separate from train/trainer.py so that the loop (`fit()`, with what it owns: meter, memory probe,
evaluator, checkpoint writer, profiler, resilience) and the arithmetic of one step each read in
one sitting. `TrainStepMixin` is a base class of `Trainer`, not an object of its own: its methods
are the Trainer's (`trainer.train_step(it)`, `trainer.accumulate_gradients(it)`,
`trainer.optimizer_step(loss)`), and they use what `Trainer.__init__` builds (cfg, model, loss_fn,
optimizer, scheduler, scaler, skipped_steps, pipeline, moe, the context-parallel handle `_cp`, the
`_autocast` and `_loss_parallel` contexts, `_grads_in_buckets`) and what `fit()` sets (profiler,
resilience, memory). The guards' verdict on a step is left in `self._verdict` for the loop.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from typing import Any

import torch

from slipstream.distributed.data_parallel import clip_grads, full_value, no_sync, total_grad_norm, zero_grads
from slipstream.errors import UserError
from slipstream.optimize.optimizers import torch_optimizers
from slipstream.train.setup import batch_size_of


class TrainStepMixin:
    """The step methods of `Trainer` (train/trainer.py): one optimizer step, measured or not."""

    def _next_batch(self, it: Iterator) -> tuple[Any, float]:
        """The next training batch and the seconds spent waiting for it."""
        t0 = time.perf_counter()
        try:
            with self._label("data"):
                return next(it), time.perf_counter() - t0
        except StopIteration:
            raise UserError("the training data ran out; use an infinite/stateful loader or fewer train.max_steps") from None

    def _label(self, name: str):
        """A slipstream/<name> range in the profiler trace while profiling is active; otherwise
        a no-op context, so unprofiled steps pay nothing for the labels."""
        if self.profiler is not None and self.profiler.labels_active:
            return self.profiler.label(name)
        return contextlib.nullcontext()

    def train_step(self, it: Iterator) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """One optimizer step. Returns (mean loss, grad norm) as device tensors, data wait, items."""
        loss, data_wait, items = self.accumulate_gradients(it)
        with self._label("optimizer"):
            grad_norm = self.optimizer_step(loss)
        if self.moe is not None:  # balancing biases move after every step, applied or skipped
            self.moe.end_step()
        return loss, grad_norm, data_wait, items

    def _measured_train_step(self, it: Iterator) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """train_step under the memory tracker (same math); the probe keeps the report."""
        out: dict[str, Any] = {}

        def forward_backward() -> None:
            out["loss"], out["wait"], out["items"] = self.accumulate_gradients(it)

        def optimizer_step() -> None:
            with self._label("optimizer"):
                out["grad_norm"] = self.optimizer_step(out["loss"])
            if self.moe is not None:  # as train_step
                self.moe.end_step()

        self.memory.measure(self.model, torch_optimizers(self.optimizer), forward_backward, optimizer_step)
        return out["loss"], out["grad_norm"], out["wait"], out["items"]

    def accumulate_gradients(self, it: Iterator) -> tuple[torch.Tensor, float, int]:
        """forward/backward over grad_accum_steps micro-batches; returns (mean loss, data wait, items)."""
        if self.pipeline is not None:
            return self._pipeline_gradients(it)
        accum = self.cfg.train.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        items = 0
        in_backward = self.cfg.optim.in_backward
        dp = self.parallel.dims.dp  # every data-parallel rank processes a micro-batch like this one
        for micro in range(accum):
            if in_backward:  # accumulate, and step inside the last micro-batch's backward only
                self.optimizer.step_enabled = micro == accum - 1
            batch, wait = self._next_batch(it)
            data_wait += wait
            if self._cp is not None:
                batch = self._cp.shard_batch(batch)  # this rank's tokens of every sequence
            items += (self.tokens_per_batch or batch_size_of(batch)) * dp
            # DDP: no gradient all-reduce before the last micro-batch (forward arms it, backward runs it).
            # loss parallel: the cross-entropy's forward and backward both run on the vocabulary shards.
            with no_sync(self.model, last_micro_batch=micro == accum - 1), self._loss_parallel:
                with self._label("forward"), self._autocast:
                    loss = self.loss_fn(self.model, batch)
                if self.resilience is not None and self.resilience.faults:  # tests only: injected faults
                    loss = self.resilience.inject(self.step + 1, loss)
                with self._label("backward"):
                    # Each micro-batch loss is a mean, so dividing by accum makes the summed
                    # gradient equal the gradient of the mean over the whole (big) batch.
                    scaled = loss / accum
                    if self.scaler is not None:
                        scaled = self.scaler.scale(scaled)
                    scaled.backward()
            loss_sum += full_value(loss.detach())  # loss parallel gives a replicated DTensor (no communication)
        return loss_sum / accum, data_wait, items

    def _pipeline_gradients(self, it: Iterator) -> tuple[torch.Tensor, float, int]:
        """The pipeline's forward/backward: the step's grad_accum_steps batches (what one process
        would accumulate), run through the schedule as parallel.pp_microbatches micro-batches."""
        from slipstream.distributed.pipeline_parallel import pipeline_step

        batches, waits = zip(*(self._next_batch(it) for _ in range(self.cfg.train.grad_accum_steps)))
        data_wait = sum(waits)
        inputs, targets = (torch.cat([batch[i] for batch in batches]) for i in (0, 1))
        items = (self.tokens_per_batch or batch_size_of(batches[0])) * len(batches) * self.parallel.dims.dp
        # loss parallel: the last stage's cross-entropy (forward and backward) on the vocabulary shards
        with self._label("pipeline"), self._autocast, self._loss_parallel:
            loss = pipeline_step(self.pipeline, inputs, targets)  # the mean loss, on every pp rank
        if self.resilience is not None and self.resilience.faults:  # tests only: injected faults
            loss = self.resilience.inject(self.step + 1, loss)
        return loss, data_wait, items

    def optimizer_step(self, loss: torch.Tensor | None = None) -> torch.Tensor:
        """clip -> (guards agree) -> step -> schedule -> zero grads; returns the pre-clip gradient
        norm (device tensor). The guards' verdict on this step is left in self._verdict."""
        if self.cfg.optim.in_backward:  # the parameters were already updated during backward
            grad_norm = self.optimizer.take_grad_norm()
            self._decide(loss, grad_norm)
            self.scheduler.step()
            return grad_norm
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)  # clip and log the true gradient, not the scaled one
        clip = self.cfg.optim.grad_clip
        if self.pipeline is not None:  # the norm over every stage, on every pp rank
            from slipstream.distributed.pipeline_parallel import pipeline_grad_norm

            grad_norm = pipeline_grad_norm(self.pipeline, params)
            if clip > 0:
                clip_grads(params, clip, grad_norm)
        elif clip > 0:  # (gradients on several meshes too: expert parallelism's next to the others)
            grad_norm = clip_grads(params, clip)
        else:
            grad_norm = total_grad_norm([p.grad for p in params if p.grad is not None])
        grad_norm = full_value(grad_norm)  # sharded parameters give a DTensor norm (already reduced)
        if self._decide(loss, grad_norm) in ("skip", "rollback", "stop"):
            # Drop this update: the scheduler still advances, so the step count stays the schedule's.
            if self.scaler is not None:
                self.scaler.update()  # closes the scaler's unscale_ of this step (and backs off on inf)
            self.scheduler.step()
            zero_grads(self.optimizer, keep_buckets=self._grads_in_buckets)
            return grad_norm
        if self.scaler is not None:
            scale_before = self.scaler._scale.clone()
            self.scaler.step(self.optimizer)  # skipped when the gradients hold inf/nan
            self.scaler.update()
            # The scaler halves its scale exactly when it skipped the step; counting on the
            # device keeps the step free of host syncs.
            self.skipped_steps += (self.scaler._scale < scale_before).long().squeeze()
        else:
            self.optimizer.step()
        self.scheduler.step()
        zero_grads(self.optimizer, keep_buckets=self._grads_in_buckets)
        return grad_norm

    def _decide(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> str:
        """The guards' verdict on this step (left in self._verdict for the loop)."""
        if self.resilience is None:
            self._verdict = None
            return "ok"
        # The data position is only needed to log a guard event; not worth building on every step otherwise.
        position = self.train_loader.state_dict() if self.resilience.guard is not None else None
        self._verdict = self.resilience.after_step(self.step + 1, loss, grad_norm, position)
        return self._verdict.action
