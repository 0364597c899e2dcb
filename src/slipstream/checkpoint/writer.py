"""Writing checkpoints: synchronous or asynchronous, committed atomically, with a manifest.

    save(step, ...)   every rank: DCP writes its shard into <dir>/.step_N.tmp/model_optim
                      (async: the state is copied to host memory now, written by a thread)
    each rank         when its shard is on disk: writes rank<R>.manifest.json (size + CRC32
                      of every file it wrote), from the writer thread
    rank 0, poll()    once its own save finished and every rank's manifest exists: writes
                      trainer_state.json, config.toml, meta.json, manifest.json, then COMPLETE,
                      renames the folder to step_N, and prunes old checkpoints

Ranks coordinate through those files, not collectives, so an asynchronous save never
competes with the training step's collectives (DCP's own coordination uses a separate gloo
group). A folder without COMPLETE is ignored by every reader; a crash at any point leaves
at worst a stale .tmp folder, which the next save removes.
"""

from __future__ import annotations

import functools
import io
import json
import os
import shutil
import signal
import time
import zlib
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from slipstream.checkpoint import manager as ckpt
from slipstream.diskspace import disk_full_error, is_disk_full

MANIFEST = "manifest.json"


class CheckpointWriteError(RuntimeError):
    """A save that could not finish (a failed write, or a rank that never reported back). Not a
    user error: a launcher with restarts should retry the job."""


def file_crc32(path: Path, chunk: int = 1 << 22) -> int:
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = zlib.crc32(block, crc)
    return crc


def _describe(folder: Path, names: list[str]) -> dict[str, list[int]]:
    return {name: [(folder / name).stat().st_size, file_crc32(folder / name)] for name in names}


def _killsave_steps(rank: int) -> set[int]:
    """Steps whose save this rank is told to die in (SLIPSTREAM_INJECT_FAULT killsave@STEP[@RANK], tests only)."""
    from slipstream.resilience.runtime import FAULT_ENV, first_attempt, parse_faults

    if not os.environ.get(FAULT_ENV) or not first_attempt():
        return set()
    return {step for kind, step, r in parse_faults(os.environ[FAULT_ENV]) if kind == "killsave" and r in (None, rank)}


def state_bytes(payload: Any) -> int:
    """Bytes a save's payload needs on disk: its tensors (a DTensor counts whole, as the ranks'
    shards add up to it), and every other value, which DCP writes as a torch.save blob of its own
    (the flat optimizer state has a few per parameter: its group's lr, betas, ...)."""
    total, stack = 0, [payload]
    while stack:
        value = stack.pop()
        if isinstance(value, dict):
            stack += value.values()
        elif isinstance(value, (list, tuple)):
            stack += value
        elif isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        else:
            total += _blob_bytes()
    return total


@functools.cache
def _blob_bytes() -> int:
    """The size of one small value saved by torch.save (mostly its zip framing): ~1.3 KB on torch 2.13."""
    buffer = io.BytesIO()
    torch.save(0.0, buffer)
    return len(buffer.getvalue())


def _own_shard_files(folder: Path, rank: int) -> list[str]:
    """The files DCP's FileSystemWriter wrote for this rank (rank 0 also writes the metadata)."""
    shards = folder / "model_optim"
    names = sorted(f"model_optim/{p.name}" for p in shards.glob(f"__{rank}_*.distcp"))
    if rank == 0 and (shards / ".metadata").exists():
        names.append("model_optim/.metadata")
    return names


@dataclass
class _Pending:
    step: int
    tmp: Path
    final: Path
    future: Future | None          # None: the shards were written synchronously
    commit_args: dict[str, Any]    # rank 0: what the commit writes besides the shards
    needed_bytes: int = 0          # the tensors' bytes: what a full disk is told it lacked
    started: float = field(default_factory=time.perf_counter)


class CheckpointWriter:
    """Saves checkpoints of one run; at most one save is in flight at a time."""

    def __init__(self, checkpoints_dir: Path, keep_last: int, keep_every: int = 0, async_save: bool = False,
                 commit_timeout_s: float = 600.0, group=None):
        self.dir = Path(checkpoints_dir)
        self.keep_last, self.keep_every = keep_last, keep_every
        self.async_save = async_save
        self.commit_timeout_s = commit_timeout_s
        self.rank, self.world = ckpt.rank_world()
        self.pending: _Pending | None = None
        self.last_committed: Path | None = None
        self.last_stall_s = 0.0      # how long the training loop was blocked by the last save
        self.last_write_s = 0.0      # how long the last save took from start to commit
        # DCP's background coordination needs its own gloo group (Parallel.side_group): it must
        # never interleave with the training step's collectives on the default group.
        if async_save and self.world > 1 and group is None:
            raise ValueError("an asynchronous CheckpointWriter of a distributed job needs a separate gloo group")
        self._group = group
        self._manifest_error: BaseException | None = None  # raised by the writer thread's callback
        self._kill_at = _killsave_steps(self.rank)

    def save(self, step: int, model, optimizer, trainer_state: dict[str, Any], config_toml: str,
             meta: dict[str, Any], extra_files: dict[str, str | Path] | None = None) -> float:
        """Start (async) or do (sync) the save of `step`; returns the stall in seconds."""
        t0 = time.perf_counter()
        self.wait()  # the previous save must be committed first (bounded memory, ordered commits)
        final = self.dir / ckpt.checkpoint_name(step)
        tmp = self.dir / f".{final.name}.tmp"
        if self.rank == 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            for stale in self.dir.glob(".step_*.tmp"):
                shutil.rmtree(stale, ignore_errors=True)  # left by a crashed save
            tmp.mkdir()
        ckpt.barrier()
        payload = ckpt.state_payload(model, optimizer)
        needed = state_bytes(payload)
        per_rank = optimizer is not None and ckpt.is_local_sgd(optimizer)
        commit_args = dict(step=step, has_optimizer=optimizer is not None, trainer_state=trainer_state,
                           config_toml=config_toml, extra_files=extra_files,
                           meta={"world_size": self.world, "per_rank_model": per_rank, "optim_flat": True, **meta})
        try:
            with ckpt.quiet_dcp():
                if self.async_save:
                    future = dcp.async_save(payload, checkpoint_id=str(tmp / "model_optim"), process_group=self._group)
                    future.add_done_callback(lambda f: self._write_rank_manifest(step, tmp, f))
                else:
                    dcp.save(payload, checkpoint_id=str(tmp / "model_optim"))
                    future = None
                    self._write_rank_manifest(step, tmp)
        except BaseException as e:
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            self._raise_if_disk_full(e, step, final, needed)
            raise
        self.pending = _Pending(step, tmp, final, future, commit_args, started=t0, needed_bytes=needed)
        if not self.async_save:
            self.wait()
        self.last_stall_s = time.perf_counter() - t0
        return self.last_stall_s

    def _write_rank_manifest(self, step: int, tmp: Path, future: Future | None = None) -> None:
        if future is not None and future.exception() is not None:
            return  # the failure surfaces in poll()/wait() on the training thread
        if step in self._kill_at:  # test fault: die with this rank's shards on disk, unreported
            print(f"injected kill -9 in the save of step {step} on rank {self.rank}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            files = _describe(tmp, _own_shard_files(tmp, self.rank))
            # Written by the writer thread while rank 0 polls for it: it must appear complete or not at all.
            part = tmp / f".rank{self.rank}.manifest.json.part"
            ckpt.write_text(part, json.dumps(files))
            os.replace(part, tmp / f"rank{self.rank}.manifest.json")
        except BaseException as e:
            if future is None:
                raise
            # A future swallows its callbacks' errors: keep it for poll()/wait(), which would
            # otherwise wait for this manifest until the commit timeout.
            self._manifest_error = e

    def _raise_if_disk_full(self, error: BaseException, step: int, final: Path, needed: int) -> None:
        """A save that failed for want of disk space becomes a DiskFullError (a user error: a restart
        would fail the same way) naming the path, the sizes and the last good checkpoint."""
        if not is_disk_full(error, self.dir, needed):
            return
        kept = ckpt.list_checkpoints(self.dir)
        after = (f"the partial save was removed and the last good checkpoint '{kept[-1]}' is intact (resume from "
                 "it with --checkpoint.resume=auto)" if kept else "the partial save was removed; there is no "
                 "earlier checkpoint")
        raise disk_full_error(f"checkpoint step {step}", final, needed, after) from None

    def _shards_done(self) -> bool:
        pending = self.pending
        if pending.future is not None:
            if not pending.future.done():
                return False
            error = pending.future.exception() or self._manifest_error
            if error is not None:
                self.pending, self._manifest_error = None, None
                if self.rank == 0:
                    shutil.rmtree(pending.tmp, ignore_errors=True)
                self._raise_if_disk_full(error, pending.step, pending.final, pending.needed_bytes)
                raise CheckpointWriteError(f"saving checkpoint step {pending.step} failed: {type(error).__name__}: "
                                           f"{str(error).splitlines()[0][:300] if str(error) else ''}")
        if self.rank != 0:  # only rank 0 commits (and then renames the folder these files are in)
            return (pending.tmp / f"rank{self.rank}.manifest.json").exists() or pending.final.exists()
        return all((pending.tmp / f"rank{r}.manifest.json").exists() for r in range(self.world))

    def poll(self) -> Path | None:
        """Commit the in-flight save if it has finished everywhere; returns the committed path."""
        if self.pending is None or not self._shards_done():
            return None
        return self._commit()

    def wait(self, timeout_s: float | None = None) -> Path | None:
        """Block until the in-flight save is committed (rank 0) or written (other ranks)."""
        if self.pending is None:
            return None
        timeout_s = self.commit_timeout_s if timeout_s is None else timeout_s
        if self.pending.future is not None:
            try:
                self.pending.future.exception(timeout=timeout_s)  # blocks until the writer thread is done
            except TimeoutError:
                raise CheckpointWriteError(f"checkpoint step {self.pending.step}: the write did not finish within "
                                           f"{timeout_s:g} s") from None
        deadline = time.monotonic() + timeout_s
        while not self._shards_done():
            if time.monotonic() > deadline:
                step = self.pending.step
                raise CheckpointWriteError(f"checkpoint step {step}: not every rank finished writing within "
                                           f"{timeout_s:g} s; a rank may have died")
            time.sleep(0.01)
        return self._commit()

    def _commit(self) -> Path:
        pending, self.pending = self.pending, None
        if self.rank == 0:
            args = pending.commit_args
            try:
                ckpt.write_checkpoint_files(pending.tmp, args["step"], args["has_optimizer"], args["trainer_state"],
                                            args["config_toml"], args["meta"], args["extra_files"],
                                            manifest=self._merged_manifest(pending.tmp))
            except BaseException as e:
                shutil.rmtree(pending.tmp, ignore_errors=True)
                self._raise_if_disk_full(e, pending.step, pending.final, pending.needed_bytes)
                raise
            ckpt.commit(pending.tmp, pending.final, self.dir)
            prune(self.dir, self.keep_last, self.keep_every, protect=pending.final)
        self.last_committed = pending.final
        self.last_write_s = time.perf_counter() - pending.started
        return pending.final

    def _merged_manifest(self, tmp: Path) -> dict[str, list[int]]:
        files: dict[str, list[int]] = {}
        for r in range(self.world):
            path = tmp / f"rank{r}.manifest.json"
            files.update(json.loads(path.read_text(encoding="utf-8")))
            path.unlink()
        return files


def prune(checkpoints_dir: Path, keep_last: int, keep_every: int = 0, protect: Path | None = None) -> None:
    """Keep the newest keep_last complete checkpoints, plus every step divisible by keep_every."""
    complete = ckpt.list_checkpoints(checkpoints_dir)
    for path in complete[:-keep_last] if keep_last > 0 else []:
        step = int(path.name.removeprefix("step_"))
        if keep_every and step % keep_every == 0:
            continue
        if protect is None or path.resolve() != Path(protect).resolve():
            shutil.rmtree(path, ignore_errors=True)
