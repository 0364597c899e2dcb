"""`slipstream bench speedrun`: the speed-run track. Does each switch that modern speed runs
use reach the suite's time-to-target sooner on this corpus and machine?

Every switch is the suite's `time_to_target` recipe (a cold-start `slipstream train` of the
default job until its val loss reaches the target, checkpointing on) with the switch's overrides
appended. Runs are interleaved (round r runs every switch once, in a rotated order), so a drift of
the machine's speed hits all switches alike. The result per switch: wall time to target (median
and its confidence interval), steps and tokens to target, and the ratio to the baseline recipe
with a bootstrap interval; a switch that never reaches the target within the recipe's step cap
is reported as such (its time does not count).

Time is what counts, not step time: a switch that costs 10 % more per step but reaches the target
in 30 % fewer steps wins; one that only speeds up steps but needs more of them may lose.
"""

from __future__ import annotations

import datetime
import sys
import tempfile
from pathlib import Path
from typing import Any

from slipstream.errors import UserError

# name -> (overrides appended to the time-to-target recipe, what it is). The order is the table's.
SWITCHES: dict[str, tuple[list[str], str]] = {
    "baseline": ([], "the default recipe: AdamW, GELU MLP, tied embeddings, cosine schedule"),
    "muon": (["--optim.optimizer=muon"], "Muon (Newton-Schulz orthogonalized momentum) for the hidden matrices, "
                                         "AdamW for the rest"),
    "qk_norm": (["--model.qk_norm=true"], "RMSNorm of each head's queries and keys"),
    "relu2": (["--model.mlp=relu2"], "ReLU² MLP instead of GELU"),
    "softcap": (["--model.logit_softcap=30"], "logit soft-capping at 30 (cap * tanh(logits / cap))"),
    "untied": (["--model.tie_embeddings=false"], "an output head of its own instead of the embedding"),
    "zero_init": (["--model.zero_init_proj=true"], "residual output projections initialized to zero"),
    "wsd": (["--optim.schedule=wsd", "--optim.decay_fraction=0.5", "--optim.warmup_steps=20"],
            "warmup-stable-decay for short runs: 20 warmup steps, the second half of the step cap a linear decay"),
}
DEFAULT_REPEATS = {"full": 3, "quick": 2, "ci": 1}


def run_speedrun(mode: str = "full", switches: list[str] | None = None, repeats: int = 0, out: str = "",
                 data_dir: str = "") -> dict[str, Any]:
    from slipstream.observe.env import collect_env, write_json_atomic
    from slipstream.perf import suite_workloads
    from slipstream.perf.suite import chosen
    from slipstream.perf.suite_stats import ratio_ci, summarize

    names = chosen(switches, SWITCHES, "speed-run switch", "--switches")
    if mode not in DEFAULT_REPEATS:
        raise UserError(f"unknown mode '{mode}'; use full, quick or ci")
    if mode == "ci" and not out:
        raise UserError("--size ci needs --out: benchmarks/suite/ holds the quick and full results")
    repeats = repeats or DEFAULT_REPEATS[mode]
    if repeats < 1:
        raise UserError(f"--repeats must be >= 1, got {repeats}")
    path = Path(out) if out else Path("benchmarks") / "suite" / f"speedrun-{_device()}-{mode}.json"
    if not out and path.exists():
        _refuse_foreign(path)  # before the runs: an explicit --out that exists needs --force (the CLI)
    data_dir = suite_workloads.prepare_data(data_dir)  # checked (or prepared) once, outside every timed run
    started = datetime.datetime.now(datetime.timezone.utc)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="slipstream-speedrun-") as tmp:
        for r in range(repeats):
            order = names[r % len(names):] + names[:r % len(names)]  # rotated: no switch always runs first
            for name in order:
                workdir = Path(tmp) / f"{name}-{r}"
                workdir.mkdir()
                print(f"[speedrun] round {r + 1}/{repeats}: {name}", file=sys.stderr, flush=True)
                try:
                    run = suite_workloads.time_to_target_once(SWITCHES[name][0], mode, data_dir, workdir)
                except Exception as e:  # one switch's failure is a row, not the end of the track
                    lines = [line for line in str(e).splitlines() if line.strip()] or [""]
                    run = {"error": f"{type(e).__name__}: {lines[0]}", "target_reached": False}
                runs[name].append(run)
    rows = [_row(name, runs[name], runs.get("baseline"), summarize, ratio_ci) for name in names]
    # the recipe every switch appends its overrides to (not the first switch's run, which has its overrides)
    result = {"bench": "speedrun", "mode": mode, "repeats": repeats, "env": collect_env(),
              "started": started.isoformat(timespec="seconds"),
              "recipe": " ".join(suite_workloads.time_to_target_recipe(mode)), "switches": rows}
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, result)
    print(speedrun_table(result))
    print(f"wrote {path}")
    return result


def _refuse_foreign(path: Path) -> None:
    """The default output is replaced only when it is an earlier `bench speedrun` result."""
    from slipstream.perf.suite_compare import SUITE_JSON
    from slipstream.safe_read import load_json_capped

    try:
        record = load_json_capped(path, SUITE_JSON)
    except (OSError, ValueError, UserError):  # unreadable, not JSON (a ValueError), or too big
        record = None
    if not (isinstance(record, dict) and record.get("bench") == "speedrun"):
        raise UserError(f"{path} exists and is not a `bench speedrun` result; move it away, or pass --out to write "
                        "elsewhere")


def _device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _row(name: str, runs: list[dict[str, Any]], baseline: list[dict[str, Any]] | None, summarize, ratio_ci
         ) -> dict[str, Any]:
    reached = [run for run in runs if run.get("target_reached")]
    row: dict[str, Any] = {"name": name, "overrides": SWITCHES[name][0], "what": SWITCHES[name][1],
                           "runs": runs, "reached": len(reached), "repeats": len(runs)}
    if len(reached) < len(runs):
        # A time only counts when the target was reached: a run that missed it (or failed) makes the
        # switch's time undefined, whatever the others did.
        errors = [run["error"] for run in runs if run.get("error")]
        row["status"] = "failed" if errors else "target_missed"
        row["error"] = errors[0] if errors else "the val loss did not reach the target within the step cap"
        return row
    wall = [run["wall_s"] for run in runs]
    row.update(status="ok", wall_s=summarize(wall), steps=summarize([run["steps"] for run in runs]),
               tokens=summarize([run["tokens"] for run in runs]),
               val_loss=summarize([run["val_loss"] for run in runs]))  # at the stop: lower = further past the target
    base_wall = [run["wall_s"] for run in baseline or [] if run.get("target_reached")]
    if name != "baseline" and baseline and len(base_wall) == len(baseline):
        ratio, lo, hi = ratio_ci(base_wall, wall)
        row["time_ratio"] = {"ratio": ratio, "ci": [lo, hi]}
    return row


def speedrun_table(result: dict[str, Any]) -> str:
    """The result as a markdown table (also printed by the command)."""
    lines = ["| switch | overrides | time to target, s (median [CI]) | vs baseline | steps | tokens | val loss at the stop |",
             "|---|---|---|---|---|---|---|"]
    for row in result["switches"]:
        overrides = " ".join(f"`{o}`" for o in row["overrides"]) or "-"
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | {overrides} | {row['status']}: {row.get('error', '')} | - | - | - | - |")
            continue
        wall = row["wall_s"]
        ratio = row.get("time_ratio")
        vs = f"{ratio['ratio']:.2f}x [{ratio['ci'][0]:.2f}, {ratio['ci'][1]:.2f}]" if ratio else "-"
        val = f"{row['val_loss']['median']:.4f}" if "val_loss" in row else "-"  # older results have none
        lines.append(f"| {row['name']} | {overrides} | {wall['median']:.1f} [{wall['ci'][0]:.1f}, {wall['ci'][1]:.1f}] "
                     f"| {vs} | {row['steps']['median']:.0f} | {row['tokens']['median']:.0f} | {val} |")
    return "\n".join(lines)
