"""Adversarial cases that already hold (issue 22, section 6), kept so they keep holding:
bad configs, damaged checkpoints, kill -9 in the middle of an asynchronous save, and SIGTERM /
SIGINT during training.

Every case checks the exit code, the one line that says what happened (an `error:` line that
names the problem and the fix, where it is an error), no traceback, and that nothing outside
the run's own outputs changed. Config errors and `checkpoint inspect` run in this process
through the CLI's `main` (they stop before any training; a second interpreter would cost a
torch import per case); training runs are real `slipstream train` processes on the tiny model.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path

import pytest

from slipstream.resilience.preemption import EXIT_PREEMPTED
from tests.adversarial.conftest import ROOT, assert_unchanged, assert_user_error, run_cli, tree_snapshot

EXIT_INTERRUPTED = 130  # Ctrl-C (slipstream.cli)


def in_process(argv, cwd: Path, capsys, monkeypatch) -> subprocess.CompletedProcess:
    """`slipstream ARGV` through the CLI's main in `cwd`, as a CompletedProcess; an exception that
    escapes main is printed as the traceback a user would see."""
    from slipstream.cli import main

    monkeypatch.chdir(cwd)
    capsys.readouterr()
    try:
        code = main([str(a) for a in argv])
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
        code = 1
    out = capsys.readouterr()
    return subprocess.CompletedProcess(argv, code, out.out, out.err)


def snapshots(*roots: Path, outputs: tuple[str, ...] = ()) -> list[dict[str, str]]:
    """Snapshots of the folders a command may read but must not change (`outputs` excluded)."""
    return [tree_snapshot(root, exclude=outputs) for root in roots]


def assert_all_unchanged(before: list[dict[str, str]], *roots: Path, outputs: tuple[str, ...] = ()) -> None:
    for old, new in zip(before, snapshots(*roots, outputs=outputs)):
        assert_unchanged(old, new)


# ------------------------------------------------------------------ bad configs

CONFIGS = {
    "unknown-key": ("[train]\nmax_step = 3\n", ["unknown config key 'train.max_step'", "did you mean 'max_steps'"]),
    "unknown-section": ("[trian]\nmax_steps = 3\n", ["unknown config section 'trian'", "did you mean 'train'"]),
    "wrong-type": ('[train]\nmax_steps = "ten"\n', ["train.max_steps", "expected an integer"]),
    "bad-value": ("[train]\nmicro_batch_size = 0\n", ["train.micro_batch_size = 0", "must be >= 1"]),
    "bad-syntax": ("[train\nmax_steps = 3\n", ["is not valid toml", "line 1"]),
    "missing-extends": ('extends = "nope.toml"\n', ["nope.toml", "does not exist", "pass an existing toml file"]),
}


@pytest.mark.parametrize("case", list(CONFIGS))
def test_bad_config_file(case, tmp_path, capsys, monkeypatch):
    text, fragments = CONFIGS[case]
    (tmp_path / "bad.toml").write_text(text)
    before = snapshots(tmp_path)
    # --data.dir=nowhere: even a config that loaded would stop before any training in this process.
    proc = in_process(["train", "--config", "bad.toml", "--data.dir=nowhere", "--run.dir=run"], tmp_path,
                      capsys, monkeypatch)
    assert_user_error(proc, *fragments)
    assert_all_unchanged(before, tmp_path)  # no run folder either


def test_cyclic_extends(tmp_path, capsys, monkeypatch):
    (tmp_path / "a.toml").write_text('extends = "b.toml"\n')
    (tmp_path / "b.toml").write_text('extends = "a.toml"\n[train]\nmax_steps = 3\n')
    before = snapshots(tmp_path)
    proc = in_process(["train", "--config", "a.toml", "--data.dir=nowhere", "--run.dir=run"], tmp_path,
                      capsys, monkeypatch)
    assert_user_error(proc, "extend each other in a cycle", "a.toml -> ", "b.toml -> ")
    assert_all_unchanged(before, tmp_path)


@pytest.mark.parametrize("override, fragments", [
    ("--train.max_steps", ["override '--train.max_steps' has no value", "write --train.max_steps=VALUE"]),
    ("--trainmax_steps=3", ["unexpected argument '--trainmax_steps=3'", "look like --section.key=value"]),
    ("--train.max_steps=abc", ["--train.max_steps=abc", "expected an integer"]),
    ("--.max_steps=3", ["unknown config section ''", "valid: run, model"]),
    ("--train.=3", ["unknown config key 'train.'", "valid: max_steps"]),
    ("--model.preset=nope", ["unknown model.preset 'nope'", "valid: tiny"]),
])
def test_bad_override(override, fragments, tmp_path, capsys, monkeypatch):
    before = snapshots(tmp_path)
    proc = in_process(["train", override, "--data.dir=nowhere", "--run.dir=run"], tmp_path, capsys, monkeypatch)
    assert_user_error(proc, *fragments)
    assert_all_unchanged(before, tmp_path)


# ------------------------------------------------------------------ training runs


def tiny(data_dir: Path, *extra: str, steps: int = 12) -> list[str]:
    return ["train", "--model.preset=tiny", f"--data.dir={data_dir}", f"--train.max_steps={steps}",
            "--train.micro_batch_size=4", "--train.seq_len=32", "--train.eval_steps=0", "--optim.warmup_steps=3",
            "--logging.log_interval=1", "--logging.progress=false", "--logging.tensorboard=false",
            "--train.deterministic=true", "--metrics.memory_breakdown=false",
            "--checkpoint.interval=2", "--checkpoint.keep_last=6", *extra]


def losses(run: Path) -> dict[int, float]:
    """Loss per step; a resumed run's later records replace the ones it repeated."""
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r and "guard_event" not in r}


def no_traceback(proc) -> None:
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stdout[-2000:] + proc.stderr[-3000:]


def checkpoint_names(run: Path) -> list[str]:
    return sorted(p.name for p in (run / "checkpoints").iterdir())


@pytest.fixture(scope="module")
def straight(tmp_path_factory, data_dir) -> Path:
    """The uninterrupted reference: 12 steps, a checkpoint every 2 (steps 2..12 kept)."""
    work = tmp_path_factory.mktemp("straight")
    proc = run_cli(*tiny(data_dir, "--run.dir=run"), cwd=work)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = work / "run"
    assert checkpoint_names(run) == [f"step_{s:08d}" for s in (2, 4, 6, 8, 10, 12)]
    return run


def damage(ckpt: Path, kind: str) -> None:
    """Damage one checkpoint folder the way a disk, a copy or a crash would."""
    shard = sorted((ckpt / "model_optim").glob("*.distcp"))[0]
    if kind == "truncated-shard":
        shard.write_bytes(shard.read_bytes()[:1000])
    elif kind == "flipped-byte":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF  # same size, different content: only the checksum can tell
        shard.write_bytes(bytes(data))
    elif kind == "missing-complete":
        (ckpt / "COMPLETE").unlink()  # as if the save had been cut off before its commit
    elif kind == "missing-file":
        shard.unlink()
    else:
        raise ValueError(kind)


# (kind, what `checkpoint inspect` and an explicit resume say, inspect's exit code)
DAMAGE = {
    "truncated-shard": (["__0_0.distcp has 1,000 bytes, the manifest says"], 1),
    "flipped-byte": (["__0_0.distcp does not match its checksum"], 1),
    "missing-file": (["__0_0.distcp is missing"], 1),
    # Without its marker a folder is not a checkpoint yet: a user error, not a failed integrity check.
    "missing-complete": (["is incomplete (no COMPLETE marker", "use an earlier checkpoint"], 2),
}


@pytest.mark.parametrize("kind", list(DAMAGE))
def test_inspect_names_the_damage(kind, straight, tmp_path, capsys, monkeypatch):
    ckpt = tmp_path / "step_00000012"
    shutil.copytree(straight / "checkpoints" / ckpt.name, ckpt)
    damage(ckpt, kind)
    fragments, code = DAMAGE[kind]
    before = snapshots(tmp_path)
    proc = in_process(["checkpoint", "inspect", ckpt], tmp_path, capsys, monkeypatch)
    if code == 1:
        fragments = ["did not pass its integrity check", *fragments]
    assert_user_error(proc, *fragments, code=code)
    assert_all_unchanged(before, tmp_path)


@pytest.mark.timeout(240)
# Two runs, not four: every integrity problem reaches resume through the same check that
# `inspect` reports above (flipped-byte stands for them); a missing marker takes another path.
@pytest.mark.parametrize("kind", ["flipped-byte", "missing-complete"])
def test_resume_refuses_a_damaged_checkpoint(kind, straight, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    newest = run / "checkpoints" / "step_00000012"
    damage(newest, kind)
    fragments, _ = DAMAGE[kind]
    if kind != "missing-complete":
        fragments = ["is damaged", *fragments, "--checkpoint.resume=auto skips damaged ones"]
    before = snapshots(tmp_path, data_dir, outputs=("run",))
    checkpoints = tree_snapshot(run / "checkpoints")
    proc = run_cli(*tiny(data_dir, "--run.dir=run", f"--checkpoint.resume={newest}"), cwd=tmp_path)
    assert_user_error(proc, *fragments)
    assert_all_unchanged(before, tmp_path, data_dir, outputs=("run",))
    assert_unchanged(checkpoints, tree_snapshot(run / "checkpoints"))  # the damaged one is left as it is


@pytest.mark.timeout(240)
def test_resume_auto_skips_every_kind_of_damage_and_continues_exactly(straight, data_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(straight, run)
    for step, kind in ((12, "flipped-byte"), (10, "truncated-shard"), (8, "missing-file"), (6, "missing-complete")):
        damage(run / "checkpoints" / f"step_{step:08d}", kind)
    before = snapshots(tmp_path, data_dir, outputs=("run",))
    proc = run_cli(*tiny(data_dir, "--run.dir=run", "--checkpoint.resume=auto"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    no_traceback(proc)
    skipped = [line for line in proc.stdout.splitlines() if line.startswith("warning: skipping damaged checkpoint")]
    assert [s.split()[4].rsplit("/", 1)[-1].rstrip(":") for s in skipped] == \
        ["step_00000012", "step_00000010", "step_00000008"], skipped  # step 6 never was a checkpoint
    assert "step_00000004" in proc.stdout.split("resumed from")[1].splitlines()[0]
    assert losses(run) == losses(straight)  # bitwise, every step
    assert_all_unchanged(before, tmp_path, data_dir, outputs=("run",))


# A test-only hook, loaded as sitecustomize by the training process: the save of step 8 writes
# its shards, says so in a marker file, and then never finishes (the test kills the process).
HOLD_SAVE = '''
import os, time
from pathlib import Path
import slipstream.checkpoint.writer as writer

_write_rank_manifest = writer.CheckpointWriter._write_rank_manifest

def _held(self, step, tmp, future=None):
    if tmp.name == os.environ["HOLD_SAVE"]:
        Path(os.environ["HOLD_MARKER"]).write_text("in flight")
        time.sleep(600)
    return _write_rank_manifest(self, step, tmp, future)

writer.CheckpointWriter._write_rank_manifest = _held
'''


def wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        assert proc.poll() is None, f"the run ended (exit {proc.returncode}) before {path.name} appeared"
        assert time.monotonic() < deadline, f"{path.name} did not appear within {timeout_s} s"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_kill_9_during_an_async_save_keeps_the_last_complete_checkpoint(straight, data_dir, tmp_path):
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(HOLD_SAVE)
    work = tmp_path / "work"
    work.mkdir()
    marker = tmp_path / "save-in-flight"
    env = dict(os.environ, PYTHONPATH=f"{hook}{os.pathsep}{ROOT / 'src'}", OMP_NUM_THREADS="2",
               HOLD_SAVE=".step_00000008.tmp", HOLD_MARKER=str(marker))
    before = snapshots(work, data_dir, outputs=("run",))
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", *tiny(data_dir, "--run.dir=run")], cwd=work, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(marker, proc, timeout_s=200)
        proc.send_signal(signal.SIGKILL)  # step 8's shards are on disk; its manifest and COMPLETE are not
    finally:
        proc.kill()
        proc.wait(timeout=30)
    run = work / "run"
    assert ".step_00000008.tmp" in checkpoint_names(run) and "step_00000008" not in checkpoint_names(run)

    proc = run_cli(*tiny(data_dir, "--run.dir=run", "--checkpoint.resume=auto"), cwd=work)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    no_traceback(proc)
    assert "step_00000006" in proc.stdout.split("resumed from")[1].splitlines()[0]
    assert losses(run) == losses(straight)  # nothing lost after step 6, nothing repeated
    assert not [n for n in checkpoint_names(run) if n.endswith(".tmp")]  # the half-written save is gone
    assert_all_unchanged(before, work, data_dir, outputs=("run",))


@pytest.mark.timeout(300)
def test_sigterm_saves_exits_75_and_resumes_exactly(straight, data_dir, tmp_path):
    """SIGTERM after step 5 (not a checkpoint step): the step is finished, saved, and the run exits 75."""
    before = snapshots(tmp_path, data_dir, outputs=("run",))
    proc = run_cli(*tiny(data_dir, "--run.dir=run"), cwd=tmp_path, env_extra={"SLIPSTREAM_INJECT_FAULT": "sigterm@5"})
    assert proc.returncode == EXIT_PREEMPTED, proc.stdout[-2000:] + proc.stderr[-3000:]
    no_traceback(proc)
    assert "preempted: saved" in proc.stdout
    assert [line for line in proc.stderr.splitlines() if line.startswith("exiting after preemption")], proc.stderr
    assert not [line for line in proc.stderr.splitlines() if line.startswith("error:")], proc.stderr
    run = tmp_path / "run"
    assert "step_00000005" in checkpoint_names(run) and (run / "checkpoints" / "step_00000005" / "COMPLETE").exists()

    proc = run_cli(*tiny(data_dir, "--run.dir=run", "--checkpoint.resume=auto"), cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "step_00000005" in proc.stdout.split("resumed from")[1].splitlines()[0]
    assert losses(run) == losses(straight)  # bitwise, every step: nothing lost, nothing repeated
    assert_all_unchanged(before, tmp_path, data_dir, outputs=("run",))


@pytest.mark.timeout(240)
def test_sigint_exits_130_and_keeps_the_last_checkpoint_intact(data_dir, tmp_path, capsys, monkeypatch):
    """Ctrl-C stops at once with exit 130 and one `interrupted` line. It does not save (that is
    what SIGTERM/SIGUSR1 are for); the checkpoints already written stay intact."""
    before = snapshots(tmp_path, data_dir, outputs=("run",))
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="2")
    # A shell starts background jobs with SIGINT ignored, and an ignored SIGINT is inherited through
    # exec (Python then installs no handler): `make test &` would make Ctrl-C a no-op in the child.
    proc = subprocess.Popen([sys.executable, "-m", "slipstream", *tiny(data_dir, "--run.dir=run", steps=400)],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        for line in proc.stdout:
            if line.startswith("train step 7/"):
                proc.send_signal(signal.SIGINT)
                break
        out, err = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == EXIT_INTERRUPTED, err[-3000:]
    assert "Traceback" not in out + err and err.strip().splitlines()[-1] == "interrupted", err[-3000:]
    assert not [line for line in err.splitlines() if line.startswith("error:")], err[-3000:]
    run = tmp_path / "run"
    # Saves are asynchronous: step 6's may still have been in flight (left as .step_00000006.tmp).
    complete = [n for n in checkpoint_names(run) if not n.startswith(".")]
    assert complete and complete[-1] >= "step_00000004", checkpoint_names(run)
    result = in_process(["checkpoint", "inspect", run / "checkpoints" / complete[-1]], tmp_path, capsys, monkeypatch)
    assert result.returncode == 0, result.stdout + result.stderr
    assert_all_unchanged(before, tmp_path, data_dir, outputs=("run",))
