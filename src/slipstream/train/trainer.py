"""The training loop: one process on CPU or one accelerator, or one rank of a data-parallel job.

    parallelize(model) once (distributed/parallelize.py), then per step:
    batch -> forward/backward x grad_accum -> clip -> guards -> optimizer -> schedule   (train/step.py)
          -> interval meter (synced only every log_interval) -> eval -> checkpoint

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
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from slipstream.checkpoint import manager as ckpt
from slipstream.checkpoint.writer import CheckpointWriter
from slipstream.config.dims import check_pipeline_config
from slipstream.config.load import check_training_rules, config_to_toml
from slipstream.config.schema import Config
from slipstream.distributed.data_parallel import gradients_live_in_buckets, unwrap
from slipstream.distributed.tensor_parallel import LossParallel
from slipstream.errors import UserError
from slipstream.observe.comm import StepComm
from slipstream.observe.console import TrainProgress
from slipstream.observe.flops import mfu
from slipstream.observe.loggers import RunLoggers
from slipstream.observe.memory import peak_memory_bytes, reset_peak_memory
from slipstream.optimize.precision import autocast_context, make_grad_scaler
from slipstream.optimize.qat import FakeQuantSwitch
from slipstream.optimize.sparsity import SparsitySchedule, sparsity_at, without_masks
from slipstream.runtime import configure_runtime
from slipstream.train.early_stop import EarlyStopping
from slipstream.train.evaluate import format_eval
from slipstream.train.lm_loss import lm_loss_fn
from slipstream.train.memory_probe import MemoryProbe
from slipstream.train.meter import IntervalMeter
from slipstream.train.resume import config_changes, load_checkpoint_state, resume_target, saved_sparsity_method
from slipstream.train.rundir import make_run_dir, on_rank0, prepare_run_dir, release_run_dir
from slipstream.train.schedule import build_scheduler, load_scheduler_state, scheduler_state
from slipstream.train.moe_monitor import MoEMonitor
from slipstream.train.setup import as_loader, build_optimizer
from slipstream.train.step import TrainStepMixin

LossFn = Callable[[nn.Module, Any], torch.Tensor]


# --- the trainer -------------------------------------------------------------------------------

@dataclass
class JobInfo:
    """What the job built around the Trainer tells it about itself (the LM job fills it in)."""

    checkpoint_meta: dict[str, Any] = field(default_factory=dict)  # extra meta.json entries (the tokenizer)
    checkpoint_files: dict[str, str] = field(default_factory=dict)  # copied into every checkpoint: name -> path
    model_summary: str = ""                                          # printed when fit() starts
    planned_peak_bytes: int | None = None                            # slipstream plan's step peak, if any
    calibration: Any = None  # sparsity.criterion = wanda: an iterable of input batches (the LM job's train windows)
    calibration_eot_id: int | None = None  # data.packing = document: calibration attends within documents


def _rng_layout(dims) -> list[int]:
    """The degrees whose groups must hold equal generators (tp and cp ranks draw the same dropout
    base, distributed.sharded_dropout), and the pipeline's."""
    return [dims.tp, dims.cp, dims.pp]


def rng_state_for(state: dict[str, Any], rank: int, world_size: int, layout: list[int]) -> dict[str, Any]:
    """The generator states a resuming rank restores: its own when the checkpoint's ranks map one
    to one onto this run's (same world size and tp/cp/pp degrees), else rank 0's on every rank.
    Resharded, a tp group could otherwise gather ranks that held different states (tp2 -> tp4 at
    one world size) and draw different masks on activations that must stay replicated."""
    per_rank = state.get("rng_per_rank")
    saved_layout = state.get("rng_layout", layout)  # older checkpoints: the world size decides alone
    if per_rank and len(per_rank) == world_size and saved_layout == layout:
        return per_rank[rank]
    return state["rng"]


class Trainer(TrainStepMixin):
    """Trains `model` on `train_data` with `loss_fn(model, batch) -> mean loss`.

    init_model: for a model built on the meta device, a function that materializes and
    initializes it (the parallelize chain calls it; FSDP: after sharding, on each rank's shards).

    val_data: a Dataset or stateful loader (its first train.eval_steps batches are evaluated),
    or `EvalWindows` (fixed windows scored per sequence by `sequence_loss_fn(model, x, y) -> (B,)`).
    tokens_per_batch: tokens in one micro-batch (LMs: batch x seq); None counts samples.
    flops_per_token: training FLOPs per token (or per sample) for MFU; None -> mfu null.
    job: what the job adds to checkpoints and the start-up print (JobInfo).

    The step methods (train_step, accumulate_gradients, optimizer_step) come from TrainStepMixin
    (train/step.py); this file holds the construction, the state and the loop around them.
    """

    def __init__(self, model: nn.Module, train_data: Any, loss_fn: LossFn, config: Config | None = None,
                 val_data: Any = None, tokens_per_batch: int | None = None, flops_per_token: float | None = None,
                 collate_fn=None, device: torch.device | None = None, parallel=None,
                 init_model: Callable[[nn.Module], Any] | None = None, sequence_loss_fn: Callable | None = None,
                 job: JobInfo | None = None):
        from slipstream.data.eval_windows import EvalWindows
        from slipstream.distributed.mesh import check_device_rules, init_parallel
        from slipstream.distributed.parallelize import parallelize

        self.cfg = config or Config()
        check_training_rules(self.cfg)  # config-only rules (a Config built in code was never loaded)
        check_pipeline_config(self.cfg)
        if self.cfg.parallel.pp > 1 and loss_fn is not lm_loss_fn:  # the schedule's last stage computes the loss
            raise UserError("parallel.pp > 1 trains with the language-model loss (next-token cross-entropy, computed "
                            "by the last stage); a custom loss_fn cannot run inside the schedule. Pass "
                            "slipstream.train.lm_loss.lm_loss_fn or set --parallel.pp=1")
        # Joins the process group under torchrun (idempotent); a single process gets a world-1 context.
        self.parallel = parallel or init_parallel(self.cfg)
        self.device = device or self.parallel.device
        check_device_rules(self.cfg, self.device)  # again: `parallel` or `device` may come from the caller
        configure_runtime(self.cfg, self.device)
        self.job = job or JobInfo()
        self.model = parallelize(model, self.parallel, self.cfg, init_model, device=self.device)
        # Context parallel: each rank trains on its piece of every sequence (the trainer cuts the batches).
        self._cp = getattr(unwrap(self.model), "context_parallel", None)
        # Pipeline parallel: the schedule runs forward and backward over this rank's stages.
        self.pipeline = getattr(self.model, "pipeline", None)
        # Mixture of experts: balancing-loss scale, bias updates and the load statistics (None: dense).
        self.moe = MoEMonitor.attach(self.model, self.parallel, self.pipeline.n_microbatches if self.pipeline
                                     else self.cfg.train.grad_accum_steps)
        # quant.qat: fake quantization turns on at quant.qat_start_step (None: no QAT).
        self.qat = FakeQuantSwitch.attach(self.model, self.cfg.quant)
        # sparsity: new masks on the schedule's steps, pruned weights re-zeroed after each step (None: dense).
        self.sparsity = SparsitySchedule.attach(self.model, self.cfg.sparsity, self.job.calibration,
                                                calibration_model=unwrap(self.model),
                                                eot_id=self.job.calibration_eot_id, parallel=self.parallel)
        if self.pipeline is not None:  # evaluation runs through the stages too
            sequence_loss_fn, eval_loss_fn = self.pipeline.sequence_losses, self.pipeline.batch_loss
        self.loss_fn = loss_fn
        self.train_loader = as_loader(train_data, self.cfg, self.device, shuffle=True, collate_fn=collate_fn,
                                       parallel=self.parallel)
        # Fixed evaluation windows pass through as they are; anything else becomes a stateful loader.
        self.val_loader = val_data if isinstance(val_data, EvalWindows) else as_loader(
            val_data, self.cfg, self.device, shuffle=False, collate_fn=collate_fn, parallel=self.parallel)
        self.tokens_per_batch = tokens_per_batch
        self.flops_per_token = flops_per_token
        self.optimizer = build_optimizer(self.model, self.cfg, self.parallel)
        self._grads_in_buckets = gradients_live_in_buckets(self.model, self.cfg)
        self.scheduler = build_scheduler(self.optimizer, self.cfg.optim, self.cfg.train.max_steps)
        self.step = 0
        self.tokens_seen = 0
        self.run_dir = Path(self.parallel.broadcast(str(make_run_dir(self.cfg))))  # rank 0 names it
        # Forward (and, for loss parallel, backward) of a micro-batch run inside both contexts.
        self._autocast = autocast_context(self.device, self.cfg.precision.autocast)
        self._loss_parallel = LossParallel(self.parallel.dims.tp > 1 and self.cfg.parallel.loss_parallel)
        self.scaler = make_grad_scaler(self.device, self.cfg.precision)
        self.skipped_steps = torch.zeros((), dtype=torch.int64, device=self.device)  # fp16 overflow skips
        self.meter = IntervalMeter(self.device, self.parallel)
        self.early_stop = EarlyStopping(self.cfg.train)
        self.evaluator = None
        if self.val_loader is not None and self.cfg.train.eval_steps:
            from slipstream.train.evaluate import Evaluator

            self.evaluator = Evaluator(self.val_loader, loss_fn if self.pipeline is None else eval_loss_fn, self.parallel,
                                       LossParallel(self._loss_parallel.enabled, inside=self._autocast),
                                       context_parallel=self._cp,
                                       max_batches=self.cfg.train.eval_steps, sequence_loss_fn=sequence_loss_fn)
        c = self.cfg.checkpoint
        async_save = c.async_save and (self.parallel.world_size == 1 or self.parallel.side_group is not None)
        self.writer = CheckpointWriter(self.run_dir / "checkpoints", c.keep_last, c.keep_every, async_save,
                                       commit_timeout_s=self.cfg.parallel.timeout_s, group=self.parallel.side_group)
        # Owned while fit() runs: the step profiler, resilience (preemption, watchdog, guards),
        # the memory probe and the run directory's lock (train/rundir.py).
        self.profiler = None
        self.resilience = None
        self.memory = None
        self._run_lock = None
        self._verdict = None

    # --- state ---

    def state_dict(self) -> dict[str, Any]:
        """Everything besides model and optimizer that a resumed run needs (JSON). A collective
        under torchrun (the interval loss mean, every rank's generator states)."""
        par = self.parallel
        return {
            "step": self.step,
            "tokens_seen": self.tokens_seen,
            "scheduler": scheduler_state(self.scheduler),
            "train_loader": self.train_loader.state_dict(),
            # Each rank's own generators (dropout masks differ per rank only through them).
            "rng": ckpt.capture_rng_state(),
            "rng_per_rank": par.gather(ckpt.capture_rng_state()) if par.world_size > 1 else None,
            "rng_layout": _rng_layout(par.dims),
            # A checkpoint may fall inside a logging interval: keep its partial sums so the
            # resumed run logs exactly what the uninterrupted one does.
            "interval": self.meter.state_dict(),
            "grad_scaler": self.scaler.state_dict() if self.scaler is not None else None,
            "skipped_steps": int(self.skipped_steps.item()),  # host sync (only at a save)
            "resilience": self.resilience.state_dict() if self.resilience is not None else None,
            "early_stop": self.early_stop.state_dict(),
            # The step whose masks the checkpoint holds: a resumed run does not prune that step again.
            "sparsity_pruned_at": self.sparsity.pruned_at if self.sparsity is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any], keep_data_position: bool = False) -> None:
        """keep_data_position: a rollback, which goes back in weights and steps but keeps reading
        after the batches that caused it (and keeps the live guard: its event count must grow)."""
        load_scheduler_state(self.scheduler, state["scheduler"])
        if keep_data_position:
            self.meter.reset()
        else:
            self.train_loader.load_state_dict(state["train_loader"])
            ckpt.restore_rng_state(rng_state_for(state, self.parallel.rank, self.parallel.world_size,
                                                 _rng_layout(self.parallel.dims)))
            if self.resilience is not None:
                self.resilience.load_state_dict(state.get("resilience"))
            self.meter.load_state_dict(state.get("interval"))
        # Also on a rollback: the evaluations since the checkpoint scored weights now thrown away.
        self.early_stop.load_state_dict(state.get("early_stop"))
        self.step = state["step"]
        self.tokens_seen = state["tokens_seen"]
        if self.scaler is not None and state.get("grad_scaler"):
            self.scaler.load_state_dict(state["grad_scaler"])
        self.skipped_steps.fill_(state.get("skipped_steps", 0))
        if self.sparsity is not None:
            self.sparsity.pruned_at = state.get("sparsity_pruned_at")

    def optimizer_layout(self) -> dict[str, Any]:
        """How the optimizer state is laid out in a checkpoint: resuming needs the same layout."""
        return {"in_backward": self.cfg.optim.in_backward, "offload": self.cfg.optim.offload,
                "optimizer": self.cfg.optim.optimizer, "state_dtype": self.cfg.optim.state_dtype,
                "dp_strategy": self.parallel.dims.strategy, "world_size": self.parallel.world_size}

    def save_checkpoint(self) -> float:
        """Save (async by default: committed later by writer.poll/wait); returns the stall in seconds."""
        # The mesh the state was sharded over (shown by `checkpoint inspect`; DCP reshards on load).
        mesh = [list(dim) for dim in self.parallel.dims.mesh_dims]
        meta = {**self.job.checkpoint_meta, "optimizer_layout": self.optimizer_layout(), "mesh": mesh}
        stall = self.writer.save(self.step, self.model, self.optimizer, self.state_dict(),
                                 config_to_toml(self.cfg), meta, self.job.checkpoint_files)
        if self.resilience is not None:
            self.resilience.saved()
        return stall

    def resume_target(self) -> Path | None:
        """checkpoint.resume's target; with auto, the newest intact checkpoint (rank 0 checks the
        files against their manifests, so every rank resumes from the same one)."""
        target = resume_target(self.cfg.checkpoint.resume, self.run_dir,
                               verify=self.cfg.checkpoint.verify and self.parallel.is_main)
        # A broadcast from rank 0: every rank resumes from the same checkpoint.
        return Path(name) if (name := self.parallel.broadcast(str(target) if target else None)) else None

    def resume(self, path: Path, keep_data_position: bool = False) -> None:
        """Load a checkpoint into this trainer (model, optimizer and state_dict)."""
        from slipstream.distributed.comm_hooks import restore_step

        # A dense checkpoint (saved without masks) under a run with [sparsity]: loaded without the
        # masks, then pruned in one shot before the next step (optimize/sparsity.py).
        from_dense = self.sparsity is not None and saved_sparsity_method(path) == "none"
        with without_masks(self.model) if from_dense else contextlib.nullcontext():
            state = load_checkpoint_state(path, self.model, self.optimizer, self.cfg, self.optimizer_layout(),
                                          self.job.checkpoint_meta, self.job.checkpoint_files)
        if from_dense:
            self.sparsity.from_dense = True
            now = sparsity_at(state["step"], self.cfg.sparsity)
            if self.parallel.is_main and not keep_data_position:
                what = f"{self.cfg.sparsity.method}, {self.cfg.sparsity.criterion}"
                print(f"sparsity: checkpoint '{path.name}' is dense; " +
                      (f"pruning it to {now:g} ({what}) before step {state['step'] + 1}" if now > 0 else
                       f"its masks start at sparsity.start_step = {self.cfg.sparsity.start_step} ({what})"))
        self.load_state_dict(state, keep_data_position)
        restore_step(self.model, self.optimizer, self.step)
        if self.qat is not None:  # the phase follows the step count: evaluate() agrees before any step
            self.qat.update(self.step)
        changes = config_changes(path, self.cfg)
        if changes and self.parallel.is_main and not keep_data_position:
            print("note: resuming with settings that differ from the checkpoint's: " + "; ".join(changes))

    def evaluate(self):
        """The validation loss with its standard error (an EvalResult), or None without val data."""
        return self.evaluator(self.model, self.device) if self.evaluator is not None else None

    # --- the loop ---

    def fit(self) -> dict[str, Any]:
        """Train to train.max_steps (resuming if configured); returns the run summary."""
        try:
            return self._fit()
        finally:  # also on errors: the next run in this folder (even in this process) may start
            try:
                if self.memory is not None:
                    self.memory.close()  # writes a pending CUDA snapshot
            finally:
                release_run_dir(self._run_lock)
                self._run_lock = None

    def _fit(self) -> dict[str, Any]:
        cfg = self.cfg
        resume_from = self._start()
        loggers = RunLoggers(cfg, self.run_dir, self.parallel, self.step, resumed=resume_from is not None)
        self.memory = MemoryProbe(cfg, self.device, self.step, self._snapshot_path(), self.job.planned_peak_bytes,
                                  is_main=self.parallel.is_main)
        # metrics.comm_volume: the collectives of the step the memory probe measures (both dispatch modes).
        self.comm = StepComm(cfg, self.step, self.parallel, unwrap(self.model), is_main=self.parallel.is_main)
        start_step, wall_start = self.step, time.perf_counter()
        last_eval = None
        self.model.train()
        it = iter(self.train_loader)
        self.meter.start()
        # The profiler stops (and writes what it recorded) when the loop ends, also on errors.
        profiling = self.profiler if self.profiler is not None else contextlib.nullcontext()
        with TrainProgress(cfg.train.max_steps, start_step=self.step, enabled=cfg.logging.progress,
                           silent=not self.parallel.is_main) as progress, \
                profiling, self.resilience, self._commit_pending_on_error():
            while self.step < cfg.train.max_steps and not self.early_stop.stopped:
                self._follow_schedules()
                self.memory.before_step(self.step)
                run_step = self._measured_train_step if self.memory.measures(self.step + 1) else self.train_step
                with self.comm.counting(self.step + 1):
                    loss, grad_norm, wait, items = run_step(it)
                if self.sparsity is not None:  # the optimizer moved the pruned weights (momentum, decay): zero again
                    self.sparsity.apply()
                verdict = self._verdict
                self.step += 1
                self.tokens_seen += items
                # A guarded step's loss is reported as an event, not averaged into the log.
                self.meter.add(loss, items, wait, counted=verdict is None or verdict.action == "ok")
                progress.advance(self.step)
                self.memory.after_step(self.step, progress)
                last = self.step == cfg.train.max_steps
                if self.step % cfg.logging.log_interval == 0 or last:
                    self._log_interval(grad_norm, loggers, progress)
                with self.meter.side_work():  # eval, checkpoint and trace writing are not step time
                    if (cfg.train.eval_interval and self.step % cfg.train.eval_interval == 0) or last:
                        # The model evaluated at step N is the one step N + 1 trains: QAT on from
                        # qat_start_step, the masks of a pruning step at N (both calls are idempotent).
                        self._follow_schedules()
                        last_eval = self._evaluate_and_log(loggers, progress) or last_eval
                    with self.resilience.paused():  # a long eval or save is not a hang
                        self._checkpoint_if_due(verdict, last or self.early_stop.stopped, loggers, progress)
                    if self.profiler is not None and not last:
                        # Ends this iteration's ProfilerStep range; after the last step, leaving
                        # the `profiling` context stops the profiler instead.
                        self.profiler.step()
                if self.early_stop.stopped and not last and self.step % cfg.logging.log_interval:
                    self._log_interval(grad_norm, loggers, progress)  # the interval that ends here
        return self.summarize(loggers, start_step, wall_start, last_eval, resume_from)

    def _follow_schedules(self) -> None:
        """QAT's switch and the sparsity masks follow the step count (self.step: steps done)."""
        if self.qat is not None:
            self.qat.update(self.step)
        if self.sparsity is not None:  # the step count decides: a resumed run needs only the saved masks
            self.sparsity.update(self.step)

    def _start(self) -> Path | None:
        """Before the first step: profiler, resilience, resume, run directory, start-up print."""
        cfg, main = self.cfg, self.parallel.is_main
        if cfg.profile.enabled:  # first: a profile setting this device cannot honour fails before any work
            from slipstream.observe.profiling import StepProfiler, current_rank

            self.profiler = StepProfiler(cfg.profile, self.device, self.run_dir, rank=current_rank())
        from slipstream.resilience.runtime import Resilience

        self.resilience = Resilience(cfg, self.parallel, self.run_dir, scaler_active=self.scaler is not None)
        resume_from = self.resume_target()
        if resume_from is not None:
            self.resume(resume_from)
        # Rank 0 checks, marks and locks the shared folder before any rank writes into it; its
        # verdict reaches every rank (the broadcast is also the barrier). fit() releases the lock.
        self._run_lock = on_rank0(self.parallel, prepare_run_dir, self.run_dir, config_to_toml(cfg),
                                  self.step if resume_from is not None else None, resume_from)
        self._peak = self._peak_flops()
        reset_peak_memory(self.device)
        if resume_from is not None and main:
            print(f"resumed from {resume_from} at step {self.step}")
        if self.job.model_summary and main:
            print(self.job.model_summary)
        if (self.parallel.dims.strategy != "none" or self.parallel.world_size > 1) and main:
            from slipstream.distributed.mesh import describe

            print(describe(self.parallel))
        return resume_from

    def _log_interval(self, grad_norm: torch.Tensor, loggers: RunLoggers, progress) -> None:
        """Log the interval that ends at this step: the loop's one host sync."""
        reading = self.meter.read()  # all-reduce of the loss + host sync
        norm = grad_norm.item()  # host sync (the device is already idle after the one above)
        per_device = reading.tokens_per_s / self.parallel.world_size
        clip = self.cfg.optim.grad_clip
        record = {
            "step": self.step, "loss": reading.mean_loss, "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": norm, "step_time_s": reading.step_time_s,
            "grad_norm_clipped": min(norm, clip) if clip > 0 else norm,  # the norm clip_grad_norm_ leaves behind
            "data_wait_s": reading.data_wait_s, "tokens_per_s": reading.tokens_per_s,
            "mfu": mfu(per_device, self.flops_per_token, self._peak) if self.flops_per_token else None,
            "mem_peak_bytes": peak_memory_bytes(self.device), "tokens": self.tokens_seen,
        }
        if self.parallel.world_size > 1:
            record["tokens_per_s_per_device"] = per_device
        if self.pipeline is not None:  # the measured bubble next to the planned one (a collective)
            record.update(self.pipeline.interval_record(self.parallel))
        record.update(self.memory.take_record())
        if self.moe is not None:  # expert load per layer (a gather under torchrun)
            record.update(self.moe.interval_record())
        loader_metrics = getattr(self.train_loader, "metrics", None)
        if callable(loader_metrics):  # the loader's own numbers, e.g. a data mixture's tokens per source
            record.update(loader_metrics())
        if self.scaler is not None:
            record["loss_scale"] = self.scaler.get_scale()
            record["skipped_steps"] = int(self.skipped_steps.item())  # host sync, at the log only
        loggers.log_interval(record, {"rank": self.parallel.rank, "local_loss": reading.local_loss,
                                      "tokens_per_s": per_device}, progress)
        if reading.mean_loss is not None and not math.isfinite(reading.mean_loss) and self.resilience.guard is None:
            loggers.close()
            raise UserError(f"loss became {reading.mean_loss} at step {self.step}; lower optim.lr, "
                            "raise optim.warmup_steps or check the data")

    def _evaluate_and_log(self, loggers: RunLoggers, progress):
        with self._label("eval"):
            result = self.evaluate()
        if result is not None:
            loggers.log({"step": self.step, **result.as_record()})
            progress.print_line(f"step {self.step}: val_loss {format_eval(result)}")
            if self.early_stop.update(result.loss, self.step):
                progress.print_line(f"stopping early at step {self.step}: {self.early_stop.reason()}")
        return result

    def _checkpoint_if_due(self, verdict, last: bool, loggers: RunLoggers, progress) -> None:
        c = self.cfg.checkpoint
        due = (c.interval and self.step % c.interval == 0) or (last and c.save_final) or (verdict and verdict.save_due)
        rolling_back = verdict is not None and verdict.action == "rollback"  # this step's state is the bad one
        if due and not rolling_back:
            loggers.log({"step": self.step, "checkpoint_stall_s": self.save_checkpoint()})
        self.writer.poll()  # commits a finished asynchronous save
        if verdict is not None:
            from slipstream.resilience.runtime import act_on

            act_on(self, verdict, loggers, progress)

    def _peak_flops(self) -> float | None:
        """The device's peak FLOP/s in the precision the matmuls run in (for MFU)."""
        from slipstream.observe.peaks import device_peak_flops

        if self.flops_per_token is None:
            return None
        # The matmuls run in the autocast dtype, or in FSDP's parameter dtype when that is 16-bit.
        low = {self.cfg.precision.autocast, self.cfg.parallel.param_dtype} & {"bf16", "fp16"}
        dtype_key = sorted(low)[0] if low else ("tf32" if self.device.type == "cuda" else "fp32")
        peak, _source = device_peak_flops(self.device, dtype_key, self.cfg.metrics.peak_tflops or None)
        return peak

    def summarize(self, loggers: RunLoggers, start_step: int, wall_start: float, last_eval,
                  resume_from: Path | None) -> dict[str, Any]:
        """After the loop: commit the last checkpoint, close everything, write summary.json."""
        from slipstream.train.summary import run_summary

        return run_summary(self, loggers, start_step, wall_start, last_eval, resume_from)

    def _snapshot_path(self) -> Path:
        suffix = f"_rank{self.parallel.rank}" if self.parallel.world_size > 1 else ""
        return self.run_dir / f"memory_snapshot{suffix}.pickle"

    @contextlib.contextmanager
    def _commit_pending_on_error(self):
        """A run that fails still commits the checkpoint it was writing (it holds the state from
        before the failure), if every rank's part lands soon: a dead peer's never will."""
        try:
            yield
        except BaseException as e:
            # Bounded after Ctrl-C (the user wants out now) and with peers (a dead one never commits).
            bounded = self.parallel.world_size > 1 or isinstance(e, KeyboardInterrupt)
            with contextlib.suppress(Exception):
                self.writer.wait(timeout_s=30.0 if bounded else None)
            raise
