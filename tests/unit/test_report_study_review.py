"""Regression tests from the review of the study and ladder pages of `slipstream report` and of
the browser test setup: each test failed before its fix."""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import subprocess
from pathlib import Path

import pytest

from slipstream.errors import UserError
from slipstream.report.ladder import ladder_sections
from slipstream.report.study import study_sections
from tests.browser import external_references
from tests.unit.test_report_study import BENCHMARKS, PRUNED_STUDY, make_study

ROOT = Path(__file__).resolve().parents[2]


def _html(sections) -> dict[str, str]:
    return {s.key: "".join(s.parts) for s in sections}


def _snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and modification time."""
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


# ---------------------------------------------------------------------------- reading a study never writes


@pytest.mark.parametrize("name", ["tune#2", "tune?2", "lr 50%20"])
def test_a_study_folder_named_with_url_characters_is_read_and_nothing_is_created(tmp_path, name):
    """The database was opened as `sqlite:///file:PATH?mode=ro&uri=true`: a '#' or '?' in PATH
    cut it short and dropped mode=ro, so SQLite created a database next to the folder (and Optuna
    its tables); a '%' was decoded and the file not found."""
    folder = make_study(tmp_path / "plain", PRUNED_STUDY[:2]).rename(tmp_path / name)
    before = _snapshot(tmp_path)
    parts = _html(study_sections(folder))
    assert parts["study-trials"].count("<tr>") == 3
    assert _snapshot(tmp_path) == before


def test_a_storage_url_with_a_query_is_read(tmp_path):
    """`sqlite:///PATH?timeout=60` (a tune.storage the tuner opens) was taken as a file named
    'study.db?timeout=60'."""
    folder = make_study(tmp_path / "s", PRUNED_STUDY[:2])
    record = json.loads((folder / "study.json").read_text())
    (folder / "study.json").write_text(json.dumps(dict(record, storage=record["storage"] + "?timeout=60")))
    assert _html(study_sections(folder))["study-trials"].count("<tr>") == 3


def test_reading_leaves_wal_and_journal_storages_as_they_were(tmp_path):
    """A read-only connection to a WAL-mode database left -wal and -shm files beside it."""
    wal = make_study(tmp_path / "wal", PRUNED_STUDY[:2])
    with contextlib.closing(sqlite3.connect(wal / "study.db")) as db:
        assert db.execute("PRAGMA journal_mode=wal").fetchone() == ("wal",)
    journal = make_study(tmp_path / "journal", PRUNED_STUDY[:2], journal=True)
    before = _snapshot(tmp_path)
    for folder in (wal, journal):
        assert _html(study_sections(folder))["study-trials"].count("<tr>") == 3
    assert _snapshot(tmp_path) == before


def test_a_file_that_is_no_optuna_storage_is_a_user_error_and_stays_unwritten(tmp_path):
    """A damaged journal raised a TypeError from Optuna's replay; a foreign SQLite database got
    Optuna's tables (refused only by mode=ro)."""
    folder = make_study(tmp_path / "s", [], journal=True)
    (folder / "study.log").write_text('5\n{"op_code": 0}\n')
    with pytest.raises(UserError, match="cannot read the study 'demo'"):
        study_sections(folder)

    other = make_study(tmp_path / "other", [])
    (other / "study.db").unlink()
    with contextlib.closing(sqlite3.connect(other / "study.db")) as db:
        db.execute("CREATE TABLE mine (x)")
        db.commit()
    before = _snapshot(tmp_path)
    with pytest.raises(UserError, match="not an Optuna storage"):
        study_sections(other)
    assert _snapshot(tmp_path) == before


def test_hostile_study_json_and_storage_files_are_user_errors(tmp_path):
    """A study.json naming a device, a FIFO or a file that is no database, or holding a number of
    more digits than Python converts (a ValueError, not a JSONDecodeError)."""
    folder = make_study(tmp_path / "s", [])
    record = json.loads((folder / "study.json").read_text())

    def report(**changes):
        (folder / "study.json").write_text(json.dumps(dict(record, **changes)))
        with pytest.raises(UserError) as error:
            study_sections(folder)
        return str(error.value)

    os.mkfifo(tmp_path / "fifo")
    assert "not a regular file" in report(storage=f"journal:{tmp_path / 'fifo'}")
    assert "not a regular file" in report(storage="journal:/dev/zero")
    (tmp_path / "passwd").write_text("root:x:0:0:root:/root:/bin/bash\n")
    assert "not an SQLite database" in report(storage=f"sqlite:///{tmp_path / 'passwd'}")
    (folder / "study.json").write_text('{"study_name": "demo", "storage": "x", "n": ' + "9" * 5000 + "}")
    with pytest.raises(UserError, match="not valid JSON"):
        study_sections(folder)


# ---------------------------------------------------------------------------- many trials, Optuna versions


def test_trials_are_fetched_a_fixed_number_of_times_however_many_there_are(tmp_path, monkeypatch):
    """The overview asked the storage for every trial once per trial (a deep copy of all of them
    each time): 1,000 trials took minutes."""
    from optuna.storages import JournalStorage

    fetches = []
    original = JournalStorage.get_all_trials
    monkeypatch.setattr(JournalStorage, "get_all_trials",
                        lambda self, *a, **k: fetches.append(1) or original(self, *a, **k))
    counts = []
    for n in (3, 12):
        trials = [{"params": {"optim.lr": 1e-4 * (i + 1), "optim.weight_decay": 0.01 * i}, "state": "complete",
                   "curve": [5.0 - 0.1 * i]} for i in range(n)]
        folder = make_study(tmp_path / f"s{n}", trials, journal=True)
        fetches.clear()
        study_sections(folder)
        counts.append(len(fetches))
    assert counts[0] == counts[1], counts


def test_importances_do_not_rely_on_optunas_default_evaluator(tmp_path, monkeypatch):
    """In Optuna 4.0 the default evaluator is fANOVA, which needs scikit-learn (not installed):
    there the whole report failed with an ImportError."""
    import optuna.importance

    original = optuna.importance.get_param_importances

    def like_optuna_4(study, *, evaluator=None, **kwargs):
        if evaluator is None:
            raise ImportError("Tried to import 'sklearn' but failed.")
        return original(study, evaluator=evaluator, **kwargs)

    monkeypatch.setattr(optuna.importance, "get_param_importances", like_optuna_4)
    parts = _html(study_sections(make_study(tmp_path / "s", PRUNED_STUDY)))
    assert 'data-figure="study-importance"' in parts["study-importance"]


def test_tied_best_trials_of_one_objective_are_one_best_trial(tmp_path):
    """Optuna's best_trials lists every trial of the best value: a single-objective study was
    said to have 'Pareto-optimal trials'."""
    tied = [{"params": {"optim.lr": lr, "optim.weight_decay": 0.1}, "state": "complete", "curve": [4.0]}
            for lr in (1e-3, 2e-3)]
    parts = _html(study_sections(make_study(tmp_path / "s", tied)))
    assert "Pareto" not in parts["study"] and re.search(r"best trial</td><td>#[01]: val_loss 4", parts["study"])
    assert parts["study-trials"].count("(best)") == 1


# ---------------------------------------------------------------------------- text from elsewhere


def test_dollar_signs_in_names_are_drawn_as_written(tmp_path):
    """A `$` in an objective or rung name was parsed as mathtext: a malformed formula failed the
    whole report with a ValueError from deep in matplotlib."""
    folder = make_study(tmp_path / "s", PRUNED_STUDY)
    record = json.loads((folder / "study.json").read_text())
    (folder / "study.json").write_text(json.dumps(dict(record, objective="$\\frac{$")))
    parts = _html(study_sections(folder))
    assert "$\\frac{$" in parts["study-history"] and "<svg" in parts["study-importance"]

    ladder = json.loads((BENCHMARKS / "ladder-speed-cpu-tiny.json").read_text())
    ladder["rungs"][1]["rung"] = "$\\frac{$"
    (tmp_path / "l.json").write_text(json.dumps(ladder))
    [section] = ladder_sections(tmp_path / "l.json")
    assert "$\\frac{$</text>" in "".join(section.parts)


def test_ladder_statistics_out_of_order_are_refused_or_not_drawn(tmp_path):
    """A min above the median (or a max below it) made negative error bars: a ValueError."""
    ladder = json.loads((BENCHMARKS / "ladder-speed-cpu-tiny.json").read_text())
    ladder["rungs"][1]["peak_bytes"] = {"median": 5.0, "min": 6.0, "max": 7.0}
    (tmp_path / "side.json").write_text(json.dumps(ladder))
    html = "".join(ladder_sections(tmp_path / "side.json")[0].parts)
    assert html.count("not measured") == 4  # the three compile rungs, and this one

    ladder["rungs"][1]["tokens_per_s"] = {"median": 5.0, "min": 1.0, "max": 4.0}
    (tmp_path / "main.json").write_text(json.dumps(ladder))
    with pytest.raises(UserError, match="'larger batch' has no median tokens_per_s"):
        ladder_sections(tmp_path / "main.json")


def test_long_free_text_is_clipped(tmp_path):
    """study.json's config, overrides and space and each trial's reason reached the page whole:
    a crafted study folder made a page of any size."""
    folder = make_study(tmp_path / "s", PRUNED_STUDY)
    record = json.loads((folder / "study.json").read_text())
    big = "x" * 200_000
    (folder / "study.json").write_text(json.dumps(dict(record, config=big, overrides=[big], space={"a": big})))
    (folder / "trials" / "trial_0002" / "trial.json").write_text(json.dumps({"reason": big}))
    parts = _html(study_sections(folder))
    assert len(parts["study"]) < 40_000 and len(parts["study-trials"]) < 20_000
    assert "more characters)" in parts["study-trials"]


# ---------------------------------------------------------------------------- the page-level check


@pytest.mark.parametrize("markup", [
    '<img src="http://example.com/x.png">', '<IMG SRC=//example.com/x.png>', '<img src="&#104;ttp://e.com/x">',
    '<picture><source srcset="http://example.com/x.png 2x"></picture>', '<img srcset="x.png 1x">',
    '<iframe src="data:text/html,x"></iframe>', '<object data="http://example.com/x.svg"></object>',
    '<embed src="x.swf">', '<video poster="http://example.com/p.png"></video>',
    '<link rel=stylesheet href="style.css">', '<script>1</script>', '<base href="http://example.com/">',
    '<svg><image href="http://example.com/x.png"/></svg>', '<svg><image xlink:href="x.png"/></svg>',
    '<svg><use href="sprite.svg#a"/></svg>', '<div style="background: url(//example.com/x)"></div>',
    "<style>@import 'x.css';</style>", "<style>p { background: image-set('x.png' 1x) }</style>",
    '<meta http-equiv="refresh" content="0; url=http://example.com/">', '<a href="https://example.com">x</a>',
])
def test_the_self_contained_check_catches_every_way_to_fetch(markup):
    """The old check (regular expressions over src/href/url()) passed <source srcset>, <object
    data>, <video poster>, a meta refresh and CSS image-set()."""
    assert external_references(f"<!DOCTYPE html><html><body>{markup}</body></html>")


def test_the_self_contained_check_passes_a_real_page(tmp_path):
    from slipstream.report.build import build_report

    page = build_report([BENCHMARKS / "ladder-speed-cpu-tiny.json", make_study(tmp_path / "s", PRUNED_STUDY)])
    assert 'xlink:href="data:image/png' in page  # the parallel plot's colour bar: inline data is fine
    assert external_references(page) == []


# ---------------------------------------------------------------------------- CI scripts


def _fake_system(tmp_path: Path, installed: dict[str, str], uid: int = 0, sudo: bool = False) -> dict[str, str]:
    """An environment whose PATH holds stand-ins for id, sudo, dpkg-query, apt-get and make that
    log their arguments (and environment) to tmp/calls; `installed` maps package -> version."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(parents=True)
    log = tmp_path / "calls"
    stubs = {
        "id": f'echo {uid}',
        "apt-get": f'echo "apt-get $* DEBIAN_FRONTEND=${{DEBIAN_FRONTEND:-}}" >> {log}',
        "make": f'echo "make $*" >> {log}',
        # dpkg-query -W -f=FORMAT PKG...: one "name version status" line per installed package.
        "dpkg-query": "rc=0; for p in \"${@:3}\"; do case $p in "
                      + "".join(f'{name}) echo "{name} {version} ii";; ' for name, version in installed.items())
                      + '*) echo "dpkg-query: no packages found matching $p" >&2; rc=1;; esac; done; exit $rc',
    }
    if sudo:
        # sudo resets the environment: the command runs with PATH only.
        stubs["sudo"] = (f'echo "sudo $*" >> {log}; [[ $1 == -n ]] && shift; [[ $1 == true ]] && exit 0; '
                         'env -i PATH="$PATH" "$@"')
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/bin/bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    # Only the stand-ins and the basic tools the scripts use (never the real apt-get or sudo).
    basics = bin_dir / "basics"
    basics.mkdir()
    for tool in ("bash", "env", "dirname", "cat", "echo", "sort", "uniq", "wc", "tr", "awk", "grep"):
        real = subprocess.run(["bash", "-c", f"command -v {tool}"], capture_output=True, text=True).stdout.strip()
        if real.startswith("/"):
            os.symlink(real, basics / tool)
    return {"PATH": f"{bin_dir}:{basics}", "HOME": str(tmp_path)}


def _run(script: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(ROOT / ".ci" / script), *args], env=env, capture_output=True, text=True, timeout=60)


def test_install_chromium_as_root_updates_then_installs_without_questions(tmp_path):
    env = _fake_system(tmp_path, installed={})
    proc = _run("install-chromium", env)
    calls = (tmp_path / "calls").read_text().splitlines()
    assert proc.returncode != 0  # the stand-in apt-get installs nothing: said, not passed over
    assert "still not installed" in proc.stderr
    assert calls[0].startswith("apt-get") and " update" in calls[0] and calls[0].endswith("=noninteractive")
    assert "install -y --no-install-recommends chromium chromium-driver" in calls[1]
    assert calls[1].endswith("DEBIAN_FRONTEND=noninteractive")


def test_install_chromium_through_sudo_keeps_debian_frontend(tmp_path):
    """sudo resets the environment: the exported DEBIAN_FRONTEND never reached apt-get."""
    env = _fake_system(tmp_path, installed={}, uid=1000, sudo=True)
    _run("install-chromium", env)
    apt = [line for line in (tmp_path / "calls").read_text().splitlines() if line.startswith("apt-get")]
    assert len(apt) == 2 and all(line.endswith("DEBIAN_FRONTEND=noninteractive") for line in apt)


def test_install_chromium_without_root_or_sudo_says_what_to_run(tmp_path):
    env = _fake_system(tmp_path, installed={}, uid=1000)
    proc = _run("install-chromium", env)
    assert proc.returncode == 1 and "apt-get install" in proc.stderr and "chromium-driver" in proc.stderr
    assert not (tmp_path / "calls").exists()


def test_install_chromium_checks_the_driver_matches_the_browser(tmp_path):
    """The check was "both files exist": a chromium upgraded without its driver passed."""
    same = {"chromium": "150.0.7871.100-1~deb12u1", "chromium-driver": "150.0.7871.100-1~deb12u1"}
    proc = _run("install-chromium", _fake_system(tmp_path / "a", installed=same))
    assert proc.returncode == 0 and "150.0.7871.100-1~deb12u1" in proc.stdout
    assert not (tmp_path / "a" / "calls").exists()  # nothing to do: no apt-get at all

    older_driver = dict(same, **{"chromium-driver": "149.0.1-1~deb12u1"})
    proc = _run("install-chromium", _fake_system(tmp_path / "b", installed=older_driver))
    assert "install -y" in (tmp_path / "b" / "calls").read_text()  # brought into step by apt-get
    assert proc.returncode != 0 and "149.0.1-1~deb12u1" in proc.stderr  # the stand-in apt-get did not


def test_ci_run_installs_what_a_fresh_debian_lacks_then_runs_make_test(tmp_path):
    """A fresh Debian 12 has neither make nor python3-venv (`python3 -m venv` fails without it)."""
    versions = {name: "1" for name in ("chromium", "chromium-driver", "make", "python3", "python3-venv")}
    env = _fake_system(tmp_path / "all", installed=versions)
    proc = _run("run", env)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "all" / "calls").read_text().splitlines() == ["make test"]

    del versions["python3-venv"]
    env = _fake_system(tmp_path / "fresh", installed=versions)
    proc = _run("run", env)
    calls = (tmp_path / "fresh" / "calls").read_text()
    assert "python3-venv" in calls and "make test" not in calls and proc.returncode != 0


def test_importances_of_a_small_study_are_flagged_as_anecdotal(tmp_path):
    """`tune hparams` prints no importances below MIN_IMPORTANCE_TRIALS complete trials; the page
    still draws them but says how little they mean, and a big enough study carries no such note."""
    from slipstream.tune.hparams_report import MIN_IMPORTANCE_TRIALS

    small = _html(study_sections(make_study(tmp_path / "small", PRUNED_STUDY)))["study-importance"]
    assert "anecdotal" in small
    big_trials = [{"params": {"optim.lr": 1e-4 * (i + 1), "optim.weight_decay": 0.01 * i}, "state": "complete",
                   "curve": [5.0 - 0.1 * i, 4.0 - 0.1 * i]} for i in range(MIN_IMPORTANCE_TRIALS)]
    big = _html(study_sections(make_study(tmp_path / "big", big_trials)))["study-importance"]
    assert "anecdotal" not in big and 'data-figure="study-importance"' in big
