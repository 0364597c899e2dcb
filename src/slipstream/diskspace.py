"""A full disk, told plainly.

Writers fail on a full disk in many disguises: an OSError with errno ENOSPC, DCP's
CheckpointException holding one per rank, or torch.save's zip writer reporting only
"unexpected pos" (it loses the errno). `is_disk_full` looks behind the wrappers and, where the
error says nothing, asks the filesystem itself whether the bytes still fit. `DiskFullError`
is the one message: where, "no space left on device", the bytes needed and the bytes free.
"""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

from slipstream.errors import UserError

_FULL = (errno.ENOSPC, errno.EDQUOT)


class DiskFullError(UserError):
    """A write that ran out of disk space; the message names the path and the sizes."""


def free_bytes(path: str | Path) -> int | None:
    """Free bytes on the filesystem holding `path` (its nearest existing parent); None if unknown."""
    probe = Path(path).absolute()
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        return shutil.disk_usage(probe).free
    except OSError:
        return None


def _causes(error: BaseException):
    """The error and everything it wraps: causes, contexts, DCP's per-rank (exception, trace) pairs."""
    seen, stack = set(), [error]
    while stack:
        e = stack.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        yield e
        stack += [e.__cause__, e.__context__]
        failures = getattr(e, "failures", None)  # torch.distributed.checkpoint.api.CheckpointException
        if isinstance(failures, dict):
            stack += [pair[0] if isinstance(pair, tuple) else pair for pair in failures.values()]


def is_disk_full(error: BaseException, folder: str | Path | None = None, needed: int = 0) -> bool:
    """True when `error` comes from a full disk: ENOSPC (or a quota) anywhere inside it, or,
    given the `folder` written to, fewer than `needed` bytes free there now (call it after
    removing the partial output, so that the check sees what a retry would have)."""
    for e in _causes(error):
        if isinstance(e, OSError) and e.errno in _FULL:
            return True
        if "No space left on device" in str(e) or "Disk quota exceeded" in str(e):
            return True
    if folder is not None and needed > 0:
        free = free_bytes(folder)
        return free is not None and free < needed
    return False


def disk_full_error(what: str, path: str | Path, needed: int | None, after: str = "") -> DiskFullError:
    """The DiskFullError of writing `what` to `path`: `needed` bytes (None: unknown), the bytes
    free there now, and `after`: what was kept (the last good checkpoint, the old data)."""
    free = free_bytes(path)
    sizes = []
    if needed:
        sizes.append(f"it needs about {needed:,} bytes")
    if free is not None:
        sizes.append(f"{free:,} bytes are free there")
    detail = f" ({', '.join(sizes)})" if sizes else ""
    tail = f"; {after}" if after else ""
    return DiskFullError(f"no space left on device while writing {what} to '{path}'{detail}{tail}. Free some space "
                         "(or choose a folder on a larger disk) and run again")
