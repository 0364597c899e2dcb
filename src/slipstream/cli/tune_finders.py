"""`slipstream tune lr` and `slipstream tune batch`: the learning-rate range test, the largest
micro-batch that fits and the critical batch size (library: tune/lr_finder.py, tune/batch_finder.py).

    slipstream tune lr --config F [--steps 200] [--min-lr 1e-7] [--max-lr 1] [--nproc N]
                       [--plot lr.png] [--force] [--json] [--section.key=value ...]
    slipstream tune batch --config F [--memory-gib G] [--max-micro-batch M] [--nproc N]
                          [--noise-rounds R] [--noise-k K] [--json] [--section.key=value ...]
"""

from __future__ import annotations

import argparse
import json


def add_commands(group) -> None:
    """Register `tune lr` and `tune batch` on the `tune` subparsers."""
    p = group.add_parser("lr", help="learning-rate range test: an exponential lr sweep, the suggested lr and a plot")
    p.add_argument("--config", help="TOML training config whose learning rate to sweep")
    p.add_argument("--steps", type=int, default=200, help="training steps of the sweep (it stops early on divergence)")
    p.add_argument("--min-lr", type=float, default=1e-7, help="lr of the first step")
    p.add_argument("--max-lr", type=float, default=1.0, help="lr of the last step")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs or CPU ranks) on this machine")
    p.add_argument("--plot", default=None, metavar="PNG", help="write the loss vs lr curve to this PNG")
    p.add_argument("--force", action="store_true", help="overwrite an existing --plot file")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(func=cmd_tune_lr)

    p = group.add_parser("batch", help="the largest micro-batch that fits (planned, then real steps) and the "
                                      "critical batch size from the gradient noise scale")
    p.add_argument("--config", help="TOML training config whose batch size to tune")
    p.add_argument("--memory-gib", type=float, default=None,
                   help="memory budget in GiB (CPU: for all --nproc ranks; default: MemAvailable, or the GPU's memory)")
    p.add_argument("--max-micro-batch", type=int, default=1024, help="the largest micro-batch to consider")
    p.add_argument("--nproc", type=int, default=1, help="processes (GPUs or CPU ranks) on this machine")
    p.add_argument("--noise-rounds", type=int, default=10,
                   help="rounds of gradient-noise measurement (each --noise-k micro-batches); 0 skips it")
    p.add_argument("--noise-k", type=int, default=8, help="micro-batches per round: B_big = k x micro-batch")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the report")
    p.set_defaults(func=cmd_tune_batch)


def cmd_tune_lr(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import split_overrides
    from slipstream.outputs import refuse_existing
    from slipstream.tune.lr_finder import format_lr_report, plot_lr_sweep, tune_lr

    refuse_existing(args.plot, args.force, "--plot")  # before the sweep, not after minutes of it
    result = tune_lr(args.config, split_overrides(extra), steps=args.steps, min_lr=args.min_lr, max_lr=args.max_lr,
                     nproc=args.nproc)
    if args.plot:
        result["plot"] = str(plot_lr_sweep(result, args.plot))
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_lr_report(result))
        if args.plot:
            print(f"wrote {result['plot']}")
    return 0


def cmd_tune_batch(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import split_overrides
    from slipstream.tune.batch_finder import format_batch_report, tune_batch

    result = tune_batch(args.config, split_overrides(extra), memory_gib=args.memory_gib,
                        max_micro_batch=args.max_micro_batch, nproc=args.nproc, noise_rounds=args.noise_rounds,
                        noise_k=args.noise_k)
    if args.json:
        print(json.dumps(result, indent=2, default=str))
    else:
        print(format_batch_report(result))
    return 0 if result["micro_batch"] is not None else 1
