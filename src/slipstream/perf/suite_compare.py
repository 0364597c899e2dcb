"""`slipstream bench compare` and `slipstream bench noise`: two suite results side by side,
and the noise band measured from repeated runs.

The statistics live in suite_stats; this module reads the files (bounded, never trusting
their shape), matches workloads by name, and prints the verdicts.
"""

from __future__ import annotations

import datetime
import json
import math
import sys
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
from slipstream.perf.suite_stats import DEFAULT_NOISE_BAND, NOISE_RULE, decide, noise_bands, ratio_ci, summarize
from slipstream.safe_read import MiB, Cap, load_json_capped

# A suite result is a few KiB per workload; the cap only stops a wrong file from being read whole.
SUITE_JSON = Cap("benchmark suite JSON", 16 * MiB, "SLIPSTREAM_MAX_SUITE_JSON_BYTES")
NOISE_BENCH = "suite_noise"  # the "bench" field of a noise file


def repository_root() -> Path:
    """The checkout this package runs from (its benchmarks/ folder holds the committed
    results), else the working directory (a pip-installed copy run in a user's project)."""
    root = Path(__file__).resolve().parents[3]
    if (root / "benchmarks").is_dir() and (root / "pyproject.toml").is_file():
        return root
    return Path.cwd()


def noise_file(device: str) -> Path:
    return repository_root() / "benchmarks" / "suite" / f"noise-{device}.json"


def _read_json(path: str | Path, what: str, fix: str) -> Any:
    """A JSON file from elsewhere, bounded; every way it can be unreadable is a UserError
    naming the file, what it should be and how to get one."""
    try:
        return load_json_capped(path, SUITE_JSON)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file; {fix}") from None
    except IsADirectoryError:
        raise UserError(f"{path} is a folder, not {what}; {fix}") from None
    except OSError as e:
        raise UserError(f"{path}: cannot read it ({e.strerror or e}); {fix}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON ({e.msg}), so not {what}; {fix}") from None


def load_noise_bands(device: str, path: str | Path | None = None, mode: str | None = None) -> dict[str, float]:
    """Workload name -> measured noise band, from `slipstream bench noise`'s file for this
    device (benchmarks/suite/noise-<device>.json unless `path` is given). No file: {}.

    With `mode`, bands measured on another mode's runs are not used ({} and a note): a mode
    runs other workloads under the same names (other sizes, sample counts and step caps), so
    their run-to-run noise says little about this mode's, and a ci run's wide band would hide
    a real regression of a full one."""
    path = Path(path) if path else noise_file(device)
    if not path.exists():
        return {}
    fix = "re-create it with `slipstream bench noise RUN.json RUN.json ...`, or delete it to use the default band"
    record = _read_json(path, "a noise band file", fix)
    workloads = record.get("workloads") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("bench") != NOISE_BENCH or not isinstance(workloads, dict):
        raise UserError(f"{path} is not a noise band file written by `slipstream bench noise`; {fix}")
    measured_mode = record.get("mode")
    if mode and measured_mode and measured_mode != mode:
        print(f"note: {path} was measured on {measured_mode} runs, not {mode}: its bands are not used "
              f"(default {DEFAULT_NOISE_BAND:.0%})", file=sys.stderr)
        return {}
    bands = {}
    for name, entry in workloads.items():
        band = entry.get("band") if isinstance(entry, dict) else None
        if isinstance(band, bool) or not isinstance(band, (int, float)) or not 0.0 <= band < 1.0:
            raise UserError(f"{path}: workload {name!r} has no valid band (a number in [0, 1)); {fix}")
        bands[name] = float(band)
    return bands


# ---------------------------------------------------------------------------- suite files

STATUSES = ("ok", "failed", "quality_failed", "skipped")
NORMALIZE_BY = ("compute", "memory", "none")
MACHINE_TOLERANCE = 0.15  # matmul peaks this close are one machine (probe's run-to-run noise on a shared VM)
SUITE_FIX = "give a result JSON written by `slipstream bench suite` (benchmarks/suite/suite-*.json)"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def load_suite(path: str | Path) -> dict[str, Any]:
    """A suite result JSON, checked for the shape this module relies on; anything else is
    a UserError naming the file, the problem and the fix."""
    suite = _read_json(path, "a benchmark suite result", SUITE_FIX)
    if not isinstance(suite, dict) or suite.get("bench") != "suite":
        raise UserError(f"{path} is not a benchmark suite result (its \"bench\" is not \"suite\"); {SUITE_FIX}")
    version = suite.get("suite_version")
    if isinstance(version, bool) or not isinstance(version, int) or version < 1:
        raise UserError(f"{path}: suite_version {version!r} is not a positive integer; the file is damaged or "
                        f"from another program; {SUITE_FIX}")
    workloads = suite.get("workloads")
    if not isinstance(workloads, list):
        raise UserError(f"{path}: \"workloads\" is not a list; {SUITE_FIX}")
    seen = set()
    for i, w in enumerate(workloads):
        name = w.get("name") if isinstance(w, dict) else None
        where = f"{path}: workload {i} ({name!r})" if isinstance(name, str) else f"{path}: workload {i}"
        if not isinstance(name, str) or not name or name in seen:
            raise UserError(f"{where} has no name or a repeated one; {SUITE_FIX}")
        seen.add(name)
        if w.get("status") not in STATUSES:
            raise UserError(f"{where}: status {w.get('status')!r} is not one of {', '.join(STATUSES)}; {SUITE_FIX}")
        samples = w.get("samples") or []
        if not isinstance(samples, list):
            raise UserError(f"{where}: \"samples\" is not a list; {SUITE_FIX}")
        if w["status"] != "ok":  # its numbers never count; a failed run may have left nulls (non-finite values)
            w["samples"] = [x for x in samples if _is_number(x)]
        elif not samples or not all(_is_number(x) for x in samples):
            raise UserError(f"{where} is \"ok\" but its samples are not a non-empty list of finite numbers; "
                            f"{SUITE_FIX}")
        if not isinstance(w.get("higher_is_better", False), bool):
            raise UserError(f"{where}: \"higher_is_better\" must be true or false; {SUITE_FIX}")
        if w.get("normalize_by", "none") not in NORMALIZE_BY:
            raise UserError(f"{where}: normalize_by {w.get('normalize_by')!r} is not one of "
                            f"{', '.join(NORMALIZE_BY)}; {SUITE_FIX}")
    for key in ("env", "machine"):
        if not isinstance(suite.get(key, {}), dict):
            raise UserError(f"{path}: \"{key}\" is not an object; {SUITE_FIX}")
    return suite


def _device(suite: dict[str, Any]) -> str:
    device = suite.get("machine", {}).get("device") or suite.get("env", {}).get("accelerator") or "cpu"
    return str(device)


def _accelerator_name(env: dict[str, Any]) -> str | None:
    devices = env.get("devices")
    if isinstance(devices, list) and devices and isinstance(devices[0], dict):
        return devices[0].get("name")
    return None


def _peak(machine: dict[str, Any], key: str, dtype: str | None = None) -> float | None:
    value = machine.get(key)
    if key == "matmul_tflops" and dtype:
        by_dtype = machine.get("matmul_tflops_by_dtype")
        value = by_dtype.get(dtype) if isinstance(by_dtype, dict) else None
    return float(value) if _is_number(value) and value > 0 else None


def machine_differences(base: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Why the two results come from different machines ([] when they look like one)."""
    reasons = []
    env_b, env_n = base.get("env", {}), new.get("env", {})
    if _device(base) != _device(new):
        reasons.append(f"device {_device(base)} vs {_device(new)}")
    for label, b, n in (("cpu", env_b.get("cpu_model"), env_n.get("cpu_model")),
                        ("accelerator", _accelerator_name(env_b), _accelerator_name(env_n))):
        if b and n and b != n:
            reasons.append(f"{label} {b!r} vs {n!r}")
    # The matmul peak tells machines of one CPU model apart (other cores or clocks behind the same
    # name). The copy bandwidth does not: on a shared VM it moved 29 % between two runs 4 minutes
    # apart on one machine (46.8 vs 36.4 GB/s, AMD EPYC, 2026-12-05), while the matmul peak moved 3 %.
    b, n = _peak(base.get("machine", {}), "matmul_tflops"), _peak(new.get("machine", {}), "matmul_tflops")
    if b and n and max(b, n) / min(b, n) > 1 + MACHINE_TOLERANCE:
        reasons.append(f"matmul_tflops {b:.3g} vs {n:.3g} TFLOP/s")
    return reasons


# ---------------------------------------------------------------------------- compare


def _peak_ratio(base: dict[str, Any], new: dict[str, Any], workload: dict[str, Any]) -> tuple[float | None, str]:
    """new machine's peak / base machine's, for the resource the workload is bound by; a
    workload with a "dtype" (bf16) uses that dtype's matmul peak when both files measured it."""
    kind = workload.get("normalize_by", "none")
    if kind == "none":
        return None, "normalize_by none: raw ratio"
    key = "matmul_tflops" if kind == "compute" else "copy_gb_s"
    dtype = workload.get("dtype") if kind == "compute" else None
    b, n = _peak(base.get("machine", {}), key, dtype), _peak(new.get("machine", {}), key, dtype)
    if dtype and not (b and n):
        b, n = _peak(base.get("machine", {}), key), _peak(new.get("machine", {}), key)
    if not (b and n):
        return None, f"not normalized: a file lacks machine.{key}"
    return n / b, ""


def _status_note(w: dict[str, Any]) -> str:
    if w["status"] == "quality_failed":
        quality = w.get("quality") if isinstance(w.get("quality"), dict) else {}
        return f"quality gate failed: {quality.get('criterion', '?')} (got {quality.get('value', '?')})"
    return f"{w['status']}: {w.get('error') or 'no reason given'}"


def _band_source(w: dict[str, Any]) -> str:
    # Files from before noise_band_source existed: their default band is the default's exact value.
    return w.get("noise_band_source") or ("default" if w.get("noise_band") == DEFAULT_NOISE_BAND else "measured")


class _Bands:
    """The noise band of a workload: --noise-band, else the larger of the two files' own
    measured bands, else the measured file for the new result's device and mode, else the
    default. A file's band that the suite marked "default" (no noise file when it ran, as for
    the runs `bench noise` measures from) is not a measurement: it must not outvote one."""

    def __init__(self, explicit: float | None, device: str, mode: str | None = None):
        self.explicit, self.device, self.mode, self._measured = explicit, device, mode, None

    def __call__(self, b: dict[str, Any], n: dict[str, Any]) -> tuple[float, str]:
        if self.explicit is not None:
            return self.explicit, "--noise-band"
        own = [w["noise_band"] for w in (b, n) if _is_number(w.get("noise_band")) and 0 <= w["noise_band"] < 1
               and _band_source(w) == "measured"]
        if own:
            return max(own), "suite files"
        if self._measured is None:
            self._measured = load_noise_bands(self.device, mode=self.mode)
        if n["name"] in self._measured:
            return self._measured[n["name"]], f"noise-{self.device}.json"
        return DEFAULT_NOISE_BAND, "default"


def compare_workload(b: dict[str, Any], n: dict[str, Any], base: dict[str, Any], new: dict[str, Any],
                     band_of: _Bands, normalize: bool) -> dict[str, Any]:
    """One row of the comparison: medians, ratio and interval, band and verdict."""
    higher = n.get("higher_is_better", False)
    row: dict[str, Any] = {"name": n["name"], "metric": n.get("metric", ""), "unit": n.get("unit", ""),
                           "higher_is_better": higher, "normalize_by": n.get("normalize_by", "none"),
                           "base_status": b["status"], "new_status": n["status"], "notes": []}
    for side, w in (("base", b), ("new", n)):
        if w["samples"]:
            stats = summarize(w["samples"])
            row[f"{side}_median"], row[f"{side}_ci"] = stats["median"], stats["ci"]
    if n["status"] in ("failed", "quality_failed"):
        row["verdict"] = "regression"
        row["notes"].append(_status_note(n))
        return row
    if n["status"] == "skipped":
        row["verdict"] = "skipped"
        row["notes"].append(_status_note(n))
        return row
    if b["status"] != "ok":
        row["verdict"] = "no baseline"
        row["notes"].append(f"base {_status_note(b)}")
        return row
    if b.get("definition") != n.get("definition"):
        if base["suite_version"] != new["suite_version"]:
            row["verdict"] = "not compared"
            row["notes"].append(f"suite version {base['suite_version']} vs {new['suite_version']} and the "
                                "definition changed: different workloads under one name")
            return row
        if base.get("mode") != new.get("mode"):  # e.g. GPT-2 at 1 x 1024 (full) vs 1 x 128 (quick)
            row["verdict"] = "not compared"
            row["notes"].append(f"{base.get('mode')} vs {new.get('mode')} mode: a different size of the workload")
            return row
        row["notes"].append("definition differs: compared anyway")
    if b.get("higher_is_better", False) != higher:
        row["notes"].append("higher_is_better differs between the files: the new file's is used")
    try:
        ratio, lo, hi = ratio_ci(b["samples"], n["samples"])
    except ValueError as e:
        row["verdict"] = "not compared"
        row["notes"].append(str(e))
        return row
    band, source = band_of(b, n)
    row.update(ratio=ratio, ratio_ci=[lo, hi], noise_band=band, band_source=source)
    if normalize:
        factor, why = _peak_ratio(base, new, n)
        if factor is not None:
            scale = (lambda r: r / factor) if higher else (lambda r: r * factor)
            row.update(peak_ratio=factor, normalized_ratio=scale(ratio), normalized_ci=[scale(lo), scale(hi)])
            lo, hi = scale(lo), scale(hi)
            row["notes"].append("verdict on the normalized ratio")
        elif why:
            row["notes"].append(why)
    row["verdict"] = decide(lo, hi, higher, band)
    return row


def compare_suites(base: dict[str, Any], new: dict[str, Any], noise_band: float | None = None) -> dict[str, Any]:
    """Two parsed suite results, workload by workload (the library half of `run_compare`)."""
    if noise_band is not None and not (_is_number(noise_band) and 0 <= noise_band < 1):
        raise UserError(f"--noise-band {noise_band} must be a fraction in [0, 1), e.g. 0.05 for 5 %")
    differences = machine_differences(base, new)
    warnings = []
    if differences:
        warnings.append("the results come from different machines (" + "; ".join(differences) + "): ratios are "
                        "also normalized by the measured peaks, and verdicts use the normalized ratio")
    if base["suite_version"] != new["suite_version"]:
        warnings.append(f"suite version {base['suite_version']} vs {new['suite_version']}: workloads whose "
                        "definition changed are not compared")
    if base.get("mode") != new.get("mode"):
        warnings.append(f"{base.get('mode')} mode vs {new.get('mode')} mode: the modes run the workloads at other "
                        "sizes, so only workloads whose definition is the same are compared; compare results of "
                        "one mode")
    band_of = _Bands(noise_band, _device(new), new.get("mode"))
    by_name = {w["name"]: w for w in base["workloads"]}
    new_names = {w["name"] for w in new["workloads"]}
    rows = []
    for n in new["workloads"]:
        if n["name"] in by_name:
            rows.append(compare_workload(by_name[n["name"]], n, base, new, band_of, bool(differences)))
        elif n["status"] in ("failed", "quality_failed"):  # a failure of the new code, baseline or not
            rows.append({"name": n["name"], "metric": n.get("metric", ""), "verdict": "regression",
                         "notes": ["only in new; " + _status_note(n)]})
        else:
            rows.append({"name": n["name"], "metric": n.get("metric", ""), "verdict": "only in new", "notes": []})
    rows += [{"name": w["name"], "metric": w.get("metric", ""), "verdict": "only in base", "notes": []}
             for w in base["workloads"] if w["name"] not in new_names]
    changed = [r["name"] for r in rows if any(note.startswith("definition differs") for note in r["notes"])]
    if changed:
        warnings.append("definition differs for " + ", ".join(changed) + ": compared anyway, read those rows "
                        "with care")
    return {"rows": rows, "regressions": [r["name"] for r in rows if r["verdict"] == "regression"],
            "improvements": [r["name"] for r in rows if r["verdict"] == "improvement"],
            "normalized": bool(differences), "machine_differences": differences, "warnings": warnings}


def run_compare(base: str | Path, new: str | Path, noise_band: float | None = None,
                as_json: bool = False) -> dict[str, Any]:
    """`slipstream bench compare BASE NEW`: print the comparison (a table, or JSON) and return
    it; the CLI exits 1 when "regressions" is not empty."""
    result = compare_suites(load_suite(base), load_suite(new), noise_band)
    result.update(base=str(base), new=str(new))
    for warning in result["warnings"]:
        print(f"warning: {warning}", file=sys.stderr)
    if as_json:
        print(json.dumps(result, indent=2, allow_nan=False))
    else:
        _print_compare(result)
    return result


def _num(value: Any) -> str:
    return f"{value:.4g}" if _is_number(value) else "-"


def _ratio_text(ratio: Any, ci: Any) -> str:
    return f"{ratio:.3f} [{ci[0]:.3f},{ci[1]:.3f}]" if _is_number(ratio) else "-"


def text_table(header: list[str], rows: list[list[str]]) -> str:
    """Columns padded to their widest cell: plain text, so a CI log of any width shows every
    cell whole (a terminal-width table would cut names and intervals short)."""
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]
    lines = [header, ["-" * w for w in widths], *rows]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(line, widths)).rstrip() for line in lines)


def _print_compare(result: dict[str, Any]) -> None:
    header = ["workload", "metric", "base", "new", "ratio [95% CI]"]
    header += ["normalized [95% CI]"] if result["normalized"] else []
    header += ["band", "verdict"]
    rows = []
    for row in result["rows"]:
        unit = f" {row['unit']}" if row.get("unit") else ""
        cells = [row["name"], row.get("metric", ""), _num(row.get("base_median")) + unit,
                 _num(row.get("new_median")) + unit, _ratio_text(row.get("ratio"), row.get("ratio_ci"))]
        if result["normalized"]:
            cells.append(_ratio_text(row.get("normalized_ratio"), row.get("normalized_ci")))
        cells += [f"{row['noise_band']:.1%}" if "noise_band" in row else "-", row["verdict"]]
        rows.append(cells)
    print(f"{result['new']} vs {result['base']}: ratio new/base of the medians")
    print(text_table(header, rows))
    for row in result["rows"]:
        for note in row["notes"]:
            print(f"  {row['name']}: {note}")
    regressions = result["regressions"]
    print(f"{len(regressions)} regression(s): {', '.join(regressions)}" if regressions else "no regressions")


# ---------------------------------------------------------------------------- noise


def _same(values: list[Any]) -> bool:
    return len({json.dumps(v, sort_keys=True) for v in values}) <= 1


def run_noise(runs: list[str], out: str = "") -> dict[str, Any]:
    """`slipstream bench noise RUN.json RUN.json ...`: the noise band of every workload from
    repeated suite runs (same commit, machine and mode), written to
    benchmarks/suite/noise-<device>.json (or `out`) for `bench suite` and `bench compare`."""
    if len(runs) < 2:
        raise UserError(f"bench noise needs two or more suite results of the same code on the same machine "
                        f"(got {len(runs)}); run `slipstream bench suite` again and pass all the JSONs")
    suites = [load_suite(path) for path in runs]
    seen: dict[str, str] = {}
    for path, suite in zip(runs, suites):  # one run twice agrees with itself: a band narrower than reruns show
        key = json.dumps([suite.get("started"), suite.get("mode"), [w["samples"] for w in suite["workloads"]]])
        if key in seen:
            raise UserError(f"{path} is the same run as {seen[key]} (same start and samples); pass each run once")
        seen[key] = str(path)
    modes = [s.get("mode") for s in suites]
    if not _same(modes):  # other sizes of the workloads: their differences are not noise
        raise UserError(f"the runs are of different suite modes ({', '.join(map(str, modes))}); a noise band is "
                        "measured from runs of one mode: pass the runs of one mode only")
    if modes[0] == "ci" and not out:
        raise UserError("ci-mode runs need --out: benchmarks/suite/noise-<device>.json holds the bands of the quick "
                        "or full runs the committed results use")
    for what, values in (("git sha", [s.get("env", {}).get("git_sha") for s in suites]),
                         ("suite version", [s["suite_version"] for s in suites])):
        if not _same(values):
            print(f"warning: the runs differ in {what} ({', '.join(map(str, values))}): the band then includes "
                  "real changes, not only noise", file=sys.stderr)
    for path, suite in zip(runs[1:], suites[1:]):
        differences = machine_differences(suites[0], suite)
        if differences:
            print(f"warning: {path} is from another machine than {runs[0]} ({'; '.join(differences)}): a noise "
                  "band is a property of one machine", file=sys.stderr)
    bands = noise_bands(suites)
    if not bands:
        raise UserError("no workload is \"ok\" with positive samples in every run, so there is nothing to measure; "
                        "pass runs of the same suite whose workloads succeeded")
    device = _device(suites[0])
    path = Path(out) if out else noise_file(device)
    if not out and path.exists():
        _refuse_foreign(path)
    skipped = sorted({w["name"] for s in suites for w in s["workloads"]} - set(bands))
    record = {"bench": NOISE_BENCH, "device": device, "mode": suites[0].get("mode"),
              "created": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
              "env": suites[0].get("env", {}),  # the machine the runs measured (not this command's)
              "rule": NOISE_RULE,
              "runs": [{"path": str(p), "git_sha": s.get("env", {}).get("git_sha"), "mode": s.get("mode"),
                        "started": s.get("started")} for p, s in zip(runs, suites)],
              "workloads": bands, "not_measured": skipped}
    from slipstream.observe.env import write_json_atomic

    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, record)
    _print_noise(record)
    print(f"wrote {path}")
    return record


def _refuse_foreign(path: Path) -> None:
    """The default noise file is replaced only when it is one `bench noise` wrote."""
    try:
        load_noise_bands("", path)
    except UserError:
        raise UserError(f"{path} exists and is not a noise band file written by `slipstream bench noise`; "
                        "move it away, or pass --out to write elsewhere") from None


def _print_noise(record: dict[str, Any]) -> None:
    rows = [[name, entry["metric"], ", ".join(f"{m:.4g}" for m in entry["run_medians"]),
             f"{entry['max_pair_diff']:.1%}", f"{entry['within_run_spread']:.1%}", f"{entry['band']:.1%}"]
            for name, entry in record["workloads"].items()]
    print(f"noise band from {len(record['runs'])} runs ({record['device']}, {record['mode']})")
    print(text_table(["workload", "metric", "run medians", "max pair diff", "within run", "band"], rows))
    if record["not_measured"]:
        print("not measured (not ok in every run): " + ", ".join(record["not_measured"]))
