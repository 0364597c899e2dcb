"""data.streaming, continued: concurrent users of one cache folder, close, retry policy and
backoff, damaged cache files, bounded eval reads, a full disk, read-ahead, and the cache
root's marker. The corpora, fixtures and helpers are test_streaming.py's."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
import torch

from slipstream.data import remote as remote_mod
from slipstream.data.stream_cache import MARKER
from slipstream.data.eval_windows import EvalWindows
from slipstream.data.streaming import StreamingEvalWindows, open_stream
from slipstream.errors import UserError
from test_streaming import (B, T, _fast_backoff, chunk_files, chunked, corpus, loader, prepared,  # noqa: F401 (fixtures)
                            same, take, with_bpe_tokenizer)

# -- review: concurrent users of one cache folder, close, retries, eval reads


def test_two_live_loaders_never_share_a_cache_folder(chunked, tmp_path):
    """Two jobs on one machine streaming the same URL (or ranks of one model-parallel group on
    two nodes with a shared home folder) have the same rank and LOCAL_RANK: one folder would
    let each evict the chunks the other reads and delete its downloads in flight."""
    a = loader(chunked, tmp_path, readahead=1)
    take(a, 2)
    in_flight = Path(a.cache.folder) / ".tmp-99999-1-abc.chunk"  # a's download under way
    in_flight.write_bytes(b"x")
    b = loader(chunked, tmp_path, readahead=1)
    assert a.cache.folder != b.cache.folder
    assert in_flight.exists()  # b's start-up cleaning left a's folder alone
    assert same(take(b, 2), take(loader(chunked, tmp_path / "ref"), 2))
    b.close()
    folder = a.cache.folder
    a.close()
    again = loader(chunked, tmp_path)  # a restarted job finds its folder (and its chunks) again
    assert again.cache.folder == folder
    again.close()


class SlowFS:
    """Reads that take `delay` seconds each, counted."""

    def __init__(self, fs, delay: float) -> None:
        self.fs, self.delay, self.calls = fs, delay, 0

    def cat_file(self, *args, **kw):
        import time

        self.calls += 1
        time.sleep(self.delay)
        return self.fs.cat_file(*args, **kw)

    def size(self, path):
        return self.fs.size(path)


def test_close_does_not_wait_for_queued_read_ahead(chunked, tmp_path):
    import time

    stream = loader(chunked, tmp_path, readahead=4, threads=1, cache_bytes=1 << 22)
    slow = SlowFS(stream.remote.fs, 0.3)
    stream.remote.fs = slow
    next(stream)  # the first chunk; four more queued behind one thread
    started = time.monotonic()
    calls, threads = slow.calls, list(stream.cache._threads)
    stream.close()
    assert time.monotonic() - started < 0.9  # at most the download in flight, not all four
    assert slow.calls <= calls + 1
    assert threads and not [t for t in threads if t.is_alive()]


def test_client_errors_are_not_retried_even_when_wrapped():
    """s3fs turns an S3 error code it does not know into OSError(EIO) with the ClientError as
    its cause; gcsfs raises HttpError for every status: a 4xx (bar 408 / 429 / RequestTimeout)
    is the request's fault and fails at once."""
    from botocore.exceptions import ClientError

    def client_error(code, status):
        return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")

    class HttpError(Exception):  # gcsfs.retry.HttpError's shape: a code attribute
        def __init__(self, code):
            self.code = code

    def wrapped(cause):
        e = OSError(5, "Input/output error")
        e.__cause__ = cause
        return e

    for e in (wrapped(client_error("InvalidObjectState", 403)), wrapped(client_error("SomethingNew", 400)),
              HttpError(400), HttpError(416)):
        assert not remote_mod.is_transient(e), e
    for e in (wrapped(client_error("SomethingNew", 503)), wrapped(client_error("RequestTimeout", 400)),
              HttpError(503), HttpError(429), HttpError(408), wrapped(ConnectionResetError(104, "reset"))):
        assert remote_mod.is_transient(e), e


def test_backoff_is_capped(monkeypatch, tmp_path):
    """data.retries = 30 must give up within minutes, not wait 0.5 s x 2^29 before the last try."""
    waits = []
    monkeypatch.setattr(remote_mod, "BACKOFF_S", 0.5)
    monkeypatch.setattr(remote_mod.time, "sleep", waits.append)
    r = remote_mod.Remote(str(tmp_path), retries=30)
    with pytest.raises(UserError, match="failed 30 time"):
        r.call("x", "reading", lambda: (_ for _ in ()).throw(ConnectionResetError(104, "reset")))
    assert len(waits) == 29 and max(waits) <= remote_mod.MAX_BACKOFF_S and sum(waits) < 30 * 60
    assert waits[:4] == [0.5, 1.0, 2.0, 4.0]  # backing off: each wait twice the last


def test_a_damaged_chunk_file_in_the_cache_is_fetched_again(chunked, tmp_path):
    """A chunk file cut short on this disk (a crash after the rename reached the disk but
    before the data did) is not trusted: it is downloaded again, not read as a short chunk."""
    reference = take(loader(chunked, tmp_path / "ref"), 3)
    first = loader(chunked, tmp_path, readahead=0)
    take(first, 1)
    folder = Path(first.cache.folder)
    first.close()
    for p in folder.iterdir():
        if p.name.endswith(".chunk"):
            p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])
    again = loader(chunked, tmp_path, readahead=0)
    assert same(take(again, 3), reference)
    again.close()


class CountingFS:
    """Records the size of every byte range read."""

    def __init__(self, fs) -> None:
        self.fs, self.reads = fs, []

    def cat_file(self, path, start=None, end=None, **kw):
        data = self.fs.cat_file(path, start=start, end=end, **kw)
        self.reads.append(len(data))
        return data

    def size(self, path):
        return self.fs.size(path)


def test_eval_windows_read_in_bounded_requests(prepared, tmp_path, monkeypatch):
    """Nearby windows are read as one request, but one request never grows past
    MAX_RANGE_BYTES: sampled windows a little apart over a large val split used to be read
    as the whole split, held in memory at once."""
    monkeypatch.setattr(StreamingEvalWindows, "MAX_RANGE_BYTES", 512, raising=False)
    local = EvalWindows(str(prepared), "val", B, T, 600)
    stream = StreamingEvalWindows(str(prepared), "val", B, T, 600, cache_dir=str(tmp_path / "c"))
    assert stream.sampled
    counting = CountingFS(stream.remote.fs)
    stream.remote.fs = counting
    for ((x, y), w), ((x0, y0), w0) in zip(stream, local):
        assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(w, w0)
    assert counting.reads and max(counting.reads) <= 512


def test_a_full_cache_disk_is_named_with_the_fix(chunked, tmp_path, monkeypatch):
    from slipstream.data import stream_cache

    def full(fd):
        raise OSError(28, "No space left on device")

    stream = loader(chunked, tmp_path, readahead=0, threads=1)
    monkeypatch.setattr(stream_cache.os, "fsync", full)
    with pytest.raises(UserError, match=r"cannot write .* to the streaming cache .*No space left.*data.cache_dir"):
        next(stream)
    stream.close()
    assert not [p for p in Path(stream.cache.folder).iterdir() if p.name.startswith(".tmp-")]


def test_read_ahead_downloads_the_next_chunks_in_the_background(chunked, tmp_path):
    """data.readahead is not ignored: after the first batch, the next chunks of this rank's
    order arrive without another batch being asked for."""
    import time

    stream = loader(chunked, tmp_path, readahead=2, threads=2, cache_bytes=1 << 22)
    next(stream)
    want = {c.name for c in stream._upcoming(0, 0)}
    assert len(want) == 3
    deadline = time.monotonic() + 10
    while not want <= set(chunk_files(Path(stream.cache.folder))):
        assert time.monotonic() < deadline, "read-ahead chunks never arrived"
        time.sleep(0.01)
    assert stream.cache.downloads == 3
    stream.close()
    none = loader(chunked, tmp_path / "none", readahead=0)
    next(none)
    time.sleep(0.2)
    assert none.cache.downloads == 1
    none.close()


def test_the_cache_root_is_marked_before_any_folder_in_it(chunked, tmp_path):
    """A loader's folder is made inside the URL's cache root; the root must carry the marker
    too, or a later process that writes the tokenizer there (another node's first process,
    data re-uploaded with a tokenizer file) finds an unmarked, non-empty folder and stops."""
    data = tmp_path / "data"
    shutil.copytree(chunked, data)
    stream = loader(data, tmp_path)
    take(stream, 1)
    stream.close()
    root = Path(stream.cache.folder).parent
    assert (root / MARKER).is_file()
    cfg = with_bpe_tokenizer(data, tmp_path / "cache")
    assert open_stream(cfg, False).tokenizer.startswith(f"bpe:{root}")


def test_marking_a_folder_leaves_no_unmarked_moment(tmp_path, monkeypatch):
    """Two processes preparing one folder at once: the second never sees a non-empty folder
    without the marker (the marker was written under a temporary name, then renamed)."""
    from slipstream.data import stream_cache

    seen = []
    folder = tmp_path / "f"
    real_open, real_replace = os.open, os.replace

    def look():
        seen.append(os.listdir(folder) if folder.is_dir() else [])

    monkeypatch.setattr(stream_cache.os, "replace", lambda *a, **k: (look(), real_replace(*a, **k))[1])
    monkeypatch.setattr(stream_cache.os, "open", lambda *a, **k: (look(), real_open(*a, **k))[1])
    stream_cache.prepare_folder(str(folder))
    monkeypatch.undo()
    assert (folder / MARKER).is_file()
    assert all(MARKER in names or not names for names in seen), seen


def test_an_error_retrying_cannot_fix_names_the_file_and_what_to_check(tmp_path):
    r = remote_mod.Remote("s3://bucket/prefix", retries=3)
    bad = OSError(5, "Bad Request")
    bad.__cause__ = type("ClientError", (Exception,), {"response": {"ResponseMetadata": {"HTTPStatusCode": 400}}})()
    calls = []

    def fn():
        calls.append(1)
        raise bad

    with pytest.raises(UserError, match=r"reading s3://bucket/prefix/x failed \(HTTP 400\): OSError.*Bad Request; "
                                        r"retrying would not help: check "):
        r.call("x", "reading", fn)
    assert len(calls) == 1
