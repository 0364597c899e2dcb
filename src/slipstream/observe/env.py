"""Capture the environment a run executes in, and write JSON files safely.

`collect_env()` is written into every run directory so that a result can later be tied
to the exact software, hardware and code revision that produced it. `write_json_atomic`
and `to_jsonable` are shared by the other observe modules.
"""

from __future__ import annotations

import dataclasses
import datetime
import importlib.metadata
import json
import math
import os
import platform
import socket
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

# Packages whose versions commonly explain a behaviour difference between two runs.
KEY_PACKAGES = ("numpy", "rich", "tensorboard", "tokenizers", "tiktoken", "transformers", "wandb", "pyarrow", "fsspec",
                "s3fs")

GIT_TIMEOUT_S = 2.0


def to_jsonable(obj: Any) -> Any:
    """Return a copy of `obj` that `json.dumps(..., allow_nan=False)` accepts.

    Tensors and numpy values become Python numbers or lists; paths become strings;
    non-finite floats (nan, inf, -inf) become None (JSON null), because bare `NaN` is
    not valid JSON and breaks most readers other than Python's. Anything else that
    JSON cannot represent is written as `str(obj)` rather than failing a run over a log.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, torch.Tensor):
        # .item()/.tolist() copy to host; callers only log at the logging interval.
        value = obj.detach().cpu()
        return to_jsonable(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(obj, (torch.dtype, torch.device)):
        return str(obj)
    if isinstance(obj, Path):
        return str(obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    # numpy is optional here: its scalars and arrays both have .tolist().
    if type(obj).__module__ == "numpy" and hasattr(obj, "tolist"):
        return to_jsonable(obj.tolist())
    return str(obj)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> None:
    """Write `obj` as pretty JSON to `path` so readers never see a half-written file."""
    write_text_atomic(path, json.dumps(to_jsonable(obj), indent=2, sort_keys=True, allow_nan=False) + "\n")


def write_text_atomic(path: str | os.PathLike, text: str) -> None:
    """Write `text` to `path` so readers never see a half-written file.

    The data goes to a temporary file in the same directory (same filesystem, so the
    rename is atomic) and then replaces `path` with os.replace. The file keeps the mode of
    the one it replaces, or gets the umask's usual mode (mkstemp makes temporaries owner-only).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp_name, _file_mode(path))
        os.replace(tmp_name, path)
    except BaseException:
        # Leave no stray temp file behind, whatever went wrong.
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def _file_mode(path: Path) -> int:
    try:
        return path.stat().st_mode & 0o777
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def cpu_model() -> str:
    """A human-readable CPU model string, e.g. 'Intel(R) Xeon(R) Platinum 8480+'."""
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
                fields = {}
                for line in f:
                    if not line.strip() and fields:
                        break  # end of the first processor's block; the others repeat it
                    key, sep, value = line.partition(":")
                    if sep and key.strip() not in fields:
                        fields[key.strip()] = value.strip()
            # x86 reports "model name"; many ARM kernels only report "Hardware" or "Model".
            for key in ("model name", "Hardware", "Model", "cpu model"):
                if fields.get(key):
                    return fields[key]
        except OSError:
            pass
    return platform.processor() or platform.machine() or "unknown"


def _run_git(args: list[str], cwd: str) -> str | None:
    """Run one git command; None when git is missing, fails or hangs."""
    try:
        result = subprocess.run(
            ["git", *args],
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0:
        return None
    return result.stdout.strip()


def git_info(cwd: str | None = None) -> dict[str, Any]:
    """Commit sha and dirty flag of the repository containing `cwd` (default: the CWD).

    Both are None when `cwd` is not inside a git repository or git is not installed; then
    SLIPSTREAM_GIT_SHA, when set, gives the sha (a copy of a checkout without its .git, such as
    a container image or a remote machine's copy of the work tree) and the dirty flag stays None.
    """
    cwd = cwd or os.getcwd()
    sha = _run_git(["rev-parse", "HEAD"], cwd)
    if not sha:
        return {"git_sha": os.environ.get("SLIPSTREAM_GIT_SHA") or None, "git_dirty": None}
    # --no-optional-locks: never take index.lock, so we cannot disturb a concurrent git.
    status = _run_git(["--no-optional-locks", "status", "--porcelain", "--untracked-files=no"], cwd)
    dirty = None if status is None else bool(status)
    return {"git_sha": sha, "git_dirty": dirty}


def _package_versions() -> dict[str, str | None]:
    versions: dict[str, str | None] = {}
    for name in KEY_PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _nvidia_driver_version() -> str | None:
    # torch does not expose the driver version; nvidia-smi is the standard place to ask.
    try:
        result = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=5.0,
        )
    except (OSError, subprocess.SubprocessError):
        return None
    if result.returncode != 0 or not result.stdout.strip():
        return None
    return result.stdout.strip().splitlines()[0].strip()


def _accelerator_info() -> dict[str, Any]:
    """Accelerator type, count and per-device details; only touches torch.cuda on CUDA."""
    info: dict[str, Any] = {"accelerator": None, "accelerator_count": 0, "devices": []}
    accelerator = getattr(torch, "accelerator", None)
    if accelerator is None or not accelerator.is_available():
        return info
    device = accelerator.current_accelerator()
    info["accelerator"] = device.type
    info["accelerator_count"] = accelerator.device_count()
    if device.type == "cuda":
        info["cudnn_version"] = torch.backends.cudnn.version()
        try:
            nccl = torch.cuda.nccl.version()
            info["nccl_version"] = ".".join(str(x) for x in nccl) if isinstance(nccl, tuple) else str(nccl)
        except (AttributeError, RuntimeError):
            info["nccl_version"] = None
        info["driver_version"] = _nvidia_driver_version()
        for index in range(info["accelerator_count"]):
            props = torch.cuda.get_device_properties(index)
            info["devices"].append(
                {
                    "index": index,
                    "name": props.name,
                    "memory_bytes": props.total_memory,
                    "capability": f"{props.major}.{props.minor}",
                    "multi_processor_count": props.multi_processor_count,
                }
            )
    return info


def collect_env() -> dict[str, Any]:
    """A JSON-serialisable description of the software, hardware and code of this run."""
    env: dict[str, Any] = {
        "timestamp": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "python_version": platform.python_version(),
        "python_executable": sys.executable,
        "torch_version": torch.__version__,
        "torch_cuda_version": torch.version.cuda,
        "platform": platform.platform(),
        "hostname": socket.gethostname(),
        "cpu_model": cpu_model(),
        "cpu_logical_cores": os.cpu_count(),
        "torch_num_threads": torch.get_num_threads(),
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
        "argv": list(sys.argv),
        "cwd": os.getcwd(),
        "packages": _package_versions(),
    }
    env.update(_accelerator_info())
    # The sha of the slipstream code that ran (an editable/source checkout); a pip-installed
    # copy has none, then the working directory's repository (the user's project) is recorded.
    code = git_info(str(Path(__file__).resolve().parent))
    env.update(code if code["git_sha"] else git_info())
    return env
