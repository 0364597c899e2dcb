"""The study and ladder sections of `slipstream report`: real (small) Optuna studies written to a
temp folder as `tune hparams` writes them, without training; the committed ladder results."""

from __future__ import annotations

import json
import shutil
from html import escape as html_escape
from pathlib import Path

import pytest

from slipstream.errors import UserError
from slipstream.report.ladder import is_ladder_json, ladder_sections
from slipstream.report.page import render_page
from slipstream.report.study import intermediate_figure, is_study_dir, open_study, read_study_record, study_sections

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"


def make_study(folder: Path, trials: list[dict], multi: bool = False, journal: bool = False,
               name: str = "demo") -> Path:
    """A study folder following the `tune hparams` contract. Each trial dict gives "params",
    "state" (complete | pruned | fail) and "curve": the val losses it reports at steps 2, 4, ...
    (a pruned trial's curve is where it stopped; a complete one ends with its value)."""
    import optuna

    folder.mkdir(parents=True, exist_ok=True)
    if journal:
        from optuna.storages import JournalStorage
        from optuna.storages.journal import JournalFileBackend

        url = f"journal:{folder / 'study.log'}"
        storage = JournalStorage(JournalFileBackend(str(folder / "study.log")))
    else:
        url = storage = f"sqlite:///{folder / 'study.db'}"
    directions = ["minimize", "maximize"] if multi else ["minimize"]
    study = optuna.create_study(study_name=name, storage=storage, directions=directions)
    distributions = {"optim.lr": optuna.distributions.FloatDistribution(1e-4, 1e-2, log=True),
                     "optim.weight_decay": optuna.distributions.FloatDistribution(0.0, 0.2)}
    states = {"complete": optuna.trial.TrialState.COMPLETE, "pruned": optuna.trial.TrialState.PRUNED,
              "fail": optuna.trial.TrialState.FAIL}
    for number, spec in enumerate(trials):
        curve = spec.get("curve", [])
        values = (spec.get("values") or curve[-1:]) if spec["state"] == "complete" else None
        study.add_trial(optuna.trial.create_trial(
            state=states[spec["state"]], params=spec["params"], values=values,
            distributions={k: distributions[k] for k in spec["params"]},
            intermediate_values={2 * (i + 1): loss for i, loss in enumerate(curve)},
            user_attrs=spec.get("user_attrs", {})))
        run_dir = folder / "trials" / f"trial_{number:04d}"
        run_dir.mkdir(parents=True)
        (run_dir / "trial.json").write_text(json.dumps({"number": number, "state": spec["state"], "values": values,
                                                         "params": spec["params"], "reason": spec.get("reason", "")}))
    (folder / "study.json").write_text(json.dumps({
        "study_name": name, "storage": url, "config": "configs/tiny.toml", "overrides": ["--train.max_steps=6"],
        "objective": "val_loss,tokens_per_s" if multi else "val_loss", "directions": directions,
        "space": {"optim.lr": {"log_uniform": [1e-4, 1e-2]}, "optim.weight_decay": {"uniform": [0.0, 0.2]}},
        "best": None}))
    return folder


PRUNED_STUDY = [
    {"params": {"optim.lr": 1e-3, "optim.weight_decay": 0.1}, "state": "complete", "curve": [5.0, 4.5, 4.2]},
    {"params": {"optim.lr": 3e-3, "optim.weight_decay": 0.05}, "state": "complete", "curve": [4.9, 4.3, 4.0]},
    {"params": {"optim.lr": 1e-4, "optim.weight_decay": 0.0}, "state": "pruned", "curve": [5.6],
     "reason": "pruned at step 2: val loss 5.6 above the median 4.95"},
    {"params": {"optim.lr": 5e-4, "optim.weight_decay": 0.2}, "state": "complete", "curve": [5.1, 4.6, 4.4]},
    {"params": {"optim.lr": 9e-3, "optim.weight_decay": 0.15}, "state": "fail", "curve": [],
     "reason": "error: loss became NaN at step 3"},
]


def _html(sections) -> dict[str, str]:
    return {s.key: "".join(s.parts) for s in sections}


def test_single_objective_study_sections(tmp_path):
    folder = make_study(tmp_path / "tune-demo", PRUNED_STUDY)
    sections = study_sections(folder)
    parts = _html(sections)
    assert list(parts) == ["study", "study-trials", "study-history", "study-intermediate", "study-parallel",
                           "study-importance"]
    # The best trial (lowest final val loss) is named in the overview and marked in the table.
    assert "#1: val_loss 4" in parts["study"] and "3 complete, 1 fail, 1 pruned" in parts["study"]
    trials = parts["study-trials"]
    assert trials.count("<tr>") == 1 + len(PRUNED_STUDY)
    assert "complete (best)" in trials and trials.count("(best)") == 1
    # Reasons come from each trial's trial.json; the pruned trial's last report is where it stopped.
    assert "val loss 5.6 above the median" in trials and "loss became NaN at step 3" in trials
    assert "5.6 at step 2" in trials and "4 at step 6" in trials
    for name in ("study-history", "study-intermediate", "study-parallel", "study-importance"):
        assert f'data-figure="{name}"' in parts[name] and "<svg" in parts[name]
    page = render_page("study", sections)
    assert page.count("<section") == 6


def test_intermediate_values_show_pruned_trials_stopping_early(tmp_path):
    study = open_study(read_study_record(make_study(tmp_path / "s", PRUNED_STUDY)), tmp_path / "s")
    ax = intermediate_figure(study).axes[0]
    lines = [line for line in ax.get_lines() if len(line.get_xdata()) > 0]
    complete = [line for line in lines if line.get_label() == "complete" or line.get_color() == "#4C72B0"]
    pruned = [line for line in lines if line.get_color() == "#DD8452"]
    assert len(complete) == 3 and max(max(line.get_xdata()) for line in complete) == 6
    # The pruned trial's line ends at step 2, with a cross marker where the pruner stopped it.
    assert pruned and max(max(line.get_xdata()) for line in pruned) == 2
    assert any(line.get_marker() == "x" for line in pruned)
    assert "pruned (stopped early)" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_too_few_trials_say_why_instead_of_plotting(tmp_path):
    one = [{"params": {"optim.lr": 1e-3, "optim.weight_decay": 0.1}, "state": "complete", "curve": [5.0, 4.0]}]
    parts = _html(study_sections(make_study(tmp_path / "one", one)))
    assert "data-figure" in parts["study-history"]  # one point is a history
    for key in ("study-parallel", "study-importance"):
        assert "need at least 2 complete trials" in parts[key] and "<svg" not in parts[key]

    # Two complete trials with the same parameters explain nothing.
    same = one + [dict(one[0], curve=[5.1, 4.1])]
    parts = _html(study_sections(make_study(tmp_path / "same", same)))
    for key in ("study-parallel", "study-importance"):
        assert "1 with distinct parameters" in parts[key] and "<svg" not in parts[key]

    empty = _html(study_sections(make_study(tmp_path / "empty", [])))
    assert "no trials yet" in empty["study-trials"]
    for key in ("study-history", "study-intermediate", "study-parallel", "study-importance"):
        assert "<svg" not in empty[key] and '<p class="note">' in empty[key]


def test_multi_objective_study_has_a_pareto_front(tmp_path):
    trials = [{"params": {"optim.lr": lr, "optim.weight_decay": wd}, "state": "complete", "values": [loss, tps]}
              for lr, wd, loss, tps in [(1e-3, 0.1, 4.2, 900.0), (3e-3, 0.0, 4.0, 700.0), (1e-4, 0.2, 4.5, 950.0),
                                        (5e-3, 0.1, 4.6, 600.0)]]
    parts = _html(study_sections(make_study(tmp_path / "multi", trials, multi=True)))
    assert "study-pareto" in parts and 'data-figure="study-pareto"' in parts["study-pareto"]
    assert "val_loss (minimized), tokens_per_s (maximized)" in parts["study"]
    assert "Pareto-optimal trials" in parts["study"] and "#3" not in parts["study"].split("Pareto-optimal")[1]
    for obj in ("val-loss", "tokens-per-s"):
        assert f'data-figure="study-history-{obj}"' in parts["study-history"]
        assert f'data-figure="study-importance-{obj}"' in parts["study-importance"]
    assert "cannot be pruned" in parts["study-intermediate"]


def test_journal_storage_and_a_moved_study_folder(tmp_path):
    make_study(tmp_path / "j", PRUNED_STUDY[:2], journal=True)
    shutil.move(tmp_path / "j", tmp_path / "moved")  # study.json still names the old path
    parts = _html(study_sections(tmp_path / "moved", prefix="other"))
    assert list(parts)[0] == "other" and "other-history" in parts
    assert parts["other-trials"].count("<tr>") == 3


def test_missing_or_foreign_storage_is_a_user_error_and_creates_nothing(tmp_path):
    folder = make_study(tmp_path / "s", PRUNED_STUDY[:1])
    assert is_study_dir(folder) and not is_study_dir(tmp_path)
    (folder / "study.db").rename(tmp_path / "elsewhere.db")
    with pytest.raises(UserError, match="does not exist"):
        study_sections(folder)
    assert not (folder / "study.db").exists()  # load_study on sqlite would have created it

    (tmp_path / "elsewhere.db").rename(folder / "study.db")
    record = json.loads((folder / "study.json").read_text())
    (folder / "study.json").write_text(json.dumps(dict(record, study_name="nope")))
    with pytest.raises(UserError, match="no study named 'nope'"):
        study_sections(folder)
    (folder / "study.json").write_text(json.dumps(dict(record, storage="postgresql://db.example/optuna")))
    with pytest.raises(UserError, match="reads sqlite"):
        study_sections(folder)
    (folder / "study.json").write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        study_sections(folder)
    with pytest.raises(UserError, match="no study.json"):
        study_sections(tmp_path)


def test_damaged_trial_json_is_named_in_its_row_and_markup_is_escaped(tmp_path):
    interrupted = {"params": {"optim.lr": 2e-3}, "state": "fail", "user_attrs": {"fail_reason": "interrupted"}}
    folder = make_study(tmp_path / "s", PRUNED_STUDY[:3] + [interrupted])
    (folder / "trials" / "trial_0001" / "trial.json").write_text("{")
    (folder / "trials" / "trial_0002" / "trial.json").write_text(json.dumps({"reason": "<b>pruned</b>"}))
    (folder / "trials" / "trial_0003" / "trial.json").unlink()  # the reason kept in the study is shown instead
    trials = _html(study_sections(folder))["study-trials"]
    assert "trial.json unreadable" in trials
    assert "&lt;b&gt;pruned&lt;/b&gt;" in trials and "<b>" not in trials
    assert "<td>interrupted</td>" in trials


# ---------------------------------------------------------------------------- ladders


@pytest.mark.parametrize("which, main, key", [("memory", "peak memory", "ladder-memory-cpu-tiny"),
                                              ("speed", "tokens/s", "ladder-speed-cpu-tiny")])
def test_ladder_json_renders_chart_and_rung_table(which, main, key):
    path = BENCHMARKS / f"ladder-{which}-cpu-tiny.json"
    result = json.loads(path.read_text())
    assert is_ladder_json(path)
    [section] = ladder_sections(path)
    html = "".join(section.parts)
    assert section.key == key and f'data-figure="{key}"' in html and main in html
    assert html.count("<tr>") == 1 + len(result["rungs"])
    for row in result["rungs"]:
        assert f"<td>{html_escape(row['rung'])}</td>" in html
    # The ratio to the baseline of the ladder's own quantity, from the committed numbers.
    main_key = "peak_bytes" if which == "memory" else "tokens_per_s"
    last = result["rungs"][-1][main_key]["median"] / result["rungs"][0][main_key]["median"]
    assert f"{last:.2f}x" in html and "1.00x" in html


def test_is_ladder_json_says_no_to_everything_else(tmp_path):
    assert not is_ladder_json(BENCHMARKS / "data-cpu.json")  # another benchmark
    assert not is_ladder_json(BENCHMARKS)  # a folder
    assert not is_ladder_json(tmp_path / "missing.json")
    (tmp_path / "bad.json").write_text('{"bench": "ladder-speed", "rungs": [')
    assert not is_ladder_json(tmp_path / "bad.json")
    (tmp_path / "deep.json").write_text("[" * 100_000 + "]" * 100_000)
    assert not is_ladder_json(tmp_path / "deep.json")
    ladder = json.loads((BENCHMARKS / "ladder-speed-cpu-tiny.json").read_text())
    ladder["rungs"][2]["tokens_per_s"] = {"median": "fast"}
    (tmp_path / "crafted.json").write_text(json.dumps(ladder))
    assert not is_ladder_json(tmp_path / "crafted.json")
    with pytest.raises(UserError, match="'data workers' has no median tokens_per_s"):
        ladder_sections(tmp_path / "crafted.json")


def test_ladder_file_over_the_cap_is_refused(tmp_path, monkeypatch):
    monkeypatch.setenv("SLIPSTREAM_MAX_LADDER_JSON_BYTES", "1KiB")
    path = BENCHMARKS / "ladder-memory-cpu-tiny.json"
    assert not is_ladder_json(path)
    with pytest.raises(UserError, match="SLIPSTREAM_MAX_LADDER_JSON_BYTES"):
        ladder_sections(path)


def test_ladder_with_unmeasured_rungs_and_markup(tmp_path):
    ladder = json.loads((BENCHMARKS / "ladder-speed-cpu-tiny.json").read_text())
    ladder["rungs"][0]["note"] = "<script>alert(1)</script>"
    ladder["rungs"][1]["rung"] = "x" * 500
    (tmp_path / "l.json").write_text(json.dumps(ladder))
    [section] = ladder_sections(tmp_path / "l.json", key="mine")
    html = "".join(section.parts)
    assert section.key == "mine" and "<script>" not in html and "&lt;script&gt;" in html
    assert "x" * 200 + "..." in html and "x" * 201 not in html
    assert "not measured" in html  # the compile rungs have no peak memory: said, not drawn as zero
