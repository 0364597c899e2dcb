"""The results of `slipstream tune hparams`: the ranked trials, the best one (the Pareto front of
a multi-objective study), parameter importances, `study.json`, the table, and the best trial
written as a config that `extends` the base one."""

from __future__ import annotations

import importlib.util
import os
import shlex
import warnings
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.tune.space import Param, override_arg, space_to_json

STATE_NAMES = {"COMPLETE": "complete", "PRUNED": "pruned", "FAIL": "failed", "RUNNING": "running", "WAITING": "waiting"}
STATE_ORDER = {"complete": 0, "pruned": 1, "failed": 2, "running": 3, "waiting": 4}
# Complete trials an importance needs. PED-ANOVA compares the best 10 % of the trials with all
# of them: below 11 trials that "10 %" is the single best trial, and the importances say only
# where that one point lies (on a planted x-only objective, 4 random trials ranked the idle
# parameter first). fANOVA's forest over a handful of points is no better.
MIN_IMPORTANCE_TRIALS = 11


def dashboard_command(url: str) -> str:
    """How to open the study in optuna-dashboard (a journal study by its file)."""
    return "optuna-dashboard " + shlex.quote(url[len("journal:"):] if url.startswith("journal:") else url)


def _record(trial, pareto: set[int]) -> dict[str, Any]:
    state = STATE_NAMES.get(trial.state.name, trial.state.name.lower())
    reason = trial.user_attrs.get("fail_reason", "")
    if state == "pruned" and trial.intermediate_values:
        reason = f"pruned at step {max(trial.intermediate_values)}"
    return {"number": trial.number, "state": state, "params": dict(trial.params),
            "values": list(trial.values) if state == "complete" else None, "reason": reason,
            "run_dir": trial.user_attrs.get("run_dir"), "pareto": trial.number in pareto,
            "duration_s": trial.duration.total_seconds() if trial.duration is not None else None,
            "requeued_from": trial.user_attrs.get("requeued_from")}


def _rank_key(record: dict, directions: list[str]) -> tuple:
    """Complete trials first, best first (the Pareto front first in a multi-objective study,
    then by the first objective); then pruned, failed, running, waiting, by number."""
    if record["state"] != "complete":
        return (STATE_ORDER.get(record["state"], 5), 0, 0.0, record["number"])
    first = record["values"][0] * (1 if directions[0] == "minimize" else -1)
    return (0, 0 if record["pareto"] or len(directions) == 1 else 1, first, record["number"])


def importances(study, directions: list[str], objective: str, seed: int) -> tuple[dict[str, float] | None, str]:
    """Optuna's parameter importances over the complete trials (fANOVA when scikit-learn is
    installed, else PED-ANOVA, which needs nothing more), or None and why there are none."""
    import optuna
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    if len(complete) < MIN_IMPORTANCE_TRIALS:
        return None, (f"no parameter importances: they need {MIN_IMPORTANCE_TRIALS} complete trials or more to mean "
                      f"anything (the study has {len(complete)})")
    if len({tuple(sorted(t.params.items())) for t in complete}) < 2:
        return None, "no parameter importances: every complete trial has the same parameter values"
    if importlib.util.find_spec("sklearn") is not None:
        evaluator, method = optuna.importance.FanovaImportanceEvaluator(seed=seed), "fANOVA"
    else:
        evaluator, method = optuna.importance.PedAnovaImportanceEvaluator(), "PED-ANOVA"
    target = None if len(directions) == 1 else (lambda t: t.values[0])
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")  # kept off the console; what matters goes into the note
            found = optuna.importance.get_param_importances(study, evaluator=evaluator, target=target)
    except (RuntimeError, ValueError) as e:
        return None, f"no parameter importances: {e}"
    # Kept: what says the numbers are weak ("few trials in a regime", "will be equal"); not the
    # experimental-API notices, nor "lower target values" (the first objective here is a loss).
    said = [str(w.message) for w in caught if not issubclass(w.category, optuna.exceptions.ExperimentalWarning)
            and "`target`" not in str(w.message)]
    if any("will be equal" in line for line in said):
        return None, f"no parameter importances: {next(line for line in said if 'will be equal' in line)}"
    on = objective.split(",")[0]
    note = f"parameter importances ({method} on {on}, {len(complete)} trials)"
    return {k: float(v) for k, v in found.items()}, note + "".join(f"; {line}" for line in said[:2])


def study_result(study, config_path: str, overrides: list[str], objective: str, directions: list[str],
                 space: dict[str, Param], url: str, folder: Path, seed: int) -> dict[str, Any]:
    """The study as JSON-ready data: every trial ranked, the best, the importances."""
    from optuna.trial import TrialState

    complete = study.get_trials(deepcopy=False, states=(TrialState.COMPLETE,))
    pareto = {t.number for t in study.best_trials} if complete and len(directions) > 1 else set()
    records = sorted((_record(t, pareto) for t in study.get_trials(deepcopy=False)),
                     key=lambda r: _rank_key(r, directions))
    best = None
    if records and records[0]["state"] == "complete":
        keys = ("number", "params", "values", "run_dir")
        best = {k: records[0][k] for k in keys}
        if len(directions) > 1:
            best["pareto_front"] = [{k: r[k] for k in keys} for r in records if r["pareto"]]
    found, note = importances(study, directions, objective, seed)
    return {"study_name": study.study_name, "storage": url, "study_dir": str(folder.resolve()),
            "config": str(Path(config_path).resolve()), "overrides": list(overrides), "objective": objective,
            "directions": directions, "space": space_to_json(space), "best": best, "trials": records,
            "importances": found, "importance_note": note, "dashboard": dashboard_command(url)}


def write_study_json(result: dict, folder: Path) -> Path:
    """`<study dir>/study.json` (atomic): what `slipstream report` needs to open the study."""
    from slipstream.observe.env import write_json_atomic

    keys = ("study_name", "storage", "study_dir", "config", "overrides", "objective", "directions", "space", "best",
            "importances", "dashboard")
    path = folder / "study.json"
    write_json_atomic(path, {k: result[k] for k in keys})
    return path


def _value(v: float) -> str:
    return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.5g}"


def _params(params: dict[str, Any]) -> str:
    return " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())


def format_report(result: dict) -> str:
    """The ranked table, the best trial, importances, where the study is and how to look at it."""
    names = result["objective"].split(",")
    multi = len(names) > 1
    rows = [("#", "state", *names, "time", "params")]
    for r in result["trials"]:
        values = r["values"] or [None] * len(names)
        state = r["state"] + (" *" if r["pareto"] else "")
        rows.append((str(r["number"]), state, *("-" if v is None else _value(v) for v in values),
                     "-" if r["duration_s"] is None else f"{r['duration_s']:.1f}s",
                     _params(r["params"]) + (f"  ({r['reason']})" if r["reason"] else "")))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    lines = [f"tune hparams: study '{result['study_name']}', objective {result['objective']} "
             f"({', '.join(result['directions'])}), {len(result['trials'])} trial(s)"]
    lines += ["  ".join([*(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))),
                         row[-1]]) for row in rows]
    if multi:
        lines.append("* = on the Pareto front (no other trial is as good in every objective and better in one)")
    lines += [f"note: {n}" for n in result.get("notes", [])]
    best = result["best"]
    if best is None:
        lines.append("no trial completed yet; see the reasons above")
    else:
        values = ", ".join(f"{n} {_value(v)}" for n, v in zip(names, best["values"]))
        what = "best (of the Pareto front: the lowest " + names[0] + ")" if multi else "best"
        lines.append(f"{what}: trial {best['number']}, {values}: {_params(best['params'])}")
    if result["importances"]:
        lines.append(result["importance_note"] + ": " + ", ".join(
            f"{k} {v:.2f}" for k, v in sorted(result["importances"].items(), key=lambda kv: -kv[1])))
    else:
        lines.append(result["importance_note"])
    lines.append(f"study: {result['storage']} (folder {result['study_dir']}); continue it with --resume")
    lines.append(f"dashboard: {result['dashboard']}")
    return "\n".join(lines)


def write_best_config(result: dict, out: str | Path) -> Path:
    """A TOML that extends the base config with the user's overrides (not the [tune] ones) and
    the best trial's parameters (atomic). Not over the config it extends. In a multi-objective
    study "best" is the trial of the Pareto front with the best first objective (the lowest
    val_loss of val_loss,tokens_per_s); the file's first line says so, and study.json lists the
    whole front."""
    import tomli_w

    from slipstream.config.load import deep_merge, parse_overrides
    from slipstream.observe.env import write_text_atomic
    from slipstream.outputs import refuse_same_file

    if result["best"] is None:
        raise UserError("no trial completed, so there is no best configuration to write")
    refuse_same_file(out, [result["config"]], "--write-config", "the --config it would extend")
    out = Path(out).resolve()
    user = [o for o in result["overrides"] if not o.lstrip("-").startswith("tune.")]
    best = [override_arg(k, v) for k, v in result["best"]["params"].items()]
    data = deep_merge(parse_overrides(user), parse_overrides(best))
    base = os.path.relpath(Path(result["config"]).resolve(), out.parent)
    names = result["objective"].split(",")
    which = "" if len(names) == 1 else f", the {names[0]}-best of the Pareto front (study.json lists the front)"
    text = (f"# Written by `slipstream tune hparams`: trial {result['best']['number']} of the study "
            f"'{result['study_name']}' ({result['objective']}{which}).\n" + tomli_w.dumps({"extends": base, **data}))
    write_text_atomic(out, text)
    return out
