"""`slipstream tune hparams`: an Optuna study of real trainings (slipstream/tune/hparams.py).

    slipstream tune hparams --config F [--trials N] [--budget 30m] [--resume] [--nproc N] [--storage URL]
                            [--write-config OUT [--force]] [--json] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import sys


def add_commands(group) -> None:
    """Register `tune hparams` in the `tune` group's subparsers."""
    p = group.add_parser("hparams", help="search hyper-parameters with an Optuna study whose trials are real trainings")
    p.add_argument("--config", help="TOML training config; its [tune] section holds the space, objective, sampler...")
    p.add_argument("--trials", type=int, default=20,
                   help="finished trials the study should have in all (shared by every worker of the study)")
    p.add_argument("--budget", default=None, help="wall time of this worker, e.g. 30m, 2h: no trial starts after it "
                   "and a running one is stopped (failed 'budget', run again on --resume)")
    p.add_argument("--resume", action="store_true", help="continue the study of this name (or join it as another "
                   "worker); without it an existing study is an error")
    p.add_argument("--nproc", type=int, default=1, help="processes per trial (through `launch local`)")
    p.add_argument("--storage", default=None, help="the study's storage: an SQLAlchemy URL or journal:PATH "
                   "(default: tune.storage, else sqlite in the study folder)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    p.add_argument("--write-config", default=None, metavar="OUT",
                   help="write the best trial as a TOML that extends --config (a multi-objective study: the trial "
                   "of its Pareto front with the best first objective)")
    p.add_argument("--force", action="store_true", help="overwrite an existing --write-config file")
    p.set_defaults(func=cmd_tune_hparams)


def cmd_tune_hparams(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import split_overrides
    from slipstream.cli.tune import print_result, refuse_config_out
    from slipstream.plan.checkpoint_interval import parse_duration
    from slipstream.tune.hparams import Terminated, tune_hparams
    from slipstream.tune.hparams_report import format_report, write_best_config

    budget = None if args.budget is None else parse_duration(args.budget, "--budget")
    refuse_config_out(args)
    try:
        result = tune_hparams(args.config, split_overrides(extra), trials=args.trials, budget_s=budget,
                              resume=args.resume, nproc=args.nproc, storage=args.storage)
    except Terminated as e:
        print(f"tune hparams: stopped by {e}; the running trial is queued again (continue with --resume)",
              file=sys.stderr)
        return 128 + e.signum  # 130 for Ctrl-C, 143 for SIGTERM, as a shell reports them
    if args.write_config and result["best"] is not None:
        result["written_config"] = str(write_best_config(result, args.write_config))
    print_result(result, format_report, args)
    return 0 if result["best"] is not None else 1
