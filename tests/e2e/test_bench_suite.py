"""`slipstream bench suite --size ci` (issue 18): one run of every workload at a tiny size, shared by
the tests below (module fixture; about a minute on 2 cores, mostly process and torchrun start-up),
checked against the suite JSON's schema; the quality gate really gates; bad input is a user error;
the README's suite block is the table of the newest committed result."""

from __future__ import annotations

import datetime
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from slipstream.cli import main
from slipstream.errors import UserError
from slipstream.perf import suite_workloads
from slipstream.perf.suite import SUITE_VERSION, WORKLOADS, run_suite, run_workload
from slipstream.perf.suite_readme import END, START, latest_suite, readme_block, suite_table, update_readme

ROOT = Path(__file__).resolve().parents[2]
ENTRY_KEYS = {"name", "title", "definition", "methodology", "metric", "unit", "higher_is_better", "normalize_by",
              "samples", "median", "ci", "ci_level", "noise_band", "noise_band_source", "quality", "status", "error",
              "secondary", "dtype"}
# The shared run takes about a minute on 2 idle cores; a busy machine may need several times that.
pytestmark = pytest.mark.timeout(900)
PARALLEL = ("data_parallel_2", "tensor_parallel_2", "pipeline_parallel_2", "context_parallel_2", "expert_parallel_2")


@pytest.fixture(scope="module")
def suite_ci(tmp_path_factory, data_dir) -> dict:
    out = tmp_path_factory.mktemp("suite") / "suite-ci.json"
    env = dict(os.environ, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-m", "slipstream", "bench", "suite", "--size", "ci", "--data-dir",
                           str(data_dir), "--out", str(out)], cwd=out.parent, env=env, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, \
        f"bench suite failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-3000:]}"
    assert f"wrote {out}" in proc.stdout
    return json.loads(out.read_text())


def test_suite_ci_json_follows_the_schema(suite_ci, tmp_path):
    from slipstream.perf.suite_compare import compare_suites, load_suite

    r = suite_ci
    assert r["bench"] == "suite" and r["suite_version"] == SUITE_VERSION and r["mode"] == "ci"
    assert r["env"]["git_sha"] and r["env"]["torch_version"] and r["wall_s"] > 0
    assert datetime.datetime.fromisoformat(r["started"]).tzinfo is not None
    m = r["machine"]
    assert m["device"] == "cpu" and m["matmul_tflops"] > 0 and m["copy_gb_s"] > 0
    assert m["matmul_tflops_by_dtype"]["fp32"] == m["matmul_tflops"]
    assert [w["name"] for w in r["workloads"]] == list(WORKLOADS)  # every workload, in the table's order
    for w in r["workloads"]:
        assert set(w) == ENTRY_KEYS, w["name"]
        assert w["status"] == "ok" and w["error"] is None, (w["name"], w["error"])
        assert w["samples"] and all(math.isfinite(x) for x in w["samples"]), w["name"]
        low, high = w["ci"]
        assert min(w["samples"]) <= low <= w["median"] <= high <= max(w["samples"]), w["name"]
        assert 0 <= w["ci_level"] < 1 and 0 < w["noise_band"] < 1 and w["noise_band_source"] in ("measured", "default")
        assert w["quality"]["passed"] is True and w["quality"]["criterion"]
        assert w["normalize_by"] in ("compute", "memory", "none") and isinstance(w["higher_is_better"], bool)
        assert w["definition"].startswith("ci: ") and "data: the --data-dir corpus" in w["definition"]
        assert len(w["methodology"]) > 100 and w["title"] and w["metric"] and w["unit"]
    by_name = {w["name"]: w for w in r["workloads"]}
    # the step workloads: one sample per timed step after the warm-up steps
    for name in ("gpt2_124m_fp32", "gpt2_124m_best", *PARALLEL):
        assert len(by_name[name]["samples"]) == WORKLOADS[name].samples["ci"], name
    for name in PARALLEL:  # each multi-rank run learned
        assert by_name[name]["secondary"]["loss_last"] < by_name[name]["secondary"]["loss_first"], name
        assert "--nproc-per-node=2" in by_name[name]["definition"]
    # what the suite writes, compare reads: the run against itself has no verdict but noise
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(r))
    same = compare_suites(load_suite(path), load_suite(path))
    assert {row["verdict"] for row in same["rows"]} == {"within noise"} and not same["warnings"]


def test_suite_ci_time_to_target_stops_at_the_target(suite_ci):
    ttt = next(w for w in suite_ci["workloads"] if w["name"] == "time_to_target")
    _, recipe, target = suite_workloads.TIME_TO_TARGET["ci"]
    cap = int(next(o for o in recipe if o.startswith("--train.max_steps=")).split("=")[1])
    s = ttt["secondary"]
    # stopped by the target at an evaluation, well before the step cap: the target was not ignored
    assert s["val_loss"] <= target and s["steps"] < cap and s["steps"] % 5 == 0
    assert s["tokens"] == s["steps"] * 4 * 64 and f"--train.target_val_loss={target:g}" in ttt["definition"]
    assert s["checkpoints"] >= 1  # checkpointing on, as in a real run
    assert 0 < s["loop_time_s"] < s["train_wall_s"] < ttt["median"]  # the cold start counts: spawn to exit


def test_suite_ci_secondary_numbers(suite_ci):
    by_name = {w["name"]: w for w in suite_ci["workloads"]}
    best = by_name["gpt2_124m_best"]
    # the best run's loss was compared with the fp32 run's at the same step, and the switches are named
    fp32 = by_name["gpt2_124m_fp32"]
    assert "of the fp32 run's" in best["quality"]["criterion"] and "--optim.implementation=fused" in best["definition"]
    bf16 = bool(suite_workloads.cpu_bf16_flags())  # bf16 autocast where the CPU has native bf16 matmuls
    assert ("--precision.autocast=bf16" in best["definition"]) is bf16 and best["dtype"] == ("bf16" if bf16 else "fp32")
    assert "autocast" not in fp32["definition"].split("switches")[0] and fp32["dtype"] == "fp32"
    assert best["secondary"]["mfu"] > 0 and best["secondary"]["process_peak_bytes"] > 0
    data = by_name["data_path"]
    rates = data["secondary"]
    assert data["median"] == pytest.approx(rates["loader_tokens_per_s"] / rates["step_tokens_per_s"])
    ckpt = by_name["checkpoint_stall"]["secondary"]
    assert ckpt["sync_save_s"] > 0 and ckpt["async_commit_s"] > 0 and ckpt["state_bytes"] > 1e6
    over = by_name["trainer_overhead"]
    assert over["median"] == pytest.approx(over["secondary"]["trainer_step_s"] / over["secondary"]["hand_loop_step_s"])


def test_quality_gate_fails_a_run_that_misses_its_target(tmp_path, data_dir, monkeypatch):
    # an unreachable target within 2 steps: the time is measured but does not count
    what, _, _ = suite_workloads.TIME_TO_TARGET["ci"]
    recipe = [*suite_workloads.TINY, "--train.max_steps=2", "--train.eval_interval=2", "--train.eval_tokens=1024",
              "--checkpoint.save_final=false", "--metrics.memory_breakdown=false", "--logging.tensorboard=false"]
    monkeypatch.setitem(suite_workloads.TIME_TO_TARGET, "ci", (what, recipe, 0.5))
    ctx = suite_workloads.SuiteContext(mode="ci", device="cpu", data_dir=str(data_dir), data_note="test",
                                       workdir=tmp_path)
    row = run_workload(WORKLOADS["time_to_target"], ctx, 1, {})
    assert row["status"] == "quality_failed" and row["quality"]["passed"] is False
    assert row["samples"] and row["median"] > 0 and row["secondary"]["steps"] == 2
    assert "quality gate" in row["error"] and "0.5" in row["error"]
    # nor does a time without the checkpoints the definition promises (this recipe saves none)
    assert row["secondary"]["checkpoints"] == 0 and "repeats [0] saved no checkpoint" in row["error"]


def test_bad_input_is_a_user_error(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert main(["bench", "suite", "--size", "ci", "--only", "bogus", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "unknown workload bogus" in err and "time_to_target" in err and not out.exists()
    # a data folder that is not a prepared corpus stops the suite before anything runs
    assert main(["bench", "suite", "--size", "ci", "--data-dir", str(tmp_path / "nope"), "--out", str(out)]) == 2
    assert "nope" in capsys.readouterr().err and not out.exists()
    with pytest.raises(UserError, match="needs --out"):
        run_suite(mode="ci")
    with pytest.raises(UserError, match="--repeats"):
        run_suite(mode="ci", repeats=-1, out=str(out))


def test_readme_table_and_latest_suite(suite_ci, tmp_path):
    table = suite_table(suite_ci)
    for w in suite_ci["workloads"]:
        assert f"| {w['name']} |" in table
    assert "ci mode" in table and suite_ci["env"]["git_sha"][:10] in table
    readme = tmp_path / "README.md"
    readme.write_text(f"# x\n\n## Measured results\n\n{START}\nplaceholder\n{END}\n\nafter\n")
    result = tmp_path / "suite" / "suite-cpu-quick-20261205-1500.json"
    result.parent.mkdir()
    result.write_text(json.dumps({**suite_ci, "mode": "quick"}))
    assert update_readme(readme, result) is True and update_readme(readme, result) is False
    text = readme.read_text()
    start, end = readme_block(text)
    assert text[start:end].strip() == suite_table({**suite_ci, "mode": "quick"}) and text.endswith("after\n")
    # latest_suite: the newest non-ci result of the device, by its "started" time
    newer = {**suite_ci, "mode": "full", "started": "2099-01-01T00:00:00+00:00"}
    (tmp_path / "suite" / "suite-cpu-full-a.json").write_text(json.dumps(newer))
    (tmp_path / "suite" / "suite-cpu-ci-b.json").write_text(json.dumps({**newer, "mode": "ci",
                                                                       "started": "2100-01-01T00:00:00+00:00"}))
    cuda = {**newer, "machine": {**newer["machine"], "device": "cuda"}, "started": "2101-01-01T00:00:00+00:00"}
    (tmp_path / "suite" / "suite-cuda-full-c.json").write_text(json.dumps(cuda))
    assert latest_suite(tmp_path / "suite", "cpu").name == "suite-cpu-full-a.json"
    assert latest_suite(tmp_path / "suite", "cuda").name == "suite-cuda-full-c.json"
    assert latest_suite(tmp_path / "nothing", "cpu") is None


def test_readme_block_is_the_latest_committed_suite():
    latest = latest_suite(ROOT / "benchmarks" / "suite", "cpu")
    if latest is None:
        pytest.skip("no CPU suite result is committed under benchmarks/suite/ yet")
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    start, end = readme_block(text)
    expected = suite_table(json.loads(latest.read_text()))
    assert text[start:end].strip() == expected, f"README's suite block is stale: regenerate it from {latest.name} " \
                                                "with slipstream.perf.suite_readme.update_readme"


def _fake_time_to_target(outcomes: dict[str, object]):
    """A stand-in for suite_workloads.time_to_target_once: each switch's wall seconds (None: the target
    was missed; an exception: the run crashed), found by its overrides."""
    from slipstream.perf.speedrun import SWITCHES

    calls = []

    def run(overrides, mode, data_dir, workdir):
        name = next(n for n, (o, _) in SWITCHES.items() if o == overrides)
        calls.append((name, data_dir))
        outcome = outcomes[name]
        if isinstance(outcome, Exception):
            raise outcome
        recipe = [*suite_workloads.TIME_TO_TARGET[mode][1], *overrides]
        return {"wall_s": outcome or 9.0, "target_reached": outcome is not None, "steps": 10, "tokens": 2560,
                "val_loss": 4.7, "loop_time_s": 1.0, "train_wall_s": 2.0, "definition": " ".join(recipe)}
    return run, calls


def test_speedrun_rows_recipe_failures_and_output(tmp_path, data_dir, monkeypatch, capsys):
    fake, calls = _fake_time_to_target({"baseline": 100.0, "muon": 80.0, "qk_norm": None,
                                        "relu2": FileNotFoundError("summary.json")})
    monkeypatch.setattr(suite_workloads, "time_to_target_once", fake)
    out = tmp_path / "speedrun.json"
    args = ["bench", "speedrun", "--size", "ci", "--switches", "relu2", "muon", "qk_norm", "baseline",
            "--data-dir", str(data_dir), "--out", str(out)]
    assert main(args) == 1  # a crashed switch is a row (the others ran) and fails the exit code
    result = json.loads(out.read_text())
    rows = {row["name"]: row for row in result["switches"]}
    assert [row["name"] for row in result["switches"]] == ["baseline", "muon", "qk_norm", "relu2"]  # the table's order
    assert rows["muon"]["time_ratio"]["ratio"] == pytest.approx(0.8) and rows["baseline"]["status"] == "ok"
    assert rows["qk_norm"]["status"] == "target_missed" and "time_ratio" not in rows["qk_norm"]
    assert rows["relu2"]["status"] == "failed" and "FileNotFoundError" in rows["relu2"]["error"]
    assert "--optim.optimizer=muon" not in result["recipe"] and "--train.max_steps=60" in result["recipe"]
    assert {d for _, d in calls} == {str(data_dir)}  # the corpus is checked once, before the runs
    table = capsys.readouterr().out
    assert "| qk_norm |" in table and "target_missed" in table and "0.80x" in table
    # the default output is never a file `bench speedrun` did not write
    monkeypatch.chdir(tmp_path)
    mine = tmp_path / "benchmarks" / "suite" / "speedrun-cpu-quick.json"
    mine.parent.mkdir(parents=True)
    mine.write_text("my notes")
    assert main(["bench", "speedrun", "--quick", "--switches", "muon", "--data-dir", str(data_dir)]) == 2
    assert "not a `bench speedrun` result" in capsys.readouterr().err and mine.read_text() == "my notes"
    assert len(calls) == 4  # refused before any run
    assert main(["bench", "speedrun", "--size", "ci", "--data-dir", str(tmp_path / "nope"), "--out", str(out),
                 "--force"]) == 2 and len(calls) == 4


def test_gpt2_warmup_covers_compilation_in_every_cuda_mode(tmp_path):
    # The best switches compile the blocks on CUDA in every mode (the methodology and docs: 3 warm-up steps
    # on CUDA); fp32 and best share the shape and warm-up, so their losses are compared at the same step.
    for mode in suite_workloads.MODES:
        ctx = {device: suite_workloads.SuiteContext(mode=mode, device=device, data_dir="", data_note="",
                                                    workdir=tmp_path) for device in ("cpu", "cuda")}
        assert "--compile.scope=blocks" in WORKLOADS["gpt2_124m_best"].recipe(ctx["cuda"])
        assert suite_workloads._gpt2_shape(ctx["cuda"])[1] == 3 and suite_workloads._gpt2_shape(ctx["cpu"])[1] == 2
        assert "(warm-up steps: 3;" in " ".join(WORKLOADS["gpt2_124m_fp32"].recipe(ctx["cuda"]))


def test_checkpoint_stall_is_not_normalized_by_device_memory_on_a_gpu(tmp_path):
    # On a GPU the async stall is the copy to host memory over the host link, which the device's own copy
    # bandwidth (HBM: 3.35 TB/s on an H100, 4.8 on an H200) does not scale: normalizing by it made an unchanged
    # stall a 1.4x "regression" between the two. On a CPU the copy is in the memory the probe measures.
    assert suite_workloads.stall_normalize_by("cpu") == "memory"
    assert suite_workloads.stall_normalize_by("cuda") == "none"
    fake = suite_workloads.Workload(
        name="checkpoint_stall", title="t", metric="stall_s", unit="s", higher_is_better=False, normalize_by="memory",
        samples={"ci": 1}, methodology="m", recipe=lambda ctx: [],
        measure=lambda ctx, n: {"samples": [0.1], "secondary": {}, "normalize_by": "none",
                                "quality": {"passed": True, "criterion": "c", "value": 1.0}})
    ctx = suite_workloads.SuiteContext(mode="ci", device="cuda", data_dir="", data_note="", workdir=tmp_path)
    row = run_workload(fake, ctx, 1, {})
    assert row["status"] == "ok" and row["normalize_by"] == "none"


def test_a_crashed_workload_is_a_row_and_fails_the_exit_code(tmp_path, data_dir, monkeypatch):
    from slipstream.perf import suite
    from slipstream.perf.suite_compare import load_suite

    def workload(name, measure):
        return suite_workloads.Workload(name=name, title=name, metric="m", unit="s", higher_is_better=False,
                                        normalize_by="none", samples={"ci": 2}, methodology="m",
                                        recipe=lambda ctx: [name], measure=measure)

    def crash(ctx, n):
        raise RuntimeError("boom\nsecond line")

    ok = {"samples": [1.0, 2.0], "secondary": {}, "quality": {"passed": True, "criterion": "c", "value": 1.0}}
    fakes = [workload("crashes", crash), workload("runs", lambda ctx, n: ok),
             workload("skips", lambda ctx, n: {"skipped": "needs 2 GPUs"})]
    monkeypatch.setattr(suite, "WORKLOADS", {w.name: w for w in fakes})
    monkeypatch.setattr(suite, "measure_machine", lambda device, mode: {"device": device})
    out = tmp_path / "s.json"
    args = ["bench", "suite", "--size", "ci", "--data-dir", str(data_dir), "--out", str(out)]
    assert main(args) == 1
    rows = {w["name"]: w for w in load_suite(out)["workloads"]}  # what the suite writes, compare reads
    assert rows["crashes"]["status"] == "failed" and rows["crashes"]["error"] == "RuntimeError: boom\nsecond line"
    assert rows["runs"]["status"] == "ok" and rows["runs"]["median"] == 1.5 and rows["skips"]["status"] == "skipped"
    assert main(args) == 2  # the --out that exists needs --force
    assert main([*args, "--force", "--only", "runs", "skips"]) == 0  # skipped is no failure


def test_speedrun_table_of_a_result_without_the_val_loss_keeps_every_column():
    # results written before the rows carried the val loss at the stop (e.g. an older committed track)
    from slipstream.perf.speedrun import speedrun_table

    stats = {"median": 5.0, "ci": [4.0, 6.0]}
    row = {"name": "muon", "overrides": ["--optim.optimizer=muon"], "status": "ok", "wall_s": stats,
           "steps": {"median": 10}, "tokens": {"median": 2560}, "time_ratio": {"ratio": 0.8, "ci": [0.7, 0.9]}}
    line = speedrun_table({"switches": [row]}).splitlines()[-1]
    assert line == "| muon | `--optim.optimizer=muon` | 5.0 [4.0, 6.0] | 0.80x [0.70, 0.90] | 10 | 2560 | - |"
