"""The training loop's resilience, in one object: preemption, watchdog, guards, time trigger.

Once per step the trainer calls `after_step(...)`. Everything that must be decided the same
way on every rank is agreed on in one small all-reduce:

    [mean loss, grad norm, preemption requested anywhere, time-based save due (rank 0)]

With the stability guard off, only the two flags are reduced, on CPU tensors (gloo), so no
device sync is added to the step; with it on, the loss and the gradient norm are read on the
host each step (one small sync; the price of per-step NaN/spike protection).

Fault injection for tests (never set in production): SLIPSTREAM_INJECT_FAULT holds
comma-separated `kind@step[@rank]` items, kind in nan, spike, crash, stall, sigterm, sigusr1,
killsave; e.g. `nan@5,crash@7@1`. killsave SIGKILLs the process in the middle of the checkpoint
save of that step: its shards are on disk, its manifest and COMPLETE are not
(checkpoint/writer.py). A crash or killsave fires only in the first attempt of a restarted job
(TORCHELASTIC_RESTART_COUNT and SLIPSTREAM_RESTART_COUNT = 0), so a restarted run can get past it.
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from slipstream.config.schema import Config
from slipstream.errors import UserError
from slipstream.resilience.guards import StabilityGuard
from slipstream.resilience.preemption import EXIT_PREEMPTED, PreemptionHandler
from slipstream.resilience.watchdog import StepWatchdog

FAULT_ENV = "SLIPSTREAM_INJECT_FAULT"
FAULT_KINDS = ("nan", "spike", "crash", "stall", "sigterm", "sigusr1", "killsave")


def first_attempt() -> bool:
    """Not a restart: faults that end the process fire only here."""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0" and \
        os.environ.get("SLIPSTREAM_RESTART_COUNT", "0") == "0"


class Preempted(Exception):
    """Raised by the trainer after the preemption checkpoint is saved; the CLI exits with EXIT_PREEMPTED."""

    exit_code = EXIT_PREEMPTED


@dataclass
class StepVerdict:
    action: str = "ok"                # ok | skip | rollback | stop
    events: list[dict[str, Any]] = field(default_factory=list)
    message: str = ""
    preempt: bool = False             # save now and exit
    save_due: bool = False            # the time-based checkpoint trigger fired


def parse_faults(text: str | None) -> list[tuple[str, int, int | None]]:
    faults = []
    for item in filter(None, (part.strip() for part in (text or "").split(","))):
        parts = item.split("@")
        try:
            kind, step, rank = parts[0], int(parts[1]), int(parts[2]) if len(parts) > 2 else None
        except (IndexError, ValueError):
            raise UserError(f"{FAULT_ENV}: '{item}' is not kind@step[@rank]") from None
        if kind not in FAULT_KINDS:
            raise UserError(f"{FAULT_ENV}: unknown fault '{kind}'; known: {', '.join(FAULT_KINDS)}")
        faults.append((kind, step, rank))
    return faults


class Resilience:
    def __init__(self, cfg: Config, parallel, run_dir: Path, scaler_active: bool = False):
        self.cfg, self.parallel, self.run_dir = cfg, parallel, Path(run_dir)
        s, r = cfg.stability, cfg.resilience
        self.guard = None
        if s.policy != "none":
            self.guard = StabilityGuard(policy=s.policy, max_events=s.max_events, spike_threshold=s.spike_threshold,
                                        window=s.window, min_history=min(10, s.window))
        # fp16's loss scaler skips overflowing steps itself: non-finite gradients are its business.
        self.check_grad_norm = not scaler_active
        on_main_thread = threading.current_thread() is threading.main_thread()
        # Under torchrun, SIGTERM is the agent's order to stop (a peer failed, or the agent itself
        # was told to stop): it must keep its default meaning or a restart would wait on us. Workers
        # of a launched job are told about preemption with SIGUSR1 (Slurm: --signal=USR1@<grace>).
        signals = ("SIGUSR1",) if parallel.env.launched else ("SIGTERM", "SIGUSR1")
        self.preemption = (PreemptionHandler(signals=signals, grace_s=r.grace_s)
                           if r.preemption and on_main_thread else None)
        self.watchdog = StepWatchdog(r.watchdog_s, self.run_dir, rank=parallel.rank) if r.watchdog_s > 0 else None
        self.last_save = time.monotonic()
        self.faults = parse_faults(os.environ.get(FAULT_ENV))
        self._armed = False

    # --- lifecycle

    def __enter__(self) -> Resilience:
        if self.preemption is not None:
            self.preemption.install()
        if self.watchdog is not None:
            self.watchdog.start()
            self.watchdog.pause()  # the first step (compilation, lazy init) is not timed
        return self

    def __exit__(self, *exc: object) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()
        if self.preemption is not None:
            self.preemption.uninstall()

    def paused(self):
        """Legitimately long stretches (eval, checkpoint saves) do not count as a hang."""
        import contextlib

        return self.watchdog.paused() if self.watchdog is not None else contextlib.nullcontext()

    def saved(self) -> None:
        self.last_save = time.monotonic()

    # --- per step

    def inject(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        """Test faults due at this step (see the module docstring); returns the (maybe poisoned) loss."""
        for fault in list(self.faults):
            kind, at, rank = fault
            if at != step or (rank is not None and rank != self.parallel.rank):
                continue
            self.faults.remove(fault)  # once per process: a rolled-back run replays the step number
            if kind == "nan":
                loss = loss * float("nan")
            elif kind == "spike":
                loss = loss * 100.0
            elif kind == "crash" and first_attempt():
                print(f"injected crash at step {step} on rank {self.parallel.rank}", flush=True)
                os._exit(13)
            elif kind == "stall":
                time.sleep(3600)
            elif kind in ("sigterm", "sigusr1"):
                os.kill(os.getpid(), signal.SIGTERM if kind == "sigterm" else signal.SIGUSR1)
        return loss

    def after_step(self, step: int, loss: torch.Tensor | None, grad_norm: torch.Tensor | None,
                   batch_position: Any) -> StepVerdict:
        """Agree across ranks on what happens after this step's gradients exist."""
        if self.watchdog is not None:
            if not self._armed:  # the first step of this process is done: from now on, time every step
                self.watchdog.resume()
                self._armed = True
            self.watchdog.beat(step)
        minutes = self.cfg.checkpoint.interval_minutes
        time_due = float(self.parallel.is_main and minutes > 0 and time.monotonic() - self.last_save >= minutes * 60)
        preempt = float(self.preemption is not None and self.preemption.requested)
        verdict = StepVerdict()
        if self.guard is None:
            if self.parallel.world_size > 1:  # a CPU tensor over gloo: no device sync
                flags = torch.tensor([preempt, time_due])
                dist.all_reduce(flags)
                preempt, time_due = flags.tolist()
            verdict.preempt, verdict.save_due = preempt > 0, time_due > 0
            return verdict
        # The norm can live elsewhere than the loss (FSDP's CPU offload keeps gradients on the host).
        values = torch.stack([loss.detach().float().reshape(()), grad_norm.detach().float().reshape(()).to(loss.device),
                              torch.tensor(preempt, device=loss.device), torch.tensor(time_due, device=loss.device)])
        if self.parallel.world_size > 1:
            dist.all_reduce(values)  # loss and norm summed (norm is equal on all ranks), flags: any
        mean_loss, norm, preempt_any, due_any = values.tolist()
        world = self.parallel.world_size
        decision = self.guard.check(step, mean_loss / world, norm / world if self.check_grad_norm else None,
                                    batch_position)
        verdict.action, verdict.events, verdict.message = decision.action, decision.events, decision.message
        verdict.preempt, verdict.save_due = preempt_any > 0, due_any > 0
        return verdict

    def state_dict(self) -> dict[str, Any]:
        return {"guard": self.guard.state_dict() if self.guard is not None else None}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        if state and state.get("guard") and self.guard is not None:
            self.guard.load_state_dict(state["guard"])


def act_on(trainer, verdict: StepVerdict, loggers, progress) -> None:
    """Log the guards' events and carry out what the ranks agreed on after this step."""
    for event in verdict.events:
        record = {k: (v if not isinstance(v, float) or math.isfinite(v) else str(v)) for k, v in event.items()
                  if k not in ("batch_position", "kind", "step")}
        loggers.log({"step": trainer.step, "guard_event": event["kind"], "action": verdict.action, **record})
        progress.print_line(f"step {trainer.step}: {event['kind']} (loss {event['loss']}, grad norm "
                            f"{event['grad_norm']}): {verdict.action}")
    if verdict.action == "stop":
        trainer.writer.wait()
        raise UserError(verdict.message)
    if verdict.action == "rollback":
        trainer.writer.wait()
        trainer.parallel.barrier()  # rank 0 has committed what the others wrote
        local = trainer.writer.last_committed or trainer.resume_target()
        target = Path(name) if (name := trainer.parallel.broadcast(str(local) if local else None)) else None
        if target is None:
            raise UserError(f"step {trainer.step}: stability.policy = rollback needs a checkpoint to go back to; "
                            "set --checkpoint.interval (or use policy skip)")
        bad_step = trainer.step
        trainer.resume(Path(target), keep_data_position=True)  # also starts a new logging interval
        progress.print_line(f"rolled back from step {bad_step} to {target.name}; the batches since are skipped")
    if verdict.preempt:
        trainer.writer.wait()
        last = trainer.writer.last_committed
        if last is None or last.name != f"step_{trainer.step:08d}":
            trainer.save_checkpoint()
            trainer.writer.wait()
        trainer.parallel.barrier()
        handler = trainer.resilience.preemption
        left = handler.seconds_left() if handler is not None else 0.0
        progress.print_line(f"preempted: saved {trainer.writer.last_committed} at step {trainer.step} "
                            f"({left:.0f} s of grace left); resume with --checkpoint.resume=auto")
        if handler is not None and handler.requested and left <= 0:
            progress.print_line(f"warning: finishing the step and saving took longer than resilience.grace_s = "
                                f"{handler.grace_s:g} s; a scheduler would have killed the job first. Save more "
                                "often, make saves cheaper, or ask the scheduler for a longer warning")
        raise Preempted(f"preempted at step {trainer.step}")
