"""`slipstream tune ...`: tuners that run real trainings on this machine.

    slipstream tune system --config F [--budget 10m] [--top K] [--nproc N] [--steps S]
                           [--layouts L ...] [--json] [--write-config OUT] [--section.key=value ...]
    slipstream tune hparams --config F [--trials N] [--budget 30m] [--resume] ...   (cli/tune_hparams.py)
    slipstream tune lr --config F ...                                               (cli/tune_finders.py)
    slipstream tune batch --config F ...                                            (cli/tune_finders.py)
"""

from __future__ import annotations

import argparse
import json

from slipstream.outputs import refuse_existing, refuse_same_file


def add_commands(sub) -> None:
    """Register the `tune` group: system here, hparams and the finders from their own modules."""
    from slipstream.cli import tune_finders, tune_hparams

    tune = sub.add_parser("tune", help="tune layouts and hyper-parameters with real trials on this machine")
    group = tune.add_subparsers(dest="tune_cmd", required=True)
    p = group.add_parser("system", help="short real trials of the planner's top-K layouts; keep the fastest that fits")
    add_tune_arguments(p)
    p.set_defaults(func=cmd_tune_system)
    tune_hparams.add_commands(group)
    tune_finders.add_commands(group)


def add_tune_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Arguments of `slipstream tune system`; config overrides come as extra `--section.key=value`."""
    parser.add_argument("--config", help="TOML training config whose layout to tune")
    parser.add_argument("--budget", default="10m", help="wall time for all trials, e.g. 90s, 10m, 1h (split evenly)")
    parser.add_argument("--top", type=int, default=3, help="the planner's K best layouts to try (plus the current one "
                        "and --layouts; 0 with --layouts: only those)")
    parser.add_argument("--nproc", type=int, default=1, help="processes (GPUs or CPU ranks) on this machine")
    parser.add_argument("--layouts", nargs="+", default=[], metavar="LAYOUT",
                        help="also try these layouts, whatever their rank: a label as `plan` prints it (quoted: "
                             "'none tp2+sp mb8x1') or some of its words ('tp2', 'cp2 ac:full': the best-ranked "
                             "layout with all of them); commas separate layouts too")
    parser.add_argument("--steps", type=int, default=20, help="training steps per trial (the first two are not timed)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--write-config", default=None, metavar="OUT", help="write the winner as a TOML config")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --write-config file")
    return parser


def cmd_tune_system(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import split_overrides
    from slipstream.tune.system import format_report, tune_system, write_winner_config
    from slipstream.plan.checkpoint_interval import parse_duration

    budget = parse_duration(args.budget, "--budget")
    refuse_config_out(args)
    layouts = [p for value in args.layouts for p in value.split(",") if p.strip()]
    result = tune_system(args.config, split_overrides(extra), budget, top=args.top, nproc=args.nproc, steps=args.steps,
                         layouts=layouts)
    if args.write_config and result["winner"] is not None:
        result["written_config"] = str(write_winner_config(result, args.write_config))
    print_result(result, format_report, args)
    return 0 if result["winner"] is not None else 1


def refuse_config_out(args: argparse.Namespace) -> None:
    """Before the trials (minutes to hours): the --write-config file must not replace one the user
    has, least of all the config it extends."""
    refuse_existing(args.write_config, args.force, "--write-config")
    if args.write_config:
        refuse_same_file(args.write_config, [args.config], "--write-config", "the --config it would extend")


def print_result(result: dict, format_report, args: argparse.Namespace) -> None:
    """One JSON object (--json), or the tuner's table and how to train the written config."""
    if args.json:
        print(json.dumps(result, indent=2, default=str))
        return
    print(format_report(result))
    if "written_config" in result:
        path = result["written_config"]
        launch = f"slipstream launch local --nproc {args.nproc} -- " if args.nproc > 1 else "slipstream "
        print(f"wrote {path}; train it with `{launch}train --config {path}`")
