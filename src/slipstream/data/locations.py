"""Where inputs live: local paths, or any fsspec URL (file://, memory://, s3://, gs://, hf://).

Everything that touches an input's bytes opens it through here, so one place decides how a
URL is reached and turns the errors of remote stores (missing object, no network, no
credentials, access denied) into UserErrors that name the input and the fix. Credentials
come from the environment exactly as fsspec and its backends (s3fs, gcsfs, huggingface_hub)
read them: nothing here takes or stores a secret.
"""

from __future__ import annotations

import contextlib
import io
import os
from typing import BinaryIO, Iterator

from slipstream.errors import UserError

# Shown when a store says it has no credentials: the variables its library reads.
CREDENTIAL_HINTS = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE; AWS_ENDPOINT_URL for an S3-compatible server)",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account JSON file (or run `gcloud auth application-default login`)",
    "gcs": "set GOOGLE_APPLICATION_CREDENTIALS to a service-account JSON file (or run `gcloud auth application-default login`)",
    "hf": "set HF_TOKEN (or run `huggingface-cli login`)",
}
_CREDENTIAL_ERRORS = {"NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                      "DefaultCredentialsError", "RefreshError", "GatedRepoError"}


def is_url(path: str) -> bool:
    return isinstance(path, str) and "://" in path


def protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def is_glob(path: str) -> bool:
    """A URL with a pattern (`*`, `?`, `[`) in its path: it stands for the files it matches."""
    return is_url(path) and any(c in path.split("://", 1)[1] for c in "*?[")


def translate(e: BaseException, path: str) -> UserError | None:
    """The UserError for an exception raised while reaching `path`, or None when it is not
    about reaching it (a bug, Ctrl-C: those go up unchanged). One that says the store could
    not be reached, or refused us, has `transient = True`: the input itself may be fine, so
    work done so far is worth keeping for the run after the cause is fixed."""
    err = _translate(e, path)
    if err is not None and not isinstance(e, ImportError) and (not isinstance(e, FileNotFoundError) or _unreachable(e)):
        err.transient = True
    return err


def _translate(e: BaseException, path: str) -> UserError | None:
    if isinstance(e, UserError) or not isinstance(e, Exception):
        return None
    name = type(e).__name__
    chain = [e, e.__cause__, e.__context__]
    if any(c is not None and type(c).__name__ in _CREDENTIAL_ERRORS for c in chain):
        hint = CREDENTIAL_HINTS.get(protocol(path) if is_url(path) else "", "configure the credentials its fsspec backend reads")
        return UserError(f"{path}: no credentials to read it ({type(e).__name__}); {hint}, then run again")
    if isinstance(e, FileNotFoundError) and not _unreachable(e):
        return UserError(f"input path does not exist: {path!r}; check the spelling (and, for a URL, the bucket and prefix)")
    if isinstance(e, PermissionError) or name in ("AccessDenied", "Forbidden"):
        return UserError(f"{path}: access denied ({e}); check that your credentials may read it")
    if isinstance(e, ImportError):
        return UserError(f"{path}: reading {protocol(path)}:// URLs needs a package that is not installed ({e}); "
                         f"pip install it (e.g. s3fs for s3://, gcsfs for gs://, huggingface_hub for hf://)")
    if isinstance(e, OSError) or _unreachable(e):
        c = _unreachable(e) or e
        return UserError(f"{path}: cannot be reached ({type(c).__name__}: {c}); check the URL, the network and the "
                         f"endpoint (AWS_ENDPOINT_URL for S3-compatible servers)")
    if is_url(path) and name in ("ValueError", "ClientError", "HTTPError", "ClientResponseError"):
        return UserError(f"{path}: the store refused the request ({type(e).__name__}: {e}); check the URL and your access")
    return None


def _unreachable(e: BaseException) -> BaseException | None:
    """Whether e (or what caused it: fsspec's HTTP store reports a refused connection as
    FileNotFoundError) is a failure to reach the store at all."""
    for c in (e, e.__cause__, e.__context__):
        name = type(c).__name__
        if isinstance(c, (ConnectionError, TimeoutError)) or any(w in name for w in ("Connect", "Endpoint", "Timeout")):
            return c
    return None


@contextlib.contextmanager
def reaching(path: str) -> Iterator[None]:
    """Run a block that opens or lists `path`, translating storage errors (see translate)."""
    try:
        yield
    except Exception as e:
        err = translate(e, path)
        if err is None:
            raise
        raise err from None


def _fs(url: str):
    import fsspec

    with reaching(url):
        return fsspec.core.url_to_fs(url)


def exists(path: str) -> bool:
    if not is_url(path):
        return os.path.exists(path)
    if is_glob(path):
        return bool(walk_url(path))
    fs, p = _fs(path)
    # info, not fs.exists: exists answers False when the store cannot be reached at all,
    # which would blame the spelling for a network or credentials problem.
    with reaching(path):
        try:
            fs.info(p)
        except FileNotFoundError as e:
            if _unreachable(e):
                raise
            return False
    return True


def isdir(path: str) -> bool:
    if not is_url(path):
        return os.path.isdir(path)
    if is_glob(path):
        return False
    fs, p = _fs(path)
    with reaching(path):
        return fs.isdir(p)


def size(path: str) -> int:
    if not is_url(path):
        return os.path.getsize(path)
    fs, p = _fs(path)
    with reaching(path):
        return int(fs.size(p))


def join(folder: str, name: str) -> str:
    return f"{folder.rstrip('/')}/{name}" if is_url(folder) else os.path.join(folder, name)


def open_binary(path: str) -> BinaryIO:
    """A seekable binary file object for a local path or a URL."""
    if not is_url(path):
        return open(path, "rb")
    fs, p = _fs(path)
    with reaching(path):
        f = fs.open(p, "rb")
    # fsspec's remote files take no size in readline, which the capped line reader needs.
    return f if isinstance(f, io.IOBase) and _readline_takes_size(f) else io.BufferedReader(f, 1 << 20)


def _readline_takes_size(f) -> bool:
    import inspect

    try:
        return len(inspect.signature(f.readline).parameters) >= 1
    except (TypeError, ValueError):  # a builtin without a signature: io's own readline(size=-1)
        return True


def walk_files(root: str, skip_dirs: frozenset[str] | set[str] = frozenset(), suffix: str | None = None) -> list[str]:
    """Every regular file below root (local folder or URL prefix), skipping hidden files and
    folders, sorted by relative path so the order never depends on the filesystem."""
    if is_url(root):
        return [f for f, _info in walk_url(root, suffix)]
    found = []
    # followlinks=False: a symlink loop must not hang the walk; symlinked files still count.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in skip_dirs]
        for name in filenames:
            if name.startswith(".") or (suffix and not name.endswith(suffix)):
                continue
            path = os.path.join(dirpath, name)
            if os.path.isfile(path):
                found.append(path)
    found.sort(key=lambda p: os.path.relpath(p, root).replace(os.sep, "/"))
    return found


def walk_url(root: str, suffix: str | None = None) -> list[tuple[str, dict]]:
    """(url, info) of every file below a URL prefix, sorted by relative path; a URL naming a
    file gives just that file; a glob URL the files it matches."""
    if is_glob(root):
        # The files are named from the folder above the first pattern, as the user spelled it.
        scheme, rest = root.split("://", 1)
        cut = min(rest.find(c) for c in "*?[" if c in rest)
        root = f"{scheme}://{rest[:rest.rfind('/', 0, cut) + 1]}".rstrip("/")
        fs, base = _fs(root)
        with reaching(root):
            listing = fs.glob(fs._strip_protocol(f"{scheme}://{rest}"), detail=True)
    else:
        fs, base = _fs(root)
        with reaching(root):
            if not fs.isdir(base):
                return [(root, fs.info(base))]
            listing = fs.find(base, detail=True)
    out = []
    for p, info in listing.items():
        rel = p[len(base):].lstrip("/") if p.startswith(base) else p
        if info.get("type", "file") != "file" or any(part.startswith(".") for part in rel.split("/")):
            continue
        if suffix and not rel.endswith(suffix):
            continue
        out.append((rel, info))
    out.sort(key=lambda item: item[0])
    return [(join(root, rel), info) for rel, info in out]


def url_identity(info: dict) -> str:
    """What tells a remote file's version: its ETag / checksum / mtime, whichever the store gives."""
    for key in ("ETag", "etag", "md5", "sha256", "blob_id", "mtime", "LastModified", "last_modified", "updated", "created"):
        if info.get(key) is not None:
            return f"{key}={info[key]}"
    return ""
