"""Resuming: which checkpoint to continue from, and whether it fits this run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from slipstream.checkpoint import manager as ckpt
from slipstream.config.schema import Config
from slipstream.errors import UserError

# What a checkpoint's optimizer_layout meant before a key existed (older checkpoints).
LAYOUT_DEFAULTS = {"in_backward": False, "offload": False, "optimizer": "adamw", "state_dtype": "fp32",
                   "dp_strategy": "none", "world_size": 1}
LAYOUT_NAMES = {"in_backward": "optim.in_backward", "offload": "optim.offload", "optimizer": "optim.optimizer",
                "state_dtype": "optim.state_dtype",
                "dp_strategy": "parallel.dp_strategy", "world_size": "processes"}


def resume_target(resume: str, run_dir: Path, verify: bool = True) -> Path | None:
    """The checkpoint checkpoint.resume asks for (none / auto / a path), or None for a fresh run.
    auto takes the newest checkpoint whose files match their manifest (verify) and says which
    damaged ones it skipped."""
    existing = ckpt.list_checkpoints(run_dir / "checkpoints")
    if resume == "none":
        if existing:
            raise UserError(f"run directory '{run_dir}' already has checkpoints; continue it with "
                            "--checkpoint.resume=auto or choose a new --run.dir")
        return None
    if resume == "auto":
        for path in reversed(existing):
            problems = ckpt.verify_checkpoint(path) if verify else []
            if not problems:
                return path
            print(f"warning: skipping damaged checkpoint {path}: {'; '.join(problems[:3])}")
        if existing and verify:
            raise UserError(f"every checkpoint in '{run_dir / 'checkpoints'}' is damaged; start a new --run.dir")
        return None
    target = ckpt.resolve_checkpoint(resume)
    newer = [p for p in existing if p.name > target.name]
    if newer:
        # Continuing here would interleave two histories (and a later resume=auto would jump back).
        raise UserError(f"run directory '{run_dir}' has checkpoints newer than '{target.name}' "
                        f"({', '.join(p.name for p in newer)}); resume into a new --run.dir, "
                        "or delete the newer checkpoints first")
    return target


def load_checkpoint_state(path: Path, model, optimizer, cfg: Config, layout: dict[str, Any],
                          checkpoint_meta: dict[str, Any], checkpoint_files: dict[str, str]) -> dict[str, Any]:
    """Check that checkpoint `path` continues this run, load its weights and optimizer state into
    `model` / `optimizer` (resharding as needed) and return its trainer state (Trainer.load_state_dict).
    layout: this run's Trainer.optimizer_layout(); checkpoint_meta / files: its JobInfo's."""
    if "tokenizer" in checkpoint_meta:  # a language-model job: its model is built from cfg.model
        check_same_model(path, cfg, checkpoint_files.get("tokenizer.json"))
    check_layout(path, layout)
    state = ckpt.load_checkpoint(path, model, optimizer, verify=cfg.checkpoint.verify)
    if state["step"] >= cfg.train.max_steps:
        raise UserError(f"checkpoint '{path}' is at step {state['step']}, which is not below "
                        f"train.max_steps = {cfg.train.max_steps}; raise --train.max_steps to train further")
    return state


# Strategies whose checkpoints hold one named, shardable state (DCP reshards it on load).
RESHARDABLE = ("none", "ddp", "zero2", "fsdp", "hsdp")


def check_layout(path: Path, layout: dict[str, Any]) -> None:
    """The optimizer state is stored per layout. Changing the number of ranks or moving between
    none / ddp / zero2 / fsdp / hsdp is resharding, which DCP does on load; per-rank layouts
    (zero1, local SGD) and other optimizer variants must match."""
    saved = {**LAYOUT_DEFAULTS, **ckpt.read_meta(path).get("optimizer_layout", {})}
    reshard = (saved["dp_strategy"] in RESHARDABLE and layout["dp_strategy"] in RESHARDABLE
               and not ckpt.read_meta(path).get("per_rank_model"))
    if reshard:
        saved = {**saved, "dp_strategy": layout["dp_strategy"], "world_size": layout["world_size"]}
    if saved != layout:
        changed = ", ".join(f"{LAYOUT_NAMES[k]}: {saved.get(k)} -> {v}" for k, v in layout.items() if saved.get(k) != v)
        raise UserError(f"checkpoint '{path}' stores its state for a different layout ({changed}); resume "
                        "with the checkpoint's optimizer settings, dp_strategy and number of processes")


# Model settings that leave the weights' shapes and meaning alone (training- or init-only).
FREE_MODEL_KEYS = ("preset", "dropout", "init_std", "zero_init_proj")


def _saved_config(path: Path) -> Config | None:
    from slipstream.config.load import config_from_toml_text

    try:
        return config_from_toml_text(ckpt.read_text_inside(path, "config.toml"))
    except (OSError, UserError):
        return None  # the checkpoint's own checks (verify, load) name what is wrong with it


def _file_sha256(path: Path | str) -> str | None:
    import hashlib

    try:
        return hashlib.sha256(Path(path).read_bytes()).hexdigest()
    except OSError:
        return None


def check_same_model(path: Path, cfg: Config, tokenizer_file: str | None = None) -> None:
    """A checkpoint continues only the model it was saved from: same shape, same numerics and the
    same tokenizer (another tokenizer gives the same ids other meanings, even at the same vocab
    size). Every differing setting is named at once, so one edit fixes the command.
    tokenizer_file: this run's bpe file, compared by content with the checkpoint's copy."""
    saved = _saved_config(path)
    if saved is None:
        return
    old, new = dataclasses.asdict(saved.model), dataclasses.asdict(cfg.model)
    free = set(FREE_MODEL_KEYS)
    if old["position"] == new["position"] == "rope":
        free.add("max_seq_len")  # rope has no position table: a longer context is the same weights
    diffs = [f"model.{k}: {old[k]!r} -> {new[k]!r}" for k in new if k not in free and old.get(k) != new[k]]
    before, now = saved.data.tokenizer, cfg.data.tokenizer
    if before.startswith("bpe:") and now.startswith("bpe:") and tokenizer_file:
        # The same file may live at another path (a data folder's copy): compare contents.
        theirs = path / "tokenizer.json"  # a plain file, never a link or pipe: read nothing outside
        same_tokenizer = (theirs.is_file() and not theirs.is_symlink()
                          and _file_sha256(theirs) == _file_sha256(tokenizer_file))
    else:
        same_tokenizer = before == now
    if not same_tokenizer:
        diffs.append(f"data.tokenizer: {before!r} -> {now!r}" + (" (other file contents)" if before == now else ""))
    if diffs:
        raise UserError(f"checkpoint '{path}' was saved from a different model than this run's ({'; '.join(diffs)}); "
                        "resume with the checkpoint's model and tokenizer settings, or train the new model in a "
                        "new --run.dir")


def config_changes(path: Path, cfg: Config) -> list[str]:
    """Settings of this run that differ from the checkpoint's config (run.dir and resume aside)."""
    from slipstream.config.load import config_from_toml_text

    try:
        saved = dataclasses.asdict(config_from_toml_text(ckpt.read_text_inside(path, "config.toml")))
    except (OSError, UserError):
        return []
    ignore = {("checkpoint", "resume"), ("run", "dir")}
    return [f"{section}.{key}: {saved[section][key]!r} -> {value!r}"
            for section, values in dataclasses.asdict(cfg).items() for key, value in values.items()
            if (section, key) not in ignore and saved.get(section, {}).get(key) != value]


def saved_sparsity_method(path: Path) -> str:
    """The sparsity.method a checkpoint was saved with ("none": it holds no masks)."""
    from slipstream.config.load import config_from_toml_text

    try:
        return config_from_toml_text(ckpt.read_text_inside(path, "config.toml")).sparsity.method
    except OSError as e:
        raise UserError(f"checkpoint '{path}' has no readable config.toml ({e.strerror}); it is damaged") from None
