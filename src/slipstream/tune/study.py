"""The Optuna study of `slipstream tune hparams`: its storage, sampler and pruner, which worker
runs which trial, and what happens to the trials of a worker that died.

Storage: an RDB study, SQLite in the study folder by default (`sqlite:///<dir>/study.db`), any
SQLAlchemy URL, or `journal:PATH` (Optuna's JournalStorage over one append-only file). The
study is the source of truth: several workers on one storage share it, and a crashed or
interrupted worker loses nothing but the trial it was running. That trial stays RUNNING in the
storage; each worker records its host, pid and process start time in the trials it runs, and a
heartbeat (the time, every HEARTBEAT_S), so the next worker on that host sees the worker is
gone, and a worker on any host sees a heartbeat older than STALE_AFTER_S (the hosts' clocks
must agree to within minutes, as NTP keeps them). It tells the trial FAIL ("interrupted") and
enqueues its parameters again, up to MAX_LOST_WORKERS times: parameters whose worker died that
often (a trial that takes the machine's memory with it) fail for good instead of looping.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.tune.space import Param, grid_search_space

STUDY_MARKER = ".slipstream-study"
LOCK_FILE = ".slipstream-study-lock"
# Failure reasons that are not the trial's fault: such trials are run again and do not count.
NOT_COUNTED = ("interrupted", "budget")
# Trials the median pruner lets finish before it compares: Optuna's default of 5 would leave the
# short studies that training allows (a few dozen trials) barely pruned.
MEDIAN_STARTUP_TRIALS = 3
# Seconds a worker waits for SQLite's write lock held by another worker (the default 5 s is
# short when both tell and ask at once on a slow disk).
SQLITE_TIMEOUT_S = 60
# Seconds a database server gets to answer the connection (postgresql, mysql): an unreachable
# host would otherwise hang the worker for the operating system's TCP timeout (minutes).
CONNECT_TIMEOUT_S = 10
# A running trial's worker records the time every HEARTBEAT_S; one silent for STALE_AFTER_S is
# taken for dead by the workers of other hosts (its own host checks its pid at once).
HEARTBEAT_S = 60
STALE_AFTER_S = 600
# Times the same parameters may lose their worker (killed, crashed machine) before they fail
# for good rather than being queued again.
MAX_LOST_WORKERS = 3


def study_name(cfg) -> str:
    return cfg.tune.study_name or cfg.run.name


def study_dir(cfg, name: str) -> Path:
    return Path(cfg.tune.dir).expanduser() if cfg.tune.dir else Path("runs") / f"tune-{name}"


def storage_url(storage: str, folder: Path) -> str:
    """tune.storage, or the SQLite file of the study folder (an absolute path: the URL is printed
    for optuna-dashboard and recorded in study.json, to be opened from anywhere)."""
    if storage:
        return storage
    from sqlalchemy.engine import URL

    # Rendered by SQLAlchemy: a '?' or '%' in the folder's path is escaped (in an f-string the
    # '?' began the URL's query, and the database was another file).
    return URL.create("sqlite", database=str((folder / "study.db").resolve())).render_as_string()


def _marked_study(folder: Path) -> str | None:
    """The study name the folder's marker records, else its study.json (a folder of an earlier
    slipstream, whose marker holds no name); None: neither says (or the marker is still being
    written by a worker that created it a moment ago)."""
    for name in (STUDY_MARKER, "study.json"):
        with contextlib.suppress(OSError, ValueError, AttributeError), open(folder / name, "rb") as f:
            study = json.loads(f.read(1 << 20)).get("study_name")  # a few KiB, whatever the file holds
            if isinstance(study, str):
                return study
    return None


def prepare_study_dir(folder: Path, name: str) -> None:
    """Create (or check) the folder of the study `name`: a non-empty folder without slipstream's
    study marker is someone else's and is refused, so no file of theirs is overwritten; a folder
    of another study is refused too (one study per folder: its trial_NNNN run directories,
    study.json and trial.json files would be the other study's)."""
    if folder.exists() and not folder.is_dir():
        raise UserError(f"study folder '{folder}' exists and is not a folder; choose another --tune.dir")
    if folder.is_dir() and not (folder / STUDY_MARKER).is_file() and any(folder.iterdir()):
        raise UserError(f"study folder '{folder}' is not empty and was not created by slipstream (no {STUDY_MARKER}); "
                        "choose a new or empty --tune.dir")
    other = _marked_study(folder) if folder.is_dir() else None
    if other is not None and other != name:
        raise UserError(f"study folder '{folder}' holds the study '{other}', not '{name}'; give each study its own "
                        f"folder (--tune.dir=NEW_FOLDER), or continue '{other}' with --tune.study_name={other}")
    try:
        folder.mkdir(parents=True, exist_ok=True)
        # Created in one step (no temp file beside it: a second worker starting now must see
        # either an empty folder or the marker, which it may read before its content is written).
        with contextlib.suppress(FileExistsError), open(folder / STUDY_MARKER, "x", encoding="utf-8") as f:
            f.write(json.dumps({"created_by": "slipstream tune hparams", "study_name": name}) + "\n")
    except OSError as e:
        raise UserError(f"cannot create the study folder '{folder}' ({e.strerror}); choose another --tune.dir") \
            from None


def _shown(url: str) -> str:
    """The URL as printed in errors: its password hidden."""
    with contextlib.suppress(Exception):
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    return url


def _creation_race(error: Exception) -> bool:
    """An error of two processes creating one database's tables at once (a duplicate row or
    table, a lock), which a second try gets past."""
    text = str(error).lower()
    return type(error).__name__ in ("IntegrityError", "OperationalError") and any(
        word in text for word in ("unique constraint", "already exists", "locked", "duplicate"))


def resolve_url(url: str) -> str:
    """The storage URL with its file made absolute (journal:PATH, sqlite:///PATH), so that the URL
    printed for optuna-dashboard and recorded in study.json and trial.json opens from any folder.
    The folder of an SQLite file must exist (SQLite's own error says only "unable to open")."""
    if url.startswith("journal:"):
        path = url[len("journal:"):]
        return f"journal:{Path(path).expanduser().resolve()}" if path.strip() else url
    if not url.startswith("sqlite"):
        return url
    try:
        from sqlalchemy.engine import make_url

        parsed = make_url(url)
    except Exception:  # noqa: BLE001 - not a URL: open_storage says so
        return url
    database = parsed.database
    if not database or database == ":memory:" or database.startswith("file:"):
        return url
    path = Path(database).expanduser().resolve()
    if not path.parent.is_dir():
        raise UserError(f"storage '{url}': the folder {path.parent} of the SQLite file does not exist; create it "
                        "or name a file in an existing folder")
    return parsed.set(database=str(path)).render_as_string(hide_password=False)


def _engine_kwargs(url: str) -> dict[str, Any] | None:
    """SQLAlchemy engine options: SQLite waits for the other workers' write lock; a database
    server must answer within CONNECT_TIMEOUT_S (unless the URL sets connect_timeout)."""
    backend = url.split(":", 1)[0].split("+", 1)[0]
    if backend == "sqlite":
        return {"connect_args": {"timeout": SQLITE_TIMEOUT_S}}
    if backend in ("postgresql", "mysql", "mariadb") and "connect_timeout" not in url:
        return {"connect_args": {"connect_timeout": CONNECT_TIMEOUT_S}}
    return None


def open_storage(url: str):
    """The Optuna storage of a URL; any failure to reach or open it is a UserError naming it."""
    import optuna

    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend, JournalStorage

        path = Path(url[len("journal:"):]).expanduser()
        if not url[len("journal:"):] or path.is_dir() or not path.parent.is_dir():
            raise UserError(f"storage '{url}': journal:PATH needs a file in an existing folder, e.g. "
                            "journal:runs/tune-x/study.log")
        try:
            return JournalStorage(JournalFileBackend(str(path)))
        except OSError as e:
            raise UserError(f"storage '{url}' cannot be opened ({e.strerror}); choose a writable journal:PATH") \
                from None
    engine_kwargs = _engine_kwargs(url)
    try:
        try:
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
        except Exception as e:  # noqa: BLE001 - see below
            if not _creation_race(e):
                raise
            time.sleep(1.0)  # workers started together race to create the tables: the other one won
            return optuna.storages.RDBStorage(url, engine_kwargs=engine_kwargs)
    except Exception as e:  # noqa: BLE001 - bad scheme, missing driver, refused connection, unwritable file...
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise UserError(f"cannot open the study storage '{_shown(url)}' ({type(e).__name__}: {reason[:300]}); give a "
                        "reachable SQLAlchemy URL (sqlite:///path/study.db, postgresql://user@host/db) or "
                        "journal:PATH with --storage or tune.storage") from None


def make_sampler(name: str, seed: int, space: dict[str, Param], grid_points: int):
    """tpe, random, grid or cmaes, seeded (the tuner reseeds it per trial: see seed_for_trial)."""
    import optuna

    if name == "tpe":
        return optuna.samplers.TPESampler(seed=seed)
    if name == "random":
        return optuna.samplers.RandomSampler(seed=seed)
    if name == "grid":
        conditional = [key for key, param in space.items() if param.when]
        if conditional:
            # The grid is every combination of every parameter: the points that differ only in
            # a parameter its condition leaves out would train the same configuration again.
            raise UserError(f"tune.sampler = grid cannot search a conditional space ({conditional[0]} has when = ...): "
                            "the grid would train the same configuration once per value of the parameter its "
                            "condition leaves out; use tune.sampler = tpe or random, or one study per branch")
        return optuna.samplers.GridSampler(grid_search_space(space, grid_points), seed=seed)
    if name == "cmaes":
        # CMA-ES samples real and integer ranges; choices fall back to independent sampling.
        return optuna.samplers.CmaEsSampler(seed=seed, warn_independent_sampling=False)
    raise UserError(f"tune.sampler = {name!r}: choose tpe, random, grid or cmaes")


def seed_for_trial(seed: int, number: int) -> int:
    """A sampler seed for the trial about to be asked: a function of tune.seed and the trials
    so far, so one worker repeats its study exactly while two workers never draw alike. Not for
    the grid: Optuna's GridSampler shuffles its points by its seed and gives trial N the N-th,
    so every worker and every trial must see the one order (tune.seed), or points repeat."""
    return (seed * 1_000_003 + number) % 2**32


def make_pruner(name: str):
    """The pruner; the warm-up (tune.prune_warmup_evals) is counted by the tuner in evaluations."""
    import optuna

    if name == "median":
        return optuna.pruners.MedianPruner(n_startup_trials=MEDIAN_STARTUP_TRIALS)
    if name == "halving":
        return optuna.pruners.SuccessiveHalvingPruner()
    if name == "hyperband":
        return optuna.pruners.HyperbandPruner()
    if name == "none":
        return optuna.pruners.NopPruner()
    raise UserError(f"tune.pruner = {name!r}: choose median, halving, hyperband or none")


def open_study(storage, url: str, name: str, directions: list[str], sampler, pruner, resume: bool,
               meta: dict[str, Any]) -> tuple[Any, list[str]]:
    """Create the study, or with `resume` continue it (starting it when it does not exist yet:
    that is how extra workers join). Returns the study and notes for the console. `meta` (the
    objective, the space) is stored with a new study and compared on resume."""
    import optuna

    notes = []
    exists = name in {s.study_name for s in storage.get_all_studies()}
    if exists and not resume:
        raise UserError(f"a study named '{name}' already exists in {_shown(url)}; continue it with --resume, or start "
                        "another with --tune.study_name=NEW_NAME (and its own --tune.dir, if you gave one)")
    if not exists:
        try:
            study = optuna.create_study(storage=storage, sampler=sampler, pruner=pruner, study_name=name,
                                        directions=directions)
            study.set_user_attr("slipstream", meta)
            if resume:
                notes.append(f"--resume: no study named '{name}' yet; started it")
            return study, notes
        except optuna.exceptions.DuplicatedStudyError:
            if not resume:  # another worker created it a moment ago
                raise UserError(f"a study named '{name}' was just created by another worker; join it with --resume") \
                    from None
    study = optuna.load_study(study_name=name, storage=storage, sampler=sampler, pruner=pruner)
    theirs = [d.name.lower() for d in study.directions]
    stored = study.user_attrs.get("slipstream", {})
    if theirs != directions or stored.get("objective", meta["objective"]) != meta["objective"]:
        raise UserError(f"the study '{name}' optimizes {stored.get('objective', theirs)} but tune.objective = "
                        f"{meta['objective']}; use --tune.objective={stored.get('objective', '...')} to continue it, "
                        "or another --tune.study_name")
    if stored.get("space") not in (None, meta["space"]):
        notes.append("the search space differs from the one the study started with; the sampler sees both")
    if stored.get("training") not in (None, meta.get("training")):
        then = " ".join(stored["training"]) or "none"
        notes.append(f"the training overrides differ from the ones the study started with ({then}); its trials "
                     "are ranked together all the same")
    return study, notes


@contextlib.contextmanager
def study_lock(folder: Path) -> Iterator[None]:
    """Serialize the workers of this study folder while they count and ask (or recover) trials,
    so two workers never start trial N+1 of N. Workers on other hosts with their own folders
    are not serialized: each may overshoot the count by the trials it has running."""
    with open(folder / LOCK_FILE, "a+", encoding="utf-8") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def process_start(pid: int) -> str | None:
    """The start time of a process (field 22 of /proc/PID/stat), telling a reused pid from the
    process we saw; None where there is no /proc or no such process."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def process_alive(pid: int, started: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: alive, and ours only if its start time is the one recorded
    now = process_start(pid)
    return started is None or now is None or now == started


def worker_attrs() -> dict[str, Any]:
    """What identifies this worker in the trials it runs, and its first heartbeat."""
    return {"worker_host": socket.gethostname(), "worker_pid": os.getpid(), "worker_start": process_start(os.getpid()),
            "heartbeat": time.time()}


def heartbeat(trial) -> Callable[[], None]:
    """A function to call often while `trial` runs: it records the time in the trial every
    HEARTBEAT_S, so workers on other hosts can tell this worker is alive."""
    last = time.monotonic()

    def beat() -> None:
        nonlocal last
        if time.monotonic() - last < HEARTBEAT_S:
            return
        last = time.monotonic()
        # A busy or briefly unreachable storage must not stop the trial: the next beat retries,
        # and only STALE_AFTER_S of silence (ten beats) counts as death.
        with contextlib.suppress(Exception):
            trial.set_user_attr("heartbeat", time.time())
    return beat


def is_counted(trial) -> bool:
    """A finished trial that counts toward --trials: complete, pruned, or failed by its own
    fault (not interrupted with its worker, nor cut by the worker's budget)."""
    from optuna.trial import TrialState

    if trial.state in (TrialState.COMPLETE, TrialState.PRUNED):
        return True
    return trial.state == TrialState.FAIL and trial.user_attrs.get("fail_reason") not in NOT_COUNTED


def counted_and_running(study) -> tuple[int, int]:
    from optuna.trial import TrialState

    trials = study.get_trials(deepcopy=False)
    return sum(map(is_counted, trials)), sum(t.state == TrialState.RUNNING for t in trials)


def _trial_id(storage, study, number: int) -> int:
    return storage.get_trial_id_from_study_id_trial_number(storage.get_study_id_from_name(study.study_name), number)


def set_trial_attr(storage, study, number: int, key: str, value: Any) -> None:
    """A user attr of any trial of the study (also one that another, dead, worker started);
    `storage` is the one the study was opened with."""
    storage.set_trial_user_attr(_trial_id(storage, study, number), key, value)


def tell(study, trial, values=None, state=None) -> None:
    """study.tell, stored whatever the sampler says after it: the grid sampler asks the study to
    stop after its last point, which only an optimize() loop can do (a RuntimeError here)."""
    try:
        study.tell(trial, values, state=state, skip_if_finished=True)
    except RuntimeError as e:
        if "Study.stop" not in str(e):
            raise


def fail_and_requeue(storage, study, number: int, reason: str, lost_worker: bool = False) -> str:
    """Tell a trial FAIL for a reason that is not its own (interrupted, budget) and enqueue its
    parameters, so the study runs that point again instead of losing it. `lost_worker`: its
    worker died (not a Ctrl-C, SIGTERM or budget it handled); the MAX_LOST_WORKERS-th death of
    the same parameters fails them for good (counted, not queued). Returns the reason recorded."""
    from optuna.trial import TrialState

    frozen = storage.get_trial(_trial_id(storage, study, number))
    lost = frozen.user_attrs.get("lost_workers", 0)
    lost = (lost if isinstance(lost, int) else 0) + int(lost_worker)
    if lost >= MAX_LOST_WORKERS:
        reason = (f"its worker died {lost} times running these parameters (killed for memory? see the trial's "
                  "trial.stderr); not queued again")
    set_trial_attr(storage, study, number, "fail_reason", reason)
    tell(study, number, state=TrialState.FAIL)
    if lost < MAX_LOST_WORKERS:
        study.enqueue_trial(frozen.params, user_attrs={"requeued_from": number, "lost_workers": lost})
    return reason


def _stop_orphan(attrs: dict[str, Any]) -> None:
    """A dead worker's trial process, if it is still running (it should die with its worker)."""
    pid, started = attrs.get("trial_pid"), attrs.get("trial_start")
    if isinstance(pid, int) and started is not None and process_start(pid) == started:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)  # the trial runs in its own session: its group is its pid


def _worker_gone(attrs: dict[str, Any], host: str) -> bool:
    """Whether the worker that runs a trial is dead: by its pid on this host, by a heartbeat
    older than STALE_AFTER_S on another. A trial without our attrs is never judged."""
    if attrs.get("worker_host") == host and isinstance(attrs.get("worker_pid"), int):
        return not process_alive(attrs["worker_pid"], attrs.get("worker_start"))
    beat = attrs.get("heartbeat")
    return isinstance(beat, (int, float)) and time.time() - beat > STALE_AFTER_S


def recover_interrupted(storage, study) -> dict[int, str]:
    """Fail ("interrupted") and requeue the RUNNING trials whose worker is gone. Call under
    study_lock. Returns their numbers and the reasons recorded."""
    from optuna.trial import TrialState

    host, recovered = socket.gethostname(), {}
    for trial in study.get_trials(deepcopy=False, states=(TrialState.RUNNING,)):
        attrs = trial.user_attrs
        if not _worker_gone(attrs, host):
            continue
        if attrs.get("worker_host") == host:
            _stop_orphan(attrs)  # another host's trial cannot be stopped from here (it dies with its worker)
        recovered[trial.number] = fail_and_requeue(storage, study, trial.number, "interrupted", lost_worker=True)
    return recovered
