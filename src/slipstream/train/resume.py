"""Resuming: which checkpoint to continue from, and whether it fits this run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from slipstream.checkpoint import manager as ckpt
from slipstream.config.schema import Config
from slipstream.errors import UserError

# What a checkpoint's optimizer_layout meant before a key existed (older checkpoints).
LAYOUT_DEFAULTS = {"in_backward": False, "offload": False, "dp_strategy": "none", "world_size": 1}
LAYOUT_NAMES = {"in_backward": "optim.in_backward", "offload": "optim.offload",
                "dp_strategy": "parallel.dp_strategy", "world_size": "processes"}


def resume_target(resume: str, run_dir: Path) -> Path | None:
    """The checkpoint checkpoint.resume asks for (none / auto / a path), or None for a fresh run."""
    existing = ckpt.list_checkpoints(run_dir / "checkpoints")
    if resume == "none":
        if existing:
            raise UserError(f"run directory '{run_dir}' already has checkpoints; continue it with "
                            "--checkpoint.resume=auto or choose a new --run.dir")
        return None
    if resume == "auto":
        return existing[-1] if existing else None
    target = ckpt.resolve_checkpoint(resume)
    newer = [p for p in existing if p.name > target.name]
    if newer:
        # Continuing here would interleave two histories (and a later resume=auto would jump back).
        raise UserError(f"run directory '{run_dir}' has checkpoints newer than '{target.name}' "
                        f"({', '.join(p.name for p in newer)}); resume into a new --run.dir, "
                        "or delete the newer checkpoints first")
    return target


def check_layout(path: Path, layout: dict[str, Any]) -> None:
    """The optimizer state is stored per layout (variant, strategy, number of ranks): refuse a mismatch."""
    saved = {**LAYOUT_DEFAULTS, **ckpt.read_meta(path).get("optimizer_layout", {})}
    if saved != layout:
        changed = ", ".join(f"{LAYOUT_NAMES[k]}: {saved.get(k)} -> {v}" for k, v in layout.items() if saved.get(k) != v)
        raise UserError(f"checkpoint '{path}' stores its state for a different layout ({changed}); resume "
                        "with the checkpoint's optimizer settings, dp_strategy and number of processes")


def config_changes(path: Path, cfg: Config) -> list[str]:
    """Settings of this run that differ from the checkpoint's config (run.dir and resume aside)."""
    from slipstream.config.load import config_from_toml_text

    try:
        saved = dataclasses.asdict(config_from_toml_text((path / "config.toml").read_text(encoding="utf-8")))
    except (OSError, UserError):
        return []
    ignore = {("checkpoint", "resume"), ("run", "dir")}
    return [f"{section}.{key}: {saved[section][key]!r} -> {value!r}"
            for section, values in dataclasses.asdict(cfg).items() for key, value in values.items()
            if (section, key) not in ignore and saved.get(section, {}).get(key) != value]
