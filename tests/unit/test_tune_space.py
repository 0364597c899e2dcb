"""`slipstream tune hparams` without trainings: the search space (flattening, distributions,
conditions, grid values), every refused input, the storage and study checks, the recovery of a
dead worker's trial, and how a finished trial's objective is read."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import optuna
import pytest
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution
from optuna.trial import TrialState

from slipstream.config import load_config
from slipstream.errors import UserError
from slipstream.tune import study as studies
from slipstream.tune.hparams import directions_of, tune_hparams
from slipstream.tune.hparams_report import write_best_config
from slipstream.tune.hparams_trial import read_objective
from slipstream.tune.space import (default_space, flatten_space, grid_search_space, grid_values, parse_space,
                                   resolve_space, suggest)

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _config(tmp_path: Path, space_toml: str) -> Path:
    path = tmp_path / "tune.toml"
    path.write_text(f'extends = "{TINY}"\n\n[tune.space]\n{space_toml}\n', encoding="utf-8")
    return path


def _space(space: dict, overrides: list[str] | None = None):
    return parse_space(space, load_config(TINY, overrides), TINY, overrides or [])


def test_toml_nested_and_override_dotted_keys_flatten_and_the_override_wins(tmp_path):
    path = _config(tmp_path, 'optim.lr = {log_uniform = [1e-4, 1e-2]}\n"optim.weight_decay" = {uniform = [0.0, 0.2]}')
    cfg = load_config(path)
    assert cfg.tune.space == {"optim": {"lr": {"log_uniform": [1e-4, 1e-2]}},
                              "optim.weight_decay": {"uniform": [0.0, 0.2]}}  # as TOML delivers it
    space, is_default = resolve_space(cfg, path, [])
    assert not is_default and list(space) == ["optim.lr", "optim.weight_decay"]
    assert (space["optim.lr"].kind, space["optim.lr"].low, space["optim.lr"].high) == ("log_uniform", 1e-4, 1e-2)

    overrides = ["--tune.space.optim.lr={log_uniform=[1e-3,5e-3]}"]
    cfg = load_config(path, overrides)
    space, _ = resolve_space(cfg, path, overrides)
    assert (space["optim.lr"].low, space["optim.lr"].high) == (1e-3, 5e-3)  # the override, not the file
    # A nested override over a file's dotted key wins too: the later entry.
    assert flatten_space({"optim.lr": {"uniform": [1, 2]}, "optim": {"lr": {"uniform": [3, 4]}}}) == \
        {"optim.lr": {"uniform": [3, 4]}}


def test_empty_space_is_the_documented_default():
    cfg = load_config(TINY, ["--optim.lr=2e-3"])
    space, is_default = resolve_space(cfg)
    assert is_default and space == default_space(cfg)
    lr, wd = space["optim.lr"].distribution(), space["optim.weight_decay"].distribution()
    assert lr == FloatDistribution(2e-4, 2e-2, log=True)
    assert wd == FloatDistribution(0.0, 0.2)


def test_each_spec_type_suggests_its_distribution():
    space = _space({"optim.lr": {"log_uniform": [1e-4, 1e-2]},
                    "optim.weight_decay": {"uniform": [0.0, 0.2], "step": 0.05},
                    "optim.warmup_steps": {"int": [0, 10], "step": 2}, "train.micro_batch_size": {"log_int": [2, 16]},
                    "optim.schedule": {"choices": ["cosine", "wsd", "constant"]}})
    expected = {"optim.lr": FloatDistribution(1e-4, 1e-2, log=True),
                "optim.weight_decay": FloatDistribution(0.0, 0.2, step=0.05),
                "optim.warmup_steps": IntDistribution(0, 10, step=2),
                "train.micro_batch_size": IntDistribution(2, 16, log=True),
                "optim.schedule": CategoricalDistribution(["cosine", "wsd", "constant"])}
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    seen = set()
    for _ in range(12):
        trial = study.ask()
        params = suggest(trial, space, load_config(TINY))
        assert trial.distributions == expected
        assert 1e-4 <= params["optim.lr"] <= 1e-2 and params["optim.warmup_steps"] % 2 == 0
        assert params["optim.weight_decay"] / 0.05 == pytest.approx(round(params["optim.weight_decay"] / 0.05))
        seen.add(params["optim.schedule"])
        study.tell(trial, 1.0)
    assert seen == {"cosine", "wsd", "constant"}


def test_conditional_parameters_follow_the_sampled_value_or_the_config():
    space = _space({"optim.decay_fraction": {"uniform": [0.1, 0.3], "when": {"optim.schedule": "wsd"}},
                    "optim.schedule": {"choices": ["cosine", "wsd"]},
                    "optim.min_lr": {"uniform": [0.0, 1e-4], "when": {"train.seq_len": 64}},
                    "optim.warmup_steps": {"int": [0, 5], "when": {"train.seq_len": 128}}})
    cfg = load_config(TINY)  # tiny: seq_len 64
    for schedule, conditional in (("wsd", True), ("cosine", False)):
        trial = optuna.trial.FixedTrial({"optim.schedule": schedule, "optim.decay_fraction": 0.2, "optim.min_lr": 0.0,
                                         "optim.warmup_steps": 3})
        params = suggest(trial, space, cfg)
        # the sampled schedule decides (it is listed after the parameter that depends on it)
        assert ("optim.decay_fraction" in params) is conditional
        assert "optim.min_lr" in params and "optim.warmup_steps" not in params  # the config's seq_len decides


@pytest.mark.parametrize("key, spec, points, expected", [
    ("optim.weight_decay", {"uniform": [0.0, 0.2]}, 3, [0.0, 0.1, 0.2]),
    ("optim.lr", {"log_uniform": [1e-4, 1e-2]}, 3, [1e-4, 1e-3, 1e-2]),
    ("optim.warmup_steps", {"int": [0, 10], "step": 5}, 3, [0, 5, 10]),
    ("optim.warmup_steps", {"int": [1, 4]}, 2, [1, 2, 3, 4]),
    ("optim.warmup_steps", {"log_int": [1, 100]}, 3, [1, 10, 100]),
    ("optim.weight_decay", {"uniform": [0.0, 0.2], "step": 0.1}, 7, [0.0, 0.1, 0.2]),
])
def test_grid_values(key, spec, points, expected):
    values = grid_values(_space({key: spec})[key], points)
    assert values == pytest.approx(expected)
    assert values[0] == expected[0] and values[-1] == expected[-1]  # the ends exactly
    assert grid_values(_space({"optim.schedule": {"choices": ["cosine", "wsd"]}})["optim.schedule"], 3) == \
        ["cosine", "wsd"]


def test_grid_sampler_visits_every_combination_once():
    space = _space({"optim.lr": {"log_uniform": [1e-4, 1e-2]}, "optim.schedule": {"choices": ["cosine", "wsd"]}})
    grid = grid_search_space(space, 3)
    study = optuna.create_study(sampler=studies.make_sampler("grid", 0, space, 3))
    seen = []
    for _ in range(6):
        trial = study.ask()
        params = suggest(trial, space, load_config(TINY))
        seen.append((params["optim.lr"], params["optim.schedule"]))
        studies.tell(study, trial, 0.0)  # the last grid point's tell asks for a stop that ask/tell cannot make
    assert len(study.get_trials(states=(TrialState.COMPLETE,))) == 6
    assert sorted(seen) == sorted((lr, s) for lr in grid["optim.lr"] for s in grid["optim.schedule"])


def test_samplers_and_pruners_are_optunas_seeded():
    space = _space({"optim.lr": {"log_uniform": [1e-4, 1e-2]}, "optim.warmup_steps": {"int": [0, 10]}})
    kinds = {"tpe": optuna.samplers.TPESampler, "random": optuna.samplers.RandomSampler,
             "grid": optuna.samplers.GridSampler, "cmaes": optuna.samplers.CmaEsSampler}
    for name, cls in kinds.items():
        firsts = []
        for _ in range(2):  # the same seed: the same first point
            study = optuna.create_study(sampler=studies.make_sampler(name, 7, space, 3))
            firsts.append(suggest(study.ask(), space, load_config(TINY)))
        assert isinstance(study.sampler, cls) and firsts[0] == firsts[1]
    assert studies.seed_for_trial(7, 1) != studies.seed_for_trial(7, 2)
    pruners = {"median": optuna.pruners.MedianPruner, "halving": optuna.pruners.SuccessiveHalvingPruner,
               "hyperband": optuna.pruners.HyperbandPruner, "none": optuna.pruners.NopPruner}
    for name, cls in pruners.items():
        assert isinstance(studies.make_pruner(name), cls)


@pytest.mark.parametrize("space, fragments", [
    ({"optim.lrr": {"uniform": [0.1, 0.2]}}, ["tune.space.optim.lrr", "no key 'optim.lrr'", "e.g."]),
    ({"optimizer.lr": {"uniform": [0.1, 0.2]}}, ["tune.space.optimizer.lr", "not a config key", "e.g."]),
    ({"lr": {"uniform": [0.1, 0.2]}}, ["tune.space.lr", "section.field"]),
    ({"optim.lr": {"loguniform": [1e-4, 1e-2]}}, ["tune.space.optim.lr", "unknown spec key 'loguniform'", "e.g."]),
    ({"optim.lr": "1e-3"}, ["tune.space.optim.lr", "expected a range table", "e.g."]),
    ({"optim.lr": {"uniform": [1e-2, 1e-4]}}, ["tune.space.optim.lr", "low > high", "[0.0001, 0.01]"]),
    ({"optim.lr": {"log_uniform": [0.0, 1e-2]}}, ["tune.space.optim.lr", "low > 0", "e.g."]),
    ({"optim.lr": {"uniform": [1e-4]}}, ["tune.space.optim.lr", "[low, high]", "e.g."]),
    ({"optim.lr": {"uniform": ["a", "b"]}}, ["tune.space.optim.lr", "[low, high]"]),
    ({"optim.schedule": {"choices": []}}, ["tune.space.optim.schedule", "non-empty", "e.g."]),
    ({"optim.schedule": {"choices": ["wsd", "wsd"]}}, ["tune.space.optim.schedule", "repeat"]),
    ({"data.inputs": {"choices": [["a"], ["b"]]}}, ["tune.space.data.inputs", "strings, numbers or booleans"]),
    ({"optim.lr": {"uniform": [1e-4, 1e-2], "choices": [1e-3]}}, ["tune.space.optim.lr", "exactly one of"]),
    ({"optim.lr": {"step": 0.1}}, ["tune.space.optim.lr", "exactly one of"]),
    ({"optim.warmup_steps": {"int": [0.5, 10]}}, ["tune.space.optim.warmup_steps", "two integers"]),
    ({"optim.warmup_steps": {"uniform": [0.0, 10.0]}}, ["tune.space.optim.warmup_steps", "int = [a, b]"]),
    ({"optim.schedule": {"int": [0, 2]}}, ["tune.space.optim.schedule", "choices"]),
    ({"optim.lr": {"log_uniform": [1e-4, 1e-2], "step": 1e-4}}, ["tune.space.optim.lr", "step cannot"]),
    ({"optim.warmup_steps": {"int": [0, 10], "step": -2}}, ["tune.space.optim.warmup_steps", "positive integer"]),
    ({"optim.lr": {"uniform": [1e-4, 1e-2], "when": "wsd"}}, ["tune.space.optim.lr", "when must be a table"]),
    ({"optim.lr": {"uniform": [1e-4, 1e-2], "when": {"optim.shedule": "wsd"}}}, ["optim.shedule"]),
    ({"optim.decay_fraction": {"uniform": [0.1, 0.3], "when": {"optim.schedule": "wds"}},
      "optim.schedule": {"choices": ["cosine", "wsd"]}}, ["tune.space.optim.decay_fraction", "can never hold"]),
    ({"optim.lr": {"uniform": [1e-4, 1e-2], "when": {"optim.weight_decay": 0.1}},
      "optim.weight_decay": {"uniform": [0.0, 0.2], "when": {"optim.lr": 1e-3}}}, ["cycle", "make one"]),
    ({"run.dir": {"choices": ["a", "b"]}}, ["tune.space.run.dir", "sets this key itself"]),
    ({"tune.seed": {"int": [0, 3]}}, ["tune.space.tune.seed", "sets this key itself"]),
    ({"optim.weight_decay": {"uniform": [-0.1, 0.2]}},
     ["tune.space.optim.weight_decay", "-0.1", "refused by the config", ">= 0"]),
    ({"optim.lr": {"log_uniform": [1e-6, 1e-3]}}, ["tune.space.optim.lr", "1e-06", "min_lr"]),
    ({"optim.schedule": {"choices": ["cosine", "sgdr"]}}, ["tune.space.optim.schedule", "'sgdr'", "choose one of"]),
])
def test_bad_spaces_are_user_errors_naming_the_key(space, fragments):
    with pytest.raises(UserError) as e:
        _space(space)
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_bad_space_in_a_config_file_fails_when_the_tuner_starts(tmp_path):
    path = _config(tmp_path, "optim.lr = {log_uniform = [1e-2, 1e-4]}")
    with pytest.raises(UserError, match="tune.space.optim.lr.*low > high"):
        tune_hparams(str(path), [], trials=1)


def test_bad_objective_is_refused():
    with pytest.raises(UserError, match="tune.objective"):
        load_config(TINY, ["--tune.objective=val_los"])
    with pytest.raises(UserError, match="tune.objective"):
        directions_of("loss")
    assert directions_of("val_loss,tokens_per_s") == ["minimize", "maximize"]
    assert directions_of("tokens_per_s") == ["maximize"]


def test_an_objective_the_trials_cannot_report_is_refused_before_any_trial(tmp_path, data_dir, corpus_file):
    from slipstream.data import prepare_dataset

    folder = tmp_path / "study"
    # storage bogus://: were the objective not refused first, the storage would fail, never a trial run
    with pytest.raises(UserError, match="val_loss needs evaluation.*eval_tokens = 0"):
        tune_hparams(str(TINY), [f"--data.dir={data_dir}", "--train.eval_tokens=0", f"--tune.dir={folder}"], trials=1,
                     storage="bogus://")
    no_val = tmp_path / "no_val"
    prepare_dataset([str(corpus_file)], "byte", str(no_val), val_fraction=0.0, num_workers=1, progress=False)
    with pytest.raises(UserError, match="best_val_loss needs a validation split"):
        tune_hparams(str(TINY), [f"--data.dir={no_val}", "--tune.objective=best_val_loss", f"--tune.dir={folder}"],
                     trials=1, storage="bogus://")
    assert not folder.exists()  # refused before the study (and any trial)
    # tokens_per_s needs no evaluation: the same config passes that check (then fails on the storage here)
    with pytest.raises(UserError, match="cannot open the study storage"):
        tune_hparams(str(TINY), [f"--data.dir={data_dir}", "--train.eval_tokens=0", "--tune.objective=tokens_per_s",
                                 f"--tune.dir={folder}"], trials=1, storage="bogus://")


@pytest.mark.parametrize("url", ["postgresql://nobody@127.0.0.1:1/x", "sqlite:////nonexistent/dir/x.db", "bogus://",
                                 "journal:/nonexistent/dir/x.log", "journal:"])
def test_unreachable_storage_is_a_user_error_naming_the_url(url):
    with pytest.raises(UserError) as e:
        studies.open_storage(url)
    assert f"'{url}'" in str(e.value) and "storage" in str(e.value)


def test_existing_study_needs_resume_and_the_same_objective(tmp_path):
    url = f"sqlite:///{tmp_path / 'study.db'}"
    storage = studies.open_storage(url)
    meta = {"objective": "val_loss", "space": {}}
    study, notes = studies.open_study(storage, url, "s", ["minimize"], None, None, resume=True, meta=meta)
    assert notes and "started it" in notes[0]  # --resume on a new study starts it (how extra workers join)
    with pytest.raises(UserError, match="already exists.*--resume.*--tune.study_name"):
        studies.open_study(storage, url, "s", ["minimize"], None, None, resume=False, meta=meta)
    with pytest.raises(UserError, match="optimizes val_loss but tune.objective = tokens_per_s"):
        studies.open_study(storage, url, "s", ["maximize"], None, None, resume=True,
                           meta={"objective": "tokens_per_s", "space": {}})
    again, notes = studies.open_study(storage, url, "s", ["minimize"], None, None, resume=True,
                                      meta={"objective": "val_loss", "space": {"optim.lr": {}}})
    assert again.study_name == "s" and "differs" in notes[0]


def test_a_dead_workers_running_trial_is_failed_as_interrupted_and_requeued(tmp_path):
    url = f"journal:{tmp_path / 'study.log'}"
    storage = studies.open_storage(url)
    study = optuna.create_study(storage=storage, study_name="s")
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    lost, alive = study.ask(), study.ask()
    lost.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
    alive.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
    host = studies.worker_attrs()["worker_host"]
    for key, value in {"worker_host": host, "worker_pid": dead.pid, "worker_start": "1",
                       "trial_pid": orphan.pid, "trial_start": studies.process_start(orphan.pid)}.items():
        lost.set_user_attr(key, value)
    for key, value in studies.worker_attrs().items():  # this process: alive
        alive.set_user_attr(key, value)

    assert studies.recover_interrupted(storage, study) == {lost.number: "interrupted"}
    assert orphan.wait(timeout=10) != 0  # the dead worker's trial process is stopped
    trials = study.get_trials()
    assert trials[lost.number].state == TrialState.FAIL
    assert trials[lost.number].user_attrs["fail_reason"] == "interrupted"
    assert trials[alive.number].state == TrialState.RUNNING
    waiting = [t for t in trials if t.state == TrialState.WAITING]
    assert len(waiting) == 1 and waiting[0].user_attrs["requeued_from"] == lost.number
    assert not studies.is_counted(trials[lost.number]) and studies.counted_and_running(study) == (0, 1)
    assert studies.recover_interrupted(storage, study) == {}  # nothing twice
    again = study.ask()  # the queued point comes first, with the lost trial's parameters
    assert again.number == waiting[0].number
    assert again.suggest_float("optim.lr", 1e-4, 1e-2, log=True) == lost.params["optim.lr"]


def test_read_objective(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    assert read_objective(run, "val_loss") == (None, "the trial wrote no summary.json")
    (run / "summary.json").write_text(json.dumps({"val_loss": 4.5, "tokens_per_s": 1000.0}))
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"step": 5, "loss": 5.0}, {"step": 5, "val_loss": 4.2}, {"step": 10, "val_loss": 4.5}]) + "\n")
    assert read_objective(run, "val_loss") == ([4.5], "")
    assert read_objective(run, "best_val_loss") == ([4.2], "")
    assert read_objective(run, "val_loss,tokens_per_s") == ([4.5, 1000.0], "")
    (run / "summary.json").write_text(json.dumps({"tokens_per_s": 1000.0}))
    values, why = read_objective(run, "val_loss")
    assert values is None and why.startswith("the trial reported no val_loss")
    (run / "summary.json").write_text(json.dumps({"val_loss": None}))  # nan is logged as null
    assert read_objective(run, "val_loss")[0] is None and "not finite" in read_objective(run, "val_loss")[1]


def test_best_config_never_replaces_the_config_it_extends(tmp_path):
    result = {"best": {"number": 0, "params": {"optim.lr": 1e-3}}, "config": str(TINY), "overrides": [],
              "study_name": "s", "objective": "val_loss"}
    with pytest.raises(UserError, match="would extend"):
        write_best_config(result, TINY)
    out = write_best_config({**result, "overrides": ["--train.max_steps=7", "--tune.seed=3"]}, tmp_path / "b.toml")
    cfg = load_config(out)
    assert cfg.optim.lr == 1e-3 and cfg.train.max_steps == 7 and cfg.tune.seed == 0 and cfg.run.name == "tiny"
    assert os.path.relpath(TINY, tmp_path) in out.read_text()
