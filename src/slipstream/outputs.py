"""Named outputs: a file the user names on the command line (`--out`, `--write-config`) is
never replaced silently.

Every command that writes such a file checks it here before doing any work (a benchmark
that runs for minutes must not fail at the end, nor overwrite a file the user cared
about), and writes it atomically (a temp file, then a rename) so `--force` replaces the
old file in one step: a reader sees the old file or the new one, never half of either.
"""

from __future__ import annotations

import os
from pathlib import Path

from slipstream.errors import UserError


def refuse_existing(path: str | os.PathLike | None, force: bool, flag: str = "--out", what: str = "") -> None:
    """UserError when `path` (set by `flag`; `what` names it when it is not the flag's own value)
    already exists and `force` is not set."""
    if not path:
        return
    p = Path(path).expanduser()
    name = what or flag
    if p.is_dir():
        raise UserError(f"{name} '{path}' is a folder; give the file to write with {flag}")
    if (p.exists() or p.is_symlink()) and not force:
        raise UserError(f"{name} '{path}' already exists; pass --force to overwrite it, or choose another {flag}")


def refuse_same_file(path: str | os.PathLike, protected: list[str | os.PathLike], flag: str, what: str) -> None:
    """UserError when `path` is one of the `protected` files (an input): not even --force
    may write a command's output over the file it reads."""
    target = Path(path).expanduser().resolve()
    for other in protected:
        if other and Path(other).expanduser().is_file() and Path(other).expanduser().resolve() == target:
            raise UserError(f"{flag} '{path}' is {what}; writing it would destroy that file: choose another {flag}")
