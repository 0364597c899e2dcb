"""The training loop: one process on CPU or one accelerator, or one rank of a data-parallel job.

    batch -> forward/backward x grad_accum -> clip -> optimizer -> schedule
          -> metrics (synced only every log_interval) -> eval -> checkpoint

`Trainer` trains any `nn.Module`: the language-model job (`train/lm.py`) uses it, and so
can a user with their own model, loss and dataset:

    trainer = Trainer(model, train_data=my_dataset, loss_fn=lambda m, b: F.mse_loss(m(b[0]), b[1]),
                      config=load_config(None, ["--train.max_steps=100"]))
    summary = trainer.fit()

Host-device syncs happen only at the logging interval: losses and the gradient norm stay
on the device as tensors between logs, so a GPU never waits for the host inside a step.

Under torchrun every rank runs this same loop (the data-parallel wrapper does the gradient
communication); collectives outside the step (loss mean, eval mean, run-dir name,
checkpoint barriers) happen at the same points on every rank, and only rank 0 logs.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slipstream.config.load import config_to_toml
from slipstream.config.schema import Config
from slipstream.distributed.data_parallel import full_value, gradients_live_in_buckets, no_sync
from slipstream.checkpoint.writer import CheckpointWriter
from slipstream.errors import UserError
from slipstream.observe.memprofile import format_memory_report, measure_step_memory, record_memory_history
from slipstream.optimize.apply import apply_optimizations
from slipstream.optimize.optimizers import torch_optimizers
from slipstream.optimize.precision import autocast_context, make_grad_scaler
from slipstream.train.evaluate import format_eval
from slipstream.train.resume import capture_state, restore_state, resume_target
from slipstream.train.rundir import make_run_dir, on_rank0, prepare_run_dir, release_run_dir
from slipstream.train.schedule import build_scheduler
from slipstream.runtime import configure_runtime
from slipstream.train.setup import build_optimizer

LossFn = Callable[[nn.Module, Any], torch.Tensor]


# --- data ------------------------------------------------------------------------------------

def _as_loader(data: Any, cfg: Config, device: torch.device, shuffle: bool, collate_fn=None, parallel=None):
    """Wrap a map-style Dataset in our stateful loader (sharded over the data-parallel ranks);
    pass stateful loaders through."""
    if data is None or (hasattr(data, "state_dict") and hasattr(data, "load_state_dict") and hasattr(data, "__iter__")
                        and not isinstance(data, torch.utils.data.Dataset)):
        dp = parallel.dims.dp if parallel else 1
        if data is not None and getattr(data, "world_size", dp) != dp:
            raise UserError(f"the {'training' if shuffle else 'validation'} loader was built for world_size = "
                            f"{data.world_size}, but this job has {dp} data-parallel ranks: every rank would "
                            f"read the same batches. Build it with rank={parallel.dp_rank if parallel else 0}, "
                            f"world_size={dp}, or pass a Dataset and let the Trainer shard it")
        return data
    if isinstance(data, torch.utils.data.Dataset):
        from slipstream.data.loader import DatasetLoader

        return DatasetLoader(data, batch_size=cfg.train.micro_batch_size, shuffle=shuffle, seed=cfg.train.seed,
                             drop_last=shuffle, collate_fn=collate_fn, device=device,
                             rank=parallel.dp_rank if parallel else 0, world_size=parallel.dims.dp if parallel else 1)
    raise UserError(f"train_data must be a torch Dataset or a stateful loader (state_dict/load_state_dict), "
                    f"got {type(data).__name__}")


def _batch_size(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.shape[0]
    if isinstance(batch, (list, tuple)) and batch:
        return _batch_size(batch[0])
    if isinstance(batch, dict) and batch:
        return _batch_size(next(iter(batch.values())))
    raise UserError(f"cannot tell the batch size of a {type(batch).__name__} batch; pass tokens_per_batch=")


# --- the trainer -------------------------------------------------------------------------------

class Trainer:
    """Trains `model` on `train_data` with `loss_fn(model, batch) -> mean loss`.

    init_model: for a model built on the meta device, a function that materializes and
    initializes it; called after data-parallel wrapping (FSDP: on each rank's shards only).

    val_data: a Dataset or stateful loader (its first train.eval_steps batches are evaluated),
    or `EvalWindows` (fixed windows scored per sequence by `sequence_loss_fn(model, x, y) -> (B,)`).
    tokens_per_batch: tokens in one micro-batch (LMs: batch x seq); None counts samples.
    flops_per_token: training FLOPs per token (or per sample) for MFU; None -> mfu null.
    """

    def __init__(self, model: nn.Module, train_data: Any, loss_fn: LossFn, config: Config | None = None,
                 val_data: Any = None, tokens_per_batch: int | None = None, flops_per_token: float | None = None,
                 collate_fn=None, device: torch.device | None = None, checkpoint_meta: dict | None = None,
                 checkpoint_files: dict[str, str] | None = None, model_summary: str = "", parallel=None,
                 init_model: Callable[[nn.Module], Any] | None = None, planned_peak_bytes: int | None = None,
                 sequence_loss_fn: Callable | None = None):
        from slipstream.distributed.data_parallel import apply_data_parallel
        from slipstream.config.dims import SHARDED
        from slipstream.distributed.mesh import init_parallel

        self.cfg = config or Config()
        # Joins the process group under torchrun (idempotent); a single process gets a world-1 context.
        self.parallel = parallel or init_parallel(self.cfg)
        self.device = device or self.parallel.device
        configure_runtime(self.cfg, self.device)
        on_meta = any(p.is_meta for p in model.parameters())
        if on_meta and init_model is None:
            raise UserError("the model is on the meta device; pass init_model= (a function that materializes "
                            "and initializes it) or build it on a real device")
        sharded = self.parallel.dims.strategy in SHARDED
        if on_meta and not sharded:  # DDP needs real parameters to wrap: materialize first
            init_model(model)
        # The one fixed order: single-device techniques (fp8 -> AC -> compile), then data parallelism.
        model = apply_optimizations(model if on_meta and sharded else model.to(self.device), self.cfg, self.device)
        self.model = apply_data_parallel(model, self.cfg, self.parallel)
        if on_meta and sharded:  # after sharding: each rank allocates only its own shards of the parameters
            init_model(self.model)
        self.loss_fn = loss_fn
        self.train_loader = _as_loader(train_data, self.cfg, self.device, shuffle=True, collate_fn=collate_fn,
                                       parallel=self.parallel)
        from slipstream.data.eval_windows import EvalWindows

        # Fixed evaluation windows pass through as they are; anything else becomes a stateful loader.
        self.val_loader = val_data if isinstance(val_data, EvalWindows) else _as_loader(
            val_data, self.cfg, self.device, shuffle=False, collate_fn=collate_fn, parallel=self.parallel)
        self.tokens_per_batch = tokens_per_batch
        self.flops_per_token = flops_per_token
        self.checkpoint_meta = checkpoint_meta or {}
        self.checkpoint_files = checkpoint_files or {}
        self.model_summary = model_summary
        self.planned_peak_bytes = planned_peak_bytes  # slipstream plan's prediction of the step peak, if any
        self.optimizer = build_optimizer(self.model, self.cfg, self.parallel)
        self._grads_in_buckets = gradients_live_in_buckets(self.model, self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, self.cfg.train.max_steps)
        self.step = 0
        self.tokens_seen = 0
        self.run_dir = Path(self.parallel.broadcast(str(make_run_dir(self.cfg))))  # rank 0 names it
        self._autocast = autocast_context(self.device, self.cfg.precision.autocast)
        self.scaler = make_grad_scaler(self.device, self.cfg.precision)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)  # fp16 overflow skips
        self.evaluator = None
        if self.val_loader is not None and self.cfg.train.eval_steps:
            from slipstream.train.evaluate import Evaluator

            self.evaluator = Evaluator(self.val_loader, loss_fn, self.parallel, self._autocast,
                                       max_batches=self.cfg.train.eval_steps, sequence_loss_fn=sequence_loss_fn)
        self.profiler = None  # a StepProfiler while fit() runs with profile.enabled
        c = self.cfg.checkpoint
        async_save = c.async_save and (self.parallel.world_size == 1 or self.parallel.side_group is not None)
        self.writer = CheckpointWriter(self.run_dir / "checkpoints", c.keep_last, c.keep_every, async_save,
                                       commit_timeout_s=self.cfg.parallel.timeout_s, group=self.parallel.side_group)
        self.resilience = None  # a Resilience while fit() runs: preemption, watchdog, guards
        self._run_lock = None  # the run directory's lock while fit() runs (train/rundir.py)
        self._verdict = None
        if self.cfg.optim.in_backward and self.cfg.stability.policy in ("skip", "rollback"):
            raise UserError(f"stability.policy = {self.cfg.stability.policy} must see the gradients before the update, "
                            "but optim.in_backward updates during backward; use policy stop or none")
        self._reset_interval()
        if self.cfg.metrics.memory_snapshot and self.device.type != "cuda":
            raise UserError("metrics.memory_snapshot records the CUDA caching allocator; this run is on "
                            f"{self.device.type}. Use --metrics.memory_breakdown (works on CPU) instead")

    # --- state ---

    def _reset_interval(self) -> None:
        """Accumulators of the current logging interval. The loss stays a device tensor so
        the loop never waits on the device between logs."""
        self._interval_loss = torch.zeros((), device=self.device)
        self._interval_steps, self._interval_items, self._interval_wait = 0, 0, 0.0
        self._interval_dropped = 0  # steps whose update a stability guard dropped

    def trainer_state(self) -> dict[str, Any]:
        return capture_state(self)

    def _optimizer_layout(self) -> dict[str, bool]:
        """How the optimizer state is laid out in a checkpoint: resuming needs the same layout."""
        return {"in_backward": self.cfg.optim.in_backward, "offload": self.cfg.optim.offload,
                "dp_strategy": self.parallel.dims.strategy, "world_size": self.parallel.world_size}

    def save_checkpoint(self) -> float:
        """Save (async by default: committed later by writer.poll/wait); returns the stall in seconds."""
        meta = {**self.checkpoint_meta, "optimizer_layout": self._optimizer_layout()}
        stall = self.writer.save(self.step, self.model, self.optimizer, self.trainer_state(),
                                 config_to_toml(self.cfg), meta, self.checkpoint_files)
        if self.resilience is not None:
            self.resilience.saved()
        return stall

    def _resume_target(self) -> Path | None:
        """checkpoint.resume's target; with auto, the newest intact checkpoint (rank 0 checks the
        files against their manifests, so every rank resumes from the same one)."""
        target = resume_target(self.cfg.checkpoint.resume, self.run_dir,
                               verify=self.cfg.checkpoint.verify and self.parallel.is_main)
        return Path(name) if (name := self.parallel.broadcast(str(target) if target else None)) else None

    def _resume(self, path: Path, keep_data_position: bool = False) -> None:
        restore_state(self, path, keep_data_position)

    def _snapshot_path(self) -> Path:
        suffix = f"_rank{self.parallel.rank}" if self.parallel.world_size > 1 else ""
        return self.run_dir / f"memory_snapshot{suffix}.pickle"

    def _job_summary(self, summary: dict[str, Any]) -> dict[str, Any]:
        """Distributed runs: the job's shape, and every rank's memory (a collective)."""
        report = self.memory_report
        mine = {"rank": self.parallel.rank, "device": str(self.device), "mem_peak_bytes": summary["mem_peak_bytes"],
                "step_peak_bytes": report.peak_bytes if report is not None else None,
                "step_peak_categories": report.categories if report is not None else None,
                # All gradients exist at the end of backward: the clearest view of what a strategy shards.
                "backward_end_categories": report.phase_categories["backward"]["end"] if report is not None else None}
        per_device = summary["tokens_per_s"] / self.parallel.world_size if summary["tokens_per_s"] else None
        return {"world_size": self.parallel.world_size, "dp_strategy": self.parallel.dims.strategy,
                "tokens_per_s_per_device": per_device, "ranks": self.parallel.gather(mine)}

    # --- the loop ---

    def _prepare_run_dir(self, resume_from: Path | None) -> None:
        # Rank 0 checks, marks and locks the shared folder before any rank writes into it; its
        # verdict reaches every rank (the broadcast is also the barrier). fit() releases the lock.
        self._run_lock = on_rank0(self.parallel, prepare_run_dir, self.run_dir, config_to_toml(self.cfg),
                                  self.step if resume_from is not None else None, resume_from)

    def _make_loggers(self, resumed: bool):
        from slipstream.observe.loggers import make_run_loggers

        return make_run_loggers(self.cfg, self.run_dir, self.parallel, self.step, resumed)

    def _peak_flops(self) -> float | None:
        from slipstream.observe.peaks import device_peak_flops

        if self.flops_per_token is None:
            return None
        # The matmuls run in the autocast dtype, or in FSDP's parameter dtype when that is 16-bit.
        low = {self.cfg.precision.autocast, self.cfg.parallel.param_dtype} & {"bf16", "fp16"}
        dtype_key = sorted(low)[0] if low else ("tf32" if self.device.type == "cuda" else "fp32")
        peak, _source = device_peak_flops(self.device, dtype_key, self.cfg.metrics.peak_tflops or None)
        return peak

    def _next_batch(self, it: Iterator) -> Any:
        try:
            return next(it)
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
        return loss, grad_norm, data_wait, items

    def _measured_train_step(self, it: Iterator) -> tuple[torch.Tensor, torch.Tensor, float, int]:
        """train_step under the memory tracker (same math); fills self.memory_report."""
        out: dict[str, Any] = {}

        def forward_backward() -> None:
            out["loss"], out["wait"], out["items"] = self.accumulate_gradients(it)

        def optimizer_step() -> None:
            with self._label("optimizer"):
                out["grad_norm"] = self.optimizer_step(out["loss"])

        self.memory_report = measure_step_memory(self.model, torch_optimizers(self.optimizer), forward_backward,
                                                 optimizer_step, self.device)
        return out["loss"], out["grad_norm"], out["wait"], out["items"]

    def accumulate_gradients(self, it: Iterator) -> tuple[torch.Tensor, float, int]:
        """forward/backward over grad_accum_steps micro-batches; returns (mean loss, data wait, items)."""
        accum = self.cfg.train.grad_accum_steps
        loss_sum = torch.zeros((), device=self.device)
        data_wait = 0.0
        items = 0
        in_backward = self.cfg.optim.in_backward
        dp = self.parallel.dims.dp  # every data-parallel rank processes a micro-batch like this one
        for micro in range(accum):
            if in_backward:  # accumulate, and step inside the last micro-batch's backward only
                self.optimizer.step_enabled = micro == accum - 1
            t0 = time.perf_counter()
            with self._label("data"):
                batch = self._next_batch(it)
            data_wait += time.perf_counter() - t0
            items += (self.tokens_per_batch or _batch_size(batch)) * dp
            # DDP: no gradient all-reduce before the last micro-batch (forward arms it, backward runs it).
            with no_sync(self.model, last_micro_batch=micro == accum - 1):
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
            loss_sum += loss.detach()
        return loss_sum / accum, data_wait, items

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
        if clip > 0:
            grad_norm = torch.nn.utils.clip_grad_norm_(params, clip)
        else:
            grad_norm = torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None])
        grad_norm = full_value(grad_norm)  # sharded parameters give a DTensor norm (already reduced)
        if self._decide(loss, grad_norm) in ("skip", "rollback", "stop"):
            # Drop this update: the scheduler still advances, so the step count stays the schedule's.
            if self.scaler is not None:
                self.scaler.update()  # closes the scaler's unscale_ of this step (and backs off on inf)
            self.scheduler.step()
            self.optimizer.zero_grad(set_to_none=not self._grads_in_buckets)
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
        self.optimizer.zero_grad(set_to_none=not self._grads_in_buckets)
        return grad_norm

    @contextlib.contextmanager
    def _commit_pending_on_error(self):
        """A run that fails still commits the checkpoint it was writing (it holds the state from
        before the failure), if every rank's part lands soon: a dead peer's never will."""
        try:
            yield
        except BaseException:
            with contextlib.suppress(Exception):
                self.writer.wait(timeout_s=30.0 if self.parallel.world_size > 1 else None)
            raise

    def _act_on(self, verdict, loggers, progress) -> None:
        from slipstream.resilience.runtime import act_on

        act_on(self, verdict, loggers, progress)

    def _decide(self, loss: torch.Tensor | None, grad_norm: torch.Tensor) -> str:
        if self.resilience is None:
            self._verdict = None
            return "ok"
        # The data position is only needed to log a guard event; not worth building on every step otherwise.
        position = self.train_loader.state_dict() if self.resilience.guard is not None else None
        self._verdict = self.resilience.after_step(self.step + 1, loss, grad_norm, position)
        return self._verdict.action

    def evaluate(self):
        """The validation loss with its standard error (an EvalResult), or None without val data."""
        return self.evaluator(self.model, self.device) if self.evaluator is not None else None

    def fit(self) -> dict[str, Any]:
        """Train to train.max_steps (resuming if configured); returns the run summary."""
        try:
            return self._fit()
        finally:  # also on errors: the next run in this folder (even in this process) may start
            release_run_dir(self._run_lock)
            self._run_lock = None

    def _fit(self) -> dict[str, Any]:
        from slipstream.observe.console import TrainProgress, print_summary
        from slipstream.observe.flops import mfu
        from slipstream.observe.memory import peak_memory_bytes, reset_peak_memory

        cfg = self.cfg
        if cfg.profile.enabled:  # first: a profile setting this device cannot honour fails before any work
            from slipstream.observe.profiling import StepProfiler, current_rank

            self.profiler = StepProfiler(cfg.profile, self.device, self.run_dir, rank=current_rank())
        from slipstream.resilience.runtime import Resilience

        self.resilience = Resilience(cfg, self.parallel, self.run_dir, scaler_active=self.scaler is not None)
        resume_from = self._resume_target()
        if resume_from is not None:
            self._resume(resume_from)
        self._prepare_run_dir(resume_from)
        loggers, rank_logger = self._make_loggers(resumed=resume_from is not None)
        peak = self._peak_flops()
        reset_peak_memory(self.device)
        main = self.parallel.is_main
        if resume_from is not None and main:
            print(f"resumed from {resume_from} at step {self.step}")
        if self.model_summary and main:
            print(self.model_summary)
        if self.parallel.dims.strategy != "none" and main:
            from slipstream.distributed.mesh import describe

            print(describe(self.parallel))

        self.model.train()
        it = iter(self.train_loader)
        log_every = cfg.logging.log_interval
        eval_every = cfg.train.eval_interval
        last_ckpt: Path | None = resume_from
        start_step, wall_start = self.step, time.perf_counter()
        train_time, train_items = 0.0, 0
        final_loss = val_loss = val_result = None
        mfu_values: list[float] = []
        # Speed is measured over the steps this process ran (a resumed interval may have
        # started before the checkpoint); the loss and data sums are restored exactly.
        timed_steps, timed_items = 0, 0
        interval_start = loop_start = time.perf_counter()
        loop_side_time = 0.0
        # Memory is measured on the second step this process runs: the optimizer state
        # (created lazily by the first step) then exists, as in every later step.
        measure_at = self.step + 2 if cfg.metrics.memory_breakdown and self.step + 2 <= cfg.train.max_steps else None
        if measure_at is not None and cfg.compile.scope != "off":
            # The tracker is a dispatch mode: compiled code would not run under it (fullgraph
            # fails, otherwise the eager model is measured instead). Never report that.
            if main:
                print("note: metrics.memory_breakdown is skipped with torch.compile (its tracker would measure "
                      "the eager model); compare memory with --compile.scope=off")
            measure_at = None
        memory_record: dict[str, Any] = {}
        self.memory_report = None
        snapshot = None

        # The profiler stops (and writes what it recorded) when the loop ends, also on errors.
        profiling = self.profiler if self.profiler is not None else contextlib.nullcontext()
        with TrainProgress(cfg.train.max_steps, start_step=self.step, enabled=cfg.logging.progress,
                           silent=not main) as progress, \
                profiling, self.resilience, self._commit_pending_on_error():
            while self.step < cfg.train.max_steps:
                if cfg.metrics.memory_snapshot and self.step == start_step + 1:
                    snapshot = contextlib.ExitStack()  # steps 2-3: the steady state, optimizer state included
                    snapshot.enter_context(record_memory_history(self.device, self._snapshot_path()))
                if self.step + 1 == measure_at:
                    # The tracker slows this one step down (its interval's record carries the
                    # mem_* keys, so it can be told apart); the math is unchanged.
                    loss, grad_norm, wait, items = self._measured_train_step(it)
                    memory_record = self.memory_report.to_record()
                else:
                    loss, grad_norm, wait, items = self.train_step(it)
                verdict = self._verdict
                timed_steps += 1
                timed_items += items
                self.step += 1
                self.tokens_seen += items
                if verdict is None or verdict.action == "ok":
                    self._interval_loss += loss
                else:  # a guarded step's loss is reported as an event, not averaged into the log
                    self._interval_dropped += 1
                self._interval_steps += 1
                self._interval_items += items
                self._interval_wait += wait
                progress.advance(self.step)
                if snapshot is not None and self.step in (start_step + 3, cfg.train.max_steps):
                    snapshot.close()  # writes the snapshot file
                    snapshot = None
                    progress.print_line(f"memory snapshot: {self._snapshot_path()} "
                                        "(open it at https://pytorch.org/memory_viz)")

                last = self.step == cfg.train.max_steps
                if self.step % log_every == 0 or last:
                    # The one host-device sync point of the loop (and, distributed, one all-reduce).
                    local_loss = self._interval_loss / max(1, self._interval_steps - self._interval_dropped)
                    mean_loss = self.parallel.mean(local_loss).item()
                    norm = grad_norm.item()
                    now = time.perf_counter()
                    elapsed = now - interval_start
                    train_time += elapsed
                    train_items += timed_items
                    tokens_per_s = timed_items / elapsed if elapsed > 0 else 0.0  # the whole job
                    per_device = tokens_per_s / self.parallel.world_size
                    util = mfu(per_device, self.flops_per_token, peak) if self.flops_per_token else None
                    if util is not None:
                        mfu_values.append(util)
                    record = {
                        "step": self.step, "loss": mean_loss, "lr": self.optimizer.param_groups[0]["lr"],
                        "grad_norm": norm, "step_time_s": elapsed / timed_steps,
                        # after clipping (the norm clip_grad_norm_ leaves behind)
                        "grad_norm_clipped": min(norm, cfg.optim.grad_clip) if cfg.optim.grad_clip > 0 else norm,
                        "data_wait_s": self._interval_wait / self._interval_steps, "tokens_per_s": tokens_per_s,
                        "mfu": util, "mem_peak_bytes": peak_memory_bytes(self.device),
                        "tokens": self.tokens_seen,
                    }
                    if self.parallel.world_size > 1:
                        record["tokens_per_s_per_device"] = per_device
                    record.update(memory_record)
                    memory_record = {}
                    if self.scaler is not None:
                        record["loss_scale"] = self.scaler.get_scale()
                        record["skipped_steps"] = int(self.skipped_steps.item())
                    if not math.isfinite(mean_loss) and self.resilience.guard is None:
                        loggers.log(record, self.step)
                        loggers.close()
                        raise UserError(f"loss became {mean_loss} at step {self.step}; lower optim.lr, "
                                        "raise optim.warmup_steps or check the data")
                    loggers.log(record, self.step)
                    if rank_logger is not None:
                        rank_logger.log({**record, "rank": self.parallel.rank, "local_loss": local_loss.item(),
                                         "tokens_per_s": per_device}, self.step)
                    progress.set_metrics(record)
                    final_loss = mean_loss
                    self._reset_interval()
                    timed_steps, timed_items = 0, 0
                    interval_start = now  # logging time counts towards the next interval

                side_start = time.perf_counter()
                if (eval_every and self.step % eval_every == 0) or last:
                    with self._label("eval"):
                        result = self.evaluate()
                    if result is not None:
                        val_loss, val_result = result.loss, result
                        loggers.log({"step": self.step, **result.as_record()}, self.step)
                        progress.print_line(f"step {self.step}: val_loss {format_eval(result)}")
                interval_save = cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0
                with self.resilience.paused():  # a long eval or save is not a hang
                    rolling_back = verdict is not None and verdict.action == "rollback"  # that state is the bad one
                    if not rolling_back and (interval_save or (last and cfg.checkpoint.save_final)
                                             or (verdict and verdict.save_due)):
                        stall = self.save_checkpoint()
                        loggers.log({"step": self.step, "checkpoint_stall_s": stall}, self.step)
                    self.writer.poll()  # commits a finished asynchronous save
                    if verdict is not None:
                        self._act_on(verdict, loggers, progress)
                if self.profiler is not None and not last:
                    # Ends this iteration's ProfilerStep range (step, logging, eval, checkpoint);
                    # writing the trace happens here once, so it counts as side time, not step time.
                    # After the last step, leaving the `profiling` context stops it instead.
                    self.profiler.step()
                side_time = time.perf_counter() - side_start
                interval_start += side_time  # eval/checkpoint time is not step time
                loop_side_time += side_time

        loop_time = time.perf_counter() - loop_start - loop_side_time
        last_ckpt = self.writer.wait() or self.writer.last_committed or last_ckpt
        self.parallel.barrier()  # every rank's part of the last checkpoint is committed
        loggers.close()
        if rank_logger is not None:
            rank_logger.close()
        if self.profiler is not None and main:
            for path in self.profiler.trace_files:
                print(f"profiler trace: {path} (open it at https://ui.perfetto.dev)")
            if self.profiler.trace_files and self.profiler.memory_timeline_file is not None:
                print(f"memory timeline: {self.profiler.memory_timeline_file}")
            if not self.profiler.trace_files:
                print(f"note: the run ended before profile.start_step = {cfg.profile.start_step}; no trace was written")
        for loader in (self.train_loader, self.val_loader):
            if hasattr(loader, "close"):
                loader.close()  # stop prefetch threads / worker processes now
        summary = {
            "final_loss": final_loss, "val_loss": val_loss,
            "val_loss_stderr": val_result.stderr if val_result else None,
            "val_tokens": val_result.tokens if val_result else None, "steps": self.step,
            "steps_this_run": self.step - start_step, "tokens": self.tokens_seen,
            "skipped_steps": int(self.skipped_steps.item()) if self.scaler is not None else None,
            "tokens_per_s": train_items / train_time if train_time > 0 else None,
            "mfu": sum(mfu_values) / len(mfu_values) if mfu_values else None,
            "mem_peak_bytes": peak_memory_bytes(self.device),
            "wall_time_s": time.perf_counter() - wall_start, "loop_time_s": loop_time,
            "run_dir": str(self.run_dir), "checkpoint": str(last_ckpt) if last_ckpt else None,
            "device": str(self.device),
        }
        summary = {k: v for k, v in summary.items() if not (k == "skipped_steps" and v is None)}
        if self.profiler is not None:
            summary["trace_files"] = [str(p) for p in self.profiler.trace_files]
        if self.memory_report is not None:
            summary["memory"] = {"step": measure_at, "peak_bytes": self.memory_report.peak_bytes,
                                 "phases": self.memory_report.phases, "categories": self.memory_report.categories,
                                 "method": self.memory_report.method, "planned_peak_bytes": self.planned_peak_bytes}
            if self.planned_peak_bytes:  # every run checks the planner (docs/planner.md)
                summary["memory"]["planned_error"] = self.planned_peak_bytes / self.memory_report.peak_bytes - 1
        if self.parallel.world_size > 1:
            summary.update(self._job_summary(summary))
        if not main:
            return summary
        from slipstream.observe.env import write_json_atomic

        write_json_atomic(self.run_dir / "summary.json", summary)
        print_summary({k: v for k, v in summary.items() if k not in ("memory", "ranks")})
        if self.memory_report is not None:
            print(f"memory of training step {measure_at} (rank 0):")
            print(format_memory_report(self.memory_report))
            if self.planned_peak_bytes:
                print(f"  planned by `slipstream plan`: {self.planned_peak_bytes / 2**20:.1f} MiB "
                      f"({summary['memory']['planned_error']:+.1%} of the measured peak)")
        return summary
