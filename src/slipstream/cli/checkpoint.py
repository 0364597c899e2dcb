"""`slipstream checkpoint inspect|export|advise`: look into a checkpoint, consolidate its weights,
choose the checkpoint interval.

    slipstream checkpoint inspect DIR [--json]
    slipstream checkpoint export DIR --format torch|safetensors|hf --out FOLDER
                                     [--dtype fp32|bf16|fp16] [--force]
                                     [--quantize int8-dynact-int4-weight|int8-weight|int8|int4]
    slipstream checkpoint prune DIR --out FOLDER --method magnitude|2:4 [--criterion magnitude|wanda]
                                [--target 0.5 --scope layer|global --calibration-tokens N --data.dir D]
    slipstream checkpoint advise --save-cost 30s --mtbf 24h [--nodes N --restart 5m --step-time 1.2s]

What inspect and export do: slipstream/checkpoint/export.py; prune: slipstream/train/prune_checkpoint.py. The interval: slipstream/plan/checkpoint_interval.py.

Adding another `slipstream checkpoint ...` subcommand from a module outside this package: add
one entry to CHECKPOINT_COMMANDS below, naming a function that is called with
`add_checkpoint_subcommand` when the CLI parser is built:

    CHECKPOINT_COMMANDS["verify"] = "mypackage.verify:register"

    # mypackage/verify.py
    def register(add_subcommand):
        p = add_subcommand("verify", "suggest ... for this checkpoint")   # an ArgumentParser
        p.add_argument("dir", help="checkpoint folder or run directory")
        p.set_defaults(func=cmd_verify)                                    # cmd_verify(args, extra) -> int

`add_checkpoint_subcommand(name, help)` may also be called directly once `add_commands` has
run (it raises RuntimeError before).
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from typing import Any, Callable

from slipstream.cli._common import no_extra
from slipstream.errors import UserError

# name -> "module:function"; function(add_checkpoint_subcommand) registers that subcommand.
CHECKPOINT_COMMANDS: dict[str, str] = {}

_checkpoint_subparsers: Any = None


def add_commands(sub) -> None:
    """Register `slipstream checkpoint ...` on the top-level subparsers."""
    global _checkpoint_subparsers
    parser = sub.add_parser("checkpoint", help="inspect a checkpoint, export its weights (torch, safetensors, HF)")
    _checkpoint_subparsers = parser.add_subparsers(dest="checkpoint_cmd", required=True)

    p = add_checkpoint_subcommand("inspect", "what a checkpoint holds: step, layout, model, sizes, integrity")
    p.add_argument("dir", help="checkpoint folder, run directory or its checkpoints/ folder")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)

    p = add_checkpoint_subcommand("export", "consolidate the model weights into one torch / safetensors / HF folder")
    p.add_argument("dir", help="checkpoint folder, run directory or its checkpoints/ folder")
    p.add_argument("--format", required=True, help="torch | safetensors | hf")
    p.add_argument("--out", required=True, help="output folder (created; see --force)")
    p.add_argument("--dtype", default=None, help="cast floating-point weights: fp32 | bf16 | fp16 (default: as saved)")
    p.add_argument("--force", action="store_true", help="replace an existing output folder from an earlier export")
    p.add_argument("--quantize", default=None,
                   help="int8-dynact-int4-weight | int8-weight: convert the blocks' linears to torchao's quantized "
                        "weights (the real model of a quant.qat run); int8 | int4: weight-only quantization, as "
                        "`generate --quantize` runs it (needs --format torch and torchao)")
    p.set_defaults(func=cmd_export)

    p = add_checkpoint_subcommand("prune", "one-shot pruning of a trained dense checkpoint (magnitude or Wanda), "
                                           "scored before and after, into a new checkpoint")
    p.add_argument("dir", help="checkpoint folder, run directory or its checkpoints/ folder (dense)")
    p.add_argument("--out", required=True, help="new folder for the pruned checkpoint (must not exist, or be empty)")
    p.add_argument("--method", required=True, choices=["magnitude", "2:4"],
                   help="magnitude: any fraction of each layer (or globally); 2:4: two zeros in every four inputs")
    p.add_argument("--criterion", default="magnitude", choices=["magnitude", "wanda"],
                   help="rank weights by abs(w), or by abs(w) x their input's norm on the train split (Wanda)")
    p.add_argument("--target", type=float, default=0.5, help="fraction of the blocks' linear weights zeroed")
    p.add_argument("--scope", default="layer", choices=["layer", "global"],
                   help="magnitude: each layer reaches the target, or one threshold over all")
    p.add_argument("--calibration-tokens", type=int, default=65_536, help="wanda: train-split tokens for the norms")
    p.add_argument("--data.dir", dest="data_dir", default=None, help="prepared data folder (default: the run's own)")
    p.add_argument("--device", default="auto")
    p.add_argument("--no-eval", action="store_true", help="skip scoring the val split before and after")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_prune)

    p = add_checkpoint_subcommand("advise", "the checkpoint interval that loses the least time, from save cost and MTBF")
    add_advise_arguments(p)
    p.set_defaults(func=cmd_advise)

    for name, target in CHECKPOINT_COMMANDS.items():
        module, _, function = target.partition(":")
        register: Callable = getattr(importlib.import_module(module), function)
        register(add_checkpoint_subcommand)


def add_checkpoint_subcommand(name: str, help: str) -> argparse.ArgumentParser:  # noqa: A002 (argparse's name)
    """A new `slipstream checkpoint NAME` parser; set `func=handler(args, extra) -> int` on it."""
    if _checkpoint_subparsers is None:
        raise RuntimeError("add_commands() has not run yet; register through CHECKPOINT_COMMANDS")
    return _checkpoint_subparsers.add_parser(name, help=help, description=help)


def cmd_inspect(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.checkpoint.export import format_report, inspect_checkpoint

    no_extra(extra)
    report = inspect_checkpoint(args.dir)
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(format_report(report))
    problems = report["integrity"]["problems"]
    if problems:  # the report goes to stdout; the verdict also goes where errors go
        print(f"error: checkpoint '{report['path']}' did not pass its integrity check: {problems[0]}",
              file=sys.stderr)
        return 1
    return 0


def cmd_export(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.checkpoint.export import export_checkpoint

    no_extra(extra)
    out = export_checkpoint(args.dir, args.format, args.out, dtype=args.dtype, force=args.force,
                            quantize=args.quantize)
    files = ", ".join(sorted(p.name for p in out.iterdir()))
    print(f"wrote {out} ({args.format}, {args.dtype or 'as saved'}): {files}")
    if args.quantize:
        from slipstream.checkpoint.export import _human

        size = (out / "model.pt").stat().st_size
        print(f"quantized {args.quantize}: model.pt is {_human(size)} ({size:,} bytes)")
    return 0


def cmd_prune(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.train.prune_checkpoint import format_prune, prune_checkpoint

    no_extra(extra)
    if not 0.0 < args.target < 1.0:
        raise UserError(f"--target {args.target} is not a fraction in (0, 1); e.g. --target 0.5")
    if args.calibration_tokens < 1:
        raise UserError(f"--calibration-tokens must be >= 1 (got {args.calibration_tokens})")
    result = prune_checkpoint(args.dir, args.out, args.method, args.target, args.criterion, args.scope,
                              args.calibration_tokens, data_dir=args.data_dir, device=args.device,
                              evaluate=not args.no_eval)
    print(json.dumps(result, indent=2) if args.json else format_prune(result))
    return 0


def add_advise_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `slipstream checkpoint advise`; durations are strings parsed by parse_duration."""
    parser.add_argument("--save-cost", required=True, help="time one checkpoint save blocks training (e.g. 30s)")
    parser.add_argument("--mtbf", required=True, help="mean time between failures, e.g. 24h (of the job; of one node with --nodes)")
    parser.add_argument("--nodes", type=int, default=1, help="nodes in the job; the job fails nodes x as often")
    parser.add_argument("--restart", default="0", help="time to restart and reload after a failure (e.g. 5m)")
    parser.add_argument("--step-time", default=None, help="seconds per training step, to give the interval in steps")
    return parser


def cmd_advise(args: argparse.Namespace, extra: list[str]) -> int:
    """Print the recommended checkpoint interval and what it costs per day."""
    from slipstream.plan.checkpoint_interval import advise, format_duration, parse_duration

    no_extra(extra)
    if args.nodes < 1:
        raise UserError(f"--nodes must be >= 1 (got {args.nodes})")
    save = parse_duration(args.save_cost, "--save-cost")
    mtbf = parse_duration(args.mtbf, "--mtbf") / args.nodes
    restart = parse_duration(args.restart, "--restart")
    step = None if args.step_time is None else parse_duration(args.step_time, "--step-time")
    a = advise(save, mtbf, restart, step)
    steps = "" if a.interval_steps is None else f" = every {a.interval_steps:,} steps at {step:g}s/step"
    print(f"checkpoint advice: save cost {format_duration(save)}, job MTBF {format_duration(mtbf)}"
          f"{f' ({args.nodes} nodes)' if args.nodes > 1 else ''}, restart {format_duration(restart)}")
    print(f"  save every     {format_duration(a.interval_s)}{steps}  (Daly; Young: {format_duration(a.young_interval_s)})")
    print(f"  saving costs   {a.overhead_pct:.2f}% of the time")
    if a.lost_hours_per_day >= 24:
        print("  expected loss  the whole day: failures come faster than the job can save and redo work")
    else:
        print(f"  expected loss  {a.lost_hours_per_day:.2f} h/day ({100 * a.lost_hours_per_day / 24:.1f}%), "
              f"of which rework and restarts {a.rework_hours_per_day:.2f} h")
    if save >= mtbf:
        print("  warning: a save takes as long as the time between failures; make saves faster "
              "(asynchronous or sharded checkpoints) before tuning the interval")
    return 0
