"""`slipstream profile`, `slipstream doctor`, `slipstream probe`: where the time goes, and this machine's rates.

    slipstream profile [--config FILE] [--section.key=value ...] [--steps N]
    slipstream doctor [--config FILE] [overrides] [--apply] [--json] | doctor --trace FILE...
    slipstream probe [--sections compute memory comm storage] [--device D] [--data-dir DIR] [--out FILE --force]
"""

from __future__ import annotations

import argparse

from slipstream.cli._common import load, no_extra, with_config


def cmd_profile(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.profiling import profile_run

    profile_run(load(args, extra), steps=args.steps)
    return 0


def cmd_doctor(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.config.load import split_overrides
    from slipstream.perf.doctor import run_doctor
    from slipstream.safe_read import parse_size

    overrides = split_overrides(extra)
    # Traces from an unknown run: no config, so the advice does not assume that run's settings.
    cfg = None if args.trace and not (args.apply or args.config or overrides) else load(args, extra)
    max_bytes = parse_size(args.max_trace_bytes, "--max-trace-bytes") if args.max_trace_bytes else None
    run_doctor(args.trace or None, cfg=cfg, overrides=overrides, apply=args.apply, as_json=args.json,
               max_trace_bytes=max_bytes)
    return 0


def add_probe_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The `slipstream probe` command-line options, for an argparse (sub)parser."""
    from slipstream.perf.probe import DEFAULT_SECTIONS, SECTIONS

    parser.add_argument("--sections", nargs="+", default=list(DEFAULT_SECTIONS), choices=list(SECTIONS))
    parser.add_argument("--device", default="auto", help="auto (the accelerator if any, else cpu), cpu, cuda[:N]")
    parser.add_argument("--data-dir", default="", help="storage: a prepared token-shard folder to read")
    parser.add_argument("--out", default="", help="JSON result file")
    parser.add_argument("--force", action="store_true", help="overwrite an existing --out file")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="matmul sizes (square n)")
    parser.add_argument("--comm-sizes", type=int, nargs="+", default=None, help="collective message sizes, bytes")
    return parser


def cmd_probe(args: argparse.Namespace, extra: list[str] | None = None) -> int:
    """`args` from add_probe_arguments (missing --sizes/--comm-sizes mean defaults)."""
    from slipstream.outputs import refuse_existing
    from slipstream.perf.probe import run_probe

    no_extra(extra or [])
    refuse_existing(args.out, getattr(args, "force", False))  # before minutes of measuring
    run_probe(
        args.sections,
        device=args.device,
        data_dir=args.data_dir or None,
        out=args.out or None,
        sizes=getattr(args, "sizes", None),
        comm_sizes=getattr(args, "comm_sizes", None),
    )
    return 0


def add_commands(sub) -> None:
    """Register `profile`, `doctor` and `probe` on the top-level subparsers."""
    p = with_config(sub.add_parser("profile", help="a short profiled training run: top ops and a chrome trace"))
    p.add_argument("--steps", type=int, default=None, help="profiled steps (default: profile.steps)")
    p.set_defaults(func=cmd_profile)

    p = with_config(sub.add_parser("doctor", help="name the bottlenecks of a run (or of traces) and the switches that fix them"))
    p.add_argument("--trace", nargs="+", default=None, help="read these chrome traces (.json or .json.gz) instead of running")
    p.add_argument("--apply", action="store_true", help="rerun with the suggested switches; print before/after")
    p.add_argument("--max-trace-bytes", default=None, metavar="SIZE",
                   help="refuse a trace larger than this once decompressed, e.g. 4GiB (default 2GiB)")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_doctor)

    p = sub.add_parser("probe", help="measure this machine: matmul TFLOP/s, memory and copy bandwidth, collectives, storage")
    add_probe_arguments(p)
    p.set_defaults(func=cmd_probe)
