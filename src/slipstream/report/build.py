"""`slipstream report PATH [PATH ...]`: decide what each path is and assemble one page.

    a folder with study.json               a `tune hparams` study     -> report.study
    a folder with metrics.jsonl or
      summary.json (runs/latest too)       a training run             -> report.run_sections
    a JSON file of `bench ladder`          a ladder result            -> report.ladder

All the runs given share one set of run sections (their curves overlaid, a config-difference
table), placed where the first run is among the arguments; studies and ladders follow their
argument order. Anything else is a UserError naming the path and what was expected.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from slipstream.errors import UserError
from slipstream.report.page import Section, render_page, write_page


def classify(path: str | Path) -> str:
    """"study", "run" or "ladder" for a report argument, or a UserError saying what was expected."""
    from slipstream.report.runs import is_run_dir

    p = Path(path)
    if not p.exists():
        raise UserError(f"report: '{path}' does not exist; give a run directory (e.g. runs/latest), a study folder "
                        "of `slipstream tune hparams` or a `slipstream bench ladder` JSON file")
    if p.is_dir():
        if (p / "study.json").is_file():
            return "study"
        if is_run_dir(p):
            return "run"
        raise UserError(f"report: '{path}' is a folder but neither a run directory (no metrics.jsonl or "
                        "summary.json) nor a study folder (no study.json); give the --run.dir of a `slipstream "
                        "train` run or the --out folder of `slipstream tune hparams`")
    if p.suffix == ".json" and _is_ladder(p):
        return "ladder"
    raise UserError(f"report: '{path}' is a file but not a `slipstream bench ladder` result; give a run directory "
                    "(the folder, not one of its files), a study folder or a ladder JSON such as "
                    "benchmarks/ladder-speed-cpu-tiny.json")


def _is_ladder(path: Path) -> bool:
    from slipstream.report.ladder import is_ladder_json

    return is_ladder_json(path)


def report_sections(paths: list[str | Path]) -> tuple[list[Section], list[str]]:
    """The page's sections for the arguments, and the names of what they show."""
    from slipstream.report.runs import read_runs

    if not paths:
        raise UserError("report: give at least one run directory, study folder or ladder JSON")
    kinds = [(Path(p), classify(p)) for p in paths]
    run_paths = [p for p, kind in kinds if kind == "run"]
    runs = read_runs(run_paths) if run_paths else []
    sections: list[Section] = []
    names: list[str] = []
    for path, kind in kinds:
        if kind == "run":
            if runs:  # all runs at the first one's place; the later ones are in it already
                from slipstream.report.run_sections import run_sections

                sections += run_sections(runs)
                names += [r.name for r in runs]
                runs = []
        elif kind == "study":
            from slipstream.report.study import study_sections

            sections += study_sections(path)
            names.append(path.resolve().name)
        else:
            from slipstream.report.ladder import ladder_sections

            sections += ladder_sections(path)
            names.append(path.name)
    return _unique_keys(sections), names


def _unique_keys(sections: list[Section]) -> list[Section]:
    """Two studies or two ladders give the same section keys: number the later ones."""
    seen: set[str] = set()
    for section in sections:
        key, n = section.key, 1
        while section.key in seen:
            n += 1
            section.key = f"{key}-{n}"
        seen.add(section.key)
    return sections


def build_report(paths: list[str | Path], title: str | None = None) -> str:
    """The self-contained HTML page for `paths` (run directories, study folders, ladder JSONs)."""
    sections, names = report_sections(list(paths))
    shown = ", ".join(names[:6]) + (f" and {len(names) - 6} more" if len(names) > 6 else "")
    return render_page(title or f"slipstream report: {shown}", sections, subtitle=f"Report of {shown}.")


def _inputs_protected(out: Path, paths: list[str | Path]) -> None:
    """--out may be neither an input file nor anywhere inside an input folder: a report must never
    replace a run's own files (nor sit in a run directory, where a later run would move it)."""
    target = out.expanduser().resolve()
    for path in paths:
        p = Path(path).resolve()
        if target == p or (p.is_dir() and p in target.parents):
            raise UserError(f"--out '{out}' is inside the input '{path}'; a report must not write into a run "
                            "directory, study folder or over its input: choose a path outside it")


def write_report(paths: list[str | Path], out: str | Path, force: bool = False, title: str | None = None) -> Path:
    """Build the report of `paths` and write it to `out` atomically; refuses an existing `out`
    without force, and any `out` inside an input."""
    from slipstream.outputs import refuse_existing

    out = Path(out)
    with _out_errors(out):
        refuse_existing(out, force)
        _inputs_protected(out, list(paths))
        if not out.expanduser().parent.is_dir():
            raise UserError(f"--out '{out}': the folder '{out.parent}' does not exist; create it or choose another "
                            "--out")
    page = build_report(paths, title)
    with _out_errors(out):
        return write_page(out.expanduser(), page)


@contextlib.contextmanager
def _out_errors(out: Path):
    """An OSError about --out (a name too long, a read-only or full disk) as a UserError naming it."""
    try:
        yield
    except OSError as e:
        raise UserError(f"--out '{out}' could not be written ({e.strerror or e}); choose another --out") from None
