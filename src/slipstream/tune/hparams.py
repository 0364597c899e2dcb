"""`slipstream tune hparams`: an Optuna study whose trials are real `slipstream train` runs.

    slipstream tune hparams --config F [--trials N] [--budget 30m] [--resume] [--nproc N]
                            [--storage URL] [--write-config OUT [--force]] [--json] [--section.key=value ...]

The space is `[tune.space]` (tune/space.py; empty: the learning rate and weight decay), the
objective `tune.objective`, the study lives in `tune.storage` (SQLite in the study folder by
default; tune/study.py). Each worker asks the study for a trial, trains it in
`<study dir>/trials/trial_NNNN/` (single process or `launch local --nproc N`), reports its val
losses to the pruner while it runs and tells the study how it ended: COMPLETE with its
objective, PRUNED, or FAIL with the reason in the trial's user attrs. `--trials N` is the total
the study should have, counted in the storage so several workers share it; `--budget` is this
worker's wall time. Ctrl-C or SIGTERM stops the running trial with everything it started and
queues its parameters again (--resume runs them). One study per folder. At the end: a ranked
table, parameter importances, `<study dir>/study.json` and, with --write-config, the best trial
as a config that `extends` the base one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.tune import study as studies
from slipstream.tune.hparams_trial import TRIAL_SETTINGS, Outcome, run_trial
from slipstream.tune.process import train_env
from slipstream.tune.space import (Param, describe, grid_search_space, override_arg, resolve_space, space_to_json,
                                   suggest)

OBJECTIVES = {"val_loss": ["minimize"], "best_val_loss": ["minimize"], "tokens_per_s": ["maximize"],
              "val_loss,tokens_per_s": ["minimize", "maximize"]}
NO_REPORT = "the trial reported no"


class Terminated(KeyboardInterrupt):
    """Ctrl-C (SIGINT) or SIGTERM (a scheduler's cancel or preemption, `kill`) stopped the tuner."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@contextlib.contextmanager
def _stop_requests(requested: list[int]) -> Iterator[None]:
    """While the trials run, SIGINT and SIGTERM are requests, appended to `requested`, that the
    tuner acts on where it is safe (Tuner.check_stop, at every look at the running trial): the
    trial is stopped with everything it started, failed "interrupted" and its parameters queued
    again. Raised at once, at any point, they could cut a write to the storage in half, and
    SIGTERM's default ends the tuner on the spot, leaving its trial RUNNING. A second signal
    raises at once (the user insists). Signal handlers exist only in the main thread: elsewhere,
    nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def request(signum, frame) -> None:
        if requested:
            raise Terminated(signum)
        requested.append(signum)

    previous = {s: signal.signal(s, request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)


def directions_of(objective: str) -> list[str]:
    if objective not in OBJECTIVES:
        raise UserError(f"tune.objective = {objective!r}: choose one of {', '.join(OBJECTIVES)}")
    return OBJECTIVES[objective]


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def _refuse_unreportable(cfg, objective: str, manifest: dict | None) -> None:
    """An objective the trials cannot report is refused before any trial runs: evaluation off,
    or (with the prepared data's manifest) no validation split."""
    if "val_loss" not in objective:
        return
    t = cfg.train
    if not (t.eval_tokens and t.eval_steps):
        raise UserError(f"tune.objective = {objective} needs evaluation, but train.eval_tokens = {t.eval_tokens} and "
                        f"train.eval_steps = {t.eval_steps} turn it off; set both > 0 (e.g. --train.eval_tokens=65536) "
                        "or use --tune.objective=tokens_per_s")
    if manifest is None:
        return
    val_tokens = int(manifest.get("splits", {}).get("val", {}).get("tokens", 0))
    if val_tokens <= t.seq_len:
        raise UserError(f"tune.objective = {objective} needs a validation split, but the data has {val_tokens} val "
                        f"tokens (fewer than one sequence of {t.seq_len}); prepare it with data.val_fraction > 0 "
                        "or use --tune.objective=tokens_per_s")


def _prepare_trial_dir(run_dir: Path) -> str:
    """Create the trial's run directory with slipstream's run marker (so the trial's own logs may
    sit beside the trainer's files); "" or why it cannot be used."""
    from slipstream.observe.env import write_json_atomic
    from slipstream.train.rundir import MARKER

    if run_dir.exists() and any(run_dir.iterdir()) and not (run_dir / MARKER).is_file():
        return f"its run directory {run_dir} holds files slipstream did not write"
    if (run_dir / "trial.json").is_file():  # its metrics.jsonl would be read as this trial's
        return (f"its run directory {run_dir} holds an earlier trial of this number (a study deleted and started "
                "again in this folder?); give the study a new --tune.dir")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not (run_dir / MARKER).is_file():
        write_json_atomic(run_dir / MARKER, {"created_by": "slipstream tune hparams"})
    return ""


def _write_trial_json(run_dir: Path, number: int, outcome: Outcome, params: dict, study_name: str, url: str) -> None:
    """The tuner's record of a trial in its run directory (only one the tuner made: marked)."""
    from slipstream.observe.env import write_json_atomic
    from slipstream.train.rundir import MARKER

    if not (run_dir / MARKER).is_file():
        return
    write_json_atomic(run_dir / "trial.json", {
        "number": number, "state": outcome.state, "params": params, "values": outcome.values,
        "reason": outcome.reason, "study_name": study_name, "storage": url, "run_dir": str(run_dir.resolve()),
        "last_step": outcome.last_step})


@dataclasses.dataclass
class Tuner:
    """What every trial of this worker shares."""

    study: Any
    storage: Any
    url: str
    folder: Path
    config_path: str
    base_overrides: list[str]  # the user's overrides and the prepared data folder
    cfg: Any
    space: dict[str, Param]
    objective: str
    target: int
    deadline: float | None
    nproc: int
    prune: bool
    log: Callable[[str], None]
    stop_requested: list[int] = dataclasses.field(default_factory=list)  # signals received (_stop_requests)

    def check_stop(self) -> None:
        if self.stop_requested:
            raise Terminated(self.stop_requested[0])

    def _recover(self) -> None:
        """Fail and requeue the trials a dead worker left running (under the lock)."""
        recovered = studies.recover_interrupted(self.storage, self.study)
        by_number = {t.number: t for t in self.study.get_trials(deepcopy=False)}
        for number, reason in recovered.items():
            _write_trial_json(self.folder / "trials" / f"trial_{number:04d}", number,
                              Outcome("failed", reason=reason), by_number[number].params,
                              self.study.study_name, self.url)
            self.log(f"note: trial {number} was left running by a worker that is gone: "
                     + ("failed as interrupted, its parameters queued again" if reason == "interrupted" else
                        f"failed: {reason}"))

    def _ask(self):
        """Under the study lock: the next trial and its parameters, or None when the study has
        its trials (finished ones that count, and those other workers are running)."""
        cfg = self.cfg
        with studies.study_lock(self.folder):
            self._recover()  # at start-up, and whenever a worker beside this one died meanwhile
            counted, running = studies.counted_and_running(self.study)
            if counted + running >= self.target:
                return None
            if cfg.tune.sampler != "grid":  # the grid keeps tune.seed: it is the order of its points
                seed = studies.seed_for_trial(cfg.tune.seed, len(self.study.get_trials(deepcopy=False)))
                self.study.sampler = studies.make_sampler(cfg.tune.sampler, seed, self.space, cfg.tune.grid_points)
            trial = self.study.ask()
            for key, value in studies.worker_attrs().items():
                trial.set_user_attr(key, value)
            run_dir = self.folder / "trials" / f"trial_{trial.number:04d}"
            trial.set_user_attr("run_dir", str(run_dir.resolve()))
            return trial, suggest(trial, self.space, cfg), run_dir

    def run_one(self) -> bool:
        """Ask, train and tell one trial; False when this worker is done."""
        from optuna.trial import TrialState

        from slipstream.config import load_config

        self.check_stop()
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.log("tune hparams: the budget is spent; no new trial")
            return False
        asked = self._ask()
        if asked is None:
            return False
        trial, params, run_dir = asked
        shown = " ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in params.items())
        self.log(f"trial {trial.number}: {shown}")
        args = [*self.base_overrides, *(override_arg(k, v) for k, v in params.items()),
                *(override_arg(k, v) for k, v in {**TRIAL_SETTINGS, "run.dir": str(run_dir)}.items())]
        started = time.monotonic()
        refused, final_step = _prepare_trial_dir(run_dir), 0
        if not refused:
            try:  # the combination must pass the config's own validation
                final_step = load_config(self.config_path, args).train.max_steps
            except UserError as e:
                refused = f"the config refuses these values: {e}"
        try:
            if refused:
                outcome = Outcome("failed", reason=refused)
            else:
                from slipstream.tune.process import train_command

                beat = studies.heartbeat(trial)

                def on_start(pid: int) -> None:  # lets a later worker stop this trial if this worker dies
                    trial.set_user_attr("trial_pid", pid)
                    trial.set_user_attr("trial_start", studies.process_start(pid))

                def on_poll() -> None:  # at every look at the trial: Ctrl-C / SIGTERM act here; the heartbeat
                    self.check_stop()
                    beat()

                # Val losses go to Optuna only where they are the objective: a tokens_per_s study
                # would show (and a pruner would rank) a loss it does not optimize.
                report = len(self.study.directions) == 1 and "val_loss" in self.objective
                outcome = run_trial(trial, train_command(["--config", self.config_path, *args], self.nproc), run_dir,
                                    train_env(), self.objective, self.deadline, report=report, prune=self.prune,
                                    warmup_evals=self.cfg.tune.prune_warmup_evals, final_step=final_step,
                                    on_start=on_start, on_poll=on_poll)
        except BaseException:  # Ctrl-C, SIGTERM: the trial is stopped; the study gets it back to run again
            outcome = Outcome("failed", reason="interrupted")
            studies.fail_and_requeue(self.storage, self.study, trial.number, "interrupted")
            _write_trial_json(run_dir, trial.number, outcome, params, self.study.study_name, self.url)
            raise
        if outcome.state == "complete":
            studies.tell(self.study, trial, outcome.values)
        elif outcome.state == "pruned":
            studies.tell(self.study, trial, state=TrialState.PRUNED)
        elif outcome.reason in studies.NOT_COUNTED:
            studies.fail_and_requeue(self.storage, self.study, trial.number, outcome.reason)
        else:
            trial.set_user_attr("fail_reason", outcome.reason)
            studies.tell(self.study, trial, state=TrialState.FAIL)
        _write_trial_json(run_dir, trial.number, outcome, params, self.study.study_name, self.url)
        values = " ".join(f"{name}={v:.5g}" for name, v in zip(self.objective.split(","), outcome.values or []))
        took = time.monotonic() - started
        what = outcome.reason if outcome.state == "pruned" else f"{outcome.state} {values or outcome.reason}"
        self.log(f"trial {trial.number}: {what} ({took:.1f}s)")  # "pruned at step 5", "complete val_loss=4.6"
        return True


def tune_hparams(config_path: str, overrides: list[str], trials: int = 20, budget_s: float | None = None,
                 resume: bool = False, nproc: int = 1, storage: str | None = None,
                 log: Callable[[str], None] = _stderr) -> dict:
    """Run (or continue) the study until it has `trials` finished trials or this worker's budget
    is spent, and return the JSON-ready result (see the module doc). Progress goes to `log`."""
    import optuna

    from slipstream.config import load_config
    from slipstream.data.ensure import ensure_data

    deadline = None if budget_s is None else time.monotonic() + budget_s
    if not config_path:
        raise UserError("tune hparams needs --config FILE: the training config whose hyper-parameters to tune")
    if trials < 1 or nproc < 1:
        raise UserError(f"--trials and --nproc must be >= 1 (got {trials} and {nproc})")
    if budget_s is not None and budget_s <= 0:
        raise UserError(f"--budget must be > 0 (got {budget_s:g}s)")
    overrides = list(overrides)
    cfg = load_config(config_path, overrides)
    tune = cfg.tune
    directions = directions_of(tune.objective)
    space, is_default = resolve_space(cfg, config_path, overrides)
    sampler = studies.make_sampler(tune.sampler, tune.seed, space, tune.grid_points)  # refuses a conditional grid
    log(("search space (tune.space is empty: the default)" if is_default else "search space (tune.space)")
        + ":\n" + describe(space))
    # The data once, before the study and any trial (quietly: --json stays one object); every
    # trial reads it. An objective the trials cannot report stops here, before the study exists.
    _refuse_unreportable(cfg, tune.objective, None)
    quiet = dataclasses.replace(cfg, logging=dataclasses.replace(cfg.logging, progress=False))
    data_dir, manifest = ensure_data(quiet)
    _refuse_unreportable(cfg, tune.objective, manifest)
    name = studies.study_name(cfg)
    folder = studies.study_dir(cfg, name)
    url = storage or tune.storage
    if url:
        url = studies.resolve_url(url)
        store = studies.open_storage(url)  # before the folder: a bad URL leaves nothing behind
        studies.prepare_study_dir(folder, name)
    else:  # the SQLite file of the study folder
        studies.prepare_study_dir(folder, name)
        url = studies.storage_url("", folder)
        store = studies.open_storage(url)
    notes = []
    prune = tune.pruner != "none"
    if prune and (len(directions) > 1 or tune.objective == "tokens_per_s"):
        prune = False
        notes.append("pruning is off: Optuna prunes no multi-objective study" if len(directions) > 1 else
                     "pruning is off: the pruner acts on val losses, which do not rank tokens_per_s")
    target = trials
    if tune.sampler == "grid":
        size = math.prod(len(v) for v in grid_search_space(space, tune.grid_points).values())
        if size < trials:
            notes.append(f"the grid has {size} points: the study stops there (not at --trials {trials})")
            target = size
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    training = [o for o in overrides if not o.lstrip("-").startswith("tune.")]
    meta = {"objective": tune.objective, "space": space_to_json(space), "training": training}
    study, opened = studies.open_study(store, url, name, directions, sampler, studies.make_pruner(tune.pruner),
                                       resume, meta)
    notes += opened
    for note in notes:
        log(f"note: {note}")
    tuner = Tuner(study, store, url, folder, str(config_path), [*overrides, f"--data.dir={Path(data_dir).resolve()}"],
                  cfg, space, tune.objective, target, deadline, nproc, prune, log)
    ran = 0
    with _stop_requests(tuner.stop_requested):
        while tuner.run_one():
            ran += 1
    from slipstream.tune.hparams_report import study_result, write_study_json

    result = study_result(study, config_path, overrides, tune.objective, directions, space, url, folder, tune.seed)
    result.update({"default_space": is_default, "pruning": prune, "notes": notes, "trials_run_here": ran,
                   "target": target})
    write_study_json(result, folder)
    finished = [t for t in result["trials"] if t["state"] in ("complete", "pruned", "failed")
                and t["reason"] not in studies.NOT_COUNTED]
    if finished and all(t["state"] == "failed" and t["reason"].startswith(NO_REPORT) for t in finished):
        raise UserError(f"none of the {len(finished)} trials reported {tune.objective} ({finished[0]['reason']}); "
                        f"see {finished[0]['run_dir']}")
    return result
