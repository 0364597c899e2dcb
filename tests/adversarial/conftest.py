"""Shared tools of the adversarial suite: run the real CLI as a user would, and prove that
a command touched nothing outside the outputs it owns.

Every case asserts the same contract: the exit code, one `error:` line that names the fix,
no traceback, and an unchanged tree outside the command's own outputs."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_cli(*args, cwd, timeout=240, env_extra: dict[str, str] | None = None, input_text: str | None = None):
    """`python -m slipstream ARGS` in `cwd`; returns the CompletedProcess (never raises on exit code)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"), OMP_NUM_THREADS="2", **(env_extra or {}))
    return subprocess.run([sys.executable, "-m", "slipstream", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout, input=input_text)


def assert_user_error(proc, *fragments: str, code: int = 2) -> str:
    """Exit `code`, an `error:` line containing every fragment (case-insensitive), no traceback.
    Returns the error line."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}:\n{out}"
    assert "Traceback" not in out, f"traceback printed:\n{out}"
    lines = [line for line in out.splitlines() if line.startswith("error:")]
    assert lines, f"no 'error:' line:\n{out}"
    for fragment in fragments:
        assert any(fragment.lower() in line.lower() for line in lines), f"'{fragment}' not in {lines}"
    return lines[0]


def tree_snapshot(root: Path, exclude: tuple[str, ...] = ()) -> dict[str, str]:
    """{relative path: sha256 (files) | 'dir' | 'link -> target'} of everything under root,
    except paths under any of `exclude` (relative to root)."""
    root = Path(root)
    snap: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for name in dirnames + filenames:
            path = Path(dirpath) / name
            rel = path.relative_to(root).as_posix()
            if any(rel == e or rel.startswith(e.rstrip("/") + "/") for e in exclude):
                continue
            if path.is_symlink():
                snap[rel] = f"link -> {os.readlink(path)}"
            elif path.is_dir():
                snap[rel] = "dir"
            else:
                snap[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
        dirnames[:] = [d for d in dirnames if not (Path(dirpath) / d).is_symlink()]
    return snap


def assert_unchanged(before: dict[str, str], after: dict[str, str]) -> None:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    assert not changed, f"files changed outside the command's outputs: {changed}"


@pytest.fixture
def cli():
    return run_cli
