"""`slipstream bench gpu` (slipstream.perf.gpu_suite), checked on a CPU: the dry run's wiring
checks, the runner going on past failing, hanging and silent items, the summary JSON, and the
clear refusal without a CUDA device."""

import json
import sys

import pytest

from slipstream.errors import UserError
from slipstream.perf import gpu_suite
from slipstream.perf.gpu_suite import ITEMS, LIMIT_S, Item, run_gpu_suite


def _quiet(lines):
    return lines.append


def test_real_items_dry_run_on_cpu_passes_lists_every_item_and_writes_nothing(tmp_path):
    out = tmp_path / "out"
    lines = []
    summary = run_gpu_suite(out, dry_run=True, show=_quiet(lines))
    assert summary["ok"], [(r["name"], r["problems"]) for r in summary["items"] if r["problems"]]
    assert [r["name"] for r in summary["items"]] == [i.name for i in ITEMS]
    assert summary["budget_total_s"] == sum(i.budget_s for i in ITEMS) <= LIMIT_S
    printed = "\n".join(lines)
    for item in ITEMS:
        assert item.name in printed
    row = {r["name"]: r for r in summary["items"]}
    assert row["ladder-memory"]["command"][1:6] == ["-m", "slipstream", "bench", "ladder", "memory"]
    assert str(out / "ladder-memory-cuda-book.json") in row["ladder-memory"]["outputs"]
    assert str(out / "gpu-gpt2-step.json") in row["gpt2-step"]["outputs"]
    # the compression ladder's CUDA rows: its own item and budget, its file under the suite's folder
    assert row["ladder-compression"]["command"][3:9] == ["bench", "ladder", "compression", "--size", "gpu", "--device"]
    assert row["ladder-compression"]["outputs"] == [str(out / "ladder-compression-cuda-gpu.json")]
    assert row["ladder-compression"]["budget_s"] == 100 and "ladder-compression" in printed
    assert not out.exists()  # a dry run writes nothing


def test_dry_run_reports_each_broken_item_and_still_checks_the_others(tmp_path):
    probe = next(i for i in ITEMS if i.name == "probe")
    memory = next(i for i in ITEMS if i.name == "memory")
    items = [
        Item("bad-option", 10, "slipstream", probe.args + ("--no-such-option",), "x"),
        Item("bad-command", 10, "slipstream", ("bench", "no-such-bench"), "x"),
        Item("bad-override", 10, "slipstream", memory.args + ("--train.no_such_key=1",), "x", config_overrides=True),
        Item("bad-module", 10, "module", ("--x",), "x", module="slipstream.no_such_module"),
        Item("bad-syntax", 10, "python", ("-c", "def ("), "x"),
        probe,
    ]
    summary = run_gpu_suite(tmp_path / "out", dry_run=True, items=items, show=_quiet([]))
    status = {r["name"]: r for r in summary["items"]}
    assert not summary["ok"]
    assert summary["failed"] == ["bad-option", "bad-command", "bad-override", "bad-module", "bad-syntax"]
    assert status["probe"]["status"] == "ok" and status["probe"]["problems"] == []
    assert "--no-such-option" in " ".join(status["bad-option"]["problems"])
    assert "no_such_key" in " ".join(status["bad-override"]["problems"])
    assert "does not import" in " ".join(status["bad-module"]["problems"])


def test_dry_run_flags_budgets_over_the_limit_and_unwritable_outputs(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    items = [Item("a", LIMIT_S, "python", ("-c", "pass"), "x"),
             Item("b", 1, "python", ("-c", "pass"), "x", outputs=("{out}/gpu-b.json",))]
    summary = run_gpu_suite(blocker / "out", dry_run=True, items=items, show=_quiet([]))
    assert not summary["budget_ok"] and not summary["ok"]
    assert summary["failed"] == ["b"]  # its output's folder would sit under a file


def test_runner_goes_on_past_failing_hanging_and_silent_items(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "cuda_available", lambda: True)
    hang = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']);"
            " print('started', flush=True); time.sleep(60)")
    items = [
        Item("hangs", 1, "python", ("-c", hang), "never ends, and its child holds the output pipe"),
        Item("fails", 20, "python", ("-c", "import sys; print('boom'); sys.exit(3)"), "exits 3"),
        Item("silent", 20, "python", ("-c", "pass"), "exits 0 without its result", outputs=("{out}/gpu-silent.json",)),
        Item("passes", 20, "python", ("-c", "import json, sys; json.dump({'ok': 1}, open(sys.argv[1], 'w'))",
                                      "{out}/gpu-passes.json"), "writes its result", outputs=("{out}/gpu-passes.json",)),
    ]
    out = tmp_path / "out"
    summary = run_gpu_suite(out, items=items, echo_output=False, show=_quiet([]))
    written = json.loads((out / "gpu-suite.json").read_text())
    assert written["failed"] == summary["failed"] == ["hangs", "fails", "silent"]
    rows = {r["name"]: r for r in written["items"]}
    assert rows["fails"]["status"] == "failed" and rows["fails"]["rc"] == 3 and "boom" in rows["fails"]["tail"]
    assert rows["hangs"]["status"] == "timeout" and rows["hangs"]["wall_s"] < 15 and "started" in rows["hangs"]["tail"]
    assert rows["silent"]["status"] == "failed" and rows["silent"]["missing_outputs"] == [str(out.resolve() / "gpu-silent.json")]
    assert rows["silent"]["timeout_s"] > 20  # the time "fails" left unused carries over
    assert rows["passes"]["status"] == "passed" and rows["passes"]["rc"] == 0
    assert rows["passes"]["outputs"] == [str(out.resolve() / "gpu-passes.json")]
    assert rows["passes"]["command"][0] == sys.executable
    assert written["env"]["git_sha"] is None or len(written["env"]["git_sha"]) == 40
    assert "torch_version" in written["env"] and "python_version" in written["env"]

    # Rerunning one item keeps the earlier rows of the others in the summary, marked as earlier.
    again = run_gpu_suite(out, items=items, only=["passes"], echo_output=False, show=_quiet([]))
    assert again["failed"] == []
    rewritten = json.loads((out / "gpu-suite.json").read_text())
    assert [r["name"] for r in rewritten["items"]] == ["passes"]
    assert [r["name"] for r in rewritten["earlier_items"]] == ["hangs", "fails", "silent"]
    assert rewritten["earlier_items"][0]["run_timestamp"] == written["env"]["timestamp"]


def test_pytest_results_are_collected_into_json(tmp_path):
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite><testcase classname="t" name="ok"/>'
        '<testcase classname="t" name="bad"><failure message="assert 1 == 2"/></testcase>'
        '<testcase classname="t" name="skip"><skipped message="needs CUDA"/></testcase></testsuite></testsuites>')
    result = gpu_suite._collect_pytest(tmp_path)
    assert result["tests"] == 3 and result["passed"] == 1
    assert result["failed"] == [{"test": "t::bad", "message": "assert 1 == 2"}]
    assert result["skipped"] == [{"test": "t::skip", "reason": "needs CUDA"}]


def test_without_cuda_the_real_run_refuses_and_names_the_dry_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu_suite, "cuda_available", lambda: False)
    with pytest.raises(UserError, match="needs a CUDA device.*--dry-run"):
        run_gpu_suite(tmp_path / "out")
    assert not (tmp_path / "out").exists()
    with pytest.raises(UserError, match="unknown GPU suite item.*nope"):
        run_gpu_suite(tmp_path / "out", dry_run=True, only=["nope"])


def test_slipstream_bench_gpu_is_wired_through_the_cli(tmp_path, capsys, monkeypatch):
    """`slipstream bench gpu` parses with slipstream.cli's parser into cli/bench.py's handler,
    which calls run_gpu_suite with typed values; gpu_suite itself takes no argparse.Namespace."""
    from slipstream import cli
    from slipstream.cli import bench

    args = cli.build_parser().parse_args(["bench", "gpu", "--dry-run", "--only", "probe", "planner",
                                          "--out-dir", str(tmp_path)])
    assert args.func is bench.cmd_bench_gpu and args.dry_run and args.only == ["probe", "planner"]
    assert args.timeout_scale == 1.0 and not args.quiet
    assert not hasattr(gpu_suite, "cmd_bench_gpu") and not hasattr(gpu_suite, "add_gpu_command")

    monkeypatch.setattr(gpu_suite, "ITEMS", (Item("quick", 5, "python", ("-c", "pass"), "x"),
                                             Item("broken", 5, "python", ("-c", "def ("), "x")))
    assert cli.main(["bench", "gpu", "--dry-run", "--only", "quick", "--out-dir", str(tmp_path)]) == 0
    assert "quick" in capsys.readouterr().out
    assert cli.main(["bench", "gpu", "--dry-run", "--out-dir", str(tmp_path)]) == 1  # a broken item fails
    assert cli.main(["bench", "gpu", "--dry-run", "--only", "nope"]) == 2
    assert "unknown GPU suite item" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # a dry run writes nothing


def test_the_module_entry_point_passes_typed_values(tmp_path, capsys, monkeypatch):
    """`python -m slipstream.perf.gpu_suite` is the same command: its main() hands run_gpu_suite
    plain values (a Path, bools, a list, a float), never the parsed namespace."""
    calls = []

    def fake_run(out_dir, **kwargs):
        calls.append((out_dir, kwargs))
        return {"ok": True, "failed": []}

    monkeypatch.setattr(gpu_suite, "run_gpu_suite", fake_run)
    assert gpu_suite.main(["--dry-run", "--only", "quick", "--out-dir", str(tmp_path), "--timeout-scale", "2",
                           "--quiet"]) == 0
    assert calls == [(tmp_path, {"dry_run": True, "only": ["quick"], "timeout_scale": 2.0, "echo_output": False})]
    monkeypatch.undo()
    assert gpu_suite.main(["--only", "nope"]) == 2
    assert "unknown GPU suite item" in capsys.readouterr().err
