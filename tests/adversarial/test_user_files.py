"""Adversarial: slipstream never deletes or overwrites a file it did not write.

- `data prepare` into a folder of the user's: only the files its old manifest lists go;
  an input inside the output folder is refused.
- `train` into a folder slipstream did not create is refused (its .slipstream-run marker is
  missing); a new run in a marked folder moves the previous run's results into
  history/<n>/; a resume continues its own metrics; a second run in a folder that is in use
  names the holder's pid and host, and a killed holder blocks nothing.
- every named output (`--out`, `--out-dir`, `--write-config`) refuses an existing file
  without --force and replaces it atomically with it.

CLI cases check the exit code, the one `error:` line (no traceback) and that nothing outside
the command's own outputs changed. Commands that must stop before any work run in this
process (`slipstream.cli.main`), which keeps them fast.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest

from slipstream.config import load_config
from slipstream.data import prepare_dataset
from slipstream.errors import UserError
from slipstream.train.lm import train_lm
from slipstream.train.rundir import LOCK, MARKER, on_rank0
from tests.adversarial.conftest import ROOT, assert_unchanged, assert_user_error, run_cli, tree_snapshot

USER_BYTES = b"the user's own file\n"


def _main(argv, capsys):
    """`slipstream ARGV` in this process, as a CompletedProcess-like object."""
    from slipstream.cli import main

    code = main([str(a) for a in argv])
    captured = capsys.readouterr()
    return SimpleNamespace(returncode=code, stdout=captured.out, stderr=captured.err)


def _manifest(folder: Path) -> dict:
    return json.loads((folder / "manifest.json").read_text())


def _listed(manifest: dict) -> set[str]:
    return {s["file"] for info in manifest["splits"].values() for s in info["shards"]}


# --- data prepare ------------------------------------------------------------------------

def test_prepare_again_keeps_user_files_and_replaces_only_its_own(tmp_path, capsys):
    a, b = tmp_path / "a.txt", tmp_path / "b.txt"
    a.write_text("alpha beta gamma\n" * 3000)
    b.write_text("a different corpus, shorter\n" * 500)
    out = tmp_path / "data"
    # Small shards: the old build has more shards than the new one will have.
    prepare_dataset([str(a)], "byte", str(out), val_fraction=0.1, shard_tokens=8192, num_workers=1, progress=False)
    old = _listed(_manifest(out))
    assert len(old) > 3
    (out / "notes.txt").write_bytes(USER_BYTES)
    (out / "mine").mkdir()
    (out / "mine" / "train_000000.bin").write_bytes(USER_BYTES)  # a name like a shard, in a subfolder
    user_before = tree_snapshot(tmp_path, exclude=("data/manifest.json", *(f"data/{n}" for n in old)))

    proc = _main(["data", "prepare", "--input", b, "--out", out, "--quiet", "--workers", "1",
                  "--val-fraction", "0.1"], capsys)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    new = _listed(_manifest(out))
    after = tree_snapshot(tmp_path, exclude=("data/manifest.json", *(f"data/{n}" for n in new)))
    assert_unchanged(user_before, after)  # user files kept, every old shard the new data does not reuse gone
    assert sorted(p.name for p in out.iterdir()) == sorted({"manifest.json", "notes.txt", "mine", *new})
    # The new data is exactly what a fresh prepare of b gives.
    fresh = tmp_path / "fresh"
    prepare_dataset([str(b)], "byte", str(fresh), val_fraction=0.1, num_workers=1, progress=False)
    assert new == _listed(_manifest(fresh))
    for name in new:
        assert (out / name).read_bytes() == (fresh / name).read_bytes(), name
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp folder left


def test_prepare_refuses_to_overwrite_an_unlisted_user_file(tmp_path, capsys, corpus_file):
    small = tmp_path / "small.txt"
    small.write_text("tiny\n" * 100)
    out = tmp_path / "data"
    prepare_dataset([str(small)], "byte", str(out), val_fraction=0.0, num_workers=1, progress=False)
    assert _listed(_manifest(out)) == {"train_000000.bin"}
    (out / "val_000000.bin").write_bytes(USER_BYTES)  # the user's, and the new build writes that name
    before = tree_snapshot(tmp_path)
    proc = _main(["data", "prepare", "--input", corpus_file, "--out", out, "--quiet", "--workers", "1"], capsys)
    assert_user_error(proc, "val_000000.bin", "does not list")
    assert_unchanged(before, tree_snapshot(tmp_path))


def test_prepare_refuses_an_input_inside_the_output(tmp_path, capsys, corpus_file):
    out = tmp_path / "data"
    prepare_dataset([str(corpus_file)], "byte", str(out), val_fraction=0.1, num_workers=1, progress=False)
    (out / "corpus.txt").write_text("text the user keeps next to the shards\n" * 200)
    before = tree_snapshot(tmp_path)
    for inputs in ([out / "corpus.txt"], [out]):
        proc = _main(["data", "prepare", "--input", *inputs, "--out", out, "--quiet", "--workers", "1"], capsys)
        assert_user_error(proc, "inside the output folder")
        assert_unchanged(before, tree_snapshot(tmp_path))


# --- train: marker, history, resume --------------------------------------------------------

def test_train_refuses_a_folder_slipstream_did_not_create(tmp_path, data_dir):
    folder = tmp_path / "experiment"
    folder.mkdir()
    config = folder / "config.toml"
    config.write_text('[model]\npreset = "tiny"\n\n[train]\nmax_steps = 2\nmicro_batch_size = 2\nseq_len = 16\n')
    (folder / "metrics.jsonl").write_text('{"step": 1, "loss": 3.0}\n')
    (folder / "summary.json").write_text('{"final_loss": 3.0}\n')
    before = tree_snapshot(tmp_path)
    proc = run_cli("train", "--config", config, f"--run.dir={folder}", f"--data.dir={data_dir}",
                   "--logging.progress=false", cwd=tmp_path)
    assert_user_error(proc, "not created by slipstream", MARKER, "--run.dir")
    assert_unchanged(before, tree_snapshot(tmp_path))


def test_a_new_run_in_a_marked_folder_keeps_the_previous_history(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    first = tiny_overrides + ["--train.max_steps=4", "--checkpoint.save_final=false"]
    train_lm(load_config(None, first))
    assert (run / MARKER).is_file()
    kept = {name: (run / name).read_bytes() for name in ("config.toml", "metrics.jsonl", "summary.json", "env.json")}

    train_lm(load_config(None, tiny_overrides + ["--train.max_steps=3", "--checkpoint.save_final=false"]))
    for name, data in kept.items():
        assert (run / "history" / "1" / name).read_bytes() == data, name
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert max(steps) == 3 and steps[0] == 1  # the new run's own metrics, from its first step
    assert json.loads((run / "summary.json").read_text())["steps"] == 3


def test_resume_in_the_same_folder_continues_its_own_metrics(tiny_overrides, tmp_path):
    run = tmp_path / "run"
    train_lm(load_config(None, tiny_overrides + ["--train.max_steps=8", "--checkpoint.interval=4"]))
    head = (run / "metrics.jsonl").read_text().splitlines()
    summary = train_lm(load_config(None, tiny_overrides + ["--checkpoint.resume=auto"]))
    assert summary["steps_this_run"] == 4
    lines = (run / "metrics.jsonl").read_text().splitlines()
    assert lines[:len(head)] == head  # the records up to the checkpoint are the first run's, untouched
    assert max(json.loads(line)["step"] for line in lines) == 12
    assert not (run / "history").exists()


# --- train: one run at a time ----------------------------------------------------------------

HOLD_LOCK = ("import sys, time\nfrom pathlib import Path\nfrom slipstream.train.rundir import lock_run_dir\n"
             "lock = lock_run_dir(Path(sys.argv[1]))\nprint('locked', flush=True)\ntime.sleep(300)\n")


def test_second_run_names_the_holder_and_a_killed_holder_blocks_nothing(tmp_path, data_dir):
    run = tmp_path / "run"
    run.mkdir()
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(run)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert holder.stdout.readline().strip() == "locked"
        args = ["train", "--model.preset=tiny", f"--data.dir={data_dir}", f"--run.dir={run}", "--train.max_steps=2",
                "--train.micro_batch_size=2", "--train.seq_len=16", "--train.eval_steps=0", "--logging.progress=false"]
        before = tree_snapshot(tmp_path)
        proc = run_cli(*args, cwd=tmp_path)
        assert_user_error(proc, "in use by another run", f"pid {holder.pid}", socket.gethostname())
        assert_unchanged(before, tree_snapshot(tmp_path))
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # The dead holder's lock file is still there; the kernel released its lock.
    assert f"pid {holder.pid}" in (run / LOCK).read_text()
    proc = run_cli(*args, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (run / "summary.json").is_file() and f"pid {holder.pid}" not in (run / LOCK).read_text()


def test_other_ranks_raise_rank0s_verdict():
    """Distributed: rank 0 alone checks the run dir; every other rank raises its error instead
    of waiting for it in a later collective."""
    error = "run directory 'x' is in use by another run (pid 7 on host h)"

    class Rank:
        def __init__(self, main):
            self.is_main = main

        def broadcast(self, value):  # rank 0 sends, the others receive its value
            return value if self.is_main else error

    calls = []
    with pytest.raises(UserError, match="in use"):
        on_rank0(Rank(False), calls.append, "not called")
    assert calls == []

    def refuse(_):
        raise UserError(error)

    with pytest.raises(UserError, match="in use"):
        on_rank0(Rank(True), refuse, None)
    assert on_rank0(Rank(True), lambda v: v + 1, 1) == 2


# --- named outputs -----------------------------------------------------------------------------

def _named_output_commands(tmp_path: Path, corpus: Path, out: Path) -> dict[str, list]:
    config = tmp_path / "tiny.toml"
    config.write_text('[model]\npreset = "tiny"\n')
    return {
        "train-tokenizer": ["data", "train-tokenizer", "--input", corpus, "--vocab-size", "300", "--out", out],
        "probe": ["probe", "--sections", "memory", "--device", "cpu", "--out", out],
        "plan": ["plan", "--model", "gpt2", "--gpus", "1xH100", "--seq", "1024", "--global-batch", "8",
                 "--write-config", out],
        "tune": ["tune", "system", "--config", config, "--write-config", out],
        "bench overhead": ["bench", "overhead", "--out", out],
        "bench sharding": ["bench", "sharding", "--out", out],
        "bench checkpoint": ["bench", "checkpoint", "--out", out],
        "bench fused-ce": ["bench", "fused-ce", "--out", out],
        "bench planner": ["bench", "planner", "--out", out],
        "bench ladder": ["bench", "ladder", "memory", "--out-dir", out.parent],
    }


NAMED = ["train-tokenizer", "probe", "plan", "tune", "bench overhead", "bench sharding", "bench checkpoint",
         "bench fused-ce", "bench planner", "bench ladder"]


@pytest.mark.parametrize("name", NAMED)
def test_named_output_refuses_an_existing_file(name, tmp_path, capsys, corpus_file):
    out = tmp_path / "out" / ("ladder-memory-cpu-tiny.json" if name == "bench ladder" else "result.file")
    out.parent.mkdir()
    out.write_bytes(USER_BYTES)
    argv = _named_output_commands(tmp_path, corpus_file, out)[name]
    before = tree_snapshot(tmp_path)
    proc = _main(argv, capsys)
    assert_user_error(proc, "already exists", "--force")
    assert_unchanged(before, tree_snapshot(tmp_path))


@pytest.mark.parametrize("name", ["train-tokenizer", "probe", "plan"])
def test_force_replaces_the_file_atomically(name, tmp_path, capsys, corpus_file):
    out = tmp_path / "out" / "result.file"
    out.parent.mkdir()
    out.write_bytes(USER_BYTES)
    inode = out.stat().st_ino
    argv = _named_output_commands(tmp_path, corpus_file, out)[name]
    before = tree_snapshot(tmp_path, exclude=("out",))
    proc = _main([*argv, "--force"], capsys)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    text = out.read_text()
    json.loads(text) if name != "plan" else tomllib.loads(text)  # a whole new file
    assert out.stat().st_ino != inode  # renamed into place, never rewritten in place
    assert [p.name for p in out.parent.iterdir()] == ["result.file"]  # no temp file left
    assert_unchanged(before, tree_snapshot(tmp_path, exclude=("out",)))


def test_an_output_that_is_the_commands_input_is_refused_even_with_force(tmp_path, capsys, corpus_file):
    corpus = tmp_path / "corpus.txt"
    corpus.write_bytes(corpus_file.read_bytes())
    config = tmp_path / "tiny.toml"
    config.write_text('[model]\npreset = "tiny"\n')
    before = tree_snapshot(tmp_path)
    proc = _main(["data", "train-tokenizer", "--input", corpus, "--out", corpus, "--force"], capsys)
    assert_user_error(proc, "one of the inputs")
    proc = _main(["tune", "system", "--config", config, "--write-config", config, "--force"], capsys)
    assert_user_error(proc, "the --config it would extend")
    assert_unchanged(before, tree_snapshot(tmp_path))


def test_a_run_directory_of_an_older_slipstream_is_still_resumable(tmp_path):
    """Written before the marker existed (config.toml + checkpoints with meta.json): accepted, so a
    job requeued after an upgrade resumes; a folder that merely has a config.toml is not."""
    from slipstream.errors import UserError
    from slipstream.train.rundir import check_run_dir

    old = tmp_path / "old-run"
    (old / "checkpoints" / "step_00000004").mkdir(parents=True)
    (old / "config.toml").write_text("[train]\n")
    (old / "checkpoints" / "step_00000004" / "meta.json").write_text("{}")
    check_run_dir(old)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "config.toml").write_text("mine")
    with pytest.raises(UserError, match="slipstream-run"):
        check_run_dir(tmp_path / "user")


def test_an_unexpected_failure_on_rank0_is_raised_on_every_rank():
    """Not only UserErrors: any failure of rank 0 reaches the others (they would wait forever)."""
    from slipstream.errors import UserError
    from slipstream.train.rundir import on_rank0

    class Rank:
        def __init__(self, main):
            self.is_main = main

        def broadcast(self, value):
            return Rank.sent if not self.is_main else setattr(Rank, "sent", value) or value

    def boom():
        raise PermissionError("no")

    with pytest.raises(PermissionError):
        on_rank0(Rank(True), boom)
    with pytest.raises(UserError, match="rank 0 failed.*PermissionError"):
        on_rank0(Rank(False), boom)
