"""`slipstream bench sharding`: memory per rank of ddp vs zero1 vs zero2 vs fsdp, measured.

Each strategy is one real training run under torchrun (same model, same global batch),
with the memory breakdown of training step 2 on every rank (`metrics.memory_breakdown`).
What the strategies differ in is the model state, so the default model is wide and the
batch small: parameters, gradients and Adam moments dominate, activations do not.

    ddp    every rank: parameters P, gradients P (DDP's buckets), Adam state 2P
    zero1  Adam state 2P / N
    zero2  gradients and Adam state / N (parameters stay whole)
    fsdp   parameters, gradients and Adam state / N (+ one gathered block at a time)

Per rank it reports the step's peak, the breakdown at the end of backward (when every
gradient exists) and the process peak RSS (CPU: everything the process ever held).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
# Wide and shallow, small batch: model state dominates (about 30M parameters).
MODEL = ["--model.preset=gpt2", "--model.n_layer=4", "--model.vocab_size=8192", "--train.seq_len=64",
         "--train.micro_batch_size=2"]
# `--size ci`: the same shape at a third of the width (3.9M parameters; the e2e tests' smoke
# run): model state still dominates, and with 4 blocks zero2's gathered parameters still raise
# its peak above fsdp's, so every strategy's per-rank saving shows. A run's time is then the
# torchrun start-up.
SIZES = {"default": MODEL,
         "ci": ["--model.preset=gpt2", "--model.n_layer=4", "--model.d_model=256", "--model.n_head=4",
                "--model.vocab_size=2048", "--train.seq_len=32", "--train.micro_batch_size=2"]}


def run_strategy(strategy: str, nproc: int, overrides: list[str], run_dir: str, steps: int = 3,
                 timeout_s: float = 600.0, memory_breakdown: bool = True, evaluate: bool = False) -> dict[str, Any]:
    """One torchrun training run; returns its summary.json (with per-rank memory unless
    memory_breakdown is off). evaluate: keep the run's evaluation (off by default: it is not step time)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           "-m", "slipstream", "train", *overrides, f"--parallel.dp_strategy={strategy}", f"--run.dir={run_dir}",
           f"--train.max_steps={steps}", *([] if evaluate else ["--train.eval_steps=0"]), "--checkpoint.save_final=false",
           "--logging.progress=false", "--logging.tensorboard=false", "--logging.log_interval=1",
           f"--metrics.memory_breakdown={str(memory_breakdown).lower()}", "--optim.warmup_steps=1"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
    except subprocess.TimeoutExpired:
        raise UserError(f"the {strategy} run did not finish within {timeout_s:g} s") from None
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).splitlines()
        # the first exception a rank raised (the root cause; the others' follow from it) heads the message
        cause = next((line for line in lines if re.match(r"\w+(Error|Exception): ", line)), "")
        tail = "\n".join(lines[-15:])
        raise UserError(f"the {strategy} run failed (exit {proc.returncode}): {cause}\n{tail}")
    return json.loads((Path(run_dir) / "summary.json").read_text(encoding="utf-8"))


def _rank_rows(summary: dict[str, Any]) -> list[dict[str, Any]]:
    ranks = summary["ranks"]  # runs here always have >= 2 ranks, which the summary lists
    return [{"rank": r["rank"], "step_peak_bytes": r["step_peak_bytes"], "process_peak_rss_bytes": r["mem_peak_bytes"],
             "end_of_backward": r.get("backward_end_categories")} for r in ranks]


def run_sharding_bench(nproc: int = 2, strategies: tuple[str, ...] = STRATEGIES, data_dir: str = "",
                       steps: int = 3, out: str = "", size: str = "default") -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env

    if nproc < 2:
        raise UserError(f"--nproc must be >= 2 to shard anything, got {nproc}")
    if steps < 2:
        raise UserError("--steps must be >= 2 (step 2 is the one measured)")
    unknown = [s for s in strategies if s not in STRATEGIES]
    if unknown:
        raise UserError(f"unknown strategy {', '.join(unknown)}; choose from {', '.join(STRATEGIES)}")
    if size not in SIZES:
        raise UserError(f"unknown --size '{size}'; choose one of {', '.join(SIZES)}")
    if size != "default" and not out:
        raise UserError(f"--size {size} needs --out: benchmarks/sharding-cpu.json holds the default size's result")
    model = SIZES[size]
    overrides = model + ([f"--data.dir={data_dir}"] if data_dir else [])
    data_dir = str(ensure_data(load_config(None, overrides))[0])  # prepare once, before the runs
    overrides = [*model, f"--data.dir={data_dir}", "--train.device=cpu"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="slipstream-sharding-") as tmp:
        for strategy in strategies:
            summary = run_strategy(strategy, nproc, overrides, str(Path(tmp) / strategy), steps=steps)
            ranks = _rank_rows(summary)
            worst = max(ranks, key=lambda r: r["step_peak_bytes"] or 0)
            rows.append({"strategy": strategy, "max_step_peak_bytes": worst["step_peak_bytes"],
                         "max_process_peak_rss_bytes": max(r["process_peak_rss_bytes"] for r in ranks),
                         "ranks": ranks, "final_loss": summary.get("final_loss"),
                         "tokens_per_s": summary.get("tokens_per_s")})
            print(f"{strategy}: step peak {worst['step_peak_bytes'] / 2**20:.1f} MiB per rank (max over ranks)")
    result = {"bench": "sharding", "nproc": nproc, "steps": steps, "overrides": overrides,
              "measured": "training step 2 on every rank (MemTracker on CPU, CUDA allocator stats on GPU)",
              "strategies": rows, "env": collect_env()}
    return write_result(result, Path(out or "benchmarks/sharding-cpu.json"), _print_table)


def write_result(result: dict[str, Any], path: Path, print_table) -> dict[str, Any]:
    """Write a memory bench's JSON (atomically), print its table, say where it went."""
    from slipstream.observe.env import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    print_table(result)
    print(f"wrote {path}")
    return result


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    table = Table(title=f"memory per rank, {result['nproc']} ranks (training step 2)")
    for col in ("strategy", "step peak", "params", "grads", "optimizer state", "activations+other",
                "process peak RSS", "vs ddp"):
        table.add_column(col)
    base = result["strategies"][0]["max_step_peak_bytes"]
    for row in result["strategies"]:
        cats = row["ranks"][0]["end_of_backward"] or {}
        rest = cats.get("activations", 0) + cats.get("other", 0)
        table.add_row(row["strategy"], f"{row['max_step_peak_bytes'] / mib:.1f} MiB",
                      f"{cats.get('parameters', 0) / mib:.1f}", f"{cats.get('gradients', 0) / mib:.1f}",
                      f"{cats.get('optimizer_state', 0) / mib:.1f}", f"{rest / mib:.1f}",
                      f"{row['max_process_peak_rss_bytes'] / mib:.0f} MiB",
                      f"{row['max_step_peak_bytes'] / base:.2f}x" if base else "n/a")
    Console().print(table)
