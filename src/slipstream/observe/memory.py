"""Memory use of the training device, for logs and the run summary.

CUDA: bytes held by tensors through PyTorch's caching allocator (torch.cuda.*_memory_allocated);
the peak can be reset, e.g. after warm-up, to measure steady-state training.

Everything else (CPU, and devices without a dedicated API here): the resident set size
(RSS) of this whole process. That includes the Python interpreter, libraries and data
loader buffers, not only tensors, and the operating system keeps the process peak for
the lifetime of the process, so on these devices `reset_peak_memory` is a no-op and the
peak is the peak since the process started.
"""

from __future__ import annotations

import os
import sys

import torch


def _is_cuda(device: str | torch.device) -> bool:
    return torch.device(device).type == "cuda"


def reset_peak_memory(device: str | torch.device) -> None:
    """Start a new peak measurement on CUDA; a no-op elsewhere (process peak RSS cannot be reset)."""
    if _is_cuda(device):
        torch.cuda.reset_peak_memory_stats(torch.device(device))


def _peak_rss_bytes() -> int:
    import resource  # Unix only; imported here so the module still imports on Windows.

    maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # ru_maxrss is in bytes on macOS but in KiB on Linux (and the other Unixes).
    return int(maxrss) if sys.platform == "darwin" else int(maxrss) * 1024


def _current_rss_bytes() -> int:
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            resident_pages = int(f.read().split()[1])
        return resident_pages * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        # No /proc (e.g. macOS): the peak is the best cheap upper bound we have.
        return _peak_rss_bytes()


def peak_memory_bytes(device: str | torch.device) -> int:
    """Peak bytes allocated on a CUDA device since the last reset; on CPU, the process peak RSS."""
    if _is_cuda(device):
        return int(torch.cuda.max_memory_allocated(torch.device(device)))
    return _peak_rss_bytes()


def current_memory_bytes(device: str | torch.device) -> int:
    """Bytes allocated now on a CUDA device; on CPU, the current process RSS."""
    if _is_cuda(device):
        return int(torch.cuda.memory_allocated(torch.device(device)))
    return _current_rss_bytes()
