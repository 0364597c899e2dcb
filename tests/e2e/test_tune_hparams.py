"""`slipstream tune hparams` end to end on this CPU: Optuna studies whose trials are real
`slipstream train` runs of the tiny model (10 steps, evaluated at steps 5 and 10).

One study (3 trials, through `slipstream.cli.main`) is shared by the end-to-end, best-config
and pruner tests; the crash/resume and concurrent-worker tests run their own."""

from __future__ import annotations

import contextlib
import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from slipstream.cli import main
from slipstream.tune.process import train_env
from slipstream.tune.study import counted_and_running, open_storage

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
MAX_STEPS = 10
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _trial_args(data_dir: Path, max_steps: int = MAX_STEPS) -> list[str]:
    """Seconds-long deterministic trials on the session's prepared corpus."""
    return [f"--data.dir={data_dir}", f"--train.max_steps={max_steps}", f"--train.eval_interval={max_steps // 2}",
            "--train.eval_tokens=2048", "--logging.tensorboard=false", "--metrics.memory_breakdown=false",
            "--train.deterministic=true"]


def _main(argv: list[str]) -> tuple[int, str, str]:
    """`slipstream ARGV` in this process (each trial still is a real subprocess)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(argv)
    return code, out.getvalue(), err.getvalue()


def _worker(argv: list[str], log: Path) -> subprocess.Popen:
    """A `slipstream tune hparams` worker process in its own process group."""
    with open(log, "wb") as f:
        return subprocess.Popen([sys.executable, "-m", "slipstream", "tune", "hparams", *argv], stdout=f,
                                stderr=subprocess.STDOUT, env=train_env(), start_new_session=True)


def _trials(url: str, name: str = "tiny") -> list:
    return optuna.load_study(study_name=name, storage=open_storage(url)).get_trials()


def _trial_json(trial) -> dict:
    return json.loads((Path(trial.user_attrs["run_dir"]) / "trial.json").read_text())


@pytest.fixture(scope="module")
def study(tmp_path_factory, data_dir):
    """A 3-trial study of the default space, its printed JSON result and the written best config."""
    root = tmp_path_factory.mktemp("study")
    best = root / "best.toml"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "2")  # the trials inherit it: no more threads than cores
        code, out, err = _main(["tune", "hparams", "--config", str(TINY), "--trials", "3", "--json",
                                "--write-config", str(best), *_trial_args(data_dir), f"--tune.dir={root / 'study'}"])
    assert code == 0, err
    result = json.loads(out)
    return {"root": root, "folder": root / "study", "result": result, "stderr": err, "best": best,
            "data_dir": data_dir, "trials": _trials(result["storage"])}


@pytest.mark.timeout(300)
def test_three_trial_study_end_to_end(study):
    folder, result = study["folder"], study["result"]
    assert "tune.space is empty: the default" in study["stderr"] and "optim.lr  log_uniform" in study["stderr"]
    assert (folder / "study.db").is_file() and result["storage"] == f"sqlite:///{folder / 'study.db'}"
    trials = study["trials"]
    assert [t.number for t in trials] == [0, 1, 2] and all(t.state == TrialState.COMPLETE for t in trials)
    assert len({t.params["optim.lr"] for t in trials}) == 3  # sampled, not one point three times
    for t in trials:
        assert Path(t.user_attrs["run_dir"]) == folder / "trials" / f"trial_{t.number:04d}"
        record = _trial_json(t)
        assert record["state"] == "complete" and record["params"] == t.params and record["values"] == t.values
        assert record["study_name"] == "tiny" and record["storage"] == result["storage"]
        summary = json.loads((Path(t.user_attrs["run_dir"]) / "summary.json").read_text())
        assert t.values == [summary["val_loss"]] and summary["steps"] == MAX_STEPS
        assert 0.0001 <= t.params["optim.lr"] <= 0.01 and 0.0 <= t.params["optim.weight_decay"] <= 0.2
    best = min(trials, key=lambda t: t.values[0])
    saved = json.loads((folder / "study.json").read_text())
    assert saved["study_name"] == "tiny" and saved["storage"] == result["storage"]
    assert saved["config"] == str(TINY) and saved["objective"] == "val_loss" and saved["directions"] == ["minimize"]
    assert saved["space"] == {"optim.lr": {"log_uniform": [0.0001, 0.01]},
                              "optim.weight_decay": {"uniform": [0.0, 0.2]}}
    assert saved["best"]["number"] == best.number and saved["best"]["values"] == best.values
    assert saved["best"]["params"] == best.params
    assert optuna.load_study(study_name=saved["study_name"], storage=saved["storage"]).best_trial.number == best.number
    assert [r["number"] for r in result["trials"]] == [t.number for t in sorted(trials, key=lambda t: t.values[0])]
    assert result["importances"] is None and "need 11 complete trials" in result["importance_note"]  # 3 are too few
    assert result["dashboard"] == f"optuna-dashboard {result['storage']}"


@pytest.mark.timeout(300)
def test_best_config_reproduces_the_best_trial(study, tmp_path):
    best = study["result"]["best"]
    text = study["best"].read_text()
    assert f'extends = "{os.path.relpath(TINY, study["root"])}"' in text
    run = tmp_path / "again"
    done = subprocess.run([sys.executable, "-m", "slipstream", "train", "--config", str(study["best"]),
                           "--train.deterministic=true", f"--run.dir={run}", "--logging.progress=false",
                           "--checkpoint.save_final=false"], env=train_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    again = json.loads((run / "summary.json").read_text())
    trial = json.loads((Path(best["run_dir"]) / "summary.json").read_text())
    assert again["val_loss"] == best["values"][0] == trial["val_loss"]  # exactly: the same training
    assert again["final_loss"] == trial["final_loss"]


@pytest.mark.timeout(300)
def test_pruner_stops_a_planted_bad_trial(study):
    """lr = 1e-4 (10x below the good trials) after three good trials: its val loss at the first
    evaluation (step 5) is well above theirs (5.3 vs 4.9), so the median pruner stops it there,
    long before its 200 steps. (lr = 10 is worse still, but its loss turns NaN within 5 more
    steps, which can end the trial before the tuner reads its first evaluation.) A point the
    config refuses fails without a run."""
    url = study["result"]["storage"]
    handle = optuna.load_study(study_name="tiny", storage=url)
    handle.enqueue_trial({"optim.lr": 1e-4, "optim.weight_decay": 0.1})
    handle.enqueue_trial({"optim.lr": 1e-6, "optim.weight_decay": 0.1})  # below optim.min_lr = 1e-4
    code, out, err = _main(["tune", "hparams", "--config", str(TINY), "--trials", "5", "--resume",
                            *_trial_args(study["data_dir"]), "--train.max_steps=200", f"--tune.dir={study['folder']}",
                            "--tune.prune_warmup_evals=0"])
    assert code == 0, err
    trials = _trials(url)
    assert [t.state for t in trials[:3]] == [TrialState.COMPLETE] * 3
    assert [(t.number, t.values) for t in trials[:3]] == [(t.number, t.values) for t in study["trials"]]
    bad, refused = trials[3], trials[4]
    assert bad.params["optim.lr"] == 1e-4 and bad.state == TrialState.PRUNED
    assert list(bad.intermediate_values) == [5]
    assert bad.intermediate_values[5] > max(t.intermediate_values[5] for t in trials[:3])
    record = _trial_json(bad)
    assert record["state"] == "pruned" and record["last_step"] < 200
    run_dir = Path(bad.user_attrs["run_dir"])
    steps = [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) < 200 and not (run_dir / "summary.json").exists()  # stopped, not finished
    assert refused.state == TrialState.FAIL and "the config refuses" in refused.user_attrs["fail_reason"]
    assert "min_lr" in _trial_json(refused)["reason"] and _trial_json(refused)["state"] == "failed"
    assert "pruned" in out and len(trials) == 5


@pytest.mark.timeout(300)
def test_killed_study_resumes_without_repeating_finished_trials(tmp_path, data_dir):
    """SIGKILL the tuner's process group while trial 1 trains; --resume fails trial 1 as
    interrupted, runs its parameters again and finishes the study (journal storage)."""
    folder, url = tmp_path / "study", f"journal:{tmp_path / 'study.log'}"
    argv = ["--config", str(TINY), "--trials", "2", *_trial_args(data_dir), f"--tune.dir={folder}", "--storage", url]
    worker = _worker(argv, tmp_path / "worker.log")
    deadline = time.monotonic() + 200
    while not (folder / "trials" / "trial_0001" / "metrics.jsonl").exists():
        assert worker.poll() is None, (tmp_path / "worker.log").read_text()
        assert time.monotonic() < deadline
        time.sleep(0.1)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()
    before = _trials(url)
    assert [t.state for t in before] == [TrialState.COMPLETE, TrialState.RUNNING]
    trial_pid = before[1].user_attrs["trial_pid"]

    code, out, err = _main(["tune", "hparams", *argv, "--resume"])
    assert code == 0, err
    after = _trials(url)
    assert (after[0].state, after[0].params, after[0].values, after[0].datetime_complete) == \
        (TrialState.COMPLETE, before[0].params, before[0].values, before[0].datetime_complete)
    assert after[1].state == TrialState.FAIL and after[1].user_attrs["fail_reason"] == "interrupted"
    assert _trial_json(after[1])["state"] == "failed" and _trial_json(after[1])["reason"] == "interrupted"
    assert after[2].params == before[1].params and after[2].user_attrs["requeued_from"] == 1  # run again
    assert after[2].state == TrialState.COMPLETE and len(after) == 3  # nothing finished is repeated
    assert _trial_json(after[2])["state"] == "complete"
    assert counted_and_running(optuna.load_study(study_name="tiny", storage=open_storage(url))) == (2, 0)
    assert "interrupted" in err
    with pytest.raises(ProcessLookupError):  # the killed worker's trial did not outlive it
        os.kill(trial_pid, 0)


@pytest.mark.timeout(120)
def test_budget_stops_the_running_trial_and_queues_it_again(tmp_path, data_dir):
    """--budget 5s ends long before the trial's 100,000 steps: it is stopped, failed 'budget' (not
    counted) and its parameters wait for the next worker."""
    from slipstream.tune.hparams import tune_hparams

    folder = tmp_path / "study"
    started = time.monotonic()
    result = tune_hparams(str(TINY), [*_trial_args(data_dir, max_steps=100_000), f"--tune.dir={folder}"], trials=3,
                          budget_s=5.0, log=lambda line: None)
    assert time.monotonic() - started < 60
    trials = _trials(result["storage"])
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.WAITING]
    assert trials[0].user_attrs["fail_reason"] == "budget" and trials[1].user_attrs["requeued_from"] == 0
    assert _trial_json(trials[0])["reason"] == "budget"
    assert not (folder / "trials" / "trial_0000" / "summary.json").exists()
    handle = optuna.load_study(study_name="tiny", storage=result["storage"])
    assert result["best"] is None and counted_and_running(handle) == (0, 0)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("storage, trials, objective",
                         [("sqlite", 4, "val_loss"), ("journal", 4, "val_loss,tokens_per_s")])
def test_two_workers_share_one_study(tmp_path, data_dir, storage, trials, objective):
    """Two `slipstream tune hparams --config configs/tiny.toml --trials N` processes on one study:
    distinct trials and run directories, N in all, both workers busy. The journal study is a
    multi-objective one: no pruning, its Pareto front is the result."""
    folder = tmp_path / "study"
    extra = ["--storage", f"journal:{tmp_path / 'study.log'}"] if storage == "journal" else []
    extra.append(f"--tune.objective={objective}")
    argv = ["--config", str(TINY), "--trials", str(trials), "--resume", *_trial_args(data_dir, max_steps=4),
            f"--tune.dir={folder}", *extra]
    workers = [_worker(argv, tmp_path / f"worker{i}.log") for i in range(2)]
    for i, w in enumerate(workers):
        assert w.wait(timeout=280) == 0, (tmp_path / f"worker{i}.log").read_text()
    url = f"journal:{tmp_path / 'study.log'}" if storage == "journal" else f"sqlite:///{folder / 'study.db'}"
    found = _trials(url)
    assert [t.number for t in found] == list(range(trials))
    assert all(t.state in (TrialState.COMPLETE, TrialState.PRUNED) for t in found)  # the median pruner may stop some
    run_dirs = {t.user_attrs["run_dir"] for t in found}
    assert len(run_dirs) == trials and all(_trial_json(t)["number"] == t.number for t in found)
    assert {t.user_attrs["worker_pid"] for t in found} == {w.pid for w in workers}
    assert len({tuple(sorted(t.params.items())) for t in found}) == trials  # distinct points too
    if "," in objective:
        handle = optuna.load_study(study_name="tiny", storage=open_storage(url))
        assert [d.name for d in handle.directions] == ["MINIMIZE", "MAXIMIZE"]
        assert all(t.state == TrialState.COMPLETE and len(t.values) == 2 for t in found)
        saved = json.loads((folder / "study.json").read_text())
        front = sorted(t.number for t in handle.best_trials)
        assert sorted(p["number"] for p in saved["best"]["pareto_front"]) == front
        logs = (tmp_path / "worker0.log").read_text() + (tmp_path / "worker1.log").read_text()
        assert "pruning is off" in logs and "Pareto front" in logs


@pytest.mark.timeout(300)
def test_a_trial_of_two_processes_runs_under_the_launcher(tmp_path, data_dir):
    """--nproc 2: the trial is a `launch local --nproc 2` job; its summary says world size 2 and
    its val loss is the study's value."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        code, out, err = _main(["tune", "hparams", "--config", str(TINY), "--trials", "1", "--nproc", "2", "--json",
                                *_trial_args(data_dir, max_steps=4), "--train.micro_batch_size=2",
                                f"--tune.dir={tmp_path / 'study'}"])
    assert code == 0, err
    (trial,) = _trials(json.loads(out)["storage"])
    assert trial.state == TrialState.COMPLETE
    summary = json.loads((Path(trial.user_attrs["run_dir"]) / "summary.json").read_text())
    assert summary["world_size"] == 2
    assert trial.values[0] == pytest.approx(summary["val_loss"])
