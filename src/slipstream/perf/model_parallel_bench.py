"""The tensor- and context-parallel rungs of `slipstream bench sharding`: memory per rank at
tp 1/2/4 and cp 2/4, measured, against the planner.

Each layout is one real training run of the LM job under torchrun (same model, same batch per
tensor-/context-parallel group, one data-parallel rank), with the memory breakdown of training
step 2 (`metrics.memory_breakdown`). Tensor parallelism splits the matmul weights (and, with
sequence parallel, the activations between them) over tp ranks, so parameters, gradients, Adam
state and activations shrink towards 1/tp; context parallelism splits every sequence, so the
activations shrink towards 1/cp, and its cp ranks average gradients through FSDP, which also
shards the model state over them. What each rank still holds whole (norms, replicated K/V
gathered for attention) is why the measured ratios are above 1/N: the table shows both.

The same step's communication (`metrics.comm_volume`, rank 0) is recorded by mesh dim and kind,
bytes (each collective's full buffer) and bus bytes (what a ring moves per rank), next to the
planner's prediction (plan/timing_comm.step_collectives) and their ratio.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

# A model every degree up to 4 divides: 4 heads (and KV heads), MLP 1024, vocabulary 2048,
# sequence 256 (= 2 x cp x tp chunks for any cp, tp <= 4). Activations and model state of
# similar size, so both scalings show.
MODEL = ["--model.preset=gpt2", "--model.n_layer=4", "--model.d_model=256", "--model.n_head=4",
         "--model.vocab_size=2048", "--train.seq_len=256", "--train.micro_batch_size=4"]
LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "tp4": (4, 1), "cp2": (1, 2), "cp4": (1, 4), "cp2tp2": (2, 2)}


def _layout_overrides(tp: int, cp: int) -> list[str]:
    strategy = "fsdp" if cp > 1 else "none"  # the cp ranks average gradients through FSDP
    return [f"--parallel.tp={tp}", f"--parallel.cp={cp}", f"--parallel.dp_strategy={strategy}"]


def run_model_parallel_bench(layouts: tuple[str, ...] = tuple(LAYOUTS), data_dir: str = "", steps: int = 3,
                             out: str = "") -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env
    from slipstream.perf.sharding import run_strategy, write_result

    unknown = [name for name in layouts if name not in LAYOUTS]
    if unknown:
        raise UserError(f"unknown layout {', '.join(unknown)}; choose from {', '.join(LAYOUTS)}")
    if steps < 2:
        raise UserError("--steps must be >= 2 (step 2 is the one measured)")
    base = MODEL + ([f"--data.dir={data_dir}"] if data_dir else [])
    data_dir = str(ensure_data(load_config(None, base))[0])  # prepare once, before the runs
    base = [*MODEL, f"--data.dir={data_dir}", "--train.device=cpu", "--train.eval_tokens=0",
            "--metrics.comm_volume=true"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="slipstream-model-parallel-") as tmp:
        for name in layouts:
            tp, cp = LAYOUTS[name]
            layout = _layout_overrides(tp, cp)
            strategy = layout[-1].split("=")[1]
            summary = run_strategy(strategy, tp * cp, base + layout[:2], str(Path(tmp) / name), steps=steps)
            memory = summary.get("memory") or {}
            categories = memory.get("categories") or {}
            rows.append({"layout": name, "tp": tp, "cp": cp, "ranks": tp * cp, "dp_strategy": strategy,
                         "step_peak_bytes": memory.get("peak_bytes"),
                         "planned_peak_bytes": memory.get("planned_peak_bytes"),
                         "categories_at_peak": categories, "comm": _comm_row(summary.get("comm") or {}),
                         "final_loss": summary.get("final_loss"),
                         "tokens_per_s": summary.get("tokens_per_s")})
            comm = rows[-1]["comm"]
            print(f"{name}: step peak {(memory.get('peak_bytes') or 0) / 2**20:.1f} MiB on rank 0; communication "
                  f"{comm['measured_bytes'] / 2**20:.2f} MiB (planned {comm['planned_bytes'] / 2**20:.2f})")
    baseline = next((r for r in rows if r["tp"] == r["cp"] == 1), None)
    for r in rows:
        if baseline is not None:
            r["vs_tp1"] = {k: (r["categories_at_peak"].get(k, 0) / v if v else None)
                           for k, v in baseline["categories_at_peak"].items()}
    result = {"bench": "model-parallel", "steps": steps, "overrides": base,
              "measured": "training step 2 of rank 0 (MemTracker on CPU): bytes by category at the step's peak; "
                          "the same step's collectives (CommCounter): bytes of their buffers by mesh dim and kind",
              "layouts": rows, "env": collect_env()}
    return write_result(result, Path(out or "benchmarks/model-parallel-cpu.json"), _print_table)


def _comm_row(comm: dict[str, Any]) -> dict[str, Any]:
    """A layout's communication: measured by dim and kind (bytes, bus bytes), planned, ratio."""
    by_dim = comm.get("vs_planned") or {}
    measured = sum(r["measured_bytes"] for r in by_dim.values())
    planned = sum(r["planned_bytes"] for r in by_dim.values())
    return {"by_dim": comm.get("by_dim", {}), "by_dim_bus": comm.get("by_dim_bus", {}),
            "planned_by_dim": comm.get("planned", {}), "vs_planned": by_dim,
            "measured_bytes": measured, "measured_bus_bytes": comm.get("total_bus_bytes", 0),
            "planned_bytes": planned, "ratio": measured / planned if planned else None}


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    mib = 2**20
    table = Table(title="memory per rank by tensor / context parallel degree (training step 2, rank 0)")
    for col in ("layout", "ranks", "step peak", "planned", "params", "grads", "optimizer state", "activations"):
        table.add_column(col, justify="right" if col != "layout" else "left")
    for r in result["layouts"]:
        c = r["categories_at_peak"]

        def show(key: str) -> str:
            ratio = (r.get("vs_tp1") or {}).get(key)
            return f"{c.get(key, 0) / mib:.2f}" + (f" ({ratio:.2f}x)" if ratio is not None else "")

        table.add_row(r["layout"], str(r["ranks"]), f"{(r['step_peak_bytes'] or 0) / mib:.1f}",
                      f"{(r['planned_peak_bytes'] or 0) / mib:.1f}", show("parameters"), show("gradients"),
                      show("optimizer_state"), show("activations"))
    Console().print(table)

    comm = Table(title="communication per step by mesh dim (training step 2, rank 0), MiB: all-gather, "
                 "reduce-scatter, all-reduce, their sum, bus bytes; planned; measured / planned")
    kinds = ("all_gather", "reduce_scatter", "all_reduce")
    for col in ("layout", "dim", "AG", "RS", "AR", "bytes", "bus", "planned", "ratio"):  # all-gather, ...
        comm.add_column(col, justify="left" if col in ("layout", "dim") else "right")
    from slipstream.observe.comm import plan_dim

    for r in result["layouts"]:
        c = r.get("comm") or {}
        if not c.get("vs_planned"):
            comm.add_row(r["layout"], "-", "", "", "", "0", "0", "0", "")
            continue
        for dim, row in c["vs_planned"].items():
            dims = [d for d in c["by_dim"] if plan_dim(d, c["planned_by_dim"]) == dim]
            per_kind = [sum(c["by_dim"][d].get(k, 0) for d in dims) / mib for k in kinds]
            bus = sum(sum(c["by_dim_bus"].get(d, {}).values()) for d in dims)
            ratio = f"{row['ratio']:.4f}" if row["ratio"] is not None else "n/a"
            comm.add_row(r["layout"], dim, *(f"{v:.2f}" for v in per_kind), f"{row['measured_bytes'] / mib:.2f}",
                         f"{bus / mib:.2f}", f"{row['planned_bytes'] / mib:.2f}", ratio)
    Console().print(comm)
