"""Resuming: which checkpoint to continue from, and whether it fits this run."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from slipstream.checkpoint import manager as ckpt
from slipstream.config.schema import Config
from slipstream.errors import UserError
from slipstream.train.schedule import scheduler_state

# What a checkpoint's optimizer_layout meant before a key existed (older checkpoints).
LAYOUT_DEFAULTS = {"in_backward": False, "offload": False, "dp_strategy": "none", "world_size": 1}
LAYOUT_NAMES = {"in_backward": "optim.in_backward", "offload": "optim.offload",
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


def capture_state(trainer) -> dict[str, Any]:
    """Everything besides model and optimizer that a resumed run needs (JSON)."""
    par = trainer.parallel
    return {
        "step": trainer.step,
        "tokens_seen": trainer.tokens_seen,
        "scheduler": scheduler_state(trainer.scheduler),
        "train_loader": trainer.train_loader.state_dict(),
        # Each rank's own generators (dropout masks differ per rank only through them).
        "rng": ckpt.capture_rng_state(),
        "rng_per_rank": par.gather(ckpt.capture_rng_state()) if par.world_size > 1 else None,
        # A checkpoint may fall inside a logging interval: keep its partial sums so the
        # resumed run logs exactly what the uninterrupted one does.
        "interval": {"loss_sum": par.mean(trainer._interval_loss).item(), "steps": trainer._interval_steps,
                     "items": trainer._interval_items, "data_wait_s": trainer._interval_wait,
                     "dropped": trainer._interval_dropped},
        "grad_scaler": trainer.scaler.state_dict() if trainer.scaler is not None else None,
        "skipped_steps": int(trainer.skipped_steps.item()),
        "resilience": trainer.resilience.state_dict() if trainer.resilience is not None else None,
    }


def restore_state(trainer, path: Path, keep_data_position: bool = False) -> None:
    """Load a checkpoint into a trainer. keep_data_position: a rollback, which goes back in
    weights and steps but keeps reading after the batches that caused it."""
    from slipstream.distributed.comm_hooks import restore_step

    if "tokenizer" in trainer.checkpoint_meta:  # a language-model job: its model is built from cfg.model
        check_same_model(path, trainer.cfg, trainer.checkpoint_files.get("tokenizer.json"))
    check_layout(path, trainer._optimizer_layout())
    state = ckpt.load_checkpoint(path, trainer.model, trainer.optimizer, verify=trainer.cfg.checkpoint.verify)
    if state["step"] >= trainer.cfg.train.max_steps:
        raise UserError(f"checkpoint '{path}' is at step {state['step']}, which is not below "
                        f"train.max_steps = {trainer.cfg.train.max_steps}; raise --train.max_steps to train further")
    trainer.scheduler.load_state_dict(state["scheduler"])
    if not keep_data_position:
        trainer.train_loader.load_state_dict(state["train_loader"])
        per_rank = state.get("rng_per_rank")
        same_ranks = per_rank and len(per_rank) == trainer.parallel.world_size
        # Resharded: no rank's generators carry over one to one; every rank takes rank 0's.
        ckpt.restore_rng_state(per_rank[trainer.parallel.rank] if same_ranks else state["rng"])
        if trainer.resilience is not None:  # a rollback keeps the live guard: its event count must grow
            trainer.resilience.load_state_dict(state.get("resilience"))
    trainer.step = state["step"]
    trainer.tokens_seen = state["tokens_seen"]
    restore_step(trainer.model, trainer.optimizer, trainer.step)
    interval = state.get("interval")
    if interval and not keep_data_position:
        trainer._interval_loss.fill_(interval["loss_sum"])
        trainer._interval_steps, trainer._interval_items = interval["steps"], interval["items"]
        trainer._interval_wait = interval["data_wait_s"]
        trainer._interval_dropped = interval.get("dropped", 0)
    if trainer.scaler is not None and state.get("grad_scaler"):
        trainer.scaler.load_state_dict(state["grad_scaler"])
    trainer.skipped_steps.fill_(state.get("skipped_steps", 0))
    changes = config_changes(path, trainer.cfg)
    if changes and trainer.parallel.is_main and not keep_data_position:
        print("note: resuming with settings that differ from the checkpoint's: " + "; ".join(changes))


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
FREE_MODEL_KEYS = ("preset", "dropout", "init_std")


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
