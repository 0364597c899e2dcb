"""`slipstream bench suite|compare|noise`: the fixed benchmark suite and its comparisons.

    slipstream bench suite [--quick | --size ci] [--only W ...] [--repeats N] [--out FILE] [--force]
    slipstream bench compare BASE.json NEW.json [--noise-band F] [--json]     (exit 1 on a regression)
    slipstream bench noise RUN.json RUN.json ... [--out FILE] [--force]        (the noise band, measured)
    slipstream bench speedrun [--quick | --size ci] [--switches S ...] [--repeats N] [--out FILE] [--force]
"""

from __future__ import annotations

import argparse

from slipstream.cli._common import add_force, no_extra
from slipstream.outputs import refuse_existing


def cmd_bench_suite(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.suite import run_suite

    no_extra(extra)
    refuse_existing(args.out, args.force)  # an explicit --out; the default is a new file per run
    result = run_suite(mode=args.mode, only=args.only, repeats=args.repeats, out=args.out, data_dir=args.data_dir)
    # skipped (e.g. the world-2 runs on a machine with one GPU) is not a failure; failed or a quality gate missed is
    return 0 if all(w["status"] in ("ok", "skipped") for w in result["workloads"]) else 1


def cmd_bench_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.suite_compare import run_compare

    no_extra(extra)
    verdict = run_compare(args.base, args.new, noise_band=args.noise_band, as_json=args.json)
    return 1 if verdict["regressions"] else 0


def cmd_bench_noise(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.suite_compare import run_noise

    no_extra(extra)
    refuse_existing(args.out, args.force)
    run_noise(args.runs, out=args.out)
    return 0


def cmd_bench_speedrun(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.perf.speedrun import run_speedrun

    no_extra(extra)
    refuse_existing(args.out, args.force)
    result = run_speedrun(mode=args.mode, switches=args.switches, repeats=args.repeats, out=args.out,
                          data_dir=args.data_dir)
    # a switch that missed the target is a measured answer; one whose run crashed is a failure
    return 1 if any(row["status"] == "failed" for row in result["switches"]) else 0


def _add_run_options(p: argparse.ArgumentParser, what: str, default_out: str) -> None:
    """--quick / --size ci, --repeats, --data-dir, --out and --force of a command that trains."""
    _add_mode(p)
    p.add_argument("--repeats", type=int, default=0, help=f"repeats per {what} (default: the mode's)")
    p.add_argument("--data-dir", default="", help="prepared data folder (default: the stdlib corpus, prepared once)")
    p.add_argument("--out", default="", help=f"JSON file (default {default_out})")
    add_force(p)


def _add_mode(p: argparse.ArgumentParser) -> None:
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--quick", dest="mode", action="store_const", const="quick",
                      help="a few minutes on 2 cores: smaller models and targets, fewer repeats")
    mode.add_argument("--size", dest="mode", choices=["ci"],
                      help="ci = seconds-long smoke run of every workload for the tests (needs --out)")
    p.set_defaults(mode="full")


def add_commands(bench) -> None:
    """Register `bench suite|compare|noise|speedrun` on the `bench` subparsers."""
    p = bench.add_parser("suite", help="the fixed benchmark suite: time-to-target, GPT-2 step, overhead, data, "
                                       "checkpoint, data- and model-parallel runs; median and confidence interval")
    p.add_argument("--only", nargs="+", default=None, metavar="WORKLOAD", help="run only these workloads")
    _add_run_options(p, "workload", "benchmarks/suite/suite-<device>-<mode>-<date>.json")
    p.set_defaults(func=cmd_bench_suite)
    p = bench.add_parser("compare", help="compare two suite results: ratio and confidence interval per workload, "
                                         "regressions beyond the noise band (exit 1)")
    p.add_argument("base", help="the baseline suite JSON")
    p.add_argument("new", help="the suite JSON to check")
    p.add_argument("--noise-band", type=float, default=None,
                   help="relative change that counts as noise, for every workload (default: each workload's "
                        "measured band, from the two files or else benchmarks/suite/noise-<device>.json of their "
                        "mode; else 0.05)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.set_defaults(func=cmd_bench_compare)
    p = bench.add_parser("noise", help="measure the noise band from repeated suite runs of the same code on one machine")
    p.add_argument("runs", nargs="+", help="two or more suite JSONs of the same commit and machine")
    p.add_argument("--out", default="", help="JSON file (default benchmarks/suite/noise-<device>.json)")
    add_force(p)
    p.set_defaults(func=cmd_bench_noise)
    p = bench.add_parser("speedrun", help="time-to-target of each speed-run switch against the default recipe")
    p.add_argument("--switches", nargs="+", default=None, metavar="SWITCH", help="run only these switches")
    _add_run_options(p, "switch", "benchmarks/suite/speedrun-<device>-<mode>.json")
    p.set_defaults(func=cmd_bench_speedrun)
