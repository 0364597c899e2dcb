"""`slipstream bench gpu`: every CUDA-only check and benchmark, in one command on one GPU.

Much of slipstream has a CUDA code path that a CPU machine never runs: the Triton
cross-entropy kernels, TF32 and fp8, pinned-memory prefetch, the allocator-stat memory
phases and the allocator snapshot, the book-size ladders, the planner's GPU accuracy, the
probe's GPU sections and the GPT-2 124M step at the best switches. `ITEMS` lists them, each
with a time budget; `run_gpu_suite` runs them one by one, each in its own subprocess with
its budget as a hard timeout (a CUDA error, a hang or an out-of-memory in one item cannot
poison the next), and writes

    <out>/<each item's own JSON>    (gpu-<item>.json, or the ladders' usual file names)
    <out>/gpu-suite.json            (machine, versions, git sha; per item: status, rc, wall
                                     time, command, the files it wrote, the tail of its output)

A failing item is reported and the suite goes on; the exit code is non-zero at the end if
any item failed. An item is stopped (its whole process group) at the sum of the budgets up to
and including it, so time an earlier item did not use carries over to the later ones. The budgets sum to at most LIMIT_S (under 10 minutes of items), set
from the wall times of the first run on one H200 (benchmarks/gpu-suite.json); the wall time of
every item is recorded so a run on a new GPU shows which budget to change.

`--dry-run` works on a CPU machine and checks the wiring only: every slipstream command and
its options parse with the real argument parser (and config overrides load), every module
command parses with its own parser, every pytest target collects at least one test, the
budgets fit the limit and the output folder is writable. It prints the plan and writes
nothing.

    python -m slipstream.perf.gpu_suite [--dry-run] [--only ITEM ...] [--out-dir benchmarks]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import io
import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from slipstream.errors import UserError
from slipstream.perf.gpu_items import ITEMS, REPO_DIR, SRC_DIR, Item

# The items' budgets together: under 10 minutes. Raised from 475 s for ladder-compression's 100 s:
# the nine items timed on the first H200 run (benchmarks/gpu-suite.json) took 302 s of their 355 s
# budgets, so with ladder-memory's 120 s and ladder-compression's 100 s a run is expected near 520 s.
# 575 s stays under the device machine's 600 s per command and leaves over 5 minutes of the
# 15-minute device budget for starting the machine.
LIMIT_S = 575
TAIL_LINES = 60  # output lines kept per item in the summary
KILL_GRACE_S = 5.0
# An item always gets at least this share of its own budget, even when the items before it
# overran theirs (by at most the kill grace each).
MIN_TIMEOUT_FRACTION = 0.5
SUMMARY_NAME = "gpu-suite.json"
DRY_RUN_WORK = Path(tempfile.gettempdir()) / "slipstream-gpu-work"  # {work} in a dry run: never created

def cuda_available() -> bool:
    """One CUDA device at least (the suite's precondition); a function so tests can replace it."""
    import torch

    return torch.cuda.is_available() and torch.cuda.device_count() > 0


def command_line(item: Item, out: Path, work: Path, python: str = sys.executable) -> list[str]:
    """The argv the suite runs for `item`."""
    args = item.expanded(out, work)
    if item.kind == "slipstream":
        return [python, "-m", "slipstream", *args]
    if item.kind == "module":
        return [python, "-m", item.module, *args]
    if item.kind == "pytest":
        return [python, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--junitxml", str(work / "junit.xml"), *args]
    if item.kind == "python":
        return [python, *args]
    raise ValueError(f"item {item.name}: unknown kind {item.kind!r}")


def _select(items: tuple[Item, ...] | list[Item], only: list[str] | None) -> list[Item]:
    if not only:
        return list(items)
    names = [i.name for i in items]
    unknown = [n for n in only if n not in names]
    if unknown:
        raise UserError(f"unknown GPU suite item(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    return [i for i in items if i.name in only]


def _child_env() -> dict[str, str]:
    """The children import this very slipstream (a source checkout needs no install) and stream their output."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(SRC_DIR), os.environ.get("PYTHONPATH")]))
    return env


# ------------------------------------------------------------------------------ dry run


# Run as a program under the items' interpreter (like `python -m slipstream` itself, so perf/
# never imports the CLI layer above it): parses each argv with slipstream's own parser.
_PARSE_SCRIPT = """
import contextlib, io, json, sys
from slipstream.cli import build_parser
results = []
for argv in json.loads(sys.stdin.read()):
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            args, extra = build_parser().parse_known_args(argv)
    except SystemExit:
        results.append({"error": (err.getvalue().strip().splitlines() or ["(no message)"])[-1]})
        continue
    results.append({"extra": extra, "config": getattr(args, "config", None),
                    "handler": callable(getattr(args, "func", None))})
print()
print(json.dumps(results))
"""


def _slipstream_parse(argvs: list[list[str]], python: str) -> tuple[list[dict[str, Any]] | None, str]:
    """What slipstream's argument parser makes of each argv (one interpreter start for all)."""
    try:
        proc = subprocess.run([python, "-c", _PARSE_SCRIPT], input=json.dumps(argvs), capture_output=True, text=True,
                              timeout=120, cwd=REPO_DIR, env=_child_env())
    except subprocess.TimeoutExpired:
        return None, "parsing the slipstream commands took over 120 s"
    lines = proc.stdout.strip().splitlines()
    try:
        results = json.loads(lines[-1]) if proc.returncode == 0 and lines else None
    except ValueError:
        results = None
    if not isinstance(results, list) or len(results) != len(argvs):
        tail = (proc.stdout + proc.stderr).strip().splitlines()[-3:]
        return None, f"slipstream's parser did not run (rc {proc.returncode}): {' | '.join(tail)}"
    return results, ""


def _check_slipstream_args(item: Item, argv: list[str], parsed: dict[str, Any]) -> list[str]:
    """The subcommand and every option must exist; config overrides must load."""
    if "error" in parsed:
        return [f"slipstream {' '.join(argv[:2])}: arguments do not parse: {parsed['error']}"]
    problems: list[str] = []
    if not parsed.get("handler"):
        problems.append(f"slipstream {argv[0]}: no command handler")
    extra = list(parsed.get("extra") or [])
    overrides = [a for a in extra if a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a]
    unknown = [a for a in extra if a not in overrides]
    if unknown:
        problems.append(f"unknown option(s) {' '.join(unknown)}")
    if overrides and not item.config_overrides:
        problems.append(f"config overrides given to a command that takes none: {' '.join(overrides)}")
    if item.config_overrides:
        from slipstream.config import load_config

        try:
            load_config(parsed.get("config"), overrides)
        except UserError as e:
            problems.append(f"config does not load: {e}")
    return problems


def _check_module_args(item: Item, argv: list[str]) -> list[str]:
    import importlib

    try:
        module = importlib.import_module(item.module)
    except ImportError as e:
        return [f"module {item.module} does not import: {e}"]
    build = getattr(module, "build_parser", None)
    if not callable(build):
        return [f"module {item.module} has no build_parser() to check its options with"]
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            build().parse_args(argv)
    except SystemExit:
        return [f"{item.module}: arguments do not parse: {err.getvalue().strip().splitlines()[-1:]}"]
    return []


def _pytest_collect(argv: list[str], python: str) -> tuple[list[str] | None, str]:
    """Node ids that `pytest --collect-only` finds for argv, or None and why it failed."""
    cmd = [python, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *argv]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, cwd=REPO_DIR, env=_child_env())
    except subprocess.TimeoutExpired:
        return None, "pytest --collect-only took over 120 s"
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        return None, f"pytest --collect-only failed (rc {proc.returncode}): {' | '.join(lines[-3:])}"
    return [line for line in proc.stdout.splitlines() if "::" in line], ""


def _pytest_targets(argv: list[str]) -> list[str]:
    return [a for a in argv if not a.startswith("-")]


def _check_pytest_args(item: Item, argv: list[str], python: str, collected: list[str] | None = None) -> list[str]:
    """Every target must exist and hold at least one test (`collected`: node ids already
    collected for several items at once; None collects this item's targets now)."""
    if collected is None:
        collected, why = _pytest_collect(argv, python)
        if collected is None:
            return [why]
    problems = []
    for target in _pytest_targets(argv):
        rel = os.path.relpath(target.split("::")[0], REPO_DIR)
        if not any(line.startswith(rel) for line in collected):
            problems.append(f"{rel}: no tests collected")
    return problems


def _check_writable(paths: list[Path]) -> list[str]:
    """Each output can be written: an existing writable file, or a creatable one (nothing is created)."""
    problems = []
    for path in paths:
        if path.exists():
            if not path.is_file() or not os.access(path, os.W_OK):
                problems.append(f"{path}: exists and is not a writable file")
            continue
        parent = path.parent
        while not parent.exists() and parent != parent.parent:
            parent = parent.parent
        if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
            problems.append(f"{path}: cannot be created ({parent} is not a writable folder)")
    return problems


def check_item(item: Item, out: Path, python: str = sys.executable, collected: list[str] | None = None,
               parsed: dict[str, Any] | None = None) -> list[str]:
    """The problems that would stop `item` from starting (empty: its wiring is sound).
    collected: pytest node ids collected beforehand for all pytest items (one pytest start);
    parsed: this slipstream item's parse result from _slipstream_parse (None: parse it now)."""
    work = DRY_RUN_WORK  # only substituted, never created
    problems: list[str] = []
    if item.budget_s <= 0:
        problems.append(f"budget {item.budget_s} s must be positive")
    argv = item.expanded(out, work)
    try:
        if item.kind == "slipstream":
            if parsed is None:
                results, why = _slipstream_parse([argv], python)
                parsed = results[0] if results else {"error": why}
            problems += _check_slipstream_args(item, argv, parsed)
        elif item.kind == "module":
            problems += _check_module_args(item, argv)
        elif item.kind == "pytest":
            problems += _check_pytest_args(item, argv, python, collected)
        elif item.kind == "python":
            if argv[:1] == ["-c"] and len(argv) > 1:
                compile(argv[1], f"<{item.name}>", "exec")  # a SyntaxError is this item's problem
        else:
            problems.append(f"unknown kind {item.kind!r}")
    except Exception as e:  # a broken item is reported, the others are still checked
        problems.append(f"check raised {type(e).__name__}: {e}")
    problems += _check_writable(item.output_paths(out, work))
    return problems


def dry_run_plan(items: list[Item], out: Path, python: str = sys.executable,
                 show: Callable[[str], None] = print) -> dict[str, Any]:
    from concurrent.futures import ThreadPoolExecutor

    rows, total = [], sum(i.budget_s for i in items)
    show(f"GPU suite plan: {len(items)} item(s), budgets {total} s of {LIMIT_S} s, results into {out}/")
    work = DRY_RUN_WORK
    # One pytest start collects every pytest item's targets, in the background while the other
    # items are checked; if that collection fails, each pytest item collects its own targets.
    targets = [t for i in items if i.kind == "pytest" for t in _pytest_targets(i.expanded(out, work))]
    # Likewise one interpreter start parses every slipstream item's arguments.
    commands = [i for i in items if i.kind == "slipstream"]
    problems_of: dict[str, list[str]] = {}
    with ThreadPoolExecutor(max_workers=2) as pool:
        collecting = pool.submit(_pytest_collect, targets, python) if targets else None
        parsing = pool.submit(_slipstream_parse, [i.expanded(out, work) for i in commands], python) if commands else None
        for item in sorted(items, key=lambda i: i.kind in ("pytest", "slipstream")):
            collected = collecting.result()[0] if collecting is not None and item.kind == "pytest" else None
            parsed = None
            if parsing is not None and item.kind == "slipstream":
                results, why = parsing.result()
                parsed = results[commands.index(item)] if results else {"error": why}
            problems_of[item.name] = check_item(item, out, python, collected, parsed)
    for item in items:
        cmd = command_line(item, out, Path("{work}"), python)
        problems = problems_of[item.name]
        rows.append({"name": item.name, "budget_s": item.budget_s, "what": item.what, "command": cmd,
                     "outputs": [str(p) for p in item.output_paths(out, Path("{work}"))],
                     "status": "ok" if not problems else "failed", "problems": problems})
        mark = "ok  " if not problems else "FAIL"
        show(f"  {mark} {item.name:<15} {item.budget_s:>4} s  {shlex.join(cmd[1:])}")
        for p in problems:
            show(f"         problem: {p}")
    over = total > LIMIT_S
    if over:
        show(f"  FAIL budgets sum to {total} s, over the limit of {LIMIT_S} s")
    failed = [r["name"] for r in rows if r["status"] != "ok"]
    show("dry run: all items wired" if not failed and not over else
         f"dry run: {len(failed)} item(s) failed{' and the budgets are over the limit' if over else ''}")
    return {"dry_run": True, "limit_s": LIMIT_S, "budget_total_s": total, "budget_ok": not over,
            "out_dir": str(out), "items": rows, "failed": failed, "ok": not failed and not over}


# ------------------------------------------------------------------------------ real run


@dataclass
class _Outcome:
    rc: int | None
    wall_s: float
    timed_out: bool
    tail: list[str] = field(default_factory=list)


def _run_child(cmd: list[str], timeout_s: float, cwd: Path, echo: Callable[[str], None]) -> _Outcome:
    """Run one item in its own session: on timeout the whole process group goes (DataLoader
    workers, compile workers, torchrun children), so nothing it started outlives it."""
    t0 = time.perf_counter()
    tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
    try:
        proc = subprocess.Popen(cmd, cwd=cwd, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, text=True, errors="replace", bufsize=1,
                                start_new_session=True)
    except OSError as e:
        return _Outcome(None, time.perf_counter() - t0, False, [f"could not start: {e}"])

    def read() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            tail.append(line.rstrip("\n"))
            echo(line.rstrip("\n"))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    timed_out = False
    try:
        proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        timed_out = True
        _signal_group(proc, signal.SIGTERM)
        try:
            proc.wait(timeout=KILL_GRACE_S)
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
    wall = time.perf_counter() - t0
    _signal_group(proc, signal.SIGKILL)  # leftovers of a finished item (its own group only)
    reader.join(timeout=KILL_GRACE_S)
    return _Outcome(proc.returncode, wall, timed_out, list(tail))


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def _collect_pytest(work: Path) -> dict[str, Any]:
    """Counts and the failing / skipped tests from the junit XML pytest wrote (our own file)."""
    import xml.etree.ElementTree as ET

    path = work / "junit.xml"
    if not path.is_file():
        return {"error": "pytest wrote no junit XML"}
    root = ET.parse(path).getroot()
    cases = root.iter("testcase")
    result: dict[str, Any] = {"passed": 0, "failed": [], "skipped": [], "tests": 0}
    for case in cases:
        node = f"{case.get('classname', '')}::{case.get('name', '')}"
        result["tests"] += 1
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            result["failed"].append({"test": node, "message": (bad.get("message") or "")[:500]})
        elif skipped is not None:
            result["skipped"].append({"test": node, "reason": (skipped.get("message") or "")[:300]})
        else:
            result["passed"] += 1
    return result


def _collect_train(work: Path) -> dict[str, Any]:
    """The short run's summary, its steady-state intervals (after the first logged one: warm-up
    and compilation) and the memory snapshot files it wrote."""
    run = work / "run"
    summary_path = run / "summary.json"
    if not summary_path.is_file():
        return {"error": f"the run wrote no {summary_path.name}"}
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    records = []
    metrics = run / "metrics.jsonl"
    if metrics.is_file():
        for line in metrics.read_text(encoding="utf-8").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "loss" in record:
                    records.append(record)
    steady = records[1:] if len(records) > 1 else records
    result: dict[str, Any] = {"summary": summary, "intervals": records}
    for key in ("tokens_per_s", "mfu", "step_time_s"):
        values = sorted(r[key] for r in steady if isinstance(r.get(key), (int, float)))
        result[f"steady_{key}"] = values[len(values) // 2] if values else None
    snapshots = sorted(run.glob("memory_snapshot*.pickle"))
    result["memory_snapshots"] = [{"file": p.name, "bytes": p.stat().st_size} for p in snapshots]
    return result


def _write_collected(item: Item, out: Path, work: Path) -> Path | None:
    from slipstream.observe.env import collect_env, write_json_atomic

    if item.collect is None:
        return None
    result = _collect_pytest(work) if item.collect == "pytest" else _collect_train(work)
    path = out / f"gpu-{item.name}.json"
    write_json_atomic(path, {"bench": f"gpu-{item.name}", "what": item.what, "result": result, "env": collect_env()})
    return path


def _earlier_rows(path: Path, rerun: set[str]) -> list[dict[str, Any]]:
    """The rows of an earlier gpu-suite.json (our own file) for items not run again now."""
    try:
        old = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return []
    if not isinstance(old, dict):
        return []
    env = old.get("env") if isinstance(old.get("env"), dict) else {}
    listed = [r for key in ("items", "earlier_items") if isinstance(old.get(key), list) for r in old[key]]
    rows = [r for r in listed if isinstance(r, dict) and r.get("name") not in rerun]
    for r in rows:
        r.setdefault("run_timestamp", env.get("timestamp"))
        r.setdefault("run_git_sha", env.get("git_sha"))
    return rows


def _run_items(items: list[Item], out: Path, python: str, timeout_scale: float,
               echo: Callable[[str], None], show: Callable[[str], None], keep_earlier: bool = False) -> dict[str, Any]:
    from slipstream.observe.env import collect_env, write_json_atomic

    summary: dict[str, Any] = {"bench": "gpu-suite", "limit_s": LIMIT_S, "budget_total_s": sum(i.budget_s for i in items),
                               "timeout_scale": timeout_scale, "python": python, "items": [], "failed": [],
                               "env": collect_env()}
    summary_path = out / SUMMARY_NAME
    earlier = _earlier_rows(summary_path, {i.name for i in items}) if keep_earlier else []
    t_suite = time.perf_counter()
    deadline = 0.0  # seconds into the suite by which this item must be done: the budgets so far
    with tempfile.TemporaryDirectory(prefix="slipstream-gpu-suite-") as tmp:
        for n, item in enumerate(items, 1):
            work = Path(tmp) / item.name
            work.mkdir()
            cmd = command_line(item, out, work, python)
            # Time an earlier item left unused carries over: an item may run past its own budget
            # only by what the items before it saved, so the suite keeps to the budgets' sum.
            deadline += item.budget_s * timeout_scale
            timeout = max(deadline - (time.perf_counter() - t_suite), MIN_TIMEOUT_FRACTION * item.budget_s * timeout_scale)
            show(f"[{n}/{len(items)}] {item.name} (budget {item.budget_s} s, timeout {timeout:.0f} s): "
                 f"{shlex.join(cmd[1:])}")
            started = time.time()
            outcome = _run_child(cmd, timeout, REPO_DIR, echo)
            status = "timeout" if outcome.timed_out else ("passed" if outcome.rc == 0 else "failed")
            row: dict[str, Any] = {"name": item.name, "what": item.what, "command": cmd, "budget_s": item.budget_s,
                                   "timeout_s": round(timeout, 1), "status": status, "rc": outcome.rc,
                                   "wall_s": round(outcome.wall_s, 2)}
            try:
                collected = _write_collected(item, out, work)
            except Exception as e:  # an unreadable result fails this item only
                collected = None
                row["collect_error"] = f"{type(e).__name__}: {e}"
                row["status"] = "failed"
            # Only files written by this run count: a stale result of an earlier run is not this item's.
            written, missing = [], []
            for path in item.output_paths(out, work):
                fresh = path.is_file() and (path == collected or path.stat().st_mtime >= started - 1)
                (written if fresh else missing).append(str(path))
            row["outputs"], row["missing_outputs"] = written, missing
            if row["status"] == "passed" and missing:
                row["status"] = "failed"  # it exited 0 but did not write its result
            row["tail"] = outcome.tail
            summary["items"].append(row)
            if row["status"] != "passed":
                summary["failed"].append(item.name)
            show(f"  -> {row['status']} (rc {outcome.rc}) in {outcome.wall_s:.1f} s"
                 + (f"; missing {', '.join(missing)}" if missing else ""))
            summary["wall_s"] = round(time.perf_counter() - t_suite, 2)
            # After every item: a killed suite keeps what it measured. Items of an earlier run that
            # this one (--only) did not rerun stay in the file, marked with that run's time and sha.
            write_json_atomic(summary_path, {**summary, "earlier_items": earlier})
    passed = sum(1 for r in summary["items"] if r["status"] == "passed")
    show(f"GPU suite: {passed} of {len(items)} passed in {summary['wall_s']:.0f} s"
         + (f"; failed: {', '.join(summary['failed'])}" if summary["failed"] else "") + f"; wrote {summary_path}")
    return summary


def run_gpu_suite(out_dir: Path, dry_run: bool = False, only: list[str] | None = None,
                  python: str = sys.executable, timeout_scale: float = 1.0, items: list[Item] | None = None,
                  echo_output: bool = True, show: Callable[[str], None] = print) -> dict[str, Any]:
    """Run (or, with dry_run, check) the GPU suite; returns the summary (see the module doc).

    only: item names to run (default all). python: the interpreter the items run under.
    timeout_scale: multiplies every budget's timeout (budgets themselves stay as planned).
    items: the item list (default ITEMS; tests pass their own).
    """
    out_dir = Path(out_dir)
    selected = _select(tuple(items) if items is not None else ITEMS, only)
    if timeout_scale <= 0:
        raise UserError(f"--timeout-scale must be > 0, got {timeout_scale}")
    if dry_run:
        return dry_run_plan(selected, out_dir, python, show)
    if not cuda_available():
        raise UserError("slipstream bench gpu needs a CUDA device and none is visible here; "
                        "use --dry-run to check the suite's wiring on this machine")
    if out_dir.exists() and not out_dir.is_dir():
        raise UserError(f"--out-dir {out_dir} exists and is not a folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    echo = (lambda line: print(f"    | {line}", flush=True)) if echo_output else (lambda line: None)
    return _run_items(selected, out_dir.resolve(), python, timeout_scale, echo, show, keep_earlier=bool(only))



# ------------------------------------------------------------------------------ CLI


def add_gpu_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The suite's options, on `slipstream bench gpu` (cli/bench.py) and on build_parser()."""
    p.add_argument("--dry-run", action="store_true",
                   help="check the wiring without a GPU: commands parse, tests collect, budgets fit; writes nothing")
    p.add_argument("--only", nargs="+", default=None, metavar="ITEM",
                   help=f"run only these items ({', '.join(i.name for i in ITEMS)})")
    p.add_argument("--out-dir", default="benchmarks", help="where the JSON results go (default benchmarks)")
    p.add_argument("--timeout-scale", type=float, default=1.0,
                   help="multiply every item's timeout (e.g. 2 on a slower GPU); the budgets stay as planned")
    p.add_argument("--quiet", action="store_true", help="do not echo the items' output, only their results")
    return p


def build_parser() -> argparse.ArgumentParser:
    """The parser of `python -m slipstream.perf.gpu_suite`."""
    return add_gpu_arguments(argparse.ArgumentParser(prog="python -m slipstream.perf.gpu_suite",
                                                     description=__doc__.split("\n\n")[0]))


def main(argv: list[str] | None = None) -> int:
    """`python -m slipstream.perf.gpu_suite`, the same as `slipstream bench gpu` (whose handler
    lives in cli/bench.py): typed values out of the parsed arguments, then run_gpu_suite;
    1 when any item (or, with --dry-run, any wiring check) failed, 2 on a usage error."""
    args = build_parser().parse_args(argv)
    out_dir, dry_run, only = Path(args.out_dir), bool(args.dry_run), list(args.only) if args.only else None
    timeout_scale, echo_output = float(args.timeout_scale), not args.quiet
    try:
        summary = run_gpu_suite(out_dir, dry_run=dry_run, only=only, timeout_scale=timeout_scale,
                                echo_output=echo_output)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if dry_run:
        return 0 if summary["ok"] else 1
    return 1 if summary["failed"] else 0


if __name__ == "__main__":
    sys.exit(main())
