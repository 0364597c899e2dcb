"""Reading prepared data from a URL or a local path with fsspec: whole small files with a
byte cap, byte ranges, sizes; transient errors are retried, the others fail at once.

Any fsspec URL works (s3://, gs://, hf://, http(s)://, file://, or a plain path). Credentials
come from the environment exactly as the filesystem's library reads them; slipstream passes
none. For S3 that is botocore's chain: AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY
(/ AWS_SESSION_TOKEN), AWS_PROFILE and ~/.aws/credentials, or an instance role; and
botocore honours AWS_ENDPOINT_URL (or AWS_ENDPOINT_URL_S3), so an S3-compatible server
(MinIO, Ceph, a moto test server) needs only that variable: checked with s3fs 2026.9.0 /
botocore 1.43 against a moto server (tests/unit/test_streaming.py). Each attempt here
includes the library's own quick retries (botocore: about 3 s on a closed port).

Errors, judged by the exception's type (library-agnostic: by class name where the class
lives in an optional library):
  - transient: connection reset / refused / aborted mid-run, timeouts, HTTP 5xx, throttling
    (SlowDown, 429, 503): retried up to `retries` attempts, waiting BACKOFF_S, then twice
    that, ... (at most MAX_BACKOFF_S); then a UserError naming the URL, the attempts and the
    last error. A 4xx status other than 408 / 429 is not transient, even inside an OSError.
  - at once: not found, access denied, missing credentials (naming the variables to set),
    and an unreachable host on the first contact (the URL is wrong or the server is down:
    waiting would not help, and the run has not started yet).
"""

from __future__ import annotations

import errno
import os
import posixpath
import sys
import time
from typing import Callable, TypeVar

from slipstream.errors import UserError
from slipstream.safe_read import Cap

T = TypeVar("T")
BACKOFF_S = 0.5  # first wait between attempts; doubles each time (tests lower it)
MAX_BACKOFF_S = 30.0  # ... up to this: a large data.retries waits longer in all, never hours per attempt

_TRANSIENT_ERRNOS = {errno.ECONNRESET, errno.ECONNREFUSED, errno.ECONNABORTED, errno.ETIMEDOUT, errno.EPIPE,
                     errno.EHOSTUNREACH, errno.ENETUNREACH, errno.ENETDOWN, errno.EAGAIN, errno.EBUSY, errno.EIO,
                     getattr(errno, "EREMOTEIO", 121)}
# Class names of the network errors of botocore, aiohttp, urllib3, requests and gcsfs.
_TRANSIENT_NAMES = ("ConnectionClosedError", "ReadTimeoutError", "ConnectTimeoutError", "ResponseStreamingError",
                    "IncompleteReadError", "ClientPayloadError", "ServerDisconnectedError", "ProtocolError",
                    "ChunkedEncodingError", "IncompleteRead", "HttpError", "TransportError", "FSTimeoutError",
                    "EndpointConnectionError", "ClientConnectorError", "ClientOSError", "ConnectionError")
_UNREACHABLE_NAMES = ("EndpointConnectionError", "ClientConnectorError", "NameResolutionError", "gaierror",
                      "ConnectionRefusedError", "NewConnectionError", "ConnectTimeoutError")
_CREDENTIAL_NAMES = ("NoCredentialsError", "PartialCredentialsError", "CredentialRetrievalError",
                     "NoAuthTokenError", "DefaultCredentialsError", "RefreshError", "ProfileNotFound")
_THROTTLE_CODES = ("SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
                   "RequestTimeout", "InternalError", "ServiceUnavailable", "503", "500", "502", "504")


class RemoteMissing(UserError):
    """The file does not exist at the URL (callers may say what that means for them)."""


def _names(e: BaseException) -> set[str]:
    return {cls.__name__ for cls in type(e).__mro__}


def _status(e: BaseException) -> int | None:
    """The HTTP status of an error that carries one (aiohttp, botocore, gcsfs)."""
    for attr in ("status", "code", "status_code"):
        value = getattr(e, attr, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    response = getattr(e, "response", None)
    if isinstance(response, dict):
        value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        return value if isinstance(value, int) else None
    return None


def _code(e: BaseException) -> str:
    response = getattr(e, "response", None)
    return str(response.get("Error", {}).get("Code", "")) if isinstance(response, dict) else ""


def is_transient(e: BaseException) -> bool:
    """A failure that a later attempt may not see: the network or an overloaded server.

    What the server said decides first, wherever in the chain it is (s3fs wraps an S3 error
    code it does not know in OSError(EIO), its cause the ClientError): a throttling code or a
    5xx / 408 / 429 status is transient, any other 4xx is the request's fault and is not."""
    chain = [err for err in (e, e.__cause__) if err is not None]
    if any(isinstance(err, (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError))
           for err in chain):
        return False
    for err in chain:
        if _code(err) in _THROTTLE_CODES:
            return True
        status = _status(err)
        if status is not None and status >= 400:
            return status >= 500 or status in (408, 429)
    for err in chain:
        if isinstance(err, (ConnectionError, TimeoutError)) or _names(err) & set(_TRANSIENT_NAMES):
            return True
        if isinstance(err, OSError) and err.errno in _TRANSIENT_ERRNOS:
            return True
    return False


def _credential_hint(url: str) -> str:
    scheme = url.split("://", 1)[0] if "://" in url else "file"
    if scheme in ("s3", "s3a"):
        return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and AWS_SESSION_TOKEN for temporary keys), or "
                "AWS_PROFILE with ~/.aws/credentials; for an S3-compatible server also AWS_ENDPOINT_URL")
    if scheme in ("gs", "gcs"):
        return "set GOOGLE_APPLICATION_CREDENTIALS to a service-account key file, or run `gcloud auth application-default login`"
    if scheme == "hf":
        return "set HF_TOKEN, or run `huggingface-cli login`"
    return "set the credentials this storage's fsspec library reads from the environment"


def _endpoint_hint(url: str) -> str:
    endpoint = os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    if url.startswith(("s3://", "s3a://")):
        where = f"AWS_ENDPOINT_URL={endpoint}" if endpoint else "the AWS endpoint (AWS_ENDPOINT_URL is not set)"
        return f"check the bucket name, {where}, that the server is running, and the network"
    return "check the address, that the server is running, and the network"


class Remote:
    """A folder of prepared data at `url`: files are named relative to it."""

    def __init__(self, url: str, retries: int = 5) -> None:
        import fsspec

        if retries < 1:
            raise UserError(f"data.retries={retries} must be >= 1")
        self.url, self.retries = url.rstrip("/") or url, retries
        self.reached = False  # no request has succeeded yet: an unreachable host is a setup error
        self.whole_files = False  # the server answered a byte range with the whole file (said once)
        try:
            self.fs, root = fsspec.core.url_to_fs(self.url)
        except (ImportError, ValueError) as e:
            raise UserError(f"cannot open {url!r} ({e}); use a local folder or an fsspec URL (s3://, gs://, "
                            "hf://, http(s)://, file://) whose library is installed") from None
        self.root = root.rstrip("/") or root
        self.local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def where(self, name: str) -> str:
        """The URL of a file of the folder, as the user would write it."""
        return f"{self.url}/{name}"

    def _path(self, name: str) -> str:
        return posixpath.join(self.root, name) if not self.local else os.path.join(self.root, name)

    def call(self, name: str, what: str, fn: Callable[[], T]) -> T:
        """fn() with retries on transient errors (see module doc); every other error is a
        UserError naming the file and what to check."""
        url, wait = self.where(name), BACKOFF_S
        for attempt in range(1, self.retries + 1):
            try:
                result = fn()
                self.reached = True
                return result
            except UserError:
                raise
            except Exception as e:  # noqa: BLE001  (classified here; anything unknown fails at once below)
                fatal = self._fatal(e, url, what)
                if fatal is not None:
                    raise fatal from None
                if attempt == self.retries:
                    raise UserError(f"{what} {url} failed {attempt} time(s) with transient errors, the last: "
                                    f"{type(e).__name__}: {e}; {_endpoint_hint(self.url)}, or raise data.retries "
                                    f"(now {self.retries})") from None
                time.sleep(wait)  # backing off: the server is overloaded or the network is down for a moment
                wait = min(wait * 2, MAX_BACKOFF_S)
        raise AssertionError("unreachable")

    def _fatal(self, e: Exception, url: str, what: str) -> UserError | None:
        names = _names(e) | (_names(e.__cause__) if e.__cause__ is not None else set())
        if names & set(_CREDENTIAL_NAMES):
            return UserError(f"no credentials to read {url} ({type(e).__name__}: {e}); {_credential_hint(self.url)}")
        if isinstance(e, FileNotFoundError):
            return RemoteMissing(f"{url} does not exist; check data.dir and that the whole folder written by "
                             "`slipstream data prepare` was uploaded there")
        if isinstance(e, PermissionError) or _status(e) in (401, 403):
            return UserError(f"access denied reading {url} ({e}); check that these credentials may read it: "
                             f"{_credential_hint(self.url)}")
        if not self.reached and names & set(_UNREACHABLE_NAMES):
            return UserError(f"cannot reach {url} ({type(e).__name__}: {e}); {_endpoint_hint(self.url)}")
        if not is_transient(e):
            status = _status(e.__cause__) if e.__cause__ is not None else _status(e)
            said = f" (HTTP {status})" if status is not None and _status(e) is None else ""
            return UserError(f"{what} {url} failed{said}: {type(e).__name__}: {e}; retrying would not help: check "
                             "the URL in data.dir (or data.sources) and that the whole folder written by "
                             "`slipstream data prepare` was uploaded there")
        return None

    def size(self, name: str) -> int:
        # Blocks on the network (one metadata request): called at start and from download threads.
        return int(self.call(name, "finding the size of", lambda: self.fs.size(self._path(name))))

    def read_range(self, name: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of a file; fewer bytes than asked is an error (the file shrank)."""
        # Blocks on the network: the caller is a download thread or the start of a run.
        data = self.call(name, "reading", lambda: self.fs.cat_file(self._path(name), start=start, end=end))
        if len(data) > end - start and len(data) >= end:
            # A plain HTTP server without Range support answers with the whole file (200, not 206).
            data = data[start:end]
            if not self.whole_files:
                self.whole_files = True
                print(f"warning: the server of {self.where(name)} ignores byte-range requests (HTTP Range) and sends "
                      f"whole files: every chunk read downloads its whole shard to keep a part of it (here "
                      f"{end - start:,} bytes); serve the data with Range support (any object store, nginx) or "
                      "prepare it without --chunk-tokens", file=sys.stderr, flush=True)
        if len(data) != end - start:
            raise UserError(f"{self.where(name)}: reading bytes {start:,} to {end:,} returned {len(data):,} bytes; "
                            "the remote data changed since its manifest was written: run "
                            "`slipstream data prepare` again and upload the whole folder")
        return data

    def read_small(self, name: str, cap: Cap) -> bytes:
        """A whole small file (manifest, tokenizer), refusing one larger than cap: remote data is untrusted."""
        size = self.size(name)
        if size > cap.limit:
            raise cap.exceeded(self.where(name), size)
        # Blocks on the network. end = cap + 1: a file that grew since size() still cannot exceed the cap.
        data = self.call(name, "reading", lambda: self.fs.cat_file(self._path(name), start=0, end=cap.limit + 1))
        if len(data) > cap.limit:
            raise cap.exceeded(self.where(name), len(data))
        return data
