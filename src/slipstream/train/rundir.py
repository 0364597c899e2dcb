"""The run directory: where it is, that it is usable, and what it holds at start-up."""

from __future__ import annotations

import contextlib
import json
import os
import time
from pathlib import Path

from slipstream.config.schema import Config
from slipstream.errors import UserError


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


def check_run_dir(run_dir: Path) -> None:
    """Fail early, before data or model work, when the run directory cannot be used."""
    if run_dir.exists() and not run_dir.is_dir():
        raise UserError(f"run directory '{run_dir}' exists and is not a folder; choose another --run.dir")
    probe = run_dir
    while not probe.exists():
        probe = probe.parent
    if not os.access(probe, os.W_OK):
        raise UserError(f"cannot create the run directory '{run_dir}': '{probe}' is not writable; "
                        "choose another --run.dir")


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


def prepare_run_dir(run_dir: Path, config_toml: str, resumed_step: int | None) -> None:
    """Create the run directory and write config.toml and env.json. A resumed run keeps the
    metrics logged up to its checkpoint (it logs the later steps again); a fresh one starts
    an empty metrics.jsonl."""
    from slipstream.observe.env import collect_env, write_json_atomic

    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create the run directory '{run_dir}' ({e.strerror}); choose another --run.dir") from None
    _point_latest(run_dir)
    tmp = run_dir / "config.toml.tmp"
    tmp.write_text(config_toml, encoding="utf-8")
    os.replace(tmp, run_dir / "config.toml")
    write_json_atomic(run_dir / "env.json", collect_env())
    metrics = run_dir / "metrics.jsonl"
    if not metrics.exists():
        return
    if resumed_step is None:
        metrics.unlink()
        return
    kept = []
    for line in metrics.read_text(encoding="utf-8").splitlines():
        step = _record_step(line)
        if step is not None and step <= resumed_step:
            kept.append(line)
    tmp = metrics.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(line + "\n" for line in kept), encoding="utf-8")
    os.replace(tmp, metrics)
