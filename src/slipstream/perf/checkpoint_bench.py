"""`slipstream bench checkpoint`: how long a save stalls training, synchronous vs asynchronous.

One process builds a model and its AdamW state (after one real step, so the moments exist),
then alternates synchronous and asynchronous saves through the trainer's CheckpointWriter:

    sync   stall = the whole save (DCP write, manifest, commit)
    async  stall = copying the state to host memory; the write and commit happen in the
           background while training continues (measured here as the time to commit)

Each is repeated; the JSON holds every repeat, the median and the machine/versions.
"""

from __future__ import annotations

import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from slipstream.errors import UserError

MODEL = ["--model.preset=gpt2", "--model.n_layer=4", "--model.vocab_size=8192", "--train.seq_len=64"]


def run_checkpoint_bench(repeats: int = 3, overrides: list[str] | None = None, out: str = "") -> dict[str, Any]:
    from slipstream.checkpoint.writer import CheckpointWriter
    from slipstream.config.load import load_config
    from slipstream.models.transformer import build_model, lm_loss
    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.optimize.optimizers import make_adamw
    from slipstream.train.setup import param_groups

    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    cfg = load_config(None, MODEL + list(overrides or []))
    model = build_model(cfg.model, "cpu", seed=0)
    optimizer = make_adamw(param_groups(model, 0.1), lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    x = torch.randint(0, cfg.model.vocab_size, (2, cfg.train.seq_len + 1))
    lm_loss(model(x[:, :-1].contiguous()), x[:, 1:].contiguous()).backward()
    optimizer.step()  # the Adam moments now exist: a realistic checkpoint
    state_bytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) + sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
    rows: dict[str, dict[str, list[float]]] = {"sync": {"stall_s": [], "commit_s": []},
                                               "async": {"stall_s": [], "commit_s": []}}
    with tempfile.TemporaryDirectory(prefix="slipstream-ckpt-bench-") as tmp:
        step = 0
        for _ in range(repeats):
            for mode in ("sync", "async"):
                step += 1
                writer = CheckpointWriter(Path(tmp) / mode, keep_last=1, async_save=mode == "async")
                stall = writer.save(step, model, optimizer, {"step": step}, "", {})
                writer.wait()
                rows[mode]["stall_s"].append(stall)
                rows[mode]["commit_s"].append(writer.last_write_s)
                print(f"{mode}: stall {stall * 1e3:.0f} ms, committed after {writer.last_write_s * 1e3:.0f} ms")
    summary = {mode: {key: {"median": statistics.median(v), "all": v} for key, v in values.items()}
               for mode, values in rows.items()}
    result = {"bench": "checkpoint", "overrides": MODEL + list(overrides or []), "repeats": repeats,
              "state_bytes": state_bytes, "results": summary,
              "stall_ratio_async_vs_sync": summary["async"]["stall_s"]["median"] / summary["sync"]["stall_s"]["median"],
              "env": collect_env()}
    path = Path(out or "benchmarks/checkpoint-cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    print(f"state {state_bytes / 2**20:.0f} MiB: sync stall {summary['sync']['stall_s']['median'] * 1e3:.0f} ms, "
          f"async stall {summary['async']['stall_s']['median'] * 1e3:.0f} ms "
          f"(commit after {summary['async']['commit_s']['median'] * 1e3:.0f} ms); wrote {path}")
    return result
