"""`slipstream checkpoint prune`: one-shot pruning of a trained (dense) checkpoint, no training.

    slipstream checkpoint prune RUN --out FOLDER --method magnitude|2:4 [--criterion magnitude|wanda]
                                [--target 0.5] [--scope layer|global] [--calibration-tokens N]

The checkpoint's weights are loaded, masked by optimize/sparsity.py's rules (Wanda: with the
input norms of `calibration_tokens` of the train split, the same windows a training run with
`sparsity.criterion = wanda` uses), scored on the val split before and after, and written as a
new weights-only checkpoint FOLDER/checkpoints/step_N (N: the source's step) with the masks and a
config whose [sparsity] section says what was done. `eval`, `generate` and `checkpoint export`
read it like any checkpoint; training cannot resume it (no optimizer state): to fine-tune a
pruned model, resume the dense checkpoint itself with [sparsity] on, which prunes the same way
in one shot at the resumed step (optimize/sparsity.py, "Pruning a dense checkpoint").
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from slipstream.config.schema import SparsityConfig
from slipstream.errors import UserError

# meta.json entries the checkpoint writer sets itself (checkpoint/manager.py write_checkpoint_files).
_WRITER_META = ("format_version", "step", "time", "torch", "has_optimizer")


def prune_checkpoint(source: str | Path, out: str | Path, method: str, target: float = 0.5,
                     criterion: str = "magnitude", scope: str = "layer", calibration_tokens: int = 65_536,
                     data_dir: str | None = None, device: str = "auto", evaluate: bool = True) -> dict[str, Any]:
    """Prune checkpoint `source` in one shot into a new checkpoint under `out`; returns what was
    done and measured (also written to out/prune.json)."""
    from slipstream.checkpoint import manager as ckpt
    from slipstream.config.load import config_to_toml
    from slipstream.data.train_data import CalibrationInputs
    from slipstream.observe.env import write_json_atomic
    from slipstream.optimize import sparsity as sp
    from slipstream.train.evaluate import evaluate_lm
    from slipstream.train.lm import load_lm_from_checkpoint

    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"--out '{out}' already exists and is not an empty folder; choose a new folder "
                        "(slipstream never writes over files it did not make)")
    if method not in ("magnitude", "2:4"):
        raise UserError(f"--method {method!r}: one-shot pruning ranks single weights; use magnitude or 2:4 "
                        "(heads and channels prune during training: [sparsity] in the config)")
    # The rules of the pruning itself, in this command's flags. A training run's rules (its
    # parallel layout, its data) do not apply: this runs in one process on the whole model.
    if method == "2:4" and target != 0.5:
        raise UserError(f"--method 2:4 zeroes exactly half of the weights (two of every four); --target {target:g} "
                        "cannot apply: use --target 0.5, or --method magnitude for another fraction")
    if scope == "global" and (method != "magnitude" or criterion != "magnitude"):
        raise UserError("--scope global ranks all weights by abs(w) under one threshold (--method magnitude "
                        "--criterion magnitude); Wanda and 2:4 compare within each row or block: use --scope layer")
    src = ckpt.resolve_checkpoint(source)
    model, _, cfg = load_lm_from_checkpoint(src, device=device)
    if cfg.sparsity.method != "none":
        raise UserError(f"checkpoint '{src}' already holds masks (sparsity.method = {cfg.sparsity.method}); "
                        "prune a dense checkpoint, or train on with a higher --sparsity.target")
    if cfg.model.moe_experts > 0:
        raise UserError("pruning mixture-of-experts models is not implemented yet (the experts' weights are not "
                        "linear layers)")
    step = ckpt.read_meta(src)["step"]
    rule = SparsityConfig(method=method, target=target, scope=scope, criterion=criterion,
                          calibration_tokens=calibration_tokens)
    pruned_cfg = dataclasses.replace(cfg, sparsity=rule)
    if data_dir is None and (cfg.data.streaming or cfg.data.mixture):
        raise UserError("the checkpoint was trained on streamed or mixed data; pass --data.dir DIR, a local "
                        "`slipstream data prepare` folder made with its tokenizer, to score and calibrate on")
    data_dir = data_dir or cfg.data.dir
    before = evaluate_lm(model, cfg, data_dir)["loss"] if evaluate else None

    sp.register_masks(model, rule)
    norms = None
    if criterion == "wanda":
        if not data_dir:
            raise UserError("--criterion wanda calibrates on the train split, and the checkpoint names no data "
                            "folder; pass --data.dir DIR (a `slipstream data prepare` folder)")
        inputs = CalibrationInputs(data_dir, cfg.train.micro_batch_size, cfg.train.seq_len, calibration_tokens,
                                   next(model.parameters()).device)
        if inputs.windows.vocab_size > cfg.model.vocab_size:
            raise UserError(f"{data_dir} has vocabulary {inputs.windows.vocab_size}, more than the model's "
                            f"{cfg.model.vocab_size}: it was tokenized with another tokenizer; calibrate on data "
                            "prepared with the checkpoint's (--data.dir)")
        eot_id = inputs.windows.eot_id if cfg.data.packing == "document" else None
        norms = sp.input_norms(model, inputs, eot_id)
    sp.compute_masks(model, rule, target, norms)
    per_layer, overall = sp.measured_sparsity(model)
    after = evaluate_lm(model, cfg, data_dir)["loss"] if evaluate else None

    meta = {k: v for k, v in ckpt.read_meta(src).items() if k not in _WRITER_META}
    meta["pruned_from"] = str(src)
    files = {"tokenizer.json": src / "tokenizer.json"} if (src / "tokenizer.json").is_file() else {}
    trainer_state = ckpt.read_json_inside(src, "trainer_state.json")
    written = ckpt.save_checkpoint(out / "checkpoints", step, model, None, trainer_state,
                                   config_to_toml(pruned_cfg), meta, files)
    result = {"source": str(src), "checkpoint": str(written), "step": step, "method": method,
              "criterion": criterion, "scope": scope, "target": target,
              "calibration_tokens": calibration_tokens if criterion == "wanda" else 0,
              "measured_sparsity": overall, "layer_sparsity_min": min(per_layer.values()),
              "layer_sparsity_max": max(per_layer.values()), "val_loss_before": before, "val_loss_after": after}
    write_json_atomic(out / "prune.json", result)
    return result


def format_prune(result: dict[str, Any]) -> str:
    what = f"{result['method']} ({result['criterion']}, {result['scope']})"
    lines = [f"pruned {result['source']} -> {result['checkpoint']}: {what} to {result['target']:g}",
             f"  measured sparsity {result['measured_sparsity']:.4f} (layers {result['layer_sparsity_min']:.4f}"
             f"..{result['layer_sparsity_max']:.4f})"]
    if result["val_loss_before"] is not None:
        lines.append(f"  val loss {result['val_loss_before']:.4f} dense -> {result['val_loss_after']:.4f} pruned "
                     f"({result['val_loss_after'] - result['val_loss_before']:+.4f})")
    return "\n".join(lines)
