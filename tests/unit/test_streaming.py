"""data.streaming: StreamingTokenLoader and the streaming eval windows, read from a local
folder, a file:// URL and a moto S3 server started here; retries, checksums, the cache bound
and the errors for bad locations and missing credentials."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import socket
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from slipstream.config import Config
from slipstream.data import prepare_dataset
from slipstream.data import remote as remote_mod
from slipstream.data.eval_windows import EvalWindows
from slipstream.data.stream_cache import MARKER
from slipstream.data.streaming import StreamingEvalWindows, StreamingTokenLoader, open_stream, open_stream_url
from slipstream.errors import UserError

B, T = 4, 32


@pytest.fixture(autouse=True)
def _fast_backoff(monkeypatch):
    monkeypatch.setattr(remote_mod, "BACKOFF_S", 0.001)


@pytest.fixture(scope="module")
def corpus() -> Path:
    return Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py"


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    """~20k byte tokens in shards of 4000 (4 train shards, ~4k val tokens), without chunk
    fields: each shard is one chunk, checked by its sha256."""
    out = tmp_path_factory.mktemp("stream") / "plain"
    prepare_dataset([str(corpus)], "byte", str(out), val_fraction=0.2, shard_tokens=4000, num_workers=1, progress=False)
    m = json.loads((out / "manifest.json").read_text())
    m.pop("chunk_tokens", None)
    for info in m["splits"].values():
        for shard in info["shards"]:
            shard.pop("chunk_sha256", None)
    (out / "manifest.json").write_text(json.dumps(m))
    return out


@pytest.fixture(scope="module")
def chunked(corpus, tmp_path_factory) -> Path:
    """The same corpus prepared with chunks of 1000 tokens (chunk_sha256 per chunk)."""
    out = tmp_path_factory.mktemp("chunked") / "data"
    prepare_dataset([str(corpus)], "byte", str(out), val_fraction=0.2, shard_tokens=4000, num_workers=1,
                    progress=False, chunk_tokens=1000)
    assert json.loads((out / "manifest.json").read_text())["chunk_tokens"] == 1000
    return out


def chunked_copy(src: Path, dst: Path, chunk_tokens: int, mask=None, mask_chunks: bool = True) -> Path:
    """A copy of a prepared folder with per-chunk checksums of chunk_tokens and, with
    mask(tokens) -> bool array, loss-mask files (with per-chunk mask checksums or without)."""
    shutil.copytree(src, dst)
    m = json.loads((dst / "manifest.json").read_text())
    m["chunk_tokens"] = chunk_tokens
    for info in m["splits"].values():
        for shard in info["shards"]:
            data = (dst / shard["file"]).read_bytes()
            step = chunk_tokens * 2
            shard["chunk_sha256"] = [hashlib.sha256(data[i:i + step]).hexdigest() for i in range(0, len(data), step)]
            if mask is not None:
                bits = mask(np.frombuffer(data, dtype="<u2")).astype(np.uint8).tobytes()
                shard["mask_file"] = shard["file"].replace(".bin", ".mask")
                (dst / shard["mask_file"]).write_bytes(bits)
                shard["mask_sha256"] = hashlib.sha256(bits).hexdigest()
                if mask_chunks:
                    shard["mask_chunk_sha256"] = [hashlib.sha256(bits[i:i + chunk_tokens]).hexdigest()
                                                  for i in range(0, len(bits), chunk_tokens)]
    if mask is not None:
        m["loss_mask"] = True
    (dst / "manifest.json").write_text(json.dumps(m))
    return dst


def loader(url, tmp_path, **kw) -> StreamingTokenLoader:
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    kw.setdefault("seed", 3)
    return StreamingTokenLoader(str(url), "train", kw.pop("batch_size", B), kw.pop("seq_len", T), **kw)


def take(it, n):
    return [tuple(t.clone() for t in next(it)) for _ in range(n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for p, q in zip(a, b) for x, y in zip(p, q))


def chunk_files(folder: Path) -> dict[str, int]:
    """Chunk files and their sizes, temp files too; a temp file renamed while we list is skipped
    (the download threads run meanwhile)."""
    sizes = {}
    for p in folder.iterdir():
        if p.name.endswith(".chunk"):
            try:
                sizes[p.name] = p.stat().st_size
            except FileNotFoundError:
                continue
    return sizes


# -- order, determinism, resume


@pytest.mark.parametrize("kind", ["plain", "chunked"])
def test_same_seed_same_batches_from_a_folder_and_a_file_url(kind, prepared, chunked, tmp_path):
    data = prepared if kind == "plain" else chunked
    a = loader(data, tmp_path / "a")
    b = loader(f"file://{data}", tmp_path / "b")
    batches = take(a, 30)
    assert same(batches, take(b, 30))
    x, y = batches[0]
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (B, T)
    assert not same(take(loader(data, tmp_path / "c", seed=4), 30), batches)
    a.close(), b.close()


def test_windows_are_the_chunks_tokens_shifted_by_one(chunked, tmp_path):
    stream = loader(chunked, tmp_path)
    tokens = np.concatenate([np.fromfile(chunked / s["file"], dtype="<u2")
                             for s in json.loads((chunked / "manifest.json").read_text())["splits"]["train"]["shards"]])
    text = tokens.astype(np.int64).tobytes()
    for x, y in take(stream, 5):
        assert torch.equal(x[:, 1:], y[:, :-1])
        for row in torch.cat([x, y[:, -1:]], 1):
            assert row.numpy().tobytes() in text  # a real window of the split
    stream.close()


def test_ranks_read_disjoint_chunks_covering_the_epoch(chunked, tmp_path):
    ranks = [loader(chunked, tmp_path, rank=r, world_size=2, readahead=0, cache_bytes=1 << 22) for r in range(2)]
    n = len(ranks[0].chunks)
    mine = [set(r._plan(0)[0].tolist()) for r in ranks]
    assert not mine[0] & mine[1] and len(mine[0] | mine[1]) >= n - 1  # leftovers only at the ragged end
    per_rank = ranks[0]._plan(0)[2]
    assert per_rank == ranks[1]._plan(0)[2]
    for r in ranks:
        take(r, per_rank // B)
        r.close()
    files = [set(chunk_files(Path(r.cache.folder))) for r in ranks]
    assert files[0] and ranks[0].cache.folder != ranks[1].cache.folder
    assert files[0] and files[1] and not files[0] & files[1]  # each rank downloaded only its own chunks


def test_resume_mid_epoch_and_across_the_epoch_boundary(chunked, tmp_path):
    bs = 3
    straight = loader(chunked, tmp_path / "s", batch_size=bs)
    per_epoch = straight._plan(0)[2]
    assert per_epoch % bs  # one batch spans the epoch boundary
    boundary = per_epoch // bs
    batches = take(straight, boundary + 8)
    for at in (3, boundary, boundary + 1):
        first = loader(chunked, tmp_path / f"r{at}", batch_size=bs)
        take(first, at)
        state = json.loads(json.dumps(first.state_dict()))  # as a checkpoint stores it
        first.close()
        resumed = loader(chunked, tmp_path / f"n{at}", batch_size=bs)
        resumed.load_state_dict(state)
        assert same(take(resumed, 5), batches[at:at + 5]), at
        resumed.close()
    state = straight.state_dict()
    assert state["epoch"] == 1 and {"shard", "chunk_offset", "window", "batch_index"} <= set(state)
    straight.close()


def test_resume_refuses_another_world_size_or_seed(chunked, tmp_path):
    state = loader(chunked, tmp_path, world_size=2).state_dict()
    with pytest.raises(UserError, match="same number of data-parallel ranks"):
        loader(chunked, tmp_path).load_state_dict(state)
    with pytest.raises(UserError, match="seed"):
        loader(chunked, tmp_path, rank=1, world_size=2, seed=9).load_state_dict(state)


def test_a_rank_without_a_chunk_is_a_clear_error(prepared, tmp_path):
    with pytest.raises(UserError, match=r"4 chunk\(s\).*8 data-parallel ranks.*--chunk-tokens"):
        loader(prepared, tmp_path, rank=0, world_size=8)


# -- the cache


def test_the_cache_stays_under_its_bound_and_deletes_only_its_files(chunked, tmp_path):
    cap = 3 * 2000 + 100  # three chunks of 1000 uint16 tokens: the one read and two ahead
    stream = loader(chunked, tmp_path, cache_bytes=cap, readahead=2, threads=2)
    folder = stream.cache.folder
    Path(folder, "notes.txt").write_text("mine")
    Path(folder, "other.bin").write_bytes(b"x" * 10)
    per_epoch = stream._plan(0)[2]
    for _ in range(2 * per_epoch // B):
        next(stream)
        with stream.cache._lock:  # no eviction while counting (downloads in flight write reserved bytes only)
            assert sum(chunk_files(Path(folder)).values()) <= cap
    stream.close()
    assert stream.cache.downloads > 3  # chunks were evicted and fetched again in epoch 2
    assert Path(folder, "notes.txt").read_text() == "mine" and Path(folder, "other.bin").exists()
    assert Path(folder, MARKER).exists()
    with pytest.raises(UserError, match="readahead"):
        loader(chunked, tmp_path, cache_bytes=2 * 2000, readahead=2)


def test_a_folder_not_made_by_the_cache_is_refused(chunked, tmp_path):
    foreign = tmp_path / "cache"
    foreign.mkdir()
    stream = loader(chunked, tmp_path)  # makes cache/<hash>/ with its marker
    stream.close()
    sub = Path(stream.cache.folder)
    shutil.rmtree(sub)
    sub.mkdir()
    (sub / "precious.txt").write_text("keep")
    with pytest.raises(UserError, match="not made by slipstream"):
        loader(chunked, tmp_path)
    assert (sub / "precious.txt").read_text() == "keep"


# -- remote errors


class FlakyFS:
    """An fsspec filesystem whose reads fail `fails` times with a connection reset first."""

    def __init__(self, fs, fails: int, error=ConnectionResetError) -> None:
        self.fs, self.fails, self.calls, self.error = fs, fails, 0, error

    def cat_file(self, *args, **kw):
        self.calls += 1
        if self.calls <= self.fails:
            raise self.error(104, "Connection reset by peer")
        return self.fs.cat_file(*args, **kw)

    def size(self, path):
        return self.fs.size(path)


@pytest.mark.parametrize("error", [ConnectionResetError, ConnectionRefusedError])
def test_transient_errors_are_retried_then_reported(chunked, tmp_path, error):
    reference = take(loader(chunked, tmp_path / "ref"), 3)
    stream = loader(chunked, tmp_path / "a", retries=4, threads=1, readahead=0)
    flaky = FlakyFS(stream.remote.fs, fails=3, error=error)  # mid-run: the host answered before
    stream.remote.fs = flaky
    assert same(take(stream, 3), reference)
    assert flaky.calls >= 4
    stream.close()
    broken = loader(chunked, tmp_path / "b", retries=3, threads=1, readahead=0)
    broken.remote.fs = FlakyFS(broken.remote.fs, fails=10**6, error=TimeoutError)
    with pytest.raises(UserError, match=r"train_\d+\.bin failed 3 time\(s\) with transient errors.*data.retries"):
        next(broken)
    broken.close()


def test_errors_that_retrying_cannot_fix_fail_at_once(chunked, tmp_path):
    stream = loader(chunked, tmp_path, retries=5, threads=1, readahead=0)
    flaky = FlakyFS(stream.remote.fs, fails=10**6, error=lambda *a: PermissionError(13, "Access Denied"))
    stream.remote.fs = flaky
    with pytest.raises(UserError, match="access denied reading"):
        next(stream)
    assert flaky.calls == 1
    stream.close()


def test_a_shard_changed_after_its_manifest_is_a_checksum_error(chunked, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(chunked, data)
    stream = loader(data, tmp_path)
    shard = data / "train_000000.bin"
    raw = bytearray(shard.read_bytes())
    raw[10:20] = bytes(reversed(raw[10:20]))  # same size, other bytes: the size check cannot see it
    shard.write_bytes(bytes(raw))
    with pytest.raises(UserError, match=r"train_000000.bin changed since its manifest was written: chunk 0"):
        for _ in range(stream._plan(0)[2] // B + 1):
            next(stream)
    stream.close()


def test_missing_data_and_bad_manifests(chunked, tmp_path):
    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, streaming=True, cache_dir=str(tmp_path / "c")))
    with pytest.raises(UserError, match="no prepared data at .*nowhere"):
        open_stream_url(str(tmp_path / "nowhere"), cfg, True)
    with pytest.raises(UserError, match="needs data.dir"):
        open_stream(cfg, True)
    bad = tmp_path / "bad"
    shutil.copytree(chunked, bad)
    m = json.loads((bad / "manifest.json").read_text())
    m["splits"]["train"]["shards"][0]["chunk_sha256"] = m["splits"]["train"]["shards"][0]["chunk_sha256"][:1]
    (bad / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(UserError, match="chunk_sha256 entries"):
        open_stream_url(str(bad), cfg, True)
    short = tmp_path / "short"
    shutil.copytree(chunked, short)
    (short / "train_000001.bin").write_bytes(b"\0" * 10)
    with pytest.raises(UserError, match="train_000001.bin has 10 bytes, its manifest says"):
        open_stream_url(str(short), cfg, True)


def with_bpe_tokenizer(data: Path, cache_dir: Path) -> Config:
    """Give the prepared folder a (dummy) bpe tokenizer file in its manifest; return a streaming
    config reading it through cache_dir."""
    (data / "tokenizer.json").write_text('{"model": {}}')
    m = json.loads((data / "manifest.json").read_text())
    m["tokenizer_file"] = "tokenizer.json"
    (data / "manifest.json").write_text(json.dumps(m))
    cfg = Config()
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, streaming=True, dir=str(data),
                                                             cache_dir=str(cache_dir)))


def test_open_stream_copies_a_bpe_tokenizer_into_the_cache(chunked, tmp_path):
    data = tmp_path / "data"
    shutil.copytree(chunked, data)
    cfg = with_bpe_tokenizer(data, tmp_path / "c")
    opened = open_stream(cfg, True)
    assert opened.location == str(data) and opened.local_dir is None
    assert opened.tokenizer.startswith("bpe:" + str(tmp_path / "c"))
    assert Path(opened.tokenizer[4:]).read_text() == '{"model": {}}'


# -- loss mask and eval windows


@pytest.mark.parametrize("mask_chunks", [True, False])
def test_a_loss_mask_turns_masked_targets_into_minus_100(prepared, tmp_path, mask_chunks):
    space = ord(" ")
    masked = chunked_copy(prepared, tmp_path / "masked", 1000, mask=lambda t: t != space, mask_chunks=mask_chunks)
    plain = chunked_copy(prepared, tmp_path / "plain", 1000)
    got, want = take(loader(masked, tmp_path / "m"), 6), take(loader(plain, tmp_path / "p"), 6)
    for (x, y), (x0, y0) in zip(got, want):
        assert torch.equal(x, x0)
        assert torch.equal(y, torch.where(y0 == space, torch.full_like(y0, -100), y0))
    assert any((y == -100).any() for _, y in got)
    local = EvalWindows(str(masked), "val", B, T, 10**6)
    stream = StreamingEvalWindows(str(masked), "val", B, T, 10**6, cache_dir=str(tmp_path / "c"))
    for ((x, y), w), ((x0, y0), w0) in zip(stream, local):
        assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(w, w0)
    assert (y == -100).any()


@pytest.mark.parametrize("world", [1, 2])
def test_eval_windows_equal_the_local_ones(prepared, tmp_path, world):
    for rank in range(world):
        local = EvalWindows(str(prepared), "val", B, T, 1500, rank=rank, world_size=world)
        stream = StreamingEvalWindows(f"file://{prepared}", "val", B, T, 1500, rank=rank, world_size=world,
                                      cache_dir=str(tmp_path / "c"))
        assert isinstance(stream, EvalWindows)
        assert (len(stream), stream.tokens, stream.sampled, stream.n_windows) == (
            len(local), local.tokens, local.sampled, local.n_windows)
        for _ in range(2):  # the second pass reads the cached windows
            for ((x, y), w), ((x0, y0), w0) in zip(stream, local):
                assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(w, w0)


# -- S3 (moto server)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3(chunked, prepared):
    """A moto S3 server with the chunked folder at s3://stream-test/chunked and the plain one at .../plain."""
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    saved = dict(os.environ)
    os.environ.update(AWS_ACCESS_KEY_ID="testing", AWS_SECRET_ACCESS_KEY="testing", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}", AWS_EC2_METADATA_DISABLED="true")
    import boto3
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    client = boto3.client("s3")
    client.create_bucket(Bucket="stream-test")
    for name, folder in (("chunked", chunked), ("plain", prepared)):
        for f in folder.iterdir():
            client.upload_file(str(f), "stream-test", f"{name}/{f.name}")
    yield port
    os.environ.clear()
    os.environ.update(saved)
    s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def test_s3_batches_equal_the_local_ones(s3, chunked, tmp_path):
    local = take(loader(chunked, tmp_path / "l", world_size=2, rank=1), 12)
    remote = loader("s3://stream-test/chunked", tmp_path / "r", world_size=2, rank=1)
    assert same(take(remote, 12), local)
    remote.close()
    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, streaming=True, dir="s3://stream-test/plain/",
                                                            cache_dir=str(tmp_path / "c")))
    opened = open_stream(cfg, check=True)
    assert opened.manifest["splits"]["train"]["tokens"] > 0 and opened.tokenizer == "byte"


def test_s3_object_overwritten_after_its_manifest(s3, chunked, tmp_path):
    import boto3

    client = boto3.client("s3")
    for f in chunked.iterdir():
        client.upload_file(str(f), "stream-test", f"changed/{f.name}")
    stream = loader("s3://stream-test/changed", tmp_path, readahead=0, threads=1)
    raw = bytearray((chunked / "train_000002.bin").read_bytes())
    raw[0:4] = raw[4:8]
    client.put_object(Bucket="stream-test", Key="changed/train_000002.bin", Body=bytes(raw))
    with pytest.raises(UserError, match=r"s3://stream-test/changed/train_000002.bin changed since its manifest"):
        for _ in range(stream._plan(0)[2] // B + 1):
            next(stream)
    stream.close()


def test_s3_unreachable_endpoint_and_missing_credentials(s3, tmp_path, monkeypatch):
    import s3fs

    cfg = Config()
    cfg = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, streaming=True, cache_dir=str(tmp_path / "c")))
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_free_port()}")  # nothing listens there
    with pytest.raises(UserError, match=r"cannot reach s3://stream-test/plain/manifest.json .*AWS_ENDPOINT_URL=http"):
        open_stream_url("s3://stream-test/plain", cfg, True)
    s3fs.S3FileSystem.clear_instance_cache()
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{s3}")
    for var in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(UserError, match="no credentials to read s3://stream-test/plain/manifest.json.*AWS_ACCESS_KEY_ID"):
        open_stream_url("s3://stream-test/plain", cfg, True)
    s3fs.S3FileSystem.clear_instance_cache()
    with pytest.raises(UserError, match="s3://stream-test/nothing-here .*no manifest.json"):
        monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
        monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
        open_stream_url("s3://stream-test/nothing-here", cfg, True)
    s3fs.S3FileSystem.clear_instance_cache()


def test_which_errors_are_transient():
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError, ReadTimeoutError

    def client_error(code, status):
        return ClientError({"Error": {"Code": code, "Message": code}, "ResponseMetadata": {"HTTPStatusCode": status}},
                           "GetObject")

    class HTTPStatus(Exception):
        def __init__(self, status):
            self.status = status

    translated = OSError(16, "SlowDown")  # s3fs turns a throttling ClientError into this
    translated.__cause__ = client_error("SlowDown", 503)
    for e in (ConnectionResetError(104, "reset"), TimeoutError(), client_error("InternalError", 500),
              client_error("SlowDown", 503), translated, HTTPStatus(502), HTTPStatus(429),
              EndpointConnectionError(endpoint_url="http://x"), ReadTimeoutError(endpoint_url="http://x")):
        assert remote_mod.is_transient(e), e
    for e in (FileNotFoundError("x"), PermissionError("x"), client_error("AccessDenied", 403), HTTPStatus(404),
              NoCredentialsError(), ValueError("bad url")):
        assert not remote_mod.is_transient(e), e


def test_processes_of_one_model_parallel_group_get_their_own_cache_folders(chunked, tmp_path, monkeypatch):
    """tp / pp ranks share a data-parallel rank and read the same batches, but never one cache folder
    (one would evict the chunks the other reads)."""
    folders, batches = [], []
    for local in ("0", "1"):
        monkeypatch.setenv("LOCAL_RANK", local)
        stream = loader(chunked, tmp_path, rank=1, world_size=2)
        batches.append(take(stream, 4))
        folders.append(stream.cache.folder)
        stream.close()
    assert folders[0] != folders[1] and same(*batches)


def test_a_plain_http_server_without_range_support(chunked, tmp_path, capsys):
    """http(s):// through fsspec; Python's http.server ignores Range and sends whole files
    (said once: every chunk read then downloads its whole shard)."""
    import functools
    import threading
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    class Quiet(SimpleHTTPRequestHandler):
        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(chunked)))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_port}"
        assert same(take(loader(url, tmp_path / "h", readahead=1), 8), take(loader(chunked, tmp_path / "l"), 8))
        local = EvalWindows(str(chunked), "val", B, T, 1500)
        stream = StreamingEvalWindows(url, "val", B, T, 1500, cache_dir=str(tmp_path / "c"))
        for ((x, y), w), ((x0, y0), w0) in zip(stream, local):
            assert torch.equal(x, x0) and torch.equal(y, y0) and torch.equal(w, w0)
        err = capsys.readouterr().err
        assert err.count("ignores byte-range requests") == 2  # once per Remote (the loader's, the windows')
        assert f"{url}/train_" in err and "Range" in err
    finally:
        server.shutdown()
