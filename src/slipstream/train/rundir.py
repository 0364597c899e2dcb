"""The run directory: where it is, that it is usable, and what it holds at start-up.

A run directory is slipstream's own (trusted) folder, so only a folder slipstream made may be
written into:

  - `.slipstream-run` marks it: written when a run creates the folder (or finds it empty).
    A non-empty folder without the mark is someone else's and is refused before any work,
    so a user's config.toml, metrics.jsonl or summary.json is never overwritten.
  - `.slipstream-lock` serializes runs: the run holds an exclusive `flock` on it from before
    it writes anything until it ends; a second run in the same folder stops with an error
    naming the holder's pid and host. The kernel drops the lock when its holder dies, so
    a lock file left by a killed run blocks nothing; the file only records who holds it.
  - history: a fresh run in a folder that holds an earlier run's results moves them
    (config.toml, env.json, metrics.jsonl, summary.json, logs/) into `history/<n>/`,
    n = 1, 2, ... in start order, before it writes its own. A resumed run continues the
    same run: it keeps metrics.jsonl up to its checkpoint's step (the later steps are
    logged again) and replaces the rest.

In a distributed job rank 0 alone checks, marks, locks and writes (the folder is shared);
the other ranks get its verdict by broadcast, so every rank stops with the same error
instead of waiting in a collective for a rank that has left.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import IO, Any, Callable

from slipstream.config.schema import Config
from slipstream.errors import UserError

MARKER = ".slipstream-run"
LOCK = ".slipstream-lock"
HISTORY = "history"
# One run's own results; the checkpoints, TensorBoard events and traces of a folder are shared
# by its runs (a fresh run refuses a folder with checkpoints; TensorBoard appends event files).
RUN_FILES = ("config.toml", "env.json", "metrics.jsonl", "summary.json", "logs")


def make_run_dir(cfg: Config) -> Path:
    """run.dir if set; with resume=auto the newest default run (runs/latest); else a new runs/<name>-<time>."""
    if cfg.run.dir:
        return Path(cfg.run.dir).expanduser()
    latest = Path("runs") / "latest"
    dangling = None
    if cfg.checkpoint.resume == "auto" and latest.is_symlink():
        if latest.resolve().is_dir():
            return Path("runs") / os.readlink(latest)
        dangling = os.readlink(latest)  # the run it named was deleted or moved
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path, n = Path("runs") / f"{cfg.run.name}-{stamp}", 1
    while path.exists():  # two runs started in the same second
        n += 1
        path = Path("runs") / f"{cfg.run.name}-{stamp}-{n}"
    if dangling is not None and os.environ.get("RANK", "0") == "0":
        # Not silently: the user asked to continue a run, and there is none to continue.
        print(f"note: runs/latest points to '{dangling}', which does not exist; checkpoint.resume=auto has "
              f"nothing to continue and starts a new run in {path}", flush=True)
    return path


def _unmarked_content(run_dir: Path) -> list[str]:
    """What makes run_dir someone else's folder: its entries when it has no marker ([] when
    it is marked or empty; a lock file alone is what a run killed at start-up leaves)."""
    if (run_dir / MARKER).is_file() or _older_slipstream_run(run_dir):
        return []
    return sorted(name for name in os.listdir(run_dir) if name != LOCK)


def _older_slipstream_run(run_dir: Path) -> bool:
    """A run directory written before the marker existed: its config.toml and at least one
    checkpoint with slipstream's meta.json. Resuming it (a requeued job after an upgrade)
    must keep working; the marker is written when the run starts."""
    checkpoints = run_dir / "checkpoints"
    return ((run_dir / "config.toml").is_file() and checkpoints.is_dir() and not checkpoints.is_symlink()
            and any((c / "meta.json").is_file() for c in checkpoints.glob("step_*")))


def check_run_dir(run_dir: Path) -> None:
    """Fail early, before data or model work, when the run directory cannot be used."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory '{run_dir}' exists and is not a folder; choose another --run.dir")
    if run_dir.is_dir():
        foreign = _unmarked_content(run_dir)
        if foreign:
            shown = ", ".join(foreign[:4]) + (", ..." if len(foreign) > 4 else "")
            raise UserError(f"run directory '{run_dir}' is not empty ({shown}) and was not created by slipstream "
                            f"(no {MARKER}); it would overwrite those files: choose a new or empty --run.dir "
                            f"(if it is a run directory of an older slipstream, `touch {run_dir / MARKER}`)")
    probe = run_dir
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise UserError(f"cannot create the run directory '{run_dir}': '{probe}' is not writable; "
                        "choose another --run.dir")


def on_rank0(parallel, fn: Callable[..., Any], *args: Any) -> Any:
    """fn(*args) on rank 0 only; a UserError there is raised on every rank (one broadcast,
    which also makes the other ranks wait until rank 0 is done). Returns fn's result on rank 0."""
    result, error = None, None
    failure: BaseException | None = None
    if parallel.is_main:
        try:
            result = fn(*args)
        except UserError as e:
            error = str(e)
        except Exception as e:  # noqa: BLE001 - the other ranks must not wait forever; re-raised below
            error, failure = f"rank 0 failed while preparing the run directory ({type(e).__name__}: {e})", e
    error = parallel.broadcast(error)  # a collective: every rank learns rank 0's verdict
    if failure is not None:
        raise failure
    if error is not None:
        raise UserError(error)
    return result


def _point_latest(run_dir: Path) -> None:
    """runs/latest -> the newest run (only for runs under the default runs/ folder)."""
    if run_dir.parent.name != "runs":
        return
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest.tmp-{os.getpid()}"
    with contextlib.suppress(OSError):
        if tmp.is_symlink():
            tmp.unlink()
        os.symlink(run_dir.name, tmp)
        os.replace(tmp, link)


def _record_step(line: str) -> int | None:
    """The step of a metrics.jsonl line; None for a line cut off by a crash."""
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return None


def lock_run_dir(run_dir: Path) -> IO[str]:
    """Take the run directory's exclusive lock (see the module doc); returns the open lock
    file, whose closing releases the lock. A held lock is a UserError naming its holder."""
    f = open(run_dir / LOCK, "a+", encoding="utf-8")  # never truncated before the lock is ours
    try:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        f.seek(0)
        holder = f.read().strip() or "a process that has not written its pid yet"
        f.close()
        raise UserError(f"run directory '{run_dir}' is in use by another run ({holder}); wait for it to finish, "
                        "or choose another --run.dir") from None
    except OSError as e:  # a filesystem without locks: running unlocked would risk two runs mixing files
        f.close()
        raise UserError(f"cannot lock the run directory '{run_dir}' ({e.strerror}); "
                        "choose a --run.dir on a local or lock-capable filesystem") from None
    f.seek(0)
    f.truncate()
    f.write(f"pid {os.getpid()} on host {socket.gethostname()}\n")
    f.flush()
    return f


def release_run_dir(lock: IO[str] | None) -> None:
    if lock is not None and not lock.closed:
        lock.close()  # the kernel drops the flock with the last descriptor


def _rotate_history(run_dir: Path) -> Path | None:
    """Move the previous run's results into history/<n>/ (see the module doc)."""
    if not any((run_dir / name).exists() for name in ("metrics.jsonl", "summary.json")):
        return None  # no results: a previous start that failed early leaves nothing to keep
    history = run_dir / HISTORY
    taken = [int(p.name) for p in history.iterdir() if p.name.isdigit()] if history.is_dir() else []
    dest = history / str(max(taken, default=0) + 1)
    dest.mkdir(parents=True)
    for name in RUN_FILES:
        if (run_dir / name).exists():
            os.rename(run_dir / name, dest / name)
    return dest


def _trim_metrics(metrics: Path, resumed_step: int) -> None:
    """Keep the records up to the checkpoint's step: the resumed run logs the later ones again."""
    kept = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        step = _record_step(line)
        if step is not None and step <= resumed_step:
            kept.append(line)
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, metrics)


def prepare_run_dir(run_dir: Path, config_toml: str, resumed_step: int | None,
                    resumed_from: Path | None = None) -> IO[str]:
    """Create (or check) the run directory, mark and lock it, keep the previous run's history,
    and write config.toml and env.json. Returns the held lock (release_run_dir frees it).

    resumed_step / resumed_from: the checkpoint this run continues, if any. Only a checkpoint
    of this run directory continues its history; any other start is a new run here."""
    from slipstream.observe.env import collect_env, write_json_atomic, write_text_atomic

    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the run directory '{run_dir}' ({e.strerror}); choose another --run.dir") from None
    lock = lock_run_dir(run_dir)
    try:
        check_run_dir(run_dir)  # again under the lock: another process may have written meanwhile
        if not (run_dir / MARKER).is_file():
            write_json_atomic(run_dir / MARKER, {"created_by": "slipstream", "pid": os.getpid(),
                                                 "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
        _point_latest(run_dir)
        metrics = run_dir / "metrics.jsonl"
        same_run = resumed_step is not None and (
            resumed_from is None or resumed_from.resolve().parent == (run_dir / "checkpoints").resolve())
        if same_run:
            if metrics.exists():
                _trim_metrics(metrics, resumed_step)
        else:
            _rotate_history(run_dir)
        write_text_atomic(run_dir / "config.toml", config_toml)
        write_json_atomic(run_dir / "env.json", collect_env())
    except BaseException:
        release_run_dir(lock)
        raise
    return lock
