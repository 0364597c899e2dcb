"""The study part of `slipstream report`: a `slipstream tune hparams` folder as tables and plots.

A study folder holds (the contract `tune hparams` writes):

    study.json                  {"study_name", "storage", "config", "overrides", "objective",
                                 "directions", "space", "best"}
    trials/trial_NNNN/          each trial's run directory, with trial.json
                                {"number", "state", "params", "values", "reason"}

The trials themselves (parameters, values, durations, the val loss each one reported) are read
from the Optuna storage that study.json names: `sqlite:///PATH` or `journal:PATH`. The storage is
opened as it is and never created: a missing database or study is an error, not an empty study
(optuna.load_study on a missing SQLite file would quietly create one). Reading never writes: SQLite
is opened read-only (see `_read_only_sqlite`), and a journal is only read (Optuna's journal takes
its lock file only to append).

The plots are Optuna's own matplotlib ones (history, parallel coordinates, importances, Pareto
front) plus the intermediate values drawn here, so that pruned trials visibly stop early. A plot
that needs more trials than the study has is replaced by one line saying why.
"""

from __future__ import annotations

import json
import re
import warnings
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.report.page import Section, figure, paragraph, preformatted, table
from slipstream.safe_read import GiB, MiB, Cap, check_size, load_json_capped

# study.json and trial.json are a few KiB; the database grows ~ a few KiB per trial.
STUDY_JSON = Cap("study JSON file (study.json, trial.json)", 16 * MiB, "SLIPSTREAM_MAX_STUDY_JSON_BYTES")
STUDY_DB = Cap("study database (SQLite or journal file)", 1 * GiB, "SLIPSTREAM_MAX_STUDY_DB_BYTES")

STATE_COLORS = {"COMPLETE": "#4C72B0", "PRUNED": "#DD8452", "FAIL": "#C44E52", "RUNNING": "#8C8C8C"}
# Characters of a free-text field shown (study.json's config, overrides and space; a trial's reason):
# a genuine one is a line or two, and a crafted file must not make a page of any size.
MAX_TEXT = 2000


def is_study_dir(path: str | Path) -> bool:
    """Whether `path` looks like a `tune hparams` study folder (the report's dispatcher asks)."""
    return (Path(path) / "study.json").is_file()


def study_sections(study_dir: str | Path, prefix: str = "study") -> list[Section]:
    """The report's sections for one study folder. Section keys are `prefix` and `prefix-*`
    (pass another prefix to put two studies on one page)."""
    study_dir = Path(study_dir)
    record = read_study_record(study_dir)
    study = open_study(record, study_dir)
    names = objective_names(record, study)
    # Fetched once: study.trials deep-copies every trial on each call (quadratic if asked per trial).
    trials = study.get_trials(deepcopy=False)
    reasons = trial_reasons(study_dir, [t.number for t in trials])
    best = best_trial_numbers(study, trials)

    sections = [_overview_section(prefix, study_dir, record, study, trials, best, names),
                _trials_section(prefix, study, trials, best, names, reasons)]
    plots = [("history", "Optimization history", _history_parts),
             ("intermediate", "Val loss during the trials", _intermediate_parts),
             ("parallel", "Parallel coordinates", _parallel_parts),
             ("importance", "Parameter importances", _importance_parts)]
    if len(study.directions) > 1:
        plots.append(("pareto", "Pareto front", _pareto_parts))
    for suffix, title, parts in plots:
        section = Section(f"{prefix}-{suffix}", title)
        for part in parts(study, trials, names):
            section.add(part)
        sections.append(section)
    return sections


# ---------------------------------------------------------------------------- reading


def read_study_record(study_dir: Path) -> dict[str, Any]:
    """study.json, checked for the fields the report needs."""
    path = study_dir / "study.json"
    if not path.is_file():
        raise UserError(f"{study_dir} is not a study folder: it has no study.json "
                        "(give the folder `slipstream tune hparams` wrote, e.g. runs/tune-<name>)")
    try:
        record = load_json_capped(path, STUDY_JSON)
    except ValueError as e:  # json.JSONDecodeError, or an integer of more digits than Python converts
        raise UserError(f"{path} is not valid JSON ({e}); the study folder is damaged") from None
    if not isinstance(record, dict):
        raise UserError(f"{path} is not a study record (a JSON object); the study folder is damaged")
    for key in ("study_name", "storage"):
        if not isinstance(record.get(key), str) or not record[key]:
            raise UserError(f"{path} has no '{key}' (a non-empty string); the study folder is damaged")
    return record


def _storage_file(url: str, study_dir: Path) -> Path:
    """The file a sqlite:/// or journal: URL names, read as the tuner's SQLAlchemy read it (a
    query such as ?timeout=60 is no part of the path, %xx escapes are decoded); also when the
    study folder was moved or copied since the study ran: then the file is found under its own
    name in the folder."""
    text = url.removeprefix("journal:")
    if url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        try:
            text = make_url(url).database or ""
        except Exception:  # noqa: BLE001 - SQLAlchemy's ArgumentError: a URL it cannot parse
            text = ""
    path = Path(text).expanduser()
    for candidate in (path, study_dir / path.name) if text and text != ":memory:" else ():
        if candidate.is_file():
            check_size(candidate, STUDY_DB)
            return candidate
    if text and path.exists():  # a device, a FIFO, a folder: nothing the report reads
        raise UserError(f"the study's storage {url} is not a regular file; give the study folder that "
                        "`slipstream tune hparams` wrote, with its own database")
    raise UserError(f"the study's storage {url} does not exist (nor {study_dir / path.name}); "
                    "the database was deleted or not copied with the study folder")


def _wal_mode(path: Path) -> bool:
    """Whether the SQLite file's header says WAL mode (its bytes 18-19 are 2); a UserError when
    the file is no SQLite database at all."""
    with open(path, "rb") as f:
        header = f.read(20)
    if not header.startswith(b"SQLite format 3\x00"):
        raise UserError(f"the study's storage {path} is not an SQLite database (its first bytes say so); "
                        "the study.json names another file, or the database is damaged")
    return header[18:20] == b"\x02\x02"


def _read_only_sqlite(path: Path):
    """An Optuna storage that reads the SQLite file at `path` and cannot write beside it.

    The connection is made here rather than from a URL: in `sqlite:///file:PATH?mode=ro&uri=true`
    a '#' or '?' in PATH cuts the path short and drops mode=ro, so SQLite would create (and Optuna
    fill) another database. A database in WAL mode with no -wal file (no writer has it open) is
    opened immutable: a read-only connection would still leave -wal and -shm files beside it."""
    import sqlite3
    from urllib.parse import quote

    import optuna

    uri = f"file:{quote(str(path.resolve()))}?mode=ro"
    if _wal_mode(path) and not Path(f"{path}-wal").exists():
        uri += "&immutable=1"
    # skip_table_creation: a file that is no Optuna database fails to read instead of being written.
    return optuna.storages.RDBStorage("sqlite://", engine_kwargs={"creator": lambda: sqlite3.connect(uri, uri=True)},
                                      skip_table_creation=True)


def open_study(record: dict[str, Any], study_dir: Path):
    """The Optuna study study.json names, loaded from its existing storage, read-only."""
    import optuna

    url, name = record["storage"], record["study_name"]
    if not url.startswith(("sqlite:///", "journal:")):
        raise UserError(f"{study_dir / 'study.json'}: storage {url!r} is not one the report reads; "
                        "it reads sqlite:///PATH and journal:PATH (open other databases with optuna-dashboard)")
    path = _storage_file(url, study_dir)
    try:
        if url.startswith("sqlite:///"):
            storage = _read_only_sqlite(path)
        else:
            from optuna.storages import JournalStorage
            from optuna.storages.journal import JournalFileBackend

            storage = JournalStorage(JournalFileBackend(str(path)))  # replays (reads) the whole journal
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - SQLAlchemy's or the journal's own errors (a KeyError too)
        raise _unreadable(name, url, path, e) from None
    try:
        return optuna.load_study(study_name=name, storage=storage)
    except KeyError:
        raise UserError(f"{url} has no study named {name!r}; the study.json and the database do not "
                        "belong together") from None
    except Exception as e:  # noqa: BLE001
        raise _unreadable(name, url, path, e) from None


def _unreadable(name: str, url: str, path: Path, error: Exception) -> UserError:
    reason = (str(error).strip().splitlines() or [""])[0][:300]  # SQLAlchemy appends the SQL and a link
    return UserError(f"cannot read the study {name!r} from {url} ({path}): {type(error).__name__}: {reason}; "
                     "the file is damaged or not an Optuna storage this Optuna version reads")


def objective_names(record: dict[str, Any], study) -> list[str]:
    """One name per objective: study.json's objective ("val_loss,tokens_per_s"), else Optuna's
    metric names, else "value"."""
    n = len(study.directions)
    objective = record.get("objective")
    if isinstance(objective, str) and len(objective.split(",")) == n:
        return [part.strip() for part in objective.split(",")]
    if study.metric_names and len(study.metric_names) == n:
        return list(study.metric_names)
    return ["value"] if n == 1 else [f"value {i}" for i in range(n)]


def trial_reasons(study_dir: Path, numbers: list[int]) -> dict[int, str]:
    """Why each trial failed or was pruned, from its trial.json ("" when it says nothing). Only
    the trials the study has are read, so a folder full of stray files costs nothing."""
    reasons = {}
    for number in numbers:
        path = study_dir / "trials" / f"trial_{number:04d}" / "trial.json"
        if not path.is_file():
            continue
        try:
            record = load_json_capped(path, STUDY_JSON)
        except (ValueError, UserError, OSError) as e:  # ValueError: json.JSONDecodeError and the like
            # One damaged trial file should not hide the whole study: the table says it.
            reasons[number] = f"(trial.json unreadable: {e})"
            continue
        reason = record.get("reason") if isinstance(record, dict) else None
        if reason:
            reasons[number] = _clip(str(reason))
    return reasons


# ---------------------------------------------------------------------------- tables


def _direction_word(direction) -> str:
    return "minimized" if direction.name == "MINIMIZE" else "maximized"


def best_trial_numbers(study, trials: list) -> list[int]:
    """The best trial's number (the first of equals), or the Pareto-optimal trials' numbers of a
    multi-objective study; [] before any trial is complete."""
    if not _complete(trials):
        return []
    if len(study.directions) == 1:
        return [study.best_trial.number]
    return sorted(t.number for t in study.best_trials)


def _complete(trials: list) -> list:
    return [t for t in trials if t.state.name == "COMPLETE"]


def _clip(text: str, limit: int = MAX_TEXT) -> str:
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text) - limit:,} more characters)"


def _overview_section(prefix: str, study_dir: Path, record: dict[str, Any], study, trials: list,
                      best_numbers: list[int], names: list[str]) -> Section:
    counts: dict[str, int] = {}
    for t in trials:
        counts[t.state.name.lower()] = counts.get(t.state.name.lower(), 0) + 1
    objectives = ", ".join(f"{name} ({_direction_word(d)})" for name, d in zip(names, study.directions))
    rows: list[list[Any]] = [
        ["study", study.study_name], ["folder", str(study_dir)], ["storage", record["storage"]],
        ["objective", objectives],
        ["trials", ", ".join(f"{n} {state}" for state, n in sorted(counts.items())) or "none yet"],
    ]
    best = [t for t in trials if t.number in best_numbers]
    if len(best) == 1:
        values = ", ".join(f"{name} {v:.4g}" for name, v in zip(names, best[0].values))
        params = ", ".join(f"{k} = {_short(v)}" for k, v in best[0].params.items())
        rows.append(["best trial", f"#{best[0].number}: {values}; {params}"])
    elif best:
        rows.append(["Pareto-optimal trials", ", ".join(f"#{t.number}" for t in best)])
    if record.get("config"):
        rows.append(["config", _clip(str(record["config"]))])
    if record.get("overrides"):
        overrides = record["overrides"]
        text = " ".join(map(str, overrides)) if isinstance(overrides, list) else str(overrides)
        rows.append(["overrides", _clip(text)])
    section = Section(prefix, f"Study {study.study_name}").add(table(["", "value"], rows, name="study-overview"))
    space = record.get("space")
    if space:
        lines = ([f"{key} = {json.dumps(value, default=str)}" for key, value in space.items()]
                 if isinstance(space, dict) else [json.dumps(space, default=str)])
        section.add(paragraph("Search space:")).add(preformatted(_clip("\n".join(lines), 10 * MAX_TEXT)))
    return section


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)


def _trials_section(prefix: str, study, trials: list, best_numbers: list[int], names: list[str],
                    reasons: dict[int, str]) -> Section:
    params = sorted({k for t in trials for k in t.params})
    best = set(best_numbers)
    arrows = ["lower is better" if d.name == "MINIMIZE" else "higher is better" for d in study.directions]
    header = ["trial", "state", *params, *(f"{n} ({a})" for n, a in zip(names, arrows)),
              "last report", "duration (s)", "why it stopped"]
    rows = []
    for t in trials:
        state = t.state.name.lower() + (" (best)" if t.number in best else "")
        values = list(t.values) if t.values else [None] * len(names)
        last = ""
        if t.intermediate_values:
            step = max(t.intermediate_values)
            last = f"{t.intermediate_values[step]:.4g} at step {step}"
        duration = t.duration.total_seconds() if t.duration is not None else None
        # trial.json's reason, else the one `tune hparams` keeps with the trial (e.g. "interrupted").
        reason = reasons.get(t.number) or _clip(str(t.user_attrs.get("fail_reason") or ""))
        rows.append([t.number, state, *(t.params.get(p) for p in params), *values, last, duration, reason])
    section = Section(f"{prefix}-trials", "Trials")
    if not rows:
        return section.add(paragraph("The study has no trials yet.", "note"))
    return section.add(table(header, rows, name="study-trials"))


# ---------------------------------------------------------------------------- plots


def _optuna_plot(plot, *args, **kwargs):
    """An Optuna matplotlib plot's figure. Optuna's plots set a global style (ggplot) and warn
    that they are experimental: the style is kept to this figure and only that warning silenced.
    Objective and parameter names come from the storage and study.json, so a `$` in them is
    drawn as written, never parsed as mathtext (a malformed formula would fail the whole page);
    `_figure` saves the figure the same way."""
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import optuna

    with matplotlib.rc_context({"text.parse_math": False}), warnings.catch_warnings():
        warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
        ax = plot(*args, **kwargs)
    fig = ax.flat[0].figure if hasattr(ax, "flat") else ax.figure
    return fig


def _figure(fig, name: str, caption: str) -> str:
    return figure(fig, name, caption, math_text=False)


def _why(text: str) -> list[str]:
    return [paragraph(text, "note")]


def _too_few_to_compare(trials: list, what: str) -> list[str]:
    """Why a plot that compares trials by their parameters cannot be drawn ([] when it can)."""
    complete = _complete(trials)
    distinct = {tuple(sorted((k, repr(v)) for k, v in t.params.items())) for t in complete if t.params}
    if len(distinct) >= 2:
        return []
    return _why(f"{what} need at least 2 complete trials with different parameters; "
                f"the study has {len(complete)} complete, {len(distinct)} with distinct parameters.")


def _history_parts(study, trials: list, names: list[str]) -> list[str]:
    from optuna.visualization.matplotlib import plot_optimization_history

    if not _complete(trials):
        return _why("The optimization history needs at least 1 complete trial; none has finished.")
    if len(names) == 1:
        fig = _optuna_plot(plot_optimization_history, study, target_name=names[0])
        return [_figure(fig, "study-history", f"{names[0]} of each complete trial and the best so far")]
    parts = []
    for i, name in enumerate(names):
        fig = _optuna_plot(plot_optimization_history, study, target=lambda t, i=i: t.values[i], target_name=name)
        parts.append(_figure(fig, _figure_name("study-history", names, i), f"{name} of each complete trial"))
    return parts


def intermediate_figure(study):
    """The val loss each trial reported at its evaluations, one line per trial: complete trials
    in blue, pruned ones in orange ending in a cross where the pruner stopped them."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    labelled = set()
    for t in study.get_trials(deepcopy=False):
        if not t.intermediate_values:
            continue
        steps = sorted(t.intermediate_values)
        values = [t.intermediate_values[s] for s in steps]
        state = t.state.name
        label = {"COMPLETE": "complete", "PRUNED": "pruned (stopped early)", "FAIL": "failed"}.get(state, state.lower())
        ax.plot(steps, values, color=STATE_COLORS.get(state, "#8C8C8C"), marker=".", alpha=0.8, lw=1.2,
                label=None if label in labelled else label)
        labelled.add(label)
        if state == "PRUNED":
            ax.plot(steps[-1:], values[-1:], color=STATE_COLORS["PRUNED"], marker="x", ms=9, mew=2)
    ax.set_xlabel("step")
    ax.set_ylabel("reported val loss")
    ax.set_title("Val loss reported at each evaluation")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return fig


def _intermediate_parts(study, trials: list, names: list[str]) -> list[str]:
    if not any(t.intermediate_values for t in trials):
        why = ("a multi-objective study cannot be pruned, so its trials report nothing" if len(names) > 1
               else "no trial has reported a val loss yet (trials report at each evaluation)")
        return _why(f"No intermediate values: {why}.")
    return [figure(intermediate_figure(study), "study-intermediate",
                   "each trial's val loss at its evaluations; a cross marks where the pruner stopped a trial")]


def _parallel_parts(study, trials: list, names: list[str]) -> list[str]:
    from optuna.visualization.matplotlib import plot_parallel_coordinate

    why = _too_few_to_compare(trials, "Parallel coordinates")
    if why:
        return why
    parts = []
    for i, name in enumerate(names):
        target = None if len(names) == 1 else (lambda t, i=i: t.values[i])
        fig = _optuna_plot(plot_parallel_coordinate, study, target=target, target_name=name)
        parts.append(_figure(fig, _figure_name("study-parallel", names, i),
                             f"each complete trial's parameters and {name}"))
    return parts


def _importance_parts(study, trials: list, names: list[str]) -> list[str]:
    import optuna
    from optuna.visualization.matplotlib import plot_param_importances

    from slipstream.tune.hparams_report import MIN_IMPORTANCE_TRIALS

    why = _too_few_to_compare(trials, "Parameter importances")
    if why:
        return why
    parts = []
    complete = sum(t.state.name == "COMPLETE" for t in trials)
    if complete < MIN_IMPORTANCE_TRIALS:  # `tune hparams` prints none below this; the page shows them, flagged
        parts += _why(f"Only {complete} complete trial(s): PED-ANOVA compares the best 10 % of trials with the "
                      f"rest, so below {MIN_IMPORTANCE_TRIALS} complete trials these importances are anecdotal.")
    for i, (name, direction) in enumerate(zip(names, study.directions)):
        # PED-ANOVA scores a given target as lower-is-better, so a maximized objective is negated
        # here, and the warning that says so is silenced.
        sign = 1.0 if direction.name == "MINIMIZE" else -1.0
        target = None if len(names) == 1 else (lambda t, i=i, sign=sign: sign * t.values[i])
        try:
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message="PedAnovaImportanceEvaluator computes")
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)  # Optuna 4
                # Named, not Optuna's default: in Optuna 4.0 that is fANOVA, which needs scikit-learn.
                evaluator = optuna.importance.PedAnovaImportanceEvaluator()
                fig = _optuna_plot(plot_param_importances, study, evaluator=evaluator, target=target, target_name=name)
        except (ValueError, RuntimeError) as e:  # e.g. no parameter that every complete trial has
            parts += _why(f"Parameter importances for {name} could not be computed: {e}")
            continue
        parts.append(_figure(fig, _figure_name("study-importance", names, i),
                             f"how much each parameter matters for a good {name} (PED-ANOVA)"))
    return parts


def _pareto_parts(study, trials: list, names: list[str]) -> list[str]:
    from optuna.visualization.matplotlib import plot_pareto_front

    if not _complete(trials):
        return _why("The Pareto front needs at least 1 complete trial; none has finished.")
    if len(names) not in (2, 3):
        return _why(f"A Pareto front is drawn for 2 or 3 objectives; this study has {len(names)}.")
    fig = _optuna_plot(plot_pareto_front, study, target_names=names)
    return [_figure(fig, "study-pareto", "complete trials; the Pareto-optimal ones (best trade-offs) highlighted")]


def _figure_name(base: str, names: list[str], i: int) -> str:
    """data-figure names: `base` for a single objective, `base-<objective>` for each of several."""
    if len(names) == 1:
        return base
    return f"{base}-" + (re.sub(r"[^A-Za-z0-9]+", "-", names[i]).strip("-").lower() or str(i))
