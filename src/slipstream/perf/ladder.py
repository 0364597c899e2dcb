"""`slipstream bench ladder`: the books' end-to-end optimization ladders, measured.

Each rung adds one switch to the rung before. All rungs run in one process, interleaved
repeat by repeat (rung 1, 2, ..., n, then again), so slow drift of the machine hits every
rung alike; each rung reports the median and spread over its repeats.

    memory ladder (book: gpt2-large, batch 32): baseline -> gradient accumulation ->
        activation checkpointing -> optimizer step in backward -> optimizer offload to CPU
        -> sharding (FSDP over 2 ranks under torchrun, same global batch; memory per rank).
        Reports the measured peak memory of a training step (and step time: the cost).
    speed ladder (book: gpt-mini, batch 32, CPU-bound text augmentation, no workers):
        baseline -> larger batch -> data workers -> pinned memory + non-blocking copies ->
        compile -> mixed precision -> fused linear+cross-entropy. Reports tokens/s.

On CPU, `--size` scales the models down so the ladders finish in minutes (`ci`: in
seconds, for the tests); the rungs and their order stay the same.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from slipstream.config.load import load_config
from slipstream.errors import UserError


@dataclass(frozen=True)
class Rung:
    name: str
    overrides: tuple[str, ...]  # cumulative: everything from the rungs before plus this one
    note: str = ""
    sharded_ranks: int = 0  # > 0: an FSDP run over this many processes (torchrun), memory per rank


def _cumulative(steps: list[tuple]) -> list[Rung]:
    rungs, acc = [], []
    for name, overrides, note, *ranks in steps:
        acc = acc + overrides
        rungs.append(Rung(name, tuple(acc), note, *ranks))
    return rungs


# Model shape per (ladder, size). "book" is the books' own setting (for GPUs). "ci" is the
# smallest shape at which every memory rung still shows its effect (activations outweigh the
# model state, so accumulation and checkpointing lower the peak); the e2e tests run it with
# --repeats 1 --steps 2. The speed ladder's time there is the compile rungs' cold compile.
SIZES = {
    "memory": {"book": ["--model.preset=gpt2-large", "--train.seq_len=1024"],
               "small": ["--model.preset=gpt2", "--model.n_layer=4", "--train.seq_len=256"],
               "tiny": ["--model.preset=gpt-mini", "--train.seq_len=128"],
               "ci": ["--model.preset=gpt-mini", "--model.n_layer=2", "--train.seq_len=128"]},
    "speed": {"book": ["--model.preset=gpt-mini", "--train.seq_len=512"],
              "small": ["--model.preset=gpt-mini", "--train.seq_len=256"],
              "tiny": ["--model.preset=gpt-mini", "--model.n_layer=2", "--train.seq_len=128"],
              "ci": ["--model.preset=gpt-mini", "--model.n_layer=1", "--train.seq_len=64"]},
}


def memory_ladder(batch: int, device: str) -> list[Rung]:
    accum = 4 if batch % 4 == 0 else 1
    return _cumulative([
        ("baseline", [f"--train.micro_batch_size={batch}", "--train.grad_accum_steps=1"],
         f"batch {batch}, fp32, fused AdamW"),
        ("grad accumulation", [f"--train.micro_batch_size={batch // accum}", f"--train.grad_accum_steps={accum}"],
         f"{accum} micro-batches of {batch // accum}: same global batch"),
        ("activation checkpointing", ["--activations.checkpointing=full"], "recompute every block"),
        ("optimizer in backward", ["--optim.in_backward=true", "--optim.grad_clip=0", "--optim.implementation=for-loop"],
         "per-parameter steps in the last micro-batch's backward: gradients are freed as they are used "
         "(with accumulation the earlier micro-batches' gradients still coexist, so the saving shows in the "
         "optimizer phase, not at the step's peak)"),
        ("optimizer offload", ["--optim.in_backward=false", "--optim.offload=true"],
         "fp32 master weights + Adam state in CPU memory" + ("" if device == "cuda" else
                                                             " (on CPU the training device IS host memory: no saving)")),
        ("sharding (fsdp x2)", [f"--train.micro_batch_size={max(1, batch // accum // 2)}", "--optim.offload=false",
                                "--optim.implementation=auto"],
         "FSDP over 2 ranks instead of offload: parameters, gradients and Adam state sharded; each rank takes "
         "half of every micro-batch (same global batch); peak of the worst rank", 2),
    ])


def speed_ladder(batch: int, device: str, augment_ms: float) -> list[Rung]:
    small = max(1, batch // 4)
    workers = 2
    return _cumulative([
        ("baseline", [f"--train.micro_batch_size={small}", "--data.augment=swap_tokens",
                      f"--data.augment_cost_ms={augment_ms}", "--data.num_workers=0",
                      "--data.pin_memory=false", "--data.prefetch=0"],
         f"batch {small}, CPU-bound augmentation ({augment_ms} ms per sequence) in the training process"),
        ("larger batch", [f"--train.micro_batch_size={batch}"], f"batch {batch}"),
        ("data workers", [f"--data.num_workers={workers}", "--data.prefetch=2"], f"{workers} loader processes"),
        ("pinned + non-blocking", ["--data.pin_memory=true"],
         "CUDA: pinned host batches, async copies" + ("" if device == "cuda" else " (no effect on CPU)")),
        ("compile", ["--compile.scope=blocks"], "regional torch.compile"),
        ("mixed precision", ["--precision.autocast=bf16"] + (["--precision.tf32=true"] if device == "cuda" else []),
         "bf16 autocast"),
        ("fused op", ["--train.fused_loss=true"], "chunked fused linear + cross-entropy"),
    ])


def _run_sharded_rung(base: list[str], rung: Rung, steps: int, run_dir: str) -> dict[str, Any]:
    import json

    from slipstream.perf.sharding import run_strategy

    summary = run_strategy("fsdp", rung.sharded_ranks, base + list(rung.overrides), run_dir, steps=steps)
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    steady = [r for r in records if "loss" in r and r["step"] >= min(3, steps)]
    worst = max(summary["ranks"], key=lambda r: r["step_peak_bytes"] or 0)
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "peak_bytes": worst["step_peak_bytes"], "optimizer_phase_peak_bytes": None,
            "memory": {"ranks": summary["ranks"]}, "loss": summary["final_loss"]}


def _run_rung(base: list[str], rung: Rung, steps: int, run_dir: str) -> dict[str, Any]:
    import json

    from slipstream.train.lm import build_lm_trainer

    if rung.sharded_ranks:
        return _run_sharded_rung(base, rung, steps, run_dir)

    overrides = base + list(rung.overrides) + [
        f"--run.dir={run_dir}", f"--train.max_steps={steps}", "--train.eval_steps=0",
        "--checkpoint.save_final=false", "--logging.progress=false", "--logging.tensorboard=false",
        "--logging.log_interval=1", "--metrics.memory_breakdown=true", "--optim.warmup_steps=1"]
    cfg = load_config(None, overrides)
    trainer = build_lm_trainer(cfg)
    with contextlib.redirect_stdout(io.StringIO()):
        summary = trainer.fit()
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    # Step 1 pays one-time costs (optimizer state allocation, compilation, worker start-up),
    # and step 2 is the one measured for memory: the steady state is steps 3.. (or 2.. when short).
    steady = [r for r in records if "loss" in r and r["step"] >= min(3, steps)]
    return {"step_time_s": statistics.median(r["step_time_s"] for r in steady),
            "tokens_per_s": statistics.median(r["tokens_per_s"] for r in steady),
            "peak_bytes": (summary.get("memory") or {}).get("peak_bytes"),
            "optimizer_phase_peak_bytes": ((summary.get("memory") or {}).get("phases") or {}).get(
                "optimizer", {}).get("peak_bytes"),
            "memory": summary.get("memory"), "loss": summary["final_loss"]}


def ladder_outputs(which: str, device: str, size: str, out_dir: str) -> tuple[Path, Path]:
    """The JSON result and PNG plot a ladder writes into out_dir."""
    stem = Path(out_dir) / f"ladder-{which}-{device}-{size}"
    return stem.with_name(stem.name + ".json"), stem.with_name(stem.name + ".png")


def run_ladder(which: str, device: str = "cpu", size: str = "tiny", repeats: int = 3, steps: int = 6,
               batch: int = 32, out_dir: str = "benchmarks", data_dir: str = "",
               augment_ms: float = 5.0) -> dict[str, Any]:
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env, write_json_atomic

    if which not in SIZES:
        raise UserError(f"unknown ladder '{which}'; choose memory or speed")
    if size not in SIZES[which]:
        raise UserError(f"unknown --size '{size}'; choose one of {', '.join(SIZES[which])}")
    if repeats < 1 or steps < 2 or batch < 1:
        raise UserError("--repeats >= 1, --steps >= 2 and --batch >= 1 are required")
    rungs = memory_ladder(batch, device) if which == "memory" else speed_ladder(batch, device, augment_ms)
    if device == "cuda" and _cuda_count() < 2:
        rungs = [r for r in rungs if not r.sharded_ranks]  # sharding needs 2 GPUs
    base = [f"--train.device={device}", *SIZES[which][size]] + ([f"--data.dir={data_dir}"] if data_dir else [])
    ensure_data(load_config(None, base))  # prepare once, outside every timed region
    results: dict[str, list[dict[str, Any]]] = {r.name: [] for r in rungs}
    with tempfile.TemporaryDirectory(prefix="slipstream-ladder-") as tmp:
        for rep in range(repeats):
            for i, rung in enumerate(rungs):
                results[rung.name].append(_run_rung(base, rung, steps, str(Path(tmp) / f"{rep}-{i}")))
                r = results[rung.name][-1]
                peak = f", peak {r['peak_bytes'] / 2**20:.1f} MiB" if r["peak_bytes"] else ""
                print(f"[{which} {rep + 1}/{repeats}] {rung.name}: {r['step_time_s'] * 1e3:.1f} ms/step, "
                      f"{r['tokens_per_s']:.0f} tok/s{peak}")
    rows = []
    for rung in rungs:
        runs = results[rung.name]
        row = {"rung": rung.name, "note": rung.note, "overrides": list(rung.overrides),
               "memory_breakdown": runs[-1]["memory"], "final_loss": [r["loss"] for r in runs]}
        for key in ("step_time_s", "tokens_per_s", "peak_bytes", "optimizer_phase_peak_bytes"):
            values = [r[key] for r in runs if r[key] is not None]
            if values:
                row[key] = {"median": statistics.median(values), "min": min(values), "max": max(values),
                            "all": values}
        rows.append(row)
    result = {"bench": f"ladder-{which}", "device": device, "size": size, "base": base, "batch": batch,
              "augment_cost_ms": augment_ms if which == "speed" else None,
              "repeats": repeats, "steps": steps, "rungs": rows, "env": collect_env()}
    json_path, png_path = ladder_outputs(which, device, size, out_dir)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(json_path, result)
    _print_table(result)
    _plot(result, str(png_path))
    print(f"wrote {json_path} and {png_path}")
    return result


def _cuda_count() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"{result['bench']} ({result['device']}, size {result['size']}, "
                        f"median of {result['repeats']})")
    for col in ("rung", "ms/step", "tokens/s", "peak memory", "optimizer-phase peak", "vs baseline"):
        table.add_column(col)
    base_key = "peak_bytes" if result["bench"] == "ladder-memory" else "tokens_per_s"
    base_value = result["rungs"][0].get(base_key, {}).get("median")
    for row in result["rungs"]:
        step = row["step_time_s"]["median"] * 1e3
        tps = row["tokens_per_s"]["median"]
        peak = row.get("peak_bytes", {}).get("median")
        opt_peak = row.get("optimizer_phase_peak_bytes", {}).get("median")
        value = row.get(base_key, {}).get("median")
        ratio = f"{value / base_value:.2f}x" if value and base_value else "n/a"
        table.add_row(row["rung"], f"{step:.1f}", f"{tps:,.0f}", f"{peak / 2**20:.1f} MiB" if peak else "n/a",
                      f"{opt_peak / 2**20:.1f} MiB" if opt_peak else "n/a", ratio)
    Console().print(table)


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    names = [r["rung"] for r in result["rungs"]]
    memory = result["bench"] == "ladder-memory"
    key = "peak_bytes" if memory else "tokens_per_s"
    scale = 2**20 if memory else 1
    medians = [r.get(key, {}).get("median", 0) / scale for r in result["rungs"]]
    lows = [m - r.get(key, {}).get("min", 0) / scale for m, r in zip(medians, result["rungs"])]
    highs = [r.get(key, {}).get("max", 0) / scale - m for m, r in zip(medians, result["rungs"])]
    fig, ax = plt.subplots(figsize=(8, 4))
    ax.bar(range(len(names)), medians, yerr=[lows, highs], capsize=4, color="#4C72B0")
    ax.set_xticks(range(len(names)), names, rotation=25, ha="right")
    ax.set_ylabel("peak memory (MiB)" if memory else "tokens/s")
    ax.set_title(f"{result['bench']} on {result['device']} (size {result['size']}; median, min-max)")
    fig.tight_layout()
    # A temp file, then a rename: an existing plot is replaced whole or not at all.
    tmp = Path(path).with_name(f".{Path(path).name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    tmp.replace(path)
