"""`slipstream report` and `slipstream compare`: finished runs for people.

    slipstream report PATH [PATH ...] --out report.html [--force] [--title T]
        PATH: a run directory (runs/latest), a `tune hparams` study folder or a `bench ladder` JSON
    slipstream compare RUN_A RUN_B [--json]
"""

from __future__ import annotations

import argparse

from slipstream.cli._common import add_force, no_extra


def add_commands(sub) -> None:
    p = sub.add_parser("report", help="one self-contained HTML page of runs, a tuning study or a ladder benchmark",
                       description="Write one HTML page (no network needed to open it) of training runs (their "
                                   "curves overlaid, config differences), `tune hparams` studies and `bench "
                                   "ladder` results.")
    p.add_argument("paths", nargs="+", metavar="PATH",
                   help="a run directory (e.g. runs/latest), a study folder (study.json) or a ladder JSON")
    p.add_argument("--out", default="report.html",
                   help="the HTML file to write (default: report.html in the current folder; never over a file "
                        "that exists, unless --force)")
    p.add_argument("--title", default=None, help="the page's title (default: the names of what it shows)")
    add_force(p)
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("compare", help="two runs side by side: config differences and metric deltas")
    p.add_argument("run_a", metavar="RUN_A", help="run directory A (the baseline)")
    p.add_argument("run_b", metavar="RUN_B", help="run directory B")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of the tables")
    p.set_defaults(func=cmd_compare)


def cmd_report(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.report.build import write_report

    no_extra(extra)
    path = write_report(args.paths, args.out, force=args.force, title=args.title)
    print(f"wrote {path}")
    return 0


def cmd_compare(args: argparse.Namespace, extra: list[str]) -> int:
    from slipstream.report.compare import compare_runs, comparison_json, format_comparison

    no_extra(extra)
    result = compare_runs(args.run_a, args.run_b)
    print(comparison_json(result) if args.json else format_comparison(result))
    return 0
