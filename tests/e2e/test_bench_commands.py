"""Every `slipstream bench ...` subcommand runs once at its smallest size into a temporary
output, and its JSON has the provenance keys and the same top-level keys as the committed
file under benchmarks/, so a committed result cannot silently go stale relative to the code
that writes it; every rung / row / strategy ran and did what it claims (a memory rung lowers
the peak it is meant to lower, a sharding strategy shrinks the state it shards, the planner's
rows hold measured and planned bytes within the target).

The ladders run at `--size ci`, `bench sharding` at `--size ci` (3.9M parameters), `bench pipeline`
at `--size ci` (gpipe and 1f1b at pp 2) and `bench planner` at `--cases stratified` (12 of the 52
cases): each a few seconds to tens of seconds,
mostly process start-up, torchrun and (speed ladder) the compile rungs' compilation. SLIPSTREAM_SLOW_BENCH=1
also runs each at the size its committed file was made at (minutes in all on 2 cores)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "benchmarks"
ENV_KEYS = {"git_sha", "torch_version", "python_version", "cpu_model", "packages"}
slow_bench = pytest.mark.skipif(os.environ.get("SLIPSTREAM_SLOW_BENCH") != "1",
                                reason="the committed file's size, minutes on 2 cores; SLIPSTREAM_SLOW_BENCH=1 runs it")


def _bench(*args, cwd, threads: int = 2) -> str:
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    proc = subprocess.run([sys.executable, "-m", "slipstream", "bench", *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"bench {' '.join(map(str, args))} failed ({proc.returncode}):\n" \
                                 f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def _same_shape(fresh: Path, committed: str) -> tuple[dict, dict]:
    new, old = json.loads(fresh.read_text()), json.loads((BENCH / committed).read_text())
    assert sorted(new) == sorted(old), f"{committed}: committed keys {sorted(old)}, the code writes {sorted(new)}"
    for d, who in ((new, "fresh"), (old, "committed")):
        missing = ENV_KEYS - set(d["env"])
        assert not missing, f"{who} {committed} lacks env keys {missing}"
        assert d["env"]["git_sha"], who
    assert new["env"]["torch_version"] == old["env"]["torch_version"], "committed under another torch"
    return new, old


def _rungs_ran(new: dict, old: dict) -> None:
    assert [r["rung"] for r in new["rungs"]] == [r["rung"] for r in old["rungs"]]
    for r, o in zip(new["rungs"], old["rungs"]):
        assert sorted(r) == sorted(o), r["rung"]
        assert r["tokens_per_s"] and r["step_time_s"], r  # measured (numbers, or median/min/max)
        assert r["final_loss"] == r["final_loss"], r  # not NaN


def test_bench_overhead(tmp_path, data_dir):
    _bench("overhead", "--config", ROOT / "configs" / "tiny.toml", f"--data.dir={data_dir}", "--rounds", "1",
           "--steps", "2", "--out", tmp_path / "o.json", cwd=tmp_path)
    new, _ = _same_shape(tmp_path / "o.json", "overhead-cpu.json")
    assert new["ratio"] > 0 and new["rounds"] == 1 and new["steps_per_round"] == 2


SIZES = [pytest.param("ci"), pytest.param("tiny", marks=slow_bench)]  # ci: seconds; tiny: the committed files'
LADDER_BATCH = 8  # the smallest at which the memory ladder keeps its global batch (4 micro-batches, 2 ranks)
# The ladders and the planner are checked on bytes (counted, not timed), which do not depend on the
# thread count: one thread, which other work on the 2 cores does not stall (with two, the same
# `bench planner --cases stratified` took 9 s to 62 s on a loaded machine, with one 10 s).
COUNTED = 1


@pytest.fixture(scope="module")
def ladder_run(tmp_path_factory, data_dir):
    """run(ladder, size) -> (JSON path, PNG path), from one `bench ladder both` run per size in this module."""
    runs = {}

    def run(ladder: str, size: str):
        if size not in runs:
            out = tmp_path_factory.mktemp(f"ladders-{size}")
            _bench("ladder", "both", "--size", size, "--repeats", "1", "--steps", "2", "--batch", LADDER_BATCH,
                   "--data-dir", data_dir, "--out-dir", out, cwd=out, threads=COUNTED)
            runs[size] = out
        out = runs[size]
        names = [f"ladder-{which}-cpu-{size}.{ext}" for which in ("memory", "speed") for ext in ("json", "png")]
        assert sorted(p.name for p in out.iterdir()) == sorted(names)
        return out / f"ladder-{ladder}-cpu-{size}.json", out / f"ladder-{ladder}-cpu-{size}.png"
    return run


def _is_png(path: Path) -> bool:
    return path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 1000


def _by_rung(result: dict, key: str) -> dict[str, int | float | None]:
    return {r["rung"]: (r.get(key) or {}).get("median") for r in result["rungs"]}


@pytest.mark.parametrize("ladder", ["memory", "speed"])
@pytest.mark.parametrize("size", SIZES)
def test_bench_ladder_json_has_the_committed_shape(ladder_run, ladder, size):
    fresh, _ = ladder_run(ladder, size)
    new, old = _same_shape(fresh, f"ladder-{ladder}-cpu-tiny.json")
    _rungs_ran(new, old)
    for prev, rung in zip(new["rungs"], new["rungs"][1:]):  # cumulative: each rung adds to the one before
        assert rung["overrides"][:len(prev["overrides"])] == prev["overrides"], rung["rung"]


@pytest.mark.parametrize("size", SIZES)
def test_bench_ladder_memory_rungs_lower_what_they_claim(ladder_run, size):
    fresh, png = ladder_run("memory", size)
    result = json.loads(fresh.read_text())
    assert result["size"] == size and result["batch"] == LADDER_BATCH and result["repeats"] == 1
    peak, opt_peak = _by_rung(result, "peak_bytes"), _by_rung(result, "optimizer_phase_peak_bytes")
    assert all(peak.values()), peak
    assert peak["grad accumulation"] < peak["baseline"], peak  # a quarter of the activations at a time
    assert peak["activation checkpointing"] < peak["grad accumulation"], peak
    # in-backward steps free each gradient as it is used: the saving shows in the optimizer phase
    assert opt_peak["optimizer in backward"] < opt_peak["activation checkpointing"], opt_peak
    # offload keeps fp32 master weights with the Adam state (on CPU in the same memory: no saving)
    cats = {r["rung"]: r["memory_breakdown"].get("categories") for r in result["rungs"]}
    assert cats["optimizer offload"]["optimizer_state"] > cats["activation checkpointing"]["optimizer_state"], cats
    sharded = result["rungs"][-1]
    assert sharded["rung"] == "sharding (fsdp x2)" and len(sharded["memory_breakdown"]["ranks"]) == 2
    assert peak["sharding (fsdp x2)"] < min(v for k, v in peak.items() if k != "sharding (fsdp x2)"), peak
    assert _is_png(png)


@pytest.mark.parametrize("size", SIZES)
def test_bench_ladder_speed_rungs_switch_what_they_claim(ladder_run, size):
    fresh, png = ladder_run("speed", size)
    result = json.loads(fresh.read_text())
    assert result["size"] == size and result["augment_cost_ms"] > 0
    rungs = {r["rung"]: r for r in result["rungs"]}
    assert "--data.augment=swap_tokens" in rungs["baseline"]["overrides"]
    assert all(r["tokens_per_s"]["median"] > 0 for r in result["rungs"])
    peak = _by_rung(result, "peak_bytes")
    assert peak["larger batch"] > peak["baseline"], peak  # the batch grew 4x: more activations
    # memory is not tracked under torch.compile: its absence from the compile rung on shows compile was on
    compiled = [r["rung"] for r in result["rungs"]][4:]
    assert compiled[0] == "compile" and all(peak[name] is None for name in compiled), peak
    assert all(peak[name] for name in peak if name not in compiled), peak
    assert _is_png(png)


def test_bench_checkpoint(tmp_path):
    _bench("checkpoint", "--repeats", "1", "--model.n_layer=1", "--model.d_model=64", "--model.n_head=2",
           "--out", tmp_path / "c.json", cwd=tmp_path)
    new, old = _same_shape(tmp_path / "c.json", "checkpoint-cpu.json")
    assert sorted(new["results"]) == sorted(old["results"]) == ["async", "sync"]
    assert new["state_bytes"] < old["state_bytes"]  # the override reached the benchmark
    assert new["stall_ratio_async_vs_sync"] > 0


def test_bench_fused_ce(tmp_path):
    _bench("fused-ce", "--rows", "64", "--d", "16", "--vocab", "128", "--dtype", "float32", "bfloat16",
           "--chunk-size", "32", "--repeats", "1", "--device", "cpu", "--out", tmp_path / "f.json", cwd=tmp_path)
    new, old = _same_shape(tmp_path / "f.json", "fused-ce-cpu.json")
    assert len(new["cases"]) == 2 and [c["dtype"] for c in new["cases"]] == ["float32", "bfloat16"]
    for c in new["cases"]:
        assert sorted(c) == sorted(old["cases"][0])
        assert c["fused_ms"] > 0 and c["unfused_ms"] > 0 and c["loss_abs_diff"] < 1e-2


@pytest.mark.parametrize("size", [pytest.param("ci"), pytest.param("default", marks=slow_bench)])
def test_bench_sharding(tmp_path, data_dir, size):
    from slipstream.perf.sharding import SIZES as SHARDING_SIZES

    strategies = ["ddp", "zero1", "zero2", "fsdp"]
    _bench("sharding", "--nproc", "2", "--strategies", *strategies, "--steps", "2", "--size", size,
           "--data-dir", data_dir, "--out", tmp_path / "s.json", cwd=tmp_path)
    new, _ = _same_shape(tmp_path / "s.json", "sharding-cpu.json")
    assert new["overrides"][:len(SHARDING_SIZES[size])] == SHARDING_SIZES[size]
    assert [s["strategy"] for s in new["strategies"]] == strategies
    assert all(len(s["ranks"]) == 2 and s["max_step_peak_bytes"] > 0 for s in new["strategies"])
    peaks = [s["max_step_peak_bytes"] for s in new["strategies"]]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4, peaks  # each shards more per rank
    # What each strategy shards, at the end of backward (every gradient exists): half of it per rank.
    # zero2 is FSDP2 without resharding after forward: its storage is sharded like fsdp's; it keeps
    # the gathered parameters from forward through backward, hence its higher step peak.
    full, *sharded = [s["ranks"][0]["end_of_backward"] for s in new["strategies"]]
    halves = {"zero1": ["optimizer_state"], "zero2": ["optimizer_state", "gradients", "parameters"],
              "fsdp": ["optimizer_state", "gradients", "parameters"]}
    for name, cats in zip(strategies[1:], sharded):
        for cat in ("optimizer_state", "gradients", "parameters"):
            expected = full[cat] / 2 if cat in halves[name] else full[cat]
            assert cats[cat] == pytest.approx(expected, rel=0.01), (name, cat, cats[cat], full[cat])


def _check_pipeline_rungs(result: dict, rung_keys: list[str], rank_keys: list[str]) -> None:
    """Every rung ran on every rank, its stages hold every block once, its bubbles are fractions
    and its planned bubble is plan/timing.pipeline_bubble's."""
    from slipstream.plan.timing import pipeline_bubble

    n_layer = int(next(o.split("=")[1] for o in result["overrides"] if o.startswith("--model.n_layer=")))
    for r in result["rungs"]:
        assert sorted(r) == rung_keys, r["rung"]
        assert len(r["ranks"]) == r["world"] == r["pp"] * r["dp"], r["rung"]
        assert all(sorted(k) == rank_keys for k in r["ranks"]), r["rung"]
        stages = {int(i): blocks for k in r["ranks"] for i, blocks in k["stages"].items()}  # dp replicas agree
        assert sorted(stages) == list(range(r["pp"] * r["virtual_stages"])), r["rung"]
        assert sorted(b for blocks in stages.values() for b in blocks) == list(range(n_layer)), r["rung"]
        assert r["timed_steps"] == result["steps"] - 2 == len(r["bubble_measured_by_step"]), r["rung"]
        assert r["step_time_s"] > 0 and r["tokens_per_s"] > 0 and r["final_loss"] == r["final_loss"], r["rung"]
        assert all(0 <= b < 1 for b in r["bubble_measured_by_step"]) and 0 <= r["bubble_measured"] < 1, r["rung"]
        assert r["bubble_planned"] == pytest.approx(
            pipeline_bubble(r["schedule"], r["pp"], r["virtual_stages"], r["microbatches"])), r["rung"]


def test_bench_pipeline(tmp_path, data_dir):
    from slipstream.perf.pipeline_bench import SIZES as PIPELINE_SIZES
    from slipstream.plan.space import SCHEDULE_VIRTUAL

    _bench("pipeline", "--size", "ci", "--data-dir", data_dir, "--out", tmp_path / "pp.json", cwd=tmp_path)
    new, old = _same_shape(tmp_path / "pp.json", "pipeline-cpu.json")
    rung_keys, rank_keys = sorted(old["rungs"][0]), sorted(old["rungs"][0]["ranks"][0])
    model, schedules, _, _ = PIPELINE_SIZES["ci"]
    assert new["size"] == "ci" and new["overrides"][:len(model)] == model
    assert [(r["schedule"], r["world"]) for r in new["rungs"]] == [(s, 2) for s in schedules]
    _check_pipeline_rungs(new, rung_keys, rank_keys)
    for r in new["rungs"]:  # memory measured on every rank
        assert r["memory_error"] is None, r["memory_error"]
        assert all(k["step_peak_bytes"] > 0 and k["activations_bytes"] > 0 for k in r["ranks"]), r["rung"]
    # activations in flight on the first stage: GPipe all micro-batches', 1F1B at most pp of them
    first = {r["schedule"]: r["ranks"][0]["activations_bytes"] for r in new["rungs"]}
    assert first["gpipe"] > first["1f1b"], first
    # the committed file: every schedule at world 2 and 4, planned by the formula in use now
    assert {(r["schedule"], r["world"]) for r in old["rungs"]} == {(s, w) for s in SCHEDULE_VIRTUAL for w in (2, 4)}
    _check_pipeline_rungs(old, rung_keys, rank_keys)


@pytest.mark.parametrize("cases", [pytest.param("stratified"), pytest.param("grid", marks=slow_bench)])
def test_bench_planner(tmp_path, cases):
    from slipstream.plan.accuracy import TARGET_ERROR
    from slipstream.plan.accuracy_cases import default_cases, stratified_cases

    # exit 0: the worst error within the target
    _bench("planner", "--cases", cases, "--out", tmp_path / "p.json", cwd=tmp_path, threads=COUNTED)
    new, old = _same_shape(tmp_path / "p.json", "planner-accuracy-cpu.json")
    expected = stratified_cases() if cases == "stratified" else default_cases()
    assert [r["case"] for r in new["memory_cases"]] == [c.label() for c in expected]
    committed = {r["case"]: r for r in old["memory_cases"]}
    for r in new["memory_cases"]:
        assert sorted(r) == sorted(committed[r["case"]]), r["case"]
        assert r["measured_bytes"] > 0 and r["planned_bytes"] > 0, r
        assert r["error"] == pytest.approx((r["planned_bytes"] - r["measured_bytes"]) / r["measured_bytes"])
        assert abs(r["error"]) <= TARGET_ERROR, r
        # the same case measured and planned as in the committed file
        assert r["planned_bytes"] == committed[r["case"]]["planned_bytes"], r["case"]
        assert r["measured_bytes"] == pytest.approx(committed[r["case"]]["measured_bytes"], rel=1e-2), r["case"]
    assert new["memory_worst_error"] == max(abs(r["error"]) for r in new["memory_cases"])
    assert [r["run"] for r in new["published"]] == [r["run"] for r in old["published"]]
