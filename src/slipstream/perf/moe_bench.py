"""`slipstream bench moe`: mixture of experts on CPU, measured.

Two parts, each made of real training runs of the LM job under torchrun (`run_strategy`):

- throughput and memory: a dense model and an MoE model with the same active parameters per token
  (8 experts, top-2, each expert half the dense MLP: a token passes through as many MLP weights
  as in the dense model, plus the router), at world 1, 2 and 4 with ep 1, 2 and 4 (and ep2 x
  fsdp2). Per rung: tokens/s over the timed steps, every rank's step peak memory (MemTracker,
  step 2), and the dispatch share: the time the all-to-all collectives ran on each rank over
  two profiled steps (gloo's all_to_all events in the profiler trace; NCCL's all-to-all kernels on
  CUDA), divided by those steps' wall time.
- balancing: one process training a small MoE on the default corpus for `balance_steps` steps with
  no balancing, the auxiliary loss, the auxiliary-loss-free bias, and both; the worst layer's
  expert-load imbalance (max / mean tokens per expert) at every step, and the final losses. The curves are plotted next to the JSON.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

# Llama-style, 4 blocks of width 256; the MoE's experts are 512 wide, the dense MLP 1024 (= 2 x 512).
BASE = ["--model.preset=moe-tiny", "--model.n_layer=4", "--model.d_model=256", "--model.n_head=4",
        "--model.n_kv_head=4", "--model.max_seq_len=128", "--train.seq_len=128",
        "--train.micro_batch_size=8", "--train.eval_tokens=0", "--train.device=cpu"]
MOE = ["--model.moe_experts=8", "--model.moe_top_k=2", "--model.moe_expert_hidden=512"]
DENSE = ["--model.moe_experts=0", "--model.d_ff=1024"]
CI_BASE = ["--model.preset=moe-tiny", "--train.seq_len=32", "--train.micro_batch_size=2",
           "--train.eval_tokens=0", "--train.device=cpu"]
# (name, world, model overrides, dp_strategy, ep)
RUNGS = [("dense", 1, DENSE, "none", 1), ("moe ep1", 1, MOE, "none", 1),
         ("dense ddp2", 2, DENSE, "ddp", 1), ("moe ddp2 ep1", 2, MOE, "ddp", 1), ("moe ep2", 2, MOE, "ddp", 2),
         ("dense ddp4", 4, DENSE, "ddp", 1), ("moe ep4", 4, MOE, "ddp", 4), ("moe ep2 x fsdp2", 4, MOE, "fsdp", 2)]
CI_RUNGS = [("dense", 1, ["--model.moe_experts=0"], "none", 1), ("moe ep2", 2, [], "ddp", 2)]
# Balancing methods on the default corpus: (name, overrides).
BALANCE = [("none", ["--model.moe_aux_loss=0", "--model.moe_bias_rate=0"]),
           ("aux loss 0.01", ["--model.moe_aux_loss=0.01", "--model.moe_bias_rate=0"]),
           ("bias 0.01", ["--model.moe_aux_loss=0", "--model.moe_bias_rate=0.01"]),
           ("both", ["--model.moe_aux_loss=0.01", "--model.moe_bias_rate=0.01"])]
BALANCE_MODEL = ["--model.preset=moe-tiny", "--model.moe_experts=8", "--model.moe_top_k=2", "--train.seq_len=128",
                 "--train.micro_batch_size=8", "--train.eval_tokens=65536", "--train.device=cpu",
                 "--data.sampling=sequential", "--optim.lr=3e-3"]
PROFILED = (4, 5)  # the profiled steps (profile.start_step counts from 1)


def run_moe_bench(steps: int = 8, balance_steps: int = 200, size: str = "default", out: str = "",
                  data_dir: str = "") -> dict[str, Any]:
    from slipstream.config.load import load_config
    from slipstream.data.ensure import ensure_data
    from slipstream.observe.env import collect_env
    from slipstream.perf.sharding import write_result

    if size not in ("default", "ci"):
        raise UserError(f"unknown --size '{size}'; choose default or ci")
    if size != "default" and not out:
        raise UserError(f"--size {size} needs --out: benchmarks/moe-cpu.json holds the default size's result")
    if steps < max(PROFILED) + 1:
        raise UserError(f"--steps must be >= {max(PROFILED) + 1} (steps {PROFILED[0]}-{PROFILED[1]} are profiled)")
    base, rungs = (BASE, RUNGS) if size == "default" else (CI_BASE, CI_RUNGS)
    given = [f"--data.dir={data_dir}"] if data_dir else []
    data_dir = str(ensure_data(load_config(None, [*base, *given]))[0])  # prepare once, before the runs
    corpus = str(ensure_data(load_config(None, [*BALANCE_MODEL, *given]))[0]) if size == "default" else data_dir
    load_before = os.getloadavg()  # other work on the cores shows in the step times
    with tempfile.TemporaryDirectory(prefix="slipstream-moe-") as tmp:
        rows = [_run_rung(name, world, [*base, *model, f"--data.dir={data_dir}", f"--parallel.ep={ep}"], strategy,
                          ep, str(Path(tmp) / name.replace(" ", "_")), steps)
                for name, world, model, strategy, ep in rungs]
        balance = [] if size != "default" else [
            _run_balance(name, [*BALANCE_MODEL, *extra, f"--data.dir={corpus}"], str(Path(tmp) / f"bal{i}"),
                         balance_steps) for i, (name, extra) in enumerate(BALANCE)]
    path = Path(out or "benchmarks/moe-cpu.json")
    result = {"bench": "moe", "size": size, "steps": steps, "profiled_steps": list(PROFILED),
              "overrides": base, "moe": MOE, "dense": DENSE,
              "measured": "tokens/s: mean over the steps >= 3 outside the profiled ones; memory: training step 2 on "
                          "every rank (MemTracker), the step's peak; dispatch share: all-to-all time (gloo "
                          "all_to_all events / NCCL all-to-all kernels) over the profiled steps' wall time, per rank; "
                          "balance: the worst layer's max/mean expert load at every step (max 4: top-2 of 8 experts)",
              "load_average": {"before": list(load_before), "after": list(os.getloadavg())},
              "rungs": rows, "balance": balance, "balance_model": BALANCE_MODEL, "env": collect_env()}
    if balance:
        result["balance_plot"] = _plot_balance(balance, path.with_name(path.stem.replace("-cpu", "") + "-balance-cpu.png"))
    return write_result(result, path, _print_table)


def _run_rung(name: str, world: int, overrides: list[str], strategy: str, ep: int, run_dir: str,
              steps: int) -> dict[str, Any]:
    from slipstream.perf.sharding import run_strategy

    profile = ["--profile.enabled=true", f"--profile.start_step={PROFILED[0]}",
               f"--profile.steps={len(PROFILED)}", "--profile.record_shapes=false", "--profile.profile_memory=false"]
    try:
        summary = run_strategy(strategy, world, [*overrides, *profile], run_dir, steps=steps)
    except UserError as e:
        raise UserError(f"bench moe, rung {name}: {e}") from None
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    timed = [r for r in records if "step_time_s" in r and r["step"] >= 3 and r["step"] not in PROFILED]
    ranks = summary.get("ranks") or [{"rank": 0, "step_peak_bytes": (summary.get("memory") or {}).get("peak_bytes")}]
    shares = [_dispatch_share(Path(run_dir) / "traces" / f"rank{r}.json") for r in range(world)]
    last = next((r for r in reversed(records) if "moe/imbalance_max" in r), {})
    row = {"rung": name, "world": world, "dp_strategy": strategy, "ep": ep, "timed_steps": len(timed),
           "step_time_s": sum(r["step_time_s"] for r in timed) / len(timed),
           "tokens_per_s": sum(r["tokens_per_s"] for r in timed) / len(timed),
           "step_peak_bytes": [r.get("step_peak_bytes") for r in ranks],
           "dispatch_share": shares, "imbalance_max": last.get("moe/imbalance_max"),
           "final_loss": summary.get("final_loss")}
    peak = max((b or 0) for b in row["step_peak_bytes"]) / 2**20
    print(f"{name}: {row['tokens_per_s']:.0f} tokens/s, step peak {peak:.1f} MiB (max over ranks), "
          f"dispatch {', '.join(f'{s:.1%}' for s in shares if s is not None) or 'n/a'}")
    return row


def _dispatch_share(trace: Path) -> float | None:
    """All-to-all time / wall time of the profiled steps, from one rank's chrome trace."""
    if not trace.is_file():
        return None
    events = json.loads(trace.read_text()).get("traceEvents", [])
    steps = sum(e.get("dur", 0) for e in events if str(e.get("name", "")).startswith("ProfilerStep#"))
    a2a = sum(e.get("dur", 0) for e in events
              if e.get("name") == "gloo:all_to_all" or ("nccl" in str(e.get("name", "")).lower()
                                                        and "alltoall" in str(e.get("name", "")).lower()))
    return a2a / steps if steps else None


def _run_balance(name: str, overrides: list[str], run_dir: str, steps: int) -> dict[str, Any]:
    from slipstream.perf.sharding import run_strategy

    cfg = [*overrides, f"--train.eval_interval={steps}"]  # (run_strategy logs every step)
    summary = run_strategy("none", 1, cfg, run_dir, steps=steps, memory_breakdown=False, evaluate=True)
    records = [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]
    curve = [{"step": r["step"], "imbalance_max": r["moe/imbalance_max"], "loss": r["loss"],
              "aux_loss": r["moe/aux_loss"]} for r in records if "moe/imbalance_max" in r]
    val = next((r["val_loss"] for r in reversed(records) if "val_loss" in r), None)
    row = {"method": name, "overrides": overrides[len(BALANCE_MODEL):-1], "curve": curve,
           "final_imbalance_max": curve[-1]["imbalance_max"], "final_loss": summary.get("final_loss"), "val_loss": val}
    print(f"balance {name}: worst-layer imbalance {curve[0]['imbalance_max']:.2f} -> {curve[-1]['imbalance_max']:.2f}, "
          f"loss {row['final_loss']:.4f}, val {val}")
    return row


def _plot_balance(balance: list[dict[str, Any]], path: Path) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for row in balance:
        ax.plot([c["step"] for c in row["curve"]], [c["imbalance_max"] for c in row["curve"]], label=row["method"])
    ax.set_xlabel("step")
    ax.set_ylabel("worst layer: max / mean tokens per expert")
    ax.set_title("MoE expert load over training (8 experts, top-2, default corpus)")
    ax.axhline(1.0, color="gray", lw=0.5)
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path.name


def _print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="mixture of experts on CPU: dense vs MoE at equal active parameters, ep 1/2/4")
    for col in ("rung", "world", "tokens/s", "ms/step", "peak MiB per rank", "dispatch share per rank"):
        table.add_column(col, justify="left" if col == "rung" else "right")
    for r in result["rungs"]:
        peaks = " ".join(f"{(b or 0) / 2**20:.1f}" for b in r["step_peak_bytes"])
        shares = " ".join(f"{s:.1%}" if s is not None else "n/a" for s in r["dispatch_share"])
        table.add_row(r["rung"], str(r["world"]), f"{r['tokens_per_s']:.0f}", f"{r['step_time_s'] * 1e3:.0f}",
                      peaks, shares if r["ep"] > 1 else "-")
    Console(width=max(Console().width, 130)).print(table)
    for row in result["balance"]:
        print(f"balance {row['method']}: worst-layer imbalance {row['final_imbalance_max']:.2f}, "
              f"loss {row['final_loss']:.4f}, val loss {row['val_loss']}")
