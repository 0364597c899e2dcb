"""Regression tests from the review of `slipstream tune hparams`: each one failed before its fix.

Most run no training: the trial is a small Python process (or a fake run_trial) standing in
for `slipstream train`, since what is checked is the tuner's side (what it reads, reports,
stores and kills)."""

from __future__ import annotations

import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import optuna
import pytest
from optuna.trial import TrialState

from slipstream.errors import UserError
from slipstream.tune import hparams, study as studies
from slipstream.tune.hparams_report import MIN_IMPORTANCE_TRIALS, dashboard_command, importances, write_best_config
from slipstream.tune.hparams_trial import Outcome, read_objective, run_trial
from slipstream.tune.process import train_env

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "configs" / "tiny.toml"
optuna.logging.set_verbosity(optuna.logging.WARNING)


def _lines(records: list[dict]) -> str:
    return "".join(json.dumps(r) + "\n" for r in records)


class _Trial:
    """What run_trial uses of an Optuna trial; should_prune says yes at the steps given."""

    def __init__(self, prune_at: set[int]):
        self.reported: dict[int, float] = {}
        self.prune_at = prune_at

    def report(self, value: float, step: int) -> None:
        self.reported[step] = value

    def should_prune(self) -> bool:
        return max(self.reported) in self.prune_at


def test_the_last_evaluation_is_the_result_never_a_reason_to_prune(tmp_path):
    """The trainer logs its last evaluation (step = max_steps) before it writes summary.json and
    exits; the tuner saw the process still running and pruned it there, throwing away a
    finished trial (with the default warm-up of one evaluation and two evaluations per trial,
    the last one was the only place the pruner ever acted)."""
    evals = _lines([{"step": 5, "val_loss": 4.0}, {"step": 10, "val_loss": 3.9}])
    script = (f"import json, time; open({str(tmp_path / 'metrics.jsonl')!r}, 'w').write({evals!r}); time.sleep(1.5); "
              f"json.dump({{'val_loss': 3.9}}, open({str(tmp_path / 'summary.json')!r}, 'w'))")
    trial = _Trial(prune_at={10})
    outcome = run_trial(trial, [sys.executable, "-c", script], tmp_path, dict(os.environ), "val_loss", None,
                        report=True, prune=True, warmup_evals=0, final_step=10)
    assert trial.reported == {5: 4.0, 10: 3.9}
    assert outcome.state == "complete" and outcome.values == [3.9], outcome


def test_a_trial_killed_by_a_signal_says_so(tmp_path):
    """A trial killed by the kernel's out-of-memory killer was failed with the last line it had
    printed to stderr (a start-up note) as its reason."""
    script = "import os, sys; print('note: starting', file=sys.stderr, flush=True); os.kill(os.getpid(), 9)"
    outcome = run_trial(_Trial(set()), [sys.executable, "-c", script], tmp_path, dict(os.environ), "val_loss", None,
                        report=True, prune=True, warmup_evals=0, final_step=10)
    assert outcome.state == "failed" and outcome.reason == "killed by SIGKILL (out of memory? see dmesg)"


def test_tokens_per_s_objective_is_the_steady_state_speed(tmp_path):
    """summary.json's tokens_per_s averages every interval, the first one (start-up, warm-up,
    torch.compile's compilation) included: a short trial ranked a compiled setting by its
    compile time. The objective is the speed after the first interval, without the slower
    memory-measured one."""
    (tmp_path / "summary.json").write_text(json.dumps({"val_loss": 4.0, "tokens_per_s": 250.0}))
    (tmp_path / "metrics.jsonl").write_text(_lines([
        {"step": 5, "loss": 5.0, "tokens": 1000, "tokens_per_s": 100.0},  # warm-up
        {"step": 5, "val_loss": 4.5},
        {"step": 10, "loss": 4.5, "tokens": 2000, "tokens_per_s": 1000.0},
        {"step": 15, "loss": 4.2, "tokens": 3000, "tokens_per_s": 500.0, "mem_step_peak_bytes": 1},
        {"step": 20, "loss": 4.0, "tokens": 5000, "tokens_per_s": 4000.0},
        {"step": 20, "checkpoint_stall_s": 0.1}]))
    # tokens over time: (1000 + 2000) / (1000 / 1000 + 2000 / 4000)
    assert read_objective(tmp_path, "tokens_per_s") == ([2000.0], "")
    assert read_objective(tmp_path, "val_loss,tokens_per_s") == ([4.0, 2000.0], "")
    (tmp_path / "metrics.jsonl").write_text(_lines([{"step": 5, "loss": 5.0, "tokens": 1000, "tokens_per_s": 100.0}]))
    assert read_objective(tmp_path, "tokens_per_s") == ([250.0], "")  # one interval: the summary's


@pytest.fixture
def fake_trials(monkeypatch):
    """tune_hparams with run_trial replaced: each trial 'completes' at once; the calls are kept."""
    calls = []

    def fake(trial, command, run_dir, env, objective, deadline, **kw):
        calls.append({"params": dict(trial.params), **kw})
        return Outcome("complete", values=[1000.0 + trial.number] * len(objective.split(",")), last_step=1)
    monkeypatch.setattr(hparams, "run_trial", fake)
    return calls


def test_a_tokens_per_s_study_gets_no_val_losses_and_each_trial_knows_its_last_step(tmp_path, data_dir, fake_trials):
    """A tokens_per_s study had its trials report val losses as their intermediate values (the
    dashboard showed a loss curve for a speed objective). And the step where pruning stops is
    the trial's own train.max_steps, also when the space samples it."""
    space = "--tune.space.train.max_steps={choices=[4, 6]}"
    hparams.tune_hparams(str(TINY), [f"--data.dir={data_dir}", f"--tune.dir={tmp_path / 's'}", space,
                                     "--tune.objective=tokens_per_s", "--tune.sampler=grid"], trials=2,
                         log=lambda line: None)
    assert [c["report"] for c in fake_trials] == [False] * 2
    assert all(c["final_step"] == c["params"]["train.max_steps"] for c in fake_trials)
    assert {c["final_step"] for c in fake_trials} == {4, 6}
    fake_trials.clear()
    hparams.tune_hparams(str(TINY), [f"--data.dir={data_dir}", f"--tune.dir={tmp_path / 'v'}"], trials=1,
                         log=lambda line: None)
    assert fake_trials[0]["report"] is True and fake_trials[0]["final_step"] == 20  # tiny.toml's max_steps


def test_one_study_per_folder(tmp_path, data_dir, fake_trials):
    """A second study name in the same --tune.dir (what the 'already exists' error suggested)
    numbered its trials from 0 again in the same trials/trial_NNNN run directories: the new
    trial's tuner read the old trial's metrics.jsonl as its own, and study.json was replaced."""
    args = [f"--data.dir={data_dir}", f"--tune.dir={tmp_path / 's'}"]
    hparams.tune_hparams(str(TINY), args, trials=1, log=lambda line: None)
    with pytest.raises(UserError, match="holds the study 'tiny', not 'other'.*--tune.dir"):
        hparams.tune_hparams(str(TINY), [*args, "--tune.study_name=other"], trials=1, log=lambda line: None)
    assert json.loads((tmp_path / "s" / "study.json").read_text())["study_name"] == "tiny"
    (tmp_path / "s" / studies.STUDY_MARKER).write_text("A study folder of `slipstream tune hparams`.\n")  # older
    with pytest.raises(UserError, match="holds the study 'tiny', not 'other'"):  # study.json says whose it is
        hparams.tune_hparams(str(TINY), [*args, "--tune.study_name=other"], trials=1, log=lambda line: None)
    # A run directory that already holds a trial (a study deleted and started again) is not reused.
    run_dir = tmp_path / "s" / "trials" / "trial_0000"
    assert "holds an earlier trial" in hparams._prepare_trial_dir(run_dir)


def test_resuming_with_other_training_settings_says_so(tmp_path, data_dir, fake_trials):
    """--resume with another --train.max_steps ranked 10-step and 20-step trials together without
    a word (the stored space and objective were compared, the training settings were not)."""
    args = [f"--data.dir={data_dir}", f"--tune.dir={tmp_path / 's'}"]
    hparams.tune_hparams(str(TINY), [*args, "--train.max_steps=10"], trials=1, log=lambda line: None)
    same = hparams.tune_hparams(str(TINY), [*args, "--train.max_steps=10"], trials=2, resume=True,
                                log=lambda line: None)
    other = hparams.tune_hparams(str(TINY), [*args, "--train.max_steps=20"], trials=3, resume=True,
                                 log=lambda line: None)
    assert not any("training overrides differ" in n for n in same["notes"])
    assert any("training overrides differ" in n and "--train.max_steps=10" in n for n in other["notes"])


def test_the_grid_visits_each_point_once_across_workers(tmp_path, data_dir, fake_trials):
    """The tuner reseeded the sampler for every trial, but Optuna's GridSampler shuffles its
    points by its seed and gives trial N the N-th point of its own order: points repeated and
    others were never trained (a 2-point grid trained one point twice)."""
    args = [f"--data.dir={data_dir}", f"--tune.dir={tmp_path / 's'}", "--tune.sampler=grid",
            '--tune.space.optim.schedule={choices=["cosine", "wsd", "constant"]}',
            "--tune.space.optim.warmup_steps={int=[0, 3]}"]
    hparams.tune_hparams(str(TINY), args, trials=5, log=lambda line: None)
    result = hparams.tune_hparams(str(TINY), args, trials=100, resume=True, log=lambda line: None)  # a second worker
    points = [tuple(sorted(c["params"].items())) for c in fake_trials]
    assert len(points) == 12 and len(set(points)) == 12 and result["target"] == 12


def test_grid_of_a_conditional_space_is_refused_before_anything_is_made(tmp_path, data_dir):
    """The grid is every combination of every parameter: with a `when`, the points differing
    only in the parameter left out trained the same configuration again."""
    folder = tmp_path / "s"
    space = ['--tune.space.optim.schedule={choices=["cosine", "wsd"]}',
             '--tune.space.optim.decay_fraction={uniform=[0.1, 0.3], when={"optim.schedule"="wsd"}}']
    with pytest.raises(UserError, match="grid cannot search a conditional space.*optim.decay_fraction"):
        hparams.tune_hparams(str(TINY), [f"--data.dir={data_dir}", f"--tune.dir={folder}", *space,
                                         "--tune.sampler=grid"], trials=2, log=lambda line: None)
    assert not folder.exists()


def test_the_default_space_holds_only_learning_rates_the_config_accepts():
    """An empty [tune.space] searched optim.lr over [lr / 10, lr x 10]; with lr = 3e-4 and the
    default optim.min_lr = 1e-4, a quarter of that range was refused by the config (lr below
    min_lr) and those trials failed without training."""
    from slipstream.config import load_config
    from slipstream.tune.space import check_values, default_space

    space = default_space(load_config(TINY, ["--optim.lr=3e-4"]))
    assert space["optim.lr"].low == 1e-4 and space["optim.lr"].high == pytest.approx(3e-3)
    check_values(space, TINY, ["--optim.lr=3e-4"])  # both ends pass the config's validation


@pytest.mark.parametrize("space, fragments", [
    ({"optim.weight_decay": {"choices": [0, 0.0]}}, ["repeat a value", "1, 1.0 and true"]),
    ({"train.deterministic": {"choices": [True, 1]}}, ["repeat a value"]),
    ({"optim.warmup_steps": {"int": [0, 10]},
      "optim.lr": {"uniform": [1e-4, 1e-2], "when": {"optim.warmup_steps": 20}}}, ["can never hold", "int [0, 10]"]),
    ({"optim.warmup_steps": {"int": [0, 10]},
      "optim.lr": {"uniform": [1e-4, 1e-2], "when": {"optim.warmup_steps": 2.5}}}, ["can never hold"]),
])
def test_spaces_optuna_cannot_honour_are_refused(space, fragments):
    """Choices equal to Optuna (it stores a choice's index, found by ==) came back as the first
    of them from the storage; a `when` on a range it never samples silently dropped a parameter."""
    from slipstream.config import load_config
    from slipstream.tune.space import parse_space

    with pytest.raises(UserError) as e:
        parse_space(space, load_config(TINY))
    for fragment in fragments:
        assert fragment in str(e.value), str(e.value)


def test_a_when_on_a_conditional_parent_may_name_the_configs_value():
    """A parent left out of a trial has the config's value there (tiny: warmup_steps = 5), so a
    `when` naming it can hold though the parent's own range does not contain it."""
    from slipstream.config import load_config
    from slipstream.tune.space import parse_space

    space = {"optim.schedule": {"choices": ["cosine", "wsd"]},
             "optim.warmup_steps": {"int": [0, 3], "when": {"optim.schedule": "wsd"}},
             "optim.weight_decay": {"uniform": [0.0, 0.2], "when": {"optim.warmup_steps": 5}}}
    assert set(parse_space(space, load_config(TINY))) == set(space)


def _dead_pid() -> int:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    return dead.pid


def test_parameters_that_keep_killing_their_worker_stop_being_queued(tmp_path):
    """A trial that takes its worker down (out of memory on the machine) was failed
    'interrupted', not counted, and queued again at every start: a study that never ended."""
    storage = studies.open_storage(f"journal:{tmp_path / 'study.log'}")
    study = optuna.create_study(storage=storage, study_name="s")
    host = studies.worker_attrs()["worker_host"]
    seen = []
    for attempt in range(studies.MAX_LOST_WORKERS):
        trial = study.ask()  # the queued point first, after the first attempt
        trial.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
        for key, value in {"worker_host": host, "worker_pid": _dead_pid(), "worker_start": "1"}.items():
            trial.set_user_attr(key, value)
        seen.append(trial.params["optim.lr"])
        reasons = studies.recover_interrupted(storage, study)
        assert list(reasons) == [trial.number]
    assert len(set(seen)) == 1  # the same parameters each time
    assert reasons[trial.number].startswith(f"its worker died {studies.MAX_LOST_WORKERS} times")
    trials = study.get_trials()
    assert not [t for t in trials if t.state == TrialState.WAITING]  # not queued again
    assert studies.is_counted(trials[-1]) and studies.counted_and_running(study) == (1, 0)
    # Ctrl-C, SIGTERM and the budget are the worker's own stops: they never count as deaths.
    for _ in range(studies.MAX_LOST_WORKERS + 1):
        trial = study.ask()
        trial.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
        assert studies.fail_and_requeue(storage, study, trial.number, "interrupted") == "interrupted"
    assert study.get_trials()[-1].state == TrialState.WAITING and study.get_trials()[-1].user_attrs["lost_workers"] == 0


def test_a_silent_worker_on_another_host_is_taken_for_dead(tmp_path, monkeypatch):
    """A worker on another host (a node of the job that died) left its trial RUNNING forever: it
    counted toward --trials, so the study stopped one short and every later worker exited."""
    storage = studies.open_storage(f"journal:{tmp_path / 'study.log'}")
    study = optuna.create_study(storage=storage, study_name="s")
    silent, beating = study.ask(), study.ask()
    old = time.time() - 60
    for trial, beat in ((silent, time.time() - studies.STALE_AFTER_S - 60), (beating, old)):
        trial.suggest_float("optim.lr", 1e-4, 1e-2, log=True)
        for key, value in {"worker_host": "node-17", "worker_pid": 1, "heartbeat": beat}.items():
            trial.set_user_attr(key, value)
    assert studies.recover_interrupted(storage, study) == {silent.number: "interrupted"}
    assert study.get_trials()[beating.number].state == TrialState.RUNNING
    # A running trial's heartbeat moves on.
    monkeypatch.setattr(studies, "HEARTBEAT_S", 0.0)
    studies.heartbeat(beating)()
    assert study.get_trials()[beating.number].user_attrs["heartbeat"] > old + 50


def test_a_database_server_must_answer_within_seconds(monkeypatch):
    """An unreachable postgresql/mysql host hung the worker for the TCP timeout (minutes)."""
    seen = {}

    class Storage:
        def __init__(self, url, engine_kwargs=None):
            seen[url] = engine_kwargs
    monkeypatch.setattr(optuna.storages, "RDBStorage", Storage)
    studies.open_storage("postgresql://tuner@10.255.255.1/study")
    studies.open_storage("mysql+pymysql://tuner@10.255.255.1/study?connect_timeout=3")
    studies.open_storage("sqlite:///x.db")
    assert seen["postgresql://tuner@10.255.255.1/study"] == {"connect_args": {"connect_timeout": 10}}
    assert seen["mysql+pymysql://tuner@10.255.255.1/study?connect_timeout=3"] is None  # the URL's own
    assert seen["sqlite:///x.db"] == {"connect_args": {"timeout": studies.SQLITE_TIMEOUT_S}}


def test_storage_urls_name_absolute_files_that_the_dashboard_opens(tmp_path, monkeypatch):
    """A relative sqlite:/// or journal: path was recorded and printed as given: the dashboard
    command and study.json opened it only from the folder the study ran in. An SQLite file in a
    missing folder said only "unable to open database file"."""
    import optuna_dashboard

    work = tmp_path / "a folder"
    work.mkdir()
    monkeypatch.chdir(work)
    sqlite, journal = studies.resolve_url("sqlite:///study.db"), studies.resolve_url("journal:study.log")
    assert sqlite == f"sqlite:///{work / 'study.db'}" and journal == f"journal:{work / 'study.log'}"
    assert studies.resolve_url("postgresql://u@h/db") == "postgresql://u@h/db"
    with pytest.raises(UserError, match="folder .*missing of the SQLite file does not exist"):
        studies.resolve_url("sqlite:///missing/study.db")
    for url in (sqlite, journal):
        optuna.create_study(storage=studies.open_storage(url), study_name="s")
    monkeypatch.chdir(tmp_path)  # elsewhere
    for url in (sqlite, journal):
        command = shlex.split(dashboard_command(url))
        assert command[0] == "optuna-dashboard"
        app = optuna_dashboard.wsgi(command[1])
        status = []
        body = b"".join(app({"REQUEST_METHOD": "GET", "PATH_INFO": "/api/studies", "QUERY_STRING": "",
                             "SERVER_NAME": "x", "SERVER_PORT": "80", "wsgi.input": io.BytesIO(),
                             "wsgi.url_scheme": "http"}, lambda s, h, *a: status.append(s)))
        assert status == ["200 OK"] and [s["study_name"] for s in json.loads(body)["study_summaries"]] == ["s"]


def test_a_relative_storage_is_recorded_absolute(tmp_path, data_dir, fake_trials, monkeypatch):
    monkeypatch.chdir(tmp_path)
    result = hparams.tune_hparams(str(TINY), [f"--data.dir={data_dir}", "--tune.dir=s"], trials=1,
                                  storage="journal:study.log", log=lambda line: None)
    assert result["storage"] == f"journal:{tmp_path / 'study.log'}"
    assert json.loads((tmp_path / "s" / "study.json").read_text())["storage"] == result["storage"]
    assert result["dashboard"] == f"optuna-dashboard {tmp_path / 'study.log'}"


def test_a_study_folder_with_a_question_mark_keeps_its_database(tmp_path, data_dir, fake_trials):
    """The default storage was f"sqlite:///{folder}/study.db": a '?' in the folder's path began
    the URL's query, and the study went to another file (here 'odd', beside the folder)."""
    folder = tmp_path / "odd?name 100%"
    result = hparams.tune_hparams(str(TINY), [f"--data.dir={data_dir}", f"--tune.dir={folder}"], trials=1,
                                  log=lambda line: None)
    assert (folder / "study.db").is_file() and not (tmp_path / "odd").exists()
    assert optuna.load_study(study_name="tiny", storage=result["storage"]).trials[0].state == TrialState.COMPLETE


def test_importances_need_enough_trials_to_mean_anything():
    """With a handful of trials PED-ANOVA's 'best 10 %' is one trial: 4 random trials of an
    objective of x alone ranked the idle parameter y first, and that was printed."""
    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(MIN_IMPORTANCE_TRIALS - 1):
        trial = study.ask()
        x, _ = trial.suggest_float("x", 0, 1), trial.suggest_float("y", 0, 1)
        study.tell(trial, (x - 0.3) ** 2)
    found, note = importances(study, ["minimize"], "val_loss", 0)
    assert found is None and f"need {MIN_IMPORTANCE_TRIALS} complete trials" in note
    for _ in range(30):
        trial = study.ask()
        x, _ = trial.suggest_float("x", 0, 1), trial.suggest_float("y", 0, 1)
        study.tell(trial, (x - 0.3) ** 2)
    found, note = importances(study, ["minimize"], "val_loss", 0)
    assert found["x"] > found["y"] and note == "parameter importances (PED-ANOVA on val_loss, 40 trials)"
    pareto = optuna.create_study(directions=["minimize", "maximize"], sampler=optuna.samplers.RandomSampler(seed=0))
    for _ in range(MIN_IMPORTANCE_TRIALS):
        trial = pareto.ask()
        x, y = trial.suggest_float("x", 0, 1), trial.suggest_float("y", 0, 1)
        pareto.tell(trial, [(x - 0.3) ** 2, y])
    found, note = importances(pareto, ["minimize", "maximize"], "val_loss,tokens_per_s", 0)
    assert found["x"] > found["y"] and "`target`" not in note  # Optuna's advice on our own choice: not shown


def test_best_config_of_a_pareto_front_says_which_trial_it_is(tmp_path):
    """Ints stay ints, floats keep every digit, and a multi-objective study's file says it holds
    the front's lowest-val_loss trial (it said nothing: "the best" of two objectives)."""
    params = {"train.micro_batch_size": 8, "optim.lr": 0.0012635598137381671}
    result = {"best": {"number": 3, "params": params, "values": [4.1, 900.0]}, "config": str(TINY),
              "overrides": ["--tune.objective=val_loss,tokens_per_s"], "study_name": "s",
              "objective": "val_loss,tokens_per_s"}
    out = write_best_config(result, tmp_path / "best.toml")
    text = out.read_text()
    assert "val_loss-best of the Pareto front" in text.splitlines()[0]
    data = tomllib.loads(text)
    assert data["train"] == {"micro_batch_size": 8} and data["optim"]["lr"] == params["optim.lr"]
    assert "tune" not in data


_WORKER = """
import sys
import slipstream.tune.process as process
# The trial: a process that outlives the test unless the tuner stops it.
process.train_command = lambda args, nproc=1: [sys.executable, "-c", "import time; time.sleep(120)"]
from slipstream.cli import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_a_stopped_tuner_stops_its_trial_and_queues_it_again(tmp_path, data_dir, sig, code):
    """SIGTERM (a scheduler's cancel, `kill`) ended the tuner on the spot: its trial was left
    RUNNING in the study (and training, until the kernel's parent-death signal). Now SIGTERM and
    Ctrl-C are requests the tuner acts on at its next look at the trial (never in the middle of
    a write to the storage): the trial's process group is stopped, the trial failed
    'interrupted' and its parameters queued for --resume."""
    url = f"journal:{tmp_path / 'study.log'}"
    worker = subprocess.Popen([sys.executable, "-c", _WORKER, "tune", "hparams", "--config", str(TINY), "--trials", "2",
                               f"--data.dir={data_dir}", f"--tune.dir={tmp_path / 's'}", "--storage", url],
                              env=train_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
    deadline, trial_pid = time.monotonic() + 40, None
    while trial_pid is None:
        assert worker.poll() is None and time.monotonic() < deadline, worker.communicate()
        time.sleep(0.2)
        with contextlib.suppress(Exception):  # the journal is being created
            trial_pid = optuna.load_study(study_name="tiny", storage=studies.open_storage(url)).trials[0] \
                .user_attrs.get("trial_pid")
    os.kill(worker.pid, sig)  # the tuner alone, as a scheduler or `kill` does
    _, err = worker.communicate(timeout=30)
    assert worker.returncode == code, err.decode()
    trials = optuna.load_study(study_name="tiny", storage=studies.open_storage(url)).trials
    assert trials[0].state == TrialState.FAIL and trials[0].user_attrs["fail_reason"] == "interrupted"
    assert trials[1].state == TrialState.WAITING and trials[1].user_attrs["requeued_from"] == 0
    assert json.loads((tmp_path / "s" / "trials" / "trial_0000" / "trial.json").read_text())["reason"] == "interrupted"
    with pytest.raises(ProcessLookupError):
        os.kill(trial_pid, 0)
