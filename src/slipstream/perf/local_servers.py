"""Local stand-ins for remote storage, started by `slipstream bench data` (and usable by tests):
a plain HTTP file server that answers byte-range requests, and a moto S3-compatible server.

Both bind 127.0.0.1 on a free port, serve from this process's threads and stop on close(),
so a benchmark measures the real remote-read path (fsspec, HTTP, the S3 protocol) without a
network or credentials.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import threading
from functools import partial
from pathlib import Path

from slipstream.errors import UserError

RANGE = re.compile(r"bytes=(\d+)-(\d*)$")


class _RangeHandler(http.server.SimpleHTTPRequestHandler):
    """SimpleHTTPRequestHandler plus single byte ranges (`Range: bytes=a-b`), which fsspec's
    HTTP filesystem sends for every partial read; the stdlib handler would send the whole file."""

    def log_message(self, *args) -> None:  # a benchmark's console is not an access log
        pass

    def send_head(self):
        match = RANGE.match(self.headers.get("Range", ""))
        path = self.translate_path(self.path)
        if not match or not os.path.isfile(path):
            return super().send_head()
        size = os.path.getsize(path)
        start = int(match.group(1))
        end = min(int(match.group(2)) if match.group(2) else size - 1, size - 1)
        if start >= size or end < start:
            self.send_error(416, "range not satisfiable")
            return None
        f = open(path, "rb")
        f.seek(start)
        self.send_response(206)
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Content-Range", f"bytes {start}-{end}/{size}")
        self.send_header("Content-Length", str(end - start + 1))
        self.send_header("Accept-Ranges", "bytes")
        self.end_headers()
        self._remaining = end - start + 1
        return f

    def copyfile(self, source, outputfile) -> None:
        remaining = getattr(self, "_remaining", None)
        if remaining is None:
            return super().copyfile(source, outputfile)
        while remaining > 0:
            block = source.read(min(remaining, 1 << 20))
            if not block:
                break
            outputfile.write(block)
            remaining -= len(block)
        self._remaining = None


class HttpFileServer:
    """Serve `root` over HTTP on 127.0.0.1: `url` is the base URL of the folder."""

    def __init__(self, root: str | Path) -> None:
        handler = partial(_RangeHandler, directory=str(root))
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self._server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="slipstream-http", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()  # waits for serve_forever to return
        self._server.server_close()


class S3Server:
    """A moto S3 server on 127.0.0.1 with one bucket. `env` holds the variables that point
    botocore (and so s3fs) at it with dummy credentials; `upload` copies a folder into the bucket."""

    def __init__(self, bucket: str = "slipstream-bench") -> None:
        try:
            from moto.server import ThreadedMotoServer
        except ImportError:
            raise UserError("the S3 stand-in needs moto: pip install 'moto[server]'") from None
        import socket

        with socket.socket() as s:  # a free port: moto's server takes a fixed one
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        import logging

        logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's web server logs every request
        self._server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
        self._server.start()
        self.endpoint = f"http://127.0.0.1:{port}"
        self.bucket = bucket
        self.env = {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": "testing",
                    "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
        self._client().create_bucket(Bucket=bucket)

    def _client(self):
        import boto3

        return boto3.client("s3", endpoint_url=self.endpoint, aws_access_key_id="testing",
                            aws_secret_access_key="testing", region_name="us-east-1")

    def upload(self, folder: str | Path, prefix: str) -> str:
        """Copy every file of `folder` to s3://bucket/prefix/ and return that URL."""
        client = self._client()
        for path in sorted(Path(folder).iterdir()):
            if path.is_file():
                client.upload_file(str(path), self.bucket, f"{prefix}/{path.name}")  # network: the local server
        return f"s3://{self.bucket}/{prefix}"

    def close(self) -> None:
        self._server.stop()


def copy_folder(src: str | Path, dst: str | Path) -> Path:
    """A copy of a prepared folder to serve (the original stays untouched by the servers)."""
    dst = Path(dst)
    shutil.copytree(src, dst)
    return dst
