"""`slipstream bench overhead`: what does our Trainer cost over a minimal hand-written loop?

Both contenders train the same model (same init), on the same data loader, with the same
fused AdamW, schedule, clipping and precision. They alternate round by round (trainer,
hand loop, trainer, ...) after one untimed warm-up round each, so machine noise hits both
alike; each round starts from a fresh
model and optimizer and times all its steps, wall clock, including the trainer's logging,
progress bar and metric bookkeeping (eval and checkpointing are off for both). The
result is the ratio of median step times; the target on CPU is <= 1.02.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from slipstream.config.schema import Config
from slipstream.perf.timer import Timer


def _bench_config(cfg: Config, run_dir: str, steps: int) -> Config:
    return dataclasses.replace(
        cfg,
        run=dataclasses.replace(cfg.run, dir=run_dir),
        train=dataclasses.replace(cfg.train, max_steps=steps, eval_steps=0, eval_interval=0),
        checkpoint=dataclasses.replace(cfg.checkpoint, save_final=False, interval=0, resume="none"),
        logging=dataclasses.replace(cfg.logging, progress=False),
        # The one-step memory measurement is a diagnostic the hand loop doesn't do.
        metrics=dataclasses.replace(cfg.metrics, memory_breakdown=False),
    )


def hand_loop(cfg: Config, steps: int) -> float:
    """The minimal loop a careful engineer writes by hand. Returns seconds for `steps` steps."""
    from slipstream.train.lm import build_lm_trainer
    from slipstream.train.schedule import lr_multiplier

    # Reuse the trainer's builder only for identical model/data/optimizer construction;
    # the loop below is all hand-written.
    pieces = build_lm_trainer(cfg)
    model, optimizer, loader, device = pieces.model, pieces.optimizer, pieces.train_loader, pieces.device
    autocast = cfg.precision.autocast == "bf16"
    accum = cfg.train.grad_accum_steps
    params = [p for g in optimizer.param_groups for p in g["params"]]
    it = iter(loader)
    model.train()
    with Timer(device) as timer:  # synchronizes the device at both ends
        for step in range(steps):
            for g in optimizer.param_groups:
                g["lr"] = cfg.optim.lr * lr_multiplier(step, cfg.optim, cfg.train.max_steps)
            for _ in range(accum):
                x, y = next(it)
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast):
                    logits = model(x)
                    loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.shape[-1]), y.view(-1))
                (loss / accum).backward()
            if cfg.optim.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(params, cfg.optim.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        loss.item()  # one final sync, as the trainer's last log does
    return timer.elapsed_s


def trainer_loop(cfg: Config) -> float:
    from slipstream.train.lm import build_lm_trainer

    trainer = build_lm_trainer(cfg)
    with contextlib.redirect_stdout(io.StringIO()):  # keep the bench output to one line per round
        summary = trainer.fit()
    return summary["loop_time_s"]


def run_overhead_bench(cfg: Config, rounds: int = 5, steps_per_round: int = 20, out: str = "") -> dict[str, Any]:
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env, write_json_atomic

    ensure_data(cfg)  # prepare outside the timed region
    trainer_times, hand_times = [], []
    with tempfile.TemporaryDirectory(prefix="slipstream-bench-") as tmp:
        # One untimed round each first: page cache (memory-mapped shards), allocator and
        # thread-pool warm-up would otherwise land on whichever contender runs first.
        warm_cfg = _bench_config(cfg, str(Path(tmp) / "warmup"), min(steps_per_round, 5))
        trainer_loop(warm_cfg)
        hand_loop(warm_cfg, min(steps_per_round, 5))
        for r in range(rounds):
            bench_cfg = _bench_config(cfg, str(Path(tmp) / f"round{r}"), steps_per_round)
            trainer_times.append(trainer_loop(bench_cfg) / steps_per_round)
            hand_times.append(hand_loop(bench_cfg, steps_per_round) / steps_per_round)
            print(f"round {r + 1}/{rounds}: trainer {trainer_times[-1] * 1e3:.2f} ms/step, "
                  f"hand loop {hand_times[-1] * 1e3:.2f} ms/step")
    trainer_median, hand_median = statistics.median(trainer_times), statistics.median(hand_times)
    ratio = trainer_median / hand_median
    env = collect_env()
    result = {
        "bench": "overhead",
        "target_ratio": 1.02,
        "ratio": ratio,
        "pass": ratio <= 1.02,
        "trainer_step_s": {"median": trainer_median, "all": trainer_times},
        "hand_loop_step_s": {"median": hand_median, "all": hand_times},
        "rounds": rounds, "steps_per_round": steps_per_round,
        "model": cfg.model.preset, "micro_batch_size": cfg.train.micro_batch_size, "seq_len": cfg.train.seq_len,
        "precision": cfg.precision.autocast, "device": cfg.train.device,
        "env": env,
    }
    verdict = "PASS" if result["pass"] else "FAIL"
    print(f"trainer / hand loop step time = {ratio:.4f} (median {trainer_median * 1e3:.2f} vs "
          f"{hand_median * 1e3:.2f} ms/step; target <= 1.02): {verdict}")
    if not out:
        machine = "cpu" if env.get("accelerator") in (None, "cpu") else str(env.get("accelerator")).replace(" ", "-")
        out = f"benchmarks/overhead-{machine}.json"
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out, result)
    print(f"wrote {out}")
    return result
