"""`slipstream bench compare` and `slipstream bench noise`: two suite results side by side,
and the noise band measured from repeated runs.

The statistics live in suite_stats; this module reads the files (bounded, never trusting
their shape), matches workloads by name, and prints the verdicts.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from slipstream.errors import UserError
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


def load_noise_bands(device: str, path: str | Path | None = None) -> dict[str, float]:
    """Workload name -> measured noise band, from `slipstream bench noise`'s file for this
    device (benchmarks/suite/noise-<device>.json unless `path` is given). No file: {}."""
    path = Path(path) if path else noise_file(device)
    if not path.exists():
        return {}
    fix = "re-create it with `slipstream bench noise RUN.json RUN.json ...`, or delete it to use the default band"
    record = _read_json(path, "a noise band file", fix)
    workloads = record.get("workloads") if isinstance(record, dict) else None
    if not isinstance(record, dict) or record.get("bench") != NOISE_BENCH or not isinstance(workloads, dict):
        raise UserError(f"{path} is not a noise band file written by `slipstream bench noise`; {fix}")
    bands = {}
    for name, entry in workloads.items():
        band = entry.get("band") if isinstance(entry, dict) else None
        if isinstance(band, bool) or not isinstance(band, (int, float)) or not 0.0 <= band < 1.0:
            raise UserError(f"{path}: workload {name!r} has no valid band (a number in [0, 1)); {fix}")
        bands[name] = float(band)
    return bands
