"""`slipstream bench compare` and `bench noise` on synthetic suite results written here: a planted
slowdown is caught, noise is not, failed quality gates count, other machines are normalized by
their measured peaks, and damaged files are UserErrors naming the file."""

from __future__ import annotations

import json
import random

import pytest

from slipstream.errors import UserError
from slipstream.perf import suite_compare
from slipstream.perf.suite_compare import compare_suites, load_noise_bands, load_suite, run_compare, run_noise

MACHINE = {"device": "cpu", "matmul_tflops": 0.33, "matmul_tflops_by_dtype": {"fp32": 0.33}, "copy_gb_s": 12.0}


def _workload(name: str, samples: list[float], higher: bool = True, normalize_by: str = "compute",
              status: str = "ok", **extra) -> dict:
    return {"name": name, "title": name, "definition": f"{name} v1", "methodology": "3 repeats",
            "metric": "tokens_per_s" if higher else "wall_s", "unit": "tok/s" if higher else "s",
            "higher_is_better": higher, "normalize_by": normalize_by, "samples": samples, "status": status,
            "error": None, "quality": {"passed": status != "quality_failed", "criterion": "val loss <= 2.5",
                                       "value": 2.9 if status == "quality_failed" else 2.4}, **extra}


def _suite(workloads: list[dict], machine: dict | None = None, cpu: str = "Test CPU", version: int = 1,
           mode: str = "ci") -> dict:
    return {"bench": "suite", "suite_version": version, "mode": mode,
            "env": {"cpu_model": cpu, "git_sha": "abc", "accelerator": None},
            "machine": dict(machine or MACHINE), "started": "2026-12-05T15:00:00+00:00", "wall_s": 1.0,
            "workloads": workloads}


def _write(path, obj) -> str:
    path.write_text(json.dumps(obj))
    return str(path)


def _noisy(mean: float, rel: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(mean, rel * mean) for _ in range(n)]


def _row(result: dict, name: str) -> dict:
    return next(r for r in result["rows"] if r["name"] == name)


def test_a_planted_30_percent_slowdown_fails_the_cli_and_noise_does_not(tmp_path, capsys):
    from slipstream.cli import main

    base = _suite([_workload("step", _noisy(100, 0.01, 5, 1), noise_band=0.05),
                   _workload("same", _noisy(100, 0.02, 5, 2), noise_band=0.05),
                   _workload("ttt", _noisy(60, 0.02, 5, 3), higher=False, noise_band=0.05)])
    new = _suite([_workload("step", _noisy(70, 0.01, 5, 4), noise_band=0.05),
                  _workload("same", _noisy(100, 0.02, 5, 5), noise_band=0.05),
                  _workload("ttt", _noisy(60, 0.02, 5, 6), higher=False, noise_band=0.05)])
    base_path, new_path = _write(tmp_path / "base.json", base), _write(tmp_path / "new.json", new)
    assert main(["bench", "compare", base_path, new_path]) == 1
    out = capsys.readouterr().out
    assert "1 regression(s): step" in out

    result = compare_suites(load_suite(base_path), load_suite(new_path))
    step = _row(result, "step")
    assert step["verdict"] == "regression" and step["ratio"] == pytest.approx(0.7, abs=0.02)
    assert step["ratio_ci"][1] < 0.95
    assert _row(result, "same")["verdict"] == "within noise"
    assert _row(result, "ttt")["verdict"] == "within noise"
    assert result["regressions"] == ["step"] and not result["normalized"]
    # The same files the other way round: a 43 % improvement, nothing to fail on.
    assert compare_suites(load_suite(new_path), load_suite(base_path))["regressions"] == []


def test_failed_quality_gates_and_missing_workloads(tmp_path):
    base = _suite([_workload("gate", [100.0] * 3), _workload("broken_base", [1.0], status="failed"),
                   _workload("gone", [1.0] * 3)])
    new = _suite([_workload("gate", [100.0, None], status="quality_failed"), _workload("broken_base", [1.0] * 3),
                  _workload("fresh", [1.0] * 3), _workload("fresh_fail", [], status="failed")])
    result = compare_suites(load_suite(_write(tmp_path / "b.json", base)), load_suite(_write(tmp_path / "n.json", new)))
    gate = _row(result, "gate")
    assert gate["verdict"] == "regression" and "quality gate failed: val loss <= 2.5 (got 2.9)" in gate["notes"]
    assert gate["new_median"] == 100.0  # a failed run's null sample (a non-finite number) is dropped, not fatal
    assert _row(result, "broken_base")["verdict"] == "no baseline"
    assert _row(result, "gone")["verdict"] == "only in base"
    assert _row(result, "fresh")["verdict"] == "only in new"
    assert sorted(result["regressions"]) == ["fresh_fail", "gate"]


def test_one_machine_with_a_noisy_copy_probe_is_not_normalized():
    """Two runs on one shared VM: the copy bandwidth moved 29 %, the matmul peak 3 % (measured):
    still one machine, so verdicts use the raw ratios."""
    base = _suite([_workload("data", [10.0, 10.1, 9.9], normalize_by="memory")],
                  machine={"device": "cpu", "matmul_tflops": 0.198, "copy_gb_s": 46.8})
    new = _suite([_workload("data", [10.0, 10.1, 9.9], normalize_by="memory")],
                 machine={"device": "cpu", "matmul_tflops": 0.204, "copy_gb_s": 36.4})
    result = compare_suites(base, new, noise_band=0.05)
    assert not result["normalized"] and result["machine_differences"] == []
    assert _row(result, "data")["verdict"] == "within noise"


def test_other_machine_is_normalized_by_its_measured_peaks(tmp_path):
    twice = {"device": "cpu", "matmul_tflops": 0.66, "copy_gb_s": 24.0}
    base = _suite([_workload("step", [100.0, 101.0, 99.0]), _workload("ttt", [60.0, 61.0, 59.0], higher=False),
                   _workload("data", [10.0, 10.1, 9.9], normalize_by="memory"),
                   _workload("mfu", [0.4, 0.4, 0.4], normalize_by="none")])
    new = _suite([_workload("step", [200.0, 202.0, 198.0]), _workload("ttt", [30.0, 30.5, 29.5], higher=False),
                  _workload("data", [20.0, 20.2, 19.8], normalize_by="memory"),
                  _workload("mfu", [0.4, 0.4, 0.4], normalize_by="none")], machine=twice, cpu="Twice CPU")
    result = compare_suites(base, new, noise_band=0.05)
    assert result["normalized"] and any("cpu" in d for d in result["machine_differences"])
    for name, raw in (("step", 2.0), ("ttt", 0.5), ("data", 2.0)):
        row = _row(result, name)
        assert row["ratio"] == pytest.approx(raw, rel=1e-6)
        assert row["normalized_ratio"] == pytest.approx(1.0, rel=1e-6)
        assert row["verdict"] == "within noise"  # raw, it would be a 2x improvement
    assert "normalized_ratio" not in _row(result, "mfu") and _row(result, "mfu")["verdict"] == "within noise"
    # Same machine (peaks within 10 %): raw ratios decide.
    same = compare_suites(base, _suite(new["workloads"], machine={**MACHINE, "matmul_tflops": 0.35}))
    assert not same["normalized"] and _row(same, "step")["verdict"] == "improvement"


def test_noise_band_precedence_and_definitions(tmp_path, monkeypatch):
    noise_path = tmp_path / "noise-cpu.json"
    monkeypatch.setattr(suite_compare, "noise_file", lambda device: noise_path)
    base = _suite([_workload("a", [100.0] * 3), _workload("b", [100.0] * 3, noise_band=0.2),
                   _workload("c", [100.0] * 3)])
    new = _suite([_workload("a", [92.0] * 3), _workload("b", [92.0] * 3, noise_band=0.01),
                  _workload("c", [92.0] * 3, definition="c v2")])
    result = compare_suites(base, new)  # no noise file yet: the default band
    assert (_row(result, "a")["noise_band"], _row(result, "a")["band_source"]) == (0.05, "default")
    assert _row(result, "a")["verdict"] == "regression"
    assert _row(result, "b")["noise_band"] == 0.2 and _row(result, "b")["verdict"] == "within noise"
    assert "definition differs: compared anyway" in _row(result, "c")["notes"]
    assert any("definition differs for c" in w for w in result["warnings"])

    noise_path.write_text(json.dumps({"bench": "suite_noise", "workloads": {"a": {"band": 0.1}}}))
    result = compare_suites(base, new)
    assert (_row(result, "a")["noise_band"], _row(result, "a")["band_source"]) == (0.1, "noise-cpu.json")
    assert _row(result, "a")["verdict"] == "within noise"
    assert _row(compare_suites(base, new, noise_band=0.0), "b")["verdict"] == "regression"  # explicit wins
    wide = _row(compare_suites(base, new, noise_band=0.3), "a")
    assert (wide["noise_band"], wide["band_source"], wide["verdict"]) == (0.3, "--noise-band", "within noise")

    newer = _suite(new["workloads"], version=2)
    assert _row(compare_suites(base, newer), "c")["verdict"] == "not compared"
    assert _row(compare_suites(base, newer), "a")["verdict"] == "within noise"  # same definition: compared


def test_damaged_files_are_user_errors_naming_them(tmp_path, monkeypatch, capsys):
    good = _write(tmp_path / "good.json", _suite([_workload("a", [1.0])]))
    cases = {"missing.json": None, "notjson.json": "{", "other.json": {"bench": "ladder"},
             "version.json": {**_suite([]), "suite_version": "one"},
             "samples.json": _suite([_workload("a", ["fast"])]),
             "status.json": _suite([_workload("a", [1.0], status="great")])}
    for name, content in cases.items():
        path = tmp_path / name
        if content is not None:
            path.write_text(content if isinstance(content, str) else json.dumps(content))
        with pytest.raises(UserError, match=name):
            run_compare(good, str(path))
    with pytest.raises(UserError, match="noise-band"):
        compare_suites(load_suite(good), load_suite(good), noise_band=1.5)
    bad_noise = _write(tmp_path / "noise-bad.json", {"bench": "suite_noise", "workloads": {"a": {"band": "x"}}})
    with pytest.raises(UserError, match="noise-bad.json"):
        load_noise_bands("cpu", bad_noise)
    assert load_noise_bands("cpu", tmp_path / "absent.json") == {}

    assert run_compare(good, good, as_json=True)["regressions"] == []
    assert json.loads(capsys.readouterr().out)["rows"][0]["verdict"] == "within noise"


def test_run_noise_writes_the_band_file_compare_reads(tmp_path, monkeypatch, capsys):
    paths = [_write(tmp_path / f"run{i}.json", _suite([_workload("step", [m - 0.5, m, m + 0.5]),
                                                         _workload("flaky", [1.0], status="failed" if i else "ok")],
                                                        mode="quick"))
             for i, m in enumerate((100.0, 104.0, 98.0))]
    with pytest.raises(UserError, match="two or more"):
        run_noise(paths[:1])
    out = tmp_path / "noise.json"
    record = run_noise(paths, out=str(out))
    assert record["workloads"]["step"]["band"] == 0.095 and record["not_measured"] == ["flaky"]
    assert load_noise_bands("cpu", out) == {"step": 0.095}
    assert "9.5%" in capsys.readouterr().out

    default = tmp_path / "noise-cpu.json"
    monkeypatch.setattr(suite_compare, "noise_file", lambda device: default)
    default.write_text("my own notes")  # not ours: never overwritten
    with pytest.raises(UserError, match="not a noise band file"):
        run_noise(paths)
    assert default.read_text() == "my own notes"
    default.unlink()
    run_noise(paths)
    assert load_noise_bands("cpu") == {"step": 0.095}


def test_noise_bands_and_comparisons_stay_within_one_mode(tmp_path, monkeypatch, capsys):
    # The modes run other sizes under the same names: a quick run's band is not a full run's, and a
    # full result against a quick one compares GPT-2 at 1 x 1024 with GPT-2 at 1 x 128.
    noise_path = tmp_path / "noise-cpu.json"
    monkeypatch.setattr(suite_compare, "noise_file", lambda device: noise_path)
    noise_path.write_text(json.dumps({"bench": "suite_noise", "mode": "quick", "workloads": {"a": {"band": 0.3}}}))
    assert load_noise_bands("cpu", mode="quick") == {"a": 0.3}
    assert load_noise_bands("cpu", mode="full") == {} and "measured on quick runs" in capsys.readouterr().err
    base = _suite([_workload("a", [100.0] * 3)], mode="full")
    row = _row(compare_suites(base, _suite([_workload("a", [80.0] * 3)], mode="full")), "a")
    assert (row["band_source"], row["verdict"]) == ("default", "regression")  # the quick band (30 %) would hide it

    quick = _suite([_workload("a", [300.0] * 3, definition="quick: a"), _workload("b", [1.0] * 3)], mode="quick")
    full = _suite([_workload("a", [100.0] * 3, definition="full: a"), _workload("b", [1.0] * 3)], mode="full")
    result = compare_suites(quick, full)
    assert _row(result, "a")["verdict"] == "not compared" and result["regressions"] == []
    assert _row(result, "b")["verdict"] == "within noise"  # the same definition in both modes: compared
    assert any("quick mode vs full mode" in w for w in result["warnings"])

    runs = [_write(tmp_path / f"{mode}.json", _suite([_workload("a", [100.0] * 3)], mode=mode))
            for mode in ("quick", "full")]
    with pytest.raises(UserError, match="different suite modes"):
        run_noise(runs, out=str(tmp_path / "noise.json"))
    ci = [_write(tmp_path / f"ci{i}.json", _suite([_workload("a", [100.0 + i] * 3)])) for i in range(2)]
    with pytest.raises(UserError, match="ci-mode runs need --out"):
        run_noise(ci)  # never over the committed bands of the quick or full runs
    assert json.loads(noise_path.read_text())["mode"] == "quick"


def test_a_measured_band_is_used_against_a_baseline_run_before_it(tmp_path, monkeypatch):
    # The natural order: run the suite a few times, `bench noise` them, commit one run as the baseline.
    # That baseline (and any run before the noise file) carries the default band, marked as the default:
    # it must not outvote the measured one.
    noise_path = tmp_path / "noise-cpu.json"
    monkeypatch.setattr(suite_compare, "noise_file", lambda device: noise_path)
    noise_path.write_text(json.dumps({"bench": "suite_noise", "mode": "ci", "workloads": {"a": {"band": 0.02}}}))
    base = _suite([_workload("a", [100.0] * 3, noise_band=0.05, noise_band_source="default")])
    new = _suite([_workload("a", [96.0] * 3, noise_band=0.02, noise_band_source="measured")])
    row = _row(compare_suites(base, new), "a")
    assert (row["noise_band"], row["band_source"], row["verdict"]) == (0.02, "suite files", "regression")
    new["workloads"][0].update(noise_band=0.05, noise_band_source="default")  # neither file measured it
    row = _row(compare_suites(base, new), "a")
    assert (row["noise_band"], row["band_source"], row["verdict"]) == (0.02, "noise-cpu.json", "regression")
    del base["workloads"][0]["noise_band_source"]  # a file from before the field: its 5 % is the default's
    assert _row(compare_suites(base, new), "a")["band_source"] == "noise-cpu.json"
    noise_path.unlink()
    assert _row(compare_suites(base, new), "a")["verdict"] == "within noise"  # the default 5 %


def test_bench_noise_refuses_one_run_passed_twice(tmp_path):
    # The same run twice agrees with itself perfectly: a band at the floor that real reruns exceed.
    run = _suite([_workload("step", [99.0, 100.0, 101.0])], mode="quick")
    first, copy = _write(tmp_path / "a.json", run), _write(tmp_path / "b.json", run)
    for paths in ([first, first], [first, copy]):
        with pytest.raises(UserError, match="same run"):
            run_noise(paths, out=str(tmp_path / "noise.json"))
    assert not (tmp_path / "noise.json").exists()
